"""Model card and Hub upload of a finished run folder (from the job, or later from a login node)."""

from pathlib import Path

from .metrics import PLOT_FILE, read_metrics

# Recipe values a reader of the card needs to reproduce or judge the run.
CARD_FIELDS = [
    "loss_type",
    "beta",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "num_train_epochs",
    "max_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "weight_decay",
    "max_grad_norm",
    "bf16",
    "seed",
]
FINAL_METRICS = ["loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"]
# Never uploaded: resumable state and local tracking files.
IGNORE = ["checkpoint-*", "checkpoint-*/**", "wandb/**", "*.lock", ".wandb_run_id"]


def model_card(resolved: dict, records: list[dict]) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    base, dataset = resolved.get("model_name_or_path"), resolved.get("dataset_name")
    data = ModelCardData(
        base_model=base if base and not base.startswith("builtin:") else None,
        datasets=[dataset] if dataset and "/" in dataset and not Path(dataset).exists() else None,
        library_name="transformers",
        tags=["dpo", "trl", "olmo3-recipe"],
    )
    derived = resolved.get("derived", {})
    recipe_rows = "\n".join(f"| `{k}` | {resolved.get(k)} |" for k in CARD_FIELDS)
    recipe_rows += f"\n| pairs per optimizer step | {derived.get('pairs_per_step')} |"
    last = records[-1] if records else {}
    metric_rows = "\n".join(f"| `{k}` | {last[k]:.4f} |" for k in FINAL_METRICS if k in last) or "| (none logged) | |"
    content = f"""---
{data.to_yaml()}
---

# {resolved.get("run_name")}

DPO post-training of `{base}` on `{dataset}` with OLMo 3's length-normalized DPO recipe, trained with TRL's
`DPOTrainer` (config `{resolved.get("config")}`).

## Recipe

| field | value |
|---|---|
{recipe_rows}

## Final metrics (step {last.get("step", "-")})

| metric | value |
|---|---|
{metric_rows}

![training curves]({PLOT_FILE})
"""
    return str(ModelCard(content))


def write_model_card(output_dir: str | Path, resolved: dict) -> Path:
    path = Path(output_dir) / "README.md"
    path.write_text(model_card(resolved, read_metrics(output_dir)))
    return path


def push_run(output_dir: str | Path, repo_id: str, token: str | None = None, private: bool | None = None) -> str:
    """Upload the final model, tokenizer, card, plot and metrics of `output_dir` to `repo_id`; returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(
        repo_id=repo_id, folder_path=str(output_dir), ignore_patterns=IGNORE, commit_message="Upload DPO run"
    )
    return f"https://huggingface.co/{repo_id}"

"""Model card and Hub upload of a finished run folder (from the job, or later from a login node)."""

import json
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
# rewards/* are TRL's (beta x summed log-ratio); rewards_norm/* are on the loss's scale (beta x log-ratio per token).
FINAL_METRICS = [
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "rewards_norm/accuracies",
    "rewards_norm/margins",
    "rewards_norm/chosen",
    "rewards_norm/rejected",
    "tokens_per_second",
]
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


# --- pushing later, from a login node ---------------------------------------------------------------------------------


def run_folder_problems(output_dir: str | Path) -> list[str]:
    """What keeps `output_dir` from being a finished run worth pushing; [] when it is one."""
    from .offline import TOKENIZER_VOCAB
    from .resolve import RUN_COMPLETE

    out = Path(output_dir)
    if not out.is_dir():
        return ["the folder itself"]
    problems = []
    if not (out / RUN_COMPLETE).is_file():
        problems.append(f"{RUN_COMPLETE} (training has not finished: resume it with the same command)")
    problems += [f for f in ("config.json", "tokenizer_config.json") if not (out / f).is_file()]
    index = out / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        problems += [s for s in shards if not (out / s).is_file()]
    elif not (out / "model.safetensors").is_file():
        problems.append("model.safetensors")
    if not any((out / f).is_file() for f in TOKENIZER_VOCAB):
        problems.append("tokenizer.json")
    problems += [f for f in ("README.md", PLOT_FILE) if not (out / f).is_file()]
    return problems


def write_access_problem(whoami: dict, repo_id: str) -> str | None:
    """Why the account and token described by `whoami` (HfApi.whoami's answer) cannot push to `repo_id`, or None.

    Judged from the answer alone: the namespace must be the user or one of their organizations with a role above
    `read`; a read token never writes; a fine-grained token needs `repo.write` on that namespace or on the repo. An
    existing repo can still refuse a `contributor` (it writes only to its own repos): `check_write_access` asks.
    """
    user = whoami.get("name")
    namespace, _, name = repo_id.rpartition("/")
    namespace = namespace or user
    token = (whoami.get("auth") or {}).get("accessToken") or {}
    label = f"the Hugging Face token {token['displayName']!r}" if token.get("displayName") else "the Hugging Face token"
    if token.get("role") == "read":
        return (
            f"{label} is read-only, so it cannot push to {repo_id}: create a write or fine-grained token at "
            "https://huggingface.co/settings/tokens and set HF_TOKEN in .env"
        )
    if namespace != user:
        orgs = {o.get("name"): o.get("roleInOrg") for o in whoami.get("orgs") or []}
        if namespace not in orgs:
            return (
                f"{user!r} cannot create {repo_id}: {namespace!r} is neither the token's user nor one of its "
                f"organizations ({', '.join(sorted(orgs)) or 'none'}); use --hub_model_id {user}/{name}, or join "
                f"{namespace!r}"
            )
        if orgs[namespace] == "read":
            return (
                f"{user!r} has the read role in {namespace!r}, so it cannot push to {repo_id}: ask an admin of "
                f"{namespace!r} for write access, or use --hub_model_id {user}/{name}"
            )
    if token.get("role") == "fineGrained":
        scoped = (token.get("fineGrained") or {}).get("scoped") or []
        if not any(
            "repo.write" in s.get("permissions", []) and (s.get("entity") or {}).get("name") in (namespace, repo_id)
            for s in scoped
        ):
            return (
                f"{label} is fine-grained without write access to repos of {namespace!r}: give it "
                "'Write access to contents/settings of all repos' there at https://huggingface.co/settings/tokens"
            )
    return None


def check_write_access(repo_id: str, token: str | None) -> None:
    """Refuse at job start a push that would fail after training: `token` must be able to write to `repo_id`.

    Asks the Hub (whoami, then the repo's write auth-check), so it is for real runs only. With HF_HUB_OFFLINE set it
    says that it skipped the check and returns: the push then happens later, from a login node.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    from .errors import ConfigError
    from .offline import is_offline

    if is_offline():
        print(
            f"Skipped checking write access to {repo_id}: HF_HUB_OFFLINE is set. Push from a login node after the "
            "run: python scripts/push_to_hub.py <output_dir>",
            flush=True,
        )
        return
    token = token or get_token()
    if not token:
        raise ConfigError(
            f"pushing to {repo_id} needs a Hugging Face token: add HF_TOKEN=... to .env or run `hf auth login`"
        )
    api = HfApi(token=token)
    try:
        whoami = _within(30, api.whoami)
    except HfHubHTTPError as e:
        if _status(e) == 401:
            raise ConfigError(
                "the Hugging Face token is invalid or expired: create one at https://huggingface.co/settings/tokens "
                "and set HF_TOKEN in .env"
            ) from None
        raise ConfigError(f"could not check write access to {repo_id}: {_cause(e)}") from None
    except Exception as e:  # no route, DNS, proxy, timeout: the node cannot reach the Hub
        raise ConfigError(
            f"could not reach the Hugging Face Hub to check write access to {repo_id} ({_cause(e)}). Compute nodes "
            "without network: set HF_HUB_OFFLINE=1 and push afterwards with scripts/push_to_hub.py"
        ) from None
    problem = write_access_problem(whoami, repo_id)
    if problem:
        raise ConfigError(problem)
    try:
        _within(30, lambda: api.auth_check(repo_id, write=True))
    except RepositoryNotFoundError:
        return  # not created yet: push_run creates it, in a namespace this token may write to
    except HfHubHTTPError as e:
        if _status(e) == 403:
            raise ConfigError(
                f"{whoami.get('name')!r} cannot write to the existing repo {repo_id}: ask its owners for write "
                "access, or push to another --hub_model_id"
            ) from None
        raise ConfigError(f"could not check write access to {repo_id}: {_cause(e)}") from None
    except Exception as e:
        raise ConfigError(
            f"could not reach the Hugging Face Hub to check write access to {repo_id} ({_cause(e)})"
        ) from None


def _status(error) -> int | None:
    return getattr(getattr(error, "response", None), "status_code", None)


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


def _within(seconds: float, fn):
    """fn() with a deadline. huggingface_hub's HTTP client has no timeout (utils/_http.py: `timeout=None`), and on a
    node whose firewall drops packets a call would hang the job, GPUs allocated, instead of failing it."""
    import threading

    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)  # daemon: a hung call must not keep the process alive
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]

"""The model card pushed with a run names its base model, data set, recipe values and final metrics."""

from dpotrain.hub import model_card


def test_model_card_names_base_dataset_recipe_and_final_metrics():
    resolved = {
        "run_name": "think-dpo", "config": "configs/think.yaml", "model_name_or_path": "org/sft-7b",
        "dataset_name": "allenai/Dolci-Think-DPO-7B", "loss_type": ["sigmoid_norm"], "beta": 5.0,
        "learning_rate": 1e-6, "lr_scheduler_type": "linear", "warmup_steps": 0.1, "num_train_epochs": 1,
        "max_length": 8192, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
        "derived": {"pairs_per_step": 128},
    }  # fmt: skip
    records = [{"step": 1, "loss": 0.6931}, {"step": 1170, "loss": 0.41, "rewards/accuracies": 0.72}]
    card = model_card(resolved, records)
    assert "base_model: org/sft-7b" in card and "- allenai/Dolci-Think-DPO-7B" in card  # Hub metadata
    assert "| `beta` | 5.0 |" in card and "| `loss_type` | ['sigmoid_norm'] |" in card
    assert "| `learning_rate` | 1e-06 |" in card and "| pairs per optimizer step | 128 |" in card
    assert "## Final metrics (step 1170)" in card
    assert "| `loss` | 0.4100 |" in card and "| `rewards/accuracies` | 0.7200 |" in card
    assert "![training curves](training_curves.png)" in card


def test_local_model_and_data_are_not_claimed_as_hub_repos(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("")
    card = model_card({"model_name_or_path": "builtin:tiny-olmo3", "dataset_name": str(data)}, [])
    assert "base_model" not in card and "datasets" not in card
    assert "(none logged)" in card


def test_model_card_lists_the_loss_scale_rewards_when_logged():
    records = [
        {"step": 5, "loss": 0.5, "rewards/margins": 210.0, "rewards_norm/margins": 1.25, "tokens_per_second": 9e3}
    ]
    card = model_card({"run_name": "r"}, records)
    assert "| `rewards_norm/margins` | 1.2500 |" in card and "| `rewards/margins` | 210.0000 |" in card
    assert "| `tokens_per_second` | 9000.0000 |" in card

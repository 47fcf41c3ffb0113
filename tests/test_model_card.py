"""The model card pushed with a run names its base model, data set, recipe values and final metrics."""

import json
from pathlib import Path

import pytest

from conftest import ROOT, run_train
from dpotrain.hub import hub
from dpotrain.recipe import run_record


def model_card(resolved: dict, *args) -> str:
    """The card of a run whose record holds `resolved` (as resolved_config.json would)."""
    return hub.model_card(run_record.of(resolved), *args)


def test_model_card_names_base_dataset_recipe_and_final_metrics():
    resolved = {
        "run_name": "think-dpo",
        "config": "configs/think.yaml",
        "model_name_or_path": "org/sft-7b",
        "dataset_name": "allenai/Dolci-Think-DPO-7B",
        "loss_type": ["sigmoid_norm"],
        "beta": 5.0,
        "learning_rate": 1e-6,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0.1,
        "num_train_epochs": 1,
        "max_length": 8192,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "derived": {"pairs_per_step": 128},
    }
    records = [{"step": 1, "loss": 0.6931}, {"step": 1170, "loss": 0.41, "rewards/accuracies": 0.72}]
    card = model_card(resolved, records)
    assert "base_model: org/sft-7b" in card and "- allenai/Dolci-Think-DPO-7B" in card  # Hub metadata
    assert "| `beta` | 5.0 |" in card and "| `loss_type` | ['sigmoid_norm'] |" in card
    assert (
        "| `learning_rate` | 1e-06 |" in card and "| pairs per optimizer step | 128 pairs, over all processes |" in card
    )
    assert "## Final metrics (step 1170)" in card
    assert "| `loss` | 0.4100 |" in card and "| `rewards/accuracies` | 0.7200 |" in card
    assert "![training curves](training_curves.png)" in card


def test_the_card_names_the_split_and_configuration_of_the_data_set_trained_on():
    """`--dataset_name HuggingFaceH4/ultrafeedback_binarized --dataset_train_split train_prefs` (docs/data.md's own
    example), or a `dataset_config`: the card said "on `HuggingFaceH4/ultrafeedback_binarized` (commit ...)", the whole
    data set, whose default configuration and split a reader loads, not what the run trained on. The default ones
    (`train`, no configuration) are not named."""
    base = {"model_name_or_path": "org/sft-7b", "dataset_name": "HuggingFaceH4/ultrafeedback_binarized", "derived": {}}
    card = model_card({**base, "dataset_train_split": "train_prefs", "dataset_config": "sub"}, [])
    assert "of `org/sft-7b` on the `train_prefs` split of configuration `sub` of `HuggingFaceH4/ultrafeedback_b" in card
    assert "- HuggingFaceH4/ultrafeedback_binarized" in card  # the Hub metadata names the repo as before
    card = model_card({**base, "dataset_train_split": "train"}, [])
    assert "of `org/sft-7b` on `HuggingFaceH4/ultrafeedback_binarized` with" in card and "split" not in card


def test_the_card_says_the_loss_trained_with_its_weights_and_options():
    """Every card said "OLMo 3's length-normalized DPO recipe", whatever loss_type trained, and named no weight or
    loss option: an MPO run's card could not be reproduced from it, an ipo run's claimed OLMo 3's loss."""
    base = {"model_name_or_path": "org/sft-7b", "dataset_name": "org/prefs", "beta": 0.1, "derived": {}}
    mpo = {**base, "loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}
    card = model_card(mpo, [])
    assert "with TRL's DPO loss (0.8 x sigmoid + 0.2 x bco_pair + 1 x sft, beta 0.1)" in card
    assert "length-normalized" not in card
    robust = {**base, "loss_type": ["robust"], "label_smoothing": 0.2, "ld_alpha": 0.5}
    assert "(robust, beta 0.1, label_smoothing 0.2, ld_alpha 0.5 (LD-DPO))" in model_card(robust, [])
    # An alpha-divergence run's coefficient is part of its loss: the card said `alpha_divergence` alone
    alpha = {**base, "loss_type": ["sigmoid"], "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}
    assert "(sigmoid, beta 0.1, f_divergence_type alpha_divergence, f_alpha_divergence_coef 0.3)" in model_card(
        alpha, []
    )
    olmo = {**base, "loss_type": ["sigmoid_norm"], "beta": 5.0}
    assert "with OLMo 3's length-normalized DPO recipe (sigmoid_norm, beta 5)" in model_card(olmo, [])


def test_local_model_and_data_are_not_claimed_as_hub_repos(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "pairs.jsonl"
    data.write_text("")
    card = model_card({"model_name_or_path": "builtin:tiny-olmo3", "dataset_name": str(data)}, [])
    assert "base_model" not in card and "datasets" not in card
    # A model folder of the user's (before: `base_model: /path/to/my-sft` in the card's metadata, which the Hub's
    # metadata check refuses as it refuses a local path under `datasets`), however it is written
    folder = tmp_path / "my-sft"
    folder.mkdir()
    for given in (str(folder), f"{folder}/", "./my-sft", "my-sft", "~/no/such/folder"):
        card = model_card({"model_name_or_path": given, "dataset_name": "org/pairs"}, [], [], "me/run")
        # by its name alone (its path is the training machine's): tests/test_model_card.py's commits test
        named = f"`{Path(given.rstrip('/')).name}` (a local folder)"
        assert "base_model" not in card and "- org/pairs" in card and named in card, given
    assert "(none logged)" in card


def test_model_card_lists_the_loss_scale_rewards_when_logged():
    records = [
        {"step": 5, "loss": 0.5, "rewards/margins": 210.0, "rewards_norm/margins": 1.25, "tokens_per_second": 9e3}
    ]
    card = model_card({"run_name": "r"}, records)
    assert "| `rewards_norm/margins` | 1.2500 |" in card and "| `rewards/margins` | 210.0000 |" in card
    assert "| `tokens_per_second` | 9,000.0 (mean of step 5) |" in card


def test_the_cards_speed_is_the_runs_mean_over_its_steady_steps_not_the_last_steps():
    """Steps of one run range widely (723-9,362 tokens/s in one); the first holds the warm-up."""
    speeds = {1: 723.0, 2: 9362.0, 3: 8000.0, 4: 1200.0}
    records = [{"step": s, "loss": 0.6, "tokens_per_second": v} for s, v in speeds.items()]
    card = model_card({"run_name": "r"}, [*records, {"step": 4, "eval_loss": 0.6}])
    mean = (9362 + 8000 + 1200) / 3
    assert (
        f"| `tokens_per_second` | {mean:,.1f} (mean of 3 logging steps, 2-4; the first, with the warm-up, "
        "left out) |" in card
    ), card


def test_the_card_shows_the_last_evaluation_apart_from_the_final_training_metrics():
    """A run that evaluated (an eval split) had its last evaluation in run_complete.json (`final_eval`) and not on the
    card, whose final metrics are the last training record's: it has a section of its own, the last evaluation's
    figures as logged, and a run that evaluated none has none."""
    train = [{"step": s, "loss": 0.7 - s / 100, "rewards/accuracies": 0.5} for s in (2, 4)]
    evals = [
        {"step": s, "eval_loss": 0.68 - s / 100, "eval_rewards/accuracies": s / 8, "eval_runtime": 1.5} for s in (2, 4)
    ]
    card = model_card({"run_name": "r"}, [train[0], evals[0], train[1], evals[1]])
    section = card.split("## Last evaluation (step 4, held-out data)\n")[1].split("![training curves]")[0]
    assert (
        section
        == "\n| metric | value |\n|---|---|\n| `eval_loss` | 0.6400 |\n| `eval_rewards/accuracies` | 0.5000 |\n\n"
    )
    assert "## Final metrics (step 4)" in card and "| `loss` | 0.6600 |" in card  # training's, as before
    assert "Last evaluation" not in model_card({"run_name": "r"}, train)


def test_the_cards_speed_leaves_each_attempts_warm_up_out_so_a_resumed_run_reads_as_an_uninterrupted_one():
    """A resume's first logged step holds the new process's warm-up as the run's first does, and the card's mean
    counted it as steady: a run resumed once read slower than the same run uninterrupted. Each attempt's first step
    is left out (after a resume with eval_on_start, the record saying `resumed_from` is the evaluation's)."""
    steady = {2: 9000.0, 3: 8000.0, 4: 8500.0, 6: 9500.0, 7: 8800.0}
    resumed = [{"step": s, "loss": 0.6, "tokens_per_second": steady.get(s, 700.0)} for s in range(1, 8)]
    resumed[4] |= {"tokens_per_second": 650.0, "resumed_from": 4}  # step 5: the resumed process's warm-up
    step_5 = {k: v for k, v in resumed[4].items() if k != "resumed_from"}
    with_eval = [*resumed[:4], {"step": 4, "eval_loss": 0.6, "resumed_from": 4}, step_5, *resumed[5:]]
    mean = sum(steady.values()) / len(steady)
    said = f"| `tokens_per_second` | {mean:,.1f} (mean of 5 logging steps, 2-7; each attempt's first (steps 1, 5), "
    for records in (resumed, with_eval):
        assert f"{said}with its warm-up, left out) |" in model_card({"run_name": "r"}, records), records


def test_a_final_metric_that_was_nan_is_said_so_on_the_card():
    """metrics.jsonl writes a NaN or infinite value null (records.dumps): the card's `{:.4f}` of it was a TypeError
    traceback after training, with the final model saved and no card or run_complete.json."""
    records = [{"step": 1, "loss": 0.69, "tokens_per_second": 900.0}, {"step": 2, "loss": None, "grad_norm": None}]
    records.append({"step": 3, "loss": None, "rewards/accuracies": 0.5, "tokens_per_second": None})
    card = model_card({"run_name": "r"}, records)
    assert "| `loss` | NaN or infinite |" in card and "| `rewards/accuracies` | 0.5000 |" in card
    assert "| `tokens_per_second` | 900.0 (mean of step 1) |" in card


def test_card_lists_the_checkpoint_branches_on_the_hub(tmp_path):
    from dpotrain.hub.hub import update_card_revisions
    from dpotrain.hub.hub_push import pushed_revisions, record_push

    record_push(tmp_path, step=2, branch="step-2", status="pushed")
    record_push(tmp_path, step=4, branch="step-4", status="failed", error="HfHubHTTPError: 500")
    record_push(tmp_path, step=6, branch="step-6", status="failed", error="HfHubHTTPError: 500")
    record_push(tmp_path, step=6, branch="step-6", status="present")  # push_to_hub.py found it there later
    record_push(tmp_path, step=6, branch="main", status="pushed")
    assert pushed_revisions(tmp_path, "org/r") == [(2, "step-2"), (6, "step-6")]

    card = model_card({"run_name": "r"}, [], pushed_revisions(tmp_path, "org/r"), "org/r")
    assert "## Checkpoint revisions" in card and 'from_pretrained("org/r", revision="step-6")' in card
    assert "| 2 | [`step-2`](" in card and "/org/r/tree/step-2)" in card and "step-4" not in card
    assert "Checkpoint revisions" not in model_card({"run_name": "r"}, [])  # none pushed: no section

    (tmp_path / "README.md").write_text(card)
    record_push(tmp_path, step=4, branch="step-4", status="pushed")
    update_card_revisions(tmp_path, "org/r")
    updated = (tmp_path / "README.md").read_text()
    assert updated.count("## Checkpoint revisions") == 1 and "| 4 | [`step-4`](" in updated
    assert updated.startswith(card.split("## Checkpoint revisions")[0])  # the rest of the card is kept


LORA_RUN = {  # a LoRA run's record, as the card reads it
    "model_name_or_path": "org/sft-7b",
    "use_peft": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    "merge_lora": False,
}


def test_a_lora_cards_adapter_names_rslora_dora_and_modules_to_save_where_set():
    """The card named r, alpha, dropout and targets alone: an adapter trained with rank-stabilized scaling, DoRA or
    layers trained whole (modules_to_save) could not be trained again from its card. Named where set, not otherwise."""
    resolved = LORA_RUN | {"lora_target_modules": ["q_proj", "v_proj"]}
    plain = model_card(resolved | {"use_rslora": False, "use_dora": False, "lora_modules_to_save": None}, [])
    assert not any(word in plain for word in ("rslora", "dora", "modules_to_save"))
    card = model_card(resolved | {"use_rslora": True, "use_dora": True, "lora_modules_to_save": ["lm_head"]}, [])
    assert (
        "target modules ['q_proj', 'v_proj'], `use_rslora: true` (the update scaled by alpha / sqrt(r)), "
        "`use_dora: true` (DoRA), `lora_modules_to_save: ['lm_head']` (trained whole, saved with the adapter)."
    ) in card


def test_a_qlora_cards_adapter_names_the_quantized_base_it_trained_on():
    """A QLoRA run's card (`--load_in_4bit`) said a LoRA adapter with its r, alpha and targets, not a word of the
    base's 4-bit quantization the adapter trained against: a reader would train it again, or judge it, on the base in
    bf16. Named with its quantization type; not for a LoRA run on the full base."""
    resolved = LORA_RUN | {
        "bnb_4bit_quant_type": "nf4",
    }
    assert "bitsandbytes" not in model_card(resolved | {"load_in_4bit": False}, [])
    card = model_card(resolved | {"load_in_4bit": True, "use_bnb_nested_quant": True}, [])
    assert (
        "target modules all-linear, `load_in_4bit: true` (QLoRA: trained on the base quantized to 4 bits by "
        "bitsandbytes, `bnb_4bit_quant_type: nf4`, `use_bnb_nested_quant: true`)."
    ) in card
    assert "quantized to 8 bits" in model_card(resolved | {"load_in_8bit": True}, [])


def test_lora_run_card_and_folder(tmp_path):
    from dpotrain.hub.hub import run_folder_problems

    resolved = {
        "model_name_or_path": "org/sft-7b",
        "use_peft": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "lora_target_modules": ["q_proj", "v_proj"],
        "merge_lora": False,
    }
    card = model_card(resolved, [])
    assert "library_name: peft" in card and "- lora" in card and "base_model: org/sft-7b" in card
    assert "**LoRA adapter** (PEFT) for `org/sft-7b`" in card and "r=16, alpha=32" in card
    assert "['q_proj', 'v_proj']" in card and "merge_lora: true" in card
    assert "Load it with `peft.AutoPeftModelForCausalLM.from_pretrained(<this repo>)`." in card
    # The built-in model or a local folder: adapter_config.json names the folder the base loaded from, which a pushed
    # adapter's user on another machine lacks (the card said AutoPeftModelForCausalLM would load it)
    folder = tmp_path / "my-sft"
    folder.mkdir()
    for base, built in (
        (str(folder), ""),
        ("builtin:tiny-olmo3", " (the built-in model, built by `dpotrain.data.builtin.materialize_model("),
    ):
        card = model_card({**resolved, "model_name_or_path": base}, [])
        assert "Load it with" not in card and "names the base by the local folder it trained from" in card, base
        assert f"load the base{built}" in card and "`peft.PeftModel.from_pretrained(base, <this repo>)`" in card
    # An adapter folder is a complete run without config.json / model.safetensors, but not without its adapter.
    for name in (
        "adapter_config.json",
        "tokenizer_config.json",
        "tokenizer.json",
        "README.md",
        "training_curves.png",
        "run_complete.json",
    ):
        (tmp_path / name).write_text("{}")
    assert run_folder_problems(tmp_path) == ["adapter_model.safetensors"]
    (tmp_path / "adapter_model.safetensors").write_text("")
    assert run_folder_problems(tmp_path) == []


def test_a_run_stopped_by_max_steps_says_so_beside_its_epochs():
    """`--max_steps 100` on a recipe of 1,172 steps: the card said `num_train_epochs` 1 alone, the recipe read back as
    a whole epoch trained."""
    card = model_card({"run_name": "r", "num_train_epochs": 1.0, "max_steps": 100}, [])
    assert "| `num_train_epochs` | 1.0 (stopped at max_steps 100) |" in card
    assert "| `num_train_epochs` | 1.0 |" in model_card({"run_name": "r", "num_train_epochs": 1.0, "max_steps": -1}, [])


def test_a_budget_that_cut_every_micro_batch_alike_reads_one_count():
    """max_tokens_per_microbatch cutting 4 pairs into every micro-batch: the card said "4-4 pairs per micro-batch"."""
    batching = {"pairs_per_step": 8, "micro_batches_per_step": {"min": 2, "mean": 2, "max": 2}}
    card = {"run_name": "r", "per_device_train_batch_size": None, "max_tokens_per_microbatch": 2048}
    for pairs, says in [(4, "4 pairs"), (1, "1 pair"), ({"min": 1, "mean": 1.5, "max": 2}, "1-2 pairs")]:
        batching["pairs_per_micro_batch"] = (
            pairs if isinstance(pairs, dict) else {"min": pairs, "mean": pairs, "max": pairs}
        )
        text = model_card({**card, "derived": {"batching": batching}}, [])
        assert f"| `per_device_train_batch_size` | {says} per micro-batch (max_tokens_per_microbatch) |" in text, text


def test_the_recipe_table_names_the_optimizer_and_its_settings_as_recorded():
    """The card named the learning rate and schedule but not the optimizer, its betas or epsilon (resolved_config.json
    holds them): a reader reproducing the run had to guess transformers' defaults of the day."""
    resolved = {
        "optim": "adamw_torch_fused",
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-08,
        "weight_decay": 0.01,
        "derived": {},
    }
    card = model_card(resolved, [])
    for row in ("`optim` | adamw_torch_fused", "`adam_beta1` | 0.9", "`adam_beta2` | 0.95", "`adam_epsilon` | 1e-08"):
        assert f"| {row} |" in card, row
    assert "| `weight_decay` | 0.01 |" in card


def test_the_adam_rows_are_shown_only_for_an_optimizer_that_reads_them():
    """`--optim sgd` or `adafactor`: the card listed adam_beta1/adam_beta2/adam_epsilon as if the run had used them
    (transformers passes them to the Adam family alone; Lion takes the betas, not epsilon)."""
    adam = {"adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-08, "derived": {}}
    shown = {
        "sgd": [],
        "adafactor": [],
        "adagrad": [],
        "lion_32bit": ["adam_beta1", "adam_beta2"],
        "paged_adamw_8bit": ["adam_beta1", "adam_beta2", "adam_epsilon"],
        "adamw_torch": ["adam_beta1", "adam_beta2", "adam_epsilon"],
    }
    for optim, rows in shown.items():
        card = model_card({**adam, "optim": optim}, [])
        assert [k for k in adam if f"| `{k}` |" in card] == rows, (optim, card)
        assert f"| `optim` | {optim} |" in card and "| `weight_decay` |" in card


def test_the_pairs_per_step_row_says_what_the_steps_took_where_fewer_pairs_were_kept():
    """pairs_per_step 8 on 3 pairs kept (max_length dropped the rest): the card said 8 pairs per optimizer step, the
    single step took 3 (the plan's pairs_per_step_trained), as the dry run says."""
    batching = {
        "pairs_per_step_trained": {"min": 3, "mean": 3, "max": 3},
        "pairs_trained": {"pairs": 3, "of": 3, "steps": 1},
    }
    card = model_card({"run_name": "r", "derived": {"pairs_per_step": 8, "batching": batching}}, [])
    assert "| pairs per optimizer step | 3 pairs, over all processes: pairs_per_step 8, but 3 pairs are one step |" in (
        card
    ), card
    batching.update(pairs_per_step_trained={"min": 8, "mean": 8, "max": 8}, pairs_trained={"pairs": 8, "of": 8})
    card = model_card({"run_name": "r", "derived": {"pairs_per_step": 8, "batching": batching}}, [])
    assert "| pairs per optimizer step | 8 pairs, over all processes |" in card, card


def test_the_best_evaluation_is_named_from_the_trainers_state():
    """metric_for_best_model with evaluation and checkpoints: transformers kept the best step's checkpoint
    (trainer_state.json's best_global_step, best_metric, best_model_checkpoint) and the card said nothing of it."""
    from transformers import TrainerState

    state = TrainerState(best_global_step=4, best_metric=0.61234, best_model_checkpoint="/runs/r/checkpoint-4")
    card = model_card({"run_name": "r", "metric_for_best_model": "eval_loss"}, [], (), "", hub.best_of(state))
    assert "| best evaluation (`eval_loss`) | step 4: 0.6123 (`checkpoint-4`) |" in card, card
    # The best step saved no checkpoint: transformers still names the earlier best's folder, which is not that step's
    state.best_global_step = 5
    card = model_card({"run_name": "r", "metric_for_best_model": "eval_loss"}, [], (), "", hub.best_of(state))
    assert "| best evaluation (`eval_loss`) | step 5: 0.6123 (no checkpoint saved at that step) |" in card, card
    assert hub.best_of(TrainerState()) is None and "best evaluation" not in model_card({"run_name": "r"}, [])


@pytest.mark.slow
def test_a_runs_card_names_its_best_evaluation_and_leaves_out_what_sgd_never_read(tmp_path, tiny_model_dir):
    """A real run with --metric_for_best_model eval_loss, an evaluation and a checkpoint at each step, and --optim
    sgd: its README.md names the best step as trainer_state.json keeps it, the last evaluation as run_complete.json
    does, and no adam_* row."""
    out, held = tmp_path / "run", tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:8]))
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out), "--max_steps", "3"]
    args += ["--eval_strategy", "steps", "--eval_steps", "1", "--dataset_mixer_eval_list", str(held), "1.0"]
    args += ["--metric_for_best_model", "eval_loss", "--save_steps", "1", "--optim", "sgd", "--report_to", "none"]
    run = run_train(args, env={"DPOTRAIN_BUILTIN_DIR": str(Path(tiny_model_dir).parent)})
    assert run.returncode == 0, run.stdout[-3000:]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    step, best = state["best_global_step"], state["best_metric"]
    card = (out / "README.md").read_text()
    assert f"| best evaluation (`eval_loss`) | step {step}: {best:.4f} (`checkpoint-{step}`) |" in card, card
    # kept for push_to_hub.py, which marks the best branch when it lists the checkpoint branches again
    best_kept = json.loads((out / "run_complete.json").read_text())["best"]
    assert best_kept == {"step": step, "metric": best, "checkpoint": f"checkpoint-{step}"}, best_kept
    # The last evaluation on the card is run_complete.json's, as logged
    final_eval = json.loads((out / "run_complete.json").read_text())["final_eval"]
    assert f"## Last evaluation (step {final_eval['step']}, held-out data)" in card, card
    assert f"| `eval_loss` | {final_eval['eval_loss']:.4f} |" in card, card
    assert "| `optim` | sgd |" in card and "adam_" not in card


def test_the_checkpoint_revisions_mark_the_best_evaluations_branch(tmp_path):
    """With metric_for_best_model, the card named the best step in its metrics and listed the checkpoint branches
    without saying which one holds that checkpoint: its row is marked, in the run's card and in the list
    push_to_hub.py writes again after pushing branches later (from run_complete.json's record of the best)."""
    from transformers import TrainerState

    from dpotrain.hub.hub_push import record_push

    state = TrainerState(best_global_step=4, best_metric=0.5, best_model_checkpoint="/runs/r/checkpoint-4")
    resolved = {"run_name": "r", "metric_for_best_model": "eval_loss"}
    revisions = [(2, "step-2"), (4, "step-4"), (6, "step-6")]
    card = model_card(resolved, [], revisions, "org/r", hub.best_of(state))
    rows = [line for line in card.splitlines() if line.startswith("| ") and "/tree/step-" in line]
    assert [row.endswith("(best evaluation, `eval_loss`) |") for row in rows] == [False, True, False], rows
    # the best step saved no checkpoint (transformers names an earlier best's folder): no branch holds it
    state.best_global_step = 6
    assert "(best evaluation" not in model_card(resolved, [], revisions, "org/r", hub.best_of(state))

    # push_to_hub.py --checkpoints after the run: the list is written anew from hub_pushes.jsonl, the mark kept
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text(model_card(resolved, [], [], "org/r", None))  # no branch pushed by the job
    (out / "resolved_config.json").write_text(json.dumps(resolved))
    state.best_global_step = 4
    (out / hub.RUN_COMPLETE).write_text(json.dumps({"global_step": 6, "final": None, "best": hub.best_of(state)}))
    for step, branch in revisions:
        record_push(out, step=step, branch=branch, status="pushed", repo="org/r")
    hub.update_card_revisions(out, "org/r")
    rows = [line for line in (out / "README.md").read_text().splitlines() if "/tree/step-" in line]
    assert [row.endswith("(best evaluation, `eval_loss`) |") for row in rows] == [False, True, False], rows


def test_the_card_names_the_commits_trained_from_and_no_path_of_the_training_machine():
    """The card said `DPO post-training of org/sft-7b on org/prefs` and no commit of either, where the record holds
    both (a branch moves: the card could not be reproduced from), said nothing of how max_length was chosen, and named
    a local model, data file and recipe by their absolute paths (`/home/alice/...`: the user's home on a public Hub
    page, meaning nothing there). Hub inputs now come with their commits, local ones by name and SHA-256."""
    hub_run = {
        "run_name": "r",
        "config": "/home/alice/dpotrain/configs/think.yaml",
        "model_name_or_path": "org/sft-7b",
        "dataset_name": "org/prefs",
        "max_length": 8192,
        "derived": {
            "model_identity": {"hub_commit": "a" * 40},
            "data_identity": {"hub_commit": "b" * 40},
            "max_length_given_by": "the command line's",
        },
    }
    card = model_card(hub_run, [])
    assert "DPO post-training of `org/sft-7b` (commit `aaaaaaaaaaaa`) on `org/prefs` (commit `bbbbbbbbbbbb`)" in card
    assert "| `max_length` | 8192 (the command line's) |" in card
    assert "(config `think.yaml`)" in card and "/home/alice" not in card
    local_run = {
        **hub_run,
        "model_name_or_path": "/home/alice/models/my-sft",
        "dataset_name": "/home/alice/data/prefs.jsonl",
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_modules": ["q_proj"],
        "derived": {"data_identity": {"prefs.jsonl": {"bytes": 10, "sha256": "c" * 64}}},
    }
    card = model_card(local_run, [])
    assert "DPO post-training of `my-sft` (a local folder) on `prefs.jsonl` (sha256 `cccccccccccc`)" in card
    assert "for `my-sft`, not a full model" in card  # the LoRA paragraph
    # A folder whose name has dots (a version) is no file; a data file whose record holds no hash is one
    dotted = {**local_run, "model_name_or_path": "/m/Llama-3.1-8B-Instruct", "dataset_name": "/d/prefs-v1.2"}
    card = model_card({**dotted, "derived": {}}, [])
    assert "`Llama-3.1-8B-Instruct` (a local folder) on `prefs-v1.2` (a local folder)" in card
    card = model_card({**dotted, "dataset_name": "/d/prefs.jsonl.gz", "derived": {}}, [])
    assert "on `prefs.jsonl.gz` (a local file)" in card
    assert "/home/alice" not in card
    source = {"rows_read": 4, "rows_usable": 4, "amount": "1.0", "taken": 4, "upsampled": False}
    mixture = [{"source": "/home/alice/data/a.jsonl [train]", **source}, {"source": "org/b [train]", **source}]
    card = model_card({**hub_run, "dataset_name": None, "derived": {"data_sources": mixture}}, [])
    assert "| `a.jsonl [train]` | 4 |" in card and "| `org/b [train]` | 4 |" in card and "/home/alice" not in card


def test_a_lora_cards_targets_name_target_parameters_beside_target_modules():
    """A card of an adapter given both `lora_target_modules` and `lora_target_parameters` (an MoE's experts) named the
    modules alone: the adapter could not be trained again from it."""
    resolved = {
        "model_name_or_path": "org/sft-moe",
        "use_peft": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj"],
        "lora_target_parameters": ["mlp.experts.gate_up_proj"],
        "merge_lora": False,
    }
    card = model_card(resolved, [])
    assert "target modules ['q_proj'] and target parameters ['mlp.experts.gate_up_proj']." in card
    card = model_card(resolved | {"lora_target_modules": None}, [])
    assert "dropout=0.0, target parameters ['mlp.experts.gate_up_proj']." in card


def test_an_endpoint_with_credentials_reaches_no_card_and_no_log_line(tmp_path, monkeypatch):
    """HF_ENDPOINT may name a mirror with `user:password@` in it: the card's branch links put it on a public model page,
    and `Pushed to <url>` and the Hub probe's line in the job's log. The address is shown without them."""
    from huggingface_hub import constants

    from dpotrain.hub.hub_push import pushed_revisions, record_push
    from dpotrain.recipe.hub_switches import shown_endpoint

    monkeypatch.setattr(constants, "ENDPOINT", "https://mirror-user:s3cret-pass@hub.example:8443/hf")
    assert shown_endpoint() == "https://hub.example:8443/hf"
    record_push(tmp_path, step=2, branch="step-2", status="pushed")
    card = model_card({"run_name": "r"}, [], pushed_revisions(tmp_path, "org/r"), "org/r")
    assert "(https://hub.example:8443/hf/org/r/tree/step-2)" in card and "s3cret" not in card
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:8080")
    assert shown_endpoint() == "http://127.0.0.1:8080"  # no credentials: as given

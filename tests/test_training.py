"""What a run promises: the DPO invariant at step 1, learning, and a complete output folder."""

import json
import math

import pytest
import torch

from conftest import DEMO_SECRETS, ROOT, built, ready
from dpotrain.data import data
from dpotrain.plan import plan
from dpotrain.recipe.config import parse_args
from dpotrain.reference.scorer import ReferenceScorer

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def smoke_trainer(tmp_path, model_dir, *overrides, rows: int):
    """A trainer of the smoke recipe on its first `rows` pairs: those its steps train on, so that the reference stage
    scores no more than that."""
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            *overrides,
        ]
    )
    dataset = data.load_preference_dataset(str(ROOT / recipe.script.dataset_name))
    return ready(built(recipe, dataset.select(range(rows))))


@pytest.mark.slow
def test_first_loss_is_ln2_and_rewards_zero_then_training_changes_every_parameter_and_lowers_the_loss(
    tmp_path, tiny_model_dir
):
    """One run carries both (a second trainer cost a model load and a reference stage of its own): its step 1 and
    its 12 steps."""
    trainer = smoke_trainer(
        tmp_path, tiny_model_dir, "--max_steps", "12", "--logging_steps", "1", "--warmup_steps", "0", rows=96
    )
    assert trainer.packed and trainer.forward.share_prompt  # the CPU's forward for the smoke recipe: prompts shared
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    # Policy and reference start identical, so every log-ratio is 0: loss = -log sigmoid(0) = ln 2, rewards 0.
    first = trainer.state.log_history[0]
    assert first["step"] == 1
    # Within fp32 rounding, not bit for bit: the reference stage scores in micro-batches of its own, so a sequence's
    # sum may add up in another order (~1e-7 here); a wrong reference is off by far more (tests/test_reference.py).
    assert abs(first["loss"] - math.log(2)) < 1e-5
    assert all(abs(first[f"rewards/{k}"]) < 1e-4 for k in ("chosen", "rejected", "margins")), first  # beta x sums

    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"parameters not trained: {unchanged}"
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert losses[-1] < losses[0] - 0.05, losses
    assert trainer.health.alarms == []  # a healthy run trips no guard


@pytest.mark.slow
def test_a_logged_loss_is_the_mean_over_the_windows_pairs_when_its_steps_differ_in_size(tmp_path, tiny_model_dir):
    """19 pairs, 8 per step, 2 epochs: steps of 8, 8, 3, 8, 8, 3 pairs. A record of steps 3-4 is the mean over their 11
    pairs (as docs/metrics.md says of every metric), not transformers' mean of the two step means, which weighed the
    3-pair step as much as the 8-pair one (0.5364 against 0.5177 here)."""
    trainer = smoke_trainer(tmp_path, tiny_model_dir, "--num_train_epochs", "2", "--logging_steps", "2", rows=19)
    step_losses, training_step = [], trainer.training_step

    def recorded(model, inputs, *args):  # one process: a step's returned loss is its mean over its pairs
        loss = training_step(model, inputs, *args)
        step_losses.append(float(loss))
        return loss

    trainer.training_step = recorded
    trainer.train()
    pairs = [8, 8, 3, 8, 8, 3]
    logged = {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}
    assert sorted(logged) == [1, 2, 4, 6] and len(step_losses) == 6
    for last in (4, 6):
        window = range(last - 2, last)
        want = sum(step_losses[i] * pairs[i] for i in window) / sum(pairs[i] for i in window)
        assert abs(logged[last] - want) < 1e-5, (last, logged[last], want, step_losses)


def test_evaluation_batches_keep_within_the_positions_a_forward_is_planned_for(tmp_path, tiny_model_dir):
    """per_device_eval_batch_size counts pairs alone: 8 held-out pairs a batch laid out up to 2,580 positions where
    the smoke recipe's budget is 2,048 (the think recipe's up to 262,144 where its plan gives a forward 3 x 65,536: an
    out-of-memory at the first evaluation). A batch is cut to the reference stage's budget."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    split = tmp_path / "split"
    split.mkdir()
    (split / "train.jsonl").write_text("".join(pairs[:16]))
    (split / "test.jsonl").write_text("".join(pairs[16:80]))
    flags = ["--dataset_name", str(split), "--eval_strategy", "steps", "--eval_steps", "2", "--max_steps", "2"]
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            *flags,
        ]
    )
    held_out = data.load_preference_dataset(str(split / "test.jsonl"))
    trainer = built(recipe, data.load_preference_dataset(str(split / "train.jsonl")), held_out).trainer
    budget, _ = ReferenceScorer(trainer).budget()
    batches = [b for b in trainer.get_eval_dataloader() if not b.get(plan.FILLER)]
    assert max(b["input_ids"].numel() for b in batches) <= budget == 2048, [b["input_ids"].numel() for b in batches]
    assert len(batches) > 8  # cut further than 64 pairs at 8 a batch


@pytest.mark.slow
def test_cpu_demo_writes_a_complete_run(demo_run):
    """The README's demo command (`bash scripts/demo.sh`: smoke recipe, whole epoch), with W&B offline, checked as a
    user would; the run is the session's (conftest.demo_run), which tests/test_readme.py continues the quickstart on."""
    project, _, result = demo_run
    out = project / "outputs" / "smoke-dpo"
    secret, wandb_secret = DEMO_SECRETS["HF_TOKEN"], DEMO_SECRETS["WANDB_API_KEY"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert "health STOP" not in result.stdout and "health warning" not in result.stdout  # a healthy run trips nothing

    for name in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "resolved_config.json",
        "metrics.jsonl",
        "training_curves.png",
        "README.md",
        "run_complete.json",
    ]:
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # every logging step once (384 pairs / 8 per step), and step 1, which the health guard logs to check ln 2
    assert [r["step"] for r in records] == [1, *range(2, 49, 2)]
    assert all("loss" in r and "rewards/accuracies" in r for r in records)
    assert abs(records[0]["loss"] - math.log(2)) < 1e-5
    # The demo must visibly learn: reward accuracy rises from 0 and the loss falls.
    # Step 1's accuracy is not checked: its margins are fp32 rounding (~1e-7, the reference stage cuts micro-batches
    # of its own), so which pairs count as "chosen ahead" is noise; the margins themselves must be ~0.
    assert abs(records[0]["rewards/margins"]) < 1e-4 and records[-1]["rewards/accuracies"] > 0.9
    assert records[-1]["loss"] < 0.3

    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["beta"] == 5.0 and resolved["loss_type"] == ["sigmoid_norm"]
    assert resolved["derived"]["total_steps"] == 48 and resolved["derived"]["pairs_per_step"] == 8

    # W&B ran for real, offline, under the run folder.
    assert list((out / "wandb").glob("offline-run-*")), "no offline W&B run"

    # Secrets never reach the console, the saved config or the W&B files.
    leaked = [str(p) for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert secret not in result.stdout and wandb_secret not in result.stdout
    assert not leaked, leaked
    assert not [p for p in out.rglob("*") if p.is_file() and wandb_secret.encode() in p.read_bytes()]


@pytest.mark.slow
def test_the_runs_weights_are_as_readable_as_its_other_files(demo_run):
    """safetensors 0.8 writes through a temporary file it creates 0600, whatever the umask (safetensors#782): the
    final model's and every checkpoint's model.safetensors were unreadable to the rest of a cluster group that reads
    the run's config.json (0644 under umask 022), so a colleague evaluating the run could not load it."""
    project, _, result = demo_run
    assert result.returncode == 0, result.stdout[-3000:]
    weights = sorted((project / "outputs" / "smoke-dpo").rglob("*.safetensors"))
    assert len(weights) == 3, weights  # the final model and the two checkpoints save_total_limit keeps
    for path in weights:
        assert path.stat().st_mode & 0o777 == (path.parent / "config.json").stat().st_mode & 0o777, path


@pytest.mark.slow
def test_a_bf16_run_on_sdpa_lays_its_rows_within_the_budget_its_memory_plan_holds(tmp_path, tiny_model_dir):
    """The memory plan of a bf16 run plans max_tokens_per_microbatch positions a micro-batch; its balanced rows on sdpa
    were padded past it (the demo's pairs: up to 2,290 positions for 2,048). Now the collator keeps them within it, the
    step plan counts what it lays out, and the reference stage's rows keep within that stage's own larger budget."""
    from dpotrain.reference.scorer import ReferenceScorer

    overrides = ["--bf16", "true", "--use_cpu", "true", "--attn_implementation", "sdpa", "--max_steps", "2"]
    trainer = smoke_trainer(tmp_path, tiny_model_dir, *overrides, rows=384)
    budget = trainer.max_tokens_per_microbatch
    assert trainer.data_collator.max_positions == budget == 2048
    run_plan = trainer.run_plan
    layout, lengths = run_plan.step_plan.layout, run_plan.lengths
    every = [mb for epoch in run_plan.epochs for step in epoch for rank in step for mb in rank if mb]
    widest = max(every, key=lambda mb: layout.positions(lengths, mb))
    collated = trainer.data_collator([trainer.train_dataset[i] for i in widest])["input_ids"]
    assert collated.numel() == layout.positions(lengths, widest) <= budget  # the plan counts what the collator lays
    assert run_plan.summary["positions_per_micro_batch"]["max"] <= budget
    scorer = ReferenceScorer(trainer)
    assert scorer.collator.max_positions == scorer.budget()[0] >= budget

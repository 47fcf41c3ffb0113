"""The step plan: every pair once per epoch in steps of pairs_per_step; each step cut into the same number of non-empty
micro-batches on every rank, no more than the step needs; and how a step is cut never changes what it computes."""

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, accelerate_launch, launch_env, python, rank_python, smoke_command
from dpotrain.data import builtin
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.plan import plan
from dpotrain.plan.plan import StepPlan

MAX_LENGTH = 8192


def heavy_tailed(n: int, seed: int = 0) -> PairLengths:
    """Dolci-like: lognormal sides (median ~2k tokens), ~15% of pairs cut at max_length on both sides."""
    rng = np.random.default_rng(seed)
    prompt = rng.lognormal(5, 1, n).astype(int) + 10
    chosen = np.minimum(prompt + rng.lognormal(7.4, 1.1, n).astype(int), MAX_LENGTH)
    rejected = np.minimum(prompt + rng.lognormal(7.0, 1.1, n).astype(int), MAX_LENGTH)
    at_max = rng.random(n) < 0.15
    chosen[at_max] = rejected[at_max] = MAX_LENGTH
    return PairLengths(chosen, rejected)


def bimodal(n: int, seed: int = 1) -> PairLengths:
    """Short chat turns and long reasoning traces, nothing in between."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.3
    chosen = np.where(long, rng.integers(6000, MAX_LENGTH + 1, n), rng.integers(40, 400, n))
    rejected = np.where(long, rng.integers(5000, MAX_LENGTH + 1, n), rng.integers(40, 400, n))
    return PairLengths(chosen, rejected)


def check_epoch(lengths: PairLengths, p: StepPlan, epoch: int) -> list[int]:
    """The plan's invariants for one epoch; returns, per step, how many micro-batches per rank it uses beyond a proven
    lower bound."""
    steps = plan.epoch_steps(lengths, p, epoch)
    pairs = [i for step in steps for rank in step for mb in rank for i in mb]
    assert sorted(pairs) == list(range(len(lengths)))  # every pair exactly once
    excess = []
    for step in steps:
        assert len(step) == p.world_size
        per_rank = {len(rank) for rank in step}
        assert len(per_rank) == 1  # the same number of micro-batches on every rank
        count = per_rank.pop()
        flat = np.asarray([i for rank in step for mb in rank for i in mb])
        for rank in step:
            # never an empty micro-batch, unless no equal count of non-empty ones exists: then a rank short of one
            # runs a filler (test_plan_scale.py checks those steps)
            assert all(rank) or (len(flat) % p.world_size and count == len(flat) // p.world_size + 1)
            assert all(p.cost(lengths, mb) <= p.max_tokens for mb in rank if mb)
        alone = [p.cost(lengths, [i]) for i in flat]
        bound = max(1, math.ceil(plan.fewest_bins(alone, p.max_tokens) / p.world_size))
        assert count >= bound
        if p.padded:
            # Runs of similar length are the best a padded cut can do (the longest pairs share a micro-batch with the
            # next longest): one micro-batch fewer per rank cannot hold the step.
            order = [int(i) for i in flat[np.lexsort((flat, -lengths.longest[flat]))]]
            fewer = p.world_size * (count - 1)
            if 0 < fewer <= len(flat):
                assert plan._padded_runs(order, lengths, p.max_tokens, fewer) is None
        excess.append(count - bound)
    return excess


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("make", [heavy_tailed, bimodal], ids=["heavy-tailed", "bimodal"])
@pytest.mark.parametrize("budget", [2 * MAX_LENGTH, 65536])
def test_every_pair_once_same_count_on_every_rank_never_empty_and_no_more_than_needed(padded, make, budget):
    lengths = make(1531)  # a prime number of pairs: a short last step in every epoch
    for world in (1, 2, 3, 4, 16, 64, 128):
        p = StepPlan(128, world, 7, budget, None, padded)
        try:
            plan.plan_run(lengths, p, 3)
        except plan.PlanError as refused:
            # Only steps the ranks cannot share equally are refused, and the budget the message names cuts them all.
            named = int(re.search(r"max_tokens_per_microbatch to ([\d,]+)", str(refused)).group(1).replace(",", ""))
            assert named > budget and "(enough for every step)" in str(refused)
            p = StepPlan(128, world, 7, named, None, padded)
        excess = [e for epoch in range(3) for e in check_epoch(lengths, p, epoch)]
        if not padded:  # bin packing: within one micro-batch of the bound, and on it for most steps
            assert max(excess) <= 1 and sum(excess) / len(excess) <= 0.35, (world, excess)


def test_micro_batch_counts_follow_each_step_not_the_worst_one():
    lengths = heavy_tailed(4000)
    p = StepPlan(128, 4, 42, 65536, None)
    counts = [len(step[0]) for step in plan.epoch_steps(lengths, p, 0)]
    assert min(counts) < max(counts)  # light steps run fewer micro-batches than heavy ones
    summary = plan.summary(lengths, p, [plan.epoch_steps(lengths, p, 0)])
    assert summary["micro_batches_per_step"]["mean"] <= summary["micro_batches_per_step"]["lower_bound_mean"] + 0.05


def test_fixed_pairs_per_micro_batch_without_a_budget():
    lengths = heavy_tailed(1000)
    p = StepPlan(128, 4, 3, None, 4, False)
    steps = plan.epoch_steps(lengths, p, 0)
    for step in steps[:-1]:
        assert [len(mb) for rank in step for mb in rank] == [4] * 32  # 128 pairs = 4 ranks x 8 micro-batches of 4
    assert sorted(i for step in steps for rank in step for mb in rank for i in mb) == list(range(1000))


@pytest.mark.parametrize("pairs, world, per_micro_batch", [(11, 4, 1), (3, 2, 1), (23, 4, 2), (130, 64, 1)])
def test_an_uneven_last_step_keeps_per_device_train_batch_size_and_fills_the_short_ranks(pairs, world, per_micro_batch):
    """Without a budget, a step whose pairs the ranks cannot share equally (an epoch's last): its micro-batches were
    capped at the smallest share's count, so at per_device_train_batch_size 1 the other ranks ran 2 pairs at once."""
    step = plan.cut_step(np.arange(pairs), heavy_tailed(pairs), StepPlan(pairs, world, 0, None, per_micro_batch))
    assert len({len(rank) for rank in step}) == 1  # the same number of micro-batches on every rank
    assert max(len(mb) for rank in step for mb in rank) == per_micro_batch
    assert sorted(i for rank in step for mb in rank for i in mb) == list(range(pairs))
    assert all([len(mb) for mb in rank] == sorted(map(len, rank), reverse=True) for rank in step)  # fillers last


def test_a_plan_that_leaves_a_rank_without_a_pair_is_refused_with_the_fix():
    fix = r"leaves 128 of the 256 processes without a pair: use pairs_per_step >= 256"
    with pytest.raises(plan.PlanError, match=fix):
        plan.epoch_steps(heavy_tailed(1000), StepPlan(128, 256, 0, 65536, None), 0)


def test_a_data_set_smaller_than_the_processes_is_refused_naming_the_data():
    """5 pairs on 8 processes at pairs_per_step 8 (the recipe's): the refusal advised `pairs_per_step >= 8`, which it
    already was; the data set is what is short."""
    with pytest.raises(plan.PlanError) as refused:
        plan.epoch_steps(heavy_tailed(5), StepPlan(8, 8, 0, 65536, None), 0)
    assert str(refused.value) == (
        "a step of 5 pairs leaves 3 of the 8 processes without a pair: use a data set of at least 8 pairs, or fewer "
        "processes"
    )
    with pytest.raises(plan.PlanError) as refused:  # one pair: it said "a step of 1 pairs"
        plan.epoch_steps(heavy_tailed(1), StepPlan(8, 2, 0, 65536, None), 0)
    assert str(refused.value).startswith("a step of 1 pair leaves 1 of the 2 processes without a pair: ")


def test_a_step_the_ranks_cannot_share_equally_runs_fillers():
    # 130 pairs that each fill the budget, on 64 ranks: at most 2 x 64 = 128 non-empty micro-batches of one pair, so
    # every rank runs 3 and the 62 ranks with 2 pairs run a filler (an empty micro-batch of the plan) last.
    full = PairLengths(np.full(130, MAX_LENGTH), np.full(130, MAX_LENGTH))
    step = plan.cut_step(np.arange(130), full, StepPlan(130, 64, 0, 2 * MAX_LENGTH, None))
    assert {len(rank) for rank in step} == {3}
    assert sorted(len(mb) for rank in step for mb in rank) == [0] * 62 + [1] * 130
    assert all(rank[0] and rank[1] for rank in step)  # a filler comes after the rank's pairs


def test_a_pair_over_the_budget_is_refused_with_the_numbers():
    full = PairLengths(np.full(130, MAX_LENGTH), np.full(130, MAX_LENGTH))
    fix = r"the longest pair 16,384\) cannot be cut .* raise max_tokens_per_microbatch to 16,384"
    with pytest.raises(plan.PlanError, match=fix):
        plan.cut_step(np.arange(130), full, StepPlan(130, 64, 0, 12000, None))


def test_the_refusals_count_steps_and_pairs_in_the_singular_when_one():
    """They read "1 step(s) of the run cannot be cut" and "the evaluation split has 1 pair(s)"."""
    for n, steps in ((1, "1 step"), (2, "2 steps")):
        full = PairLengths(np.full(n, MAX_LENGTH), np.full(n, MAX_LENGTH))
        with pytest.raises(plan.PlanError, match=f"^{steps} of the run cannot be cut; the hardest: "):
            plan.plan_run(full, StepPlan(1, 1, 0, 12000, None), 1)
    with pytest.raises(plan.PlanError, match="^the evaluation split has 1 pair, fewer than the 2 processes that "):
        plan.eval_batches(1, 2, 1)
    with pytest.raises(plan.PlanError, match="^the evaluation split has 2 pairs, fewer than the 3 processes that "):
        plan.eval_batches(2, 3, 1)


def test_order_is_deterministic_per_seed_and_random_at_the_scale_of_steps():
    lengths = heavy_tailed(997)
    p = StepPlan(64, 2, 1, 65536, None)
    assert plan.epoch_steps(lengths, p, 0) == plan.epoch_steps(lengths, p, 0)
    assert plan.epoch_steps(lengths, p, 0) != plan.epoch_steps(lengths, StepPlan(64, 2, 2, 65536, None), 0)
    assert plan.epoch_steps(lengths, p, 0) != plan.epoch_steps(lengths, p, 1)
    first = plan.steps_of(plan.epoch_order(997, 1, 0), 64, 2)[0]  # a random draw, not the shortest pairs
    tokens = lengths.tokens
    assert abs(tokens[first].mean() - tokens.mean()) < 3 * tokens.std() / 8


def test_packed_and_padded_plans_hold_the_same_pairs_in_each_step():
    lengths = heavy_tailed(700)
    packed = plan.epoch_steps(lengths, StepPlan(64, 4, 9, 65536, None, padded=False), 0)
    padded = plan.epoch_steps(lengths, StepPlan(64, 4, 9, 65536, None, padded=True), 0)
    assert [sorted(i for r in s for mb in r for i in mb) for s in packed] == [
        sorted(i for r in s for mb in r for i in mb) for s in padded
    ]


def test_padded_micro_batches_group_similar_lengths():
    lengths = heavy_tailed(2000)
    p = StepPlan(128, 4, 5, 65536, None, padded=True)
    summary = plan.summary(lengths, p, [plan.epoch_steps(lengths, p, 0)])
    # Padded in random micro-batches of 4 pairs (TRL) this mix pads far more; runs of similar length pad little.
    random_cut = plan.summary(
        lengths,
        StepPlan(128, 4, 5, None, 4, padded=True),
        [plan.epoch_steps(lengths, StepPlan(128, 4, 5, None, 4, padded=True), 0)],
    )
    assert summary["padding_share"] < random_cut["padding_share"] / 2


def test_the_sampler_yields_one_step_at_a_time_and_replays_after_a_restart():
    lengths = heavy_tailed(997)
    p = StepPlan(64, 2, 5, 65536, None)
    sampler = plan.StepSampler(lengths, p, rank=1)
    first = list(sampler)
    assert len(first) == len(sampler) == 16  # 997 pairs: 15 steps of 64 and one of 37
    again = plan.StepSampler(lengths, p, rank=1, planned=[plan.epoch_steps(lengths, p, 0)])  # a requeued process
    assert list(again) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


# --- what a step computes, whatever the cut, the forward and the world size -------------------------------------------

# One micro-batch, and micro-batches of unequal pair counts packed and padded: every micro-batch is weighed by its share
# of the step's pairs (`RecipeDPOTrainer.compute_loss`) whatever cut it came from, and the cuts themselves (a fixed
# number of pairs per micro-batch, other budgets) are proven on literal steps (tests/test_literal_tensors.py).
CUTS = {
    "16 pairs in one micro-batch": ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"],
    "token budget 2048": ["--pairs_per_step", "16", "--max_tokens_per_microbatch", "2048"],
    "padded, token budget 2048": [
        "--pairs_per_step",
        "16",
        "--max_tokens_per_microbatch",
        "2048",
        "--padding_free",
        "false",
    ],
}
# One plain SGD step at learning rate 1: the weights move by exactly minus the step's gradient.
ONE_SGD_STEP = [
    "--max_steps",
    "1",
    "--optim",
    "sgd",
    "--learning_rate",
    "1.0",
    "--lr_scheduler_type",
    "constant",
    "--warmup_steps",
    "0",
    "--save_strategy",
    "no",
    "--report_to",
    "none",
]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(48, seed=7)))
    return path


def launch(tmp_path, model_dir, args, processes=1, timeout=900):
    """`train_dpo.py` with the smoke recipe; with `processes` > 1 DeepSpeed ZeRO-2 through `accelerate launch`."""
    launcher = [python()]
    if processes > 1:
        launcher = [
            *accelerate_launch(),
            "--config_file",
            str(ROOT / "accelerate_config.yaml"),
            "--num_processes",
            str(processes),
            *rank_python(),
        ]
    env = launch_env(tmp_path / "cache")
    cmd = smoke_command(launcher, model_dir, *args)
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def one_step_update(tmp_path, model_dir, pairs_file, cut, processes=1):
    out = tmp_path / "run"
    args = [
        "--dataset_name",
        str(pairs_file),
        "--output_dir",
        str(out),
        "--max_tokens_per_microbatch",
        "None",
        "--pairs_per_step",
        "None",
        *ONE_SGD_STEP,
        *cut,
    ]
    launch(tmp_path, model_dir, args, processes)
    derived = json.loads((out / "resolved_config.json").read_text())["derived"]
    assert derived["world_size"] == processes
    if "--padding_free" in cut:  # TRL's collator on the same plan, and the record says so
        assert derived["batching"]["forward"].startswith("padded") and derived["batching"]["padding_share"] > 0
    before, after = weights(model_dir), weights(out)
    return {name: after[name] - before[name] for name in before}


@pytest.mark.slow
def test_one_step_has_the_same_gradient_whatever_the_cut_the_forward_and_the_world_size(
    tmp_path, tiny_model_dir, pairs_file
):
    want = one_step_update(tmp_path / "base", tiny_model_dir, pairs_file, CUTS["16 pairs in one micro-batch"])
    runs = {
        name: one_step_update(tmp_path / name.replace(" ", "-").replace(",", ""), tiny_model_dir, pairs_file, cut)
        for name, cut in CUTS.items()
        if name != "16 pairs in one micro-batch"
    }
    runs["ZeRO-2, 2 processes, token budget 2048"] = one_step_update(
        tmp_path / "w2-budget", tiny_model_dir, pairs_file, CUTS["token budget 2048"], processes=2
    )
    assert max(float(d.abs().max()) for d in want.values()) > 1e-3  # the step moved the weights
    for name, got in runs.items():
        for param, d in want.items():
            assert (got[param] - d).abs().max() <= 1e-6 + 1e-5 * d.abs().max(), (name, param)


@pytest.mark.slow
def test_several_epochs_resumed_in_the_last_and_on_two_processes_end_with_the_same_weights(
    tmp_path, tiny_model_dir, pairs_file
):
    """3 epochs of 45 pairs (a short last step each epoch), 8 pairs per step: resumed from a checkpoint in epoch 3,
    and run by 2 ZeRO-2 processes, the final weights equal one uninterrupted process's."""
    data = tmp_path / "pairs45.jsonl"
    data.write_text("".join(pairs_file.read_text().splitlines(keepends=True)[:45]))
    args = [
        "--dataset_name",
        str(data),
        "--num_train_epochs",
        "3",
        "--pairs_per_step",
        "8",
        "--max_tokens_per_microbatch",
        "2048",
        "--logging_steps",
        "1",
        "--save_steps",
        "7",
        "--report_to",
        "none",
        "--save_total_limit",
        "10",
    ]
    whole = tmp_path / "whole"
    launch(tmp_path / "w", tiny_model_dir, [*args, "--output_dir", str(whole)])
    resolved = json.loads((whole / "resolved_config.json").read_text())["derived"]
    assert resolved["total_steps"] == 18  # 6 steps per epoch (the 5 pairs left over form a 6th), 3 epochs

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    (resumed / "run_complete.json").unlink()
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-14", "checkpoint-18", "checkpoint-7"]
    shutil.rmtree(resumed / "checkpoint-18")  # as if stopped after step 14: the second step of the third epoch
    (resumed / "model.safetensors").unlink()
    stdout = launch(tmp_path / "r", tiny_model_dir, [*args, "--output_dir", str(resumed)])
    assert f"Resuming from {resumed}/checkpoint-14" in stdout
    two = tmp_path / "two"
    # Only its final weights are compared: no checkpoints, whose saves (every rank's optimizer state) it would wait on
    launch(tmp_path / "t", tiny_model_dir, [*args, "--output_dir", str(two), "--save_strategy", "no"], processes=2)
    base = weights(whole)
    for name, other in (("resumed", weights(resumed)), ("2 processes", weights(two))):
        for param, w in base.items():
            assert (other[param] - w).abs().max() < 1e-5, (name, param)


@pytest.mark.slow
def test_a_dry_run_shows_the_plan_training_records(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """`--dry-run` plans the run exactly as training does, before a model loads: from a local data set's rows tokenized
    as the trainer does, and from the analyzer's cached lengths (scripts/analyze_dataset.py, CPU) once they exist."""
    import train_dpo
    from conftest import run_train

    env = {"DPOTRAIN_CACHE": str(tmp_path / "cache"), "DPOTRAIN_BUILTIN_DIR": str(Path(tiny_model_dir).parent)}
    recipe = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    smoke = [*recipe, "--output_dir", str(tmp_path / "run"), "--max_steps", "2"]  # the run's own command, as it plans
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def dry_run() -> dict:  # in this process: the same command, without paying the imports again
        train_dpo.main([*smoke, "--dry-run", "--json"])
        out = capsys.readouterr().out
        return json.loads(out[out.index("{\n") : out.rindex("}") + 1])["derived"]

    from_rows = dry_run()["batching"]
    analysis = subprocess.run(
        [python(), str(ROOT / "scripts" / "analyze_dataset.py"), *recipe],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert analysis.returncode == 0, analysis.stderr[-2000:]
    from_cache = dry_run()["batching"]
    result = run_train([*smoke, "--report_to", "none", "--save_strategy", "no"], env=env)
    assert result.returncode == 0, result.stdout[-2000:]
    trained = json.loads((tmp_path / "run" / "resolved_config.json").read_text())["derived"]["batching"]
    assert from_rows == trained and from_cache == trained


def test_data_seed_orders_the_pairs_as_in_transformers():
    """`--data_seed` is transformers' seed of the data order, which the step plan replaces: it was recorded (and
    compared on resume) but the plan ordered the pairs by `seed` alone, so `--data_seed 7` trained the same order."""
    from types import SimpleNamespace

    from dpotrain.plan import plan_stage

    lengths = PairLengths(np.full(64, 100), np.full(64, 90))

    def order(seed: int, data_seed: int | None) -> list[int]:
        args = SimpleNamespace(
            seed=seed, data_seed=data_seed, per_device_train_batch_size=8, max_steps=-1, num_train_epochs=1
        )
        run = plan_stage.make(lengths, args, 8, 1, 2048, plan.RowLayout("rows"), max_length_cuts={})
        return [i for step in run.epochs[0] for rank in step for mb in rank for i in mb]

    assert order(42, 7) != order(42, None)  # data_seed decides the order ...
    assert order(42, 7) == order(1, 7)  # ... whatever the model's seed
    assert order(42, None) == order(42, 42)  # unset: seed's, as before


def test_a_max_steps_of_many_epochs_plans_the_first_at_start_and_the_rest_as_they_come(monkeypatch):
    """`--max_steps 1000000000000` planned every one of its 2e10 epochs at start (~30 s per 100,000 steps) before the
    dry run answered. The epochs holding PLANNED_AHEAD steps are planned; the sampler plans a later one as it starts,
    as the plan would have. What the run records keeps its steps and epochs."""
    from types import SimpleNamespace

    from dpotrain.plan import plan_stage

    monkeypatch.setattr(plan_stage, "PLANNED_AHEAD", 10, raising=False)
    lengths = PairLengths(np.arange(100, 116), np.full(16, 90))
    args = SimpleNamespace(seed=3, data_seed=None, per_device_train_batch_size=4, max_steps=100, num_train_epochs=1)
    run = plan_stage.make(lengths, args, 8, 2, 2048, plan.RowLayout("rows"), max_length_cuts={})  # 2 steps an epoch
    assert len(run.epochs) == 5  # the 10 steps, not 50 epochs
    assert run.summary["pairs_trained"] == {"pairs": 16, "of": 16, "steps": 100}
    assert run.summary["epochs_trained"] == 50
    whole = plan.plan_run(lengths, run.step_plan, 8)
    for rank in range(2):
        sampler = plan.StepSampler(lengths, run.step_plan, rank, run.epochs)
        sampler.set_epoch(7)
        assert list(sampler) == [[tuple(tuple(mb) for mb in step[rank])] for step in whole[7]]


def test_the_plan_line_says_the_pairs_its_steps_take():
    """26 pairs of 12 a step on 3 ranks: steps of 12 and 14 (a last step of 2 pairs, fewer than the ranks, joins the
    one before it). The run's line said "Plan: 2 steps of 12 pairs per epoch"; 3 pairs at 8 a step, "1 step of 8"."""
    from types import SimpleNamespace

    from dpotrain.plan import plan_stage

    def line(pairs: int, per_step: int) -> str:
        lengths = PairLengths(np.arange(100, 100 + pairs), np.full(pairs, 90))
        args = SimpleNamespace(seed=3, data_seed=None, per_device_train_batch_size=2, max_steps=-1, num_train_epochs=1)
        return plan_stage.make(lengths, args, per_step, 3, None, plan.RowLayout("rows"), max_length_cuts={}).line()

    assert line(26, 12).startswith("Plan: 2 steps of 12-14 pairs per epoch (1 epoch planned), 2-3 micro-batches ")
    assert line(3, 8).startswith("Plan: 1 step of 3 pairs per epoch")
    assert line(24, 12).startswith("Plan: 2 steps of 12 pairs per epoch")


def test_num_train_epochs_rounded_up_to_whole_steps_is_said_as_the_epochs_the_steps_make():
    """`--num_train_epochs 1.5` of 3 steps an epoch trains 5 steps (transformers rounds up): the plan line said "1.667
    epochs planned" and the dry run "5 optimizer steps (1.5 epochs)", two numbers of one run. Both say the epochs the 5
    steps make, and the 1.5 asked, in the same words (test_dry_run.py: the dry run's)."""
    from types import SimpleNamespace

    from dpotrain.plan import plan_stage

    lengths = PairLengths(np.arange(100, 112), np.full(12, 90))
    args = SimpleNamespace(seed=3, data_seed=None, per_device_train_batch_size=4, max_steps=-1, num_train_epochs=1.5)
    run = plan_stage.make(lengths, args, 4, 1, None, plan.RowLayout("rows"), max_length_cuts={})  # 3 steps an epoch
    assert run.summary["pairs_trained"]["steps"] == 5
    assert "(1.667 epochs planned: num_train_epochs 1.5 rounded up to whole steps), " in run.line(), run.line()


@pytest.mark.parametrize(
    "epochs, max_steps, said",
    [(0.5, -1, "(0.5 epochs planned)"), (1, 3, "(1.5 epochs planned)"), (1, 100, "(50 epochs planned)")],
    ids=["half_an_epoch", "max_steps_past_an_epoch", "past_the_epochs_planned_ahead"],
)
def test_the_plan_line_says_the_epochs_the_steps_make(epochs, max_steps, said, monkeypatch):
    """`--num_train_epochs 0.5` printed "Plan: ... (1 epoch planned)" beside the dry run's "(0.5 epochs)": the line
    counted the epochs cut into steps (whole ones), not the epochs the run's steps make (`epochs_trained`)."""
    from types import SimpleNamespace

    from dpotrain.plan import plan_stage

    monkeypatch.setattr(plan_stage, "PLANNED_AHEAD", 10, raising=False)  # 5 epochs of 2 steps cut ahead, of 50
    lengths = PairLengths(np.arange(100, 116), np.full(16, 90))
    args = SimpleNamespace(
        seed=3, data_seed=None, per_device_train_batch_size=4, max_steps=max_steps, num_train_epochs=epochs
    )
    run = plan_stage.make(lengths, args, 8, 2, 2048, plan.RowLayout("rows"), max_length_cuts={})  # 2 steps an epoch
    assert run.line().startswith(f"Plan: 2 steps of 8 pairs per epoch {said}, "), run.line()

"""Micro-batches: the order is random, deterministic and complete; how a step is cut never changes its gradient."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from dpotrain import batching, builtin

RNG = np.random.default_rng(0)
COSTS = RNG.integers(40, 2000, size=997)  # a heavy-tailed-enough spread of pair lengths, a prime number of pairs


def epoch(costs, plan, seed, epoch_index, world):
    return [list(batching.epoch_micro_batches(costs, plan, seed, epoch_index, rank)) for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("budget", [None, 4096])
def test_every_pair_once_per_epoch_and_ranks_in_step(world, budget):
    plan = batching.plan(COSTS, 64, world, seed=3, epochs=2, max_tokens=budget, pairs_per_micro_batch=4)
    for e in (0, 1):
        ranks = epoch(COSTS, plan, 3, e, world)
        seen = sorted(i for micro_batches in ranks for mb in micro_batches for i in mb)
        assert seen == list(range(len(COSTS)))  # every pair exactly once
        lengths = {len(mbs) for mbs in ranks}
        assert lengths == {batching.epoch_length(COSTS, plan, 3, e)}  # every rank runs the same count
        for micro_batches in ranks:
            assert all(micro_batches)  # none empty
            if budget:
                over = [mb for mb in micro_batches if len(mb) > 1 and COSTS[mb].sum() > budget]
                assert not over
    if budget:
        sizes = [len(mb) for mb in epoch(COSTS, plan, 3, 0, world)[0]]
        assert len(set(sizes)) > 1  # micro-batches of different pair counts: cut by tokens, not by pairs


def test_steps_hold_pairs_per_step_and_a_tiny_last_step_joins_the_one_before():
    order = np.arange(130)
    assert [len(s) for s in batching.steps_of(order, 64, 4)] == [64, 66]  # 2 left over < 4 processes
    assert [len(s) for s in batching.steps_of(order, 64, 2)] == [64, 64, 2]


def test_order_is_deterministic_per_seed_and_differs_across_seeds_and_epochs():
    plan = batching.plan(COSTS, 64, 2, seed=1, epochs=2, max_tokens=4096, pairs_per_micro_batch=None)
    assert epoch(COSTS, plan, 1, 0, 2) == epoch(COSTS, plan, 1, 0, 2)
    assert epoch(COSTS, plan, 1, 0, 2) != epoch(COSTS, plan, 2, 0, 2)
    assert epoch(COSTS, plan, 1, 0, 2) != epoch(COSTS, plan, 1, 1, 2)
    # Grouping by length happens only inside a step: the first step's pairs are a random draw, not the shortest.
    first_step = batching.steps_of(batching.epoch_order(len(COSTS), 1, 0), 64, 2)[0]
    assert abs(COSTS[first_step].mean() - COSTS.mean()) < 3 * COSTS.std() / 8


def test_resumed_sampler_replays_the_rest_of_the_epoch():
    plan = batching.plan(COSTS, 64, 2, seed=5, epochs=1, max_tokens=4096, pairs_per_micro_batch=None)
    sampler = batching.TokenBudgetSampler(COSTS, plan, seed=5, rank=1)
    full = list(sampler)
    again = batching.TokenBudgetSampler(COSTS, plan, seed=5, rank=1)  # a new process after a requeue
    assert list(again)[10:] == full[10:] and len(again) == len(full)


# --- one optimizer step's gradient, whatever the micro-batching and world size ----------------------------------------

CUTS = {
    "16 pairs in one micro-batch": ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"],
    "4 micro-batches of 4 pairs": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"],
    "token budget 2048": ["--pairs_per_step", "16", "--max_tokens_per_microbatch", "2048"],
    "token budget 6000": ["--pairs_per_step", "16", "--max_tokens_per_microbatch", "6000"],
}
# One plain SGD step at learning rate 1: the weights move by exactly minus the step's gradient.
ONE_SGD_STEP = ["--max_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
                "--warmup_steps", "0", "--save_strategy", "no", "--report_to", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(48, seed=7)))
    return path


def one_step_update(tmp_path, model_dir, pairs_file, cut, processes=1):
    """The weight change of one optimizer step of `train_dpo.py` (with `processes` > 1: DeepSpeed ZeRO-2 through
    `accelerate launch`, as on a cluster)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", model_dir, "--dataset_name",
            str(pairs_file), "--output_dir", str(out), "--max_tokens_per_microbatch", "None", "--pairs_per_step",
            "None", *ONE_SGD_STEP, *cut]  # fmt: skip
    launcher = [sys.executable]
    if processes > 1:
        launcher = [str(ROOT / ".venv" / "bin" / "accelerate"), "launch", "--config_file",
                    str(ROOT / "accelerate_config.yaml"), "--num_processes", str(processes)]  # fmt: skip
    env = {**os.environ, "DPOTRAIN_CACHE": str(tmp_path / "cache"),
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # fmt: skip
    result = subprocess.run([*launcher, str(ROOT / "train_dpo.py"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["world_size"] == processes
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    return {name: after[name] - before[name] for name in before}


@pytest.mark.slow
def test_one_step_has_the_same_gradient_whatever_the_micro_batching_and_world_size(
    tmp_path, tiny_model_dir, pairs_file
):
    want = one_step_update(tmp_path / "base", tiny_model_dir, pairs_file, CUTS["16 pairs in one micro-batch"])
    runs = {name: one_step_update(tmp_path / name.replace(" ", "-"), tiny_model_dir, pairs_file, cut)
            for name, cut in CUTS.items() if name != "16 pairs in one micro-batch"}  # fmt: skip
    runs["ZeRO-2, 2 processes, token budget 2048"] = one_step_update(
        tmp_path / "w2-budget", tiny_model_dir, pairs_file, CUTS["token budget 2048"], processes=2
    )
    runs["ZeRO-2, 2 processes x 2 micro-batches of 4 pairs"] = one_step_update(
        tmp_path / "w2-fixed", tiny_model_dir, pairs_file,
        ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"], processes=2,
    )  # fmt: skip
    assert max(float(d.abs().max()) for d in want.values()) > 1e-3  # the step moved the weights
    for name, got in runs.items():
        for param, d in want.items():
            assert (got[param] - d).abs().max() <= 1e-6 + 1e-5 * d.abs().max(), (name, param)

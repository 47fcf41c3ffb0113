"""The plan at scale: the same plans as before it was made fast, a Think-sized run planned in seconds, and any budget
>= 2 x max_length cuts every step (ranks short of a micro-batch run a filler)."""

import dataclasses
import hashlib
import json
import sys

import numpy as np
import pytest

from conftest import ROOT
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.plan import plan
from dpotrain.plan.plan import StepPlan
from test_plan import heavy_tailed  # the same mix, at the same MAX_LENGTH (8192)

sys.path.insert(0, str(ROOT / "benchmarks"))
from lengths_like import dolci_think  # noqa: E402

MAX_LENGTH = 8192
# Digests of the plans of the cases below, recorded from plan.py before planning was made fast (commit fdcbfa8), with
# this file's `cases` and `digest`: each a sha256 of the JSON of `plan_run(lengths, p, 2)`, or "refused <the budget
# the refusal named>".
RECORDED = json.loads((ROOT / "tests" / "data" / "plan_digests.json").read_text())


def think(n: int, seed: int, share: bool) -> PairLengths:
    prompt, chosen, rejected = dolci_think(n, seed)
    kept = prompt < MAX_LENGTH
    mode = "keep_start" if seed % 2 else "keep_end"
    return PairLengths.from_parts(prompt[kept], chosen[kept], rejected[kept], MAX_LENGTH, share, mode)


MIXES = {
    "heavy-1531-0": lambda: heavy_tailed(1531, 0),
    "heavy-3001-3": lambda: heavy_tailed(3001, 3),
    "think-2000-1-shared": lambda: think(2000, 1, True),
    "think-2000-2-shared": lambda: think(2000, 2, True),
    "think-2500-5": lambda: think(2500, 5, False),
}


BUDGET_WORLDS, FIXED_WORLDS = (1, 3, 16, 64, 128), (1, 4, 16)  # the world sizes recorded, by kind of case


def cases(worlds=(1, 3, 4, 16, 64, 128)):
    """(key, mix, StepPlan) for every recorded case with these world sizes."""
    for name in MIXES:
        for world in (w for w in worlds if w in BUDGET_WORLDS):
            for budget in (2 * MAX_LENGTH, 24000, 65536):
                for padded in (False, True):
                    for pps in (128, 200):
                        key = f"{name} w{world} b{budget} pps{pps} {'padded' if padded else 'packed'}"
                        yield key, name, StepPlan(pps, world, 11, budget, None, padded)
        for world in FIXED_WORLDS:
            if world in worlds:
                yield f"{name} w{world} fixed3", name, StepPlan(128, world, 11, None, 3, False)


def digest(planned) -> str:
    return hashlib.sha256(json.dumps(planned).encode()).hexdigest()[:16]


def check_valid(lengths: PairLengths, p: StepPlan, planned) -> None:
    """Every pair once per epoch, the same micro-batch count on every rank, each within the budget; fillers (empty)
    only where no equal count of non-empty micro-batches exists: then every pair is alone and a rank has at most
    one filler."""
    for epoch in planned:
        assert sorted(i for step in epoch for rank in step for mb in rank for i in mb) == list(range(len(lengths)))
        for step in epoch:
            assert len({len(rank) for rank in step}) == 1
            assert all(p.cost(lengths, mb) <= p.max_tokens for rank in step for mb in rank if mb)
            fillers = [sum(1 for mb in rank if not mb) for rank in step]
            if any(fillers):
                n = sum(len(mb) for rank in step for mb in rank)
                assert n % p.world_size and len(step[0]) == n // p.world_size + 1 and max(fillers) == 1
                assert all(len(mb) == 1 for rank in step for mb in rank if mb)
                assert all(rank[-1] == [] for rank, f in zip(step, fillers, strict=True) if f)  # fillers come last


def check_recorded(worlds) -> int:
    checked, made = 0, {}
    for key, name, p in cases(worlds):
        lengths = made.setdefault(name, MIXES[name]())
        recorded = RECORDED[key]
        if recorded.startswith("refused"):
            # Refused before for want of an equal count of non-empty micro-batches: now planned, with fillers.
            check_valid(lengths, p, plan.plan_run(lengths, p, 2))
        else:
            assert digest(plan.plan_run(lengths, p, 2)) == recorded, key
        checked += 1
    return checked


@pytest.mark.slow
def test_the_plans_are_the_ones_recorded_before_planning_was_made_fast():
    assert check_recorded(worlds=(3, 64)) == 120


@pytest.mark.slow
@pytest.mark.extended  # the fast test checks a subset of the same recorded plans
def test_every_recorded_plan_is_the_same():
    assert check_recorded(worlds=sorted({*BUDGET_WORLDS, *FIXED_WORLDS})) == len(RECORDED) == 315  # 4: fixed3 only


class Whole(np.ndarray):
    """A per-pair array of PairLengths that counts the passes over all of it (a ufunc given the whole array), whatever
    they cost on this machine: planning that reads its arrays whole per pair or per step is what took minutes."""

    passes = 0
    whole: tuple = ()  # the shape of a whole per-pair array (`counted`)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        Whole.passes += any(isinstance(x, Whole) and x.shape == self.whole for x in inputs)
        return getattr(ufunc, method)(*(np.asarray(x) if isinstance(x, Whole) else x for x in inputs), **kwargs)


def counted(lengths: PairLengths) -> PairLengths:
    """The same lengths, each per-pair array a `Whole` (its derived arrays, computed from them, plain ones)."""
    Whole.whole, Whole.passes = lengths.chosen.shape, 0
    fields = {f.name: getattr(lengths, f.name) for f in dataclasses.fields(lengths)}
    return PairLengths(**{name: None if a is None else np.asarray(a).view(Whole) for name, a in fields.items()})


@pytest.mark.slow
def test_a_think_sized_run_is_planned_in_seconds():
    """150k Dolci-Think-like pairs, the think recipe's budget and steps, 64 ranks: the plan of one epoch in a few passes
    over the pairs' lengths (before: one per pair read, not planned after 24 minutes). Its CPU time is measured by
    `python benchmarks/plan.py --timing` (BENCHMARKS.md), not asserted here: a test must not depend on the load."""
    prompt, chosen, rejected = dolci_think(150_000, seed=0)
    lengths = counted(PairLengths.from_parts(prompt, chosen, rejected, 16384, share=True))
    p = StepPlan(128, 64, 42, 65536, None)
    planned = plan.plan_run(lengths, p, 1)
    assert len(planned[0]) == -(-150_000 // 128)  # the last step: 112 pairs
    # 2 here (the packed cost, computed once and kept): with the cost computed again at each read, 60,592 for 20k pairs
    assert Whole.passes < 10, Whole.passes
    plan.summary(lengths, p, planned)
    assert Whole.passes < 10, Whole.passes  # 3


def long_multi_turn(n: int, max_length: int, seed: int = 0) -> PairLengths:
    """Long multi-turn prompts: every pair's longer side over half of max_length, so two pairs never share a padded
    micro-batch of 2 x max_length."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(max_length // 2 + 1, max_length, n)
    return PairLengths.from_parts(prompt, rng.integers(50, 3000, n), rng.integers(50, 3000, n), max_length)


@pytest.mark.parametrize("world", [64, 128])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "packed"])
def test_a_budget_of_twice_max_length_is_never_refused(world, padded):
    """The issue's case: 3,001 pairs, max_length 4096, budget 8192; the last 57 pairs join the step before (185
    pairs), so ranks get 2 or 3 pairs that each need a micro-batch of their own: all ranks run 3, some a filler."""
    lengths = long_multi_turn(3001, 4096)
    p = StepPlan(128, world, 42, 8192, None, padded)
    planned = plan.plan_run(lengths, p, 2)
    check_valid(lengths, p, planned)
    last = planned[0][-1]
    assert sum(len(mb) for rank in last for mb in rank) == 185
    fillers = sum(1 for rank in last for mb in rank if not mb)
    assert len(last[0]) == 185 // world + 1 and fillers == world * len(last[0]) - 185
    summary = plan.summary(lengths, p, planned)
    assert summary["filler_micro_batches"] == 2 * fillers  # the same last step in both epochs
    assert summary["pairs_per_micro_batch"]["min"] == 1  # fillers are not micro-batches of 0 pairs in the records


def test_a_filler_reads_a_pair_of_its_rank_and_is_marked():
    rows = plan.StepRows(_Rows())
    read = rows[((7, 3), (5,), ())]
    assert [filler for _, filler in read] == [False, False, True]
    assert read[2][0] == [{"i": 5}]  # the rank's last pair: the lightest of its lightest micro-batch
    batch = plan.StepCollator(lambda r: {"ids": [x["i"] for x in r]})([read])
    assert [mb.get(plan.FILLER, False) for mb in batch["micro_batches"]] == [False, False, True]


@pytest.mark.parametrize("pairs, world, batch_size", [(13, 2, 1), (9, 8, 1), (5, 4, 1), (13, 2, 8), (7, 4, 2)])
def test_an_evaluation_a_rank_is_a_pair_short_of_ends_with_a_filler_of_its_first_pair(pairs, world, batch_size):
    """Held-out pairs the ranks cannot share equally at per_device_eval_batch_size 1 (13 on 2 processes: 7 and 6)
    gave the short rank an empty batch, which the collator met as "max() arg is an empty sequence", a traceback at
    the first evaluation after training. It is a filler of the rank's first pair, marked so its metrics are not
    counted; every pair is evaluated once."""
    every = plan.eval_batches(pairs, world, batch_size)
    assert len({len(batches) for batches in every}) == 1 and all(batches[0] for batches in every)
    assert sorted(i for batches in every for batch in batches for i in batch) == list(range(pairs))
    collate = plan.BatchCollator(lambda r: {"ids": [x["i"] for x in r]})
    for batches in every:
        rows = plan.StepRows(_Rows(), stand_in=batches[0][0])
        read = [collate([rows[(tuple(batch),)]]) for batch in batches]
        assert [len(b["ids"]) for b in read] == [len(batch) or 1 for batch in batches]
        assert [b.get(plan.FILLER, False) for b in read] == [not batch for batch in batches]
        assert all(b["ids"] == [batches[0][0]] for b in read if b.get(plan.FILLER))


def test_an_evaluation_batch_past_the_token_budget_is_cut_and_every_rank_keeps_as_many_batches():
    """13 pairs of 1,000 positions on 2 ranks, 8 a batch, a budget of 2,500: batches of 2 pairs (7 on one rank: 4
    batches; 6 on the other: 3 and a filler)."""
    every = plan.eval_batches(13, 2, 8, lambda pairs: 1000 * len(pairs), 2500)
    assert every == [[[0, 1], [2, 3], [4, 5], [6]], [[7, 8], [9, 10], [11, 12], []]]


class _Rows:
    def __getitems__(self, index):
        return [{"i": i} for i in index]


@pytest.mark.slow
def test_a_filler_changes_nothing_a_step_computes(tmp_path, tiny_model_dir):
    """3 long pairs, a budget of one pair per micro-batch (2 x max_length), one SGD step: on 2 ZeRO-2 processes rank 1
    gets 1 pair and runs a filler beside rank 0's 2 micro-batches; the update, the loss and the tokens counted equal
    one process's 3 micro-batches."""
    from test_plan import ONE_SGD_STEP, launch, weights

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Tell me about {words[i]}."}],
            "chosen": [{"role": "assistant", "content": " ".join(words[(i + k) % 12] for k in range(120))}],
            "rejected": [{"role": "assistant", "content": " ".join(words[(i * k) % 12] for k in range(120))}],
        }
        for i in range(3)
    ]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cut = ["--pairs_per_step", "3", "--max_length", "64", "--max_tokens_per_microbatch", "128", "--logging_steps", "1"]
    runs = {}
    for processes in (1, 2):
        out = tmp_path / f"w{processes}"
        launch(
            tmp_path / f"l{processes}",
            tiny_model_dir,
            ["--dataset_name", str(data), "--output_dir", str(out), *ONE_SGD_STEP, *cut],
            processes,
        )
        batching = json.loads((out / "resolved_config.json").read_text())["derived"]["batching"]
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[processes] = (weights(out), batching, next(m for m in metrics if "loss" in m))
    before = weights(tiny_model_dir)
    (one, one_batching, one_log), (two, two_batching, two_log) = runs[1], runs[2]
    assert one_batching["filler_micro_batches"] == 0 and one_batching["micro_batches_per_step"]["max"] == 3
    assert two_batching["filler_micro_batches"] == 1 and two_batching["micro_batches_per_step"]["max"] == 2
    moved = max(float((one[name] - before[name]).abs().max()) for name in before)
    assert moved > 1e-3  # the step moved the weights
    for name in before:
        d1, d2 = one[name] - before[name], two[name] - before[name]
        assert (d2 - d1).abs().max() <= 1e-6 + 1e-5 * d1.abs().max(), name
    assert two_log["num_tokens"] == one_log["num_tokens"]
    assert abs(two_log["loss"] - one_log["loss"]) < 1e-6

"""Every engine, every forward, the reference scored or reused: the same collectives on every rank.

{ZeRO-2, ZeRO-3, FSDP2} x {packed with shared prompts, packed, padded} x {reference scored in the run, reference reused
from an earlier run}, each a real `accelerate launch` of 2 gloo processes with the shipped engine config, samples at
step 0 and evaluation on: per-step losses and evaluation equal to one process (1e-4; rewards within the rounding of
their log-probs), and the reference log-probs the 2 processes scored (in the stage's own micro-batches, on 2 ranks)
equal to one process's (1e-5 relative). Each launch is bounded in time: a rank left waiting in a collective fails its
test with the output so far, its process group killed, instead of stalling the suite.

The fast part (CI) is the padded forward under ZeRO-3 with a reused reference, the one whose samples at step 0 left
ZeRO-3 unable to train at step 1 when no reference scoring ran before them, and under FSDP2 with half the reference
reused and half scored (an interrupted stage resumed, with FSDP2's sharded weights): the path whose ranks used to run
different numbers of forwards (each picked its row groups alone). The rest is `extended` (beyond CI's budget).
"""

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
import yaml

from conftest import ROOT, launch_env, python, rank_python, run_bounded, smoke_command, torchrun_launch

ENGINES = {
    "zero2": "accelerate_config.yaml",
    "zero3": "configs/accelerate/zero3.yaml",
    "fsdp2": "configs/accelerate/fsdp2.yaml",
}
# Each forward asked for: a run decides its own from the pairs (forwards/choice.py), on these packing unshared
FORWARDS = {
    "shared": ["--share_prompt", "true"],
    "packed": ["--share_prompt", "false"],
    "padded": ["--padding_free", "false"],
}
FORWARD_RECORD = {"shared": "packed, prompts shared", "packed": "packed", "padded": "padded"}
RUN = [
    "--max_steps",
    "3",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--report_to",
    "none",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "2",
    "--samples_every",
    "2",
    "--sample_count",
    "2",
    "--sample_max_new_tokens",
    "6",
]
LIMIT_S = 480  # per launch; a 2-process run takes 1-2 min on 2 busy cores
FAST = {("zero3", "padded", "reused"), ("fsdp2", "padded", "partial")}
BEYOND_CI = (pytest.mark.slow, pytest.mark.extended)  # ~25 min together on 2 cores: `scripts/test.sh -m extended`
CASES = [
    pytest.param(e, f, r, marks=() if (e, f, r) in FAST else BEYOND_CI, id=f"{e}-{f}-{r}")
    for e in ENGINES
    for f in FORWARDS
    for r in ("scored", "reused", "partial")
    if r != "partial" or (e, f, r) in FAST
]


def launch(out, cache, model_dir, data, *args, config=None, limit=LIMIT_S) -> str:
    """`train_dpo.py` with the smoke recipe, one process or 2 through `accelerate launch`; its output. Killed with its
    whole process group (launcher and ranks) past `limit` seconds: the test fails, naming the hang."""
    launcher = [python()]
    if config:
        launcher = [
            str(ROOT / ".venv" / "bin" / "accelerate"),
            "launch",
            "--config_file",
            str(ROOT / config),
            "--num_processes",
            "2",
            *rank_python(),
        ]
    env = launch_env(cache)
    cmd = smoke_command(launcher, model_dir, "--dataset_name", str(data), "--output_dir", str(out), *args)
    start = time.monotonic()
    code, log, _ = run_bounded(cmd, limit, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if code is None:
        pytest.fail(
            f"{' '.join(args)} under {config or 'one process'} did not finish in {limit} s (a rank waiting in "
            f"a collective the others never run?): killed\n{log[-3000:]}"
        )
    assert code == 0, log[-4000:]
    print(f"{config or 'one process'} {' '.join(args)}: {time.monotonic() - start:.0f} s")
    return log


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, splits):
    """One process per forward, run on first use: its output folder and its reference cache (scored in the run)."""
    folder, runs = tmp_path_factory.mktemp("one"), {}

    def run(forward: str):
        if forward not in runs:
            out, cache = folder / forward, folder / f"{forward}-cache"
            launch(out, cache, tiny_model_dir, splits, *RUN, *FORWARDS[forward])
            runs[forward] = out, cache
        return runs[forward]

    return run


def metrics(out) -> dict:
    """{(step, "train" | "eval"): record} of metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], "eval" if "eval_loss" in r else "train"): r for r in records}


def reference_scores(cache) -> dict:
    """{pairs: {"chosen": ..., "rejected": ...}} of every finished reference in `cache` (one per data split)."""
    out = {}
    for path in cache.glob("reference/*/complete.npz"):
        with np.load(path) as f:
            out[len(f["chosen"])] = {"chosen": f["chosen"], "rejected": f["rejected"]}
    return out


BETA = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())["beta"]


def tolerance(record: dict, metric: str) -> float:
    """1e-4 of the value; a reward, beta x (log-prob - reference log-prob), also carries the fp32 rounding of the
    log-probs it is a difference of (a few ulps of |logps|, ~1e-4 at 700 nats): at step 1 the policy is the reference,
    and the rewards are that rounding alone."""
    tol = 1e-4 * max(1, abs(record[metric]))
    if "rewards/" in metric:
        prefix = metric.split("rewards/")[0]  # "" or "eval_"
        logps = abs(record[f"{prefix}logps/chosen"]) + abs(record[f"{prefix}logps/rejected"])
        tol += BETA * 2 * float(np.finfo(np.float32).eps) * logps
    return tol


def samples(out) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("engine, forward, reference", CASES)
def test_two_processes_compute_what_one_process_computes(
    engine, forward, reference, tmp_path, tiny_model_dir, splits, one_process
):
    base, base_cache = one_process(forward)
    cache = tmp_path / "cache"
    if reference != "scored":  # the one-process run's cache: a rerun, or training after a --reference-only job
        shutil.copytree(base_cache, cache)
    # The training split: the 24 of its 48 pairs the 3 steps of 8 train (all the reference stage scores of it)
    if reference == "partial":  # an interrupted stage: the first half of the pairs saved, the rest to score
        (folder,) = {p.parent for p in cache.glob("reference/*/complete.npz") if len(np.load(p)["chosen"]) == 24}
        with np.load(folder / "complete.npz") as f:
            half = np.arange(12)
            np.savez(folder / "part-earlier-r0.npz", index=half, chosen=f["chosen"][half], rejected=f["rejected"][half])
        (folder / "complete.npz").unlink()
    out = tmp_path / "run"
    log = launch(out, cache, tiny_model_dir, splits, *RUN, *FORWARDS[forward], config=ENGINES[engine])

    said = {"reused": "all 24 pairs reused", "scored": "24 scored", "partial": "12 reused from an interrupted run, 12"}
    assert [r for r, line in said.items() if line in log] == [reference]
    if reference != "reused":  # scored on 2 processes in the stage's micro-batches: one process's numbers
        want, got = reference_scores(base_cache), reference_scores(cache)
        assert sorted(got) == sorted(want) == [12, 24]  # the evaluation split, and the training pairs the steps train
        for pairs, side in [(p, s) for p in want for s in ("chosen", "rejected")]:
            relative = np.abs(got[pairs][side] - want[pairs][side]) / np.maximum(1, np.abs(want[pairs][side]))
            assert relative.max() <= 1e-5, (pairs, side, relative.max())
    derived = json.loads((out / "resolved_config.json").read_text())["derived"]
    assert derived["world_size"] == 2
    assert derived["batching"]["forward"].startswith(FORWARD_RECORD[forward])
    want, got = metrics(base), metrics(out)
    assert list(got) == list(want) == [(1, "train"), (2, "train"), (2, "eval"), (3, "train"), (3, "eval")]
    for key, record in want.items():
        for metric in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins", "logps/chosen"):
            if metric in record:
                assert abs(got[key][metric] - record[metric]) <= tolerance(record, metric), (key, metric)
    # Samples at step 0 (the base model, before any update) and at step 2, written once by the main process.
    assert [s["step"] for s in samples(out)] == [0, 0, 2, 2]
    assert [s["completion"] for s in samples(out)][:2] == [s["completion"] for s in samples(base)][:2]
    assert (out / "model.safetensors").is_file()


RANKS_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head
from dpotrain.forwards import padded

dist.init_process_group("gloo")
rank = dist.get_rank()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
add_fused_lm_head(model)
calls = []
model.register_forward_pre_hook(lambda *args: calls.append(1))
# rank 0: rows of very different lengths (several groups); rank 1: one pair of equal lengths (one group)
lengths = [[90, 80, 61, 60, 33, 31, 9, 8], [20, 20]][rank]
ids = torch.randint(5, 500, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(rank))
mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
inputs = dict(input_ids=ids * mask, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
runs = {}
for lockstep in (False, True):
    model.zero_grad()
    calls.clear()
    log_probs = padded.GroupedModel(model, padded.row_groups(lengths), lockstep)(fused_lm_head=True, **inputs).log_probs
    log_probs.sum().backward()
    runs[lockstep] = len(calls), log_probs.detach(), [p.grad.clone() for p in model.parameters()]
(alone, lp_alone, grad_alone), (together, lp_together, grad_together) = runs[False], runs[True]
# A file per rank: the ranks' prints share one pipe, and one rank's line can land inside the other's.
with open(f"{sys.argv[2]}/rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "alone": alone, "together": together,
               "log_probs": float((lp_alone - lp_together).abs().max()),
               "grads": max(float((a - b).abs().max()) for a, b in zip(grad_alone, grad_together))}, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_padded_ranks_run_as_many_forwards_as_the_rank_that_wants_the_most(tmp_path, tiny_model_dir):
    """Two gloo ranks, one with rows that cut into several groups and one with a single group: alone each runs its own
    count (under ZeRO-3 or FSDP2, a hang); in lockstep both run the larger count, with the same log-probs and
    gradients as alone, to kernel rounding (the fillers add zero)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    result = subprocess.run(
        [
            *torchrun_launch(),
            "--standalone",
            "--nproc_per_node",
            "2",
            *rank_python(),
            str(script),
            tiny_model_dir,
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    many, one = reports
    assert one["alone"] == 1 < many["alone"]  # what each rank would run on its own
    assert many["together"] == one["together"] == many["alone"]
    for r in reports:
        assert r["log_probs"] <= 1e-6 and r["grads"] <= 1e-5, r  # other row groups: other kernel shapes

"""The GPU benchmarks keep running: their CPU modes (--tiny) end to end, and the layer count their GPU defaults take
from the memory plan. Their figures are not checked here (a loaded 2-core CPU says nothing about a GPU)."""

import argparse
import json
import subprocess
import sys

import pytest

from conftest import ROOT, python

sys.path.insert(0, str(ROOT / "benchmarks"))


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python(), *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_end_to_end_tiny_writes_its_tables(tmp_path):
    result = bench(
        "benchmarks/end_to_end.py",
        "--tiny",
        "--out",
        str(tmp_path),
        "--data",
        "think",
        "--paths",
        "trl",
        "project",
        "--steps",
        "2",
        "--profile-step",
        "2",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    saved = json.loads((tmp_path / "results.json").read_text())
    rows = {r["path"]: r for r in saved["results"]}
    assert set(rows) == {"trl", "project"} and all("failed" not in r for r in rows.values()), rows
    # The project's step 2 under torch.profiler (the CPU's self time here): every kernel counted once, by kind
    profile = rows["project"]["profile"]
    assert "profile" not in rows["trl"] and profile["step"] == 2 and profile["self_time_of"] == "cpu"
    assert sum(profile["by_kind"].values()) == pytest.approx(1, abs=0.01) and profile["by_kind"]["matmul"] > 0
    assert profile["top"][0]["ms"] >= profile["top"][-1]["ms"] > 0 and profile["total_ms"] > profile["top"][0]["ms"]
    assert "Self CPU" in (tmp_path / "think-project" / "profile.txt").read_text()
    assert rows["project"]["reference_s"] > 0 and rows["trl"]["reference_s"] == 0  # TRL's reference is live
    assert all(r["steps"] == 2 and r["tokens_per_s_per_gpu"] > 0 for r in rows.values())
    assert rows["trl"]["pair_tokens"] == rows["project"]["pair_tokens"]  # the same pairs, whole, on both
    # Equal settings, those the project's run took (its stages: the forward, then the memory plan for it): the
    # weights' dtype, bf16 autocast, 1 layer in 2 checkpointed (--tiny forces what the plan picks at 7B width), the
    # pairs per step; printed for both sides.
    settings = ("dtype", "mixed_precision", "checkpointing_every_n_layers", "checkpointed_layers", "pairs_per_step")
    assert {k: rows["trl"][k] for k in settings} == {k: rows["project"][k] for k in settings}, rows
    assert rows["project"]["checkpointing_every_n_layers"] == 2 and rows["project"]["mixed_precision"] == "bf16"
    assert rows["project"]["plan_attention"] in rows["project"]["forward"]  # planned for the forward it took
    assert "think trl: dtype float32, mixed_precision bf16, checkpointing_every_n_layers 2" in result.stdout
    # The layer search at 7B width for an 80 GiB GPU ran to the plan's refusal
    assert 4 <= saved["layers_that_fit"] < 32 and "memory plan: one process on 1 GPU needs" in result.stdout
    assert rows["project"]["first_step_compute_s"] + rows["project"]["first_step_compile_s"] == pytest.approx(
        rows["project"]["first_step_s"], abs=2e-3
    )
    table = (tmp_path / "results.md").read_text()
    assert "| think | trl |" in table and "think: end to end" in table  # a PASS or FAIL line, never asserted


@pytest.mark.extended
def test_end_to_end_tiny_under_zero2_launches_both_under_deepspeed(tmp_path):
    """--engine zero2: the project and plain TRL each under `accelerate launch` with accelerate_config.yaml."""
    result = bench(
        "benchmarks/end_to_end.py",
        "--tiny",
        "--engine",
        "zero2",
        "--out",
        str(tmp_path),
        "--data",
        "think",
        "--paths",
        "trl",
        "project",
        "--steps",
        "2",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["path"], r.get("deepspeed")) for r in rows] == [("project", True), ("trl", True)], rows
    # DeepSpeed loads bf16 weights (engine.load_dtype): plain TRL too, and the same checkpointed layers
    settings = [(r["dtype"], r["checkpointing_every_n_layers"], r["pairs_per_step"]) for r in rows]
    assert settings == [("bfloat16", 2, 4)] * 2, rows


@pytest.mark.slow
def test_attention_tiny_runs_on_cpu():
    result = bench(
        "benchmarks/attention.py",
        "--device",
        "cpu",
        "--tiny",
        "--micro-batches",
        "2",
        "--warmup",
        "0",
        "--paths",
        "trl",
        "shared_sdpa",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert rows[0]["layers"] == 4 and rows[0]["checkpointing"] == "all"
    assert [r["path"] for r in rows[1:]] == ["trl", "shared_sdpa"] and all(r["pair_tokens_per_s"] > 0 for r in rows[1:])


@pytest.mark.slow
def test_attention_default_layers_fit_the_plan():
    """On an 80 GB H100 at the default budget: without checkpointing few 7B-width layers fit, with every other layer
    checkpointed more; the count chosen fits with the plan's allowance and one more would not."""
    import attention
    from transformers import Olmo3Config

    from dpotrain.plan import memory

    gpu = 79.6 * memory.GIB
    config = Olmo3Config(vocab_size=100_278, max_position_embeddings=65536)
    counts = {}
    for every in (None, 2):
        args = argparse.Namespace(
            device="cuda",
            tiny=False,
            budget=65536,
            max_length=16384,
            every=every,
            paths=["trl", "shared_sdpa"],
            hidden=4096,
        )
        counts[every] = n = attention.layers_that_fit(gpu, config, args)
        for layers, fits in ((n, True), (n + 1, False)):
            trial = Olmo3Config(
                vocab_size=100_278,
                max_position_embeddings=65536,
                num_hidden_layers=layers,
                layer_types=attention.layer_types(layers),
            )
            need = attention.planned_bytes(trial, "sdpa", args) * (1 + memory.FRAGMENTATION)
            assert (need + memory.CONTEXT_GIB * memory.GIB <= gpu) is fits, (every, layers)
    assert 1 <= counts[None] < counts[2]

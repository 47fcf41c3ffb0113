"""Long jobs on many ranks: FSDP2 launches whose rank 0 would write whole checkpoints are refused, and the gradients a
process holds between micro-batches are what the plan counts, under each engine (real `accelerate launch`es of 2 CPU
processes, gloo). That every process group has the recipe's collective timeout, that FSDP2 checkpoints are sharded and
resume exactly, and that the final model is one plain HF folder, are checked on the launches that already train under
each engine: tests/test_distributed.py (ZeRO-2) and tests/test_engines.py (ZeRO-3, FSDP2, DDP)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, accelerate_launch, rank_python
from dpotrain.cluster import engine
from dpotrain.recipe.errors import ConfigError


@pytest.mark.parametrize("value", ["FULL_STATE_DICT", "LOCAL_STATE_DICT"])
def test_an_fsdp2_launch_whose_rank_0_writes_whole_checkpoints_is_refused(value, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", value)
    with pytest.raises(ConfigError, match=f"fsdp_state_dict_type {value} is not supported: set fsdp_state_dict_type"):
        engine.launched()
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    assert engine.launched().name == "fsdp2"


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", ["accelerate_config.yaml", "configs/accelerate/zero3.yaml", "configs/accelerate/fsdp2.yaml"]
)
def test_gradients_held_between_micro_batches_are_what_the_plan_counts(config):
    """benchmarks/between_micro_batches.py under each engine: after a step's first micro-batch, the gradients a
    process holds are at most what the plan counts among its model states (ZeRO-2's partition may hold a parameter
    that straddles its boundary whole: 5%); FSDP2 holds no unsharded gradient between micro-batches. (16 tokens per
    micro-batch: what a process holds does not depend on them, and bf16 on a CPU is slow: 256 took 40 s a launch.)"""
    bin_dir = os.path.dirname(sys.executable)
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / config),
        "--num_processes",
        "2",
        *rank_python(),
        str(ROOT / "benchmarks" / "between_micro_batches.py"),
        "--layers",
        "2",
        "--hidden",
        "256",
        "--tokens",
        "16",
    ]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:]
    record = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    held = record["held_gradient_bytes"]
    assert record["deferred"] is False and record["world"] == 2
    assert 0 < sum(held.values()) <= 1.05 * record["planned_gradient_bytes"], record
    if "unsharded" in held:
        assert held["unsharded"] == 0, record

"""Long jobs on many ranks: FSDP2 launches whose rank 0 would write whole checkpoints are refused, and the gradients a
process holds between micro-batches are what the plan counts, under each engine (real `accelerate launch`es of 2 CPU
processes, gloo). That every process group has the recipe's collective timeout, that FSDP2 checkpoints are sharded and
resume exactly, and that the final model is one plain HF folder, are checked on the launches that already train under
each engine: tests/test_distributed.py (ZeRO-2) and tests/test_engines.py (ZeRO-3, FSDP2, DDP)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, accelerate_launch, python, rank_python
from dpotrain.cluster import engine
from dpotrain.recipe.errors import ConfigError
from dpotrain.train import resume


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


def test_an_fsdp2_checkpoint_resumes_under_fsdp2_alone(tmp_path):
    """transformers loads FSDP's shards under FSDP alone: one process, DDP or DeepSpeed loaded the model and scored the
    reference, then raised "Checkpoint found at ... is only supported when using PyTorch FSDP" (seen for one process).
    The layout is an FSDP2 checkpoint's of 2 processes, as tests/test_engines.py's launch writes it."""
    checkpoint = tmp_path / "checkpoint-2"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        (checkpoint / part).mkdir(parents=True)
        for rank in (0, 1):
            (checkpoint / part / f"__{rank}_0.distcp").write_bytes(b"")
    for name, world, processes in (("single", 1, "1 process"), ("ddp", 2, "2 processes"), ("zero2", 2, "2 processes")):
        with pytest.raises(ConfigError) as refused:
            resume.check_partitions(str(checkpoint), world, engine.Engine(name))
        assert str(refused.value) == (
            f"checkpoint {str(checkpoint)!r} holds FSDP2 shards (written by 2 processes), which only an FSDP2 launch "
            f"loads, and this run is {name} ({processes}): resume it under FSDP2 "
            "(ACCELERATE_CONFIG=configs/accelerate/fsdp2.yaml, on any number of GPUs), or start afresh (a new "
            "--output_dir)"
        )
    for world in (2, 4):  # torch.distributed.checkpoint reshards: test_an_fsdp2_run_resumes_on_more_processes...
        resume.check_partitions(str(checkpoint), world, engine.Engine("fsdp2"))


def test_a_whole_checkpoint_is_refused_by_an_fsdp2_launch(tmp_path):
    """A checkpoint of one process or DDP (whole weights and `optimizer.pt`) resumed under FSDP2 (a requeue switched to
    it to fit memory) loaded the model and scored the reference, then torch.distributed.checkpoint ended every rank in
    `AssertionError: metadata is None` for the shards it looked for. The layout is a one-process checkpoint's."""
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (checkpoint / name).write_bytes(b"")
    for name in ("single", "ddp"):
        resume.check_partitions(str(checkpoint), 2, engine.Engine(name))
    with pytest.raises(ConfigError) as refused:
        resume.check_partitions(str(checkpoint), 2, engine.Engine("fsdp2"))
    assert str(refused.value) == (
        f"checkpoint {str(checkpoint)!r} was written without FSDP2 (one process or DDP: whole weights and "
        "optimizer.pt), and this run is FSDP2 (2 processes), which loads only its own shards: resume it with the "
        "launch that wrote it, or start afresh (a new --output_dir) from its weights (--model_name_or_path on a "
        "copy of the checkpoint folder)"
    )


def test_a_zero_checkpoint_resumes_under_the_zero_stage_that_wrote_it_alone(tmp_path):
    """A requeue switched from ZeRO-2 to ZeRO-3 (the fix for a model whose Adam state does not fit a GPU) loaded the
    model and scored the reference, then DeepSpeed ended every rank in a bare `AssertionError` (its ZeRO-3 model-state
    files are per rank; ZeRO-2's one is not). The layouts are those 2-process launches of each stage write."""
    written = {
        "zero2": ["mp_rank_00_model_states.pt"],
        "zero3": [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)],
    }
    for stage, other in (("zero2", "zero3"), ("zero3", "zero2")):
        checkpoint = tmp_path / stage / "checkpoint-2"
        (checkpoint / "global_step2").mkdir(parents=True)
        for name in [*written[stage], *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))]:
            (checkpoint / "global_step2" / name).write_bytes(b"")
        resume.check_partitions(str(checkpoint), 2, engine.Engine(stage))
        with pytest.raises(ConfigError) as refused:
            resume.check_partitions(str(checkpoint), 2, engine.Engine(other))
        assert str(refused.value) == (
            f"checkpoint {str(checkpoint)!r} was written by {engine.NAMES[stage]}, whose optimizer and model state "
            f"{engine.NAMES[other]} cannot load: resume it under {engine.NAMES[stage]} "
            f"({resume.ZERO_CONFIGS[stage]}), or start afresh (a new --output_dir) from its weights "
            "(--model_name_or_path on a copy of the checkpoint folder)"
        )


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_bf16_zero_checkpoint_is_known_for_deepspeeds_and_resumes_on_its_processes(stage, tmp_path):
    """Under bf16 (every GPU recipe) DeepSpeed names its optimizer shards `bf16_zero_pp_rank_*` (engine.py's
    `_get_zero_ckpt_prefix`), which the look for `zero_pp_rank_*` missed: every requeue of a bf16 ZeRO run was refused
    as "written without DeepSpeed", and a resume on another number of processes went on to DeepSpeed's error after
    the model loaded. The layouts are those 2-process bf16 launches of each stage write (ZeRO-2's measured on a CPU)."""
    models = (
        ["mp_rank_00_model_states.pt"]
        if stage == "zero2"
        else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
    )
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "global_step2").mkdir(parents=True)
    for name in [*models, *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))]:
        (checkpoint / "global_step2" / name).write_bytes(b"")
    resume.check_partitions(str(checkpoint), 2, engine.Engine(stage))
    with pytest.raises(ConfigError, match="partitioned over 2 processes, and this run has 1"):
        resume.check_partitions(str(checkpoint), 1, engine.Engine(stage))
    with pytest.raises(ConfigError, match="holds DeepSpeed ZeRO optimizer state, and this run does not use DeepSpeed"):
        resume.check_partitions(str(checkpoint), 2, engine.Engine("ddp"))


@pytest.mark.slow
def test_an_fsdp2_run_resumes_on_more_processes_with_the_same_weights_and_is_refused_on_one(tmp_path):
    """docs said to resume an FSDP2 run on the same number of GPUs, and nothing checked it. A run of 2 processes,
    resumed from its step-2 checkpoint on 4: torch.distributed.checkpoint reshards weights and optimizer state, and
    the run ends with the uninterrupted run's losses and weights. Resumed by one process: refused before the data
    loads (a ValueError once the model had loaded and the reference was scored)."""
    from safetensors.torch import load_file

    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--max_steps", "4", "--save_steps", "2"]
    args += ["--logging_steps", "1", "--report_to", "none", "--samples_every", "0"]

    def run(out, processes: int | None) -> subprocess.CompletedProcess:
        launch = [python()]
        if processes:
            config = str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")
            launch = [*accelerate_launch(), "--config_file", config, "--num_processes", str(processes), *rank_python()]
        cmd = [*launch, str(ROOT / "train_dpo.py"), *args, "--output_dir", str(out)]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    def losses(out) -> dict:
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r}

    whole = tmp_path / "whole"
    assert run(whole, 2).returncode == 0
    for out in (tmp_path / "four", tmp_path / "one"):
        shutil.copytree(whole, out)
        shutil.rmtree(out / "checkpoint-4")
        (out / "run_complete.json").unlink()
    result = run(tmp_path / "four", 4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resuming from {tmp_path}/four/checkpoint-2" in result.stdout + result.stderr
    assert list(losses(whole)) == [1, 2, 3, 4]
    assert losses(tmp_path / "four") == pytest.approx(losses(whole), abs=1e-6)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(tmp_path / "four" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6  # 4e-9: another order of reduction

    result = run(tmp_path / "one", None)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: checkpoint '{tmp_path}/one/checkpoint-2' holds FSDP2 shards (written by 2 processes)")
    )
    assert "Data (train)" not in result.stdout + result.stderr


@pytest.mark.slow
def test_an_fsdp2_launch_with_use_cpu_shards_and_its_rerun_resumes(tmp_path):
    """`--use_cpu true` (how a bf16 run goes on a CPU) made accelerate's state MULTI_CPU, which never becomes FSDP: the
    FSDP2 launch trained as DDP under a record of FSDP2, wrote whole checkpoints, and the same command rerun after a
    kill was refused ("written without FSDP2"). Now it shards, and its rerun resumes from its checkpoint."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    data = tmp_path / "pairs16.jsonl"
    data.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:16]))
    config = str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")
    out = tmp_path / "run"
    cmd = [*accelerate_launch(), "--config_file", config, "--num_processes", "2", *rank_python()]
    cmd += [str(ROOT / "train_dpo.py"), "--config", str(ROOT / "configs" / "smoke.yaml"), "--dataset_name", str(data)]
    cmd += ["--output_dir", str(out), "--save_steps", "1", "--warmup_steps", "0", "--report_to", "none"]
    cmd += ["--bf16", "true", "--use_cpu", "true"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DDP constructor" not in result.stderr  # DDP's own warning, printed when it wrapped the model
    assert (out / "checkpoint-1" / "pytorch_model_fsdp_0").is_dir() and not (
        out / "checkpoint-1" / "optimizer.pt"
    ).exists()
    shutil.rmtree(out / "checkpoint-2")  # as if killed after step 1's checkpoint
    (out / "run_complete.json").unlink()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resuming from {out}/checkpoint-1" in result.stdout + result.stderr

"""The sbatch scripts, as users submit them, on a real Slurm; and their launch line for several nodes."""

import json
import os
import shutil
import subprocess
import time

import pytest
from safetensors.torch import load_file

from conftest import ROOT

SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + sorted(ROOT.glob("tests/slurm/*.sh")) + [ROOT / ".ci" / "run"]
SMOKE_JOB = ["--gpus-per-node=0", "scripts/dpo_train.sh", "--max_steps", "10", "--logging_steps", "1",
             "--save_steps", "1000", "--report_to", "none"]  # fmt: skip
RUN_FILES = ["model.safetensors", "tokenizer.json", "resolved_config.json", "metrics.jsonl", "training_curves.png",
             "README.md", "run_complete.json"]  # fmt: skip


def steps(output_dir) -> list[int]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def weights(output_dir):
    return load_file(str(output_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """The smoke recipe through the very same scripts/dpo_train.sh, submitted with --gpus-per-node=0."""
    out = tmp_path_factory.mktemp("slurm") / "plain"
    env = {**slurm.env, "RECIPE": "configs/smoke.yaml"}
    job = slurm.sbatch([*SMOKE_JOB, "--output_dir", str(out)], cwd=ROOT, env=env)
    state = slurm.wait(job, timeout=600)
    return job, state, out


@pytest.mark.slurm
@pytest.mark.slow
def test_smoke_job_completes_with_log_and_outputs(slurm, uninterrupted):
    job, state, out = uninterrupted
    log = ROOT / "logs" / f"dpo-think-{job}.out"
    assert state == "COMPLETED", log.read_text()[-3000:] if log.exists() else slurm.job_info(job)
    text = log.read_text()
    assert f"=== DPO job {job} (dpo-think) restart 0" in text
    assert "batch: 8 pairs per step = 4 per process x 2 accumulation x 1 processes" in text
    assert "training exited with code 0" in text
    for name in RUN_FILES:
        assert (out / name).is_file(), name
    assert steps(out) == list(range(1, 11))


@pytest.mark.slurm
@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_and_ends_like_an_uninterrupted_one(slurm, uninterrupted, tmp_path):
    _, plain_state, plain = uninterrupted
    assert plain_state == "COMPLETED"
    out = tmp_path / "preempted"
    env = {**slurm.env, "RECIPE": "configs/smoke.yaml"}
    job = slurm.sbatch([*SMOKE_JOB, "--output_dir", str(out)], cwd=ROOT, env=env)

    deadline = time.time() + 400
    while len(steps(out)) < 3:  # mid-training: a few optimizer steps done, most still to come
        assert time.time() < deadline and slurm.state(job) in ("PENDING", "RUNNING"), slurm.job_info(job)
        time.sleep(0.2)
    slurm.signal(job, "USR1")  # what --signal=B:USR1@<seconds> delivers before the time limit

    assert slurm.wait(job, timeout=600) == "COMPLETED"
    info = slurm.job_info(job)
    log = (ROOT / "logs" / f"dpo-think-{job}.out").read_text()
    assert info["Restarts"] == "1", log[-3000:]
    assert "signal received: checkpointing at the next optimizer step" in log
    assert "requeueing job" in log and "Resuming from" in log and "restart 1" in log
    assert steps(out) == list(range(1, 11))  # every optimizer step once: none repeated, none skipped
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 10
    a, b = weights(plain), weights(out)
    assert all((a[k] - b[k]).abs().max().item() < 1e-6 for k in a), "resumed run diverged from the uninterrupted one"


def print_launch(nodes: int, *train_args: str, gpus: str = "4") -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"LAUNCH_PRINT_ONLY": "1", "RECIPE": "configs/think.yaml", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_GPUS_PER_NODE": gpus, "SLURM_JOB_NODELIST": f"gpu[07-{6 + nodes:02d}]"}  # fmt: skip
    result = subprocess.run(["bash", "scripts/launch.sh", *train_args], cwd=ROOT, env=env, capture_output=True,
                            text=True, check=True)  # fmt: skip
    return result.stdout.strip()


@pytest.mark.parametrize("nodes", [2, 4])
def test_multi_node_launch_line(nodes):
    line = print_launch(nodes, "--learning_rate", "8e-8", gpus="h100:4")
    assert line.startswith(f"srun --nodes={nodes} --ntasks-per-node=1 ")
    for part in [f"--num_machines {nodes}", f"--num_processes {4 * nodes}", "--main_process_ip gpu07",
                 "--deepspeed_multinode_launcher standard", "--config_file accelerate_config.yaml",
                 "train_dpo.py --config configs/think.yaml --learning_rate 8e-8"]:  # fmt: skip
        assert part in line, part
    # Run the line with a stand-in srun that shows what each node's bash receives: the machine rank must still be
    # the variable, evaluated per node, not the batch shell's value.
    shown = subprocess.run(["bash", "-c", f'srun() {{ printf "%s" "${{@: -1}}"; }}; SLURM_PROCID=0; {line}'],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--machine_rank $SLURM_PROCID " in shown


def test_job_refuses_a_batch_its_size_cannot_reach():
    # 3 nodes x 4 GPUs = 12 processes x 4 pairs each: 128 pairs per step is not a whole number of micro-steps.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"RECIPE": "configs/think.yaml", "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_PER_NODE": "4",
            "SLURM_JOB_NODELIST": "gpu[01-03]"}  # fmt: skip
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "pairs_per_step=128 is not reachable with 12 process(es)" in result.stderr
    assert "launch: srun" not in result.stdout  # refused before anything was launched


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed (scripts/test.sh installs it)")
@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_shellcheck(script):
    result = subprocess.run(["shellcheck", "--severity=error", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout

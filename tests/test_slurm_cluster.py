"""The test Slurm cluster itself: a job with the project's GPU header runs, and a requeue reruns.

Run: .venv/bin/python -m pytest tests/test_slurm_cluster.py -m slurm
Needs root (the cluster installs slurm with apt and runs its daemons as root); skipped otherwise.
"""

import textwrap
import time

import pytest

from slurm_cluster import start_slurm_cluster

pytestmark = pytest.mark.slurm


# Same GPU request as the project's sbatch scripts: this GPU-less node runs it only when the
# submission overrides it with --gpus-per-node=0. %x is the job name, i.e. the script's file name.
HEADER = """\
#!/bin/bash
#SBATCH --gpus-per-node=4
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --output=%x-%j.out
"""


def write_script(path, body):
    path.write_text(HEADER + textwrap.dedent(body))
    return path


def test_second_start_reuses_running_cluster(slurm):
    again = start_slurm_cluster(slurm.state_dir)
    assert not again.started_here
    assert again.slurm_conf == slurm.slurm_conf


def test_gpu_header_needs_override(slurm, tmp_path):
    script = write_script(tmp_path / "job.sh", "echo never\n")
    with pytest.raises(RuntimeError, match="Invalid generic resource"):
        slurm.sbatch([str(script)], cwd=tmp_path)


def test_job_completes_with_gpus_per_node_0(slurm, tmp_path):
    script = write_script(
        tmp_path / "hello.sh",
        """\
        echo "hello from job $SLURM_JOB_ID"
        echo "gpus per node: $SLURM_GPUS_PER_NODE"
        """,
    )
    job = slurm.sbatch(["--gpus-per-node=0", script.name], cwd=tmp_path)
    assert slurm.wait(job, timeout=30) == "COMPLETED"
    info = slurm.job_info(job)
    assert info["ExitCode"] == "0:0"
    assert info["Restarts"] == "0"
    out = tmp_path / f"hello.sh-{job}.out"
    assert info["StdOut"] == str(out)
    assert out.read_text() == (f"hello from job {job}\ngpus per node: 0\n")


def test_requeued_job_reruns_and_appends(slurm, tmp_path):
    script = write_script(
        tmp_path / "requeue.sh",
        """\
        if [[ ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
            echo "first run"
            scontrol requeue "$SLURM_JOB_ID"
            sleep 60  # killed by the requeue
            echo "not killed by the requeue"
        else
            echo "second run, restart $SLURM_RESTART_COUNT"
        fi
        """,
    )
    t0 = time.monotonic()
    job = slurm.sbatch(["--gpus-per-node=0", script.name], cwd=tmp_path)
    # wait() must not stop at the requeue (REQUEUED, then PENDING again).
    assert slurm.wait(job, timeout=60) == "COMPLETED"
    elapsed = time.monotonic() - t0
    assert slurm.job_info(job)["Restarts"] == "1"
    lines = (tmp_path / f"requeue.sh-{job}.out").read_text().splitlines()
    # --open-mode=append keeps the first run's output; slurmstepd adds its own line in between.
    assert lines[0] == "first run"
    assert lines[-1] == "second run, restart 1"
    assert any("DUE TO JOB REQUEUE" in line for line in lines[1:-1])
    assert "not killed by the requeue" not in lines
    assert elapsed < 60, f"requeue to rerun took {elapsed:.0f}s (cred_expire=5 should make it ~10 s)"


def test_signal_reaches_batch_shell_trap(slurm, tmp_path):
    # The payload runs in the background and the shell `wait`s: a bash trap only runs between
    # foreground commands, so a foreground `sleep 60` would delay it for a minute.
    script = write_script(
        tmp_path / "trap.sh",
        """\
        trap 'echo "got USR1"; kill $pid; exit 0' USR1
        echo ready
        sleep 60 & pid=$!
        wait $pid
        echo "trap did not run"
        """,
    )
    job = slurm.sbatch(["--gpus-per-node=0", script.name], cwd=tmp_path)
    out = tmp_path / f"trap.sh-{job}.out"
    deadline = time.monotonic() + 30
    while not (out.exists() and "ready" in out.read_text()):
        assert time.monotonic() < deadline, f"job {job} never started: {slurm.job_info(job)}"
        time.sleep(0.2)
    slurm.signal(job, "USR1")
    assert slurm.wait(job, timeout=30) == "COMPLETED"
    assert out.read_text() == "ready\ngot USR1\n"

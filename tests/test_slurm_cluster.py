"""The test Slurm cluster itself: a job with the project's GPU header runs, and a requeue reruns.

Run: .venv/bin/python -m pytest tests/test_slurm_cluster.py -m slurm
Needs root (the cluster installs slurm with apt and runs its daemons as root); skipped otherwise.
"""

import datetime
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


@pytest.mark.slow
def test_requeued_job_reruns_and_appends(slurm, tmp_path):
    script = write_script(
        tmp_path / "requeue.sh",
        """\
        if [[ ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
            echo "first run"
            echo "requeued at $(date +%s)"
            scontrol requeue "$SLURM_JOB_ID"
            # Killed by the requeue. slurmstepd may signal the sleep before the shell, which then goes on for a moment:
            # the line says the sleep outlived the requeue, not that the shell took a moment to die.
            sleep 60 && echo "not killed by the requeue"
        else
            echo "second run, restart $SLURM_RESTART_COUNT"
        fi
        """,
    )
    job = slurm.sbatch(["--gpus-per-node=0", script.name], cwd=tmp_path)
    # wait() must not stop at the requeue (REQUEUED, then PENDING again).
    assert slurm.wait(job, timeout=300) == "COMPLETED"
    info = slurm.job_info(job)
    assert info["Restarts"] == "1"
    lines = (tmp_path / f"requeue.sh-{job}.out").read_text().splitlines()
    # --open-mode=append keeps the first run's output; slurmstepd adds its own line in between.
    assert lines[0] == "first run" and lines[1].startswith("requeued at ")
    assert lines[-1] == "second run, restart 1"
    assert any("DUE TO JOB REQUEUE" in line for line in lines[1:-1])
    assert "not killed by the requeue" not in lines
    # The rerun's begin time is Slurm's own stamp, the requeue's time + cred_expire + 1 (tests/slurm/cluster.sh): ~6 s
    # with the cluster's cred_expire=5, 121 s with Slurm's default; the stamps are the job's, not how long the test
    # took, and the margin is for the moment between the script's `date` and slurmctld's handling of the requeue.
    eligible = datetime.datetime.fromisoformat(info["EligibleTime"]).timestamp()
    waited = eligible - int(lines[1].removeprefix("requeued at "))
    # above 0: the stamp is the requeue's, not the first submission's
    assert 0 < waited < 60, f"requeued job eligible {waited:.0f} s after its requeue (cred_expire=5: ~6 s)"


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


def node_cpus(slurm) -> int:
    return int(slurm.run(["sinfo", "-h", "-N", "-o", "%c"]).stdout.split()[0])


def test_a_step_gets_one_core_unless_it_asks_for_the_jobs_cpus(slurm, tmp_path):
    """Tasks are bound to their CPUs as on clusters that bind to cores (task/affinity), and srun, as since Slurm
    22.05, does not inherit the job's --cpus-per-task: the bug scripts/launch.sh avoids with SRUN_CPUS_PER_TASK."""
    cpus = node_cpus(slurm)
    if cpus < 2:
        pytest.skip("a one-CPU node cannot show a step getting fewer CPUs than its job")
    script = write_script(
        tmp_path / "cpus.sh",
        """\
        echo "batch: $(nproc)"
        echo "step: $(srun --quiet nproc)"  # --quiet: no "step creation temporarily disabled, retrying" in the log
        echo "step with SRUN_CPUS_PER_TASK: $(SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK srun --quiet nproc)"
        """,
    )
    job = slurm.sbatch(["--gpus-per-node=0", f"--cpus-per-task={cpus}", script.name], cwd=tmp_path)
    assert slurm.wait(job, timeout=60) == "COMPLETED"
    out = (tmp_path / f"cpus.sh-{job}.out").read_text()
    assert out == f"batch: {cpus}\nstep: 1\nstep with SRUN_CPUS_PER_TASK: {cpus}\n"


# A job that says which signals reach its batch shell and its step, and what Slurm says of it once the step is over.
# The step writes what it got to a file of its own: on scancel, srun is signalled too and may be torn down before it
# relays the step's last line into the job's log (seen on CI), so the log cannot tell whether the step got TERM.
# The step's shell ends by its trap only: proctrack/linuxproc signals a step's processes one by one, and on a busy
# machine the sleep died, `wait` returned and the shell ended before its own SIGTERM came (seen once on CI). So the
# shell loops, and its trap kills the sleep it may have started again in that moment: an orphaned sleep kept the step,
# hence srun and the job, alive until Slurm's SIGKILL (seen on CI: a preempted job still RUNNING 60 s after its
# preemption, a cancelled one COMPLETING 60 s after scancel with its batch shell killed).
SIGNALLED = """\
trap 'echo "batch got TERM"' TERM
srun bash -c 'trap "echo step got TERM >step-$SLURM_JOB_ID.log; kill \\$! 2>/dev/null; exit 0" TERM; echo ready
  while :; do sleep 300 & wait; done' & pid=$!
while :; do wait $pid; kill -0 $pid 2>/dev/null || break; done
scontrol show job -o "$SLURM_JOB_ID" | tr ' ' '\\n' | grep -E '^(JobState|Reason|PreemptTime)='
"""


def wait_for_line(path, text, job, slurm, timeout=60):
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"job {job}: no {text!r} in its log: {slurm.job_info(job)}"
        time.sleep(0.2)


def what_slurm_saw(slurm, out) -> str:
    """A failure's message: the job's log and the end of each daemon's, to tell a missed signal from a lost write."""
    parts = [f"job log:\n{out.read_text() if out.exists() else '(none)'}"]
    for log in sorted((slurm.state_dir / "log").glob("*")):
        parts.append(f"{log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    return "\n".join(parts)


@pytest.mark.slow
def test_preemption_signals_the_steps_and_a_job_that_ends_within_its_grace_time_is_not_requeued(slurm, tmp_path):
    """What scripts/launch.sh builds on: a job preempted by one in the higher-priority partition gets SIGTERM in its
    steps at once, none in its batch shell, and stays RUNNING through the partition's GraceTime; a job that ends in
    that time ends COMPLETED and is not requeued: it has to requeue itself."""
    cpus = node_cpus(slurm)
    script = write_script(tmp_path / "preempted.sh", SIGNALLED)
    job = slurm.sbatch(["--gpus-per-node=0", f"--cpus-per-task={cpus}", script.name], cwd=tmp_path)
    out = tmp_path / f"preempted.sh-{job}.out"
    wait_for_line(out, "ready", job, slurm)
    urgent = slurm.sbatch(
        ["--partition=urgent", f"--cpus-per-task={cpus}", "--output=/dev/null", "--wrap", "true"], cwd=tmp_path
    )
    assert slurm.wait(job, timeout=60) == "COMPLETED", what_slurm_saw(slurm, out)
    assert slurm.job_info(job)["Restarts"] == "0"
    step_log = tmp_path / f"step-{job}.log"
    assert step_log.exists() and step_log.read_text() == "step got TERM\n", what_slurm_saw(slurm, out)
    lines = [line for line in out.read_text().splitlines() if not line.startswith("slurmstepd")]
    assert lines[0] == "ready" and "batch got TERM" not in lines, lines
    assert "JobState=RUNNING" in lines and not any(line == "PreemptTime=None" for line in lines), lines
    assert slurm.wait(urgent, timeout=60) == "COMPLETED"


def test_scancel_signals_the_batch_shell_too_and_the_job_is_no_longer_running(slurm, tmp_path):
    """How scripts/launch.sh tells a cancelled job (not to requeue) from a preempted one: the same SIGTERM reaches
    the steps, but the job is already COMPLETING, and its batch shell is signalled as well."""
    script = write_script(tmp_path / "cancelled.sh", SIGNALLED)
    job = slurm.sbatch(["--gpus-per-node=0", script.name], cwd=tmp_path)
    out = tmp_path / f"cancelled.sh-{job}.out"
    wait_for_line(out, "ready", job, slurm)
    slurm.cancel(job)
    assert slurm.wait(job, timeout=60) == "CANCELLED"
    wait_for_line(out, "JobState=", job, slurm)
    lines = out.read_text().splitlines()
    assert {"batch got TERM", "JobState=COMPLETING", "Reason=None"} <= set(lines), lines
    # The step gets the SIGTERM, unless srun, signalled once more as the step is aborted, kills it first ("srun: forcing
    # job termination", seen once in CI on a busy machine): a cancelled job's processes may not get to save.
    step_log = tmp_path / f"step-{job}.log"
    if step_log.exists():
        assert step_log.read_text() == "step got TERM\n"
    else:
        assert "srun: forcing job termination" in lines, lines

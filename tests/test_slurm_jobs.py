"""The sbatch scripts, as users submit them, on a real Slurm; and their launch line for several nodes."""

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import ROOT, launch_smoke_meanwhile, warm_venv
from dpotrain.cluster import job as job_module
from slurm_cluster import SUBMIT_DIR, TERMINAL_STATES, states_once_a_second

SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + sorted(ROOT.glob("tests/slurm/*.sh")) + [ROOT / ".ci" / "run"]


def readme_cpu_example() -> tuple[dict[str, str], list[str]]:
    """The README's CPU-only submission: its variables, and the sbatch options up to and including the script."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.endswith("# CPU-only node"))
    words = shlex.split(line.split("#")[0])
    env = dict(w.split("=", 1) for w in words[: words.index("sbatch")])
    return env, words[words.index("sbatch") + 1 : words.index("scripts/dpo_train.sh") + 1]


SECRET = "hf_dpotrainTestSecret123"  # a --hub_token value the job's log must never show
# The README's CPU-only example as written, with more steps (room to stop it mid-training), no W&B, and a token given
# on the command line.
README_ENV, README_SBATCH = readme_cpu_example()
# Room for the stop to land mid-training on a loaded machine: the scontrol requeue is sent at step 3; a stop arriving
# after the last step ends the job COMPLETED unstopped (12 steps left ~9 of margin, seconds at CI's load).
README_JOB_STEPS = 20
SMOKE_JOB = [
    *README_SBATCH,
    "--max_steps",
    str(README_JOB_STEPS),
    "--logging_steps",
    "1",
    "--save_steps",
    "1000",
    "--report_to",
    "none",
    "--hub_token",
    SECRET,
]
RUN_FILES = [
    "model.safetensors",
    "tokenizer.json",
    "resolved_config.json",
    "metrics.jsonl",
    "training_curves.png",
    "README.md",
    "run_complete.json",
]


def steps(output_dir) -> list[int]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def weights(output_dir):
    return load_file(str(output_dir / "model.safetensors"))


SCRIPT = str(ROOT / "scripts" / "dpo_train.sh")


def submit_dir() -> Path:
    SUBMIT_DIR.mkdir(parents=True, exist_ok=True)
    return SUBMIT_DIR


def log_path(job: int, submitted_from=SUBMIT_DIR) -> Path:
    """Where the README says a job's log is: sbatch's --output, in the folder the job was submitted from."""
    return Path(submitted_from) / f"dpo-think-{job}.out"


def readme_run_uninterrupted(out: Path):
    """What the README's job computes without a preemption: its launch, with the job's arguments, outside Slurm, in a
    thread (`launch_smoke_meanwhile`: a Future of its output folder). Its reference is its own (DPOTRAIN_CACHE), scored
    beside the job's, not read from it."""
    args = [*SMOKE_JOB[SMOKE_JOB.index("scripts/dpo_train.sh") + 1 :], "--output_dir", str(out)]
    return launch_smoke_meanwhile(out, 1, args, env={"DPOTRAIN_CACHE": f"{out}-cache"})


@pytest.fixture(scope="module")
def readme_job(slurm, tmp_path_factory):
    """The README's CPU example through the very same scripts/dpo_train.sh, submitted with --gpus-per-node=0 by its
    full path from a folder outside the project that has no logs/ subfolder, its data and output folder named relative
    to that folder (as a user types them there); requeued mid-training by `scontrol requeue` (its user's, or an admin's
    moving it off a node: Slurm sends the SIGTERM of scancel and requeues the job itself); run to its end, then
    requeued once more, its data file moved away meanwhile (test_a_requeue_of_the_finished_job_...). The tests
    below check this one job (a job start is ~30 s; the scontrol requeue had a job of its own until session 38).
    Until session 71 the job was first preempted by the time-limit warning's USR1 and requeued by launch.sh, a start
    more: the two-node job of tests/test_slurm_multinode.py is stopped so, and resumes like its uninterrupted run. The
    uninterrupted run it is compared with runs from the requeue on, while the job saves, waits for its requeue's begin
    time and starts again (its dry run is one process of the job's two CPUs); run from the job's submission, it shared
    the CPUs with its first start. Returns (job, its end state, its output folder, the folder submitted from, the
    uninterrupted run's folder, its end state once requeued finished)."""
    folder = tmp_path_factory.mktemp("slurm")
    elsewhere = folder / "submitted-here"
    out = elsewhere / "run"
    elsewhere.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", elsewhere / "my_pairs.jsonl")  # the recipe's own pairs
    args = [str(ROOT / a) if a == "scripts/dpo_train.sh" else a for a in SMOKE_JOB]
    relative = ["--output_dir", "run", "--dataset_name", "my_pairs.jsonl"]
    job = slurm.sbatch([*args, *relative], cwd=elsewhere, env=README_ENV)
    log = log_path(job, elsewhere)
    wait_while_running(slurm, job, lambda: len(steps(out)) >= 3, log=log)  # mid-training: most steps still to come
    slurm.run(["scontrol", "requeue", str(job)])
    plain = tmp_path_factory.mktemp("plain") / "run"
    with readme_run_uninterrupted(plain) as uninterrupted:
        state = slurm.wait(job, timeout=600)
        uninterrupted.result()
    finished = None
    if state == "COMPLETED":  # requeued once more, finished, its data archived meanwhile (one start more, no training)
        archived = folder / "archived.jsonl"
        (elsewhere / "my_pairs.jsonl").rename(archived)
        slurm.run(["scontrol", "requeue", str(job)])
        finished = slurm.wait(job, timeout=300)
        archived.rename(elsewhere / "my_pairs.jsonl")
    return job, state, out, elsewhere, plain, finished


def real_cpus() -> int:
    """This machine's CPUs as slurmd counts them (`slurmd -C`: "NodeName=vm CPUs=2 Boards=1 ...")."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"\bCPUs=(\d+)", out).group(1))


@pytest.mark.slurm
def test_test_node_has_the_real_cpu_count_and_the_readme_example_fits_it(slurm):
    node_cpus = int(slurm.run(["sinfo", "-h", "-N", "-o", "%c"]).stdout.split()[0])
    assert node_cpus == real_cpus(), "the test node claims CPUs it lacks: restart it (tests/slurm/cluster.sh stop)"
    assert README_ENV == {"RECIPE": "configs/smoke.yaml"}
    assert README_SBATCH[:2] == ["--gpus-per-node=0", "--cpus-per-task=2"] and node_cpus >= 2


@pytest.mark.slurm
def test_header_cpus_alone_never_start_on_a_small_node(slurm, tmp_path):
    """Why the README's CPU example passes --cpus-per-task: the header's 32 CPUs pend forever on a smaller node."""
    if real_cpus() >= 32:
        pytest.skip(f"this node has {real_cpus()} CPUs: the header's 32 fit")
    job = slurm.sbatch(["--gpus-per-node=0", "--output=/dev/null", "scripts/dpo_train.sh"], cwd=ROOT, env=README_ENV)
    try:
        deadline = time.time() + 300  # the scheduler's first look at the job: seconds, longer on a loaded machine
        while (info := slurm.job_info(job))["Reason"] not in ("PartitionConfig", "BadConstraints"):
            assert time.time() < deadline and info["JobState"] == "PENDING", info
            time.sleep(0.5)
        assert info["JobState"] == "PENDING"
    finally:
        slurm.cancel(job)


@pytest.mark.slurm
def test_a_time_limit_within_the_checkpoint_warning_is_refused_before_the_plan(slurm, tmp_path):
    """`sbatch --time=5:00 scripts/dpo_train.sh`: the script's --signal=B:USR1@600 would come at once, and the job
    would stop at its first step to checkpoint, requeue, and do it again at every start. One line naming --time, the
    job's last, before the dry run plans it; the job fails, never requeued."""
    log = tmp_path / "short.out"
    options = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    job = slurm.sbatch([*options, "--time=5:00", f"--output={log}", SCRIPT], cwd=tmp_path, env=README_ENV)
    assert slurm.wait(job, timeout=120) == "FAILED", slurm.job_info(job)
    assert slurm.job_info(job)["Restarts"] == "0"
    lines = log.read_text().splitlines()
    assert "checkpoints must be written within 600 s (time-limit warning)" in "\n".join(lines)
    assert re.fullmatch(
        r"error: the job's time limit \([0-9:-]+ left\) is within its checkpoint warning \(--signal=B:USR1@600\), "
        r"which Slurm would send at once: every requeue would stop at its first step to save; submit with --time "
        rf"above 10 minutes, or lower the @600 in {re.escape(SCRIPT)}",
        lines[-1],
    ), lines[-5:]


@pytest.mark.slurm
def test_the_checkpoint_warning_is_the_one_the_job_was_submitted_with_not_the_scripts_edited_since(slurm, tmp_path):
    """Slurm keeps the script's #SBATCH lines as submitted; the file may be edited while the job pends (or before a
    requeue days later). launch.sh read the file: a job submitted with --signal=B:USR1@600 and --time=5:00, whose
    script then said @100, was not refused and trained, to be warned at once by Slurm's real @600 (and a job
    submitted with @100, the file then saying @600, was refused). Read from Slurm's stored copy (`scontrol write
    batch_script`)."""
    log, script = tmp_path / "edited.out", tmp_path / "my_job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --signal=B:USR1@600\n"
        f"exec bash {shlex.quote(str(ROOT / 'scripts' / 'launch.sh'))} --max_steps 2 --report_to none "
        f"--output_dir {shlex.quote(str(tmp_path / 'run'))}\n"
    )
    options = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    job = slurm.sbatch(
        [*options, "--hold", "--time=5:00", f"--output={log}", str(script)], cwd=tmp_path, env=README_ENV
    )
    script.write_text(script.read_text().replace("@600", "@100"))  # edited while the job pends
    slurm.run(["scontrol", "release", str(job)])
    assert slurm.wait(job, timeout=300) == "FAILED", log.read_text()[-3000:]
    assert "error: the job's time limit" in log.read_text() and "(--signal=B:USR1@600)" in log.read_text()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_submitted_from_another_jobs_step_is_its_own_and_a_health_guard_stop_ends_it_with_the_runs_code(
    slurm, tmp_path
):
    """One job for two tests (a job start is ~30-60 s in CI; each had a job of its own until session 71): submitted
    with `sbatch` typed inside another job's step, its training then stopped by a health guard.

    A health stop (exit 3, not requeued, the same command refused) reached the job's log as accelerate's code for any
    worker's failure: the job ended ExitCode 1 with the log's last line "training failed with exit code 1 ... once it
    is fixed, the same sbatch command goes on from the newest complete checkpoint", which the stop refuses. The job now
    ends with the run's 3 and a last line that says what stopped it.

    `sbatch` typed inside another job (a pipeline's batch job, a shell of `srun --pty bash`) hands the job that job's
    SLURM_* variables (sbatch's --export=ALL), and the job read them as its own:
    - SLURM_RESTART_COUNT of a job requeued once, which Slurm leaves as it is at a first start: the banner said
      `restart 1`, and a `scancel` logged "Slurm has requeued job <id> itself" while the job stayed cancelled (both
      read the count launch.sh takes from Slurm's record of the job, scontrol's Restarts=; the scancel of a job that
      stays cancelled: test_two_jobs_sharing_a_node_...);
    - the step's CPU binding (SLURM_CPU_BIND=quiet,mask_cpu:0x1), which srun reads as its --cpu-bind: the training step
      was bound to the submitting step's one CPU ("1 CPUs" in its node line), not the job's;
    - SLURM_GPUS_PER_TASK of a shell that asked for GPUs per task: the job was refused for GPUs it never asked for
      (Slurm's record of it has no TresPerTask), and srun would have asked for them;
    - SLURM_MEM_PER_GPU (or _CPU, _NODE) of a shell that asked for memory so, which srun reads as its own: the training
      step asked the other job's memory, and on this node without GPUs srun refused it after the dry run ("Invalid
      generic resource (gres) specification"). The step now asks for all of the job's memory (srun --mem=0);
    - SLURM_GPUS, _GPUS_PER_SOCKET, _CPUS_PER_GPU, _NTASKS_PER_GPU of an `salloc --gpus=1` (...) shell, which srun
      read as its own the same way (each refused here: the gres error, or "--ntasks-per-node is mutually exclusive
      with --ntasks-per-gpu"): dropped, as Slurm's record of the job has no such request.
    Each of those ended the job before its training, which the health guard's stop at step 2 shows ran."""
    log = tmp_path / "doomed.out"
    options = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    # A learning rate of 1e30 turns the weights non-finite at the first update: the nonfinite guard stops at step 2, a
    # step before the run's last (the reference stage scores the 3 planned steps' pairs: 6 scored twice as many).
    args = ["--max_steps", "3", "--logging_steps", "1", "--warmup_steps", "0", "--learning_rate", "1e30"]
    args += ["--save_steps", "1000", "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    sbatch = ["sbatch", "--parsable", *options, f"--output={log}", SCRIPT, *args]
    # Set inside the step: srun reads all but the first.
    inherited = ["env", "SLURM_RESTART_COUNT=1", "SLURM_GPUS_PER_TASK=1", "SLURM_MEM_PER_GPU=1024", "SLURM_GPUS=1"]
    inherited += ["SLURM_GPUS_PER_SOCKET=1", "SLURM_CPUS_PER_GPU=1", "SLURM_NTASKS_PER_GPU=1"]
    submitted = slurm.run(
        ["srun", "--cpus-per-task=1", "bash", "-c", shlex.join([*inherited, *sbatch])], cwd=tmp_path, env=README_ENV
    )
    job = int(submitted.stdout.split()[-1].split(";")[0])
    assert slurm.wait(job, timeout=300) == "FAILED", slurm.job_info(job)
    info = slurm.job_info(job)
    assert (info["Restarts"], info["ExitCode"]) == ("0", "3:0"), info
    text = log.read_text()
    assert f"=== DPO job {job} (dpo-think) restart 0 at " in text, text[-3000:]
    cpus = int(next(o for o in options if o.startswith("--cpus-per-task=")).split("=")[1])  # the job's, not the step's
    node = re.search(r"^node \S+: machine rank 0 of 1, .*, (\d+) CPUs$", text, re.MULTILINE)
    assert node and int(node[1]) == cpus, text[-3000:]  # on a 1-CPU machine the binding cannot be told apart
    assert "health: training STOPPED at step 2 by the nonfinite guard" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "training stopped by a health guard" in last and "the same command is refused" in last, last
    assert "goes on from the newest complete checkpoint" not in text, text[-3000:]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_whose_training_processes_refuse_to_go_on_points_at_the_error_line_not_a_traceback(slurm, tmp_path):
    """A refusal once the training processes have started (here W&B's server not answering, which the run asks and a
    dry run does not; the output folder's lock, used before, the job's dry run now refuses): each rank ends on one
    `error:` line and exit 2, which accelerate makes 1, and the log's last line said "training failed with exit code 1
    ... its traceback is above that": there is none, and the line to read is the `error:` one. It now says so."""
    log, out = tmp_path / "refused.out", tmp_path / "run"
    sbatch = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    args = ["--max_steps", "2", "--report_to", "wandb", "--output_dir", str(out)]
    # A key (the dry run's check) and a W&B server that refuses the connection (the run's, once its processes start)
    wandb = {"WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_MODE": "online"}
    job = slurm.sbatch([*sbatch, f"--output={log}", SCRIPT, *args], cwd=tmp_path, env={**README_ENV, **wandb})
    assert slurm.wait(job, timeout=300) == "FAILED", slurm.job_info(job)
    text = log.read_text()
    assert re.search(r"^error: report_to wandb, and W&B does not answer here", text, re.M), text[-3000:]
    assert "launch: " in text  # refused by the training processes, not by the job's dry run
    last = text.strip().splitlines()[-1]
    assert "refused to go on" in last and "its 'error:' line above says why and what to do" in last, last
    assert "traceback" not in last, last
    assert not list((ROOT / "logs").glob(f".stop-{job}*"))  # launch.sh's own marker read and removed


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_on_a_folder_a_live_run_holds_ends_at_its_dry_run_before_the_launch(slurm, tmp_path):
    """A second job on the output folder of a live run: its dry run listed nothing (it said the run starts or resumes
    there), so every node started its training processes, each to be refused by the lock. The dry run lists the live
    run's lock now, and the job ends on that line, exit 2, before anything is launched."""
    from dpotrain.cluster import run_lock

    log, out = tmp_path / "held.out", tmp_path / "run"
    sbatch = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    args = ["--max_steps", "2", "--report_to", "none", "--output_dir", str(out)]
    assert run_lock.acquire(out) is None  # another run, live on this node
    try:
        job = slurm.sbatch([*sbatch, f"--output={log}", SCRIPT, *args], cwd=tmp_path, env=README_ENV)
        assert slurm.wait(job, timeout=300) == "FAILED", slurm.job_info(job)
    finally:
        run_lock.release()
    text = log.read_text()
    assert re.search(rf"^error: output_dir .*{re.escape(str(out))}.* is in use by another run", text, re.M), text[
        -3000:
    ]
    assert "launch: " not in text and slurm.job_info(job)["ExitCode"] == "2:0", text[-3000:]


def early_stopped_job(
    slurm, folder: Path, *options: str, env=None, script=SCRIPT, args=("--max_steps", "4")
) -> tuple[int, Path]:
    """The README's CPU job (4 steps, or `args`), sent `scancel --signal=USR1 --batch` as its banner is printed: to the
    batch shell while launch.sh reads the recipe and plans the run, long before it launches training."""
    log = folder / "early.out"
    sbatch = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    args = [*args, "--report_to", "none", "--output_dir", str(folder / "run")]
    env = {**README_ENV, **(env or {})}
    job = slurm.sbatch([*sbatch, *options, f"--output={log}", str(script), *args], cwd=folder, env=env)
    wait_while_running(slurm, job, lambda: log.exists() and "=== DPO job" in log.read_text(), poll=0.05, log=log)
    slurm.signal(job, "USR1")
    return job, log


@pytest.mark.slurm
@pytest.mark.slow
def test_a_time_limit_warning_before_the_launch_ends_the_job_in_one_line_not_in_requeues(slurm, tmp_path):
    """The time-limit warning (--signal=B:USR1@120) reaching the batch shell during the start-up of a job whose limit
    (3 minutes) is just above it: it ended the job by bash's default action, without a line. A requeue would be warned
    as early at every start and never train: the job ends FAILED in one line naming --time, not requeued."""
    job, log = early_stopped_job(slurm, tmp_path, "--time=3", env={"SBATCH_SIGNAL": "B:USR1@120"})
    assert slurm.wait(job, timeout=300) == "FAILED", log.read_text(errors="replace")[-3000:]
    assert slurm.job_info(job)["Restarts"] == "0"
    lines = log.read_text(errors="replace").splitlines()
    assert re.fullmatch(
        r"error: the time-limit warning \(--signal=B:USR1@120\) came before training was launched, in the job's "
        r"start-up of \d+ s \([0-9:]+ left\): every requeue would be warned as early and never train, so the job is "
        r"not requeued; submit with a --time longer than the warning, the start-up and some training, or lower the "
        r"@120 in SBATCH_SIGNAL: the same command goes on from the newest checkpoint",
        lines[-1],
    ), lines[-5:]
    assert not any(line.startswith("launch: ") for line in lines)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_time_limit_warning_that_stops_a_start_before_it_saved_anything_ends_the_job_in_one_line(slurm, tmp_path):
    """The time-limit warning (--signal=B:USR1@60 under a limit of 2 minutes) reaching a start launched but still
    loading (a model that takes longer to load than the job has before its warning: held before the model loads until
    the stop, tests/helpers/slow_checkpoint.py): the start stopped with nothing saved, and launch.sh requeued it; every
    requeue, given the same limit, was warned as early and saved nothing again, taking allocations until someone
    cancelled the job (the smoke recipe under --time=2 and @100: 7 starts, each stopped before the model loaded or
    with 0 of 32 reference pairs saved). Now it ends FAILED in one line naming --time and the warning, as a warning
    before the launch does: one rule.

    The job is submitted with a limit the start cannot reach (10 minutes) and cut once it is held: Slurm's warning then
    comes to a start that is there, however long the start took (a fixed --time=2 raced it: at load 10-25 the warning
    came ~35-60 s in, before the launch or before the hold)."""
    from dpotrain.cluster.job import seconds_left

    project = slow_checkpoint_project(tmp_path / "project")
    held, log = tmp_path / "held", tmp_path / "warned.out"
    held.mkdir()
    sbatch = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    hold = {"SLOW_CHECKPOINT_S": "0", "DPOTRAIN_TEST_HOLD": "start@0", "DPOTRAIN_TEST_HOLD_DIR": str(held)}
    env = {**README_ENV, "SBATCH_SIGNAL": "B:USR1@60", **hold}
    args = ["--max_steps", "4", "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    script = str(project / "scripts" / "dpo_train.sh")
    job = slurm.sbatch([*sbatch, "--time=10", f"--output={log}", script, *args], cwd=tmp_path, env=env)
    wait_while_running(slurm, job, (held / "held-start").exists, log=log)  # launched, held before the model loads
    # The limit in whole minutes (Slurm's unit), 90-150 s from now: Slurm checks time limits every 30 s and warns up to
    # 60 s before the @60, so the warning comes within ~90 s, leaving at least a minute to stop and refuse.
    ran = seconds_left(slurm.job_info(job)["RunTime"])
    slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={-(-(ran + 90) // 60)}"])
    assert slurm.wait(job, timeout=300) == "FAILED", log.read_text(errors="replace")[-3000:]
    assert slurm.job_info(job)["Restarts"] == "0"
    text = log.read_text(errors="replace")
    assert "Stop requested: stopped before the model loaded" in text
    assert re.fullmatch(
        r"error: the time-limit warning \(--signal=B:USR1@60\) came before this start saved anything \(no reference "
        r"pairs, no checkpoint\), in the job's start-up of \d+ s \([0-9:]+ left\): every requeue would be warned as "
        r"early and never train, so the job is not requeued; submit with a --time longer than the warning, the "
        r"start-up and some training, or lower the @60 in SBATCH_SIGNAL: the same command goes on from the newest "
        r"checkpoint",
        text.splitlines()[-1],
    ), text[-3000:]


@pytest.mark.parametrize(("left", "refused"), [("10:59", True), ("11:00", True), ("11:01", False), ("23:50:00", False)])
@pytest.mark.parametrize("when", ["before-launch", "nothing-saved"])
def test_only_the_time_limit_warning_of_a_start_that_saved_nothing_is_refused_a_requeue(left, refused, when):
    """A USR1 that stopped a start before anything was saved (before the launch, or the run's processes say so), with
    the time left within the warning (@600, which Slurm may send up to 60 s early), is the time-limit warning, which
    every requeue would get as early: refused. More time left: `scancel --signal`."""
    from dpotrain.cluster import job
    from dpotrain.recipe.errors import ConfigError

    said = {"before-launch": "before training was launched", "nothing-saved": "before this start saved anything"}
    if refused:
        with pytest.raises(ConfigError, match=rf"came {said[when]}.*, in the job's start-up of 40 s"):
            job.check_warned_start("600", "scripts/dpo_train.sh", left, "40", when)
    else:
        job.check_warned_start("600", "scripts/dpo_train.sh", left, "40", when)


@pytest.mark.slurm
def test_a_relative_chdir_is_the_folder_a_jobs_relative_paths_are_read_in_and_a_dry_run_launches_nothing(
    slurm, tmp_path
):
    """`RECIPE=my.yaml sbatch --chdir exp /path/to/dpotrain/scripts/dpo_train.sh --dataset_name pairs.jsonl ...` typed
    in exp's parent, on a real Slurm: the log, the recipe, the data and the output folder are exp's, as docs/slurm.md
    says of `--chdir DIR` (a dry run: the plan names each).
    And `sbatch scripts/dpo_train.sh --dry-run` is the plan at the job's own size, on its own node, once: a job once
    printed its two summary lines, then started every process of every node, each printing the whole dry run again,
    and ended "training exited with code 0", as if it had trained. (One job for both: a job is ~9 s.)"""
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "my.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", exp / "pairs.jsonl")
    script = [str(ROOT / a) if a == "scripts/dpo_train.sh" else a for a in README_SBATCH]
    args = ["--dataset_name", "pairs.jsonl", "--report_to", "none", "--output_dir", "run", "--dry-run"]
    job = slurm.sbatch(["--chdir", "exp", *script, *args], cwd=tmp_path, env={"RECIPE": "my.yaml"})
    state = slurm.wait(job, timeout=300)
    log = log_path(job, exp).read_text()
    assert state == "COMPLETED", log
    assert f"dry run of {exp / 'my.yaml'}" in log and f"data:          {exp / 'pairs.jsonl'}" in log, log
    assert f"output:        {exp / 'run'}: the run starts there (new)" in log, log
    assert log.count("dry run of ") == 1 and "processes:     1 (" in log, log
    assert "launch: " not in log and "training exited" not in log and not (exp / "run").exists(), log


@pytest.mark.slurm
@pytest.mark.slow
def test_smoke_job_completes_with_log_and_outputs(slurm, readme_job):
    job, state, out, submitted_from, *_ = readme_job
    log = log_path(job, submitted_from)
    assert state == "COMPLETED", log.read_text()[-3000:] if log.exists() else slurm.job_info(job)
    text = log.read_text()  # UTF-8 throughout: srun splits the processes' output at any byte (launch.sh's TQDM_ASCII)
    assert text.isascii(), [line for line in text.splitlines() if not line.isascii()][:3]  # no bar's block characters
    assert f"=== DPO job {job} (dpo-think) restart 0" in text
    assert f"project: {ROOT}  log: {log}" in text  # the banner says where the project and the log are
    # The relative --output_dir and --dataset_name both mean the folder submitted from, and the log says so in full.
    assert sorted(p.name for p in submitted_from.iterdir()) == sorted([log.name, "my_pairs.jsonl", "run"])
    assert f"; output: {out}\n" in text and f"  data:          {submitted_from / 'my_pairs.jsonl'} (split" in text
    assert not (ROOT / "run").exists()
    # A token given on the command line is used but never shown (the banner and the launch line of each of its three
    # starts mask it).
    shown = [line for line in text.splitlines() if line.startswith(("recipe: ", "launch: "))]
    assert len(shown) == 6 and all("--hub_token REDACTED" in line for line in shown), shown  # 3 starts
    assert not any(SECRET in line for line in text.splitlines())
    assert "batch: 8 pairs per step over 1 process, micro-batches of at most 2048 packed tokens" in text
    assert "training exited with code 0" in text
    for name in RUN_FILES:
        assert (out / name).is_file(), name


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_requeued_by_scontrol_saves_and_resumes_from_that_checkpoint(slurm, readme_job):
    """`scontrol requeue <job>` (its user's, or an admin's moving it off a node) while it trains: Slurm sends the
    SIGTERM of scancel, and requeues the job itself. Its process saves, and the requeued job resumes from that
    checkpoint, every step once, and ends like an uninterrupted run. The log said the job had been "preempted, past its
    GraceTime", which it never was. (The README's job: one job for both.)"""
    job, state, out, submitted_from, uninterrupted, _ = readme_job
    log = log_path(job, submitted_from).read_text()
    assert state == "COMPLETED", log[-3000:]
    assert slurm.job_info(job)["Restarts"] == "2", log[-3000:]  # the second requeue: the test below
    first, second = log.split(f"=== DPO job {job} (dpo-think) restart 2", 1)[0].split(
        f"=== DPO job {job} (dpo-think) restart 1", 1
    )
    assert "signal received: checkpointing at the next optimizer step (SIGTERM)" in first, first[-3000:]
    saved = re.search(r"checkpoint (\S+) written; Slurm has requeued job (\d+) itself \(([^)]*)\)", first)
    assert saved and saved[2] == str(job), first[-3000:]
    assert saved[3] == "scontrol requeue, or a preemption past its GraceTime", saved[0]
    assert f"Resuming from {saved[1]}" in second, second[-3000:]
    assert steps(out) == list(range(1, README_JOB_STEPS + 1))  # every optimizer step once: none repeated, none skipped
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == README_JOB_STEPS
    a, b = weights(uninterrupted), weights(out)
    assert all((a[k] - b[k]).abs().max().item() < 1e-6 for k in a), "resumed run diverged from the uninterrupted one"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeue_of_the_finished_job_with_its_data_moved_away_trains_nothing_and_completes(slurm, readme_job):
    """Slurm requeues a job whose run has finished (a node lost as the job ended; here `scontrol requeue` once it
    ended), its data file archived meanwhile. launch.sh's dry run read the data first: `error: dataset ... does not
    exist`, the job FAILED and its `afterok` dependents never started. The requeue reads none of the run's inputs, says
    there is nothing to do and ends COMPLETED, the run's files as they were. (The README's job, requeued by its
    fixture: no job of its own.)"""
    job, _, out, submitted_from, _, finished = readme_job
    log = log_path(job, submitted_from).read_text()
    assert finished == "COMPLETED", log[-3000:]
    last = log.split(f"=== DPO job {job} (dpo-think) restart 2", 1)[1]
    said = f"output_dir {out} holds the run this Slurm job ({job}) finished before it was requeued: nothing to do"
    assert said in last and "error:" not in last, last[-3000:]
    assert "Resuming from" not in last and steps(out) == list(range(1, README_JOB_STEPS + 1))  # nothing trained
    assert json.loads((out / "run_complete.json").read_text())["slurm_job_id"] == str(job)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_readmes_cpu_line_runs_as_printed_right_after_the_demo(slurm, demo_run):
    """The README's order: the demo (its outputs/smoke-dpo now holds a finished run), then its CPU-only sbatch line,
    typed as printed in the project folder by the same newcomer (conftest.demo_run: a fresh shell, nothing
    activated). The job trains to its end beside the demo's run, which it leaves whole."""
    project, env, demo = demo_run
    assert demo.returncode == 0, demo.stdout[-3000:]
    demo_model = (project / "outputs" / "smoke-dpo" / "model.safetensors").read_bytes()
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.endswith("# CPU-only node"))
    line = line.split("  #")[0]
    # DeepSpeed's extensions folder as the session's other jobs use it (its CPU shm op is no longer built at all:
    # upstream.skip_deepspeed_shm_op; a newcomer's first job compiled it, ~45 s here).
    built = {"TORCH_EXTENSIONS_DIR": torch_extensions_dir()}
    typed = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", line], cwd=project, env={**slurm.env, **env, **built},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert typed.returncode == 0, typed.stderr
    job = int(re.fullmatch(r"Submitted batch job (\d+)\n", typed.stdout)[1])
    state = slurm.wait(job, timeout=600)
    log = (project / f"dpo-think-{job}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-3000:]
    words = shlex.split(line)
    out = project / words[words.index("--output_dir") + 1]
    assert f"; output: {out}\n" in log and (out / "run_complete.json").is_file(), log[-3000:]
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == int(
        words[words.index("--max_steps") + 1]
    )
    assert (project / "outputs" / "smoke-dpo" / "model.safetensors").read_bytes() == demo_model


# --- preemption by a higher-priority job, as on shared clusters; CPUs and ports on shared nodes -----------------------

# The test cluster binds tasks to cores (tests/slurm/cluster.sh): without launch.sh passing the job's --cpus-per-task
# on to srun, the training step would get one CPU (tests/test_slurm_cluster.py).
TWO_PROCESSES = {"RECIPE": "configs/smoke.yaml", "CPU_PROCESSES_PER_NODE": "2"}
# Where each stop lands is held for (the test's DPOTRAIN_TEST_HOLD), not raced: the steps and pairs need only leave a
# step to train past the second stop's checkpoint and the reference stage more than its first saved part. They were 40
# and 1,200 (~15 s of training, ~7 s of scoring over 2 processes, in the job and again in its uninterrupted twin) while
# the stops were polled for (session 38 cut them to 720 pairs, lost in the load).
STEPS = 10  # of 30 pairs: the last start trains steps 4-10, the launch.sh written over in place while it does
PAIRS = 300  # the 10 steps' pairs, ~2 s of scoring over 2 processes, saved every 0.2 s: parts before the end


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    from dpotrain.data import builtin

    path = tmp_path_factory.mktemp("pairs") / f"pairs{PAIRS}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(PAIRS, seed=21)))
    return path


def two_process_args(out, data) -> list[str]:
    """STEPS steps of 30 pairs (the whole data set: the reference stage scores the pairs the steps train), no checkpoint
    of its own before the end; the reference stage saves what it scored every 0.2 s. Read by 2 data loader workers
    per process, as the real recipes read with 4 (the smoke recipe with none): a preemption signals every process of
    the job step, the workers too, and one killed by the SIGTERM ended the run at once, exit 1, no checkpoint. The
    uninterrupted twin reads alike; workers only load the batches, in the same order, and change nothing it computes."""
    return [
        "--dataloader_num_workers",
        "2",
        "--dataset_name",
        str(data),
        "--max_steps",
        str(STEPS),
        "--pairs_per_step",
        str(PAIRS // STEPS),
        "--logging_steps",
        "1",
        "--save_steps",
        "1000",
        "--report_to",
        "none",
        "--output_dir",
        str(out),
        "--reference_save_seconds",
        "0.2",
    ]


def two_process_job(slurm, out, data, env=None, script=SCRIPT) -> int:
    """Two training processes on the node (DeepSpeed ZeRO-2 on CPU) through scripts/dpo_train.sh."""
    args = ["--gpus-per-node=0", f"--cpus-per-task={real_cpus()}", str(script), *two_process_args(out, data)]
    return slurm.sbatch(args, cwd=submit_dir(), env={**TWO_PROCESSES, "DPOTRAIN_CACHE": f"{out}-cache", **(env or {})})


def slow_checkpoint_project(folder: Path) -> Path:
    """The project as a job finds it, on a slow file system: a checkpoint asked for by a stop takes SLOW_CHECKPOINT_S
    seconds longer (its train_dpo.py is tests/helpers/slow_checkpoint.py), and its scripts/launch.sh is a copy of its
    own, for a test to write over. Every other entry links to this project; a job submitted as
    `<folder>/scripts/dpo_train.sh` runs in `folder` (dpo_train.sh finds it from the script's path) and keeps its stop
    files in its own logs/."""
    (folder / "scripts").mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in ("train_dpo.py", "logs", "scripts"):
            (folder / entry.name).symlink_to(entry)
    for entry in (ROOT / "scripts").iterdir():
        if entry.name != "launch.sh":
            (folder / "scripts" / entry.name).symlink_to(entry)
    shutil.copy(ROOT / "scripts" / "launch.sh", folder / "scripts" / "launch.sh")
    (folder / "train_dpo.py").symlink_to(ROOT / "tests" / "helpers" / "slow_checkpoint.py")
    return folder


def preempt(slurm) -> int:
    """A job in the higher-priority partition that needs the whole node: Slurm preempts the running job (SIGTERM to
    its steps, SIGKILL after the partition's GraceTime of 90 s: tests/slurm/cluster.sh)."""
    return slurm.sbatch(
        ["--partition=urgent", f"--cpus-per-task={real_cpus()}", "--output=/dev/null", "--wrap", "sleep 2"], cwd=ROOT
    )


def cancel_with_the_steps_sigterm_first(slurm, job: int) -> None:
    """`scancel <job>` with the order its SIGTERMs took in a CI run forced (2 ms apart there): the batch shell's child
    that runs srun (launch.sh's `eval "$line" &`), a process of the batch step, ends on its SIGTERM a second before
    the batch shell gets its own, which lands in the shell's wait for the save (its `sleep 1` signalled too)."""
    listed = slurm.run(["scontrol", "listpids", str(job)]).stdout.splitlines()[1:]
    shell = next(int(f[0]) for f in map(str.split, listed) if f[2:4] == ["batch", "0"])  # PID JOBID STEPID LOCALID
    (child,) = subprocess.run(["pgrep", "-P", str(shell)], capture_output=True, text=True).stdout.split()
    os.kill(int(child), signal.SIGTERM)
    time.sleep(1)
    slurm.cancel(job)


def job_log(job: int) -> str:
    path = log_path(job)
    return path.read_text(errors="replace") if path.exists() else ""  # progress bars cut mid-character


def two_process_plain(out: Path, data: Path):
    """The uninterrupted run a preempted job must end like: the launch `two_process_job` makes, outside Slurm, with
    its own reference (DPOTRAIN_CACHE), in a thread (`launch_smoke_meanwhile`: a Future of its output folder). Started
    as the job's slow checkpoint begins, it runs in that checkpoint's ~35 s of sleep and the requeue's wait, with the
    node's CPUs idle; started with the job, it shared the 2 CPUs with the job's first two starts and lengthened both
    (one after the other, it added ~50 s)."""
    return launch_smoke_meanwhile(out, 2, two_process_args(out, data), env={"DPOTRAIN_CACHE": f"{out}-cache"})


def reference_scores(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The reference log-probs a job kept in its cache (`<output>-cache`: `two_process_job`), as float32 arrays."""
    (path,) = Path(f"{out}-cache").glob("reference/*/complete.npz")
    with np.load(path) as f:
        return f["chosen"], f["rejected"]


def wait_while_running(slurm, job: int, done, timeout: float = 600, poll: float = 0.2, log: Path | None = None) -> None:
    """Poll until `done()`; fail with the job's log (`log`: where it was submitted from, if not SUBMIT_DIR) if the job
    ends first (a requeue, REQUEUED then PENDING, is not an end) or `timeout` passes. `done()` is polled every `poll`
    seconds, the job's state once a second (`states_once_a_second`)."""
    deadline = time.time() + timeout
    state = states_once_a_second(slurm, job)
    while not done():
        if time.time() >= deadline or state()[0] in TERMINAL_STATES:
            text = log.read_text(errors="replace") if log and log.exists() else job_log(job)
            raise AssertionError(f"job {job} ended or timed out ({slurm.job_info(job)}): {text[-3000:]}")
        time.sleep(poll)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_preempted_in_its_reference_stage_then_mid_training_with_a_slow_checkpoint_loses_nothing(
    slurm, tmp_path, pairs_file
):
    """Two processes under accelerate launch (torchrun's agent), preempted twice by a job of the higher-priority
    partition. First in the reference stage: the pairs it scored are kept, the requeued run scores only the rest, and
    the reference ends bit for bit what an uninterrupted job scored. Then mid-training, the checkpoint takes 35 s
    under the partition's 90 s GraceTime (a slow file system, for a checkpoint asked for by a stop only:
    `slow_checkpoint_project`): it completes, the job requeues again, resumes from it and ends like an uninterrupted
    run. (One job for both preemptions: each 2-process job on 2 CPUs is a minute or more.)
    And while its last start trains: launch.sh waits in the job's batch shell for the whole training (days), and bash
    reads a script as it runs it: a launch.sh written over in place meanwhile (an editor saving over it, `cp` of a newer
    checkout onto this one) was read on at the old offset in the new text once the training ended, and a job that had
    trained to its end failed (bash ran half a line: `launch.sh: line 282: 0: command not found`). Bash now reads it
    whole before it runs. (This proof had a job of its own, requeued by scontrol, until session 38.)"""
    out = tmp_path / "run"
    project = slow_checkpoint_project(tmp_path / "project")
    # Each preemption lands where it is meant to, however long sbatch, the scheduler and the signal take on a loaded
    # machine: the first start waits in its reference stage once it saved some pairs, the second at the end of step 3,
    # each until its stop (tests/helpers/slow_checkpoint.py). Polled for, a start scored or trained on meanwhile, and a
    # late preemption found the reference stage over (its seconds of scoring) or the training further on.
    held = tmp_path / "held"
    held.mkdir()
    env = {"SLOW_CHECKPOINT_S": "35", "DPOTRAIN_TEST_HOLD": "reference@0,step-3@1", "DPOTRAIN_TEST_HOLD_DIR": str(held)}
    job = two_process_job(slurm, out, pairs_file, env=env, script=project / "scripts" / "dpo_train.sh")
    wait_while_running(slurm, job, (held / "held-reference").exists)  # some pairs saved
    urgent = [preempt(slurm)]
    wait_while_running(slurm, job, (held / "held-step-3").exists)  # requeued, the reference finished, mid-training
    urgent.append(preempt(slurm))
    with two_process_plain(tmp_path / "plain", pairs_file) as uninterrupted:  # in the slow checkpoint's sleep
        # The last start trains past the checkpoint it resumed from, its batch shell waiting for srun in launch.sh,
        # read before the write below.
        def resumed() -> int | None:
            found = re.search(r"restart 2 .*Resuming from \S+/checkpoint-(\d+)", job_log(job), re.DOTALL)
            return int(found[1]) if found else None

        wait_while_running(slurm, job, lambda: resumed() is not None and len(steps(out)) > resumed())
        launch = project / "scripts" / "launch.sh"
        inode = launch.stat().st_ino
        launch.write_text(launch.read_text().replace("\n", "\n# a line added while the job ran\n", 1))
        assert launch.stat().st_ino == inode  # written over in place, not replaced by a new file
        state = slurm.wait(job, timeout=900)
        plain = uninterrupted.result()
    assert state == "COMPLETED", job_log(job)[-3000:]
    log = job_log(job)
    assert slurm.job_info(job)["Restarts"] == "2", log[-3000:]
    runs = re.split(r"=== DPO job \d+ \(dpo-think\) restart ", log)[1:]
    assert [r.split(" ", 1)[0] for r in runs] == ["0", "1", "2"], log[-3000:]

    # The first preemption: the reference stage stopped with some pairs saved, the requeued run scored the rest.
    stopped = re.search(rf"reference log-probs \(train\): stopped with ([\d,]+) of {PAIRS:,}", runs[0])
    assert stopped, runs[0][-3000:]
    saved = int(stopped.group(1).replace(",", ""))
    assert 0 < saved < PAIRS and "requeueing job" in runs[0]
    assert f"{saved:,} kept from an interrupted run" in runs[1]  # the requeued job scored only the rest
    plain_chosen, plain_rejected = reference_scores(plain)
    chosen, rejected = reference_scores(out)
    assert chosen.tobytes() == plain_chosen.tobytes() and rejected.tobytes() == plain_rejected.tobytes()  # bit for bit

    # The second: mid-training, a checkpoint slower than torchrun's ~30 s shutdown timeout, within the GraceTime.
    step, seconds = (int(x) for x in re.search(r"checkpoint-(\d+) written in (\d+)\.\d s", runs[1]).groups())
    assert 35 <= seconds < 90 and step == 3, runs[1][-3000:]
    assert "requeueing job" in runs[1]
    assert "Received 15 death signal" not in log  # the agent let its workers finish the checkpoint
    assert f"Resuming from {out}/checkpoint-{step}" in runs[2]
    assert "training exited with code 0" in runs[2]  # launch.sh written over in place: the job ends as it started
    assert "checkpoints must be written within 600 s (time-limit warning) and 90 s (partition debug's" in log
    assert f"2 processes, {real_cpus()} CPUs" in log  # the job's CPUs, not one
    assert steps(out) == list(range(1, STEPS + 1))  # every optimizer step once
    a, b = weights(plain), weights(out)
    assert all((a[k] - b[k]).abs().max().item() < 1e-6 for k in a), "resumed run diverged from the uninterrupted one"
    assert all(slurm.wait(u, timeout=300) == "COMPLETED" for u in urgent)


@pytest.mark.slurm
@pytest.mark.slow
def test_two_jobs_sharing_a_node_run_at_once_and_a_cancelled_job_stays_cancelled_and_a_refused_requeue_fails(
    slurm, tmp_path
):
    """Two 2-process jobs on one node at once (one CPU each): each meets its processes at a port of its own (from the
    job id), so both train side by side. Then scancel sends one the SIGTERM of a preemption, but the user wants the
    job to end: it saves and is not requeued, though the SIGTERM reaches the batch shell after srun's parent has
    ended on its own (`cancel_with_the_steps_sigterm_first`): the shell waits KillWait for the save, and its `sleep 1`
    there, ended by the same SIGTERM, ended the shell under set -e, the job's log saying nothing of the checkpoint
    (a job at its time limit was not requeued). The other is one Slurm will not requeue (--no-requeue): it ends FAILED,
    not COMPLETED, so that an `afterok` dependency does not start on an unfinished run.
    The cancelled one is submitted as `sbatch --export=RECIPE=...,... scripts/dpo_train.sh`, its variables named on the
    sbatch line, not ALL: sbatch hands that choice to the job's steps too (SLURM_EXPORT_ENV), and the training step
    started with none of the batch shell's environment, not even PATH, and failed at once ("execve(): bash: No such
    file or directory"), after the dry run had passed. (`--export=NONE` alike.) Its log line of the warning's lead says
    that lead is the script's, since an SBATCH_SIGNAL where it was submitted would not be seen."""
    exported = {
        **TWO_PROCESSES,
        "DPOTRAIN_CACHE": str(tmp_path / "cache"),
        "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
    }
    exported |= {
        k: v for k, v in os.environ.items() if k.startswith(("HF_", "DPOTRAIN_BUILTIN", "WANDB_", "TOKENIZERS"))
    }
    export = "--export=" + ",".join(f"{k}={v}" for k, v in exported.items())  # the test's paths hold no comma
    jobs = {}
    for name, extra in (("cancelled", [export]), ("no-requeue", ["--no-requeue"])):
        args = [
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            *extra,
            SCRIPT,
            # Far more steps than either job reaches before its stop: the two start apart (each a dry run, on the
            # same 2 CPUs), and with 40 the one ahead was at its last step when the other reached step 3, saved its
            # final model instead of a checkpoint and ended COMPLETED (CI, stop 87). The health checks off: on these
            # pairs `loss_floor` stopped a job near step 113 (FAILED before the other reached step 3, session 45), so
            # the 2,000 steps were not the margin they meant to be.
            "--max_steps",
            "2000",
            "--health_checks",
            "false",
            "--logging_steps",
            "1",
            "--save_steps",
            "100000",
            "--report_to",
            "none",
            "--output_dir",
            str(tmp_path / name),
        ]
        jobs[name] = slurm.sbatch(
            args, cwd=submit_dir(), env={**TWO_PROCESSES, "DPOTRAIN_CACHE": str(tmp_path / "cache")}
        )
    deadline = time.time() + 400
    states = states_once_a_second(slurm, *jobs.values())
    while not all(len(steps(tmp_path / name)) >= 3 for name in jobs):  # both mid-training at once
        assert time.time() < deadline and all(s in ("PENDING", "RUNNING") for s in states()), states()
        time.sleep(0.2)
    assert all(slurm.state(job) == "RUNNING" for job in jobs.values())  # side by side, not one after the other
    ports = {re.search(r"rendezvous \S+:(\d+)", job_log(job)).group(1) for job in jobs.values()}
    assert len(ports) == 2
    slurm.signal(jobs["no-requeue"], "USR1")
    cancel_with_the_steps_sigterm_first(slurm, jobs["cancelled"])

    for name, state in (("cancelled", "CANCELLED"), ("no-requeue", "FAILED")):
        assert slurm.wait(jobs[name], timeout=120) == state, job_log(jobs[name])[-3000:]
    for name, job in jobs.items():
        log = job_log(job)
        assert slurm.job_info(job)["Restarts"] == "0", log[-3000:]
        saved = re.search(r"checkpoint (\S+) written; ", log)
        assert saved and (Path(saved.group(1)) / "COMPLETE").is_file(), log[-3000:]
        assert not (tmp_path / name / "run_complete.json").exists()
        # Its lead (the script's 600 s) is told to be the script's: an SBATCH_SIGNAL set by its submitter would not
        # reach it (dpotrain/cluster/job.py: unseen_variable)
        unseen = "this job was submitted with an --export list without ALL, so an SBATCH_SIGNAL in the shell"
        assert (unseen in log) == (name == "cancelled"), log[:3000]
        if name == "cancelled":
            assert f"job {job} was cancelled (scancel), so it is not requeued: submit the same command" in log
            assert "srun ended on Slurm's SIGTERM: waiting up to 30 s (KillWait)" in log, log[-3000:]
        else:
            assert f"error: Slurm refused to requeue job {job} (Requested operation is presently disabled" in log


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_not_requeued_whose_output_folder_is_named_after_it_says_to_submit_naming_that_folder(slurm, tmp_path):
    """A recipe's `output_dir: /scratch/runs/$SLURM_JOB_ID` (docs/running.md: a folder per job), in a job Slurm does not
    requeue (here --no-requeue; a `scancel` alike): the log said "submit the same command again to go on from what was
    saved", and the new job, its id another, started the run from step 0 in a new folder. It names the folder to pass,
    which a new job resumes from."""
    recipe = tmp_path / "per-job.yaml"
    smoke = (ROOT / "configs" / "smoke.yaml").read_text()
    recipe.write_text(smoke + f"output_dir: {tmp_path}/run-$SLURM_JOB_ID\n")
    args = ["--max_steps", "2000", "--health_checks", "false", "--logging_steps", "1", "--save_steps", "100000"]
    sbatch = [o for o in README_SBATCH if not o.endswith("dpo_train.sh")]
    job = slurm.sbatch([*sbatch, "--no-requeue", SCRIPT, *args], cwd=submit_dir(), env={"RECIPE": str(recipe)})
    out = tmp_path / f"run-{job}"
    wait_while_running(slurm, job, lambda: len(steps(out)) >= 3)
    slurm.signal(job, "USR1")
    assert slurm.wait(job, timeout=120) == "FAILED", job_log(job)[-3000:]
    log = job_log(job)
    assert re.search(r"checkpoint \S+ written; ", log), log[-3000:]
    said = f"submit the same command again with --output_dir {out} to go on from what was saved"
    assert said in log and f"named after this job's id {job}" in log, log[-3000:]


def test_the_way_to_go_on_names_an_output_folder_named_after_the_job():
    """Where Slurm does not requeue a job: the same command again, naming the output folder where it holds the job's
    id (or its array's), as a whole number: a new job's id would name another folder."""
    assert job_module.go_on("/runs/run-1234/x", "1234", "") == (
        "submit the same command again with --output_dir /runs/run-1234/x to go on from what was saved (its folder is "
        "named after this job's id 1234: a new job's id names a new folder, which would start the run from step 0)"
    )
    assert "--output_dir" in job_module.go_on("/runs/700_3", "703", "700")  # an array task's: the array's id
    for out in ("/runs/run-12345", "/runs/91234", "/runs/smoke"):
        assert job_module.go_on(out, "1234", "") == "submit the same command again to go on from what was saved"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_stop_before_the_launch_requeues_and_a_sigterm_to_the_whole_job_says_what_srun_killed_and_requeues(
    slurm, tmp_path
):
    """Two stops of one job (a job start is ~30 s), each followed by a requeue; the job then trains to its end.
    - A USR1 (`scancel --signal=USR1 --batch`) that reached the batch shell before launch.sh had set its traps ended
      the shell by bash's default action: the job FAILED (ExitCode 0:10) with no line in its log, never requeued, its
      run never finished. Now that start launches nothing, says so, and requeues; the next start trains.
    - `scancel --signal=TERM --full` signals every process of the job, the batch step's srun among them, and srun
      answers a SIGTERM it receives with a SIGKILL of its tasks ("srun: forcing job termination"): the training
      processes die before they save, whatever they or launch.sh handle (srun takes SIGTERM back and waits for it). The
      job waited KillWait for a save that could not come, then ended FAILED, unrequeued, its log saying "Slurm ended
      the job before its save was complete", neither true, and nothing of the steps lost. Now the log says what was
      lost and how to stop with a checkpoint, and the job, which the stop request did not end, is requeued and trains
      to its end. (Its checkpoint on a slow file system, `slow_checkpoint_project`: signalled once step 3 of its
      second start has trained.)
    Each had a job of its own until session 69."""
    project = slow_checkpoint_project(tmp_path / "project")
    held, out = tmp_path / "held", tmp_path / "run"
    held.mkdir()
    hold = {"SLOW_CHECKPOINT_S": "45", "DPOTRAIN_TEST_HOLD": "step-3@1", "DPOTRAIN_TEST_HOLD_DIR": str(held)}
    # 4 steps: one past the hold at step 3, which the killed start never reaches (6 until session 73: the last start
    # trained 2 more, and every start's reference stage scored 16 pairs more)
    args = ("--max_steps", "4", "--logging_steps", "1", "--save_steps", "1000")
    script = project / "scripts" / "dpo_train.sh"
    job, log = early_stopped_job(slurm, tmp_path, env=hold, script=script, args=args)  # USR1 at its banner
    wait_while_running(slurm, job, (held / "held-step-3").exists, log=log)  # step 3 trained, its stop not yet asked
    slurm.signal(job, "TERM", batch_only=False)  # scancel --signal=TERM --full
    state = slurm.wait(job, timeout=600)
    text = log.read_text(errors="replace")
    assert state == "COMPLETED" and slurm.job_info(job)["Restarts"] == "2", (slurm.job_info(job), text[-3000:])
    early, rest = text.split(f"=== DPO job {job} (dpo-think) restart 1", 1)
    first, second = rest.split(f"=== DPO job {job} (dpo-think) restart 2", 1)

    # The USR1 before the launch: nothing launched in that start, which said so and requeued.
    assert f"SIGUSR1 came before training was launched: nothing trained in this start; requeueing job {job}" in early
    assert "launch: " not in early

    # The SIGTERM to the whole job, in the start after it: what srun killed, and a requeue.
    assert "srun: forcing job termination" in first and "Slurm ended the job" not in first, first[-3000:]
    lost = re.search(
        r"^warning: srun was sent the SIGTERM too \(scancel --signal=TERM --full signals every process of the job, .*: "
        r"the steps trained "
        r"since the run's start \(no complete checkpoint\) are lost: 1 to (\d) \(the last logged\), and any after it; "
        rf"its requeue starts the run again\. To stop a job with a checkpoint, .*`scancel --signal=TERM {job}` .*"
        rf"`scancel --signal=USR1 --batch {job}`$",
        first,
        re.M,
    )
    assert lost and lost[1] in "23", first[-3000:]
    assert f"srun killed the training processes before they saved (its SIGTERM); requeueing job {job}" in first
    assert "waiting up to" not in first  # no KillWait for processes already killed
    assert "training exited with code 0" in second
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 4


@pytest.mark.slurm
@pytest.mark.slow
def test_ctrl_c_to_launch_sh_run_in_an_allocation_saves_before_the_allocation_is_given_back(slurm, tmp_path):
    """`bash scripts/launch.sh` typed inside `salloc` (docs/slurm.md), then Ctrl-C: the terminal's SIGINT reaches the
    launch.sh shell (salloc's foreground group) and srun, which only reports its tasks. Untrapped, it ended the shell at
    once, salloc gave the allocation back, and Slurm killed the run KillWait (30 s) into a checkpoint that takes longer
    (`slow_checkpoint_project`: 40 s more): nothing saved. Now a stop request, as Ctrl-C is outside Slurm: the run
    saves, and launch.sh says to run the same command again (an allocation cannot be requeued) and exits 75."""
    project = slow_checkpoint_project(tmp_path / "project")
    held, out = tmp_path / "held", tmp_path / "run"
    held.mkdir()
    hold = {"SLOW_CHECKPOINT_S": "40", "DPOTRAIN_TEST_HOLD": "step-3@0", "DPOTRAIN_TEST_HOLD_DIR": str(held)}
    env = {**slurm.env, **README_ENV, **hold, "DPOTRAIN_CACHE": f"{out}-cache"}
    # 4 steps: the checkpoint at the hold (step 3) is a stop's, not the run's last (6 until session 73: 16 pairs more
    # scored by the reference stage, for steps never trained)
    args = ["--max_steps", "4", "--logging_steps", "1", "--save_steps", "1000", "--report_to", "none"]
    salloc = subprocess.Popen(
        [
            "salloc",
            "--gpus-per-node=0",
            f"--cpus-per-task={real_cpus()}",
            "bash",
            str(project / "scripts" / "launch.sh"),
        ]
        + [*args, "--output_dir", str(out)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    text = []
    reader = threading.Thread(target=lambda: text.extend(salloc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 300
        while not (held / "held-step-3").exists():  # step 3 trained, its stop not yet asked
            assert salloc.poll() is None and time.time() < deadline, "".join(text)[-3000:]
            time.sleep(0.2)
        # What a terminal's Ctrl-C does: SIGINT to its foreground process group, the one salloc runs launch.sh in.
        shell = int(subprocess.run(["pgrep", "-P", str(salloc.pid)], capture_output=True, text=True).stdout.split()[0])
        os.killpg(os.getpgid(shell), signal.SIGINT)
        rc = salloc.wait(timeout=300)
    finally:
        if salloc.poll() is None:
            os.killpg(salloc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    log = "".join(text)
    assert rc == 75, log[-3000:]
    assert (out / "checkpoint-3" / "COMPLETE").is_file(), log[-3000:]
    assert "an allocation (salloc) is not requeued: run the same command to go on" in log, log[-3000:]
    # Its time-limit warning's fix is salloc's option: it named an #SBATCH line to add to `<folder>/(null)`.
    assert "no time-limit warning is set for this allocation" in log and "(null)" not in log, log[-3000:]


@pytest.mark.slurm
def test_launch_sh_run_in_a_job_step_shares_its_cpus_instead_of_waiting_for_them(slurm, tmp_path):
    """`srun --pty bash` (a shell on a node, inside a job step), then `bash scripts/launch.sh`: that step holds the
    job's CPUs, and launch.sh's own srun waited for them, silently, until the job's time limit. Its training step now
    overlaps the shell's (`srun --overlap`): the run trains and ends, exit 0."""
    out = tmp_path / "run"
    args = ["--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--output_dir", str(out)]
    launch = shlex.join(["bash", str(ROOT / "scripts" / "launch.sh"), *args])
    env = {**slurm.env, **README_ENV, "DPOTRAIN_CACHE": f"{out}-cache"}
    cpus = f"--cpus-per-task={real_cpus()}"
    try:  # the time limit is the bound of a launch that waits: the job ends then, the test with it
        ran = subprocess.run(
            ["srun", "--job-name=launch-in-a-step", "--gpus-per-node=0", cpus, "--time=4", "bash", "-c", launch],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        for job in slurm.run(["squeue", "-h", "-n", "launch-in-a-step", "-o", "%i"]).stdout.split():
            slurm.run(["scancel", job], check=False)  # a launch that waited past the timeout
    log = ran.stdout + ran.stderr
    assert ran.returncode == 0, log[-3000:]
    assert "training exited with code 0" in log and (out / "run_complete.json").is_file(), log[-3000:]
    # A job srun made has no batch script (Command=bash): the warning's fix named `<folder>/bash` to edit.
    assert "give salloc --signal=USR1@600 (srun --signal=USR1@600 for a job srun made)" in log, log[-3000:]
    assert f"{tmp_path}/bash" not in log, log[-3000:]


@pytest.mark.parametrize(
    ("complete", "logged", "says"),
    [
        ((), [1, 2], "the steps trained since the run's start (no complete checkpoint) are lost: 1 to 2 (the last "),
        ((2, 4), [1, 2, 3, 4, 5], "the steps trained since checkpoint-4 are lost: 5 (the last logged), and any after"),
        (
            (2,),
            [1, 2],
            "any step trained since checkpoint-2 is lost (none was logged past it); its requeue goes on from",
        ),
    ],
)
def test_a_stop_srun_killed_says_the_steps_lost_since_the_newest_complete_checkpoint(complete, logged, says, tmp_path):
    """What the log says a `scancel --signal=TERM --full` lost (srun kills its tasks on the SIGTERM it gets itself):
    the steps metrics.jsonl logged past the newest checkpoint marked COMPLETE (one cut short, checkpoint-6 here, is
    none), and where the requeue goes on from."""
    from dpotrain.cluster import job

    for step in (*complete, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if step in complete:
            (tmp_path / f"checkpoint-{step}" / "COMPLETE").touch()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in logged))
    line = job.killed_by_srun(tmp_path, "123")
    assert says in line and line.endswith("`scancel --signal=USR1 --batch 123`"), line


def print_launch(nodes: int, *train_args: str, gpus: str = "4", env: dict | None = None) -> str:
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        | {"RECIPE": "configs/think.yaml"}
        | (env or {})
    )
    env |= {
        "LAUNCH_PRINT_ONLY": "1",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_GPUS_PER_NODE": gpus,
        "SLURM_JOB_NODELIST": f"gpu[07-{6 + nodes:02d}]",
    }
    result = subprocess.run(
        ["bash", "scripts/launch.sh", *train_args], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


@pytest.mark.slow  # starts bash and the package's engine reader
def test_each_nodes_launcher_ignores_the_stop_signals_its_training_processes_answer():
    """Slurm signals every process of the training step: `scancel --signal=USR1 <job>` (the steps, not the batch shell),
    an allocation's or a step's `--signal=USR1@600` (docs/slurm.md), a preemption's SIGTERM. The training processes save
    on either; `accelerate launch` (torchrun's agent) ended on the USR1 by its default action, so the step ended at
    once and Slurm killed the processes it had started, mid-save (the test cluster's proctrack/linuxproc leaves them as
    orphans; proctrack/cgroup, as clusters run, does not). Each node's launcher now starts with both ignored, as the
    processes' own handlers take over (dpotrain/train/preemption.py)."""
    line = print_launch(1, gpus="0", env={"RECIPE": "configs/smoke.yaml"})
    assert " .venv/bin/accelerate launch " in line, line
    # The node's shell as srun runs it, with a stand-in for accelerate that shows the signals it starts with ignored
    shown = line.replace(" .venv/bin/accelerate launch ", " sh -c 'grep SigIgn /proc/self/status' launcher ")
    out = subprocess.run(
        ["bash", "-c", f'srun() {{ bash -c "${{@: -1}}"; }}; {shown}'], capture_output=True, text=True, check=True
    ).stdout
    ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", out, re.M).group(1), 16)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        assert ignored & (1 << (sig - 1)), (sig.name, out)


@pytest.mark.slow  # starts bash and the package's engine reader
def test_a_rendezvous_port_in_use_on_the_first_node_is_passed_over_for_a_free_one():
    """The port is 20000 + job id mod 10000: a job whose id differs by a multiple of 10000 from one on the same node
    (or any process) holding it met "address already in use" at the rendezvous. The batch shell, on the first node,
    moves it to the next free port, written into the one launch line every node runs; a MAIN_PROCESS_PORT given in
    use is refused in one line."""
    import socket

    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    for port in range(20000 + os.getpid() % 9000, 29999):  # a port in 20000-29998 whose next one is free too
        held, after = socket.socket(), socket.socket()
        try:
            held.bind(("", port))
            after.bind(("", port + 1))
            break
        except OSError:
            held.close()
            after.close()
    after.close()  # free: the port the job moves to
    with held:
        held.listen()  # another job's rendezvous, as torch's store holds it
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
        env |= {"RECIPE": "configs/think.yaml", "LAUNCH_PRINT_ONLY": "1", "SLURM_JOB_NUM_NODES": "1"}
        env |= {"SLURM_GPUS_PER_NODE": "4", "SLURM_JOB_NODELIST": host, "SLURM_JOB_ID": str(port - 20000 + 10000)}
        moved = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert moved.returncode == 0, moved.stderr
        assert f"--main_process_port {port + 1} " in moved.stdout, moved.stdout
        assert moved.stderr == f"rendezvous port {port} is in use on {host}: using {port + 1}\n", moved.stderr
        given = subprocess.run(
            ["bash", "scripts/launch.sh"], cwd=ROOT, env=env | {"MAIN_PROCESS_PORT": str(port)}, capture_output=True,
            text=True,
        )  # fmt: skip
        assert given.returncode == 1 and not given.stdout, given.stdout
        assert given.stderr == (
            f"error: MAIN_PROCESS_PORT={port} is in use on {host} (another job or process listens there): choose "
            "another, or unset it for a free port from the job id\n"
        ), given.stderr


@pytest.mark.slow  # starts bash and the package's engine reader
@pytest.mark.parametrize(
    "gpus, cpus, says",
    [
        ("0", "abc", "CPU_PROCESSES_PER_NODE=abc is not a number of processes: give a whole number of 1 or more"),
        ("0", "0", "CPU_PROCESSES_PER_NODE=0 is not a number of processes"),
        ("four", "1", "cannot read the GPUs per node from Slurm's 'four' (SLURM_GPUS_PER_NODE, SLURM_GPUS_ON_NODE)"),
    ],
)
def test_processes_per_node_that_are_no_number_are_refused_by_name(gpus, cpus, says):
    """CPU_PROCESSES_PER_NODE=abc ended in bash's "abc: unbound variable"; =0 was planned as 0 processes and refused
    naming WORLD_SIZE, which the user had not set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": "configs/smoke.yaml"}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_GPUS_PER_NODE": gpus, "CPU_PROCESSES_PER_NODE": cpus}
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.strip().startswith(f"error: {says}"), result.stderr
    del env["RECIPE"]  # launch.sh run by hand, without the sbatch scripts' RECIPE: bash's own "line 27: RECIPE: ..."
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.startswith("error: set RECIPE, e.g. RECIPE=configs/think.yaml")


@pytest.mark.parametrize(
    ("exported", "recipe", "warned"),
    [
        ("NONE", None, "--export=NONE (sbatch's option, or SBATCH_EXPORT)"),
        ("HF_HOME=/scratch/hf", None, "an --export list without ALL or RECIPE (HF_HOME=/scratch/hf)"),
        ("RECIPE=configs/smoke.yaml", "configs/smoke.yaml", None),
        ("ALL,HF_HOME=/scratch/hf", None, None),
        (None, None, None),
    ],
)
def test_a_job_submitted_without_the_shells_variables_says_it_runs_the_default_recipe(exported, recipe, warned):
    """`RECIPE=configs/instruct.yaml sbatch --export=NONE scripts/dpo_train.sh` (or a site's SBATCH_EXPORT=NONE, or an
    --export list without ALL): the job starts without the submitting shell's variables, and trained the script's
    default recipe without a word. Said on one warning line, first in the log (here before the missing venv's refusal);
    a list naming RECIPE, or one with ALL, says nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RECIPE"))} | {"VENV": "/nonexistent"}
    env |= {"SLURM_EXPORT_ENV": exported} if exported else {}
    env |= {"RECIPE": recipe} if recipe else {}
    result = subprocess.run(["bash", "scripts/dpo_train.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "error: no virtual environment at /nonexistent" in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    if warned:
        assert lines[0] == (
            f"warning: this job was submitted with {warned}, so a RECIPE, ACCELERATE_CONFIG, VENV or PREFLIGHT set in "
            "the shell sbatch ran in is not seen here: it runs the script's default recipe, configs/think.yaml; pass "
            "them on (sbatch --export=ALL,RECIPE=configs/my.yaml ...)"
        ), result.stderr
    else:
        assert "warning:" not in result.stderr, result.stderr


def test_a_recipe_that_is_a_folder_is_named_as_a_folder_by_the_job(tmp_path):
    """`RECIPE=configs sbatch scripts/dpo_train.sh` (a folder: the shell completed to it) was refused as "recipe configs
    not found", though it was there; train_dpo.py --config says the same of a folder (tests/test_newcomer.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": str(tmp_path)}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "4"}
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"error: recipe {tmp_path} is a folder, not a recipe file: set RECIPE={tmp_path}/<name>.yaml"
    ), result.stderr


@pytest.mark.parametrize("python", ["gone", "no-library"])
def test_a_venv_whose_python_does_not_run_on_the_node_is_refused_in_one_line(python, tmp_path):
    """A venv made with a Python the compute node does not have (a pyenv in a home it does not mount: a dangling link;
    a module's Python whose libpython the job did not `module load`) ended the job in bash's "launch.sh: line 88:
    .venv/bin/python: No such file or directory", naming no fix. One line naming the python and the fix."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    shutil.copy(ROOT / ".venv" / "bin" / "accelerate", venv / "accelerate")
    if python == "gone":
        (venv / "python").symlink_to(tmp_path / "pyenv" / "bin" / "python3")
        why = f"it links to {tmp_path / 'pyenv' / 'bin' / 'python3'}, which is not there"
    else:
        why = "python3: error while loading shared libraries: libpython3.11.so.1.0: cannot open shared object file"
        (venv / "python").write_text(f"#!/bin/sh\necho '{why}' >&2\nexit 127\n")
        (venv / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": "configs/smoke.yaml"}
    env |= {"VENV": str(tmp_path / "venv"), "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "0"}
    result = subprocess.run(["bash", "scripts/dpo_train.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and not result.stdout, result.stdout
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    assert result.stderr.startswith(
        f"error: the virtual environment's python, {venv / 'python'}, does not run on {host} ({why}"
    ), result.stderr
    assert "module load" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.slow  # starts bash and the package's engine reader
@pytest.mark.parametrize("asked", [{"SLURM_GPUS_PER_TASK": "1"}, {"SLURM_TRES_PER_TASK": "cpu=8,gres/gpu:1"}])
def test_a_job_asking_gpus_per_task_is_refused_in_one_line(asked):
    """`sbatch --ntasks-per-node=4 --gpus-per-task=1` (one task per GPU, another launcher's habit): the one task per
    node that launches got one task's GPU, and a process started for each of the node's 4 GPUs on it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": "configs/think.yaml"}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "4", **asked}
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and not result.stdout, result.stdout
    assert result.stderr.startswith("error: the job asks for GPUs per task (--gpus-per-task): launch.sh starts one")
    assert "submit with --gpus-per-node=N and --ntasks-per-node=1" in result.stderr, result.stderr


@pytest.mark.parametrize("nodes", ["0", "", "two", "-1"])
def test_a_node_count_that_is_no_number_of_nodes_is_refused_in_one_line(nodes):
    """Slurm sets SLURM_JOB_NUM_NODES to 1 or more, but one exported by hand is read too: 0 was launched as
    `srun --nodes=0` with `--num_processes 0`, an empty one as a single node whatever the allocation, and a word ended
    the job in bash's "two: unbound variable"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": "configs/think.yaml"}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_JOB_NUM_NODES": nodes, "SLURM_GPUS_PER_NODE": "4"}
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and not result.stdout, result.stdout
    assert result.stderr == (
        f"error: SLURM_JOB_NUM_NODES='{nodes}' is not a number of nodes: Slurm sets it to the job's nodes (1 or more);"
        " unset it (one node), or submit with sbatch --nodes=N\n"
    ), result.stderr


@pytest.mark.parametrize("port", ["abc", "70000", "-1", "0", "08", "29500 "])
def test_a_rendezvous_port_that_is_no_port_is_refused_in_one_line(port):
    """MAIN_PROCESS_PORT given is checked on the first node by binding it: a word or a number past 65535 ended the job
    in a Python traceback (ValueError, OverflowError) from launch.sh's check, 0 (any free port, each node its own)
    was launched as the port every node meets at, `08` was bound as port 8 and said to be `in use: using 8`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env |= {"RECIPE": "configs/think.yaml", "LAUNCH_PRINT_ONLY": "1", "SLURM_GPUS_PER_NODE": "4"}
    result = subprocess.run(
        ["bash", "scripts/launch.sh"], cwd=ROOT, env=env | {"MAIN_PROCESS_PORT": port}, capture_output=True, text=True
    )
    assert result.returncode == 1 and not result.stdout, result.stdout
    assert result.stderr == (
        f"error: MAIN_PROCESS_PORT='{port}' is not a port: give a whole number from 1024 to 65535, free on the first"
        " node, or unset it for a free port from the job id\n"
    ), result.stderr


def test_a_quoted_tilde_in_recipe_and_accelerate_config_is_the_home_folder(tmp_path):
    """`RECIPE="~/recipes/think.yaml" sbatch scripts/dpo_train.sh`: quoted, the ~ reaches the job as it is (bash
    expands it only unquoted, at the start of a word), and the job looked for a folder named `~`: "recipe
    ~/recipes/think.yaml not found". It is the home folder, as the shell would have made it; `~user/` too; and so
    for ACCELERATE_CONFIG and VENV."""
    home = tmp_path / "home"
    (home / "recipes").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "think.yaml", home / "recipes" / "think.yaml")
    shutil.copy(ROOT / "accelerate_config.yaml", home / "my_accel.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_"))}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_GPUS_PER_NODE": "4", "HOME": str(home)}

    def launch(**given) -> subprocess.CompletedProcess:
        script = str(ROOT / "scripts" / "dpo_train.sh")
        return subprocess.run(["bash", script], cwd=tmp_path, env=env | given, capture_output=True, text=True)

    (home / "venvs").mkdir()
    (home / "venvs" / "dpo").symlink_to(ROOT / ".venv")
    result = launch(RECIPE="~/recipes/think.yaml", ACCELERATE_CONFIG="~/my_accel.yaml", VENV="~/venvs/dpo")
    assert result.returncode == 0, result.stderr
    assert f"train_dpo.py --config {home / 'recipes' / 'think.yaml'} " in result.stdout, result.stdout
    assert f"--config_file {home / 'my_accel.yaml'} " in result.stdout, result.stdout
    # VENV too: "no virtual environment at ~/venvs/dpo: run `bash scripts/setup_env.sh`", of a venv that was there
    assert f"exec {home / 'venvs' / 'dpo' / 'bin' / 'accelerate'} launch " in result.stdout, result.stdout
    assert f"export PATH={home / 'venvs' / 'dpo' / 'bin'}:" in result.stdout, result.stdout
    # ~user/: that user's home from the passwd database, not HOME (no such recipe there: refused naming the path)
    user = pwd.getpwuid(os.getuid())
    result = launch(RECIPE=f"~{user.pw_name}/no-recipe-{tmp_path.name}.yaml")
    assert result.returncode == 1 and result.stderr == (
        f"error: recipe {user.pw_dir.rstrip('/')}/no-recipe-{tmp_path.name}.yaml not found: set"
        " RECIPE=configs/<name>.yaml (see configs/)\n"
    ), result.stderr
    result = launch(RECIPE="~no-such-user-here/think.yaml")
    assert result.returncode == 1 and result.stderr == (
        "error: RECIPE=~no-such-user-here/think.yaml: there is no user no-such-user-here for its ~: give the full"
        " path\n"
    ), result.stderr


@pytest.mark.parametrize("nodes", [2, 4])
def test_multi_node_launch_line(nodes):
    line = print_launch(nodes, "--learning_rate", "8e-8", gpus="h100:4")
    assert line.startswith(f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 ")
    for part in [
        f"--num_machines {nodes}",
        f"--num_processes {4 * nodes}",
        "--main_process_ip gpu07",
        "--deepspeed_multinode_launcher standard",
        "--config_file accelerate_config.yaml",
        "train_dpo.py --config configs/think.yaml --learning_rate 8e-8",
    ]:
        assert part in line, part
    # Run the line with a stand-in srun that shows what each node's bash receives: the machine rank must still be
    # the variable, evaluated per node, not the batch shell's value.
    shown = subprocess.run(
        ["bash", "-c", f'srun() {{ printf "%s" "${{@: -1}}"; }}; SLURM_PROCID=0; {line}'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--machine_rank $SLURM_PROCID " in shown
    # Each node finds the venv's tools first, as an activated venv would: DeepSpeed builds its ops with its ninja.
    assert f"export PATH={ROOT}/.venv/bin:$PATH " in shown


def test_launch_line_hands_each_node_paths_and_arguments_as_given(tmp_path):
    """A venv, recipe and accelerate config in folders with spaces and non-ASCII names (a project under
    "My Projects/"), and arguments with a space, a $, a " or a quote: each node's `accelerate launch` gets them as
    given. (The line put them unquoted in `bash -c "..."`: a space split the venv's PATH entry and the recipe, a $ was
    expanded on the node, a " ended the node's command.)"""
    folder = tmp_path / "My Projects é"
    (folder / "venv" / "bin").mkdir(parents=True)
    for tool in ("accelerate", "python"):
        (folder / "venv" / "bin" / tool).symlink_to(ROOT / ".venv" / "bin" / tool)
    shutil.copy(ROOT / "configs" / "think.yaml", folder / "think recipe.yaml")
    shutil.copy(ROOT / "accelerate_config.yaml", folder / "zero 2.yaml")
    paths = {
        "VENV": folder / "venv",
        "RECIPE": folder / "think recipe.yaml",
        "ACCELERATE_CONFIG": folder / "zero 2.yaml",
    }
    args = ["--output_dir", "outputs/mon run é", "--run_name", "cost$HOME", "--run_name", 'a "b" `c`', "--x", "it's"]
    line = print_launch(2, *args, env={k: str(v) for k, v in paths.items()})
    # A stand-in srun shows what each node's bash receives; that bash runs it, with `exec` showing what it would start.
    on_node = subprocess.run(
        ["bash", "-c", f'srun() {{ printf "%s" "${{@: -1}}"; }}; {line}'], capture_output=True, text=True, check=True
    ).stdout
    shown = subprocess.run(
        ["bash", "-c", 'exec() { printf "%s\\n" "$@" "$PATH"; }; ' + on_node],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    words = shown[shown.index("launch") - 1 : -1]
    assert words[0] == f"{paths['VENV']}/bin/accelerate"
    assert words[words.index("--config_file") + 1] == str(paths["ACCELERATE_CONFIG"])
    config = ["--accelerate_config", str(paths["ACCELERATE_CONFIG"])]  # the engine launched, as the run records it
    assert words[words.index("train_dpo.py") :] == ["train_dpo.py", "--config", str(paths["RECIPE"]), *args, *config]
    assert shown[-1].startswith(f"{paths['VENV']}/bin:")  # the venv's tools first on PATH, as a whole entry


@pytest.mark.parametrize(
    "given", [["--accelerate_config", "configs/accelerate/zero3.yaml"], ["--accelerate-config=none"]]
)
def test_an_accelerate_config_among_the_jobs_arguments_is_the_one_launched(given):
    """`sbatch scripts/dpo_train.sh --accelerate_config configs/accelerate/zero3.yaml`: the job's dry run planned
    ZeRO-3 (the argument came after launch.sh's own) while the nodes launched accelerate_config.yaml's ZeRO-2. The
    launch takes the argument's config (`none`: a job still launches the default), and every node's train_dpo.py gets
    the launched one last, so the run plans and records the engine it runs."""
    launched = "configs/accelerate/zero3.yaml" if "zero3" in given[-1] else "accelerate_config.yaml"
    line = print_launch(2, *given, "--learning_rate", "8e-8")
    assert f"--config_file {launched} " in line
    assert line.endswith(f'--learning_rate 8e-8 --accelerate_config {launched}"')
    # ACCELERATE_CONFIG naming another engine than the argument: one of them would be ignored, so the job is refused.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {
        "LAUNCH_PRINT_ONLY": "1",
        "RECIPE": "configs/think.yaml",
        "ACCELERATE_CONFIG": "configs/accelerate/fsdp2.yaml",
    }
    result = subprocess.run(["bash", "scripts/launch.sh", *given], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.strip().startswith(
        "error: ACCELERATE_CONFIG=configs/accelerate/fsdp2.yaml and --accelerate_config"
    )


def test_launch_line_masks_secrets_given_on_the_command_line():
    line = print_launch(
        2,
        "--hub_token",
        SECRET,
        f"--wandb_api_key={SECRET}",
        "--max_tokens_per_microbatch",
        "4096",
        "--learning_rate",
        "8e-8",
    )
    assert SECRET not in line
    assert "--hub_token REDACTED --wandb_api_key=REDACTED" in line
    assert "--max_tokens_per_microbatch 4096 --learning_rate 8e-8" in line  # not secrets: shown as given


def read_until(command: list[str], cwd, env: dict, prefixes: tuple[str, ...]) -> list[str]:
    """launch.sh's output lines up to the first that starts with one of `prefixes` (included), then its process group
    killed: what follows is a launch the test does not need. A launch.sh that hangs fails the test, not stalls it."""
    job = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    watchdog = threading.Timer(300, os.killpg, (job.pid, signal.SIGKILL))
    watchdog.start()
    lines = []
    try:
        while (line := job.stdout.readline()) and not line.startswith(prefixes):
            lines.append(line)
        lines.append(line)
    finally:
        watchdog.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    return lines


def test_the_banner_of_a_project_outside_git_names_no_commit_and_no_change(tmp_path):
    """A project that is no git checkout (a release's tarball, or one git will not read: another user's folder):
    `git diff` fails there with 129, not the 1 of a change, and every job's banner said `git: unknown (dirty)`."""
    project = tmp_path / "dpotrain"  # the project's files, without its .git
    project.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "logs", "outputs"):
            (project / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_", "GIT_"))}
    # Read up to the banner's git line, then the launch's group killed: what follows is its dry run, a fresh start of
    # the stack (~7 CPU-s, 12-15 s on 2 busy cores) that the banner does not depend on. `set -e` ends launch.sh at a
    # failing line, so a banner printed whole is one the git lines let through. `--betta`: were the banner never seen,
    # the dry run refuses it and nothing trains (a dry run's refusal ending a job with 2: test_job_refuses_a_batch_...).
    command = ["bash", str(project / "scripts" / "launch.sh"), "--betta", "5"]
    lines = read_until(command, project, {**env, "RECIPE": "configs/smoke.yaml"}, ("gpus per node:",))
    assert lines[-1] == "gpus per node: 0  git: unknown\n", "".join(lines)


@pytest.mark.slow
def test_job_refuses_a_batch_its_size_cannot_reach():
    # Micro-batches of 4 pairs instead of the recipe's token budget, on 3 nodes x 4 GPUs = 12 processes: 128 pairs
    # per step is not a whole number of micro-steps. (Under a token budget, 128 pairs split over any 12 processes.)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {
        "RECIPE": "configs/think.yaml",
        "SLURM_JOB_ID": "4242",  # in a job: outside one, launch.sh refuses first (`bash scripts/dpo_train.sh`)
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_GPUS_PER_NODE": "4",
        "SLURM_JOB_NODELIST": "gpu[01-03]",
        "VENV": warm_venv(),  # its dry run on the warm interpreter: what launch.sh does with its refusal is under test
    }
    fixed = ["--max_tokens_per_microbatch", "None", "--per_device_train_batch_size", "4"]
    result = subprocess.run(["bash", "scripts/launch.sh", *fixed], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2  # the dry run's refusal ends the job with its own code
    assert "pairs_per_step=128 is not reachable with 12 processes" in result.stderr
    assert "launch: srun" not in result.stdout  # refused before anything was launched


@pytest.mark.slow  # starts bash and the job's dry run
def test_job_refuses_an_accelerate_config_that_launches_one_process_per_node(tmp_path):
    """`ACCELERATE_CONFIG=my.yaml sbatch ...` of a config `accelerate config` wrote for one GPU (distributed_type NO):
    `accelerate launch --num_processes 2` runs its simple launcher for it, one process, so the job trained alone on
    one of its GPUs (resolved_config.json: world_size 1) and exited 0, its plan and log saying 2 processes. Refused by
    the job's dry run, before anything launches."""
    config = tmp_path / "one_gpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_machines: 1\nnum_processes: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_"))}
    env |= {
        "RECIPE": "configs/smoke.yaml",
        "ACCELERATE_CONFIG": str(config),
        "CPU_PROCESSES_PER_NODE": "2",  # 2 processes per node, as --gpus-per-node=2 asks on GPUs
        "DPOTRAIN_STOP_FILE": str(tmp_path / "stop-%j"),
        "SLURM_JOB_ID": "4243",  # in a job: outside one, launch.sh refuses first (`bash scripts/dpo_train.sh`)
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_GPUS_PER_NODE": "0",
    }
    args = ["--output_dir", str(tmp_path / "run")]
    result = subprocess.run(["bash", "scripts/launch.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stdout + result.stderr  # the dry run's refusal ends the job with its code
    assert (
        f"error: accelerate config {config} has distributed_type NO, for which `accelerate launch` starts one process "
        "per node, not the 2 planned: name one that starts them all, accelerate_config.yaml (ZeRO-2)"
    ) in result.stderr, result.stderr
    assert "launch: srun" not in result.stdout and not (tmp_path / "run").exists()  # refused before any launch


@pytest.mark.slow  # the preflight loads the tiny model and scores its sample
def test_preflight_asked_as_true_runs_before_the_launch_and_a_word_that_is_no_yes_or_no_is_refused(tmp_path):
    """`PREFLIGHT=true sbatch scripts/dpo_train.sh` (yes/no as the recipe's fields take it): launch.sh compared the
    variable with 1 alone, so the job launched training without the preflight asked for, and said nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_"))}
    env |= {
        "RECIPE": "configs/smoke.yaml",
        "DPOTRAIN_STOP_FILE": str(tmp_path / "stop-%j"),
        "SLURM_JOB_ID": "4244",  # in a job: outside one, launch.sh refuses first (`bash scripts/dpo_train.sh`)
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_GPUS_PER_NODE": "0",
        "VENV": warm_venv(),  # its dry run and preflight on the warm interpreter: launch.sh's order is under test
    }
    command = ["bash", "scripts/launch.sh", "--output_dir", str(tmp_path / "run")]
    refused = subprocess.run(command, cwd=ROOT, env=env | {"PREFLIGHT": "maybe"}, capture_output=True, text=True)
    assert refused.returncode == 1 and not refused.stdout, refused.stdout
    assert refused.stderr == (
        "error: PREFLIGHT='maybe' is not a yes or no: give PREFLIGHT=1 for the preflight before training, or unset it\n"
    ), refused.stderr
    # up to the preflight's verdict, or the launch that came in its place
    lines = read_until(command, ROOT, env | {"PREFLIGHT": "true"}, ("## Verdict:", "launch: srun"))
    assert lines[-1].startswith("## Verdict:"), "".join(lines)


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed (scripts/test.sh installs it)")
@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_shellcheck(script):
    """Every finding, not errors alone: a warning or note (SC2317's unreachable code in launch.sh's signal trap) stood
    in `shellcheck scripts/launch.sh` unseen; a finding the code is right about is silenced where it is, saying why."""
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_eight_gpus_per_node_are_eight_processes_per_node_and_the_plan_counts_nodes_of_eight(monkeypatch):
    line = print_launch(2, gpus="8")
    assert "--num_machines 2" in line and "--num_processes 16" in line
    # launch.sh's dry run passes GPUS_PER_NODE: a refusal then suggests nodes of 8, not the config's 4.
    from dpotrain.cluster import engine

    assert engine.from_config(str(ROOT / "accelerate_config.yaml")).gpus_per_node == 4
    monkeypatch.setenv("GPUS_PER_NODE", "8")
    assert engine.from_config(str(ROOT / "accelerate_config.yaml")).gpus_per_node == 8
    assert "GPUS_PER_NODE=$PROCS_PER_NODE" in (ROOT / "scripts" / "launch.sh").read_text()


def test_sbatch_scripts_ask_for_memory_and_find_the_project_from_a_spool_copy(tmp_path):
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert re.search(r"^#SBATCH --mem=\S+ +# EDIT", text, re.MULTILINE), script
        assert re.search(r"^#SBATCH --gpus-per-node=\d+ +# EDIT: your nodes' GPUs \(4 or 8\)", text, re.MULTILINE)
        # Slurm opens the log before the script runs: a folder in its path that is missing fails the job unlogged.
        assert re.search(r"^#SBATCH --output=[^/ ]+ ", text, re.MULTILINE), script
        # Run as Slurm does, a copy elsewhere, started in the project: it hands over to the project's launch.sh.
        copy = tmp_path / script
        copy.write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_GPUS_PER_NODE": "8"}
        result = subprocess.run(["bash", str(copy)], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert "--num_processes 8" in result.stdout and "train_dpo.py --config configs/" in result.stdout


def test_sbatch_scripts_find_a_project_whose_path_holds_spaces_from_another_folder(tmp_path):
    """Submitted by its full path from another folder, the project under "My Projects é/": Slurm's Command= joins the
    path and the script's arguments with spaces, and the path was cut at its first space (the job then died on
    "/tmp/.../scripts/launch.sh: No such file or directory")."""
    project = tmp_path / "My Projects é" / "dpotrain"
    project.parent.mkdir()
    project.symlink_to(ROOT)
    elsewhere = tmp_path / "runs"
    elsewhere.mkdir()
    bin_dir = tmp_path / "bin"  # a stand-in scontrol: the job's record as `scontrol show job` prints it
    bin_dir.mkdir()
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        scontrol = bin_dir / "scontrol"
        scontrol.write_text(
            f"#!/bin/sh\necho '   Command={project}/scripts/{script} --max_steps 4'\necho '   WorkDir={elsewhere}'\n"
        )
        scontrol.chmod(0o755)
        copy = tmp_path / script  # Slurm runs a copy from its spool folder, started where it was submitted
        copy.write_text((ROOT / "scripts" / script).read_text())
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env |= {
            "LAUNCH_PRINT_ONLY": "1",
            "SLURM_JOB_ID": "7",
            "SLURM_SUBMIT_DIR": str(elsewhere),
            "SLURM_GPUS_PER_NODE": "4",
            "PATH": f"{bin_dir}:{env['PATH']}",
        }
        result = subprocess.run(
            ["bash", str(copy), "--max_steps", "4"], cwd=elsewhere, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        assert "--max_steps 4" in result.stdout and "--num_processes 4" in result.stdout


def spooled_job(tmp_path, submitted: Path, submit_dir: Path, workdir: Path | None = None, command=None) -> str:
    """What the sbatch script `submitted` launches (LAUNCH_PRINT_ONLY), typed in `submit_dir`: Slurm runs a copy of it
    from its spool folder, started in `workdir` (`sbatch --chdir`; else where it was submitted), and scontrol's
    `Command=` names `command` (the path as typed; the submitted path by default; "" for a scontrol that cannot
    answer)."""
    workdir = workdir or submit_dir
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    answer = f"echo '   Command={command or submitted}'\necho '   WorkDir={workdir}'" if command != "" else "exit 1"
    scontrol.write_text(f"#!/bin/sh\n{answer}\n")
    scontrol.chmod(0o755)
    copy = tmp_path / submitted.name
    copy.write_text(submitted.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_"))}
    env |= {
        "LAUNCH_PRINT_ONLY": "1",
        "SLURM_JOB_ID": "7",
        "SLURM_SUBMIT_DIR": str(submit_dir),
        "SLURM_GPUS_PER_NODE": "4",
        "PATH": f"{bin_dir}:{env['PATH']}",
    }
    result = subprocess.run(["bash", str(copy)], cwd=workdir, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_sbatch_scripts_run_the_project_of_the_submitted_script_not_the_checkout_submitted_from(tmp_path):
    """`sbatch ~/dpotrain-exp/scripts/dpo_train.sh` typed in another checkout (~/dpotrain): the job looked for the
    project in the folder it was submitted from first, and ran that checkout's launch.sh (and so its train_dpo.py)."""
    other = tmp_path / "dpotrain-old"  # the checkout submitted from: a launch.sh that says it ran
    (other / "scripts").mkdir(parents=True)
    (other / "scripts" / "launch.sh").write_text("echo ran the checkout submitted from\n")
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        out = spooled_job(tmp_path, ROOT / "scripts" / script, other)
        assert "ran the checkout" not in out and "--num_processes 4" in out, out


def test_a_copy_of_the_scripts_folder_submitted_from_the_project_runs_the_project(tmp_path):
    """A copy of scripts/ elsewhere, its launch.sh too (~/jobs/scripts/, edited), submitted from the project: at
    c4e9dc2 the job ran the project (the folder submitted from), and once the submitted script's folder came first it
    ran the copied launch.sh in ~/jobs, which holds no project (no train_dpo.py, no .venv). A script's folder is the
    project's only with train_dpo.py above it."""
    jobs = tmp_path / "jobs" / "scripts"
    jobs.mkdir(parents=True)
    (jobs / "launch.sh").write_text("echo ran the copied launch.sh\n")
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        (jobs / script).write_text((ROOT / "scripts" / script).read_text())
        out = spooled_job(tmp_path, jobs / script, ROOT)
        assert "ran the copied" not in out and "--num_processes 4" in out, out


def test_a_relative_recipe_and_accelerate_config_of_a_job_are_the_folder_submitted_froms(tmp_path):
    """`RECIPE=my.yaml ACCELERATE_CONFIG=my_accel.yaml sbatch /path/to/dpotrain/scripts/dpo_train.sh` from the folder
    holding them: the job runs in the project, where both were looked for alone ("recipe my.yaml not found: set
    RECIPE=configs/<name>.yaml"), while a relative path on the same command line is the folder submitted from's. The
    project's own (the default configs/think.yaml, a recipe's accelerate_config) stay the project's."""
    elsewhere = tmp_path / "runs"  # (a path with spaces: the test above)
    elsewhere.mkdir()
    (elsewhere / "my.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    (elsewhere / "my_accel.yaml").write_text((ROOT / "accelerate_config.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "ACCELERATE_CONFIG"}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(elsewhere), "SLURM_GPUS_PER_NODE": "4"}

    def launch(**given) -> str:
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "dpo_train.sh"), *given.pop("args", [])],
            cwd=elsewhere,
            env=env | given,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    line = launch(RECIPE="my.yaml", ACCELERATE_CONFIG="my_accel.yaml")
    assert f"--config_file {elsewhere / 'my_accel.yaml'} " in line, line
    assert f"train_dpo.py --config {elsewhere / 'my.yaml'} " in line, line
    line = launch(RECIPE="my.yaml", args=["--accelerate_config", "my_accel.yaml"])
    assert f"--config_file {elsewhere / 'my_accel.yaml'} " in line, line
    line = launch()  # not in the folder submitted from: the project's
    assert "train_dpo.py --config configs/think.yaml " in line and "--config_file accelerate_config.yaml " in line


def test_the_sbatch_scripts_default_recipe_is_the_projects_not_the_folder_submitted_froms(tmp_path):
    """`sbatch ~/dpotrain-exp/scripts/dpo_train.sh` typed in another checkout (~/dpotrain): the job runs the submitted
    script's project (23b55b7), and its default RECIPE, configs/think.yaml, was looked for in the folder submitted from
    first, as a RECIPE given is: that checkout's recipe, with this project's code. A RECIPE given still is."""
    other = tmp_path / "dpotrain"  # the checkout submitted from, its own configs/think.yaml
    (other / "configs").mkdir(parents=True)
    (other / "configs" / "think.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "ACCELERATE_CONFIG"}
    env = {k: v for k, v in env.items() if k not in ("RECIPE", "DPOTRAIN_RECIPE_GIVEN")}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(other), "SLURM_GPUS_PER_NODE": "4"}
    for given, recipe in (({}, "configs/think.yaml"), ({"RECIPE": "configs/think.yaml"}, other / "configs/think.yaml")):
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "dpo_train.sh")], cwd=other, env=env | given, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        assert f"train_dpo.py --config {recipe} " in result.stdout, result.stdout


def test_a_job_submitted_with_chdir_reads_relative_paths_in_that_folder(tmp_path):
    """`sbatch --chdir DIR .../dpo_train.sh`: Slurm starts the job in DIR, reads the script's own relative path and
    writes the log there, while SLURM_SUBMIT_DIR stays the folder sbatch ran in (a real Slurm 23.11 job: PWD=DIR,
    StdOut=DIR/<job>.out). The job's relative RECIPE, ACCELERATE_CONFIG and command-line paths were looked for in
    SLURM_SUBMIT_DIR: `RECIPE=my.yaml sbatch --chdir exp ...` was refused as "recipe my.yaml not found"."""
    submitted, workdir = tmp_path / "home", tmp_path / "exp"  # where sbatch ran; --chdir's folder
    submitted.mkdir()
    workdir.mkdir()
    (workdir / "my.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    (workdir / "my_accel.yaml").write_text((ROOT / "accelerate_config.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "ACCELERATE_CONFIG"}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(submitted), "SLURM_GPUS_PER_NODE": "4"}
    env |= {"RECIPE": "my.yaml", "ACCELERATE_CONFIG": "my_accel.yaml"}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "dpo_train.sh")], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert f"--config_file {workdir / 'my_accel.yaml'} " in result.stdout, result.stdout
    assert f"train_dpo.py --config {workdir / 'my.yaml'} " in result.stdout, result.stdout


def test_a_relative_submitted_path_is_read_where_sbatch_ran_not_in_chdirs_folder(tmp_path):
    """`sbatch --chdir DIR ../dpotrain/scripts/dpo_train.sh`: sbatch read the script where it ran, and Slurm keeps a
    path it did not find under DIR as typed (scontrol's Command=, relative); the job, started in DIR, looked for it
    there, and fell back to the folder submitted from: another checkout there ran its own launch.sh."""
    project, submitted, workdir = tmp_path / "dpotrain", tmp_path / "other", tmp_path / "runs" / "exp"
    project.symlink_to(ROOT)
    (submitted / "scripts").mkdir(parents=True)  # where sbatch ran: another checkout, a launch.sh that says it ran
    (submitted / "scripts" / "launch.sh").write_text("echo ran the checkout submitted from\n")
    (submitted / "train_dpo.py").write_text("")
    workdir.mkdir(parents=True)
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        out = spooled_job(tmp_path, ROOT / "scripts" / script, submitted, workdir, f"../dpotrain/scripts/{script}")
        assert "ran the checkout" not in out and "--num_processes 4" in out, out


def test_without_scontrol_a_job_started_by_chdir_in_the_project_finds_it(tmp_path):
    """`sbatch --chdir ~/dpotrain ~/dpotrain/scripts/dpo_train.sh` typed elsewhere, on a node without scontrol: the
    job looked for the project in the folder submitted from alone, and failed, though it was started in it."""
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):  # on a node where scontrol cannot answer
        out = spooled_job(tmp_path, ROOT / "scripts" / script, elsewhere, workdir=ROOT, command="")
        assert "--num_processes 4" in out, out


def test_launch_sh_run_directly_runs_its_own_project_and_reads_paths_where_it_was_typed(tmp_path):
    """`bash ~/dpotrain/scripts/launch.sh` inside an allocation (salloc: SLURM_SUBMIT_DIR is where salloc ran): it
    went to SLURM_SUBMIT_DIR, or the folder it was typed in, for the project, and died on "no virtual environment".
    It runs the project it is in; a relative RECIPE and command-line paths are the folder's it was typed in."""
    typed, allocated = tmp_path / "exp", tmp_path / "home"
    for folder in (typed, allocated):
        folder.mkdir()
    (typed / "my.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_")) and k != "RECIPE"}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(allocated), "SLURM_GPUS_PER_NODE": "4"}
    for cwd, recipe, shown in (
        (ROOT, "configs/smoke.yaml", "configs/smoke.yaml"),
        (typed, "my.yaml", typed / "my.yaml"),
    ):
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "launch.sh")], cwd=cwd, env=env | {"RECIPE": recipe}, capture_output=True
        )
        assert result.returncode == 0, result.stderr.decode()
        assert f"train_dpo.py --config {shown} " in result.stdout.decode(), result.stdout.decode()


def test_launch_sh_run_directly_runs_its_own_project_over_a_root_exported_for_another(tmp_path):
    """`export DPOTRAIN_ROOT=~/dpotrain` (as an edited copy of the sbatch scripts asks: the test below) left in the
    shell, then `bash ~/dpotrain-exp/scripts/launch.sh` in an allocation: launch.sh took the exported project over its
    own and ran ~/dpotrain's train_dpo.py and venv, where the sbatch scripts run the project of the script submitted."""
    other = tmp_path / "other"
    other.mkdir()
    for name in ("train_dpo.py", "dpotrain", ".venv", "configs", "accelerate_config.yaml", "ds_config.json"):
        (other / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_", "VENV"))}
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_GPUS_PER_NODE": "4", "RECIPE": "configs/smoke.yaml"}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch.sh")], cwd=tmp_path, env=env | {"DPOTRAIN_ROOT": str(other)},
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"export PATH={ROOT}/.venv/bin:" in result.stdout, result.stdout


def torch_extensions_dir() -> str:
    """Where the session's jobs, run by this venv, built DeepSpeed's JIT ops: in the venv (dpotrain/recipe/venv.py),
    else in cpp_extension's default for this interpreter."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    from dpotrain.recipe import venv

    if folder := os.environ.get("TORCH_EXTENSIONS_DIR") or venv.torch_extensions_default():
        return folder
    device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{device}")


def test_a_link_to_an_sbatch_script_runs_the_project_it_points_into(tmp_path):
    """`sbatch ~/bin/dpo.sh`, a link to the project's script, typed in another folder: scontrol's Command= names the
    link, whose own folder holds no project, so the job died on "launch.sh: No such file or directory"."""
    links, elsewhere = tmp_path / "links", tmp_path / "runs"
    links.mkdir()
    elsewhere.mkdir()
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        (links / script).symlink_to(ROOT / "scripts" / script)
        out = spooled_job(tmp_path, links / script, elsewhere)
        assert "--num_processes 4" in out, out


def test_an_edited_copy_outside_the_project_runs_the_exported_project_or_says_how(tmp_path):
    """A copy of an sbatch script kept outside the project (its #SBATCH lines edited), submitted from outside too: it
    ran bash's "launch.sh: No such file or directory". It now runs the project the user exports as DPOTRAIN_ROOT, and
    without one fails at once saying so."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for script in ("dpo_train.sh", "dpo_instruct_train.sh"):
        (jobs / script).write_text((ROOT / "scripts" / script).read_text())
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_ROOT"))}
        env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(jobs), "SLURM_GPUS_PER_NODE": "4"}
        refused = subprocess.run(["bash", str(jobs / script)], cwd=jobs, env=env, capture_output=True, text=True)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1 and "export DPOTRAIN_ROOT=/path/to/dpotrain" in refused.stderr
        env["DPOTRAIN_ROOT"] = str(ROOT)
        ran = subprocess.run(["bash", str(jobs / script)], cwd=jobs, env=env, capture_output=True, text=True)
        assert ran.returncode == 0 and "--num_processes 4" in ran.stdout, ran.stderr


@pytest.mark.parametrize("code", [3, 143])
def test_the_launch_in_the_background_ends_with_srun_s_own_exit_code(code):
    """launch.sh runs srun's line in the background (to keep its traps live) and reads its code with `wait`: under
    set -e a background `eval` of a failing command ended with 1, whatever srun's code, so an srun ended by Slurm's
    SIGTERM (143) read as a node's failure and the wait for the save was skipped. The script's own line, run here."""
    (launch,) = [ln for ln in (ROOT / "scripts" / "launch.sh").read_text().splitlines() if 'eval "$line"' in ln]
    script = f"""set -euo pipefail
line='bash -c "exit {code}"'
{launch}
wait "$!" && rc=0 || rc=$?
echo "rc=$rc"
"""
    ran = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert ran.stdout.strip() == f"rc={code}", (ran.stdout, ran.stderr)

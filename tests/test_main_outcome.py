"""What the main process alone does (a write, a check), shared with every rank (collectives.main_outcome): two real
gloo ranks, the main process's write refused, end on its one line (written once) instead of waiting in the next
collective."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import ROOT, accelerate_launch, model_with_a_token_past_its_embedding, rank_python, torchrun_launch
from hub_server import StandInHub

# Rank 0 alone runs under a file size limit (`ulimit -f`, as a node's limits may differ from the others'): its writes
# past it fail with EFBIG (Python ignores SIGXFSZ), as a full disk's with ENOSPC; the other rank writes nothing there.
# `from_opening`: the limit is set as rank 0 first opens a path holding that name (the file, its temporary name, a file
# in a folder so named: an audit hook), not at its start: a file written late in the run refused, and none before it.
WRAPPER = textwrap.dedent("""
    import os, resource, runpy, sys
    import datasets.config
    sys.path.insert(0, {root!r})
    sys.argv[0] = {train!r}
    # Held in memory (datasets keeps a data set this small in memory, and maps it without cache files): rank 0's
    # tokenized copies are not written past the limit before the record. Set here, not as
    # HF_DATASETS_IN_MEMORY_MAX_SIZE: datasets reads that while being imported, so each rank and the launcher would
    # start as a fresh interpreter (tests/helpers/warm.py), ~6 CPU-s of imports each; datasets reads this at each load.
    datasets.config.IN_MEMORY_MAX_SIZE = {in_memory}

    def at_open(event, args):
        if event == "open" and {from_opening!r} in str(args[0]):
            resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))

    if os.environ.get("RANK") == "1":  # rank 1's own environment (`rank1_env`), as a node's may differ
        os.environ.update({rank1_env!r})
        # and its own view of a path (`rank1_paths`: a node-local copy of the data, of the output folder)
        sys.argv = [{rank1_paths!r}.get(arg, arg) for arg in sys.argv]
        if {rank1_killed!r}:  # killed as its first training step starts, as a lost node's process is
            import signal
            from dpotrain.train.trainer import RecipeDPOTrainer
            RecipeDPOTrainer.training_step = lambda *_, **__: os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("RANK") == "0":
        if {from_opening!r}:
            sys.addaudithook(at_open)
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    runpy.run_path({train!r}, run_name="__main__")
""")


def launch_with_main_limited(
    tmp_path,
    tiny_model_dir,
    limit: int,
    *more: str,
    env: dict | None = None,
    from_opening: str = "",
    config: str | None = None,
    rank1_env: dict | None = None,
    closed_at_once: bool = False,
    rank1_paths: dict | None = None,
    rank1_killed: bool = False,
):
    """The run of `more` on two DDP ranks, rank 0 under a file size limit of `limit`: (the CompletedProcess, stdout and
    stderr together; the output folder). `closed_at_once`: a rank the launcher closes once another failed (its
    SIGTERM, then SIGKILL 30 s later, torchrun's shutdown timeout) is killed as the SIGTERM is sent. `rank1_killed`:
    rank 1 is SIGKILLed as its first training step starts, rank 0 going on into the step's collectives."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(8, seed=3)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wrapper = tmp_path / "wrapper.py"
    train = str(ROOT / "train_dpo.py")
    wrapper.write_text(
        WRAPPER.format(
            root=str(ROOT),
            train=train,
            limit=limit,
            from_opening=from_opening,
            in_memory=1 << 30,
            rank1_env=rank1_env or {},
            rank1_paths=rank1_paths or {},
            rank1_killed=rank1_killed,
        )
    )
    out = tmp_path / "run"
    # DDP, not the recipe's ZeRO-2: DeepSpeed compiles its CPU op on first use, with files past any small limit.
    # `config`: an engine's (configs/accelerate/), under a limit set `from_opening` only, past the op's build.
    ddp = tmp_path / "ddp.yaml"
    # Port 0: a free one, not 29500, which a launch of the other test worker may hold (scripts/test.sh).
    ddp.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\nmain_process_port: 0\n"
    )
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / config) if config else str(ddp),
        "--num_processes",
        "2",
        *rank_python(),
        str(wrapper),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--warmup_steps",
        "0",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--ddp_timeout",  # the old code's other rank waited in the first training step's all-reduce for this long
        "120",
        *more,
    ]
    path = f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, **(env or {})}
    if closed_at_once:
        return launch_closing_at_once(cmd, env), out
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    return result, out


def launch_closing_at_once(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """`cmd` (a launch) run as `subprocess.run` with its output read as it comes: each rank the launcher closes (its
    line "Sending process PID closing signal SIGTERM") killed there, as the launcher kills it 30 s later. A rank still
    in the ranks' first meeting (torch's process group made inside C++, where Python runs no signal handler) writes
    nothing in those 30 s: they were a wait, not what the test reads. Past 600 s the launch is killed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(600, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if closing := re.search(r"Sending process (\d+) closing signal SIGTERM", line):
                with contextlib.suppress(ProcessLookupError):  # it ended on the SIGTERM already
                    os.kill(int(closing.group(1)), signal.SIGKILL)
        proc.wait()
    finally:
        timer.cancel()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines))


@pytest.mark.slow
def test_the_main_process_record_refused_by_the_disk_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """resolved_config.json is written by the main process alone, the other ranks going on into the first training
    step's all-reduce: a write the disk refused ended the main process, and the other waited there (under NCCL until
    ddp_timeout, 30 min; under gloo here, a traceback of its all-gather's 'Connection closed by peer', a remote worker
    crashing). Now every rank raises the main's error, written once: by the main process, which met it."""
    # 10,000 bytes: more than rank 0's writes before the record (its lock, run_files.json, the 8 rows' arrow file;
    # TRL's maps write nothing of a data set held in memory), less than the record (about 12 KB).
    result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 10_000)
    said = result.stdout
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert result.returncode != 0
    assert "Connection closed by peer" not in said and "[rank1]: Traceback" not in said, said[-3000:]
    assert len(errors) == 1, errors  # rank 0's; rank 1's, the same, given it by rank 0, is not written again
    # The limit, rank 0's alone, named on both ranks' lines: what to raise, not space to free (disk_full.SIZE_LIMIT)
    limit = "error: a file size limit (ulimit -f) of 10,000 bytes stopped the write"
    assert errors[0].startswith(f"{limit}: {out / 'resolved_config.json'} could not be written: raise it"), errors[0]
    assert not (out / "resolved_config.json").exists()


SEAL = textwrap.dedent("""
    import errno, os, resource, sys
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from dpotrain.train import checkpoint_manifest
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == 0:  # the main process's node refuses files past 64 bytes: the manifest (the other rank writes none)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    try:
        checkpoint_manifest.seal(Path({folder!r}), "COMPLETE", "{{}}\\n", rank == 0)
        dist.barrier()  # the next training step's collective
        said = "sealed"
    except OSError as e:
        said = f"refused: {{errno.errorcode[e.errno]}}"
    except RuntimeError as e:  # gloo: the main process ended while this rank waited for it
        said = "left waiting in the next collective"
    with open(os.path.join({out!r}, f"rank{{rank}}.txt"), "w") as f:  # one file each: the pipe interleaves lines
        f.write(said)
    # Ended as train_dpo.py ends (its exit handlers, no teardown): a warm rank's teardown collects the test server's
    # heap, ~2 CPU-s (tests/helpers/warm.py)
    from dpotrain.recipe.errors import end_process
    end_process(0)
""")


@pytest.mark.slow
def test_a_checkpoint_manifest_the_main_process_cannot_write_ends_every_rank(tmp_path):
    """Every rank hashes its share of a checkpoint, the main process alone writes MANIFEST.json and the mark: a write
    the disk refused there ended the main process, and the others went on into the next step's collective and waited
    (NCCL: ddp_timeout). Now every rank raises the main's error, as the run's one line (disk_full)."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    for name in "abcd":  # a manifest of 4 entries: past 64 bytes
        (folder / name).write_text(name * 10)
    out = tmp_path / "said"
    out.mkdir()
    script = tmp_path / "seal.py"
    script.write_text(SEAL.format(root=str(ROOT), folder=str(folder), out=str(out)))
    cmd = [*torchrun_launch(), "--standalone", "--nproc_per_node", "2", *rank_python(), str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    said = {p.name: p.read_text() for p in sorted(out.iterdir())}
    assert said == {"rank0.txt": "refused: EFBIG", "rank1.txt": "refused: EFBIG"}, result.stderr[-3000:]
    assert not (folder / "COMPLETE").exists()


# rank 0's node does not answer for the folder (ESTALE), as Path.stat raises it; the other rank's does
SEAL_UNANSWERED = SEAL.replace(
    "    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n",
    "    real_stat = Path.stat\n"
    "    def stat(path, *args, **kwargs):\n"
    "        if path == Path({folder!r}):\n"
    "            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))\n"
    "        return real_stat(path, *args, **kwargs)\n"
    "    Path.stat = stat\n",
).replace("refuses files past 64 bytes: the manifest (the other rank writes none)", "does not answer for the folder")


@pytest.mark.slow
def test_a_checkpoint_the_main_process_could_not_look_at_ends_every_rank(tmp_path):
    """The main process lists the checkpoint's files for every rank to hash its share: its look at the folder
    unanswered (ESTALE, on rank 0's node alone) was raised there while the other ranks waited in the listing's
    broadcast (seen failing on the old code: rank 1 left waiting). Now every rank raises it."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "a").write_text("a")
    out = tmp_path / "said"
    out.mkdir()
    script = tmp_path / "seal.py"
    script.write_text(SEAL_UNANSWERED.format(root=str(ROOT), folder=str(folder), out=str(out)))
    cmd = [*torchrun_launch(), "--standalone", "--nproc_per_node", "2", *rank_python(), str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    said = {p.name: p.read_text() for p in sorted(out.iterdir())}
    assert said == {"rank0.txt": "refused: ESTALE", "rank1.txt": "refused: ESTALE"}, result.stderr[-3000:]
    assert not (folder / "COMPLETE").exists()


@pytest.mark.slow
def test_a_push_the_hub_refuses_at_start_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """The Hub is asked once, by the main process, whether the run may push (here: a token that may not create a repo
    in that namespace). Asked before the process group started, its refusal ended the main process while the other
    rank waited for it to join the group: under `accelerate launch` torchrun's agent sent it SIGTERM, which the run
    holds while the model loads, and killed it 30 s later (on another node it waited for ddp_timeout). Now the group
    starts first and the answer is every rank's, at once: its line written by the main process alone."""
    hub = StandInHub()
    hub.state.create_status["other"] = 403
    try:
        push = ("--push_to_hub", "true", "--hub_model_id", "other/new", "--hub_token", "hf_stand_in_token")
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home")}
        result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *push, env=env)
    finally:
        hub.close()
    said = result.stdout
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert result.returncode != 0
    assert "SIGKILL" not in said and "[rank1]: Traceback" not in said, said[-3000:]
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: the Hub refuses to create other/new with this Hugging Face token")
    assert "other/new" not in hub.state.repos


@pytest.mark.slow
def test_a_folder_another_live_run_holds_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """Whether another live run holds the output folder is asked by the main process alone (another rank, slower,
    would find the lock its own main process had just taken): its refusal ended the main process, and the other rank
    waited for it at the lock's broadcast. Now the answer is every rank's."""
    from dpotrain.cluster import run_lock

    out = tmp_path / "run"
    out.mkdir()
    # This test's own process, alive for the whole launch: the run that holds the folder.
    (out / run_lock.LOCK_FILE).write_text(json.dumps(run_lock.holder_record()))
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30)
    said = result.stdout
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert result.returncode != 0
    assert "[rank1]: Traceback" not in said, said[-3000:]
    assert len(errors) == 1, errors
    assert f"pid {os.getpid()}" in errors[0], errors[0]


def one_line_each(result, limit: int, what: str) -> None:
    """Every rank of the launch ended on the main process's error, its one line written once, the main process's limit
    named (not a traceback, nor a rank left waiting in a collective until the timeout)."""
    said = result.stdout
    # A line may follow the other rank's progress bar, which ends without a newline: the two share one pipe.
    errors = [line[line.index("error: ") :] for line in said.splitlines() if "error: " in line]
    assert result.returncode != 0
    # (the launcher's own traceback, `ChildFailedError`, follows any rank's non-zero exit)
    assert "[rank0]: Traceback" not in said and "[rank1]: Traceback" not in said, said[-3000:]
    assert "Connection closed by peer" not in said and "Timed out" not in said, said[-3000:]  # gloo's waits
    assert len(errors) == 1, (errors, said[-3000:])  # the other rank's copy is not written again
    assert errors[0].startswith(f"error: a file size limit (ulimit -f) of {limit:,} bytes stopped the write: {what}")


@pytest.mark.slow
def test_a_checkpoint_the_main_process_cannot_write_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """Under DDP the main process alone writes a checkpoint's weights, optimizer and trainer state: a write the disk
    refused there ended the main process on its line, and the other rank went on into the save's barrier (`on_save`)
    and waited (gloo: 'Connection closed by peer'; NCCL: ddp_timeout). Now the save's outcome is every rank's: the
    main process's line written once, the checkpoint cut short removed."""
    # 100,000 bytes: more than any file rank 0 writes before the checkpoint (the record, about 12 KB), less than the
    # checkpoint's weights (about 760 KB).
    result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 100_000, "--save_strategy", "steps")
    one_line_each(result, 100_000, f"checkpoint-1 could not be written in {out}: raise it")
    assert not (out / "checkpoint-1").exists()


@pytest.mark.slow
def test_a_metrics_line_the_main_process_cannot_write_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """metrics.jsonl is written by the main process alone at each logged step: a write the disk refused there ended
    the main process on its line, and the other rank went on into the next collective and waited (gloo: 'Connection
    closed by peer'; NCCL: ddp_timeout). Now the write's outcome is every rank's, its line written once."""
    # Rank 0's limit set as it opens metrics.jsonl: 100 bytes, less than one record (about 800 bytes).
    more = ("--max_steps", "2", "--logging_steps", "1")
    result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 100, *more, from_opening="metrics.jsonl")
    one_line_each(result, 100, f"{out / 'metrics.jsonl'} could not be written: raise it")


@pytest.mark.slow
def test_a_samples_record_the_main_process_cannot_write_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """samples.jsonl: the main process generates and writes a round of samples (before training: the base model's)
    while the other rank goes on into the first step's all-reduce: a write the disk refused ended the main process
    alone. Now every rank ends on the main's line."""
    more = ("--samples_every", "1", "--sample_count", "1")
    result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 100, *more, from_opening="samples.jsonl")
    one_line_each(result, 100, f"{out / 'samples.jsonl'} could not be written: raise it")


@pytest.mark.slow
def test_a_health_stop_record_the_main_process_cannot_write_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """A health guard stops every rank at the same step, and the main process alone writes health_stop.json (what
    stopped the run, for its rerun): a write the disk refused there ended the main process, and the other rank went
    on into the stop's checkpoint and waited for it. Now every rank ends on the main's line."""
    guard = ("--max_steps", "3", "--logging_steps", "1", "--health_action", "stop", "--health_loss_floor", "0.69")
    result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 10, *guard, from_opening="health_stop.json")
    assert "health STOP [loss_floor]" in result.stdout, result.stdout[-3000:]
    one_line_each(result, 10, f"{out / 'health_stop.json'} could not be written: raise it")


@pytest.mark.slow
def test_a_final_model_the_main_process_cannot_write_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """The final model: under DDP the main process alone writes it, and the others wait at the last barrier; a write
    the disk refused ended the main process on its line and left them there. Now every rank ends on the main's."""
    from dpotrain import output_folder

    staging = output_folder.FINAL_STAGING
    result, out = launch_with_main_limited(tmp_path, tiny_model_dir, 100_000, from_opening=staging)
    one_line_each(result, 100_000, f"the final model could not be written in {out}: raise it")


@pytest.mark.slow
def test_a_stop_confirmation_the_main_process_cannot_write_ends_every_rank_on_its_line(tmp_path, tiny_model_dir):
    """A stop request (the stop file there from the start: every rank stops after step 1, with checkpoint-1): the main
    process alone writes `<stop file>.checkpointed`, which tells the batch script to requeue, while the other rank goes
    on to the stopped run's last barrier. A write the disk refused there ended the main process alone, and the other
    waited. Now every rank ends on the main's line."""
    stop = tmp_path / "stop"
    stop.write_text("")
    # A live reference: no reference stage, whose own stop (before training) this is not.
    more = ("--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--precompute_ref_log_probs", "false")
    env = {"DPOTRAIN_STOP_FILE": str(stop)}
    result, out = launch_with_main_limited(
        tmp_path, tiny_model_dir, 10, *more, env=env, from_opening="stop.checkpointed"
    )
    assert "Stop requested: checkpoint" in result.stdout, result.stdout[-3000:]
    one_line_each(result, 10, f"{stop}.checkpointed could not be written: raise it")
    assert (out / "checkpoint-1" / "COMPLETE").is_file()  # what the rerun goes on from


ENGINES = {"zero3": "configs/accelerate/zero3.yaml", "fsdp2": "configs/accelerate/fsdp2.yaml"}
# A short collective timeout: the old code's ranks waited in a collective for it (gloo), and the test with them.
SHORT_WAIT = ("--ddp_timeout", "30")


# TR-DPO: its moved reference is gathered after the rest of the checkpoint, on every rank (moved_reference.save).
TR_DPO = ("--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--precompute_ref_log_probs", "false")


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine,tr_dpo",
    # ZeRO-3 once, with TR-DPO: its checkpoint is the same held writes (the weights, DeepSpeed's own), then the moved
    # reference's gathers, which the main process must still join. A ZeRO-3 launch without TR-DPO runs the first part
    # alone: a write not held there fails this launch as it failed that one, so it is not launched again.
    [("zero2", ()), ("fsdp2", ()), ("zero3", TR_DPO)],
    ids=["zero2", "fsdp2", "zero3-tr_dpo"],
)
def test_a_sharded_checkpoint_the_main_process_cannot_write_ends_every_rank_on_its_line(
    tmp_path, tiny_model_dir, engine, tr_dpo
):
    """Under ZeRO-3 (and ZeRO-2, the default engine) the main process writes a checkpoint's weights, then every rank
    enters DeepSpeed's save (its barriers): a write refused there ended the main process's part early, and it waited
    in `every_rank_outcome` while the other waited in DeepSpeed's barrier, both until the collective timeout. Under
    FSDP2 each rank writes its shards (torch.distributed.checkpoint), which raises one rank's failure on every rank as
    a CheckpointException, a BaseException: a traceback on each rank. Now every rank ends on the main's line, the
    checkpoint removed. With TR-DPO the main process, its weights refused, must still join the moved reference's
    gathers after them."""
    more = ("--save_strategy", "steps", "--save_steps", "1", *tr_dpo, *SHORT_WAIT)
    # 10 bytes from the checkpoint's first file on: every file refused, as on a full disk, DeepSpeed's `latest` tag
    # file (12 bytes, written just before its last barrier) too.
    config = {"zero2": "accelerate_config.yaml", **ENGINES}[engine]
    result, out = launch_with_main_limited(
        tmp_path, tiny_model_dir, 10, *more, from_opening="checkpoint-1", config=config
    )
    one_line_each(result, 10, f"checkpoint-1 could not be written in {out}: raise it")
    assert not (out / "checkpoint-1").exists()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_sharded_final_model_the_main_process_cannot_write_ends_every_rank_on_its_line(
    tmp_path, tiny_model_dir, engine
):
    """The final model under ZeRO-3 and FSDP2: every rank gathers the weights (`accelerator.get_state_dict`), and the
    main process writes them after the last gather: its refusal reaches the others in `every_rank_outcome`, where they
    wait. Passed before this test was written (kept: a write moved between two gathers would hang here)."""
    from dpotrain import output_folder

    result, out = launch_with_main_limited(
        tmp_path, tiny_model_dir, 1000, *SHORT_WAIT, from_opening=output_folder.FINAL_STAGING, config=ENGINES[engine]
    )
    one_line_each(result, 1000, f"the final model could not be written in {out}: raise it")


@pytest.mark.slow
def test_a_refusal_of_the_command_is_one_line_in_a_launch_log(tmp_path, tiny_model_dir):
    """A refusal of the command itself (before the ranks' first collective, from what every rank reads alike) was
    written by every rank: twice in a 2-process launch's log, 4 times on a node of 4 GPUs. Now by one process of the
    node alone (the first to meet it), and every rank still exits non-zero (the launcher's summary lists each)."""
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, "--learning_rate", "-1")
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == ["error: learning_rate must be > 0 (got -1.0); the recipes use 1e-6"], result.stdout[-3000:]
    # The launcher's summary: one entry per rank, each exited non-zero (2, the refusal's code, where it got there
    # before the launcher ended it for the other's exit).
    codes = re.findall(r"^\s*exitcode\s*: (-?\d+)", result.stdout, re.MULTILINE)
    assert len(codes) == 2 and "0" not in codes, result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,line",
    [
        (["--warmup_steps", "1"], "--max_steps 1 with warmup trains nothing"),
        (["--max_length", "8", "--max_tokens_per_microbatch", "16"], "max_length 8 leaves 0 of 8 pairs"),
        (["--eval_strategy", "steps", "--max_length", "512"], "max_length 512 leaves 0 of the 2 held-out pairs"),
        (["--eval_strategy", "steps"], "the evaluation split has 1 pair, fewer than the 2 processes that evaluate"),
    ],
)
def test_a_refusal_of_the_data_after_the_ranks_met_is_one_line_in_a_launch_log(tmp_path, tiny_model_dir, args, line):
    """A run that would train nothing (one step, all of it warm-up; a max_length that leaves the pairs nothing to
    learn, or the held-out pairs none to evaluate on; fewer held-out pairs than the ranks) is refused once the data
    set is counted, after the ranks first met, from what every rank counts alike: it was written by every rank, twice
    in a 2-process launch's log. Now once, by the first rank to meet it, every rank exiting non-zero."""
    if "--eval_strategy" in args:  # held-out pairs whose prompts alone fill max_length
        from dpotrain.data import builtin

        held = builtin.make_preference_rows(2 if "--max_length" in args else 1, seed=4)  # else: fewer than the ranks
        for row in held:
            for side in ("chosen", "rejected"):
                row[side][0]["content"] += " please" * 600
        (tmp_path / "held.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held))
        args = [*args, "--dataset_mixer_eval_list", str(tmp_path / "held.jsonl"), "1.0"]
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *args)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], result.stdout[-3000:]
    assert result.returncode != 0


@pytest.mark.slow
def test_a_refusal_of_the_command_rank_1_alone_meets_is_one_line_in_a_launch_log(tmp_path, tiny_model_dir):
    """A refusal before the ranks first meet is written by the first process on the node that meets it: rank 1's
    environment alone refused (GPUS_PER_NODE, read as the recipe is parsed), rank 0 went on to the first collective
    and the launcher ended it, and the job's log held no error line at all (the first process on the node wrote the
    line, and it had none to write; the launcher's summary showed exit code 2 alone). Rank 0, in the ranks' first
    meeting, is killed as the launcher closes it (`closed_at_once`), not 30 s later by the launcher."""
    rank1_env = {"GPUS_PER_NODE": "two"}
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, rank1_env=rank1_env, closed_at_once=True)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    want = "error: GPUS_PER_NODE='two' is not a number of processes: give a whole number (WORLD_SIZE=16"
    assert len(errors) == 1 and errors[0].startswith(want), result.stdout[-3000:]
    assert result.returncode != 0


@pytest.mark.slow
def test_a_refusal_of_the_data_rank_1_alone_meets_after_the_ranks_met_is_one_line_in_a_launch_log(
    tmp_path, tiny_model_dir
):
    """A refusal of the data after the ranks met (here a max_length that leaves the pairs nothing to learn) was written
    by rank 0 alone (every rank counts the same pairs): where rank 1 alone met it (its node's own copy of the data
    file), it wrote nothing, rank 0 went on to its next collective until the launcher ended it, and the job's log held
    no line saying why. Now the refusing rank's line, once, every rank ending non-zero."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(8, seed=3)  # the launch's own pairs, each prompt made to fill max_length
    for row in rows:
        row["chosen"][0]["content"] += " please" * 600
        row["rejected"][0]["content"] = row["chosen"][0]["content"]
    copy = tmp_path / "node1" / "pairs.jsonl"
    copy.parent.mkdir()
    copy.write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths = {str(tmp_path / "pairs.jsonl"): str(copy)}
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, rank1_paths=paths, closed_at_once=True)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "leaves 0 of 8 pairs" in errors[0], result.stdout[-3000:]
    codes = re.findall(r"^\s*exitcode\s*: (-?\d+)", result.stdout, re.MULTILINE)
    assert result.returncode != 0 and len(codes) == 2 and "0" not in codes, result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no token", "no W&B login", "foreign files"])
def test_a_refusal_of_the_outputs_after_the_ranks_met_is_one_line_in_a_launch_log(tmp_path, tiny_model_dir, case):
    """The output checks after the ranks met that every rank reads alike (a push without a token, W&B without a login,
    an output folder holding files that are no run's) were written by every rank: twice in a 2-process launch's log.
    Now once, every rank exiting non-zero, none left waiting in a collective."""
    more, env, line = [], {}, "holds files that are not a run's (1: notes.txt)"
    if case == "no token":
        more, line = ["--push_to_hub", "true", "--hub_model_id", "org/x"], "no Hugging Face token was found"
        env = {"HF_TOKEN": "", "HF_TOKEN_PATH": str(tmp_path / "no-token")}
    elif case == "no W&B login":
        more, line = ["--report_to", "wandb"], "report_to wandb but no W&B login"
        env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc")}
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "notes.txt").write_text("a person's notes\n")
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *more, env=env)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], result.stdout[-3000:]
    codes = re.findall(r"^\s*exitcode\s*: (-?\d+)", result.stdout, re.MULTILINE)
    assert result.returncode != 0 and len(codes) == 2 and "0" not in codes, result.stdout[-3000:]


@pytest.mark.slow
def test_a_rank_killed_mid_training_leaves_the_other_one_line_not_gloos_traceback(tmp_path, tiny_model_dir):
    """Rank 1 killed in its first training step (SIGKILL: a lost node, the kernel's OOM killer) left rank 0 in the
    step's collectives, which gloo ended with a traceback ('Connection closed by peer', pair.cc) above the launcher's
    summary: noise where the cause is the dead rank's. Now rank 0 ends on one line saying another process ended
    first and where to look, exit non-zero; the launcher's summary names rank 1's SIGKILL."""
    from dpotrain.recipe.errors import PEER_GONE

    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, rank1_killed=True)
    said = result.stdout
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors == [f"error: {PEER_GONE}"], said[-3000:]
    assert "[rank0]: Traceback" not in said and "pair.cc" not in said and "SIGKILL" in said, said[-3000:]


OWN = textwrap.dedent("""
    import os, signal, sys
    from datetime import timedelta
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from dpotrain.cluster import collectives
    from dpotrain.recipe.errors import ConfigError, RunError, run_command

    def main():
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        rank = dist.get_rank()
        if {mode!r} == "shared":  # rank 1's write failed: every rank raises it (a checkpoint's save)
            collectives.every_rank_outcome(RunError("rank 1's write failed") if rank == 1 else None)
        collectives.max_over_ranks(0, "cpu")  # the ranks have met: what one raises alone may be its own
        if rank == 1:
            raise ConfigError("rank 1's own refusal")
        signal.signal(signal.SIGTERM, lambda *_: None)  # held, as train_dpo.py holds it for a checkpoint
        dist.barrier()  # rank 0 waits here for rank 1, whose process ends

    run_command(main, int(os.environ["RANK"]), os.environ["LOCAL_RANK"] == "0")  # as train_dpo.py's
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode,line", [("shared", "rank 1's write failed"), ("own", "rank 1's own refusal")])
def test_a_failure_one_rank_met_is_written_by_that_rank_alone(tmp_path, mode, line):
    """Rank 1's failure, given to rank 0 (`every_rank_outcome`), was written by both; one it raises alone after the
    ranks met must still be written (by it): one line each time, from rank 1. Rank 0, left waiting for it in a
    collective, printed gloo's traceback ('Connection closed by peer') below rank 1's line, hiding it: now one line
    saying another process ended first, where the cause is, and a non-zero exit."""
    from dpotrain.recipe.errors import PEER_GONE

    script = tmp_path / "own.py"
    script.write_text(OWN.format(root=str(ROOT), mode=mode))
    cmd = [*torchrun_launch(), "--standalone", "--nproc_per_node", "2", *rank_python(), str(script)]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    errors = [line[line.index("error: ") :] for line in result.stdout.splitlines() if "error: " in line]
    left = [f"error: {PEER_GONE}"] if mode == "own" else []  # rank 0's, after rank 1's: rank 1 ended first
    assert result.returncode != 0 and errors == [f"error: {line}", *left], result.stdout[-3000:]
    assert "[rank0]: Traceback" not in result.stdout and "pair.cc" not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_a_resume_refused_once_the_ranks_met_is_written_once(tmp_path, tiny_model_dir):
    """The output folder's resume checks run after the ranks' first collective, where each rank writes its own line:
    an unfinished run with other settings (resolve.check_output_dir) and a TR-DPO checkpoint without its moved
    reference (resume.check_live_reference) were written once per rank; `check_partitions` beside them once. Before
    them, the same folder resumed by rank 0 while rank 1 sees none: the ranks' disagreement, named once."""
    from dpotrain.train import checkpoint_manifest, resume

    tr_dpo = ("--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--precompute_ref_log_probs", "false")
    saved = ("--save_strategy", "steps", "--save_steps", "1")
    first, out = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *tr_dpo, *saved)
    assert first.returncode == 0, first.stdout[-3000:]
    for name in ("model.safetensors", "run_complete.json"):  # a run stopped after its checkpoint
        (out / name).unlink()
    # Rank 1's node sees an empty output folder (a node-local one), rank 0's the checkpoint: rank 0 resumes, rank 1
    # starts afresh. Every rank joins each output check's gather whatever it decided (`once(..., when=)`): one that
    # skipped the check its decision skips would be a gather behind the other, which then takes the other's next
    # values as its outcome (a traceback), or waits; they reach the folder's agreement, whose line names it.
    apart = {str(out): str(tmp_path / "node1" / "run")}
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *tr_dpo, *saved, rank1_paths=apart)
    errors = [line[line.index("error: ") :] for line in result.stdout.splitlines() if "error: " in line]
    disagree = "error: ranks disagree on the output folder's state: rank 1 has resume=None, rank 0 has resume="
    assert result.returncode != 0 and len(errors) == 1, result.stdout[-3000:]
    assert errors[0].startswith(disagree) and "checkpoint-1" in errors[0], result.stdout[-3000:]
    checkpoint = out / "checkpoint-1"
    manifest = json.loads((checkpoint / checkpoint_manifest.MANIFEST).read_text())
    del manifest["files"][resume.REFERENCE_FILE]  # as a version that did not save the reference wrote it
    (checkpoint / checkpoint_manifest.MANIFEST).write_text(json.dumps(manifest))
    (checkpoint / resume.REFERENCE_FILE).unlink()
    for more, refusal in [
        ((), resume.no_reference(str(checkpoint))),
        (("--max_steps", "2"), f"output_dir '{out}' holds an unfinished run with other settings (max_steps: 1 -> 2)"),
    ]:
        result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *tr_dpo, *saved, *more)
        errors = [line[line.index("error: ") :] for line in result.stdout.splitlines() if "error: " in line]
        assert result.returncode != 0 and len(errors) == 1 and refusal in errors[0], result.stdout[-3000:]


# gloo's words as a rank waiting in a collective meets its peer's end (the launches above raise it for real).
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
    "[127.0.0.1]:35728. This is typically caused by a remote worker crashing."
)


def test_only_gloos_peer_gone_becomes_the_one_line_and_a_ranks_own_error_keeps_its_traceback(capsys):
    """The rule that turns gloo's 'Connection closed by peer' into one line must not hide this rank's own failure: a
    RuntimeError of other words, one that merely says 'closed by peer' (a Hub connection), a ConnectionResetError, go
    on as the traceback they were; gloo's, raised from another error too, ends on the line, exit code 1."""
    from dpotrain.recipe.errors import PEER_GONE, ConfigError, run_cli

    def raising(error):
        def main():
            raise error

        return main

    def wrapped():
        try:
            raise RuntimeError(GLOO_PEER_GONE)
        except RuntimeError as e:
            raise ValueError("the step's collective failed") from e

    for own in (RuntimeError("CUDA out of memory"), RuntimeError("Connection closed by peer"), ConnectionResetError()):
        with pytest.raises(type(own)):
            run_cli(raising(own))
    for gone in (raising(RuntimeError(GLOO_PEER_GONE)), wrapped):
        with pytest.raises(SystemExit) as ended:
            run_cli(gone)
        assert ended.value.code == 1 and capsys.readouterr().err == f"error: {PEER_GONE}\n"

    # Met while this rank shared its own failure with the others (collectives.main_outcome's except): that one is said,
    # a refusal as its line and code, any other as its traceback; the peer-gone line alone hid it
    def sharing(own):
        def main():
            try:
                raise own
            except Exception:  # noqa: BLE001 - the collective that shares it meets the dead peer
                raise RuntimeError(GLOO_PEER_GONE)  # noqa: B904 - as gloo's raises it: `own` is its context

        return main

    with pytest.raises(SystemExit) as ended:
        run_cli(sharing(ConfigError("output_dir is full: make room")))
    assert ended.value.code == 2 and capsys.readouterr().err == "error: output_dir is full: make room\n"
    with pytest.raises(RuntimeError, match="Connection closed by peer") as raised:
        run_cli(sharing(ValueError("this rank's own bug")))
    assert isinstance(raised.value.__context__, ValueError)  # Python prints both tracebacks
    with pytest.raises(SystemExit) as ended:  # a Ctrl-C behind it: its own line and code, not two tracebacks
        run_cli(sharing(KeyboardInterrupt()))
    assert ended.value.code == 130 and capsys.readouterr().err == "\nCtrl-C: stopped\n"

    def wrapping():  # gloo's error wrapped (`raise ... from`) as the refusal is shared: the refusal still said
        try:
            raise ConfigError("output_dir is full: make room")
        except ConfigError:
            try:
                raise RuntimeError(GLOO_PEER_GONE)  # noqa: B904 - as gloo's raises it: the refusal is its context
            except RuntimeError as gone:
                raise ValueError("the broadcast failed") from gone

    with pytest.raises(SystemExit) as ended:
        run_cli(wrapping)
    assert ended.value.code == 2 and capsys.readouterr().err == "error: output_dir is full: make room\n"


def _long(rows: list, words: int) -> list:
    """`rows` with each answer made `words` words longer: pairs past any max_length the launch's own pairs fit."""
    for row in rows:
        for side in ("chosen", "rejected"):
            row[side][-1]["content"] += " volcano" * words
    return rows


def _plain(rows: list) -> list:
    """`rows` as plain-text pairs (a prompt and two answers, no chat template): the same text in the other kind."""
    return [
        {
            "prompt": r["chosen"][0]["content"],
            "chosen": r["chosen"][1]["content"],
            "rejected": "I will not say. " + r["rejected"][1]["content"],
        }
        for r in rows
    ]


# Checks after the ranks met, on what each rank reads from its own copy of the data (a node-local one): `file` is the
# pairs rank 1 alone reads (the launch's own are made from `builtin.make_preference_rows(8, seed=3)`). Each rank
# raised alone: one refused alone left the others in their next collective (under NCCL until ddp_timeout), and one
# met by every rank was written by each. The other checks moved into `every_rank` run on what the ranks already agree
# on, so have no launch here: `plan.plan_run` (the trainer's plan, after `agreement.check` found the first half's
# lengths equal) and `resolve.check_resumed_ranks` (the resume point the ranks agreed on, its record's pairs) are met
# alike by every rank; `weight_names.check` is a dry run's, which starts no process group.
ALONE = {
    "held-out kind": (
        "held.jsonl",
        _plain,
        ["--eval_strategy", "steps", "--dataset_mixer_eval_list", "{held}", "1.0"],
        "the held-out pairs are plain text and the training pairs message lists",
    ),
    "auto's token budget": (
        "pairs.jsonl",
        lambda rows: _long(rows, 300),
        ["--max_length", "auto", "--auto_coverage", "1.0", "--max_tokens_per_microbatch", "1024"],
        "max_length: auto chose",
    ),
    "positions": (
        "pairs.jsonl",
        lambda rows: _long(rows, 5000),
        ["--max_length", "none", "--max_tokens_per_microbatch", "none", "--per_device_train_batch_size", "4"],
        "reaches past the 4,096 positions",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ALONE))
def test_a_refusal_rank_1_alone_meets_on_its_copy_of_the_data_ends_every_rank_on_its_line(
    tmp_path, tiny_model_dir, case
):
    """Held-out pairs of another kind than the training pairs, a token budget short of the max_length `auto` chose, a
    sequence past the model's positions: each refused on rank 1 alone (its node's own copy of the pairs), after the
    ranks met. Rank 1 raised alone and rank 0 went on to its next collective, where it waited (NCCL: ddp_timeout)
    until the launcher ended it: SIGTERM, and a traceback of rank 0 in the log. Now every rank joins one gather
    whatever it found (`collectives.every_rank`): the refusing rank's line, once, every rank ending on it."""
    from dpotrain.data import builtin

    file, changed, args, line = ALONE[case]
    held = tmp_path / "held.jsonl"  # the held-out pairs every rank reads, where the case has some
    held.write_text("".join(json.dumps(row) + "\n" for row in builtin.make_preference_rows(4, seed=4)))
    rows = builtin.make_preference_rows(4, seed=4) if file == "held.jsonl" else builtin.make_preference_rows(8, seed=3)
    copy = tmp_path / "node1" / file
    copy.parent.mkdir()
    copy.write_text("".join(json.dumps(row) + "\n" for row in changed(rows)))
    args = [arg.format(held=held) for arg in args]
    result, _ = launch_with_main_limited(
        tmp_path, tiny_model_dir, 1 << 30, *args, rank1_paths={str(tmp_path / file): str(copy)}
    )
    _one_line_every_rank_ends_on(result, line)


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank 1 alone", "every rank"])
def test_a_refusal_of_the_model_after_the_ranks_met_is_one_line_every_rank_ends_on(tmp_path, tiny_model_dir, who):
    """The model's checks of the forward stage (here its tokenizer's ids past the embedding's rows, config.json's
    vocab_size cut by hand) ran on each rank on its own: met by every rank, the line was written by each, twice in a
    2-process launch's log; met by rank 1 alone (its node's own copy of the model folder), rank 1 raised alone and
    rank 0 went on to its next collective until the launcher ended it. Now one gather (`stages.check_model`): the
    line once, every rank ending on it."""
    import shutil

    cut = tmp_path / "cut-model"
    shutil.copytree(tiny_model_dir, cut)
    config = json.loads((cut / "config.json").read_text())
    config["vocab_size"] = 64
    (cut / "config.json").write_text(json.dumps(config))
    model, paths = (tiny_model_dir, {tiny_model_dir: str(cut)}) if who == "rank 1 alone" else (str(cut), {})
    result, _ = launch_with_main_limited(tmp_path, model, 1 << 30, rank1_paths=paths)
    _one_line_every_rank_ends_on(result, "token ids, past the 64 rows of the model's embedding")


def _one_line_every_rank_ends_on(result, line: str) -> None:
    """The launch ended on one refusal line holding `line`, written once, each rank exiting 2 (a refusal's code), rank 0
    not closed while waiting in a collective."""
    said = result.stdout
    errors = [written for written in said.splitlines() if written.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], said[-3000:]
    assert "[rank0]: Traceback" not in said, said[-3000:]  # rank 0 ended on rank 1's refusal, not closed waiting
    codes = re.findall(r"^\s*exitcode\s*: (-?\d+)", said, re.MULTILINE)
    assert result.returncode != 0 and codes == ["2", "2"], said[-3000:]


def _model_with_router_loss(tmp_path, tiny_model_dir) -> str:
    """A copy of the tiny model whose config.json names a router's auxiliary loss: its prompts cannot be shared
    (`shared_prompt.share_problem`), as on a node whose copy of the model differs; every other check passes."""
    import shutil

    changed = tmp_path / "router-model"
    shutil.copytree(tiny_model_dir, changed)
    config = json.loads((changed / "config.json").read_text())
    config |= {"output_router_logits": False, "router_aux_loss_coef": 0.01}
    (changed / "config.json").write_text(json.dumps(config))
    return str(changed)


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank 1 alone", "every rank"])
def test_a_refusal_of_the_forward_choice_is_one_line_every_rank_ends_on(tmp_path, tiny_model_dir, who):
    """The forward's choice (`choice.decide`: the kernels, share_prompt, FlashAttention of this node) ran on each rank
    alone: refused by rank 1 alone (here share_prompt, its node's copy of the model), rank 1 raised alone and rank 0
    went on to its next collective until the launcher ended it; refused by every rank, the line was written twice. Now
    one gather (`stages.decide_forward`): the line once, every rank ending on it."""
    changed = _model_with_router_loss(tmp_path, tiny_model_dir)
    model, paths = (tiny_model_dir, {tiny_model_dir: changed}) if who == "rank 1 alone" else (changed, {})
    result, _ = launch_with_main_limited(tmp_path, model, 1 << 30, "--share_prompt", "true", rank1_paths=paths)
    _one_line_every_rank_ends_on(result, "share_prompt cannot be used here: olmo3's router auxiliary loss")


@pytest.mark.slow
def test_ranks_that_choose_different_forwards_are_refused_at_the_choice_naming_their_nodes(tmp_path, tiny_model_dir):
    """Each rank chooses its forward alone from what its node has (its kernels, its copy of the model): rank 1's copy
    cannot share prompts, so it chose unshared packing where rank 0 chose shared prompts. The first half's agreement
    refused it only after the memory plan had been made for each rank's own forward, as two digests; now the forwards
    are compared as they are chosen (`agreement.check_nodes`), in words, with each rank's node. Long prompts, which
    rank 0 shares (the cheaper forward for them), given to both ranks (the launch's last --dataset_name)."""
    import socket

    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(8, seed=3)
    for row in rows:
        for side in ("chosen", "rejected"):
            row[side][0]["content"] += " volcano" * 100
    data = tmp_path / "long-prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths = {tiny_model_dir: _model_with_router_loss(tmp_path, tiny_model_dir)}
    result, _ = launch_with_main_limited(
        tmp_path, tiny_model_dir, 1 << 30, "--dataset_name", str(data), rank1_paths=paths
    )
    node = socket.gethostname()
    _one_line_every_rank_ends_on(
        result,
        f"ranks disagree on the forward: rank 1 (node {node}) has unshared packing, balanced rows on sdpa, rank 0 "
        f"(node {node}) has shared prompts packing, balanced rows on sdpa: install the same attention kernels",
    )


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank 1 alone", "every rank"])
def test_a_memory_plan_one_node_cannot_fit_is_one_line_every_rank_ends_on(tmp_path, tiny_model_dir, who):
    """The memory plan is made from each node's GPU (`memory.gpu_memory`; here `--gpu_memory_gib`, which rank 1 alone
    reads as 1 GiB, as a node of smaller GPUs): refused on rank 1 alone, rank 1 raised alone and rank 0 went on to
    the first half's agreement until the launcher ended it; refused everywhere, the line was written by each rank. Now
    one gather (`stages.plan_memory`): the line once, every rank ending on it."""
    gpu, paths = ("80", {"80": "1"}) if who == "rank 1 alone" else ("1", {})
    bf16 = ["--bf16", "true", "--use_cpu", "true", "--gpu_memory_gib", gpu]  # planned: bf16 on a CPU's "GPU"
    result, _ = launch_with_main_limited(tmp_path, tiny_model_dir, 1 << 30, *bf16, rank1_paths=paths)
    _one_line_every_rank_ends_on(result, "more than the 1.0 GiB GPU (gpu_memory_gib)")


@pytest.mark.slow
def test_ranks_whose_memory_plans_differ_are_refused_at_the_plan_naming_their_nodes(tmp_path, tiny_model_dir):
    """Each rank plans its memory from its node's GPU (`memory.gpu_memory`; here `--gpu_memory_gib`, which rank 1 alone
    reads as 1 GiB, as a node of smaller GPUs), the plan not enforced (`--memory_check false`): rank 0's fits with no
    layer checkpointed, rank 1's fits nowhere, so it checkpoints every layer. Ranks training by different plans are
    refused as the plan is made (`agreement.check_nodes`), in one line naming both nodes; no test had made two plans
    differ (the tiny model checkpoints nothing on one GPU size), so the refusal was never seen."""
    import socket

    planned = ["--bf16", "true", "--use_cpu", "true", "--gpu_memory_gib", "80", "--activation_checkpointing", "true"]
    result, _ = launch_with_main_limited(
        tmp_path, tiny_model_dir, 1 << 30, *planned, "--memory_check", "false", rank1_paths={"80": "1"}
    )
    node = socket.gethostname()
    _one_line_every_rank_ends_on(
        result, f"ranks disagree on the memory plan: rank 1 (node {node}) has checkpointing all 2 layers, the reference"
    )
    (line,) = [written for written in result.stdout.splitlines() if written.startswith("error:")]
    assert f", rank 0 (node {node}) has checkpointing none, the reference's micro-batch x" in line, line
    assert line.endswith("the memory plan is made from each node's GPU and the pairs' lengths"), line


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank 1 alone", "every rank"])
def test_pairs_holding_a_token_past_the_embedding_are_one_line_every_rank_ends_on(tmp_path, tiny_model_dir, who):
    """Pairs whose text holds an added token past the model's embedding rows (`positions.check_data_tokens`) were
    refused on each rank on its own, after the forward stage's gather: met by every rank, the line twice in a 2-process
    launch's log; met by rank 1 alone (its node's own copy of the pairs), rank 1 raised alone and rank 0 went on to its
    next collective (a reviewer's finding). Now one gather: the line once, every rank ending on it."""

    from dpotrain.data import builtin

    model, _ = model_with_a_token_past_its_embedding(tmp_path, tiny_model_dir, "<|extra|>")
    pairs = builtin.make_preference_rows(8, seed=3)  # as launch_with_main_limited writes them
    pairs[5]["chosen"][-1]["content"] += " <|extra|>"
    held = tmp_path / "node1" / "pairs.jsonl"
    held.parent.mkdir()
    held.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    ours = str(tmp_path / "pairs.jsonl")
    more, paths = ([], {ours: str(held)}) if who == "rank 1 alone" else (["--dataset_name", str(held)], {})
    result, _ = launch_with_main_limited(tmp_path, str(model), 1 << 30, *more, rank1_paths=paths)
    _one_line_every_rank_ends_on(result, "1 of 8 pairs of the train split hold '<|extra|>'")

"""The push path end to end: train_dpo.py and scripts/push_to_hub.py against a recording stand-in for the Hub.

huggingface_hub is pointed at tests/hub_server.py with HF_ENDPOINT and runs for real (its HTTP client, retries,
preupload and NDJSON commits); W&B runs offline. Each run is a few steps of the tiny model.

- Online, without push_checkpoints: one upload, to main, after training; none by the Trainer (no repo created at
  init, no "Training in progress" commits); a token given as --hub_token is used, and found in no file and no log.
- Online, with push_checkpoints: one branch step-<N> per complete checkpoint holding only model, config and
  tokenizer; a checkpoint deleted by save_total_limit while its upload runs still arrives whole; a branch whose
  commit keeps failing (500) is a warning and a record, the run finishes; a transient error is retried.
- Offline: nothing is attempted, the run finishes and prints the push command; push_to_hub.py --checkpoints then
  pushes the branches and main, and a second run of it skips what is there. A run stopped for requeue gets its
  checkpoint pushed (main waits for the finished model), resumes, and the same command pushes the rest.
"""

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from conftest import PAUSE_AT, ROOT, failing_stat, in_child, pause_env, python, run_train, signal_paused
from dpotrain import output_folder
from dpotrain.hub.hub_push import PUSH_RECORD, push_command, read_pushes, unconfirmed_push
from hub_server import StandInHub

SMOKE = str(ROOT / "configs" / "smoke.yaml")
# a script run as a user runs it, in the project, its output in .stdout
TEXT = {"cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "timeout": 300}
SECRET = "hf_SECRETsecret123"
REPO = "me/dpo-test"
MODEL_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture
def hub():
    server = StandInHub()
    yield server
    server.close()


def env_for(hub, tmp_path, offline=False, **extra) -> dict:
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "HF_TOKEN": "",  # the token comes from --hub_token only
        "HF_HOME": str(tmp_path / "hf_home"),  # no cached login
        "WANDB_MODE": "offline",
        "DPOTRAIN_HUB_RETRY_WAITS": "0",  # one retry, at once
        **extra,
    }


def push_checkpoints(out, hub, tmp_path):
    """`python scripts/push_to_hub.py OUT --checkpoints` against the stand-in Hub, the token from the environment."""
    return subprocess.run(
        [python(), str(ROOT / "scripts" / "push_to_hub.py"), str(out), "--checkpoints"],
        cwd=tmp_path,
        env={**os.environ, **env_for(hub, tmp_path, HF_TOKEN=SECRET)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def hub_in_process(hub, monkeypatch) -> None:
    """This process's huggingface_hub pointed at the stand-in Hub, online, with no wait between retries."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")


def push_script(hub, monkeypatch):
    """scripts/push_to_hub.py loaded in this process, its Hub the stand-in (`hub_in_process`), the token in HF_TOKEN."""
    import importlib.util

    monkeypatch.setenv("HF_TOKEN", SECRET)
    hub_in_process(hub, monkeypatch)
    spec = importlib.util.spec_from_file_location("push_to_hub", ROOT / "scripts" / "push_to_hub.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def train(hub, tmp_path, model_dir, *args, offline=False):
    out = tmp_path / "run"
    common = ["--config", SMOKE, "--model_name_or_path", model_dir, "--output_dir", str(out), "--max_steps", "4"]
    push = ["--push_to_hub", "true", "--hub_model_id", REPO, "--hub_token", SECRET]
    result = run_train([*common, *push, *args], env=env_for(hub, tmp_path, offline), timeout=300)
    return out, result


def requests(hub) -> list[dict]:
    return hub.state.project_requests()


def assert_secret_nowhere(out: Path, result) -> None:
    """Not in any file of the run folder (model, checkpoints, training_args.bin pickles, W&B files), nor in the log."""
    assert list(out.rglob("training_args.bin")), "no training_args.bin: nothing to check"
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "no W&B run file: nothing to check"
    leaked = [str(p) for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert SECRET not in result.stdout


def tensor_names(path: Path | bytes) -> list[str]:
    if isinstance(path, bytes):
        from safetensors.torch import load

        return sorted(load(path))
    with safe_open(str(path), "pt") as f:
        return sorted(f.keys())


@pytest.mark.slow
def test_online_run_pushes_once_to_main_after_training_and_never_saves_the_token(hub, tmp_path, tiny_model_dir):
    """The run samples too (one run for both claims: sampling asks nothing of the Hub). samples.jsonl holds the
    training data's first prompts verbatim (the recipes sample them every 50 steps where no sample_prompts are given)
    and the model's answers; the final push uploaded it to main, a repo often public, where the docs name the model,
    tokenizer, card and curves: a private data set's rows were published in silence. It stays in the run's folder (and
    W&B's table), as the run's other local records do."""
    samples = ["--samples_every", "2", "--sample_max_new_tokens", "4"]
    out, result = train(hub, tmp_path, tiny_model_dir, "--save_steps", "2", "--report_to", "wandb", *samples)
    assert result.returncode == 0, result.stdout[-3000:]

    kinds = [r["kind"] for r in requests(hub)]
    # At start: the token's user, the write check, (no repo found) whether the repo exists, and the new repo created
    # (the Hub says now whether this token may). Then the push, once the run is complete: main's files listed (an
    # earlier model's are replaced), the commit.
    assert kinds == [
        "whoami",
        "auth_check",
        "model_info",
        "create_repo",
        "create_repo",
        "tree",
        "validate_yaml",
        "preupload",
        "commit",
    ], kinds
    assert all(r["auth"] == f"Bearer {SECRET}" for r in requests(hub))  # the command line's token is the one used
    # Created by this project at start (before any model weight loads), and again (it exists: left as it is) by the
    # push after the run is complete; never by the Trainer.
    at_start, at_push = hub.state.of("create_repo")
    assert at_start["time"] < (out / "run_complete.json").stat().st_mtime <= at_push["time"]
    [commit] = hub.state.commits
    assert (commit["revision"], commit["message"]) == ("main", "Upload DPO run")
    assert MODEL_FILES | {"README.md", "training_curves.png", "metrics.jsonl"} <= set(commit["files"])
    unwanted = ("checkpoint-", "wandb/", ".hub_staging/", "training_args.bin", "hub_pushes.jsonl", ".wandb_run_id")
    assert not [f for f in commit["files"] if f.startswith(unwanted)]
    assert "Checkpoint revisions" not in commit["files"]["README.md"].decode()
    assert [r["status"] for r in read_pushes(out)] == ["started", "pushed"]
    # the sampled prompts stay off the Hub, in samples.jsonl and in any other file pushed
    prompt = json.loads((out / "samples.jsonl").read_text().splitlines()[0])["prompt"]
    assert "samples.jsonl" not in commit["files"]
    assert not [name for name, content in commit["files"].items() if prompt.encode() in content]

    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["push_to_hub"] is True and resolved["hub_strategy"] == "end" and resolved["hub_model_id"] == REPO
    args = torch.load(out / "checkpoint-4" / "training_args.bin", weights_only=False)
    assert args.push_to_hub is False and args.hub_token is None  # the Trainer never pushes, never holds the token
    assert_secret_nowhere(out, result)


@pytest.mark.slow
def test_checkpoints_go_to_branches_and_a_failing_one_does_not_fail_the_run(hub, tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    rotated = {}

    def until_checkpoint_1_is_rotated():  # hold step-1's upload until save_total_limit has deleted its folder
        deadline = time.time() + 120
        while (out / "checkpoint-1").exists() and time.time() < deadline:
            time.sleep(0.1)
        rotated["checkpoint-1"] = not (out / "checkpoint-1").exists()

    hub.state.hold[("preupload", "step-1")] = until_checkpoint_1_is_rotated
    hub.state.fail[("commit", "step-2")] = -1  # the Hub keeps failing this commit
    hub.state.fail[("create_branch", "step-3")] = 1  # a transient error: retried
    out, result = train(
        hub, tmp_path, tiny_model_dir, "--push_checkpoints", "true", "--save_steps", "1", "--save_total_limit", "1"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert rotated == {"checkpoint-1": True}

    commits = [(c["revision"], c["message"]) for c in hub.state.commits]
    assert commits == [
        ("step-1", "Checkpoint at step 1"),
        ("step-3", "Checkpoint at step 3"),
        ("step-4", "Checkpoint at step 4"),
        ("main", "Upload DPO run"),
    ]
    branches = {c["revision"]: c for c in hub.state.commits}
    for name in ("step-1", "step-3", "step-4"):  # the model only: no optimizer, scheduler, RNG, training_args.bin
        assert set(branches[name]["files"]) == MODEL_FILES, branches[name]["files"].keys()
        assert set(hub.state.repos[REPO][name]) == MODEL_FILES | {".gitattributes"}
    # The rotated checkpoint arrived whole: the model's tensors, and other weights than the last step's.
    step1, step4 = branches["step-1"]["files"]["model.safetensors"], branches["step-4"]["files"]["model.safetensors"]
    assert tensor_names(step1) == tensor_names(out / "model.safetensors")
    assert step1 != step4 and step4 == (out / "model.safetensors").read_bytes()

    assert len(hub.state.of("create_repo")) == 3  # at start, the checkpoint pusher, the final push; never the Trainer
    assert not [c for c in hub.state.commits if "Training in progress" in c["message"] or "save" in c["message"]]

    records = {r["branch"]: r for r in read_pushes(out)}
    assert records["step-2"]["status"] == "failed" and records["step-2"]["attempts"] == 2
    assert "500" in records["step-2"]["error"]
    assert (records["step-3"]["status"], records["step-3"]["attempts"]) == ("pushed", 2)
    assert records["step-1"]["status"] == records["step-4"]["status"] == records["main"]["status"] == "pushed"
    assert f"warning: checkpoint-2 was not pushed to {REPO}@step-2" in result.stdout
    assert "retrying in 0 s" in result.stdout

    card = branches["main"]["files"]["README.md"].decode()
    assert "## Checkpoint revisions" in card
    assert "| 1 | [`step-1`]" in card and "| 3 | [`step-3`]" in card and "| 4 | [`step-4`]" in card
    assert "step-2" not in card
    # step 2's staged copy, its last since rotation deleted checkpoint-2, is kept for push_to_hub.py --checkpoints
    assert [p.name for p in (out / ".hub_staging").iterdir()] == ["checkpoint-2"]


@pytest.mark.slow  # two training runs
def test_a_resumed_run_stopped_before_its_first_step_waits_for_the_pushes_it_queued(hub, tmp_path, tiny_model_dir):
    """A resumed run queues the checkpoints a stopped job left unpushed as training begins (`on_train_begin`); a stop
    asked then ends it before its first step (StoppedBeforeTraining). It exited at once, the upload thread killed with
    the process: its checkpoint neither pushed nor recorded as unfinished, its staged links left. It now waits for the
    uploads (STOP_WAIT_S) as a stop at a step's end does."""
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "4"]
    args += ["--logging_steps", "1", "--save_steps", "1000", "--report_to", "none"]
    args += ["--push_to_hub", "true", "--hub_model_id", REPO, "--push_checkpoints", "true"]

    def paused_run(env: dict, at: str, event: str = "open") -> str:
        paused = tmp_path / "paused"
        paused.unlink(missing_ok=True)
        env = {**os.environ, **env, **pause_env("", at, paused), "DPOTRAIN_TEST_PAUSE_AT_EVENT": event}
        proc = subprocess.Popen(
            [python(), str(PAUSE_AT), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        log = signal_paused(paused, proc, signal.SIGTERM)
        assert proc.returncode == 75, log[-3000:]
        return log

    # offline (nothing pushed), SIGTERM as the first step is logged: stopped with that step's checkpoint
    log = paused_run(env_for(hub, tmp_path, offline=True, HF_TOKEN=SECRET), "*/metrics.jsonl")
    [step] = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")]
    assert step < 4 and not read_pushes(out), log[-3000:]

    # online, resumed: stopped (SIGTERM) as checkpoint-N is staged for its push, inside `trainer.train`'s set-up; the
    # Hub takes its time over the commit, which a process that does not wait never sees answered
    hub.state.hold[("commit", f"step-{step}")] = lambda: time.sleep(2)
    log = paused_run(env_for(hub, tmp_path, HF_TOKEN=SECRET), f"*/checkpoint-{step}/*", "os.link")
    assert f"Stop requested: stopped before step {step + 1}" in log, log[-3000:]
    assert [(r["branch"], r["status"]) for r in read_pushes(out)] == [(f"step-{step}", "pushed")], log[-3000:]
    assert [c["revision"] for c in hub.state.commits] == [f"step-{step}"]
    assert not (out / ".hub_staging").exists()


@pytest.mark.slow  # a training run, W&B, and push_to_hub.py twice
def test_offline_run_finishes_and_push_to_hub_pushes_it_later(hub, tmp_path, tiny_model_dir):
    out, result = train(
        hub,
        tmp_path,
        tiny_model_dir,
        "--push_checkpoints",
        "true",
        "--save_steps",
        "2",
        "--report_to",
        "wandb",
        offline=True,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert hub.state.requests == []  # nothing attempted
    assert (
        f"HF_HUB_OFFLINE is set, so nothing was pushed: push (the last 2 checkpoints, those still on disk) from a "
        f"machine that reaches the Hub with `python scripts/push_to_hub.py {out} --repo-id {REPO} --checkpoints`"
    ) in result.stdout
    assert_secret_nowhere(out, result)
    assert not (out / PUSH_RECORD).exists()

    pushed = push_checkpoints(out, hub, tmp_path)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert [(c["revision"], c["message"]) for c in hub.state.commits] == [
        ("step-2", "Checkpoint at step 2"),
        ("step-4", "Checkpoint at step 4"),
        ("main", "Upload DPO run"),
    ]
    assert set(hub.state.repos[REPO]["step-2"]) == MODEL_FILES | {".gitattributes"}
    card = hub.state.repos[REPO]["main"]["README.md"].decode()
    assert "| 2 | [`step-2`]" in card and "| 4 | [`step-4`]" in card
    assert SECRET not in pushed.stdout + pushed.stderr

    again = push_checkpoints(out, hub, tmp_path)  # everything is there: nothing is uploaded twice
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(hub.state.commits) == 3
    assert f"Skipped checkpoint-2: {REPO}@step-2 already holds it" in again.stdout
    assert f"Skipped main: {REPO} already holds this run" in again.stdout


@pytest.mark.slow  # a training run stopped, push_to_hub.py, the run resumed, push_to_hub.py again
def test_a_stopped_offline_run_pushes_its_checkpoint_then_goes_on_and_pushes_the_rest(hub, tmp_path, tiny_model_dir):
    """A run stopped for requeue (exit 75) on nodes without network: push_to_hub.py --checkpoints refused it as "not a
    finished run". It pushes the stop's checkpoint to its branch and leaves main; the run resumes from that checkpoint
    (the push record in its folder is its own); once it has finished, the same command skips that branch and pushes
    the rest and main."""
    out, stop = tmp_path / "run", tmp_path / "stop"
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "8"]
    args += ["--logging_steps", "1", "--save_steps", "1000", "--report_to", "none"]
    args += ["--push_to_hub", "true", "--hub_model_id", REPO]
    env = {**os.environ, **env_for(hub, tmp_path, offline=True, HF_TOKEN=SECRET, DPOTRAIN_STOP_FILE=str(stop))}
    job = subprocess.Popen(
        [python(), str(ROOT / "train_dpo.py"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.time() < deadline, job.stdout.read()[-3000:]
        time.sleep(0.2)
    stop.touch()
    log = job.communicate(timeout=300)[0]
    assert job.returncode == 75, log[-3000:]
    [stopped_at] = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")]

    pushed = push_checkpoints(out, hub, tmp_path)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert f"{out} has not finished training (no run_complete.json): only its checkpoints are pushed" in pushed.stdout
    assert sorted(hub.state.repos[REPO]) == ["main", f"step-{stopped_at}"]
    assert set(hub.state.repos[REPO][f"step-{stopped_at}"]) == MODEL_FILES | {".gitattributes"}
    assert set(hub.state.repos[REPO]["main"]) == {".gitattributes"}

    stop.unlink()
    resumed = run_train(args, env=env_for(hub, tmp_path, offline=True, HF_TOKEN=SECRET), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-{stopped_at}" in resumed.stdout
    again = push_checkpoints(out, hub, tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Skipped checkpoint-{stopped_at}: {REPO}@step-{stopped_at} already holds it" in again.stdout
    assert [c["revision"] for c in hub.state.commits] == [f"step-{stopped_at}", "step-8", "main"]


@pytest.mark.slow
def test_a_run_killed_before_or_during_its_final_push_completes_it_when_run_again(hub, tmp_path, tiny_model_dir):
    """Issue #53: killed while the final push ran, the rerun said the run was finished and never pushed. The push's
    start and its confirmation are recorded in hub_pushes.jsonl: the same command again completes the push, and trains
    nothing. run_complete.json is written before the final push starts: a job killed between the two (Slurm's SIGKILL
    after a time limit's SIGTERM, a node lost) left a finished run whose push was never recorded as started, and the
    same command again refused it as "already holds a finished run" without a word of the push it asked for (a requeue
    of the same Slurm job: "nothing to do", exit 0, and never pushed). The push is recorded as due before the run is
    marked complete. One run for both: SIGKILLed right after run_complete.json is in place; its rerun pushes, and the
    stand-in Hub holds that rerun's commit to main, as a stalled upload, where it is SIGKILLed too; the next completes
    the push."""
    import threading

    from dpotrain.cluster import run_lock
    from dpotrain.recipe.writes import pid_alive

    stalled, release = threading.Event(), threading.Event()

    def stall():  # the first commit to main hangs until the job is dead; the next rerun's goes through
        if not stalled.is_set():
            stalled.set()
            release.wait(600)

    out = tmp_path / "run"
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "2"]
    args += ["--save_strategy", "no", "--report_to", "none", "--push_to_hub", "true", "--hub_model_id", REPO]
    args += ["--hub_token", SECRET]
    paused = tmp_path / "paused"
    env = {**os.environ, **env_for(hub, tmp_path), **pause_env("*/run_complete.json", "*", paused)}
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    signal_paused(paused, proc, signal.SIGKILL)  # right after run_complete.json is in place
    assert (out / "run_complete.json").is_file() and hub.state.commits == []

    hub.state.hold[("commit", "main")] = stall
    log = tmp_path / "killed.log"
    try:
        with open(log, "w") as sink:
            killed = subprocess.Popen(
                [python(), str(ROOT / "train_dpo.py"), *args],
                env={**os.environ, **env_for(hub, tmp_path)},
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            while not stalled.wait(0.1):  # its push reached the commit to main: it did not refuse the folder
                assert killed.poll() is None, log.read_text()[-3000:]
            killed.send_signal(signal.SIGKILL)
        finally:
            killed.kill()
            killed.wait()
        assert "Data (train)" not in log.read_text(), log.read_text()[-3000:]  # it pushed, training nothing
        # The run is the warm interpreter's child, which kills itself once its client (`killed`) is gone: the rerun
        # takes the lock it left once that process is gone, as it would a fresh interpreter's
        holder = json.loads((out / run_lock.LOCK_FILE).read_text())["pid"]
        deadline = time.monotonic() + 60
        while pid_alive(holder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / "run_complete.json").is_file() and hub.state.commits == []

        rerun = run_train(args, env=env_for(hub, tmp_path), timeout=300)
        assert rerun.returncode == 0, rerun.stdout[-3000:]
        assert (
            f"output_dir {out}: a finished run whose push to {REPO} was started and not confirmed (the job was "
            "killed while pushing): pushing it now; nothing is trained"
        ) in rerun.stdout, rerun.stdout[-3000:]
        assert f"Pushed to {hub.endpoint}/{REPO}" in rerun.stdout and "Data (train)" not in rerun.stdout
        [commit] = hub.state.commits
        assert commit["revision"] == "main" and MODEL_FILES | {"README.md", "run_complete.json"} <= set(commit["files"])
        # Each attempt's start, then its confirmation: the first job's, recorded before run_complete.json, and the
        # killed rerun's were started and never confirmed.
        assert [(r["branch"], r["status"]) for r in read_pushes(out)] == [
            ("main", "started"),
            ("main", "started"),
            ("main", "started"),
            ("main", "pushed"),
        ]
        again = run_train(args, env=env_for(hub, tmp_path), timeout=300)  # pushed and confirmed: finished
        assert again.returncode == 2 and "already holds a finished run" in again.stdout, again.stdout[-3000:]
        assert len(hub.state.commits) == 1
    finally:
        release.set()


@pytest.mark.slow
def test_a_run_pushed_only_by_the_script_owns_its_record_of_pushes(hub, tmp_path, tiny_model_dir):
    """A run trained without pushing, pushed later by scripts/push_to_hub.py: the record the script writes is the
    run's, so replacing the run replaces it too (kept as a user's file, the next run's pushes would join the old
    run's in it, and its model card would list the old revisions)."""
    out = tmp_path / "run"
    args = [
        "--config",
        SMOKE,
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
    ]
    # Trained and replaced offline without a push, so neither needs the stand-in Hub's environment: the suite's warm
    # interpreter runs them (a fresh one each, ~10 s of imports on 2 cores, only for the push script).
    trained = run_train(args, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:]
    assert PUSH_RECORD not in output_folder.read_manifest(out)
    pushed = subprocess.run(
        [python(), str(ROOT / "scripts" / "push_to_hub.py"), str(out), "--repo-id", REPO],
        cwd=tmp_path,
        env={**os.environ, **env_for(hub, tmp_path, HF_TOKEN=SECRET)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pushed.returncode == 0 and (out / PUSH_RECORD).is_file(), pushed.stdout + pushed.stderr
    assert PUSH_RECORD in output_folder.read_manifest(out)
    replaced = run_train([*args, "--overwrite_output_dir", "true"])
    assert replaced.returncode == 0, replaced.stdout[-3000:]
    assert not (out / PUSH_RECORD).exists()


# --- what is refused, before anything loads ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, refusal",
    [
        (["--hub_strategy", "checkpoint"], "hub_strategy 'checkpoint' is transformers' push at every save"),
        (["--hub_strategy", "all_checkpoints"], "push_checkpoints: true pushes each checkpoint's model to a branch"),
        # typed, transformers' default asks for a push at every save: accepted and recorded as "end", none was made
        (["--hub_strategy", "every_save"], "hub_strategy 'every_save' is transformers' push at every save"),
        (["--hub_revision", "dev"], "hub_revision 'dev' is not supported: the final model goes to main"),
        (["--save_strategy", "no", "--push_checkpoints", "true"], "save_strategy is 'no', so no checkpoint is saved"),
        # transformers' "skip a push while the last is going", recorded as asked and never done: every one is pushed
        (["--push_checkpoints", "true", "--hub_always_push", "false"], "hub_always_push false would skip a check"),
    ],
)
def test_pushes_the_project_cannot_make_are_refused(args, refusal):
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    recipe = parse_args(["--config", SMOKE, "--push_to_hub", "true", "--hub_model_id", REPO, *args])
    with pytest.raises(ConfigError, match=refusal):
        hub.take_push_settings(recipe)


def test_checkpoint_pushes_are_recorded_as_never_skipped():
    """resolved_config.json said transformers' default `hub_always_push: false` (skip a checkpoint's push while the
    one before is uploading) for a run that pushes every checkpoint in turn: it says what the run does now."""
    from dpotrain.hub import hub

    assert hub.PushSettings(True, REPO, None, True).record({"hub_always_push": False})["hub_always_push"] is True


def test_a_run_name_with_a_slash_is_no_repo_to_push_to_without_hub_model_id(tmp_path):
    """`--run_name org/think` with push_to_hub and no hub_model_id pushed into the namespace org, a repo no one
    named: the run name names a repo in the token user's namespace, and a place is said by hub_model_id."""
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    argv = ["--config", SMOKE, "--push_to_hub", "true", "--run_name", "org/think", "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError) as refused:
        hub.take_push_settings(parse_args(argv))
    assert str(refused.value) == (
        "push_to_hub without hub_model_id pushes to a repo named after the run: 'org/think', which would push into "
        "the namespace 'org': say where to push (--hub_model_id org/think), or name the run without '/'"
    )
    assert hub.take_push_settings(parse_args([*argv, "--hub_model_id", "org/think"])).repo_id == "org/think"


@pytest.mark.parametrize(
    "args, given",
    [
        (["--hub_model_id", "org/name@main"], "hub_model_id 'org/name@main'"),
        (["--hub_model_id", "my org/name"], "hub_model_id 'my org/name'"),
        (["--hub_model_id", "org/team/name"], "hub_model_id 'org/team/name'"),
        (["--hub_model_id", "org/" + "n" * 97], f"hub_model_id 'org/{'n' * 97}'"),
        (["--hub_model_id", ""], "hub_model_id ''"),  # was taken for unset: pushed to the run name's repo
        # the run name, said as the repo's name ("pushes to the run name 'my run' is not a ..." read as one garbled
        # clause)
        (
            ["--output_dir", "outputs/my run"],
            "push_to_hub without hub_model_id pushes to a repo named after the run: 'my run'",
        ),
        (
            ["--run_name", "über-dpo"],
            "push_to_hub without hub_model_id pushes to a repo named after the run: 'über-dpo'",
        ),
    ],
)
def test_a_repo_name_the_hub_refuses_is_refused_before_anything_runs(args, given):
    """It was met at the write-access check, said as a Hub that could not be reached ('set HF_HUB_OFFLINE=1 and push
    afterwards': a run that trained in full, then failed at push_to_hub.py), and a dry run said nothing."""
    import train_dpo
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    argv = ["--config", SMOKE, "--push_to_hub", "true", *args]
    with pytest.raises(ConfigError) as refused:
        hub.take_push_settings(parse_args(argv))
    assert str(refused.value).startswith(f"{given} is not a Hugging Face repo name (`name` or `namespace/name`")
    assert str(refused.value).endswith(": pass --hub_model_id org/name")
    with pytest.raises(ConfigError, match="is not a Hugging Face repo name"):
        train_dpo.main([*argv, "--dry-run"])
    for repo in ("org/name", "name", "Org-1/my_run.v2"):  # a bare name goes to the token user's namespace
        assert hub.take_push_settings(parse_args([*argv, "--hub_model_id", repo])).repo_id == repo
    assert not hub.take_push_settings(parse_args(["--config", SMOKE, *args])).requested  # no push, no refusal


@pytest.mark.parametrize("value", ["15s,60s", "one", "-5", "nan", "inf"])
def test_retry_waits_that_are_not_seconds_are_refused_before_training(monkeypatch, value):
    """They were read at the first upload, after training: each checkpoint's upload and the final push failed
    (ValueError: could not convert string to float), and push_to_hub.py ended in a traceback."""
    from dpotrain.hub import hub
    from dpotrain.hub.hub_push import with_retries
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    recipe = parse_args(["--config", SMOKE, "--push_to_hub", "true", "--hub_model_id", REPO])
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", value)
    with pytest.raises(ConfigError, match=rf"^DPOTRAIN_HUB_RETRY_WAITS='{value}' is not a list of seconds between"):
        hub.take_push_settings(recipe)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", " 0, 1.5 ")
    assert hub.take_push_settings(recipe).requested and with_retries(lambda: "done", "x") == ("done", 1)


def test_push_checkpoints_needs_push_to_hub(tmp_path):
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    with pytest.raises(ConfigError, match="push_checkpoints needs push_to_hub: true"):
        hub.take_push_settings(parse_args(["--config", SMOKE, "--push_checkpoints", "true"]))
    # a recipe that pushes, run once with --push_to_hub false: the recipe's push_checkpoints is turned off by a flag,
    # which the refusal names ("or drop it" said not how, for a line of the recipe)
    recipe = tmp_path / "pushes.yaml"
    recipe.write_text(Path(SMOKE).read_text() + "push_to_hub: true\nhub_model_id: org/x\npush_checkpoints: true\n")
    with pytest.raises(ConfigError, match=r"or drop it \(--push_checkpoints false\)$"):
        hub.take_push_settings(parse_args(["--config", str(recipe), "--push_to_hub", "false"]))
    off = parse_args(["--config", str(recipe), "--push_to_hub", "false", "--push_checkpoints", "false"])
    assert not hub.take_push_settings(off).requested


def test_checkpoint_pushes_under_fsdp2_are_refused_by_the_run_and_by_its_dry_run(monkeypatch):
    """FSDP2's checkpoints are each rank's shard (torch.distributed.checkpoint): a branch would get no model."""
    import train_dpo
    from dpotrain.cluster import engine
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    args = ["--config", SMOKE, "--push_to_hub", "true", "--hub_model_id", REPO, "--push_checkpoints", "true"]
    refusal = "push_checkpoints under FSDP2: its checkpoints are sharded"
    with pytest.raises(ConfigError, match=refusal):
        train_dpo.main([*args, "--accelerate_config", "configs/accelerate/fsdp2.yaml", "--dry-run"])
    launch = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}
    for name, value in launch.items():  # what `accelerate launch` sets for fsdp2.yaml
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=refusal):
        hub.take_push_settings(parse_args(args), engine.launched())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert hub.take_push_settings(parse_args(args), engine.launched()).checkpoints  # ZeRO-2 etc. push them


def test_the_trainer_gets_no_push_and_no_token(monkeypatch):
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.trainer import training_arguments

    argv = ["train_dpo.py", "--config", SMOKE, "--push_to_hub", "--hub_token", SECRET, f"--hub_token={SECRET}"]
    monkeypatch.setattr("sys.argv", argv)
    recipe = parse_args(argv[1:])
    push = hub.take_push_settings(recipe)
    assert (push.requested, push.token, push.repo_id, push.checkpoints) == (True, SECRET, "smoke-dpo", False)
    trainer_args = training_arguments(recipe)  # what TRL and transformers see: the one place their fields are set
    assert trainer_args.push_to_hub is False and trainer_args.hub_token is None
    assert recipe.training.push_to_hub is True  # the recipe keeps the user's intent
    assert argv[-3:] == ["--hub_token", "<HUB_TOKEN>", "--hub_token=<HUB_TOKEN>"]  # what W&B records
    assert SECRET not in repr(push)


@pytest.mark.parametrize("given", ["--hub_token", "HF_TOKEN"])
def test_a_token_read_with_its_line_break_is_used_without_it_and_a_token_that_cannot_be_sent_is_never_printed(
    given, hub, monkeypatch, capfd
):
    """A wrapper that hands the token file read whole (`Path("~/.hf_token").read_text()`, its newline kept): the
    write-access check failed on the HTTP client's `Illegal header value b'Bearer hf_...\\n'`, printed in one line
    ("could not reach the Hugging Face Hub ... (LocalProtocolError: ...)"), the token in the job's log. The token is
    now read as huggingface_hub reads HF_TOKEN (line breaks and the white space around it dropped); one that still
    cannot be sent (two tokens pasted with a space, a control character) is refused naming where it came from, never
    its value."""
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    hub_in_process(hub, monkeypatch)
    monkeypatch.setattr("sys.argv", ["train_dpo.py"])
    args = ["--config", SMOKE, "--push_to_hub", "true", "--hub_model_id", REPO]

    def settings(token: str):
        monkeypatch.setenv("HF_TOKEN", token if given == "HF_TOKEN" else "")
        return hub_module.take_push_settings(parse_args(args + ([given, token] if given != "HF_TOKEN" else [])))

    push = settings(f"{SECRET}\r\n")
    assert push.token == SECRET and hub_module.check_write_access(REPO, push.token) == REPO
    for unsendable in (f"{SECRET} hf_another", f"{SECRET}\x7fhf_another"):
        with pytest.raises(ConfigError) as refused:
            hub_module.check_write_access(REPO, settings(unsendable).token)
        assert given in str(refused.value) and SECRET not in str(refused.value)
    assert SECRET not in "".join(capfd.readouterr())


@pytest.mark.parametrize("inside", ["\x0b", "\u200b"])
def test_a_saved_login_token_that_cannot_be_sent_is_refused_naming_its_file_never_printed(
    inside, hub, monkeypatch, tmp_path, capfd
):
    """A token file written by hand (`echo ... > ~/.cache/huggingface/token`, a zero-width space pasted with the token)
    was not checked as HF_TOKEN is: a vertical tab went into the log in the HTTP client's `Illegal header value
    b'Bearer hf_...'`, and a letter that is not ASCII read as "could not reach the Hugging Face Hub ... set
    HF_HUB_OFFLINE=1", the job then training for hours to fail the push the same way. Both are refused, by the job and
    push_to_hub.py, naming the file, never the token."""
    from huggingface_hub import constants

    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    saved = tmp_path / "token"
    saved.write_text(f"{SECRET}{inside}x\n", encoding="utf-8")
    script = push_script(hub, monkeypatch)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    monkeypatch.setattr("sys.argv", ["train_dpo.py"])
    with pytest.raises(ConfigError) as job:
        hub_module.take_push_settings(parse_args(["--config", SMOKE, "--push_to_hub", "true", "--hub_model_id", REPO]))
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps({"hub_model_id": REPO}))
    (run / "run_complete.json").write_text('{"global_step": 1}\n')
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors", "README.md"):
        (run / name).write_text("{}")
    (run / "training_curves.png").write_bytes(b"png")
    with pytest.raises(ConfigError) as later:
        script.main([str(run)])
    for refused in (job, later):
        assert str(refused.value).startswith(f"the token saved in {saved} (by `hf auth login`, or written there) holds")
    assert SECRET not in str(job.value) + str(later.value) + "".join(capfd.readouterr())
    assert not hub.state.commits and not hub.state.project_requests()


# --- the pusher on its own: which checkpoints it takes ---------------------------------------------------------------


def test_pusher_takes_only_marked_checkpoints_and_a_resumed_run_pushes_what_is_left(hub, tmp_path, monkeypatch):
    """A requeued job resumes with complete checkpoints on disk: those not recorded as pushed go first; a checkpoint
    without its COMPLETE mark (a save cut short) never goes."""
    from transformers import TrainerState

    from dpotrain.hub.hub_push import CheckpointPusher, record_push
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.checkpoints import MARKER
    from dpotrain.train.resume import REFERENCE_FILE

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    for step, marked in [(2, True), (4, True), (6, False)]:
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        # reference_model.safetensors: TR-DPO's moved reference, for a resume; not the step's model
        for name in ("model.safetensors", "config.json", "optimizer.pt", "training_args.bin", REFERENCE_FILE):
            (folder / name).write_bytes(f"{name} {step}".encode())
        if marked:  # the model's save wrote two of them
            checkpoint_manifest.seal(folder, MARKER, "{}", is_main=True, model=["model.safetensors", "config.json"])
    record_push(out, step=4, branch="step-4", status="pushed")

    pusher = CheckpointPusher(REPO, SECRET, None, out)
    state = TrainerState(global_step=6)
    pusher.on_train_begin(None, state, None)
    pusher.on_save(None, state, None)  # checkpoint-6 has no mark: not taken
    assert pusher.finish(60) == []
    assert [(c["revision"], sorted(c["files"])) for c in hub.state.commits] == [
        ("step-2", ["config.json", "model.safetensors"])
    ]
    assert hub.state.commits[0]["files"]["model.safetensors"] == b"model.safetensors 2"
    assert [r["branch"] for r in read_pushes(out) if r["status"] == "pushed"] == ["step-4", "step-2"]
    assert read_pushes(out)[-1]["repo"] == REPO  # the card of another repo must not list it (pushed_revisions)
    assert not (out / ".hub_staging").exists()


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_checkpoints_are_staged_through_no_link_and_into_no_persons_folder(hub, tmp_path, monkeypatch, capsys, kind):
    """A pushed checkpoint is staged in `.hub_staging/` (hard links that outlive rotation). A link there (which no run
    makes) was followed: the staged files linked, and an earlier attempt's removed, in the folder it points to; a
    person's folder of that name was emptied and removed at the end. Either is moved aside, said in a line, before the
    first checkpoint is staged: the run claims the name as it makes the folder."""
    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import STAGING, CheckpointPusher
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    sealed_checkpoint(out / "checkpoint-2")
    run_files.write(out, [run_files.MANIFEST, "checkpoint-2"])
    scratch = tmp_path / "scratch"  # the person's: linked in, or their own folder of that name
    theirs = scratch if kind == "link" else out / STAGING
    (theirs / "checkpoint-2").mkdir(parents=True)
    (theirs / "checkpoint-2" / "notes.md").write_text("mine\n")
    if kind == "link":
        (out / STAGING).symlink_to(scratch, target_is_directory=True)

    pusher = CheckpointPusher(REPO, SECRET, None, out)
    pusher.on_save(None, TrainerState(global_step=2, is_world_process_zero=True), None)
    assert pusher.finish(60) == []
    assert [c["revision"] for c in hub.state.commits] == ["step-2"]
    (aside,) = out.glob(f"{STAGING}.not-this-run-*")
    said = "a link, which no run makes" if kind == "link" else "not this run's"
    assert f"Moved {out / STAGING} to {aside}: {said}" in capsys.readouterr().out
    kept = scratch if kind == "link" else aside
    assert sorted(p.name for p in kept.rglob("*")) == ["checkpoint-2", "notes.md"]
    assert (kept / "checkpoint-2" / "notes.md").read_text() == "mine\n"
    assert not (out / STAGING).exists() and STAGING not in run_files.read(out)


def test_the_revisions_a_card_lists_are_those_of_the_repo_it_describes(tmp_path):
    """Checkpoint records named no repo: `push_to_hub.py --repo-id org/b --checkpoints` of a run whose job pushed to
    org/a listed org/a's steps (rotated away since) in org/b's card, as dead links, and a resumed run's pusher took
    them for pushed to its own repo. A record from before records named the repo counts for any."""
    from dpotrain.hub.hub_push import pushed_revisions, record_push

    out = tmp_path / "run"
    out.mkdir()
    record_push(out, step=1, branch="step-1", status="pushed")  # written before checkpoint records named their repo
    record_push(out, step=2, branch="step-2", status="pushed", repo="org/a")
    record_push(out, step=4, branch="step-4", status="pushed", repo="org/b")
    record_push(out, step=2, branch="step-2", status="failed", repo="org/b")
    assert pushed_revisions(out, "org/b") == [(1, "step-1"), (4, "step-4")]
    assert pushed_revisions(out, "org/a") == [(1, "step-1"), (2, "step-2")]


def test_a_finished_run_with_a_push_left_is_pushed_by_the_same_command_and_otherwise_said_how(tmp_path):
    """What the rerun decides from hub_pushes.jsonl (resolve.check_output_dir), the run and the dry run alike: a push
    started and not confirmed is completed where the command asks for a push, and named with the command that pushes
    it where it does not; a confirmed one leaves a finished run."""
    from dpotrain import resolve
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="step-2", status="pushed")  # a checkpoint's branch: not the final push
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    asked = parse_args(["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_model_id", REPO])
    plan = resolve.check_output_dir(asked, 8)
    assert plan == resolve.OutputDecision(None, False, push_left=REPO)
    assert plan.record(str(out))["output_folder"] == (
        f"{out}: a finished run whose push to {REPO} was started and not confirmed: the run pushes it, and trains "
        "nothing"
    )
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(parse_args(["--config", SMOKE, "--output_dir", str(out)]), 8)
    assert str(refused.value).endswith(
        f"; its push to {REPO} was started and not confirmed: rerun with --push_to_hub to complete it, or run "
        f"`python scripts/push_to_hub.py {out} --repo-id {REPO}`"
    )
    # A checkpoint upload given up with it (a stop request at the end of training): the command pushes it too
    record_push(out, step=4, branch="step-4", repo=REPO, status="unfinished", error="given up on a stop request")
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(parse_args(["--config", SMOKE, "--output_dir", str(out)]), 8)
    assert str(refused.value).endswith(f"`python scripts/push_to_hub.py {out} --repo-id {REPO} --checkpoints`")
    record_push(out, step=2, branch="main", status="pushed", repo=REPO)
    with pytest.raises(ConfigError, match="already holds a finished run: pass --output_dir for a new run, or "):
        resolve.check_output_dir(asked, 8)


def test_a_finished_runs_push_left_is_said_before_the_data_and_model_it_no_longer_reads(tmp_path):
    """A rerun without --push_to_hub of a finished run whose final push a kill cut short, its data file moved away
    since: refused as "dataset ... does not exist" (the model's folder alike), the push left and the finished run
    unsaid, where the advice needs neither. Said first, from the folder's records, as the push it completes is."""
    import train_dpo
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    gone = ["--dataset_name", str(tmp_path / "moved.jsonl"), "--model_name_or_path", str(tmp_path / "sft")]
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(["--config", SMOKE, *gone, "--output_dir", str(out)])
    assert str(refused.value) == (
        f"output_dir {str(out)!r} already holds a finished run: pass --output_dir for a new run, or "
        f"--overwrite_output_dir to replace it; its push to {REPO} was started and not confirmed: rerun with "
        f"--push_to_hub to complete it, or run `python scripts/push_to_hub.py {out} --repo-id {REPO}`"
    )


def test_a_push_asked_of_a_finished_run_never_pushed_names_the_command_that_pushes_it(tmp_path):
    """A run trained without --push_to_hub, and the same command run again with it to push the model: refused as
    "already holds a finished run: pass --output_dir for a new run, or --overwrite_output_dir to replace it", both of
    which train it again (the second deleting the model it meant to push) and neither a word of push_to_hub.py. The
    refusal names the command that pushes it, training nothing; and says so where the run is on that repo already."""
    from dpotrain import resolve
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text('{"global_step": 2}')
    common = ["--config", SMOKE, "--output_dir", str(out)]
    refusal = (
        f"output_dir '{out}' already holds a finished run: pass --output_dir for a new run, or --overwrite_output_dir "
        "to replace it"
    )
    for given in (REPO, "dpo-test"):  # the name as given: push_to_hub.py adds the token's namespace as the run does
        with pytest.raises(ConfigError) as refused:
            resolve.check_output_dir(parse_args([*common, "--push_to_hub", "true", "--hub_model_id", given]), 8)
        assert str(refused.value) == (
            f"{refusal}; to push it to {given}, training nothing, run `python scripts/push_to_hub.py {out} --repo-id "
            f"{given}`"
        )
    with pytest.raises(ConfigError) as refused:  # no push asked: the refusal as it was
        resolve.check_output_dir(parse_args(common), 8)
    assert str(refused.value) == refusal
    record_push(out, step=2, branch="main", status="pushed", repo=REPO)
    for given in (REPO, "dpo-test"):
        with pytest.raises(ConfigError) as refused:
            resolve.check_output_dir(parse_args([*common, "--push_to_hub", "true", "--hub_model_id", given]), 8)
        assert str(refused.value) == f"{refusal}; it is on {REPO} already ({out}/hub_pushes.jsonl)"


def test_a_push_left_is_not_completed_under_another_hub_model_id(tmp_path):
    """A rerun completing a cut-short push with another --hub_model_id pushed to the repo the push started on (as the
    docs say) and said nothing of the repo it was given, as if it were used. Refused, the run and the dry run alike,
    naming both repos and each way on; the same repo, or its name without the namespace the run added, completes it."""
    from dpotrain import resolve
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    common = ["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_model_id"]
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(parse_args([*common, "org/other"]), 8)
    assert str(refused.value) == (
        f"hub_model_id org/other: {out} holds a finished run whose push to {REPO} was started and not confirmed, "
        f"which a rerun completes there and nowhere else: drop --hub_model_id (or pass {REPO}) to complete it, or "
        f"push the run to org/other with `python scripts/push_to_hub.py {out} --repo-id org/other`"
    )
    for same in (REPO, "dpo-test"):  # as given to the run, which named it with the token's namespace
        assert resolve.check_output_dir(parse_args([*common, same]), 8).push_left == REPO


def test_a_push_left_is_completed_to_the_repo_it_started_on(hub, tmp_path, monkeypatch, tiny_model_dir, capfd):
    """The refusal of a rerun without a push says 'rerun with --push_to_hub to complete it', and the dry run 'the run
    pushes it' to the repo the push started on: a rerun with --push_to_hub and no --hub_model_id pushed the run to a
    repo named after the run (me/run) instead. The rerun trains nothing: a Ctrl-C while it pushes speaks of
    the push ('finishing the push to the Hub'), where it said 'stopping before training' and the push went on."""
    import shutil

    from dpotrain import publish, resolve
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.preemption import GracefulStop

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_token", SECRET])
    push = hub_module.take_push_settings(recipe)
    decision = resolve.check_output_dir(recipe, 8)
    assert (decision.push_left, push.repo_id) == (REPO, "run")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job (conftest restores it)
    stop = GracefulStop()
    stop.terminal.clear()  # this process's terminal, where pytest runs in one, stays as it is
    try:
        publish.complete_push(recipe, push, decision.push_left, stop)
        os.kill(os.getpid(), signal.SIGINT)  # as during the push: the rerun's stop is the push's throughout
        time.sleep(0.1)
    finally:
        stop.release(exiting=False)
    assert [commit["repo"] for commit in hub.state.commits] == [REPO] and "me/run" not in hub.state.repos
    assert [(r["status"], r["repo"]) for r in read_pushes(out)] == [("started", REPO)] * 2 + [("pushed", REPO)]
    said = capfd.readouterr().err
    assert "Ctrl-C: finishing the push to the Hub, then ending" in said and "before training" not in said, said


def test_a_ctrl_c_in_an_offline_rerun_left_a_push_speaks_of_no_push(tmp_path, monkeypatch, capfd):
    """An offline rerun of a finished run whose push was cut short trains nothing and pushes nothing (HF_HUB_OFFLINE:
    it names push_to_hub.py); a Ctrl-C there said 'finishing the push to the Hub', a push that never began."""

    from huggingface_hub import constants

    from dpotrain import publish
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.preemption import GracefulStop

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_token", SECRET])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job (conftest restores it)
    stop = GracefulStop()
    stop.terminal.clear()  # this process's terminal, where pytest runs in one, stays as it is
    try:
        push = hub_module.take_push_settings(recipe)
        assert publish.complete_push(recipe, push, REPO, stop) is None
        os.kill(os.getpid(), signal.SIGINT)  # as the rerun ends: its stop is still installed
    finally:
        stop.release(exiting=False)
    said = capfd.readouterr()
    assert "HF_HUB_OFFLINE is set, so nothing was pushed" in said.out, said.out
    assert "Ctrl-C: ending; nothing is trained or pushed here (HF_HUB_OFFLINE" in said.err, said.err
    assert "finishing the push" not in said.err and "before training" not in said.err, said.err
    assert [r["status"] for r in read_pushes(out)] == ["started"]


def test_a_stop_request_during_a_hung_final_push_ends_the_run_for_its_requeue(
    hub, tmp_path, monkeypatch, tiny_model_dir, capsys
):
    """The time limit's warning (the batch shell's stop file) or a preemption's SIGTERM while the final push hung: the
    run went on waiting for the Hub, said nothing to the batch script, and Slurm killed it at the end of KillWait (the
    time limit: a TIMEOUT job, not requeued). Now the push is recorded as not done, `.checkpointed` tells launch.sh to
    requeue, and the run ends with 75; the requeued job completes the push to that repo, training nothing."""
    import shutil
    import threading

    from dpotrain import publish
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.preemption import STOPPED_EXIT, GracefulStop

    hub_in_process(hub, monkeypatch)
    stalled, release = threading.Event(), threading.Event()
    hub.state.hold[("commit", "main")] = lambda: (
        stalled.set(),
        release.wait(60),
    )  # a commit that hangs (a fix undone: fails)
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)
    (out / "run_complete.json").write_text('{"global_step": 2}')
    stop_file = tmp_path / "stop"
    args = ["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_model_id", REPO]
    recipe = parse_args([*args, "--hub_token", SECRET])
    push = hub_module.take_push_settings(recipe)
    stop = GracefulStop(str(stop_file))
    try:
        preempt = lambda: stalled.wait(600) and os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731
        threading.Thread(target=preempt, daemon=True).start()  # as Slurm does, once the push hangs
        assert publish.push_final(out, push, recipe.training, stop) == STOPPED_EXIT
    finally:
        stop.release(exiting=False)
        release.set()
    assert [(r["status"], r["repo"]) for r in read_pushes(out)] == [("started", REPO), ("unfinished", REPO)]
    assert "final push to me/dpo-test" in Path(f"{stop_file}.checkpointed").read_text()
    # Its stop line: the time after the request is the stop's, not glued to "training nothing" ("... pushes it,
    # training nothing 0 s after the request")
    said = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Stop requested:"))
    assert re.search(r"training nothing\) \d+ s after the request; exiting so that the job can be requeued$", said), (
        said
    )
    assert unconfirmed_push(out)["status"] == "unfinished"  # the requeued job's decision (push_left): to this repo
    hub.state.hold.clear()
    publish.complete_push(recipe, push, REPO)
    assert read_pushes(out)[-1]["status"] == "pushed" and unconfirmed_push(out) is None


def test_a_push_given_up_on_a_stop_request_does_not_hold_the_process_end(tmp_path):
    """The given-up upload's thread is left running; Python's exit joins concurrent.futures' workers, a daemon
    thread's pool too (huggingface_hub's LFS uploads go through one), so the process waited on the upload it gave up,
    past the job's end: the requeue it asked for never came. The process ends with the stop's code, the upload not
    waited for (it would have ended, and said so, 120 s on: a margin only a process that waited for it uses up, the
    child's own end taking well under that on a loaded machine)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dpotrain.hub.hub_push import PushStopped, until_stopped
    from dpotrain.recipe.errors import end_process

    ended = tmp_path / "upload-ended"

    def given_up():
        started = threading.Event()

        def hung():
            started.set()
            time.sleep(120)  # the Hub not answering
            ended.write_text("the process waited for it\n")

        def upload():  # an upload through a pool, as LFS's
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(hung).result()

        with contextlib.suppress(PushStopped):
            until_stopped(upload, started.is_set)
        end_process(75)

    code, _, err = in_child(given_up)
    assert code == 75 and not ended.exists(), err


def test_a_checkpoint_upload_abandoned_at_the_wait_s_end_does_not_hold_the_process_end(hub, tmp_path, monkeypatch):
    """The end of training waits FINAL_WAIT_S for the checkpoint uploads still running, then records them
    `unfinished` and goes on; the upload's thread is left running, and Python's exit joins concurrent.futures' workers
    (huggingface_hub's LFS uploads, which the stand-in's "regular" files do not take: the upload is run through a pool
    here, as LFS's is): the process then waited on the hung commit past the job's end, until Slurm killed it. The
    child ends before the Hub answers the held commit."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.recipe.errors import end_process

    hub_in_process(hub, monkeypatch)
    held, answered, release = tmp_path / "commit-held", tmp_path / "commit-answered", threading.Event()
    # the stand-in's handler thread (this process): the child's commit hangs until the test ends
    hub.state.hold[("commit", "step-2")] = lambda: (held.write_text(""), release.wait(60), answered.write_text(""))
    out = tmp_path / "run"
    sealed_checkpoint(out / "checkpoint-2")

    def abandoned():
        upload = hub_push.upload_checkpoint

        def through_a_pool(*args):  # as an LFS upload's workers
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(upload, *args).result()

        hub_push.upload_checkpoint = through_a_pool
        pusher = hub_push.CheckpointPusher(REPO, SECRET, None, out)
        pusher.on_save(None, TrainerState(global_step=2, is_world_process_zero=True), None)
        while not held.exists():  # the commit is on the Hub's side, hung
            time.sleep(0.05)
        assert pusher.finish(0.1) == [2]
        end_process(0)

    try:
        code, _, err = in_child(abandoned)
        ended_first = not answered.exists()
    finally:
        release.set()
    assert code == 0 and ended_first, err
    recorded = [(r["step"], r["status"], r.get("error")) for r in read_pushes(out)]
    assert recorded == [(2, "unfinished", "still uploading")]


def test_a_checkpoint_rotation_deleted_while_its_upload_hung_is_pushed_from_its_staged_copy(
    hub, tmp_path, monkeypatch, capsys
):
    """save_total_limit deletes checkpoint-2 while its upload hangs; the job is stopped (or killed), the upload left
    `unfinished`. Its files survive only in `.hub_staging/checkpoint-2`, where neither the resumed run nor the rerun
    completing the push looked: the step was never pushed, and nothing said so (and the next wait's end removed the
    staged copy). Now it goes up from there, checked as a checkpoint is; a copy a kill cut short is recorded `failed`,
    saying the step is gone (its warning named push_to_hub.py, to push it "while it is still on disk")."""
    import shutil

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import FINAL_WAIT_S, STAGING, CheckpointPusher, record_checkpoint, stage

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    for step in (2, 4):  # the stopped job's: both staged as its pusher stages them, then rotated away
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        stage(folder, out / STAGING)
        shutil.rmtree(folder)
        record_checkpoint(out, REPO, step, "unfinished", error="still uploading")
    (out / STAGING / "checkpoint-4" / "model.safetensors").unlink()  # the kill came while it was being staged
    sealed_checkpoint(out / "checkpoint-6")  # the one rotation kept

    pusher = CheckpointPusher(REPO, SECRET, None, out)
    pusher.submit_left()  # as the resumed run's on_train_begin, and the rerun completing the push, call it
    assert pusher.finish(FINAL_WAIT_S) == []
    latest = {r["step"]: (r["status"], r.get("error", "")) for r in read_pushes(out)}
    assert latest[2][0] == "pushed" and latest[6][0] == "pushed", latest
    assert latest[4][0] == "failed" and "checkpoint-4 was deleted while its upload ran" in latest[4][1], latest
    assert "model.safetensors is missing" in latest[4][1], latest
    [said] = [line for line in capsys.readouterr().err.splitlines() if "checkpoint-4 was not pushed" in line]
    assert said.endswith("no command can push it: its checkpoint was deleted, and no whole copy of it is left"), said
    step_2 = [c for c in hub.state.commits if c["revision"] == "step-2"]
    assert len(step_2) == 1 and step_2[0]["files"]["model.safetensors"] == b"model.safetensors\n"


def test_push_to_hub_checkpoints_pushes_a_step_that_survives_only_as_its_staged_copy(hub, tmp_path, monkeypatch):
    """save_total_limit deleted checkpoint-2 while its upload hung and the job was stopped: the step survives only in
    `.hub_staging/checkpoint-2`. `push_to_hub.py --checkpoints`, the command the warnings name, pushed only the
    checkpoints on disk, and left that step unpushed without a word. Now it pushes it by the rule of the resumed run
    (`staged_only`): checked as a checkpoint is, and a copy a kill cut short is recorded `failed`, saying so."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import STAGING, record_checkpoint, stage
    from dpotrain.train import run_files

    out = tmp_path / "run"
    for step in (2, 4):  # the stopped job's: both staged as its pusher stages them, then rotated away
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        stage(folder, out / STAGING)
        shutil.rmtree(folder)
        record_checkpoint(out, REPO, step, "unfinished", error="given up on a stop request")
    (out / STAGING / "checkpoint-4" / "model.safetensors").unlink()  # the kill came while it was being staged
    sealed_checkpoint(out / "checkpoint-6")  # the one rotation kept (a stopped run: no run_complete.json)
    run_files.write(out, [run_files.MANIFEST, STAGING, PUSH_RECORD, "checkpoint-6"])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), pytest.raises(Exception) as ended:  # main reads .env into the environment
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    said = str(ended.value)  # the copy cut short: the command says no command can push it (not "run ... again")
    assert said.startswith("no command can push step-4 (see ") and "run the same command again" not in said, said
    assert said.endswith("checkpoint-4 was deleted, and its copy in .hub_staging was not whole (removed)"), said
    latest = {r["step"]: (r["status"], r.get("error", "")) for r in read_pushes(out)}
    assert latest[2][0] == "pushed" and latest[6][0] == "pushed", latest
    assert latest[4][0] == "failed" and "checkpoint-4 was deleted while its upload ran" in latest[4][1], latest
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert "step-4" not in hub.state.repos[REPO] or "model.safetensors" not in hub.state.repos[REPO]["step-4"]
    # Both copies removed: step 2's is on the Hub, step 4's can never be pushed (it failed every run of the command,
    # "run the same command again"; a reviewer's finding)
    assert not (out / STAGING / "checkpoint-2").exists() and not (out / STAGING / "checkpoint-4").exists()


def test_a_staged_copy_whose_push_was_recorded_before_a_kill_is_removed_by_the_next_push(hub, tmp_path, monkeypatch):
    """push_to_hub.py killed after recording step 2 pushed from its staged copy, before removing the copy: every later
    run of the command skipped the step (on the Hub) and left the copy, the deleted checkpoint's weights on the disk
    for good. The next run removes it, and pushes nothing again."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import STAGING, record_checkpoint, stage
    from dpotrain.train import run_files

    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    stage(folder, out / STAGING)
    shutil.rmtree(folder)  # rotated away while its upload ran
    record_checkpoint(out, REPO, 2, "pushed", files=["model.safetensors"])  # what the killed command wrote last
    sealed_checkpoint(out / "checkpoint-4")
    run_files.write(out, [run_files.MANIFEST, STAGING, PUSH_RECORD, "checkpoint-4"])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), contextlib.suppress(SystemExit):  # main reads .env into the environment
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    latest = {r["step"]: r["status"] for r in read_pushes(out)}
    assert latest == {2: "pushed", 4: "pushed"}, latest
    assert "step-2" not in hub.state.repos[REPO]  # not pushed again
    assert not (out / STAGING / "checkpoint-2").exists()


def test_push_to_hub_tells_the_steps_no_command_can_push_from_those_it_can(hub, tmp_path, monkeypatch, capsys):
    """Every `failed` step ended in "step-N failed to push (see ...): run the same command again", a staged copy the
    command had just removed as cut short too: run again, it exited 0 and said nothing of that step, lost on the Hub
    side. Now such a failure is recorded `pushable: false` and named apart, once, as no command's to push; the closing
    line names only the steps a rerun can push (a Hub failure), and the rerun pushes them. (Failed on the old code:
    its line named step-4 among the steps to run the command again for.)"""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import STAGING, record_checkpoint, stage
    from dpotrain.recipe.errors import ConfigError, RunError
    from dpotrain.train import run_files

    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-4")
    stage(folder, out / STAGING)
    shutil.rmtree(folder)  # rotated away while its upload hung, and its copy cut short by the kill
    record_checkpoint(out, REPO, 4, "unfinished", error="given up on a stop request")
    (out / STAGING / "checkpoint-4" / "model.safetensors").unlink()
    (sealed_checkpoint(out / "checkpoint-6") / "model.safetensors").write_text("cut\n")  # damaged on disk
    sealed_checkpoint(out / "checkpoint-8")
    run_files.write(out, [run_files.MANIFEST, STAGING, PUSH_RECORD, "checkpoint-6", "checkpoint-8"])
    script = push_script(hub, monkeypatch)
    hub.state.fail_status = 400  # a failure nothing retries: a rerun can push it
    hub.state.fail[("commit", "step-8")] = -1
    with mock.patch.dict(os.environ), pytest.raises(RunError) as ended:  # the Hub's failure: exit 1, not a refusal
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    assert str(ended.value) == f"step-8 failed to push (see {out}/{PUSH_RECORD}): run the same command again"
    lost = [line for line in capsys.readouterr().err.splitlines() if "no command can push step-" in line]
    assert lost == [
        f"warning: no command can push step-4, step-6 (see {out}/{PUSH_RECORD}), so they are not on the Hub: "
        "step-4: checkpoint-4 was deleted, and its copy in .hub_staging was not whole (removed); "
        "step-6: checkpoint-6 on disk is not pushable as it is, model.safetensors has 4 bytes, 18 were saved (cut "
        "short or replaced)"
    ], lost
    latest = {r["step"]: r for r in read_pushes(out)}
    assert [latest[s].get("pushable") for s in (4, 6, 8)] == [False, False, None], latest
    del hub.state.fail[("commit", "step-8")]
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as again:  # step-6 is still on disk, as it is
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    assert str(again.value).startswith("no command can push step-6 (see "), str(again.value)
    assert hub.state.repos[REPO]["step-8"]["model.safetensors"] == b"model.safetensors\n"


def test_a_damaged_staged_copy_is_recorded_failed_once_and_removed_as_a_cut_short_one_is(hub, tmp_path, monkeypatch):
    """`push_to_hub.py --checkpoints` removed a staged copy it could not push only where its error said "is not whole"
    (a file cut short, by its size). A copy of the right sizes whose bytes differ from its manifest (a bad disk block)
    failed later, on its SHA-256, and was kept: every run of the command failed on it again, a `failed` line and
    "run the same command again" each time. Now both go one way: recorded failed once, saying why, and removed."""
    import shutil

    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    for step in (2, 4):  # the stopped job's: both staged as its pusher stages them, then rotated away
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        hub_push.stage(folder, out / hub_push.STAGING)
        shutil.rmtree(folder)
        hub_push.record_checkpoint(out, REPO, step, "unfinished", error="given up on a stop request")
    (out / hub_push.STAGING / "checkpoint-2" / "model.safetensors").write_text("model.safetensorZ\n")  # same size
    (out / hub_push.STAGING / "checkpoint-4" / "model.safetensors").write_text("cut\n")  # cut short
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD])
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    first = hub_push.push_checkpoints(api, out, REPO)
    assert [(r["step"], r["status"]) for r in first] == [(2, "failed"), (4, "failed")], first
    assert "checkpoint-2 was deleted while its upload ran" in first[0]["error"], first
    assert "does not match its SHA-256" in first[0]["error"] and "has 4 bytes" in first[1]["error"], first
    assert (
        not (out / hub_push.STAGING / "checkpoint-2").exists()
        and not (out / hub_push.STAGING / "checkpoint-4").exists()
    )
    assert hub_push.push_checkpoints(api, out, REPO) == []  # the command run again: nothing left to fail on
    assert [r["status"] for r in read_pushes(out)].count("failed") == 2
    assert not hub.state.commits


@pytest.mark.parametrize("failing_read", [1, 2])  # the manifest's first read (its files), or its second (the model's)
@pytest.mark.parametrize("pusher", ["push_to_hub", "requeued job"])
def test_a_staged_copy_whose_manifest_read_fails_once_is_kept_and_pushed_later(
    hub, tmp_path, monkeypatch, capsys, pusher, failing_read
):
    """A read of a staged copy's manifest that failed (EIO, ESTALE on NFS) was taken for a manifest naming no model's
    files: NotPushable, and the copy, the step's last, removed (push_to_hub.py and the resumed run's pusher alike), or
    an OSError out of the requeued job's start. A read that failed is no damaged copy: now it is recorded failed with
    its cause, the copy kept, and the next job or command pushes it. (Failed on the old code: the copy removed on the
    second read, a traceback on the first.)"""
    import errno
    import shutil
    from pathlib import Path

    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    copy = hub_push.stage(folder, out / hub_push.STAGING)
    shutil.rmtree(folder)  # rotated away while its upload hung: the copy is the step's last
    hub_push.record_checkpoint(out, REPO, 2, "unfinished", error="given up on a stop request")
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD])
    HfApi(endpoint=hub.endpoint, token=SECRET).create_repo(REPO)  # as push_to_hub.py creates it first
    manifest, reads, read_text = copy / "MANIFEST.json", [], Path.read_text

    def failing(path, *args, **kwargs):
        if path == manifest:
            reads.append(path)
            if len(reads) == failing_read:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read_text(path, *args, **kwargs)

    def push_it():
        if pusher == "push_to_hub":
            return hub_push.push_checkpoints(HfApi(endpoint=hub.endpoint, token=SECRET), out, REPO)
        job = hub_push.CheckpointPusher(REPO, SECRET, None, out)
        job.submit_left()  # as the resumed run's on_train_begin calls it
        assert job.finish(hub_push.FINAL_WAIT_S) == []
        return None

    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_text", failing)
        push_it()
    latest = hub_push.read_pushes(out)[-1]
    assert latest["status"] == "failed" and "pushable" not in latest, latest
    assert latest["error"] == "it could not be read (OSError: [Errno 5] Input/output error)", latest
    assert (copy / "model.safetensors").read_text() == "model.safetensors\n"  # kept, whole
    assert "was not pushed" in capsys.readouterr().err
    push_it()  # the next job, or the command run again: the read answers
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert hub_push.read_pushes(out)[-1]["status"] == "pushed" and not copy.exists()


@pytest.mark.parametrize("failing_read", [1, 2, 3])  # the check's two reads of the manifest, then the staging's
def test_a_checkpoint_whose_manifest_read_fails_at_its_save_is_a_warning_and_pushed_later(
    hub, tmp_path, monkeypatch, capsys, failing_read
):
    """At a save, the pusher's check reads the checkpoint's manifest in the training loop: a read that failed (EIO)
    ended the run in an OSError, or was taken for a checkpoint no command can push. Now it is a warning and a `failed`
    line that a later push keeps its promise of. (Failed on the old code: the OSError, or `pushable: false`.)"""
    import errno
    from pathlib import Path

    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import FINAL_WAIT_S, CheckpointPusher

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    manifest, reads, read_text = sealed_checkpoint(out / "checkpoint-2") / "MANIFEST.json", [], Path.read_text

    def failing(path, *args, **kwargs):
        if path == manifest:
            reads.append(path)
            if len(reads) == failing_read:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read_text(path, *args, **kwargs)

    pusher = CheckpointPusher(REPO, SECRET, None, out)
    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_text", failing)
        pusher.on_save(None, TrainerState(global_step=2, is_world_process_zero=True), None)
    assert pusher.finish(FINAL_WAIT_S) == []
    [record] = read_pushes(out)
    assert record["status"] == "failed" and "pushable" not in record, record
    assert record["error"].endswith("(OSError: [Errno 5] Input/output error)"), record
    assert "pushes it later while it is still on disk" in capsys.readouterr().err
    job = CheckpointPusher(REPO, SECRET, None, out)  # the next job, as its start pushes what is left
    job.submit_left()
    assert job.finish(FINAL_WAIT_S) == []
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"


@pytest.mark.parametrize("name", ["model.safetensors", "MANIFEST.json"])
@pytest.mark.parametrize("pusher", ["push_to_hub", "requeued job"])
def test_a_staged_copy_whose_file_stat_fails_is_kept_not_taken_for_missing(hub, tmp_path, monkeypatch, pusher, name):
    """A reviewer's finding: the check asked Path.is_file() whether a weight file or the manifest was there, and on
    Python 3.14 it says False for every OSError (an ESTALE, an EIO), so a file that could not be read now was taken for
    one deleted: NotPushable, and the staged copy, the step's last, removed. A stat that fails other than for a missing
    file is a read that failed: recorded failed, the copy kept, pushed by the next job or command. (Failed on the old
    code: `pushable: false`, the copy removed.)"""
    import shutil

    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    copy = hub_push.stage(folder, out / hub_push.STAGING)
    shutil.rmtree(folder)  # rotated away while its upload hung: the copy is the step's last
    hub_push.record_checkpoint(out, REPO, 2, "unfinished", error="given up on a stop request")
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD])
    HfApi(endpoint=hub.endpoint, token=SECRET).create_repo(REPO)

    def push_it():
        if pusher == "push_to_hub":
            return hub_push.push_checkpoints(HfApi(endpoint=hub.endpoint, token=SECRET), out, REPO)
        job = hub_push.CheckpointPusher(REPO, SECRET, None, out)
        job.submit_left()
        assert job.finish(hub_push.FINAL_WAIT_S) == []
        return None

    with monkeypatch.context() as patched:
        failing_stat(patched, copy / name)
        push_it()
    latest = hub_push.read_pushes(out)[-1]
    assert latest["status"] == "failed" and "pushable" not in latest, latest
    assert latest["error"] == f"it could not be read (OSError: [Errno 116] Stale file handle: '{copy / name}')", latest
    assert (copy / "model.safetensors").read_text() == "model.safetensors\n"  # kept, whole
    push_it()  # the file server answers again
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert hub_push.read_pushes(out)[-1]["status"] == "pushed" and not copy.exists()


def test_a_failure_whose_recording_cannot_read_the_checkpoint_is_a_warning_not_an_error_out_of_on_save(
    hub, tmp_path, monkeypatch, capsys
):
    """A reviewer's finding: recording a checkpoint's failed push asks whether it is still on disk (its COMPLETE
    mark), a read that can fail as the check's did (ESTALE): raised out of `on_save`, on rank 0 alone, while the other
    ranks go on into the next collective and wait there. A failure while recording a failure is said in the warning,
    never raised out of a callback. (Failed on the old code: the OSError out of on_save.)"""
    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import FINAL_WAIT_S, CheckpointPusher
    from dpotrain.train.checkpoints import MARKER

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    manifest, mark, read_text, real_stat, looks = (
        folder / "MANIFEST.json",
        folder / MARKER,
        Path.read_text,
        Path.stat,
        [],
    )

    def manifest_fails(path, *args, **kwargs):
        if path == manifest:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read_text(path, *args, **kwargs)

    def mark_fails_after_one_look(path, *args, **kwargs):
        if path == mark:
            looks.append(path)
            if len(looks) > 1:  # the save's own look answered; the one recording the failure does not
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))
        return real_stat(path, *args, **kwargs)

    pusher = CheckpointPusher(REPO, SECRET, None, out)
    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_text", manifest_fails)
        patched.setattr(Path, "stat", mark_fails_after_one_look)
        pusher.on_save(None, TrainerState(global_step=2, is_world_process_zero=True), None)
    assert len(looks) > 1  # the recording's look failed
    assert pusher.finish(FINAL_WAIT_S) == []
    [record] = read_pushes(out)
    assert record["status"] == "failed" and record["error"].startswith("it could not be read (OSError: [Errno 5]")
    said = capsys.readouterr().err
    assert "checkpoint-2 was not pushed to me/dpo-test@step-2 (it could not be read" in said, said
    assert "whether checkpoint-2 is still on disk could not be read" in said, said


def test_push_to_hub_records_a_step_whose_manifest_read_fails_at_the_push_and_goes_on(hub, tmp_path, monkeypatch):
    """A reviewer's finding: push_checkpoint reads the manifest a third time (the files it records), after the check's
    two reads; failing there (EIO), the OSError ended the whole `push_to_hub.py --checkpoints` with no record of the
    step, and the steps after it were not tried. Every step the command tries ends recorded, pushed or failed with its
    cause (the copy kept), and the command goes on to the next. (Failed on the old code: the OSError.)"""
    import shutil

    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    for step in (2, 4):  # both rotated away while their uploads hung
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        hub_push.stage(folder, out / hub_push.STAGING)
        shutil.rmtree(folder)
        hub_push.record_checkpoint(out, REPO, step, "unfinished", error="given up on a stop request")
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD])
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    copy = out / hub_push.STAGING / "checkpoint-2"
    manifest, reads, read_text = copy / "MANIFEST.json", [], Path.read_text

    def third_read_fails(path, *args, **kwargs):
        if path == manifest:
            reads.append(path)
            if len(reads) == 3:  # the check read it twice; push_checkpoint's read of the files it records
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read_text(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_text", third_read_fails)
        records = hub_push.push_checkpoints(api, out, REPO)
    assert len(reads) == 3
    assert [(r["step"], r["status"], r.get("error")) for r in records] == [
        (2, "failed", "it could not be read (OSError: [Errno 5] Input/output error)"),
        (4, "pushed", None),
    ]
    assert (copy / "model.safetensors").read_text() == "model.safetensors\n"  # kept for the command run again
    assert "step-2" not in hub.state.repos[REPO]


def test_push_to_hub_records_a_step_whose_read_fails_comparing_it_with_its_branch_and_goes_on(
    hub, tmp_path, monkeypatch
):
    """Run again, `push_to_hub.py --checkpoints` compares each checkpoint with the branch that holds it already, reading
    its files; a read failing there (EIO) ended the whole command with no record of the step, and the steps after it
    untried. It is recorded failed with its cause, and the command goes on. (Failed on the old code: the OSError.)"""
    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    assert [r["status"] for r in hub_push.push_checkpoints(api, out, REPO)] == ["pushed"]
    sealed_checkpoint(out / "checkpoint-4")  # saved since
    manifest, reads, read_text = folder / "MANIFEST.json", [], Path.read_text

    def third_read_fails(path, *args, **kwargs):
        if path == manifest:
            reads.append(path)
            if len(reads) == 3:  # the check read it twice; the comparison with the branch reads its SHA-256s
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read_text(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_text", third_read_fails)
        records = hub_push.push_checkpoints(api, out, REPO)
    assert [(r["step"], r["status"], r.get("error")) for r in records] == [
        (2, "failed", "it could not be read (OSError: [Errno 5] Input/output error)"),
        (4, "pushed", None),
    ]
    assert len(reads) == 3 and (folder / "model.safetensors").read_text() == "model.safetensors\n"


def test_push_to_hub_names_the_fix_of_a_file_it_cannot_read_and_keeps_its_copy(hub, tmp_path, monkeypatch):
    """A reviewer's finding: a permission refused on a staged copy's manifest, or a folder standing where its weight
    file should be, is no failure a rerun gets past, yet the command said "run the same command again" of it, for
    ever; and the folder was taken for a deleted file, the copy (the step's last) removed as never pushable. Each is
    now recorded failed with its cause and its fix, the copy kept, and the closing line names both. (Failed on the old
    code: the folder's copy removed, no fix named.) A permission refused is patched in: the tests may run as root."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    out = tmp_path / "run"
    for step in (2, 4):  # the stopped job's: staged, then rotated away
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        hub_push.stage(folder, out / hub_push.STAGING)
        shutil.rmtree(folder)
        hub_push.record_checkpoint(out, REPO, step, "unfinished", error="given up on a stop request")
    sealed_checkpoint(out / "checkpoint-6")  # the one rotation kept (a stopped run: no run_complete.json)
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD, "checkpoint-6"])
    refused, weights = (
        out / hub_push.STAGING / "checkpoint-2" / "MANIFEST.json",
        out / hub_push.STAGING / "checkpoint-4",
    )
    (weights / "model.safetensors").unlink()
    (weights / "model.safetensors").mkdir()  # a folder where the weight file should be
    read_text = Path.read_text

    def permission_refused(path, *args, **kwargs):
        if path == refused:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return read_text(path, *args, **kwargs)

    script = push_script(hub, monkeypatch)
    monkeypatch.setattr(Path, "read_text", permission_refused)
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as failed:
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    folder_there = f"IsADirectoryError: [Errno 21] Is a directory: '{weights / 'model.safetensors'}'"
    assert str(failed.value) == (
        f"step-2, step-4 failed to push (see {out}/{PUSH_RECORD}), and they push only once mended: step-2: it could "
        f"not be read (PermissionError: [Errno 13] Permission denied: '{refused}'): fix the file's permissions first; "
        f"step-4: it could not be read ({folder_there}): a folder stands where the checkpoint's file should be: put "
        "the file back in its place first; then run the same command again"
    )
    latest = {r["step"]: r for r in read_pushes(out)}
    assert [(s, latest[s]["status"], latest[s].get("pushable")) for s in (2, 4, 6)] == [
        (2, "failed", None),
        (4, "failed", None),
        (6, "pushed", None),
    ]
    assert refused.is_file() and (weights / "model.safetensors").is_dir()  # both copies kept: nothing lost


def test_a_cut_short_staged_copy_is_recorded_failed_by_one_job_not_by_each_requeue(hub, tmp_path, monkeypatch):
    """The resumed run's pusher recorded a staged copy a kill cut short `failed` and left it in `.hub_staging/`, which
    only the end of training's wait cleared: a job stopped or killed again before it left it, and each requeue wrote
    the same `failed` line and warning again. Now the copy goes with its one record."""
    import shutil

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import STAGING, CheckpointPusher, record_checkpoint, stage

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    stage(folder, out / STAGING)
    shutil.rmtree(folder)
    record_checkpoint(out, REPO, 2, "unfinished", error="still uploading")
    (out / STAGING / "checkpoint-2" / "model.safetensors").unlink()  # the kill came while it was being staged
    for _job in range(2):  # two requeued jobs, the first killed before its end (no `finish`)
        CheckpointPusher(REPO, SECRET, None, out).submit_left()
    assert [(r["status"], r.get("pushable")) for r in read_pushes(out)] == [("unfinished", None), ("failed", False)]
    assert not (out / STAGING / "checkpoint-2").exists()


def test_a_checkpoint_damaged_on_disk_is_not_promised_a_later_push(hub, tmp_path, monkeypatch, capsys):
    """A checkpoint whose files disagree with its manifest (cut short, or a flipped byte) failed its push with
    "`push_to_hub.py --checkpoints` pushes it later while it is still on disk": the command checks it as the run does,
    and refuses it every time. The warning now says no command can push it as it is."""
    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import CheckpointPusher, checkpoints_left

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    (sealed_checkpoint(out / "checkpoint-2") / "model.safetensors").write_text("cut\n")  # by its size, at once
    (sealed_checkpoint(out / "checkpoint-4") / "model.safetensors").write_text("model.safetensorZ\n")  # its SHA-256
    pusher = CheckpointPusher(REPO, SECRET, None, out)
    for step in (2, 4):
        pusher.on_save(None, TrainerState(global_step=step, is_world_process_zero=True), None)
    assert pusher.finish(60) == []
    said = [line for line in capsys.readouterr().err.splitlines() if "was not pushed" in line]
    assert len(said) == 2 and not any("pushes it later" in line for line in said), said
    assert all(
        line.endswith("no command can push it as it is: push_to_hub.py --checkpoints checks it as the run does")
        for line in said
    ), said
    assert [(r["step"], r["status"], r["pushable"]) for r in read_pushes(out)] == [
        (2, "failed", False),
        (4, "failed", False),
    ]
    assert checkpoints_left(out, REPO) == []  # no `--checkpoints` named for them: it refuses them too


def test_push_to_hub_refuses_a_folder_a_running_job_holds(hub, tmp_path, monkeypatch):
    """`push_to_hub.py --checkpoints` never read the run's lock: beside a requeued job of the same folder, both pushed
    the same staged copy and each removed it once pushed, under the other's upload. Refused now, before anything is
    written, naming the job; once the job is gone the same command pushes."""
    import json
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.cluster import run_lock
    from dpotrain.hub.hub_push import STAGING, record_checkpoint, stage
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    stage(folder, out / STAGING)
    shutil.rmtree(folder)
    record_checkpoint(out, REPO, 2, "unfinished", error="given up on a stop request")
    sealed_checkpoint(out / "checkpoint-4")  # the one rotation kept (a stopped run: no run_complete.json)
    run_files.write(out, [run_files.MANIFEST, STAGING, PUSH_RECORD, "checkpoint-4"])
    job = subprocess.Popen(["sleep", "600"])  # the requeued job's process: alive until killed below
    try:
        holder = {**run_lock.holder_record(), "pid": job.pid, "process_start": run_lock.process_start(job.pid)}
        (out / run_lock.LOCK_FILE).write_text(json.dumps({**holder, "slurm_job_id": "5512"}, indent=1))
        records = (out / PUSH_RECORD).read_text()
        script = push_script(hub, monkeypatch)
        with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
            script.main([str(out), "--repo-id", REPO, "--checkpoints"])
        said = str(refused.value)
        assert said.startswith(f"{out} is in use by a running job (host ") and f"pid {job.pid}" in said, said
        assert said.endswith("wait for it to end (or stop it: scancel 5512), then run this command again"), said
        assert (out / PUSH_RECORD).read_text() == records and (out / STAGING / "checkpoint-2").is_dir()
        assert not hub.state.commits
    finally:
        job.kill()
        job.wait()
    with mock.patch.dict(os.environ):  # the job gone: its lock is a dead run's
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"


@pytest.mark.parametrize(
    ("recorded", "does"),
    [
        ({"push_to_hub": False}, "is still writing it (saving and deleting checkpoints as it trains)"),
        ({"push_to_hub": True}, "is still writing it (saving and deleting checkpoints as it trains), and pushes its "),
        ({"push_to_hub": True, "push_checkpoints": True}, "pushes its own checkpoints"),
    ],
)
def test_push_to_hub_says_what_the_running_job_holding_the_folder_does(hub, tmp_path, monkeypatch, recorded, does):
    """A running job's folder was refused because the job "pushes its own checkpoints", said of a job run without
    --push_to_hub too, which pushes nothing: the refusal says what the job does, by its record."""
    from dpotrain.cluster import run_lock
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    out.mkdir()
    (out / "resolved_config.json").write_text(json.dumps(recorded))
    job = subprocess.Popen(["sleep", "600"])  # the job's process: alive until killed below
    try:
        holder = {**run_lock.holder_record(), "pid": job.pid, "process_start": run_lock.process_start(job.pid)}
        (out / run_lock.LOCK_FILE).write_text(json.dumps(holder, indent=1))
        with pytest.raises(ConfigError) as refused:
            push_script(hub, monkeypatch).main([str(out), "--repo-id", REPO, "--checkpoints"])
        assert f"), which {does}" in str(refused.value), str(refused.value)
        assert str(refused.value).endswith(": wait for it to end, then run this command again")
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize("job_starts_at", [6, 2])  # while checkpoint-6 on disk is pushed; while step 2's copy is
def test_push_to_hub_asks_the_run_lock_again_before_each_staged_copy(hub, tmp_path, monkeypatch, job_starts_at):
    """`push_to_hub.py --checkpoints` read the run's lock once, at its start: a requeued job starting during its
    uploads (minutes) pushed the same staged copies, and each removed them once pushed, under the other's upload. The
    lock is asked again before each staged copy is pushed and before it is removed, with the same refusal: the job
    started at checkpoint-6's upload gets every staged copy; at step 2's, that copy is kept for it and step 4 is left
    to it. (Failed on the old code: no refusal, both copies pushed and removed under the job.)"""
    import json
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.cluster import run_lock
    from dpotrain.hub import hub_push
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    out = tmp_path / "run"
    for step in (2, 4):  # the stopped job's: staged, then rotated away
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        hub_push.stage(folder, out / hub_push.STAGING)
        shutil.rmtree(folder)
        hub_push.record_checkpoint(out, REPO, step, "unfinished", error="given up on a stop request")
    sealed_checkpoint(out / "checkpoint-6")  # the one rotation kept (a stopped run: no run_complete.json)
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD, "checkpoint-6"])
    script = push_script(hub, monkeypatch)
    job = subprocess.Popen(["sleep", "600"])  # the requeued job's process: alive until killed below
    push_checkpoint = hub_push.push_checkpoint

    def pushed_as_the_job_starts(api, repo_id, folder, step, run_dir):
        entry = push_checkpoint(api, repo_id, folder, step, run_dir)
        if step == job_starts_at:  # the job takes the folder's lock during this upload
            holder = {**run_lock.holder_record(), "pid": job.pid, "process_start": run_lock.process_start(job.pid)}
            (out / run_lock.LOCK_FILE).write_text(json.dumps({**holder, "slurm_job_id": "5512"}, indent=1))
        return entry

    monkeypatch.setattr(hub_push, "push_checkpoint", pushed_as_the_job_starts)
    try:
        with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
            script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    finally:
        job.kill()
        job.wait()
    said = str(refused.value)
    assert said.startswith(f"{out} is in use by a running job (host ") and f"pid {job.pid}" in said, said
    assert said.endswith("wait for it to end (or stop it: scancel 5512), then run this command again"), said
    on_the_hub = {s for s, _ in hub_push.pushed_revisions(out, REPO)}
    assert on_the_hub == ({6} if job_starts_at == 6 else {2, 6}), on_the_hub
    # the copies the job pushes are left to it, the one pushed here too (its removal would come under the job's upload)
    assert all((out / hub_push.STAGING / f"checkpoint-{s}" / "model.safetensors").is_file() for s in (2, 4))
    assert "step-4" not in hub.state.repos[REPO]


def test_a_staged_copy_whose_upload_fails_for_good_is_kept_for_push_to_hub(hub, tmp_path, monkeypatch, capsys):
    """The staged copy of a checkpoint save_total_limit deleted is its last copy. When its upload failed past the
    retries, the worker deleted it all the same, and `finish` the staging folder: the step was gone, while the record
    said `failed` and the warning that `push_to_hub.py --checkpoints` "pushes it later while it is still on disk". Now
    the copy is kept (and the folder holding it, its other copies removed), the warning names it, and the command
    pushes it."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import FINAL_WAIT_S, STAGING, CheckpointPusher, record_checkpoint, stage
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")
    stage(folder, out / STAGING)
    shutil.rmtree(folder)  # rotated away while its upload hung
    record_checkpoint(out, REPO, 2, "unfinished", error="given up on a stop request")
    sealed_checkpoint(out / "checkpoint-4")
    run_files.write(out, [run_files.MANIFEST, STAGING, PUSH_RECORD, "checkpoint-4"])
    hub.state.fail_status = 400  # a failure nothing retries
    hub.state.fail[("commit", "step-2")] = -1
    pusher = CheckpointPusher(REPO, SECRET, None, out)
    pusher.submit_left()  # as the resumed run's on_train_begin calls it
    assert pusher.finish(FINAL_WAIT_S) == []
    latest = {r["step"]: r["status"] for r in read_pushes(out)}
    assert latest == {2: "failed", 4: "pushed"}, latest
    kept = out / STAGING / "checkpoint-2"
    assert (kept / "model.safetensors").read_text() == "model.safetensors\n"
    assert sorted(p.name for p in (out / STAGING).iterdir()) == ["checkpoint-2"]  # checkpoint-4's copy removed
    assert STAGING in run_files.read(out)  # still the run's: the next push finds it
    assert f"pushes it later from its copy in {kept}" in capsys.readouterr().err
    del hub.state.fail[("commit", "step-2")]
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ):  # main reads .env into the environment
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert [r["status"] for r in read_pushes(out) if r["step"] == 2][-1] == "pushed"
    assert not kept.exists()  # on the Hub now: no longer kept (it stayed, a checkpoint's size, forever)


def test_one_staged_copy_is_kept_at_a_time_while_the_hub_fails(hub, tmp_path, monkeypatch, capsys):
    """While the Hub fails every upload (a revoked token, an outage past the retries), each failed checkpoint's staged
    copy was kept, and once rotation deleted the checkpoint it held a whole one: the disk filled past
    save_total_limit's bound until a save failed (a reviewer's finding). The newest copy is kept; an older one is
    removed, said where it was its step's last."""
    import shutil

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import FINAL_WAIT_S, STAGING, CheckpointPusher, record_checkpoint, stage
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    for step in (2, 3):  # both rotated away while their uploads hung, then the job was stopped
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        stage(folder, out / STAGING)
        shutil.rmtree(folder)
        record_checkpoint(out, REPO, step, "unfinished", error="given up on a stop request")
    run_files.write(out, [run_files.MANIFEST, STAGING, PUSH_RECORD])
    hub.state.fail_status = 400  # a failure nothing retries
    hub.state.fail[("commit", "step-2")] = hub.state.fail[("commit", "step-3")] = -1
    pusher = CheckpointPusher(REPO, SECRET, None, out)
    pusher.submit_left()
    assert pusher.finish(FINAL_WAIT_S) == []
    assert sorted(p.name for p in (out / STAGING).iterdir()) == ["checkpoint-3"]
    said = capsys.readouterr().err
    assert "the copy of checkpoint-2 kept after its failed upload is removed for checkpoint-3's" in said, said
    assert "step 2 is on neither the disk nor the Hub" in said, said


def test_a_stop_request_while_training_waits_for_checkpoint_uploads_ends_the_run_for_its_requeue(
    hub, tmp_path, monkeypatch, tiny_model_dir, capsys
):
    """The end of training waits up to 30 min for the checkpoint uploads still running (push_checkpoints). The time
    limit's warning (the batch shell's stop file) or a preemption's SIGTERM while the Hub hung one of them: the run
    went on waiting, said nothing to the batch script, and Slurm killed it (the time limit: a TIMEOUT job, not
    requeued), the checkpoint's push lost without a word. Now the wait is given up (`unfinished` in hub_pushes.jsonl),
    the final push too, `.checkpointed` tells launch.sh to requeue, the run ends with 75, and the requeued job pushes
    the checkpoint to its branch, then main, whose card lists it, training nothing. The pusher driven as
    publish.finish_outputs drives it, without a training run."""
    import shutil
    import threading

    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain import publish
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub.hub_push import FINAL_WAIT_S, CheckpointPusher, PushStopped
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.preemption import STOPPED_EXIT, GracefulStop

    hub_in_process(hub, monkeypatch)
    stalled, release = threading.Event(), threading.Event()
    hub.state.hold[("commit", "step-2")] = lambda: (stalled.set(), release.wait(60))  # the checkpoint's commit hangs
    hub.state.fail[("commit", "step-2")], hub.state.fail_status = 1, 400  # and then fails: the given-up thread's end
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)  # the final model, saved before the wait
    sealed_checkpoint(out / "checkpoint-2")
    stop_file = tmp_path / "stop"
    flags = ["--push_to_hub", "true", "--hub_model_id", REPO, "--push_checkpoints", "true"]
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), *flags, "--hub_token", SECRET])
    push = hub_module.take_push_settings(recipe)
    stop = GracefulStop(str(stop_file))
    pusher = CheckpointPusher(REPO, SECRET, None, out)
    try:
        pusher.on_save(None, TrainerState(global_step=2, is_world_process_zero=True), None)
        warned = lambda: stalled.wait(600) and stop_file.write_text("")  # noqa: E731 - as launch.sh's trap does
        threading.Thread(target=warned, daemon=True).start()
        with pytest.raises(PushStopped):  # a fix undone: waits FINAL_WAIT_S
            pusher.finish(FINAL_WAIT_S, stop.asked_to_end)
        (out / "README.md").write_text("# run\n")  # the run's outputs, written after the wait (finish_outputs)
        (out / "run_complete.json").write_text('{"global_step": 2}')
        assert publish.push_final(out, push, recipe.training, stop) == STOPPED_EXIT
        pushes = [(r["branch"], r["status"], r.get("error")) for r in read_pushes(out)]
        given_up = "given up on a stop request"
        assert pushes == [
            ("step-2", "unfinished", given_up),
            ("main", "started", None),
            ("main", "unfinished", given_up + " while pushing"),
        ]
        assert "final push to me/dpo-test" in Path(f"{stop_file}.checkpointed").read_text()
        assert unconfirmed_push(out)["repo"] == REPO  # the requeued job's decision (push_left): to this repo
    finally:
        stop.release(exiting=False)
        hub.state.hold.clear()
        release.set()
    pusher.queue.join()  # the upload given up ends (a 400 recorded `failed`), as the job's end would have cut it

    # The requeued job completes the push: the checkpoint first, to its branch, then main, whose card lists it
    stop_file.unlink()
    capsys.readouterr()
    publish.complete_push(recipe, push, REPO)
    # the reason recorded, not "killed while pushing, or the push failed", which sent a reader to look for a crash
    assert (
        f"{REPO} was started and not confirmed (the push was left unfinished: given up on a stop request while "
        "pushing): pushing it now; nothing is trained"
    ) in capsys.readouterr().out
    assert [(r["branch"], r["status"]) for r in read_pushes(out)[-3:]] == [
        ("step-2", "pushed"),
        ("main", "started"),
        ("main", "pushed"),
    ]
    assert [c["revision"] for c in hub.state.commits][-2:] == ["step-2", "main"]
    assert 'revision="step-2"' in hub.state.commits[-1]["files"]["README.md"].decode()
    assert unconfirmed_push(out) is None


def test_a_rerun_completing_a_push_creates_no_repo_named_after_the_command(hub, tmp_path, monkeypatch, tiny_model_dir):
    """The rerun the refusal advises (`--push_to_hub` alone) checked write access to, and created, a repo named after
    the run (me/run) at its start, though it pushes only to the repo the cut-short push started on: an empty stray
    repo on the Hub. The whole rerun, through the command's entry."""
    import shutil

    import train_dpo
    from dpotrain.hub.hub_push import record_push

    hub_in_process(hub, monkeypatch)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    train_dpo.main(["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--report_to", "none"])
    assert [commit["repo"] for commit in hub.state.commits] == [REPO] and "me/run" not in hub.state.repos


def test_the_push_commands_a_run_prints_keep_a_folder_with_a_space_one_word(tmp_path, monkeypatch, capsys):
    """`python scripts/push_to_hub.py /x/my runs/think dpo --repo-id ...`, copied as printed, pushed the folder
    '/x/my' (or was refused for the words after it): each printed command is as a shell reads it back."""
    import shlex

    from conftest import sealed_checkpoint
    from dpotrain import publish, resolve
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub.hub_push import CheckpointPusher, record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "my runs" / "think dpo"
    out.mkdir(parents=True)
    (out / "run_complete.json").write_text('{"global_step": 2}')
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    with pytest.raises(ConfigError) as refused:  # a finished run whose push was cut short, rerun without a push
        resolve.check_output_dir(parse_args(["--config", SMOKE, "--output_dir", str(out)]), 8)
    script = ["python", "scripts/push_to_hub.py", str(out)]
    assert shlex.split(str(refused.value).rsplit("`", 2)[1]) == [*script, "--repo-id", REPO]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the run's last lines: nothing pushed, and how to push it
    args = ["--push_to_hub", "true", "--hub_model_id", REPO, "--push_checkpoints", "true", "--hub_token", SECRET]
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), *args])
    publish.push_final(out, hub_module.take_push_settings(recipe), recipe.training)
    printed = capsys.readouterr().out
    assert shlex.split(printed.rsplit("`", 2)[1]) == [*script, "--repo-id", REPO, "--checkpoints"], printed

    sealed_checkpoint(out / "checkpoint-2")  # still on disk: the command pushes it later
    CheckpointPusher(REPO, SECRET, None, out)._failed(2, 1, "500")  # a checkpoint's upload that failed
    warned = capsys.readouterr().err
    assert shlex.split(warned.split("`")[1]) == [*script, "--checkpoints"], warned


def test_a_failing_final_push_is_retried_then_recorded(hub, tmp_path, monkeypatch, tiny_model_dir):
    import shutil

    from huggingface_hub.errors import HfHubHTTPError

    from dpotrain.hub.hub import push_run

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    (run / "run_complete.json").write_text('{"global_step": 7}')
    hub.state.fail[("create_repo", None)] = -1  # no retry of huggingface_hub's own there: only this project's
    with pytest.raises(HfHubHTTPError, match="500"):
        push_run(run, REPO, token=SECRET)
    started, record = read_pushes(run)  # its start, then its outcome: a push neither confirmed (unconfirmed_push)
    assert (started["branch"], started["status"], started["repo"]) == ("main", "started", REPO)
    assert (record["branch"], record["step"], record["status"], record["attempts"]) == ("main", 7, "failed", 2)
    assert len(hub.state.of("create_repo")) == 2 and hub.state.commits == []
    assert unconfirmed_push(run) == record


def test_a_refused_connection_is_retried_under_either_http_library_of_huggingface_hub():
    """huggingface_hub 2 sends with httpx2 (requirements.txt), 1.x with httpx (the lent GPU machine's 1.33): a
    connection refused by either is worth another attempt, a programming error is not."""
    import httpx2

    from dpotrain.hub.hub_push import is_transient

    httpx = pytest.importorskip("httpx", reason="httpx (huggingface_hub 1.x's HTTP library) is not installed")

    assert is_transient(httpx2.ConnectError("refused")) and is_transient(httpx.ConnectError("refused"))
    assert is_transient(TimeoutError()) and not is_transient(ValueError("a bug"))


@pytest.mark.parametrize("spelling", [["--hub-token", SECRET], [f"--hub-token={SECRET}"]])
def test_the_dashed_token_flag_reaches_no_printed_command(monkeypatch, spelling):
    # HfArgumentParser takes --hub-token as well as --hub_token: the command a refusal or a requeue prints, and the
    # argv W&B records, must hide it under either spelling.
    from dpotrain.hub import hub
    from dpotrain.recipe.config import parse_args

    argv = ["train_dpo.py", "--config", SMOKE, "--push_to_hub", *spelling]
    monkeypatch.setattr("sys.argv", argv)
    recipe = parse_args(argv[1:])
    assert recipe.training.hub_token == SECRET
    assert SECRET not in " ".join(recipe.command_line)
    assert hub.take_push_settings(recipe).token == SECRET
    assert SECRET not in " ".join(argv)


def test_a_push_uploads_the_runs_own_files_never_a_persons_files_in_its_folder(hub, tmp_path, monkeypatch):
    """After training, a person keeps notes, an evaluation and a .env (HF_TOKEN=...) in the run's folder; the final push
    and scripts/push_to_hub.py uploaded the whole folder but IGNORE, so all three reached the (maybe public) repo. The
    run owns only the files it recorded (run_files.json): those, and what lies under them, are uploaded."""

    from dpotrain.hub import hub as hub_module
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    own = ["config.json", "model.safetensors", "README.md", "run_complete.json", "merged/model.safetensors"]
    for name in own:
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text("{}" if name.endswith(".json") else name)
    run_files.write(
        run, [run_files.MANIFEST, "config.json", "model.safetensors", "README.md", "run_complete.json", "merged"]
    )
    mine = {".env": f"HF_TOKEN={SECRET}\n", "notes.txt": "lr 1e-6 looked best", "eval/scores.json": "{}"}
    for name, text in mine.items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(text)
    hub_module.push_run(run, REPO, token=SECRET)
    assert sorted(set(hub.state.repos[REPO]["main"]) - {".gitattributes"}) == sorted(own)  # run_files.json: IGNORE
    # What push_to_hub.py compares with main before it pushes again: the same files
    assert hub_push.local_files(run, hub_module.IGNORE, allow=hub_module.own_files(run)) == sorted(own)
    assert all((run / name).read_text() == text for name, text in mine.items())  # left where they are


def test_a_persons_files_inside_the_runs_merged_folder_are_never_pushed(hub, tmp_path, monkeypatch):
    """A LoRA run with merge_lora: a person evaluates the merged model and keeps the results beside it (merged/notes.md,
    merged/lm_eval/results.json). `merged` is the run's name in run_files.json, and everything under it went to main
    with `push_to_hub.py` later. In a folder of the run's, only the final model's files (run_complete.json's
    model_files) go."""
    import hashlib

    from dpotrain.hub import hub as hub_module
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    (run / "merged").mkdir(parents=True)
    model = ["adapter_config.json", "adapter_model.safetensors", "merged/config.json", "merged/model.safetensors"]
    for name in [*model, "README.md", "tokenizer_config.json"]:
        (run / name).write_text("{}" if name.endswith(".json") else name)
    saved = {
        n: {"bytes": (run / n).stat().st_size, "sha256": hashlib.sha256((run / n).read_bytes()).hexdigest()}
        for n in model
    }
    (run / "run_complete.json").write_text(json.dumps({"global_step": 2, "model_files": saved}))
    own = [*model, "README.md", "run_complete.json", "tokenizer_config.json"]
    run_files.write(run, [run_files.MANIFEST, *{n.split("/")[0] for n in own}])
    mine = {"merged/notes.md": "lr 1e-6 looked best", "merged/lm_eval/results.json": '{"acc": 0.5}'}
    for name, text in mine.items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(text)
    hub_module.push_run(run, REPO, token=SECRET)
    assert sorted(set(hub.state.repos[REPO]["main"]) - {".gitattributes"}) == sorted(own)
    assert hub_push.local_files(run, hub_module.IGNORE, allow=hub_module.own_files(run)) == sorted(own)
    assert all((run / name).read_text() == text for name, text in mine.items())  # left where they are


def test_a_persons_checkpoint_in_the_run_folder_is_never_pushed(hub, tmp_path, monkeypatch):
    """A person copies a checkpoint of another run into this run's folder to compare (rotation keeps it: not the
    run's). A resumed run's pusher and push_to_hub.py --checkpoints pushed it as this run's step-1 branch, to a repo
    that may be public. Only the checkpoints run_files.json names go."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    for name in ("checkpoint-1", "checkpoint-2"):
        sealed_checkpoint(run / name)
    run_files.write(run, [run_files.MANIFEST, "checkpoint-2"])  # checkpoint-1 is the person's copy
    submitted = []
    pusher = hub_push.CheckpointPusher(REPO, SECRET, None, run)
    monkeypatch.setattr(pusher, "submit", submitted.append)
    pusher.on_train_begin(None, SimpleNamespace(is_world_process_zero=True), None)  # a resumed run's first pushes
    assert submitted == [run / "checkpoint-2"]
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO, exist_ok=True)
    assert [r["branch"] for r in hub_push.push_checkpoints(api, run, REPO)] == [hub_push.branch_name(2)]
    assert hub_push.branch_name(1) not in hub.state.repos[REPO]


def test_a_pushed_checkpoint_whose_record_cannot_be_written_is_not_said_pushed_nor_unpushed(
    hub, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """push_to_hub.py --checkpoints: the branch went up, then hub_pushes.jsonl could not be written (a full disk, a
    read-only folder). That error ends the command in one line, saying the branch went up, that its record was not
    written and how to record it. It printed "Pushed checkpoint-2" first (the record disagreeing), then "pushing ...
    failed"; before a119055 it also said "checkpoint-2 was not pushed" of a branch the Hub holds."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import push_command
    from dpotrain.recipe.errors import RunError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", "{}")]:
        (run / name).write_text(text)
    sealed_checkpoint(run / "checkpoint-2")
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    (run / PUSH_RECORD).mkdir()  # no record can be written there, at any attempt
    script = push_script(hub, monkeypatch)
    with pytest.raises(RunError) as ended, mock.patch.dict(os.environ):  # main reads .env into the environment
        script.main([str(run), "--repo-id", REPO, "--checkpoints"])
    assert "step-2" in hub.state.repos[REPO] and "model.safetensors" not in hub.state.repos[REPO]["main"]
    assert str(ended.value) == (
        f"checkpoint-2 went up to {REPO}@step-2, but its record could not be written (IsADirectoryError: [Errno 21] "
        f"Is a directory: '{run / PUSH_RECORD}'): make room on that disk or make the folder writable, then run "
        f"`{push_command(run, '--repo-id', REPO, '--checkpoints')}`, which finds it on the Hub and records it"
    )
    said = capsys.readouterr()
    assert "Pushed" not in said.out and "not pushed" not in said.err, said


@pytest.mark.parametrize(
    "steps, said",
    [
        ([2], "1 checkpoint on disk is not pushed: add --checkpoints to push it to a branch"),
        ([2, 4], "2 checkpoints on disk are not pushed: add --checkpoints to push them to branches"),
    ],
)
def test_the_checkpoints_left_unpushed_are_counted_in_their_number(
    steps, said, hub, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """push_to_hub.py without --checkpoints of a run with one checkpoint printed "1 checkpoint(s) on disk are not
    pushed: add --checkpoints to push them to branches step-<N>"."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", "{}")]:
        (run / name).write_text(text)
    for step in steps:
        sealed_checkpoint(run / f"checkpoint-{step}")
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ):  # main reads .env into the environment
        script.main([str(run), "--repo-id", REPO])
    assert f"{said} step-<N>\n" in capsys.readouterr().out


def test_checkpoints_the_run_pushed_are_not_said_unpushed(hub, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """A run that pushed its checkpoints itself (push_checkpoints: true), its main push failed: push_to_hub.py without
    --checkpoints said "2 checkpoints on disk are not pushed: add --checkpoints", counting every checkpoint on disk
    whatever hub_pushes.jsonl records. Only those not recorded on the repo pushed to are counted."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import record_checkpoint
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", "{}")]:
        (run / name).write_text(text)
    for step in (2, 4):
        sealed_checkpoint(run / f"checkpoint-{step}")
    run_files.write(run, [run_files.MANIFEST, PUSH_RECORD, *sorted(p.name for p in run.iterdir())])
    record_checkpoint(run, REPO, 2, "pushed", attempts=1, commit="c2")
    record_checkpoint(run, REPO, 4, "pushed", attempts=1, commit="c4")
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ):  # main reads .env into the environment
        script.main([str(run), "--repo-id", REPO])
    assert "not pushed" not in capsys.readouterr().out
    with mock.patch.dict(os.environ):  # to another repo, which the records say holds none of them
        script.main([str(run), "--repo-id", "me/other"])
    assert "2 checkpoints on disk are not pushed: add --checkpoints" in capsys.readouterr().out


def test_the_runs_pushes_whose_record_cannot_be_written_say_they_went_up(
    hub, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """In the run, hub_pushes.jsonl cannot be written (a full disk). The pusher said "Pushed checkpoint-1", then
    "checkpoint-1 was not pushed", and its thread died on the record of that, leaving checkpoint-2 unpushed for `finish`
    to wait on; the final push said "pushing ... failed" of a run the Hub holds. Each says what went up and that its
    record was not written, and the pusher goes on to the next checkpoint."""
    import shutil

    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain import publish
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub import hub_push
    from dpotrain.hub.hub_push import CheckpointPusher, push_command
    from dpotrain.recipe.config import parse_args

    hub_in_process(hub, monkeypatch)
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)
    (out / "run_complete.json").write_text('{"global_step": 2}')
    for step in (1, 2):
        sealed_checkpoint(out / f"checkpoint-{step}")
    (out / PUSH_RECORD).mkdir()  # no record can be written there, at any attempt
    pusher = CheckpointPusher(REPO, SECRET, None, out)
    for step in (1, 2):
        pusher.on_save(None, TrainerState(global_step=step, is_world_process_zero=True), None)
    assert pusher.finish(30) == [] and {"step-1", "step-2"} <= set(hub.state.repos[REPO])
    said = capsys.readouterr()
    assert "Pushed" not in said.out and "not pushed" not in said.err, said
    for step in (1, 2):
        assert (
            f"warning: checkpoint-{step} went up to {REPO}@step-{step}, but its record could not be written" in said.err
        )

    def unwritable():  # the final push's start is recorded, its upload goes through, its record cannot be written
        (out / PUSH_RECORD).rename(out / "started.jsonl")
        (out / PUSH_RECORD).mkdir()

    (out / PUSH_RECORD).rmdir()
    hub.state.hold[("commit", "main")] = unwritable
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_model_id", REPO])
    with pytest.raises(hub_push.UnrecordedPush) as ended:  # run_command's one `error:` line
        publish.push_final(out, hub_module.take_push_settings(recipe), recipe.training)
    assert "model.safetensors" in hub.state.repos[REPO]["main"]
    assert str(ended.value).startswith(f"{out} went up to {REPO}, but its record could not be written ("), ended
    assert f"then run `{push_command(out, '--repo-id', REPO)}`, which finds" in str(ended.value)
    assert "Pushed" not in capsys.readouterr().out


def test_a_final_push_the_hub_fails_ends_a_launched_run_on_its_own_error_line(hub, tmp_path, monkeypatch, capsys):
    """The final push failing past the retries ended the run by SystemExit, which left no `<stop file>.refused` for
    scripts/launch.sh: the job's last line was "training failed with exit code 1: srun stopped every node ... its
    traceback is above that", of a run that trained to its end, with no traceback and no node failed. Now the run's
    own one `error:` line, marked for launch.sh as a refusal is, naming the push_to_hub.py command."""
    from dpotrain import publish
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe import errors
    from dpotrain.recipe.config import parse_args

    hub_in_process(hub, monkeypatch)
    monkeypatch.setattr("sys.argv", ["train_dpo.py"])
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text('{"global_step": 2}\n')
    (out / "config.json").write_text("{}")
    hub.state.fail[("commit", "main")] = -1
    hub.state.fail_status = 400  # not retried
    mark = tmp_path / "stop.refused"  # what launch.sh reads (preemption.GracefulStop.from_env, under a launcher)
    monkeypatch.setattr(errors, "_ONE_LINE_MARK", [str(mark)])
    args = ["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_model_id", REPO]
    recipe = parse_args([*args, "--hub_token", SECRET])
    with pytest.raises(SystemExit) as ended:
        errors.run_cli(lambda: publish.push_final(out, hub_module.take_push_settings(recipe), recipe.training))
    line = f"error: pushing {out} to {REPO} failed (BadRequestError: "
    assert ended.value.code == 1
    assert capsys.readouterr().err.startswith(line) and mark.read_text().startswith(line)
    assert "the run is saved, push it with `python " in mark.read_text() and SECRET not in mark.read_text()


@pytest.mark.parametrize("refused_at", ["create", "commit"])
def test_a_token_revoked_during_training_is_said_at_the_final_push_with_its_fix_first(
    hub, tmp_path, monkeypatch, tiny_model_dir, refused_at
):
    """The token revoked during training: the final push's 401 (at the repo's creation, or at the commit) ended the
    run on "pushing ... failed (...); the run is saved, push it with `push_to_hub.py ...`", a command that fails the
    same way until the token is replaced. As for a refused card: the fix first (the invalid token's own line, naming
    where the token came from), then the command."""
    import shutil

    from dpotrain import publish
    from dpotrain.cluster import offline
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.errors import RunError
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    monkeypatch.setenv("HF_TOKEN", SECRET)  # the environment's: its line says to export a new one
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    (run / "run_complete.json").write_text("{}")
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    if refused_at == "create":
        hub.state.create_status[REPO.split("/")[0]] = 401
    else:
        hub.state.fail[("commit", "main")] = -1
        hub.state.fail_status, hub.state.fail_error = 401, "Invalid credentials in Authorization header"
    push = hub_module.PushSettings(True, REPO, None, False, SECRET, None)
    with pytest.raises(RunError) as said:
        publish.push_final(run, push, SimpleNamespace(save_total_limit=None))
    command = push_command(run, "--repo-id", REPO)
    fix = offline.invalid_token(SECRET)
    assert fix.startswith("the Hugging Face token in HF_TOKEN, set in the environment, is invalid or expired: ")
    assert str(said.value) == f"{fix}, then push it with `{command}`; the run is saved and main was not pushed"
    assert SECRET not in str(said.value)
    assert "model.safetensors" not in hub.state.repos.get(REPO, {}).get("main", {})  # main was not pushed


def test_a_push_to_a_repo_holding_an_earlier_model_replaces_that_model(hub, tmp_path, monkeypatch):
    """A repo's main held an earlier run's model (one model.safetensors, or a LoRA adapter); the push of a sharded model
    left those files beside the new shards, and `from_pretrained(repo)` loaded them, not the model pushed: transformers
    takes model.safetensors before an index, and adapter_config.json makes the repo an adapter. The push replaces the
    model's files on main (history keeps the old ones) and leaves the repo's other files alone."""

    from dpotrain.hub import hub as hub_module
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)

    def run_folder(name, files):
        run = tmp_path / name
        for file in files:
            (run / file).parent.mkdir(parents=True, exist_ok=True)
            (run / file).write_text(f"{name} {file}")
        run_files.write(run, [run_files.MANIFEST, *files])
        return run

    earlier = ["config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors", "README.md"]
    hub_module.push_run(run_folder("earlier", [*earlier, "eval_results.json"]), REPO, token=SECRET)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    hub_module.push_run(run_folder("later", ["config.json", *shards, "README.md"]), REPO, token=SECRET)
    main = hub.state.repos[REPO]["main"]
    assert sorted(set(main) - {".gitattributes"}) == sorted(["config.json", *shards, "README.md", "eval_results.json"])
    assert all(main[name] == f"later {name}".encode() for name in ["config.json", *shards])


def test_another_runs_checkpoint_on_a_branch_is_not_taken_for_this_runs(hub, tmp_path, monkeypatch, capsys):
    """Two runs of one base model pushed to one repo (a recipe's hub_model_id, kept): run A's branch step-2 holds files
    of the same names and sizes as run B's checkpoint-2 (one architecture, config and tokenizer). push_to_hub.py
    --checkpoints of run B compared sizes alone: it said 'Skipped checkpoint-2: ... already holds it', recorded it as
    on the Hub, and the card listed run A's weights as run B's step 2. The Hub keeps *.safetensors in LFS (the
    stand-in says so, with their SHA-256, as the Hub's tree does)."""
    from huggingface_hub import HfApi, constants

    from dpotrain.hub import hub_push
    from dpotrain.train import checkpoint_manifest, run_files
    from dpotrain.train.checkpoints import MARKER

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")

    def run_with_checkpoint(name: str, weights: bytes) -> Path:
        folder = tmp_path / name / "checkpoint-2"
        folder.mkdir(parents=True)
        for file, content in {"model.safetensors": weights, "config.json": b"{}", "optimizer.pt": b"o"}.items():
            (folder / file).write_bytes(content)
        checkpoint_manifest.seal(folder, MARKER, "{}\n", is_main=True, model=["model.safetensors", "config.json"])
        run_files.write(folder.parent, [run_files.MANIFEST, folder.name])
        return folder.parent

    run_a, run_b = run_with_checkpoint("a", b"weights of run A"), run_with_checkpoint("b", b"weights of run B")
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO, exist_ok=True)
    hub_push.push_checkpoints(api, run_a, REPO)
    [record] = hub_push.push_checkpoints(api, run_b, REPO)
    assert record["status"] == "pushed", capsys.readouterr().out
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"weights of run B"
    [again] = hub_push.push_checkpoints(api, run_b, REPO)  # what the branch holds now is this run's: skipped
    assert again["status"] == "present" and len(hub.state.commits) == 2
    assert (record["repo"], again["repo"]) == (REPO, REPO)  # each names the repo it is on: `pushed_revisions`
    assert f"Skipped checkpoint-2: {REPO}@step-2 already holds it" in capsys.readouterr().out


def test_a_checkpoint_branch_whose_upload_fails_holds_no_other_model(hub, tmp_path, monkeypatch):
    """A repo whose main holds an earlier run's model (a recipe's hub_model_id, kept); checkpoint-2's commit keeps
    failing. Its branch was forked from main before the commit, so the failed push left step-2 holding the earlier
    model: `from_pretrained(repo, revision="step-2")` loaded it, silently, and once rotation deleted checkpoint-2 no
    push could replace it. A checkpoint's branch starts from the repo's first commit, which holds no model."""
    from huggingface_hub import HfApi, constants

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")
    run = tmp_path / "run"
    sealed_checkpoint(run / "checkpoint-2")
    run_files.write(run, [run_files.MANIFEST, "checkpoint-2"])
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO, exist_ok=True)
    api.upload_file(path_or_fileobj=b"an earlier model", path_in_repo="model.safetensors", repo_id=REPO)
    # A failure nothing retries: what the branch holds after it is the point, not the retries (~10 s of waits under a
    # 500; test_checkpoints_go_to_branches_and_a_failing_one_does_not_fail_the_run retries a 500 to its end).
    hub.state.fail_status = 400
    hub.state.fail[("commit", "step-2")] = -1
    [failed] = hub_push.push_checkpoints(api, run, REPO)
    assert (failed["status"], failed["repo"]) == ("failed", REPO)
    assert set(hub.state.repos[REPO]["step-2"]) == {".gitattributes"}, "the branch holds another model"
    del hub.state.fail[("commit", "step-2")]
    [pushed] = hub_push.push_checkpoints(api, run, REPO)  # the same command again: the branch gets the checkpoint
    assert pushed["status"] == "pushed"
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert hub.state.repos[REPO]["main"]["model.safetensors"] == b"an earlier model"


def squashed_repo_with_a_model(hub, api) -> None:
    """REPO's main holding a sharded model and a card, its history squashed into one commit (`super_squash_history`,
    which users run to save space): the repo's first commit holds that model."""
    api.create_repo(REPO, exist_ok=True)
    for name in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "README.md", "config.json"]:
        api.upload_file(path_or_fileobj=f"main's {name}".encode(), path_in_repo=name, repo_id=REPO)
    api.super_squash_history(REPO)
    assert len(api.list_repo_commits(REPO)) == 1


def test_a_checkpoint_branch_of_a_squashed_repo_holds_the_checkpoint_alone(hub, tmp_path, monkeypatch):
    """A squashed repo's first commit holds main's model, so a new step-N branch starts with it: the upload must leave
    the branch holding the checkpoint's files alone (no shard of main's beside its model.safetensors), and an upload
    that fails must leave no model there at all (it left main's, which `from_pretrained(repo, revision="step-2")`
    loaded as step 2's, while the whole checkpoint went up before the commit that replaced it)."""
    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    sealed_checkpoint(run / "checkpoint-2")
    run_files.write(run, [run_files.MANIFEST, "checkpoint-2"])
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    squashed_repo_with_a_model(hub, api)
    hub.state.fail_status = 400  # retried or not, a failed upload leaves the same branch: ~20 s of waits less
    hub.state.fail[("preupload", "step-2")] = -1  # the checkpoint's upload fails
    [failed] = hub_push.push_checkpoints(api, run, REPO)
    assert failed["status"] == "failed"
    assert set(hub.state.repos[REPO]["step-2"]) == {".gitattributes"}, "the branch holds main's model"
    del hub.state.fail[("preupload", "step-2")]
    [pushed] = hub_push.push_checkpoints(api, run, REPO)
    assert pushed["status"] == "pushed"
    assert set(hub.state.repos[REPO]["step-2"]) == {".gitattributes", "model.safetensors"}
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert "README.md" in hub.state.repos[REPO]["main"]  # main keeps its files
    hub.state.fail[("commit", "step-4")] = -1  # even the commit emptying a new branch fails: no branch is left
    sealed_checkpoint(run / "checkpoint-4")
    run_files.write(run, [run_files.MANIFEST, "checkpoint-2", "checkpoint-4"])
    assert [r["status"] for r in hub_push.push_checkpoints(api, run, REPO)] == ["present", "failed"]
    assert "step-4" not in hub.state.repos[REPO]


def test_a_branch_another_push_made_meanwhile_keeps_its_checkpoint(hub, tmp_path, monkeypatch):
    """Two pushes of one new step-N at once (a requeued job pushing what it left, `push_to_hub.py --checkpoints` typed
    on the login node): the second saw no branch, then found the first's and emptied it, as if it held main's model,
    so the branch held no model until its own upload went through; one that then failed left it empty, or deleted it,
    while the first's record (and the card) said it was on the Hub."""
    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    folder = sealed_checkpoint(run / "checkpoint-2")
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    hub_push.push_checkpoint(api, REPO, folder, 2, run)  # the first push, whole
    hub_push.new_branch(api, REPO, "step-2")  # the second, which read the branch list before the first made it
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"


def test_only_a_new_checkpoint_branch_reads_the_repos_history(hub, tmp_path, monkeypatch):
    """The base of a new branch is the repo's first commit, which takes listing main's whole history (pages of it in a
    repo pushed to often); a push to a branch that exists (a push again, a rerun's) needs no base."""
    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.checkpoints import MARKER

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    folder = sealed_checkpoint(run / "checkpoint-2")
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    hub_push.push_checkpoint(api, REPO, folder, 2, run)
    assert len(hub.state.of("commits")) == 1
    (folder / "model.safetensors").write_text("trained further\n")
    checkpoint_manifest.seal(folder, MARKER, "{}\n", is_main=True, model=["model.safetensors"])  # saved again
    hub_push.push_checkpoint(api, REPO, folder, 2, run)
    assert len(hub.state.of("commits")) == 1, "the repo's history was listed for a branch that exists"
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"trained further\n"


def test_the_runs_pusher_and_push_to_hub_push_a_checkpoint_alike(hub, tmp_path, monkeypatch, capsys):
    """The run's pusher and push_to_hub.py --checkpoints each had their own checks and their own records: a checkpoint
    whose weights were cut short after its save (sizes no longer those of its manifest) went up as that step's model,
    and the records of one push held their keys in three orders. One check, one record shape, for both."""
    from huggingface_hub import HfApi
    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    runs = {"by the run": tmp_path / "a", "by push_to_hub.py": tmp_path / "b"}
    for run in runs.values():
        for step in (2, 4):
            sealed_checkpoint(run / f"checkpoint-{step}")
        (run / "checkpoint-4" / "model.safetensors").write_text("cut")  # since its save: 18 bytes were written
        run_files.write(run, [run_files.MANIFEST, "checkpoint-2", "checkpoint-4"])
    pusher = hub_push.CheckpointPusher(REPO, SECRET, None, runs["by the run"])
    for step in (2, 4):
        pusher.on_save(None, TrainerState(global_step=step, is_world_process_zero=True), None)
    assert pusher.finish(60) == []
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo("me/other")
    hub_push.push_checkpoints(api, runs["by push_to_hub.py"], "me/other")

    def shape(run):  # each record's keys in order, and what it says, by step
        records = sorted(read_pushes(run), key=lambda r: r["step"])
        return [(list(r), r["branch"], r["status"], r.get("error")) for r in records]

    assert shape(runs["by the run"]) == shape(runs["by push_to_hub.py"])
    [(_, _, _, error)] = [s for s in shape(runs["by the run"]) if s[2] == "failed"]
    assert error == "model.safetensors has 3 bytes, 18 were saved (cut short or replaced)"
    for repo in (REPO, "me/other"):
        assert "step-2" in hub.state.repos[repo] and "step-4" not in hub.state.repos[repo]
    said = capsys.readouterr().err
    assert f"checkpoint-4 was not pushed to {REPO}@step-4 (model.safetensors has 3 bytes" in said
    assert "checkpoint-4 was not pushed to me/other@step-4: model.safetensors has 3 bytes" in said


def test_a_stopped_runs_checkpoints_go_to_their_branches_and_main_waits_for_the_finished_model(
    hub, tmp_path, monkeypatch, capsys
):
    """A run stopped for requeue (exit 75) leaves a complete checkpoint and no final model. push_to_hub.py, with or
    without --checkpoints, refused it as "not a finished run: missing run_complete.json (...), config.json, ...,
    README.md, training_curves.png": its checkpoint could not reach the Hub until the run had finished. --checkpoints
    pushes it to its branch and says that the run has not finished (main stays as it was); without it, one line names
    the flag."""
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"  # what a stop leaves: the record, the metrics so far, the checkpoint it wrote
    sealed_checkpoint(run / "checkpoint-4")
    (run / "resolved_config.json").write_text(json.dumps({"hub_model_id": REPO, "run_name": "run"}))
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 0.69}\n')
    run_files.write(run, [run_files.MANIFEST, "resolved_config.json", "metrics.jsonl", "checkpoint-4"])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:  # main reads .env into the environment
        script.main([str(run)])
    assert str(refused.value) == (
        f"{run} has not finished training (no run_complete.json): resume it with the same command, then push it; add "
        "--checkpoints to push checkpoint-4 now, to branch step-4 (main gets only a finished model)"
    )
    assert not hub.state.commits
    with mock.patch.dict(os.environ):
        script.main([str(run), "--checkpoints"])
    assert sorted(hub.state.repos[REPO]) == ["main", "step-4"]
    assert hub.state.repos[REPO]["step-4"]["model.safetensors"] == b"model.safetensors\n"
    assert set(hub.state.repos[REPO]["main"]) == {".gitattributes"}  # no model, no card: the run has not finished
    assert f"{run} has not finished training (no run_complete.json): only its checkpoints are pushed" in (
        capsys.readouterr().out
    )
    assert [(r["branch"], r["status"]) for r in read_pushes(run)] == [("step-4", "pushed")]


def test_a_run_a_health_guard_stopped_is_not_told_to_resume_with_the_same_command(hub, tmp_path, monkeypatch, capsys):
    """A run a health guard stopped (exit 3: its checkpoint, health_stop.json, no final model): push_to_hub.py said
    "resume it with the same command, then push it", a command the run itself refuses after such a stop (resuming would
    train on the values it stopped on). Both lines now say what stopped it and the rerun its stop named."""
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    sealed_checkpoint(run / "checkpoint-4")
    (run / "resolved_config.json").write_text(json.dumps({"hub_model_id": REPO, "run_name": "run"}))
    (run / "health_stop.json").write_text(json.dumps({"guard": "margin", "step": 4, "message": "...", "fatal": False}))
    run_files.write(run, [run_files.MANIFEST, "resolved_config.json", "health_stop.json", "checkpoint-4"])
    script = push_script(hub, monkeypatch)
    stopped = (
        f"the margin guard stopped it at step 4 ({run}/health_stop.json), and the same command is refused: fix the "
        "cause the stop named, then rerun it with --overwrite_output_dir to start afresh (or with --health_action "
        "warn to go on from its checkpoint)"
    )
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
        script.main([str(run)])
    assert str(refused.value) == (
        f"{run} has not finished training (no run_complete.json): {stopped}; add --checkpoints to push checkpoint-4 "
        "now, to branch step-4 (main gets only a finished model)"
    )
    with mock.patch.dict(os.environ):
        script.main([str(run), "--checkpoints"])
    said = capsys.readouterr().out
    assert "with the same command" not in said, said
    assert (
        f"{run} has not finished training (no run_complete.json): only its checkpoints are pushed (to branches of "
        f"{REPO}), main is left as it was; {stopped}; once it has finished, run this command again" in said
    ), said
    (run / "health_stop.json").write_text(json.dumps({"guard": "nonfinite", "step": 4, "fatal": True}))
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
        script.main([str(run)])
    assert "the nonfinite guard stopped it at step 4" in str(refused.value)
    assert "start afresh; add --checkpoints" in str(refused.value) and "health_action" not in str(refused.value)


def test_a_run_a_health_guard_stopped_before_any_checkpoint_is_not_told_to_resume(hub, tmp_path, monkeypatch):
    """A run the nonfinite guard stopped before its first checkpoint (that guard writes none from a non-finite state)
    has nothing push_to_hub.py can push: it said "missing run_complete.json (training has not finished: resume it with
    the same command)", a command the run refuses after such a stop. It now names the guard and the rerun."""
    from unittest import mock

    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps({"hub_model_id": REPO, "run_name": "run"}))
    (run / "health_stop.json").write_text(json.dumps({"guard": "nonfinite", "step": 2, "fatal": True}))
    run_files.write(run, [run_files.MANIFEST, "resolved_config.json", "health_stop.json"])
    script = push_script(hub, monkeypatch)
    for args in ([str(run)], [str(run), "--checkpoints"]):
        with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
            script.main(args)
        assert str(refused.value) == (
            f"{run} has not finished training (no run_complete.json) and has no checkpoint to push: the nonfinite "
            f"guard stopped it at step 2 ({run}/health_stop.json), and the same command is refused: fix the cause the "
            "stop named, then rerun it with --overwrite_output_dir to start afresh"
        )
    assert not hub.state.project_requests()  # refused before the Hub is asked


def test_a_checkpoint_is_hashed_once_per_push_against_its_manifest(hub, tmp_path, monkeypatch, capsys):
    """A push took each checkpoint file's SHA-256 from its manifest to compare with the Hub's, but never checked the
    file against it: weights damaged after the save (a bad disk block: the same size) went up as that step's model. The
    push hashes each file once, refuses one that differs from its manifest before any branch is made, and hands the
    digest to the upload (which otherwise hashes the file itself)."""
    from huggingface_hub import HfApi
    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import checkpoint_manifest, run_files

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    folder = sealed_checkpoint(run / "checkpoint-2")
    run_files.write(run, [run_files.MANIFEST, "checkpoint-2"])
    names = hub_push.checkpoint_files(folder)
    listed = checkpoint_manifest.read(folder)
    adds = hub_push.verified_additions(folder, names)
    assert [(a.path_in_repo, a.upload_info.is_hashed) for a in adds] == [(n, True) for n in names]
    assert [a.upload_info.sha256.hex() for a in adds] == [listed[n]["sha256"] for n in names]

    (folder / "model.safetensors").write_text("model.safetensorZ\n")  # one byte flipped, the size kept
    said = "model.safetensors does not match its SHA-256 in MANIFEST.json (damaged after it was saved)"
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    [record] = hub_push.push_checkpoints(api, run, REPO)
    assert (record["status"], record["error"]) == ("failed", said)
    pusher = hub_push.CheckpointPusher(REPO, SECRET, None, run)
    pusher.on_save(None, TrainerState(global_step=2, is_world_process_zero=True), None)
    assert pusher.finish(60) == []
    assert [(r["status"], r["error"]) for r in read_pushes(run)] == [("failed", said)] * 2
    assert "step-2" not in hub.state.repos[REPO] and not hub.state.commits
    assert f"checkpoint-2 was not pushed to {REPO}@step-2: {said}" in capsys.readouterr().err


@pytest.mark.slow  # a training run, push_to_hub.py, then the run's resume
def test_a_checkpoint_branch_holds_the_tokenizer_whole_and_a_record_of_pushes_changed_by_hand_is_refused_at_once(
    hub, tmp_path, tiny_model_dir
):
    """A tokenizer with several chat templates saves the named ones in additional_chat_templates/; a checkpoint's branch
    took the top-level files of a hand list alone, so `AutoTokenizer.from_pretrained(repo, revision="step-N")` loaded
    it without them. A branch holds what the checkpoint's model save wrote, that folder too, and still no optimizer,
    RNG or trainer state; the final push to main holds it as well.

    hub_pushes.jsonl with a line changed by hand (or by another program) was read only as push_to_hub.py made the
    card's list of branches, after each checkpoint had gone up (a 7B's: 15 GB each), and by a resumed run as its
    checkpoint pusher was built, on rank 0 alone while the other ranks went on to load the model. Both now read it
    first, and refuse it in the record's one line before anything uploads or loads. One run for both (each a
    training run with its checkpoints pushed)."""
    import shutil

    from transformers import AutoTokenizer

    from dpotrain.data import builtin

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = {"default": builtin.CHAT_TEMPLATE, "tool_use": "{{ bos_token }}" + builtin.CHAT_TEMPLATE}
    tokenizer.save_pretrained(model)
    out, result = train(hub, tmp_path, str(model), "--push_checkpoints", "true", "--save_steps", "2")
    assert result.returncode == 0, result.stdout[-3000:]
    templates = {"additional_chat_templates/tool_use.jinja"}
    for branch in ("step-4", "main"):
        files = hub.state.repos[REPO][branch]
        assert templates <= set(files), sorted(files)
        loaded = tmp_path / branch  # what from_pretrained(REPO, revision=branch) downloads: the branch's files
        for path, content in files.items():
            (loaded / path).parent.mkdir(parents=True, exist_ok=True)
            (loaded / path).write_bytes(content)
        assert AutoTokenizer.from_pretrained(loaded).chat_template == tokenizer.chat_template, branch
    assert set(hub.state.repos[REPO]["step-4"]) == MODEL_FILES | templates | {".gitattributes"}

    # The record of pushes with a line changed by hand: refused by push_to_hub.py, then by the resume, before anything
    # uploads or loads
    lines = (out / PUSH_RECORD).read_text().splitlines(keepends=True)
    (out / PUSH_RECORD).write_text("".join([lines[0][:20] + "\n", *lines[1:]]))
    commits = len(hub.state.commits)
    said = f"error: {out / PUSH_RECORD}: line 1 is not a JSON record ("

    pushed = subprocess.run(  # to another repo, which holds none of them yet
        [python(), str(ROOT / "scripts" / "push_to_hub.py"), str(out), "--checkpoints", "--repo-id", "me/other"],
        env={**os.environ, **env_for(hub, tmp_path, HF_TOKEN=SECRET)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pushed.returncode == 1 and pushed.stderr.splitlines()[-1].startswith(said), pushed.stderr
    assert "Pushed" not in pushed.stdout and len(hub.state.commits) == commits
    # The job killed after checkpoint-2, before its end: its resume refuses the record before anything loads
    asked = len(requests(hub))
    shutil.rmtree(out / "checkpoint-4")
    (out / "run_complete.json").unlink()
    _, resumed = train(hub, tmp_path, str(model), "--save_steps", "2", "--push_checkpoints", "true")
    assert resumed.returncode == 2 and resumed.stdout.strip().splitlines()[-1].startswith(said), resumed.stdout[-3000:]
    assert len(requests(hub)) == asked  # not a request more: refused before the write check


def test_a_checkpoint_whose_manifest_names_no_model_files_is_not_pushed(hub, tmp_path, monkeypatch, capsys):
    """A checkpoint saved before manifests named its model's files: nothing says which of its files the model's save
    wrote, so it is not pushed (a warning and a `failed` record), never pushed by a guess at its names."""
    from huggingface_hub import HfApi

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub_push
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    folder = sealed_checkpoint(run / "checkpoint-2")
    run_files.write(run, [run_files.MANIFEST, "checkpoint-2"])
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    del manifest["model"]
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    api = HfApi(endpoint=hub.endpoint, token=SECRET)
    api.create_repo(REPO)
    [record] = hub_push.push_checkpoints(api, run, REPO)
    said = "its MANIFEST.json does not say which files are its model's"
    assert (record["status"], record["error"]) == ("failed", said)
    assert "step-2" not in hub.state.repos[REPO]
    assert f"checkpoint-2 was not pushed to {REPO}@step-2: {said}" in capsys.readouterr().err


def mixed_run(tmp_path, tiny_model_dir, folder: str, stale: str) -> Path:
    """A finished run whose `folder` ("" or "merged/") holds the final model as 2 shards and an index, beside an
    earlier save's weights (`stale`: its model.safetensors, or a third shard), all recorded as the run's own files, as
    a job resumed before move_in removed them left them. Real weight files: the tiny model's, copied."""
    import shutil

    from dpotrain.train import run_files
    from dpotrain.train.metrics import PLOT_FILE

    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)
    for name, text in [("README.md", "# run\n"), (PLOT_FILE, "png"), ("run_complete.json", '{"global_step": 2}')]:
        (out / name).write_text(text)
    (out / "resolved_config.json").write_text(json.dumps({"hub_model_id": REPO, "run_name": "run"}))
    weights, model = out / folder, (out / "model.safetensors").read_bytes()
    weights.mkdir(exist_ok=True)
    (weights / "config.json").write_text((out / "config.json").read_text())
    (out / "model.safetensors").unlink()
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for shard in shards:
        (weights / shard).write_bytes(model)
    (weights / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    (weights / stale).write_bytes(model)  # the earlier save's
    if folder:  # the run's own model, whole
        (out / "model.safetensors").write_bytes(model)
    run_files.write(out, [run_files.MANIFEST, *(p.name for p in out.iterdir())])
    return out


@pytest.mark.parametrize(
    "folder, stale, named",
    [
        ("", "model.safetensors", "model.safetensors (written "),
        ("", "model-00003-of-00003.safetensors", "00003.safetensors, which model.safetensors.index.json does not"),
        ("merged/", "model.safetensors", "merged/model.safetensors (written "),
    ],
)
def test_a_run_folder_holding_an_earlier_saves_weights_is_refused_before_anything_uploads(
    hub, tmp_path, monkeypatch, tiny_model_dir, folder, stale, named
):
    """A job resumed before move_in removed an earlier attempt's weights (or a person's copy) left them beside the
    final model, recorded as the run's own: push_to_hub.py uploaded them all, and with a model.safetensors beside the
    index from_pretrained(repo) loaded that one, the earlier model; a shard no index names went up as dead weight. Now
    refused in one line naming the files, before the Hub is asked anything."""
    from dpotrain.recipe.errors import ConfigError

    out = mixed_run(tmp_path, tiny_model_dir, folder, stale)
    with pytest.raises(ConfigError) as info:
        push_script(hub, monkeypatch).main([str(out)])
    assert str(info.value).startswith(f"{out} holds weights of more than one save") and named in str(info.value)
    assert str(info.value).endswith("or rerun training into a new output_dir; then push again")
    assert requests(hub) == [] and hub.state.repos == {}


def test_a_rerun_completing_its_push_refuses_a_folder_holding_an_earlier_saves_weights(
    hub, tmp_path, monkeypatch, tiny_model_dir
):
    """The run's own final push (here a rerun completing the push a killed job started) makes the same check, before
    its upload: it pushed the earlier save's model.safetensors beside the final shards."""

    from dpotrain import publish, resolve
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import RunError

    hub_in_process(hub, monkeypatch)
    out = mixed_run(tmp_path, tiny_model_dir, "", "model.safetensors")
    record_push(out, step=2, branch="main", status="started", repo=REPO)
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--push_to_hub", "true", "--hub_token", SECRET])
    push = hub_module.take_push_settings(recipe)
    decision = resolve.check_output_dir(recipe, 8)
    with pytest.raises(RunError, match=r"holds weights of more than one save.*model\.safetensors \(written "):
        publish.complete_push(recipe, push, decision.push_left)
    assert hub.state.commits == [] and hub.state.repos == {}
    assert [r["status"] for r in read_pushes(out)] == ["started"]  # still left to push, once the folder is fixed


def test_a_final_push_the_run_recorded_as_started_and_then_refused_records_why(
    hub, tmp_path, monkeypatch, tiny_model_dir
):
    """The run records its final push as started before run_complete.json (a kill between the two is completed by
    the rerun); the push's own check of the folder then refused it (an earlier save's weights beside the final ones)
    before its try, so nothing recorded the outcome, and every rerun said "(the job was killed while pushing): pushing
    it now", which was never so. Now the refusal is recorded as the push's failure, with its cause. (Old code: the
    records ended on "started".)"""
    from dpotrain.hub import hub as hub_module
    from dpotrain.hub.hub_push import record_push
    from dpotrain.recipe.errors import ConfigError

    hub_in_process(hub, monkeypatch)
    out = mixed_run(tmp_path, tiny_model_dir, "", "model.safetensors")
    record_push(out, step=2, branch="main", status="started", repo=REPO)  # as publish.finish_outputs records it
    with pytest.raises(ConfigError, match="holds weights of more than one save"):
        hub_module.push_run(out, REPO, token=SECRET, started=True)
    records = read_pushes(out)
    assert [r["status"] for r in records] == ["started", "failed"], records
    assert "holds weights of more than one save" in records[-1]["error"] and hub.state.commits == []
    assert unconfirmed_push(out)["status"] == "failed"  # the rerun says the push failed, and why


def test_a_push_leaves_the_users_models_in_other_folders_of_the_repo(hub, tmp_path, monkeypatch):
    """A repo whose owner keeps other files of their own beside the run's: a quantized copy in `awq/`, an ONNX export,
    the original checkpoint. The push replaced an earlier model's weights "wherever they lie" (`*.safetensors`
    matches a path in any folder), so it deleted those too, leaving `awq/config.json` without its weights. It replaces
    weights where a run writes a model, the repo's top folder and `merged/`, and nothing elsewhere."""

    from dpotrain.hub import hub as hub_module
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    theirs = {
        "awq/config.json": b"{}",
        "awq/model.safetensors": b"awq weights",
        "onnx/model.bin": b"onnx",
        "original/pytorch_model.bin": b"original",
        "merged/model.safetensors": b"an earlier run's merged model",
        "model.safetensors": b"an earlier run's model",
    }
    hub.state.add_model_commit(REPO, theirs)
    run = tmp_path / "run"
    files = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    files += ["model.safetensors.index.json", "README.md"]
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    run_files.write(run, [run_files.MANIFEST, *files])
    hub_module.push_run(run, REPO, token=SECRET)
    main = hub.state.repos[REPO]["main"]
    kept = ["awq/config.json", "awq/model.safetensors", "onnx/model.bin", "original/pytorch_model.bin"]
    assert sorted(set(main) - {".gitattributes"}) == sorted([*files, *kept])
    assert all(main[name] == theirs[name] for name in kept)


def test_a_push_to_a_repo_holding_an_earlier_model_leaves_none_of_its_tokenizer(
    hub, tmp_path, monkeypatch, tiny_model_dir
):
    """A repo whose main held an earlier model saved by transformers 4 (the SFT model a DPO run starts from, pushed to
    one repo): its special_tokens_map.json, added_tokens.json and named chat templates stayed beside the run's
    tokenizer, as only weights were replaced, and `AutoTokenizer.from_pretrained(repo)` read them: another eos and pad
    token (generation never stops at the run's), a token added, another model's template. The push deletes them too, in
    the top folder and merged/, and leaves the owner's other files (a handler.py, a copy in awq/)."""
    import shutil

    from transformers import AutoTokenizer

    from dpotrain.hub import hub as hub_module
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    earlier = {
        "special_tokens_map.json": json.dumps({"eos_token": "<|im_start|>", "pad_token": "<|im_start|>"}).encode(),
        "added_tokens.json": json.dumps({"<earlier_token>": 100000}).encode(),
        "additional_chat_templates/tool_use.jinja": b"the earlier model's {{ messages }}",
        "merged/special_tokens_map.json": b"{}",
        "model.safetensors": b"an earlier run's model",
    }
    theirs = {"handler.py": b"# the owner's endpoint handler", "awq/special_tokens_map.json": b"{}"}
    hub.state.add_model_commit(REPO, {**earlier, **theirs})
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    (run / "README.md").write_text("card")
    pushed = sorted(p.name for p in run.iterdir())
    run_files.write(run, [run_files.MANIFEST, *pushed])
    hub_module.push_run(run, REPO, token=SECRET)

    main = hub.state.repos[REPO]["main"]
    assert sorted(set(main) - {".gitattributes"}) == sorted([*pushed, *theirs]), sorted(main)
    assert all(main[name] == content for name, content in theirs.items())
    loaded = tmp_path / "loaded"  # main's top folder, as from_pretrained(REPO) reads it
    for name, content in main.items():
        if "/" not in name or name.startswith("additional_chat_templates/"):
            (loaded / name).parent.mkdir(parents=True, exist_ok=True)
            (loaded / name).write_bytes(content)
    tokenizer, pushed = AutoTokenizer.from_pretrained(loaded), AutoTokenizer.from_pretrained(run)
    assert (tokenizer.eos_token, tokenizer.pad_token, len(tokenizer)) == (
        pushed.eos_token,
        pushed.pad_token,
        len(pushed),
    )
    assert tokenizer.chat_template == pushed.chat_template


def test_a_push_the_hub_refuses_part_way_never_leaves_main_with_half_a_model(hub, tmp_path, monkeypatch):
    """huggingface_hub's upload_folder (with hf_xet installed) commits in batches and, where a commit fails, splits it
    into smaller commits: a push of more than 20 files (a 32B model's shards, its tokenizer and the run's files) the
    Hub refused a few times went up in parts, the first deleting the earlier model's weights and adding 20 files, so
    main served 19 of 24 shards until the next part (never, were it refused). The push is one commit: every state main
    passes through holds one whole model."""

    from dpotrain.hub import hub as hub_module
    from dpotrain.train import run_files

    hub_in_process(hub, monkeypatch)
    hub.state.add_model_commit(REPO, {"config.json": b"earlier", "model.safetensors": b"earlier weights"})
    run = tmp_path / "run"
    shards = [f"model-{i:05d}-of-00024.safetensors" for i in range(1, 25)]
    files = ["config.json", *shards, "model.safetensors.index.json", "README.md"]
    run.mkdir()
    index = {"metadata": {}, "weight_map": {f"layer{i}": name for i, name in enumerate(shards)}}
    for name in files:
        (run / name).write_text(json.dumps(index) if name.endswith("index.json") else name)
    run_files.write(run, [run_files.MANIFEST, *files])
    hub.state.fail_status = 400  # refused, not an outage: neither huggingface_hub nor the project tries it again
    hub.state.fail[("commit", "main")] = 6  # upload_folder's sixth split of the failed commit is down to 20 files
    with contextlib.suppress(Exception):  # refused: the push is told so (and the rerun completes it)
        hub_module.push_run(run, REPO, token=SECRET)
    states = [files for _, _, files in hub.state.snapshots.values() if "config.json" in files]
    held = [sorted(name for name in state if name.startswith("model")) for state in states]
    assert all(names in (["model.safetensors"], [*shards, "model.safetensors.index.json"]) for names in held), held


def test_a_run_folder_written_before_runs_recorded_their_files_pushes_no_env_file(hub, tmp_path, monkeypatch):
    """A run folder from a version before run_files.json: push_to_hub.py uploads everything in it but IGNORE, and a
    `.env` with HF_TOKEN=... kept there (beside the notes the person wrote) went to the Hub, public where the repo is.
    No run writes a .env: it is never uploaded, whoever's folder it is."""

    from dpotrain.hub import hub as hub_module

    hub_in_process(hub, monkeypatch)
    run = tmp_path / "run"
    (run / "merged").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "README.md", "run_complete.json", ".env", "merged/.env.local"):
        (run / name).write_text(f"HF_TOKEN={SECRET}\n" if ".env" in name else "{}" if ".json" in name else name)
    assert hub_module.own_files(run) is None  # no record of the run's files: the older version's folder
    hub_module.push_run(run, REPO, token=SECRET)
    main = hub.state.repos[REPO]["main"]
    assert sorted(set(main) - {".gitattributes"}) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "run_complete.json",
    ]


@pytest.mark.slow
def test_no_path_of_the_training_machine_reaches_the_hub(hub, tmp_path, tiny_model_dir):
    """A run of a local model on a local data file (LoRA, merged, its checkpoint pushed too) uploads its record and its
    adapter's config as copies naming each local path by its last part, as the card does: the repo is often public, and
    the training machine's paths (its user's home, a site's project folder) mean nothing there. The run's folder keeps
    its record as written (a resume reads it), and push_to_hub.py compares the copies with the Hub's: the same run is
    not pushed again, a changed record is.

    The LoRA checkpoint's branch holds the adapter and the tokenizer, not PEFT's own model card that its save writes
    beside the adapter (README.md), whose `base_model` is the base's local path, which the Hub refuses in a card's
    metadata (transformers#33922); the run's own card goes to main."""
    from dpotrain.recipe import run_record

    data = tmp_path / "my-data" / "prefs.jsonl"
    data.parent.mkdir()
    data.write_bytes((ROOT / "data" / "smoke_prefs.jsonl").read_bytes())
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--merge_lora", "true"]
    args = ["--dataset_name", str(data), "--push_checkpoints", "true", "--save_steps", "4", *lora]
    out, result = train(hub, tmp_path, tiny_model_dir, *args)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (out / "checkpoint-4" / "README.md").is_file()  # PEFT's, in the checkpoint
    adapter = MODEL_FILES - {"config.json", "generation_config.json", "model.safetensors"}
    adapter |= {"adapter_config.json", "adapter_model.safetensors", ".gitattributes"}
    assert set(hub.state.repos[REPO]["step-4"]) == adapter

    local = {str(tmp_path), str(Path(tiny_model_dir).parent), str(ROOT), str(Path.home())}
    uploaded = {(c["revision"], name): content for c in hub.state.commits for name, content in c["files"].items()}
    checked = {("main", "resolved_config.json"), ("main", "merged/config.json"), ("step-4", "adapter_config.json")}
    assert checked <= uploaded.keys()
    leaked = {where: path for where, content in uploaded.items() for path in local if path.encode() in content}
    assert not leaked, leaked
    record = json.loads(uploaded["main", "resolved_config.json"])
    assert (record["model_name_or_path"], record["dataset_name"]) == (Path(tiny_model_dir).name, "prefs.jsonl")
    assert (record["output_dir"], record["config"]) == ("run", "smoke.yaml")
    replaced = set(record["local_paths_replaced"]["fields"])
    assert {"model_name_or_path", "dataset_name", "output_dir", "config"} <= replaced
    assert json.loads(uploaded["step-4", "adapter_config.json"])["base_model_name_or_path"] == Path(tiny_model_dir).name
    kept = json.loads((out / "resolved_config.json").read_text())
    assert kept["output_dir"] == str(out) and "local_paths_replaced" not in kept  # the run's own, as written

    commits = len(hub.state.commits)
    again = push_checkpoints(out, hub, tmp_path)  # the same run: nothing goes up again
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Skipped main: {REPO} already holds this run" in again.stdout
    assert f"Skipped checkpoint-4: {REPO}@step-4 already holds it" in again.stdout
    assert len(hub.state.commits) == commits
    kept["derived"]["dataset_rows"] += 1  # a record that differs (not in a path) is another run's: pushed
    # sealed as a run writes its record: one edited by hand is refused (push_to_hub.check_record_as_written)
    kept = run_record.sealed({k: v for k, v in kept.items() if k != run_record.SEAL})
    (out / "resolved_config.json").write_text(json.dumps(kept, indent=2))
    changed = push_checkpoints(out, hub, tmp_path)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert [c["revision"] for c in hub.state.commits[commits:]] == ["main"]


def test_the_uploaded_record_names_each_local_path_by_its_last_part_and_nothing_else():
    """Paths whole (a folder with a space) and inside texts (a mixture's spec), a home's `~`: by their last part; Hub
    names, URLs and ratios stay; the copy is sealed again, so that it does not read as edited by hand."""
    from dpotrain.hub.public import public_record
    from dpotrain.recipe import run_record

    home = "/home/ann/my data/pairs.jsonl"
    values = {
        "dataset_mixer_list": [home, "0.5", "org/dolci", "1.0"],
        "accelerate_config": "~/configs/zero2.yaml",
        "chat_template_path": "/scratch/proj/templates/think.jinja",
        "hub_model_id": "org/name",
        "derived": {"data_sources": [{"source": f"{home}:0.5 [train]"}, {"source": "org/dolci:1.0"}]},
        "note": "loss curves at https://wandb.ai/org/proj, tokens/s 1/2",
    }
    public = public_record(run_record.sealed(values))
    assert public["dataset_mixer_list"] == ["pairs.jsonl", "0.5", "org/dolci", "1.0"]
    assert (public["accelerate_config"], public["chat_template_path"]) == ("zero2.yaml", "think.jinja")
    assert public["derived"]["data_sources"] == [{"source": "pairs.jsonl:0.5 [train]"}, {"source": "org/dolci:1.0"}]
    assert (public["hub_model_id"], public["note"]) == (values["hub_model_id"], values["note"])
    assert public["local_paths_replaced"]["fields"] == [
        "dataset_mixer_list[0]",
        "accelerate_config",
        "chat_template_path",
        "derived.data_sources[0].source",
    ]
    assert not run_record.edited(public)
    assert public_record({"hub_model_id": "org/name"}) is None  # nothing to replace: the file goes up as it is


def test_the_uploaded_record_keeps_texts_that_are_no_paths_as_written():
    """A text that begins with a path (a resumed run's `derived.output_folder` sentence) went up as the last part of
    its last path; a prompt beginning with `/` or holding `/no_think` lost its slash; a path that begins another
    (`/scratch/run` in `/scratch/run2/...`) was cut at the shorter one. Now: a sentence's paths each by its last part,
    the person's prompts as written, a one-part `/word` left, paths replaced whole only where they end."""
    from dpotrain.hub.public import public_record

    out = "/scratch/me/run"
    values = {
        "output_dir": out,
        "sample_prompts": ["/help me plan a trip", "What does /usr/bin/env do?"],
        "chat_template_kwargs": {"note": "Answer briefly /no_think"},
        "derived": {
            "output_folder": f"{out}: an unfinished run, which the run resumes from {out}/checkpoint-40",
            "cache": f"lengths of another run ({out}2/cache/ab.npz)",
        },
    }
    public = public_record(values)
    assert public["output_dir"] == "run"
    assert public["sample_prompts"] == values["sample_prompts"]
    assert public["chat_template_kwargs"] == values["chat_template_kwargs"]
    assert public["derived"] == {
        "output_folder": "run: an unfinished run, which the run resumes from checkpoint-40",
        "cache": "lengths of another run (ab.npz)",
    }
    assert public["local_paths_replaced"]["fields"] == ["output_dir", "derived.output_folder", "derived.cache"]


def test_push_to_hub_records_a_checkpoint_whose_mark_cannot_be_read_and_goes_on(hub, tmp_path, monkeypatch):
    """`push_to_hub.py --checkpoints` asked each checkpoint's COMPLETE mark outside the reads it records: a mark whose
    stat failed (a permission, ESTALE) raised straight out, before the push's try (listing the stopped run's
    checkpoints) or in it ("run the same command again", which failed for ever): no record of the step, the steps
    after it untried. The step is now among those tried, recorded failed with its fix, and the command goes on
    (seen failing on the old code: the PermissionError, no record, checkpoint-4 untried)."""
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    out = tmp_path / "run"
    for step in (2, 4):  # a stopped run's (no run_complete.json)
        sealed_checkpoint(out / f"checkpoint-{step}")
    run_files.write(out, [run_files.MANIFEST, PUSH_RECORD, "checkpoint-2", "checkpoint-4"])
    mark, real_stat = out / "checkpoint-2" / "COMPLETE", Path.stat

    def stat(path, *args, **kwargs):
        if path == mark:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_stat(path, *args, **kwargs)

    script = push_script(hub, monkeypatch)
    monkeypatch.setattr(Path, "stat", stat)
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as failed:
        script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    assert str(failed.value) == (
        f"step-2 failed to push (see {out}/{PUSH_RECORD}), and it pushes only once mended: step-2: it could not be "
        f"read (PermissionError: [Errno 13] Permission denied: '{mark}'): fix the file's permissions first; then run "
        "the same command again"
    )
    assert [(r["step"], r["status"]) for r in read_pushes(out)] == [(2, "failed"), (4, "pushed")]


def test_push_to_hub_says_the_steps_that_failed_before_the_run_locks_refusal(hub, tmp_path, monkeypatch, capsys):
    """The run lock asked again mid-command (a requeued job started meanwhile) ended the command with its refusal
    alone: checkpoint-6, which had failed just before with a fix to make (its manifest's permission), lost its closing
    line and fix. They are now said, as warnings, before the refusal (seen failing on the old code: no step-6 line)."""
    import json
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.cluster import run_lock
    from dpotrain.hub import hub_push
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    out = tmp_path / "run"
    folder = sealed_checkpoint(out / "checkpoint-2")  # the stopped job's: staged, then rotated away
    hub_push.stage(folder, out / hub_push.STAGING)
    shutil.rmtree(folder)
    hub_push.record_checkpoint(out, REPO, 2, "unfinished", error="given up on a stop request")
    sealed_checkpoint(out / "checkpoint-6")  # the one rotation kept (a stopped run: no run_complete.json)
    run_files.write(out, [run_files.MANIFEST, hub_push.STAGING, PUSH_RECORD, "checkpoint-6"])
    refused, read_text = out / "checkpoint-6" / "MANIFEST.json", Path.read_text
    job = subprocess.Popen(["sleep", "600"])  # the requeued job's process: alive until killed below

    def permission_refused(path, *args, **kwargs):
        if path == refused:  # the job takes the folder's lock as checkpoint-6's read is refused
            holder = {**run_lock.holder_record(), "pid": job.pid, "process_start": run_lock.process_start(job.pid)}
            (out / run_lock.LOCK_FILE).write_text(json.dumps({**holder, "slurm_job_id": "5512"}, indent=1))
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return read_text(path, *args, **kwargs)

    script = push_script(hub, monkeypatch)
    monkeypatch.setattr(Path, "read_text", permission_refused)
    try:
        with mock.patch.dict(os.environ), pytest.raises(ConfigError) as stopped:
            script.main([str(out), "--repo-id", REPO, "--checkpoints"])
    finally:
        job.kill()
        job.wait()
    assert str(stopped.value).startswith(f"{out} is in use by a running job (host "), stopped.value
    warned = capsys.readouterr().err
    assert (
        f"warning: step-6 failed to push (see {out}/{PUSH_RECORD}), and it pushes only once mended: step-6: it could "
        f"not be read (PermissionError: [Errno 13] Permission denied: '{refused}'): fix the file's permissions first; "
        "then run the same command again\n"
    ) in warned, warned
    assert (out / hub_push.STAGING / "checkpoint-2" / "model.safetensors").is_file()  # left to the job


def saves_with_a_pusher(hub, monkeypatch, out):
    """What a run's saves do on its main process, without training (save_total_limit 1): the checkpoint sealed and
    listed complete, CompleteMarker's rotation, then the pusher's on_save (it comes after the marker)."""
    from transformers import TrainerState

    from conftest import sealed_checkpoint
    from dpotrain.hub.hub_push import CheckpointPusher
    from dpotrain.train import run_files
    from dpotrain.train.checkpoints import rotate_recorded

    hub_in_process(hub, monkeypatch)
    run_files.write(out, [run_files.MANIFEST, PUSH_RECORD])
    pusher, args = (
        CheckpointPusher(REPO, SECRET, None, out),
        SimpleNamespace(output_dir=str(out), save_total_limit=1),
    )

    def save(step: int) -> None:
        run_files.claim(out, [f"checkpoint-{step}"])
        folder = sealed_checkpoint(out / f"checkpoint-{step}")
        run_files.completed(out, folder.name)
        state = TrainerState(global_step=step, is_world_process_zero=True)
        rotate_recorded(args, state, folder)
        pusher.on_save(args, state, None)

    return pusher, save


def manifests_unread(monkeypatch, unread: set) -> None:
    """The manifests of the checkpoints in `unread` (by step) fail their read (EIO) while they are in it."""
    read_text = Path.read_text

    def failing(path, *args, **kwargs):
        if path.name == "MANIFEST.json" and path.parent.name in {f"checkpoint-{s}" for s in unread}:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", failing)


def test_a_checkpoint_the_pusher_could_not_stage_is_kept_by_rotation_until_it_is(hub, tmp_path, monkeypatch, capsys):
    """checkpoint-2's read failed as the pusher staged it (EIO): recorded failed with no staged copy, and the next
    save's rotation (save_total_limit 1, before the pusher's on_save) deleted it: the step was lost while the warning
    promised "push_to_hub.py --checkpoints pushes it later while it is still on disk". Rotation now keeps it until the
    pusher stages it, tried again at the next save (seen failing on the old code: checkpoint-2 deleted, not pushed)."""
    from dpotrain.hub.hub_push import FINAL_WAIT_S, pushed_revisions

    out = tmp_path / "run"
    pusher, save = saves_with_a_pusher(hub, monkeypatch, out)
    unread = {2}
    manifests_unread(monkeypatch, unread)
    save(2)
    assert "pushes it later while it is still on disk" in capsys.readouterr().err
    unread.clear()  # the file system answers again
    save(4)
    assert (
        f"Kept {out / 'checkpoint-2'}, which save_total_limit lets go, for its push to the Hub"
        in capsys.readouterr().out
    )
    assert pusher.finish(FINAL_WAIT_S) == []
    assert hub.state.repos[REPO]["step-2"]["model.safetensors"] == b"model.safetensors\n"
    assert {s for s, _ in pushed_revisions(out, REPO)} == {2, 4}
    save(6)  # staged and pushed: rotation lets it go now
    assert not (out / "checkpoint-2").exists()
    assert pusher.finish(FINAL_WAIT_S) == []


def test_a_checkpoint_never_staged_that_rotation_deletes_is_recorded_lost(hub, tmp_path, monkeypatch, capsys):
    """Rotation keeps one checkpoint the pusher could not stage, the newest: while reads keep failing, each kept would
    fill the disk. An older one it lets go is lost: its record says `pushable: false` and its warning that no command
    can push it, never "pushes it later" (seen failing on the old code: no such record)."""
    from dpotrain.hub.hub_push import FINAL_WAIT_S, checkpoints_left

    out = tmp_path / "run"
    pusher, save = saves_with_a_pusher(hub, monkeypatch, out)
    unread = {2, 4}
    manifests_unread(monkeypatch, unread)
    save(2)
    save(4)  # checkpoint-2 tried again and failing still; checkpoint-4 is the one kept now
    assert (out / "checkpoint-2").is_dir()
    capsys.readouterr()
    unread.discard(2)  # readable again after its last try: rotation's removal reads its manifest too
    save(6)
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-4").is_dir()
    warned = capsys.readouterr().err
    assert (
        f"warning: checkpoint-2 was not pushed to {REPO}@step-2 (it could not be staged before save_total_limit "
        "deleted it); training goes on. Recorded in "
    ) in warned, warned
    assert "no command can push it: its checkpoint was deleted, and no whole copy of it is left" in warned
    latest = {r["step"]: r for r in read_pushes(out)}
    assert latest[2]["status"] == "failed" and latest[2]["pushable"] is False
    assert pusher.finish(FINAL_WAIT_S) == []
    assert checkpoints_left(out, REPO) == [4]  # still on disk, for push_to_hub.py --checkpoints


def test_a_checkpoint_folder_the_file_server_did_not_answer_for_leaves_push_to_hub_pushing_main(
    hub, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """push_to_hub.py of a finished run, checkpoint-2's folder unanswered (ESTALE) as its checkpoints are counted for
    the note on those not pushed: the look raises (`writes.looked`); inside main's try it ended in "pushing ... failed
    (OSError: ...): run the same command again", as if the Hub had failed, then in the unanswered look's own line with
    main not pushed. A count for a note ends nothing: main is pushed, and the note says the count failed and how to
    push them. (Old code: RunError.)"""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", "{}")]:
        (run / name).write_text(text)
    sealed_checkpoint(run / "checkpoint-2")
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), monkeypatch.context() as patched:
        failing_stat(patched, run / "checkpoint-2")
        script.main([str(run), "--repo-id", REPO])
    said = capsys.readouterr().out
    assert "The run's checkpoints could not be counted (OSError: [Errno 116] Stale file handle" in said, said
    assert "config.json" in hub.state.repos[REPO]["main"], said  # main pushed


def test_a_lost_step_whose_checkpoint_could_not_be_looked_at_is_not_said_to_be_on_disk(hub, tmp_path, monkeypatch):
    """never_pushed took a checkpoint whose COMPLETE mark could not be looked at (ESTALE) for one on disk: "checkpoint-4
    on disk is not pushable as it is", where whether it is on disk is not known. (Old code: that wording.)"""
    from dpotrain.train.checkpoints import MARKER

    out = tmp_path / "run"
    script = push_script(hub, monkeypatch)
    record = {"step": 4, "branch": "step-4", "pushable": False, "error": "its staged copy was not whole (removed)"}
    with monkeypatch.context() as patched:
        failing_stat(patched, out / "checkpoint-4" / MARKER)
        said = script.never_pushed(out, [record])
    assert "on disk" not in said.replace("whether it is on disk is not known", ""), said
    assert said.endswith(
        f"step-4: checkpoint-4 could not be looked at (OSError: [Errno {errno.ESTALE}] Stale file handle: "
        f"'{out / 'checkpoint-4' / MARKER}'), so whether it is on disk is not known, its staged copy was not whole "
        "(removed)"
    ), said


def test_a_requeue_keeps_the_checkpoint_held_for_its_staging_through_the_resumes_rotation(
    hub, tmp_path, monkeypatch, capsys
):
    """checkpoints.unstaged is in memory only: the job holding checkpoint-2 for its staging ended (preempted), and the
    requeue's resume from checkpoint-4 settled (listed complete, rotated: CompleteMarker's on_train_begin) before the
    pusher's on_train_begin could stage it again, deleting it while its record stayed `failed` (not `pushable: false`)
    for push_to_hub.py to push "later". The new job's pusher holds it again from the run's records, before the settle
    (seen failing on the old code: checkpoint-2 deleted by the settle)."""
    from transformers import TrainerState

    from dpotrain.hub.hub_push import FINAL_WAIT_S, CheckpointPusher, pushed_revisions
    from dpotrain.train import checkpoints

    out = tmp_path / "run"
    first, save = saves_with_a_pusher(hub, monkeypatch, out)
    unread = {2}
    manifests_unread(monkeypatch, unread)
    save(2)
    save(4)  # checkpoint-2 held for its staging, its read failing still
    assert first.finish(FINAL_WAIT_S) == []
    unread.clear()
    checkpoints.unstaged.clear()  # the job's process ends: its hold with it
    pusher = CheckpointPusher(REPO, SECRET, None, out)  # the requeued job's, built before the trainer's callbacks run
    args = SimpleNamespace(output_dir=str(out), save_total_limit=1)
    state = TrainerState(global_step=4, is_world_process_zero=True)
    checkpoints.settle_resumed(args, state, str(out / "checkpoint-4"))
    assert (out / "checkpoint-2" / "COMPLETE").is_file()
    pusher.on_train_begin(args, state, None)
    assert pusher.finish(FINAL_WAIT_S) == []
    assert {s for s, _ in pushed_revisions(out, REPO)} == {2, 4}
    assert checkpoints.unstaged == set()  # staged: a later save's rotation lets it go


def test_a_staging_folder_unanswered_as_the_pusher_claims_it_is_a_warning_and_a_failed_record(
    hub, tmp_path, monkeypatch, capsys
):
    """The pusher's claim of its staging folder (run_files.set_aside_if_not_own, in on_save on rank 0 alone) raised an
    unanswered look's OSError (ESTALE) out of the save on rank 0, the other ranks waiting in their next collective
    (seen failing on the old code: the OSError raised). Now a warning and a failed record, as its other reads, and the
    checkpoint kept by rotation and staged at the next save."""
    from dpotrain.hub.hub_push import FINAL_WAIT_S, STAGING, pushed_revisions

    out = tmp_path / "run"
    pusher, save = saves_with_a_pusher(hub, monkeypatch, out)
    with monkeypatch.context() as patched:
        failing_stat(patched, out / STAGING)
        save(2)
    warned = capsys.readouterr().err
    assert (
        f"warning: checkpoint-2 was not pushed to {REPO}@step-2 (it could not be staged (OSError: [Errno "
        f"{errno.ESTALE}] {os.strerror(errno.ESTALE)}: '{out / STAGING}')); training goes on. Recorded in "
    ) in warned, warned
    assert [(r["step"], r["status"]) for r in read_pushes(out)] == [(2, "failed")]
    save(4)  # the file server answers again: checkpoint-2, kept meanwhile, staged and pushed
    assert pusher.finish(FINAL_WAIT_S) == []
    assert {s for s, _ in pushed_revisions(out, REPO)} == {2, 4}


@pytest.mark.slow  # prefetch.py, then a training run whose start waits on the slow Hub's probe
def test_a_slow_hubs_run_that_read_its_cache_offline_still_pushes_its_checkpoints_and_final_model(
    hub, tmp_path, tiny_model_dir
):
    """A Hub slow to answer the start-up probe (over its 3 s) that still answers the write check: the run read its
    cached Hub data set offline, as it says, by setting HF_HUB_OFFLINE itself, and at the end took that for the user's
    own: "HF_HUB_OFFLINE is set, so nothing was pushed", no push recorded, exit 0 though --push_to_hub was asked. Its
    own switch is lifted for its pushes: the checkpoints and main go up as on a Hub that answers at once."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_bytes()
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": pairs})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {k: v for k, v in env_for(hub, tmp_path).items() if k != "HF_HUB_OFFLINE"}  # neither switch set: online
    cached = ["--config", SMOKE, "--dataset_name", "org/prefs", "--model_name_or_path", tiny_model_dir]
    fetched = subprocess.run([python(), str(ROOT / "scripts" / "prefetch.py"), *cached], env=env, **TEXT)
    assert fetched.returncode == 0, fetched.stdout
    slow = []

    def slow_probe():  # `HEAD /`, the probe's request (and nothing the push asks): over its deadline, once
        if not slow:
            slow.append(time.time())
            time.sleep(5)

    hub.state.hold[("unknown", None)] = slow_probe
    hub.state.requests.clear()
    out = tmp_path / "run"
    args = [*cached, "--output_dir", str(out), "--max_steps", "4", "--push_checkpoints", "true", "--save_steps", "2"]
    args += ["--push_to_hub", "true", "--hub_model_id", REPO, "--hub_token", SECRET]
    result = subprocess.run([python(), str(ROOT / "train_dpo.py"), *args], env=env, **TEXT | {"timeout": 600})
    assert slow, "the probe did not reach the stand-in"
    assert result.returncode == 0, result.stdout[-3000:]
    assert "The Hugging Face Hub does not answer here (" in result.stdout  # the cache read offline, as it says
    assert "HF_HUB_OFFLINE is set" not in result.stdout, result.stdout[-3000:]
    assert [(c["revision"], c["message"]) for c in hub.state.commits] == [
        ("step-2", "Checkpoint at step 2"),
        ("step-4", "Checkpoint at step 4"),
        ("main", "Upload DPO run"),
    ]
    assert [r["status"] for r in read_pushes(out) if r["branch"] == "main"] == ["started", "pushed"]
    assert f"Pushed to {hub.endpoint}/{REPO}" in result.stdout, result.stdout[-3000:]


def test_push_to_hub_ends_a_branch_push_the_hub_failed_with_exit_1_not_a_refusals_2(hub, tmp_path, monkeypatch, capsys):
    """A branch whose commits the Hub fails (500) past the retries ended `push_to_hub.py RUN --checkpoints` with
    "error: step-2 failed to push ...: run the same command again" and exit 2, a refused input's code, where
    docs/hub.md gives exit 1 for a push the Hub failed: a script or a job chain retrying on 1 took it for an input to
    fix. Now exit 1; the other steps are pushed."""
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.recipe.errors import run_cli
    from dpotrain.train import run_files

    out = tmp_path / "run"
    for step in (2, 4):  # a stopped run's (no run_complete.json): its checkpoints alone go up
        sealed_checkpoint(out / f"checkpoint-{step}")
    run_files.write(out, [run_files.MANIFEST, PUSH_RECORD, "checkpoint-2", "checkpoint-4"])
    script = push_script(hub, monkeypatch)
    hub.state.fail[("commit", "step-2")] = -1  # 500, every time
    with mock.patch.dict(os.environ), pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main([str(out), "--repo-id", REPO, "--checkpoints"]))
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"error: step-2 failed to push (see {out}/{PUSH_RECORD}): run the same command again"
    assert [c["revision"] for c in hub.state.commits] == ["step-4"]
    # The Hub failing the write check before any upload is the Hub's failure too, not a refused input
    hub.state.whoami_status = 500
    with mock.patch.dict(os.environ), pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main([str(out), "--repo-id", REPO, "--checkpoints"]))
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the warning of its retry
    assert ended.value.code == 1 and last.startswith(f"error: could not check write access to {REPO}: "), err


def test_a_damaged_run_complete_json_names_a_fix_that_works(hub, tmp_path, monkeypatch, tiny_model_dir):
    """A finished run's run_complete.json damaged (a copy to a login node cut short): push_to_hub.py said "rerun the
    same command to write it again", and that rerun refused the folder as a finished run's, naming
    --overwrite_output_dir (which deletes the trained model) or a new --output_dir; no rerun writes it. The line names
    the copy to restore."""
    import shutil
    from unittest import mock

    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", '{"global')]:
        (run / name).write_text(text)
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    script = push_script(hub, monkeypatch)
    with pytest.raises(ConfigError) as refused, mock.patch.dict(os.environ):
        script.main([str(run), "--repo-id", REPO])
    assert str(refused.value).startswith(f"{run / 'run_complete.json'} is unreadable (JSONDecodeError: ")
    assert str(refused.value).endswith(
        "a finished run writes it last, and no rerun writes it again: restore it from the folder the run wrote (this "
        "one may be a copy cut short) or from another copy of it"
    )
    assert hub.state.commits == []


def test_a_section_added_after_the_cards_revisions_is_kept_by_push_to_hub(hub, tmp_path, monkeypatch, tiny_model_dir):
    """A person adds their evaluation to a finished run's card, after its last section, the list of checkpoint
    branches; push_to_hub.py, run again for a branch that failed, made that list anew and dropped everything after its
    heading: the section was gone from the card in the folder and on main. Only the list is replaced."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.hub import hub as hub_module
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    (run / "training_curves.png").write_text("png")
    (run / "run_complete.json").write_text("{}")
    sealed_checkpoint(run / "checkpoint-2")
    theirs = "\n## Evaluation\n\nMMLU 61.2 (ours, 5-shot)\n"
    (run / "README.md").write_text("# run\n" + hub_module.revisions_section([(2, "step-2")], REPO) + theirs)
    run_files.write(run, [run_files.MANIFEST, PUSH_RECORD, *sorted(p.name for p in run.iterdir())])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ):
        script.main([str(run), "--repo-id", REPO, "--checkpoints"])
    card = (run / "README.md").read_text()
    assert card.endswith(theirs) and "[`step-2`]" in card, card
    assert hub.state.repos[REPO]["main"]["README.md"].decode().endswith(theirs)


def test_a_card_edited_in_another_encoding_is_refused_naming_the_fix_not_a_rerun(
    hub, tmp_path, monkeypatch, tiny_model_dir
):
    """A person adds their evaluation to a finished run's card in an editor that saves Latin-1 ("Évaluation"):
    push_to_hub.py failed reading it with "UnicodeDecodeError ...: run the same command again", exit 1, which fails the
    same way each time. It is refused before main is pushed, naming the line and the fix (save it as UTF-8)."""
    import shutil
    from unittest import mock

    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    (run / "training_curves.png").write_text("png")
    (run / "run_complete.json").write_text("{}")
    (run / "README.md").write_bytes("# run\n\n## Évaluation\n".encode("latin-1"))
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
        script.main([str(run), "--repo-id", REPO])
    assert str(refused.value) == (
        f"{run}/README.md line 3 is not UTF-8 text, which a model card must be: save it as UTF-8 (written as Latin-1: "
        "`iconv -f latin1 -t utf-8`), then run the same command again; main was not pushed"
    )
    assert not hub.state.of("commit")


def test_a_card_whose_metadata_the_hub_refuses_is_refused_with_the_hubs_reasons_not_a_rerun(
    hub, tmp_path, monkeypatch, tiny_model_dir
):
    """A person adds `license: Apache 2.0` to a finished run's card (the Hub takes `apache-2.0`), and the Hub refuses
    the card's metadata (validate-yaml's 400): push_to_hub.py said "ValueError: Invalid metadata in README.md.: run the
    same command again", exit 1, which fails the same way each time, and the Hub's reason was dropped with the lines
    after the first. It is refused naming the card, the Hub's reason and the fix, main not pushed; the run's own final
    push says the same, then the command that pushes the run once the card is fixed."""
    import shutil
    from unittest import mock

    from dpotrain import publish
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.errors import ConfigError, RunError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    (run / "training_curves.png").write_text("png")
    (run / "run_complete.json").write_text("{}")
    (run / "README.md").write_text("---\nlicense: Apache 2.0\ntags:\n- dpo\n---\n\n# run\n")
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    hub.state.card_refusals["license"] = '"license" must be one of [apache-2.0, mit, other]'
    refused = (
        f"the Hub refuses the model card {run}/README.md: its metadata (the YAML block between the `---` lines at its "
        'top) is not what the Hub takes: "license" must be one of [apache-2.0, mit, other]; fix it there'
    )
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as said:
        script.main([str(run), "--repo-id", REPO])
    assert str(said.value) == f"{refused}, then run the same command again; main was not pushed"
    assert not hub.state.of("commit")

    push = hub_module.PushSettings(True, REPO, None, False, SECRET, None)
    with pytest.raises(RunError) as said:  # the run's own final push, after training
        publish.push_final(run, push, SimpleNamespace(save_total_limit=None))
    command = push_command(run, "--repo-id", REPO)
    assert str(said.value) == f"{refused}, then push it with `{command}`; the run is saved and main was not pushed"
    assert not hub.state.of("commit")
    assert read_pushes(run)[-1]["status"] == "failed"

    hub.state.card_refusals.clear()  # the card fixed: the same command pushes it
    with mock.patch.dict(os.environ):
        script.main([str(run), "--repo-id", REPO])
    assert hub.state.repos[REPO]["main"]["README.md"].startswith(b"---\nlicense: Apache 2.0\n")


def test_a_record_edited_after_the_run_is_refused_before_it_reaches_the_hub(hub, tmp_path, monkeypatch, tiny_model_dir):
    """A finished run's resolved_config.json with a value "fixed" by hand (its own SHA-256, `written_sha256`, then
    disagrees): push_to_hub.py pushed it to main as the run's record, learning_rate 0.5 beside a card and a model
    trained at 1e-4, and said `Pushed`. It is refused before anything uploads, naming the checkpoint's copy to put back
    and --repo-id (an edited hub_model_id chose the repo); the record as the run wrote it is pushed."""
    import shutil
    from unittest import mock

    from conftest import sealed_checkpoint
    from dpotrain.recipe import run_record
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", "{}")]:
        (run / name).write_text(text)
    written = json.dumps(run_record.sealed({"hub_model_id": REPO, "run_name": "run", "learning_rate": 1e-4}))
    (run / "resolved_config.json").write_text(written)
    sealed_checkpoint(run / "checkpoint-2")
    (run / "checkpoint-2" / "resolved_config.json").write_text(written)
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    (run / "resolved_config.json").write_text(written.replace("0.0001", "0.5"))
    script = push_script(hub, monkeypatch)
    with mock.patch.dict(os.environ), pytest.raises(ConfigError) as refused:
        script.main([str(run)])
    assert str(refused.value) == (
        f"{run}/resolved_config.json was edited after the run wrote it, and would reach the Hub as the record of a run "
        f"that was not trained so: put back the run's own ({run}/checkpoint-2/resolved_config.json holds a copy); to "
        "push to another repo, pass --repo-id org/name; nothing was pushed"
    )
    assert not hub.state.project_requests()
    shutil.copy(run / "checkpoint-2" / "resolved_config.json", run / "resolved_config.json")
    with mock.patch.dict(os.environ):
        script.main([str(run)])
    assert json.loads(hub.state.repos[REPO]["main"]["resolved_config.json"])["learning_rate"] == 1e-4


def test_push_to_hub_under_the_compute_nodes_offline_switch_in_env_names_a_command_that_pushes(
    hub, tmp_path, monkeypatch, tiny_model_dir
):
    """HF_HUB_OFFLINE=1 in the project's .env, as docs/hub.md sets it for compute nodes without network: push_to_hub.py,
    run on the login node from the same project, read it too and said "unset it", which a shell's `unset` does not do
    (the .env sets it again at each command). It names the command that pushes: HF_HUB_OFFLINE=0 before it, which
    wins over .env's, and that command pushes."""
    import shutil
    from unittest import mock

    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import run_files

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run)
    for name, text in [("README.md", "# run\n"), ("training_curves.png", "png"), ("run_complete.json", "{}")]:
        (run / name).write_text(text)
    run_files.write(run, [run_files.MANIFEST, *sorted(p.name for p in run.iterdir())])
    script = push_script(hub, monkeypatch)
    project = tmp_path / "project"
    project.mkdir()
    (project / ".env").write_text("HF_HUB_OFFLINE=1\n")
    monkeypatch.setattr(script, "ROOT", project)
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the login node's shell: set nowhere but in .env
    with pytest.raises(ConfigError) as refused, mock.patch.dict(os.environ):
        script.main([str(run), "--repo-id", REPO])
    assert str(refused.value) == (
        f"HF_HUB_OFFLINE is set (by {project / '.env'}), so {run} cannot be pushed to {REPO} from here: where the Hub "
        f"is reachable, run `HF_HUB_OFFLINE=0 python scripts/push_to_hub.py {run} --repo-id {REPO}` (a variable set "
        "for the command wins over .env's)"
    )
    hub_in_process(hub, monkeypatch)  # huggingface_hub as a new process given HF_HUB_OFFLINE=0 imports it
    with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "0"}):
        script.main([str(run), "--repo-id", REPO])
    assert "model.safetensors" in hub.state.repos[REPO]["main"]


def test_a_hub_failing_one_request_of_the_write_check_does_not_end_the_job(hub, monkeypatch):
    """One 500 (or 429: the Hub rate-limits whoami strictly) to the write check at a job's start ended the job, exit 2,
    a requeued job's too, whose run was then resumed by no one; uploads are asked again on such an answer, and the
    check now is too. A Hub that goes on failing ends the job before training, naming the rerun."""
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.errors import ConfigError

    hub_in_process(hub, monkeypatch)
    hub.state.add_repo(REPO)
    hub.state.fail[("whoami", None)] = 1
    assert hub_module.check_write_access(REPO, SECRET) == REPO
    hub.state.fail[("auth_check", None)] = 1
    assert hub_module.check_write_access("dpo-test", SECRET) == REPO  # the namespace taken from whoami's answer
    assert [r["kind"] for r in requests(hub)].count("whoami") == 4  # each attempt asks again whole
    hub.state.whoami_status = 500
    with pytest.raises(ConfigError) as refused:
        hub_module.check_write_access(REPO, SECRET)
    assert str(refused.value).startswith(f"could not check write access to {REPO}: HfHubHTTPError: ")
    assert str(refused.value).endswith("; nothing was trained: run the same command again")


@pytest.mark.slow  # a training run, then push_to_hub.py twice
def test_a_final_model_damaged_since_the_run_saved_it_is_refused_before_anything_uploads(hub, tmp_path, tiny_model_dir):
    """A finished run's model files changed after the run saved them (a bad disk block, a copy to a login node that
    garbled a file, a config.json cut short or edited): push_to_hub.py pushed them to main, exit 0, 'Pushed to ...', a
    model no from_pretrained loads (or other weights) in place of the one trained. The run records each file's size
    and SHA-256 in run_complete.json; a push checks them and refuses in one line naming the file, before any upload."""
    out, result = train(hub, tmp_path, tiny_model_dir, "--save_strategy", "no", "--report_to", "none", offline=True)
    assert result.returncode == 0, result.stdout[-3000:]
    config = out / "config.json"
    whole = config.read_text()
    config.write_text(whole[:100])  # cut short
    pushed = push_checkpoints(out, hub, tmp_path)
    assert pushed.returncode == 2, pushed.stdout + pushed.stderr
    assert pushed.stderr.strip().splitlines()[-1] == (
        f"error: {config} is not the file the run saved (100 bytes, where the run saved "
        f"{json.loads((out / 'run_complete.json').read_text())['model_files']['config.json']['bytes']:,}): copy it "
        "again from the folder the run wrote, or train again into a new output_dir; nothing was pushed"
    )
    assert hub.state.commits == []

    config.write_text(whole)  # put back; the weights' body changed in place, their size and header as saved
    weights = out / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    pushed = push_checkpoints(out, hub, tmp_path)
    assert pushed.returncode == 2, pushed.stdout + pushed.stderr
    assert pushed.stderr.strip().splitlines()[-1] == (
        f"error: {weights} is not the file the run saved (its SHA-256 is not the one run_complete.json records): "
        "copy it again from the folder the run wrote, or train again into a new output_dir; nothing was pushed"
    )
    assert hub.state.commits == []


def test_a_lora_runs_merged_folder_deleted_whole_is_pushed_without_it_and_the_card_says_so(
    hub, tmp_path, monkeypatch, capsys
):
    """`rm -r outputs/x/merged` once a LoRA run with merge_lora had finished (the base with the adapter merged in, as
    large as the base, made again from the adapter): every push was refused, "merged/model.safetensors is not the file
    the run saved (it is missing): copy it again ... or train again", and the run could not be pushed at all. Pushed
    without it, the card no longer naming a merged/ that is not there; a merged/ there in part is still refused. Every
    final push: push_to_hub.py's and a rerun's completing the run's own push a kill cut short (both hub.push_run); the
    rerun's pushed the card naming merged/, not there."""
    from dpotrain.hub import hub as hub_module
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import checkpoint_manifest

    out = tmp_path / "run"
    (out / "merged").mkdir(parents=True)
    for name in ("adapter_model.safetensors", "merged/model.safetensors", "merged/config.json"):
        (out / name).write_text(f"{name}\n")
    saved = {
        n: {"bytes": (out / n).stat().st_size, "sha256": checkpoint_manifest.sha256(out / n)}
        for n in ("adapter_model.safetensors", "merged/model.safetensors", "merged/config.json")
    }
    (out / hub_module.RUN_COMPLETE).write_text(json.dumps({"global_step": 2, hub_module.MODEL_FILES: saved}))
    (out / hub_module.CARD).write_text(
        "This is a **LoRA adapter**. The merged model (base + adapter) is in `merged/`.\n"
    )
    (out / "merged" / "model.safetensors").unlink()  # in part: a copy cut short
    with pytest.raises(ConfigError, match="merged/model.safetensors is not the file the run saved"):
        hub_module.check_saved_model(out)
    for entry in (out / "merged").iterdir():
        entry.unlink()
    (out / "merged").rmdir()  # deleted whole
    assert hub_module.check_saved_model(out, hashed=True) == {
        "adapter_model.safetensors": saved["adapter_model.safetensors"]["sha256"]
    }
    assert hub_module.merged_deleted(out)
    hub_in_process(hub, monkeypatch)
    hub_module.push_run(out, REPO, token=SECRET)
    assert capsys.readouterr().out == (
        f"note: {out / 'merged'} was deleted since the run wrote it: the run is pushed without its merged model, its "
        "card saying so\n"
    )
    main = hub.state.repos[REPO]["main"]
    assert "adapter_model.safetensors" in main and not [name for name in main if name.startswith("merged/")]
    card = (out / hub_module.CARD).read_text()
    assert main["README.md"] == card.encode() and card == (
        "This is a **LoRA adapter**. Its merged model (`merge_lora: true`) was deleted after training, so `merged/` is "
        "not here: merge the adapter into the base with PEFT's `merge_and_unload()`.\n"
    )

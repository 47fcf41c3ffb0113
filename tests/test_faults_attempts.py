"""Faults between a run's attempts (hunted in rounds four and five: a kill at a save's exact point, attempts that
differ; nothing lost, nothing silent), on the tiny model: each held by construction (a run stopped at one exact point
by tests/helpers/pause_at.py, then killed), never by timing. What the hunt tried that already held is in the commits'
messages, not repeated here as tests."""

import json
import os
import shutil
import signal
import subprocess

import pytest
from test_changed_inputs import ARGS, resealed
from test_faults import FINAL

from conftest import PAUSE_AT, ROOT, pause_env, paused_pid, python
from dpotrain.train import run_files
from dpotrain.train.checkpoints import gone, is_complete, own_checkpoints

STEPS = 4


def command(out, model_dir, data, *extra) -> list[str]:
    """The smoke recipe on `data`: 4 steps, checkpoints at steps 2 and 4, save_total_limit 1."""
    return [
        *("--config", str(ROOT / "configs" / "smoke.yaml"), "--max_steps", str(STEPS), "--save_steps", "2"),
        *("--save_total_limit", "1", "--logging_steps", "1", "--report_to", "none"),
        *("--output_dir", str(out), "--model_name_or_path", model_dir, "--dataset_name", str(data), *extra),
    ]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The smoke data's first 48 pairs: an epoch of 6 steps, of which the run trains 4."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:48]))
    return path


def killed_at(out, model_dir, data, after: str, at: str, paused, event: str = "open") -> None:
    """The run SIGKILLed (a lost node, Slurm's kill after its grace time) at the point `after`/`at`, the audit event
    `event` (pause_at.py)."""
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *command(out, model_dir, data)],
        cwd=ROOT,
        env={**os.environ, **pause_env(after, at, paused), "DPOTRAIN_TEST_PAUSE_AT_EVENT": event},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        os.kill(paused_pid(paused, proc), signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()


def rerun(out, model_dir, data) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python(), str(ROOT / "train_dpo.py"), *command(out, model_dir, data)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_kill_inside_rotation_leaves_no_checkpoint_it_deleted_named_gone(tmp_path, tiny_model_dir, pairs):
    """SIGKILL inside save_total_limit's rotation after checkpoint-4's mark: checkpoint-2's folder deleted (the run
    stopped as its `shutil.rmtree` begins, which the test then finishes), the run's record not yet rewritten
    (`run_files.disown`).
    run_files.json still listed checkpoint-2 as marked complete, so `checkpoints.gone` named it moved or deleted by
    someone: a rerun that then passed over a damaged checkpoint-4 said `Not resuming from .../checkpoint-2: its folder
    is gone since the run saved it (run_files.json names it: moved or deleted)` and told the user to restore it from
    a copy, where the run had deleted it itself. Rotation now unlists it as complete before deleting it."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    killed_at(out, tiny_model_dir, pairs, "*/checkpoint-4/COMPLETE", "*/checkpoint-2", paused, "shutil.rmtree")
    shutil.rmtree(out / "checkpoint-2")  # what the rmtree the kill cut short was doing
    assert "checkpoint-2" in run_files.read(out)  # the point: its folder deleted, the record still naming it
    assert gone(out) == []

    (out / "checkpoint-4" / "optimizer.pt").unlink()  # damaged since: nothing left to resume from
    result = rerun(out, tiny_model_dir, pairs)
    assert result.returncode != 0
    assert "checkpoint-2" not in result.stdout, result.stdout[-3000:]
    assert "checkpoint-4: " in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_a_resume_under_another_commit_of_the_project_says_which(tmp_path, tiny_model_dir, capsys):
    """A requeue that ran another checkout of this project (a `git pull` between attempts, a job resumed from a
    colleague's copy) trained the steps after its checkpoint under other code, and nothing said so, where an upgraded
    package was said. Each record now keeps the project's commit with the packages (`derived.packages.dpotrain`), and
    a resume under another one says which, in the packages' note, and goes on."""
    import train_dpo

    now = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert len(now) == 40, "the tests run from a git checkout of the project"
    out = tmp_path / "run"
    argv = [*ARGS[:2], "--model_name_or_path", tiny_model_dir, "--max_steps", "2", "--save_steps", "2"]
    argv += ["--report_to", "none", "--output_dir", str(out)]
    train_dpo.main(argv)
    checkpoint = out / "checkpoint-2"
    for name in FINAL:  # as a kill after the last checkpoint leaves the folder
        (out / name).unlink()
    old = "0" * 40  # the checkpoint as another commit of the project sealed it
    resealed(checkpoint, lambda record: record["derived"]["packages"].update(dpotrain=old))
    capsys.readouterr()
    train_dpo.main(argv)
    said = f"note: {checkpoint} was trained under other package versions (dpotrain {old} -> {now}); the steps after "
    assert said in capsys.readouterr().out


@pytest.mark.slow
def test_a_checkpoint_in_a_folder_another_run_trains_in_now_is_refused(tmp_path, tiny_model_dir, pairs):
    """--resume_from_checkpoint naming a checkpoint of another run that is training now (its folder's lock live): the
    resume started, and that run's save_total_limit rotation may delete the checkpoint while this one loads it
    (after the reference stage), transformers then going on without the optimizer state it no longer finds, in
    silence. Refused before anything loads; the other run, stopped holding its lock once checkpoint-2 is marked, is
    untouched."""
    first, paused = tmp_path / "first", tmp_path / "paused"
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *command(first, tiny_model_dir, pairs)],
        cwd=ROOT,
        env={**os.environ, **pause_env("*/checkpoint-2/COMPLETE", "*", paused)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pid = paused_pid(paused, proc)
        second = tmp_path / "second"
        args = command(second, tiny_model_dir, pairs, "--resume_from_checkpoint", str(first / "checkpoint-2"))
        result = subprocess.run(
            [python(), str(ROOT / "train_dpo.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    said = result.stdout + result.stderr
    assert result.returncode != 0, said[-3000:]
    assert (
        f"error: resume_from_checkpoint {str(first / 'checkpoint-2')!r} is in {str(first)!r}, where another run is "
        "training now (host " in said
    ), said[-3000:]
    assert "copy the checkpoint out of its folder (cp -r) and resume from the copy" in said
    assert not (second / "resolved_config.json").exists() and (first / "checkpoint-2" / "COMPLETE").is_file()


@pytest.mark.slow
def test_a_requeue_past_a_checkpoint_of_another_run_goes_on_whatever_that_run_does_since(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Job 111 `--output_dir run --resume_from_checkpoint other/checkpoint-2` saved run/checkpoint-4 and was
    requeued: that start goes on from run/checkpoint-4 (`resume.explicit_point`) and loads nothing of the one named.
    The live-lock refusal and the is-a-folder check of the named one ran first, and ended the job's own requeue once
    the other run trained in its folder again, or once its rotation had deleted the checkpoint named."""
    from test_own_files import hold_lock

    import train_dpo

    other, out = tmp_path / "other", tmp_path / "run"
    base = [*ARGS[:2], "--model_name_or_path", tiny_model_dir, "--max_steps", "4", "--save_steps", "2"]
    base += ["--report_to", "none"]
    train_dpo.main([*base, "--output_dir", str(other)])
    named = other / "checkpoint-2"
    argv = [*base, "--output_dir", str(out), "--resume_from_checkpoint", str(named)]
    monkeypatch.setenv("SLURM_JOB_ID", "111")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    train_dpo.main(argv)
    for restart in ("1", "2"):
        for name in FINAL:  # as a kill after its last checkpoint leaves the folder
            (out / name).unlink()
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        if restart == "1":  # the other run's folder held by a live run of it
            holder = hold_lock(other, SLURM_JOB_ID="222", SLURM_RESTART_COUNT="0")
            try:
                train_dpo.main(argv)
            finally:
                holder.kill()
                holder.wait()
        else:  # the named checkpoint deleted since (the other run's rotation)
            shutil.rmtree(named)
            train_dpo.main(argv)
        assert (out / "run_complete.json").is_file()


@pytest.mark.slow
def test_a_kill_while_overwrite_output_dir_replaces_a_run_leaves_no_checkpoint_it_deleted_named_gone(
    tmp_path, tiny_model_dir, pairs
):
    """--overwrite_output_dir over a finished run, SIGKILLed as it removes the old run's config.json: its checkpoints
    (removed before it, by name) deleted, the old run's record still listing them as marked complete. The same command
    again (a requeue) said `Not resuming from .../checkpoint-4: its folder is gone since the run saved it
    (run_files.json names it: moved or deleted)` for each, deleted by the run itself. The replacement now unlists them
    as complete first."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    args = [*command(out, tiny_model_dir, pairs, "--save_total_limit", "2"), "--overwrite_output_dir", "true"]
    train = [python(), str(ROOT / "train_dpo.py"), *args]
    first = subprocess.run(train[:-2], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and (out / "checkpoint-2").is_dir(), first.stdout[-3000:]  # checkpoints 2 and 4 kept
    # Stopped before the old run's config.json is removed: its files go in the order of their names (run_complete.json
    # first), the checkpoints before it
    at = {**pause_env("", str(out / "config.json"), paused), "DPOTRAIN_TEST_PAUSE_AT_EVENT": "os.remove"}
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *args],
        cwd=ROOT,
        env={**os.environ, **at},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        os.kill(paused_pid(paused, proc), signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert (out / "config.json").is_file() and not list(out.glob("checkpoint-*"))  # the point: both deleted
    assert gone(out) == []

    again = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "gone since the run saved it" not in again.stdout, again.stdout[-3000:]


def test_a_checkpoint_in_a_folder_whose_lock_cannot_be_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """A checkpoint shared from a colleague's folder whose run.lock is 0600: its read raised PermissionError out of
    the live-lock check, a traceback at the run's start. Whether a run trains there cannot be told, and one that does
    may rotate the checkpoint away while this run loads it: refused, naming the lock and the copy to resume from
    instead (the tests run as root, whom chmod refuses nothing: the read is patched to raise as it would)."""
    from pathlib import Path

    from dpotrain.cluster import run_lock
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import resume

    other = tmp_path / "colleague"
    (other / "checkpoint-2").mkdir(parents=True)
    lock = other / run_lock.LOCK_FILE
    lock.write_text("{}")
    read_bytes = Path.read_bytes

    def denied(path):
        if path == lock:
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", denied)
    named = str(other / "checkpoint-2")
    with pytest.raises(ConfigError) as refused:
        resume.check_explicit(named, tmp_path / "run")
    said = str(refused.value)
    assert said.startswith(f"resume_from_checkpoint {named!r} is in {str(other.resolve())!r}, whose run.lock this ")
    assert "PermissionError: [Errno 13] Permission denied" in said and "\n" not in said
    assert said.endswith("copy the checkpoint out of its folder (cp -r) and resume from the copy")


@pytest.mark.slow
def test_a_kill_right_after_a_checkpoints_mark_is_settled_by_the_rerun_that_resumes_from_it(
    tmp_path, tiny_model_dir, pairs
):
    """SIGKILL right after checkpoint-4's COMPLETE mark, before the main process listed it complete in run_files.json
    and rotated (save_total_limit 1): the rerun resumed from checkpoint-4, the last step, so saved nothing and rotated
    nothing. The finished run kept checkpoint-2 beyond its limit for good (a whole checkpoint's space, in silence),
    and its record never listed checkpoint-4 as complete, so a checkpoint-4 moved or deleted later was not named gone
    (`checkpoints.gone`). The resume now settles what the killed save left: the checkpoint it resumes from listed
    complete, and the rotation done."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    killed_at(out, tiny_model_dir, pairs, "*/checkpoint-4/COMPLETE", f"*/{run_files.MANIFEST}", paused)
    assert is_complete(out / "checkpoint-4") and (out / "checkpoint-2").is_dir()
    assert run_files.completed(out) == ["checkpoint-2"]  # the state the kill left: checkpoint-4 not yet listed

    result = rerun(out, tiny_model_dir, pairs)
    assert result.returncode == 0, result.stdout[-3000:]
    log = result.stdout
    assert f"Resuming from {out / 'checkpoint-4'}" in log
    assert [p.name for p in own_checkpoints(out)] == ["checkpoint-4"], log[-3000:]
    assert not (out / "checkpoint-2").exists()
    assert run_files.completed(out) == ["checkpoint-4"]
    assert "checkpoint-2" not in run_files.read(out)
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == STEPS

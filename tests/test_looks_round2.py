"""Looks and records that still raised where a line was owed or a kept folder was (session 47, after session 46's
tests/test_unanswered_looks.py): a lock another user's run left unreadable, rotation's record unreadable, the disk-full
line's list of checkpoints, an input path whose look was unanswered, a count for a note. Each test failed on the code
before its fix (its docstring says how)."""

import errno
import importlib.util
import os
import re
from pathlib import Path

import pytest

from conftest import ROOT
from dpotrain.cluster import run_lock
from dpotrain.recipe.errors import ConfigError, run_cli


def unreadable_file(monkeypatch, path: Path) -> None:
    """`path` opens with EACCES, as a 0600 file of another user's does (these tests may run as root, who reads it)."""
    read_bytes = Path.read_bytes

    def refused(self, *args, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return read_bytes(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_bytes", refused)


def another_users_lock(out: Path, monkeypatch) -> Path:
    """A live run's lock in `out` (this process's, its heartbeat stopped), unreadable to this process."""
    assert run_lock.acquire(out) is None
    held = run_lock._held.pop()
    held._stop.set()
    unreadable_file(monkeypatch, out / run_lock.LOCK_FILE)
    return out / run_lock.LOCK_FILE


def lock_line(lock: Path) -> str:
    return (
        f"error: the lock {lock} could not be read (Permission denied), so whether a live run holds {lock.parent} "
        f"cannot be told: it is another user's run's (ask them: they remove it once that run has ended), or fix its "
        f"permissions (chmod a+r {lock}); then run the same command again"
    )


def test_a_lock_another_user_left_unreadable_is_one_line_naming_it_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A run on a folder whose run.lock is 0600 and another user's: `check_free` (every run's look, before it takes
    the lock) raised the PermissionError, a traceback of the lock's code. Now the lock's refusal of its kind (exit 2),
    naming the lock and the fix; the lock is left as it was. (Old code: PermissionError raised out of run_cli.)"""
    lock = another_users_lock(tmp_path / "run", monkeypatch)
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: run_lock.check_free(tmp_path / "run"))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "Traceback" not in err, err
    assert err.strip() == lock_line(lock), err
    assert lock.exists()


def test_a_run_whose_own_lock_was_made_unreadable_ends_on_its_own_outcome_the_lock_kept(tmp_path, monkeypatch):
    """The run's own lock made unreadable while it ran (chmod 600 by another user's hand): `release`, in
    train_dpo.main's finally, raised the lock's refusal (a PermissionError before), hiding how the run ended. Now the
    lock is kept, as a folder turned read-only keeps it (the rerun takes it over: its process is gone). (Old code:
    ConfigError raised out of release.)"""
    out = tmp_path / "run"
    assert run_lock.acquire(out) is None
    unreadable_file(monkeypatch, out / run_lock.LOCK_FILE)
    run_lock.release()
    assert (out / run_lock.LOCK_FILE).exists() and not run_lock._held


def test_push_to_hub_refuses_a_run_whose_lock_it_cannot_read_in_one_line(tmp_path, monkeypatch):
    """push_to_hub.py on a run folder whose run.lock it may not read: `check_no_live_run` (before the push, outside
    main's try) raised the PermissionError as a traceback. Now refused as a live run's lock is, naming the lock and
    the fix. (Old code: PermissionError raised.)"""
    spec = importlib.util.spec_from_file_location("push_to_hub", ROOT / "scripts" / "push_to_hub.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lock = another_users_lock(tmp_path / "run", monkeypatch)
    with pytest.raises(ConfigError) as refused:
        script.check_no_live_run(tmp_path / "run")
    assert f"error: {refused.value}" == lock_line(lock)


def rotated_run(tmp_path) -> Path:
    """A run's folder with its own complete checkpoints 2 and 4, listed complete in its record."""
    from conftest import sealed_checkpoint
    from dpotrain.train import run_files

    out = tmp_path / "run"
    for step in (2, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
        run_files.completed(out, f"checkpoint-{step}")
    return out


@pytest.mark.parametrize("fault", ["damaged", "EIO"])
def test_rotation_whose_record_cannot_be_read_keeps_every_folder_and_says_why_once(
    tmp_path, monkeypatch, capsys, fault
):
    """run_files.json unreadable at a save's rotation (a damaged record; an EIO): `run_files.read` raised its
    ConfigError ("pass another --output_dir") out of rotation, from the main process's save, and the whole run ended
    there (every rank, by main_outcome). Now rotation deletes nothing, every folder kept, and says why once over two
    saves. (Old code: ConfigError raised out of rotate.)"""
    from dpotrain.train.checkpoints import rotate
    from dpotrain.train.run_files import MANIFEST

    out = rotated_run(tmp_path)
    record = out / MANIFEST
    if fault == "damaged":
        record.write_text('{"names": ["checkpoint-2", ')
    else:
        read_bytes = Path.read_bytes

        def failing(self, *args, **kwargs):
            if self == record:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
            return read_bytes(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_bytes", failing)
    assert rotate(out, 1) == [] and rotate(out, 1) == []
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    said = capsys.readouterr().out
    assert said.count(f"Rotation deleted nothing in {out}: {record} is unreadable (") == 1, said
    assert said.rstrip().endswith(
        "so no checkpoint there can be told the run's and none is deleted: restore it from a copy, or remove the "
        "checkpoints save_total_limit lets go yourself; a later save reads it again"
    ), said


def test_the_disk_full_line_is_said_when_the_checkpoints_cannot_be_listed(tmp_path, monkeypatch):
    """A checkpoint that did not fit, checkpoint-2's COMPLETE mark unanswered (ESTALE) as the line was made: the look's
    OSError was raised in place of the disk-full line, and in `_save_checkpoint` before the ranks' all-gather, on that
    rank alone (the others waited in it). Now the line is said, its list of checkpoints "could not be listed" with the
    cause; so for the final model's and another write's. (Old code: OSError raised by save_failed.)"""
    from conftest import failing_stat
    from dpotrain.train import disk_full
    from dpotrain.train.checkpoints import MARKER

    out = rotated_run(tmp_path)
    (out / "checkpoint-6").mkdir()
    failing_stat(monkeypatch, out / "checkpoint-2" / MARKER)
    why = disk_full.FULL[errno.ENOSPC]
    listed = f"its checkpoints could not be listed (OSError: [Errno {errno.ESTALE}] {os.strerror(errno.ESTALE)}: "
    said = str(disk_full.save_failed(out / "checkpoint-6", why))
    assert said.startswith(f"{why}: checkpoint-6 could not be written in {out} (") and listed in said, said
    said = str(disk_full.final_save_failed(out, why))
    assert said.startswith(f"{why}: the final model could not be written in {out} (") and listed in said, said
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "samples.jsonl"))
    said = str(disk_full.write_failed(error, why))
    assert said.startswith(f"{why}: {out / 'samples.jsonl'} could not be written (") and listed in said, said


def test_an_input_inside_the_output_folder_whose_look_was_unanswered_is_not_passed_over(tmp_path, monkeypatch):
    """model_name_or_path a folder inside output_dir, its look unanswered (ESTALE): Python 3.14's exists() said False,
    so the "reads its own output folder" refusal was skipped and the run went on to remove files it then loads. Now
    the look is raised (the command's one line, `errors.unanswered`), as every look whose False would lose files;
    the file server answering again, the refusal. (Old code: no refusal, no error.)"""
    from conftest import failing_stat
    from dpotrain import output_folder
    from dpotrain.recipe.config import parse_args

    out, model = tmp_path / "run", tmp_path / "run" / "model"
    model.mkdir(parents=True)
    recipe = parse_args(
        ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out), "--model_name_or_path", str(model)]
    )
    with monkeypatch.context() as patched:
        failing_stat(patched, model)
        with pytest.raises(OSError, match=re.escape(f"[Errno {errno.ESTALE}]")):
            output_folder.check_reads_outside(recipe)
    with pytest.raises(ConfigError, match=re.escape(f"model_name_or_path {str(model)!r} is in output_dir")):
        output_folder.check_reads_outside(recipe)


def test_push_to_hub_skips_its_note_on_checkpoints_it_cannot_count_and_pushes_on(tmp_path, monkeypatch, capsys):
    """push_to_hub.py without --checkpoints counts the run's checkpoints on disk only for a note ("1 checkpoint on disk
    is not pushed: add --checkpoints ..."); a checkpoint folder's look unanswered (ESTALE) there raised, ending the
    push before main. Now the note says they could not be counted and the command goes on (here a stopped run: its
    closing line). (Old code: OSError raised out of push.)"""
    from conftest import failing_stat

    spec = importlib.util.spec_from_file_location("push_to_hub", ROOT / "scripts" / "push_to_hub.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = rotated_run(tmp_path)
    failing_stat(monkeypatch, out / "checkpoint-2")
    assert script.push(None, out, "me/dpo-test", "hf_x", False, False, finished=False) == []
    said = capsys.readouterr().out
    assert "The run's checkpoints could not be counted (OSError: [Errno 116] Stale file handle" in said, said
    assert "add --checkpoints to push any not pushed yet" in said and f"{out} has not finished training" in said, said

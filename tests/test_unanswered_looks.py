"""A look the file server did not answer (NFS's ESTALE, an EIO) is no file gone. On Python 3.14 Path.exists(),
is_file() and is_dir() say False for every OSError (cpython gh-118243), not only a missing path; where that False led
to a deletion, an overwrite, a fresh start or a checkpoint passed over, the look is `writes.looked`'s, which says
"missing" only for FileNotFoundError/NotADirectoryError and raises any other OSError. Each test emulates Python 3.14
(`failing_stat`) with one path's stat failing, and each failed on the code before `writes.looked` (its docstring says
how)."""

import errno
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from conftest import ROOT, failing_stat, sealed_checkpoint
from dpotrain.cluster import run_lock
from dpotrain.recipe.errors import ConfigError, run_cli
from dpotrain.train import run_files

ESTALE = f"[Errno {errno.ESTALE}] {os.strerror(errno.ESTALE)}"


def own_checkpoints(out, *steps):
    for step in steps:
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")


def test_rotation_never_deletes_a_complete_checkpoint_whose_mark_it_could_not_look_at(tmp_path, monkeypatch, capsys):
    """checkpoint-4's COMPLETE mark unanswered: `is_complete` said False, and rotation deleted the newest complete
    checkpoint as one cut short, keeping the older. (Old code: checkpoint-4 removed, `[checkpoint-4]` returned.) Nor
    is the look's OSError raised out of rotation, which ended the whole run from the main process's save (before:
    raised); the folder is kept, said once, and the others rotated as they would be."""
    from dpotrain.train.checkpoints import MARKER, rotate

    out = tmp_path / "run"
    own_checkpoints(out, 2, 4)
    with monkeypatch.context() as patched:
        failing_stat(patched, out / "checkpoint-4" / MARKER)
        assert rotate(out, 1) == []
        assert rotate(out, 1) == []
    assert (out / "checkpoint-4" / MARKER).is_file() and (out / "checkpoint-4" / "model.safetensors").is_file()
    assert (out / "checkpoint-2" / MARKER).is_file()
    said = capsys.readouterr().out
    assert said.count(f"Kept {out / 'checkpoint-4'}: its {MARKER} mark could not be looked at (OSError: ") == 1, said
    assert said.endswith("so rotation cannot tell whether save_total_limit lets it go; a later save looks again\n")


def test_rotation_says_the_fix_of_a_folder_it_could_not_remove_whose_mark_it_could_not_look_at(
    tmp_path, monkeypatch, capsys
):
    """checkpoint-2's removal failed (ESTALE, its folder stale) and the look at its mark in rotation's `except` raised
    the same error: the "mend its file system" line was never said and the run ended (old code: the OSError raised
    out of rotate). It stays, still listed complete, its fix said."""
    from dpotrain.train.checkpoints import MARKER, rotate

    out = tmp_path / "run"
    own_checkpoints(out, 2, 4)
    for step in (2, 4):
        run_files.completed(out, f"checkpoint-{step}")
    folder, unlink = out / "checkpoint-2", Path.unlink

    def going_stale(path, *args, **kwargs):  # as rotation's removal unlinks the mark, the folder goes stale
        unlink(path, *args, **kwargs)
        if path == folder / MARKER:
            failing_stat(patched, folder / MARKER)
            failing_stat(patched, folder / "model.safetensors")  # the removal's listing of the folder's files

    with monkeypatch.context() as patched:
        patched.setattr(Path, "unlink", going_stale)
        assert rotate(out, 1, keep=(out / "checkpoint-4",)) == []
    assert (out / "checkpoint-2" / "model.safetensors").is_file()
    assert "checkpoint-2" in run_files.completed(out)
    said = capsys.readouterr().out
    assert f"Could not remove {out / 'checkpoint-2'} (OSError: " in said, said
    assert "mend its file system (an I/O error or a stale mount, not a permission: ask your admins)" in said


def test_a_resume_never_passes_over_a_checkpoint_whose_file_it_could_not_look_at(tmp_path, monkeypatch):
    """checkpoint-4's weights unanswered: the manifest's check said "model.safetensors is missing", the resume went back
    to checkpoint-2 and the rotation after its first save deleted checkpoint-4 as damaged. (Old code: checkpoint-2
    returned.)"""
    from dpotrain.train.resume import latest_sound_checkpoint

    out = tmp_path / "run"
    own_checkpoints(out, 2, 4)
    with monkeypatch.context() as patched:
        failing_stat(patched, out / "checkpoint-4" / "model.safetensors")
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            latest_sound_checkpoint(out)
    assert latest_sound_checkpoint(out) == out / "checkpoint-4"  # the file server answers again


@pytest.mark.slow
def test_a_resume_never_passes_over_a_checkpoint_this_job_may_not_read(tmp_path):
    """checkpoint-4's optimizer.pt not readable by this job (another user's file, mode 600): its checksum could not be
    read, the resume said "optimizer.pt is unreadable (Permission denied)", went on from checkpoint-2 and deleted the
    sound checkpoint-4 as it saved step 4 again ("Removed ... of an earlier attempt (complete)"). Now refused on every
    rank with the fix. Read in a process without root's bypass of file modes (CI runs as root). (Old code: checkpoint-2
    returned.)"""
    import subprocess
    import sys

    out = tmp_path / "run"
    own_checkpoints(out, 2, 4)
    (out / "checkpoint-4" / "optimizer.pt").chmod(0)
    confirm = f"from dpotrain.train import resume; print(resume.confirm({str(out / 'checkpoint-4')!r}, False))"
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    command = [*(drop if os.geteuid() == 0 else []), sys.executable, "-c", confirm]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and not result.stdout.strip(), result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        f"RunError: {out / 'checkpoint-4' / 'optimizer.pt'} cannot be read by this job (Permission denied): a "
        "checkpoint this job cannot read is not passed over as damaged (the run would go on from an older one and "
        f"delete it): make it readable (chmod -R a+rX {out / 'checkpoint-4'}, or ask its owner), then rerun"
    ) in result.stderr, result.stderr[-2000:]
    (out / "checkpoint-4" / "optimizer.pt").chmod(0o644)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == str(out / "checkpoint-4"), result.stderr[-2000:]


def test_a_finished_run_whose_mark_could_not_be_looked_at_is_not_trained_again(tmp_path, monkeypatch):
    """run_complete.json unanswered: the finished run was taken for one that never trained there, and trained again
    over its final model. (Old code: `OutputDecision(None, False)`, a fresh run in the finished run's folder.)"""
    from dpotrain import resolve
    from dpotrain.hub.hub import RUN_COMPLETE
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out)])
    run_files.write(out, [run_files.MANIFEST, RUN_COMPLETE, "model.safetensors"])
    (out / RUN_COMPLETE).write_text(json.dumps({}))
    (out / "model.safetensors").write_text("the finished run's model\n")
    with monkeypatch.context() as patched:
        failing_stat(patched, out / RUN_COMPLETE)
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            resolve.check_output_dir(recipe)


def test_a_persons_file_the_file_server_did_not_answer_for_is_never_taken_for_none(tmp_path, monkeypatch):
    """A person's samples.jsonl (not in the run's record) unanswered: taken for no file, it was not moved aside, and
    the run wrote its own over it. (Old code: False returned, the file left where the run writes.)"""
    out = tmp_path / "run"
    run_files.write(out, [run_files.MANIFEST])
    (out / "samples.jsonl").write_text("a person's notes\n")
    with monkeypatch.context() as patched:
        failing_stat(patched, out / "samples.jsonl")
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            run_files.set_aside_if_not_own(out, "samples.jsonl")
    assert (out / "samples.jsonl").read_text() == "a person's notes\n"


def test_a_run_from_before_records_whose_mark_could_not_be_looked_at_is_not_replaced_unrecorded(tmp_path, monkeypatch):
    """A finished run from before runs recorded their files, its run_complete.json unanswered: not seen as a run, so
    --overwrite_output_dir was not refused, and the new run wrote over its files. (Old code: no refusal, no error.)"""
    from dpotrain import output_folder
    from dpotrain.hub.hub import RUN_COMPLETE

    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_COMPLETE).write_text("{}")
    (out / "model.safetensors").write_text("the old run's model\n")
    with monkeypatch.context() as patched:
        failing_stat(patched, out / RUN_COMPLETE)
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            output_folder.check_replaceable(str(out), start_afresh=True)


def test_a_run_folder_that_could_not_be_looked_at_still_has_its_others_checkpoints_refused(tmp_path, monkeypatch):
    """The output folder unanswered: taken for no folder, so no run's, and a person's checkpoint-3 where the run saves
    its own was not refused, then cleared at the save. (Old code: no refusal, no error.)"""
    from dpotrain import output_folder

    out = tmp_path / "run"
    own_checkpoints(out, 2)
    sealed_checkpoint(out / "checkpoint-3")  # not in the run's record: a person's
    with monkeypatch.context() as patched:
        failing_stat(patched, out)
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            output_folder.check_checkpoints_of_others(str(out), None, 10)


@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub, this process's huggingface_hub online (as tests/test_hub_push.py's `hub_in_process`)."""
    from huggingface_hub import constants

    from hub_server import StandInHub

    server = StandInHub()
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    yield server
    server.close()


def test_push_to_hub_records_a_checkpoint_whose_mark_it_could_not_look_at(hub, tmp_path, monkeypatch, capsys):
    """push_to_hub.py --checkpoints, checkpoint-2's COMPLETE unanswered: "Skipped checkpoint-2: no COMPLETE mark", no
    record, the command's summary without it. Now recorded failed with its cause, and said. (Old code: no record.)"""
    from huggingface_hub import HfApi

    from dpotrain.hub import hub_push
    from dpotrain.train.checkpoints import MARKER

    out = tmp_path / "run"
    own_checkpoints(out, 2)
    mark = out / "checkpoint-2" / MARKER
    with monkeypatch.context() as patched:
        failing_stat(patched, mark)
        hub_push.push_checkpoints(HfApi(endpoint=hub.endpoint, token="hf_x"), out, "me/dpo-test")
    [record] = hub_push.read_pushes(out)
    assert record["status"] == "failed" and record["step"] == 2, record
    assert record["error"] == f"it could not be read (OSError: {ESTALE}: '{mark}')", record
    assert "checkpoint-2 was not pushed to me/dpo-test@step-2: it could not be read" in capsys.readouterr().err


def test_the_left_checkpoints_unlisted_on_rank_0_are_a_warning_not_an_error_out_of_on_train_begin(
    tmp_path, monkeypatch, capsys
):
    """`submit_left`, run on rank 0 alone as training begins: a checkpoint folder unanswered was passed over without a
    word on Python 3.14, and its OSError (3.10-3.13, and `writes.looked`) ended rank 0 alone while the other ranks
    waited in their next collective. Now a warning naming the command that pushes them later. (Old code: no warning.)"""
    from dpotrain.hub.hub_push import CheckpointPusher, push_command

    out = tmp_path / "run"
    own_checkpoints(out, 2)
    pusher = CheckpointPusher("me/dpo-test", "hf_x", None, out)
    with monkeypatch.context() as patched:
        failing_stat(patched, out / "checkpoint-2")
        pusher.submit_left()
    said = capsys.readouterr().err
    assert "the checkpoints an earlier job left unpushed to me/dpo-test could not be listed (OSError: " in said, said
    assert f"`{push_command(out, '--checkpoints')}` pushes them later" in said
    assert pusher.pending == {}


def test_a_saves_model_folder_that_could_not_be_looked_at_is_not_taken_for_none(tmp_path, monkeypatch):
    """The checkpoint's model save, written into a folder of its own and moved up into the checkpoint: that folder
    unanswered, its files were left where no resume loads them, and the sealed checkpoint named no model files (never
    pushed). (Old code: () returned, the weights left in the subfolder.)"""
    from dpotrain.train.trainer import moved_up

    written = tmp_path / "checkpoint-2" / "model"
    written.mkdir(parents=True)
    (written / "model.safetensors").write_text("weights\n")
    with monkeypatch.context() as patched:
        failing_stat(patched, written)
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            moved_up(written)
    assert moved_up(written) == ("model.safetensors",)  # the file server answers again
    assert (tmp_path / "checkpoint-2" / "model.safetensors").read_text() == "weights\n"


def test_a_report_path_that_could_not_be_looked_at_is_not_taken_for_no_input(tmp_path, monkeypatch):
    """The analyzer's report path a link to its data file, the link unanswered: taken for no file, it was not found to
    be the input, and the report was written over the data. (Old code: no refusal, no error.)"""
    from dpotrain.recipe import writes

    data = tmp_path / "pairs.jsonl"
    data.write_text("{}\n")
    report = tmp_path / "report.json"
    report.symlink_to(data)
    with monkeypatch.context() as patched:
        failing_stat(patched, report)
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            writes.check_not_input("--json", str(report), [data.resolve()])


def test_a_health_stop_whose_record_could_not_be_looked_at_is_not_resumed_past(tmp_path, monkeypatch):
    """health_stop.json unanswered: `after_health_stop` took the run a health guard stopped for one never stopped, and
    the rerun resumed on the values it stopped on. (Old code: False returned, nothing raised.)"""
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.resume import HEALTH_STOP, after_health_stop

    out = tmp_path / "run"
    out.mkdir()
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out)])
    (out / HEALTH_STOP).write_text(json.dumps({"guard": "loss_floor", "step": 3, "message": "m", "fatal": False}))
    with monkeypatch.context() as patched:
        failing_stat(patched, out / HEALTH_STOP)
        with pytest.raises(OSError, match=re.escape(ESTALE)):
            after_health_stop(recipe, out)
    with pytest.raises(Exception, match="loss_floor guard stopped it at step 3"):
        after_health_stop(recipe, out)  # the file server answers again: refused, as the stop asks


def test_a_run_whose_look_was_not_answered_ends_on_one_line_naming_the_file_and_the_fix(tmp_path, monkeypatch, capsys):
    """A look the file server did not answer is raised rather than taken for a file gone; the command then ends on one
    line (exit 1) naming the file, that nothing was taken for gone, and the fix, not a traceback of the run's code.
    (Old code: the OSError's traceback.)"""
    import train_dpo
    from dpotrain.hub.hub import RUN_COMPLETE
    from dpotrain.recipe.errors import run_cli

    out = tmp_path / "run"
    run_files.write(out, [run_files.MANIFEST, RUN_COMPLETE])
    (out / RUN_COMPLETE).write_text(json.dumps({}))
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out), "--dry-run"]
    with monkeypatch.context() as patched:
        failing_stat(patched, out / RUN_COMPLETE)
        with pytest.raises(SystemExit) as ended:
            run_cli(lambda: train_dpo.main(argv))
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {out / RUN_COMPLETE} could not be read (Stale file handle): "), line
    assert "nothing was taken for gone" in line and "run the same command again once it answers" in line
    assert (out / RUN_COMPLETE).is_file()


def test_a_link_to_itself_is_no_file_as_pythons_own_looks_say(tmp_path):
    """`writes.looked` raises only what the file server left unanswered: a link looping to itself (ELOOP), which Python
    3.10-3.13's Path.is_file() takes for no file, is none here too, not an error that ends a rotation or a run's
    start. (Old code: `[Errno 40] Too many levels of symbolic links` raised.)"""
    from dpotrain.recipe import writes

    loop = tmp_path / "model.safetensors"
    loop.symlink_to(loop)
    assert not writes.is_file(loop) and not writes.exists(loop) and writes.looked(loop) is None
    assert not writes.is_file(tmp_path / "missing") and writes.is_dir(tmp_path)


# Looks and records that still raised where a line was owed or a kept folder was (session 47): a lock another user's
# run left unreadable, rotation's record unreadable, the disk-full line's list of checkpoints, an input path whose look
# was unanswered, a count for a note. Each test failed on the code before its fix (its docstring says how).


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
    from types import SimpleNamespace

    from dpotrain.train.checkpoints import rotate_recorded
    from dpotrain.train.run_files import MANIFEST

    out = rotated_run(tmp_path)
    args, state = SimpleNamespace(output_dir=str(out), save_total_limit=1), SimpleNamespace(best_model_checkpoint=None)
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
    for _ in range(2):  # two saves, each with its rotation and the record's update after it (nothing to unlist)
        rotate_recorded(args, state, out / "checkpoint-4")
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    said = capsys.readouterr().out
    assert said.count(f"Rotation deleted nothing in {out}: {record} is unreadable (") == 1, said
    assert said.rstrip().endswith(
        "so no checkpoint there can be told the run's and none is deleted: restore it from a copy, or remove the "
        "checkpoints save_total_limit lets go yourself; a later save reads it again"
    ), said
    assert "still names" not in said, said  # the record's update after a rotation that deleted nothing: no line


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

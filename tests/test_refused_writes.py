"""Writes and reads the file system refuses while a run holds its folder: the lock's heartbeat refresh (it died on
one failure), the lock's taking on the main process (its failure left the other ranks waiting), the disk-full line's own
reads (it raised while it was made), and the final save refused for a reason no full disk explains. Each test failed
on the code before its fix (its docstring says how)."""

import errno
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from test_unanswered_looks import unreadable_file

from conftest import PYTHON, ROOT, rank_python, torchrun_launch
from dpotrain.cluster import run_lock


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EACCES], ids=["ESTALE", "EACCES"])
def test_a_heartbeat_whose_refresh_fails_says_so_once_and_refreshes_again_once_it_can(
    tmp_path, monkeypatch, capsys, code
):
    """The heartbeat's refresh raised (the lock unanswered, ESTALE; made unreadable, `_read`'s ConfigError): the thread
    ended with a thread traceback, the lock's time stopped, and after STALE_S another run could take the folder over
    while this one trained. Now one line naming the lock and the cause, and the next beat refreshes it. Run by
    construction: the thread stopped first, its own loop run here with no wait, stopped by the third look. (Old code,
    HEARTBEAT_S set to 0: the OSError raised out of `_refresh`.)"""
    out = tmp_path / "run"
    assert run_lock.acquire(out) is None
    held = run_lock._held.pop()
    held._stop.set()  # the thread's own loop ends at its first wait: the beats below are this test's alone
    held._thread.join()
    held._stop.clear()
    lock = out / run_lock.LOCK_FILE
    os.utime(lock, (1, 1))  # a time the refresh moves
    read_bytes, looks = Path.read_bytes, []

    def unanswered_twice(path, *args, **kwargs):
        if path == lock:
            looks.append(path)
            if len(looks) <= 2:
                raise OSError(code, os.strerror(code), str(path))  # EACCES: a PermissionError
            held._stop.set()  # the third beat's look answers, and is the last
        return read_bytes(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_bytes", unanswered_twice)
    try:
        held._refresh(0)
    finally:
        monkeypatch.undo()
    refreshed = lock.stat().st_mtime
    held.release()
    kind = "PermissionError" if code == errno.EACCES else "OSError"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(looks) == 3 and held.lost is None and refreshed > 1
    assert warnings == [
        f"warning: the lock {lock} could not be refreshed ({kind}: [Errno {code}] {os.strerror(code)}: '{lock}'): "
        f"tried again every 0 s; should it stay so for {run_lock.STALE_S} s, another run may take {out} "
        "over while this one trains"
    ], warnings


def test_a_heartbeat_at_a_lock_another_user_now_holds_stops_the_run_not_retries(tmp_path, monkeypatch, capsys):
    """The run's lock removed by hand (a folder that looked stuck) and the folder taken by a colleague's run, whose
    lock (umask 077) this user cannot read: the heartbeat said "could not be refreshed ... tried again", and both runs
    trained on in one folder. Another file than the one the run made (stat tells it, unread: its inode, or its owner
    where it took the removed one's inode) is lost, and the run stops at its step's end as for any lock taken. The
    run's own file stays its own: a refresh that failed, said and retried. Its read refused as a 0600 file's is. (Old
    code: the refusal raised out of `beat`, retried, `lost` never set.)"""
    import pickle

    out = tmp_path / "run"
    assert run_lock.acquire(out) is None
    held = run_lock._held.pop()
    held._stop.set()
    held._thread.join()
    lock = out / run_lock.LOCK_FILE
    unreadable_file(monkeypatch, lock)  # read as a 0600 file of another user's is
    with pytest.raises(run_lock.LockUnreadable) as unread:  # the run's own: a failed refresh, said and retried
        held.beat()
    assert held.lost is None
    lock.unlink()  # removed by hand, and a colleague's run took the folder: its own lock, another file
    lock.write_text('{"host": "other", "pid": 1}')  # which may take the removed file's inode
    if os.getuid() == 0:
        os.chown(lock, 12345, 12345)  # the colleague's
    elif (lock.stat().st_dev, lock.stat().st_ino, lock.stat().st_uid) == held.file:
        pytest.skip("the new file took the removed one's inode, and only root can give it another owner")
    assert held.beat() is False
    assert held.lost.startswith("taken by another user's run (uid "), held.lost
    assert held.lost.endswith("), whose lock this run cannot read"), held.lost
    shared = pickle.loads(pickle.dumps(unread.value))  # as `main_outcome` shares it with every rank
    assert type(shared) is run_lock.LockUnreadable and str(shared) == str(unread.value)
    assert isinstance(shared.error, PermissionError)
    monkeypatch.undo()
    held.release()
    assert lock.read_text() == '{"host": "other", "pid": 1}'  # never another run's lock removed


def test_a_lock_the_file_system_takes_none_of_is_no_lock(tmp_path, monkeypatch):
    """A write that returns 0 (a file system that takes nothing and says nothing) looped for ever writing the lock."""
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(OSError, match="the file system wrote none of it"):
        run_lock._create(tmp_path / "run.lock", b"{}")


TAKE = textwrap.dedent("""
    import errno, os, resource, sys
    from datetime import timedelta
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from dpotrain.cluster import run_lock
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    if rank == 0:  # the main process's node refuses every byte written: the lock's (the other rank writes none)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        run_lock.take({folder!r})
        dist.barrier()  # the run's next collective
        said = "taken"
    except OSError as e:
        said = f"refused: {{errno.errorcode[e.errno]}}"
    except RuntimeError as e:  # gloo: the main process ended while this rank waited for it
        said = "left waiting in the broadcast"
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # what it says, written
    with open(os.path.join({out!r}, f"rank{{rank}}.txt"), "w") as f:  # one file each: the pipe interleaves lines
        f.write(said)
""")


@pytest.mark.slow
def test_a_lock_the_main_process_cannot_write_ends_every_rank(tmp_path):
    """The main process alone takes the run's lock, then broadcasts its outcome: a write the disk refused there
    (`acquire` raising: a file size limit of 0 here, a read-only folder, ESTALE) ended the main process before the
    broadcast, and the other ranks waited in it (NCCL: ddp_timeout). Now the outcome is `main_outcome`'s: every rank
    raises the main's error. (Old code: rank 1 'left waiting in the broadcast', gloo's error once rank 0 ended.)"""
    out = tmp_path / "said"
    out.mkdir()
    script = tmp_path / "take.py"
    script.write_text(TAKE.format(root=str(ROOT), folder=str(tmp_path / "run"), out=str(out)))
    cmd = [*torchrun_launch(), "--standalone", "--nproc_per_node", "2", *rank_python(), str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    said = {p.name: p.read_text() for p in sorted(out.iterdir())}
    assert said == {"rank0.txt": "refused: EFBIG", "rank1.txt": "refused: EFBIG"}, result.stderr[-3000:]
    assert not (tmp_path / "run" / run_lock.LOCK_FILE).exists()


CUT_SHORT = textwrap.dedent("""
    import errno, resource, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from dpotrain.cluster import run_lock
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # the lock's first 16 bytes written, then EFBIG
    try:
        run_lock.acquire(Path({folder!r}))
        said = "taken"
    except OSError as e:
        said = f"refused: {{errno.errorcode[e.errno]}} {{e.filename}}"
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print(said)
""")


def test_a_lock_written_cut_short_fails_the_take(tmp_path):
    """A file size limit (or a disk filling as it was written) let the lock's one `os.write` write part of it and
    return: the take succeeded with a lock of 16 bytes, and the first heartbeat found it "no longer this run's" and
    stopped the run. Now the rest is written, the limit's EFBIG fails the take naming the lock, and no part of it is
    left. (Old code: "taken", run.lock its first 16 bytes.)"""
    folder = tmp_path / "run"
    script = tmp_path / "take.py"
    script.write_text(CUT_SHORT.format(root=str(ROOT), folder=str(folder)))
    # A cold interpreter: the script imports the lock alone (0.1 s), where python()'s warm server, started for it in
    # the fast tier, imports torch and transformers first (~8 s)
    result = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    lock = folder / run_lock.LOCK_FILE
    assert result.stdout.strip() == f"refused: EFBIG {lock}", result.stderr[-3000:]
    assert not lock.exists()


def test_the_disk_full_line_is_said_when_the_free_space_and_the_last_manifest_cannot_be_read(tmp_path, monkeypatch):
    """A checkpoint that did not fit, the disk's free space and the last complete checkpoint's manifest unanswered
    (ESTALE) as the line was made: `shutil.disk_usage`'s and `total_bytes`' OSError were raised in place of the
    disk-full line, and in `_save_checkpoint` before the ranks' all-gather, on that rank alone. Now the line is said,
    each part that failed said as its cause; so for the final model's and another write's. (Old code: OSError raised
    by save_failed, final_save_failed and write_failed.)"""
    import shutil

    from conftest import sealed_checkpoint
    from dpotrain.train import checkpoint_manifest, disk_full, run_files

    out = tmp_path / "run"
    for step in (2, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
        run_files.completed(out, f"checkpoint-{step}")
    (out / "checkpoint-6").mkdir()
    (out / "checkpoint-6" / "model.safetensors").write_bytes(b"\0" * 2048)
    unanswered = f"OSError: [Errno {errno.ESTALE}] {os.strerror(errno.ESTALE)}"

    def no_answer(path, *args, **kwargs):
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))

    manifest, read_text = out / "checkpoint-4" / checkpoint_manifest.MANIFEST, Path.read_text
    monkeypatch.setattr(shutil, "disk_usage", no_answer)
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: no_answer(p) if p == manifest else read_text(p, *a, **k))
    why = disk_full.FULL[errno.ENOSPC]
    said = str(disk_full.save_failed(out / "checkpoint-6", why))
    assert said == (
        f"{why}: checkpoint-6 could not be written in {out} (its free space unknown ({unanswered}: '{out}'); a "
        f"checkpoint takes more than the 2.0 KiB written before it failed (checkpoint-4's manifest could not be read: "
        f"{unanswered}: '{manifest}')): free space there (or lower --save_total_limit), then rerun; checkpoint-4 is "
        "kept, and the same command goes on from it"
    ), said
    said = str(disk_full.final_save_failed(out, why))
    assert said.startswith(f"{why}: the final model could not be written in {out} (its free space unknown ("), said
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "samples.jsonl"))
    said = str(disk_full.write_failed(error, why))
    assert said.startswith(f"{why}: {out / 'samples.jsonl'} could not be written (its free space unknown ("), said


def test_the_disk_full_line_offers_a_lower_save_total_limit_only_where_it_frees_room(tmp_path):
    """A checkpoint that did not fit beside the one complete checkpoint kept (save_total_limit 1, or the first save
    past save_total_limit 2's first): the line said "free space there (or lower --save_total_limit)", and the rerun
    with the limit lowered (to 1: 0 is refused) failed at the same save, since the newest complete one stays until the
    next is marked. Offered only where two or more complete ones are kept."""
    from conftest import sealed_checkpoint
    from dpotrain.train import disk_full, run_files

    out = tmp_path / "run"
    why = disk_full.FULL[errno.ENOSPC]
    for step, offered in ((2, False), (4, True)):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
        run_files.completed(out, f"checkpoint-{step}")
        said = str(disk_full.save_failed(out / "checkpoint-6", why))
        assert ("free space there (or lower --save_total_limit), then rerun;" in said) is offered, said
        assert "free space there" in said and f"checkpoint-{step} is kept" in said, said


# A write under `folder` (a file opened by Python: the final model's config.json, a checkpoint's torch.save'd states)
# refused by something no full disk explains: EACCES in a folder whose mode lets this process write (os.access says
# yes), as NFS's root squash gives; an EIO, as a failing or stale mount gives with room on its disk.
REFUSING = textwrap.dedent("""
    import errno, os, runpy, sys
    sys.path.insert(0, {root!r})
    sys.argv[0] = {train!r}

    def at_open(event, args):
        if event == "open" and {folder!r} in str(args[0]) and any(m in str(args[1]) for m in "wax+"):
            raise {error}(errno.{code}, os.strerror(errno.{code}), str(args[0]))

    sys.addaudithook(at_open)
    runpy.run_path({train!r}, run_name="__main__")
""")


@pytest.mark.slow
@pytest.mark.parametrize(
    "folder, error, code, steps, said",
    [
        ("/.final_model/", "PermissionError", "EACCES", 1, "the final model could not be written in {out} ("),
        ("/checkpoint-2/", "OSError", "EIO", 2, "checkpoint-2 could not be written in {out} ("),
    ],
    ids=["final model", "checkpoint"],
)
def test_a_write_the_file_system_refuses_for_another_reason_is_one_line_and_the_rerun_goes_on(
    folder, error, code, steps, said, tmp_path, tiny_model_dir
):
    """The final save, or a checkpoint's, refused by something no full disk explains (a PermissionError in a folder
    whose mode allows the write: root squashed on NFS; an EIO with room on the disk): raised as it was, it ended a
    finished training in a traceback, and a checkpoint's was said as a file that "could not be read" naming no rerun
    (`errors.unanswered`). Now one line naming what could not be written, the error, the fix and what the rerun does,
    and the rerun does it: it goes on from checkpoint-1 and saves the final model. (Old code: a traceback of the
    PermissionError; "...checkpoint-2/.model_save/config.json could not be read (Input/output error): ...".)"""
    from conftest import python, smoke_command

    wrapper = tmp_path / "wrapper.py"
    train = str(ROOT / "train_dpo.py")
    wrapper.write_text(REFUSING.format(root=str(ROOT), train=train, folder=folder, error=error, code=code))
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "steps", "--save_steps", "1"]
    args += ["--warmup_steps", "0", "--report_to", "none"]
    refused = smoke_command([python(), str(wrapper)], tiny_model_dir, *args)
    refused.remove(train)  # the wrapper runs it
    result = subprocess.run(refused, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    number = getattr(errno, code)
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"error: {said.format(out=out)}{error}: [Errno {number}] {os.strerror(number)}: "), last
    assert last.endswith(
        "): fix what refused the write (the file system's health, the folder's permissions: ask your admins if it "
        "stays), then rerun; "
        + (
            "the same command goes on from checkpoint-1"
            if steps == 1
            else "checkpoint-1 is kept, and the same command goes on from it"
        )
    ), last
    rerun = subprocess.run(
        smoke_command([python()], tiny_model_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"Resuming from {out / 'checkpoint-1'}" in rerun.stdout, rerun.stdout[-3000:]
    assert (out / "run_complete.json").is_file() and (out / "config.json").is_file()


def test_a_final_model_torch_save_could_not_write_is_one_line_and_other_runtime_errors_stay(tmp_path):
    """torch.save's failed write (training_args.bin, in the final save) is a RuntimeError whose text alone says so
    ('[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598', raised as it closes the file, after
    'basic_ios::clear: iostream error'; or '... PytorchStreamWriter failed writing file data/0: file write failed'):
    with room on the disk (the probe's), it ended a finished training in a traceback. Now the refused write's one line
    naming the rerun; a RuntimeError of another text (the reader's, a bug's, torch's words alone inside another
    message) stays as it is. The errors here are torch's own, from a save into /dev/full. (Old code: final_write
    returned the RuntimeError.)"""
    import torch

    from dpotrain.recipe.errors import RunError
    from dpotrain.train import disk_full

    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(RuntimeError) as written:
        torch.save({"w": torch.zeros(1 << 10)}, "/dev/full")  # 4 KiB: past the stream's buffer, so its close fails
    failed = [written.value, written.value.__context__]
    failed.append(
        RuntimeError(
            "[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file "
            "data/37: file write failed"
        )
    )
    # TORCH_SHOW_CPP_STACKTRACES=1: C++'s stack below the first line, which alone is matched (it was a traceback)
    failed.append(RuntimeError(f"{failed[-1]}\nC++ CapturedTraceback:\n#4 c10::Error::Error from ??:0"))
    for error in failed:
        said = disk_full.final_write(error, out)
        assert isinstance(said, RunError), (error, said)
        assert str(said) == (
            f"the final model could not be written in {out} (torch.save's write failed: RuntimeError: "
            f"{str(error).splitlines()[0]}): the "
            "file was open, so no permission refused it: fix the file system's health (an I/O error; ask your admins "
            "if it stays), then rerun; the same command trains again"
        ), str(said)
    torn = tmp_path / "torn.pt"
    torch.save({"w": torch.zeros(4)}, torn)
    torn.write_bytes(torn.read_bytes()[:-100])  # 'PytorchStreamReader failed reading zip archive: ...'
    with pytest.raises(RuntimeError) as read:
        torch.load(torn)
    others = [read.value, RuntimeError("file write failed"), RuntimeError("a bug: unexpected pos 704 vs 598 here")]
    others.append(RuntimeError("[enforce fail at inline_container.cc:323] . PytorchStreamReader failed reading file"))
    for error in others:
        assert disk_full.final_write(error, out) is error, error


SAFETENSORS_LIMIT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    import torch
    from safetensors.torch import save_file
    from dpotrain.train import disk_full
    folder = Path({folder!r})
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, hard))  # the disk probe's 1 MiB fits, the 4 MiB weights not
    try:
        save_file({{"w": torch.zeros(1 << 20)}}, str(folder / "model.safetensors"))
    except Exception as e:
        print(type(e).__name__, "|", disk_full.why_full(e, folder))
""")


@pytest.mark.slow  # a fresh interpreter importing torch under a file size limit (3.1 s in CI's run)
def test_a_final_model_safetensors_could_not_write_is_said_as_its_os_error(tmp_path):
    """safetensors' failed write is a SafetensorError, no OSError ('Error while serializing: I/O error: File too large
    (os error 27)'): a final save under a file size limit the disk probe's 1 MiB passes, or into a folder gone, ended
    a finished training in a traceback. Its text names the OS's error number, which tells it from a bug: said as that
    OSError is (the limit's line; the refused write's one line naming the rerun), and a SafetensorError of another
    kind stays as it is. (Old code: why_full None, final_write returned the SafetensorError.)"""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load, save_file

    from conftest import python
    from dpotrain.recipe.errors import RunError
    from dpotrain.train import disk_full

    script = tmp_path / "limited.py"
    script.write_text(SAFETENSORS_LIMIT.format(root=str(ROOT), folder=str(tmp_path)))
    result = subprocess.run([python(), str(script)], capture_output=True, text=True, timeout=120)
    assert (
        result.stdout.strip() == f"SafetensorError | {disk_full.SIZE_LIMIT} of {2 << 20:,} bytes stopped the write"
    ), result.stdout + result.stderr[-3000:]
    out = tmp_path / "run"
    out.mkdir()
    # A refused permission (root squashed on NFS; the tests run as root, whom no mode refuses): safetensors' own words
    denied = SafetensorError(f"Error while serializing: I/O error: Permission denied (os error {errno.EACCES})")
    said = disk_full.final_write(denied, out)
    assert isinstance(said, RunError), said
    assert str(said).startswith(
        f"the final model could not be written in {out} (PermissionError: [Errno {errno.EACCES}] Permission denied)"
    ), str(said)
    assert str(said).endswith("then rerun; the same command trains again"), str(said)
    # A folder gone (a bug's, or a person's rm): no "fix the file system's health", the error as it is
    with pytest.raises(SafetensorError) as gone:
        save_file({"w": torch.zeros(4)}, str(out / "gone" / "model.safetensors"))
    assert disk_full.final_write(gone.value, out) is gone.value
    exists = FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(out / ".final_model"))
    assert disk_full.final_write(exists, out) is exists
    with pytest.raises(SafetensorError) as bug:
        load(b"not a safetensors file")
    assert disk_full.final_write(bug.value, out) is bug.value
    assert disk_full.final_write(RuntimeError("file write failed"), out).args == ("file write failed",)

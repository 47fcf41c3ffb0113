"""A write of the run that the disk refuses: one line naming the file or folder, why, and what to do.

torch.save's C++ writer reports a full disk as "basic_ios::clear" or "file write failed" (the errno is lost), and
safetensors as a SafetensorError, so a failed save is told apart by the folder itself: a small probe written there fails
the same way. The checkpoint cut short is removed to give the space back; the same command goes on from the last one.
"""

import contextlib
import errno
import os
import re
import resource
import shlex
import shutil
from pathlib import Path

from dpotrain.cluster import collectives, run_lock
from dpotrain.recipe import records, run_record, writes
from dpotrain.recipe.errors import ConfigError, RunError, cause, size
from dpotrain.train import checkpoint_manifest
from dpotrain.train.checkpoints import checkpoints, complete_checkpoints, is_checkpoint_name

SIZE_LIMIT = "a file size limit (ulimit -f)"
FULL = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: f"{SIZE_LIMIT} stopped the write",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission is denied",
    errno.EPERM: "permission is denied",
}
# What to do where the disk has room but takes no write (else: free space there), by the start of the why.
FIX = {
    FULL[errno.EROFS]: "make it writable again (a file system remounted read-only after a disk error needs its "
    "administrator)",
    FULL[errno.EACCES]: "give this job write permission there",
    # A limit on each file's size, not the disk's room: freeing space changes nothing (`ulimit -f` in the job script
    # or the shell that launched it, a node's limits.conf, Slurm's PropagateResourceLimits from the submitting shell)
    SIZE_LIMIT: "raise it (ulimit -f unlimited before the launch; on Slurm, where sbatch was run "
    "too, as Slurm passes the submitting shell's limits on)",
}
PROBE_BYTES = 1 << 20
# The run's output folder, once its recipe is read (`take_output_dir`): a failed write that names no file is looked for
# there first, as the caches are (a record or a library's write there said "free space in datasets' cache ...").
OUTPUT_DIR: list[Path] = []


def take_output_dir(path: str | os.PathLike) -> None:
    OUTPUT_DIR[:] = [Path(path)]


def size_limit(error: OSError | None = None) -> int | None:
    """The file size limit behind an EFBIG: the one of the process that met it (kept on the error where another rank
    is given it: `collectives.SIZE_LIMIT`, as the limit is per process), else this process's own; None: unlimited."""
    limit = getattr(error, collectives.SIZE_LIMIT, None)
    if limit is None:
        limit = collectives.file_size_limit()
    return None if limit == resource.RLIM_INFINITY else limit


def _why(code: int, error: OSError | None = None) -> str:
    """`FULL`'s line for `code`; an EFBIG's with the limit in bytes, which is the figure to raise."""
    if code == errno.EFBIG and (limit := size_limit(error)) is not None:
        return f"{SIZE_LIMIT} of {limit:,} bytes stopped the write"
    return FULL[code]


def _fix(why: str) -> str | None:
    return next((todo for start, todo in FIX.items() if why.startswith(start)), None)


def refused(error: BaseException) -> str | None:
    """Why, when `error` is a write the disk refused (`FULL`; EACCES and EPERM only where the file is not writable)."""
    if not isinstance(error, OSError) or error.errno not in FULL:
        return None
    if error.errno in (errno.EACCES, errno.EPERM):
        target = Path(error.filename) if isinstance(error.filename, str) else None
        # os.path.exists: False where the look is unanswered (ESTALE), which Path.exists raised while the line was made
        if target is None or os.access(target if os.path.exists(target) else target.parent, os.W_OK):
            return None
        if _unreadable(target):  # a read, not a write: `read_denied` says it
            return None
    return _why(error.errno, error)


def _unreadable(target: Path) -> bool:
    """Whether this job cannot read `target`: its folder cannot be entered, or it is there and cannot be read."""
    return not os.access(target.parent, os.X_OK) or (os.path.exists(target) and not os.access(target, os.R_OK))


def read_denied(error: BaseException) -> RunError | None:
    """The line for a read the permissions refused (a checkpoint folder made another user's, chmod 700): it was said
    as a refused write, with the write's fix, naming a file the run never wrote (`refused` asks `_unreadable`)."""
    for e in _chain(error, (RunError, ConfigError)):
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM) and isinstance(e.filename, str):
            target = Path(e.filename)
            if _unreadable(target):
                return RunError(
                    f"permission is denied: {target} could not be read: give this job read permission there "
                    f"(chmod -R a+rX {shlex.quote(str(target.parent))}, or ask its owner), then rerun"
                )
    return None


def _todo(why: str) -> str:
    return _fix(why) or "free space there"


def why_full(error: BaseException, folder: Path) -> str | None:
    """Why writing in `folder` failed, if the disk refused it (`FULL`); else None."""
    return refused(written_error(error) or error) or _probe(folder)


# safetensors' text for a failed write (its SafetensorError carries no errno): Rust's io::Error for an OS error, the
# file named where it knows it: 'Error while serializing: I/O error: File too large (os error 27)'
SAFETENSORS_IO = re.compile(
    r'I/O error: (?P<strerror>.+?) \(os error (?P<errno>[0-9]+)\)(?: at path "(?P<path>[^"]+)")?'
)


def written_error(error: BaseException) -> OSError | None:
    """`error` as the OSError of the write that failed: itself, or the one a SafetensorError's text names (its type and
    the OS's error number tell an I/O failure from a bug); else None. torch.save's failed write names no error number
    (a RuntimeError: `TORCH_WRITE`): no OSError is made up for it here; `final_write` says it in its own words."""
    if isinstance(error, OSError):
        return error
    from safetensors import SafetensorError

    if isinstance(error, SafetensorError) and (found := SAFETENSORS_IO.search(str(error))):
        return OSError(int(found["errno"]), found["strerror"], found["path"])
    return None


def _probe(folder: Path) -> str | None:
    """Why a write of PROBE_BYTES in `folder` fails, if the disk refuses it (`FULL`); else None."""
    probe = folder / f".dpotrain-space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return _why(e.errno) if e.errno in FULL else None
    finally:
        with contextlib.suppress(OSError):  # a read-only file system refuses even to remove what is not there
            probe.unlink(missing_ok=True)
    return None


def _caches() -> list[tuple[str, Path, str]]:
    """Where a run writes: its output folder (when known) and its caches: (what, folder, how to move it)."""
    import tempfile

    import datasets
    from huggingface_hub import constants

    from dpotrain.data.lengths import cache_root

    return [
        *(("the output folder", folder, "--output_dir") for folder in OUTPUT_DIR),
        ("datasets' cache", Path(datasets.config.HF_DATASETS_CACHE), "HF_DATASETS_CACHE (or HF_HOME)"),
        ("the Hub's download cache", Path(constants.HF_HUB_CACHE), "HF_HUB_CACHE (or HF_HOME)"),
        ("dpotrain's cache", cache_root(), "DPOTRAIN_CACHE"),
        ("the temporary folder", Path(tempfile.gettempdir()), "TMPDIR"),
    ]


def _unnamed_file(why: str) -> str:
    """Where a failed write that names no file went (pyarrow's under datasets' `map`, which writes the data set's
    tokenized copy into datasets' cache: it said `a file could not be written: free space there`, naming no place):
    the output folder or cache whose disk refuses a probe too, with what moves it; else the free space of each."""
    caches = [(what, folder, var) for what, folder, var in _caches() if folder.is_dir()]
    for what, folder, var in caches:
        if (found := _probe(folder)) is not None:
            free = "" if _fix(found) else f", {_free(folder)}"
            where = "with room" if not _fix(found) else "where this job may write"
            return (
                f"{found}: a file could not be written in {what}, {folder}{free}: {_todo(found)}, or set {var} to a "
                f"folder {where}"
            )
    spaces = ", ".join(f"{what} {path} ({var}): {_size_or_why(_space(path))}" for what, path, var in caches)
    return f"{why}: a file could not be written (its writer did not name it; free space in {spaces}): {_todo(why)}"


def _size_or_why(free: int | str) -> str:
    return size(free) if isinstance(free, int) else f"unknown ({free})"


def _complete(out: Path, but: Path | None = None) -> list[Path] | str:
    """The run's complete checkpoints in `out` (but `but`), or why they could not be listed (a look unanswered, ESTALE):
    its OSError, raised while the line was made, hid the disk-full line (and in a save, before the ranks' all-gather,
    left the others waiting in it)."""
    try:
        return [p for p in complete_checkpoints(out) if p != but]
    except OSError as e:
        return cause(e)


def _after(kept: list[Path] | str, out: Path | None = None) -> str:
    """What the same command does next, given the run's complete checkpoints (or why they could not be listed) in
    `out`. A run of `auto_resume: false` (its record in `out` says) does not go on from them by itself: its rerun was
    told it would, and then refused "has checkpoints and auto_resume is false"."""
    if isinstance(kept, str):
        return f"its checkpoints could not be listed ({kept}): the same command goes on from the newest complete one"
    if kept and out is not None and not _auto_resume(out):
        return (
            f"{kept[-1].name} is kept: add --resume_from_checkpoint {shlex.quote(str(kept[-1]))} to go on from it "
            "(auto_resume is false)"
        )
    if kept:
        return f"{kept[-1].name} is kept, and the same command goes on from it"
    return "no checkpoint was complete yet: the same command starts afresh"


def _auto_resume(out: Path) -> bool:
    """The run's auto_resume, as its record in `out` holds it; True (the default) where the record does not read: in
    an error's line, which must not raise (the one field read, not the whole record's shape)."""
    try:
        values = records.read_record(out / run_record.RESOLVED, records.RESOLVED_FIX)
    except (OSError, ConfigError, ValueError):
        return True
    return not isinstance(values, dict) or values.get("auto_resume") is not False


def _space(folder: Path) -> int | str:
    """The bytes free in `folder`, or why they could not be read (a look unanswered, ESTALE): raised while a line was
    made, it hid the line (and in a save, before the ranks' all-gather, left the others waiting in it)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError as e:
        return cause(e)


def _free(folder: Path) -> str:
    """`<size> free there`, as the lines say it, or why the free space is unknown (`_space`)."""
    free = _space(folder)
    return f"{size(free)} free there" if isinstance(free, int) else f"its free space unknown ({free})"


def _need(folder: Path, kept: list[Path] | str) -> str:
    """What a checkpoint takes: the last complete one's bytes by its manifest, else more than what `folder` holds
    (other ranks may still be writing their shards there); a manifest unanswered (ESTALE) said as that, not raised."""
    written = f"more than the {size(writes.folder_bytes(folder))} written before it failed"
    if not kept or isinstance(kept, str):
        return f"a checkpoint takes {written}"
    try:
        previous = checkpoint_manifest.total_bytes(kept[-1])
    except OSError as e:
        return f"a checkpoint takes {written} ({kept[-1].name}'s manifest could not be read: {cause(e)})"
    return (
        f"a checkpoint takes {size(previous)}, as {kept[-1].name} did" if previous else f"a checkpoint takes {written}"
    )


def save_failed(folder: Path, why: str) -> RunError:
    """The error for checkpoint `folder` that did not fit (`why`: from `why_full`). Never raises: in
    `_save_checkpoint` it is made before the ranks' all-gather, on one rank alone."""
    out = folder.parent
    kept = _complete(out, but=folder)
    room = "" if _fix(why) else f" ({_free(out)}; {_need(folder, kept)})"
    # A lower save_total_limit frees room only where more than one complete checkpoint is kept: the newest stays until
    # the next is marked complete (checkpoints.py), so with one (save_total_limit 1, or the first save past it) the
    # rerun it advised failed at the same save
    lower = " (or lower --save_total_limit)" if isinstance(kept, list) and len(kept) > 1 else ""
    todo = _fix(why) or f"free space there{lower}"
    return RunError(
        f"{why}: {folder.name} could not be written in {out}{room}: {todo}, then rerun; {_after(kept, out)}"
    )


def final_save_failed(out: Path, why: str) -> RunError:
    free = "" if _fix(why) else f" ({_free(out)})"
    return RunError(
        f"{why}: the final model could not be written in {out}{free}: {_todo(why)}, then rerun; {_after_final(out)}"
    )


def _after_final(out: Path) -> str:
    """What the same command does after a final save that failed: its complete checkpoints are what it goes on from."""
    kept = _complete(out)
    if isinstance(kept, str) or (kept and not _auto_resume(out)):
        return _after(kept, out)
    return f"the same command goes on from {kept[-1].name}" if kept else "the same command trains again"


# What the file system or its permissions refuse a write with, whatever the space: the final save's one line names them
WRITE_REFUSED = (errno.EIO, errno.ESTALE, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTCONN, errno.ESHUTDOWN)
WRITE_REFUSED += (errno.ETIMEDOUT, errno.EREMOTEIO, errno.EHOSTDOWN, errno.ENOLINK, errno.ECOMM)  # a mount gone


# torch.save's zip writer (caffe2/serialize/inline_container.cc) on a write to its file that failed: miniz's
# MZ_ZIP_FILE_WRITE_FAILED ('[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file
# data/37: file write failed'), the end of file past what was written ('... . unexpected pos 704 vs 598', raised as the
# writer closes after a failed write), or the file stream's own failure ('basic_ios::clear: iostream error'). Matched
# whole, so that no other RuntimeError (the same writer's bugs, its reader's, a library's) is said as a failed write.
TORCH_WRITE = re.compile(
    r"(\[enforce fail at inline_container\.cc:[0-9]+\] \. )?(PytorchStreamWriter failed writing .+: file write failed"
    r"|unexpected pos [0-9]+ vs [0-9]+)|basic_ios::clear: iostream error"
)


def torch_write_failed(error: BaseException) -> bool:
    """Whether `error` is torch.save's RuntimeError for a write to its file that failed (`TORCH_WRITE`)."""
    first = (str(error).strip().splitlines() or [""])[0]  # TORCH_SHOW_CPP_STACKTRACES=1 adds C++'s stack below
    return type(error) is RuntimeError and TORCH_WRITE.fullmatch(first) is not None


REFUSED_FIX = (
    "fix what refused the write (the file system's health, the folder's permissions: ask your admins if it stays)"
)


def final_write(error: Exception, out: Path) -> Exception:
    """What the final save's `error` ends the run on: an OSError that is no full disk's (EIO, ESTALE, a PermissionError
    the folder's mode does not explain: root squashed on NFS, an immutable file) as one line naming the file, the fix
    and what the rerun does; it was raised as it was, a traceback after the whole training. A full disk's is left to
    `write_failed` (train_dpo.main), anything else as it is (a FileExistsError, a missing folder, an OSError of a
    library's own: a bug's traceback, not "fix the file system"). safetensors' failed write is said as its OSError
    (`written_error`); torch.save's (training_args.bin: a RuntimeError whose text alone says the write failed,
    `TORCH_WRITE`) in its own words, where it was a traceback after the whole training (the disk probe had found room
    in `trainer.save_model`)."""
    return _write_refused(error, f"the final model could not be written in {out}", lambda: _after_final(out))


def checkpoint_write(error: Exception, folder: Path) -> Exception:
    """`final_write`'s line for checkpoint `folder` whose write the file system refused with room on its disk (an EIO,
    a stale NFS handle, torch.save's failed write of the optimizer's state): it was every rank's traceback."""
    out = folder.parent
    return _write_refused(
        error, f"{folder.name} could not be written in {out}", lambda: _after(_complete(out, but=folder), out)
    )


def _write_refused(error: Exception, what: str, after) -> Exception:
    """`error` as one line saying `what` could not be written, why, the fix and `after()` (what the rerun does), where
    the file system refused the write; else `error` itself (`final_write`)."""
    failed = written_error(error)
    if failed is None and torch_write_failed(error):  # training_args.bin: the disk had room (trainer.save_model)
        return RunError(
            f"{what} (torch.save's write failed: {cause(error)}): the file was open, so no permission refused it: fix "
            f"the file system's health (an I/O error; ask your admins if it stays), then rerun; {after()}"
        )
    if failed is None:
        return error
    if full := full_write(failed):  # said by write_failed: here for safetensors', which train_dpo.main would not know
        return error if failed is error else write_failed(*full)
    if failed.errno not in WRITE_REFUSED:  # a missing folder, a file in the way, a library's own: a bug's traceback
        return error
    return RunError(f"{what} ({cause(failed)}): {REFUSED_FIX}, then rerun; {after()}")


def _chain(error: BaseException | None, until: tuple[type, ...] = ()):
    """`error`, then the errors it was raised from or while handling, each once, up to one of the types `until`."""
    seen = set()
    while error is not None and id(error) not in seen and not isinstance(error, until):
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def full_write(error: BaseException) -> tuple[OSError, str] | None:
    """The failed write behind `error` (itself, or the error it was raised from) and why, when the disk refused it."""
    # a RunError (a checkpoint that did not fit, above) is already the one line
    return next(((e, why) for e in _chain(error, (RunError, ConfigError)) if (why := refused(e))), None)


def folder_gone(error: BaseException) -> RunError | None:
    """The line for a write into the output folder that failed because the folder was deleted or moved away while the
    run trained (`mv outputs/x outputs/x.old`), or the checkpoint it was writing was (`rm -rf outputs/x/checkpoint-*`
    to free space): a FileNotFoundError traceback, at the next metrics record or the checkpoint's MANIFEST.json. The
    lock's holder knows its folder (`run_lock.folder_gone`: a new one of that name too); another rank, that it is not
    there."""
    for e in _chain(error) if OUTPUT_DIR else ():
        if (
            isinstance(e, FileNotFoundError)
            and isinstance(e.filename, str)
            and (gone := _gone_under(OUTPUT_DIR[0], e.filename, isinstance(e, checkpoint_manifest.GoneWhileRead)))
        ):
            return RunError(gone)
    return None


def _gone_under(out: Path, filename: str, read: bool) -> str | None:
    """`folder_gone`'s line for `filename`, not found in `out`: the folder gone, or the checkpoint folder it lies in;
    `read`: found gone as the checkpoint was checksummed, not written."""
    path, out = Path(os.path.abspath(filename)), Path(os.path.abspath(out))
    if not path.is_relative_to(out):
        return None
    failed = f"{filename} could not be {'read' if read else 'written'}"
    if run_lock.folder_gone() or not os.path.isdir(out):
        return run_lock.gone_line(out, f"as {failed}")
    parts = path.relative_to(out).parts
    if len(parts) < 2 or not is_checkpoint_name(parts[0]) or os.path.isdir(out / parts[0]):
        return None
    return (
        f"{parts[0]} was deleted or moved away while this run {'checksummed' if read else 'wrote'} it in {out} "
        f"({failed}): this run ended there; run the same command again: {_after(_complete(out), out)}"
    )


def write_failed(error: OSError, why: str) -> RunError:
    """The line for another write of the run the disk refused: the file, the space left there, and what the same
    command does next when the file is in a run's folder (one of the three above it)."""
    path = Path(error.filename) if error.filename else None
    if path is None:
        return RunError(f"{_unnamed_file(why)}, then rerun")
    above = list(path.parents)[:3]
    where = f"{path} could not be written"
    folder = next((p for p in above if p.is_dir()), None)
    free = f" ({_free(folder)})" if folder and not _fix(why) else ""
    return RunError(f"{why}: {where}{free}: {_todo(why)}, then rerun{_after_write(above)}")


def _after_write(above: list[Path]) -> str:
    """`; ` and what the same command does next where the file is in a run's folder (one of `above`), else ''."""
    try:
        out = next((p for p in above if (p / "run_files.json").is_file() or checkpoints(p)), None)
    except OSError as e:  # a run's folder or not, unknown: its checkpoints not listed, the line said all the same
        return f"; {_after(cause(e))}"
    return f"; {_after(_complete(out), out)}" if out else ""

"""A save that runs out of disk: one line naming the folder and the space needed, the earlier checkpoint kept.

torch.save's C++ writer reports a full disk as "basic_ios::clear", "file write failed" or "unexpected pos ..."
(the errno is lost) and safetensors as a SafetensorError, so a failed write is told apart by the folder itself: a
small probe written there fails the same way (ENOSPC: the disk is full; EDQUOT: the quota; EFBIG: a file size limit,
`ulimit -f`). The checkpoint cut short is this run's own, never resumed from (it has no COMPLETE mark): it is removed
to give the space back, and the newest complete checkpoint, untouched, is where the rerun goes on.
"""

import errno
import os
import shutil
from pathlib import Path

from dpotrain.recipe.errors import ConfigError, RunError
from dpotrain.train import checkpoint_manifest
from dpotrain.train.checkpoints import checkpoints, is_complete

FULL = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file size limit is reached (ulimit -f)",
}
PROBE_BYTES = 1 << 20


def why_full(error: BaseException, folder: Path) -> str | None:
    """Why writing in `folder` failed, if for lack of space; else None."""
    if isinstance(error, OSError) and error.errno in FULL:
        return FULL[error.errno]
    probe = folder / f".dpotrain-space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return FULL.get(e.errno)
    finally:
        probe.unlink(missing_ok=True)
    return None


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"


def _used(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def save_failed(folder: Path, why: str, remove: bool) -> RunError:
    """The error for checkpoint `folder` that did not fit (`why`: from `why_full`); removes it when `remove` (the
    main process: the one that deletes)."""
    out = folder.parent
    kept = [p for p in checkpoints(out) if is_complete(p) and p != folder]
    written = _used(folder)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    free = shutil.disk_usage(out).free
    previous = checkpoint_manifest.total_bytes(kept[-1]) if kept else None
    need = (
        f"a checkpoint takes {_size(previous)}, as {kept[-1].name} did"
        if previous
        else (f"a checkpoint takes more than the {_size(written)} written before it failed")
    )
    after = (
        f"{kept[-1].name} is kept, and the same command goes on from it"
        if kept
        else "no checkpoint was complete yet: the same command starts afresh"
    )
    return RunError(
        f"{why}: {folder.name} could not be written in {out} ({_size(free)} free there; {need}): free "
        f"space there (or lower --save_total_limit), then rerun; {after}"
    )


def final_save_failed(out: Path, why: str) -> RunError:
    kept = [p for p in checkpoints(out) if is_complete(p)]
    after = f"the same command goes on from {kept[-1].name}" if kept else "the same command trains again"
    return RunError(
        f"{why}: the final model could not be written in {out} ({_size(shutil.disk_usage(out).free)} "
        f"free there): free space there, then rerun; {after}"
    )


def full_write(error: BaseException) -> tuple[OSError, str] | None:
    """The failed write behind `error` (itself, or the error it was raised from: a library may wrap it) and why, when
    it failed for lack of space; else None."""
    seen = set()
    while error is not None and id(error) not in seen and not isinstance(error, (RunError, ConfigError)):
        seen.add(id(error))  # a RunError (a checkpoint that did not fit, above) is already the one line
        if isinstance(error, OSError) and error.errno in FULL:
            return error, FULL[error.errno]
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return None


def write_failed(error: OSError, why: str) -> RunError:
    """The one line for a write of the run other than a checkpoint (metrics, plot, card, samples, records, caches) that
    did not fit: the file, the space left there, and what the same command does next when the file is in a run's
    folder (the nearest of the three folders above it that holds run_files.json or checkpoints)."""
    path = Path(error.filename) if error.filename else None
    above = list(path.parents)[:3] if path else []
    where = f"{path} could not be written" if path else "a file could not be written"
    folder = next((p for p in above if p.is_dir()), None)
    free = f" ({_size(shutil.disk_usage(folder).free)} free there)" if folder else ""
    out = next((p for p in above if (p / "run_files.json").is_file() or checkpoints(p)), None)
    kept = [p for p in checkpoints(out) if is_complete(p)] if out else []
    after = (
        f"; {kept[-1].name} is kept, and the same command goes on from it"
        if kept
        else "; no checkpoint was complete yet: the same command starts afresh"
        if out
        else ""
    )
    return RunError(f"{why}: {where}{free}: free space there, then rerun{after}")

"""The training data's identity by content, not only its name: a run resumed on other data would go on mid-epoch on
pairs its plan never saw.

A local file (or the training split's Arrow files of a folder saved with `save_to_disk`) is recorded in the run's
resolved_config.json with each file's size, modification time and SHA-256 (~1 s per GB, once at start on the main
process: a 10 GB JSONL takes seconds beside the minutes datasets takes to read it). A rerun compares sizes first,
then trusts an unchanged size and modification time (as datasets' own cache and make do) and hashes the file again
only when the time differs (a copy, a checkout), so that touching a file does not refuse a resume but changing its
content does. A Hub data set is named by its name, config and split (RESUME_FIELDS), not its content.
"""

import hashlib
from pathlib import Path


def _files(name: str, split: str) -> tuple[Path, list[Path]] | None:
    """The files the training split is read from: the file itself, or a saved split's `data-*.arrow` (not the
    `cache-*.arrow` files datasets adds beside them as the data is mapped and filtered)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        split_dir = path / split if (path / split).is_dir() else path
        return path, sorted(split_dir.glob("data-*.arrow"))
    return None  # a Hub data set


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def of(name: str, split: str = "train") -> dict | None:
    """{relative path: {"bytes", "mtime_ns", "sha256"}} of a local data set's `split`; None for a Hub one."""
    found = _files(name, split)
    if found is None:
        return None
    root, files = found
    record = {}
    for path in files:
        stat = path.stat()
        record[path.relative_to(root).as_posix()] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                                     "sha256": _sha256(path)}  # fmt: skip
    return record


def changed(old: dict | None, name: str, split: str = "train") -> str | None:
    """How the local data set `name`'s `split` differs from the run's record `old` (`of`), or None: the same
    content, a Hub data set, or a run recorded before data identities."""
    found = _files(name, split)
    if not old or found is None:
        return None
    root, files = found
    now = {path.relative_to(root).as_posix(): path for path in files}
    if set(now) != set(old):
        return f"{name} holds {sorted(now)}, the run trained on {sorted(old)}"
    for rel, path in now.items():
        stat, was = path.stat(), old[rel]
        if stat.st_size != was["bytes"]:
            return f"{rel} has {stat.st_size} bytes, the run trained on {was['bytes']}"
        digest = _sha256(path) if stat.st_mtime_ns != was["mtime_ns"] else was["sha256"]
        if digest != was["sha256"]:
            return f"{rel} has other content (SHA-256 {digest[:12]}..., the run trained on {was['sha256'][:12]}...)"
    return None

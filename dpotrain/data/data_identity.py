"""A run's input files by identity, not only by name: a run resumed on other data, or on another model at the same
path, would go on mid-epoch on pairs its plan never saw, or score its reference with other weights.

`of_files` records each file's size, modification time and SHA-256, `changed_files` compares: data files hashed whole
(~1 s per GB, once at start), the model's (model_identity.py, tens of GB) known by their first and last MiB. A rerun
trusts an unchanged size and time (as datasets' cache and make do; a file hashed whole, its change time too) and hashes
again a file whose time changed; one known by its ends is then refused even when they are the same, since a re-export
rewrites the file while its size and first and last tensors may stay (the message gives the `touch` that restores the
recorded time; docs/reliability.md).
"""

import hashlib
import os
import shlex
from pathlib import Path

ENDS = 1 << 20  # bytes hashed at each end of a file known by its ends (a file up to 2 x ENDS is hashed whole)
TRAINED, EVALUATED = "trained on", "evaluated on"  # what a run does with its pairs (held-out ones), said in refusals


def saved(path: Path) -> bool:
    """A folder written by `save_to_disk` (read in place, its split's Arrow files alone), not a folder of data files
    (which datasets reads whole, every file under it): load_from_disk's own test, a `Dataset`'s dataset_info.json with
    its state.json, or a `DatasetDict`'s dataset_dict.json (a folder of data files may hold a dataset_info.json too,
    which load_dataset leaves out)."""
    if (path / "dataset_dict.json").is_file():
        return True
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def entries(data_files, split: str) -> list:
    """A source's `data_files` entries for `split`: one entry, a list, or a mapping of split to either."""
    entries = data_files.get(split) if isinstance(data_files, dict) else data_files
    return entries if isinstance(entries, list) else [entries]


def load_matches(base: str, entry: str) -> list[str]:
    """The local files datasets' load reads for a `data_files` entry, by its own resolution from the folder it reads
    (`base`: a builder's data_dir): `**` matches folders at any depth (`pairs/**/*.jsonl` reads pairs/a.jsonl too,
    which Python's glob does not match: such a source was refused as matching no file, and its identity left the file
    out), `~` is not expanded (the load fails on it); none for a remote file."""
    from datasets.data_files import resolve_pattern

    if "://" in entry:
        return []
    try:
        return resolve_pattern(entry, base_path=os.path.abspath(os.path.expanduser(base)))
    except FileNotFoundError:
        return []


def files(name: str, split: str = "train", data_dir: str | None = None, data_files=None) -> dict[str, Path] | None:
    """The files the training split is read from, by their names relative to the data set: the file itself; a saved
    split's `data-*.arrow` (not datasets' `cache-*.arrow` beside them); every file of a folder of shards (or of its
    `data_dir`), hidden ones aside; the local files `data_files` lists. None for a data set on the Hub."""
    path = Path(name).expanduser()
    if data_files and path.is_dir():  # those files only, never the whole folder they are named from
        # a path, a glob, a list of them, or {split: ...}, relative to the source's folder (a builder: the working one)
        listed = [
            Path(f) for e in entries(data_files, split) if isinstance(e, str) for f in sorted(load_matches(path, e))
        ]
        root = Path(os.path.commonpath([str(p.resolve().parent) for p in listed])) if listed else path
        return {p.resolve().relative_to(root).as_posix(): p for p in listed}
    if path.is_file():
        return {path.name: path}
    if not path.is_dir():
        return None
    if saved(path):
        split_dir = path / split if (path / split).is_dir() else path
        found = sorted(split_dir.glob("data-*.arrow"))
    else:
        folder = path / data_dir if data_dir else path
        shown = (p for p in folder.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts))
        found = sorted(p for p in shown if p.is_file())  # hidden files and folders aside
    return {p.relative_to(path).as_posix(): p for p in found}


def stamp(path: Path) -> str:
    """What the analyzer's cache knows a file by, unread: its size and times, change time and inode too, which neither
    `cp -p` of another file of the same size nor a rename over it keeps (its modification time they do). A chmod or a
    move changes it: the lengths are measured again, as they are cheaper to measure than to mistake. A resume compares
    content (`changed_files`), so a moved or chmod-ed file still resumes."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def _sha256(path: Path, ends: bool = False) -> str:
    with open(path, "rb") as f:
        if not ends:
            return hashlib.file_digest(f, "sha256").hexdigest()
        digest = hashlib.sha256(f.read(ENDS))
        f.seek(-ENDS, os.SEEK_END)
        digest.update(f.read(ENDS))
        return digest.hexdigest()


def of_files(found: dict[str, Path], ends: bool = False) -> dict:
    """{name: {"bytes", "mtime_ns", "ctime_ns", "sha256" or "sha256_ends"}} of the files `found` (name -> path);
    `ends`: files larger than 2 MiB are known by their first and last MiB."""
    record = {}
    for name, path in found.items():
        stat = path.stat()
        key = "sha256_ends" if ends and stat.st_size > 2 * ENDS else "sha256"
        digest = _sha256(path, key == "sha256_ends")
        record[name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, key: digest}
    return record


def changed_files(
    old: dict, found: dict[str, Path], read: str = TRAINED, evaluated=frozenset(), reads=None
) -> str | None:
    """How the files `found` differ from the record `old` (`of_files`), naming the file; None: the same. `read`: what
    the run did with them (held-out files: EVALUATED); `evaluated`: the resolved paths among them it evaluated on (a
    folder of split files' test split, recorded with the training files as datasets reads the folder whole); `reads`:
    the resolved paths among them the run reads (None: all), the others left out (a test split it does not evaluate
    on). A recorded file gone is named: a record holds the files its run read (one made before then, every file of
    the folder: it does not say which split each was)."""
    if reads is not None:
        unread = {n for n, p in found.items() if p.resolve() not in reads}
        found, old = ({n: v for n, v in d.items() if n not in unread} for d in (found, old))
    # A file evaluated on alone that the record lacks: the first attempt did not evaluate (`eval_*` may change), and
    # records hold only the files a run reads
    found = {n: p for n, p in found.items() if n in old or p.resolve() not in evaluated}
    if set(found) != set(old):
        added, gone = sorted(set(found) - set(old)), sorted(set(old) - set(found))
        return ", ".join([*(f"{n} is new" for n in added), *(f"{n} is gone" for n in gone)]) + " since the run started"
    for name, path in found.items():
        stat, was, did = path.stat(), old[name], EVALUATED if path.resolve() in evaluated else read
        if stat.st_size != was["bytes"]:
            return f"{name} has {stat.st_size} bytes, the run {did} {was['bytes']}"
        # A file hashed whole is trusted while its change time agrees too: `cp -p` of another file of the same size
        # keeps the modification time, never the change time (a chmod or a move changes it too: hashed again).
        # A file known by its ends is trusted on its modification time: hashed again, its ends prove nothing.
        same_ctime = "sha256_ends" in was or stat.st_ctime_ns == was.get("ctime_ns", stat.st_ctime_ns)
        if stat.st_mtime_ns == was["mtime_ns"] and same_ctime:
            continue
        if "sha256" in was:
            digest, then = _sha256(path), was["sha256"]
            if digest != then:
                return f"{name} has other content (SHA-256 {digest[:12]}..., the run {did} {then[:12]}...)"
            continue
        if _sha256(path, ends=True) != was["sha256_ends"]:
            return f"{name} has other content (its first and last MiB differ from those the run {did})"
        seconds, nanoseconds = divmod(was["mtime_ns"], 10**9)
        return (
            f"{name} was rewritten since the run started (its first and last MiB, all that is compared of a "
            f"large file, are the same); if it is the same file copied, `touch -d @{seconds}.{nanoseconds:09d} "
            f"{shlex.quote(str(path))}` gives it back the time the run recorded"
        )
    return None


def changed(
    old: dict | None,
    name: str,
    split: str = "train",
    data_dir=None,
    data_files=None,
    read: str = TRAINED,
    evaluated=frozenset(),
    reads=None,
) -> str | None:
    """How the local data set `name`'s `split` differs from the run's record `old` (`of_files`), or None."""
    found = files(name, split, data_dir, data_files)
    return changed_files(old, found, read, evaluated, reads) if old and found is not None else None

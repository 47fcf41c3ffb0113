"""What the run reads back of what it wrote: its append-only records (metrics.jsonl, samples.jsonl, hub_pushes.jsonl),
its whole records (resolved_config.json, health_stop.json, run_files.json, run_complete.json) and its caches.

Append-only records hold one JSON object per line, appended whole or not at all. A node lost while appending can leave
the last line cut short, nothing else: the rerun goes on from the checkpoint and writes the steps past it again, so a
cut last line is dropped with one warning; a damaged line before the last is an error naming the file and the line. A
full disk while appending leaves no part of the line (`append` truncates back to where it was).

Whole records are renamed into place (writes.py); one found damaged is what the rerun would decide on, so it is refused
in one line naming the file and what to do (`read_record`). A damaged cache file is removed and computed again.

Records are strict JSON (`dumps`): a NaN or infinite number (a loss that diverged, with the health guards off) is
written null, as JSON has no such numbers and jq, JavaScript and most readers refuse Python's `NaN` token.
"""

import contextlib
import fcntl
import json
import math
import os
import traceback
import zipfile
from pathlib import Path

from dpotrain.recipe.errors import ConfigError, RunError, cause, warn

# What reading a damaged file raises, and nothing else (a bug in a reader raises): numpy and zipfile on a file cut at
# any length or with any bit flipped at any byte of a part, a complete.npz and a length cache (BadZipFile, EOFError,
# KeyError: a member's name; ValueError: its header, or a dtype read as pickled objects; OSError: a seek before the
# start; tests/test_faults_inputs.py flips them), json on text cut short (ValueError). zipfile's NotImplementedError
# and RuntimeError ("encrypted") are damage too, but a bug's as well: `zip_damage` tells them apart. TypeError,
# AttributeError and zlib.error (the caches are not compressed) were here: a reader's bug removed its cache file and
# computed it again at every start, in silence.
UNREADABLE = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile)

_warned: set[tuple[str, int]] = set()  # (file, size): a torn line is reported once per process, however often read


def read(path: str | Path, step: bool = False) -> list[dict]:
    """The records of `path` (none when it does not exist), each a JSON object (`step`: with a number for its step,
    which a resume trims by and the plot draws against); a torn last line is dropped with one warning."""
    path = Path(path)
    try:
        file = open(path, "rb")
    except FileNotFoundError:
        return []
    with file:
        # Appends hold the file's lock while they write (`append`): a line another process was writing was read
        # half written and dropped as a crash's. A file system without locks reads as before.
        with contextlib.suppress(OSError):
            fcntl.flock(file, fcntl.LOCK_SH)
        raw = file.read()
    return parse(path, raw, step)


def parse(path: Path, raw: bytes, step: bool = False) -> list[dict]:
    """The records of `raw`, the bytes of `path` (`read`)."""
    *whole, torn = raw.split(b"\n")  # appended whole, the file ends with a newline: nothing after it
    records = []
    for number, line in enumerate(whole, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = None if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
            if step and not problem and type(record.get("step")) not in (int, float):
                problem = f"its step is {record.get('step')!r}, not a number"
        except ValueError as e:
            problem = str(e)
        if problem:
            raise RunError(
                f"{path}: line {number} is not a JSON record ({problem}); a crash can cut only the last line of this "
                "file, so it was changed by hand or another program: restore it, or delete that line, then rerun"
            ) from None
        records.append(record)
    seen = (str(path), len(raw))
    if torn.strip() and seen not in _warned:  # the last line, with no newline after it (whole JSON or not): cut short
        _warned.add(seen)
        warn(
            f"{path}: dropped its last line ({len(whole) + 1}: {len(torn)} bytes, cut short as a crash while writing "
            "it leaves it); the checkpoint is what the run goes on from, and the steps after it are recorded again"
        )
    return records


def append(path: str | Path, records: list[dict]) -> None:
    """Appends `records` (one line each) to `path`, all of them or none: a write that fails (a full disk) leaves the
    file as it was and raises OSError naming `path`. A torn last line left by a crash is cut off first. Appends from
    several processes take turns (a lock on the file)."""
    path = Path(path)
    data = "".join(dumps(r) + "\n" for r in records).encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # Two processes append to one file (hub_pushes.jsonl: the run's pusher and push_to_hub.py): unlocked, one saw
        # the other's line half written and cut it off as torn. A file system without locks (Lustre mounted without
        # `flock`) appends as before.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            raw = os.pread(fd, size, 0)
            parse(path, raw)  # says what is dropped (`read` would wait for the lock held here)
            size = size - len(raw.rsplit(b"\n", 1)[-1])
            os.ftruncate(fd, size)
        try:
            written = 0
            while written < len(data):  # a regular file takes it in one write unless the disk fills on the way
                written += os.write(fd, data[written:])
        except OSError as e:
            os.ftruncate(fd, size)  # no partial line left behind
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def dumps(record, **kwargs) -> str:
    """`record` as strict JSON: a float that is NaN or infinite (anywhere in it) written null, which readers take for
    no value; json.dumps would write the bare `NaN`/`Infinity` tokens, which are no JSON."""
    return json.dumps(_finite(record), allow_nan=False, **kwargs)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_object(path: str | Path) -> dict | None:
    """The JSON object in `path`; None where there is none, or it cannot be read, or holds no object (for a reader
    that passes over such a file: `read_record` refuses it)."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_record(path: str | Path, fix: str) -> dict | None:
    """The JSON object in `path`, a record the run wrote whole; None when there is none; one that cannot be read is
    refused: `<path> is unreadable (<why>): <fix>`."""
    path = Path(path)
    try:
        record = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):  # a folder that is a file (`--output_dir notes.txt/run`) holds none
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({cause(e)}): {fix}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} is unreadable (a JSON {type(record).__name__}, not an object): {fix}")
    return record


# What to do about a damaged resolved_config.json (read typed by recipe/run_record.py)
RESOLVED_FIX = (
    "it holds the settings the run's checkpoints were trained with, which a rerun compares with its own: restore it "
    "from a copy (each checkpoint keeps one), delete it to go on without that comparison, or pass a new --output_dir"
)


@contextlib.contextmanager
def zip_damage():
    """Reading a zip (np.load of an .npz): a flipped bit in the zip's directory makes zipfile raise NotImplementedError
    (a compression method or version it lacks) or RuntimeError (the file seems encrypted) rather than BadZipFile:
    raised as BadZipFile, the file's damage. The same errors raised outside zipfile (a bug) are left as they are."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as e:
        if Path(traceback.extract_tb(e.__traceback__)[-1].filename) != Path(zipfile.__file__):
            raise
        raise zipfile.BadZipFile(f"{type(e).__name__}: {e}") from e


@contextlib.contextmanager
def npz(path: str | Path):
    """`np.load` of an .npz, its damage raised as BadZipFile (`zip_damage`). A file that holds no zip at all (zeroed,
    overwritten, empty) is said so: np.load reads such a file as a pickle, and its error told the user to load it with
    `allow_pickle=True`, which would run what the file holds."""
    import numpy as np

    with open(path, "rb") as f:  # a missing file stays FileNotFoundError: no cache, not a damaged one
        if not zipfile.is_zipfile(f):
            raise zipfile.BadZipFile("it holds no .npz archive: emptied, zeroed or written over")
    with zip_damage(), np.load(path) as loaded:
        yield loaded


def read_cache(path: str | Path, load, kind: str, again: str, key: str | None = None, other: str = ""):
    """What `load(path)` reads of a file of the `kind` cache; None when there is none, or when it is damaged (then it
    is removed, with one warning saying `again`: how it is computed again). With `key`, `load` returns (the key the
    file names, None for one written before files named theirs; what it read), and a file naming another key is
    damaged: `other` (a format string of that key) says what it holds."""
    try:
        found = load(path)
    except FileNotFoundError:
        return None
    except PermissionError as e:
        # Another user's file in a shared cache: whole, only not ours to read. Said damaged and removed, it was unlinked
        # where the folder let us (their good file gone), and where not, the warning said so of a file still there.
        warn(f"the {kind} cache file {path} cannot be read ({cause(e)}); it is left as it is and {again}")
        return None
    except UNREADABLE as e:
        return damaged_cache(path, cause(e), kind, again)
    if key is None:
        return found
    if found[0] is not None and found[0] != key:
        return damaged_cache(path, f"it holds {other.format(found[0])}", kind, again)
    return found[1]


def damaged_cache(path: str | Path, why: str, kind: str, again: str) -> None:
    warn(f"the {kind} cache file {path} is damaged ({why}); it is removed and {again}")
    with contextlib.suppress(OSError):  # a read-only cache: computed again next time too, never a reason not to start
        Path(path).unlink(missing_ok=True)

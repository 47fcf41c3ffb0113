"""How the project writes its reports and records: to a temporary name beside the target, flushed to disk, then renamed
into place, so that a reader (a resuming run, a person, `wandb sync`) never sees half a file and a kill mid-write
leaves the previous version whole; and never over one of the command's own inputs; and the paths the command is given
checked against their file system's limits first.
"""

import contextlib
import errno
import hashlib
import os
import socket
import stat
from contextlib import contextmanager
from pathlib import Path

from dpotrain.recipe import launcher
from dpotrain.recipe.errors import ConfigError

# What `unwritable`'s probe file stands for: its name is a temporary's of this name (`_temporary_name`).
PROBE = "dpotrain-write-test"


@contextmanager
def replacing(path: str | Path, mode: str = "w"):
    """A file object to write `path`'s new content to ("w" text, "wb" bytes); on leaving without an error the content
    is on disk and renamed over `path` (the folder's entry synced too), on an error `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(_temporary_name(path))
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it...
        os.replace(tmp, path)
    except OSError as e:  # a full disk names the file meant, not the temporary one (or none: a failed write)
        if not e.errno:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        with contextlib.suppress(OSError):  # a read-only file system refuses even to remove what is not there
            tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # ...and the new name is on disk (without folder handles: still atomic)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temporary_name(path: Path) -> str:
    """The name `replacing` writes under: unique per process and host (ranks may share a folder), and within NAME_MAX
    where `path`'s own name is (a name near the limit is stood for by its digest)."""
    ours = f".{socket.gethostname()}.{os.getpid()}.tmp"
    name = f".{path.name}{ours}"
    if len(os.fsencode(name)) <= _limits(path.parent)[0]:
        return name
    return f".{_digest(path.name)}{ours}"


def _digest(name: str) -> str:
    """What stands for a name too long to prefix a temporary's (`_temporary_name`, `temporaries`)."""
    return hashlib.sha256(os.fsencode(name)).hexdigest()[:16]


def temporaries(folder: Path, names) -> list[tuple[Path, str, int]]:
    """`replacing`'s temporaries in `folder` of the files `names` (`_temporary_name`'s parts): (path, host, pid)."""
    stems = {f".{n}." for n in names} | {f".{_digest(n)}." for n in names}
    found = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        stem = next((s for s in stems if entry.name.startswith(s) and entry.name.endswith(".tmp")), None)
        host, _, pid = entry.name[len(stem or "") : -len(".tmp")].rpartition(".")
        if stem and host and pid.isdigit():
            found.append((entry, host, int(pid)))
    return found


def remove_dead_temporaries(folder: Path, names) -> list[Path]:
    """Removes the `dead_temporaries` of `names` in `folder`, and returns them: a writer's own leftovers, which nothing
    else would ever remove (a folder it cannot list or write in keeps them)."""
    removed = []
    with contextlib.suppress(OSError):
        for path in dead_temporaries(Path(folder), names):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def dead_temporaries(folder: Path, names) -> list[Path]:
    """The `temporaries` of `names` left by a writer on this host that was killed mid-write (its pid gone; or this
    process's own, which writes nothing while it asks: a container's pids repeat). Another host's, or a live
    process's, are never among them: that writer may be writing."""
    here = socket.gethostname()
    return [
        path
        for path, host, pid in temporaries(folder, names)
        if host == here and (pid == os.getpid() or not pid_alive(pid))
    ]


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's counts: it may be writing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_text(path: str | Path, text: str) -> Path:
    with replacing(path) as f:
        f.write(text)
    return Path(path)


def check_report_paths(paths: dict[str, str | None]) -> None:
    """Refuses each report's path (flag -> path) that the report could not be written to, before the work that makes
    it: a folder or a device (/dev/stdout) at the path itself, a folder for it that does not exist or this process
    cannot write in, or the path of another report of the command (the second written over the first)."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if not path:
            continue
        if path == "-":  # stdout, to other tools: this wrote a file named '-' in the folder the command ran in
            example = "report.png" if flag == "--plot" else "report.json"
            raise ConfigError(
                f"{flag} takes a file name, and '-' would write a file named '-': give e.g. {flag} {example}"
            )
        folder = Path(path).resolve().parent
        for bad, why in (  # in this order: the first found is said
            (Path(path).is_dir(), " is a folder: give the path of the file to write, inside it or elsewhere"),
            # /dev/stdout, /dev/null: the report is renamed over the path, and as root that replaced the device's own
            # entry with a file (/dev/null a file every later command wrote into), the report reaching nobody
            (
                Path(path).exists() and not Path(path).is_file(),
                " is a device, pipe or terminal, not a file: the report is written as a file in its place; give a "
                "file name (the markdown report goes to stdout)",
            ),
            (not folder.is_dir(), f": folder {str(folder)!r} does not exist; create it or write elsewhere"),
            (not os.access(folder, os.W_OK), f": cannot write in {str(folder)!r}"),
        ):
            if bad:
                raise ConfigError(f"{flag} {str(path)!r}{why}")
        where = Path(path).expanduser().resolve()
        if where in seen:
            raise ConfigError(f"{seen[where]} and {flag} name the same file {str(path)!r}: give each its own path")
        seen[where] = flag


def input_files(*paths) -> list[Path]:
    """The files a command reads from `paths` (files, or every file inside folders), resolved; others left out."""
    found = []
    for p in paths:
        if not p:
            continue
        p = Path(p).expanduser()
        if p.is_file():
            found.append(p.resolve())
        elif p.is_dir():
            found += [f.resolve() for f in p.rglob("*") if f.is_file()]
    return found


def check_not_input(flag: str, path: str | Path | None, inputs: list[Path]) -> None:
    """Refuses to write `path` when it is one of the command's inputs: the report would replace what it describes."""
    if not path:
        return
    target = Path(path).expanduser()
    # `looked`: an input unanswered (ESTALE) is raised, never taken for no file and written over
    target = target.resolve() if exists(target) or target.is_symlink() else target.absolute()
    for source in inputs:
        if target == source or (exists(target) and exists(source) and os.path.samefile(target, source)):
            raise ConfigError(
                f"{flag} {str(path)!r} is one of this command's inputs ({source}): writing there would "
                "replace it; write the report to another path"
            )


@contextmanager
def quiet_progress_bars():
    """transformers' and datasets' progress bars off for a moment (saving, an index rewrite), as they were after."""
    import datasets
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars[0]:
            hf_logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()


def progress_bars_on_main_only() -> None:
    """transformers' and datasets' progress bars off in a launch's other processes, as the Trainer's own bar is: a
    job's log held each bar once per rank, and a bar still open (its line ends as it closes) glued another process's
    next line onto its own."""
    if launcher.launched_main():
        return
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def readable_weights(folder: str | Path) -> None:
    """The `*.safetensors` just saved in `folder` given the mode the umask gives any other file: safetensors 0.8 writes
    through a temporary file it creates 0600 (safetensors#782), so a run's weights were the one file of its folder
    the rest of a cluster group, reading its config.json, could not load."""
    umask = os.umask(0o077)  # read by setting it: 0o077 meanwhile, so a file another thread makes is never wider
    os.umask(umask)
    for path in Path(folder).glob("*.safetensors"):
        with contextlib.suppress(OSError):  # another user's file (a shared folder): left as it was
            os.chmod(path, 0o666 & ~umask)


# What Python 3.10-3.13's Path.exists()/is_file() take for no file beside ENOENT/ENOTDIR (pathlib's _IGNORED_ERRNOS):
# a link looping to itself (ELOOP) is none, as there; it is no look the file server left unanswered.
_NO_SUCH_PATH = (errno.ELOOP, errno.EBADF)


def looked(path: str | Path) -> os.stat_result | None:
    """`path`'s stat (links followed); None only where it is missing (FileNotFoundError, NotADirectoryError). Any other
    OSError (NFS's ESTALE, an EIO) is raised: Path.exists(), is_file() and is_dir() say False for every OSError on
    Python 3.14 (cpython gh-118243), so a look the file server did not answer was taken for a file gone, and a
    checkpoint deleted, a finished run trained again, a person's file written over. For a look whose False leads to a
    deletion, an overwrite, a fresh start or a checkpoint passed over; one that only words a message may say False."""
    try:
        return Path(path).stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno in _NO_SUCH_PATH:  # as Python 3.10-3.13's Path looks: a link to itself is no file
            return None
        raise


def is_file(path: str | Path) -> bool:
    """Path.is_file(), but an unanswered look raised (`looked`)."""
    return (found := looked(path)) is not None and stat.S_ISREG(found.st_mode)


def is_dir(path: str | Path) -> bool:
    """Path.is_dir(), but an unanswered look raised (`looked`)."""
    return (found := looked(path)) is not None and stat.S_ISDIR(found.st_mode)


def exists(path: str | Path) -> bool:
    """Path.exists(), but an unanswered look raised (`looked`)."""
    return looked(path) is not None


def missing_top(path: str | Path) -> Path | None:
    """The top-level folder of `path` (made absolute) where this machine has none: a file system not mounted here (a
    compute node's scratch seen from a login node, a container started without its bind mount) or a typo. Probed as
    the nearest folder that exists, `/` said the run could not write there, or, to root, let it make the folder in
    the root file system (a container's: lost with it)."""
    top = Path(*Path(os.path.abspath(path)).parts[:2])  # `/` alone for the root itself, which is always there
    return None if os.path.lexists(top) else top


def unwritable(path: str | Path) -> tuple[Path, str] | None:
    """Whether this process can create files at `path` (or the nearest folder that exists): None, or (the folder
    probed, why not). A real file is made and removed: permission bits say nothing to root, nor of a read-only mount.
    Named as `replacing`'s temporaries are, the probe a kill left is removed by the next probe there (under a random
    name it stayed, and made an empty output folder one of "files that are not a run's")."""
    path = Path(path)
    folder = next(p for p in (path, *path.absolute().parents) if p.exists())
    remove_dead_temporaries(folder, [PROBE])
    probe = folder / _temporary_name(folder / PROBE)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        return folder, e.strerror or type(e).__name__
    with contextlib.suppress(OSError):
        probe.unlink()
    return None


def check_path_limit(flag: str, path: str, room: int = 0) -> None:
    """Refuses `path` (given as `flag`) past its file system's limits (NAME_MAX, and PATH_MAX with `room`, what the run
    makes inside it): such a path fails in a traceback at the first call that touches it, even `exists()`."""
    full = Path(path).expanduser().absolute()
    name_max, path_max = _limits(full)
    long = next((name for name in full.parts if len(os.fsencode(name)) > name_max), None)
    if long is not None:
        raise ConfigError(
            f"{flag} {path!r}: the name {long[:24] + '...'!r} in it is {len(os.fsencode(long))} bytes, and this "
            f"file system takes names of at most {name_max} bytes (NAME_MAX): give a shorter name"
        )
    size = len(os.fsencode(str(full)))
    if size + room > path_max:
        inside = f", and the run's own names inside it take up to {room} more" if room else ""
        raise ConfigError(
            f"{flag} {path!r}: the path is {size} bytes{inside}; this file system takes paths of at most "
            f"{path_max} bytes (PATH_MAX): give a shorter path"
        )


def _limits(path: Path) -> tuple[int, int]:
    """NAME_MAX and PATH_MAX of the file system `path` is on, or would be: that of the nearest folder that exists."""
    for folder in (path, *path.parents):
        try:
            return os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
        except OSError:  # not there (yet), or itself past the limits
            continue
    return 255, 4096  # Linux's


def folder_bytes(*folders: Path) -> int:
    """The bytes of the files under `folders`. Others write there meanwhile (other jobs in the same caches: a run's
    reference log-probs, datasets' maps of the same pairs; other ranks in a checkpoint that failed on one): a file or
    folder they rename or remove while it is counted counts nothing."""
    total = 0
    for folder in folders:
        for top, _, names in os.walk(folder):  # a folder gone before it is listed is passed over (os.walk's way)
            for name in names:
                try:
                    found = os.stat(os.path.join(top, name))
                except OSError:
                    continue
                total += found.st_size if stat.S_ISREG(found.st_mode) else 0
    return total

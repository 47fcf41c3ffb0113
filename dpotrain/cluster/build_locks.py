"""Stale build locks of JIT-compiled ops: found before a job starts, instead of a job that waits forever.

DeepSpeed compiles some ops on first use (on CPU `deepspeed_shm_comm`, on GPU e.g. fused Adam) with
torch.utils.cpp_extension, in `<root>/<op>/`, root = $TORCH_EXTENSIONS_DIR or
~/.cache/torch_extensions/py<ver>_<device>. The builder creates `<op>/lock`, keeps it open while it compiles and
deletes it when done (torch.utils.file_baton.FileBaton); every other process waits while the file exists, with no
timeout and no message. A job killed during the build (time limit, scancel, a second preemption signal) leaves the
file behind, and every later job then hangs silently until its time limit.

A lock that no process on this machine holds open has no builder here. It is reported, not removed: with the
home folder shared between nodes a job on another node may be compiling right now, and a second builder in the
same folder would corrupt the op. `train_dpo.py` checks on every rank of a DeepSpeed launch before its arguments
are parsed, since building them starts DeepSpeed, which builds its op before the ranks meet: no collective can share
one rank's view, and none is needed. Each rank looks at its own node's folder, and a rank of the same job that is
already building holds the lock open, so it is not called stale. `scripts/launch.sh` runs the same check first:

    python -m dpotrain.cluster.build_locks     # exit 2 and one `error:` line per stale lock; 0 when there is none
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from dpotrain.recipe.errors import ConfigError, run_cli

CONFIRM_S = 0.2  # a lock found unheld is looked at again this much later (see stale_locks)


def extensions_root() -> Path:
    """The folder torch builds this interpreter's extensions in (torch.utils.cpp_extension._get_build_directory)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    version = _torch_file("version")
    if version.hip is not None:
        device = f"rocm{version.hip.replace('.', '')}"
    elif version.cuda is not None:
        device = f"cu{version.cuda.replace('.', '')}"
    else:
        device = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    # torch.utils.cpp_extension.get_default_build_root
    root = os.path.realpath(_torch_file("_appdirs").user_cache_dir(appname="torch_extensions"))
    return Path(root) / f"{python}_{device}"


def _torch_file(name: str):
    """torch's module `torch.<name>` run from its file without importing torch, which costs ~2 CPU-seconds that
    `scripts/launch.sh` would pay before every job: torch/version.py and torch/_appdirs.py import only the standard
    library."""
    spec = importlib.util.find_spec("torch")
    if spec is None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    path = Path(spec.submodule_search_locations[0]) / f"{name}.py"
    file_spec = importlib.util.spec_from_file_location(f"_torch_{name}_file", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def held_open() -> set[str]:
    """Paths of the files that processes on this machine hold open (those whose /proc/<pid>/fd we may read)."""
    paths = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    paths.add(os.readlink(fd))
                except OSError:  # closed meanwhile
                    pass
        except OSError:  # process gone, or another user's
            pass
    return paths


def _identity(lock: Path) -> tuple[int, int, int] | None:
    try:
        st = lock.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def stale_locks(root: Path | None = None, settle_s: float = CONFIRM_S) -> list[Path]:
    """Build locks under `root` that no process on this machine holds open.

    A builder closes its lock a moment before it deletes it (FileBaton.release), and a new one may take the lock
    while /proc is read: a lock counts as stale only if the same file is still there `settle_s` later and nobody held
    it in a second look."""
    root = root or extensions_root()
    found = {lock: _identity(lock) for lock in sorted(root.glob("*/lock"))}
    if not found:
        return []
    held = held_open()
    candidates = [lock for lock in found if os.path.realpath(lock) not in held]
    if not candidates:
        return []
    time.sleep(settle_s)
    held = held_open()
    return [lock for lock in candidates if _identity(lock) == found[lock] and os.path.realpath(lock) not in held]


def check_launch() -> None:
    """In `train_dpo.py`, on every rank, before anything starts DeepSpeed: a DeepSpeed launch with a stale lock in
    this node's extension folder is refused with the one line (other engines build no op: nothing to wait on)."""
    from dpotrain.cluster import engine

    if engine.launched().deepspeed:
        check()


def check() -> None:
    stale = stale_locks()
    if stale:
        ops = ", ".join(lock.parent.name for lock in stale)
        paths = " ".join(str(lock) for lock in stale)
        raise ConfigError(
            f"stale build lock of the JIT-compiled op(s) {ops}: a process was killed while compiling and no process "
            f"on this node holds the lock, so every job would wait on it forever. Remove it (rm {paths}) and resubmit "
            "(unless a job on another node sharing this folder is compiling it right now: then let that one finish)"
        )


if __name__ == "__main__":
    run_cli(check)

"""One run per output folder: `<output_dir>/run.lock`, taken by the launch's main process before anything is written
(docs/reliability.md). Two runs on one folder (a double `sbatch`) would delete each other's checkpoints.

The holder's record is written to a file of its own, then hard-linked to `run.lock`: atomic on NFS and Lustre, unlike
fcntl/flock (open(2), "O_EXCL ... on NFS"); without hard links, O_CREAT|O_EXCL. A run that is gone releases nothing
(SIGKILL, a lost node), so its lock is taken over (`free_reason`): by a requeue of the same Slurm job, once its process
is gone on this host, or once not refreshed for `STALE_S` from another host (a live holder touches it every
`HEARTBEAT_S`).
"""

import contextlib
import errno
import json
import os
import socket
import threading
import time
from pathlib import Path

from dpotrain.recipe import writes
from dpotrain.recipe.errors import ConfigError, cause, warn

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30  # how often a live run refreshes its lock's time
STALE_S = 300  # a lock of another host not refreshed for this long is a dead run's (node clocks agree to well within)
BREAK_STALE_S = 60  # a takeover in progress (run.lock.break) older than this was itself killed
# What link(2) says where the file system has no hard links: vfat and exFAT (EPERM), FUSE and object-store mounts
# (ENOSYS, ENOTSUP), and a few network and union mounts (EXDEV, EMLINK).
NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK}


def is_lock_file(name: str) -> bool:
    """The lock's own names in the output folder: the lock, a holder's file before it links it, a takeover's mark."""
    return name in (LOCK_FILE, f"{LOCK_FILE}.break") or name.startswith(f".{LOCK_FILE}.")


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22); None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def slurm_restart() -> int:
    """How many times Slurm has requeued this job (SLURM_RESTART_COUNT); 0 at its first start and outside Slurm. The one
    place the project reads it: the lock's takeover and the resume past a named checkpoint both ask it."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def slurm_job() -> str | None:
    """The Slurm job this process runs in (SLURM_JOB_ID), the same at every requeue of it; None outside Slurm."""
    return os.environ.get("SLURM_JOB_ID") or None


def holder_record(out: Path | None = None) -> dict:
    """Who this process is, as the lock names it, and the folder `out` it holds (`folder_inode`). No command line: it
    may hold a token."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": process_start(os.getpid()),
        "boot_id": boot_id(),
        "slurm_job_id": slurm_job(),
        "slurm_restart_count": slurm_restart(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        **({"folder_inode": folder_inode(out)} if out is not None else {}),
    }


def folder_inode(out: Path) -> int | None:
    """The folder's inode number: kept by `mv`, new in a copy. None where it cannot be looked at."""
    try:
        return os.stat(out).st_ino
    except OSError:
        return None


def copied(holder: dict, out: Path) -> bool:
    """Whether the lock came with a copy of its folder (`cp -r` of a run's folder): its holder, a process of this host,
    took another folder. Of another host's holder it is not told: a FUSE mount (gcsfuse, s3fs) numbers inodes per host,
    and a live run's lock read as a copy's would let a second run into its folder; a copy's lock, never refreshed, is
    taken once stale. A lock written before locks named their folder is never taken for one."""
    recorded, found = holder.get("folder_inode"), folder_inode(out)
    here = holder.get("host") == socket.gethostname()
    return here and isinstance(recorded, int) and found is not None and found != recorded


def alive_here(holder: dict) -> bool:
    """Whether the holder, a process of this host, still runs."""
    if holder.get("boot_id") and boot_id() and holder["boot_id"] != boot_id():
        return False  # the host restarted since
    try:
        if not writes.pid_alive(int(holder["pid"])):
            return False
    except (KeyError, TypeError, ValueError):
        return False
    started = process_start(int(holder["pid"]))
    return holder.get("process_start") is None or started is None or started == holder["process_start"]


# How every lock a run writes begins (`holder_record` as JSON): an unreadable run.lock that does not begin so was not
# cut short by a run, it is a person's file of that name, and is never taken over.
_LOCK_START = b'{\n "host": '


def foreign(out: Path, raw: bytes, holder: dict | None) -> str | None:
    """The refusal for a run.lock no run wrote; None for a run's lock (whole, or caught half-written)."""
    if holder is not None or raw[: len(_LOCK_START)] == _LOCK_START[: len(raw)]:
        return None
    return (
        f"output_dir {str(out)!r} holds a file named {LOCK_FILE} that no run wrote (a run's lock is JSON naming its "
        "holder): move that file out of the folder, or pass another --output_dir"
    )


def free_reason(holder: dict | None, age_s: float, out: Path | None = None) -> str | None:
    """Why a lock held by `holder` (refreshed `age_s` ago) in the folder `out` may be taken over; None when its holder
    may be alive and hold that folder."""
    if holder is None:
        return "unreadable" if age_s > STALE_S else None
    # A copy's lock was refused while the run it was copied from lived, naming that run as this folder's holder (and
    # `scancel` of it as a way out), and from another host until not refreshed for STALE_S
    if out is not None and copied(holder, out):
        return "a copy of another folder's lock (cp -r): its run holds that folder, not this one"
    job = slurm_job()
    restart = slurm_restart()
    if job and holder.get("slurm_job_id") == job and int(holder.get("slurm_restart_count") or 0) < restart:
        return f"an earlier start of this Slurm job ({job}), now requeued"
    if holder.get("host") == socket.gethostname():
        return None if alive_here(holder) else f"its process ({holder.get('pid')}) is gone"
    if age_s > STALE_S:
        return f"not refreshed for {age_s:.0f} s (> {STALE_S} s): its node is gone"
    return None


def _read(lock: Path) -> tuple[bytes, dict | None, float] | None:
    """The lock's bytes, its holder (None if unreadable) and seconds since it was refreshed; None when there is none."""
    try:
        raw, age = lock.read_bytes(), time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    except PermissionError as e:  # a 0600 lock of another user's run (umask 077): its traceback ended the command
        raise LockUnreadable(unreadable(lock, e), e) from None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    return raw, holder if isinstance(holder, dict) else None, age


class LockUnreadable(ConfigError):
    """A run.lock this process may not read (`unreadable`'s refusal); `error` the PermissionError, for a caller whose
    refusal says more (a resume from a checkpoint in that folder names the copy to make)."""

    def __init__(self, message: str, error: OSError):
        super().__init__(message)
        self.error = error

    def __reduce__(self):  # shared with every rank (`main_outcome` pickles it): else a RunError in its place there
        return type(self), (str(self), self.error)


def unreadable(lock: Path, error: OSError) -> str:
    """The refusal for a lock this process may not read: whether a live run holds its folder cannot be told, so
    nothing is taken for free (and nothing pushed or written there)."""
    return (
        f"the lock {lock} could not be read ({error.strerror}), so whether a live run holds {lock.parent} cannot be "
        f"told: it is another user's run's (ask them: they remove it once that run has ended), or fix its permissions "
        f"(chmod a+r {lock}); then run the same command again"
    )


def describe(holder: dict | None, age_s: float) -> str:
    if holder is None:
        return f"an unreadable lock, refreshed {age_s:.0f} s ago"
    job = holder.get("slurm_job_id")
    slurm = f", Slurm job {job} (restart {holder.get('slurm_restart_count', 0)})" if job else ""
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}{slurm}, since {holder.get('since')}; its lock was "
        f"refreshed {age_s:.0f} s ago"
    )


def refusal(out: Path, holder: dict | None, age_s: float) -> str:
    job = (holder or {}).get("slurm_job_id")
    stop = f"stop it (scancel {job})" if job else "stop it"
    return (
        f"output_dir {str(out)!r} is in use by another run ({describe(holder, age_s)}; {out / LOCK_FILE}): wait "
        f"for it to end, {stop}, or pass another --output_dir. A dead run's lock is taken over by itself: on its "
        f"host once its process is gone, from another host once not refreshed for {STALE_S} s"
    )


def live_holder(out: Path) -> tuple[dict | None, float] | None:
    """The holder of a live run's lock on `out` and seconds since it was refreshed; None where none is held (no lock, a
    dead run's, or a file no run wrote)."""
    found = _read(out / LOCK_FILE)
    if found is None or foreign(out, found[0], found[1]) or free_reason(found[1], found[2], out) is not None:
        return None
    return found[1], found[2]


def check_free(out: Path) -> None:
    """Refuses a folder a live run holds (read-only: any rank, before anything loads). `take` decides for real."""
    found = _read(out / LOCK_FILE)
    if found and (not_a_lock := foreign(out, found[0], found[1])):
        raise ConfigError(not_a_lock)
    if found and free_reason(found[1], found[2], out) is None:
        raise ConfigError(refusal(out, found[1], found[2]))


class Lock:
    """The lock this process holds on `out`, refreshed in the background until `release`."""

    def __init__(self, out: Path, raw: bytes, made: list[Path]):
        self.out, self.path, self.raw, self.made = out, out / LOCK_FILE, raw, made  # made: `_make`'s folders
        self.lost: str | None = None  # how the lock stopped being this run's: the run stops (`lost`)
        self.file = _file_of(self.path)  # the file this run made: a lock it may not read is its own, or another's
        self.folder = _open_folder(out)  # the folder itself, held open: its inode is not reused while the run runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _refresh(self, every_s: float | None = None) -> None:
        """The heartbeat thread: a beat every `every_s` (HEARTBEAT_S, read as it starts) until `release`, or until the
        lock is another run's. A beat that raised (the lock made unreadable, ESTALE, EIO) ended the thread, the lock's
        time stopped, and once stale another run could take the folder over while this one trained: now said once, and
        tried again at each beat."""
        every_s = HEARTBEAT_S if every_s is None else every_s
        failing = False
        while not self._stop.wait(every_s):
            try:
                if not self.beat():
                    return
                failing = False
            except Exception as e:  # noqa: BLE001 - any failure: a heartbeat that ends frees the folder to others
                if not failing:
                    warn(self._unrefreshed(e, every_s))
                failing = True

    def _unrefreshed(self, error: Exception, every_s: float) -> str:
        # `_read`'s refusal of a lock it may not read names the lock and its fix for a run that starts: the
        # PermissionError it was raised for is the cause here
        seen = error.__context__ if isinstance(error, ConfigError) and error.__context__ else error
        return (
            f"the lock {self.path} could not be refreshed ({cause(seen)}): tried again every {every_s:g} s; should it "
            f"stay so for {STALE_S} s, another run may take {self.out} over while this one trains"
        )

    def gone(self) -> bool:
        """Whether the output folder is no longer at its path (deleted, moved away, or a new folder of that name in its
        place): the run's next save would make a new one there (transformers' makedirs) and go on writing into it,
        without the run's record, earlier checkpoints or lock. A look that is not answered (EIO) is not taken for it."""
        try:
            found = os.stat(self.out)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False
        try:
            held = os.fstat(self.folder) if self.folder is not None else None
        except OSError:
            return False
        return held is not None and (found.st_dev, found.st_ino) != (held.st_dev, held.st_ino)

    def beat(self) -> bool:
        """Refreshes the lock's time; False once it is another run's (`lost` says whose). A lock removed by hand (`rm
        run.lock`, a folder that looked stuck) is linked again at once: a run started next took it, resumed from this
        run's checkpoint, and the two trained on in one folder, writing over each other's checkpoints."""
        try:
            found = _read(self.path)
        except LockUnreadable as unread:
            return self._unreadable_beat(unread)
        if found is None and self.gone():  # the run stops at its step's end (`folder_gone`); moved back, it beats on
            return True
        if found is None:
            with contextlib.suppress(OSError):  # not linked (a read-only folder): lost, below
                if _link(self.path, self.raw):
                    self.file = _file_of(self.path)
                    warn(
                        f"the lock {self.path} was removed while this run held it: taken again, so that no other run "
                        f"starts in {self.out}; remove it only once its run has ended"
                    )
                    return True
            found = _read(self.path)
        if found is None or found[0] != self.raw:
            self.lost = "removed" if found is None else f"taken by {describe(found[1], found[2])}"
            warn(f"the lock {self.path} is no longer this run's ({self.lost}): it stops at the end of its step")
            return False
        with contextlib.suppress(OSError):  # a file system hiccup: the next beat tries again, long before stale
            os.utime(self.path)
        return True

    def _unreadable_beat(self, unread: LockUnreadable) -> bool:
        """A beat at a lock this process may not read. Another file than the one this run made (stat tells it unread):
        the run's own was removed by hand and a colleague's run (umask 077) took the folder, so it is lost, not a failed
        refresh retried while two runs trained in one folder. The run's own made unreadable (chmod): its time still
        moved, and the refusal raised for `_refresh` to say once."""
        found = self.path.stat()
        # Its owner as shown when made, not this process's uid: NFS's root squash shows root's own file as nobody's
        if self.file is not None and (found.st_dev, found.st_ino, found.st_uid) != self.file:
            self.lost = f"taken by another user's run (uid {found.st_uid}), whose lock this run cannot read"
            warn(f"the lock {self.path} is no longer this run's ({self.lost}): it stops at the end of its step")
            return False
        with contextlib.suppress(OSError):
            os.utime(self.path)
        raise unread

    def release(self) -> None:
        self._stop.set()
        if self.folder is not None:
            with contextlib.suppress(OSError):
                os.close(self.folder)
            self.folder = None
        # A folder turned read-only keeps the lock: the run's error says why, and the rerun takes it over (its process
        # is gone). One made unreadable (chmod) too: the refusal `_read` raises would hide the run's own end here.
        with contextlib.suppress(OSError, ConfigError):
            found = _read(self.path)
            if found is not None and found[0] == self.raw:
                self.path.unlink(missing_ok=True)
        _unmake(self.made)  # refused before it wrote anything: no empty folder left for it, nor above it


_held: list[Lock] = []


def _file_of(path: Path) -> tuple[int, int, int] | None:
    """The file at `path` (device, inode and owner as shown: a file made after one removed may take its inode), None
    where it cannot be looked at."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_uid


def _open_folder(out: Path) -> int | None:
    """The output folder, opened (a descriptor: `Lock.gone` compares what is at its path now with it); None where it
    cannot be opened, and then no move of it is looked for."""
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None


def _link(lock: Path, raw: bytes) -> bool:
    """Makes `lock` hold `raw`, atomically, unless it exists (link(2): atomic on NFS where O_EXCL may not be)."""
    own = lock.with_name(f".{lock.name}.{socket.gethostname()}.{os.getpid()}")
    _create(own, raw, exclusive=False, lock=lock)
    try:
        os.link(own, lock)
        return True
    except FileExistsError:
        return False
    except OSError as e:  # NFS may report a failed link that was made: the link count tells (open(2))
        if os.stat(own).st_nlink == 2:
            return True
        return _create(lock, raw) if e.errno in NO_HARD_LINKS else False
    finally:
        own.unlink(missing_ok=True)


def _create(path: Path, raw: bytes, exclusive: bool = True, lock: Path | None = None) -> bool:
    """Makes `path` hold `raw`, on disk; `exclusive`: unless it exists (O_CREAT|O_EXCL, the lock without a hard link,
    where there are none), else False. A failed write is said of `lock` (train_dpo.main), the lock it was for."""
    lock = lock or path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC), 0o644)
    except FileExistsError:
        return False
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(lock)) from e
    try:
        # A file size limit or a disk filling on the way writes part and says so only at the next write: one write
        # left the lock cut short, the take succeeded, and the first heartbeat found the lock not this run's
        written = 0
        while written < len(raw):
            if not (wrote := os.write(fd, raw[written:])):  # a file system that takes nothing and says nothing
                raise OSError(errno.EIO, "the file system wrote none of it", str(path))
            written += wrote
        os.fsync(fd)
    except OSError as e:  # a full disk: no file left behind (no empty lock for the next run to wait out)
        with contextlib.suppress(OSError):  # read-only: not even a missing file may be removed
            path.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(lock)) from e
    finally:
        os.close(fd)
    return True


def _break(lock: Path, seen: bytes, why: str) -> None:
    """Removes a dead holder's lock, unless another run did so first (then it may hold a new one: left alone)."""
    breaker = lock.with_name(f"{lock.name}.break")
    if not _link(breaker, b""):
        found = _read(breaker)
        if found and found[2] > BREAK_STALE_S:
            breaker.unlink(missing_ok=True)  # a takeover killed half-way: the next attempt takes its place
        return
    try:
        found = _read(lock)
        if found and found[0] == seen:
            lock.unlink()
            print(f"Took over {lock} from {describe(found[1], found[2])}: {why}", flush=True)
    finally:
        breaker.unlink(missing_ok=True)


def _make(out: Path) -> list[Path]:
    """Makes `out` (a link to a folder still to be made: that folder, as mkdir -p); the folders it made, deepest first.
    Only `out` itself was known as made: a refused or failed take left the folders above it (and it) behind."""
    folder = out.resolve()
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _unmake(made: list[Path]) -> None:
    """Removes the folders `_make` made, deepest first, while each is empty: rmdir(2) refuses one that holds anything
    (a file a run or a person wrote since), and then the folders above it stay too. Never raises: the take's own
    refusal or error is the one to say."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def acquire(out: Path) -> str | None:
    """Takes the lock on `out` for this process; returns None, or the refusal when a live run holds it. A refused or
    failed take removes the folders it made for the lock (left behind empty before)."""
    made = _make(out)
    try:
        refused = _acquire(out, made)
    except BaseException:
        _unmake(made)
        raise
    if refused:
        _unmake(made)
    return refused


def _acquire(out: Path, made: list[Path]) -> str | None:
    lock = out / LOCK_FILE
    raw = json.dumps(holder_record(out), indent=1).encode() + b"\n"
    for _ in range(5):  # a takeover raced by another run: each try ends with a holder or a broken lock
        if _link(lock, raw):
            _held.append(Lock(out, raw, made))
            return None
        found = _read(lock)
        if found is None:
            continue  # released meanwhile
        if not_a_lock := foreign(out, found[0], found[1]):
            return not_a_lock
        why = free_reason(found[1], found[2], out)
        if why is None:
            return refusal(out, found[1], found[2])
        _break(lock, found[0], why)
        time.sleep(0.2)
    found = _read(lock)
    return refusal(out, *(found[1:] if found else (None, 0.0)))


def take(output_dir: str) -> None:
    """The launch's main process takes the lock; every rank learns the outcome from it (`main_outcome`: one broadcast,
    after the process group is made) and a refused launch ends on every rank with the same line. What `acquire` raises
    (a folder it may not make, a lock it may not write or read, ESTALE) is every rank's too: raised before the
    broadcast, it left the other ranks waiting there."""
    from dpotrain.cluster.collectives import main_outcome

    if refused := main_outcome(acquire, Path(output_dir)):
        raise ConfigError(refused)


def lost() -> str | None:
    """How a lock this process held stopped being its own ('taken by host ...'), or None: still held, or none."""
    return next((lock.lost for lock in _held if lock.lost), None)


def folder_gone() -> bool:
    """Whether the output folder of a lock this process holds was deleted or moved away since the lock was taken
    (`Lock.gone`); False where it holds none (the other ranks: the main process's answer is every rank's)."""
    return any(lock.gone() for lock in _held)


def gone_line(out: str | Path, ended: str) -> str:
    """The line of a run whose output folder was deleted or moved away while it trained; `ended`: where it ended."""
    return (
        f"the output folder {out} was deleted or moved away while this run trained: this run ended {ended}, writing "
        "nothing more there (a folder made again of that name would hold none of its record, checkpoints or lock); "
        f"move the folder back to {out} and run the same command again to go on from its newest checkpoint, or run "
        "it as it is to start afresh"
    )


def release() -> None:
    """Releases the locks this process holds (the end of a run, however it ends but SIGKILL)."""
    while _held:
        _held.pop().release()

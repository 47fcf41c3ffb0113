"""The run's output may lose its reader before the run ends: the terminal closes (SIGHUP, then EIO), or the `| tee log`
is killed by the same Ctrl-C that asked the run to stop (EPIPE). A write there would end the run in an OSError before
the checkpoint its stop promised, so a stream whose reader is gone is pointed at /dev/null, at the file descriptor
(prints, logging, tqdm, C libraries all go on). After the run's Ctrl-C, such a stream goes to the terminal the Ctrl-C
came from instead, where it has one: the stop's lines (the checkpoint saved, the command that goes on from it) are read
there, as without the pipe. Standard library only: `train_dpo.py` guards its streams before it imports the libraries
that keep a reference to them.
"""

import errno
import io
import os
import signal
import stat
import sys
import time

STREAMS = (1, 2)  # stdout, stderr
# The signals that ask a run to stop (train/preemption.py takes them over as the run begins)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_held: list[tuple[int, float]] = []  # stop signals heard while the libraries load (`hold_stops`), with when
_before_held: dict[int, object] = {}  # the handlers `hold_stops` replaced
_parent_at_start: list[int] = []  # this process's parent as `hold_stops` found it: its launcher, where one started it
_parent_command: list[list[str] | None] = []  # that parent's command line, read then (`parent_command_at_start`)
_reader_gone: list[int] = []  # the streams pointed elsewhere because their pipe's reader is gone
_ctrl_c = [False]  # the run's Ctrl-C heard (`heard_ctrl_c`), until the next run begins (`run_begins`)


def detach(fds: list[int], to_terminal: bool = False) -> None:
    """Points `fds` at /dev/null (`to_terminal`: at this process's terminal, where it has one): what read them is gone,
    and a write there would end the run in an OSError."""
    try:  # O_NOCTTY: a process without a terminal must not take one by opening it
        target = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY) if to_terminal else None
    except OSError:  # none (a Slurm job, nohup, a service): nowhere a person reads
        target = None
    target = os.open(os.devnull, os.O_WRONLY) if target is None else target
    for fd in fds:
        os.dup2(target, fd)
    os.close(target)


def hold_stops() -> None:
    """A stop signal heard while the libraries load (seconds; a minute from a busy shared file system) is kept for the
    run's stop (train/preemption.py, `take_held`), which stops before the model loads, saying so (exit 75). Python's
    default action ended the process there without a word (exit 143), while one a moment later stopped in one line.
    Not Ctrl-C, which ends the loading at once in one line (venv.loading_libraries); an ignored SIGHUP (nohup) stays
    ignored, as the run's stop leaves it. The parent is noted too (`parent_at_start`), with its command line."""
    _parent_at_start[:] = [os.getppid()]
    _parent_command[:] = [command_of(_parent_at_start[0])]
    for sig in STOP_SIGNALS:
        if sig == signal.SIGINT or (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN):
            continue
        _before_held[sig] = signal.signal(sig, _hold)


def _hold(signum, frame) -> None:
    if signum == signal.SIGHUP:  # the terminal is gone: a write to it would end the run (EIO) before its stop
        detach([fd for fd in STREAMS if os.isatty(fd)])
    _held.append((signum, time.time()))


def take_held(sig: int, handler) -> tuple[object, list[tuple[int, float]]]:
    """For the run's stop, which has just set its own handler for `sig` in place of `handler`: the handler to give back
    once the run is over (the one `hold_stops` replaced, not its own), and the `sig`s heard while held (taken)."""
    before = _before_held.pop(sig, handler) if handler is _hold else handler
    heard = [(signum, at) for signum, at in _held if signum == sig]
    _held[:] = [(signum, at) for signum, at in _held if signum != sig]
    return before, heard


def command_of(pid: int) -> list[str] | None:
    """Process `pid`'s command line; None: not readable (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.fsdecode(f.read()).split("\0")[:-1]
    except OSError:
        return None


def parent_command_at_start() -> list[str] | None:
    """The command line of the parent this process had as its command began (`hold_stops`), read then: a launcher
    killed while the libraries loaded is not there to read later. None where it noted none (imported) or could not."""
    return _parent_command[0] if _parent_command else None


def parent_at_start() -> int | None:
    """The parent this process had as its command began (`hold_stops`); None where it did not note one (imported)."""
    return _parent_at_start[0] if _parent_at_start else None


def run_begins() -> None:
    """A run's stop is made (`GracefulStop`): no Ctrl-C heard yet. One that a run before in this process heard
    (train_dpo.main called again, in a notebook) was that run's, kept past its end for its last lines (run_cli's, after
    main returns): kept on, a later run's lines, their pipe's reader gone (`| head`), went to the terminal as after a
    Ctrl-C."""
    _ctrl_c[0] = False


def heard_ctrl_c() -> None:
    """The run's Ctrl-C (the stop's signal handler): the `| tee` it killed came from the terminal it was pressed in,
    where the streams whose reader is gone write on, whether that was found before or after this."""
    _ctrl_c[0] = True
    if _reader_gone:
        detach(_reader_gone, to_terminal=True)


def _fstat(fd: int) -> os.stat_result | None:
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _readers_gone(fd: int) -> None:
    """`fd` lost its reader (EPIPE): it and the other stream on the same pipe (`2>&1 | tee`) go to /dev/null, or to
    the terminal after the run's Ctrl-C."""
    pipe = _fstat(fd)
    if pipe is not None:
        fds = [other for other in STREAMS if (found := _fstat(other)) and os.path.samestat(found, pipe)] or [fd]
        _reader_gone.extend(fds)
        detach(fds, to_terminal=_ctrl_c[0])


def _lost(fd: int, error: OSError) -> None:
    """A write to `fd` failed: where its pipe's reader is gone (EPIPE) or its terminal closed (EIO: the terminal a
    Ctrl-C pointed it at, or the run's own before the SIGHUP's handler ran), it is pointed elsewhere; any other error
    is raised. A hung-up terminal is still a character device to fstat, where isatty's ioctl fails."""
    if isinstance(error, BrokenPipeError):
        _readers_gone(fd)
    elif error.errno == errno.EIO and (found := _fstat(fd)) and stat.S_ISCHR(found.st_mode):
        detach([fd])
    else:
        raise error


def say(fd: int, data: bytes) -> None:
    """os.write for a signal handler (print is not safe there), where a reader gone is no error."""
    try:
        os.write(fd, data)
    except OSError as e:
        _lost(fd, e)
        os.write(fd, data)  # where it points now: the terminal after a Ctrl-C, else /dev/null


class _PipeWriter(io.FileIO):
    """fd 1 or 2 as a raw file whose writes outlive its reader: on EPIPE (or EIO from the terminal a Ctrl-C pointed it
    at, since closed), detached and written again."""

    def write(self, data):
        try:
            return super().write(data)
        except OSError as e:
            _lost(self.fileno(), e)
            return super().write(data)


def guard_streams() -> None:
    """sys.stdout and sys.stderr, where they go to a pipe (or a socket), rebuilt on `_PipeWriter`, as they were
    (encoding, buffering). A terminal is the SIGHUP handler's to detach (train/preemption.py); a file has no reader."""
    sys.stdout, sys.stderr = _guarded(sys.stdout, 1), _guarded(sys.stderr, 2)


def _guarded(old, fd: int):
    try:
        if old is None or old.fileno() != fd:  # replaced already (a test's capture): not this process's fd
            return old
        kind = os.fstat(fd).st_mode
    except (OSError, ValueError, io.UnsupportedOperation):
        return old
    if not (stat.S_ISFIFO(kind) or stat.S_ISSOCK(kind)):
        return old
    try:
        old.flush()
    except BrokenPipeError:
        _readers_gone(fd)
    raw = _PipeWriter(fd, "w", closefd=False)
    binary = raw if isinstance(old.buffer, io.FileIO) else io.BufferedWriter(raw)  # `python -u`: unbuffered
    return io.TextIOWrapper(
        binary,
        encoding=old.encoding,
        errors=old.errors,
        newline="\n",
        line_buffering=old.line_buffering,
        write_through=old.write_through,
    )

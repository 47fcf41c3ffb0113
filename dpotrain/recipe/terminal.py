"""The run's output may lose its reader before the run ends: the terminal closes (SIGHUP, then EIO), or the `| tee log`
is killed by the same Ctrl-C that asked the run to stop (EPIPE). A write there would end the run in an OSError before
the checkpoint its stop promised, so a stream whose reader is gone is pointed at /dev/null, at the file descriptor
(prints, logging, tqdm, C libraries all go on). Standard library only: `train_dpo.py` guards its streams before it
imports the libraries that keep a reference to them.
"""

import io
import os
import stat
import sys

STREAMS = (1, 2)  # stdout, stderr


def detach(fds: list[int]) -> None:
    """Points `fds` at /dev/null: what read them is gone, and a write there would end the run in an OSError."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


def _fstat(fd: int) -> os.stat_result | None:
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _readers_gone(fd: int) -> None:
    """`fd` lost its reader (EPIPE): it and the other stream on the same pipe (`2>&1 | tee`) go to /dev/null."""
    pipe = _fstat(fd)
    if pipe is not None:
        detach([other for other in STREAMS if (found := _fstat(other)) and os.path.samestat(found, pipe)] or [fd])


def say(fd: int, data: bytes) -> None:
    """os.write for a signal handler (print is not safe there), where a reader gone is no error."""
    try:
        os.write(fd, data)
    except BrokenPipeError:
        _readers_gone(fd)


class _PipeWriter(io.FileIO):
    """fd 1 or 2 as a raw file whose writes outlive its reader: on EPIPE, detached and written again to /dev/null."""

    def write(self, data):
        try:
            return super().write(data)
        except BrokenPipeError:
            _readers_gone(self.fileno())
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

"""The run's output (stdout, stderr) may lose its reader before the run ends: the terminal closes (SIGHUP; every write
to it then fails with EIO), or the `| tee log` the output goes through is killed by the same Ctrl-C that asked the run
to stop (every write then fails with EPIPE). A print, a logging handler or a progress bar writing there would end the
run in an OSError before the checkpoint its stop promised. So a stream whose reader is gone is pointed at /dev/null,
at the file descriptor: everything that writes to fd 1 or 2 (prints, logging handlers, tqdm, C libraries) goes on, and
what the run says from then on is lost with its reader. Standard library only: `train_dpo.py` guards its streams
before it imports the libraries that keep a reference to them.
"""

import io
import os
import stat
import sys

STREAMS = (1, 2)  # stdout, stderr


def is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def detach(fds: list[int]) -> None:
    """Points `fds` at /dev/null: what read them is gone, and a write there would end the run in an OSError."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


def _readers_gone(fd: int) -> None:
    """`fd` lost its reader (EPIPE): it and the other stream on the same pipe (`2>&1 | tee`) go to /dev/null."""
    try:
        pipe = os.fstat(fd)
    except OSError:
        return
    same = []
    for other in STREAMS:
        try:
            found = os.fstat(other)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (pipe.st_dev, pipe.st_ino):
            same.append(other)
    detach(same or [fd])


def say(fd: int, data: bytes) -> None:
    """os.write for a signal handler (print is not safe there), where a reader gone is no error."""
    try:
        os.write(fd, data)
    except BrokenPipeError:
        _readers_gone(fd)


class _PipeWriter(io.FileIO):
    """fd 1 or 2 as a raw file whose writes outlive its reader: on EPIPE the stream is detached and the write done
    again, to /dev/null."""

    def write(self, data):
        try:
            return super().write(data)
        except BrokenPipeError:
            _readers_gone(self.fileno())
            return super().write(data)


def guard_streams() -> None:
    """sys.stdout and sys.stderr, where they go to a pipe (or a socket), rebuilt on `_PipeWriter`, as they were
    (encoding, buffering). A terminal is the SIGHUP handler's to detach (dpotrain/train/preemption.py); a file has
    no reader to lose. Once, in a command's `__main__`, before the libraries keep a reference to the streams."""
    sys.stdout = _guarded(sys.stdout, 1)
    sys.stderr = _guarded(sys.stderr, 2)


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

import contextlib
import ctypes
import os
import sys

from dpotrain.recipe import upstream


class ConfigError(Exception):
    """Bad input found before any expensive work: the message is one line that names the fix."""


class RunError(Exception):
    """A run that cannot go on (found while it runs): the message is one line that says why and what to do."""


def cause(error: BaseException, limit: int = 300) -> str:
    """One line naming an error: its type and the first line of its text, at most `limit` characters of it (never a
    request's headers, where the token travels)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:limit] if text else ''}".rstrip(": ")


def size(n: int | None) -> str:
    """A number of bytes as a message writes it: '2.3 MiB' ('?' where it is not known)."""
    if n is None:
        return "?"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def plural(n, word: str, spec: str = "", count: bool = True, many: str | None = None) -> str:
    """`n word` as a message reads it: `plural(1, "pair")` is "1 pair", `plural(2, "process")` "2 processes",
    `plural(1234, "step", ",")` "1,234 steps"; `count=False` gives the word alone ("steps"); `many`, a plural that is
    not the word + s or es ("micro-batches": "epoch" takes s). The word is singular when the count as printed
    (`format(n, spec)`) reads "1": a float 1.0 under `g`, a `Spread` of one value. Here, in the module every
    message-writing module already imports, and which imports no library: a refusal stays light."""
    text = format(n, spec)
    if text != "1":
        word = many or word + ("es" if word.endswith(("s", "sh", "x")) else "s")
    return f"{text} {word}" if count else word


def warn(text: str) -> None:
    """`warning: <text>` on stderr, in one write: a line written in parts runs into another process's in a launch's
    shared log."""
    sys.stderr.write(f"warning: {text}\n")
    sys.stderr.flush()


def run_cli(main, own_line: bool = False) -> None:
    """Run a command's `main`; a ConfigError or RunError ends it in one line on stderr (exit 2, 1), no traceback, and
    Ctrl-C where nothing waits for a checkpoint (a dry run, the scripts) in one line too (exit 130: 128 + SIGINT, as a
    shell reports it, preemption.INTERRUPTED_EXIT). `own_line`: the error line starts with a line break, for a launch's
    other processes, whose log the main process's progress bar shares with its line not ended until it closes."""
    try:
        sys.exit(main())
    except (ConfigError, RunError, KeyboardInterrupt) as e:
        # An error met mid-step leaves the Trainer's progress bar open: closed first, the error starts a line.
        for bar in upstream.open_progress_bars():
            bar.close()
        # One write: a line written in two parts (`print`) runs into another process's in a launch's shared log.
        stopped = isinstance(e, KeyboardInterrupt)
        lead = "\n" if own_line else ""
        sys.stderr.write("\nCtrl-C: stopped\n" if stopped else f"{lead}error: {e}\n")
        sys.stderr.flush()
        sys.exit(130 if stopped else 2 if isinstance(e, ConfigError) else 1)


def run_command(main, own_line: bool = False) -> None:
    """`run_cli` for a process's own command (train_dpo.py's and each script's `__main__`): once `main` has ended, the
    process ends as Python's exit would, but without tearing the interpreter down (`end_process`)."""
    try:
        run_cli(main, own_line)
    except SystemExit as ended:
        end_with(ended)


def end_with(ended: SystemExit) -> None:
    """The process ended with `ended`'s code (`end_process`); a message to print (`sys.exit("...")`) is left to the
    interpreter's own exit, which prints it."""
    code = 0 if ended.code is None else ended.code
    if not isinstance(code, int):
        raise ended
    end_process(code)


def end_process(code: int) -> None:
    """End the process with `code` after what Python's exit does first, skipping its teardown: with the stack imported
    (torch, transformers, TRL, datasets, DeepSpeed), freeing every module and collecting the heap cost 1.4-2.8 CPU-s
    per process (BENCHMARKS.md, "The process's end"), paid by every rank, dry run, analyzer and refusal, and freed
    nothing the operating system does not free at exit. Only its own code's end: a traceback still exits the usual way.
    gc.freeze() instead would save most of it, but triton's nanobind then prints hundreds of 'leaked' lines."""
    upstream.wait_for_threads()  # as Python's exit, first: a background Hub upload, concurrent.futures' workers
    upstream.run_exit_handlers()  # then atexit's: W&B's teardown (its files), logging.shutdown, temporary folders
    try:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a stream that cannot take its last output: the interpreter's exit reports it
        sys.exit(code)
    # C libraries' stdio buffers (printf to a pipe): exit() flushes them, os._exit does not.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
    os._exit(code)

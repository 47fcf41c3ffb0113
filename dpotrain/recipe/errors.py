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


def run_cli(main) -> None:
    """Run a command's `main`; a ConfigError or RunError ends it in one line on stderr (exit 2, 1), no traceback, and
    Ctrl-C where nothing waits for a checkpoint (a dry run, the scripts) in one line too (exit 130: 128 + SIGINT, as a
    shell reports it, preemption.INTERRUPTED_EXIT)."""
    try:
        sys.exit(main())
    except (ConfigError, RunError, KeyboardInterrupt) as e:
        # An error met mid-step leaves the Trainer's progress bar open: closed first, the error starts a line.
        for bar in upstream.open_progress_bars():
            bar.close()
        # One write: a line written in two parts (`print`) runs into another process's in a launch's shared log.
        stopped = isinstance(e, KeyboardInterrupt)
        sys.stderr.write("\nCtrl-C: stopped\n" if stopped else f"error: {e}\n")
        sys.stderr.flush()
        sys.exit(130 if stopped else 2 if isinstance(e, ConfigError) else 1)

import contextlib
import ctypes
import difflib
import errno
import hashlib
import os
import sys
from decimal import Decimal

from dpotrain.recipe import upstream


class ConfigError(Exception):
    """Bad input found before any expensive work: the message is one line that names the fix."""


class RunError(Exception):
    """A run that cannot go on (found while it runs): the message is one line that says why and what to do."""


def cause(error: BaseException, limit: int = 300) -> str:
    """One line naming an error: its type and the first line of its text, at most `limit` characters of it (never a
    request's headers, where the token travels). A Hub error's reason, the Hub's own words (huggingface_hub's
    `server_message`, which it writes on a later line: "Bad request for commit endpoint:", then why), is added where
    that first line lacks it: a push the Hub refused said only "Bad request for commit endpoint"."""
    text = str(error).strip()
    first = text.splitlines()[0][:limit] if text else ""
    said = " ".join(str(getattr(error, "server_message", None) or "").split())[:limit]
    if said and said.lower() not in first.lower():
        first = f"{first.rstrip(': .')}: {said}"
    return f"{type(error).__name__}: {first}".rstrip(": ")


def closest(name: str, known, cutoff: float = 0.6) -> str | None:
    """The one of `known` that `name` is likeliest a misspelling of (difflib's similarity ratio at least `cutoff`), for
    every "did you mean"; None when none is that close. 0.6, difflib's own, where the list is a few dozen names; a
    caller with hundreds raises it (config._suggest)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def unknown_key_fix(key: str, known) -> str:
    """The fix for a key its reader does not take (`split_batchs`): the known key it may be a misspelling of, else the
    keys it takes."""
    known = sorted(known)
    close = closest(key, known)
    return f"did you mean {close!r}? Else remove it" if close else f"remove it (it takes {', '.join(known)})"


def size(n: int | None) -> str:
    """A number of bytes as a message writes it: '2.3 MiB' ('?' where it is not known)."""
    if n is None:
        return "?"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def plural(n, word: str, spec: str = "", count: bool = True, many: str | None = None) -> str:
    """`n word` as a message reads it: "1 pair", "2 processes", `plural(1234, "step", ",")` "1,234 steps";
    `count=False`: the word alone; `many`: a plural that is not the word + s or es. Singular where the count as printed
    (`format(n, spec)`) reads "1" (1.0 under `g`, a `Spread` of one value). Here, in the module every message-writing
    module imports and which imports no library: a refusal stays light."""
    text = format(n, spec)
    if text != "1":
        word = many or word + ("es" if word.endswith(("s", "sh", "x")) else "s")
    return f"{text} {word}" if count else word


def decimal(n: float) -> str:
    """A number of parts (epochs) as a message writes it: thousands separated, at most 3 decimals, no trailing zero
    ("0.5", "3", "20,833.333"), as the counts beside it; never format `g`'s "20833.3" or "1.23457e+06". One that
    rounds to 0 keeps its first digits ("0.0004"), not "0"."""
    text = f"{n:,.3f}".rstrip("0").rstrip(".")
    return format(Decimal(f"{n:.3g}"), "f") if n and text in ("0", "-0") else text


def warn(text: str) -> None:
    """`warning: <text>` on stderr in one write: a line in parts runs into another process's in a shared log."""
    sys.stderr.write(f"warning: {text}\n")
    sys.stderr.flush()


# The attribute an error carries where another rank writes its line: one given by the rank that met it
# (cluster/collectives.py) or decided alike on every rank from what they all gathered (train/agreement.py). Its value:
# the rank whose own line it is. Not written again on the others: a 4-GPU node's log held the same line 4 times.
SAID_BY = "said_by_rank"


def said_by(error: BaseException, rank: int = 0) -> BaseException:
    """`error`, marked as the line rank `rank` writes (`SAID_BY`); the others' copies of it are ended without it."""
    setattr(error, SAID_BY, rank)
    return error


# Whether this process has joined the ranks in a collective yet (cluster/collectives.py sets it at its first): before
# it, a ConfigError comes from the command, environment and files every rank reads alike. (The process group itself
# is up earlier: transformers starts it as it parses the training arguments.)
_ranks_met = [False]


def ranks_met() -> None:
    """Called at this process's first collective (`collectives._distributed`): refusals from then on may come from what
    the ranks exchanged, or from a rank's own share."""
    _ranks_met[0] = True


def writes_line(error: BaseException, rank: int = 0, first_on_node: bool = True) -> bool:
    """Whether the process of launch rank `rank` writes `error`'s one line: not where another rank writes it
    (`SAID_BY`, on the error or one it was raised from: disk_full's line for a write the main process failed). A
    ConfigError raised before the ranks' first collective mostly comes from what every rank reads alike: the first
    process on each node to meet it writes it (`first_to_say`: one line in the job's log, yet a node whose files
    differ, or a rank alone in its own environment, still says so). A failure of one rank's own: that rank's line."""
    if not _own_line(error, rank):
        return False
    if _ranks_met[0] or not isinstance(error, ConfigError):
        return True
    first = first_to_say(str(error))
    return first_on_node if first is None else first


def _own_line(error: BaseException, rank: int) -> bool:
    """Whether `error` is this rank's own line, not one another rank writes (`SAID_BY`, on it or one it was raised
    from)."""
    seen = error
    while seen is not None:
        if getattr(seen, SAID_BY, rank) != rank:
            return False
        seen = seen.__cause__ or seen.__context__
    return True


# Where a launched process that ends on its one `error:` line leaves that line (`mark_one_line_ends`:
# scripts/launch.sh's `<stop file>.refused`); empty: nowhere.
_ONE_LINE_MARK: list[str] = []


def mark_one_line_ends(path: str | None) -> None:
    """From now on, a ConfigError or RunError this process ends on (its own, not another rank's copy) is also written
    to `path` (None: nowhere). accelerate makes any worker's exit code 1, and the job's last line took it for a
    failure and sent the reader to a traceback there was none of: the file tells launch.sh it was a refusal."""
    _ONE_LINE_MARK[:] = [path] if path else []


def _leave_mark(line: str) -> None:
    """`line` in the file `mark_one_line_ends` named, whole (each rank that ends on it may write it at once); never
    raises: the line itself is on stderr already."""
    path = _ONE_LINE_MARK[0]
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(temporary, "w") as f:
            f.write(line)
        os.replace(temporary, path)
    with contextlib.suppress(OSError):
        os.unlink(temporary)


# The name of the mark `first_to_say` leaves: the line's own hash, so that a different refusal is written too.
SAID_MARK = "dpotrain-said-{}"


def first_to_say(line: str) -> bool | None:
    """Whether this process is the first of its node's to write `line`: before the ranks meet there is no collective
    to ask (the others may never join one), so each process that would write it creates a mark named by the line in
    the folder torchrun (`accelerate launch` runs it) made for this attempt of the launch on this node, the parent of
    each process's own TORCHELASTIC_ERROR_FILE folder; the kernel lets one create it. Without one (another launcher),
    None: the first process on the node writes it, and a refusal another process meets alone goes unsaid."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    attempt = os.path.dirname(os.path.dirname(error_file)) if error_file else ""
    if not os.path.basename(attempt).startswith("attempt_"):  # torchrun's layout: attempt_<n>/<local rank>/error.json
        return None
    mark = os.path.join(attempt, SAID_MARK.format(hashlib.sha256(line.encode()).hexdigest()[:16]))
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:  # a folder it cannot write: as without one
        return None
    return True


def run_cli(main, rank: int = 0, first_on_node: bool = True) -> None:
    """Run a command's `main`; a ConfigError or RunError ends it in one line on stderr (exit 2, 1), no traceback, and
    Ctrl-C where nothing waits for a checkpoint (a dry run, the scripts) in one line too (exit 130: 128 + SIGINT, as a
    shell reports it). `rank`, `first_on_node`: the process's place in a launch, for `writes_line`; another rank's
    line starts with a line break, as the log it shares may hold the main's progress bar, unended until it closes."""
    try:
        sys.exit(main())
    except (ConfigError, RunError, KeyboardInterrupt) as e:
        _end_on(e, rank, first_on_node)
    except Exception as e:
        own = _behind_peer_gone(e)
        if own is None:  # gloo's word that another process ended: nothing of this one's
            finish_wandb(1)  # the main process's, left waiting by a rank that died: its line last too
            _peer_gone_line("\n" if rank else "")
            sys.exit(1)
        if own is not e and isinstance(own, (ConfigError, RunError, KeyboardInterrupt)):  # this process's, met first
            _end_on(own, rank, first_on_node)
        if (ctrl_c := _during_ctrl_c(e)) is not None:
            _end_on(ctrl_c, rank, first_on_node)
        if (line := unanswered(own)) is not None:
            _end_on(line, rank, first_on_node)
        raise  # this process's own failure: its traceback (and what it was handling), as Python prints it


def _during_ctrl_c(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C `error` was raised while handling, if any: a library's clean-up that failed because the Ctrl-C cut
    its work short (datasets' map over 2+ processes waits 0.05 s for its workers' results as it ends, and raised
    multiprocess's TimeoutError over the KeyboardInterrupt: a traceback, exit 1). The Ctrl-C is what ended it."""
    seen, met = error.__context__, set()
    while seen is not None and id(seen) not in met:
        if isinstance(seen, KeyboardInterrupt):
            return seen
        met.add(id(seen))
        seen = seen.__context__
    return None


# A file server's failure to answer (NFS's ESTALE, an EIO), which the run's looks raise rather than take for a file gone
# (`writes.looked`): no bug of the run's and nothing of the user's input, so one line, not a traceback.
UNANSWERED = (errno.ESTALE, errno.EIO)


def unanswered(error: BaseException | None) -> RunError | None:
    """The one line an unanswered look at a file ends a command on: what and where, that nothing was taken for gone,
    and the fix; None for any other error (its traceback as Python prints it)."""
    if not isinstance(error, OSError) or error.errno not in UNANSWERED or not error.filename:
        return None
    return RunError(
        f"{error.filename} could not be read ({error.strerror}): the file system did not answer, and nothing was "
        "taken for gone, deleted or written over; run the same command again once it answers (a stale NFS handle "
        "clears on its own or with a remount: ask your admins if it stays)"
    )


def _end_on(e: BaseException, rank: int, first_on_node: bool) -> None:
    """A ConfigError or RunError in one line on stderr (exit 2, 1), a Ctrl-C in one (exit 130)."""
    # An error met mid-step leaves the Trainer's progress bar open: closed first, the error starts a line.
    for bar in upstream.open_progress_bars():
        bar.close()
    # One write: a line written in two parts (`print`) runs into another process's in a launch's shared log.
    stopped = isinstance(e, KeyboardInterrupt)
    code = 130 if stopped else 2 if isinstance(e, ConfigError) else 1
    finish_wandb(code)  # its closing lines before the run's line, as the process's exit printed them after it
    lead = "\n" if rank else ""
    if stopped or writes_line(e, rank, first_on_node):  # every rank still exits with its code: the launcher's
        sys.stderr.write("\nCtrl-C: stopped\n" if stopped else f"{lead}error: {e}\n")  # summary lists each
        sys.stderr.flush()
    if not stopped and _ONE_LINE_MARK and _own_line(e, rank):
        _leave_mark(f"error: {e}\n")
    sys.exit(code)


def finish_wandb(exit_code: int) -> None:
    """End the W&B run this process holds (a run's main process, where it reports to wandb) with the process's exit
    code, before the run's last line: W&B's exit handler ended it with that code too, but printed its closing lines
    ("wandb: You can sync this run ...") after that line. Nothing where wandb was never imported (not imported here)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(wandb, "run", None) is None:
        return
    try:
        wandb.finish(exit_code=exit_code)
    # Its service gone, its upload cut by a second Ctrl-C: said in a note, and the run's own line is still written
    # after it, where a traceback from here took its place
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any failure of W&B's ending
        sys.stderr.write(f"note: W&B could not end its run ({cause(e)}); its files are as the run left them\n")


def _behind_peer_gone(error: BaseException) -> BaseException | None:
    """`error`, where it is not gloo's word that a peer process ended (`upstream.peer_gone`); where it is, what this
    process was handling as the collective met the dead peer (its refusal being shared with the others, in
    `collectives.main_outcome`'s except: `__context__`), or None: nothing of its own. The peer-gone line alone hid that
    refusal (a reviewer's finding)."""
    while error is not None and upstream.peer_gone(error):
        while error.__cause__ is not None and upstream.peer_gone(error.__cause__):
            error = error.__cause__  # gloo's own error, where another was raised from it: what it was handling
        error = None if error.__suppress_context__ else error.__context__
    return error


# What a rank left in a collective by another process's end writes: the same words on every rank, so that a node's
# processes write it once (`first_to_say`), and nothing of gloo's own message (a port, a file of its source).
PEER_GONE = (
    "another process of this launch ended while this one waited for it in a collective (gloo: connection closed by "
    "peer): the first failing process's own line above, or the launcher's summary (its Root Cause), says why"
)


def _peer_gone_line(lead: str) -> None:
    """`error: <PEER_GONE>`, once per node where the launcher's layout allows: gloo's traceback, printed by every rank
    the dead one left waiting, hid the line that said why above it."""
    for bar in upstream.open_progress_bars():
        bar.close()
    if first_to_say(PEER_GONE) is not False:
        sys.stderr.write(f"{lead}error: {PEER_GONE}\n")
        sys.stderr.flush()


def run_command(main, rank: int = 0, first_on_node: bool = True) -> None:
    """`run_cli` for a process's own command (train_dpo.py's, each script's `__main__`), ended by `end_process`."""
    try:
        run_cli(main, rank, first_on_node)
    except SystemExit as ended:
        end_with(ended)


def end_with(ended: SystemExit) -> None:
    """The process ended with `ended`'s code (`end_process`); a message (`sys.exit("...")`) left to Python's exit."""
    code = 0 if ended.code is None else ended.code
    if not isinstance(code, int):
        raise ended
    end_process(code)


# Set where the process leaves work running at its end (`abandon_threads`): a final push given up on a stop request
# (hub_push.until_stopped), whose HTTP requests nothing interrupts. Python's exit joins concurrent.futures' workers,
# a daemon thread's pool too (huggingface_hub's LFS uploads): the process waited on the upload it gave up, past the
# job's end, and the job that was to requeue was killed instead.
_THREADS_ABANDONED = []


def abandon_threads() -> None:
    """The process's end joins no thread (`end_process`): what runs in them was given up."""
    _THREADS_ABANDONED.append(True)


def end_process(code: int) -> None:
    """End the process with `code` after what Python's exit does first, skipping its teardown: with the stack imported
    (torch, transformers, TRL, datasets, DeepSpeed), freeing every module and collecting the heap cost 1.4-2.8 CPU-s
    per process (BENCHMARKS.md, "The process's end"), paid by every rank, dry run, analyzer and refusal, and freed
    nothing the operating system does not free at exit. Only its own code's end: a traceback still exits the usual way.
    gc.freeze() instead would save most of it, but triton's nanobind then prints hundreds of 'leaked' lines."""
    if not _THREADS_ABANDONED:  # as Python's exit, first: a background Hub upload, concurrent.futures' workers
        upstream.wait_for_threads()
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

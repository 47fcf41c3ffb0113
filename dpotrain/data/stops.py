"""A run's passes over every pair (the data stage's read, `max_length: auto`'s measure, TRL's tokenization), stopped as
they run once the run's stop is asked (SIGTERM, SIGUSR1, Ctrl-C): acted on only once such a pass was over, a stop
waited minutes on a large data set, past a Slurm GraceTime. One mechanism for every pass (`stoppable`, `stopped`; a
map function of another's: `looking`)."""

import contextlib
import functools
import os
import sys

STOP_LOOK_S = 0.5  # how often a stoppable pass looks at the run's stop
# While a pass can be stopped: the flag its batches look at (forked map workers inherit it), 1 once a stop is asked
_STOPPING: dict = {"flag": None}


class PassStopped(Exception):
    """A stop was asked as a run read or measured every pair (`stoppable`): nothing of the pass is kept."""


@contextlib.contextmanager
def stoppable(stop_asked):
    """The passes inside, stopped at their next batch once `stop_asked()` (looked at every STOP_LOOK_S by a thread of
    this process, where the signal handlers run) is true: each batch (in this process or a forked map worker) looks at
    a shared flag (`stopped`) and raises its pass's `PassStopped`. No work is added to a pass, nor is it cut into maps
    of its own (each map's workers unpickle the tokenizer again). `stop_asked` None: nothing is stopped, and a SIGTERM
    left to end the process ends its map workers too (`_workers_end_with_it`)."""
    if stop_asked is None:
        with _workers_end_with_it():
            yield
        return
    import multiprocessing
    import threading

    # A byte of shared memory, no lock: a worker killed as the pool ends (its SIGTERM) holding an Event's lock left
    # the other waiting for it, and the pool's end waiting for that one
    flag, over = multiprocessing.RawValue("b", 0), threading.Event()

    def watch():
        while not over.wait(STOP_LOOK_S):
            if stop_asked():
                flag.value = 1
                return

    watcher = threading.Thread(target=watch, daemon=True)
    _STOPPING["flag"] = flag
    watcher.start()
    try:
        yield
    finally:
        over.set()
        watcher.join()
        _STOPPING["flag"] = None  # asked as the last batch ended: the pass is over, the run's next stop point stops


@contextlib.contextmanager
def _workers_end_with_it():
    """A SIGTERM to this process alone (`kill <pid>`, a wrapper's `Popen.terminate`) where nothing answers it (the
    analyzer, a dry run: its default, the process's end) ends the pass's map workers with it: only the pool's end stops
    them, and left running they held the command's output for good (`... | tee`, a caller's `communicate()` waited
    forever). The process still dies of the SIGTERM; a worker given one (Slurm's, a group's) dies of it, as before."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield  # the run's stop answers it (GracefulStop), or another's handler does
        return
    owner = os.getpid()

    def ended(signum, frame):
        if os.getpid() == owner:  # forked workers inherit this handler: each ends itself alone
            for module in ("multiprocess", "multiprocessing"):  # datasets' pools are multiprocess's
                for child in getattr(sys.modules.get(module), "active_children", list)():
                    child.kill()  # idle or mid-batch: nothing of a pass is kept
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, ended)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stopped() -> bool:
    """Whether the pass a batch belongs to is to stop (`stoppable`): a byte read, cheap enough for every row."""
    return (flag := _STOPPING["flag"]) is not None and bool(flag.value)


def looking(function):
    """`function`, a `Dataset.map` function another's code gives (TRL's tokenization), made to look at the run's stop
    first (`stopped`) at each row or batch, raising `PassStopped`. A partial of module-level names: the map's cache,
    named by its function's hash, is the same in every run."""
    return functools.partial(_looked_at, function)


def _looked_at(function, *args, **kwargs):
    if stopped():  # the error pickles from a map worker
        raise PassStopped("stopped as the pairs were tokenized")
    return function(*args, **kwargs)

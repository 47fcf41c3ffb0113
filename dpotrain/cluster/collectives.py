"""Agreement across ranks, with torch.distributed directly.

accelerate's `reduce` leaves a gloo (CPU) process group alone when its own state says it is not distributed, so the
project's few collectives go through torch.distributed. Outside a process group each is the identity.

What the main process alone does (a write, a question to the Hub) while the other ranks wait goes through
`main_outcome` or `main_first`: its failure is every rank's. A refusal on the main process alone left the others in
their next collective, under NCCL until the collective timeout (ddp_timeout, 30 min), under gloo with a traceback of a
"remote worker crashing"; now every rank raises the main's error, and each ends on its one line.
"""

import errno
import pickle
import resource
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dpotrain.data import stops
from dpotrain.recipe import upstream
from dpotrain.recipe.errors import RunError, cause, ranks_met, said_by

# The attribute an EFBIG given to another rank carries: the file size limit of the process that met it (a limit is
# per process, and another rank's may differ), which its one line names (train/disk_full.py).
SIZE_LIMIT = "size_limit"
AWAKE_LOOK_S = 0.05  # how often a rank waiting in an `awake` collective looks whether it is over


def file_size_limit() -> int:
    """This process's file size limit in bytes (`ulimit -f`; resource.RLIM_INFINITY where there is none)."""
    return resource.getrlimit(resource.RLIMIT_FSIZE)[0]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes in its group: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _distributed() -> bool:
    """Whether a collective joins other ranks (every one of this module's asks first)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks_met()  # a refusal from here on may be this rank's own: each rank writes its line (errors.writes_line)
        return True
    return False


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over ranks (a copy)."""
    if _distributed():
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def max_over_ranks(value: int, device, awake: bool = False) -> int:
    """The largest of every rank's `value`: one rank's request (stop, checkpoint) becomes every rank's."""
    return int(max_of_ranks([value], device, awake)[0])


def max_of_ranks(values: list[float], device, awake: bool = False) -> list[float]:
    """Each of `values`, the largest over ranks, in one collective (float64: every rank gets the same numbers).
    `awake`: waited for in looks AWAKE_LOOK_S apart, in which this process's signal handlers run: waiting in the
    collective itself, a rank heard its SIGTERM only once the rank it waited for had ended its turn (`in_turns`)."""
    if not _distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=awake)
    if awake:
        while not work.is_completed():
            time.sleep(AWAKE_LOOK_S)
        work.wait()  # its error, if it failed
    return tensor.tolist()


def broadcast_from_main(obj):
    """Rank 0's `obj` on every rank (any picklable object; the other ranks' `obj` is ignored)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (objects of different sizes: not tensors)."""
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main_outcome(work, *args):
    """`work(*args)` on the main process alone, its outcome every rank's: what it returned, or what it raised, raised
    on every rank. Every rank calls it; the others wait for the main's turn, as at a barrier."""
    if not _distributed():
        return work(*args)
    if dist.get_rank() != 0:
        return _taken(broadcast_from_main(None))
    try:
        value = work(*args)
    except Exception as failed:
        broadcast_from_main((False, _shareable(failed)))
        raise
    broadcast_from_main((True, value))
    return value


def every_rank_outcome(failed: Exception | None) -> None:
    """A step every rank runs with writes of its own (a checkpoint: the main process's weights and optimizer under DDP,
    each rank's shards under DeepSpeed), ended the same way on every rank: each rank gives what it raised, or None,
    and the first failure by rank is raised on every rank (on its own rank as itself, with its traceback). One
    all-gather: a rank that failed alone left the others in the next collective."""
    if not _distributed():
        if failed is not None:
            raise failed
        return
    outcomes = gather_objects(None if failed is None else _shareable(failed))
    first = next((rank for rank, outcome in enumerate(outcomes) if outcome is not None), None)
    if first is None:
        return
    if first == dist.get_rank():
        raise failed
    raise said_by(outcomes[first], first) from None  # its line is the rank's that met it


def every_rank(work, *args, **kwargs):
    """`work(*args, **kwargs)` on every rank (a check of files every rank reads, whose side effects each rank keeps),
    ended the same way on every rank (`every_rank_outcome`): a refusal met after the ranks' first collective was
    written by each rank that met it, one line per process; now by the first rank to meet it alone. `work` must not
    itself join the ranks (a rank refused before a collective inside it would leave the others there)."""
    failed, value = None, None
    try:
        value = work(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure is every rank's: a rank raising alone left the others waiting
        failed = e
    every_rank_outcome(failed)
    return value


# What a save's write may raise: torch.distributed.checkpoint's CheckpointException (FSDP2's checkpoint shards: one
# rank's refused write, shared with every rank) is a BaseException, which `except Exception` let through as a traceback.
REFUSED = (Exception, CheckpointException)


class HeldWrites:
    """A save whose collective parts every rank must run to their end (ZeRO-3's gathers and DeepSpeed's barriers in a
    checkpoint, TR-DPO's reference gathered after it): a write refused on one rank between two of them is held, not
    raised, and the rank goes on into the next with the others. Raised there, it left them waiting in that collective
    (gloo: a timeout; NCCL: ddp_timeout) while it waited in `every_rank_outcome`. `raise_first` once they are done."""

    def __init__(self):
        self.failed: BaseException | None = None

    def run(self, work, *args, **kwargs):
        """`work(*args, **kwargs)`, what it raised held (the first failure kept): None then. Never skipped after a
        failure: `work` may hold a collective (a gather before the main process writes)."""
        try:
            return work(*args, **kwargs)
        except REFUSED as e:
            self.failed = self.failed or e
            return None

    def raise_first(self) -> None:
        if self.failed is not None:
            raise self.failed


@contextmanager
def main_first():
    """accelerate's `main_process_first` (the main process's turn, then the others': a cache the main writes, the
    others read), with the main's failure raised on every rank, where accelerate's left the others at its barrier."""
    if not _distributed():
        yield
        return
    if dist.get_rank() != 0:
        _taken(broadcast_from_main(None))
        yield
        return
    try:
        yield
    except Exception as failed:
        broadcast_from_main((False, _shareable(failed)))
        raise
    broadcast_from_main((True, None))


@contextmanager
def in_turns(device):
    """TRL's order for its maps over the pairs (`global_then_local_main_first`: the main process, then each node's
    local main, then the others, each reading the cache the one before wrote), where a stop mid-map
    (`stops.PassStopped`) leaves no rank behind: accelerate's barriers between the turns were skipped by a rank that
    raised, the others left in them. Here every rank takes the same all-reduces between the turns, each saying whether a
    rank's turn stopped or heard the stop (`stops.stopped`); once one has, the turns still to come are skipped, and
    every rank raises PassStopped after the last all-reduce (its stop point then agrees on the stop and says it)."""
    from accelerate import PartialState

    state = PartialState()
    mine = 0 if state.is_main_process else 1 if state.is_local_main_process else 2
    stopped = None
    for turn in range(3):
        if turn == mine and stopped is None:
            try:
                yield
            except stops.PassStopped as e:
                stopped = e
        if (
            turn < 2
            and max_over_ranks(int(stopped is not None or stops.stopped()), device, awake=True)
            and stopped is None
        ):
            stopped = stops.PassStopped("stopped as another rank tokenized the pairs")
    if stopped is not None:
        raise stopped


STOP_KEY = "dpotrain/stop heard"  # set in the process group's store by the first rank to hear the run's stop


def stop_heard_on_any_rank(heard_here: bool) -> bool:
    """Whether a rank heard the run's stop: this one (`heard_here`, then told to the others in the process group's
    store), or another that told it. For the passes one rank does while the others wait for it in a collective
    (`in_turns`): a stop only a waiting rank heard (a SIGTERM to one task, a stop file on one node's disk) reached the
    working rank at its turn's end, minutes on a large data set. Not a collective: asked from a watcher thread."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return heard_here
    try:
        store = upstream.default_store()
        if heard_here:
            store.set(STOP_KEY, "1")
        return heard_here or store.check([STOP_KEY])
    except Exception:  # noqa: BLE001 - a store gone (its launcher ended): each rank's own stop, as before
        return heard_here


def _taken(outcome):
    """The main process's outcome on another rank: its value, or its error raised here (a copy: its traceback is in
    the main process's output)."""
    done, value = outcome
    if not done:
        raise said_by(value, 0) from None  # the main process writes its line
    return value


def _shareable(failed: Exception) -> Exception:
    """`failed` as another rank can be given it: itself (its type and fields, an OSError's errno and file, which the
    rank's own one-line message reads, and an EFBIG's file size limit, this process's), else one line naming it."""
    if isinstance(failed, OSError) and failed.errno == errno.EFBIG and not hasattr(failed, SIZE_LIMIT):
        setattr(failed, SIZE_LIMIT, file_size_limit())
    try:
        pickle.loads(pickle.dumps(failed))
        return failed
    except Exception:  # noqa: BLE001 - pickling fails as the object's own __reduce__ does: one line instead
        return RunError(f"the main process failed: {cause(failed)}")

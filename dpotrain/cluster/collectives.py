"""Agreement across ranks, with torch.distributed directly.

accelerate's `reduce` leaves a gloo (CPU) process group alone when its own state says it is not distributed, so the
project's few collectives go through torch.distributed. Outside a process group each is the identity.
"""

import os

import torch
import torch.distributed as dist


def launched_main() -> bool:
    """Whether this is the launch's first process (RANK 0, or no launcher): read from the launcher's environment, so it
    holds before the process group starts. The one place the project reads RANK."""
    return int(os.environ.get("RANK", "0")) == 0


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes in its group: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over ranks (a copy)."""
    if _distributed():
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def max_over_ranks(value: int, device) -> int:
    """The largest of every rank's `value`: one rank's request (stop, checkpoint) becomes every rank's."""
    return int(max_of_ranks([value], device)[0])


def max_of_ranks(values: list[float], device) -> list[float]:
    """Each of `values`, the largest over ranks, in one collective (float64: every rank gets the same numbers)."""
    if not _distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
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

"""Agreement across ranks, with torch.distributed directly.

accelerate's `reduce` leaves a gloo (CPU) process group alone when its own state says it is not distributed, so the
project's few collectives go through torch.distributed. Outside a process group each is the identity.
"""

import torch
import torch.distributed as dist


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
    if not _distributed():
        return value
    flag = torch.tensor([value], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())

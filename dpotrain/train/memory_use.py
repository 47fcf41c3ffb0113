"""The memory a run used, measured beside the memory plan (`dpotrain/plan/memory.py`), so every run checks the plan.

At each training log, and after the first step, the largest process's peaks (`memory/peak_reserved_gib`, what the
plan's total estimates, and allocated on a GPU; `memory/peak_rss_gib`) go beside `memory/planned_gib`. A GPU run whose
peak passes the plan says so once.
"""

import resource
import sys

import torch
from transformers import TrainerCallback

from dpotrain.cluster.collectives import max_of_ranks
from dpotrain.plan.memory import GIB


def peaks() -> dict[str, float]:
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    found = {"memory/peak_rss_gib": rss / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        found["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return found


class MemoryUse(TrainerCallback):
    """The peaks of the largest process (`measure` is one collective), with the plan's total; printed once the first
    optimizer step allocated its optimizer states."""

    def __init__(self, planned_gib: float | None, device=None):
        self.planned = planned_gib  # the plan's total per GPU (`MemoryPlan.total_gib`); None: not planned
        self.device, self.warned, self.stepped = device, False, False

    def measure(self) -> dict[str, float]:
        mine = peaks()
        names = sorted(mine)
        largest = max_of_ranks([mine[n] for n in names], self.device)
        found = dict(zip(names, (round(v, 3) for v in largest), strict=True))
        if self.planned is not None:
            found["memory/planned_gib"] = self.planned
        return found

    def line(self, found: dict[str, float]) -> str:
        """'Memory after step 1: peak 61.2 GiB reserved (58.0 allocated) per GPU, plan 64.1 GiB; host RSS 12.3 GiB'."""
        host = f"host RSS {found['memory/peak_rss_gib']:.1f} GiB"
        if "memory/peak_reserved_gib" not in found:
            plan = "" if self.planned is None else f", plan {self.planned:.1f} GiB per GPU (for a GPU run)"
            return f"peak {host} (a CPU run: no GPU memory to compare{plan})"
        gpu = (
            f"peak {found['memory/peak_reserved_gib']:.1f} GiB reserved "
            f"({found['memory/peak_allocated_gib']:.1f} allocated) per GPU"
        )
        plan = "not planned" if self.planned is None else f"plan {self.planned:.1f} GiB"
        return f"{gpu}, {plan}; {host}"

    def past_plan(self, found: dict[str, float]) -> str | None:
        """Once: the warning for a GPU peak past the plan's total."""
        reserved = found.get("memory/peak_reserved_gib")
        if self.warned or reserved is None or self.planned is None or reserved <= self.planned:
            return None
        self.warned = True
        return (
            f"warning: this run's GPU memory peak, {reserved:.1f} GiB reserved, passes the memory plan's "
            f"{self.planned:.1f} GiB: the plan underestimates this setup (a longer run may run out of memory); "
            "the per-part plan is in resolved_config.json (derived.memory)"
        )

    def warn(self, found: dict[str, float], main: bool) -> None:
        warning = self.past_plan(found)
        if warning and main:
            print(warning, file=sys.stderr, flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.stepped:
            return
        self.stepped = True
        found = self.measure()
        if state.is_world_process_zero:
            print(f"Memory after step {state.global_step}: {self.line(found)}", flush=True)
        self.warn(found, state.is_world_process_zero)

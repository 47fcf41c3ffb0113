"""Checkpoints that are safe to resume from.

transformers writes `checkpoint-N/` file by file, so a job killed mid-save leaves a folder that looks like a
checkpoint but is not one. `CompleteMarker` writes `COMPLETE` into the folder once every rank has finished its part,
and resuming only ever picks a folder with that mark.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

MARKER = "COMPLETE"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """`checkpoint-N` folders of `output_dir`, oldest step first, complete or not."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)))


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    complete = [p for p in checkpoints(output_dir) if (p / MARKER).exists()]
    return complete[-1] if complete else None


class CompleteMarker(TrainerCallback):
    """Marks a checkpoint complete after all ranks saved it (`on_save` runs after `_save_checkpoint` returns)."""

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # DeepSpeed ranks write their own optimizer shards
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                marker = {"global_step": state.global_step, "time": time.time()}
                (folder / MARKER).write_text(json.dumps(marker) + "\n")
        return control


def report_save(step: int, seconds: float) -> None:
    """Main process, after a checkpoint is written: how long it took, and a warning when that is more than a stop
    leaves for it — the time-limit warning (`--signal=B:USR1@<s>`) or the partition's preemption GraceTime, which
    scripts/launch.sh exports as DPOTRAIN_SAVE_WARN_S and DPOTRAIN_GRACE_S."""
    print(f"checkpoint-{step} written in {seconds:.1f} s", flush=True)
    limits = [(float(os.environ.get(name) or 0), what) for name, what in (
        ("DPOTRAIN_SAVE_WARN_S", "what the time-limit warning leaves (raise #SBATCH --signal=B:USR1@<seconds>)"),
        ("DPOTRAIN_GRACE_S", "the partition's preemption GraceTime (a preempted job is killed before its "
                             "checkpoint is complete: ask your admins for a longer GraceTime, or save to a faster "
                             "file system)"))]  # fmt: skip
    for limit, what in limits:
        if limit and seconds > limit:
            print(f"warning: checkpoint-{step} took {seconds:.0f} s, longer than the {limit:.0f} s of {what}",
                  file=sys.stderr, flush=True)  # fmt: skip

"""Checkpoints that are safe to resume from.

transformers writes `checkpoint-N/` file by file, so a job killed mid-save leaves a folder that looks like a
checkpoint but is not one. `CompleteMarker` writes `COMPLETE` into the folder once every rank has finished its part,
and resuming only ever picks a folder with that mark.
"""

import json
import re
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

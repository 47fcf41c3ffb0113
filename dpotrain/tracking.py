"""W&B wiring: one W&B run per output_dir, so a requeued or resumed job keeps logging to the same run."""

import os
import time
import uuid
from pathlib import Path

RUN_ID_FILE = ".wandb_run_id"


def setup_wandb(training) -> None:
    if "wandb" not in (training.report_to or []):
        return
    out = Path(training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    id_file = out / RUN_ID_FILE
    if "WANDB_RUN_ID" not in os.environ:
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])
        os.environ["WANDB_RUN_ID"] = id_file.read_text().strip()
    os.environ.setdefault("WANDB_RESUME", "allow")
    os.environ.setdefault("WANDB_DIR", str(out))  # offline runs live next to the model they describe
    os.environ.setdefault("WANDB_NAME", training.run_name)


def keep_offline_runs(output_dir: str | Path) -> Path | None:
    """Move `<output_dir>/wandb` aside before the folder is replaced, when it holds offline runs.

    Offline runs (WANDB_MODE=offline on nodes without network) exist nowhere else until `wandb sync`: replacing a run
    must not delete its only history. They go to `<output_dir>.wandb-offline-<time>/`, next to the output folder.
    """
    source = Path(output_dir) / "wandb"
    if not any(source.glob("offline-run-*")):
        return None
    target = source.parent.with_name(f"{source.parent.name}.wandb-offline-{time.strftime('%Y%m%d-%H%M%S')}")
    source.rename(target)
    return target

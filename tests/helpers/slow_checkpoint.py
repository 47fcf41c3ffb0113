"""`SLOW_CHECKPOINT_S=40 python tests/helpers/slow_checkpoint.py ARGS`: train_dpo.py ARGS, where a checkpoint asked
for by a stop (Ctrl-C, a preemption's SIGTERM, the stop file) takes SLOW_CHECKPOINT_S seconds longer between its files
and its COMPLETE mark, as on a slow shared file system. Tests use it to stop or kill a run while such a checkpoint is
being written; a link named train_dpo.py to this file stands in for the project's own in a job's folder."""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # through a link too: the project this file belongs to
sys.path.insert(0, str(ROOT))

from dpotrain.train.trainer import RecipeDPOTrainer  # noqa: E402  (the project, from ROOT)

SECONDS = float(os.environ["SLOW_CHECKPOINT_S"])
save_checkpoint = RecipeDPOTrainer._save_checkpoint


def slow_save_checkpoint(self, model, trial):
    save_checkpoint(self, model, trial)  # every file written; the COMPLETE mark comes after (CompleteMarker.on_save)
    if self.graceful_stop.stopped:
        time.sleep(SECONDS)


RecipeDPOTrainer._save_checkpoint = slow_save_checkpoint
sys.argv[0] = str(ROOT / "train_dpo.py")
runpy.run_path(str(ROOT / "train_dpo.py"), run_name="__main__")

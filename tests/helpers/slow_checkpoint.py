"""`SLOW_CHECKPOINT_S=40 python tests/helpers/slow_checkpoint.py ARGS`: train_dpo.py ARGS, where a checkpoint asked
for by a stop (Ctrl-C, a preemption's SIGTERM, the stop file) takes SLOW_CHECKPOINT_S seconds longer between its files
and its COMPLETE mark, as on a slow shared file system. Tests use it to stop or kill a run while such a checkpoint is
being written; a link named train_dpo.py to this file stands in for the project's own in a job's folder.

DPOTRAIN_TEST_HOLD (optional): points where the run waits for a stop request, so that a test's stop lands there
however slowly it arrives (a Slurm preemption: sbatch, the scheduler, the signal; seconds on a loaded machine, in
which a run polled for went on past the point, or to its end). Comma-separated, each `start@R` (at the run's first
stage boundary, before the model loads: nothing saved yet, as in a start-up longer than the time before a time-limit
warning), `reference@R` (after the process's first part of reference scores is saved) or `step-N@R` (at the end of
optimizer step N, before the ranks agree on a stop), held at Slurm restart R only (SLURM_RESTART_COUNT; 0 outside
Slurm), so that the requeued run goes on. Every process of the run holds there until its own stop (a signal, or the
stop file) is asked; the first one to get there writes `held-<point>` in DPOTRAIN_TEST_HOLD_DIR, which the test waits
for before it stops the run."""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # through a link too: the project this file belongs to
sys.path.insert(0, str(ROOT))

from dpotrain.reference import reference  # noqa: E402  (the project, from ROOT)
from dpotrain.train.preemption import GracefulStop  # noqa: E402
from dpotrain.train.trainer import RecipeDPOTrainer  # noqa: E402

SECONDS = float(os.environ["SLOW_CHECKPOINT_S"])
HOLD = {p for p in os.environ.get("DPOTRAIN_TEST_HOLD", "").split(",") if p}
RESTART = os.environ.get("SLURM_RESTART_COUNT") or "0"
save_checkpoint = RecipeDPOTrainer._save_checkpoint


def slow_save_checkpoint(self, model, trial):
    save_checkpoint(self, model, trial)  # every file written; the COMPLETE mark comes after (CompleteMarker.on_save)
    if self.graceful_stop.stopped:
        time.sleep(SECONDS)


def hold(point: str, stop) -> None:
    """Wait at `point` (once per process) until `stop` is asked, if the test asked for a hold there."""
    if f"{point}@{RESTART}" not in HOLD or point in held:
        return
    held.add(point)
    marker = Path(os.environ["DPOTRAIN_TEST_HOLD_DIR"]) / f"held-{point}"
    try:
        marker.touch(exist_ok=False)  # the first process there says so; each waits for its own request
    except FileExistsError:
        pass
    while not stop.asked_here():  # the signal handler runs in this sleep (the main thread)
        time.sleep(0.05)


held: set[str] = set()
stops = []  # the run's GracefulStop, as the reference stage's stop checks are handed it
stop_checks_init, write_part = reference._StopChecks.__init__, reference.Store.write_part


def recording_stop_checks_init(self, stop, *args, **kwargs):
    stops.append(stop)
    stop_checks_init(self, stop, *args, **kwargs)


def holding_write_part(self, *args, **kwargs):
    write_part(self, *args, **kwargs)
    if stops:
        hold("reference", stops[-1])


on_step_end, stop_before_training = GracefulStop.on_step_end, GracefulStop.stop_before_training


def holding_stop_before_training(self, *args, **kwargs):
    hold("start", self)
    return stop_before_training(self, *args, **kwargs)


def holding_on_step_end(self, args, state, control, **kwargs):
    hold(f"step-{state.global_step}", self)
    return on_step_end(self, args, state, control, **kwargs)


RecipeDPOTrainer._save_checkpoint = slow_save_checkpoint
reference._StopChecks.__init__ = recording_stop_checks_init
reference.Store.write_part = holding_write_part
GracefulStop.on_step_end = holding_on_step_end
GracefulStop.stop_before_training = holding_stop_before_training
sys.argv[0] = str(ROOT / "train_dpo.py")
runpy.run_path(str(ROOT / "train_dpo.py"), run_name="__main__")

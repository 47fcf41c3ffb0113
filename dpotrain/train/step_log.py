"""One readable line per logging step instead of transformers' dictionary printed inside the progress bar:

    step 4/12  loss 0.6931  acc 0.50  margin 0.001  lr 1.0e-06  grad_norm 3.2  tok/s 812

`acc` and `margin` are on the loss's scale (`rewards_norm/*`) where logged, else TRL's `rewards/*` (all: metrics.jsonl).
"""

import sys

from transformers.trainer_callback import ProgressCallback

from dpotrain.recipe import upstream

# (label, keys in order of preference, format)
FIELDS = [
    ("loss", ("loss",), "{:.4f}"),
    ("acc", ("rewards_norm/accuracies", "rewards/accuracies"), "{:.2f}"),
    ("margin", ("rewards_norm/margins", "rewards/margins"), "{:.3g}"),
    ("lr", ("learning_rate",), "{:.1e}"),
    ("grad_norm", ("grad_norm",), "{:.3g}"),
    ("tok/s", ("tokens_per_second",), "{:,.0f}"),
]


def line(logs: dict, step: int, max_steps: int, first_step: int | None = None, stopped: bool = False) -> str | None:
    """The line of one log record: a training step's, an evaluation's, or the end of training's; None for others.
    `first_step`: the step this attempt started at (a resume's), where known. `stopped`: training ended before
    max_steps (a stop request, a health guard's stop)."""
    if "train_runtime" in logs and step == first_step:  # resumed at its last step: transformers says mean loss 0
        return f"trained to step {step}/{max_steps}: no step left to train after the checkpoint resumed from"
    if "train_runtime" in logs:  # transformers' summary once training ends
        took = f"in {logs['train_runtime']:.1f} s"
        if isinstance(logs.get("train_loss"), float):
            took += f", mean loss {logs['train_loss']:.4f}"
        # transformers times and averages this attempt's steps alone: the line names them, where "trained to step 8/8
        # in 0.1 s" read as the whole run's time (the earlier attempts' times are in no record)
        steps = f"steps {first_step + 1}-{step}" if first_step and step > first_step + 1 else f"step {step}"
        if stopped:
            # The run's last line after its stop line: it read `trained to step 3/12 in 3.8 s`, a finished run's words
            attempt = f"{steps} this attempt, resumed from step {first_step}: " if first_step else ""
            took = took.removeprefix("in ")
            return f"training stopped at step {step}/{max_steps}, before its last step ({attempt}{took})"
        if not first_step:
            return f"trained to step {step}/{max_steps} {took}"
        return f"trained {steps} of {max_steps} {took} (this attempt, resumed from step {first_step})"
    evaluation = "eval_loss" in logs
    if evaluation:
        logs = {k.removeprefix("eval_"): v for k, v in logs.items()}
    elif "loss" not in logs:
        return None
    parts = [f"eval at step {step}/{max_steps}" if evaluation else f"step {step}/{max_steps}"]
    for label, keys, form in FIELDS:
        key = next((k for k in keys if isinstance(logs.get(k), (int, float))), None)
        if key is not None:
            parts.append(f"{label} {form.format(logs[key])}")
    return "  ".join(parts)


def write_line(text: str) -> None:
    """`text` as a line of stdout that starts a line of its own where a progress bar is live: a bar leaves its cursor
    at the end of its row, and a stop's line printed there (`Stop requested: ...`) was glued onto it on a terminal,
    `0%|...| 0/12 [...]Stop requested`. tqdm's write clears the bars, writes the line and draws them again below it,
    as `StepLog.on_log` writes its lines; with no bar open (before training, after its bar closed), a print."""
    bars = [bar for bar in upstream.open_progress_bars() if not bar.disable]
    if bars:
        type(bars[0]).write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


class StepLog(ProgressCallback):
    """transformers' progress bar, its log records written as `line`s above it; with `disable_tqdm`, the lines alone."""

    first_step: int | None = None  # where this attempt started: a resumed run's checkpoint step

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step
        if not args.disable_tqdm:
            super().on_train_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        # The evaluation's bar is drawn a row under the training bar by moving the cursor up (ESC[A) at each update: in
        # a file (a Slurm log) those land as `^[[A` between the lines. There the evaluation's own line is enough.
        if not args.disable_tqdm and (self.training_bar is None or sys.stderr.isatty()):
            super().on_prediction_step(args, state, control, eval_dataloader, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        main = state.is_world_process_zero
        stopped = state.global_step < state.max_steps  # a stop request or a health guard ended it early
        text = line(logs or {}, state.global_step, state.max_steps, self.first_step, stopped) if main else None
        if text is None:
            return
        if self.training_bar is not None:
            self.training_bar.write(text)
        else:
            print(text, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)

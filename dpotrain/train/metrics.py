"""The run's metrics history (`metrics.jsonl`, one record per logging step) and its training-curve plot."""

from pathlib import Path

from transformers import TrainerCallback

from dpotrain.cluster import collectives
from dpotrain.recipe import records as run_records
from dpotrain.recipe.errors import plural, warn
from dpotrain.recipe.writes import replacing, write_text

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
# What a DPO run is judged by, one panel each: (title, y-axis label, keys drawn in it); a panel with no line is left
# out, and why a run may have none (`WHY_ABSENT`) is printed under the figure. TRL's rewards/* are beta x SUMMED
# log-ratios even with sigmoid_norm (hundreds on long completions); rewards_norm/* are per completion token, the scale
# the loss and the health guards use (a few units): two panels, never one axis.
CURVES = [
    ("loss", "", ["loss", "dpo_loss"]),  # dpo_loss: without the MoE router term, logged when the loss has one
    ("reward accuracy", "share of pairs, chosen > rejected", ["rewards/accuracies", "rewards_norm/accuracies"]),
    ("reward margin summed over tokens (TRL)", "beta x summed log-ratio,\nchosen - rejected", ["rewards/margins"]),
    (
        "rewards per completion token (the loss's scale)",
        "beta x log-ratio\n/ completion tokens",
        ["rewards_norm/margins", "rewards_norm/chosen", "rewards_norm/rejected"],
    ),
    ("learning rate", "", ["learning_rate"]),
    ("tokens per second", "non-padding tokens / s", ["tokens_per_second", "tokens_per_second_per_gpu"]),
    ("MFU", "model FLOPs / GPU peak", ["mfu"]),
]
WHY_ABSENT = {
    "MFU": "MFU not plotted: it needs a GPU's peak FLOP/s (H100/H200/B200 detected, or gpu_peak_tflops), none on a CPU."
}


class MetricsRecorder(TrainerCallback):
    """Appends every training or evaluation log record to metrics.jsonl (main process). After a resume the records past
    the checkpoint's step are dropped first (trained again), and the first record says `resumed_from`, which the plot
    marks."""

    def __init__(self):
        self._trimmed = False
        self._resumed_from = None
        self._checkpoint_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        # A resume: the Trainer has loaded the checkpoint's state. `_resumed_from` marks the first record written.
        self._resumed_from = self._checkpoint_step = state.global_step or None
        if self._resumed_from:  # before the health guard and W&B read the records back
            collectives.main_outcome(restore, Path(args.output_dir) / METRICS_FILE, state.log_history)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:  # the last step is always recorded, whatever logging_steps says
            control.should_log = True
        log_saved_step(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        log_saved_step(control)  # save_strategy or eval_strategy epoch: the epoch's last step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not ({"loss", "eval_loss"} & set(logs)):  # every rank logs these, the main process writes
            return
        # Its refusal (a full disk) is every rank's line, not the main's alone while the others wait in the next step's
        # all-reduce (NCCL: for ddp_timeout). A broadcast per logged record: about 1.4 ms on 2 gloo CPU ranks, where
        # the Trainer has just gathered the loss (the ranks are together) and a step takes 100 ms or more.
        collectives.main_outcome(self._write, Path(args.output_dir) / METRICS_FILE, state, logs)

    def _write(self, path: Path, state, logs: dict) -> None:
        if not self._trimmed:
            # A resume trims at the checkpoint's step, not at its first record's: with eval_on_start that record is an
            # evaluation AT the checkpoint's step, and trimming there dropped the step's training record (kept in the
            # checkpoint, never trained again); the resume's evaluation is added after it.
            keep_before(path, state.global_step if self._checkpoint_step is None else self._checkpoint_step + 1)
            self._trimmed = True
        record = {"step": state.global_step, "epoch": state.epoch, **logs}
        if self._resumed_from is not None:
            record["resumed_from"], self._resumed_from = self._resumed_from, None
        run_records.append(path, [record])  # whole, or not at all


def log_saved_step(control) -> None:
    """A step saved as a checkpoint is logged too: a resume counts `num_tokens` on from the checkpoint's last record,
    and the steps since it (a save_steps not a multiple of logging_steps; a stop's checkpoint, at any step) were in no
    record: the demo (logging_steps 2) stopped at step 3 logged step 3's loss nowhere and ended 1,657 tokens short.
    So is a step that evaluates: its save is decided after the evaluation (save_strategy best; a stop asked during
    it), past the point where transformers logs."""
    if control.should_save or control.should_evaluate:
        control.should_log = True


def keep_before(path: Path, step: int) -> None:
    """After a resume: a history's records of `step` and later dropped (trained again); a kill here keeps it whole."""
    kept = [r for r in run_records.read(path, step=True) if r["step"] < step]
    write_text(path, "".join(run_records.dumps(r) + "\n" for r in kept))


def restore(path: Path, history: list[dict]) -> None:
    """After a resume: the records of the checkpoint's steps that metrics.jsonl lacks (deleted or edited between
    attempts, so the history, plot and card began at the resume), written again from the checkpoint's trainer state,
    whose log history holds every record this callback wrote (`Trainer.log`), and said."""
    records = run_records.read(path, step=True)
    have = {(r["step"], "eval_loss" in r) for r in records}
    lost = [
        {"step": h["step"], "epoch": h.get("epoch"), **h}
        for h in history
        if {"loss", "eval_loss"} & set(h) and (h["step"], "eval_loss" in h) not in have
    ]
    if not lost:
        return
    # A step's training record before its evaluation's, as they were logged
    whole = sorted(records + lost, key=lambda r: (r["step"], "eval_loss" in r))
    write_text(path, "".join(run_records.dumps(r) + "\n" for r in whole))
    steps = steps_text(list(dict.fromkeys(r["step"] for r in lost)), "logged")
    warn(
        f"{path} lacked the records of step {steps}, which the checkpoint resumed from holds: written again from its "
        "trainer_state.json"
    )


def steps_text(numbers: list[int], what: str) -> str:
    """ "1, 2, 4", or "2 to 40 (20 <what>)" where there are more than 4."""
    if len(numbers) <= 4:
        return ", ".join(map(str, numbers))
    return f"{numbers[0]} to {numbers[-1]} ({len(numbers)} {what})"


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return run_records.read(path, step=True)  # a last line cut short by a crash is dropped, with a warning


def last_logged(records: list[dict], key: str = "loss") -> dict | None:
    """The last record holding `key`: "loss" a training step's, "eval_loss" an evaluation's (logged after the training
    record of its step)."""
    return next((r for r in reversed(records) if key in r), None)


def measured_panels(records: list[dict]) -> tuple[list[tuple[str, str, dict]], list[str]]:
    """The panels the run has data for, as (title, y label, {series: [(step, value), ...]}), and why others are not."""
    panels, absent = [], []
    for title, ylabel, keys in CURVES:
        names = [name for key in keys for name in (key, f"eval_{key}")]  # eval_: the held-out split's, when evaluated
        series = {name: points for name in names if (points := [(r["step"], r[name]) for r in records if name in r])}
        if series:
            panels.append((title, ylabel, series))
        elif title in WHY_ABSENT:
            absent.append(WHY_ABSENT[title])
    return panels, absent


def metrics_figure(records: list[dict], title: str = ""):
    """The training curves as a matplotlib figure: one panel per measured group, legends beside the data."""
    import matplotlib

    matplotlib.use("Agg")  # login and compute nodes have no display
    import matplotlib.pyplot as plt

    panels, notes = measured_panels(records)  # notes: why a panel is left out, the resumes
    rows = max(1, (len(panels) + 1) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.9 * rows), sharex=True, squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (label, ylabel, series) in zip(axes.flat, panels, strict=False):
        for i, (name, points) in enumerate(series.items()):
            # Later lines dashed: series that coincide (accuracies, tokens/s on one GPU) stay visible as two.
            marker, linestyle = "." if len(points) < 50 else None, "-" if i == 0 else "--"
            ax.plot(*zip(*points, strict=True), marker=marker, label=name, linestyle=linestyle)
        if len(series) > 1:
            # Beside the axes, never on the data: the free column between the two panels of a row.
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.set_title(label)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=True)
    resumes = sorted({r["resumed_from"] for r in records if "resumed_from" in r})
    for ax in axes.flat[: len(panels)]:
        for step in resumes:  # a dotted line where the run went on from a checkpoint
            ax.axvline(step, color="0.4", linestyle=":", linewidth=1)
    if resumes:
        steps = ", ".join(str(s) for s in resumes)
        notes.append(f"Dotted lines: resumed from a checkpoint at {plural(len(resumes), 'step', count=False)} {steps}.")
    for ax in axes.flat[: len(panels)][-2:]:  # the lowest panel of each column
        ax.set_xlabel("optimizer step")
    fig.suptitle(title)
    if notes:
        fig.supxlabel("\n".join(notes), fontsize=8, color="0.35")
    return fig


def plot_metrics(records: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt

    fig = metrics_figure(records, title)
    with replacing(path, "wb") as f:  # a kill mid-write leaves the previous plot whole, never half an image
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return Path(path)

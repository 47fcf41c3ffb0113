"""The run's metrics history (`metrics.jsonl`, one record per logging step) and its training-curve plot."""

import json
from pathlib import Path

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
# What a DPO run is judged by: (panel title, keys drawn in it). TRL's rewards/* are beta x SUMMED log-ratios even with
# sigmoid_norm; rewards_norm/* (beta x log-ratio / completion tokens) are on the loss's own scale, and
# tokens_per_second counts non-padding tokens. A key a run did not log leaves its line out.
CURVES = [
    ("loss", ["loss", "dpo_loss"]),  # dpo_loss: without the MoE router term, logged when the loss has one
    ("reward accuracy", ["rewards/accuracies", "rewards_norm/accuracies"]),
    ("reward margin (summed, TRL)", ["rewards/margins"]),
    ("rewards on the loss's scale", ["rewards_norm/margins", "rewards_norm/chosen", "rewards_norm/rejected"]),
    ("learning rate", ["learning_rate"]),
    ("tokens per second", ["tokens_per_second", "tokens_per_second_per_gpu"]),
    ("MFU (model FLOPs / GPU peak)", ["mfu"]),
]


class MetricsRecorder(TrainerCallback):
    """Appends every training or evaluation log record (`loss` / `eval_loss`) to `<output_dir>/metrics.jsonl` (main
    process only).

    After a resume the records past the checkpoint's step are dropped first: those steps are trained again, and the
    history must hold each step once.
    """

    def __init__(self):
        self._trimmed = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or not ({"loss", "eval_loss"} & set(logs)):
            return
        path = Path(args.output_dir) / METRICS_FILE
        if not self._trimmed:
            kept = [r for r in read_metrics(path) if r["step"] < state.global_step]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._trimmed = True
        with open(path, "a") as f:
            f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, **logs}) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(records: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # login and compute nodes have no display
    import matplotlib.pyplot as plt

    rows = (len(CURVES) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.3 * rows), sharex=True)
    for ax in axes.flat[len(CURVES) :]:
        ax.set_visible(False)
    for ax, (label, keys) in zip(axes.flat, CURVES, strict=False):
        for key in keys:
            for name in (key, f"eval_{key}"):  # the held-out split's (dataset_test_split), when evaluated
                points = [(r["step"], r[name]) for r in records if name in r]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None, label=name)
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)

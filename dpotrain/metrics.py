"""The run's metrics history (`metrics.jsonl`, one record per logging step) and its training-curve plot."""

import json
from pathlib import Path

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
# What a DPO run is judged by; TRL's names. Rewards are beta x summed log-ratios even with sigmoid_norm (FACTS.md).
CURVES = [
    ("loss", "loss"),
    ("rewards/accuracies", "reward accuracy"),
    ("rewards/margins", "reward margin"),
    ("learning_rate", "learning rate"),
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

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (key, label) in zip(axes.flat, CURVES, strict=False):
        for name in (key, f"eval_{key}"):  # the held-out split's (dataset_test_split), when evaluated
            points = [(r["step"], r[name]) for r in records if name in r]
            if points:
                ax.plot(*zip(*points, strict=False), marker="." if len(points) < 50 else None, label=name)
        if any(f"eval_{key}" in r for r in records):
            ax.legend()
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)

"""The training-curve plot (dpotrain/train/metrics.py) shows what the run measured, with legends beside the data."""

import pytest

from dpotrain.train.metrics import metrics_figure, plot_metrics


def records(steps=6, **extra_keys):
    """Log records shaped like a CPU demo run's: TRL's summed rewards, the loss-scale ones, tokens/s, no MFU."""
    out = []
    for step in range(1, steps + 1):
        r = {
            "step": step,
            "loss": 0.69 / step,
            "learning_rate": 1e-4 * step,
            "rewards/accuracies": 1.0,
            "rewards_norm/accuracies": 1.0,
            "rewards/margins": 40.0 * step,
            "rewards_norm/margins": 0.5 * step,
            "rewards_norm/chosen": 0.2 * step,
            "rewards_norm/rejected": -0.3 * step,
            "tokens_per_second": 300.0,
            "tokens_per_second_per_gpu": 300.0,
        }
        out.append(r | {k: f(step) for k, f in extra_keys.items()})
    return out


def panels(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_a_cpu_run_has_no_mfu_panel_and_the_figure_says_why():
    fig = metrics_figure(records())
    assert list(panels(fig)) == [
        "loss",
        "reward accuracy",
        "reward margin summed over tokens (TRL)",
        "rewards per completion token (the loss's scale)",
        "learning rate",
        "tokens per second",
    ]
    assert all(ax.lines for ax in panels(fig).values())  # no empty panel
    note = fig.get_supxlabel()
    assert "MFU not plotted" in note and "GPU's peak FLOP/s" in note and "gpu_peak_tflops" in note


def test_a_gpu_run_has_its_mfu_panel_and_no_note():
    fig = metrics_figure(records(mfu=lambda s: 0.3))
    assert panels(fig)["MFU"].lines
    assert fig.get_supxlabel() == ""


def test_a_key_group_never_logged_leaves_its_panel_out():
    fig = metrics_figure([{k: v for k, v in r.items() if not k.startswith("rewards_norm/")} for r in records()])
    assert "rewards per completion token (the loss's scale)" not in panels(fig)
    assert [line.get_label() for line in panels(fig)["reward accuracy"].lines] == ["rewards/accuracies"]


def test_summed_and_loss_scale_margins_sit_on_separate_labelled_axes():
    by_title = panels(metrics_figure(records()))
    summed = by_title["reward margin summed over tokens (TRL)"]
    per_token = by_title["rewards per completion token (the loss's scale)"]
    assert [line.get_label() for line in summed.lines] == ["rewards/margins"]
    assert "rewards/margins" not in [line.get_label() for line in per_token.lines]
    assert "summed" in summed.get_ylabel()
    assert "completion tokens" in per_token.get_ylabel()


@pytest.mark.parametrize("extra", [{}, {"eval_loss": lambda s: 0.7 / s, "dpo_loss": lambda s: 0.6 / s}])
def test_legends_lie_outside_every_panels_data_area(extra):
    """Each legend's box, drawn, overlaps no panel: neither its own data nor its neighbour's."""
    fig = metrics_figure(records(**extra))
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    legends = [ax.get_legend() for ax in visible if ax.get_legend()]
    assert len(legends) == (4 if extra else 3)  # every panel with more than one line has one
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in visible:
            assert not box.overlaps(ax.get_window_extent(renderer)), (legend.axes.get_title(), ax.get_title())


def test_a_resume_recorded_in_the_metrics_is_a_dotted_line_in_every_panel_and_named_under_the_figure():
    """metrics.jsonl's first record after a resume holds `resumed_from` (the checkpoint's step, MetricsRecorder)."""
    history = records(steps=8)
    history[5]["resumed_from"] = 5  # stopped after step 5's checkpoint, went on at step 6
    fig = metrics_figure(history)
    for title, ax in panels(fig).items():
        marks = [line for line in ax.lines if line.get_linestyle() == ":"]
        assert [list(line.get_xdata()) for line in marks] == [[5, 5]], title
    assert "Dotted lines: resumed from a checkpoint at step 5." in fig.get_supxlabel()
    assert not [
        line for ax in panels(metrics_figure(records())).values() for line in ax.lines if line.get_linestyle() == ":"
    ]


def test_plot_metrics_writes_a_png(tmp_path):
    path = plot_metrics(records(), tmp_path / "curves.png", title="run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

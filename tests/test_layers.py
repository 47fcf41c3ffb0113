"""The decoder layers as trained (dpotrain/plan/layers.py): the memory plan's checkpointed layers reach the model and
stay
there through TRL's own re-enabling; partial checkpointing trains the same numbers; the throughput clock leaves sample
generation out."""

import time

import pytest
from trl.models.utils import disable_gradient_checkpointing

from conftest import ROOT, built, ready
from dpotrain.data import data
from dpotrain.plan import layers
from dpotrain.recipe.config import parse_args
from dpotrain.train.pair_metrics import PairMetrics
from dpotrain.train.samples import SampleGenerator

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def trained(tmp_path, model_dir, *args):
    """Two steps of the CPU demo with a live reference: TRL runs it under `disable_gradient_checkpointing`, which
    turns checkpointing off and back on at every step."""
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--save_strategy",
            "no",
            "--max_steps",
            "2",
            "--precompute_ref_log_probs",
            "false",
            *args,
        ]
    )
    trainer = ready(built(recipe, data.load_preference_dataset(str(ROOT / recipe.script.dataset_name))))
    trainer.train()
    return trainer


@pytest.mark.slow
def test_partial_checkpointing_holds_and_trains_the_same(tmp_path, tiny_model_dir):
    every_other = trained(
        tmp_path / "a",
        tiny_model_dir,
        "--activation_checkpointing",
        "true",
        "--activation_checkpointing_kwargs",
        '{"every_n_layers": 2}',
    )
    model = every_other.model
    assert layers.checkpointed(model) == [0]  # 1 in 2 of the 2 layers, after TRL re-enabled it at each step
    with disable_gradient_checkpointing(model, every_other.args.gradient_checkpointing_kwargs):
        assert layers.checkpointed(model) == []
    assert layers.checkpointed(model) == [0]  # not every layer, TRL's default
    assert every_other.layers_record == {"checkpointed": [0], "compiled": 0, "decoder_layers": 2}

    plain = trained(tmp_path / "b", tiny_model_dir)
    assert layers.checkpointed(plain.model) == []
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (every_other, plain)]
    assert losses[0] and losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.slow
def test_compile_option_compiles_each_decoder_layer(tmp_path, tiny_model_dir):
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--compile_layers",
            "true",
            "--samples_every",
            "4",
        ]
    )
    trainer = built(recipe, data.load_preference_dataset(str(ROOT / recipe.script.dataset_name))).trainer
    compiled = [layer._compiled_call_impl is not None for layer in layers.decoder_layers(trainer.model)]
    assert compiled == [True, True] and trainer.layers_record["compiled"] == 2
    generator = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SampleGenerator))
    assert generator.spent == trainer.pair_metrics.exclude  # samples' time is taken off the throughput clock


def test_throughput_clock_leaves_out_excluded_time():
    metrics = PairMetrics()
    metrics.start([])
    metrics.sums["train"].update(pairs=1, tokens=1000)
    time.sleep(0.5)
    metrics.exclude(0.45)  # sample generation took most of the interval
    assert metrics.reduce("train", "cpu")["tokens_per_second"] > 1000 / 0.2
    metrics.sums["train"].update(pairs=1, tokens=1000)
    time.sleep(0.2)
    assert metrics.reduce("train", "cpu")["tokens_per_second"] < 1000 / 0.2  # the next interval counts in full


def test_evaluation_time_is_left_out_of_the_throughput_clock(monkeypatch):
    """An evaluation runs after a training log, inside the next interval, which counted it as training time (the CPU
    demo evaluating and saving every 2 steps logged ~2,700 tokens/s at steps 2, 4, 6; 1,319 and 796 at steps 3, 5)."""
    from trl import DPOTrainer

    from dpotrain.train.trainer import RecipeDPOTrainer

    monkeypatch.setattr(DPOTrainer, "evaluate", lambda self, *a, **k: time.sleep(0.45) or {"eval_loss": 0.5})
    trainer = RecipeDPOTrainer.__new__(RecipeDPOTrainer)  # what evaluate reads of a built trainer: its clock
    trainer.pair_metrics = PairMetrics()
    trainer.pair_metrics.start([])
    trainer.pair_metrics.sums["train"].update(pairs=1, tokens=1000)
    assert trainer.evaluate() == {"eval_loss": 0.5}
    time.sleep(0.05)
    assert trainer.pair_metrics.reduce("train", "cpu")["tokens_per_second"] > 1000 / 0.2


@pytest.mark.slow
def test_a_checkpoints_save_time_is_left_out_of_the_throughput_clock(tmp_path, tiny_model_dir, monkeypatch):
    """A save runs after its step's log, inside the next interval, which counted it as training time: a 4 s save (a
    slow shared file system) on the CPU demo logged 241 tokens/s at the step after it, ~3,000 at the others."""
    from dpotrain.train.trainer import RecipeDPOTrainer

    save = RecipeDPOTrainer._save_checkpoint  # every file written for real, then the slow file system's wait
    monkeypatch.setattr(RecipeDPOTrainer, "_save_checkpoint", lambda self, *a: save(self, *a) or time.sleep(1.0))
    excluded, exclude = [], PairMetrics.exclude
    monkeypatch.setattr(
        PairMetrics, "exclude", lambda self, seconds: excluded.append(seconds) or exclude(self, seconds)
    )
    flags = ["--max_steps", "2", "--save_steps", "1", "--logging_steps", "1", "--report_to", "none"]
    recipe = parse_args(
        ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path)] + flags
    )
    ready(built(recipe, data.load_preference_dataset(str(ROOT / recipe.script.dataset_name)))).train()
    assert len(excluded) == 2 and min(excluded) >= 1.0  # checkpoints 1 and 2, each save's whole time

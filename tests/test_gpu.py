"""The recipes' GPU settings (bf16, activation checkpointing), on a GPU: skipped, with the reason, without one."""

import math

import pytest
import torch

from conftest import ROOT, built, ready
from dpotrain.data import data
from dpotrain.recipe.config import parse_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_bf16_and_activation_checkpointing_keep_the_step_one_invariant(tmp_path, tiny_model_dir):
    recipe = parse_args(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--bf16",
            "true",
            "--activation_checkpointing",
            "true",
            "--max_steps",
            "3",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
        ]
    )
    trainer = ready(built(recipe, data.load_preference_dataset(str(ROOT / "data" / "smoke_prefs.jsonl"))))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert abs(losses[0] - math.log(2)) < 1e-3  # bf16 autocast: policy and reference still agree at step 1
    assert losses[-1] < losses[0]

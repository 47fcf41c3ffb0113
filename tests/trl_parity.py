"""This project's training next to plain TRL's `DPOTrainer` fed the same pairs in the same steps (fp32, the smoke
recipe on the built-in tiny OLMo 3), for tests/test_trajectory.py and tests/test_loss_variants.py.

The project's run packs each step's pairs with their prompts shared, cuts the step into micro-batches by a token
budget and scores the reference once before training; plain TRL pads each step's pairs into one batch and keeps the
reference model in memory. Plain TRL gets the data set in the order the project's plan chose, read sequentially, so
both see the same pairs in the same steps, with the same model, schedule and loss.
"""

import json

import datasets
import torch
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler

from conftest import ROOT, built, ready
from dpotrain.recipe.config import parse_args

PAIRS_PER_STEP = 8
ROWS = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()]


def ours(output_dir, model_dir, steps: int, *overrides: str, rows: list[dict] = ROWS):
    """The project's trainer of the smoke recipe for `steps` steps of PAIRS_PER_STEP pairs, after its plan and
    reference stages, on the first pairs of `rows` those steps use (so that the reference stage scores no more), with
    the final assistant turn trained, as plain TRL trains it."""
    recipe = parse_args(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(output_dir),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--max_steps",
            str(steps),
            "--logging_steps",
            "1",
            "--pairs_per_step",
            str(PAIRS_PER_STEP),
            "--assistant_turns",
            "final",
            *overrides,
        ]
    )
    return ready(built(recipe, datasets.Dataset.from_list(rows[: steps * PAIRS_PER_STEP])))


def plan_order(trainer, steps: int) -> list[int]:
    """The rows of the first `steps` steps of a one-process trainer's plan, in its order."""
    planned = trainer.run_plan.epochs[0][:steps]
    order = [i for step in planned for micro_batch in step[0] for i in micro_batch]  # one process: rank 0 holds all
    assert len(order) == steps * PAIRS_PER_STEP == len(set(order))
    return order


def micro_batches_per_step(trainer, steps: int) -> list[int]:
    return [len(step[0]) for step in trainer.run_plan.epochs[0][:steps]]


def plain_trl(model_dir, rows: list[dict], output_dir, steps: int, **config):
    """TRL's own `DPOTrainer`, reading its data set in order: the smoke recipe's values (configs/smoke.yaml), one
    padded batch of PAIRS_PER_STEP pairs per step, a live reference model; `config` overrides DPOConfig fields."""
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset or self.train_dataset)

    values = dict(
        output_dir=str(output_dir),
        loss_type=["sigmoid_norm"],
        beta=5.0,
        learning_rate=1e-4,
        lr_scheduler_type="linear",
        warmup_steps=0.1,
        max_steps=steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=PAIRS_PER_STEP,
        gradient_accumulation_steps=1,
        max_length=1024,
        seed=42,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        dataloader_num_workers=0,
        padding_free=False,
        precompute_ref_log_probs=False,
    )
    return InOrder(
        model=model_dir, args=DPOConfig(**{**values, **config}), train_dataset=datasets.Dataset.from_list(rows)
    )


def step_losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]


def largest_relative_difference(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True))


def weight_differences(weights: dict, other, model_dir) -> dict[str, tuple[float, float]]:
    """Per parameter of the model `other`: (largest difference from `weights`, by name, how far `other` moved from
    the start)."""
    start = load_file(f"{model_dir}/model.safetensors")
    with torch.no_grad():
        return {
            name: (float((weights[name] - w).abs().max()), float((w - start[name]).abs().max()))
            for name, w in other.named_parameters()
        }


def relative_weight_distances(weights: dict, other, model_dir) -> dict[str, float]:
    """Per parameter of the model `other`: the norm of its difference from `weights` over the norm of how far `other`
    moved from the start. A norm, not the largest entry: Adam moves an entry whose gradient is near zero by up to the
    learning rate either way, so fp32 rounding can flip single entries of an otherwise equal update."""
    start = load_file(f"{model_dir}/model.safetensors")
    with torch.no_grad():
        return {
            name: float((weights[name] - w).norm() / (w - start[name]).norm()) for name, w in other.named_parameters()
        }

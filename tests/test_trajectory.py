"""40 optimizer steps of this project's path equal plain TRL's `DPOTrainer` fed the same pairs in each step (fp32).

The project's run packs each step's pairs with their prompts shared, cuts the step into micro-batches by a token
budget and scores the reference once before training; plain TRL pads each step's 8 pairs into one batch and keeps the
reference model in memory. Plain TRL gets the data set in the order the project's plan chose, read sequentially, so
both see the same pairs in the same steps, with the same model, schedule and loss.
"""

import json

import datasets
import pytest
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler

from conftest import ROOT, ready
from dpotrain.config import parse_args
from dpotrain.trainer import build_trainer

STEPS, PAIRS_PER_STEP = 40, 8


class PlainTRL:
    """TRL's own `DPOTrainer`, reading its data set in order (the project's plan order, set by the caller)."""

    @staticmethod
    def build(model_dir, rows, output_dir):
        from trl import DPOConfig, DPOTrainer

        class InOrder(DPOTrainer):
            def _get_train_sampler(self, train_dataset=None):
                return SequentialSampler(train_dataset or self.train_dataset)

        # The smoke recipe's values (configs/smoke.yaml), one padded batch of 8 pairs per step, a live reference model.
        args = DPOConfig(output_dir=str(output_dir), loss_type=["sigmoid_norm"], beta=5.0, learning_rate=1e-4,
                         lr_scheduler_type="linear", warmup_steps=0.1, max_steps=STEPS, weight_decay=0.0,
                         max_grad_norm=0.0, per_device_train_batch_size=PAIRS_PER_STEP, gradient_accumulation_steps=1,
                         max_length=1024, seed=42, logging_steps=1, report_to="none", save_strategy="no",
                         bf16=False, dataloader_num_workers=0, padding_free=False,
                         precompute_ref_log_probs=False)  # fmt: skip
        return InOrder(model=model_dir, args=args, train_dataset=datasets.Dataset.from_list(rows))


def step_losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]


@pytest.mark.slow
def test_forty_steps_equal_plain_trl_fed_the_same_pairs(tmp_path, tiny_model_dir):
    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()]
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", tiny_model_dir,
                         "--output_dir", str(tmp_path / "ours"), "--report_to", "none", "--save_strategy", "no",
                         "--max_steps", str(STEPS), "--logging_steps", "1", "--pairs_per_step", str(PAIRS_PER_STEP),
                         "--max_tokens_per_microbatch", "2048"])  # fmt: skip
    ours = ready(build_trainer(recipe, datasets.Dataset.from_list(rows)))
    assert ours.forward.packed and ours.forward.share_prompt  # the project's default path on this model
    steps = ours.run_plan.epochs[0][:STEPS]
    assert max(len(step[0]) for step in steps) > 1  # some steps are cut into several micro-batches
    ours.train()

    order = [i for step in steps for micro_batch in step[0] for i in micro_batch]  # one process: rank 0 holds all
    assert len(order) == STEPS * PAIRS_PER_STEP == len(set(order))
    plain = PlainTRL.build(tiny_model_dir, [rows[i] for i in order], tmp_path / "plain")
    plain.train()

    got, want = step_losses(ours), step_losses(plain)
    assert len(got) == len(want) == STEPS
    assert max(want) - min(want) > 0.05  # the loss moved: steps are told apart
    relative = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]
    assert max(relative) <= 2e-6, max(relative)
    # Adam divides each gradient by its own running scale, so an entry whose gradient is near zero (embedding rows of
    # tokens a step barely touches) turns fp32 rounding into a visible share of its update: the final weights agree
    # to 0.1% of how far training moved them (measured: 3e-4 for the embedding, 1e-5 elsewhere).
    start = load_file(f"{tiny_model_dir}/model.safetensors")
    ours_weights = dict(ours.model.named_parameters())
    for name, w in plain.model.named_parameters():
        moved = (w - start[name]).abs().max()
        assert moved > 1e-3, name
        assert (ours_weights[name] - w).abs().max() <= 1e-3 * moved, name

"""The packed forward is the padded forward without the padding: same log-probs, loss and gradients (fp32).

Each comparison builds two real trainers on the same pairs: TRL's padded path with the reference model in memory
(`padding_free: false`, `precompute_ref_log_probs: false`), and this project's packed path with the cached
reference. The policy is then moved away from the reference (the same noise in both), so the loss depends on both.
The layouts themselves are proven on literal tensors (tests/test_literal_tensors.py); models whose layers carry state
along a packed row take the padded path (tests/test_architectures.py: the olmo_hybrid family, the parity check).
"""

import pytest
import torch
from test_shared_prompt import trainer_for  # one recipe for the two forward comparisons

from conftest import ROOT
from dpotrain.data import builtin
from dpotrain.forwards import packing

SMOKE = str(ROOT / "configs" / "smoke.yaml")


@pytest.fixture(scope="module")
def rows():
    # Pairs of very different lengths (the longest over the tiny OLMo 3's 128-token sliding window) in one batch.
    all_rows = builtin.make_preference_rows(64, seed=0)
    return sorted(all_rows, key=lambda r: len(r["chosen"][-1]["content"]) + len(r["rejected"][-1]["content"]))[-6:]


def perturb(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)


def loss_and_grads(trainer, indices):
    trainer.model.train()
    trainer.model.zero_grad()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in indices])
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["olmo3", "llama"])
def test_packed_equals_padded(tmp_path, tiny_model_dir, llama_dir, rows, model):
    """The recipe's loss. Other losses read the same per-token log-probs in the same padded view (its layout:
    tests/test_literal_tensors.py), and each is held to plain TRL's padded training in tests/test_loss_variants.py."""
    model_dir = tiny_model_dir if model == "olmo3" else llama_dir
    padded = trainer_for(
        tmp_path / "padded", model_dir, rows, "--padding_free", "false", "--precompute_ref_log_probs", "false"
    )
    packed = trainer_for(tmp_path / "packed", model_dir, rows)
    assert padded.ref_model is not None and packed.ref_model is None  # the packed path keeps one model in memory
    assert packed.packed and not padded.packed
    perturb(padded.model)
    perturb(packed.model)

    indices = list(range(len(rows)))
    padded_batch = padded.data_collator([padded.train_dataset[i] for i in indices])
    packed_batch = packed.data_collator([packed.train_dataset[i] for i in indices])
    # These six longest pairs fill rows badly (sequences near max_length): still fewer positions than TRL's batch.
    assert packed_batch["input_ids"].numel() < 0.9 * padded_batch["input_ids"].numel()

    with torch.no_grad():
        # Per-token log-probs of the completions, laid out as TRL's [2B, L-1]
        want = padded.model(
            input_ids=padded_batch["input_ids"],
            attention_mask=padded_batch["attention_mask"],
            labels=padded_batch["input_ids"].masked_fill(padded_batch["completion_mask"] == 0, -100),
            fused_lm_head=True,
            use_cache=False,
        ).log_probs
        got = packing.unpack_outputs(packing.forward(packed.model, packed_batch), packed_batch).log_probs
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-5
    # All sequences in a single row (how FlashAttention's varlen kernel gets them) gives the same.
    one_row = packing.PackedPreferenceCollator(packed.args.max_length, one_row=True)(
        [packed.train_dataset[i] for i in indices]
    )
    assert one_row["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in one_row
    with torch.no_grad():
        got_one_row = packing.unpack_outputs(packing.forward(packed.model, one_row), one_row).log_probs
    assert (got_one_row - want).abs().max() < 1e-5
    # ...and their sums, the sequence log-probs DPO works with: equal to fp32's resolution at their size (a sum of
    # -3,000 has a spacing of 2.4e-4 between neighbouring floats).
    assert ((got.sum(1) - want.sum(1)).abs() / want.sum(1).abs()).max() < 1e-6

    loss_padded, grads_padded = loss_and_grads(padded, indices)
    loss_packed, grads_packed = loss_and_grads(packed, indices)
    assert abs(loss_packed - loss_padded) < 1e-5, (loss_packed, loss_padded)
    for name, g in grads_padded.items():
        assert (grads_packed[name] - g).abs().max() <= 1e-5 + 1e-4 * g.abs().max(), name


def test_a_one_row_batch_padded_to_a_groups_multiple_bounds_its_padding_as_a_segment():
    """A one-row micro-batch padded to a multiple of a sequence-parallel group (3 here): the padding is a segment of
    its own in every boundary a varlen kernel or a hybrid's layers read, as in the position ids; a varlen kernel writes
    only the positions its segments cover (the rest would be uninitialized memory, NaN x 0 in the backward)."""
    pairs = [
        {"prompt_ids": [5] * p, "chosen_ids": [6] * c, "rejected_ids": [7] * r} for p, c, r in ((2, 3, 1), (1, 2, 2))
    ]
    batch = packing.PackedPreferenceCollator(64, one_row=True, pad_to_multiple_of=3)(pairs)
    lengths = [5, 3, 3, 3]  # chosen 0, 1, then rejected 0, 1: 14 positions, padded to 15
    assert batch["input_ids"].shape == (1, 15)
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 5, 8, 11, 14, 15]
    assert batch["max_length_q"] == batch["max_length_k"] == max(lengths)
    assert batch["seq_idx"].tolist() == [[0] * 5 + [1] * 3 + [2] * 3 + [3] * 3 + [4]]
    assert batch["position_ids"][0, 14] == 0  # the position ids began the padding's segment already
    assert batch["seq_lens"].tolist() == lengths  # the sequences themselves do not change
    # Padding longer than every sequence is the longest segment
    wide = packing.PackedPreferenceCollator(64, one_row=True, pad_to_multiple_of=32)(pairs)
    assert wide["cu_seq_lens_q"].tolist()[-2:] == [14, 32] and wide["max_length_q"] == wide["max_length_k"] == 18
    # Without padding, the segments are the sequences'
    exact = packing.PackedPreferenceCollator(64, one_row=True, pad_to_multiple_of=2)(pairs)
    assert exact["cu_seq_lens_q"].tolist() == [0, 5, 8, 11, 14] and exact["seq_idx"].shape == (1, 14)

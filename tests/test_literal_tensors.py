"""The math of the forwards and of the step plan on two tiny pairs, each expected tensor written out by hand, as TRL
tests its preference collator (tests/test_dpo_trainer.py): the packed rows and their layout index, the padded view
TRL's `_compute_loss` reads (equal to TRL's own collator's batch), the labels, the masks, the padded row groups, the
pair lengths the plan cuts by, the cut of a step, and the SFT term's share of a step. No model, no trainer: these
prove the layouts exactly, so the whole-trainer tests only need to show that the pieces are wired together.

The pairs, and the four sequences of a micro-batch in TRL's order (chosen 0, chosen 1, rejected 0, rejected 1):

    A: prompt [1, 2], chosen [3, 4, 5], rejected [6]      s0 = [1, 2, 3, 4, 5]   s2 = [1, 2, 6]
    B: prompt [7],    chosen [8],       rejected [9, 10]  s1 = [7, 8]            s3 = [7, 9, 10]
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from trl import DPOConfig
from trl.trainer.dpo_trainer import DataCollatorForPreference

from dpotrain.data import cuts
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import masks, packing, padded
from dpotrain.forwards.shared_prompt import SharedPromptCollator
from dpotrain.plan import plan
from dpotrain.plan.plan import StepPlan
from dpotrain.recipe.errors import ConfigError
from dpotrain.train import losses, trainer

A = {"prompt_ids": [1, 2], "chosen_ids": [3, 4, 5], "rejected_ids": [6]}
B = {"prompt_ids": [7], "chosen_ids": [8], "rejected_ids": [9, 10]}
PAIRS = [A, B]

# TRL's padded [2B, L] batch of A and B (right padding with 0): what the padded view of every layout must be
PADDED = {
    "input_ids": [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0], [1, 2, 6, 0, 0], [7, 9, 10, 0, 0]],
    "attention_mask": [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]],
    "completion_mask": [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0]],
}


def as_lists(batch: dict) -> dict:
    return {k: v.tolist() if torch.is_tensor(v) else v for k, v in batch.items()}


def per_token(log_probs: torch.Tensor):
    """Per-token outputs as a fused LM head returns them: only log-probs here, the other fields absent."""
    return SimpleNamespace(
        loss=None, aux_loss=None, **(dict.fromkeys(packing.PER_TOKEN_FIELDS) | {"log_probs": log_probs})
    )


# --- packed rows: the collator, the labels, the layout index and the padded view ------------------------------------


def test_packed_rows_of_two_pairs():
    """Lengths [5, 2, 3, 3] fill two rows of 7 (s0 s1 | s2 s3 and one pad): at a hidden size of 4096 two rows of 7
    cost less than three of 5; each sequence's positions restart at 0, and so does the padding at a row's end."""
    batch = packing.PackedPreferenceCollator()(PAIRS)
    assert as_lists(batch) == {
        "input_ids": [[1, 2, 3, 4, 5, 7, 8], [1, 2, 6, 7, 9, 10, 0]],
        "position_ids": [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 0, 1, 2, 0]],
        "completion_mask": [[0, 0, 1, 1, 1, 0, 1], [0, 0, 1, 0, 1, 1, 0]],
        "seq_lens": [5, 2, 3, 3],
        "seq_rows": [0, 0, 1, 1],
        "seq_starts": [0, 5, 0, 3],
    }
    # The labels TRL's fused head shifts along a row: completion tokens, never a sequence's first position (else the
    # last token of s0 would be scored as predicting the first of s1)
    assert packing.packed_labels(batch).tolist() == [
        [-100, -100, 3, 4, 5, -100, 8],
        [-100, -100, 6, -100, 9, 10, -100],
    ]
    # Every position but the row's end padding is held by exactly one sequence of the padded layout
    assert packing.token_weights(batch).tolist() == [[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]]
    assert trainer.pairs_in(batch) == 2 and trainer.computed_tokens(batch) == 13
    assert trainer.shared_prefixes(batch) is None


def test_one_row_for_a_varlen_kernel():
    batch = packing.PackedPreferenceCollator(one_row=True)(PAIRS)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 8, 1, 2, 6, 7, 9, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 0, 1, 2]]
    assert batch["seq_starts"].tolist() == [0, 5, 7, 10] and batch["seq_rows"].tolist() == [0, 0, 0, 0]
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 7, 10, 13] and batch["max_length_q"] == 5
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]]
    assert as_lists(packing.padded_view(batch)) == PADDED


def test_the_layout_index_reads_each_sequence_from_its_row():
    """Entries of the flattened `[2, 7]` rows: s0 at 0..4, s1 at 5..6, s2 at 7..9, s3 at 10..12; the rest of each
    padded row points at 0 and is invalid."""
    index, valid = packing.layout_index(torch.tensor([0, 5, 7, 10]), torch.tensor([5, 2, 3, 3]), 5)
    assert index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 0, 0, 0], [7, 8, 9, 0, 0], [10, 11, 12, 0, 0]]
    assert valid.long().tolist() == PADDED["attention_mask"]
    # From entry `jump` on, a row skips `offset` entries (a rejected sequence past its pair's chosen completion)
    index, valid = packing.layout_index(
        torch.tensor([0, 7]), torch.tensor([3, 3]), 4, jumps=torch.tensor([2, 1]), offsets=torch.tensor([4, 2])
    )
    assert index.tolist() == [[0, 1, 6, 0], [7, 10, 11, 0]] and valid.long().tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]


def test_the_padded_view_is_trls_own_batch():
    batch = packing.PackedPreferenceCollator()(PAIRS)
    assert as_lists(packing.padded_view(batch)) == PADDED
    assert as_lists(DataCollatorForPreference(pad_token_id=0)(PAIRS)) == PADDED  # what TRL's own collator makes
    with_ref = [
        {**A, "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0},
        {**B, "ref_chosen_logps": -0.5, "ref_rejected_logps": -3.0},
    ]
    view = packing.padded_view(packing.PackedPreferenceCollator()(with_ref))
    assert view["ref_chosen_logps"].tolist() == [-1.5, -0.5] and view["ref_rejected_logps"].tolist() == [-2.0, -3.0]


@pytest.mark.parametrize(
    "mode, s0, s0_mask",
    [("keep_start", [1, 2, 3, 4], [0, 0, 1, 1]), ("keep_end", [2, 3, 4, 5], [0, 1, 1, 1])],
)
def test_truncation_at_max_length_is_trls(mode, s0, s0_mask):
    """max_length 4 cuts only s0 (5 tokens): its end with keep_start, its start with keep_end."""
    want = {
        "input_ids": [s0, [7, 8, 0, 0], [1, 2, 6, 0], [7, 9, 10, 0]],
        "attention_mask": [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]],
        "completion_mask": [s0_mask, [0, 1, 0, 0], [0, 0, 1, 0], [0, 1, 1, 0]],
    }
    assert as_lists(packing.padded_view(packing.PackedPreferenceCollator(4, mode)(PAIRS))) == want
    assert as_lists(packing.padded_view(SharedPromptCollator(4, mode)(PAIRS))) == want
    assert as_lists(DataCollatorForPreference(pad_token_id=0, max_length=4, truncation_mode=mode)(PAIRS)) == want


def test_per_token_outputs_are_laid_out_as_trls_predictions():
    """Output column c of a row predicts the row's token c + 1: s0's predictions are columns 0..3 of row 0, s1's
    column 5 (column 4 predicts s1's first token from s0's last: never read), s2's columns 0..1 of row 1, s3's 3..4."""
    batch = packing.PackedPreferenceCollator()(PAIRS)
    log_probs = -torch.arange(1.0, 13.0).view(2, 6)  # row 0: -1 .. -6, row 1: -7 .. -12
    got = packing.unpack_outputs(per_token(log_probs), batch)
    assert got.log_probs.tolist() == [[-1, -2, -3, -4], [-6, 0, 0, 0], [-7, -8, 0, 0], [-10, -11, 0, 0]]
    assert got.entropy is None


# --- shared prompts: one unit per pair, the rejected side's jump, the mask ------------------------------------------

SHARED = {
    # A: prompt[0] | prompt[1] chosen | prompt[1] rejected
    # B (a one-token prompt): prompt[0] chosen | prompt[0] rejected
    "input_ids": [[1, 2, 3, 4, 5, 2, 6, 7, 8, 7, 9, 10]],
    "position_ids": [[0, 1, 2, 3, 4, 1, 2, 0, 1, 0, 1, 2]],
    "completion_mask": [[0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 1, 1]],
    "attention_block": [[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]],
    "attention_branch": [[0, 1, 1, 1, 1, 2, 2, 1, 1, 2, 2, 2]],
    "seq_lens": [5, 2, 3, 3],
    "seq_rows": [0, 0, 0, 0],
    "seq_starts": [0, 7, 0, 7],
    # s2 (A rejected) continues at its token 2 four columns on (past [3, 4, 5] and the copy of 2); s3 at its token 1
    "seq_jumps": [5, 2, 2, 1],
    "seq_offsets": [0, 0, 4, 2],
}


def test_shared_prompt_units_of_two_pairs():
    """P + C + R + 1 positions a pair (7 and 5): one row of 12 costs less than two of 7."""
    batch = SharedPromptCollator()(PAIRS)
    assert as_lists(batch) == SHARED
    assert as_lists(packing.padded_view(batch)) == PADDED
    assert packing.packed_labels(batch).tolist() == [[-100, -100, 3, 4, 5, -100, 6, -100, 8, -100, 9, 10]]
    # A's prompt token 1 is read by both of A's sequences; the copy of the last prompt token only by the rejected one
    # (as its own, in place of the original)
    assert packing.token_weights(batch).tolist() == [[2, 2, 1, 1, 1, 0, 1, 2, 1, 0, 1, 1]]
    assert trainer.shared_prefixes(batch).tolist() == [1, 0]  # prompt tokens computed once instead of twice
    assert trainer.pairs_in(batch) == 2 and trainer.computed_tokens(batch) == 12


def test_shared_prompt_predictions_are_laid_out_as_trls():
    """s2 predicts its token 1 from column 0 and its token 2 (the 6) from the copy of the prompt's last token (column
    5); s3 predicts from its copy of the 7 (column 9) on."""
    batch = SharedPromptCollator()(PAIRS)
    got = packing.unpack_outputs(per_token(-torch.arange(1.0, 12.0).view(1, 11)), batch)
    assert got.log_probs.tolist() == [[-1, -2, -3, -4], [-8, 0, 0, 0], [-1, -6, 0, 0], [-10, -11, 0, 0]]


def test_a_pair_keep_end_cuts_into_is_laid_out_unshared_in_the_same_rows():
    """max_length 4, keep_end: A's chosen side loses its first token, so A is two sequences; B stays one unit."""
    batch = SharedPromptCollator(4, "keep_end")(PAIRS)
    assert batch["input_ids"].tolist() == [[7, 8, 7, 9, 10, 0, 0], [2, 3, 4, 5, 1, 2, 6]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2]]
    assert batch["attention_block"].tolist() == [[3, 3, 3, 3, 3, 0, 0], [1, 1, 1, 1, 2, 2, 2]]
    assert batch["seq_offsets"].tolist() == [0, 0, 0, 2]


# q (row) attends k (column): the same pair, k's position not after q's, k in the prompt or in q's branch
SHARED_MASK = [
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # the copy of 2 sees the prompt's 1 and itself, as s2's token 1 does
    [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0],  # the 6: never the chosen [2, 3, 4, 5]
    [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],  # B's copy of 7 (its prompt is one token): only itself
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
]
# A sliding window of 2 positions: a query no longer sees keys 2 or more positions back
SHARED_MASK_WINDOW_2 = [
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
]


@pytest.mark.parametrize("window, want", [(None, SHARED_MASK), (2, SHARED_MASK_WINDOW_2)], ids=["full", "window-2"])
def test_the_dense_mask_of_shared_prompts(window, want):
    block, branch, pos = masks.compact(SharedPromptCollator()(PAIRS))
    mask = masks.dense_mask(block, branch, pos, window)
    assert mask.shape == (1, 1, 12, 12) and mask.dtype == torch.bool
    assert mask[0, 0].long().tolist() == want


def test_the_dense_mask_of_unshared_rows_is_causal_per_sequence():
    """Units are found where the position ids restart at 0; the row's end padding is a unit of its own."""
    batch = packing.PackedPreferenceCollator()(PAIRS)
    block, branch, pos = masks.compact(batch)
    assert block.tolist() == [[1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 2, 2, 2, 3]] and not branch.any()
    row_1 = masks.dense_mask(block, branch, pos, None)[1, 0].long().tolist()
    assert row_1 == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]


# --- rows and groups: how a micro-batch's sequences are laid out ----------------------------------------------------


def test_rows_weigh_attention_against_the_linear_layers():
    lengths = [5, 2, 3, 3]
    assert packing.fill_rows(lengths, 4096) == [[0, 1], [2, 3]]  # 2 x 7 positions: linear layers dominate
    # With a hidden size of 1 attention dominates (a row of W costs W x (1 + W / 8)): 3 rows of 5 cost 24.4, 2 of 7 26.3
    assert packing.fill_rows(lengths, 1) == [[0], [2, 1], [3]]
    assert packing.fill_rows(lengths, 4096, max_width=6) == [[0], [2, 1], [3]]  # the memory plan's bound
    with pytest.raises(ValueError, match="a sequence of 5 positions is wider than the rows' bound 4"):
        packing.fill_rows(lengths, 4096, max_width=4)


def test_rows_keep_within_the_positions_the_memory_plan_holds():
    """Rows are padded to one width: by cost alone, 3 rows of 5 take 15 positions for 13 tokens. Capped at 14 (the
    budget a bf16 run's memory plan plans for), 2 rows of 7; capped at 13, where no count fits, the fewest positions
    (one row, within max_width); an fp32 run (the CPU demo, memory not planned) is not capped."""
    lengths = [5, 2, 3, 3]
    assert packing.fill_rows(lengths, 1, max_positions=14) == [[0, 1], [2, 3]]
    assert packing.fill_rows(lengths, 1, max_positions=13) == [[0, 2, 3, 1]]
    assert packing.fill_rows(lengths, 1, max_width=7, max_positions=13) == [[0, 1], [2, 3]]
    assert packing.positions_cap(2048, half_precision=True) == 2048
    assert packing.positions_cap(2048, half_precision=False) is None


def test_a_step_whose_rows_cannot_keep_within_the_budget_takes_one_more_micro_batch():
    """Two pairs of 3 + 3 tokens and one of 4 + 1 (17 tokens), budget 17: one micro-batch by tokens. Its rows, at most
    2 x max_length (6) wide, take 3 x 6 = 18 positions: the plan cuts the step in two where the rows are capped, and in
    one where they are not (fp32: nothing is planned to hold them)."""
    lengths = PairLengths.from_parts(np.zeros(3, int), np.array([3, 3, 4]), np.array([3, 3, 1]), 3)
    capped = plan.RowLayout.of(True, False, 1, None, 3, 17)
    assert capped.positions(lengths, [0, 1, 2]) == 18
    for layout, want in ((capped, 2), (plan.RowLayout.of(True, False, 1, None, 3, None), 1)):
        step = plan.cut_step(np.arange(3), lengths, StepPlan(3, 1, 0, 17, None, False, layout))
        assert len(step[0]) == want
        assert all(layout.positions(lengths, mb) <= 17 for mb in step[0]) or layout.max_positions is None


def test_padded_row_groups_pad_least():
    """Sorted longest first (5, 3, 3, 2): one group pads to 4 x 5 = 20 positions, [5] [3 3] [2] to 13, as few as four
    groups, so three groups are run; told to run two, [5] [3 3 2] (14) is the best."""
    assert padded.row_groups([5, 2, 3, 3]) == [[0], [2, 3], [1]]
    assert padded.positions([5, 2, 3, 3]) == 13
    assert padded.row_groups([5, 2, 3, 3], count=2) == [[0], [2, 3, 1]]
    assert padded.row_groups([4, 4, 4]) == [[0, 1, 2]]  # nothing to save: one forward


def test_the_grouped_forward_lays_each_groups_outputs_into_trls_layout():
    """Each group runs on its own rows cut to its longest sequence; a stand-in for the fused head returns each row's
    tokens 1.. as its per-token output, so the laid-out result is TRL's shifted input ids, zero past each row's end."""
    calls = []

    def model(input_ids, attention_mask, fused_lm_head):  # what TRL passes: the rows and their attention mask
        calls.append(input_ids.tolist())
        return per_token(input_ids[:, 1:].float() * attention_mask[:, 1:])

    inputs = {k: torch.tensor(PADDED[k]) for k in ("input_ids", "attention_mask")}
    grouped = padded.GroupedModel(model, padded.row_groups([5, 2, 3, 3]))
    out = grouped(fused_lm_head=True, **inputs)
    assert calls == [[[1, 2, 3, 4, 5]], [[1, 2, 6], [7, 9, 10]], [[7, 8]]]
    assert out.log_probs.tolist() == [[2, 3, 4, 5], [8, 0, 0, 0], [2, 6, 0, 0], [9, 10, 0, 0]]
    assert grouped.positions == 13


# --- what the plan knows of each pair, and what a forward costs -----------------------------------------------------


def test_pair_lengths_are_the_collators_lengths():
    prompt, chosen, rejected = np.array([2, 1]), np.array([3, 1]), np.array([1, 2])  # A and B
    lengths = PairLengths.from_parts(prompt, chosen, rejected, None)
    assert (lengths.chosen.tolist(), lengths.rejected.tolist()) == ([5, 2], [3, 3])
    assert lengths.tokens.tolist() == [8, 5] and lengths.longest.tolist() == [5, 3]
    # Shared, a pair is one unit of P + C + R + 1 positions: the collator's 7 and 5
    assert PairLengths.from_parts(prompt, chosen, rejected, None, share=True).tokens.tolist() == [7, 5]
    cut = PairLengths.from_parts(prompt, chosen, rejected, 4, share=True)  # keep_start: A's chosen [1, 2, 3, 4]
    assert (cut.chosen.tolist(), cut.tokens.tolist()) == ([4, 2], [6, 5])
    keep_end = PairLengths.from_parts(prompt, chosen, rejected, 4, share=True, truncation_mode="keep_end")
    assert keep_end.shared.tolist() == [False, True] and keep_end.tokens.tolist() == [7, 5]  # A laid out unshared


@pytest.mark.parametrize(
    "kind, multiple, share, want",
    [
        ("rows", None, False, 14),  # two rows of 7
        ("one_row", None, False, 13),
        ("one_row", 4, False, 16),
        ("padded", None, False, 13),  # groups [5] [3 3] [2]
        ("rows", None, True, 12),  # one row of the two units
    ],
)
def test_the_plans_positions_are_what_the_collators_lay_out(kind, multiple, share, want):
    lengths = PairLengths.from_parts(np.array([2, 1]), np.array([3, 1]), np.array([1, 2]), None, share=share)
    assert plan.RowLayout(kind, multiple=multiple).positions(lengths, [0, 1]) == want
    if kind == "rows":
        collate = SharedPromptCollator() if share else packing.PackedPreferenceCollator()
        assert collate(PAIRS)["input_ids"].numel() == want


def test_a_pair_laid_out_unshared_is_two_units_to_the_plan_and_to_the_forwards_cost():
    """max_length 4, keep_end: A is laid out as its two cut sequences, B as one unit (the collator's two rows of 7).
    The forward's cost (cost.training_flops) packs the same units: it counted A as one unit of 7, so one row of 12."""
    lengths = PairLengths.from_parts(np.array([2, 1]), np.array([3, 1]), np.array([1, 2]), 4, True, "keep_end")
    assert lengths.units([0, 1]) == [5, 4, 3] and lengths.sequences([0, 1]) == [4, 2, 3, 3]
    assert packing.fill_rows(lengths.units([0, 1]), hidden_size=64) == [[0], [1, 2]]
    collated = SharedPromptCollator(4, "keep_end")(PAIRS)["input_ids"]
    assert plan.RowLayout("rows").positions(lengths, [0, 1]) == collated.numel() == 14


def test_cut_and_dropped_pairs_are_counted_as_trl_cuts_and_drops_them():
    prompt, chosen, rejected = [2, 1, 4], [3, 1, 1], [1, 2, 1]  # A, B, and a pair whose prompt fills max_length 4
    keep_start = cuts.count(prompt, chosen, rejected, 4)
    assert keep_start == {"max_length": 4, "truncation_mode": "keep_start", "pairs": 3, "truncated": 1, "dropped": 1}
    assert cuts.line(keep_start) == (
        "max_length 4: 1 of 3 pairs cut (keep_start: their end), 1 dropped (prompt alone fills max_length)"
    )
    assert cuts.count(prompt, chosen, rejected, 4, "keep_end") == {
        "max_length": 4,
        "truncation_mode": "keep_end",
        "pairs": 3,
        "truncated": 2,
        "dropped": 0,
    }
    assert cuts.count(prompt, chosen, rejected, 4, dropped_before=2)["pairs"] == 5
    assert cuts.count(prompt, chosen, rejected, None)["truncated"] == 0
    nothing = r"^max_length 1 leaves 0 of 3 pairs \(0\.0%\) anything to learn \(the data\): 3 dropped"
    with pytest.raises(ConfigError, match=nothing):
        cuts.check(prompt, chosen, rejected, None, 1, "keep_start", "the data")
    # A's completions share their first token (3 vs 1: none; here 1): cut at 3, A's sides are the same tokens
    shared = [[1, 0], [0, 0], [0, 0]]  # per pair: tokens both completions start with, both sequences end with
    with pytest.raises(ConfigError, match=r"leaves 1 of 3 pairs .*1 dropped .*, 1 cut until chosen and rejected"):
        cuts.check(prompt, chosen, rejected, shared, 3, "keep_start", "the data")
    cuts.check(prompt, chosen, rejected, shared, 3, "keep_end", "the data")  # keep_end keeps each side's end


def test_keep_end_counts_the_pairs_it_cuts_until_both_sides_end_the_same():
    """keep_end keeps each sequence's last max_length tokens: where both sequences end with that many tokens alike
    (answers that differ only early, or a max_length within the template's closing tokens), chosen and rejected are
    the same tokens, a pair at ln 2 with no gradient. Counted and refused as keep_start's shared starts are: the run
    trained every pair at ln 2 with a gradient norm of 0 and exited 0."""
    prompt, chosen, rejected = np.array([2, 2, 2]), np.array([6, 6, 6]), np.array([5, 6, 7])
    shared = [[0, 4], [0, 2], [0, 4]]  # all three sequences end with 2 tokens alike, two of them with 4
    assert cuts.teaching(prompt, shared, 2, "keep_end") == (0, 0, 3)
    assert cuts.teaching(prompt, shared, 3, "keep_end") == (1, 0, 2)
    assert cuts.teaching(prompt, shared, 5, "keep_end") == (3, 0, 0)
    assert cuts.teaching(prompt, shared, 2, "keep_start")[2] == 0  # their starts differ
    with pytest.raises(ConfigError, match=r"leaves 1 of 3 pairs .*0 dropped .*, 2 cut until chosen and rejected"):
        cuts.check(prompt, chosen, rejected, shared, 3, "keep_end", "the data")


# --- the step plan --------------------------------------------------------------------------------------------------

# Six pairs: chosen and rejected lengths, so packed costs (tokens) [8, 4, 12, 6, 5, 12] and padded widths (longest)
# [5, 2, 8, 3, 4, 6]
SIX = PairLengths(np.array([5, 2, 8, 3, 4, 6]), np.array([3, 2, 4, 3, 1, 6]))


def test_an_epoch_is_cut_into_steps_and_a_short_last_step_joins_the_one_before():
    order = np.arange(10)
    assert [s.tolist() for s in plan.steps_of(order, 4, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [s.tolist() for s in plan.steps_of(order, 4, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert plan.epochs_needed(5, 1.0, 10, 4, 3) == 3  # 2 steps an epoch: step 5 is in the third
    assert plan.epochs_needed(0, 2.5, 10, 4, 3) == 3


def test_a_packed_step_in_balanced_micro_batches_the_same_count_on_each_rank():
    """Budget 16 on 2 ranks: the two 12s need a micro-batch each and 8, 6, 5 do not fit in one, so no fewer than 4
    micro-batches (the lower bound); longest first into the least loaded of 4 gives loads 12, 12, 12, 11, dealt
    heaviest first so that micro-batch j weighs about the same on both ranks."""
    assert plan.fewest_bins(SIX.tokens, 16) == 4
    step = plan.cut_step(np.arange(6), SIX, StepPlan(6, 2, 0, 16, None))
    assert step == [[[0, 1], [5]], [[2], [3, 4]]]
    assert [[SIX.tokens[mb].sum() for mb in rank] for rank in step] == [[12, 12], [12, 11]]


def test_a_padded_step_in_runs_of_similar_length():
    """Padded, a micro-batch costs 2 x pairs x its longest side: sorted by longest (8, 6, 5, 4, 3, 2), runs of at most
    20 positions: [8] [6] [5 4] [3 2]."""
    step = plan.cut_step(np.arange(6), SIX, StepPlan(6, 2, 0, 24, None, padded=True))
    assert step == [[[0, 4], [5]], [[2], [3, 1]]]
    p = StepPlan(6, 2, 0, 24, None, padded=True)
    assert [[p.cost(SIX, mb) for mb in rank] for rank in step] == [[20, 12], [16, 12]]


def test_a_step_without_a_budget_in_micro_batches_of_a_fixed_number_of_pairs():
    assert plan.cut_step(np.arange(6), SIX, StepPlan(6, 2, 0, None, 2)) == [[[0, 2], [4]], [[1, 3], [5]]]
    seven = PairLengths(np.ones(7, dtype=int), np.ones(7, dtype=int))
    assert plan.cut_step(np.arange(7), seven, StepPlan(7, 2, 0, None, 2)) == [[[0, 2], [4, 6]], [[1, 3], [5]]]


def test_a_step_the_ranks_cannot_share_equally_ends_with_a_filler():
    """Five pairs that each fill the budget, on 2 ranks: 3 micro-batches each, the last of rank 1 empty (a filler)."""
    full = PairLengths(np.full(5, 8), np.full(5, 8))
    assert plan.cut_step(np.arange(5), full, StepPlan(5, 2, 0, 16, None)) == [[[0], [2], [4]], [[1], [3], []]]


def test_the_sft_term_is_the_steps_mean_over_its_chosen_tokens_however_the_step_is_cut():
    """The trainer weighs micro-batch k by n_k x W / N (its pairs of the step's N, on W ranks: `compute_loss`); the SFT
    term of each is scaled so that the weighed sum is the NLL of the step's chosen tokens over their count, T = 4 here
    (A's 3, B's 1): (6 + 4) / 4, whether A and B share a micro-batch or not."""
    args = DPOConfig(output_dir="unused", loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], bf16=False)
    sft = losses.SftOverStep(args)
    assert sft.active and sft.weight == 0.5 and sft.others == (["sigmoid"], [1.0])
    # Per-token log-probs of the chosen predictions (rejected rows: never read); NLL of A's tokens 6, of B's 4
    a, b = [-9.0, -1.0, -2.0, -3.0], [-4.0, -9.0, -9.0, -9.0]
    step_pairs, step_tokens = torch.tensor(2), torch.tensor(4)
    view = {k: torch.tensor(v) for k, v in PADDED.items()}
    assert losses.chosen_tokens(view) == 4
    together = sft.term(SimpleNamespace(log_probs=torch.tensor([a, b, a, b])), view, 2, step_pairs, step_tokens)
    assert together.item() == 0.5 * 10 / 4
    apart = 0.0
    for pair, log_probs in ((A, a), (B, b)):
        alone = packing.padded_view(packing.PackedPreferenceCollator()([pair]))
        width = alone["input_ids"].shape[1] - 1
        outputs = SimpleNamespace(log_probs=torch.tensor([log_probs[:width], log_probs[:width]]))
        apart += sft.term(outputs, alone, 1, step_pairs, step_tokens).item() * 1 / 2  # weighed n_k x W / N = 1 / 2
    assert apart == 0.5 * 10 / 4
    filler = sft.term(SimpleNamespace(log_probs=torch.tensor([a, b, a, b])), view, 0, step_pairs, step_tokens)
    assert filler.item() == 0.0
    assert trainer.pairs_in({**view, plan.FILLER: True}) == 0 and trainer.pairs_in(view) == 2

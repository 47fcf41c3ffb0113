"""The forwards a micro-batch can take, and the choice between them: `choice.py` lists what this machine and recipe
allow, in a documented order, and decides once per run; `cost.py` ranks those on kernels whose speed was measured by
their estimated cost on the run's pairs (any other kernel is taken by the order); `sample.py` finds those pairs'
lengths before the model loads.

- packed rows, unshared, on a varlen FlashAttention kernel: one row per micro-batch, boundaries from `cu_seq_lens_q/k`
  (`packing.PackedPreferenceCollator(one_row=True)`), no mask;
- packed rows, prompts shared or not, on FlexAttention: one row per micro-batch and a block mask built from the
  collator's compact inputs (`masks.block_masks`), fully masked blocks skipped, the attention compiled once per run
  (`flex.py`);
- packed rows, prompts shared or not, on sdpa/eager: balanced rows (`packing.fill_rows`) and, for shared prompts, a
  dense boolean mask (`masks.dense_masks`); the CPU's forward and the fallback;
- TRL's padded batches in row groups (`padded.py`), for models that cannot pack.
"""

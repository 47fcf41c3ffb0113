"""The forwards a micro-batch can take, and the choice between them (`choice.py`, ranked by `cost.py` on the lengths
`sample.py` finds): packed rows, unshared, on a varlen FlashAttention kernel (one row, no mask); packed rows, prompts
shared or not, on FlexAttention (one row, a block mask: `masks.block_masks`, compiled once per run: `flex.py`) or on
sdpa/eager (balanced rows, a dense mask for shared prompts); TRL's padded batches in row groups (`padded.py`).
"""

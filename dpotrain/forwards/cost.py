"""What each candidate forward costs on a run's pairs, and the decision between them (docs/attention.md, "How the
forward is chosen"): a pure function of the lengths, the candidates, the model's config and the kernels' measured
speeds (`SPEED`), so every rank decides alike. An estimate is the training FLOPs of what a forward computes (every
position, laid out as its collator lays them, and the keys its attention attends) divided by its kernel's measured
speed; a kernel whose speed is not measured is taken by the order, its layouts ranked by their work alone.
"""

from dataclasses import dataclass

import numpy as np

from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import flops, packing, padded


@dataclass(frozen=True)
class Speed:
    share_of_peak: float  # model FLOPs computed per second / the GPU's dense bf16 peak, in the training loop
    source: str


# The speed each attention kernel trains at on a GPU, only where measured and recorded in BENCHMARKS.md ("Measured on
# one H100 80GB": OLMo 3 7B layer width, bf16, activation checkpointing, MFU as train_dpo.py logs it).
SPEED = {
    "flash_attention_4": Speed(
        0.324, "measured on an H100: think-shaped pairs, unshared packing on FA4 varlen, 32.4% MFU (41.0k tokens/s)"
    ),
    "flex_attention": Speed(
        0.250,
        "measured on an H100: think-shaped pairs, shared prompts on flex, 25.0% MFU "
        "(33.9k tokens/s; multi-turn pairs 32.7%)",
    ),
}
UNIT_PEAK_TFLOPS = 989.0  # estimates are in seconds of an H100 (dense bf16 peak, flops.PEAK_BF16_TFLOPS)
SAMPLE_PAIRS = 1024  # pairs a decision weighs (a seeded sample of more): the ranking, not the total, matters


@dataclass(frozen=True)
class Candidate:
    attention: str
    packed: bool
    share_prompt: bool

    @property
    def one_row(self) -> bool:
        return self.packed and (packing.one_row(self.attention) or self.attention == "flex_attention")

    def describe(self) -> str:
        if not self.packed:
            return f"padded micro-batches on {self.attention}"
        return f"{'shared prompts' if self.share_prompt else 'unshared'} on {self.attention}"


@dataclass(frozen=True)
class TokenCounts:
    """Token counts of the pairs a decision is made from, as the trainer tokenizes them, and where they come from."""

    prompt: np.ndarray
    chosen: np.ndarray  # the chosen completion
    rejected: np.ndarray
    source: str
    shared: np.ndarray | None = None  # [shared start, shared end] per pair (`lengths.Measured`); None: unmeasured

    @classmethod
    def of(cls, measured, source: str) -> "TokenCounts":
        """Every pair's counts as measured (`lengths.Measured`: the analyzer's cache, a mixture's pairs at start)."""
        return cls(measured.prompt, measured.chosen, measured.rejected, source, measured.shared)

    def sample(self, pairs: int = SAMPLE_PAIRS, seed: int = 0) -> "TokenCounts":
        if len(self.prompt) <= pairs:
            return self
        keep = np.sort(np.random.default_rng(seed).choice(len(self.prompt), pairs, replace=False))
        return TokenCounts(self.prompt[keep], self.chosen[keep], self.rejected[keep], self.source)


def model_flops(config) -> flops.ModelFlops:
    """What `flops.ModelFlops.of` counts of the built model, from its config alone (the forward is chosen before the
    weights load): per layer its own head width, key/value heads and sliding window, the MLP weights a token runs."""
    text = config.get_text_config()
    h, kinds = text.hidden_size, flops.layer_kinds(text)
    # not head_counts: Gemma 4 may refuse a global num_key_value_heads; none at all in a model without attention
    # (Mamba, RWKV: trained padded), whose layers are counted by their MLP weights alone
    heads = getattr(text, "num_attention_heads", None) or 0
    dims, kv = flops.per_layer(text, "head_dim"), flops.per_layer(text, "num_key_value_heads")
    params = sum(
        _attention_params(text, i, dims[i], kv[i] or heads) + flops.mlp_params(text, i) for i in range(len(kinds))
    )
    # Gemma 4's per-layer inputs: a gate and a projection in each layer, and the model's projection into all of them
    params += 3 * h * (getattr(text, "hidden_size_per_layer_input", None) or 0) * len(kinds)
    return flops.ModelFlops(params + text.vocab_size * h, flops.attention_widths(text), flops.layer_windows(text))


def _attention_params(text, layer: int, d: int, kv: int) -> int:
    """A layer's attention weights: q and o of every head, k and v of the key/value heads (`flops.kv_matrices`), or
    multi-head latent attention's (DeepSeek V2/V3: q and kv through low-rank projections)."""
    h, heads = text.hidden_size, getattr(text, "num_attention_heads", None) or 0
    if rank := getattr(text, "kv_lora_rank", None):
        qk, v, rope, q_rank = text.qk_head_dim, text.v_head_dim, text.qk_rope_head_dim, text.q_lora_rank
        q = h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        return q + h * (rank + rope) + rank * heads * (qk - rope + v) + heads * v * h
    return 2 * h * heads * d + flops.kv_matrices(text, layer) * h * kv * d


def micro_batches(lengths: PairLengths, budget: int | None, pairs: int) -> list[list[int]]:
    """The pairs in order, cut as the plan cuts a step: within `budget` positions, or `pairs` at a time."""
    out, current, used = [], [], 0
    for i, cost in enumerate(lengths.tokens.tolist()):
        if current and (len(current) == pairs if budget is None else used + cost > budget):
            out.append(current)
            current, used = [], 0
        current.append(i)
        used += cost
    return out + ([current] if current else [])


def _dense(work: flops.ModelFlops, widths: list[int]) -> float:
    """Forward FLOPs of rows of these widths under a dense mask (every key of its row in every attention layer)."""
    w = np.asarray(widths, dtype=np.float64)
    attention = sum(work.attention_widths)  # linear-attention layers are 0 wide; a sliding one's mask is dense too
    return 2.0 * work.matmul_params * float(w.sum()) + 4.0 * attention * float((w * w).sum())


def training_flops(
    candidate: Candidate,
    lengths: TokenCounts,
    work: flops.ModelFlops,
    max_length: int | None,
    truncation_mode: str,
    budget: int | None,
    pairs: int,
    hidden_size: int,
    max_positions: int | None = None,
) -> float:
    """Forward + backward FLOPs the candidate computes on these pairs, its rows laid out as its collator lays them."""
    pl = PairLengths.from_parts(
        lengths.prompt, lengths.chosen, lengths.rejected, max_length, candidate.share_prompt, truncation_mode
    )
    if candidate.one_row:  # skipped tiles cost nothing; a shared pair's prompt once (flops.ModelFlops.training)
        shared = None if pl.shared is None else (pl.prompt - 1)[pl.shared]
        return work.training(np.concatenate([pl.chosen, pl.rejected]), shared)
    total = 0.0
    for mb in micro_batches(pl, budget, pairs):
        if candidate.packed:  # balanced rows of one width, a dense mask over each
            bound = packing.row_width_bound(max_length)
            rows, width = packing.lay_rows(pl.units(mb), False, hidden_size, bound, max_positions=max_positions)
            total += _dense(work, [width] * len(rows))
        else:  # TRL's padded rows in groups, each padded to its longest
            seqs = pl.sequences(mb)
            groups = padded.row_groups(seqs)
            widths = [max(seqs[i] for i in g) for g in groups for _ in g]
            if packing.one_row(candidate.attention):  # FlashAttention unpads: attention over real tokens only
                total += 2.0 * work.matmul_params * sum(widths) + (
                    work.forward(seqs) - 2.0 * work.matmul_params * sum(seqs)
                )
            else:
                total += _dense(work, widths)
    return 3.0 * total


def shown(estimate: float) -> str:
    """An estimate as a line shows it: 891, 1,112, 0.317."""
    return f"{estimate:,.0f}" if estimate >= 100 else f"{estimate:.3g}"


def measured(attn: str, cuda: bool) -> bool:
    """Whether this project measured the speed `attn` trains at on this device (`SPEED`: GPU speeds)."""
    return cuda and packing.attention_name(attn) in SPEED


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    seconds: float  # per 1,000 pairs: on an H100 at the kernel's measured speed, or (one kernel) TFLOP of work
    speed: Speed


@dataclass(frozen=True)
class Decision:
    ranked: tuple  # Estimates, cheapest first
    unit: str
    lengths_from: str
    measured: bool = False  # ranked by the kernels' measured speeds; else by the work on one kernel
    not_weighed: tuple = ()  # the candidates the order left out: on a kernel whose speed is not measured

    @property
    def winner(self) -> Estimate:
        return self.ranked[0]

    @property
    def runner_up(self) -> Estimate | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def summary(self) -> str:
        """'est. 627 against 890 for unshared on flash_attention_4 (H100-seconds per 1,000 pairs)'."""
        if self.runner_up is None:
            return f"est. {shown(self.winner.seconds)} {self.unit}"
        second = self.runner_up
        return (
            f"est. {shown(self.winner.seconds)} against {shown(second.seconds)} for {second.candidate.describe()} "
            f"({self.unit})"
        )

    def record(self) -> dict:
        return {
            "lengths_from": self.lengths_from,
            "unit": self.unit,
            "estimates": [
                {
                    "forward": e.candidate.describe(),
                    "estimate": round(e.seconds, 4),
                    "speed": e.speed.share_of_peak,
                    "speed_source": e.speed.source,
                }
                for e in self.ranked
            ],
            "not_weighed": list(self.not_weighed),
        }


def decide(
    candidates: list[Candidate],
    lengths: TokenCounts,
    config,
    cuda: bool,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    budget: int | None = None,
    pairs: int = 4,
    live_reference: bool = False,
    max_positions: int | None = None,
) -> Decision:
    """The comparable candidates ranked by their estimated cost on these pairs (ties: the order given), in
    H100-seconds at the measured speeds, or in TFLOP of work on one kernel. `live_reference`: a reference forward runs
    beside each micro-batch's training. `max_positions`: balanced rows' bound (`packing.positions_cap`)."""
    if not candidates:
        raise ValueError("no candidate forward to decide between")
    if max_length is not None and truncation_mode == "keep_start":  # TRL drops the pairs whose prompt fills it
        kept = lengths.prompt < max_length
        lengths = TokenCounts(lengths.prompt[kept], lengths.chosen[kept], lengths.rejected[kept], lengths.source)
    sample = lengths.sample()
    work, hidden = model_flops(config), config.get_text_config().hidden_size
    # Ranked against each other: those on measured kernels when the first runs one; else those on the first's kernel
    # alone, whose layouts differ in work only.
    first = candidates[0]
    by_speed = measured(first.attention, cuda)
    weighed = [c for c in candidates if (measured(c.attention, cuda) if by_speed else c.attention == first.attention)]
    one_kernel = Speed(1.0, f"every candidate runs {first.attention}: only the work differs")
    scale = UNIT_PEAK_TFLOPS * 1e12 if by_speed else 1e12
    estimates = []
    for c in weighed:
        speed = SPEED[packing.attention_name(c.attention)] if by_speed else one_kernel
        total = training_flops(c, sample, work, max_length, truncation_mode, budget, pairs, hidden, max_positions)
        total *= 4 / 3 if live_reference else 1  # forward + backward is 3 forwards; the reference's is a 4th
        estimates.append(Estimate(c, 1000 * (total / len(sample.prompt)) / (speed.share_of_peak * scale), speed))
    ranked = sorted(estimates, key=lambda e: round(e.seconds, 9))  # stable: ties keep the order given
    unit = "H100-seconds per 1,000 pairs" if by_speed else f"TFLOP per 1,000 pairs, all on {first.attention}"
    n, of = len(sample.prompt), len(lengths.prompt)
    source = lengths.source + (f" ({n:,} of its {of:,} pairs weighed)" if n < of else "")
    left_out = tuple(c.describe() for c in candidates if c not in weighed)
    return Decision(tuple(ranked), unit, source, by_speed, left_out)

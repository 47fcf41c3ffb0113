"""Which pairs go into which micro-batch: a fixed number of pairs per optimizer step, cut by a token budget.

An optimizer step always holds `pairs_per_step` pairs (the recipe's 128), drawn in a seeded random order. How those
pairs are cut into micro-batches is a separate, purely mechanical choice:

- `max_tokens_per_microbatch` set: each rank's share of the step is split into micro-batches of balanced token
  counts under that budget (a pair is never split). Long and short pairs are grouped only inside a step, so the order
  stays random at the scale of steps.
- unset: micro-batches of `per_device_train_batch_size` pairs, as in any Trainer, so a run stays comparable with
  other tools at equal work.

Every rank runs the same number of micro-batches per step (ZeRO-2 reduces gradients on every backward, and a rank
that runs one more would wait forever). The Trainer's loop wants that number fixed for the whole run, so it is the
largest any step needs; steps with shorter pairs get fuller budgets left unused rather than extra micro-batches. The
plan depends only on the lengths, the seed and the epoch, so every rank computes it alone and a resumed job replays
the same micro-batches.
"""

import math
from dataclasses import dataclass

import numpy as np
from transformers.trainer_pt_utils import BatchRebalanceSampler

# Losses computed across the pairs of a micro-batch (they sort the batch's log-ratios), not per pair: their value
# depends on which pairs share a micro-batch, so a token budget would change what they optimize.
BATCH_LEVEL_LOSSES = {"aot", "aot_unpaired"}


@dataclass(frozen=True)
class BatchPlan:
    pairs_per_step: int
    world_size: int
    micro_batches: int  # per rank and optimizer step: gradient_accumulation_steps
    max_tokens: int | None  # the budget, or None for micro-batches of a fixed number of pairs
    pairs_per_micro_batch: int | None  # with max_tokens None


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def steps_of(order: np.ndarray, pairs_per_step: int, world_size: int) -> list[np.ndarray]:
    """Cut an epoch's order into optimizer steps of `pairs_per_step` pairs.

    A last step with fewer pairs than processes joins the step before it (every rank needs at least one pair), so no
    pair is dropped or repeated; that one step then holds up to world_size - 1 extra pairs, and its loss is still the
    mean over its own pairs.
    """
    steps = [order[i : i + pairs_per_step] for i in range(0, len(order), pairs_per_step)]
    if len(steps) > 1 and len(steps[-1]) < world_size:
        last = steps.pop()
        steps[-1] = np.concatenate([steps[-1], last])
    return steps


def balanced_groups(indices: np.ndarray, costs: np.ndarray, groups: int) -> list[list[int]]:
    """Split `indices` into `groups` non-empty groups of balanced total cost (longest first, each to the lightest)."""
    order = indices[np.argsort(-costs[indices], kind="stable")]
    loads = [0] * groups
    out: list[list[int]] = [[] for _ in range(groups)]
    for i in order:
        g = min(range(groups), key=lambda k: (loads[k], k))
        out[g].append(int(i))
        loads[g] += int(costs[i])
    return out


def rank_shares(step: np.ndarray, costs: np.ndarray, p: "BatchPlan") -> list[np.ndarray]:
    """Each rank's pairs of one step: balanced by tokens under a budget, else an equal number of pairs each."""
    if p.max_tokens is None:
        return [step[r :: p.world_size] for r in range(p.world_size)]
    return [np.asarray(g) for g in balanced_groups(step, costs, p.world_size)]


def split_share(share: np.ndarray, costs: np.ndarray, count: int, p: "BatchPlan") -> list[list[int]]:
    """One rank's pairs of a step as `count` micro-batches: balanced by tokens, else in order, equal in pairs."""
    if p.max_tokens is None:
        return [[int(i) for i in part] for part in np.array_split(share, count)]
    return balanced_groups(share, costs, count)


def micro_batches_needed(costs: np.ndarray, indices: list[int], max_tokens: int) -> int:
    """The fewest balanced micro-batches that keep every one within `max_tokens`."""
    idx = np.asarray(indices)
    g = max(1, math.ceil(int(costs[idx].sum()) / max_tokens))
    while g < len(idx) and max(int(costs[b].sum()) for b in balanced_groups(idx, costs, g)) > max_tokens:
        g += 1
    return min(g, len(idx))


def plan(
    costs: np.ndarray,
    pairs_per_step: int,
    world_size: int,
    seed: int,
    epochs: int,
    max_tokens: int | None,
    pairs_per_micro_batch: int | None,
) -> BatchPlan:
    """The micro-batch count per step for the whole run (the largest any step of `epochs` epochs needs)."""
    if max_tokens is None:
        return BatchPlan(pairs_per_step, world_size, math.ceil(pairs_per_step / world_size / pairs_per_micro_batch),
                         None, pairs_per_micro_batch)  # fmt: skip
    needed = 1
    for epoch in range(max(epochs, 1)):
        for step in steps_of(epoch_order(len(costs), seed, epoch), pairs_per_step, world_size):
            for share in balanced_groups(step, costs, world_size):
                needed = max(needed, micro_batches_needed(costs, share, max_tokens))
    return BatchPlan(pairs_per_step, world_size, needed, max_tokens, None)


def last_step_count(step: np.ndarray, costs: np.ndarray, p: BatchPlan) -> int:
    """Micro-batches of an epoch's last step: it may hold fewer pairs than a rank has micro-batches."""
    return min(p.micro_batches, min(len(x) for x in rank_shares(step, costs, p)))


def epoch_micro_batches(costs: np.ndarray, batch_plan: BatchPlan, seed: int, epoch: int, rank: int):
    """This rank's micro-batches of one epoch, step after step: lists of data set indices."""
    p = batch_plan
    steps = steps_of(epoch_order(len(costs), seed, epoch), p.pairs_per_step, p.world_size)
    for s, step in enumerate(steps):
        # Every rank runs the same number of micro-batches; only a short last step may need fewer than usual.
        count = p.micro_batches if s < len(steps) - 1 else last_step_count(step, costs, p)
        yield from split_share(rank_shares(step, costs, p)[rank], costs, count, p)


def epoch_length(costs: np.ndarray, batch_plan: BatchPlan, seed: int, epoch: int) -> int:
    """Micro-batches per rank in one epoch (the Trainer's `len(dataloader)`)."""
    p = batch_plan
    steps = steps_of(epoch_order(len(costs), seed, epoch), p.pairs_per_step, p.world_size)
    return (len(steps) - 1) * p.micro_batches + last_step_count(steps[-1], costs, p)


class TokenBudgetSampler(BatchRebalanceSampler):
    """The batch sampler of the train dataloader: yields this rank's micro-batches (lists of indices).

    A `BatchRebalanceSampler` subclass only so that transformers' Trainer treats it as the rank-aware batch sampler
    it is (`Trainer._get_dataloader` passes it as `batch_sampler` and stops accelerate from sharding it again).
    """

    def __init__(self, costs, batch_plan: BatchPlan, seed: int, rank: int):
        self.costs = np.asarray(costs, dtype=np.int64)
        self.batch_plan = batch_plan
        self.seed = seed
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        return epoch_micro_batches(self.costs, self.batch_plan, self.seed, self.epoch, self.rank)

    def __len__(self):
        return epoch_length(self.costs, self.batch_plan, self.seed, self.epoch)

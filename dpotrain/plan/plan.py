"""The plan: which pairs form each optimizer step, and how each rank's share of a step is cut into micro-batches.

An optimizer step holds `pairs_per_step` pairs drawn in a seeded random order, cut into micro-batches: the same number
on every rank (ZeRO reduces gradients on every backward, so a rank that ran one more would wait forever), no more than
the step needs. The number may change from step to step: the Trainer sees one item per optimizer step and
`RecipeDPOTrainer.training_step` runs the step's micro-batches itself. With a token budget, packed sequences go into the
fewest bins under it that every rank can share equally (a pair is never split); padded batches (models that cannot
pack) into runs of similar length; without one, micro-batches hold `per_device_train_batch_size` pairs. Where no equal
count of non-empty micro-batches exists, each pair gets its own and a rank dealt one fewer runs a filler (`FILLER`), so
any budget >= 2 x max_length cuts every step. The plan depends only on the lengths, the seed, the world size and the
epoch: every rank computes it alone, and a resumed job replays the same steps.
"""

import bisect
import heapq
import math
from dataclasses import dataclass

import numpy as np
from transformers.trainer_pt_utils import BatchRebalanceSampler

from dpotrain.data.pair_lengths import PairLengths
from dpotrain.recipe.errors import ConfigError, decimal, plural


@dataclass(frozen=True)
class StepPlan:
    pairs_per_step: int
    world_size: int
    seed: int
    max_tokens: int | None  # the token budget of a micro-batch, or None for micro-batches of a fixed number of pairs
    pairs_per_micro_batch: int | None  # with max_tokens None
    padded: bool = False  # micro-batches padded to their longest sequence (TRL's collator), not packed
    layout: "RowLayout | None" = None  # how the forward lays a micro-batch out: rows' padding counts against the budget

    def alone(self, lengths: PairLengths, pairs) -> np.ndarray:
        """What each pair costs in a micro-batch of its own (`cost` of a one-pair micro-batch), for many pairs."""
        return 2 * lengths.longest[pairs] if self.padded else lengths.tokens[pairs]

    def cost(self, lengths: PairLengths, micro_batch) -> int:
        """Positions a micro-batch takes: packed, its sequences; padded, 2 rows per pair of its longest sequence."""
        idx = np.asarray(micro_batch)
        if self.padded:
            return 2 * len(idx) * int(lengths.longest[idx].max())
        return int(lengths.tokens[idx].sum())


class PlanError(ConfigError):
    def __init__(self, message: str, needed_budget: int | None = None):
        super().__init__(message)
        self.needed_budget = needed_budget  # the smallest token budget that would cut the step, when one would


# A filler micro-batch is an empty one in the plan: a forward and backward on one of the rank's own pairs with weight 0,
# only so that every rank runs the same collectives.
FILLER = "filler"


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def steps_of(order: np.ndarray, pairs_per_step: int, world_size: int) -> list[np.ndarray]:
    """Cut an epoch's order into optimizer steps of `pairs_per_step` pairs; a last step with fewer pairs than processes
    joins the step before it (every rank needs a pair), so no pair is dropped or repeated."""
    steps = [order[i : i + pairs_per_step] for i in range(0, len(order), pairs_per_step)]
    if len(steps) > 1 and len(steps[-1]) < world_size:
        last = steps.pop()
        steps[-1] = np.concatenate([steps[-1], last])
    return steps


# --- cutting one step ------------------------------------------------------------------------------------------------


def _lpt(items: list[int], costs: dict[int, int], bins: int) -> list[list[int]]:
    """Longest processing time first: each item (already longest first) into the least loaded of `bins` bins."""
    heap = [(0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in items:
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return out


def _first_fit(items: list[int], costs: dict[int, int], budget: int, bins: int) -> list[list[int]] | None:
    """First fit decreasing into at most `bins` bins of `budget`; None when the items do not fit."""
    out: list[list[int]] = []
    loads: list[int] = []
    for i in items:
        b = next((b for b, load in enumerate(loads) if load + costs[i] <= budget), len(out))  # else a new bin
        if b == bins:
            return None
        if b == len(out):
            out.append([])
            loads.append(0)
        out[b].append(i)
        loads[b] += costs[i]
    while len(out) < bins:  # more bins than first fit needs: split the heaviest bin that holds more than one pair
        b = max((b for b in range(len(out)) if len(out[b]) > 1), key=lambda b: (loads[b], -b))
        moved = out[b].pop()  # its shortest pair
        loads[b] -= costs[moved]
        out.append([moved])
        loads.append(costs[moved])
    return out


def _packed_bins(order: list[int], lengths: PairLengths, budget: int, bins: int, tries: int = 0):
    """`bins` non-empty micro-batches of at most `budget` packed positions, balanced when possible; None when neither
    heuristic fits them. `tries`: first-fit attempts on slightly shuffled orders (seeded) when the plain ones fail."""
    costs = {i: int(lengths.tokens[i]) for i in order}
    balanced = _lpt(order, costs, bins)
    if max(sum(costs[i] for i in b) for b in balanced) <= budget:
        return balanced
    found = _first_fit(order, costs, budget, bins)
    rng = np.random.default_rng(order[:8])
    for _ in range(tries if found is None else 0):
        noise = rng.uniform(0.85, 1.15, len(order))  # longest first, roughly
        shuffled = [order[j] for j in np.argsort([-costs[i] * x for i, x in zip(order, noise, strict=True)])]
        found = _first_fit(shuffled, costs, budget, bins)
        if found is not None:
            break
    return found


def fewest_bins(costs, budget: int) -> int:
    """A lower bound on the micro-batches of at most `budget` that items of these costs need (Martello and Toth's L2
    bound for bin packing), for every candidate k (each distinct cost up to half the budget) at once, on sorted costs:
    items over budget - k need a bin each (`big`), so do those over half up to budget - k (`mid`), and the items from k
    to half the budget fit only into the room `mid` leaves, or into new bins."""
    w = np.sort(np.asarray(costs, dtype=np.int64))
    best = math.ceil(int(w.sum()) / budget)
    half = budget / 2
    over_half = int(np.count_nonzero(w > half))
    k = np.unique(w[w <= half])
    if len(k):
        total = np.concatenate([[0], np.cumsum(w)])  # total[i]: the sum of the i smallest
        n_half = np.searchsorted(w, half, side="right")  # costs <= half
        n_mid_top = np.searchsorted(w, budget - k, side="right")  # costs <= budget - k
        big = len(w) - n_mid_top
        mid = np.maximum(n_mid_top - n_half, 0)
        mid_sum = np.where(n_mid_top > n_half, total[n_mid_top] - total[n_half], 0)
        n_small_lo = np.searchsorted(w, k)  # costs < k
        small_sum = total[n_half] - total[n_small_lo]
        room = mid * budget - mid_sum
        extra = np.maximum(0, -((room - small_sum) // budget))  # ceil((small - room) / budget), in integers
        best = max(best, int((big + mid + extra).max()))
    return max(best, over_half, 1)


def _padded_runs(order: list[int], lengths: PairLengths, budget: int, bins: int) -> list[list[int]] | None:
    """`bins` non-empty runs of similar length (longest first) whose padded size stays within `budget`: the smallest
    largest run that `bins` runs can achieve, so the micro-batches are balanced."""
    widths = [2 * int(lengths.longest[i]) for i in order]  # sorted longest first: a run pads to its first pair

    def runs_within(capacity: int) -> list[int] | None:
        starts = [0]
        for j in range(1, len(order)):
            if (j - starts[-1] + 1) * widths[starts[-1]] > capacity:
                starts.append(j)
        return starts if len(starts) <= bins else None

    if runs_within(budget) is None:
        return None
    lo = max(widths)  # the smallest capacity that `bins` runs reach
    starts = runs_within(lo + bisect.bisect_left(range(lo, budget), True, key=lambda c: runs_within(c) is not None))
    runs = [order[a:b] for a, b in zip(starts, [*starts[1:], len(order)], strict=True)]
    while len(runs) < bins:  # fewer runs than bins: halve the largest run that holds more than one pair
        r = max(
            (r for r in range(len(runs)) if len(runs[r]) > 1),
            key=lambda r: (len(runs[r]) * 2 * int(lengths.longest[runs[r][0]]), -r),
        )
        half = (len(runs[r]) + 1) // 2
        runs[r : r + 1] = [runs[r][:half], runs[r][half:]]
    return runs


def _deal(bins: list[list[int]], costs: list[int], world_size: int, per_rank: int | None = None):
    """The bins dealt to ranks, `per_rank` each (default: an equal share), balanced by cost, each rank's heaviest
    first (ranks wait for each other at every backward); a rank dealt fewer ends with fillers (empty lists)."""
    per_rank = per_rank or len(bins) // world_size
    order = sorted(range(len(bins)), key=lambda b: (-costs[b], bins[b][0]))
    heap = [(0, r) for r in range(world_size)]  # the ranks with room left, least loaded first
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for b in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(b)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + costs[b], r))
    # `order` is heaviest first, so each rank's list is too; its fillers come last
    return [[bins[b] for b in rank] + [[] for _ in range(per_rank - len(rank))] for rank in ranks]


def cut_step(pairs: np.ndarray, lengths: PairLengths, p: StepPlan) -> list[list[list[int]]]:
    """One step's pairs as `[rank][micro-batch] -> pair indices`, cut as the module's docstring says (packed: into the
    fewest bins that bin packing finds)."""
    w, n = p.world_size, len(pairs)
    if n < w:
        # A step shorter than pairs_per_step is the epoch's only one (`steps_of` joins a short last step to the one
        # before): the data set holds fewer pairs than the processes, whatever pairs_per_step says.
        fix = f"use a data set of at least {w} pairs" if n < p.pairs_per_step else f"use pairs_per_step >= {w}"
        raise PlanError(
            f"a step of {plural(n, 'pair')} leaves {w - n} of the {w} processes without a pair: {fix}, "
            "or fewer processes"
        )
    if p.max_tokens is None:
        shares = [[int(i) for i in pairs[r::w]] for r in range(w)]
        # The micro-batches the largest share needs, on every rank: a rank with one pair fewer (an epoch's last step)
        # ends with a filler (array_split's empty part). Capped at the smallest share, per_device_train_batch_size 1
        # put 2 pairs in a micro-batch on the other ranks (a step of 11 pairs on 4: [0, 4], [8]), the memory it was
        # set to keep within exceeded at an epoch's end.
        count = math.ceil(len(shares[0]) / p.pairs_per_micro_batch)
        return [[[int(i) for i in part] for part in np.array_split(share, count)] for share in shares]
    found = _cut(pairs, lengths, p, p.max_tokens)
    if found is not None:
        return found
    alone = [int(c) for c in p.alone(lengths, pairs)]
    # The smallest budget that cuts this step, for the message (twice the whole step always fits)
    budgets = range(p.max_tokens, 2 * sum(alone))
    least = p.max_tokens + bisect.bisect_left(budgets, True, key=lambda b: _cut(pairs, lengths, p, b) is not None)
    needed = math.ceil(least / 1024) * 1024
    raise PlanError(
        f"a step of {n} pairs ({sum(alone):,} positions, the longest pair {max(alone):,}) cannot be cut into the same "
        f"number of non-empty micro-batches of at most max_tokens_per_microbatch={p.max_tokens:,} on each of {w} "
        f"processes (with {n} pairs no process can have more than {n // w}): raise max_tokens_per_microbatch to "
        f"{needed:,}, or use fewer processes",
        needed,
    )


def _cut(pairs: np.ndarray, lengths: PairLengths, p: StepPlan, budget: int) -> list[list[list[int]]] | None:
    w, n = p.world_size, len(pairs)
    key = lengths.longest if p.padded else lengths.tokens
    order = [int(i) for i in pairs[np.lexsort((pairs, -key[pairs]))]]  # longest first, ties by index
    alone = p.alone(lengths, order)  # what each pair costs in a micro-batch of its own
    if alone.max() > budget:
        return None
    # A padded micro-batch costs at least what its pairs cost alone, so the bound holds for both forwards.
    start = max(1, math.ceil(fewest_bins(alone, budget) / w))
    for per_rank in range(start, n // w + 1):
        if p.padded:
            bins = _padded_runs(order, lengths, budget, w * per_rank)
        else:
            bins = _packed_bins(order, lengths, budget, w * per_rank, tries=16 if per_rank == start else 0)
        if bins is not None and (p.layout is None or p.layout.fits(lengths, bins, budget)):
            return _deal(bins, [p.cost(lengths, b) for b in bins], w)
    if n % w == 0:
        return None
    # No equal count of non-empty micro-batches: every pair alone (a budget >= 2 x max_length holds any pair),
    # n // w + 1 micro-batches a rank, and a rank dealt one fewer runs a filler.
    return _deal([[i] for i in order], [int(c) for c in alone], w, per_rank=n // w + 1)


def epoch_steps(lengths: PairLengths, p: StepPlan, epoch: int) -> list[list[list[list[int]]]]:
    """Every step of one epoch: `[step][rank][micro-batch] -> pair indices`."""
    steps = steps_of(epoch_order(len(lengths), p.seed, epoch), p.pairs_per_step, p.world_size)
    return [cut_step(step, lengths, p) for step in steps]


def plan_run(lengths: PairLengths, p: StepPlan, epochs: int) -> list:
    """Every epoch of a run, planned at start: a step that cannot be cut is refused now, naming the budget that cuts
    every step of the run."""
    planned, refused = [], []
    for epoch in range(epochs):
        steps = []
        for step in steps_of(epoch_order(len(lengths), p.seed, epoch), p.pairs_per_step, p.world_size):
            try:
                steps.append(cut_step(step, lengths, p))
            except PlanError as e:
                if e.needed_budget is None:
                    raise
                refused.append(e)
        planned.append(steps)
    if refused:
        worst = max(refused, key=lambda e: e.needed_budget)
        raise PlanError(
            f"{plural(len(refused), 'step')} of the run cannot be cut; the hardest: {worst}".replace(
                f"to {worst.needed_budget:,},", f"to {worst.needed_budget:,} (enough for every step),"
            ),
            worst.needed_budget,
        )
    return planned


@dataclass(frozen=True)
class RowLayout:
    """How a micro-batch becomes the positions the model runs: one row, balanced rows, or padded row groups."""

    kind: str  # "one_row", "rows" (unshared or shared prompts: `lengths.shared` says) or "padded"
    hidden_size: int = 4096
    multiple: int | None = None  # a packed row's width is padded to a multiple of it (`ForwardChoice.pad_multiple`)
    max_width: int | None = None  # balanced rows' widest (`packing.row_width_bound` of max_length)
    max_positions: int | None = None  # balanced rows' positions, padding included (`packing.positions_cap`)

    @classmethod
    def of(cls, packed: bool, one_row: bool, hidden_size: int, multiple: int | None, max_length, max_positions):
        """The layout of a forward, from the choice (a dry run) or the collator built from it (the run): one rule."""
        from dpotrain.forwards.packing import row_width_bound

        if not packed:
            return cls("padded")
        return cls("one_row" if one_row else "rows", hidden_size, multiple, row_width_bound(max_length), max_positions)

    @property
    def padded(self) -> bool:
        return self.kind == "padded"

    def positions(self, lengths: PairLengths, micro_batch) -> int:
        if self.kind == "padded":
            from dpotrain.forwards.padded import positions

            return positions(lengths.sequences(micro_batch))
        from dpotrain.forwards.packing import lay_rows

        rows, width = lay_rows(
            lengths.units(micro_batch),
            self.kind == "one_row",
            self.hidden_size,
            self.max_width,
            self.multiple,
            self.max_positions,
        )
        return len(rows) * width

    def fits(self, lengths: PairLengths, micro_batches: list[list[int]], budget: int) -> bool:
        """Balanced rows are padded to the widest (a dense mask needs one width): the positions they take, padding
        included, must stay within the budget the memory plan plans for (the demo's rows took up to 2,290 positions for
        a budget of 2,048; 7B-wide ones 19,295 for 16,384). The rows keep within it where they can (`fill_rows`); where
        they cannot, the step takes more micro-batches. Only where the memory is planned (`packing.positions_cap`); one
        row pads only to its tile; padded groups have their own cost."""
        if self.kind != "rows" or self.max_positions is None:
            return True
        return all(self.positions(lengths, mb) <= budget for mb in micro_batches)


def pairs_trained(epochs: list, steps: int) -> np.ndarray:
    """The pairs the run's first `steps` optimizer steps train, sorted: all the reference stage scores."""
    first = [step for epoch in epochs for step in epoch][:steps]
    taken = [i for step in first for rank in step for mb in rank for i in mb]
    return np.unique(np.asarray(taken, dtype=np.int64))


def epochs_needed(max_steps: int, num_train_epochs: float, pairs: int, pairs_per_step: int, world_size: int) -> int:
    """Epochs a run touches (the plan covers each): num_train_epochs, or what max_steps reaches."""
    if max_steps > 0:
        return max(1, math.ceil(max_steps / len(steps_of(range(pairs), pairs_per_step, world_size))))
    return max(1, math.ceil(num_train_epochs))


def summary(
    lengths: PairLengths,
    p: StepPlan,
    epochs: list[list],
    forward: RowLayout | None = None,
    reduce_per_backward: bool = True,
    steps: int | None = None,
) -> dict:
    """What the plan does, for the run's records (micro-batches, gradient reductions: ZeRO reduces at every backward,
    DDP and FSDP once per step; pairs and positions per micro-batch; the padding share). `forward` gives the positions
    a micro-batch really takes, else the plan's cost counts. `steps`: the run trains only the plan's first `steps`
    (max_steps, or part of an epoch): the record is theirs, not the whole epochs' (per-epoch figures at their rate)."""
    per_epoch = len(epochs[0])  # optimizer steps in an epoch
    trained = [step for epoch in epochs for step in epoch][:steps]
    counts = [len(step[0]) for step in trained]  # fillers included: they take their time
    every = [mb for step in trained for rank in step for mb in rank]
    micro_batches = [mb for mb in every if mb]
    pairs = [len(mb) for mb in micro_batches]
    real = [int(lengths.tokens[mb].sum()) for mb in micro_batches]
    taken = [forward.positions(lengths, mb) if forward else p.cost(lengths, mb) for mb in micro_batches]
    forward_name = "padded (TRL's collator)" if p.padded else "packed"
    if not p.padded and lengths.shared is not None:
        forward_name = f"packed, prompts shared ({int(lengths.shared.sum())} of {len(lengths)} pairs)"
    per_epoch_micro_batches = round(sum(counts) * per_epoch / len(trained))
    reductions = per_epoch_micro_batches if reduce_per_backward else per_epoch
    out = {
        "forward": forward_name,
        "pairs_per_step": p.pairs_per_step,
        "max_tokens_per_microbatch": p.max_tokens,
        "micro_batches_per_step": {"min": min(counts), "mean": round(sum(counts) / len(counts), 3), "max": max(counts)},
        "micro_batches_per_epoch": per_epoch_micro_batches,
        "gradient_reductions_per_epoch": 0 if p.world_size == 1 else reductions,
        "pairs_per_micro_batch": _spread(pairs),
        # The pairs each trained step takes: pairs_per_step but where an epoch's last step takes what is left (or all
        # of an epoch smaller than one step), which the setting alone does not say.
        "pairs_per_step_trained": _spread([sum(len(mb) for rank in step for mb in rank) for step in trained]),
        "positions_per_micro_batch": _spread(taken),
        "padding_share": round(1 - sum(real) / sum(taken), 4),
        "filler_micro_batches": len(every) - len(micro_batches),
    }
    if p.max_tokens is not None:
        # No cut can do with fewer micro-batches per rank than this bound (`fewest_bins`) allows.
        alone = p.alone(lengths, slice(None))
        fewest = [
            math.ceil(fewest_bins(alone[[i for rank in step for mb in rank for i in mb]], p.max_tokens) / p.world_size)
            for step in trained
        ]
        out["micro_batches_per_step"]["lower_bound_mean"] = round(sum(fewest) / len(fewest), 3)
    return out


def check_eval_split(pairs: int, world_size: int) -> None:
    """Every rank that evaluates needs a pair of its own (`eval_batches`). The data stage checks it as the held-out
    pairs are read: checked only here, a split of 1 pair on 3 processes was refused after the model loaded and the
    reference scored every pair, at the first evaluation."""
    if pairs < world_size:
        raise PlanError(
            f"the evaluation split has {plural(pairs, 'pair')}, fewer than the {world_size} processes that evaluate "
            f"(each needs one): hold out at least {world_size} pairs, launch fewer processes, or set no eval_strategy"
        )


def eval_batches(pairs: int, world_size: int, batch_size: int, positions=None, budget=None) -> list[list[list[int]]]:
    """An evaluation set as `[rank][batch] -> pair indices`: every pair once, the same number of batches of at most
    `batch_size` pairs on every rank (the evaluation loop gathers after every batch), each rank's first holding pairs;
    a rank with fewer pairs than another ends with empty ones, fillers (13 pairs on 2 ranks, 1 a batch: 7 and 6).
    With a token `budget`, a batch whose `positions(pairs)` exceed it is cut further: by count alone, the think recipe's
    8 pairs a batch held up to 262,144 positions, past what its memory plan gives a forward (3 x 65,536)."""
    check_eval_split(pairs, world_size)
    per_rank = math.ceil(pairs / (world_size * batch_size))
    chunks = [[int(i) for i in c] for c in np.array_split(np.arange(pairs), world_size * per_rank)]
    ranks = [
        [part for c in chunks[rank::world_size] for part in _within(c, positions, budget)] for rank in range(world_size)
    ]
    most = max(len(batches) for batches in ranks)
    return [batches + [[] for _ in range(most - len(batches))] for batches in ranks]


def _within(batch: list[int], positions, budget: int | None) -> list[list[int]]:
    """`batch` in order, cut where the next pair would take it past `budget` positions (a pair alone past it alone)."""
    if budget is None or not batch:
        return [batch]
    parts = [[batch[0]]]
    for i in batch[1:]:
        if positions([*parts[-1], i]) > budget:
            parts.append([])
        parts[-1].append(i)
    return parts


def _spread(values: list[int]) -> dict:
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)}


class StepSampler(BatchRebalanceSampler):
    """The train dataloader's batch sampler: one item per optimizer step, this rank's micro-batches of it; a
    `BatchRebalanceSampler`, so accelerate does not shard it again. An epoch past `planned` is planned as it starts."""

    def __init__(self, lengths: PairLengths, plan: StepPlan, rank: int, planned: list | None = None):
        self.lengths, self.plan, self.rank = lengths, plan, rank
        self.planned = list(planned or [])
        self.epoch = 0
        self.steps_per_epoch = len(steps_of(np.arange(len(lengths)), plan.pairs_per_step, plan.world_size))

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        planned = self.epoch < len(self.planned)
        for step in self.planned[self.epoch] if planned else epoch_steps(self.lengths, self.plan, self.epoch):
            yield [tuple(tuple(mb) for mb in step[self.rank])]

    def __len__(self):
        return self.steps_per_epoch


class FixedBatches(BatchRebalanceSampler):
    """This rank's batches fixed in advance (evaluation): rank-aware, so accelerate does not shard it again."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class StepRows:
    """A data set read a whole step at a time: this rank's micro-batches of one step, each as its rows and whether it is
    a filler (which reads the rows of this rank's last pair of the step, or `stand_in` in a step without one: an
    evaluation's filler batch)."""

    def __init__(self, dataset, stand_in: int | None = None):
        self.dataset, self.stand_in = dataset, stand_in

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, micro_batches):
        stand_in = [next((mb[-1] for mb in reversed(micro_batches) if mb), self.stand_in)]
        return [(self.dataset.__getitems__(list(mb or stand_in)), not mb) for mb in micro_batches]


@dataclass
class StepCollator:
    """Collates each micro-batch of a step with the forward's own collator; a filler's batch carries `FILLER`."""

    collate: object

    def __call__(self, items: list) -> dict:
        (step,) = items  # the sampler yields one step at a time
        return {
            "micro_batches": [{**self.collate(rows), FILLER: True} if f else self.collate(rows) for rows, f in step]
        }


@dataclass
class BatchCollator(StepCollator):
    """An evaluation batch, read as a step of one micro-batch (`StepRows`): a filler's carries `FILLER`."""

    def __call__(self, items: list) -> dict:
        return super().__call__(items)["micro_batches"][0]


def check_eval_delay(steps: dict, training, per_epoch: int | None = None) -> None:
    """An eval_delay past the run's last step (eval_strategy steps) or last epoch (epoch) meant transformers never
    evaluated, and the run exited 0 without the held-out evaluation asked for: refused here, before the model loads.
    `per_epoch`: the optimizer steps of an epoch, which place the last epoch of a run of max_steps."""
    # transformers' IntervalStrategy is a str: it equals its spelling
    total, delay, strategy = steps.get("total_steps"), training.eval_delay or 0, training.eval_strategy
    if strategy == "epoch" and training.max_steps > 0 and total is not None and per_epoch:
        # Under max_steps the run ends at epoch max_steps / per_epoch (transformers' state.epoch there, where it judges
        # eval_delay): checked against num_train_epochs alone, --max_steps 4 of a 13-step epoch with eval_delay 1
        # evaluated nothing and exited 0
        last = total / per_epoch
        if delay > last:
            within = math.floor(last * 1000) / 1000  # rounded down: an eval_delay it names must evaluate
            raise ConfigError(
                f"eval_delay {delay:g} is past the run's last epoch ({decimal(last)}: max_steps {total} of "
                f"{plural(per_epoch, 'step')} an epoch, eval_strategy epoch): it would never evaluate; pass an "
                f"eval_delay of {decimal(within)} or less, --max_steps {math.ceil(delay * per_epoch)} or more, or "
                "eval_strategy no"
            )
    if strategy == "steps" and total is not None and delay > total:
        raise ConfigError(
            f"eval_delay {delay:g} is past the run's last step ({total}): it would never evaluate; pass an eval_delay "
            f"of {total} or less (the run's steps: --dry-run), or eval_strategy no"
        )
    if strategy == "epoch" and training.max_steps <= 0 and delay > training.num_train_epochs:
        raise ConfigError(
            f"eval_delay {delay:g} is past the run's last epoch ({training.num_train_epochs:g}, eval_strategy epoch): "
            f"it would never evaluate; pass an eval_delay of {training.num_train_epochs:g} or less, or eval_strategy no"
        )


def check_schedule_fits(steps: dict, training) -> None:
    """warmup_stable_decay counts its phases in steps of its own (`num_decay_steps`, `num_stable_steps`), which the
    schedule's walk before the data loads cannot weigh against the run. Without `num_stable_steps` the stable phase is
    what is left, and a decay longer than the steps after warm-up made it negative, so the rate fell from inside
    warm-up and never reached learning_rate (10 decay steps of a 6-step run with 2 of warm-up: at most 0.5 x
    learning_rate). With it, transformers takes the phases as given: fewer than the run's steps held the rest at
    min_lr_ratio x learning_rate (0 by default: 8 steps with 2 + 2 + 2 trained steps 7 and 8 at rate 0), more ended
    the run before its decay did (or before it began)."""
    kwargs = training.lr_scheduler_kwargs or {}
    decay, total = kwargs.get("num_decay_steps"), steps.get("total_steps")
    if training.lr_scheduler_type != "warmup_stable_decay" or total is None or not _a_count(decay):
        return
    warmup = steps.get("warmup_steps") or 0
    after = total - warmup
    if "num_stable_steps" in kwargs:
        _check_phases(total, warmup, kwargs)
    elif decay > after:
        raise ConfigError(
            f"lr_scheduler_kwargs num_decay_steps {decay:g} is more than the {plural(after, 'step')} after warm-up "
            f"of the run's {total}: warmup_stable_decay would start its decay inside the warm-up and the learning rate "
            f"never reach the one set: give num_decay_steps {after} or fewer (the run's steps: --dry-run)"
        )


def _a_count(value) -> bool:
    """A number of steps as transformers reads one (a JSON number; not true/false, which Python counts as 1 and 0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_phases(total: int, warmup: int, kwargs: dict) -> None:
    """warmup_stable_decay's phases as given (`check_schedule_fits`): warm-up + stable + decay, the run's steps."""
    stable, decay = kwargs["num_stable_steps"], kwargs["num_decay_steps"]
    if not _a_count(stable) or warmup + stable + decay == total:
        return
    after, floor = total - warmup, kwargs.get("min_lr_ratio", 0)
    phases = f"warm-up {warmup} + stable {stable:g} + decay {decay:g} = {warmup + stable + decay:g} steps"
    if warmup + stable + decay < total:
        rest = total - warmup - stable - decay
        what = f"hold the learning rate at min_lr_ratio ({floor:g}) x learning_rate for the last {rest:g}"
        what += " steps, training nothing" if not floor else " steps"
    elif warmup + stable >= total:
        what = "end before its decay begins (the learning rate never decays)"
    else:
        what = "end before its decay does (the learning rate never comes down to the end of it)"
    fix = f"num_stable_steps {after - decay:g}" if after >= decay else f"num_stable_steps + num_decay_steps = {after}"
    raise ConfigError(
        f"lr_scheduler_type warmup_stable_decay with lr_scheduler_kwargs {phases}, and the run has {total} "
        f"({warmup} of warm-up): it would {what}: give {fix} (the phases then add up to the run's steps), or remove "
        "num_stable_steps (the stable phase is then what is left; the run's steps: --dry-run)"
    )


def check_steps(steps: dict, max_steps: int = -1, made_of: str | None = None) -> None:
    """A run whose every optimizer step has learning rate 0 (or that has none) would be saved as if it had trained:
    transformers' schedules give step 1 the rate 0 whenever there is warmup. Checked on the data set's rows when it
    loads, then on the pairs training keeps once they are tokenized (`made_of` says which)."""
    total, warmup = steps.get("total_steps"), steps.get("warmup_steps") or 0
    if total is None:
        return
    made_of = made_of or plural(steps.get("dataset_rows"), "row")
    if total == 1 and warmup >= 1 and max_steps == 1:  # "--max_steps N" is no advice to one who asked for one step
        raise ConfigError(
            "--max_steps 1 with warmup trains nothing (a warmup's first step runs at learning rate 0): add "
            "--warmup_steps 0 to train that step at the full learning rate, or pass --max_steps 2 or more"
        )
    if total == 0 or (total == 1 and warmup >= 1):
        raise ConfigError(
            f"this run would train nothing: {plural(total, 'optimizer step')}, {warmup} of warmup (learning rate 0 at "
            f"step 1) from {made_of} at {plural(steps.get('pairs_per_step'), 'pair')} per step: use more data, "
            "a smaller per_device_train_batch_size / pairs_per_step, more num_train_epochs, or --max_steps N (2 or "
            "more; or --warmup_steps 0 for one step at the full learning rate)"
        )
    if warmup >= total:  # the schedule's peak is at step `warmup`: a run that ends first never trains at its rate
        raise ConfigError(
            f"warmup_steps makes {warmup} warm-up steps of the run's {total}: the learning rate would never reach "
            "the one set; pass a smaller --warmup_steps (a float < 1 is a share of the run, the recipes' 0.1)"
        )

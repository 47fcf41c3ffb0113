"""The run's plan: every step of every epoch the run touches, cut into each rank's micro-batches (`plan.py`), made while
the trainer is built, right after TRL has tokenized the training set, and before the reference stage (which scores the
pairs the plan's steps train): a step that cannot be cut is refused before the reference is scored.
"""

import math
from dataclasses import dataclass

import numpy as np

from dpotrain.cluster import collectives
from dpotrain.data import cuts
from dpotrain.data.pair_lengths import PairLengths, token_counts
from dpotrain.plan import plan
from dpotrain.recipe.errors import plural
from dpotrain.recipe.run_record import Spread, epochs_text

# The steps planned at start at most, by whole epochs: far past any recipe's run (the OLMo 3 recipes train ~1,170-2,030)
PLANNED_AHEAD = 20_000


@dataclass(frozen=True)
class RunPlan:
    lengths: PairLengths
    step_plan: plan.StepPlan
    epochs: list  # every epoch the run touches: [epoch][step][rank][micro-batch] -> pair indices
    summary: dict  # `plan.summary`: what the run records as `derived.batching`
    trained: np.ndarray  # the pairs the run's steps train (`plan.pairs_trained`): what the reference stage scores
    asked_epochs: float | None = None  # num_train_epochs, where it decides the steps (not max_steps): `epochs_text`

    def line(self) -> str:
        """'Plan: 24 steps of 8 pairs per epoch (3 epochs planned), 1-2 micro-batches per step per rank, ...'."""
        s, batches = self.summary, lambda n, kind="": plural(n, f"{kind}micro-batch", many=f"{kind}micro-batches")
        fillers = f", {batches(s['filler_micro_batches'], 'filler ')}" if s["filler_micro_batches"] else ""
        steps = len(self.epochs[0])
        # The epochs the run's steps make (`--num_train_epochs 0.5`: 0.5), not the whole ones cut into steps so far
        epochs = epochs_text(s.get("epochs_trained", len(self.epochs)), self.asked_epochs, " planned")  # 0.5, 3...
        # what the steps take (an epoch's last step: what is left), where the summary has it; else the setting
        taken = Spread.of(s.get("pairs_per_step_trained") or self.step_plan.pairs_per_step)
        pairs = plural(taken.min, "pair") if taken.min == taken.max else f"{taken} pairs"
        return (
            f"Plan: {plural(steps, 'step')} of {pairs} per epoch ({epochs}), "
            f"{batches(Spread.of(s['micro_batches_per_step']))} per step per rank{fillers}, "
            f"{s['padding_share']:.1%} padding ({s['forward']})"
        )


def check_kept_steps(
    max_length_cuts: dict, steps: int, args, pairs: int, pairs_per_step: int, per_epoch: int | None = None
) -> None:
    """The steps of the pairs training keeps, checked again where max_length dropped some (`make`); `per_epoch`: the
    steps of an epoch of them, where known."""
    if max_length_cuts.get("dropped"):
        kept = {"total_steps": steps, "warmup_steps": args.get_warmup_steps(steps), "pairs_per_step": pairs_per_step}
        plan.check_steps(kept, args.max_steps, f"the {pairs} pairs training keeps")
        plan.check_schedule_fits(kept, args)  # warmup_stable_decay's phases, against the steps the run now has
        plan.check_eval_delay(kept, args, per_epoch)  # eval_delay, against the steps the run now has


def _planned_steps(lengths: PairLengths, step_plan: plan.StepPlan, epochs: int, args, max_length_cuts: dict):
    """The epochs' plan (`plan.plan_run`: a `PlanError` where a step cannot be cut) and the steps the Trainer runs:
    max_steps, or num_train_epochs of the epoch's steps (as transformers counts them). Fewer pairs than the rows the
    data stage counted its steps on (keep_start drops those whose prompt fills max_length): fewer steps, maybe all of
    them warm-up, checked again."""
    planned = plan.plan_run(lengths, step_plan, epochs)
    steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * len(planned[0]))
    check_kept_steps(max_length_cuts, steps, args, len(lengths), step_plan.pairs_per_step, len(planned[0]))
    return planned, steps


def make(
    lengths: PairLengths,
    args,
    pairs_per_step: int,
    world_size: int,
    budget: int | None,
    forward: plan.RowLayout,
    reduce_per_backward: bool = True,
    *,
    max_length_cuts: dict,
) -> RunPlan:
    """The run's plan from its pairs' lengths and the training arguments, at start and in a dry run; a
    `plan.PlanError` (with the budget that would do) when a step cannot be cut. `max_length_cuts` (`cuts.count`): the
    pairs cut or dropped at max_length, recorded with the plan. `forward`: how a micro-batch is laid out (padded or
    packed rows), which decides both how steps are cut and the positions the summary counts."""
    # The pairs' order: `data_seed` when given (transformers' seed of the data samplers, which this plan replaces),
    # else `seed`, as the Trainer's sampler would take it.
    seed = args.seed if args.data_seed is None else args.data_seed
    per_micro_batch = None if budget else args.per_device_train_batch_size
    step_plan = plan.StepPlan(pairs_per_step, world_size, seed, budget, per_micro_batch, forward.padded, forward)
    epochs = plan.epochs_needed(args.max_steps, args.num_train_epochs, len(lengths), pairs_per_step, world_size)
    # Every epoch is planned now: a step that cannot be cut is refused before the model does any work. Up to the
    # epochs that hold PLANNED_AHEAD steps: a max_steps of many epochs more (--max_steps 1000000000000) planned every
    # one of them, ~30 s per 100,000 steps, before the dry run answered; the sampler plans a later epoch as it starts.
    per_epoch = len(plan.steps_of(range(len(lengths)), pairs_per_step, world_size))
    epochs = min(epochs, max(1, math.ceil(PLANNED_AHEAD / per_epoch)))
    # Every rank plans and checks its own lengths (its copy of the data) inside one gather (`collectives.every_rank`),
    # whatever it found: a rank refused alone is said once, and no rank waits in a collective the others skipped.
    planned, steps = collectives.every_rank(_planned_steps, lengths, step_plan, epochs, args, max_length_cuts)
    trained = plan.pairs_trained(planned, steps)
    summary = plan.summary(lengths, step_plan, planned, forward, reduce_per_backward, steps)
    summary["pairs_trained"] = {"pairs": len(trained), "of": len(lengths), "steps": steps}
    # The epochs those steps make: max_steps past an epoch's steps trains more than num_train_epochs says (the card)
    summary["epochs_trained"] = round(steps / len(planned[0]), 3)
    summary["max_length_cuts"] = max_length_cuts
    asked = args.num_train_epochs if args.max_steps <= 0 else None
    return RunPlan(lengths, step_plan, planned, summary, trained, asked)


def for_trainer(trainer) -> RunPlan:
    """The plan of the trainer's tokenized training set, for the forward decided. Every rank plans alone, from the same
    lengths and seed (`agreement.check` finds the plans equal)."""
    args = trainer.args
    counts = token_counts(trainer.train_dataset)
    lengths = PairLengths.from_parts(*counts, args.max_length, trainer.forward.share_prompt, args.truncation_mode)
    # Pairs TRL cut or dropped at max_length: counted on the tokenized set, recorded with the plan (derived.batching).
    dropped = trainer.rows_given - len(trainer.train_dataset)
    counted = cuts.count(*counts, args.max_length, args.truncation_mode, dropped)
    run_plan = make(
        lengths,
        args,
        trainer.pairs_per_step,
        trainer.data_parallel_size,
        trainer.max_tokens_per_microbatch,
        forward=trainer.plan_forward(),
        reduce_per_backward=trainer.is_deepspeed_enabled,
        max_length_cuts=counted,
    )
    if trainer.accelerator.is_main_process:
        print(run_plan.line(), flush=True)
        print(f"Cut at {cuts.line(counted)}", flush=True)
    return run_plan

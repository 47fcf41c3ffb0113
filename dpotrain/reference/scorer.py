"""What the reference stage needs of the trainer, in one object: `ReferenceScorer(trainer)`. The trainer
(`RecipeDPOTrainer`) is passed in, not imported: the train stage comes after this one.
"""

import contextlib
import dataclasses
import functools

import torch

from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import choice, packing
from dpotrain.plan import layers
from dpotrain.plan.memory import forward_only_multiple
from dpotrain.recipe import upstream


class ReferenceScorer:
    def __init__(self, trainer):
        self._trainer = trainer  # what changes while the stage runs: its models, data sets and collator
        self.accelerator, self.args, self.engine = trainer.accelerator, trainer.args, trainer.engine
        self.forward, self.packed, self.ld_alpha = trainer.forward, trainer.packed, trainer.ld_alpha
        self.rank, self.world = trainer.data_parallel_rank, trainer.data_parallel_size
        self.weights_hash = trainer.weights_hash  # the full weights, also under ZeRO-3 (the trainer hashes them)
        self.max_tokens_per_microbatch = trainer.max_tokens_per_microbatch
        self.planned_multiple = trainer.reference_multiple
        self.every_rank = choice.needs_every_rank(trainer.engine, trainer.forward)

    @property
    def policy(self):
        """The model trained (its weights before the first update are the reference's, unless a reference is given)."""
        return self._trainer.model

    def lengths(self, dataset) -> PairLengths:
        return PairLengths.of(dataset, self.args.max_length, self.forward.share_prompt, self.args.truncation_mode)

    def budget(self) -> tuple[int | None, int | None]:
        """A reference micro-batch's token budget (positions), or its pair count when training has no budget:
        training's times `memory.forward_only_multiple` (a forward keeps no activations for a backward)."""
        args, budget = self.args, self.max_tokens_per_microbatch
        tokens = budget or args.per_device_train_batch_size * 2 * (args.max_length or 0)
        if not tokens:  # no max_length and no budget: nothing bounds a pair, so nothing to scale
            return None, args.per_device_train_batch_size
        # The memory plan's, decided on its own (traced) parts: formulas for them here gave a padded LoRA run with a
        # token budget (7B, every layer checkpointed) a micro-batch past what the plan held. Formulas without a plan.
        multiple = self.planned_multiple or self._formula_multiple(tokens)
        if budget is not None:
            return budget * multiple, None
        return None, args.per_device_train_batch_size * multiple

    def _formula_multiple(self, tokens: int) -> int:
        args, f = self.args, self.forward
        width = min(tokens, 2 * args.max_length) if self.packed and args.max_length else args.max_length or tokens
        # every k-th layer checkpointed keeps the others' activations: less room for a forward than all checkpointed
        checkpointing, config = layers.checkpointed_every(args) or False, packing.causal_lm(self.policy).config
        return forward_only_multiple(config, tokens, width, f.attention, checkpointing, f.sequence_parallel)

    def model(self):
        """The model that scores the reference (`RecipeDPOTrainer.reference_model`)."""
        return self._trainer.reference_model()

    @functools.cached_property
    def collator(self):
        """Training's collator; where its balanced rows keep within training's budget (`packing.positions_cap`), these
        keep within the stage's larger one."""
        collator, (budget, _) = self._trainer.data_collator, self.budget()
        if getattr(collator, "max_positions", None) is None or budget is None:
            return collator
        return dataclasses.replace(collator, max_positions=budget)

    def layout(self):
        """How the stage's collator lays out a micro-batch (`plan.RowLayout`), for the stage's cut."""
        return self._trainer.plan_forward(self.collator)

    def collate(self, rows: list[dict]) -> dict:
        """One reference micro-batch, collated on the host (the stage's prefetch thread calls it)."""
        return self.collator(rows)

    def log_probs(self, model, batch: dict):
        """Summed reference log-probs of the chosen and rejected completions of one collated micro-batch, with TRL's
        `compute_ref_log_probs` (adapter disabled for PEFT, no grad, autocast, LD-DPO) around the training forward."""
        device = self.accelerator.device
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        stand_in, padded_batch = choice.stand_in(model, batch, every_rank=self.every_rank)
        return self._trainer.compute_ref_log_probs(stand_in, padded_batch)

    @contextlib.contextmanager
    def context(self):
        """Around the whole reference stage: no autograd (inference mode; plain no_grad when the engine shards the
        weights, whose gathered parameters are trained with afterwards), and activation checkpointing left as it is:
        TRL's `compute_ref_log_probs` would re-enable it around every micro-batch with TRL's default arguments (all
        layers, not the run's choice)."""
        leave_alone = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
        with upstream.patched(upstream.DISABLE_CHECKPOINTING, leave_alone):
            with torch.no_grad() if self.engine.shards_weights else torch.inference_mode():
                yield

    def finish(self) -> None:
        """After the reference stage. FSDP2 leaves the root's weights gathered after a forward: reshard them, or
        accelerate's optimizer preparation, which pairs parameters by storage, misses them: their updates lost."""
        if self._trainer.is_fsdp_enabled:
            reshard(self._trainer.model)


def reshard(model) -> None:
    """Every FSDP2 unit of `model` resharded (after a forward outside training: its root and LM head stay gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()

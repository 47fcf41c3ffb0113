"""What the reference stage needs of the trainer, in one object: `ReferenceScorer(trainer)`.

The stage (reference.py) scores every pair with the training forward, in micro-batches of its own, before training.
From the trainer it needs only this:
- who scores what: the data-parallel rank and size, the pairs' lengths and the stage's budget (`lengths`, `budget`),
  from which reference.py cuts its micro-batches;
- what the cache key holds of the run (`policy`, `weights_hash`, `ld_alpha`, the forward);
- the model that scores (`model`), how a micro-batch is collated (`collate`) and scored (`log_probs`: TRL's own
  reference code around the training forward), what surrounds the whole stage (`context`), and what the engine needs
  once it is done (`finish`).

The trainer is passed in, not imported: the train stage comes after this one (tests/test_layout.py). It is the
project's `RecipeDPOTrainer`, built with its plan (for the training set's lengths).
"""

import contextlib

import torch

from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import choice, packing
from dpotrain.plan import layers
from dpotrain.plan.memory import forward_only_multiple
from dpotrain.recipe import upstream


class ReferenceScorer:
    def __init__(self, trainer):
        self._trainer = trainer  # what changes while the stage runs: its models, data sets and collator
        self.accelerator = trainer.accelerator
        self.args = trainer.args
        self.engine = trainer.engine
        self.forward = trainer.forward
        self.packed = trainer.packed
        self.rank, self.world = trainer.data_parallel_rank, trainer.data_parallel_size
        self.weights_hash = trainer.weights_hash  # the full weights, also under ZeRO-3 (the trainer hashes them)
        self.ld_alpha = trainer.ld_alpha
        self.max_tokens_per_microbatch = trainer.max_tokens_per_microbatch
        self.every_rank = choice.needs_every_rank(trainer.engine, trainer.forward)

    @property
    def policy(self):
        """The model trained (its weights before the first update are the reference's, unless a reference is given)."""
        return self._trainer.model

    # --- the stage's micro-batches (reference.py cuts them) ---------------------------------------------------------
    def lengths(self, dataset) -> PairLengths:
        """The token lengths of the pairs the stage scores (of the training set, the plan's), from Arrow offsets."""
        args = self.args
        return PairLengths.of(dataset, args.max_length, self.forward.share_prompt, args.truncation_mode)

    def budget(self) -> tuple[int | None, int | None]:
        """A reference micro-batch's token budget (positions, as the plan counts them), or its pair count when
        training has no budget: training's times `memory.forward_only_multiple`, the forward-only micro-batch that
        takes the memory the plan gives a training micro-batch (a forward keeps no activations for a backward)."""
        args, budget = self.args, self.max_tokens_per_microbatch
        tokens = budget or args.per_device_train_batch_size * 2 * (args.max_length or 0)
        if not tokens:  # no max_length and no budget: nothing bounds a pair, so nothing to scale
            return None, args.per_device_train_batch_size
        width = min(tokens, 2 * args.max_length) if self.packed and args.max_length else args.max_length or tokens
        # every k-th layer checkpointed keeps the others' activations: less room for a forward than all checkpointed
        checkpointing = layers.checkpointed_every(args) or False
        multiple = forward_only_multiple(
            packing.causal_lm(self.policy).config,
            tokens,
            width,
            self.forward.attention,
            checkpointing,
            self.forward.sequence_parallel,
        )
        if budget is not None:
            return budget * multiple, None
        return None, args.per_device_train_batch_size * multiple

    # --- scoring ----------------------------------------------------------------------------------------------------
    def model(self):
        """The model that scores the reference (`RecipeDPOTrainer.reference_model`)."""
        return self._trainer.reference_model()

    def collate(self, rows: list[dict]) -> dict:
        """One reference micro-batch, collated on the host (the stage's prefetch thread calls it)."""
        return self._trainer.data_collator(rows)

    def log_probs(self, model, batch: dict):
        """Summed reference log-probs of the chosen and rejected completions of one collated micro-batch, on the
        device, with the training forward: TRL's `compute_ref_log_probs` (adapter disabled for PEFT, no grad, autocast,
        LD-DPO), the packed forward standing in for the model call when training packs."""
        batch = {
            k: v.to(self.accelerator.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
        }
        stand_in, padded_batch = choice.stand_in(model, batch, every_rank=self.every_rank)
        return self._trainer.compute_ref_log_probs(stand_in, padded_batch)

    @contextlib.contextmanager
    def context(self):
        """Around the whole reference stage: no autograd at all (inference mode; plain no_grad when the engine shards
        the weights, whose gathered parameters, allocated inside, are trained with afterwards), and activation
        checkpointing left as it is. The scorer is in eval mode, where transformers' layers never checkpoint; TRL's
        `compute_ref_log_probs` would turn checkpointing off and on around every micro-batch, re-enabled with TRL's
        default arguments (a walk over every module each time, and a per-run choice of which layers checkpoint
        replaced by all of them)."""
        leave_alone = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
        with upstream.patched("trl.trainer.dpo_trainer:disable_gradient_checkpointing", leave_alone):
            with torch.no_grad() if self.engine.shards_weights else torch.inference_mode():
                yield

    def finish(self) -> None:
        """After the reference stage. FSDP2 leaves the root's weights gathered after a forward (it reshards only
        inner units): reshard them, or accelerate's optimizer preparation, which pairs parameters by storage, misses
        them and their updates are lost."""
        if self._trainer.is_fsdp_enabled:
            from torch.distributed.fsdp import FSDPModule

            for module in self._trainer.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

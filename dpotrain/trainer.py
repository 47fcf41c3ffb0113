"""The seam between TRL and this project: one `DPOTrainer` subclass, configured from a recipe, with our callbacks.

Everything DPO-specific (tokenization, the loss and its variants, LD-DPO, the reference under PEFT) stays TRL's. The
subclass changes how a micro-batch reaches TRL's loss code, and what surrounds it:
- the forward is packed (`packing.py`): TRL's `_compute_loss` runs on the padded view of a packed micro-batch, with
  `packing.PackedModel` answering its model call;
- micro-batches follow `batching.py` (a token budget, a fixed number of pairs per optimizer step), and each
  micro-batch's loss is weighed by its share of the step's pairs, so a step's loss and gradient are the mean over
  its pairs whatever the micro-batching (`compute_loss`, `get_batch_samples`);
- reference log-probs are scored once with the same packed forward and cached (`reference.py`);
- metrics are sums and counts reduced once per log (`pair_metrics.py`), since ranks hold different numbers of pairs.
`padding_free: false` keeps TRL's padded forward (same loss weighting and metrics), for comparison.
"""

import contextlib
import math

import torch
from transformers import TrainerCallback
from trl import DPOTrainer, get_peft_config, get_quantization_config
from trl.models import prepare_deepspeed

from . import batching, builtin, packing, reference
from .checkpoints import CompleteMarker
from .collectives import all_reduce_sum
from .config import Recipe
from .errors import ConfigError
from .health import HealthGuard
from .metrics import MetricsRecorder
from .pair_metrics import PairMetrics
from .preemption import GracefulStop
from .samples import SampleGenerator


def model_init_kwargs(recipe: Recipe) -> dict:
    """What TRL's own `trl/scripts/dpo.py` passes to `from_pretrained`, from ModelConfig's fields."""
    kwargs = dict(
        revision=recipe.model.model_revision,
        attn_implementation=recipe.model.attn_implementation,
        dtype=recipe.model.dtype,
    )
    kwargs.update(recipe.training.model_init_kwargs or {})
    return kwargs


def resolve_model_path(recipe: Recipe) -> str:
    name = recipe.model.model_name_or_path
    return builtin.materialize_model(name) if builtin.is_builtin(name) else name


def decide_packing(recipe: Recipe, model_path: str) -> tuple[bool, int]:
    """Packed or padded forward for this model and recipe: a one-line note when packing is off by necessity, an
    error when it was asked for explicitly and cannot be honoured. Reads the model's config only (no weights).
    Returns the decision and the model's hidden size (packed rows weigh attention against linear layers with it)."""
    from transformers import AutoConfig

    t = recipe.training
    config = AutoConfig.from_pretrained(model_path, revision=recipe.model.model_revision)
    hidden_size = getattr(config.get_text_config(), "hidden_size", 4096)
    if not t.padding_free:
        return False, hidden_size
    config._attn_implementation = recipe.model.attn_implementation or "sdpa"  # transformers' default
    problem = packing.packing_problem(config)
    if problem is None and t.sync_ref_model:
        problem = "sync_ref_model updates the reference during training, so it cannot be scored once and cached"
    if problem is None and "precompute_ref_log_probs" in recipe.given and not t.precompute_ref_log_probs:
        problem = "the packed path scores the reference once before training (precompute_ref_log_probs: true)"
    if problem is None:
        t.precompute_ref_log_probs = True  # the reference cache: only the policy stays in memory
        return True, hidden_size
    if "padding_free" in recipe.given:
        raise ConfigError(f"padding_free (packed sequences) cannot be used here: {problem}; set --padding_free false")
    if recipe.project.max_tokens_per_microbatch is not None:
        raise ConfigError(
            f"max_tokens_per_microbatch needs packed sequences, which cannot be used here: {problem}; remove "
            "max_tokens_per_microbatch (micro-batches of per_device_train_batch_size pairs)"
        )
    print(f"Note: padded batches (TRL's forward), not packed sequences: {problem}.", flush=True)
    t.padding_free = False
    return False, hidden_size


def pairs_in(batch: dict) -> int:
    return len(batch["seq_lens"]) // 2 if packing.is_packed(batch) else batch["input_ids"].shape[0] // 2


class _Recording:
    """Stands in for the model in TRL's padded path only to keep its outputs for `PairMetrics`."""

    def __init__(self, model):
        self.model = model
        self.outputs = None

    def __call__(self, **kwargs):
        self.outputs = self.model(**kwargs)
        return self.outputs


class _LocalGathers:
    """The accelerator as TRL's metric code sees it inside `_compute_loss`: gathers stay on this rank.

    TRL gathers per-pair tensors across ranks on every micro-batch; ranks with different pair counts would hang
    there. Its metrics are discarded anyway (`RecipeDPOTrainer.log` logs `PairMetrics`' exact reductions instead).
    """

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


class _StartMetrics(TrainerCallback):
    def __init__(self, metrics: PairMetrics):
        self.metrics = metrics

    def on_train_begin(self, args, state, control, **kwargs):
        self.metrics.start(state.log_history)  # after a resume, log_history is the checkpoint's


class RecipeDPOTrainer(DPOTrainer):
    def __init__(
        self,
        *args,
        packed: bool,
        pairs_per_step: int,
        max_tokens_per_microbatch: int | None,
        attn_implementation: str | None,
        hidden_size: int,
        **kwargs,
    ):
        self.packed = packed
        self.pairs_per_step = pairs_per_step
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.batch_plan: batching.BatchPlan | None = None
        self.train_costs = None
        self.pair_metrics = PairMetrics()
        training_args = kwargs["args"]
        training_args.padding_free = False  # TRL 1.16 warns "temporarily unavailable" and pads; we pack
        # The reference is scored with this same collator, so its rows are laid out as training's.
        self.packed_collator = packing.PackedPreferenceCollator(
            training_args.max_length,
            training_args.truncation_mode,
            one_row=packing.one_row(attn_implementation or "sdpa"),
            hidden_size=hidden_size,
        )
        if packed:
            kwargs["data_collator"] = self.packed_collator
        super().__init__(*args, **kwargs)
        training_args.padding_free = packed  # the records say what ran
        # compute_loss weighs each micro-batch by its share of the step's pairs; the Trainer must not divide the
        # loss by the accumulation steps again.
        self.loss_is_scaled_for_ga = True
        self.add_callback(_StartMetrics(self.pair_metrics))

    # --- data: tokenized by TRL, then planned into micro-batches --------------------------------------------
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if dataset_name == "train" and self.packed:
            # Runs inside TRL's __init__, before transformers creates the accelerator and fills DeepSpeed's
            # "auto" values: the micro-batch count per step must be known by then.
            self.train_costs = reference.pair_costs(dataset, args.max_length)
            self.batch_plan = batching.plan(
                self.train_costs,
                self.pairs_per_step,
                args.world_size,
                args.seed,
                epochs_needed(args, len(dataset), self.pairs_per_step),
                self.max_tokens_per_microbatch,
                args.per_device_train_batch_size,
            )
            args.gradient_accumulation_steps = self.batch_plan.micro_batches
        return dataset

    def _get_train_sampler(self, train_dataset=None):
        if self.batch_plan is None:
            return super()._get_train_sampler(train_dataset)
        return batching.TokenBudgetSampler(self.train_costs, self.batch_plan, self.args.seed, self.args.process_index)

    def batching_summary(self) -> dict:
        """How micro-batches are made, for the run's records: this rank's first epoch under the plan."""
        summary = {"forward": "packed" if self.packed else "padded (TRL)",
                   "micro_batches_per_step": self.args.gradient_accumulation_steps}  # fmt: skip
        if self.batch_plan is None:
            return summary | {"pairs_per_micro_batch": self.args.per_device_train_batch_size}
        micro_batches = list(
            batching.epoch_micro_batches(self.train_costs, self.batch_plan, self.args.seed, 0, self.args.process_index)
        )
        pairs = [len(mb) for mb in micro_batches]
        tokens = [int(self.train_costs[mb].sum()) for mb in micro_batches]
        return summary | {
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
            "pairs_per_step": self.pairs_per_step,
            "pairs_per_micro_batch": {"min": min(pairs), "mean": round(sum(pairs) / len(pairs), 2), "max": max(pairs)},
            "tokens_per_micro_batch": {
                "min": min(tokens),
                "mean": round(sum(tokens) / len(tokens)),
                "max": max(tokens),
            },
            "padding_share": 0.0,
        }

    # --- reference log-probs: once, packed, cached ------------------------------------------------------------
    def _precompute_ref_logps(self, dataset, name, batch_size):
        if not self.packed:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        return reference.add_reference_logps(self, dataset, name, self.first_micro_batches(name, len(dataset)))

    def first_micro_batches(self, name: str, rows: int) -> list[list[list[int]]]:
        """Every rank's micro-batches as training first meets them: the batch plan's epoch 0 for the training set;
        for an evaluation set, the eval loader's consecutive batches dealt round-robin to the ranks."""
        world = self.accelerator.num_processes
        if name == "train" and self.batch_plan is not None:
            return [
                list(batching.epoch_micro_batches(self.train_costs, self.batch_plan, self.args.seed, 0, rank))
                for rank in range(world)
            ]
        size = self.args.per_device_eval_batch_size
        chunks = [list(range(i, min(i + size, rows))) for i in range(0, rows, size)]
        return [chunks[rank::world] for rank in range(world)]

    def reference_scorer(self):
        """The model that scores the reference: TRL's choice in `_precompute_ref_logps` (under DeepSpeed, an
        inference engine places the still-unprepared policy on the device)."""
        if self.ref_model is not None:
            return self.ref_model
        if self.is_deepspeed_enabled:
            if self._precompute_engine is None:
                self._precompute_engine = prepare_deepspeed(self.model, self.accelerator)
            return self._precompute_engine
        return self.model

    # --- the loss ---------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, and the number of pairs in the whole step over all ranks."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return batches, all_reduce_sum(torch.tensor(sum(pairs_in(b) for b in batches), device=device))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs)  # TRL: the mean over this micro-batch
        if num_items_in_batch is None:  # evaluation: no gradient, nothing to weigh
            return result
        # Gradients are averaged over ranks; summed over micro-batches. This weight makes the step's gradient
        # the mean over all of its pairs: sum_k (mean_k x n_k x W / N) / W = sum over pairs / N.
        weight = pairs_in(inputs) * self.accelerator.num_processes / num_items_in_batch
        if return_outputs:
            return result[0] * weight, result[1]
        return result * weight

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        if packing.is_packed(inputs):
            stand_in, padded = packing.PackedModel(model, inputs), packing.padded_view(inputs)
        else:
            stand_in, padded = _Recording(model), inputs
            if "ref_chosen_logps" not in inputs:  # TRL's own reference forward, run first so metrics see it
                ref = self.ref_model if self.ref_model is not None else self.model
                chosen, rejected = self.compute_ref_log_probs(ref, inputs)
                padded = {**inputs, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
        with self._reference_in_inputs():
            result = super()._compute_loss(stand_in, padded, return_outputs)
        self.pair_metrics.add(
            mode,
            stand_in.outputs,
            padded,
            padded["ref_chosen_logps"],
            padded["ref_rejected_logps"],
            self.beta,
            self.ld_alpha,
            positions=inputs["input_ids"].numel(),
        )
        return result

    @contextlib.contextmanager
    def _reference_in_inputs(self):
        """TRL's `_compute_loss` reads the reference from the inputs, and its gathers stay local (see
        `_LocalGathers`), for the duration of one call."""
        saved = self.precompute_ref_logps, self.accelerator
        self.precompute_ref_logps, self.accelerator = True, _LocalGathers(self.accelerator)
        try:
            yield
        finally:
            self.precompute_ref_logps, self.accelerator = saved

    def log(self, logs, start_time=None):
        mode = "train" if self.model.training else "eval"
        self._metrics[mode].clear()  # TRL's per-rank, per-micro-batch values: replaced by exact means
        for name, value in self.pair_metrics.reduce(mode, self.accelerator.device).items():
            self._metrics[mode][name].append(value)
        super().log(logs, start_time)


def epochs_needed(args, rows: int, pairs_per_step: int) -> int:
    """Epochs the run will touch (the batch plan covers each): num_train_epochs, or what max_steps reaches."""
    if args.max_steps > 0:
        return max(1, math.ceil(args.max_steps / max(1, rows // pairs_per_step)))
    return max(1, math.ceil(args.num_train_epochs))


def build_trainer(recipe: Recipe, train_dataset, eval_dataset=None, callbacks=()):
    """The project's DPO trainer, with: COMPLETE marks on checkpoints, metrics.jsonl, a clean stop on Slurm's
    signals, health guards and sample generations. `trainer.graceful_stop.stopped` tells after `train()` whether it
    ended early to be requeued; `trainer.health.stop` whether a guard stopped it."""
    t, p = recipe.training, recipe.project
    t.model_init_kwargs = model_init_kwargs(recipe)
    # The arguments set up the process group (with their ddp_backend) when first asked for their device; until then
    # `world_size` reads 1.
    world = t.world_size if t.device is not None else 1
    model_path = resolve_model_path(recipe)
    packed, hidden_size = decide_packing(recipe, model_path)
    graceful_stop = GracefulStop.from_env()
    health = HealthGuard(recipe.project) if recipe.project.health_checks else None
    # Order matters: GracefulStop.on_save reports a checkpoint only after CompleteMarker has marked it.
    trainer = RecipeDPOTrainer(
        model=model_path,
        args=t,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        callbacks=[CompleteMarker(), MetricsRecorder(), graceful_stop, *([health] if health else []), *callbacks],
        # LoRA (--use_peft): TRL wraps the model and scores the reference with the adapter disabled (no second model).
        peft_config=get_peft_config(recipe.model),
        quantization_config=get_quantization_config(recipe.model),  # --load_in_4bit/8bit, as TRL's own dpo.py
        packed=packed,
        pairs_per_step=p.pairs_per_step or t.per_device_train_batch_size * t.gradient_accumulation_steps * world,
        max_tokens_per_microbatch=p.max_tokens_per_microbatch,
        attn_implementation=recipe.model.attn_implementation,
        hidden_size=hidden_size,
    )
    trainer.graceful_stop = graceful_stop
    trainer.health = health  # .stop tells after `train()` whether a guard stopped it (dpotrain/health.py)
    if recipe.project.samples_every > 0:
        trainer.add_callback(SampleGenerator.from_recipe(recipe, trainer.train_dataset, trainer.processing_class))
    return trainer

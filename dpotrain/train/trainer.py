"""The seam between TRL and this project: one `DPOTrainer` subclass, configured from a recipe, with our callbacks.

Everything DPO-specific (tokenization, the loss and its variants, LD-DPO, the reference under PEFT) stays TRL's. The
subclass changes how pairs reach TRL's loss code, and what surrounds it:
- steps follow the plan (`plan_stage.py`): the dataloader yields one item per optimizer step, this rank's micro-batches,
  which `training_step` runs with the accumulation boundary on the last: the Trainer counts optimizer steps;
- each micro-batch's loss is weighed by its share of the step's pairs (`compute_loss`, `get_batch_samples`);
- the forward is packed (`packing.py`): TRL's `_compute_loss` runs on the padded view, `packing.PackedModel` answering
  its model call; models that cannot pack get TRL's padded collator, on the same plan;
- reference log-probs are scored in a stage of their own before training (`reference.py`), with the same forward;
- metrics are sums and counts reduced once per log (`pair_metrics.py`), since ranks hold different numbers of pairs.
"""

import contextlib
import functools
import json
import math
import os
import shutil
import time
import types
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.trainer_utils import seed_worker
from trl import DPOTrainer

from dpotrain.cluster import collectives, engine
from dpotrain.cluster import sequence_parallel as groups
from dpotrain.cluster.collectives import all_reduce_sum, max_over_ranks
from dpotrain.data import builtin, stops, turns
from dpotrain.data.pair_lengths import pair_columns
from dpotrain.forwards import choice, flops, packing, padded, sequence_parallel
from dpotrain.forwards.choice import ForwardChoice
from dpotrain.plan import layers, plan, plan_stage
from dpotrain.recipe import run_record, upstream, writes
from dpotrain.recipe.config import Recipe, replaced
from dpotrain.recipe.errors import ConfigError, RunError
from dpotrain.recipe.writes import quiet_progress_bars, readable_weights
from dpotrain.reference.scorer import ReferenceScorer
from dpotrain.train import (
    disk_full,
    dropout,
    lora,
    losses,
    moved_reference,
    resume,
    run_files,
    samples,
    unused_parameters,
)
from dpotrain.train.checkpoints import CompleteMarker, clear_for_save, step_of
from dpotrain.train.health import HealthGuard
from dpotrain.train.memory_use import MemoryUse
from dpotrain.train.metrics import MetricsRecorder, read_metrics
from dpotrain.train.pair_metrics import PairMetrics
from dpotrain.train.preemption import GracefulStop, StoppedBeforeTraining, loader_worker
from dpotrain.train.step_log import StepLog
from dpotrain.train.weight_names import config_fields, refusal

# What TRL's hash in its __init__ returns for a LoRA run (its trainer's __init__): a key is taken after, never this one
LORA_HASH_DEFERRED = "not taken: a LoRA run keys its reference by its base weights"
# What TRL's `_prepare_dataset` reads of the run's arguments (trl 1.16): all it is given of them (`_prepare_dataset`)
TRL_PREPARE_READS = ("dataset_num_proc", "max_length", "truncation_mode")
MODEL_SAVE = ".model_save"  # inside a checkpoint: its model is written here, then moved into it (`save_model`)
# transformers' end-of-training figures that are 0 where the attempt trained no step (RecipeDPOTrainer.log)
UNTRAINED_SUMMARY = ("train_loss", "train_samples_per_second", "train_steps_per_second")


def training_arguments(run: Recipe):
    """What TRL and transformers see (a new `DPOConfig`, so their checks run) where it differs from the recipe:
    gradient_accumulation_steps 1 (a step's micro-batches run inside `training_step`, before transformers fills
    DeepSpeed's "auto" batch sizes); padding_free off (TRL 1.16 warns "temporarily unavailable" and pads; this project
    packs with its own collator); push_to_hub off and no hub_token (hub.take_push_settings); model_init_kwargs as
    `trl/scripts/dpo.py` builds them from ModelConfig (`RunSpec.as_run`), the recipe's own on top."""
    m = run.model
    init = dict(revision=m.model_revision, attn_implementation=m.attn_implementation, dtype=m.dtype)
    init |= run.training.model_init_kwargs or {}
    trl_only = dict(gradient_accumulation_steps=1, padding_free=False, push_to_hub=False, hub_token=None)
    return replaced(run, training={**trl_only, "model_init_kwargs": init}).training


def resolve_model_path(recipe: Recipe) -> str:
    name = recipe.model.model_name_or_path
    return builtin.materialize_model(name) if builtin.is_builtin(name) else name


@contextlib.contextmanager
def whole_weights_only():
    """TRL's model loads refused where the weights lack some of the model's tensors, which transformers starts at random
    after a table in the log (a DDP state dict's `module.` names: every tensor). Entered before the wrapping (PEFT) and
    the reference stage, which would score a partly random model. Each rank's load judged, the first refusal raised on
    every rank; the dry run refuses them from their files' names (`weight_names.check`)."""

    def checked(model_id, *args, **kwargs):
        model, info = load(model_id, *args, **kwargs, output_loading_info=True)
        zero3 = is_deepspeed_zero3_enabled()
        overrides = config_fields(kwargs)  # the model_init_kwargs TRL passes on
        collectives.every_rank_outcome(refusal(model_id, model, info, zero3, kwargs.get("revision"), overrides))
        return model

    with upstream.patched(upstream.CREATE_MODEL, checked) as load:
        yield


@functools.cache
def _answering_num_experts(config_class: type) -> type:
    """`config_class` that also answers to `num_experts` (see `trl_compatible_config`), a module-level name here so
    that the config still pickles."""
    name = f"_{config_class.__name__}"
    # The field itself: a map is read once, so `num_experts` mapped to a name the map holds too (DeepSeek V4's
    # num_local_experts, its n_routed_experts) was an AttributeError all the same
    field = config_class.attribute_map.get("num_local_experts", "num_local_experts")
    attribute_map = {**config_class.attribute_map, "num_experts": field}
    alias = type(name, (config_class,), {"attribute_map": attribute_map, "__module__": __name__, "__qualname__": name})
    globals()[name] = alias
    return alias


def trl_compatible_config(model) -> None:
    """TRL 1.16's fused LM head reads `config.num_experts` for the MoE auxiliary loss (trl/trainer/utils.py,
    `_fused_forward`); GraniteMoe (Shared, SWA, Hybrid), PhiMoE and Llama 4 call it `num_local_experts`
    (an AttributeError at the first step): the config answers to both, its saved config.json unchanged. Drop this once
    TRL reads `num_local_experts` as well."""
    config = packing.causal_lm(model).config.get_text_config()
    if hasattr(config, "num_local_experts") and not hasattr(config, "num_experts"):
        config.__class__ = _answering_num_experts(type(config))


def sequence_lengths(batch: dict) -> torch.Tensor:
    """The real tokens of each sequence of a micro-batch, packed or padded."""
    return batch["seq_lens"] if packing.is_packed(batch) else batch["attention_mask"].sum(dim=1)


def shared_prefixes(batch: dict) -> torch.Tensor | None:
    """Per shared pair, the prompt tokens computed once instead of twice (all but its last: shared_prompt.py)."""
    if "seq_offsets" not in batch:
        return None
    shared = batch["seq_offsets"] > 0
    return batch["seq_jumps"][shared] - 1


def computed_tokens(batch: dict) -> int:
    """The real tokens the forward computed: every sequence's, a shared prompt's once."""
    shared = shared_prefixes(batch)
    return int(sequence_lengths(batch).sum()) - (0 if shared is None else int(shared.sum()))


def pairs_in(batch: dict) -> int:
    """The pairs a micro-batch trains on: none in a filler (`plan.FILLER`), whose rows only keep collectives equal."""
    if batch.get(plan.FILLER):
        return 0
    return len(batch["seq_lens"]) // 2 if packing.is_packed(batch) else batch["input_ids"].shape[0] // 2


def _batch_columns(dataset):
    """The columns the collators read: the pair's tokens and, once the reference stage scored them, its reference's."""
    columns = (*pair_columns(dataset), *packing.REFERENCE_KEYS)
    return dataset.select_columns([c for c in columns if c in dataset.column_names])


def epoch_evaluation_owed(checkpoint: str, args) -> bool:
    """Whether the resumed `checkpoint` ended an epoch whose evaluation (eval_strategy epoch) it lacks: a stop at an
    epoch's last step saves and leaves the epoch's evaluation out to end in time (`CompleteMarker.on_epoch_end`), and
    the resume starts at the next epoch, so that epoch was never evaluated (metrics.jsonl went from epoch 1's training
    to epoch 2's evaluation). Then the resumed run evaluates at its start, at the checkpoint's step, where
    eval_on_start would (`OwedEvaluation`)."""
    if args.eval_strategy != "epoch":
        return False
    state = json.loads((Path(checkpoint) / resume.STATE_FILE).read_text())
    epoch, step = state.get("epoch") or 0, state.get("global_step")
    # transformers' state.epoch is whole exactly at an epoch's last step (epoch + steps / steps_in_epoch)
    if not float(epoch).is_integer() or epoch < max(args.eval_delay or 0, 1):
        return False
    evaluated = [r for r in state.get("log_history", []) if "eval_loss" in r and r.get("step") == step]
    # A save_steps checkpoint at an epoch's end is written before the epoch's evaluation, which metrics.jsonl then holds
    return not evaluated and not any("eval_loss" in r and r["step"] == step for r in read_metrics(args.output_dir))


ADAPTER_CARD = "README.md"  # PEFT's save_pretrained writes an adapter's model card under this name


def moved_up(folder: Path) -> tuple[str, ...]:
    """What a save wrote in `folder`, moved into the folder above it; the names of the model's files: all but the
    Trainer's pickle of its arguments (training_args.bin) and PEFT's model card of an adapter, whose `base_model` (a
    local base's path) the Hub refuses in a branch's commit (transformers#33922; the run's own card goes to main)."""
    # `writes.looked`: unanswered (ESTALE), raised; on 3.14 is_dir() said none, the weights left in the subfolder, and
    # the sealed checkpoint named no model files (never pushed) nor held them where a resume loads them
    names = sorted(e.name for e in folder.iterdir()) if writes.is_dir(folder) else []
    for name in names:
        os.replace(folder / name, folder.parent / name)
    if writes.is_dir(folder):
        folder.rmdir()
    return tuple(n for n in names if n not in (TRAINING_ARGS_NAME, ADAPTER_CARD))


class OwedEvaluation(TrainerCallback):
    """The evaluation a resumed checkpoint owes (`epoch_evaluation_owed`), made where transformers makes eval_on_start's
    (`_inner_training_loop`): after every callback's on_train_begin, before the first epoch begins, at the checkpoint's
    step, by the trainer's `evaluate` (its record logged, to metrics.jsonl and W&B, as any evaluation's)."""

    def __init__(self, evaluate):
        self.evaluate = evaluate

    def on_train_begin(self, args, state, control, **kwargs):
        self.evaluate()


class RecipeDPOTrainer(DPOTrainer):
    """Built ready by `train_stage.build_run`: its plan made in `__init__` once TRL tokenized the training set."""

    def __init__(
        self,
        *args,
        forward: ForwardChoice,
        pairs_per_step: int,
        max_tokens_per_microbatch: int | None,
        gpu_peak_tflops: float | None,
        run_engine: engine.Engine,
        stop: GracefulStop,
        health: HealthGuard | None = None,
        planned_gib: float | None = None,
        reference_multiple: int | None = None,
        assistant_turns: str = "final",
        compile_layers: bool = False,
        callbacks=(),
        resume_from: str | None = None,
        **kwargs,
    ):
        self.engine, self.forward, self.packed = run_engine, forward, forward.packed
        self.assistant_turns = assistant_turns  # read by `_prepare_dataset`, which TRL's __init__ calls
        self.pairs_per_step, self.max_tokens_per_microbatch = pairs_per_step, max_tokens_per_microbatch
        self.reference_multiple = reference_multiple  # the memory plan's (`ReferenceScorer.budget`)
        self.graceful_stop = stop  # .stopped tells after `train()` whether it ended early to be requeued
        self.health = health  # .stop tells after `train()` whether a guard stopped it (dpotrain/train/health.py)
        self.model_path = kwargs["model"]  # the base weights on disk (a built-in one materialized): the LoRA merge
        self.rows_given = len(kwargs["train_dataset"])  # before TRL dropped pairs whose prompt fills max_length
        training_args = kwargs["args"]  # `training_arguments`: one item per optimizer step, TRL's padding off
        if self.packed:
            kwargs["data_collator"] = choice.collator(forward, training_args, max_tokens_per_microbatch)
        # Order matters: GracefulStop.on_save reports a checkpoint only after CompleteMarker has marked it.
        self.complete_marker = CompleteMarker(resume_from)  # the agreed resume point (spec.output.resume_from)
        kwargs["callbacks"] = [self.complete_marker, MetricsRecorder(), stop, *([health] if health else [])]
        # A LoRA start keys its reference by the base weights (`_weights_hash`): TRL's hash in its __init__, of base and
        # adapter, a second pass over every weight (minutes for a 32B model), is not taken (`earlier_lora_hash`)
        deferred = upstream.patched(upstream.TRL_HASH, lambda module: LORA_HASH_DEFERRED)
        # Distributed before TRL maps the data: on a CPU-only node accelerate's state says "not distributed" until the
        # accelerator is made, and the main-first order of TRL's maps held no rank back; now that the maps' caches are
        # shared (`_prepare_dataset`), the ranks raced to write the same cache files.
        engine.enable_on_cpu(self.engine)
        with whole_weights_only(), self._no_second_model_under_fsdp(kwargs), lora.without_peft_deprecation():
            with deferred if kwargs.get("peft_config") is not None else contextlib.nullcontext():
                super().__init__(*args, **kwargs)  # loads the model, tokenizes the data sets
        for model in (self.model, self.ref_model):
            if model is not None:
                trl_compatible_config(model)
                if training_args.disable_dropout:
                    dropout.disable(model)
        if self.packed:  # TRL sets the pad token only where it builds its own (padded) collator
            self._set_pad_token(training_args.pad_token)
        else:  # TRL's padded collator, its rows run in groups of similar length (padded.py)
            self.data_collator = padded.GroupedCollator(self.data_collator)
        self.weights_hash = self._weights_hash()
        # DeepSeek V4's compressor, which a micro-batch shorter than its blocks leaves out (unused_parameters.py)
        self.unused = unused_parameters.left_out_by_a_short_forward(
            self.model, self.engine, self.accelerator.num_processes
        )
        self._reference_engine = None  # the DeepSpeed engine that scores the reference (`reference_model`)
        self.loss_is_scaled_for_ga = True  # compute_loss weighs each micro-batch by its share of the step's pairs
        self.sft = losses.SftOverStep(training_args)  # TRL's SFT term, over the whole step (losses.py)
        # The step's pairs and chosen completion tokens on all ranks (`get_batch_samples`), for the SFT term
        self._step_pairs = self._step_chosen_tokens = None
        self.model_flops = flops.ModelFlops.of(self.model)
        self.pair_metrics = PairMetrics(self.accelerator.num_processes, flops.peak_tflops(gpu_peak_tflops))
        self.complete_marker.spent = self.pair_metrics.exclude  # a checkpoint's save is no training time
        if health is not None:
            health.watch(self.accelerator)  # which tells a step fp16's loss scaler skipped
        self.memory_use = MemoryUse(planned_gib, self.accelerator.device)
        # Every step cut into micro-batches from the lengths TRL just tokenized; refused here, before the reference
        self.run_plan = plan_stage.for_trainer(self)
        self.layers_record = self._set_up_layers(compile_layers)
        if self.packed and self.model.config.model_type in packing.BOUNDARY_HYBRIDS:
            self.check_packing()
        # One readable line per logging step (step_log.py), not the Trainer's progress bar or dictionary.
        self.remove_callback(ProgressCallback)
        self.remove_callback(PrinterCallback)
        # then the run's optional features (train_stage.build_run), one module each
        for callback in (self.pair_metrics, self.memory_use, StepLog(), *callbacks):
            self.add_callback(callback)
            if hasattr(callback, "attach"):  # one that reads the built trainer (samples.SampleGenerator)
                callback.attach(self)

    def _weights_hash(self) -> str | None:
        """The reference cache's key: the hash of the weights the reference scores (TRL's, under ZeRO-3, is of each
        rank's empty partition), on the main process (TRL's on every rank). None with a live reference."""
        trl_hash = upstream.weights_hash(self)  # None with a live reference: no cache, nothing to compare
        zero3, main = self.engine.name == "zero3", self.accelerator.is_main_process
        if trl_hash and getattr(self.model, "peft_config", None):
            # LoRA: the reference is the base with the adapter off; TRL's hash takes the adapter's random weights too.
            # On every rank that loaded its own copy, as TRL's is: the ranks compare them (agreement.values).
            return engine.weights_sha256(self.model, main or self.engine.loads_on_every_rank, zero3, base=True)
        return engine.weights_sha256(self.model, main, zero3=True) if zero3 and trl_hash else trl_hash

    def earlier_lora_hash(self) -> str | None:
        """LoRA: the key a run recorded before session 41 took (TRL's hash of base and initial adapter), on the main
        process; None for a full fine-tune. Taken on demand by a resume whose record holds another hash, before
        training changes the adapter; every rank calls it (under ZeRO-3 it gathers the weights)."""
        if not getattr(self.model, "peft_config", None):
            return None
        return engine.weights_sha256(self.model, self.accelerator.is_main_process, zero3=self.engine.name == "zero3")

    def _set_up_layers(self, compile_layers: bool) -> dict:
        """Sequence parallelism's groups (Ulysses around the attention), the memory plan's checkpointed layers held
        against TRL's re-enabling of all of them, the optional compile; the decoder layers as trained (layers.py)."""
        sequence_parallel.set_up(self.forward.sequence_parallel, self.model)
        layers.hold_checkpointing(self.model, self.args)
        compiled = layers.compile_layers(self.model) if compile_layers else 0
        checkpointed, decoder_layers = layers.checkpointed(self.model), len(layers.decoder_layers(self.model))
        return {"checkpointed": checkpointed, "compiled": compiled, "decoder_layers": decoder_layers}

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL's tokenization; with `assistant_turns: all`, each prompt's labeled tokens too (data/turns.py)."""
        # TRL's filter of fully truncated pairs is a lambda holding `args`, which datasets hashes whole into the name of
        # its cache: output_dir and run_name made each run's filter, and every map after it (the turns' labels, the
        # reference's), new, their caches never reused and piling up. Given the fields it reads, a run reuses them.
        read = types.SimpleNamespace(**{name: getattr(args, name) for name in TRL_PREPARE_READS})
        with self._stoppable_maps(args):
            dataset = super()._prepare_dataset(dataset, processing_class, read, dataset_name)
        self._stop_point(args)
        if self.assistant_turns != "all":
            return dataset
        with self._stoppable_maps(args), collectives.in_turns(args.device):  # as TRL's own map, the main process first
            dataset = turns.add_prompt_labels(dataset, upstream.trl_tokenizer(self), args.dataset_num_proc)
        self._stop_point(args)
        return dataset

    @contextlib.contextmanager
    def _stoppable_maps(self, args):
        """The maps over every pair in the block (TRL's tokenization, the turns' labels), stopped mid-map by the run's
        stop (`stops.stoppable`, each map's function `stops.looking`): a stop waited for each whole map, minutes on a
        large data set, past a Slurm GraceTime. Every rank then takes the stop point (`collectives.in_turns` raises on
        every rank alike); a cut map caches nothing (datasets removes its temporary file), and the same command goes
        on. Not once training began (TRL maps a data set given to `evaluate` then)."""
        stop = self.graceful_stop
        if stop.training_begun:
            yield
            return
        in_turns = functools.partial(collectives.in_turns, args.device)
        try:
            with (
                stops.stoppable(lambda: collectives.stop_heard_on_any_rank(stop.asked_here(new_only=True))),
                upstream.maps_in_turns(in_turns, stops.looking),
            ):
                yield
        except stops.PassStopped:
            self._stop_point(args)  # the stop agreed on and said, on every rank
            raise

    def _stop_point(self, args) -> None:
        """A stop asked as TRL loaded the model or tokenized the pairs waited for every map (minutes on a large data
        set, past a Slurm GraceTime), to be acted on at the reference stage's first micro-batch. Now each map's end,
        its main-first order over, is a stop point every rank reaches alike: the run stops before its first step. Not
        once training began (TRL maps a data set given to `evaluate` then)."""
        stop = self.graceful_stop
        before = resume.before_step(self.complete_marker.resume_from, stop.reference_only)
        if not stop.training_begun and stop.stop_before_training(args.device, before):
            raise StoppedBeforeTraining

    def create_accelerator_and_postprocess(self):
        engine.enable_on_cpu(self.engine)  # FSDP2 and DDP on a CPU-only node: see engine.py
        with engine.fsdp_units(self.engine, self.model):  # the decoder layers the model has (TRL loaded it)
            super().create_accelerator_and_postprocess()

    @contextlib.contextmanager
    def _no_second_model_under_fsdp(self, kwargs):
        """Under FSDP, TRL loads a second copy of the model for its precompute of the reference (trl/trainer/
        dpo_trainer.py: "the policy isn't sharded until `train`"). The reference stage scores with the policy, so that
        load (minutes and a full host copy for a 32B model) is skipped. Drop this when TRL stops loading it (#6470)."""
        alone = kwargs.get("peft_config") is None and kwargs.get("ref_model") is None
        if not (self.engine.name == "fsdp2" and kwargs["args"].precompute_ref_log_probs and alone):
            yield
            return
        calls = []

        def policy_only(*args, **kw):  # the first call loads the policy, the second the reference copy
            calls.append(args)
            return load(*args, **kw) if len(calls) == 1 else None

        with upstream.patched(upstream.CREATE_MODEL, policy_only) as load:
            yield

    def save_model(self, output_dir=None, _internal_call=False):
        """The final model under FSDP2, as a plain HF folder: every rank gathers the full state dict, the main process
        writes it (transformers writes no weights with SHARDED_STATE_DICT, kept by checkpoints: `_internal_call`)."""
        # generation_config.json saved as it loaded (its pad, BOS and EOS ids aligned): a config changed since must
        # pass transformers' strict check, which `temperature` without do_sample (SFT exports) failed at a checkpoint.
        upstream.saved_as_loaded(self.model.generation_config)
        # A checkpoint's model is written in a folder of its own, then moved in: the names it wrote are its model's
        # (its Hub branch holds them), not another rank's file written meanwhile (its RNG state).
        target = Path(output_dir or self.args.output_dir)
        written = target / MODEL_SAVE if _internal_call else target
        try:
            with quiet_progress_bars():  # "Writing model shards", a bar of one item per shard, at every checkpoint
                if self.is_fsdp_enabled and not _internal_call:
                    state_dict = self.accelerator.get_state_dict(self.model)  # every rank gathers
                    with engine.own_class(self.model):
                        upstream.save_weights(self, output_dir, state_dict)
                else:
                    super().save_model(str(written), _internal_call)
            if self.args.should_save:
                if _internal_call:
                    self.complete_marker.model = moved_up(written)
                readable_weights(target)
        except Exception as e:  # the final model is written in a folder inside the run's (publish.py): named by it
            why = None if _internal_call else disk_full.why_full(e, Path(self.args.output_dir))
            if why is None:  # inside a checkpoint: `_save_checkpoint` says it
                raise
            raise disk_full.final_save_failed(Path(self.args.output_dir), why) from None

    def create_model_card(self, *args, **kwargs):
        """Not TRL's card ("fine-tuned version of [None]") at every checkpoint: hub.py writes one as the run ends."""

    def _save_checkpoint(self, model, trial):
        start = time.monotonic()
        folder = Path(upstream.checkpoint_parent(self, trial)) / f"checkpoint-{self.state.global_step}"

        def cleared() -> None:
            clear_for_save(folder.parent, self.state.global_step)
            # The run's by name, before its first file: --overwrite_output_dir removes it and no other checkpoint-*
            run_files.claim(folder.parent, [folder.name])

        # The main process's turn, the others waiting; its refusal (a full disk) is every rank's.
        collectives.main_outcome(cleared)
        failed, cut_short = None, False
        try:
            self._write_checkpoint(model, trial, folder)
        except collectives.REFUSED as e:  # a full disk: one line naming the folder and space, not "basic_ios::clear"
            why = disk_full.why_full(e, folder.parent)
            failed = disk_full.checkpoint_write(e, folder) if why is None else disk_full.save_failed(folder, why)
            cut_short = why is not None and self.is_world_process_zero()
        # A rank that failed alone (under DDP the main writes the weights) ended while the others waited in
        # `on_save`'s barrier: one all-gather per checkpoint, the first failure every rank's line.
        try:
            collectives.every_rank_outcome(failed)
        finally:
            # Removed once every rank is done writing (under ZeRO-3 the others write their RNG states after it)
            if cut_short:
                shutil.rmtree(folder, ignore_errors=True)
                # On the disk that was full this write may fail too: the save's own line goes first
                with contextlib.suppress(OSError):
                    run_files.disown(folder.parent, [folder.name])
        # Reported once the checkpoint is hashed and marked (CompleteMarker): the time a stop has to leave for it.
        self.complete_marker.save_started = start

    def _write_checkpoint(self, model, trial, folder: Path) -> None:
        """transformers' checkpoint, TR-DPO's moved reference and the run's record, in `folder` (cleared). Every rank
        runs each collective part to its end, whatever was refused on it before (`HeldWrites`): else, under ZeRO-3, the
        others waited in DeepSpeed's barriers while the main process waited in `every_rank_outcome`."""
        held = collectives.HeldWrites()
        # Held: the weights (`save_model`: under ZeRO-3 gathered, then written by the main process) and DeepSpeed's own
        # writes, which a collective follows
        weights = upstream.attributes_set(self, save_model=functools.partial(held.run, self.save_model))
        deepspeeds = upstream.deepspeed_writes_held(self.model_wrapped, held.run) if self.is_deepspeed_enabled else None
        with weights, deepspeeds or contextlib.nullcontext():
            # transformers rotates at the end of this call, before the COMPLETE mark: CompleteMarker rotates after it
            with upstream.patched(upstream.ROTATION, lambda **_: None):
                held.run(super()._save_checkpoint, model, trial)
        if self.args.sync_ref_model:
            # TR-DPO's moved reference, for a resume; every rank (gathered under ZeRO-3 and FSDP2)
            held.run(moved_reference.save, self, folder / resume.REFERENCE_FILE)
            if self.is_world_process_zero():
                held.run(readable_weights, folder)  # safetensors writes it 0600: unreadable to the group
        held.raise_first()
        record = folder.parent / run_record.RESOLVED
        if self.is_world_process_zero() and record.is_file():
            # The settings a resume must keep travel with the checkpoint, in its manifest (resolve.trained_under).
            shutil.copy2(record, folder / record.name)

    def _determine_best_metric(self, metrics, trial):
        """Under save_strategy best transformers saves at an evaluation only at a new best, over the save a stop asked
        for (a stop request's, `GracefulStop`; a health guard's): the run stopped with no checkpoint of its last steps,
        though its last line named one. Under `best` only a stop asks for a save, so one asked is kept; none is made of
        the non-finite state a health guard stopped on, even at a new best."""
        new_best = super()._determine_best_metric(metrics, trial)
        if self.health is not None and self.health.stop is not None and self.health.stop.fatal:
            return False
        return new_best or self.control.should_save

    def _load_optimizer_and_scheduler(self, checkpoint):
        """The optimizer's state, and TR-DPO's moved reference. Here, not in `_load_from_checkpoint` (one process and
        DDP only): transformers calls this on a resume under every engine, the model prepared, before the first step."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not self.args.sync_ref_model:
            return
        path = Path(checkpoint) / resume.REFERENCE_FILE
        if not path.is_file():  # an older checkpoint `resume.confirm` fell back to may lack it: never skipped
            raise RunError(resume.no_reference(checkpoint))
        moved_reference.load(self, path)  # every rank: its whole copy, or its shard under ZeRO-3 and FSDP2

    def _set_pad_token(self, pad_token: str | None) -> None:
        """The recipe's `pad_token` on the saved tokenizer and the model's configs, as TRL sets it for the padded
        collator packed runs replace (stages.check_pad_token checked it against the vocabulary)."""
        if not pad_token:
            return
        tokenizer = upstream.trl_tokenizer(self)
        tokenizer.pad_token = pad_token
        self.model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model.generation_config.pad_token_id = tokenizer.pad_token_id

    def _run_epoch(self, *args, **kwargs):
        """transformers checks `max_steps` only after a step: resumed from a checkpoint of the last step, it would
        train a step past max_steps."""
        if self.state.global_step >= self.state.max_steps > 0:
            self.control.should_training_stop = True
            return
        # The epoch's steps set here: a resumed epoch's loader (skip_first_batches) holds a BatchSamplerShard without
        # set_epoch on more than one process, and trained epoch 0's steps again in place of the resumed epoch's.
        sampler = kwargs["train_dataloader"]
        while sampler is not None and not isinstance(sampler, plan.StepSampler):
            sampler = getattr(sampler, "batch_sampler", None)
        if sampler is not None:
            sampler.set_epoch(kwargs["epoch"])
        super()._run_epoch(*args, **kwargs)

    @property
    def data_parallel_size(self) -> int:
        """The processes that read their own pairs: a group of `sequence_parallel` processes shares one micro-batch."""
        return groups.data_parallel_size(self.accelerator.num_processes, self.forward.sequence_parallel)

    @property
    def data_parallel_rank(self) -> int:
        """This process's share of the data: its group's."""
        return groups.data_parallel_rank(self.args.process_index, self.forward.sequence_parallel)

    def plan_forward(self, collator=None) -> plan.RowLayout:
        """How this trainer's collator (or the reference stage's, `collator`) lays out a micro-batch, for the plan's
        cut and the positions its summary counts."""
        if not self.packed:  # TRL's own collator
            return plan.RowLayout("padded")
        c = collator or self.data_collator
        return plan.RowLayout.of(True, c.one_row, c.hidden_size, c.pad_to_multiple_of, c.max_length, c.max_positions)

    def get_train_dataloader(self):
        """One item per optimizer step (`plan.StepSampler`), collated per micro-batch with the forward's collator."""
        run_plan = self.run_plan
        sampler = plan.StepSampler(run_plan.lengths, run_plan.step_plan, self.data_parallel_rank, run_plan.epochs)
        rows = plan.StepRows(_batch_columns(self.train_dataset))
        return self._rank_aware_loader(rows, sampler, plan.StepCollator(self.data_collator), training=True)

    def evaluate(self, *args, **kwargs):
        """TRL's evaluation, its time kept out of the next log's tokens_per_second and MFU (as samples')."""
        start = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.pair_metrics.exclude(time.perf_counter() - start)

    def get_eval_dataloader(self, eval_dataset=None):
        """The evaluation set in `plan.eval_batches`: the same number of batches on every rank, no pair counted twice.
        Each batch is read as a step of one micro-batch: a rank's empty batch (a pair fewer than another rank's) is a
        filler of its first pair, whose metrics are not counted (`_compute_loss`); read as it was, an empty batch was
        a traceback at the first evaluation (per_device_eval_batch_size 1, 13 held-out pairs on 2 processes)."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        # Within the positions the reference stage's forward holds (training's budget x the plan's forward-only
        # multiple): evaluation is the same forward without gradients, as docs/memory.md plans it.
        scorer = ReferenceScorer(self)
        budget, _ = scorer.budget() if self.max_tokens_per_microbatch else (None, None)
        lengths, layout = (scorer.lengths(dataset), self.plan_forward()) if budget else (None, None)
        size = self.args.per_device_eval_batch_size
        batches = plan.eval_batches(
            len(dataset), self.data_parallel_size, size, lambda pairs: layout.positions(lengths, pairs), budget
        )
        batches = batches[self.data_parallel_rank]
        rows = plan.StepRows(_batch_columns(dataset), stand_in=batches[0][0])
        sampler = plan.FixedBatches([[(tuple(batch),)] for batch in batches])
        return self._rank_aware_loader(rows, sampler, plan.BatchCollator(self.data_collator))

    def _rank_aware_loader(self, dataset, sampler, collate, training: bool = False):
        """A DataLoader over a batch sampler that already yields this rank's share, prepared by accelerate (device
        placement) without being sharded again (as transformers' `_get_dataloader` does for a BatchRebalanceSampler)."""
        args, workers = self.args, self.args.dataloader_num_workers
        seeded = functools.partial(seed_worker, num_workers=workers, rank=args.process_index) if training else None
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            # Pinned memory only helps copies to a GPU; without one torch warns at every training start.
            pin_memory=args.dataloader_pin_memory and self.args.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            worker_init_fn=functools.partial(loader_worker, then=seeded),  # stop signals are the trainer's
        )
        loader = self.accelerator.prepare(loader)
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    # --- one optimizer step: its micro-batches, the accumulation boundary on the last -------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        micro_batches = inputs["micro_batches"]
        total = 0.0
        for i, micro_batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DeepSpeed (its boundary from accelerate) and FSDP2 reduce at every backward, DDP only at the last
            # micro-batch (`Engine.defers_gradient_sync`: what each holds in between).
            upstream.set_sync_gradients(self.accelerator, last)
            defer = not last and self.engine.defers_gradient_sync
            with self.accelerator.no_sync(model) if defer else contextlib.nullcontext():
                total = total + super().training_step(model, micro_batch, num_items_in_batch)
        return total

    def _prepare_inputs(self, inputs):
        """A micro-batch on the device as transformers moves it, the reference's sums kept float32: DeepSpeed casts
        inputs to the engine's dtype, and in bf16 a sum of -3,111.24 nats becomes -3,104 while the policy's sums stay
        float32: step 1's rewards would not be 0 (the step-1 guard)."""
        kept = {key: inputs[key] for key in packing.REFERENCE_KEYS if key in inputs}
        prepared = super()._prepare_inputs({key: value for key, value in inputs.items() if key not in kept})
        return {**prepared, **{key: value.to(self.args.device) for key, value in kept.items()}}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step and its pairs over all ranks (with an SFT term, its chosen tokens too: `losses.SftOverStep`)."""
        steps, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        micro_batches = [mb for step in steps for mb in step["micro_batches"] if pairs_in(mb)]
        pairs = sum(pairs_in(mb) for mb in micro_batches)
        # the chosen tokens as TRL counts them, in its padded layout (a packed micro-batch's padded view)
        padded_views = (packing.padded_view(mb) if packing.is_packed(mb) else mb for mb in micro_batches)
        tokens = sum(int(losses.chosen_tokens(mb)) for mb in padded_views) if self.sft.active else 0
        totals = all_reduce_sum(torch.tensor([pairs, tokens], device=device))
        self._step_pairs, self._step_chosen_tokens = totals[0], totals[1]
        return steps, totals[0]

    def floating_point_ops(self, inputs):
        count = super().floating_point_ops
        if "micro_batches" in inputs:  # a filler's forward is not training: not counted
            return sum(count(mb) for mb in inputs["micro_batches"] if not mb.get(plan.FILLER))
        return count(inputs)

    # --- reference log-probs: a stage of its own (reference.py), the ready run's first verb ------------------------
    def _precompute_ref_logps(self, dataset, name, batch_size):
        return dataset  # deferred: the reference stage scores every pair (dpotrain/reference/reference.py)

    def reference_model(self):
        """The model that scores the reference: a reference model if given; else the policy before its first update,
        under DeepSpeed in an inference engine made once (as TRL's `_precompute_ref_logps`), under FSDP2 sharded by
        accelerate now, as training will use it (the Trainer finds it prepared)."""
        if self.ref_model is not None:
            return self.ref_model
        if self.is_deepspeed_enabled:
            if self._reference_engine is None:
                from trl.models import prepare_deepspeed

                self._reference_engine = prepare_deepspeed(self.model, self.accelerator)
            return self._reference_engine
        if self.is_fsdp_enabled:
            from accelerate.utils.fsdp_utils import fsdp2_prepare_model

            self.model = self.model_wrapped = fsdp2_prepare_model(self.accelerator, self.model)
        return self.model

    def train(self, *args, **kwargs):
        """Training, once the reference's ZeRO-3 inference engine has forgotten the order it fetched weights in: it
        hooks the same modules as training's, whose first forward would fail on its recorded pass ("pop from an empty
        deque")."""
        if self._reference_engine is not None:
            samples.leave_for_training(None, self._reference_engine.optimizer)
        # The checkpoint checked again, on every rank, before transformers reads any of it (its trainer_state.json, then
        # DeepSpeed's or FSDP's load, then the optimizer's): it skips a missing optimizer.pt in silence, DeepSpeed falls
        # back to the weights alone with a warning, and a folder deleted whole ended in their tracebacks
        if isinstance(checkpoint := kwargs.get("resume_from_checkpoint"), str):
            collectives.every_rank(resume.check_state_left, checkpoint)
        # Decided by the main process, which writes metrics.jsonl, for every rank: an evaluation is collectives, and a
        # rank whose node reads the output folder otherwise (a copy, a lagging file system) would skip them alone.
        owed = isinstance(checkpoint, str) and collectives.main_outcome(epoch_evaluation_owed, checkpoint, self.args)
        # Made by a callback of this call, not by setting eval_on_start: the arguments stay the recipe's, and so does
        # every checkpoint's training_args.bin (eval_on_start already asked evaluates there once)
        owed_evaluation = None
        if owed and not self.args.eval_on_start:
            ignore_keys = kwargs.get("ignore_keys_for_eval")
            owed_evaluation = OwedEvaluation(functools.partial(self.evaluate, ignore_keys=ignore_keys))
            self.add_callback(owed_evaluation)  # the last: every other callback has begun (metrics trimmed, W&B on)
        try:
            # transformers' final rotation (save_total_limit 1, a best checkpoint) deletes every `checkpoint-*` folder
            # but the best, a person's checkpoint-4.bak/ and the run's newest too: the run's own (CompleteMarker)
            # replaces it.
            with upstream.patched(upstream.FINAL_ROTATION, lambda *_, **__: []):
                return super().train(*args, **kwargs)
        finally:
            if owed_evaluation is not None:
                self.remove_callback(owed_evaluation)

    def use_reference(self, name: str, scored) -> None:
        """The reference stage's data set `name` ("train" or "eval"), scored, in place of the tokenized one."""
        setattr(self, f"{name}_dataset", scored)

    # --- hybrids whose kernels take sequence boundaries: packed as decided, once their model and pairs agree ---------
    def check_packing(self) -> None:
        """Score the longest pairs in packed rows and each sequence alone (`packing.parity`); past the tolerance, stop
        with the fix, on every rank alike. A check only: the forward decided is never changed here."""
        tokens = self.run_plan.lengths.tokens  # it runs while the trainer is built, once its plan is made
        examples = [self.train_dataset[int(i)] for i in np.argsort(-tokens, kind="stable")[:4]]
        model = self.reference_model()
        half = self.args.bf16 or self.args.fp16 or next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        tolerance = packing.PARITY_TOLERANCE["half" if half else "fp32"]
        try:
            with torch.no_grad(), self.accelerator.autocast():
                diff = packing.parity(model, self.data_collator, examples)
            problem = (
                f"its packed rows score completion tokens up to {diff:.2g} nats away from the same sequences alone "
                f"(tolerance {tolerance:g}): its layers carry state across packed sequences here"
                if diff > tolerance
                else None
            )
        except ValueError as e:  # transformers: the kernel that keeps packed sequences apart is not installed
            problem = str(e).rstrip(".")
        if max_over_ranks(int(problem is not None), self.accelerator.device):
            problem = problem or "another process's packed rows differ from its sequences alone"
            raise ConfigError(
                f"padding_free (packed sequences) cannot be used here: {problem}; set --padding_free false"
            )

    # --- the loss ---------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs)  # TRL: the mean over this micro-batch
        if num_items_in_batch is None:  # evaluation: no gradient, nothing to weigh
            return result
        # Averaged over ranks, summed over micro-batches: the step's gradient is the mean over its pairs,
        # sum_k (mean_k x n_k x W / N) / W (a filler: n_k = 0). A sequence-parallel group's S processes count each
        # pair (N x S) and their gather's backward sums S equal gradients: the S cancel.
        weight = pairs_in(inputs) * self.accelerator.num_processes / num_items_in_batch
        loss = unused_parameters.in_every_graph(result[0] if return_outputs else result, self.unused)
        return (loss * weight, result[1]) if return_outputs else loss * weight

    def _stand_in(self, model, batch: dict):
        """What answers TRL's model call, and TRL's padded view of the inputs (as `ReferenceScorer.log_probs`)."""
        return choice.stand_in(model, batch, every_rank=choice.needs_every_rank(self.engine, self.forward, model))

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        stand_in, view = self._stand_in(model, inputs)  # view: TRL's padded [2B, L] inputs
        if "ref_chosen_logps" not in view:  # a live reference model (TRL's forward), run first so metrics see it
            ref = self.ref_model if self.ref_model is not None else self.model
            # The policy with its adapter off (LoRA) is scored in training mode: every module of it out of it keeps
            # NEFTune's noise (transformers' hook reads the embeddings' `training`) and dropout kept on
            # (--disable_dropout false: 1.8-2.5 nats off at attention_dropout 0.3) off the reference, as the
            # reference stage and a reference model (both in eval mode) never get them; each put back as it was
            with contextlib.ExitStack() as scoring, lora.without_peft_deprecation():
                for module in self.accelerator.unwrap_model(ref).modules() if ref is self.model else ():
                    scoring.enter_context(upstream.attributes_set(module, training=False))
                chosen, rejected = self.compute_ref_log_probs(self._stand_in(ref, inputs)[0], view)
            view = {**view, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
        # TRL's `_compute_loss` reads the reference from the inputs, and in training leaves out its SFT term, added
        # below over the whole step. Its gathers stay on this rank: TRL gathers per-pair tensors on every micro-batch,
        # which hangs where ranks hold different pair counts; its metrics are replaced anyway (`log`).
        over_step = self.sft.active and mode == "train"  # evaluation keeps TRL's per-batch SFT term
        seams = dict(precompute_ref_logps=True)
        if over_step:
            seams.update(zip(("loss_types", "loss_weights"), self.sft.others, strict=True))
        local = dict.fromkeys(("gather", "gather_for_metrics"), lambda tensor: tensor)
        with upstream.attributes_set(self, **seams), upstream.attributes_set(self.accelerator, **local):
            result = super()._compute_loss(stand_in, view, return_outputs)
        if over_step:
            sft = self.sft.term(stand_in.outputs, view, pairs_in(inputs), self._step_pairs, self._step_chosen_tokens)
            result = (result[0] + sft, result[1]) if return_outputs else result + sft
        # MoE: TRL's loss holds router_aux_loss_coef x the router's load-balancing loss; the DPO loss without it is
        # logged beside the total (`dpo_loss`), and the health guards judge it.
        loss = result[0] if return_outputs else result
        router = self.router_aux_loss_coef * stand_in.outputs.aux_loss if self.aux_loss_enabled else None
        # A filler is no metric; a sequence-parallel group's pairs are counted once, by its lead.
        if inputs.get(plan.FILLER) or not sequence_parallel.leads_group():
            return result
        grouped = isinstance(stand_in, padded.GroupedModel)  # the positions the grouped padded forward ran
        flops = 0.0 if mode == "eval" else self.model_flops.training(sequence_lengths(inputs), shared_prefixes(inputs))
        self.pair_metrics.add(
            mode,
            stand_in.outputs,
            view,
            self.beta,
            self.ld_alpha,
            positions=stand_in.positions if grouped else inputs["input_ids"].numel(),
            computed_tokens=computed_tokens(inputs),
            loss=loss,
            model_flops=flops,
            dpo_loss=None if router is None else loss - router,
        )
        return result

    def log(self, logs, start_time=None):
        mode = "train" if self.model.training else "eval"
        trl_metrics = upstream.trl_metrics(self)[mode]
        trl_metrics.clear()  # TRL's per-rank, per-micro-batch values: replaced by exact means
        exact = self.pair_metrics.reduce(mode, self.accelerator.device)
        if mode == "train" and self.args.logging_nan_inf_filter and not math.isfinite(exact.get("loss", 0.0)):
            del exact["loss"]  # --logging_nan_inf_filter true asked for transformers' loss, its NaN steps left out
        for name, value in exact.items():
            trl_metrics[name].append(value)
        if mode == "train" and "loss" in logs:  # every rank logs: the peaks are one collective
            found = self.memory_use.measure()
            logs = {**logs, **found}
            self.memory_use.warn(found, self.accelerator.is_main_process)
        resumed = self.complete_marker.resume_from
        if "train_runtime" in logs and resumed and step_of(Path(resumed)) == self.state.global_step:
            # Resumed at its last step, the attempt trained nothing: transformers' summary holds train_loss 0.0 and 0
            # pairs/s, which W&B wrote over its run's summary of the attempts that trained (step_log says so instead)
            logs = {k: v for k, v in logs.items() if k not in UNTRAINED_SUMMARY}
        super().log(logs, start_time)

"""The seam: every private name of TRL, transformers, accelerate, datasets, torch (and argparse, tqdm, threading,
atexit) that this project touches, strings given to `getattr` and patch targets included.

A private name moves without a deprecation. Each is listed once (`SEAMS`: what it is, why it is used) and reached only
through this module's functions, so an upgrade that moves one fails by name, not inside a training step; after one:

    python -c "from dpotrain.recipe import upstream; upstream.check()"

Kinds of seam:
- `override`: a private method `RecipeDPOTrainer` overrides; its parameters must be the ones the override takes.
- `call`: a private function or method the project calls, with the parameters it passes.
- `read`: a private attribute or constant the project reads.
- `set`: an attribute an upstream private method reads from `self`, set around the call (named in that method's source).
- `patch`: a module-level name an upstream function looks up at call time, replaced for one call (`patched`).
- `source`: a phrase of upstream source that says what an API does not (`text`, in the symbol's source).
"""

import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Seam:
    symbol: str  # "package.module:Qualified.name"
    kind: str  # override, call, read, set, patch (module docstring)
    why: str  # what the project does with it, and where
    params: tuple[str, ...] = ()  # override / call: the parameters relied on, in order (self excluded)
    read_in: str = ""  # set: the upstream function ("module:Qualified.name") whose source must use the name
    text: str = ""  # source: the phrase the symbol's source must hold

    @property
    def name(self) -> str:
        """The name itself ("module:A._b" -> "_b"): what an accessor reads, sets or calls on an object it is given."""
        return self.symbol.rpartition(":")[2].rpartition(".")[2]


_LISTED: list[Seam] = []  # every seam, in the order its constructor below is called: SEAMS


def _of_kind(kind: str):
    def seam(symbol: str, why: str, params: tuple[str, ...] = (), **where) -> Seam:
        _LISTED.append(made := Seam(symbol, kind, why, params, **where))
        return made

    return seam


# One constructor per kind; accessors read the name from the Seam (`_value(TOKENIZE)`, `_member(trainer, TRL_METRICS)`):
# the name `check()` verifies is the one the code uses.
_override, _call, _read, _set, _patch, _source = map(_of_kind, ("override", "call", "read", "set", "patch", "source"))

DPO = "trl.trainer.dpo_trainer"
# transformers' models with mixed layer kinds take a dict of masks, one per kind; their forward says so in this phrase
MASK_PER_LAYER_KIND = "causal_mask_mapping := attention_mask, dict"
# a model whose attention hands learnable attention sinks to the attention function (gpt-oss, Granite SWA, ...)
ATTENTION_SINKS = "s_aux=self.sinks"
TRAINER = "transformers.trainer"
LOSS = f"{DPO}:DPOTrainer._compute_loss"  # where TRL reads the attributes set around it
C10D = "torch.distributed.distributed_c10d"
DEEPSPEED_TAG = "global_step{}"  # DeepSpeed's checkpoint tag without one given: the `latest` file names it
MEM = "torch.distributed._tools.mem_tracker"
PEAK_KEPT = "the global peak, kept by the memory plan's tracker as the stock one keeps it (mem_tracker)"
DATA_FILES = "_data_files"  # a `save_to_disk` split's state.json: its data files
LOADED_HASH = "_original_object_hash"  # a GenerationConfig's hash as loaded: changed since, it is saved strictly

# --- RecipeDPOTrainer's overrides of private methods (dpotrain/train/trainer.py) ----------------------------
_override(
    f"{DPO}:DPOTrainer._compute_loss",
    "the packed forward answers TRL's model call; the reference comes from the inputs; metrics reduced once a log",
    ("model", "inputs", "return_outputs"),
)
_override(
    f"{DPO}:DPOTrainer._precompute_ref_logps",
    "deferred: the reference stage (dpotrain/reference) scores every pair after the plan stage",
    ("dataset", "name", "batch_size"),
)
_override(
    f"{DPO}:DPOTrainer._prepare_dataset",
    "TRL's tokenization, then each prompt's labeled earlier turns with assistant_turns all (data/turns.py)",
    ("dataset", "processing_class", "args", "dataset_name"),
)
_override(
    f"{TRAINER}:Trainer._save_checkpoint",
    "the folder cleared first, rotation after the COMPLETE mark, a full disk in one line",
    ("model", "trial"),
)
_override(
    f"{TRAINER}:Trainer._determine_best_metric",
    "under save_strategy best, its answer is the save made at an evaluation: a stop's save is kept",
    ("metrics", "trial"),
)
_override(
    f"{TRAINER}:Trainer._load_optimizer_and_scheduler",
    "the optimizer as transformers loads it, then TR-DPO's moved reference the checkpoint holds (train/resume.py): "
    "the resume's one hook under every engine (`_load_from_checkpoint` is skipped under DeepSpeed)",
    ("checkpoint",),
)
_override(
    f"{TRAINER}:Trainer._prepare_inputs",
    "the reference's float32 sums kept out of the cast of every float input to DeepSpeed's dtype (bf16)",
    ("inputs",),
)
_override(
    f"{TRAINER}:Trainer._run_epoch",
    "a run resumed from its last step's checkpoint trains nothing (transformers checks max_steps after a step); "
    "the step sampler is given the epoch, which a resumed epoch's wrapped loader does not pass on",
    ("model", "epoch", "train_dataloader"),
)
# --- private methods and functions called -------------------------------------------------------------------
OUTPUT_DIR = _call(
    f"{TRAINER}:Trainer._get_output_dir", "the checkpoint folder's parent, to clear and name it", ("trial",)
)
SAVE = _call(
    f"{TRAINER}:Trainer._save",
    "FSDP2's final model: the gathered full state dict written once",
    ("output_dir", "state_dict"),
)
SYNC_GRADIENTS = _call(
    "accelerate.state:GradientState._set_sync_gradients",
    "the accumulation boundary on a step's last micro-batch: one Trainer step runs all of a step's micro-batches",
    ("sync_gradients",),
)
TOKENIZE = _call(
    "trl.data_utils:_tokenize",
    "the analyzer and the length stage tokenize one row as DPOTrainer does (dpotrain/data/lengths.py)",
    ("processing_class", "input"),
)
CACHE_ENTRIES = _call(
    "torch._dynamo.eval_frame:_debug_get_cache_entry_list",
    "counts FlexAttention's compilations (dpotrain/forwards/flex.py)",
    ("code",),
)
# --- private attributes and constants read ------------------------------------------------------------------
WEIGHTS_HASH = _read(
    f"{DPO}:DPOTrainer._precompute_model_hash", "the reference cache's key: the weights' hash TRL takes in __init__"
)
TRL_METRICS = _read(f"{DPO}:DPOTrainer._metrics", "TRL's per-micro-batch metrics, replaced by exact means at each log")
TRL_TOKENIZER = _read(
    f"{DPO}:DPOTrainer._tokenizer",
    "the pad token of TRL's padded collator, when a model cannot pack; the tokenizer that labels earlier turns",
)
GENERATION_DEFAULTS = _call(
    "transformers.generation.configuration_utils:GenerationConfig._get_default_generation_params",
    "the samples' greedy decoding: each setting a model's generation_config.json may hold, at its default",
)
LOGPROB_CHUNK = _read(
    "trl.trainer.utils:_CHUNKED_LOGPROB_CHUNK_SIZE",
    "the fused LM head's vocabulary tile, in the memory plan (dpotrain/plan/memory.py)",
)
ATTN_IMPLEMENTATION = _read(
    "transformers.configuration_utils:PretrainedConfig._attn_implementation",
    "which attention a config (and its masks) will use: the forward choice sets it on a copy to ask if it packs",
)
MEM_REF_TYPE = _read(
    f"{MEM}:_MemRefType", "the memory plan's traced peak sorts memory by kind (dpotrain/plan/memory.py)"
)
# --- attributes set around TRL's private methods ------------------------------------------------------------
_set(
    f"{DPO}:DPOTrainer.precompute_ref_logps",
    "True around `_compute_loss`: the reference (live or cached) comes from the inputs",
    read_in=LOSS,
)
_set(
    f"{DPO}:DPOTrainer.accelerator",
    "a local stand-in around `_compute_loss`: its per-micro-batch gathers hang ranks with unequal pair counts",
    read_in=LOSS,
)
_set(
    f"{DPO}:DPOTrainer.loss_types",
    "without `sft` around `_compute_loss`: the SFT term is added over the whole step (dpotrain/train/losses.py)",
    read_in=LOSS,
)
_set(f"{DPO}:DPOTrainer.loss_weights", "the weights of the loss types left without `sft`", read_in=LOSS)
SHARED_STATE = _set(
    "accelerate.state:PartialState._shared_state",
    "FSDP2 and DDP on CPU-only nodes: the distributed type accelerate sets only for accelerators (engine.py)",
    read_in="accelerate.state:PartialState.__init__",
)
PG_TIMEOUT = _set(
    f"{C10D}:default_pg_timeout",
    "the recipe's collective timeout for every process group made later (DeepSpeed's own)",
    read_in=f"{C10D}:_get_default_timeout",
)
RECOVERY_SCRIPT = _set(
    "deepspeed.runtime.engine:DeepSpeedEngine._copy_recovery_script",
    "through HeldWrites in a checkpoint: refused, it left the other ranks in the save's last barrier",
    read_in="deepspeed.runtime.engine:DeepSpeedEngine._save_zero_checkpoint",
)
_source(
    "deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint",
    "the tag DeepSpeed names a checkpoint by, written to `latest` after its last barrier (deepspeed_writes_held)",
    text='tag = f"global_step{self.global_steps}"',
)
PG_NCCL_TIMEOUT = _set(
    f"{C10D}:default_pg_nccl_timeout", "the same, for NCCL groups", read_in=f"{C10D}:_get_default_timeout"
)
C10D_WORLD = _read(
    f"{C10D}:_world",
    "every process group and its name, to print and test their timeouts (dpotrain/cluster/engine.py)",
)
DEFAULT_GROUP = _call(f"{C10D}:_get_default_group", "the default group's name")
DEFAULT_STORE = _call(
    f"{C10D}:_get_default_store",
    "the default group's key-value store, where a rank that heard the run's stop tells the others while they work "
    "alone (collectives.stop_heard_on_any_rank)",
)
FROM_CONFIG = _call(
    "transformers.modeling_utils:PreTrainedModel._from_config",
    "the memory plan builds, from its config alone, a model whose class no auto class maps (a vision-language model "
    "such as Qwen2-VL, which TRL loads by the class config.json names; dpotrain/plan/memory.py)",
    ("config",),
)
CHECKPOINTING_ENABLE = _call(
    "transformers.modeling_utils:PreTrainedModel._activation_checkpointing_enable",
    "the plan's every k-th layer checkpointed, called by the model's own enable, which the project replaces on "
    "the instance so that TRL's re-enables keep the plan (dpotrain/plan/layers.py)",
    ("activation_checkpointing_kwargs", "every_n_layers", "offload"),
)
RECORDED_OUTPUTS = _read(
    "transformers.modeling_utils:PreTrainedModel._can_record_outputs",
    "the module class whose outputs a model records as its router logits: one holding none of them (Doge's dense "
    "layers) records none, and TRL's router loss failed on the empty tuple (options.check_router_loss)",
)
SUPPORTS_SDPA = _read(
    "transformers.modeling_utils:PreTrainedModel._supports_sdpa",
    "sdpa, or eager for a model class without it: the dense attention of shared prompts and of generation",
)
DATASET_FINGERPRINT = _read(
    "datasets.arrow_dataset:Dataset._fingerprint",
    "what a map's cache is named by: the first map over a data set saved with `save_to_disk` is given a cache named "
    "by it in datasets' cache, not beside the user's files (dpotrain/data/data.py:cached_by_datasets)",
)
FOLDER_EXTENSIONS = _read(
    "datasets.packaged_modules:_ALL_ALLOWED_EXTENSIONS",
    "the files datasets reads of a local folder: a resume compares only those (dpotrain/data/mixture.py:_split_files)",
)
FORMAT_EXTENSIONS = _read(
    "datasets.packaged_modules:_MODULE_TO_EXTENSIONS",
    "the files of the one format datasets infers for a folder: a note beside its shards is not read, nor compared on "
    "a resume (dpotrain/data/mixture.py:_split_files)",
)
NO_SPLIT_MODULES = _read(
    "transformers.modeling_utils:PreTrainedModel._no_split_modules",
    "the decoder layer classes FSDP2 makes its units of, as accelerate reads them, less the ones the model does not "
    "have (dpotrain/cluster/engine.py:fsdp_units)",
)
KEEP_IN_FP32 = _read(
    "transformers.modeling_utils:PreTrainedModel._keep_in_fp32_modules",
    "the modules bitsandbytes' quantizer leaves unquantized beside the output head, as it reads them: the memory "
    "plan's count of a QLoRA base's quantized weights (dpotrain/plan/memory.py:quantized_weights)",
)
_source(
    "transformers.models.olmo3.modeling_olmo3:Olmo3Model.forward",
    "a model whose forward takes a dict of masks per layer kind (the config does not say): the shared-prompt "
    "forward hands it one mask per kind (dpotrain/forwards/shared_prompt.py)",
    text=MASK_PER_LAYER_KIND,
)
_source(
    "transformers.models.gpt_oss.modeling_gpt_oss:GptOssAttention.forward",
    "a model with learnable attention sinks (the config does not say): no FlashAttention build that drops them, no "
    "sequence-parallel group (dpotrain/forwards/choice.py, dpotrain/forwards/sequence_parallel.py)",
    text=ATTENTION_SINKS,
)
BF16_GPU_AVAILABLE = _patch(
    "transformers.training_args:is_torch_bf16_gpu_available",
    "a dry run on a CPU login node plans a bf16 GPU job: transformers' 'bf16 needs a GPU' must not refuse it",
    read_in="transformers.training_args:TrainingArguments._validate_args",
)
TF32_AVAILABLE = _patch(
    "transformers.training_args:is_torch_tf32_available",
    "a dry run on a CPU login node plans a GPU job with tf32: transformers' 'tf32 requires Ampere' must not refuse it",
    read_in="transformers.training_args:TrainingArguments.__post_init__",
)
TF32_ENABLED = _patch(
    "transformers.training_args:enable_tf32",
    "the dry run's tf32 is the planned GPU job's: this process's own float32 matmuls are not switched to it",
    read_in="transformers.training_args:TrainingArguments.__post_init__",
)
TEMPLATE_CLOCK = _patch(
    "transformers.utils.chat_template_utils:datetime",
    "the clock a chat template's `strftime_now` reads, set to two fixed days: a template that writes the day it "
    "renders on (Llama 3.2's) renders two texts, said as the pairs are read (chat_template.dated)",
    read_in="transformers.utils.chat_template_utils:_cached_compile_jinja_template",  # its strftime_now
)
INVALIDATE_TRACE = _call(
    "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator._invalidate_trace",
    "after generating under ZeRO-3, the recorded fetch order is forgotten (dpotrain/train/samples.py)",
)
TORCH_CHECK = _call(
    "torch:_check", "FlexAttention's rows are whole tiles, said to the compiler (dpotrain/forwards/flex.py)"
)
MARK_DYNAMIC = _call(
    "torch._dynamo:maybe_mark_dynamic",
    "the block mask's tile tables as dynamic sizes: a new row width is no new compilation (forwards/flex.py)",
    ("t", "index"),
)
COMPILE_MODES = _call(
    "torch._inductor:list_mode_options",
    "the modes torch.compile takes (its docstring names this function): another torch_compile_mode is refused before "
    "the model loads (options.py)",
    ("mode", "dynamic"),
)
DYNAMO_CONFIG = _read(
    "torch._dynamo:config", "torch.compile's recompile limit and whether it is disabled (forwards/flex.py)"
)
RECOMPILE_LIMIT_HIT = _read(
    "torch._dynamo.exc:FailOnRecompileLimitHit",
    "dynamo gave the flex function up: the run stops in one line (forwards/flex.py)",
)
FAKE_TENSOR_MODE = _read(
    "torch._subclasses.fake_tensor:FakeTensorMode",
    "the memory plan traces the backbone on fake tensors, without parameters (dpotrain/plan/memory.py)",
)
FAKE_TENSOR_LOG = _read(
    "torch._subclasses.fake_tensor:log",
    "quiet while the memory plan traces: its failed trace is said once, as the formula's reason, not as torch's "
    "error lines (dpotrain/plan/memory.py)",
)
MEM_TRACKER = _read(f"{MEM}:MemTracker", "the memory plan's traced peak, by kind of memory (dpotrain/plan/memory.py)")
PEAK_STATS = _override(
    f"{MEM}:MemTracker._update_peak_stats",
    "the memory plan's trace updates the global peak only, not every module's on every operator (mem_tracker)",
    ("peak_state",),
)
TOTAL_KEY = _read(f"{MEM}:_TOTAL_KEY", PEAK_KEPT)
CURR_MEM_SNAP, PEAK_MEM, PEAK_MEM_SNAP = (
    _read(f"{MEM}:MemTracker.{name}", PEAK_KEPT) for name in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
)
PROGRESS_BARS = _read(
    "tqdm.std:tqdm._instances",
    "the open progress bars, closed before an error's line (recipe/errors.py), cleared for a stop's (step_log.py)",
)
PARSER_ACTIONS = _read(
    "argparse:ArgumentParser._actions",
    "the recipe's flags, their help and defaults: unknown-flag hints, the short --help, the parser built once "
    "(recipe/config.py, usage.py)",
)
GROUP_BACKEND = _call(
    f"{C10D}:ProcessGroup._get_backend", "a group's backend per device, whose options hold its timeout", ("device",)
)
GROUP_DEVICES = _read(
    f"{C10D}:ProcessGroup._device_types", "the devices a group has a backend for, to read each one's timeout"
)
BACKEND_TIMEOUT = _read(
    "torch._C._distributed_c10d:Backend.Options._timeout", "a backend's collective timeout, as it was made"
)
PG_MAP, PG_NAMES = (
    _read(f"{C10D}:_World.{name}", "every process group (`_world`) and its name") for name in ("pg_map", "pg_names")
)
SAVED_AS_LOADED = _source(
    "transformers.generation.configuration_utils:GenerationConfig.save_pretrained",
    "the model's generation_config.json saved as transformers saves one it loaded, its settings kept (warned about, "
    "not refused): the run's alignment of the pad, BOS and EOS ids made it one changed since it loaded, held to the "
    "strict check, and a setting its mode does not read (`temperature` with do_sample false) failed the first "
    "checkpoint (dpotrain/train/trainer.py)",
    text=f'getattr(self, "{LOADED_HASH}", None) != hash(self)',
)
FUSED_HEAD_BACKBONE = _source(
    "trl.trainer.utils:add_fused_lm_head",
    "TRL's fused LM head, which computes every log-prob DPOTrainer takes, runs `model.base_model` as the backbone: a "
    "causal LM with no module named by its base_model_prefix (Llama 4's, Mllama's) ran itself there and failed on its "
    "own output in the reference stage; refused before it loads (options.check_backbone)",
    text='backbone_attr = "base_model"',
)
LOAD_FROM_DISK = _source(
    "datasets.arrow_dataset:Dataset.load_from_disk",
    "a `save_to_disk` split's data files, as `load_from_disk` reads them from its state.json: a split without "
    "one is named before the load fails inside datasets (dpotrain/data/data.py)",
    text=f'state["{DATA_FILES}"]',
)
STATE_DICT_AS_FILES = _source(
    "transformers.modeling_utils:PreTrainedModel._load_pretrained_model",
    "a state_dict given to from_pretrained is renamed, converted and judged as the files' tensors are: the dry run "
    "gives it the names and shapes of the weights' files as meta tensors, and reads which of the model's tensors "
    "they lack from the loading info (dpotrain/train/weight_names.py)",
    text="merged_state_dict = state_dict",
)
# --- the interpreter's own exit, its first steps taken by a command before it ends (recipe/errors.py) ---------
THREADS_SHUTDOWN = _call(
    "threading:_shutdown",
    "a command's end waits for the threads Python's exit waits for (a Hub upload, concurrent.futures' workers)",
)
EXIT_HANDLERS = _call(
    "atexit:_run_exitfuncs", "a command's end runs the exit handlers (W&B's teardown, logging.shutdown, ...)"
)
# --- torch.distributed's words for a peer process gone (recipe/errors.py, `peer_gone`) -----------------------------
# gloo's transport (C++, third_party/gloo/gloo/transport/tcp/pair.cc) raises a bare RuntimeError in every collective
# a rank waits in when another rank's process ends: its socket closed ("Connection closed by peer [host]:port. This is
# typically caused by a remote worker crashing"), or reset. Its text is all that tells it from any other RuntimeError:
# no seam `check` can read C++ source, so an upgrade that rewords it brings back the traceback, no worse.
GLOO_TRANSPORT = "gloo/transport"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
# --- module-level names replaced for one call ---------------------------------------------------------------
ROTATION = _patch(  # the checkpoint rotation inside Trainer._save_checkpoint
    "transformers.trainer:rotate_checkpoints",
    "a no-op inside `_save_checkpoint`: checkpoints are rotated after their COMPLETE mark (train/checkpoints.py), "
    "never before it, and without flipping `save_total_limit` on the run's arguments",
    read_in=f"{TRAINER}:Trainer._save_checkpoint",
)
FINAL_ROTATION = _patch(  # what Trainer._finalize_training deletes from
    "transformers.trainer:sort_checkpoints",
    "no checkpoint for `_finalize_training` to delete: with save_total_limit 1 and a best checkpoint it deleted "
    "every `checkpoint-*` folder of output_dir but the best, a person's too; the run's rotation keeps its own",
    read_in=f"{TRAINER}:Trainer._finalize_training",
)
CREATE_MODEL = _patch(
    f"{DPO}:create_model_from_path",
    "under FSDP2, the reference copy TRL loads for its precompute is skipped (the sharded policy scores instead); "
    "every load asks for transformers' loading info, and weights lacking some of the model's tensors are refused",
    read_in=f"{DPO}:DPOTrainer.__init__",
)
TRL_HASH = _patch(
    f"{DPO}:hash_module",
    "a LoRA start's reference key is the base weights' hash (dpotrain/train/trainer.py): TRL's of base and adapter, "
    "a second pass over every weight, is taken only by a resume of a run recorded with it",
    read_in=f"{DPO}:DPOTrainer.__init__",
)
TRL_MAPS_IN_TURNS = _patch(
    f"{DPO}:global_then_local_main_first",
    "TRL's maps over the pairs taken in turns whose ends every rank agrees on (collectives.in_turns), so that a stop "
    "mid-map ends every rank alike: a rank raising inside accelerate's order left the others at its barrier",
    read_in=f"{DPO}:DPOTrainer._prepare_dataset",
)
DATASET_MAP = _set(
    "datasets.arrow_dataset:Dataset.map",
    "the function of each map TRL's tokenization makes (local to `_prepare_dataset`; its filter maps through it too) "
    "looks at the run's stop at each row (data/stops.py), for the duration of the trainer's `_prepare_dataset`",
    read_in=f"{DPO}:DPOTrainer._prepare_dataset",
)
ZERO3_ENABLED = _patch(
    "transformers.modeling_utils:is_deepspeed_zero3_enabled",
    "the memory plan's models (meta device, fake tensors) built plain inside a ZeRO-3 launch, not in DeepSpeed's "
    "zero.Init, which fails there in bf16 (dpotrain/plan/memory.py); the dry run's meta load of the weights' names "
    "takes the load of a single process (dpotrain/train/weight_names.py)",
    read_in="transformers.modeling_utils:PreTrainedModel._from_config",
)
DISABLE_CHECKPOINTING = _patch(
    f"{DPO}:disable_gradient_checkpointing",
    "left alone in the reference stage (eval mode): TRL re-enables checkpointing on every layer each micro-batch",
    read_in=f"{DPO}:DPOTrainer.compute_ref_log_probs",
)
SHM_OP = _patch(
    "deepspeed.comm.torch:build_shm_op",
    "left unbuilt in a DeepSpeed launch's rank on a CPU-only node, for the whole process (skip_deepspeed_shm_op, "
    "dpotrain/recipe/config.py): a JIT compile of 24-140 s on a fresh venv, for `inference_all_reduce` alone",
    read_in="deepspeed.comm.torch:TorchBackend.__init__",
)

SEAMS = tuple(_LISTED)


class SeamMoved(RuntimeError):
    """An upstream private name the project relies on is gone or changed."""

    def __init__(self, seam: Seam, problem: str):
        super().__init__(
            f"{seam.symbol} ({seam.kind}): {problem}. The project uses it because: {seam.why}. "
            "Adapt that use (dpotrain/recipe/upstream.py lists them all) or pin the version in requirements.txt"
        )


def _lookup(symbol: str):
    """(owner, name, value) for "module:A.b"; value `_MISSING` for an instance attribute set only by __init__."""
    module_name, _, path = symbol.partition(":")
    *parents, name = path.split(".")
    owner = functools.reduce(getattr, parents, importlib.import_module(module_name))
    return owner, name, getattr(owner, name, _MISSING)


_MISSING = object()


def _value(seam: Seam):
    """What a seam's symbol ("module:A.b") names."""
    return getattr(*_lookup(seam.symbol)[:2])


def _member(obj, seam: Seam):
    """The seam's name on an object the accessor is given (a trainer's `_metrics`)."""
    return getattr(obj, seam.name)


def _assigned_in_class(cls, name: str) -> bool:
    """An instance attribute upstream sets in one of the class's methods (`self.<name> = ...`)."""
    for klass in inspect.getmro(cls)[:-1]:  # all but object
        with contextlib.suppress(OSError, TypeError):
            source = inspect.getsource(klass)
            if f"self.{name} =" in source or f"self.{name}: " in source:
                return True
    return False


def verify(seam: Seam) -> None:
    """Raises SeamMoved when the upstream name is gone or no longer takes the parameters the project passes."""
    try:
        owner, name, value = _lookup(seam.symbol)
    except (ImportError, AttributeError) as e:
        raise SeamMoved(seam, f"cannot be imported ({e})") from None
    if value is _MISSING and not (inspect.isclass(owner) and _assigned_in_class(owner, name)):
        raise SeamMoved(seam, "no longer exists")
    if value is not _MISSING and seam.kind in ("override", "call") and seam.params:
        try:
            params = [p for p in inspect.signature(value).parameters if p != "self"]
        except (TypeError, ValueError):
            return  # a builtin without a signature: existing is all that can be checked
        if params[: len(seam.params)] != list(seam.params):
            raise SeamMoved(seam, f"takes ({', '.join(params)}), the project relies on ({', '.join(seam.params)})")
    if seam.read_in and name not in inspect.getsource(_lookup(seam.read_in)[2]):
        raise SeamMoved(seam, f"is no longer read by {seam.read_in}")
    if seam.text and seam.text not in inspect.getsource(value):
        raise SeamMoved(seam, f"no longer holds {seam.text!r}")


def installed(seam: Seam) -> bool:
    """Whether the package a seam lives in is installed (DeepSpeed is optional where no recipe uses it)."""
    return importlib.util.find_spec(seam.symbol.split(".")[0].split(":")[0]) is not None


def check() -> None:
    """Every seam of an installed package verified; all problems reported at once, and the packages not installed."""
    problems, absent = [], sorted({s.symbol.split(".")[0] for s in SEAMS if not installed(s)})
    for seam in filter(installed, SEAMS):
        try:
            verify(seam)
        except SeamMoved as e:
            problems.append(str(e))
    if problems:
        raise SystemExit("upstream names this project relies on have moved:\n" + "\n".join(problems))
    print(f"upstream: {len(SEAMS)} seams checked" + (f" ({', '.join(absent)} not installed)" if absent else ""))


# --- the accessors: the only places the code reaches these names ----------------------------------------------------


def tokenize(processing_class, input, **apply_chat_template_kwargs) -> dict:
    """TRL's tokenization of one row, the call DPOTrainer makes."""
    return _value(TOKENIZE)(processing_class, input, **apply_chat_template_kwargs)


def default_generation_params() -> dict:
    return _value(GENERATION_DEFAULTS)()


def saved_as_loaded(generation_config) -> None:
    """`generation_config` saved as transformers saves one unchanged since it loaded (`SAVED_AS_LOADED`)."""
    setattr(generation_config, LOADED_HASH, hash(generation_config))


def chunked_logprob_chunk_size() -> int:
    return _value(LOGPROB_CHUNK)


def compilations_of(code) -> int:
    return len(_value(CACHE_ENTRIES)(code))


def mem_ref_types():
    return _value(MEM_REF_TYPE)


def set_attn_implementation(config, name: str) -> None:
    """Which attention a config's masks are built for, without loading a model (`from_pretrained` sets it so)."""
    setattr(config, ATTN_IMPLEMENTATION.name, name)


def model_from_config(model_class, config, **kwargs):
    """`model_class` built from `config` as `AutoModelForCausalLM.from_config` builds its own (dtype and attention
    from `kwargs`), for a class no auto class maps."""
    return _member(model_class, FROM_CONFIG)(config, **kwargs)


def attn_implementation(config) -> str | None:
    return getattr(config, ATTN_IMPLEMENTATION.name, None)


def set_sync_gradients(accelerator, sync: bool) -> None:
    """Whether this micro-batch ends the accumulation (a step's micro-batches run inside one Trainer step)."""
    _member(accelerator.gradient_state, SYNC_GRADIENTS)(sync)


def weights_hash(trainer) -> str:
    return _member(trainer, WEIGHTS_HASH)


def trl_metrics(trainer) -> dict:
    """TRL's metric lists by mode ("train", "eval"), which its `log` averages."""
    return _member(trainer, TRL_METRICS)


def trl_tokenizer(trainer):
    return _member(trainer, TRL_TOKENIZER)


def checkpoint_parent(trainer, trial) -> str:
    return _member(trainer, OUTPUT_DIR)(trial)


def without_zero3_init():
    """Models built in the block are plain, not in DeepSpeed's `zero.Init` (transformers' while a ZeRO-3 config lives),
    which the memory plan's meta or fake models do not need and which fails there in bf16."""
    return patched(ZERO3_ENABLED, lambda: False)


def save_weights(trainer, output_dir, state_dict) -> None:
    _member(trainer, SAVE)(output_dir, state_dict=state_dict)


@contextlib.contextmanager
def deepspeed_writes_held(engine, run):
    """DeepSpeed's checkpoint writes on `engine` through `run` (collectives.HeldWrites.run) for the block, so a refused
    one lets the rank go on into the save's barriers; the `latest` tag file, which DeepSpeed writes with `open` just
    before its last barrier, is written after it."""
    writer, save_checkpoint = engine.checkpoint_engine, engine.save_checkpoint

    def tagged_after(save_dir, tag=None, save_latest=True, **kwargs):
        saved = save_checkpoint(save_dir, tag=tag, save_latest=False, **kwargs)
        if save_latest and engine.global_rank == 0:
            tag = str(tag) if tag is not None else DEEPSPEED_TAG.format(engine.global_steps)
            run(Path(save_dir, "latest").write_text, tag)
        return saved

    with (
        attributes_set(
            writer, save=functools.partial(run, writer.save), makedirs=functools.partial(run, writer.makedirs)
        ),
        attributes_set(engine, **{RECOVERY_SCRIPT.name: functools.partial(run, _member(engine, RECOVERY_SCRIPT))}),
        attributes_set(engine, save_checkpoint=tagged_after),
    ):
        yield


@contextlib.contextmanager
def patched(seam: Seam, replacement):
    """A `patch` seam's module-level name replaced for the duration of the block."""
    module, name, original = _lookup(seam.symbol)
    with attributes_set(module, **{name: replacement}):
        yield original


@contextlib.contextmanager
def maps_in_turns(in_turns, each_function):
    """For the block: TRL's main-first order of its maps replaced by `in_turns` (a context manager), and the function
    of every `Dataset.map` made (TRL's, its filter's, the block's own) by `each_function(function)`."""
    owner, name, original = _lookup(DATASET_MAP.symbol)

    @functools.wraps(original)
    def mapped(self, function=None, *args, **kwargs):
        return original(self, None if function is None else each_function(function), *args, **kwargs)

    with patched(TRL_MAPS_IN_TURNS, in_turns), attributes_set(owner, **{name: mapped}):
        yield


@contextlib.contextmanager
def template_clock(day):
    """Chat templates' `strftime_now` reads `day` (a datetime) as now, for the block; nothing else reads that clock."""
    clock = type("TemplateClock", (), {"now": staticmethod(lambda tz=None: day)})
    with patched(TEMPLATE_CLOCK, clock):
        yield


@contextlib.contextmanager
def attributes_set(obj, **values):
    """`set` seams, set for the duration of the block; one the object did not hold itself is removed again after."""
    own = getattr(obj, "__dict__", {})
    saved = {name: (name in own, getattr(obj, name)) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, (held, value) in saved.items():
            if held:
                setattr(obj, name, value)
            else:
                delattr(obj, name)


def dataset_fingerprint(dataset) -> str:
    """What datasets names the caches of maps over `dataset` by (its files' own, and every transform since)."""
    return _member(dataset, DATASET_FINGERPRINT)


def data_extensions(module: str | None = None) -> list:
    """The file extensions datasets reads in a local folder: of every format (`module` None), or of one (`json`)."""
    return _value(FOLDER_EXTENSIONS) if module is None else _value(FORMAT_EXTENSIONS)[module]


def saved_data_files(state: dict) -> list:
    """The data files a `save_to_disk` split's state.json (read as a dict) lists, as `load_from_disk` reads them."""
    return state.get(DATA_FILES) or []


def set_distributed_type(kind) -> None:
    """accelerate's distributed type for every state made from now on: FSDP2 and DDP on CPU-only nodes."""
    _value(SHARED_STATE)["distributed_type"] = kind


def set_default_collective_timeout(timeout) -> None:
    """The timeout of every process group made without one (DeepSpeed's too): read at each `new_group`."""
    for seam in (PG_TIMEOUT, PG_NCCL_TIMEOUT):
        setattr(*_lookup(seam.symbol)[:2], timeout)


def default_group_name() -> str:
    return _member(_value(C10D_WORLD), PG_NAMES)[_value(DEFAULT_GROUP)()]


def default_store():
    """The default process group's key-value store (torchrun's rendezvous store under a launch)."""
    return _value(DEFAULT_STORE)()


def group_timeouts() -> dict[str, float]:
    """Every process group's name -> the shortest collective timeout of its backends, in seconds."""
    world, found = _value(C10D_WORLD), {}
    for group in _member(world, PG_MAP):
        backends = (_member(group, GROUP_BACKEND)(device) for device in _member(group, GROUP_DEVICES))
        seconds = [_member(backend.options, BACKEND_TIMEOUT).total_seconds() for backend in backends]
        found[_member(world, PG_NAMES).get(group, "?")] = min(seconds)
    return found


def enable_checkpointing(model, kwargs, every_n_layers: int, offload: bool) -> None:
    """transformers' checkpointing of every k-th layer, past the public method the project replaces on the instance."""
    _member(model, CHECKPOINTING_ENABLE)(kwargs, every_n_layers=every_n_layers, offload=offload)


@functools.cache
def http_transport_errors() -> tuple[type, ...]:
    """The transport errors of huggingface_hub's HTTP library: httpx2 under huggingface_hub 2, httpx under 1.x."""
    return tuple(importlib.import_module(n).TransportError for n in ("httpx2", "httpx") if importlib.util.find_spec(n))


def causal_lm_class(config):
    """The causal-LM class transformers' auto class builds for `config`, or None where it maps none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # not `.get`: the lazy mapping's entries live behind its __getitem__, not in the dict
        return None


def sets_its_backbone(model_class) -> bool:
    """Whether a causal-LM class's `__init__` sets the module its base_model_prefix names, which `base_model` returns
    and TRL's fused LM head runs (`FUSED_HEAD_BACKBONE`); False where its source does not show it (or is not there)."""
    try:
        source = inspect.getsource(model_class.__init__)
    except (OSError, TypeError):
        return False
    return f"self.{model_class.base_model_prefix} =" in source


def router_class(model) -> type | None:
    """The module class whose outputs `model` records as its router logits (`RECORDED_OUTPUTS`), or None."""
    recorded = (getattr(model, RECORDED_OUTPUTS.name, None) or {}).get("router_logits")
    return getattr(recorded, "target_class", recorded)


def no_split_modules(model) -> set[str]:
    """The class names `model` says are not to be split across devices (`NO_SPLIT_MODULES`): its layers."""
    return set(getattr(model, NO_SPLIT_MODULES.name, None) or ())


def kept_in_fp32(model) -> list[str]:
    """The modules `model` keeps in float32 (`KEEP_IN_FP32`), which bitsandbytes' quantizer leaves unquantized."""
    return list(getattr(model, KEEP_IN_FP32.name, None) or ())


def supports_sdpa(model_or_class) -> bool:
    """Whether a model (class) takes sdpa; transformers' default where a class does not say."""
    return getattr(model_or_class, SUPPORTS_SDPA.name, True)


def takes_mask_per_layer_kind(model_class) -> bool:
    """Whether a model class's forward accepts a dict of masks per layer kind, read from its modeling module."""
    return MASK_PER_LAYER_KIND in _module_source(model_class.__module__)


def has_attention_sinks(config) -> bool:
    """Whether the model of `config` hands learnable attention sinks to its attention function, read from its
    modeling module; False where transformers maps no class to it (remote code)."""
    model_class = causal_lm_class(config)
    return model_class is not None and ATTENTION_SINKS in _module_source(model_class.__module__)


@functools.cache
def _module_source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


@contextlib.contextmanager
def gpu_precision_checks_skipped():
    """transformers' "bf16 needs a GPU" and "tf32 requires Ampere" answered yes for the block (a dry run on a CPU plans
    a GPU job), and its switch of this process to TF32 left undone."""
    yes = lambda *_, **__: True  # noqa: E731
    with patched(BF16_GPU_AVAILABLE, yes), patched(TF32_AVAILABLE, yes), patched(TF32_ENABLED, lambda *_, **__: None):
        yield


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed's shared-memory op left unbuilt for the rest of this process, a rank of a DeepSpeed launch on a
    CPU-only node: the op serves `inference_all_reduce` alone (AutoTP inference), which training never calls, and its
    JIT compile took 24-140 s of a fresh venv's first launch, before even a refusal at start. Every process group
    DeepSpeed makes asks for it (TrainingArguments' PartialState, then TRL's `deepspeed.initialize` of a reference
    model), hence for the process, not one call. A node with GPUs is left as DeepSpeed sets it."""
    import os

    import torch

    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"  # as accelerate's state reads it
    if launched and not torch.cuda.is_available():
        module, name, _ = _lookup(SHM_OP.symbol)
        setattr(module, name, lambda: None)


def forget_fetch_order(coordinator) -> None:
    """DeepSpeed ZeRO-3's recorded order of parameter fetches, forgotten (the next forward records its own)."""
    _member(coordinator, INVALIDATE_TRACE)()


def compiler_check():
    """`torch._check` itself (not a wrapper, which dynamo would not know): a fact the compiler cannot prove."""
    return _value(TORCH_CHECK)


def mark_dynamic(tensor, dim: int) -> None:
    _value(MARK_DYNAMIC)(tensor, dim)


def compile_modes() -> list[str]:
    """The `mode`s torch.compile takes."""
    return list(_value(COMPILE_MODES)())


def dynamo_config():
    """torch.compile's settings module (`recompile_limit`, `disable`)."""
    return _value(DYNAMO_CONFIG)


def recompile_limit_hit() -> type[Exception]:
    return _value(RECOMPILE_LIMIT_HIT)


def fake_tensor_mode():
    return _value(FAKE_TENSOR_MODE)()


def quiet_fake_tensor_log():
    """torch's fake-tensor logger off for the block (only its own lines: the run's other logs as they were)."""
    return attributes_set(_value(FAKE_TENSOR_LOG), disabled=True)


def mem_tracker():
    """torch's MemTracker keeping the global peak only: the stock one also updates every module's on every operator."""
    total = _value(TOTAL_KEY)

    def update_peak_stats(self, peak_state) -> None:
        peaks, peak_snapshots = _member(self, PEAK_MEM), _member(self, PEAK_MEM_SNAP)
        for device, snapshot in _member(self, CURR_MEM_SNAP).items():
            if peaks.get(device, 0) < snapshot[total]:
                peaks[device] = snapshot[total]
                peak_snapshots[device] = copy.deepcopy(snapshot)

    # A class made with the override under the seam's name (a `def` would write the name a second time)
    return type("GlobalPeakTracker", (_value(MEM_TRACKER),), {PEAK_STATS.name: update_peak_stats})()


def open_progress_bars() -> list:
    """tqdm's open bars, where tqdm is imported (never imported here for it)."""
    tqdm = sys.modules.get("tqdm")
    return list(getattr(getattr(tqdm, "tqdm", None), PROGRESS_BARS.name, ()))


def parser_actions(parser) -> list:
    """An argparse parser's actions: its flags, their help and defaults."""
    return _member(parser, PARSER_ACTIONS)


def long_flags(parser) -> dict:
    """Each `--flag` of an argparse parser (every spelling it takes) -> its action."""
    return {
        flag: action for action in parser_actions(parser) for flag in action.option_strings if flag.startswith("--")
    }


def wait_for_threads() -> None:
    """What Python's exit does first: `threading._shutdown` joins the non-daemon threads and runs what
    `threading._register_atexit` registered (concurrent.futures' workers end)."""
    _value(THREADS_SHUTDOWN)()


def run_exit_handlers() -> None:
    """What Python's exit does next: every `atexit` handler, newest first, once (`atexit._run_exitfuncs`)."""
    _value(EXIT_HANDLERS)()


def peer_gone(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from (`raise ... from`), is gloo's word that another process of the launch
    ended while this one waited for it in a collective: nothing this process did, so no traceback of its own."""
    while error is not None:
        text = str(error)
        if isinstance(error, RuntimeError) and GLOO_TRANSPORT in text and any(p in text for p in PEER_GONE):
            return True
        error = error.__cause__
    return False

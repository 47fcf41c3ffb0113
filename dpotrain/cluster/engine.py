"""The engine a launch asked for — one process, DDP, DeepSpeed ZeRO-2 or ZeRO-3, FSDP2 — and what each needs.

Read from the environment `accelerate launch` sets (or a config file, for a dry run); unsupported ones are refused
before anything loads. Also the few places an engine changes: who runs every forward, the load dtype, the weights' hash
under ZeRO-3, gradient clipping, the process groups, and FSDP or DDP on CPU-only nodes.
"""

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from dpotrain.recipe import launcher, upstream, venv
from dpotrain.recipe.config import DS_FILE_FIX, launch_file, launch_file_places
from dpotrain.recipe.errors import ConfigError, cause, plural

LAUNCHED = "this launch"  # the source of an engine read from the environment `accelerate launch` sets
SUPPORTED = "one process, DDP, DeepSpeed ZeRO-2 or ZeRO-3, FSDP2 (accelerate_config.yaml, configs/accelerate/)"
NAMES = {  # how records and refusals name each engine
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp2": "FSDP2",
    "ddp": "DDP",
    "single": "one process",
}


@dataclass(frozen=True)
class Engine:
    """An engine and the settings that change what it holds per GPU: `from_config` (a dry run) or `launched`."""

    name: str  # "single", "ddp", "zero2", "zero3", "fsdp2"; "unplanned" from a config plans do not cover
    source: str = LAUNCHED  # the file(s) it was read from, or why it is unplanned
    gpus_per_node: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket: int | None = None  # DeepSpeed's reduce_bucket_size in elements; None: "auto" (hidden^2)
    overlap_comm: bool = False
    # DeepSpeed's gradient_clipping: "auto" (filled from max_grad_norm), a number, or None (absent: never clips)
    gradient_clipping: str | float | None = "auto"
    # Why `launched` would refuse this engine (FSDP1, ZeRO-0/1, ...): a job refuses it before starting
    refused: str | None = None
    # accelerate's mixed precision: TrainingArguments autocasts in it where the recipe sets neither bf16 nor fp16
    mixed_precision: str = "no"
    mixed_precision_from: str = "ACCELERATE_MIXED_PRECISION"  # or the accelerate config a dry run read it from
    # The DeepSpeed config's non-"auto" MATCHED and zero_force_ds_cpu_optimizer values, and its OWN_PARTS' types
    deepspeed_settings: tuple[tuple[str, object], ...] = ()
    # A config file's num_processes, so a dry run reads the file once; None where no file was read or it was refused
    processes: int | None = None
    ram_efficient_loading: bool = False  # FSDP2's fsdp_cpu_ram_efficient_loading: the main process loads the weights

    @property
    def shards_weights(self) -> bool:
        """Every forward gathers weights from every rank: all ranks must run each forward together."""
        return self.name in ("zero3", "fsdp2")

    @property
    def deepspeed(self) -> bool:
        return self.name.startswith("zero")

    @property
    def loads_on_every_rank(self) -> bool:
        """Every rank loads the whole weights from its own node's files (a folder staged there, its Hub cache), where
        ZeRO-3 and FSDP2's RAM-efficient loading take the main process's: the ranks' copies may differ."""
        return self.name in ("single", "ddp", "zero2") or (self.name == "fsdp2" and not self.ram_efficient_loading)

    @property
    def defers_gradient_sync(self) -> bool:
        """Whether a step's micro-batches but the last skip the gradient reduction (`accelerator.no_sync`). DDP only:
        DeepSpeed reduces into partitioned buffers anyway, and FSDP2 deferring would hold every unsharded gradient."""
        return self.name == "ddp"


def _mixed_precision_set() -> str:
    return (os.environ.get("ACCELERATE_MIXED_PRECISION") or "no").lower()


def launched() -> Engine:
    """The engine of this launch, from the environment `accelerate launch` sets; refuses the unsupported."""
    env = os.environ.get
    world, per_node = launcher.world(1), launcher.processes_per_node()
    if env("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        ds_file = env("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "none"
        save_16bit = env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false")  # accelerate's default: false
        if ds_file != "none" and os.path.isfile(ds_file):
            found = _deepspeed_file(Path(ds_file), per_node, f"{LAUNCHED} -> {ds_file}", save_16bit)
        else:  # the settings inline in the accelerate config, passed one by one: ACCELERATE_DEEPSPEED_<KEY>
            clip = env("ACCELERATE_GRADIENT_CLIPPING", "auto")  # accelerate's own default: "auto"
            setting = lambda key, default: env(f"ACCELERATE_DEEPSPEED_{key.upper()}", default)
            found = _inline_deepspeed(setting, LAUNCHED, per_node, clip if clip == "auto" else float(clip))
            found = _with_accumulation(found, env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"))
        found = _supported_stage(found, LAUNCHED)
    elif env("ACCELERATE_USE_FSDP", "false").lower() == "true":
        refused = _unsupported_fsdp(
            env("FSDP_VERSION", "1"), env("FSDP_STATE_DICT_TYPE"), env("FSDP_ACTIVATION_CHECKPOINTING")
        )
        offload, loading = (env(f"FSDP_{key}", "false").lower() == "true" for key in ("OFFLOAD_PARAMS", RAM_EFFICIENT))
        found = Engine(
            "fsdp2", LAUNCHED, per_node, offload_params=offload, ram_efficient_loading=loading, refused=refused
        )
    else:
        for flag in ("ACCELERATE_USE_MEGATRON_LM", "ACCELERATE_USE_SAGEMAKER"):
            if env(flag, "false").lower() == "true":
                raise ConfigError(f"{flag.removeprefix('ACCELERATE_USE_').lower()} is not supported: use {SUPPORTED}")
        found = Engine("ddp" if world > 1 else "single", LAUNCHED, per_node)
    if found.refused:
        raise ConfigError(found.refused)
    return replace(found, mixed_precision=_mixed_precision_set())


def _supported_stage(found: Engine, source: str) -> Engine:
    """A DeepSpeed engine of a ZeRO stage other than 2 or 3: unplanned, and refused."""
    if found.name in ("zero2", "zero3"):
        return found
    stage = found.name.removeprefix("zero")
    return Engine(
        "unplanned",
        f"DeepSpeed ZeRO stage {stage} ({source}): plans cover stages 2, 3",
        refused=f"DeepSpeed ZeRO stage {stage} is not supported: use ZeRO-2 (accelerate_config.yaml) or "
        "ZeRO-3 (ACCELERATE_CONFIG=configs/accelerate/zero3.yaml)",
    )


def _unsupported_fsdp(version, state_dict_type: str | None, checkpointing=None) -> str | None:
    """Why an FSDP launch is refused (as `launched` reads it, or a config file says it), or None."""
    if _true(checkpointing):
        # accelerate's own checkpointing of every layer: with the recipe's on, transformers stopped in a traceback
        # once the model had loaded; with it off, every layer was checkpointed under a plan and record of none.
        return (
            "fsdp_activation_checkpointing: true is not supported: set fsdp_activation_checkpointing: false in the "
            "accelerate config and pass --activation_checkpointing true (the recipe's, which the memory plan counts)"
        )
    if str(version) != "2":
        return (
            f"FSDP version {version} is not supported: set fsdp_version: 2 in the accelerate config "
            "(configs/accelerate/fsdp2.yaml)"
        )
    if not (state_dict_type or "SHARDED_STATE_DICT").upper().endswith("SHARDED_STATE_DICT"):
        # FULL_STATE_DICT: the main process gathers and writes every checkpoint while the other ranks wait.
        return (
            f"fsdp_state_dict_type {state_dict_type} is not supported: set fsdp_state_dict_type: SHARDED_STATE_DICT "
            "(configs/accelerate/fsdp2.yaml); the final model is written as safetensors either way"
        )
    return None


def read_accelerate_config(path: str):
    """The accelerate config at `path` as `accelerate launch --config_file` reads it (accelerate's own loader)."""
    # UTF-16 (PowerShell 5's `>`) or Latin-1: the codec's words, or YAML's "unacceptable character #x0000" where
    # UTF-16 has no byte-order mark, named no fix
    try:
        if not venv.is_utf16(Path(path).read_bytes()):
            return load_config_from_file(path)
    except UnicodeDecodeError:
        pass
    except Exception as e:  # noqa: BLE001 - YAML, unknown key, no distributed_type: `accelerate launch` refuses it too
        raise ConfigError(f"accelerate config {path!r} would be refused by `accelerate launch`: {cause(e)}") from None
    raise ConfigError(
        f"accelerate config {path!r} is not UTF-8 text, which `accelerate launch` reads: save it as UTF-8"
    )


def processes(config) -> int:
    """An accelerate config's num_processes (accelerate's -1, unset or null, counted as 1)."""
    return max(getattr(config, "num_processes", None) or 1, 1)


def from_config(accelerate_config: str) -> Engine:
    """The engine an accelerate config file selects (a dry run); never raises: "unplanned", the reason in `source`."""
    from_environment = _mixed_precision_set()  # where no config is read, TrainingArguments still reads it
    if accelerate_config.lower() in ("", "none"):
        return Engine("single", "python train_dpo.py, no launcher", mixed_precision=from_environment)
    if not Path(accelerate_config).is_file():
        why = f"accelerate config {accelerate_config!r} not found"
        return Engine("unplanned", why, mixed_precision=from_environment)
    try:
        config = read_accelerate_config(accelerate_config)
    except ConfigError as e:
        return Engine("unplanned", str(e), refused=str(e), mixed_precision=from_environment)
    try:
        found = _engine_of(config, accelerate_config)
    except ConfigError as e:  # its DeepSpeed config unreadable: `accelerate launch` would refuse it too
        found = Engine("unplanned", str(e), refused=str(e))
    mixed = str(config.mixed_precision or "no").lower()
    source = f"the accelerate config {accelerate_config}"
    return replace(found, mixed_precision=mixed, mixed_precision_from=source, processes=processes(config))


def _engine_of(config, accelerate_config: str) -> Engine:
    per_node = max(processes(config) // max(config.num_machines or 1, 1), 1)  # null: one machine, as accelerate
    # The job's GPUs per node (scripts/launch.sh: --gpus-per-node) over the config's: what a refusal counts nodes in.
    per_node = launcher.planned_gpus_per_node() or per_node
    kind = config.distributed_type.value
    if kind == "DEEPSPEED":
        ds = config.deepspeed_config
        ds_file = ds.get("deepspeed_config_file")
        if ds_file:  # as the launched processes read it (config._launch_deepspeed_file)
            ds_path = Path(launch_file(ds_file, accelerate_config))
            if not ds_path.is_file():  # every launched process would stop on it
                why = f"DeepSpeed config {ds_file!r} ({accelerate_config}) not found"
                return Engine("unplanned", why, refused=f"{why} in {launch_file_places()}: {DS_FILE_FIX}")
            found = _deepspeed_file(ds_path, per_node, f"{accelerate_config} -> {ds_file}")
            # accelerate refuses its settings beside the file as each process starts (_deepspeed_config_checks)
            beside = sorted(set(ds) & SET_IN_THE_FILE) + ["mixed_precision"] * (config.mixed_precision is not None)
            if beside and not found.refused:
                found = replace(
                    found,
                    refused=f"accelerate config {accelerate_config} sets {', '.join(beside)} beside its "
                    'deepspeed_config_file, which `accelerate launch` refuses as each process starts ("the following '
                    'accelerate config variables will be ignored"): remove them from it (the DeepSpeed file holds '
                    'these settings; its "auto" values take the recipe\'s)',
                )
        else:  # the settings inline in the accelerate config; accelerate's own default clipping: "auto"
            found = _inline_deepspeed(ds.get, accelerate_config, per_node, ds.get("gradient_clipping", "auto"))
            found = _with_accumulation(found, ds.get("gradient_accumulation_steps"))
        return _supported_stage(found, accelerate_config)
    if kind == "FSDP":
        fsdp = config.fsdp_config
        refused = _unsupported_fsdp(
            fsdp.get("fsdp_version", 1), fsdp.get("fsdp_state_dict_type"), fsdp.get("fsdp_activation_checkpointing")
        )
        if int(fsdp.get("fsdp_version", 1)) != 2:
            why = f"FSDP version 1 ({accelerate_config}): plans cover FSDP2 (fsdp_version: 2)"
            return Engine("unplanned", why, refused=refused)
        offload, loading = (_true(fsdp.get(f"fsdp_{key.lower()}")) for key in ("OFFLOAD_PARAMS", RAM_EFFICIENT))
        return Engine(
            "fsdp2", accelerate_config, per_node, offload_params=offload, ram_efficient_loading=loading, refused=refused
        )
    if kind == "MULTI_GPU":
        return Engine("ddp", accelerate_config, per_node)
    if kind == "NO":
        return Engine("single", accelerate_config)
    refused = f"{kind.lower()} is not supported: use {SUPPORTED}" if kind == "MEGATRON_LM" else None
    return Engine("unplanned", f"distributed_type {kind} ({accelerate_config}) is not one plans cover", refused=refused)


def _inline_deepspeed(setting, source: str, per_node: int, clip) -> Engine:
    """DeepSpeed's settings inline in an accelerate config, `setting(key, default)`; DeepSpeed's defaults otherwise."""
    # Absent or null: accelerate's DeepSpeedPlugin runs ZeRO-2 (read as 0, such a config was refused as "stage 0")
    stage = setting("zero_stage", None)
    stage = 2 if stage in (None, "") else int(stage)
    # As `accelerate launch` passes them on: lowercased, and a null one not at all (DeepSpeed's default: none)
    devices = (str(setting(f"offload_{part}_device", "none") or "none").lower() for part in ("optimizer", "param"))
    off_opt, off_par = (device != "none" for device in devices)
    found = Engine(f"zero{stage}", source, per_node, off_opt, off_par, int(5e8), stage == 3, clip)
    saves = _true(setting("zero3_save_16bit_model", False))  # accelerate's default: false
    return replace(found, refused=None if stage != 3 or saves else _unsaved_zero3(source, INLINE_SAVE_FIX))


def _deepspeed_file(path: Path, per_node: int, source: str, save_16bit=False) -> Engine:
    """A DeepSpeed JSON config (another stage as "zero<stage>", for the caller to refuse); `save_16bit` fills an
    "auto" of its gather-on-save."""
    config = _deepspeed_json(path)
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if type(stage) is not int:  # DeepSpeed takes a number only ("auto" is transformers' word for other fields)
        raise ConfigError(f'DeepSpeed config {str(path)!r}: zero_optimization "stage" {stage!r}: give 2 or 3')
    if stage not in (2, 3):
        return Engine(f"zero{stage}", source)
    # null is DeepSpeed's "no offload", as an absent section is
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    off_par = (zero.get("offload_param") or {}).get("device", "none") not in ("none", None)
    bucket = zero.get("reduce_bucket_size", 5e8)  # DeepSpeed's default
    bucket = None if bucket == "auto" else int(float(bucket))
    overlap = bool(zero.get("overlap_comm", stage == 3))
    clip = config.get("gradient_clipping")
    # DeepSpeed's spellings of the setting (its default: false); accelerate fills an "auto" of the first
    gathers = [zero.get(key) for key in GATHER_ON_SAVE]
    saves = any(_true(save_16bit if value == "auto" else value) for value in gathers)
    fix = f'"{GATHER_ON_SAVE[0]}": true in its zero_optimization'
    refused = None if stage != 3 or saves else _unsaved_zero3(source, fix)
    # An own part counts by its key alone, as transformers reads it: an empty or null "optimizer" or "scheduler" still
    # stood in for the recipe's and stopped in a traceback once the model had loaded (DeepSpeed built none)
    settings = {key: _setting(config, key) for key in (*MATCHED, "zero_force_ds_cpu_optimizer")} | {
        key: (config[key].get("type") if isinstance(config[key], dict) else None) or json.dumps(config[key])
        for key in OWN_PARTS
        if key in config
    }
    settings = tuple((key, value) for key, value in settings.items() if value not in (None, "auto"))
    found = Engine(f"zero{stage}", source, per_node, off_opt, off_par, bucket, overlap, clip, refused)
    return replace(found, deepspeed_settings=settings)


def _deepspeed_json(path: Path) -> dict:
    """A DeepSpeed config file's settings, refused naming the file (transformers' error names neither file nor fix)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        config = cause(e)
    if not isinstance(config, dict) or not isinstance(config.get("zero_optimization", {}), dict):
        why = config if isinstance(config, str) else "not a JSON object with a zero_optimization object"
        raise ConfigError(
            f"DeepSpeed config {str(path)!r} cannot be read ({why}): fix it (ds_config.json is an example)"
        )
    return config


# Settings transformers matches against the training arguments once the model has loaded (`trainer_config_process`),
# and the parts DeepSpeed runs in place of the recipe's optim and lr_scheduler_type (`deepspeed_optim_sched`)
MATCHED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "bf16", "fp16")
OWN_PARTS = ("optimizer", "scheduler")


def _setting(config: dict, key: str):
    """A DeepSpeed config's value of `key` (bf16, fp16: their `enabled`), None where it has none."""
    value = config.get(key)
    return value.get("enabled") if key in ("bf16", "fp16") and isinstance(value, dict) else value


def _with_accumulation(found: Engine, steps) -> Engine:
    """accelerate's inline gradient_accumulation_steps, which becomes the DeepSpeed config's."""
    if steps in (None, "auto") or not found.deepspeed:
        return found
    return replace(found, deepspeed_settings=(("gradient_accumulation_steps", int(steps)),))


# What `accelerate launch` refuses beside a deepspeed_config_file (accelerate's `_deepspeed_config_checks`)
SET_IN_THE_FILE = set(
    "gradient_accumulation_steps gradient_clipping zero_stage offload_optimizer_device offload_param_device "
    "offload_param_nvme_path offload_optimizer_nvme_path zero3_save_16bit_model".split()
)


INLINE_SAVE_FIX = "zero3_save_16bit_model: true under deepspeed_config in the accelerate config"
# DeepSpeed's names for "gather the ZeRO-3 weights when the model is saved" (deepspeed/runtime/zero/config.py)
GATHER_ON_SAVE = tuple(
    "stage3_gather_16bit_weights_on_model_save gather_16bit_weights_on_model_save "
    "stage3_gather_fp16_weights_on_model_save".split()
)


def _true(value) -> bool:
    """A boolean setting as YAML, JSON or accelerate's environment give it."""
    return str(value).lower() == "true"


def _unsaved_zero3(source: str, fix: str) -> str:
    """ZeRO-3 not gathering weights on save: the final folder would hold DeepSpeed shards, after a single warning."""
    return (
        f"the DeepSpeed ZeRO-3 config ({source}) does not gather the weights when the model is saved, so the final "
        f"model would be written as DeepSpeed shards, without model.safetensors: set {fix} "
        "(configs/accelerate/ds_zero3.json does)"
    )


# Who clips, per engine: each scales by max_norm / norm, one norm over every rank's gradients (logged: grad_norm).
CLIPPED_BY = {
    "single": "torch's clip_grad_norm_",
    "ddp": "torch's clip_grad_norm_, after the all-reduce",
    "fsdp2": "accelerate's clip_grad_norm_, one norm over every rank's shards",
    "zero2": "DeepSpeed's engine (gradient_clipping, filled from max_grad_norm), one norm over every rank's partition",
    "zero3": "DeepSpeed's engine (gradient_clipping, filled from max_grad_norm), one norm over every rank's partition",
}


def gradient_clipping(max_grad_norm: float, run_engine: Engine) -> dict:
    """The clipping in effect; refused before anything loads: a DeepSpeed config that never clips, or one whose number
    differs from max_grad_norm (transformers stops on it once the model has loaded)."""
    if max_grad_norm < 0:
        raise ConfigError(
            f"max_grad_norm must be >= 0 (got {max_grad_norm:g}): the global gradient norm to clip at, "
            "0 for no clipping (the OLMo 3 recipes: 1.0)"
        )
    clip = run_engine.gradient_clipping
    if run_engine.deepspeed and clip is None and max_grad_norm > 0:
        raise ConfigError(
            f"the DeepSpeed config ({run_engine.source}) has no gradient_clipping, so DeepSpeed would "
            f'not clip while max_grad_norm is {max_grad_norm:g}: add "gradient_clipping": "auto" '
            "to it (filled from max_grad_norm), or pass --max_grad_norm 0"
        )
    if run_engine.deepspeed and clip not in (None, "auto") and float(clip) != max_grad_norm:
        raise ConfigError(
            f"the DeepSpeed config ({run_engine.source}) sets gradient_clipping {clip} and max_grad_norm "
            f'is {max_grad_norm:g}: set "gradient_clipping": "auto" there (it then takes '
            f"max_grad_norm), or pass --max_grad_norm {clip}"
        )
    if max_grad_norm == 0:
        return {"max_grad_norm": None, "clipped_by": "none (max_grad_norm 0)"}
    # An engine the dry run cannot plan: its source says why (not what clips), and the launch's engine will clip
    by = CLIPPED_BY.get(run_engine.name) or f"the launch's engine, not planned ({run_engine.source})"
    return {"max_grad_norm": max_grad_norm, "clipped_by": by}


def check_mixed_precision(training, run_engine: Engine) -> None:
    """Refuses accelerate's mixed precision where the recipe sets neither bf16 nor fp16: TrainingArguments would
    autocast in it under a record of fp32."""
    mixed, where = run_engine.mixed_precision, run_engine.mixed_precision_from
    if training.bf16 or training.fp16 or mixed == "no":
        return
    flag = f"pass --{mixed} true to train in {mixed}, or " if mixed in ("bf16", "fp16") else ""
    raise ConfigError(
        f"mixed_precision is {mixed} ({where}) and the recipe sets neither bf16 nor fp16: the run would train with "
        f"{mixed} autocast under a record of fp32: {flag}set mixed_precision: 'no' in the accelerate config "
        "(ACCELERATE_MIXED_PRECISION unset) to train in fp32"
    )


def check_deepspeed_settings(training, world: int, run_engine: Engine) -> None:
    """A DeepSpeed config's own optimizer or scheduler, or a MATCHED value that differs (transformers stops on it after
    loading), refused before anything loads. The step plan runs a step's micro-batches: DeepSpeed accumulates 1."""
    settings = dict(run_engine.deepspeed_settings)
    replaced = {"optimizer": ("optim", training.optim), "scheduler": ("lr_scheduler_type", training.lr_scheduler_type)}
    if own := [key for key in OWN_PARTS if key in settings]:
        theirs = " and ".join(f'"{key}" ({settings[key]})' for key in own)
        ours = " and ".join(f"{replaced[key][0]} {getattr(replaced[key][1], 'value', replaced[key][1])}" for key in own)
        raise ConfigError(
            f"the DeepSpeed config ({run_engine.source}) has its own {theirs}, which DeepSpeed would run in place of "
            f"the recipe's {ours}: remove {' and '.join(f'{key!r}' for key in own)} from it, and the run uses the "
            "recipe's"
        )
    per_gpu = training.per_device_train_batch_size
    expected = {
        "train_micro_batch_size_per_gpu": per_gpu,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world * per_gpu,
        "bf16": bool(training.bf16),
        "fp16": bool(training.fp16),
    }
    differ = [
        f"{key} {json.dumps(settings[key])}" for key in MATCHED if key in settings and settings[key] != expected[key]
    ]
    if differ:
        raise ConfigError(
            f"the DeepSpeed config ({run_engine.source}) sets {', '.join(differ)}, which transformers would refuse "
            f'once the model has loaded: set {"it" if len(differ) == 1 else "them"} to "auto" there, filled from '
            "the run (its step plan runs each step's micro-batches; the recipe's bf16 and fp16)"
        )


def check_offloaded_optimizer(training, run_engine: Engine) -> None:
    """Under ZeRO optimizer offload accelerate puts DeepSpeed's CPU Adam in place of any optimizer but AdamW and
    Adagrad (`map_pytorch_optim_to_deepspeed`)."""
    from transformers import Trainer

    forced = dict(run_engine.deepspeed_settings).get("zero_force_ds_cpu_optimizer", True)
    if not (run_engine.deepspeed and run_engine.offload_optimizer and forced):
        return
    try:
        optimizer_cls = Trainer.get_optimizer_cls_and_kwargs(training)[0]
    except Exception:  # noqa: BLE001 - options.check_optimizer names what cannot be built here
        return
    kept = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, kept):
        return
    optim = getattr(training.optim, "value", training.optim)
    raise ConfigError(
        f"optim {optim} under ZeRO optimizer offload ({run_engine.source}) would train as DeepSpeed's CPU Adam: "
        "accelerate puts it in place of any optimizer but AdamW and Adagrad: use optim adamw_torch_fused (the "
        'recipes\') or adagrad, train without offload_optimizer, or set "zero_force_ds_cpu_optimizer": false in '
        "the DeepSpeed config file (the optimizer then steps on the CPU as it is)"
    )


def check_processes_per_node(per_node: int, gpus: int) -> None:
    """Refuses more processes on a node than GPUs (`gpus`, 0 without CUDA): NCCL stops at the first collective."""
    if gpus and per_node > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ConfigError(
            f"{plural(per_node, 'process')} were started on this node, which has {plural(gpus, 'GPU')}{seen}: "
            f"start one per GPU (`accelerate launch --num_processes` counts all nodes' processes: {gpus} x nodes), or "
            "use scripts/launch.sh, which starts one per GPU of the job"
        )


DDP_SETTINGS = ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")


def check_ddp_settings(training, run_engine: Engine) -> None:
    """Refuses ddp_* settings under DeepSpeed or FSDP2, which do not use torch's DDP: recorded, never applied."""
    named = [name for name in DDP_SETTINGS if getattr(training, name) is not None]
    if named and run_engine.name in ("zero2", "zero3", "fsdp2"):
        raise ConfigError(
            f"{named[0]} would be ignored: it sets torch's DDP, and this run trains under {NAMES[run_engine.name]} "
            f"({run_engine.source}): remove {named[0]} (it applies to a DDP launch only)"
        )


def load_dtype(recipe, engine: Engine, config=None) -> str | None:
    """The dtype the weights load in: bf16 under DeepSpeed with bf16 where the recipe names none (its optimizer keeps
    an fp32 copy), halving host memory; FSDP2 keeps fp32 parameters."""
    if engine.deepspeed and recipe.training.bf16 and "dtype" not in recipe.given:
        return "bfloat16"
    return model_dtype(recipe, config)


def model_dtype(recipe, config=None) -> str | None:
    """The recipe's dtype, `auto` resolved from the model's `config` where it has one, as transformers does."""
    dtype = recipe.model.dtype
    if dtype == "auto" and config is not None and getattr(config, "dtype", None) is not None:
        return str(config.dtype).removeprefix("torch.")
    return dtype


def check_half_weights(recipe, engine: Engine, config=None) -> None:
    """Refuses weights that train in bf16/fp16 with no fp32 copy: an Adam step rounds away on any weight above ~512x
    (fp16: 4096x) the learning rate. DeepSpeed, FSDP2 under mixed precision and PEFT's adapter keep fp32."""
    t, dtype = recipe.training, model_dtype(recipe, config)
    half, above = {"bfloat16": ("bf16", 512), "float16": ("fp16", 4096)}.get(dtype, (None, 0))
    if half is None or recipe.model.use_peft or ((t.bf16 or t.fp16) and (engine.deepspeed or engine.name == "fsdp2")):
        return
    raise ConfigError(
        f"--dtype {recipe.model.dtype}{f' (this model: {dtype})' * (dtype != recipe.model.dtype)} would train the "
        f"weights themselves in {half}, with no fp32 copy under {NAMES.get(engine.name, engine.name)}: an update near "
        f"the learning rate ({t.learning_rate:g}) rounds away on any weight above about {above * t.learning_rate:.1g}: "
        "remove --dtype (the weights train in float32, computed in bf16 with bf16: true), train under DeepSpeed or "
        f"FSDP2 with {half}: true, or train a LoRA adapter (use_peft)"
    )


RAM_EFFICIENT = "CPU_RAM_EFFICIENT_LOADING"  # accelerate's FSDP_<key> variable, the config's fsdp_<key> (lowercase)


def one_per_node(found: Engine, world: int, accelerate_config: str) -> Engine:
    """A dry run planning `world` > 1 processes on an accelerate config of `distributed_type: NO` (what `accelerate
    config` writes for one GPU): `accelerate launch` runs its simple launcher for it, one process per node whatever
    its `--num_processes`, so a 4-GPU job (scripts/launch.sh) trained alone on one GPU, its plan and log saying 4
    processes, and exited 0. Refused, as the job refuses it before it launches."""
    if found.name != "single" or world <= 1 or accelerate_config.lower() in ("", "none") or found.refused:
        return found
    return replace(
        found,
        refused=f"accelerate config {accelerate_config} has distributed_type NO, for which `accelerate launch` starts "
        f"one process per node, not the {world} planned: name one that starts them all, accelerate_config.yaml "
        "(ZeRO-2), configs/accelerate/zero3.yaml or fsdp2.yaml, or one of distributed_type MULTI_GPU",
    )


def as_it_runs(found: Engine, world: int, on_gpus: bool) -> Engine:
    """The engine that runs: FSDP2 as one CPU process is "single"; fewer processes than a node's GPUs run on one node
    of that many (scripts/launch.sh asks Slurm for just those GPUs)."""
    if 1 < world < found.gpus_per_node:
        found = replace(found, gpus_per_node=world)
    if found.name != "fsdp2" or world > 1 or on_gpus:
        return found
    why = "FSDP2 shards over GPUs, or over 2 or more CPU processes; one process on CPU runs unsharded"
    return replace(found, name="single", source=f"{found.source}: {why}", offload_params=False)


def enable_on_cpu(engine: Engine) -> None:
    """Makes an FSDP or DDP launch distributed on a CPU-only node: accelerate 1.15 turns them on for accelerators only,
    leaving independent processes."""
    if torch.cuda.is_available() or engine.name not in ("fsdp2", "ddp"):
        return
    state = PartialState()
    # `--use_cpu true` (how a bf16 run goes on a CPU) makes accelerate's state MULTI_CPU, which never becomes FSDP:
    # the FSDP2 launch trained as DDP under a record of FSDP2, writing whole checkpoints its rerun refused to resume.
    unsharded = (DistributedType.NO, DistributedType.MULTI_CPU) if engine.name == "fsdp2" else (DistributedType.NO,)
    if state.distributed_type in unsharded and state.num_processes > 1:
        # FSDP: AcceleratorState sets it up for accelerator types only, then makes it FSDP; MULTI_CPU wraps DDP.
        kind = DistributedType.MULTI_GPU if engine.name == "fsdp2" else DistributedType.MULTI_CPU
        upstream.set_distributed_type(kind)


FSDP_UNITS = "FSDP_TRANSFORMER_CLS_TO_WRAP"  # accelerate's plugin reads the classes to wrap from it as it is made


@contextlib.contextmanager
def fsdp_units(engine: Engine, model):
    """FSDP2 shards one unit per decoder layer, by class name: accelerate takes the names in the model's
    `_no_split_modules` and refuses one that no module of the model has, which the text-only model of a multimodal
    family lists (Qwen3.5's vision blocks, Gemma 4's vision and audio layers: "Could not find the transformer layer
    class ..."). Under accelerate's transformer-based policy, with no classes named in the accelerate config
    (`fsdp_transformer_layer_cls_to_wrap`, the user's word, kept), the accelerator is made wrapping those of the list
    the model has."""
    policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "").upper()
    units = []
    if engine.name == "fsdp2" and policy == "TRANSFORMER_BASED_WRAP" and not os.environ.get(FSDP_UNITS):
        present = {type(module).__name__ for module in model.modules()}
        units = sorted(upstream.no_split_modules(model) & present)
    with mock.patch.dict(os.environ, {FSDP_UNITS: ",".join(units)}) if units else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def own_class(model):
    """`model` under its own class for the block. FSDP2's fully_shard makes it an `FSDP<class>` subclass, made in
    torch's module, which transformers' save_pretrained of a model with its own code (auto_map) took for that code:
    the final folder held torch's FSDP source files, its config's auto_map named `_fsdp_init.FSDP<class>`, and it did
    not load. (transformers strips the prefix from `architectures` alone.)"""
    from torch.distributed.fsdp import FSDPModule

    sharded = type(model)
    own = [base for base in sharded.__bases__ if base is not FSDPModule]
    if not isinstance(model, FSDPModule) or len(own) != 1:
        yield
        return
    model.__class__ = own[0]
    try:
        yield
    finally:
        model.__class__ = sharded


PEFT_PREFIX = "base_model.model."  # a PEFT model's state-dict names start so; the base layer's weight is under:
PEFT_BASE_PARTS = ("base_layer", "original_module")  # an adapted layer's, and a trained copy's (modules_to_save)


def base_weight_name(name: str) -> str | None:
    """A PEFT model's state-dict name as its base model names that weight; None for the adapter's own tensors."""
    parts = name.removeprefix(PEFT_PREFIX).split(".")
    if any(part.startswith("lora_") or part == "modules_to_save" for part in parts):
        return None
    return ".".join(part for part in parts if part not in PEFT_BASE_PARTS)


def weights_sha256(model, is_main: bool, zero3: bool, base: bool = False) -> str | None:
    """sha256 of a model's full weights as TRL's `hash_module` takes it, on the main process; under ZeRO-3 gathered
    first (TRL would hash empty partitions), so every rank calls it. `base`: a PEFT model's base weights alone."""
    if zero3:
        import deepspeed  # here: a slow import only ZeRO-3 needs
    h, state = hashlib.sha256(), model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each of their names
    names = {name: base_weight_name(name) if base else name for name in state}
    for name in sorted((n for n in names if names[n] is not None), key=names.get):
        param, tensor = params.get(name), state[name]
        gathered = zero3 and param is not None
        with deepspeed.zero.GatheredParameters([param]) if gathered else contextlib.nullcontext():
            if is_main:
                full = (param.data if gathered else tensor).detach().cpu()
                h.update(str(full.dtype).encode())
                if full.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                    full = full.to(torch.float32)
                h.update(full.numpy().tobytes())
    return h.hexdigest() if is_main else None


def weights_sample(model) -> str:
    """A fingerprint of the weights this rank holds: each parameter's name, dtype, shape and 64 of its values spread
    over it (a fine-tune or another commit changes nearly all of them), exact bytes, a small copy per parameter where
    the full hash (`weights_sha256`) reads every weight: for ranks to compare what each loaded for a live reference."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        flat = param.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // 64)][:64].cpu().contiguous()
        h.update(f"{name} {picked.dtype} {tuple(param.shape)}".encode())
        h.update(picked.view(torch.uint8).numpy().tobytes() if picked.numel() else b"")
    return h.hexdigest()


def start_processes(training, run_engine: Engine):
    """This launch's process group, made first with the recipe's `ddp_timeout` (a bare `PartialState()` gets 10 minutes
    and TrainingArguments keeps it), which is also torch's default for later groups (DeepSpeed's)."""
    timeout = timedelta(seconds=training.ddp_timeout)
    upstream.set_default_collective_timeout(timeout)
    # As TrainingArguments would make it (`ddp_backend`: gloo on CPU-only nodes); DeepSpeed picks its own.
    backend = None if run_engine.deepspeed else training.ddp_backend
    state = PartialState(timeout=timeout, **({"backend": backend} if backend else {}))
    if dist.is_initialized() and dist.get_rank() == 0:  # torch's rank: accelerate's is not settled yet on CPU
        held = upstream.group_timeouts()[upstream.default_group_name()]
        print(f"Collective timeout: {held:.0f} s (ddp_timeout) for every process group", flush=True)
    return state


def end_processes() -> None:
    """Destroys every process group after the last collective: left to the exit, a rank could die with SIGABRT."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

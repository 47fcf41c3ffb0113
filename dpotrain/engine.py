"""The engine a launch asked for — one process, DDP, DeepSpeed ZeRO-2 or ZeRO-3, FSDP2 — and what each needs.

`accelerate launch --config_file X` tells the training processes through its environment which engine to use; this
module reads it, refuses what the project does not support (before anything loads), and holds the few places where an
engine changes what the run must do:
- ZeRO-3 and FSDP2 shard the weights, so every rank takes part in every forward (the reference stage's filler
  micro-batches, sample generation with `synced_gpus`), and the weights' hash must be taken from the full weights;
- the weights are loaded in the dtype the engine trains them in, without a full host copy per process where the
  engine can avoid it (ZeRO-3's `zero3_init_flag`, FSDP2's RAM-efficient loading: accelerate's configs);
- accelerate 1.15 turns FSDP and DDP on only for accelerator devices (accelerate/state.py: the FSDP branch sits under
  MULTI_GPU/..., and a CPU launch without `use_cpu` comes out as DistributedType.NO): on a CPU-only node such a
  launch would run independent processes that never exchange a gradient. `enable_on_cpu` makes accelerate set them
  up, so CPU-only clusters and the tests run the real engine.
"""

import contextlib
import json
import os
from dataclasses import dataclass

import torch

from .errors import ConfigError

SUPPORTED = "one process, DDP, DeepSpeed ZeRO-2 or ZeRO-3, FSDP2 (accelerate_config.yaml, configs/accelerate/)"


@dataclass(frozen=True)
class Engine:
    name: str  # "single", "ddp", "zero2", "zero3", "fsdp2"

    @property
    def shards_weights(self) -> bool:
        """Every forward gathers weights from every rank: all ranks must run each forward together."""
        return self.name in ("zero3", "fsdp2")

    @property
    def deepspeed(self) -> bool:
        return self.name.startswith("zero")


def launched() -> Engine:
    """The engine of this process's launch, from the environment `accelerate launch` sets; refuses the others."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        stage = _zero_stage()
        if stage not in (2, 3):
            raise ConfigError(f"DeepSpeed ZeRO stage {stage} is not supported: use ZeRO-2 (accelerate_config.yaml) or "
                              "ZeRO-3 (ACCELERATE_CONFIG=configs/accelerate/zero3.yaml)")  # fmt: skip
        return Engine(f"zero{stage}")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ConfigError(f"FSDP version {version} is not supported: set fsdp_version: 2 in the accelerate config "
                              "(configs/accelerate/fsdp2.yaml)")  # fmt: skip
        return Engine("fsdp2")
    for flag in ("ACCELERATE_USE_MEGATRON_LM", "ACCELERATE_USE_SAGEMAKER"):
        if os.environ.get(flag, "false").lower() == "true":
            raise ConfigError(f"{flag.removeprefix('ACCELERATE_USE_').lower()} is not supported: use {SUPPORTED}")
    return Engine("ddp" if world > 1 else "single")


def _zero_stage() -> int:
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and path != "none" and os.path.isfile(path):
        stage = json.loads(open(path).read()).get("zero_optimization", {}).get("stage", stage)
    return int(stage) if stage is not None else 0


def load_dtype(recipe, engine: Engine) -> str | None:
    """The dtype the weights load in when the recipe names none (TRL's default is float32).

    DeepSpeed trains bf16 weights and keeps its own fp32 master copy in the optimizer, so with bf16 the weights load in
    bf16: half the host memory per process, as open-instruct does. FSDP2 keeps fp32 parameters and computes in bf16
    (its mixed-precision policy), so they load in fp32 (once, on the main process: RAM-efficient loading)."""
    if "dtype" in recipe.given:
        return recipe.model.dtype
    if engine.deepspeed and recipe.training.bf16:
        return "bfloat16"
    return recipe.model.dtype


def enable_on_cpu(engine: Engine) -> None:
    """Before accelerate builds its state on a CPU-only node: make an FSDP or DDP launch distributed (see the module
    doc). A no-op with a GPU, for one process, and for DeepSpeed (which accelerate sets up on CPU with gloo)."""
    if torch.cuda.is_available() or engine.name not in ("fsdp2", "ddp"):
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type == DistributedType.NO and state.num_processes > 1:
        # FSDP: the branch of AcceleratorState that sets it up is taken for accelerator types only; it then becomes
        # DistributedType.FSDP. DDP: MULTI_CPU makes accelerate wrap the model in DistributedDataParallel.
        kind = DistributedType.MULTI_GPU if engine.name == "fsdp2" else DistributedType.MULTI_CPU
        PartialState._shared_state["distributed_type"] = kind


def zero3_weights_sha256(model, is_main: bool) -> str | None:
    """sha256 of the full weights of a ZeRO-3 model, as TRL's `hash_module` takes it of an unsharded one (so the
    reference cache key does not depend on the engine), on the main process. Each tensor is gathered from its shards
    first: a collective, every rank calls this. (TRL hashes the empty local partitions.)"""
    import hashlib

    import deepspeed

    h = hashlib.sha256()
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each of their names
    for name, tensor in sorted(model.state_dict().items()):
        param = params.get(name)
        with deepspeed.zero.GatheredParameters([param]) if param is not None else contextlib.nullcontext():
            if is_main:
                full = (param.data if param is not None else tensor).detach().cpu()
                h.update(str(full.dtype).encode())
                if full.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                    full = full.to(torch.float32)
                h.update(full.numpy().tobytes())
    return h.hexdigest() if is_main else None


def start_processes(timeout_s: int):
    """The process group of this launch, made here, first, with the recipe's collective timeout (`ddp_timeout`).

    The first group made decides: made without a timeout (a bare `PartialState()`), it gets torch's and DeepSpeed's
    default of 10 minutes, and the Trainer's `ddp_timeout` no longer applies (TrainingArguments finds the group made
    and keeps it). Anything one rank does alone for longer than the timeout — the final model's write, a large data
    set tokenized main process first — ends the job while the other ranks wait at a barrier."""
    from datetime import timedelta

    from accelerate import PartialState

    return PartialState(timeout=timedelta(seconds=timeout_s))


def group_timeouts() -> dict[str, float]:
    """Every process group of this process, by torch's name for it ("0" is the default group), and its collective
    timeout in seconds as torch holds it (the shortest of its backends: NCCL for GPUs, gloo beside it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_available() or not dist.is_initialized():
        return {}
    found = {}
    for group in c10d._world.pg_map:
        seconds = [group._get_backend(device).options._timeout.total_seconds() for device in group._device_types]
        found[c10d._world.pg_names.get(group, "?")] = min(seconds)
    return found

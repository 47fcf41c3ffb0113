"""TR-DPO's moved reference (`sync_ref_model`) in a checkpoint, under every engine: the reference TRL moves toward the
policy as it trains is state a resume needs (`resume.REFERENCE_FILE`). One file format for all: the model's own
parameter names, full tensors as held (bf16 or fp32), a tied weight once under the name `safetensors.torch.save_model`
keeps. One process, DDP and ZeRO-2 hold the whole reference on each rank (ZeRO-2: TRL gives it DeepSpeed's stage 0);
ZeRO-3 and FSDP2 shard it over the ranks, so its save and load there are collectives every rank enters."""

from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from dpotrain.recipe.errors import RunError

SHARDED = ("zero3", "fsdp2")  # the engines whose reference each rank holds a shard of


def save(trainer, path: Path) -> None:
    """Every rank calls it; the main process writes. Under ZeRO-3 the reference is gathered one module at a time to
    the main process's host memory (GPU memory bounded by one module's weights), under FSDP2 one tensor at a time
    (`accelerator.get_state_dict`, as the final model is saved)."""
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    if trainer.engine.name not in SHARDED:  # whole on the main process: written from it, nothing gathered
        if trainer.is_world_process_zero():
            safetensors.torch.save_model(reference, str(path))
        return
    state = trainer.accelerator.get_state_dict(trainer.ref_model)
    if trainer.is_world_process_zero():
        kept = {name: tied[0] for tied in tied_names(reference) for name in tied}
        state = {k: v.contiguous() for k, v in state.items() if kept.get(k, k) == k}
        safetensors.torch.save_file(state, str(path), metadata={"format": "pt"})


def load(trainer, path: Path) -> None:
    """Every rank calls it, after the model is prepared and before the first step; each rank's reference (or shard of
    it) then holds the saved weights exactly."""
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    if trainer.engine.name == "zero3":
        load_zero3(reference, path, trainer.is_world_process_zero())
    elif trainer.engine.name == "fsdp2":
        load_fsdp2(reference, path, trainer.is_world_process_zero())
    else:  # every rank's whole copy
        # "cpu", not the "cpu:0" a DeepSpeed run with --use_cpu true (a bf16 run on a CPU) has: safetensors refuses it
        # ("device cpu:0 is invalid"), and every resume of such a TR-DPO run ended in that traceback
        device = trainer.accelerator.device
        safetensors.torch.load_model(reference, str(path), device=device.type if device.type == "cpu" else str(device))


def tied_names(model) -> list[list[str]]:
    """Each parameter's names, sorted (tied weights have several: the first is the one the file holds, as
    `safetensors.torch.save_model` keeps it)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [sorted(group) for group in names.values()]


def load_zero3(reference, path: Path, main: bool) -> None:
    """Module by module, as DeepSpeed gathers a ZeRO-3 model to save it: every rank gathers the module's parameters
    (`GatheredParameters`, the same order on every rank), the main process copies the file's tensors in, and DeepSpeed
    broadcasts them from it and partitions them again as the context ends (`modifier_rank=0`). Buffers are not
    partitioned: every rank copies its own."""
    import deepspeed

    stored = {name: group[0] for group in tied_names(reference) for name in group}
    buffers = set(reference.state_dict()) - set(stored)  # the persistent ones; no gather (parameters stay empty)
    with safe_open(str(path), framework="pt", device="cpu") as file:  # read one tensor at a time, not the file whole
        missing = sorted((set(stored.values()) | buffers) - set(file.keys()))
        unexpected = sorted(set(file.keys()) - set(stored.values()) - buffers)
        if missing or unexpected:  # every rank sees it: none enters a gather the others skip
            raise RunError(f"{path} does not match the reference model: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name in buffers:
                reference.get_buffer(name).copy_(file.get_tensor(name))
            for prefix, module in reference.named_modules():
                params = list(module.named_parameters(recurse=False))
                with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                    for name, param in params if main else ():
                        param.copy_(file.get_tensor(stored[f"{prefix}.{name}" if prefix else name]))


def load_fsdp2(reference, path: Path, main: bool) -> None:
    """The main process reads the file and torch sends each rank its shard (`broadcast_from_rank0`); a tied weight
    is given under each of its names, as the model's state dict has them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {}
    if main:
        state = safetensors.torch.load_file(str(path))
        for group in tied_names(reference):
            state.update({name: state[group[0]] for name in group[1:] if group[0] in state})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(reference, state, options=options)

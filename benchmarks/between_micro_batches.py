"""What each engine holds in gradients between a step's micro-batches, against what the memory plan counts for them.

    python -m accelerate.commands.launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 \
        benchmarks/between_micro_batches.py [--defer] [--layers 8 --hidden 512]
    (also accelerate_config.yaml for ZeRO-2, configs/accelerate/zero3.yaml for ZeRO-3)

Two processes on CPU (gloo): an OLMo 3-shaped model in bf16 mixed precision, as the engines set it up for a bf16
recipe, two steps of four micro-batches with the gradient sync deferred as training defers it
(`Engine.defers_gradient_sync`; `--defer`: FSDP2's `no_sync` on every micro-batch but the last, as before). After the
second step's first micro-batch, the main process prints one JSON line: the gradient bytes this process holds, counted
from the tensors (FSDP2: unsharded and sharded gradients; ZeRO-2: its bf16 gradient partition; ZeRO-3: its fp32
gradient partition), what the plan counts for them per GPU (dpotrain/plan/memory.py), and the seconds of the last step
(gloo on a shared CPU: not what GPUs take).
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.getcwd())


def fsdp2_gradient_bytes(model) -> dict[str, int]:
    from torch.distributed.fsdp import FSDPModule

    held = {"unsharded": 0, "sharded": 0}
    seen = set()  # a tensor once
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group else []:
            sharded = param.sharded_param.grad.to_local() if param.sharded_param.grad is not None else None
            for kind, grad in (
                ("unsharded", param.unsharded_accumulated_grad),
                ("unsharded", getattr(param, "_unsharded_param", None) is not None and param._unsharded_param.grad),
                ("sharded", sharded),
            ):
                if isinstance(grad, torch.Tensor) and grad.data_ptr() not in seen:
                    seen.add(grad.data_ptr())
                    held[kind] += grad.numel() * grad.element_size()
    return held


def deepspeed_gradient_bytes(model, stage: int) -> dict[str, int]:
    """ZeRO-2: the reduced gradients of this rank's partition, per parameter group (`all_grad_tensors`); ZeRO-3: its
    flat gradient partition."""
    optimizer = model.optimizer
    if stage == 2:
        tensors = [t for group in optimizer.all_grad_tensors.values() if group for t in group if t is not None]
    else:
        tensors = [optimizer.grad_partitions_flat_buffer]
    return {"partition": sum(t.numel() * t.element_size() for t in tensors)}


def planned_gradient_bytes(name: str, params: int, world: int) -> int:
    """The gradients among the plan's model states (`memory.model_state_bytes`): ZeRO-2's bf16 partition, ZeRO-3's
    and FSDP2's fp32 shards."""
    return int({"zero2": 2, "zero3": 4, "fsdp2": 4}[name] * params / world)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--defer", action="store_true", help="FSDP2: no_sync on every micro-batch but a step's last")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, Olmo3Config

    from dpotrain.cluster import engine
    from dpotrain.recipe import upstream

    run_engine = engine.launched()
    # What start_processes reads of the training arguments: their timeout, and gloo where there is no GPU.
    training = SimpleNamespace(ddp_timeout=1800, ddp_backend=None if torch.cuda.is_available() else "gloo")
    engine.start_processes(training, run_engine)
    engine.enable_on_cpu(run_engine)  # FSDP2 on a CPU-only machine, as train_dpo.py sets it up
    defer = args.defer or run_engine.defers_gradient_sync
    accelerator = Accelerator(mixed_precision="bf16")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if run_engine.deepspeed:  # what the Trainer fills in for DeepSpeed's "auto" values
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds.update(
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            train_batch_size=world,
            gradient_clipping=0.0,
        )
    config = Olmo3Config(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=args.layers,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 creates them partitioned
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(2):
        start = time.perf_counter()
        for i in range(4):
            last = i == 3
            ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=accelerator.device)
            upstream.set_sync_gradients(accelerator, last)  # as RecipeDPOTrainer.training_step
            with accelerator.no_sync(model) if defer and not last else torch.enable_grad():
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
            if i == 0 and step == 1:
                if run_engine.deepspeed:
                    held = deepspeed_gradient_bytes(model, int(run_engine.name[-1]))
                else:
                    held = fsdp2_gradient_bytes(model)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) == 0:
        record = {
            "engine": run_engine.name,
            "deferred": defer,
            "parameters": params,
            "world": world,
            "held_gradient_bytes": held,
            "planned_gradient_bytes": planned_gradient_bytes(run_engine.name, params, world),
            "step_seconds": round(seconds, 2),
        }
        print(json.dumps(record), flush=True)
    # Every rank's process groups ended before the interpreter's exit, as train_dpo.py ends them: left to it, a rank's
    # collective threads can be torn down out of order ("terminate called without an active exception", SIGABRT).
    engine.end_processes()
    # ...and still, once in CI (session 65, ZeRO-3 on CPU), a rank aborted that way after the record was printed and its
    # groups ended: a thread of DeepSpeed's CPU collectives torn down at the interpreter's exit. What this script
    # measures is done and printed, so the exit skips that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

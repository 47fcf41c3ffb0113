"""What FSDP2 holds between a step's micro-batches, with and without deferring the gradient sync (`no_sync`).

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 \
        benchmarks/between_micro_batches.py [--defer] [--layers 8 --hidden 1024]

Two processes on CPU (gloo): an OLMo 3-shaped model in bf16 mixed precision, as accelerate sets FSDP2 up for a bf16
recipe, two steps of four micro-batches; after each step's first micro-batch it reports the gradients the process
holds (FSDP2's unsharded accumulated gradients and the sharded ones, counted from the tensors) and its resident memory
growth, and the time per step (not representative of GPUs: gloo on a shared CPU).
"""

import argparse
import os
import sys
import time

import psutil
import torch

sys.path.insert(0, os.getcwd())


def held_gradient_bytes(model) -> dict[str, int]:
    from torch.distributed.fsdp import FSDPModule

    unsharded = sharded = 0
    seen = set()  # a tied weight once
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        for param in group.fsdp_params if group else []:
            for grad in (param.unsharded_accumulated_grad, param._unsharded_param.grad
                         if hasattr(param, "_unsharded_param") else None):  # fmt: skip
                if grad is not None and grad.data_ptr() not in seen:
                    seen.add(grad.data_ptr())
                    unsharded += grad.numel() * grad.element_size()
            if param.sharded_param.grad is not None and param.sharded_param.grad.to_local().data_ptr() not in seen:
                g = param.sharded_param.grad.to_local()
                seen.add(g.data_ptr())
                sharded += g.numel() * g.element_size()
    return {"unsharded": unsharded, "sharded": sharded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--defer", action="store_true", help="no_sync on every micro-batch but a step's last")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, Olmo3Config

    from dpotrain import engine

    engine.start_processes(1800, None if torch.cuda.is_available() else "gloo")
    engine.enable_on_cpu(engine.launched())  # FSDP2 on a CPU-only machine, as train_dpo.py sets it up
    accelerator = Accelerator(mixed_precision="bf16")
    config = Olmo3Config(vocab_size=8192, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=args.layers)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    process = psutil.Process()
    for step in range(2):
        start = time.perf_counter()
        for i in range(4):
            last = i == 3
            ids = torch.randint(0, config.vocab_size, (1, args.tokens))
            before = process.memory_info().rss
            with accelerator.no_sync(model) if args.defer and not last else torch.enable_grad():
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
            if i == 0 and step == 1:  # optimizer state exists by now: only the gradients differ
                held = held_gradient_bytes(model)
                grown = process.memory_info().rss - before
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
    if accelerator.is_main_process:
        mib = 2**20
        print(f"{'deferred' if args.defer else 'every micro-batch'}: {params / 1e6:.1f}M parameters, after the first "
              f"micro-batch: unsharded gradients {held['unsharded'] / mib:.1f} MiB (2 x parameters = "
              f"{2 * params / mib:.1f}), sharded gradients {held['sharded'] / mib:.1f} MiB, resident memory "
              f"+{grown / mib:.1f} MiB; last step {seconds:.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

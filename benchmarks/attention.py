"""The training loop's speed per forward, at OLMo 3 7B's layer shape: plain TRL's padded batches against packed rows on
varlen FlashAttention, shared prompts on FlexAttention and shared prompts on sdpa.

    python benchmarks/attention.py --device cuda                       # H100/B200: 7B width, as many layers as fit
    python benchmarks/attention.py --device cuda --checkpointing none  # no recomputation: fewer layers fit
    python benchmarks/attention.py --device cuda --data multiturn      # long shared histories, short answers
    python benchmarks/attention.py --device cpu --tiny                 # a few seconds: the script itself still runs

Each path runs the same micro-batches (a token budget of `--budget` positions, cut by the project's own plan,
dpotrain/plan/plan.py, from Dolci-Think-like lengths at max_length 16384 or a multi-turn mix) through forward and
backward
of a random-init OLMo 3 (`Olmo3Config` defaults: hidden 4096, intermediate 11008, 32 heads, sliding window 4096 on 3
of 4 layers, vocabulary 100,278) in bf16, with activation checkpointing as `--checkpointing` says (all layers, as the
recipes allow; none; or every k-th layer) and as many decoder layers as the memory plan fits on the GPU with it (its
parts this loop holds, with the plan's allowance for the CUDA context and fragmentation; `--layers` fixes the count),
the loss the sum of the completions' log-probs (TRL's fused LM head): the step's work without the optimizer. Printed per
path: pair tokens/s per GPU (both sequences of every pair, whole),
training-loop MFU (the model FLOPs of what the path computed, dpotrain/forwards/flops.py, over the GPU's peak), the
memory
plan's activations + LM head + masks + bf16 weights and gradients beside `torch.cuda.max_memory_allocated`.
Paths whose kernel is not installed (flash_attn) are skipped with the reason. Token ids are random: speed does not
depend on them.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dpotrain.data.pair_lengths import PairLengths  # noqa: E402
from dpotrain.forwards import choice, flops, masks, packing  # noqa: E402  # noqa: E402
from dpotrain.forwards.shared_prompt import SharedPromptCollator  # noqa: E402
from dpotrain.plan import memory, plan  # noqa: E402

PATHS = ("trl", "packed_varlen", "shared_flex", "shared_sdpa")
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    sliding_window=64,
    vocab_size=1000,
    num_hidden_layers=4,
)


def lengths_of(data: str, pairs: int, max_length: int, seed: int):
    """(prompt, chosen completion, rejected completion) token counts: Dolci-Think-like, or multi-turn (the history
    ~85% of a pair, short last answers)."""
    from lengths_like import dolci_think

    prompt, chosen, rejected = dolci_think(pairs, seed)
    if data == "multiturn":
        rng = np.random.default_rng(seed)
        prompt = np.minimum(rng.lognormal(np.log(3000), 0.8, pairs).astype(np.int64), max_length - 64)
        chosen, rejected = (np.maximum(1, rng.lognormal(np.log(300), 0.7, pairs)).astype(np.int64) for _ in range(2))
    room = np.maximum(1, max_length - prompt)
    prompt = np.minimum(prompt, max_length - 1)
    return prompt, np.minimum(chosen, room), np.minimum(rejected, room)


def layers_that_fit(gpu_bytes: float, config, args) -> int:
    """The most decoder layers whose planned memory (`planned_bytes`, for the hungriest attention of the paths run),
    with the memory plan's allowance, fits `gpu_bytes`; at least 1."""
    import copy

    attns = [setup[0] for setup in (path_setup(p, args) for p in args.paths) if not isinstance(setup, str)] or ["sdpa"]
    best = 1
    for layers in range(1, 129):
        trial = copy.deepcopy(config)
        trial.num_hidden_layers = layers
        trial.layer_types = layer_types(layers)
        need = max(planned_bytes(trial, attn, args) for attn in attns)
        if need * (1 + memory.FRAGMENTATION) + memory.CONTEXT_GIB * memory.GIB > gpu_bytes:
            break
        best = layers
    return best


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def build_model(args, attn: str):
    from transformers import AutoModelForCausalLM, Olmo3Config
    from trl.trainer.utils import add_fused_lm_head

    spec = dict(TINY) if args.tiny else {"vocab_size": 100_278}
    config = Olmo3Config(max_position_embeddings=65536, **spec)
    config.num_hidden_layers = args.layers
    config.layer_types = layer_types(config.num_hidden_layers)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).to(args.device)
    if args.every:
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=args.every)
    add_fused_lm_head(model, outputs=("log_probs",))
    return model.train()


def examples(prompt, chosen, rejected, micro_batch, vocab: int, rng):
    return [
        {
            "prompt_ids": rng.integers(5, vocab, int(prompt[i])).tolist(),
            "chosen_ids": rng.integers(5, vocab, int(chosen[i])).tolist(),
            "rejected_ids": rng.integers(5, vocab, int(rejected[i])).tolist(),
        }
        for i in micro_batch
    ]


def path_setup(path: str, args) -> tuple[str, object] | str:
    """(attention, collator) of a path, or why it cannot run here."""
    cuda = args.device == "cuda"
    if path == "trl":  # TRL's padded collator, on the best attention it can use with an attention mask
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        best = choice.installed_varlen(cuda) or "sdpa"
        return best, DataCollatorForPreference(pad_token_id=0, max_length=args.max_length)
    if path == "packed_varlen":
        varlen = choice.installed_varlen(cuda)
        if varlen is None:
            return "no varlen FlashAttention kernel installed (requirements-gpu.txt)" if cuda else "needs CUDA"
        return varlen, packing.PackedPreferenceCollator(args.max_length, one_row=True, hidden_size=args.hidden)
    if path == "shared_flex":
        if not cuda and not args.tiny:
            return "FlexAttention has no backward on CPU"
        return "flex_attention", SharedPromptCollator(
            args.max_length, one_row=True, hidden_size=args.hidden, pad_to_multiple_of=masks.BLOCK
        )
    return "sdpa", SharedPromptCollator(args.max_length, hidden_size=args.hidden)


def step(model, batch: dict, backward: bool) -> None:
    if packing.is_packed(batch):
        log_probs = packing.forward(model, batch).log_probs
    else:
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        log_probs = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=labels,
            fused_lm_head=True,
            use_cache=False,
        ).log_probs
    if backward:
        log_probs.float().sum().backward()


def run_path(path: str, args, micro_batches, parts) -> dict:
    setup = path_setup(path, args)
    if isinstance(setup, str):
        return {"path": path, "skipped": setup}
    attn, collate = setup
    model = build_model(args, attn)
    model_flops = flops.ModelFlops.of(model)
    rng = np.random.default_rng(0)
    batches = [collate(examples(*parts, mb, model.config.vocab_size, rng)) for mb in micro_batches]
    device = torch.device(args.device)
    # FlexAttention has no backward on CPU: there the tiny run checks the forward only.
    backward = not (args.device == "cpu" and attn == "flex_attention")
    if attn == "flex_attention":  # the project's FlexAttention, compiled once for every width, as a run installs it
        from dpotrain.forwards import flex

        flex.install()
        if args.device == "cpu":  # inductor on a CPU takes minutes; the tiny run checks the path, not its speed
            flex.BACKEND = "eager"
    timings, tokens, model_work = [], 0, 0.0
    for k, batch in enumerate([batches[0]] * args.warmup + batches):
        batch = {key: v.to(device) if torch.is_tensor(v) else v for key, v in batch.items()}
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad() if not backward else torch.enable_grad():
            step(model, batch, backward)
        model.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        if k >= args.warmup:
            timings.append(time.perf_counter() - start)
            lens = batch["seq_lens"] if packing.is_packed(batch) else batch["attention_mask"].sum(1)
            tokens += int(lens.sum())
            shared = batch["seq_jumps"][batch["seq_offsets"] > 0] - 1 if "seq_offsets" in batch else None
            model_work += model_flops.training(lens, shared)
    seconds = sum(timings)
    peak = flops.peak_tflops(args.peak_tflops)
    result = {
        "path": path,
        "attention": attn,
        "micro_batches": len(timings),
        "seconds": round(seconds, 3),
        "pair_tokens_per_s": round(tokens / seconds, 1),
        "mfu": None if peak is None else round(model_work / seconds / (peak * 1e12), 4),
        "backward": backward,
    }
    if args.device == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["plan_gib"] = round(planned_bytes(model.config, attn, args) / memory.GIB, 2)
        torch.cuda.reset_peak_memory_stats()
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def planned_bytes(config, attn: str, args) -> float:
    """The memory plan's parts that this loop holds: bf16 weights and gradients, activations (with the checkpointing
    run), LM head, masks."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    activations, _ = memory.activation_bytes(config, args.budget, args.every or False)
    head = config.vocab_size * config.hidden_size
    shape = memory.ModelShape(
        params=params,
        trainable=params,
        largest_layer=head,
        decoder_layer=0,
        lm_head=head,
        lm_head_trains=True,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        load_bytes=2,
    )
    width = args.budget if attn == "flex_attention" else min(args.budget, packing.row_width_bound(args.max_length))
    masks_bytes = memory.mask_bytes(attn, args.budget, width, config, checkpointing=args.every == 1)
    return 4 * params + activations + memory.lm_head_bytes(shape, args.budget) + masks_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model and short sequences")
    parser.add_argument("--data", default="think", choices=["think", "multiturn"])
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=65536, help="positions per micro-batch (the plan's budget)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (compilation)")
    parser.add_argument("--layers", type=int, default=None, help="default: as many as the memory plan fits")
    parser.add_argument(
        "--checkpointing",
        default="all",
        help="activation checkpointing: all (as recipes allow), none, or k: every k-th layer",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="default: the GPU's, by name (flops.py)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the records to this JSON file, rewritten as each path ends"
    )
    args = parser.parse_args()
    if args.tiny:
        args.max_length, args.budget = min(args.max_length, 512), min(args.budget, 2048)
    args.hidden = TINY["hidden_size"] if args.tiny else 4096
    args.every = {"all": 1, "none": None}.get(args.checkpointing) or int(args.checkpointing)
    if args.tiny:
        args.layers = TINY["num_hidden_layers"]
    elif args.layers is None:
        from transformers import Olmo3Config

        gpu = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else 80 * memory.GIB
        args.layers = layers_that_fit(gpu, Olmo3Config(vocab_size=100_278, max_position_embeddings=65536), args)
    records = [{"layers": args.layers, "checkpointing": args.checkpointing, "budget": args.budget}]
    print(json.dumps(records[0]), flush=True)
    save(records, args.out)
    prompt, chosen, rejected = lengths_of(args.data, 4000, args.max_length, seed=0)
    for path in args.paths:
        share = path.startswith("shared")
        lengths = PairLengths.from_parts(prompt, chosen, rejected, args.max_length, share)
        step_plan = plan.StepPlan(128, 1, 0, args.budget, None, padded=path == "trl")
        micro_batches = [mb for step_ in plan.epoch_steps(lengths, step_plan, 0) for mb in step_[0]]
        result = run_path(path, args, micro_batches[: args.micro_batches], (prompt, chosen, rejected))
        records.append({"data": args.data, "device": args.device, **result})
        print(json.dumps(records[-1]), flush=True)
        save(records, args.out)


def save(records: list[dict], out: Path | None) -> None:
    """The records so far, the file replaced whole: a run cut off keeps every path it finished."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".partial").write_text(json.dumps(records, indent=2) + "\n")
        out.with_suffix(".partial").replace(out)


if __name__ == "__main__":
    main()

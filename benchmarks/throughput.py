"""Throughput of one DPO epoch: plain TRL `DPOTrainer` against this project's packed path, with and without shared
prompts, same everything else.

    python benchmarks/throughput.py                          # CPU: OLMo 3-shaped 4-layer model, 256 Dolci-like pairs
    python benchmarks/throughput.py --data-set multiturn     # long shared histories, short last answers
    python benchmarks/throughput.py --runs 3 --pairs 512 --paths trl shared
    python benchmarks/throughput.py --data-set multiturn --paths shared shared_all   # every assistant turn trained
    python benchmarks/throughput.py --device cuda --shape 1b --bf16 --pairs 1024 --max-length 4096 \
        --peak-tflops 989   # a GPU; MFU against the given peak

Each run is a fresh process, timed whole (imports, model load, tokenization, reference log-probs, training, one
epoch), and the paths alternate so that a slower machine phase hits all of them. All see the same random-init model,
the same pairs, the same pairs per optimizer step, the same activation-checkpointing setting, the same loss (OLMo 3's
length-normalized DPO) and the same max_length:
- plain TRL (`trl`): `trl.DPOTrainer` as shipped: padded micro-batches of `--batch` pairs, the reference model in
  memory;
- this project, packed (`packed`, `--share_prompt false`) and packed with each pair's prompt once (`shared`): the run's
  ready run (`dpotrain.train_stage.build_run`), micro-batches cut by a token budget of `--batch` x 2 x max_length
  positions (the most a padded micro-batch of `--batch` pairs can hold), reference log-probs scored once before training
  (into a fresh cache, so every run pays for them).
Printed: wall time, pairs/s, pair tokens/s (both sequences of each pair, whole: the same work on every path), the
positions each path ran per pair and their padding share, peak memory, MFU (model FLOPs of what each path computed,
dpotrain/forwards/flops.py), and the ratios. Data sets: `dolci`, a heavy-tailed mix of single-turn pairs; `multiturn`,
long
shared histories and short last answers (the prompt ~85% of a pair's tokens). Nothing is downloaded: the model is
built from a config, the tokenizer and data are generated.
"""

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    # OLMo 3's layout (3 sliding-window layers to 1 full, GQA, QK-norm) at CPU scale...
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=128,
    ),
    # ...and a ~1.3B one for a GPU (OLMo 3 7B's head size and window; 16 layers of hidden 2048).
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        sliding_window=4096,
    ),
}


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def build_model(folder: Path, shape: str, vocab_size: int | None) -> None:
    """Random-init OLMo 3 of `shape` with the built-in tokenizer (or a larger vocabulary for GPU-sized runs)."""
    import torch
    from transformers import AutoModelForCausalLM, Olmo3Config

    from dpotrain.data import builtin

    tokenizer = builtin.build_tokenizer()
    tokenizer.save_pretrained(folder)
    spec = SHAPES[shape]
    config = Olmo3Config(
        vocab_size=vocab_size or len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=65536,
        layer_types=layer_types(spec["num_hidden_layers"]),
        **spec,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def dolci_like_pairs(n: int, seed: int) -> list[dict]:
    """Preference pairs with Dolci's shape and a heavy-tailed length mix: most answers short, a long tail (log-normal
    word counts, median ~60 words, 1% past ~600), chosen and rejected lengths independent, so pairs are uneven."""
    rng = random.Random(seed)
    words = "the a of to and in is it that for on with as was at by this from be are or have an not one all".split()
    words += "model answer step first then next because value result check river cloud number reason".split()

    def text(median: float, sigma: float) -> str:
        count = max(1, min(int(rng.lognormvariate(0, sigma) * median), 3000))
        return " ".join(rng.choice(words) for _ in range(count))

    rows = []
    for _ in range(n):
        prompt = [{"role": "user", "content": text(25, 0.8)}]
        rows.append(
            {
                "chosen": prompt + [{"role": "assistant", "content": text(60, 1.0)}],
                "rejected": prompt + [{"role": "assistant", "content": text(45, 1.0)}],
            }
        )
    return rows


def multi_turn_pairs(n: int, seed: int) -> list[dict]:
    """Multi-turn preference pairs: a long shared history (2-5 earlier exchanges) and short last answers that differ,
    as in Dolci-Instruct's synthetic multi-turn pairs: the prompt is ~85% of a pair's positions (2P / (2P + C + R))."""
    rng = random.Random(seed)
    words = "the a of to and in is it that for on with as was at by this from be are or have an not one all".split()
    words += "model answer step first then next because value result check river cloud number reason".split()

    def text(median: float, sigma: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(rng.lognormvariate(0, sigma) * median))))

    rows = []
    for _ in range(n):
        history = []
        for _ in range(rng.randint(2, 5)):
            history += [{"role": "user", "content": text(25, 0.5)}, {"role": "assistant", "content": text(55, 0.5)}]
        prompt = [*history, {"role": "user", "content": text(25, 0.5)}]
        rows.append(
            {
                "chosen": prompt + [{"role": "assistant", "content": text(55, 0.5)}],
                "rejected": prompt + [{"role": "assistant", "content": text(48, 0.5)}],
            }
        )
    return rows


DATA_SETS = {"dolci": dolci_like_pairs, "multiturn": multi_turn_pairs}


class Counting:
    """Counts what a training epoch runs on, one training micro-batch at a time (`counted`): the positions the model
    runs on, the pairs' tokens (both sequences, whole: the same workload on every path), the tokens it really computes
    (a shared prompt once), the tokens outside the completions (the prompts, each sequence's) and their model FLOPs."""

    def __init__(self, model_flops):
        self.model_flops = model_flops
        self.positions = self.tokens = self.computed = self.prompt = 0
        self.flops = 0.0

    def add(self, batch: dict) -> None:
        from dpotrain.train.trainer import computed_tokens, sequence_lengths, shared_prefixes

        self.positions += batch["input_ids"].numel()
        lengths = sequence_lengths(batch)
        self.tokens += int(lengths.sum())
        self.computed += computed_tokens(batch)
        self.prompt += int(lengths.sum()) - int(batch["completion_mask"].sum())
        self.flops += self.model_flops.training(lengths, shared_prefixes(batch))


def counted(trainer_class):
    """`trainer_class` (plain TRL's DPOTrainer, or the project's), counting each training micro-batch its loss is
    computed on (`Counting`, as `.counting`): a subclass, so the trainer is built whole and nothing in it is replaced
    from outside. A filler micro-batch (the step plan's, which keeps ranks' collectives equal) trains nothing and is
    not counted."""
    from dpotrain.forwards.flops import ModelFlops
    from dpotrain.train.trainer import pairs_in

    class CountingTrainer(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.counting = Counting(ModelFlops.of(self.model))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training and pairs_in(inputs):
                self.counting.add(inputs)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return CountingTrainer


def worker(args) -> None:
    """One epoch on one path, in this process; prints one JSON line."""
    import datasets
    import torch

    start = time.perf_counter()
    data = datasets.load_dataset("json", data_files=str(args.data), split="train")
    common = dict(
        output_dir=str(args.out),
        loss_type=["sigmoid_norm"],
        beta=5.0,
        learning_rate=1e-6,
        lr_scheduler_type="linear",
        warmup_steps=0.1,
        num_train_epochs=1,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_length=args.max_length,
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    dtype = "float32"  # both sides: fp32 weights under bf16 autocast (bf16 weights alone lose a 1e-6 update)
    per_step = args.batch * args.accumulation
    if args.path == "trl":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accumulation,
            padding_free=False,
            precompute_ref_log_probs=False,
            **common,
            model_init_kwargs={"attn_implementation": args.attn, "dtype": dtype},
        )
        trainer = counted(DPOTrainer)(model=str(args.model), args=config, train_dataset=data)
    else:
        from dpotrain import stages, train_stage
        from dpotrain.recipe.config import parse_args
        from dpotrain.train.trainer import RecipeDPOTrainer

        flags = [f"--{k}={v}" for k, v in common.items() if k != "loss_type"]
        recipe = parse_args(
            [
                *flags,
                "--loss_type",
                "sigmoid_norm",
                "--attn_implementation",
                args.attn,
                "--dtype",
                dtype,
                "--model_name_or_path",
                str(args.model),
                "--dataset_name",
                str(args.data),
                "--pairs_per_step",
                str(per_step),
                "--max_tokens_per_microbatch",
                str(args.batch * 2 * args.max_length),
                "--share_prompt",
                str(args.path.startswith("shared")).lower(),
                "--assistant_turns",
                "all" if args.path.endswith("_all") else "final",
            ]
        )
        launch = stages.checks(recipe)
        spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, data))
        ready = train_stage.build_run(spec, trainer_class=counted(RecipeDPOTrainer))
        ready.score_reference()  # the reference pass: part of the end-to-end time
        trainer = ready.trainer
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_start = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    counting = trainer.counting
    params = sum(p.numel() for p in trainer.model.parameters())
    print(
        "RESULT "
        + json.dumps(
            {
                "path": args.path,
                "pairs": len(data),
                "steps": trainer.state.global_step,
                "pairs_per_step": per_step,
                "in_process_s": end - start,
                "train_s": end - train_start,
                "tokens": counting.tokens,
                "positions": counting.positions,
                "computed": counting.computed,
                "prompt_tokens": counting.prompt,
                "flops": counting.flops,
                "params": params,
                "gpu_peak_bytes": peak,
                "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "micro_batches_per_step": (
                    trainer.run_plan.summary["micro_batches_per_step"]["mean"]
                    if args.path != "trl"
                    else trainer.args.gradient_accumulation_steps
                ),
            }
        ),
        flush=True,
    )


def run_once(args, path: str, folder: Path) -> dict:
    out = folder / f"run-{path}"
    env = {
        **os.environ,
        "DPOTRAIN_CACHE": tempfile.mkdtemp(dir=folder),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        path,
        "--model",
        str(folder / "model"),
        "--data",
        str(folder / "pairs.jsonl"),
        "--out",
        str(out),
        *args.passthrough,
    ]
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"{path} run failed:\n{result.stdout[-4000:]}")
    return {**json.loads(lines[-1][7:]), "wall_s": wall}


def summarize(runs: list[dict], peak_tflops: float | None) -> dict:
    r = runs[0]
    wall = statistics.median(x["wall_s"] for x in runs)
    train = statistics.median(x["train_s"] for x in runs)
    out = {
        "wall_s": wall,
        "train_s": train,
        "pairs_per_s": r["pairs"] / wall,
        "tokens_per_s": r["tokens"] / wall,
        "train_tokens_per_s": r["tokens"] / train,
        "padding_share": 1 - r["computed"] / r["positions"],
        "positions_per_pair": r["positions"] / r["pairs"],
        "prompt_share": r["prompt_tokens"] / r["tokens"],
        "peak_memory_gib": (r["gpu_peak_bytes"] or r["rss_peak_bytes"]) / 2**30,
        "steps": r["steps"],
        "micro_batches_per_step": r["micro_batches_per_step"],
        "walls": [round(x["wall_s"], 1) for x in runs],
    }
    if peak_tflops:
        # Model FLOPs of the tokens each path computed (dpotrain/forwards/flops.py): the policy's forward + backward,
        # and the
        # reference's forward (a third of that: live in TRL, the reference stage here), over the whole epoch.
        out["mfu"] = 4 / 3 * r["flops"] / wall / (peak_tflops * 1e12)
    return out


PATHS = {
    "trl": "plain TRL",
    "packed": "packed",
    "shared": "packed + shared prompt",
    # the same with every assistant turn trained (`assistant_turns: all`; the others train the final one)
    "packed_all": "packed, every turn",
    "shared_all": "packed + shared prompt, every turn",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2, help="runs of each path, alternating (median reported)")
    parser.add_argument("--batch", type=int, default=4, help="pairs per padded micro-batch (TRL)")
    parser.add_argument("--accumulation", type=int, default=2, help="TRL's micro-batches per step")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--data-set", choices=sorted(DATA_SETS), default="dolci")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["trl", "packed", "shared"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the built-in tokenizer's (~1k)")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak, for MFU")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worker", choices=sorted(PATHS), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.path = args.worker
        return worker(args)

    args.passthrough = [
        f"--batch={args.batch}",
        f"--accumulation={args.accumulation}",
        f"--max-length={args.max_length}",
        f"--attn={args.attn}",
    ]
    args.passthrough += ["--bf16"] * args.bf16 + ["--activation-checkpointing"] * args.activation_checkpointing
    with tempfile.TemporaryDirectory(prefix="dpo-throughput-") as tmp:
        folder = Path(tmp)
        build_model(folder / "model", args.shape, args.vocab_size)
        rows = DATA_SETS[args.data_set](args.pairs, seed=0)
        (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs = {path: [] for path in args.paths}
        for i in range(args.runs):
            for path in args.paths if i % 2 == 0 else reversed(args.paths):  # alternating, so a slow phase hits all
                runs[path].append(run_once(args, path, folder))
                print(f"run {i + 1} {path}: {runs[path][-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    results = {path: summarize(runs[path], args.peak_tflops) for path in args.paths}
    import torch

    first = results[args.paths[0]]
    params = runs[args.paths[0]][0]["params"]
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or 'CPU'}"
    print(
        f"# DPO throughput, one epoch of {args.pairs} {args.data_set} pairs (prompt {first['prompt_share']:.0%} of "
        f"their tokens), {first['steps']} steps of {args.batch * args.accumulation} pairs, max_length "
        f"{args.max_length}, OLMo 3 '{args.shape}' ({params / 1e6:.1f}M params), {'bf16' if args.bf16 else 'fp32'}, "
        f"{args.attn}, activation checkpointing {'on' if args.activation_checkpointing else 'off'}"
    )
    print(f"# machine: {machine}, {os.cpu_count()} CPUs; {args.runs} alternating runs per path, median\n")
    rows = [
        ("wall time, whole process (s)", "wall_s", "{:.1f}"),
        ("pairs/s", "pairs_per_s", "{:.2f}"),
        ("pair tokens/s (whole process)", "tokens_per_s", "{:.0f}"),
        ("pair tokens/s (training loop)", "train_tokens_per_s", "{:.0f}"),
        ("positions run per pair", "positions_per_pair", "{:.0f}"),
        ("padding share of positions", "padding_share", "{:.1%}"),
        ("peak memory (GiB)", "peak_memory_gib", "{:.2f}"),
        ("micro-batches per step", "micro_batches_per_step", "{}"),
        ("wall time of each run (s)", "walls", "{}"),
    ]
    if args.peak_tflops:
        rows.append(("MFU (model FLOPs computed / wall / peak)", "mfu", "{:.1%}"))
    print("| | " + " | ".join(PATHS[p] for p in args.paths) + " |\n|---|" + "---|" * len(args.paths))
    for label, key, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt.format(results[p][key]) for p in args.paths) + " |")
    if "trl" in results:
        for path in args.paths[1:] if args.paths[0] == "trl" else [p for p in args.paths if p != "trl"]:
            print(
                f"speed-up of {PATHS[path]} over plain TRL, whole process: "
                f"{results['trl']['wall_s'] / results[path]['wall_s']:.2f}x"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""The whole run, end to end, against plain TRL at equal settings: this project's reference stage + training (its own
forward, and each forward forced) and `trl.DPOTrainer` with its live reference, on a think-like and a multi-turn mix.

    python benchmarks/end_to_end.py --out results/e2e                     # one GPU, one process (7B layer width)
    python benchmarks/end_to_end.py --out results/e2e-zero2 --engine zero2  # the same under DeepSpeed ZeRO-2, launched
                                                                            # by `accelerate launch` on one GPU
    python benchmarks/end_to_end.py --out /tmp/e2e --tiny                 # CPU, seconds: the script itself still runs

The model is a random-init OLMo 3 at 7B's layer width (hidden 4096, intermediate 11008, 32 heads, sliding window 4096
on 3 of 4 layers, vocabulary 100,278) with as many decoder layers as the memory plan (dpotrain/memory.py) fits on this
GPU with the recipe's settings (bf16, activation checkpointing allowed, the token budget below); `--layers` fixes it.
Every path sees the same model, the same pairs, the same pairs per step (`--pairs-per-step`), the same loss (OLMo 3's
length-normalized DPO) and the same max_length; plain TRL runs the activation checkpointing the project's plan chose
(the same every_n_layers), its padded micro-batches of `--trl-batch` pairs, on the best attention it can use (a varlen
FlashAttention when installed, else sdpa). The data are generated words (the built-in tokenizer, ~1 token a word):
think-like pairs with Dolci-Think-DPO's length mix (benchmarks/lengths_like.py) at max_length 16,384 and a token budget
of 65,536 (configs/think.yaml), and multi-turn pairs (the shared history ~85% of a pair) at 4,096 and 32,768.

Reported per path and data set, in `<out>/results.json` and `<out>/results.md`:
- end to end: the reference stage + training (TRL: training, its reference inside), and the speed-up over TRL;
- training loop: steady pair tokens/s per GPU (the pairs' tokens, whole, over the median step after the first) and MFU
  (the model FLOPs of what the path computed, dpotrain/flops.py, over the GPU's peak);
- the reference stage's pair tokens/s (the project's paths);
- the first step's time against the steady step's;
- the GPU's peak memory beside the memory plan's total (`torch.cuda.max_memory_allocated`: every micro-batch's peak is
  at most it).
The targets of issue 25 are printed as PASS/FAIL lines, not asserted: >= 2x plain TRL end to end on think-like data,
>= 2.5x on multi-turn, training-loop MFU >= 45%, the first step <= 2x a steady one, no peak above the plan.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTH = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
             sliding_window=4096, vocab_size=100_278)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, sliding_window=64,
            num_hidden_layers=2)  # fmt: skip
DATA = {  # max_length, token budget per micro-batch, pairs per step
    "think": (16384, 65536, 32),
    "multiturn": (4096, 32768, 32),
}
# Forced forwards: (attn_implementation or None for the project's own choice, share_prompt, padding_free)
FORWARDS = {
    "project": (None, None, None),
    "shared_flex": ("flex_attention", True, True),
    "packed_varlen": ("varlen", False, True),
    "packed_flex": ("flex_attention", False, True),
    "shared_sdpa": ("sdpa", True, True),
    "padded": ("sdpa", False, False),
}
TARGETS = {"think": 2.0, "multiturn": 2.5}  # end-to-end speed-up over plain TRL
MFU_TARGET, FIRST_STEP_TARGET = 0.45, 2.0
GIB = 2**30


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def write_model(folder: Path, layers: int, tiny: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Olmo3Config

    from dpotrain import builtin

    tokenizer = builtin.build_tokenizer()
    tokenizer.save_pretrained(folder)
    spec = {**TINY, "vocab_size": len(tokenizer)} if tiny else {**WIDTH, "num_hidden_layers": layers}
    config = Olmo3Config(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=65536, layer_types=layer_types(spec["num_hidden_layers"]),
                         **spec)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)


def write_pairs(path: Path, data: str, n: int, scale: float = 1.0, seed: int = 0) -> None:
    """Generated words with the lengths of the mix: think-like (Dolci-Think-DPO's components) or multi-turn, each
    length x `scale` (--tiny: the same shapes at a CPU's size)."""
    from attention import lengths_of

    prompt, chosen, rejected = lengths_of(data, n, DATA[data][0] - 64, seed)  # room for the chat template's tokens
    prompt, chosen, rejected = ((x * scale).astype(int) for x in (prompt, chosen, rejected))
    rng = random.Random(seed)
    words = "the a of to and in is it that for on with as was at by this from be are or have an not one all".split()

    def text(count: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(count))))

    with path.open("w") as f:
        for p, c, r in zip(prompt, chosen, rejected, strict=True):
            user = [{"role": "user", "content": text(p)}]
            f.write(json.dumps({"chosen": user + [{"role": "assistant", "content": text(c)}],
                                "rejected": user + [{"role": "assistant", "content": text(r)}]}) + "\n")  # fmt: skip


def recipe_args(args, data: str, model: Path, pairs: Path, out: Path, forward: str) -> list[str]:
    max_length, budget, per_step = DATA[data]
    if args.tiny:
        max_length, budget, per_step = 512, 2048, 4
    flags = ["--model_name_or_path", str(model), "--dataset_name", str(pairs), "--output_dir", str(out),
             "--max_length", str(max_length), "--max_tokens_per_microbatch", str(budget),
             "--pairs_per_step", str(args.pairs_per_step or per_step), "--loss_type", "sigmoid_norm", "--beta", "5",
             "--learning_rate", "1e-6", "--num_train_epochs", "1", "--max_grad_norm", "0", "--logging_steps", "1",
             "--save_strategy", "no", "--report_to", "none", "--seed", "42", "--samples_every", "0",
             "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--overwrite_output_dir", "true",
             "--bf16", str(not args.tiny).lower(), "--activation_checkpointing", "true",
             "--accelerate_config", "accelerate_config.yaml" if args.engine == "zero2" else "none"]  # fmt: skip
    if args.gpu_memory_gib:
        flags += ["--gpu_memory_gib", str(args.gpu_memory_gib)]
    import torch

    if not torch.cuda.is_available():  # bf16 autocast on the CPU: --tiny, and planning for a GPU from a CPU
        flags += ["--use_cpu", "true"]
    if args.compile_layers:
        flags += ["--compile_layers", "true"]
    attn, share, padding_free = FORWARDS.get(forward, (None, None, None))
    if attn == "varlen":
        from dpotrain.forwards import choice

        attn = choice.installed_varlen(True) or "flash_attention_4"
    if attn:
        flags += ["--attn_implementation", attn]
    if share is not None:
        flags += ["--share_prompt", str(share).lower()]
    if padding_free is not None:
        flags += ["--padding_free", str(padding_free).lower()]
    return flags


class StepClock:
    """Wall time of each optimizer step (CUDA synchronized), the first one from the start of training."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, *a, **k):
                clock.last = clock.now()

            def on_step_end(self, *a, **k):
                now = clock.now()
                clock.steps.append(now - clock.last)
                clock.last = now

        self.steps: list[float] = []
        self.callback = Callback()

    @staticmethod
    def now() -> float:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


def worker(args) -> dict:
    """One path on one data set, in this process: a JSON record."""
    import datasets
    import torch
    from throughput import Counting

    from dpotrain.flops import ModelFlops

    pairs = datasets.load_dataset("json", data_files=str(args.pairs), split="train")
    out = Path(args.run_out)
    clock = StepClock()
    planned, checkpointing, reference_s = None, args.trl_every, 0.0
    if args.path == "trl":
        from trl import DPOConfig, DPOTrainer

        flags = recipe_args(args, args.data, args.model, args.pairs, out, "project")
        value = dict(zip(flags[::2], flags[1::2], strict=True))
        per_step = int(value["--pairs_per_step"])
        batch = min(args.trl_batch, per_step)
        cuda = torch.cuda.is_available()
        from dpotrain.forwards import choice

        attn = choice.installed_varlen(cuda) or "sdpa"
        kwargs = {"every_n_layers": checkpointing} if checkpointing else None
        config = DPOConfig(
            output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=per_step // batch,
            padding_free=False, precompute_ref_log_probs=False, loss_type=["sigmoid_norm"], beta=5.0,
            learning_rate=1e-6, num_train_epochs=1, max_grad_norm=0.0, max_length=int(value["--max_length"]),
            bf16=not args.tiny, activation_checkpointing=checkpointing is not None,
            activation_checkpointing_kwargs=kwargs, logging_steps=1, save_strategy="no", report_to="none", seed=42,
            dataloader_num_workers=0, disable_tqdm=True, use_cpu=not cuda,
            deepspeed=str(ROOT / "ds_config.json") if args.engine == "zero2" else None,
            model_init_kwargs={"attn_implementation": attn, "dtype": "float32" if args.tiny else "bfloat16"},
        )  # fmt: skip
        trainer = DPOTrainer(model=str(args.model), args=config, train_dataset=pairs, callbacks=[clock.callback])
        forward = f"padded, {batch} pairs a micro-batch, on {attn}"
    else:
        from dpotrain import engine, memory, plan_stage, reference
        from dpotrain.config import parse_args
        from dpotrain.trainer import build_trainer

        recipe = parse_args(recipe_args(args, args.data, args.model, args.pairs, out, args.path))
        plan = memory.plan(recipe, 1, engine.launched())
        memory.apply_checkpointing(recipe, plan)
        planned = plan.get("per_gpu_gib", {}).get("total")
        checkpointing = (plan.get("checkpointing") or {}).get("every_n_layers")
        trainer = build_trainer(recipe, pairs, callbacks=[clock.callback])
        plan_stage.run_stage(trainer)
        start = StepClock.now()
        reference.run_stage(trainer, trainer.graceful_stop)
        reference_s = StepClock.now() - start
        forward = trainer.forward.line()
    counting = Counting(trainer.data_collator, ModelFlops.of(trainer.model))
    trainer.data_collator = counting
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = StepClock.now()
    trainer.train()
    train_s = StepClock.now() - start
    steps = clock.steps
    steady = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
    pair_tokens = counting.tokens  # the pairs' tokens, both sequences whole: the same on every path
    peak = flops_peak(args)
    record = {
        "path": args.path, "data": args.data, "engine": args.engine,
        "deepspeed": bool(getattr(trainer, "is_deepspeed_enabled", False)), "forward": forward, "pairs": len(pairs),
        "pair_tokens": pair_tokens, "steps": len(steps), "checkpointing_every_n_layers": checkpointing,
        "reference_s": round(reference_s, 3), "train_s": round(train_s, 3),
        "end_to_end_s": round(reference_s + train_s, 3), "first_step_s": round(steps[0], 3),
        "steady_step_s": round(steady, 3),
        "tokens_per_s_per_gpu": round(pair_tokens / len(steps) / steady, 1),
        "reference_tokens_per_s": round(pair_tokens / reference_s, 1) if reference_s else None,
        "mfu": round(counting.flops / len(steps) / steady / (peak * 1e12), 4) if peak else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if torch.cuda.is_available() else None,
        "plan_gib": planned,
    }  # fmt: skip
    return record


def flops_peak(args) -> float | None:
    from dpotrain import flops

    return flops.peak_tflops(args.peak_tflops)


def layers_that_fit(args, folder: Path) -> int:
    """The most decoder layers of 7B width whose memory plan fits this GPU, with the think recipe's settings."""
    from dpotrain import engine, memory
    from dpotrain.config import parse_args

    folder.mkdir(parents=True, exist_ok=True)
    pairs = folder / "none.jsonl"
    pairs.write_text("")
    best = 1
    for layers in range(1, 33):
        from transformers import Olmo3Config

        Olmo3Config(**WIDTH, num_hidden_layers=layers, layer_types=layer_types(layers)).save_pretrained(folder)
        recipe = parse_args(recipe_args(args, "think", folder, pairs, folder / "out", "project"))
        plan = memory.plan(recipe, 1, engine.from_config(str(ROOT / "accelerate_config.yaml") if args.engine == "zero2"
                                                        else "none"))  # fmt: skip
        if plan.get("fits") is False:
            break
        best = layers
    return best


def run_path(args, path: str, data: str, folder: Path, trl_every) -> dict:
    """One path in a fresh process (its own CUDA peak; under `accelerate launch` for ZeRO-2); --tiny: in this one."""
    run_out = folder / f"{data}-{path}"
    common = ["--worker", path, "--data", data, "--model", str(folder / "model"), "--pairs",
              str(folder / f"{data}.jsonl"), "--run-out", str(run_out), "--engine", args.engine,
              "--trl-batch", str(args.trl_batch)]  # fmt: skip
    common += ["--trl-every", str(trl_every)] if trl_every else []
    common += ["--tiny"] if args.tiny else []
    common += ["--compile-layers"] if args.compile_layers else []
    for name in ("pairs_per_step", "gpu_memory_gib", "peak_tflops"):
        if getattr(args, name):
            common += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {"DPOTRAIN_CACHE": tempfile.mkdtemp(dir=folder), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.tiny and args.engine == "single":  # seconds, not a process start per run
        os.environ.update(env)
        worker_args = argparse.Namespace(**{**vars(args), "worker": path, "path": path, "data": data,
                                            "model": folder / "model", "pairs": folder / f"{data}.jsonl",
                                            "run_out": run_out, "trl_every": trl_every})  # fmt: skip
        return worker(worker_args)
    env = {**os.environ, **env}
    launch = [sys.executable]
    if args.engine == "zero2":
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "accelerate_config.yaml"), "--num_processes", "1", "--num_machines", "1"]  # fmt: skip
    result = subprocess.run([*launch, __file__, *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)  # fmt: skip
    (folder / f"{data}-{path}.log").write_text(result.stdout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode or not lines:
        tail = result.stdout.strip().splitlines()[-1:] or ["no output"]
        return {"path": path, "data": data, "failed": tail[0][:300], "log": str(folder / f"{data}-{path}.log")}
    return json.loads(lines[-1][len("RESULT ") :])


def verdicts(results: list[dict]) -> list[str]:
    lines = []
    for data in DATA:
        rows = {r["path"]: r for r in results if r["data"] == data and "failed" not in r}
        trl, own = rows.get("trl"), rows.get("project")
        if trl and own:
            ratio = trl["end_to_end_s"] / own["end_to_end_s"]
            lines.append(_verdict(ratio >= TARGETS[data], f"{data}: end to end {ratio:.2f}x plain TRL "
                                  f"(target >= {TARGETS[data]}x)"))  # fmt: skip
        if own and own["mfu"] is not None:
            lines.append(_verdict(own["mfu"] >= MFU_TARGET, f"{data}: training-loop MFU {own['mfu']:.1%} (target >= "
                                  f"{MFU_TARGET:.0%})"))  # fmt: skip
        if own:
            first = own["first_step_s"] / own["steady_step_s"]
            lines.append(_verdict(first <= FIRST_STEP_TARGET, f"{data}: first step {first:.2f}x a steady one (target "
                                  f"<= {FIRST_STEP_TARGET:g}x)"))  # fmt: skip
        for r in rows.values():
            if r.get("peak_gib") is not None and r.get("plan_gib") is not None:
                lines.append(_verdict(r["peak_gib"] <= r["plan_gib"], f"{data} {r['path']}: peak {r['peak_gib']} GiB "
                                      f"within the plan's {r['plan_gib']} GiB"))  # fmt: skip
    return lines


def _verdict(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'FAIL'} {text}"


COLUMNS = ["data", "path", "forward", "end_to_end_s", "vs_trl", "reference_s", "reference_tokens_per_s", "train_s",
           "tokens_per_s_per_gpu", "mfu", "first_step_s", "steady_step_s", "peak_gib", "plan_gib",
           "checkpointing_every_n_layers"]  # fmt: skip


def markdown(results: list[dict], header: str, lines: list[str]) -> str:
    trl = {r["data"]: r for r in results if r["path"] == "trl" and "failed" not in r}
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if "failed" in r:
            table.append(f"| {r['data']} | {r['path']} | failed: {r['failed']} (log: {r['log']}) |")
            continue
        base = trl.get(r["data"])
        r = {**r, "vs_trl": round(base["end_to_end_s"] / r["end_to_end_s"], 2) if base else None}
        table.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |")
    return "\n".join([header, "", *table, "", *[f"- {line}" for line in lines], ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for results.json, results.md and each run's log")
    parser.add_argument("--tiny", action="store_true", help="CPU: a 2-layer hidden-64 model, a few pairs")
    parser.add_argument("--engine", choices=["single", "zero2"], default="single",
                        help="zero2: every run under `accelerate launch` with accelerate_config.yaml (DeepSpeed "
                        "ZeRO-2) on one process")  # fmt: skip
    parser.add_argument("--data", nargs="+", choices=sorted(DATA), default=sorted(DATA))
    parser.add_argument("--paths", nargs="+", choices=["trl", *FORWARDS], default=None,
                        help="default: trl and every forward (--tiny: trl, project, shared_sdpa)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="default: as many as the memory plan fits")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (pairs = steps x per step)")
    parser.add_argument("--pairs-per-step", type=int, default=None, help="default: 32 (--tiny: 4)")
    parser.add_argument(
        "--trl-batch",
        type=int,
        default=2,
        help="pairs per padded micro-batch of plain TRL (2: 4 x 16,384 positions, the think budget)",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peak-tflops", type=float, default=None, help="default: the GPU's, by name (flops.py)")
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="the project's paths with compile_layers (regional torch.compile; plain TRL as is)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--run-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trl-every", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.path, args.data = args.worker, args.data[0]
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    if args.out is None:
        parser.error("--out FOLDER is required: results.json, results.md and the runs' logs go there")
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("error: no GPU here: run this on a GPU machine (docs/gpu-benchmarks.md), or --tiny on a CPU")
    paths = args.paths or (["trl", "project", "shared_sdpa"] if args.tiny else ["trl", *FORWARDS])
    folder = args.out.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    layers = TINY["num_hidden_layers"] if args.tiny else (args.layers or layers_that_fit(args, folder / "fit"))
    write_model(folder / "model", layers, args.tiny)
    results = []
    for data in args.data:
        per_step = args.pairs_per_step or (4 if args.tiny else DATA[data][2])
        write_pairs(folder / f"{data}.jsonl", data, args.steps * per_step, 480 / DATA[data][0] if args.tiny else 1)
        trl_every = None
        # The project's own choice first: plain TRL then runs the checkpointing its plan chose (run for that alone
        # when not asked for).
        for path in sorted(set(paths) | ({"project"} if "trl" in paths else set()), key=lambda p: p != "project"):
            record = run_path(args, path, data, folder, trl_every)
            if path == "project" and "failed" not in record:
                trl_every = record["checkpointing_every_n_layers"]
            if path in paths:
                results.append(record)
                print(json.dumps(record), flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    header = (
        f"# End to end, {device}, {args.engine}, {layers} decoder layers of OLMo 3 7B's width"
        f"{' (tiny)' if args.tiny else ''}\n\n`python benchmarks/end_to_end.py {' '.join(sys.argv[1:])}`"
    )
    lines = verdicts(results)
    (folder / "results.json").write_text(
        json.dumps(
            {"layers": layers, "device": device, "engine": args.engine, "results": results, "targets": lines}, indent=2
        )
        + "\n"
    )
    (folder / "results.md").write_text(markdown(results, header, lines))
    print("\n".join(lines))
    print(f"results: {folder / 'results.md'}, {folder / 'results.json'}")


if __name__ == "__main__":
    main()

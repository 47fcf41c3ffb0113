"""The whole run, end to end, against plain TRL at equal settings: this project's reference stage + training (its own
forward, and each forward forced) and `trl.DPOTrainer` with its live reference, on a think-like and a multi-turn mix.

    python benchmarks/end_to_end.py --out results/e2e                     # one GPU, one process (7B layer width)
    python benchmarks/end_to_end.py --out results/e2e-zero2 --engine zero2  # the same under DeepSpeed ZeRO-2, launched
                                                                            # by `accelerate launch` on one GPU
    python benchmarks/end_to_end.py --out /tmp/e2e --tiny                 # CPU, seconds: the script itself still runs

The model is a random-init OLMo 3 at 7B's layer width (hidden 4096, intermediate 11008, 32 heads, sliding window 4096
on 3 of 4 layers, vocabulary 100,278) with 4 decoder layers (each run a few minutes on one H100); `--layers N` sets
another count, `--layers fit` as many as the memory plan (dpotrain/plan/memory.py) fits on this GPU with the think
recipe's settings (the search stops at the first count the plan refuses); `--write-model DIR` writes it alone and
`--model DIR` uses it (a GPU lease writes one and shares it: benchmarks/gpu_lease.sh).

Equal settings: the project's path runs the run's own stages (dpotrain/stages.py: the forward decided from the pairs,
then the memory plan for that forward, which chooses the checkpointed layers; build_run, with its plan; the reference
stage). Plain TRL then runs at the settings that run took, printed for both sides: the weights' dtype as loaded (float32
on one process, bfloat16 under DeepSpeed: engine.load_dtype), bf16 autocast, the same every k-th decoder layer
checkpointed, the same pairs per step and token budget (`--trl-batch` pairs per padded micro-batch, by default the
budget over 2 x max_length: 2 on think-like pairs, 4 on multi-turn; its live reference, on the best attention it can
use: a varlen FlashAttention when installed, else sdpa, named in every row). TRL gets one fix: it re-enables
checkpointing around its live reference with `every_n_layers` handed to torch's checkpoint(), which raises, so its model
is held to the plan's layers as the project's is (dpotrain/plan/layers.py). The data are generated words, as many as the
mix's tokens over the built-in tokenizer's measured tokens per word (~1.57): think-like pairs with Dolci-Think-DPO's
length mix (benchmarks/lengths_like.py) at max_length 16,384 and a token budget of 65,536 (configs/think.yaml), and
multi-turn pairs (the shared history ~85% of a pair) at 4,096 and 32,768. `--tiny` (CPU): a 2-layer hidden-64 model in
bf16 autocast, layer 0 of 2 checkpointed (what the plan picks at 7B width, forced), and the layer search at 7B width for
an 80 GiB GPU, to its refusal.

Reported per path and data set, in `<out>/results.json` and `<out>/results.md`, rewritten as each path finishes:
- end to end: the reference stage + training (TRL: training, its reference inside), and the speed-up over TRL, with
  and without the compiler's time (dynamo + inductor, in the reference stage and training);
- training loop: steady pair tokens/s per GPU (the pairs' tokens, whole, over the median step after the first) and MFU
  (the model FLOPs of what the path computed, dpotrain/forwards/flops.py, over the GPU's peak);
- the reference stage's pair tokens/s, with and without its compile time (the project's paths);
- the first step's time against the steady step's, and inside the first step the compiler's time (dynamo + inductor)
  apart from its compute; `setup_s`: engine start-up before the first step (DeepSpeed's op builds);
- the GPU's peak memory over the reference stage and training (and after the reference stage alone) beside the memory
  plan: the peak of tensors (`torch.cuda.max_memory_allocated`: every micro-batch's peak is at most it) against the
  plan's tensors (its total less its allowance for the CUDA context and fragmentation), and the peak the caching
  allocator reserved (`max_memory_reserved`: tensors and fragmentation) against the plan's total; and the plan the
  run's stage makes for a budget of the widest micro-batch the run trained (generated pairs need not fill it);
- `--profile-step N` (the project's path): step N under `torch.profiler`, its kernels by self time on the device (the
  CPU's on a CPU) and their share by kind (matmul, attention, other fused kernels, ...) in the record and in
  `<out>/<data>-project/profile.txt`; that step's time includes the profiler's, so profile in a run of its own.
The targets are printed as PASS/FAIL lines, not asserted: >= 2x plain TRL end to end on think-like data,
>= 2.5x on multi-turn, training-loop MFU >= 45%, the reference stage >= 2.5x the loop's tokens/s, the first step <= 2x
a steady one, the plan's tensors >= the peak allocated and within 10% of it, the plan's total >= the peak reserved.
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

# OLMo 3 7B's shape, its 65,536 positions included (Olmo3Config's default, 2048, is refused at the think recipe's 16K)
WIDTH = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_attention_heads=32,
    num_key_value_heads=32,
    sliding_window=4096,
    vocab_size=100_278,
    max_position_embeddings=65536,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=64,
    num_hidden_layers=2,
    max_position_embeddings=65536,
)
TINY_EVERY = 2  # --tiny checkpoints 1 layer in 2 (of its 2: layer 0), on both sides
TINY_LENGTHS = (512, 2048)  # --tiny: max_length, token budget per micro-batch
# --tiny's pairs: the mix's shapes scaled to this many tokens at most, so that they fit max_length with the chat
# template's tokens
TINY_TOKENS = 240
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
REFERENCE_TARGET = 2.5  # the reference stage's tokens/s over the training loop's, in the same run
PLAN_MARGIN = 0.10  # the memory plan at most this much above the measured peak
SETTINGS = ("dtype", "mixed_precision", "checkpointing_every_n_layers", "pairs_per_step")  # equal on both sides
GIB = 2**30


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def write_model(folder: Path, layers: int, tiny: bool) -> Path:
    """The benchmark's model (random init, bf16) and the built-in tokenizer in `folder`, written once: a folder that
    exists is complete (it is written beside and renamed), and is used as it is."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Olmo3Config

    from dpotrain.data import builtin

    if folder.is_dir():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = builtin.build_tokenizer()
    tokenizer.save_pretrained(partial)
    spec = {**TINY, "vocab_size": len(tokenizer)} if tiny else {**WIDTH, "num_hidden_layers": layers}
    config = Olmo3Config(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        layer_types=layer_types(spec["num_hidden_layers"]),
        **spec,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(partial)
    partial.rename(folder)
    return folder


WORDS = "the a of to and in is it that for on with as was at by this from be are or have an not one all".split()


def tokens_per_word() -> float:
    """The built-in tokenizer's tokens per word of the pairs' text (~1.57: a word and its space are often two), measured
    on 4,000 words drawn apart from the pairs' own."""
    from dpotrain.data import builtin

    rng = random.Random(1)
    sample = " ".join(rng.choice(WORDS) for _ in range(4000))
    return len(builtin.build_tokenizer()(sample)["input_ids"]) / 4000


def write_pairs(path: Path, data: str, n: int, scale: float = 1.0, seed: int = 0, think_tag: bool = False) -> None:
    """Generated words with the lengths of the mix: think-like (Dolci-Think-DPO's components) or multi-turn, each
    length x `scale` (--tiny: the same shapes at a CPU's size). `think_tag`: every answer opens with `<think>`, as the
    think recipe's template (configs/templates/olmo_thinker.jinja) requires of every row."""
    from attention import lengths_of

    prompt, chosen, rejected = lengths_of(data, n, DATA[data][0] - 64, seed)  # room for the chat template's tokens
    # The mix's lengths are tokens; the text is words, each more than one token: written as many words as tokens, the
    # pairs came out ~1.6x the mix (lease 1b: 57 of 96 multi-turn prompts alone filled max_length, and the run refused)
    per_word = tokens_per_word()
    prompt, chosen, rejected = ((x * scale / per_word).astype(int) for x in (prompt, chosen, rejected))
    rng = random.Random(seed)

    def text(count: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, int(count))))

    opening = "<think>" if think_tag else ""
    with path.open("w") as f:
        for p, c, r in zip(prompt, chosen, rejected, strict=True):
            user = [{"role": "user", "content": text(p)}]
            f.write(
                json.dumps(
                    {
                        "chosen": user + [{"role": "assistant", "content": opening + text(c)}],
                        "rejected": user + [{"role": "assistant", "content": opening + text(r)}],
                    }
                )
                + "\n"
            )


def recipe_args(args, data: str, model: Path, pairs: Path, out: Path, forward: str) -> list[str]:
    max_length, budget, per_step = DATA[data]
    if args.tiny:
        (max_length, budget), per_step = TINY_LENGTHS, 4
    flags = [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(pairs),
        "--output_dir",
        str(out),
        "--max_length",
        str(max_length),
        "--max_tokens_per_microbatch",
        str(budget),
        "--pairs_per_step",
        str(args.pairs_per_step or per_step),
        "--loss_type",
        "sigmoid_norm",
        "--beta",
        "5",
        "--learning_rate",
        "1e-6",
        "--num_train_epochs",
        "1",
        "--max_grad_norm",
        "0",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--seed",
        "42",
        "--samples_every",
        "0",
        "--dataloader_num_workers",
        "0",
        "--disable_tqdm",
        "true",
        "--overwrite_output_dir",
        "true",
        "--bf16",
        "true",
        "--activation_checkpointing",
        "true",
        "--accelerate_config",
        "accelerate_config.yaml" if args.engine == "zero2" else "none",
    ]
    if args.tiny:  # what the plan chooses on an H100 at 7B width (1 layer in k), forced: no memory pressure here
        flags += ["--activation_checkpointing_kwargs", json.dumps({"every_n_layers": TINY_EVERY})]
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
    """Wall time of each optimizer step (CUDA synchronized), the first one from the start of training, and the
    compiler's time (dynamo + inductor: `torch._dynamo.utils.calculate_time_spent`) inside each: the first step's
    compilation apart from its compute. `setup_s`: from `train()` to its first step (engine start-up: DeepSpeed's
    op builds, the optimizer)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, *a, **k):
                clock.last, clock.last_compile = clock.now(), compile_s()

            def on_step_end(self, *a, **k):
                now, compiled = clock.now(), compile_s()
                clock.steps.append(now - clock.last)
                clock.compiles.append(compiled - clock.last_compile)
                clock.last, clock.last_compile = now, compiled

        self.steps: list[float] = []
        self.compiles: list[float] = []
        self.callback = Callback()

    @staticmethod
    def now() -> float:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


def peak_gib(reserved: bool = False) -> float | None:
    """The GPU's peak allocated memory (`reserved`: held by the caching allocator) since this worker started (its
    reference stage included), or None on a CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return round((torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / GIB, 2)


def compile_s() -> float:
    """Seconds this process has spent compiling (dynamo's tracing and the backend's code generation, forward and
    backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def compared_settings(trainer) -> dict:
    """What a comparison at equal settings must hold equal: the weights' dtype as loaded, mixed precision, the decoder
    layers checkpointed (every k-th), and the pairs in an optimizer step."""
    from dpotrain.plan import layers

    args = trainer.args
    pairs_per_step = getattr(trainer, "pairs_per_step", None) or (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    )
    return {
        "dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
        "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "none",
        "checkpointing_every_n_layers": layers.checkpointed_every(args),
        "checkpointed_layers": layers.checkpointed(trainer.model),
        "pairs_per_step": pairs_per_step,
    }


def project_trainer(args, pairs, clock):
    """This project's run, by its own stages (dpotrain/stages.py): the forward decided from the pairs and the memory
    plan for it (which chooses the checkpointed layers), the ready run (the trainer with its plan), the reference
    stage (timed)."""
    from throughput import counted

    from dpotrain import stages, train_stage
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.trainer import RecipeDPOTrainer

    flags = recipe_args(args, args.data, args.model, args.pairs, Path(args.run_out), args.path)
    recipe = parse_args(flags)
    launch = stages.checks(recipe)
    spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, pairs))
    forward, plan = spec.forward.planned, spec.memory
    ready = train_stage.build_run(spec, callbacks=[clock.callback], trainer_class=counted(RecipeDPOTrainer))
    start, compiled = StepClock.now(), compile_s()
    outcomes = ready.score_reference()
    stage = outcomes[0].record() if outcomes else {}  # the stage's own clock: its first micro-batch timed apart
    extra = {
        "reference_s": StepClock.now() - start,
        "reference_compile_s": compile_s() - compiled,
        "reference_warmup_s": stage.get("warmup_seconds"),
        "reference_steady_tokens_per_s": stage.get("tokens_per_second"),
        "reference_peak_gib": peak_gib(),
        "plan_gib": plan.total_gib,
        "plan_allowance_gib": (plan.per_gpu_gib or {}).get("cuda_context_and_fragmentation"),
        # made after training: parsing a recipe makes TRL's arguments, which reset accelerate's state under a trainer
        "widest": lambda: widest_micro_batch(args, flags, launch, plan.values, ready.trainer.run_plan.summary),
        "plan_attention": plan.attention,
        "attention": forward.attention,
        "forward": forward.line(),
    }
    return ready.trainer, extra


def widest_micro_batch(args, flags: list[str], launch, plan: dict, batching: dict) -> dict:
    """The positions of the widest micro-batch the run trains (its step plan's), and the memory plan's tensors (GiB:
    its total less the allowance) that the run's own stage makes for a budget of those positions, with the layers it
    checkpointed. The plan is made for the token budget, which generated pairs need not fill: on lease 1b the widest of
    think's micro-batches held 56,832 of the 65,536 positions planned, and the tensors read 12% above the peak."""
    from dpotrain.plan import memory
    from dpotrain.recipe.config import parse_args

    widest = (batching.get("positions_per_micro_batch") or {}).get("max")
    if not widest or not plan.get("per_gpu_gib"):
        return {}
    at = flags.index("--max_tokens_per_microbatch") + 1
    every = plan["checkpointing"]["every_n_layers"]
    kept = ["--activation_checkpointing", "false"]
    if every:
        kept = ["--activation_checkpointing_kwargs", json.dumps({"every_n_layers": every})]
    recipe = parse_args([*flags[:at], str(widest), *flags[at + 1 :], *kept])
    parts = memory.plan(recipe, launch.world, launch.engine, plan.get("attention"))["per_gpu_gib"]
    tensors = parts["total"] - parts["cuda_context_and_fragmentation"]
    return {"widest_micro_batch_positions": widest, "plan_tensors_at_widest_gib": round(tensors, 2)}


def forward_and_plan(
    recipe, pairs, world: int, run_engine, cuda: bool | None = None, varlen: str | None = "installed", lengths=None
):
    """The run's lengths, forward and memory stages (dpotrain/stages.py), on `pairs` for one machine: `cuda` and
    `varlen` as detected unless given (a CPU can plan a GPU's forwards): the launch is fabricated, the stages are the
    run's. The memory plan refuses what does not fit. `lengths`: the lengths stage's value from an earlier call on the
    same pairs (returned), else measured."""
    import torch

    from dpotrain import resolve, stages
    from dpotrain.forwards import choice
    from dpotrain.plan import memory
    from dpotrain.train.trainer import resolve_model_path

    cuda = torch.cuda.is_available() if cuda is None else cuda
    varlen = choice.installed_varlen(cuda) if varlen == "installed" else varlen
    launch = stages.Launch(
        world,
        "the benchmark's",
        run_engine,
        {"this machine": (cuda, varlen)},
        dry_run=False,
        batch=resolve.decide_batch(recipe, world),
    )
    model_path = resolve_model_path(recipe)
    model = memory.model_config(recipe, model_path, local_only=False)
    pairs_held = stages.given_pairs(recipe, launch, pairs)
    lengths = lengths or stages.measure_lengths(recipe, launch, pairs_held, model_path, model[0])
    forward = stages.decide_forward(recipe, launch, model_path, lengths, model)
    stages.plan_memory(recipe, launch, pairs_held, lengths, forward, model)
    return lengths


def trl_trainer(args, pairs, clock):
    """Plain `trl.DPOTrainer` (padded micro-batches of `--trl-batch` pairs, its live reference) at the settings the
    project's run took (`--trl-settings`: dtype, mixed precision, checkpointed layers, pairs per step)."""
    import torch
    from throughput import counted
    from trl import DPOConfig, DPOTrainer

    from dpotrain.forwards import choice
    from dpotrain.plan import layers

    same = json.loads(args.trl_settings) if args.trl_settings else {}
    flags = recipe_args(args, args.data, args.model, args.pairs, Path(args.run_out), "project")
    value = dict(zip(flags[::2], flags[1::2], strict=True))
    per_step = same.get("pairs_per_step") or int(value["--pairs_per_step"])
    batch = min(trl_batch(args, args.data), per_step)
    if per_step % batch:
        raise SystemExit(f"error: --trl-batch {batch} does not divide {per_step} pairs per step")
    cuda = torch.cuda.is_available()
    attn = choice.installed_varlen(cuda) or "sdpa"
    every = same.get("checkpointing_every_n_layers")
    config = DPOConfig(
        output_dir=str(args.run_out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=per_step // batch,
        padding_free=False,
        precompute_ref_log_probs=False,
        loss_type=["sigmoid_norm"],
        beta=5.0,
        learning_rate=1e-6,
        num_train_epochs=1,
        max_grad_norm=0.0,
        max_length=int(value["--max_length"]),
        bf16=same.get("mixed_precision", "bf16") == "bf16",
        activation_checkpointing=every is not None,
        activation_checkpointing_kwargs={"every_n_layers": every} if every else None,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=not cuda,
        deepspeed=str(ROOT / "ds_config.json") if args.engine == "zero2" else None,
        model_init_kwargs={"attn_implementation": attn, "dtype": same.get("dtype", "float32")},
    )
    trainer = counted(DPOTrainer)(model=str(args.model), args=config, train_dataset=pairs, callbacks=[clock.callback])
    # TRL re-enables checkpointing around its live reference with `gradient_checkpointing_enable(kwargs)`: every layer,
    # `every_n_layers` handed to torch's checkpoint(), which raises. The project's fix, the only one TRL gets: held to
    # the same every k-th layer as the project's run.
    layers.hold_checkpointing(trainer.model, config)
    return trainer, {
        "reference_s": 0.0,
        "reference_compile_s": 0.0,
        "attention": attn,
        "forward": f"padded, {batch} pairs a micro-batch, on {attn}",
    }


def trl_batch(args, data: str) -> int:
    """Plain TRL's pairs per padded micro-batch: `--trl-batch`, else the project's token budget filled with pairs
    padded to max_length (2 x 2 x 16,384 = 65,536 on think-like pairs; 4 x 2 x 4,096 = 32,768 on multi-turn)."""
    if args.trl_batch:
        return args.trl_batch
    max_length, budget, _ = DATA[data]
    if args.tiny:
        max_length, budget = TINY_LENGTHS
    return max(1, budget // (2 * max_length))


def worker(args) -> dict:
    """One path on one data set, in this process: a JSON record."""
    import datasets
    import torch

    from dpotrain.plan import memory

    memory.default_allocator()  # as train_dpo.py sets it, for both sides: the allocator the plan assumes
    pairs = datasets.load_dataset("json", data_files=str(args.pairs), split="train")
    clock = StepClock()
    if torch.cuda.is_available():  # the peak over the reference stage and training, as the memory plan covers both
        torch.cuda.reset_peak_memory_stats()
    trainer, extra = (trl_trainer if args.path == "trl" else project_trainer)(args, pairs, clock)
    profiler = StepProfiler(args.profile_step, Path(args.run_out)) if args.profile_step and args.path != "trl" else None
    if profiler:
        trainer.add_callback(profiler.callback)
    start = StepClock.now()
    trainer.train()
    train_s = StepClock.now() - start
    record = record_of(args, trainer, clock, trainer.counting, extra, train_s, len(pairs))
    record |= extra["widest"]() if "widest" in extra else {}
    return record | ({"profile": profiler.summary} if profiler else {})


class StepProfiler:
    """One optimizer step under `torch.profiler` (CPU and CUDA activity): its kernels by self time on the device (on
    a CPU, the CPU's), the top ones and every kernel's kind summed (`kind_of`), for a goal missed: what the step spends
    its time on. The whole table goes to FOLDER/profile.txt."""

    def __init__(self, step: int, folder: Path):
        from transformers import TrainerCallback

        self.step, self.folder, self.summary = step, folder, None
        owner = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == owner.step:
                    owner.start()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == owner.step:
                    owner.stop()

        self.callback = Callback()

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profile = profile(activities=activities)
        self.profile.__enter__()

    def stop(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profile.__exit__(None, None, None)
        device = torch.cuda.is_available()
        events = self.profile.key_averages()
        key = "self_device_time_total" if device else "self_cpu_time_total"
        # On a GPU an operator (aten::mm) carries its kernels' device time too: the kernels alone, each counted once
        kernels = [e for e in events if not device or e.device_type != torch.autograd.DeviceType.CPU]
        timed = sorted(((e.key, getattr(e, key), e.count) for e in kernels if getattr(e, key) > 0), key=lambda e: -e[1])
        total = sum(t for _, t, _ in timed) or 1
        kinds: dict[str, float] = {}
        for name, t, _ in timed:
            kind = kind_of(name)
            kinds[kind] = kinds.get(kind, 0.0) + t
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "profile.txt").write_text(events.table(sort_by=key, row_limit=60) + "\n")
        self.summary = {
            "step": self.step,
            "self_time_of": "device" if device else "cpu",
            "total_ms": round(total / 1e3, 1),
            "by_kind": {k: round(t / total, 3) for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [
                {"name": name[:120], "ms": round(t / 1e3, 1), "share": round(t / total, 3), "calls": n}
                for name, t, n in timed[:25]
            ],
            "table": str(self.folder / "profile.txt"),
        }


KINDS = (  # a kernel's kind by its name, first match: what a profile of a DPO step on one GPU is made of
    ("attention", ("flex", "triton_tem", "flash", "fmha", "attention", "efficient_attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "sm90")),
    ("cross-entropy / log-softmax", ("log_softmax", "logsumexp", "cross_entropy", "nll_loss")),
    ("communication", ("nccl", "all_reduce", "reduce_scatter", "all_gather")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copies / casts", ("copy", "memcpy", "memset", "catarray", "aten::cat", "to_copy")),
    ("other fused (triton)", ("triton",)),
    ("elementwise / reductions", ("elementwise", "vectorized", "reduce", "unrolled")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(m in low for m in marks)), "other")


def record_of(args, trainer, clock, counting, extra, train_s: float, pairs: int) -> dict:
    from dpotrain.forwards import flex

    steps, compiles = clock.steps, clock.compiles
    steady = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
    pair_tokens = counting.tokens  # the pairs' tokens, both sequences whole: the same on every path
    peak, reference_s = flops_peak(args), extra["reference_s"]
    compiled = extra["reference_compile_s"] + sum(compiles)  # dynamo + inductor, reference stage and training
    reference_compute_s = reference_s - extra["reference_compile_s"]
    return {
        "path": args.path,
        "data": args.data,
        "engine": args.engine,
        "deepspeed": bool(getattr(trainer, "is_deepspeed_enabled", False)),
        "attention": extra["attention"],
        "forward": extra["forward"],
        **compared_settings(trainer),
        "pairs": pairs,
        "pair_tokens": pair_tokens,
        "steps": len(steps),
        "reference_s": round(reference_s, 3),
        "train_s": round(train_s, 3),
        "end_to_end_s": round(reference_s + train_s, 3),
        "compile_s": round(compiled, 3),
        "end_to_end_less_compile_s": round(reference_s + train_s - compiled, 3),
        "setup_s": round(train_s - sum(steps), 3),  # train() to its first step: engine start-up, op builds
        "first_step_s": round(steps[0], 3),
        "first_step_compile_s": round(compiles[0], 3),  # dynamo + inductor inside the first step
        "first_step_compute_s": round(steps[0] - compiles[0], 3),
        "later_compile_s": round(sum(compiles[1:]), 3),  # recompilations after the first step
        "steady_step_s": round(steady, 3),
        "flex_compilations": flex.compilations(),
        "tokens_per_s_per_gpu": round(pair_tokens / len(steps) / steady, 1),  # steady: no compilation
        "train_tokens_per_s": round(pair_tokens / train_s, 1),  # the whole of training: compilation included
        "reference_tokens_per_s": round(pair_tokens / reference_s, 1) if reference_s else None,
        "reference_tokens_per_s_less_compile": round(pair_tokens / reference_compute_s, 1) if reference_s else None,
        # after its first micro-batch (compilation, the allocator's growth, ...), as training's steady step is after its
        # first step: what a run of thousands of pairs scores at, where a 96-pair run's warm-up is half its time
        "reference_warmup_s": extra.get("reference_warmup_s"),
        "reference_steady_tokens_per_s": extra.get("reference_steady_tokens_per_s"),
        "mfu": round(counting.flops / len(steps) / steady / (peak * 1e12), 4) if peak else None,
        "reference_peak_gib": extra.get("reference_peak_gib"),
        "peak_gib": peak_gib(),  # over the reference stage and training
        "peak_reserved_gib": peak_gib(reserved=True),  # tensors and the caching allocator's fragmentation
        "plan_gib": extra.get("plan_gib"),
        "plan_allowance_gib": extra.get("plan_allowance_gib"),
        "plan_attention": extra.get("plan_attention"),
    }


def flops_peak(args) -> float | None:
    from dpotrain.forwards import flops

    return flops.peak_tflops(args.peak_tflops)


def layers_that_fit(args, folder: Path) -> int:
    """The most decoder layers of 7B width whose memory plan fits the GPU (this one, else `--gpu-memory-gib`), with
    the think recipe's settings and the forward a run would take on it (`forward_and_plan`: planned on a GPU's
    forwards even from a CPU). The first count the plan refuses (its ConfigError, memory_check on) ends the search."""
    import datasets
    import torch
    from transformers import Olmo3Config

    from dpotrain.cluster import engine
    from dpotrain.data import builtin
    from dpotrain.forwards import choice
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    folder.mkdir(parents=True, exist_ok=True)
    builtin.build_tokenizer().save_pretrained(folder)
    write_pairs(folder / "think.jsonl", "think", 64)
    pairs = datasets.load_dataset("json", data_files=str(folder / "think.jsonl"), split="train")
    cuda = torch.cuda.is_available()
    varlen = choice.installed_varlen(cuda) if cuda else None
    planned = engine.from_config(str(ROOT / "accelerate_config.yaml") if args.engine == "zero2" else "none")
    best, lengths = 0, None
    for layers in range(1, 33):
        Olmo3Config(**WIDTH, num_hidden_layers=layers, layer_types=layer_types(layers)).save_pretrained(folder)
        recipe = parse_args(
            recipe_args(
                argparse.Namespace(**{**vars(args), "tiny": False}),
                "think",
                folder,
                folder / "think.jsonl",
                folder / "out",
                "project",
            )
        )
        try:
            lengths = forward_and_plan(recipe, pairs, 1, planned, cuda=True, varlen=varlen, lengths=lengths)
        except ConfigError as refused:  # the plan's refusal: this many layers do not fit
            print(f"{layers} layers: {str(refused)[:200]}", flush=True)
            break
        best = layers
    return best


def run_path(args, path: str, data: str, folder: Path, trl_settings: dict | None) -> dict:
    """One path in a fresh process (its own CUDA peak; under `accelerate launch` for ZeRO-2); --tiny: in this one.
    Plain TRL runs at `trl_settings`, those the project's run took."""
    run_out = folder / f"{data}-{path}"
    common = [
        "--worker",
        path,
        "--data",
        data,
        "--model",
        str(args.model),
        "--pairs",
        str(folder / f"{data}.jsonl"),
        "--run-out",
        str(run_out),
        "--engine",
        args.engine,
        "--trl-batch",
        str(trl_batch(args, data)),
    ]
    settings = json.dumps(trl_settings) if trl_settings else None
    common += ["--trl-settings", settings] if settings else []
    common += ["--tiny"] if args.tiny else []
    common += ["--compile-layers"] if args.compile_layers else []
    for name in ("pairs_per_step", "gpu_memory_gib", "peak_tflops", "profile_step"):
        if getattr(args, name):
            common += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {"DPOTRAIN_CACHE": tempfile.mkdtemp(dir=folder), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.tiny and args.engine == "single":  # seconds, not a process start per run
        os.environ.update(env)
        worker_args = argparse.Namespace(
            **{
                **vars(args),
                "worker": path,
                "path": path,
                "data": data,
                "pairs": folder / f"{data}.jsonl",
                "run_out": run_out,
                "trl_settings": settings,
            }
        )
        return worker(worker_args)
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    launch = [sys.executable]
    if args.engine == "zero2":
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_config.yaml"),
            "--num_processes",
            "1",
            "--num_machines",
            "1",
        ]
    # Its output as it comes, into its log and this process's own (a GPU lease keeps only the latter, and a path cut
    # off at the lease's limit shows how far it got): never held back until the path ends.
    log = folder / f"{data}-{path}.log"
    output = []
    with (
        log.open("w") as f,
        subprocess.Popen(
            [*launch, __file__, *common],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a library's stray byte is not worth the path
            cwd=ROOT,
        ) as process,
    ):
        for line in process.stdout:
            output.append(line)
            f.write(line)
            f.flush()
            if not line.startswith("RESULT "):  # the record is printed by this process once the path is saved
                print(f"  {data} {path}: {line}", end="", flush=True)
    lines = [line for line in output if line.startswith("RESULT ")]
    if process.returncode or not lines:
        tail = "".join(output).strip().splitlines()[-1:] or ["no output"]
        return {"path": path, "data": data, "failed": tail[0][:300], "log": str(log)}
    return json.loads(lines[-1][len("RESULT ") :])


def verdicts(results: list[dict]) -> list[str]:
    lines = []
    for data in DATA:
        rows = {r["path"]: r for r in results if r["data"] == data and "failed" not in r}
        trl, own = rows.get("trl"), rows.get("project")
        if trl and own:
            ratio = trl["end_to_end_s"] / own["end_to_end_s"]
            less = trl["end_to_end_less_compile_s"] / own["end_to_end_less_compile_s"]
            lines.append(
                _verdict(
                    ratio >= TARGETS[data],
                    f"{data}: end to end {ratio:.2f}x plain TRL, {less:.2f}x less compile time "
                    f"(target >= {TARGETS[data]}x)",
                )
            )
        if own and own["mfu"] is not None:
            lines.append(
                _verdict(
                    own["mfu"] >= MFU_TARGET, f"{data}: training-loop MFU {own['mfu']:.1%} (target >= {MFU_TARGET:.0%})"
                )
            )
        if own and own["reference_tokens_per_s_less_compile"]:
            lines.append(reference_verdict(data, own))
        if own:
            first = own["first_step_s"] / own["steady_step_s"]
            lines.append(
                _verdict(
                    first <= FIRST_STEP_TARGET,
                    f"{data}: first step {first:.2f}x a steady one (target <= {FIRST_STEP_TARGET:g}x)",
                )
            )
        if own and own.get("peak_gib") and own.get("plan_gib") is not None:
            lines += memory_verdicts(data, own)
    return lines


def reference_verdict(data: str, own: dict) -> str:
    """The reference stage's steady tokens/s (after its first micro-batch) over the training loop's steady step's, like
    with like (a 96-pair run's reference stage may be 2 micro-batches, its first ~12 s of warm-up on an H200); the two
    whole, warm-ups and compilation in, beside it. Where the stage ran one micro-batch (nothing steady to time), the
    stage less its compilation is judged."""
    train = own["tokens_per_s_per_gpu"]
    whole = own["reference_tokens_per_s"] / own["train_tokens_per_s"]  # each whole: warm-ups and compilation in
    steady = own.get("reference_steady_tokens_per_s")
    if not steady:
        ratio = own["reference_tokens_per_s_less_compile"] / train
        how = f"the stage less its compilation ({whole:.2f}x each whole; one micro-batch: nothing steady to time)"
    else:
        ratio = steady / train
        warmup = own["reference_warmup_s"]
        how = f"both steady: the stage after its {warmup:.1f} s first micro-batch ({whole:.2f}x each whole)"
    return _verdict(
        ratio >= REFERENCE_TARGET,
        f"{data}: reference stage {ratio:.2f}x the training loop's tokens/s, {how} (target >= {REFERENCE_TARGET}x)",
    )


def memory_verdicts(data: str, own: dict) -> list[str]:
    """The plan against the GPU, like with like: its tensors (total less the allowance for the CUDA context and
    fragmentation) against the peak allocated, within PLAN_MARGIN; its total against the peak the allocator reserved
    (tensors and fragmentation; the CUDA context is outside both)."""
    peak, plan, reserved = own["peak_gib"], own["plan_gib"], own.get("peak_reserved_gib")
    allowance = own.get("plan_allowance_gib") or 0.0
    tensors = round(plan - allowance, 2)
    lines = [
        _verdict(
            peak <= tensors <= peak * (1 + PLAN_MARGIN),
            f"{data}: memory plan's tensors {tensors} GiB (its {plan} GiB less {allowance} GiB for the CUDA context "
            f"and fragmentation) for a peak of {peak} GiB allocated (reference stage {own['reference_peak_gib']} GiB; "
            f"target: >= the peak, within {PLAN_MARGIN:.0%})",
        )
    ]
    at_widest = own.get("plan_tensors_at_widest_gib")
    if at_widest is not None:
        lines.append(
            _verdict(
                peak <= at_widest <= peak * (1 + PLAN_MARGIN),
                f"{data}: memory plan's tensors {at_widest} GiB at the widest micro-batch run "
                f"({own['widest_micro_batch_positions']:,} positions) for a peak of {peak} GiB allocated (target: >= "
                f"the peak, within {PLAN_MARGIN:.0%})",
            )
        )
    if reserved:
        lines.append(
            _verdict(
                reserved <= plan,
                f"{data}: memory plan {plan} GiB for a peak of {reserved} GiB reserved by the caching allocator "
                "(target: the plan >= it)",
            )
        )
    return lines


def _verdict(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'FAIL'} {text}"


COLUMNS = [
    "data",
    "path",
    "attention",
    "forward",
    "dtype",
    "mixed_precision",
    "checkpointing_every_n_layers",
    "pairs_per_step",
    "end_to_end_s",
    "vs_trl",
    "end_to_end_less_compile_s",
    "vs_trl_less_compile",
    "compile_s",
    "reference_s",
    "reference_tokens_per_s",
    "reference_tokens_per_s_less_compile",
    "reference_warmup_s",
    "reference_steady_tokens_per_s",
    "train_s",
    "train_tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "setup_s",
    "first_step_s",
    "first_step_compile_s",
    "first_step_compute_s",
    "steady_step_s",
    "flex_compilations",
    "reference_peak_gib",
    "peak_gib",
    "peak_reserved_gib",
    "plan_gib",
    "plan_allowance_gib",
]


def markdown(results: list[dict], header: str, lines: list[str]) -> str:
    trl = {r["data"]: r for r in results if r["path"] == "trl" and "failed" not in r}
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if "failed" in r:
            table.append(f"| {r['data']} | {r['path']} | failed: {r['failed']} (log: {r['log']}) |")
            continue
        base = trl.get(r["data"])
        if base:
            r = {
                **r,
                "vs_trl": round(base["end_to_end_s"] / r["end_to_end_s"], 2),
                "vs_trl_less_compile": round(base["end_to_end_less_compile_s"] / r["end_to_end_less_compile_s"], 2),
            }
        table.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |")
    return "\n".join([header, "", *table, "", *[f"- {line}" for line in lines], ""])


def save(folder: Path, saved: dict, header: str) -> None:
    """results.json and results.md with the rows so far, each replaced whole (a reader never sees half a file)."""
    lines = verdicts(saved["results"])
    for name, text in (
        ("results.json", json.dumps({**saved, "targets": lines}, indent=2) + "\n"),
        ("results.md", markdown(saved["results"], header, lines)),
    ):
        (folder / f"{name}.partial").write_text(text)
        os.replace(folder / f"{name}.partial", folder / name)


def run_all(args, paths: list[str], folder: Path, saved: dict, header: str) -> list[dict]:
    """Every path on every data set: the project's own run first, plain TRL then at the settings it took (the
    project's run is made for that alone when not asked for). The results are saved as each path finishes."""
    results = saved["results"]
    for data in args.data:
        per_step = args.pairs_per_step or (4 if args.tiny else DATA[data][2])
        scale = TINY_TOKENS / DATA[data][0] if args.tiny else 1
        write_pairs(folder / f"{data}.jsonl", data, args.steps * per_step, scale)
        trl_settings = None
        for path in sorted(set(paths) | ({"project"} if "trl" in paths else set()), key=lambda p: p != "project"):
            if path == "trl" and trl_settings is None:  # unequal settings are no comparison
                record = {
                    "path": path,
                    "data": data,
                    "failed": "not run: the project's run failed, so the settings to compare at are unknown",
                    "log": str(folder / f"{data}-project.log"),
                }
            else:
                record = run_path(args, path, data, folder, trl_settings)
            if path == "project" and "failed" not in record:
                trl_settings = {k: record[k] for k in SETTINGS}
            if path in paths:
                results.append(record)
                save(folder, saved, header)
                print(json.dumps(record), flush=True)
                if "failed" not in record:
                    print(f"{data} {path}: " + ", ".join(f"{k} {record[k]}" for k in SETTINGS), flush=True)
    return results


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for results.json, results.md and each run's log")
    parser.add_argument("--tiny", action="store_true", help="CPU: a 2-layer hidden-64 model, a few pairs")
    parser.add_argument(
        "--engine",
        choices=["single", "zero2"],
        default="single",
        help="zero2: every run under `accelerate launch` with accelerate_config.yaml (DeepSpeed ZeRO-2) on one process",
    )
    parser.add_argument("--data", nargs="+", choices=sorted(DATA), default=sorted(DATA))
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=["trl", *FORWARDS],
        default=None,
        help="default: trl and every forward (--tiny: trl, project, shared_sdpa)",
    )
    parser.add_argument(
        "--layers",
        default="4",
        help="decoder layers of 7B width (default 4: each run within a few "
        "minutes on one H100), or `fit`: as many as the memory plan fits",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the model folder: one written by --write-model is used as it is (its layers, not --layers); "
        "default: written under --out",
    )
    parser.add_argument("--write-model", type=Path, default=None, help="only write the model (--layers, --tiny) there")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (pairs = steps x per step)")
    parser.add_argument("--pairs-per-step", type=int, default=None, help="default: 32 (--tiny: 4)")
    parser.add_argument(
        "--trl-batch",
        type=int,
        default=None,
        help="pairs per padded micro-batch of plain TRL; default: the project's token budget filled with pairs "
        "padded to max_length (think 2 = 2 x 2 x 16,384 = 65,536 positions; multi-turn 4 = 4 x 2 x 4,096 = 32,768)",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="the GPU memory the plan checks against where it cannot be detected (the CPU: --tiny's "
        "layer search plans 7B width for 80)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="default: the GPU's, by name (flops.py)")
    parser.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="the project's paths: this optimizer step (1 = the first) under torch.profiler, its kernels in the record",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="the project's paths with compile_layers (regional torch.compile; plain TRL as is)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--run-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trl-settings", default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    if args.worker:
        args.path, args.data = args.worker, args.data[0]
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    if args.layers != "fit" and not args.layers.isdigit():
        parser.error(f"--layers takes a number or `fit` (got {args.layers!r})")
    if args.write_model:
        print(f"model: {write_model(args.write_model.resolve(), int(args.layers), args.tiny)}", flush=True)
        return
    if args.out is None:
        parser.error("--out FOLDER is required: results.json, results.md and the runs' logs go there")
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("error: no GPU here: run this on a GPU machine (docs/gpu-benchmarks.md), or --tiny on a CPU")
    paths = args.paths or (["trl", "project", "shared_sdpa"] if args.tiny else ["trl", *FORWARDS])
    folder = args.out.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    fit = None
    # The layer search: asked for, or --tiny's own model (7B width, an 80 GiB GPU: the search itself keeps running)
    if args.layers == "fit" or (args.tiny and args.model is None):
        search = argparse.Namespace(**{**vars(args), "gpu_memory_gib": args.gpu_memory_gib or 80})
        fit = layers_that_fit(search, folder / "fit")
        print(f"Layers of 7B width the memory plan fits: {fit}", flush=True)
    layers = TINY["num_hidden_layers"] if args.tiny else fit if args.layers == "fit" else int(args.layers)
    if args.model is None:
        args.model = write_model(folder / ("model-tiny" if args.tiny else f"model-{layers}-layers"), layers, args.tiny)
    layers = json.loads((args.model / "config.json").read_text())["num_hidden_layers"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    header = (
        f"# End to end, {device}, {args.engine}, {layers} decoder layers of OLMo 3 7B's width"
        f"{' (tiny)' if args.tiny else ''}\n\n`python benchmarks/end_to_end.py {' '.join(sys.argv[1:])}`"
    )
    saved = {"layers": layers, "layers_that_fit": fit, "device": device, "engine": args.engine, "results": []}
    run_all(args, paths, folder, saved, header)
    print("\n".join(verdicts(saved["results"])))
    print(f"results: {folder / 'results.md'}, {folder / 'results.json'}")


if __name__ == "__main__":
    main()

"""What `train_dpo.py --dry-run` shows a person: a short summary of what the job will do, before it is submitted.

The full resolved configuration (every field, and under `derived` the step and memory plans) is one JSON object:
written next to the output folder (never inside it: a folder is where a run lives), or printed instead of the summary
with `--json`, for scripts (scripts/launch.sh reads it).
"""

import json
import math
import os
import re
import sys
from pathlib import Path

from dpotrain import output_folder
from dpotrain.data import chat_template, cuts, mixture
from dpotrain.forwards import cost, flops
from dpotrain.hub import hub_push
from dpotrain.plan.memory import EXPANDABLE
from dpotrain.plan.memory_advice import NODE_SIZES
from dpotrain.recipe import hub_switches, run_record
from dpotrain.recipe.errors import ConfigError, decimal, plural
from dpotrain.recipe.run_record import Record, epochs_text, per_step_text
from dpotrain.recipe.writes import check_not_input, check_path_limit, input_files, missing_top, unwritable, write_text
from dpotrain.train import losses

# Memory of GPUs users train on, in GiB as `gpu_memory_gib` takes it (nvidia-smi's total MiB / 1024).
KNOWN_GPUS = {"H100 80GB": 79.6, "H200": 140.4, "B200": 179.0}
GPU_SIZES = ", ".join(f"{size:g} ({name})" for name, size in KNOWN_GPUS.items())  # what --gpu_memory_gib takes


def write_json(resolved: dict, output_dir: str) -> Path:
    """The full plan, beside the output folder (`--output_dir .`: `./.dry-run.json`), never a folder for the run."""
    out = Path(os.path.abspath(output_dir))
    path = out.parent / f"{out.name}.dry-run.json"
    get, sources = resolved.get, mixture.local_files(resolved)  # a mixture's local sources, as the recipe resolved them
    inputs = input_files(get("config"), get("dataset_name"), *sources, get("accelerate_config"))
    # Its name is output_dir's and 13 bytes more: an output_dir name the run takes may leave this one past NAME_MAX.
    check_path_limit("the dry run's record (beside --output_dir; --json prints it instead)", str(path))
    check_not_input("the dry run's record (beside --output_dir)", path, inputs)
    try:
        return write_text(path, json.dumps(resolved, indent=2, default=str) + "\n")
    except OSError:
        if path.is_dir():  # a folder of the record's name: the rename over it failed in an IsADirectoryError traceback
            raise ConfigError(
                f"output_dir {output_dir!r}: {path} is a folder, where the dry run writes its record: move that folder "
                "away, or pass --json to print the record instead"
            ) from None
        problem = unwritable(path.parent)  # a parent that is a file, a read-only mount: named as the run names it
        if problem is None:
            raise  # a full disk: train_dpo's one line for it
        raise ConfigError(
            f"output_dir {output_dir!r}: cannot write the dry run's record beside it in {problem[0]} ({problem[1]}): "
            "pass --output_dir a folder this job can write in, or --json to print the record instead"
        ) from None


def report(
    resolved: dict, output_dir: str, as_json: bool, stdout=None, warnings: tuple = (), caches: str | None = None
) -> None:
    """The dry run's output on the process's own `stdout`: the JSON alone (`--json`), else the summary (`warnings`,
    `caches`: `summary`'s; the JSON records decisions only)."""
    if as_json:
        text = json.dumps(resolved, indent=2, default=str)
    else:
        record = run_record.of(resolved)
        # Not beside a folder the run refuses as no run's (`--output_dir /`, `~`, `.`, `data`): `/.dry-run.json` was
        # written in the root, `data.dry-run.json` in the project, for a run that would never be there; nor where the
        # run's refusal is that nothing can be written (`notes.txt/run`: the record's own error followed it). A run's
        # folder refused for a flag (other settings, --overwrite_output_dir) is where the run goes once it is given.
        refused = (record.output.folder or "").endswith(run_record.REFUSED_FOLDER)
        parent = Path(os.path.abspath(output_dir)).parent
        blocked = unwritable(parent)
        nowhere = output_folder.no_runs_folder(output_dir) or missing_top(output_dir) or blocked
        # Nor beside the Slurm job's own folder, unknown before the job: it was beside the folder as written, named
        # after no job (`runs/$SLURM_JOB_ID.dry-run.json`). Nor where only the run's own folder can be written in (a
        # read-only parent, a folder made for the user in it): the dry run was refused there, the run is not
        skip = refused and nowhere or is_job_folder(record) or blocked
        written = None if skip else write_json(resolved, output_dir)
        text = summary(record, written, warnings=warnings, caches=caches)
    print(text, file=stdout or sys.stdout, flush=True)


def gpu_name(gib: float | None) -> str:
    """A known GPU of this size (within 1 GiB), for the summary; '' when none is."""
    return next((name for name, size in KNOWN_GPUS.items() if gib is not None and abs(size - gib) <= 1.0), "")


def template_text(r: Record) -> str:
    """The chat template the pairs are tokenized with: the recipe's file, or the model's own."""
    t = r.lengths.template or run_record.Template(None, None, None, None, None)
    if t.plain_text:
        unused = f"; chat_template_path is not used ({t.unused})" if t.unused else ""
        return f"none: the pairs are plain text, no chat template applies{unused}"
    digest = f"sha256 {t.sha256[:12]}" if t.sha256 else ""
    if r.settings.chat_template_path:
        return f"{chat_template.named(r.settings.chat_template_path)} ({digest}; chat_template_path)"
    return f"the model's own ({digest or chat_template.unread_text(t.unread)})"


def max_length_text(r: Record) -> str:
    """'1024 (the recipe's); 3 of 40 pairs cut (keep_start: their end), 1 dropped (...)': the pairs the run will cut
    or drop, which the record alone said (a dry run whose max_length dropped half the rows showed only the length)."""
    length, counted = r.lengths, r.batching.max_length_cuts
    if not length.max_length:
        return length.chosen_by
    cut = f"; {cuts.counts(counted)}" if counted and counted["max_length"] else ""
    return f"{length.max_length} ({length.chosen_by}){cut}"


def trained_text(r: Record) -> str:
    """Which tokens of each side are trained: plain text's completion, or the turns `assistant_turns` names."""
    if r.lengths.template and r.lengths.template.plain_text:
        return "the completion after the prompt (plain text has no assistant turns: assistant_turns does not apply)"
    if r.settings.assistant_turns == "all":
        return "every assistant turn of each side (assistant_turns all, as open-instruct trained OLMo 3)"
    return "the final assistant turn of each side (assistant_turns final, TRL's)"


def summary(
    r: Record, json_file: Path | None, heading: str | None = None, warnings: tuple = (), caches: str | None = None
) -> str:
    """The lines a person reads before submitting (and a run prints as it starts, under its own `heading`); `warnings`
    (`lengths.missing_bos`, `lengths.unopened_turn`, not in the record) are rows under the template they are about;
    `caches` (`lengths.written_outside`) what reading the pairs wrote outside the run's folder (a home quota fills)."""
    s, launch, memory = r.settings, r.launch, r.memory
    lines = [heading or f"dry run of {s.config or 'the command line'}: nothing loaded, nothing trained"]

    def row(name: str, text: str) -> None:
        lines.append(f"  {name + ':':<15}{text}")

    model = s.model_name_or_path
    if m := memory.model:
        model += f" ({m['parameters'] / 1e9:.2f}B parameters, {m['layers']} layers, hidden size {m['hidden_size']})"
    precision = "bf16" if s.bf16 else "fp16" if s.fp16 else "fp32"
    if precision == "fp32" and (half := {"bfloat16": "bf16", "float16": "fp16"}.get(s.dtype)):
        # no autocast: the weights' own dtype computes, and the optimizer updates them in it
        precision = f"{half} (the weights' dtype, without mixed precision: no fp32 copy of the weights)"
    row("model", f"{model}; weights load in {s.dtype}, training computes in {precision}")
    if s.use_peft:  # what trains: an adapter, not the weights the model line describes
        # Both where both are given (PEFT adapts the modules and the parameters, an MoE's experts): one hid the other
        targets = s.lora_target_modules or []
        targets = " ".join(targets) if isinstance(targets, list) else targets
        if s.lora_target_parameters:
            parameters = f"parameters {' '.join(s.lora_target_parameters)}"
            targets = f"{targets} and {parameters}" if targets else parameters
        row(
            "LoRA",
            f"an adapter trains on {targets} (r {s.lora_r}, alpha {s.lora_alpha}, dropout {s.lora_dropout:g}); the "
            "model's weights stay frozen"
            # QLoRA: the model line's dtype is what the weights bitsandbytes does not quantize load in
            + (f", the linear layers' in {bits} bits (QLoRA: load_in_{bits}bit)" if (bits := _bits(s)) else "")
            + (f" but {' '.join(s.lora_modules_to_save)}, trained whole" if s.lora_modules_to_save else "")
            + ("; merged into them in merged/ at the end" if s.merge_lora else ""),
        )
    rows, sources = r.data.dataset_rows, r.data.data_sources or []
    data = mixture.of_sources(sources) if sources else f"{s.dataset_name} (split {s.dataset_train_split})"
    row("data", f"{data}: {plural(rows, 'row', ',') if rows is not None else 'rows counted when the run loads it'}")
    lines.extend(f"  {'':<15}{mixture.describe(source)}" for source in sources)
    row("max length", max_length_text(r))
    row("template", template_text(r))
    for warning in warnings:
        row("warning", warning)
    row("trained", trained_text(r))
    row("loss", losses.loss_text(s))
    row("learning rate", learning_rate_text(s))
    row("steps", steps_text(r))
    # The value in effect (engine.gradient_clipping); grad_norm in the logs is the norm before it
    if clipping := launch.gradient_clipping:
        norm, by = clipping["max_grad_norm"], clipping["clipped_by"]
        row("clipping", by if norm is None else f"global gradient norm {norm} (max_grad_norm), by {by}")
    row("time", duration_text(r))
    row("reference", reference_text(s, r.batching.pairs_trained, r.data.total_steps))
    row("watching", watching_text(s, r.data.total_steps))
    row("checkpoints", checkpoints_text(r))
    world, per_node, n = launch.world_size, memory.gpus_per_node, s.sequence_parallel_size or 1
    nodes = -(-world // per_node) if per_node else None
    shape = f", {plural(nodes, 'node')} of {plural(per_node, 'GPU')}" if per_node and world > 1 else ""
    row("processes", f"{world} ({launch.world_size_source}){shape}")
    ranks = launch.data_parallel_size or world
    if n > 1:
        row(
            "sequence",
            f"each micro-batch split over a group of {n} processes (--sequence_parallel_size {n}): "
            f"{plural(ranks, 'data-parallel rank')} (processes / {n}) read the pairs",
        )
    over = "all processes" if n == 1 else plural(ranks, "data-parallel rank")
    row("per step", per_step_text(r.batching, over))
    _batching_rows(r.batching, ranks, row)
    launcher = s.accelerate_config or "none"
    row("engine", memory.engine or ("one process" if launcher.lower() in ("", "none") else launcher))
    row("forward", forward_text(r.forward))
    _memory_rows(memory, row)
    if s.compile_layers:
        row("compile", "each decoder layer (compile_layers): the first steps compile (dpotrain/plan/layers.py)")
    _written_rows(r, caches, json_file, row)
    # Last, where the eye lands: what the run itself would refuse (a login missing on a login node, the folder).
    lines += [f"warning: the run would refuse: {refusal}" for refusal in r.output.would_refuse]
    return "\n".join(lines)


def steps_text(r: Record) -> str:
    """'40 optimizer steps (1 epoch), 4 of warmup', or when they are counted."""
    s, total = r.settings, r.data.total_steps
    if total is None:
        return "counted when the run loads the data set (a dry run reads only local files)"
    trained = r.batching.epochs_trained  # the epochs its steps make (None: a record from before the plan counted them)
    if s.max_steps > 0:
        epochs = "" if trained is None else f" ({plural(decimal(trained), 'epoch')}: max_steps)"  # 2,083.396
    else:  # num_train_epochs rounded up to whole steps: said as the plan's line says it
        epochs = f" ({epochs_text(s.num_train_epochs if trained is None else trained, s.num_train_epochs)})"
    return f"{plural(total, 'optimizer step', ',')}{epochs}, {r.data.warmup_steps:,} of warmup"


def _written_rows(r: Record, caches: str | None, json_file: Path | None, row) -> None:
    """Where the run writes: its folder, the Hub, the caches outside its folder, the dry run's own record."""
    if r.settings.reference_only:  # no run's folder: it said "the run starts there", of a finished run's too
        folder = r.settings.output_dir
        row("output", f"nothing in {folder}: --reference_only scores and caches the reference log-probs, then exits")
    elif r.output.folder:  # a dry run: what the run would do with its folder
        row("output", r.output.folder)
    if r.settings.push_to_hub:
        row("push", push_text(r.settings))
    if caches:
        row("caches", caches)
    if json_file is not None:
        row("everything", f"{json_file} (or --json prints it)")
    elif (r.output.folder or "").endswith(run_record.REFUSED_FOLDER):  # a dry run's: `report` wrote none (no run's)
        row("everything", "not written beside a folder the run refuses (--json prints it)")
    elif is_job_folder(r):
        row("everything", "not written, the job's folder being unknown before the job (--json prints it)")
    elif r.output.folder:  # a dry run's, beside a folder the run may write in, where nothing else can be (`report`)
        parent = Path(os.path.abspath(r.settings.output_dir)).parent
        row("everything", f"not written: {parent} cannot be written in, only the run's folder (--json prints it)")


def is_job_folder(r: Record) -> bool:
    """Whether a dry run's output folder is the Slurm job's own, named as the job starts (run_record.JOB_FOLDER)."""
    return run_record.JOB_FOLDER in (r.output.folder or "")


def push_text(s) -> str:
    """Where the run pushes, and when: what a person checks before a job runs for hours (a mistyped repo id)."""
    # A bare name is the token's account's repo (hub.check_write_access asks whoami as the run starts)
    repo = s.hub_model_id if "/" in s.hub_model_id else f"<the token's account>/{s.hub_model_id}"
    repo += {True: " (private)", False: " (public)"}.get(s.hub_private_repo, "")
    if hub_switches.pushes_offline():  # the run checks no access and pushes nothing (hub.check_push_access)
        # push_checkpoints' checkpoints in the command too: the one named without --checkpoints pushed main alone
        flags, theirs = (["--checkpoints"], ", and each checkpoint still on disk to a branch step-<N>")
        flags, theirs = (flags, theirs) if s.push_checkpoints else ([], "")
        return (
            f"nothing during the run (HF_HUB_OFFLINE): `{hub_push.push_command(s.output_dir, *flags)}`, where the Hub "
            f"is reached, pushes the final model to {repo}{theirs}"
        )
    every = "; each checkpoint's model to a branch step-<N> as it is saved" if s.push_checkpoints else ""
    return f"the final model to {repo} on the Hub once training ends{every}"


def watching_text(s, total: int | None = None) -> str:
    """'health guards stop a doomed run (docs/health.md); no samples (samples_every 0)': whether anything watches the
    run, which the record alone said. `total`: the run's steps, where counted: an interval not below them watches the
    ends alone (the summary said "every 100 steps" of a 48-step run, which sampled the base model alone)."""
    health = "no health guard (health_checks false)"
    if s.health_checks:
        health = f"health guards {'stop' if s.health_action == 'stop' else 'warn of'} a doomed run (docs/health.md)"
        if s.disable_dropout is False and s.health_step1_tolerance:  # the model, not loaded here, has any or none
            health += "; step1 not judged if the model has dropout, kept on in training (disable_dropout false)"
        logged = total and s.logging_steps and interval_steps(s.logging_steps, total)
        if s.logging_strategy == "steps" and logged and total > 2 and logged >= total:  # logged: total counted
            health += (
                f", judging step 1 and step {total:,} alone (logging_steps {s.logging_steps:g} is not below the run's "
                f"{total:,} steps; --logging_steps 1 logs every step)"
            )
    if not s.samples_every:
        return f"{health}; no samples (samples_every 0)"
    every = f"every {s.samples_every} steps" if s.samples_every != 1 else "every step"
    if total and s.samples_every >= total:  # sampled at step 0 and every samples_every steps, not at the end
        every = (
            f"at step 0 alone, the base model's (samples_every {s.samples_every} is not below the run's {total:,} "
            "steps)"
        )
    if s.sample_prompts:  # the first sample_count of those given; of a file's or the data's, up to that many
        n = min(s.sample_count, len(s.sample_prompts))
        return f"{health}; samples from {plural(n, 'prompt')} {every}"
    return f"{health}; samples from up to {plural(s.sample_count, 'prompt')} {every}"


STOP_SAVES = "a stop request (preemption, time limit, Ctrl-C) still saves one"


def checkpoints_text(r: Record) -> str:
    """When checkpoints are written, as transformers' DefaultFlowCallback writes them (every save_steps steps, a
    fraction below 1 of the run's steps rounded up, and at the last step). A save_steps not below the run's steps was
    accepted and said nowhere: the job ran with no checkpoint on the way, and a crash lost every step."""
    s, total = r.settings, r.data.total_steps
    kept = (
        f"; the newest {s.save_total_limit} kept (save_total_limit {s.save_total_limit})" if s.save_total_limit else ""
    )
    if s.save_strategy == "no":
        return f"none (save_strategy no); {STOP_SAVES}"
    # One epoch or less (the recipes train 1): no epoch's end before the last step, as a save_steps past the run below
    epochs = r.batching.epochs_trained if s.max_steps > 0 else s.num_train_epochs
    if s.save_strategy == "epoch" and epochs is not None and epochs <= 1:
        return (
            "NONE before the end: save_strategy epoch saves at each epoch's end, and the run ends within its first "
            f"epoch, so {f'step {total:,}' if total else 'its last step'} alone is saved and a crash before it loses "
            f"every step; {STOP_SAVES}: --save_strategy steps --save_steps N saves every N steps (0.1: every tenth of "
            "the run)"
        )
    if s.save_strategy == "epoch":
        return f"at the end of each epoch{kept}"
    if s.save_strategy == "best":
        return f"at each evaluation that improves {s.metric_for_best_model}{kept}"
    every = s.save_steps
    if total is None:  # the steps are counted when the run loads the data set
        share = f"{every:.0%} of the run's steps" if every < 1 else plural(int(every), "step", ",")
        return f"every {share} and at the end{kept}"
    steps = interval_steps(every, total)
    if steps >= total:
        return (
            f"NONE before the end: save_steps {every:g} is not below the run's {total:,} steps, so step {total:,} "
            f"alone is saved and a crash before it loses every step; {STOP_SAVES}: --save_steps N saves every N "
            "steps (0.1: every tenth of the run)"
        )
    share = f" (save_steps {every:g} of the run's {total:,})" if every < 1 else ""
    every_steps = "every step" if steps == 1 else f"every {plural(steps, 'step', ',')}"
    return f"{every_steps}{share} and at the end (step {total:,}){kept}"


def interval_steps(every: float, total: int) -> int:
    """The steps between a logging or a save, as transformers' TrainerState.compute_steps reads `every`: a fraction
    below 1 of the run's `total` steps, rounded up, else a number of steps."""
    return math.ceil(total * every) if every < 1 else int(every)


def learning_rate_text(s) -> str:
    """'1e-06 (the recipe's learning_rate_note); linear schedule with 10% warm-up (warmup_steps 0.1)'."""
    note = rate_note(s.learning_rate_note, s.learning_rate)
    note = f" ({note})" if note else ""
    warmup = s.warmup_steps
    # transformers takes the whole steps of a number of 1 or more (get_warmup_steps): 1.5 warms up over 1 step
    share = (
        f"{warmup:.0%} warm-up" if 0 < warmup < 1 else plural(int(warmup), "warm-up step") if warmup else "no warm-up"
    )
    schedule = f"{s.lr_scheduler_type} schedule with {share} (warmup_steps {warmup:g})"
    return f"{s.learning_rate:g}{note}; {schedule}"


def rate_note(note: str | None, rate: float) -> str:
    """A recipe's learning_rate_note beside the rate in effect, less a clause (cut at ': ' and '; ') that names
    `--learning_rate X` where X is that rate: think.yaml's "--learning_rate 8e-8 reproduces it" was shown to a run
    given --learning_rate 8e-8."""
    clauses = re.split(r"(?<=[:;]) ", note or "")
    kept = [c for c in clauses if not ((flag := NOTE_RATE.search(c)) and _number(flag[1]) == rate)]
    return " ".join(kept).rstrip(":; ")


NOTE_RATE = re.compile(r"--learning_rate[= ]([^\s,;:)]+)")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def duration_text(r: Record) -> str:
    """How long the reference stage and the steps take: model FLOPs (6 x parameters per token trained, 2 x per token
    scored) / (GPUs x the GPU's peak x the lowest MFU this project measured, forwards/cost.py SPEED); else why not."""
    s, memory, batching, steps = r.settings, r.memory, r.batching, r.data.total_steps
    if not (s.bf16 or s.fp16):
        return "not estimated: this recipe computes in fp32, a CPU run (the estimate is a GPU's: its peak FLOP/s)"
    if not memory.model:
        return f"not estimated: no memory plan, which counts the model's parameters ({memory.skipped or ''})"
    if batching.positions_per_micro_batch is None or steps is None:
        return f"not estimated: tokens per step are known {batching.planned or 'at start'}"
    source = memory.gpu_memory_source
    detected = source.removeprefix("detected: ").split(" (")[0]  # "detected: NVIDIA H100 80GB HBM3 (a note)"
    name = detected if source.startswith("detected") else gpu_name(memory.gpu_memory_gib)
    peak = s.gpu_peak_tflops or flops.peak_of(name)
    if not peak:
        other = "" if source.startswith("detected") else f", or --gpu_memory_gib {GPU_SIZES}"  # a GPU here wins over it
        why = name or "no GPU here and no gpu_memory_gib of a known GPU"
        return (
            f"not estimated: the GPU's peak is unknown ({why}): pass --gpu_peak_tflops (its dense bf16 TFLOP/s){other}"
        )
    mfu = min(speed.share_of_peak for speed in cost.SPEED.values())
    gpus = r.launch.world_size
    tokens = tokens_per_step(batching, r.launch.data_parallel_size or gpus) * steps
    params = memory.model["parameters"]
    seconds = tokens * params / (gpus * mfu * peak * 1e12)  # per FLOP per token and parameter
    # The stage scores each pair the steps train once: a run of 3 epochs scores one epoch's tokens, not 3 epochs' (it
    # said 3x the stage's time)
    epochs, once = max(1.0, batching.epochs_trained or 1.0), ""
    if not s.precompute_ref_log_probs:  # a live reference model (as `reference_text` reads it): a forward every step
        timed, per_token = "no reference stage (a live reference model, in each step)", 8
    else:
        timed, per_token = f"~{_took(2 * seconds / epochs)} reference stage", 6
        once = f", of 1 of the {epochs:g} epochs: each pair is scored once" if epochs > 1 else ""
    on = f"{plural(gpus, 'GPU')} x {peak:,.0f} TFLOP/s{f' ({name})' if name else ''}"
    return (
        f"est. {timed} + ~{_took(per_token * seconds)} for {plural(steps, 'step', ',')}: ~{tokens:,.0f} tokens "
        f"x {per_token} x {params / 1e9:.2f}B parameters (the reference's forward: 2 x{once}) / ({on} x {mfu:.0%} "
        "MFU, the lowest this project measured): an estimate, not a measurement"
    )


def _took(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def tokens_per_step(b: run_record.RecordedBatching, ranks: int) -> float:
    """Real (non-padding) tokens a step trains on, from the step plan."""
    return b.micro_batches_per_step.mean * ranks * b.positions_per_micro_batch.mean * (1 - b.padding_share)


def _batching_rows(b: run_record.RecordedBatching, ranks: int, row) -> None:
    """The summary's micro-batch rows: from the step plan where it is made, else what decides them at start."""
    budget = b.max_tokens_per_microbatch
    if b.positions_per_micro_batch is not None:
        per, widest = b.micro_batches_per_step, b.positions_per_micro_batch.max
        # The budget counts the pairs' tokens; positions count the rows as laid out, their padding included, so the
        # widest micro-batch may pass it (it read "at most 2,048" beside a plan of up to 2,290 positions)
        padded = f"; up to {widest:,} positions with the rows' padding" if budget and widest > budget else ""
        cap = f" (at most {budget:,} tokens of pairs, max_tokens_per_microbatch{padded})" if budget else ""
        row(
            "micro-batches",
            f"{per} per step on each process{f' (mean {per.mean})' * (per.min != per.max)}, "
            f"~{b.positions_per_micro_batch.mean:,.0f} positions each{cap}",
        )
        tokens = f"~{tokens_per_step(b, ranks):,.0f}"
        row("tokens/step", f"{tokens} (from the pairs' token lengths; padding {b.padding_share:.1%})")
        row("layout", b.layout)
    else:
        pairs = b.pairs_per_micro_batch
        cut = f"at most {budget:,} packed tokens each" if budget else plural(pairs, "pair")
        row("micro-batches", f"{cut}; how many per step, and tokens per step: {b.planned or 'at start'}")


def reference_text(s, trained: dict | None, total: int | None = None) -> str:
    """What the reference stage scores: the pairs the planned steps train (a short run's steps train some of them).
    `total`: the run's steps, where counted, against TR-DPO's sync interval."""
    if not s.precompute_ref_log_probs:  # TRL's reference under PEFT: the model itself, no second one
        live = "the model with its LoRA adapter disabled" if s.use_peft else "a live reference model"
        live = f"{live}, run beside every step (no reference stage)"
        # TRL moves it at the end of each step divisible by ref_model_sync_steps (512 by default): one not below the
        # run's steps leaves every step training against the unmoved reference, which the summary said nowhere
        if s.sync_ref_model and total and s.ref_model_sync_steps >= total:
            live += (
                f"; TR-DPO moves it every {s.ref_model_sync_steps} steps (ref_model_sync_steps), not below the run's "
                f"{plural(total, 'step', ',')}: no step trains against a moved reference (plain DPO)"
                + (f": --ref_model_sync_steps {total - 1} or fewer moves it" if total > 1 else "")
            )
        return live
    if trained is None:
        return "the pairs the planned steps train, scored once before training (counted when the run plans its steps)"
    pairs, of, steps = trained["pairs"], trained["of"], trained["steps"]
    scope = (
        f"all {of:,} pairs"
        if pairs == of
        else f"{pairs:,} of the {of:,} pairs (those the {plural(steps, 'planned step', ',')} train)"
    )
    return f"{scope} scored once before training (the reference stage, cached for later runs)"


def forward_text(forward: dict) -> str:
    """'with FlashAttention 4 installed: unshared packing, one row per micro-batch on flash_attention_4 (cheapest
    measured: est. 890 against 1,112 for ..., H100-seconds per 1,000 pairs); without: ...'."""
    parts = []
    if "layout" in forward:  # the forward this machine takes, as the run records it
        forward = {"on this machine": forward}
    for name, f in forward.items():
        if not isinstance(f, dict):
            continue
        if "candidates" in f:
            parts.append(f"{name}: one of {', '.join(f['candidates'])}")
            continue
        estimates = (f.get("decision") or {}).get("estimates", [])
        text = f"{f['layout']} on {f['attention']}"
        if len(estimates) > 1:
            unit, by = f["decision"]["unit"], f["decision"]["by"]
            text += (
                f" ({by}: est. {cost.shown(estimates[0]['estimate'])} against "
                f"{cost.shown(estimates[1]['estimate'])} for {estimates[1]['forward']}, {unit})"
            )
        parts.append(f"{name}: {text}")
    if "decided" in forward:
        parts.append(forward["decided"])
    if "planned_for" in forward and len(parts) > 2:
        parts.append(f"the plans below are for {forward['planned_for']!r}")
    return "; ".join(parts) or "decided at start"


def _memory_rows(memory: run_record.MemoryPlan, row) -> None:
    """The memory plan per GPU, whether it fits which GPU, and how to plan for another."""
    if memory.per_gpu_gib is None:
        row("memory/GPU", f"not planned: {memory.skipped}")
        return
    parts = memory.per_gpu_gib
    detail = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in parts.items() if k != "total")
    row("memory/GPU", f"~{parts['total']} GiB ({detail})")
    if memory.checkpointing:  # activation checkpointing: which decoder layers, and who chose (memory.py)
        row("checkpointing", f"{memory.checkpointing['layers']}, chosen by {memory.checkpointing['chosen_by']}")
    if memory.allocator and EXPANDABLE not in memory.allocator:
        row("allocator", f"{memory.allocator}: the plan's fragmentation allowance assumes {EXPANDABLE}")
    gpu, source = memory.gpu_memory_gib, memory.gpu_memory_source
    if gpu is None:
        unchecked = "not checked: no GPU here and no gpu_memory_gib in the recipe. Plan for yours with --gpu_memory_gib"
        row("GPU", f"{unchecked}: {GPU_SIZES}")
        return
    name = gpu_name(gpu)
    verdict = "fits" if memory.fits else "does NOT fit (--memory_check false let it through)"
    row("GPU", f"{verdict} one {gpu} GiB GPU{f' ({name})' if name else ''}, from {source}")
    if not source.startswith("detected"):
        row(
            "other GPUs",
            f"--gpu_memory_gib {GPU_SIZES}; {other_nodes(memory.world_size, memory.gpus_per_node)} "
            "(scripts/launch.sh sets both from the job's --nodes and --gpus-per-node)",
        )


def other_nodes(world: int, per_node: int) -> str:
    """How to plan the same number of nodes with the other node size of the sbatch scripts (not the one planned)."""
    nodes = -(-world // per_node)
    return "; ".join(
        f"{plural(nodes, 'node')} of {size}: WORLD_SIZE={nodes * size} GPUS_PER_NODE={size}"
        for size in NODE_SIZES
        if size != per_node
    )


def _bits(s) -> int | None:
    """The bits bitsandbytes stores a QLoRA base's linear layers in (--load_in_4bit/8bit), None without."""
    return 4 if s.load_in_4bit else 8 if s.load_in_8bit else None

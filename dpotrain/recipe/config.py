"""Parse a recipe: TRL's own dataclasses plus `ProjectArguments`, with defaults < YAML < command line.

A YAML recipe becomes command-line words placed before the real command line: both go through the same argparse types
and choices (TRL's `TrlParser.parse_args_and_config` makes YAML values defaults, unchecked), and the command line wins
as argparse keeps the last value. Unknown keys are errors that name the closest known one.
"""

import argparse
import contextlib
import copy
import decimal
import functools
import glob
import json
import math
import os
import re
import shlex
import sys
import typing
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dpotrain.recipe import launcher, recipe_file, refused, upstream, usage, venv, writes
from dpotrain.recipe.cli import FALSE, TOKEN_FLAGS, TRUE, value_words, warn_given_twice
from dpotrain.recipe.errors import ConfigError, closest, plural, unknown_key_fix, warn
from dpotrain.recipe.refused import LOAD_BEST_REFUSED, UNSETTABLE

# The files that mark a folder as a run's: run_record.RESOLVED and dpotrain/train/run_files.py's MANIFEST, named here
# (run_record imports this module, run_files is a later stage); the tests hold the names equal
RUN_MARKS = ("resolved_config.json", "run_files.json")


@contextlib.contextmanager
def keep_end_unwarned():
    """TRL's FutureWarning for `truncation_mode: keep_end` silenced: it came with a file path from every build of its
    config (the recipe's, each `dataclasses.replace`, on every rank); `build` says it once in a line instead."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The `'keep_end'` truncation mode is deprecated", FutureWarning)
        yield


def option(default, help: str, **metadata):
    """A field of `ProjectArguments`: its default, and its help (and `choices`) as HfArgumentParser reads them."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class ProjectArguments:
    """Options of this project; everything else is a TRL / transformers field under its own name."""

    pairs_per_step: int | None = option(
        None,
        "Preference pairs per optimizer step over all processes. When set, gradient_accumulation_steps is "
        "derived as pairs_per_step / (per_device_train_batch_size x world size), so the effective batch stays the "
        "same on any number of GPUs or nodes; a value that does not divide evenly is refused at start.",
    )
    max_tokens_per_microbatch: int | None = option(
        None,
        "Token budget of a micro-batch (packed positions of all its chosen and rejected sequences, per "
        "process). An optimizer step keeps pairs_per_step pairs; this decides how they are cut into micro-batches "
        "(a pair is never split), and gradient_accumulation_steps is derived from the data. Must be at least "
        "2 x max_length. Unset: micro-batches of per_device_train_batch_size pairs.",
    )
    sequence_parallel_size: int = option(
        1,
        "Split each micro-batch's packed sequences along the sequence over this many processes (DeepSpeed "
        "Ulysses: attention sees the whole sequence for 1/N of the heads), for pairs longer than one GPU holds. "
        "Data-parallel ranks = processes / N; steps and pairs_per_step count data-parallel ranks, so the same "
        "pairs make the same steps on any N (README: Long traces).",
    )
    # argparse %-formats help texts: a literal percent sign is written %%.
    auto_coverage: float = option(
        0.95,
        "With max_length: auto (and the analyzer's --coverage), the fraction of pairs that must fit without "
        "truncation: max_length is the smallest multiple of 512 reaching it. Packed, a longer max_length costs only "
        "the extra tokens of the longer pairs, so the default leaves 95%% of pairs whole (docs/max_length.md).",
    )
    overwrite_output_dir: bool = option(
        False,
        "Replace a finished run (or half-written checkpoints) in output_dir and start afresh. An "
        "unfinished run with a complete checkpoint still resumes, so a requeued job keeps its progress.",
    )
    auto_resume: bool = option(True, "Resume from the newest verified checkpoint in output_dir when there is one.")
    accelerate_config: str = option(
        "accelerate_config.yaml",
        "Accelerate config whose num_processes a --dry-run outside a launcher predicts as world size (the launch "
        "`accelerate launch --config_file <it>`); `none` predicts plain `python train_dpo.py`, 1 process.",
    )
    gpu_memory_gib: float | None = option(
        None,
        "Memory of one of the job's GPUs in GiB (nvidia-smi's MiB / 1024), for the memory plan of a dry "
        "run on a machine without a GPU (a login node); on a machine with a GPU, its memory is used instead. A "
        "plan that does not fit is refused with the engine or node count that would (dpotrain/plan/memory.py).",
    )
    memory_check: bool = option(
        True,
        "Refuse a run whose memory plan (an estimate, docs/memory.md) exceeds the GPU memory. false: "
        "the plan is only shown, for a setup you know fits.",
    )
    merge_lora: bool = option(
        False,
        "With use_peft: also save the base model with the trained LoRA adapter merged in, to "
        "<output_dir>/merged/ (the adapter itself is always saved in output_dir).",
    )
    dataset_revision: str | None = option(
        None,
        "A Hub data set's commit, branch or tag to train on. Default: the commit `main` points to when the "
        "run starts; a resumed run keeps the commit it started on, wherever `main` has moved since.",
    )
    skip_invalid: bool = option(
        False,
        "Drop the rows the trainer cannot use (null or malformed messages, empty completions, chosen "
        "identical to rejected, ...) and count them in resolved_config.json, instead of refusing the data set.",
    )
    # --- a mixture of sources (dpotrain/data/mixture.py; docs/data.md "Several sources"); dataset_name names one ---
    datasets: list[str] | None = option(
        None,
        "TRL's mixture (DatasetMixtureConfig): in YAML a list of sources, each a mapping with path, name, "
        "data_dir, data_files, split, columns, and either TRL's fraction (its share of the mixture) or amount "
        "(0.5: that fraction of the source, 2.0 upsamples; 1000: that many pairs). Instead of dataset_name.",
    )
    eval_datasets: list[str] | None = option(
        None, "The held-out mixture, written as `datasets` (split default: dataset_test_split)."
    )
    dataset_mixer_list: list[str] | None = option(
        None,
        "open-instruct's mixture: SOURCE AMOUNT [SOURCE AMOUNT ...]; an amount with a decimal point is a "
        "fraction of the source (above 1.0 upsamples), one without is a count of pairs. Instead of dataset_name.",
    )
    dataset_mixer_list_splits: list[str] | None = option(
        None, "The split of each source (one for all). Default: dataset_train_split."
    )
    dataset_mixer_eval_list: list[str] | None = option(None, "The held-out mixture, written as dataset_mixer_list.")
    dataset_mixer_eval_list_splits: list[str] | None = option(
        None, "The split of each held-out source (one for all). Default: dataset_test_split."
    )
    streaming: bool = option(
        False, "TRL's mixture field, accepted as false only: the step plan needs every pair's length up front."
    )
    test_split_size: float | None = option(
        None, "TRL's mixture field, refused (TRL splits without a seed): use eval_datasets instead."
    )
    hh_format: str = option(
        "messages",
        "HH-RLHF strings (`\\n\\nHuman: ... \\n\\nAssistant: ...`): `messages` turns them into message "
        "lists, so the model's chat template applies (what a chat model is trained on); `text` trains the raw "
        "strings, prompt up to the last `Assistant:`. Other data shapes are not affected (docs/data.md).",
    )
    chat_template_path: str | None = option(
        None,
        "The chat template to tokenize with instead of the model's own: a .jinja file, or a folder holding "
        "chat_template.jinja (TRL's spelling). Training, its reference stage, the analyzer, the dry run and the "
        "preflight all use it; it is saved with the model and checkpoints (chat_template.jinja) and recorded by "
        "content. configs/templates/olmo_thinker.jinja is OLMo 3 Think's (docs/data.md, 'Chat template').",
    )
    assistant_turns: str = option(
        "final",
        "Which assistant turns of a multi-turn pair are trained. `final`: TRL's, everything before the "
        "final assistant turn is prompt. `all`: open-instruct's (OLMo 3's), every assistant turn of each side is "
        "labeled, earlier turns included (they are shared by both sides), and each side's log-prob sums (for "
        "sigmoid_norm: averages) over all its labeled tokens (docs/data.md 'Assistant turns').",
        choices=["final", "all"],
    )
    learning_rate_note: str | None = option(
        None,
        "A recipe's word on its learning_rate, shown beside it in the dry run's summary (and the run's "
        "first lines): configs/think.yaml says which rate OLMo 3 used and the flag that reproduces it. A clause "
        "naming `--learning_rate X` is left out where X is the rate in effect.",
    )
    push_checkpoints: bool = option(
        False,
        "With push_to_hub: also push each complete checkpoint's model weights, tokenizer and config (never "
        "optimizer state) to a branch step-<N> of the hub_model_id repo, in the background while training goes "
        "on. With HF_HUB_OFFLINE nothing is pushed during the run: scripts/push_to_hub.py --checkpoints does it "
        "later, for the checkpoints still on disk (save_total_limit deletes older ones).",
    )
    dry_run: bool = option(
        False,
        "Show what the run will do and exit, without loading a model or data: a summary (steps, batching, "
        "memory per GPU and the GPU it is checked against), and the full resolved configuration as JSON in "
        "<output_dir>.dry-run.json (none beside a folder the run refuses as no run's).",
    )
    json: bool = option(False, "With --dry-run: print the full resolved configuration as JSON instead of the summary.")
    share_prompt: bool | None = option(
        None,
        "Compute each pair's prompt once in its packed row instead of twice (dpotrain/forwards/shared_prompt.py): the "
        "same log-probs, loss and gradients, P + C + R positions per pair instead of 2P + C + R. Unset: on where it is "
        "exact (packed rows with sdpa or eager attention; not FlashAttention's varlen kernel, which cannot express "
        "it), with a note otherwise; true: required (refused where it cannot work); false: off.",
    )
    gpu_peak_tflops: float | None = option(
        None,
        "The GPU's dense bf16 peak in TFLOP/s, for the MFU in the logs. Unset: detected for H100, H200, "
        "B200 (dpotrain/forwards/flops.py); without a GPU, no MFU is logged.",
    )
    compile_layers: bool = option(
        False,
        "Compile each decoder layer with torch.compile (regional: one graph per layer kind, the rest of the model "
        "eager; dpotrain/plan/layers.py). Off by default: not yet measured to pay on a GPU (BENCHMARKS.md).",
    )
    reference_only: bool = option(
        False,
        "Score and cache the reference log-probs (the reference stage), then exit without training: run it "
        "on a larger allocation, or as a job of its own before the training job (sbatch --dependency=afterok:). "
        "The training run with the same model, data and max_length reuses the result on any number of processes.",
    )
    reference_save_seconds: float = option(
        120.0,
        "The reference stage writes what each process has scored at least this often (and when it stops), "
        "so a killed job loses at most this much scoring.",
    )
    preflight: bool = option(
        False,
        "Run the preflight (scripts/preflight.py: the base model's log-prob gap between chosen and "
        "rejected on a sample) instead of training; exit 3 when it predicts the run is doomed.",
    )

    # --- training health guards (dpotrain/train/health.py); values from two failed runs (docs/health.md) ---
    health_checks: bool = option(True, "Watch the logged metrics and stop a doomed run.")
    health_action: str = option(
        "stop",
        "What a tripped guard does: stop (a resumable checkpoint, exit 3, no requeue) or warn (a log "
        "line). NaN/inf always stops.",
        choices=["warn", "stop"],
    )
    health_step1_tolerance: float = option(
        0.02,
        "Step 1, before any update: |loss - ln 2| and |rewards| on the loss's scale (beta x log-ratio per "
        "token) must stay within this, else the reference disagrees with the policy. fp32 differs by ~1e-6. 0: off.",
    )
    health_loss_floor: float = option(
        0.01, "Stop when the loss falls below this (a collapsing run's went 0.006 -> 0.000). 0: off."
    )
    health_max_margin: float = option(
        5.0,
        "Stop when the reward margin on the loss's scale exceeds this (above 5 unstable, collapse seen at "
        "9-18; the sigmoid loss is already 0.007 at 5). 0: off.",
    )
    health_logp_drop: float = option(
        1.0,
        "Stop when the chosen AND the rejected log-probs both fell by more than this many nats per token "
        "against the reference (a collapsing policy pushes everything down). 0: off.",
    )
    health_pinned_pairs: int = option(
        1024,
        "Stop when reward accuracy is 1.0 on this many consecutive pairs within health_early_fraction of "
        "training (8 steps of 128 pairs; too rare by chance on real pairs, common in a collapsing run). 0: off.",
    )
    health_early_fraction: float = option(0.25, "The share of training counted as early for health_pinned_pairs.")

    # --- sample generations during training (dpotrain/train/samples.py) ---
    samples_every: int = option(
        0, "Generate from a few fixed prompts every N optimizer steps (and before step 1). 0: off."
    )
    sample_prompts: list[str] | None = option(
        None, "Prompts to sample from (user turns). Default: the data set's first ones."
    )
    sample_prompts_file: str | None = option(
        None, "A file of prompts: .txt (one per line) or .jsonl (a `prompt` string per line)."
    )
    sample_count: int = option(4, "How many prompts (the first ones given or in the data).")
    sample_max_new_tokens: int = option(64, "Greedy generation length per prompt.")
    sample_repetition_warn: float = option(
        0.5,
        "Warn when a sample's repetition score (share of repeated word 3-grams) exceeds this: "
        "a collapsed model's samples read 'hormonal hormonal hormonal'.",
    )


@dataclass
class Recipe:
    script: object  # trl.ScriptArguments
    training: object  # trl.DPOConfig
    model: object  # trl.ModelConfig
    project: ProjectArguments
    config_path: str | None
    max_length_auto: bool
    given: set[str]  # the fields set by the recipe or the command line, not left at their defaults
    replaced_batching: dict | None = None  # the recipe's batching that command-line batch flags replaced
    command_line: tuple[str, ...] = ()  # as typed, without a --hub_token: what a printed command repeats
    # A dry run outside a Slurm job, of a recipe's output_dir naming a SLURM_ variable (`/scratch/runs/$SLURM_JOB_ID`):
    # the job's own folder, unknown before the job, left as written and planned as new (`_recipe_variables`)
    job_folder: bool = False
    # The recipe file names a resume_from_checkpoint: the command a stop prints clears it (preemption.rerun_command)
    recipe_resumes: bool = False
    # The recipe file's mapping from parse_args' one reading (numbers as written, `env:` unexpanded): what a printed
    # command leaves to the file (offline.prefetch_command) is read here, not in the file again, edited since maybe
    in_file: dict = field(default_factory=dict)


def make_parser():
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    # allow_abbrev=False: argparse would otherwise take `--learning_rat` for `--learning_rate`; no usage line of its
    # own (180 lines naming every flag): --help-all starts with --help's (usage.every_field)
    parser = TrlParser(
        (ScriptArguments, DPOConfig, ModelConfig, ProjectArguments),
        prog="train_dpo.py",
        allow_abbrev=False,
        usage=argparse.SUPPRESS,
    )
    # this project's words where upstream's mislead (usage.py), and a refused field's refusal (refused.py)
    words, combined = refused.help_words() | usage.OWN_WORDS, refused.combined_words()
    for action in upstream.parser_actions(parser):
        action.help = words.get(action.dest, action.help)
        if action.dest in combined:  # what it does, then where the run refuses it
            action.help = f"{(action.help or '').strip().rstrip('.')}. {combined[action.dest]}".lstrip(". ")
        # and its defaults, which --help-all shows as `(default: ...)`: it showed TRL's and transformers' own
        action.default = OWN_DEFAULTS.get(action.dest, action.default)
    flags = upstream.long_flags(parser)

    def error(message):  # a value missing or of the wrong type: the flag and what it takes, in one line
        raise ValueRefused(usage.value_refused(message, flags) or message, message)

    parser.error = error  # argparse's prints the whole usage (hundreds of fields): one line instead
    return parser


class ValueRefused(ConfigError):
    """argparse's refusal of a value, said in one line naming its flag; `message`: argparse's own, read again where the
    value is the recipe file's (`_in_recipe_file`)."""

    def __init__(self, said: str, message: str):
        super().__init__(said)
        self.message = message


def _in_recipe_file(refused: ValueRefused, config: dict, config_path: str | None, on_command_line) -> ConfigError:
    """`refused` named as the recipe file's key where the value argparse refused is that file's (its words come before
    the command line's): a recipe's `health_checks: 2` was refused as "--health_checks takes true or false, not '2'",
    a flag nobody typed, or typed right (`--health_checks true`) over the file's value."""
    parts = usage.refused_value(refused.message, _options())
    key = next((k for k in config if parts and ALIASES.get(k, k) == parts[0].dest), None)
    if config_path is None or key is None:
        return refused
    written = [w.removeprefix(f"--{key}=") for w in _as_flags({key: config[key]}) if w != f"--{key}"]
    value = parts[2]
    if value[1:-1] not in written if value is not None else parts[0].dest in on_command_line:
        return refused  # the command line's value
    return ConfigError(usage.value_refused(refused.message, _options(), recipe=(config_path, key)))


def _parse_known(parser, tokens: list[str], config: dict, config_path: str | None, on_command_line):
    """argparse's reading of `tokens`, a value it refuses named where it was written (`_in_recipe_file`); before any
    field is validated, so that an unknown flag is named first."""
    try:
        return parser.parse_known_args(tokens)
    except ValueRefused as refused:
        raise _in_recipe_file(refused, config, config_path, on_command_line) from None


@functools.cache
def _built_parser():
    """The parser, built once per process, and its actions' defaults as built."""
    parser = make_parser()
    return parser, {action: copy.deepcopy(action.default) for action in upstream.parser_actions(parser)}


def _parser():
    """`make_parser()`'s, each default a fresh copy: a parsed field holds its default itself (`loss_type`'s list),
    whose change must not become the next parse's default."""
    parser, defaults = _built_parser()
    for action, default in defaults.items():
        action.default = copy.deepcopy(default)
    return parser


@functools.cache
def _options() -> dict[str, object]:
    """`--name` (snake_case, or kebab-case) -> its argparse action."""
    return upstream.long_flags(make_parser())


def fields_set(words) -> set[str]:
    """The fields that command-line words set (`--name value`, `--name=value`, either spelling)."""
    options = _options()
    return {options[w.split("=")[0]].dest for w in words if w.split("=")[0] in options}


def settings_given(recipe, *switches: str) -> set[str]:
    """The fields given, as a check of a feature's settings reads them: the command line's alone where it typed one of
    the feature's `switches` (a feature turned off for one run leaves the recipe file's settings for it unused, which
    no flag could unset), else every field the recipe or the command line set."""
    typed = fields_set(recipe.command_line)
    return typed if typed & set(switches) else recipe.given


def without(words, fields: set[str]) -> list[str]:
    """Command-line words less the fields named, each with the words the parser takes as its value (`--name value`,
    `--name=value`, either spelling): a printed command whose own flags set those fields."""
    return split_fields(words, fields)[0]


def split_fields(words, fields: set[str]) -> tuple[list[str], list[str]]:
    """(`without(words, fields)`, the words it leaves out: those that set the fields, as typed)."""
    options, kept, taken, i = _options(), [], [], 0
    while i < len(words):
        name, equals, _ = words[i].partition("=")
        action = options.get(name)
        if action is None or action.dest not in fields:
            kept.append(words[i])
        else:
            width = 1 + (0 if equals else len(value_words(action.nargs, words[i + 1 :])))
            taken += words[i : i + width]
            i += width - 1
        i += 1
    return kept, taken


# Names that older transformers / TRL versions (and many tutorials) use, with what replaced them.
_MAX_LENGTH_ONLY = "TRL 1.16 has only max_length; rows whose prompt alone fills it are dropped"
REMOVED = {
    "warmup_ratio": "removed in transformers 5: use warmup_steps: 0.1, a float < 1 is a ratio",
    "evaluation_strategy": "renamed eval_strategy in transformers 5",
    "no_cuda": "removed in transformers 5: use use_cpu: true",
    "logging_dir": "removed in transformers 5: W&B and metrics.jsonl log to output_dir",
    "torch_dtype": "renamed dtype",
    "max_prompt_length": _MAX_LENGTH_ONLY,
    "max_completion_length": _MAX_LENGTH_ONLY,
    # RPO's term, alpha x the chosen answers' mean NLL, is TRL 1.x's `sft` loss type beside the DPO loss: whichever
    # loss type the recipe has (TRL 0.x added it to any; RPO's paper: sigmoid), not sigmoid in its place
    "rpo_alpha": "removed in TRL 1.x: its NLL term is the sft loss type beside your loss, weighted: --loss_type "
    "<your loss_type> sft --loss_weights 1 <rpo_alpha>",
    # TRL 1.x's DPOTrainer has no reference-free mode (its losses all weigh the policy against a reference); the
    # reference-free losses (SimPO, CPO) are trl.experimental's CPOTrainer, which this project does not run
    "reference_free": "removed in TRL 1.x, whose DPO losses all compare with a reference model: drop reference_free",
    "padding_value": "removed in TRL 1.x, which pads with the tokenizer's pad token (pad_token): drop padding_value",
    "label_pad_token_id": "removed in TRL 1.x, which leaves prompt and padding out of the loss itself (its "
    "completion mask): drop label_pad_token_id",
}


# Options of the launchers typed after the script (`sbatch scripts/dpo_train.sh --gpus-per-node=8`: sbatch hands what
# follows the script to it, and it to train_dpo.py), which ended the job at its dry run naming no option to use. Not
# sbatch's --output: more likely --output_dir mistyped, which the suggestion names.
SBATCH_OPTIONS = frozenset(
    "nodes gpus_per_node gpus gres gpus_per_task ntasks ntasks_per_node cpus_per_task cpus_per_gpu mem mem_per_cpu "
    "mem_per_gpu time partition account qos job_name error signal requeue no_requeue exclusive constraint "
    "nodelist exclude dependency array chdir export mail_type mail_user reservation begin".split()
)
ACCELERATE_OPTIONS = frozenset(
    "num_processes num_machines machine_rank main_process_ip main_process_port config_file mixed_precision multi_gpu "
    "use_deepspeed use_fsdp deepspeed_config_file zero_stage gpu_ids same_network rdzv_backend dynamo_backend "
    "num_cpu_threads_per_process deepspeed_multinode_launcher".split()
)

# scripts/preflight.py's own options that train_dpo.py has not (its --seed and --json are train_dpo.py's too): typed
# after `train_dpo.py --preflight`, which runs the same preflight on its default sample, they were "unknown" alone
PREFLIGHT_OPTIONS = frozenset({"sample", "plot"})


def _suggest(name: str) -> str:
    """' (did you mean ...?)' for a misspelled field, written as given; an older version's field: what replaced it; a
    launcher's option typed after the script: where it goes."""
    bare = name.lstrip("-").replace("-", "_")
    if bare in REMOVED:
        return f" ({REMOVED[bare]})"
    if name.startswith("--") and bare in SBATCH_OPTIONS:
        return (
            f" (an sbatch option: give it before the script (sbatch {name}=... scripts/dpo_train.sh ...): after it, "
            "sbatch hands it to the script, which hands it to train_dpo.py)"
        )
    if name.startswith("--") and bare in PREFLIGHT_OPTIONS:
        return (
            f" (an option of scripts/preflight.py: run `python scripts/preflight.py` with the same arguments and "
            f"{name} instead of train_dpo.py --preflight, which scores the preflight's default sample)"
        )
    if name.startswith("--") and bare in ACCELERATE_OPTIONS:
        return (
            f" (an option of accelerate launch: give it before train_dpo.py (accelerate launch {name} ... train_dpo.py "
            "--config ...); a Slurm job takes its processes from its nodes and GPUs, its config from ACCELERATE_CONFIG "
            "or --accelerate_config)"
        )
    known = [o if name.startswith("--") else o[2:] for o in _options() if "-" not in o[2:]]  # snake_case spellings
    # 0.75, not 0.6: among train_dpo's 225 fields 0.6 names a wrong one for many a short word ('config' ->
    # 'fsdp_config', 'precision' -> 'hub_revision', 'name' -> 'run_name'); 0.75 still gives 'learning_rate' for
    # 'learning', 'output_dir' for 'output'
    close = closest(name, known, cutoff=0.75)
    return f" (did you mean {close!r}?)" if close else ""


def read_recipe(path: str, planning: bool = False) -> dict:
    """The recipe file at `path`, checked as training checks it: strict YAML, and every key a field. `planning`: a dry
    run's (the analyzer's, prefetch.py's): outside a Slurm job it leaves unset what names the job's SLURM_ variables."""
    return _env_read(path, _recipe_checked(path), planning)


def _recipe_checked(path: str) -> dict:
    """The recipe file at `path`, read once, every key a field; its `env:` block as written (`_env_read`)."""
    writes.check_path_limit("config", path)
    if Path(path).is_dir():  # there, but not a file: "not found" sent the user looking for it
        inside = sorted(Path(path).glob("*.yaml")) + sorted(Path(path).glob("*.yml"))
        fix = f"one of its files (--config {shlex.quote(str(inside[0]))})" if inside else "a .yaml recipe file"
        raise ConfigError(f"recipe {path!r} is a folder, not a recipe file: pass {fix}")
    if Path(path).exists() and not Path(path).is_file():  # `--config <(sed ... think.yaml)`: was "not found"
        raise ConfigError(
            f"recipe {path!r} is not a file but a pipe or device (as `<(...)` and /dev/stdin give), which reads once, "
            "and a run reads its recipe again (each process of a launch, the prefetch command it prints): write the "
            "recipe to a file and pass that"
        )
    if not Path(path).is_file():
        # Run from outside the project: the fix names the project's file by its path from here
        relative = not Path(path).is_absolute()
        shipped = relative and (venv.ROOT / path).is_file()
        fix = (
            f"--config {shlex.quote(venv.project_file(path))}"
            if shipped
            else f"one of {shlex.quote(venv.project_file('configs'))}/*.yaml"
        )
        raise ConfigError(f"recipe {path!r} not found{f' in {os.getcwd()}' * relative}: pass {fix}")
    config = recipe_file.load(path)
    for key in config:
        if key != "env" and (f"--{key}" not in _options() or "-" in str(key)):  # YAML reads `42:` or `yes:` as no str
            raise _unknown_key(path, key)
    for old, new in ALIASES.items():  # one field under two names: the last line won without a word
        if old in config and new in config:
            raise ConfigError(
                f"{path}: {old} and {new} are one field (transformers 5 renamed {old} to {new}), and the recipe gives "
                f"both: keep {new}"
            )
    _refuse_boolean_text(path, config)
    for key, value in config.items():  # a field of named choices: `save_strategy: no` is transformers' "no", which
        if isinstance(value, bool) and key != "env" and _options()[f"--{key}"].choices:  # was refused as 'false'
            config[key] = recipe_file.boolean_word(path, key) or str(value).lower()
    _refuse_several_values(path, config)
    if not isinstance(config.get("env") or {}, dict):
        raise ConfigError(f"{path}: env: is a mapping of environment variables, one `NAME: value` line each below it")
    return config


def _env_read(path: str, config: dict, planning: bool) -> dict:
    """The checked recipe `config` with its `env:` block's values as the run sets them (`planning`: `read_recipe`)."""
    taken = {}  # what the block sets: the environment wins, and `WANDB_PROJECT:` with no value sets nothing
    left_to_job = set()
    for name, value in (config.get("env") or {}).items():
        _check_env_entry(path, name, value)
        if isinstance(value, (list, dict)):  # `WANDB_TAGS: [dpo, olmo3]` was set to Python's "['dpo', 'olmo3']"
            shown = "a,b" if venv.is_secret_name(str(name)) else ",".join(map(str, value))  # a token's never shown
            example = f" (e.g. {name}: '{shown}')" if isinstance(value, list) else ""
            raise ConfigError(
                f"{path}: env: {name} is a {'list' if isinstance(value, list) else 'mapping'}, and a variable holds "
                f"one text value: write it as the program that reads it takes it{example}"
            )
        if value is None or str(name) in os.environ:
            _say_hidden(path, str(name), value)
            continue
        # A dry run outside a Slurm job: what names the job's variables (SLURM_*, or one the block leaves to the job)
        # is the job's to set, checked with a stand-in for them (another variable not set is refused all the same)
        job, written = (
            JOB_STAND_IN if planning and not os.environ.get("SLURM_JOB_ID") else None,
            recipe_file.written(value),
        )
        if isinstance(value, bool):  # YAML's yes/no/on/off, set as written: `WANDB_CONSOLE: off` was set to 'False'
            written = recipe_file.boolean_word(path, "env", (str(name),)) or written
        named = set(re.findall(r"\$\{?(\w+)", written))
        stand_ins = {n: job for n in named if n.startswith("SLURM_") or n in left_to_job} if job else {}
        read = _env_value(path, str(name), written, {**os.environ, **taken, **stand_ins})
        _check_env_cache_folder(path, str(name), read)
        if stand_ins:
            left_to_job.add(str(name))
        else:
            taken[str(name)] = read
    return config | ({"env": taken, LEFT_TO_JOB: frozenset(left_to_job)} if "env" in config else {})


def _refuse_several_values(path: str, config: dict) -> None:
    """A list of several values, or a mapping, for a field of one value: the list's words were argparse's "unknown
    argument 'b.jsonl'", the mapping went on as its JSON text (`dataset_name: {path: json, ...}` was a Hub name)."""
    mappings = _object_fields(_built_parser()[0]) | UNSETTABLE.keys()  # the fields a mapping is a value of
    for key, value in config.items():
        if key == "env" or _options()[f"--{key}"].nargs not in (None, "?"):
            continue
        if isinstance(value, list) and len(value) > 1:
            given, fix = str(len(value)), SEVERAL_FILES
        elif isinstance(value, dict) and key not in mappings:
            given, fix = "a mapping", MAPPED_SOURCE
        else:
            continue
        fix = fix if key == "dataset_name" else ""  # the data set's own ways to give several, or a mapping
        raise ConfigError(f"{path}: {key} takes one value and the recipe gives {given}: give one{fix}")


def _check_env_entry(path: str, name, value) -> None:
    """What os.environ refuses in a ValueError traceback (`WANDB=PROJECT`, an empty name, a NUL in the value), and a
    name no shell exports: one line (the value never shown: it may be a token)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
        raise ConfigError(
            f"{path}: env: {str(name)!r} is no variable name: write it in letters, digits and _, not a digit first"
        )
    if "\0" in recipe_file.written(value or ""):
        raise ConfigError(f"{path}: env: {name}'s value holds a NUL character, which no variable holds: remove it")


# read_recipe's key (no field's: it holds spaces) for the env: block's names a dry run outside a Slurm job leaves to
# the job, their values naming its SLURM_ variables: read as the job's own, as those are (`_recipe_variables`)
LEFT_TO_JOB = "env left to the job"


# What a dry run outside a Slurm job reads a job's variable as, to check the rest of a value naming it
JOB_STAND_IN = "/slurm-job"


def _env_value(path: str, name: str, written: str, environ: dict) -> str:
    """An `env:` value as the block sets it, read as `export DATA=$SCRATCH/data` reads it (`$$` a `$`). A variable not
    set is refused naming both fixes where the name is no folder's (a token, a note, a pattern: `$$` for a `$` meant
    as written; only the folder's fix was given)."""
    try:
        return venv.shell_expanded(written, environ)
    except venv.Unexpanded as e:
        fix = (
            "or give the folder's absolute path"
            if venv.is_folder_name(name)
            else "or write $$ for a $ meant as written"
        )
        raise ConfigError(f"{path}: env: {name} {_env_shown(name, written)} {_unexpanded(e, path, fix)}") from None


def _refuse_boolean_text(path: str, config: dict) -> None:
    """YAML 1.1 reads an unquoted yes, no, on or off as a boolean: a data set's configuration `no` (Norwegian) was
    asked for as 'false', and `output_dir: yes` trained into a folder named `true`, without a word. A mixture's list
    elements (`dataset_mixer_list_splits: [no]` became 'false') and an entry's names and paths too."""
    for key in (*TEXT_FIELDS, *TEXT_LISTS, *MIXTURE_ENTRIES):
        value = config.get(key)
        if key in TEXT_LISTS and isinstance(value, list):
            value = next((v for v in value if isinstance(v, bool)), None)
        elif key in MIXTURE_ENTRIES and isinstance(value, list):
            # in the file's order, a list's elements too, as `boolean_word` finds the word it quotes back
            parts = [v for e in value if isinstance(e, dict) for k, v in e.items() if k in ENTRY_TEXT]
            parts = [p for v in parts for p in (v if isinstance(v, list) else [v])]
            value = next((v for v in parts if isinstance(v, bool)), None)
        if not isinstance(value, bool):
            continue
        word = recipe_file.boolean_word(path, key, ENTRY_TEXT * (key in MIXTURE_ENTRIES))  # as written, quoted back
        fix = "quote the value, e.g. 'no'" if word is None else f"quote it ({key}: '{word}')"
        if word is not None and isinstance(config[key], list):
            fix = f"quote it ('{word}')"
        raise ConfigError(
            f"{path}: {key} takes text, and YAML reads its unquoted value as the boolean {str(value).lower()} "
            f"(yes, no, on and off too): {fix}"
        )


# Keys other tools take for a base file: a recipe has no include, and `config: ...` was refused as a misspelling
INCLUDE_KEYS = ("config", "include", "includes", "base", "extends", "inherit", "defaults", "import", "imports")


def _unknown_key(path: str, key) -> ConfigError:
    """A recipe's key that names no field, with what to write instead."""
    name = str(key)
    bare = name.lstrip("-")
    if bare.lower() in INCLUDE_KEYS:
        return ConfigError(
            f"{path}: unknown key {key!r}: a recipe includes no other recipe: copy the lines you need from the other "
            "one into this one, or pass that one as --config and this one's changes as flags (--beta 0.1)"
        )
    field = bare.replace("-", "_")
    if name.startswith("-") and f"--{field}" in _options():  # `--beta: 5` was "did you mean '--beta'?"
        return ConfigError(f"{path}: key {key!r}: a recipe's keys are field names without dashes: write `{field}:`")
    return ConfigError(
        f"{path}: unknown key {key!r}{_suggest(bare if name.startswith('-') else name)}. Remove it or fix its spelling."
    )


def _say_hidden(path: str, name: str, value) -> None:
    """The environment wins over the recipe's `env:` block, an empty variable too (as python-dotenv, accelerate and
    Slurm read it): one set empty (`export WANDB_PROJECT=`) hiding the recipe's value is said, with the fix."""
    if value is None or os.environ.get(name) != "" or recipe_file.written(value) == "":
        return
    if launcher.launched_main():  # every rank reads the recipe
        warn(
            f"{path}: env: {name} {_env_shown(name, recipe_file.written(value))} is not used: {name} is set empty "
            f"in the environment, which wins over the recipe (as over .env): unset {name} to take the recipe's"
        )


def _env_shown(name: str, written: str) -> str:
    """An `env:` value as a message quotes it: a secret's (HF_TOKEN, WANDB_API_KEY) never, as the log is kept (an
    empty `HF_TOKEN=` left in `.env` from .env.example hid the recipe's token, and its warning printed the token)."""
    return "(its value not shown: a secret)" if venv.is_secret_name(name) else repr(written)


# What huggingface_hub (HF_HUB_*), datasets (HF_DATASETS_*) and transformers read as they are imported, too late for a
# recipe's `env:`. Their *_OFFLINE switches are handed over (hub_switches.py); HF_TOKEN and others are read when used.
READ_AT_IMPORT = ("HF_HOME", "HF_ENDPOINT", "HF_XET_CACHE", "HF_XET_HIGH_PERFORMANCE", "HF_MODULES_CACHE", "HF_DEBUG")
READ_AT_IMPORT += ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY", "HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_CO_STAGING")
# huggingface_hub's too: the saved login's file (set late, the run found "no token" beside it, or another account's) and
# the folders its caches default to (XDG_CACHE_HOME set late moved datasets' cache, which is imported after the block,
# but not the models': a 7B download filled the home quota it was set to avoid)
READ_AT_IMPORT += ("HF_TOKEN_PATH", "XDG_CACHE_HOME", "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE")


def _check_env_cache_folder(path: str, name: str, value: str) -> None:
    """A cache folder or the Hub's address in a recipe's `env:` block is set after the libraries read theirs, and a
    relative DPOTRAIN_CACHE would be each command's own folder's: refused (only what the block sets is checked)."""
    if name in READ_AT_IMPORT or (name.startswith(("HF_HUB_", "HF_DATASETS_")) and not name.endswith("_OFFLINE")):
        raise ConfigError(
            f"{path}: env: {name} is read by the Hub libraries as they are imported, before the recipe is: set it in "
            f".env or the shell ({name}={shlex.quote(value)}), not in the recipe"
        )
    if name == "DPOTRAIN_CACHE" and value and not os.path.isabs(os.path.expanduser(value)):
        raise ConfigError(
            f"{path}: env: DPOTRAIN_CACHE {value!r} is relative, which each command would read from the folder it "
            "runs in (a Slurm job: the project): give its absolute path (~/ works), or set it in .env (a relative one "
            "there is the project's)"
        )


def _as_flags(config: dict) -> list[str]:
    """The recipe's fields as command-line words, read by the same argparse types and choices as the command line."""

    def word(value) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, dict):  # a mixture entry, its amount as written
            return json.dumps(_written_entry(value))
        return recipe_file.written(value)  # as the recipe wrote it

    def flag(key: str, value) -> list[str]:
        if isinstance(value, list):
            return [f"--{key}", *map(word, value)]
        # joined to its flag where it starts with `-` (`run_name: "-ablation"`): argparse takes a word of its own that
        # starts so for a flag, and refused the recipe's value as "none given"
        return [f"--{key}={word(value)}"] if word(value).startswith("-") else [f"--{key}", word(value)]

    return [w for key, v in config.items() for w in flag(key, v)]


def _amount_text(value):
    """A recipe's amount: its text where the number was written with an exponent that YAML 1.1 read as text, without a
    decimal point (`1e3`) or a sign (`1.5e3`): mixture.py refuses it, where a number would be a count or a fraction."""
    text = recipe_file.written(value)
    return text if isinstance(value, float) and ("." not in text or re.search(r"[eE]\d", text)) else value


# transformers 5's deprecated names, renamed first so the last value wins (an old one is read only if the new is unset)
ALIASES = {
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
}


def _renamed(words: list[str]) -> tuple[list[str], bool]:
    """`words` with each deprecated flag renamed, and whether max_length is `auto` (passed on to TRL as None)."""
    options, out, auto, i = _options(), [], False, 0
    while i < len(words):
        flag, eq, value = words[i].partition("=")
        i += 1
        if flag in ("--max_length", "--max-length"):
            # The next word is its value unless it is a flag: `--max_length` alone is argparse's "expected one
            # argument" (said with what it takes: usage.value_refused), not a length of '' or '--beta'
            if not eq and i < len(words) and not words[i].startswith("--"):
                value, eq, i = words[i], "=", i + 1
            auto = bool(eq) and value.lower() == "auto"  # `Auto`, `AUTO`: no other word is a length
            out += [flag, "None" if auto else value] if eq else [flag]
            continue
        action = options[flag] if flag.startswith("--") and flag in options else None
        new = ALIASES.get(action.dest) if action is not None else None
        if new and action.nargs == 0:  # argparse's `--no_gradient_checkpointing` (store_false): its value, not on
            eq, value = "=", str(action.const).lower()
        out.append(f"--{new}{eq}{value}" if new else words[i - 1])
    return out, auto


def _negative_values_joined(words: list[str]) -> list[str]:
    """`--flag -1e-6` as `--flag=-1e-6`, for every flag of one value: argparse reads a word starting with `-` as a flag
    unless it looks like `-1` or `-0.5` to it (no exponent, no inf), so `--learning_rate -1e-6` (or a recipe's
    `learning_rate: -1e-6`) was refused as "none given" before the range check could name the value. Joined, the word
    is read as any value is (`--max_steps -1` as before). A list flag's (`--loss_weights 1 -1e-3`: "unknown argument
    '-1e-3'") is written out in decimals, `-0.001`, which argparse reads as a number: the same float."""
    options, out, listing = _options(), [], None
    for word in words:
        flag = out[-1] if out else ""
        action = options.get(flag) if flag.startswith("--") else None
        if word.startswith("--"):  # a list of numbers: a list of text (sample prompts, names) takes `-5e1` as given
            taking = options.get(word)
            listing = (
                taking if taking is not None and taking.nargs in ("+", "*") and taking.type in (float, int) else None
            )
        if action is not None and action.nargs in (None, "?") and _negative_number(word):
            out[-1] = f"{flag}={word}"
        elif listing is not None and _negative_number(word) and math.isfinite(float(word)):
            out.append(format(decimal.Decimal(word), "f"))
        else:
            out.append(word)
    return out


def _negative_number(word: str) -> bool:
    if not word.startswith("-") or word.startswith("--"):
        return False
    try:
        float(word)
    except ValueError:
        return False
    return True


# TRL and transformers fields whose default this project sets otherwise, unless the recipe or command line gives one.
OWN_DEFAULTS = {
    "padding_free": True,  # packed sequences (TRL's is False)
    # transformers' True logs a NaN or inf loss as the mean of the steps before it, and syncs the GPU every step
    "logging_nan_inf_filter": False,
}


def parse_args(argv: list[str] | None = None) -> Recipe:
    typed_here = argv is None  # a person's command line; a program's words (a test, a notebook) may layer overrides
    argv = list(sys.argv[1:] if argv is None else argv)
    typed = without_secrets(argv)
    flag = dry_run_flag(argv)  # the recipe's `dry_run: true` is read with the recipe, once (`dry_run_asked`)
    parser = _parser()
    if {"-h", "--help"} & set(argv):  # what users type first; every field one flag away
        print(usage.short_help(parser, ProjectArguments))
        raise SystemExit(0)
    if "--help-all" in argv:
        print(usage.every_field(parser))
        raise SystemExit(0)

    config_path, argv = take_config(argv)
    if typed_here:
        warn_given_twice(argv, _options(), LAUNCHER_FIELDS, ALIASES)
    checked = _recipe_checked(config_path) if config_path is not None else {}
    dry = dry_run_asked(flag, checked)  # before its env: block is read, which a dry run reads as planning
    config = _env_read(config_path, checked, planning=dry) if config_path is not None else {}
    in_file = copy.deepcopy(checked)  # the recipe's own, whatever the parse does with `config`
    # stdout: a dry run's summary alone. The parse imports TRL where its caller had not (an importer of this module
    # alone), and transformers prints "[INFO] Running in WANDB offline mode" as it is imported
    with contextlib.redirect_stdout(sys.stderr) if dry else contextlib.nullcontext():
        return _built(argv, config, config_path, dry, parser, typed, in_file)


def _built(argv: list[str], config: dict, config_path: str | None, dry: bool, parser, typed, in_file: dict) -> Recipe:
    """The recipe from the command line's words (without --config) over the recipe file's `config`, checked;
    `in_file`: that file's mapping as read."""
    _take_env_block(config.pop("env", None) or {})
    left_to_job = config.pop(LEFT_TO_JOB, frozenset())
    launcher.check_process_counts()
    # A recipe's `field: null` is a None default, given as no words (argparse reads "None" as text); a value's default:
    # refused, unless the command line gives the field. An unknown field goes on as words, to be named as unknown.
    options, on_command_line = _options(), fields_set(argv)
    unset = _unset(config, options)
    for key in unset:
        default = options[f"--{key}"].default
        if default is not None and options[f"--{key}"].dest not in on_command_line:
            raise ConfigError(
                f"{key}: null in the recipe, but {key} needs a value: delete the line for its default ({default!r}) "
                "or write one"
            )
    words, max_length_auto = _renamed(_as_flags({k: v for k, v in config.items() if k not in unset}) + argv)
    words = _negative_values_joined(words)
    tokens = _one_process_backend(words) + _cpu_deepspeed_backend(words)
    if unsettable := sorted(fields_set(tokens) & UNSETTABLE.keys()):
        raise ConfigError(f"{unsettable[0]} cannot be set here: {UNSETTABLE[unsettable[0]]}")
    known, remaining = _parse_known(parser, tokens, config, config_path, on_command_line)
    if remaining:
        raise _unknown_words(tokens, remaining, on_command_line | {ALIASES.get(f, f) for f in on_command_line})
    if config_path is None and not fields_set(argv) - {"dry_run", "json"}:
        # No recipe and no field (a program's parse of fields alone is its own): TRL's defaults were checked, and
        # `python train_dpo.py` bare stopped on "bf16/gpu". A mistyped flag is named first (above).
        configs = shlex.quote(venv.project_file("configs"))  # its path from the folder run in
        raise ConfigError(
            f"no recipe and no model: pass --config {configs}/<name>.yaml (think.yaml, instruct.yaml, "
            "think-32b.yaml; smoke.yaml: the CPU demo), or --model_name_or_path with every field the run needs"
        )
    _launch_deepspeed_file(known.accelerate_config)  # before TrainingArguments, which read it
    # Every value this project decides from the parsed ones is decided before the dataclasses are built (as
    # HfArgumentParser builds them), so TRL's and transformers' checks run on the values the run uses
    values, given = dict(vars(known)), fields_set(tokens)
    if "dataset_name" in on_command_line and values["dataset_name"] != recipe_file.written(config.get("dataset_name")):
        # The recipe file's configuration and commit are its data set's (as a mixture on the command line drops them,
        # `_command_line_data_wins`): a local file typed was refused for them, which no flag unsets; another Hub data
        # set was asked for the recipe's configuration, at the recipe's commit
        values |= dict.fromkeys({"dataset_config", "dataset_revision"} - on_command_line)
    replaced, job_folder = _decided(values, given, on_command_line, config_path, left_to_job)
    _check_eval_steps(values, given)  # before transformers reads 0 as unset
    _check_json_objects(values, given, parser)
    try:
        upstream.skip_deepspeed_shm_op()  # TrainingArguments makes the launch's process group here (PartialState)
        with upstream.gpu_precision_checks_skipped() if dry else contextlib.nullcontext(), keep_end_unwarned():
            built = [
                kind(**{f.name: values[f.name] for f in fields(kind) if f.init}) for kind in parser.dataclass_types
            ]
    except ValueError as e:  # transformers' own validation of TrainingArguments: a user error, said in one line
        raise _refused_upstream(e, known) from None
    script, training, model, project = built
    _check_finite(*built)
    if training.truncation_mode == "keep_end" and launcher.launched_main():
        warn("truncation_mode keep_end is deprecated by TRL (to be removed in TRL 2.0); it trains as TRL defines it")
    if project.gpu_memory_gib is not None and project.gpu_memory_gib <= 0:  # the analyzer's plan reads it too
        raise ConfigError(
            f"gpu_memory_gib must be > 0 (got {project.gpu_memory_gib:g}): one GPU's memory in GiB (an H100 80 GB: "
            "79.6), or unset it to plan for the GPU of the machine"
        )
    list_single_target(model)
    resumes = bool(config.get("resume_from_checkpoint"))
    return Recipe(
        script,
        training,
        model,
        project,
        config_path,
        max_length_auto,
        given,
        replaced,
        typed,
        job_folder,
        resumes,
        in_file,
    )


def _unset(config: dict, options: dict) -> set[str]:
    """The recipe's fields given `null`, less those whose type reads the word null as None though their default is a
    value (`max_length: null`, TRL's unbounded), which take that word in `config`, as `--max_length null` gives it:
    refused as "needs a value", the recipe could not say what the command line can."""
    unset = {k for k, v in config.items() if v is None and f"--{k}" in options}
    nulls = {k for k in unset if options[f"--{k}"].default is not None and _reads_null(options[f"--{k}"])}
    config |= dict.fromkeys(nulls, "null")
    return unset - nulls


def _reads_null(action) -> bool:
    """Whether a field's argparse type reads the word `null` as None (TRL's for an `int | None` field), not as text."""
    try:
        return action.type not in (None, str) and action.type("null") is None
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False


SEVERAL_FILES = " (several files of pairs: one source of a mixture, `datasets:` with `data_files`, docs/data.md)"
MAPPED_SOURCE = (
    " (a source written as a mapping, path: and data_files:, is a mixture's entry: `datasets: [{...}]`, docs/data.md)"
)


# Hyphens a page or chat turns `--` into (en and em dashes, ...), pasted with a flag: `–max_steps` is no flag
DASHES = "-\u2010\u2011\u2012\u2013\u2014\u2015\u2212"


def _unknown_words(tokens: list[str], remaining: list[str], typed: set[str]) -> ConfigError:
    """What argparse left over: an unknown flag by its name alone (`--hub_tokn=hf_...` must not print the token), a
    field's name without its `--`, else a word past the value of a one-value flag of the command line (`typed`: its
    fields), named with that flag, not the value (it may be a token), nor that word past a token. The help named is
    train_dpo.py's, whose fields these are, also where another script passes them on (prefetch.py, preflight.py)."""
    flag = next((r.split("=")[0] for r in remaining if r.startswith("-")), None)
    if flag is not None:
        return ConfigError(f"unknown argument {flag!r}{_suggest(flag)}; see train_dpo.py --help")
    options = _options()
    # A field without its two hyphens (`max_steps 10`, Hydra's `learning_rate=1e-5`, a pasted `–max_steps`) was said to
    # follow the value of the recipe's last field, which the user never typed. Its value is not printed: a token's.
    name, eq, _ = remaining[0].lstrip(DASHES).partition("=")
    if f"--{name}" in options:
        shown = remaining[0].partition("=")[0] + "=..." * bool(eq)
        return ConfigError(f"unknown argument {shown!r}: a field is given as a flag, two hyphens: --{name} VALUE")
    for i, word in enumerate(tokens):
        name, eq, _ = word.partition("=")
        action = options.get(name)
        if eq and action is not None and action.nargs in ("+", "*") and tokens[i + 1 : i + 2] == remaining[:1]:
            return ConfigError(  # `--loss_type=sigmoid sft`: argparse takes one word after `=`
                f"unknown argument {remaining[0]!r}: {name}= takes the one word after `=`: give several after a space "
                f"({name} a b)"
            )
        if action is None or action.nargs not in (None, "?") or action.dest not in typed:  # not a recipe's field
            continue
        after = [w for w in tokens[i + 1 : i + 3 - bool(eq)] if not w.startswith("--") and w not in options]
        if len(after) == 2 - bool(eq) and after[-1] == remaining[0]:  # the word past its one value
            if name in TOKEN_FLAGS:  # a part of the token too, maybe: a file of two lines, a token pasted with a space
                return ConfigError(
                    f"unknown argument (not shown: it may be a part of a token) after the value of {name}, which "
                    "takes one: give the token alone"
                )
            several = SEVERAL_FILES if action.dest == "dataset_name" else ""
            return ConfigError(
                f"unknown argument {remaining[0]!r}: it follows the value of {name}, which takes one: give one{several}"
            )
    return ConfigError(f"unknown argument {remaining[0]!r}; see train_dpo.py --help")


def _refused_upstream(e: ValueError, known) -> ConfigError:
    """TRL's or transformers' refusal of the parsed fields (`known`), as one line that names the fix."""
    if "load_best_model_at_end" in str(e):
        return ConfigError(LOAD_BEST_REFUSED)
    if "`loss_weights` must have the same length" in str(e):  # TRL's line named the mismatch, not its fix
        return ConfigError(_weights_refused(known.loss_type, known.loss_weights))
    if "existing deepspeed config" in str(e):  # accelerate's, for a deepspeed_config_file found nowhere
        return ConfigError(f"{e} (the accelerate config's, not in {launch_file_places()}: {DS_FILE_FIX})")
    hint = next((fix for said, fix in UPSTREAM_FIXES if said in str(e)), "")
    return ConfigError(f"{e}{f' ({hint})' if hint else ''}")


# The fix for each of transformers' refusals of TrainingArguments that says what is wrong but not what to pass
STEPS_OR_FRACTION = "a whole number of steps, or a fraction of the run below 1: 0.1"
UPSTREAM_FIXES = (
    ("--tf32 requires", "here: --tf32 false, or run it on an Ampere or newer GPU; a --dry-run plans it from anywhere"),
    ("bf16", "on a CPU machine: --bf16 false, or the CPU demo configs/smoke.yaml"),
    (
        "requires non-zero --logging_steps",
        "give a number of steps, the recipes log every step: --logging_steps 1, or a fraction of the run: 0.1",
    ),
    ("requires either non-zero --eval_steps", f"give --eval_steps as {STEPS_OR_FRACTION}"),
    (
        "Expected value warmup_steps >= 0",
        "give a number of steps, or a fraction of the run below 1: the recipes warm up over 0.1 of it; 0 for none",
    ),
    ("must be an integer if bigger than 1", f"give {STEPS_OR_FRACTION}"),
    ("torch_empty_cache_steps` must be", "give a number of steps, or leave it unset to never empty the cache"),
)


# Fields of a JSON object that transformers also reads as the path of a JSON file ("Path to JSON config file"); the
# engine's own two, `deepspeed` and `fsdp_config`, are refused at any value (options.check_engine_switches)
OBJECT_OR_FILE = ("accelerator_config",)
ENGINE_OBJECTS = ("deepspeed", "fsdp_config")


def _object_fields(parser) -> set[str]:
    """The fields typed `dict | str`, by their annotations (HfArgumentParser rewrites the fields' types to `str`)."""
    hints = [typing.get_type_hints(kind) for kind in parser.dataclass_types]
    kinds = {name: typing.get_args(hint) for each in hints for name, hint in each.items()}
    return {
        name for name, args in kinds.items() if str in args and any(dict in (a, typing.get_origin(a)) for a in args)
    }


def _check_json_objects(values: dict, given: set[str], parser) -> None:
    """A field typed `dict | str` given text that is no JSON object: transformers parses only a value starting with `{`
    and keeps any other as text, so `--model_init_kwargs dtype=bfloat16` ended in a traceback at the checks, and
    `activation_checkpointing_kwargs: use_reentrant` in one after the model loaded; `{"a":` in JSON's words alone
    ("Expecting value: line 1 column 6"), naming no field. Parsed here, or refused naming the field (not its text: a
    model_init_kwargs may hold a token). A recipe's mapping arrives as JSON (`_as_flags`)."""
    for name in sorted(given & _object_fields(parser) - set(ENGINE_OBJECTS)):
        value = values[name]
        if not isinstance(value, str):
            continue
        shape = f"""--{name} '{{"key": value}}' (in a recipe: `key: value` lines indented below {name}:)"""
        if value.lstrip().startswith("{"):
            try:
                json.loads(value)  # transformers parses it (and reads "true", "0.1" inside as a bool, a number)
            except json.JSONDecodeError as e:
                said = e.msg.removesuffix(" at")  # "Unterminated string starting at"
                raise ConfigError(
                    f"{name} is not valid JSON ({said} at character {e.pos}): write it as {shape}"
                ) from None
            values[name] = value.lstrip()  # transformers' test is `startswith("{")`: ` {...}` stayed text
        elif name not in OBJECT_OR_FILE:
            raise ConfigError(
                f"{name} takes a JSON object, and the text given is not one: write it as {shape}, or '{{}}' for none"
            )
        elif not Path(value).expanduser().is_file():
            raise ConfigError(
                f"{name} takes a JSON object or the path of a JSON file holding one, and the text given is neither: "
                f"write it as {shape}"
            )
    if "accelerator_config" in given and isinstance(values["accelerator_config"], str):
        _check_accelerator_keys(values["accelerator_config"])


def _check_accelerator_keys(value: str) -> None:
    """An accelerator_config key AcceleratorConfig does not take (`split_batchs`): transformers builds it with the
    keys as given, and its TypeError was a traceback. Named with the key it may mean (a JSON object, or its file)."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    try:
        text = value if value.lstrip().startswith("{") else Path(value).expanduser().read_text()
        keys = set(json.loads(text))
    except (OSError, ValueError, TypeError):  # transformers' own error names a file it cannot read
        return
    known = {f.name for f in fields(AcceleratorConfig)}
    for key in sorted(keys - known):
        fix = unknown_key_fix(key, known)
        raise ConfigError(f"accelerator_config {key!r} is no key of transformers' AcceleratorConfig: {fix}")


def _check_eval_steps(values: dict, given: set[str]) -> None:
    """`eval_steps 0` under eval_strategy steps: TrainingArguments reads 0 as unset and evaluates every logging_steps
    instead (every step under the OLMo 3 recipes), recording that value in its place: refused before it is built."""
    strategy = values["eval_strategy"]  # argparse's word, or transformers' enum
    if "eval_steps" in given and values["eval_steps"] == 0 and getattr(strategy, "value", strategy) == "steps":
        logging = values["logging_steps"]
        raise ConfigError(
            f"eval_steps 0 is no schedule: transformers would evaluate every logging_steps ({logging:g}) steps "
            "instead: give a number of steps (--eval_steps 50) or a fraction of the run (0.1), or remove "
            "eval_steps to evaluate every logging_steps"
        )


def _weights_refused(types, weights) -> str:
    """loss_weights of another length than loss_type (TRL's DPOConfig refuses it as it is built)."""
    types = [types] if isinstance(types, str) else list(types)
    return (
        f"loss_weights {' '.join(f'{w:g}' for w in weights)} gives {plural(len(weights), 'weight')} for "
        f"{plural(len(types), 'loss type')} ({' '.join(types)}): give one weight per type, in loss_type's order (MPO: "
        "--loss_type sigmoid bco_pair sft --loss_weights 0.8 0.2 1.0), or remove loss_weights (each term then weighs 1)"
    )


def _decided(
    values: dict, given: set[str], on_command_line: set[str], config_path: str | None, left_to_job: frozenset[str]
) -> tuple:
    """The parsed `values` with what this project decides from them: its defaults, batch and data flags of the command
    line over the recipe's, paths placed, the run's name and folder. Returns what the batch flags replaced, and whether
    output_dir is the Slurm job's own folder, left as written (`_recipe_variables`, with the env: block's names
    `left_to_job`)."""
    values |= {name: value for name, value in OWN_DEFAULTS.items() if name not in given}
    # TRL's default for checkpointing under transformers 5's name (the old one, renamed where given, is deprecated)
    if "activation_checkpointing" not in given:
        values["activation_checkpointing"] = values["gradient_checkpointing"]
    if values["use_peft"] and values["disable_dropout"] and "lora_dropout" not in given:
        # TRL's disable_dropout zeroes the adapter's dropout too: the record and adapter_config.json say so
        values["lora_dropout"] = 0.0
    replaced = _command_line_batch_wins(values, on_command_line)
    job_folder = _placed_paths(values, given, on_command_line, config_path, left_to_job)
    _check_blank_names(values, given)
    if "output_dir" in on_command_line and "run_name" not in on_command_line:
        values["run_name"] = Path(values["output_dir"]).expanduser().resolve().name
    if not values["run_name"]:  # from the recipe's file name; output_dir from it, outputs/<run_name>
        values["run_name"] = Path(config_path).stem + "-dpo" if config_path else "dpo"
    if "output_dir" not in given:
        _check_folder_name(values["run_name"])
        values["output_dir"] = str(Path("outputs") / values["run_name"])
    values["output_dir"] = _walked_back(values["output_dir"])
    if there := in_submit_dir(values["output_dir"]):  # a Slurm job's output folder, absolute
        values["output_dir"] = os.path.abspath(there if "output_dir" in on_command_line else values["output_dir"])
    return replaced, job_folder


def _check_blank_names(values: dict, given: set[str]) -> None:
    """A blank run_name or output_dir, refused rather than taken for unset or made a folder of blanks."""
    if "run_name" in given and not (values["run_name"] or "").strip():
        raise ConfigError(
            f"run_name {values['run_name']!r} is blank: give the run a name, or remove run_name to name it after the "
            "recipe (or after --output_dir)"
        )
    out = values["output_dir"]
    if "output_dir" in given and (not out.strip() or any(not part.strip() for part in Path(out).parts)):
        raise ConfigError(
            f"output_dir {out!r} is blank{' in part' if out.strip() else ''}: name the run's folder (--output_dir "
            "outputs/my-run), or remove output_dir for outputs/<run_name>"
        )


def _walked_back(out: str) -> str:
    """output_dir with a '..' after a folder's name (`runs/a/checkpoint-48/..`) as the folder it names at the start,
    resolved by the file system (`runs/a`). Every path of the run's files went through that folder, which may be one
    the run deletes (a checkpoint, by rotation or --overwrite_output_dir): from then on none could be written, and
    the run ended "deleted or moved away", its old run half removed and its lock left. A leading '..' goes through
    no folder of the run's and is kept as written."""
    path = Path(out).expanduser()
    parts = path.parts
    last = max((i for i, part in enumerate(parts) if part == ".."), default=0)
    if not [part for part in parts[:last] if part not in ("..", path.anchor)]:
        return out
    return os.path.join(os.path.realpath(os.path.join(*parts[: last + 1])), *parts[last + 1 :])


def _check_folder_name(run_name: str) -> None:
    """A run name that names the run's folder, outputs/<run_name>, is one folder's name: `a/b` trained into a folder
    under outputs/a, `../x` into the project's x/, `.` into outputs/ itself, beside the other runs."""
    if "/" in run_name or os.sep in run_name or run_name.strip() in (".", ".."):
        raise ConfigError(
            f"run_name {run_name!r} names the run's folder, outputs/<run_name>, and is not one folder's name: name the "
            "run without '/' (--run_name my-run), or give its folder (--output_dir runs/my-run)"
        )


# A mixture source read by datasets' builder of that name (`path: json` + `data_files: x.jsonl`)
MIXTURE_BUILDERS = frozenset({"json", "csv", "parquet"})
# A mixture's two spellings, TRL's and open-instruct's (with its splits), for the training and the held-out pairs
MIXTURE_SPELLINGS = (
    ("datasets", "dataset_mixer_list", "dataset_mixer_list_splits"),
    ("eval_datasets", "dataset_mixer_eval_list", "dataset_mixer_eval_list_splits"),
)


def _command_line_data_wins(values: dict, on_command_line: set[str]) -> None:
    """The data the command line names replaces the recipe file's, in either spelling (both on it stay refused)."""
    for trl, mixer, splits in MIXTURE_SPELLINGS:
        here = {trl, mixer} & on_command_line
        if here == {trl}:
            values |= dict.fromkeys({mixer, splits} - on_command_line)
        elif here == {mixer}:
            values[trl] = None
    mixed_here = {"datasets", "dataset_mixer_list"} & on_command_line
    if mixed_here and "dataset_name" not in on_command_line:
        # with the recipe file's configuration and commit of it (refused beside a mixture)
        values |= dict.fromkeys({"dataset_name", "dataset_config", "dataset_revision"} - on_command_line)
    elif "dataset_name" in on_command_line and not mixed_here:
        values |= dict.fromkeys(("datasets", "dataset_mixer_list", "dataset_mixer_list_splits"))


# The files a recipe may name by a path relative to the project
RECIPE_PATHS = ("dataset_name", "model_name_or_path", "chat_template_path", "sample_prompts_file", "accelerate_config")
PATH_FIELDS = (*RECIPE_PATHS, "resume_from_checkpoint")  # every field that names a file or folder read
# Fields that take a name or a path, never a yes or no
TEXT_FIELDS = ("run_name", "output_dir", "dataset_config", "dataset_train_split", "dataset_test_split")
TEXT_FIELDS += ("dataset_revision", "model_revision", "hub_revision", "hub_model_id", *RECIPE_PATHS)
# A mixture's lists of sources and splits, each element text; TRL's entries, whose names and paths are text
TEXT_LISTS = ("dataset_mixer_list", "dataset_mixer_list_splits", "dataset_mixer_eval_list")
TEXT_LISTS += ("dataset_mixer_eval_list_splits",)
MIXTURE_ENTRIES = ("datasets", "eval_datasets")
ENTRY_TEXT = ("path", "name", "split", "data_dir", "data_files", "revision")


def _placed_paths(
    values: dict, given: set[str], on_command_line: set[str], config_path: str | None, left_to_job: frozenset[str]
) -> bool:
    """Each relative path the run reads placed where it is found, and the command line's data in place of the recipe
    file's. `~` is expanded where the shell did not (transformers takes `~/my-sft` for a malformed Hub name). A path
    found where the command runs is read there; else a recipe's is the project's file, a Slurm job's command line's
    the one in the folder submitted from (accelerate_config: the launch's own, which launch.sh reads). A recipe's path
    found in neither place but beside the recipe file (`config_path`) is refused naming it (`_beside_recipe`). Returns
    whether output_dir is the Slurm job's own folder (`_recipe_variables`)."""
    job_folder = _recipe_variables(values, given - on_command_line, config_path, left_to_job)
    for name in PATH_FIELDS:
        value = values[name]
        if not isinstance(value, str) or not value:
            continue
        value = os.path.expanduser(value) if value.startswith("~") else value
        if name not in on_command_line:
            if name in RECIPE_PATHS:
                value = _project_file(value) or value
                _beside_recipe(name, value, config_path)
        elif name != "accelerate_config":
            value = _submitted_file(value) or value
        values[name] = value
    _mixture_files(values, given - on_command_line, on_command_line, config_path)
    _command_line_data_wins(values, on_command_line)
    return job_folder


def _recipe_variables(
    values: dict, from_recipe: set[str], config_path: str | None, left_to_job: frozenset[str]
) -> bool:
    """A recipe's path or folder with `$HOME` or `${SCRATCH}` read as a shell reads it, as its `env:` block is: taken
    as written, `output_dir: $HOME/runs/a` made a folder named `$HOME` in the folder run in, and `dataset_name:
    $HOME/pairs.jsonl` was said not to exist. A variable that is not set is refused by name. The command line's are
    the shell's to expand (a `$` it passed on was quoted). accelerate_config is not: a Slurm job launches the recipe's
    as written (dpotrain/cluster/job.py), and the dry run must plan that engine. Returns whether output_dir is the
    Slurm job's own folder: in a dry run outside a job (prefetch.py's and the analyzer's on a login node too), one
    naming a SLURM_ variable is unknown before the job and left as written, the rest of it checked all the same; it
    was refused, and prefetch.py, which runs before the job, could not fetch for it; so is one naming a variable of
    the env: block that names one (`left_to_job`: `SCR: /scratch/$SLURM_JOB_ID`, `output_dir: $SCR/run`). A path the
    dry run reads stays refused: it must be read."""
    job_folder = False
    for name in sorted(({*PATH_FIELDS, "output_dir"} - {"accelerate_config"}) & from_recipe):
        value = values[name]
        if not isinstance(value, str) or "$" not in value:
            continue
        if name == "output_dir" and values["dry_run"] and not os.environ.get("SLURM_JOB_ID"):
            # each name the job sets (SLURM_, or left to it) not set here read as a stand-in: another variable not set
            # is refused by name
            named = [n for n in re.findall(r"\$\{?(\w+)", value) if n not in os.environ]
            job = {n: JOB_STAND_IN for n in named if n.startswith("SLURM_") or n in left_to_job}
            recipe_expanded(name, value, config_path, environ=os.environ | job)
            if job_folder := _unreadable(value):  # a stand-in was read: the folder is the job's
                continue
        values[name] = recipe_expanded(name, value, config_path)
        if name == "output_dir":
            _refuse_run_left_as_written(value, values[name], config_path)
    return job_folder


def _unreadable(value: str) -> bool:
    """Whether `value` names a variable not set here (its other faults refused already, with the job's stand-ins)."""
    try:
        venv.shell_expanded(value)
    except venv.Unexpanded:
        return True
    return False


class JobVariable(ConfigError):
    """A recipe's path (`said`: the file, the field and the value) naming the SLURM_ `variable`, refused outside a
    Slurm job. Its fix for a dry run is an `sbatch` one, which plans in the job; `before_job` is the refusal of a
    command that reads the path before any job (prefetch.py, the analyzer), for which that is no fix."""

    def __init__(self, message: str, said: str, variable: str, field: str):
        super().__init__(message)
        self.said, self.variable, self.field = said, variable, field

    def before_job(self, does: str, flags: tuple[str, ...] | None = None) -> str:
        """The refusal as the command that `does` (`prefetch.py fetches`) says it, passing the job's path as its flag
        for the field, where its `flags` (None: every field's) have one."""
        given = (
            f"pass the path the job reads as --{self.field} here, or " if flags is None or self.field in flags else ""
        )
        return (
            f"{self.said} names ${self.variable}, which is set only inside a Slurm job, and {does} before the job: "
            f"{given}write the path out"
        )


def recipe_expanded(name: str, value: str, config_path: str | None, environ=None) -> str:
    """A recipe's `value` of field `name` by `venv.shell_expanded`'s rule (`environ`: os.environ), or refused in one
    line with why and what to do."""
    try:
        return venv.shell_expanded(value, environ)
    except venv.Unexpanded as e:
        said, variable, fix = f"{config_path}: {name} {value!r}", e.args[0], "or write the path out"
        if e.why == "unset" and variable.startswith("SLURM_") and not os.environ.get("SLURM_JOB_ID"):
            raise JobVariable(f"{said} {_unexpanded(e, config_path, fix)}", said, variable, name) from None
        raise ConfigError(f"{said} {_unexpanded(e, config_path, fix)}") from None


def _unexpanded(e: venv.Unexpanded, config_path: str | None, fix: str) -> str:
    """Why a recipe's `$` is not read, with `fix`. A SLURM_ variable is set by Slurm in the job, never by an export."""
    name = e.args[0]
    if e.why == "syntax":
        reads = "it reads ~, $NAME and ${NAME}; $$ is a $"
        return f"holds {name}, which a recipe does not read ({reads}): {fix.removeprefix('or ')}"
    if e.why == "empty":
        return f"names ${name}, which is set empty (the path would start at the root): give {name} a value, {fix}"
    if name.startswith("SLURM_") and os.environ.get("SLURM_JOB_ID"):  # SLURM_ARRAY_TASK_ID in a job of no array
        job = os.environ["SLURM_JOB_ID"]
        return f"names ${name}, which this Slurm job ({job}) does not set: {fix.removeprefix('or ')}"
    if name.startswith("SLURM_"):
        job = f"RECIPE={shlex.quote(str(config_path))} sbatch scripts/dpo_train.sh --dry-run"
        return f"names ${name}, which is set only inside a Slurm job: `{job}` plans it there, {fix}"
    return f"names ${name}, which is not set: export {name}, {fix}"


def _refuse_run_left_as_written(written: str, expanded: str, config_path: str | None) -> None:
    """A recipe's output_dir read as written until its `$` was expanded (`$HOME/runs/a` was `./$HOME/runs/a`): where
    that folder holds a run, the run in the expanded one (empty) would start again from step 0 after an upgrade, the
    old checkpoints left behind without a word. Refused naming both folders. `~` was read before `$` was (the old
    folder of `~/runs/$RUN` is the home's `runs/$RUN`, not one in a folder named `~`)."""
    old = Path(os.path.expanduser(written))
    if os.path.abspath(old) == os.path.abspath(expanded):
        return
    held = next((old / f for f in RUN_MARKS if (old / f).is_file()), None)
    if held is not None:
        raise ConfigError(
            f"{config_path}: output_dir {written!r} is now read as a shell reads it, {expanded}, but the folder named "
            f"as written, {old.resolve()}, holds a run ({held.name}): move that folder to {expanded} to go "
            f"on there, or pass --output_dir {shlex.quote(written)} to keep it where it is"
        )


def _beside_recipe(name: str, value: str, config_path: str | None) -> None:
    """A recipe's relative path not found where it is read (the folder run in, the project) but beside the recipe file
    (a recipe of one's own naming its data beside it): refused naming that file, not said missing with no word of it."""
    if config_path is None or os.path.isabs(value) or Path(value).exists():
        return
    beside = Path(config_path).expanduser().resolve().parent / value
    if beside.exists():
        raise ConfigError(
            f"{name} {value!r} in {config_path} is neither in the folder run in ({Path.cwd()}) nor in the project "
            f"({venv.ROOT}), where a recipe's relative paths are read, but beside the recipe: write it as {beside} in "
            f"the recipe, or run in {beside.parent}"
        )


def _submitted_file(value: str, pattern: bool = False) -> str | None:
    """Where a Slurm job's command line's relative `value` is found in the folder the user submitted from, else None."""
    there = in_submit_dir(value)
    return str(there) if there is not None and _found(there, pattern) else None


def _project_file(value: str, pattern: bool = False) -> str | None:
    """The project's file a relative `value` names where the folder the command runs in has none, else None.
    `pattern`: `value` may be a glob (a mixture's `data_files`), found where it matches a file."""
    path = Path(value).expanduser()
    if not path.is_absolute() and not _found(path, pattern) and _found(venv.ROOT / path, pattern):
        return str(venv.ROOT / path)
    return None


def _found(path: Path, pattern: bool) -> bool:
    return path.exists() or (pattern and glob.has_magic(str(path)) and bool(glob.glob(str(path))))


def recorded_place(name: str, pattern: bool = False, started: Path | None = None) -> str | None:
    """Where a recorded path is found, as a run places its own, first in `started` (the recorded run's folder, where the
    run read it); resolved, else None: a resume compares names by it, so a name as written and its full path are one
    setting. Looked for here first, a file of the recorded name in the folder the resume was typed in (a copy) was
    taken for it, and the run's own file, named from there, refused as another setting."""
    places = (Path(name).expanduser(), in_submit_dir(name), Path(_project_file(name, pattern) or name))
    if started is not None and not os.path.isabs(name):
        places = (started / name, *places)
    return next((str(p.resolve()) for p in places if p is not None and _found(p, pattern)), None)


def same_sources(old, new, mixer: bool, started: Path | None = None) -> bool:
    """Two records of one mixture field (`mixer`: SOURCE AMOUNT pairs, else TRL's `datasets`) naming the same sources,
    each path compared by `recorded_place`. `started`: the folder the `old` record's run was started in."""
    if not (isinstance(old, list) and isinstance(new, list)):
        return False

    def key(words, started=None):
        placed = _moved_sources([str(w) for w in words], mixer, functools.partial(recorded_place, started=started))
        return [json.loads(w) if w.lstrip().startswith("{") else w for w in placed]

    try:
        return key(old, started) == key(new)
    except ValueError:  # a word that is no JSON entry: compared as written
        return False


def _mixture_files(values: dict, from_recipe: set[str], on_command_line: set[str], config_path: str | None) -> None:
    """A mixture source's relative paths placed as the fields' are (`_placed_paths`), a recipe's found only beside the
    recipe file refused naming it (`_beside_recipe`), a recipe's `~` and `$NAME` read as its fields' are."""
    fields = [name for spellings in MIXTURE_SPELLINGS for name in spellings[:2]]  # the sources, not their splits
    for name in [f for f in fields if values[f] and f in from_recipe | on_command_line]:

        def from_project(value: str, pattern: bool = False, name=name) -> str | None:
            value = recipe_expanded(name, value, config_path)  # `$DATA/x.jsonl` as dataset_name reads it
            placed = _project_file(value, pattern)
            if placed is None and not pattern:
                _beside_recipe(name, value, config_path)
            return placed or value

        move = from_project if name in from_recipe else _submitted_file
        words = values[name] if name.startswith("dataset_mixer") else entry_words(values[name], name)
        values[name] = _moved_sources(words, name.startswith("dataset_mixer"), move)


# What opens a source written in YAML, not a path or a Hub name: a flow mapping or list, a block list, `key: value`
YAML_ENTRY = re.compile(r"\s*[{\[]|\s*-\s|[^\s:]+:(\s|$)")


def entry_words(words: list, flag: str) -> list:
    """TRL's mixture words with each source written in YAML, as --help says (`{path: a.jsonl, amount: 0.5}`, its
    block style `path: a.jsonl<newline>amount: 0.5`, or a list of them: `- path: a.jsonl<newline>- path: b.jsonl`),
    as one JSON entry per source, as a recipe's `datasets:` entries are: a block list was taken for a Hub data set's
    name. A path or a Hub name, a file that exists, and a JSON entry stay as written; what does not read is refused."""
    out = []
    for word in words:
        text = str(word)
        if not YAML_ENTRY.match(text) or os.path.exists(os.path.expanduser(text)) or _json_entry(text):
            out.append(word)
            continue
        try:
            value = recipe_file.value(text, flag)
        except ValueError as e:  # what does not read, named
            value = str(e)
        for entry in value if isinstance(value, list) else [value]:
            if not isinstance(entry, dict | str) or (isinstance(entry, str) and entry is value):
                raise ConfigError(
                    f"`{flag}:` entry {text!r} is not a mapping ({entry}): write each source as one, in YAML or JSON: "
                    "{path: a.jsonl, amount: 0.5}"
                )
            out.append(entry if isinstance(entry, str) else json.dumps(_written_entry(entry)))
    return out


def _json_entry(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _written_entry(entry: dict) -> dict:
    """A mixture entry read from YAML, its `amount` as written (`1e3` stays text: mixture.py refuses it, where the
    number 1000.0 would upsample the source 1000 times) and its other numbers as numbers."""
    return {k: _amount_text(v) if k == "amount" else v for k, v in entry.items()}


def _moved_sources(words: list[str], mixer: bool, move) -> list[str]:
    """One mixture field's words with each path datasets reads from the working folder passed through `move` (the new
    path, or None to keep it): a source's, a builder's data_dir, else its data_files; else left as written."""
    if mixer:  # SOURCE AMOUNT pairs
        return [(move(w) or w) if i % 2 == 0 else w for i, w in enumerate(words)]
    out = []
    for word in words:
        try:
            entry = json.loads(word)
        except ValueError:
            out.append(move(word) or word)  # `--datasets a.jsonl b.jsonl`: whole sources
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            out.append(word)
            continue
        new = dict(entry)
        if entry["path"] not in MIXTURE_BUILDERS:
            new["path"] = move(entry["path"]) or entry["path"]
        elif isinstance(entry.get("data_dir"), str):  # its data_files are read from there
            new["data_dir"] = move(entry["data_dir"]) or entry["data_dir"]
        elif isinstance(files := entry.get("data_files"), dict):
            new["data_files"] = {k: _moved_files(v, move) for k, v in files.items()}
        elif files is not None:
            new["data_files"] = _moved_files(files, move)
        out.append(word if new == entry else json.dumps(new))
    return out


def _moved_files(files, move):
    """A builder's `data_files` (a path or glob, or a list of them) through `move`."""
    if isinstance(files, str):
        return move(files, pattern=True) or files
    if isinstance(files, list):
        return [move(f, pattern=True) or f if isinstance(f, str) else f for f in files]
    return files


DS_FILE_FIX = "give its deepspeed_config_file's path from the folder the launch runs in, or an absolute one"


def _launch_deepspeed_file(accelerate_config: str | None) -> None:
    """`accelerate launch` hands its config's deepspeed_config_file on as written, read from each process's folder:
    placed as the dry run places it (`launch_file`), so a launch from outside the project finds it."""
    name = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and name and name != "none":
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = launch_file(name, accelerate_config)


def launch_file(name: str, accelerate_config: str | None) -> str:
    """An accelerate config's relative deepspeed_config_file: in a Slurm job's folder submitted from, else here, else
    the project's. The project's own `accelerate_config` names the project's file, not a submit folder's."""
    path = Path(accelerate_config or "none").expanduser()  # a path from here, a job's from the project
    own = str(path).lower() != "none" and path.is_file() and path.resolve().is_relative_to(venv.ROOT.resolve())
    return (None if own else _submitted_file(name)) or _project_file(name) or name


def launch_file_places() -> str:
    """Where `launch_file` looks, as a refusal names them."""
    submitted = os.environ.get("DPOTRAIN_SUBMIT_DIR")
    job = f", {submitted} (where the job was submitted)" if submitted and submitted != os.getcwd() else ""
    return f"{os.getcwd()}{job} nor in the project"


def take_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The recipe's path (`--config PATH` or `--config=PATH`) and the other words; given twice: refused."""
    at = [i for i, word in enumerate(argv) if word == "--config" or word.startswith("--config=")]
    if not at:
        return None, argv
    i = at[0]
    path = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
    path = os.path.expanduser(path)  # `--config=~/my.yaml`: the shell expands no `~` after `=`
    if not path or path.startswith("--"):
        raise ConfigError("--config needs a path, e.g. --config configs/think.yaml")
    if len(at) > 1:
        raise ConfigError(
            f"--config is given {len(at)} times ({path!r} first): pass one recipe (a Slurm job's is RECIPE=<path> "
            "sbatch scripts/dpo_train.sh, which passes it: not a --config of its own)"
        )
    return path, argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]


# Fields a launcher puts after the user's words so that its value wins (launch.sh, the analyzer, prefetch, demo.sh)
LAUNCHER_FIELDS = frozenset({"accelerate_config", "dry_run", "json", "overwrite_output_dir"})


def _check_finite(*parts) -> None:
    """`inf` and `nan` parse as floats, which the JSON records would write as `Infinity`, refused by strict readers."""

    def numbers(value):  # a mapping's too (lr_scheduler_kwargs: {min_lr_rate: .nan}), and a list's
        if isinstance(value, dict):
            value = list(value.values())
        return [n for v in value for n in numbers(v)] if isinstance(value, list) else [value]

    for part in parts:
        for f in fields(part):
            value = getattr(part, f.name)
            if any(isinstance(v, float) and not math.isfinite(v) for v in numbers(value)):
                raise ConfigError(
                    f"{f.name} {value} is not a finite number: give one (an option that can be turned off says how in "
                    "--help: max_grad_norm 0, a health threshold 0)"
                )


def dry_run_asked(flag: bool | None, recipe: dict) -> bool:
    """Whether a run is a dry run: the command line's `flag` (`dry_run_flag`), else the `recipe` read from its
    --config (`dry_run: true`), as a Slurm job reads it (cluster/job.py's `asks`). The command line's flag alone was
    read: a recipe's dry run was planned as a run (a bf16 recipe refused on a login node's CPU, a job's `$SLURM_JOB_ID`
    folder refused outside the job)."""
    return flag if flag is not None else str(recipe.get("dry_run", False)).lower() in TRUE


def dry_run_flag(argv: list[str], field: str = "dry_run") -> bool | None:
    """The command line's dry-run flag (or another yes/no `field`'s, `preflight`) however it is spelled (--dry-run,
    --dry_run=true, --dry-run true); None where it gives none. The last one decides, as the run's parser takes it."""
    asked = None
    for i, word in enumerate(argv):
        flag, _, value = word.partition("=")
        if flag not in (f"--{field}", f"--{field.replace('_', '-')}"):
            continue
        if not value and i + 1 < len(argv) and argv[i + 1].lower() in TRUE + FALSE:
            value = argv[i + 1]
        asked = value.lower() not in FALSE
    return asked


def in_submit_dir(name: str | None) -> Path | None:
    """A relative path on a Slurm job's command line, in the folder submitted from (DPOTRAIN_SUBMIT_DIR, set by
    scripts/dpo_train.sh), not the project the job runs in; None outside a job, or for an absolute one."""
    submitted = os.environ.get("DPOTRAIN_SUBMIT_DIR")
    if not name or not submitted or Path(name).expanduser().is_absolute():
        return None
    return Path(submitted) / name


def without_secrets(argv: list[str], flags: tuple[str, ...] = TOKEN_FLAGS) -> tuple[str, ...]:
    """The command line without a --hub_token (or other `flags`) and its value: a printed command shows no token."""
    value = {i + 1 for i, word in enumerate(argv) if word in flags}
    return tuple(w for i, w in enumerate(argv) if i not in value and w.split("=")[0] not in flags)


def _command_line_batch_wins(values: dict, on_command_line: set[str]) -> dict | None:
    """Batch flags on the command line win over a recipe's pairs_per_step and token budget, which are dropped. Returns
    what was replaced and the flags that keep its pairs per step (None: nothing). A batch value below 1: refused."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if values[name] < 1:
            raise ConfigError(f"{name} must be >= 1 (got {values[name]})")
    batch_flags = {"per_device_train_batch_size", "gradient_accumulation_steps"} & on_command_line
    recipe_batching = [f for f in ("pairs_per_step", "max_tokens_per_microbatch") if values[f] is not None]
    if not batch_flags or {"pairs_per_step", "max_tokens_per_microbatch"} & on_command_line or not recipe_batching:
        return None
    replaced = {name: values[name] for name in recipe_batching}
    values |= dict.fromkeys(recipe_batching)
    flags = " ".join(f"--{name}" for name in sorted(batch_flags))
    keep = []
    if replaced.get("pairs_per_step") is not None and "gradient_accumulation_steps" not in batch_flags:
        keep += ["--pairs_per_step", str(replaced["pairs_per_step"])]  # accumulation then follows from it
        if replaced.get("max_tokens_per_microbatch") is not None:
            keep += ["--max_tokens_per_microbatch", "none"]  # micro-batches of pairs, not of tokens
    kept = f" ({' '.join(keep)} keeps its {plural(replaced['pairs_per_step'], 'pair')} per step)" if keep else ""
    if launcher.launched_main():  # every rank parses the recipe alike: one line, not one per process
        print(
            f"Note: {' and '.join(sorted(batch_flags))} on the command line: micro-batches of "
            f"{plural(values['per_device_train_batch_size'], 'pair')}, {values['gradient_accumulation_steps']} per "
            f"step and process; the recipe's {' and '.join(recipe_batching)} are not used{kept}.",
            file=sys.stderr,
        )
    return {**replaced, "by": flags, "keep": " ".join(keep)}


def _take_env_block(block: dict) -> None:
    """TRL's `env:` block of a recipe, what it sets as read_recipe checked and expanded it."""
    os.environ.update(block)
    if "huggingface_hub" in sys.modules or "datasets" in sys.modules:  # imported before the block: its HF_HUB_OFFLINE
        from dpotrain.recipe import hub_switches

        hub_switches.take_late_switches()


def _one_process_backend(words: list[str]) -> list[str]:
    """`words` without ddp_backend where no launcher made a process group: accelerate then asks for the one named
    ("Default process group has not been initialized")."""
    if launcher.under_launcher() or launcher.several_processes():
        return words
    return list(without_secrets(words, ("--ddp_backend", "--ddp-backend")))


def _cpu_deepspeed_backend(args: list[str]) -> list[str]:
    """Several processes on CPU need an explicit gloo backend: else accelerate reports one process ("No backend == no
    distributed training") while DeepSpeed or FSDP run all of them."""
    import torch

    several = launcher.under_launcher() and launcher.several_processes()
    launched = several or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    if launched and not torch.cuda.is_available() and not any("ddp_backend" in a for a in args):
        return ["--ddp_backend", "gloo"]
    return []


def list_single_target(model) -> None:
    """TRL turns a single --lora_target_modules value into a string (ModelConfig.__post_init__, run again by every
    `dataclasses.replace`), which PEFT takes as a regular expression over the full module path: a list of one."""
    targets = model.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"[\w.]+", targets):
        model.lora_target_modules = [targets]


def replaced(recipe: Recipe, **parts: dict) -> Recipe:
    """A new recipe: `recipe` with the fields given per part (`training=`, `model=`, `project=`: name -> value)
    replaced, each part built anew so TRL's checks run (the GPU precision ones skipped); `recipe` is never written."""
    new = {}
    with upstream.gpu_precision_checks_skipped(), keep_end_unwarned():
        for part, values in parts.items():
            if unknown := set(values) - {f.name for f in fields(getattr(recipe, part))}:
                raise AttributeError(f"{part} has no field {sorted(unknown)[0]!r}")
            new[part] = replace(getattr(recipe, part), **values)
    if "model" in new:  # replace ran TRL's __post_init__ again: a single target module is a string once more
        list_single_target(new["model"])
    auto = recipe.max_length_auto and new.get("training", recipe.training).max_length is None
    return replace(recipe, **new, max_length_auto=auto)


def uses_live_reference(recipe: Recipe) -> bool:
    """A reference model run at every step instead of the reference stage (`sync_ref_model` updates it)."""
    t = recipe.training
    return bool(t.sync_ref_model or ("precompute_ref_log_probs" in recipe.given and not t.precompute_ref_log_probs))

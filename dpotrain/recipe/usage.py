"""`train_dpo.py --help`: what users type first, short. `--help-all` prints every TRL and transformers field (over a
thousand lines), which argparse's own help would otherwise put between a user and `--config`."""

import argparse
import dataclasses
import re
import textwrap

from dpotrain.recipe import upstream

# The fields the README's commands and recipes set most, in the order a run meets them.
COMMON = """
    model_name_or_path dataset_name output_dir max_length learning_rate beta loss_type max_steps num_train_epochs
    report_to push_to_hub hub_model_id use_peft lora_target_modules resume_from_checkpoint seed
""".split()
RECIPES = "configs/think.yaml, instruct.yaml, think-32b.yaml, smoke.yaml (the CPU demo)"


# Fields whose TRL / transformers help says what this project does not do, or leaves out what it does: its words
# instead, set on the parser's actions (config.make_parser), so that --help, --help-all and an error say the same.
OWN_WORDS = {
    "model_name_or_path": "The SFT model to train: a Hub name, a local folder, or builtin:tiny-olmo3 (the CPU demo)",
    # TRL's: "If `datasets` is provided, this will be ignored", where both in one recipe are refused (docs/data.md)
    "dataset_name": "The pairs to train on: a Hub data set, a local .jsonl or .parquet file, or a save_to_disk folder "
    "(several sources: datasets, docs/data.md)",
    # TRL's four: "If `datasets` is provided, this will be ignored", where this project reads or refuses each with a
    # mixture (mixture.parse, options.check_streaming)
    "dataset_config": "dataset_name's configuration (datasets' `name`); a mixture's sources name their own (`name:`), "
    "and dataset_config with one is refused",
    "dataset_train_split": "The split to train on: dataset_name's, and that of each mixture source that names none",
    "dataset_test_split": "The split to evaluate on (with eval_strategy): dataset_name's, and that of each held-out "
    "mixture source that names none",
    "dataset_streaming": "Accepted as false only: the step plan needs every pair's length up front (datasets "
    "memory-maps a loaded data set, so it need not fit in RAM)",
    # transformers': "The initial learning rate for AdamW", where warmup makes it the peak
    "learning_rate": "The peak learning rate, after warmup_steps (the recipes: linear decay to zero)",
    "output_dir": "The run's folder: checkpoints, the final model and the run's records (default: outputs/<run_name>)",
    # TRL's "Maximum length of the tokenized sequence" said nothing of `auto`
    "max_length": "Tokens per sequence (prompt + completion), longer ones cut as truncation_mode says, or auto: the "
    "length the analyzer chooses for the data (docs/max_length.md)",
    "max_steps": "Optimizer steps to train, overriding num_train_epochs (-1: num_train_epochs decides)",
    "push_to_hub": "Push the final model to the Hub once training ends (hub_model_id: the repo; docs/hub.md)",
    # transformers': "The name of the repository to keep in sync with the local `output_dir`", which it no longer is
    "hub_model_id": "The Hub repo push_to_hub pushes to (default: the run name, in your namespace)",
    # TRL's: "Temporarily unavailable: since the DPO refactor, setting it to True warns and falls back to standard
    # padding", where this project packs by default (config.OWN_DEFAULTS) with its own forward (docs/speed.md)
    "padding_free": "Packed sequences: each micro-batch's chosen and rejected sequences laid end to end in rows, no "
    "padding between them (docs/speed.md); false: TRL's padded batches. A model that cannot pack falls back to padded "
    "ones with a note (an error where true is given)",
    # TRL's "Whether to precompute ... (default: False)", where a run scores the reference once unless told otherwise
    # (stages.py: the field set true where no live reference is asked for, config.uses_live_reference)
    "precompute_ref_log_probs": "Unset (the default): the reference stage, every pair's reference log-probs scored "
    "once before training and cached, no reference model in memory (docs/reference.md); false given (or "
    "sync_ref_model): a reference model run beside every step",
    # transformers' "Whether to log the first `global_step` or not", where the health guards log it (stages.py)
    "logging_first_step": "Log step 1 on its own. Unset (the default), the health guards (health_checks, the "
    "default) log it anyway, and refuse false (docs/health.md)",
    # transformers': "This value is ignored if the repo already exists", where the run refuses an existing public
    # repo (hub.check_private)
    "hub_private_repo": "true: the repo push_to_hub creates is private, and an existing public repo is refused at "
    "start (make it private first); unset: a new repo takes the namespace's default visibility (docs/hub.md)",
    "help": "The short list: the recipe, the fields users set most and this project's options",
    # TRL's "Type of loss to use" named neither the choices, nor that several combine, nor which the recipes train
    "loss_type": "Loss types, several summed by loss_weights (recipes: sigmoid_norm; README: The loss)",
    # transformers' "The list of integrations to report the results and logs to": not what the recipes log to, nor
    # that none turns it off (README: W&B)
    "report_to": "Where to log: wandb (the recipes'; its key in .env), none, or an installed integration",
    # TRL's "Whether to use PEFT for training" and "LoRA target modules": not that LoRA is what it trains, nor that the
    # run refuses use_peft without targets
    "use_peft": "Train a LoRA adapter, not the full weights, with lora_target_modules (docs/lora.md)",
    "lora_target_modules": "The modules LoRA adapts, which use_peft requires: q_proj v_proj, or all-linear",
    # transformers' "Enable ... checkpointing to trade compute for memory ... (default: True)", where the memory plan
    # decides how many layers (plan/memory.choose_checkpointing), and its old name is renamed to the new
    # (config.ALIASES; argparse's --no_gradient_checkpointing shares these words)
    "activation_checkpointing": "Unset (the default) or true: the memory plan checkpoints the fewest decoder layers "
    "that fit (docs/memory.md); false: none; activation_checkpointing_kwargs every_n_layers N: every N-th",
    "gradient_checkpointing": "transformers' old name of activation_checkpointing (--no_gradient_checkpointing: "
    "false), read as it where that is not given; unset (the default): as activation_checkpointing unset",
    # TRL's "The only supported value is 'keep_start'", where keep_end trains (TRL's deprecation said as a warning)
    "truncation_mode": "How a sequence over max_length is cut: keep_start keeps its start (a pair whose prompt alone "
    "fills it is dropped); keep_end keeps its end and drops none, with TRL's deprecation warning (docs/max_length.md)",
    # transformers' "Path to a folder with a valid checkpoint for your model" left out that a rerun resumes by itself
    "resume_from_checkpoint": "A checkpoint-N folder to resume from: without it, a rerun resumes from the newest",
}
# Fields whose default the run decides, not the parser's value (TRL's or transformers'): their words above and in
# refused.help_words say the run's, and --help-all leaves argparse's `(default: ...)` out of their rows
RUN_DECIDES = (
    "output_dir",
    "hub_model_id",
    "hub_strategy",
    "precompute_ref_log_probs",
    "logging_first_step",
    "activation_checkpointing",
    "gradient_checkpointing",
)
WIDTH, FLAG = 120, 34  # the help's width, and the column its descriptions start at


def _first_sentence(text: str | None) -> str:
    """Up to the first '. ' or '; ' outside parentheses (a sentence whose parenthesis is left open reads as cut), not
    an 'e.g. ' (prefetch.py's --config: "the recipe the job runs, e.g")."""
    text = re.sub(r"\s+", " ", (text or "").replace("%%", "%")).strip()
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        end = char in ".;" and text[i + 1 : i + 2] == " " and text[i - 3 : i] not in ("e.g", "i.e")
        if depth == 0 and end and re.match(r"[a-z)`']", text[i - 1 : i]):
            return text[:i]
    return text.rstrip(".;")


def _row(flag: str, text: str) -> str:
    """A flag and its whole description, wrapped under the description column (a long flag: on the next line)."""
    lines = textwrap.wrap(text, WIDTH - FLAG) or [""]
    first = f"  {flag}".ljust(FLAG) + lines[0] if len(flag) + 2 < FLAG - 1 else f"  {flag}"
    rest = lines[1:] if first.endswith(lines[0]) and lines[0] else lines
    return "\n".join([first, *(" " * FLAG + line for line in rest)])


def _recipe_rows() -> list[str]:
    """The usage and the recipe and dry-run flags: what --help and --help-all start with."""
    return [
        "usage: python train_dpo.py --config RECIPE [--dry-run [--json]] [--FIELD VALUE ...]",
        "       accelerate launch --config_file accelerate_config.yaml train_dpo.py --config RECIPE ...",
        "       sbatch scripts/dpo_train.sh [--FIELD VALUE ...]",
        "",
        "The recipe, then overrides (TRL's defaults < the recipe's YAML < the command line):",
        _row("--config RECIPE", f"a recipe: {RECIPES}"),
        _row("--dry-run", "what the run will do (data, steps, batching, forward, memory plan), loading no weights"),
        _row("--json", "with --dry-run: the whole resolved configuration as JSON on stdout, for scripts"),
    ]


def short_help(parser, project_fields) -> str:
    """The usage, the recipe and dry-run flags, the fields users set most, this project's own, and where the rest is."""
    actions = {a.dest: a for a in upstream.long_flags(parser).values()}
    own = [f.name for f in dataclasses.fields(project_fields) if f.name not in ("dry_run", "json")]
    lines = [
        *_recipe_rows(),
        "",
        "Fields users set most (TRL / transformers, by their own names):",
        *(_row(f"--{name}", _first_sentence(actions[name].help)) for name in COMMON if name in actions),
        "",
        "This project's options (README, docs/running.md):",
        *(_row(f"--{name}", _first_sentence(actions[name].help)) for name in own if name in actions),
        "",
        "Every TRL and transformers field (over a thousand lines): python train_dpo.py --help-all",
    ]
    return "\n".join(lines)


def every_field(parser) -> str:
    """`--help-all`: --help's usage and recipe flags, then argparse's list of every field (its usage is suppressed:
    180 lines naming each flag again, config.make_parser). argparse's `(default: ...)` is left out where it is not the
    run's: the RUN_DECIDES fields', and each `--no_<field>` switch's (a value the parse never reads: the field's own
    flag sets the default)."""
    hidden = [
        a
        for a in upstream.parser_actions(parser)
        if a.dest in RUN_DECIDES or (a.nargs == 0 and a.const is False and a.option_strings[0].startswith("--no"))
    ]
    shown = [a.default for a in hidden]
    try:
        for action in hidden:
            action.default = argparse.SUPPRESS  # argparse's documented "no default": no `(default: ...)` printed
        return "\n".join([*_recipe_rows(), "", parser.format_help().strip()])
    finally:
        for action, default in zip(hidden, shown, strict=True):
            action.default = default


def takes(action) -> str:
    """What a flag takes, from its argparse action: 'a number', 'one of keep_end, keep_start', 'true or false'."""
    if getattr(action.type, "__name__", "") == "string_to_bool":  # transformers' bool fields
        return "true or false" + " (alone: true)" * (action.const is True)  # `--use_peft` alone; not `--bf16` (None)
    several = action.nargs in ("+", "*")
    kind = {"int": "whole number", "float": "number"}.get(getattr(action.type, "__name__", ""), "value")
    kind = f"one or more {kind}s" if several else f"a {kind}"
    if action.choices:
        kind = f"one {'or more ' * several}of " + ", ".join(map(str, action.choices))
    return kind + " or auto" * (action.dest == "max_length")  # config._renamed takes `auto` before argparse


def _example(flag: str, action) -> str:
    """'e.g. --beta 0.1' (the parser's default: TRL's or transformers' own, which a recipe may change, so it is given
    as an example, not as the run's default), else the flag's help (a default of None shows nothing to type)."""
    default = action.default
    if isinstance(default, list) and default:
        default = " ".join(map(str, default))
    if isinstance(default, float):
        default = f"{default:g}"
    if isinstance(default, (int, str)) and not isinstance(default, bool) and str(default):
        return f"e.g. {flag} {default}"
    return _first_sentence(action.help)


def value_refused(message: str, flags: dict, words=(), recipe: tuple[str, str] | None = None) -> str | None:
    """argparse's "argument --beta: expected one argument" or "argument --max_length/--max-length: invalid int value:
    'abc'" as one line naming the flag, what it takes and what it got; None for another message. `flags`: each
    `--flag` -> its action; `words`: the command line, whose spelling of the flag is named (argparse names its first:
    `--repo-id` for a typed `--repo_id`, `--private` for `--hub_private_repo`). `recipe`: (the recipe file, its key)
    where the value refused is that file's line, named as the key in the file (a recipe's `health_checks: 2` was
    refused as "--health_checks takes ...", a flag the user never typed, or typed right over the file's value)."""
    parts = refused_value(message, flags)
    if parts is None:
        return None
    action, flag, value = parts
    flag = next((w for w in (w.partition("=")[0] for w in words) if w in action.option_strings), flag)
    kind = takes(action)
    hint = "" if action.choices or kind.startswith("true") else f" ({_example(flag, action)})"
    if recipe is not None:
        path, key = recipe
        flag = f"{key} in {path}"
        hint = hint.replace(f"e.g. --{action.dest} ", f"e.g. {key}: ")
    return f"{flag} takes {kind}{hint}: none given" if value is None else f"{flag} takes {kind}{hint}, not {value}"


def refused_value(message: str, flags: dict) -> tuple | None:
    """(the action, the flag argparse names, the value refused as quoted, or None where none was given) of argparse's
    message of a value missing or of the wrong type; None for another message."""
    found = re.fullmatch(r"argument (--[\w-]+)\S*: (.*)", message, re.S)
    action = flags.get(found[1]) if found else None
    if action is None:
        return None
    said = found[2]
    if re.fullmatch(r"expected (one|at least one|\d+) arguments?", said):
        return action, found[1], None
    got = re.match(r"invalid (?:\w+ value|choice): ('.*?'|\".*?\")(?: \(choose from .*\))?$", said, re.S)
    got = got or re.match(r"Truthy value expected: got (.*) but expected", said, re.S)  # transformers' string_to_bool
    if got is None:
        return None
    return action, found[1], got[1] if got[1][:1] in "'\"" else repr(got[1])

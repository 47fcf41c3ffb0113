"""`train_dpo.py --help`: what users type first, short. `--help-all` prints every TRL and transformers field (over a
thousand lines), which argparse's own help would otherwise put between a user and `--config`."""

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


# Fields whose transformers help says what this project does not do: what it does instead.
OWN_WORDS = {
    "push_to_hub": "Push the final model to the Hub once training ends (hub_model_id: the repo; docs/hub.md)",
    # transformers': "The name of the repository to keep in sync with the local `output_dir`", which it no longer is
    "hub_model_id": "The Hub repo push_to_hub pushes to (default: the run name, in your namespace)",
}
WIDTH, FLAG = 120, 34  # the help's width, and the column its descriptions start at


def _first_sentence(text: str | None) -> str:
    """Up to the first '. ' or '; ' outside parentheses (a sentence whose parenthesis is left open reads as cut)."""
    text = re.sub(r"\s+", " ", (text or "").replace("%%", "%")).strip()
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ".;" and text[i + 1 : i + 2] == " " and re.match(r"[a-z)`']", text[i - 1 : i]):
            return text[:i]
    return text.rstrip(".;")


def _row(flag: str, text: str) -> str:
    """A flag and its whole description, wrapped under the description column (a long flag: on the next line)."""
    lines = textwrap.wrap(text, WIDTH - FLAG) or [""]
    first = f"  {flag}".ljust(FLAG) + lines[0] if len(flag) + 2 < FLAG - 1 else f"  {flag}"
    rest = lines[1:] if first.endswith(lines[0]) and lines[0] else lines
    return "\n".join([first, *(" " * FLAG + line for line in rest)])


def short_help(parser, project_fields) -> str:
    """The usage, the recipe and dry-run flags, the fields users set most, this project's own, and where the rest is."""
    actions = {a.dest: a for a in upstream.long_flags(parser).values()}

    def described(name: str) -> str:
        return OWN_WORDS.get(name) or _first_sentence(actions[name].help)

    own = [f.name for f in dataclasses.fields(project_fields) if f.name not in ("dry_run", "json")]
    lines = [
        "usage: python train_dpo.py --config RECIPE [--dry-run [--json]] [--FIELD VALUE ...]",
        "       accelerate launch --config_file accelerate_config.yaml train_dpo.py --config RECIPE ...",
        "       sbatch scripts/dpo_train.sh [--FIELD VALUE ...]",
        "",
        "The recipe, then overrides (TRL's defaults < the recipe's YAML < the command line):",
        _row("--config RECIPE", f"a recipe: {RECIPES}"),
        _row("--dry-run", "what the run will do (data, steps, batching, forward, memory plan), loading no weights"),
        _row("--json", "with --dry-run: the whole resolved configuration as JSON on stdout, for scripts"),
        "",
        "Fields users set most (TRL / transformers, by their own names):",
        *(_row(f"--{name}", described(name)) for name in COMMON if name in actions),
        "",
        "This project's options (README, docs/running.md):",
        *(_row(f"--{name}", described(name)) for name in own if name in actions),
        "",
        "Every TRL and transformers field (over a thousand lines): python train_dpo.py --help-all",
    ]
    return "\n".join(lines)

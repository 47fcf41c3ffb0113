"""`train_dpo.py --help`: what users type first, short. `--help-all` prints every TRL and transformers field (over a
thousand lines), which argparse's own help would otherwise put between a user and `--config`."""

import dataclasses
import re

# The fields the README's commands and recipes set most, in the order a run meets them.
COMMON = ("model_name_or_path", "dataset_name", "output_dir", "max_length", "learning_rate", "beta", "loss_type",
          "max_steps", "num_train_epochs", "report_to", "push_to_hub", "hub_model_id", "use_peft",
          "lora_target_modules", "resume_from_checkpoint", "seed")  # fmt: skip
RECIPES = "configs/think.yaml, instruct.yaml, think-32b.yaml, smoke.yaml (the CPU demo)"


def _first_sentence(text: str | None, width: int = 96) -> str:
    text = re.sub(r"\s+", " ", (text or "").replace("%%", "%")).strip()
    sentence = re.split(r"(?<=[a-z)`'])[.;]\s", text, maxsplit=1)[0].rstrip(".;")
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def short_help(parser, project_fields) -> str:
    """The usage, the recipe and dry-run flags, the fields users set most, this project's own options (from their
    dataclass: `project_fields`), and where the rest is."""
    actions = {a.dest: a for a in parser._actions}

    def row(flag: str, text: str) -> str:
        return f"  {flag:<32}{text}"

    own = [f.name for f in dataclasses.fields(project_fields) if f.name not in ("dry_run", "json")]
    lines = [
        "usage: python train_dpo.py --config RECIPE [--dry-run [--json]] [--FIELD VALUE ...]",
        "       accelerate launch --config_file accelerate_config.yaml train_dpo.py --config RECIPE ...",
        "       sbatch scripts/dpo_train.sh [--FIELD VALUE ...]",
        "",
        "The recipe, then overrides (TRL's defaults < the recipe's YAML < the command line):",
        row("--config RECIPE", f"a recipe: {RECIPES}"),
        row("--dry-run", "what the run will do (data, steps, batching, forward, memory plan), loading no weights"),
        row("--json", "with --dry-run: the whole resolved configuration as JSON on stdout, for scripts"),
        "",
        "Fields users set most (TRL / transformers, by their own names):",
        *(row(f"--{name}", _first_sentence(actions[name].help)) for name in COMMON if name in actions),
        "",
        "This project's options (README, docs/running.md):",
        *(row(f"--{name}", _first_sentence(actions[name].help)) for name in own if name in actions),
        "",
        "Every TRL and transformers field (over a thousand lines): python train_dpo.py --help-all",
    ]
    return "\n".join(lines)

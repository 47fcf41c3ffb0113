"""This project's one push path: the run's repo, the token kept off disk, the model card, the final upload, and the
write-access check at start. Checkpoint branches: hub_push.py."""

import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    ModelCard,
    ModelCardData,
    get_token,
)
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from dpotrain.cluster.offline import (
    TOKENIZER_VOCAB,
    InvalidToken,
    hf_token,
    invalid_token,
    is_hub_model,
    is_offline,
    shards_of,
    usable_token,
    within,
)
from dpotrain.data import builtin, mixture, model_identity
from dpotrain.data.data import COMPRESSIONS, LOCAL_SUFFIXES
from dpotrain.data.hub_revision import KEY
from dpotrain.hub.hub_push import (
    PushStopped,
    is_transient,
    local_files,
    pushed_revisions,
    record_push,
    record_pushed,
    retry_waits,
    status_of,
    until_stopped,
    with_retries,
)
from dpotrain.hub.public import upload_content
from dpotrain.recipe import hub_switches, refused, venv
from dpotrain.recipe import records as run_records
from dpotrain.recipe.config import TOKEN_FLAGS
from dpotrain.recipe.errors import ConfigError, RunError, cause, decimal, plural
from dpotrain.recipe.run_record import RESOLVED, Record, epochs_text, per_step_text, rounded_up
from dpotrain.recipe.run_record import of as of_record
from dpotrain.recipe.run_record import read as read_record
from dpotrain.recipe.writes import write_text
from dpotrain.train import checkpoint_manifest, run_files
from dpotrain.train.lora import MERGED_DELETED, MERGED_DIR, MERGED_LINE, card_lines
from dpotrain.train.losses import loss_text, loss_types
from dpotrain.train.metrics import PLOT_FILE, last_logged, read_metrics
from dpotrain.train.weight_names import CUT_SHORT, WEIGHT_FILES, not_whole

CARD = "README.md"  # the model card, written by a finished run (write_model_card)
RUN_COMPLETE = "run_complete.json"  # written last by a finished run (publish.py); a folder with it is a finished run
MODEL_FILES = "model_files"  # run_complete.json's record of the final model's files, each {"bytes", "sha256"}

# Recipe values a reader of the card needs to reproduce or judge the run; the optimizer's settings too: a recipe rarely
# names them, and transformers' defaults change between its versions.
CARD_FIELDS = (
    "loss_type beta learning_rate lr_scheduler_type warmup_steps num_train_epochs max_length padding_free "
    "max_tokens_per_microbatch per_device_train_batch_size gradient_accumulation_steps optim adam_beta1 adam_beta2 "
    "adam_epsilon weight_decay max_grad_norm bf16 seed"
).split()
# rewards/* are TRL's (beta x summed log-ratio); rewards_norm/* are on the loss's scale (beta x log-ratio per token).
# The speed follows them: the run's (`speed_row`), not the last step's.
FINAL_METRICS = [
    "loss",
    *(f"{scale}/{k}" for scale in ("rewards", "rewards_norm") for k in ("accuracies", "margins", "chosen", "rejected")),
]
# Never uploaded to main: resumable state (checkpoints go to branches), local records, training_args.bin (a pickle,
# unsafe to load), run_files.json; nor a .env (a person's secrets, in the folder of a run from before run_files.json);
# nor samples.jsonl, whose prompts are the training data's first ones verbatim unless the recipe names its own (the
# recipes' default): a private data set's rows went up to a repo that is often public, said nowhere.
IGNORE = (
    "checkpoint-* checkpoint-*/** wandb/** *.lock .wandb_run_id training_args.bin .hub_staging/** hub_pushes.jsonl "
    "run_files.json .env .env.* */.env */.env.* samples.jsonl"
).split()
# Deleted on main by a final push in REPLACED_IN unless uploaded again: an earlier model's weights or adapter config
# would load in place of the new ones (model.safetensors before a sharded index). main's history keeps them.
REPLACED = "*.safetensors *.safetensors.index.json *.bin *.bin.index.json adapter_config.json".split()
# The top folder and merged/: weights elsewhere (awq/, an ONNX export) are the repo owner's, never a run's.
REPLACED_IN = (PurePosixPath("."), PurePosixPath(MERGED_DIR))
# Deleted there too: the rest of an earlier model that from_pretrained reads (model_identity.MODEL_FILES, but code: a
# handler.py may be the owner's, and a model's code loads only where its config.json names it), and its named chat
# templates. A transformers 4 save's special_tokens_map.json, left beside the run's tokenizer, gave the tokenizer loaded
# from the repo the earlier model's eos and pad tokens.
LOADED = [*REPLACED, *(p for p in model_identity.MODEL_FILES if p != "*.py"), f"{model_identity.TEMPLATES_DIR}/*"]
# The optimizers that read the Adam settings, by a part of transformers' optim name ("adam" is bitsandbytes' AdamW too;
# Lion reads the betas alone): a card showing them for another would name values the run never read.
ADAM_FIELDS = {
    "adam": ("adam_beta1", "adam_beta2", "adam_epsilon"),
    "ademamix": ("adam_beta1", "adam_beta2", "adam_epsilon"),
    "lion": ("adam_beta1", "adam_beta2"),
}
# transformers' values that mean no more than "push the model": accepted. Its default every_save only as the default:
# typed, it asks for a push at every save, which push_checkpoints makes here
HUB_STRATEGIES = ("every_save", "end")


# --- the push settings: this project's, taken out of the Trainer's hands --------------------------------------------


@dataclass
class PushSettings:
    requested: bool  # push_to_hub as the user gave it
    repo_id: str
    private: bool | None
    checkpoints: bool  # push_checkpoints
    token: str | None = field(default=None, repr=False)  # in memory only
    base: str | None = None  # model_name_or_path: the repo pushed to must not be it (`check_not_the_base`)

    def check_token(self) -> None:
        if self.requested and not self.token:
            raise ConfigError(
                "push_to_hub is set but no Hugging Face token was found: add HF_TOKEN=... to .env, "
                f"run `hf auth login`, or drop --push_to_hub{venv.hidden('HF_TOKEN')}"
            )

    def record(self, resolved: dict) -> dict:
        """What the project does, in the resolved config (the Trainer itself runs with push_to_hub off)."""
        resolved["push_to_hub"] = self.requested
        if self.requested:
            resolved["hub_model_id"] = self.repo_id  # the repo pushed to; push_to_hub.py reads it
            resolved["hub_strategy"] = "end"  # the final model once training ends; checkpoints: push_checkpoints
        if self.checkpoints:  # each checkpoint queued and pushed in turn, never skipped for a push still going
            resolved["hub_always_push"] = True
        return resolved


def take_push_settings(recipe, run_engine=None) -> PushSettings:
    """The push this run will make under `run_engine`, checked. transformers' Trainer with push_to_hub creates the repo
    at init (failing offline), pushes at every save and pickles hub_token into training_args.bin: so it runs with
    push_to_hub off, this project pushes, and --hub_token is blanked from sys.argv, which W&B records."""
    t, p, base = recipe.training, recipe.project, recipe.model.model_name_or_path
    strategy = getattr(t.hub_strategy, "value", t.hub_strategy)
    typed_every_save = strategy == "every_save" and "hub_strategy" in recipe.given
    if t.push_to_hub and (strategy not in HUB_STRATEGIES or typed_every_save):
        raise ConfigError(f"hub_strategy {strategy!r} {refused.HUB_STRATEGY}")
    if t.push_to_hub and t.hub_revision:
        raise ConfigError(f"hub_revision {t.hub_revision!r} {refused.HUB_REVISION}")
    if p.push_checkpoints and not t.push_to_hub:  # `--push_to_hub false` on a recipe that pushes: the flag named
        raise ConfigError(
            "push_checkpoints needs push_to_hub: true (and hub_model_id: org/name), or drop it "
            "(--push_checkpoints false)"
        )
    if p.push_checkpoints and run_engine is not None and run_engine.name == "fsdp2":
        raise ConfigError(
            "push_checkpoints under FSDP2: its checkpoints are sharded (each rank's part, "
            "torch.distributed.checkpoint), with no model a branch could hold: drop push_checkpoints (the final model "
            "is still pushed as one safetensors folder), or train under ZeRO-2 or ZeRO-3"
        )
    if p.push_checkpoints and not t.hub_always_push and "hub_always_push" in recipe.given:
        # transformers' false skips a checkpoint's push while the one before is uploading: recorded, never done
        raise ConfigError(
            "hub_always_push false would skip a checkpoint's push while the one before is still uploading, and "
            "push_checkpoints pushes every checkpoint in turn: drop hub_always_push (fewer pushes: a larger save_steps)"
        )
    if p.push_checkpoints and getattr(t.save_strategy, "value", t.save_strategy) == "no":
        raise ConfigError(
            "push_checkpoints is set but save_strategy is 'no', so no checkpoint is saved: set "
            "save_strategy: steps and save_steps, or drop push_checkpoints"
        )
    # `--hub_model_id ''` is a name given (refused below), not unset: it must not push to the run name's repo
    repo_id = t.run_name if t.hub_model_id is None else t.hub_model_id
    if t.push_to_hub:  # now, not at the write-access check (taken for no network) or, offline, after training
        # the run name said as the repo's: "pushes to the run name 'my run' is not a ..." read as one garbled clause
        run_named = "push_to_hub without hub_model_id pushes to a repo named after the run:"
        given = "hub_model_id" if t.hub_model_id is not None else run_named
        if t.hub_model_id is None and "/" in repo_id:  # a name, not a place: `a/b` pushed to the namespace a
            raise ConfigError(
                f"{run_named} {repo_id!r}, which would push into the namespace {repo_id.split('/')[0]!r}: say where "
                f"to push (--hub_model_id {repo_id}), or name the run without '/'"
            )
        check_repo_id(repo_id, given, "pass --hub_model_id org/name")
        check_not_the_base(repo_id, base)  # a bare name: once the Hub names its namespace
        retry_waits()  # read at the first upload, after training
    scrub_argv(sys.argv)
    token = usable_token(t.hub_token, "--hub_token") or hf_token()
    return PushSettings(bool(t.push_to_hub), repo_id, t.hub_private_repo, p.push_checkpoints, token, base)


def check_not_the_base(repo_id: str, base: str | None) -> None:
    """Refuse a push to the Hub repo the run trains from (`base`, its model_name_or_path): the final push replaces the
    model on main (`main_operations`), so the base was gone from main, and a later run from it started from this one's
    DPO model, silently. The Hub matches repo names without case. A bare `repo_id` (no namespace) is checked once
    `check_write_access` has named its namespace."""
    if "/" in repo_id and is_hub_model(base) and repo_id.casefold() == base.casefold():
        raise ConfigError(
            f"hub_model_id {repo_id!r} is the model this run trains from (model_name_or_path): its push would replace "
            "that model on main, and runs started from it later would start from this run's model: pass another "
            "--hub_model_id (or --repo-id to push_to_hub.py)"
        )


def check_repo_id(repo_id: str, given: str, fix: str) -> None:
    """Refuse a repo name the Hub refuses: at the write-access check it would read as a Hub out of reach."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConfigError(
            f"{given} {repo_id!r} is not a Hugging Face repo name (`name` or `namespace/name`, each of letters, "
            "digits, '-', '_' and '.', at most 96 characters, not starting or ending with '-' or '.', without '--' or "
            f"'..', not ending in '.git'): {fix}"
        ) from None


def scrub_argv(argv: list[str]) -> None:
    """Blank the value of --hub_token in place: W&B and crash reports record the process's command line."""
    for i, arg in enumerate(argv):
        name, eq, _ = arg.partition("=")
        if name in TOKEN_FLAGS:
            if eq:
                argv[i] = f"{name}=<HUB_TOKEN>"
            elif i + 1 < len(argv):
                argv[i + 1] = "<HUB_TOKEN>"


def model_card(
    r: Record, records: list[dict], revisions: list[tuple[int, str]] = (), repo_id: str = "", best: dict | None = None
) -> str:
    s, sources = r.settings, r.data.data_sources or []
    base, dataset = s.model_name_or_path, s.dataset_name
    names = [dataset] if dataset else [source["source"].split(" [")[0].split(":")[0] for source in sources]
    # a path is no Hub data set, here or not (the card of a run whose data lay in /home/...: the Hub refuses it)
    hub_names = [n for n in names if "/" in n and is_hub_model(n)]
    data_named = mixture.of_sources(sources) if sources else part_named(s) + named(dataset, r.data.data_identity)
    trained_from = f"{named(base, r.model_identity)} on {data_named}"
    data = ModelCardData(
        base_model=base if is_hub_model(base) else None,  # a local folder is no Hub repo: the Hub refuses the card
        datasets=hub_names or None,
        library_name="peft" if s.use_peft else "transformers",
        tags=["dpo", "trl", "olmo3-recipe", *(["lora", "peft"] if s.use_peft else [])],
    )
    recipe_rows = "\n".join(f"| `{k}` | {as_run(k, r)} |" for k in card_fields(s.optim))
    recipe_rows += f"\n| pairs per optimizer step | {per_step_text(r.batching, 'all processes')} |"
    recipe_rows += f"\n| chat template | {template_named(r)} |"
    if counted := r.batching.max_length_cuts:  # what the trainer saw of the data: pairs cut or dropped (cuts.py)
        recipe_rows += (
            f"\n| pairs cut / dropped at max_length | {counted['truncated']} / {counted['dropped']} of "
            f"{counted['pairs']} |"
        )
    types = loss_types(s)
    # OLMo 3's loss only where it is the one trained (not an ipo or MPO run)
    what = "OLMo 3's length-normalized DPO recipe" if types == ["sigmoid_norm"] else "TRL's DPO loss"
    if None not in types and s.beta is not None:  # a record that names its loss (all this project writes)
        what += f" ({loss_text(s)})"
    last = last_logged(records) or {}  # training, not an evaluation
    metric_rows = "\n".join(f"| `{k}` | {number(last[k])} |" for k in FINAL_METRICS if k in last)
    metric_rows = (metric_rows + "\n" + speed_row(records)).strip() or "| (none logged) | |"
    metric_rows += best_row(best, s.metric_for_best_model)
    content = f"""---
{data.to_yaml()}
---

# {s.run_name}

DPO post-training of {trained_from} with {what}, trained with TRL's
`DPOTrainer` (config `{Path(s.config or "-").name}`).
{card_lines(s)}{sources_section(sources)}
## Recipe

| field | value |
|---|---|
{recipe_rows}

## Final metrics (step {last.get("step", "-")})

| metric | value |
|---|---|
{metric_rows}
{evaluation_section(records)}
![training curves]({PLOT_FILE})
"""
    marked = best_branch_step(best, s.metric_for_best_model)
    return str(ModelCard(content + revisions_section(revisions, repo_id or s.hub_model_id or "", marked)))


def evaluation_section(records: list[dict]) -> str:
    """The card's last evaluation on the held-out data, as run_complete.json's `final_eval` holds it
    (`publish.completion`), as TRL's and transformers' cards show evaluation results; "" where the run evaluated none.
    A run that evaluated had its figures there and none on the card, whose final metrics are training's."""
    evaluated = last_logged(records, "eval_loss")
    if not evaluated:
        return ""
    rows = "\n".join(
        f"| `{k}` | {number(evaluated[k])} |" for k in (f"eval_{m}" for m in FINAL_METRICS) if k in evaluated
    )
    return f"""
## Last evaluation (step {evaluated["step"]}, held-out data)

| metric | value |
|---|---|
{rows}
"""


def shown(name: str) -> str:
    """A model or data set as the card names it: a local path by its last part (the training machine's full path means
    nothing on the Hub)."""
    if not name or builtin.is_builtin(name) or is_hub_model(name):
        return name
    return Path(name.rstrip("/")).name or name


def named(name: str | None, identity: dict | None) -> str:
    """`name` with the commit or SHA-256 the run read of it (a branch moves and a path is reused), else that it was a
    local folder."""
    if not name:
        return "`-`"
    identity = identity or {}
    if identity.get(KEY):
        return f"`{name}` (commit `{identity[KEY][:12]}`)"
    files = identity.get("files", identity)  # a model's under "files", a data set's at the top
    hashed = {f: e["sha256"] for f, e in files.items() if isinstance(e, dict) and e.get("sha256")}
    if is_hub_model(name) or builtin.is_builtin(name):  # a Hub name without a commit (an older record): as it was
        return f"`{name}`"
    if len(hashed) == 1 and "files" not in identity:  # a data set of one local file
        return f"`{shown(name)}` (sha256 `{next(iter(hashed.values()))[:12]}`)"
    # A file by a data file's suffix (datasets' own), never a model; a name's dots are no suffix (`Llama-3.1-8B`)
    suffixes = [s for s in Path(name).suffixes if s not in COMPRESSIONS]
    file = "files" not in identity and len(hashed) <= 1 and suffixes[-1:] in [[s] for s in LOCAL_SUFFIXES]
    return f"`{shown(name)}` (a local {'file' if file else 'folder'})"


def part_named(s) -> str:
    """The part of `dataset_name` trained on, where it is not the whole default one, said before its name: its split
    (`ultrafeedback_binarized`'s `train_prefs`) and configuration. The card named the data set alone, whose default a
    reader loads."""
    split = f"the `{s.dataset_train_split}` split of " if s.dataset_train_split not in (None, "train") else ""
    return split + (f"configuration `{s.dataset_config}` of " if s.dataset_config else "")


def card_fields(optim: str | None) -> list[str]:
    """CARD_FIELDS less the Adam settings an optimizer does not read (ADAM_FIELDS); all of them where none is named."""
    if not optim:
        return CARD_FIELDS
    read = next((fields for part, fields in ADAM_FIELDS.items() if part in str(optim)), ())
    return [k for k in CARD_FIELDS if not k.startswith("adam_") or k in read]


def best_of(state) -> dict | None:
    """The best evaluation as transformers' TrainerState keeps it, None where no metric_for_best_model chose."""
    if state.best_global_step is None or state.best_metric is None:
        return None
    # transformers names the best step's folder only where one was saved at it, and leaves an earlier best's otherwise
    folder = Path(state.best_model_checkpoint or "").name
    saved = folder if folder == f"checkpoint-{state.best_global_step}" else None
    return {"step": state.best_global_step, "metric": state.best_metric, "checkpoint": saved}


def best_row(best: dict | None, name: str | None) -> str:
    """The card's row for the best evaluation: its step, value and checkpoint (kept from rotation: checkpoints.py)."""
    if not best:
        return ""
    where = f"`{best['checkpoint']}`" if best.get("checkpoint") else "no checkpoint saved at that step"
    return f"\n| best evaluation (`{name}`) | step {best['step']}: {number(best['metric'])} ({where}) |"


def number(value) -> str:
    """A final metric as the card shows it; null in metrics.jsonl was NaN or infinite (`records.dumps`)."""
    return "NaN or infinite" if value is None else f"{value:.4f}"


def template_named(r: Record) -> str:
    """The chat template trained with: the recipe's file, by name and SHA-256, or the base model's own."""
    given, t = r.settings.chat_template_path, r.lengths.template
    if t and t.plain_text:
        return "none (the pairs are plain text)"
    digest = f" (sha256 `{t.sha256[:12]}`)" if t and t.sha256 else ""
    return f"`{Path(given).name}`{digest}" if given else f"the base model's own{digest}"


def sources_section(sources: list[dict]) -> str:
    """A mixture's sources as recorded (data/mixture.py), each by its files' SHA-256 or its Hub revision."""
    if not sources:
        return ""
    rows = []
    for r in sources:
        ident = r.get("identity") or {}
        files = ident.get("files") or {}
        what = ", ".join(f"`{name}` sha256 `{f['sha256'][:12]}`" for name, f in files.items())
        what = what or ident.get("revision", "")
        share = f"{r['token_share']:.1%}" if "token_share" in r else ""
        dropped = f", {cut} dropped at max_length" if (cut := r.get("dropped_at_max_length")) else ""
        name = r["source"].split(" [")[0].split(":")[0]
        source = r["source"].replace(name, shown(name), 1)  # a local source by its file's name (`shown`)
        rows.append(
            f"| `{source}` | {r['rows_read']} | {r['rows_usable']} | {r['amount']} | {r['taken']}"
            f"{' (upsampled)' if r['upsampled'] else ''}{dropped} | {share} | {what} |"
        )
    return (
        "\n## Data\n\n| source | rows | usable | amount | taken | share of tokens | identity |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def as_run(key: str, r: Record):
    """A recipe field as the run used it: warm-up in steps, the epochs max_steps made, batches as a budget cut them."""
    value, b = getattr(r.settings, key), r.batching
    if key == "warmup_steps" and r.data.warmup_steps is not None:
        return f"{r.data.warmup_steps} ({value:g} of the steps)" if 0 < (value or 0) < 1 else r.data.warmup_steps
    if key == "num_train_epochs" and (r.settings.max_steps or -1) > 0:  # max_steps wins over epochs in transformers
        epochs = b.epochs_trained  # what its steps make: fewer epochs, or more
        if epochs is None:  # a record from before the plan counted them
            return f"{value} (stopped at max_steps {r.settings.max_steps})"
        trained = f"{plural(decimal(epochs), 'epoch')} trained"
        return f"{value} (max_steps {r.settings.max_steps} decides the steps: {trained})"
    if key == "num_train_epochs" and b.epochs_trained is not None and rounded_up(b.epochs_trained, value):
        return f"{value} ({epochs_text(b.epochs_trained, value, ' trained')})"  # as the Plan line says it
    if key == "max_length" and value is not None:
        return f"{value} ({r.lengths.chosen_by})"
    if key == "per_device_train_batch_size" and value is None and b.pairs_per_micro_batch:
        return f"{plural(b.pairs_per_micro_batch, 'pair')} per micro-batch (max_tokens_per_microbatch)"
    if key == "gradient_accumulation_steps" and value is None and b.micro_batches_per_step:
        per = b.micro_batches_per_step
        return (
            f"{plural(per, 'micro-batch', many='micro-batches')} per step{f' (mean {per.mean})' * (per.min != per.max)}"
        )
    return value


REVISIONS_HEADING = "## Checkpoint revisions"


def best_branch_step(best: dict | None, name: str | None) -> tuple[int, str] | None:
    """(step, metric) of the best evaluation where a checkpoint was saved at its step: its branch holds that model."""
    return (best["step"], name) if best and best.get("checkpoint") else None


def revisions_section(revisions: list[tuple[int, str]], repo_id: str, best: tuple[int, str] | None = None) -> str:
    """The card's checkpoint branches, the `best` one marked: the last section, which push_to_hub.py replaces."""
    if not revisions:
        return ""
    mark = {best[0]: f" (best evaluation, `{best[1]}`)"} if best else {}
    rows = "\n".join(
        f"| {step} | [`{b}`]({hub_switches.shown_endpoint()}/{repo_id}/tree/{b}){mark.get(step, '')} |"
        for step, b in revisions
    )
    return f"""
{REVISIONS_HEADING}

Checkpoints saved during training (model weights, config and tokenizer; no optimizer state) are branches of this
repo: `AutoModelForCausalLM.from_pretrained("{repo_id}", revision="{revisions[-1][1]}")`.

| step | revision |
|---|---|
{rows}
"""


def speed_row(records: list[dict]) -> str:
    """The mean tokens/s of the logging steps but each attempt's first, not the last step's alone (one step's figure
    ranges widely). An attempt's first holds its warm-up (the first steps' allocations, compilation): a resumed run's
    first step after the resume (its record says `resumed_from`) was counted as steady, an uninterrupted run's not."""
    speeds, warm_ups, first = [], [], True  # first: the next training record starts an attempt
    for r in records:
        first = first or "resumed_from" in r  # an evaluation at the checkpoint's step may hold it (eval_on_start)
        if "loss" in r and r.get("tokens_per_second") is not None:
            (warm_ups if first else speeds).append((r["step"], r["tokens_per_second"]))
            first = False
    steady = speeds or warm_ups  # each attempt logged one step: all of them
    if not steady:
        return ""
    (first_step, _), (last_step, _) = steady[0], steady[-1]
    steps = f"{len(steady)} logging steps, {first_step}-{last_step}" if len(steady) > 1 else f"step {first_step}"
    left = ""
    if speeds and len(warm_ups) == 1:
        left = "; the first, with the warm-up, left out"
    elif speeds and warm_ups:
        left = f"; each attempt's first (steps {', '.join(str(s) for s, _ in warm_ups)}), with its warm-up, left out"
    mean = sum(v for _, v in steady) / len(steady)
    return f"| `tokens_per_second` | {mean:,.1f} (mean of {steps}{left}) |"


def write_model_card(output_dir: str | Path, r: Record, repo_id: str = "", best: dict | None = None) -> Path:
    card = model_card(r, read_metrics(output_dir), pushed_revisions(output_dir, repo_id), repo_id, best)
    return write_text(Path(output_dir) / CARD, card)


def update_card_revisions(output_dir: str | Path, repo_id: str) -> None:
    """Replace the card's revisions section with what hub_pushes.jsonl says is on the Hub (push_to_hub.py)."""
    path = Path(output_dir) / "README.md"
    try:
        card = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a section added in an editor's other encoding: "run the same command again" was
        # push_to_hub.py's advice, which failed the same way each time
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} line {line} is not UTF-8 text, which a model card must be: save it as UTF-8 (written as Latin-1: "
            f"`iconv -f latin1 -t utf-8`), then run the same command again; main was not pushed"
        ) from None
    head, _, section = card.partition("\n" + REVISIONS_HEADING)
    # A section a person added after the list (their evaluation) kept: the list has no heading of its own after its
    # first, and everything after it was dropped from the card in the folder and on main
    after = section[section.find("\n## ") :] if "\n## " in section else ""
    kept = head.rstrip("\n") + "\n"
    recorded = read_record(Path(output_dir) / RESOLVED) or of_record({})  # the metric's name
    best = best_branch_step(finished(output_dir).get("best"), recorded.settings.metric_for_best_model)
    card_now = kept + revisions_section(pushed_revisions(output_dir, repo_id), repo_id, best) + after
    if card_now != card:  # the run's own card left as it was where nothing changes (a push to the run's repo)
        write_text(path, card_now)


def finished(output_dir) -> dict:
    """What a finished run recorded of its end (run_complete.json, `publish.completion`); {} where it has none."""
    # Not "rerun the same command": a rerun refuses a finished run's folder (pass a new --output_dir, or
    # --overwrite_output_dir, which deletes the trained model), and writes no run_complete.json into it
    fix = (
        "a finished run writes it last, and no rerun writes it again: restore it from the folder the run wrote (this "
        "one may be a copy cut short) or from another copy of it"
    )
    return run_records.read_record(Path(output_dir) / RUN_COMPLETE, fix) or {}


def finished_step(output_dir) -> int | None:
    """The step a finished run ended at (run_complete.json), None where it has not finished."""
    return finished(output_dir).get("global_step")


def own_files(output_dir: str | Path) -> list[str] | None:
    """The patterns an upload of the run may take: its own names (run_files.json), never a person's file (a .env);
    None for a run from before run_files.json (all but IGNORE, as then). Inside a folder of the run's (merged/), a
    finished run's final model files alone, as run_complete.json's model_files names them: a person's evaluation of
    the merged model kept beside it (merged/lm_eval/results.json) went up with it."""
    names = run_files.read(Path(output_dir))
    if names is None:
        return None
    saved = finished(output_dir).get(MODEL_FILES)  # none yet where the run records them (saved_model), or older
    if not isinstance(saved, dict):
        return [p for name in names for p in (name, f"{name}/*")]
    return [p for name in names for p in (name, *(f for f in saved if f.startswith(f"{name}/")))]


def push_run(
    output_dir: str | Path,
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    stop_asked=None,
    started: bool = False,
) -> str:
    """Upload the run to main of `repo_id`, retried; returns the repo's URL. Recorded as started (unless `started`:
    the run recorded it before its run_complete.json, `publish.finish_outputs`), then its outcome (a kill leaves it
    unconfirmed); given up as `stop_asked()` says, `unfinished`, raising PushStopped."""
    step = finished_step(output_dir)
    record = functools.partial(record_push, output_dir, step=step, branch="main")
    try:
        check_one_model(output_dir)  # push_to_hub.py's and the run's own final push alike
        digests = check_saved_model(output_dir, hashed=True)  # each file hashed once: the upload takes the digest
        say_merged_deleted(Path(output_dir))
    except Exception as e:
        if started:  # its start recorded by the run: its outcome too, else each rerun said "killed while pushing"
            with contextlib.suppress(OSError):  # a record the disk refuses: the check's refusal is what to say
                record(status="failed", repo=repo_id, error=cause(e))
        raise
    api = HfApi(token=token)

    def upload():
        create_repo(api, repo_id, private)
        # create_commit, not upload_folder: with hf_xet installed upload_folder commits in batches and splits a commit
        # the Hub refuses into smaller ones, so main could serve part of the new model beside part of the old
        operations = main_operations(api, repo_id, Path(output_dir), digests)
        try:
            return api.create_commit(repo_id, operations, commit_message="Upload DPO run", revision="main")
        except ValueError as e:  # huggingface_hub asks the Hub to validate the card's metadata before the commit
            if (refused := card_refused(Path(output_dir), e)) is None:
                raise
            raise refused from None

    if not started:
        record(status="started", repo=repo_id)
    try:
        commit, attempts = until_stopped(lambda: with_retries(upload, f"push to {repo_id}"), stop_asked)
    except PushStopped:
        record(status="unfinished", repo=repo_id, error="given up on a stop request while pushing")
        raise
    except Exception as e:
        # `attempts`: with_retries' count; another failure (the stop request's own check) has none
        record(status="failed", repo=repo_id, attempts=getattr(e, "attempts", None), error=cause(e))
        raise
    record_pushed(output_dir, str(output_dir), repo_id, step=step, branch="main", attempts=attempts, commit=commit.oid)
    return f"{hub_switches.shown_endpoint()}/{repo_id}"


class CardRefused(ConfigError):
    """The Hub refuses the model card's metadata: every push fails the same way until the card is fixed. `refusal`: the
    line up to its fix, which push_to_hub.py and the run's own push follow with their next step."""

    def __init__(self, refusal: str):
        super().__init__(f"{refusal}, then run the same command again; main was not pushed")
        self.refusal = refusal


def card_refused(out: Path, error: ValueError) -> CardRefused | None:
    """huggingface_hub's ValueError for a card whose metadata the Hub's validate-yaml refused (a `license: Apache 2.0`
    added by hand: the Hub takes `apache-2.0`) as one line naming the card and the Hub's reasons, which huggingface_hub
    puts on the lines after the first (`cause` keeps the first alone); None for any other ValueError. It was "failed
    (ValueError: Invalid metadata in README.md.): run the same command again", which failed the same way each time."""
    if not str(getattr(getattr(error.__cause__, "response", None), "url", "")).endswith("/api/validate-yaml"):
        return None
    reasons = [line[2:].strip()[:500] for line in str(error).splitlines()[1:] if line.startswith("- ")]
    return CardRefused(
        f"the Hub refuses the model card {out / CARD}: its metadata (the YAML block between the `---` lines at its "
        f"top) is not what the Hub takes: {'; '.join(reasons) or 'the Hub gave no reason'}; fix it there"
    )


def main_operations(api, repo_id: str, out: Path, digests: dict[str, str] | None = None) -> list:
    """The one commit of a final push: the run's own files, and main's earlier weights it does not replace deleted.
    `digests`: the SHA-256 of files already hashed (check_saved_model), which huggingface_hub then does not hash."""
    names = local_files(out, IGNORE, allow=own_files(out))
    held = api.list_repo_files(repo_id, revision="main")
    stale = [
        p
        for p in held
        if p not in names
        and in_model_folder(PurePosixPath(p))
        and any(PurePosixPath(p).match(pattern) for pattern in LOADED)
    ]
    # the run's record and a LoRA adapter's config as their copies without the training machine's paths (public.py)
    adds = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=uploaded(out, name)) for name in names]
    for add in adds:
        if isinstance(add.path_or_fileobj, str) and add.path_in_repo in (digests or {}):  # hashed lazily otherwise
            add.upload_info.sha256 = bytes.fromhex(digests[add.path_in_repo])
    return [*(CommitOperationDelete(p) for p in stale), *adds]


def in_model_folder(path: PurePosixPath) -> bool:
    """Whether `path` lies where a run writes a model (REPLACED_IN), its named chat templates' folder included."""
    folder = path.parent.parent if path.parent.name == model_identity.TEMPLATES_DIR else path.parent
    return folder in REPLACED_IN


def uploaded(out: Path, name: str) -> bytes | str:
    """What the final push uploads as `name`: the copy `upload_content` makes, else the file by its path."""
    public = upload_content(out, name)
    return str(out / name) if public is None else public


# --- pushing later, from a login node ---------------------------------------------------------------------------------


def run_folder_problems(output_dir: str | Path) -> list[str]:
    """What keeps `output_dir` from being a finished run worth pushing; [] when it is one."""
    out = Path(output_dir)
    if not out.is_dir():
        return ["the folder itself"]
    problems = []
    if not (out / RUN_COMPLETE).is_file():
        problems.append(f"{RUN_COMPLETE} (training has not finished: resume it with the same command)")
    adapter = (out / "adapter_config.json").is_file()  # a LoRA run (use_peft): an adapter instead of full weights
    needed = ("adapter_model.safetensors" if adapter else "config.json", "tokenizer_config.json")
    problems += [f for f in needed if not (out / f).is_file()]
    index = out / "model.safetensors.index.json"
    if not adapter and index.is_file():
        shards = shards_of(index)
        problems += [f"{index.name} (unreadable)"] if shards is None else [s for s in shards if not (out / s).is_file()]
    elif not adapter and not (out / "model.safetensors").is_file():
        problems.append("model.safetensors")
    if not any((out / f).is_file() for f in TOKENIZER_VOCAB):
        problems.append("tokenizer.json")
    problems += [f for f in ("README.md", PLOT_FILE) if not (out / f).is_file()]
    return problems


def check_one_model(output_dir: str | Path) -> None:
    """Refuse, before anything uploads, weights of more than one save in a folder the push takes (a job resumed before
    move_in removed an earlier attempt's, a person's copy): from_pretrained loads model.safetensors before a sharded
    index, so the repo would serve the earlier model."""
    out = Path(output_dir)
    folders: dict[PurePosixPath, set[str]] = {}
    for name in local_files(out, IGNORE, allow=own_files(out)):
        path = PurePosixPath(name)
        if path.name != "adapter_config.json" and any(path.match(p) for p in REPLACED):
            folders.setdefault(path.parent, set()).add(path.name)
    check_whole(out, folders)
    found = []
    for folder, names in folders.items():
        at = "" if folder == PurePosixPath(".") else f"{folder}/"
        loadable = [n for n in WEIGHT_FILES if n in names]  # in from_pretrained's order
        indexed = {n: shards_of(out / folder / n) for n in loadable if n.endswith(".index.json")}
        if None in indexed.values():
            continue  # an index that cannot be read: from_pretrained says what is wrong with it
        saves = {n: {n, *indexed.get(n, [])} & names for n in loadable}  # each model, with the shards its index names
        if len(saves) > 1:
            shards = {n: f" and its {len(files) - 1} shards" * (len(files) > 1) for n, files in saves.items()}
            each = [f"{at}{n}{shards[n]} (written {written(out / folder, files)})" for n, files in saves.items()]
            found.append(f"{' beside '.join(each)} (from_pretrained loads {at}{next(iter(saves))})")
        if stray := sorted(n for n in names - set().union(*saves.values()) if not n.startswith("adapter_model.")):
            index = next((f"{at}{n} does" for n in saves if n.endswith(".index.json")), "no index does")
            found.append(f"{', '.join(at + n for n in stray)}, which {index} not name")
    if found:
        raise ConfigError(
            f"{out} holds weights of more than one save, which would all reach the repo: {'; '.join(found)}. Delete "
            "the earlier save's files (from a job resumed before this version, or a copy), or rerun training into a "
            "new output_dir; then push again"
        )


def saved_model(out: Path, names: list[str]) -> dict[str, dict]:
    """The final model's files among `names` (the top-level names its save wrote, merged/ too) that a push uploads, each
    with its size and SHA-256: run_complete.json's `model_files`, which a push checks (check_saved_model). Not the
    card, which a LoRA save writes (PEFT's) and the run, then push_to_hub.py (its revisions), write again."""
    pushed = local_files(out, IGNORE, allow=own_files(out))
    taken = [n for n in pushed if n.split("/")[0] in names and n != CARD]
    return {n: {"bytes": (out / n).stat().st_size, "sha256": checkpoint_manifest.sha256(out / n)} for n in taken}


def check_saved_model(output_dir: str | Path, hashed: bool = False) -> dict[str, str]:
    """Refuse, before anything uploads, a final model's file missing or changed since the run saved it (a bad disk
    block, a garbled or cut-short copy, an edited config.json), by the sizes run_complete.json records and, `hashed`,
    their SHA-256: pushed, main served a model no from_pretrained loads, or other weights, and the push said done.
    Returns {name: SHA-256} of the files hashed; a run recorded before runs kept the record is not checked."""
    out = Path(output_dir)
    again = "copy it again from the folder the run wrote, or train again into a new output_dir; nothing was pushed"
    digests = {}
    skipped = merged_deleted(out)
    for name, saved in (finished(out).get(MODEL_FILES) or {}).items():
        if skipped and PurePosixPath(name).parts[0] == MERGED_DIR:
            continue
        path = out / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ConfigError(f"{path} is not the file the run saved (it is missing): {again}") from None
        if size != saved["bytes"]:
            was = f"{size:,} bytes, where the run saved {saved['bytes']:,}"
            raise ConfigError(f"{path} is not the file the run saved ({was}): {again}")
        if not hashed:
            continue
        digests[name] = checkpoint_manifest.sha256(path)
        if digests[name] != saved["sha256"]:
            raise ConfigError(
                f"{path} is not the file the run saved (its SHA-256 is not the one {RUN_COMPLETE} records): {again}"
            )
    return digests


def merged_deleted(out: Path) -> bool:
    """Whether a LoRA run's merged/ was deleted whole since the run wrote it (`rm -r`: the base with the adapter merged
    in, as large as the base, and made from what the push uploads). The run is pushed without it, the card saying so
    (`say_merged_deleted`): refused as a file missing ("copy it again ... or train again"), it could not be pushed at
    all. A merged/ there in part is a copy cut short, refused as any (`check_saved_model`)."""
    names = finished(out).get(MODEL_FILES) or {}
    recorded = any(PurePosixPath(name).parts[0] == MERGED_DIR for name in names)
    return recorded and not os.path.lexists(out / MERGED_DIR)


def say_merged_deleted(out: Path) -> None:
    """Before a final push (`push_run`: push_to_hub.py's, and a rerun's completing the run's own push a kill cut
    short): a merged/ deleted whole (`merged_deleted`) is pushed without, the card's line of it replaced by one saying
    it was deleted, and said in a line."""
    if not merged_deleted(out):
        return
    card = out / CARD
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    if MERGED_LINE in text:
        write_text(card, text.replace(MERGED_LINE, MERGED_DELETED))
    print(
        f"note: {out / MERGED_DIR} was deleted since the run wrote it: the run is pushed without its merged model, "
        "its card saying so",
        flush=True,
    )


def check_whole(out: Path, folders: dict[PurePosixPath, set[str]]) -> None:
    """Refuse weights cut short since the run wrote them (a copy of the folder to a login node stopped midway), from
    their headers: pushed, they replaced the model on main with one no from_pretrained loads, and the push said done."""
    again = "copy it again from the folder the run wrote (or train again into a new output_dir); nothing was pushed"
    for folder, names in folders.items():
        for name in sorted(n for n in names if n.endswith(".safetensors")):
            # only a header that says more (a file that is no safetensors at all is the loader's to refuse)
            if (why := not_whole(out / folder / name, again)) and why.startswith(CUT_SHORT):
                raise ConfigError(f"{out / folder / name} {why}")


def written(folder: Path, names) -> str:
    """When the newest of `names` in `folder` was written, to the minute: which of two saves is the earlier."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(max((folder / n).stat().st_mtime for n in names)))


def hub_failed(where: str) -> type[Exception]:
    """What a Hub that fails to answer a check (a 5xx, no route) ends `where` with: the job is refused at its start
    (ConfigError, exit 2), before training, as its other checks are; push_to_hub.py fails (RunError, exit 1, as
    docs/hub.md gives for the Hub failing it): its exit 2 said "fix your input" of an outage."""
    return ConfigError if where == "job" else RunError


def check_write_access(repo_id: str, token: str | None, where: str = "job", base: str | None = None) -> str:
    """Refuse a push the Hub would refuse, at start (`where`: "job"), not after training, or in push_to_hub.py, and one
    to the run's own base model (`base`: `check_not_the_base`). Returns the repo id with its namespace, which the Hub's
    branch and commit endpoints need; offline, `repo_id` as given."""
    if is_offline():
        print(
            f"Skipped checking write access to {repo_id}: HF_HUB_OFFLINE is set, so nothing is pushed during the run. "
            "Push from a machine that reaches the Hub after the run: python scripts/push_to_hub.py <output_dir>",
            flush=True,
        )
        return repo_id
    token = token or get_token()
    if not token:
        raise ConfigError(
            f"pushing to {repo_id} needs a Hugging Face token: add HF_TOKEN=... to .env or run `hf auth login`"
            f"{venv.hidden('HF_TOKEN')}"
        )
    api = HfApi(token=token)

    def ask() -> tuple[dict, str, bool]:
        whoami = within(30, api.whoami)
        named = repo_id if "/" in repo_id else f"{whoami.get('name')}/{repo_id}"
        return whoami, named, _may_write(api, named)

    try:
        # A Hub that answered with a 5xx or 429 asked again, as an upload is (with_retries): one such answer ended the
        # job, a requeued one's too, exit 2. No answer at all (no route, a timeout) is not: a node without network
        # is told so at once.
        (whoami, repo_id, writable), _ = with_retries(ask, f"the write check of {repo_id}", answered_failure)
    except HfHubHTTPError as e:
        if status_of(e) == 401:
            raise InvalidToken(invalid_token(token)) from None
        nothing = "nothing was trained" if where == "job" else "nothing was pushed"
        raise hub_failed(where)(
            f"could not check write access to {repo_id}: {cause(e)}; {nothing}: run the same command again"
        ) from None
    except Exception as e:  # noqa: BLE001 - no route, DNS, proxy, timeout, a bad HF_ENDPOINT: named by cause()
        unreachable = (
            "Compute nodes without network: set HF_HUB_OFFLINE=1 and push afterwards with scripts/push_to_hub.py"
            if where == "job"
            else "This machine cannot reach the Hub: run scripts/push_to_hub.py where it can (a login node with "
            "network), or fix HF_ENDPOINT / the proxy settings (HTTPS_PROXY)"
        )
        raise hub_failed(where)(
            f"could not reach the Hugging Face Hub to check write access to {repo_id} ({cause(e)}). {unreachable}"
        ) from None
    check_not_the_base(repo_id, base)
    if not writable:
        raise ConfigError(write_refused(whoami, repo_id))
    return repo_id


def answered_failure(error: BaseException) -> bool:
    """The Hub's own answer of a failure worth asking again (a 5xx, 429 or 408), not a request that got no answer."""
    return isinstance(error, HfHubHTTPError) and status_of(error) is not None and is_transient(error)


def _may_write(api, repo_id: str) -> bool:
    """True when the token may write to `repo_id`, or there is no such repo yet (the push creates it)."""
    try:
        within(30, lambda: api.auth_check(repo_id, write=True))
    except RepositoryNotFoundError:
        # Also the answer for a repo the token may see but not write to (huggingface_hub's `hf spaces hot-reload`
        # reads it so): whether the repo exists tells which.
        return not within(30, lambda: api.repo_exists(repo_id))
    except HfHubHTTPError as e:
        if status_of(e) == 403:  # the repo exists, and this token may not write to it
            return False
        raise
    return True


def create_at_start(repo_id: str, token: str | None, private: bool | None) -> None:
    """The run's repo created at start, as transformers' Trainer does: the Hub answers now, not after training, whether
    this token may create it. Main process, after `check_write_access`; nothing offline."""
    if is_offline():
        return
    api = HfApi(token=token or get_token())
    try:
        within(30, lambda: create_repo(api, repo_id, private))
    except ConfigError:  # the Hub's refusal, named by create_repo
        raise
    except Exception as e:  # noqa: BLE001 - a 5xx, a connection dropped (a traceback before), no answer in 30 s
        raise ConfigError(
            f"could not create {repo_id} on the Hub ({cause(e)}), though it answered the write check: nothing was "
            "trained; run the same command again"
        ) from None
    check_private(repo_id, token, private)


def create_repo(api, repo_id: str, private: bool | None):
    """`repo_id` created if absent; the Hub's refusal (a read token, another's namespace) a ConfigError, not retried."""
    try:
        # None (hub_private_repo unset) is the namespace's default, as the Trainer and push_run read it: an organization
        # that makes its repos private by default gets a private one, not a public one
        return api.create_repo(repo_id, private=private, exist_ok=True)
    except HfHubHTTPError as e:
        # 401: the token revoked or expired (at the final push: during training), which no token's rights explain
        if status_of(e) == 401:
            raise InvalidToken(invalid_token(api.token or get_token())) from None
        if status_of(e) != 403:
            raise
        raise ConfigError(
            f"the Hub refuses to create {repo_id} with this Hugging Face token ({cause(e)}): use a write token that "
            f"may create repos in {repo_id.rpartition('/')[0]!r}, or a --hub_model_id in a namespace it can write to"
        ) from None


def check_private(repo_id: str, token: str | None, private: bool | None, where: str = "job") -> None:
    """Refuse a private push to an existing public repo: the flag only sets the visibility of a repo it creates."""
    if not private:
        return
    try:
        public = not within(30, lambda: HfApi(token=token or get_token()).repo_info(repo_id).private)
    except RepositoryNotFoundError:
        return  # created private by the push
    except Exception as e:  # noqa: BLE001 - a 5xx, a connection dropped (a traceback before), no answer in 30 s
        raise hub_failed(where)(
            f"could not read whether {repo_id} is private ({cause(e)}): nothing was pushed; run the same command again"
        ) from None
    if public:
        raise ConfigError(
            f"{repo_id} is a public repo, which hub_private_repo / --private does not change (they make a new repo "
            f"private): make it private first (`hf repos settings {repo_id} --private`, or its Settings page), or push "
            "to another repo name"
        )


def write_refused(whoami: dict, repo_id: str) -> str:
    """One line for a repo this token may not write to: the user's own (the token lacks write access) or another's."""
    user = whoami.get("name")
    if repo_id.rpartition("/")[0] != user:
        return (
            f"{user!r} cannot write to the existing repo {repo_id}: ask its owners for write access, or push to "
            "another --hub_model_id"
        )
    shown = ((whoami.get("auth") or {}).get("accessToken") or {}).get("displayName")
    label = f"the Hugging Face token {shown!r}" if shown else "the Hugging Face token"
    return (
        f"{label} has no write access to {repo_id}: create a write token (or a fine-grained one that may write to "
        f"{repo_id}) at https://huggingface.co/settings/tokens and set HF_TOKEN in .env"
    )

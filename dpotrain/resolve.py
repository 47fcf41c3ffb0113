"""From parsed arguments to a checked plan: derived numbers, and every refusal that must come before a model loads."""

import contextlib
import dataclasses
import math
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dpotrain import output_folder
from dpotrain.cluster import engine, run_lock
from dpotrain.data import builtin, chat_template, mixture, model_identity
from dpotrain.hub import hub_push
from dpotrain.hub.hub import RUN_COMPLETE
from dpotrain.plan.plan import steps_of
from dpotrain.recipe import config, init_kwargs, launcher, run_record, writes
from dpotrain.recipe import records as run_records
from dpotrain.recipe.config import Recipe
from dpotrain.recipe.errors import ConfigError, plural
from dpotrain.train import preemption, resume
from dpotrain.train.checkpoints import own_checkpoints, refuse_links

# Settings a resumed run must share with the run that wrote its checkpoint: each changes what the steps left train.
# Every other field may change, each with why in tests/test_refusals.py (MAY_CHANGE_FIELDS), which decides each once.
RESUME_FIELDS = """
    model_name_or_path model_revision trust_remote_code dataset_name dataset_config dataset_train_split skip_invalid
    hh_format assistant_turns datasets dataset_mixer_list dataset_mixer_list_splits pad_token learning_rate
    lr_scheduler_type lr_scheduler_kwargs warmup_steps num_train_epochs max_steps optim optim_args optim_target_modules
    weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm seed data_seed neftune_noise_alpha beta loss_type
    loss_weights label_smoothing ld_alpha f_divergence_type f_alpha_divergence_coef use_weighting discopop_tau
    router_aux_loss_coef disable_dropout sync_ref_model ref_model_mixup_alpha ref_model_sync_steps max_length
    truncation_mode use_peft lora_r lora_alpha lora_dropout lora_target_modules lora_target_parameters
    lora_modules_to_save lora_task_type use_rslora use_dora load_in_4bit load_in_8bit bnb_4bit_quant_type
    use_bnb_nested_quant bnb_4bit_quant_storage
""".split()


def world_size(recipe: Recipe, planning: bool, planned: engine.Engine | None = None) -> tuple[int, str]:
    """Processes taking part. Under a launcher the environment says (accelerate's simple launcher: one); a --dry-run
    outside one predicts the launch, from `planned` where the caller has read the recipe's accelerate config
    (`engine.from_config`) already."""
    if (world := launcher.world()) is not None:
        return world, "environment (WORLD_SIZE)"
    if preemption.simple_launch():  # `accelerate launch --num_processes 1` (--cpu): its one process, this one
        check_one_process_asked(preemption.processes_asked())
        return 1, "accelerate launch of one process"
    launch = recipe.project.accelerate_config
    if not planning or launch.lower() in ("", "none"):
        return 1, "single process (python train_dpo.py, no launcher)"
    if not Path(launch).is_file():
        # It planned 1 process in silence: a mistyped name, or the default accelerate_config.yaml named from outside
        # the project, as a launch of one while `accelerate launch --config_file` it fails.
        raise ConfigError(
            f"accelerate config {launch!r} not found (in {os.getcwd()}), so `accelerate launch --config_file "
            f"{shlex.quote(launch)}` would fail: pass --accelerate_config the file the launch reads (its path from "
            "here), or none for one process"
        )
    planned = planned or engine.from_config(launch)
    if planned.processes is None:  # accelerate refuses the file: `accelerate launch` would stop on it
        raise ConfigError(planned.refused)
    return planned.processes, (
        f"predicted for `accelerate launch --config_file {shlex.quote(launch)}` ({launch}: num_processes); "
        "plain `python train_dpo.py` runs 1 process: --accelerate_config none plans that"
    )


def check_one_process_asked(asked: int | None) -> None:
    """accelerate's one-process launcher started this process while its command asked for `asked` processes: `--cpu`,
    or `--num_processes N` without --multi_gpu where the machine has fewer than 2 GPUs (a CPU machine, one GPU),
    starts one process, says nothing, and sets nothing the process could read the number from. The run trained on one
    process, its plan saying 1, as if that were what was asked."""
    if asked is None or asked <= 1:
        return
    raise ConfigError(
        f"`accelerate launch --num_processes {asked}` started this one process alone: with --cpu, or without "
        f"--multi_gpu on a machine of fewer than 2 GPUs, accelerate runs its one-process launcher; for {asked} "
        f"processes add --multi_gpu and drop --cpu (on a machine without GPUs they train on CPU, over gloo), or pass "
        "--num_processes 1 for one"
    )


def check_values(recipe: Recipe) -> None:
    t, p = recipe.training, recipe.project
    if t.beta <= 0:
        raise ConfigError(f"beta must be > 0 (got {t.beta}); OLMo 3's length-normalized DPO uses --beta 5")
    if t.learning_rate <= 0:
        raise ConfigError(f"learning_rate must be > 0 (got {t.learning_rate}); the recipes use 1e-6")
    if p.pairs_per_step is not None and p.pairs_per_step < 1:
        raise ConfigError(f"pairs_per_step must be >= 1 (got {p.pairs_per_step}), or unset it")
    if p.max_tokens_per_microbatch is not None and not recipe.max_length_auto:
        check_token_budget(p.max_tokens_per_microbatch, t.max_length)
    if not 0 < p.auto_coverage <= 1:
        raise ConfigError(f"auto_coverage must be in (0, 1] (got {p.auto_coverage})")
    if not recipe.model.model_name_or_path:
        raise ConfigError("no model: set model_name_or_path in the recipe or pass --model_name_or_path")
    chat_template.check(p.chat_template_path)  # the file the recipe names, before anything loads
    mixture.check(recipe)  # one source (dataset_name) or a mixture of them


def check_token_budget(budget: int, max_length: int | None, auto: str = "") -> None:
    """A token budget holds the longest pair there can be (under `max_length: auto`, checked once it is decided:
    `auto` says the choice, which the user never typed)."""
    if max_length is None:
        raise ConfigError(
            f"max_tokens_per_microbatch={budget} must hold the longest possible pair, 2 x max_length (unbounded: "
            "set max_length); a pair is never split"
        )
    if budget < 2 * max_length:
        chose = f"max_length: auto chose {max_length:,} ({auto}), and " if auto else ""
        shorter = f", or --max_length {budget // 2} (or less)" if budget >= 2 else ""  # a max_length of 0 is refused
        raise ConfigError(
            f"{chose}max_tokens_per_microbatch={budget} must hold the longest possible pair, 2 x max_length "
            f"({2 * max_length}); a pair is never split: pass --max_tokens_per_microbatch {2 * max_length} (or more)"
            + shorter
        )


@dataclass(frozen=True)
class Batch:
    """Pairs per optimizer step, kept fixed on any number of processes, and the gradient accumulation that gives it."""

    pairs_per_step: int
    gradient_accumulation_steps: int | None  # None: micro-batches cut by tokens, as many as the data makes (plan.py)


def decide_batch(recipe: Recipe, world: int) -> Batch:
    """Keep pairs_per_step fixed on any number of processes by deriving gradient accumulation; without pairs_per_step,
    per_device_train_batch_size x gradient_accumulation_steps x processes. `world`: the data-parallel ranks."""
    t, pairs = recipe.training, recipe.project.pairs_per_step
    per_step = t.per_device_train_batch_size * world
    ranks = _ranks(world, recipe.project.sequence_parallel_size)
    if recipe.project.max_tokens_per_microbatch is not None:
        # Micro-batches are cut by tokens: accumulation follows from the data; each process needs a pair per step.
        ignored = sorted({"per_device_train_batch_size", "gradient_accumulation_steps"} & recipe.given)
        if pairs is not None and ignored:  # pairs_per_step and the budget decide both: a value given would be unused
            raise ConfigError(
                f"{' and '.join(ignored)} would not be used: max_tokens_per_microbatch cuts each step of "
                f"pairs_per_step={pairs} pairs into micro-batches. Remove {' and '.join(ignored)}, or pass "
                "--max_tokens_per_microbatch none for micro-batches of per_device_train_batch_size pairs"
            )
        pairs = pairs or per_step * t.gradient_accumulation_steps
        if pairs < world:
            raise ConfigError(f"pairs_per_step={pairs} gives some of the {ranks} no pair: use at least {world}")
        return Batch(pairs, None)
    if pairs is None:
        return Batch(per_step * t.gradient_accumulation_steps, t.gradient_accumulation_steps)
    if pairs % per_step:
        raise ConfigError(
            _unreachable(pairs, world, t.per_device_train_batch_size, recipe.project.sequence_parallel_size)
        )
    if "gradient_accumulation_steps" in recipe.given and t.gradient_accumulation_steps != pairs // per_step:
        raise ConfigError(
            f"gradient_accumulation_steps={t.gradient_accumulation_steps} contradicts pairs_per_step={pairs} "
            f"(which needs {pairs // per_step} on {ranks}): set one of them, not both"
        )
    return Batch(pairs, pairs // per_step)


def _ranks(world: int, n: int) -> str:
    """`world` data-parallel ranks as a refusal names them: processes, or under sequence_parallel_size `n` > 1 ranks
    of `n` processes each (a refusal that counted them as processes named a launch that could not fix it)."""
    if n == 1:
        return plural(world, "process")
    return f"{plural(world, 'data-parallel rank')} ({world * n} processes / sequence_parallel_size {n})"


def _unreachable(pairs: int, world: int, batch: int, n: int = 1) -> str:
    """Why `pairs` per step is no whole number of micro-steps of `batch` pairs on `world` data-parallel ranks (of `n`
    processes each), and the fixes."""
    per_step = world * batch
    fixes = [f"--pairs_per_step {-(-pairs // per_step) * per_step} (a multiple of {per_step})"]
    if pairs % world == 0:
        share = pairs // world
        fit = max(d for d in range(1, min(batch, share) + 1) if share % d == 0)
        fixes.insert(0, f"--per_device_train_batch_size {fit} (pairs per process in a micro-step)")
    elif n == 1:
        fixes.append(f"run on a number of processes that divides {pairs}")
    else:
        fixes.append(f"run on {n} x a number that divides {pairs} processes")
    return (
        f"pairs_per_step={pairs} is not reachable with {_ranks(world, n)} x per_device_train_batch_size="
        f"{batch} ({plural(per_step, 'pair')} per micro-step): pass {', '.join(fixes)}, or "
        "--max_tokens_per_microbatch N (micro-batches cut by tokens, for any pairs_per_step)"
    )


@dataclass(frozen=True)
class OutputDecision:
    resume_from: str | None  # a complete checkpoint to resume from
    start_afresh: bool  # remove what output_dir holds before training
    # A dry run: what the run would refuse (credentials, the output folder), each the refusal's own line; a run refuses.
    would_refuse: tuple[str, ...] = ()
    data_commit: str | None = None  # a continued run's Hub data set commit, the one it started on (hub_revision.kept)
    source_commits: dict | None = None  # a continued run's mixture's Hub sources' commits, by repo (mixture.kept)
    source_draws: dict | None = None  # what its sources' rows were drawn by, by their specs now (mixture.drawn_by)
    # A finished run whose final push was started and not confirmed (hub_push.unconfirmed_push): the repo it pushed to.
    # The run completes that push and trains nothing.
    push_left: str | None = None
    # A requeue of the Slurm job that finished the run (`finished_by_this_job`): that job's id. The run trains nothing.
    finished_by: str | None = None
    # A dry run outside a Slurm job: output_dir is the job's own folder, named as the job starts (Recipe.job_folder)
    job_folder: bool = False
    # --auto_resume false going on from a checkpoint named in output_dir: the run's checkpoints saved past it, which
    # the run moves aside as it starts (output_folder.set_aside_past)
    set_aside: tuple[str, ...] = ()
    # A dry run: `check_output_dir` refused (a named checkpoint missing, a finished run there, ...), so nothing is
    # decided for the folder; the run refuses (`would_refuse` says why)
    refused: bool = False

    @property
    def trains(self) -> bool:
        """Whether the run trains: not when it only completes a push, or finds its own job's run finished."""
        return not (self.push_left or self.finished_by)

    def record(self, output_dir: str) -> dict:
        """What the run would do with its folder, and what it would refuse: for a dry run's summary."""
        if self.job_folder:  # as written, naming the job's variable: the summary says where it is made
            folder = f"{output_dir}{run_record.JOB_FOLDER}"
            folder += f", from the checkpoint {self.resume_from}" if self.resume_from else ""
        elif self.finished_by:
            folder = f"{output_dir}: {finished_run(self.finished_by)}: the run trains nothing"
        elif self.push_left:
            folder = pushing_left(output_dir, self.push_left)
        elif self.refused or any(names_folder(refusal, output_dir) for refusal in self.would_refuse):
            # Before the resume's lines: a checkpoint the run would refuse (written by another number of processes,
            # damaged) was called the one it resumes from, above the refusal
            folder = f"{output_dir}{run_record.REFUSED_FOLDER}"
        elif self.start_afresh:
            folder = f"{output_dir}: replaced by the run (--overwrite_output_dir: the old run's own files only)"
            folder += f", which resumes from {self.resume_from}" if self.resume_from else ""
        elif self.resume_from and Path(self.resume_from).parent.resolve() == Path(output_dir).resolve():
            folder = f"{output_dir}: an unfinished run, which the run resumes from {self.resume_from}"
        elif self.resume_from:  # another folder's checkpoint: this one was called "an unfinished run", new or empty
            new = "" if Path(output_dir).is_dir() else " (new)"
            folder = f"{output_dir}: the run starts there{new}, from the checkpoint {self.resume_from}"
        else:
            folder = f"{output_dir}: the run starts there" + ("" if Path(output_dir).is_dir() else " (new)")
        if self.set_aside:  # (--auto_resume false)
            aside = output_folder.past_folder(Path(output_dir), self.resume_from, "<time>")
            folder += f"; the checkpoints saved past it ({', '.join(self.set_aside)}) are moved to {aside}"
        return {"output_folder": folder, "would_refuse": list(self.would_refuse)}


# A dry run's decision where `check_output_dir` refused (listed in `would_refuse`): none made for the folder
UNDECIDED = OutputDecision(None, False, refused=True)


def names_folder(refusal: str, output_dir: str) -> bool:
    """Whether `refusal` is about the output folder: it names the folder, or a path inside it, quoted, as the folder's
    refusals do (`output_dir 'run' ...`, `checkpoint 'run/checkpoint-3' ...`). Not the folder's name as a word of
    another refusal: `--output_dir run` beside a missing Hub token ('..., run `hf auth login`') is a new folder."""
    spellings = {output_dir, str(Path(output_dir)), os.path.abspath(output_dir)}
    return any(f"{q}{name}{end}" in refusal for name in spellings for q in "'\"" for end in (q, "/"))


def written_record(out: Path) -> Path | None:
    """The folder whose resolved_config.json holds the settings the run in `out` ran with: `out`, unless its record
    was edited by hand since (`run_record.edited`); then, as a resume compares with its checkpoint's own record
    (resume.say_hand_edit), the newest checkpoint holding its copy, or None."""
    if not run_record.edited_file(out / run_record.RESOLVED):
        return out
    return next((f for f in reversed(own_checkpoints(out)) if (f / run_record.RESOLVED).is_file()), None)


def changed_in_folder(recipe: Recipe, out: Path, pairs_per_step: int | None) -> list[str]:
    """`changed_settings` against the run in `out` as it ran (`written_record`). Compared with a record edited by hand,
    an edit alone refused its checkpoints cut short as "no complete checkpoint", where the same record as written
    starts afresh; with no record as written left, the refusal names the edit."""
    folder = written_record(out)
    if folder is None:
        raise ConfigError(
            f"output_dir {str(out)!r} has no complete checkpoint, and its resolved_config.json was edited after the "
            "run wrote it, so the settings it ran with are not known: pass --overwrite_output_dir to start afresh, "
            "or a new --output_dir"
        )
    return changed_settings(recipe, folder, pairs_per_step)


# `pairs_per_step` of prefetch.py's `check_output_dir`: given the job's data flags alone (the command a run prints
# names no other), it takes the job's settings to be the stopped run's own, as recorded: the folder alone decides.
AS_RECORDED = "the settings as recorded"


def changed_settings(recipe: Recipe, out: Path, pairs_per_step: int | None) -> list[str]:
    """`field: old -> new` for each RESUME_FIELDS value (and pairs per step, the data's and the model's content) that
    differs from the resolved_config.json in `out`; [] when there is none to compare with, or with `AS_RECORDED`.
    `pairs_per_step` None: not compared (a start that ends before its launch is planned: train_dpo.py's requeue of
    a finished job)."""
    old, new = run_record.read(out / run_record.RESOLVED), run_record.of(resolved_config(recipe, {}))
    if old is None or pairs_per_step is AS_RECORDED:
        return []
    # auto again: the analyzer's choice for the same data and tokenizer, at the same coverage (another one chose another
    # max_length, which the resumed run trained with in silence)
    again = {"max_length"} if recipe.max_length_auto and old.lengths.auto is not None else set()
    changed = old.changed(new, [f for f in RESUME_FIELDS if f not in again] + ["auto_coverage"] * bool(again))
    # A LoRA run recorded before lora_dropout followed disable_dropout (config.parse_args) wrote TRL's 0.05, and trained
    # its adapter without dropout as the resumed run does: the same setting
    if changed.get("lora_dropout", (None, None))[1] == 0 and old.settings.use_peft and old.settings.disable_dropout:
        del changed["lora_dropout"]
    if "model_init_kwargs" in old.values:  # the keys the run decides are recorded as loaded, compared as their fields
        was, now = (init_kwargs.config_overrides(r.settings.model_init_kwargs) for r in (old, new))
        if was != now:
            changed["model_init_kwargs"] = (was, now)
    if pairs_per_step is not None and old.batching.pairs_per_step != pairs_per_step:  # None: not planned here
        changed["pairs_per_step"] = (old.batching.pairs_per_step, pairs_per_step)
    started = _started_in(out, old.values.get("output_dir"))
    for name in ("dataset_name", "model_name_or_path"):  # their content is compared below, whatever they are named
        if name in changed and _one_place(*changed[name], started):
            del changed[name]
    for name in ("datasets", "dataset_mixer_list"):  # a mixture's sources alike
        if name in changed and config.same_sources(*changed[name], name == "dataset_mixer_list", started):
            del changed[name]
    mixed = {"dataset_name", "datasets", "dataset_mixer_list", "dataset_mixer_list_splits"}
    content = None if mixed & set(changed) else mixture.content_changed(recipe, old.derived)
    # The held-out files too, where the held-out pairs are named as recorded (naming others may change): edited in
    # place, they changed the pairs evaluated on, and the eval curves across the resume, in silence
    held = old.changed(new, ["dataset_test_split", *mixture.EVAL_FIELDS])
    for name in mixture.EVAL_FIELDS[:2]:
        if name in held and config.same_sources(*held[name], name == "dataset_mixer_eval_list", started):
            del held[name]
    evaluates = recipe.training.eval_strategy != "no" and not held and not mixed & set(changed)
    held_out = mixture.held_out_changed(recipe, old.derived) if evaluates else None
    # The model's weights, tokenizer and template by their files (a Hub model by its commit): model_identity.py
    same_model = not {"model_name_or_path", "model_revision"} & set(changed)
    model = model_identity.changed(recipe, old.model_identity) if same_model else None
    # The template by its content (chat_template.py): the same file moved resumes, an edited one does not.
    template = chat_template.changed(old.lengths.template, recipe.project.chat_template_path)
    found = {f: f"{was!r} -> {now!r}" for f, (was, now) in changed.items()}
    found |= {"dataset content": content, "held-out content": held_out, "model": model, "chat template": template}
    return [f"{name}: {what}" for name, what in found.items() if what]


def _started_in(record: Path, recorded: str | None) -> Path | None:
    """The folder a run was started in, told by its output folder: recorded relative to it (`run`), found now as
    `exp/run` from the folder above. `record`: the folder holding the record, the run's or a checkpoint's in it. None
    where the record names it absolute, or the two do not end alike."""
    if not isinstance(recorded, str) or os.path.isabs(recorded):
        return None
    parts = Path(os.path.normpath(recorded)).parts
    for folder in (Path(os.path.abspath(record)), Path(os.path.abspath(record)).parent):
        if len(folder.parts) > len(parts) and folder.parts[-len(parts) :] == parts:
            return Path(*folder.parts[: -len(parts)])
    return None


def _one_place(old, new, started: Path | None = None) -> bool:
    """Two names of one local file or folder (relative once, absolute once, through a link; a built-in model and the
    folder it is built in): not a changed setting, the content being compared anyway. A recorded relative name is
    looked for as the run looks for its own (`config.recorded_place`), first in `started`, the folder the run started
    in (`cd exp; ... --dataset_name pairs.jsonl`, resumed from above as `exp/pairs.jsonl`): looked for here alone, a
    run started in the project was refused its resume from another folder naming that file by its full path."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    old, new = ((builtin.existing_model_dir(n) if builtin.is_builtin(n) else n) or n for n in (old, new))
    was, now = config.recorded_place(old, started=started), Path(new).expanduser()
    return was is not None and now.exists() and was == str(now.resolve())


def trained_under(checkpoint: Path) -> Path:
    """The folder holding the record of the settings `checkpoint` was trained under: its own copy (a checkpoint
    copied out of its run is compared too), else its run's folder's. Neither: refused."""
    for folder in (checkpoint, checkpoint.resolve().parent):
        if (folder / run_record.RESOLVED).is_file():
            return folder
    raise ConfigError(
        f"checkpoint {str(checkpoint)!r} holds no record of the settings it was trained with (resolved_config.json), "
        "and neither does the folder it is in, so a resume cannot be checked against them: copy its run's "
        f"resolved_config.json into it, or {resume.new_run_from(checkpoint)}"
    )


def trained_otherwise(recipe: Recipe, pairs_per_step: int | None):
    """What `resume.confirm` compares a checkpoint it falls back to with (its newest found damaged by its checksums):
    `changed_settings` against the record it was trained under, as `check_output_dir` compared the one it chose."""
    return lambda folder: changed_settings(recipe, trained_under(Path(folder)), pairs_per_step)


def trained_record(checkpoint: str | Path) -> run_record.Record | None:
    """The record of the settings `checkpoint` was trained under, read from the folder `trained_under` finds."""
    return run_record.read(trained_under(Path(checkpoint)) / run_record.RESOLVED)


def resumed(out: Path, point: str) -> OutputDecision:
    """Resume from `point`: a hand edit of the run's record is said not to be used (resume.say_hand_edit)."""
    resume.say_hand_edit(out, point, trained_under(Path(point)))
    return OutputDecision(point, False)


def afresh(decision: OutputDecision) -> OutputDecision:
    """`decision` to resume turned into the start afresh --overwrite_output_dir asks for, no checkpoint left to resume
    once their checksums were read (resume.confirm): as `check_output_dir` decides where it sees that first."""
    return dataclasses.replace(decision, resume_from=None, start_afresh=True, data_commit=None, source_commits={})


def continued_record(decision: OutputDecision, output_dir: str) -> str | None:
    """The folder of the record whose data commits a run that goes on (`decision`) loads: the resumed checkpoint's own
    copy (`trained_under`), else output_dir's; None where the run starts afresh or trains nothing (data at main). The
    data stage and prefetch.py both read it, so the job fetched for is the job that runs. A checkpoint resumed into a
    folder replaced (--overwrite_output_dir, --resume_from_checkpoint from elsewhere) goes on too: its steps left are
    those of the pairs it was cut from."""
    # The job's own folder (a dry run outside the job): not made yet, its name as written no folder of the job's
    if not decision.trains or (decision.start_afresh or decision.job_folder) and not decision.resume_from:
        return None
    return str(trained_under(Path(decision.resume_from))) if decision.resume_from else output_dir


def check_named(recipe: Recipe, pairs_per_step: int | None) -> None:
    """The checks of the checkpoint --resume_from_checkpoint names, run where it is loaded: its folder (verified, in no
    other live run's folder), the settings it was trained under (the automatic resume's comparison, with the record
    it was trained under), and its steps left."""
    t = recipe.training
    out, explicit = Path(t.output_dir), t.resume_from_checkpoint
    resume.check_explicit(explicit, out)
    folder = Path(explicit)
    if changed := changed_settings(recipe, trained_under(folder), pairs_per_step):
        raise ConfigError(
            f"resume_from_checkpoint {str(folder)!r} was written by a run with other settings "
            f"({'; '.join(changed)}): rerun with its settings to resume it, or {resume.new_run_from(folder)}"
        )
    resume.check_steps_left(explicit, out, t.max_steps)  # with num_train_epochs: once the data is counted


def replaced(recipe: Recipe, pairs_per_step: int | None) -> OutputDecision:
    """`replacing` the run in output_dir. A requeue going on from its own progress past the named checkpoint skipped
    that checkpoint's checks (`resume.requeued_past`); replaced, that progress goes and the named one is loaded after
    all: checked here, else a requeue whose folder's record was edited or differs loaded it unchecked (another run's
    settings, a live run's folder)."""
    t, auto = recipe.training, recipe.project.auto_resume
    out, explicit = Path(t.output_dir), t.resume_from_checkpoint
    decision = replacing(out, explicit)
    if explicit and resume.requeued_past(explicit, out, auto):
        check_named(recipe, pairs_per_step)
    return decision


def replacing(out: Path, explicit: str | None) -> OutputDecision:
    """--overwrite_output_dir replaces the run in `out` (its own files: output_folder.replace), then the run starts
    afresh, or resumes the checkpoint it names, unless that is one of the files replaced."""
    if explicit and out.resolve() in Path(explicit).resolve().parents:
        raise ConfigError(
            f"resume_from_checkpoint {explicit!r} is in output_dir {str(out)!r}, whose run --overwrite_output_dir "
            "replaces, that checkpoint with it: copy the checkpoint out of that folder first, or pass a new "
            "--output_dir"
        )
    from dpotrain.train.tracking import offline_run_folders, offline_runs_kept_in  # as output_folder.replace

    wandb = Path(os.path.abspath(out)) / "wandb"
    if offline_run_folders(wandb) and (why := output_folder.not_movable_beside(out)):
        raise ConfigError(
            f"output_dir {str(out)!r}: the run there, which --overwrite_output_dir replaces, holds W&B offline runs "
            f"({wandb}, nowhere else until `wandb sync`), which cannot be moved aside beside it "
            f"({offline_runs_kept_in(out, '<time>')}): {why}; sync them (wandb sync {wandb}/offline-run-*) and "
            f"delete {wandb}, or move it out of the folder yourself, then run the same command again"
        )
    return OutputDecision(explicit, True)


def how_to_push(out: Path, repo: str) -> str:
    """What a command asking for a push says of the finished run in `out` it refuses to train again: the command that
    pushes it, training nothing, or that it is on `repo` already (a bare name: in the namespace the push added). Both
    ways the refusal named train it again, --overwrite_output_dir deleting the model the command meant to push."""
    on_hub = [
        r["repo"]
        for r in hub_push.read_pushes(out)
        if r.get("branch") == "main" and r["status"] in hub_push.ON_THE_HUB and r.get("repo")
        if repo in (r["repo"], r["repo"].rpartition("/")[2])
    ]
    if on_hub:
        return f"; it is on {on_hub[-1]} already ({out / hub_push.PUSH_RECORD})"
    return f"; to push it to {repo}, training nothing, run `{hub_push.push_command(out, '--repo-id', repo)}`"


def check_push_left_repo(out: Path, repo: str, given: str | None) -> None:
    """A rerun completes a cut-short final push to the repo it started on (`repo`): to another hub_model_id, a commit
    the Hub may have taken would be pushed twice, and the one given recorded nowhere, so another is refused, not
    passed over in silence. `given` without a namespace is the name the run was given (it added the token's)."""
    if given is None or given in (repo, repo.rpartition("/")[2]):
        return
    raise ConfigError(
        f"hub_model_id {given}: {out} holds a finished run whose push to {repo} was started and not confirmed, "
        f"which a rerun completes there and nowhere else: drop --hub_model_id (or pass {repo}) to complete it, or "
        f"push the run to {given} with `{hub_push.push_command(out, '--repo-id', given)}`"
    )


def push_left(recipe: Recipe) -> str | None:
    """The repo of the final push to complete, where output_dir holds a finished run whose push was started and not
    confirmed (hub_push.unconfirmed_push: a kill cut it short, it failed, or a stop request gave it up) and the command
    asks for a push without --overwrite_output_dir: the rerun completes it and trains nothing. Read from the folder's
    records alone, so train_dpo.py decides it before the checks read what the recipe names (moved away since the run
    finished); check_output_dir decides by it too. Another --hub_model_id is refused (check_push_left_repo)."""
    t, out = recipe.training, Path(recipe.training.output_dir)
    if not t.push_to_hub or recipe.project.overwrite_output_dir or not writes.exists(out / RUN_COMPLETE):
        return None
    if (left := hub_push.unconfirmed_push(out)) is None:
        return None
    repo = left_repo(left, t)
    check_push_left_repo(out, repo, t.hub_model_id)
    return repo


def left_repo(left: dict | None, training) -> str:
    """The repo of a push left unconfirmed (`left`, its record): the one it started on; a record written before pushes
    named their repo, or no push left, the command's."""
    return (left or {}).get("repo") or training.hub_model_id or training.run_name


def pushing_left(output_dir: str, repo: str) -> str:
    """What a rerun completing a finished run's push does with its folder: the dry run's line, and its summary's."""
    return (
        f"{output_dir}: a finished run whose push to {repo} was started and not confirmed: the run pushes it, and "
        "trains nothing"
    )


def finished_by_this_job(out: Path) -> str | None:
    """The Slurm job this start is a requeue of, where that job finished the run in `out` (run_complete.json names it)
    before Slurm requeued it: its node lost, or a preemption past its grace time, while the process was ending. Not
    where its final push was started and not confirmed: the requeue completes that push (`push_left`)."""
    job = run_lock.slurm_job()
    if (
        not job
        or not run_lock.slurm_restart()
        or not writes.is_file(out / RUN_COMPLETE)
        or hub_push.unconfirmed_push(out)
    ):
        return None
    fix = "a finished run writes it last: check the folder's final model, then train into a new --output_dir"
    record = run_records.read_record(out / RUN_COMPLETE, fix)
    return job if (record or {}).get("slurm_job_id") == job else None


def finished_line(output_dir: str, job: str) -> str:
    """What a requeue of the job that finished the run says, and ends with exit code 0 (no `afterok` left waiting)."""
    return f"output_dir {output_dir} holds {finished_run(job)}: nothing to do"


def finished_run(job: str) -> str:
    return f"the run this Slurm job ({job}) finished before it was requeued"


def say_untrained_settings(recipe: Recipe, out: Path, pairs_per_step: int | None) -> None:
    """The job's recipe edited since it finished its run (the next experiment's, or more steps before an `scontrol
    requeue`): the run is still this job's, but what the command now asks is not trained, which "nothing to do" alone
    left unsaid."""
    changed = []
    with contextlib.suppress(ConfigError):  # its record damaged since: nothing to compare, the job ends as before
        changed = changed_settings(recipe, out, pairs_per_step)
    if changed:
        resume._say(
            f"note: the settings differ from those of the run this job finished ({'; '.join(changed)}), and "
            "nothing is trained with them: to train them, submit a job with a new --output_dir"
        )


def resumed_into(recipe: Recipe, out: Path, named: str, pairs_per_step: int | None) -> OutputDecision:
    """`--resume_from_checkpoint` into `out`, not finished: the settings must be those of the run there too, whose
    record, metrics, final model and checkpoints the resume writes over, read as it ran (`written_record`: a hand
    edit of its record refused a resume of its own checkpoint as "other settings")."""
    explicit, replace = recipe.training.resume_from_checkpoint, recipe.project.overwrite_output_dir
    folder = written_record(out)
    other = changed_settings(recipe, folder, pairs_per_step) if folder else []
    if (other or folder is None) and replace:
        return replaced(recipe, pairs_per_step)
    if folder is None:
        raise ConfigError(
            f"output_dir {named} holds an unfinished run whose resolved_config.json was edited after the run wrote "
            f"it, and no checkpoint of it holds its copy, so the settings it ran with are not known, and resuming "
            f"{explicit} there would write over it: pass a new --output_dir, or --overwrite_output_dir to replace "
            "that run"
        )
    if other:
        raise ConfigError(
            f"output_dir {named} holds an unfinished run with other settings ({'; '.join(other)}), which resuming "
            f"{explicit} there would write over: pass a new --output_dir, or --overwrite_output_dir to replace that run"
        )
    decision = resumed(out, resume.explicit_point(explicit, out, recipe.project.auto_resume))
    if recipe.project.auto_resume:
        return decision
    past = output_folder.saved_past(out, explicit, output_folder.read_manifest(out))
    if past and (why := output_folder.not_movable_beside(out)):
        them = "it" if len(past) == 1 else "them"
        raise ConfigError(
            f"output_dir {named}: {', '.join(p.name for p in past)}, saved past {explicit}, cannot be moved aside "
            f"beside it ({output_folder.past_folder(out, explicit, '<time>')}) as --auto_resume false does: {why}; "
            f"move {them} out of the folder yourself (mv {' '.join(str(p) for p in past)} <elsewhere>), or delete "
            f"{them}, then run the same command again"
        )
    return dataclasses.replace(decision, set_aside=tuple(p.name for p in past))


def finished_refusal(recipe: Recipe) -> ConfigError | None:
    """A finished run in output_dir that the command neither replaces nor pushes, refused from the folder's records
    alone, as train_dpo.py decides `push_left` before its checks: a rerun whose final push a kill cut short, with a
    data file or model moved away since, was refused for them (`dataset ... does not exist`) and never told the
    command that pushes it, nor that the run is finished. check_output_dir refuses it alike (the dry run lists it).
    The refusal, or None where the run is not refused for it."""
    out = Path(recipe.training.output_dir)
    if recipe.job_folder or recipe.project.overwrite_output_dir:
        return None
    try:
        if not writes.exists(out / RUN_COMPLETE):
            return None
    except OSError:  # a path past the file system's limits, a look unanswered: the checks say it in their own line
        return None
    if push_left(recipe) is None:
        return _finished(recipe, f"{str(out)!r}" + (f" (a link to {out.resolve()})" if out.is_symlink() else ""))
    return None


def _finished(recipe: Recipe, named: str) -> ConfigError:
    """The refusal of a finished run's folder (`named`), with how to push it where a push is left or asked for."""
    t, out = recipe.training, Path(recipe.training.output_dir)
    left = hub_push.unconfirmed_push(out)  # a push a kill cut short (or that failed), not asked again: said how
    repo = left_repo(left, t)
    # the checkpoints given up with it (a stop request at the end of training): that command's --checkpoints
    flags = ["--repo-id", repo, *(["--checkpoints"] if hub_push.checkpoints_left(out, repo) else [])]
    how = (
        f"; its push to {repo} was started and not confirmed: rerun with --push_to_hub to complete it, or run "
        f"`{hub_push.push_command(out, *flags)}`"
        if left
        else how_to_push(out, repo)
        if t.push_to_hub
        else ""
    )
    return ConfigError(
        f"output_dir {named} already holds a finished run: pass --output_dir for a new run, or "
        f"--overwrite_output_dir to replace it{how}"
    )


def check_output_dir(recipe: Recipe, pairs_per_step: int | None = None) -> OutputDecision:
    """Resume, start afresh, or refuse: never write over a finished run by accident, never lose checkpoints (an
    unfinished run with a complete checkpoint and the same settings resumes even with --overwrite_output_dir)."""
    t, p = recipe.training, recipe.project
    out, explicit = Path(t.output_dir), t.resume_from_checkpoint
    if job := finished_by_this_job(out):  # the same command again: nothing replaced, resumed or refused
        say_untrained_settings(recipe, out, pairs_per_step)
        return OutputDecision(None, False, finished_by=job)
    # Named with its target: a link retargeted between attempts (to another run's folder) read as the user's own folder
    named = f"{str(out)!r}" + (f" (a link to {out.resolve()})" if out.is_symlink() else "")
    # A requeue going on from its own checkpoint past the named one loads nothing of it: checked only where loaded
    if explicit and not resume.requeued_past(explicit, out, p.auto_resume):
        check_named(recipe, pairs_per_step)
    if recipe.job_folder:  # the job's own, not made before the job: a new folder, holding no stopped run
        return OutputDecision(explicit, False, job_folder=True)
    # A named checkpoint is resumed into output_dir, as any: a finished run there is not written over by accident.
    if writes.exists(out / RUN_COMPLETE):  # `writes.looked`: unanswered, raised; never a finished run trained again
        if p.overwrite_output_dir:
            return replaced(recipe, pairs_per_step)
        if repo := push_left(recipe):  # train_dpo.py decides it first, before its checks; prefetch.py here
            return OutputDecision(None, False, push_left=repo)
        raise _finished(recipe, named)
    refuse_links(out)  # a run that keeps the folder's checkpoints keeps none through a link
    if explicit:
        return resumed_into(recipe, out, named, pairs_per_step)
    if resume.after_health_stop(recipe, out):
        return OutputDecision(None, True)
    latest = resume.latest_sound_checkpoint(out, refuse=p.auto_resume and not p.overwrite_output_dir)
    if latest and p.auto_resume:
        changed = changed_settings(recipe, trained_under(latest), pairs_per_step)
        if changed and p.overwrite_output_dir:
            return OutputDecision(None, True)
        if changed:
            raise ConfigError(
                f"output_dir {named} holds an unfinished run with other settings ({'; '.join(changed)}): rerun "
                "with its settings to resume it, pass a new --output_dir, or --overwrite_output_dir to start afresh"
            )
        if p.overwrite_output_dir:  # the flag's start afresh not done: said, where it resumed without a word
            resume._say(
                f"note: --overwrite_output_dir resumes {latest}, not afresh: the run in {named} has these settings, "
                "and a job requeued with the flag in its command must not lose its progress; to train again from "
                "step 1, pass a new --output_dir"
            )
        return resumed(out, str(latest))
    if own_checkpoints(out):  # a person's checkpoint-N is none of the run's (check_checkpoints_of_others)
        if p.overwrite_output_dir or resume.only_cut_short(out, changed_in_folder(recipe, out, pairs_per_step)):
            return OutputDecision(None, True)
        # Only a run with auto_resume false gets here holding a sound checkpoint: said as docs/resuming.md spells the
        # setting, with the checkpoint to name, the way that page gives to go on without the automatic resume.
        state = (
            "has no complete checkpoint: pass"
            if latest is None
            else "has checkpoints and auto_resume is false: pass --resume_from_checkpoint "
            f"{shlex.quote(str(latest))} to go on from the newest,"
        )
        raise ConfigError(f"output_dir {named} {state} --overwrite_output_dir to start afresh, or a new --output_dir")
    if (out / run_record.RESOLVED).is_file() and not p.overwrite_output_dir:  # written as its training started
        resume.say_afresh(out, t.save_strategy)
    return OutputDecision(None, False)


def count_steps(recipe: Recipe, batch: Batch, world: int, rows: int | None) -> dict:
    """Optimizer steps as the Trainer will count them: steps of pairs_per_step pairs (plan.py), on `world` ranks."""
    t, pairs = recipe.training, batch.pairs_per_step
    plan = {"pairs_per_step": pairs, "dataset_rows": rows, "total_steps": None, "warmup_steps": None}
    if t.max_steps > 0:
        total = t.max_steps
    elif rows is not None:
        total = math.ceil(t.num_train_epochs * len(steps_of(np.arange(rows), pairs, world)))
    else:
        return plan
    return plan | {"total_steps": total, "warmup_steps": t.get_warmup_steps(total)}


def check_resumed_ranks(folder: str | None, training, pairs_per_step: int, ranks: int, rows: int | None) -> None:
    """A checkpoint resumed on another number of data-parallel ranks: the steps are the same pairs on any number
    (`steps_of`), except that an epoch's last step of fewer pairs than ranks joins the one before it. Where that makes
    the epoch another number of steps (40 pairs of 3 a step: 13 steps on 3 ranks, 14 on one), the resumed run went on
    in silence with other pairs past that point and another learning-rate schedule: refused, unless the run ends
    before they differ. `training`: the recipe's TrainingArguments."""
    if folder is None or rows is None:
        return
    old = trained_record(folder)
    was = old.launch.data_parallel_size if old is not None else None
    if was is None or was == ranks:
        return
    kept = kept_pairs(folder, rows)  # the epoch is cut from the pairs training keeps, not the rows
    then, now = (len(steps_of(np.arange(kept), pairs_per_step, n)) for n in (was, ranks))
    total = training.max_steps if training.max_steps > 0 else math.ceil(training.num_train_epochs * now)
    if then != now and total >= min(then, now):
        dropped = f" it trains (of {rows} rows: {rows - kept} dropped at max_length)" if kept != rows else ""
        raise ConfigError(
            f"checkpoint {folder!r} was trained on {plural(was, 'data-parallel process')}, where the "
            f"{plural(kept, 'pair')}{dropped} make {plural(then, 'step')} an epoch, and on {ranks} they make {now} (a "
            "last step of fewer pairs than processes joins the one before it): the steps past it would train other "
            f"pairs, on another learning-rate schedule; resume it on {plural(was, 'process')}, or "
            f"{resume.new_run_from(folder)}"
        )


def check_epochs_left(folder: str | None, recipe: Recipe, batch: Batch, data_parallel: int, rows: int) -> None:
    """Under num_train_epochs, a checkpoint of another run saved at this run's last step, counted on the pairs its run
    kept (`resume.check_steps_left`). Every rank reads the checkpoint's record and counts its own copy of the data
    inside one gather (`collectives.every_rank`, the data stage): each rank raised alone, the refusal said once per
    rank, and a rank refused alone left the others in their next collective."""
    total = count_steps(recipe, batch, data_parallel, kept_pairs(folder, rows))["total_steps"]
    resume.check_steps_left(folder, Path(recipe.training.output_dir), total)


def kept_pairs(folder: str | None, rows: int) -> int:
    """The pairs the run of checkpoint `folder` trained on, as its plan recorded them (`pairs_trained.of`: under
    keep_start TRL drops a pair whose prompt alone fills max_length). A resume has the same max_length, data and
    tokenizer (RESUME_FIELDS), so they are this run's too, known before the data is tokenized; else the rows."""
    if folder is None:
        return rows
    old = trained_record(folder)
    return (old.batching.pairs_trained or {}).get("of", rows) if old is not None else rows


def planned_steps(recipe: Recipe, steps: dict, batching: dict) -> dict:
    """`count_steps`' numbers on the pairs training keeps (`batching`, the plan's summary): a data set's rows can make
    more steps than the run trains (`kept_pairs`), and a warm-up ratio more warm-up steps than its schedule has."""
    total = batching["pairs_trained"]["steps"]
    return steps | {"total_steps": total, "warmup_steps": recipe.training.get_warmup_steps(total)}


def resolved_config(recipe: Recipe, derived: dict) -> dict:
    """Every field by its own name (tokens redacted by `TrainingArguments.to_dict`), plus the derived numbers."""
    resolved = {**asdict(recipe.script), **asdict(recipe.model), **asdict(recipe.project), **recipe.training.to_dict()}
    resolved["pad_token"] = recipe.training.pad_token  # to_dict hides every `*_token` field; only hub_token is secret
    del resolved["dry_run"], resolved["json"]  # how a dry run prints, not a setting of the run
    if recipe.max_length_auto:  # the analyzer's choice (derived.max_length says how it was made), or "auto"
        resolved["max_length"] = derived.get("max_length", {}).get("max_length", "auto")
    if recipe.project.max_tokens_per_microbatch is not None:
        # Micro-batches are cut by tokens: neither is fixed (derived.batching once the trainer has planned them).
        resolved["per_device_train_batch_size"] = resolved["gradient_accumulation_steps"] = None
    if "micro_batches_per_step" in derived.get("batching", {}):  # the plan's micro-batches per step are the truth
        per_step = derived["batching"]["micro_batches_per_step"]
        resolved["gradient_accumulation_steps"] = per_step["min"] if per_step["min"] == per_step["max"] else None
    resolved["config"] = recipe.config_path
    if recipe.replaced_batching:  # batch flags replaced the recipe's pairs per step: said where people look
        derived = {**derived, "recipe_batching_replaced": recipe.replaced_batching}
    resolved["derived"] = derived
    return resolved

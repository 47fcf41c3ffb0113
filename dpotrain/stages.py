"""The run's first half: checks -> data -> lengths -> forward -> plan -> memory, each stage a value the next takes.

A dry run is this first half alone, before a model weight loads, its launch planned from the recipe's accelerate
config and local files only (what needs the Hub is recorded as decided at start, with the command that decides it now).
"""

import copy
import functools
import json
import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import transformers

from dpotrain import options, output_folder, resolve
from dpotrain.cluster import collectives, engine, offline, run_lock, sequence_parallel
from dpotrain.data import (
    builtin,
    chat_template,
    cuts,
    data,
    data_identity,
    hub_revision,
    lengths,
    mixture,
    positions,
    rows,
    stops,
    turns,
)
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import choice, cost, sample
from dpotrain.forwards.packing import positions_cap
from dpotrain.hub import hub, hub_push
from dpotrain.plan import layers, memory, plan, plan_stage
from dpotrain.recipe import config, launcher, records, venv
from dpotrain.recipe.config import uses_live_reference
from dpotrain.recipe.errors import ConfigError, RunError, cause, warn
from dpotrain.recipe.run_record import MemoryPlan
from dpotrain.reference import reference
from dpotrain.train import agreement, health, lora, metrics, preemption, resume, samples, weight_names
from dpotrain.train.preemption import StoppedBeforeTraining
from dpotrain.train.resume import check_partitions

FA4_SETS = {"with FlashAttention 4 installed": "flash_attention_4", "without": None}  # a dry run for a GPU job

# The analyzer's flags that change what it measures (the revision too: its lengths are cached per commit; a mixture's
# rows are drawn by the seed; assistant_turns splits each pair; the model's revision and own code give the tokenizer)
# or the cuts its report ends with (max_length, mode)
ANALYZER_FIELDS = """
    model_name_or_path model_revision trust_remote_code dataset_name dataset_train_split dataset_config dataset_revision
    hh_format auto_coverage
    chat_template_path dataset_mixer_list dataset_mixer_list_splits seed assistant_turns max_length truncation_mode
    dataset_mixer_eval_list dataset_mixer_eval_list_splits eval_datasets eval_strategy eval_steps datasets
""".split()


def analyze_command(recipe) -> str:
    """The analyzer's command that measures what this run will train: the recipe, and the command line's overrides
    (a mixture, `--datasets` too, its seed and assistant_turns among them: without them it measured the recipe's data
    set)."""
    words = ["python", venv.project_file("scripts/analyze_dataset.py")]
    words += ["--config", recipe.config_path] if recipe.config_path else []
    values = {**vars(recipe.training), **vars(recipe.script), **vars(recipe.model), **vars(recipe.project)}
    values["max_length"] = "auto" if recipe.max_length_auto else values["max_length"]
    changed = config.fields_set(recipe.command_line)
    for name in ANALYZER_FIELDS:
        if name in changed and values[name] is not None:
            value = getattr(values[name], "value", values[name])  # eval_strategy's enum: its word
            words += [f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return shlex.join(words)


def analyze_hint(recipe) -> str:
    """How to see now what the run decides from the token lengths: the analyzer's command, then the dry run again."""
    model = recipe.model.model_name_or_path or ""
    if lengths.holds_no_tokenizer(model):
        return f"{model} holds no tokenizer to measure them with: dry-run your own model to see them now"
    return f"to see it now: {analyze_command(recipe)}, then this dry run again"


# --- checks -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """The processes and engine of the run (a dry run: its launch's), and the machines the forward is decided for."""

    world: int
    world_source: str
    engine: engine.Engine
    machines: dict  # name -> (CUDA, the varlen FlashAttention installed)
    dry_run: bool  # the launch is planned (`--dry-run`), not running
    sequence_parallel: int = 1  # processes per group that split each micro-batch's sequence (sequence_parallel.py)
    clipping: dict | None = None  # the gradient clipping in effect on this engine (`engine.gradient_clipping`)
    batch: resolve.Batch | None = None  # pairs per step for these processes, and the accumulation that gives it

    @property
    def data_parallel(self) -> int:
        """The processes that read their own data: what pairs and steps count."""
        return sequence_parallel.data_parallel_size(self.world, self.sequence_parallel)

    def record(self) -> dict:
        return {
            "world_size": self.world,
            "world_size_source": self.world_source,
            "data_parallel_size": self.data_parallel,
            "gradient_clipping": self.clipping,
        }


def decide_launch(recipe) -> Launch:
    """The world size, decided once per run, and the engine; an engine this project does not support is refused."""
    run_engine = engine.launched()
    dry_run = recipe.project.dry_run
    # A dry run plans the recipe's accelerate config, not the launch it is in, except the one process accelerate's
    # simple launcher started, which runs one process without an engine whatever that config says
    from_config = dry_run and not preemption.simple_launch()
    planned = engine.from_config(recipe.project.accelerate_config) if from_config else run_engine
    world, source = resolve.world_size(recipe, planning=dry_run, planned=planned)
    if dry_run:  # a config that launches one process per node, planned for more (engine.one_per_node)
        planned = engine.one_per_node(planned, world, recipe.project.accelerate_config)
    cuda, t = torch.cuda.is_available(), recipe.training
    if cuda and not t.use_cpu:  # before the process group: two ranks on one GPU fail only at NCCL's first collective
        engine.check_processes_per_node(run_engine.gpus_per_node, torch.cuda.device_count())
    gpu_job = bool(recipe.project.gpu_memory_gib) or ((t.bf16 or t.fp16) and not t.use_cpu)
    planned = engine.as_it_runs(planned, world, on_gpus=(cuda and not t.use_cpu) or (dry_run and gpu_job))
    if dry_run and not cuda and gpu_job:  # a login node planning a GPU job: with and without FA4
        machines = {name: (True, varlen) for name, varlen in FA4_SETS.items()}
    else:
        machines = {"on this machine": (cuda, choice.installed_varlen(cuda))}
    n = recipe.project.sequence_parallel_size
    sequence_parallel.check_launch(n, world, planned)  # N divides the processes, on DeepSpeed's engine
    clipping = engine.gradient_clipping(recipe.training.max_grad_norm, planned)  # its DeepSpeed config agrees
    engine.check_mixed_precision(recipe.training, planned)
    engine.check_deepspeed_settings(recipe.training, world, planned)  # what DeepSpeed would run in the recipe's place
    engine.check_offloaded_optimizer(recipe.training, planned)
    engine.check_ddp_settings(recipe.training, planned)
    engine.check_half_weights(recipe, planned)
    batch = resolve.decide_batch(recipe, sequence_parallel.data_parallel_size(world, n))
    return Launch(world, source, planned, machines, dry_run, n, clipping, batch)


def checks(recipe) -> Launch:
    """Everything that can be refused from the recipe alone, the same in a run and a dry run, before anything loads."""
    options.check_path_limits(recipe)  # before the first call that touches a path
    resolve.check_values(recipe)
    health.check_values(recipe.project)
    samples.check_values(recipe.project)
    options.check_options(recipe)  # options TRL would fail on, or ignore, only after loading the model
    lora.check_lora(recipe)
    return decide_launch(recipe)


def data_folders(recipe) -> list[str]:
    """The folders a run may read whole as data: the data set's, and each mixture source's without data_files."""
    values = mixture.fields_of(recipe)
    whole = [s for evaluation in (False, True) for s in mixture.parse(values, evaluation) or [] if not s.data_files]
    folders = [s.data_dir if s.path in mixture.BUILDERS else os.path.join(s.path, s.data_dir or "") for s in whole]
    return [name for name in (recipe.script.dataset_name, *folders) if name]


def check_histories(output_dir: str) -> None:
    """The records a resume trims (metrics.jsonl, samples.jsonl), read now: a line changed by hand is refused before
    the model loads. One the run's manifest does not name is a person's, moved aside, never read."""
    own = output_folder.read_manifest(Path(output_dir))
    for name in [n for n in (metrics.METRICS_FILE, samples.SAMPLES_FILE) if own is None or n in own]:
        try:
            records.read(Path(output_dir) / name, step=True)
        except RunError as e:
            raise ConfigError(str(e)) from None
    # hub_pushes.jsonl too, which the checkpoint pusher reads as it is built: a line changed by hand was refused there,
    # on the main process alone while the other ranks loaded the model. One unread now (ESTALE) the pusher warns of.
    if own is None or hub_push.PUSH_RECORD in own:
        try:
            hub_push.read_pushes(output_dir)
        except RunError as e:
            raise ConfigError(str(e)) from None
        except OSError:
            pass


def output_checks(recipe, launch: Launch, push) -> tuple[resolve.OutputDecision, object]:
    """The run's outputs (reference cache, push token, W&B, output folder, offline files); a dry run lists refusals.
    Returns the decision, and the push with its repo named as the Hub confirmed it (`claim_repo`), `push` unchanged."""
    training, only_reference = recipe.training, recipe.project.reference_only
    # An engine the run refuses at its start (FSDP1, ZeRO-1, ...): a dry run lists it
    refusals = [launch.engine.refused] if launch.dry_run and launch.engine.refused else []

    def check(step, *args, **kwargs):
        try:
            return step(*args, **kwargs)
        except ConfigError as refused:
            if not launch.dry_run:
                raise
            refusals.append(str(refused))

    # The ranks have met: the first rank to meet a refusal writes it alone. `when` (a rank's own decision) skips the
    # work, never the gather: a rank that skipped it would wait in the next collective until the timeout.
    def once(step, *args, when=True, **kwargs):
        return check(collectives.every_rank, _only_if, when, step, *args, **kwargs)

    folder_refused = False
    if not only_reference:  # a file, or a folder of files but no run: refused (output_folder.py); a held lock too
        check(output_folder.check_reads_outside, recipe)  # first: nothing a run reads may be one of its own files
        patterns = mixture.patterns(mixture.fields_of(recipe))  # a data_files glob, which its own files may match
        output_folder.check_outside_data(training.output_dir, data_folders(recipe), patterns)  # the dry run's JSON too
        listed = len(refusals)
        check(output_folder.check, training.output_dir, not launch.dry_run)
        # A dry run goes on past a refusal, but reads nothing inside a folder refused (a file: NotADirectoryError)
        folder_refused = len(refusals) > listed
        if launch.dry_run and not folder_refused:
            # A live run's folder: planned as the run will find it once that run ends, and its refusal listed. Unlisted,
            # the dry run said "the run resumes from checkpoint-N", and a job's dry run let every node start its
            # processes, to be refused by the lock there
            check(run_lock.check_free, Path(training.output_dir))
    if not uses_live_reference(recipe):
        reference.check_writable()  # the reference stage saves as it goes
    check(options.check_modules_cache, recipe)  # before the first half loads the model's config (its own code)
    said = len(refusals)
    check(lengths.check_tokenizer_folder, recipe.model.model_name_or_path or "")  # configs/models/*: a shape only
    if launch.dry_run and len(refusals) == said:  # a folder with its tokenizer, its weights not yet copied beside
        check(options.check_weights, recipe.model.model_name_or_path or "")  # the run's refusal, before the model loads
    decision = resolve.OutputDecision(None, False)
    if not only_reference:
        # Every rank reads the same environment and files, after the ranks met: written once, by the first rank
        check(collectives.every_rank, push.check_token)
        check(collectives.every_rank, options.check_wandb, recipe)
        if not launch.dry_run:  # asked by the process that logs to W&B; its refusal is every rank's
            collectives.main_outcome(options.check_wandb_reachable, recipe)
        if not folder_refused:  # the W&B run's check reads before the replaced run's files go (output_folder.replace)
            decision = once(resolve.check_output_dir, recipe, launch.batch.pairs_per_step) or resolve.UNDECIDED
            once(options.check_wandb_run_replaced, recipe, when=decision.start_afresh)
        resuming = bool(decision.resume_from and not decision.start_afresh)
        once(check_histories, training.output_dir, when=resuming)  # the histories it trims, read before the model loads
        # Once per run that trains (completing a cut push must not create a repo); the main's answer is every rank's
        if push.requested and not launch.dry_run:  # every rank joins: the main's decision is the one that counts
            claimed = collectives.main_outcome(_only_if, decision.trains, claim_repo, push)
            push = replace(push, repo_id=claimed or push.repo_id)  # None: a run that trains nothing claims none
    recorded = resolve.continued_record(decision, training.output_dir)  # prefetch.py fetches by it too
    kept = hub_revision.kept(recipe, recorded) if recorded else None
    sources = mixture.kept(recipe, recorded) if recorded else {}  # a mixture's Hub sources at its record's commits
    draws = mixture.drawn_by(recipe, recorded) if recorded else {}  # the rows it started on
    said = [(recipe.script.dataset_name, " (dataset_revision)", kept)] if kept else []
    said += [(f"mixture source {repo}", "", commit) for repo, commit in sorted(sources.items())]
    for name, why, commit in said if launcher.launched_main() else []:
        print(f"Resuming on {name}: commit {commit[:12]}, the one this run started on{why}", flush=True)
    # The engine, processes and precision that wrote it: the main process's answer, said once; a dry run lists it
    check(collectives.main_outcome, check_partitions, decision.resume_from, launch.world, launch.engine, training.bf16)
    once(resume.check_live_reference, decision.resume_from, recipe)
    if not folder_refused:
        once(output_folder.check_replaceable, training.output_dir, decision.start_afresh)
    if not only_reference and not folder_refused:
        found, steps = decision.resume_from, training.max_steps
        once(output_folder.check_checkpoints_of_others, training.output_dir, found, steps, when=decision.trains)
    # With HF_HUB_OFFLINE: model, tokenizer and data set cached (a resumed run's at its recorded commits). A dry run
    # lists a model cached in part, which nothing completes offline (one not cached at all it plans without).
    resumed_in = training.output_dir if kept or sources else None
    once(offline.check_offline_artifacts, recipe, output_dir=resumed_in, in_part=launch.dry_run)
    once(offline.check_hub_cache, recipe)  # online: what is not cached is downloaded there
    found = {"data_commit": kept, "source_commits": sources, "source_draws": draws}
    return replace(decision, would_refuse=tuple(refusals), **found), push


def _only_if(condition: bool, work, *args, **kwargs):
    """`work(*args, **kwargs)` where `condition` holds, else None: a rank's own decision, inside a collective that
    every rank joins whatever it decided."""
    return work(*args, **kwargs) if condition else None


def claim_repo(push) -> str:
    """The push's repo with its namespace, once the Hub says this token may write there (a new repo: may create it)."""
    repo_id = hub.check_write_access(push.repo_id, push.token, base=push.base)
    hub.create_at_start(repo_id, push.token, push.private)
    return repo_id


# --- data -------------------------------------------------------------------------------------------------------------
def _note_also_trained(values: dict, say: bool) -> None:
    """The note that held-out pairs are also trained on, by the main process (`say`), once a job: its eval loss is
    not a held-out one."""
    for spec in mixture.also_trained(values) if say else []:
        print(
            f"note: the held-out pairs of {spec} are pairs this run also trains on: their eval loss measures "
            "pairs the model has seen, not how it does on new ones (held-out pairs of their own: "
            "--dataset_mixer_eval_list FILE 1.0)",
            flush=True,
        )


@dataclass(frozen=True)
class Data:
    """The training (and held-out) pairs, checked row by row, and the optimizer steps they make."""

    train: object | None  # None where a dry run does not load the data set (on the Hub)
    eval: object | None
    steps: dict  # resolve.count_steps: pairs_per_step, dataset_rows, total_steps, warmup_steps
    checked: dict = field(default_factory=dict)  # invalid_rows, invalid_eval_rows, eval_rows, data_sources
    mix: mixture.Mix | None = None  # the training mixture's sources, and the source of each pair
    revision: str | None = None  # the data set's revision as loaded: a Hub data set's commit (`pin_data`)
    dataset_id: str | None = None  # what the analyzer's cache of these pairs is keyed by (`_read_identity`)
    tokenizer: "ModelTokenizer | None" = None  # the one the rows were checked against, for the lengths stage
    eval_mix: mixture.Mix | None = None  # the held-out mixture's sources, and the source of each held-out pair

    def record(self) -> dict:
        return {**self.checked, **self.steps}


def load_data(
    recipe,
    launch: Launch,
    say: bool = True,
    output: resolve.OutputDecision | None = None,
    stop_point=None,
    stop_asked=None,
) -> Data:
    """The data set (or a mixture's sources) loaded and every row checked before a model loads. A dry run leaves a
    Hub data set for the run, but reads a mixture's. `output`: a continued run loads the commit it started on.
    `stop_point`, `stop_asked`: `first_half`'s, the reads stopped as they run (`_read_stoppably`)."""
    script, p = recipe.script, recipe.project
    revision = (output.data_commit if output is not None else None) or p.dataset_revision
    values = mixture.fields_of(recipe)
    mixed = mixture.given(values)
    if launch.dry_run and not mixed and not data.is_local(script.dataset_name):
        steps = resolve.count_steps(recipe, launch.batch, launch.data_parallel, None)
        _note_also_trained(values, say and recipe.training.eval_strategy != "no")  # the run's note, its data unread
        return Data(None, None, steps, revision=revision)
    # A continued run's commits, from its record (output_checks); the prefetch command named gives the run's folder
    kept = output.source_commits if output is not None else None
    recorded = output is not None and output.data_commit is not None
    resumed_in = recipe.training.output_dir if kept or recorded else None
    if not launch.dry_run or mixed:  # a dry run reads a mixture's Hub sources: the run's checks of them first
        offline.check_job_reachable(recipe, model=False, output_dir=resumed_in)  # the Hub must answer, within seconds
    if launch.dry_run and mixed:  # offline, an uncached source: the run's refusal, not datasets' OfflineModeIsEnabled
        offline.check_offline_artifacts(recipe, model=False, output_dir=resumed_in)  # with the prefetch command
    checked: dict = {}
    identify = say and not launch.dry_run  # the content, recorded: a rerun on changed data refuses to resume
    template = ModelTokenizer(recipe, launch)  # loaded where message pairs' answers are checked
    rules = rows.RowRules.of(recipe, template, say=say)  # the training pairs'; the held-out's with evaluation=True
    # A mixture's Hub sources' commits (mixture.pin), training and held-out (a held-out mixture beside dataset_name
    # too); a continued run's: its record's
    pins = pin_sources(recipe, kept) if mixed or mixture.given(values, evaluation=True) else None
    fetch = offline.prefetch_command(recipe, resumed_in)  # named where the copy read is not the commit the run reads
    if mixed:
        revision = None
    elif not launch.dry_run:
        revision = pin_data(recipe, revision)
    drawn = output.source_draws if output is not None else None  # a continued run's rows: drawn as it started
    before = _read_identity(recipe, launch, revision, pins=pins, drawn=drawn)
    read = (revision, checked, identify, pins, fetch, recorded)
    trained: set = set()  # the training pairs' digests: held-out pairs among them are said (rows.say_repeats)
    stop = (stop_point, stop_asked)
    dataset, mix = _read_stoppably(*stop, _load_pairs, recipe, rules, *read, trained=trained, drawn=drawn)
    # The files' content recorded before the look after the read, which refuses a file changed since the look before:
    # hashed after the held-out pairs' read, a file changed meanwhile was recorded as the pairs trained on, and a
    # resume went on with it (a mixture's sources are hashed as each is read, in `mixture.load`)
    found = mixture.data_identity_of(recipe) if identify and not mixed else None
    dataset_id = _read_identity(recipe, launch, revision, before, pins, drawn)
    eval_dataset, eval_mix = None, None
    if recipe.training.eval_strategy != "no":  # the held-out pairs: a held-out mixture, else the test split
        held = replace(rules, evaluation=True)
        eval_dataset, eval_mix = _read_stoppably(*stop, _load_pairs, recipe, held, *read, trained=trained, drawn=drawn)
        checked["eval_rows"] = len(eval_dataset)
        collectives.every_rank(check_held_out_pairs, dataset, eval_dataset, launch.data_parallel)  # said once
        _note_also_trained(values, say)
    steps = resolve.count_steps(recipe, launch.batch, launch.data_parallel, len(dataset))
    if identify and not mixed:
        checked["data_identity"] = found or hub_revision.identity(revision)  # the files read, not all their folder's
        # The test split's files where the training split's leave them out (a saved DatasetDict's own folder; a folder
        # of split files is recorded whole): a resume compares them (mixture.held_out_changed)
        test = eval_dataset is not None and not mixture.given(values, evaluation=True)
        held = data_identity.files(script.dataset_name, script.dataset_test_split) if test else None
        if held and not set(held) <= set(found or {}):
            checked["eval_identity"] = data_identity.of_files(held)
    collectives.every_rank(check_steps, steps, recipe.training, launch.data_parallel)  # each its own copy of the data
    if output is not None:  # a checkpoint of another number of ranks, whose epochs they would cut otherwise
        # One gather, said once: the rows are each rank's own copy's where the record lacks the pairs its run kept
        resumed, pairs, ranks = output.resume_from, launch.batch.pairs_per_step, launch.data_parallel
        collectives.every_rank(resolve.check_resumed_ranks, resumed, recipe.training, pairs, ranks, len(dataset))
        if recipe.training.max_steps <= 0:  # epochs: steps of the pairs the checkpoint's run kept
            collectives.every_rank(resolve.check_epochs_left, resumed, recipe, launch.batch, ranks, len(dataset))
    return Data(dataset, eval_dataset, steps, checked, mix, revision, dataset_id, template, eval_mix)


def _read_stoppably(stop_point, stop_asked, read, *args, **kwargs):
    """`read(*args, **kwargs)` (`_load_pairs`), stopped as it checks and reads the pairs once `stop_asked()`
    (`stops.stoppable`): on a large split they take minutes, and a stop waited for them, past a Slurm GraceTime. Every
    rank then takes a stop point, stopped or not (a rank stopped alone would leave the others in the data stage's next
    collective): the run ends there on every rank where one asked."""
    try:
        with stops.stoppable(stop_asked):
            pairs = read(*args, **kwargs)
    except stops.PassStopped:
        _stop_at(stop_point)  # this rank asked: every rank stops here
        raise
    _stop_at(stop_point)
    return pairs


def check_held_out_pairs(train, held, data_parallel: int) -> None:
    """The held-out pairs, one per rank at least and of the training pairs' kind; every rank checks its own copy of
    both inside one gather (`collectives.every_rank`): a node whose copy differs is refused alone, said once."""
    plan.check_eval_split(len(held), data_parallel)
    # Read as the training pairs are, chat template or none: else their loss is of another input
    kinds = [isinstance(d[0]["chosen"], list) if len(d) else None for d in (train, held)]
    if None not in kinds and kinds[0] != kinds[1]:
        name = {True: "message lists", False: "plain text"}
        raise ConfigError(
            f"the held-out pairs are {name[kinds[1]]} and the training pairs {name[kinds[0]]}: a run applies the chat "
            "template to all its pairs or to none; write the held-out pairs in the training pairs' shape (docs/data.md)"
        )


def _read_identity(
    recipe, launch: Launch, revision: str | None, before: str | None = None, pins=None, drawn=None
) -> str | None:
    """The training data's identity (None: unknown), read before and after the rows: a file being written is refused.
    A Hub data set is known by the commit it is read at (`revision`, a mixture's `pins`), the same both times; a
    continued mixture by what drew its rows (`drawn`, mixture.drawn_by)."""
    try:
        now = mixture.dataset_id(recipe, local_only=launch.dry_run, revision=revision, pins=pins, drawn=drawn)
    except (OSError, ValueError):
        return None
    if before is not None and now != before:
        name = "a source of the mixture" if now.startswith("mixture:") else recipe.script.dataset_name
        raise ConfigError(
            f"the training data ({name}) changed while the run read it (rows still being written?): start the run "
            "once the data set is complete"
        )
    return now


def _load_pairs(
    recipe,
    rules: rows.RowRules,
    revision,
    checked: dict,
    identify,
    pins,
    fetch: str,
    recorded=False,
    trained=None,
    drawn=None,
):
    """The training (or, where `rules.evaluation`, held-out) pairs, invalid rows counted in `checked`: a mixture's, else
    dataset_name's split. `fetch`: the prefetch command, named where the copy read offline is not the commit the run
    reads; `recorded`: `revision` is the commit the run's record holds (`fetch` names the run's folder); `trained`:
    the training pairs' digests (`rows.usable_pairs`; a mixture's sources say their own repeats alone); `drawn`: a
    continued mixture's sources' draws (`mixture.drawn_by`)."""
    s, evaluation = recipe.script, rules.evaluation
    key = "invalid_eval_rows" if evaluation else "invalid_rows"
    sources = mixture.parse(mixture.fields_of(recipe), evaluation)
    if sources is not None:
        given = {"identify": identify, "pins": pins, "prefetch": fetch, "drawn": drawn}
        dataset, mix = mixture.load(sources, recipe.training.seed, rules, checked, key, **given)
        checked["eval_sources" if evaluation else "data_sources"] = mix.records
        return dataset, mix
    name, split = s.dataset_name, s.dataset_test_split if evaluation else s.dataset_train_split
    flag = "--dataset_test_split" if evaluation else "--dataset_train_split"
    dataset = data.load_preference_dataset(name, split, s.dataset_config, revision, say=rules.say, split_flag=flag)
    hub_revision.check_loaded(dataset, name, revision, fetch, evaluation=evaluation, recorded=recorded)
    return rows.usable_pairs(dataset, rules, checked, key, split=split, source=name, trained=trained), None


class ModelTokenizer:
    """The model's tokenizer, loaded once on first use: the data stage checks answers with it, the lengths stage
    measures with it. Called, it gives the tokenizer, or None where a dry run cannot load it (`loaded` says why)."""

    def __init__(self, recipe, launch: Launch):
        self.recipe, self.launch = recipe, launch
        self.built = None  # a built-in model's tokenizer as built before its folder existed (`model_files` saves it)

    @functools.cached_property
    def source(self) -> str | None:
        """The model's name or folder; a built-in model's folder once built, else None (only its tokenizer built)."""
        name = self.recipe.model.model_name_or_path
        if not builtin.is_builtin(name):
            return name
        builtin.check_name(name)
        return builtin.existing_model_dir(name)

    @functools.cached_property
    def loaded(self) -> tuple[object | None, str | None]:
        """`_tokenizer`'s (tokenizer, why it could not be read)."""
        if self.source is None:
            self.built = builtin.build_tokenizer()
            return chat_template.apply(self.built, self.recipe.project.chat_template_path), None
        if not self.launch.dry_run and not builtin.is_builtin(self.recipe.model.model_name_or_path):
            offline.check_job_reachable(self.recipe, dataset=False)
        return _tokenizer(self.recipe, self.source, local_only=self.launch.dry_run)

    def __call__(self):
        return self.loaded[0]

    def saved_in(self, path: str) -> None:
        """The built-in model's folder now holds the tokenizer built here: named by it (the analyzer's cache key)."""
        if self.built is not None:
            self.built.name_or_path = self.source = path

    @property
    def unread(self) -> str:
        """Why it is None (a dry run's: the data line says the answers were not checked, and why)."""
        return chat_template.unread_text(self.loaded[1])


def pin_data(recipe, revision: str | None) -> str | None:
    """A single Hub data set's revision resolved to the commit every rank loads, once, by the main process."""
    name = recipe.script.dataset_name
    if not hub_revision.applies(name):
        return revision
    # Its refusal (a data set the Hub does not have, a revision it lacks) ends every rank, not the main's alone.
    return collectives.main_outcome(hub_revision.resolve, name, revision)


def pin_sources(recipe, kept: dict | None = None) -> dict[str, str]:
    """A mixture's Hub sources (training and held-out) resolved to the commits every rank reads, once, by the main
    process (`mixture.pin`); `kept`: a continued run's, from its record (`mixture.kept`), the main's taken."""
    values = mixture.fields_of(recipe)
    splits = (False, True) if recipe.training.eval_strategy != "no" else (False,)  # training's, and held-out's
    sources = [s for evaluation in splits for s in mixture.parse(values, evaluation) or []]
    return collectives.main_outcome(mixture.pin, sources, kept)


def model_files(recipe, launch: Launch, tokenizer: ModelTokenizer | None = None) -> str:
    """Where the model's files are: a built-in model materialized here (with `tokenizer`'s), else its folder or name."""
    if not launch.dry_run:
        offline.check_job_reachable(recipe, dataset=False)  # the model's files next (tokenizer first): rows checked
    name = recipe.model.model_name_or_path
    if not builtin.is_builtin(name):
        return name
    path = builtin.materialize_model(name, tokenizer and tokenizer.built)
    if tokenizer is not None:
        tokenizer.saved_in(path)
    return path


# --- lengths ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lengths:
    """The pairs' token lengths: what the forward is decided from, and every pair's when the analyzer measured them."""

    auto: dict | None  # derived.max_length under `max_length: auto`
    pairs: cost.TokenCounts | None  # the analyzer's lengths of the whole split, else a seeded sample
    measured: tuple | None  # (Measured, report path): every pair's, as the analyzer measured them
    tokenizer: object | None  # the recipe's, as loaded: the build gives the trainer a copy (train_stage.py)
    sources: list | None = None  # a mixture's data_sources, each with its share of the tokens
    template: dict | None = None  # the chat template tokenized with (chat_template.record): a resume compares it
    max_length: int | None = None  # the run's: the recipe's, or under `max_length: auto` the analyzer's choice
    positions: int | None = None  # the model's (`positions.model_limit`), where max_length is known or auto
    given_by: str | None = None  # not `auto`: whose max_length (the recipe's, the command line's, TRL's default)
    every: object | None = None  # lengths.Measured of every pair, where measured: each is tokenized once per first half
    # `lengths.NO_BOS`, `lengths.UNOPENED`: what the template does to the pairs, said by the summary, not recorded
    warnings: tuple[str, ...] = ()

    def record(self) -> dict:
        named = {"max_length": self.auto, "data_sources": self.sources, "chat_template": self.template}
        named["max_length_given_by"] = self.given_by if self.auto is None else None  # a null's too: whose it was
        return {key: value for key, value in named.items() if value is not None}


def _tokenizer(recipe, model_path: str, local_only: bool) -> tuple[object | None, str | None]:
    """(tokenizer, None); in a dry run (None, why) where it cannot be loaded here (why: None where it is not here)."""
    lengths.check_sentencepiece(model_path)  # on this machine: the dry run says it too
    try:
        return lengths.recipe_tokenizer(recipe, model_path, local_files_only=local_only), None
    except (ConfigError, OSError, ValueError) as e:
        if local_only:  # a dry run: not on this machine, or a folder without one (configs/models/*: the checks list it)
            here = Path(model_path).is_dir() and not lengths.holds_no_tokenizer(model_path)
            return None, cause(e) if here else None
        if isinstance(e, ConfigError):
            raise
        if any((Path(model_path) / name).is_file() for name in lengths.TOKENIZER_FILES):  # e.g. config.json cut off
            raise ConfigError(
                f"could not read the tokenizer of {model_path!r} ({cause(e, 200)}): its files are here, but one cannot "
                "be read (cut off while it was written or copied?): copy the model's folder again, or download it "
                "again (hf download)"
            ) from None
        raise ConfigError(
            f"could not load the tokenizer of {model_path!r} ({cause(e, 200)}): a model folder needs its "
            "tokenizer files (tokenizer.json, tokenizer_config.json) beside config.json"
        ) from None


def check_pad_token(pad_token: str | None, tokenizer) -> None:
    """A recipe's `pad_token` must be a token of the tokenizer: TRL raised only once the model had loaded."""
    if pad_token and pad_token not in tokenizer.get_vocab():
        raise ConfigError(
            f"pad_token {pad_token!r} is not a token of the tokenizer of {tokenizer.name_or_path}: give one of its "
            f"tokens (e.g. its EOS token {tokenizer.eos_token!r}), or leave pad_token out (the tokenizer's own pad "
            "token, else its EOS token)"
        )


def check_pads(pad_token: str | None, tokenizer) -> None:
    """Without a recipe's `pad_token`, the tokenizer's pad or EOS token: TRL raised only once the model had loaded.
    After the pairs' checks: plain text's says more of a missing EOS."""
    if not pad_token and tokenizer.pad_token is None and tokenizer.eos_token is None:
        raise ConfigError(
            f"the tokenizer of {tokenizer.name_or_path} has neither a pad token nor an EOS token, one of which the "
            "trainer pads with: give --pad_token, one of its tokens (which one does not matter: padding is masked by "
            "length), or set pad_token in its tokenizer_config.json"
        )


def _analyzer_cache(
    recipe, launch: Launch, tokenizer, pairs: Data, positions, stop_asked=None
) -> tuple[tuple | None, dict | None]:
    """The one read of the analyzer's cache per run, and `max_length: auto`'s choice (else analysed now, if loaded).
    `stop_asked`: the run's stop, looked at by the main process as it measures every pair, the others waiting for it
    (`lengths.MeasureStopped`, on every rank: `first_half`); another rank measuring (the main's cache not written)
    never stops alone, which would leave the others in the next collective."""
    p, dataset, truncation = recipe.project, pairs.train, recipe.training.truncation_mode
    dataset_id = pairs.dataset_id or _read_identity(recipe, launch, pairs.revision)
    if dataset_id is None:
        return None, None
    measured = lengths.cached_measure(dataset_id, tokenizer)
    if measured is not None and pairs.mix is not None and not pairs.mix.measures(measured[0]):
        # Not the mixture's pairs (another rows check kept other rows): its shares and `auto` would be other rows'.
        # Said by the main process: without `auto` no rank writes a new cache, and every rank found this one
        if launcher.launched_main():
            warn(
                f"the analyzer's cached lengths ({measured[1]}) are of {measured[0].rows} pairs, not the "
                f"{len(pairs.mix.source_of_row)} of the mixture the run reads: out of date, measured again"
            )
        measured = None
    if not recipe.max_length_auto:
        return measured, None
    if measured is not None:
        return measured, lengths.resolution_of(measured, p.auto_coverage, positions, truncation)
    if dataset is None:
        return None, None
    m, auto = lengths.analyse(
        dataset,
        tokenizer,
        p.auto_coverage,
        dataset_id,
        progress=not launch.dry_run,
        max_positions=positions,
        truncation_mode=truncation,
        stop_asked=stop_asked if launcher.launched_main() else None,
    )
    report = auto["report"] and Path(auto["report"])  # None: the cache could not be written (a warning said why)
    return (m, report or "the training split, measured at start (not cached)"), auto


def kept_max_length(output: resolve.OutputDecision | None, auto: dict) -> dict:
    """`max_length: auto`'s choice on a resume: the checkpoint's where the analyzer now chooses another (an upgrade),
    said: the steps left are cut as the checkpoint's were (a length no longer taken is refused by its checks)."""
    if output is None or not output.resume_from or not isinstance(auto.get("max_length"), int):
        return auto
    trained = resolve.trained_record(output.resume_from)
    kept = trained.lengths.auto if trained is not None else None
    if not isinstance(kept, dict) or not isinstance(kept.get("max_length"), int):
        return auto  # recorded without `auto` (a given max_length): the resume compares it as a setting
    if kept["max_length"] == auto["max_length"]:
        return auto
    if launcher.launched_main():
        print(
            f"note: max_length: auto chooses {auto['max_length']:,} now, and {output.resume_from} trained at "
            f"{kept['max_length']:,} (chosen at the run's start): the steps after it train at "
            f"{kept['max_length']:,}, as it did (a new --output_dir trains at {auto['max_length']:,})",
            flush=True,
        )
    return auto | kept  # the checkpoint's choice; a field an older record lacks, as analysed now


def measure_lengths(
    recipe, launch: Launch, pairs: Data, model_path: str, model_config, output=None, stop_asked=None
) -> Lengths:
    """The lengths stage; decides `max_length: auto`. `model_config`: None where a dry run does not have it.
    `stop_asked`: the run's stop, as `_analyzer_cache` and a mixture's pass over every pair look at it."""
    t, p = recipe.training, recipe.project
    max_length = t.max_length
    limit = None  # the model's positions: what max_length may be, or advise
    if (recipe.max_length_auto or max_length is not None) and model_config is not None:
        limit = positions.model_limit(model_config)[0]
    # The data stage's tokenizer where it was loaded from the same place, else loaded now
    same = pairs.tokenizer is not None and pairs.tokenizer.source == model_path
    tokenizer, unread = pairs.tokenizer.loaded if same else _tokenizer(recipe, model_path, local_only=launch.dry_run)
    measured, auto = None, None
    if tokenizer is not None:
        check_pad_token(t.pad_token, tokenizer)
        with collectives.main_first():  # its refusal: every rank's (outside a process group, nothing to share)
            measured, auto = _analyzer_cache(recipe, launch, tokenizer, pairs, limit, stop_asked)
    if recipe.max_length_auto and auto is None:
        hint = analyze_hint(recipe).removesuffix(", then this dry run again")
        resolved = f"at start, by analysing the training split ({hint})"
        auto = {"max_length": "auto", "target_coverage": p.auto_coverage, "cached": False, "resolved": resolved}
    elif auto is not None:
        auto = kept_max_length(output, auto)
        max_length = auto["max_length"]
    if recipe.max_length_auto and p.max_tokens_per_microbatch is not None:  # the recipe's: every rank joins alike
        # Each rank's choice, from its own copy of the data: one gather, whatever it chose (a refusal: every rank's)
        collectives.every_rank(check_auto_budget, p.max_tokens_per_microbatch, auto)
    if measured is None and pairs.mix is not None and tokenizer is not None:  # every pair, for the sources' shares
        # Each rank's own pass (minutes on a large mixture), stopped as it runs: a rank stopped alone gives its
        # MeasureStopped to every rank in the gather, which all then stop (`first_half`), none left in a collective
        every = collectives.every_rank(
            lengths.measure,
            pairs.train,
            tokenizer,
            num_proc=lengths.workers(pairs.train),
            skip_invalid=True,
            stop_asked=stop_asked,
            read=True,
        )
        measured = (every, "the mixture's pairs, measured at start")
    found, every = None, measured[0] if measured is not None else None
    tokenized = every  # the pairs tokenized here (every one, else a sample), whose first tokens say if BOS is missing
    if measured is not None:
        m, report = measured
        source = report if isinstance(report, str) else f"the analyzer's cached lengths ({report})"
        found = cost.TokenCounts.of(m, source)
    elif pairs.train is not None and tokenizer is not None:
        found, every, tokenized = sample.measured_sample(
            pairs.train, tokenizer, t.seed, p.hh_format, every=launch.dry_run
        )
    collectives.every_rank(check_max_length, recipe, pairs, found, measured, tokenizer, max_length, limit, launch)
    shares = None
    if pairs.mix is not None and measured is not None:
        shares = pairs.mix.with_token_shares(measured[0], max_length, t.truncation_mode)
    if tokenizer is not None:
        check_pads(t.pad_token, tokenizer)
    from trl.data_utils import is_conversational  # here, as in data/shapes.py: it imports datasets

    plain = pairs.train is not None and not is_conversational(next(iter(pairs.train)))  # TRL's test, as it reads
    template = chat_template.record(p.chat_template_path, tokenizer, plain_text=plain, unread=unread)
    warnings = ()
    if tokenizer is not None and not plain:  # message pairs: the template writes BOS and opens the answer
        found_here = (lengths.missing_bos(tokenized, tokenizer), lengths.unopened_turn(tokenized, tokenizer))
        warnings = tuple(w for w in found_here if w)
    given_by = "TRL's default" if "max_length" not in recipe.given else "the recipe's"
    given_by = "the command line's" if "max_length" in config.fields_set(recipe.command_line) else given_by
    return Lengths(auto, found, measured, tokenizer, shares, template, max_length, limit, given_by, every, warnings)


def check_auto_budget(budget: int, auto: dict | None) -> None:
    """The token budget against the max_length `auto` chose (none chosen yet: nothing to check)."""
    if auto is None or not isinstance(auto.get("max_length"), int):
        return
    whole = f"{auto['coverage']:.1%} of the pairs whole, target {auto['target_coverage']:.0%}"
    resolve.check_token_budget(budget, auto["max_length"], whole)


def check_steps(steps: dict, training, world: int = 1) -> None:
    """The steps the data set's rows make on `world` data-parallel ranks: a run that trains nothing, or whose schedule
    does not fit, refused. Every rank runs it inside one gather (`collectives.every_rank`): a rank whose copy of the
    data differs ends every rank."""
    plan.check_steps(steps, training.max_steps)
    plan.check_schedule_fits(steps, training)
    rows = steps.get("dataset_rows")
    per_epoch = None if rows is None else len(plan.steps_of(range(rows), steps["pairs_per_step"], world))
    plan.check_eval_delay(steps, training, per_epoch)  # an evaluation that would never come, before the model loads


def check_kept_steps(recipe, launch: Launch, pairs: Data, pair_lengths: Lengths) -> None:
    """The steps of the pairs training keeps, where max_length drops some and every pair was measured: a run they
    leave nothing to train was refused by the plan stage only after the model loaded and --overwrite_output_dir had
    removed the finished run it replaced. Every rank, on its own copy (`collectives.every_rank`)."""
    every, max_length = pair_lengths.every, pair_lengths.max_length
    if every is None or max_length is None or pairs.train is None:
        return  # a sample alone: the plan stage checks the pairs TRL keeps
    dropped = int(cuts.drops(every.prompt, max_length, recipe.training.truncation_mode).sum())
    kept = len(pairs.train) - dropped
    total = resolve.count_steps(recipe, launch.batch, launch.data_parallel, kept)["total_steps"]
    plan_stage.check_kept_steps({"dropped": dropped}, total, recipe.training, kept, launch.batch.pairs_per_step)


def check_max_length(recipe, pairs: Data, f, measured, tokenizer, max_length, limit, launch: Launch) -> None:
    """The training and held-out pairs at `max_length`, each rank's own copy in one gather (`collectives.every_rank`).
    One that leaves the pairs (`f`), or a mixture source's (`measured`: every pair), nothing to learn: refused, advising
    within the model's positions (`limit`); more pairs cut than the analyzer's rule would: warned of once."""
    if max_length is None:
        return
    mode, budget = recipe.training.truncation_mode, recipe.project.max_tokens_per_microbatch
    if f is not None:
        cuts.check(f.prompt, f.chosen, f.rejected, f.shared, max_length, mode, f.source, limit, budget)
        if not recipe.max_length_auto and launcher.launched_main():  # auto is chosen to leave COVERAGE whole
            if many := cuts.warning(f.prompt, f.chosen, f.rejected, max_length, mode, f.source, limit, budget):
                warn(many)
    if pairs.mix is not None and measured is not None:  # every pair: each source's
        pairs.mix.check_cuts(measured[0], max_length, mode, limit, budget)
    if pairs.eval is not None and tokenizer is not None:
        check_held_out(pairs.eval, tokenizer, max_length, recipe, launch.data_parallel, pairs.eval_mix, limit)


def held_out_pairs(recipe, revision: str | None, template, pins: dict | None = None, fetch: str = ""):
    """The pairs a recipe that evaluates is evaluated on, read as the run reads them (a held-out mixture, else the
    test split at `revision`), for the analyzer: `template`, the tokenizer the answers are checked against."""
    return _load_pairs(recipe, rows.RowRules.of(recipe, template, True, say=False), revision, {}, False, pins, fetch)[0]


def held_out_cuts(held_out, tokenizer, max_length: int, recipe) -> tuple[lengths.Measured, dict]:
    """The held-out pairs' lengths and their cuts at `max_length` (`cuts.count`), as the run and the analyzer count."""
    m = lengths.measure(
        held_out, tokenizer, num_proc=lengths.workers(held_out), skip_invalid=True, hh_format=recipe.project.hh_format
    )
    return m, cuts.count(m.prompt, m.chosen, m.rejected, max_length, recipe.training.truncation_mode)


def check_held_out(held_out, tokenizer, max_length: int, recipe, ranks: int, mix=None, limit=None) -> None:
    """The held-out pairs at `max_length`: the trainer drops one whose prompt alone fills it. Fewer than the ranks
    left, or none of a held-out mixture's source (`mix`): refused (TRL failed after the reference was scored; the
    source went unevaluated, unsaid), advising within the model's positions (`limit`); some dropped: said."""
    t = recipe.training
    if t.truncation_mode != "keep_start":
        return  # keep_end drops nothing
    m, counted = held_out_cuts(held_out, tokenizer, max_length, recipe)
    kept = m.rows - counted["dropped"]
    chosen = " (max_length: auto's choice, from the training pairs)" if recipe.max_length_auto else ""
    if kept < ranks:  # the split holds a pair per rank (`plan.check_eval_split`, as it is read): max_length drops them
        raise ConfigError(
            f"max_length {max_length:,}{chosen} leaves {kept:,} of the {m.rows:,} held-out pairs, where each process "
            f"that evaluates ({ranks}) needs one: the trainer drops a pair whose prompt alone fills "
            f"max_length (the shortest held-out prompt is {int(m.prompt.min()):,} tokens); pass a --max_length "
            f"above {int(sorted(m.prompt)[ranks - 1]):,}, or hold out pairs with shorter prompts"
        )
    if mix is not None and counted["dropped"]:  # after the whole set's: one source of several dropped whole
        mix.check_held_out_drops(m, max_length, limit, chosen)
    if counted["dropped"]:
        print(f"Held-out pairs at {cuts.line(counted)}", flush=True)


# --- forward ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Forward:
    """The forward the step and memory plans are made for, and what was weighed for each machine of the launch."""

    planned: choice.ForwardChoice | None
    options: dict  # per machine: a forward's record, or its candidates while undecided
    planned_for: str = ""
    decided: str = ""  # why it is not decided yet, and the command that decides it now

    def line(self) -> str:
        """What was planned, in words: compared across nodes (`agreement.check_nodes`)."""
        f = self.planned
        if f is None:
            return "none yet"
        return f"{f.layout} on {f.attention}" + (f" ({self.decided})" if self.decided else "")

    @property
    def decided_here(self) -> bool:
        """Decided for the one machine the run is on: the attention the model loads with, packed or padded."""
        return self.planned is not None and len(self.options) == 1 and not self.decided

    def record(self) -> dict:
        if self.decided_here:
            return self.planned.record()
        given = {"decided": self.decided, "planned_for": self.planned_for}
        return {**self.options, **{key: value for key, value in given.items() if value}}


def _generation_stops(recipe, model_path: str, local_only: bool) -> set | None:
    """generation_config.json's eos_token_id; None where it cannot be read here; a folder without it: config.json's.
    A file transformers refuses is refused here, not at the model's load after the first half; one that is not JSON
    transformers drops without a word, saving generation settings made from config.json."""
    from huggingface_hub.errors import HFValidationError
    from transformers import GenerationConfig

    file = Path(model_path) / "generation_config.json"
    if Path(model_path).is_dir() and not file.is_file():
        return set()
    try:
        if file.is_file():
            json.loads(file.read_text())  # transformers reads a file that is not JSON as one that is not there
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{file} is not a JSON file ({cause(e, 120)}), which transformers would leave unread (the model saved "
            "with generation settings made from its config.json): correct it, or remove it"
        ) from None
    try:
        found = GenerationConfig.from_pretrained(
            model_path, revision=recipe.model.model_revision, local_files_only=local_only
        )
    except (ValueError, TypeError) as e:  # its values, as transformers validates them (not a Hub repo's name)
        if isinstance(e, HFValidationError):
            return None
        raise ConfigError(
            f"the generation_config.json of {recipe.model.model_name_or_path} is one transformers "
            f"{transformers.__version__} refuses to load ({cause(e, 200).rstrip('.')}): correct or remove that "
            "setting in it"
        ) from None
    except Exception:  # noqa: BLE001 - not on this machine, no network: nothing refused on a guess
        return None
    return chat_template.eos_ids(found.eos_token_id)


def _model_checks(recipe, launch: Launch, model_path: str, pair_lengths: Lengths, config) -> None:
    """The model's checks (its config, tokenizer, template, generation file; the pairs' positions), run by every rank
    in the forward's gather (`_chosen`): each rank reads its own copy of the model's files and of the data, and one
    refused alone raised alone, leaving the others in their next collective; one every rank met was said once per
    rank. Now the first rank to meet it says it, once, and every rank ends on it. None: the config was not read."""
    if config is None:
        return
    model_name = recipe.model.model_name_or_path
    options.check_generates(config, model_name)
    options.check_backbone(config, model_name)
    options.check_router_loss(config, model_name, recipe.training.router_aux_loss_coef)
    options.check_dbrx_rope(config, model_name, recipe.training.model_init_kwargs)
    options.check_unbounded_clip(config, model_name, recipe.training.model_init_kwargs)
    options.check_checkpointing(config, model_name, recipe.training.activation_checkpointing)
    sequence_parallel.check_heads(launch.sequence_parallel, config, launch.world)  # a group splits the heads
    whole_split = pair_lengths.measured is not None  # each rank's own lengths, and max_length (`auto`'s from them)
    positions.check(config, model_name, pair_lengths.max_length, pair_lengths.pairs, whole_split=whole_split)
    positions.check_vocabulary(config, pair_lengths.tokenizer, model_name, recipe.training.pad_token)
    stops = _generation_stops(recipe, model_path, launch.dry_run)  # read by the model's load: refused before it
    if pair_lengths.tokenizer is not None and not (pair_lengths.template or {}).get("plain_text"):
        chat_template.check_stops(pair_lengths.tokenizer, config, model_name, stops)
        if recipe.project.assistant_turns == "all":
            turns.check_template(pair_lengths.tokenizer)
    lora.check_targets(recipe, config, model_name)
    engine.check_half_weights(recipe, launch.engine, config)  # `--dtype auto`: the weights' own dtype
    memory.check_loading(launch.engine, config, model_name)
    samples.check_positions(recipe.project, config, pair_lengths.tokenizer, model_name)


def decide_forward(recipe, launch: Launch, model_path: str, pair_lengths: Lengths, model: tuple) -> Forward:
    """The forward stage: from the pairs' lengths, among the forwards each machine can run; `model`: (config, why)."""
    # The model's checks and the choice, which reads this node's machine (its GPU, its kernels): one gather, joined by
    # every rank, its config read or not (a rank that skipped it would wait in another collective); a refusal one node
    # meets ends every rank, and the forwards chosen are compared at once, by node (each rank chooses alone)
    forward = collectives.every_rank(_chosen, recipe, launch, model_path, pair_lengths, model)
    agreement.check_nodes("the forward", forward.line())
    return forward


def _chosen(recipe, launch: Launch, model_path: str, pair_lengths: Lengths, model: tuple) -> Forward:
    """This rank's forward (`decide_forward`), from its machine's kernels and own lengths, the model checked first."""
    config, why = model
    _model_checks(recipe, launch, model_path, pair_lengths, config)
    if config is None:
        return Forward(None, {}, decided=f"at start, from the data's lengths ({why})")
    counts, max_length = pair_lengths.pairs, pair_lengths.max_length
    if counts is None:
        return _undecided(recipe, launch, config)
    if len(launch.machines) == 1:
        ((name, (cuda, varlen)),) = launch.machines.items()
        chosen = choice.decide(recipe, config, cuda, varlen, counts, max_length)
        return Forward(chosen, {name: chosen.record()}, planned_for=name)
    chosen = {}
    for name, (cuda, varlen) in launch.machines.items():  # a login node: for the GPU, with and without FA4
        chosen[name], _ = choice.choose(copy.deepcopy(config), recipe, cuda, varlen, counts, False, max_length)
    planned = max(chosen, key=lambda name: choice.mask_weight(chosen[name].attention))
    return Forward(chosen[planned], {name: f.record() for name, f in chosen.items()}, planned_for=planned)


def _undecided(recipe, launch: Launch, config) -> Forward:
    """No lengths yet (a dry run, uncached Hub data): the candidates the run will weigh, planned for the heaviest."""
    options, weighed = {}, []
    check = not launch.dry_run or len(launch.machines) == 1
    for name, (cuda, varlen) in launch.machines.items():
        listed, _ = choice.candidates(copy.deepcopy(config), recipe, cuda, varlen, check_kernels=check)
        options[name] = {"candidates": [c.describe() for c in listed]}
        weighed += [(name, c) for c in listed]
    name, heaviest = max(weighed, key=lambda item: choice.mask_weight(item[1].attention))
    h, hidden = heaviest, getattr(config.get_text_config(), "hidden_size", 4096)
    planned = choice.ForwardChoice(
        h.packed, h.share_prompt, hidden, h.attention, "the candidate of heaviest masks", None, launch.sequence_parallel
    )
    decided = f"at start, from the data's lengths ({analyze_hint(recipe)})"
    return Forward(planned, options, f"{name}: {heaviest.describe()}", decided)


# --- plan and memory --------------------------------------------------------------------------------------------------
def plan_batching(recipe, launch: Launch, pairs: Data, pair_lengths: Lengths, forward: Forward) -> dict:
    """The step plan a dry run records (`derived.batching`): the run's plan stage on every pair's measured lengths."""
    t, p, max_length = recipe.training, recipe.project, pair_lengths.max_length
    pending = {"planned": f"at start, from the token lengths ({analyze_hint(recipe)})"}
    f = forward.planned
    m = pair_lengths.every  # measured by the lengths stage: the analyzer's, the mixture's, or a dry run's
    if f is None or max_length is None or m is None:
        return pending
    counted = cuts.count(m.prompt, m.chosen, m.rejected, max_length, t.truncation_mode)  # as the run will count
    limit = pair_lengths.positions
    budget = p.max_tokens_per_microbatch
    cuts.check(
        m.prompt, m.chosen, m.rejected, m.shared, max_length, t.truncation_mode, "the training split", limit, budget
    )
    # TRL drops the pairs whose prompt alone fills max_length under keep_start; keep_end cuts their start instead
    kept = (m.prompt < max_length) | (t.truncation_mode != "keep_start")
    every = PairLengths.from_parts(
        m.prompt[kept], m.chosen[kept], m.rejected[kept], max_length, f.share_prompt, t.truncation_mode
    )
    return plan_stage.make(
        every,
        t,
        pairs.steps["pairs_per_step"],
        launch.data_parallel,
        p.max_tokens_per_microbatch,
        forward=plan.RowLayout.of(
            f.packed, f.one_row, f.hidden_size, f.pad_multiple, max_length, positions_cap(budget, t.bf16 or t.fp16)
        ),
        reduce_per_backward=launch.engine.deepspeed,
        max_length_cuts=counted,
    ).summary


def plan_memory(
    recipe, launch: Launch, pairs: Data, pair_lengths: Lengths, forward: Forward, model: tuple
) -> MemoryPlan:
    """The memory plan, once per run, for this run's recipe, forward and engine: refused when it cannot fit the GPU."""
    attention = forward.planned.attention if forward.planned is not None else None
    run = as_run(recipe, launch, pairs, pair_lengths, forward)
    # Made from this node's GPU: in one gather (a node's "does not fit" ends every rank on one line), then compared
    planned = MemoryPlan.of(
        collectives.every_rank(memory.plan, run, launch.world, launch.engine, attention, model=model)
    )
    agreement.check_nodes("the memory plan", _memory_line(planned))
    return planned


def _memory_line(planned: MemoryPlan) -> str:
    """What of the memory plan a rank trains by: its checkpointed layers and the reference stage's micro-batch (not the
    GPU's size: two GPUs of one kind may tell it apart by a few MiB, and plan alike)."""
    if planned.skipped is not None:
        return "not planned"
    layers_kept = (planned.checkpointing or {}).get("layers")
    return f"checkpointing {layers_kept}, the reference's micro-batch x{planned.reference_multiple}"


# --- the first half ---------------------------------------------------------------------------------------------------
def as_run(
    recipe, launch: Launch, pairs: Data, pair_lengths: Lengths, forward: Forward, planned=None, load_dtype=None
) -> config.Recipe:
    """The recipe a user would write to make this run: each decision of the first half in its field, named here alone.
    `planned`, `load_dtype`: the memory stage's, once made."""
    batch, f = launch.batch, forward
    training = {"max_length": pair_lengths.max_length}  # the recipe's, or under `max_length: auto` the analyzer's
    project = {"pairs_per_step": batch.pairs_per_step}
    model = {}
    if batch.gradient_accumulation_steps is not None:  # None: micro-batches are cut by tokens (plan.py)
        training["gradient_accumulation_steps"] = batch.gradient_accumulation_steps
    if not uses_live_reference(recipe):
        training["precompute_ref_log_probs"] = True  # the reference stage scores once
    if recipe.project.health_checks:  # the step1 guard logs step 1 on its own (train/health.py), as this field does
        training["logging_first_step"] = True
    if pairs.revision is not None:
        project["dataset_revision"] = pairs.revision  # the commit every rank loaded
    if f.decided_here:
        training["padding_free"] = f.planned.packed
        model["attn_implementation"] = f.planned.attention
    if planned is not None:
        training |= layers.checkpointing_fields(recipe.training, planned.checkpointing)
    if load_dtype is not None:  # the engine's (`engine.load_dtype`): bf16 under DeepSpeed, else the recipe's
        model["dtype"] = load_dtype
    return config.replaced(recipe, training=training, model=model, project=project)


@dataclass(frozen=True)
class RunSpec:
    """Every decision of the run, made once by the first half before a model weight loads; `record()` is
    resolved_config.json's `derived` block (docs/architecture.md)."""

    recipe: config.Recipe  # the user's intent as parsed (never written); `as_run` is the recipe of this run
    launch: Launch  # world and data-parallel size, engine, sequence-parallel group, clipping, pairs per step
    data: Data  # the pairs, the steps they make, the data set's commit and content identity
    lengths: Lengths  # max_length (auto: the analyzer's choice), the pairs' token lengths
    forward: Forward  # packed or padded, prompts shared or not, the attention kernel
    memory: MemoryPlan  # the memory plan per GPU, its checkpointed layers
    load_dtype: str | None  # the dtype the weights load in (`engine.load_dtype`)
    batching: dict | None  # a dry run's step plan; the run's comes from the plan stage
    output: resolve.OutputDecision | None = None  # resume from a checkpoint, start afresh (None: no output folder)
    push: object | None = None  # hub.PushSettings: the push the run makes (None: none)

    @property
    def pairs_per_step(self) -> int:
        return self.launch.batch.pairs_per_step

    @functools.cached_property
    def as_run(self) -> config.Recipe:
        return as_run(self.recipe, self.launch, self.data, self.lengths, self.forward, self.memory, self.load_dtype)

    def resolved_config(self, derived: dict) -> dict:
        """resolved_config.json (and a dry run's JSON): every field as this run uses it, and `derived`."""
        return resolve.resolved_config(self.as_run, derived)

    def record(self) -> dict:
        batching = {} if self.batching is None else {"batching": self.batching}
        forward = {"forward": self.forward.record(), "memory": self.memory.values}
        return self.launch.record() | self.data.record() | self.lengths.record() | forward | batching


def first_half(
    recipe,
    launch: Launch,
    state=None,
    output: resolve.OutputDecision | None = None,
    push=None,
    pairs: Data | None = None,
    stop_point=None,
    stop_asked=None,
) -> RunSpec:
    """data -> lengths -> forward -> (a dry run: plan) -> memory. `pairs`: the data stage's, where a caller has it.
    `stop_point`: called by every rank alike between the data stage's pieces, True where a stop asked by then ends
    the run there (said and agreed on): `StoppedBeforeTraining` is raised. A stop asked as a large data set was read
    waited for its pairs to be tokenized and the forward chosen (minutes), past a Slurm GraceTime. `stop_asked`: this
    process's stop, looked at without a collective as the pairs are read and the main process measures every pair
    (`max_length: auto`)."""
    say = state is None or state.is_main_process
    pairs = pairs if pairs is not None else load_data(recipe, launch, say, output, stop_point, stop_asked)
    _stop_at(stop_point)  # the data read and checked, before the model's files are fetched and the pairs tokenized
    model_path = model_files(recipe, launch, pairs.tokenizer)
    weight_names.check_whole(model_path)  # before the lengths are measured and the model loads, the dry run too
    model = memory.model_config(recipe, model_path, local_only=launch.dry_run)
    if model[0] is not None:  # a Hub model's config not cached at the checks: read now, before the pairs are tokenized
        options.check_init_kwargs_apply(recipe, model[0])
    try:
        pair_lengths = measure_lengths(recipe, launch, pairs, model_path, model[0], output, stop_asked)
    except lengths.MeasureStopped:  # on every rank (main_first): the stop agreed on and said, as at the points here
        _stop_at(stop_point)
        raise
    _stop_at(stop_point)  # the pairs' lengths measured, before the forward's sample is tokenized as the trainer does
    if not launch.dry_run:  # the dry run plans the steps of the pairs kept (plan_batching)
        collectives.every_rank(check_kept_steps, recipe, launch, pairs, pair_lengths)
    forward = decide_forward(recipe, launch, model_path, pair_lengths, model)
    splits = {"train": pairs.train, "held-out": pairs.eval}
    # each rank's own copy of the pairs: one gather, the first refusal said once and every rank ending on it
    collectives.every_rank(
        positions.check_data_tokens, model[0], pair_lengths.tokenizer, recipe.model.model_name_or_path, splits
    )
    batching = plan_batching(recipe, launch, pairs, pair_lengths, forward) if launch.dry_run else None
    if batching is not None and "pairs_trained" in batching:  # the steps of the pairs TRL keeps, not of the rows
        pairs = replace(pairs, steps=resolve.planned_steps(recipe, pairs.steps, batching))
    planned = plan_memory(recipe, launch, pairs, pair_lengths, forward, model)
    auto = model[0] if recipe.model.dtype == "auto" else None
    load_dtype = engine.load_dtype(recipe, launch.engine, auto)  # bf16 under DeepSpeed, not TRL's float32 default
    # Last, where the run refuses them as they load (trainer.whole_weights_only); no process group: this process's
    if launch.dry_run and model[0] is not None:
        weight_names.check(recipe, model_path, model[0])
    return RunSpec(recipe, launch, pairs, pair_lengths, forward, planned, load_dtype, batching, output, push)


def _stop_at(stop_point) -> None:
    """One of the data stage's stop points (`first_half`)."""
    if stop_point is not None and stop_point():
        raise StoppedBeforeTraining


def given_pairs(recipe, launch: Launch, train, eval_dataset=None) -> Data:
    """The data stage's value for pairs a caller holds (a test's, a benchmark's, the preflight's): nothing recorded."""
    if eval_dataset is not None:  # as `load_data` checks it: a pair per rank (`check_held_out` counts on it)
        plan.check_eval_split(len(eval_dataset), launch.data_parallel)
    steps = resolve.count_steps(recipe, launch.batch, launch.data_parallel, len(train))
    return Data(train, eval_dataset, steps, revision=recipe.project.dataset_revision)

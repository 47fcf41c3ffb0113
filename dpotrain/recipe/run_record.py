"""The run's record read back by type: resolved_config.json (a run's) and the dry run's JSON (`--dry-run --json`).

Both hold every recipe field as the run used it, and under `derived` what the stages decided. `read` (a file) and `of`
(the object in hand) give it back as a `Record`, one section per decision, for every reader. A view of the file, not a
format of its own: a field that a record of an earlier version lacks reads None.
"""

import functools
import hashlib
import json
from dataclasses import dataclass, field, fields, make_dataclass, replace
from pathlib import Path

from dpotrain.recipe import records
from dpotrain.recipe.errors import ConfigError, cause, decimal, plural


def _view(cls, values):
    """`cls` from a recorded mapping, field by field: None where it lacks one."""
    values = values if isinstance(values, dict) else {}
    return cls(**{f.name: values.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Spread:
    """A count per step or micro-batch: fixed (min = mean = max), or the step plan's spread."""

    min: float
    mean: float
    max: float

    @classmethod
    def of(cls, value) -> "Spread | None":
        if isinstance(value, dict):
            return cls(value["min"], value["mean"], value["max"])
        return None if value is None else cls(value, value, value)

    def __str__(self) -> str:
        return f"{self.min}" if self.min == self.max else f"{self.min}-{self.max}"


@dataclass(frozen=True)
class RecordedLaunch:
    world_size: int | None
    world_size_source: str | None
    data_parallel_size: int | None  # processes / sequence_parallel_size: the ranks that read their own pairs
    gradient_clipping: dict | None  # max_grad_norm and clipped_by, as in effect (engine.gradient_clipping)


@dataclass(frozen=True)
class RecordedData:
    dataset_rows: int | None  # None: a Hub data set, which a dry run does not load
    total_steps: int | None
    warmup_steps: int | None
    data_sources: list | None  # a mixture's sources (data/mixture.py)
    eval_sources: list | None  # the held-out mixture's sources
    data_identity: dict | None  # the data set's content, or a Hub data set's commit (hub_revision.KEY)


@dataclass(frozen=True)
class Template:
    """The chat template the pairs are tokenized with (chat_template.record)."""

    path: str | None  # the recipe's file (chat_template_path); None: the model's own
    sha256: str | None  # of its content; None where the model's tokenizer was not at hand
    plain_text: bool | None  # plain-text pairs: no template applies
    unused: str | None  # a chat_template_path given for plain-text pairs
    unread: str | None = None  # why the model's tokenizer, whose files are here, could not be read (a dry run)


@dataclass(frozen=True)
class RecordedLengths:
    max_length: int | None  # as trained: the recipe's, or `auto`'s choice; None: unbounded, or decided at start
    auto: dict | None  # `max_length: auto`: the analyzer's choice and coverage (lengths.py), or when it is made
    template: Template | None
    given_by: str | None = None  # not `auto`: the recipe's, the command line's, TRL's default (None: an older record)

    @property
    def chosen_by(self) -> str:
        if self.auto is None:
            if self.max_length is None:  # `--max_length null`, or the recipe's `max_length: null`: unbounded
                if self.given_by == "the command line's":
                    return "none: the command line's --max_length null"
                if self.given_by == "the recipe's":
                    return "none: the recipe's max_length: null"
                return "none: the recipe sets no max_length"  # an older record: whose null it was is not there
            return self.given_by or "the recipe's"
        if self.max_length is None:
            return f"max_length: auto, decided {self.auto.get('resolved', 'at start')}"
        whole, target = self.auto["coverage"], self.auto["target_coverage"]
        return f"max_length: auto, {whole:.1%} of the pairs whole (target {target:.0%})"


@dataclass(frozen=True)
class RecordedBatching:
    """Pairs per step and their micro-batches: the recipe's fixed ones, or the step plan's (None until it is made)."""

    pairs_per_step: int | None
    micro_batches_per_step: Spread | None  # per process: gradient accumulation
    pairs_per_micro_batch: Spread | None  # per_device_train_batch_size
    pairs_per_step_trained: Spread | None  # the plan's pairs in each trained step (an epoch's last: what is left)
    max_tokens_per_microbatch: int | None  # the token budget that cuts them, where one does
    planned: str | None  # the step plan not made: when it is
    positions_per_micro_batch: Spread | None  # the plan's, as every other field below
    padding_share: float | None
    layout: str | None  # packed, prompts shared, or padded
    pairs_trained: dict | None  # the pairs the planned steps train: pairs, of, steps
    epochs_trained: float | None  # the epochs those steps make (max_steps: fewer than num_train_epochs, or more)
    max_length_cuts: dict | None  # pairs cut or dropped at max_length (cuts.py)
    replaced: dict | None  # the recipe's pairs per step, where batch flags on the command line replaced it


@dataclass(frozen=True)
class MemoryPlan:
    """The memory plan per GPU (plan/memory.py), or why it was skipped: the run's own section (`stages.RunSpec.memory`,
    `values` as made) and the record's (`derived.memory`), read by the same fields."""

    skipped: str | None
    engine: str | None
    world_size: int | None
    gpus_per_node: int | None
    gpu_memory_gib: float | None
    gpu_memory_source: str | None
    fits: bool | None
    per_gpu_gib: dict | None  # its parts, and their total
    model: dict | None  # parameters, layers, hidden_size
    checkpointing: dict | None  # the checkpointed decoder layers, and who chose them
    allocator: str | None  # the caching allocator's setting the run had (memory.allocator)
    attention: str | None  # the attention implementation whose masks it counts
    reference_multiple: int | None  # the reference stage's micro-batch, in training's (`memory.forward_only_multiple`)
    values: dict = field(default_factory=dict, repr=False, compare=False)  # the plan as made: what `derived` records

    @classmethod
    def of(cls, values) -> "MemoryPlan":
        return replace(_view(cls, values), values=values if isinstance(values, dict) else {})

    @property
    def total_gib(self) -> float | None:
        """The plan's total per GPU; None where memory was not planned (a CPU run, fp32, no config on this machine)."""
        return (self.per_gpu_gib or {}).get("total")


@dataclass(frozen=True)
class RecordedOutput:
    output_dir: str | None
    folder: str | None  # a dry run: what the run would do with it
    would_refuse: tuple[str, ...]  # a dry run: what the run would refuse, each as it would say it


@dataclass(frozen=True)
class Record:
    values: dict = field(repr=False)  # the object as recorded
    launch: RecordedLaunch
    data: RecordedData
    lengths: RecordedLengths
    forward: dict  # the forward chosen (choice.ForwardChoice.record), or a dry run's per machine
    batching: RecordedBatching
    memory: MemoryPlan
    output: RecordedOutput
    model_identity: dict | None  # the model's files as the run loaded them (model_identity.py)

    @functools.cached_property
    def settings(self):
        """Every recipe field as the run used it, by attribute; the push as the project makes it (hub_model_id)."""
        return _view(_settings(), self.values)

    @property
    def derived(self) -> dict:
        """The block as recorded, for what no section holds."""
        return self.values.get("derived") or {}

    def changed(self, new: "Record", names) -> dict[str, tuple]:
        """name -> (old, new) for each of `names` this record holds that `new` gives another value (a field a record
        of an earlier version lacks is not compared)."""
        pairs = {n: (getattr(self.settings, n), getattr(new.settings, n)) for n in names if n in self.values}
        return {n: (was, now) for n, (was, now) in pairs.items() if was != now}


@functools.cache
def _settings():
    """The fields of the dataclasses a recipe is parsed into, and the recipe file's path (`config`)."""
    from dpotrain.recipe.config import make_parser

    names = {f.name: f.type for part in make_parser().dataclass_types for f in fields(part)} | {"config": str}
    return make_dataclass("Settings", [(n, t, field(default=None)) for n, t in names.items()], frozen=True)


# Where a record holds an object, and where a count or its spread (a number, or min/mean/max): a file edited into
# another shape is refused as unreadable when read, not an AttributeError at whichever reader meets it first.
_OBJECTS = (
    "derived",
    *(
        f"derived.{name}"
        for name in """gradient_clipping chat_template max_length forward memory memory.per_gpu_gib batching
    batching.pairs_trained batching.max_length_cuts recipe_batching_replaced model_identity data_identity
    eval_identity""".split()
    ),
)
_SPREADS = tuple(
    f"derived.batching.{name}"
    for name in "micro_batches_per_step pairs_per_micro_batch positions_per_micro_batch pairs_per_step_trained".split()
)


def _misshapen(r: dict) -> str | None:
    """The first field of `r` of another shape than a run writes, said as its reader would; None when none is."""

    def at(path):
        value = r
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        return value

    for path in _OBJECTS:
        value = at(path)
        if value is not None and not isinstance(value, dict):
            return f"{path} is a JSON {type(value).__name__}, not an object"
    number = (int, float)
    for path in _SPREADS:
        value = at(path)
        whole = isinstance(value, dict) and all(isinstance(value.get(k), number) for k in ("min", "mean", "max"))
        if value is not None and not whole and (isinstance(value, bool) or not isinstance(value, number)):
            return f"{path} is neither a number nor its min, mean and max"
    return None


# The run's record's file name, in its folder and each checkpoint's (resolve.trained_under)
RESOLVED = "resolved_config.json"
# A dry run's output_folder outside a Slurm job, for an output_dir naming a SLURM_ variable (config.Recipe.job_folder)
JOB_FOLDER = ": the Slurm job's own folder, named as the job starts: the run starts there (new)"
REFUSED_FOLDER = ": refused by the run (below)"  # a dry run's output_folder, ending so for a folder the run refuses

# The record's digest of itself, written with it: a file edited by hand (a value "fixed" before a resume) is told from
# one the run wrote, whose settings a rerun neither reads nor keeps (resume.say_hand_edit)
SEAL = "written_sha256"


def _digest(values: dict) -> str:
    """SHA-256 of the record as its file reads (through JSON), but its seal: an editor's new indentation is no edit."""
    read = json.loads(json.dumps({k: v for k, v in values.items() if k != SEAL}, default=str))
    return hashlib.sha256(json.dumps(read, sort_keys=True).encode()).hexdigest()


def sealed(values: dict) -> dict:
    """`values` with its digest, as resolved_config.json is written."""
    return {**values, SEAL: _digest(values)}


def edited(values: dict) -> bool:
    """Whether a record the run sealed was changed since (one written before seals, or unsealed: not known, False)."""
    return isinstance(values.get(SEAL), str) and values[SEAL] != _digest(values)


def edited_file(path: str | Path) -> bool:
    """Whether the record in `path` was edited after the run sealed it (none, unreadable, or unsealed: False)."""
    values = records.json_object(path)  # none, or damaged: its readers refuse it themselves
    return values is not None and edited(values)


def of(values: dict) -> Record:
    """The record in hand (`resolve.resolved_config`'s object), read as its file reads: through JSON."""
    return _record(json.loads(json.dumps(values, default=str)))


def read(path: str | Path) -> Record | None:
    """The record in `path`; None where there is none; one that cannot be read is refused (`records.read_record`)."""
    values = records.read_record(path, records.RESOLVED_FIX)
    if values is not None and (why := _misshapen(values)):
        raise ConfigError(f"{path} is unreadable ({why}): {records.RESOLVED_FIX}")
    return None if values is None else _record(values)


def parse(text: str, source) -> Record:
    """The record in `text`, read from `source` (named where it is not one)."""
    try:
        values = json.loads(text)
        why = None if isinstance(values, dict) else f"a JSON {type(values).__name__}, not an object"
    except ValueError as e:
        why = cause(e)
    why = why or _misshapen(values)
    if why:
        raise ConfigError(f"{source}: not a run's record ({why})")
    return _record(values)


def _record(r: dict) -> Record:
    d = r["derived"] if isinstance(r.get("derived"), dict) else {}
    plan, auto, template = d.get("batching") or {}, d.get("max_length"), d.get("chat_template")
    batching = RecordedBatching(
        d.get("pairs_per_step"),
        Spread.of(plan.get("micro_batches_per_step") or r.get("gradient_accumulation_steps")),
        Spread.of(r.get("per_device_train_batch_size") or plan.get("pairs_per_micro_batch")),
        Spread.of(plan.get("pairs_per_step_trained")),
        r.get("max_tokens_per_microbatch"),
        plan.get("planned"),
        Spread.of(plan.get("positions_per_micro_batch")),
        plan.get("padding_share"),
        plan.get("forward"),
        plan.get("pairs_trained"),
        plan.get("epochs_trained"),
        plan.get("max_length_cuts"),
        d.get("recipe_batching_replaced"),
    )
    return Record(
        r,
        _view(RecordedLaunch, d),
        _view(RecordedData, d),
        RecordedLengths(
            r["max_length"] if isinstance(r.get("max_length"), int) else None,
            auto if isinstance(auto, dict) else None,
            _view(Template, template) if template else None,
            d.get("max_length_given_by"),
        ),
        d.get("forward") or {},
        batching,
        MemoryPlan.of(d.get("memory")),
        RecordedOutput(r.get("output_dir"), d.get("output_folder"), tuple(d.get("would_refuse") or ())),
        d.get("model_identity"),
    )


def epochs_text(trained: float, asked: float | None, verb: str = "") -> str:
    """The plan line's and the dry run's one wording of the epochs a run's steps make: '1.5 epochs'; where they are not
    the num_train_epochs asked (`asked`; None where max_steps decides), which transformers rounds up to whole steps:
    '1.667 epochs{verb}: num_train_epochs 1.5 rounded up to whole steps' (1.5 of 3 steps an epoch: 5 steps)."""
    said = f"{plural(decimal(trained), 'epoch')}{verb}"
    if rounded_up(trained, asked):
        said += f": num_train_epochs {decimal(asked)} rounded up to whole steps"
    return said


def rounded_up(trained: float, asked: float | None) -> bool:
    """Whether the epochs a run's steps make are not the num_train_epochs asked (`epochs_text`), as written."""
    return asked is not None and decimal(asked) != decimal(trained)


def per_step_text(b: RecordedBatching, over: str) -> str:
    """The dry run's and the model card's one wording of the pairs per step: '8 pairs, over all processes', or what
    the trained steps take where it is not pairs_per_step: '3 pairs, over all processes: pairs_per_step 8, but the 3
    pairs training keeps (of 6 rows) are one step'."""
    pairs, trained, kept = b.pairs_per_step, b.pairs_per_step_trained, (b.pairs_trained or {}).get("of")
    replaced = replaced_text(b.replaced, pairs)
    if trained is None or kept is None or trained.min == trained.max == pairs:
        return f"{plural(pairs, 'pair')}, over {over}{replaced}"
    rows = (b.max_length_cuts or {}).get("pairs", kept)
    of = f"the {plural(kept, 'pair')} training keeps (of {rows} rows)" if rows != kept else f"{plural(kept, 'pair')}"
    last = trained.max if trained.max > pairs else trained.min  # a last step of fewer pairs than ranks joins
    why = (
        f"{of} {'is' if kept == 1 else 'are'} one step"
        if kept <= pairs
        else f"an epoch of {of} ends in a step of {last}"
    )
    count = f"{trained} pairs" if trained.min != trained.max else plural(trained.min, "pair")
    return f"{count}, over {over}: pairs_per_step {pairs}, but {why}{replaced}"


def replaced_text(replaced: dict | None, pairs: int) -> str:
    """'; NOT the recipe's 128: --per_device_train_batch_size on the command line replaced it (...)'."""
    if not replaced or replaced.get("pairs_per_step") in (None, pairs):
        return ""
    keep = f" ({replaced['keep']} keeps it, in micro-batches of that many pairs)" if replaced.get("keep") else ""
    return f"; NOT the recipe's {replaced['pairs_per_step']}: {replaced['by']} on the command line replaced it{keep}"

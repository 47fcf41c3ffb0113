"""What would make a memory plan that does not fit, fit: the levers this run can take, each planned for real.

A refusal that says "try LoRA" and then refuses the LoRA run sends a user round in circles, so every option offered is
a plan made by the function that refused (`memory.plan`, handed in as `plan`) on a copy of the recipe with the option's
changes, offered only when it fits: fewest changes first, and none that holds a smaller set that fits. The levers,
cheapest to the run first (`Advisor.levers`; docs/memory.md): the cached reference, fewer tokens per micro-batch
(without a token budget: fewer pairs per micro-batch), activation checkpointing on every layer, another engine,
sequence parallelism, more nodes, LoRA, a shorter max_length.
"""

import bisect
import functools
import itertools
import math
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dpotrain.cluster import sequence_parallel
from dpotrain.cluster.engine import LAUNCHED, NAMES, Engine, from_config
from dpotrain.forwards import sequence_parallel as split_rows
from dpotrain.forwards.packing import attention_name
from dpotrain.plan.layers import checkpointing_fields
from dpotrain.recipe.config import (
    ALIASES,
    dry_run_flag,
    fields_set,
    replaced,
    split_fields,
    take_config,
    uses_live_reference,
    without,
)
from dpotrain.recipe.errors import ConfigError, plural
from dpotrain.recipe.run_record import MemoryPlan
from dpotrain.recipe.venv import ROOT

# The accelerate configs this project ships, one per engine: what a refusal tells the user to pass.
SHIPPED = {
    "zero2": "accelerate_config.yaml",
    "zero3": "configs/accelerate/zero3.yaml",
    "fsdp2": "configs/accelerate/fsdp2.yaml",
}
# The sbatch scripts and the recipe each runs when no RECIPE is given (their `RECIPE=${RECIPE:-...}`)
SCRIPTS = {
    (ROOT / "configs" / "think.yaml").resolve(): "scripts/dpo_train.sh",
    (ROOT / "configs" / "instruct.yaml").resolve(): "scripts/dpo_instruct_train.sh",
}
MAX_NODES = 16  # how far a refusal looks for a node count that fits
NODE_SIZES = (4, 8)  # GPUs per node the sbatch scripts are written for (their `#SBATCH --gpus-per-node`, # EDIT)
MOST_OPTIONS = 4  # a refusal is one line: the first few that fit say enough
# The token budgets a refusal weighs: 1, 1.5, 2, 3, 4, 6, ... x 1024. Each size is traced once (memory.layer_costs
# keeps the traces), so every option shares them.
TOKEN_GRID = sorted({1024 * m * 2**k for k in range(9) for m in (1, 3) if m * 2**k >= 2} | {1024})
MIN_MAX_LENGTH = 1024  # the shortest max_length a refusal suggests
# Levers with a number to find, in the order they are searched: the smallest group, the fewest nodes, the most tokens.
SEARCHED = ("sequence", "nodes", "tokens", "batch", "shorter")


def node_size(engine: Engine) -> int:
    """GPUs per node the plan counts nodes in: the job's or the accelerate config's; one process: nodes of 4."""
    return engine.gpus_per_node if engine.gpus_per_node > 1 else NODE_SIZES[0]


@dataclass
class Trial:
    """A recipe copy with some levers pulled: the engine, processes and command-line flags they amount to."""

    recipe: object
    engine: Engine
    world: int
    flags: list[str]
    config: str  # the accelerate config file to name for this engine


@dataclass(frozen=True)
class Option:
    """Changes that make the plan fit, as the user types them, and the plan's GiB per GPU with them."""

    levers: tuple[str, ...]
    flags: tuple[str, ...]
    engine: str
    config: str
    world: int
    per_node: int
    gib: float
    moves_launch: bool  # another engine or node count: a different submission
    tokens: int | None  # tokens per micro-batch
    group: int = 1  # sequence_parallel_size

    def better_than(self, other: "Option") -> bool:
        """Fewer GPUs, more tokens per micro-batch, or a smaller sequence-parallel group (less exchanged per layer)."""
        return self.world < other.world or (self.tokens or 0) > (other.tokens or 0) or self.group < other.group

    @property
    def node_gpus(self) -> int:
        """GPUs per node of the launch: a node's, or fewer where the option needs less than one node (another engine
        for a one-process run), which would otherwise read `--nodes=0`."""
        return min(self.per_node, self.world)

    def text(self, command_line: tuple[str, ...] = ()) -> str:
        parts = []
        if self.moves_launch:
            nodes = plural(self.world // self.node_gpus, "node")
            parts.append(f"{NAMES[self.engine]} fits on {plural(self.world, 'GPU')} ({nodes})")
        if self.flags and parts:
            parts.append(f"with `{shlex.join(self.flags)}`")  # the submission below replaces the command's own
        elif self.flags:
            parts.append(self._changes(command_line))
        submission = self.submission(command_line) if self.moves_launch else None
        return f"{' '.join(parts)} (~{self.gib:.1f} GiB)" + (f": `{submission}`" if submission else "")

    def _changes(self, command_line: tuple[str, ...]) -> str:
        """The flags as the refused command takes them, pasteable: those setting a field it typed replace its words
        (added beside them, the last would count after a "given twice" warning)."""
        pairs = [self.flags[i : i + 2] for i in range(0, len(self.flags), 2)]  # each lever's flags: `--name value`
        typed = fields_set(command_line)
        added = [w for pair in pairs if not _spellings(pair) & typed for w in pair]
        # a lever's flags the command typed as they are (`--max_tokens_per_microbatch none` kept): neither added nor
        # changed ("change `--x none` to `--x none`")
        changed = [
            w for pair in pairs if _spellings(pair) & typed and _typed(command_line, pair) != list(pair) for w in pair
        ]
        parts = [f"add `{shlex.join(added)}`"] if added else []
        if changed:
            yours = split_fields(list(command_line), _spellings(changed))[1]
            parts.append(f"change `{shlex.join(yours)}` to `{shlex.join(changed)}`")
        return ", and ".join(parts)

    def submission(self, command_line: tuple[str, ...]) -> str | None:
        """The sbatch command that runs the refused command with this option, pasted in the folder it ran in (a Slurm
        job's: the one it was submitted from), as scripts/launch.sh takes it: the engine as ACCELERATE_CONFIG, the
        recipe as RECIPE (or the script whose default it is), the command's other arguments less those the option's
        flags replace, and the option's flags.
        None without a recipe, which every script needs. The job plans itself before it launches (launch.sh's dry run),
        so no dry run is printed beside it."""
        recipe, args = _job_arguments(command_line)
        args = without(args, _spellings(self.flags))  # the option's value, not the refused one too ("given twice")
        if recipe is None:
            return None
        here = Path(os.environ.get("DPOTRAIN_SUBMIT_DIR") or os.getcwd())  # where it is pasted
        # The config as the run found it: the folder it ran in (a job's: the project), else the project's
        config = next((p for p in (Path(self.config), ROOT / self.config) if p.is_file()), None)
        env = {"ACCELERATE_CONFIG": _from(here, config) if config else self.config}
        script = SCRIPTS.get(Path(recipe).resolve())
        if script is None:
            script, env["RECIPE"] = "scripts/dpo_train.sh", _from(here, recipe)
        # --gpus-per-node named: the script's own `#SBATCH` must not decide a count assumed here
        sbatch = ["sbatch", f"--nodes={self.world // self.node_gpus}", f"--gpus-per-node={self.node_gpus}"]
        words = [*sbatch, _from(here, ROOT / script), *args, *self.flags]
        return " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items()) + " " + shlex.join(words)


def _typed(command_line: tuple[str, ...], pair) -> list[str]:
    """The words `command_line` sets `pair`'s field with, as the option would write them (`--name value`)."""
    words = split_fields(list(command_line), _spellings(pair))[1]
    return [pair[0], words[-1].partition("=")[2] or words[-1]] if words else []


def _spellings(flags) -> set[str]:
    """The fields `flags` set, with their older names (`--gradient_checkpointing` for activation_checkpointing): a
    command's words for any of them set the same field."""
    fields = fields_set(flags)
    return fields | {old for old, new in ALIASES.items() if new in fields}


def _from(here: Path, path) -> str:
    """`path` (relative: to the folder the command ran in) as typed in `here`: relative inside it, else absolute."""
    path = Path(os.path.abspath(path))
    return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)


def _job_arguments(command_line) -> tuple[str | None, list[str]]:
    """The command's recipe and its other arguments, less what scripts/launch.sh gives train_dpo.py itself (--config as
    RECIPE, --accelerate_config as ACCELERATE_CONFIG) and a dry run's (--dry-run, --json: its own dry run, a job's
    included, asked for them); a `--dry_run false` (turning off a recipe's) stays."""
    recipe, words = take_config(list(command_line))
    kept = without(words, {"accelerate_config", "dry_run", "json"})
    return recipe, kept + ["--dry_run", "false"] * (dry_run_flag(words) is False)


class Advisor:
    """The levers for one refused plan, tried through `plan(recipe, world, engine, attention)` -> its record."""

    def __init__(self, recipe, world: int, engine: Engine, attention: str | None, plan: Callable, heads):
        self.recipe, self.world, self.engine, self.attention, self._plan = recipe, world, engine, attention, plan
        self.heads = heads  # (attention heads, key/value heads): what a sequence-parallel group must split
        self.per_node = node_size(engine)
        # Launched, the engine is read from the environment: the command line's config (scripts/launch.sh passes the
        # job's as --accelerate_config) where it names that engine, else the shipped one for it
        own = recipe.project.accelerate_config
        unknown = engine.source.startswith(LAUNCHED) and from_config(own).name != engine.name
        self.config = SHIPPED.get(engine.name, "") if unknown else own
        self.pairs = recipe.project.pairs_per_step or math.inf
        self._seen: dict[tuple, tuple[bool, float]] = {}
        self._engines: dict[str, Engine] = {}  # each shipped config read once (`engine_lever`)

    # --- one plan ---

    def planned(self, trial: Trial) -> tuple[bool, float]:
        """(fits, GiB per GPU): the trial's plan, once for each distinct setting (combinations meet the same ones)."""
        key = (trial.engine.name, trial.config, trial.world, repr(trial.recipe))  # whatever a lever changed in it
        if key not in self._seen:
            # a plan that does not fit is looked for
            unchecked = replaced(trial.recipe, project={"memory_check": False})
            try:
                planned = MemoryPlan.of(self._plan(unchecked, trial.world, trial.engine, attention=self.attention))
            except ConfigError:  # a trial the run would refuse (PEFT's LoRA on this model) is no option
                planned = MemoryPlan.of({})
            gib = planned.total_gib if planned.total_gib is not None else math.inf
            self._seen[key] = (bool(planned.fits), gib)
        return self._seen[key]

    # --- the levers: each changes a trial, or returns False where it cannot apply ---

    def levers(self) -> list[str]:
        r, t = self.recipe, self.recipe.training
        budget = r.project.max_tokens_per_microbatch is not None
        checkpointing = not t.activation_checkpointing or "every_n_layers" in (t.activation_checkpointing_kwargs or {})
        applies = {
            "cached": uses_live_reference(r) and not t.sync_ref_model,
            "tokens": budget,
            # micro-batches of per_device_train_batch_size pairs, the step's count kept by pairs_per_step (batch
            # flags given alone set the step's pairs: fewer pairs a micro-batch would change them, not memory alone)
            "batch": not budget and bool(r.project.pairs_per_step) and t.per_device_train_batch_size > 1,
            "checkpointing": checkpointing,
            "zero3": self.engine.name != "zero3",
            "fsdp2": self.engine.name != "fsdp2",
            "sequence": self.heads and self.group_sizes(self.world),
            "nodes": True,
            "lora": not r.model.use_peft,
            "shorter": budget and (t.max_length or 0) > MIN_MAX_LENGTH,
        }
        return [lever for lever, offered in applies.items() if offered]

    def cached(self, trial: Trial) -> bool:
        trial.recipe = replaced(trial.recipe, training={"precompute_ref_log_probs": True})
        trial.flags += ["--precompute_ref_log_probs", "true"]
        return True

    def checkpointing(self, trial: Trial) -> bool:
        every_layer = checkpointing_fields(trial.recipe.training, {"every_n_layers": 1})
        given = trial.recipe.given | {"activation_checkpointing", "activation_checkpointing_kwargs"}
        trial.recipe = replace(replaced(trial.recipe, training=every_layer), given=given)
        trial.flags += [
            "--activation_checkpointing",
            "true",
            "--activation_checkpointing_kwargs",
            '{"every_n_layers": 1}',  # a word, quoted where printed
        ]
        return True

    def engine_lever(self, kind: str, trial: Trial) -> bool:
        # Read once a search: accelerate's loader parses the YAML twice a read, and a search that finds nothing pulls
        # this lever in ~70 combinations (0.24 of its 0.35 CPU-s once its traces are made: the tiny model's dry run)
        if kind not in self._engines:
            self._engines[kind] = from_config(str(ROOT / SHIPPED[kind]))
        trial.engine = self._engines[kind]
        trial.config = SHIPPED[kind]
        trial.recipe = replaced(trial.recipe, project={"accelerate_config": SHIPPED[kind]})
        return True

    def lora(self, trial: Trial) -> bool:
        m, lora = trial.recipe.model, {"use_peft": True}
        trial.flags += ["--use_peft", "true"]
        if not m.lora_target_modules and not m.lora_target_parameters:
            lora["lora_target_modules"] = "all-linear"
            trial.flags += ["--lora_target_modules", "all-linear"]
        if trial.recipe.training.disable_dropout:  # the adapter's dropout as the run resolves it (config.parse_args)
            lora["lora_dropout"] = 0.0
        trial.recipe = replaced(trial.recipe, model=lora)
        return True

    def group_sizes(self, world: int) -> list[int]:
        """The sequence-parallel sizes beyond the recipe's a refusal weighs; none for a forward that cannot split."""
        r, current = self.recipe, self.recipe.project.sequence_parallel_size
        attention, asked = self.attention or r.model.attn_implementation or "", r.model.attn_implementation
        if not r.training.padding_free or attention.endswith("eager"):  # forwards/choice.py: only packed rows split
            return []
        if asked is not None and attention_name(asked) not in split_rows.ATTENTION:
            return []
        return [n for n in sequence_parallel.groups_within(self.per_node, world, self.heads) if n > current]

    def sequence(self, trial: Trial) -> bool:
        """The smallest sequence_parallel_size that fits, under DeepSpeed's engine (Ulysses runs on no other)."""
        if trial.engine.name not in sequence_parallel.ENGINES:
            return False
        for n in self.group_sizes(trial.world):
            trial.recipe = replaced(trial.recipe, project={"sequence_parallel_size": n})
            if self.planned(trial)[0]:
                trial.flags += ["--sequence_parallel_size", str(n)]
                return True
        return False

    def nodes(self, trial: Trial) -> bool:
        """The fewest nodes beyond this job's on which the trial fits, in whole sequence-parallel groups."""
        group, size = trial.recipe.project.sequence_parallel_size, self.per_node
        worlds = [n * size for n in range(self.world // size + 1, MAX_NODES + 1)]
        worlds = [w for w in worlds if w // group <= self.pairs and w % group == 0]
        # more processes never need more memory each
        return self._bisect(trial, worlds, functools.partial(setattr, trial, "world")) is not None

    def tokens(self, trial: Trial, shorten: bool = False) -> bool:
        """The largest token budget that fits, from TOKEN_GRID, still holding a pair of max_length. `shorten` (the
        `shorter` lever, last: longer pairs are cut): the largest max_length below the recipe's that fits (down to
        MIN_MAX_LENGTH), with a budget of one pair of it."""
        r = trial.recipe
        sizes = self._sizes(self.recipe, shorten)  # from the recipe's own max_length and budget, not the trial's

        def use(tokens: int):
            trial.recipe = self._with_budget(r, tokens, shorten)

        best = self._bisect(trial, sizes, use, last=True)  # plans shrink with the tokens (traces are kept)
        if best is None:
            return False
        trial.flags += ["--max_length", str(best // 2)] if shorten else []
        trial.flags += ["--max_tokens_per_microbatch", str(best)]
        return True

    def batch(self, trial: Trial) -> bool:
        """Without a token budget (micro-batches of per_device_train_batch_size pairs): the most pairs per micro-batch
        below the recipe's that fits and divides each data-parallel rank's pairs per step, which stay the run's (the
        command line's batch flag alone would replace them and leave a token budget: docs/running.md)."""
        r, steps = trial.recipe, self.recipe.project.pairs_per_step
        ranks = trial.world // r.project.sequence_parallel_size
        sizes = [n for n in range(1, r.training.per_device_train_batch_size) if steps % (ranks * n) == 0]

        def use(n: int):
            trial.recipe = replaced(r, training={"per_device_train_batch_size": n})

        best = self._bisect(trial, sizes, use, last=True)  # fewer pairs never need more memory
        if best is None:
            return False
        # as docs/running.md gives the flags that keep a recipe's pairs per step in micro-batches of that many pairs
        trial.flags += ["--per_device_train_batch_size", str(best), "--pairs_per_step", str(steps)]
        trial.flags += ["--max_tokens_per_microbatch", "none"]
        return True

    def shorter(self, trial: Trial) -> bool:
        return self.tokens(trial, shorten=True)

    def _bisect(self, trial: Trial, values: list, use, last: bool = False):
        """The first of `values` on which the trial fits (`last`: the last one), fitting being monotone along them;
        `use(value)` sets one on the trial, which is left with the one found. None when none fits."""

        def fits(value) -> bool:
            use(value)
            return self.planned(trial)[0]

        # the first that fits; `last`: the one before the first that does not
        i = bisect.bisect_left(values, True, key=(lambda v: not fits(v)) if last else fits) - last
        if not 0 <= i < len(values):
            return None
        use(values[i])
        return values[i]

    def _sizes(self, recipe, shorten: bool) -> list[int]:
        pair = 2 * (recipe.training.max_length or 0)  # a micro-batch holds at least one whole pair
        current = recipe.project.max_tokens_per_microbatch
        if shorten:
            return [g for g in TOKEN_GRID if 2 * MIN_MAX_LENGTH <= g < min(pair, current + 1)]
        return [g for g in TOKEN_GRID if pair <= g < current]

    @staticmethod
    def _with_budget(recipe, tokens: int, shorten: bool):
        shorter = {"training": {"max_length": tokens // 2}} if shorten else {}
        return replaced(recipe, project={"max_tokens_per_microbatch": tokens}, **shorter)

    # --- combinations ---

    def attempt(self, combo: tuple[str, ...]) -> Option | None:
        trial = Trial(self.recipe, self.engine, self.world, [], self.config)
        # Fixed changes first, then the searched ones (nodes, then tokens: the largest budget for the rest).
        budget = next((lever for lever in combo if lever in ("tokens", "shorter")), None)
        if budget and {"nodes", "sequence"} & set(combo):  # the fewest nodes (smallest group) at the smallest budget,
            # then the largest budget on them
            sizes = self._sizes(self.recipe, budget == "shorter")
            if not sizes:
                return None
            trial.recipe = self._with_budget(trial.recipe, sizes[0], budget == "shorter")
        for lever in sorted(combo, key=lambda lever: SEARCHED.index(lever) + 1 if lever in SEARCHED else 0):
            pull = (lambda t, k=lever: self.engine_lever(k, t)) if lever in SHIPPED else getattr(self, lever)
            if not pull(trial):
                return None
        fits, gib = self.planned(trial)
        if not fits:
            return None
        moves = trial.engine is not self.engine or trial.world != self.world
        return Option(
            combo,
            tuple(trial.flags),
            trial.engine.name,
            trial.config,
            trial.world,
            self.per_node,
            gib,
            moves,
            trial.recipe.project.max_tokens_per_microbatch,
            trial.recipe.project.sequence_parallel_size,
        )

    def options(self) -> list[Option]:
        """Fewest changes first; splitting sequences (`sequence`) only where nothing fits a whole pair on each GPU (it
        exchanges every layer's attention inputs), and cutting pairs shorter (`shorter`) only where nothing that keeps
        them whole fits."""
        levers = self.levers()
        whole = [lever for lever in levers if lever != "shorter"]
        per_gpu = [lever for lever in whole if lever != "sequence"]
        return (self._search(per_gpu) or self._search(whole) or self._search(levers))[:MOST_OPTIONS]

    def _search(self, levers: list[str]) -> list[Option]:
        found = []
        for size in (1, 2, 3, 4):
            for combo in itertools.combinations(levers, size):
                if sum(lever in ("zero3", "fsdp2") for lever in combo) > 1 or {"tokens", "shorter"} <= set(combo):
                    continue  # one engine at a time; one token budget
                smaller = [o for o in found if set(o.levers) <= set(combo)]
                if any(not set(o.levers) & set(SEARCHED) for o in smaller):
                    continue  # a smaller set of these changes fits already
                option = self.attempt(combo)
                # A searched lever found with fewer changes stays offered; one more change only where it buys fewer
                # nodes, more tokens per micro-batch or a smaller group (ZeRO-3 on 2 nodes rather than ZeRO-2 on 3).
                if option and all(option.better_than(o) for o in smaller):
                    found.append(option)
            if len(found) >= MOST_OPTIONS or (found and size > min(len(o.levers) for o in found)):
                break  # the fewest changes that fit, and the sets one larger (another engine on more nodes, say)
        return found


def advice(recipe, world: int, engine: Engine, attention: str | None, gpu_gib: float, plan: Callable, heads) -> str:
    """The refusal's second half: each option that fits, as flags to add and the submission, or why none does.
    `heads`: the model's (attention heads, key/value heads), for sequence parallelism (None: not weighed)."""
    advisor = Advisor(recipe, world, engine, attention, plan, heads)
    options = advisor.options()
    if not options:
        cached = "the cached reference, " if "cached" in advisor.levers() else ""
        return (
            f"no change this run can make fits a {gpu_gib:.1f} GiB GPU on up to {MAX_NODES} nodes ({cached}fewer "
            f"tokens per micro-batch, activation checkpointing, ZeRO-3, FSDP2, sequence parallelism within a node, "
            f"more nodes, LoRA, max_length down to {MIN_MAX_LENGTH}, and up to four of them together were "
            "planned): plan for larger GPUs with --gpu_memory_gib"
        )
    listed = "; ".join(f"[{i}] {o.text(recipe.command_line)}" for i, o in enumerate(options, 1))
    return f"these fit: {listed}"

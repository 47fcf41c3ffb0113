"""The parsed recipe is the user's intent, never written after `parse_args`; the first half returns one frozen value
(`stages.RunSpec`) holding every decision in its own section, and `stages.as_run` is the one function that lays them
into a recipe (a new one, `config.replaced`).

Two checks: the source (no assignment to, or mutation of, anything reached through a recipe, in dpotrain/, train_dpo.py
and scripts/), and a run's stages on the CPU demo (the recipe's every field the same after them)."""

import ast
import dataclasses
import functools
import json
from pathlib import Path

import datasets
import pytest

from conftest import ROOT, parse_once, walk_once
from dpotrain import stages
from dpotrain.data import builtin
from dpotrain.recipe import config
from dpotrain.recipe.config import parse_args

SOURCES = [*sorted((ROOT / "dpotrain").rglob("*.py")), ROOT / "train_dpo.py", *sorted((ROOT / "scripts").glob("*.py"))]
# Methods that change a list, set or dict in place: called on something reached through a recipe, they write it.
MUTATORS = {"add", "update", "append", "extend", "insert", "pop", "popitem", "remove", "discard", "clear", "setdefault"}
# The one function that makes a recipe with fields replaced (it sets fields of parts it has just copied).
REPLACED = ("dpotrain/recipe/config.py", "replaced")


def _through_recipe(node) -> bool:
    """Whether an expression is reached through a recipe: a name `recipe`, or an attribute `.recipe` on the way."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr == "recipe":
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id == "recipe"


def _root(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _aliases(function) -> set[str]:
    """Local names bound to a part of a recipe (`t, p = recipe.training, recipe.project`)."""
    names = set()
    for node in walk_once(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            both = isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
            pairs = zip(target.elts, value.elts, strict=False) if both else [(target, value)]
            for name, bound in pairs:
                if isinstance(name, ast.Name) and isinstance(bound, (ast.Attribute, ast.Subscript)):
                    if _through_recipe(bound) or _root(bound) in names:
                        names.add(name.id)
    return names


def _written(target, aliases: set[str]) -> bool:
    """Whether an assignment's target is inside something reached through a recipe (not `trial.recipe = ...`)."""
    if not isinstance(target, (ast.Attribute, ast.Subscript)):
        return False
    return _through_recipe(target.value) or _root(target) in aliases


def writes_to_a_recipe(source: str) -> list[tuple[int, str]]:
    """(line, code) of every assignment to, or in-place change of, something reached through a recipe."""
    found = []
    for function in walk_once(parse_once(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases = _aliases(function)
        written = functools.partial(_written, aliases=aliases)
        for node in walk_once(function):
            targets = []
            if isinstance(node, ast.Assign):
                targets = [
                    t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                ]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args:
                    first = node.args[0]
                    if _through_recipe(first) or _root(first) in aliases:
                        found.append((node.lineno, ast.unparse(node)))
                elif (
                    isinstance(f, ast.Attribute)
                    and f.attr in MUTATORS
                    and (written(f.value) or isinstance(f.value, ast.Name) and f.value.id in aliases)
                ):
                    found.append((node.lineno, ast.unparse(node)))
            found += [(node.lineno, ast.unparse(t)) for t in targets if written(t)]
    return sorted(set(found))


def test_no_module_writes_to_a_parsed_recipe():
    writes = []
    for path in SOURCES:
        relative = str(path.relative_to(ROOT))
        tree = parse_once(path.read_text())
        skip = set()
        if relative == REPLACED[0]:
            new = next(f for f in walk_once(tree) if isinstance(f, ast.FunctionDef) and f.name == REPLACED[1])
            skip = set(range(new.lineno, new.end_lineno + 1))
        writes += [
            f"{relative}:{line}: {code}" for line, code in writes_to_a_recipe(path.read_text()) if line not in skip
        ]
    assert not writes, "the parsed recipe is intent: return the decision from the stage instead\n" + "\n".join(writes)


@pytest.mark.parametrize(
    "code",
    [
        "def f(recipe):\n    recipe.training.max_length = 4\n",
        "def f(recipe):\n    t = recipe.training\n    t.max_length = 4\n",
        "def f(recipe):\n    t, p = recipe.training, recipe.project\n    p.pairs_per_step += 1\n",
        "def f(self):\n    self.recipe.model.dtype = 'bfloat16'\n",
        "def f(recipe):\n    setattr(recipe.training, 'max_length', 4)\n",
        "def f(recipe):\n    recipe.given.add('max_length')\n",
        "def f(recipe):\n    given = recipe.given\n    given.add('max_length')\n",
        "def f(recipe):\n    recipe.training.model_init_kwargs['dtype'] = 'bfloat16'\n",
    ],
)
def test_the_source_check_finds_each_kind_of_write(code):
    assert writes_to_a_recipe(code), code


def test_the_source_check_leaves_copies_and_other_objects_alone():
    code = (
        "def f(recipe, trial):\n    trial.recipe = config.replaced(recipe)\n    args = copy.copy(x)\n"
        "    args.max_length = 4\n    self.recipe = recipe\n"
    )
    assert writes_to_a_recipe(code) == []


def _fields(recipe) -> str:
    """Every field of every part, as resolved_config.json would write them (the intent: nothing decided)."""
    parts = {name: dataclasses.asdict(getattr(recipe, name)) for name in ("script", "model", "project")}
    parts["training"] = recipe.training.to_dict()
    parts["top"] = [recipe.config_path, recipe.max_length_auto, sorted(recipe.given)]
    return json.dumps(parts, sort_keys=True, default=str)


@pytest.mark.slow
def test_the_first_half_leaves_the_recipe_as_parsed_and_returns_one_frozen_value(tmp_path, tiny_model_dir):
    """The CPU demo's stages, through the trainer: the recipe is the same after them, field by field; what they
    decided (max_length under auto, the forward's attention, the load dtype, pairs per step) is in the resolved
    value's recipe of the run (`as_run`) and in TRL's arguments."""
    from dpotrain import train_stage

    recipe = parse_args(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            "--max_steps",
            "1",
            "--pairs_per_step",
            "8",
        ]
    )
    before = _fields(recipe)
    launch = stages.checks(recipe)
    output, _ = stages.output_checks(recipe, launch, _push(recipe, launch))
    pairs = datasets.Dataset.from_list(builtin.make_preference_rows(24, seed=3))
    resolved = stages.first_half(recipe, launch, output=output, pairs=stages.given_pairs(recipe, launch, pairs))
    trainer = train_stage.build_run(resolved).trainer
    assert _fields(recipe) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.memory = {}  # type: ignore[misc]
    assert resolved.recipe is recipe and resolved.as_run is not recipe
    run = resolved.as_run
    assert run.model.attn_implementation == resolved.forward.planned.attention
    assert run.training.padding_free == resolved.forward.planned.packed
    assert run.project.pairs_per_step == resolved.pairs_per_step == 8
    assert run.training.precompute_ref_log_probs  # the cached reference: the reference stage scores once
    # TRL's arguments: the run's settings, but one item per optimizer step and TRL's own padding off
    assert trainer.args is not run.training and trainer.args.gradient_accumulation_steps == 1
    assert not trainer.args.padding_free and trainer.args.max_length == run.training.max_length
    assert trainer.args.model_init_kwargs["attn_implementation"] == resolved.forward.planned.attention
    record = resolved.resolved_config(resolved.record())
    assert record["attn_implementation"] == resolved.forward.planned.attention and record["pairs_per_step"] == 8


def _push(recipe, launch):
    from dpotrain.hub import hub

    return hub.take_push_settings(recipe, launch.engine)


def test_replaced_copies_and_never_writes_the_original(tiny_model_dir):
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", tiny_model_dir])
    before = _fields(recipe)
    run = config.replaced(recipe, training={"max_length": 77}, project={"pairs_per_step": 3})
    assert (run.training.max_length, run.project.pairs_per_step) == (77, 3)
    assert _fields(recipe) == before and run.model is recipe.model  # parts not decided are shared, never written
    with pytest.raises(AttributeError, match="no field 'max_lenght'"):
        config.replaced(recipe, training={"max_lenght": 1})


@pytest.mark.slow
def test_every_recipe_is_resolved_the_same_by_a_dry_run_and_leaves_its_file(tmp_path):
    """Each shipped recipe's dry run (the first half on the launch its accelerate config describes) leaves the recipe
    as parsed: the recipes the package ships are resolved without a write."""
    for name in ("think", "instruct", "smoke"):
        recipe = parse_args(
            ["--config", str(ROOT / "configs" / f"{name}.yaml"), "--dry-run", "--output_dir", str(tmp_path / name)]
        )
        before = _fields(recipe)
        launch = stages.checks(recipe)
        stages.first_half(recipe, launch, output=stages.output_checks(recipe, launch, _push(recipe, launch))[0])
        assert _fields(recipe) == before, name
        assert Path(ROOT / "configs" / f"{name}.yaml").is_file()


def test_output_checks_join_the_same_collectives_whatever_a_rank_decided(tmp_path, tiny_model_dir, monkeypatch):
    """A rank that sees a checkpoint (resume) and one that does not (a node-local output_dir: a fresh start) join the
    same collectives in the same order; one that skipped a gather another joined waited there until the timeout."""
    from conftest import sealed_checkpoint
    from dpotrain.cluster import collectives

    joined = []
    for name in ("every_rank", "main_outcome"):  # the real collectives, each call recorded by name
        real = getattr(collectives, name)
        monkeypatch.setattr(collectives, name, functools.partial(_recorded, joined, name, real))

    def collectives_of(output_dir):
        recipe = parse_args(
            ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", tiny_model_dir]
            + ["--output_dir", str(output_dir), "--report_to", "none", "--max_steps", "4"]
        )
        launch = stages.checks(recipe)
        joined.clear()
        decision, _ = stages.output_checks(recipe, launch, _push(recipe, launch))
        return decision, list(joined)

    sealed_checkpoint(tmp_path / "seen" / "checkpoint-2")
    (tmp_path / "seen" / "resolved_config.json").write_text(json.dumps({"derived": {"pairs_per_step": 8}}))
    resumed, seen = collectives_of(tmp_path / "seen")
    fresh, unseen = collectives_of(tmp_path / "unseen")
    assert resumed.resume_from and not fresh.resume_from  # the two decisions differ
    assert seen == unseen


def _recorded(joined, name, real, *args, **kwargs):
    joined.append(name)
    return real(*args, **kwargs)

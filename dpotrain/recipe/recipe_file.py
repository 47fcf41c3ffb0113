"""A recipe's YAML read strictly: a key written twice or a syntax error is one line naming the file and the line.

PyYAML keeps the last of two equal keys without a word (`beta: 5` ... `beta: 0.1` trains with 0.1), and its syntax
errors are several lines of parser state. An empty or comment-only recipe is refused too: it would train TRL's
defaults under the recipe's name. Training (`config.parse_args`) and the analyzer read recipes through here.

A number keeps the text it was written as (`Written`): a recipe's values become command-line words, typed by the same
argparse types as the command line, and PyYAML's YAML 1.1 rewrites a number's text (`model_revision: 1.10` would be the
revision "1.1", `revision: 0123` the octal 83, `save_steps: 0100` 64 steps, `1:30` the number 90).
"""

import copy
import functools
import math
import re
from collections.abc import Hashable
from pathlib import Path

import yaml

from dpotrain.recipe import venv
from dpotrain.recipe.errors import ConfigError, cause


class WrittenInt(int):
    """An int as the recipe wrote it: `.text` is the source text, what a command-line word of it would be."""

    text: str


class WrittenFloat(float):
    """A float as the recipe wrote it (see WrittenInt)."""

    text: str


def written(value) -> str:
    """A recipe's scalar as a command-line word: its source text where it was a number, `str` otherwise."""
    return getattr(value, "text", None) or str(value)


def _number(kind, construct):
    def construct_written(loader, node):
        value = kind(construct(loader, node))  # still a number where it is one (inside a mapping, json.dumps of it)
        # YAML's `.inf`/`.nan` as Python spells them, which argparse reads and the finite-number check then names
        value.text = node.value if math.isfinite(value) else str(value)
        return value

    return construct_written


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice (YAML 1.2 says keys are unique; PyYAML does not check)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            # A merge key (`<<: *base`) is YAML's own, no field: SafeLoader merges it in `super()`, where a key written
            # here overrides the merged one (not given twice); the merged mapping was checked where it was written.
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):  # `[loss_type]: x`: `key in seen` was a TypeError traceback; super()
                continue  # refuses it as YAML's "found unhashable key", with its line
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.name}:{line}: key {key!r} is given twice (first on line {seen[key]}); YAML would keep the "
                    "last one silently: remove one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats that YAML 1.1 reads as text: without a decimal point (`1e-7`, `5E+3`), or with one and an exponent
# without a sign (`1.0e6`, as JSON and Python write it). A field's own value became its float anyway (argparse types
# the word), but one inside a mapping stayed text: `lr_scheduler_kwargs: {min_lr: 1e-7}` failed in the scheduler's
# arithmetic, `model_init_kwargs`' `rope_theta: 1.0e6` in a traceback once the model loaded. Quoted, a value stays text.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)
# A date or time is read as the text written, as no field takes a date: inside a mapping (a mixture entry's `revision:
# 2024-01-01`, a tag named by its day) it was a `datetime.date` that the recipe's JSON words could not hold, a TypeError
# traceback; a field's own (`run_name: 2024-01-01T10:00:00Z`) was Python's spelling of it, "2024-01-01 10:00:00+00:00".
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _number(WrittenInt, yaml.SafeLoader.construct_yaml_int))
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _number(WrittenFloat, yaml.SafeLoader.construct_yaml_float))


def load(path: str | Path) -> dict:
    """The recipe at `path` as a mapping, or a ConfigError naming `path:line` (or an empty recipe)."""
    raw = Path(path).read_bytes()
    if venv.is_utf16(raw):  # was a traceback, or "control character #x0" where it has no byte-order mark
        raise ConfigError(f"{path}: UTF-16 text, not UTF-8: save the recipe as UTF-8")
    text = raw.decode("utf-8", errors="replace")  # a comment saved in Latin-1 (`# réglé`) sets nothing
    recipe = _parsed(str(path), text)
    if "\ufffd" in text and text.encode() != raw:
        _refuse_undecoded(str(path), recipe)
    return copy.deepcopy(recipe)  # the caller's own: parse_args takes its `env:` block out


def _refuse_undecoded(path: str, recipe: dict) -> None:
    """A key or value holding bytes that are not UTF-8 (a recipe saved in Latin-1): read with U+FFFD in their place,
    `run_name: café-dpo` named the run and its folder `caf\ufffd-dpo` without a word."""
    for key, value in recipe.items():
        if "\ufffd" in f"{key}{value}":
            raise ConfigError(
                f"{path}: {key} holds bytes that are not UTF-8 text (it would read {str(value)!r}): save the recipe "
                "as UTF-8"
            )


def value(text: str, name: str) -> object:
    """A command line's value written in YAML (a mixture source: `{path: a.jsonl, amount: 0.5}`), read as a recipe's
    values are (a key given twice refused, numbers as written, a date as text); ValueError naming what does not read.
    `name`: what the value is called in a refusal (its option)."""
    loader = _StrictLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ValueError(cause(e).replace("\n", " ")) from None
    finally:
        loader.dispose()


def loosely(path) -> object:
    """What a recipe that does not read (a draft, a misspelt key, a key given twice) names, as far as PyYAML reads it,
    nothing checked: None where it does not read at all."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def boolean_word(path, key: str, within: tuple[str, ...] = ()) -> str | None:
    """The word (`on`, `No`) YAML read as a boolean in the recipe's `key`, the first under it, as written: a refusal
    quotes it back, not another word. `within`: in a mapping under it, the keys looked in (a mixture entry's names and
    paths; a word under another of its keys was quoted). None where the file does not read or holds none there."""
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=_StrictLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    stack = [v for k, v in getattr(root, "value", []) if isinstance(root, yaml.MappingNode) and k.value == key]
    while stack:
        node = stack.pop(0)
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:bool":
            return node.value
        if isinstance(node, yaml.SequenceNode):
            stack[:0] = node.value
        elif isinstance(node, yaml.MappingNode):
            stack[:0] = [v for k, v in node.value if not within or getattr(k, "value", None) in within]
    return None


@functools.lru_cache(maxsize=32)
def _parsed(path: str, text: str) -> dict:
    """`load`'s mapping, parsed once per content: a run reads its recipe twice (its fields, then whether it names a
    resume_from_checkpoint) and the tests parse the same recipes hundreds of times. A file changed is read anew."""
    try:
        loader = _StrictLoader(text)  # reads every character first: a NUL or a bell was a ReaderError traceback
    except yaml.reader.ReaderError as e:
        line = text[: e.position].count("\n") + 1
        raise ConfigError(
            f"{path}: line {line} holds a control character (#x{e.character:x}), which YAML does not read: remove it"
        ) from None
    loader.name = path
    try:
        recipe = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        what = e.problem or e.context or "a syntax error"
        if e.context and e.context_mark and e.problem_mark and e.context_mark.line != e.problem_mark.line:
            what += f", {e.context} opened on line {e.context_mark.line + 1}"  # an unclosed [ or {, a stray quote
        raise ConfigError(f"{where}: not valid YAML ({what}): fix it (a recipe is `field: value` lines)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({cause(e)})") from None
    finally:
        loader.dispose()
    if recipe is None:  # every field would take TRL's default (beta 0.1, sigmoid, 3 epochs) under this recipe's name
        raise ConfigError(
            f"{path}: the recipe holds no settings (empty, or comments only): write its `field: value` "
            "lines (configs/smoke.yaml is a small one to start from)"
        )
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: a recipe is a YAML mapping of field: value")
    return recipe

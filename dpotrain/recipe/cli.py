"""The scripts' command lines speak train_dpo.py's vocabulary, and a mistyped flag gets a "did you mean".

`Parser` is argparse where every `--long-flag` is also `--long_flag` (a user types either), extra names make the
trainer's name for the same thing work too, and an unknown flag is refused in one `error:` line (a `ConfigError`)
naming the closest known one instead of argparse's usage dump.
"""

import argparse
import itertools
import sys

from dpotrain.recipe import upstream, usage
from dpotrain.recipe.errors import ConfigError, closest, warn

# The flags whose values no line prints (config.without_secrets drops them from a printed command)
TOKEN_FLAGS = ("--hub_token", "--hub-token")
# The spellings of a boolean value, train_dpo.py's (transformers' string_to_bool, which the scripts' flags take too).
TRUE, FALSE = ("true", "yes", "1", "t", "y"), ("false", "no", "0", "f", "n")


def warn_given_twice(argv: list[str], options: dict, exempt=frozenset(), aliases=None) -> None:
    """A field given twice on a command line with two values: the last counts, as argparse and every layered command
    line (defaults, then a user's "$@") expect, and a warning line on stderr says which, where argparse said nothing
    (`--learning_rate 1e-6 ... --learning_rate 2e-6` trained at 2e-6 in silence). The same value twice, however it is
    spelled (`1e-6`, `1.0e-6`), means one thing and is not named. `options`: each `--flag` -> its action; `exempt`: the
    fields a launcher appends to win; `aliases`: an old name -> the field it names (`--gradient_checkpointing`)."""
    seen, aliases = {}, aliases or {}
    for i, word in enumerate(argv):
        name, equals, value = word.partition("=")
        action = options.get(name)
        if action is None or action.dest in exempt:
            continue
        values = [value] if equals else value_words(action.nargs, argv[i + 1 :])
        meaning = _meaning(action, values)
        first = seen.setdefault(aliases.get(action.dest, action.dest), (name, values, meaning, action))
        if first[2] != meaning:
            # a token's values stay unsaid: the line goes to the terminal, a `| tee` log, a Slurm job's log
            then = " ".join(values) or "alone"
            # the field's other name, or its other switch (`--no_x` then `--x true`: not "--no_x ... then true")
            then = f"{name} {then}" if action is not first[3] else then
            both = f"{' '.join(first[1]) or 'alone'}, then {then}"
            both = "two values, not shown: a secret" if name in TOKEN_FLAGS else both
            warn(f"{first[0]} is given twice on the command line ({both}): the last counts")
            seen[aliases.get(action.dest, action.dest)] = (name, values, meaning, action)


def value_words(nargs, after: list[str]) -> list[str]:
    """Of the words after a flag, those argparse would take as its value (`--streaming` none, `--candidates 1 2` all up
    to the next flag)."""
    following = list(itertools.takewhile(lambda w: not w.startswith("--"), after))
    if nargs in (None, "?"):
        return following[:1]
    return following[:nargs] if isinstance(nargs, int) else following


def _meaning(action, values: list[str]):
    """What argparse would make of a flag's words: `1e-6` and `1.0e-6` are one learning rate, `--bf16` alone true."""
    if not values:
        return action.const
    try:
        return [action.type(v) for v in values] if callable(action.type) else values
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return values


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # an abbreviation must not silently mean another flag
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        spellings = []
        for name in names:
            spellings.append(name)
            if name.startswith("--"):
                spellings += [f"--{name[2:].replace('-', '_')}", f"--{name[2:].replace('_', '-')}"]
        return super().add_argument(*dict.fromkeys(spellings), **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is None:  # a person's command line, as train_dpo.py's (a program's words layer on purpose)
            warn_given_twice(sys.argv[1:], upstream.long_flags(self))
        self.words = list(sys.argv[1:] if args is None else args)  # an error names the flag as spelled here
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        # a missing or mistyped value: train_dpo.py's words
        refused = usage.value_refused(message, upstream.long_flags(self), getattr(self, "words", ()))
        if refused:
            raise ConfigError(refused)
        words = message.split(": ", 1)[-1].split()
        unknown = next((w.split("=")[0] for w in words if w.startswith("-")), None)
        if message.startswith("unrecognized arguments") and unknown:
            close = closest(unknown, upstream.long_flags(self))
            hint = f" (did you mean {close}?)" if close else ""
            raise ConfigError(f"unknown argument {unknown!r}{hint}; see {self.prog} --help")
        raise ConfigError(f"{message}; see {self.prog} --help")

"""The scripts' command lines speak train_dpo.py's vocabulary, and a mistyped flag gets a "did you mean".

`Parser` is argparse where every `--long-flag` is also `--long_flag` (a user types either), extra names make the
trainer's name for the same thing work too, and an unknown flag is refused in one `error:` line (a `ConfigError`)
naming the closest known one instead of argparse's usage dump.
"""

import argparse
import difflib

from dpotrain.recipe import upstream
from dpotrain.recipe.errors import ConfigError

# The spellings of a boolean value, train_dpo.py's (transformers' string_to_bool): the scripts take the same ones.
TRUE, FALSE = ("true", "yes", "1", "t", "y"), ("false", "no", "0", "f", "n")


def flag(value: str | bool) -> bool:
    """`--skip_invalid` alone, or `--skip_invalid true|false` as train_dpo.py takes it."""
    if isinstance(value, bool):
        return value
    if value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


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

    def error(self, message: str):
        words = message.split(": ", 1)[-1].split()
        unknown = next((w.split("=")[0] for w in words if w.startswith("-")), None)
        if message.startswith("unrecognized arguments") and unknown:
            close = difflib.get_close_matches(unknown, list(upstream.long_flags(self)), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown argument {unknown!r}{hint}; see {self.prog} --help")
        raise ConfigError(f"{message}; see {self.prog} --help")

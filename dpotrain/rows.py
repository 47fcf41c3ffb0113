"""Is a preference row usable by TRL's DPOTrainer? One check for the analyzer and for training.

`check_row` finds what the trainer would crash on after loading the model (a null side, non-string content, a
message without `role`, text rows mixed with message rows) or silently train on (plain text inside a message data
set, empty completions, chosen identical to rejected). `check_dataset` runs it on every row before training.
"""

import dataclasses
import re
import time

from trl.data_utils import extract_prompt

from .errors import ConfigError

ROW_COLUMNS = ("prompt", "chosen", "rejected", "tools", "chat_template_kwargs")


class InvalidRowError(ConfigError):
    """A row the trainer cannot use: the message names the row index and the column."""

    def __init__(self, index: int, column: str, problem: str, skip_flag: str = "--skip-invalid"):
        self.index, self.column, self.problem = index, column, problem
        super().__init__(
            f"row {index}, column {column!r}: {problem} (fix or remove the row, or pass {skip_flag} to drop and "
            "count such rows instead)"
        )


# --- one row, as the trainer tokenizes it -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """What the trainer decides once, from the first row: message lists or plain text, and extraction or not."""

    conversational: bool
    has_prompt: bool  # a `prompt` column: no extraction
    eos_token: str | None  # appended to plain-text completions

    @classmethod
    def of(cls, first_row: dict, columns, eos_token: str | None) -> "RowFormat":
        # The trainer looks at the first row only (with `is_conversational`: a list of role/content messages). Any
        # list counts here, so that a first row with a malformed message is reported as such; a first row with a
        # null `chosen` tells nothing, so `rejected` decides (the row is then reported as invalid).
        sample = first_row.get("chosen") if first_row.get("chosen") is not None else first_row.get("rejected")
        return cls(isinstance(sample, list), "prompt" in columns, eos_token)


def check_row(row: dict, fmt: RowFormat) -> tuple[str, str] | None:
    """(column, problem) for a row the trainer cannot use or should not see, None for a good row."""
    for column in ("prompt", "chosen", "rejected") if fmt.has_prompt else ("chosen", "rejected"):
        problem = _check_value(row.get(column), fmt.conversational)
        if problem:
            return column, problem
        if fmt.conversational and not row[column]:
            return column, "empty message list" if column == "prompt" else "empty completion (no message)"
    if row["chosen"] == row["rejected"]:
        return "chosen", "identical to `rejected`: the pair expresses no preference"
    if not fmt.has_prompt and fmt.conversational:
        # `extract_prompt` needs both sides to go on after the shared messages; if one side ends within them, its
        # completion is empty (and TRL would take part of the prompt as completion).
        shared = 0
        while (
            shared < min(len(row["chosen"]), len(row["rejected"])) and row["chosen"][shared] == row["rejected"][shared]
        ):
            shared += 1
        for column in ("chosen", "rejected"):
            if len(row[column]) == shared:
                return column, f"empty completion: no message after the {shared} message(s) shared with the other side"
        if shared == 0:
            return "prompt", "`chosen` and `rejected` share no leading message, so there is no prompt to extract"
    example = split_row(row, fmt)
    for column in ("chosen", "rejected"):
        completion = row[column] if fmt.has_prompt else example[column]
        if fmt.conversational and all(not m["content"].strip() for m in completion):
            return column, "empty completion: every completion message has empty content"
        if not fmt.conversational and not completion.removesuffix(fmt.eos_token or "").strip():
            return column, "empty completion"
    return None


def _check_value(value, conversational: bool) -> str | None:
    if value is None:
        return "missing (null)"
    if not conversational:
        if not isinstance(value, str):
            return f"a {type(value).__name__} where the data set has plain text (its first row is text)"
        return None
    if not isinstance(value, list):
        return f"a {type(value).__name__} where the data set has message lists (its first row has messages)"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not a {{'role', 'content'}} mapping"
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"message {i} has no {key!r}"
            if not isinstance(message[key], str):
                return f"message {i} has a non-string {key!r} ({type(message[key]).__name__})"
    return None


def split_row(row: dict, fmt: RowFormat) -> dict:
    """prompt / chosen / rejected as the trainer tokenizes them (prompt extracted, EOS appended to plain text)."""
    if fmt.has_prompt:
        example = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
    else:
        example = extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]})
    if not fmt.conversational and fmt.eos_token:  # DPOTrainer._prepare_dataset's add_eos (None: checks only)
        for column in ("chosen", "rejected"):
            if not example[column].endswith(fmt.eos_token):
                example[column] = example[column] + fmt.eos_token
    for column in ("tools", "chat_template_kwargs"):
        if row.get(column) is not None:
            example[column] = row[column]
    return example


@dataclasses.dataclass
class RowCheck:
    """Rows of a data set that `check_row` refused: {"index", "column", "problem"} each, in data set order."""

    rows: int
    invalid: list[dict]
    seconds: float

    def by_reason(self) -> dict[str, int]:
        """Counts per kind of problem (numbers in the message generalised: `message N has no 'role'`)."""
        counts: dict[str, int] = {}
        for p in self.invalid:
            reason = f"{p['column']}: {re.sub(r'[0-9]+', 'N', p['problem'])}"
            counts[reason] = counts.get(reason, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def summary(self, examples: int = 20) -> dict:
        """For resolved_config.json: how many rows were dropped, why, and the first few of them."""
        return {"rows": self.rows, "dropped": len(self.invalid), "by_reason": self.by_reason(),
                "first": self.invalid[:examples], "seconds": round(self.seconds, 2)}  # fmt: skip


def check_dataset(dataset, eos_token: str | None = None, skip_invalid: bool = False, batch_size: int = 2048):
    """`check_row` on every row of an in-memory `Dataset`. The first bad row raises `InvalidRowError` naming the
    training flag, unless `skip_invalid`: then every bad row is listed in the returned `RowCheck`.

    Rows are read a column batch at a time (Arrow to Python in bulk), which is what keeps 150k rows in seconds.
    """
    start = time.perf_counter()
    columns = [c for c in ROW_COLUMNS if c in dataset.column_names]
    if len(dataset) == 0:
        raise ConfigError("the data set has no rows: check the file or the split")
    fmt = RowFormat.of(dataset[0], columns, eos_token)
    invalid = []
    index = 0
    for batch in dataset.select_columns(columns).iter(batch_size=batch_size):
        for values in zip(*batch.values(), strict=True):
            problem = check_row(dict(zip(columns, values, strict=True)), fmt)
            if problem:
                if not skip_invalid:
                    raise InvalidRowError(index, *problem, skip_flag="--skip_invalid true")
                invalid.append({"index": index, "column": problem[0], "problem": problem[1]})
            index += 1
    return RowCheck(index, invalid, time.perf_counter() - start)


def without_invalid_rows(dataset, skip_invalid: bool, derived: dict, key: str):
    """The data set, refused at its first bad row, or with `skip_invalid` without its bad rows: then they are
    recorded as `derived[key]` (for resolved_config.json) and said on the console."""
    checked = check_dataset(dataset, skip_invalid=skip_invalid)
    if not checked.invalid:
        return dataset
    derived[key] = checked.summary()
    print(f"Dropped {len(checked.invalid)} invalid row(s) of {checked.rows}: {checked.by_reason()}", flush=True)
    bad = {p["index"] for p in checked.invalid}
    return dataset.select([i for i in range(len(dataset)) if i not in bad])

"""Is a preference row usable by TRL's DPOTrainer? One reading and one check for the analyzer and for training.

`read_row` reads a row in any shape `shapes.py` knows into an explicit prompt and its two completions, and refuses
what the trainer would crash on after loading the model (a null side, a message without `role`, ...) or silently
train on (two sides that answer different prompts, empty completions, chosen identical to rejected). `usable_pairs`
runs it on every row before training and hands the trainer the rows as read.
"""

import dataclasses
import functools
import hashlib
import json
import re
import sys
import time
import unicodedata
from collections import Counter
from pathlib import Path

from dpotrain.data import chat_template, data_identity, shapes, stops, turns
from dpotrain.data.data import cached_by_datasets, mixed_type_columns, row_location, row_locations
from dpotrain.data.shapes import ROW_COLUMNS
from dpotrain.recipe.errors import ConfigError, plural, warn

IMAGE_COLUMNS = ("image", "images")  # TRL's DPOTrainer reads a data set with either as a vision one


class InvalidRowError(ConfigError):
    """A row the trainer cannot use: the message names the row index and the column."""

    def __init__(self, index: int, column: str, problem: str, skip_flag: str = "--skip-invalid", where: str = ""):
        self.index, self.column, self.problem, self.skip_flag = index, column, problem, skip_flag
        at = f"{where}; " if where else ""
        super().__init__(
            f"row {index}, column {column!r}: {problem} ({at}fix or remove the row, or pass {skip_flag} to drop and "
            "count such rows instead)"
        )

    def located(self, dataset_name: str, split: str = "train", files=None) -> "InvalidRowError":
        """The same refusal, saying where the row is in the user's file (`data.row_location`: 'line 8 of x.jsonl')."""
        where = row_location(dataset_name, self.index, split, files)
        return InvalidRowError(self.index, self.column, self.problem, self.skip_flag, where)


# --- one row, as the trainer tokenizes it -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """What is decided once, from the first row: the data set's shape (and so message lists or plain text)."""

    shape: shapes.Shape
    eos_token: str | None  # appended to plain-text completions (None: checks only)
    template: object | None = None  # the tokenizer the answers are checked against (chat_template.answer_problem)
    assistant_turns: str = "final"  # the recipe's: under `all` the prompt's earlier assistant turns are trained too
    # Rows the project read already (`usable_pairs`): a "" prompt beside text answers that share no start is the
    # implicit prompt `shapes.read` wrote for a data set without a prompt column, not an export's gap
    read: bool = False

    @classmethod
    def of(
        cls,
        first_row: dict,
        columns,
        eos_token: str | None,
        hh_format: str = "messages",
        template=None,
        assistant_turns: str = "final",
        read: bool = False,
    ) -> "RowFormat":
        """`template`: a tokenizer, or a function that loads it (called for message rows, which it reads, and for
        plain text where `eos_token` is not given: the trainer appends its EOS, which the checks read too);
        `assistant_turns`: the recipe's (which turns are trained)."""
        shape = shapes.Shape.of(first_row, columns, hh_format)
        if callable(template) and not hasattr(template, "apply_chat_template"):
            template = template() if shape.conversational or eos_token is None else None
        if eos_token is None and not shape.conversational and template is not None:
            eos_token = template.eos_token  # a side that differs only in it, or holds it alone, trains nothing
        return cls(shape, eos_token, template if shape.conversational else None, assistant_turns, read)

    @property
    def conversational(self) -> bool:
        return self.shape.conversational


def read_row(
    row: dict, fmt: RowFormat, rendered: dict | None = None, first: bool = False
) -> tuple[dict | None, tuple[str, str] | None]:
    """`(example, None)`: the row as the trainer tokenizes it (`shapes.read`: explicit prompt, extra columns left out,
    no EOS yet), or `(None, (column, problem))` for a row the trainer cannot use or should not see. `rendered`: the
    chat template's texts of a message row checked against it (`chat_template.answer_problem`); `first`: the data
    set's first row, whose kind is the data set's."""
    shape = fmt.shape
    if fmt.template is not None and (problem := chat_template.parts_problem(row, fmt.template)):
        return None, problem  # text parts the template would write otherwise than joined, as decode joins them
    row, problem = shapes.decode(row, shape)  # message lists written as JSON text (CSV, Parquet strings)
    if problem:
        return None, problem
    if problem := _template_input_problem(row):
        return None, problem
    for column in ("prompt", "chosen", "rejected") if shape.name.startswith("prompt+") else ("chosen", "rejected"):
        if problem := _check_value(row.get(column), shape.raw_lists, first, column):
            if column == "prompt" and isinstance(row[column], list) and isinstance(row.get("chosen"), str):
                problem = (  # TRL would join the prompt's messages to the string answers, and fail on every row
                    "a message list, where chosen and rejected are plain text: write each answer as a message list "
                    "([{'role': 'assistant', 'content': ...}]), or the prompt as text"
                )
            return None, (column, problem)
        if shape.raw_lists and not row[column]:
            return None, (column, "empty message list" if column == "prompt" else "empty completion (no message)")
    if shape.name == "ultrafeedback" and (problem := _check_value(row.get("prompt"), False, first)):  # a string prompt
        return None, (
            "prompt",
            problem.replace("plain text (its first row is text)", "a string prompt (its first row has one)"),
        )
    if shapes.given(row["chosen"]) == shapes.given(row["rejected"]):
        return None, ("chosen", "identical to `rejected`: the pair expresses no preference")
    example, problem = shapes.read(row, shape)
    if problem:
        return None, problem
    if problem := _alike(example, fmt):
        return None, ("chosen", problem)
    if fmt.conversational and (problem := _empty_turn(example["prompt"], "user")):
        return None, ("prompt", problem)
    if shape.name == "prompt+text" and blank(example["prompt"]) and not _implicit_prompt(example, fmt):
        return None, ("prompt", EMPTY_PROMPT + unseen(example["prompt"]))
    # An earlier assistant turn of the prompt is trained under `assistant_turns: all` (open-instruct labels every one):
    # an empty one would teach the model to answer with nothing, as an empty final answer would. Under `final` (TRL's
    # split) it is context the model reads and is not trained on: a turn the conversation had (a model that said
    # nothing), which teaches no empty answer; such a pair stays, as it always did.
    every_turn = fmt.conversational and fmt.assistant_turns == "all"
    if every_turn and (problem := _empty_turn(example["prompt"], "assistant", "earlier")):
        return None, ("prompt", problem)
    for column in ("chosen", "rejected"):
        completion = example[column]
        if fmt.conversational and not any(map(_says_something, completion)):
            said = "".join(m.get("content") or "" for m in completion)
            return None, (column, "empty completion: every completion message has empty content" + unseen(said))
        if fmt.conversational and (problem := _empty_turn(completion, "assistant")):
            return None, (column, problem)
        if not fmt.conversational and blank(text := completion.removesuffix(fmt.eos_token or "")):
            return None, (column, "empty completion" + unseen(text))
    if fmt.template is not None:  # the answers against the template's generation prompt
        if problem := chat_template.answer_problem(example, fmt.template, rendered):
            return None, problem
    # open-instruct's labels of the earlier turns (turns.masked_spans): the start's probe judges the template on an
    # earlier answer with its thinking in `content`, and one that drops the thinking of earlier answers from its own
    # field (`reasoning_content`, gpt-oss's `thinking`) passed it, the rows holding one raising inside the trainer's
    # map once the model had loaded. Those rows are judged here, one by one (the others cost nothing more).
    if every_turn and fmt.template is not None and any(map(_thinks, example["prompt"])):
        try:
            turns.masked_spans(example["prompt"], fmt.template, **chat_template.template_kwargs(example))
        except turns.Rewritten as e:
            return None, ("prompt", str(e))
    return example, None


def _template_input_problem(row: dict) -> tuple[str, str] | None:
    """(column, problem) of what TRL hands the chat template beside the messages, where it would stop in a traceback."""
    # TRL spreads a row's chat_template_kwargs into apply_chat_template (`**kwargs`): anything but an object stopped
    # the row check, and TRL's tokenization after it, in a traceback ('str' object has no attribute 'items')
    if (kwargs := row.get("chat_template_kwargs")) is not None and not isinstance(kwargs, dict):
        return (
            "chat_template_kwargs",
            f"a {type(kwargs).__name__}, where the chat template's keyword arguments are an object, which TRL passes "
            'to apply_chat_template as keywords: write it as one, e.g. {"enable_thinking": false}',
        )
    # TRL reads a text `tools` as JSON (json.loads): text that is not JSON raised JSONDecodeError in a traceback
    if isinstance(tools := row.get("tools"), str) and (problem := _not_json(tools)):
        return (
            "tools",
            f"a text that is not JSON ({problem}): write the tools as a list of JSON schemas "
            '([{"type": "function", "function": {"name": ..., "parameters": ...}}]), or as the JSON text of one',
        )
    return None


def _not_json(text: str) -> str | None:
    """Why `text` is not JSON (json's words, where), or None."""
    try:
        json.loads(text)
    except ValueError as e:
        return f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
    return None


THINKING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # where chat templates read an answer's thinking


def _thinks(message: dict) -> bool:
    """Whether an assistant message holds its thinking in a field of its own (`THINKING_FIELDS`)."""
    return message.get("role") == "assistant" and any(message.get(key) for key in THINKING_FIELDS)


def _alike(example: dict, fmt: RowFormat) -> str | None:
    """Why the sides of a read pair express no preference (`chosen`'s problem), or None."""
    if shapes.given(example["chosen"]) == shapes.given(example["rejected"]):
        return "identical to `rejected` once read: the pair expresses no preference"
    if not fmt.conversational and (eos := fmt.eos_token) and _same_but_eos(example, eos):
        return (
            f"identical to `rejected` but for the EOS token {eos!r} one side ends with, which the trainer appends to "
            "a side without it: both are the same tokens, and the pair expresses no preference"
        )
    if _same_but_white_space(example["chosen"], example["rejected"]):
        return (
            "identical to `rejected` but for white space at the start or end of a message: the pair expresses no "
            "preference (it would train a taste for that white space; under a chat template that trims content, "
            "which many do, both sides are the same tokens)"
        )
    return None


def _same_but_eos(example: dict, eos: str) -> bool:
    """Whether plain-text sides differ only in the EOS text one ends with: `split_row` (TRL's add_eos) appends it to
    the other, and both train as the same tokens (a pair at ln 2 with no gradient)."""
    return example["chosen"].removesuffix(eos) == example["rejected"].removesuffix(eos)


def _same_but_white_space(chosen, rejected) -> bool:
    """Whether two completions are the same but for the white space around their text (each message's): an export that
    strips one column and not the other. Message by message, left at the first content that differs (most pairs)."""
    if isinstance(chosen, str) or isinstance(rejected, str):
        return isinstance(chosen, str) and isinstance(rejected, str) and chosen.strip() == rejected.strip()
    if len(chosen) != len(rejected):
        return False
    for a, b in zip(chosen, rejected, strict=True):
        x, y = a.get("content"), b.get("content")
        if not (x == y or isinstance(x, str) and isinstance(y, str) and x.strip() == y.strip()):
            return False
    return shapes.given([{**m, "content": None} for m in chosen]) == shapes.given(
        [{**m, "content": None} for m in rejected]
    )


# The roles chat templates render (OpenAI's, which transformers and TRL follow; `developer`, `function`, `ipython` and
# `environment` are other templates' names for system and tool turns).
ROLES = {"system", "user", "assistant", "tool", "developer", "function", "ipython", "environment"}


def _check_value(value, conversational: bool, first: bool = False, column: str | None = None) -> str | None:
    if value is None:
        return "missing (null)"
    if isinstance(value, dict) and ("role" in value or "from" in value):  # TRL reads neither shape: a list is needed
        return "one message, not a list of messages: write it as a list ([{'role': 'assistant', 'content': ...}])"
    # The data set's kind is read from its first row (shapes.Shape.of): of that row itself, no other row to follow
    why, like = ("read from its first row, this one", "") if first else (None, ", as the first row is")
    if not conversational:
        if not isinstance(value, str) and column == "prompt":  # the kind is read from the answers, not the prompt
            return f"{_a(value)} where the data set has plain text (its answers are text): write the prompt as text"
        if not isinstance(value, str):
            kind = why or "its first row is text"
            return f"{_a(value)} where the data set has plain text ({kind}): write it as text{like}"
        return None
    if not isinstance(value, list):
        return (
            f"{_a(value)} where the data set has message lists ({why or 'its first row has messages'}): write it as a "
            f"list of messages ([{{'role': 'assistant', 'content': ...}}]){like}"
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is {_a(message)}, not a {{'role', 'content'}} mapping"
        for key in ("role", "content"):
            if key == "content" and message.get(key) is None and message.get("tool_calls"):
                continue  # a tool call without text, as TRL's data sets write it: the template renders its calls
            if message.get(key) is None:
                if "from" in message and "value" in message:  # ShareGPT's spelling, which chat templates do not read
                    return (
                        f"message {i} has no {key!r}: it is written ShareGPT's way ('from', 'value'); rename them "
                        "'role' and 'content', with 'human' as 'user' and 'gpt' as 'assistant'"
                    )
                return f"message {i} has no {key!r}"
            if key == "content" and isinstance(message[key], list):  # text parts alone are joined (shapes.text_parts)
                part = next(p for p in message[key] if not shapes.is_text_part(p))
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return (
                    f"message {i} has a {kind!r} part in its content, and dpotrain trains text only (TRL trains "
                    "images with a vision-language model): keep only its text parts ({'type': 'text', 'text': ...})"
                )
            if not isinstance(message[key], str):
                parts = " or a list of text parts ([{'type': 'text', 'text': ...}])" if key == "content" else ""
                return (
                    f"message {i} has a non-string {key!r} ({type(message[key]).__name__}): write it as a "
                    f"string{parts}, which the chat template reads"
                )
        if message["role"] not in ROLES:  # read as something else further on ("a prompt followed by another prompt")
            return (
                f"message {i} has role {message['role']!r}, which chat templates do not know: use 'assistant' "
                "for the model's turns ('user', 'system', 'tool' for the others)"
            )
    return None


def _a(value) -> str:
    """'an int', 'a list': the value's type with its article (it read 'a int')."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


# Characters a reader does not see, which `str.strip` keeps: format characters (Unicode category Cf: zero-width space,
# joiners, word joiner, the BOM U+FEFF an editor leaves) and NUL. An answer made of nothing else (with white space) is
# empty in all but name: it passed the empty check and trained an answer nobody wrote. A NUL inside text is kept as
# text: byte-level tokenizers (OLMo's, Llama 3's, Qwen's) write it as a byte token and decode it back.
def blank(text: str) -> bool:
    """Whether `text` shows nothing: white space, format characters and NULs alone (or nothing at all)."""
    return all(c.isspace() or c == "\0" or unicodedata.category(c) == "Cf" for c in text)


def unseen(text: str) -> str:
    """How an empty refusal names text `blank` alone finds empty: its characters, which an editor does not show."""
    if not text.strip():
        return ""
    codes = ", ".join(f"U+{ord(c):04X}" for c in dict.fromkeys(text) if not c.isspace())
    return f" (only characters a reader does not see: {codes})"


def _implicit_prompt(example: dict, fmt: RowFormat) -> bool:
    """Whether an empty prompt is the one `shapes.read` gave text answers without a prompt column that share no start
    (a data set's own shape, trained as TRL trains it), in rows read already (`RowFormat.read`)."""
    return fmt.read and example["prompt"] == "" and example["chosen"][:1] != example["rejected"][:1]


def _says_something(message: dict) -> bool:
    """Whether a message holds anything for the chat template to write: text, or another field the template renders
    (an assistant's `tool_calls`, OLMo's `function_calls`, a `reasoning_content`). A completion that is a tool call is
    an answer: TRL trains its rendered call."""
    extra = (value for key, value in message.items() if key not in ("role", "content", "name"))
    return not blank(message.get("content") or "") or any(isinstance(v, str | list | dict) and v for v in extra)


# A `prompt` column's empty text beside text answers, the plain-text kin of an empty user turn: an export's gap (a
# missing prompt written as ""), not a pair. TRL (1.16) tokenizes "" to no token (OLMo's tokenizer, like most, adds no
# BOS), so the answers train as text nobody asked for, and nothing before an answer's first token predicts it: that
# token is never scored, and a pair whose answers differ there alone (" Yes." / " No.") expresses no preference.
# (Text answers without a prompt column that share no start, TRL's implicit prompt "", are the data set's own shape.)
EMPTY_PROMPT = (
    "empty text (nothing before the answers: the model would learn to answer a question nobody asked, and their "
    "first token, which no prompt token predicts, is never scored): write the prompt, or, for answers that have none, "
    "leave the prompt column out (TRL then takes what the answers share at their start as the prompt)"
)
# The empty turns refused, by role and where: a user turn of the prompt (the chat template renders an empty user turn
# as its header with nothing after it: the model would learn to answer a question nobody asked, an export's gap, not a
# user's intent), and an assistant turn
# of a completion beside the one that answers (an export's trailing `{"role": "assistant", "content": ""}`: rendered
# as a turn of its own, header and end token, it would teach the model to follow its answer with an empty turn).
EMPTY_TURN = {
    "user": "a user turn with empty content (the chat template would render its header with nothing after it)",
    "assistant": "an assistant turn with empty content beside the answer (it would train as an empty turn of its own): "
    "remove it",
    "earlier": "an earlier assistant turn with empty content, which assistant_turns all trains (every assistant turn "
    "is labeled): it would train an empty answer; write the turn's text, or pass --assistant_turns final (the final "
    "answer alone trained, earlier turns read as context)",
}


def _empty_turn(messages: list[dict], role: str, said: str | None = None) -> str | None:
    """The first message of `role` with empty or whitespace-only content (and nothing else the template writes), said
    as `EMPTY_TURN[said or role]`."""
    for i, message in enumerate(messages):
        if message["role"] == role and not _says_something(message):
            return f"message {i} is {EMPTY_TURN[said or role]}" + unseen(message.get("content") or "")
    return None


def split_row(example: dict, fmt: RowFormat) -> dict:
    """A read row as the trainer tokenizes it: EOS appended to plain-text completions (DPOTrainer's add_eos)."""
    if fmt.conversational or not (eos := fmt.eos_token):
        return dict(example)
    return example | {c: example[c] if example[c].endswith(eos) else example[c] + eos for c in ("chosen", "rejected")}


@dataclasses.dataclass
class RowCheck:
    """Rows of a data set that `read_row` refused: {"index", "column", "problem"} each, in data set order."""

    rows: int
    invalid: list[dict]
    seconds: float
    fmt: RowFormat | None = None
    digests: list[bytes] = dataclasses.field(default_factory=list)  # each usable row's `pair_digest`, in order

    @property
    def repeats(self) -> int:
        """Usable rows that repeat an earlier one exactly: trained (or evaluated) once per time they appear."""
        return len(self.digests) - len(set(self.digests))

    def by_reason(self) -> dict[str, int]:
        """Counts per kind of problem (numbers in the message generalised: `message N has no 'role'`)."""
        counts = Counter(
            f"{p['column']}: {re.sub(r'message [0-9]+', 'message N', p['problem'].split(shapes.DETAIL)[0])}"
            for p in self.invalid
        )
        return dict(counts.most_common())  # ties in the order first met

    def summary(self, examples: int = 20) -> dict:
        """For resolved_config.json: how many rows were dropped, why, and the first few of them."""
        return {
            "rows": self.rows,
            "dropped": len(self.invalid),
            "by_reason": self.by_reason(),
            "first": self.invalid[:examples],
            "seconds": round(self.seconds, 2),
        }


def check_text_only(dataset, evaluation: bool = False) -> None:
    """A data set whose `image`/`images` column holds images is refused: TRL trains it only with a vision-language
    model (it refuses a text one), and here the column would go unread, the text trained (`evaluation`: evaluated on)
    without the images it asks about. Counted in Arrow (no image is decoded); a streaming data set by its first row."""
    import datasets
    import pyarrow.compute as pc

    for column in IMAGE_COLUMNS:
        if column not in (dataset.column_names or next(iter(dataset), {})):
            continue
        if isinstance(dataset, datasets.Dataset):
            values = dataset.select_columns([column]).with_format("arrow")[:][column]
            if hasattr(values.type, "value_type"):  # a list of images: an empty one holds none
                values = pc.if_else(pc.greater(pc.list_value_length(values), 0), values, None)
            held = len(values) - values.null_count
            where = f"{held} of {len(values)} rows"
        else:
            held, where = next(iter(dataset))[column] not in (None, []), "its first row"
        if held:
            did = data_identity.EVALUATED if evaluation else data_identity.TRAINED
            raise ConfigError(
                f"the data set holds images (column {column!r}, {where}), and dpotrain trains text only "
                f"(TRL trains such pairs with a vision-language model), so the model would be {did} the text without "
                "the images it speaks of: remove the column to use the text alone"
            )


@dataclasses.dataclass(frozen=True)
class RowRules:
    """How a split's rows are read into pairs (`check_dataset`, `usable_pairs`, each source of `mixture.load`): made
    once from the recipe where the tokenizer is known (`of`), the same for every source of a mixture."""

    skip_invalid: bool = False  # bad rows dropped and counted; else the first is refused
    hh_format: str = "messages"  # how HH-style strings are read (`RowFormat`)
    assistant_turns: str = "final"  # whether the prompt's earlier answers are trained (`read_row`)
    template: object = None  # the tokenizer (or its loader, `stages.ModelTokenizer`) the answers are checked against
    template_file: str | None = None  # the recipe's chat_template_path, named on the console
    evaluation: bool = False  # held-out pairs, which the run evaluates on
    say: bool = True  # what is read and dropped, on the console

    @classmethod
    def of(cls, recipe, template=None, evaluation: bool = False, say: bool = True) -> "RowRules":
        p = recipe.project
        return cls(p.skip_invalid, p.hh_format, p.assistant_turns, template, p.chat_template_path, evaluation, say)


def check_dataset(dataset, rules: RowRules = RowRules()) -> RowCheck:
    """`read_row` on every row of an in-memory `Dataset` (a column batch at a time: 150k rows in seconds), every bad
    row listed in the returned `RowCheck`. Unless `rules.skip_invalid`, bad rows among good ones raise
    `InvalidRowError`: the first, or answers that leave the chat template's generation prompt all together (a data set
    that has one usually has many). Every row bad is for the caller to say (`usable_pairs`): dropping bad rows would
    leave nothing."""
    start = time.perf_counter()
    columns = [c for c in ROW_COLUMNS if c in dataset.column_names]
    if len(dataset) == 0:
        raise ConfigError("the data set has no rows: check the file or the split")
    check_text_only(dataset, rules.evaluation)
    fmt = RowFormat.of(dataset[0], columns, None, rules.hh_format, rules.template, rules.assistant_turns)
    if fmt.template is not None:  # judged on the rows as written: HH strings are read as messages here
        chat_template.require(fmt.template, fmt.shape.name)
    invalid, digests, index = [], [], 0
    for batch in dataset.select_columns(columns).iter(batch_size=2048):
        if stops.stopped():  # a run's read (`stops.stoppable`): a large split's check takes minutes
            raise ReadStopped("stopped as the pairs were checked")
        for values in zip(*batch.values(), strict=True):
            example, problem = read_row(dict(zip(columns, values, strict=True)), fmt, first=index == 0)
            if problem:
                invalid.append({"index": index, "column": problem[0], "problem": problem[1]})
            elif rules.say:  # hashed where every row is read once anyway; by the process that says the counts alone
                digests.append(pair_digest(example))
            index += 1
    checked = RowCheck(index, invalid, time.perf_counter() - start, fmt, digests)
    if rules.skip_invalid or not invalid or len(invalid) == index:
        return checked
    if other := [p for p in invalid if not p["problem"].startswith(chat_template.MISMATCH)]:
        first, problem = other[0], other[0]["problem"]
    else:  # answers that leave the generation prompt only: said all together
        first = invalid[0]
        shown = ", ".join(str(p["index"]) for p in invalid[:10]) + (", ..." if len(invalid) > 10 else "")
        problem = f"{first['problem']}; {len(invalid)} of {index} rows do so (rows {shown})"
    raise InvalidRowError(first["index"], first["column"], problem, "--skip_invalid true")


def pair_digest(example: dict) -> bytes:
    """A pair as the trainer renders it (`read_row`'s example: the prompt explicit whatever the shape, with the tools
    and chat_template_kwargs the template is given), hashed: two rows with the same digest are the same pair, written
    alike or not. Null fields left out at every level: Arrow gives each message of a column every field any message
    of it has (a split with one tool call gives all its messages `tool_calls: null`), and the same pair in another
    split read without them was taken for another."""
    parts = [_without_nulls(example.get(c)) for c in ("prompt", "chosen", "rejected", *shapes.KEPT_COLUMNS)]
    text = json.dumps(parts, sort_keys=True, default=str)  # sorted: a message's keys in any order are the same pair
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def say_repeats(checked: RowCheck, split: str, evaluation: bool, trained: set | None, mixed=False) -> None:
    """Pairs that repeat an earlier one of their split, and held-out pairs the run also trains on (`trained`: the
    training pairs' digests): said, never dropped (open-instruct keeps them too), so a data set's repeats are known.
    `mixed`: a mixture's source, counted as read, before its share is taken (or repeated)."""
    pairs = len(checked.digests)
    if repeats := checked.repeats:
        used = "in the source as read, before its share is taken" if mixed else "evaluated" if evaluation else "trained"
        print(
            f"Data ({split}): {repeats:,} of {plural(pairs, 'pair', ',')} repeat an earlier pair exactly "
            f"({used}{'' if mixed else ' as often as they appear'})",
            flush=True,
        )
    if evaluation and trained and (also := sum(d in trained for d in checked.digests)):
        print(
            f"Data ({split}): {also:,} of the {plural(pairs, 'evaluation pair', ',')} are also training pairs (their "
            "eval loss is on pairs the model trains on)",
            flush=True,
        )


def every_row_invalid(
    checked: RowCheck, split: str, source: str | None, template=None, source_split: str | None = None, files=None
) -> str:
    """One line for a split none of whose rows is usable (`--skip_invalid` is not offered: it would leave nothing): the
    one check every row fails and what fits instead (`chat_template.misfit`, told by the tokenizer the rows were
    checked against: `checked.fmt`'s, else `template`), or the three most common."""
    reasons, first = checked.by_reason(), checked.invalid[0]
    where = row_location(source, first["index"], source_split or split, files) if source else f"row {first['index']}"
    detail = first["problem"].split(shapes.DETAIL, 1)[1:]
    shown = f"; {'first: ' * (checked.rows > 1)}{where}" + (f", {detail[0]}" if detail else "")
    # Answers off the generation prompt are one check however their reasons differ: the text expected where the
    # answer starts (a template that writes something per conversation) or the side that leaves it.
    off_template = all(p["problem"].startswith(chat_template.MISMATCH) for p in checked.invalid)
    if len(reasons) == 1 or off_template:  # said as the first row has it (`message 0`, counted as `message N`)
        problem = first["problem"].split(shapes.DETAIL, 1)[0]
        failed = {p["column"] for p in checked.invalid}
        column = " or ".join(c for c in ("prompt", "chosen", "rejected", *shapes.KEPT_COLUMNS) if c in failed)
        if column == "prompt" and problem == "missing (null)":  # an export's empty column: the pairs hold the prompt
            problem += "; remove the `prompt` column, and each pair's prompt is read from chosen and rejected"
        if first["problem"].startswith(shapes.ANOTHER_PROMPT) and " (assistant): " in first["problem"]:
            problem += (  # two sampled conversations, parting at an earlier answer: what a pair is made of them
                "; where a pair is two conversations that part at an earlier answer, cut both where they part: the "
                "messages before the first answer that differs are the prompt, that answer each side's"
            )
        # A split of one row has one reason: its row, not "every row (1 of 1)"
        n = checked.rows
        every = (
            f"every row of the {split} split ({n} of {n}) fails one check"
            if n > 1
            else f"the only row of the {split} split fails a check"
        )
        tokenizer = checked.fmt.template if checked.fmt else template
        return f"{every}: {column}: {problem}{chat_template.misfit(problem, tokenizer)}{shown}"
    top = "; ".join(f"{n} x {reason}" for reason, n in list(reasons.items())[:3])
    return (
        f"no usable row in the {split} split: all {checked.rows} rows are invalid ({top}{shown}): check that "
        "dataset_name and the split are the ones meant"
    )


def usable_pairs(
    dataset,
    rules: RowRules,
    derived: dict,
    key: str,
    *,
    split="train",
    source: str | None = None,
    dated=None,
    trained: set | None = None,
    mixed: bool = False,
    source_split: str | None = None,
    source_files=None,
):
    """The data set's pairs as the trainer is to tokenize them (`read_row`, as `rules` say), refused at the first bad
    row (located in `source`'s `source_split`, else `split`: `data.row_location`), or with `rules.skip_invalid`
    without the bad rows, recorded as `derived[key]`. No usable row left is refused too: the trainer would fail only
    after loading the model. `dated`: where the template writes the day it renders on, its warning kept there under
    `key`, not said (a mixture says it once, `say_dated`). `trained`: the training pairs' digests, filled by the
    training split's read and counted against by the held-out split's (`say_repeats`); `mixed`: a mixture's source;
    `source_files`: the files `source` is read from, or what gives them, where datasets resolves them from more than
    its name (`data.row_locations`)."""
    try:
        checked = check_dataset(dataset, rules)
    except InvalidRowError as e:
        raise e.located(source, source_split or split, source_files) if source else e from None
    say, template = rules.say, rules.template
    if say:
        fmt = checked.fmt  # message rows without the tokenizer (a dry run's loader gave none): answers not checked
        unchecked = template.unread if fmt.conversational and fmt.template is None and template is not None else None
        shown = chat_template.named(rules.template_file)
        described = fmt.shape.describe(template_file=shown, unchecked=unchecked, assistant_turns=fmt.assistant_turns)
        print(f"Data ({split}): {plural(checked.rows, 'row')}, {described}", flush=True)
        if unread := [c for c in dataset.column_names if c not in ROW_COLUMNS]:
            print(
                f"Data ({split}): {plural(len(unread), 'column', count=False)} not read: {', '.join(unread)} (a pair "
                f"is read from {', '.join(ROW_COLUMNS)}; rename a column to one of them to have it read)",
                flush=True,
            )
    if checked.invalid:
        derived[key] = checked.summary()
        if source:  # each listed row where a refusal names it ('line 9 of my.jsonl'), not by its index alone
            listed = derived[key]["first"]
            where = row_locations(source, [p["index"] for p in listed], source_split or split, files=source_files)
            derived[key]["first"] = [{**p, "where": where[p["index"]]} for p in listed]
        if len(checked.invalid) == checked.rows:
            raise ConfigError(every_row_invalid(checked, split, source, None, source_split, source_files))
        if say:
            dropped = plural(len(checked.invalid), "invalid row")
            print(f"Dropped {dropped} of {checked.rows}: {checked.by_reason()}", flush=True)
        bad = {p["index"] for p in checked.invalid}
        dataset = dataset.select([i for i in range(len(dataset)) if i not in bad])
    if say:
        say_repeats(checked, split, rules.evaluation, trained, mixed)
    if trained is not None and not rules.evaluation:
        trained.update(checked.digests)
    columns = [c for c in ROW_COLUMNS if c in dataset.column_names]
    read = [c for c in columns if c not in shapes.KEPT_COLUMNS]
    selected, features = dataset.select_columns(columns), _parsed_features(dataset, checked.fmt.shape)
    pairs = selected.map(
        _read_pair,
        fn_kwargs={"shape": checked.fmt.shape, "code": reading_code()},
        remove_columns=read,
        features=features,
        desc=f"Reading {split} pairs",
        # a saved data set's maps cache in datasets' cache, from this one on: never in the user's folder
        **cached_by_datasets(selected, _read_pair, checked.fmt.shape, read, features, reading_code()),
    )
    order = [c for c in ROW_COLUMNS if c in pairs.column_names]  # the columns in the order normalize wrote them before
    pairs = no_null_kwargs(pairs.select_columns(order))
    if say and not rules.evaluation and len(pairs):  # judged on the first pair, before the model loads
        if dated is None:
            say_if_dated(checked.fmt, pairs[0])
        elif said := dated_warning(checked.fmt, pairs[0]):
            dated[key] = said
    return pairs


class ReadStopped(stops.PassStopped):
    """A stop was asked as a run read every pair (`stops.stoppable`): nothing read is kept, nor cached."""


def _read_pair(row: dict, shape: shapes.Shape, code: str = "") -> dict:
    """`usable_pairs`' map: `shapes.normalize`, stopped at the row a run's stop is seen at (`stops.stoppable`): the
    map over a large split takes minutes, and a stop waited for its end, past a Slurm GraceTime."""
    if stops.stopped():
        raise ReadStopped("stopped as the pairs were read")
    return shapes.normalize(row, shape, code)


# The modules whose code the maps over the pairs run (`reading_code`)
READING_MODULES = (shapes, sys.modules[__name__], chat_template, turns)


def source_digest(modules) -> str:
    """A digest of `modules`' source files: a cache key that changes with their code."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def reading_code() -> str:
    """A digest of the code the maps over the pairs run (`READING_MODULES`). datasets keys a map's cache by its
    function's name, not its code: after an upgrade that reads rows otherwise (a repeated prompt taken out, another HH
    split), the pairs read by the old code came back from the cache, and trained, while every check ran the new code.
    Keyed by it, the pairs (and TRL's tokenization after them) are made again once."""
    return source_digest(READING_MODULES)


def dated_warning(fmt: RowFormat, pair: dict) -> str | None:
    """The warning where the chat template writes the day it renders on into `pair`'s prompt (`chat_template.dated`;
    `pair`: a usable pair as read, its chat_template_kwargs kept); None where it writes none."""
    if fmt.template is not None and fmt.conversational:
        return chat_template.dated(fmt.template, pair)
    return None


def say_if_dated(fmt: RowFormat, pair: dict) -> None:
    """One warning where the chat template writes the day it renders on into `pair`'s prompt. Said by the run's data
    stage (`usable_pairs`; a mixture's once, `say_dated`) and by the analyzer, which measures with that template and
    whose cache is keyed on the template, not the day it wrote."""
    if said := dated_warning(fmt, pair):
        warn(said)


def say_dated(dated: dict, sources: list[str]) -> None:
    """A mixture's warnings of a template that writes the day (`dated`: by source, as `usable_pairs` kept them), one
    line each, not one a source: the sources it is true of named where the others' rows give the date."""
    for line in dict.fromkeys(dated.values()):
        named = [s for s in sources if dated.get(s) == line]
        warn(
            line
            if len(named) == len(sources)
            else f"{line} (mixture {plural(len(named), 'source', count=False)} {', '.join(named)})"
        )


def first_usable(dataset, hh_format: str, template) -> tuple[RowFormat, dict] | None:
    """The data set's format and its first pair that reads (`read_row`), as the trainer is to tokenize it; None where
    no row does. A streamed data set is read only up to that row."""
    names = dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)).keys())
    columns = [c for c in ROW_COLUMNS if c in names]
    fmt = None
    for index, row in enumerate(dataset.select_columns(columns)):
        fmt = fmt or RowFormat.of(row, columns, None, hh_format, template)
        example, _ = read_row(row, fmt, first=index == 0)
        if example is not None:
            return fmt, example
    return None


def _parsed_features(dataset, shape: shapes.Shape):
    """The read pairs' column types where messages are parsed from JSON text (`shape.json_columns`): datasets' Json,
    each message as written (else the first batch fixes the fields and a later `name` or `tool_calls` fails the map).
    So too where a column is datasets' Json (a field of mixed types, `data.exact_mixed_fields`): the map would keep
    that type for the pairs, and Json keeps text that reads as JSON as it is (the answer `"42"` read back the int)."""
    import datasets

    if not (shape.json_columns and shape.conversational or mixed_type_columns(dataset)):
        return None
    kept = {c: dataset.features[c] for c in shapes.KEPT_COLUMNS if c in dataset.column_names}
    pair = datasets.List(datasets.Json()) if shape.conversational else datasets.Value("string")
    return datasets.Features({**kept, **dict.fromkeys(("prompt", "chosen", "rejected"), pair)})


def null_kwargs(features) -> dict | None:
    """What a row with a null `chat_template_kwargs` is given (`no_null_kwargs`): `{}`, none; None where no row has
    any (or no column)."""
    import datasets

    feature = (features or {}).get("chat_template_kwargs")
    return {} if isinstance(feature, dict | datasets.Json) else None


def no_null_kwargs(pairs):
    """TRL applies a row's `**chat_template_kwargs`: each row gets those it gives (`chat_template.given_kwargs`),
    `{}` where it has none, as datasets' Json (a struct column gives every row every key, null where it has none);
    a column no row fills is dropped."""
    import datasets

    if pairs.features.get("chat_template_kwargs") is None:
        return pairs
    if null_kwargs(pairs.features) is None:  # no row has keyword arguments (an all-null column)
        return pairs.remove_columns("chat_template_kwargs")
    features = pairs.features.copy()
    features["chat_template_kwargs"] = datasets.Json()
    return pairs.map(
        lambda kwargs: {"chat_template_kwargs": chat_template.given_kwargs(kwargs)},
        input_columns="chat_template_kwargs",
        features=features,
        desc="Reading chat_template_kwargs",
    )

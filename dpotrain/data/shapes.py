"""The shapes public preference data sets come in (`messages`, `prompt+messages`, `prompt+text`, `ultrafeedback`, `hh`,
`text`: docs/data.md "The shapes", `Shape.describe`), read into one: an explicit prompt and the two completions.

The shape is decided from the data set's first row (`Shape.of`), then each row is read (`read`). A row that cannot be
read so is a problem `(column, what)`, refused or dropped by `rows.py` like any other invalid row. Other columns are
left out, except the two TRL reads: `tools` and `chat_template_kwargs`.
"""

import dataclasses
import json
import re

from dpotrain.recipe.errors import plural

KEPT_COLUMNS = ("tools", "chat_template_kwargs")  # passed on to the chat template, as DPOTrainer does
ROW_COLUMNS = ("prompt", "chosen", "rejected", *KEPT_COLUMNS)  # every column a pair is read from
HH_FORMATS = ("messages", "text")
DETAIL = " — "  # what follows is this row's own detail, left out of the counts per reason (rows.RowCheck.by_reason)
ANOTHER_PROMPT = "answers another prompt than `chosen` (a pair is two answers to one prompt)" + DETAIL
# `\r\n` line ends too (a file saved on Windows): not read as HH, such strings trained as plain text, no template
HH_TURN = re.compile(r"(?:^|\r?\n\r?\n)(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}
# The prompt's earlier answers are labeled under `assistant_turns: all` (dpotrain/data/turns.py), though in its counts
EVERY_TURN = "assistant_turns all: the prompt's assistant turns are trained too (every turn, as open-instruct's)"
NOT_HH = "not an HH-RLHF conversation (`\\n\\nHuman: ...\\n\\nAssistant: ...`) like the data set's first row"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str  # one of the table's shapes
    conversational: bool  # read into message lists (the chat template applies) or plain text
    json_columns: tuple = ()  # columns whose cells hold message lists as JSON text (CSV, Parquet strings): parsed
    repeats_prompt: bool = False  # prompt+messages (+text) whose first row's sides start with the prompt (its text)
    answers_only: bool = False  # ultrafeedback whose first row's sides hold no user turn: the string prompt is it

    @classmethod
    def of(cls, first_row: dict, columns, hh_format: str = "messages") -> "Shape":
        """The data set's shape, from its first row (a first row with a null `chosen` is judged by `rejected`; the
        row is then reported as invalid)."""
        json_columns = tuple(
            c for c in ("prompt", "chosen", "rejected") if c in columns and json_messages(first_row.get(c)) is not None
        )
        first_row = {**first_row, **{c: json_messages(first_row[c]) for c in json_columns}}
        first_row = {c: text_parts(v) if c in ("prompt", "chosen", "rejected") else v for c, v in first_row.items()}
        side = first_row.get("chosen") if first_row.get("chosen") is not None else first_row.get("rejected")
        prompt = first_row.get("prompt") if "prompt" in columns else None
        # any list: a malformed first message is then reported as such; one message not in a list too (beside a
        # message prompt, read as text, the prompt was blamed: "a list where the data set has plain text")
        if isinstance(side, list) or isinstance(side, dict) and isinstance(prompt, list):
            if "prompt" not in columns:
                return cls("messages", True, json_columns)
            if isinstance(prompt, str):
                asked = isinstance(side, list) and any(isinstance(m, dict) and m.get("role") == "user" for m in side)
                return cls("ultrafeedback", True, json_columns, answers_only=not asked)
            repeats = (
                isinstance(prompt, list) and bool(prompt) and isinstance(side, list) and _starts_with(side, prompt)
            )
            return cls("prompt+messages", True, json_columns, repeats)
        if "prompt" in columns:
            return cls("prompt+text", False, repeats_prompt=_repeats_text(prompt, first_row, columns))
        if isinstance(side, str) and is_hh(side):
            return cls("hh", hh_format == "messages")
        return cls("text", False)

    @property
    def raw_lists(self) -> bool:
        """chosen/rejected are message lists in the file (not only after reading)."""
        return self.name in ("messages", "prompt+messages", "ultrafeedback")

    def describe(
        self,
        tokenizer_name: str | None = None,
        template_file: str | None = None,
        unchecked: str | None = None,
        assistant_turns: str = "final",
    ) -> str:
        """One line for the console and the analyzer's report: what the rows are and how they are tokenized (with the
        model's chat template, or the recipe's `template_file`). `unchecked`: why the answers were not checked against
        the template (a dry run without the model's tokenizer); `assistant_turns`: the recipe's."""
        template = f"the chat template of {tokenizer_name}" if tokenizer_name else "the model's chat template"
        template = f"the chat template {template_file}" if template_file else template
        if assistant_turns == "all" and self.conversational:  # the prompt is TRL's split, but not context alone
            template = f"{EVERY_TURN}; {template}"
        if unchecked:
            template += f" (answers not checked against it: {unchecked})"
        if self.json_columns:
            template += f" ({', '.join(self.json_columns)}: message lists written as JSON text, parsed)"
        return {
            "messages": f"message lists, prompt = the messages before the last assistant turn; {template}",
            "prompt+messages": "message lists with a prompt column"
            + (" whose messages the conversations repeat: read without the repetition" if self.repeats_prompt else "")
            + f"; {template}",
            "ultrafeedback": (
                f"answers as message lists, with a string prompt: read as the user turn before them; {template}"
                if self.answers_only
                else "message lists with a string prompt that repeats the first user turn (UltraFeedback-"
                f"binarized): read without it; {template}"
            ),
            "hh": "HH-RLHF strings (\\n\\nHuman: ... \\n\\nAssistant: ...) "
            + (
                f"turned into message lists; {template} (hh_format: text trains the raw strings)"
                if self.conversational
                else "trained as plain text, no chat template (hh_format: text; `messages` applies the template)"
            ),
            "text": "plain text, prompt = the start chosen and rejected share; no chat template",
            "prompt+text": "plain text with a prompt column"
            + (" that chosen and rejected repeat: read without the repetition" if self.repeats_prompt else "")
            + "; no chat template",
        }[self.name]


def json_messages(value) -> list | None:
    """A message list written as JSON text (`'[{"role": "user", "content": ...}]'`, as CSV files and some Parquet
    exports hold them), parsed; None for anything else."""
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    if isinstance(parsed, list) and parsed and all(isinstance(m, dict) and "role" in m for m in parsed):
        return parsed
    return None


def is_text_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def text_parts(messages):
    """Messages whose content is a list of text parts (`[{"type": "text", "text": ...}]`, OpenAI's way, TRL's vision
    one) with their text joined as the content: what a chat template that takes parts writes for them, where one that
    does not would raise or write the list. A list holding another part (an image) is refused (`rows._check_value`)."""
    if not isinstance(messages, list):
        return messages
    return [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m, dict) and isinstance(m.get("content"), list) and all(map(is_text_part, m["content"]))
        else m
        for m in messages
    ]


def decode(row: dict, shape: Shape) -> tuple[dict, tuple[str, str] | None]:
    """The row with its JSON-text message lists parsed (`shape.json_columns`) and its text parts joined (`text_parts`),
    or the column that is not one where the first row's is, or that is one where the first row's is plain text (it
    would train the JSON)."""
    row = dict(row)
    for column in ("prompt", "chosen", "rejected"):
        value = row.get(column)
        if column in shape.json_columns:
            if value is None:
                continue  # reported as missing by rows.read_row
            parsed = json_messages(value)
            if parsed is None:
                return row, (
                    column,
                    "not a message list written as JSON, as this column is in the data set's first "
                    f"row{DETAIL}{_short(value)}",
                )
            row[column] = parsed
        elif not shape.raw_lists or column == "prompt" and shape.name == "ultrafeedback":
            if json_messages(value) is not None:
                return row, (
                    column,
                    "a message list written as JSON text, where the data set's first row holds plain text: it would be "
                    "tokenized as JSON text; write this column the same way in every row",
                )
        if column in row:
            row[column] = text_parts(row[column])
    return row, None


def is_hh(text: str) -> bool:
    return text.lstrip().startswith("Human:") and "\n\nAssistant:" in text.replace("\r\n", "\n")


def read(row: dict, shape: Shape) -> tuple[dict | None, tuple[str, str] | None]:
    """`({"prompt", "chosen", "rejected", ...}, None)` as the trainer and the analyzer use the row, or `(None,
    (column, problem))`. Values are expected to have the shape's types (`rows.read_row` checks them first)."""
    # An empty HH side is said as such, not as a conversation of another shape
    if shape.name == "hh" and (column := next((c for c in ("chosen", "rejected") if not row[c].strip()), None)):
        return None, (column, "empty: an HH-RLHF conversation (`\\n\\nHuman: ...\\n\\nAssistant: ...`) was expected")
    if shape.name == "prompt+messages":
        example, problem = _explicit_prompt(row["prompt"], row["chosen"], row["rejected"])
    elif shape.name == "prompt+text":
        example, problem = _text_prompt(row["prompt"], row["chosen"], row["rejected"], shape.repeats_prompt)
    elif shape.name == "text":
        problem = _prefix_pair(row["chosen"], row["rejected"])  # then TRL's own reading
        example = None if problem else _common_start(row["chosen"], row["rejected"])
    elif shape.name == "hh" and not shape.conversational:
        example, problem = _hh_text(row["chosen"], row["rejected"])
    else:
        chosen, rejected = row["chosen"], row["rejected"]
        if shape.name == "hh":
            chosen, rejected = hh_messages(chosen), hh_messages(rejected)
            if column := "chosen" if chosen is None else "rejected" if rejected is None else None:
                return None, (column, NOT_HH)
        if shape.name == "ultrafeedback":
            sides, problem = _with_string_prompt(row["prompt"], chosen, rejected)
            if problem:
                return None, problem
            chosen, rejected = sides
        example, problem = _messages(chosen, rejected)
    if problem:
        return None, problem
    return example | {column: row[column] for column in KEPT_COLUMNS if row.get(column) is not None}, None


def _messages(chosen: list, rejected: list) -> tuple[dict | None, tuple[str, str] | None]:
    """Each side's prompt is its messages before its trailing assistant turn(s); the two prompts must be equal."""
    prompt_c, completion_c = split_conversation(chosen)
    prompt_r, completion_r = split_conversation(rejected)
    for column, completion in (("chosen", completion_c), ("rejected", completion_r)):
        if not completion:
            return None, (column, "empty completion: the conversation does not end with an assistant message")
    asked_c, asked_r = given(prompt_c), given(prompt_r)
    if asked_c != asked_r:
        return None, ("rejected", ANOTHER_PROMPT + _first_difference(asked_c, asked_r))
    if not prompt_c:
        return None, ("prompt", "no message before the assistant's answer, so there is no prompt")
    # Assistant messages both answers start with are the prompt's, as TRL's extract_prompt reads them: else both
    # sides would train them (in sigmoid_norm's and ipo's averages, the sft term, the metrics).
    shared = _shared_start(completion_c, completion_r)
    prompt_c, completion_c, completion_r = (
        prompt_c + completion_c[:shared],
        completion_c[shared:],
        completion_r[shared:],
    )
    return {"prompt": prompt_c, "chosen": completion_c, "rejected": completion_r}, None


def _shared_start(a: list, b: list) -> int:
    """How many messages two answers start with alike, leaving each at least its last: where one answer is the start
    of the other, the shorter one would be left without an answer (TRL's extract_prompt leaves it none)."""
    shared = 0
    while shared < min(len(a), len(b)) - 1 and given(a[shared : shared + 1]) == given(b[shared : shared + 1]):
        shared += 1
    return shared


def given(messages):
    """Messages without their null fields, as written: one Arrow schema per column gives each message every field any
    message of the column has (null where absent), so only `chosen`'s might carry `tool_calls`. Text is itself."""
    if not isinstance(messages, list):
        return messages
    return [{key: value for key, value in m.items() if value is not None} for m in messages]


def _starts_with(side: list, prompt: list) -> bool:
    """Whether a conversation holds the prompt's messages (same role, same content but for surrounding white space,
    same tool calls) and then more (its answer)."""
    same = (
        m.get("role") == p.get("role")
        and str(m.get("content")).strip() == str(p.get("content")).strip()
        and m.get("tool_calls") == p.get("tool_calls")
        for m, p in zip(side, prompt, strict=False)
    )
    return len(side) > len(prompt) and all(same)


def _explicit_prompt(prompt: list, chosen: list, rejected: list):
    """A prompt column beside chosen/rejected. TRL (1.16) renders prompt + chosen as given, so sides that repeat the
    prompt are read without it (else trained twice). A side with another user (or system) turn, first or later (a
    follow-up, a tool's result), is refused: TRL would train that turn as answer, which `assistant_turns` never labels
    and the conversations' own shape reads as prompt."""
    repeats = {c: _starts_with(side, prompt) for c, side in (("chosen", chosen), ("rejected", rejected))}
    if all(repeats.values()):
        return _answers_only(prompt, chosen[len(prompt) :], rejected[len(prompt) :])
    for column, other in (("chosen", "rejected"), ("rejected", "chosen")):
        if repeats[other] and not repeats[column]:
            return None, (
                column,
                f"does not start with the `prompt` column's messages while `{other}` does: write "
                "both sides the same way (the whole conversation, or the answer alone)",
            )
    for column, side in (("chosen", chosen), ("rejected", rejected)):
        role = side[0].get("role") if side else None
        if role not in ("assistant", None):
            return None, (
                column,
                f"starts with a {role} message that is not the `prompt` column's, so the prompt would be followed by "
                "another prompt: drop the `prompt` column if the conversations hold the whole exchange, or keep only "
                f"the answer here{DETAIL}{_short(side[0].get('content'))}",
            )
    return _answers_only(prompt, chosen, rejected)


def _repeats_text(prompt, first_row: dict, columns) -> bool:
    """Whether both string sides of the first row start with its string `prompt` (the whole text in each side)."""
    sides = [first_row.get(c) for c in ("chosen", "rejected") if c in columns]
    return (
        isinstance(prompt, str)
        and bool(prompt.strip())
        and len(sides) == 2
        and all(isinstance(side, str) and side.startswith(prompt) for side in sides)
    )


def _text_prompt(prompt: str, chosen: str, rejected: str, repeats: bool):
    """A string prompt column beside string answers. TRL (1.16) tokenizes prompt, then answer, as given, so where the
    data set's sides write the prompt out again (`repeats`: decided by its first row, since a chit-chat answer may begin
    with the words it was asked), a row whose sides both start with it is read without the repetition: else the prompt
    trains twice, the second time as part of every answer. A row of such a data set where one side alone repeats it is
    refused: it cannot be told which text is the answer."""
    starts = {column: side.startswith(prompt) for column, side in (("chosen", chosen), ("rejected", rejected))}
    if not repeats or not any(starts.values()):
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}, None
    if all(starts.values()):
        return {"prompt": prompt, "chosen": chosen[len(prompt) :], "rejected": rejected[len(prompt) :]}, None
    column, other = ("chosen", "rejected") if starts["rejected"] else ("rejected", "chosen")
    return None, (
        column,
        f"does not start with the `prompt` column's text while `{other}` does: write both sides the same way (the "
        "whole text, or the answer alone)",
    )


def _answers_only(prompt: list, chosen: list, rejected: list):
    """The pair, unless a completion holds a turn that is not the assistant's (it would be trained as answer)."""
    for column, side in (("chosen", chosen), ("rejected", rejected)):
        if turn := next((m for m in side if m.get("role") != "assistant"), None):
            return None, (
                column,
                f"holds a {turn.get('role')} message after the `prompt` column's messages and the answer's start, "
                "which TRL would take as part of the answer: put every turn before the final answer in `prompt` "
                f"(the same on both sides), or drop the `prompt` column{DETAIL}{_short(turn.get('content'))}",
            )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}, None


def _prefix_pair(chosen: str, rejected: str) -> tuple[str, str] | None:
    """Text pairs without a prompt column: TRL takes the start both sides share as the prompt. When one side is the
    start of the other, that leaves it its last character as the whole answer (TRL's `extract_prompt`): refused."""
    for column, side, other in (("chosen", chosen, rejected), ("rejected", rejected, chosen)):
        if len(side) < len(other) and other.startswith(side):
            return (
                column,
                f"is the start of `{'rejected' if column == 'chosen' else 'chosen'}`, so the prompt the "
                "two share (their common start) would leave it a one-character answer: give the prompt "
                "in a `prompt` column and only the answers in chosen/rejected",
            )
    return None


def _common_start(chosen: str, rejected: str) -> dict:
    """TRL's `extract_prompt` on text (the shared start, less a space it ends with), but an empty prompt where the sides
    share no start: TRL's step back over the space reads index -1 there."""
    # imported here, not at the top: trl.data_utils imports datasets (seconds), which --help and the refusals skip
    from trl.data_utils import extract_prompt

    if chosen[:1] != rejected[:1]:
        return {"prompt": "", "chosen": chosen, "rejected": rejected}
    return extract_prompt({"chosen": chosen, "rejected": rejected})


def split_conversation(messages: list) -> tuple[list, list]:
    """(prompt, completion): the completion is the trailing run of assistant messages."""
    end = len(messages)
    while end > 0 and messages[end - 1].get("role") == "assistant":
        end -= 1
    return messages[:end], messages[end:]


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            what = x.get("role") if x.get("role") == y.get("role") else f"{x.get('role')} vs {y.get('role')}"
            return f"message {i} ({what}): {_differing(x, y)}"
    return f"chosen's prompt has {plural(len(a), 'message')}, this one {len(b)}"


def _differing(x: dict, y: dict) -> str:
    """Where two messages differ, as the reader can see it. Quoted from their start, two turns that part after it (a
    word changed deep in a long prompt) read the same, `'What is 51 plus 99? Then tell me some...'` twice; so did two
    whose text is the same and a field beside it is not (a `name` on one side)."""
    texts = str(x.get("content")), str(y.get("content"))
    if texts[0] == texts[1]:
        # content 1 and "1" read the same as text: then the content is the key, each shown by its repr (not as text).
        # A key on one side alone (`name: null` in chosen, no `name` here) is said so: both read as "none" before.
        key = next((k for k in sorted({*x, *y}, key=str) if x.get(k, _ABSENT) != y.get(k, _ABSENT)), "content")
        if all(m.get(key) is not None for m in (x, y)) and not all(isinstance(m[key], str) for m in (x, y)):
            return f"the same content, but {key} {_parted(repr(x[key]), repr(y[key]), _cut)}"  # as Python writes it
        shown = ("absent" if key not in m else "none" if m[key] is None else _short(m[key]) for m in (x, y))
        return "the same content, but {} {} in chosen, {} here".format(key, *shown)
    return _parted(*texts, _short)


def _parted(a: str, b: str, show) -> str:
    """Two texts (or two values' reprs) as `show` quotes them, from where they part when that is past the quoted
    start: two lists of tool calls that part at their fourth call read the same twice."""
    at = next((i for i, pair in enumerate(zip(a, b, strict=False)) if len(set(pair)) > 1), min(len(a), len(b)))
    if at < SHORT - 3:  # `show` shows where they part
        return f"{show(a)} in chosen, {show(b)} here"
    a, b = (show("..." + t[at - 10 :]) for t in (a, b))
    return f"{a} in chosen, {b} here (they part at character {at})"


SHORT = 40  # characters of a text a refusal quotes
_ABSENT = object()


def _cut(text: str) -> str:
    """`text` cut to SHORT characters, as written (a value's repr)."""
    return text if len(text) <= SHORT else text[: SHORT - 3] + "..."


def _short(text) -> str:
    return repr(_cut(str(text)))


def _with_string_prompt(prompt: str, chosen: list, rejected: list):
    """UltraFeedback-binarized: the string prompt repeats the conversations' first user turn, so the conversations
    alone are the pair. Sides that hold only the answer get it as their user turn."""
    sides = []
    for column, side in (("chosen", chosen), ("rejected", rejected)):
        user = next((m for m in side if m.get("role") == "user"), None)
        if user is None:
            side = [{"role": "user", "content": prompt}, *side]
        elif user["content"].strip() != prompt.strip():
            detail = f"{DETAIL}{_short(prompt)} vs {_short(user['content'])}"
            return None, (
                "prompt",
                f"the string prompt is not the first user turn of `{column}` (it must repeat "
                f"it, or be left out){detail}",
            )
        sides.append(side)
    return sides, None


def hh_turns(text: str) -> list[tuple[str, str, int]] | None:
    """(role, content, offset where the content starts) of each turn of an HH-RLHF string; None if it is not one."""
    parts = HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        return None
    turns, offset = [], len(parts[0])
    for marker, content in zip(parts[1::2], parts[2::2], strict=True):
        offset = text.index(f"{marker}:", offset) + len(marker) + 1
        turns.append((HH_ROLES[marker], content, offset))
        offset += len(content)
    return turns


def hh_messages(text: str) -> list[dict] | None:
    turns = hh_turns(text)
    return None if turns is None else [{"role": role, "content": content.strip()} for role, content, _ in turns]


def _hh_text(chosen: str, rejected: str):
    """`hh_format: text`: the prompt is the string up to the last `Assistant:`, checked turn by turn."""
    parsed = {}
    for column, text in (("chosen", chosen), ("rejected", rejected)):
        turns = hh_turns(text)
        if turns is None:
            return None, (column, NOT_HH)
        if turns[-1][0] != "assistant":
            return None, (column, "empty completion: the conversation does not end with an Assistant turn")
        parsed[column] = turns
    prompts = {c: [{"role": r, "content": t.strip()} for r, t, _ in turns[:-1]] for c, turns in parsed.items()}
    if prompts["chosen"] != prompts["rejected"]:
        return None, ("rejected", ANOTHER_PROMPT + _first_difference(prompts["chosen"], prompts["rejected"]))
    cut = parsed["chosen"][-1][2]
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[parsed["rejected"][-1][2] :]}, None


def normalize(row: dict, shape: Shape, code: str = "") -> dict:
    """`read` of a row known to be valid, for `Dataset.map` (the data set the trainer tokenizes). `code`
    (`rows.reading_code`) only keys the map's cache."""
    row, problem = decode(row, shape)
    example, problem = (None, problem) if problem else read(row, shape)
    if problem:  # rows.usable_pairs checked every row first
        raise ValueError(f"row not readable as {shape.name}: {problem}")
    # The columns passed on stay the data set's own (`rows.usable_pairs`): datasets' map takes its keys from the first
    # row, and would fail on or drop a value that row lacks.
    return {column: value for column, value in example.items() if column not in KEPT_COLUMNS}

"""The chat template a recipe chooses (`chat_template_path`), and what a pair's answers must be to be read under it.

`lengths.load_tokenizer` sets it on every tokenizer the project loads, so all of them tokenize alike. Its content, not
its path, is what a run depends on: its SHA-256 is recorded (`record`) and a resume whose template reads differently is
refused (`changed`). `answer_problem`: TRL splits a pair where the tokenized prompt (with the generation prompt) and
prompt + answer diverge, open-instruct (OLMo 3) by the prompt's length; they agree only where the rendered answer
begins with the generation prompt (docs/data.md "Answers and the generation prompt").
"""

import hashlib
import json
import os
from pathlib import Path

from dpotrain.data.shapes import DETAIL, is_text_part
from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.run_record import Template

MISMATCH = "the answer does not begin with the chat template's generation prompt"
TEMPLATE_ERROR = "chat template error"  # the template refuses the row (lengths.py's analyzer says the same)
FILE = "chat_template.jinja"  # the name transformers 5 saves a tokenizer's template under
SHOWN = 40  # characters of an answer shown where it leaves the generation prompt
OLMO_THINK_PROMPT = "<|im_start|>assistant\n<think>"  # olmo_thinker's generation prompt (configs/templates)
THINK_END = "</think>"  # where a thinking block ends, in the answers of reasoning models' data


def template_file(path: str) -> Path:
    """The Jinja file `path` names (itself, or a folder's chat_template.jinja); refused in one line if there is none."""
    given = Path(path).expanduser()
    if given.is_dir():
        if not (given / FILE).is_file():
            raise ConfigError(
                f"chat_template_path {path!r} is a folder without {FILE}: name the template file "
                f"itself, or a tokenizer folder saved with its template"
            )
        return given / FILE
    if given.exists() and not given.is_file():
        # `<(curl ...)`: a pipe was said not to exist, and a pipe is empty once read (each resume compares the template)
        raise ConfigError(
            f"chat_template_path {path!r} is not a file or a folder (a pipe or a device): write the template to a "
            ".jinja file first and give that file"
        )
    if not given.is_file():
        # `--chat_template_path none` on a recipe naming one (think.yaml) meant the model's own: no word said how
        own = " (for the model's own template: --chat_template_path '')" if path.lower() in ("none", "null") else ""
        raise ConfigError(
            f"chat_template_path {path!r} does not exist: give a .jinja file (e.g. "
            "configs/templates/olmo_thinker.jinja) or a folder holding chat_template.jinja, relative to "
            f"the folder you run from{own}"
        )
    return given


def named(path: str | None) -> str | None:
    """The name the run's Data line and the analyzer's output give the template a recipe chooses: the file read, a
    folder's chat_template.jinja (the run named the folder where the analyzer named the file), else `path` as given."""
    if not path:
        return None
    return str(Path(path) / FILE) if Path(path).expanduser().is_dir() else path


def check(path: str | None) -> None:
    """Before anything loads: the file is there and reads as text."""
    if path:
        read(path)


def read(path: str) -> str:
    file = template_file(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"chat_template_path {path!r}: cannot read {file} ({e}): give a readable UTF-8 Jinja file"
        ) from None
    if (form := _json_form(text)) is not None:
        raise ConfigError(
            f"chat_template_path {path!r} is JSON ({form}), not a Jinja template: {_jinja_fix(file, form)}"
        )
    if not text.strip():  # transformers reads an empty template as none: the run then said to give one
        raise ConfigError(
            f"chat_template_path {path!r}: {file} is empty: give a Jinja chat template (e.g. "
            "configs/templates/olmo_thinker.jinja), or leave chat_template_path out for the model's own"
        )
    return text


def _json_form(text: str) -> str | None:
    """What a template file holding JSON is (a processor's chat_template.json, `{"chat_template": "..."}`, or a
    tokenizer_config.json), or None for Jinja text: read as Jinja, the JSON's quotes and escapes became template text,
    and every pair was refused as not beginning with the generation prompt, naming the data."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:  # Jinja ({% ... %}, {{ ... }}) is no JSON
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("chat_template"), str):
        return "a processor's chat_template.json" if len(value) == 1 else "a tokenizer_config.json"
    return "an object without a chat_template text"


def _jinja_fix(file: Path, form: str) -> str:
    """What to give in place of a JSON template file (`_json_form`): the command that writes its `chat_template` as a
    .jinja file, where it holds one."""
    import shlex

    if "without" in form:
        return "give a .jinja file holding the template itself (e.g. configs/templates/olmo_thinker.jinja)"
    code = "import json, sys; sys.stdout.write(json.load(open(sys.argv[1]))['chat_template'])"
    return (
        f'write its template to a .jinja file and give that: python -c "{code}" {shlex.quote(str(file))} > FILE.jinja'
    )


def apply(tokenizer, path: str | None):
    """`tokenizer` with the template `path` names (unchanged without one): saved with it, as the run trained."""
    if path:
        tokenizer.chat_template = read(path)
        tokenizer.chat_template_file = named(path)  # what the analyzer's report says it read rows with
    return tokenizer


def unread_text(unread: str | None) -> str:
    """Why a dry run has no model tokenizer, as its summary says it (the template line, the data line): `unread`, what
    went wrong reading its files here, else that it is not on this machine."""
    return f"its tokenizer could not be read here: {unread}" if unread else "its tokenizer is not on this machine"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def text_of(template: str | dict | None) -> str | None:
    """A tokenizer's template as one text: a tokenizer saved with several (additional_chat_templates/, a list in its
    tokenizer_config.json: Command R's `tool_use`) holds them as a dict by name, and `apply_chat_template` picks one
    per conversation (`tool_use` for a row with `tools`)."""
    return json.dumps(template, sort_keys=True) if isinstance(template, dict) else template


def record(path: str | None, tokenizer=None, plain_text: bool = False, unread: str | None = None) -> dict:
    """What resolved_config.json says of the template in effect: where it comes from and its content's SHA-256; for
    plain-text pairs, that none applies, and whether a `chat_template_path` was given to no effect. `unread`: why the
    model's tokenizer, whose files are here, could not be read (a dry run goes on without it)."""
    if plain_text:
        return {"path": None, "source": "none: plain text", "sha256": None, "plain_text": True, "unused": path}
    if path:
        return {"path": str(template_file(path).resolve()), "sha256": sha256(read(path))}
    own = text_of(getattr(tokenizer, "chat_template", None))
    found = {"path": None, "source": "the model's own", "sha256": sha256(own) if isinstance(own, str) else None}
    return {**found, "unread": unread} if tokenizer is None and unread else found


def changed(old: Template | None, path: str | None) -> str | None:
    """How the template now differs from the one a run recorded (`record`), or None: the same content, no record, or a
    run on plain text. A file given now is compared by content; a run that used a file, resumed without one, is a
    change."""
    if not old or old.plain_text:
        return None
    if path:
        now = sha256(read(path))
        if now == old.sha256:
            return None
        was, digest = old.path or "the model's own template", str(old.sha256)[:12]
        return f"{path} (SHA-256 {now[:12]}...) is not the template the run trained with, {was} ({digest}...)"
    if old.path:
        return f"the run trained with {old.path}, this one with the model's own (pass --chat_template_path)"
    return None


def require(tokenizer, shape_name: str) -> None:
    """Message rows need the tokenizer's chat template: refused, before the model loads, where it has none. HH-RLHF
    strings are message lists only as read (`hh_format: messages`), and `hh_format: text` trains them with none."""
    template = getattr(tokenizer, "chat_template", None)
    # A blank one (a chat_template.jinja of white space) is none: it renders every pair as nothing, which was refused
    # as a template that "writes no string content (it reads text parts only, as SmolVLM's ...)"
    if template and not (isinstance(template, str) and not template.strip()):
        return
    if shape_name == "hh":
        rows = "HH-RLHF strings, read as message lists (hh_format: messages)"
        fix = (
            "set hh_format: text (--hh_format text; the analyzer's --hh-format text) to train the strings as plain "
            "text, give a template with"
        )
    else:
        rows, fix = "message lists", "give one with"
    raise ConfigError(
        f"the tokenizer of {tokenizer.name_or_path} has no chat template, and the data set's rows are {rows}, which "
        f"need one: {fix} --chat_template_path FILE.jinja, or use a model folder whose tokenizer has one "
        "(chat_template.jinja beside tokenizer_config.json, or a chat_template entry in it)"
    )


def check_stops(tokenizer, config, model: str, generation_stops: set | None) -> None:
    """Refuses a template that ends the assistant turn with no token the model stops generating at: TRL adds EOS to
    plain text only (conversational pairs end as the template writes them), so every answer would train without an
    end. The stops: `model_stops`, with `generation_stops`, generation_config's eos_token_id (None where it cannot be
    read here: nothing is refused on a guess)."""
    from trl.data_utils import common_prefix_length

    from dpotrain.recipe import upstream

    if generation_stops is None:
        return
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    try:
        prompt = upstream.tokenize(tokenizer, turns[:1], add_generation_prompt=True)["input_ids"]
        whole = upstream.tokenize(tokenizer, turns)["input_ids"]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this pair: the rows' checks name what it refuses
        return
    answer = set(whole[common_prefix_length(prompt, whole) :])
    stops = model_stops(tokenizer, config, generation_stops)
    if answer & stops:
        return
    stops = sorted(stops)
    end = text[text.rindex("Hello.") + len("Hello.") :] if "Hello." in text else ""
    said = ", ".join(repr(t) for t in tokenizer.convert_ids_to_tokens(stops))
    raise ConfigError(
        f"the chat template ends each answer with {end!r}, and {model} stops generating at none of its tokens (it "
        f"stops at {said}: the EOS of its tokenizer, config.json and generation_config.json), so every answer would "
        f"train without an end and the model would learn not to stop: give a chat template that ends the assistant "
        f"turn with {tokenizer.eos_token!r} (chat_template_path), or add the id of the token that ends its turns to "
        "eos_token_id in generation_config.json"
    )


def model_stops(tokenizer, config, generation_stops: set) -> set:
    """The ids the model stops generating at: its tokenizer's EOS, config.json's eos_token_id and generation_config's
    (`generation_stops`). What the end-of-answer check accepts (`check_stops`), and what the samples stop at."""
    # A vision-language config's own eos_token_id (Gemma 3's [1, 106]) may list more than its text config's
    configs = (config, config.get_text_config())
    found = {tokenizer.eos_token_id} | generation_stops
    return found.union(*(eos_ids(getattr(c, "eos_token_id", None)) for c in configs)) - {None}


def eos_ids(value) -> set:
    """eos_token_id as configs write it: one id, a list of them, or none."""
    return set(value) if isinstance(value, list | tuple) else {value} - {None}


# --- answers against the generation prompt ---------------------------------------------------------------------------


def given_kwargs(kwargs) -> dict:
    """A row's chat_template_kwargs as it gives them: a key it has no value for (a null row, or a key only other rows
    have, which Arrow gives every row of the column as null) left out, not passed as None, which a template's `is
    defined` takes as given (`Effort: None`, Llama 3's `Today Date: None`, written into every such row's prompt)."""
    return {k: v for k, v in (kwargs or {}).items() if v is not None}


def template_kwargs(example: dict) -> dict:
    """A message row's `apply_chat_template` arguments, as DPOTrainer's tokenize_fn passes them (`tools` a list or a
    JSON string), and the row's chat_template_kwargs it gives (`given_kwargs`), as the run's pairs hold them."""
    tools = example.get("tools")
    kwargs = given_kwargs(example.get("chat_template_kwargs"))
    return {"tools": json.loads(tools) if isinstance(tools, str) else tools, **kwargs}


def answer_problem(example: dict, tokenizer, rendered: dict | None = None) -> tuple[str, str] | None:
    """(column, problem) for a conversational pair whose rendered prompt + answer does not begin with the rendered
    prompt + generation prompt, or whose prompt (with the generation prompt), prompt + chosen or prompt + rejected the
    template refuses (`raise_exception`: a system turn it does not take, roles that do not alternate): TRL's
    tokenization would raise on that row after the model loaded. None otherwise, and without a template at all
    (`lengths.check_tokenizer` refuses that with its fix). `rendered`, for a pair without a problem: its three texts,
    as `lengths.measure` tokenizes them (rendered once a row)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    kwargs, texts = template_kwargs(example), {}
    for column in ("prompt", "chosen", "rejected"):
        messages = example["prompt"] + (example[column] if column != "prompt" else [])
        try:
            texts[column] = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=column == "prompt", **kwargs
            )
        except Exception as e:  # noqa: BLE001 - whatever the template raises, TRL's map would raise too
            calls = any(m.get("tool_calls") and m.get("content") is None for m in messages)
            fix = (  # a template written for text turns alone reads every message's content
                " (a message calls a tool and has no content: give a chat template that writes tool_calls, "
                "chat_template_path, e.g. a tool-calling model's chat_template.jinja)"
                if calls
                else _no_system_turn(messages, tokenizer, column == "prompt", kwargs)
            )
            return column, f"{TEMPLATE_ERROR}: {type(e).__name__}: {e}{fix}"
    for column in ("chosen", "rejected"):
        if not texts[column].startswith(texts["prompt"]):
            return column, _off_prompt(example, column, texts)
        if problem := _eos_twice(example[column], texts[column], tokenizer.eos_token):
            return column, problem
        if _calls_unwritten(example["prompt"] + example[column], texts[column], tokenizer, kwargs):
            return column, (
                f"{TEMPLATE_ERROR}: the chat template does not write tool_calls, so the tool call would train as "
                "the text around it (an empty answer where it has none): give a chat template that writes "
                "tool_calls (chat_template_path, e.g. a tool-calling model's chat_template.jinja)"
            )
    if problem := _message_unwritten(example["prompt"], texts["prompt"], tokenizer, kwargs):
        return "prompt", problem
    if texts["chosen"] == texts["rejected"]:  # they differ where the template does not look (`reasoning_content`)
        return "chosen", _rendered_alike(example, tokenizer)
    if rendered is not None:
        rendered.update(texts, unopened=_unopened(example, texts, tokenizer, kwargs))
    return None


def parts_problem(row: dict, tokenizer) -> tuple[str, str] | None:
    """(column, problem) for a message of the row as written whose content is several text parts, where the chat
    template takes parts and writes them otherwise than their text joined (Gemma 3's trims each part): the project
    reads parts as their joined text (`shapes.text_parts`), TRL hands them to the template, and the two would train
    other tokens. A template that does not take parts (it raises on them, or writes the list) keeps the join."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    for column in ("prompt", "chosen", "rejected"):
        value = row.get(column)
        for n, message in enumerate(value if isinstance(value, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and len(content) > 1 and all(map(is_text_part, content)):
                if _joins_parts(tokenizer):
                    return None  # judged once per template: every message is read alike
                return column, (
                    f"message {n} holds several text parts, and the chat template writes them otherwise than their "
                    "text joined, as they are read here (Gemma 3's trims each part), so the pair would train other "
                    "tokens than TRL renders from them: join each message's parts into one string as the model is to "
                    "read it, or give a chat template that writes parts as their joined text (chat_template_path)"
                )
    return None


_PARTS: dict = {}  # template -> whether it writes a message's text parts as their text joined: judged once each


def _joins_parts(tokenizer) -> bool:
    """Whether the template writes a user message of text parts as the same message with their text joined, or does
    not take parts at all (raises on them, or writes the list itself): then the join is this project's reading."""
    key = str(tokenizer.chat_template)
    if key not in _PARTS:
        texts = ["Name a colour.", " Be brief. "]
        as_parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]
        written = _rendered(tokenizer, as_parts)
        joined = _rendered(tokenizer, [{"role": "user", "content": "".join(texts)}])
        if written is None or joined is None:  # a template that does not take parts (TRL would raise on them)
            _PARTS[key] = True
        else:
            takes = texts[0] in written and "'type'" not in written and '"type"' not in written
            # One that writes no string content (SmolVLM's) renders both sides alike: `_rendered_alike` says so
            _PARTS[key] = not takes or written == joined or not writes_strings(tokenizer)
    return _PARTS[key]


_STRINGS: dict = {}  # template -> whether it writes a message's content given as a string: judged once each


def writes_strings(tokenizer) -> bool:
    """Whether the template writes a user message's string content (SmolVLM's and Idefics3's read text parts only, and
    write nothing of a string)."""
    key = str(tokenizer.chat_template)
    if key not in _STRINGS:
        text = _rendered(tokenizer, [{"role": "user", "content": "Name a colour."}])
        # One that refuses this message: the rows' checks say what it refuses
        _STRINGS[key] = text is None or "Name a colour." in text
    return _STRINGS[key]


_OPENS: dict = {}  # (template, its arguments) -> whether its generation prompt adds text: judged once each


def _unopened(example: dict, texts: dict, tokenizer, kwargs: dict) -> bool:
    """Whether the chosen answer, rendered after the rendered prompt, starts with template text before its content
    (`<|im_start|>assistant\n`) because the generation prompt adds nothing: TRL then trains that text as the answer's
    first tokens (`lengths.unopened_turn` warns). Not where only whitespace comes first (Llama 2's ' ' after [/INST],
    whose generation prompt is rightly empty), nor where the generation prompt does open the turn (Qwen3's empty
    `<think></think>` before an answer's content). The prompt is rendered without the generation prompt once per
    template and arguments, only where an answer starts otherwise: no render of its own a pair."""
    content = example["chosen"][0].get("content") if example["chosen"] else None
    if not isinstance(content, str) or not content.strip():
        return False  # a tool call: its rendering starts with what the template writes for it
    answer = texts["chosen"][len(texts["prompt"]) :]
    start = answer.find(content.strip()[:SHOWN])
    if start <= 0 or not answer[:start].strip():
        return False  # the content first, or written otherwise than given (a template that trims or escapes it)
    key = (str(tokenizer.chat_template), json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _OPENS:
        bare = _rendered(tokenizer, example["prompt"], **kwargs)  # None: one that needs the generation prompt
        _OPENS[key] = bare != texts["prompt"]
    return not _OPENS[key]


def _no_system_turn(messages: list, tokenizer, generation: bool, kwargs: dict) -> str:
    """The fix where the template refuses a system turn and renders the conversation without it (Gemma's and Mistral's
    raise "System role not supported"): --skip_invalid alone would drop every pair that has one."""
    if not any(m.get("role") == "system" for m in messages):
        return ""
    try:
        rest = [m for m in messages if m.get("role") != "system"]
        tokenizer.apply_chat_template(rest, tokenize=False, add_generation_prompt=generation, **kwargs)
    except Exception:  # noqa: BLE001 - the system turn is not (only) what the template refuses
        return ""
    return (
        " (the chat template takes no system turn: fold the system message into the first user message, or give a "
        "chat template that takes one, chat_template_path)"
    )


def _message_unwritten(prompt: list, text: str, tokenizer, kwargs: dict) -> str | None:
    """The problem where the template writes nothing of a message of the prompt: its text nowhere in the rendered
    prompt `text`, which renders the same without it (a template written for user and assistant turns skips a system
    message, without an error), so the pair would train without it; None otherwise. Rendered again only for a
    message whose text is not found as written (a template that folds it into another turn writes it)."""
    for n, message in enumerate(prompt):
        content = message.get("content")
        if not isinstance(content, str) or not content.strip() or content.strip() in text:
            continue
        try:
            rest = tokenizer.apply_chat_template(
                prompt[:n] + prompt[n + 1 :], tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception:  # noqa: BLE001 - a template that cannot render the prompt without it: it reads the message
            continue
        if rest == text:
            return (
                f"{TEMPLATE_ERROR}: the chat template writes nothing of message {n} ({message.get('role')}), so the "
                "pair would train without it: give a chat template that writes it (chat_template_path), or remove "
                f"the message from the data{DETAIL}it reads {content[:80]!r}"
            )
    return None


def _calls_unwritten(messages: list, text: str, tokenizer, kwargs: dict) -> bool:
    """Whether the conversation calls a tool and renders the same with its calls left out: a template written for text
    turns that reads content with a default (`content or ''`) drops the calls without an error, and TRL would then
    train the empty answer, or two calls as identical sides."""
    if not any(m.get("tool_calls") for m in messages):
        return False
    uncalled = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    try:
        return tokenizer.apply_chat_template(uncalled, tokenize=False, **kwargs) == text
    except Exception:  # noqa: BLE001 - a template that needs the calls to render writes them
        return False


def _eos_twice(answer: list, text: str, eos: str | None) -> str | None:
    """An answer whose content ends with the EOS token written as text (an SFT export's), where the template writes EOS
    after it too: a special token in a message's content is tokenized as the token, so the answer ends in two."""
    content = answer[-1].get("content") if answer else None
    if not eos or not isinstance(content, str) or not content.rstrip().endswith(eos) or content not in text:
        return None
    if not text[text.rindex(content) + len(content) :].lstrip().startswith(eos):
        return None  # the template writes no EOS of its own: the content's is the answer's one end
    return (
        f"the answer ends with the EOS token written as text ({eos!r}), and the chat template writes it after the "
        "answer as well, so it would train two: remove it from the end of the answers"
    )


def _off_prompt(example: dict, column: str, texts: dict) -> str:
    """Why the rendered prompt + answer does not begin with the rendered prompt (with the generation prompt): the two
    part before the prompt's last message is written out, so the template writes the prompt's own messages otherwise
    once an answer follows (Mistral's system message, written only into a last user turn); or the answer's thinking
    block is nowhere in what follows (DeepSeek-R1-Distill's drops it); or else the answer does not begin with the
    generation prompt (`_mismatch`). TRL would train the rest of the prompt, or the answer without its thinking, in
    the first two; the fix differs in each."""
    prompt, whole = texts["prompt"], texts[column]
    same = len(os.path.commonprefix([prompt, whole]))
    last = example["prompt"][-1].get("content")
    last = last.strip() if isinstance(last, str) else ""
    if last and last in prompt and same < prompt.rindex(last) + len(last):
        return _prompt_otherwise(example["prompt"], prompt[same:], whole[same:])
    content = example[column][-1].get("content") if example[column] else None
    thinking = content.split(THINK_END, 1)[0].replace("<think>", "").strip() if isinstance(content, str) else ""
    if THINK_END in (content or "") and thinking and thinking not in whole[same:]:
        return (
            f"the chat template drops the answer's thinking block (the text up to {THINK_END!r}), so the answer would "
            "train without it: give a chat template that writes the final answer whole (chat_template_path: the "
            f"model's template without its split at {THINK_END!r}, as TRL's deepseek_r1_distill_training.jinja is "
            "DeepSeek-R1-Distill's)"
        )
    return _mismatch(prompt, whole)


def _prompt_otherwise(prompt: list, alone: str, followed: str) -> str:
    """The problem where the prompt's messages render otherwise once an answer follows; after `DETAIL`, this row's
    texts from where the prompt alone (`alone`) and the prompt followed by its answer (`followed`) part."""
    system = next((m.get("content") for m in prompt if m.get("role") == "system"), None)
    if isinstance(system, str) and system.strip() and system in alone and system not in followed:
        fix = (
            "the template writes the system message only where a user turn ends the conversation (Mistral's puts it "
            "into the last user turn): fold the system message into the first user message, or give a chat template "
            "that writes it wherever the conversation ends (chat_template_path)"
        )
    else:
        fix = "give a chat template that renders a conversation's start the same whatever follows (chat_template_path)"
    return (
        "the chat template renders the prompt otherwise once an answer follows it, so TRL would split where the two "
        f"part and train the rest of the prompt as the answer: {fix}{DETAIL}the prompt alone reads "
        f"{alone[:SHOWN]!r} there, the conversation {followed[:SHOWN]!r}"
    )


def _rendered_alike(example: dict, tokenizer) -> str:
    """The problem where both sides render to the same text: they differ in a message field the template does not
    write (Qwen2.5's leaves out `reasoning_content`), and the pair would train no preference."""
    fields = sorted(
        {
            k
            for a, b in zip(example["chosen"], example["rejected"], strict=False)
            for k in a.keys() | b.keys()
            if a.get(k) != b.get(k)
        }
    )
    named = ", ".join(f"`{f}`" for f in fields) or "their messages"
    if not writes_strings(tokenizer):  # every pair renders alike: the template reads text parts only
        return (
            "identical to `rejected` as the chat template renders them: the template writes no string content (it "
            "reads text parts only, as SmolVLM's and Idefics3's do), and a message's content is read here as one "
            "string, its text parts joined: give a chat template that writes string content (chat_template_path)"
        )
    return (
        f"identical to `rejected` as the chat template renders them (they differ only in {named}, where the "
        "template writes nothing of the difference), so the pair would train no preference: give a chat template "
        "that writes what tells them apart (chat_template_path), or fix or remove the row"
    )


def _mismatch(prompt: str, whole: str) -> str:
    """The problem, then (after `shapes.DETAIL`, left out of the counts per reason) what this row's answer reads."""
    same = len(os.path.commonprefix([prompt, whole]))
    expected, found = prompt[same:][:SHOWN], whole[same:][:SHOWN]
    return (
        f"{MISMATCH} ({expected!r}), so TRL's prompt/answer split would label other tokens than open-instruct's "
        f"position-based masking (OLMo 3's){DETAIL}it reads {found!r} there"
    )


def misfit(problem: str, tokenizer=None) -> str:
    """What fits instead, where every row fails `answer_problem`: the template is not this data's. Under OLMo 3 Think's
    (`olmo_thinker`, whose generation prompt opens `<think>`), OLMo's recipe for answers without one; under another
    (DeepSeek-R1-Distill's opens `<think>\\n`), where the OLMo recipes do not help, what its generation prompt is."""
    if not problem.startswith(MISMATCH):
        return ""
    opened = generation_prompt(tokenizer) if tokenizer is not None else None
    if opened == OLMO_THINK_PROMPT:
        return (
            "; the chat template does not fit these answers: train them with the recipe whose template does "
            "(configs/instruct.yaml for answers without a thinking block), or with no chat_template_path (the "
            "model's own template)"
        )
    said = f"its generation prompt is {opened!r}" if opened else "its generation prompt opens text the answers lack"
    return (
        f"; the chat template does not fit these answers: {said}, so each answer must begin with what follows the "
        "assistant turn's header there (the text above): write the answers to begin with it, or give a chat template "
        "whose generation prompt opens no block the answers lack (chat_template_path)"
    )


def generation_prompt(tokenizer) -> str | None:
    """What the template's add_generation_prompt adds after a user turn; None where it cannot be told (the template
    refuses the turn, or writes the conversation otherwise with it)."""
    turn = [{"role": "user", "content": "Hi."}]
    bare, opened = _rendered(tokenizer, turn), _rendered(tokenizer, turn, add_generation_prompt=True)
    if bare is None or opened is None:  # a template that refuses this turn: the rows' own check said what it is
        return None
    return opened[len(bare) :] if opened.startswith(bare) else None


# Two days a template's `strftime_now` is given: one that writes the day it renders on renders them apart.
DAYS = ((2024, 7, 26), (2025, 1, 2))
DATE_STRING = {"date_string": "26 Jul 2024"}  # Llama 3.1's and 3.2's templates take the date so, and write it


def dated(tokenizer, example: dict) -> str | None:
    """Where the template writes the day it renders on into `example`'s prompt (Llama 3.2's `Today Date:`, from
    transformers' `strftime_now`, unless the row's chat_template_kwargs give `date_string`), a warning naming the fix;
    None where it writes none, or the probe cannot tell (the template refuses the probe's rendering)."""
    messages = example.get("prompt") or example.get("chosen")
    if not isinstance(messages, list) or not messages:
        return None
    if not _apart(tokenizer, messages, template_kwargs(example)):
        return None
    fix = (
        f"give the date in each row's chat_template_kwargs ({json.dumps(DATE_STRING)})"
        if not _apart(tokenizer, messages, template_kwargs(example) | DATE_STRING)
        else "give the template the date it writes in each row's chat_template_kwargs (the name it reads it by)"
    )
    return (
        "the chat template writes the day it renders on into the prompts (transformers' strftime_now, as Llama 3.2's "
        "`Today Date:` does), so the same pairs are other tokens on another day, and a job requeued after midnight "
        f"scores the whole reference again: {fix}"
    )


def _apart(tokenizer, messages: list, kwargs: dict) -> bool:
    """Whether `messages` (with the generation prompt) render to two texts on the two `DAYS`."""
    from datetime import datetime

    from dpotrain.recipe import upstream

    texts = []
    for day in DAYS:
        with upstream.template_clock(datetime(*day)):
            texts.append(_rendered(tokenizer, messages, add_generation_prompt=True, **kwargs))
    return None not in texts and texts[0] != texts[1]


def _rendered(tokenizer, messages: list, **kwargs) -> str | None:
    """The template's text of `messages` (a probe of what it writes), or None where it raises on them: the template's
    own refusal (`raise_exception`), or a shape it does not take."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001 - whatever a template raises, the probe's answer is "refused"
        return None

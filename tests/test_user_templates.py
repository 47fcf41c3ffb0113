"""Chat templates users bring with the models they post-train (Mistral's, DeepSeek-R1-Distill's, Qwen's): each pair is
tokenized as TRL 1.16's `DPOTrainer` tokenizes it, or refused in one line that says what the template does to it and
what to give instead (dpotrain/data/chat_template.py `answer_problem`, docs/data.md "Chat template").

Each case builds a tiny byte-level BPE with the family's special tokens (no Hub), reads the rows as the run reads them
(`rows.usable_pairs`) and tokenizes them with TRL's own `DPOTrainer._prepare_dataset`, beside TRL fed the rows as
written: where the project reads a row, its tokens are TRL's; where it refuses one, TRL is shown training the wrong
tokens (the reason for refusing it)."""

from pathlib import Path

import datasets
import pytest
import trl

from dpotrain.data import rows as rows_module
from dpotrain.data.rows import InvalidRowError
from dpotrain.recipe.errors import ConfigError

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"  # the models' own templates, as TRL ships them
TEXTS = ["Name a colour. Blue. Seven.", "What is 2 + 2? It is 4. Five", "Let me think step by step.", "user assistant"]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **fields) -> dict:
    return {"role": "assistant", "content": text, **fields}


def tokenizer_of(specials: list[str], template: str, bos: str | None, eos: str):
    """A byte-level BPE trained on a few lines, with a family's special tokens and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(TEXTS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, chat_template=template)


def trl_tokenized(rows: list[dict], tokenizer, tmp_path) -> list[dict]:
    """TRL's own tokenization of `rows`: DPOTrainer._prepare_dataset, unbound, with the one attribute it uses."""
    from trl import DPOConfig, DPOTrainer

    class Shim:
        _tokenizer = tokenizer

    args = DPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False)
    return DPOTrainer._prepare_dataset(Shim(), datasets.Dataset.from_list(rows), tokenizer, args, "train").to_list()


def read(rows: list[dict], tokenizer) -> list[dict]:
    """The rows as the run reads them, checked against the template (refused at the first bad row)."""
    return rows_module.usable_pairs(
        datasets.Dataset.from_list(rows), rows_module.RowRules(template=tokenizer, say=False), {}, "invalid"
    )


def refusal(rows: list[dict], tokenizer) -> str:
    with pytest.raises((InvalidRowError, ConfigError)) as refused:
        read(rows, tokenizer)
    line = str(refused.value)
    assert "\n" not in line
    return line


def ids(tokenized: list[dict]) -> list[tuple]:
    """Each row's token ids (the message columns aside: a data set read back fills absent fields with None)."""
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in tokenized]


def decoded(tokenizer, row: dict) -> tuple[str, str, str]:
    return tuple(tokenizer.decode(row[f"{part}_ids"]) for part in ("prompt", "chosen", "rejected"))


# --- Mistral: the system message only where the prompt ends the conversation -----------------------------------------

# Mistral-7B-Instruct-v0.3's template (as its tokenizer_config.json ships it; Mistral-Nemo's writes the system message
# the same way), less its tool and role-alternation parts: the system message goes into the LAST user turn, written
# only `if loop.last`. The prompt alone ends with that user turn; prompt + answer ends with the answer, so there the
# system message is written nowhere.
MISTRAL_V03 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def mistral():
    return tokenizer_of(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], MISTRAL_V03, "<s>", "</s>")


def test_a_template_that_writes_the_system_message_only_after_the_last_user_turn_is_refused_saying_so(tmp_path):
    """Mistral v0.3 renders a pair with a system message as `[INST] system\\n\\nquestion[/INST]` alone and as
    `[INST] question[/INST] answer</s>` with its answer: TRL splits where the tokens part, right after `[INST]`, and
    trains the user's question as the first tokens of every answer, the system message gone. The project refused the
    row, but said the answer did not begin with the generation prompt ('Be brief.\\n\\nName a colour.[/INST]') and,
    where every row has a system message, to train with configs/instruct.yaml: neither is what is wrong."""
    tokenizer = mistral()
    system = {"role": "system", "content": "Be brief."}
    plain = {"prompt": [user("What is 2 + 2?")], "chosen": [assistant("It is 4.")], "rejected": [assistant("Five")]}
    with_system = {
        "prompt": [system, user("Name a colour.")],
        "chosen": [assistant("Blue.")],
        "rejected": [assistant("Seven.")],
    }
    theirs = trl_tokenized([plain, with_system], tokenizer, tmp_path)
    prompt, chosen, _ = decoded(tokenizer, theirs[1])
    assert prompt == "<s>[INST] " and chosen.startswith("Name a colour.[/INST] Blue.")  # the question, as the answer
    assert "Be brief." not in prompt + chosen

    line = refusal([plain, with_system], tokenizer)
    assert line.startswith("row 1, column 'chosen': the chat template renders the prompt otherwise once an answer ")
    assert "fold the system message into the first user message" in line and "chat_template_path" in line
    assert "generation prompt" not in line and "open-instruct" not in line
    every = refusal([with_system, with_system], tokenizer)  # every row: one line, without the think recipe's advice
    assert every.startswith("every row of the train split (2 of 2) fails one check: chosen: the chat template renders")
    assert "configs/instruct.yaml" not in every

    ours = trl_tokenized(read([plain], tokenizer).to_list(), tokenizer, tmp_path)  # without a system message: TRL's
    assert ids(ours) == ids(theirs[:1]) and decoded(tokenizer, ours[0]) == (
        "<s>[INST] What is 2 + 2?[/INST]",
        " It is 4.</s>",
        " Five</s>",
    )


# --- DeepSeek-R1-Distill: the answer's thinking dropped -----------------------------------------------------------


def deepseek(template: str):
    specials = [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
    ]
    text = (TRL_TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer_of(specials, text, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")


THINKING_PAIR = {
    "prompt": [user("What is 2 + 2?")],
    "chosen": [assistant("<think>\nLet me think step by step.\n</think>\n\nIt is 4.")],
    "rejected": [assistant("<think>\nMaybe.\n</think>\n\nFive")],
}


def test_a_template_that_drops_the_answers_thinking_block_is_refused_naming_the_block(tmp_path):
    """DeepSeek-R1-Distill's own template writes every assistant turn from the text after '</think>', the last one too,
    and opens the generation prompt with `<think>\\n`: TRL trains each answer without its reasoning (and its prompt
    without the `<think>\\n` the model is served with). The project refused the row saying the answer does not begin
    with '<think>\\n', which it does, and (every row) to train with configs/instruct.yaml for answers without a thinking
    block, which these have."""
    tokenizer = deepseek("deepseek_r1_distill")
    prompt, chosen, rejected = decoded(tokenizer, trl_tokenized([THINKING_PAIR], tokenizer, tmp_path)[0])
    assert prompt.endswith("<｜Assistant｜>") and chosen == "\n\nIt is 4.<｜end▁of▁sentence｜>"  # no reasoning trained
    assert "Let me think" not in prompt + chosen and "Maybe" not in rejected

    line = refusal([THINKING_PAIR, THINKING_PAIR], tokenizer)
    assert line.startswith(
        "every row of the train split (2 of 2) fails one check: chosen: the chat template drops the answer's thinking "
        "block (the text up to '</think>')"
    ), line
    assert "chat_template_path" in line and "configs/instruct.yaml" not in line and "does not begin" not in line


def test_deepseek_r1_distills_training_template_keeps_the_thinking_and_tokenizes_as_trl(tmp_path):
    """TRL's patched copy (deepseek_r1_distill_training.jinja) renders the answer whole: read, and TRL's tokens."""
    tokenizer = deepseek("deepseek_r1_distill_training")
    theirs = trl_tokenized([THINKING_PAIR], tokenizer, tmp_path)
    assert ids(trl_tokenized(read([THINKING_PAIR], tokenizer).to_list(), tokenizer, tmp_path)) == ids(theirs)
    prompt, chosen, _ = decoded(tokenizer, theirs[0])
    assert prompt.endswith("<｜Assistant｜><think>\n") and chosen.startswith("Let me think step by step.\n</think>")


@pytest.mark.parametrize("template", ["deepseek_r1_distill", "deepseek_r1_distill_training"])
def test_answers_without_thinking_under_deepseeks_template_are_told_its_generation_prompt_not_olmos_recipe(
    template, tmp_path
):
    """DeepSeek-R1-Distill's templates open the generation prompt with `<think>\\n`: answers without a thinking block
    are served after `<think>\\n` and trained without it (TRL's prompt stops before it), every row fails. The refusal
    said to train with configs/instruct.yaml (an OLMo recipe) or with no chat_template_path (the model's own template,
    which is this one): neither helps. It names the generation prompt, that the answers must begin with it, or a
    template whose generation prompt opens no block the answers lack."""
    tokenizer = deepseek(template)
    plain = {"prompt": [user("What is 2 + 2?")], "chosen": [assistant("It is 4.")], "rejected": [assistant("Five")]}
    prompt, chosen, _ = decoded(tokenizer, trl_tokenized([plain], tokenizer, tmp_path)[0])
    assert prompt.endswith("<｜Assistant｜>") and chosen.startswith("It is 4.")  # <think>\n trained nowhere

    line = refusal([plain, plain], tokenizer)
    assert line.startswith(
        "every row of the train split (2 of 2) fails one check: chosen: the answer does not begin with the chat "
        "template's generation prompt ('<think>\\n')"
    ), line
    assert "configs/instruct.yaml" not in line and "no chat_template_path" not in line, line
    assert (
        "its generation prompt is '<｜Assistant｜><think>\\n'" in line
        and "each answer must begin with what follows" in line
    ), line
    assert "chat_template_path" in line, line


# --- sides that differ only where the template does not look -------------------------------------------------------


def test_sides_the_template_renders_alike_are_refused_as_identical(tmp_path):
    """Qwen2.5's template writes an assistant message's `content` and not its `reasoning_content` (Qwen3's writes
    both): a pair whose sides differ in their reasoning alone is read as two messages that differ, and TRL trains two
    identical sequences, a pair without a preference, its reasoning trained nowhere."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = tokenizer_of(specials, (TRL_TEMPLATES / "qwen2_5.jinja").read_text(), None, "<|im_end|>")
    pair = {
        "prompt": [user("What is 2 + 2?")],
        "chosen": [assistant("It is 4.", reasoning_content="2 + 2 = 4")],
        "rejected": [assistant("It is 4.", reasoning_content="2 + 2 = 5")],
    }
    other = {"prompt": [user("Name a colour.")], "chosen": [assistant("Blue.")], "rejected": [assistant("Seven.")]}
    theirs = trl_tokenized([other, pair], tokenizer, tmp_path)
    assert theirs[1]["chosen_ids"] == theirs[1]["rejected_ids"]

    line = refusal([other, pair], tokenizer)
    assert line.startswith("row 1, column 'chosen': identical to `rejected` as the chat template renders them"), line
    assert "reasoning_content" in line and "chat_template_path" in line
    assert ids(trl_tokenized(read([other], tokenizer).to_list(), tokenizer, tmp_path)) == ids(theirs[:1])


# --- text parts a template writes otherwise than joined ------------------------------------------------------------


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def test_text_parts_a_template_writes_otherwise_than_joined_are_refused_naming_the_message(tmp_path):
    """Gemma 3's template takes a message's content as a list of parts and writes each text part trimmed: TRL renders
    `["Name a colour.", " Be brief."]` as 'Name a colour.Be brief.'. The project joined the parts into one string
    first ('Name a colour. Be brief.'), so it trained other tokens than TRL and than the model is served with. A
    template that does not take parts (Qwen2.5's raises on them) keeps the join; so does one that writes them joined
    (Qwen2.5-VL's), where the tokens are TRL's."""
    gemma3 = tokenizer_of(
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        (TRL_TEMPLATES / "gemma3.jinja").read_text(),
        "<bos>",
        "<eos>",
    )
    pair = {
        "prompt": [user(parts("Name a colour.", " Be brief."))],
        "chosen": [assistant(parts("Blue."))],
        "rejected": [assistant(parts("Seven."))],
    }
    prompt, _, _ = decoded(gemma3, trl_tokenized([pair], gemma3, tmp_path)[0])
    assert "Name a colour.Be brief." in prompt
    line = refusal([pair, pair], gemma3)
    assert line.startswith("every row of the train split (2 of 2) fails one check: prompt: message 0 holds ")
    assert "trims each part" in line and "join" in line

    one_part = dict(pair, prompt=[user(parts("Name a colour. Be brief."))])  # one part: nothing to join otherwise
    ours = trl_tokenized(read([one_part], gemma3).to_list(), gemma3, tmp_path)
    assert ids(ours) == ids(trl_tokenized([one_part], gemma3, tmp_path))

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    joins = tokenizer_of(specials, (TRL_TEMPLATES / "qwen2_5_vl.jinja").read_text(), None, "<|im_end|>")
    ours = trl_tokenized(read([pair], joins).to_list(), joins, tmp_path)
    assert ids(ours) == ids(trl_tokenized([pair], joins, tmp_path))
    takes_none = tokenizer_of(specials[:3], (TRL_TEMPLATES / "qwen2_5.jinja").read_text(), None, "<|im_end|>")
    prompt, _, _ = decoded(takes_none, trl_tokenized(read([pair], takes_none).to_list(), takes_none, tmp_path)[0])
    assert "Name a colour. Be brief." in prompt


def test_a_template_that_writes_text_parts_alone_is_refused_saying_it_writes_no_string_content(tmp_path):
    """SmolVLM's template (Idefics3's too) loops over a message's content as parts and writes nothing of a string. The
    project reads parts as one string (`shapes.text_parts`), so every answer rendered empty: TRL, handed those rows,
    trains each pair as two identical sequences with no answer in them. Refused, saying what to give."""
    specials = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>"]
    smolvlm = tokenizer_of(
        specials, (TRL_TEMPLATES / "smolvlm.jinja").read_text(), "<|im_start|>", "<end_of_utterance>"
    )
    as_parts = {
        "prompt": [user(parts("Name a colour.", " Be brief."))],
        "chosen": [assistant(parts("Blue."))],
        "rejected": [assistant(parts("Seven."))],
    }
    as_strings = {"prompt": [user("Name a colour.")], "chosen": [assistant("Blue.")], "rejected": [assistant("Seven.")]}
    _, chosen, _ = decoded(smolvlm, trl_tokenized([as_parts], smolvlm, tmp_path)[0])
    assert "Blue." in chosen  # TRL, handed the parts, writes them
    empty = trl_tokenized([as_strings], smolvlm, tmp_path)[0]
    assert empty["chosen_ids"] == empty["rejected_ids"] and "Blue" not in smolvlm.decode(empty["chosen_ids"])
    for rows in ([as_parts, as_parts], [as_strings, as_strings]):
        line = refusal(rows, smolvlm)
        assert line.startswith(
            "every row of the train split (2 of 2) fails one check: chosen: identical to `rejected` as the chat "
            "template renders them: the template writes no string content"
        ), line
        assert "chat_template_path" in line and "trims each part" not in line


# --- assistant_turns all: open-instruct's labels under templates users bring -------------------------------------


@pytest.mark.parametrize(
    ("template", "specials", "eos", "user_labeled"),
    [
        ("phi3", ["<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|endoftext|>", True),
        (
            "llama3_1",
            ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "<|eot_id|>",
            False,
        ),
    ],
)
def test_every_assistant_turn_is_labeled_as_open_instruct_labels_it(template, specials, eos, user_labeled, tmp_path):
    """With `assistant_turns: all`, a multi-turn pair read by the project, tokenized by TRL and labeled by
    `turns.prompt_labels` trains the tokens open-instruct's rule labels (tests/open_instruct_dpo.py). Phi-3's template
    ends a conversation with EOS where a later turn writes `<|user|>`, so the rule labels that `<|user|>` after the
    earlier answer (docs/data.md "Assistant turns"); Llama 3.1's labels no token of the user's turn."""
    from open_instruct_dpo import tokenize

    from dpotrain.data import turns

    tokenizer = tokenizer_of(specials, (TRL_TEMPLATES / f"{template}.jinja").read_text(), specials[0], eos)
    history = [user("What is 2 + 2?"), assistant("It is 4."), user("Name a colour.")]
    pair = {"chosen": [*history, assistant("Blue.")], "rejected": [*history, assistant("Seven.")]}
    (row,) = trl_tokenized(read([pair], tokenizer).to_list(), tokenizer, tmp_path)
    labels = turns.prompt_labels(row, tokenizer)
    for side in ("chosen", "rejected"):
        want_ids, want_labels = tokenize(pair[side], tokenizer, 10**6)
        assert row["prompt_ids"] + row[f"{side}_ids"] == want_ids
        assert labels[1:] + [1] * len(row[f"{side}_ids"]) == [int(x != -100) for x in want_labels[1:]]
    trained = tokenizer.decode([t for t, label in zip(row["prompt_ids"], labels, strict=True) if label])
    assert trained.startswith("It is 4.") and ("<|user|>" in trained) == user_labeled


# --- implicit prompts: answers that start with the same assistant message ----------------------------------------


def test_assistant_messages_both_answers_start_with_are_the_prompts_as_trl_reads_them(tmp_path):
    """Two conversations that part after a shared assistant message (`[user, 'Let me see.', 'Blue.']` against
    `[user, 'Let me see.', 'Seven.']`): TRL's extract_prompt takes every message they share as the prompt, and
    trains 'Blue.' against 'Seven.'. The project took each side's whole trailing run of assistant messages as its
    answer, so both answers trained 'Let me see.' too (in the averages of sigmoid_norm, ipo, the sft term and the
    metrics). With `assistant_turns: all` the shared message is an earlier turn, labeled as open-instruct labels it."""
    from open_instruct_dpo import tokenize

    from dpotrain.data import turns

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = tokenizer_of(specials, (TRL_TEMPLATES / "qwen2_5.jinja").read_text(), None, "<|im_end|>")
    start = [user("Name a colour."), assistant("Let me see.")]
    pair = {"chosen": [*start, assistant("Blue.")], "rejected": [*start, assistant("Seven."), assistant("Or eight.")]}
    prefix = {"chosen": [*start], "rejected": [*start, assistant("Seven.")]}  # one answer the start of the other
    theirs = trl_tokenized([pair], tokenizer, tmp_path)
    (row,) = trl_tokenized(read([pair], tokenizer).to_list(), tokenizer, tmp_path)
    assert ids([row]) == ids(theirs)
    _, chosen, rejected = decoded(tokenizer, row)
    assert chosen == "Blue.<|im_end|>\n" and rejected.startswith("Seven.")

    labels = turns.prompt_labels(row, tokenizer)  # assistant_turns all: open-instruct's labels
    for side in ("chosen", "rejected"):
        want_ids, want_labels = tokenize(pair[side], tokenizer, 10**6)
        assert row["prompt_ids"] + row[f"{side}_ids"] == want_ids
        assert labels[1:] + [1] * len(row[f"{side}_ids"]) == [int(x != -100) for x in want_labels[1:]]

    # Where one answer is the start of the other, no message is left to be the shorter side's answer: kept as read.
    (kept,) = read([prefix], tokenizer).to_list()
    assert [m["content"] for m in kept["chosen"]] == ["Let me see."]
    assert [m["content"] for m in kept["rejected"]] == ["Let me see.", "Seven."]

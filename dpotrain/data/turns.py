"""Which assistant turns a pair trains (`assistant_turns`): the final one (TRL's), or every one (open-instruct's).

open-instruct (`sft_tulu_tokenize_and_truncate_v1` at 2fd104e) masks each non-assistant message i from the end of the
rendered messages[:i] to the end of the rendered messages[:i+1] (with the generation prompt when an assistant message
follows, masking its header); every assistant turn is labeled (docs/data.md "Assistant turns"). With `all`, TRL's
tokenization stays and one column is added, `prompt_labels`: 1 for each prompt token open-instruct labels, 0 elsewhere
(and at position 0, which nothing predicts); the collators put it before each completion's mask. A pair whose
completion open-instruct would label otherwise than TRL's split is refused, naming it.
"""

from dpotrain.data import chat_template
from dpotrain.data.pair_lengths import LABELS
from dpotrain.recipe import upstream
from dpotrain.recipe.errors import ConfigError


class Rewritten(ValueError):
    """The template writes an earlier turn otherwise once the conversation goes on (`masked_spans`)."""


REWRITTEN = (
    "assistant_turns all: the chat template writes an earlier assistant turn otherwise once a later turn follows "
    "(e.g. it drops the thinking block of earlier answers, as Qwen3's does), so open-instruct's rule, which masks each "
    "turn from the length of the conversation rendered up to it, would train tokens of the turn after it: use "
    "--assistant_turns final (the final answer alone, as TRL trains it), or a chat template that writes earlier "
    "assistant turns as it writes the last"
)
PROBE = [  # an earlier answer with a thinking block, then the next user turn
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello."},
    {"role": "user", "content": "Bye."},
]


def masked_spans(prompt: list[dict], tokenizer, **template_kwargs) -> list[tuple[int, int]]:
    """The positions open-instruct masks in a conversation that starts with `prompt` and goes on with assistant
    messages only: one (start, end) per non-assistant message of the prompt (rendering the prompt's own prefixes gives
    the same lengths as the whole conversation's, at a fraction of the cost on long answers). Raises `Rewritten` where
    the prefix before a message is not the start of the prefix that ends with it: the start would then lie inside that
    message, whose first tokens would be trained."""

    def ids(upto: int, generation: bool) -> list[int]:
        return upstream.tokenize(tokenizer, prompt[:upto], add_generation_prompt=generation, **template_kwargs)[
            "input_ids"
        ]

    from trl.data_utils import common_prefix_length

    spans = []
    for i, message in enumerate(prompt):
        if message["role"] == "assistant":
            continue
        # the generation prompt (the assistant header) when an assistant message follows: always after the last
        header = i == len(prompt) - 1 or prompt[i + 1]["role"] == "assistant"
        upto = ids(i + 1, header)
        before = ids(i, False) if i else []
        # One token may differ: the conversation's last turn may end with another token than an earlier one
        # (olmo_thinker: EOS, where an earlier turn ends with <|im_end|> and a newline), as open-instruct labels it.
        if len(before) - common_prefix_length(before, upto) > 1:
            raise Rewritten(REWRITTEN)
        spans.append((len(before), len(upto)))
    return spans


def check_template(tokenizer) -> None:
    """Before the model loads, with `assistant_turns: all`: a template that writes an earlier answer otherwise once the
    conversation goes on is refused (`masked_spans`), judged on `PROBE` (each pair is judged again as it is labeled)."""
    try:
        masked_spans(PROBE, tokenizer)
    except Rewritten as e:
        raise ConfigError(str(e)) from None
    except Exception:  # noqa: BLE001 - a template that refuses this conversation: the rows' checks name what it refuses
        return


def prompt_labels(example: dict, tokenizer) -> list[int]:
    """The `prompt_labels` of one tokenized pair (its `prompt_ids`, `chosen_ids`, `rejected_ids` as TRL made them
    from its `prompt`, `chosen`, `rejected`; the completions are assistant messages, as the data stage reads them)."""
    from trl.data_utils import is_conversational

    p = len(example["prompt_ids"])
    if not is_conversational(example):  # plain text has no turns: TRL's split is all there is
        return [0] * p
    labels = [1] * p
    spans = masked_spans(example["prompt"], tokenizer, **chat_template.template_kwargs(example))
    for n, (start, end) in enumerate(spans):
        last = n == len(spans) - 1 and example["prompt"][-1]["role"] != "assistant"
        if end > p and last and chat_template.answer_problem(example, tokenizer) is None:
            # The prompt with its generation prompt is text both sides start with (the run refuses the rest before
            # the model loads: chat_template.answer_problem), but its last tokens merged with the answer's first
            # characters into another token ('>' + '...' into '>...'): TRL split where they diverge and warned once,
            # and `final` trains the merged token; so does `all` (it raised here, once the model had loaded:
            # docs/data.md "Chat template").
            end = p
        if end > p:  # open-instruct would mask the first tokens of each completion, which TRL's split trains
            raise ValueError(
                "assistant_turns all: the pair whose prompt starts "
                f"{str(example['prompt'][0].get('content'))[:60]!r} is labeled by open-instruct's rule otherwise than "
                "its completions are split (the chat template renders the prompt with its generation prompt unlike "
                "the start of the conversation): fix the pair or the template, or use assistant_turns final"
            )
        labels[start:end] = [0] * len(labels[start:end])
    return [0, *labels[1:]] if p else []


def add_prompt_labels(dataset, tokenizer, num_proc: int | None = None):
    """`dataset` (tokenized by TRL, its `prompt` / `chosen` / `rejected` still there) with a `prompt_labels` column."""
    label = lambda example: {LABELS: prompt_labels(example, tokenizer)}
    return dataset.map(label, num_proc=num_proc, desc="Labeling every assistant turn")


def completion_mask(example: dict, side: str) -> list[int]:
    """A sequence's completion mask before truncation: the prompt's labels (none without the column), then the
    completion's tokens."""
    prompt = example.get(LABELS) or [0] * len(example["prompt_ids"])
    return list(prompt) + [1] * len(example[f"{side}_ids"])

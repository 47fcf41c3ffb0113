"""How many positions a model takes, and the refusal of a run whose sequences would go past them.

A rotary model fed positions past its context trains without an error, on positions its attention never learned (a
model with learned position embeddings fails with a device-side assert): the run is refused before the model loads.
The limit is `max_position_embeddings`, or the context a RoPE scaling extends it to (`factor` x
`original_max_position_embeddings`), whichever is larger: a Qwen config given yarn 4 x 32768 by its user keeps 32768
as max_position_embeddings.

The token ids likewise: a tokenizer whose ids reach past the model's embedding rows (a tokenizer from another model, or
tokens added without resizing the embeddings) fails at the first pair holding such a token, an IndexError on a CPU and
a device-side assert on a GPU, after the reference stage began: refused with the positions."""

import numpy as np

from dpotrain.recipe.errors import ConfigError

SCALED_ROPE = ("yarn", "llama3", "linear", "dynamic", "longrope")
RESIZE = "resize its embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"


def model_limit(config) -> tuple[int | None, str]:
    """The positions the model takes, and where that number comes from; (None, why) when its config does not say."""
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    how = f"max_position_embeddings {limit}"
    rope = getattr(text, "rope_parameters", None) or {}
    # One dict, or one per layer type (Gemma 3, OLMo 3: {"full_attention": {...}, "sliding_attention": {...}})
    kinds = [rope] if "rope_type" in rope or "factor" in rope else [r for r in rope.values() if isinstance(r, dict)]
    for r in kinds:
        factor, original = r.get("factor"), r.get("original_max_position_embeddings")
        if r.get("rope_type") in SCALED_ROPE and factor and original and factor * original > (limit or 0):
            limit = int(factor * original)
            how = f"rope {r['rope_type']} factor {factor:g} x {original} positions"
    return (limit, how) if limit else (None, "its config names no max_position_embeddings")


def longest_sequence(max_length: int | None, pairs, whole_split: bool) -> tuple[int | None, str]:
    """The longest sequence the model will see, and what says so: the data's own longest where every pair was
    measured (or nothing bounds it), else max_length."""
    if pairs is not None and len(pairs.prompt) and (whole_split or max_length is None):
        longest = int((np.asarray(pairs.prompt) + np.maximum(pairs.chosen, pairs.rejected)).max())
        if max_length is not None and longest > max_length:
            return max_length, f"max_length {max_length:,} (the data's longest sequence is {longest:,} tokens)"
        within = "" if max_length is None else f", within max_length {max_length:,}"
        scope = "the data's longest sequence" if whole_split else "the longest sequence of a sample of the data"
        return longest, f"{scope} ({longest:,} tokens{within})"
    if max_length is not None:
        return max_length, f"max_length {max_length:,}"
    return None, "max_length unset and no lengths measured"


def check(config, model: str, max_length: int | None, pairs, whole_split: bool) -> None:
    """Refuses a run whose sequences reach past the model's positions (module doc)."""
    limit, how = model_limit(config)
    longest, what = longest_sequence(max_length, pairs, whole_split)
    if limit is None or longest is None or longest <= limit:
        return
    raise ConfigError(
        f"{what} reaches past the {limit:,} positions {model} takes ({how}): set --max_length {limit} or lower "
        "(scripts/analyze_dataset.py shows what each length keeps), or extend the model's context in its config.json "
        "(rope_scaling, max_position_embeddings) if you mean to train it longer"
    )


def check_vocabulary(config, tokenizer, model: str, pad_token: str | None = None) -> None:
    """Refuses a tokenizer whose ids reach past the model's embedding rows where the run would feed them (module doc):
    its vocabulary proper (a tokenizer of another model: any text may hit those ids), or an added token that the chat
    template writes or the trainer pads and ends sequences with (tokens added without resizing the embeddings). An
    added token nothing writes may lie past them, as Gemma's text models keep `<image_soft_token>` one past their last
    row; a model with more rows than the tokenizer has ids (a vocabulary padded to a multiple of 64 or 128) is fine.
    `pad_token`: the recipe's (TRL's DPOConfig), which the trainer pads with instead of the tokenizer's own: an added
    token past the rows passed, and a padded run stopped at its first padded micro-batch (IndexError)."""
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if tokenizer is None or not isinstance(rows, int):
        return
    base, count = _vocabulary_ids(tokenizer)
    past = {i: token for token, i in tokenizer.get_added_vocab().items() if i >= rows}
    if base <= rows and not past:
        return
    fix = f"give the model folder the tokenizer the model was trained with, or {RESIZE}"
    if base > rows:
        has = (
            f"{base:,} token ids"
            if base == count
            else f"token ids up to {base - 1:,} ({count:,} tokens: its ids skip numbers)"
        )
        raise ConfigError(
            f"the tokenizer of {model} has {has}, past the {rows:,} rows of the model's embedding "
            f"(vocab_size in its config.json): {fix}"
        )
    pad_id = tokenizer.convert_tokens_to_ids(pad_token) if pad_token else tokenizer.pad_token_id
    written = {tokenizer.eos_token_id, pad_id, tokenizer.bos_token_id} | _template_ids(tokenizer)
    fed = sorted(i for i in past if i in written)
    if pad_token and pad_id in fed:  # the recipe's choice: another pad token is the fix at hand
        raise ConfigError(
            f"pad_token {pad_token!r} (id {pad_id:,}) is an added token past the {rows:,} rows of the model's "
            f"embedding (vocab_size in the config.json of {model}): the trainer would pad with it, so give a pad_token "
            f"the model has (e.g. its EOS token {tokenizer.eos_token!r}), leave pad_token out, or {RESIZE}"
        )
    if fed:
        raise ConfigError(
            f"the tokenizer of {model} writes {past[fed[0]]!r} (id {fed[0]:,}: the chat template, or as its eos, pad "
            f"or bos token), past the {rows:,} rows of the model's embedding (vocab_size in its config.json): {fix}"
        )


def _vocabulary_ids(tokenizer) -> tuple[int, int]:
    """(the highest id of the tokenizer's vocabulary proper, without its added tokens, plus one; how many tokens it
    holds). Its `vocab_size` is the count: where the ids skip numbers (a vocabulary edited by hand, tokens removed) the
    count can fit the model's rows while its highest ids, which any text may produce, lie past them. A tokenizer with
    no `tokenizers` backend (sentencepiece's) numbers its pieces 0 .. vocab_size - 1."""
    count = tokenizer.vocab_size
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return count, count
    return max(backend.get_vocab(with_added_tokens=False).values(), default=-1) + 1, count


def _template_ids(tokenizer) -> set:
    """The ids the chat template writes around a system, user and assistant turn and a generation prompt."""
    from dpotrain.recipe import upstream

    if not tokenizer.chat_template:
        return set()
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    ids = set()
    for messages, generation in (([{"role": "system", "content": "Be brief."}, *turns], False), (turns[:1], True)):
        try:
            ids.update(upstream.tokenize(tokenizer, messages, add_generation_prompt=generation)["input_ids"])
        except Exception:  # noqa: BLE001 - a template that takes no system turn (the next render has none)
            continue
    return ids


def check_data_tokens(config, tokenizer, model: str, splits: dict) -> None:
    """Refuses pairs whose text holds an added token past the model's embedding rows: `check_vocabulary` passes one
    that nothing the run writes itself, but a special token in a message is tokenized as the token, and the first
    micro-batch holding it stopped the run once the model had loaded. `splits`: name -> the pairs as read (None: not
    loaded); searched only where the tokenizer has such a token."""
    rows = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    if tokenizer is None or not isinstance(rows, int):
        return
    if not (past := {token: i for token, i in tokenizer.get_added_vocab().items() if i >= rows}):
        return
    for name, pairs in splits.items():
        held = [(token, pair) for pair in pairs or () if (token := _held(pair, past))]
        if held:
            token, pair = held[0]
            prompt = pair["prompt"]  # a message list, or plain text
            start = str(prompt[0].get("content") if isinstance(prompt, list) and prompt else prompt)[:60]
            raise ConfigError(
                f"{len(held):,} of {len(pairs):,} pairs of the {name} split hold {token!r} (id {past[token]:,}; the "
                f"first: the pair whose prompt starts {start!r}), an added token of the tokenizer of {model} past the "
                f"{rows:,} rows of the model's embedding (vocab_size in its config.json): the first micro-batch "
                "holding it would stop the run (an IndexError on a CPU, a device-side assert on a GPU): remove it from "
                f"those pairs, or {RESIZE}"
            )


def _held(pair: dict, tokens) -> str | None:
    """The first of `tokens` a pair's text holds."""
    return next((token for text in _strings(pair) for token in tokens if token in text), None)


def _strings(value):
    """Every string in a pair as read (message contents, tools, plain text), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list | tuple):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)

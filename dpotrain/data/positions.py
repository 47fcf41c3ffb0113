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


def check_vocabulary(config, tokenizer, model: str) -> None:
    """Refuses a tokenizer whose ids reach past the model's embedding rows (module doc). A model with more rows than
    the tokenizer has ids (a vocabulary padded to a multiple of 64 or 128, as most are) is fine."""
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if tokenizer is None or not isinstance(rows, int):
        return
    ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    if ids <= rows:
        return
    raise ConfigError(
        f"the tokenizer of {model} has {ids:,} token ids, past the {rows:,} rows of the model's embedding (vocab_size "
        f"in its config.json): give the model folder the tokenizer the model was trained with, or resize its "
        "embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"
    )

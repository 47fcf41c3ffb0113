"""The built-in tiny setup: a 2-layer OLMo 3 model, a byte-level BPE tokenizer and a bundled preference set.

Nothing here downloads. `model_name_or_path: builtin:tiny-olmo3` in a recipe is turned into a local folder by
`materialize_model`, which trains the tokenizer on the bundled data and initializes the model from a seeded config
the first time, then reuses the folder. The same seed gives the same weights, so CPU runs are reproducible.
"""

import functools
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.venv import ROOT
from dpotrain.recipe.writes import quiet_progress_bars

SMOKE_DATASET = ROOT / "data" / "smoke_prefs.jsonl"
BUILTIN_PREFIX = "builtin:"
# Bump when the recipe for a built-in artifact changes, so stale caches are rebuilt rather than reused.
_BUILD_VERSION = 1

# ChatML, as OLMo 3 / Dolci chat templates render turns. `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]

BUILTIN_MODELS = {
    # Shaped like OLMo 3 (sliding + full attention layers, GQA), small enough for a 2-core CPU.
    "tiny-olmo3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def is_builtin(name: str | None) -> bool:
    return bool(name) and name.startswith(BUILTIN_PREFIX)


def check_name(name: str) -> None:
    if name.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
        known = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_MODELS)
        raise ConfigError(
            f"unknown built-in model {name!r}: the built-in ones are {known} (or give a Hub name or "
            "a local model folder)"
        )


def _model_dir(name: str) -> Path:
    root = Path(os.environ.get("DPOTRAIN_BUILTIN_DIR", ROOT / "outputs" / ".builtin"))
    return root / f"{name.removeprefix(BUILTIN_PREFIX)}-v{_BUILD_VERSION}"


def existing_model_dir(name: str) -> str | None:
    """The folder of an already built built-in model, or None (nothing is built)."""
    target = _model_dir(name)
    return str(target) if (target / "model.safetensors").exists() else None


def materialize_model(name: str, built=None) -> str:
    """Return a local folder holding the built-in model `name` (with its tokenizer), building it on first use.
    `built`: the tokenizer `build_tokenizer` made already in this process (a run's row check), saved instead of a
    second build, unless a recipe's template replaced the built-in one on it."""
    check_name(name)
    if existing := existing_model_dir(name):
        return existing
    key, target = name.removeprefix(BUILTIN_PREFIX), _model_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private folder and rename: several ranks of one launch may race here, and a reader must never see
    # a half-written model. The build is deterministic, so whichever rename wins holds the same files.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        own = built is not None and built.chat_template == CHAT_TEMPLATE
        tokenizer = built if own else build_tokenizer()
        tokenizer.save_pretrained(tmp)
        with quiet_progress_bars():  # "Writing model shards": a bar for one small file
            build_model(key, tokenizer).save_pretrained(tmp)
        if (tmp / "model.safetensors").exists():
            try:
                tmp.rename(target)
            except OSError:
                if existing_model_dir(name) is None:  # not another rank's rename first: the error, not a wait
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Once torch.distributed is up, transformers writes weights on global rank 0 only (`should_save_on_this_rank`):
    # another rank waits for rank 0's folder (shared, as the project folder is on a cluster) instead of publishing a
    # folder without weights.
    deadline = time.monotonic() + 600
    while (found := existing_model_dir(name)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the built-in model {name} never appeared in {target} (written by global rank 0): is {target.parent}"
                " on a file system every node shares?"
            )
        time.sleep(0.5)
    return found


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE trained on the bundled preference data, with a ChatML chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_bpe(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=BUILTIN_MODELS["tiny-olmo3"]["max_position_embeddings"],
    )


@functools.cache
def _trained_bpe(vocab_size: int) -> str:
    """The trained BPE as tokenizer.json text: training is deterministic and takes ~0.2 CPU-s, which a run paid twice
    (the dry run's template check, then the model's build) and the tests once per dry run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(SMOKE_DATASET) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    texts = [m["content"] for row in rows for side in ("chosen", "rejected") for m in row[side]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts + ["user", "assistant", "system"], trainer=trainer)
    return tok.to_str()


def model_config(key: str, vocab_size: int = 1024):
    """The built-in model's config: its shape, and the special tokens' ids as `build_tokenizer` assigns them (the BPE
    trainer numbers SPECIAL_TOKENS first, in order). Olmo3Config's own defaults (eos 50279, ...) lie outside this
    vocabulary, which transformers warns about at every load."""
    from transformers import Olmo3Config

    bos, pad, eos = (SPECIAL_TOKENS.index(token) for token in ("<|endoftext|>", "<|pad|>", "<|im_end|>"))
    return Olmo3Config(
        vocab_size=vocab_size, bos_token_id=bos, pad_token_id=pad, eos_token_id=eos, **BUILTIN_MODELS[key]
    )


def build_model(key: str, tokenizer, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(key, len(tokenizer))
    specials = (config.bos_token_id, config.pad_token_id, config.eos_token_id)
    assert specials == (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id), specials
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# --- the bundled data set --------------------------------------------------------------------------------------------
# Dolci's shape: `chosen` / `rejected` are message lists that share their leading (user, optionally system) turns and
# differ in the last assistant turn. Chosen answers are careful, correct and well formed; rejected answers are wrong
# or sloppy, so even a tiny model can learn the preference within a few dozen steps. Lengths vary like real data:
# short and long answers on either side, some pairs 10x apart.

_TOPICS = ["rivers", "volcanoes", "bees", "tides", "glaciers", "comets", "forests", "deserts", "coral", "storms"]
_FACTS = [
    "They follow patterns that can be measured and explained.",
    "Scientists study them with careful observation over many years.",
    "Their behaviour depends on temperature, pressure and time.",
    "Small changes can build up into large effects.",
    "They connect to the water cycle and to life around them.",
    "Records from the past help us predict what happens next.",
]
_SLOPPY = ["idk lol", "whatever", "maybe stuff happens", "no idea tbh", "it is what it is", "??", "ok so like yeah"]


def _careful_answer(rng: random.Random, a: int, b: int, topic: str, paragraphs: int) -> str:
    lines = [f"Let us work it out step by step: {a} + {b} = {a + b}.", f"The answer is {a + b}."]
    lines += [f"About {topic}: " + " ".join(rng.sample(_FACTS, 3)) for _ in range(paragraphs)]
    return "\n\n".join(lines)


def _sloppy_answer(rng: random.Random, a: int, b: int, repeats: int) -> str:
    wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 7])
    return f"{wrong} " + " ".join(rng.choice(_SLOPPY) for _ in range(repeats))


def make_preference_rows(n: int = 384, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, topic = rng.randint(2, 99), rng.randint(2, 99), rng.choice(_TOPICS)
        user = f"What is {a} plus {b}? Then tell me something about {topic}."
        prompt = [{"role": "user", "content": user}]
        if i % 10 == 3:
            prompt = [{"role": "system", "content": "You are a careful, friendly tutor."}] + prompt
        if i % 10 == 7:  # multi-turn: an earlier exchange before the scored turn
            prompt = [
                {"role": "user", "content": f"Hi! Can you help me with {topic}?"},
                {"role": "assistant", "content": "Of course. What would you like to know?"},
            ] + prompt
        # Lengths: mostly short answers, a long tail, and pairs 10x apart in both directions.
        shape = rng.random()
        if shape < 0.1:
            chosen, rejected = _careful_answer(rng, a, b, topic, 12), _sloppy_answer(rng, a, b, 1)
        elif shape < 0.2:
            chosen, rejected = _careful_answer(rng, a, b, topic, 0), _sloppy_answer(rng, a, b, 60)
        else:
            chosen = _careful_answer(rng, a, b, topic, int(rng.expovariate(1 / 2.5)))
            rejected = _sloppy_answer(rng, a, b, 1 + int(rng.expovariate(1 / 8)))
        answers = {"chosen": chosen, "rejected": rejected}
        rows.append({side: prompt + [{"role": "assistant", "content": text}] for side, text in answers.items()})
    return rows


if __name__ == "__main__":  # regenerate the bundled file: python -m dpotrain.data.builtin
    SMOKE_DATASET.write_text("".join(json.dumps(row) + "\n" for row in make_preference_rows()))
    print(f"wrote {SMOKE_DATASET}")

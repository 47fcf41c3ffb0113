"""A run whose sequences reach past the model's positions is refused at start, before the model loads
(dpotrain/data/positions.py): from max_length, or from the data's own longest sequence where the analyzer measured
every pair; the limit counts a RoPE scaling in the config."""

import json
import shutil
import subprocess

import numpy as np
import pytest
from test_refusals import refused
from transformers import AutoConfig, Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config

from conftest import ROOT, model_with_a_token_past_its_embedding, python, run_train
from dpotrain.data import lengths, positions
from dpotrain.forwards import cost
from dpotrain.recipe.errors import ConfigError

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]
# The built-in model takes 4096 positions; these pairs are at most ~550 tokens long.
PAST = ["--max_length", "8192", "--max_tokens_per_microbatch", "16384"]


@pytest.mark.parametrize(
    "config, limit",
    [
        (AutoConfig.from_pretrained(ROOT / "configs" / "models" / "olmo3-7b"), 65536),  # rope per layer type
        (
            LlamaConfig(
                max_position_embeddings=131072,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 8192,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
            ),
            131072,
        ),
        # Qwen's long-context recipe: yarn added to config.json, max_position_embeddings left at 32768
        (
            Qwen2Config(
                max_position_embeddings=32768,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            ),
            131072,
        ),
        (Gemma3TextConfig(), 131072),  # linear scaling on full attention, no original: max_position_embeddings holds
        (GPT2Config(), 1024),  # learned positions (n_positions)
    ],
    ids=["olmo3-7b", "llama3.1", "qwen-yarn", "gemma3", "gpt2"],
)
def test_the_limit_is_the_models_positions_or_what_its_rope_scaling_extends_them_to(config, limit):
    assert positions.model_limit(config)[0] == limit


def test_the_longest_sequence_is_the_datas_only_where_every_pair_was_measured():
    pairs = cost.TokenCounts(np.array([100, 3000]), np.array([50, 2000]), np.array([900, 10]), "test")
    assert positions.longest_sequence(8192, pairs, whole_split=True)[0] == 5000  # prompt + its longer completion
    assert positions.longest_sequence(8192, pairs, whole_split=False)[0] == 8192  # a sample: max_length bounds it
    assert positions.longest_sequence(4000, pairs, whole_split=True)[0] == 4000  # truncated to max_length
    assert positions.longest_sequence(None, pairs, whole_split=False)[0] == 5000
    positions.check(Qwen2Config(max_position_embeddings=5000), "m", 8192, pairs, whole_split=True)  # fits exactly
    refusal = (
        r"the data's longest sequence \(5,000 tokens, within max_length 8,192\) reaches past the 4,096 positions m "
        r"takes \(max_position_embeddings 4096\): set --max_length 4096 or lower"
    )
    with pytest.raises(ConfigError, match=refusal):
        positions.check(Qwen2Config(max_position_embeddings=4096), "m", 8192, pairs, whole_split=True)


@pytest.mark.slow
def test_the_run_and_its_dry_run_refuse_a_max_length_past_the_models_positions_before_it_loads(tmp_path):
    out = tmp_path / "run"
    for extra in (["--dry-run"], []):
        result = run_train([*SMOKE, *PAST, "--output_dir", str(out), *extra])
        last = result.stdout.strip().splitlines()[-1]
        assert result.returncode == 2, result.stdout[-3000:]
        assert last == (
            "error: max_length 8,192 reaches past the 4,096 positions builtin:tiny-olmo3 takes "
            "(max_position_embeddings 4096): set --max_length 4096 or lower (scripts/analyze_dataset.py "
            "shows what each length keeps), or extend the model's context in its config.json (rope_scaling,"
            " max_position_embeddings) if you mean to train it longer"
        ), last
        assert "Loading weights" not in result.stdout and not (out / "resolved_config.json").exists()


@pytest.mark.slow
def test_a_max_length_past_the_models_positions_is_taken_when_the_analyzer_measured_every_pair_within_them(tmp_path):
    """The analyzer's cache holds every pair's lengths: the longest (~550 tokens) is what reaches the model."""
    analyzed = subprocess.run(
        [python(), str(ROOT / "scripts" / "analyze_dataset.py"), *SMOKE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert analyzed.returncode == 0, analyzed.stderr[-3000:]
    result = run_train([*SMOKE, *PAST, "--output_dir", str(tmp_path / "run"), "--dry-run"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "reaches past" not in result.stdout


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_tokenizer_with_ids_past_the_models_embedding_is_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A tokenizer of more ids than the model has embedding rows (here the built-in model's config cut to 800 rows)
    used to pass the checks and stop the run in its reference stage (IndexError on a CPU, a device-side assert on a
    GPU); a model with more rows than the tokenizer has ids, as most have, is fine."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    ids = len(lengths.load_tokenizer(str(folder)))
    assert ids > 800
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 800}))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder), *dry_run)
    assert line == (
        f"error: the tokenizer of {folder} has {ids:,} token ids, past the 800 rows of the model's embedding "
        "(vocab_size in its config.json): give the model folder the tokenizer the model was trained with, or resize "
        "its embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"
    )
    tokenizer = lengths.load_tokenizer(str(folder))
    positions.check_vocabulary(LlamaConfig(vocab_size=ids), tokenizer, "m")  # exactly the tokenizer's ids
    positions.check_vocabulary(LlamaConfig(vocab_size=ids + 64), tokenizer, "m")  # padded rows
    # An added token past the rows that nothing writes passes (Gemma's text models: `<image_soft_token>`, one past
    # their last row); one the chat template writes does not.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>", "<|turn|>"]})
    positions.check_vocabulary(LlamaConfig(vocab_size=ids), tokenizer, "m")
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|turn|>")
    with pytest.raises(
        ConfigError, match=rf"the tokenizer of m writes '<\|turn\|>' \(id {ids + 1:,}: the chat template"
    ):
        positions.check_vocabulary(LlamaConfig(vocab_size=ids), tokenizer, "m")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_recipes_pad_token_past_the_models_embedding_is_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A `pad_token` that is a token of the tokenizer (so the vocabulary check passed) but an added one past the
    model's embedding rows: the check of what the trainer feeds took the tokenizer's own pad token, and a padded run
    stopped in its reference stage on `IndexError: index out of range in self`, after the model had loaded."""
    folder, rows = model_with_a_token_past_its_embedding(tmp_path, tiny_model_dir, "<|mypad|>")
    args = ["--model_name_or_path", str(folder), "--pad_token", "<|mypad|>", "--padding_free", "false"]
    line = refused(tmp_path, monkeypatch, capsys, *args, "--max_steps", "2", *dry_run)
    assert line == (
        f"error: pad_token '<|mypad|>' (id {rows:,}) is an added token past the {rows:,} rows of the model's embedding "
        f"(vocab_size in the config.json of {folder}): the trainer would pad with it, so give a pad_token the model "
        "has (e.g. its EOS token '<|im_end|>'), leave pad_token out, or resize its embeddings to the tokenizer "
        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"
    )
    positions.check_vocabulary(
        LlamaConfig(vocab_size=rows), lengths.load_tokenizer(str(folder)), "m", "<|im_end|>"
    )  # one it has: fine


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_pairs_holding_an_added_token_past_the_models_embedding_are_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """An added token past the model's embedding rows that nothing the run writes itself passes the tokenizer's check,
    but a pair whose text holds it (a special token in a message is tokenized as the token) fed its id: the dry run
    said nothing, and the run stopped at the first micro-batch holding it, `IndexError: index out of range in self`
    once the model had loaded (a device-side assert on a GPU)."""
    from dpotrain.data import builtin

    folder, rows = model_with_a_token_past_its_embedding(tmp_path, tiny_model_dir, "<|extra|>")
    pairs = builtin.make_preference_rows(40, seed=3)
    for n in (5, 9):
        pairs[n]["chosen"][-1]["content"] += " <|extra|>"
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    args = ["--model_name_or_path", str(folder), "--dataset_name", str(data), "--max_steps", "2"]
    line = refused(tmp_path, monkeypatch, capsys, *args, *dry_run)
    first = pairs[5]["chosen"][0]["content"][:60]
    assert line == (
        f"error: 2 of 40 pairs of the train split hold '<|extra|>' (id {rows:,}; the first: the pair whose prompt "
        f"starts {first!r}), an added token of the tokenizer of {folder} past the {rows:,} rows of the model's "
        "embedding (vocab_size in its config.json): the first micro-batch holding it would stop the run (an IndexError "
        "on a CPU, a device-side assert on a GPU): remove it from those pairs, or resize its embeddings to the "
        "tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_tokenizer_whose_ids_skip_numbers_past_the_models_embedding_is_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A vocabulary whose ids skip numbers (here 'assistant' moved from id 896 to 950): it holds 897 tokens, as many as
    the model has embedding rows, so the check of its `vocab_size` (a count) passed, and the run stopped in its
    reference stage on `IndexError: index out of range in self` (a device-side assert on a GPU) once the model had
    loaded. Its highest id is what reaches the embedding."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    rows, top = len(vocab), max(vocab.values())
    assert top == rows - 1 == json.loads((folder / "config.json").read_text())["vocab_size"] - 1
    vocab["assistant"] = rows + 53
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: the tokenizer of {folder} has token ids up to {rows + 53:,} ({rows:,} tokens: its ids skip numbers), "
        f"past the {rows:,} rows of the model's embedding (vocab_size in its config.json): give the model folder the "
        "tokenizer the model was trained with, or resize its embeddings to the tokenizer "
        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"
    )
    tokenizer = lengths.load_tokenizer(str(folder))
    positions.check_vocabulary(LlamaConfig(vocab_size=rows + 54), tokenizer, "m")  # rows up to its highest id: fine

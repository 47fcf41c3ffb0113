"""scripts/analyze_dataset.py and dpotrain/data/lengths.py: the lengths are the trainer's own, the numbers follow from
them.

Every expected number here is computed from what TRL itself produces: `DPOTrainer._prepare_dataset` (the trainer's
tokenization, and its filter of rows whose prompt fills max_length) and `DataCollatorForPreference` (truncation and
padding), on small local data sets with the built-in tiny tokenizer.
"""

import json
import os
import re
import shutil
import subprocess
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from conftest import PAUSE_AT, PYTHON, ROOT, in_child, pause_env, python, signal_paused
from dpotrain.data import builtin, cuts, data, lengths
from dpotrain.forwards import packing
from dpotrain.recipe.errors import ConfigError, size

SCRIPT = ROOT / "scripts" / "analyze_dataset.py"


# --- fixtures --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return lengths.load_tokenizer(tiny_model_dir)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _messages_rows() -> list[dict]:
    """Dolci-shaped rows without `prompt`: single-turn, system (i % 10 == 3), multi-turn (i % 10 == 7); and one
    long prompt that the trainer drops at small max_length."""
    rows = builtin.make_preference_rows(40, seed=3)
    long_user = {"role": "user", "content": "Please explain tides. " * 30}
    rows.append(
        {
            "chosen": [long_user, {"role": "assistant", "content": "The moon pulls the water."}],
            "rejected": [long_user, {"role": "assistant", "content": "idk"}],
        }
    )
    return rows


def _prompt_rows() -> list[dict]:
    """Explicit `prompt` message lists, completions of one or two messages."""
    rows = []
    for i, row in enumerate(_messages_rows()):
        prompt, chosen, rejected = row["chosen"][:-1], row["chosen"][-1:], row["rejected"][-1:]
        if i % 5 == 1:
            chosen = chosen + [{"role": "assistant", "content": "Anything else I can help with?"}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def _text_rows() -> list[dict]:
    """Plain text, prompt extracted from the shared start (as TRL does, character by character)."""
    rows = []
    for row in _messages_rows():
        question = f"Question: {row['chosen'][-2]['content']}\nAnswer:"
        rows.append(
            {
                "chosen": question + " " + row["chosen"][-1]["content"],
                "rejected": question + " " + row["rejected"][-1]["content"],
            }
        )
    return rows


def _text_prompt_rows() -> list[dict]:
    """Plain text with a `prompt` column; some prompts end mid-word, so tokens merge across the boundary."""
    rows = []
    for i, row in enumerate(_text_rows()):
        cut = row["chosen"].index("Answer:") + (5 if i % 3 == 0 else 7)  # "Answ|er:" merges differently
        rows.append({"prompt": row["chosen"][:cut], "chosen": row["chosen"][cut:], "rejected": row["rejected"][cut:]})
    return rows


SHAPES = {"messages": _messages_rows, "prompt": _prompt_rows, "text": _text_rows, "text_prompt": _text_prompt_rows}


@pytest.fixture(params=sorted(SHAPES))
def shaped(request, tmp_path):
    """(name, path) of a local JSONL data set of one shape (message lists and plain text cannot share one)."""
    return request.param, write_jsonl(tmp_path / f"{request.param}.jsonl", SHAPES[request.param]())


def error_line(capsys) -> str:
    """The one `error: ...` line, which is the last thing printed."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1, lines
    return lines[-1]


def trainer_dataset(dataset, tokenizer, tmp_path, max_length=None):
    """The trainer's own processed data set: DPOTrainer._prepare_dataset, unbound, with the one attribute it uses."""
    from trl import DPOConfig, DPOTrainer

    class Shim:
        _tokenizer = tokenizer

    args = DPOConfig(output_dir=str(tmp_path / "out"), max_length=max_length, report_to=[], use_cpu=True, bf16=False)
    return DPOTrainer._prepare_dataset(Shim(), dataset, tokenizer, args, "train")


def trainer_lengths(dataset, tokenizer, tmp_path):
    processed = trainer_dataset(dataset, tokenizer, tmp_path)
    return tuple(np.array([len(ids) for ids in processed[k]]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))


# --- the same tokens as training -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["batched", "reference"])
def test_lengths_equal_the_trainers_for_every_row(shaped, method, tokenizer, tmp_path):
    name, path = shaped
    dataset = data.load_preference_dataset(path)
    prompt, chosen, rejected = trainer_lengths(dataset, tokenizer, tmp_path)
    m = lengths.measure(dataset, tokenizer, method=method, chunk_size=16)
    assert m.invalid == [] and m.fast_path_mismatches == 0
    np.testing.assert_array_equal(m.index, np.arange(len(dataset)))
    np.testing.assert_array_equal(m.prompt, prompt, err_msg=name)
    np.testing.assert_array_equal(m.chosen, chosen, err_msg=name)
    np.testing.assert_array_equal(m.rejected, rejected, err_msg=name)
    assert m.conversational == (name in ("messages", "prompt"))


def test_rows_without_chat_template_kwargs_are_measured_as_the_run_reads_them(tmp_path, tiny_model_dir):
    """A null `chat_template_kwargs` beside rows that have some reaches the run's template as the column's keys with
    no value (rows.no_null_kwargs, as a row written `{}` reads), and the analyzer rendered it with none: a template
    that writes what is defined (`effort is defined`) gave the run 22 prompt tokens more on those rows than the
    analyzer measured, the max_length recommended and `max_length: auto`'s choice made from lengths the run never
    trains. Measured now as the run reads them, streamed too."""
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    template = tmp_path / "effort.jinja"
    own = (Path(tiny_model_dir) / "chat_template.jinja").read_text()
    effort = "{% if effort is defined %}<|im_start|>system\nEffort: {{ effort }} {{ effort }}<|im_end|>\n{% endif %}"
    template.write_text(effort + own)
    rows = _messages_rows()
    for i, row in enumerate(rows):
        row["chat_template_kwargs"] = {"effort": "high"} if i % 2 else None
    path = write_jsonl(tmp_path / "kwargs.jsonl", rows)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", tiny_model_dir]
    args += ["--dataset_name", path, "--chat_template_path", str(template), "--assistant_turns", "final"]
    recipe = parse_args([*args, "--output_dir", str(tmp_path / "run")])
    pairs = stages.load_data(recipe, stages.checks(recipe), say=False).train
    tokenizer = lengths.recipe_tokenizer(recipe)
    trained = trainer_lengths(pairs, tokenizer, tmp_path)
    for streaming in (False, True):
        m = lengths.measure(data.load_preference_dataset(path, streaming=streaming), tokenizer, chunk_size=8)
        for key, run in zip(("prompt", "chosen", "rejected"), trained, strict=True):
            np.testing.assert_array_equal(getattr(m, key), run, err_msg=f"{key}, streaming={streaming}")


def test_answers_after_a_files_first_10_mib_are_measured_as_written(tokenizer, tmp_path):
    """datasets types a JSON Lines field by the file's first 10 MiB: one later answer written as text parts (or as a
    number) made it read that chunk's answers as JSON cast to text, every one of them quoted and its newlines `\\n`,
    with no mark of it on the loaded data. The analyzer measured those texts, and the run trained them, in silence."""
    rows = []
    for i, row in enumerate(_messages_rows() * 15):  # 615 pairs of ~20 KiB: the last ones after the first 10 MiB
        row = json.loads(json.dumps(row))
        row["chosen"][-1]["content"] += f"\n\nSee also note {i}.\n" + "Tides rise and fall.\n" * 1000
        rows.append(row)
    parts = rows[-1]["chosen"][-1]
    parts["content"] = [{"type": "text", "text": parts["content"]}]
    path = write_jsonl(tmp_path / "late.jsonl", rows)
    assert os.path.getsize(path) > 11 << 20
    loaded = data.load_preference_dataset(path)
    assert [row["chosen"] for row in loaded] == [row["chosen"] for row in rows]  # '"...' before
    late, early = len(rows) - 2, len(rows) - 2 - 41 * 14  # the same pair, but its note's number
    m = lengths.measure(loaded.select([early, late]), tokenizer)
    assert abs(int(m.chosen[1]) - int(m.chosen[0])) <= 2  # quoted, its 1,000 newlines `\\n`: more tokens


@pytest.mark.parametrize("mixed_answers", [False, True])
def test_template_inputs_after_a_files_first_10_mib_are_measured_as_written(mixed_answers, tmp_path, tiny_model_dir):
    """As the answers above: one late row's `effort` written as a number made that chunk's `chat_template_kwargs`
    (and a tool's `"default": "auto"`) come back quoted, `"high"` with its quotes, which the template wrote into every
    prompt of the chunk: other tokens measured, and trained, than the rows hold. `mixed_answers`: the first row's
    answer also written as text parts, which made only the answers be read again, the quoted kwargs left so."""
    template = tmp_path / "effort.jinja"
    own = (Path(tiny_model_dir) / "chat_template.jinja").read_text()
    template.write_text(
        "{% if effort is defined %}<|im_start|>system\nEffort: {{ effort }}<|im_end|>\n{% endif %}" + own
    )
    tokenizer = lengths.load_tokenizer(tiny_model_dir, chat_template_path=str(template))
    rows = []
    for i, row in enumerate(_messages_rows() * 15):  # 615 pairs of ~20 KiB: the last ones after the first 10 MiB
        row = json.loads(json.dumps(row))
        row["chosen"][-1]["content"] += f" See also note {i}. " + "Tides rise and fall. " * 1000
        row["chat_template_kwargs"] = {"effort": "high"}
        rows.append(row)
    rows[-1]["chat_template_kwargs"] = {"effort": 3}
    if mixed_answers:
        rows[0]["chosen"][-1]["content"] = [{"type": "text", "text": rows[0]["chosen"][-1]["content"]}]
    path = write_jsonl(tmp_path / "late.jsonl", rows)
    assert os.path.getsize(path) > 11 << 20
    loaded = data.load_preference_dataset(path)
    assert [row["chat_template_kwargs"] for row in loaded] == [row["chat_template_kwargs"] for row in rows]
    late, early = len(rows) - 2, len(rows) - 2 - 41 * 14  # the same pair, but its note's number
    m = lengths.measure(loaded.select([early, late]), tokenizer)
    assert m.prompt[1] == m.prompt[0]  # '"high"': more tokens


def test_two_processes_and_streaming_give_the_same_lengths(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    one = lengths.measure(data.load_preference_dataset(path), tokenizer, chunk_size=8)
    two = lengths.measure(data.load_preference_dataset(path), tokenizer, num_proc=2, chunk_size=8)
    streamed = lengths.measure(data.load_preference_dataset(path, streaming=True), tokenizer, num_proc=2, chunk_size=8)
    for m in (two, streamed):
        for key in ("index", "prompt", "chosen", "rejected"):
            np.testing.assert_array_equal(getattr(m, key), getattr(one, key))


def test_a_batch_whose_fast_path_differs_from_the_trainers_is_measured_row_by_row(tokenizer, monkeypatch, capsys):
    import datasets

    rows = datasets.Dataset.from_list(_messages_rows())  # in memory: nothing cached
    reference = lengths.measure(rows, tokenizer, method="reference")
    fast = lengths._lengths_of_texts
    monkeypatch.setattr(lengths, "_lengths_of_texts", lambda *a: [(p + 1, *rest) for p, *rest in fast(*a)])
    m = lengths.measure(rows, tokenizer, chunk_size=16)
    assert m.fast_path_mismatches == 3  # 41 rows: three batches, each checked on its first row
    for key in ("index", "prompt", "chosen", "rejected", "shared"):
        np.testing.assert_array_equal(getattr(m, key), getattr(reference, key))
    assert "differed from TRL's in 3 chunks; those were measured" in capsys.readouterr().err
    assert lengths.measure(rows, tokenizer, chunk_size=64).fast_path_mismatches == 1  # it read "1 chunk(s); those"
    assert "differed from TRL's in 1 chunk; it was measured one row at a time" in capsys.readouterr().err


def test_each_pairs_chat_template_is_rendered_once_and_measured_as_the_trainer_does(tokenizer, monkeypatch):
    """Issue #54: `measure` rendered each pair's three texts twice, to check the answers against the template and to
    tokenize them. The check's texts are tokenized: once a row, plus `row_lengths`' own on each batch's first row."""
    import datasets

    rows = datasets.Dataset.from_list(_messages_rows())  # in memory: nothing cached
    reference = lengths.measure(rows, tokenizer, method="reference")
    calls, render = [], type(tokenizer).apply_chat_template

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("tokenize", True))
        return render(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counted)
    m = lengths.measure(rows, tokenizer, chunk_size=16)
    assert len(rows) == 41 and calls.count(False) == 3 * 41  # rendered as text: the three texts of each row, once
    assert len(calls) == 3 * 41 + 3 * 3  # and tokenized by the trainer's calls on the first row of the 3 batches
    for key in ("index", "prompt", "chosen", "rejected", "shared"):
        np.testing.assert_array_equal(getattr(m, key), getattr(reference, key))


def test_a_split_read_from_files_is_tokenized_once_per_tokenizer(tokenizer, tmp_path):
    """`Dataset.map`'s cache, beside the data set's own files: the same rows with the same tokenizer are read back (the
    file is not written again), another chat template is tokenized anew."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    dataset = data.load_preference_dataset(path)
    folder = os.path.dirname(dataset.cache_files[0]["filename"])

    def maps():
        return {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder) if f.startswith("cache-")}

    before = maps()
    first = lengths.measure(dataset, tokenizer, chunk_size=8)
    written = maps()
    assert len(set(written) - set(before)) == 1
    again = lengths.measure(data.load_preference_dataset(path), tokenizer, num_proc=2, chunk_size=8)
    assert maps() == written  # read back, not tokenized and written again
    for key in ("index", "prompt", "chosen", "rejected", "shared"):
        np.testing.assert_array_equal(getattr(again, key), getattr(first, key))
    other = lengths.load_tokenizer(tokenizer.name_or_path)
    other.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    lengths.measure(dataset, other, chunk_size=8)
    assert len(set(maps()) - set(written)) == 1


def test_measuring_in_processes_leaves_the_environment_as_it_found_it(tokenizer, tmp_path, monkeypatch):
    """datasets, mapping in processes, sets TOKENIZERS_PARALLELISM and puts a copy of os.environ in its place: a patch
    of the environment around the measure (the preflight's) must still be undone, and nothing else left behind."""
    from unittest import mock

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    dataset = data.load_preference_dataset(write_jsonl(tmp_path / "d.jsonl", _messages_rows()))
    environ, before = os.environ, dict(os.environ)
    with mock.patch.dict(os.environ, DPOTRAIN_PATCHED="1"):
        assert lengths.measure(dataset, tokenizer, num_proc=2, chunk_size=8).rows == len(dataset)
    assert os.environ is environ and dict(os.environ) == before


def test_a_saved_data_set_in_a_read_only_folder_is_analysed_without_writing_there(cli, tmp_path, tiny_model_dir):
    """The analyzer as its process ends it (`run_cli`), in a forked child where the data set's folder is a read-only
    mount (`in_child`), its two map processes forked from that child: a fresh interpreter imported the stack again."""
    import datasets

    from dpotrain.recipe.errors import run_cli

    saved = tmp_path / "shared" / "pairs"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_messages_rows())}).save_to_disk(str(saved))
    files = sorted(saved.rglob("*"))
    argv = [str(saved), "--tokenizer", tiny_model_dir, "--num-proc", "2"]
    env = {"DPOTRAIN_CACHE": str(tmp_path / "cache")}
    code, stdout, stderr = in_child(lambda: run_cli(lambda: cli.main(argv)), read_only=[saved.parent], env=env)
    assert code == 0 and "Recommended max_length: 512" in stdout, stderr[-3000:]
    assert sorted(saved.rglob("*")) == files


# --- the report's numbers ---------------------------------------------------------------------------------------------


def test_json_numbers_follow_from_the_trainers_processed_data(cli, tokenizer, tmp_path, tiny_model_dir):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    out = tmp_path / "report.json"
    argv = [path, "--tokenizer", tiny_model_dir, "--candidates", "64", "128", "300", "--batch-size", "3"]
    assert cli.main([*argv, "--json", str(out), "--num-proc", "1", "--coverage", "0.8"]) == 0
    report = json.loads(out.read_text())

    dataset = data.load_preference_dataset(path)
    processed = trainer_dataset(dataset, tokenizer, tmp_path)
    prompt, chosen, rejected = (
        np.array([len(x) for x in processed[k]]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")
    )
    total = prompt + np.maximum(chosen, rejected)
    assert report["rows"] == len(dataset)
    for key, values in (("total", total), ("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        expected = {f"p{q}": int(np.percentile(values, q, method="inverted_cdf")) for q in (50, 90, 95, 99)}
        assert report[key] == expected | {"max": int(values.max())}
    assert set(report["coverage"]) == {"64", "128", "300", *map(str, lengths.REPORT_LENGTHS)}
    for length, fraction in report["coverage"].items():
        assert fraction == pytest.approx(np.mean(total <= int(length)))

    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=None)
    for length in (64, 128, 300):
        cut = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=length)
        kept = trainer_dataset(dataset, tokenizer, tmp_path, max_length=length)  # the trainer's own drop filter
        candidate = report["candidates"][str(length)]
        assert candidate["dropped"] == len(dataset) - len(kept)
        rows = [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in kept]
        truncated = sum(cut([r])["input_ids"].numel() < collator([r])["input_ids"].numel() for r in rows)
        assert candidate["truncated"] == truncated
        # Padding in data set order, batches of 3 pairs, exactly as the collator pads them.
        batches = [cut(rows[i : i + 3]) for i in range(0, len(rows), 3)]
        positions = sum(b["input_ids"].numel() for b in batches)
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        assert candidate["padding"]["padded_dataset_order"] == pytest.approx(1 - real / positions)
        assert candidate["padding"]["packed_positions"] == real
        assert candidate["padding"]["batch_size"] == 3
        # Packed compute: the positions of the sequences as the packed collator cuts them, and with each pair's
        # prompt once (its completions cut where their sequences are).
        pairs = [packing.sequences(r, length, "keep_start") for r in rows]
        unshared = sum(len(ids) for pair in pairs for ids, _ in pair)
        shared = sum(len(r["prompt_ids"]) + sum(c) + sum(m) for r, ((_, c), (_, m)) in zip(rows, pairs, strict=True))
        assert candidate["compute"]["positions"] == unshared == real
        assert candidate["compute"]["positions_shared_prompt"] == shared < unshared

    best = report["candidates"][str(report["recommended_max_length"])]["compute"]
    for candidate in report["candidates"].values():
        compute = candidate["compute"]
        assert compute["relative"] == pytest.approx(compute["positions"] / best["positions"])
        assert compute["relative_shared_prompt"] == pytest.approx(
            compute["positions_shared_prompt"] / best["positions_shared_prompt"]
        )

    best = report["recommended_max_length"]
    assert best % 512 == 0 and np.mean(total <= best) >= 0.8 and (best == 512 or np.mean(total <= best - 512) < 0.8)
    assert report["recommendation"]["coverage"] == pytest.approx(np.mean(total <= best))


def test_recommendation_is_the_smallest_multiple_of_512_reaching_the_target():
    total = np.array([100] * 89 + [1000] + [5000] * 10)  # 89% <= 512, 90% <= 1024, 100% <= 5120
    assert lengths.recommend(total, 0.89) == 512
    assert lengths.recommend(total, 0.9) == 1024  # 1000 <= 1024: exactly at the target counts
    assert lengths.recommend(total, 0.91) == 5120
    assert lengths.recommend(total, 1.0) == 5120
    assert lengths.recommend(np.array([1024]), 1.0) == 1024  # a row of exactly max_length is not truncated


def test_recommendation_shows_what_a_shorter_and_a_doubled_max_length_trade():
    # 90 short pairs (total 400) and 10 long ones (prompt 100, chosen 800, rejected 400: total 900), computed by hand:
    # at 512 a long pair runs min(900, 512) + 500 = 1012 positions, at 1024 all 1400; a short one 400 + 300 = 700.
    short, long = 90, 10
    m = lengths.Measured(
        index=np.arange(short + long),
        prompt=np.full(short + long, 100),
        chosen=np.array([300] * short + [800] * long),
        rejected=np.array([200] * short + [400] * long),
        invalid=[],
        conversational=True,
    )
    at_512, at_1024 = short * 700 + long * 1012, short * 700 + long * 1400
    prompts = (short + long) * 100
    assert lengths.packed_positions(m, 512) == (at_512, at_512 - prompts)
    assert lengths.packed_positions(m, 1024) == (at_1024, at_1024 - prompts)
    assert lengths.packed_positions(m, 100) == (0, 0)  # every prompt fills max_length: every pair dropped

    r = lengths.recommendation(m, 0.9)
    assert (r["max_length"], r["coverage"], r["truncated"], r["dropped"]) == (512, 0.9, long, 0)
    assert r["doubled"]["max_length"] == 1024 and r["doubled"]["coverage"] == 1.0
    assert r["doubled"]["compute"] == pytest.approx(at_1024 / at_512 - 1)  # +5.3%
    assert r["doubled"]["compute_shared_prompt"] == pytest.approx((at_1024 - prompts) / (at_512 - prompts) - 1)
    assert "no smaller multiple of 512 exists" in r["reason"]
    doubling = "doubling to 1,024 would leave 10.0% more of the pairs whole for +5.3% packed compute (+6.1% with"
    assert doubling in r["reason"]

    r = lengths.recommendation(m, 0.95)
    assert r["max_length"] == 1024 and r["lower"]["max_length"] == 512 and r["lower"]["coverage"] == 0.9
    assert r["lower"]["compute"] == pytest.approx(at_512 / at_1024 - 1)
    assert "512 would leave 90.0% whole for 5.0% less compute" in r["reason"]


def test_padding_of_a_batch_larger_than_the_data_is_one_batch():
    """--batch-size 99999999999999999999 (a typo's extra digits) was read, every pair tokenized, and the report failed
    in a traceback (TypeError: Cannot cast array data from dtype('O') to dtype('int64')): numpy's arange takes no
    step past 2**63. A batch of more pairs than there are pads them all to the longest, as any batch of at least that
    many does."""
    m = lengths.Measured(np.arange(3), np.full(3, 10), np.array([5, 20, 10]), np.full(3, 5), [], True)
    one_batch = lengths.padding(m, 1024, 3)  # 6 sequences padded to 30: 180 positions for 15 + 30 + 20 + 3 x 15
    assert one_batch == (180, 1 - 110 / 180, (180 - 110) / 3)
    assert lengths.padding(m, 1024, 10**20) == lengths.padding(m, 1024, 4) == one_batch


def test_a_low_target_is_raised_to_a_length_training_takes():
    """auto_coverage 0.3 on pairs two in three of whose prompts are long: the target is reached at 512, where those
    prompts alone fill max_length. The analyzer recommended 512 and `max_length: auto` chose it, which the run then
    refused (fewer than half the pairs keep anything to learn), advising `--max_length auto`."""
    from dpotrain.data import cuts

    m = lengths.Measured(
        index=np.arange(30),
        prompt=np.array([20] * 10 + [700] * 20),
        chosen=np.full(30, 10),
        rejected=np.full(30, 5),
        invalid=[],
        conversational=True,
    )
    r = lengths.recommendation(m, 0.3)
    assert (r["max_length"], r["raised"], r["capped"]) == (1024, {"from": 512, "teaching": 10}, None)
    assert "raised from 512, the smallest multiple reaching the target, where only 10 of 30 pairs" in r["reason"]
    cuts.check(m.prompt, m.chosen, m.rejected, None, r["max_length"], "keep_start", "the pairs")  # taken
    assert lengths.recommendation(m, 0.95)["raised"] is None  # a target training takes as it is


def test_under_keep_end_long_prompts_are_not_refused_as_dropped(cli, tmp_path, tiny_model_dir, capsys):
    """keep_end cuts a long pair's start and drops nothing, and training takes max_length 4,096 on pairs most of whose
    prompts are longer. The analyzer and `max_length: auto` judged the recommendation as keep_start does: refused,
    "12 dropped (the prompt alone fills max_length)", the length a recipe could give by hand."""
    words = [" ".join(f"w{i}" for i in range(1500 if k < 12 else 50)) for k in range(20)]  # 12 prompts > 4,096
    rows = [
        {side: [{"role": "user", "content": w}, {"role": "assistant", "content": a}] for side, a in answers}
        for w in words
        for answers in [(("chosen", "yes it is"), ("rejected", "no"))]
    ]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\nmax_length: auto\ntruncation_mode: keep_end\n"
        "bf16: false\naccelerate_config: none\n"
    )
    out = tmp_path / "r.json"
    assert cli.main(["--config", str(recipe), "--num-proc", "1", "--json", str(out)]) == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    r, at = report["recommendation"], report["candidates"]["4096"]
    assert (r["max_length"], r["truncated"], r["dropped"], r["raised"]) == (4096, 12, 0, None)
    assert (at["truncated"], at["dropped"]) == (12, 0)  # the table's counts are training's too
    assert "12 pairs (60.0%) are cut at max_length (the collator keeps the end); 0 are" in capsys.readouterr().out
    # the reasoning `max_length: auto` records (derived.max_length): keep_end cuts their start, not their end
    assert "12 pairs (60.0%) are cut at their start (keep_end) and 0 dropped" in r["reason"], r["reason"]
    found = lengths.cached_measure(lengths.dataset_identity(path), lengths.load_tokenizer(tiny_model_dir))
    assert lengths.resolution_of(found, 0.95, 4096, "keep_end")["max_length"] == 4096  # the run's, from the cache
    with pytest.raises(ConfigError, match="12 dropped"):  # keep_start: those pairs are dropped, as training refuses
        lengths.recommendation(found[0], max_positions=4096)


def test_a_recommendation_short_of_its_target_is_not_said_to_reach_it():
    """Capped at the model's positions, the recommendation leaves fewer pairs whole than the target asks, and its
    reason (the analyzer's --json, resolved_config.json's derived.max_length) and the report's rationale began
    `max_length=4,096 is the smallest multiple of 512 that leaves at least 95.0% of pairs whole: 92.3% ...`. Raised
    for the pairs' sake, it is not the smallest multiple reaching the target either."""
    from dpotrain.data import lengths_report

    m = lengths.Measured(np.arange(20), np.full(20, 100), np.array([100] * 18 + [900] * 2), np.full(20, 50), [], True)
    r = lengths.recommendation(m, 0.95, max_positions=512)
    assert (r["max_length"], r["coverage"]) == (512, 0.9)
    assert r["reason"].startswith(
        "max_length=512 is within the model's positions, below the target of 95.0% of pairs whole: 90.0% of 20 pairs"
    )
    assert "capped at the model's 512 positions" in r["reason"]
    text = lengths_report.to_markdown(lengths.summarize(m, max_positions=512, dataset="pairs.jsonl"), 512)
    assert "- Within the model's positions, below the target of 95.0% of pairs whole: it leaves 90.0%" in text
    assert "leaving at least" not in text
    raised = lengths.Measured(
        np.arange(30), np.array([20] * 10 + [700] * 20), np.full(30, 10), np.full(30, 5), [], True
    )
    assert lengths.recommendation(raised, 0.3)["reason"].startswith(
        "max_length=1,024 is the smallest multiple of 512 that leaves at least 30.0% of pairs whole and half the pairs "
        "anything to learn:"
    )


def test_synthetic_think_lengths_reproduce_the_published_statistics():
    """benchmarks/think_lengths.py stands in for Dolci-Think-DPO-7B (not downloadable here): its table in
    BENCHMARKS.md is only as good as this fit to the seed report's numbers."""
    from benchmarks import think_lengths

    m = think_lengths.synthetic_think_lengths()
    for tokens, share in think_lengths.TOTAL_CDF.items():
        assert lengths.coverage(m.total, tokens) == pytest.approx(share, abs=0.003), tokens
    for q, tokens in think_lengths.TOTAL_PERCENTILES.items():
        assert np.percentile(m.total, q) == pytest.approx(tokens, rel=0.01), q
    for name, (median, p95) in think_lengths.COMPONENTS.items():
        values = getattr(m, name)
        assert np.median(values) == pytest.approx(median, rel=0.06), name
        assert np.percentile(values, 95) == pytest.approx(p95, rel=0.07), name


def test_think_recipe_max_length_is_what_its_table_supports():
    """configs/think.yaml's max_length (chosen from benchmarks/think_lengths.py's table): it leaves the default
    coverage of the pairs whole, is within one multiple of 512 of the analyzer's recommendation, and its token
    budget holds its longest pair."""
    import yaml

    from benchmarks import think_lengths

    recipe = yaml.safe_load((ROOT / "configs" / "think.yaml").read_text())
    m = think_lengths.synthetic_think_lengths()
    best = lengths.recommendation(m)["max_length"]
    assert lengths.coverage(m.total, recipe["max_length"]) >= lengths.DEFAULT_COVERAGE
    assert best <= recipe["max_length"] <= best + lengths.STEP
    assert recipe["max_tokens_per_microbatch"] >= 2 * recipe["max_length"]


def test_max_length_null_on_the_command_line_is_counted_as_the_run_trains_it_unbounded(
    cli, tmp_path, tiny_model_dir, capsys
):
    """`train_dpo.py --max_length null` over a recipe without a token budget trains unbounded (its dry run: `max
    length: none`), cutting nothing; the analyzer took the same flag and ended with the cuts at its recommended length
    (`Cut at max_length 512: ...`), as if that were the length the run trains at."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\nmax_length: 384\n")
    assert cli.main(["--config", str(recipe), "--num-proc", "1", "--max_length", "null"]) == 0
    err = capsys.readouterr().err
    assert f"Cut at max_length unset: none of {len(_messages_rows())} pairs cut or dropped" in err, err
    assert "warning: training refuses" not in err  # no token budget: the run trains it


def test_max_length_null_over_a_token_budget_is_said_as_training_refuses_it(cli, tmp_path, tiny_model_dir, capsys):
    """configs/smoke.yaml has a token budget, which no unbounded pair fits: `train_dpo.py --max_length null` is refused
    at start. The analyzer ended with `Cut at max_length unset: none ... cut` and exit 0, nothing said of the
    refusal, as it says of a length the budget cannot hold."""
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--tokenizer", tiny_model_dir, "--num-proc", "1"]
    assert cli.main([write_jsonl(tmp_path / "d.jsonl", _messages_rows()), *smoke, "--max_length", "null"]) == 0
    assert (
        "warning: training refuses --max_length null with the recipe's max_tokens_per_microbatch: "
        "max_tokens_per_microbatch=2048 must hold the longest possible pair, 2 x max_length (unbounded: set "
        "max_length); a pair is never split"
    ) in capsys.readouterr().err


def test_report_prints_tables_and_reasoning(cli, tmp_path, tiny_model_dir, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 0
    out = capsys.readouterr().out
    for heading in ("Total Length", "Component Breakdown", "Cumulative Distribution", "Candidates", "Rationale"):
        assert heading in out
    assert "Smallest multiple of 512 leaving at least 95.0% of pairs whole" in out
    assert "Recommended max_length: 512 (covers 100.0% of pairs; target 95.0%; 1024 would cover 100.0%" in out


def test_recipe_gives_tokenizer_dataset_batch_size_and_current_max_length(cli, tmp_path, tiny_model_dir, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\nper_device_train_batch_size: 2\n"
        "max_length: 384\nauto_coverage: 0.5\n"
    )
    out = tmp_path / "r.json"
    assert cli.main(["--config", str(recipe), "--json", str(out), "--num-proc", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["candidates"]["384"]["padding"]["batch_size"] == 2
    assert report["recommendation"]["target_coverage"] == 0.5
    assert "The recipe's max_length=384 covers" in capsys.readouterr().out


def test_the_padding_figures_pad_the_batch_the_run_takes(cli, tmp_path, tiny_model_dir):
    """Without a token budget a run's micro-batches are per_device_train_batch_size pairs, TRL's 8 where nothing sets
    it; the analyzer's padding figures padded 4 (its own default) beside a dry run that planned 8. With a budget the run
    pads no fixed batch: OLMo 3's 4 pairs, unless the recipe gives a batch size."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    base = f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\nmax_length: 384\n"
    batches = {}
    for name, extra in [("none", ""), ("budget", "max_tokens_per_microbatch: 1024\n")]:
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(base + extra)
        out = tmp_path / f"{name}.json"
        assert cli.main(["--config", str(recipe), "--json", str(out), "--num-proc", "1"]) == 0
        batches[name] = json.loads(out.read_text())["candidates"]["384"]["padding"]["batch_size"]
    assert batches == {"none": 8, "budget": 4}


def test_max_length_and_truncation_mode_on_the_command_line_are_measured_as_training_takes_them(
    cli, tokenizer, tmp_path, tiny_model_dir, capsys
):
    """`train_dpo.py --max_length 64 --truncation_mode keep_end` over a recipe: the analyzer takes the same two flags
    over the same recipe (it refused them as unknown, so another length could be judged only by editing the recipe)
    and ends with the counts that run records."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\nmax_length: 384\n")
    argv = ["--config", str(recipe), "--num-proc", "1", "--max-length", "64", "--truncation_mode", "keep_end"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    m = lengths.measure(data.load_preference_dataset(path), tokenizer)
    expected = cuts.count(m.prompt, m.chosen, m.rejected, 64, "keep_end")
    assert expected["truncated"] > 0 and expected["dropped"] == 0
    assert f"Cut at {cuts.line(expected)}" in captured.err
    # the command line's length, not the recipe's 384: it said "The recipe's max_length=64" and marked 64 "(recipe)"
    assert "- --max_length 64 covers" in captured.out and "| 64 (--max_length) |" in captured.out
    assert "(recipe)" not in captured.out


def test_a_hub_data_set_takes_the_recipe_that_names_its_model(cli):
    """docs/max_length.md: `analyze_dataset.py allenai/Dolci-Think-DPO-7B` takes the tokenizer from configs/think.yaml.
    Two recipes train on that data set, and think-32b.yaml, first by name, names no model (the 32B SFT is the user's):
    the command was refused ('no tokenizer for ...'), and with --tokenizer measured without think.yaml's chat
    template, for think-32b's max_length."""
    run = cli.read_run(cli.parse_args(["allenai/Dolci-Think-DPO-7B"]))
    assert os.path.basename(run.config_path) == "think.yaml"
    assert run.model.model_name_or_path == "geodesic-research/sfm-sft_dolci_think_unfiltered"
    assert run.project.chat_template_path == "configs/templates/olmo_thinker.jinja"
    run = cli.read_run(cli.parse_args(["allenai/Dolci-Think-DPO-7B", "--tokenizer", "org/my-think-sft"]))
    assert (os.path.basename(run.config_path), run.training.max_length) == ("think.yaml", 16384)


def test_a_data_set_revision_nothing_is_read_at_and_a_streamed_mixture_are_refused(
    cli, tmp_path, tiny_model_dir, capsys
):
    """--revision beside a local file or a mixture (each source read at main) was taken and recorded in the report
    ("revision": "v2") though nothing was read at it; training refuses such a dataset_revision."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    other = write_jsonl(tmp_path / "e.jsonl", _messages_rows()[:10])
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndatasets:\n  - path: {path}\n  - path: {other}\n")
    for argv, reads in (
        ([path, "--tokenizer", tiny_model_dir], f"{path!r} is local"),
        (["--config", str(recipe)], "the recipe reads a mixture (each source at main)"),
    ):
        assert cli.main([*argv, "--revision", "v2", "--json", str(tmp_path / "r.json")]) == 2
        assert error_line(capsys) == (
            "error: revision 'v2' (--revision, or the recipe's dataset_revision) names a commit of a Hub data set, and "
            f"{reads}: remove it"
        )
    assert not (tmp_path / "r.json").exists()
    # --streaming (for a data set larger than memory) beside a mixture was ignored: every source was read whole. It is
    # refused, naming the flag typed (the mixture's own check named the recipe's `streaming: true`, which it has not).
    assert cli.main(["--config", str(recipe), "--streaming"]) == 2
    assert error_line(capsys) == (
        "error: --streaming with a mixture: its sources are counted and sampled, which needs their rows: remove "
        "--streaming (each source is read whole, as training reads it)"
    )


@pytest.mark.parametrize("key", ["streaming", "dataset_streaming"])
def test_a_recipe_the_run_refuses_for_streaming_is_refused_by_the_analyzer_too(
    key, cli, tmp_path, tiny_model_dir, capsys
):
    """A recipe holding `streaming: true` (or TRL's `dataset_streaming: true`) with one data set was analysed and its
    max_length recommended (exit 0), where the run refuses that recipe before it starts. The analyzer's own
    --streaming (how it reads a data set larger than memory) is not the recipe's and still measures."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "streamed.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\n{key}: true\n")
    assert cli.main(["--config", str(recipe), "--json", str(tmp_path / "r.json")]) == 2
    assert error_line(capsys) == (
        f"error: {key} (in {recipe}): the step plan and the reference stage need every pair's length up front; "
        "remove it (datasets memory-maps a loaded data set, so it need not fit in RAM)"
    )
    assert not (tmp_path / "r.json").exists()
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\n")
    assert cli.main(["--config", str(recipe), "--streaming", "--json", str(tmp_path / "r.json")]) == 0


def test_a_recipe_with_test_split_size_is_refused_by_the_analyzer_as_by_the_run(cli, tmp_path, tiny_model_dir, capsys):
    """TRL's `test_split_size: 0.1` beside one data set was analysed and its max_length recommended (exit 0), where
    the run refuses that recipe before it starts: only a mixture's parse, which one data set never reached, read it."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "split.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {path}\ntest_split_size: 0.1\n")
    assert cli.main(["--config", str(recipe), "--json", str(tmp_path / "r.json")]) == 2
    assert error_line(capsys).startswith("error: test_split_size is not supported (TRL splits without a seed")
    assert not (tmp_path / "r.json").exists()


def test_a_folder_that_reads_a_file_twice_is_refused_by_the_analyzer_as_by_the_run(
    cli, tmp_path, tiny_model_dir, capsys
):
    """A data folder holding a file and a link to it: datasets reads both, so the analyzer measured every pair twice
    (768 of the demo's 384, exit 0: its percentiles, recommendation and cache of rows the run never trains), where the
    run refuses the folder before it starts (mixture.check, which the analyzer called for a mixture only)."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", _messages_rows())
    (folder / "b.jsonl").symlink_to("a.jsonl")
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--tokenizer", tiny_model_dir, "--dataset_name"]
    assert cli.main([*args, str(folder), "--json", str(tmp_path / "r.json")]) == 2
    assert error_line(capsys).startswith(f"error: dataset {folder} [train] reads {folder / 'a.jsonl'} twice")
    assert not (tmp_path / "r.json").exists()


def test_a_length_the_recipes_token_budget_cannot_hold_is_said_as_training_refuses_it(
    cli, tmp_path, tiny_model_dir, capsys
):
    """configs/smoke.yaml's max_tokens_per_microbatch 2048 holds pairs up to max_length 1,024. `--max_length 4096`, and
    a recommendation of 2,048, were reported as lengths to train at with no word, and the run refused each before it
    started (`max_tokens_per_microbatch=2048 must hold the longest possible pair`). Said after the report, in the run's
    words, with the budget to pass."""
    rows = _messages_rows()
    for row in rows:
        row["chosen"][-1]["content"] += " Tides rise and fall twice a day." * 60
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--tokenizer", tiny_model_dir, "--num-proc", "1"]
    assert cli.main([path, *smoke, "--max_length", "4096"]) == 0
    said = capsys.readouterr()
    assert "Recommended max_length: 2048" in said.out
    assert (
        "warning: training refuses --max_length 4,096 with the recipe's max_tokens_per_microbatch: "
        "max_tokens_per_microbatch=2048 must hold the longest possible pair, 2 x max_length (8192); a pair is never "
        "split: pass --max_tokens_per_microbatch 8192 (or more), or --max_length 1024 (or less)"
    ) in said.err
    assert (
        "warning: training refuses the recommended max_length 2,048 (and max_length: auto's choice) with the "
        "recipe's max_tokens_per_microbatch: max_tokens_per_microbatch=2048 must hold the longest possible pair, 2 x "
        "max_length (4096); a pair is never split: pass --max_tokens_per_microbatch 4096 (or more), or --max_length "
        "1024 (or less)"
    ) in said.err
    short = write_jsonl(tmp_path / "short.jsonl", _messages_rows())
    assert cli.main([short, *smoke, "--max_length", "1024"]) == 0
    assert "warning: training refuses" not in capsys.readouterr().err  # lengths the budget holds: nothing said


def test_a_length_that_leaves_nothing_to_learn_is_said_as_training_refuses_it(cli, tmp_path, tiny_model_dir, capsys):
    """Answers that share a long start, cut inside it at max_length 64: chosen and rejected are the same tokens, and
    train_dpo.py refuses the length before the model loads. The analyzer reported `24 of 24 pairs cut`, exit 0, no
    word of the refusal. Said after the report, in the run's words (cuts.check), with the length to pass."""
    steps = "First, we read the question carefully. Then we check each part of it in turn. " * 4
    pairs = [
        {
            "prompt": [{"role": "user", "content": f"Question {i}?"}],
            "chosen": [{"role": "assistant", "content": steps + "So the answer is yes."}],
            "rejected": [{"role": "assistant", "content": steps + "So the answer is no."}],
        }
        for i in range(24)
    ]
    path = write_jsonl(tmp_path / "d.jsonl", pairs)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--tokenizer", tiny_model_dir, "--num-proc", "1"]
    assert cli.main([path, *smoke, "--max_length", "64"]) == 0
    err = capsys.readouterr().err
    assert "Cut at max_length 64: 24 of 24 pairs cut" in err, err
    assert (
        "warning: training refuses --max_length 64: max_length 64 leaves 0 of 24 pairs (0.0%) anything to learn (the "
        "pairs measured): 0 dropped (the prompt alone fills max_length; the shortest prompt is"
    ) in err, err
    assert cli.main([path, *smoke]) == 0  # the recipe's 1024 keeps every difference: nothing said
    assert "training refuses" not in capsys.readouterr().err


def test_a_length_past_the_models_positions_is_said_as_training_refuses_it(cli, tmp_path, tiny_model_dir, capsys):
    """One pair of ~19,000 tokens, and --max_length 8192 past the built-in model's 4,096 positions: train_dpo.py
    refuses it before the model loads (a rotary model would train on positions it never learned). The analyzer said
    only that the token budget cannot hold 8,192, naming --max_tokens_per_microbatch 16384 to pass: followed, the run
    was refused again, on the positions. Said now too, in the run's words; nothing where no pair reaches that far."""
    rows = _messages_rows()
    rows[3]["chosen"][-1]["content"] = "The quick brown fox jumps. " * 1000
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--tokenizer", tiny_model_dir, "--num-proc", "1"]
    assert cli.main([write_jsonl(tmp_path / "long.jsonl", rows), *smoke, "--max_length", "8192"]) == 0
    err = capsys.readouterr().err
    assert "warning: training refuses --max_length 8,192: max_length 8,192 (the data's longest sequence is " in err
    assert "reaches past the 4,096 positions" in err, err
    assert cli.main([write_jsonl(tmp_path / "short.jsonl", _messages_rows()), *smoke, "--max_length", "8192"]) == 0
    assert "positions" not in capsys.readouterr().err  # every pair measured, none that long: the run takes it


def test_the_held_out_pairs_a_recipe_evaluates_on_are_counted_as_the_run_counts_them(
    cli, tmp_path, tiny_model_dir, capsys
):
    """A recipe that evaluates (`eval_strategy: steps`) on a test split with long prompts: the run drops the held-out
    pairs whose prompt alone fills max_length (`Held-out pairs at max_length 128: ..., 4 dropped`, or refuses the
    length where too few are left), and the analyzer measured the training split alone and said nothing of them. It
    counts them now, read and measured by the run's code, in the run's line."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", _messages_rows()[:20])
    held = _messages_rows()[20:28]
    for row in held[::2]:
        long_user = {"role": "user", "content": "Tell me about the sea. " * 40}
        row["chosen"], row["rejected"] = [long_user, row["chosen"][-1]], [long_user, row["rejected"][-1]]
    write_jsonl(folder / "test.jsonl", held)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {folder}\nmax_length: 128\neval_strategy: steps\n"
        "eval_steps: 2\nbf16: false\nreport_to: [none]\n"
    )
    assert cli.main(["--config", str(recipe), "--num-proc", "1"]) == 0
    err = capsys.readouterr().err
    line = "Held-out pairs at max_length 128: 1 of 8 pairs cut (keep_start: their end), 4 dropped (prompt alone fills"
    assert line in err, err
    recipe.write_text(recipe.read_text().replace("eval_strategy: steps", "eval_strategy: 'no'"))
    assert cli.main(["--config", str(recipe), "--num-proc", "1"]) == 0
    assert "Held-out" not in capsys.readouterr().err  # a recipe that does not evaluate reads no held-out pairs


def test_held_out_pairs_named_on_the_command_line_are_counted_and_refused_without_eval_strategy(
    cli, tmp_path, tiny_model_dir, capsys
):
    """The run's held-out mixture (--dataset_mixer_eval_list, --eval_datasets) could not be given to the analyzer, so
    pairs named on train_dpo.py's command line went unmeasured; and a recipe's held-out pairs without eval_strategy
    (which the run refuses) were analysed silently, none of them measured. Taken in the run's words, counted as the run
    counts them, and refused as the run refuses them, before the analysis."""
    write_jsonl(tmp_path / "train.jsonl", _messages_rows()[:20])
    write_jsonl(tmp_path / "held.jsonl", _messages_rows()[20:28])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {tmp_path / 'train.jsonl'}\nmax_length: 128\n"
        "bf16: false\nreport_to: [none]\n"
    )
    held = ["--dataset_mixer_eval_list", str(tmp_path / "held.jsonl"), "1.0"]
    assert cli.main(["--config", str(recipe), "--num-proc", "1", *held]) == 2
    assert "dataset_mixer_eval_list is only used for evaluation, and eval_strategy is no" in capsys.readouterr().err
    evaluates = ["--eval_strategy", "steps", "--eval_steps", "2"]
    assert cli.main(["--config", str(recipe), "--num-proc", "1", *held, *evaluates]) == 0
    assert "Held-out pairs at max_length 128: " in capsys.readouterr().err
    entry = json.dumps({"path": str(tmp_path / "held.jsonl"), "split": "train"})
    assert cli.main(["--config", str(recipe), "--num-proc", "1", "--eval_datasets", entry, *evaluates]) == 0
    assert "Held-out pairs at max_length 128: " in capsys.readouterr().err


def test_a_recipes_model_revision_is_the_tokenizer_measured_with(cli, tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The recipe's model_revision is the tokenizer training loads, and the one the analyzer measures with. It loaded
    main's: offline (a cache prefetch.py filled at the revision holds no main) it was refused, naming prefetch.py, which
    had already run; online it measured main's tokenizer, here a chat template with a system line, while training read
    the revision's."""
    import shutil

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # HF_HUB_OFFLINE=1 here
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for ref, commit in (("v1", "a" * 40), ("main", "b" * 40)):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)
    template = repo / "snapshots" / ("b" * 40) / "chat_template.jinja"
    template.write_text("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + template.read_text())
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: org/tiny\nmodel_revision: v1\ndataset_name: {path}\nmax_length: 1024\n")
    out = tmp_path / "r.json"
    assert cli.main(["--config", str(recipe), "--json", str(out), "--num-proc", "1"]) == 0, capsys.readouterr().err
    v1 = lengths.measure(data.load_preference_dataset(path, "train"), lengths.load_tokenizer(tiny_model_dir))
    assert json.loads(out.read_text())["total"] == lengths.percentiles(v1.total)
    assert "with the tokenizer of org/tiny at revision v1" in capsys.readouterr().err


def test_sample_is_seeded_and_plot_is_a_png(cli, tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    reports = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        argv = [path, "--tokenizer", tiny_model_dir, "--sample", "10", "--seed", "7", "--json", str(out)]
        assert cli.main([*argv, "--plot", str(tmp_path / f"{name}.png"), "--num-proc", "1"]) == 0
        reports.append(json.loads(out.read_text()))
    assert reports[0]["rows"] == 10 and reports[0]["total"] == reports[1]["total"]
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_streamed_sample_is_drawn_from_the_whole_stream(cli, tmp_path):
    """--sample with --streaming drew from a shuffle buffer of 10,000 rows: from the stream's first ~10,000 rows only.
    A data set sorted by source or length (short pairs first) was reported, and its max_length recommended, from its
    first part alone, as "a seeded sample". Drawn now from every row, as in memory."""
    pair = {"chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yes."}]}
    pair["rejected"] = [pair["chosen"][0], {"role": "assistant", "content": "No."}]
    path = write_jsonl(tmp_path / "d.jsonl", [pair] * 14_000)
    stream = data.load_preference_dataset(path, streaming=True)
    picked, indices = cli.sample(stream, 200, 42)
    assert len(picked) == 200 and list(indices) == sorted(set(indices))
    assert 0.1 < np.mean(np.asarray(indices) >= 10_500) < 0.4  # ~1/4 of the rows; all below 10,200 before
    assert cli.sample(stream, 200, 42)[1] == indices  # seeded


@pytest.mark.parametrize("size", [2000, len(_messages_rows())], ids=["more rows", "as many rows"])
@pytest.mark.parametrize("streaming", [False, True], ids=["in memory", "streaming"])
def test_a_sample_of_at_least_every_row_is_the_complete_analysis(
    streaming, size, cli, tokenizer, tmp_path, tiny_model_dir, capsys
):
    """--sample 2000 (the documented quick look) of a data set of 41 rows analyses every row: the report said "a seeded
    sample of 41 rows" and its JSON {"rows": 2000}, a sample the analysis was not, and it was not cached for
    `max_length: auto`, which then analysed the same rows again. Streamed too (its rows are not counted before)."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    out = tmp_path / "r.json"
    argv = [path, "--tokenizer", tiny_model_dir, "--sample", str(size), "--json", str(out), "--num-proc", "1"]
    assert cli.main([*argv, *(["--streaming"] if streaming else [])]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == len(_messages_rows()) and report["sample"] is None
    assert "seeded sample" not in capsys.readouterr().out
    assert cached_choice(lengths.dataset_identity(path), tokenizer)["cached"] is True


@pytest.mark.parametrize("streaming", [False, True], ids=["in memory", "streaming"])
def test_sample_keeps_the_original_row_indices(streaming, cli, tmp_path, tiny_model_dir):
    rows = [GOOD if i % 2 else BAD_ROWS["identical"][0] for i in range(20)]  # every even row is invalid
    out = tmp_path / "r.json"
    argv = [write_jsonl(tmp_path / "d.jsonl", rows), "--tokenizer", tiny_model_dir, "--sample", "15", "--skip-invalid"]
    assert cli.main([*argv, "--json", str(out), "--num-proc", "1", *(["--streaming"] if streaming else [])]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] + report["invalid"]["count"] == 15
    assert report["invalid"]["count"] > 0 and all(r["index"] % 2 == 0 for r in report["invalid"]["rows"])


# --- bad input -------------------------------------------------------------------------------------------------------


USER = {"role": "user", "content": "Is it?"}
GOOD = {
    "chosen": [USER, {"role": "assistant", "content": "Yes, it is."}],
    "rejected": [USER, {"role": "assistant", "content": "No."}],
}
BAD_ROWS = {
    "no role": (
        {"chosen": [{"content": "Is it?"}, {"role": "assistant", "content": "Yes."}], "rejected": GOOD["rejected"]},
        "chosen",
        "message 0 has no 'role'",
    ),
    "no content": (
        {"chosen": GOOD["chosen"], "rejected": [GOOD["rejected"][0], {"role": "assistant"}]},
        "rejected",
        "message 1 has no 'content'",
    ),
    "non-string content": (
        {"chosen": [GOOD["chosen"][0], {"role": "assistant", "content": 42}], "rejected": GOOD["rejected"]},
        "chosen",
        "message 1 has a non-string 'content' (int)",
    ),
    "empty completion": (
        {"chosen": [GOOD["chosen"][0], {"role": "assistant", "content": "  "}], "rejected": GOOD["rejected"]},
        "chosen",
        "empty completion",
    ),
    "no completion message": (
        {"chosen": GOOD["chosen"][:1], "rejected": GOOD["rejected"]},
        "chosen",
        "empty completion",
    ),
    "identical": ({"chosen": GOOD["chosen"], "rejected": GOOD["chosen"]}, "chosen", "identical to `rejected`"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_is_named_by_index_and_column(case, cli, tmp_path, tiny_model_dir, capsys):
    row, column, problem = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, row, GOOD])
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert error_line(capsys).startswith(f"error: row 2, column '{column}': {problem}")


@pytest.mark.parametrize(
    "first, expected",
    [
        (
            {"chosen": "Blue.", "rejected": 7},
            "an int where the data set has plain text (read from its first row, this one)",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
                "rejected": "x",
            },
            "a str where the data set has message lists (read from its first row, this one): write it as a list of ",
        ),
        (  # the kind is read from the answers: the first row's prompt, a number, is not "text, as the first row is"
            {"prompt": 7, "chosen": "Blue.", "rejected": "Green."},
            "an int where the data set has plain text (its answers are text): write the prompt as text",
        ),
    ],
)
def test_the_first_rows_other_type_is_not_said_to_differ_from_the_first_row(
    first, expected, cli, tmp_path, tiny_model_dir, capsys
):
    """The data set's kind is read from its first row: an answer of another type in that row itself was refused as
    "an int where the data set has plain text (its first row is text): write it as text, as the first row is"."""
    second = {"chosen": first["chosen"], "rejected": "Green."}  # a good row of the first's kind
    if "prompt" in first:
        second = {"prompt": "Sky?", "chosen": "Blue.", "rejected": "Grey."}
    if isinstance(first["chosen"], list):
        second["rejected"] = [first["chosen"][0], {"role": "assistant", "content": "Green."}]
    path = write_jsonl(tmp_path / "bad.jsonl", [first, second])
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    line = error_line(capsys)
    column = "prompt" if "prompt" in first else "rejected"
    assert line.startswith(f"error: row 0, column '{column}': {expected}") and "as the first row is" not in line, line


def test_text_row_with_empty_completion(cli, tmp_path, tiny_model_dir, capsys):
    rows = [
        {"prompt": "Sky?", "chosen": " Blue.", "rejected": " Green."},
        {"prompt": "Sky?", "chosen": "", "rejected": "x"},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert error_line(capsys).startswith("error: row 1, column 'chosen': empty completion")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: str(tmp / "missing.jsonl"), "does not exist"),
        (lambda tmp: "no-such-org/no-such-dataset", "could not load data set 'no-such-org/no-such-dataset'"),
        (lambda tmp: write_jsonl(tmp / "cols.jsonl", [{"chosen": "a", "other": "b"}]), "no rejected column"),
    ],
    ids=["missing file", "unknown hub dataset", "missing column"],
)
def test_bad_dataset_is_one_line_error(make, message, cli, tmp_path, tiny_model_dir, capsys):
    assert cli.main([make(tmp_path), "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert message in error_line(capsys)


def test_unknown_split(cli, tmp_path, tiny_model_dir, capsys):
    import datasets

    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD])}).save_to_disk(str(folder))
    assert cli.main([str(folder), "--split", "test", "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    # the analyzer's own option, not the run's --dataset_train_split
    assert error_line(capsys).endswith(f"dataset {str(folder)!r} has no split 'test': set --split to one of ['train']")


def test_skip_invalid_counts_and_lists_the_rows(cli, tmp_path, tiny_model_dir, capsys):
    rows = [GOOD] + [BAD_ROWS[case][0] for case in sorted(BAD_ROWS)] + [GOOD]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "r.json"
    argv = [path, "--tokenizer", tiny_model_dir, "--skip-invalid", "--json", str(out), "--num-proc", "1"]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 2 and report["rows_seen"] == len(rows)
    assert report["invalid"]["count"] == len(BAD_ROWS)
    listed = {(r["index"], r["column"]) for r in report["invalid"]["rows"]}
    assert listed == {(i + 1, BAD_ROWS[case][1]) for i, case in enumerate(sorted(BAD_ROWS))}
    printed = capsys.readouterr()
    assert f"Invalid rows, left out of every number above: {len(BAD_ROWS)}" in printed.out
    # Cached for `max_length: auto` with skip_invalid, which trains the rows kept: not cached, its run measured every
    # pair again (minutes). The lengths are the kept pairs', numbered as the run's data set holds them (0, 1), as the
    # run's own measurement caches them, not by the file's rows (0 and the last).
    assert "cached for `max_length: auto` in training" in printed.err
    (npz,) = (Path(os.environ["DPOTRAIN_CACHE"]) / "lengths").glob("*.npz")
    with np.load(npz) as cached:
        assert cached["index"].tolist() == [0, 1] and len(cached["prompt"]) == 2


@pytest.mark.parametrize("skip", [[], ["--skip-invalid"]], ids=["stops", "skip-invalid"])
def test_every_row_invalid_is_refused_as_the_run_refuses_it(skip, cli, tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Every row bad (each pair's sides the same): the run says the one check they all fail and offers no
    --skip_invalid; the analyzer named row 0 and offered --skip-invalid, which then said only "no valid rows to
    analyse (3 invalid)"."""
    from test_refusals import refused

    path = write_jsonl(tmp_path / "same.jsonl", [{"chosen": GOOD["chosen"], "rejected": GOOD["chosen"]}] * 3)
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", path, *(["--skip_invalid", "true"] if skip else []))
    assert line.startswith("error: every row of the train split (3 of 3) fails one check: chosen: identical"), line
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1", *skip]) == 2
    assert error_line(capsys) == line


@pytest.mark.parametrize(
    "template, fits",
    [
        ("olmo_thinker", "train them with the recipe whose template does (configs/instruct.yaml for answers without"),
        ("deepseek_r1_distill", "its generation prompt is '<｜Assistant｜><think>\\n', so each answer must begin with"),
    ],
)
def test_every_answer_off_the_generation_prompt_skipped_names_what_fits_the_template(
    template, fits, cli, tmp_path, tiny_model_dir, capsys
):
    """--skip-invalid dropping every row, each answer without the thinking block the generation prompt opens: the line
    names what fits the template it was measured with, as the run's does (chat_template.misfit). The analyzer gave it
    no tokenizer there, so OLMo's advice (configs/instruct.yaml) was said under any template."""
    import trl

    folder = (
        ROOT / "configs" / "templates" if template.startswith("olmo") else Path(trl.__file__).parent / "chat_templates"
    )
    pair = {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "It is 4."}],
        "rejected": [{"role": "assistant", "content": "Five."}],
    }
    path = write_jsonl(tmp_path / "plain.jsonl", [pair] * 3)
    argv = [path, "--tokenizer", tiny_model_dir, "--chat_template_path", str(folder / f"{template}.jinja")]
    assert cli.main([*argv, "--num-proc", "1", "--skip-invalid"]) == 2
    line = error_line(capsys)
    assert "fails one check: chosen: the answer does not begin with the chat template's generation prompt" in line, line
    assert fits in line, line


def test_a_streamed_json_file_whose_answers_mix_types_is_refused_not_read_otherwise(
    cli, tmp_path, tiny_model_dir, capsys
):
    """One answer written as text parts makes datasets store the answers as JSON, which a stream reads back as JSON:
    the answer "42" came back the number 42, and `--streaming` refused that valid row as a number ("fix or remove the
    row"), or with --skip-invalid left it out of every number, where training and the analysis in memory read it as
    written (data.exact_mixed_fields). Refused in one line naming the flag."""
    rows = _messages_rows()
    rows[1]["chosen"][-1]["content"] = [{"type": "text", "text": rows[1]["chosen"][-1]["content"]}]
    rows[2]["chosen"][-1]["content"] = "42"
    argv = [write_jsonl(tmp_path / "mixed.jsonl", rows), "--tokenizer", tiny_model_dir, "--num-proc", "1"]
    assert cli.main([*argv, "--json", str(tmp_path / "r.json")]) == 0  # in memory: every row, as written
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == len(rows)
    for skip in ([], ["--skip-invalid"]):
        assert cli.main([*argv, "--streaming", *skip]) == 2
        line = error_line(capsys)
        assert line.startswith("error: --streaming: ") and "analyse it without --streaming" in line, line


def test_a_streamed_data_set_whose_first_row_is_bad_names_the_row(cli, tmp_path, tiny_model_dir, capsys):
    """--streaming with a bad first row: the check of whether every row is bad took len() of the stream, and the
    analyzer ended in `TypeError: object of type 'IterableDataset' has no len()` (exit 1, a traceback) instead of the
    row's line that the same file read whole gets."""
    path = write_jsonl(tmp_path / "first.jsonl", [{"chosen": GOOD["chosen"], "rejected": GOOD["chosen"]}, GOOD])
    argv = [path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]
    assert cli.main(argv) == 2
    whole = error_line(capsys)
    assert whole.startswith("error: row 0, column 'chosen': identical to `rejected`"), whole
    assert cli.main([*argv, "--streaming"]) == 2
    assert error_line(capsys) == whole


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset_name", "mixture"])
def test_the_recipes_skip_invalid_skips_the_rows_the_run_skips(mixed, cli, tmp_path, tiny_model_dir, capsys):
    """A recipe with `skip_invalid: true` (the run drops and counts its bad rows): the analyzer stopped at the first
    (`error: row 1, column ...`, exit 2), reading only its own --skip-invalid; the flag still decides over it."""
    rows = [GOOD] + [BAD_ROWS[case][0] for case in sorted(BAD_ROWS)] + [GOOD]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    data_line = f"datasets: [{{path: {path}}}]" if mixed else f"dataset_name: {path}"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\n{data_line}\nskip_invalid: true\nbf16: false\n")
    out = tmp_path / "r.json"
    assert cli.main(["--config", str(recipe), "--json", str(out), "--num-proc", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 2 and report["rows_seen"] == (2 if mixed else len(rows))  # a mixture drops them first
    assert cli.main(["--config", str(recipe), "--skip-invalid", "false", "--num-proc", "1"]) == 2
    assert error_line(capsys).startswith("error: row 1, column 'chosen'")


# --- max_length: auto ------------------------------------------------------------------------------------------------


def cached_choice(dataset_id, tokenizer, coverage=lengths.DEFAULT_COVERAGE, cache=None):
    """`max_length: auto` from the cache, as the lengths stage reads it (None: no cached analysis)."""
    found = lengths.cached_measure(dataset_id, tokenizer, cache)
    return None if found is None else lengths.resolution_of(found, coverage)


def test_auto_max_length_caches_per_dataset_tokenizer_and_template(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    dataset = data.load_preference_dataset(path)
    dataset_id = lengths.dataset_identity(path)
    cache = tmp_path / "c"
    assert cached_choice(dataset_id, tokenizer, 0.9, cache) is None

    _, first = lengths.analyse(dataset, tokenizer, 0.9, dataset_id, cache, progress=False)
    total = lengths.measure(dataset, tokenizer).total
    assert first["cached"] is False and first["max_length"] == lengths.recommend(total, 0.9)
    assert first["coverage"] == pytest.approx(np.mean(total <= first["max_length"])) and first["rows"] == len(dataset)
    assert json.loads(open(first["report"]).read())["recommended_max_length"] == first["max_length"]

    again = cached_choice(dataset_id, tokenizer, 0.9, cache)
    assert again["cached"] is True and again["max_length"] == first["max_length"]
    assert again == first | {"cached": True}
    other_target = cached_choice(dataset_id, tokenizer, 0.5, cache)
    assert other_target["target_coverage"] == 0.5 and other_target["max_length"] == lengths.recommend(total, 0.5)

    other_template = lengths.load_tokenizer(tokenizer.name_or_path)
    other_template.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert cached_choice(dataset_id, other_template, 0.9, cache) is None

    write_jsonl(tmp_path / "d.jsonl", _messages_rows()[:-1])  # the file changed: a new identity
    assert lengths.dataset_identity(path) != dataset_id


def test_another_file_copied_over_the_data_with_its_size_and_time_is_not_read_from_the_cache(tmp_path):
    """`cp -p other.jsonl d.jsonl` of another file of the same size, given the same time: the cache was keyed by size
    and modification time alone, so `max_length: auto` and the lengths stage read the old file's lengths as the new
    one's. Its change time (which no copy can set) keys the cache too: a copy is measured again."""
    from dpotrain.data import mixture
    from dpotrain.recipe.config import parse_args

    rows = _messages_rows()
    (tmp_path / "pairs").mkdir()
    path = write_jsonl(tmp_path / "pairs" / "d.jsonl", rows)
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]  # other pairs, as many bytes
    other = write_jsonl(tmp_path / "other.jsonl", swapped)
    builder = {"path": "json", "data_dir": str(tmp_path / "pairs")}  # a mixture's source read by a builder
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--datasets", json.dumps(builder)])
    dataset_id, mixed, then = lengths.dataset_identity(path), mixture.dataset_id(recipe, local_only=True), os.stat(path)
    os.utime(other, ns=(then.st_atime_ns, then.st_mtime_ns))
    # The copy's change time past the data's: the kernel stamps it from a coarse clock (a tick of 1-10 ms, whole
    # seconds on some file systems), so a fixed sleep could leave both in one stamp. Touched until its stamp is later.
    clock = tmp_path / "clock"
    clock.touch()
    while os.stat(clock).st_ctime_ns <= then.st_ctime_ns:
        time.sleep(0.01)
        clock.touch()
    shutil.copy2(other, path)  # cp -p
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns) == (then.st_size, then.st_mtime_ns)
    assert [json.loads(line) for line in open(path)] == swapped
    assert lengths.dataset_identity(path) != dataset_id
    assert mixture.dataset_id(recipe, local_only=True) != mixed


def test_a_tokenizer_that_splits_special_tokens_is_not_read_from_another_settings_cache(tiny_model_dir, tmp_path):
    """`split_special_tokens: true` in tokenizer_config.json: the answers' "<|im_start|>" are then tokenized as text,
    more tokens each, by the trainer too. The cache key (the backend's JSON, EOS, template) left the setting out, so the
    lengths measured before it was set were read as this tokenizer's: a stale analysis taken for current."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    rows = _messages_rows()
    for row in rows:
        row["chosen"][-1]["content"] += " <|im_start|> <|pad|>."
    dataset = data.load_preference_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
    before = lengths.load_tokenizer(str(model))
    lengths.save_cache(lengths.measure(dataset, before), {}, "local:d", before)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    after = lengths.load_tokenizer(str(model))
    measured = lengths.measure(dataset, after)
    assert (measured.chosen > lengths.measure(dataset, before).chosen).all()  # the setting changes the lengths
    assert lengths.cached_measure("local:d", after) is None


@pytest.mark.parametrize("edited", ["lengths", "data", "shapes"])
def test_a_length_analysis_is_measured_again_where_the_code_that_counts_changed(
    edited, tokenizer, tmp_path, monkeypatch
):
    """The cached analyses (and their map's cache in datasets) were keyed by a version bumped by hand: an edit of the
    code that counts without a bump read the old code's lengths back as current. They are keyed by a digest of that
    code's source (this module, the files' loading, the rows' reading). Here the new code counts one more prompt
    token."""
    from dpotrain.data import rows, shapes

    dataset = data.load_preference_dataset(write_jsonl(tmp_path / "d.jsonl", _messages_rows()))
    before = lengths.measure(dataset, tokenizer)
    lengths.save_cache(before, {}, "local:d", tokenizer, tmp_path / "c")
    assert lengths.cached_measure("local:d", tokenizer, tmp_path / "c") is not None
    module = {"lengths": lengths, "data": data, "shapes": shapes}[edited]
    upgraded = tmp_path / f"{edited}.py"
    upgraded.write_text(Path(module.__file__).read_text() + "\n# upgraded\n")
    monkeypatch.setattr(module, "__file__", str(upgraded))
    split = lengths._split_lengths
    monkeypatch.setattr(lengths, "_split_lengths", lambda *ids: (split(*ids)[0] + 1, *split(*ids)[1:]))
    rows.reading_code.cache_clear(), lengths.analysis_code.cache_clear()
    try:
        assert lengths.cached_measure("local:d", tokenizer, tmp_path / "c") is None
        assert (lengths.measure(dataset, tokenizer).prompt == before.prompt + 1).all()
    finally:
        rows.reading_code.cache_clear(), lengths.analysis_code.cache_clear()


def test_a_length_cache_cut_anywhere_is_refused_with_what_happens_next_never_read(tokenizer, tmp_path, capsys):
    """A cache file cut short (a node lost mid-write where renames are not kept whole): at every length it is refused
    with one warning saying it is measured again, and removed; never read as fewer or other lengths."""
    m = lengths.Measured(*(np.arange(40) for _ in range(4)), [], True, shared=np.arange(40))
    report = lengths.save_cache(m, {}, "local:d", tokenizer, tmp_path / "c")
    whole = report.with_suffix(".npz").read_bytes()
    for cut in range(0, len(whole), 7):
        report.with_suffix(".npz").write_bytes(whole[:cut])
        assert lengths.cached_measure("local:d", tokenizer, tmp_path / "c") is None, cut
        assert not report.with_suffix(".npz").exists()
        assert "is damaged (" in capsys.readouterr().err
    report.with_suffix(".npz").write_bytes(whole)
    assert lengths.cached_measure("local:d", tokenizer, tmp_path / "c")[0].rows == 40


def test_a_length_analysis_that_cannot_be_cached_is_a_warning_and_the_run_has_its_answer(tokenizer, tmp_path, capsys):
    """`max_length: auto` analysed at start with a cache that cannot be written (a full disk or quota): the run ended in
    the writer's traceback. It warns and goes on with the answer it measured."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    dataset = data.load_preference_dataset(path)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    _, auto = lengths.analyse(dataset, tokenizer, 0.9, lengths.dataset_identity(path), blocked / "c", progress=False)
    assert auto["max_length"] == lengths.recommend(lengths.measure(dataset, tokenizer).total, 0.9)
    assert auto["report"] is None and auto["cached"] is False
    assert "warning: the length analysis was not cached (" in capsys.readouterr().err


def test_hub_identity_offline_comes_from_the_local_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / "datasets--org--think" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0123abcd\n")
    assert lengths.dataset_identity("org/think") == "hub:org/think:default:train@0123abcd"  # HF_HUB_OFFLINE=1 here
    assert lengths.dataset_identity("org/think", "test", "sub", "v2") == "hub:org/think:sub:test@v2"
    # `all` drops pairs `final` keeps: its own key, and `final`'s as it was (the caches written for it stay found)
    assert lengths.dataset_identity("org/think", assistant_turns="final") == "hub:org/think:default:train@0123abcd"
    assert (
        lengths.dataset_identity("org/think", assistant_turns="all") == "hub:org/think:default:train@0123abcd:turns-all"
    )


def test_a_cache_that_cannot_be_written_leaves_the_analysis_done(cli, tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The cache is an extra: a full disk or quota where it lives (here DPOTRAIN_CACHE, a file) ended the analyzer in
    a traceback, exit 1, after its report was printed and written."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "not-a-folder"))
    out = tmp_path / "r.json"
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--json", str(out), "--num-proc", "1"]) == 0
    assert json.loads(out.read_text())["recommended_max_length"] == 512
    said = capsys.readouterr().err.splitlines()  # the warning, then the caches' line (of the copy only)
    assert said[-2].startswith("warning: not cached for `max_length: auto` (NotADirectoryError: ")
    assert said[-1].startswith("Caches: ") and "DPOTRAIN_CACHE" not in said[-1]


def test_cli_run_is_reused_by_a_dry_run(cli, tokenizer, tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    assert cached_choice(lengths.dataset_identity(path), tokenizer) is None
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 0
    found = cached_choice(lengths.dataset_identity(path), tokenizer)
    assert (
        found["cached"] is True
        and found["max_length"] == 512
        and found["report"].startswith(os.environ["DPOTRAIN_CACHE"])
    )


def test_data_changed_during_the_analysis_is_not_cached_as_the_new_datas(
    cli, tokenizer, tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """Rows appended while the analyzer tokenized (a generation job still writing the file, minutes into an analysis
    of 150k rows): it keyed the cache by the file as it was at the end, so `max_length: auto` on the longer file reused
    the lengths of the rows before, as if measured on these."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    measure = cli.lengths.measure

    def measure_while_rows_are_added(*args, **kwargs):
        with open(path, "a") as f:  # another process writing the file during the analysis
            f.write(json.dumps(GOOD) + "\n")
        return measure(*args, **kwargs)

    monkeypatch.setattr(cli.lengths, "measure", measure_while_rows_are_added)
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 0
    assert cached_choice(lengths.dataset_identity(path), tokenizer) is None
    assert "changed during the analysis" in capsys.readouterr().err
    monkeypatch.setattr(cli.lengths, "measure", measure)
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 0  # left alone: cached as it is
    assert cached_choice(lengths.dataset_identity(path), tokenizer)["rows"] == len(_messages_rows()) + 1


def test_the_analysis_is_found_by_its_model_folder_however_the_folder_is_named(
    cli, tmp_path, tiny_model_dir, monkeypatch
):
    """`analyze_dataset.py --tokenizer sft/` (a shell's completion), then a run with `max_length: auto` and
    `model_name_or_path: sft`, or the folder made absolute (a Slurm job does so with a relative command-line path) or
    reached through a link: the cache was keyed by the tokenizer's name as typed, so the run measured every pair again
    and its dry run did not show the analysis. The reference cache's key names the model the same way."""
    from dpotrain.data import model_identity

    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    (tmp_path / "sft").symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    assert cli.main([path, "--tokenizer", "sft/", "--num-proc", "1"]) == 0
    for name in ("sft", "./sft", str(tmp_path / "sft"), tiny_model_dir, f"{tiny_model_dir}/"):
        found = cached_choice(lengths.dataset_identity(path), lengths.load_tokenizer(name))
        assert found is not None and found["cached"] is True, name
        assert model_identity.cache_name(name) == os.path.realpath(tiny_model_dir), name
    assert model_identity.cache_name("org/model") == "org/model"  # a Hub name as written


def test_the_models_config_is_read_once_for_the_position_cap_and_the_memory_line(
    cli, tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """The analyzer read the model's config twice, asking the Hub each time where it may: for the position cap, then
    local-only for the memory plan. Once now, both from it; a folder without a config (a tokenizer's alone) caps
    nothing and its memory line says why, as before (HF_HUB_OFFLINE=1 here: a Hub model's config not cached refuses
    its tokenizer first)."""
    from transformers import AutoConfig

    model, tokenizer_only = tmp_path / "model", tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text()) | {"max_position_embeddings": 256}
    (model / "config.json").write_text(json.dumps(config))
    shutil.copytree(model, tokenizer_only)
    (tokenizer_only / "config.json").unlink()
    read, reads = AutoConfig.from_pretrained.__func__, []

    def reading(cls, *args, **kwargs):  # the real read, its caller noted (transformers' AutoTokenizer reads it too)
        reads.append(Path(traceback.extract_stack(limit=2)[0].filename))
        return read(cls, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(reading))
    data = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    recipe = tmp_path / "r.yaml"
    for folder, capped, memory in (
        (model, {"max_position_embeddings": 256, "uncapped": 512}, "max_length 256 fits"),
        (tokenizer_only, None, f"not planned (the config of {str(tokenizer_only)!r} is not readable on this machine"),
    ):
        recipe.write_text(
            f"model_name_or_path: {folder}\ndataset_name: {data}\nbf16: true\ngpu_memory_gib: 80\n"
            f"accelerate_config: {ROOT / 'accelerate_config.yaml'}\nauto_coverage: 1.0\n"
        )
        reads.clear()
        assert cli.main(["--config", str(recipe), "--json", str(tmp_path / "r.json"), "--num-proc", "1"]) == 0
        assert json.loads((tmp_path / "r.json").read_text())["recommendation"]["capped"] == capped
        assert memory in "".join(capsys.readouterr())  # a line not planned goes to stderr
        ours = [f.relative_to(ROOT) for f in reads if {ROOT / "dpotrain", ROOT / "scripts"} & set(f.parents)]
        assert ours == [Path("dpotrain/plan/memory.py")]


# --- the command line, end to end ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_end_to_end(tmp_path, tiny_model_dir):
    good = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    out = tmp_path / "r.json"
    env = {**os.environ, "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    argv = [python(), str(SCRIPT), good, "--tokenizer", tiny_model_dir, "--json", str(out), "--num-proc", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Sequence Length Analysis" in done.stdout and "Recommended max_length: 512" in done.stdout
    assert json.loads(out.read_text())["rows"] == len(_messages_rows())

    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, BAD_ROWS["no role"][0]])
    done = subprocess.run([python(), str(SCRIPT), bad, "--tokenizer", tiny_model_dir], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: row 1, column 'chosen'")


def test_a_report_path_after_an_equals_sign_is_the_home_folders(cli, tmp_path, tiny_model_dir, monkeypatch):
    """`--json=~/r.json` (a shell expands no `~` after `=`): refused as "folder '<here>/~' does not exist; create it",
    advice that makes a folder named `~` (which `rm -rf ~` then takes for the home folder). The preflight's alike."""
    import importlib.util

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--json=~/r.json", "--num-proc", "1"]) == 0
    assert json.loads((home / "r.json").read_text())["rows"] == len(_messages_rows()) and not (tmp_path / "~").exists()
    spec = importlib.util.spec_from_file_location("preflight_script", ROOT / "scripts" / "preflight.py")
    preflight = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preflight)
    own, _ = preflight.parse_own(["--json=~/p.json", "--plot=~/p.png"])
    assert (own.json, own.plot) == (str(home / "p.json"), str(home / "p.png"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--json", "/nonexistent/dir/x.json"], "--json '/nonexistent/dir/x.json': folder '/nonexistent/dir' does not"),
        (["--plot", "x.txt"], "--plot 'x.txt': the histogram is an image"),
        (["--batch-size", "-1"], "--batch-size must be >= 1 (got -1)"),
        (["--batch-size", "0"], "--batch-size must be >= 1 (got 0)"),
        (["--sample", "0"], "--sample must be >= 1 (got 0)"),
        (["--num-proc", "0"], "--num-proc must be >= 1 (got 0)"),
        (["--candidates", "-5", "0"], "--candidates are max_length values and must be >= 1 (got -5)"),
        (["--max_length", "0"], "max_length must be >= 1 (got 0), or `auto`"),  # the run's refusal, word for word
        (["--max_length", "-5"], "max_length must be >= 1 (got -5), or `auto`"),
        # a typo's extra digits: numpy's counts failed past 2**63 in a traceback, once every pair had been tokenized
        (["--max_length", "163840000000000000000"], "max_length 163840000000000000000 is longer than any model takes"),
        (["--candidates", "8192", "99999999999999999999"], "--candidates 99999999999999999999 is longer than any"),
        # A folder: the report's rename into place failed there after the analysis, in a traceback.
        (["--json", "/tmp"], "--json '/tmp' is a folder: give the path of the file to write"),
        # A device: the report was renamed over it, and as root /dev/null (or /dev/stdout) became a regular file
        (["--json", "/dev/null"], "--json '/dev/null' is a device, pipe or terminal, not a file"),
        # `-` read as stdout, as other tools do: a file named '-' was written in the folder instead, found by no one
        (["--json", "-"], "--json takes a file name, and '-' would write a file named '-'"),
        # Named as typed (either spelling) with what it is: it said `--coverage` of `--auto_coverage 1.5`, no fix
        (["--auto_coverage", "1.5"], "--coverage (--auto_coverage) must be in (0, 1] (got 1.5): the share of pairs"),
        (["--seed", "-1"], "--seed -1 is out of range"),  # numpy's seeds: the padding figures' shuffle failed after
        # the plot was written over the JSON report, after the analysis
        (["--json", "r.png", "--plot", "./r.png"], "--json and --plot name the same file './r.png': give each its own"),
    ],
)
def test_values_and_outputs_checked_before_the_analysis(args, message, cli, tmp_path, capsys):
    # A tokenizer that does not exist: had the analysis started, the error would be about it instead.
    data = str(ROOT / "data" / "smoke_prefs.jsonl")
    assert cli.main([data, "--tokenizer", str(tmp_path / "no-tokenizer"), *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert "Traceback" not in out


def test_a_report_is_never_written_over_a_runs_own_file(cli, tmp_path, capsys):
    """`--json outputs/run/run_complete.json` (the analyzer's or the preflight's) replaced a finished run's record with
    the report, `--plot outputs/run/training_curves.png` its curves, in silence. A run's own files (those its
    run_files.json names, and what its checkpoints hold) are refused before the analysis; a new file beside them, as
    any file of a person's there, is not."""
    from dpotrain import output_folder
    from dpotrain import preflight as checks
    from dpotrain.train import run_files

    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    for name in ("run_complete.json", "training_curves.png", "checkpoint-4/trainer_state.json", "notes.json"):
        (run / name).write_text(name)
    run_files.write(run, [run_files.MANIFEST, "run_complete.json", "training_curves.png", "checkpoint-4"])
    before = {p: p.read_text() for p in run.rglob("*") if p.is_file()}
    data, tokenizer = str(ROOT / "data" / "smoke_prefs.jsonl"), str(tmp_path / "no-tokenizer")  # refused before it
    for flag, name, what in (
        ("--json", "run_complete.json", "the run's run_complete.json"),
        ("--plot", "training_curves.png", "the run's training_curves.png"),
        ("--json", "checkpoint-4/trainer_state.json", "a file of the run's checkpoint-4"),
    ):
        path = str(run / name)
        said = f"{flag} {path!r} is {what} in {run} (run_files.json names it), which the report would replace: give a"
        assert cli.main([data, "--tokenizer", tokenizer, flag, path]) == 2
        assert error_line(capsys).startswith(f"error: {said}")
        with pytest.raises(ConfigError, match=re.escape(said)):
            checks.check_outputs(*((path, None) if flag == "--json" else (None, path)))
    for path in (run / "lengths.json", run / "notes.json"):  # not the run's
        output_folder.check_report_paths({"--json": str(path)})
    assert {p: p.read_text() for p in run.rglob("*") if p.is_file()} == before


def test_a_report_is_never_written_into_the_data_folder_it_describes(cli, tmp_path, capsys):
    """datasets reads every file of a folder of data files: `--json shards/lengths.json` was read at the next run as a
    row whose `chosen` is the report's struct (the folder refused for a column of two types), and two `--plot` images
    there made the folder an image data set with no chosen/rejected. Refused before the analysis, as a mixture's
    folder source is; a report beside the folder is written."""
    folder = tmp_path / "shards"
    (folder / "plots").mkdir(parents=True)
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", folder / "a.jsonl")
    data, tokenizer = str(folder), str(tmp_path / "no-tokenizer")  # refused before it
    mixed = ["--dataset_mixer_list", str(ROOT / "data" / "smoke_prefs.jsonl"), "1.0", data, "1.0"]
    for source, flag, path in (
        ([data], "--json", folder / "lengths.json"),
        (mixed, "--plot", folder / "plots" / "lengths.png"),
    ):
        assert cli.main([*source, "--tokenizer", tokenizer, flag, str(path)]) == 2
        said = f"error: {flag} {str(path)!r} is inside the data folder {data!r}, every file of which datasets reads"
        assert error_line(capsys).startswith(said)
    assert sorted(p.name for p in folder.rglob("*")) == ["a.jsonl", "plots"]


def test_a_recipes_coverage_out_of_range_is_named_as_the_recipes_key(cli, tmp_path, capsys):
    """A recipe's `auto_coverage: 1.5` was refused as `--coverage`, a flag the user never typed."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("auto_coverage: 1.5\n" + (ROOT / "configs" / "smoke.yaml").read_text())
    assert cli.main([str(ROOT / "data" / "smoke_prefs.jsonl"), "--config", str(recipe)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: auto_coverage in {recipe} must be in (0, 1] (got 1.5): the share of pairs to leave whole, 0.95 by "
        "default"
    )


def test_a_tokenizer_folder_that_is_not_there_is_named_as_training_names_it(cli, tmp_path, capsys):
    """A mistyped local model folder: the analyzer ended in transformers' "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'", naming no fix, where training says the folder does not exist."""
    data, missing = str(ROOT / "data" / "smoke_prefs.jsonl"), str(tmp_path / "my-sft")
    assert cli.main([data, "--model_name_or_path", missing]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: model folder {missing!r} does not exist: check the path, or give a Hub name like org/model"
    )


def test_a_tokenizer_path_that_is_a_file_is_named_as_a_file(cli, tmp_path, capsys):
    """`--tokenizer configs/smoke.yaml` (a recipe given where the model goes, a model's tokenizer.json): the line said
    the "model folder ... does not exist", where the file is there and is no folder; it now says so."""
    data, recipe = str(ROOT / "data" / "smoke_prefs.jsonl"), str(ROOT / "configs" / "smoke.yaml")
    assert cli.main([data, "--tokenizer", recipe]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: model path {recipe!r} is a file, not a folder: give the folder that holds the model's files "
        "(config.json, tokenizer.json), or a Hub name like org/model"
    )


SYSTEM_FIRST = """from transformers import PreTrainedTokenizerFast


class MyTokenizer(PreTrainedTokenizerFast):
    def apply_chat_template(self, conversation, *args, **kwargs):  # a system turn of its own, where none is given
        if conversation and isinstance(conversation[0], dict) and conversation[0].get("role") != "system":
            conversation = [{"role": "system", "content": "You are a careful assistant."}, *conversation]
        return super().apply_chat_template(conversation, *args, **kwargs)
"""


def own_code_tokenizer(folder, tiny_model_dir, code: str = SYSTEM_FIRST) -> Path:
    """The built-in model saved in `folder` with a tokenizer of its own code (auto_map in tokenizer_config.json), which
    transformers loads only with trust_remote_code (else the tokenizer of the model's config)."""
    shutil.copytree(tiny_model_dir, folder)
    (folder / "tokenization_mine.py").write_text(code)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "MyTokenizer", "auto_map": {"AutoTokenizer": [None, "tokenization_mine.MyTokenizer"]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_lengths_measured_without_a_tokenizers_own_code_are_not_the_runs_that_runs_it(tmp_path, tiny_model_dir):
    """A tokenizer's own code (here a system turn it adds) tokenizes otherwise than the tokenizer transformers loads
    without trust_remote_code, from the same files. The cache was keyed by the files alone: lengths the analyzer
    measured without the code (it has no recipe saying trust_remote_code) were the cached lengths of a run with
    `--trust_remote_code true --max_length auto`, which chose its max_length from prompts 10 tokens shorter than it
    trains. Each is its own analysis now."""
    folder = str(own_code_tokenizer(tmp_path / "model", tiny_model_dir))
    generic, own = lengths.load_tokenizer(folder), lengths.load_tokenizer(folder, trust_remote_code=True)
    assert type(generic).__name__ != "MyTokenizer" and type(own).__name__ == "MyTokenizer"
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    measured = {}
    for name, tokenizer in (("generic", generic), ("own", own)):
        measured[name] = lengths.measure(data.load_preference_dataset(path), tokenizer)
    more = measured["own"].prompt - measured["generic"].prompt  # the system turn, where a row has none
    assert more.min() >= 0 and more.max() > 0
    key = lengths.dataset_identity(path)
    lengths.save_cache(measured["generic"], {}, key, generic)
    assert lengths.cached_measure(key, own) is None
    lengths.save_cache(measured["own"], {}, key, own)
    found, _ = lengths.cached_measure(key, own)
    np.testing.assert_array_equal(found.prompt, measured["own"].prompt)


def test_an_unwritable_modules_cache_is_the_runs_line_before_a_tokenizer_with_its_own_code_loads(
    cli, tmp_path, capsys, monkeypatch, tiny_model_dir
):
    """transformers imports a tokenizer's own code (`trust_remote_code: true`) from a copy it writes under
    HF_MODULES_CACHE: one it cannot write in ended the analysis in "could not load the tokenizer ...
    (NotADirectoryError: [Errno 20] Not a directory: ...)", naming no fix, where the run refuses it in one line naming
    HF_MODULES_CACHE."""
    tokenizer = own_code_tokenizer(tmp_path / "tok", tiny_model_dir)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"model_name_or_path: {tokenizer}\ndataset_name: {ROOT / 'data' / 'smoke_prefs.jsonl'}\n")
    recipe.write_text(recipe.read_text() + "trust_remote_code: true\nmax_length: 1024\n")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("HF_MODULES_CACHE", str(blocked / "modules"))
    from transformers import dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(blocked / "modules"))  # read at import
    assert cli.main(["--config", str(recipe)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: transformers' modules cache {blocked}/modules is not writable (Not a directory in {blocked}), and "
        "a model with its own code (trust_remote_code) is imported from a copy of that code written there: set "
        "HF_MODULES_CACHE (or HF_HOME) to a writable folder"
    )


def test_a_draft_recipe_beside_the_shipped_ones_is_judged_only_when_it_is_the_data_sets(cli, tmp_path, monkeypatch):
    """The analyzer looks in configs/ for the recipe of its data set. A draft there that does not parse (a misspelt key,
    a YAML typo) stopped every analysis, of any data set; it now stops only the analysis of the data set it names."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    (project / "configs" / "a-draft.yaml").write_text("dataset_name: my/data\nlerning_rate: 1e-6\n")
    (project / "configs" / "b-typo.yaml").write_text("dataset_name: [unclosed\n")
    monkeypatch.setattr(cli, "ROOT", project)
    monkeypatch.chdir(tmp_path)
    assert cli.recipe_for("allenai/Dolci-Think-DPO-7B") == "project/configs/think.yaml"
    assert cli.recipe_for("other/data") is None
    with pytest.raises(ConfigError, match="a-draft.yaml: unknown key 'lerning_rate'"):
        cli.recipe_for("my/data")


def test_the_recipe_of_a_local_data_set_is_found_however_its_path_is_written(cli, monkeypatch):
    """`./data/smoke_prefs.jsonl`, or its full path, is the file configs/smoke.yaml trains on
    (`data/smoke_prefs.jsonl`): compared as written, neither found the recipe (the analysis asked for a tokenizer)."""
    monkeypatch.chdir(ROOT)
    assert cli.recipe_for("data/smoke_prefs.jsonl") == "configs/smoke.yaml"
    for written in ("./data/smoke_prefs.jsonl", str(ROOT / "data" / "smoke_prefs.jsonl")):
        assert cli.recipe_for(written) == "configs/smoke.yaml", written
    monkeypatch.chdir(ROOT / "data")  # from the data's folder, as that folder names it
    assert cli.recipe_for("smoke_prefs.jsonl") == str(ROOT / "configs" / "smoke.yaml")
    assert cli.recipe_for("other_prefs.jsonl") is None


@pytest.mark.slow
def test_ctrl_c_ends_the_analyzer_in_one_line_and_caches_nothing(tmp_path):
    """The login node's tool ended Ctrl-C in the traceback of whatever it was doing (an import of pandas or torch, a
    tokenizer batch), exit 1; it now says it stopped, in one line, exit 130, and leaves no cache a run would trust."""
    import signal

    rows = (ROOT / "data" / "smoke_prefs.jsonl").read_text() * 40  # 60 batches of 256 pairs to tokenize
    (tmp_path / "pairs.jsonl").write_text(rows)
    command = [PYTHON, str(PAUSE_AT), str(tmp_path / "pairs.jsonl"), "--config", "configs/smoke.yaml", "--num-proc=1"]
    env = {**os.environ, "DPOTRAIN_CACHE": str(tmp_path / "cache"), "DPOTRAIN_TEST_PAUSE_SCRIPT": str(SCRIPT)}

    def stopped(event: str, at: str) -> tuple[int, str]:
        """Ctrl-C to the analyzer stopped by itself at `at` (tests/helpers/pause_at.py), which takes it as it goes on:
        it lands there however slowly it is sent (a fixed sleep, or a progress line read, raced the run)."""
        paused = tmp_path / f"paused-{event}"
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**env, **pause_env("", at, paused), "DPOTRAIN_TEST_PAUSE_AT_EVENT": event},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # SIGINT as a terminal's Ctrl-C delivers it (a shell's background job, which this may run under, ignores it)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        out = signal_paused(paused, proc, signal.SIGINT)
        return proc.returncode, out

    # Tokenizing: datasets' map opens its cache file once the first batch is measured, 59 batches still to go
    code, out = stopped("open", "*/json/default-*/0.0.0/*/tmp*")
    assert code == 130 and "Traceback" not in out and "Tokenizing" in out, (code, out[-3000:])
    assert out.strip().splitlines()[-1] == "Ctrl-C: stopped", out[-3000:]
    assert not list((tmp_path / "cache").rglob("*.npz"))  # nothing measured is kept as the data set's lengths

    # Inside torch's import, just before its C++ set-up (torch._C), where a KeyboardInterrupt aborted the process
    code, out = stopped("import", "torch._C")
    assert code == 130, (code, out)
    assert out.strip() == "Ctrl-C: stopped while loading the libraries; nothing was started", out


@pytest.mark.slow
def test_ctrl_c_to_the_analyzer_alone_as_its_workers_tokenize_ends_it_in_one_line(tmp_path):
    """`kill -INT` to the analyzer's own process (not its process group) as 2 workers tokenized: datasets' map, ending,
    waits 0.05 s for their results and raised multiprocess's TimeoutError over the KeyboardInterrupt, a traceback and
    exit 1. The Ctrl-C is what ended it: one line, exit 130, as a terminal's Ctrl-C ends it."""
    import signal

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(20000, seed=5)))
    env = {**os.environ, "DPOTRAIN_CACHE": str(tmp_path / "cache"), "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    command = [python(), str(SCRIPT), str(data), "--config", "configs/smoke.yaml", "--num-proc", "2"]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = _output_until_tokenizing(proc)
    time.sleep(1)
    os.kill(proc.pid, signal.SIGINT)
    out = (seen + proc.communicate(timeout=120)[0]).decode()
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == "Ctrl-C: stopped", out[-3000:]


@pytest.mark.slow
def test_a_sigterm_to_the_analyzer_alone_as_its_workers_tokenize_leaves_no_worker_running(tmp_path):
    """`kill <pid>` (SIGTERM to the analyzer's own process, not its process group: a supervisor's, a wrapper's
    `Popen.terminate`) as 2 workers tokenized: the analyzer died of it, and its map's workers, which only the pool's end
    stops, were left running for good, idle, holding its output: `analyze_dataset.py ... | tee report.txt` or a
    caller's `communicate()` waited forever. The workers now end with it; it still dies of the SIGTERM."""
    import signal

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(20000, seed=5)))
    env = {**os.environ, "DPOTRAIN_CACHE": str(tmp_path / "cache"), "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    # A cold interpreter: the process signalled is the analyzer, its workers in the session started here
    command = [PYTHON, str(SCRIPT), str(data), "--config", "configs/smoke.yaml", "--num-proc", "2"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        seen = _output_until_tokenizing(proc)
        time.sleep(1)
        os.kill(proc.pid, signal.SIGTERM)
        try:  # ends once no process holds the output: the analyzer ends in a second or two
            out = (seen + proc.communicate(timeout=60)[0]).decode()
        except subprocess.TimeoutExpired:
            pytest.fail(f"its output still held a minute after its SIGTERM, by {_running_in(proc.pid)}")
        assert proc.returncode == -signal.SIGTERM, out[-3000:]
        deadline = time.monotonic() + 30  # its resource tracker ends once every process that wrote to it has
        while (left := _running_in(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], out[-3000:]
    finally:
        for pid in _running_in(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


def _output_until_tokenizing(proc: subprocess.Popen) -> bytes:
    """What `proc` wrote until its workers' pass began (its `Tokenizing` bar)."""
    import select

    seen, fd = b"", proc.stdout.fileno()
    while b"Tokenizing" not in seen:
        assert proc.poll() is None, seen.decode()[-3000:]
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 65536)
    return seen


def _running_in(session: int) -> list[int]:
    """The processes of `session` not yet ended (an ended one whose parent died may stay a zombie here)."""
    running = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except (OSError, ValueError):
            continue
        state, _, _, sid = stat.rsplit(")", 1)[1].split()[:4]
        if int(sid) == session and state != "Z":
            running.append(int(entry))
    return running


def test_the_report_says_one_pair_per_padded_batch_in_the_singular():
    """`--per_device_train_batch_size 1` (the think recipes' micro-batches are one pair): the report read "Padded
    batches of 1 pairs" and "1 pairs = 2 sequences"."""
    from dpotrain.data import lengths_report

    m = lengths.Measured(
        index=np.arange(10),
        prompt=np.full(10, 100),
        chosen=np.arange(300, 310),
        rejected=np.full(10, 200),
        invalid=[],
        conversational=True,
    )
    text = lengths_report.to_markdown(lengths.summarize(m, batch_size=1, dataset="pairs.jsonl"), 512)
    assert "(TRL's DataCollatorForPreference, 1 pair = 2 sequences padded to the longest)" in text, text
    assert "- Padded batches of 1 pair would add " in text, text
    assert " 1 pairs" not in text, text


def test_a_data_set_of_one_pair_is_said_in_the_singular():
    """A file of one usable pair: the report opened with "1 pairs tokenized as TRL's DPOTrainer tokenizes them"."""
    from dpotrain.data import lengths_report

    one = dict(prompt=np.array([100]), chosen=np.array([300]), rejected=np.array([200]), invalid=[])
    m = lengths.Measured(index=np.arange(1), conversational=True, **one)
    report = lengths.summarize(m, dataset="pair.jsonl") | {"tokenizer": "org/model"}
    text = lengths_report.to_markdown(report, 512)
    assert "\n1 pair tokenized as TRL's DPOTrainer tokenizes them, " in text and " 1 pairs" not in text, text
    assert "\n1 pair of synthetic token counts " in lengths_report.to_markdown(report | {"synthetic": True}, 512)


def test_one_pair_cut_and_one_dropped_are_said_in_the_singular():
    """Eight short pairs, one whose answer runs past the recommended max_length, one whose prompt alone fills it: the
    report read "1 pairs (10.0%) are cut ...; 1 are dropped by the trainer because their prompt alone fills it"."""
    from dpotrain.data import lengths_report

    m = lengths.Measured(
        index=np.arange(10),
        prompt=np.array([100] * 9 + [3000]),
        chosen=np.array([300] * 8 + [3000, 300]),
        rejected=np.full(10, 200),
        invalid=[],
        conversational=True,
    )
    report = lengths.summarize(m, target=0.8, dataset="pairs.jsonl")
    assert (
        "; 1 pair (10.0%) is cut at the end and 1 dropped by the trainer because its prompt alone fills "
        in (report["recommendation"]["reason"])
    ), report["recommendation"]
    text = lengths_report.to_markdown(report, 512)
    assert (
        "- 1 pair (10.0%) is cut at max_length (the collator keeps the start); 1 is dropped by the trainer because its "
        "prompt alone fills it"
    ) in text.splitlines(), text


def test_a_mixture_on_the_command_line_is_measured_as_the_run_reads_it(cli, tmp_path, tiny_model_dir, capsys):
    """`--dataset_mixer_list a.jsonl 1.0 b.jsonl 2` (README: the run's command-line mixture) was refused by the
    analyzer as "unknown argument '--dataset_mixer_list' (did you mean --dataset_train_split?)": the mixture a user
    trains could only be measured by writing it into a recipe. It is read as the run reads it, each source's share
    reported; a mixture beside a data set is refused as the run refuses it."""
    a = write_jsonl(tmp_path / "a.jsonl", _messages_rows())
    b = write_jsonl(tmp_path / "b.jsonl", _messages_rows()[:3])
    out = tmp_path / "r.json"
    mixer = ["--dataset_mixer_list", a, "1.0", b, "2", "--dataset_mixer_list_splits", "train"]
    assert cli.main(["--tokenizer", tiny_model_dir, *mixer, "--json", str(out), "--num-proc", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == len(_messages_rows()) + 2 and report["dataset"] == "the --dataset_mixer_list mixture"
    said = capsys.readouterr()
    assert f"Source {a} [train]: {len(_messages_rows())} rows, took" in said.out
    assert "Analysing the --dataset_mixer_list mixture (train) with the tokenizer of" in said.err  # "None" before
    assert cli.main([a, "--tokenizer", tiny_model_dir, *mixer]) == 2
    assert error_line(capsys).startswith(f"error: a data set ({a!r}) and --dataset_mixer_list: a mixture names")


def test_a_datasets_mixture_is_measured_on_the_rows_the_run_takes(cli, tmp_path, tiny_model_dir, capsys):
    """train_dpo.py's `--datasets` (TRL's mixture, in YAML) was refused by the analyzer ("unknown argument"): a user
    of that spelling could measure the mixture only by writing it into a recipe. It is read by the run's parser, and
    the rows measured are the ones the dry run plans (a fraction drawn by the seed, a count, a source upsampled)."""
    a = write_jsonl(tmp_path / "a.jsonl", _messages_rows())
    b = write_jsonl(tmp_path / "b.jsonl", _messages_rows()[:5])
    sources = [f"- path: {a}\n  amount: 0.5\n- path: {b}\n  amount: 2.0\n"]
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--datasets", *sources, "--seed", "3"]
    out = tmp_path / "r.json"
    assert cli.main([*args, "--model_name_or_path", tiny_model_dir, "--json", str(out), "--num-proc", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["dataset"] == "the --datasets mixture"
    planned = _dry_run(capsys, [*args, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run")])
    taken = [r["taken"] for r in planned["derived"]["data_sources"]]
    assert taken == [len(_messages_rows()) // 2, 10] and report["rows"] == sum(taken)
    assert cli.main([a, "--tokenizer", tiny_model_dir, "--datasets", b]) == 2
    assert error_line(capsys).startswith(f"error: a data set ({a!r}) and --datasets: a mixture names")


def test_a_mixtures_sources_are_said_read_with_the_recipes_chat_template(cli, tmp_path, tiny_model_dir, capsys):
    """A hunt: with `--chat_template_path`, each mixture source's `Data (...)` line said "the model's chat template"
    where its rows were checked with the file given, and the run's dry run named the file: the analyzer's rules for
    the sources left the recipe's template out. Both now name it."""
    template = tmp_path / "mine.jinja"
    template.write_text((ROOT / "configs" / "templates" / "olmo_thinker.jinja").read_text())
    rows = _messages_rows()[:6]
    for row in rows:  # answers that open with a thinking block, as the thinker template's generation prompt asks
        for side in ("chosen", "rejected"):
            row[side] = [*row[side][:-1], {**row[side][-1], "content": "<think>ok</think>" + row[side][-1]["content"]}]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    mixer = ["--dataset_mixer_list", a, "1.0", "--chat_template_path", str(template)]
    assert cli.main(["--tokenizer", tiny_model_dir, *mixer, "--num-proc", "1"]) == 0
    said = capsys.readouterr()
    data = [line for line in (said.out + said.err).splitlines() if line.startswith(f"Data ({a}")]
    assert data and all(line.endswith(f"the chat template {template}") for line in data), data
    assert "the model's chat template" not in said.out + said.err


def test_seed_is_the_runs_seed_so_a_mixture_is_measured_on_the_rows_the_run_takes(cli, tmp_path, tiny_model_dir):
    """`--seed 3` is train_dpo.py's seed, which draws a mixture's rows: the analyzer took it for its own --sample seed
    and measured the rows the recipe's seed (7) draws (a probe: 23 of 35 pairs cut at 160 where the run with --seed 3
    cut 24), cached under that seed's key, where no run with --seed 3 looks. Now the rows measured and cached are the
    run's."""
    from dpotrain import stages
    from dpotrain.data import mixture
    from dpotrain.recipe.config import parse_args

    a = write_jsonl(tmp_path / "a.jsonl", _messages_rows()[:30])
    b = write_jsonl(tmp_path / "b.jsonl", _messages_rows()[::-1])
    recipe = tmp_path / "r.yaml"
    sources = f"datasets:\n  - path: {a}\n    amount: 0.5\n  - path: {b}\n    amount: 20\n"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\n{sources}seed: 7\nbf16: false\nreport_to: [none]\n")
    assert cli.main(["--config", str(recipe), "--seed", "3", "--num-proc", "1"]) == 0
    run = parse_args(["--config", str(recipe), "--seed", "3"])
    tokenizer = lengths.recipe_tokenizer(run)
    found = lengths.cached_measure(mixture.dataset_id(run), tokenizer)
    assert found is not None, "the analysis was cached under the recipe's seed, not the run's"
    pairs = stages.load_data(run, stages.checks(run), say=False).train
    trained = lengths.measure(pairs, tokenizer)
    for side in ("prompt", "chosen", "rejected"):
        np.testing.assert_array_equal(getattr(found[0], side), getattr(trained, side), err_msg=side)


def test_a_flag_given_twice_with_two_values_is_said_and_the_last_counts(
    cli, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """`--tokenizer A ... --model_name_or_path B` (two spellings of one flag) measured with B, and `--max_length 10
    --max_length 20` reported on 20, without a word: the last still counts, as train_dpo.py's, and a warning names
    both values."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    twice = ["--tokenizer", str(tmp_path), "--model_name_or_path", tiny_model_dir, "--max_length", "10"]
    monkeypatch.setattr("sys.argv", ["analyze_dataset.py", path, *twice, "--max-length", "20", "--num-proc", "1"])
    assert cli.main() == 0
    err = capsys.readouterr().err
    assert (
        f"warning: --tokenizer is given twice on the command line ({tmp_path}, then {tiny_model_dir}): the last "
        "counts" in err
    )
    assert "warning: --max_length is given twice on the command line (10, then 20): the last counts" in err


def cache_folder_bytes(dataset) -> tuple[str, int]:
    """The folder datasets reports the pairs' Arrow copy in (`Dataset.cache_files`), and the bytes of its files."""
    folder = os.path.dirname(dataset.cache_files[0]["filename"])
    return folder, sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def test_the_analyzer_says_where_datasets_copied_the_pairs_and_how_much_it_takes(cli, tmp_path, tiny_model_dir, capsys):
    """The first analysis of a data set writes datasets' Arrow copy of its pairs into HF_DATASETS_CACHE (895 MB for
    50k thinking pairs) without a word: a home quota on a login node filled unannounced. The analyzer names the folder
    and its measured size, and this project's own cache (the analysis it keeps for `max_length: auto`)."""
    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows() * 20)
    assert cli.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Caches: ")]
    folder, written = cache_folder_bytes(data.load_preference_dataset(path, say=False))
    own = tmp_path / "cache"
    kept = sum(f.stat().st_size for f in own.rglob("*") if f.is_file())
    assert said == [
        f"Caches: {size(written)} in {folder} (datasets' copy of the pairs as Arrow, made at their first read, and "
        f"its maps: HF_DATASETS_CACHE or HF_HOME places it elsewhere); {size(kept)} in {own} (this project's length "
        "analyses and reference log-probs: DPOTRAIN_CACHE places it elsewhere)"
    ]
    assert written > 0 and kept > 0


@pytest.mark.parametrize("saved", [False, True], ids=["file", "save_to_disk"])
def test_a_dataset_config_for_a_file_is_refused_by_the_run_and_the_analyzer(saved, cli, tmp_path, capsys):
    """`--dataset_config` names one of a Hub data set's configurations: for a local file (or a data set saved by
    save_to_disk) datasets reads the file without it, and the run recorded it in resolved_config.json, read by nothing;
    the analyzer measured the file as if it applied. Both refuse it, in one line."""
    import datasets

    from dpotrain import options
    from dpotrain.recipe.config import parse_args

    path = write_jsonl(tmp_path / "d.jsonl", _messages_rows())
    if saved:
        datasets.load_dataset("json", data_files=str(path), split="train").save_to_disk(tmp_path / "saved")
        path = tmp_path / "saved"
    what = "a data set saved by save_to_disk" if saved else "a file"
    refusal = (
        f"dataset_config 'sub' names a configuration of a Hub data set, and '{path}' is {what}, which has none: "
        "remove dataset_config"
    )
    run = parse_args(["--model_name_or_path", "builtin:tiny-olmo3", "--dataset_name", str(path), "--dry-run"])
    options.check_options(run)  # without it: accepted
    run.script.dataset_config = "sub"
    with pytest.raises(ConfigError) as refused:
        options.check_options(run)
    assert str(refused.value) == refusal
    assert cli.main([str(path), "--dataset_config", "sub", "--json", str(tmp_path / "r.json")]) == 2
    assert error_line(capsys) == f"error: {refusal}"
    assert not (tmp_path / "r.json").exists()


def _empty_earlier_answer(tmp_path) -> tuple[list[dict], list[str]]:
    """41 pairs, the multi-turn one at index 7 with an empty earlier answer, and the smoke recipe's arguments that
    read them as a mixture under `assistant_turns: all` (which drops that pair) with `max_length: auto`."""
    pairs = _messages_rows()
    assert pairs[7]["chosen"][1]["role"] == "assistant"  # a multi-turn pair: an earlier exchange before the answer
    for side in ("chosen", "rejected"):
        pairs[7][side][1]["content"] = ""
    path = write_jsonl(tmp_path / "d.jsonl", pairs)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    return pairs, [*smoke, "--dataset_mixer_list", path, "1.0", "--skip_invalid", "true", "--max_length", "auto"]


def _dry_run(capsys, args) -> dict:
    import train_dpo

    capsys.readouterr()
    train_dpo.main([*args, "--dry-run", "--json"])
    said = capsys.readouterr()
    return json.loads(said.out[said.out.index("{\n") :]) | {"said": said.err}


def test_the_analyzer_drops_the_empty_earlier_answer_the_run_drops_under_all(cli, tmp_path, tiny_model_dir, capsys):
    """A mixture under `assistant_turns: all` with `skip_invalid: true` and one pair whose earlier answer is empty:
    the analyzer read the rows as `final` does, kept that pair and cached 41 pairs' lengths where the run keeps 40,
    and the dry run after it failed with an IndexError traceback (each cached row's source, `Mix.with_token_shares`).
    Both now drop it, and the cache is not `final`'s."""
    pairs, args = _empty_earlier_answer(tmp_path)
    args += ["--model_name_or_path", tiny_model_dir]
    out = tmp_path / "r.json"
    assert cli.main([*args, "--json", str(out), "--num-proc", "1"]) == 0
    assert json.loads(out.read_text())["rows"] == len(pairs) - 1
    planned = _dry_run(capsys, [*args, "--output_dir", str(tmp_path / "run")])
    assert planned["derived"]["max_length"]["cached"] is True and planned["derived"]["max_length"]["rows"] == 40
    assert [r["rows_usable"] for r in planned["derived"]["data_sources"]] == [len(pairs) - 1]


def test_cached_lengths_of_rows_the_mixture_no_longer_holds_are_measured_again(tmp_path, tiny_model_dir, capsys):
    """A cache written before the rows check dropped a pair (41 pairs' lengths, where the run reads 40) was read as
    the mixture's: an IndexError traceback in `Mix.with_token_shares` before the model loaded. Now out of date, said,
    and measured again; lengths that reach past the mixture are refused in one line, never indexed."""
    from dpotrain import stages
    from dpotrain.data import mixture
    from dpotrain.recipe.config import parse_args

    pairs, args = _empty_earlier_answer(tmp_path)
    args += ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run")]
    final = parse_args([*args, "--assistant_turns", "final"])
    kept = stages.load_data(final, stages.checks(final), say=False)
    tokenizer = lengths.recipe_tokenizer(final)
    older = lengths.measure(kept.train, tokenizer)
    assert older.rows == len(pairs)
    every_turn = mixture.dataset_id(parse_args(args))
    assert every_turn != mixture.dataset_id(final)  # `final` keeps the pair: its lengths are not `all`'s
    lengths.save_cache(older, {}, every_turn, tokenizer)  # under `all`'s key, as an older rows check kept the pair
    planned = _dry_run(capsys, args)
    assert f"cached lengths ({tmp_path}" in planned["said"]
    assert "are of 41 pairs, not the 40 of the mixture the run reads: out of date, measured again" in planned["said"]
    assert planned["derived"]["max_length"]["rows"] == len(pairs) - 1
    assert [r["rows_usable"] for r in planned["derived"]["data_sources"]] == [len(pairs) - 1]
    with pytest.raises(ConfigError, match=r"^the lengths measured reach pair 40, .* holds 40 pairs: an out-of-date"):
        mixture.Mix(kept.mix.records, kept.mix.source_of_row[:40]).with_token_shares(older)


def test_available_cpus_keeps_within_the_cgroup_cpu_quota(tmp_path):
    """A login node limiting each user to 2 CPUs (systemd's CPUQuota: cgroup v2's cpu.max on the user's slice, the
    session scope below it unlimited) showed all its cores in the affinity, and the analyzer forked a tokenizer per
    core. Here a tree laid out as /sys/fs/cgroup is, with /proc/self/cgroup's lines."""
    own = tmp_path / "cgroup"
    scope = tmp_path / "user.slice" / "user-1000.slice" / "session-3.scope"
    scope.mkdir(parents=True)
    (scope / "cpu.max").write_text("max 100000\n")
    (scope.parent / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: two processes use it
    own.write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    assert lengths.cgroup_cpu_quota(str(tmp_path), str(own)) == 2
    (scope.parent / "cpu.max").write_text("max 100000\n")
    assert lengths.cgroup_cpu_quota(str(tmp_path), str(own)) is None
    # cgroup v1 (a container's --cpus=1 on an older host): quota and period in two files of the cpu mount
    v1 = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n")
    assert lengths.cgroup_cpu_quota(str(tmp_path), str(own)) == 1
    assert lengths.cgroup_cpu_quota(str(tmp_path), str(tmp_path / "none")) is None  # no cgroups (macOS): no limit
    (v1 / "cpu.cfs_quota_us").write_text("")  # unreadable as a quota: no limit, not a traceback at --help
    assert lengths.cgroup_cpu_quota(str(tmp_path), str(own)) is None


def test_a_launchs_processes_share_their_nodes_cpus_when_they_measure(monkeypatch):
    """A mixture's pairs are measured at a run's start by every process of the launch at once (each its own copy, in
    its own pool of tokenizers): each took every CPU it could use, 8 ranks on a 64-core node forking 512. Each now takes
    its share of the node's (LOCAL_WORLD_SIZE, which accelerate launch and torchrun set), at least one; the analyzer, a
    process alone, takes them all."""
    large = range(lengths.PARALLEL_ROWS)
    cpus = lengths.available_cpus()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert lengths.workers(large) == cpus and lengths.workers(range(10)) == 1
    for processes in (2, cpus + 1):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        assert lengths.workers(large) == max(1, cpus // processes), processes

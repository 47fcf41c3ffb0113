"""Issue #42: every input read as the user meant it or refused in one line, the same in training, the dry run and the
analyzer (docs/reliability.md, "Your data: read as meant or refused").

Data sets are generated from the built-in rows and written with the real `datasets` library; training runs in this
process through its command-line entry (`train_dpo.main`), the analyzer through its `main`.
"""

import json
import os
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from test_analyzer import error_line, trainer_dataset, write_jsonl
from test_refusals import refused

import train_dpo
from conftest import ROOT
from dpotrain import options
from dpotrain.cluster import job
from dpotrain.data import builtin, cuts, data, lengths, rows, shapes
from dpotrain.recipe import config, run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, run_cli
from dpotrain.train import run_files

SMOKE = ROOT / "configs" / "smoke.yaml"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return lengths.load_tokenizer(tiny_model_dir)


def conversations(n=16, seed=11) -> list[dict]:
    """chosen/rejected conversations sharing their prompt (single-turn, with a system message, multi-turn)."""
    return builtin.make_preference_rows(n, seed=seed)


@pytest.fixture
def analyzer(cli):  # noqa: F811  (test_analyzer's fixture: the script as a module)
    return cli


def read(path: str):
    """The pairs train_dpo.py hands the trainer, from the file as loaded."""
    return rows.usable_pairs(data.load_preference_dataset(path), rows.RowRules(say=False), {}, "invalid_rows")


def analyzer_error(analyzer, capsys, *argv) -> str:
    assert analyzer.main([*argv, "--num-proc", "1"]) == 2
    return error_line(capsys)


# --- a prompt column the conversations already hold -------------------------------------------------------------------


def test_a_prompt_column_repeated_in_the_conversations_is_trained_once(tokenizer, tmp_path):
    """TRL renders prompt + chosen as given: a prompt column beside whole conversations trains the user turn twice.
    Read as meant, the pairs are those of the conversations alone."""
    plain = conversations()
    repeated = [{"prompt": r["chosen"][:-1], **r} for r in plain]
    as_meant = read(write_jsonl(tmp_path / "plain.jsonl", plain))
    pairs = read(write_jsonl(tmp_path / "repeated.jsonl", repeated))
    assert pairs.to_list() == as_meant.to_list()
    # The trainer's tokens, and the analyzer's count of them, hold the prompt once.
    processed = trainer_dataset(pairs, tokenizer, tmp_path)
    assert (
        tokenizer.decode(processed[0]["prompt_ids"] + processed[0]["chosen_ids"]).count(
            plain[0]["chosen"][-2]["content"]
        )
        == 1
    )
    m = lengths.measure(datasets.Dataset.from_list(repeated), tokenizer)
    np.testing.assert_array_equal(m.prompt, [len(p) for p in processed["prompt_ids"]])
    np.testing.assert_array_equal(m.chosen, [len(c) for c in processed["chosen_ids"]])


@pytest.mark.parametrize(
    "edit, column, problem",
    [
        (lambda r: {**r, "rejected": r["rejected"][-1:]}, "rejected", "does not start with the `prompt` column's"),
        (
            lambda r: {**r, "prompt": [{"role": "user", "content": "Another question?"}]},
            "chosen",
            "starts with a user message that is not the `prompt` column's",
        ),
        (  # TRL trained the follow-up as answer tokens, though no `assistant_turns` labels a user turn
            lambda r: {**r, "chosen": [*r["chosen"], {"role": "user", "content": "And?"}, r["chosen"][-1]]},
            "chosen",
            "holds a user message after the `prompt` column's messages and the answer's start, which TRL would take",
        ),
        (  # the answer alone, with a tool's result inside it
            lambda r: {
                **r,
                "chosen": [r["chosen"][-1], {"role": "tool", "content": "4"}, r["chosen"][-1]],
                "rejected": r["rejected"][-1:],
            },
            "chosen",
            "holds a tool message after the `prompt` column's messages and the answer's start, which TRL would take",
        ),
    ],
    ids=["one side repeats it", "another prompt inside the conversation", "a follow-up turn", "a tool's result"],
)
def test_a_prompt_column_the_conversations_contradict_is_refused(
    edit, column, problem, analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    good = [{"prompt": r["chosen"][:-1], **r} for r in conversations()]
    path = write_jsonl(tmp_path / "bad.jsonl", [*good[:5], edit(good[5]), *good[6:]])
    expected = f"row 5, column '{column}': {problem}"
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", path)
    assert expected in analyzer_error(analyzer, capsys, path, "--tokenizer", tiny_model_dir)


def test_a_conversation_whose_tool_call_differs_from_the_prompt_columns_is_not_read_as_repeating_it():
    """A repeated prompt was recognised by role and content alone: a side whose tool call differed from the prompt
    column's (content empty or null) passed for a repetition and was trained on the prompt column's call instead."""

    def call(name):
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name}}]}

    user, result, answer = {"role": "user", "content": "2+2?"}, {"role": "tool", "content": "4"}, "It is 4."
    prompt = [user, call("calc"), result]
    row = {
        "prompt": prompt,
        "chosen": [user, call("search"), result, {"role": "assistant", "content": answer}],
        "rejected": [*prompt, {"role": "assistant", "content": "It is 5."}],
    }
    fmt = rows.RowFormat.of(row, list(row), None)
    assert fmt.shape.name == "prompt+messages"
    assert rows.read_row(row, fmt) == (
        None,
        (
            "chosen",
            "does not start with the `prompt` column's messages while `rejected` does: write both sides the same way "
            "(the whole conversation, or the answer alone)",
        ),
    )


# --- text pairs where one side is the start of the other --------------------------------------------------------------


def test_text_pair_where_one_side_starts_the_other_is_refused(analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch):
    """TRL takes the shared start as the prompt: 'Paris.' against 'Paris. It is in France.' leaves chosen the answer
    '.' — refused in training and in the analyzer, naming the row and the side."""
    good = [
        {"chosen": f"Q{i}: capital of France? A: Paris.", "rejected": f"Q{i}: capital of France? A: Lyon."}
        for i in range(12)
    ]
    bad = {"chosen": "Q: capital of France? A: Paris.", "rejected": "Q: capital of France? A: Paris. It is in France."}
    path = write_jsonl(tmp_path / "text.jsonl", [*good[:7], bad, *good[7:]])
    expected = "row 7, column 'chosen': is the start of `rejected`"
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", path)
    assert expected in analyzer_error(analyzer, capsys, path, "--tokenizer", tiny_model_dir)
    # The same with the sides swapped names the other column.
    swapped = {"chosen": bad["rejected"], "rejected": bad["chosen"]}
    path = write_jsonl(tmp_path / "swapped.jsonl", [*good[:2], swapped, *good[2:]])
    assert "row 2, column 'rejected': is the start of `chosen`" in analyzer_error(
        analyzer, capsys, path, "--tokenizer", tiny_model_dir
    )


def test_text_answers_that_share_no_start_have_an_empty_prompt_whatever_they_end_with(tokenizer, tmp_path):
    """docs/data.md: answers that share no start are a pair with an empty prompt. TRL's extract_prompt steps back over
    a space before the first difference, at index 0 reading index -1: a `chosen` ending with a space became its own
    prompt but for that space, its answer ' ' (refused as an empty completion) and rejected's its last character."""
    pairs = [{"chosen": f"Blue is colour {i}. ", "rejected": f"Green {i}."} for i in range(6)]
    pairs += [{"chosen": f"Q{i}: a colour? A: Blue. ", "rejected": f"Q{i}: a colour? A: Green."} for i in range(6)]
    read_pairs = read(write_jsonl(tmp_path / "text.jsonl", pairs))
    assert read_pairs[0] == {"prompt": "", "chosen": "Blue is colour 0. ", "rejected": "Green 0."}
    assert read_pairs[6] == {"prompt": "Q0: a colour? A:", "chosen": " Blue. ", "rejected": " Green."}
    processed = trainer_dataset(read_pairs, tokenizer, tmp_path)
    m = lengths.measure(datasets.Dataset.from_list(pairs), tokenizer)
    assert m.invalid == []
    for key in ("prompt", "chosen", "rejected"):
        np.testing.assert_array_equal(getattr(m, key), [len(ids) for ids in processed[f"{key}_ids"]], err_msg=key)


def test_the_runs_measure_of_text_answers_that_share_no_start_keeps_every_pair(tokenizer, tmp_path):
    """The run measures the pairs as it read them (the forward's decision, a mixture's shares), where such a pair's
    implicit prompt is a `prompt` column's "": each was refused as an empty prompt and left out, and a data set of them
    ended in a ZeroDivisionError traceback before training. An explicit empty prompt column is still refused."""
    from dpotrain.forwards import sample

    pairs = [{"chosen": f"Blue is colour {i}.", "rejected": f"Green {i}."} for i in range(6)]
    read_pairs = read(write_jsonl(tmp_path / "text.jsonl", pairs))
    found, _, _ = sample.measured_sample(read_pairs, tokenizer, seed=0)
    processed = trainer_dataset(read_pairs, tokenizer, tmp_path)
    assert list(found.prompt) == [0] * 6
    assert list(found.chosen) == [len(ids) for ids in processed["chosen_ids"]]
    given = [{"prompt": "", **pair} for pair in pairs]
    assert len(lengths.measure(datasets.Dataset.from_list(given), tokenizer, skip_invalid=True).invalid) == 6


# --- message lists written as JSON text -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_message_lists_written_as_json_text_are_read_as_messages(kind, tokenizer, tmp_path):
    plain = conversations()
    as_text = datasets.Dataset.from_list([{k: json.dumps(v) for k, v in r.items()} for r in plain])
    path = str(tmp_path / f"pairs.{kind}")
    as_text.to_csv(path, index=False) if kind == "csv" else as_text.to_parquet(path)
    pairs = read(path)
    assert pairs.to_list() == read(write_jsonl(tmp_path / "plain.jsonl", plain)).to_list()
    # The analyzer reads them the same way: its lengths are the trainer's.
    m = lengths.measure(data.load_preference_dataset(path), tokenizer)
    assert m.conversational
    processed = trainer_dataset(pairs, tokenizer, tmp_path)
    np.testing.assert_array_equal(m.rejected, [len(r) for r in processed["rejected_ids"]])


def test_json_text_messages_with_fields_the_first_rows_lack_are_read_as_written(tmp_path):
    """Parsed from JSON text, each row's messages have the fields written in it; datasets fixed the fields from the
    first batch of rows it wrote (1,000), and a later message with another one (a `name`, a tool call's `tool_calls`)
    failed the read in a traceback (Couldn't cast array of type struct<role, content, name> to {'role', 'content'})."""
    rows = [
        {side: [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": a}] for side, a in sides}
        for i, sides in enumerate([(("chosen", "Yes."), ("rejected", "No."))] * 1010)
    ]
    for side in ("chosen", "rejected"):
        rows[1005][side][0]["name"] = "bob"
    path = str(tmp_path / "late.csv")
    datasets.Dataset.from_list([{k: json.dumps(v) for k, v in r.items()} for r in rows]).to_csv(path, index=False)
    pairs = read(path)
    assert pairs[1005]["prompt"] == [{"role": "user", "content": "Q1005?", "name": "bob"}]
    assert pairs[0]["prompt"] == [{"role": "user", "content": "Q0?"}] and len(pairs) == 1010


def test_json_text_cells_that_do_not_match_the_first_row_are_refused(
    analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    plain = conversations()
    cells = [{k: json.dumps(v) for k, v in r.items()} for r in plain]
    cells[4]["rejected"] = "Green."  # plain text in a column of JSON message lists
    path = str(tmp_path / "mixed.csv")
    datasets.Dataset.from_list(cells).to_csv(path, index=False)
    expected = "row 4, column 'rejected': not a message list written as JSON"
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", path)
    assert expected in analyzer_error(analyzer, capsys, path, "--tokenizer", tiny_model_dir)
    # Plain text first, then a JSON message list: it would train the JSON.
    text = [{"prompt": f"Q{i}?", "chosen": " Yes.", "rejected": " No."} for i in range(12)]
    text[6]["chosen"] = json.dumps(plain[0]["chosen"])
    path = str(tmp_path / "text.csv")
    datasets.Dataset.from_list(text).to_csv(path, index=False)
    assert "row 6, column 'chosen': a message list written as JSON text" in analyzer_error(
        analyzer, capsys, path, "--tokenizer", tiny_model_dir
    )


def test_csv_cells_that_look_like_numbers_are_read_as_the_text_written(tokenizer, tmp_path):
    """A CSV cell holds a string (docs/data.md), but pandas inferred a column's type from its cells: answers `42`,
    `1.50` or `True` became an int, the float 1.5 or a bool, and every row was refused ('a int where the data set has
    plain text')."""
    columns = {
        "ints": [(f"What is {i} + {i}?", f"{2 * i}", f"{2 * i + 1}") for i in range(10)],
        "floats": [(f"Half of {2 * i + 3}?", f"{i + 1}.50", f"{i + 1}.25") for i in range(10)],
        "bools": [(f"Is {i} even?", str(i % 2 == 0), str(i % 2 == 1)) for i in range(10)],
        "zero-padded": [(f"{i} as three digits?", f"00{i}", f"{i}") for i in range(10)],
    }
    for name, written in columns.items():
        path = tmp_path / f"{name}.csv"
        path.write_text(
            "prompt,chosen,rejected,score\n" + "".join(f"{p},{c},{r},{i}\n" for i, (p, c, r) in enumerate(written))
        )
        pairs = read(str(path))
        assert [(r["prompt"], r["chosen"], r["rejected"]) for r in pairs] == written, name
        assert lengths.measure(data.load_preference_dataset(str(path)), tokenizer).rows == 10  # the analyzer too
    # pandas' DataFrame.to_csv writes its index first, under no name: read as pandas names it, not read for pairs
    path = tmp_path / "indexed.csv"
    path.write_text(",prompt,chosen,rejected\n" + "".join(f"{i},{p},{c},{r}\n" for i, (p, c, r) in enumerate(written)))
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in read(str(path))] == written


def test_csv_cells_pandas_takes_for_missing_values_are_read_as_the_text_written(tmp_path):
    """An answer `None`, `NA`, `N/A`, `null` or `nan` in a CSV file is that text (docs/data.md), but pandas read each as
    a missing value: the row was refused as "missing (null)" beside a cell that says otherwise, and with skip_invalid
    the pair was dropped and counted so. An empty cell is still missing. One file, a folder and a `path: csv` source."""
    from dpotrain.data import mixture

    written = [("Is 4 prime?", "None", "Two"), ("N/A means?", "not applicable", "NA"), ("Hi", "null", "nan")]
    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / "pairs.csv").write_text("prompt,chosen,rejected\n" + "".join(f"{p},{c},{r}\n" for p, c, r in written))
    path = str(folder / "pairs.csv")
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in read(path)] == written
    assert data.load_preference_dataset(str(folder), say=False).to_list() == read(path).to_list()
    source = mixture.Source("csv", "train", data_files=[path])
    assert mixture.read_source(source, say=False).to_list() == read(path).to_list()
    (folder / "pairs.csv").write_text("prompt,chosen,rejected\nQ1?,A,B\nQ2?,,B\n")
    with pytest.raises(ConfigError, match=r"row 1, column 'chosen': missing \(null\)"):
        read(path)


# --- a Hub-style folder's configurations -----------------------------------------------------------------------------


def hub_style_folder(tmp_path, configs: dict[str, str]) -> str:
    """A cloned Hub data set: a README.md whose `configs:` name each configuration's file."""
    folder = tmp_path / "cloned"
    for name in configs:
        (folder / name).mkdir(parents=True)
        write_jsonl(folder / name / "train.jsonl", conversations(4))
    card = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/*.jsonl\n{extra}"
        for c, extra in configs.items()
    )
    (folder / "README.md").write_text(f"---\nconfigs:\n{card}---\n")
    return str(folder)


def test_a_folders_configuration_left_out_or_misspelled_names_the_ones_it_has(tmp_path):
    """A cloned Hub data set with two configurations and no dataset_config was refused as an unreadable folder ("could
    not read the local folder ... (ValueError: Config name is missing.) ... put the pairs there as .jsonl ... files
    of one format"): a fix that is not one. A name it lacks said the same. The line now names the configurations."""
    folder = hub_style_folder(tmp_path, {"en": "", "de": ""})
    for name, said in ((None, "has 2 configurations"), ("fr", "has no configuration 'fr'")):
        with pytest.raises(ConfigError) as refused_:
            data.load_preference_dataset(folder, config=name, say=False)
        line = str(refused_.value)
        assert said in line and "en, de" in line and "dataset_config" in line and "\n" not in line, line
    assert len(data.load_preference_dataset(folder, config="de", say=False)) == 4
    # One marked `default: true` is read without a name, as datasets reads it
    folder = hub_style_folder(tmp_path / "2", {"en": "  default: true\n", "de": ""})
    assert len(data.load_preference_dataset(folder, say=False)) == 4


# --- precision --------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on a CUDA GPU")
def test_fp16_without_a_gpu_is_refused_not_recorded(tmp_path, monkeypatch, capsys):
    assert "fp16 needs a CUDA GPU and this run has none" in refused(tmp_path, monkeypatch, capsys, "--fp16", "true")
    # Also under use_cpu, where no GPU would be used even if there were one.
    assert "fp16 needs a CUDA GPU" in refused(tmp_path, monkeypatch, capsys, "--fp16", "true", "--use_cpu", "true")


def test_activation_offloading_without_a_gpu_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """It stopped in a traceback once the model had loaded (torch.cuda.Stream: "CUDA driver version is insufficient
    for CUDA runtime version"); a dry run, which plans a GPU job from a login node, still plans it."""
    says = "activation_offloading needs a CUDA GPU (TRL moves the activations to CPU memory on CUDA streams) and this "
    assert says in refused(tmp_path, monkeypatch, capsys, "--activation_offloading", "true", "--use_cpu", "true")
    if not torch.cuda.is_available():
        assert says in refused(tmp_path, monkeypatch, capsys, "--activation_offloading", "true")
    options.check_options(parse_args(["--config", str(SMOKE), "--activation_offloading", "true", "--dry-run"]))


# --- pairs cut and dropped at max_length ------------------------------------------------------------------------------


def cut_rows() -> list[dict]:
    """Rows of every length, and two whose prompt alone is long (dropped at a small max_length)."""
    out = conversations(30, seed=2)
    for i in (4, 17):
        long_user = {"role": "user", "content": f"Please explain tides number {i}. " * 25}
        out[i] = {
            "chosen": [long_user, {"role": "assistant", "content": "The moon pulls the water."}],
            "rejected": [long_user, {"role": "assistant", "content": "No idea."}],
        }
    return out


@pytest.mark.slow
def test_pairs_cut_and_dropped_are_counted_the_same_by_the_run_and_the_analyzer(
    analyzer, tmp_path, tiny_model_dir, tokenizer, capsys
):
    path = write_jsonl(tmp_path / "pairs.jsonl", cut_rows())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        SMOKE.read_text()
        .replace("max_length: 1024", "max_length: 160")
        .replace("dataset_name: data/smoke_prefs.jsonl", f"dataset_name: {path}")
        .replace("pairs_per_step: 8", "pairs_per_step: 4")
    )
    # What TRL itself keeps and cuts, independently of this project's counting.
    processed = trainer_dataset(read(path), tokenizer, tmp_path, max_length=160)
    total = np.array(
        [
            len(p) + max(len(c), len(r))
            for p, c, r in zip(processed["prompt_ids"], processed["chosen_ids"], processed["rejected_ids"], strict=True)
        ]
    )
    expected = {
        "max_length": 160,
        "truncation_mode": "keep_start",
        "pairs": 30,
        "truncated": int((total > 160).sum()),
        "dropped": 30 - len(processed),
    }
    assert expected["truncated"] > 0 and expected["dropped"] == 2

    out = tmp_path / "run"
    train_dpo.main(["--config", str(recipe), "--output_dir", str(out), "--max_steps", "2"])
    run_lines = capsys.readouterr().out
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["derived"]["batching"]["max_length_cuts"] == expected
    line = f"Cut at {cuts.line(expected)}"
    assert line in run_lines.splitlines()
    assert (
        f"| pairs cut / dropped at max_length | {expected['truncated']} / 2 of 30 |" in (out / "README.md").read_text()
    )

    # The analyzer, on the same recipe: the same line, and the same counts in its report.
    assert analyzer.main(["--config", str(recipe), "--num-proc", "1", "--json", str(tmp_path / "r.json")]) == 0
    assert line in capsys.readouterr().err.splitlines()
    candidate = json.loads((tmp_path / "r.json").read_text())["candidates"]["160"]
    assert (candidate["truncated"], candidate["dropped"]) == (expected["truncated"], 2)


def test_a_max_length_that_drops_every_pair_is_one_line(tmp_path, capsys):
    """Refused from the lengths the run decides its forward from (its tokenizer only: before the model loads)."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(["--config", str(SMOKE), "--output_dir", str(out), "--max_length", "8"]))
    printed = capsys.readouterr()
    assert ended.value.code == 2 and "Traceback" not in printed.out + printed.err
    line = printed.err.strip().splitlines()[-1]
    assert line.startswith("error: max_length 8 leaves 0 of 384 pairs (0.0%) anything to learn"), line
    assert "384 dropped (the prompt alone fills max_length; the shortest prompt is" in line
    assert not out.exists()  # nothing written: no model loaded, no trainer made the output folder


def useless_rows() -> list[dict]:
    """Text pairs that a max_length of 30 leaves nothing to learn from: three in four have a prompt longer than 30
    tokens (dropped), the rest a short prompt and two answers that share their first ~28 tokens (cut to the same
    tokens)."""
    shared = " The answer, worked out step by step with care and attention to detail, is"
    out = []
    for i in range(64):
        words = " ".join(("alpha", "beta", "gamma", "delta")[(i * k) % 4] for k in range(40))
        prompt = f"Q{i}: add." if i % 4 == 0 else f"Question {i}: {words}"
        out.append({"prompt": prompt, "chosen": f"{shared} {i + 1}.", "rejected": f"{shared} {i + 7}."})
    return out


@pytest.mark.parametrize("mode", ["run", "dry run", "analyzed"])
def test_a_max_length_that_leaves_no_pair_anything_to_teach_is_refused(mode, analyzer, tmp_path, capsys):
    """Issue 53 item 6: dropped pairs and pairs cut until both sides are the same tokens teach nothing (the run trained
    at ln 2 with a gradient norm of ~1e-6 and exited 0). Refused before the model loads, naming max_length, the share
    and what to pass; the dry run says it too, from the run's sample or from the analyzer's cached lengths."""
    path = write_jsonl(tmp_path / "pairs.jsonl", useless_rows())
    out = tmp_path / "run"
    argv = ["--config", str(SMOKE), "--dataset_name", str(path), "--output_dir", str(out), "--max_length", "30"]
    dry_run = [] if mode == "run" else ["--dry-run"]
    if mode == "analyzed":  # the analyzer's cache of every pair, shared starts included
        assert analyzer.main(["--config", str(SMOKE), "--dataset_name", str(path), "--num-proc", "1"]) == 0
        capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, "--max_tokens_per_microbatch", "64", *dry_run]))
    printed = capsys.readouterr()
    assert ended.value.code == 2 and "Traceback" not in printed.out + printed.err
    line = printed.err.strip().splitlines()[-1]
    assert line.startswith("error: max_length 30 leaves 0 of 64 pairs (0.0%) anything to learn"), line
    assert "48 dropped" in line and "16 cut until chosen and rejected are the same tokens" in line
    assert "--max_length 512" in line and "auto" in line
    assert ("the analyzer's cached lengths" in line) == (mode == "analyzed")
    assert not out.exists()  # nothing written: no model loaded


@pytest.mark.parametrize("mode", ["run", "analyzed"])
def test_a_keep_end_max_length_that_cuts_every_pair_to_the_same_end_is_refused(mode, analyzer, tmp_path, capsys):
    """keep_end keeps each sequence's end: pairs whose answers differ only in their first words, cut inside the end
    both share, are the same tokens on both sides. The run trained every pair at ln 2 with a gradient norm of 0 and
    exited 0, where keep_start's shared starts were refused; refused alike before the model loads, from the run's
    sample or the analyzer's cached lengths."""
    shared = " is the answer, worked out step by step with care and attention to detail."
    rows = [
        {"prompt": f"Q{i}: add.", "chosen": f" {i + 1}{shared}", "rejected": f" {i + 7}{shared}"} for i in range(64)
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "run"
    argv = ["--config", str(SMOKE), "--dataset_name", str(path), "--output_dir", str(out), "--max_length", "12"]
    argv += ["--truncation_mode", "keep_end"]
    if mode == "analyzed":
        assert analyzer.main(["--config", str(SMOKE), "--dataset_name", str(path), "--num-proc", "1"]) == 0
        capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    printed = capsys.readouterr()
    assert ended.value.code == 2 and "Traceback" not in printed.out + printed.err
    line = printed.err.strip().splitlines()[-1]
    assert line.startswith("error: max_length 12 leaves 0 of 64 pairs (0.0%) anything to learn"), line
    assert "0 dropped" in line and "64 cut until chosen and rejected are the same tokens" in line
    assert ("the analyzer's cached lengths" in line) == (mode == "analyzed")
    assert not out.exists()  # nothing written: no model loaded


@pytest.mark.parametrize("long", [3, 7])
def test_the_length_a_refusal_advises_is_within_the_models_positions(long, tmp_path, tiny_model_dir, capsys):
    """Pairs with prompts past the model's 4,096 positions: refused at a max_length too short, the line advised the
    length that leaves 95% whole or `auto`, both refused in turn (past the positions; capped, the same cut).
    It advises the model's positions where they keep half of the pairs, else says that no length does."""
    pairs = conversations(10)
    for pair in pairs[:long]:
        prompt = " ".join(f"w{i}" for i in range(5000))  # in the prompt, the same on both sides
        for side in ("chosen", "rejected"):
            pair[side][0]["content"] = prompt
    path = write_jsonl(tmp_path / "long_prompts.jsonl", pairs)
    argv = ["--config", str(SMOKE), "--model_name_or_path", tiny_model_dir, "--dataset_name", path]
    argv += ["--output_dir", str(tmp_path / "run"), "--pairs_per_step", "2", "--max_length", "20", "--dry-run"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    printed = capsys.readouterr()
    assert ended.value.code == 2 and "Traceback" not in printed.out + printed.err
    line = printed.err.strip().splitlines()[-1]
    assert line.startswith("error: max_length 20 leaves 0 of 10 pairs (0.0%) anything to learn"), line
    advice = line.split("must keep a difference: ")[1]
    assert "auto" not in advice and "the smallest multiple" not in advice, line
    if long == 3:
        assert re.fullmatch(  # with the budget the smoke recipe's 2,048 tokens cannot give it
            r"pass --max_length 4096 --max_tokens_per_microbatch 8192 \(the model's positions: [0-9,]+ would reach "
            r"past them; a micro-batch holds 2 x max_length, and max_tokens_per_microbatch is 2048\)",
            advice,
        )
    else:
        assert "no max_length within the model's 4,096 positions does (7 of the pairs have a prompt" in line, line
    # Within the positions, the advice is as before.
    with pytest.raises(ConfigError, match=r"pass --max_length 5120 .* or --max_length auto"):
        cuts.check([10, 5000, 5000], [10] * 3, [10] * 3, None, 20, "keep_start", "three pairs", max_positions=8192)


@pytest.mark.parametrize("max_positions", [None, 4096], ids=["the analyzer's length", "the model's positions"])
def test_the_max_length_a_warning_advises_is_taken_as_written(max_positions, tmp_path):
    """A newcomer's hunt: the warning for pairs cut at max_length advised `pass --max_length 4,096` (or `5,120`), and
    that flag, copied, was refused: `--max_length takes a whole number or auto ... not '4,096'`."""
    line = cuts.warning([3000] * 10, [2000] * 10, [2000] * 10, 1024, "keep_start", "ten pairs", max_positions)
    flag = re.search(r"pass (--max_length \S+)", line).group(1)
    assert flag == f"--max_length {max_positions or 5120}", line
    recipe = parse_args(["--config", str(SMOKE), "--output_dir", str(tmp_path / "run"), *flag.split()])
    assert recipe.training.max_length == (max_positions or 5120)


@pytest.mark.parametrize("max_positions", [None, 4096], ids=["the analyzer's length", "the model's positions"])
def test_the_length_a_warning_advises_comes_with_the_token_budget_it_needs(max_positions, tmp_path):
    """A hunt: on pairs of up to ~2,500 tokens the CPU demo's recipe (max_tokens_per_microbatch 2048) warned "pass
    --max_length 2560 ... or --max_length auto", and both, followed, were refused: "max_tokens_per_microbatch=2048
    must hold the longest possible pair, 2 x max_length (5120)". The advice now names the budget it needs, and the
    flags as printed pass the run's check; a budget that holds the length is not named."""
    from dpotrain import resolve

    smoke = ["--config", str(SMOKE), "--output_dir", str(tmp_path / "run")]
    budget = parse_args(smoke).project.max_tokens_per_microbatch
    line = cuts.warning([3000] * 10, [2000] * 10, [2000] * 10, 1024, "keep_start", "ten pairs", max_positions, budget)
    length = max_positions or 5120
    assert budget < 2 * length  # the recipe's budget cannot hold the advised length alone
    for flags in re.findall(r"pass (--max_length \S+(?: --max_tokens_per_microbatch \S+)?)", line) + re.findall(
        r" or (--max_length auto --max_tokens_per_microbatch \S+)", line
    ):
        recipe = parse_args([*smoke, *flags.split()])
        assert recipe.project.max_tokens_per_microbatch == 2 * length, (flags, line)
        resolve.check_token_budget(recipe.project.max_tokens_per_microbatch, recipe.training.max_length or length)
    assert line.count("--max_tokens_per_microbatch") == (1 if max_positions else 2), line
    roomy = cuts.warning([3000] * 10, [2000] * 10, [2000] * 10, 1024, "keep_start", "ten", max_positions, 2 * length)
    assert "--max_tokens_per_microbatch" not in roomy and "micro-batch" not in roomy, roomy


def test_the_recommendation_is_capped_at_the_models_positions(analyzer, tmp_path, tiny_model_dir, capsys):
    """One pair far longer than the model's 4,096 positions (the built-in model's max_position_embeddings) among a few:
    95% coverage would need its length; the analyzer recommends 4,096 and says why. A newcomer's hunt: its last line
    went on "8192 would cover ... for +...% packed compute", and its rationale offered "doubling to 8,192": a length the
    run refuses, past the model's positions. A longer length is offered only within them."""
    pairs = conversations(12)
    pairs[3]["chosen"][-1]["content"] = " ".join(f"w{i}" for i in range(9000))
    path = write_jsonl(tmp_path / "outlier.jsonl", pairs)
    argv = [path, "--tokenizer", "builtin:tiny-olmo3", "--num-proc", "1", "--json", str(tmp_path / "r.json")]
    assert analyzer.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["recommended_max_length"] == 4096
    assert report["recommendation"]["capped"]["uncapped"] > 4096
    assert "Capped at the model's 4,096 positions (max_position_embeddings)" in printed
    assert report["recommendation"]["doubled"] is None and "doubling to" not in printed, printed
    assert re.search(r"^Recommended max_length: 4096 \(covers [0-9.]+% of pairs; target 95\.0%\)$", printed, re.M)
    # `max_length: auto` resolves through the same rule.
    m = lengths.measure(data.load_preference_dataset(path), lengths.load_tokenizer(tiny_model_dir))
    assert lengths.recommendation(m, max_positions=4096)["max_length"] == 4096
    assert lengths.recommendation(m)["max_length"] > 4096
    # Below the positions, a doubling past them is offered as the positions themselves.
    answers = np.array([2400] * 19 + [9000])
    m = lengths.Measured(np.arange(20), np.full(20, 100), answers, answers - 50, [], True)
    r = lengths.recommendation(m, max_positions=4096)
    assert r["max_length"] == 2560 and r["doubled"]["max_length"] == 4096, r
    assert "raising it to 4,096 (the model's positions) would leave" in r["reason"], r["reason"]


@pytest.mark.slow
def test_a_cap_that_only_drops_recommends_the_length_that_trains_the_same(analyzer, tmp_path, tiny_model_dir, capsys):
    """Three of forty prompts past the model's 4,096 positions, dropped at any length it takes: the recommendation was
    the positions, 4,096, where 512 trains the same tokens, and under `max_length: auto` the smoke recipe's token
    budget (2,048) then refused the run it had chosen for. Now both take the smallest multiple of 512 that keeps the
    other pairs whole; an outlier that is cut, not dropped, keeps 4,096 (the test above)."""
    pairs = conversations(40)
    for pair in pairs[:3]:
        prompt = " ".join(f"w{i}" for i in range(5000))
        for side in ("chosen", "rejected"):
            pair[side][0]["content"] = prompt
    path = write_jsonl(tmp_path / "some_long_prompts.jsonl", pairs)
    report = tmp_path / "r.json"
    assert analyzer.main([path, "--tokenizer", tiny_model_dir, "--num-proc", "1", "--json", str(report)]) == 0
    r = json.loads(report.read_text())["recommendation"]
    assert (r["max_length"], r["coverage"], r["dropped"], r["capped"]["max_position_embeddings"]) == (
        512,
        0.925,
        3,
        4096,
    )
    assert "; 512 trains the same tokens: it leaves the same pairs whole (92.5%)" in capsys.readouterr().out
    argv = ["--config", str(SMOKE), "--model_name_or_path", tiny_model_dir, "--dataset_name", path]
    argv += ["--output_dir", str(tmp_path / "run"), "--max_length", "auto", "--dry-run"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    printed = capsys.readouterr()
    assert ended.value.code in (0, None), printed.err  # sys.exit(None): the dry run planned
    line = next(x for x in printed.out.splitlines() if x.strip().startswith("max length:"))
    assert re.search(r"max length: +512 \(max_length: auto, 92\.5% of the pairs whole", line), line
    # A budget too small for auto's choice: the line says what auto chose, which the command line does not show.
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, "--max_tokens_per_microbatch", "1000"]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and line.startswith(
        "error: max_length: auto chose 512 (92.5% of the pairs whole, target 95%), and max_tokens_per_microbatch=1000"
    ), line
    assert line.endswith("pass --max_tokens_per_microbatch 1024 (or more), or --max_length 500 (or less)"), line


@pytest.mark.slow
def test_pairs_whose_prompts_all_fill_the_models_positions_are_refused_in_one_line(
    analyzer, tmp_path, tiny_model_dir, capsys
):
    """Every prompt longer than the model's 4,096 positions: the capped recommendation keeps no pair, and comparing
    the other lengths' compute with its none divided by zero (a ZeroDivisionError traceback from the analyzer and
    from a `max_length: auto` run). One line instead, from both, naming the prompts and the fix."""
    pairs = conversations(6)
    for pair in pairs:
        long = " ".join(f"w{i}" for i in range(5000))
        for side in ("chosen", "rejected"):
            pair[side][0]["content"] = long  # the first message: in the prompt, the same on both sides
    path = write_jsonl(tmp_path / "long_prompts.jsonl", pairs)
    line = analyzer_error(analyzer, capsys, path, "--tokenizer", tiny_model_dir)
    expected = "error: every one of the 6 pairs measured has a prompt that alone fills the model's 4,096 positions"
    assert line.startswith(expected) and "shorten the prompts" in line, line
    argv = ["--config", str(SMOKE), "--model_name_or_path", tiny_model_dir, "--dataset_name", path]
    argv += ["--output_dir", str(tmp_path / "run"), "--pairs_per_step", "2", "--max_length", "auto"]
    argv += ["--max_tokens_per_microbatch", "8192"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, "--dry-run"]))
    printed = capsys.readouterr()
    assert ended.value.code == 2 and "Traceback" not in printed.out + printed.err
    assert printed.err.strip().splitlines()[-1].startswith(expected), printed.err


def test_a_capped_recommendation_training_would_refuse_is_refused_by_the_analyzer_too(
    analyzer, tmp_path, tiny_model_dir, capsys
):
    """Four of six prompts longer than the model's 4,096 positions: the capped recommendation (4,096) keeps two pairs,
    fewer than the half training asks for, so a run at it is refused. The analyzer recommended it all the same; it
    now says what training would say, naming what to do."""
    pairs = conversations(6)
    for pair in pairs[:4]:
        long = " ".join(f"w{i}" for i in range(5000))
        for side in ("chosen", "rejected"):
            pair[side][0]["content"] = long
    path = write_jsonl(tmp_path / "mostly_long_prompts.jsonl", pairs)
    line = analyzer_error(analyzer, capsys, path, "--tokenizer", tiny_model_dir)
    assert line.startswith("error: max_length 4,096 leaves 2 of 6 pairs (33.3%) anything to learn"), line
    assert "no max_length within the model's 4,096 positions does (4 of the pairs" in line, line


def test_a_mixture_source_with_no_pair_in_the_sample_says_so(analyzer, tmp_path, capsys):
    """A one-row source among forty rows, sampled two: its lengths line read `p50 None, p95 None, max None`."""
    pairs = conversations(41)
    a, b = write_jsonl(tmp_path / "a.jsonl", pairs[:40]), write_jsonl(tmp_path / "b.jsonl", pairs[40:])
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        SMOKE.read_text().replace("dataset_name:", "# dataset_name:") + f"datasets:\n  - path: {a}\n  - path: {b}\n"
    )
    assert analyzer.main(["--config", str(recipe), "--sample", "2", "--num-proc", "1"]) == 0
    sources = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Source ")]
    assert len(sources) == 2 and "pair lengths p50 " in sources[0] and "None" not in "".join(sources), sources
    assert sources[1].endswith("pair lengths none measured"), sources


# --- recipes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("beta: 5.0\nlearning_rate: 1.0e-6\nbeta: 0.1\n", ":3: key 'beta' is given twice (first on line 1)"),
        ("beta: 5.0\nloss_type: [sigmoid_norm\nlearning_rate: 1.0e-6\n", ":3: not valid YAML"),
        ("beta: 5.0\n  learning_rate: 1.0e-6\n", ":2: not valid YAML (mapping values are not allowed here)"),
        ("betta: 5.0\n", ": unknown key 'betta' (did you mean 'beta'?)"),
        # a list as a key: the duplicate-key check's `key in seen` was a TypeError traceback
        ("beta: 5.0\n[loss_type]: sigmoid\n", ":2: not valid YAML (found unhashable key"),
    ],
    ids=["duplicate key", "unclosed list", "bad indentation", "misspelled key", "list as key"],
)
def test_a_bad_recipe_is_refused_alike_by_training_and_the_analyzer(
    text, expected, analyzer, tmp_path, tiny_model_dir, capsys
):
    recipe = tmp_path / "my.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as refused_by_training:
        parse_args(["--config", str(recipe)])
    assert f"{recipe}{expected}" in str(refused_by_training.value)
    line = analyzer_error(
        analyzer,
        capsys,
        str(ROOT / "data" / "smoke_prefs.jsonl"),
        "--config",
        str(recipe),
        "--tokenizer",
        tiny_model_dir,
    )
    assert line == f"error: {refused_by_training.value}"


def test_shipped_recipes_read_strictly():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert config.read_recipe(str(path))  # no key given twice, none misspelled


def test_a_recipes_merge_key_is_read_as_yaml_reads_it(tmp_path):
    """`<<: *source` (YAML's merge key) was 'not valid YAML': the strict reader took it for a key of its own. A key
    written beside it overrides the merged one; a key written twice is still refused."""
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        "bf16: false\n"
        "datasets:\n"
        "  - &source {path: data/a.jsonl, split: train, amount: 0.5}\n"
        "  - <<: *source\n"
        "    path: data/b.jsonl\n"
    )
    assert [json.loads(s) for s in parse_args(["--config", str(recipe)]).project.datasets] == [
        {"path": "data/a.jsonl", "split": "train", "amount": 0.5},
        {"path": "data/b.jsonl", "split": "train", "amount": 0.5},
    ]
    recipe.write_text("bf16: false\nmodel_init_kwargs:\n  <<: {revision: main}\n  revision: dev\n  revision: v2\n")
    with pytest.raises(ConfigError, match=":5: key 'revision' is given twice"):
        parse_args(["--config", str(recipe)])


# --- tracebacks that are now one line ---------------------------------------------------------------------------------


def invalid_utf8(tmp_path, kind: str) -> tuple[str, int]:
    """A data file with one Latin-1 byte on line 5, and that line's number."""
    plain = (
        conversations(12)
        if kind == "jsonl"
        else [{"prompt": f"Q{i}?", "chosen": " Oui.", "rejected": " Non."} for i in range(12)]
    )
    path = tmp_path / f"latin.{kind}"
    if kind == "jsonl":
        datasets.Dataset.from_list(plain).to_json(path)
    else:
        datasets.Dataset.from_list(plain).to_csv(path, index=False)
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4].replace(b"?", "\u00e9?".encode("latin-1"), 1)
    path.write_bytes(b"\n".join(lines))
    return str(path), 5


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_invalid_utf8_names_the_file_and_line(kind, analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch):
    path, line = invalid_utf8(tmp_path, kind)
    expected = f"{path}:{line}: not valid UTF-8 (byte 0xe9"
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", path)
    assert expected in analyzer_error(analyzer, capsys, path, "--tokenizer", tiny_model_dir)


def test_a_utf16_data_file_is_told_to_convert_from_utf16_not_latin1(tmp_path, monkeypatch, capsys):
    """A pairs file saved as UTF-16 (PowerShell 5's `>`, Notepad's "Unicode") was told to convert "from Latin-1:
    `iconv -f latin1 -t utf-8`", which turns it into UTF-8 holding a NUL beside every letter; without its byte-order
    mark it decodes as UTF-8 (a NUL is UTF-8) and was "not valid JSON (Expecting property name ...) at column 2"."""
    row = json.dumps({"prompt": "Q?", "chosen": " Oui.", "rejected": " Non."}) + "\n"
    for codec in ("utf-16", "utf-16-le"):  # with its byte-order mark, as those tools write it, and without
        path = tmp_path / f"{codec}.jsonl"
        path.write_bytes((row * 3).encode(codec))
        said = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
        assert f"{path}:1: not valid UTF-8 (it is UTF-16 text)" in said and "(from UTF-16: `iconv -f utf-16" in said
    path = tmp_path / "latin.jsonl"
    path.write_bytes(
        row.replace("Oui", "Oui \u00e9t\u00e9").encode("utf-8") + row.replace("Q?", "\u00e9?").encode("latin-1")
    )
    assert "(from Latin-1: `iconv -f latin1 -t utf-8`)" in data._invalid_utf8(path)


def test_a_data_file_named_for_another_format(analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch):
    jsonl = tmp_path / "pairs.parquet"
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", jsonl)
    expected = f"dataset file '{jsonl}' is named .parquet but holds json lines: rename it to 'pairs.jsonl'"
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(jsonl))
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(jsonl), "--dry-run")
    assert expected in analyzer_error(analyzer, capsys, str(jsonl), "--tokenizer", tiny_model_dir)
    parquet = tmp_path / "real.jsonl"
    datasets.Dataset.from_list(conversations(4)).to_parquet(parquet)
    assert "is named .jsonl but holds parquet: rename it to 'real.parquet'" in refused(
        tmp_path, monkeypatch, capsys, "--dataset_name", str(parquet)
    )


def test_a_parquet_file_cut_short_or_not_parquet_is_refused_naming_the_file(
    analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """A `.parquet` file cut short (a copy stopped midway: no footer) or holding neither Parquet nor JSON ended in
    `KeyError: None` (the suffix check looked up the name of a format it had not recognised), as a traceback in
    training and the dry run and as the analyzer's cause. Now one line names the file, what is wrong and the fix."""
    whole = tmp_path / "whole.parquet"
    datasets.Dataset.from_list(conversations(64)).to_parquet(whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    expected = f"dataset file '{cut}' is cut short: it begins as Parquet but lacks Parquet's end"
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(cut))
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(cut), "--dry-run")
    assert expected in analyzer_error(analyzer, capsys, str(cut), "--tokenizer", tiny_model_dir)
    assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(cut)).endswith(
        ": copy it again, or write it again (Dataset.to_parquet)"
    )
    # In a folder of shards, or a mixture source's data_files, the load failed naming pyarrow's "magic bytes not found
    # in footer" and no file
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(whole, shards / "a.parquet")
    shutil.copy(cut, shards / "b.parquet")
    in_folder = expected.replace(str(cut), str(shards / "b.parquet"))
    assert in_folder in refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(shards), "--dry-run")
    source = json.dumps({"path": "parquet", "data_files": str(shards / "*.parquet")})
    said = refused(tmp_path, monkeypatch, capsys, "--datasets", source, "--dry-run")
    assert said.startswith("error: mixture source parquet") and in_folder in said, said
    # The analyzer streams a folder lazily, past the load's checks: a traceback from inside datasets' iterator
    assert in_folder in analyzer_error(analyzer, capsys, str(shards), "--tokenizer", tiny_model_dir, "--streaming")
    text = tmp_path / "text.parquet"
    text.write_text("prompt,chosen,rejected\nQ?,Yes.,No.\n")
    said = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(text))
    assert said == (
        f"error: dataset file '{text}' is named .parquet but is not Parquet (nor JSON): write the pairs to it as "
        "Parquet (Dataset.to_parquet), or give it the suffix of the format it holds (.jsonl, .csv, ...)"
    )


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_a_compressed_data_file_cut_short_or_not_compressed_is_refused_naming_the_file(
    codec, analyzer, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """A `.jsonl.gz` (`.bz2`, `.xz`) cut short ended in `EOFError: Compressed file ended before the end-of-stream marker
    was reached`, and a plain `.jsonl` named `.jsonl.gz` in `gzip.BadGzipFile`: tracebacks naming no file, in training
    and the dry run. Now one line names the file, that it is cut short (copy it again) or not compressed so."""
    import bz2
    import gzip
    import lzma

    plain = (ROOT / "data" / "smoke_prefs.jsonl").read_bytes()
    packed = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[codec](plain)
    codec_name = {"gz": "gzip", "bz2": "bzip2", "xz": "xz"}[codec]
    for keep in (len(packed) // 2, 100):  # cut after rows were read, and within the first row
        cut = tmp_path / f"cut{keep}.jsonl.{codec}"
        cut.write_bytes(packed[:keep])
        expected = (
            f"error: dataset file '{cut}' is cut short: its {codec_name} stream stops before its end (a copy or a "
            "download stopped midway): copy it again"
        )
        assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(cut)) == expected
        assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(cut), "--dry-run") == expected
    assert expected in analyzer_error(analyzer, capsys, str(cut), "--tokenizer", tiny_model_dir)
    renamed = tmp_path / f"plain.jsonl.{codec}"
    renamed.write_bytes(plain)
    assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(renamed)) == (
        f"error: dataset file '{renamed}' is named .{codec} but is not {codec_name}-compressed (the suffix decides how "
        f"it is read): rename it to 'plain.jsonl' if it holds the pairs uncompressed, or compress it with {codec_name}"
    )


def test_a_data_path_holding_pattern_characters_is_read_as_named_or_refused(tmp_path, monkeypatch, capsys):
    """datasets reads a data file's path as a pattern: `pairs-[1].jsonl` (3 pairs) beside `pairs-1.jsonl` (5) trained
    the other file's 5, silently (its record named the first); `q?m/p.jsonl` read `qam/p.jsonl` beside it (8). A file
    is read as named; a folder of shards, whose path datasets joins its own patterns to, and `::` (fsspec's chaining)
    are refused before anything loads."""
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)

    def write(path, n: int, start: int = 0) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines[start : start + n]))
        return str(path)

    write(tmp_path / "pairs-1.jsonl", 5, start=10)
    write(tmp_path / "qam" / "p.jsonl", 5, start=10)
    for named in (write(tmp_path / "pairs-[1].jsonl", 3), write(tmp_path / "q?m" / "p.jsonl", 3)):
        read = data.load_preference_dataset(named, say=False)
        assert read["chosen"] == [json.loads(line)["chosen"] for line in lines[:3]], named
    for path in (
        write(tmp_path / "shards[1]" / "part-0.jsonl", 3).rsplit("/", 1)[0],
        write(tmp_path / "a::b.jsonl", 3),
    ):
        line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", path, "--dry-run")
        found = "[" if "[" in path else "::"
        assert f"holds {found!r}, which datasets reads as a pattern" in line and "rename it" in line, line


def test_a_glob_given_as_the_dataset_says_how_to_read_its_files(tmp_path, monkeypatch, capsys):
    """`--dataset_name 'shards/*.jsonl'` (datasets' `data_files` takes such patterns) was refused as a path that does
    not exist ("check the path"), while the files it names are there. The line says how to read them."""
    for part in ("a", "b"):
        (tmp_path / "shards" / part).mkdir(parents=True)
        write_jsonl(tmp_path / "shards" / part / "p.jsonl", conversations(4))
    pattern = str(tmp_path / "shards" / "*" / "p.jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", pattern, "--dry-run")
    assert f"dataset {pattern!r} is a pattern (it matches 2 files)" in line, line
    assert "data_files" in line and "path: json" in line, line
    missing = str(tmp_path / "none" / "*.jsonl")  # one that matches nothing is a path that does not exist
    assert "does not exist" in refused(tmp_path, monkeypatch, capsys, "--dataset_name", missing, "--dry-run")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_unknown_builtin_and_empty_model_folder(dry_run, tmp_path, monkeypatch, capsys):
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", "builtin:tiny-olmo", *dry_run)
    assert "unknown built-in model 'builtin:tiny-olmo': the built-in ones are builtin:tiny-olmo3" in line
    empty = tmp_path / "my-sft"
    empty.mkdir()
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(empty), *dry_run)
    assert f"model folder '{empty}' is empty" in line
    (empty / "notes.txt").write_text("weights to come")
    assert "holds no config.json" in refused(
        tmp_path, monkeypatch, capsys, "--model_name_or_path", str(empty), *dry_run
    )


def test_a_model_folder_without_its_weights_or_its_class_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A run refuses a folder holding a config and no weights, or a sharded index whose shards are not all there
    (before: from_pretrained's OSError traceback), before the model loads, after its first half (whose refusals, the
    memory plan's, come first as in a dry run); a dry run plans from the config alone (configs/models/ holds no
    weights), and refuses an index whose shards are not all there among its first checks, as the run does."""
    folder = tmp_path / "my sft"  # a space in the path, as a user's folder may have
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder))
    assert line == (
        f"error: model folder '{folder}' holds a config.json but no weights (model.safetensors, pytorch_model.bin "
        "or a sharded index): copy the weights save_pretrained wrote beside it, or give a Hub name like org/model"
    )
    options.check_model(str(folder))  # the dry run's check: a config is enough to plan
    adapter = tmp_path / "adapter"  # a LoRA adapter saved with its base's config: transformers looks for full weights
    shutil.copytree(folder, adapter)
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a LoRA adapter"):  # tests/test_refusals.py: a LoRA run's folder
        options.check_model(str(adapter))
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = {"metadata": {}, "weight_map": {f"w{i}": shard for i, shard in enumerate(shards)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / shards[0]).write_bytes(b"")
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder))
    assert line == (
        f"error: model folder '{folder}' lacks 2 of the 3 weight shards its model.safetensors.index.json lists "
        "(model-00002-of-00003.safetensors, ...): copy the missing shards into it"
    )
    # The dry run (launch.sh's, before a job's processes start) passed it: the run failed as the weights loaded
    assert refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder), "--dry-run") == line
    # A config written by config.save_pretrained alone names no class: TRL's load stopped in a TypeError
    (folder / "model.safetensors.index.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder))
    assert line == (
        f"error: model folder '{folder}' has a config.json that names no architectures, which TRL loads the model by: "
        'add "architectures": ["Olmo3ForCausalLM"] to it (model.save_pretrained writes it)'
    )


# --- inputs a researcher brings that the earlier rounds did not try (session 47): recipes, data files and model
# folders read as the user meant them, or refused in one line naming the fix before the model loads

SMOKE_DATA = ROOT / "data" / "smoke_prefs.jsonl"


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: builtin:tiny-olmo3\nbf16: false\nreport_to: [none]\n{text}")
    return str(path)


# --- recipes --------------------------------------------------------------------------------------------------------


def test_a_recipes_paths_read_home_and_variables_as_a_shell_does(tmp_path, monkeypatch):
    """`output_dir: $HOME/runs/a` in a recipe was taken as written: the run (its dry run too) made a folder named
    `$HOME` in the folder run in and wrote there, and `dataset_name: $DATA/pairs.jsonl` was said not to exist. The
    recipe's `env:` block reads `$VAR` as a shell does; its paths now do too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DATA", str(SMOKE_DATA.parent))
    parsed = parse_args(
        ["--config", recipe(tmp_path, "output_dir: $HOME/runs/a\ndataset_name: ${DATA}/smoke_prefs.jsonl\n")]
    )
    assert parsed.training.output_dir == str(tmp_path / "home" / "runs" / "a")
    assert parsed.script.dataset_name == str(SMOKE_DATA)
    assert not (tmp_path / "$HOME").exists()


def test_a_recipes_path_naming_a_variable_that_is_not_set_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCRATCH", raising=False)
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: $SCRATCH/runs/a\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    assert str(refused.value) == (
        f"{path}: output_dir '$SCRATCH/runs/a' names $SCRATCH, which is not set: export SCRATCH, or write the path out"
    )


@pytest.mark.parametrize(
    "written, read", [("outputs/run$5", "outputs/run$5"), ("cost$", "cost$"), ("a$-b/$$HOME", "a$-b/$HOME")]
)
def test_a_dollar_that_names_no_variable_is_read_as_written(written, read, tmp_path, monkeypatch):
    """One rule: `$NAME` and `${NAME}` are expanded, `$$` is a `$`, a `$` before anything else is itself. `$5` was
    refused as "names $5, which is not set", and `outputs/run$5` had trained in that folder before."""
    monkeypatch.chdir(tmp_path)
    parsed = parse_args(["--config", recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: {written}\n")])
    assert parsed.training.output_dir == read


@pytest.mark.parametrize(
    "written, says",
    [
        (
            "${SCRATCH:-/tmp}/runs/a",
            "holds ${SCRATCH:-/tmp}, which a recipe does not read (it reads ~, $NAME and ${NAME}; $$ is a $): write "
            "the path out",
        ),
        ("$EMPTY/runs/a", "names $EMPTY, which is set empty (the path would start at the root): give EMPTY a value, "),
        ("/scratch/$SLURM_JOB_ID", "names $SLURM_JOB_ID, which is set only inside a Slurm job: `RECIPE={path} sbatch "),
    ],
)
def test_a_variable_a_recipe_cannot_read_is_refused_saying_why(written, says, tmp_path, monkeypatch):
    """`${SCRATCH:-/tmp}` was refused as "names $SCRATCH, which is not set" with SCRATCH set; `$EMPTY/runs/a` (set
    empty) was `/runs/a`, a folder at the root; `$SLURM_JOB_ID` on a login node said to export it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    monkeypatch.setenv("EMPTY", "")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: {written}\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    assert str(refused.value).startswith(f"{path}: output_dir {written!r} {says.replace('{path}', path)}")


@pytest.mark.parametrize("mark", [run_record.RESOLVED, run_files.MANIFEST])
def test_a_run_in_the_folder_its_output_dir_named_as_written_is_not_left_behind(mark, tmp_path, monkeypatch):
    """`output_dir: $HOME/runs/a` wrote in `./$HOME/runs/a` until `$` was expanded: the same recipe then named an empty
    folder, and a requeue started again from step 0, the run's checkpoints left where they were, without a word."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    old = tmp_path / "$HOME" / "runs" / "a"
    old.mkdir(parents=True)
    (old / mark).write_text("{}")
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: $HOME/runs/a\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    assert str(refused.value) == (
        f"{path}: output_dir '$HOME/runs/a' is now read as a shell reads it, {tmp_path}/home/runs/a, but the folder "
        f"named as written, {old}, holds a run ({mark}): move that folder to {tmp_path}/home/runs/a to go on there, "
        "or pass --output_dir '$HOME/runs/a' to keep it where it is"
    )
    assert parse_args(["--config", path, "--output_dir", "$HOME/runs/a"]).training.output_dir == "$HOME/runs/a"


def test_a_run_left_in_the_homes_folder_named_as_written_is_not_left_behind(tmp_path, monkeypatch):
    """`output_dir: ~/runs/$RUN` wrote in the home's `runs/$RUN` before `$` was read (`~` was): the check of the folder
    named as written looked for `./~/runs/$RUN`, found nothing there, and the run started again in `runs/a`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUN", "a")
    old = tmp_path / "home" / "runs" / "$RUN"
    old.mkdir(parents=True)
    (old / run_record.RESOLVED).write_text("{}")
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: ~/runs/$RUN\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    assert f"but the folder named as written, {old}, holds a run (resolved_config.json)" in str(refused.value)


def test_the_env_blocks_values_are_read_as_its_paths_are(tmp_path, monkeypatch):
    """`env: {DATA: $SCRATCH/data}` kept `$SCRATCH` as written (only a name ending HOME, CACHE or DIR was expanded), and
    `dataset_name: $DATA/x.jsonl` was then refused as "SCRATCH is not set", which it was. Each value reads as `export
    DATA=$SCRATCH/data` would, with what the block set above it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCRATCH", str(SMOKE_DATA.parent.parent))
    for name in ("DATA", "PAIRS"):
        monkeypatch.delenv(name, raising=False)
    path = recipe(
        tmp_path,
        f"env:\n  DATA: $SCRATCH/{SMOKE_DATA.parent.name}\n  PAIRS: ${{DATA}}/{SMOKE_DATA.name}\n"
        "dataset_name: $PAIRS\n",
    )
    assert parse_args(["--config", path]).script.dataset_name == str(SMOKE_DATA)
    assert os.environ["DATA"] == str(SMOKE_DATA.parent)


def test_a_variable_the_command_line_passes_on_is_left_as_the_shell_left_it(tmp_path, monkeypatch):
    """A `$` on the command line was quoted there (the shell expands the others): the folder is the one named."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\n")
    parsed = parse_args(["--config", path, "--output_dir", "runs/$HOME"])
    assert parsed.training.output_dir == "runs/$HOME"
    assert os.environ["HOME"] == str(tmp_path / "home")


def test_a_recipe_value_saved_in_latin1_is_refused_and_a_comment_so_saved_is_not(tmp_path, monkeypatch):
    """A recipe saved in Latin-1 is read with U+FFFD for each byte that is not UTF-8: `run_name: café-dpo` named the
    run and its folder `caf\ufffd-dpo` without a word. A comment so written (`# réglé`) sets nothing and still reads."""
    monkeypatch.chdir(tmp_path)
    path = Path(recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\n"))
    path.write_bytes(path.read_bytes() + "# réglé pour le CPU\n".encode("latin-1"))
    assert parse_args(["--config", str(path)]).training.run_name == "recipe-dpo"
    path.write_bytes(path.read_bytes() + "run_name: café-dpo\n".encode("latin-1"))
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", str(path)])
    assert str(refused.value) == (
        f"{path}: run_name holds bytes that are not UTF-8 text (it would read 'caf\ufffd-dpo'): save the recipe as "
        "UTF-8"
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("beta: 5.0\n".encode("utf-16"), "UTF-16 text, not UTF-8: save the recipe as UTF-8"),
        ("beta: 5.0\n".encode("utf-16-le"), "UTF-16 text, not UTF-8: save the recipe as UTF-8"),
        (b"beta: 5\nrun_name: a\x07b\n", "line 2 holds a control character (#x7), which YAML does not read: remove it"),
    ],
    ids=["utf-16", "utf-16-no-mark", "control-character"],
)
def test_a_recipe_saved_as_utf16_or_holding_a_control_character_is_one_line(text, expected, tmp_path, monkeypatch):
    """A recipe saved as UTF-16 (PowerShell 5's `>`, Notepad's "Unicode"), or holding a control character (a NUL, a
    bell pasted from a terminal): PyYAML's ReaderError escaped as a traceback ("unacceptable character #x0000")."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "odd.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", str(path)])
    assert str(refused.value) == f"{path}: {expected}"


@pytest.mark.parametrize("line", ["dataset_config: no", "output_dir: yes", "run_name: off", "dataset_config: On"])
def test_a_name_yaml_reads_as_a_boolean_is_refused_naming_the_quotes(line, tmp_path, monkeypatch):
    """YAML 1.1 reads an unquoted yes, no, on or off as a boolean, which became the word 'true' or 'false': a data
    set's configuration `no` (Norwegian) was asked for as 'false', `output_dir: yes` trained into a folder named
    `true`, and the run said nothing of it. Quoted, the text is read as written."""
    monkeypatch.chdir(tmp_path)
    key, value = line.split(": ")
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\n{line}\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    boolean = "true" if value.lower() in ("yes", "on") else "false"
    assert str(refused.value) == (
        f"{path}: {key} takes text, and YAML reads its unquoted value as the boolean {boolean} (yes, no, on and off "
        f"too): quote it ({key}: '{value}')"
    )
    quoted = parse_args(["--config", recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\n{key}: '{value}'\n")])
    assert {**vars(quoted.script), **vars(quoted.training)}[key] == value


def test_a_slurm_jobs_engine_reads_home_in_the_recipes_accelerate_config(tmp_path, monkeypatch):
    """docs/running.md says a Slurm job reads `~` in accelerate_config; the job's engine (what launch.sh launches and
    checks with `-f`) took `~/zero3.yaml` as written, a file named `~` that is nowhere."""
    monkeypatch.delenv("ACCELERATE_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = recipe(tmp_path, "accelerate_config: ~/zero3.yaml\n")
    assert job.engine(path) == str(tmp_path / "home" / "zero3.yaml")
    assert job.engine(path, ["--accelerate_config=~/fsdp.yaml"]) == str(tmp_path / "home" / "fsdp.yaml")


@pytest.mark.parametrize(
    "lines, key",
    [
        ("dataset_mixer_list: [a.jsonl, '1.0']\ndataset_mixer_list_splits: [no]\n", "dataset_mixer_list_splits"),
        ("datasets:\n  - {path: json, data_files: a.jsonl, name: no}\n", "datasets"),
        ("datasets:\n  - {path: json, columns: [On], data_files: a.jsonl, name: no}\n", "datasets"),  # `On`: not
        ("datasets:\n  - {path: json, data_files: [a.jsonl, no], split: on}\n", "datasets"),  # the first, in order
    ],
)
def test_a_mixtures_name_yaml_reads_as_a_boolean_is_refused_quoting_it(lines, key, tmp_path, monkeypatch):
    """`dataset_mixer_list_splits: [no]` became the split 'false', a `datasets:` entry's `name: no` was recorded as
    `name: false`: refused as the fields' own are, quoting the word written."""
    monkeypatch.chdir(tmp_path)
    path = recipe(tmp_path, lines)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    assert str(refused.value) == (
        f"{path}: {key} takes text, and YAML reads its unquoted value as the boolean false (yes, no, on and off too): "
        "quote it ('no')"
    )


def test_a_mixture_entrys_boolean_split_is_refused_wherever_the_entry_comes_from():
    """A `datasets` entry's `split: false` (YAML's unquoted no, or JSON's on the command line) fell back to the default
    split without a word."""
    from dpotrain.data import mixture

    with pytest.raises(ConfigError) as refused:
        mixture._entry(json.dumps({"path": "a.jsonl", "split": False}), "train", "--datasets", "dataset_train_split")
    assert str(refused.value) == (
        "`--datasets:` entry 'a.jsonl': split is the boolean false, which YAML reads from an unquoted yes, no, on or "
        "off: quote it (split: 'no')"
    )


def test_a_mixtures_paths_read_variables_as_the_recipes_paths_do(tmp_path, monkeypatch):
    """`dataset_mixer_list: [$DATA/x.jsonl, '1.0']` and a `datasets:` entry's `data_files: $DATA/x.jsonl` were kept as
    written while `dataset_name: $DATA/x.jsonl` was expanded: docs/running.md says a recipe's paths."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA", str(SMOKE_DATA.parent))
    mixer = parse_args(["--config", recipe(tmp_path, f"dataset_mixer_list: [$DATA/{SMOKE_DATA.name}, '1.0']\n")])
    assert mixer.project.dataset_mixer_list == [str(SMOKE_DATA), "1.0"]
    entry = f"datasets:\n  - path: json\n    data_files: ${{DATA}}/{SMOKE_DATA.name}\n"
    trl = parse_args(["--config", recipe(tmp_path, entry)])
    assert [json.loads(e)["data_files"] for e in trl.project.datasets] == [str(SMOKE_DATA)]
    monkeypatch.delenv("DATA")
    path = recipe(tmp_path, entry)
    with pytest.raises(ConfigError, match=r"datasets '\$\{DATA\}/smoke_prefs.jsonl' names \$DATA, which is not set"):
        parse_args(["--config", path])


def test_the_prefetch_command_of_a_job_whose_output_dir_names_its_job_id_runs_on_the_login_node(
    tmp_path, monkeypatch, capsys
):
    """`output_dir: /scratch/u/$SLURM_JOB_ID`: the prefetch command an offline job prints, run on the login node (no
    SLURM_JOB_ID there), stopped on "SLURM_JOB_ID is not set" and fetched nothing. It names the job's own folder."""
    import importlib.util
    import shlex

    from dpotrain.cluster import offline

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: {tmp_path}/$SLURM_JOB_ID\n")
    command = offline.prefetch_command(parse_args(["--config", path, "--dry-run"]))
    assert command.endswith(f"prefetch.py --config {path} --output_dir {tmp_path}/4242"), command
    monkeypatch.delenv("SLURM_JOB_ID")  # the login node
    spec = importlib.util.spec_from_file_location("prefetch", ROOT / "scripts" / "prefetch.py")
    prefetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefetch)
    words = shlex.split(command)  # after the caches' variables and `python scripts/prefetch.py`
    prefetch.main(words[words.index("--config") :])
    assert capsys.readouterr().out.startswith("Nothing to fetch: builtin:tiny-olmo3 and ")


def prefetch_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefetch", ROOT / "scripts" / "prefetch.py")
    prefetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefetch)
    return prefetch


@pytest.mark.parametrize("written", ["runs/${SLURM_JOB_ID}", "{tmp_path}/scratch/$SLURM_JOB_ID"])
def test_a_dry_run_on_a_login_node_plans_an_output_dir_naming_the_job_id_as_the_jobs_new_folder(
    written, tmp_path, monkeypatch, capsys
):
    """`output_dir: /scratch/runs/$SLURM_JOB_ID`, a folder per job: outside a job every planning command (the dry
    run, the analyzer, prefetch.py) refused it, prefetch.py saying to prefetch with an sbatch dry run, in the job that
    cannot fetch. It is the job's own folder, new: planned so, its record written beside no folder named after no job.
    In a job, the folder is the job's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    written = written.replace("{tmp_path}", str(tmp_path))
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: {written}\nmax_length: 1024\n")
    train_dpo.main(["--config", path, "--dry-run"])
    out = capsys.readouterr().out
    assert f"\n  output:        {written}{run_record.JOB_FOLDER}\n" in out, out
    assert "\n  everything:    not written, the job's folder being unknown before the job (--json prints it)" in out
    assert sorted(tmp_path.rglob("*.dry-run.json")) == [] and not (tmp_path / "runs").exists()
    train_dpo.main(["--config", path, "--dry-run", "--json"])
    printed = capsys.readouterr().out
    record = json.loads(printed[printed.index("{\n") :])
    assert record["output_dir"] == written
    assert record["derived"]["output_folder"] == f"{written}{run_record.JOB_FOLDER}"
    assert sorted(tmp_path.rglob("*.dry-run.json")) == []

    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # in the job: the folder it names
    in_job = written.replace("${SLURM_JOB_ID}", "4242").replace("$SLURM_JOB_ID", "4242")
    assert parse_args(["--config", path, "--dry-run"]).training.output_dir == in_job
    train_dpo.main(["--config", path, "--dry-run"])
    out = capsys.readouterr().out
    assert f"\n  output:        {in_job}: the run starts there (new)\n" in out, out
    assert (tmp_path / f"{in_job}.dry-run.json").is_file()


def test_an_output_dir_under_an_env_variable_the_job_sets_is_the_jobs_new_folder_outside_the_job(
    tmp_path, monkeypatch, capsys
):
    """`env: {SCR: /scratch/$SLURM_JOB_ID}` and `output_dir: $SCR/run`: the block leaves SCR to the job, and every
    planning command on a login node (the dry run, prefetch.py) refused the output_dir as naming $SCR, "not set", the
    recipe that the job runs as written. It is the job's own new folder, as `output_dir: /scratch/$SLURM_JOB_ID/run`
    is; another variable not set is refused all the same. In the job, the folder it names."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SCR", raising=False)
    monkeypatch.delenv("NOPE", raising=False)
    block = f"env:\n  SCR: {tmp_path}/scratch/$SLURM_JOB_ID\ndataset_name: {SMOKE_DATA}\nmax_length: 1024\n"
    path = recipe(tmp_path, f"{block}output_dir: $SCR/run\n")
    train_dpo.main(["--config", path, "--dry-run"])
    out = capsys.readouterr().out
    assert f"\n  output:        $SCR/run{run_record.JOB_FOLDER}\n" in out, out
    assert sorted(tmp_path.rglob("*.dry-run.json")) == [] and not (tmp_path / "scratch").exists()
    prefetch_script().main(["--config", path])
    assert capsys.readouterr().out.splitlines()[0] == (
        "The job's own folder, $SCR/run, is new (Slurm names it as the job starts): fetching as for a new run"
    )
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # in the job: the folder it names
    assert parse_args(["--config", path, "--dry-run"]).training.output_dir == f"{tmp_path}/scratch/4242/run"
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(ConfigError, match=r"output_dir '\$SCR/\$NOPE' names \$NOPE, which is not set"):
        parse_args(["--config", recipe(tmp_path, f"{block}output_dir: $SCR/$NOPE\n"), "--dry-run"])


def test_prefetch_on_a_login_node_fetches_for_the_new_folder_an_output_dir_naming_the_job_id_is(
    tmp_path, monkeypatch, capsys
):
    """prefetch.py runs on the login node, before the job: an output_dir naming $SLURM_JOB_ID was refused there,
    saying to run an sbatch dry run, in a job whose nodes cannot fetch. It fetches as for a new folder, the job's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: {tmp_path}/runs/$SLURM_JOB_ID\n")
    prefetch_script().main(["--config", path])
    assert capsys.readouterr().out.splitlines() == [
        f"The job's own folder, {tmp_path}/runs/$SLURM_JOB_ID, is new (Slurm names it as the job starts): fetching "
        "as for a new run",
        f"Nothing to fetch: builtin:tiny-olmo3 and {SMOKE_DATA} are local.",
    ]
    assert not (tmp_path / "runs").exists()


def test_the_analyzer_on_a_login_node_reads_a_recipe_whose_output_dir_names_the_job_id(
    analyzer, tmp_path, monkeypatch, capsys
):
    """The analyzer reads no output folder: a recipe with `output_dir: /scratch/runs/$SLURM_JOB_ID` was refused on the
    login node, where the data is analyzed before the job."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\noutput_dir: {tmp_path}/runs/$SLURM_JOB_ID\n")
    out = tmp_path / "report.json"
    assert analyzer.main(["--config", path, "--num-proc", "1", "--json", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "field, fix",
    [
        ("dataset_name", "pass the path the job reads as --dataset_name here, or write the path out"),
        ("chat_template_path", "pass the path the job reads as --chat_template_path here, or write the path out"),
        ("sample_prompts_file", "write the path out"),  # read by the run alone: no flag of the analyzer's
    ],
)
def test_the_analyzer_on_a_login_node_refuses_a_path_naming_the_job_id_with_its_own_fix(
    field, fix, analyzer, tmp_path, monkeypatch, capsys
):
    """A data path naming $SLURM_JOB_ID: the analyzer, run before the job, said to plan it with an `sbatch` dry run,
    which runs in the job and analyzes nothing. It names its own flag, as prefetch.py does."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    written = f"/scratch/$SLURM_JOB_ID/{field}.txt"
    fields = {"dataset_name": SMOKE_DATA} | {field: written}
    path = recipe(tmp_path, "".join(f"{name}: {value}\n" for name, value in fields.items()))
    assert analyzer.main(["--config", path, "--num-proc", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {path}: {field} {written!r} names $SLURM_JOB_ID, which is set only inside a Slurm job, and the "
        f"analyzer reads the recipe before the job: {fix}"
    )


@pytest.mark.parametrize(
    "field, written, says",
    [
        ("output_dir", "/scratch/$SLURM_JOB_ID/$NOPE", "names $NOPE, which is not set: export NOPE, or write the path"),
        ("output_dir", "/scratch/${SLURM_JOB_ID:-x}", "holds ${SLURM_JOB_ID:-x}, which a recipe does not read"),
        (
            "dataset_name",
            "/data/$SLURM_JOB_ID/pairs.jsonl",
            "names $SLURM_JOB_ID, which is set only inside a Slurm job, and prefetch.py fetches before the job: pass "
            "the path the job reads as --dataset_name here, or write the path out",
        ),
    ],
)
def test_prefetch_on_a_login_node_still_refuses_what_it_cannot_read_of_a_recipe_naming_the_job_id(
    field, written, says, tmp_path, monkeypatch
):
    """The job's folder is left to the job; the rest of output_dir is checked (a variable not set here is refused by
    name), and a path the job reads naming $SLURM_JOB_ID is refused: what prefetch.py fetches must be known. Its fix is
    no sbatch dry run, which runs in the job, after the fetch it was to prepare."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("NOPE", raising=False)
    fields = {"dataset_name": SMOKE_DATA} | {field: written}  # dataset_name's line replaced where it is the field
    path = recipe(tmp_path, "".join(f"{name}: {value}\n" for name, value in fields.items()))
    with pytest.raises(ConfigError) as refused:
        prefetch_script().main(["--config", path])
    assert str(refused.value).startswith(f"{path}: {field} {written!r} {says}"), refused.value
    assert "sbatch" not in str(refused.value)


# --- data -----------------------------------------------------------------------------------------------------------


def pair(user: dict, other_user: dict) -> dict:
    return {
        "chosen": [user, {"role": "assistant", "content": "Blue."}],
        "rejected": [other_user, {"role": "assistant", "content": "Seven."}],
    }


LONG = "What is 51 plus 99? Then tell me something about forests and the rivers in them."


@pytest.mark.parametrize(
    "other, says",
    [
        (
            {"role": "user", "content": LONG.replace("rivers", "lakes")},
            "message 0 (user): '...s and the rivers in them.' in chosen, '...s and the lakes in them.' here (they "
            "part at character 65)",
        ),
        (
            {"role": "user", "content": LONG, "name": "alice"},
            "message 0 (user): the same content, but name absent in chosen, 'alice' here",
        ),
    ],
)
def test_prompts_that_part_past_the_quoted_start_or_beside_the_text_are_shown_where_they_differ(other, says):
    """A pair whose prompts differ was refused quoting both user turns from their start, 40 characters: two long turns
    that part later (a word changed deep in the prompt), or the same text with a field beside it on one side (a
    `name`), read `'What is 51 plus 99? Then tell me some...' in chosen, 'What is 51 plus 99? Then tell me some...'
    here`, the same twice, and the user was left to find the difference."""
    user = {"role": "user", "content": LONG}
    with pytest.raises(rows.InvalidRowError) as refused:
        rows.check_dataset(datasets.Dataset.from_list([pair(user, user), pair(user, other)]))
    assert says in str(refused.value)


def test_prompts_whose_content_differs_only_in_type_are_shown_differing():
    """Content `1` on one side and `"1"` on the other read "the same content, but content '1' in chosen, '1' here":
    both shown as text. A value that is no text is shown as Python writes it."""
    said = shapes._first_difference([{"role": "user", "content": 1}], [{"role": "user", "content": "1"}])
    assert said == "message 0 (user): the same content, but content 1 in chosen, '1' here"


def test_a_field_on_one_side_alone_or_long_is_shown_as_it_differs():
    """`name: null` in chosen and no `name` here read "the same content, but content 'Hi' in chosen, 'Hi' here" (the
    key was looked up as None on both sides); a long value beside the text (a list of tool calls) was quoted whole."""
    said = shapes._first_difference(
        [{"role": "user", "content": "Hi", "name": None}], [{"role": "user", "content": "Hi"}]
    )
    assert said == "message 0 (user): the same content, but name none in chosen, absent here"
    calls = [{"id": f"call-{i}", "name": "lookup"} for i in range(100)]
    said = shapes._first_difference(
        [{"role": "user", "content": "Hi", "tool_calls": calls}], [{"role": "user", "content": "Hi", "tool_calls": []}]
    )
    assert said == f"message 0 (user): the same content, but tool_calls {repr(calls)[:37]}... in chosen, [] here"
    other = [*calls[:4], {"id": "call-4", "name": "search"}, *calls[5:]]
    said = shapes._first_difference(
        [{"role": "user", "content": "Hi", "tool_calls": calls}],
        [{"role": "user", "content": "Hi", "tool_calls": other}],
    )
    at = next(i for i, (a, b) in enumerate(zip(repr(calls), repr(other), strict=False)) if a != b)
    assert said == (
        f"message 0 (user): the same content, but tool_calls ... 'name': 'lookup'}}, {{'id': 'call-5... in chosen, "
        f"... 'name': 'search'}}, {{'id': 'call-5... here (they part at character {at})"
    )


# --- model folders --------------------------------------------------------------------------------------------------


def test_a_model_folders_blank_chat_template_is_said_to_be_none(tmp_path, tiny_model_dir):
    """A model folder whose chat_template.jinja holds only white space (written and left blank, or cut short) rendered
    every pair as nothing, and the run refused every row as 'identical to `rejected` as the chat template renders them:
    the template writes no string content (it reads text parts only, as SmolVLM's and Idefics3's do)', a template of
    text parts it never had. It is no template: refused as the model folder without one, before the model loads."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text("  \n")
    tokenizer = lengths.load_tokenizer(str(model))
    with pytest.raises(ConfigError) as refused:
        rows.check_dataset(data.load_preference_dataset(str(SMOKE_DATA)), rows.RowRules(template=tokenizer))
    assert str(refused.value).startswith(f"the tokenizer of {model} has no chat template, and the data set's rows are")


@pytest.mark.parametrize("name, renamed", [("PAIRS.JSONL", "PAIRS.jsonl"), ("Pairs.Jsonl.GZ", "Pairs.jsonl.gz")])
def test_a_data_file_with_an_upper_case_suffix_is_refused_naming_the_name_to_give(name, renamed, tmp_path):
    """`PAIRS.JSONL` (a Windows export) was refused as "use .jsonl, .json, .parquet, ...", which it seemed to be."""
    path = tmp_path / name
    shutil.copy(SMOKE_DATA, path)
    with pytest.raises(ConfigError) as refused:
        data.load_preference_dataset(str(path))
    assert str(refused.value) == (
        f"dataset file {str(path)!r}: a data file's suffix is read in lower case only (as datasets reads a folder's "
        f"files): rename it to {renamed!r}"
    )

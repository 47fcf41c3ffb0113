"""Issue #21: a user's data in the shapes public preference sets have (docs/data.md), read once for the analyzer and
the trainer (dpotrain/data/shapes.py, rows.usable_pairs).

Every data set here is generated (the built-in Dolci-shaped rows, rewritten into each shape) and written as a file
with the real `datasets` library. The trainer's lengths are TRL's own: `DPOTrainer._prepare_dataset` on the pairs
`rows.usable_pairs` hands it, exactly as train_dpo.py does.
"""

import json
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
from test_analyzer import trainer_dataset
from test_refusals import refused

import train_dpo
from conftest import ROOT, built, ready
from dpotrain.data import builtin, data, lengths, rows, shapes
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, run_cli

SMOKE = str(ROOT / "configs" / "smoke.yaml")
N = 24  # 3 optimizer steps of the smoke recipe's 8 pairs


# --- the shapes, generated --------------------------------------------------------------------------------------------


def dolci(n=N) -> list[dict]:
    """chosen/rejected message lists sharing the prompt: single-turn, with a system message, multi-turn."""
    return builtin.make_preference_rows(n, seed=5)


def first_user(messages) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


def ultrafeedback(n=N) -> list[dict]:
    """UltraFeedback-binarized: a string prompt repeating the first user turn, full conversations, extra columns."""
    return [
        {
            "prompt": first_user(r["chosen"]),
            "prompt_id": f"{i:08x}",
            **r,
            "messages": r["chosen"],
            "score_chosen": 8.5,
            "score_rejected": 3.0,
        }
        for i, r in enumerate(dolci(n))
    ]


def explicit_prompt(n=N) -> list[dict]:
    return [{"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:], "rejected": r["rejected"][-1:]} for r in dolci(n)]


def hh_string(messages) -> str:
    """Anthropic HH-RLHF's form (it has no system turns)."""
    names = {"user": "Human", "assistant": "Assistant"}
    return "".join(f"\n\n{names[m['role']]}: {m['content']}" for m in messages if m["role"] != "system")


def hh(n=N) -> list[dict]:
    return [{"chosen": hh_string(r["chosen"]), "rejected": hh_string(r["rejected"])} for r in dolci(n)]


def text(n=N) -> list[dict]:
    return [
        {
            "chosen": f"Question: {first_user(r['chosen'])}\nAnswer: {r['chosen'][-1]['content']}",
            "rejected": f"Question: {first_user(r['chosen'])}\nAnswer: {r['rejected'][-1]['content']}",
        }
        for r in dolci(n)
    ]


def text_prompt(n=N) -> list[dict]:
    out = []
    for r in text(n):
        cut = r["chosen"].index("Answer:") + len("Answer:")
        out.append({"prompt": r["chosen"][:cut], "chosen": r["chosen"][cut:], "rejected": r["rejected"][cut:]})
    return out


def text_instruction(n=N, column="instruction") -> list[dict]:
    """Text answers alone, their prompt in a column of another common name (Alpaca's `instruction`, Orca's
    `question`, ...), and a column no reading uses."""
    return [{column: r["prompt"], **{k: r[k] for k in ("chosen", "rejected")}, "source": "gen"} for r in text_prompt(n)]


def content_parts(n=N) -> list[dict]:
    """OpenAI's (and TRL's vision) way to write a message: its content a list of parts, here text parts only."""

    def parts(messages):
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]

    return [{"chosen": parts(r["chosen"]), "rejected": parts(r["rejected"])} for r in dolci(n)]


def write(tmp_path, name: str, make, kind: str) -> tuple[str, str]:
    """(dataset_name, split) of the rows `make()` written as `kind`, with `datasets` itself."""
    dataset = datasets.Dataset.from_list(make())
    if kind == "jsonl":
        dataset.to_json(tmp_path / f"{name}.jsonl")
        return str(tmp_path / f"{name}.jsonl"), "train"
    if kind == "json":  # one JSON array, as a list of records is often saved
        (tmp_path / f"{name}.json").write_text(json.dumps(make()))
        return str(tmp_path / f"{name}.json"), "train"
    if kind == "parquet":
        dataset.to_parquet(tmp_path / f"{name}.parquet")
        return str(tmp_path / f"{name}.parquet"), "train"
    if kind == "csv":
        dataset.to_csv(tmp_path / f"{name}.csv", index=False)
        return str(tmp_path / f"{name}.csv"), "train"
    if kind == "saved":
        dataset.save_to_disk(str(tmp_path / name))
        return str(tmp_path / name), "train"
    if kind == "saved_dict":  # named splits, as a DatasetDict saved with save_to_disk
        datasets.DatasetDict({"prefs": dataset, "held_out": dataset.select(range(8))}).save_to_disk(
            str(tmp_path / name)
        )
        return str(tmp_path / name), "prefs"
    raise ValueError(kind)


# name: (rows, file kind, hh_format, read as message lists)
SHAPES = {
    "dolci messages, jsonl": (dolci, "jsonl", "messages", True),
    "explicit prompt messages, parquet": (explicit_prompt, "parquet", "messages", True),
    "ultrafeedback-binarized, parquet": (ultrafeedback, "parquet", "messages", True),
    "hh-rlhf as messages, jsonl": (hh, "jsonl", "messages", True),
    "hh-rlhf as text, json": (hh, "json", "text", False),
    "standard text, json array": (text, "json", "messages", False),
    "standard text with prompt, csv": (text_prompt, "csv", "messages", False),
    "text with an instruction column, jsonl": (text_instruction, "jsonl", "messages", False),
    "messages, save_to_disk": (dolci, "saved", "messages", True),
    "messages with text content parts, jsonl": (content_parts, "jsonl", "messages", True),
    "messages, DatasetDict split": (dolci, "saved_dict", "messages", True),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return lengths.load_tokenizer(tiny_model_dir)


def read_pairs(name: str, split: str, hh_format: str, skip_invalid: bool = False, derived: dict | None = None):
    """The loaded data set, and the pairs train_dpo.py hands the trainer."""
    raw = data.load_preference_dataset(name, split)
    return raw, rows.usable_pairs(
        raw, rows.RowRules(skip_invalid, hh_format), {} if derived is None else derived, "invalid_rows"
    )


# --- one reading: the analyzer's lengths are the trainer's ------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_analyzer_lengths_equal_the_trainers(shape, tokenizer, tmp_path):
    make, kind, hh_format, conversational = SHAPES[shape]
    name, split = write(tmp_path, "d", make, kind)
    raw, pairs = read_pairs(name, split, hh_format)
    assert len(pairs) == N and sorted(pairs.column_names) == ["chosen", "prompt", "rejected"]  # extra columns left out
    processed = trainer_dataset(pairs, tokenizer, tmp_path)
    m = lengths.measure(raw, tokenizer, hh_format=hh_format, chunk_size=8)
    assert m.invalid == [] and m.fast_path_mismatches == 0 and m.conversational == conversational
    for key in ("prompt", "chosen", "rejected"):
        np.testing.assert_array_equal(getattr(m, key), [len(ids) for ids in processed[f"{key}_ids"]], err_msg=key)
    # Message lists go through the chat template (its <|im_start|> turns); text does not.
    prompt = tokenizer.decode(processed[0]["prompt_ids"])
    assert ("<|im_start|>user" in prompt) == conversational, prompt


def test_text_content_parts_train_as_the_same_messages_written_as_strings(tokenizer, tmp_path):
    """A message whose content is a list of text parts is its text: the same pairs, the same token ids."""
    _, parts = read_pairs(*write(tmp_path, "parts", content_parts, "parquet"), "messages")
    _, strings = read_pairs(*write(tmp_path, "strings", dolci, "parquet"), "messages")
    assert parts.to_list() == strings.to_list()


@pytest.mark.parametrize("kind", ["image", "image_url"])
def test_a_content_part_that_is_not_text_is_refused_naming_the_fix(kind, tmp_path, monkeypatch, capsys):
    pairs = content_parts()
    pairs[3]["chosen"][0]["content"].insert(0, {"type": kind, "text": None})
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(
        f"error: row 3, column 'chosen': message 0 has a {kind!r} part in its content, and dpotrain trains text only ("
    ), line
    assert "keep only its text parts" in line


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_compressed_file_reads_as_the_file_itself(kind, tokenizer, tmp_path):
    """`pairs.jsonl.gz` is what datasets (and so TRL's scripts) read through its codec, as a folder of such shards is
    read here; a CSV's cells stay the text written (`42`, not the int) through it."""
    import gzip

    make = {"jsonl": dolci, "csv": lambda: [{**r, "chosen": " 42"} for r in text_prompt()]}[kind]
    name, split = write(tmp_path, "d", make, kind)
    with open(name, "rb") as plain, gzip.open(f"{name}.gz", "wb") as packed:
        packed.write(plain.read())
    raw, pairs = read_pairs(f"{name}.gz", split, "messages")
    assert pairs.to_list() == read_pairs(name, split, "messages")[1].to_list() and len(pairs) == N
    assert lengths.measure(raw, tokenizer).rows == N  # the analyzer's reading


def test_a_string_prompt_beside_answers_alone_is_said_to_be_their_user_turn():
    """`{"prompt": "Hi?", "chosen": [assistant], "rejected": [assistant]}` is read with the string as the user turn, and
    the data line said the opposite: "a string prompt that repeats the first user turn (UltraFeedback-binarized): read
    without it"."""
    answer = [{"role": "assistant", "content": "Hello."}]
    columns = ("prompt", "chosen", "rejected")
    described = shapes.Shape.of({"prompt": "Hi?", "chosen": answer, "rejected": answer}, columns).describe()
    want = (
        "answers as message lists, with a string prompt: read as the user turn before them; the model's chat template"
    )
    assert described == want
    whole = [{"role": "user", "content": "Hi?"}, *answer]
    described = shapes.Shape.of({"prompt": "Hi?", "chosen": whole, "rejected": whole}, columns).describe()
    assert described.startswith("message lists with a string prompt that repeats the first user turn")


def test_a_folder_of_data_files_beside_a_dataset_info_json_is_read_as_its_files(tmp_path):
    """A folder of data files with a dataset_info.json (a cloned Hub data set's, or one copied from a save_to_disk
    folder) was taken for a save_to_disk folder, and ended in load_from_disk's traceback ("FileNotFoundError: Directory
    ... is neither a `Dataset` directory nor a `DatasetDict` directory"); datasets' load reads the files and leaves
    that file out, as it leaves out a config.json, which is then no data file left out of the `train` split either."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dolci()))
    (folder / "dataset_info.json").write_text(json.dumps({"description": "", "features": {}}))
    (folder / "config.json").write_text(json.dumps({"chosen": "not a pair"}))
    _, pairs = read_pairs(str(folder), "train", "messages")
    assert len(pairs) == N and pairs[0]["chosen"] == dolci()[0]["chosen"][-1:]


def test_an_arrow_file_is_read_as_the_folder_it_was_saved_in(tmp_path):
    """A split's `data-00000-of-00001.arrow` (what save_to_disk writes), or an Arrow IPC file, given as the data set was
    refused ("use .jsonl, .json, .parquet or .csv"), while a folder of such files was read: read now as that folder
    is (datasets' arrow builder); one without rows is refused as any empty file is."""
    import pyarrow as pa

    name, split = write(tmp_path, "saved", dolci, "saved")
    _, pairs = read_pairs(name, split, "messages")
    saved = next((tmp_path / "saved").glob("data-*.arrow"))
    assert read_pairs(str(saved), "train", "messages")[1].to_list() == pairs.to_list() and len(pairs) == N
    table = datasets.Dataset.from_list(dolci()).data.table
    with pa.ipc.new_file(str(tmp_path / "pairs.arrow"), table.schema) as ipc:  # the IPC file format (Feather v2)
        ipc.write_table(table)
    assert read_pairs(str(tmp_path / "pairs.arrow"), "train", "messages")[1].to_list() == pairs.to_list()
    with pa.ipc.new_stream(str(tmp_path / "empty.arrow"), table.schema) as ipc:
        ipc.write_table(table.slice(0, 0))
    with pytest.raises(ConfigError, match="empty.arrow' has no rows: it needs one pair per row"):
        data.load_preference_dataset(str(tmp_path / "empty.arrow"))


@pytest.mark.parametrize("suffix", [".ndjson", ".tsv"])
def test_ndjson_and_tsv_read_as_their_jsonl_and_csv_kin(suffix, tokenizer, tmp_path):
    """datasets reads `.ndjson` as JSON Lines and `.tsv` as CSV split at tabs, a folder of such shards here too; but a
    file of them was refused, and a folder's skipped the checks its kin get: beside one number, every answer that
    reads as JSON (`"0"`) came back a number, and every row was refused. Read as written now, bad rows located."""
    import csv

    pairs = [{"prompt": f"{i} + {i}?", "chosen": str(2 * i), "rejected": f"{2 * i + 1}.50"} for i in range(N)]
    pairs[5]["chosen"] = 'ten,\t"ten"\nor 10'  # a TSV cell spanning two lines: row 7 is on line 10
    pairs[7]["chosen"] = 14 if suffix == ".ndjson" else ""  # the one bad row: not text, or empty

    def write_file(path, part):
        with open(path, "w", newline="") as f:
            if suffix == ".ndjson":
                f.write("".join(json.dumps(p) + "\n" for p in part))
            else:
                writer = csv.DictWriter(f, ["prompt", "chosen", "rejected"], delimiter="\t")
                writer.writeheader()
                writer.writerows(part)

    (tmp_path / "shards").mkdir()
    write_file(tmp_path / f"pairs{suffix}", pairs)
    write_file(tmp_path / "shards" / f"a{suffix}", pairs[:12])
    write_file(tmp_path / "shards" / f"b{suffix}", pairs[12:])
    assert (
        data.row_location(str(tmp_path / f"pairs{suffix}"), 7)
        == f"line {8 if suffix == '.ndjson' else 10} of pairs{suffix}"
    )
    for name in (str(tmp_path / f"pairs{suffix}"), str(tmp_path / "shards")):
        derived = {}
        raw, read = read_pairs(name, "train", "messages", skip_invalid=True, derived=derived)
        assert read.to_list() == [p for i, p in enumerate(pairs) if i != 7], name
        assert derived["invalid_rows"]["dropped"] == 1 and derived["invalid_rows"]["first"][0]["index"] == 7, name
        assert [p["index"] for p in lengths.measure(raw, tokenizer, skip_invalid=True).invalid] == [7], (
            name
        )  # the analyzer's reading


def test_text_that_reads_as_json_stays_text_where_a_field_mixes_types(tmp_path):
    """datasets stores a field whose type differs between rows as JSON, and text that reads as JSON as it is: the
    answer `"0"` came back the int 0, refused (or with --skip_invalid dropped) as not text. Here a message's content
    is text in some rows and text parts in one; then a text column holds a number in one row."""
    pairs = [
        {**r, "chosen": [*r["chosen"][:-1], {"role": "assistant", "content": str(i)}]} for i, r in enumerate(dolci())
    ]
    pairs[5]["rejected"][-1]["content"] = [{"type": "text", "text": "null"}]
    path = tmp_path / "parts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    _, read = read_pairs(str(path), "train", "messages")
    assert [p["chosen"][-1]["content"] for p in read] == [str(i) for i in range(N)]
    assert read[5]["rejected"][-1]["content"] == "null"
    answers = [{"prompt": f"{i} + {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(N)]
    answers[7]["chosen"] = 14
    path = tmp_path / "numbers.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in answers))
    derived = {}
    _, read = read_pairs(str(path), "train", "messages", skip_invalid=True, derived=derived)
    assert len(read) == N - 1 and derived["invalid_rows"]["first"][0]["index"] == 7
    assert read[0] == {"prompt": "0 + 0?", "chosen": "0", "rejected": "1"}


def test_text_that_looks_like_a_date_stays_text(tmp_path):
    """Arrow's JSON reader types a field whose every value looks like a date (`"2024-07-26"`, `"1999-12-10 10:30:00"`)
    as a timestamp: a row's chat_template_kwargs `{"date_string": "2024-07-26"}` (docs/data.md: how to train with one
    date) reached the template as the integer 1721952000000, and answers that are dates were refused as not text."""
    pairs = [{**p, "chat_template_kwargs": {"date_string": "2024-07-26"}} for p in dolci()]
    path = tmp_path / "dated.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    _, read = read_pairs(str(path), "train", "messages")
    assert [p["chat_template_kwargs"] for p in read] == [{"date_string": "2024-07-26"}] * N
    answers = [
        {"prompt": f"When was {i}?", "chosen": f"20{i + 10}-01-02", "rejected": "1999-12-10 10:30:00"} for i in range(N)
    ]
    for name, text in (
        ("dates.jsonl", "".join(json.dumps(a) + "\n" for a in answers)),
        ("dates.json", json.dumps(answers)),
    ):
        (tmp_path / name).write_text(text)
        _, read = read_pairs(str(tmp_path / name), "train", "messages")
        assert [(p["chosen"], p["rejected"]) for p in read] == [(a["chosen"], a["rejected"]) for a in answers], name


def test_a_line_separator_inside_text_is_kept_where_a_field_mixes_types(tmp_path):
    """JSON keeps U+2028 and \\x85 unescaped inside a string (`json.dumps(ensure_ascii=False)` writes them so); the
    second reading of a field that mixes types split the file's lines there too, and ended in a JSONDecodeError
    traceback (the run, the dry run and the analyzer)."""
    pairs = dolci()
    for i, pair in enumerate(pairs):
        pair["chosen"][-1]["content"] = f"Line one\u2028line two\x85three {i}\x0c."
    pairs[5]["rejected"][-1]["content"] = [{"type": "text", "text": "parts"}]
    path = tmp_path / "separators.jsonl"
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\r\n" for p in pairs), encoding="utf-8")
    _, read = read_pairs(str(path), "train", "messages")
    assert [p["chosen"][-1]["content"] for p in read] == [f"Line one\u2028line two\x85three {i}\x0c." for i in range(N)]
    assert read[5]["rejected"][-1]["content"] == "parts"


def with_images(tmp_path, images) -> str:
    """TRL's vision shape (its `images` column), saved with save_to_disk: the analyzer and the run read it alike."""
    import PIL.Image

    pairs = [{"images": images(PIL.Image.new("RGB", (4, 4), "red")), **r} for r in explicit_prompt()]
    features = {**datasets.Dataset.from_list(explicit_prompt()).features, "images": datasets.List(datasets.Image())}
    dataset = datasets.Dataset.from_list(pairs, features=datasets.Features(features))
    dataset.save_to_disk(str(tmp_path / "vision"))
    return str(tmp_path / "vision")


def test_a_data_set_holding_images_is_refused_by_the_run_and_the_analyzer(
    cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """TRL trains such pairs only with a vision-language model; unread, the images' questions trained without them."""
    name = with_images(tmp_path, lambda image: [image])
    expected = "error: the data set holds images (column 'images', 24 of 24 rows), and dpotrain trains text only"
    assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", name).startswith(expected)
    assert cli.main([name, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)


@pytest.mark.parametrize("given", ["test split", "held-out mixture"])
def test_held_out_pairs_holding_images_are_refused_as_evaluated_on_not_trained(given, tmp_path, monkeypatch, capsys):
    """The refusal of held-out pairs holding images said "the text would be trained without the images": the run
    only evaluates on them. Said as what the run does with them, a saved data set's test split or a held-out mixture's
    source; the fix is the same."""
    vision = with_images(tmp_path, lambda image: [image])
    split = datasets.load_from_disk(vision)
    both = tmp_path / "both"
    datasets.DatasetDict({"train": split.remove_columns("images"), "test": split}).save_to_disk(str(both))
    held = ["--dataset_name", str(both)] if given == "test split" else ["--dataset_mixer_eval_list", vision, "1.0"]
    line = refused(tmp_path, monkeypatch, capsys, *held, "--eval_strategy", "steps", "--eval_steps", "2")
    assert "the model would be evaluated on the text without the images it speaks of" in line, line
    assert "trained" not in line, line


HELD_OUT_ROWS = {  # held-out rows refused for their shape, and what the refusal says
    "json text": (
        [
            {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go."},
            {"prompt": "Hi", "chosen": json.dumps([{"role": "assistant", "content": "Hi."}]), "rejected": "Go."},
        ],
        "it would be tokenized as JSON text",
    ),
    "user turn in an answer": (
        [
            {
                "prompt": [{"role": "user", "content": "Hi"}],
                "chosen": [
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "More"},
                    {"role": "assistant", "content": "Fine."},
                ],
                "rejected": [{"role": "assistant", "content": "Go."}],
            }
        ]
        * 2,
        "which TRL would take as part of the answer",
    ),
    "conversation waiting": (
        [{"chosen": "Hello.", "rejected": "Go.", "messages": [{"role": "user", "content": "Hi"}]}] * 2,
        "the answers would be read without it as their prompt",
    ),
}


@pytest.mark.parametrize("case", HELD_OUT_ROWS)
def test_held_out_rows_refused_for_their_shape_are_not_said_to_be_trained(case, tmp_path, monkeypatch, capsys):
    """Held-out rows refused for how TRL would read them said the pairs "would be trained as JSON", "would be
    trained as part of the answer", or "the answers would train without it": held-out pairs are evaluated on. Said
    as what happens to the pair whichever the run does with it."""
    rows, says = HELD_OUT_ROWS[case]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = refused(
        tmp_path, monkeypatch, capsys, "--dataset_mixer_eval_list", str(held), "1.0", "--eval_strategy", "steps"
    )
    assert says in line and " train " not in line and "trained" not in line, line


@pytest.mark.parametrize("wrapper", [{}, {"version": 2}])
def test_pairs_wrapped_in_a_json_object_are_refused_naming_the_wrapper_and_the_fix(
    wrapper, cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """`{"data": [...pairs...]}`, as some exports write a .json file: datasets reads it as one row whose column is
    `data`, refused as a data set with no chosen/rejected columns (`it has ['data']`), as if the pairs were not
    there."""
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({**wrapper, "data": explicit_prompt()}))
    expected = f"error: dataset {str(path)!r} wraps its pairs in a JSON object (under 'data'), which datasets reads"
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert line.startswith(expected) and f"jq -c '.data[]' {path} > pairs.jsonl" in line, line
    assert cli.main([str(path), "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)


@pytest.mark.parametrize("shape", ["text", "messages"])
def test_pairs_written_by_column_are_refused_naming_the_fix(shape, cli, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`json.dump({"prompt": [...], "chosen": [...], "rejected": [...]})`: datasets reads it as one row whose sides
    are every pair's, refused as "prompt: message 0 is a str, not a {'role', 'content'} mapping" (text) or another
    row check: neither the cause nor the fix. The pairs written as the line says then read."""
    pairs = text_prompt() if shape == "text" else dolci()
    path = tmp_path / "columns.json"
    path.write_text(json.dumps({key: [p[key] for p in pairs] for key in pairs[0]}))
    expected = f"error: dataset {str(path)!r} is written by column (one JSON object whose chosen and rejected are"
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert line.startswith(expected) and f"lists of {N} and {N} values), which datasets reads as one row" in line, line
    assert cli.main([str(path), "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)
    fix = line.split("(`")[1].split("`)")[0].replace("'pairs.jsonl'", repr(str(tmp_path / "pairs.jsonl")))
    import pandas  # noqa: F401  (the line's own command, run as written)

    exec(fix)
    _, read = read_pairs(str(tmp_path / "pairs.jsonl"), "train", "messages")
    assert len(read) == N


def test_a_message_prompt_with_string_answers_is_refused_naming_the_fix(
    cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """`prompt` as messages, `chosen`/`rejected` as the answers' text (a common export): read as plain text from its
    string answers, every row was refused as `prompt: a list where the data set has plain text (its first row is
    text)`, which names neither what is mixed nor the fix (TRL fails on such rows too)."""
    pairs = [
        {**p, "chosen": p["chosen"][0]["content"], "rejected": p["rejected"][0]["content"]} for p in explicit_prompt()
    ]
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    expected = (
        "prompt: a message list, where chosen and rejected are plain text: write each answer as a message list "
        "([{'role': 'assistant', 'content': ...}]), or the prompt as text"
    )
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith("error: every row of the train split (24 of 24) fails one check: ") and expected in line
    assert cli.main([name, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert expected in capsys.readouterr().err


def one_message_sides(n=N) -> list[dict]:
    return [
        {"prompt": f"Q{i}?", "chosen": p["chosen"][0], "rejected": p["rejected"][0]}
        for i, p in enumerate(explicit_prompt(n))
    ]


def one_message_sides_after_messages(n=N) -> list[dict]:
    """The same with the prompt as messages: it was blamed, `prompt: a list where the data set has plain text`."""
    return [{**p, "chosen": p["chosen"][0], "rejected": p["rejected"][0]} for p in explicit_prompt(n)]


def sharegpt(n=N) -> list[dict]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [
        {c: [{"from": names[m["role"]], "value": m["content"]} for m in p[c]] for c in ("chosen", "rejected")}
        for p in dolci(n)
    ]


@pytest.mark.parametrize(
    "make, expected",
    [
        (one_message_sides, "chosen: one message, not a list of messages: write it as a list ([{'role': 'assistant'"),
        (one_message_sides_after_messages, "chosen: one message, not a list of messages: write it as a list ([{"),
        (sharegpt, "chosen: message 0 has no 'role': it is written ShareGPT's way ('from', 'value'); rename them"),
    ],
    ids=["one message", "one message after a message prompt", "sharegpt"],
)
def test_sides_written_in_another_message_shape_are_refused_naming_the_fix(
    make, expected, cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """A side written as one message (`"chosen": {"role": "assistant", ...}`) was refused as `a dict where the data set
    has plain text (its first row is text)`, which its first row is not; ShareGPT's `from`/`value` messages as
    `message 0 has no 'role'`. Neither said what to write instead (TRL reads neither)."""
    name, _ = write(tmp_path, "d", make, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(f"error: every row of the train split ({N} of {N}) fails one check: {expected}"), line
    assert cli.main([name, "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line


@pytest.mark.parametrize("train, held", [(dolci, text_prompt), (text_prompt, dolci)], ids=["text held out", "lists"])
def test_held_out_pairs_of_another_kind_than_the_training_pairs_are_refused(train, held, tmp_path, monkeypatch, capsys):
    """A run applies the chat template to all its pairs or to none, as a mixture of both is refused. Held-out plain text
    beside training message lists was evaluated without the template the model trains with (and the reverse with
    one): eval loss and accuracy of another input than trained, the summary's `template:` line naming the model's."""
    train_name, _ = write(tmp_path, "train", train, "jsonl")
    held_name, _ = write(tmp_path, "held", held, "jsonl")
    evaluation = ["--dataset_mixer_eval_list", held_name, "1.0", "--eval_strategy", "steps", "--dry-run"]
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", train_name, *evaluation)
    kinds = ("plain text", "message lists") if train is dolci else ("message lists", "plain text")
    assert line.startswith(f"error: the held-out pairs are {kinds[0]} and the training pairs {kinds[1]}: "), line


def test_an_images_column_without_images_is_left_unread(tmp_path):
    _, pairs = read_pairs(with_images(tmp_path, lambda image: []), "train", "messages")
    assert len(pairs) == N


@pytest.mark.parametrize("column", ["instruction", "question", "input", "query"])
def test_a_prompt_in_a_column_of_another_common_name_is_read_as_the_prompt(column, tmp_path, capsys):
    """Issue 53 item 7: string answers whose prompt sits in `instruction` (or `question`, `input`, `query`) trained with
    an empty prompt: the "prompt" was the characters both answers share. Read as the prompt, saying so in one line;
    a column the run does not read is named at start (the dry run says both)."""
    name, _ = write(tmp_path, "d", lambda: text_instruction(column=column), "jsonl")
    _, pairs = read_pairs(name, "train", "messages")
    assert pairs["prompt"] == [r["prompt"] for r in text_prompt()]
    train_dpo.main(["--config", SMOKE, "--dataset_name", name, "--output_dir", str(tmp_path / "run"), "--dry-run"])
    out = capsys.readouterr().out
    assert f"Data (train): column '{column}' read as the prompt (there is no `prompt` column" in out
    assert f"Data (train): {N} rows, plain text with a prompt column; no chat template" in out
    assert "Data (train): column not read: source (a pair is read from prompt, chosen, rejected" in out


def test_a_prompt_column_of_another_name_is_read_though_the_first_rows_answers_start_with_it(tmp_path):
    """The column was left unread for the whole data set where the first row's answers started with its text (a
    chit-chat `Hello` answered `Hello! ...`, or one exported row of whole texts): every other row trained with the
    characters its answers share as its prompt, here none, its question lost. Read as a `prompt` column is now."""
    pairs = text_instruction(column="question")
    pairs[0] |= {k: pairs[0]["question"] + pairs[0][k] for k in ("chosen", "rejected")}  # the whole text, this row
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    _, read = read_pairs(name, "train", "messages")
    assert read.to_list() == text_prompt()
    # a first row without its question (null) left the column unread too: now that row alone is refused (dropped)
    pairs[0]["question"] = None
    name, _ = write(tmp_path, "null", lambda: pairs, "jsonl")
    _, read = read_pairs(name, "train", "messages", skip_invalid=True)
    assert read.to_list() == text_prompt()[1:]


@pytest.mark.parametrize("kind", ["jsonl", "saved"])
def test_pairs_are_read_again_where_the_reading_code_changed(kind, tmp_path, monkeypatch):
    """datasets keys a map's cache by its function's name, not its code: after an upgrade that reads rows otherwise,
    the pairs the old code read came back from the cache (and were trained) while every check ran the new code. Here
    the new code gives each text pair another prompt; the reading code's digest (the edited shapes.py) keys the map."""
    name, split = write(tmp_path, "d", text, kind)
    assert read_pairs(name, split, "messages")[1][0]["prompt"] != "new"
    edited = tmp_path / "shapes.py"
    edited.write_text(Path(shapes.__file__).read_text() + "\n# upgraded\n")
    monkeypatch.setattr(shapes, "__file__", str(edited))
    monkeypatch.setattr(shapes, "_common_start", lambda c, r: {"prompt": "new", "chosen": c, "rejected": r})
    rows.reading_code.cache_clear()
    try:
        assert read_pairs(name, split, "messages")[1][0]["prompt"] == "new"
    finally:
        rows.reading_code.cache_clear()


def test_two_columns_that_may_hold_the_prompt_are_refused(tmp_path, monkeypatch, capsys):
    """Alpaca's `instruction` and `input` together: which is the prompt, or how they join, is the user's to say."""
    pairs = [{"input": "Some text.", **r} for r in text_instruction()]
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert (
        line.startswith("error: dataset ") and "no `prompt` column and 2 that may hold it (input, instruction)" in line
    )
    assert "rename the one that holds the prompt to `prompt`" in line


@pytest.mark.parametrize("column, role", [("messages", "role"), ("conversations", "from")])
def test_string_answers_beside_an_unread_conversation_awaiting_them_are_refused(
    column, role, tmp_path, monkeypatch, capsys
):
    """String answers whose prompt is a message list in another column (`messages`, ShareGPT's `conversations`): the
    column was named among those not read and the answers trained with the characters both start with as their
    prompt (here none): a run with no prompt at all. Refused in one line naming the fix; a whole conversation there
    (it ends in the assistant's turn: a record of the chosen chat, not a prompt) is left unread as before."""
    user = "user" if role == "role" else "human"
    turn = dict(role={"role": user, "content": "Name a colour."}, **{"from": {"from": user, "value": "Name a colour."}})
    pairs = [{column: [turn[role]], "chosen": "Blue.", "rejected": "Seven."} for _ in range(N)]
    pairs[0][column] = []  # a first pair without one: the column was judged on it alone, and left unread
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert f"no `prompt` column and, in column '{column}' (not read), a conversation waiting for its answer" in line
    fix = "write each answer as a message list ([{'role': 'assistant', 'content': ...}]), or remove the column"
    assert line.endswith(f"rename '{column}' to `prompt` and {fix}"), line
    # The fix half done (answers as message lists, the column not renamed): every row was refused as having no prompt
    # ("no message before the assistant's answer"), naming no column and no fix
    said = {side: [{"role": "assistant", "content": p[side]}] for p in pairs[:1] for side in ("chosen", "rejected")}
    answers = [{**p, **said} for p in pairs]
    name, _ = write(tmp_path, "half", lambda: answers, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert "has answers that are assistant messages alone, no `prompt` column and, in column " in line, line
    assert line.endswith(f"every pair would have no prompt; rename '{column}' to `prompt`"), line
    answered = [{"messages": [turn["role"], {"role": "assistant", "content": "Blue."}], **p} for p in text()]
    name, _ = write(tmp_path, "answered", lambda: answered, "jsonl")
    plain, _ = write(tmp_path, "plain", text, "jsonl")
    assert read_pairs(name, "train", "messages")[1].to_list() == read_pairs(plain, "train", "messages")[1].to_list()


@pytest.mark.slow
def test_held_out_pairs_the_trainer_would_drop_are_said_before_the_model_loads(tmp_path, tiny_model_dir, capsys):
    """Held-out pairs whose prompts alone fill max_length are dropped by the trainer, as training pairs are. All of
    them: the run loaded the model, scored the reference and stopped with "the evaluation split has 0 pairs" (it had
    4), the dry run not a word. Now refused before anything loads, naming the length that keeps them; some of them:
    said in one line."""
    long = " ".join(f"w{i}" for i in range(700))  # ~700+ tokens: past max_length 512
    held = [dict(r, prompt=long + r["prompt"]) for r in text_prompt(4)]
    path = tmp_path / "d"
    splits = {"train": text_prompt(), "test": held}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    args = ["--dataset_name", str(path), "--eval_strategy", "steps", "--eval_steps", "1", "--max_length", "512"]
    run = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run"), *args]
    with pytest.raises(SystemExit) as ended:  # a run, not a dry run: refused before its model loads
        run_cli(lambda: train_dpo.main(run))
    printed = capsys.readouterr()
    line = printed.err.strip().splitlines()[-1]
    assert ended.value.code == 2 and "Traceback" not in printed.err and not (tmp_path / "run").exists(), printed.err
    assert line.startswith("error: max_length 512 leaves 0 of the 4 held-out pairs, where each process that"), line
    assert re.search(r"pass a --max_length above [0-9,]+, or hold out pairs with shorter prompts$", line), line
    splits["test"] = held[:2] + text_prompt(2)
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path / "2"))
    run[run.index(str(path))] = str(path / "2")
    run.append("--dry-run")
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(run))
    out = capsys.readouterr().err  # a dry run's own lines go to stderr, its summary too
    assert ended.value.code in (0, None)
    assert "Held-out pairs at max_length 512: 0 of 4 pairs cut (keep_start: their end), 2 dropped" in out, out


def test_hh_strings_become_the_turns_of_a_conversation(tmp_path):
    name, _ = write(tmp_path, "hh", hh, "jsonl")
    _, as_messages = read_pairs(name, "train", "messages")
    _, as_text = read_pairs(name, "train", "text")
    row = dolci()[7]  # multi-turn: two Human turns
    assert as_messages[7]["prompt"] == [m for m in row["chosen"][:-1] if m["role"] != "system"]
    assert as_messages[7]["chosen"] == row["chosen"][-1:] and as_messages[7]["rejected"] == row["rejected"][-1:]
    # As text, the prompt is the string up to the last `Assistant:`, whole: never cut inside a completion.
    assert as_text[7]["prompt"] == hh_string(row["chosen"][:-1]) + "\n\nAssistant:"
    assert as_text[7]["chosen"] == " " + row["chosen"][-1]["content"]
    assert as_text[7]["rejected"] == " " + row["rejected"][-1]["content"]


def test_hh_strings_under_a_model_without_a_chat_template_are_refused_offering_hh_format_text(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A newcomer's hunt: HH-RLHF strings with a base model that has no chat template (the usual pair for HH) were
    refused as "the data set's rows are message lists", which the user never wrote, naming only a template to give:
    `--hh_format text`, which trains the strings as written, went unsaid (the pairs were judged once already read)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    name, _ = write(tmp_path, "hh", hh, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--dataset_name", name)
    assert line.startswith(
        f"error: the tokenizer of {model} has no chat template, and the data set's rows are HH-RLHF strings, read "
        "as message lists (hh_format: messages), which need one: set hh_format: text (--hh_format text; the "
        "analyzer's --hh-format text) to train the strings as plain text, give a template with --chat_template_path "
        "FILE.jinja"
    ), line


def test_hh_strings_with_windows_line_ends_are_read_as_hh(tmp_path):
    """HH-RLHF strings saved with `\r\n` line ends (a Windows editor or export) were not recognised as HH: the run
    trained them as plain text, without the chat template and without saying so. Their turns are read as with `\n`."""
    crlf = [{k: v.replace("\n", "\r\n") for k, v in r.items()} for r in hh()]
    name, _ = write(tmp_path, "hh_crlf", lambda: crlf, "jsonl")
    raw, as_messages = read_pairs(name, "train", "messages")
    _, as_text = read_pairs(name, "train", "text")
    _, lf = read_pairs(write(tmp_path, "hh", hh, "jsonl")[0], "train", "messages")
    assert isinstance(as_messages[0]["chosen"], list), "read as plain text"
    unix = [{k: [m | {"content": m["content"].replace("\r\n", "\n")} for m in r[k]] for k in r} for r in as_messages]
    assert unix == lf.to_list()
    # As text, the raw strings train as written: the prompt up to the last `Assistant:`, its \r\n kept.
    assert as_text[7]["prompt"] + as_text[7]["chosen"] == raw[7]["chosen"]
    assert as_text[7]["prompt"].endswith("\r\n\r\nAssistant:") and "\r\n" in as_text[7]["prompt"]


def test_ultrafeedback_measures_and_tokenizes_exactly_as_without_its_prompt_column(tokenizer, tmp_path):
    with_prompt, _ = write(tmp_path, "uf", ultrafeedback, "parquet")
    without, _ = write(
        tmp_path,
        "plain",
        lambda: [{"chosen": r["chosen"], "rejected": r["rejected"]} for r in ultrafeedback()],
        "parquet",
    )
    (raw_a, a), (raw_b, b) = read_pairs(with_prompt, "train", "messages"), read_pairs(without, "train", "messages")
    assert a.to_list() == b.to_list()
    ids_a, ids_b = trainer_dataset(a, tokenizer, tmp_path), trainer_dataset(b, tokenizer, tmp_path)
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ids_a[key] == ids_b[key]
    m_a, m_b = lengths.measure(raw_a, tokenizer), lengths.measure(raw_b, tokenizer)
    for key in ("prompt", "chosen", "rejected"):
        np.testing.assert_array_equal(getattr(m_a, key), getattr(m_b, key))


@pytest.mark.slow
def test_ultrafeedback_trains_exactly_as_without_its_prompt_column(tmp_path, tiny_model_dir):
    with_prompt, _ = write(tmp_path, "uf", ultrafeedback, "jsonl")
    without, _ = write(tmp_path, "plain", dolci, "jsonl")
    losses = []
    for name in (with_prompt, without):
        recipe = parse_args(
            [
                "--config",
                SMOKE,
                "--model_name_or_path",
                tiny_model_dir,
                "--dataset_name",
                name,
                "--output_dir",
                str(tmp_path / "run"),
                "--save_strategy",
                "no",
                "--report_to",
                "none",
                "--max_steps",
                "2",
                "--warmup_steps",
                "0",
                "--logging_steps",
                "1",
            ]
        )
        trainer = ready(built(recipe, read_pairs(name, "train", "messages")[1]))
        trainer.train()
        losses.append([r["loss"] for r in trainer.state.log_history if "loss" in r])
    assert len(losses[0]) == 2 and losses[0][1] != losses[0][0]  # step 2 trained on what step 1 learned
    assert losses[0] == losses[1]


def text_prompt_repeated(n=N) -> list[dict]:
    """A `prompt` column beside string answers that each write the prompt out again (the whole text, prompt and answer,
    in each side), as some exports of HH-style and completion data do."""
    return [
        {"prompt": p["prompt"], "chosen": t["chosen"], "rejected": t["rejected"]}
        for p, t in zip(text_prompt(n), text(n), strict=True)
    ]


def test_string_answers_that_repeat_the_prompt_column_read_as_the_answers_alone(tokenizer, tmp_path, capsys):
    """A newcomer's hunt: string answers that repeat the `prompt` column's text were read as given, and TRL joins prompt
    and answer, so every pair trained the prompt twice, its repetition as part of each answer (sigmoid_norm's mean and
    the SFT term over it), without a word. Read once, as message lists that repeat their prompt are, and said."""
    repeated, _ = write(tmp_path, "repeated", text_prompt_repeated, "jsonl")
    once, _ = write(tmp_path, "once", text_prompt, "jsonl")
    (_, a), (_, b) = read_pairs(repeated, "train", "messages"), read_pairs(once, "train", "messages")
    assert a.to_list() == b.to_list()
    ids_a, ids_b = trainer_dataset(a, tokenizer, tmp_path), trainer_dataset(b, tokenizer, tmp_path)
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ids_a[key] == ids_b[key]
    train_dpo.main(["--config", SMOKE, "--dataset_name", repeated, "--output_dir", str(tmp_path / "run"), "--dry-run"])
    out = capsys.readouterr().out
    assert (
        f"Data (train): {N} rows, plain text with a prompt column that chosen and rejected repeat: read without the "
        "repetition; no chat template"
    ) in out, out


def test_one_side_alone_repeating_the_prompt_column_is_refused(tmp_path, monkeypatch, capsys):
    pairs = text_prompt_repeated()
    pairs[3]["rejected"] = text_prompt()[3]["rejected"]
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(
        "error: row 3, column 'rejected': does not start with the `prompt` column's text while `chosen` does: write "
        "both sides the same way (the whole text, or the answer alone)"
    ), line


def test_a_string_prompt_that_is_not_the_user_turn_is_refused():
    bad = ultrafeedback(4)
    bad[2]["prompt"] = "Something else entirely"
    with pytest.raises(rows.InvalidRowError) as info:
        rows.check_dataset(datasets.Dataset.from_list(bad))
    assert str(info.value).startswith("row 2, column 'prompt': the string prompt is not the first user turn")


def test_sides_holding_only_the_answer_get_the_string_prompt_as_their_user_turn():
    pairs = [
        {
            "prompt": "Name a colour.",
            "chosen": [{"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "assistant", "content": "Seven."}],
        }
    ] * 2
    read = rows.usable_pairs(datasets.Dataset.from_list(pairs), rows.RowRules(), {}, "invalid_rows")
    assert read[0] == {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Seven."}],
    }


# --- short training runs, as a user starts them -----------------------------------------------------------------------


def train(tmp_path, monkeypatch, capsys, tiny_model_dir, *args) -> tuple[dict, str]:
    """`python train_dpo.py --config smoke.yaml --max_steps 2 ARGS`, in this process: (resolved config, stdout)."""
    monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", tiny_model_dir.rsplit("/", 1)[0])
    out = tmp_path / "run"
    train_dpo.main(
        [
            "--config",
            SMOKE,
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            *args,
        ]
    )
    assert (out / "run_complete.json").is_file()
    return json.loads((out / "resolved_config.json").read_text()), capsys.readouterr().out


@pytest.mark.slow  # ~20-30 s each on 2 cores; the UltraFeedback and skip_invalid runs below are not marked
@pytest.mark.parametrize(
    "shape, printed",
    [
        ("ultrafeedback-binarized, parquet", "a string prompt that repeats the first user turn (UltraFeedback-"),
        ("hh-rlhf as messages, jsonl", "HH-RLHF strings (\\n\\nHuman: ... \\n\\nAssistant: ...) turned into message"),
        ("hh-rlhf as text, json", "trained as plain text, no chat template (hh_format: text"),
        ("standard text with prompt, csv", "plain text with a prompt column; no chat template"),
        ("messages, DatasetDict split", "message lists, prompt = the messages before the last assistant turn"),
    ],
)
def test_a_short_run_trains_and_says_how_it_read_the_rows(
    shape, printed, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    make, kind, hh_format, _ = SHAPES[shape]
    name, split = write(tmp_path, "d", make, kind)
    resolved, stdout = train(
        tmp_path,
        monkeypatch,
        capsys,
        tiny_model_dir,
        "--dataset_name",
        name,
        "--dataset_train_split",
        split,
        "--hh_format",
        hh_format,
    )
    assert f"Data ({split}): {N} rows, " in stdout and printed in stdout
    assert resolved["derived"]["dataset_rows"] == N and resolved["hh_format"] == hh_format


@pytest.mark.slow
def test_pairs_with_other_prompts_are_dropped_and_counted_under_skip_invalid(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    pairs = hh()
    for i in (4, 9):
        pairs[i]["rejected"] = pairs[i]["rejected"].replace("\n\nHuman: ", "\n\nHuman: Ignore that. ", 1)
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    resolved, stdout = train(
        tmp_path, monkeypatch, capsys, tiny_model_dir, "--dataset_name", name, "--skip_invalid", "true"
    )
    dropped = resolved["derived"]["invalid_rows"]
    assert dropped["dropped"] == 2 and [r["index"] for r in dropped["first"]] == [4, 9]
    assert dropped["by_reason"] == {
        "rejected: answers another prompt than `chosen` (a pair is two answers to one prompt)": 2
    }
    assert resolved["derived"]["dataset_rows"] == N - 2 and f"Dropped 2 invalid rows of {N}" in stdout


# --- refused before the model loads -----------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Answer in one word."}


def other_user_turn(n=N) -> list[dict]:
    """A shared system message, then user turns that differ: TRL alone would take the system message as the prompt
    and train on each side's user turn as part of its "completion"."""
    pairs = [{"chosen": [SYSTEM, *r["chosen"]], "rejected": [SYSTEM, *r["rejected"]]} for r in dolci(n)]
    pairs[3]["rejected"][1] = {"role": "user", "content": "Name a shape."}
    return pairs


def other_human_turn(n=N) -> list[dict]:
    pairs = hh(n)
    pairs[3]["rejected"] = pairs[3]["rejected"].replace("\n\nHuman: What is", "\n\nHuman: What was", 1)
    return pairs


@pytest.mark.parametrize(
    "make, hh_format", [(other_user_turn, "messages"), (other_human_turn, "messages"), (other_human_turn, "text")]
)
def test_pairs_whose_sides_answer_other_prompts_are_refused(make, hh_format, tmp_path, monkeypatch, capsys):
    name, _ = write(tmp_path, "d", make, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name, "--hh_format", hh_format)
    assert line.startswith("error: row 3, column 'rejected': answers another prompt than `chosen`"), line
    assert "in chosen" in line and "--skip_invalid true" in line


@pytest.mark.parametrize("make", [dolci, text_prompt], ids=["messages", "text"])
def test_sides_that_differ_only_in_white_space_around_the_answer_are_refused(make, tmp_path, monkeypatch, capsys):
    """A newcomer's hunt: a pair whose rejected side is chosen's with a trailing space or newline (an export that
    strips one column and not the other) trained as a preference for white space without a word; under a template that
    trims content (Qwen's, Llama 3's) both sides are the same tokens, a pair at ln 2 with no gradient."""
    pairs = make()
    answer = pairs[3]["chosen"]
    if make is dolci:
        pairs[3]["rejected"] = [*answer[:-1], {**answer[-1], "content": answer[-1]["content"] + "\n "}]
    else:
        pairs[3]["rejected"] = f"{answer}\n "
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(
        "error: row 3, column 'chosen': identical to `rejected` but for white space at the start or end of a message: "
        "the pair expresses no preference"
    ), line


def test_plain_text_sides_that_differ_only_in_a_written_eos_are_refused(tmp_path, monkeypatch, capsys):
    """`" Paris.<|im_end|>"` against `" Paris."`: the trainer appends EOS to the side without it (add_eos), and the
    pair trained as two identical sequences (ln 2, no gradient), counted and measured as any other, without a word."""
    pairs = text_prompt()
    pairs[3]["rejected"] = pairs[3]["chosen"] + "<|im_end|>"
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(
        "error: row 3, column 'chosen': identical to `rejected` but for the EOS token '<|im_end|>' one side ends with"
    ), line


def test_conversations_that_part_at_an_earlier_answer_in_every_row_are_refused_naming_the_cut(
    tmp_path, monkeypatch, capsys
):
    """A newcomer's hunt: multi-turn pairs whose sides part at an earlier answer (two sampled conversations, a common
    export) were refused in every row as answering "another prompt", with no word of what to do (`--skip_invalid` is
    not offered: it would drop them all)."""
    follow = [{"role": "user", "content": "Are you sure?"}, {"role": "assistant", "content": "Yes."}]
    pairs = [{"chosen": [*r["chosen"], *follow], "rejected": [*r["rejected"], *follow]} for r in dolci()]
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(
        f"error: every row of the train split ({N} of {N}) fails one check: rejected: answers another prompt than "
        "`chosen` (a pair is two answers to one prompt); where a pair is two conversations that part at an earlier "
        "answer, cut both where they part: the messages before the first answer that differs are the prompt, that "
        "answer each side's; first: line 1 of d.jsonl, message "
    ), line


def test_one_dropped_row_is_counted_in_the_singular(capsys):
    """--skip_invalid dropping one row printed "Dropped 1 invalid row(s) of 24"."""
    pairs = dolci()
    pairs[5] = {**pairs[5], "rejected": pairs[5]["chosen"]}
    derived = {}
    kept = rows.usable_pairs(datasets.Dataset.from_list(pairs), rows.RowRules(True), derived, "invalid_rows")
    assert len(kept) == N - 1 and f"Dropped 1 invalid row of {N}: " in capsys.readouterr().out


def test_a_prompt_that_runs_on_past_chosens_is_counted_in_messages(tmp_path, monkeypatch, capsys):
    """rejected goes on past chosen's one-message prompt: it read "chosen's prompt has 1 message(s), this one 3"."""
    pairs = dolci()
    user, answer = {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}
    more = [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    pairs[3] = {"chosen": [user, answer], "rejected": [user, *more, answer]}
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith("error: row 3, column 'rejected': answers another prompt than `chosen`"), line
    assert "chosen's prompt has 1 message, this one 3" in line, line


@pytest.mark.parametrize("skip", [[], ["--skip_invalid", "true"]], ids=["refused", "skip_invalid"])
def test_no_usable_row_is_one_error_line_that_does_not_offer_skip_invalid(skip, tmp_path, monkeypatch, capsys):
    pairs = [{"chosen": r["chosen"], "rejected": r["chosen"]} for r in dolci()]  # every pair identical
    name, _ = write(tmp_path, "d", lambda: pairs, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name, *skip)
    assert line == (
        f"error: every row of the train split ({N} of {N}) fails one check: chosen: identical to `rejected`: the pair "
        "expresses no preference; first: line 1 of d.jsonl"
    )
    name, _ = write(tmp_path, "one", lambda: pairs[:1], "jsonl")  # it read "every row ... (1 of 1)"
    assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", name, *skip) == (
        "error: the only row of the train split fails a check: chosen: identical to `rejected`: the pair expresses no "
        "preference; line 1 of one.jsonl"
    )
    several = [{**p, "rejected": None} if i % 2 else p for i, p in enumerate(pairs)]  # two checks, every row
    name, _ = write(tmp_path, "e", lambda: several, "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name, *skip)
    assert line.startswith(f"error: no usable row in the train split: all {N} rows are invalid (12 x ") and (
        "skip_invalid" not in line
    )


@pytest.mark.parametrize("make", [dolci, text])
def test_a_prompt_column_null_in_every_row_is_refused_naming_the_fix(make, tmp_path, monkeypatch, capsys):
    """An export's empty `prompt` column (pandas writes null where there is none): the pairs hold their prompt."""
    name, _ = write(tmp_path, "d", lambda: [{"prompt": None, **r} for r in make()], "jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", name)
    assert line.startswith(f"error: every row of the train split ({N} of {N}) fails one check: prompt: missing (null)")
    assert "remove the `prompt` column" in line, line


def test_an_empty_split_is_one_error_line(tmp_path, monkeypatch, capsys):
    empty = datasets.Dataset.from_list(dolci(2)).select([])
    empty.to_parquet(tmp_path / "empty.parquet")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(tmp_path / "empty.parquet"))
    assert (
        line == f"error: dataset file {str(tmp_path / 'empty.parquet')!r} has no rows: it needs one pair per row, "
        "with chosen/rejected"
    )
    folder = tmp_path / "saved"  # datasets itself cannot read such a split back
    datasets.DatasetDict({"train": datasets.Dataset.from_list(dolci(2)), "test": empty}).save_to_disk(str(folder))
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder), "--skip_invalid", "true")
    assert line == f"error: dataset {str(folder)!r}: split ['test'] saved with no rows; remove it or save rows"


def test_an_unknown_hh_format_is_refused(tmp_path, monkeypatch, capsys):
    assert "hh_format 'raw': choose `messages`" in refused(tmp_path, monkeypatch, capsys, "--hh_format", "raw")


# --- the analyzer says how it read the rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("hh_format", ["messages", "text"])
def test_analyzer_report_says_whether_the_chat_template_applies(hh_format, cli, tmp_path, tiny_model_dir, capsys):  # noqa: F811
    name, _ = write(tmp_path, "hh", hh, "jsonl")
    assert cli.main([name, "--tokenizer", tiny_model_dir, "--num-proc", "1", "--hh-format", hh_format]) == 0
    out = capsys.readouterr().out
    if hh_format == "messages":
        assert f"with the chat template of `{tiny_model_dir}`" in out and "turned into message lists" in out
    else:
        assert "as plain text with the tokenizer of" in out and "(no chat template)" in out
        assert "with the chat template" not in out


@pytest.mark.parametrize("first", ["has them", "has none"])
def test_tools_and_chat_template_kwargs_in_some_rows_only_reach_every_row_that_has_them(first, tmp_path):
    """Tool-using rows carry `tools` (and `chat_template_kwargs`), the others none. The pairs were written by a map
    that takes its columns from the first row: one with them, and a later row without failed (KeyError, a traceback
    before the model loads); one without them, and every later row's were silently dropped. Each row keeps its own
    now; a row without `chat_template_kwargs` has none (`{}`), since TRL applies `**` to them, and not the column's
    keys as None, which a template's `is defined` takes as given."""
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    pairs = builtin.make_preference_rows(8, seed=5)
    having = range(0 if first == "has them" else 1, 8, 2)
    for i in having:
        pairs[i] |= {"tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    read = rows.usable_pairs(data.load_preference_dataset(str(path)), rows.RowRules(say=False), {}, "invalid_rows")
    assert read.column_names[:3] == ["prompt", "chosen", "rejected"]
    for i, row in enumerate(read):
        assert (row["tools"] is not None) == (i in having), i
        assert row["chat_template_kwargs"] == ({"enable_thinking": False} if i in having else {}), i


# A template that writes an assistant's tool calls, as tool-calling models' templates do (Qwen's, Llama's)
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function']['name'] }}({{ c['function']['arguments'] }})"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_call_answers_are_read_and_measured_as_the_trainer_tokenizes_them(tiny_model_dir, tmp_path):
    """Tool-calling pairs in TRL's format: an answer that is a tool call (`tool_calls`, no text) was refused as an
    empty completion or a message without content, and a data set whose chosen sides call a tool where the rejected
    ones answer in text was refused whole: each message of the chosen column then holds a `tool_calls` field (null
    where it calls nothing) and the rejected column's none, so the two read as answering other prompts (message 0
    (user): '2+2?' in chosen, '2+2?' here)."""
    user = {"role": "user", "content": "2+2?"}

    def call(name, content=None):
        message = {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": "{}"}}],
        }
        return message if content is None else {**message, "content": content}

    text = [
        {"chosen": [user, call("calc")], "rejected": [user, {"role": "assistant", "content": "5."}]},
        {"chosen": [user, call("calc", "")], "rejected": [user, call("search", "")]},
        {
            "chosen": [
                user,
                call("calc", "Let me check."),
                {"role": "tool", "content": "4"},
                {"role": "assistant", "content": "4."},
            ],
            "rejected": [
                user,
                call("calc", "Let me check."),
                {"role": "tool", "content": "4"},
                {"role": "assistant", "content": "5."},
            ],
        },
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in text))
    tokenizer = lengths.load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = TOOL_TEMPLATE
    raw = data.load_preference_dataset(str(path))
    pairs = rows.usable_pairs(raw, rows.RowRules(template=tokenizer, say=False), {}, "invalid_rows")
    processed = trainer_dataset(pairs, tokenizer, tmp_path)
    answers = [(tokenizer.decode(r["chosen_ids"]), tokenizer.decode(r["rejected_ids"])) for r in processed]
    assert answers == [
        ("<tool_call>calc({})</tool_call><|im_end|>\n", "5.<|im_end|>\n"),
        ("<tool_call>calc({})</tool_call><|im_end|>\n", "<tool_call>search({})</tool_call><|im_end|>\n"),
        ("4.<|im_end|>\n", "5.<|im_end|>\n"),
    ]
    assert "Let me check.<tool_call>calc({})</tool_call>" in tokenizer.decode(processed[2]["prompt_ids"])
    m = lengths.measure(raw, tokenizer)
    assert m.invalid == []
    for key in ("prompt", "chosen", "rejected"):
        np.testing.assert_array_equal(getattr(m, key), [len(ids) for ids in processed[f"{key}_ids"]], err_msg=key)
    # An answer that says nothing at all is still refused
    empty = [
        {"chosen": [user, {"role": "assistant", "content": " ", "tool_calls": None}], "rejected": text[0]["rejected"]}
    ]
    with pytest.raises(rows.InvalidRowError, match="empty completion"):
        rows.check_dataset(datasets.Dataset.from_list(empty + text))


def test_a_tool_call_the_chat_template_cannot_write_is_refused_naming_the_fix(
    cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """An answer that is a tool call with no `content`, under a template written for text turns (the built-in model's
    reads every message's content): refused, as TRL would fail on it, with only jinja's "UndefinedError: 'dict
    object' has no attribute 'content'" and no word of what to change. The run and the analyzer name the fix."""
    user = {"role": "user", "content": "2+2?"}
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": "{}"}}]}
    pairs = [{"chosen": [user, call], "rejected": [user, {"role": "assistant", "content": f"{i}."}]} for i in range(4)]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    fix = "a message calls a tool and has no content: give a chat template that writes tool_calls, chat_template_path"
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert line.startswith("error: every row of the train split (4 of 4) fails one check: chosen: chat template error")
    assert fix in line, line
    assert cli.main([str(path), "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert fix in capsys.readouterr().err


def test_a_tool_call_the_chat_template_leaves_out_is_refused_naming_the_fix(
    cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """A tool call with empty `content` (TRL's format) under a template that reads content but never tool_calls (the
    built-in model's) rendered as an empty answer, `<|im_start|>assistant\n<|im_end|>`: the run and the analyzer took
    every row, the chosen side trained saying nothing, and a pair of two calls trained identical sides. Refused as the
    call without content is, naming the fix; the template that writes the calls reads the same rows (above)."""
    user = {"role": "user", "content": "2+2?"}

    def call(name):
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name}}]}

    pairs = [
        {"chosen": [user, call("calc")], "rejected": [user, {"role": "assistant", "content": f"{i}."}]}
        for i in range(N - 1)
    ]
    pairs.append({"chosen": [user, call("calc")], "rejected": [user, call("search")]})
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    fix = "the chat template does not write tool_calls, so the tool call would train as the text around it"
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert line.startswith(f"error: every row of the train split ({N} of {N}) fails one check: chosen: chat template")
    assert fix in line and "give a chat template that writes tool_calls (chat_template_path" in line, line
    assert cli.main([str(path), "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert fix in capsys.readouterr().err


def test_chat_template_kwargs_of_other_names_in_other_rows_all_reach_the_trainer(tiny_model_dir, tmp_path):
    """Rows whose chat_template_kwargs differ in their names (`enable_thinking` here, `reasoning_effort` there) are
    read by datasets as Json, which the reading took for a column no row fills and dropped: every row's keyword
    arguments lost without a word, while the analyzer measured the rows with them."""
    pairs = builtin.make_preference_rows(6, seed=3)
    given = [{"system_note": "terse"}, {"reasoning_effort": "high"}, None, {"system_note": "x", "level": 2}, None, None]
    for pair, kwargs in zip(pairs, given, strict=True):
        pair["chat_template_kwargs"] = kwargs
    path = tmp_path / "kwargs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    raw = data.load_preference_dataset(str(path))
    read = rows.usable_pairs(raw, rows.RowRules(say=False), {}, "invalid_rows")
    assert read["chat_template_kwargs"] == [k or {} for k in given]
    tokenizer = lengths.load_tokenizer(tiny_model_dir)  # a template that writes them
    tokenizer.chat_template = "{{ system_note | default('') }}{{ reasoning_effort | default('') }}" + (
        tokenizer.chat_template
    )
    processed = trainer_dataset(read, tokenizer, tmp_path)
    assert tokenizer.decode(processed[1]["prompt_ids"]).startswith("high<|im_start|>")
    m = lengths.measure(raw, tokenizer)
    np.testing.assert_array_equal(m.prompt, [len(ids) for ids in processed["prompt_ids"]])


def refused_then_dropped(pairs, tmp_path, tiny_model_dir):
    """The run's refusal of `pairs` without --skip_invalid, and with it the rows it drops (its record) beside those the
    analyzer drops, each row's problem with its index."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    raw = data.load_preference_dataset(str(path))
    with pytest.raises(rows.InvalidRowError) as info:
        rows.usable_pairs(raw, rows.RowRules(say=False), {}, "invalid_rows", source=str(path))
    derived = {}
    assert len(rows.usable_pairs(raw, rows.RowRules(True, say=False), derived, "invalid_rows")) == len(pairs) - 1
    measured = lengths.measure(raw, lengths.load_tokenizer(tiny_model_dir), skip_invalid=True)
    return str(info.value), derived["invalid_rows"]["first"], measured.invalid


@pytest.mark.parametrize("content", ["", "  \n"], ids=["empty", "whitespace"])
def test_an_empty_user_turn_is_refused_by_the_run_and_counted_by_the_analyzer_alike(content, tmp_path, tiny_model_dir):
    """A conversation whose user message says nothing trained without a word: the chat template renders the user's
    header with nothing after it, a gap in the export rather than a prompt (an empty text prompt is refused alike).
    The run refuses it in one line with --skip_invalid as the way past; the analyzer drops and counts the same row."""
    pairs = dolci(6)
    for side in ("chosen", "rejected"):  # the prompt the two sides share, as the messages shape repeats it
        pairs[3][side] = [{**m, "content": content} if m["role"] == "user" else m for m in pairs[3][side]]
    said, dropped, analyzer = refused_then_dropped(pairs, tmp_path, tiny_model_dir)
    assert re.fullmatch(
        r"row 3, column 'prompt': message \d is a user turn with empty content \(the chat template would render its "
        r"header with nothing after it\) \(line 4 of .*pairs\.jsonl; fix or remove the row, or pass --skip_invalid "
        r"true to drop and count such rows instead\)",
        said,
    ), said
    assert [p["index"] for p in analyzer] == [p["index"] for p in dropped] == [3]


@pytest.mark.parametrize("content", ["", " \t"], ids=["empty", "whitespace"])
def test_an_empty_text_prompt_is_refused_by_the_run_and_counted_by_the_analyzer_alike(
    content, tmp_path, tiny_model_dir
):
    """One empty `prompt` beside text answers (an export's missing prompt written as "") trained without a word: TRL
    tokenizes it to no token, so the answers trained as text nobody asked for, their first token never scored (nothing
    before it predicts it). Refused as the empty user turn is, with its file and line; --skip_invalid drops it, and the
    analyzer counts the same row."""
    pairs = text_prompt(6)
    pairs[3]["prompt"] = content
    said, dropped, analyzer = refused_then_dropped(pairs, tmp_path, tiny_model_dir)
    assert re.fullmatch(
        r"row 3, column 'prompt': empty text \(nothing before the answers: .*\): write the prompt, or, for answers "
        r"that have none, leave the prompt column out \(TRL then takes what the answers share at their start as the "
        r"prompt\) \(line 4 of "
        r".*pairs\.jsonl; fix or remove the row, or pass --skip_invalid true to drop and count such rows instead\)",
        said,
    ), said
    assert [p["index"] for p in analyzer] == [p["index"] for p in dropped] == [3]


@pytest.mark.parametrize("content", ["", " "], ids=["empty", "whitespace"])
def test_an_empty_assistant_turn_after_the_answer_is_refused_by_the_run_and_counted_by_the_analyzer(
    content, tmp_path, tiny_model_dir
):
    """An export's trailing `{"role": "assistant", "content": ""}` after chosen's answer trained as a turn of its own
    (header and end token): the model learned to follow its answer with an empty turn. Refused as the empty user turn
    is, and counted by the analyzer alike; an answer that is a tool call (empty content) stays a pair."""
    pairs = dolci(6)
    pairs[2]["chosen"] = pairs[2]["chosen"] + [{"role": "assistant", "content": content}]
    pairs[4]["rejected"] = pairs[4]["rejected"][:-1] + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    ]
    said, dropped, analyzer = refused_then_dropped(pairs, tmp_path, tiny_model_dir)  # the tool call's pair kept
    assert re.match(
        r"row 2, column 'chosen': message \d is an assistant turn with empty content beside the answer \(it would "
        r"train as an empty turn of its own\): remove it \(line 3 of ",
        said,
    ), said
    assert analyzer[0] == dropped[0] and dropped[0]["index"] == 2
    # The built-in template does not write tool_calls: refused by that check, once the template is known, not this one
    assert [(p["index"], p["problem"][:41]) for p in analyzer[1:]] == [(4, "chat template error: the chat template do")]


def test_repeated_pairs_and_held_out_pairs_also_trained_are_said_not_dropped(tmp_path, capsys):
    """A data set whose rows repeat (the same prompt, chosen and rejected) trained each repeat again without a word,
    and held-out pairs that are training pairs too were not said: their eval loss is then no held-out one. Said in one
    line each where the data's other counts are, in the dry run and the run; nothing dropped, nothing refused.
    (Old code: no such line.)"""
    pairs = text_prompt()
    written = {"chosen": pairs[0]["chosen"], "rejected": pairs[0]["rejected"], "prompt": pairs[0]["prompt"]}
    train = pairs + [pairs[3], pairs[5], written]  # 3 repeats of 27: the last one a repeat whose keys are reordered
    held = [pairs[1], pairs[2], pairs[2], *text_prompt(N + 4)[N:]]  # 3 training pairs (one twice) and 4 new ones
    path = tmp_path / "d"
    splits = {"train": train, "test": held}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    args = ["--dataset_name", str(path), "--eval_strategy", "steps", "--eval_steps", "1"]
    train_dpo.main(["--config", SMOKE, *args, "--output_dir", str(tmp_path / "run"), "--dry-run"])
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if line.startswith("Data (") and "pair" in line]
    assert lines == [
        "Data (train): 3 of 27 pairs repeat an earlier pair exactly (trained as often as they appear)",
        "Data (test): 1 of 7 pairs repeat an earlier pair exactly (evaluated as often as they appear)",
        "Data (test): 3 of the 7 evaluation pairs are also training pairs (their eval loss is on pairs the model "
        "trains on)",
    ], lines
    derived: dict = {}
    _, read = read_pairs(str(path), "train", "messages", derived=derived)
    assert len(read) == len(train) and derived == {}  # every repeat is trained: none dropped, none counted invalid


def test_a_pairs_digest_is_what_the_template_renders_not_how_arrow_stored_it():
    """Two rows alike but for their chat_template_kwargs (thinking on, off) render as other tokens, and were counted a
    repeat; the same pair in a split whose messages Arrow gave `tool_calls: null` (another message of it had tool
    calls) was taken for another pair, so an evaluation pair also trained was not said (a reviewer's finding)."""
    from dpotrain.data.rows import pair_digest

    chat = [{"role": "user", "content": "hi"}]
    pair = {
        "prompt": chat,
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
    }
    thinking = {**pair, "chat_template_kwargs": {"enable_thinking": True}}
    assert pair_digest(thinking) != pair_digest({**pair, "chat_template_kwargs": {"enable_thinking": False}})
    assert pair_digest({**pair, "tools": [{"name": "f"}]}) != pair_digest(pair)
    nulled = {k: [{**m, "tool_calls": None} for m in v] for k, v in pair.items()}
    assert pair_digest(nulled) == pair_digest(pair)


@pytest.mark.parametrize("rows_given", ["every row", "one row", "text beside objects"])
def test_chat_template_kwargs_that_are_not_an_object_are_refused_with_their_row(
    rows_given, tmp_path, monkeypatch, capsys
):
    """TRL spreads a row's chat_template_kwargs into apply_chat_template (`**`): a column of JSON texts (an export
    that wrote each object as a string) or a row's list stopped the row check in a traceback ('str' object has no
    attribute 'items'), before the model loads; now the row and the column are named, as any other bad value. A text
    among objects is refused alike: datasets stores such a column as Json, which decoded the text into its object
    (one rule: the file read again, each value as written)."""
    pairs = builtin.make_preference_rows(8, seed=5)
    if rows_given == "every row":
        pairs = [p | {"chat_template_kwargs": json.dumps({"enable_thinking": False})} for p in pairs]
    else:
        pairs = [p | {"chat_template_kwargs": {"enable_thinking": False}} for p in pairs]
        pairs[3]["chat_template_kwargs"] = ["enable_thinking"]
        if rows_given == "text beside objects":
            pairs[3]["chat_template_kwargs"] = json.dumps({"enable_thinking": False})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path), "--dry-run")
    kind = "a list" if rows_given == "one row" else "a str"
    problem = (
        f"{kind}, where the chat template's keyword arguments are an object, which TRL passes to apply_chat_template "
        'as keywords: write it as one, e.g. {"enable_thinking": false}'
    )
    if rows_given == "every row":
        assert line == (
            f"error: every row of the train split (8 of 8) fails one check: chat_template_kwargs: {problem}; first: "
            "line 1 of pairs.jsonl"
        )
    else:
        assert line.startswith(f"error: row 3, column 'chat_template_kwargs': {problem} (line 4 of pairs.jsonl; ")


def test_tools_written_as_text_that_is_not_json_are_refused_with_their_row(tmp_path, monkeypatch, capsys):
    """TRL reads a `tools` text as JSON (a tool list saved as its JSON text, which a valid row here still is): a row
    whose text is not JSON (a tool's name alone) stopped the row check in a JSONDecodeError traceback."""
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    pairs = [p | {"tools": json.dumps(tools)} for p in builtin.make_preference_rows(8, seed=5)]
    pairs[5]["tools"] = "get_weather"
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path), "--dry-run")
    assert line.startswith(
        "error: row 5, column 'tools': a text that is not JSON (Expecting value at column 1): write the tools as a "
        'list of JSON schemas ([{"type": "function", "function": {"name": ..., "parameters": ...}}]), or as the JSON '
        "text of one (line 6 of pairs.jsonl; "
    )

"""A refused row is named as the user finds it in their file: its line in a .jsonl or .csv, and what is wrong with it
in words that match (an empty HH side is 'empty'), the same in the run, the dry run and the analyzer."""

import csv
import json

import pytest
from test_analyzer import error_line

import train_dpo
from conftest import ROOT
from dpotrain.data import data
from dpotrain.recipe.errors import ConfigError

SMOKE = ROOT / "configs" / "smoke.yaml"


def pairs(n: int) -> list[dict]:
    return [
        {
            "chosen": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"yes {i}"}],
            "rejected": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"no {i}"}],
        }
        for i in range(n)
    ]


def jsonl_with_an_empty_chosen(path) -> str:
    """Row 7 (from 0) has an empty answer; a blank line before it (which readers skip) puts it on line 9."""
    rows = pairs(12)
    rows[7]["chosen"][-1]["content"] = ""
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_dry_run_and_the_run_name_the_line_of_a_jsonl(tmp_path):
    path = jsonl_with_an_empty_chosen(tmp_path / "my.jsonl")
    for mode in (["--dry-run"], []):
        with pytest.raises(ConfigError) as refused:
            train_dpo.main(["--config", str(SMOKE), "--dataset_name", path, "--output_dir", str(tmp_path / "o"), *mode])
        message = str(refused.value)
        assert message.startswith("row 7, column 'chosen': empty completion") and "(line 9 of my.jsonl; fix" in message
    assert not (tmp_path / "o").exists()


def test_the_analyzer_names_the_same_line(cli, tmp_path, capsys):  # noqa: F811
    path = jsonl_with_an_empty_chosen(tmp_path / "my.jsonl")
    assert cli.main([path, "--tokenizer", "builtin:tiny-olmo3", "--num-proc", "1"]) == 2
    line = error_line(capsys)
    assert line.startswith("error: row 7, column 'chosen': empty completion") and "(line 9 of my.jsonl; fix" in line


def test_the_rows_skip_invalid_lists_are_named_by_their_line(cli, tmp_path, capsys):  # noqa: F811
    """`--skip-invalid` lists the rows it left out by index alone (`| 7 | chosen | ...`), which a reader of a .jsonl
    takes for its line 7, or 8: the row is on line 9 (a blank line before it). Each listed row is named where it is."""
    path = jsonl_with_an_empty_chosen(tmp_path / "my.jsonl")
    report = tmp_path / "r.json"
    argv = [path, "--tokenizer", "builtin:tiny-olmo3", "--num-proc", "1", "--skip-invalid", "--json", str(report)]
    assert cli.main(argv) == 0
    assert "| 7 | line 9 of my.jsonl | chosen | empty completion" in capsys.readouterr().out
    assert json.loads(report.read_text())["invalid"]["rows"][0]["where"] == "line 9 of my.jsonl"


def test_a_row_of_a_folder_of_shards_is_named_by_its_file_and_line(cli, tmp_path, capsys):  # noqa: F811
    """A folder of data files is read as one data set, its files one after another: a bad row of its second file was
    located `row 8 (from 0) of shards`, which names no file to open (among a hundred shards: no way to find it)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs(6)))
    jsonl_with_an_empty_chosen(folder / "b.jsonl")  # row 7 of it, on its line 9: row 13 of the folder
    where = "(line 9 of shards/b.jsonl; fix"
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(["--config", str(SMOKE), "--dataset_name", str(folder), "--output_dir", str(tmp_path / "o")])
    assert str(refused.value).startswith("row 13, column 'chosen': empty completion") and where in str(refused.value)
    assert cli.main([str(folder), "--tokenizer", "builtin:tiny-olmo3", "--num-proc", "1"]) == 2
    assert where in error_line(capsys)
    assert not (tmp_path / "o").exists()


def test_a_csv_row_is_found_by_the_line_its_record_starts_on(tmp_path):
    """A quoted field spanning two lines moves every later record down a line."""
    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "chosen", "rejected"])
        writer.writerow(["two\nlines", "a", "b"])
        writer.writerow(["q", "c", "d"])
    assert data.row_location(str(path), 0) == "line 2 of pairs.csv"
    assert data.row_location(str(path), 1) == "line 4 of pairs.csv"
    assert data.row_location("org/hub-set", 3) == "row 3 (from 0) of org/hub-set"


def test_a_csv_row_after_a_blank_line_is_found_on_its_own_line(tmp_path):
    """pandas skips a blank line of a CSV file (datasets reads it so): counted as a record, it named the line above the
    bad row, a good pair the user would remove while the bad one stayed."""
    path = tmp_path / "pairs.csv"
    path.write_text("prompt,chosen,rejected\nQ0:, yes 0, no 0\n\nQ1:, yes 1, no 1\nQ2:, yes 2, no 2\nQ3:,, no 3\n")
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(["--config", str(SMOKE), "--dataset_name", str(path), "--output_dir", str(tmp_path / "o")])
    message = str(refused.value)
    assert message.startswith("row 3, column 'chosen': missing (null)") and "(line 6 of pairs.csv; fix" in message


def test_an_empty_hh_side_is_said_to_be_empty(tmp_path):
    hh = [
        {"chosen": f"\n\nHuman: q{i}\n\nAssistant: yes", "rejected": f"\n\nHuman: q{i}\n\nAssistant: no"}
        for i in range(6)
    ]
    hh[2]["chosen"] = ""
    path = tmp_path / "hh.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in hh))
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(
            ["--config", str(SMOKE), "--dataset_name", str(path), "--output_dir", str(tmp_path / "o"), "--dry-run"]
        )
    message = str(refused.value)
    assert message.startswith("row 2, column 'chosen': empty: an HH-RLHF conversation") and "(line 3 of hh" in message


@pytest.mark.parametrize(
    "where",
    ["answer", "another turn", "plain text"],
)
def test_an_answer_of_zero_width_characters_alone_is_refused_as_empty(tmp_path, where):
    """Zero-width and format characters (U+200B..U+200D, U+2060, U+FEFF), which `str.strip` keeps, beside a no-break
    space: an answer a reader sees as empty passed the empty check and trained as one. Refused as an empty one, named
    by its line; a NUL inside text is text (byte-level tokenizers write it as a byte: the row is kept)."""
    invisible = "\u00a0\u200b\u200c\u200d\u2060\ufeff"
    rows = pairs(12)
    rows[0]["chosen"][-1]["content"] = "yes\x00 0"  # kept: the run refuses row 7 alone
    if where == "plain text":
        rows = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(12)]
        rows[7]["chosen"] = invisible
    elif where == "another turn":  # a turn beside the answer, which the package would train as one of its own
        rows[7]["chosen"].append({"role": "assistant", "content": invisible})
    else:
        rows[7]["chosen"][-1]["content"] = invisible
    path = tmp_path / "my.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(["--config", str(SMOKE), "--dataset_name", str(path), "--output_dir", str(tmp_path / "o")])
    message = str(refused.value)
    assert message.startswith("row 7, column 'chosen': ") and "(line 8 of my.jsonl; fix" in message, message
    assert "empty" in message and "U+200B" in message, message


def test_the_rows_a_run_drops_are_recorded_where_they_are(tmp_path):
    """`--skip_invalid true` recorded the dropped rows by index alone (`derived.invalid_rows.first`: index 7), which a
    reader of a .jsonl takes for its line 7 or 8: the row is on line 9. Each is recorded where a refusal names it."""
    path = jsonl_with_an_empty_chosen(tmp_path / "my.jsonl")
    out = tmp_path / "o"
    argv = ["--config", str(SMOKE), "--dataset_name", path, "--output_dir", str(out), "--skip_invalid", "true"]
    train_dpo.main([*argv, "--dry-run"])
    first = json.loads((tmp_path / "o.dry-run.json").read_text())["derived"]["invalid_rows"]["first"]
    assert [(p["index"], p["where"]) for p in first] == [(7, "line 9 of my.jsonl")]


@pytest.mark.parametrize("given", ["shards", "./shards/", "link"])
def test_a_bad_row_of_a_folder_given_relative_is_named_not_a_traceback(tmp_path, monkeypatch, given):
    """datasets lists a folder's files by their absolute (resolved) paths: a folder given relative (`shards`) or
    by a link had its bad row end the run, the dry run and the analyzer in a ValueError traceback (`is not in the
    subpath of 'shards'`), not the refusal naming the file and line."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs(6)))
    jsonl_with_an_empty_chosen(folder / "b.jsonl")
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    assert data.row_location(given, 13) == f"line 9 of {'link' if given == 'link' else 'shards'}/b.jsonl"


def test_a_row_of_a_folder_of_arrow_shards_is_named_by_its_shard(tmp_path):
    """A folder of `.arrow` shards (a save_to_disk split's files copied out, without its state.json) is read as one
    data set: its bad row was named `row 11 (from 0) of arrows`, no shard to open; it is `row 4 (from 0)` of the
    second shard (7 rows each)."""
    import datasets

    rows = pairs(14)
    rows[11]["chosen"][-1]["content"] = ""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    (tmp_path / "arrows").mkdir()
    for shard in (tmp_path / "saved").glob("*.arrow"):
        (tmp_path / "arrows" / shard.name).write_bytes(shard.read_bytes())
    assert data.row_location(str(tmp_path / "arrows"), 11) == "row 4 (from 0) of arrows/data-00001-of-00002.arrow"


@pytest.mark.parametrize(
    "source",
    [
        {"path": "json", "data_files": "shards/*.jsonl"},
        {"path": "json", "data_dir": "shards"},
        {"path": "shards", "data_files": "b.jsonl"},
    ],
)
def test_a_bad_row_of_a_mixture_source_read_by_a_glob_or_data_dir_is_named_by_its_file(tmp_path, monkeypatch, source):
    """A mixture source read through datasets' `data_files` (a glob) or `data_dir` named its bad row `row 13 (from 0)
    of json [train] data_files=shards/*.jsonl`: no file to open. It is named by the file datasets read it from."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs(6)))
    jsonl_with_an_empty_chosen(folder / "b.jsonl")
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(SMOKE), "--datasets", json.dumps(source), "--output_dir", str(tmp_path / "o"), "--dry-run"]
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(argv)
    assert "(line 9 of shards/b.jsonl; fix" in str(refused.value)


def test_a_bad_row_of_one_of_two_mixture_files_of_the_same_name_says_which(tmp_path, monkeypatch):
    """Two mixture sources `a/train.jsonl` and `b/train.jsonl`: a bad row was named `line 9 of train.jsonl`, either
    file. A mixture's file source is named by its path."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    (tmp_path / "a" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs(12)))
    jsonl_with_an_empty_chosen(tmp_path / "b" / "train.jsonl")
    monkeypatch.chdir(tmp_path)
    mixer = ["--dataset_mixer_list", "a/train.jsonl", "1.0", "b/train.jsonl", "1.0"]
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(["--config", str(SMOKE), *mixer, "--output_dir", str(tmp_path / "o"), "--dry-run"])
    assert "(line 9 of b/train.jsonl; fix" in str(refused.value)


def test_the_folder_the_command_runs_in_is_read_as_a_data_set_and_its_bad_row_named(tmp_path, monkeypatch):
    """`--dataset_name .` in a folder of data files was refused as unreadable (datasets takes the folder's name from the
    path, and `.` has none: "dataset_name should be specified but got None"), telling the user to put the pairs
    there as .jsonl files, which they were. It is read as the folder, and its bad row named by the folder's name."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs(6)))
    jsonl_with_an_empty_chosen(folder / "b.jsonl")
    monkeypatch.chdir(folder)
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(
            ["--config", str(SMOKE), "--dataset_name", ".", "--output_dir", str(tmp_path / "o"), "--dry-run"]
        )
    assert str(refused.value).startswith("row 13, column 'chosen'") and "(line 9 of shards/b.jsonl; fix" in str(
        refused.value
    )


def test_a_row_of_a_json_array_is_named_by_the_line_it_starts_on_where_it_has_one_of_its_own(tmp_path):
    """A JSON file holding one array, written with an indent (json.dump(rows, f, indent=2)): its bad row was named
    `row 7 (from 0) of pairs.json`, to be counted out by hand among thousands of multi-line items. Named by the line
    the item starts on; an array written on one line keeps the row's position, every item being on line 1."""
    rows = pairs(12)
    rows[7]["chosen"][-1]["content"] = ""
    indented = tmp_path / "pairs.json"
    indented.write_text(json.dumps(rows, indent=2))
    lines = json.dumps(rows, indent=2).split("\n")
    start = [n for n, line in enumerate(lines, 1) if line == "  {"][7]
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(["--config", str(SMOKE), "--dataset_name", str(indented), "--output_dir", str(tmp_path / "o")])
    assert f"(line {start} of pairs.json; fix" in str(refused.value)
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(rows))
    assert data.row_location(str(flat), 7) == "row 7 (from 0) of flat.json"

"""Inputs a researcher brings that the earlier rounds did not try (session 47): recipes, data files and model folders
read as the user meant them, or refused in one line naming the fix before the model loads."""

import os
import shutil
from pathlib import Path

import datasets
import pytest

from conftest import ROOT
from dpotrain.data import data, lengths, rows
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

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


@pytest.mark.parametrize("line", ["dataset_config: no", "output_dir: yes", "run_name: off"])
def test_a_name_yaml_reads_as_a_boolean_is_refused_naming_the_quotes(line, tmp_path, monkeypatch):
    """YAML 1.1 reads an unquoted yes, no, on or off as a boolean, which became the word 'true' or 'false': a data
    set's configuration `no` (Norwegian) was asked for as 'false', `output_dir: yes` trained into a folder named
    `true`, and the run said nothing of it. Quoted, the text is read as written."""
    monkeypatch.chdir(tmp_path)
    key, value = line.split(": ")
    path = recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\n{line}\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    boolean = "true" if value in ("yes", "on") else "false"
    assert str(refused.value) == (
        f"{path}: {key} takes text, and YAML reads its unquoted value as the boolean {boolean} (yes, no, on and off "
        f"too): quote it ({key}: 'no')"
    )
    quoted = parse_args(["--config", recipe(tmp_path, f"dataset_name: {SMOKE_DATA}\n{key}: '{value}'\n")])
    assert {**vars(quoted.script), **vars(quoted.training)}[key] == value


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
            "message 0 (user): the same content, but name none in chosen, 'alice' here",
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

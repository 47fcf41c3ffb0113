"""Inputs a researcher brings that the earlier rounds did not try (session 47): recipes, data files and model folders
read as the user meant them, or refused in one line naming the fix before the model loads."""

import os

import pytest

from conftest import ROOT
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

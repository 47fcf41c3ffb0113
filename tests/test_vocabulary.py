"""One vocabulary across the tools: the analyzer and the scripts take train_dpo.py's names for the same things, every
tool answers a mistyped flag with "did you mean", and the dry run's analyzer hint repeats the user's own overrides."""

import json
import shlex

import pytest
from test_analyzer import error_line

from conftest import ROOT
from dpotrain import stages
from dpotrain.recipe.config import parse_args

SMOKE = str(ROOT / "configs" / "smoke.yaml")
DATA = str(ROOT / "data" / "smoke_prefs.jsonl")


def test_the_analyzer_takes_the_trainers_spellings(cli, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "r.json"
    argv = [
        "--dataset_name",
        DATA,
        "--model_name_or_path",
        "builtin:tiny-olmo3",
        "--skip_invalid",
        "true",
        "--num_proc",
        "1",
        "--sample",
        "16",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 16 and report["tokenizer"] == "builtin:tiny-olmo3"


@pytest.mark.parametrize(
    ("argv", "suggested"),
    [(["--skip-invalidd"], "--skip-invalid"), (["--model_name_or_pth", "x"], "--model_name_or_path")],
)
def test_the_analyzer_suggests_the_flag_meant(cli, capsys, argv, suggested):  # noqa: F811
    assert cli.main([DATA, *argv]) == 2
    assert f"(did you mean {suggested}?)" in error_line(capsys)


def test_push_to_hub_suggests_the_flag_meant(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("push_to_hub", ROOT / "scripts" / "push_to_hub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(Exception) as refused:
        module.main([str(tmp_path), "--repo_idd", "org/x"])
    assert "(did you mean --repo_id?)" in str(refused.value)


def _script(name: str):
    """scripts/<name>.py as a module (its `main(argv)`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "argv", "says"),
    [
        (
            "prefetch",
            ["--config"],
            "--config takes a value (the recipe the job runs, e.g. configs/think.yaml): none given",
        ),
        ("preflight", ["--sample", "abc"], "--sample takes a whole number (e.g. --sample 512), not 'abc'"),
        (
            "push_to_hub",
            ["out", "--repo_id"],
            "--repo_id takes a value (org/name to push to (default: hub_model_id of the run)): none given",
        ),
        ("push_to_hub", ["out", "--repo-id"], "--repo-id takes a value"),
        ("push_to_hub", ["out", "--private", "maybe"], "--private takes true or false (alone: true), not 'maybe'"),
        (
            "push_to_hub",
            ["out", "--hub_private_repo=maybe"],
            "--hub_private_repo takes true or false (alone: true), not 'maybe'",
        ),
    ],
)
def test_a_scripts_missing_or_mistyped_value_is_one_line_naming_the_flag_and_what_it_takes(name, argv, says):
    """The scripts said argparse's "argument --sample: expected one argument; see ... --help" where train_dpo.py names
    what the flag takes (usage.value_refused): the same words, from the same code (cli.Parser). The flag as typed:
    argparse names its first spelling, `--repo-id` for `--repo_id`, `--private` for `--hub_private_repo`."""
    from dpotrain.recipe.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        _script(name).main(argv)
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_the_analyzers_missing_or_mistyped_value_is_one_line_naming_the_flag_and_what_it_takes(cli, capsys):  # noqa: F811
    assert cli.main([DATA, "--sample"]) == 2
    assert error_line(capsys) == (
        "error: --sample takes a whole number (analyse N rows drawn with --seed instead of every row): none given"
    )
    assert cli.main([DATA, "--skip-invalid", "maybe"]) == 2
    assert error_line(capsys) == "error: --skip-invalid takes true or false (alone: true), not 'maybe'"


def test_the_dry_runs_analyzer_hint_repeats_the_users_overrides(cli):  # noqa: F811
    recipe = parse_args(
        ["--config", SMOKE, "--model_name_or_path", "org/my-sft", "--dataset_name", "org/pairs", "--dry-run"]
    )
    words = shlex.split(stages.analyze_command(recipe))
    assert words[:4] == ["python", "scripts/analyze_dataset.py", "--config", SMOKE]
    assert dict(zip(words[4::2], words[5::2], strict=True)) == {
        "--model_name_or_path": "org/my-sft",
        "--dataset_name": "org/pairs",
    }
    args = cli.parse_args(words[2:])  # the analyzer reads the hint as meant: this model, this data set
    assert (args.tokenizer, args.dataset, args.config) == ("org/my-sft", "org/pairs", SMOKE)


def test_the_dry_runs_analyzer_hint_measures_the_runs_mixture_seed_and_turns(cli, tmp_path):  # noqa: F811
    """`--dataset_mixer_list a.jsonl 50 b.jsonl 0.5 --seed 7 --assistant_turns final --max_length auto` on a model not
    cached here: the dry run's "to see it now" command named the model alone, so the analyzer measured the recipe's
    data set (data/smoke_prefs.jsonl), at the recipe's seed and assistant_turns, not the pairs this run trains."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    lines = open(DATA).readlines()
    a.write_text("".join(lines[:100]))
    b.write_text("".join(lines[100:]))
    given = ["--dataset_mixer_list", str(a), "50", str(b), "0.5", "--dataset_mixer_list_splits", "train"]
    given += ["--seed", "7", "--assistant_turns", "final", "--max_length", "auto", "--truncation_mode", "keep_end"]
    run = parse_args(["--config", SMOKE, "--model_name_or_path", "org/my-sft", *given, "--dry-run"])
    words = shlex.split(stages.analyze_command(run))
    measured = cli.read_run(cli.parse_args(words[2:]))  # the recipe as the analyzer reads the hint
    for name in ("dataset_mixer_list", "dataset_mixer_list_splits"):
        assert getattr(measured.project, name) == getattr(run.project, name), name
    assert measured.script.dataset_name == run.script.dataset_name
    assert measured.project.assistant_turns == "final" and measured.training.seed == 7
    assert measured.max_length_auto and measured.training.truncation_mode == "keep_end"


def test_the_dry_runs_analyzer_hint_measures_the_runs_held_out_pairs(cli, tmp_path):  # noqa: F811
    """`--dataset_mixer_eval_list held.jsonl 1.0 --eval_strategy steps --eval_steps 2`: the dry run's "to see it now"
    command left the held-out pairs out (the analyzer took none of those flags), so it never counted the pairs the run
    drops from them. The hint carries them, and the analyzer reads them as the run does."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(open(DATA).readlines()[:20]))
    given = ["--dataset_mixer_eval_list", str(held), "1.0", "--eval_strategy", "steps", "--eval_steps", "2"]
    run = parse_args(["--config", SMOKE, "--model_name_or_path", "org/my-sft", *given, "--dry-run"])
    words = shlex.split(stages.analyze_command(run))
    measured = cli.read_run(cli.parse_args(words[2:]))  # the recipe as the analyzer reads the hint
    assert measured.project.dataset_mixer_eval_list == run.project.dataset_mixer_eval_list == [str(held), "1.0"]
    assert measured.training.eval_strategy == "steps" and measured.training.eval_steps == 2


def test_the_dry_runs_analyzer_hint_measures_the_runs_trl_mixture(cli, tmp_path):  # noqa: F811
    """`--datasets '{path: a.jsonl, amount: 0.5}'` on a model not cached here: the dry run's "to see it now" command
    left the mixture out, and the analyzer measured the recipe's data set (data/smoke_prefs.jsonl) instead."""
    a = tmp_path / "a.jsonl"
    a.write_text("".join(open(DATA).readlines()[:20]))
    run = parse_args(
        ["--config", SMOKE, "--model_name_or_path", "org/my-sft", "--datasets", f"{{path: {a}, amount: 0.5}}"]
    )
    words = shlex.split(stages.analyze_command(run))
    measured = cli.read_run(cli.parse_args(words[2:]))  # the recipe as the analyzer reads the hint
    assert measured.project.datasets == run.project.datasets and measured.script.dataset_name is None


def test_the_analyzer_takes_the_runs_tokenizer_revision_and_own_code(cli, tmp_path, tiny_model_dir, capsys):  # noqa: F811
    """`--model_revision v2 --trust_remote_code true` on a model not cached here: the dry run's "to see it now" command
    left both out, and the analyzer had neither flag, so it measured main's tokenizer, or the one transformers loads
    without the model's own code (the run's adds a system turn: other lengths), or stopped on transformers' "contains
    custom code which must be executed", naming no flag. It takes both now, as train_dpo.py spells them."""
    from test_analyzer import own_code_tokenizer

    given = ["--model_revision", "v2", "--trust_remote_code", "true"]
    run = parse_args(["--config", SMOKE, "--model_name_or_path", "org/my-sft", *given, "--dry-run"])
    words = shlex.split(stages.analyze_command(run))
    measured = cli.read_run(cli.parse_args(words[2:]))  # the recipe as the analyzer reads the hint
    assert measured.model.model_revision == "v2" and measured.training.trust_remote_code is True
    folder = own_code_tokenizer(tmp_path / "model", tiny_model_dir)
    (folder / "config.json").unlink()  # a tokenizer alone: transformers loads none without its code
    json_path = tmp_path / "r.json"
    assert cli.main([DATA, "--tokenizer", str(folder), "--json", str(json_path)]) == 2
    assert error_line(capsys) == (
        f"error: the tokenizer of {str(folder)!r} runs its own code (auto_map in its tokenizer_config.json or "
        "config.json): read it, then give --trust_remote_code true"
    )
    assert cli.main([DATA, "--tokenizer", str(folder), "--trust_remote_code", "true", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["prompt"]["max"] > 50  # the smoke data's longest prompt, and its system


def test_a_boolean_is_spelled_the_same_for_the_scripts_as_for_train_dpo(cli):  # noqa: F811
    """The scripts' `--skip-invalid true|false` takes exactly the spellings train_dpo.py's parser takes (transformers'
    string_to_bool, their type too), and TRUE / FALSE, which the command-line readers match words against, name the
    same ones ("on" was once the scripts' alone, "t" and "y" the trainer's alone)."""
    from transformers.hf_argparser import string_to_bool

    from dpotrain.recipe.cli import FALSE, TRUE

    assert cli.parse_args([DATA, "--skip-invalid", "y"]).skip_invalid is True
    for word in ("true", "TRUE", "yes", "1", "t", "y", "false", "No", "0", "f", "n"):
        assert string_to_bool(word) is (word.lower() in TRUE), word
    assert set(TRUE) | set(FALSE) == {"true", "yes", "1", "t", "y", "false", "no", "0", "f", "n"}

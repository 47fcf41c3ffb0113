"""Recipes: defaults < YAML < command line, unknown keys refused, every shipped file resolves, dry runs load nothing."""

import json
import math
import os
import re
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import yaml

import train_dpo
from conftest import ROOT
from dpotrain import resolve
from dpotrain.data import mixture
from dpotrain.recipe import run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, run_cli
from dpotrain.train import losses

RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def environment(**env):
    """`env` set for a run in this process, and the environment as it was afterwards: a recipe's `env:` block sets
    its variables in the process (where unset), as in the user's `python train_dpo.py`, and must not outlive it."""
    return mock.patch.dict(os.environ, env)


@pytest.fixture
def dry_run(monkeypatch, capsys):
    """`python train_dpo.py ARGS --dry-run --json` from the project folder, run in this process (the imports are paid
    once per session, not once per run): the resolved configuration it prints."""
    monkeypatch.chdir(ROOT)

    def run(*args, env=None) -> dict:
        with environment(**(env or {})):
            train_dpo.main([*args, "--dry-run", "--json"])
        out = capsys.readouterr().out
        return json.loads(out[out.index("{") : out.rindex("}") + 1])

    return run


def test_precedence_defaults_then_yaml_then_cli(tmp_path):
    path = write(
        tmp_path, "beta: 2.0\nlearning_rate: 1e-6\nloss_type: [sigmoid_norm]\nmodel_name_or_path: m\nbf16: false\n"
    )
    recipe = parse_args(["--config", path, "--learning_rate", "3e-7"])
    assert recipe.training.beta == 2.0  # YAML over TRL's default 0.1
    assert recipe.training.learning_rate == 3e-7  # CLI over YAML
    assert recipe.training.loss_type == ["sigmoid_norm"]
    assert recipe.training.per_device_train_batch_size == 8  # untouched default
    assert recipe.given >= {"beta", "learning_rate", "loss_type", "model_name_or_path"}
    # YAML 1.1 reads `1e-6` as a string; it must still arrive as the float the field declares.
    assert parse_args(["--config", path]).training.learning_rate == 1e-6


def test_unknown_yaml_key_is_named_with_a_suggestion(tmp_path):
    path = write(tmp_path, "betta: 5.0\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml: unknown key 'betta' \(did you mean 'beta'\?\)"):
        parse_args(["--config", path])


@pytest.mark.parametrize(
    "line, says",
    [
        # it said "unknown key '--beta' (did you mean '--beta'?)": the fix it named was the key written
        ("--beta: 5.0", "key '--beta': a recipe's keys are field names without dashes: write `beta:`"),
        ("--learning-rate: 1.0e-6", "key '--learning-rate': a recipe's keys are field names without dashes: write "),
        # a recipe meant to build on another: "unknown key '--config' (did you mean '--fsdp_config'?)"
        ("config: configs/smoke.yaml", "unknown key 'config': a recipe includes no other recipe: copy the lines"),
        ("--config: configs/smoke.yaml", "unknown key '--config': a recipe includes no other recipe: copy the lines"),
        ("include: configs/smoke.yaml", "unknown key 'include': a recipe includes no other recipe: copy the lines"),
    ],
)
def test_a_key_written_as_a_flag_or_naming_another_recipe_says_what_to_write(line, says, tmp_path):
    with pytest.raises(ConfigError, match=r"^.*recipe\.yaml: " + re.escape(says)):
        parse_args(["--config", write(tmp_path, f"bf16: false\n{line}\n")])


def test_unknown_cli_argument_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown argument '--learning_rat' \(did you mean '--learning_rate'\?\)"):
        parse_args(["--learning_rat", "1e-6"])
    # no close match among train_dpo's 225 fields is named: at difflib's 0.6 '--precision' got '--hub_revision'
    with pytest.raises(ConfigError, match=r"^unknown argument '--precision'; see train_dpo.py --help$"):
        parse_args(["--precision", "bf16"])


def test_gradient_checkpointing_is_activation_checkpointing_and_the_command_line_wins(tmp_path):
    """transformers 5 reads its deprecated name only where `activation_checkpointing` is unset: the command line's
    `--gradient_checkpointing false` (open-instruct's flag) beside a recipe's `activation_checkpointing: true` was
    accepted and ignored, and `--gradient_checkpointing` did not turn on what the recipe had off."""
    path = write(tmp_path, "activation_checkpointing: true\nbf16: false\n")
    # argparse's own off switch for it (in --help-all) too: it was renamed to `--activation_checkpointing`, alone: on
    off_switches = (["--no_gradient_checkpointing"], ["--no-gradient-checkpointing"])
    for off in (["--gradient_checkpointing", "false"], ["--gradient-checkpointing=false"], *off_switches):
        recipe = parse_args(["--config", path, *off])
        assert (recipe.training.activation_checkpointing, recipe.training.gradient_checkpointing) == (False, False)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]  # activation_checkpointing: false
    recipe = parse_args(
        [*smoke, "--gradient_checkpointing", "--gradient_checkpointing_kwargs", '{"every_n_layers": 2}']
    )
    assert recipe.training.activation_checkpointing and recipe.training.activation_checkpointing_kwargs == {
        "every_n_layers": 2
    }
    assert "activation_checkpointing_kwargs" in recipe.given  # the memory plan keeps a given every_n_layers
    # The old name in a recipe still works, under the new name's last-value-wins.
    assert parse_args(
        ["--config", write(tmp_path, "gradient_checkpointing: true\nbf16: false\n")]
    ).training.activation_checkpointing


@pytest.mark.parametrize(
    "words, says",
    [
        (["--beta", "abc"], "--beta takes a number (e.g. --beta 0.1), not 'abc'"),
        (["--beta"], "--beta takes a number (e.g. --beta 0.1): none given"),
        (["--beta", "--max_steps", "3"], "--beta takes a number (e.g. --beta 0.1): none given"),
        (["--learning_rate", "1e-6x"], "--learning_rate takes a number (e.g. --learning_rate 1e-06), not"),
        (
            ["--max_length", "abc"],
            "--max_length takes a whole number or auto (e.g. --max_length 1024), not",
        ),
        (
            ["--max_length"],
            "--max_length takes a whole number or auto (e.g. --max_length 1024): none given",
        ),
        (["--max_length", "--beta", "1"], "--max_length takes a whole number or auto (e.g. --max_length 1024)"),
        (["--max-steps=1.5"], "--max_steps takes a whole number (e.g. --max_steps -1), not '1.5'"),
        (["--use_peft", "maybe"], "--use_peft takes true or false (alone: true), not 'maybe'"),
        (["--truncation_mode", "x"], "--truncation_mode takes one of keep_end, keep_start, not 'x'"),
        (["--loss_type"], "--loss_type takes one or more values (e.g. --loss_type sigmoid): none given"),
        (["--output_dir"], "--output_dir takes a value (The run's folder"),
        (["--loss_weights", "abc"], "--loss_weights takes one or more numbers (List of loss weights"),
    ],
)
def test_a_value_missing_or_of_the_wrong_type_is_one_line_naming_the_flag_and_what_it_takes(words, says):
    """argparse's own words were "argument --beta: expected one argument" and "argument --max_length/--max-length:
    invalid int value: 'abc'" (and `--max_length` alone "invalid int value: ''"), which say neither what the flag
    takes nor, for max_length, that `auto` is a value."""
    with pytest.raises(ConfigError) as refused:
        parse_args([*words, "--bf16", "false"])
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "line, words, says",
    [
        ("health_checks: 2", [], "health_checks in {} takes true or false (alone: true), not '2'"),
        ("health_checks: 2", ["--health_checks", "true"], "health_checks in {} takes true or false (alone: true), "),
        ("learning_rate: abc", [], "learning_rate in {} takes a number (e.g. learning_rate: 1e-06), not 'abc'"),
        ("truncation_mode: middle", [], "truncation_mode in {} takes one of keep_end, keep_start, not 'middle'"),
        ("loss_weights: []", [], "loss_weights in {} takes one or more numbers (List of loss weights"),
        ("max_length: abc", [], "max_length in {} takes a whole number or auto (e.g. max_length: 1024), not 'abc'"),
        ("beta: 5", ["--beta", "abc"], "--beta takes a number (e.g. --beta 0.1), not 'abc'"),
        ("seed: 1", ["--health_checks", "2"], "--health_checks takes true or false (alone: true), not '2'"),
    ],
)
def test_a_recipe_files_value_of_the_wrong_type_is_named_as_its_key_in_the_file(tmp_path, line, words, says):
    """A recipe's `health_checks: 2` was refused as "--health_checks takes true or false, not '2'": a flag nobody typed
    (or typed right, `--health_checks true`, over the file's value), the file unnamed. Named as the key in the file, as
    the recipe's other refusals are; a command line's value is still named as its flag."""
    recipe = write(tmp_path, f"bf16: false\n{line}\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", recipe, *words])
    assert str(refused.value).startswith(says.format(recipe)), str(refused.value)


@pytest.mark.parametrize(
    "args, recipe, says",
    [
        (["--learning_rate", "-1e-6"], "", "learning_rate must be > 0 (got -1e-06)"),
        ([], "learning_rate: -1e-6\n", "learning_rate must be > 0 (got -1e-06)"),
        (["--beta", "-1E-2"], "", "beta must be > 0 (got -0.01)"),
        (
            ["--max_length", "-1e3"],
            "",
            "--max_length takes a whole number or auto (e.g. --max_length 1024), not '-1e3'",
        ),
        (["--learning_rate", "-inf"], "", "learning_rate -inf is not a finite number"),
    ],
)
def test_a_negative_value_reaches_its_check_and_is_named(args, recipe, says, tmp_path):
    """argparse takes a word starting with `-` for a flag unless it looks like `-1` or `-0.5` to it: `--learning_rate
    -1e-6`, or a recipe's `learning_rate: -1e-6` passed on as the same words, was refused as "--learning_rate takes a
    number ...: none given", the value the user wrote never named."""
    with pytest.raises(ConfigError) as refused:
        resolve.check_values(parse_args(["--config", write(tmp_path, f"bf16: false\n{recipe}"), *args]))
    assert str(refused.value).startswith(says), str(refused.value)


@pytest.mark.parametrize(
    "args, recipe, says",
    [
        (["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "-1e-3", "--beta", "-2e-1"], "", "-0.001 x sft"),
        ([], "loss_type: [sigmoid, sft]\nloss_weights: [1, -1.5e-3]\n", "-0.0015 x sft"),
    ],
)
def test_a_negative_weight_in_a_list_reaches_its_check_and_is_named(args, recipe, says, tmp_path):
    """A list flag's negative number with an exponent, `--loss_weights 1 -1e-3` (or a recipe's list passed on as the
    same words), was refused as "unknown argument '-1e-3'": argparse took it for a flag. Read as the number it is."""
    parsed = parse_args(["--config", write(tmp_path, f"bf16: false\n{recipe}"), *args])
    assert parsed.training.beta == (-0.2 if args else 0.1)
    with pytest.raises(ConfigError) as refused:
        losses.check_options(parsed)
    assert str(refused.value).startswith(f"loss_weights: {says} is negative"), str(refused.value)
    with pytest.raises(ConfigError) as refused:  # a list of text takes no number: `-5e1` is no prompt made up here
        parse_args(["--config", write(tmp_path, "bf16: false\n"), "--sample_prompts", "hello", "-5e1"])
    assert "unknown argument '-5e1'" in str(refused.value)


@pytest.mark.parametrize("field", ["max_steps", "local_rank"])  # the fields whose default is a negative number
def test_a_negative_number_that_a_field_takes_is_still_read(field, tmp_path):
    as_flags = parse_args(["--config", write(tmp_path, "bf16: false\n"), f"--{field}", "-1"])
    in_recipe = parse_args(["--config", write(tmp_path, f"bf16: false\n{field}: -1\n")])
    assert getattr(as_flags.training, field) == getattr(in_recipe.training, field) == -1
    assert (
        parse_args(["--config", write(tmp_path, "bf16: false\n"), "--max_steps", "-1", "--beta", "-0.5"]).training.beta
        == -0.5
    )


def test_max_length_auto_is_recorded_and_a_later_value_wins(tmp_path):
    path = write(tmp_path, "max_length: auto\nbf16: false\n")
    assert parse_args(["--config", path]).max_length_auto
    recipe = parse_args(["--config", path, "--max_length", "2048"])
    assert not recipe.max_length_auto and recipe.training.max_length == 2048
    # `Auto` was "invalid int value: 'Auto'", which did not name the word it meant
    for spelt in (["--max_length", "Auto"], ["--max-length=AUTO"]):
        recipe = parse_args(["--config", path, "--max_length", "2048", *spelt])
        assert recipe.max_length_auto and recipe.training.max_length is None


@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_resolves_in_a_dry_run(recipe_path, dry_run):
    # Offline and with a model that cannot be loaded here: a dry run must not touch either. A recipe for the user's
    # own model (think-32b) names none and gets one on the command line, as its usage line says.
    declared = yaml.safe_load(recipe_path.read_text())
    model = [] if "model_name_or_path" in declared else ["--model_name_or_path", "org/your-sft-model"]
    resolved = dry_run("--config", str(recipe_path), *model, env={"HF_HUB_OFFLINE": "1"})
    declared.pop("env", None)
    for key, value in declared.items():
        if key in ("warmup_steps", "learning_rate"):
            assert math.isclose(resolved[key], float(value)), key
        elif key != "report_to" or value != ["none"]:
            assert resolved[key] == value, key
    derived = resolved["derived"]
    world = 1 if declared.get("accelerate_config") == "none" else 4  # the launch the README shows for the recipe
    assert derived["world_size"] == world  # accelerate_config.yaml, configs/accelerate/*.yaml: 4 processes
    # The memory plan: skipped where the model's config is not on this machine (or for the CPU demo, in fp32).
    assert derived["memory"].get("skipped") or derived["memory"]["per_gpu_gib"]["total"] > 0
    if resolved["max_tokens_per_microbatch"]:  # micro-batches cut by tokens: their count comes from the data
        assert derived["pairs_per_step"] == declared["pairs_per_step"]
        assert resolved["per_device_train_batch_size"] is None and resolved["gradient_accumulation_steps"] is None
    else:
        assert derived["pairs_per_step"] == (
            resolved["per_device_train_batch_size"] * resolved["gradient_accumulation_steps"] * world
        )
    assert resolved["output_dir"] == f"outputs/{resolved['run_name']}"
    assert "learning_rate" in resolved and "lr_scheduler_type" in resolved  # Trainer fields by their own names


def test_olmo3_recipes_hold_the_published_values():
    for name in ("think", "instruct"):
        resolved = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        assert resolved["loss_type"] == ["sigmoid_norm"] and resolved["beta"] == 5.0
        assert resolved["learning_rate"] == 1e-6 and resolved["lr_scheduler_type"] == "linear"
        assert resolved["warmup_steps"] == 0.1 and resolved["num_train_epochs"] == 1
        assert resolved["pairs_per_step"] == 128 and resolved["max_tokens_per_microbatch"] >= 2 * resolved["max_length"]
        assert resolved["bf16"] is True and resolved["activation_checkpointing"] is True


def test_32b_recipe_holds_olmo3s_32b_think_values_and_needs_your_model(monkeypatch, capsys):
    think = yaml.safe_load((ROOT / "configs" / "think.yaml").read_text())
    think32 = yaml.safe_load((ROOT / "configs" / "think-32b.yaml").read_text())
    assert think32["learning_rate"] == 7e-8 and think32["max_length"] == 8192  # OLMo 3, Table 48: 32B Think
    same = (
        "dataset_name",
        "loss_type",
        "beta",
        "lr_scheduler_type",
        "warmup_steps",
        "num_train_epochs",
        "weight_decay",
        "max_grad_norm",
        "pairs_per_step",
        "seed",
        "bf16",
        "activation_checkpointing",
    )
    assert {k: think32[k] for k in same} == {k: think[k] for k in same}
    assert think32["accelerate_config"] == "configs/accelerate/zero3.yaml"  # the engine its memory plan fits on
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as ended, environment(HF_HUB_OFFLINE="1"):  # ended as train_dpo.py's command line
        run_cli(lambda: train_dpo.main(["--config", "configs/think-32b.yaml", "--dry-run"]))
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: no model: set model_name_or_path in the recipe or pass --model_name_or_path"
    )


def test_dry_run_derives_steps_for_a_local_dataset(dry_run):
    derived = dry_run("--config", "configs/think.yaml", "--dataset_name", "data/smoke_prefs.jsonl")["derived"]
    # 384 pairs / 128 per step -> 3 steps, 10% warmup rounded up -> 1; 8 accumulation steps on 4 GPUs.
    assert derived == {**derived, "dataset_rows": 384, "total_steps": 3, "warmup_steps": 1, "pairs_per_step": 128}


def test_world_size_from_the_environment_keeps_128_pairs(dry_run):
    resolved = dry_run("--config", "configs/think.yaml", env={"WORLD_SIZE": "16"})
    assert resolved["derived"]["world_size"] == 16 and resolved["derived"]["pairs_per_step"] == 128
    # Micro-batches of a fixed number of pairs instead of a token budget: accumulation from the world size.
    fixed = ["--max_tokens_per_microbatch", "None", "--per_device_train_batch_size", "4"]
    resolved = dry_run("--config", "configs/think.yaml", *fixed, env={"WORLD_SIZE": "16"})
    assert resolved["gradient_accumulation_steps"] == 2 and resolved["derived"]["pairs_per_step"] == 128


def test_ddp_backend_in_a_recipe_run_or_planned_as_one_process_is_left_to_the_launch(dry_run, monkeypatch):
    """A cluster recipe's `ddp_backend: nccl` ended every process outside a launch of several (its dry run, a test
    run on one GPU) in `error: Default process group has not been initialized, please make sure to call
    init_process_group`: accelerate makes no process group for one process, then asks the one it was told of."""
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    planned = dry_run("--config", "configs/think.yaml", "--ddp_backend", "nccl")
    assert planned["derived"]["world_size"] == 4 and planned["ddp_backend"] is None
    alone = dry_run("--config", "configs/smoke.yaml", "--ddp-backend=gloo")
    assert alone["derived"]["world_size"] == 1 and alone["ddp_backend"] is None


def test_help_starts_with_what_users_type_and_every_option_is_one_flag_away(capsys):
    """--help: the usage with --config, the fields users set most and this project's options, short; --help-all: every
    field (argparse %-formats each help text: one bare percent sign once made it crash with a TypeError)."""
    with pytest.raises(SystemExit) as stop:
        parse_args(["--help"])
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: python train_dpo.py --config RECIPE") and len(shown.splitlines()) < 120
    assert "--dry-run" in shown and "--model_name_or_path" in shown and "--health_action" in shown
    assert shown.rstrip().endswith("python train_dpo.py --help-all")
    with pytest.raises(SystemExit) as stop:
        parse_args(["--help-all"])
    assert stop.value.code == 0
    every = capsys.readouterr().out
    assert "--auto_coverage" in every and "leaves 95% of pairs whole" in every and len(every.splitlines()) > 500


ENTRY_POINTS = ["train_dpo.py", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.py"))]


@pytest.mark.parametrize("where", ["project", "elsewhere"])
def test_outside_the_venv_every_entry_point_says_the_same_one_line(where, tmp_path):
    """`python train_dpo.py` or `python scripts/<any>.py` by a Python without the stack (here: this one with its
    site-packages left out, -S) is the same one line naming the fix (dpotrain/recipe/venv.py), not a ModuleNotFoundError
    traceback; the command it names runs from where it was typed (an absolute path from another folder)."""
    import re
    import subprocess
    import sys

    cwd = ROOT if where == "project" else tmp_path
    lines = set()
    for entry in ENTRY_POINTS:
        done = subprocess.run(
            [sys.executable, "-S", str(ROOT / entry) if where == "elsewhere" else entry, "--help"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and "Traceback" not in done.stderr, (entry, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (entry, done.stderr)
        lines.add(done.stderr.strip())
    assert len(lines) == 1, lines
    line = lines.pop()
    assert line.startswith(f"error: torch is not installed for {sys.executable}: run `source "), line
    activate = re.search(r"`source (\S+)`", line).group(1)
    assert (cwd / activate).is_file() and (where == "project") == (activate == ".venv/bin/activate"), line
    setup = re.search(r"`bash (\S+)`", line).group(1)
    assert (cwd / setup).is_file(), line


def test_the_missing_stack_commands_quote_a_project_path_with_spaces(tmp_path, monkeypatch):
    """A project in a folder with spaces: the `source ...` and `bash ...` commands named for a missing package were
    printed unquoted, and broke when pasted."""
    import importlib.util
    import re
    import shlex

    from dpotrain.recipe import venv

    project = tmp_path / "my projects" / "dpotrain"
    for name in (".venv/bin/python", ".venv/bin/activate", "scripts/setup_env.sh"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("")
    monkeypatch.setattr(venv, "ROOT", project)
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path / "runs")  # outside the project: its paths are printed in full
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as ended:
        venv.require()
    line = str(ended.value)
    assert shlex.split(re.search(r"`(source [^`]+)`", line).group(1)) == ["source", str(project / ".venv/bin/activate")]
    assert shlex.split(re.search(r"`(bash [^`]+)`", line).group(1)) == ["bash", str(project / "scripts/setup_env.sh")]


def test_config_spelt_with_an_equals_sign_or_given_twice(tmp_path):
    """`--config=PATH` was refused as "unknown argument '--config=...' (did you mean '--fsdp_config'?)", and a second
    --config (sbatch scripts/dpo_train.sh --config other.yaml: the script passes its RECIPE first) the same way."""
    path = write(tmp_path, "beta: 2.0\nbf16: false\n")
    assert parse_args([f"--config={path}", "--learning_rate", "3e-7"]).training.beta == 2.0
    assert parse_args([f"--config={path}"]).config_path == path
    with pytest.raises(ConfigError, match=r"--config is given 2 times .*: pass one recipe \(a Slurm job's is RECIPE="):
        parse_args(["--config", path, "--config", str(ROOT / "configs" / "smoke.yaml")])
    for argv in (["--config"], ["--config="], ["--config", "--beta", "2"]):
        with pytest.raises(ConfigError, match=r"^--config needs a path, e.g. --config configs/think.yaml$"):
            parse_args(argv)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("beta: 5.0\n42: 1\n", "recipe.yaml: unknown key 42. Remove it"),
        ("beta: 5.0\nenv:\n  - WANDB_MODE=offline\n", "recipe.yaml: env: is a mapping of environment variables"),
        ("beta: 5.0\nenv: WANDB_MODE=offline\n", "recipe.yaml: env: is a mapping of environment variables"),
    ],
)
def test_a_key_yaml_reads_as_a_number_or_an_env_that_is_no_mapping_is_one_line(text, expected, tmp_path):
    """Both ended in a traceback (AttributeError: 'int' object has no attribute 'lstrip' / 'list' ... 'items')."""
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_args(["--config", write(tmp_path, text)])


@pytest.mark.parametrize(
    "args, recipe, expected",
    [
        (["--max_grad_norm", "inf"], "", "max_grad_norm inf is not a finite number"),
        (["--beta", "nan"], "", "beta nan is not a finite number"),
        ([], "learning_rate: .inf\n", "learning_rate inf is not a finite number"),
        (
            ["--loss_type", "sigmoid", "sft", "--loss_weights", "1.0", "nan"],
            "",
            "loss_weights [1.0, nan] is not a finite number",
        ),
        # a mapping's number: the dry run's JSON held `"min_lr_rate": Infinity`
        ([], "lr_scheduler_kwargs: {min_lr_rate: .inf}\n", "{'min_lr_rate': inf} is not a finite number"),
        (["--lr_scheduler_kwargs", '{"min_lr_rate": NaN}'], "", "{'min_lr_rate': nan} is not a finite number"),
    ],
)
def test_a_value_that_is_not_a_finite_number_is_refused(args, recipe, expected, tmp_path):
    """`--max_grad_norm inf` was trained and recorded as `Infinity` in resolved_config.json and the dry run's JSON,
    which is not JSON: strict readers (jq, JavaScript, W&B's config) refuse the whole record."""
    path = write(tmp_path, f"bf16: false\n{recipe}")
    with pytest.raises(ConfigError, match=re.escape(expected) + r": give one \(an option that can be turned off"):
        parse_args(["--config", path, *args])


def test_a_mistyped_flag_is_named_without_its_value():
    """`--hub_tokn=hf_...` printed the token in its error line (a terminal, a Slurm log)."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--bf16", "false", "--hub_tokn=hf_secretvalue"])
    assert str(refused.value) == "unknown argument '--hub_tokn' (did you mean '--hub_token'?); see train_dpo.py --help"


def test_a_recipes_null_is_none_for_a_text_field_too(tmp_path):
    """`hub_model_id: null` (a copied recipe's value unset) reached argparse as the word "None", which a text field
    kept: the run pushed to a repo named None, read a chat template file named None, was named None."""
    text = (
        "bf16: false\nrun_name: null\nhub_model_id: null\nchat_template_path: null\nmax_tokens_per_microbatch: null\n"
    )
    recipe = parse_args(["--config", write(tmp_path, text)])
    assert recipe.training.hub_model_id is None and recipe.project.chat_template_path is None
    assert recipe.training.run_name == "recipe-dpo" and recipe.training.output_dir == str(Path("outputs/recipe-dpo"))
    assert recipe.project.max_tokens_per_microbatch is None
    # The command line's word wins over the recipe's null, as every value does.
    assert parse_args(["--config", write(tmp_path, text), "--hub_model_id", "org/x"]).training.hub_model_id == "org/x"


@pytest.mark.parametrize("args, text", [(["--run_name", ""], ""), (["--run_name", "  "], ""), ([], 'run_name: ""\n')])
def test_a_blank_run_name_is_refused_not_taken_for_unset(args, text, tmp_path):
    """`--run_name ''` named the run after the recipe (smoke-dpo: another run's name and folder), as if unset, and
    `--run_name '  '` named it, and its folder, `outputs/  `. A recipe's `run_name: null` still leaves it unset."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, f"bf16: false\n{text}"), *args])
    assert str(refused.value) == (
        f"run_name {args[-1] if args else ''!r} is blank: give the run a name, or remove run_name to name it after the "
        "recipe (or after --output_dir)"
    )


@pytest.mark.parametrize("name", ["a/b", "../x", ".", "..", "runs/"])
def test_a_run_name_naming_the_runs_folder_is_one_folders_name(name, tmp_path):
    """`--run_name a/b` trained into outputs/a/b, `--run_name ../x` into the project's x/, `.` into outputs/ itself,
    where the other runs are. With output_dir given, the run name is W&B's name alone, and any text holds."""
    recipe = write(tmp_path, "bf16: false\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", recipe, "--run_name", name])
    assert str(refused.value) == (
        f"run_name {name!r} names the run's folder, outputs/<run_name>, and is not one folder's name: name the run "
        "without '/' (--run_name my-run), or give its folder (--output_dir runs/my-run)"
    )
    given = parse_args(["--config", recipe, "--run_name", name, "--output_dir", str(tmp_path / "run")]).training
    assert (given.run_name, given.output_dir) == (name, str(tmp_path / "run"))
    assert parse_args(["--config", recipe, "--run_name", "my.run..v2"]).training.output_dir == str(
        Path("outputs/my.run..v2")
    )


@pytest.mark.parametrize(
    "args, text, part",
    [
        (["--output_dir", ""], "", ""),
        (["--output_dir", " "], "", ""),
        (["--output_dir", "runs/ "], "", " in part"),
        (["--output_dir", "  /x"], "", " in part"),
        ([], 'output_dir: " "\n', ""),
    ],
)
def test_a_blank_output_dir_is_refused(args, text, part, tmp_path):
    """`--output_dir ''` (an unset shell variable) trained in the working folder and wrote its dry-run file beside it
    (`<cwd>.dry-run.json`); `--output_dir ' '` named the run ' ' and its folder an invisible ' '."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, f"bf16: false\n{text}"), *args])
    assert str(refused.value) == (
        f"output_dir {args[-1] if args else ' '!r} is blank{part}: name the run's folder (--output_dir "
        "outputs/my-run), or remove output_dir for outputs/<run_name>"
    )
    # A name with spaces inside it is a name.
    assert parse_args(["--config", write(tmp_path, "bf16: false\n"), "--output_dir", "my run"]).training.run_name == (
        "my run"
    )


@pytest.mark.parametrize(
    "name, default",
    [
        ("accelerate_config", "accelerate_config.yaml"),
        ("dataset_train_split", "train"),
        ("report_to", "none"),  # was ['None']: transformers' "None is not supported" once the trainer was built
        ("loss_type", ["sigmoid"]),  # a default_factory's
    ],
)
def test_a_recipes_null_for_a_field_that_needs_a_value_is_refused_in_one_line(tmp_path, name, default):
    """`accelerate_config: null` became None, which the dry run's engine reading called .lower() on (an
    AttributeError traceback); a field whose default is a value is refused, naming that default."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, f"bf16: false\n{name}: null\n")])
    assert str(refused.value) == (
        f"{name}: null in the recipe, but {name} needs a value: delete the line for its default ({default!r}) or "
        "write one"
    )


def test_a_recipes_max_length_null_is_unbounded_as_the_command_lines_is(tmp_path):
    """`max_length: null` (TRL's None: no pair cut, docs/max_length.md) was refused as "max_length needs a value:
    delete the line for its default (1024)", while `--max_length null` trained unbounded: the recipe could not say what
    the command line can. Its record names whose null it was."""
    recipe = parse_args(["--config", write(tmp_path, "bf16: false\nmax_length: null\n")])
    assert recipe.training.max_length is None and not recipe.max_length_auto and "max_length" in recipe.given
    typed = parse_args(["--config", write(tmp_path, "bf16: false\n"), "--max_length", "null"]).training.max_length
    assert typed is None
    assert (
        parse_args(
            ["--config", write(tmp_path, "bf16: false\nmax_length: null\n"), "--max_length", "512"]
        ).training.max_length
        == 512
    )
    lengths = run_record.RecordedLengths(None, None, None, "the recipe's")
    assert lengths.chosen_by == "none: the recipe's max_length: null"


def test_a_recipes_text_starting_with_a_dash_is_its_value_as_the_command_lines_joined_one_is(tmp_path):
    """`run_name: "-ablation"` reached argparse as `--run_name -ablation`, whose word starting with `-` it takes for a
    flag: refused as "--run_name takes a value: none given", while `--run_name=-ablation` named the run. A negative
    number is still the number."""
    recipe = parse_args(["--config", write(tmp_path, 'bf16: false\nrun_name: "-ablation"\nlearning_rate: -1e-6\n')])
    assert recipe.training.run_name == "-ablation" and recipe.training.output_dir == str(Path("outputs/-ablation"))
    assert recipe.training.learning_rate == -1e-6
    typed = parse_args(["--config", write(tmp_path, "bf16: false\n"), "--run_name=-ablation"]).training.run_name
    assert typed == "-ablation"


@pytest.mark.parametrize(
    "line, said",
    [
        ('"WANDB=PROJECT": x', "env: 'WANDB=PROJECT' is no variable name: write it in letters, digits and _"),
        ('"": x', "env: '' is no variable name"),
        ('MY_NOTE: "a\\0b"', "env: MY_NOTE's value holds a NUL character, which no variable holds: remove it"),
    ],
)
def test_an_env_entry_the_environment_cannot_hold_is_one_line(line, said, tmp_path):
    """os.environ refuses a name holding `=` or empty, and a value holding a NUL: a ValueError (an OSError) traceback
    from every entry point, after the recipe had been read and checked."""
    with environment(), pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  {line}\n")])
    assert said in str(refused.value)


def test_a_recipes_null_is_none_for_a_list_field_too(tmp_path):
    """`datasets: null` beside dataset_name (a recipe saying it trains no mixture) was the mixture ['None'], refused as
    'dataset_name and a mixture'; any list field's null was a list of the word None, or refused as a number
    (`loss_weights: null`: invalid float value: 'None'); `output_dir: null` left no output folder at all."""
    text = f"bf16: false\ndataset_name: {ROOT / 'data' / 'smoke_prefs.jsonl'}\ndatasets: null\n"
    text += "dataset_mixer_list: null\nsample_prompts: null\nloss_weights: null\noutput_dir: null\n"
    recipe = parse_args(["--config", write(tmp_path, text)])
    p = recipe.project
    assert (p.datasets, p.dataset_mixer_list, p.sample_prompts, recipe.training.loss_weights) == (None,) * 4
    assert recipe.training.output_dir == str(Path("outputs/recipe-dpo"))  # was None: the default, not a folder
    mixture.check(recipe)  # dataset_name alone: no mixture
    given = parse_args(["--config", write(tmp_path, text), "--sample_prompts", "None"])  # the command line's word
    assert given.project.sample_prompts == ["None"]


@pytest.mark.parametrize("field", ["liger_kernel_config", "parallelism_config"])
def test_a_field_argparse_cannot_read_is_refused_by_name_with_the_fix(field, tmp_path):
    """Typed as a dict and as accelerate's ParallelismConfig, these fields could not be set at all: any value, in the
    recipe or on the command line, stopped in argparse's "invalid dict value", which named no fix."""
    for args in (
        ["--config", write(tmp_path, f"bf16: false\n{field}:\n  rope: true\n")],
        ["--bf16", "false", f"--{field.replace('_', '-')}={{}}"],
    ):
        with pytest.raises(ConfigError) as refused:
            parse_args(args)
        assert str(refused.value).startswith(f"{field} cannot be set here: ")
        assert str(refused.value).endswith(f": remove {field}")


def test_a_list_for_a_one_value_field_is_refused_by_name(tmp_path):
    """`dataset_name: [a.jsonl, b.jsonl]` became the words `--dataset_name a.jsonl b.jsonl`, refused as "unknown
    argument 'b.jsonl'", which named neither the field nor the way to train several files.
    A list of one is its value."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, "bf16: false\ndataset_name: [a.jsonl, b.jsonl]\n")])
    assert str(refused.value) == (
        f"{tmp_path / 'recipe.yaml'}: dataset_name takes one value and the recipe gives 2: give one (several files of "
        "pairs: one source of a mixture, `datasets:` with `data_files`, docs/data.md)"
    )
    with pytest.raises(ConfigError, match=r": learning_rate takes one value and the recipe gives 2: give one$"):
        parse_args(["--config", write(tmp_path, "bf16: false\nlearning_rate: [1.0e-6, 2.0e-6]\n")])
    with pytest.raises(ConfigError, match=r": bf16 takes one value and the recipe gives 2: give one$"):  # a switch
        parse_args(["--config", write(tmp_path, "bf16: [true, false]\n")])
    assert (
        parse_args(["--config", write(tmp_path, "bf16: false\nlearning_rate: [2.0e-6]\n")]).training.learning_rate
        == 2e-6
    )


def test_a_mapping_for_a_one_value_field_is_refused_by_name(tmp_path):
    """`dataset_name: {path: json, data_files: ...}` (datasets' load arguments) went on as its JSON text, a Hub name the
    dry run passed and the run asked the Hub for ("fill the cache with prefetch.py --dataset_name '{...}'"). The
    fields that take a mapping still do."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, "bf16: false\ndataset_name: {path: json, data_files: a.jsonl}\n")])
    assert str(refused.value).startswith(
        f"{tmp_path / 'recipe.yaml'}: dataset_name takes one value and the recipe gives a mapping: give one (a source "
        "written as a mapping"
    )
    with pytest.raises(ConfigError, match=r": run_name takes one value and the recipe gives a mapping: give one$"):
        parse_args(["--config", write(tmp_path, "bf16: false\nrun_name: {a: 1}\n")])
    kwargs = "bf16: false\nlr_scheduler_kwargs: {min_lr: 1.0e-7}\nmodel_init_kwargs: {dtype: float32}\n"
    recipe = parse_args(["--config", write(tmp_path, kwargs)])
    assert recipe.training.lr_scheduler_kwargs == {"min_lr": 1e-7}


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--dataset_name", "a.jsonl", "b.jsonl"],
            "unknown argument 'b.jsonl': it follows the value of --dataset_name, which takes one: give one (several "
            "files of pairs: one source of a mixture, `datasets:` with `data_files`, docs/data.md)",
        ),
        (
            ["--report_to", "wandb", "tensorboard"],
            "unknown argument 'tensorboard': it follows the value of --report_to, which takes one: give one",
        ),
        (
            ["--output_dir=runs/a", "b"],
            "unknown argument 'b': it follows the value of --output_dir, which takes one: give one",
        ),
        # neither the value nor the word past it is printed: a token, or a part of one (`--hub_token $(cat file)`
        # of a file holding two lines, a token pasted with a space in it), went to the log
        (
            ["--hub_token", "hf_secret", "hf_secretTail"],
            "unknown argument (not shown: it may be a part of a token) after the value of --hub_token, which takes "
            "one: give the token alone",
        ),
        (
            ["--hub-token=hf_secret", "hf_secretTail"],
            "unknown argument (not shown: it may be a part of a token) after the value of --hub-token, which takes "
            "one: give the token alone",
        ),
        (
            ["--loss_type=sigmoid", "sft"],
            "unknown argument 'sft': --loss_type= takes the one word after `=`: give several after a space "
            "(--loss_type a b)",
        ),
        (["--bf16", "false", "--beta", "5", "--betta", "5"], "unknown argument '--betta' (did you mean '--beta'?)"),
    ],
)
def test_a_word_past_a_flags_value_on_the_command_line_is_refused_naming_the_flag(args, says):
    """`--dataset_name a.jsonl b.jsonl` and `--report_to wandb tensorboard` were refused as "unknown argument
    'b.jsonl'; see --help", which named neither the field nor what to do (the recipe's list of two said both)."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--bf16", "false", *args])
    assert str(refused.value).startswith(says) and "hf_secret" not in str(refused.value)


@pytest.mark.parametrize(
    "args, says",
    [
        (["learning_rate=1e-5"], "unknown argument 'learning_rate=...': a field is given as a flag, two hyphens: "),
        (
            ["max_steps", "10"],
            "unknown argument 'max_steps': a field is given as a flag, two hyphens: --max_steps VALUE",
        ),
        (["\u2013max_steps", "10"], "unknown argument '\u2013max_steps': a field is given as a flag, two hyphens: "),
        (["hub_token=hf_secret"], "unknown argument 'hub_token=...': a field is given as a flag, two hyphens: "),
        (["notes.txt"], "unknown argument 'notes.txt'; see train_dpo.py --help"),
    ],
)
def test_a_word_after_a_recipe_is_refused_as_the_users_not_the_recipes_last_fields(args, says, tmp_path):
    """The recipe's fields are words before the command line's: a stray word there (Hydra's `learning_rate=1e-5`, a
    field without its `--`, a `--` a web page turned into a long dash) was refused as "it follows the value of
    --samples_every, which takes one: give one", the recipe's last field, which the user never typed."""
    recipe = write(tmp_path, "bf16: false\nsamples_every: 0\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", recipe, *args])
    assert str(refused.value).startswith(says) and "hf_secret" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "flag, says",
    [
        ("--gpus-per-node=8", "an sbatch option: give it before the script (sbatch --gpus-per-node=... scripts/"),
        ("--nodes", "an sbatch option: give it before the script (sbatch --nodes=... scripts/"),
        ("--time=48:00:00", "an sbatch option: give it before the script"),
        ("--num_processes", "an option of accelerate launch: give it before train_dpo.py"),
        ("--config_file", "an option of accelerate launch: give it before train_dpo.py"),
    ],
)
def test_a_launchers_option_after_the_script_is_refused_saying_where_it_goes(flag, says):
    """`sbatch scripts/dpo_train.sh --gpus-per-node=8` (sbatch's options after the script reach the script, which
    hands them to train_dpo.py): the job, queued and started on its GPUs, ended at its dry run on "unknown argument
    '--gpus-per-node'; see train_dpo.py --help", which names no option to use. So with accelerate launch's after the
    script. The refusal says whose option it is and where it goes."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--bf16", "false", flag, "8"])
    name = flag.split("=")[0]
    assert str(refused.value).startswith(f"unknown argument {name!r} ({says}"), str(refused.value)


def test_epochs_typed_under_a_recipes_max_steps_are_refused_not_ignored(tmp_path, dry_run):
    """`--num_train_epochs 2` on the command line of a recipe with `max_steps: 10` trained 10 steps (0.208 epochs of
    the demo's data): max_steps wins, as in transformers, and the typed epochs were accepted and read by nothing."""
    recipe = tmp_path / "steps.yaml"
    recipe.write_text((ROOT / "configs" / "smoke.yaml").read_text() + "max_steps: 10\n")
    args = ["--config", str(recipe), "--output_dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError) as refused:
        dry_run(*args, "--num_train_epochs", "2")
    assert str(refused.value) == (
        "--num_train_epochs 2 would be ignored: the recipe's max_steps 10 wins over it (as in transformers): add "
        "--max_steps -1 to train 2 epochs, or remove --num_train_epochs"
    )
    assert dry_run(*args, "--num_train_epochs", "2", "--max_steps", "-1")["derived"]["total_steps"] == 96
    assert (
        dry_run(*args, "--max_steps", "4")["derived"]["total_steps"] == 4
    )  # the recipe's epochs, typed steps: as told


def test_an_env_variable_without_a_value_is_left_unset(tmp_path):
    """`WANDB_PROJECT:` (null) set the variable to the word "None": W&B logged to a project named None."""
    path = write(tmp_path, "bf16: false\nenv:\n  DPOTRAIN_TEST_UNSET:\n  DPOTRAIN_TEST_SET: offline\n")
    with environment():
        os.environ.pop("DPOTRAIN_TEST_UNSET", None)
        parse_args(["--config", path])
        assert "DPOTRAIN_TEST_UNSET" not in os.environ and os.environ["DPOTRAIN_TEST_SET"] == "offline"


def test_an_empty_variable_in_the_environment_wins_over_the_recipes_env_block_and_is_named(tmp_path, capsys):
    """One rule for `.env` and the recipe's `env:`: the environment wins, an empty variable too (set is given, as
    python-dotenv, accelerate and Slurm read it; `FOO= cmd` clears it for one command). `export WANDB_PROJECT=` in a
    shell profile hid the recipe's `WANDB_PROJECT: olmo3-dpo` in silence (transformers handed W&B an empty project
    name); a warning line now names it and the fix. A variable set to a value, or unset, says nothing."""
    path = write(tmp_path, "bf16: false\nenv:\n  DPOTRAIN_TEST_EMPTY: olmo3-dpo\n  DPOTRAIN_TEST_GIVEN: recipe\n")
    with environment():
        os.environ.update(DPOTRAIN_TEST_EMPTY="", DPOTRAIN_TEST_GIVEN="shell")
        parse_args(["--config", path])
        assert (os.environ["DPOTRAIN_TEST_EMPTY"], os.environ["DPOTRAIN_TEST_GIVEN"]) == ("", "shell")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {path}: env: DPOTRAIN_TEST_EMPTY 'olmo3-dpo' is not used: DPOTRAIN_TEST_EMPTY is set empty in the "
        "environment, which wins over the recipe (as over .env): unset DPOTRAIN_TEST_EMPTY to take the recipe's"
    ]
    with environment():
        os.environ.pop("DPOTRAIN_TEST_EMPTY", None)
        parse_args(["--config", path])
        assert os.environ["DPOTRAIN_TEST_EMPTY"] == "olmo3-dpo"
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY"])
def test_a_secret_in_the_env_block_hidden_by_an_empty_variable_is_named_without_its_value(name, tmp_path, capsys):
    """`.env` copied from .env.example with its `HF_TOKEN=` line left blank, and the token in the recipe's `env:`
    block: the warning that the empty variable hides the recipe's quoted the token into the log (a Slurm log)."""
    secret = "hf_NOTPRINTEDNOTPRINTED"
    path = write(tmp_path, f"bf16: false\nenv:\n  {name}: {secret}\n")
    with environment():
        os.environ[name] = ""
        parse_args(["--config", path])
    err = capsys.readouterr().err
    assert secret not in err
    assert f"env: {name} (its value not shown: a secret) is not used: {name} is set empty" in err


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "eight"), ("GPUS_PER_NODE", "4x"), ("WORLD_SIZE", "0")])
def test_a_process_count_that_is_not_a_number_is_refused_in_one_line(name, value, tmp_path, monkeypatch):
    """`WORLD_SIZE=eight python train_dpo.py --dry-run` (the docs plan a launch with `WORLD_SIZE=16 GPUS_PER_NODE=8`):
    a ValueError traceback from whichever line read it first (GPUS_PER_NODE's: after the recipe was read)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, "bf16: false\n"), "--dry-run"])
    assert str(refused.value) == (
        f"{name}={value!r} is not a number of processes: give a whole number (WORLD_SIZE=16 GPUS_PER_NODE=8 plans 2 "
        "nodes of 8 GPUs), or unset it"
    )


LAUNCH_ENVIRONMENT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GPUS_PER_NODE",
    "TORCHELASTIC_ERROR_FILE",
)
BY_HAND = "accelerate launch and torchrun set it for each process they start; unset {0} to run as one process"


@pytest.mark.parametrize(
    "env, line",
    [
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 is set but RANK and WORLD_SIZE are not"),
        ({"LOCAL_RANK": "0", "RANK": "0"}, "LOCAL_RANK=0 is set but WORLD_SIZE is not"),
        ({"LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not a process's rank: " + BY_HAND.format("LOCAL_RANK")),
        ({"RANK": ""}, "RANK='' is not a process's rank: " + BY_HAND.format("RANK")),
        ({"WORLD_SIZE": ""}, "WORLD_SIZE='' is not a number of processes"),
        ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x' is not a number of processes"),
    ],
)
def test_a_launchers_variable_set_by_hand_is_one_line_the_process_writes(env, line, tmp_path, monkeypatch, capsys):
    """A shell's leftover `export LOCAL_RANK=1` ended `python train_dpo.py` in exit 2 and no line at all (a node's
    first process writes a refusal, and this one was told it was not: torch's "RANK expected, but not set" unsaid),
    LOCAL_RANK=0 in that torch line, and a RANK, LOCAL_RANK, LOCAL_WORLD_SIZE or an empty WORLD_SIZE that is not a
    number in a ValueError traceback. Ended as train_dpo.py's own process ends (its `__main__`)."""
    from dpotrain.recipe import launcher

    for name in LAUNCH_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    recipe = write(tmp_path, "bf16: false\n")
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: parse_args(["--config", recipe, "--dry-run"]), launcher.rank(), launcher.first_on_node())
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.startswith(f"error: {line}") and err.count("\n") == 1, err


def test_processes_that_fill_no_whole_number_of_nodes_are_refused(tmp_path, monkeypatch):
    """`WORLD_SIZE=8 GPUS_PER_NODE=3 python train_dpo.py --dry-run` planned "3 nodes of 3 GPUs" for 8 processes, a
    job scripts/launch.sh cannot start (one process per GPU on every node: 3 nodes make 9)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("GPUS_PER_NODE", "3")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", write(tmp_path, "bf16: false\n"), "--dry-run"])
    assert str(refused.value) == (
        "WORLD_SIZE=8 processes fill no whole number of nodes of GPUS_PER_NODE=3 (a job starts one process per GPU on "
        "every node): give a multiple of 3, e.g. WORLD_SIZE=6 or 9"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")  # fewer than a node: a part of one node, planned as such
    parse_args(["--config", write(tmp_path, "bf16: false\n"), "--dry-run"])


def test_home_and_variables_in_a_folder_of_the_recipes_env_block_are_read_as_a_shell_reads_them(tmp_path, monkeypatch):
    """`TRITON_CACHE_DIR: ~/triton` in `env:` was set as written (triton made a folder named `~` where the run ran),
    and `DPOTRAIN_CACHE: $SCRATCH/dpo` was refused as relative. A variable that is not set is refused by name."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    for name in ("TRITON_CACHE_DIR", "DPOTRAIN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    recipe = write(tmp_path, "bf16: false\nenv:\n  TRITON_CACHE_DIR: ~/triton\n  DPOTRAIN_CACHE: $SCRATCH/dpo\n")
    with environment():
        parse_args(["--config", recipe])
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / "triton")
        assert os.environ["DPOTRAIN_CACHE"] == str(tmp_path / "scratch" / "dpo")
    monkeypatch.delenv("SCRATCH")
    with pytest.raises(ConfigError) as refused, environment():
        parse_args(["--config", recipe])
    assert str(refused.value) == (
        f"{recipe}: env: DPOTRAIN_CACHE '$SCRATCH/dpo' names $SCRATCH, which is not set: export SCRATCH, or give the "
        "folder's absolute path"
    )


def test_an_env_value_that_is_no_folder_is_refused_with_its_own_fix(tmp_path, monkeypatch):
    """`WANDB_NOTES: cost in $USD` (a note, a token, a pattern) was refused "export USD, or give the folder's absolute
    path": no folder is named. Its fix is `$$`, which is a `$` in every value of the block, as in a shell's export."""
    monkeypatch.delenv("USD", raising=False)
    with pytest.raises(ConfigError) as refused, environment():
        parse_args(["--config", write(tmp_path, "bf16: false\nenv:\n  WANDB_NOTES: cost in $USD\n")])
    assert str(refused.value) == (
        f"{tmp_path / 'recipe.yaml'}: env: WANDB_NOTES 'cost in $USD' names $USD, which is not set: export USD, or "
        "write $$ for a $ meant as written"
    )
    with environment():
        parse_args(["--config", write(tmp_path, "bf16: false\nenv:\n  WANDB_NOTES: cost in $$USD, p@$$w0rd\n")])
        assert os.environ["WANDB_NOTES"] == "cost in $USD, p@$w0rd"


def test_a_dry_run_outside_a_job_leaves_the_jobs_slurm_variables_to_the_job(tmp_path, monkeypatch):
    """`TRITON_CACHE_DIR: /scratch/$SLURM_JOB_ID/triton` made the analyzer and prefetch.py (dry runs) refuse the recipe
    on a login node, where Slurm sets no variable: the job sets it. A run outside a job is still refused by name, and
    inside a job a SLURM_ variable that job does not set is not said to be "set only inside a Slurm job"."""
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    recipe = write(tmp_path, "bf16: false\nenv:\n  TRITON_CACHE_DIR: /scratch/$SLURM_ARRAY_TASK_ID/triton\n")
    with environment():
        parse_args(["--config", recipe, "--dry-run"])
        assert "TRITON_CACHE_DIR" not in os.environ
    with pytest.raises(ConfigError) as refused, environment():
        parse_args(["--config", recipe])
    assert "names $SLURM_ARRAY_TASK_ID, which is set only inside a Slurm job: `RECIPE=" in str(refused.value)
    with pytest.raises(ConfigError) as refused, environment(SLURM_JOB_ID="4242"):
        parse_args(["--config", recipe, "--dry-run"])
    assert str(refused.value) == (
        f"{recipe}: env: TRITON_CACHE_DIR '/scratch/$SLURM_ARRAY_TASK_ID/triton' names $SLURM_ARRAY_TASK_ID, which "
        "this Slurm job (4242) does not set: give the folder's absolute path"
    )
    # What names a variable the block leaves to the job is the job's too; the rest of such a value is checked
    for name in ("SCR", "MISSING", "HF_HUB_ETAG_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    leaves = "bf16: false\nenv:\n  SCR: /scratch/$SLURM_JOB_ID\n  TRITON_CACHE_DIR: ${SCR}/triton\n"
    with environment():
        parse_args(["--config", write(tmp_path, leaves), "--dry-run"])
        assert "SCR" not in os.environ and "TRITON_CACHE_DIR" not in os.environ
    for value, says in [
        ("TRITON_CACHE_DIR: $SLURM_JOB_ID/$MISSING", "names $MISSING, which is not set: export MISSING"),
        ("HF_HUB_ETAG_TIMEOUT: $SLURM_CPUS_ON_NODE", "HF_HUB_ETAG_TIMEOUT is read by the Hub libraries as they are"),
    ]:
        with pytest.raises(ConfigError) as refused, environment():
            parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  {value}\n"), "--dry-run"])
        assert says in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "name",
    [
        *("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_ENDPOINT"),
        *("HF_HUB_ENABLE_HF_TRANSFER", "HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ETAG_TIMEOUT"),
        *("HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_TELEMETRY"),
        *("HF_DATASETS_IN_MEMORY_MAX_SIZE", "HF_XET_HIGH_PERFORMANCE", "TRANSFORMERS_VERBOSITY"),
        # huggingface_hub's login file and its caches' base folders: `HF_TOKEN_PATH` set here left the run saying "no
        # Hugging Face token was found" beside the file; `XDG_CACHE_HOME` moved datasets' cache but not the models'
        *("HF_TOKEN_PATH", "XDG_CACHE_HOME", "HF_ASSETS_CACHE"),
    ],
)
def test_a_hub_cache_folder_in_the_recipes_env_block_is_refused(name, tmp_path, monkeypatch):
    """The recipe's `env:` is set as it is read, after huggingface_hub and datasets were imported, which read their
    cache folders and the Hub's address then: `HF_HOME: /scratch/hf` was set in the environment (and named by the
    printed prefetch command) while the run read and wrote ~/.cache/huggingface; `HF_ENDPOINT: https://mirror` was
    set while every download and push asked huggingface.co. The libraries' other switches read as they are imported
    (`HF_HUB_DOWNLOAD_TIMEOUT: 60`, `HF_HUB_DISABLE_PROGRESS_BARS: 1`, ...) were set, and ignored, in silence."""
    monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "my hf"
    with pytest.raises(ConfigError) as refused, environment():
        parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  {name}: {folder}\n")])
    assert str(refused.value) == (
        f"{tmp_path / 'recipe.yaml'}: env: {name} is read by the Hub libraries as they are imported, before the recipe "
        f"is: set it in .env or the shell ({name}='{folder}'), not in the recipe"
    )
    parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  {name}:\n")])  # sets nothing: nothing to refuse


def test_a_yes_no_on_or_off_in_the_recipes_env_block_is_set_as_written(tmp_path, monkeypatch):
    """YAML 1.1 reads an unquoted on/off/yes/no as a boolean, which the block set as Python's word: W&B's documented
    `WANDB_CONSOLE: off` was set to 'False', which wandb refuses ("WANDB_CONSOLE 'False' is not a value W&B takes"),
    naming a value the recipe never held. A variable is text: the word written is set."""
    for name in ("WANDB_CONSOLE", "DPOTRAIN_TEST_FLAG", "DPOTRAIN_TEST_OTHER"):
        monkeypatch.delenv(name, raising=False)
    text = "bf16: false\nenv:\n  WANDB_CONSOLE: off\n  DPOTRAIN_TEST_FLAG: Yes\n  DPOTRAIN_TEST_OTHER: true\n"
    with environment():
        parse_args(["--config", write(tmp_path, text)])
        assert os.environ["WANDB_CONSOLE"] == "off"
        assert os.environ["DPOTRAIN_TEST_FLAG"] == "Yes" and os.environ["DPOTRAIN_TEST_OTHER"] == "true"


def test_a_list_or_mapping_in_the_recipes_env_block_is_refused(tmp_path, monkeypatch):
    """A variable holds one text value: `WANDB_TAGS: [dpo, olmo3]` was set to Python's "['dpo', 'olmo3']", which W&B
    split at its comma into the tags "['dpo'" and " 'olmo3']", without a word; a mapping alike."""
    monkeypatch.delenv("WANDB_TAGS", raising=False)
    with pytest.raises(ConfigError) as refused, environment():
        parse_args(["--config", write(tmp_path, "bf16: false\nenv:\n  WANDB_TAGS: [dpo, olmo3]\n")])
    assert str(refused.value) == (
        f"{tmp_path / 'recipe.yaml'}: env: WANDB_TAGS is a list, and a variable holds one text value: write it as the "
        "program that reads it takes it (e.g. WANDB_TAGS: 'dpo,olmo3')"
    )
    assert "WANDB_TAGS" not in os.environ
    with pytest.raises(ConfigError, match=r"env: HF_TOKEN is a mapping, and a variable holds one text value"):
        with environment():
            parse_args(["--config", write(tmp_path, "bf16: false\nenv:\n  HF_TOKEN: {a: hf_secret}\n")])


def test_what_the_libraries_read_when_used_is_taken_from_the_recipes_env_block(tmp_path, monkeypatch):
    """Not every Hugging Face variable is refused in `env:`: the token and transformers' call-time switches work."""
    names = ("HF_TOKEN", "TRANSFORMERS_NO_ADVISORY_WARNINGS", "HF_MLFLOW_LOG_ARTIFACTS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    with environment():
        parse_args(["--config", write(tmp_path, "bf16: false\nenv:\n" + "".join(f"  {n}: '1'\n" for n in names))])
        assert all(os.environ[name] == "1" for name in names)


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_an_offline_switch_in_the_recipes_env_block_turns_the_hub_libraries_off(name, tmp_path, monkeypatch):
    """huggingface_hub and datasets read their offline switches as they are imported, before the recipe: a recipe's
    `env: {HF_HUB_OFFLINE: 1}` was in the environment, so the run's own checks took the Hub for off, while the libraries
    still asked the network for every file (minutes of retries on a node without one). They are told, as of `.env`."""
    import datasets.config
    from huggingface_hub import constants

    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    with environment():
        parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  {name}: 1\n")])
    assert constants.HF_HUB_OFFLINE == (name != "HF_DATASETS_OFFLINE")
    assert datasets.config.HF_DATASETS_OFFLINE is True


def test_a_relative_dpotrain_cache_in_the_recipes_env_block_is_refused(tmp_path, monkeypatch):
    """`DPOTRAIN_CACHE: cache` in a recipe was read from each command's folder as it was used: the analyzer's from
    where it ran, a job's from the project, so the lengths it measured were measured again by the job; a relative cache
    folder is one folder for every command (docs/hub.md). An absolute one, or one under ~, is set."""
    monkeypatch.delenv("DPOTRAIN_CACHE", raising=False)
    with pytest.raises(ConfigError, match=r"env: DPOTRAIN_CACHE 'cache' is relative, .*: give its absolute path"):
        with environment():
            parse_args(["--config", write(tmp_path, "bf16: false\nenv:\n  DPOTRAIN_CACHE: cache\n")])
    for folder in (str(tmp_path / "cache"), "~/dpotrain-cache"):
        with environment():
            parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  DPOTRAIN_CACHE: {folder}\n")])
            assert os.environ["DPOTRAIN_CACHE"] == os.path.expanduser(folder)  # ~ as a shell reads it


@pytest.mark.parametrize("name", ["HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "DPOTRAIN_CACHE"])
def test_a_cache_folder_the_environment_sets_is_not_refused_in_the_env_block(name, tmp_path, monkeypatch):
    """The environment wins over a recipe's `env:` block: where it sets the cache folder, the block's is never set and
    the libraries read the environment's, as before the block's cache folders were refused. A shared recipe naming the
    cluster's HF_HOME (or a relative DPOTRAIN_CACHE), run by a person whose shell or .env sets it too, was refused."""
    mine = str(tmp_path / "my cache")
    monkeypatch.setenv(name, mine)
    for value in ("/scratch/shared/hf", "cache"):
        with environment():
            parse_args(["--config", write(tmp_path, f"bf16: false\nenv:\n  {name}: {value}\n")])
            assert os.environ[name] == mine


def test_a_number_in_a_recipe_is_read_as_written(tmp_path, monkeypatch):
    """PyYAML (YAML 1.1) rewrote a number's text before argparse saw it: `model_revision: 1.10` fetched the revision
    "1.1", `0123` the octal 83, `save_steps: 0100` saved every 64 steps, an `env:` value `1.10` was set to "1.1". A
    recipe's value is now the word the command line would give."""
    monkeypatch.delenv("DPOTRAIN_TEST_VERSION", raising=False)
    path = write(
        tmp_path,
        "bf16: false\nmodel_revision: 1.10\ndataset_revision: 0123\nrun_name: 1:30\nsave_steps: 0100\n"
        "learning_rate: 5.0e-7\nlr_scheduler_kwargs: {min_lr_rate: 0.10}\nenv:\n  DPOTRAIN_TEST_VERSION: 1.10\n",
    )
    recipe = parse_args(["--config", path])
    assert recipe.model.model_revision == "1.10"
    assert recipe.project.dataset_revision == "0123"
    assert recipe.training.run_name == "1:30"
    assert recipe.training.save_steps == 100
    assert recipe.training.learning_rate == 5e-7
    assert recipe.training.lr_scheduler_kwargs == {"min_lr_rate": 0.1}  # inside a mapping, still a number
    assert os.environ["DPOTRAIN_TEST_VERSION"] == "1.10"


def test_a_number_with_an_exponent_and_no_decimal_point_is_a_number_inside_a_mapping_too(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-7`, without a decimal point, as text. A field's own value still became its float
    (argparse types the word), but inside a mapping it stayed text: `lr_scheduler_kwargs: {min_lr: 1e-7}` was refused
    as "cannot be built with {'min_lr': '1e-7'} (unsupported operand type(s) for /: 'str' and 'float')", naming no fix
    a user could see. A mixture's `amount: 1e3` is still refused: its decimal point says fraction or count."""
    path = write(
        tmp_path,
        "bf16: false\nlearning_rate: 1e-6\nlr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr: 1e-7}\n"
        "model_revision: 1e5\nenv:\n  DPOTRAIN_TEST_RATE: 1e-6\n",
    )
    with environment():
        recipe = parse_args(["--config", path])
        assert os.environ["DPOTRAIN_TEST_RATE"] == "1e-6"  # a word, as written
    assert recipe.training.lr_scheduler_kwargs == {"min_lr": 1e-7}
    assert recipe.training.learning_rate == 1e-6 and recipe.model.model_revision == "1e5"
    path = write(tmp_path, "bf16: false\ndatasets:\n  - path: data/smoke_prefs.jsonl\n    amount: 1e3\n")
    with pytest.raises(ConfigError, match=r"amount '1e3': write a fraction of the source with a decimal point"):
        mixture.parse(mixture.fields_of(parse_args(["--config", path])))


def test_a_number_with_a_decimal_point_and_an_unsigned_exponent_is_a_number_inside_a_mapping_too(tmp_path):
    """PyYAML (YAML 1.1) reads `1.0e6` as text too: its exponent has no sign (YAML 1.2, JSON and Python write it so).
    Inside a mapping it stayed text: `model_init_kwargs: {rope_parameters: {full_attention: {rope_theta: 1.0e6}}}` was
    recorded as "1.0e6" and ended the run in a traceback once the model loaded ("unsupported operand type(s) for ** or
    pow(): 'str' and 'Tensor'"). A field's own value keeps its text; a mixture's `amount: 1.5e3` is still refused."""
    rope = "{rope_type: default, rope_theta: 1.0e6}"
    path = write(
        tmp_path,
        f"bf16: false\nmodel_init_kwargs:\n  rope_parameters: {{full_attention: {rope}}}\nrun_name: 1.0e6\n",
    )
    recipe = parse_args(["--config", path])
    theta = recipe.training.model_init_kwargs["rope_parameters"]["full_attention"]["rope_theta"]
    assert theta == 1e6 and isinstance(theta, float)
    assert recipe.training.run_name == "1.0e6"  # text, as written
    path = write(tmp_path, "bf16: false\ndatasets:\n  - path: data/smoke_prefs.jsonl\n    amount: 1.5e3\n")
    with pytest.raises(ConfigError, match=r"amount '1.5e3': write a fraction of the source with a decimal point"):
        mixture.parse(mixture.fields_of(parse_args(["--config", path])))


def test_a_strategy_of_no_in_a_recipe_is_transformers_no(tmp_path):
    """YAML 1.1 reads an unquoted `no` as false: `save_strategy: no` (transformers' value, as docs/checks.md writes it)
    was refused as "--save_strategy takes one of no, steps, epoch, best, not 'false'", a word the recipe never held. A
    field of named choices takes the word written; one that is none of them is refused quoting it."""
    recipe = parse_args(["--config", write(tmp_path, "bf16: false\nsave_strategy: no\neval_strategy: no\n")])
    assert recipe.training.save_strategy == "no" and recipe.training.eval_strategy == "no"
    with pytest.raises(
        ConfigError, match=r"^save_strategy in \S+recipe.yaml takes one of no, steps, epoch, best, not 'off'$"
    ):
        parse_args(["--config", write(tmp_path, "bf16: false\nsave_strategy: off\n")])


def test_a_recipe_from_a_pipe_is_refused_as_one_not_as_missing(tmp_path):
    """`--config <(sed 's/1e-6/5e-7/' configs/think.yaml)` names /dev/fd/63, a pipe: refused as "recipe '/dev/fd/63'
    not found: pass one of configs/*.yaml", though it was there. A run reads its recipe again (each process of a
    launch), which a pipe cannot give: said so, with the fix."""
    pipe = tmp_path / "recipe.yaml"
    os.mkfifo(pipe)  # nothing writes to it: a read would block, so the refusal must come first
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", str(pipe)])
    assert str(refused.value) == (
        f"recipe {str(pipe)!r} is not a file but a pipe or device (as `<(...)` and /dev/stdin give), which reads once, "
        "and a run reads its recipe again (each process of a launch, the prefetch command it prints): write the recipe "
        "to a file and pass that"
    )


def test_a_data_set_on_the_command_line_does_not_take_the_recipes_configuration_and_commit(tmp_path):
    """A recipe's dataset_config and dataset_revision are its Hub data set's. `--dataset_name my.jsonl` kept them:
    refused as "dataset_config 'subset_a' names a configuration of a Hub data set, and 'my.jsonl' is a file: remove
    dataset_config", a line of the recipe no flag unsets (`--dataset_config ''` was refused alike); another Hub data set
    was asked for the recipe's configuration at the recipe's commit. Dropped, as a mixture on the command line drops
    them; the recipe's own data set named again keeps them, and so does one typed."""
    recipe = write(tmp_path, "bf16: false\ndataset_name: org/prefs\ndataset_config: subset_a\ndataset_revision: v1.0\n")

    def data(*args):
        s = parse_args(["--config", recipe, *args])
        return s.script.dataset_name, s.script.dataset_config, s.project.dataset_revision

    assert data("--dataset_name", "data/smoke_prefs.jsonl") == ("data/smoke_prefs.jsonl", None, None)
    assert data("--dataset_name", "org/other") == ("org/other", None, None)
    assert data("--dataset_name", "org/other", "--dataset_config", "b") == ("org/other", "b", None)
    assert data("--dataset_name", "org/prefs") == data() == ("org/prefs", "subset_a", "v1.0")


def test_a_recipes_chat_template_is_turned_off_on_the_command_line_as_its_refusal_says(tmp_path):
    """`--chat_template_path none` on a recipe naming a template (think.yaml), meaning the model's own, was refused as
    "'none' does not exist: give a .jinja file ...", with no word of how to ask for the model's own: `''`, which the
    refusal now names, and which is the model's own template."""
    from dpotrain.data import chat_template

    recipe = write(tmp_path, "bf16: false\nchat_template_path: configs/templates/olmo_thinker.jinja\n")
    with pytest.raises(ConfigError, match=r"\(for the model's own template: --chat_template_path ''\)$"):
        chat_template.check(parse_args(["--config", recipe, "--chat_template_path", "none"]).project.chat_template_path)
    own = parse_args(["--config", recipe, "--chat_template_path", ""]).project.chat_template_path
    chat_template.check(own)
    assert not own


def test_a_date_in_a_recipe_is_the_text_written(tmp_path):
    """YAML 1.1 reads an unquoted date as a `datetime.date`: inside a mapping (a mixture entry's configuration `name:
    2024-01-01`) the recipe's JSON words could not hold it, a TypeError traceback at parse; a field's own time was
    Python's spelling of it (`run_name: 2024-01-01T10:00:00Z` trained into `outputs/2024-01-01 10:00:00+00:00`)."""
    text = "bf16: false\ndatasets:\n  - path: org/prefs\n    name: 2024-01-01\n    amount: 0.5\n"
    recipe = parse_args(["--config", write(tmp_path, text + "run_name: 2024-01-01T10:00:00Z\n")])
    assert json.loads(recipe.project.datasets[0])["name"] == "2024-01-01"
    assert recipe.training.run_name == "2024-01-01T10:00:00Z"
    assert recipe.training.output_dir == "outputs/2024-01-01T10:00:00Z"


@pytest.mark.parametrize("value", ["-5", "0"])
def test_a_gpu_memory_that_is_no_memory_is_refused_at_parse(value, tmp_path):
    """`--gpu_memory_gib -5` was taken by the dry run and the analyzer ("GPUs of -5.0 GiB") until the memory plan
    refused it with advice for a GPU too small."""
    with pytest.raises(ConfigError, match=rf"^gpu_memory_gib must be > 0 \(got {value}\)"):
        parse_args(["--config", write(tmp_path, "bf16: false\n"), "--gpu_memory_gib", value])


def test_a_recipe_that_never_names_checkpointing_gets_trls_default_without_a_deprecation_warning(tmp_path):
    """TRL's DPOConfig defaults `gradient_checkpointing` (transformers 5's deprecated name) to True: every recipe that
    named neither spelling printed "FutureWarning: `gradient_checkpointing` is deprecated", on every rank, about a
    field its user never wrote. TRL's default is given under the new name, and not counted as the recipe's."""
    import warnings

    path = write(tmp_path, "bf16: false\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = parse_args(["--config", path])
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
    assert recipe.training.activation_checkpointing is True and "activation_checkpointing" not in recipe.given
    off = parse_args(["--config", path, "--gradient_checkpointing", "false"])  # the old name still read, as given
    assert off.training.activation_checkpointing is False and "activation_checkpointing" in off.given


def test_a_parse_leaves_the_next_one_its_defaults():
    """parse_args builds its parser once per process (issue #54: a third of its time): a field given in one parse, or
    a default list changed in the recipe it returned, is not the next parse's default (tests parse many)."""
    cpu = ["--bf16", "false"]
    first = parse_args([*cpu, "--beta", "0.3", "--loss_type", "sigmoid", "ipo"])
    default = parse_args(cpu)
    default.training.loss_type.append("sft")
    default.training.include_for_metrics.append("inputs")
    again = parse_args(cpu)
    assert (first.training.beta, first.training.loss_type) == (0.3, ["sigmoid", "ipo"])
    assert (again.training.beta, again.training.loss_type, again.training.include_for_metrics) == (0.1, ["sigmoid"], [])


def test_a_recipe_file_is_parsed_once_per_content_and_each_reader_gets_its_own(tmp_path, capsys, monkeypatch):
    """Issue #54: a run parsed its recipe's YAML twice (its fields, then whether it names a resume_from_checkpoint),
    and the tests parse the same recipes hundreds of times. Parsed once per content: a changed file is parsed anew,
    and a reader's change to its mapping (parse_args takes the `env:` block out) is not the next reader's."""
    from dpotrain.recipe import recipe_file

    parsed, get = [], recipe_file._StrictLoader.get_single_data
    monkeypatch.setattr(recipe_file._StrictLoader, "get_single_data", lambda self: parsed.append(1) or get(self))
    path = write(tmp_path, (ROOT / "configs" / "smoke.yaml").read_text() + "env:\n  DPOTRAIN_TEST_PARSED: '1'\n")
    train_dpo.main(["--config", path, "--output_dir", str(tmp_path / "run"), "--dry-run"])
    assert len(parsed) == 1 and "dry run of" in capsys.readouterr().out
    first = recipe_file.load(path)
    first.pop("env")
    assert recipe_file.load(path)["env"] == {"DPOTRAIN_TEST_PARSED": "1"} and len(parsed) == 1
    write(tmp_path, "beta: 0.3\n")
    assert recipe_file.load(path) == {"beta": 0.3} and len(parsed) == 2


def test_one_field_under_both_its_names_is_refused_in_a_recipe_and_said_on_the_command_line(
    tmp_path, monkeypatch, capsys
):
    """`activation_checkpointing: false` and, lower in the same recipe, `gradient_checkpointing: true` (transformers 5's
    old name of the same field) trained with checkpointing on, the last line winning without a word: a key given twice
    under one name is refused, so under two names too. On the command line the last counts, said as for one name."""
    path = write(tmp_path, "activation_checkpointing: false\nbf16: false\ngradient_checkpointing: true\n")
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", path])
    assert str(refused.value) == (
        f"{path}: gradient_checkpointing and activation_checkpointing are one field (transformers 5 renamed "
        "gradient_checkpointing to activation_checkpointing), and the recipe gives both: keep activation_checkpointing"
    )
    monkeypatch.setattr(
        "sys.argv",
        ["train_dpo.py", "--config", write(tmp_path, "bf16: false\n")]
        + ["--activation_checkpointing", "false", "--gradient_checkpointing", "true"],
    )
    assert parse_args().training.activation_checkpointing
    assert capsys.readouterr().err.strip().splitlines() == [
        "warning: --activation_checkpointing is given twice on the command line (false, then --gradient_checkpointing "
        "true): the last counts"
    ]


def test_a_field_given_twice_with_two_values_is_said_and_the_last_counts(tmp_path, monkeypatch, capsys):
    """`--learning_rate 1e-6 ... --learning_rate 2e-6` (a long command line edited, a flag added that was already
    there) trained at 2e-6 with no word said: argparse keeps the last value. The last still counts (a wrapper's
    defaults before the user's "$@" rely on it), and one warning line names both. The same value twice, in any
    spelling, means one thing and is not named; nor are the flags a launcher puts after the user's words to win
    (launch.sh's --accelerate_config and --dry-run --json, demo.sh's --overwrite_output_dir). A program's words
    (parse_args(argv): a test, a notebook) layer overrides in silence, as before."""
    path = write(tmp_path, "bf16: false\nreport_to: [none]\n")

    def typed(*words):  # the command line a person typed: sys.argv, as `python train_dpo.py ...` has it
        monkeypatch.setattr("sys.argv", ["train_dpo.py", "--config", path, *words])
        return parse_args()

    said = "warning: --learning_rate is given twice on the command line (1e-6, then 2e-6): the last counts"
    for twice in (
        ["--learning_rate", "1e-6", "--learning_rate", "2e-6"],
        ["--learning_rate=1e-6", "--learning-rate", "2e-6"],
    ):
        capsys.readouterr()
        assert typed(*twice).training.learning_rate == 2e-6
        assert capsys.readouterr().err.strip().splitlines() == [said]
        assert parse_args(["--config", path, *twice]).training.learning_rate == 2e-6  # a program's: the last
        assert capsys.readouterr().err == ""
    assert typed("--loss_type", "sigmoid", "--beta", "0.1", "--loss_type", "sigmoid", "sft").training.loss_type == [
        "sigmoid",
        "sft",
    ]
    assert "--loss_type is given twice on the command line (sigmoid, then sigmoid sft)" in capsys.readouterr().err
    same = typed("--learning_rate", "1e-6", "--learning_rate=1.0e-6", "--bf16", "false", "--bf16=False").training
    assert same.learning_rate == 1e-6 and not same.bf16
    launcher = ["--dry_run", "false", "--overwrite_output_dir", "false", "--overwrite_output_dir", "--dry-run"]
    assert typed(*launcher).project.dry_run
    assert capsys.readouterr().err == ""


def test_a_fields_on_and_off_switches_given_together_are_each_named(tmp_path, monkeypatch, capsys):
    """`--no_health_checks ... --health_checks true` warned "--no_health_checks is given twice on the command line
    (alone, then true)": read as `--no_health_checks true`, the opposite of what the last flag turned on. The other
    switch of the field is named, as an old name of it is."""
    path = write(tmp_path, "bf16: false\nreport_to: [none]\n")
    for words, said, last in (
        (["--no_health_checks", "--health_checks", "true"], "(alone, then --health_checks true)", True),
        (["--health_checks", "true", "--no-health-checks"], "(true, then --no-health-checks alone)", False),
    ):
        monkeypatch.setattr("sys.argv", ["train_dpo.py", "--config", path, *words])
        assert parse_args().project.health_checks is last
        assert said in capsys.readouterr().err


@pytest.mark.parametrize("spellings", [("--hub_token", "--hub_token"), ("--hub-token=", "--hub_token")])
def test_a_token_given_twice_is_said_without_its_values(spellings, tmp_path, monkeypatch, capsys):
    """`--hub_token hf_a ... --hub_token hf_b` (a wrapper's token, then the user's): the warning that the last counts
    printed both tokens, into the terminal, a `| tee` log and a Slurm job's log, where every other path blanks them."""
    path = write(tmp_path, "bf16: false\nreport_to: [none]\n")
    first, second = spellings
    words = [f"{first}hf_FIRSTsecret"] if first.endswith("=") else [first, "hf_FIRSTsecret"]
    monkeypatch.setattr("sys.argv", ["train_dpo.py", "--config", path, *words, second, "hf_LASTsecret"])
    assert parse_args().training.hub_token == "hf_LASTsecret"
    err = capsys.readouterr().err
    assert "hf_" not in err, err
    assert err.strip() == (
        f"warning: {first.rstrip('=')} is given twice on the command line (two values, not shown: a secret): the "
        "last counts"
    )


@pytest.mark.slow  # a process of its own: the Hub libraries' switches are this process's too
def test_a_recipes_offline_switch_does_not_outlive_its_run_in_the_process(tmp_path):
    """A recipe's `env: {HF_HUB_OFFLINE: "1"}` (or a silent Hub) turns the Hub libraries offline for its run. Called
    from a notebook (`train_dpo.main(argv)`), the run gives its environment back, but the libraries' switches stayed
    off: the notebook's next run, of a recipe without that block, read the cache alone, in silence."""
    from conftest import python

    smoke = (ROOT / "configs" / "smoke.yaml").read_text()
    recipe = tmp_path / "offline.yaml"
    recipe.write_text(smoke + '\nenv:\n  HF_HUB_OFFLINE: "1"\n')
    program = tmp_path / "notebook.py"
    program.write_text(
        "import datasets.config, train_dpo\nfrom huggingface_hub import constants\n"
        f"train_dpo.main(['--config', {str(recipe)!r}, '--output_dir', {str(tmp_path / 'run')!r}, '--dry-run'])\n"
        "print('switches', constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, "
        "datasets.config.HF_DATASETS_OFFLINE, 'HF_HUB_OFFLINE' in __import__('os').environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([python(), str(program)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "switches False False False False", result.stdout[-3000:]


@pytest.mark.parametrize("given", [["--rpo_alpha", "1.0"], "rpo_alpha: 1.0\n"], ids=["command_line", "recipe"])
def test_rpo_alpha_names_what_replaced_it(given, tmp_path):
    """TRL 1.x removed `rpo_alpha` (RPO: DPO plus alpha x the chosen answers' NLL) for its `sft` loss type in a weighted
    list; the refusal said only 'removed in TRL 1.x', leaving the user to find the replacement."""
    argv = given if isinstance(given, list) else ["--config", write(tmp_path, given)]
    with pytest.raises(ConfigError, match=re.escape("--loss_type <your loss_type> sft --loss_weights 1 <rpo_alpha>")):
        parse_args(argv)


@pytest.mark.parametrize("name", ["reference_free", "label_pad_token_id", "padding_value"])
@pytest.mark.parametrize("form", ["command_line", "recipe"])
def test_an_option_trl_1_removed_is_refused_with_its_fix(name, form, tmp_path):
    """`reference_free` and `label_pad_token_id` were refused with 'removed in TRL 1.x' alone: nothing said that the
    fix is to drop the option (TRL 1.x masks the loss's padding itself; its DPO loss always has a reference)."""
    argv = [f"--{name}", "1"] if form == "command_line" else ["--config", write(tmp_path, f"{name}: 1\n")]
    with pytest.raises(ConfigError, match=f"removed in TRL 1.x, .*: drop {name}"):
        parse_args(argv)


def test_batching_flags_note_is_said_by_the_main_process_alone(monkeypatch, capsys):
    """Every rank parses the recipe: the note that the command line's micro-batch flags replace the recipe's batching
    is the main process's line (RANK 0), not one per process (a 4-GPU x 8-node job wrote it 32 times)."""
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--per_device_train_batch_size", "1"]
    monkeypatch.setenv("RANK", "1")
    one = parse_args(smoke)
    assert "on the command line: micro-batches of" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert parse_args(smoke) == one
    assert "on the command line: micro-batches of 1 pair, 1 per step and process" in capsys.readouterr().err

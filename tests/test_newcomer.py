"""Issue #47, a newcomer's path: from the demo to a cluster dry run, every command as printed, no stumble.

Each case runs the real entry (`train_dpo.main` or `run_cli(train_dpo.main)`, in this process: cheap) on a login node
as a newcomer has it: no W&B login, no Hugging Face token, no GPU.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train_dpo
from conftest import ROOT, warm_venv
from dpotrain.recipe import venv
from dpotrain.recipe.errors import ConfigError, run_cli
from dpotrain.train import run_files

SMOKE = str(ROOT / "configs" / "smoke.yaml")
THINK = str(ROOT / "configs" / "think.yaml")
OLMO3_7B = str(ROOT / "configs" / "models" / "olmo3-7b")


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A fresh clone on a login node, in the project folder: no W&B key or mode, no ~/.netrc, no Hugging Face token or
    cached login, no .env (a developer's own .env, found beside train_dpo.py, is not read)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(venv, "load_env", lambda root: None)


def dry_run(capsys, *args) -> str:
    """The summary a dry run prints (exit status 0 checked)."""
    argv = [*args] if "--dry-run" in args else [*args, "--dry-run"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    out, err = capsys.readouterr()
    assert ended.value.code in (None, 0), out + err
    return out


# --- 11: the README's dry runs before credentials ---------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["think", "instruct"])
def test_a_dry_run_without_a_wandb_login_shows_its_plan_and_what_the_run_would_refuse(
    recipe, tmp_path, capsys, no_credentials
):
    out = dry_run(
        capsys,
        "--config",
        str(ROOT / "configs" / f"{recipe}.yaml"),
        "--model_name_or_path",
        OLMO3_7B,
        "--output_dir",
        str(tmp_path / "run"),
    )
    assert "memory/GPU:    ~" in out, out  # the plan, made
    refusals = [line for line in out.splitlines() if line.startswith("warning: the run would refuse: ")]
    # The model folder is a shape with no tokenizer (README step 4), which the run would refuse too.
    assert len(refusals) == 2 and "holds no tokenizer" in refusals[0], out
    assert "report_to wandb but no W&B login" in refusals[1] and "WANDB_MODE=offline" in refusals[1]


def test_a_dry_run_of_a_model_folder_without_its_weights_says_the_run_would_refuse_it(
    tmp_path, capsys, no_credentials, tiny_model_dir
):
    """A newcomer's hunt: a model folder copied to the login node with its config and tokenizer but not yet its weights
    passed the dry run without a word, and the run (a job, after its wait in the queue) refused it at start."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    out = dry_run(capsys, "--config", SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"))
    refusals = [line for line in out.splitlines() if line.startswith("warning: the run would refuse: ")]
    assert refusals == [
        f"warning: the run would refuse: model folder {str(model)!r} holds a config.json but no weights "
        "(model.safetensors, pytorch_model.bin or a sharded index): copy the weights save_pretrained wrote beside it, "
        "or give a Hub name like org/model"
    ], out


def test_a_dry_run_of_a_push_without_a_token_says_the_run_would_refuse_it(tmp_path, capsys, no_credentials):
    out = dry_run(
        capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--push_to_hub", "--hub_model_id", "me/x"
    )
    assert "warning: the run would refuse: push_to_hub is set but no Hugging Face token was found" in out, out


def test_a_wandb_identity_token_file_is_a_login(tmp_path, capsys, no_credentials, monkeypatch):
    """W&B's login by a workload identity (WANDB_IDENTITY_TOKEN_FILE, which wandb.init reads instead of a key) was
    refused as "no W&B login": only a key or ~/.netrc counted."""
    token = tmp_path / "identity-token"
    token.write_text("a-jwt\n")
    monkeypatch.setenv("WANDB_IDENTITY_TOKEN_FILE", str(token))
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "dry run of" in out and "no W&B login" not in out, out


def test_wandb_disabled_which_nothing_reads_any_more_is_refused_not_logged_online(
    tmp_path, capsys, no_credentials, monkeypatch
):
    """WANDB_DISABLED=true (older guides' switch) with a W&B login: transformers 5 and wandb no longer read it, and the
    run logged to W&B's server, which the user had turned off. The run refuses it, naming the switches that work."""
    monkeypatch.setenv("WANDB_DISABLED", "true")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert (
        "warning: the run would refuse: WANDB_DISABLED=true is read by neither transformers nor wandb any more: "
        "set WANDB_MODE=disabled, or pass --report_to none"
    ) in out, out
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the switch that works: nothing refused
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "WANDB_DISABLED" not in out, out


@pytest.mark.parametrize("host", [None, "https://wandb.example.com"], ids=["default", "own-server"])
def test_wandb_login_is_a_login_wherever_it_logged_in(host, tmp_path, capsys, no_credentials, monkeypatch):
    """`wandb login` writes its key to ~/.netrc for the server it logs in to: wandb's default, api.forge.coreweave.com
    since the wandb of requirements.txt, or `--host`'s, which it keeps in its settings file. The run looked for a key
    for api.wandb.ai alone, and refused either as "no W&B login", the remedy it names being `wandb login`."""
    from wandb.sdk.lib import settings_file, urls
    from wandb.sdk.lib.wbauth.wbnetrc import write_netrc_auth

    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    if host:  # what `wandb login --host` keeps
        stored = tmp_path / "wandb-config" / "settings"
        files = settings_file.SettingsFiles(global_settings=stored, local_settings=tmp_path / "no-workspace")
        files.set("base_url", host, globally=True)
        files.save()
    write_netrc_auth(host=host or urls.DEFAULT_BASE_URL, api_key="k" * 40)
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "dry run of" in out and "no W&B login" not in out, out


def test_a_malformed_wandb_key_in_netrc_is_refused_before_the_model_loads(
    tmp_path, capsys, no_credentials, monkeypatch
):
    """A ~/.netrc whose W&B key wandb rejects (a key pasted short): wandb.init raises AuthenticationError for it, after
    the model loaded, but the check took wandb's exception as "its internals moved" and let the run start. So too a
    WANDB_BASE_URL wandb refuses."""
    from wandb.sdk.lib import urls

    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {urls.DEFAULT_BASE_URL.split('://')[1]}\n  login user\n  password short-key\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "the run would refuse: report_to wandb, but wandb refuses the W&B key in ~/.netrc (or $NETRC" in out, out
    assert "API key must have 40+ characters" in out and "wandb login --relogin" in out, out
    assert "short-key" not in out  # the key itself never reaches the output
    monkeypatch.setenv("WANDB_BASE_URL", "https://app.wandb.ai")  # W&B's web page, which wandb.init refuses too
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "the run would refuse: report_to wandb, but wandb refuses its server address" in out, out
    assert "'https://app.wandb.ai' is not a valid server address" in out and "fix WANDB_BASE_URL" in out, out


@pytest.mark.parametrize(
    "key, said",
    [
        ("abc123def456-pasted-short", "API key must have 40+ characters"),
        ("k" * 40 + "'", "API key may only contain the letters A-Z, digits and underscores"),
    ],
    ids=["short", "stray-quote"],
)
def test_a_wandb_api_key_wandb_refuses_is_refused_before_the_model_loads(
    key, said, tmp_path, capsys, no_credentials, monkeypatch
):
    """A WANDB_API_KEY wandb rejects by its form (a key pasted short, a quote of the .env line left in it) passed the
    check (any value was a login): wandb.init raised AuthenticationError in a traceback once W&B started, after the
    model loaded and the reference was scored. So too a key set beside WANDB_IDENTITY_TOKEN_FILE, which wandb
    refuses. Refused in one line, by wandb's own check, the key never quoted."""
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", key)
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "the run would refuse: report_to wandb, but wandb refuses the W&B key in WANDB_API_KEY" in out, out
    assert said in out and key not in out, out
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # a key of wandb's form, beside a login by workload identity
    monkeypatch.setenv("WANDB_IDENTITY_TOKEN_FILE", str(tmp_path / "identity-token"))
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert (
        "both WANDB_API_KEY (in the environment) and WANDB_IDENTITY_TOKEN_FILE are set" in out and "k" * 40 not in out
    ), out
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE")
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb")
    assert "the run would refuse: report_to wandb" not in out, out


def test_the_run_itself_still_refuses_without_a_wandb_login(tmp_path, capsys, no_credentials):
    with pytest.raises(SystemExit) as ended:
        run_cli(
            lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb"])
        )
    assert ended.value.code == 2
    assert "error: report_to wandb but no W&B login" in capsys.readouterr().err


# --- 16: a dry run after the demo -------------------------------------------------------------------------------------


def test_a_dry_run_on_a_finished_runs_folder_shows_its_plan_and_what_the_run_would_do(tmp_path, capsys):
    out = tmp_path / "smoke-dpo"
    out.mkdir()
    (out / "run_complete.json").write_text("{}")  # what the demo leaves: a finished run, its own files recorded
    run_files.claim(out, ["run_complete.json"])
    text = dry_run(capsys, "--config", SMOKE, "--output_dir", str(out))
    assert f"output:        {out}: refused by the run (below)" in text, text
    assert text.rstrip().splitlines()[-1] == (
        f"warning: the run would refuse: output_dir {str(out)!r} already holds a finished run: pass --output_dir for "
        "a new run, or --overwrite_output_dir to replace it"
    )
    text = dry_run(capsys, "--config", SMOKE, "--output_dir", str(out), "--overwrite_output_dir")
    assert f"output:        {out}: replaced by the run (--overwrite_output_dir" in text and "warning:" not in text
    text = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "new"))
    assert f"output:        {tmp_path / 'new'}: the run starts there (new)" in text, text


def test_the_summary_calls_the_folder_refused_only_where_a_refusal_names_it(tmp_path, monkeypatch):
    """`--output_dir run` and a missing Hub token ('..., run `hf auth login`, ...'): the summary said 'run: refused by
    the run (below)' of a new folder, because the folder's name was a word of the token's refusal."""
    from dpotrain.resolve import OutputDecision

    monkeypatch.chdir(tmp_path)
    token = (
        "push_to_hub is set but no Hugging Face token was found: add HF_TOKEN=... to .env, run `hf auth login`, or "
        "drop --push_to_hub"
    )
    assert OutputDecision(None, False, (token,)).record("run")["output_folder"] == "run: the run starts there (new)"
    for output_dir, refusal in [
        ("run", "output_dir 'run' already holds a finished run: pass --output_dir for a new run, or ..."),
        ("./run/", "output_dir 'run' has no complete checkpoint: pass --overwrite_output_dir to start afresh, ..."),
        ("run", "checkpoint 'run/checkpoint-3' holds no record of the settings it was trained with ..."),
        ("run", f"output_dir {str(tmp_path / 'run')!r} is in use by another run (...)"),
    ]:
        folder = OutputDecision(None, False, (token, refusal)).record(output_dir)["output_folder"]
        assert folder == f"{output_dir}: refused by the run (below)", (output_dir, refusal)


# --- 12: every analyzer command a dry run prints runs; a model folder without a tokenizer is named -------------------


def analyzer():
    """scripts/analyze_dataset.py as a module: `main(argv)` returns the exit status (tests/test_analyzer.py)."""
    import importlib.util
    import os
    from unittest import mock

    spec = importlib.util.spec_from_file_location("analyze_dataset", ROOT / "scripts" / "analyze_dataset.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):  # it hides GPUs on import: undone
        spec.loader.exec_module(module)
    return module


def test_a_model_folder_without_a_tokenizer_is_named_with_what_to_pass_by_the_analyzer_and_the_run(tmp_path, capsys):
    expected = (
        f"error: model folder {OLMO3_7B!r} holds no tokenizer (config.json alone: a model's shape, enough to "
        "plan memory, not to tokenize): pass --model_name_or_path your model's Hub name (org/model) or the "
        "folder save_pretrained wrote, with its tokenizer.json"
    )
    assert analyzer().main(["--config", THINK, "--model_name_or_path", OLMO3_7B]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    with pytest.raises(SystemExit) as ended:
        run_cli(
            lambda: train_dpo.main(
                ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--model_name_or_path", OLMO3_7B]
            )
        )
    assert ended.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == expected


def test_the_dry_run_of_a_shape_without_a_tokenizer_prints_no_analyzer_command_it_cannot_run(
    tmp_path, capsys, no_credentials
):
    out = dry_run(
        capsys,
        "--config",
        "configs/think.yaml",
        "--model_name_or_path",
        "configs/models/olmo3-7b",
        "--output_dir",
        str(tmp_path / "think-dpo"),
    )
    assert "analyze_dataset.py" not in out, out
    assert "configs/models/olmo3-7b holds no tokenizer to measure them with: dry-run your own model" in out


def test_the_analyzer_command_a_dry_run_prints_runs_as_printed(tiny_model_dir, tmp_path, capsys, no_credentials):
    """A model with its tokenizer and a Hub data set not yet measured: the command the summary prints, run as printed
    in the project folder, gets to the data set (which needs the Hub: offline here, so refused naming it)."""
    import re
    import shlex

    out = dry_run(
        capsys,
        "--config",
        "configs/think.yaml",
        "--model_name_or_path",
        tiny_model_dir,
        "--max_length",
        "4096",
        "--max_tokens_per_microbatch",
        "8192",
        "--output_dir",
        str(tmp_path / "think-dpo"),
    )
    printed = set(re.findall(r"(python scripts/analyze_dataset\.py[^,;)]*)", out))
    assert len(printed) == 1, out
    words = shlex.split(printed.pop())
    assert analyzer().main(words[2:]) == 2
    err = capsys.readouterr().err
    assert f"Analysing allenai/Dolci-Think-DPO-7B (train) with the tokenizer of {tiny_model_dir}" in err, err
    assert err.strip().splitlines()[-1].startswith("error: could not load data set 'allenai/Dolci-Think-DPO-7B'")


def test_the_analyzer_command_a_dry_run_prints_measures_the_data_sets_revision_the_run_trains(
    tiny_model_dir, tmp_path, capsys, no_credentials
):
    """Lengths are kept per data set commit: the printed command left out --dataset_revision, so it measured main and
    the dry run run again still found this revision's lengths unmeasured. The analyzer also takes the run's name for
    the flag (docs/max_length.md: train_dpo.py's names for the same things)."""
    import re
    import shlex

    out = dry_run(
        capsys,
        "--config",
        "configs/think.yaml",
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_revision",
        "v1.2",
        "--max_length",
        "4096",
        "--max_tokens_per_microbatch",
        "8192",
        "--output_dir",
        str(tmp_path / "think-dpo"),
    )
    printed = set(re.findall(r"(python scripts/analyze_dataset\.py[^,;)]*)", out))
    assert len(printed) == 1, out
    words = shlex.split(printed.pop())
    assert words[words.index("--dataset_revision") + 1] == "v1.2", words
    assert analyzer().parse_args(words[2:]).revision == "v1.2"


def test_the_prefetch_command_a_dry_run_prints_for_a_model_not_cached_runs_as_printed(
    tmp_path, capsys, no_credentials, monkeypatch
):
    """README step 4 with your own Hub model, not in the cache yet: the plan is skipped, naming the prefetch command
    that fetches its config. It printed `--config <recipe>`, which a shell reads as a redirection from a file named
    recipe; now the command for this recipe and model, which prefetch.py takes as printed (offline here: it says what
    the cache lacks, the model the dry run named)."""
    import importlib.util
    import shlex

    out = dry_run(
        capsys,
        "--config",
        "configs/think.yaml",
        "--model_name_or_path",
        "org/my-sft-model",
        "--output_dir",
        str(tmp_path / "think-dpo"),
    )
    line = next(line for line in out.splitlines() if line.startswith("  memory/GPU:"))
    assert "not planned: the config of 'org/my-sft-model' is not in the local Hugging Face cache" in line, line
    words = shlex.split(line.split("`")[1])
    home = words.pop(0)  # the cache the dry run read (HF_HOME), which prefetch must fill
    assert home.startswith("HF_HOME=") and "<" not in line, line
    assert words == [
        "python",
        "scripts/prefetch.py",
        "--config",
        "configs/think.yaml",
        "--model_name_or_path",
        "org/my-sft-model",
        "--output_dir",  # the job's folder, which prefetch.py decides on
        str(tmp_path / "think-dpo"),
    ]
    spec = importlib.util.spec_from_file_location("prefetch", ROOT / "scripts" / "prefetch.py")
    prefetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefetch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: prefetch.main(words[2:]))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and "the cache lacks: model 'org/my-sft-model'" in err, err


def test_the_commands_a_run_prints_name_the_projects_scripts_from_the_folder_it_ran_in(tmp_path, monkeypatch):
    """`python ~/dpotrain/train_dpo.py --config ~/dpotrain/configs/think.yaml --output_dir runs/a` started in another
    folder printed `python scripts/prefetch.py --config /home/.../think.yaml` (the analyzer's, push_to_hub.py's, a
    memory refusal's sbatch command alike): typed back there, python found no such script; in the project, the run's own
    relative paths were not there. Each names the script as a command typed where the run started does."""
    import argparse
    import shlex
    from pathlib import Path

    from dpotrain import stages
    from dpotrain.cluster import offline
    from dpotrain.hub import hub_push
    from dpotrain.plan.memory_advice import Option
    from dpotrain.recipe.config import parse_args

    recipe = parse_args(
        ["--config", THINK, "--model_name_or_path", "org/sft", "--dataset_name", "org/pairs", "--dry-run"]
    )
    zero3 = Option((), (), "zero3", "configs/accelerate/zero3.yaml", 8, 4, 60.0, True, None)
    analyze_dataset, no_revision = analyzer(), argparse.Namespace(revision=None)
    printed = lambda: [  # noqa: E731
        stages.analyze_command(recipe),
        offline.prefetch_command(recipe),
        hub_push.push_command("runs/a", "--checkpoints"),
        analyze_dataset.fetch_remedy("org/sft", "org/pairs", None, THINK, no_revision).split("`")[1],
        zero3.submission(("--config", SMOKE)),
    ]
    for folder in (tmp_path, ROOT):  # elsewhere, and the project (a Slurm job runs there): as it was
        monkeypatch.chdir(folder)
        for command in printed():
            words = [w for w in shlex.split(command) if "=" not in w]  # past WORLD_SIZE=8 and the like
            script = Path(words[1])
            assert script.is_file() and script.resolve().parent in (ROOT, ROOT / "scripts"), (folder, command)
            assert folder != ROOT or not script.is_absolute(), command
            for name in ("RECIPE", "ACCELERATE_CONFIG"):  # an sbatch command's, read where it is typed
                for value in (w.split("=", 1)[1] for w in shlex.split(command) if w.startswith(f"{name}=")):
                    assert Path(value).is_file(), (name, command)


# --- 13: batch flags that change the recipe's pairs per step are said where people look -------------------------------


def test_batch_flags_that_replace_the_recipes_pairs_per_step_are_said_with_the_flags_that_keep_it(tmp_path, capsys):
    args = [
        "--config",
        "configs/think.yaml",
        "--model_name_or_path",
        "configs/models/olmo3-7b",
        "--report_to",
        "none",
        "--output_dir",
        str(tmp_path / "think-dpo"),
        "--per_device_train_batch_size",
        "2",
    ]
    out = dry_run(capsys, *args)  # 4 processes (accelerate_config.yaml): 2 x 4 = 8 pairs per step
    keep = "--pairs_per_step 128 --max_tokens_per_microbatch none"
    assert (
        "  per step:      8 pairs, over all processes; NOT the recipe's 128: --per_device_train_batch_size on the "
        f"command line replaced it ({keep} keeps it, in micro-batches of that many pairs)"
    ) in out, out
    out = dry_run(capsys, *args, *keep.split())  # the flags it names: the recipe's 128, in micro-batches of 2
    assert "  per step:      128 pairs, over all processes\n" in out and "  micro-batches: 2 pairs;" in out, out
    # The run prints the same summary as its first lines, from the resolved configuration it records.
    from dpotrain import resolve
    from dpotrain.recipe.config import parse_args

    recipe = parse_args(["--config", SMOKE, "--per_device_train_batch_size", "2"])
    replaced = resolve.resolved_config(recipe, {})["derived"]["recipe_batching_replaced"]
    assert replaced == {
        "pairs_per_step": 8,
        "max_tokens_per_microbatch": 2048,
        "by": "--per_device_train_batch_size",
        "keep": "--pairs_per_step 8 --max_tokens_per_microbatch none",
    }, replaced


# --- 14: memory advice that moves the launch gives the sbatch command that submits it ---------------------------------


@pytest.mark.slow
def test_every_launch_a_memory_refusal_offers_is_an_sbatch_command_that_plans_what_it_said(capsys, monkeypatch):
    """The README's second dry run (think on an 80 GB H100): options on another engine or node count name the sbatch
    command that submits them. Each, pasted as printed in the project folder, is launched by scripts/launch.sh on the
    GPUs it names, and launch.sh's own dry run of that job (its environment and train_dpo.py arguments) plans the
    engine and the GiB the refusal said, and fits."""
    import re

    from conftest import submitted

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("GPUS_PER_NODE", raising=False)
    monkeypatch.chdir(ROOT)
    readme = ["--config", "configs/think.yaml", "--model_name_or_path", "configs/models/olmo3-7b", "--dry-run"]
    with pytest.raises(SystemExit):
        run_cli(lambda: train_dpo.main([*readme, "--gpu_memory_gib", "79.6"]))
    error = capsys.readouterr().err.strip().splitlines()[-1]
    offers = re.findall(r"\] (DeepSpeed ZeRO-\d|FSDP2) fits on [^`]*(?:`[^`]*` )?\(~([\d.]+) GiB\): `([^`]*)`", error)
    assert len(offers) == error.count(" sbatch --nodes=") >= 2, error  # ZeRO-2 on 3 nodes, ZeRO-3 on 1
    for engine, gib, command in offers:
        launched = submitted(command, ROOT)
        world, per_node = launched["processes"], launched["processes"] // launched["machines"]
        assert launched["train"][2:6] == [*readme[2:4], "--gpu_memory_gib", "79.6"], command  # the user's, no dry run
        with monkeypatch.context() as m:  # as launch.sh runs it, in the project
            m.setenv("WORLD_SIZE", str(world))
            m.setenv("GPUS_PER_NODE", str(per_node))
            out = dry_run(capsys, *launched["train"], "--dry-run")
        assert f"  memory/GPU:    ~{gib} GiB" in out and "  GPU:           fits one 79.6 GiB GPU" in out, (command, out)
        assert f"  processes:     {world} (environment (WORLD_SIZE))" in out, out
        assert f"  engine:        {engine}" in out, out


# --- 15: one readable line per logging step, no bar or warning that is not the user's business ------------------------


@pytest.fixture(scope="module")
def short_run(tiny_model_dir, tmp_path_factory):
    """4 steps of the smoke recipe on its first 32 pairs, in this process, as train_dpo.py runs them: a log record and
    a checkpoint every 2 steps, samples before step 1 and every 2 steps. Returns (everything printed, the folder)."""
    import contextlib
    import io
    import os

    from conftest import built, ready
    from dpotrain.data import data
    from dpotrain.recipe.config import parse_args

    out = tmp_path_factory.mktemp("short") / "run"
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--max_steps",
            "4",
            "--logging_steps",
            "2",
            "--save_steps",
            "2",
            "--samples_every",
            "2",
            "--sample_count",
            "2",
            "--sample_max_new_tokens",
            "24",
        ]
    )
    pairs = data.load_preference_dataset(str(ROOT / recipe.script.dataset_name)).select(range(32))
    printed = io.StringIO()
    # Its own reference cache: the session's may hold these pairs' scores from an earlier test, and a reference found
    # whole prints no speed line.
    cache, os.environ["DPOTRAIN_CACHE"] = os.environ.get("DPOTRAIN_CACHE"), str(tmp_path_factory.mktemp("cache"))
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            trainer = ready(built(recipe, pairs))
            trainer.train()
    finally:
        if cache is None:
            del os.environ["DPOTRAIN_CACHE"]
        else:
            os.environ["DPOTRAIN_CACHE"] = cache
    return printed.getvalue(), out


@pytest.mark.slow
def test_each_logging_step_is_one_readable_line(short_run):
    import re

    text, _ = short_run
    assert "{'loss'" not in text and "'grad_norm'" not in text and "{'train_runtime'" not in text, text[-3000:]
    lines = [line.split("\r")[-1] for line in text.splitlines() if re.search(r"(^|\r)step \d+/4  ", line)]
    shape = r"step {}/4  loss \d\.\d{{4}}  acc \d\.\d\d  margin \S+  lr \d\.\de[-+]\d\d  grad_norm \S+  tok/s [\d,]+"
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [1, 2, 4], lines  # 1 is logged on its own
    for line in lines:
        assert re.fullmatch(shape.format(line.split()[1].split("/")[0]), line), line
    assert re.search(r"trained to step 4/4 in [\d.]+ s, mean loss \d\.\d{4}", text), text[-2000:]


@pytest.mark.slow
def test_no_progress_bar_for_saving_or_an_index_and_no_collapse_warning_before_training(short_run):
    text, out = short_run
    assert (out / "checkpoint-2" / "COMPLETE").is_file()  # the saves happened, without their bars
    for noise in ("Writing model shards", "Flattening the indices", "samples warning step 0"):
        assert noise not in text, noise

    # TRL's own card ("fine-tuned version of [None]") is not written at a checkpoint: the project's comes at the end.
    assert not (out / "README.md").exists()


@pytest.mark.slow
def test_one_process_logs_its_tokens_per_second_once(short_run):
    import json

    text, out = short_run
    assert "tokens/s over 1 process in " in text and "per process)" not in text, text[-3000:]  # the reference
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("tokens_per_second" in r and "tokens_per_second_per_gpu" not in r for r in records), records


def test_a_base_model_that_loops_already_is_no_collapse_and_a_run_that_starts_looping_is(
    tiny_model_dir, tmp_path, capsys
):
    """Real greedy generation on the built-in, untrained model, which loops on some prompts by itself ("143 143 143"):
    at step 0 that is the base model's habit, not training's doing, and so is the same answer later. Looping where the
    base model did not (made to, by suppressing every token but one: a logits processor of transformers' own) is
    still flagged."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState

    from dpotrain.train.samples import SampleGenerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    (word,) = tokenizer(" the", add_special_tokens=False)["input_ids"]  # one token: " the the the ..."
    loop = [i for i in range(model.config.vocab_size) if i != word]
    args, state = SimpleNamespace(output_dir=str(tmp_path)), TrainerState(is_world_process_zero=True)

    def generator(prompt: str) -> SampleGenerator:
        (tmp_path / "samples.jsonl").unlink(missing_ok=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return SampleGenerator([ids], tokenizer, every=2, max_new_tokens=16, warn_at=0.5)

    def round_at(step: int, looping: bool) -> float:
        model.generation_config.suppress_tokens = loop if looping else None
        state.global_step = step
        return samples.generate(args, state, model)[0]["repetition"]

    samples = generator("What is insulin?")
    assert round_at(0, looping=False) > 0.5 and round_at(2, looping=False) > 0.5  # the base model loops, no more later
    assert samples.flagged == [] and "samples warning" not in capsys.readouterr().err
    samples = generator("Tell me about tides.")
    assert round_at(0, looping=False) <= 0.5 and round_at(2, looping=True) > 0.5  # training made it loop
    assert [r["step"] for r in samples.flagged] == [2]
    assert "samples warning step 2: prompt 0 repeats itself" in capsys.readouterr().err


# --- 16: smaller stumbles ---------------------------------------------------------------------------------------------


def test_max_steps_1_is_refused_with_advice_that_works(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        run_cli(
            lambda: train_dpo.main(
                ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--dry-run"]
            )
        )
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --max_steps 1 with warmup trains nothing (a warmup's first step runs at learning rate 0): add "
        "--warmup_steps 0 to train that step at the full learning rate, or pass --max_steps 2 or more"
    )
    out = dry_run(
        capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--warmup_steps", "0"
    )
    assert "  steps:         1 optimizer step (0.021 epochs: max_steps), 0 of warmup" in out, out


def test_a_message_with_an_unknown_role_is_named_as_such(tmp_path, capsys):
    import json

    prompt = [{"role": "user", "content": "Name a colour."}]
    row = {
        "prompt": prompt,
        "chosen": [{"role": "bot", "content": "Blue."}],
        "rejected": [{"role": "bot", "content": "Seven."}],
    }
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit) as ended:
        run_cli(
            lambda: train_dpo.main(
                ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--dataset_name", str(data), "--dry-run"]
            )
        )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and "another prompt" not in line, line
    assert line.startswith(  # its only row: said as failing a check (not "every row ... (1 of 1)"), no --skip_invalid
        "error: the only row of the train split fails a check: chosen: message 0 has role 'bot', which chat "
        "templates do not know: use 'assistant' for the model's turns"
    ), line
    assert "skip_invalid" not in line


def test_help_shows_each_description_whole_and_says_what_push_to_hub_and_hub_model_id_do_here(capsys):
    import re

    from dpotrain.recipe.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = capsys.readouterr().out
    lines = [line for line in shown.splitlines() if line.startswith(("  --", " " * 34))]  # the options, not the usage
    assert all(len(line) <= 120 and not line.endswith("...") for line in lines), shown
    flags = [line.split()[0] for line in lines if line.startswith("  --")]
    assert "--dataset_mixer_eval_list_splits" in flags and all(re.fullmatch(r"--[a-z0-9_-]+", f) for f in flags), flags
    assert "every time the model is saved" not in shown
    assert "--push_to_hub                   Push the final model to the Hub once training ends" in shown
    # transformers' "repository to keep in sync with the local `output_dir`": this project pushes once, at the end
    assert "keep in sync" not in shown
    assert "--hub_model_id                  The Hub repo push_to_hub pushes to (default: the run name" in shown
    # Every option --help lists is documented in docs/ (or the README).
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    own = [f for f in flags if f.startswith("--") and f not in ("--dry-run", "--json", "--config")]
    assert [f for f in own if f[2:] not in docs] == []


def test_help_says_what_the_common_fields_take_here_and_help_all_lists_all_of_it_in_the_same_words(capsys):
    """--help showed --max_length as "Maximum length of the tokenized sequence" (TRL's), not that it takes `auto`;
    --max_steps as "Overrides `num_train_epochs`", --output_dir without its default here and --dataset_name as
    transformers and TRL word them. --help-all, where a user goes for the rest, did not list --config, and gave
    push_to_hub and hub_model_id transformers' words, which --help had corrected: one help text per flag."""
    import re

    from dpotrain.recipe.config import parse_args

    def shown(flag: str) -> str:
        with pytest.raises(SystemExit):
            parse_args([flag])
        return capsys.readouterr().out

    short, every = shown("--help"), shown("--help-all")
    rows = {}  # --flag -> its description, wrapped lines joined
    for line in short.splitlines():
        if line.startswith("  --"):
            flag, _, text = line.strip().partition(" ")
            rows[flag] = text.strip()
        elif line.startswith(" " * 34) and rows:
            rows[flag] += " " + line.strip()
    assert "auto" in rows["--max_length"] and "docs/max_length.md" in rows["--max_length"], rows["--max_length"]
    assert (
        "default: outputs/<run_name>" in rows["--output_dir"] and "builtin:tiny-olmo3" in rows["--model_name_or_path"]
    )
    assert not rows["--max_steps"].startswith("Overrides") and ".jsonl" in rows["--dataset_name"]
    listed = {f.replace("-", "_") for f in re.findall(r"^  (?:-h, )?(--[\w-]+)", every, re.M)}
    assert [f for f in rows if f.replace("-", "_") not in listed] == []
    flat = re.sub(r"\s+", " ", every)
    assert [f for f, text in rows.items() if not f.startswith("--config") and text not in flat] == []
    assert "keep in sync" not in every
    assert every.startswith(short[: short.index("Fields users")].rstrip())  # --help's usage, not argparse's 180 lines
    assert "[--dataset_name DATASET_NAME]" not in every


def test_help_says_that_a_rerun_resumes_what_use_peft_trains_and_which_loss_the_recipes_use(capsys):
    """--help, a newcomer's first read, gave transformers' "Path to a folder with a valid checkpoint for your model"
    for --resume_from_checkpoint (not that the same command resumes by itself), TRL's "Whether to use PEFT for
    training" and "LoRA target modules" (not that it trains a LoRA adapter, nor that use_peft needs its targets),
    "Type of loss to use" (not that several combine, nor which the recipes train), and for --report_to "The list of
    integrations to report the results and logs to" (not that the recipes log to W&B, nor that none turns it off)."""
    import re

    from dpotrain.recipe.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert (
        "--resume_from_checkpoint A checkpoint-N folder to resume from: without it, a rerun resumes from the newest"
        in shown
    )
    assert "--use_peft Train a LoRA adapter, not the full weights, with lora_target_modules" in shown
    assert "--report_to Where to log: wandb (the recipes'; its key in .env), none, or an installed integration" in shown
    assert (
        "--lora_target_modules The modules LoRA adapts, which use_peft requires: q_proj v_proj, or all-linear" in shown
    )
    assert "--loss_type Loss types, several summed by loss_weights (recipes: sigmoid_norm;" in shown
    with pytest.raises(ConfigError, match="use_peft needs the layers to adapt"):  # what the help says, the run does
        train_dpo.main(["--config", SMOKE, "--use_peft", "true", "--dry-run"])


def test_help_all_says_what_the_data_fields_do_with_a_mixture_and_that_the_learning_rate_is_the_peak(capsys):
    """--help-all gave dataset_config, dataset_train_split, dataset_test_split and dataset_streaming TRL's "If
    `datasets` is provided, this will be ignored": here a mixture's sources take the split fields as their default
    split, dataset_config with a mixture is refused, and dataset_streaming is refused with or without one (checked
    below, so the words follow the code). --learning_rate read "The initial learning rate for AdamW", which the
    recipes' warmup makes the peak."""
    import re

    from dpotrain import options
    from dpotrain.data import mixture
    from dpotrain.recipe.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help-all"])
    every = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "this will be ignored" not in every and "initial learning rate" not in every
    assert "and that of each mixture source that names none. Refused where every mixture source names" in every
    assert "remove dataset_train_split, or name '<split>' there (default: train)" in every
    assert "and dataset_config with one is refused" in every
    assert "The peak learning rate, after warmup_steps (the recipes: linear decay to zero)" in every
    data = str(ROOT / "data" / "smoke_prefs.jsonl")
    mixed = ["--model_name_or_path", "m", "--dataset_mixer_list", data, "1.0", "--dry-run"]
    sources = mixture.parse(mixture.fields_of(parse_args([*mixed, "--dataset_train_split", "dev"])))
    assert [s.split for s in sources] == ["dev"]
    with pytest.raises(ConfigError, match="dataset_config 'x' and a mixture"):
        mixture.parse(mixture.fields_of(parse_args([*mixed, "--dataset_config", "x"])))
    with pytest.raises(ConfigError, match="^dataset_streaming: the step plan"):
        options.check_streaming(parse_args(["--model_name_or_path", "m", "--dataset_streaming", "--dry-run"]))


def test_help_all_gives_the_default_a_run_takes_for_the_fields_whose_default_this_project_sets(capsys):
    """--help-all printed TRL's and transformers' defaults for the fields this project defaults otherwise:
    --padding_free read "Temporarily unavailable: since the DPO refactor, setting it to True warns and falls back to
    standard padding ... (default: False)", where every run packs by default, and --logging_nan_inf_filter "(default:
    True)", where the runs log a NaN loss as it was (docs/metrics.md). The help now shows the default the parse gives
    (config.OWN_DEFAULTS, checked on a parse below, so the words follow the code)."""
    import re

    from dpotrain.recipe.config import OWN_DEFAULTS, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help-all"])
    every = capsys.readouterr().out
    assert "Temporarily unavailable" not in every and "falls back to standard padding" not in re.sub(r"\s+", " ", every)
    rows = dict(re.findall(r"^  --(\w+) .*?\n((?:  {6,}.*\n)+)", every, re.M))  # --flag -> its description
    recipe = parse_args(["--config", SMOKE, "--dry-run"])
    for name, default in OWN_DEFAULTS.items():
        assert getattr(recipe.training, name) == default  # smoke.yaml sets neither: the project's default
        assert re.sub(r"\s+", " ", rows[name]).strip().endswith(f"(default: {default})"), (name, rows[name])


def test_help_all_says_that_a_run_scores_the_reference_once_and_logs_step_1_unless_told_otherwise(capsys):
    """--help-all gave --precompute_ref_log_probs TRL's "Whether to precompute the reference model log probabilities
    ... (default: False)", where a run scores the reference once before training unless it is given false (or
    sync_ref_model asks for a live one: a reference model in memory beside every step), and --logging_first_step
    "Whether to log the first `global_step` or not. (default: False)", where the health guards log step 1 (and refuse
    false). Checked on a parse below, so the words follow the code."""
    import re

    from dpotrain.recipe.config import parse_args, uses_live_reference

    with pytest.raises(SystemExit):
        parse_args(["--help-all"])
    every = capsys.readouterr().out
    rows = {k: re.sub(r"\s+", " ", v) for k, v in re.findall(r"^  --(\w+) .*?\n((?:  {6,}.*\n)+)", every, re.M)}
    assert "Whether to precompute" not in rows["precompute_ref_log_probs"], rows["precompute_ref_log_probs"]
    assert "scored once before training" in rows["precompute_ref_log_probs"]
    assert "Whether to log the first" not in rows["logging_first_step"], rows["logging_first_step"]
    assert "health" in rows["logging_first_step"]
    assert not uses_live_reference(parse_args(["--config", SMOKE, "--dry-run"]))
    assert uses_live_reference(parse_args(["--config", SMOKE, "--precompute_ref_log_probs", "false", "--dry-run"]))
    with pytest.raises(ConfigError, match="logging_first_step false: the health guards log step 1"):
        train_dpo.main(["--config", SMOKE, "--logging_first_step", "false", "--dry-run"])


def test_help_all_says_that_a_private_push_to_an_existing_public_repo_is_refused_not_ignored(capsys):
    """--help-all gave --hub_private_repo transformers' "This value is ignored if the repo already exists": a user
    pushing a private run to a repo of that name expected the push to go on, where the run refuses an existing public
    repo at start (hub.check_private; docs/hub.md), never pushing to it in public: the refusal itself is
    tests/test_offline_and_push.py's test_a_private_push_to_a_public_repo_is_refused_before_anything_uploads."""
    import re

    from dpotrain.recipe.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help-all"])
    every = capsys.readouterr().out
    rows = {k: re.sub(r"\s+", " ", v) for k, v in re.findall(r"^  --(\w+) .*?\n((?:  {6,}.*\n)+)", every, re.M)}
    assert "ignored if the repo already exists" not in rows["hub_private_repo"], rows["hub_private_repo"]
    assert "an existing public repo is refused" in rows["hub_private_repo"], rows["hub_private_repo"]


def test_the_analyzers_price_and_its_rationale_speak_one_unit():
    """The hand-computed lengths of tests/test_analyzer.py: 1,024 over 512 makes 10% more pairs whole for +5.3% packed
    compute. The table's Price and the rationale say the same trade in the same words: +0.53% per 1% more whole."""
    import numpy as np

    from dpotrain.data import lengths, lengths_report

    short, long = 90, 10
    m = lengths.Measured(
        index=np.arange(short + long),
        prompt=np.full(short + long, 100),
        chosen=np.array([300] * short + [800] * long),
        rejected=np.array([200] * short + [400] * long),
        invalid=[],
        conversational=True,
    )
    text = lengths_report.to_markdown(lengths.summarize(m, target=0.9, dataset="pairs.jsonl"), 512)
    at_512, at_1024 = short * 700 + long * 1012, short * 700 + long * 1400
    per_point = f"{(at_1024 / at_512 - 1) / 10:+.2%}"  # +0.53%
    row = next(line for line in text.splitlines() if line.startswith("| 1,024 |"))
    assert f"| {per_point} per 1% |" in row, row
    assert (
        f"for +5.3% packed compute (+6.1% with the prompt once), {per_point} per 1% more pairs whole (the Price "
        "column's unit)" in text
    ), text


def test_a_recipes_own_paths_not_in_the_folder_run_in_are_the_projects(tmp_path, monkeypatch, capsys):
    """`python ~/dpotrain/train_dpo.py --config ~/dpotrain/configs/smoke.yaml` run in another folder was refused
    ("dataset 'data/smoke_prefs.jsonl' does not exist (looked in ...)"), and the analyzer's own choice of think.yaml
    for Dolci-Think refused its chat template, configs/templates/olmo_thinker.jinja: a recipe names the project's
    files as a job reads them, in the project folder. A file found where the command runs, and the command line's
    paths, stay the folder's."""
    from dpotrain.recipe.config import parse_args

    monkeypatch.chdir(tmp_path)
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"))
    assert f"  data:          {ROOT / 'data' / 'smoke_prefs.jsonl'} (split train): 384 rows" in out, out
    think = parse_args(["--config", THINK, "--dry-run"]).project.chat_template_path
    assert think == str(ROOT / "configs" / "templates" / "olmo_thinker.jinja")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "smoke_prefs.jsonl").write_text("")  # a file of that name here: this folder's
    assert parse_args(["--config", SMOKE, "--dry-run"]).script.dataset_name == "data/smoke_prefs.jsonl"
    given = ["--chat_template_path", "configs/templates/olmo_thinker.jinja", "--dry-run"]
    assert parse_args(["--config", THINK, *given]).project.chat_template_path == given[1]


@pytest.mark.parametrize("field", ["dataset_name", "chat_template_path", "datasets"])
def test_a_recipes_path_found_only_beside_the_recipe_is_refused_naming_it(field, tmp_path, monkeypatch):
    """A newcomer's hunt: a recipe of one's own in one's own folder, naming its data beside it (`dataset_name:
    pairs.jsonl`, a mixture's `datasets: [{path: pairs.jsonl}]`), run from another folder was refused as "dataset
    'pairs.jsonl' does not exist (looked in <the folder run in>): check the path", the file that was meant left unnamed
    (a recipe's relative paths are read from the folder run in, else the project's, never from the recipe's own
    folder)."""
    from dpotrain.recipe.config import parse_args

    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", mine / "pairs.jsonl")
    (mine / "template.jinja").write_text((ROOT / "configs" / "templates" / "olmo_thinker.jinja").read_text())
    value = "template.jinja" if field == "chat_template_path" else "pairs.jsonl"
    smoke = Path(SMOKE).read_text()
    recipe = {
        "dataset_name": smoke.replace("dataset_name: data/smoke_prefs.jsonl", f"dataset_name: {value}"),
        "chat_template_path": f"{smoke}\n{field}: {value}\n",
        "datasets": smoke.replace("dataset_name: data/smoke_prefs.jsonl", "")
        + f"\ndatasets:\n  - path: {value}\n    amount: 0.5\n",
    }[field]
    (mine / "recipe.yaml").write_text(recipe)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", str(mine / "recipe.yaml"), "--dry-run"])
    assert str(refused.value) == (
        f"{field} {value!r} in {mine / 'recipe.yaml'} is neither in the folder run in ({elsewhere}) nor in the "
        f"project ({ROOT}), where a recipe's relative paths are read, but beside the recipe: write it as "
        f"{mine / value} in the recipe, or run in {mine}"
    )
    monkeypatch.chdir(mine)  # run where the file is: read there
    read = parse_args(["--config", str(mine / "recipe.yaml"), "--dry-run"])
    if field == "datasets":
        assert [json.loads(source)["path"] for source in read.project.datasets] == [value]
    else:
        assert getattr(read.script if field == "dataset_name" else read.project, field) == value


def test_a_relative_dataset_name_of_a_slurm_job_is_where_the_user_submitted_and_a_miss_says_where_it_looked(
    tmp_path, capsys, monkeypatch
):
    """scripts/dpo_train.sh runs the job in the project and names the folder it was submitted from
    (DPOTRAIN_SUBMIT_DIR): `sbatch /path/to/dpotrain/scripts/dpo_train.sh --dataset_name my_pairs.jsonl` from the
    user's folder trains on that folder's file."""
    import shutil

    submitted = tmp_path / "mine"
    submitted.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", submitted / "my_pairs.jsonl")
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    monkeypatch.chdir(ROOT)  # where the job runs
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", "run", "--dataset_name", "my_pairs.jsonl")
    assert f"  data:          {submitted / 'my_pairs.jsonl'} (split train): 384 rows" in out, out
    # A relative --output_dir is there too, not in the project, and named by its full path.
    assert f"  output:        {submitted / 'run'}: the run starts there (new)" in out, out
    with pytest.raises(SystemExit) as ended:
        run_cli(
            lambda: train_dpo.main(
                ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--dataset_name", "nope.jsonl", "--dry-run"]
            )
        )
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: dataset 'nope.jsonl' does not exist (looked in {ROOT} and {submitted} (where the job was submitted)): "
        "check the path, or give a Hub name like org/dataset"
    )
    assert "export DPOTRAIN_SUBMIT_DIR=$PWD\n" in (ROOT / "scripts" / "dpo_train.sh").read_text()


def test_a_relative_or_home_model_folder_is_the_users_folder(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """`sbatch .../dpo_train.sh --model_name_or_path my-sft` from the user's folder loads that folder's model, as a
    relative --dataset_name reads that folder's file (before: refused as a folder that does not exist, looked for in
    the project alone); `model_name_or_path: ~/my-sft` is the home folder's model (before: the checks and the dry
    run took it, and the run stopped at the tokenizer: transformers took `~/my-sft` for a malformed Hub name)."""
    import shutil

    from dpotrain.data import lengths
    from dpotrain.recipe.config import parse_args

    submitted, home = tmp_path / "mine", tmp_path / "home"
    shutil.copytree(tiny_model_dir, submitted / "my-sft")
    shutil.copytree(tiny_model_dir, home / "my-sft")
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(ROOT)  # where the job runs
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--model_name_or_path", "my-sft")
    assert f"  model:         {submitted / 'my-sft'}; weights load in" in out, out
    recipe = parse_args(["--config", SMOKE, "--model_name_or_path", "~/my-sft"])
    assert recipe.model.model_name_or_path == str(home / "my-sft")
    assert lengths.recipe_tokenizer(recipe).chat_template  # as the run loads it


def test_every_relative_file_on_a_jobs_command_line_is_the_users_where_it_is_there(tmp_path, monkeypatch):
    """`sbatch .../dpo_train.sh --chat_template_path my.jinja` from the user's folder: the data set and the model were
    read from the folder submitted from, the chat template, the sample prompts and the checkpoint to resume from were
    looked for in the project alone (where the job runs) and refused as missing."""
    from dpotrain.recipe.config import parse_args

    submitted = tmp_path / "mine"
    (submitted / "run" / "checkpoint-2").mkdir(parents=True)
    (submitted / "my.jinja").write_text((ROOT / "configs" / "templates" / "olmo_thinker.jinja").read_text())
    (submitted / "prompts.txt").write_text("Name a colour.\n")
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    monkeypatch.chdir(ROOT)  # where the job runs
    given = {
        "chat_template_path": "my.jinja",
        "sample_prompts_file": "prompts.txt",
        "resume_from_checkpoint": "run/checkpoint-2",
    }
    read = parse_args(["--config", SMOKE, *(w for name, path in given.items() for w in (f"--{name}", path))])
    found = {name: getattr(read.project, name, None) or getattr(read.training, name, None) for name in given}
    assert found == {name: str(submitted / path) for name, path in given.items()}, found
    project_file = "configs/templates/olmo_thinker.jinja"  # not in the folder submitted from: the project's, as before
    assert (
        parse_args(["--config", SMOKE, "--chat_template_path", project_file]).project.chat_template_path == project_file
    )


def test_a_home_path_the_shell_did_not_expand_is_the_home_folders(tmp_path, monkeypatch):
    """`~` in a recipe's value, or after `--flag=` (where a shell expands none): `--config=~/my.yaml` was 'recipe not
    found: pass one of configs/*.yaml', and `sample_prompts_file: ~/prompts.txt`, `accelerate_config: ~/accel.yaml`
    were refused as missing, while dataset_name and model_name_or_path read the same spelling as the home folder's."""
    from dpotrain.recipe.config import parse_args

    home = tmp_path / "home"
    home.mkdir()
    (home / "prompts.txt").write_text("Name a colour.\n")
    (home / "accel.yaml").write_text((ROOT / "accelerate_config.yaml").read_text())
    recipe = home / "my.yaml"
    recipe.write_text(
        (ROOT / "configs" / "smoke.yaml")
        .read_text()
        .replace("accelerate_config: none", "accelerate_config: ~/accel.yaml")
        + "sample_prompts_file: ~/prompts.txt\n"
    )
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    read = parse_args(["--config=~/my.yaml", "--dry-run", "--resume_from_checkpoint=~/run/checkpoint-2"])
    assert read.config_path == str(recipe)
    assert read.project.sample_prompts_file == str(home / "prompts.txt")
    assert read.project.accelerate_config == str(home / "accel.yaml")
    assert read.training.resume_from_checkpoint == str(home / "run" / "checkpoint-2")
    from dpotrain import resolve

    assert resolve.world_size(read, planning=True)[0] == 4  # the home folder's accelerate config, read


@pytest.mark.parametrize("spelling", [["--dry_run=true"], ["--dry_run", "true"], ["--dry-run=True"], ["--dry_run"]])
def test_one_dry_run_flag_however_it_is_spelled(spelling, tmp_path, capsys, no_credentials):
    """A bf16 recipe on a machine without a GPU: every spelling plans, none meets transformers' bf16/GPU check."""
    from dpotrain.recipe.config import dry_run_flag as flag

    assert flag(spelling) is True and flag(["--dry_run=false"]) is False and flag(["--dry_run", "no"]) is False
    # The last one decides, as the run's parser takes it
    assert flag([*spelling, "--max_steps", "4", "--dry-run", "false"]) is False
    assert flag(["--dry_run=false", *spelling]) is True
    with pytest.raises(SystemExit) as ended:
        run_cli(
            lambda: train_dpo.main(
                [
                    "--config",
                    "configs/instruct.yaml",
                    "--model_name_or_path",
                    "configs/models/olmo3-7b",
                    "--output_dir",
                    str(tmp_path / "instruct-dpo"),
                    *spelling,
                ]
            )
        )
    out, err = capsys.readouterr()
    assert ended.value.code in (None, 0), err
    assert "memory/GPU:    ~" in out and "bf16/gpu" not in err


def test_a_recipes_dry_run_is_planned_as_the_flags_is(tmp_path, capsys, monkeypatch, no_credentials):
    """A recipe's `dry_run: true` (docs/slurm.md: a job of it plans and ends) was a dry run planned as a run: on a
    login node without a GPU a bf16 recipe stopped on transformers' bf16/GPU check, which `--dry-run` skips, and its
    `--json` shared stdout with the libraries' lines. `--dry_run false` still turns it off. Decided from the one
    reading of the recipe that the run parses: the file was read three times before the run had its recipe (for the
    decision in train_dpo, again in parse_args, then by read_recipe), and an edit between them was two recipes."""
    import builtins
    import io

    from dpotrain.recipe.config import dry_run_asked as asked

    recipe = tmp_path / "instruct-dry.yaml"
    recipe.write_text((ROOT / "configs" / "instruct.yaml").read_text() + "\ndry_run: true\n")
    argv = ["--config", str(recipe), "--model_name_or_path", "configs/models/olmo3-7b"]
    argv += ["--dataset_name", "data/smoke_prefs.jsonl"]  # local pairs: the dry run reads them, and names prefetch
    assert asked(None, {"dry_run": True}) and not asked(False, {"dry_run": True}) and not asked(None, {})
    opened, parsed, real_open, real_parse = [], [], io.open, train_dpo.parse_args

    def counted(file, *args, **kwargs):  # every open of the recipe: pathlib's reads go through io.open
        opened.extend([file] if isinstance(file, (str, os.PathLike)) and Path(file) == recipe else [])
        return real_open(file, *args, **kwargs)

    def parse(*args):
        read = real_parse(*args)
        parsed.append((read.project.dry_run, len(opened)))  # the recipe's reads by the time the run has its recipe
        return read

    monkeypatch.setattr(io, "open", counted)
    monkeypatch.setattr(builtins, "open", counted)
    monkeypatch.setattr(train_dpo, "parse_args", parse)
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, "--output_dir", str(tmp_path / "instruct-dpo"), "--json"]))
    out, err = capsys.readouterr()
    assert ended.value.code in (None, 0), err
    assert json.loads(out)["derived"]["memory"]["per_gpu_gib"] and "bf16/gpu" not in err
    assert parsed == [(True, 1)]
    assert len(opened) == 1  # and none after: the prefetch command the dry run names repeats that reading


@pytest.mark.slow
def test_a_recipes_own_dry_run_is_all_the_job_does_and_a_job_ends_at_its_dry_run_on_what_the_run_would_refuse(
    tmp_path,
):
    """`dry_run: true` in the job's recipe (not on its command line): launch.sh planned the job, then launched it, and
    every process of every node set up its engine to print the plan again ("training exited with code 0").

    Turned off on the command line, the job is an ordinary one: scripts/launch.sh plans it with a dry run first, and
    what the run would refuse (no W&B login) ends the job there, in seconds, with the run's own line, before any
    process starts (the dry run itself plans past it)."""
    import os
    import subprocess

    recipe = tmp_path / "planned.yaml"
    recipe.write_text((ROOT / "configs" / "smoke.yaml").read_text() + "dry_run: true\n")
    gone = ("WANDB_MODE", "WANDB_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in gone and not k.startswith("SLURM_")}
    env |= {"RECIPE": str(recipe)}
    for args, planned in (([], True), (["--dry_run", "false", "--report_to", "wandb"], False)):
        # The recipe's own dry run reports to no W&B: its Python starts warm (`warm_venv`), where the job's run needs a
        # home without a W&B login, which no warm interpreter has (a fresh one reads HOME as it imports). The job's run
        # has a job's id: outside one, launch.sh refuses it before planning it (no Slurm answers about it).
        job = {"VENV": warm_venv()} if planned else {"SLURM_JOB_ID": "4242"}
        login = {} if planned else {"HOME": str(tmp_path), "NETRC": str(tmp_path / "no-netrc")}
        result = subprocess.run(
            ["bash", "scripts/launch.sh", "--output_dir", str(tmp_path / "run"), *args],
            cwd=ROOT,
            env=env | job | login,
            capture_output=True,
            text=True,
            timeout=300,
        )
        said = result.stdout[-2000:] + result.stderr[-2000:]
        if planned:
            assert result.returncode == 0 and result.stdout.count(f"dry run of {recipe}") == 1, said
            assert "launch: " not in result.stdout and "training" not in result.stderr, said
        else:  # turned off on the command line: the job's plan, then what the run would refuse (no W&B login)
            assert result.returncode == 2, said
            assert result.stderr.strip().splitlines()[-1].startswith("error: report_to wandb but no W&B login"), said
            assert "batch: 8 pairs per step" in result.stdout, said  # planned, then ended
        assert not (tmp_path / "run").exists(), said


def test_the_job_script_typed_outside_slurm_is_refused_in_one_line_before_the_launch(tmp_path):
    """`bash scripts/dpo_train.sh` with sbatch forgotten: after its dry run, launch.sh started srun, which outside an
    allocation asks Slurm for a job of its own without the script's #SBATCH lines (no GPUs: one CPU process, nothing
    to requeue it), or, where no Slurm answers, failed, and the log said "srun stopped every node; the first 'srun:
    error: <node>' line above names the node that failed". Refused in one line naming sbatch and salloc, first and
    alone: it came after a "no time-limit warning is set for this job" warning and a plan of this machine, not the
    job's."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": SMOKE}
    result = subprocess.run(
        ["bash", "scripts/dpo_train.sh", "--output_dir", str(tmp_path / "run"), "--max_steps", "2"],
        cwd=ROOT,
        env=env | {"HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = result.stdout[-2000:] + result.stderr[-2000:]
    assert result.returncode == 1, said
    # First and alone: a "no time-limit warning is set for this job" warning and this machine's plan came before it
    assert result.stderr == (
        "error: not in a Slurm job, so there are no nodes to launch on: submit the script with sbatch (sbatch "
        "scripts/dpo_train.sh <arguments>), or run it inside an allocation (salloc)\n"
    ), said
    assert "batch: " not in result.stdout and "launch: srun" not in result.stdout, said
    assert not (tmp_path / "run").exists(), said


@pytest.mark.slow
def test_the_job_scripts_dry_run_typed_outside_slurm_says_it_plans_this_machine_not_the_job(tmp_path):
    """`bash scripts/dpo_train.sh --dry-run` on a login node, to preview the job: outside a Slurm job launch.sh counts
    no GPUs, so the plan was one process's (`DeepSpeed ZeRO-2 on 1 GPU needs ~199.0 GiB` for OLMo 3 7B) with nothing
    saying it was not the 4-GPU job the script asks for. A note says so, and how to plan the job."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"RECIPE": SMOKE}
    result = subprocess.run(
        ["bash", "scripts/dpo_train.sh", "--output_dir", str(tmp_path / "run"), "--dry-run"],
        cwd=ROOT,
        env=env | {"HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        "note: not in a Slurm job: planned for this machine alone (processes: 1, GPUs per node: 0), not the job the "
        f"script asks for; the job's plan: sbatch <the script> --dry-run, or python train_dpo.py --config {SMOKE} "
        "--dry-run with the same arguments"
    ) in result.stderr
    assert result.stdout.count(f"dry run of {SMOKE}") == 1 and not (tmp_path / "run").exists()


@pytest.mark.slow  # the job script starts the stack for train_dpo.py's --help (warm: `warm_venv`)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_job_scripts_help_is_the_help_alone(flag):
    """`bash scripts/dpo_train.sh --help` outside Slurm printed the job's banner (`=== DPO job local ...`, the project,
    the nodes, the commit) and its time-limit lines ("no time-limit warning is set for this job") before the help.
    Its train_dpo.py --help on the warm interpreter (a fresh one: ~5 CPU-s of imports for the same help)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"VENV": warm_venv()}
    result = subprocess.run(
        ["bash", "scripts/dpo_train.sh", "--max_steps", "4", flag],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]  # no time-limit lines
    assert "usage: python train_dpo.py --config RECIPE" in result.stdout, result.stdout[:2000]
    assert "sbatch scripts/dpo_train.sh" in result.stdout and "DPO job" not in result.stdout, result.stdout[:2000]


def test_a_relative_cache_folder_is_where_it_was_written_for_every_entry_point(tmp_path, monkeypatch):
    """`DPOTRAIN_CACHE=cache` or `HF_HOME=hf` in `.env` is the project's folder (beside the `.env`), whatever folder a
    command runs in; exported in the shell it is the folder it was set in, which for a Slurm job is the folder
    submitted from (the job runs in the project). Read from each command's folder, prefetch.py and the analyzer run
    from the user's folder filled one cache and the job, started in the project, read another."""
    from dpotrain.data import lengths

    project, submitted, elsewhere = tmp_path / "project", tmp_path / "my work", tmp_path / "elsewhere"
    for folder in (project, submitted, elsewhere):
        folder.mkdir()
    (project / ".env").write_text("DPOTRAIN_CACHE=cache\nHF_HOME=./caches/hf\nHF_HUB_CACHE=/abs/hub\n")
    names = ("DPOTRAIN_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", "ds")  # the shell's, relative
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    monkeypatch.chdir(elsewhere)  # where the job runs (the project for scripts/launch.sh; any other folder alike)
    venv.load_env(project)
    found = {name: os.environ.get(name) for name in names}
    assert found == {
        "DPOTRAIN_CACHE": str(project / "cache"),
        "HF_HOME": str(project / "caches" / "hf"),
        "HF_HUB_CACHE": "/abs/hub",
        "HF_DATASETS_CACHE": str(submitted / "ds"),
    }, found
    assert lengths.cache_root() == project / "cache"
    venv.load_env(project)  # read again (an importer's main(), after its first run): the same folders
    assert {name: os.environ.get(name) for name in names} == found
    monkeypatch.delenv("DPOTRAIN_SUBMIT_DIR")  # not a job: the shell's is the folder the command runs in
    monkeypatch.setenv("HF_DATASETS_CACHE", "ds")
    venv.load_env(project)
    assert os.environ["HF_DATASETS_CACHE"] == str(elsewhere / "ds")


def test_a_dot_env_in_the_folder_typed_in_that_is_not_the_projects_is_named_not_passed_over(
    tmp_path, monkeypatch, capsys
):
    """A `.env` in the folder a command is typed in (a job's folder submitted from), not the project's: every command
    reads the project's alone, and this one's HF_HOME, WANDB_MODE=offline or HF_TOKEN went unread without a word (the
    dry run then asked to "add WANDB_API_KEY=... to .env, ... set WANDB_MODE=offline", which the user had done there).
    Named once, by the launch's main process; the project's own folder, or a link to its `.env`, says nothing."""
    project, mine, submitted, linked = (tmp_path / name for name in ("project", "mine", "submitted", "linked"))
    for folder in (project, mine, submitted, linked):
        folder.mkdir()
    for folder in (mine, submitted):
        (folder / ".env").write_text("WANDB_MODE=offline\n")
    (project / ".env").write_text("# the project's: no values\n")
    (linked / ".env").symlink_to(project / ".env")
    for name in ("WANDB_MODE", "DPOTRAIN_SUBMIT_DIR", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(mine)
    venv.load_env(project)
    err = capsys.readouterr().err
    assert f"warning: {mine / '.env'} is not read" in err and str(project / ".env") in err, err
    assert "WANDB_MODE" not in os.environ  # the project's alone is read
    venv.load_env(project)  # read again (an importer's main()): said once
    assert capsys.readouterr().err == ""
    # A job runs in the project: the folder it was submitted from is the one typed in; its other ranks say nothing
    monkeypatch.chdir(project)
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    monkeypatch.setenv("RANK", "1")
    venv.load_env(project)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")  # launched by launch.sh after its dry run, which named it
    venv.load_env(project)
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("LOCAL_RANK")  # that dry run
    venv.load_env(project)
    assert f"warning: {submitted / '.env'} is not read" in capsys.readouterr().err
    for folder in (project, linked):  # the project's own .env
        monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(folder))
        venv.load_env(project)
        assert capsys.readouterr().err == ""


def test_an_empty_cache_folder_is_the_libraries_default_not_the_folder_a_command_runs_in(tmp_path):
    """`HF_HOME=` in `.env` (a placeholder left blank) or `export HF_DATASETS_CACHE=` in the shell: the Hub libraries
    join their folders to the empty path, so each command cached in the folder it ran in (`./hub`, `./datasets`: a
    job in the project, prefetch.py and the analyzer wherever they were typed), the offline job missing what prefetch.py
    fetched. Empty is unset, as DPOTRAIN_CACHE's already was: the libraries' defaults, in a fresh interpreter."""
    import subprocess
    import sys

    project, elsewhere, home = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "home"
    for folder in (project, elsewhere):
        folder.mkdir()
    (project / ".env").write_text("HF_HOME=\nHF_HUB_CACHE=''\n")
    code = (
        "import sys; from pathlib import Path; from dpotrain.recipe import venv; venv.load_env(Path(sys.argv[1]))\n"
        "import datasets.config, huggingface_hub.constants as c\n"
        "print(c.HF_HOME, c.HF_HUB_CACHE, datasets.config.HF_DATASETS_CACHE, sep='\\n')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_CACHE"))}
    env |= {"HF_DATASETS_CACHE": "", "HOME": str(home), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(project)], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    hf = home / ".cache" / "huggingface"
    assert result.stdout.split() == [str(hf), str(hf / "hub"), str(hf / "datasets")], result.stdout


def test_home_and_variables_in_a_cache_folder_of_the_env_file_are_read_as_a_shell_reads_them(tmp_path, monkeypatch):
    """`HF_DATASETS_CACHE=~/ds` or `=$SCRATCH/ds` in `.env`: python-dotenv expands only `${VAR}`, and datasets took
    `~/ds` literally, filling a folder named `~` in the folder the command ran in; `$SCRATCH/ds`, relative, became a
    folder named `$SCRATCH` in the project. Other values (a token) are untouched; an unset variable is refused."""
    home, scratch, project = tmp_path / "home", tmp_path / "scratch", tmp_path / "project"
    project.mkdir()
    (project / ".env").write_text(
        'HF_DATASETS_CACHE=~/ds\nDPOTRAIN_CACHE=$SCRATCH/dpo\nTRITON_CACHE_DIR="${SCRATCH}/triton"\nHF_TOKEN=hf_$x\n'
    )
    names = ("HF_DATASETS_CACHE", "DPOTRAIN_CACHE", "TRITON_CACHE_DIR", "HF_TOKEN")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SCRATCH", str(scratch))
    monkeypatch.chdir(project)
    venv.load_env(project)
    assert {name: os.environ[name] for name in names} == {
        "HF_DATASETS_CACHE": str(home / "ds"),
        "DPOTRAIN_CACHE": str(scratch / "dpo"),
        "TRITON_CACHE_DIR": str(scratch / "triton"),
        "HF_TOKEN": "hf_$x",
    }
    monkeypatch.setenv("HF_HUB_CACHE", "~/hub")  # the environment's, with a `~` the shell left (quoted)
    venv.load_env(project)
    assert os.environ["HF_HUB_CACHE"] == str(home / "hub")
    for name in names:  # not monkeypatch: its undo, after own_environment's, would put load_env's values back
        del os.environ[name]
    monkeypatch.delenv("SCRATCH")
    with pytest.raises(SystemExit) as refused:
        venv.load_env(project)
    assert str(refused.value) == (
        "error: .env sets DPOTRAIN_CACHE=$SCRATCH/dpo, but SCRATCH is not set: export SCRATCH before running, "
        "or write the folder's absolute path in .env"
    )


def test_a_bare_name_in_the_env_file_sets_nothing_beside_an_expanded_folder(tmp_path, monkeypatch):
    """A `.env` line with a name and no `=` (python-dotenv reads it as no value; load_dotenv sets nothing) beside a
    folder to expand: the expansion looked the name up in the environment and ended in a KeyError traceback."""
    (tmp_path / ".env").write_text("WANDB_DISABLED\nHF_DATASETS_CACHE=~/ds\n")
    for name in ("WANDB_DISABLED", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    venv.load_env(tmp_path)
    assert "WANDB_DISABLED" not in os.environ
    assert os.environ["HF_DATASETS_CACHE"] == str(tmp_path / "home" / "ds")


def test_a_dollar_in_an_env_file_value_not_a_folders_is_kept_as_written(tmp_path, monkeypatch):
    """Pinned, not a fix: a review asked whether `PASS=a$$b` in `.env` became `a$b`. It does not: python-dotenv reads
    `${NAME}` alone, and `venv.expand_folder` reads `$` in a folder's value only (`HF_HOME=a$$b` is `a$b`, as a shell
    reads it), so a token or password with `$` is taken as written, quoted or not."""
    (tmp_path / ".env").write_text("DPO_PASS=a$$b\nDPO_NOTE=x$HOME\nDPO_QUOTED='q$$r'\nDPO_CACHE_DIR=c$$d\n")
    for name in ("DPO_PASS", "DPO_NOTE", "DPO_QUOTED", "DPO_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    venv.load_env(tmp_path)
    got = {name: os.environ[name] for name in ("DPO_PASS", "DPO_NOTE", "DPO_QUOTED", "DPO_CACHE_DIR")}
    assert got == {"DPO_PASS": "a$$b", "DPO_NOTE": "x$HOME", "DPO_QUOTED": "q$$r", "DPO_CACHE_DIR": "c$d"}


def test_an_empty_variable_in_the_shell_that_hides_the_env_files_value_is_named_where_the_value_is_asked_for(
    tmp_path, monkeypatch
):
    """`export HF_TOKEN=` (a placeholder in a shell profile or a cluster's module) beside HF_TOKEN=hf_... in `.env`:
    push_to_hub said "no Hugging Face token: add HF_TOKEN=... to .env", which the user had done. The environment still
    wins over `.env`, an empty value too (`HF_TOKEN= cmd` means no token; the tests mean it so), and each refusal that
    asks for the value says what hides it."""
    from dpotrain.hub.hub import PushSettings

    (tmp_path / ".env").write_text("HF_TOKEN=hf_from_env_file\nWANDB_API_KEY=from_env_file\n")
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("WANDB_API_KEY", "from_shell")
    venv.load_env(tmp_path)
    assert (os.environ["HF_TOKEN"], os.environ["WANDB_API_KEY"]) == ("", "from_shell")
    # Said from what load_env read, not from .env read again: a file edited since is not the one the command read
    (tmp_path / ".env").write_text("WANDB_API_KEY=from_env_file\n")
    hint = " (.env sets HF_TOKEN, but an empty HF_TOKEN in the environment wins over it: unset HF_TOKEN)"
    assert venv.hidden("HF_TOKEN", tmp_path) == hint
    assert venv.hidden("WANDB_API_KEY", tmp_path) == ""  # set: it is the value
    monkeypatch.delenv("HF_TOKEN")
    assert venv.hidden("HF_TOKEN", tmp_path) == ""  # unset: .env's is taken
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setattr(venv, "ROOT", tmp_path)  # the project's .env, as the run reads it
    with pytest.raises(ConfigError) as refused:
        PushSettings(requested=True, repo_id="me/x", private=None, checkpoints=False).check_token()
    assert str(refused.value).endswith(f"or drop --push_to_hub{hint}") and "hf_from_env_file" not in str(refused.value)


@pytest.mark.parametrize("line", ['HF_TOKEN="hf_secret', "HF_TOKEN: hf_secret"], ids=["unclosed-quote", "yaml-style"])
def test_a_line_of_the_env_file_that_cannot_be_read_is_refused_by_its_number(line, tmp_path, monkeypatch):
    """python-dotenv skips a line it cannot read, with a warning naming no file ("could not parse statement starting
    at line 2", twice); the token on it was then missing, and push_to_hub.py said to add HF_TOKEN to .env, which the
    user had. Refused in one line naming the file and the line, never its value."""
    (tmp_path / ".env").write_text(f"WANDB_PROJECT=p\n{line}\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SystemExit) as refused:
        venv.load_env(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"error: {tmp_path / '.env'} line 2 is not NAME=value"), message
    assert "hf_secret" not in message and "HF_TOKEN" not in os.environ


UTF16 = "is UTF-16 text, not the UTF-8 python-dotenv reads"


@pytest.mark.parametrize(
    "text, said",
    [
        ("WANDB_MODE=offline\nHF_TOKEN=hf_secret\n".encode("utf-16"), UTF16),
        ("WANDB_MODE=offline\nHF_TOKEN=hf_secret\n".encode("utf-16-le"), UTF16),
        (b"WANDB_MODE=o\nHF_TOKEN=hf_caf\xe9\n", "line 2 is not UTF-8 text"),
    ],
    ids=["utf-16", "utf-16-no-mark", "latin-1"],
)
def test_an_env_file_that_is_not_utf8_is_refused_in_one_line(text, said, tmp_path, monkeypatch):
    """A `.env` saved as UTF-16 (PowerShell 5's `echo ... > .env`, Notepad's "Unicode") or in Latin-1: every entry
    point (train_dpo.py, push_to_hub.py, ...) ended in a UnicodeDecodeError traceback, and UTF-16 without its
    byte-order mark (it decodes as UTF-8) in os.environ's "embedded null byte". Refused in one line naming the file
    and the fix, never the bytes (the line may hold a token)."""
    (tmp_path / ".env").write_bytes(text)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SystemExit) as refused:
        venv.load_env(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"error: {tmp_path / '.env'} {said}"), message
    assert "save it as UTF-8" in message and "hf_" not in message and "HF_TOKEN" not in os.environ


def test_a_count_of_one_reads_in_the_singular_in_what_a_run_prints(tmp_path, capsys, monkeypatch):
    """`save_total_limit: 1`, a step of one pair, a checkpoint of one process's ZeRO state: "the last 1 checkpoints",
    "Plan: 1 steps of 1 pairs", "micro-batches of 1 pairs", "partitioned over 1 processes ... on 1 processes"."""
    import numpy as np

    from dpotrain import publish
    from dpotrain.hub import hub
    from dpotrain.plan import plan
    from dpotrain.plan.plan_stage import RunPlan
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train import resume

    smoke, out = str(ROOT / "configs" / "smoke.yaml"), tmp_path / "run"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--push_to_hub", "true", "--hub_model_id", "me/x", "--push_checkpoints", "true", "--hub_token", "hf_x"]
    recipe = parse_args(["--config", smoke, "--output_dir", str(out), "--save_total_limit", "1", *args])
    publish.push_final(out, hub.take_push_settings(recipe), recipe.training)
    assert "nothing was pushed: push (the last checkpoint, the one still on disk) from" in capsys.readouterr().out

    # The plan's line wrote "(1 epoch(s) planned), 1 micro-batch(es) per step per rank, 1 filler micro-batch(es)"
    per_step, summary = {"min": 1, "mean": 1, "max": 1}, {"filler_micro_batches": 0, "padding_share": 0.0}
    summary = {**summary, "micro_batches_per_step": per_step, "forward": "packed"}
    one = RunPlan(None, plan.StepPlan(1, 1, 0, None, 1), [[np.zeros(1)]], summary, None)
    assert one.line().startswith("Plan: 1 step of 1 pair per epoch (1 epoch planned), 1 micro-batch per step per rank")
    spread = {**per_step, "mean": 1.5, "max": 2}
    two = RunPlan(None, one.step_plan, [[np.zeros(1)]] * 2, {**summary, "micro_batches_per_step": spread}, None)
    assert "(2 epochs planned), 1-2 micro-batches per step per rank, 0.0% padding" in two.line()
    fillers = [dataclasses.replace(one, summary={**summary, "filler_micro_batches": n}).line() for n in (1, 2)]
    assert ", 1 filler micro-batch, " in fillers[0] and ", 2 filler micro-batches, " in fillers[1]

    parse_args(["--config", smoke, "--per_device_train_batch_size", "1"])
    assert "on the command line: micro-batches of 1 pair, 1 per step and process" in capsys.readouterr().err

    # The reference's speed line read "over 1 process(es) in 1 micro-batch(es) each"
    from dpotrain.reference.reference import Outcome

    speed = {"warmup_seconds": 2.0, "tokens_per_second": 1000.0}
    one = Outcome("train", 4, 0, 4, False, out, world=1, micro_batches=1, **speed).speed_line()
    assert one.endswith(": warm-up 2.0 s (first micro-batch), then 1,000 tokens/s over 1 process in 1 micro-batch each")
    two = Outcome("train", 4, 0, 4, False, out, world=2, micro_batches=2, **speed).speed_line()
    assert two.endswith("over 2 processes (500 per process) in 2 micro-batches each")

    (out / "checkpoint-2" / "global_step2").mkdir(parents=True)
    (out / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="partitioned over 1 process, and this run has 2: resume it on 1 process,"):
        resume.check_partitions(str(out / "checkpoint-2"), 2)


def test_a_shipped_recipe_named_from_outside_the_project_is_refused_naming_its_path_from_there(tmp_path, monkeypatch):
    """`python ~/dpotrain/train_dpo.py --config configs/think.yaml` (every example's spelling) from another folder:
    a command line's path is the folder's, and the refusal advised "pass one of configs/*.yaml", what was passed."""
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", "configs/smoke.yaml", "--dry-run"])
    assert str(refused.value) == (
        f"recipe 'configs/smoke.yaml' not found in {tmp_path}: pass --config {ROOT / 'configs' / 'smoke.yaml'}"
    )
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", "configs/mine.yaml", "--dry-run"])
    assert str(refused.value) == (
        f"recipe 'configs/mine.yaml' not found in {tmp_path}: pass one of {ROOT / 'configs'}/*.yaml"
    )
    monkeypatch.chdir(ROOT)  # in the project, as before
    with pytest.raises(ConfigError, match=f"^recipe 'configs/mine.yaml' not found in {ROOT}: pass one of configs/"):
        parse_args(["--config", "configs/mine.yaml", "--dry-run"])


def test_the_recipe_refusal_quotes_a_project_path_with_spaces(tmp_path, monkeypatch):
    """A project in a folder with spaces (`~/my projects/dpotrain`): the refusal's fix named its path unquoted
    (`pass --config /home/me/my projects/dpotrain/configs/smoke.yaml`), which a shell splits when pasted."""
    import shlex

    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    project, here = tmp_path / "my projects" / "dpotrain", tmp_path / "runs"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "smoke.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    here.mkdir()
    monkeypatch.setattr(venv, "ROOT", project)
    monkeypatch.chdir(here)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", "configs/smoke.yaml", "--dry-run"])
    assert shlex.split(str(refused.value).split(": pass ")[1]) == ["--config", str(project / "configs" / "smoke.yaml")]
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", "configs/mine.yaml", "--dry-run"])
    assert str(refused.value).endswith(f"pass one of {shlex.quote(str(project / 'configs'))}/*.yaml")


def test_a_run_started_in_the_project_resumes_from_another_folder_on_the_same_files(tmp_path, monkeypatch):
    """A run started in the project records the recipe's `dataset_name: data/smoke_prefs.jsonl` as written; the same
    command from another folder names the project's file by its full path, and the resume was refused as a run with
    other settings ("dataset_name: 'data/smoke_prefs.jsonl' -> '/.../data/smoke_prefs.jsonl'"): the recorded name was
    looked for in the folder the resume runs in alone. A job's folder submitted from counts too."""
    import json
    import shutil

    from dpotrain import resolve
    from dpotrain.recipe.config import parse_args

    argv = ["--config", SMOKE, "--output_dir", str(tmp_path / "run")]
    monkeypatch.chdir(ROOT)
    started = parse_args(argv)
    assert started.script.dataset_name == "data/smoke_prefs.jsonl"
    out = tmp_path / "run"
    out.mkdir()
    (out / "resolved_config.json").write_text(json.dumps(resolve.resolved_config(started, {})))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = parse_args(argv)
    assert resumed.script.dataset_name == str(ROOT / "data" / "smoke_prefs.jsonl")
    assert resolve.changed_settings(resumed, out, None) == []
    # Another file of the same name is still another setting
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", elsewhere / "mine.jsonl")
    other = parse_args([*argv, "--dataset_name", "mine.jsonl"])
    assert [c.split(":")[0] for c in resolve.changed_settings(other, out, None)] == ["dataset_name"]
    # A Slurm job (run in the project) resuming a run started in the folder it was submitted from, by a relative name
    (out / "resolved_config.json").write_text(json.dumps(resolve.resolved_config(other, {})))
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(elsewhere))
    monkeypatch.chdir(ROOT)
    job = parse_args([*argv, "--dataset_name", "mine.jsonl"])
    assert job.script.dataset_name == str(elsewhere / "mine.jsonl")
    assert resolve.changed_settings(job, out, None) == []


def test_a_mixture_run_resumes_where_its_sources_are_named_by_their_full_path(tmp_path, monkeypatch):
    """A mixture's sources are placed as dataset_name is (config._mixture_files): a Slurm job's command line's by
    their full path in the folder submitted from, a recipe's from another folder in the project. A run started where
    its data is records `--dataset_mixer_list data/pairs.jsonl 1.0` as written, so its requeue as a job submitted from
    there (or a run recorded before these rules) was refused as a run with other settings
    ("dataset_mixer_list: ['data/pairs.jsonl', '1.0'] -> ['/.../data/pairs.jsonl', '1.0']"), where the same for
    dataset_name resumes (resolve._one_place). The sources' content is still compared (they are recorded by the names
    the run started with), and another file is still another setting."""
    import json
    import shutil

    from dpotrain import resolve
    from dpotrain.data import mixture
    from dpotrain.recipe.config import parse_args

    (tmp_path / "data").mkdir()
    pairs = tmp_path / "data" / "pairs.jsonl"
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", pairs)
    monkeypatch.delenv("DPOTRAIN_SUBMIT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    entry = json.dumps({"path": "json", "data_files": "data/pairs.jsonl"})
    for given in (["--dataset_mixer_list", "data/pairs.jsonl", "1.0"], ["--datasets", entry]):
        argv = ["--config", SMOKE, "--output_dir", str(out), *given]
        started = parse_args(argv)
        record = resolve.resolved_config(started, {})
        sources = mixture.parse(mixture.fields_of(started))
        record["derived"] = {
            "data_sources": [{"source": s.spec(), "identity": mixture.identity_of(s)} for s in sources]
        }
        (out / "resolved_config.json").write_text(json.dumps(record))
        monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(tmp_path))  # a job submitted from there, run in the project
        monkeypatch.chdir(ROOT)
        job = parse_args(argv)
        assert str(pairs) in str(job.project.datasets or job.project.dataset_mixer_list)
        assert resolve.changed_settings(job, out, None) == []
        with open(pairs, "a") as f:
            f.write(ROOT.joinpath("data", "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[0])
        changed = resolve.changed_settings(job, out, None)
        assert len(changed) == 1 and changed[0].startswith("dataset content: ") and "pairs.jsonl" in changed[0]
        shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", pairs)
        monkeypatch.delenv("DPOTRAIN_SUBMIT_DIR")
        monkeypatch.chdir(tmp_path)
    shutil.copy(pairs, tmp_path / "mine.jsonl")
    other = parse_args(["--config", SMOKE, "--output_dir", str(out), "--datasets", "mine.jsonl"])
    assert [c.split(":")[0] for c in resolve.changed_settings(other, out, None)] == ["datasets"]


def test_a_dry_run_into_a_file_says_the_runs_one_refusal_of_it(tmp_path, capsys):
    """`--output_dir` naming a file: the dry run listed the run's refusal ("is a file, not a folder"), then a second,
    misleading one from reading inside it ("afile/run_files.json is unreadable (NotADirectoryError ...): it is the
    record of the run already in that folder"). The run stops at the first; the dry run says that one alone."""
    target = tmp_path / "afile"
    target.write_text("a user's file\n")
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(target))
    refusals = [line for line in out.splitlines() if line.startswith("warning: the run would refuse: ")]
    assert len(refusals) == 1 and "is a file, not a folder: pass --output_dir a folder" in refusals[0], refusals
    assert target.read_text() == "a user's file\n"


@pytest.mark.slow
def test_a_flag_typed_twice_with_two_values_is_said_and_the_last_counts(tmp_path):
    """`python train_dpo.py ... --learning_rate 1e-6 ... --learning_rate 2e-6` as a person types it (sys.argv, which
    the check reads): the last counts, as argparse's, and one warning line names both values, which was silent.
    Its stdout is the JSON alone, W&B offline too, as prefetch.py's is its own text."""
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--output_dir", str(out), "--learning_rate", "1e-6", "--learning_rate=2e-6"]

    # W&B offline, as a job without a key runs: transformers printed "[INFO] Running in WANDB offline mode" to stdout
    # as train_dpo imported it, before the JSON, and `--json | jq` broke. stdout is the JSON alone. A fresh interpreter,
    # not python()'s warm one, whose imports (and that line) were made once in its server.
    def fresh(script: str, *words: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "WANDB_MODE": "offline"}
        command = [sys.executable, str(ROOT / script), *words]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    result = fresh("train_dpo.py", *args, "--dry-run", "--json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    warning = "warning: --learning_rate is given twice on the command line (1e-6, then 2e-6): the last counts"
    assert result.stderr.splitlines().count(warning) == 1, result.stderr[-2000:]
    assert json.loads(result.stdout)["learning_rate"] == 2e-06, result.stdout[:2000]
    # prefetch.py loaded its libraries outside venv.entry_point, so the line began its stdout (`--help` and answers)
    helped = fresh("scripts/prefetch.py", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: prefetch.py"), helped.stdout[:500]


def test_the_options_help_names_readme_sections_that_exist():
    """`--help` pointed memory_check at "README 'Memory plan'" and auto_coverage at "README: Choosing max_length",
    sections the README no longer has (they are docs/memory.md and docs/max_length.md): every README section an
    option's help names begins one of the README's headings."""
    import dataclasses
    import re

    from dpotrain.recipe import usage
    from dpotrain.recipe.config import ProjectArguments

    headings = [line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines() if line[:2] == "##"]
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(ProjectArguments)} | usage.OWN_WORDS
    named = {
        name: section for name, text in helps.items() for section in re.findall(r"README(?:: |\s+')([^)']+)", text)
    }
    assert "sequence_parallel_size" in named and "loss_type" in named  # README: Long traces, The loss
    assert {name: s for name, s in named.items() if not any(h.startswith(s) for h in headings)} == {}


# --- a newcomer's commands hunt: odd credentials, a recipe that is a folder, a mistyped script flag ------------------


@pytest.mark.parametrize("blank", ["", "   ", "\t"], ids=["empty", "spaces", "tab"])
def test_a_blank_hugging_face_token_or_wandb_key_is_no_login(blank, tmp_path, capsys, no_credentials, monkeypatch):
    """`HF_TOKEN="  "` or `WANDB_API_KEY=" "` in .env (a value pasted as spaces, or a quoted placeholder): the dry run
    counted it as a login and said nothing, the run started, and the push (or wandb.init, after the model loaded)
    failed on a key that was never there. Blank is no login, as huggingface_hub and wandb read it."""
    monkeypatch.setenv("HF_TOKEN", blank)
    monkeypatch.setenv("WANDB_API_KEY", blank)
    out = dry_run(
        capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--push_to_hub", "--hub_model_id", "me/x",
        "--report_to", "wandb",
    )  # fmt: skip
    assert "warning: the run would refuse: push_to_hub is set but no Hugging Face token was found" in out, out
    assert "report_to wandb but no W&B login" in out, out
    if blank:
        assert "(HF_TOKEN is set to white space only: give its value, or unset HF_TOKEN)" in out, out
        assert "(WANDB_API_KEY is set to white space only: give its value, or unset WANDB_API_KEY)" in out, out


def test_a_blank_token_from_the_env_file_is_named_there_not_unset_in_the_shell(tmp_path, monkeypatch):
    """`HF_TOKEN="  "` in .env (a quoted placeholder): the hint said "give its value, or unset HF_TOKEN", and an
    `unset` in the shell does nothing to .env's line, which is read again by the next command. It names .env."""
    (tmp_path / ".env").write_text('HF_TOKEN="  "\n')
    monkeypatch.delenv("HF_TOKEN", raising=False)
    venv.load_env(tmp_path)
    assert venv.hidden("HF_TOKEN", tmp_path) == " (.env sets HF_TOKEN to white space only: give its value there)"
    monkeypatch.setenv("HF_TOKEN", " ")  # the shell's own blank, beside .env's other one: the shell's is the cause
    assert (
        venv.hidden("HF_TOKEN", tmp_path) == " (HF_TOKEN is set to white space only: give its value, or unset HF_TOKEN)"
    )


def test_a_recipe_that_is_a_folder_is_named_as_a_folder(tmp_path, monkeypatch):
    """`--config configs/` (a folder, or a recipe path completed to a folder by the shell) was refused as "not found",
    though it was there: the refusal says it is a folder and which files in it are recipes."""
    from dpotrain.recipe.config import parse_args

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--config", "recipes", "--dry-run"])
    assert str(refused.value) == (
        "recipe 'recipes' is a folder, not a recipe file: pass one of its files (--config recipes/mine.yaml)"
    )
    (tmp_path / "recipes" / "mine.yaml").unlink()  # a folder without a recipe: no file of it to name
    with pytest.raises(ConfigError, match="^recipe 'recipes' is a folder, not a recipe file: pass a .yaml recipe"):
        parse_args(["--config", "recipes", "--dry-run"])


@pytest.mark.parametrize("word", ["--devv", "dev", "--help", "-h"])
def test_setup_env_refuses_a_word_it_does_not_take_before_it_installs_anything(word, tmp_path):
    """`bash scripts/setup_env.sh --devv` (or `--help`) installed the training requirements without the test tools and
    said "venv ready", exit 0: the mistyped word was never read. It now stops at once, naming the one word it takes."""
    import subprocess

    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_env.sh", project / "scripts")
    for name in ("requirements.txt", "requirements-dev.txt"):
        (project / name).write_text("")
    python = project / ".venv" / "bin" / "python"  # a stand-in venv: it records what it was asked to install
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "installs"}\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", "scripts/setup_env.sh", word], cwd=project, capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: setup_env.sh takes no {word!r}: "), done.stderr
    assert "--dev" in done.stderr and not (tmp_path / "installs").exists()
    fine = subprocess.run(["bash", "scripts/setup_env.sh", "--dev"], cwd=project, capture_output=True, text=True)
    assert fine.returncode == 0 and "requirements-dev.txt" in fine.stdout, fine.stdout + fine.stderr


@pytest.mark.parametrize("venv", [False, True], ids=["python-named", "venv-in-place"])
def test_setup_env_refuses_a_python_older_than_the_pinned_torch_takes_before_it_installs(venv, tmp_path):
    """The README promised Python 3.10+, but the pinned torch has wheels for 3.11 and later only: on 3.10 setup_env.sh
    made the venv and ended in the resolver's "No solution found". It now says the Python is too old and what to run,
    before it makes or installs anything (a venv already made with 3.10: remove it)."""
    import subprocess

    found = [shutil.which("python3.10"), *map(str, Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))]
    runs = [p for p in found if p and subprocess.run([p, "-c", ""], capture_output=True).returncode == 0]
    if not runs:
        pytest.skip("needs a Python 3.10 (on PATH or pyenv's) to stand for a cluster's older Python")
    old = runs[0]
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_env.sh", project / "scripts")
    for name in ("requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / name, project)
    if venv:
        subprocess.run([old, "-m", "venv", "--without-pip", ".venv"], cwd=project, check=True)
    env = {**os.environ, "PYTHON": old}
    done = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=project, capture_output=True, text=True, env=env)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stdout + done.stderr
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert "is Python 3.10." in done.stderr and f"torch {pinned} needs Python 3.11 or later" in done.stderr
    assert ("rm -rf .venv" in done.stderr) == venv and "PYTHON=python3.11" in done.stderr, done.stderr
    assert (project / ".venv").exists() == venv and not list(project.glob(".venv/.installed-*"))


@pytest.mark.parametrize("torch, need", [("", 10), ("2.15.0+cu130", 2)], ids=["torch-to-install", "torch-in-place"])
def test_setup_env_refuses_to_start_an_install_the_disk_cannot_hold(torch, need, tmp_path):
    """A CI run ended 11 s into the install on pip's "[Errno 28] No space left on device". setup_env.sh now counts the
    free space where the venv and pip's downloads go before it installs anything: on a 64 MB file system it stops with
    the room it needs (less when the pinned torch, a cluster's own build, is already in the venv)."""
    import subprocess

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to mount a small tmpfs")
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert torch == "" or torch.startswith(pinned)  # the in-place case stands for the pinned version
    small = tmp_path / "small"
    small.mkdir()
    stand_in = tmp_path / "python"  # the venv's python: it records what it is asked and knows its torch version
    stand_in.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "asked"}\n[ "$1" = -c ] && echo "{torch}"\nexit 0\n')
    stand_in.chmod(0o755)
    script = f"""
set -e
mkdir -p "$0/project/scripts" "$0/project/.venv/bin" "$0/tmp"
cp {ROOT / "scripts" / "setup_env.sh"} "$0/project/scripts/"
cp {ROOT / "requirements.txt"} {ROOT / "requirements-dev.txt"} "$0/project/"
cp {stand_in} "$0/project/.venv/bin/python"
cd "$0/project" && TMPDIR="$0/tmp" bash scripts/setup_env.sh
"""
    mount = 'mount -t tmpfs -o size=64m tmpfs "$0" && { sh -c "$1" "$0"; rc=$?; umount "$0"; exit $rc; }'
    done = subprocess.run(["unshare", "--mount", "sh", "-c", mount, str(small), script], capture_output=True, text=True)
    if "mount:" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: the install needs about {need} GB free and "), done.stderr
    assert "free disk space" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    free_mb = int(re.search(r"and (\d+) MB are free", done.stderr).group(1))
    assert 0 < free_mb <= 64  # the tmpfs alone, counted once though the venv and TMPDIR are both on it
    assert "-m pip" not in (tmp_path / "asked").read_text()  # asked its torch version, never to install


PIP_SOURCES = """global.find-links='/wheels /more-wheels'
global.index-url='https://pypi.org/simple'
global.extra-index-url='file:///opt/pypi/simple'
:env:.index-url='https://mirror.example/simple'
:env:.cert='/etc/ssl/site.pem'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
"""


@pytest.mark.parametrize(
    "settings, uv_exit, installer",
    [(PIP_SOURCES, 0, "uv"), (PIP_SOURCES + "global.proxy='http://proxy:3128'\n", 0, "pip"), (PIP_SOURCES, 1, "pip")],
    ids=["pip-sources", "a-setting-uv-lacks", "uv-fails"],
)
def test_setup_env_installs_with_uv_from_pips_sources_and_leaves_to_pip_what_uv_cannot(
    settings, uv_exit, installer, tmp_path
):
    """setup_env.sh installs with uv (34 s against pip's 84 s with byte-compiling, on 2 cores). uv reads no pip
    configuration: the indexes, wheel folders, certificate and timeout that pip.conf or PIP_* set are handed to it (one
    index URL: PIP_INDEX_URL's over pip.conf's, as pip takes it), and pip's best match across indexes asked for. A
    pip setting uv is not given (a proxy) leaves the install to pip, as does a uv that fails, with one warning; uv's
    cache beside the venv is removed either way."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_env.sh", project / "scripts")
    for name in ("requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / name, project)
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    (tmp_path / "pip-config").write_text(settings)
    bin_dir = project / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # Stand-ins that record what they are asked: the venv's python (its pip; the torch in place), and the uv that pip
    # installs, which fails with `uv_exit` after making its cache.
    uv = tmp_path / "uv"
    uv.write_text(
        f'#!/bin/sh\necho "uv $* SSL_CERT_FILE=$SSL_CERT_FILE UV_HTTP_TIMEOUT=$UV_HTTP_TIMEOUT"'
        f" >> {tmp_path / 'asked'}\n"
        f'mkdir -p .venv/.uv-cache/wheels\n[ {uv_exit} = 0 ] || echo "error: uv could not reach the index" >&2\n'
        f"exit {uv_exit}\n"
    )
    uv.chmod(0o755)
    (bin_dir / "python").write_text(
        f"""#!/bin/sh
echo "python $*" >> {tmp_path / "asked"}
case "$*" in
  "-m pip config list") cat {tmp_path / "pip-config"} ;;
  *uv==*) cp {uv} {bin_dir / "uv"} ;;
  *importlib.metadata*) echo {pinned}+cu132 ;;
  *sysconfig*) echo {tmp_path / "site"} ;;
esac
"""
    )
    (bin_dir / "python").chmod(0o755)
    done = subprocess.run(["bash", "scripts/setup_env.sh", "--dev"], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0 and "venv ready" in done.stdout, done.stdout + done.stderr
    asked = (tmp_path / "asked").read_text().splitlines()
    uv_asked = [line for line in asked if line.startswith("uv ")]
    pip_asked = [line for line in asked if line.startswith("python -m pip install --quiet --no-compile")]
    compiled = [line for line in asked if line.startswith("python -m compileall")]
    if installer == "uv":
        assert uv_asked == [
            "uv pip install --quiet --python .venv/bin/python --cache-dir .venv/.uv-cache --compile-bytecode"
            " --index-strategy unsafe-best-match --find-links /wheels --find-links /more-wheels"
            " --extra-index-url file:///opt/pypi/simple --index-url https://mirror.example/simple"
            " -r requirements-dev.txt SSL_CERT_FILE=/etc/ssl/site.pem UV_HTTP_TIMEOUT=180"
        ]
        assert not pip_asked and not compiled and done.stderr == "", asked
    else:
        assert pip_asked == ["python -m pip install --quiet --no-compile --no-cache-dir -r requirements-dev.txt"]
        assert compiled == [f"python -m compileall -q -j0 {tmp_path / 'site'}"]
        if uv_exit:
            assert len(uv_asked) == 1, asked
            assert done.stderr == (
                "error: uv could not reach the index\nwarning: uv could not install requirements-dev.txt (its error"
                " above): installing with pip\n"
            )
        else:  # the proxy pip was told of: uv is not even installed
            assert not uv_asked and not any("uv==" in line for line in asked) and done.stderr == "", asked
    assert not (project / ".venv" / ".uv-cache").exists()
    assert list((project / ".venv").glob(".installed-*")), "the install's stamp"


@pytest.mark.parametrize("words", [[], ["--dry-run"]], ids=["bare", "dry-run"])
def test_a_command_without_a_recipe_or_a_model_asks_for_a_recipe(words, tmp_path, monkeypatch):
    """`python train_dpo.py` typed bare stopped on "Your setup doesn't support bf16/gpu" (TRL's defaults, no recipe
    read), and `--dry-run` alone on "set model_name_or_path in the recipe", though no recipe was given: it names
    --config and the recipes."""
    from dpotrain.recipe.config import parse_args

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        parse_args(words)
    configs = ROOT / "configs"  # named by its path from the folder run in, outside the project
    assert str(refused.value).startswith(f"no recipe and no model: pass --config {configs}/<name>.yaml ("), refused
    assert "smoke.yaml" in str(refused.value) and "--model_name_or_path" in str(refused.value)
    with pytest.raises(ConfigError, match=r"^unknown argument '--confg'"):
        parse_args([*words, "--confg", "configs/smoke.yaml"])  # a mistyped flag is named first


@pytest.mark.parametrize("kind", ["dangling-link", "folder", "unreadable"])
def test_an_env_file_there_but_not_readable_is_refused_not_skipped(kind, tmp_path):
    """A `.env` that is a link to a file not there (moved, or on storage this node does not mount) or a folder was
    skipped as absent: its HF_HOME, HF_HUB_OFFLINE and WANDB_MODE=offline were ignored without a word (the job's caches
    in the home quota, an offline node retrying the Hub); one unreadable to this user (a colleague's, mode 600, in a
    shared checkout) was a PermissionError traceback. Each is one line naming the file and the fix."""
    env = tmp_path / ".env"
    if kind == "dangling-link":
        env.symlink_to(tmp_path / "secrets" / "dpotrain.env")
        said = f"error: {env} is a link to {tmp_path / 'secrets' / 'dpotrain.env'}, which is not there"
    elif kind == "folder":
        env.mkdir()
        said = f"error: {env} is not a file"
    else:
        env.write_text("HF_HOME=/somewhere\n")
        env.chmod(0)
        said = f"error: cannot read {env} (Permission denied)"
    # A fresh process (root reads a mode-000 file: it runs without that capability), with the project's own code
    code = "import sys, pathlib; from dpotrain.recipe import venv; venv.load_env(pathlib.Path(sys.argv[1]))"
    command = [sys.executable, "-c", code, str(tmp_path)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root's file-read capability")
        drop = "-dac_override,-dac_read_search"
        command = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.startswith(said), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("name", ["PREFLIGHT", "CPU_PROCESSES_PER_NODE", "RECIPE"])
def test_an_env_file_setting_a_variable_only_the_job_script_reads_is_refused(name, tmp_path, monkeypatch):
    """`.env.example` says the scripts load `.env`, but scripts/launch.sh reads its own variables (PREFLIGHT, RECIPE,
    CPU_PROCESSES_PER_NODE, ...) from the environment alone: a `.env` with PREFLIGHT=1 and CPU_PROCESSES_PER_NODE=2
    ran a Slurm job with no preflight on one process, COMPLETED, without a word. Refused in one line naming the variable
    and where to give it; the same value already in the environment is harmless."""
    (tmp_path / ".env").write_text(f"WANDB_MODE=offline\n{name}=configs/smoke.yaml\n")
    monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as refused:
        venv.load_env(tmp_path)
    assert str(refused.value) == (
        f"error: {tmp_path / '.env'} sets {name}, which only scripts/launch.sh reads, from the environment a job "
        f"starts with (never from .env): remove it from .env and give it on the command line ({name}=... sbatch "
        "scripts/dpo_train.sh ...)"
    )
    monkeypatch.setenv(name, "configs/smoke.yaml")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    venv.load_env(tmp_path)
    assert os.environ["WANDB_MODE"] == "offline"


def _help_rows(capsys) -> dict[str, str]:
    """--help-all's rows: each field's name -> its help, whitespace as single spaces."""
    from dpotrain.recipe.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help-all"])
    every = capsys.readouterr().out
    rows = re.findall(r"^  --(\w+)(.*\n(?:(?!  -).*\n)*)", every, re.M)
    return {name: re.sub(r"\s+", " ", text) for name, text in rows}


def test_help_all_says_that_each_field_the_run_refuses_is_refused_with_the_refusals_fix(capsys):
    """--help-all gave TRL's and transformers' own words for the fields the run refuses: --hub_revision "The revision
    to use when pushing to the Hub", --load_best_model_at_end "Load the best checkpoint at the end of training",
    --deepspeed "Enable DeepSpeed integration", --label_smoothing_factor "Label smoothing factor to prevent
    overconfidence". Each refused field's help says it is refused, with the fix the refusal gives (one table for
    both)."""
    from dpotrain.recipe import refused

    rows = _help_rows(capsys)
    fixes = {name: why for name, why in (refused.UNREAD | refused.UNSETTABLE | refused.NOT_DEFAULT).items()}
    fixes |= {"deepspeed": refused.ENGINE_SWITCHES, "fsdp": refused.ENGINE_SWITCHES, "fsdp_config": refused.FSDP_CONFIG}
    fixes |= {"load_best_model_at_end": "remove it (every checkpoint-N is a complete model"}
    fixes |= {"hub_revision": refused.HUB_REVISION, "hub_strategy": refused.HUB_STRATEGY}
    fixes |= {"train_sampling_strategy": refused.SAMPLER}
    for name, fix in fixes.items():
        assert "refused" in rows[name].lower(), (name, rows[name])
        # argparse wraps at hyphens too ("micro- batches"): the words compared without their spaces
        assert re.sub(r"\s+", "", fix) in re.sub(r"\s+", "", rows[name]), (name, rows[name])
    with pytest.raises(ConfigError, match="would save the best checkpoint's weights as the final model"):
        train_dpo.main(["--config", SMOKE, "--load_best_model_at_end", "--eval_strategy", "steps", "--dry-run"])


def test_help_all_says_the_memory_plan_decides_checkpointing_and_that_keep_end_trains(capsys):
    """--help-all gave --gradient_checkpointing "Enable gradient checkpointing ... (default: True)" and
    --activation_checkpointing the same "(default: None)", where unset the memory plan decides how many layers are
    checkpointed; and --truncation_mode "The only supported value is 'keep_start'", where keep_end trains (the analyzer
    and docs/max_length.md take it). Checked on a parse, so the words follow the code."""
    from dpotrain.plan.memory import checkpointing_request
    from dpotrain.recipe.config import parse_args

    rows = _help_rows(capsys)
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        assert "Enable" not in rows[name], rows[name]
    assert "memory plan" in rows["activation_checkpointing"]
    assert "old name of activation_checkpointing" in rows["gradient_checkpointing"]
    assert "only supported value" not in rows["truncation_mode"] and "keep_end keeps its end" in rows["truncation_mode"]
    unset = parse_args(["--config", SMOKE, "--activation_checkpointing", "true", "--dry-run"])
    assert checkpointing_request(unset) == (1, False)  # every layer allowed, the plan may choose fewer
    assert parse_args(["--config", SMOKE, "--truncation_mode", "keep_end"]).training.truncation_mode == "keep_end"


def test_help_all_gives_only_the_runs_default_for_the_fields_whose_default_the_run_decides(capsys):
    """--help-all printed argparse's `(default: ...)`, TRL's or transformers' value, beside this project's words for
    the fields whose default the run decides: --hub_strategy "Unset (shown every_save) or end ... (default:
    every_save)", --output_dir "(default: outputs/<run_name>) (default: None)", --gradient_checkpointing "(default:
    True)" where unset the memory plan decides; and each `--no_<field>` switch "(default: False)" (for
    --no_skip_memory_metrics, whose memory metrics are skipped unless asked), a value the parse never reads (the
    field's own flag gives it). Those rows now say the run's default in their own words alone."""
    from dpotrain.recipe import usage

    rows = _help_rows(capsys)
    for name in usage.RUN_DECIDES:
        assert rows[name].count("(default") <= 1 and "shown" not in rows[name], (name, rows[name])
        assert "default" in rows[name].lower(), (name, rows[name])
    switches = [name for name in rows if name.startswith("no_") and name[3:] in rows]
    assert "no_gradient_checkpointing" in switches and "no_skip_memory_metrics" in switches, switches
    for name in switches:
        assert "(default:" not in rows[name], (name, rows[name])
    assert rows["skip_memory_metrics"].endswith("(default: True) "), rows["skip_memory_metrics"]  # the field's own
    assert "(default: every_save)" not in rows["hub_strategy"] and "(default: None)" not in rows["output_dir"]


# Words of a refusal that refuses a field for what else the run has (or for being set at all)
FIELD_REFUSALS = ("would be ignored", "does not work with", "is set but", "cannot be honoured", "only used for eval")
FIELD_REFUSALS += ("needs the liger-kernel", "would override", "would be recorded with the run", "only applies with")
FIELD_REFUSALS += ("cannot be trained directly", "would not be NEFTune's")
# The modules whose checks refuse a field for what else the run has
CHECKS = ("options.py", "train/losses.py", "train/lora.py", "forwards/choice.py", "data/mixture.py")
# Functions whose refusals walk refused.py's own tables (UNREAD, ACCELERATOR_UNREAD), the field a table's key
TABLE_WALKS = {"check_unread"}


def _field_refusals():
    """Each `raise ConfigError(...)` of the recipe's checks (options.py, train/losses.py) that refuses a field for what
    else the run has: (where, the function, the key of refused.COMBINED it says, or the field its words start with)."""
    import ast

    found = []
    for path in (ROOT / "dpotrain" / name for name in CHECKS):
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for node in ast.walk(function):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                    continue
                message = node.exc.args[0]
                parts = message.values if isinstance(message, ast.JoinedStr) else [message]
                calls = [p.value for p in parts if isinstance(p, ast.FormattedValue) and isinstance(p.value, ast.Call)]
                # said(name, ...) in a loop over names: each name is a key (said raises KeyError for another)
                keys = [getattr(c.args[0], "value", "<loop>") for c in calls if getattr(c.func, "id", "") == "said"]
                text = "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in parts)
                if keys or any(words in text for words in FIELD_REFUSALS):
                    where = f"{path.name}:{node.lineno}"
                    found.append((where, function.name, keys[0] if keys else None, text.split()[0].lstrip("-")))
    return found


def test_the_reference_only_and_optim_args_key_refusals_are_in_refused_py_and_their_help(capsys):
    """--help-all described --reference_only as working with a live reference, and --optim_args with any key its
    optim reads none of, both refused by words written inline in options.py that no walk of refusals matched. Now
    refused.py's, said by the checks, and in each field's help with when."""
    from dpotrain.recipe import refused

    rows = {name: re.sub(r"\s+", " ", row) for name, row in _help_rows(capsys).items()}
    assert "Refused with a live reference (precompute_ref_log_probs false, or sync_ref_model)" in rows["reference_only"]
    assert "Refused with a key its optim does not read: optim_args" in rows["optim_args"]
    with pytest.raises(ConfigError, match=re.escape(f"reference_only {refused.said('reference_only_live')}")):
        train_dpo.main(["--config", SMOKE, "--reference_only", "--precompute_ref_log_probs", "false"])


def test_every_refusal_of_a_field_is_in_refused_py_and_its_help_says_when(capsys):
    """--help-all described fields the run refuses in a combination as working: --sync_ref_model (refused with
    use_peft, and with precompute_ref_log_probs), --dataloader_persistent_workers (with 0 workers, the default),
    --optim_target_modules (but for galore/apollo), --accelerator_config's loader keys, --use_liger_kernel (the
    package is not installed), --precompute_ref_batch_size (at any value), the evaluation-only fields without
    eval_strategy, ... each refused by words written inline in options.py or train/losses.py. Those words are now
    refused.py's (one table: COMBINED), each field's help adds them with when, and every such refusal the checks raise
    takes its words from the table (a `said(key)`), or walks one of refused.py's tables: one written inline fails here
    unless its field's help says it is refused."""
    from dpotrain.recipe import refused

    rows = _help_rows(capsys)
    bare = {name: re.sub(r"\s+", "", row) for name, row in rows.items()}  # argparse wraps at spaces and hyphens
    for field, when, words, stand_ins in refused.COMBINED.values():
        said = re.sub(r"\s+", "", f"Refused {when}: {field} {words.format(**stand_ins)}")
        assert said in bare[field], (field, rows[field])
    for key, (_, why) in refused.ACCELERATOR_UNREAD.items():
        assert re.sub(r"\s+", "", f"{key} cannot be honoured: {why}") in bare["accelerator_config"], key
    assert "Refused" in rows["precompute_ref_batch_size"], rows["precompute_ref_batch_size"]
    found = _field_refusals()
    assert len([f for f in found if f[2]]) >= 20, found  # the walk sees the table's refusals
    for where, function, key, field in found:
        if key is not None:
            assert key in refused.COMBINED or key == "<loop>", (where, key)
        elif field.startswith("{"):  # a field named by a loop: only over refused.py's tables
            assert function in TABLE_WALKS, (where, function)
        else:
            assert "Refused" in rows.get(field, ""), (where, field, rows.get(field))
    with pytest.raises(ConfigError, match=re.escape(f"sync_ref_model {refused.said('sync_with_peft')}")):
        train_dpo.main(["--config", SMOKE, "--sync_ref_model", "--use_peft", "--lora_target_modules", "all-linear"])

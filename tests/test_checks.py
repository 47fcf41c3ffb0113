"""Bad input is refused before any data set or model loads, with one line that names the fix."""

import json
import os
import signal

import pytest

import train_dpo
from conftest import ROOT, run_train, sealed_checkpoint
from dpotrain.recipe.errors import ConfigError
from dpotrain.train.preemption import STOP_SIGNALS

# A model that cannot load here (offline, not on disk): if a check came after loading, the error would be another.
BASE = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", "org/not-a-model-here"]


@pytest.fixture(autouse=True)
def online(monkeypatch):
    # Offline, the missing model would be the first thing refused (tests/test_offline_and_push.py covers that).
    # No request is made either way: every check here refuses before anything is fetched.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


def refused(tmp_path, *args) -> str:
    with pytest.raises(ConfigError) as info:
        train_dpo.main([*BASE, "--output_dir", str(tmp_path / "run"), *args])
    return str(info.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beta", "0"], "beta must be > 0 (got 0.0); OLMo 3's length-normalized DPO uses --beta 5"),
        (["--beta", "-1"], "beta must be > 0"),
        (["--learning_rate", "0"], "learning_rate must be > 0 (got 0.0)"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be >= 1 (got 0)"),
        (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps must be >= 1"),
        (["--pairs_per_step", "0"], "pairs_per_step must be >= 1"),
    ],
)
def test_bad_values(tmp_path, args, message, capsys):
    assert message in refused(tmp_path, *args)
    # Refused alone: `--per_device_train_batch_size 0` printed the Note on the recipe's pairs_per_step it replaced
    # ("micro-batches of 0 pairs") before its refusal.
    assert "Note:" not in capsys.readouterr().err


def test_missing_local_dataset(tmp_path):
    msg = refused(tmp_path, "--dataset_name", str(tmp_path / "nope.jsonl"))
    assert "does not exist: check the path" in msg and "nope.jsonl" in msg


def test_a_data_set_or_template_given_as_a_pipe_is_refused_as_no_file(tmp_path):
    """`--dataset_name <(zcat pairs.jsonl.gz)`: the shell passes /dev/fd/N, a pipe, which exists but is no file. It was
    sent to the Hub ("could not load data set '/dev/fd/63' from the Hub"), a template said not to exist; and a run
    reads its inputs more than once, where a pipe is empty once read."""
    read, write = os.pipe()
    try:
        os.write(write, b'{"chosen": "Blue.", "rejected": "Red.", "prompt": "Sky?"}\n')
        os.close(write)
        pipe = f"/dev/fd/{read}"
        assert refused(tmp_path, "--dataset_name", pipe) == (
            f"dataset '{pipe}' is not a file or a folder (a pipe or a device): write the pairs to a file first "
            "(.jsonl, or .jsonl.gz as it is) and give that file"
        )
        assert refused(tmp_path, "--chat_template_path", pipe) == (
            f"chat_template_path '{pipe}' is not a file or a folder (a pipe or a device): write the template to a "
            ".jinja file first and give that file"
        )
    finally:
        os.close(read)
    assert not (tmp_path / "run").exists()


def test_dataset_without_chosen_rejected(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    msg = refused(tmp_path, "--dataset_name", str(path))
    assert "has no chosen/rejected columns (it has ['messages'])" in msg and "rename the columns" in msg
    path.write_text(json.dumps({"chosen": "Blue."}) + "\n")  # one missing: it read "no rejected column(s)"
    assert "has no rejected column (it has ['chosen'])" in refused(tmp_path, "--dataset_name", str(path))


def test_output_dir_with_a_finished_run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_complete.json").write_text("{}")
    msg = refused(tmp_path)
    assert "already holds a finished run" in msg and "--overwrite_output_dir" in msg


def test_output_dir_with_only_incomplete_checkpoints(tmp_path):
    (tmp_path / "run" / "checkpoint-10").mkdir(parents=True)  # killed mid-save: no COMPLETE marker
    assert "has no complete checkpoint" in refused(tmp_path)


def test_pairs_per_step_not_reachable(tmp_path, monkeypatch):
    # Micro-batches of a fixed number of pairs: 128 is no whole number of 4-pair micro-batches on 3 processes.
    monkeypatch.setenv("WORLD_SIZE", "3")
    msg = refused(
        tmp_path, "--pairs_per_step", "128", "--per_device_train_batch_size", "4", "--max_tokens_per_microbatch", "None"
    )
    assert "pairs_per_step=128 is not reachable with 3 processes x per_device_train_batch_size=4 (12 pairs per" in msg
    # One process: it read "with 1 process(es)"
    monkeypatch.setenv("WORLD_SIZE", "1")
    msg = refused(
        tmp_path, "--pairs_per_step", "128", "--per_device_train_batch_size", "3", "--max_tokens_per_microbatch", "None"
    )
    assert "pairs_per_step=128 is not reachable with 1 process x per_device_train_batch_size=3 (3 pairs per" in msg
    args = ["--pairs_per_step", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3"]
    msg = refused(tmp_path, *args, "--max_tokens_per_microbatch", "None")
    assert "contradicts pairs_per_step=8 (which needs 2 on 1 process): set one of them, not both" in msg


def test_pairs_per_step_not_reachable_names_the_values_that_reach_it(tmp_path, monkeypatch):
    """A newcomer's hunt: a recipe of one's own without a token budget and `pairs_per_step: 4` met TRL's default of 8
    pairs per device, and was told to "choose a process count or per-device batch that divides 4, or set
    --pairs_per_step", the pairs_per_step it had set: now the values that reach it, as flags."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    msg = refused(tmp_path, "--pairs_per_step", "4", "--max_tokens_per_microbatch", "None")
    assert msg.endswith(
        ": pass --per_device_train_batch_size 4 (pairs per process in a micro-step), --pairs_per_step 8 (a multiple "
        "of 8), or --max_tokens_per_microbatch N (micro-batches cut by tokens, for any pairs_per_step)"
    ), msg
    monkeypatch.setenv("WORLD_SIZE", "3")  # no per-device batch reaches 128 over 3 processes
    msg = refused(
        tmp_path, "--pairs_per_step", "128", "--per_device_train_batch_size", "4", "--max_tokens_per_microbatch", "None"
    )
    assert msg.endswith(
        ": pass --pairs_per_step 132 (a multiple of 12), run on a number of processes that divides 128, or "
        "--max_tokens_per_microbatch N (micro-batches cut by tokens, for any pairs_per_step)"
    ), msg


def test_token_budget_needs_room_for_the_longest_pair(tmp_path):
    msg = refused(tmp_path, "--max_length", "1024", "--max_tokens_per_microbatch", "1500")
    assert "must hold the longest possible pair, 2 x max_length (2048)" in msg
    # The line names both ways out (it said neither).
    assert msg.endswith("pass --max_tokens_per_microbatch 2048 (or more), or --max_length 750 (or less)"), msg
    # A budget of no tokens named `--max_length 0 (or less)` as a way out, a length refused as below 1
    for budget in ("0", "-1", "1"):
        msg = refused(tmp_path, "--max_length", "1024", "--max_tokens_per_microbatch", budget)
        assert msg.endswith(
            f"microbatch={budget} must hold the longest possible pair, 2 x max_length (2048); a pair is "
            "never split: pass --max_tokens_per_microbatch 2048 (or more)"
        ), msg


@pytest.mark.slow
def test_push_without_a_token_from_the_command_line(tmp_path):
    # No HF_TOKEN and an empty HF_HOME (no cached login): the CLI prints one line and exits non-zero.
    result = run_train(
        [*BASE, "--output_dir", str(tmp_path / "run"), "--push_to_hub", "--hub_model_id", "me/x"],
        env={"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode != 0
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("error: push_to_hub is set but no Hugging Face token was found: add HF_TOKEN=")
    assert "Traceback" not in result.stdout


def test_overwrite_replaces_a_finished_run_but_never_discards_resumable_progress(tmp_path):
    from dpotrain import resolve
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    recipe = parse_args([*BASE, "--output_dir", str(out), "--overwrite_output_dir"])
    sealed_checkpoint(out / "checkpoint-4")
    (out / "resolved_config.json").write_text(json.dumps({"derived": {}}))  # a record with no setting to compare
    assert resolve.check_output_dir(recipe) == resolve.OutputDecision(str(out / "checkpoint-4"), False)  # a requeue
    (out / "run_complete.json").write_text("{}")
    assert resolve.check_output_dir(recipe) == resolve.OutputDecision(None, True)


def test_a_run_called_in_process_gives_the_callers_signal_handlers_back(tmp_path, monkeypatch, capsys):
    """A script or notebook that calls `train_dpo.main` goes on after it: its Ctrl-C handler must be its own again,
    not ignored (an ignored signal stays ignored in every process it starts after: a `| tee` Ctrl-C cannot end)."""
    monkeypatch.chdir(ROOT)

    def callers(signum, frame):
        pass

    for sig in STOP_SIGNALS:  # conftest's own_signals gives the session's handlers back after the test
        signal.signal(sig, callers)
    train_dpo.main(["--config", "configs/smoke.yaml", "--output_dir", str(tmp_path / "run"), "--dry-run"])
    assert "steps" in capsys.readouterr().out
    refused(tmp_path, "--learning_rate", "-1")  # a refused run too
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == dict.fromkeys(STOP_SIGNALS, callers)


def test_a_run_called_in_process_leaves_the_callers_environment_as_it_was(tmp_path, monkeypatch, capsys):
    """A run sets variables for itself (its recipe's `env:` block, W&B's run id and folder): a notebook's second call
    started with the first run's, and a second run reporting to W&B logged into the first one's W&B run."""
    monkeypatch.chdir(ROOT)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((ROOT / "configs" / "smoke.yaml").read_text() + "\nenv:\n  DPOTRAIN_TEST_RUNS_OWN: set\n")
    before = dict(os.environ)
    train_dpo.main(["--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--dry-run"])
    assert "steps" in capsys.readouterr().out
    assert dict(os.environ) == before

"""Round six of the fault hunt (docs/reliability.md): faults at the seams the earlier rounds left, each tried for real
first. Kills land at exact points (tests/helpers/pause_at.py), never after a wait."""

import os
import signal
import subprocess

import pytest

from conftest import PAUSE_AT, ROOT, pause_env, python, run_train, signal_paused
from dpotrain.hub.hub_push import read_pushes
from hub_server import StandInHub

SMOKE = str(ROOT / "configs" / "smoke.yaml")
SECRET = "hf_SECRETsecret123"
REPO = "me/dpo-test"


@pytest.fixture
def hub():
    server = StandInHub()
    yield server
    server.close()


def hub_env(hub, tmp_path) -> dict:
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": "",  # the token comes from --hub_token only
        "HF_HOME": str(tmp_path / "hf_home"),
        "WANDB_MODE": "offline",
        "DPOTRAIN_HUB_RETRY_WAITS": "0",
    }


@pytest.mark.slow
def test_a_run_killed_between_its_completion_mark_and_its_push_pushes_when_run_again(hub, tmp_path, tiny_model_dir):
    """run_complete.json is written before the final push starts: a job killed between the two (Slurm's SIGKILL after
    a time limit's SIGTERM, a node lost) left a finished run whose push was never recorded as started, and the same
    command again refused it as "already holds a finished run" without a word of the push it asked for (a requeue of
    the same Slurm job: "nothing to do", exit 0, and never pushed). The push is recorded as due before the run is
    marked complete: the rerun completes it and trains nothing."""
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "2"]
    args += ["--save_strategy", "no", "--report_to", "none", "--push_to_hub", "true", "--hub_model_id", REPO]
    args += ["--hub_token", SECRET]
    paused = tmp_path / "paused"
    env = {**os.environ, **hub_env(hub, tmp_path), **pause_env("*/run_complete.json", "*", paused)}
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    signal_paused(paused, proc, signal.SIGKILL)  # right after run_complete.json is in place
    assert (out / "run_complete.json").is_file() and hub.state.commits == []

    rerun = run_train(args, env=hub_env(hub, tmp_path), timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"Pushed to {hub.endpoint}/{REPO}" in rerun.stdout and "Data (train)" not in rerun.stdout, rerun.stdout
    [commit] = hub.state.commits
    assert commit["revision"] == "main" and {"model.safetensors", "run_complete.json"} <= set(commit["files"])
    assert read_pushes(out)[-1]["status"] == "pushed"

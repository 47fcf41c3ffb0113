"""Round six of the fault hunt (docs/reliability.md): faults at the seams the earlier rounds left, each tried for real
first. Kills land at exact points (tests/helpers/pause_at.py), never after a wait."""

import os
import signal
import subprocess

import pytest

from conftest import PAUSE_AT, ROOT, in_child, pause_env, python, run_train, signal_paused
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


def test_ctrl_c_reaching_the_workers_of_a_datasets_map_is_the_runs_alone_to_answer():
    """datasets' `map(num_proc=N)` (the lengths of a large data set, TRL's tokenization under dataset_num_proc) forks
    its workers from the run's process, and they kept its stop's signal handler: a terminal's Ctrl-C, which reaches
    the whole foreground group, printed `Ctrl-C: stopping before training, ...` once more from each worker (three
    lines for one Ctrl-C on 2 CPUs, seen under `python train_dpo.py ... --max_length auto` on 4,608 pairs), and a
    second one ended each worker in the stop's `os._exit`, releasing the run's lock from there. The workers leave the
    signal to the process that made the stop. By construction: each worker signals itself from inside the map."""
    import datasets

    from dpotrain.train.preemption import GracefulStop

    def interrupted(batch):  # in the pool's worker: the Ctrl-C a terminal sends its whole foreground group
        os.kill(os.getpid(), signal.SIGINT)
        return batch

    def run():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job
        stop = GracefulStop()
        try:
            rows = datasets.Dataset.from_dict({"x": list(range(8))})
            done = rows.map(interrupted, batched=True, batch_size=4, num_proc=2, keep_in_memory=True)
            print(len(done), stop.interrupted)
        finally:
            stop.release(exiting=False)

    code, out, err = in_child(run)
    assert code == 0 and out.split() == ["8", "None"], out + err
    assert "Ctrl-C" not in err, err

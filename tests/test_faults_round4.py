"""Faults hunted in round four (nothing lost, nothing silent), on the tiny model: each held by construction (a run
stopped at one exact point by tests/helpers/pause_at.py, then killed), never by timing. What the hunt tried that
already held is in the commits' messages, not repeated here as tests."""

import json
import os
import signal
import subprocess

import pytest

from conftest import PAUSE_AT, ROOT, pause_env, paused_pid, python
from dpotrain.train import run_files
from dpotrain.train.checkpoints import is_complete, own_checkpoints

STEPS = 4


def command(out, model_dir, data, *extra) -> list[str]:
    """The smoke recipe on `data`: 4 steps, checkpoints at steps 2 and 4, save_total_limit 1."""
    return [
        *("--config", str(ROOT / "configs" / "smoke.yaml"), "--max_steps", str(STEPS), "--save_steps", "2"),
        *("--save_total_limit", "1", "--logging_steps", "1", "--report_to", "none"),
        *("--output_dir", str(out), "--model_name_or_path", model_dir, "--dataset_name", str(data), *extra),
    ]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The smoke data's first 48 pairs: an epoch of 6 steps, of which the run trains 4."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:48]))
    return path


def killed_at(out, model_dir, data, after: str, at: str, paused) -> None:
    """The run SIGKILLed (a lost node, Slurm's kill after its grace time) at the point `after`/`at` (pause_at.py)."""
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *command(out, model_dir, data)],
        cwd=ROOT,
        env={**os.environ, **pause_env(after, at, paused)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        os.kill(paused_pid(paused, proc), signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()


def rerun(out, model_dir, data) -> str:
    result = subprocess.run(
        [python(), str(ROOT / "train_dpo.py"), *command(out, model_dir, data)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


@pytest.mark.slow
def test_a_kill_right_after_a_checkpoints_mark_is_settled_by_the_rerun_that_resumes_from_it(
    tmp_path, tiny_model_dir, pairs
):
    """SIGKILL right after checkpoint-4's COMPLETE mark, before the main process listed it complete in run_files.json
    and rotated (save_total_limit 1): the rerun resumed from checkpoint-4, the last step, so saved nothing and rotated
    nothing. The finished run kept checkpoint-2 beyond its limit for good (a whole checkpoint's space, in silence),
    and its record never listed checkpoint-4 as complete, so a checkpoint-4 moved or deleted later was not named gone
    (`checkpoints.gone`). The resume now settles what the killed save left: the checkpoint it resumes from listed
    complete, and the rotation done."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    killed_at(out, tiny_model_dir, pairs, "*/checkpoint-4/COMPLETE", f"*/{run_files.MANIFEST}", paused)
    assert is_complete(out / "checkpoint-4") and (out / "checkpoint-2").is_dir()
    assert run_files.completed(out) == ["checkpoint-2"]  # the state the kill left: checkpoint-4 not yet listed

    log = rerun(out, tiny_model_dir, pairs)
    assert f"Resuming from {out / 'checkpoint-4'}" in log
    assert [p.name for p in own_checkpoints(out)] == ["checkpoint-4"], log[-3000:]
    assert not (out / "checkpoint-2").exists()
    assert run_files.completed(out) == ["checkpoint-4"]
    assert "checkpoint-2" not in run_files.read(out)
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == STEPS

"""One W&B run per output folder: a requeued or resumed job logs to the run it started."""

import os

from conftest import ROOT
from dpotrain.config import parse_args
from dpotrain.tracking import RUN_ID_FILE, setup_wandb


def test_resumed_job_reuses_the_wandb_run_id(tmp_path, monkeypatch):
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_NAME"):
        # setenv first so that monkeypatch restores the variable's absence afterwards: setup_wandb sets these in
        # os.environ, and a leaked WANDB_DIR would send later tests' W&B runs elsewhere.
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(tmp_path)]
    setup_wandb(parse_args(args).training)
    first = os.environ["WANDB_RUN_ID"]
    assert (tmp_path / RUN_ID_FILE).read_text() == first
    assert os.environ["WANDB_RESUME"] == "allow" and os.environ["WANDB_DIR"] == str(tmp_path)

    monkeypatch.delenv("WANDB_RUN_ID")  # the requeued job is a new process
    setup_wandb(parse_args(args).training)
    assert os.environ["WANDB_RUN_ID"] == first

    monkeypatch.delenv("WANDB_RUN_ID")
    other = tmp_path / "other"
    setup_wandb(parse_args([*args, "--output_dir", str(other)]).training)
    assert os.environ["WANDB_RUN_ID"] != first

"""What a run records says what ran: its last step, its own name, and the numbers it resolved (issue #35 item 7)."""

import json

import pytest
from test_honest_runs import first_pairs

from conftest import ROOT, run_train
from dpotrain.train.metrics import read_metrics

SMOKE = str(ROOT / "configs" / "smoke.yaml")


@pytest.mark.slow
def test_the_last_step_the_run_name_and_resolved_numbers_are_recorded(tmp_path, tiny_model_dir):
    """5 steps logged every 2: metrics.jsonl, run_complete.json and the card end at step 5, not 4; the card and
    plot are titled with the folder the user named, and the card shows warm-up in steps and the batches as cut."""
    out = tmp_path / "my-first-try"
    result = run_train(
        [
            "--config",
            SMOKE,
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--dataset_name",
            first_pairs(tmp_path, 5),
            "--max_steps",
            "5",
            "--logging_steps",
            "2",
            "--save_strategy",
            "no",
        ],
        env={"DPOTRAIN_BUILTIN_DIR": str(tiny_model_dir.rsplit("/", 1)[0])},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 4, 5]  # step 1: the health guard's
    assert json.loads((out / "run_complete.json").read_text())["final"]["step"] == 5
    card = (out / "README.md").read_text()
    assert "\n# my-first-try\n" in card and "## Final metrics (step 5)" in card
    assert "| `warmup_steps` | 1 (0.1 of the steps) |" in card  # 10% of 5 steps, rounded up
    assert "| `per_device_train_batch_size` | None |" not in card and "pairs per micro-batch" in card
    assert "| `gradient_accumulation_steps` | None |" not in card and "micro-batches per step" in card
    assert json.loads((out / "resolved_config.json").read_text())["run_name"] == "my-first-try"
    # The memory the run used, measured at every log and after the first step (a CPU run: host RSS, nothing planned)
    rss = [r["memory/peak_rss_gib"] for r in read_metrics(out) if "loss" in r]
    assert len(rss) == 4 and 0.05 < rss[0] <= rss[-1] < 64, rss  # a peak only grows; a real process's size
    assert "Memory after step 1: peak host RSS" in result.stdout and "Memory, the run's peak: " in result.stdout


def test_run_complete_holds_the_last_training_record_and_the_last_evaluation_apart():
    """An evaluation at the last step is logged after that step's training record: run_complete.json's `final` was the
    evaluation's (eval_loss, no loss), while the model card's final metrics were the training record's."""
    from dpotrain.publish import completion

    train = [{"step": s, "epoch": s / 5, "loss": 0.7 - s / 100} for s in (2, 4)]
    evals = [{"step": s, "epoch": s / 5, "eval_loss": 0.68 - s / 100} for s in (2, 4)]
    records = [train[0], evals[0], train[1], evals[1]]
    assert completion(4, records) == {"global_step": 4, "final": train[1], "final_eval": evals[1]}
    assert completion(4, train) == {"global_step": 4, "final": train[1]}  # not evaluated: as before
    assert completion(0, []) == {"global_step": 0, "final": None}

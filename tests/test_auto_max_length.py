"""`max_length: auto`: training runs the analyzer on its split (or reuses its cache) and records the choice."""

import json

import pytest

import train_dpo
from conftest import ROOT

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--max_length", "auto", "--report_to", "none"]


def dry_run(capsys, *args) -> dict:
    train_dpo.main([*SMOKE, *args, "--dry-run", "--json"])
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") :])


@pytest.mark.slow
def test_auto_max_length_is_chosen_recorded_and_then_shown_by_a_dry_run(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    model = ["--model_name_or_path", tiny_model_dir]

    # A Hub data set the analyzer has not cached: the dry run says how to decide it now.
    hub = dry_run(capsys, *model, "--dataset_name", "allenai/Dolci-Think-DPO-7B")
    assert hub["max_length"] == "auto"
    assert hub["derived"]["max_length"]["cached"] is False
    assert "scripts/analyze_dataset.py" in hub["derived"]["max_length"]["resolved"]

    out = tmp_path / "run"
    train_dpo.main([*SMOKE, *model, "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no"])
    resolved = json.loads((out / "resolved_config.json").read_text())
    choice = resolved["derived"]["max_length"]
    # The bundled pairs are at most ~550 tokens: 512 is the smallest multiple of 512 covering 95% of them (2 cut).
    assert resolved["max_length"] == choice["max_length"] == 512
    assert choice["coverage"] >= 0.95 and choice["target_coverage"] == 0.95 and choice["rows"] == 384
    assert choice["truncated"] == 2 and choice["doubled"]["max_length"] == 1024 and choice["doubled"]["coverage"] == 1
    assert "smallest multiple of 512 that leaves at least 95.0% of pairs whole" in choice["reason"]
    assert not choice["cached"]

    after = dry_run(capsys, *model)
    assert after["max_length"] == 512 and after["derived"]["max_length"]["cached"] is True
    assert after["derived"]["max_length"]["coverage"] == choice["coverage"]

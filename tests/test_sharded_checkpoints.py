"""Long jobs on many ranks: every process group has the recipe's collective timeout (`ddp_timeout`, read back from
torch in the launched processes), FSDP2 checkpoints are sharded (each rank writes its own part) and resume exactly, and
the final model is one plain HF safetensors folder. Real `accelerate launch`es of 2 CPU processes (gloo)."""

import json
import os
import re
import shutil
import subprocess
import sys

import datasets
import pytest
from safetensors.torch import load_file

from conftest import ROOT
from dpotrain import builtin, engine
from dpotrain.errors import ConfigError

TIMEOUT_S = 1234  # not a default of torch (600, 1800), DeepSpeed (600) or transformers (1800)
RUN = ["--max_steps", "4", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none",
       "--ddp_timeout", str(TIMEOUT_S)]  # fmt: skip


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs"
    datasets.Dataset.from_list(builtin.make_preference_rows(48, seed=13)).save_to_disk(path)
    return path


def launch(config: str, out, model_dir, data, *args) -> str:
    """train_dpo.py under `accelerate launch --config_file <config> --num_processes 2`, reporting each rank's process
    groups as it exits (tests/helpers/report_groups.py); its output."""
    bin_dir = os.path.dirname(sys.executable)
    cmd = [os.path.join(bin_dir, "accelerate"), "launch", "--config_file", str(ROOT / config), "--num_processes", "2",
           str(ROOT / "tests" / "helpers" / "report_groups.py"), str(ROOT / "train_dpo.py"),
           "--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", model_dir,
           "--dataset_name", str(data), "--output_dir", str(out), *RUN, *args]  # fmt: skip
    env = {**os.environ, "DPOTRAIN_CACHE": f"{out}-cache", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def assert_every_group_has_the_recipes_timeout(log: str) -> None:
    assert f"Collective timeout: {TIMEOUT_S} s (ddp_timeout) for every process group" in log
    reports = dict(re.findall(r"process groups of rank (\d): (\{.*\})", log))
    assert sorted(reports) == ["0", "1"], log[-3000:]
    for rank, groups in reports.items():
        timeouts = eval(groups)  # {'0': 1234.0, ...}: a dict literal printed by the helper
        assert timeouts and set(timeouts.values()) == {float(TIMEOUT_S)}, (rank, timeouts)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["accelerate_config.yaml", "configs/accelerate/zero3.yaml"])
def test_every_deepspeed_process_group_has_ddp_timeout(config, tmp_path, tiny_model_dir, pairs):
    """ZeRO-2 and ZeRO-3 (DeepSpeed makes a group of its own in `deepspeed.initialize`, after start-up)."""
    log = launch(config, tmp_path / "run", tiny_model_dir, pairs, "--max_steps", "2", "--save_strategy", "no")
    assert_every_group_has_the_recipes_timeout(log)
    assert log.count("Data (train): 48 rows") == 1  # said by one process of the launch, not by each


@pytest.mark.slow
def test_fsdp2_checkpoints_are_sharded_resume_exactly_and_the_model_is_one_hf_folder(tmp_path, tiny_model_dir, pairs):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    log = launch("configs/accelerate/fsdp2.yaml", out, tiny_model_dir, pairs)
    assert_every_group_has_the_recipes_timeout(log)

    # Each rank wrote its own shard of the weights and of the optimizer (torch.distributed.checkpoint); no full copy.
    checkpoint = out / "checkpoint-2"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], part
    assert not list(checkpoint.glob("*.safetensors")) and not list(checkpoint.glob("*.bin"))
    assert (checkpoint / "COMPLETE").exists()

    # The final model: one HF folder, loadable as any model.
    model = AutoModelForCausalLM.from_pretrained(out)
    final = load_file(str(out / "model.safetensors"))
    assert set(final) == set(model.state_dict()) - {"lm_head.weight"} or set(final) == set(model.state_dict())

    # Resumed from the sharded checkpoint of step 2: the same final weights as the uninterrupted run.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.copytree(f"{out}-cache", f"{resumed}-cache")
    shutil.rmtree(resumed / "checkpoint-4")
    (resumed / "run_complete.json").unlink()
    log = launch("configs/accelerate/fsdp2.yaml", resumed, tiny_model_dir, pairs)
    assert f"Resuming from {resumed}/checkpoint-2" in log
    again = load_file(str(resumed / "model.safetensors"))
    assert set(again) == set(final)
    assert all(again[k].equal(final[k]) for k in final)


@pytest.mark.parametrize("value", ["FULL_STATE_DICT", "LOCAL_STATE_DICT"])
def test_an_fsdp2_launch_whose_rank_0_writes_whole_checkpoints_is_refused(value, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", value)
    with pytest.raises(ConfigError, match=f"fsdp_state_dict_type {value} is not supported: set fsdp_state_dict_type"):
        engine.launched()
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    assert engine.launched().name == "fsdp2"


@pytest.mark.slow
@pytest.mark.parametrize("config", ["accelerate_config.yaml", "configs/accelerate/zero3.yaml",
                                    "configs/accelerate/fsdp2.yaml"])  # fmt: skip
def test_gradients_held_between_micro_batches_are_what_the_plan_counts(config):
    """benchmarks/between_micro_batches.py under each engine: after a step's first micro-batch, the gradients a
    process holds are at most what the plan counts among its model states (ZeRO-2's partition may hold a parameter
    that straddles its boundary whole: 5%); FSDP2 holds no unsharded gradient between micro-batches."""
    bin_dir = os.path.dirname(sys.executable)
    cmd = [os.path.join(bin_dir, "accelerate"), "launch", "--config_file", str(ROOT / config), "--num_processes", "2",
           str(ROOT / "benchmarks" / "between_micro_batches.py"), "--layers", "2", "--hidden", "256"]  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    record = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    held = record["held_gradient_bytes"]
    assert record["deferred"] is False and record["world"] == 2
    assert 0 < sum(held.values()) <= 1.05 * record["planned_gradient_bytes"], record
    if "unsharded" in held:
        assert held["unsharded"] == 0, record

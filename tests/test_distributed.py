"""accelerate_config.yaml and ds_config.json: valid for their own tools, and ZeRO-2 really trains through a launch,
every process group it makes with the recipe's collective timeout (`ddp_timeout`, read back from torch in the
launched processes)."""

import json
import math
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import (
    GROUP_TIMEOUT_S,
    REPORT_GROUPS,
    ROOT,
    accelerate_launch,
    assert_every_group_has_the_recipes_timeout,
    rank_python,
)
from dpotrain.recipe.config import parse_args


def filled_ds_config(*overrides):
    """ds_config.json after transformers fills its "auto" values from the trainer's arguments."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", "/tmp/unused", *overrides])
    hf_config = HfTrainerDeepSpeedConfig(json.loads((ROOT / "ds_config.json").read_text()))
    hf_config.trainer_config_process(recipe.training)
    return hf_config.config


def test_ds_config_passes_deepspeeds_own_validation():
    from deepspeed.runtime.config import DeepSpeedConfig

    config = filled_ds_config("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "8")
    assert "auto" not in json.dumps(config)
    validated = DeepSpeedConfig(config)
    assert validated.zero_optimization_stage == 2
    assert validated.train_micro_batch_size_per_gpu == 4 and validated.gradient_accumulation_steps == 8
    assert validated.train_batch_size == 32  # one process here; 128 on the 4 GPUs of accelerate_config.yaml


def test_deepspeed_validation_can_fail():
    from deepspeed.runtime.config import DeepSpeedConfig

    config = filled_ds_config()
    config["train_batch_size"] += 1  # what a hand-edited batch size that disagrees with the trainer looks like
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        DeepSpeedConfig(config)


def test_accelerate_config_loads_and_points_at_ds_config():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "accelerate_config.yaml"))
    assert str(config.distributed_type) == "DistributedType.DEEPSPEED"
    assert config.num_processes == 4 and config.num_machines == 1
    ds_file = config.deepspeed_config["deepspeed_config_file"]
    assert (ROOT / ds_file).is_file() and ds_file == "ds_config.json"


@pytest.mark.slow
def test_zero2_trains_on_cpu_through_accelerate_launch(tmp_path, tiny_model_dir):
    out = tmp_path / "zero2"
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        *rank_python(),
        REPORT_GROUPS,
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--ddp_timeout",
        str(GROUP_TIMEOUT_S),
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:]
    # DeepSpeed makes a group of its own in `deepspeed.initialize`, after start-up: it too holds the recipe's timeout.
    assert_every_group_has_the_recipes_timeout(result.stdout)
    assert result.stdout.count("Data (train): 384 rows") == 1  # said by one process of the launch, not by each
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert abs(records[0]["loss"] - math.log(2)) < 1e-5
    assert records[-1]["loss"] < records[0]["loss"]
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["derived"]["world_size"] == 2  # two real processes (accelerate on CPU alone would run each apart)
    # 384 pairs / 8 per step (the recipe's pairs_per_step, on any number of processes) = 48 steps per epoch.
    assert math.isclose(records[0]["epoch"], 1 / 48)
    batching = resolved["derived"]["batching"]  # cut by tokens: micro-batches of unequal size, ranks in step
    assert batching["forward"] == "packed, prompts shared (384 of 384 pairs)" and batching["pairs_per_step"] == 8
    assert batching["positions_per_micro_batch"]["min"] < batching["positions_per_micro_batch"]["max"]
    assert batching["gradient_reductions_per_epoch"] == batching["micro_batches_per_epoch"]  # ZeRO: every backward
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_bf16_zero2_run_records_the_dtype_its_weights_load_in_and_starts_at_its_reference(tmp_path, tiny_model_dir):
    """DeepSpeed trains bf16 weights: resolved_config.json says bfloat16 (as the dry run does), not TRL's float32
    default, and the saved weights are bf16. On a CPU, bf16 needs `--use_cpu true`. The 2 steps' 16 pairs only: the
    reference stage scores every pair it is given, and bf16 on a CPU is slow (the smoke data's 384 took 9 s).

    At step 1 the policy is the reference: its rewards are 0 here (0.0 measured; a reference micro-batch laid out
    unlike the step's moves bf16 sums by ~3e-4). They were -0.024 (rejected, past the step-1 guard's 0.02) while
    transformers cast the cached float32 reference sums to bf16 on their way into the step, rounding -3,111.24 to
    -3,104 (`RecipeDPOTrainer._prepare_inputs`)."""
    out = tmp_path / "bf16"
    data = tmp_path / "pairs16.jsonl"
    data.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:16]))
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        *rank_python(),
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--warmup_steps",
        "0",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--bf16",
        "true",
        "--use_cpu",
        "true",
        "--logging_steps",
        "1",
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:]
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["dtype"] == resolved["model_init_kwargs"]["dtype"] == "bfloat16"
    assert {str(t.dtype) for t in load_file(str(out / "model.safetensors")).values()} == {"torch.bfloat16"}
    step1 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step1["step"] == 1
    assert abs(step1["rewards_norm/chosen"]) < 1e-3 and abs(step1["rewards_norm/rejected"]) < 1e-3, step1

"""Sequence parallelism (`--sequence_parallel_size N`, dpotrain/forwards/sequence_parallel.py): 2 processes splitting
every packed row in halves train the trajectory of 1 process (loss 1e-4 relative per step, weights 1e-5, fp32), through
DeepSpeed Ulysses' all-to-all on gloo: multi-turn pairs with shared prompts and a cached reference on ZeRO-2; the same
pairs unshared, with a live reference model and evaluation, on ZeRO-3. Each 2-process launch costs ~60 s on 2 cores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, python, rank_python
from dpotrain.forwards import sequence_parallel

STEPS = ["--max_steps", "4", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]


def train(out, model_dir, *args, processes=1, config="accelerate_config.yaml"):
    launcher = [python()]
    if processes > 1:
        launcher = [str(ROOT / ".venv" / "bin" / "accelerate"), "launch", "--config_file", str(ROOT / config),
                    "--num_processes", str(processes), *rank_python()]  # fmt: skip
    env = {**os.environ, "DPOTRAIN_CACHE": f"{out}-cache", "PATH": f"{os.path.dirname(sys.executable)}:"
           f"{os.environ['PATH']}"}  # fmt: skip
    cmd = [*launcher, str(ROOT / "train_dpo.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
           "--model_name_or_path", model_dir, "--output_dir", str(out), *STEPS, *args]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def records(out) -> dict:
    """{(step, "train" | "eval"): record} of metrics.jsonl."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {(r["step"], "eval" if "eval_loss" in r else "train"): r for r in map(json.loads, lines)}


def assert_same_trajectory(one, split, log: str, model_dir) -> None:
    assert "Sequence parallel: 1 group(s) of 2 processes, each process 1/2 of every packed row" in log
    want, got = records(one), records(split)
    assert list(got) == list(want)
    for key, record in want.items():
        for metric in ("loss", "eval_loss", "grad_norm", "logps/chosen", "rewards/margins", "num_tokens"):
            if metric in record:
                assert abs(got[key][metric] - record[metric]) <= 1e-4 * max(1, abs(record[metric])), (key, metric)
    # The group read one micro-batch at a time: the plan is the one of a single data-parallel rank
    batching = [json.loads((d / "resolved_config.json").read_text())["derived"]["batching"] for d in (one, split)]
    assert batching[1]["micro_batches_per_step"] == batching[0]["micro_batches_per_step"]
    wa, wb = load_file(str(one / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    assert all(float((wb[k] - start[k]).abs().max()) > 0 for k in wb)  # every tensor trained, not left as it was


@pytest.mark.slow
def test_two_processes_splitting_rows_train_what_one_process_trains_zero2_shared_prompts(tmp_path, tiny_model_dir):
    train(tmp_path / "one", tiny_model_dir)
    log = train(tmp_path / "split", tiny_model_dir, "--sequence_parallel_size", "2", processes=2)
    assert "prompts shared" in log
    assert_same_trajectory(tmp_path / "one", tmp_path / "split", log, tiny_model_dir)


@pytest.mark.slow
def test_two_processes_splitting_rows_train_what_one_process_trains_zero3_live_reference(tmp_path, tiny_model_dir,
                                                                                        splits):  # fmt: skip
    args = ["--dataset_name", str(splits), "--share_prompt", "false", "--precompute_ref_log_probs", "false",
            "--eval_strategy", "steps", "--eval_steps", "2"]  # fmt: skip
    train(tmp_path / "one", tiny_model_dir, *args)
    log = train(tmp_path / "split", tiny_model_dir, *args, "--sequence_parallel_size", "2", processes=2,
                config="configs/accelerate/zero3.yaml")  # fmt: skip
    assert (2, "eval") in records(tmp_path / "split")
    assert_same_trajectory(tmp_path / "one", tmp_path / "split", log, tiny_model_dir)


@pytest.mark.parametrize(
    "engine, attention, padding_free, refusal",
    [
        ("fsdp2", None, None, "runs under DeepSpeed ZeRO-2 or ZeRO-3"),
        ("ddp", None, None, "runs under DeepSpeed ZeRO-2 or ZeRO-3"),
        ("zero2", "flex_attention", None, "runs with --attn_implementation sdpa"),
        ("zero3", "flash_attention_2", None, "runs with --attn_implementation sdpa"),
        ("zero2", None, False, "drop --padding_free false"),
    ],
)  # fmt: skip
def test_what_sequence_parallelism_does_not_run_on_is_refused(engine, attention, padding_free, refusal):
    assert refusal in sequence_parallel.problem(2, engine, attention, padding_free)
    assert sequence_parallel.problem(1, engine, attention, padding_free) is None  # off: nothing to refuse
    assert sequence_parallel.problem(2, "zero2", None, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2 or more CUDA GPUs (sequence_parallel_size 2 splits a row over two)")  # fmt: skip
def test_on_two_gpus_splitting_rows_in_bf16_trains_what_one_gpu_trains(tmp_path, tiny_model_dir):
    """bf16 on GPUs, sdpa (the attention sequence parallelism runs on): the all-to-all and the gathers over NCCL. bf16
    sums in another order round differently: the losses agree to 1e-2 relative, not to fp32's 1e-4."""
    bf16 = ["--bf16", "true"]
    train(tmp_path / "one", tiny_model_dir, *bf16)
    log = train(tmp_path / "split", tiny_model_dir, *bf16, "--sequence_parallel_size", "2", processes=2)
    assert "Sequence parallel: 1 group(s) of 2 processes" in log
    want, got = records(tmp_path / "one"), records(tmp_path / "split")
    assert list(got) == list(want)
    for key, record in want.items():
        assert abs(got[key]["loss"] - record["loss"]) <= 1e-2 * max(1, abs(record["loss"])), key

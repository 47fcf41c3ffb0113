"""The GPU forwards (dpotrain/forwards/), on a GPU: shared prompts on FlexAttention, packed rows on varlen
FlashAttention, and packed and shared rows on sdpa score and differentiate as each sequence run alone (bf16), the
memory plan holds its largest micro-batch, and each shipped recipe's settings run on FlexAttention with few
compilations. Skipped, with the reason, without a GPU (or without flash_attn for the varlen test, without DeepSpeed for
the shipped recipes). All of them: `pytest -m gpu tests/test_gpu_attention.py`."""

import importlib.util
import re
import subprocess

import pytest
import torch
from test_shared_prompt import random_pairs

from conftest import ROOT, python, run_bounded
from dpotrain.forwards import choice, flex, masks, packing
from dpotrain.forwards.shared_prompt import SharedPromptCollator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]
LOG_PROB_TOLERANCE = 5e-2  # bf16: per-token log-probs of the same sequence in different kernels
GRAD_TOLERANCE = 5e-2  # relative, over all parameters


SHAPE = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=128,
    max_position_embeddings=4096,
)


def olmo3(attn: str):
    from transformers import Olmo3Config

    return on_gpu_in_bf16(Olmo3Config(**SHAPE), attn)


def gpt_oss(attn: str):
    """gpt-oss's shape at this size: a learnable sink per head (drawn away from 0), sliding and full layers, experts."""
    from transformers import GptOssConfig

    kinds = ["sliding_attention", "full_attention"] * 2
    config = GptOssConfig(**SHAPE, head_dim=64, num_local_experts=4, num_experts_per_tok=2, layer_types=kinds)
    model = on_gpu_in_bf16(config, attn)
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, mean=1.0, std=2.0)
    return model


def on_gpu_in_bf16(config, attn: str):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    flex.install()  # flex_attention through the project's compiled function, as a run does
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn).cuda()
    add_fused_lm_head(model, outputs=("log_probs",))
    return model


def on_gpu(batch: dict) -> dict:
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def alone(model, pairs) -> tuple[torch.Tensor, list]:
    """Summed completion log-probs of every sequence run alone (sdpa, no packing), and the gradient of their sum."""
    total, sums = 0.0, []
    for side in (0, 1):
        for pair in pairs:
            ids, mask = packing.sequences(pair, None, "keep_start")[side]
            batch = on_gpu(
                {
                    "input_ids": torch.tensor([ids]),
                    "position_ids": torch.arange(len(ids))[None],
                    "completion_mask": torch.tensor([mask]),
                }
            )
            s = packing.forward(model, batch).log_probs.float().sum()
            sums.append(s)
            total = total + s
    total.backward()
    return torch.stack(sums).detach(), [p.grad.float().clone() for p in model.parameters()]


def packed_sums(model, batch) -> tuple[torch.Tensor, list]:
    log_probs = packing.unpack_outputs(packing.forward(model, batch), batch).log_probs.float()
    sums = log_probs.sum(dim=1)
    sums.sum().backward()
    return sums.detach(), [p.grad.float().clone() for p in model.parameters()]


def check_against_alone(attn: str, collate, build=olmo3, alone_on: str = "sdpa") -> None:
    pairs = random_pairs(prompts=(150, 30, 1, 400), completions=((40, 90), (200, 20), (7, 9), (5, 3)))
    model = build(attn)
    got, got_grads = packed_sums(model, on_gpu(collate(pairs)))
    model.zero_grad(set_to_none=True)
    model.config._attn_implementation = alone_on
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = alone_on
    want, want_grads = alone(model, pairs)
    assert ((got - want).abs() / want.abs().clamp(min=1)).max() < LOG_PROB_TOLERANCE
    num = sum(float((a - b).norm() ** 2) for a, b in zip(got_grads, want_grads, strict=True)) ** 0.5
    den = sum(float(b.norm() ** 2) for b in want_grads) ** 0.5
    assert num / den < GRAD_TOLERANCE


def test_shared_prompts_on_flex_equal_each_sequence_alone():
    torch._dynamo.reset()  # this test's compilations only
    check_against_alone("flex_attention", SharedPromptCollator(1024, one_row=True, pad_to_multiple_of=masks.BLOCK))
    assert flex.compilations() == 1  # one forward and backward with gradients, through the project's compiled flex


def test_gpt_oss_packed_rows_on_flex_equal_each_sequence_alone_with_their_sinks():
    """gpt-oss's sinks through the project's compiled flex (`flex.with_sinks`: the output renormalized by its
    log-sum-exp), the sinks' gradients included, against each sequence alone on eager; one compilation."""
    torch._dynamo.reset()
    collate = packing.PackedPreferenceCollator(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)
    check_against_alone("flex_attention", collate, build=gpt_oss, alone_on="eager")
    assert flex.compilations() == 1


@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_packed_and_shared_rows_on_sdpa_equal_each_sequence_alone(layout):
    """sdpa's own packed path (balanced rows, a per-sequence mask from the restarting positions) and shared prompts on
    sdpa (a 4D mask per row): the forwards a GPU takes without flex or FlashAttention, on CUDA's sdpa kernels."""
    hidden = 256  # olmo3()'s: the collators weigh attention against the linear layers with it
    collate = {
        "packed": packing.PackedPreferenceCollator(1024, hidden_size=hidden),
        "shared": SharedPromptCollator(1024, hidden_size=hidden),
    }[layout]
    check_against_alone("sdpa", collate)


# Each shipped recipe on its engine, one GPU: the recipe's bf16, activation checkpointing, checkpoints and samples, plus
# evaluation and samples at every step (the most flips between training, generation, evaluation and the reference).
RECIPES = {
    "think": "accelerate_config.yaml",
    "instruct": "accelerate_config.yaml",
    "think-32b": "configs/accelerate/zero3.yaml",
}
# Autograd modes (with gradients; without: evaluation, a no-grad reference, reentrant checkpointing's first pass;
# inference mode), each at most twice (a micro-batch of one 128-position tile is a shape of its own for dynamo).
MOST_COMPILATIONS = 6
# Per run: inductor's compilations take minutes on a cold cache; the second and third recipes find the first's compiled
# kernels cached. They need DeepSpeed (the recipes' engines): the `tests-recipes` piece of lease 3, which carries it
# (benchmarks/gpu_lease.sh, docs/gpu-benchmarks.md); what does not fit its share is cut off there, test by test.
LIMIT_S = 240


@pytest.mark.parametrize("recipe", RECIPES)
def test_shipped_recipe_runs_on_flex_compiled_a_few_times(recipe, tmp_path, tiny_model_dir, splits):  # noqa: F811
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed, the recipes' engine (lease 3 carries it: docs/gpu-benchmarks.md)")
    out = tmp_path / "run"
    # as a module: `pip install --target` (benchmarks/gpu_lease.sh) puts no console script on PATH
    cmd = [
        python(),
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / RECIPES[recipe]),
        "--num_processes",
        "1",
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / f"{recipe}.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(splits),
        "--output_dir",
        str(out),
        "--attn_implementation",
        "flex_attention",
        "--pairs_per_step",
        "8",
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--samples_every",
        "1",
        "--sample_count",
        "2",
        "--sample_max_new_tokens",
        "16",
        "--report_to",
        "none",
        "--dataset_num_proc",
        "1",
    ]
    code, stdout, _ = run_bounded(cmd, LIMIT_S, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert code == 0, (stdout or "")[-4000:]
    found = re.search(r"FlexAttention: (\d+) compilations this run", stdout)
    assert found, stdout[-4000:]
    assert 1 <= int(found.group(1)) <= MOST_COMPILATIONS, found.group(0)
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2 * 5  # steps 0 to 4, two prompts each
    assert any("eval_loss" in line for line in (out / "metrics.jsonl").read_text().splitlines())


@pytest.mark.skipif(
    choice.installed_varlen(torch.cuda.is_available()) is None,
    reason="no varlen FlashAttention installed (pip install -r requirements-gpu.txt)",
)
def test_packed_rows_on_varlen_flash_attention_equal_each_sequence_alone():
    attn = choice.installed_varlen(True)
    check_against_alone(attn, packing.PackedPreferenceCollator(1024, one_row=True))


def test_plan_holds_its_largest_micro_batch():
    """The benchmark's own comparison on the plan's widest shared micro-batch: measured peak <= planned."""
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "attention.py"),
            "--device",
            "cuda",
            "--layers",
            "2",
            "--micro-batches",
            "4",
            "--paths",
            "shared_flex",
            "shared_sdpa",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=LIMIT_S,
    ).stdout
    import json

    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    paths = [row for row in rows if "path" in row]  # the first line is the run's settings (layers, checkpointing)
    assert [row["path"] for row in paths] == ["shared_flex", "shared_sdpa"], rows
    for result in paths:
        assert "skipped" in result or result["peak_gib"] <= result["plan_gib"], result

"""The GPU kit (benchmarks/gpu_*.sh, benchmarks/end_to_end.py and what a GPU run of the project takes), on the CPU:
each test forces the setting a GPU would take (a memory plan that refuses, every k-th layer checkpointed, FlashAttention
4 present but not importable, a compiled decoder layer) and checks the kit takes it the first time."""

import argparse
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch

from conftest import ROOT, python

sys.path.insert(0, str(ROOT / "benchmarks"))


def kit_args(**given) -> argparse.Namespace:
    """end_to_end.py's arguments as its GPU default (not --tiny), one process."""
    base = dict(
        tiny=False,
        engine="single",
        gpu_memory_gib=None,
        pairs_per_step=None,
        compile_layers=False,
        peak_tflops=None,
        trl_batch=2,
        steps=2,
    )
    return argparse.Namespace(**{**base, **given})


# --- 1: the layer search ends at the plan's refusal, not with it ---


@pytest.mark.slow
def test_layer_search_stops_where_the_memory_plan_refuses(tmp_path):
    """On a GPU memory_check is on and the GPU's memory known: the first layer count that does not fit raises the
    plan's ConfigError. The search takes that as its answer (here an 80 GiB GPU given on the CPU)."""
    import end_to_end

    layers = end_to_end.layers_that_fit(kit_args(gpu_memory_gib=80), tmp_path / "fit")
    assert 4 <= layers < 32, layers


# --- 7: FlashAttention 4 counts as installed only when its kernels import ---


def test_fa4_present_but_not_importable_is_not_installed(monkeypatch):
    """transformers says FA4 is available as soon as its package is there, even when `import flash_attn.cute` fails
    (a missing CUTLASS DSL package): the run must then not take it."""
    import transformers.utils

    from dpotrain.forwards import choice

    monkeypatch.setattr(transformers.utils, "is_flash_attn_4_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` raises ImportError
    problem = choice.kernel_problem("flash_attention_4", cuda=True)
    assert problem is not None and "flash_attn.cute" in problem, problem


# --- 8: the reference stage sizes its micro-batches from the layers actually checkpointed ---


def wider_model(folder, tiny_model_dir) -> str:
    """The tiny model's tokenizer with a 4-layer, 512-wide OLMo 3 (random): wide enough that activations, not the
    dense masks of the CPU's sdpa, decide how much a forward-only micro-batch may hold."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Olmo3Config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(folder)
    config = Olmo3Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def test_reference_budget_follows_every_k_th_layer_checkpointing(tmp_path, tiny_model_dir):
    """A plan that checkpoints 1 layer in k keeps the others' activations: the forward-only multiple is that of the
    plan's k, not of every layer."""
    from dpotrain.data import data
    from dpotrain.forwards import packing
    from dpotrain.plan import memory
    from dpotrain.recipe.config import parse_args
    from dpotrain.reference.scorer import ReferenceScorer
    from dpotrain.train_stage import trainer_on

    model = wider_model(tmp_path / "model", tiny_model_dir)
    recipe = parse_args(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--model_name_or_path",
            model,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "1",
            "--activation_checkpointing",
            "true",
            "--activation_checkpointing_kwargs",
            '{"every_n_layers": 2}',
        ]
    )
    pairs = data.load_preference_dataset(str(ROOT / "data" / "smoke_prefs.jsonl")).select(range(8))
    trainer = trainer_on(recipe, pairs)
    args = trainer.args
    tokens = trainer.max_tokens_per_microbatch or args.per_device_train_batch_size * 2 * args.max_length
    width = min(tokens, 2 * args.max_length) if trainer.packed else args.max_length
    config = packing.causal_lm(trainer.model).config
    attn = trainer.forward.attention
    every_other = memory.forward_only_multiple(config, tokens, width, attn, 2)
    every_layer = memory.forward_only_multiple(config, tokens, width, attn, True)
    budget, pairs_per = ReferenceScorer(trainer).budget()
    got = budget // tokens if budget else pairs_per // args.per_device_train_batch_size
    assert every_layer < every_other and got == every_other, (got, every_other, every_layer)


def test_forward_only_multiple_at_7b_width_with_every_other_layer():
    """At 7B width the multiple with every other layer checkpointed lies between all layers' (2-3x) and none (8x)."""
    from transformers import Olmo3Config

    from dpotrain.plan import memory

    seven_b = Olmo3Config(
        vocab_size=100278,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    )
    every = memory.forward_only_multiple(seven_b, 16384, 16384, "flash_attention_2", True)
    other = memory.forward_only_multiple(seven_b, 16384, 16384, "flash_attention_2", 2)
    assert every < other <= memory.REFERENCE_MULTIPLE_MOST, (every, other)


# --- 9: samples are generated with compilation off ---


def test_sample_generation_compiles_nothing(tmp_path, tiny_model_dir):
    """With compile_layers every decoder layer shares one code object and its recompile limit: generating samples
    (a KV cache, one-token steps) must not spend it, so the step-0 samples run the layers uncompiled."""
    import torch._dynamo

    from dpotrain.data import data
    from dpotrain.plan import layers
    from dpotrain.recipe.config import parse_args
    from dpotrain.train.samples import SampleGenerator
    from dpotrain.train_stage import trainer_on

    recipe = parse_args(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "1",
            "--samples_every",
            "4",
            "--sample_count",
            "1",
            "--sample_max_new_tokens",
            "3",
        ]
    )
    pairs = data.load_preference_dataset(str(ROOT / "data" / "smoke_prefs.jsonl")).select(range(8))
    trainer = trainer_on(recipe, pairs)
    for layer in layers.decoder_layers(trainer.model):  # what compile_layers does, on a backend that costs nothing
        layer.compile(backend="eager")
    generator = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SampleGenerator))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    state = argparse.Namespace(is_world_process_zero=True, global_step=0)
    records = generator.generate(trainer.args, state, trainer.model)
    assert len(records) == 1
    assert sum(torch._dynamo.utils.counters["frames"].values()) == 0, dict(torch._dynamo.utils.counters["frames"])
    torch._dynamo.reset()


# --- 5: gpu_setup.sh fails when a package the kit needs does not import ---


def fake_wheel(folder, name: str = "kitprobe") -> None:
    """A pure-Python wheel built by hand (no network, no build tool)."""
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.mark.slow
def test_gpu_setup_fails_when_a_kernel_does_not_import(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels)
    env = {**os.environ, "PYTHON": python()}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_setup.sh"), str(wheels), str(tmp_path / "t")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout + result.stderr
    assert "flash_attn.cute" in out, out  # this CPU machine has no FlashAttention 4
    assert result.returncode != 0, out


def test_kit_launches_accelerate_as_a_module():
    """`pip install --target` puts no console script on PATH: every launch in the kit and the GPU tests goes through
    `python -m accelerate.commands.launch`."""
    files = [
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "benchmarks").glob("*.sh"),
        ROOT / "docs" / "gpu-benchmarks.md",
        ROOT / "tests" / "test_gpu.py",
        ROOT / "tests" / "test_gpu_attention.py",
    ]
    binary = re.compile(r"""["']accelerate["'],\s*["']launch|bin/accelerate|^\s*accelerate launch""", re.M)
    offenders = [f.name for f in files if binary.search(f.read_text())]
    assert offenders == [], offenders


# --- 6: the GPU parity test runs on the attention a run would take ---


def only_fa4_installed(monkeypatch, tmp_path) -> None:
    """This machine as an H100 with FlashAttention 4 alone: its `flash_attn` package (which holds `flash_attn.cute`, no
    FA2 kernels) importable, transformers' checks as they read there."""
    import transformers.utils

    package = tmp_path / "fa4" / "flash_attn"
    (package / "cute").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "fa4"))
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for check, present in (
        ("is_flash_attn_4_available", True),
        ("is_flash_attn_3_available", False),
        ("is_flash_attn_2_available", False),
    ):
        monkeypatch.setattr(transformers.utils, check, lambda present=present: present)


def test_gpu_parity_test_takes_the_runs_varlen_attention(monkeypatch, tmp_path):
    from test_architectures import parity_attention

    from dpotrain.forwards import choice

    only_fa4_installed(monkeypatch, tmp_path)
    assert choice.installed_varlen(True) == "flash_attention_4"
    assert parity_attention() == "flash_attention_4"


# --- 2 and 3: plain TRL at the project's settings, every k-th layer checkpointed ---


def tiny_bench(tmp_path, path: str, **given) -> dict:
    """One path of end_to_end.py --tiny, in this process: its JSON record."""
    import end_to_end

    end_to_end.write_model(tmp_path / "model", 2, tiny=True)
    end_to_end.write_pairs(tmp_path / "think.jsonl", "think", 8, 480 / end_to_end.DATA["think"][0])
    given = {"trl_settings": None, **given}
    args = kit_args(
        tiny=True,
        worker=path,
        path=path,
        data="think",
        model=tmp_path / "model",
        pairs=tmp_path / "think.jsonl",
        run_out=tmp_path / path,
        **given,
    )
    return end_to_end.worker(args)


@pytest.mark.slow
def test_plain_trl_trains_with_every_k_th_layer_checkpointed(tmp_path, monkeypatch):
    """TRL's live reference turns checkpointing off and on again with the training arguments' kwargs: given
    `every_n_layers`, torch's checkpoint() gets it as a keyword and raises at the second micro-batch."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    settings = {"dtype": "float32", "mixed_precision": "bf16", "checkpointing_every_n_layers": 2, "pairs_per_step": 4}
    record = tiny_bench(tmp_path, "trl", trl_settings=json.dumps(settings))
    assert record["steps"] == 2 and record["checkpointed_layers"] == [0], record
    assert {k: record[k] for k in settings} == settings


# --- 4 and 11: the probe piece counts flex's compilations on inductor ---


@pytest.mark.slow  # ~1 min: two inductor compilations of FlexAttention on 2 cores
def test_gpu_probe_counts_flex_compilations_on_inductor(tmp_path):
    """benchmarks/gpu_probe.py --tiny: versions, kernels imported for real, and the project's flex compiled by the
    compiler a GPU runs (inductor, not `eager`) once per autograd mode over several row widths (the CPU has no flex
    backward: no_grad and inference mode)."""
    out = tmp_path / "probe.json"
    result = subprocess.run(
        [python(), str(ROOT / "benchmarks" / "gpu_probe.py"), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(out.read_text())
    assert probe["versions"]["torch"] and probe["kernels"]["imports"]["trl"] == "ok"
    assert probe["kernels"]["imports"]["flash_attn.cute"].startswith("import flash_attn.cute: ")
    assert probe["flex"]["backend"] == "inductor" and list(probe["flex"]["modes"]) == ["no_grad", "inference"]
    assert probe["flex"]["compilations"] == 2, probe["flex"]
    assert all(len(m["calls"]) == 3 and all(c["ms"] > 0 for c in m["calls"]) for m in probe["flex"]["modes"].values())


# --- 4: gpu_all.sh is a list of pieces, each within one GPU command, resumable ---


def test_gpu_all_lists_its_pieces_in_order_and_skips_finished_ones(tmp_path):
    def dry_run() -> str:
        result = subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "gpu_all.sh"), str(tmp_path), "--dry-run"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    pieces = [line.split() for line in dry_run().splitlines() if line and not line.startswith((" ", "~"))]
    names = [p[0] for p in pieces]
    assert names == [
        "probe",
        "pytest-gpu",
        "pytest-gpu-recipes",
        "think-recipe",
        "attention-think",
        "attention-multiturn",
        "e2e-think",
        "e2e-multiturn",
        "e2e-zero2",
    ], names
    minutes = [int(p[1].removeprefix("~")) for p in pieces]
    assert all(1 <= m <= 9 for m in minutes) and all(" ".join(p[3:]) == "to run" for p in pieces)
    (tmp_path / "probe.json").write_text("{}")
    (tmp_path / "e2e-think").mkdir()
    (tmp_path / "e2e-think" / "results.json").write_text("{}")
    finished = [line.split()[0] for line in dry_run().splitlines() if "finished" in line]
    assert finished == ["probe", "e2e-think"]
    # every piece's command names a script that exists, and writes the JSON the script looks for
    text = (ROOT / "benchmarks" / "gpu_all.sh").read_text()
    for script in ("gpu_probe.py", "gpu_tests.py", "recipe_steps.py", "attention.py", "end_to_end.py"):
        assert f"benchmarks/{script}" in text and (ROOT / "benchmarks" / script).is_file()


@pytest.mark.slow
def test_gpu_tests_piece_records_each_skip_with_its_reason(tmp_path):
    """The pytest piece on this CPU: every GPU test skipped, each with its reason, in the piece's JSON."""
    out = tmp_path / "pytest-gpu.json"
    cmd = [python(), str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out), "--", "-k", "not shipped_recipe"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["counts"] == {"skipped": len(record["tests"])} and len(record["tests"]) >= 5
    assert all(t["reason"].strip() for t in record["tests"].values()), record["tests"]

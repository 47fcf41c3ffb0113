"""The GPU kit (benchmarks/gpu_*.sh and .py, benchmarks/end_to_end.py and what a GPU run of the project takes), on the
CPU: each test forces the setting a GPU would take (a memory plan that refuses, every k-th layer checkpointed,
FlashAttention 4 present but not importable, a compiled decoder layer) and checks the kit takes it the first time; the
lease's calls as the docs give them fit the device tool. The lease itself on the CPU: tests/test_gpu_lease.py."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, built, python

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
        profile_step=None,
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
    trainer = built(recipe, pairs).trainer
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


@pytest.mark.slow  # builds a trainer (~15 s on 2 cores)
def test_the_reference_stage_takes_the_memory_plans_multiple(tmp_path, tiny_model_dir):
    """Where the memory plan is made (bf16), the stage's micro-batch is the plan's `reference_multiple` training
    micro-batches, decided on the plan's own (traced) parts: 4 x 2,048 positions here, where the stage's formulas alone
    said 3 (issue #54: one value, decided in the plan and read by the stage)."""
    from dpotrain.data import data
    from dpotrain.recipe.config import parse_args
    from dpotrain.reference.scorer import ReferenceScorer
    from dpotrain.train import agreement

    model = wider_model(tmp_path / "model", tiny_model_dir)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", model, "--max_steps", "1"]
    recipe = parse_args([*smoke, "--output_dir", str(tmp_path), "--bf16", "true", "--use_cpu", "true"])
    pairs = data.load_preference_dataset(str(ROOT / "data" / "smoke_prefs.jsonl")).select(range(8))
    run = built(recipe, pairs)
    assert ReferenceScorer(run.trainer).budget() == (4 * 2048, None)
    assert run.spec.memory.values["reference_multiple"] == 4  # recorded in derived.memory
    # Decided on each rank from its own GPU's memory: a rank with another count of forwards would hang ZeRO-3's gathers
    assert agreement.values(run.trainer, None)["the reference's micro-batch"] == "4"


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
    trainer = built(recipe, pairs).trainer
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


def test_the_think_recipe_piece_keeps_the_steps_it_logged_when_cut_off(tmp_path, monkeypatch):
    """A lease kills the think-recipe piece at its limit (lease 1's took 221 s of its 240): its JSON must hold what
    the run logged by then. It was written only when the run ended, so a run cut off in its last step left no step,
    no speed, no memory. Here the run (a stand-in for train_dpo.py) logs step 1 and hangs, as a slow step 2 would."""
    import threading
    import time

    import recipe_steps

    run = (
        "import json, os, sys, time; run = sys.argv[1]; os.makedirs(run, exist_ok=True);"
        "open(os.path.join(run, 'pid'), 'w').write(str(os.getpid()));"
        "step = dict(step=1, loss=0.693, num_tokens=1000, tokens_per_second=250.0, mfu=0.3);"
        "open(os.path.join(run, 'metrics.jsonl'), 'w').write(json.dumps(step) + '\\n'); time.sleep(60)"
    )
    monkeypatch.setattr(
        recipe_steps, "command", lambda args, folder, model: [sys.executable, "-c", run, str(folder / "run")]
    )
    out = tmp_path / "think-recipe.json"
    argv = ["recipe_steps.py", "--out", str(out), "--model", str(tmp_path / "model"), "--steps", "2", "--tiny"]
    monkeypatch.setattr(sys, "argv", argv)

    def piece():
        try:
            recipe_steps.main()
        except SystemExit:  # its exit code: the run's
            pass

    thread = threading.Thread(target=piece, daemon=True)
    thread.start()
    pid_file, deadline = tmp_path / "think-recipe" / "run" / "pid", time.time() + 20
    try:
        while not out.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert out.exists(), "nothing written while the run was going"
        record = json.loads(out.read_text())
        assert record["exit_code"] is None and record["final_model"].startswith("not yet"), record
        assert [s["step"] for s in record["steps"]] == [1] and record["first_step_s"] == 4.0, record
    finally:
        if pid_file.exists():
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)  # the lease's cut: the run's whole group
        thread.join(timeout=10)
    assert json.loads(out.read_text())["exit_code"] == -signal.SIGKILL


def test_an_end_to_end_path_shows_its_output_as_it_runs(tmp_path, monkeypatch, capsys):
    """On a GPU each path runs in a process of its own. Its output was held in memory until it ended: a lease that
    cut the e2e piece at its limit brought back no line of the path it was in (how far plain TRL got, a warning, the
    step it hung in). It goes to the path's log and to the piece's own output (OUT/logs.txt) as it comes."""
    import threading
    import time

    import end_to_end

    release = tmp_path / "release"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, sys, time\n"
        "print('step 1 of 3: 41.5 s')\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.05)\n"
        "print('RESULT ' + json.dumps({'path': 'trl', 'data': 'multiturn', 'steps': 3}))\n"
    )
    monkeypatch.setattr(end_to_end, "__file__", str(worker))  # the script each path's process runs
    args = kit_args(model=tmp_path / "model", trl_batch=4, pairs_per_step=None)
    found = {}
    thread = threading.Thread(
        target=lambda: found.update(end_to_end.run_path(args, "trl", "multiturn", tmp_path, None)), daemon=True
    )
    thread.start()
    log, deadline = tmp_path / "multiturn-trl.log", time.time() + 20
    try:
        while not (log.exists() and "step 1 of 3" in log.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        assert log.exists() and "step 1 of 3" in log.read_text(), "nothing of the path's output while it ran"
    finally:
        release.touch()
        thread.join(timeout=20)
    assert found == {"path": "trl", "data": "multiturn", "steps": 3}, found
    assert "multiturn trl: step 1 of 3: 41.5 s" in capsys.readouterr().out


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


# --- the lease's calls, as docs/gpu-benchmarks.md gives them, fit the device tool ---


def doc_calls() -> list[dict]:
    """Every `run(...)` call in docs/gpu-benchmarks.md: its command's budget and pieces, its carry and timeout."""
    text = (ROOT / "docs" / "gpu-benchmarks.md").read_text()
    calls = []
    for found in re.finditer(r"run\(command=\"([^\"]*)\", carry=\[([^\]]*)\], timeout_s=(\d+)\)", text):
        command, carry, timeout = found.groups()
        lease = re.search(r"bash benchmarks/gpu_lease\.sh \$OUT (\d+) ([\w,-]+)", command)
        calls.append(
            {
                "command": command,
                "budget": int(lease.group(1)) if lease else None,
                "pieces": lease.group(2).split(",") if lease else [],
                "carry": re.findall(r"'([^']+)'", carry),
                "timeout": int(timeout),
            }
        )
    return calls


def carried_tree_mib() -> float:
    """What the device tool carries of the project in every call, in MiB: the files git tracks, and those it would
    (untracked, not ignored), as gpu_wheels.sh counts them; the checkout's own, so a tree grown too large fails here."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (ROOT / os.fsdecode(name)).stat().st_size for name in listed if name and (ROOT / os.fsdecode(name)).is_file()
    ) / (1 << 20)


def test_the_documented_lease_calls_fit_the_device_tool():
    """Each call a session copies from the docs: the lease script with pieces that exist, a deadline a minute
    inside its timeout (at most the tool's 600 s), carried folders that gpu_wheels.sh writes and a call's carry holds
    with the tree (the sizes the docs record), the interpreter the image has."""
    import gpu_lease

    calls = doc_calls()
    assert len(calls) >= 5, calls  # lease 1: 2 calls, lease 2: 2, lease 3: at least 1
    tree = carried_tree_mib()
    sizes = {"core": 15.3, "ds": 4.7, "fa4-1": 26.7, "fa4-2": 41.6}  # MiB, as measured (docs/gpu-benchmarks.md)
    for call in calls:
        assert call["budget"] is not None and set(call["pieces"]) <= set(gpu_lease.NAMED), call
        assert call["timeout"] <= 600 and call["budget"] <= call["timeout"] - 45, call
        assert all(c.startswith(".whl/") and c.removeprefix(".whl/") in sizes for c in call["carry"]), call
        assert tree + sum(sizes[c.removeprefix(".whl/")] for c in call["carry"]) <= 64, (tree, call)
        assert not re.search(r"(^|[;&|]\s*)python\s", call["command"]), call
    text = (ROOT / "docs" / "gpu-benchmarks.md").read_text()
    for folder, mib in sizes.items():
        assert f"`.whl/{folder}`" in text and f"{mib} MiB" in text, folder


def test_each_documented_call_runs_what_its_lease_table_gives_it():
    """A lease's table gives each call its seconds (docs/gpu-benchmarks.md): the `run(...)` a session copies must run
    those pieces, and write the model where the table puts it. Lease 1b's first call was `tests` alone, which needs
    no model, so none was written: its second call (`profile-think,e2e-multiturn`, budgeted without it) would have
    spent ~70 s of its 330 writing one, leaving plain TRL's multi-turn run no time to finish."""
    import gpu_lease

    text = (ROOT / "docs" / "gpu-benchmarks.md").read_text()
    leases = re.split(r"^### (Lease [^:]+):", text, flags=re.M)[1:]
    assert len(leases) >= 8, "the docs' leases, each a `### Lease N:` section"
    for lease, section in zip(leases[::2], leases[1::2], strict=True):
        rows = re.findall(r"^\| \d+ \| call (\d): ([^\n]*)\|$", section, flags=re.M)
        commands = re.findall(r"run\(command=\"bash benchmarks/gpu_lease\.sh \$OUT \d+ ([\w,-]+)\"", section)
        assert rows and len(rows) == len(commands), (lease, rows, commands)
        for (call, row), pieces in zip(rows, commands, strict=True):
            named = pieces.split(",")
            runs = set(named) | ({"model"} if any(gpu_lease.NAMED[n].needs_model for n in named) else set())
            given = {n for n in re.findall(r"`([\w-]+)`", row) if n in gpu_lease.NAMED}
            given |= {"model"} if re.search(r"\bmodel \d+", row) else set()
            assert given <= runs, f"{lease}, call {call}: the table gives it {sorted(given)}, the command runs {pieces}"


def test_the_kit_runs_python3_and_pip_never_byte_compiles():
    """The lent machine's interpreter is `python3` (it has no `python`); pip there installs from the carried files
    alone, into a folder of its own, without compiling thousands of modules on the device's clock."""
    script = (ROOT / "benchmarks" / "gpu_lease.sh").read_text()
    assert re.search(r"PYTHON=\$\{PYTHON:-python3\}", script)
    installs = re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)?", script)
    assert installs and all("--no-compile" in i and "--no-index" in i and "--no-deps" in i for i in installs), installs


# What the lent GPU machine's Python has (docs/gpu-benchmarks.md, "The machine"), and what lease 1 carries (`core`,
# benchmarks/gpu_wheels.sh): by import name.
ON_THE_GPU_IMAGE = {"torch", "numpy", "triton", "transformers", "accelerate", "tokenizers", "huggingface_hub", "peft"}
ON_THE_GPU_IMAGE |= {"safetensors", "pyarrow", "pandas", "xxhash", "matplotlib", "pytest", "yaml", "httpx", "packaging"}
CARRIED_IN_LEASE_ONE = {"trl", "datasets", "dill", "multiprocess", "dotenv"}


def test_the_package_imports_only_what_lease_one_has():
    """Every import the package makes when a module loads (not inside a function: DeepSpeed, W&B and FlashAttention
    are imported where they are used) is on the lent machine's Python or in lease 1's carry. An HTTP library pinned
    with huggingface_hub 2 (httpx2), imported at the top of hub_push.py, failed every piece that loads the run's
    stages on the image's huggingface_hub 1.33: such a name goes through the seam (`upstream.http_transport_errors`)."""
    import ast

    missing = []
    for path in [*sorted((ROOT / "dpotrain").rglob("*.py")), ROOT / "train_dpo.py"]:
        for node in ast.parse(path.read_text()).body:
            body = node.body if isinstance(node, ast.Try) else [node]
            for n in body:
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
                names += [n.module] if isinstance(n, ast.ImportFrom) and n.level == 0 else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names | {"dpotrain"} | ON_THE_GPU_IMAGE | CARRIED_IN_LEASE_ONE:
                        missing.append(f"{path.relative_to(ROOT)}:{n.lineno}: import {name}")
    assert not missing, missing


def test_a_profiled_steps_kernels_are_sorted_by_kind_from_their_gpu_names():
    """The profile's share per kind comes from kernel names only a GPU produces: each lands in its kind, the first
    match winning (an all-reduce is communication, not a reduction; a scatter is not a concatenation)."""
    import end_to_end

    kinds = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "matmul",
        "triton_tem_fused_0": "attention",  # FlexAttention's compiled template
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits>": "attention",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<>": "copies / casts",
        "Memcpy DtoD (Device -> Device)": "copies / casts",
        "void at::native::_scatter_gather_elementwise_kernel<128, 4>": "elementwise / reductions",
        "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>": "elementwise / reductions",
        "triton_red_fused__log_softmax_1": "cross-entropy / log-softmax",
        "triton_poi_fused_mul_2": "other fused (triton)",
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>": "optimizer",
        "cudaLaunchKernel": "other",
    }
    assert {name: end_to_end.kind_of(name) for name in kinds} == kinds


@pytest.mark.slow
@pytest.mark.parametrize("data", ["think", "multiturn"])
def test_the_generated_pairs_fit_their_max_length_as_tokens(tmp_path, data):
    """The mix's lengths are tokens, written as words: at full size (a GPU lease's), every prompt leaves room under
    max_length and the pairs cut are few (the run refuses data of which most is dropped or cut). Written a word per
    token, 57 of 96 multi-turn prompts alone filled 4,096 tokens on the lease, and the run refused its data."""
    import end_to_end

    from dpotrain.data import builtin

    n, max_length = 96, end_to_end.DATA[data][0]
    end_to_end.write_pairs(tmp_path / "pairs.jsonl", data, n)
    tokenizer = builtin.build_tokenizer()
    prompts, whole = [], []
    for line in (tmp_path / "pairs.jsonl").read_text().splitlines():
        row = json.loads(line)
        prompt = tokenizer.apply_chat_template(row["chosen"][:1], add_generation_prompt=True, tokenize=False)
        prompts.append(len(tokenizer(prompt)["input_ids"]))
        sides = (tokenizer.apply_chat_template(row[side], tokenize=False) for side in ("chosen", "rejected"))
        whole.append(max(len(tokenizer(text)["input_ids"]) for text in sides))
    assert max(prompts) < max_length, (max(prompts), max_length)  # a prompt that fills it is dropped
    cut = sum(length > max_length for length in whole)
    assert cut <= 0.15 * n, f"{cut} of {n} pairs past max_length {max_length}"


@pytest.mark.slow
def test_the_plan_at_the_widest_micro_batch_run_is_the_plan_made_for_that_budget(tmp_path):
    """The memory goal compares like with like: generated pairs need not fill the token budget the plan is made for
    (lease 1b: the widest think micro-batch held 56,832 of 65,536 positions, and the plan's tensors read 12% above the
    peak). At 7B width on 141 GB, with no layer checkpointed (what the H200 chose), the plan at the widest micro-batch
    has the same model states and activations for 56,832 positions, ~9.6 GiB fewer than for 65,536 (the dry run's
    figures: 72.6 and 63.0 GiB), and autocast's copies of 4 layers 24 KiB a position fewer (one process: lease 1c)."""
    import end_to_end
    from transformers import Olmo3Config

    from dpotrain import stages
    from dpotrain.data import builtin
    from dpotrain.plan import memory
    from dpotrain.recipe.config import parse_args

    model = tmp_path / "model"
    builtin.build_tokenizer().save_pretrained(model)
    Olmo3Config(**end_to_end.WIDTH, num_hidden_layers=4, layer_types=end_to_end.layer_types(4)).save_pretrained(model)
    end_to_end.write_pairs(tmp_path / "think.jsonl", "think", 8)
    given = kit_args(gpu_memory_gib=141)
    flags = end_to_end.recipe_args(given, "think", model, tmp_path / "think.jsonl", tmp_path / "out", "project")
    launch = stages.checks(parse_args(flags))
    planned = memory.plan(parse_args(flags), launch.world, launch.engine, "flex_attention")
    assert planned["checkpointing"]["every_n_layers"] is None, planned["checkpointing"]
    batching = {"positions_per_micro_batch": {"min": 52352, "mean": 54489.6, "max": 56832}}
    found = end_to_end.widest_micro_batch(given, flags, launch, planned, batching)
    parts = planned["per_gpu_gib"]
    tensors = parts["total"] - parts["cuda_context_and_fragmentation"]
    assert found["widest_micro_batch_positions"] == 56832
    copies = 4 * 24 * 1024 * (65536 - 56832) / 2**30
    assert found["plan_tensors_at_widest_gib"] == pytest.approx(tensors - (72.6 - 63.0) - (4.0 - 3.8) - copies, abs=0.3)
    own = {"peak_gib": 90.13, "plan_gib": 114.1, "plan_allowance_gib": 13.1, "reference_peak_gib": 27.4, **found}
    verdicts = end_to_end.memory_verdicts("think", own)
    assert verdicts[0].startswith("FAIL") and "101.0 GiB" in verdicts[0], verdicts  # lease 1b's, against the budget
    assert verdicts[1].startswith("PASS") and "56,832 positions" in verdicts[1], verdicts

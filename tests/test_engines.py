"""ZeRO-3 and FSDP2 as first-class engines: with 2 processes, the same per-step losses, evaluation and final weights as
one process; step 1 at ln 2; resume exact; samples, evaluation and the LoRA merge complete (no rank left waiting);
every process group has the recipe's collective timeout (`ddp_timeout`, read back from torch in the launched
processes); FSDP2 checkpoints are sharded (each rank writes its own part) and the final model is one plain HF folder.
Each 2-process launch is checked for all of these at once: a launch costs ~40 s on 2 cores."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import (
    GROUP_TIMEOUT_S,
    REPORT_GROUPS,
    ROOT,
    accelerate_launch,
    assert_every_group_has_the_recipes_timeout,
    ddp_config,
    launch_env,
    python,
    rank_python,
    smoke_command,
    tiny_model,
)
from dpotrain.cluster import engine
from dpotrain.recipe.errors import ConfigError

ZERO2 = "accelerate_config.yaml"  # the shipped default: DeepSpeed ZeRO-2
ENGINES = {"zero3": "configs/accelerate/zero3.yaml", "fsdp2": "configs/accelerate/fsdp2.yaml"}
RUN = [
    "--max_steps",
    "4",
    "--logging_steps",
    "1",
    "--save_steps",
    "2",
    "--report_to",
    "none",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "2",
    "--samples_every",
    "2",
    "--sample_count",
    "2",
    "--sample_max_new_tokens",
    "8",
    "--ddp_timeout",
    str(GROUP_TIMEOUT_S),
]
LORA = ["--use_peft", "true", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj", "--merge_lora", "true"]


def train(out, model_dir, data, *args, config=None, timeout=900, env=None, returncode=0):
    """`train_dpo.py` with the smoke recipe: one process, or 2 through `accelerate launch --config_file <config>`,
    whose ranks report their process groups as they end (tests/helpers/report_groups.py). `env`: more variables;
    `returncode`: the launcher's expected exit (`accelerate launch` exits 1 when a rank exits non-zero)."""
    launcher = [python()]
    if config:
        launcher = [
            *accelerate_launch(),
            "--config_file",
            str(ROOT / config),
            "--num_processes",
            "2",
            *rank_python(),
            REPORT_GROUPS,
        ]
    env = launch_env(f"{out}-cache", **(env or {}))
    cmd = smoke_command(launcher, model_dir, "--dataset_name", str(data), "--output_dir", str(out), *args)
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert result.returncode == returncode, result.stdout[-4000:]
    return result.stdout


def metrics(out) -> dict:
    """{(step, "train" | "eval"): record} of metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], "eval" if "eval_loss" in r else "train"): r for r in records}


def weights_keys(out) -> set[str]:
    return {json.loads(p.read_text())["weights_sha256"] for p in Path(f"{out}-cache").glob("reference/*/identity.json")}


def assert_same_weights(a, b, tolerance):
    wa, wb = load_file(str(a)), load_file(str(b))
    assert set(wa) == set(wb)
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    assert worst <= tolerance, worst


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, splits):
    folder = tmp_path_factory.mktemp("one")
    train(folder / "run", tiny_model_dir, splits, *RUN)
    train(folder / "lora", tiny_model_dir, splits, *RUN, *LORA)
    return folder


def assert_fsdp2_checkpoint_is_sharded_and_the_model_one_hf_folder(out) -> None:
    from transformers import AutoModelForCausalLM

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


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINES)
def test_engine_with_two_processes_computes_what_one_process_computes(
    name, tmp_path, tiny_model_dir, splits, one_process
):
    out = tmp_path / "run"
    log = train(out, tiny_model_dir, splits, *RUN, config=ENGINES[name])
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["world_size"] == 2
    assert_every_group_has_the_recipes_timeout(log)  # ZeRO-3's own group is made in `deepspeed.initialize`
    assert log.count("Data (train): 48 rows") == 1  # said by one process of the launch, not by each
    want, got = metrics(one_process / "run"), metrics(out)
    assert list(got) == list(want) == [(1, "train"), (2, "train"), (2, "eval"), (3, "train"), (4, "train"), (4, "eval")]
    assert abs(got[(1, "train")]["loss"] - 0.6931472) < 1e-5  # fp32 rounding: the stage cuts its own micro-batches
    for key, record in want.items():
        for metric in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins", "logps/chosen"):
            if metric in record:
                assert abs(got[key][metric] - record[metric]) <= 1e-4 * max(1, abs(record[metric])), (key, metric)
    # The reference cache's key holds the full weights under every engine (TRL hashes ZeRO-3's empty partitions).
    assert weights_keys(out) == weights_keys(one_process / "run")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 2, 2, 4, 4]  # every rank generated; the main process wrote
    assert_same_weights(one_process / "run" / "model.safetensors", out / "model.safetensors", 1e-5)
    if name == "fsdp2":
        assert_fsdp2_checkpoint_is_sharded_and_the_model_one_hf_folder(out)
    # Each rank hashed its share of every checkpoint; the manifest lists every rank's files (resume.py checks them).
    assert log.count("checksummed by 2 processes and marked COMPLETE") == 2
    manifest = json.loads((out / "checkpoint-4" / "MANIFEST.json").read_text())["files"]
    on_disk = {p.relative_to(out / "checkpoint-4").as_posix() for p in (out / "checkpoint-4").rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {"MANIFEST.json", "COMPLETE"} and len(manifest) > 5

    # Resumed from the checkpoint of step 2: the same final weights as the uninterrupted run.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.copytree(f"{out}-cache", f"{resumed}-cache")
    shutil.rmtree(resumed / "checkpoint-4")
    (resumed / "run_complete.json").unlink()
    log = train(resumed, tiny_model_dir, splits, *RUN, config=ENGINES[name])
    assert f"Resuming from {resumed}/checkpoint-2" in log and "all 32 pairs reused" in log  # 4 steps of 8
    assert_same_weights(out / "model.safetensors", resumed / "model.safetensors", 0)  # FSDP2: from its shards

    # LoRA with the merged model: the adapter and its merge as with one process.
    lora = tmp_path / "lora"
    train(lora, tiny_model_dir, splits, *RUN, *LORA, config=ENGINES[name])
    assert_same_weights(
        one_process / "lora" / "merged" / "model.safetensors", lora / "merged" / "model.safetensors", 1e-6
    )
    # Its reference cache is the base's, as a full fine-tune keys it: the base's weights gathered, the adapter left out
    assert weights_keys(lora) == weights_keys(one_process / "lora") == weights_keys(one_process / "run")


@pytest.mark.slow
def test_plain_ddp_with_two_processes_trains_like_one_process(tmp_path, tiny_model_dir, splits, one_process):
    config = ddp_config(tmp_path)
    out = tmp_path / "run"
    log = train(out, tiny_model_dir, splits, *RUN, config=config)
    assert_every_group_has_the_recipes_timeout(log)
    want, got = metrics(one_process / "run"), metrics(out)
    assert [round(r.get("loss", 0), 5) for r in got.values()] == [round(r.get("loss", 0), 5) for r in want.values()]
    assert_same_weights(one_process / "run" / "model.safetensors", out / "model.safetensors", 1e-5)


@pytest.mark.slow
def test_plain_ddp_with_two_processes_runs_the_padded_forward_in_lockstep(tmp_path, tiny_model_dir):
    """The padded forward (`--padding_free false`, and every model type not proven to pack) runs each micro-batch as
    groups of rows of similar length, one forward each. Under DDP every forward of the wrapped model broadcasts the
    main process's buffers (the rotary frequencies): a rank with one group more than the other ran a broadcast the
    other never joined, which had gone on to its backward's all-reduce, and the launch hung at step 1 until the
    collective timeout (ddp_timeout: 30 minutes, here 60 s). The ranks now run as many forwards each, as under sharded
    weights, and train what one process trains."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:12]))
    args = ["--padding_free", "false", "--max_length", "550", "--max_tokens_per_microbatch", "1100"]
    args += ["--pairs_per_step", "3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, tiny_model_dir, data, *args)
    train(two, tiny_model_dir, data, *args, "--ddp_timeout", "60", config=ddp_config(tmp_path), timeout=300)
    want, got = metrics(one), metrics(two)
    assert list(got) == list(want) == [(step, "train") for step in (1, 2, 3, 4)]
    assert [r["loss"] for r in got.values()] == pytest.approx([r["loss"] for r in want.values()], abs=1e-5)


# TR-DPO with the reference synced after each step, from step 1 at the full rate (no warm-up: at the smoke recipe's
# learning rate 0 the policy stays the base model, the reference too, and a resume without it ends the same)
TR_DPO = ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--report_to", "none"]
TR_DPO += ["--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.5"]
TR_DPO += ["--precompute_ref_log_probs", "false", "--warmup_steps", "0"]


@pytest.fixture(scope="module")
def tr_dpo_run(tmp_path_factory, tiny_model_dir, splits) -> Path:
    """The uninterrupted TR-DPO run under DDP, whose final weights each engine's resumed run is held to (1e-6): the
    uninterrupted runs of DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 processes each) ended within 2.1e-7 of each other, while a
    resume against the base model as reference (the moved one not loaded) ended 6.4e-5 (from step 2) and 1.2e-4 (from
    step 1) away. One run for the four engines, not one each."""
    out = tmp_path_factory.mktemp("tr_dpo") / "run"
    train(out, tiny_model_dir, splits, *TR_DPO, config=ddp_config(out.parent))
    return out


@pytest.mark.slow
def test_a_tr_dpo_run_under_ddp_resumes_against_its_moved_reference(tmp_path, tiny_model_dir, splits, tr_dpo_run):
    """DDP holds TR-DPO's whole reference on each rank: the main process writes it into each checkpoint and every rank
    loads it on a resume, which ends with the uninterrupted run's weights (resumed against the base model, it did
    not: tests/test_faults.py, one process)."""
    resumed = tmp_path / "resumed"
    shutil.copytree(tr_dpo_run, resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    (resumed / "run_complete.json").unlink()
    log = train(resumed, tiny_model_dir, splits, *TR_DPO, config=ddp_config(tmp_path))
    assert f"Resuming from {resumed}/checkpoint-2" in log
    assert_same_weights(tr_dpo_run / "model.safetensors", resumed / "model.safetensors", 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp2"])
def test_a_tr_dpo_run_under_each_engine_resumes_against_its_moved_reference(
    name, tmp_path, tiny_model_dir, splits, tr_dpo_run
):
    """ZeRO-2, the default engine: TRL gives the reference DeepSpeed's stage 0, whole on every rank, as DDP does.
    ZeRO-3 and FSDP2 shard it over the ranks: gathered to the main process to save, and sent from it into every rank's
    shard to load. The main process writes the moved reference into each checkpoint (in its manifest, the model's names
    and full shapes); a run stopped after step 1 is requeued (each rank exits 75, `.checkpointed` written), and its
    rerun loads the reference into every rank and ends with the uninterrupted run's weights. Under ZeRO-3 and FSDP2 the
    stop exited 1 with no requeue, and the rerun was refused ("TR-DPO run (sync_ref_model) under FSDP2 ... does not
    hold it"). ZeRO-2 runs with `--use_cpu true` (what a bf16 run on a CPU needs), which gives a DeepSpeed rank the
    device "cpu:0": safetensors refused it as the moved reference loaded, and every resume of such a run ended in
    "device cpu:0 is invalid" after the model had loaded (fp32 here: the same device)."""
    from dpotrain.train import checkpoint_manifest, resume

    config = {"zero2": "accelerate_config.yaml", **ENGINES}[name]
    run = [*TR_DPO, *(["--use_cpu", "true"] if name == "zero2" else [])]  # ZeRO-2: loaded on DeepSpeed's "cpu:0"
    stop_file, stopped = tmp_path / "stop", tmp_path / "stopped"
    stop_file.touch()  # there before the run starts: it stops after step 1, saving checkpoint-1
    env = {"DPOTRAIN_STOP_FILE": str(stop_file)}
    log = train(stopped, tiny_model_dir, splits, *run, config=config, env=env, returncode=1)
    # Requeued: the batch script's sign, and a rank's exit 75 (torchrun may end the other rank before it exits)
    assert Path(f"{stop_file}.checkpointed").is_file() and re.search(r"exitcode\s*: 75", log), log[-3000:]
    assert resume.REFERENCE_FILE in checkpoint_manifest.read(stopped / "checkpoint-1")
    moved = load_file(str(stopped / "checkpoint-1" / resume.REFERENCE_FILE))
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert set(moved) <= set(base)  # the model's own names, not the DeepSpeed engine's ("module.")
    assert all(moved[k].shape == base[k].shape for k in moved)  # whole, not a rank's partition
    assert max(float((moved[k].float() - base[k].float()).abs().max()) for k in moved) > 1e-5  # synced at step 1
    stop_file.unlink()  # as the batch script does before the requeued job starts
    log = train(stopped, tiny_model_dir, splits, *run, config=config, env=env)
    assert f"Resuming from {stopped}/checkpoint-1" in log
    # Against the base model as reference (the moved one not loaded), steps 2-4 would train to other weights.
    assert_same_weights(tr_dpo_run / "model.safetensors", stopped / "model.safetensors", 1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "gemma4_text"])
def test_fsdp2_shards_each_decoder_layer_of_a_text_model_whose_family_lists_vision_blocks(model_type, monkeypatch):
    """Qwen3.5's and Gemma 4's text models list their family's vision (and audio) blocks in `_no_split_modules`, and
    accelerate's FSDP2 refused the classes it cannot find in the model, after the model loaded. The accelerator is made
    wrapping the listed classes the model has: one unit per decoder layer, by accelerate's own plugin and policy."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from transformers import AutoConfig, AutoModelForCausalLM

    for name, value in {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(engine.FSDP_UNITS, raising=False)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = AutoConfig.for_model(model_type, num_hidden_layers=4, vocab_size=128, **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = {type(layer).__name__ for layer in model.model.layers}
    with pytest.raises(ValueError, match="Could not find the transformer layer class"):  # accelerate, left alone
        fsdp2_prepare_auto_wrap_policy(FullyShardedDataParallelPlugin(), model)
    with engine.fsdp_units(engine.Engine("fsdp2", engine.LAUNCHED, 2), model):
        plugin = FullyShardedDataParallelPlugin()
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [module for module in model.modules() if policy(module)] == list(model.model.layers)
    assert sorted(plugin.transformer_cls_names_to_wrap) == sorted(layers)
    # Classes named in the accelerate config (fsdp_transformer_layer_cls_to_wrap) are the user's, kept as given.
    monkeypatch.setenv(engine.FSDP_UNITS, "Given")
    with engine.fsdp_units(engine.Engine("fsdp2", engine.LAUNCHED, 2), model):
        assert FullyShardedDataParallelPlugin().transformer_cls_names_to_wrap == ["Given"]


def test_fsdp2_loading_on_the_main_process_a_model_with_buffers_in_its_weights_is_refused_before_it_loads(
    tmp_path, monkeypatch, tiny_model_dir
):
    """A DeepSeek-V3-style router keeps its bias as a buffer saved with the weights, and accelerate 1.15's RAM-efficient
    FSDP2 loading (the shipped fsdp2.yaml's) sends parameters only: the launch stopped in "'Tensor' object has no
    attribute 'device_mesh'" once the model had loaded (huggingface/accelerate#3898). Refused by the dry run and the
    launch before the load, naming the setting; off, or a model without such buffers, plans."""
    import train_dpo

    for name in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    router = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
    model = tiny_model("glm4_moe", tmp_path / "glm4_moe", tiny_model_dir, n_group=1, topk_group=1, **router)
    shipped = ROOT / ENGINES["fsdp2"]
    off = tmp_path / "fsdp2.yaml"
    off.write_text(shipped.read_text().replace("cpu_ram_efficient_loading: true", "cpu_ram_efficient_loading: false"))

    def dry_run(model_dir, config):
        smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(tmp_path / "run")]
        return train_dpo.main(
            [*smoke, "--model_name_or_path", model_dir, "--dry-run", "--accelerate_config", str(config)]
        )

    with pytest.raises(ConfigError) as refused:
        dry_run(model, shipped)
    assert str(refused.value) == (
        f"{model} saves buffers with its weights (model.layers.1.mlp.gate.e_score_correction_bias), which FSDP2's "
        f"RAM-efficient loading in accelerate 1.15.0 cannot send to the other processes (huggingface/accelerate#3898): "
        f"set fsdp_cpu_ram_efficient_loading: false in the accelerate config ({shipped}; each process then loads the "
        "whole model in host memory), or train under DeepSpeed ZeRO-3 (configs/accelerate/zero3.yaml)"
    )
    assert dry_run(model, off) in (0, None)
    assert dry_run(tiny_model_dir, shipped) in (0, None)
    # A launch reads the setting as `accelerate launch` passes it on
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    for value, expected in (("true", True), ("false", False)):
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", value)
        assert engine.launched().ram_efficient_loading is expected


@pytest.mark.slow
def test_a_deepseek_v4_model_trains_under_zero2_on_micro_batches_shorter_and_longer_than_its_compressed_blocks(
    tmp_path, tiny_model_dir
):
    """The bundled pairs put micro-batches below and above the 128 positions DeepSeek V4's compressor takes on the two
    ranks of step 1: their ZeRO-2 gradient buckets differed, and gloo stopped the launch ("Received data size doesn't
    match expected size"). test_architectures checks the parameters found and the loss kept."""
    from test_architectures import FAMILIES

    model = tiny_model("deepseek_v4", tmp_path / "model", tiny_model_dir, **FAMILIES["deepseek_v4"])
    out = tmp_path / "run"
    train(out, model, ROOT / "data" / "smoke_prefs.jsonl", "--max_steps", "2", "--report_to", "none", config=ZERO2)
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 2


@pytest.mark.slow
def test_a_qwen3_5_text_model_with_its_own_code_trains_under_fsdp2_and_saves_its_own_code(
    tmp_path, tiny_model_dir, splits
):
    """The launch the test above stands for: accelerate's "Could not find the transformer layer class
    Qwen3_5VisionBlock" ended it once the model had loaded. The model has its own code too (a Qwen3.5 text model under
    another model_type; one launch for both): FSDP2 makes the model an `FSDP<class>` subclass made in torch's module,
    and transformers' save_pretrained of a model with its own code copied that module as the code: the final folder held
    torch's `_fsdp_*.py` files, its auto_map named `_fsdp_init.FSDPTinyRemoteForCausalLM`, and loading it stopped in
    torch's "Tried to register an operator ... multiple times". It is saved under its own class: its own code, and it
    loads."""
    from test_architectures import remote_code_model
    from transformers import AutoModelForCausalLM

    model = remote_code_model(tmp_path / "model", tiny_model_dir, "qwen3_5_text")
    out = tmp_path / "run"
    args = ("--trust_remote_code", "true", "--max_steps", "1", "--warmup_steps", "0", "--report_to", "none")
    train(out, str(model), splits, *args, config=ENGINES["fsdp2"])
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 1
    assert sorted(p.name for p in out.glob("*.py")) == ["modeling_tiny_remote.py"]
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_tiny_remote.TinyRemoteForCausalLM"
    assert type(AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)).__name__ == "TinyRemoteForCausalLM"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP version 1 is not supported: set fsdp_version: 2"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, "ZeRO stage 1 is not supported"),
        ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "megatron_lm is not supported"),
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
            "fsdp_activation_checkpointing: true is not supported: set fsdp_activation_checkpointing: false",
        ),
    ],
)
def test_engines_the_project_does_not_support_are_refused(env, message, monkeypatch):
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        engine.launched()


def test_fsdp_activation_checkpointing_is_refused_before_anything_loads(tmp_path):
    """fsdp_activation_checkpointing: true in an FSDP2 config: with the recipe's activation_checkpointing on,
    transformers stopped the launch in a ValueError traceback once the model had loaded; with it off, accelerate
    checkpointed every layer under a memory plan and record of none. The dry run (and so the job) refuses it."""
    config = tmp_path / "fsdp2.yaml"
    shipped = (ROOT / ENGINES["fsdp2"]).read_text()
    config.write_text(shipped.replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true"))
    found = engine.from_config(str(config))
    assert found.refused and found.refused.startswith("fsdp_activation_checkpointing: true is not supported")
    assert engine.from_config(str(ROOT / ENGINES["fsdp2"])).refused is None


def test_an_inline_deepspeed_config_without_zero_stage_is_zero2_as_accelerate_runs_it(tmp_path, monkeypatch):
    """accelerate's DeepSpeedPlugin runs ZeRO-2 where the accelerate config's deepspeed_config names no zero_stage
    (`accelerate launch` then sets no ACCELERATE_DEEPSPEED_ZERO_STAGE): read as stage 0, such a launch was refused
    with "DeepSpeed ZeRO stage 0 is not supported", a stage nobody asked for. A stage given is kept."""
    config = tmp_path / "inline.yaml"
    config.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: auto\nnum_processes: 2\n")
    found = engine.from_config(str(config))
    assert (found.name, found.refused) == ("zero2", None)
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert engine.launched().name == "zero2"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0")
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO stage 0 is not supported"):
        engine.launched()


def test_more_processes_on_a_node_than_it_has_gpus_are_refused(monkeypatch):
    """`accelerate launch --num_processes 8` on a node of 4 GPUs: accelerate gives rank i GPU i % 4, two ranks share
    each GPU, and NCCL stops the launch at its first collective ("Duplicate GPU detected"), after the model loaded.
    `stages.decide_launch` refuses it first, with torch's GPU count (a CPU-only launch has none: not checked)."""
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ConfigError) as refused:
        engine.check_processes_per_node(engine.launched().gpus_per_node, 4)
    assert str(refused.value) == (
        "8 processes were started on this node, which has 4 GPUs (CUDA_VISIBLE_DEVICES=0,1,2,3): start one per GPU "
        "(`accelerate launch --num_processes` counts all nodes' processes: 4 x nodes), or use scripts/launch.sh, "
        "which starts one per GPU of the job"
    )
    engine.check_processes_per_node(4, 4)
    engine.check_processes_per_node(8, 0)


@pytest.mark.slow
def test_an_fsdp1_launch_is_refused_before_anything_loads(tmp_path, tiny_model_dir):
    config = tmp_path / "fsdp1.yaml"
    config.write_text((ROOT / ENGINES["fsdp2"]).read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        *rank_python(),
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "error: FSDP version 1 is not supported: set fsdp_version: 2" in result.stderr
    assert "Loading weights" not in result.stderr + result.stdout


@pytest.mark.parametrize("source", ["launch", "dry run"])
def test_an_accelerate_mixed_precision_the_recipe_does_not_train_in_is_refused(source, tmp_path, monkeypatch):
    """`accelerate config` writes `mixed_precision: bf16`; with a recipe in fp32 (bf16 and fp16 false) TrainingArguments
    took ACCELERATE_MIXED_PRECISION, which `accelerate launch` sets from it: the run trained under bf16 autocast while
    the dry run, the memory plan and resolved_config.json said fp32."""
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    if source == "launch":
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
        where = r"\(ACCELERATE_MIXED_PRECISION\)"
    else:
        config = tmp_path / "mine.yaml"
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\n")
        args += ["--dry-run", "--accelerate_config", str(config)]
        where = rf"\(the accelerate config {config}\)"
    with pytest.raises(
        ConfigError, match=rf"^mixed_precision is bf16 {where} and the recipe sets neither .* --bf16 true"
    ):
        stages.checks(parse_args(args))
    stages.checks(
        parse_args([*args, "--bf16", "true", "--use_cpu", "true"])
    )  # the recipe's precision wins: trained as recorded


def test_a_zero3_config_that_does_not_gather_the_weights_on_save_is_refused(tmp_path, monkeypatch):
    """DeepSpeed's stage3_gather_16bit_weights_on_model_save defaults to false (accelerate's zero3_save_16bit_model
    too): a ZeRO-3 launch of a config without it completed, printed "Saved model", and left no model.safetensors in
    the output folder, only DeepSpeed's shards (global_stepN/, zero_to_fp32.py), which the run then pushed. Refused at
    start, by the run and the dry run (listed among what the run would refuse); still planned as ZeRO-3."""
    shipped = json.loads((ROOT / "configs" / "accelerate" / "ds_zero3.json").read_text())
    zero3_yaml = (ROOT / "configs" / "accelerate" / "zero3.yaml").read_text()

    def config(gather, yaml_extra=""):
        ds = {**shipped, "zero_optimization": dict(shipped["zero_optimization"])}
        ds["zero_optimization"].pop("stage3_gather_16bit_weights_on_model_save")
        if gather is not None:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        path = tmp_path / "zero3.yaml"
        path.write_text(
            zero3_yaml.replace("configs/accelerate/ds_zero3.json", str(tmp_path / "ds.json")).replace(
                "deepspeed_config:\n", f"deepspeed_config:\n{yaml_extra}"
            )
        )
        return str(path)

    unsaved = "does not gather the weights when the model is saved, so the final model would be written as"
    for gather, extra in ((None, ""), (False, ""), ("auto", "")):
        planned = engine.from_config(config(gather, extra))
        assert planned.name == "zero3" and unsaved in planned.refused, (gather, planned)
        assert '"stage3_gather_16bit_weights_on_model_save": true in its zero_optimization' in planned.refused
    assert engine.from_config(config(True)).refused is None
    inline = tmp_path / "inline.yaml"
    inline.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\nnum_processes: 2\n")
    assert unsaved in engine.from_config(str(inline)).refused
    assert "zero3_save_16bit_model: true under deepspeed_config" in engine.from_config(str(inline)).refused

    # The launch: the same settings as `accelerate launch` passes them on.
    for name in (
        "ACCELERATE_USE_FSDP",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ConfigError, match=f"^the DeepSpeed ZeRO-3 config \\(this launch\\) {unsaved}"):
        engine.launched()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    assert engine.launched().name == "zero3"
    config(None)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false")
    with pytest.raises(ConfigError, match=unsaved):
        engine.launched()
    config("auto")  # filled from `accelerate launch --zero3_save_16bit_model true`
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    assert engine.launched().refused is None
    # the shipped config gathers them
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "configs" / "accelerate" / "ds_zero3.json"))
    assert engine.launched().refused is None


def test_deepspeed_settings_that_would_replace_or_contradict_the_recipes_are_refused_at_start(tmp_path, monkeypatch):
    """DeepSpeed configs written by hand (as in transformers' docs) set batch sizes, an optimizer and a scheduler. The
    step plan runs each step's micro-batches itself (DeepSpeed gets an accumulation of 1): a config's
    "gradient_accumulation_steps": 4 stopped every rank with transformers' "Please correct the following DeepSpeed
    config values" traceback once the model had loaded and the reference stage had run; a "scheduler" (WarmupLR)
    trained at a constant learning rate while the record said linear decay. Refused before anything loads, by the dry
    run and the launch; numbers that agree pass."""
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    for name in ("WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    shipped = json.loads((ROOT / "ds_config.json").read_text())
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    per_gpu = parse_args(smoke).training.per_device_train_batch_size

    def dry_run(**settings):
        (tmp_path / "ds.json").write_text(json.dumps({**shipped, **settings}))
        config = tmp_path / "accelerate.yaml"  # 4 processes, as the shipped accelerate_config.yaml
        config.write_text(
            (ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", str(tmp_path / "ds.json"))
        )
        return stages.checks(parse_args([*smoke, "--dry-run", "--accelerate_config", str(config)]))

    late = 'which transformers would refuse once the model has loaded: set them to "auto" there'
    with pytest.raises(
        ConfigError, match=f"sets train_micro_batch_size_per_gpu 1, gradient_accumulation_steps 4, {late}"
    ):
        dry_run(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match='sets bf16 true, which transformers would refuse .* set it to "auto"'):
        dry_run(bf16={"enabled": True})  # the smoke recipe trains in fp32
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
    with pytest.raises(
        ConfigError,
        match=r"its own \"scheduler\" \(WarmupLR\), which DeepSpeed would run in place of "
        r"the recipe's lr_scheduler_type linear: remove 'scheduler'",
    ):
        dry_run(scheduler=scheduler)
    with pytest.raises(
        ConfigError,
        match=r"its own \"optimizer\" \(AdamW\), which DeepSpeed would run in place of the recipe's optim adamw_",
    ):
        dry_run(optimizer={"type": "AdamW", "params": {"lr": "auto"}})
    # An empty or null part counts too, as transformers reads it by its key: DeepSpeed then built none, and every
    # rank stopped once the model had loaded ("zero stage 2 requires an optimizer"; "'DummyScheduler' object has no
    # attribute 'get_last_lr'").
    with pytest.raises(ConfigError, match=r"its own \"optimizer\" \(\{\}\), which DeepSpeed would run in place"):
        dry_run(optimizer={})
    with pytest.raises(ConfigError, match=r"its own \"scheduler\" \(null\), which DeepSpeed would run in place"):
        dry_run(scheduler=None)
    inline = tmp_path / "inline.yaml"  # as `accelerate config` writes its answer: accelerate makes it DeepSpeed's
    inline.write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 4\n"
    )
    with pytest.raises(ConfigError, match="sets gradient_accumulation_steps 4, which transformers would refuse"):
        stages.checks(parse_args([*smoke, "--dry-run", "--accelerate_config", str(inline)]))
    # What transformers would fill in anyway is not refused.
    dry_run(train_micro_batch_size_per_gpu=per_gpu, gradient_accumulation_steps=1, train_batch_size=4 * per_gpu)

    # The launch reads the same file from the environment `accelerate launch` sets (the recipe parsed first: its
    # TrainingArguments would set up the DeepSpeed processes).
    training = parse_args(smoke).training
    (tmp_path / "ds.json").write_text(json.dumps({**shipped, "gradient_accumulation_steps": 8}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    launched = engine.launched()
    with pytest.raises(
        ConfigError, match=r"^the DeepSpeed config \(this launch -> .*\) sets gradient_accumulation_steps 8"
    ):
        engine.check_deepspeed_settings(training, 2, launched)  # as stages.decide_launch checks it


def test_a_deepspeed_config_that_is_not_json_is_named_in_one_line(tmp_path, monkeypatch):
    """A trailing comma in a hand-edited DeepSpeed config ended the dry run in a JSONDecodeError traceback (and a list,
    in an AttributeError one): the dry run now lists it as what the run would refuse, naming the file; the launch
    refuses it in one line."""
    for text, why in (('{"zero_optimization": {"stage": 2,}}', "JSONDecodeError"), ("[2]", "not a JSON object")):
        (tmp_path / "ds.json").write_text(text)
        config = tmp_path / "accelerate.yaml"
        config.write_text(
            (ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", str(tmp_path / "ds.json"))
        )
        planned = engine.from_config(str(config))
        assert planned.name == "unplanned" and planned.refused == planned.source, planned
        assert planned.refused.startswith(f"DeepSpeed config {str(tmp_path / 'ds.json')!r} cannot be read ({why}"), (
            planned
        )
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
        with pytest.raises(ConfigError, match=f"cannot be read \\({why}.*: fix it"):
            engine.launched()


def test_an_optimizer_zero_offload_would_replace_is_refused_at_start(tmp_path, monkeypatch):
    """Under ZeRO optimizer offload accelerate puts DeepSpeed's CPU Adam in place of any optimizer but AdamW and
    Adagrad (`map_pytorch_optim_to_deepspeed`): `optim sgd` trained as Adam, recorded as sgd. Refused by the dry run
    and the launch alike (stages.checks); AdamW, Adagrad, and a config that turns the replacement off pass."""
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    for name in ("WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    shipped = json.loads((ROOT / "ds_config.json").read_text())
    offload = {**shipped["zero_optimization"], "offload_optimizer": {"device": "cpu"}}

    def checks(optim, **settings):
        (tmp_path / "ds.json").write_text(json.dumps({**shipped, "zero_optimization": offload, **settings}))
        config = tmp_path / "accelerate.yaml"
        config.write_text(
            (ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", str(tmp_path / "ds.json"))
        )
        smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--optim", optim]
        return stages.checks(parse_args([*smoke, "--dry-run", "--accelerate_config", str(config)]))

    for optim in ("sgd", "adafactor", "rmsprop"):
        with pytest.raises(ConfigError, match=f"optim {optim} under ZeRO optimizer offload .* would train as "):
            checks(optim)
    for optim in ("adamw_torch_fused", "adamw_torch", "adagrad"):
        assert checks(optim).engine.offload_optimizer
    assert checks("sgd", zero_force_ds_cpu_optimizer=False).engine.offload_optimizer  # the recipe's optimizer steps


def test_a_deepspeed_stage_that_is_no_number_and_a_null_offload_are_read_as_deepspeed_reads_them(tmp_path):
    """`"stage": "auto"` (transformers' word for the fields it fills, not this one) and `"offload_optimizer": null`
    (DeepSpeed's "no offload") ended the dry run in a ValueError and an AttributeError traceback."""
    ds = json.loads((ROOT / "ds_config.json").read_text())
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        (ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", str(tmp_path / "ds.json"))
    )
    (tmp_path / "ds.json").write_text(
        json.dumps({**ds, "zero_optimization": {**ds["zero_optimization"], "stage": "auto"}})
    )
    planned = engine.from_config(str(config))
    assert planned.name == "unplanned" and planned.refused.endswith("zero_optimization \"stage\" 'auto': give 2 or 3")
    zero = {**ds["zero_optimization"], "offload_optimizer": None, "offload_param": None}
    (tmp_path / "ds.json").write_text(json.dumps({**ds, "zero_optimization": zero}))
    planned = engine.from_config(str(config))
    assert planned.name == "zero2" and not planned.offload_optimizer and not planned.offload_params, planned


def test_offload_settings_are_read_as_accelerate_launch_passes_them_on(tmp_path):
    """`fsdp_offload_params: "false"` (quoted) was planned as offloaded (bool of a non-empty string), and an inline
    `offload_optimizer_device: null` as offloaded too (None is not "none"), while `accelerate launch` passes them on
    as false and not at all: the memory plan counted memory the launch keeps on the GPU."""
    fsdp = (ROOT / "configs" / "accelerate" / "fsdp2.yaml").read_text()
    for written, offloaded in (('"false"', False), ("false", False), ('"true"', True), ("true", True)):
        config = tmp_path / "fsdp2.yaml"
        config.write_text(fsdp.replace("fsdp_offload_params: false", f"fsdp_offload_params: {written}"))
        assert engine.from_config(str(config)).offload_params is offloaded, written
    for written, offloaded in (("null", False), ("none", False), ("None", False), ("cpu", True)):
        config = tmp_path / "inline.yaml"
        config.write_text(
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
            f"  offload_optimizer_device: {written}\n  offload_param_device: {written}\n"
        )
        found = engine.from_config(str(config))
        assert (found.offload_optimizer, found.offload_params) == (offloaded, offloaded), written


def test_accelerate_settings_beside_a_deepspeed_file_are_refused_by_the_dry_run_as_by_the_launch(tmp_path):
    """`accelerate launch` refuses an accelerate config that names a deepspeed_config_file and also sets what the file
    holds (zero3_save_16bit_model, gradient_accumulation_steps, ..., or a mixed_precision, even 'no'): every process
    stopped as it started with "the following accelerate config variables will be ignored", after a dry run that had
    planned it without a word. The dry run lists it as what the run would refuse (launch.sh's job ends there)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    shipped = (ROOT / "configs" / "accelerate" / "zero3.yaml").read_text()
    shipped = shipped.replace(
        "configs/accelerate/ds_zero3.json", str(ROOT / "configs" / "accelerate" / "ds_zero3.json")
    )
    cases = {
        "mixed_precision": shipped.replace("num_machines: 1", "mixed_precision: 'no'\nnum_machines: 1"),
        "zero3_save_16bit_model": shipped.replace(
            "deepspeed_config:\n", "deepspeed_config:\n  zero3_save_16bit_model: true\n"
        ),
        "": shipped,
    }
    for beside, text in cases.items():
        config = tmp_path / "zero3.yaml"
        config.write_text(text)
        refused = engine.from_config(str(config)).refused
        # What the launch does with it: accelerate's own launcher and plugin, in this process.
        args, defaults, from_config = _validate_launch_command(
            launch_command_parser().parse_args(["--config_file", str(config), "train_dpo.py"])
        )
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] * from_config)]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as `launch_command` sets it
        env = {k: v for k, v in prepare_deepspeed_cmd_env(args)[1].items() if k.startswith("ACCELERATE_")}
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            if beside:
                assert f"sets {beside} beside its deepspeed_config_file, which `accelerate launch` refuses" in refused
                with pytest.raises(ValueError, match="the following accelerate config variables will be ignored"):
                    DeepSpeedPlugin()
            else:
                assert refused is None
                DeepSpeedPlugin()


def test_an_accelerate_config_with_a_null_process_count_is_planned_as_accelerate_reads_it(tmp_path):
    """`num_processes: null` (accelerate then counts the machine's GPUs) ended the dry run in a TypeError traceback
    ('>' not supported between 'int' and 'NoneType'): planned as an unset count is, 1 process."""
    config = tmp_path / "ddp.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: null\nnum_machines: 1\n")
    assert engine.processes(engine.read_accelerate_config(str(config))) == 1
    assert engine.from_config(str(config)).name == "ddp"


def test_a_launch_from_outside_the_project_reads_the_shipped_deepspeed_file_the_dry_run_planned(tmp_path, monkeypatch):
    """accelerate_config.yaml names `deepspeed_config_file: ds_config.json`, which `accelerate launch` hands each
    process as written, to read from the folder it runs in: `accelerate launch --config_file
    ~/dpotrain/accelerate_config.yaml ~/dpotrain/train_dpo.py ...` from another folder stopped every process as its
    TrainingArguments were made ("Expected a string path to an existing deepspeed config ... Received: ds_config.json"),
    while the dry run had planned ZeRO-2 from the project's file. The processes now read it as the dry run does: here,
    else the project's."""
    import torch
    import transformers.training_args as training_args

    from dpotrain.recipe.config import parse_args

    # The launch's DeepSpeed processes without their process group: the plugin reads the file as in a launch.
    monkeypatch.setattr(training_args.TrainingArguments, "_setup_devices", property(lambda self: torch.device("cpu")))
    monkeypatch.chdir(tmp_path)  # no ds_config.json here
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_config.json")
    for name in ("WORLD_SIZE", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_GRADIENT_CLIPPING"):
        monkeypatch.delenv(name, raising=False)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    assert engine.from_config(str(ROOT / "accelerate_config.yaml")).name == "zero2"  # what the dry run plans
    training = parse_args(smoke).training
    shipped = json.loads((ROOT / "ds_config.json").read_text())
    assert training.deepspeed_plugin.hf_ds_config.config["zero_optimization"] == shipped["zero_optimization"]
    assert engine.launched().name == "zero2" and engine.launched().source.endswith(str(ROOT / "ds_config.json"))
    # Found nowhere: accelerate's line, with where it was looked for and the fix.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "my_ds.json")
    with pytest.raises(
        ConfigError,
        match=f"Received: my_ds.json \\(.*not in {tmp_path} nor in the project: give its deepspeed_config_file's",
    ):
        parse_args(smoke)


def test_a_jobs_accelerate_config_from_the_submit_folder_reads_its_deepspeed_file_there(tmp_path, monkeypatch):
    """`ACCELERATE_CONFIG=my_accel.yaml sbatch .../dpo_train.sh` from a folder holding my_accel.yaml and the
    `deepspeed_config_file: my_ds.json` it names: the job runs in the project, where my_ds.json was looked for alone,
    so its dry run refused it ("not found in <project> nor in the project") and every process stopped on it, while
    `accelerate launch --config_file my_accel.yaml` typed in that folder reads it there. A relative ds file is read
    as the launch typed there reads it: in the folder submitted from, else here, else the project's."""
    import torch
    import transformers.training_args as training_args

    from dpotrain.recipe.config import parse_args

    monkeypatch.setattr(training_args.TrainingArguments, "_setup_devices", property(lambda self: torch.device("cpu")))
    submitted = tmp_path / "runs"
    submitted.mkdir()
    ds = json.loads((ROOT / "ds_config.json").read_text())
    ds["zero_optimization"] |= {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}  # not the project's
    (submitted / "my_ds.json").write_text(json.dumps(ds))
    text = (ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", "my_ds.json")
    (submitted / "my_accel.yaml").write_text(text)
    monkeypatch.chdir(ROOT)  # where the job runs
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    for name in ("WORLD_SIZE", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_GRADIENT_CLIPPING"):
        monkeypatch.delenv(name, raising=False)
    planned = engine.from_config(str(submitted / "my_accel.yaml"))
    assert planned.name == "zero3" and planned.refused is None, planned
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # the launched processes: accelerate hands it as written
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "my_ds.json")
    training = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml")]).training
    assert training.deepspeed_plugin.hf_ds_config.config["zero_optimization"]["stage"] == 3
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(submitted / "my_ds.json")
    # The project's own, not in the folder submitted from, stays the project's
    assert engine.from_config(str(ROOT / "accelerate_config.yaml")).name == "zero2"
    # Found nowhere: the refusal names each folder looked in
    (submitted / "my_ds.json").unlink()
    assert engine.from_config(str(submitted / "my_accel.yaml")).refused.startswith(
        f"DeepSpeed config 'my_ds.json' ({submitted / 'my_accel.yaml'}) not found in {ROOT}, {submitted} (where the "
        "job was submitted) nor in the project: "
    )


def test_the_projects_accelerate_config_reads_the_projects_deepspeed_file_in_a_job_from_any_folder(
    tmp_path, monkeypatch
):
    """`sbatch /path/to/dpotrain/scripts/dpo_train.sh` (the project's accelerate_config.yaml, `deepspeed_config_file:
    ds_config.json`) from a folder holding a ds_config.json of its own (another checkout's, another tool's): the job
    planned and trained with that one (ZeRO-3 here) where c4e9dc2 read the project's (ZeRO-2). A config of the
    folder submitted from still reads its ds_config.json there."""
    import torch
    import transformers.training_args as training_args

    from dpotrain.recipe.config import parse_args

    monkeypatch.setattr(training_args.TrainingArguments, "_setup_devices", property(lambda self: torch.device("cpu")))
    submitted = tmp_path / "runs"
    submitted.mkdir()
    ds = json.loads((ROOT / "ds_config.json").read_text())
    ds["zero_optimization"] |= {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}  # not the project's
    (submitted / "ds_config.json").write_text(json.dumps(ds))
    (submitted / "my_accel.yaml").write_text((ROOT / "accelerate_config.yaml").read_text())
    monkeypatch.chdir(ROOT)  # where the job runs
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(submitted))
    for name in ("WORLD_SIZE", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_GRADIENT_CLIPPING"):
        monkeypatch.delenv(name, raising=False)
    assert engine.from_config("accelerate_config.yaml").name == "zero2"
    assert engine.from_config(str(submitted / "my_accel.yaml")).name == "zero3"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # the launched processes: accelerate hands it as written
    for config, stage in (("accelerate_config.yaml", 2), (str(submitted / "my_accel.yaml"), 3)):
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_config.json")
        smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--accelerate_config", config]
        training = parse_args(smoke).training
        assert training.deepspeed_plugin.hf_ds_config.config["zero_optimization"]["stage"] == stage, config


def test_a_deepspeed_file_found_nowhere_is_what_the_run_would_refuse_and_its_clipping_reads_as_unplanned(
    tmp_path, monkeypatch
):
    """An accelerate config whose deepspeed_config_file is neither in the folder the dry run runs in nor in the project:
    every launched process stops on it, while the dry run planned the run in silence, its clipping line reading "by
    DeepSpeed config 'missing.json' (accel.yaml) not found" (the reason it could not plan, as what clips)."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "accel.yaml"
    config.write_text((ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", "missing.json"))
    planned = engine.from_config("accel.yaml")
    assert planned.name == "unplanned" and planned.refused == (
        f"DeepSpeed config 'missing.json' (accel.yaml) not found in {tmp_path} nor in the project: give its "
        "deepspeed_config_file's path from the folder the launch runs in, or an absolute one"
    ), planned
    assert engine.gradient_clipping(1.0, planned)["clipped_by"] == (
        "the launch's engine, not planned (DeepSpeed config 'missing.json' (accel.yaml) not found)"
    )

"""`train_dpo.py --dry-run` as a person reads it (dpotrain/dry_run.py): a summary of what the job will do, the GPU its
memory plan was checked against and how to plan for another; the full JSON beside the output folder, or with --json."""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import train_dpo
from conftest import PYTHON, ROOT, in_child, submitted
from dpotrain.recipe import config as config_mod
from dpotrain.recipe.errors import ConfigError, plural

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]
OLMO3_7B = str(ROOT / "configs" / "models" / "olmo3-7b")  # a shipped config.json: a real plan on a fresh clone


def dry_run(capsys, *args) -> str:
    train_dpo.main([*args, "--dry-run"])
    return capsys.readouterr().out


def field(text: str, name: str) -> str:
    """The value of one summary line (`  name:  value`)."""
    match = re.search(rf"^  {re.escape(name)}:\s+(.*)$", text, re.MULTILINE)
    assert match, f"no {name!r} line in:\n{text}"
    return match.group(1)


def test_a_new_folder_given_another_folders_checkpoint_is_not_called_an_unfinished_run(tmp_path):
    """`--resume_from_checkpoint other/checkpoint-40 --output_dir new`: the dry run said `new: an unfinished run, which
    the run resumes from ...`, of a folder not made yet. Its own checkpoint's folder is still an unfinished run."""
    from dpotrain import resolve

    other = str(tmp_path / "other" / "checkpoint-40")
    said = resolve.OutputDecision(resume_from=other, start_afresh=False).record(str(tmp_path / "new"))
    assert said["output_folder"] == f"{tmp_path / 'new'}: the run starts there (new), from the checkpoint {other}"
    said = resolve.OutputDecision(resume_from=other, start_afresh=False).record(str(tmp_path / "other"))
    assert said["output_folder"] == f"{tmp_path / 'other'}: an unfinished run, which the run resumes from {other}"


def test_a_checkpoint_the_run_refuses_to_resume_is_not_called_the_one_it_resumes_from(tmp_path):
    """A 2-process ZeRO run stopped at checkpoint-4, dry-run on 1 process: `output: <out>: an unfinished run, which the
    run resumes from <out>/checkpoint-4` above `warning: the run would refuse: checkpoint '<out>/checkpoint-4' holds
    DeepSpeed ZeRO optimizer state partitioned over 2 processes, ...`: two answers. The refusal is the run's answer."""
    from dpotrain import resolve
    from dpotrain.recipe import run_record

    out = tmp_path / "run"
    found = str(out / "checkpoint-4")
    refusal = (
        f"checkpoint {found!r} holds DeepSpeed ZeRO optimizer state partitioned over 2 processes, and this run has 1: "
        "resume it on 2 processes, or start afresh"
    )
    for afresh in (False, True):
        said = resolve.OutputDecision(found, afresh, would_refuse=(refusal,)).record(str(out))
        assert said == {"output_folder": f"{out}{run_record.REFUSED_FOLDER}", "would_refuse": [refusal]}, said
    said = resolve.OutputDecision(found, False, would_refuse=("report_to wandb but no W&B login",)).record(str(out))
    assert said["output_folder"] == f"{out}: an unfinished run, which the run resumes from {found}"  # not the folder's


def test_a_dry_run_writes_no_record_beside_a_folder_the_run_refuses(tmp_path, capsys):
    """`--output_dir /`, `~`, `.` or `data` (folders holding what is no run's) are refused by the run, and the dry run
    said so, then wrote its record beside them all the same: `/.dry-run.json` in the root, `data.dry-run.json` in the
    project, files in a person's folders for a run that would never be there. --json still prints it. (A run's own
    folder refused for a flag, such as --overwrite_output_dir, is where the run goes once given it: written there.)"""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a person's file")
    text = dry_run(capsys, *SMOKE, "--output_dir", str(mine))
    assert field(text, "output") == f"{mine}: refused by the run (below)"
    assert field(text, "everything") == "not written beside a folder the run refuses (--json prints it)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    printed = dry_run(capsys, *SMOKE, "--output_dir", str(mine), "--json")
    assert json.loads(printed[printed.index("{\n") :])["output_dir"] == str(mine)


def test_a_resume_checkpoint_the_run_refuses_is_not_called_a_new_run_there(tmp_path, capsys):
    """`--resume_from_checkpoint /nonexistent`: the dry run's output line said "the run starts there (new)" above its
    own `would refuse` warning for that checkpoint, two answers to what the run does with its folder. A refusal of the
    folder's decision (resume, start afresh, or refuse) is the run's answer: the line says the run refuses."""
    out, gone = tmp_path / "run", tmp_path / "nonexistent"
    text = dry_run(capsys, *SMOKE, "--output_dir", str(out), "--resume_from_checkpoint", str(gone))
    assert field(text, "output") == f"{out}: refused by the run (below)", text
    assert f"warning: the run would refuse: resume_from_checkpoint '{gone}' is not a folder" in text, text


def test_a_folder_where_the_record_goes_is_refused_in_one_line_naming_json(tmp_path):
    """A folder named as the dry run's record (`runs/x.dry-run.json/`, a run once given that name): the record's
    rename over it ended the dry run in an IsADirectoryError traceback, after the whole first half."""
    from dpotrain import dry_run as dry_run_mod

    (tmp_path / "x.dry-run.json").mkdir()
    resolved = {"config": None, "dataset_name": "data/smoke_prefs.jsonl", "accelerate_config": "none"}
    with pytest.raises(ConfigError, match=r"x\.dry-run\.json is a folder, where the dry run writes its record: move"):
        dry_run_mod.write_json(resolved, str(tmp_path / "x"))
    assert [p.name for p in (tmp_path / "x.dry-run.json").iterdir()] == []


def test_a_lora_summary_says_an_adapter_trains_and_what_the_reference_is(tmp_path, capsys):
    """The summary of a LoRA run read as a full fine-tune's (the model line, no word of the adapter), and its live
    reference as "a live reference model", where TRL runs the model with its adapter disabled (no second model)."""
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--lora_modules_to_save", "lm_head"]
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), *lora, "--precompute_ref_log_probs", "false")
    assert field(text, "LoRA") == (
        "an adapter trains on q_proj v_proj (r 16, alpha 32, dropout 0); the model's weights stay frozen but lm_head, "
        "trained whole"
    )
    assert (
        field(text, "reference")
        == "the model with its LoRA adapter disabled, run beside every step (no reference stage)"
    )
    text = dry_run(
        capsys,
        *SMOKE,
        "--output_dir",
        str(tmp_path / "run"),
        "--use_peft",
        "true",
        "--lora_target_modules",
        "all-linear",
        "--merge_lora",
        "true",
    )
    assert field(text, "LoRA").endswith(
        "(r 16, alpha 32, dropout 0); the model's weights stay frozen; merged into them in merged/ at the end"
    )
    assert "LoRA:" not in dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"))


def bitsandbytes_stand_in(monkeypatch) -> None:
    """A stand-in for bitsandbytes, which this machine lacks and a GPU cluster has: the classes PEFT looks up."""
    import importlib.machinery
    import sys
    import types

    import torch

    bnb = types.ModuleType("bitsandbytes")
    bnb.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)  # PEFT asks importlib whether it is installed
    bnb.nn = types.SimpleNamespace(
        **{name: type(name, (torch.nn.Linear,), {}) for name in ("Linear4bit", "Linear8bitLt")}
    )
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)


def test_a_qlora_dry_run_on_a_login_node_plans_the_gpu_job(tmp_path, capsys, monkeypatch):
    """`--load_in_4bit true` (QLoRA) needs a CUDA GPU, and its dry run on a login node without one was refused as a
    run there is ("load_in_4bit needs a CUDA GPU ...: remove --load_in_4bit"), though the dry run plans the GPU job;
    a run (or a dry run with --use_cpu true) without a GPU is still refused. Its summary said the weights load in the
    recipe's dtype, not a word of the 4 bits bitsandbytes holds the linear layers in."""
    bitsandbytes_stand_in(monkeypatch)
    qlora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "--load_in_4bit", "true"]
    args = [*SMOKE, "--output_dir", str(tmp_path / "run"), *qlora]
    assert field(dry_run(capsys, *args), "LoRA") == (
        "an adapter trains on q_proj (r 16, alpha 32, dropout 0); the model's weights stay frozen, the linear layers' "
        "in 4 bits (QLoRA: load_in_4bit)"
    )
    with pytest.raises(ConfigError, match=r"^load_in_4bit needs a CUDA GPU"):
        train_dpo.main([*args, "--use_cpu", "true", "--dry-run"])


def test_a_qlora_setting_bitsandbytes_refuses_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """`--bnb_4bit_quant_storage bf16` (transformers takes bfloat16) passed the dry run, and the job met
    BitsAndBytesConfig's ValueError as it built the trainer, once the data set had been read and tokenized."""
    bitsandbytes_stand_in(monkeypatch)
    qlora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "--load_in_4bit", "true"]
    args = [*SMOKE, "--output_dir", str(tmp_path / "run"), *qlora, "--bnb_4bit_quant_storage"]
    with pytest.raises(ConfigError) as refused:
        train_dpo.main([*args, "bf16", "--dry-run"])
    assert str(refused.value) == (
        "load_in_4bit: `bnb_4bit_quant_storage` must be a valid string (one of 'float16', 'float32', 'int8', 'uint8', "
        "'float64', 'bfloat16'): pass one of those, or remove the setting it names"
    )
    assert "LoRA:" in dry_run(capsys, *args, "bfloat16")


def test_half_weights_without_mixed_precision_are_said_to_compute_in_their_dtype(tmp_path, capsys):
    """`--dtype bfloat16` with `bf16: false` (no autocast) computes in bf16, the weights' own dtype, with no fp32 copy
    (a LoRA adapter trains: PEFT keeps it in fp32; full weights would be refused, `engine.check_half_weights`): the
    summary said "training computes in fp32"."""
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj"]
    for dtype, half in (("bfloat16", "bf16"), ("float16", "fp16")):
        text = dry_run(capsys, *SMOKE, *lora, "--output_dir", str(tmp_path / "run"), "--dtype", dtype)
        assert field(text, "model").endswith(
            f"weights load in {dtype}, training computes in {half} (the weights' dtype, without mixed precision: no "
            "fp32 copy of the weights)"
        )


def test_dtype_auto_is_recorded_as_the_dtype_the_weights_load_in(tmp_path, capsys, tiny_model_dir):
    """`--dtype auto` loads the weights in the dtype the model's config names: the summary said "weights load in auto",
    resolved_config.json recorded "auto", and the memory plan counted 2 bytes a weight for a float32 model."""
    from dpotrain.cluster import engine
    from dpotrain.plan import memory

    bf16_model = tmp_path / "bf16-model"
    shutil.copytree(tiny_model_dir, bf16_model)
    config = json.loads((bf16_model / "config.json").read_text())
    (bf16_model / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj"]  # a bf16 model's weights train in fp32
    for model, dtype, extra in ((tiny_model_dir, "float32", []), (str(bf16_model), "bfloat16", lora)):
        out = tmp_path / dtype
        args = [*SMOKE, "--model_name_or_path", model, "--dtype", "auto", *extra, "--output_dir", str(out)]
        assert f"weights load in {dtype}," in field(dry_run(capsys, *args), "model")
        assert json.loads((tmp_path / f"{dtype}.dry-run.json").read_text())["dtype"] == dtype
        recipe = config_mod.parse_args([*args])
        model_config = memory.model_config(recipe)[0]
        assert engine.model_dtype(recipe, model_config) == dtype
        assert memory.model_shape(recipe, model_config).load_bytes == (4 if dtype == "float32" else 2)


def test_smoke_summary_says_what_the_run_does_and_writes_the_json_beside_the_output_folder(tmp_path, capsys):
    out = tmp_path / "run"
    text = dry_run(capsys, *SMOKE, "--output_dir", str(out))
    assert f"dry run of {ROOT / 'configs' / 'smoke.yaml'}: nothing loaded, nothing trained\n" in text
    assert field(text, "model").startswith("builtin:tiny-olmo3; weights load in float32, training computes in fp32")
    assert field(text, "data") == "data/smoke_prefs.jsonl (split train): 384 rows"
    assert (
        field(text, "trained") == "every assistant turn of each side (assistant_turns all, as open-instruct trained "
        "OLMo 3)"
    )
    assert field(text, "steps") == "48 optimizer steps (1 epoch), 5 of warmup"  # 384 / 8, 10% warmup rounded up
    assert (
        field(text, "reference")
        == "all 384 pairs scored once before training (the reference stage, cached for later runs)"
    )
    assert field(text, "processes").startswith("1 (single process")
    assert field(text, "per step") == "8 pairs, over all processes"
    # The run's first half on the local data set: its step plan and forward, from the run's own seeded sample.
    assert field(text, "micro-batches").startswith("1-2 per step on each process (mean 1.042)")
    # the recipe's comment quotes the same range (it said 1-3, which no step of it has)
    spread = field(text, "micro-batches").split(" per step", 1)[0]
    assert f"steps of {spread} micro-batches" in (ROOT / "configs" / "smoke.yaml").read_text()
    assert "(at most 2,048 tokens of pairs, max_tokens_per_microbatch" in field(text, "micro-batches")
    assert field(text, "engine") == "one process (python train_dpo.py, no launcher)"
    assert field(text, "forward").startswith(
        "on this machine: shared prompts packing, balanced rows on sdpa (by the "
        "documented order, then the least work: est."
    )
    assert "this recipe trains in fp32" in field(text, "memory/GPU")  # the plan is for bf16 GPU runs: said why not
    written = tmp_path / "run.dry-run.json"
    assert field(text, "everything") == f"{written} (or --json prints it)"
    assert not out.exists()  # the real run must not find a folder the dry run made
    resolved = json.loads(written.read_text())
    assert resolved["derived"]["total_steps"] == 48 and resolved["dataset_name"] == "data/smoke_prefs.jsonl"
    # --json prints the same object and nothing else, for scripts (scripts/launch.sh).
    printed = dry_run(capsys, *SMOKE, "--output_dir", str(out), "--json")
    assert "dry run of" not in printed  # libraries may print a line of their own before the JSON
    printed = json.loads(printed[printed.index("{\n") :])
    assert printed == resolved


def test_a_short_run_says_how_many_pairs_the_reference_stage_scores(tmp_path, capsys):
    """Issue 53 item 8: `--max_steps 6` of 8 pairs scores the 48 pairs those steps train, not all 384; the dry run says
    so before the job is submitted (the run's record has the same count: derived.batching.pairs_trained)."""
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), "--max_steps", "6")
    assert field(text, "reference").startswith("48 of the 384 pairs (those the 6 planned steps train) scored once")
    resolved = json.loads((tmp_path / "run.dry-run.json").read_text())
    assert resolved["derived"]["batching"]["pairs_trained"] == {"pairs": 48, "of": 384, "steps": 6}


def test_the_summary_says_whether_health_guards_and_samples_watch_the_run(tmp_path, capsys):
    """Only resolved_config.json said whether the health guards were on: a run started with --health_checks false
    (or a recipe without samples) read like one that was watched, in the summary and in the run's own first lines."""
    out = ["--output_dir", str(tmp_path / "run")]
    watched = field(dry_run(capsys, *SMOKE, *out), "watching")
    assert watched == "health guards stop a doomed run (docs/health.md); no samples (samples_every 0)"
    args = ["--health_checks", "false", "--samples_every", "5", "--sample_prompts", "Hi", "Bye"]
    assert field(dry_run(capsys, *SMOKE, *out, *args), "watching") == (
        "no health guard (health_checks false); samples from 2 prompts every 5 steps"
    )


def test_the_record_says_step_1_is_logged_where_the_health_guards_log_it(tmp_path, capsys):
    """The step1 guard logs step 1 on its own, and resolved_config.json said logging_first_step false (transformers'
    default): metrics.jsonl began at step 1 under a record saying it would not."""
    for args, logged in (([], True), (["--health_checks", "false"], False)):
        dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), *args)
        assert json.loads((tmp_path / "run.dry-run.json").read_text())["logging_first_step"] is logged, args


def test_max_steps_past_an_epoch_says_the_epochs_its_steps_train(tmp_path, capsys):
    """`--max_steps 100` of the demo's 48 steps per epoch trains 2.08 epochs (the plan goes on into the next ones), and
    the model card said `num_train_epochs` 1 "(stopped at max_steps 100)": the epochs are counted with the plan. Many
    epochs are written as the plan's line and the steps write theirs (thousands separated, 3 decimals at most): the
    summary and the card said "2083.4 epochs" beside "100,003 optimizer steps" (format `g`: 6 digits, 1e+06 past).
    The many epochs are those of the demo's first 24 pairs, 3 steps an epoch: 3,001 steps are 1,000.333 epochs (format
    `g`: "1000.33"), where the demo's 384 pairs needed 100,003 steps, each planned (~3 CPU-s against ~0.3)."""
    from dpotrain.hub import hub
    from dpotrain.recipe import run_record

    few = tmp_path / "24_pairs.jsonl"
    few.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:24]))
    for steps, epochs, data in (("100", "2.083", ()), ("6", "0.125", ()), ("3,001", "1,000.333", (few,))):
        out = tmp_path / steps.replace(",", "")
        data_set = [arg for path in data for arg in ("--dataset_name", str(path))]  # none: the demo's 384 pairs
        text = dry_run(capsys, *SMOKE, *data_set, "--output_dir", str(out), "--max_steps", steps.replace(",", ""))
        assert field(text, "steps").startswith(f"{steps} optimizer steps ({epochs} epochs: max_steps), "), text
        resolved = json.loads((out.parent / f"{out.name}.dry-run.json").read_text())
        assert resolved["derived"]["batching"]["epochs_trained"] == float(epochs.replace(",", ""))
        card = hub.model_card(run_record.of(resolved), [])
        decides = f"max_steps {steps.replace(',', '')} decides the steps"
        assert f"| `num_train_epochs` | 1.0 ({decides}: {epochs} epochs trained) |" in card


@pytest.mark.parametrize(
    "n, said", [(1 / 30000, "0.0000333"), (0.0004, "0.0004"), (0.5, "0.5"), (3.0, "3"), (20833.3333, "20,833.333")]
)
def test_an_epoch_count_is_written_without_an_exponent_and_never_rounded_to_nothing(n, said):
    """`errors.decimal`: 3 decimals at most, thousands separated; a count those round to 0 kept its digits as format
    `g`'s "3.33e-05" (a `--max_steps 1` smoke run of a large data set: "3.33e-05 epochs", a reviewer's finding), and
    before that as "0"."""
    from dpotrain.recipe.errors import decimal

    assert decimal(n) == said


def test_a_fractional_number_of_warmup_steps_is_said_as_transformers_takes_it(tmp_path, capsys):
    """`--warmup_steps 1.5` (1 or more: steps, not a ratio) warms up over int(1.5) = 1 step (transformers'
    get_warmup_steps, and derived.warmup_steps); the summary's learning rate line said 1.5 warm-up steps, then "1
    warm-up steps"."""
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), "--warmup_steps", "1.5")
    assert field(text, "learning rate") == "0.0001; linear schedule with 1 warm-up step (warmup_steps 1.5)"
    assert field(text, "steps").startswith("48 optimizer steps (1 epoch), 1 of warmup")


@pytest.mark.parametrize("steps", ["2", "5"])
def test_a_short_run_records_the_micro_batches_of_the_steps_it_trains(steps, tmp_path, capsys):
    """`--max_steps 2` recorded (and its model card showed) the micro-batches of the whole epoch's 48 planned steps:
    1-2 per step, mean 1.042, of 4-8 pairs, where the 2 steps it trains have one of 8 pairs each. Counted over the
    steps trained, the micro-batches per step add up to a whole number, holding the steps' pairs, no more."""
    from dpotrain.hub import hub
    from dpotrain.recipe import run_record

    dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), "--max_steps", steps)
    resolved = json.loads((tmp_path / "run.dry-run.json").read_text())
    batching = resolved["derived"]["batching"]
    micro_batches = batching["micro_batches_per_step"]["mean"] * int(steps)
    assert micro_batches == pytest.approx(round(micro_batches), abs=1e-6), batching["micro_batches_per_step"]
    pairs = batching["pairs_per_micro_batch"]["mean"] * round(micro_batches)
    assert pairs == pytest.approx(8 * int(steps), abs=0.05 * round(micro_batches)), batching["pairs_per_micro_batch"]
    pairs = run_record.Spread.of(batching["pairs_per_micro_batch"])  # "8 pairs" where every micro-batch holds 8
    card = hub.model_card(run_record.of(resolved), [])
    assert f"| `per_device_train_batch_size` | {plural(pairs, 'pair')} per micro-batch" in card


@pytest.mark.slow
def test_a_login_node_dry_run_names_the_gpu_it_planned_for_and_how_to_plan_for_another(tmp_path, capsys):
    think = [
        "--config",
        str(ROOT / "configs" / "think.yaml"),
        "--model_name_or_path",
        OLMO3_7B,
        "--output_dir",
        str(tmp_path / "think"),
    ]
    text = dry_run(capsys, *think)
    model = field(text, "model")
    assert "7.30B parameters, 32 layers" in model
    assert model.endswith("weights load in bfloat16, training computes in bf16")  # DeepSpeed with bf16: what runs
    assert field(text, "engine").startswith("DeepSpeed ZeRO-2 (accelerate_config.yaml")
    # Planned for the forward the GPUs can take (FlexAttention's block masks, not sdpa's dense ones: 106.9 GiB).
    assert field(text, "memory/GPU").startswith("~98.1 GiB (model states 44.2,")
    assert field(text, "forward").startswith(
        "with FlashAttention 4 installed: one of shared prompts on "
        "flex_attention, unshared on flash_attention_4, unshared on "
        "flex_attention; without: "
    )
    assert field(text, "GPU") == "fits one 179.0 GiB GPU (B200), from gpu_memory_gib"  # the recipe's sizing
    assert field(text, "other GPUs").startswith("--gpu_memory_gib 79.6 (H100 80GB), 140.4 (H200), 179 (B200)")
    resolved = json.loads((tmp_path / "think.dry-run.json").read_text())
    assert resolved["dtype"] == "bfloat16" and resolved["bf16"] is True
    # The same job on 80 GB H100s is refused before submitting, with what would fit.
    with pytest.raises(ConfigError, match=r"needs ~98.1 GiB per GPU .* more than the 79.6 GiB GPU"):
        train_dpo.main([*think, "--gpu_memory_gib", "79.6", "--dry-run"])


def test_without_a_gpu_size_the_summary_says_nothing_was_checked_and_how_to_check(tmp_path, capsys):
    text = dry_run(
        capsys,
        "--config",
        str(ROOT / "configs" / "think.yaml"),
        "--model_name_or_path",
        OLMO3_7B,
        "--output_dir",
        str(tmp_path / "t"),
        "--gpu_memory_gib",
        "None",
    )
    assert field(text, "GPU").startswith("not checked: no GPU here and no gpu_memory_gib in the recipe")
    assert "--gpu_memory_gib: 79.6 (H100 80GB)" in field(text, "GPU")


def test_an_allocator_set_by_the_user_is_kept_and_the_summary_says_what_the_plan_assumed(tmp_path, capsys, monkeypatch):
    """The run sets expandable segments (docs/memory.md) only where the user set no allocator; one of the user's own
    is kept, recorded, and named beside the plan it was not planned for. The default is recorded, not shown."""
    think = ["--config", str(ROOT / "configs" / "think.yaml"), "--model_name_or_path", OLMO3_7B, "--output_dir"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")
    text = dry_run(capsys, *think, str(tmp_path / "own"))
    assert field(text, "allocator") == (
        "PYTORCH_ALLOC_CONF=max_split_size_mb:256: the plan's fragmentation allowance assumes expandable_segments:True"
    )
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    text = dry_run(capsys, *think, str(tmp_path / "default"))
    assert "allocator:" not in text
    recorded = json.loads((tmp_path / "default.dry-run.json").read_text())
    assert recorded["derived"]["memory"]["allocator"] == "PYTORCH_ALLOC_CONF=expandable_segments:True"


def test_the_summary_counts_the_rows_of_every_local_data_set_as_datasets_loads_them(tmp_path, capsys):
    """JSON Lines, a JSON array, CSV (a quoted answer spanning lines), Parquet, `save_to_disk` folders of one data set
    and of named splits: the dry run's row count is the one `datasets` loads, and its steps follow from it."""
    import datasets

    from dpotrain.data import data

    rows = [{"chosen": f"Q{i}\nA good answer,\nover lines", "rejected": f"Q{i}\nA bad one"} for i in range(40)]
    table = datasets.Dataset.from_list(rows)
    (tmp_path / "pairs.json").write_text(json.dumps(rows, indent=1))
    table.to_json(tmp_path / "pairs.jsonl")
    table.to_csv(tmp_path / "pairs.csv")
    table.to_parquet(tmp_path / "pairs.parquet")
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select(range(7))}).save_to_disk(str(tmp_path / "splits"))
    # The dry run counts the rows it loads (stages.py), as training does.
    for name in ("pairs.json", "pairs.jsonl", "pairs.csv", "pairs.parquet", "saved", "splits"):
        assert len(data.load_preference_dataset(str(tmp_path / name))) == 40, name
    assert len(data.load_preference_dataset(str(tmp_path / "splits"), "test")) == 7
    broken = tmp_path / "broken.json"  # the loader's one-line error, not a traceback
    broken.write_text('[{"chosen": "a",')
    with pytest.raises(ConfigError, match=r"broken.json:1: not valid JSON \(Expecting property name enclosed in"):
        data.load_preference_dataset(str(broken))
    assert len((tmp_path / "pairs.csv").read_text().splitlines()) > 41  # lines are not rows there
    text = dry_run(capsys, *SMOKE, "--dataset_name", str(tmp_path / "pairs.csv"), "--output_dir", str(tmp_path / "o"))
    assert field(text, "data") == f"{tmp_path / 'pairs.csv'} (split train): 40 rows"
    assert field(text, "steps").startswith("5 optimizer steps (1 epoch)")  # 40 pairs at the smoke recipe's 8


def test_num_train_epochs_rounded_up_to_whole_steps_says_the_epochs_the_steps_make(tmp_path, capsys):
    """`--num_train_epochs 1.5` of 3 steps an epoch trains 5 steps: the summary said "5 optimizer steps (1.5 epochs)"
    while the run's plan line said "1.667 epochs planned". Both say the epochs the steps make, and the 1.5 asked."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:24]))
    out = ["--output_dir", str(tmp_path / "o"), "--dataset_name", str(pairs)]
    text = dry_run(capsys, *SMOKE, *out, "--num_train_epochs", "1.5")  # 24 pairs at the smoke recipe's 8: 3 steps
    said = "5 optimizer steps (1.667 epochs: num_train_epochs 1.5 rounded up to whole steps), "
    assert field(text, "steps").startswith(said), text
    text = dry_run(capsys, *SMOKE, *out, "--num_train_epochs", "2")
    assert field(text, "steps").startswith("6 optimizer steps (2 epochs), "), text


def test_the_model_card_says_the_epochs_num_train_epochs_rounded_up_to_whole_steps_trained(tmp_path, capsys):
    """The card of a `--num_train_epochs 1.5` run of 3 steps an epoch said `num_train_epochs` 1.5 alone, while its 5
    steps trained 1.667 epochs (the Plan line's and the dry run's words): it says both, as they do."""
    from dpotrain.hub import hub
    from dpotrain.recipe import run_record

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:24]))
    out = tmp_path / "o"
    dry_run(capsys, *SMOKE, "--output_dir", str(out), "--dataset_name", str(pairs), "--num_train_epochs", "1.5")
    card = hub.model_card(run_record.of(json.loads((tmp_path / "o.dry-run.json").read_text())), [])
    trained = "1.667 epochs trained: num_train_epochs 1.5 rounded up to whole steps"
    assert f"| `num_train_epochs` | 1.5 ({trained}) |" in card, card


def test_a_mixture_of_one_source_is_said_in_the_singular(tmp_path, capsys):
    text = dry_run(
        capsys, *SMOKE, "--dataset_mixer_list", "data/smoke_prefs.jsonl", "0.5", "--output_dir", str(tmp_path)
    )
    assert field(text, "data") == "a mixture of 1 source: 192 rows"  # it said "1 sources"


@pytest.mark.slow  # 5-9 s on 2 cores: past the fast tier's ~2 s per test
@pytest.mark.parametrize("per_node", [4, 8])
def test_every_suggested_command_plans_the_world_size_it_names(tmp_path, capsys, monkeypatch, per_node):
    """Two nodes of 4 and of 8 GPUs (GPUS_PER_NODE, as scripts/launch.sh passes the job's --gpus-per-node): the summary
    plans in those nodes and offers the other node size only, and every sbatch line of a refusal, run as printed, gives
    the GPUs it names in nodes of the size planned."""
    from dpotrain import resolve
    from dpotrain.cluster import engine
    from dpotrain.plan import memory
    from dpotrain.recipe.config import parse_args

    think = [
        "--config",
        str(ROOT / "configs" / "think.yaml"),
        "--model_name_or_path",
        OLMO3_7B,
        "--output_dir",
        str(tmp_path / "think"),
    ]
    monkeypatch.setenv("WORLD_SIZE", str(2 * per_node))
    monkeypatch.setenv("GPUS_PER_NODE", str(per_node))
    text = dry_run(capsys, *think)
    assert field(text, "processes") == f"{2 * per_node} (environment (WORLD_SIZE)), 2 nodes of {per_node} GPUs"
    hints = re.findall(r"(\d+) nodes? of (\d+): WORLD_SIZE=(\d+) GPUS_PER_NODE=(\d+)", field(text, "other GPUs"))
    assert [(int(n), int(size)) for n, size, _, _ in hints] == [(2, 12 - per_node)]  # the other size, not this one
    recipe = parse_args([*think, "--gpu_memory_gib", "79.6", "--dry-run"])
    for nodes, size, world, gpus in hints:
        assert (world, gpus) == (str(int(nodes) * int(size)), size)
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("GPUS_PER_NODE", gpus)
        assert resolve.world_size(recipe, planning=True)[0] == int(world)
        assert engine.from_config(recipe.project.accelerate_config).gpus_per_node == int(size)

    # On 80 GB H100s ZeRO-2 does not fit 2 nodes: the refusal names what would, in nodes of the size planned.
    monkeypatch.setenv("GPUS_PER_NODE", str(per_node))
    with pytest.raises(ConfigError) as info:
        memory.plan(recipe, 2 * per_node)
    offers = re.findall(r"fits on (\d+) GPUs \((\d+) nodes?\)[^`]*\(~[\d.]+ GiB\): `([^`]*)`", str(info.value))
    assert len(offers) == 3, str(info.value)  # ZeRO-2 on more nodes, ZeRO-3, FSDP2
    for gpus, nodes, line in offers:
        launched = submitted(line, Path.cwd())  # run as pasted in the folder the dry run ran in
        world, gpus_per_node = launched["processes"], launched["processes"] // launched["machines"]
        assert (world, gpus_per_node) == (int(gpus), per_node) and world == int(nodes) * per_node, line
        monkeypatch.setenv("GPUS_PER_NODE", str(gpus_per_node))  # what launch.sh's own dry run then plans with
        assert engine.from_config(launched["config"]).gpus_per_node == per_node, line


@pytest.mark.slow  # 2.4 s: a dry run of a ZeRO-3 GPU plan
def test_fewer_processes_than_a_nodes_gpus_are_planned_as_the_one_node_that_runs_them(tmp_path, capsys, monkeypatch):
    """`WORLD_SIZE=8 GPUS_PER_NODE=16`: 8 GPUs of a 16-GPU node, the job scripts/launch.sh submits with
    --gpus-per-node=8. The summary said "1 node of 16 GPUs", the record 16 per node, and offered "1 node of 8:
    WORLD_SIZE=8 GPUS_PER_NODE=8" (this same job) as another node size."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("GPUS_PER_NODE", "16")
    argv = [*SMOKE, "--output_dir", str(tmp_path / "run"), "--accelerate_config", "configs/accelerate/zero3.yaml"]
    text = dry_run(capsys, *argv, "--bf16", "true", "--gpu_memory_gib", "80")
    assert field(text, "processes") == "8 (environment (WORLD_SIZE)), 1 node of 8 GPUs"
    assert "WORLD_SIZE=8 GPUS_PER_NODE=8" not in field(text, "other GPUs")
    derived = json.loads((tmp_path / "run.dry-run.json").read_text())["derived"]
    assert derived["memory"]["gpus_per_node"] == 8 and derived["data_parallel_size"] == 8


def test_a_dry_run_under_accelerate_launchs_one_process_plans_that_launch(tmp_path):
    """`accelerate launch --config_file one.yaml --num_processes 1 train_dpo.py ... --dry-run` (accelerate's simple
    launcher: one process, no process group, no LOCAL_RANK or WORLD_SIZE) planned the recipe's accelerate config, 4
    processes on DeepSpeed ZeRO-2, where the same launch's run trains 1 process without DeepSpeed ("engine: one process
    (this launch)"); under `accelerate_config: none` it said "python train_dpo.py, no launcher". The parent's command
    line says which launch this is (nothing in the environment says how many processes it runs): the dry run plans
    it. In a forked child: the process watches that launcher as the run's would (PR_SET_PDEATHSIG)."""
    from dpotrain.train import preemption

    launch = [PYTHON, str(Path(PYTHON).parent / "accelerate"), "launch", "--num_processes", "1", "train_dpo.py"]
    config = str(ROOT / "accelerate_config.yaml")

    def run():
        preemption.launcher_command = lambda: launch  # this process's parent: that launch
        train_dpo.main([*SMOKE, "--accelerate_config", config, "--output_dir", str(tmp_path / "o"), "--dry-run"])

    code, text, err = in_child(run, env={"WORLD_SIZE": None, "LOCAL_RANK": None, "RANK": None})
    assert code == 0, err[-3000:]
    assert field(text, "processes") == "1 (accelerate launch of one process)"
    assert field(text, "engine") == "one process (this launch)"


def test_the_dry_run_reads_the_accelerate_config_once(tmp_path, capsys, monkeypatch):
    """The launch's engine and its processes come from one read of the accelerate config (issue #54: `from_config`
    and `resolve.world_size` each read it), and the dry run still plans what the file says."""
    from dpotrain.cluster import engine

    reads = []
    real = engine.load_config_from_file
    monkeypatch.setattr(engine, "load_config_from_file", lambda path: reads.append(path) or real(path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # planned from the file, as outside a launcher
    config = str(ROOT / "accelerate_config.yaml")
    text = dry_run(capsys, *SMOKE, "--accelerate_config", config, "--output_dir", str(tmp_path / "o"))
    assert reads == [config]
    assert field(text, "processes").startswith("4 (predicted for `accelerate launch --config_file")
    assert field(text, "engine").startswith(f"DeepSpeed ZeRO-2 ({config}")


def test_an_accelerate_config_accelerate_would_refuse_is_refused_by_the_dry_run(tmp_path, capsys, monkeypatch):
    """The accelerate config is read with accelerate's own loader, as `accelerate launch` reads it: a key it does not
    know stops the launch, so the dry run that predicts it stops too, in one line with accelerate's reason (the engine
    alone is left unplanned with that reason)."""
    from dpotrain.cluster import engine
    from dpotrain.recipe.errors import run_cli

    bad = tmp_path / "accelerate.yaml"
    bad.write_text((ROOT / "accelerate_config.yaml").read_text() + "gpus_per_node: 4\n")
    assert "unknown keys (['gpus_per_node'])" in engine.from_config(str(bad)).source
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # planned from the file, as outside a launcher
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: dry_run(capsys, *SMOKE, "--accelerate_config", str(bad), "--output_dir", str(tmp_path / "o")))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and line.startswith(f"error: accelerate config {str(bad)!r} would be refused by"), line
    assert "unknown keys (['gpus_per_node'])" in line


@pytest.mark.parametrize(
    "template", [[], ["--chat_template_path", str(ROOT / "configs" / "templates" / "olmo_thinker.jinja")]]
)
def test_plain_text_pairs_are_said_to_train_without_a_template_on_the_completion(template, tmp_path, capsys):
    """Issue 53 item 20: text pairs (no message lists) go through no chat template and have no assistant turns; the
    summary and the model card said "the model's own" template and "every assistant turn" (smoke.yaml's
    assistant_turns all). They say what applies to plain text: no template, the completion after the prompt."""
    from dpotrain.hub.hub import model_card
    from dpotrain.recipe import run_record

    rows = [{"prompt": f"Q: {i} + {i} =", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."} for i in range(16)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = dry_run(capsys, *SMOKE, "--dataset_name", str(data), "--output_dir", str(tmp_path / "run"), *template)
    assert field(text, "template").startswith("none: the pairs are plain text, no chat template applies"), text
    assert ("chat_template_path is not used" in field(text, "template")) == bool(template)
    assert field(text, "trained") == (
        "the completion after the prompt (plain text has no assistant turns: assistant_turns does not apply)"
    )
    card = model_card(run_record.read(tmp_path / "run.dry-run.json"), [])
    assert "| chat template | none (the pairs are plain text) |" in card


def test_the_summary_shows_what_the_run_trains_in_one_block_and_why_a_cpu_run_has_no_time_estimate(tmp_path, capsys):
    """Loss, learning rate and schedule, steps, clipping, turns and template, read from the record the run keeps."""
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"))
    rows = [line.split(":")[0].strip() for line in text.splitlines()[1:] if line.startswith("  ")]
    block = ["template", "trained", "loss", "learning rate", "steps", "clipping", "time"]
    assert rows[rows.index("template") : rows.index("template") + len(block)] == block, rows  # together, clipping once
    assert field(text, "loss") == "sigmoid_norm, beta 5"
    assert field(text, "learning rate") == "0.0001; linear schedule with 10% warm-up (warmup_steps 0.1)"
    assert field(text, "time") == (
        "not estimated: this recipe computes in fp32, a CPU run (the estimate is a GPU's: its peak FLOP/s)"
    )
    text = dry_run(
        capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), "--loss_type", "sigmoid", "robust", "--loss_weights",
        "0.5", "0.5", "--label_smoothing", "0.1", "--learning_rate", "3e-5", "--lr_scheduler_type", "cosine",
        "--warmup_steps", "2",
    )  # fmt: skip
    assert field(text, "loss") == "0.5 x sigmoid + 0.5 x robust, beta 5, label_smoothing 0.1"  # robust's option
    assert field(text, "learning rate") == "3e-05; cosine schedule with 2 warm-up steps (warmup_steps 2)"
    assert field(text, "steps") == "48 optimizer steps (1 epoch), 2 of warmup"


@pytest.mark.slow
def test_a_gpu_dry_run_estimates_the_reference_stage_and_the_steps_and_think_names_olmo3s_learning_rate(
    tmp_path, capsys, tiny_model_dir
):
    """OLMo 3 7B's shape with a tokenizer (the tiny model's) on the bundled pairs: the step plan is made, so the time
    row holds the documented rule: tokens x 6 x parameters / (GPUs x peak x MFU); the reference's forward a third."""
    import shutil
    from pathlib import Path

    model = tmp_path / "olmo3-7b-with-tokenizer"
    model.mkdir()
    shutil.copy(Path(OLMO3_7B) / "config.json", model)
    for f in [*Path(tiny_model_dir).glob("tokenizer*"), Path(tiny_model_dir) / "chat_template.jinja"]:
        shutil.copy(f, model)
    args = ["--config", str(ROOT / "configs" / "instruct.yaml"), "--model_name_or_path", str(model)]
    text = dry_run(capsys, *args, "--dataset_name", str(ROOT / "data" / "smoke_prefs.jsonl"), "--report_to", "none",
                   "--output_dir", str(tmp_path / "i"))  # fmt: skip
    time = field(text, "time")
    said = re.fullmatch(
        r"est\. ~(\d+) s reference stage \+ ~(\d+) s for 3 steps: ~([\d,]+) tokens x 6 x 7\.30B parameters \(the "
        r"reference's forward: 2 x\) / \(4 GPUs x 989 TFLOP/s \(H100 80GB\) x 25% MFU, the lowest this project "
        r"measured\): an estimate, not a measurement",
        time,
    )
    assert said, time
    tokens = int(said[3].replace(",", ""))
    per_step = int(re.match(r"~([\d,]+) ", field(text, "tokens/step"))[1].replace(",", ""))
    assert abs(tokens - 3 * per_step) <= 3  # the planned steps' tokens, as the tokens/step row counts them
    resolved = json.loads((tmp_path / "i.dry-run.json").read_text())
    params = resolved["derived"]["memory"]["model"]["parameters"]
    assert int(said[2]) == round(tokens * 6 * params / (4 * 989e12 * 0.25))  # the rule, from the recorded values
    assert int(said[1]) == round(tokens * 2 * params / (4 * 989e12 * 0.25))

    # think.yaml trains at the product's 1e-6, not OLMo 3 7B Think's 8e-8: said by the rate, with the flag that
    # reproduces it, which does; given that flag, the note no longer tells it to pass it (it did: "8e-08 (OLMo 3 7B
    # Think used 8e-8: --learning_rate 8e-8 reproduces it)").
    think = ["--config", str(ROOT / "configs" / "think.yaml"), "--model_name_or_path", OLMO3_7B]
    text = dry_run(capsys, *think, "--output_dir", str(tmp_path / "t"))
    assert field(text, "learning rate").startswith(
        "1e-06 (OLMo 3 7B Think used 8e-8: --learning_rate 8e-8 reproduces it); linear schedule with 10% warm-up"
    )
    text = dry_run(capsys, *think, "--output_dir", str(tmp_path / "t"), "--learning_rate", "8e-8")
    assert json.loads((tmp_path / "t.dry-run.json").read_text())["learning_rate"] == 8e-8
    assert field(text, "learning rate").startswith("8e-08 (OLMo 3 7B Think used 8e-8); linear schedule")


@pytest.mark.slow
def test_the_reference_stage_of_a_run_of_several_epochs_is_estimated_over_one_epoch(tmp_path, capsys, tiny_model_dir):
    """The stage scores each pair the steps train once, whatever the epochs: `--num_train_epochs 3` said ~3x its time
    (the 3 epochs' tokens x 2 x parameters). The steps' estimate is the 3 epochs'; the stage's, one epoch's."""
    model = tmp_path / "olmo3-7b-with-tokenizer"
    model.mkdir()
    shutil.copy(Path(OLMO3_7B) / "config.json", model)
    for f in [*Path(tiny_model_dir).glob("tokenizer*"), Path(tiny_model_dir) / "chat_template.jinja"]:
        shutil.copy(f, model)
    args = ["--config", str(ROOT / "configs" / "instruct.yaml"), "--model_name_or_path", str(model), "--report_to"]
    args += ["none", "--dataset_name", str(ROOT / "data" / "smoke_prefs.jsonl"), "--num_train_epochs", "3"]
    time = field(dry_run(capsys, *args, "--output_dir", str(tmp_path / "i"), "--gpu_memory_gib", "80"), "time")
    said = re.fullmatch(
        r"est\. ~(\d+) s reference stage \+ ~(\d+) s for \d+ steps: ~([\d,]+) tokens x 6 x 7\.30B parameters \(the "
        r"reference's forward: 2 x, of 1 of the 3 epochs: each pair is scored once\) / .*",
        time,
    )
    assert said, time
    params = json.loads((tmp_path / "i.dry-run.json").read_text())["derived"]["memory"]["model"]["parameters"]
    tokens = int(said[3].replace(",", ""))
    assert int(said[2]) == round(tokens * 6 * params / (4 * 989e12 * 0.25))  # the steps: every epoch's tokens
    assert int(said[1]) == round(tokens / 3 * 2 * params / (4 * 989e12 * 0.25))  # the stage: one epoch's


def unrecorded_refusals(capsys, *args) -> list[str]:
    """The refusals a dry run of the demo with ARGS lists, where it writes no record beside a folder it refuses."""
    said = dry_run(capsys, *SMOKE, *args)
    assert "everything:    not written beside a folder the run refuses (--json prints it)" in said, said
    return [line for line in said.splitlines() if line.startswith("warning: the run would refuse: ")]


def test_an_output_dir_on_a_file_system_this_machine_lacks_is_refused_by_name_and_never_made(capsys, monkeypatch):
    """`--output_dir /lustre/me/run` where this machine has no /lustre (a compute node's file system seen from a login
    node, a container without its bind mount, a typo): the run probed `/`, the nearest folder there, and said it
    "cannot write in /"; to root it made /lustre in the root file system (a container's, lost with it) and trained
    there. Now it names the folder missing; a dry run outside a job lists it, saying the job's own dry run checks it on
    its node, and writes no record."""
    from dpotrain.recipe.errors import run_cli

    top = Path(f"/dpotrain-test-missing-{os.getpid()}")
    out = top / "me" / "run"
    assert not top.exists()
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    refusal = (
        f"output_dir '{out}': {top} does not exist on this machine (a file system not mounted here, or a typo): pass "
        "--output_dir a folder on a file system this node has"
    )
    try:
        assert unrecorded_refusals(capsys, "--output_dir", str(out)) == [
            f"warning: the run would refuse: {refusal}; if the job's nodes mount it, the job's own dry run checks it "
            "there"
        ]
        with pytest.raises(SystemExit) as ended:
            run_cli(lambda: train_dpo.main([*SMOKE, "--output_dir", str(out), "--max_steps", "1"]))
        assert ended.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {refusal}"
        assert not top.exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_dry_run_into_a_folder_under_a_file_says_the_runs_refusal_and_writes_nothing(tmp_path, capsys):
    """`--output_dir notes.txt/run`, a folder under a file: the run refuses it ("cannot write in ... (Not a
    directory)"). The dry run ended in FileExistsError's traceback writing its record beside the folder; then it said
    the run would refuse "notes.txt/run/run_files.json is unreadable (NotADirectoryError ...): it is the record of the
    run already in that folder", of a folder that cannot exist, and stopped on its own record's write. Now the run's
    refusal alone, and no record written (`--json` prints it)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file\n")
    out = notes / "run"
    assert unrecorded_refusals(capsys, "--output_dir", str(out)) == [
        f"warning: the run would refuse: output_dir '{out}': cannot write in {notes} (Not a directory): pass "
        "--output_dir a folder this job can write in"
    ]
    assert notes.read_text() == "a user's file\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_keep_end_plans_the_pairs_whose_prompt_fills_max_length_as_trl_keeps_them(tmp_path, capsys):
    """TRL drops a pair whose prompt alone fills max_length under keep_start only; keep_end cuts its start and trains
    it. The forward's cost and the step plan dropped them under keep_end too: with every prompt that long, a
    ZeroDivisionError traceback (cost.decide on no pairs) from the dry run and the run."""
    from dpotrain.data import builtin

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(16, seed=3)))
    argv = [*SMOKE, "--dataset_name", str(path), "--output_dir", str(tmp_path / "run"), "--pairs_per_step", "2"]
    argv += ["--truncation_mode", "keep_end", "--max_length", "16", "--json"]  # shorter than every prompt
    printed = dry_run(capsys, *argv)
    batching = json.loads(printed[printed.index("{\n") :])["derived"]["batching"]
    assert batching["pairs_trained"] == {"pairs": 16, "of": 16, "steps": 8}
    assert batching["max_length_cuts"]["dropped"] == 0 and batching["max_length_cuts"]["truncated"] == 16
    assert batching["positions_per_micro_batch"]["mean"] == 2 * 2 * 16  # two pairs of two sides, each cut to 16


def test_the_max_length_line_says_whose_it_is(tmp_path, capsys):
    """`--max_length 512` on the command line over the smoke recipe's 1024, or a recipe without one (TRL's default):
    the summary said "(the recipe's)" of both."""

    def whose(*args) -> str:
        return field(dry_run(capsys, *args, "--output_dir", str(tmp_path / "run")), "max length").split(";")[0]

    assert whose(*SMOKE, "--max_length", "512") == "512 (the command line's)"
    assert whose(*SMOKE) == "1024 (the recipe's)"
    recipe = tmp_path / "no_max_length.yaml"
    smoke = (ROOT / "configs" / "smoke.yaml").read_text().splitlines(keepends=True)
    recipe.write_text("".join(line for line in smoke if not line.startswith("max_length:")))
    assert whose("--config", str(recipe)) == "1024 (TRL's default)"


def test_a_max_length_cleared_on_the_command_line_is_said_so(tmp_path, capsys):
    """`--max_length null` over the smoke recipe's 1024: the summary said "none: the recipe sets no max_length", though
    the recipe sets one and the command line cleared it."""
    args = ["--max_length", "null", "--max_tokens_per_microbatch", "null", "--output_dir", str(tmp_path / "run")]
    assert field(dry_run(capsys, *SMOKE, *args), "max length") == "none: the command line's --max_length null"


def cut_warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ") and "cut or dropped" in line]


def dry_run_warnings(capsys, *args) -> list[str]:
    train_dpo.main([*args, "--dry-run"])
    return cut_warnings(capsys.readouterr().err)


def test_a_max_length_that_cuts_more_pairs_than_the_analyzers_rule_says_so_once_naming_the_length_it_would_pass(
    tmp_path, capsys, monkeypatch
):
    """`--max_length 64` on the CPU demo cut 310 of its 384 pairs without a word (only fewer than half keeping a
    difference is refused): more than 1 - auto_coverage (5%) cut or dropped is one warning line naming the analyzer's
    length, or auto. The demo's own max_length cuts none, and `auto` is chosen to leave 95% whole: both quiet."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))  # the pairs measured here, not a cache's
    out = ["--output_dir", str(tmp_path / "run")]
    assert dry_run_warnings(capsys, *SMOKE, *out, "--max_length", "64") == [
        "warning: more than 5% of the pairs are cut or dropped at max_length 64 (a seeded sample of 384 of 384 rows, "
        "tokenized as the trainer does): 310 of 384 pairs cut (keep_start: their end), 0 dropped (prompt alone fills "
        "max_length); pass --max_length 512 (the smallest multiple of 512 that leaves 95% of these pairs whole) or "
        "--max_length auto (docs/max_length.md)"
    ]
    for quiet in ([], ["--max_length", "512"], ["--max_length", "auto"]):  # 0, 2 (0.5%) of 384 cut; auto: 512
        assert dry_run_warnings(capsys, *SMOKE, *out, *quiet) == [], quiet


def test_the_runs_first_half_says_it_on_the_main_process_only(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A run (not a dry run) says it at its lengths stage, before the model loads, on the launch's first process."""
    from dpotrain import stages
    from dpotrain.plan import memory

    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    words = [*SMOKE, "--model_name_or_path", tiny_model_dir, "--max_length", "64", "--output_dir", str(tmp_path)]
    recipe = config_mod.parse_args(words)
    launch = stages.checks(recipe)
    pairs = stages.load_data(recipe, launch, say=False)
    model = memory.model_config(recipe, tiny_model_dir, local_only=False)[0]
    capsys.readouterr()
    for rank, said in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        stages.measure_lengths(recipe, launch, pairs, tiny_model_dir, model)
        assert len(cut_warnings(capsys.readouterr().err)) == said, rank


def test_the_micro_batch_line_tells_the_token_budget_from_the_positions_it_lays_out(tmp_path, capsys):
    """A hunt: the CPU demo's summary read "~1,590 positions each (at most 2,048)" where its own record's widest
    micro-batch lays out 2,290 positions: the budget counts the pairs' tokens, the positions the rows' padding too.
    The line now says which is which, and the widest micro-batch where it passes the budget.
    In bf16 the memory plan plans the budget's positions, so a run on sdpa keeps its rows within it: one laid them past
    what its plan held (the demo's 2,290 positions; 7B-wide, 19,295 positions for 16,384)."""
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"))
    record = json.loads((tmp_path / "run.dry-run.json").read_text())["derived"]["batching"]
    widest, budget = record["positions_per_micro_batch"]["max"], record["max_tokens_per_microbatch"]
    assert widest > budget  # the demo's plan (fp32, memory not planned): balanced rows padded past the budget
    assert field(text, "micro-batches").endswith(
        f"positions each (at most {budget:,} tokens of pairs, max_tokens_per_microbatch; up to {widest:,} positions "
        "with the rows' padding)"
    ), text
    bf16 = ["--bf16", "true", "--attn_implementation", "sdpa", "--output_dir", str(tmp_path / "bf16")]
    text = dry_run(capsys, *SMOKE, *bf16)
    capped = json.loads((tmp_path / "bf16.dry-run.json").read_text())["derived"]["batching"]
    assert capped["positions_per_micro_batch"]["max"] <= budget < widest
    assert field(text, "micro-batches").endswith(f"(at most {budget:,} tokens of pairs, max_tokens_per_microbatch)")


def test_a_count_of_one_reads_in_the_singular(tmp_path, capsys):
    """One pair per step, one sample prompt, every step, an epoch's worth of max_steps: the summary said "1 pairs",
    "1 prompts every 1 steps", "1 epochs" and "1-1 per step ... (mean 1.0)", the model card "1 epochs trained"."""
    from dpotrain.hub import hub
    from dpotrain.recipe import run_record

    argv = ["--output_dir", str(tmp_path / "run"), "--pairs_per_step", "1", "--max_steps", "384"]
    text = dry_run(capsys, *SMOKE, *argv, "--sample_count", "1", "--samples_every", "1")
    assert field(text, "steps").startswith("384 optimizer steps (1 epoch: max_steps), "), text
    assert field(text, "watching").endswith("; samples from up to 1 prompt every step"), text
    assert field(text, "per step") == "1 pair, over all processes"
    assert re.fullmatch(
        r"1 per step on each process, ~\d+ positions each \(at most 2,048 tokens of pairs, max_tokens_per_microbatch\)",
        field(text, "micro-batches"),
    )
    card = hub.model_card(run_record.of(json.loads((tmp_path / "run.dry-run.json").read_text())), [])
    assert "| `num_train_epochs` | 1.0 (max_steps 384 decides the steps: 1 epoch trained) |" in card


def test_the_steps_are_counted_on_the_pairs_trl_keeps(tmp_path, capsys):
    """TRL drops a pair whose prompt alone fills max_length (keep_start): 4 of 16 rows here, so the run trains 3 steps
    of 4 pairs with 1 of warm-up (0.3 of 3, rounded up), as its step plan says. The dry run said 4 steps and 2 of
    warm-up, counted on the rows."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(16, seed=3)
    for row in rows[:4]:  # a prompt past the smoke recipe's max_length of 1024
        for side in ("chosen", "rejected"):
            row[side][-2]["content"] += " word" * 1500  # the user turn before the answer: the prompt's last
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*SMOKE, "--dataset_name", str(path), "--output_dir", str(tmp_path / "run")]
    text = dry_run(capsys, *argv, "--pairs_per_step", "4", "--warmup_steps", "0.3")
    assert field(text, "steps") == "3 optimizer steps (1 epoch), 1 of warmup"
    # and says why there are 12 pairs of the 16 rows (it was in the record alone: "max length: 1024 (the recipe's)")
    cut = "0 of 16 pairs cut (keep_start: their end), 4 dropped (prompt alone fills max_length)"
    assert field(text, "max length") == f"1024 (the recipe's); {cut}"
    derived = json.loads((tmp_path / "run.dry-run.json").read_text())["derived"]
    assert derived["batching"]["pairs_trained"] == {"pairs": 12, "of": 12, "steps": 3}
    assert (derived["dataset_rows"], derived["total_steps"], derived["warmup_steps"]) == (16, 3, 1)


def test_the_per_step_row_says_the_pairs_the_steps_take(tmp_path, capsys):
    """3 of 6 rows kept (keep_start drops a pair whose prompt alone fills max_length) at pairs_per_step 8: the one step
    trains 3 pairs, and the summary said "per step: 8 pairs". The setting keeps its fields (pairs_per_step, 8); the
    plan's count is derived.batching.pairs_per_step_trained."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(6, seed=3)
    for row in rows[3:]:  # a prompt past the smoke recipe's max_length of 1024
        for side in ("chosen", "rejected"):
            row[side][-2]["content"] += " word" * 1500
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*SMOKE, "--dataset_name", str(path), "--output_dir", str(tmp_path / "run"), "--warmup_steps", "0"]
    text = dry_run(capsys, *argv, "--pairs_per_step", "8")
    want = "3 pairs, over all processes: pairs_per_step 8, but the 3 pairs training keeps (of 6 rows) are one step"
    assert field(text, "per step") == want
    resolved = json.loads((tmp_path / "run.dry-run.json").read_text())
    assert resolved["pairs_per_step"] == resolved["derived"]["pairs_per_step"] == 8
    assert resolved["derived"]["batching"]["pairs_per_step_trained"] == {"min": 3, "mean": 3.0, "max": 3}
    text = dry_run(capsys, *argv, "--pairs_per_step", "2")  # steps of 2, 1: the last takes what is left
    want = "1-2 pairs, over all processes: pairs_per_step 2, but an epoch of the 3 pairs training keeps (of 6 rows) "
    assert field(text, "per step") == want + "ends in a step of 1"
    # 384 rows in steps of 8 x 5 micro-batches, the last of 24; the batch flag's note after what the steps take
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "whole"), "--gradient_accumulation_steps", "5")
    want = "24-40 pairs, over all processes: pairs_per_step 40, but an epoch of 384 pairs ends in a step of 24; NOT "
    assert field(text, "per step").startswith(want + "the recipe's 8: --gradient_accumulation_steps on the command")
    # one pair (said "1 pairs, ...: but 1 pair are one step")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(rows[0]) + "\n")
    text = dry_run(
        capsys, *SMOKE, "--dataset_name", str(one), "--output_dir", str(tmp_path / "one"), "--max_steps", "2"
    )
    assert field(text, "per step") == "1 pair, over all processes: pairs_per_step 8, but 1 pair is one step"


def measured_rows(monkeypatch) -> list[int]:
    """The rows each `lengths.measure` call of this test tokenizes (the real call, counted)."""
    from dpotrain.data import lengths

    calls, measure = [], lengths.measure

    def counted(dataset, *args, **kwargs):
        calls.append(len(dataset))
        return measure(dataset, *args, **kwargs)

    monkeypatch.setattr(lengths, "measure", counted)
    return calls


@pytest.mark.parametrize("rows", [40, 1030])  # the seeded sample (1,024 rows) is all of the pairs, or part of them
def test_a_dry_run_tokenizes_each_pair_once(rows, tmp_path, capsys, monkeypatch):
    """Issue #54: the lengths stage measured its seeded sample and the step plan then measured every pair again, so a
    data set of at most 1,024 pairs (every test's, the demo's) was tokenized twice. The plan reads what was measured."""
    from dpotrain.data import builtin

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(rows, seed=1)))
    calls = measured_rows(monkeypatch)
    text = dry_run(capsys, *SMOKE, "--dataset_name", str(path), "--output_dir", str(tmp_path / "run"))
    assert calls == [rows]
    assert field(text, "max length").startswith(f"1024 (the recipe's); 0 of {rows:,} pairs cut")  # every pair planned


def test_a_sample_taken_from_every_pairs_lengths_is_the_sample_measured_alone():
    """A dry run measures every pair once and takes the seeded sample from them (`every`): the same rows, lengths and
    source as the sample measured alone, invalid rows left out of both."""
    import datasets

    from dpotrain.data import builtin, chat_template
    from dpotrain.forwards import sample

    pairs = builtin.make_preference_rows(30, seed=2)
    pairs[3]["chosen"] = []  # no answer: invalid: left out of both
    tokenizer = chat_template.apply(builtin.build_tokenizer(), None)
    table = datasets.Dataset.from_list(pairs)
    alone, none, _ = sample.measured_sample(table, tokenizer, seed=7, rows=10)
    taken, every, _ = sample.measured_sample(table, tokenizer, seed=7, rows=10, every=True)
    assert none is None and every.rows == 29 and len(every.invalid) == 1
    assert taken.source == alone.source
    for name in ("prompt", "chosen", "rejected", "shared"):
        assert getattr(taken, name).tolist() == getattr(alone, name).tolist(), name


def test_a_model_whose_config_cannot_be_read_is_planned_without_it_and_said_why(
    tmp_path, capsys, monkeypatch, tiny_model_dir
):
    """A dry run plans on from the data's lengths where the model's config.json cannot be read, and says why in the
    forward line; the project reads the config once for that (it read it a second time just for the reason's text)."""
    from transformers import AutoConfig

    from dpotrain.plan import memory

    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "olmo3", "hidden_size": ')  # cut off mid-write
    reads = []

    class Reads(AutoConfig):  # the project's own reads of a config (the tokenizer's are transformers' own)
        @classmethod
        def from_pretrained(cls, path, *args, **kwargs):
            reads.append(str(path))
            return AutoConfig.from_pretrained(path, *args, **kwargs)

    monkeypatch.setattr(memory, "AutoConfig", Reads)  # memory.model_config: the one reader
    text = dry_run(capsys, *SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"))
    assert field(text, "forward") == (
        f"at start, from the data's lengths (the config of '{model}' is not readable on this machine (OSError: It "
        f"looks like the config file at '{model}/config.json' is not a valid JSON file.))"
    )
    assert reads == [str(model)]


def test_fsdp2_on_one_cpu_process_is_named_for_what_runs(tmp_path, capsys, monkeypatch):
    """A CPU recipe launched with configs/accelerate/fsdp2.yaml on one process: accelerate leaves it
    DistributedType.NO (FSDP only on GPUs, and `engine.enable_on_cpu` for 2+ processes), so it trains as one plain
    process; the dry run said "engine: FSDP2" and "clipping: ... one norm over every rank's shards"."""
    from dpotrain.cluster import engine

    fsdp2 = [*SMOKE, "--output_dir", str(tmp_path / "run"), "--accelerate_config", "configs/accelerate/fsdp2.yaml"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    text = dry_run(capsys, *fsdp2)
    assert field(text, "engine") == (
        "one process (configs/accelerate/fsdp2.yaml: FSDP2 shards over GPUs, or over 2 or more CPU processes; one "
        "process on CPU runs unsharded)"
    )
    assert field(text, "clipping").endswith("by torch's clip_grad_norm_")
    monkeypatch.setenv("WORLD_SIZE", "2")  # enable_on_cpu makes two CPU processes FSDP2
    assert field(dry_run(capsys, *fsdp2), "engine") == "FSDP2 (configs/accelerate/fsdp2.yaml)"
    # On GPUs one process runs FSDP2 (accelerate launches it through torchrun: DistributedType.FSDP)
    planned = engine.from_config("configs/accelerate/fsdp2.yaml")
    assert engine.as_it_runs(planned, 1, on_gpus=True) is planned


def test_a_data_set_of_one_row_is_counted_in_the_singular(tmp_path, capsys):
    """The summary's data line read "(split train): 1 rows"."""
    one = tmp_path / "one.jsonl"
    one.write_text((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[0] + "\n")
    args = [*SMOKE, "--dataset_name", str(one), "--warmup_steps", "0", "--output_dir", str(tmp_path / "run")]
    assert field(dry_run(capsys, *args), "data") == f"{one} (split train): 1 row"


def test_a_model_whose_tokenizer_cannot_be_read_says_why_on_the_template_line(tmp_path, capsys, tiny_model_dir):
    """Issue #54: with tokenizer files present but a config.json cut off mid-write (transformers' tokenizer loader
    reads it), the template line said "its tokenizer is not on this machine", which sends the user looking for files
    that are there. It says the tokenizer could not be read, and why."""
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "olmo3", "hidden_size": ')
    text = dry_run(capsys, *SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"))
    assert field(text, "template") == (
        f"the model's own (its tokenizer could not be read here: OSError: It looks like the config file at "
        f"'{model}/config.json' is not a valid JSON file.)"
    )


def test_a_dry_run_whose_tokenizer_cannot_be_read_says_the_answers_were_not_checked(tmp_path, capsys, tiny_model_dir):
    """Issue #54: with the tokenizer files present but config.json cut off mid-write, the data stage checked the rows
    without the chat template (the answers against its generation prompt: not checked), and its line still said "the
    model's chat template", as though they had been. It says they were not, and why, in the template line's words."""
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "olmo3", "hidden_size": ')
    train_dpo.main([*SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"), "--dry-run"])
    said = capsys.readouterr().err  # the stages' lines: a dry run's stdout is its summary (or JSON) alone
    data = next(line for line in said.splitlines() if line.startswith("Data (train): "))
    assert data.endswith(
        "; the model's chat template (answers not checked against it: its tokenizer could not be read here: OSError: "
        f"It looks like the config file at '{model}/config.json' is not a valid JSON file.)"
    )


@pytest.mark.slow  # trains nothing, but starts the run's checks in this process (~3 s)
def test_a_run_whose_model_config_cannot_be_read_is_refused_before_the_rows_are_checked(tmp_path, tiny_model_dir):
    """Issue #54: a run with the tokenizer files present and config.json cut off is refused at the data stage's first
    message row, before the model loads; the line said "a model folder needs its tokenizer files ... beside
    config.json", files that are there. It names the file that cannot be read and says to copy the folder again."""
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "olmo3", "hidden_size": ')
    args = [*SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"), "--max_steps", "2"]
    with pytest.raises(ConfigError) as refused:
        train_dpo.main(args)
    assert str(refused.value) == (
        f"could not read the tokenizer of {str(model)!r} (OSError: It looks like the config file at "
        f"'{model}/config.json' is not a valid JSON file.): its files are here, but one cannot be read (cut off while "
        "it was written or copied?): copy the model's folder again, or download it again (hf download)"
    )
    assert not (tmp_path / "run").exists()


def tokenizer_loads(monkeypatch) -> list[str]:
    """What each tokenizer load or build of this test read (the real calls, counted)."""
    from dpotrain.data import builtin, lengths

    loads, load, build = [], lengths.load_tokenizer, builtin.build_tokenizer

    def loaded(name, *args, **kwargs):
        loads.append(name)
        return load(name, *args, **kwargs)

    def built(*args, **kwargs):
        loads.append("built")
        return build(*args, **kwargs)

    monkeypatch.setattr(lengths, "load_tokenizer", loaded)
    monkeypatch.setattr(builtin, "build_tokenizer", built)
    return loads


@pytest.mark.parametrize("model", ["folder", "builtin"])
def test_a_dry_run_loads_the_tokenizer_once(model, tmp_path, capsys, monkeypatch, tiny_model_dir):
    """Issue #54: the data stage's row check loaded (or, for a built-in model, built) the tokenizer, and the lengths
    stage loaded it again: seconds on a login node for a real model's tokenizer. The lengths stage takes the one the
    rows were checked against where it is the model's own, loaded from the same place. A built-in model built before
    (its folder exists) is read from its folder: it was built once and read twice."""
    name = tiny_model_dir if model == "folder" else "builtin:tiny-olmo3"  # built by the fixture: its folder exists
    loads = tokenizer_loads(monkeypatch)
    text = dry_run(capsys, *SMOKE, "--model_name_or_path", name, "--output_dir", str(tmp_path / "run"))
    assert loads == [tiny_model_dir]
    assert re.fullmatch(r"the model's own \(sha256 [0-9a-f]{12}\)", field(text, "template"))


@pytest.mark.slow  # trains 2 steps in this process
def test_a_run_loads_the_tokenizer_once(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """Issue #54: a real run loaded the tokenizer for the row check (the lengths stage reused it), then again for the
    trainer: seconds per rank for a real model's tokenizer. The trainer takes a copy of the first half's."""
    loads = tokenizer_loads(monkeypatch)
    out = tmp_path / "run"
    args = [*SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "2"]
    assert train_dpo.main([*args, "--save_strategy", "no"]) in (0, None)
    assert loads == [tiny_model_dir]
    assert (out / "chat_template.jinja").is_file()  # the tokenizer the trainer saved with the model


# What a dry run (each Slurm job start runs one) imports without using: BENCHMARKS.md, "What a dry run imports that it
# does not use". The rest of its imports (torch._dynamo, peft, torch.distributed.checkpoint, ...) parsing any recipe
# imports (TRL's DPOConfig), so they are not listed.
UNUSED_BY_A_DRY_RUN = ("deepspeed", "wandb", "matplotlib", "trl.trainer.dpo_trainer", "dpotrain.train.trainer")


@pytest.mark.slow  # starts the stack in a fresh interpreter (its imports ~6 CPU-s): 12.8 s in CI's ci47
def test_a_refusal_and_a_dry_run_import_only_what_each_uses(tmp_path, tiny_model_dir):
    """A refusal (and --help) needs the parser, not the data: `datasets` (with pandas and pyarrow, ~1.5 CPU-s) was
    imported by train_dpo.py's own imports (trl.data_utils at the top of data/shapes.py, datasets.config in
    cluster/offline.py and recipe/hub_switches.py) before the one line printed. A dry run imports what parsing the
    recipe and reading the data need, and not DeepSpeed (0.38 s), W&B with report_to none, the plot's matplotlib or the
    trainer: an import at a module's top would add it to every job start.
    One fresh interpreter for both (this one has imported everything; each start imports the stack, ~6 CPU-s): the
    refusal first, then the dry run, whose modules are then a superset of its own alone, so none of those it must not
    import can hide. A built model's folder (building one saves it with transformers, whose save imports DeepSpeed)."""
    refused = [*SMOKE, "--beta", "-1"]
    args = [*SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run"), "--dry-run"]
    code = (
        "import sys, train_dpo\n"
        "from dpotrain.recipe.errors import ConfigError\n"
        "try:\n"
        f"    train_dpo.main({refused!r})\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
        "print('loaded:', *sorted({'datasets', 'pandas', 'pyarrow', 'deepspeed', 'wandb'} & set(sys.modules)))\n"
        f"train_dpo.main({args!r})\n"
        f"print('loaded:', *sorted(set({UNUSED_BY_A_DRY_RUN!r}) & set(sys.modules)))\n"
    )
    out = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "refused: beta must be > 0" in out
    lines = out.splitlines()
    refused_at = next(i for i, line in enumerate(lines) if line.startswith("refused: "))
    assert lines[refused_at + 1] == "loaded:", out  # what the refusal alone imported
    assert "nothing loaded, nothing trained" in out  # the dry run ran to its summary
    assert lines[-1] == "loaded:", out


def test_a_built_in_models_first_dry_run_builds_its_tokenizer_once(tmp_path, capsys, monkeypatch):
    """The built-in model's very first run built its tokenizer for the row check, built it again to save the model's
    folder, then loaded it from that folder for the lengths: one tokenizer, made three times. The row check's is saved
    in the folder and measures the lengths."""
    monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", str(tmp_path / "builtin"))  # nothing built yet
    loads = tokenizer_loads(monkeypatch)
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"))
    assert loads == ["built"]
    assert [p.parent.name for p in (tmp_path / "builtin").glob("*/tokenizer.json")] == ["tiny-olmo3-v1"]
    again = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"))  # read from the folder: the same tokenizer
    assert loads == ["built", str(tmp_path / "builtin" / "tiny-olmo3-v1")]
    assert field(again, "template") == field(text, "template")


def test_a_dry_run_says_where_datasets_copied_the_pairs_and_how_much_it_takes(tmp_path, capsys, monkeypatch):
    """A data set's first dry run writes datasets' Arrow copy of its pairs into HF_DATASETS_CACHE (895 MB for 50k
    thinking pairs, ~4.7 GB for 260k) without a word: a home quota on a login node filled unannounced. The summary
    names the folder datasets reports (`cache_files`) and the size of what is in it, measured."""
    from dpotrain.data import data
    from dpotrain.recipe.errors import size

    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))  # nothing of this project's: not named
    pairs = tmp_path / "pairs.jsonl"
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", pairs)  # a file no test read before: copied now
    text = dry_run(capsys, *SMOKE, "--dataset_name", str(pairs), "--output_dir", str(tmp_path / "run"))
    folder = Path(data.load_preference_dataset(str(pairs), say=False).cache_files[0]["filename"]).parent
    written = sum(f.stat().st_size for f in folder.iterdir())
    assert field(text, "caches") == (
        f"{size(written)} in {folder} (datasets' copy of the pairs as Arrow, made at their first read, and its maps: "
        "HF_DATASETS_CACHE or HF_HOME places it elsewhere)"
    )
    assert written > (ROOT / "data" / "smoke_prefs.jsonl").stat().st_size / 2  # the copy, not a record of it


@pytest.mark.parametrize("given", ["dataset_name", "a mixture source's data_files"])
def test_a_datasets_cache_without_room_for_the_copy_is_refused_before_it_is_written(given, tmp_path):
    """datasets copies a local data file into HF_DATASETS_CACHE at its first read; on a disk without room for it the
    dry run said "could not read dataset file '...pairs.jsonl': DatasetGenerationError: An error occurred while
    generating the dataset", naming the data file, not the cache. The dry run (and the run, the analyzer: the same
    load) refuses in one line that names the cache and the fix, before the copy starts. The command as its process
    ends it (`run_cli`), in a forked child with a real 1 MiB disk under the cache (`in_child`), not a fresh
    interpreter that imported the stack again for a refusal."""
    from dpotrain.recipe.errors import run_cli, size

    disk = tmp_path / "disk"
    disk.mkdir()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text((ROOT / "data" / "smoke_prefs.jsonl").read_text() * 4)  # 1.7 MB of pairs
    data, read = ["--dataset_name", str(pairs)], [pairs]
    if given != "dataset_name":  # two files: read by datasets' json builder, not the one-file loader
        read.append(tmp_path / "more.jsonl")
        read[1].write_text((ROOT / "data" / "smoke_prefs.jsonl").read_text())
        data = ["--datasets", json.dumps({"path": "json", "data_files": [str(f) for f in read]})]
    args = [*SMOKE, *data, "--output_dir", str(tmp_path / "run"), "--dry-run"]
    env = {"HF_DATASETS_CACHE": str(disk / "datasets")}
    code, _, stderr = in_child(lambda: run_cli(lambda: train_dpo.main(args)), tmpfs=[(disk, "1m")], env=env)
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"error: the datasets cache {disk / 'datasets'} has 1.0 MiB free, and datasets first copies the data set's "
        f"{size(sum(f.stat().st_size for f in read))} of files into it (as Arrow, about their size): set "
        "HF_DATASETS_CACHE (or "
        "HF_HOME) to a folder on a disk with room, or make room there"
    )


def test_a_run_that_pushes_says_where_and_when_before_it_is_submitted(tmp_path, capsys, monkeypatch):
    """A dry run with --push_to_hub named no repo anywhere in its summary: a mistyped hub_model_id (or a public repo
    meant private) was seen only once the job had trained for hours. The summary says where and when; offline, that
    nothing is pushed during the run and the command that pushes it, quoted
    for a shell."""
    monkeypatch.setenv("HF_TOKEN", "hf_placeholder")  # a dry run checks no access
    from huggingface_hub import constants

    # online, as a login node is: the switch huggingface_hub read at import (the suite runs with HF_HUB_OFFLINE=1)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    out = str(tmp_path / "my runs" / "run")  # pasted into a shell: the command quotes it
    base = ["--config", "configs/smoke.yaml", "--output_dir", out, "--push_to_hub", "--hub_model_id", "me/olmo-dpo"]
    assert "push" not in re.findall(
        r"^  (\w+):", dry_run(capsys, "--config", "configs/smoke.yaml", "--output_dir", out), re.M
    )
    assert field(dry_run(capsys, *base, "--hub_private_repo", "true"), "push") == (
        "the final model to me/olmo-dpo (private) on the Hub once training ends"
    )
    assert field(dry_run(capsys, *base, "--push_checkpoints", "true"), "push") == (
        "the final model to me/olmo-dpo on the Hub once training ends; each checkpoint's model to a branch step-<N> "
        "as it is saved"
    )
    assert field(dry_run(capsys, *base[:-2]), "push") == (  # no hub_model_id: the run's name, in the token's account
        "the final model to <the token's account>/run on the Hub once training ends"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    quoted = shlex.quote(out)
    assert field(dry_run(capsys, *base), "push") == (
        f"nothing during the run (HF_HUB_OFFLINE): `python scripts/push_to_hub.py {quoted}`, where the Hub is reached, "
        "pushes the final model to me/olmo-dpo"
    )
    # The checkpoints asked for are in the command: without --checkpoints it pushed main alone, exit 0
    assert field(dry_run(capsys, *base, "--push_checkpoints", "true"), "push") == (
        f"nothing during the run (HF_HUB_OFFLINE): `python scripts/push_to_hub.py {quoted} --checkpoints`, where the "
        "Hub is reached, pushes the final model to me/olmo-dpo, and each checkpoint still on disk to a branch step-<N>"
    )


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without a GPU, as a login node")
def test_tf32_is_planned_by_a_dry_run_without_a_gpu_and_refused_by_a_run_there(tmp_path):
    """`tf32: true` in a GPU recipe: transformers' "--tf32 requires Ampere" refused the dry run on a CPU login node,
    where it plans the GPU job (bf16's check was skipped there, tf32's not). The dry run takes it, without switching its
    own process to TF32; a run on this machine is still refused, now naming the fix."""
    import torch

    args = [*SMOKE, "--output_dir", str(tmp_path / "run"), "--tf32", "true"]
    before = torch.backends.fp32_precision
    assert config_mod.parse_args([*args, "--dry-run"]).training.tf32 is True
    assert torch.backends.fp32_precision == before
    with pytest.raises(ConfigError, match=r"--tf32 requires Ampere .*\(here: --tf32 false, or run it on an Ampere"):
        config_mod.parse_args(args)


def test_the_summary_says_when_checkpoints_are_written_and_where_none_comes_before_the_end(tmp_path, capsys):
    """A `--save_steps` past the run's steps was accepted and said nowhere (as in transformers, which saves at the end
    alone): the job ran for hours with no checkpoint on the way, and a crash lost every step. The summary (the dry run's
    and the run's first lines) says when checkpoints are written, and plainly where none comes before the end."""
    out = ["--output_dir", str(tmp_path / "run")]
    assert field(dry_run(capsys, *SMOKE, *out), "checkpoints") == (
        "every 20 steps and at the end (step 48); the newest 2 kept (save_total_limit 2)"
    )
    assert field(dry_run(capsys, *SMOKE, *out, "--save_steps", "0.25"), "checkpoints").startswith(
        "every 12 steps (save_steps 0.25 of the run's 48) and at the end (step 48)"
    )
    late = field(dry_run(capsys, *SMOKE, *out, "--save_steps", "1000"), "checkpoints")
    assert late.startswith(
        "NONE before the end: save_steps 1000 is not below the run's 48 steps, so step 48 alone is saved and a crash "
        "before it loses every step"
    ), late
    assert late.endswith("--save_steps N saves every N steps (0.1: every tenth of the run)")  # the fix named
    assert field(dry_run(capsys, *SMOKE, *out, "--save_strategy", "no"), "checkpoints").startswith(
        "none (save_strategy no)"
    )


def test_save_strategy_epoch_on_a_run_of_one_epoch_or_less_says_no_checkpoint_comes_before_the_end(tmp_path, capsys):
    """`--save_strategy epoch` saves at each epoch's end, and the recipes train 1 epoch: the summary said "at the end of
    each epoch" and nothing more, where `--save_steps` past the run's steps is said plainly (above) for the same
    outcome: a job of hours with no checkpoint on the way, a crash losing every step. Said the same way now; a run of
    several epochs saves at each epoch's end as before."""
    out = ["--output_dir", str(tmp_path / "run"), "--save_strategy", "epoch"]
    for extra in ([], ["--max_steps", "10"], ["--num_train_epochs", "0.5"]):
        line = field(dry_run(capsys, *SMOKE, *out, *extra), "checkpoints")
        total = {"--max_steps": "10", "--num_train_epochs": "24"}.get(extra[0] if extra else "", "48")
        assert line.startswith(
            "NONE before the end: save_strategy epoch saves at each epoch's end, and the run ends within its first "
            f"epoch, so step {total} alone is saved and a crash before it loses every step"
        ), line
        assert line.endswith("--save_strategy steps --save_steps N saves every N steps (0.1: every tenth of the run)")
    line = field(dry_run(capsys, *SMOKE, *out, "--num_train_epochs", "2"), "checkpoints")
    assert line == "at the end of each epoch; the newest 2 kept (save_total_limit 2)"


def test_a_dry_run_of_a_folder_a_live_run_holds_lists_the_runs_refusal(tmp_path, capsys):
    """A dry run of a live run's folder said "the run starts there" (or resumes from its checkpoint) and nothing more,
    and a job's dry run passed: every node started its processes, each refused by the lock. It still plans the run as
    it will find the folder, and lists the refusal; with --json, the record launch.sh ends such a job on."""
    from dpotrain.cluster import run_lock

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            PYTHON,
            "-c",
            "import sys, time; from pathlib import Path; from dpotrain.cluster import run_lock; "
            "assert run_lock.acquire(Path(sys.argv[1])) is None; print('held', flush=True); time.sleep(600)",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        text = dry_run(capsys, *SMOKE, "--output_dir", str(out))
        printed = dry_run(capsys, *SMOKE, "--output_dir", str(out), "--json")
    finally:
        holder.kill()
        holder.wait()
    assert f"warning: the run would refuse: output_dir '{out}' is in use by another run (host " in text, text
    assert field(text, "steps") == "48 optimizer steps (1 epoch), 5 of warmup"  # planned all the same
    refusals = json.loads(printed[printed.index("{\n") :])["derived"]["would_refuse"]
    assert len(refusals) == 1 and "is in use by another run" in refusals[0]
    assert sorted(p.name for p in out.iterdir()) == [run_lock.LOCK_FILE]  # the dry run wrote nothing there


def test_a_reference_only_dry_run_says_nothing_is_written_in_the_output_folder(tmp_path, capsys):
    """`--reference_only true` scores the reference into the cache and exits; it writes nothing in output_dir (a
    finished run's folder stays as it is). Its dry run said "<out>: the run starts there", of a finished run too."""
    from dpotrain.hub.hub import RUN_COMPLETE
    from dpotrain.train import run_files

    out = tmp_path / "run"  # a finished run's folder
    run_files.write(out, [run_files.MANIFEST, RUN_COMPLETE])
    (out / RUN_COMPLETE).write_text(json.dumps({"global_step": 48}))
    text = dry_run(capsys, *SMOKE, "--output_dir", str(out), "--reference_only", "true")
    said = f"nothing in {out}: --reference_only scores and caches the reference log-probs, then exits"
    assert field(text, "output") == said, text
    assert "would refuse" not in text


def test_a_run_folder_writable_in_a_read_only_parent_is_planned_not_refused(tmp_path):
    """A folder made for the user on a mount they may not write in (`/projects` read-only, `/projects/run` a writable
    mount or a folder of theirs): the run trains there, and its dry run ended in `error: ... cannot write the dry run's
    record beside it in /projects (Read-only file system): pass --output_dir a folder this job can write in` (exit 2).
    It plans the run and says where the record could not go; --json prints it."""
    import ctypes

    parent = tmp_path / "projects"
    out = parent / "run"
    out.mkdir(parents=True)
    argv = [*SMOKE, "--output_dir", str(out), "--dry-run"]

    def dry_run_there():
        from dpotrain.recipe.errors import run_cli

        libc = ctypes.CDLL(None, use_errno=True)  # the run's folder a writable mount inside the read-only parent
        assert libc.mount(b"tmpfs", os.fsencode(out), b"tmpfs", 0, b"size=1m") == 0
        run_cli(lambda: train_dpo.main(argv))

    code, printed, err = in_child(dry_run_there, read_only=[parent])
    assert code == 0, err[-2000:]
    assert field(printed, "output") == f"{out}: the run starts there"
    said = f"not written: {parent} cannot be written in, only the run's folder (--json prints it)"
    assert field(printed, "everything") == said
    assert not list(parent.iterdir())[1:]  # the run's folder alone


def test_a_dry_run_ended_by_a_bad_row_still_says_what_it_had_listed(tmp_path, capsys):
    """A finished run's folder (listed: the run refuses it before it reads the data) and a bad row (a refusal that ends
    the dry run): the dry run ended on the row alone, and the run's own first line, the folder's, went unsaid."""
    from dpotrain.hub.hub import RUN_COMPLETE
    from dpotrain.recipe.errors import run_cli
    from dpotrain.train import run_files

    out = tmp_path / "run"  # a finished run's folder
    run_files.write(out, [run_files.MANIFEST, RUN_COMPLETE])
    (out / RUN_COMPLETE).write_text(json.dumps({"global_step": 48}))
    rows = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:16]
    same = json.loads(rows[0])
    rows.append(json.dumps({**same, "rejected": same["chosen"]}))  # chosen identical to rejected: refused
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(rows) + "\n")
    argv = [*SMOKE, "--output_dir", str(out), "--dataset_name", str(data), "--dry-run"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "error: row 16" in err, err[-2000:]
    said = f"warning: the run would refuse: output_dir '{out}' already holds a finished run"
    assert said in err and err.index(said) < err.index("error: row 16"), err[-2000:]


def test_lora_target_parameters_beside_target_modules_are_in_the_summary(tmp_path, capsys):
    """`lora_target_parameters` given beside `lora_target_modules` (PEFT adapts both: an MoE's attention and experts)
    were left out of the summary, which named the modules alone."""
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "--lora_target_parameters", "mlp.down_proj.weight"]
    text = dry_run(capsys, *SMOKE, "--output_dir", str(tmp_path / "run"), *lora)
    assert field(text, "LoRA").startswith("an adapter trains on q_proj and parameters mlp.down_proj.weight (r 16,")


def test_a_tr_dpo_sync_the_run_never_reaches_is_said_in_the_reference_line():
    """TR-DPO with TRL's ref_model_sync_steps 512 on a shorter run (the demo's 48 steps): TRL moves the reference at
    the steps divisible by it, so no step trained against a moved one, and the summary said only "a live reference
    model". It says so now, with the interval that moves it; a run long enough to sync says nothing of it."""
    from dpotrain import dry_run
    from dpotrain.recipe import run_record

    values = {"precompute_ref_log_probs": False, "sync_ref_model": True, "ref_model_sync_steps": 512}
    s = run_record.of(values).settings
    said = dry_run.reference_text(s, None, 48)
    assert said.startswith("a live reference model, run beside every step (no reference stage); TR-DPO moves it")
    assert "not below the run's 48 steps: no step trains against a moved reference (plain DPO)" in said
    assert said.endswith("--ref_model_sync_steps 47 or fewer moves it")
    assert "TR-DPO" not in dry_run.reference_text(s, None, 1024)
    assert "TR-DPO" not in dry_run.reference_text(s, None, None)  # steps not counted: nothing claimed

"""Gradient clipping as OLMo 3 had it (`max_grad_norm: 1.0` in the OLMo 3 recipes): ONE norm over every parameter's
gradient of the whole step, on every process, checked against a clip computed by hand from the same step unclipped.

One optimizer step of plain SGD (no momentum, constant learning rate lr, no warm-up) moves each weight by -lr x the
gradient it was given, so the unclipped step shows the step's gradient g, and the clipped step must move by
-lr x g x (1.0 / |g|) where |g| > 1.0, while `grad_norm` logs |g| (before clipping, as TRL logs it). Adam would hide a
wrong clip: its first update is nearly the same whatever factor scales every gradient. On one process (in this
process, seconds) and on 2 processes under DeepSpeed ZeRO-2 (a launch); ZeRO-3, FSDP2 and a sequence-parallel group
of 2 the same way (`-m extended`: a launch each). The DeepSpeed config refusals and the record: fast, in-process.
"""

import json
import math
import os
import subprocess

import datasets
import pytest
import yaml
from safetensors.torch import load_file
from trl_parity import ROWS

from conftest import ROOT, accelerate_launch, built, python, rank_python, ready
from dpotrain import stages
from dpotrain.cluster import engine
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

LR = 0.5
SGD_STEP = [
    "--optim",
    "sgd",
    "--learning_rate",
    str(LR),
    "--lr_scheduler_type",
    "constant",
    "--warmup_steps",
    "0",
    "--max_steps",
    "1",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--report_to",
    "none",
]
# The smoke data's first 48 pairs; the step takes 8 of them (pairs_per_step), the same 8 on any number of processes.
# The reference stage scores only those 8, in one micro-batch per rank: under ZeRO-3 its inference engine, which hooks
# the same modules as training's, then stopped training's first forward in DeepSpeed's parameter coordinator ("pop
# from an empty deque") until it forgot the pass it recorded (`RecipeDPOTrainer.train`).
PAIRS = ROWS[:48]


def one_step(out, model_dir, *flags: str):
    """The smoke recipe's first optimizer step, in this process, after its plan and reference stages."""
    recipe = parse_args(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(out),
            *SGD_STEP,
            *flags,
        ]
    )
    trainer = ready(built(recipe, datasets.Dataset.from_list(PAIRS)))
    trainer.train()
    return trainer


def moves(weights: dict, model_dir) -> dict:
    """How far each parameter moved from the built-in model's start."""
    start = load_file(f"{model_dir}/model.safetensors")
    return {name: w.detach().float() - start[name] for name, w in weights.items()}


def norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def grad_norms(log_history) -> list[float]:
    return [r["grad_norm"] for r in log_history if "grad_norm" in r]


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory, tiny_model_dir):
    """The step unclipped, in this process: (each parameter's move, the gradient's norm |g| = |move| / lr)."""
    trainer = one_step(tmp_path_factory.mktemp("free") / "run", tiny_model_dir, "--max_grad_norm", "0")
    moved = moves(dict(trainer.model.named_parameters()), tiny_model_dir)
    g = norm(moved.values()) / LR
    assert abs(grad_norms(trainer.state.log_history)[0] - g) <= 1e-5 * g  # logged as computed, unclipped
    assert g > 1.5, g  # the clip at 1.0 acts on this step
    return moved, g


def assert_clipped_by_hand(moved: dict, logged: float, unclipped, tolerance: float) -> None:
    """`moved` is the unclipped step scaled by 1.0 / |g|, and `logged` is |g|."""
    free, g = unclipped
    assert abs(logged - g) <= 1e-4 * g, (logged, g)  # grad_norm: the norm before clipping
    assert abs(norm(moved.values()) / LR - 1.0) <= 1e-4  # the update applied: a gradient of norm 1.0
    names = set(moved) & set(free)
    assert len(names) >= len(free) - 1  # a tied lm_head may be saved once
    worst = max(float((moved[n] - free[n] / g).abs().max()) for n in names)
    assert worst <= tolerance * max(float(free[n].abs().max()) / g for n in names), worst


@pytest.mark.slow
def test_one_process_clips_the_step_at_one_global_norm(tmp_path, tiny_model_dir, unclipped):
    trainer = one_step(tmp_path / "run", tiny_model_dir, "--max_grad_norm", "1.0")
    moved = moves(dict(trainer.model.named_parameters()), tiny_model_dir)
    assert_clipped_by_hand(moved, grad_norms(trainer.state.log_history)[0], unclipped, 1e-4)


def engine_config(tmp_path, name: str) -> str:
    """The engine's shipped accelerate config, its DeepSpeed file allowing plain SGD (DeepSpeed refuses an optimizer
    it has not tested with ZeRO unless told; it runs any torch optimizer)."""
    shipped = {
        "zero2": "accelerate_config.yaml",
        "zero3": "configs/accelerate/zero3.yaml",
        "fsdp2": "configs/accelerate/fsdp2.yaml",
    }[name]
    config = yaml.safe_load((ROOT / shipped).read_text())
    if name.startswith("zero"):
        ds_file = ROOT / config["deepspeed_config"]["deepspeed_config_file"]
        ds = {**json.loads(ds_file.read_text()), "zero_allow_untested_optimizer": True}
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        config["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "ds.json")
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "accelerate.yaml")


LAUNCHES = [
    pytest.param("zero2", [], id="zero2"),
    pytest.param("zero3", [], id="zero3"),  # also a ZeRO-3 run whose reference stage is one micro-batch per rank
    pytest.param("fsdp2", [], id="fsdp2", marks=pytest.mark.extended),
    pytest.param("zero2", ["--sequence_parallel_size", "2"], id="zero2-sequence-parallel", marks=pytest.mark.extended),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", LAUNCHES)
def test_two_processes_clip_the_step_at_one_global_norm(name, extra, tmp_path, tiny_model_dir, unclipped):
    """2 processes: the same pairs' step (a mean over all of them, as on one process), clipped at ONE norm over both
    processes' gradients: a norm per rank, or per shard, would scale the parts differently."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    out = tmp_path / "run"
    cmd = [
        *accelerate_launch(),
        "--config_file",
        engine_config(tmp_path, name),
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
        *SGD_STEP,
        *extra,
    ]
    env = {**os.environ, "DPOTRAIN_CACHE": f"{out}-cache", "PATH": f"{os.path.dirname(python())}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:]
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["derived"]["world_size"] == 2 and resolved["derived"]["gradient_clipping"]["max_grad_norm"] == 1.0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    moved = moves(load_file(str(out / "model.safetensors")), tiny_model_dir)
    assert_clipped_by_hand(moved, grad_norms(records)[0], unclipped, 1e-3)


# --- what is recorded and refused, before anything loads --------------------------------------------------------------


def test_the_olmo3_recipes_clip_at_one_and_the_dry_run_says_so(capsys):
    for name in ("think", "think-32b", "instruct", "smoke"):
        recipe = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        assert recipe["max_grad_norm"] == 1.0, name
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--dry-run"])
    assert stages.decide_launch(recipe).record()["gradient_clipping"] == {
        "max_grad_norm": 1.0,
        "clipped_by": "torch's clip_grad_norm_",
    }
    recipe = parse_args(["--config", str(ROOT / "configs" / "think.yaml"), "--dry-run"])
    clipping = stages.decide_launch(recipe).record()["gradient_clipping"]
    assert clipping["max_grad_norm"] == 1.0 and clipping["clipped_by"].startswith("DeepSpeed's engine")


def ds_engine(tmp_path, clipping) -> engine.Engine:
    ds = json.loads((ROOT / "ds_config.json").read_text())
    ds.pop("gradient_clipping")
    if clipping is not None:
        ds["gradient_clipping"] = clipping
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config = yaml.safe_load((ROOT / "accelerate_config.yaml").read_text())
    config["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "ds.json")
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    return engine.from_config(str(tmp_path / "accelerate.yaml"))


@pytest.mark.parametrize(
    "clipping, max_grad_norm, expected",
    [
        (
            None,
            1.0,
            "has no gradient_clipping, so DeepSpeed would not clip while max_grad_norm is 1: add "
            '"gradient_clipping": "auto" to it (filled from max_grad_norm), or pass --max_grad_norm 0',
        ),
        (0.5, 1.0, 'sets gradient_clipping 0.5 and max_grad_norm is 1: set "gradient_clipping": "auto" there'),
        ("auto", -1.0, "max_grad_norm must be >= 0 (got -1)"),
    ],
)
def test_a_deepspeed_config_that_would_not_clip_as_asked_is_refused(clipping, max_grad_norm, expected, tmp_path):
    found = ds_engine(tmp_path, clipping)
    with pytest.raises(ConfigError) as refused:
        engine.gradient_clipping(max_grad_norm, found)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("clipping, max_grad_norm", [("auto", 1.0), (1.0, 1.0), (None, 0.0), ("auto", 0.0)])
def test_a_deepspeed_config_that_clips_as_asked_is_recorded(clipping, max_grad_norm, tmp_path):
    record = engine.gradient_clipping(max_grad_norm, ds_engine(tmp_path, clipping))
    assert record["max_grad_norm"] == (max_grad_norm or None)


def test_transformers_fills_deepspeeds_auto_from_max_grad_norm():
    """What the record relies on: transformers' Trainer writes max_grad_norm into DeepSpeed's "auto" (accelerate's
    1.0 applies only without a Trainer, as in open-instruct)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    for value in (1.0, 0.0):
        config = HfTrainerDeepSpeedConfig(json.loads((ROOT / "ds_config.json").read_text()))
        config.trainer_config_process(TrainingArguments(output_dir="unused", max_grad_norm=value, use_cpu=True))
        assert config.config["gradient_clipping"] == value


def test_the_recipes_page_quotes_the_recipes():
    """docs/recipes.md's table says each recipe's max_length, learning rate and clipping as its YAML holds them."""
    rows = {}
    for line in (ROOT / "docs" / "recipes.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("`max_length`", "`learning_rate`", "weight decay / gradient clipping"):
            rows[cells[0]] = cells[1:]
    names = ("think", "think-32b", "instruct", "smoke")
    recipes = [yaml.safe_load((ROOT / "configs" / f"{n}.yaml").read_text()) for n in names]
    assert [int(c) for c in rows["`max_length`"]] == [r["max_length"] for r in recipes]
    assert [float(c) for c in rows["`learning_rate`"]] == [r["learning_rate"] for r in recipes]
    assert rows["weight decay / gradient clipping"][0] == "0 / global norm 1.0 (`max_grad_norm`)"
    assert rows["weight decay / gradient clipping"][1:] == ["same"] * 3
    assert {(r["weight_decay"], r["max_grad_norm"]) for r in recipes} == {(0.0, 1.0)}

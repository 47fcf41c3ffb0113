"""The run as its stages (dpotrain/stages.py): the dry run is the run's own first half, so it records what the run
then writes in resolved_config.json; each decision is made once per run; a dry run's stdout is its JSON alone."""

import json
import os
import subprocess
import sys

import pytest

import train_dpo
from conftest import ROOT, launch_smoke, python, run_train
from dpotrain import resolve
from dpotrain.data import lengths
from dpotrain.plan import memory

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]


def dry_json(args: list[str], env: dict | None = None) -> dict:
    """`python train_dpo.py ... --dry-run --json`: its stdout, parsed (it must be the JSON alone)."""
    result = subprocess.run(
        [python(), str(ROOT / "train_dpo.py"), *SMOKE, *args, "--dry-run", "--json"],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def assert_same_decisions(dry: dict, ran: dict) -> None:
    """World size, pairs, rows, steps, max_length, forward, batching and memory plan: field by field."""
    d, r = dry["derived"], ran["derived"]
    for key in (
        "world_size",
        "world_size_source",
        "pairs_per_step",
        "dataset_rows",
        "total_steps",
        "warmup_steps",
        "batching",
    ):
        assert d[key] == r[key], key
    assert dry["max_length"] == ran["max_length"]
    for key in ("attention", "packed", "share_prompt", "one_row", "layout", "decision"):
        assert d["forward"][key] == r["forward"][key], key
    # The engine is the same; where it was read from differs (the accelerate config, or the launched process).
    d_memory, r_memory = dict(d["memory"]), dict(r["memory"])
    d_engine, r_engine = d_memory.pop("engine", ""), r_memory.pop("engine", "")
    assert d_engine.split(" (")[0] == r_engine.split(" (")[0]
    assert d_memory == r_memory


@pytest.mark.slow
def test_the_dry_run_records_what_the_run_writes_on_one_process(tmp_path):
    # bf16 on the CPU (use_cpu): a memory plan is made, for this machine, not for a GPU node.
    args = ["--max_steps", "2", "--use_cpu", "true", "--bf16", "true", "--save_strategy", "no"]
    dry = dry_json([*args, "--output_dir", str(tmp_path / "run")])
    assert "per_gpu_gib" in dry["derived"]["memory"]
    assert "micro_batches_per_step" in dry["derived"]["batching"]
    result = run_train([*SMOKE, *args, "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stdout[-3000:]
    assert_same_decisions(dry, json.loads((tmp_path / "run" / "resolved_config.json").read_text()))


@pytest.mark.slow
def test_the_dry_run_records_what_a_two_process_launch_writes(tmp_path):
    launch = ["--accelerate_config", str(ROOT / "accelerate_config.yaml")]
    args = ["--max_steps", "2", "--save_strategy", "no", "--output_dir", str(tmp_path / "run")]
    dry = dry_json([*launch, *args], env={"WORLD_SIZE": "2"})
    assert dry["derived"]["world_size"] == 2
    launch_smoke(2, [*launch, *args])
    ran = json.loads((tmp_path / "run" / "resolved_config.json").read_text())
    assert ran["derived"]["batching"]["gradient_reductions_per_epoch"] > 0  # DeepSpeed: one per backward
    assert_same_decisions(dry, ran)


@pytest.mark.slow
def test_each_decision_is_made_once_per_run_and_per_dry_run(tmp_path, monkeypatch, capsys):
    calls = {"memory plan": 0, "analyzer cache read": 0, "max_length": 0, "world size": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(memory, "plan", counted("memory plan", memory.plan))
    monkeypatch.setattr(lengths, "cached_measure", counted("analyzer cache read", lengths.cached_measure))
    monkeypatch.setattr(lengths, "analyse", counted("max_length", lengths.analyse))
    monkeypatch.setattr(lengths, "resolution_of", counted("max_length", lengths.resolution_of))
    monkeypatch.setattr(resolve, "world_size", counted("world size", resolve.world_size))
    args = [
        *SMOKE,
        "--max_length",
        "auto",
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--use_cpu",
        "true",
        "--bf16",
        "true",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    train_dpo.main([*args, "--dry-run", "--json"])
    assert calls == {"memory plan": 1, "analyzer cache read": 1, "max_length": 1, "world size": 1}
    capsys.readouterr()
    train_dpo.main(args)  # the dry run analysed the split: the run reads the analyzer's cache once
    assert calls == {"memory plan": 2, "analyzer cache read": 2, "max_length": 2, "world size": 2}


@pytest.mark.slow
def test_the_first_half_reads_the_models_config_once(tmp_path, monkeypatch):
    """A Hub model's config asks the Hub at each read: the lengths stage (the model's positions), the forward's checks,
    the load dtype (`--dtype auto`), the memory plan and each plan its refusal weighs read it apart, 15 times in this
    refused dry run. The first half reads it once and passes it on."""
    from transformers import AutoConfig

    from dpotrain.recipe.errors import ConfigError

    read, load = [], AutoConfig.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        caller = sys._getframe(1).f_globals["__name__"]  # not transformers' own (AutoTokenizer reads it to choose)
        read.extend([caller] if caller.startswith("dpotrain") else [])
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(counted))
    model = str(ROOT / "configs" / "models" / "olmo3-7b")  # a 7B's config: 40 GiB is too little, the advice weighs
    args = ["--model_name_or_path", model, "--bf16", "true", "--dtype", "auto", "--gpu_memory_gib", "40"]
    with pytest.raises(ConfigError, match="memory plan: .* these fit"):
        train_dpo.main([*SMOKE, *args, "--output_dir", str(tmp_path / "run"), "--dry-run"])
    assert read == ["dpotrain.plan.memory"]  # memory.model_config, the one reader, once


@pytest.mark.slow  # loads the model and builds its trainer
def test_the_trainer_takes_a_copy_of_the_first_halfs_tokenizer(tmp_path, tiny_model_dir):
    """Issue #54: the trainer takes the tokenizer the first half measured the pairs with, not one loaded again, and as
    a copy of its own: TRL and the packed trainer set the recipe's pad token on theirs, which the first half's keeps
    as loaded (what it was checked with: `check_pad_token`)."""
    import datasets

    from conftest import built
    from dpotrain.recipe.config import parse_args

    args = ["--model_name_or_path", tiny_model_dir, "--pad_token", "<|im_end|>", "--max_steps", "1"]
    recipe = parse_args([*SMOKE, *args, "--output_dir", str(tmp_path / "run")])
    pairs = datasets.load_dataset("json", data_files=str(ROOT / "data" / "smoke_prefs.jsonl"), split="train[:16]")
    run = built(recipe, pairs)
    first, trained = run.spec.lengths.tokenizer, run.trainer.processing_class
    assert trained is not first and trained.name_or_path == first.name_or_path == tiny_model_dir
    assert (trained.pad_token, first.pad_token) == ("<|im_end|>", "<|pad|>")
    assert trained.chat_template == first.chat_template and trained.get_vocab() == first.get_vocab()


def test_the_recipes_env_block_sets_what_the_environment_does_not(tmp_path, capsys, monkeypatch):
    """The run's process gets the recipe's `env:` variables where the environment has none, from the parse on
    (conftest's `own_environment` removes them after the test; train_dpo.main gives an in-process caller its own
    back)."""
    recipe = tmp_path / "recipe.yaml"
    env = "\nenv:\n  DPOTRAIN_RECIPE_FLAG: 'on'\n  DPOTRAIN_SET_BY_USER: recipe\n"
    recipe.write_text((ROOT / "configs" / "smoke.yaml").read_text() + env)
    monkeypatch.delenv("DPOTRAIN_RECIPE_FLAG", raising=False)
    monkeypatch.setenv("DPOTRAIN_SET_BY_USER", "environment")
    from dpotrain.recipe.config import parse_args

    parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "run")])
    assert os.environ["DPOTRAIN_RECIPE_FLAG"] == "on" and os.environ["DPOTRAIN_SET_BY_USER"] == "environment"


@pytest.mark.slow
@pytest.mark.parametrize("dry", [True, False])
def test_an_empty_chosen_in_a_local_file_is_refused_by_the_dry_run_as_by_the_run(tmp_path, dry):
    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:32]]
    rows[5]["chosen"] = []
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*SMOKE, "--dataset_name", str(data), "--output_dir", str(tmp_path / "run"), *(["--dry-run"] * dry)]
    result = run_train(args)
    assert result.returncode == 2, result.stdout[-2000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "row 5" in errors[0] and "chosen" in errors[0], errors
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_dry_run_json_is_stdout_alone_where_libraries_print(tmp_path):
    # W&B configured (offline) as a user would: what libraries print goes to stderr.
    dry = dry_json(["--report_to", "wandb", "--output_dir", str(tmp_path / "run")], env={"WANDB_MODE": "offline"})
    assert dry["derived"]["forward"]["attention"] == "sdpa"

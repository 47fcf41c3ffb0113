"""What a demo prints holds nothing a user should not act on (issue: quiet, true output)."""

import warnings

import pytest

from dpotrain.data import builtin
from dpotrain.plan import memory
from dpotrain.recipe.config import parse_args


def test_the_builtin_models_planning_config_is_the_config_it_is_built_with(tmp_path, monkeypatch):
    """The smoke recipe's model, planned before it is built and after: special tokens inside its vocabulary (Olmo3's
    defaults, eos 50279, made transformers warn at every demo start) and the ids its tokenizer assigns."""
    monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", str(tmp_path))
    recipe = parse_args(["--config", "configs/smoke.yaml"])
    planned, _ = memory.model_config(recipe)  # not built yet
    tokenizer = builtin.build_tokenizer()
    assert (planned.bos_token_id, planned.pad_token_id, planned.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
    )
    assert planned.eos_token_id < planned.vocab_size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built, _ = memory.model_config(recipe) if builtin.materialize_model(recipe.model.model_name_or_path) else None
    assert built.eos_token_id == planned.eos_token_id and built.vocab_size == len(tokenizer)


@pytest.mark.slow
def test_the_demo_prints_no_warning_to_ignore_and_a_short_readable_start(demo_run):
    """The README's demo as a newcomer runs it: no warning about the built-in model's config or pinned memory on a
    machine without a GPU, and the resolved configuration as the dry run's few lines, not a 2,000-character JSON."""
    _, _, result = demo_run
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    for noise in (
        "eos_token_id must be",
        "'pin_memory' argument is set",
        "Resolved configuration:",
        "{'loss'",
        "{'train_runtime'",
        "Writing model shards",
        "Flattening the indices",
        "cut or dropped at max_length",  # its max_length cuts none of its pairs (cuts.warning)
    ):
        assert noise not in out, noise
    # One readable line per logging step (dpotrain/train/step_log.py), as a trainer prints it.
    import re

    assert re.search(r"step 1/48  loss 0\.6931  acc \d\.\d\d  margin \S+  lr ", out), out[-3000:]  # above the bar
    assert re.search(r"trained to step 48/48 in [\d.]+ s, mean loss \d\.\d{4}", out), out[-3000:]
    start = out[out.index("run of configs/smoke.yaml: all of it in") :].splitlines()
    assert start[1].startswith("  model:") and all(len(line) < 240 for line in start[1:10]), start[:10]
    assert "memory/GPU:    not planned: this recipe trains in fp32, and memory is planned for GPU runs in bf16" in out


def test_a_resume_with_no_step_left_says_so_not_a_mean_loss_of_0():
    """A run killed after its last checkpoint, run again, resumes at max_steps and trains nothing: transformers' summary
    then holds train_loss 0.0, printed as `mean loss 0.0000` for a run whose losses were ~0.6."""
    from types import SimpleNamespace

    from dpotrain.train.step_log import StepLog, line

    summary = {"train_runtime": 0.01, "train_loss": 0.0}
    log = StepLog()
    log.on_train_begin(SimpleNamespace(disable_tqdm=True), SimpleNamespace(global_step=4), None)
    assert line(summary, 4, 4, log.first_step) == (
        "trained to step 4/4: no step left to train after the checkpoint resumed from"
    )
    summary = {"train_runtime": 2.5, "train_loss": 0.61}  # resumed at step 2: steps 3 and 4 trained here
    # transformers' time and mean loss cover this attempt's steps alone: the line names those steps, where "trained to
    # step 4/4 in 2.5 s" read as the whole run's time, its parenthesis after the mean loss
    assert line(summary, 4, 4, first_step=2) == (
        "trained steps 3-4 of 4 in 2.5 s, mean loss 0.6100 (this attempt, resumed from step 2)"
    )
    assert (
        line(summary, 4, 4, first_step=3)
        == "trained step 4 of 4 in 2.5 s, mean loss 0.6100 (this attempt, resumed from step 3)"
    )
    assert (
        line({"train_runtime": 1.0}, 3, 8, first_step=1)
        == "trained steps 2-3 of 8 in 1.0 s (this attempt, resumed from step 1)"
    )
    assert line(summary, 4, 4, first_step=0) == "trained to step 4/4 in 2.5 s, mean loss 0.6100"


@pytest.mark.parametrize(
    "first, expected",
    [
        (
            0,
            "training stopped at step 3/12, before its last step (3.8 s, mean loss 0.6732)",
        ),
        (
            1,
            "training stopped at step 3/12, before its last step (steps 2-3 this attempt, resumed from step 1: "
            "3.8 s, mean loss 0.6732)",
        ),
    ],
)
def test_a_stopped_runs_last_line_says_it_stopped_not_a_finished_runs_summary(first, expected, capsys):
    """A Ctrl-C, a SIGTERM or a health guard ends training before max_steps: its stop line is printed as the checkpoint
    is saved, and transformers' summary came after it as the run's last line, `trained to step 3/12 in 3.8 s, mean loss
    0.6732`, a finished run's words (`tail -1` of a nohup or Slurm log, the terminal under `| tee`). (A health stop's
    own line comes after it, publish.py.)"""
    from types import SimpleNamespace

    from dpotrain.train.step_log import StepLog

    log = StepLog()
    args = SimpleNamespace(disable_tqdm=True)
    log.on_train_begin(args, SimpleNamespace(global_step=first), None)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3, max_steps=12)
    log.on_log(args, state, None, logs={"train_runtime": 3.8, "train_loss": 0.6732})
    assert capsys.readouterr().out.strip() == expected


def test_a_lora_run_and_its_merge_raise_no_futurewarning_a_user_cannot_act_on(tmp_path, tiny_model_dir):
    """PEFT reads transformers' deprecated `is_gradient_checkpointing` as it wraps a model: every LoRA run printed
    "FutureWarning: `is_gradient_checkpointing` is deprecated" at its start and again at the merge (merge_lora)."""
    from conftest import built
    from dpotrain.data import data
    from dpotrain.train import lora

    recipe = parse_args(
        [
            "--config",
            "configs/smoke.yaml",
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
        ]
        + ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "1"]
    )
    pairs = data.load_preference_dataset(recipe.script.dataset_name).select(range(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer = built(recipe, pairs).trainer
        trainer.model.save_pretrained(tmp_path / "run")  # the adapter, as the run saves it
        merged = lora.save_merged(tmp_path / "run", tiny_model_dir, {}, trainer.model, trainer.processing_class)
    assert (merged / "model.safetensors").is_file()


def test_an_evaluation_off_a_terminal_writes_no_cursor_moves_into_the_log(capfd):
    """A Slurm log is a file: transformers' evaluation bar, drawn one row under the training bar, moved the cursor up
    (ESC[A) at every update, and the log read `^[[A` between its lines. Off a terminal the evaluation's own line says
    what it found; the bar is left out (the training bar, one row, stays)."""
    from types import SimpleNamespace

    from dpotrain.train.step_log import StepLog

    args, state = SimpleNamespace(disable_tqdm=False), SimpleNamespace(is_world_process_zero=True, max_steps=4)
    state.global_step = 0
    log = StepLog()
    log.on_train_begin(args, state, None)
    for _ in range(2):
        log.on_prediction_step(args, state, None, eval_dataloader=[0, 1])
    log.on_evaluate(args, state, None)
    log.on_log(args, state, None, logs={"eval_loss": 0.6})
    log.on_train_end(args, state, None)
    out, err = capfd.readouterr()
    assert "eval at step 0/4  loss 0.6000" in out
    assert "\x1b[A" not in out + err and "0/2" not in err


def test_keep_end_is_said_deprecated_once_in_a_line_not_as_trls_warning_per_config_build(capfd):
    """TRL's FutureWarning for keep_end came raw, with file paths, from every build of its config: the recipe's and
    each `dataclasses.replace` (twice per dry run, run and analyzer start). One line of the project's now."""
    from dpotrain.recipe.config import replaced

    with warnings.catch_warnings(record=True) as caught:  # the filters as the run has them (no simplefilter)
        recipe = parse_args(["--config", "configs/smoke.yaml", "--truncation_mode", "keep_end"])
        replaced(recipe, training={"max_length": 512})
    assert not [w for w in caught if "keep_end" in str(w.message)], [str(w.message) for w in caught]
    err = capfd.readouterr().err
    assert err.count("truncation_mode keep_end is deprecated by TRL") == 1, err


def test_a_live_reference_scores_without_a_futurewarning_a_user_cannot_act_on(tmp_path, tiny_model_dir):
    """TRL's `disable_gradient_checkpointing`, around each score of a live reference (`--precompute_ref_log_probs
    false`, sync_ref_model), reads transformers' deprecated `is_gradient_checkpointing`: every rank printed
    "FutureWarning: `is_gradient_checkpointing` is deprecated" with its file path at the first step."""
    from conftest import built
    from dpotrain.data import data

    recipe = parse_args(
        ["--config", "configs/smoke.yaml", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path)]
        + ["--precompute_ref_log_probs", "false", "--max_steps", "2", "--warmup_steps", "0"]
    )
    trainer = built(recipe, data.load_preference_dataset(recipe.script.dataset_name).select(range(8))).trainer
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        loss = trainer.training_step(trainer.model, batch)
    assert loss.isfinite()

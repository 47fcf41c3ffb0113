"""The plan is a stage of the run: building the trainer tokenizes and plans nothing; train_dpo.py plans after it and
before the reference stage, and a trainer without a plan is refused, not trained on some other cut."""

import datasets
import pytest

from conftest import ROOT, run_train
from dpotrain import stages
from dpotrain.data import builtin
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.plan import plan, plan_stage
from dpotrain.recipe import config
from dpotrain.recipe.config import parse_args
from dpotrain.reference import reference
from dpotrain.train.trainer import build_trainer
from dpotrain.train_stage import trainer_on

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def built(tmp_path, model_dir, *overrides):
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--max_steps",
            "2",
            *overrides,
        ]
    )
    return trainer_on(recipe, datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=5)))


@pytest.mark.slow
def test_building_the_trainer_plans_nothing_and_an_unplanned_trainer_is_refused(tmp_path, tiny_model_dir):
    trainer = built(tmp_path, tiny_model_dir, "--gradient_accumulation_steps", "3")
    # One item per optimizer step from construction on: what transformers filled DeepSpeed's "auto" values from.
    assert trainer.args.gradient_accumulation_steps == 1
    assert trainer.accelerator.gradient_state.num_steps == 1
    for unplanned in (
        lambda: trainer.run_plan,
        trainer.train,
        lambda: reference.run_stage(trainer, trainer.graceful_stop),
    ):
        with pytest.raises(RuntimeError, match="no plan: run the plan stage after build_trainer"):
            unplanned()

    run_plan = plan_stage.run_stage(trainer)
    assert trainer.run_plan is run_plan
    # The stage's plan is the plan of the tokenized training set, as the plan module cuts it.
    lengths = PairLengths.of(trainer.train_dataset, trainer.args.max_length, trainer.forward.share_prompt)
    assert (run_plan.lengths.tokens == lengths.tokens).all()
    # The recipe's accumulation lives in the plan: steps of 3 micro-batches of 8 pairs (the smoke recipe's batch size).
    assert (run_plan.step_plan.pairs_per_step, run_plan.step_plan.pairs_per_micro_batch) == (24, 8)
    assert run_plan.epochs == plan.plan_run(lengths, run_plan.step_plan, 1)
    reference.run_stage(trainer, trainer.graceful_stop)
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_step_that_cannot_be_cut_is_refused_by_the_plan_stage_not_by_building(tmp_path, tiny_model_dir):
    """The checks refuse a token budget below a pair of max_length; the plan stage, its last line of defence, refuses
    it too, for a budget given to the stages past the checks (a fabricated stage input)."""
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--max_steps",
            "2",
            "--max_length",
            "256",
            "--max_tokens_per_microbatch",
            "512",
        ]
    )
    found = stages.checks(recipe)
    past_the_checks = config.decided(recipe, {"project": {"max_tokens_per_microbatch": 64}})
    pairs = stages.given_pairs(recipe, found, datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=5)))
    trainer = build_trainer(stages.first_half(past_the_checks, found, pairs=pairs))
    with pytest.raises(plan.PlanError, match="cannot be cut"):
        plan_stage.run_stage(trainer)


@pytest.mark.slow
def test_train_dpo_runs_its_stages_in_order(tmp_path, tiny_model_dir):
    """build -> plan -> reference, each stage's line in that order (a reference-only run: no training needed)."""
    rows = tmp_path / "pairs.jsonl"
    datasets.Dataset.from_list(builtin.make_preference_rows(48, seed=5)).to_json(rows)
    env = {"DPOTRAIN_CACHE": str(tmp_path / "cache"), "DPOTRAIN_BUILTIN_DIR": str(tiny_model_dir.rsplit("/", 1)[0])}
    result = run_train(
        [
            "--config",
            SMOKE,
            "--dataset_name",
            str(rows),
            "--output_dir",
            str(tmp_path / "run"),
            "--reference_only",
            "true",
        ],
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    log = result.stdout
    stage_line = "Plan: 6 steps of 8 pairs per epoch (1 epoch(s) planned), "
    assert stage_line in log, log[-3000:]
    assert log.index("Tokenizing train dataset") < log.index(stage_line) < log.index("reference log-probs (train)")

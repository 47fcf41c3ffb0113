"""The plan is made as the run is built (`train_stage.build_run`), right after TRL tokenizes the training set and
before the reference stage: a built trainer holds the plan of its tokenized pairs, and a step that cannot be cut is
refused there."""

from dataclasses import replace

import datasets
import pytest

from conftest import ROOT, built, run_train
from dpotrain import resolve, stages, train_stage
from dpotrain.data import builtin
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.hub import hub
from dpotrain.plan import plan
from dpotrain.recipe import config
from dpotrain.recipe.config import parse_args

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def smoke_run(tmp_path, model_dir, *overrides):
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
    return built(recipe, datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=5)))


@pytest.mark.slow
def test_the_built_trainer_holds_the_plan_of_its_tokenized_pairs(tmp_path, tiny_model_dir):
    run = smoke_run(tmp_path, tiny_model_dir, "--gradient_accumulation_steps", "3")
    trainer = run.trainer
    # One item per optimizer step from construction on: what transformers filled DeepSpeed's "auto" values from.
    assert trainer.args.gradient_accumulation_steps == 1
    assert trainer.accelerator.gradient_state.num_steps == 1
    run_plan = trainer.run_plan
    # The plan is the plan of the tokenized training set, as the plan module cuts it.
    lengths = PairLengths.of(trainer.train_dataset, trainer.args.max_length, trainer.forward.share_prompt)
    assert (run_plan.lengths.tokens == lengths.tokens).all()
    # The recipe's accumulation lives in the plan: steps of 3 micro-batches of 8 pairs (the smoke recipe's batch size).
    assert (run_plan.step_plan.pairs_per_step, run_plan.step_plan.pairs_per_micro_batch) == (24, 8)
    assert run_plan.epochs == plan.plan_run(lengths, run_plan.step_plan, 1)
    run.score_reference()
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_step_that_cannot_be_cut_is_refused_as_the_trainer_is_built(tmp_path, tiny_model_dir):
    """The checks refuse a token budget below a pair of max_length; the plan, its last line of defence, refuses it
    too as the trainer is built, for a budget given to the stages past the checks (a fabricated stage input)."""
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
    launch = stages.checks(recipe)
    past_the_checks = config.replaced(recipe, project={"max_tokens_per_microbatch": 64})
    pairs = stages.given_pairs(recipe, launch, datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=5)))
    spec = stages.first_half(past_the_checks, launch, pairs=pairs)
    with pytest.raises(plan.PlanError, match="cannot be cut"):
        train_stage.build_run(spec)


@pytest.mark.slow
def test_train_dpo_runs_its_stages_in_order(tmp_path, tiny_model_dir):
    """build -> plan -> reference, each stage's line in that order (a reference-only run: no training needed). Its
    output_dir is a link to a folder still to be made (`outputs/run -> /scratch/me/run`): a reference-only run, which
    takes no lock, ended in transformers' FileExistsError there."""
    link, target = tmp_path / "run", tmp_path / "scratch" / "run"
    link.symlink_to(target)
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
            str(link),
            "--reference_only",
            "true",
        ],
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    log = result.stdout
    stage_line = "Plan: 6 steps of 8 pairs per epoch (1 epoch planned), "
    assert stage_line in log, log[-3000:]
    assert log.index("Tokenizing train dataset") < log.index(stage_line) < log.index("reference log-probs (train)")
    assert link.is_symlink() and not target.exists()  # made for the Trainer, then removed: nothing was written there


def test_the_run_records_the_steps_of_the_pairs_trl_keeps(tmp_path, tiny_model_dir):
    """TRL drops a pair whose prompt alone fills max_length (keep_start): 4 of 16 rows here, so the run trains 3 steps
    of 4 pairs with 1 of warm-up (0.3 of 3, rounded up). resolved_config.json and the run's first summary said 4 steps
    and 2 of warm-up, counted on the rows (the model card's warm-up too)."""
    rows = builtin.make_preference_rows(16, seed=5)
    for row in rows[:4]:  # a prompt past the smoke recipe's max_length of 1024
        for side in ("chosen", "rejected"):
            row[side][-2]["content"] += " word" * 1500  # the user turn before the answer: the prompt's last
    recipe = parse_args(
        ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run")]
        + ["--report_to", "none", "--save_strategy", "no", "--pairs_per_step", "4", "--warmup_steps", "0.3"]
    )
    run = built(recipe, datasets.Dataset.from_list(rows))
    assert len(run.trainer.train_dataset) == 12 and len(run.trainer.run_plan.epochs[0]) == 3
    # The record the run writes before it trains (`ReadyRun.train`), for a new folder and no push.
    spec = replace(run.spec, output=resolve.OutputDecision(None, False), push=hub.PushSettings(False, "r", None, False))
    derived = train_stage.record_run(spec, run.trainer, [])["derived"]
    assert (derived["dataset_rows"], derived["total_steps"], derived["warmup_steps"]) == (16, 3, 1)

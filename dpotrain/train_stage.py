"""The run's second half up to training: the old run removed where it is replaced, the trainer built with the forward
the first half chose (`stages.first_half`), and the run's resolved configuration written once the plan stage
(`plan_stage.run_stage`) and the reference stage (`reference.run_stage`) have run."""

import json
from dataclasses import dataclass
from pathlib import Path

from dpotrain import dry_run, output_folder, resolve
from dpotrain.cluster import offline
from dpotrain.data import model_identity
from dpotrain.hub.hub_push import CheckpointPusher
from dpotrain.recipe import run_record, writes
from dpotrain.train.preemption import STOPPED_EXIT
from dpotrain.train.tracking import WandbStepIsGlobalStep, setup_wandb


@dataclass(frozen=True)
class Built:
    trainer: object
    pusher: CheckpointPusher | None  # checkpoint branches pushed in the background, from the main process
    output_existed: bool  # output_dir was there before the Trainer made it


def clear_old_run(recipe, output: resolve.OutputPlan, state, push_requested: bool) -> None:
    """Only now, once the data and the plans are checked: a refused data set must not cost the old run. The replaced
    run's own files go (output_folder.py: never the user's), and this run's names are recorded before it writes."""
    if state.is_main_process and not recipe.project.reference_only:  # the run's own files only (output_folder.py)
        output_folder.start(recipe, output.start_afresh, push_requested)
    state.wait_for_everyone()


def build(resolved, state, stop) -> Built:
    """The trainer (TRL loads the model with the attention `resolved.forward` chose, and tokenizes the data set)."""
    from dpotrain.train.trainer import build_trainer

    recipe, push = resolved.settings, resolved.push
    training, only_reference = recipe.training, recipe.project.reference_only
    out = Path(training.output_dir)
    clear_old_run(recipe, resolved.output, state, push.requested)
    if state.is_main_process and not only_reference:
        setup_wandb(training)
    # Checkpoint branches: pushed from the main process in the background, only where the Hub is reachable.
    pusher = None
    if push.checkpoints and not offline.is_offline() and state.is_main_process and not only_reference:
        pusher = CheckpointPusher(push.repo_id, push.token, push.private, out)
    callbacks = [WandbStepIsGlobalStep(), *([pusher] if pusher else [])]
    existed = out.exists()
    trainer = build_trainer(resolved, callbacks=callbacks, stop=stop)
    return Built(trainer, pusher, existed)


def trainer_on(recipe, train, eval_dataset=None, callbacks=(), stop=None):
    """The trainer the run builds for `recipe`, on pairs the caller already holds (a test's, a benchmark's): the run's
    own stages (`stages.checks`, then the first half on these pairs, `stages.given_pairs`), without an output folder's
    checks or the old run's removal. It has no plan yet: the plan stage and the reference stage come next, as in the
    run."""
    from dpotrain import stages
    from dpotrain.train.trainer import build_trainer

    found = stages.checks(recipe)
    resolved = stages.first_half(recipe, found, pairs=stages.given_pairs(recipe, found, train, eval_dataset))
    return build_trainer(resolved, callbacks=callbacks, stop=stop)


def ends_after_reference(recipe, built: Built, outcomes, state) -> int | None:
    """The exit code of a run that ends here: a stop request during the reference stage (STOPPED_EXIT: the requeued
    job scores only the rest), or a reference-only run (0); None: training goes on."""
    trainer, out = built.trainer, Path(recipe.training.output_dir)
    if outcomes and outcomes[-1].stopped:
        if state.is_main_process:
            trainer.graceful_stop.mark_saved(outcomes[-1].line())
        return STOPPED_EXIT
    if recipe.project.reference_only:
        if state.is_main_process and not built.output_existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # the Trainer makes output_dir when it starts; a reference-only run writes nothing there
        return 0
    return None


def record_run(resolved, trainer, run_plan, outcomes, state) -> dict:
    """resolved_config.json: the first half's records, and what the trainer, the plan stage and the reference stage
    decided (the forward, as the forward stage decided it)."""
    recipe, output, push = resolved.settings, resolved.output, resolved.push
    training = recipe.training
    derived = resolved.record()
    derived["total_steps"] = trainer.state.max_steps or derived["total_steps"]
    derived["batching"] = run_plan.summary
    derived["reference"] = {o.name: o.record() for o in outcomes}  # its warm-up and steady tokens/s, when it scored
    derived["forward"] = trainer.forward.record()  # the attention and layout chosen (dpotrain/forwards/choice.py)
    derived["layers"] = trainer.layers_record  # the decoder layers as trained: checkpointed, compiled (layers.py)
    resolved = push.record(resolve.resolved_config(recipe, derived | {"resumed_from": output.resume_from}))
    # What the model loaded with (trainer.training_arguments): revision, the forward's attention, the load dtype.
    resolved["model_init_kwargs"] = trainer.args.model_init_kwargs
    if state.is_main_process:
        # The model's files as this run loaded them (or its Hub commit): a rerun on others is refused (resolve.py)
        resolved["derived"]["model_identity"] = model_identity.of(recipe)
        out = Path(training.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        writes.write_text(out / "resolved_config.json", json.dumps(resolved, indent=2, default=str) + "\n")
        # A few readable lines (the dry run's summary, as decided now); every field is in the file.
        heading = f"run of {recipe.config_path or 'the command line'}: all of it in {out / 'resolved_config.json'}"
        print(dry_run.summary(run_record.of(resolved), None, heading), flush=True)
        if output.resume_from:
            print(f"Resuming from {output.resume_from}", flush=True)
    return resolved

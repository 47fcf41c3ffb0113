"""DPO post-training with OLMo 3's recipe: TRL's DPOTrainer under Accelerate + DeepSpeed ZeRO-2.

    # the built-in CPU demo (tiny OLMo 3 model and bundled data, nothing downloads)
    python train_dpo.py --config configs/smoke.yaml

    # what a recipe resolves to on the launch in accelerate_config.yaml, without loading anything
    python train_dpo.py --config configs/think.yaml --dry-run

    # a real run on 4 GPUs (on Slurm: sbatch scripts/dpo_train.sh)
    accelerate launch --config_file accelerate_config.yaml train_dpo.py --config configs/think.yaml

Any TRL / transformers field is a command-line override (--learning_rate 5e-7, --max_steps 100, ...).
"""

import json
import os
import shutil
from pathlib import Path

from dotenv import load_dotenv

from dpotrain import (
    agreement,
    build_locks,
    data,
    data_identity,
    dry_run,
    engine,
    health,
    hub,
    hub_push,
    lora,
    memory,
    offline,
    options,
    plan_stage,
    reference,
    resolve,
    resume,
    rows,
    samples,
)
from dpotrain.config import parse_args
from dpotrain.errors import run_cli
from dpotrain.hub_push import CheckpointPusher
from dpotrain.metrics import PLOT_FILE, plot_metrics, read_metrics
from dpotrain.preemption import STOPPED_EXIT, GracefulStop
from dpotrain.tracking import WandbStepIsGlobalStep, keep_offline_runs, setup_wandb


def main(argv=None) -> None:
    # First: a SIGTERM or USR1 while the model loads is kept for the reference stage and training to honour.
    stop = GracefulStop.from_env()
    try:
        result = run(argv, stop)
        engine.end_processes()  # not after an error: a rank may still be in a collective the others left
        return result
    finally:
        # Done (or failed): a preemption's SIGTERM from now on must not kill the process while Python shuts down,
        # which restores default handlers (the job would end FAILED after a complete run).
        stop.release()


def lightest_attention(recipe) -> str | None:
    """The attention of the forward with the least mask memory this machine could take for the recipe's model (None
    when its config is not on this machine: the plan says it skipped). Refuses an attention the recipe asks for that
    cannot run here."""
    from dpotrain.forwards import choice

    config, _ = memory.load_model_config(recipe)
    return None if config is None else choice.lightest_attention(config, recipe)


def forward_stage(recipe, dataset, world: int, run_engine, derived: dict, cuda: bool | None = None,
                  varlen: str | None = "installed", lengths=None):  # fmt: skip
    """The run's forward, decided from its pairs' lengths (`forwards/sample.py`: the analyzer's cached lengths, else a
    seeded sample of `dataset` tokenized as the trainer does; or `lengths`) between the forwards this machine can run
    (`cuda`, `varlen`: detected unless given), and the memory plan for it, refused when it does not fit. Both recorded
    in `derived`; the recipe's attn_implementation and padding_free set to the forward chosen."""
    from dpotrain.forwards import choice, sample
    from dpotrain.trainer import resolve_model_path

    model_path = resolve_model_path(recipe)
    lengths = lengths or sample.run_lengths(recipe, dataset, model_path)
    forward = choice.decide_forward(recipe, model_path, cuda=cuda, lengths=lengths, varlen=varlen)
    derived["forward"] = forward.record()
    derived["memory"] = memory.plan(recipe, world, run_engine, attention=forward.attention)
    # The decoder layers to checkpoint, from this plan only: the first check's choice, applied, would read as an
    # explicit setting here.
    memory.apply_checkpointing(recipe, derived["memory"])
    return forward


def run(argv, stop: GracefulStop) -> int | None:
    load_dotenv()  # HF_TOKEN, WANDB_API_KEY, WANDB_PROJECT...; the environment wins over .env
    # Before the arguments are parsed: building them starts DeepSpeed's communication (TrainingArguments asks for its
    # device), which compiles an op first and would wait on a stale build lock of it forever, silently.
    build_locks.check_launch()
    recipe = parse_args(argv)
    training, script = recipe.training, recipe.script

    # Everything that can be refused is refused here, before a data set or a model loads.
    resolve.check_values(recipe)
    health.check_values(recipe.project)
    samples.check_values(recipe.project)
    options.check_options(recipe)  # options TRL would fail on, or ignore, only after loading the model
    lora.check_lora(recipe)
    run_engine = engine.launched()  # an engine this project does not support is refused here (dpotrain/engine.py)
    resolve.fill_defaults(recipe)
    if recipe.project.preflight:  # the base model's view of the data, instead of training (dpotrain/preflight.py)
        from dpotrain import preflight

        offline.check_job_reachable(recipe)  # a model or data set to download: the Hub must answer, within seconds

        return preflight.main_from_recipe(recipe)
    # This project pushes, not the Trainer; the token stays in memory. Checked for the engine that will run: the
    # launched one, or for a dry run the one its accelerate config plans.
    planned_engine = engine.from_config(recipe.project.accelerate_config) if recipe.project.dry_run else run_engine
    push = hub.take_push_settings(recipe, planned_engine)
    world, world_source = resolve.world_size(recipe, planning=recipe.project.dry_run)
    resolve.plan_batch(recipe, world)
    derived = {"world_size": world, "world_size_source": world_source}
    if recipe.project.dry_run:
        n_rows = None  # a Hub data set is counted when the run loads it
        if data.is_local(script.dataset_name):
            n_rows = data.count_local_rows(script.dataset_name, script.dataset_train_split)
        derived.update(resolve.plan_steps(recipe, world, n_rows))
        options.check_plan(derived)
        max_length = training.max_length
        if recipe.max_length_auto:
            derived["max_length"] = resolve.preview_auto_max_length(recipe)
            max_length = derived["max_length"].get("max_length") if derived["max_length"]["cached"] else None
        # What the GPU nodes will run (from the analyzer's cached lengths, with and without FlashAttention 4), and the
        # step and memory plans for it.
        derived["forward"], planned = resolve.preview_forward(recipe, max_length)
        derived["batching"] = resolve.preview_plan(recipe, world, max_length, planned)
        attention = planned.attention if planned is not None else None
        derived["memory"] = memory.plan(recipe, world, attention=attention)  # refuses a plan that cannot fit the GPU
        memory.apply_checkpointing(recipe, derived["memory"])  # the layers the plan checkpoints, in the resolved config
        # The dtype the weights will load in under the planned engine (bf16 under DeepSpeed), not TRL's default.
        if planned_engine.name != "unplanned":
            recipe.model.dtype = engine.load_dtype(recipe, planned_engine)
        resolved = push.record(resolve.resolved_config(recipe, derived))
        if recipe.project.json:  # for scripts (scripts/launch.sh): the whole resolved configuration, nothing else
            print(json.dumps(resolved, indent=2, default=str))
        else:
            print(dry_run.summary(resolved, dry_run.write_json(resolved, training.output_dir)))
        return
    # The same memory plan as the dry run that scripts/launch.sh makes, for the engine this process runs under: a job
    # started with `accelerate launch` by hand is refused here too, before anything loads. The forward is decided from
    # the data (below): planned here for the lightest one this machine could take, again for the one it takes.
    derived["memory"] = memory.plan(recipe, world, run_engine, attention=lightest_attention(recipe))
    only_reference = recipe.project.reference_only  # the reference stage alone: no output folder, W&B or push
    if not resolve.uses_live_reference(recipe):
        reference.check_writable()  # the reference stage saves as it goes
    if not only_reference:
        push.check_token()
        options.check_wandb(recipe)
        if push.requested and int(os.environ.get("RANK", "0")) == 0:  # one whoami, not one per rank (rate limits)
            push.repo_id = hub.check_write_access(push.repo_id, push.token)  # now, not after training; user/name
    pairs_per_step = recipe.project.pairs_per_step or (
        training.per_device_train_batch_size * training.gradient_accumulation_steps * world
    )
    plan = resolve.OutputPlan(None, False) if only_reference else resolve.check_output_dir(recipe, pairs_per_step)
    offline.check_offline_artifacts(recipe)  # with HF_HUB_OFFLINE: model, tokenizer and data set must be cached

    # The first process group, with every collective's timeout.
    state = engine.start_processes(training, run_engine)
    plan.resume_from = resume.confirm(plan.resume_from, explicit=bool(training.resume_from_checkpoint))  # checksums
    out = Path(training.output_dir)
    offline.check_job_reachable(recipe, model=False)  # a data set to download: the Hub must answer, within seconds
    dataset = data.load_preference_dataset(
        script.dataset_name, script.dataset_train_split, script.dataset_config, streaming=script.dataset_streaming
    )
    # Every row checked before a model loads (a streamed data set is not: it is read once, by the trainer).
    skip = recipe.project.skip_invalid
    if hasattr(dataset, "__len__"):
        dataset = rows.usable_pairs(dataset, skip, derived, "invalid_rows", recipe.project.hh_format,
                                    split=script.dataset_train_split, say=state.is_main_process)  # fmt: skip
    eval_dataset = None
    if training.eval_strategy != "no":  # the held-out split (options.check_options: there is one)
        eval_dataset = data.load_preference_dataset(script.dataset_name, script.dataset_test_split,
                                                    script.dataset_config)  # fmt: skip
        eval_dataset = rows.usable_pairs(eval_dataset, skip, derived, "invalid_eval_rows", recipe.project.hh_format,
                                         split=script.dataset_test_split, say=state.is_main_process)  # fmt: skip
        derived["eval_rows"] = len(eval_dataset)
    derived.update(resolve.plan_steps(recipe, world, len(dataset) if hasattr(dataset, "__len__") else None))
    derived["data_identity"] = (data_identity.of(script.dataset_name, script.dataset_train_split)
                                if state.is_main_process else None)  # fmt: skip
    options.check_plan(derived)
    offline.check_job_reachable(recipe, dataset=False)  # the model's files next (tokenizer first): rows checked first
    if recipe.max_length_auto:
        derived["max_length"] = resolve.auto_max_length(recipe, dataset, state)
    # The forward, from the pairs' lengths, and the memory plan for it: before the old run is removed and the model
    # loads (TRL loads it with the attention chosen here).
    forward = forward_stage(recipe, dataset, world, run_engine, derived)
    if plan.start_afresh and state.is_main_process:  # only now: a refused data set must not cost the old run
        kept = keep_offline_runs(out)
        if kept:
            print(f"Kept the W&B offline runs of the replaced run in {kept} (`wandb sync {kept}/offline-run-*`)",
                  flush=True)  # fmt: skip
        shutil.rmtree(out)  # a stale run_complete.json or metrics.jsonl must not outlive the run it described
    state.wait_for_everyone()
    if state.is_main_process and not only_reference:
        setup_wandb(training)

    from dpotrain.trainer import build_trainer

    # Checkpoint branches: pushed from the main process in the background, only where the Hub is reachable.
    pusher = None
    if push.checkpoints and not offline.is_offline() and state.is_main_process and not only_reference:
        pusher = CheckpointPusher(push.repo_id, push.token, push.private, out)
    callbacks = [WandbStepIsGlobalStep(), *([pusher] if pusher else [])]
    created_before = out.exists()
    trainer = build_trainer(recipe, dataset, eval_dataset=eval_dataset, callbacks=callbacks, stop=stop, forward=forward)
    # The plan stage (dpotrain/plan_stage.py): every step of the run cut into micro-batches, from the tokenized lengths;
    # a step that cannot be cut is refused here, before the reference is scored.
    run_plan = plan_stage.run_stage(trainer)
    # What every rank decided alone (its data's lengths, its plan, its resume point...) must be the same everywhere.
    agreement.at_start(trainer, plan.resume_from)

    # The reference stage (dpotrain/reference.py): scored once, saved as it goes, stopped cleanly on a stop request.
    outcomes = reference.run_stage(trainer, trainer.graceful_stop, recipe.project.reference_save_seconds)
    if outcomes and outcomes[-1].stopped:
        if state.is_main_process:
            trainer.graceful_stop.mark_saved(outcomes[-1].line())  # the requeued job scores only the rest
        return STOPPED_EXIT
    if only_reference:
        if state.is_main_process and not created_before and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # the Trainer makes output_dir when it starts; a reference-only run writes nothing there
        return

    derived["total_steps"] = trainer.state.max_steps or derived["total_steps"]
    # The dtype the weights loaded in (engine.load_dtype: bf16 under DeepSpeed), as the dry run records it, not TRL's
    # float32 default.
    recipe.model.dtype = training.model_init_kwargs["dtype"]
    derived["batching"] = run_plan.summary
    derived["reference"] = {o.name: o.record() for o in outcomes}  # its warm-up and steady tokens/s, when it scored
    derived["forward"] = trainer.forward.record()  # the attention and layout chosen (dpotrain/forwards/choice.py)
    derived["layers"] = trainer.layers_record  # the decoder layers as trained: checkpointed, compiled (layers.py)
    resolved = push.record(resolve.resolved_config(recipe, derived | {"resumed_from": plan.resume_from}))
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved_config.json").write_text(json.dumps(resolved, indent=2, default=str) + "\n")
        print("Resolved configuration:", json.dumps(derived, default=str), flush=True)
        if plan.resume_from:
            print(f"Resuming from {plan.resume_from}", flush=True)

    trainer.train(resume_from_checkpoint=plan.resume_from)
    # A doomed run (dpotrain/health.py): no final model, no run_complete.json, and no requeue.
    if getattr(trainer, "health", None) and trainer.health.stop:
        stop_file = trainer.graceful_stop.stop_file
        if state.is_main_process:
            if stop_file:  # a preemption at the same step must not requeue a doomed run either
                Path(f"{stop_file}.checkpointed").unlink(missing_ok=True)
            print(health.stop_line(trainer.health.stop, str(out)), flush=True)
        if pusher:
            pusher.finish(hub_push.STOP_WAIT_S)
        return health.HEALTH_STOP_EXIT
    if trainer.graceful_stop.stopped and trainer.state.global_step < trainer.state.max_steps:
        if pusher:
            pusher.finish(hub_push.STOP_WAIT_S)  # the requeued job pushes what is left
        return STOPPED_EXIT  # checkpointed on a stop request; the requeued job resumes from it

    trainer.save_model(str(out))  # with use_peft: the adapter (adapter_model.safetensors, adapter_config.json)
    # The last collective step. The other ranks end here rather than wait at a barrier while the main process waits
    # for uploads: a barrier longer than ddp_timeout (30 min) would fail the job after training succeeded.
    state.wait_for_everyone()

    if state.is_main_process:
        if recipe.project.merge_lora:
            base, init = trainer.model_path, training.model_init_kwargs
            merged = lora.save_merged(out, base, init.get("revision"), init.get("dtype"), trainer.processing_class)
            print(f"Saved the merged model to {merged}", flush=True)
        if pusher:
            pusher.finish(hub_push.FINAL_WAIT_S)  # the card lists the pushed revisions
        records = read_metrics(out)
        plot_metrics(records, out / PLOT_FILE, title=training.run_name)
        hub.write_model_card(out, resolved, push.repo_id)
        summary = {"global_step": trainer.state.global_step, "final": records[-1] if records else None}
        (out / resolve.RUN_COMPLETE).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"Saved model, metrics and {PLOT_FILE} to {out}", flush=True)
        command = f"python scripts/push_to_hub.py {out} --repo-id {push.repo_id}"
        command += " --checkpoints" if push.checkpoints else ""
        if push.requested and offline.is_offline():
            limit = training.save_total_limit if push.checkpoints else None  # rotation deleted the older ones
            kept = f" (the last {limit} checkpoints, those still on disk)" if limit else ""
            print(f"HF_HUB_OFFLINE is set, so nothing was pushed: push{kept} from a machine that reaches the Hub "
                  f"with `{command}`", flush=True)  # fmt: skip
        elif push.requested:
            try:
                url = hub.push_run(out, push.repo_id, token=push.token, private=push.private)
            except Exception as e:  # the run itself is saved and complete: say how to push it
                raise SystemExit(f"error: pushing {out} to {push.repo_id} failed ({hub.cause(e)}); the run is saved, "
                                 f"push it with `{command}`") from None  # fmt: skip
            print(f"Pushed to {url}", flush=True)


if __name__ == "__main__":
    run_cli(main)

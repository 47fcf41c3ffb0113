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

from dpotrain import data, health, hub, offline, resolve, samples
from dpotrain.config import parse_args
from dpotrain.errors import run_cli
from dpotrain.metrics import PLOT_FILE, plot_metrics, read_metrics
from dpotrain.tracking import setup_wandb


def main(argv=None) -> None:
    load_dotenv()  # HF_TOKEN, WANDB_API_KEY, WANDB_PROJECT...; the environment wins over .env
    recipe = parse_args(argv)
    training, script = recipe.training, recipe.script

    # Everything that can be refused is refused here, before a data set or a model loads.
    resolve.check_values(recipe)
    health.check_values(recipe.project)
    samples.check_values(recipe.project)
    resolve.fill_defaults(recipe)
    if recipe.project.preflight:  # the base model's view of the data, instead of training (dpotrain/preflight.py)
        from dpotrain import preflight

        return preflight.main_from_recipe(recipe)
    world, world_source = resolve.world_size(recipe, planning=recipe.project.dry_run)
    resolve.plan_batch(recipe, world)
    derived = {"world_size": world, "world_size_source": world_source}
    if recipe.project.dry_run:
        rows = data.count_local_rows(script.dataset_name) if data.is_local(script.dataset_name) else None
        derived.update(resolve.plan_steps(recipe, world, rows))
        if recipe.max_length_auto:
            derived["max_length"] = resolve.preview_auto_max_length(recipe)
        print(json.dumps(resolve.resolved_config(recipe, derived), indent=2, default=str))
        return
    resolve.check_push(recipe)
    repo_id = training.hub_model_id or training.run_name
    if training.push_to_hub and int(os.environ.get("RANK", "0")) == 0:  # one whoami, not one per rank (rate limits)
        hub.check_write_access(repo_id, training.hub_token or resolve.hf_token())  # now, not after training
    plan = resolve.check_output_dir(recipe)
    offline.check_offline_artifacts(recipe)  # with HF_HUB_OFFLINE: model, tokenizer and data set must be cached

    from accelerate import PartialState

    state = PartialState()
    out = Path(training.output_dir)
    if plan.start_afresh and state.is_main_process:
        shutil.rmtree(out)  # a stale run_complete.json or metrics.jsonl must not outlive the run it described
    state.wait_for_everyone()
    dataset = data.load_preference_dataset(
        script.dataset_name, script.dataset_train_split, script.dataset_config, streaming=script.dataset_streaming
    )
    derived.update(resolve.plan_steps(recipe, world, len(dataset) if hasattr(dataset, "__len__") else None))
    if recipe.max_length_auto:
        derived["max_length"] = resolve.auto_max_length(recipe, dataset, state)
    if state.is_main_process:
        setup_wandb(training)

    from dpotrain.trainer import build_trainer

    trainer = build_trainer(recipe, dataset)
    derived["total_steps"] = trainer.state.max_steps or derived["total_steps"]
    derived["batching"] = trainer.batching_summary()
    resolved = resolve.resolved_config(recipe, derived | {"resumed_from": plan.resume_from})
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
        return health.HEALTH_STOP_EXIT
    if trainer.graceful_stop.stopped and trainer.state.global_step < trainer.state.max_steps:
        return  # checkpointed on a stop request; the requeued job resumes from it

    trainer.save_model(str(out))

    if state.is_main_process:
        records = read_metrics(out)
        plot_metrics(records, out / PLOT_FILE, title=training.run_name)
        hub.write_model_card(out, resolved)
        summary = {"global_step": trainer.state.global_step, "final": records[-1] if records else None}
        (out / resolve.RUN_COMPLETE).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"Saved model, metrics and {PLOT_FILE} to {out}", flush=True)
        if training.push_to_hub and offline.is_offline():
            print(f"HF_HUB_OFFLINE is set: push from a login node with "
                  f"`python scripts/push_to_hub.py {out} --repo-id {repo_id}`", flush=True)  # fmt: skip
        elif training.push_to_hub:
            token = training.hub_token or resolve.hf_token()
            url = hub.push_run(out, repo_id, token=token, private=training.hub_private_repo)
            print(f"Pushed to {url}", flush=True)
    state.wait_for_everyone()


if __name__ == "__main__":
    run_cli(main)

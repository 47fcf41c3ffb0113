"""The run's second half, from the first half's decisions (`stages.RunSpec`): the old run removed where it is replaced
(`prepare_output`), then a ready run (`build_run`, which the run, the preflight, the tests and the benchmarks all build
through) that scores the reference and trains."""

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from dpotrain import dry_run, output_folder, publish, resolve
from dpotrain.cluster import collectives
from dpotrain.data import lengths, model_identity
from dpotrain.forwards import flex
from dpotrain.hub.hub_push import CheckpointPusher
from dpotrain.recipe import hub_switches, launcher, run_record, writes
from dpotrain.recipe.errors import ConfigError
from dpotrain.reference import reference
from dpotrain.train import agreement, dropout, lora, resume
from dpotrain.train.health import HealthGuard
from dpotrain.train.preemption import STOPPED_EXIT, GracefulStop, StoppedBeforeTraining
from dpotrain.train.samples import SampleGenerator
from dpotrain.train.tracking import WandbStepIsGlobalStep, setup_wandb

# The loaded weights' hash (the reference cache's key), in resolved_config.json's `derived`; None with a live reference.
WEIGHTS_KEY = "reference_weights_sha256"


def prepare_output(spec) -> None:
    """Only now, once the data and the plans are checked (a refused data set must not cost the old run): the replaced
    run's own files go, this run's names are recorded before it writes, and W&B's run id is kept there."""
    recipe = spec.recipe

    def start() -> None:  # the main process's; a refusal of its writes (a full disk) ends every rank, not its alone
        if not recipe.project.reference_only:  # the run's own files only (output_folder.py)
            output_folder.start(recipe, spec.output.start_afresh, spec.push.requested)
            setup_wandb(recipe.training, resumes=spec.output.resume_from is not None)

    collectives.main_outcome(start)  # and no rank writes into the folder before it is cleared


@dataclass(frozen=True)
class ReadyRun:
    """A run ready to score its reference and train: what `build_run` returns."""

    spec: object  # stages.RunSpec: every decision of the first half
    trainer: object  # trainer.RecipeDPOTrainer, with its plan
    pusher: CheckpointPusher | None  # checkpoint branches pushed in the background, from the main process
    output_existed: bool  # output_dir was there before the Trainer made it

    def score_reference(self) -> list[reference.Outcome]:
        """The reference stage (dpotrain/reference/reference.py); one Outcome per data set."""
        check_reference_weights(self.spec, self.trainer)
        project = self.spec.recipe.project
        return reference.run_stage(self.trainer, project.reference_save_seconds, project.reference_only)

    def train(self, outcomes: list) -> int | None:
        """The run's record (resolved_config.json), training, then the final model saved and pushed; the exit code.
        A stop request during the reference stage (STOPPED_EXIT) and a reference-only run (0) train nothing."""
        recipe, trainer = self.spec.recipe, self.trainer
        main, out = trainer.accelerator.is_main_process, Path(recipe.training.output_dir)
        # Pairs this start scored and saved: a requeue reuses them, so a stop from here has saved something
        if any(o.scored and not o.unsaved for o in outcomes):
            trainer.graceful_stop.saved_something()
        if outcomes and outcomes[-1].stopped:  # every rank (the stop was agreed on): the main's refusal is every rank's
            stopped = outcomes[
                -1
            ]  # its own line, just printed, says what it kept: the stop line says when, and what next
            collectives.main_outcome(trainer.graceful_stop.mark_saved, stopped.stop_what(), False, stopped.line())
            return STOPPED_EXIT
        if recipe.project.reference_only:
            if main and not self.output_existed and out.is_dir() and not any(out.iterdir()):
                out.resolve().rmdir()  # made at its start (where a link points): a reference-only run writes none
            collectives.main_outcome(reference.check_cached, outcomes)  # its one product: exit 0 only if it is kept
            return 0
        # A stop asked while the model loaded or a cached reference was read ends the run before its first step
        resumed = self.spec.output.resume_from
        before = resume.before_step(resumed)
        if trainer.graceful_stop.stop_before_training(trainer.accelerator.device, before):
            return STOPPED_EXIT
        record = record_run(self.spec, trainer, outcomes)
        # And after the record: the main process hashed the model's files for it, a while for large weights
        if trainer.graceful_stop.stop_before_training(trainer.accelerator.device, before):
            return STOPPED_EXIT
        try:
            trainer.train(resume_from_checkpoint=resumed)
        except StoppedBeforeTraining:  # asked during train()'s own set-up: agreed on and reported (GracefulStop)
            return publish.end_stopped(self)  # as a stop at a step's end: the pushes queued meanwhile waited for
        return publish.save_and_push(self, record)


def check_reference_weights(spec, trainer) -> None:
    """A resume scores its reference from the weights the run started from, or is refused. model_identity.py
    compares a large weights file by its size and time alone: one replaced with its time put back (`touch -r`) was
    trained past the checkpoint against another reference, in silence. The loaded weights' hash (the cache key's) is
    recorded, and compared here, before the stage scores anything. Every rank calls it: under ZeRO-3 the main process
    holds the hash, and a LoRA run's earlier hash gathers the weights."""
    was = collectives.main_outcome(_other_weights_recorded, spec, trainer)
    if was:  # a LoRA run recorded before session 41 took TRL's hash of base and adapter: taken now, for it alone
        collectives.main_outcome(_refuse_other_weights, spec, trainer, was, trainer.earlier_lora_hash())


def _other_weights_recorded(spec, trainer) -> str | None:
    """The weights' hash the resumed run recorded, where it is not this load's; None with nothing to compare."""
    resume_from = spec.output.resume_from if spec.output else None
    if not resume_from or not trainer.weights_hash:  # a live reference model: no hash taken (TRL's)
        return None
    trained = resolve.trained_record(resume_from)
    was = trained.derived.get(WEIGHTS_KEY) if trained else None
    # The hash is of the weights in the dtype they loaded in, its name hashed too: loaded in another (--dtype, which may
    # change between attempts) the same files hash otherwise, and the resume was refused as a model whose files were
    # replaced. Those files' sizes and times are still compared at start (model_identity).
    if trained and (loaded := trained.values.get("dtype")) and spec.load_dtype and loaded != spec.load_dtype:
        return None
    return was if was and was != trainer.weights_hash else None


def _refuse_other_weights(spec, trainer, was: str, earlier: str | None) -> None:
    if was != earlier:  # LoRA: the hash it recorded before session 41
        model, resume_from = spec.recipe.model.model_name_or_path, spec.output.resume_from
        raise ConfigError(
            f"model {model!r}: the weights loaded are not those {resume_from} was trained against (SHA-256 "
            f"{trainer.weights_hash[:12]}..., the run started from {was[:12]}...): its files were replaced since the "
            "run started, keeping their size and times, and the reference log-probs would be scored from other "
            "weights: put back the model the run started from, or pass --overwrite_output_dir to start afresh"
        )


def run(spec, stop: GracefulStop) -> int | None:
    """The run's second half: the trainer built (TRL loads the model and tokenizes the pairs), the reference scored
    once (saved as it goes, stopped cleanly on a stop request), then its record, training, the final model saved and
    pushed (dpotrain/publish.py)."""
    try:
        ready = build_run(spec, stop)
    except StoppedBeforeTraining:  # asked as the model loaded or the pairs were tokenized: agreed on and said
        return STOPPED_EXIT
    return ready.train(ready.score_reference())


def build_run(spec, stop: GracefulStop | None = None, callbacks=(), trainer_class=None) -> ReadyRun:
    """The ready run of `spec`: TRL loads the model with the attention the forward stage chose and tokenizes the pairs,
    the trainer makes its plan from them, and every rank checks it decided as the others. `callbacks`: a caller's
    own, after the run's. `trainer_class`: a subclass of `RecipeDPOTrainer` to build instead (the benchmarks')."""
    from trl import get_quantization_config

    from dpotrain.train.trainer import RecipeDPOTrainer, resolve_model_path, training_arguments

    recipe, push, forward = spec.recipe, spec.push, spec.forward.planned
    p, out = recipe.project, Path(recipe.training.output_dir)
    model_path = resolve_model_path(recipe)
    tokenizer = trainer_tokenizer(spec, model_path)
    pusher = None  # checkpoint branches, pushed from the main process in the background where the Hub is reachable
    pushes = push and push.checkpoints and not hub_switches.pushes_offline()  # the user's HF_HUB_OFFLINE: none
    if pushes and launcher.launched_main() and not p.reference_only:
        pusher = CheckpointPusher(push.repo_id, push.token, push.private, out)
    optional = [WandbStepIsGlobalStep(), *([pusher] if pusher else [])]
    if forward.attention == "flex_attention":
        flex.install()  # compiled once per run, not transformers' compilation per width and training flag
        optional.append(flex.CompilationReport())
    if p.samples_every > 0:
        optional.append(SampleGenerator.from_recipe(recipe, tokenizer, every_rank=spec.launch.engine.shards_weights))
    existed = out.exists()
    if p.reference_only and launcher.launched_main():  # no lock made it: the Trainer's os.makedirs would fail on
        out.resolve().mkdir(parents=True, exist_ok=True)  # a link to a folder still to be made; made where it points
    trainer = (trainer_class or RecipeDPOTrainer)(
        model=model_path,
        processing_class=tokenizer,
        args=training_arguments(spec.as_run),
        train_dataset=spec.data.train,
        eval_dataset=spec.data.eval,
        # LoRA (--use_peft): TRL wraps the model and scores the reference with the adapter disabled (no second model).
        peft_config=lora.peft_config(spec.as_run.model),  # with the base's model_revision (lora.py)
        # --load_in_4bit/8bit, as TRL's own dpo.py (its compute dtype: the one the weights load in)
        quantization_config=get_quantization_config(spec.as_run.model),
        forward=forward,
        pairs_per_step=spec.pairs_per_step,
        max_tokens_per_microbatch=p.max_tokens_per_microbatch,
        gpu_peak_tflops=p.gpu_peak_tflops,
        run_engine=spec.launch.engine,
        stop=stop or GracefulStop.from_env(),
        health=HealthGuard(p, spec.pairs_per_step) if p.health_checks else None,
        planned_gib=spec.memory.total_gib,
        reference_multiple=spec.memory.reference_multiple,
        assistant_turns=p.assistant_turns,
        compile_layers=p.compile_layers,
        callbacks=[*optional, *callbacks],
        resume_from=spec.output.resume_from if spec.output else None,  # what a resume settles (CompleteMarker)
    )
    # What every rank decided alone (its data's lengths, its plan, its resume point...) must be the same everywhere.
    agreement.check(agreement.values(trainer, spec.output.resume_from if spec.output else None))
    return ReadyRun(spec, trainer, pusher, existed)


def trainer_tokenizer(spec, model_path: str):
    """The recipe's tokenizer with its chat template (TRL tokenizes with it, the Trainer saves it): a copy of the one
    the first half measured the pairs with, from the same place, else loaded. Loading it again cost each rank ~0.6 CPU-s
    for an 11 MB tokenizer.json (a copy ~0.35) and, for a Hub model, the Hub's answers. A copy: its pad token is set."""
    held = spec.lengths.tokenizer
    if held is not None and held.name_or_path == model_path:
        return copy.deepcopy(held)
    return lengths.recipe_tokenizer(spec.recipe, model_path)


def record_run(spec, trainer, outcomes) -> dict:
    """resolved_config.json: the first half's records, and what the trainer, its plan and the reference decided."""
    recipe, output, push = spec.recipe, spec.output, spec.push
    derived = spec.record()
    derived["batching"] = trainer.run_plan.summary
    derived |= resolve.planned_steps(recipe, spec.data.steps, derived["batching"])  # of the pairs TRL kept
    derived["reference"] = {o.name: o.record() for o in outcomes}  # its warm-up and steady tokens/s, when it scored
    derived["forward"] = trainer.forward.record()  # the attention and layout chosen (dpotrain/forwards/choice.py)
    derived["layers"] = trainer.layers_record  # the decoder layers as trained: checkpointed, compiled (layers.py)
    derived["dropout"] = dropout.active(trainer.model)  # on in training ([]: none); a resume compares it
    derived[WEIGHTS_KEY] = trainer.weights_hash  # what a resume's reference is scored from (check_reference_weights)
    record = push.record(spec.resolved_config(derived | {"resumed_from": output.resume_from}))
    # What the model loaded with (trainer.training_arguments): revision, the forward's attention, the load dtype.
    record["model_init_kwargs"] = trainer.args.model_init_kwargs

    def write() -> None:  # the main process's; the disk's refusal ends every rank, not the main alone
        # The model's files as this run loaded them (or its Hub commit): a rerun on others is refused (resolve.py)
        record["derived"]["model_identity"] = model_identity.of(recipe)
        # Each checkpoint's copy: what its steps were trained under. Here: git asked once, not by every rank
        packages = record["derived"]["packages"] = agreement.recorded_versions()
        out = Path(recipe.training.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        writes.write_text(
            out / run_record.RESOLVED, json.dumps(run_record.sealed(record), indent=2, default=str) + "\n"
        )
        # A few readable lines (the dry run's summary, as decided now); every field is in the file.
        heading = f"run of {recipe.config_path or 'the command line'}: all of it in {out / run_record.RESOLVED}"
        print(dry_run.summary(run_record.of(record), None, heading, spec.lengths.warnings), flush=True)
        if output.resume_from:
            print(f"Resuming from {output.resume_from}", flush=True)
            # An upgrade between attempts may change the loss or the optimizer's state as loaded: said, not refused
            trained = resolve.trained_record(output.resume_from)
            if trained and (changed := agreement.upgraded(trained.derived.get("packages"), packages)):
                print(
                    f"note: {output.resume_from} was trained under other package versions ({changed}); the steps "
                    "after it are trained under this run's (resolved_config.json records them): install the "
                    "checkpoint's versions to go on exactly as it started",
                    flush=True,
                )
            config = trainer.model.config
            rates = dropout.config_rates(config) | dropout.config_rates(config.get_text_config())
            if trained and (note := resume.dropout_changed(output.resume_from, trained, derived["dropout"], rates)):
                print(note, flush=True)

    collectives.main_outcome(write)
    return record

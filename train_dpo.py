"""DPO post-training with OLMo 3's recipe: TRL's DPOTrainer under Accelerate + DeepSpeed ZeRO-2.

    python train_dpo.py --config configs/smoke.yaml  # the CPU demo: a tiny OLMo 3, bundled data, no download
    python train_dpo.py --config configs/think.yaml --dry-run  # what a recipe resolves to, loading nothing
    # a real run on 4 GPUs (on Slurm: sbatch scripts/dpo_train.sh)
    accelerate launch --config_file accelerate_config.yaml train_dpo.py --config configs/think.yaml

Any TRL / transformers field is a command-line override (--learning_rate 5e-7, --max_steps 100, ...).
"""

import os
import sys
from contextlib import ExitStack, nullcontext, redirect_stdout
from dataclasses import replace
from pathlib import Path
from unittest import mock

from dpotrain.recipe import terminal, venv  # the standard library only

if __name__ == "__main__":  # first: the libraries' logging handlers and progress bars keep the streams they find
    terminal.guard_streams()  # a `| tee` killed by the same Ctrl-C must not end the run before its checkpoint
    terminal.hold_stops()  # a SIGTERM while the libraries load stops the run as one after it does, not in silence

ROOT = Path(__file__).resolve().parent

with venv.entry_point(ROOT, command=__name__ == "__main__"):  # the project's venv, then .env, then torch
    from dpotrain import dry_run, options, preflight, publish, resolve, stages, train_stage
    from dpotrain.cluster import engine, offline, run_lock
    from dpotrain.data import lengths
    from dpotrain.hub import hub
    from dpotrain.plan import memory
    from dpotrain.recipe import hub_switches, launcher, writes
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError, RunError, run_command, warn
    from dpotrain.train import agreement, disk_full, resume
    from dpotrain.train.preemption import STOPPED_EXIT, GracefulStop, StoppedBeforeTraining


# The stop line of a run stopped before --overwrite_output_dir's removal began
REPLACE_STOPPED = "stopped with none of the old run's files removed, before the model loaded"


def main(argv=None) -> None:
    command = None if argv is None else [sys.executable, str(Path(__file__).resolve()), *map(str, argv)]
    stop = GracefulStop.from_env(command)  # first: a stop while the model loads is kept; it prints `command`
    # A run sets env variables (recipe env:, .env, W&B's run id) and may turn the Hub libraries offline: an importer
    # gets its own back for its next run.
    with nullcontext() if __name__ == "__main__" else importers_own():
        try:
            result = run(argv, stop)
            engine.end_processes()  # not after an error: a rank may still be in a collective the others left
            return result
        except Exception as e:  # any write of the run that did not fit, or its folder gone: one line
            if (gone := disk_full.folder_gone(e)) is not None:
                raise gone from None
            if (denied := disk_full.read_denied(e)) is not None:
                raise denied from None
            if (full := disk_full.full_write(e)) is None:
                raise
            raise disk_full.write_failed(*full) from None
        finally:  # as the command, a late SIGTERM must not kill the exit (a FAILED job); imported: handlers back
            stop.release(exiting=__name__ == "__main__")
            run_lock.release()  # the output folder's lock (dpotrain/cluster/run_lock.py), however the run ended


def end_finished(recipe, job: str) -> None:
    """Every rank ends with 0, in no collective: each reads the same run_complete.json (a node that could not, where
    the output folder is not shared, waits for the others until the collective timeout). The main process says which
    settings now differ, takes over the killed start's lock (released as `main` ends) and says there is nothing to do,
    once in the job's log. A dry run says so on stderr, and prints no plan (launch.sh then launches the processes,
    which say it again as they take the lock over)."""
    out = recipe.training.output_dir
    if recipe.project.dry_run:
        print(resolve.finished_line(out, job), file=sys.stderr, flush=True)
        return None
    if launcher.launched_main():
        # pairs per step not compared: the launch that decides it is not planned, and nothing trains
        resolve.say_untrained_settings(recipe, Path(out), None)
        # `acquire`, not `run_lock.take`, which shares its outcome in a collective the other ranks never join (the
        # launch may have made its process group as the recipe was parsed: DeepSpeed's)
        if refused := run_lock.acquire(Path(out)):
            raise ConfigError(refused)
        print(resolve.finished_line(out, job), flush=True)
    return None


def complete_left_push(recipe, repo: str, stop: GracefulStop) -> int | None:
    """The push by the main process, in no collective (none is started): it takes the folder's lock with `acquire`
    (released as `main` ends) and pushes; the other ranks end with 0. The push's settings and token are checked as the
    run checks them, by the dry run too, which says on stderr what the run will do and prints no plan (launch.sh then
    launches the processes)."""
    if not (recipe.project.dry_run or launcher.launched_main()):
        return None
    push = hub.take_push_settings(recipe)
    push.check_token()
    out = recipe.training.output_dir
    if recipe.project.dry_run:
        print(f"output_dir {resolve.pushing_left(out, repo)}", file=sys.stderr, flush=True)
        return None
    if refused := run_lock.acquire(Path(out)):
        raise ConfigError(refused)
    return publish.complete_push(recipe, push, repo, stop)


def first_half(recipe, launch, state, output, push, stop: GracefulStop):
    """The run's first half (`stages.first_half`); None where a stop asked as the data was read ended it between its
    pieces (agreed on and said)."""
    try:
        return stages.first_half(
            recipe,
            launch,
            state,
            output,
            push,
            stop_point=lambda: stopped_early(stop, state, output),
            stop_asked=lambda: stop.asked_here(new_only=True),  # as stop_before_training asks it
        )
    except StoppedBeforeTraining:
        return None


def stopped_early(stop: GracefulStop, state, output) -> bool:
    """A stop asked by now (as the data was read) ends the run before the model loads (every rank alike). Before the
    old run's files go (--overwrite_output_dir), the command printed to go on is the one typed: it removed the finished
    run, then stopped. One asked during the removal lets it finish (`run`)."""
    if output.start_afresh:
        return stop.stop_before_training(state.device, REPLACE_STOPPED, as_typed=True)
    return stop.stop_before_training(state.device, "stopped before the model loaded")


def importers_own() -> ExitStack:
    """What a run changes in the process handed back as it was when it ends: the environment, and the Hub libraries'
    offline switches (read from it at import, so not restored with it)."""
    own = ExitStack()
    own.enter_context(mock.patch.dict(os.environ))
    own.enter_context(hub_switches.restored())
    return own


def checks(recipe, finished):
    """`stages.checks`; where they refuse in a dry run of a finished run's folder (a data file moved away since), what
    the run refuses first, reading none of it (`finished`: resolve.finished_refusal), is said before their line."""
    try:
        return stages.checks(recipe)
    except ConfigError:
        if finished:
            warn(f"the run would refuse: {finished}")
        raise


def run(argv, stop: GracefulStop) -> int | None:
    """The run, stage by stage (dpotrain/stages.py for the first half, docs/architecture.md for all of them)."""
    offline.start_run()  # no answer from the Hub yet: one a run before in this process got is not this run's
    if __name__ != "__main__":  # an importer (a notebook, the tests); a command read it before its imports, once
        venv.load_env(ROOT)  # HF_TOKEN, WANDB_API_KEY, WANDB_PROJECT...
    writes.progress_bars_on_main_only()  # one copy of each bar in a launch's log, not one per rank
    stdout = sys.stdout
    recipe = parse_args(argv)  # a dry run's parse prints to stderr: its stdout is the summary alone
    stop.take_recipe(recipe)
    disk_full.take_output_dir(recipe.training.output_dir)  # a failed write that names no file: looked for there too
    if recipe.project.dry_run or recipe.project.preflight:
        stop.not_needed()  # no checkpoint to save: Ctrl-C stops it at once (one line, run_cli)
    memory.default_allocator()  # after .env and the recipe's `env:` (a user's setting wins), before any GPU memory
    # Decided before the checks, from the output folder's records alone: a data file or model moved away since the run
    # finished (or a recipe edited for the next experiment) refused the start (`error: dataset ... does not exist`, exit
    # 2), and the job FAILED, its `afterok` dependents never started. Not a preflight's or a reference-only job's
    finished = None
    if not (recipe.project.preflight or recipe.project.reference_only):
        if job := resolve.finished_by_this_job(Path(recipe.training.output_dir)):  # a requeue of the job that finished
            return end_finished(recipe, job)
        if repo := resolve.push_left(recipe):  # a finished run's final push cut short: that push, and nothing else
            return complete_left_push(recipe, repo, stop)
        if (finished := resolve.finished_refusal(recipe)) and not recipe.project.dry_run:  # with a push left's command
            raise finished
    with redirect_stdout(sys.stderr) if recipe.project.dry_run else nullcontext():  # stdout: its summary alone
        if recipe.project.preflight:  # the base model's view of the data, instead of training (dpotrain/preflight.py)
            # The run's checks and its own first; the default sample, the recipe's seed, markdown only
            return preflight.run(recipe)
        launch = checks(recipe, finished)  # everything that can be refused from the recipe, before anything loads
        push = hub.take_push_settings(recipe, launch.engine)
        # Before the ranks meet: a refusal written once, not by every rank (a dry run lists it); a reference-only job
        # starts no W&B run (output_checks skips its W&B checks too)
        if not launch.dry_run and not recipe.project.reference_only:
            options.check_wandb_variables(recipe)
        # The process group first: what the main process asks the Hub and W&B becomes every rank's answer.
        state = None if launch.dry_run else engine.start_processes(recipe.training, launch.engine)
        if state is not None:  # once for the job: a rank offline and another online read different files
            offline.agree_on_hub(recipe)
        output, push = stages.output_checks(recipe, launch, push)  # resume, start afresh or refuse; token, W&B, offline
        if launch.dry_run:  # the dry run: the run's first half, then its record instead of training
            try:
                resolved = stages.first_half(recipe, launch, output=output, push=push)
            except (ConfigError, RunError):
                # What it listed already (a finished run's folder, a login missing), which the run refuses before it
                # reads the data: it was lost behind this refusal, and the run's first line went unsaid
                for refusal in output.would_refuse:
                    warn(f"the run would refuse: {refusal}")
                raise
            derived = resolved.record() | output.record(recipe.training.output_dir)  # and what the run would refuse
            record = push.record(resolved.resolved_config(derived))
            warnings = resolved.lengths.warnings  # for the summary, not decisions the record keeps
            caches = lengths.written_outside(resolved.data.train, resolved.data.eval)  # measured, not recorded
            return dry_run.report(record, recipe.training.output_dir, recipe.project.json, stdout, warnings, caches)
    if not recipe.project.reference_only:  # one run per output folder, taken before anything is written there
        run_lock.take(recipe.training.output_dir)  # by the main process, its outcome every rank's
    # Every rank decided alike on its folder (a node that does not see its files decides otherwise): else a rank that
    # found the run finished or a push to complete ends here, the others waiting in a collective until the timeout
    agreement.check({"the output folder's state": agreement.folder_state(output)})
    if output.finished_by:  # a requeue of the job that finished the run: its lock taken over and released
        if state.is_main_process:  # every rank ends here: one line in the job's log, not one per GPU
            print(resolve.finished_line(recipe.training.output_dir, output.finished_by), flush=True)
        return None
    explicit = output.resume_from == recipe.training.resume_from_checkpoint  # damaged: refused, not fallen back
    compare = resolve.trained_otherwise(recipe, launch.batch.pairs_per_step)  # a checkpoint fallen back to
    afresh = recipe.project.overwrite_output_dir and not explicit
    point = resume.confirm(output.resume_from, explicit=explicit, compare=compare, afresh=afresh)
    # None where every checkpoint failed its checksums under --overwrite_output_dir: the run there is replaced
    output = replace(output, resume_from=point) if point or not output.resume_from else resolve.afresh(output)
    if (spec := first_half(recipe, launch, state, output, push, stop)) is None:  # data -> lengths -> forward -> memory
        return STOPPED_EXIT
    agreement.check(agreement.first_half_values(spec))
    options.check_weights(recipe.model.model_name_or_path)  # a folder without them: before an old run's files go
    if spec.output.start_afresh and stopped_early(stop, state, spec.output):
        return STOPPED_EXIT
    train_stage.prepare_output(spec)  # the old run's files removed where it is replaced
    # After the removal: the command printed to go on drops --overwrite_output_dir, which would resume the old run.
    if stop.stop_before_training(state.device, "stopped before the model loaded"):
        return STOPPED_EXIT
    return train_stage.run(spec, stop)  # the model, the reference scored once, training, the final model and push


if __name__ == "__main__":
    run_command(main, launcher.rank(), launcher.first_on_node())  # which lines this rank writes, and how

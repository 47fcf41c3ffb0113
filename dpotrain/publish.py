"""The run's last stage: the final model saved (or not, for a doomed or preempted run), its metrics, plot, model card
and run_complete.json written, and the run pushed to the Hub where asked."""

import contextlib
from dataclasses import replace
from pathlib import Path

from huggingface_hub import get_token

from dpotrain import output_folder
from dpotrain.cluster import collectives, offline, run_lock
from dpotrain.data import model_identity
from dpotrain.hub import hub, hub_push
from dpotrain.recipe import hub_switches, run_record, writes
from dpotrain.recipe import records as run_records
from dpotrain.recipe.errors import RunError, cause, finish_wandb
from dpotrain.train import disk_full, health, lora
from dpotrain.train.metrics import PLOT_FILE, last_logged, plot_metrics, read_metrics
from dpotrain.train.preemption import STOPPED_EXIT


def save_and_push(run, resolved: dict) -> int | None:
    """After training (`train_stage.ReadyRun.train`): the exit code of a doomed or stopped run, else None once the
    final model and the run's outputs are saved and pushed."""
    recipe, trainer, pusher = run.spec.recipe, run.trainer, run.pusher
    state, out = trainer.accelerator, Path(recipe.training.output_dir)  # every rank; the main process writes
    # A doomed run (dpotrain/train/health.py): no final model, no run_complete.json, and no requeue.
    if trainer.health and trainer.health.stop:
        if state.is_main_process:
            line = health.stop_line(trainer.health.stop, str(out))
            if stop_file := trainer.graceful_stop.stop_file:  # a preemption at the same step must not requeue it either
                Path(f"{stop_file}.checkpointed").unlink(missing_ok=True)
                # For launch.sh's last line and exit code: the launcher's exit code is 1 for any worker's, and the
                # job's log ended "training failed with exit code 1 ... the same sbatch command goes on from the
                # newest complete checkpoint", which the stop refuses.
                writes.write_text(f"{stop_file}.health", line + "\n")
            # The curves are what a stopped run is read by (the loss that fell to 0, the margin that ran away)
            output_folder.claim_for_writing(out, [PLOT_FILE])
            plot_metrics(read_metrics(out), out / PLOT_FILE, title=recipe.training.run_name)
            # W&B ended the run at exit as finished (exit code 0) and printed its closing lines after the stop line:
            # ended here with the run's exit code, so the W&B run says failed and the stop line is the last one. Here,
            # not in run_cli (which ends it before every error line): this line is the run's own, printed as it returns.
            finish_wandb(health.HEALTH_STOP_EXIT)
            print(line, flush=True)
        if pusher:
            pusher.finish(hub_push.STOP_WAIT_S)
        return health.HEALTH_STOP_EXIT
    if trainer.graceful_stop.stopped and trainer.state.global_step < trainer.state.max_steps:
        return end_stopped(run)  # checkpointed on a stop request; the requeued job resumes from it

    # Written beside the folder's other files, then recorded by name and moved in (output_folder.py): the run's own
    # files are the names it wrote, not whatever changed in the folder while it saved.
    failed = None
    try:
        collectives.main_outcome(output_folder.stage_final, out)  # never through a link, nor into a person's folder
        trainer.save_model(str(out / output_folder.FINAL_STAGING))  # with use_peft: the adapter
    except Exception as e:  # noqa: BLE001 - a full disk, any failure: every rank raises it, below
        failed = disk_full.final_write(e, out)  # an EIO, a refused permission: one line naming the rerun too
    # The last collective step, and its barrier: the main process writes the model alone under DDP, and its refusal
    # left the others waiting here (NCCL: for ddp_timeout); each rank's outcome is every rank's. The other ranks end
    # here rather than wait while the main process waits for uploads: a barrier longer than ddp_timeout (30 min)
    # would fail the job after training succeeded.
    collectives.every_rank_outcome(failed)
    if state.is_main_process:
        saved = output_folder.move_in(out)
        return finish_outputs(run, resolved, saved)
    return None


def end_stopped(run) -> int:
    """Every rank of a run stopped on request inside `trainer.train`, at a step's end or before its first step (its
    set-up: a resumed run's pusher has queued the checkpoints a stopped job left unpushed by then); STOPPED_EXIT."""
    if run.pusher:
        run.pusher.finish(hub_push.STOP_WAIT_S)  # the requeued job pushes what is left
    # The ranks leave together (the stop was decided over all of them): torchrun ends every worker still running
    # as soon as one exits with a code other than 0, so a rank still at work (the main waiting for uploads) would be
    # killed at it.
    run.trainer.accelerator.wait_for_everyone()
    return STOPPED_EXIT


def finish_outputs(run, resolved: dict, saved: list[str] = ()) -> int | None:
    """The main process's outputs of a finished run: merged model, metrics, plot, card, run_complete.json, the push;
    STOPPED_EXIT where a stop request gave up the push (`push_final`). `saved`: the names the final model's save
    wrote, whose files run_complete.json records by size and SHA-256 for the pushes to check."""
    recipe, trainer, pusher, push = run.spec.recipe, run.trainer, run.pusher, run.spec.push
    training = recipe.training
    out = Path(training.output_dir)
    # A LoRA recipe's merge_lora is unused where --use_peft false runs it once as a full fine-tune (lora.check_lora):
    # no adapter to merge (PEFT's "Can't find 'adapter_config.json'" traceback once training had ended)
    merging = recipe.project.merge_lora and recipe.model.use_peft
    if merging:
        identity = resolved.get("derived", {}).get("model_identity") or {}
        # A local base written over during training (the SFT model exported again to its path) would be merged as it
        # now is, into weights the adapter never trained on: refused, naming the file. The adapter is saved already.
        # Checked before merged/ is claimed as the run's. (A Hub base loads at its recorded commit, below.)
        if identity.get("files") and (changed := model_identity.changed(recipe, identity)):
            raise RunError(
                f"the base changed since the run loaded it ({changed}), so the adapter in {out} was not merged: put "
                "the base back as it was and run the same command again to merge (or --merge_lora false to keep the "
                "adapter alone)"
            )
        output_folder.claim_for_writing(out, [lora.MERGED_DIR])
        base, init = trainer.model_path, trainer.args.model_init_kwargs  # what the model loaded with
        init = {"trust_remote_code": trainer.args.trust_remote_code, **init}  # as TRL's DPOTrainer loads it
        # A Hub base at the commit the run recorded loading: its branch may have moved since (the SFT model pushed
        # again during training), and a merge into main's newest weights is one the adapter never trained on
        if commit := identity.get(model_identity.KEY):
            init["revision"] = commit
        merged = lora.save_merged(out, base, init, trainer.model, trainer.processing_class)
        print(f"Saved the merged model to {merged}", flush=True)
    else:
        output_folder.remove_earlier_merge(out)
    if pusher:  # the card lists the pushed revisions
        # A stop request (the time limit's warning, a preemption) gives the wait up, the uploads left recorded
        # unfinished; the run's outputs are written all the same (the local files of seconds), and push_final gives
        # the final push up on the same request: STOPPED_EXIT, the requeue pushing both (complete_push). Main
        # process alone: the other ranks ended after the final model's save, none waits in a collective.
        with contextlib.suppress(hub_push.PushStopped):
            pusher.finish(hub_push.FINAL_WAIT_S, trainer.graceful_stop.asked_to_end)
    records = read_metrics(out)
    output_folder.claim_for_writing(out, [PLOT_FILE, hub.CARD])
    plot_metrics(records, out / PLOT_FILE, title=training.run_name)
    best = hub.best_of(trainer.state)
    hub.write_model_card(out, run_record.of(resolved), push.repo_id, best)
    # the best evaluation kept for push_to_hub.py, which lists the checkpoint branches again after pushing them
    summary = completion(trainer.state.global_step, records) | ({"best": best} if best else {})
    if job := run_lock.slurm_job():  # a requeue of this job after its end is told from another start (resolve.py)
        summary["slurm_job_id"] = job
    # The model as saved, checked by every push (hub.check_saved_model): files damaged or garbled since (a bad disk
    # block, a copy to a login node) were pushed to main as the run's model, and the push said done.
    merged = [lora.MERGED_DIR] if merging else []
    summary[hub.MODEL_FILES] = hub.saved_model(out, [*saved, *merged])
    # The final push recorded as started before the run is marked complete: a job killed between the two (Slurm's
    # SIGKILL after a time limit's SIGTERM, a node lost) left a finished run the rerun refused, and a requeue of the
    # same job ended on "nothing to do", the push asked for never made nor named. The rerun completes it
    # (resolve.push_left).
    started = push.requested and not hub_switches.pushes_offline()
    if started:
        hub_push.record_push(out, step=summary["global_step"], branch="main", status="started", repo=push.repo_id)
    writes.write_text(out / hub.RUN_COMPLETE, run_records.dumps(summary, indent=2) + "\n")
    print(f"Saved model, metrics and {PLOT_FILE} to {out}", flush=True)
    measured = next((r for r in reversed(records) if "memory/peak_rss_gib" in r), None)  # peaks since the start
    if measured is not None:
        print(f"Memory, the run's peak: {trainer.memory_use.line(measured)}", flush=True)
    return push_final(out, push, training, trainer.graceful_stop, started)


def completion(step: int, records: list[dict]) -> dict:
    """run_complete.json: the step the run ended at, its last training record (`final`, the model card's final
    metrics) and, where it evaluated, its last evaluation (`final_eval`): an evaluation at the last step is logged after
    that step's training record, and `final` was the evaluation's, without the training loss."""
    evaluated = last_logged(records, "eval_loss")
    return {"global_step": step, "final": last_logged(records)} | ({"final_eval": evaluated} if evaluated else {})


def complete_push(recipe, push, repo: str, stop=None) -> int | None:
    """A rerun of a finished run whose final push was started and not confirmed (resolve.push_left: the job was killed
    while pushing, the push failed, or a stop request gave it up; the line says which, `cut_short`): that push, to
    `repo` (the one it started on, as the dry run and the refusal name it), and nothing else; by the main process alone
    (train_dpo.complete_left_push). Not the command's hub_model_id: a rerun with --push_to_hub alone, as the refusal
    advises, would push to a repo named after the run instead."""
    offline = hub_switches.pushes_offline()  # the user's HF_HUB_OFFLINE: push_final names push_to_hub.py
    if stop is not None:
        stop.nothing_to_train(pushing=not offline)
    out = Path(recipe.training.output_dir)
    push = replace(push, repo_id=repo)
    now = "not now (below)" if offline else "pushing it now"  # HF_HUB_OFFLINE: push_final says how
    print(
        f"output_dir {out}: a finished run whose push to {push.repo_id} was started and not confirmed "
        f"({cut_short(hub_push.unconfirmed_push(out))}): {now}; nothing is trained",
        flush=True,
    )
    if push.checkpoints and not offline:  # offline, push_final names push_to_hub.py --checkpoints
        push_checkpoints_left(out, push, stop)
    return push_final(out, push, recipe.training, stop)


def cut_short(record: dict | None) -> str:
    """Why the final push is left unconfirmed, as hub_pushes.jsonl's latest line of it says (hub.push_run): a start
    alone is a job killed while pushing; a stop request's `unfinished` and a failure carry their reason."""
    status, error = (record or {}).get("status"), (record or {}).get("error")
    if status == "unfinished":
        return f"the push was left unfinished: {error}" if error else "the push was left unfinished"
    if status == "failed":
        return f"the push failed: {error}" if error else "the push failed"
    return "the job was killed while pushing"


def push_checkpoints_left(out: Path, push, stop) -> None:
    """A rerun completing the push: first the run's complete checkpoints still on disk that hub_pushes.jsonl does not
    record on the Hub (those a stop request gave up while the end of training waited for them, recorded unfinished),
    each to its branch of the push's repo, and the card's list of revisions made again for main. A stop request gives
    it up as it gives the end of training's wait up; push_final then ends the run on the same request."""
    pusher = hub_push.CheckpointPusher(push.repo_id, push.token, push.private, out)
    pusher.submit_left()
    with contextlib.suppress(hub_push.PushStopped):
        pusher.finish(hub_push.FINAL_WAIT_S, stop.asked_to_end if stop is not None else None)
    if (out / hub.CARD).is_file():
        hub.update_card_revisions(out, push.repo_id)


def push_final(out: Path, push, training, stop=None, started: bool = False) -> int | None:
    """The finished run to main of its repo where asked (its start and its confirmation recorded by hub.push_run), or
    with HF_HUB_OFFLINE the command that pushes it later. A push still running when the job is asked to end (`stop`,
    preemption.GracefulStop: the time limit's warning, a preemption) is given up, recorded `unfinished`, and the run
    ends with STOPPED_EXIT, `.checkpointed` telling launch.sh to requeue: the requeue completes the push
    (resolve.push_left). Waited for, it hung until Slurm's kill, and a time limit's job is not
    requeued. `started`: its start already recorded (finish_outputs)."""
    command = hub_push.push_command(out, "--repo-id", push.repo_id, *(["--checkpoints"] if push.checkpoints else []))
    if push.requested and hub_switches.pushes_offline():
        limit = training.save_total_limit if push.checkpoints else None  # rotation deleted the older ones
        kept = f" (the last {limit} checkpoints, those still on disk)" if limit else ""
        kept = " (the last checkpoint, the one still on disk)" if limit == 1 else kept
        print(
            f"HF_HUB_OFFLINE is set, so nothing was pushed: push{kept} from a machine that reaches the Hub "
            f"with `{command}`",
            flush=True,
        )
    elif push.requested:
        asked = stop.asked_to_end if stop is not None else None
        try:
            with hub_switches.online_for_push():  # a Hub slow to answer at start: the run's own offline switch lifted
                url = hub.push_run(
                    out, push.repo_id, token=push.token, private=push.private, stop_asked=asked, started=started
                )
        except hub_push.PushStopped:
            what = (
                # One parenthesis: the stop line goes on with when ("... 3 s after the request"), glued to "training
                # nothing" before; launch.sh's requeue line with its requeue
                f"the final push to {push.repo_id} was given up unfinished (recorded in {out / hub_push.PUSH_RECORD};"
                " the run is saved and complete, and the same command pushes it, training nothing)"
            )
            stop.saved_something()  # the run is complete: its requeue pushes, training nothing
            stop.mark_saved(what)
            return STOPPED_EXIT
        except Exception as e:  # noqa: BLE001 - the run is saved and complete: say how to push it
            if isinstance(e, hub_push.UnrecordedPush):  # on the Hub: no "failed", no other command
                raise
            raise push_failed(e, out, push.repo_id, command, push.token) from None
        print(f"Pushed to {url}", flush=True)
    return None


def push_failed(error: Exception, out: Path, repo: str, command: str, token: str | None = None) -> RunError:
    """The run's line for a final push that failed, naming the command that pushes it. RunError, not SystemExit:
    run_command writes its line where launch.sh looks for a run's own `error:` line (`<stop file>.refused`); a
    SystemExit left none, and the job's last line said "training failed ... srun stopped every node ... its traceback
    is above", of a run that trained to its end and has no traceback. `token`: the push's (None: the one
    huggingface_hub finds), named by its source where the Hub refused it."""
    if (
        hub_push.status_of(error) == 401
    ):  # at the commit: the token revoked during training (at the repo's creation: hub.py)
        error = offline.InvalidToken(offline.invalid_token(token or get_token()))
    # push_to_hub.py fails the same way until the card is fixed or the token replaced: the fix first, then the command
    if isinstance(error, (hub.CardRefused, offline.InvalidToken)):
        return RunError(f"{error.refusal}, then push it with `{command}`; the run is saved and main was not pushed")
    return RunError(f"pushing {out} to {repo} failed ({cause(error)}); the run is saved, push it with `{command}`")

"""Which checkpoint a rerun goes on from, or why it may not: resume exactly or refuse.

- Only a verified checkpoint is resumed from: its COMPLETE mark, its manifest listing the optimizer's and scheduler's
  state, every file at its size (before anything loads) and checksum (once processes have started: `confirm`). The
  automatic resume takes the newest verified one of the run's own (run_files.json names it), saying why it skipped
  newer ones; one named with --resume_from_checkpoint that cannot be verified is refused.
- A run stopped by a health guard is remembered (`HEALTH_STOP`): the same command is refused with the fix.
- A folder whose only checkpoints were cut short holds nothing to resume: the identical rerun (a requeue) starts afresh.
"""

import json
import shlex
from pathlib import Path

from dpotrain.cluster import collectives, engine, run_lock
from dpotrain.recipe import launcher, run_record
from dpotrain.recipe import records as run_records
from dpotrain.recipe.cli import FALSE, TRUE
from dpotrain.recipe.errors import ConfigError, RunError, cause, plural
from dpotrain.recipe.writes import is_file, write_text
from dpotrain.train import agreement, checkpoint_manifest, run_files
from dpotrain.train.checkpoints import (
    CUT,
    MARKER,
    UNMARKED,
    checkpoints,
    gone,
    is_complete,
    own_checkpoints,
    passed_over,
    step_of,
)
from dpotrain.train.run_files import MANIFEST

GONE = "its folder is gone since the run saved it (run_files.json names it: moved or deleted)"
STATE_FILE = "trainer_state.json"  # transformers' record of the step a checkpoint was saved at
HEALTH_STOP = "health_stop.json"  # written by a run a health guard stopped (dpotrain/train/health.py)
# A DeepSpeed ZeRO checkpoint's optimizer shards, one per process. `*zero_pp_rank_`: under bf16 (every GPU recipe)
# DeepSpeed names them `bf16_zero_pp_rank_*`; missed, every requeue of a bf16 ZeRO run was refused as a checkpoint
# "written without DeepSpeed"
ZERO_OPTIMIZER_SHARDS = "global_step*/*zero_pp_rank_*_optim_states.pt"


def _say(line: str) -> None:
    if launcher.launched_main():  # before the processes start: every rank runs this
        print(line, flush=True)


def unverified(folder: Path) -> str | None:
    """Why `folder` is no checkpoint to resume from (no COMPLETE mark, `checkpoint_manifest.problem`); None: verified,
    but for its checksums (`confirm`)."""
    problem = checkpoint_manifest.problem(folder)
    if is_complete(folder):
        return problem or renamed(folder) or record_changed(folder)
    if was_complete(folder):  # the mark gone since
        gone = f"its {MARKER} mark is gone since the run wrote it ({MANIFEST} lists it as complete)"
        return gone + (f"; {problem}" if problem else "")
    return f"no {MARKER} mark ({CUT}, or not this project's)" + (f"; {problem}" if problem else "")


def was_complete(folder: Path) -> bool:
    """Marked complete by the run: the mark is there, or `run_files.completed` lists it (the mark deleted since, or
    left out of a restore). One without its mark is then damaged, never cut short: with every checkpoint's mark
    removed, the rerun took them all for cut short, started afresh and deleted them."""
    return is_complete(folder) or folder.name in run_files.completed(folder.parent)


def record_changed(folder: Path) -> str | None:
    """The checkpoint's copy of resolved_config.json against its checksum, hashed before anything loads (a small
    file): the rerun's settings are compared with it then. Edited at the same size (a learning rate "fixed" to the
    rerun's), it passed that comparison, failed its checksum only once processes had started, and the checkpoint
    before it was gone on from unchecked: trained at the old rate under a record of the new one."""
    listed = (checkpoint_manifest.read(folder) or {}).get(run_record.RESOLVED)
    if listed and checkpoint_manifest.sha256(folder / run_record.RESOLVED) != listed["sha256"]:
        return f"{run_record.RESOLVED} does not match its checksum (damaged after it was written)"
    return None


def renamed(folder: Path) -> str | None:
    """A checkpoint-N whose trainer_state.json was saved at another step: rotation and the run's records go by the
    name, and the resume by the state, so it cannot be verified as the step it names."""
    try:
        named, saved = step_of(folder), saved_step(folder)
    except (ValueError, IndexError):  # not named checkpoint-N: nothing to compare
        return None
    if saved is None or saved == named:
        return None
    # A renamed folder's state is the one sealed in it: one that is not was edited after the seal (the step too), and
    # the fix is the file's, not the name's. One small file hashed, where the rename is suspected.
    listed = (checkpoint_manifest.read(folder) or {}).get(STATE_FILE)
    if listed and checkpoint_manifest.sha256(folder / STATE_FILE) != listed["sha256"]:
        return f"{STATE_FILE} does not match its checksum (damaged after it was written)"
    return f"its {STATE_FILE} was saved at step {saved} (renamed from checkpoint-{saved}?): give it back its name"


def newest_verified(out: Path, before: Path | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest of the run's own checkpoints (older than `before`) that passes `unverified`, and the newer ones passed
    over, each with why. Never a person's copy: the run would go on from weights it did not train."""
    folders = own_checkpoints(out)
    if before is not None:
        folders = [p for p in folders if step_of(p) < step_of(before)]
    skipped = []
    for folder in reversed(folders):
        why = unverified(folder)
        if why is None:
            return folder, skipped
        skipped.append((folder, why))
    return None, skipped


def latest_sound_checkpoint(out: Path, before: Path | None = None, refuse: bool = True) -> Path | None:
    """The newest verified checkpoint (older than `before`), each newer one passed over said in a line (a person's
    too). With none left: refused when a complete checkpoint failed its checks (`refuse`), else None."""
    found, skipped = newest_verified(out, before)
    own, low, high = own_checkpoints(out), step_of(found) if found else -1, step_of(before) if before else float("inf")
    for folder in [p for p in checkpoints(out) if p not in own and low < step_of(p) < high]:
        _say(f"Not resuming from {folder}: not this run's ({MANIFEST} does not name it)")
    passed_over.update(folder.absolute() for folder, _ in skipped if was_complete(folder))
    # One the run saved and someone moved or deleted since is passed over as a damaged one is, not in silence: with
    # every checkpoint gone, the rerun said "no checkpoint: training again from step 1", as if none had been saved.
    missing = [(p, GONE) for p in gone(out) if low < step_of(p) < high]
    skipped = sorted(skipped + missing, key=lambda found: -step_of(found[0]))
    damaged = any(was_complete(folder) for folder, _ in skipped) or bool(missing)
    if found is not None or damaged:
        for i, (folder, why) in enumerate(skipped):
            _say(f"Not resuming from {folder}: {why}; {next_step(found is None and i == len(skipped) - 1)}")
    if found is None and damaged and refuse:
        raise ConfigError(no_sound_checkpoint(out, [f"{folder.name}: {why}" for folder, why in skipped]))
    return found


def next_step(last: bool) -> str:
    """What a skipped checkpoint's line says comes next: the oldest one skipped, with nothing verified before it, said
    "trying the checkpoint before it" just before the refusal that none was left."""
    return "no verified checkpoint before it" if last else "trying the checkpoint before it"


def no_sound_checkpoint(out: Path, damaged: list[str], afresh: bool = False) -> str:
    if afresh:
        return (
            f"output_dir {out} has no checkpoint left to resume from ({'; '.join(damaged)}): starting afresh, as "
            "--overwrite_output_dir asks"
        )
    named = "folder or file" if any(GONE in why for why in damaged) else "file"
    return (
        f"output_dir {str(out)!r} has no checkpoint left to resume from ({'; '.join(damaged)}): restore "
        f"each named {named} from a copy, or pass --overwrite_output_dir to start afresh"
    )


def confirm(resume_from: str | None, explicit: bool, compare=None, afresh: bool = False) -> str | None:
    """On every rank once processes have started: the resume point's checksums, each rank its share; a damaged
    checkpoint is skipped for the previous sound one (refused where named with --resume_from_checkpoint), whose
    settings `compare` gives as they differ from the run's (`check_fallen_back`). With none left: refused, or None
    where --overwrite_output_dir asks to start afresh (`afresh`)."""
    # First, that every rank found the same checkpoint: else they would run different collectives below and hang.
    agreement.check({"the resume point": str(resume_from)})
    rank, world = collectives.rank_and_world()
    folder, damaged = Path(resume_from) if resume_from else None, []
    while folder is not None:
        every_rank = collectives.gather_objects(checkpoint_manifest.checksum_problems(folder, rank, world))
        found = [p for part in every_rank for p in part]
        if denied := next((p for p in found if checkpoint_manifest.DENIED in p), None):
            # Every rank has `found`: all refuse together. Passed over as damaged, the run went on from an older one
            # and deleted this sound one as it saved that step again (with none older, the refusal's
            # --overwrite_output_dir deleted them all)
            raise RunError(
                f"{folder}/{denied}: a checkpoint this job cannot read is not passed over as damaged (the run would "
                f"go on from an older one and delete it): make it readable (chmod -R a+rX {shlex.quote(str(folder))}, "
                "or ask its owner), then rerun"
            )
        if not found:
            if (
                compare is not None
                and str(folder) != resume_from
                and check_fallen_back(folder, damaged, compare, afresh)
            ):
                return None
            return str(folder)
        damaged.append(f"{folder.name}: {found[0]}")
        passed_over.add(folder.absolute())
        if explicit:
            raise RunError(
                f"resume_from_checkpoint {str(folder)!r} is damaged ({found[0]}): restore the file, or "
                "name another checkpoint"
            )
        if rank == 0:
            last = newest_verified(folder.parent, before=folder)[0] is None
            print(f"Not resuming from {folder}: {found[0]}; {next_step(last)}", flush=True)
        folder = latest_sound_checkpoint(folder.parent, before=folder, refuse=False)
        if folder is None and afresh:
            # --overwrite_output_dir resumed an unfinished run of the same settings: with none of its checkpoints
            # sound it starts afresh, as the flag asks; refused, the line named that very flag as the way out
            if rank == 0:
                print(no_sound_checkpoint(Path(resume_from).parent, damaged, afresh=True), flush=True)
            return None
        if folder is None:
            raise RunError(no_sound_checkpoint(Path(resume_from).parent, damaged))
    return None


def check_fallen_back(folder: Path, damaged: list[str], compare, afresh: bool = False) -> bool:
    """A checkpoint `confirm` falls back to, compared with the run's settings as the one chosen before it was
    (resolve.check_output_dir, before its checksums were read): fallen back to unchecked, another run's checkpoint
    copied over the run's own (another learning rate, seed or data) was resumed from, under a record of this run's
    settings, exit code 0. The main process compares (`compare`: resolve.trained_otherwise), every rank refuses; or,
    under --overwrite_output_dir (`afresh`), which replaces a run of other settings, every rank returns True: the run
    starts afresh (refused, the flag went unread)."""
    if not (changed := collectives.main_outcome(compare, folder)):
        return False
    what = (
        f"{damaged[0]}, and {folder.name}, the checkpoint before it, was written by a run with other settings "
        f"({'; '.join(changed)})"
    )
    if afresh:
        if collectives.rank_and_world()[0] == 0:
            print(f"output_dir {folder.parent}: {what}: starting afresh, as --overwrite_output_dir asks", flush=True)
        return True
    newest = damaged[0].split(":", 1)[0]
    raise ConfigError(
        f"output_dir {str(folder.parent)!r}: {what}: not resumed from; restore {newest}'s file from a copy, or pass a "
        "new --output_dir"
    )


def check_state_left(checkpoint: str) -> None:
    """As training resumes from the checkpoint (the trainer's `train`, before transformers reads any of it), minutes
    after `confirm` verified it, the reference stage between: a file gone since (the rotation of a run started in its
    folder after the live-lock check; a person) and transformers went on with a fresh optimizer, in silence. Its
    manifest's files and sizes looked at again (no checksums: `confirm`'s), before any step."""
    if why := checkpoint_manifest.problem(Path(checkpoint)):
        raise RunError(
            f"checkpoint {checkpoint!r} changed after the resume verified it ({why}), before training resumed from "
            "it: nothing was trained; restore it from a copy (one in another run's folder: copied out, cp -r, "
            "while no run trains there), then run the same command again"
        )


def check_explicit(folder: str, out: Path) -> None:
    """--resume_from_checkpoint: a checkpoint that passes `unverified`, in no other live run's folder (`out`: this
    run's); else refused, naming the one to pass instead."""
    check_not_live(folder, out)
    if not Path(folder).is_dir():
        # One gone (its run's rotation deleted it: the command of a resume run again as it was typed) where output_dir
        # holds the run's progress since: "a rerun of the same command" was refused again, and under --auto_resume
        # false so was the command without it
        newest = newest_verified(out)[0]
        # transformers' `train(resume_from_checkpoint=True)`, given as a word: what the run does by itself
        fix = (
            "it names a checkpoint-N folder; drop it, and a rerun resumes from output_dir's newest verified "
            "checkpoint by itself (--auto_resume false: never; --overwrite_output_dir: starts afresh)"
            if folder.lower() in TRUE + FALSE
            else f"pass --resume_from_checkpoint {shlex.quote(str(newest))}, the newest verified checkpoint in "
            "output_dir"
            if newest
            else "name a checkpoint-N folder (a rerun of the same command resumes from the newest one by itself)"
        )
        raise ConfigError(f"resume_from_checkpoint {folder!r} is not a folder: {fix}")
    if why := unverified(Path(folder)):
        # A run's folder named for one of its checkpoints: the newest of those; else the one beside it
        inside, _ = newest_verified(Path(folder))
        instead = inside or newest_verified(Path(folder).parent)[0]
        fix = (
            f"pass --resume_from_checkpoint {shlex.quote(str(instead))}, the newest verified checkpoint "
            f"{'in' if inside else 'beside'} it"
            if instead
            else f"restore each named file from a copy, or {new_run_from(folder)}"
            if holds_a_checkpoint_or_weights(Path(folder))
            else "it holds no checkpoint, nor weights to start from: name a checkpoint-N folder (a rerun of the same "
            "command resumes from the newest one by itself)"
        )
        raise ConfigError(f"resume_from_checkpoint {folder!r} cannot be verified ({why}): {fix}")


def check_not_live(folder: str, out: Path) -> None:
    """A checkpoint in another run's folder while that run trains there (its lock live): its rotation
    (save_total_limit) or a save of that step deletes the checkpoint while this run loads it, minutes later, after the
    reference stage, and transformers goes on without the optimizer state it no longer finds, in silence. Verified at
    start, it is not this run's to keep: refused before anything loads."""
    run = Path(folder).resolve().parent
    if run == Path(out).resolve():
        return
    try:
        held = run_lock.live_holder(run)
    except run_lock.LockUnreadable as denied:  # a colleague's folder, its lock 0600: whether that run trains, unknown
        raise ConfigError(
            f"resume_from_checkpoint {folder!r} is in {str(run)!r}, whose {run_lock.LOCK_FILE} this run cannot read "
            f"({cause(denied.error)}): whether another run trains there now, whose save_total_limit rotation may "
            "delete that checkpoint while this run loads it, cannot be told: copy the checkpoint out of its folder "
            "(cp -r) and resume from the copy"
        ) from None
    if held is None:
        return
    raise ConfigError(
        f"resume_from_checkpoint {folder!r} is in {str(run)!r}, where another run is training now "
        f"({run_lock.describe(*held)}; {run / run_lock.LOCK_FILE}): its save_total_limit rotation may delete that "
        "checkpoint while this run loads it, which would then go on without its optimizer state: wait for that run "
        "to end, or copy the checkpoint out of its folder (cp -r) and resume from the copy"
    )


def holds_a_checkpoint_or_weights(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint's state or a model (a run's final folder): else the advice to restore its
    files or start from its weights sent a user who named an empty or unrelated folder to train from nothing."""
    return any((folder / name).is_file() for name in ("trainer_state.json", "config.json", "adapter_config.json"))


def check_steps_left(named: str | None, out: Path, total: int | None) -> None:
    """A checkpoint of another run saved at this run's last step (or past it): resumed into `out`, the run would train
    nothing and record a finished run with no metrics. Its own run's (in `out`) is finished by a rerun: the final model
    is written from it."""
    if not named or not total or total <= 0 or Path(named).resolve().parent == out.resolve():
        return
    step = saved_step(Path(named))
    if step is not None and step >= total:
        raise ConfigError(
            f"resume_from_checkpoint {named!r} was saved at step {step}, and the run ends at step {total} (max_steps "
            f"or num_train_epochs, which a resume keeps as its checkpoint was trained): it would train nothing; to "
            f"train on, {new_run_from(named)}"
        )


def before_step(resumed: str | None, reference_only: bool = False) -> str:
    """The stop line of a start stopped before its first step: step 1, or the one after the resumed checkpoint's; a
    --reference_only run, which trains no step, before its reference stage."""
    if reference_only:
        return "stopped before the reference stage"
    return f"stopped before step {(saved_step(Path(resumed)) or 0) + 1 if resumed else 1}"


def saved_step(folder: Path) -> int | None:
    """The step a checkpoint was saved at (trainer_state.json, else its name); None: unknown."""
    try:
        return int(json.loads((folder / STATE_FILE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return step_of(folder)
        except (ValueError, IndexError):  # a checkpoint renamed by hand
            return None


def past_named(named: str, out: Path, auto: bool = True) -> Path | None:
    """The run's newest verified checkpoint in `out` saved past the named one (`explicit_point`); None: none, or
    --auto_resume false (`auto`). The named one's step is read from its name where its folder is gone."""
    newest, _ = newest_verified(out) if auto else (None, [])
    if newest is None or newest.resolve() == Path(named).resolve():
        return None
    past, start = saved_step(newest), saved_step(Path(named))
    return None if past is None or start is None or past <= start else newest


def requeued_past(named: str, out: Path, auto: bool = True) -> bool:
    """Whether this start is a Slurm requeue that goes on from the job's own checkpoint past the named one
    (`explicit_point`), never loading the named one: its checks (another run's live lock, its folder since rotated
    away by that run) are not this start's, and refused the job's own requeue."""
    return bool(run_lock.slurm_restart()) and past_named(named, out, auto) is not None


def explicit_point(named: str, out: Path, auto: bool = True) -> str:
    """Where a run given --resume_from_checkpoint goes on from. Verified checkpoints past the named one are what its
    next rerun or requeue would resume from. In a requeued Slurm job they are the job's own progress, gone on from:
    the requeue runs the same command, and went back to the named checkpoint each time (a job preempted more often
    than it reached its end never ended). Before a first start they are another course of the run: refused, as the
    next rerun would go on from them silently, and rotation keep them over this run's newest. With --auto_resume
    false (`auto`): the named one, always."""
    newest = past_named(named, out, auto)
    if newest is None:
        return named
    if restart := run_lock.slurm_restart():
        _say(
            f"resume_from_checkpoint {named}: this job was requeued (Slurm restart {restart}) after saving {newest}: "
            "going on from that one, not back to the checkpoint named"
        )
        return str(newest)
    start = saved_step(Path(named))
    raise ConfigError(
        f"output_dir {str(out)!r} holds {newest.name}, past resume_from_checkpoint {named!r} (step {start}), which the "
        "run's next rerun or requeue would go on from, not from this run's progress: drop --resume_from_checkpoint "
        f"(one the recipe file names: add --resume_from_checkpoint '') to go on from {newest.name}, move the "
        f"checkpoints past step {start} out of that folder to go back to the one named, or pass a new --output_dir"
    )


def check_partitions(folder: str | None, world: int, run_engine=None, bf16: bool | None = None) -> None:
    """A DeepSpeed ZeRO checkpoint resumes only on the number of processes that wrote it: DeepSpeed cannot repartition
    its optimizer state (it raises after the weights load). Nor does one cross between DeepSpeed and the other engines
    (`run_engine`): DeepSpeed loads only its own `global_step*`, the others go on with a fresh optimizer, silently.
    An FSDP2 checkpoint resumes under FSDP2 alone, and FSDP2 resumes its own alone (torch.distributed.checkpoint
    looks for its shards' metadata in a whole checkpoint, and raises after the model loads). `bf16`: the run's, which
    a DeepSpeed checkpoint must match (`check_zero_precision`)."""
    if folder is None:
        return
    written = len(list(Path(folder).glob(ZERO_OPTIMIZER_SHARDS)))
    fix = AFRESH
    processes = lambda n: plural(n, "process")
    if written and written != world:
        raise ConfigError(
            f"checkpoint {folder!r} holds DeepSpeed ZeRO optimizer state partitioned over {processes(written)}, and "
            f"this run has {world}: resume it on {processes(written)}, or {fix}"
        )
    # transformers loads FSDP's shards under FSDP alone: one process, DDP or DeepSpeed loaded the model and scored the
    # reference, then raised. Any number of FSDP2 processes loads them: torch.distributed.checkpoint reshards (2 -> 4
    # processes: the same weights).
    sharded = len(list(Path(folder).glob("pytorch_model_fsdp_*/*.distcp")))
    if sharded and run_engine is not None and run_engine.name != "fsdp2":
        raise ConfigError(
            f"checkpoint {folder!r} holds FSDP2 shards (written by {processes(sharded)}), which only an FSDP2 launch "
            f"loads, and this run is {run_engine.name} ({processes(world)}): resume it under FSDP2 "
            "(ACCELERATE_CONFIG=configs/accelerate/fsdp2.yaml, on any number of GPUs), or start afresh (a new "
            "--output_dir)"
        )
    if run_engine is not None and run_engine.name == "fsdp2" and not sharded and not written:
        # An FSDP2 run saves shards alone (a launch writing whole checkpoints is refused): these are another engine's
        raise ConfigError(
            f"checkpoint {folder!r} was written without FSDP2 (one process or DDP: whole weights and optimizer.pt), "
            f"and this run is FSDP2 ({processes(world)}), which loads only its own shards: resume it with the launch "
            f"that wrote it, or {fix}"
        )
    if run_engine is None or bool(written) == run_engine.deepspeed:
        check_zero_stage(folder, run_engine)
        check_zero_precision(folder, run_engine, bf16)
        return
    if written:
        raise ConfigError(
            f"checkpoint {folder!r} holds DeepSpeed ZeRO optimizer state, and this run does not use DeepSpeed (engine: "
            f"{run_engine.name}), which would go on with a fresh optimizer: resume it under the DeepSpeed launch that "
            f"wrote it, or {fix}"
        )
    raise ConfigError(
        f"checkpoint {folder!r} was written without DeepSpeed (one process, DDP or FSDP), and this run uses DeepSpeed "
        f"({run_engine.name}, {processes(world)}), which cannot load it: resume it with the launch that wrote it (one "
        f"process: `python train_dpo.py` with the same arguments, without accelerate launch), or {fix}"
    )


# Where each ZeRO stage's launch is configured, named in the refusal of the other's checkpoint
ZERO_CONFIGS = {
    "zero2": "ACCELERATE_CONFIG=accelerate_config.yaml, the default",
    "zero3": "ACCELERATE_CONFIG=configs/accelerate/zero3.yaml",
}


def check_zero_stage(folder: str, run_engine) -> None:
    """A ZeRO-2 checkpoint resumes under ZeRO-2 alone, a ZeRO-3 one under ZeRO-3: DeepSpeed looks for the model state
    files of the stage it runs (ZeRO-3's one per rank, `zero_pp_rank_*_mp_rank_*_model_states.pt`; ZeRO-2's one,
    `mp_rank_*_model_states.pt`) and, finding none, ends every rank in a bare AssertionError once the model has loaded
    and the reference has been scored."""
    if run_engine is None or not run_engine.deepspeed:
        return
    states = [p.name for p in Path(folder).glob("global_step*/*mp_rank_*_model_states.pt")]
    if not states:
        return  # no DeepSpeed state here; check_partitions says what else the checkpoint lacks
    stage = "zero3" if all(name.startswith("zero_pp_rank_") for name in states) else "zero2"
    if stage == run_engine.name:
        return
    raise ConfigError(
        f"checkpoint {folder!r} was written by {engine.NAMES[stage]}, whose optimizer and model state "
        f"{engine.NAMES.get(run_engine.name, run_engine.name)} cannot load: resume it under {engine.NAMES[stage]} "
        f"({ZERO_CONFIGS[stage]}), or {AFRESH}"
    )


def check_zero_precision(folder: str, run_engine, bf16: bool | None) -> None:
    """A DeepSpeed checkpoint resumes only with the bf16 setting that wrote it: DeepSpeed names a bf16 run's optimizer
    shards `bf16_zero_pp_rank_*` and loads only the names of its own precision, and loads the weights in bf16 under
    bf16 alone (`engine.load_dtype`). A requeue with --bf16 turned off (or on), a change "precision" was said to allow,
    loaded the model, then was refused as a model whose "files were replaced since the run started" (the loaded
    weights' hash is taken in their dtype); past it, DeepSpeed's FileNotFoundError (the other precision's shards)."""
    if run_engine is None or not run_engine.deepspeed or bf16 is None:
        return
    shards = sorted(p.name for p in Path(folder).glob(ZERO_OPTIMIZER_SHARDS))
    if not shards or all(name.startswith("bf16_") for name in shards) == bool(bf16):
        return
    was, now = ("true", "false") if bf16 is False else ("false", "true")
    raise ConfigError(
        f"checkpoint {folder!r} was trained under DeepSpeed with bf16 {was} (its optimizer state: {shards[0]}), and "
        f"this run has bf16 {now}: DeepSpeed loads only the optimizer state and weights of its own precision: resume "
        f"it with --bf16 {was}, or {AFRESH}"
    )


REFERENCE_FILE = "reference_model.safetensors"  # TR-DPO's moved reference, in each checkpoint (moved_reference.py)


def check_live_reference(folder: str | None, recipe) -> None:
    """TR-DPO (`sync_ref_model`) moves its reference model toward the policy as it trains: a resume without it scored
    against the base model again, another loss than the stopped run's, in silence. Every engine's checkpoint holds it
    (`REFERENCE_FILE`, in its manifest, which verifies it: one there unlisted fails `checkpoint_manifest.problem`);
    one without it (written by an older version) is refused."""
    if folder is None or not recipe.training.sync_ref_model or (Path(folder) / REFERENCE_FILE).is_file():
        return
    raise ConfigError(no_reference(folder))


def no_reference(folder: str) -> str:
    return (
        f"checkpoint {folder!r} is of a TR-DPO run (sync_ref_model), whose reference model moved toward the "
        f"policy as it trained; the checkpoint does not hold it ({REFERENCE_FILE}), so a resume would train against "
        f"the base model as reference: train again from the start in a new --output_dir, or {new_run_from(folder)} "
        "(its reference starts there)"
    )


def dropout_changed(checkpoint: str, trained, now: list[str], rates: dict[str, float]) -> str | None:
    """The line a resume says where the checkpoint trained with other dropout than the steps after it will (`now`,
    `dropout.active` as recorded in `derived.dropout`): a version between attempts that turns off more of the dropout a
    model applies itself (dropout.py). Said, and gone on with (as a package upgrade is): the fix is the resume's, and a
    refusal would strand the run (`--disable_dropout false` brings back TRL's Dropout modules too). A record without the
    field was written before it was kept, by a version that left the rates a model applies itself on (of `rates`, its
    config's: which ones, only the model's code says)."""
    recorded = trained.derived.get("dropout")
    if recorded is None and rates and trained.settings.disable_dropout:
        was = ", ".join(f"{name} {rate:g}" for name, rate in rates.items())
        # "may": a rate only a Dropout module applies (GPT-2's resid_pdrop) was off then too (TRL's disable_dropout)
        return (
            f"note: {checkpoint}'s record does not say what dropout it trained with: written before the record kept "
            f"it, it may have trained with the dropout its model applies itself on ({was} in its config), which "
            f"disable_dropout now turns off; the steps after it train with {', '.join(now) or 'none'}, as "
            "resolved_config.json now records (derived.dropout)"
        )
    if recorded is None or sorted(recorded) == sorted(now):
        return None
    return (
        f"note: {checkpoint} trained with dropout {', '.join(recorded) or 'off'}, and the steps after it train with "
        f"{', '.join(now) or 'none'} (another version of dropout.disable), as resolved_config.json now records "
        "(derived.dropout)"
    )


# --- a health stop, remembered -------------------------------------------------------------------------------------


def remember_health_stop(output_dir: str, alarm) -> None:
    """Main process, when a guard stops the run: what stopped it, for the rerun (`after_health_stop`)."""
    record = {"guard": alarm.guard, "step": alarm.step, "message": alarm.message, "fatal": alarm.fatal}
    write_text(Path(output_dir) / HEALTH_STOP, json.dumps(record, indent=2) + "\n")


def after_health_stop(recipe, out: Path) -> bool:
    """A rerun of a run a health guard stopped: refused (it would resume on the values it stopped on), afresh with
    --overwrite_output_dir (True), gone on with `health_action: warn` (False). No record: False."""
    path = out / HEALTH_STOP
    if not is_file(path):  # `writes.looked`: unanswered (ESTALE) is no record gone, and the stop not resumed past
        return False
    if recipe.project.overwrite_output_dir:  # whatever the record says
        _say(f"output_dir {out}: a health guard stopped it ({path}); starting afresh (--overwrite_output_dir)")
        return True
    fix = (
        "it says which health guard stopped the run: pass --overwrite_output_dir to start afresh, or delete it to go "
        "on from the checkpoint the stop wrote"
    )
    stop = run_records.read_record(path, fix)
    what = f"the {stop.get('guard')} guard stopped it at step {stop.get('step')}"
    if recipe.project.health_action == "warn" and not stop.get("fatal"):
        _say(f"output_dir {out}: {what}; going on from its checkpoint, as health_action: warn asks")
        return False
    go_on = "" if stop.get("fatal") else " (or --health_action warn to go on from its checkpoint anyway)"
    again = (
        "resuming would train on the values it stopped on"
        # A non-finite stop wrote no checkpoint: the complete ones are earlier, whose resume trains into the NaN again
        if not stop.get("fatal") and any(map(is_complete, own_checkpoints(out)))
        else "the same command would fail the same way"
    )
    raise ConfigError(
        f"output_dir {str(out)!r}: {what}, and {again}: fix the cause the stop named, then rerun with "
        f"--overwrite_output_dir to start afresh{go_on}"
    )


def only_cut_short(out: Path, changed: list[str]) -> bool:
    """Whether the run's own checkpoints were all cut short under the rerun's settings: a requeue then starts afresh."""
    folders = own_checkpoints(out)
    ran_here = (out / run_record.RESOLVED).is_file()  # written as training starts: a run of this project was here
    if not folders or any(map(was_complete, folders)) or changed or not ran_here:
        return False
    _say(f"output_dir {out}: {', '.join(p.name for p in folders)} {UNMARKED}, nothing to resume from: starting afresh")
    return True


def say_afresh(out: Path, save_strategy) -> None:
    """A rerun over an unfinished run that left no checkpoint (killed before its first save, or never saving) trains
    its steps again from the start: said, not done in silence."""
    why = " (save_strategy no)" if save_strategy == "no" else ""
    _say(f"note: output_dir {out} holds an unfinished run with no checkpoint{why}: training again from step 1")


def say_hand_edit(out: Path, checkpoint, trained: Path) -> None:
    """A rerun resuming `checkpoint` over a `<out>/resolved_config.json` edited by hand (a value "fixed" before the
    resume): a run takes its settings from its recipe and command line, compared with the checkpoint's own record
    (`trained`, the folder holding it), and writes the file anew as training starts. The edit was overwritten in
    silence, the user believing it trained: said in one line, naming the values edited where the checkpoint's
    record differs."""
    path = Path(out) / run_record.RESOLVED
    now = run_records.json_object(path)  # none, or damaged: read (and refused) by the comparison itself
    if now is None or not run_record.edited(now):
        return
    was = run_records.read_record(Path(trained) / path.name, run_records.RESOLVED_FIX) if trained != out else None
    found = _differences(was, now) if was is not None else []
    where = f" ({'; '.join(found[:4])}{'; ...' if len(found) > 4 else ''})" if found else ""
    _say(
        f"note: {path} was edited after the run wrote it{where}: a resume takes its settings from the recipe and "
        f"command line, checked against {checkpoint}'s own record, so the edit is not used and the file is written "
        "anew as training starts; to train with another value, pass it with a new --output_dir"
    )


def _differences(was: dict, now: dict) -> list[str]:
    """`field: <checkpoint's> -> <file's>` for each value that differs (the derived ones as `derived.<name>`)."""
    pairs = [(k, was.get(k), now.get(k)) for k in dict.fromkeys([*was, *now]) if k not in ("derived", run_record.SEAL)]
    old, new = (r.get("derived") if isinstance(r.get("derived"), dict) else {} for r in (was, now))
    pairs += [(f"derived.{k}", old.get(k), new.get(k)) for k in dict.fromkeys([*old, *new])]
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in pairs if a != b]


# A copy, not the folder itself: the run that saved it deletes it when its rotation lets it go, and the new run reads
# its base again at every resume (output_folder refuses a model inside an unfinished run's checkpoint).
AFRESH = "start afresh (a new --output_dir) from its weights (--model_name_or_path on a copy of the checkpoint folder)"


def new_run_from(checkpoint) -> str:
    """The advice to start a new run from `checkpoint`'s weights; for a LoRA adapter (no run starts from one:
    options.check_model), from its base model."""
    if (Path(checkpoint) / "adapter_config.json").is_file():
        return (
            "start a new run from its base model with --use_peft true (it holds a LoRA adapter, which a run cannot "
            "start from), a new --output_dir"
        )
    return (
        f"start a new run from a copy of its weights (cp -r {shlex.quote(str(checkpoint))} <new folder>, then "
        "--model_name_or_path <new folder> and a new --output_dir)"
    )

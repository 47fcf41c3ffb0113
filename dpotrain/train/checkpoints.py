"""Checkpoints that are safe to resume from.

transformers writes `checkpoint-N/` file by file, so a job killed mid-save leaves a folder that looks like a
checkpoint. `CompleteMarker` writes `COMPLETE` once every rank has finished its part; resuming only picks a folder
with that mark. `save_total_limit` keeps that many *complete* checkpoints, rotated after the new one is marked
(transformers rotates before, and could delete the newest complete one). Only the main process deletes, and only the
run's own checkpoints (run_files.json's): a person's `checkpoint-N` is kept, or moved aside where the run saves.
"""

import errno
import json
import os
import re
import shlex
import shutil
import time
from pathlib import Path

from accelerate import PartialState
from transformers import TrainerCallback

from dpotrain.cluster import collectives
from dpotrain.recipe import writes
from dpotrain.recipe.errors import ConfigError, cause, warn
from dpotrain.train import checkpoint_manifest, run_files

MARKER = "COMPLETE"
# A folder without the mark, as its lines name it: a save killed before its mark leaves one, and so does a deletion
# killed midway (`remove` takes the mark first; rotation's, a person's rm -r), so its lines name neither as the cause.
CUT = "a save or a deletion cut short"
UNMARKED = f"incomplete (no {MARKER} mark: {CUT})"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_told: set[str] = set()  # checkpoints not the run's that rotation has said it keeps (said once per process)
# Complete checkpoints this process's resume found damaged and passed over: rotation counts them as cut short (kept
# as one of `save_total_limit`, a damaged one had the older sound one deleted in its place).
passed_over: set[Path] = set()  # absolute paths
# The checkpoint the Hub pusher (hub_push.CheckpointPusher, same process) could not stage, its read failing: rotation
# keeps it until staged, one at a time (the newest). Deleted first, its step was lost while the warning promised a
# later push "while it is still on disk" (CompleteMarker rotates before the pusher's on_save).
unstaged: set[Path] = set()  # absolute paths
_held_said: set[Path] = set()  # those rotation has said it keeps (once each; by path, as _told's names are not)
_unsure_said: set[Path] = set()  # those rotation kept, their mark's look unanswered (said once each)
_unread_said: set[str] = set()  # output folders whose record rotation could not read (said once each)
# What rotation says of a record it cannot read (run_files.read's fix): no folder can be told the run's then.
ROTATION_FIX = (
    "so no checkpoint there can be told the run's and none is deleted: restore it from a copy, or remove the "
    "checkpoints save_total_limit lets go yourself; a later save reads it again"
)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """`checkpoint-N` folders of `output_dir`, oldest step first, complete or not. A link is none (`links`)."""
    root = Path(output_dir)
    if not writes.is_dir(root):  # `writes.looked`: an unanswered look is no folder gone
        return []
    found = (p for p in root.iterdir() if not p.is_symlink() and writes.is_dir(p) and _CHECKPOINT.match(p.name))
    return sorted(found, key=step_of)


def links(output_dir: str | Path) -> list[Path]:
    """`checkpoint-N` names of `output_dir` that are symbolic links. A run makes none, so none is its checkpoint,
    whatever its record says: resumed from, it would be read as the run's without being it; rotated, its folder
    was never deleted (shutil.rmtree does not follow a link) yet dropped from the record; written at its step, the
    save ended in `OSError: Cannot call rmtree on a symbolic link`. Refused at a run's start (`refuse_links`)."""
    root = Path(output_dir)
    found = root.iterdir() if writes.is_dir(root) else ()
    return sorted((p for p in found if p.is_symlink() and _CHECKPOINT.match(p.name)), key=step_of)


def refuse_links(output_dir: str | Path) -> None:
    """One `error:` line for a `checkpoint-N` link in a run's folder (`links`), naming the two fixes."""
    if found := links(output_dir):
        link = found[-1]
        target = os.path.realpath(link)
        put = f"rm {shlex.quote(str(link))} && mv {shlex.quote(target)} {shlex.quote(str(link))}"
        raise ConfigError(
            f"output_dir {str(output_dir)!r} holds {link.name}, a link to {target}: a run resumes from, rotates and "
            "writes only checkpoint folders it wrote there, never through a link (which it can neither verify as its "
            f"own nor delete): put the folder itself there ({put}), or move the link out of the output folder"
        )


def recorded_names(output_dir: str | Path) -> list[str] | None:
    """The run's own names (run_files.json; None: no record), an old checkpoint pattern read as the folder's."""
    names = run_files.read(Path(output_dir))
    if names is not None and run_files.OLD_CHECKPOINTS in names:
        names = [n for n in names if n != run_files.OLD_CHECKPOINTS] + [p.name for p in checkpoints(output_dir)]
    return names


def own_checkpoints(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` folders the run's record names, oldest step first (without a record: all)."""
    own, found = recorded_names(output_dir), checkpoints(output_dir)
    return found if own is None else [p for p in found if p.name in own]


def gone(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` the run's record lists as marked complete whose folder is no longer there (moved or deleted
    since the run saved it: a scratch cleaner, an `rm` to free space), oldest step first. The run drops a name from
    its record as it deletes the folder itself (rotation, a save the disk could not take); a name only claimed is a
    save killed before its folder was made, not one gone."""
    root, names = Path(output_dir), run_files.completed(Path(output_dir))
    return sorted((root / n for n in names if _CHECKPOINT.match(n) and not os.path.lexists(root / n)), key=step_of)


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is a checkpoint folder's (`checkpoint-<N>`)."""
    return _CHECKPOINT.match(name) is not None


def step_of(folder: Path) -> int:
    """The step of a `checkpoint-N` folder."""
    return int(folder.name.rsplit("-", 1)[1])


def is_complete(folder: Path) -> bool:
    # `writes.looked`: an unanswered look at the mark is raised, never a complete checkpoint rotated as cut short
    return writes.is_file(folder / MARKER)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir` with the mark, oldest step first."""
    return [p for p in checkpoints(output_dir) if is_complete(p)]


def rotate(output_dir: str | Path, limit: int | None, keep: tuple = ()) -> list[Path]:
    """Deletes what `save_total_limit` lets go among the run's own checkpoints, and returns it. Kept: the `limit`
    newest complete ones (by step, as resuming picks them), the folders in `keep` (the one just written, the best) and
    the one the Hub pusher could not stage (`unstaged`); deleted: the other complete ones, and every one without the
    mark. Nothing without a limit."""
    if not limit or limit <= 0:
        return []
    try:  # a damaged or unanswered record: its refusal ended the whole run from the main process's save
        own = set(run_files.read(Path(output_dir), ROTATION_FIX) or ())
    except ConfigError as e:
        if str(output_dir) not in _unread_said:
            _unread_said.add(str(output_dir))
            print(f"Rotation deleted nothing in {output_dir}: {e}", flush=True)
        return []
    try:
        found = checkpoints(output_dir)
    except OSError as e:  # a folder's look unanswered (ESTALE): unsure what is there, so nothing is deleted
        print(
            f"Rotation deleted nothing in {output_dir}: it could not be listed ({cause(e)}); "
            "a later save lists it again",
            flush=True,
        )
        return []
    if others := [p.name for p in found if p.name not in own and p.name not in _told]:
        _told.update(others)
        print(f"Kept {', '.join(others)} in {output_dir}: not this run's ({run_files.MANIFEST}), never rotated")
    mine = [p for p in found if p.name in own]
    marks = {p: marked(p) for p in mine}  # None: unanswered, kept (a complete one rotated as cut short is lost)
    sound = [p for p in mine if marks[p] and p.absolute() not in passed_over]
    kept = {p.name for p in sound[-limit:]} | {Path(k).name for k in keep if k}
    doomed, stayed = [p for p in mine if (p.name not in kept or p not in sound) and marks[p] is not None], []
    for folder in [p for p in doomed if p.absolute() in unstaged]:
        doomed.remove(folder)
        if folder.absolute() not in _held_said:
            _held_said.add(folder.absolute())
            print(
                f"Kept {folder}, which save_total_limit lets go, for its push to the Hub: its files could not be "
                "staged (recorded failed); it goes once staged",
                flush=True,
            )
    for folder in doomed:
        if not marks[folder]:
            print(f"Removed {folder}: {UNMARKED}, never resumed from", flush=True)
        elif folder.absolute() in passed_over:
            print(f"Removed {folder}: damaged (the resume passed over it), never resumed from", flush=True)
        # One the run cannot delete (made read-only, chmod -w, by a person keeping it): the errors were ignored, its
        # mark left and taken for a person's file ("Kept COMPLETE ...: not the run's"), and the folder dropped from
        # the run's record while it stayed, whole and marked. Said, and it stays the run's.
        # Unlisted as complete first: a kill between the folder's deletion and the record's rewrite (`disown`) left it
        # listed, and a rerun named it gone, moved or deleted by someone, to be restored from a copy.
        try:
            listed = run_files.incomplete(output_dir, folder.name)
        except (ConfigError, OSError) as e:  # the record unread or unwritten since: the folder kept, not unrecorded
            stayed.append(folder)
            print(f"Kept {folder}, which save_total_limit lets go: {cause(e)}; a later save tries again", flush=True)
            continue
        try:
            remove(folder)
        except OSError as e:
            stayed.append(folder)
            if listed and marked(folder, say=False) is not False:  # its mark stayed too (or unanswered): listed again
                relist(Path(output_dir), folder.name)
            print(
                f"Could not remove {folder} ({cause(e)}), which save_total_limit lets go: it stays, still this run's; "
                f"{removal_fix(folder, e)}, or remove it yourself",
                flush=True,
            )
    return [folder for folder in doomed if folder not in stayed]


def relist(output_dir: Path, name: str) -> None:
    """`name` listed complete again (a folder rotation could not remove); a record that fails then is said, not raised
    out of rotation: the folder stays whole and marked, only unnamed "gone" should it go later."""
    try:
        run_files.completed(output_dir, name)
    except (ConfigError, OSError) as e:
        print(
            f"{output_dir / name} stays, but is not listed complete again in the run's record: {cause(e)}", flush=True
        )


def marked(folder: Path, say: bool = True) -> bool | None:
    """Whether `folder` is marked complete; None where the look went unanswered (ESTALE, EIO), said once: rotation
    keeps it, never raises (it ended the whole run, from the main process's save)."""
    try:
        return is_complete(folder)
    except OSError as e:
        if say and folder.absolute() not in _unsure_said:
            _unsure_said.add(folder.absolute())
            print(
                f"Kept {folder}: its {MARKER} mark could not be looked at ({cause(e)}), so rotation cannot tell "
                "whether save_total_limit lets it go; a later save looks again",
                flush=True,
            )
        return None


def removal_fix(folder: Path, error: OSError) -> str:
    """The mending of a checkpoint rotation could not remove, by the error's kind: "make it writable" alone was said of
    an I/O error, a stale mount or a manifest that could not be read too, where chmod mends nothing; "mend its file
    system" of a folder not empty or busy (a file held open), where nothing is broken."""
    # EROFS too: what a folder made read-only reads as where the tests stand in for chmod -w (run as root)
    if isinstance(error, PermissionError) or error.errno == errno.EROFS:
        return f"make it writable (chmod -R u+w {shlex.quote(str(folder))}) for a later save to remove it"
    # NFS's .nfsXXXX of a file still open (an evaluation reading the checkpoint): nothing to mend, it passes
    if error.errno in (errno.ENOTEMPTY, errno.EBUSY):
        return "a file in it may be held open by another process; a later save removes it"
    return (
        "mend its file system (an I/O error or a stale mount, not a permission: ask your admins) for a later save to "
        "remove it"
    )


def remove(folder: Path) -> None:
    """Deletes a checkpoint folder, its COMPLETE mark first: a kill midway (rmtree goes in the folder's own order)
    left the mark on a folder that had lost its optimizer state or weights, counted complete by rotation and pushed
    as a checkpoint by `push_to_hub.py --checkpoints`; without the mark it is a save cut short, as it now is.
    A file its manifest does not list is a person's (an evaluation's results written into it while the run trained,
    deleted with it before): the run's files go, its manifest last, and the folder stays with the person's."""
    (folder / MARKER).unlink(missing_ok=True)
    listed = checkpoint_manifest.read(folder) if writes.is_dir(folder) and not folder.is_symlink() else None
    theirs = [rel for rel, _ in checkpoint_manifest.listing(folder)] if listed else []  # none listed: all the run's
    if not (theirs := sorted(r for r in theirs if r not in listed and r != checkpoint_manifest.MANIFEST)):
        shutil.rmtree(folder)
        return
    for rel in listed:
        (folder / rel).unlink(missing_ok=True)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):  # global_step4/, emptied
        if not any(sub.iterdir()):
            sub.rmdir()
    (folder / checkpoint_manifest.MANIFEST).unlink()
    them = "it" if len(theirs) == 1 else "them"
    print(f"Kept {', '.join(theirs)} in {folder}: not the run's (its MANIFEST.json does not list {them})", flush=True)


def clear_for_save(output_dir: str | Path, global_step: int) -> None:
    """Main process, before `checkpoint-<global_step>` is written: one left from an earlier attempt is removed, so the
    new one never holds the old one's files or mark. One the run did not write is moved aside, never removed: refused
    at the run's start (`output_folder.check_checkpoints_of_others`), it was put there while the run trained."""
    folder = Path(output_dir) / f"checkpoint-{global_step}"
    passed_over.discard(folder.absolute())  # written anew: sound once marked
    if not run_files.set_aside_if_not_own(output_dir, folder.name) and writes.is_dir(folder):
        state = "complete" if is_complete(folder) else UNMARKED
        print(f"Removed {folder} of an earlier attempt ({state}) before writing it again", flush=True)
        run_files.incomplete(output_dir, folder.name)  # first: killed after the removal, it is no checkpoint gone
        remove(folder)
        if os.path.lexists(folder):
            # A person's files `remove` kept ("Kept ...: not the run's"): written into, the new seal listed them as the
            # checkpoint's, and its rotation deleted them. Moved aside with them, as a person's checkpoint-N is.
            run_files.disown(output_dir, [folder.name])
            run_files.set_aside_if_not_own(output_dir, folder.name)


class CompleteMarker(TrainerCallback):
    """Marks a checkpoint complete after all ranks saved it (`on_save` runs after `_save_checkpoint` returns), rotates,
    and reports how long the save took from `save_started` (set by `RecipeDPOTrainer._save_checkpoint`)."""

    save_started: float | None = None  # time.monotonic() when the checkpoint's save began
    spent = None  # called with the seconds each save took: the throughput clock leaves them out (as samples')
    model: tuple[str, ...] = ()  # the names its model's save wrote (main process: `RecipeDPOTrainer.save_model`)

    def __init__(self, resume_from: str | None = None):
        # The run's resume point, which every rank agreed on (agreement.check): on_train_begin's broadcast is keyed on
        # it, never on a rank's own state.global_step (transformers reads trainer_state.json behind os.path.isfile,
        # which says no for any OSError: that rank skipped the broadcast the others entered)
        self.resume_from = resume_from

    def on_save(self, args, state, control, **kwargs):
        PartialState().wait_for_everyone()  # DeepSpeed ranks write their own optimizer shards
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        # Every rank hashes its share; the main process writes MANIFEST.json, then the mark, each flushed to disk.
        marker = json.dumps({"global_step": state.global_step, "time": time.time()}) + "\n"
        checkpoint_manifest.seal(folder, MARKER, marker, state.is_world_process_zero, self.model)

        def rotated() -> None:  # the main process's; its refusal ends every rank, not the main alone (collectives)
            run_files.completed(Path(args.output_dir), folder.name)  # gone later: moved or deleted (`gone`)
            if self.save_started is not None:
                report_save(state.global_step, time.monotonic() - self.save_started)
            rotate_recorded(args, state, folder)

        collectives.main_outcome(rotated)
        # A save is no training: counted, the next log's tokens_per_second and MFU fell with the file system's speed
        # (a 4 s save on the CPU demo: 241 tokens/s at the step after it, ~3,000 at the others), and the card's mean
        if self.spent and self.save_started is not None:
            self.spent(time.monotonic() - self.save_started)
        self.save_started, self.model = None, ()
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        # A stop mid-epoch (a preemption's, a health guard's) saves at its step, or on a non-finite state saves
        # nothing; then the Trainer ends the epoch, whose save (save_strategy epoch) or evaluation finding a new best
        # (save_strategy best, eval_strategy epoch) wrote that step again: the complete checkpoint removed ("of an
        # earlier attempt") and rewritten in the grace time, lost if the kill came meanwhile, or the NaN state the
        # guard refused saved and marked complete, rotation deleting a sound one for it. The epoch did not end: no
        # save nor evaluation (the last step's, at max_steps, are kept).
        if control.should_training_stop and state.global_step < state.max_steps:
            control.should_save = control.should_evaluate = False
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        # transformers takes save_steps, logging_steps and eval_steps from the resumed checkpoint's trainer_state.json
        # (a warning alone): a resume with --save_steps 2 of a run that saved every 4 saved every 4, under a record of
        # 2. They may change between attempts: this run's own are put back, as its record says (every rank).
        state.compute_steps(args, state.max_steps)
        # Every rank, on the agreed resume point alone: all join the same broadcast, or none does.
        if self.resume_from:
            collectives.main_outcome(settle_resumed, args, state, self.resume_from)
        return control


def rotate_recorded(args, state, folder: Path) -> None:
    """Main process: rotation after `folder` (kept, with the best), the record then naming what is there."""
    deleted = rotate(args.output_dir, args.save_total_limit, keep=(folder, state.best_model_checkpoint))
    if not deleted:  # nothing to unlist: its record unread, a line at every save naming nothing
        return
    try:
        run_files.disown(args.output_dir, [p.name for p in deleted])
    except (ConfigError, OSError) as e:  # deleted, but still named: as a save killed before its folder, passed over
        print(f"The run's record still names {', '.join(p.name for p in deleted)}, deleted: {cause(e)}", flush=True)


def settle_resumed(args, state, resume_from: str) -> None:
    """Main process, as a resume begins: what `CompleteMarker.on_save` does after a mark, done for the run's newest
    checkpoint it resumes from. A kill right after that mark (a lost node, Slurm's kill past its grace time) left it
    unlisted as complete in run_files.json (so not named gone if moved or deleted later) and the rotation undone: a
    resume from the last step saves nothing, and the finished run kept a whole checkpoint past save_total_limit. Not
    where newer checkpoints lie past it (passed over as damaged, or named resume_from_checkpoint): a save settles
    those, never this. Only where `resume_from` IS that folder (by its real path): matched by its step alone, a
    --resume_from_checkpoint /elsewhere/checkpoint-4 listed the run's own checkpoint-4 complete and rotated the
    folder's older ones, though nothing was resumed from it."""
    own = own_checkpoints(args.output_dir)
    folder = own[-1] if own else None
    if folder is None or Path(resume_from).resolve() != folder.resolve() or not is_complete(folder):
        return
    run_files.completed(Path(args.output_dir), folder.name)
    rotate_recorded(args, state, folder)


def report_save(step: int, seconds: float) -> None:
    """How long a checkpoint took, and a warning when that is more than a stop leaves for it (DPOTRAIN_SAVE_WARN_S
    and DPOTRAIN_GRACE_S, exported by scripts/launch.sh)."""
    print(f"checkpoint-{step} written in {seconds:.1f} s", flush=True)
    for name, what in (
        ("DPOTRAIN_SAVE_WARN_S", "what the time-limit warning leaves (raise #SBATCH --signal=B:USR1@<seconds>)"),
        (
            "DPOTRAIN_GRACE_S",
            "the partition's preemption GraceTime (a preempted job is killed before its checkpoint is complete: ask "
            "your admins for a longer GraceTime, or save to a faster file system)",
        ),
    ):
        limit = float(os.environ.get(name) or 0)
        if limit and seconds > limit:
            warn(f"checkpoint-{step} took {seconds:.0f} s, longer than the {limit:.0f} s of {what}")

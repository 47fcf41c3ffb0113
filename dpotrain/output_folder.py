"""The output folder holds one run, and the run owns only its own files (docs/reliability.md).

A run records the top-level names it writes in `run_files.json` before anything else; `--overwrite_output_dir` removes
exactly those, and a person's files stay. A folder of files but no run is refused; a run from before records is
resumed, never replaced; and a run reads nothing from its own folder, whose files it may remove.
"""

import os
import re
import shlex
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path

from dpotrain.cluster import collectives, run_lock
from dpotrain.data import data_identity, mixture
from dpotrain.hub.hub import CARD, REPLACED, RUN_COMPLETE
from dpotrain.hub.hub_push import PUSH_RECORD
from dpotrain.recipe import run_record, writes
from dpotrain.recipe.errors import ConfigError, RunError, cause, plural
from dpotrain.recipe.writes import unwritable
from dpotrain.train import run_files
from dpotrain.train.checkpoints import MARKER, checkpoints, is_checkpoint_name, recorded_names, step_of
from dpotrain.train.checkpoints import remove as remove_checkpoint
from dpotrain.train.lora import MERGED_DIR
from dpotrain.train.metrics import METRICS_FILE, PLOT_FILE
from dpotrain.train.resume import HEALTH_STOP, new_run_from, saved_step
from dpotrain.train.run_files import MANIFEST, claim
from dpotrain.train.samples import SAMPLES_FILE
from dpotrain.train.tracking import RUN_ID_FILE

# The final model is written here, then its names recorded and moved in: what `save_model` writes depends on the
# model, the engine and LoRA. Claimed only as it saves, so one there that the record does not name is a person's.
FINAL_STAGING = ".final_model"
# What a file browser or an editor leaves in any folder it shows: a folder holding only them is empty to its owner.
BROWSER_FILES = (".DS_Store", ".ipynb_checkpoints", "Thumbs.db", "desktop.ini")
# What a refusal of an input in the output folder says of that folder, and what to do
_NEVER_READ = (
    "a run writes and removes its own files there (checkpoints, the final model, the old run's under "
    "--overwrite_output_dir), so it never reads from there"
)
_COPY_OUT = "copy it out of that folder first, or pass another --output_dir"
# Files a run writes in its folder that a data set's glob may match (`check_outside_data`)
_RUN_PATHS = (
    METRICS_FILE,
    SAMPLES_FILE,
    run_record.RESOLVED,
    RUN_COMPLETE,
    CARD,
    "model.safetensors",
    "checkpoint-1/trainer_state.json",
)


def run_names(recipe, pushes: bool) -> list[str]:
    """The top-level names this run's settings make it write at its start; the final model, checkpoints, staging
    folders, card, plot and merged model are recorded as they are written (a person's README.md in a stopped run's
    folder is not the run's by name)."""
    t, p = recipe.training, recipe.project
    # HEALTH_STOP: a guard's stop, which a replacing run must remove with the rest (its rerun would be refused)
    names = [MANIFEST, run_record.RESOLVED, METRICS_FILE, RUN_COMPLETE, HEALTH_STOP]
    names += [SAMPLES_FILE] if p.samples_every else []
    names += ["wandb", RUN_ID_FILE] if "wandb" in (t.report_to or []) else []
    names += [PUSH_RECORD] if pushes else []
    return names


def read_manifest(out: Path) -> list[str] | None:
    """The names the run in `out` recorded as its own; None without a record. An earlier format named the card, plot
    and merged model from the start: they are the run's only where it finished, else they may be a person's."""
    names = recorded_names(out)
    if names is not None and not run_files.of_this_format(out) and not writes.exists(out / RUN_COMPLETE):
        names = [n for n in names if n not in (CARD, PLOT_FILE, MERGED_DIR)]
    return names


def is_legacy_run(out: Path) -> bool:
    """A run written before runs recorded their files: it has the marks only this project writes."""
    # `writes.looked`: an unanswered look raised, never a run's folder taken for a person's or for empty
    return writes.exists(out / RUN_COMPLETE) or writes.exists(out / run_record.RESOLVED) or bool(checkpoints(out))


def same_folder_above(path: Path, folder: Path) -> Path | None:
    """`path` or the folder above it that is `folder`, by device and inode, not by name (a bind mount or a
    case-insensitive file system reaches a folder by a path no link resolves to); None: outside it."""
    try:
        key = folder.stat()
    except OSError:
        return None
    for above in (path, *path.parents):
        try:
            if os.path.samestat(key, above.stat()):
                return above
        except OSError:  # not made yet (an output folder), or a folder this user may not look in
            continue
    return None


def check_outside_data(output_dir: str, data_names: list[str], patterns: tuple[str, ...] = ()) -> None:
    """datasets reads every file under a folder of data files: a run's folder inside one would be read as data at its
    next start, and a requeue refused for changed data. So does a `data_files` glob (`pairs/**/*.jsonl`) that matches
    the run's own files: it matched none at the first start, then its metrics.jsonl at every rerun, refused as an
    input in output_dir."""
    from fsspec.utils import glob_translate  # here: datasets' dependency, which a lent GPU's image is not known to have

    out = Path(output_dir).expanduser().resolve()
    ours = [f"{folder}/{name}" for folder in {os.path.abspath(out), str(out)} for name in _RUN_PATHS]
    for pattern in patterns:
        if found := next((path for path in ours if re.match(glob_translate(pattern), path)), None):
            raise ConfigError(
                f"output_dir {output_dir!r} is where the data_files glob {pattern!r} matches the run's own files "
                f"({found}): read as pairs at its next start, they would get every rerun and requeue refused; pass an "
                "--output_dir the glob does not reach, or a narrower glob"
            )
    if name := data_folder_above(out, data_names):
        raise ConfigError(
            f"output_dir {output_dir!r} is inside the data folder {name!r}, every file of which datasets reads as "
            "data: the run's own files would be read as pairs at its next start (a requeue too); pass an "
            "--output_dir outside it"
        )


def data_folder_above(path: Path, data_names: list[str]) -> str | None:
    """The name of the folder of data files (not a saved data set) among `data_names` that `path` is in, or None."""
    for name in filter(None, data_names):  # None: no local data set (a Hub name is no folder here)
        folder = Path(name).expanduser()
        if folder.is_dir() and not data_identity.saved(folder) and same_folder_above(path, folder):
            return name  # by name, or by another name (a bind mount)
    return None


def check_reports_outside_data(paths: dict[str, str | None], data_names: list[str]) -> None:
    """A command's reports (flag -> path) refused inside a folder of data files it reads: datasets reads every file
    there at the next read, by the run and the analyzer alike. The analyzer's `--json` report in it was read as a row
    whose `chosen` is a struct (the folder refused for a column of two types), and two `--plot` images made datasets
    read the folder as images, refused as a data set with no chosen/rejected columns."""
    for flag, path in paths.items():
        if path and (name := data_folder_above(Path(path).expanduser().resolve().parent, data_names)):
            raise ConfigError(
                f"{flag} {path!r} is inside the data folder {name!r}, every file of which datasets reads as data: "
                "the report would be read with the pairs by the next run or analysis of it; write it outside the folder"
            )


def _writable_and_free(out: Path, lock: bool) -> None:
    """The main process's checks (the others of a launch would find the lock it just took): on a file system this
    machine has, writable, and (`lock`, the run's: not a dry run's) free."""
    if top := writes.missing_top(out):
        # A dry run on a login node plans a job whose nodes may mount what the login node lacks
        elsewhere = "; if the job's nodes mount it, the job's own dry run checks it there" * (
            not lock and run_lock.slurm_job() is None
        )
        raise ConfigError(
            f"output_dir {str(out)!r}: {top} does not exist on this machine (a file system not mounted here, or a "
            f"typo): pass --output_dir a folder on a file system this node has{elsewhere}"
        )
    # One still to be made is probed in the nearest folder that exists
    if problem := unwritable(out.resolve()):  # a link: where it points
        raise ConfigError(
            f"output_dir {str(out)!r}: cannot write in {problem[0]} ({problem[1]}): pass --output_dir a "
            "folder this job can write in"
        )
    # A live run's folder is a run's whatever it holds at this instant (a record half-written, no manifest yet)
    if lock and writes.is_dir(out):  # unanswered: raised, never its lock taken for free
        run_lock.check_free(out)


def check(output_dir: str, lock: bool = True) -> None:
    """Refuses an output_dir that is a file, a folder of files but no run, one the run cannot write in (under a file:
    `notes.txt/run`), or (`lock`: not a dry run's, which may plan beside a live run) one another live run holds.
    Read-only; every rank, once the ranks have met: its checks in two `every_rank`s around the main process's
    (`main_outcome`: its refusal every rank's, the others would wait for it in the next collective), which
    `every_rank`'s work must not hold."""
    collectives.every_rank(_not_a_file, output_dir)
    collectives.main_outcome(_writable_and_free, Path(output_dir), lock)
    collectives.every_rank(_a_run_folder, output_dir)


def _not_a_file(output_dir: str) -> None:
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"output_dir {output_dir!r} is a file, not a folder: pass --output_dir a folder (new or "
            "one of an earlier run)"
        )


def no_runs_folder(output_dir: str) -> bool:
    """Whether `output_dir` is a folder the run refuses as no run's (a person's files, a checkpoint): `/`, `~`, `.`."""
    try:
        _a_run_folder(output_dir)
    except ConfigError:
        return True
    return False


def _a_run_folder(output_dir: str) -> None:
    """A folder that holds files but no run (`check`), or a checkpoint's folder: refused. None yet: nothing to say."""
    out = Path(output_dir)
    # A folder in a checkpoint: its run found this run's files there (a resume loads `*.safetensors`, `optimizer.pt`)
    # unlisted in its manifest, passed over the checkpoint as damaged and deleted it, its progress since the one before
    # lost. Any run's, by its marks: the run of a copy may be anywhere.
    for above in out.expanduser().resolve().parents:
        if is_checkpoint_name(above.name) and any(writes.is_file(above / n) for n in ("trainer_state.json", MARKER)):
            raise ConfigError(
                f"output_dir {output_dir!r} is inside the checkpoint {str(above)!r}: a run's files there make that "
                "checkpoint fail its run's checks at a resume, which then passes over it and deletes it; pass "
                "--output_dir a folder outside it"
            )
    if not writes.is_dir(out):
        return
    # A run killed as it wrote its first record, or probed the folder, leaves a temporary on whichever node: no
    # person's file, and no live run's past the lock's check
    dead = {path.name for path, _, _ in writes.temporaries(out, [MANIFEST, writes.PROBE])}
    found = [e.name for e in out.iterdir() if not (run_lock.is_lock_file(e.name) or e.name in (*BROWSER_FILES, *dead))]
    recorded = read_manifest(out)
    # A checkpoint's marks, never at the top of a run's folder: its resolved_config.json read it as a run from before
    marks = [name for name in ("trainer_state.json", MARKER) if (out / name).is_file()] if recorded is None else []
    if marks:
        raise ConfigError(
            f"output_dir {output_dir!r} is a checkpoint ({', '.join(marks)}), not a run's folder: a run would write "
            f"over its files; pass --output_dir a new folder: to go on from it, with --resume_from_checkpoint "
            f"{shlex.quote(output_dir)}; or {new_run_from(out)}"
        )
    if found and recorded is None and not is_legacy_run(out):
        shown = ", ".join(sorted(found)[:3]) + (", ..." if len(found) > 3 else "")
        raise ConfigError(
            f"output_dir {output_dir!r} holds files that are not a run's ({len(found)}: {shown}): a run "
            "would write over them, with or without --overwrite_output_dir; pass --output_dir a new or "
            "empty folder (e.g. outputs/<name>)"
        )


def reads(recipe) -> list[tuple[str, str]]:
    """What a run reads from paths, each named as its refusal names it: model, data, chat template, sample prompts."""
    model = recipe.model.model_name_or_path or ""
    found = [(f"model_name_or_path {model!r}", model)]
    found += [(f"dataset_name {recipe.script.dataset_name!r}", recipe.script.dataset_name or "")]
    found += [(f"a mixture source {path!r}", path) for path in mixture.local_files(mixture.fields_of(recipe))]
    template, prompts = recipe.project.chat_template_path, recipe.project.sample_prompts_file
    found += [(f"chat_template_path {template!r}", template)] if template else []
    # A run's own samples.jsonl holds a `prompt` per line: read as the prompts, it was removed with the run it replaced
    return found + ([(f"sample_prompts_file {prompts!r}", prompts)] if prompts else [])


def check_report_paths(paths: dict[str, str | None]) -> None:
    """A command's reports (flag -> path: the analyzer's and the preflight's `--json`, `--plot`) refused where they
    could not be written (`writes.check_report_paths`) or where the path is a file of a run: a name its folder's
    run_files.json records, or a file in one of its checkpoints. Written there, the report replaced it in silence:
    `--json outputs/run/run_complete.json` the finished run's record, `--plot outputs/run/training_curves.png` its
    curves. A new file in a run's folder is a person's, as any other."""
    writes.check_report_paths(paths)
    for flag, path in paths.items():
        if not path:
            continue
        where = Path(path).expanduser().resolve()
        for folder, name in ((where.parent, where.name), (where.parent.parent, where.parent.name)):
            try:
                own = run_files.read(folder) or []
            except (ConfigError, OSError):  # a record that cannot be read: the run's own refusal says so
                continue
            if name in own and (folder / name).exists():
                what = f"the run's {name}" if folder == where.parent else f"a file of the run's {name}"
                raise ConfigError(
                    f"{flag} {str(path)!r} is {what} in {folder} ({MANIFEST} names it), which the report would "
                    "replace: give a path of its own"
                )


def check_reads_outside(recipe) -> None:
    """A run never reads from its own output folder, by any path: it removes files there, maybe the model it loads.
    Every rank's look, ended alike on every rank (`every_rank`): a look one rank's file server left unanswered, raised
    on that rank alone, left the others in the next collective."""
    collectives.every_rank(_reads_outside, recipe)


def _reads_outside(recipe) -> None:
    out = recipe.training.output_dir
    root = Path(out).expanduser().resolve()
    for named, path in reads(recipe):
        where = Path(path).expanduser()
        # `writes.exists`: an unanswered look (ESTALE) is raised, never taken for no input and the refusal skipped
        if not path or not (writes.exists(where) or where.is_symlink()):
            continue
        real = where.resolve()
        inside, alias = _inside(real, root)
        if inside:
            link = f" (a link to {real})" if str(real) != os.path.abspath(where) else ""
            raise ConfigError(f"{named}{link}{alias} is in output_dir {out!r}: {_NEVER_READ}: {_COPY_OUT}")
        if checkpoint := _unfinished_runs_checkpoint(real):
            # Its run deletes it when save_total_limit lets it go (at its next attempt too), and this run reads it again
            # at every resume (the reference model is the base): a stopped run was left unable to resume ("model
            # folder ... does not exist"). A copy elsewhere resumes: a local input is compared by its content.
            where = "is" if checkpoint == real else f"is in {checkpoint.name},"
            raise ConfigError(
                f"{named} {where} a checkpoint of the unfinished run in {str(checkpoint.parent)!r}, which deletes it "
                "when its save_total_limit lets it go, while this run reads it again at every resume: "
                f"copy it out of that folder (cp -r {shlex.quote(str(checkpoint))} <new folder>) and pass the copy"
            )
        if writes.is_dir(real):  # what it reads is each file in it, which a link there may take from the output folder
            _no_links_into(named, real, root, out)


def _inside(real: Path, root: Path) -> tuple[bool, str]:
    """Whether the real path `real` lies in the output folder `root`, by name or by another name (a bind mount), and
    the words that name the second (`same_folder_above`)."""
    alias = same_folder_above(real, root)
    said = f" ({alias} is the same folder as {root})" if alias and alias != root else ""
    return real == root or root in real.parents or alias is not None, said


def _unfinished_runs_checkpoint(real: Path) -> Path | None:
    """The `checkpoint-N` folder holding the real path `real` that an unfinished run (no run_complete.json) records as
    its own, whose rotation may delete it; None: none (a finished run's, a person's copy, a record not readable)."""
    for above in (real, *real.parents):
        if not is_checkpoint_name(above.name) or writes.exists(above.parent / RUN_COMPLETE):
            continue
        try:
            if above.name in (read_manifest(above.parent) or []):
                return above
        except ConfigError:  # that run's record damaged: not this run's to judge (its own start refuses it)
            continue
    return None


def _no_links_into(named: str, folder: Path, root: Path, out: str) -> None:
    """A folder input (a model, a chat template's, data) whose files are links into the output folder is refused as if
    it lay there: --overwrite_output_dir removed the finished model a folder of links to its files named, and the run
    failed on the links left dangling. Its entries by their names alone (`scandir`: no stat per file, for a data
    folder of thousands), no folder link followed; a hard link needs nothing (the file outlives one name removed)."""
    found = []
    for link in _links_under(folder):
        real = Path(os.path.realpath(link))
        inside, alias = _inside(real, root)
        if inside:
            found.append((link, real, alias))
    if found:
        link, real, alias = found[0]
        more = f" (and {plural(len(found) - 1, 'other link')} into it)" if len(found) > 1 else ""
        raise ConfigError(
            f"{named} holds {link}, a link to {real}{alias}{more}, which is in output_dir {out!r}: {_NEVER_READ}: "
            "put a copy of what each link points to in its place, or pass another --output_dir"
        )


def _links_under(folder: Path):
    """The symbolic links under `folder`, folder links not followed. A folder gone or not ours to look in has none to
    show (the run's own read says why); an unanswered look (ESTALE) is raised, never taken for no link."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.is_symlink():
            yield Path(entry.path)
        elif entry.is_dir(follow_symlinks=False):
            yield from _links_under(Path(entry.path))


def check_replaceable(output_dir: str, start_afresh: bool) -> None:
    """Refuses to replace a run whose own files are not recorded (written before run_files.json existed), or one with a
    folder of its own the run cannot remove (`unremovable`): the replacement removed run_complete.json and the card
    first, then ended at that folder, the finished run left unfinished."""
    out = Path(output_dir)
    if not (start_afresh and writes.is_dir(out)):
        return
    if (own := read_manifest(out)) is None and is_legacy_run(out):
        raise ConfigError(
            f"output_dir {output_dir!r} holds a run written before runs recorded their own files (no "
            f"{MANIFEST}), so --overwrite_output_dir cannot tell them from yours: move or delete that "
            "run yourself, or pass a new --output_dir"
        )
    for name in sorted(set(own or ()) - {MANIFEST}):
        if problem := unremovable(out / name):
            raise ConfigError(
                f"output_dir {output_dir!r} holds {name}, the replaced run's own, which this run removes first, and "
                f"cannot ({problem[0]}: {problem[1]}): make it writable (chmod -R u+w {shlex.quote(str(out / name))}), "
                "or move it out of the folder, then rerun"
            )


def unremovable(folder: Path) -> tuple[Path, str] | None:
    """Whether the run can remove the folder `folder` (a file or a link: None), probed as `writes.unwritable` probes:
    (the folder in it that refuses a file, why), or None. Removing needs every folder in it writable."""
    if not writes.is_dir(folder) or folder.is_symlink():
        return None
    inside = [folder, *sorted(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink())]
    return next(filter(None, map(unwritable, inside)), None)


def _saved_again(out: Path, resume_from: str | None, max_steps: int) -> list[Path]:
    """The checkpoint folders at a step the run may still save (past its start, up to max_steps): it clears each to
    save there (`checkpoints.clear_for_save`)."""
    start = (saved_step(Path(resume_from)) or 0) if resume_from else 0
    last = max_steps if max_steps > 0 else float("inf")
    return [p for p in checkpoints(out) if start < step_of(p) <= last]


def check_checkpoints_of_others(output_dir: str, resume_from: str | None, max_steps: int) -> None:
    """Refuses a `checkpoint-N` the run did not write at a step it may still save: it clears that folder to save there,
    and the person's files would be gone. One of the run's own there that it cannot remove (made read-only to keep it,
    another user's) is refused too: the run trained up to that step, then ended in a PermissionError traceback as it
    cleared the folder, every rerun alike."""
    out = Path(output_dir)
    own = read_manifest(out) if writes.is_dir(out) else None
    if own is None:  # no run (nothing there), or one written before runs recorded their files: all its checkpoints
        return
    ahead = _saved_again(out, resume_from, max_steps)
    if others := [p.name for p in ahead if p.name not in own]:
        raise ConfigError(
            f"output_dir {output_dir!r} holds {', '.join(others)}, which this run did not write ({MANIFEST} does not "
            f"name {'it' if len(others) == 1 else 'them'}), where the run may save its own checkpoint of that step: "
            f"move it out of the folder (or rename it, e.g. {others[0]}.bak), or pass another --output_dir"
        )
    for folder in ahead:
        if problem := unremovable(folder):
            raise ConfigError(
                f"output_dir {output_dir!r} holds {folder.name}, an earlier attempt's, which this run removes to save "
                f"that step again, and cannot ({problem[0]}: {problem[1]}): make it writable (chmod -R u+w "
                f"{shlex.quote(str(folder))}), or move it out of the folder, then rerun"
            )


def start(recipe, start_afresh: bool, pushes: bool) -> None:
    """Main process, before the run writes in its folder: the replaced run's own files removed, this run's recorded."""
    out = Path(recipe.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = run_names(recipe, pushes)
    old = read_manifest(out)
    run_files.remove_dead_temporaries(out, [*names, *(old or [])])
    if start_afresh and old is not None:
        replace(out, old)
    else:  # resumed: what earlier attempts wrote is the run's too (before records, its checkpoint folders)
        names = (old if old is not None else [p.name for p in checkpoints(out)]) + names
        # Under --auto_resume false a run goes on from the checkpoint it names, always (resume.explicit_point)
        if (named := recipe.training.resume_from_checkpoint) and not recipe.project.auto_resume:
            names = set_aside_past(out, named, names)
    # A name this run writes that the record does not hold, there already, is a person's: moved aside, never appended
    # to or removed as the run's. Without a record (a run from before records), its files are the run's.
    for name in [n for n in names if old is not None and n not in old and n != MANIFEST]:
        run_files.set_aside_if_not_own(out, name)
    run_files.write(out, names)
    clear_final_staging(out)


def set_aside_past(out: Path, named: str, names: list[str]) -> list[str]:
    """Main process, a run of --auto_resume false going on from the checkpoint it names: the run's own checkpoints
    saved past that one (a course of the run given up for it) moved aside to `<output_dir>.past-<checkpoint>-<time>/`;
    returns `names` without them. Left in the folder, a later attempt that resumes by itself (the same command without
    --auto_resume false, killed before this course saved past them) went on from them, silently, and rotation kept
    them over this course's own. Moved, not deleted: they may be worth keeping, and only the user can tell."""
    if not (past := saved_past(out, named, names)):
        return names
    aside = past_folder(out, named, time.strftime("%Y%m%d-%H%M%S"))
    aside.mkdir()
    for checkpoint in past:
        run_files.incomplete(out, checkpoint.name)  # first: killed midway, it is no checkpoint gone
        checkpoint.rename(aside / checkpoint.name)
    moved = [p.name for p in past]
    print(
        f"Moved {', '.join(moved)} to {aside}: saved past {named}, which this run goes on from (--auto_resume false); "
        f"left in {out}, a later run resuming by itself would have gone on from them; delete {aside} if you do not "
        "need them",
        flush=True,
    )
    return [n for n in names if n not in moved]


def saved_past(out: Path, named: str, names: list[str] | None = None) -> list[Path]:
    """The run's own checkpoints in `out` (those `names` holds: its record's, else every checkpoint) saved past the
    checkpoint `named`, by step: what a run of --auto_resume false going on from `named` moves aside."""
    if (start := saved_step(Path(named))) is None:
        return []
    return [p for p in checkpoints(out) if (names is None or p.name in names) and step_of(p) > start]


def past_folder(out: Path, named: str, when: str) -> Path:
    """Where `set_aside_past` moves them: `<output_dir>.past-<checkpoint>-<when>` beside the folder."""
    folder = Path(os.path.abspath(out))  # `--output_dir .`: a folder beside the one run in
    return folder.with_name(f"{folder.name}.past-{Path(named).name}-{when}")


def not_movable_beside(out: Path) -> str | None:
    """Why what the run sets aside beside `out` (`past_folder`, W&B's offline runs: tracking.offline_runs_kept_in)
    cannot be renamed there, or None: `out` is a mount point (a container's bind, a job's scratch mount: EXDEV), or its
    parent is a folder this job cannot write in (a site's /scratch/<group> above a user's own folder: EACCES, EROFS).
    The rename failed in a traceback once the data was read (going back: the checkpoint already unlisted as complete,
    the folder beside made)."""
    folder = Path(os.path.abspath(out))
    if folder.stat().st_dev != folder.parent.stat().st_dev:
        return "it is a file system of its own (a mount point), and a rename does not cross file systems"
    if not os.access(folder.parent, os.W_OK | os.X_OK):
        return f"{folder.parent} is a folder this job cannot write in"
    return None


def clear_final_staging(out: Path) -> None:
    """Main process: an earlier attempt's final save, cut short, removed; a link or a person's folder there is moved
    aside, never emptied (the save would write through a link)."""
    staging = Path(out) / FINAL_STAGING
    if run_files.set_aside_if_not_own(out, FINAL_STAGING):
        return
    try:
        if staging.is_dir():
            shutil.rmtree(staging)
        else:
            staging.unlink(missing_ok=True)
    except OSError as e:  # a busy file on NFS, a read-only part: one line, not a traceback after the whole training
        raise RunError(
            f"{staging}, an earlier attempt's final save cut short, could not be removed ({cause(e)}): remove it "
            "yourself, then rerun the same command"
        ) from None


def stage_final(out: str | Path) -> None:
    """Main process, right before every rank saves the final model into `FINAL_STAGING`: cleared, then the name
    recorded as the run's before its first byte."""
    # The folder deleted or moved away after the last step's end was checked (`GracefulStop.on_step_end`): the save
    # made it again and the run ended with 0, its model in a folder the user removed, without its record or checkpoints
    if run_lock.folder_gone():
        raise RunError(run_lock.gone_line(out, "after its last step, before its final model was saved"))
    clear_final_staging(Path(out))
    claim(out, [FINAL_STAGING])


def replace(out: Path, names: list[str]) -> None:
    """Removes what the run in `out` recorded as its own, but its record (a kill before the next run rewrites it
    leaves a folder that is still a run's) and its lock."""
    from dpotrain.train.tracking import keep_offline_runs, offline_run_folders  # as in run_names

    if kept := keep_offline_runs(out):
        # the folder quoted, the pattern not: typed back, a folder with a space in its name is one word
        sync = " ".join(f"{shlex.quote(str(folder))}/offline-run-*" for folder in offline_run_folders(kept))
        print(f"Kept the W&B offline runs of the replaced run in {kept} (`wandb sync {sync}`)", flush=True)
    own = set(names) - {MANIFEST, run_lock.LOCK_FILE}
    # Its checkpoints unlisted as complete first (the record stays, naming them): a kill midway left the ones deleted
    # listed, and the rerun said each "gone since the run saved it (moved or deleted)", deleted by the run itself.
    if run_files.completed(out):
        run_files.write(out, run_files.read(out), complete=[])
    # The marks of being whole first, each before what it vouches for: a kill midway left run_complete.json on a run
    # without its model, and a checkpoint's COMPLETE on a folder missing files; now it is a run stopped before its end.
    removed = sorted((e for e in out.iterdir() if e.name in own), key=lambda e: (e.name != RUN_COMPLETE, e.name))
    folders = sum(entry.is_dir() and not entry.is_symlink() for entry in removed)
    for entry in removed:
        if not (entry.is_dir() and not entry.is_symlink()):
            entry.unlink(missing_ok=True)
        else:  # a checkpoint's mark first (`checkpoints.remove`); in any other folder of the run none is found
            remove_checkpoint(entry)
    left = [e.name for e in out.iterdir() if e.name not in (MANIFEST, run_lock.LOCK_FILE)]
    counts = [plural(n, word) for n, word in ((len(removed) - folders, "file"), (folders, "folder")) if n]
    print(
        f"Replaced the run in {out}: removed {' and '.join(counts) or 'nothing'} of its own"
        + (f"; kept {plural(len(left), 'other')} ({', '.join(sorted(left)[:5])})" if left else ""),
        flush=True,
    )


def claim_for_writing(out: str | Path, names: list[str]) -> None:
    """Main process, before the run writes `names` at its end: a person's file of a name moved aside, never written
    over; then each recorded as the run's, before its first byte."""
    for name in names:
        run_files.set_aside_if_not_own(out, name)
    claim(out, names)


def remove_earlier_merge(out: str | Path) -> None:
    """Main process, at the end of a run that does not merge (merge_lora false): an earlier attempt's `merged/`
    (merge_lora true, killed before run_complete.json, or while it wrote it) removed where the run recorded it as its
    own. Left, it sat beside an adapter it was not made from, and the push uploaded it, whole or cut short, as the
    run's merged model."""
    out = Path(out)
    target = out / MERGED_DIR
    if MERGED_DIR not in (read_manifest(out) or []) or not target.is_dir() or target.is_symlink():
        return
    shutil.rmtree(target)
    run_files.disown(out, [MERGED_DIR])
    print(
        f"Removed {target}, an earlier attempt's merged model: this run does not merge (merge_lora false)", flush=True
    )


def move_in(out: str | Path) -> list[str]:
    """Main process, once every rank has saved into `FINAL_STAGING`: its names recorded, then moved into the folder;
    returns them. An earlier attempt's weights this save did not write are removed first: from_pretrained would load
    its model.safetensors before a new sharded index, and the push would upload them."""
    out = Path(out)
    staging = out / FINAL_STAGING
    names = sorted(e.name for e in staging.iterdir())
    own = read_manifest(out) or []
    if stale := [n for n in own if n not in names and any(fnmatch(n, p) for p in REPLACED) and writes.is_file(out / n)]:
        for name in stale:
            (out / name).unlink()
        run_files.disown(out, stale)
        shown = stale[0] + (", ..." if len(stale) > 1 else "")
        print(f"Removed {plural(len(stale), 'weight file')} ({shown}) of an earlier attempt's final model", flush=True)
    claim_for_writing(out, names)
    for name in names:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    staging.rmdir()
    run_files.disown(out, [FINAL_STAGING])  # gone: a folder of that name made later is a person's
    return names

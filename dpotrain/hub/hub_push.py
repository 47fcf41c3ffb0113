"""Checkpoints as Hub revisions: each complete checkpoint's model goes to a branch `step-<N>` of the run's repo, as
`from_pretrained(repo, revision="step-N")` loads it (never optimizer, scheduler or RNG state, nor training_args.bin).

`CheckpointPusher` links the checkpoint's files into `<output_dir>/.hub_staging/` at once, so one `save_total_limit`
deletes mid-upload is uploaded all the same, in a background thread, retried; one that still fails is a warning and a
line in hub_pushes.jsonl, never a failed run.
"""

import contextlib
import errno
import hashlib
import math
import os
import queue
import shlex
import shutil
import stat
import threading
import time
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from huggingface_hub.utils.sha import git_hash
from transformers import TrainerCallback

from dpotrain.cluster.offline import Background
from dpotrain.hub.public import upload_content
from dpotrain.recipe import hub_switches, upstream, venv, writes
from dpotrain.recipe import records as run_records
from dpotrain.recipe.errors import ConfigError, RunError, abandon_threads, cause, warn
from dpotrain.train import checkpoint_manifest, run_files
from dpotrain.train.checkpoints import MARKER, is_complete, own_checkpoints, step_of, unstaged

PUSH_RECORD = "hub_pushes.jsonl"  # one line per upload's start (the final push) and outcome: step, branch, status
STAGING = ".hub_staging"
# `pushed` by this run or push_to_hub.py, `present` found already on the Hub by push_to_hub.py.
ON_THE_HUB = ("pushed", "present")
# Seconds between attempts of one upload, on top of huggingface_hub's own retries of single requests (~20 s): a Hub
# outage of a few minutes must not lose a checkpoint. DPOTRAIN_HUB_RETRY_WAITS overrides (tests: "0").
DEFAULT_RETRY_WAITS = (15.0, 60.0, 240.0)
# How long the end of training waits for checkpoint uploads still running (a 7B checkpoint is ~15 GB).
FINAL_WAIT_S = 30 * 60
# How long a run stopped for requeue waits (Slurm's signal comes ~30-60 s before the kill); the requeued job pushes
# what is left.
STOP_WAIT_S = 10


def push_command(output_dir: str | Path, *flags: str) -> str:
    """The scripts/push_to_hub.py command that pushes `output_dir`, quoted for a shell."""
    return shlex.join(["python", venv.project_file("scripts/push_to_hub.py"), str(output_dir), *flags])


def branch_name(step: int) -> str:
    return f"step-{step}"


def checkpoint_files(folder: Path) -> list[str]:
    """A checkpoint's model files, as its manifest names them: its optimizer and RNG state, training_args.bin,
    DeepSpeed's global_step*/ and TR-DPO's reference stay."""
    return checkpoint_manifest.model_files(folder) or []


class NotPushable(Exception):
    """Why a complete checkpoint cannot go to its branch (said in the warning and the record's `error`)."""


class ReadFailed(Exception):
    """A checkpoint whose check could not read it (EIO, ESTALE; a permission, a folder in a file's place: FIXES): not
    damaged, so its staged copy is kept and a later job or command pushes it (taken for NotPushable, the step's last
    copy was removed)."""


def pushable_files(folder: Path) -> list[str]:
    """The files of a complete checkpoint that go to its branch, their sizes checked against its manifest (a file cut
    short or replaced since would go up as that step's model); NotPushable says why not, ReadFailed that it could not
    be read now."""
    with reading():
        return checked_files(folder)


# A read's failure that no later push gets past until the user mends it, by its error, with the mending: said after its
# cause (the record's `error`), where an EIO or ESTALE may pass and the same command run again pushes it
FIXES = {
    PermissionError: "fix the file's permissions first",
    IsADirectoryError: "a folder stands where the checkpoint's file should be: put the file back in its place first",
}


@contextlib.contextmanager
def reading():
    """A checkpoint's files read: an OSError raised as ReadFailed, which keeps the staged copy, naming its fix where
    it has one (FIXES)."""
    try:
        yield
    except OSError as e:
        fix = next((f": {text}" for kind, text in FIXES.items() if isinstance(e, kind)), "")
        raise ReadFailed(f"it could not be read ({cause(e)}){fix}") from e


def needs_fix(record: dict) -> bool:
    """Whether a `failed` record's error names a fix (FIXES): not pushed by the same command run as it is."""
    return str(record.get("error", "")).endswith(tuple(FIXES.values()))


def marked(folder: Path, unread=ReadFailed) -> bool | None:
    """Whether checkpoint `folder` is on disk, complete (its COMPLETE mark). A mark that could not be read (ESTALE, a
    permission) is never an OSError raised, but ReadFailed naming its fix (`reading`: push_to_hub.py records the step's
    failure; its OSError ended the command with no record of the step, the steps after it untried), or `unread` given
    in its place: None, not known (the pusher's callbacks, on rank 0 alone: an OSError left the other ranks waiting in
    the next collective); True, a checkpoint to try, whose push records the failure."""
    try:
        with reading():
            return is_complete(folder)
    except ReadFailed:
        if unread is ReadFailed:
            raise
        return unread


def size_of(path: Path) -> int | None:
    """`path`'s size; None only where it is missing. Any other OSError (ESTALE, EIO) is raised, a folder there as
    IsADirectoryError: Path.is_file() says False for every OSError on Python 3.14 (cpython gh-118243), so a file that
    could not be read now was taken for one deleted, and the step's last copy removed."""
    if (info := writes.looked(path)) is None:
        return None
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    return info.st_size


def checked_files(folder: Path) -> list[str]:
    """`pushable_files`' check, its reads' OSErrors raised."""
    size_of(folder / checkpoint_manifest.MANIFEST)  # its read failing raised here, never taken for no manifest
    listed, names = checkpoint_manifest.read(folder), checkpoint_manifest.model_files(folder)
    if listed == {}:
        raise NotPushable(f"its {checkpoint_manifest.MANIFEST} is unreadable")
    if listed is None or names is None:  # written before manifests named the model's files
        raise NotPushable(f"its {checkpoint_manifest.MANIFEST} does not say which files are its model's")
    if not any(n.endswith(".safetensors") for n in names):
        raise NotPushable("no model weights (*.safetensors)")
    for name in names:
        size = size_of(folder / name) if name in listed else None
        if size is None:
            raise NotPushable(f"{name} is missing (deleted after it was saved)")
        if size != listed[name]["bytes"]:
            raise NotPushable(f"{name} has {size} bytes, {listed[name]['bytes']} were saved (cut short or replaced)")
    return names


def why(error: Exception) -> str:
    """What a record and a warning say of a push's failure: a NotPushable's or ReadFailed's reason as it is, another
    error's `cause`."""
    return str(error) if isinstance(error, (NotPushable, ReadFailed)) else cause(error)


def record_checkpoint(out: Path, repo_id: str, step: int, status: str, **entry) -> dict:
    """The record of checkpoint `step`'s push to its branch (one shape: `record_push`), a field given as None left out
    (`attempts` where no upload was made, `pushable` but where false)."""
    entry = {key: value for key, value in entry.items() if value is not None}
    return record_push(out, step=step, branch=branch_name(step), repo=repo_id, status=status, **entry)


def push_checkpoint(api, repo_id: str, folder: Path, step: int, out: Path) -> dict:
    """`folder` (a checkpoint, or its staged copy) to branch `step-N`, retried (`with_retries`); the record written."""
    branch = branch_name(step)
    # before the upload: a read failing after it said "failed" of a push made; ReadFailed, not its OSError, which
    # ended push_to_hub.py with no record of the step and the steps after it untried
    with reading():
        files = checkpoint_files(folder)
    commit, attempts = with_retries(lambda: upload_checkpoint(api, repo_id, folder, step), f"{branch} push")
    entry = record_pushed(
        out, folder.name, repo_id, step=step, branch=branch, attempts=attempts, commit=commit.oid, files=files
    )
    print(f"Pushed {folder.name} to {repo_id}@{branch}", flush=True)
    return entry


class UnrecordedPush(RunError):
    """An upload the Hub took whose record could not be written: neither "Pushed" nor "failed" is true."""


def record_pushed(output_dir: str | Path, what: str, repo_id: str, **entry) -> dict:
    """The record of an upload the Hub took; one that cannot be written raises UnrecordedPush naming the push_to_hub.py
    command that finds it on the Hub and records it."""
    try:
        return record_push(output_dir, status="pushed", repo=repo_id, **entry)
    except OSError as e:
        branch = entry["branch"]
        where, flags = (repo_id, []) if branch == "main" else (f"{repo_id}@{branch}", ["--checkpoints"])
        again = push_command(output_dir, "--repo-id", repo_id, *flags)
        raise UnrecordedPush(
            f"{what} went up to {where}, but its record could not be written ({cause(e)}): make room on that disk or "
            f"make the folder writable, then run `{again}`, which finds it on the Hub and records it"
        ) from None


_record_lock = threading.Lock()


# The fields every record opens with ("step" None for a run from before run_complete.json named it); the rest follow.
RECORD_HEAD = ("step", "branch", "repo", "status")


def record_push(output_dir: str | Path, **entry) -> dict:
    """One line of hub_pushes.jsonl, of one shape wherever it is written: the time, RECORD_HEAD, then the rest."""
    head = {key: entry.pop(key) for key in RECORD_HEAD if key in entry}
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **head, **entry}
    with _record_lock:
        run_records.append(Path(output_dir) / PUSH_RECORD, [entry])
    return entry


def read_pushes(output_dir: str | Path) -> list[dict]:
    return run_records.read(Path(output_dir) / PUSH_RECORD)


def pushed_revisions(output_dir: str | Path, repo_id: str) -> list[tuple[int, str]]:
    """(step, branch) of the checkpoint branches of `repo_id` whose latest record says they are on the Hub, by step."""
    latest = latest_checkpoint_records(output_dir, repo_id)
    return sorted((r["step"], b) for b, r in latest.items() if r["status"] in ON_THE_HUB)


def latest_checkpoint_records(output_dir: str | Path, repo_id: str) -> dict[str, dict]:
    """Each checkpoint branch of `repo_id` with its latest record (a record without a repo, written before records
    named it, counts for any)."""
    records = [r for r in read_pushes(output_dir) if r.get("repo", repo_id) == repo_id]
    return {r["branch"]: r for r in records if r.get("branch", "main") != "main"}


def checkpoints_left(output_dir: str | Path, repo_id: str) -> list[int]:
    """The steps whose latest checkpoint push record to `repo_id` is not on the Hub (given up, or failed), but those
    no command can push (`pushable: false`: cut short or damaged), which `--checkpoints` would not push either."""
    latest = latest_checkpoint_records(output_dir, repo_id).values()
    return sorted(r["step"] for r in latest if r["status"] not in ON_THE_HUB and r.get("pushable", True))


def unconfirmed_push(output_dir: str | Path) -> dict | None:
    """The latest record of a final push to main left unconfirmed (killed, or failed), for the rerun to complete."""
    main = [r for r in read_pushes(output_dir) if r.get("branch") == "main"]
    return main[-1] if main and main[-1]["status"] not in ON_THE_HUB else None


def status_of(error) -> int | None:
    """The HTTP status of a Hub error; None where it carries no response."""
    return getattr(getattr(error, "response", None), "status_code", None)


def is_transient(error: BaseException) -> bool:
    """Worth another attempt later: the Hub's 5xx, 429 and 408, and connections that failed or dropped."""
    if isinstance(error, HfHubHTTPError):
        status = status_of(error)
        return status is None or status in (408, 429) or status >= 500
    return isinstance(error, (*upstream.http_transport_errors(), ConnectionError, TimeoutError))


def retry_waits() -> tuple[float, ...]:
    """The seconds between attempts, refused in one line if not seconds (asked before training, not at the upload)."""
    value = os.environ.get("DPOTRAIN_HUB_RETRY_WAITS")
    if not value:
        return DEFAULT_RETRY_WAITS
    try:
        waits = tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        waits = (math.nan,)
    if not all(math.isfinite(w) and w >= 0 for w in waits):
        raise ConfigError(
            f"DPOTRAIN_HUB_RETRY_WAITS={value!r} is not a list of seconds between a Hub upload's attempts: write them "
            "comma-separated, e.g. DPOTRAIN_HUB_RETRY_WAITS=15,60,240 (the default), or unset it"
        )
    return waits


def with_retries(fn, what: str, transient=is_transient):
    """fn() retried on `transient` errors after each wait: (result, attempts); a final error gets `.attempts`."""
    waits = retry_waits()
    for attempt in range(1, len(waits) + 2):
        try:
            return fn(), attempt
        except Exception as e:
            if attempt > len(waits) or not transient(e):
                e.attempts = attempt
                raise
            wait = waits[attempt - 1]
            warn(f"{what} failed ({cause(e)}); retrying in {wait:.0f} s")
            time.sleep(wait)


class PushStopped(Exception):
    """A push given up on a stop request: the Hub may hang a commit for longer than Slurm waits, and a job killed there
    is not requeued (a time limit's) or says nothing."""


def until_stopped(fn, stop_asked=None):
    """fn() in a daemon thread until it ends or `stop_asked()` (each second): then PushStopped, the thread abandoned
    (an HTTP request cannot be interrupted)."""
    if stop_asked is None:
        return fn()
    if stop_asked():  # asked before it starts (while checkpoint uploads were waited for): not started at all
        raise PushStopped
    push = Background(fn, "dpotrain-final-push")
    # A poll, not an Event the stop sets: the stop file (launch.sh's way on Slurm) is seen only when looked at, and
    # a signal's Event would need a wait on two events, which threading has not
    while not push.done.wait(1.0):
        if stop_asked():
            abandon_threads()
            raise PushStopped
    return push.result()


def upload_checkpoint(api, repo_id: str, folder: Path, step: int):
    """Branch `step-N` holding exactly the checkpoint's model files, in one commit. create_commit, not upload_folder:
    only it takes the files' digests."""
    branch = branch_name(step)
    adds = verified_additions(folder, checkpoint_files(folder))  # before the branch: a damaged checkpoint makes none
    if branch not in {b.name for b in api.list_repo_refs(repo_id).branches}:
        new_branch(api, repo_id, branch)
    added = {op.path_in_repo for op in adds}
    # main's files (a card, an earlier run's model) and an earlier push's do not belong to this step
    held = [p for p in api.list_repo_files(repo_id, revision=branch) if p != ".gitattributes" and p not in added]
    operations = [*(CommitOperationDelete(p) for p in held), *adds]
    return api.create_commit(repo_id, operations, commit_message=f"Checkpoint at step {step}", revision=branch)


def verified_additions(folder: Path, names: list[str]) -> list:
    """The upload of `names`, each file hashed once: checked against its manifest's SHA-256 (NotPushable: damaged),
    which the upload then takes instead of hashing it again."""
    listed = checkpoint_manifest.read(folder) or {}
    adds = []
    for name in names:
        with reading():  # a file unreadable now (a permission, a folder in its place): kept, its fix named
            digest = checkpoint_manifest.sha256(folder / name)
        if name in listed and digest != listed[name]["sha256"]:
            raise NotPushable(
                f"{name} does not match its SHA-256 in {checkpoint_manifest.MANIFEST} (damaged after it was saved)"
            )
        public = upload_content(folder, name)  # a LoRA adapter's config naming a local base: its copy (public.py)
        add = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name) if public is None else public)
        if public is None:  # hashed lazily by huggingface_hub, which this digest spares
            add.upload_info.sha256 = bytes.fromhex(digest)
        adds.append(add)
    return adds


def new_branch(api, repo_id: str, branch: str) -> None:
    """`branch` created holding no model, so that an upload failing after it leaves none there to load: from the
    repo's first commit, not main; a squashed history's model there deleted at once (the branch too, if that fails)."""
    first = api.list_repo_commits(repo_id)[-1].commit_id  # newest first
    try:
        api.create_branch(repo_id, branch=branch, revision=first)
    except HfHubHTTPError as e:
        if status_of(e) != 409:
            raise
        # Made since the branch list was read, by another push of this step: this upload replaces its checkpoint whole
        return
    held = [CommitOperationDelete(p) for p in api.list_repo_files(repo_id, revision=branch) if p != ".gitattributes"]
    if not held:
        return
    try:
        api.create_commit(repo_id, held, commit_message="Start from no model", revision=branch)
    except Exception:
        with contextlib.suppress(Exception):  # the error that counts is the commit's
            api.delete_branch(repo_id, branch=branch)
        raise


def local_files(folder: Path, ignore: list[str], allow: list[str] | None = None) -> list[str]:
    """The relative paths an upload takes from `folder`, by huggingface_hub's filter, as upload_folder applies it."""
    paths = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
    return list(filter_repo_objects(paths, allow_patterns=allow, ignore_patterns=[*ignore, *DEFAULT_IGNORE_PATTERNS]))


def remote_matches(api, repo_id: str, revision: str, folder: Path, names: list[str]) -> bool:
    """Whether `revision` holds exactly `names` of `folder`, by content: another run of the same base model leaves
    files of the same names and sizes."""
    remote = remote_files(api, repo_id, revision)
    return remote is not None and holds(remote, folder, names)


def remote_files(api, repo_id: str, revision: str) -> dict | None:
    """The files `revision` holds ({path: its entry}, .gitattributes left out); None where there is no such revision."""
    try:
        remote = {
            f.path: f for f in api.list_repo_tree(repo_id, revision=revision, recursive=True) if hasattr(f, "size")
        }
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return None
    remote.pop(".gitattributes", None)
    return remote


def holds(remote: dict, folder: Path, names: list[str]) -> bool:
    """Whether `remote` (`remote_files`) is exactly `names` of `folder`, by content, reading only local files: sizes
    first; then an LFS file by its SHA-256 (a checkpoint's from its manifest), another by its git blob id."""
    # what a push uploads of a file: its copy without the training machine's paths where it has one (public.py)
    public = {n: content for n in names if (content := upload_content(folder, n)) is not None}
    sizes = {n: len(public[n]) if n in public else (folder / n).stat().st_size for n in names}
    if remote.keys() != set(names) or any(remote[n].size != sizes[n] for n in names):
        return False
    hashed = checkpoint_manifest.read(folder) or {}  # none for a run's folder (main)
    for name in names:
        local, entry = folder / name, hashed.get(name) or {}
        if name in public and remote[name].lfs is None:
            same = remote[name].blob_id == git_hash(public[name])
        elif name in public:
            same = remote[name].lfs.sha256 == hashlib.sha256(public[name]).hexdigest()
        elif remote[name].lfs is None:
            same = remote[name].blob_id == git_hash(local.read_bytes())  # a small file (large ones are in LFS)
        else:
            known = entry.get("sha256") if entry.get("bytes") == local.stat().st_size else None
            same = remote[name].lfs.sha256 == (known or checkpoint_manifest.sha256(local))
        if not same:
            return False
    return True


def stage(folder: Path, staging_root: Path) -> Path:
    """Hard links (across file systems, copies) of the checkpoint's model files and manifest: they outlive it."""
    target = staging_root / folder.name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    # size_of, not is_file(): a copy staged without its manifest, its read failing now, is no push's ever
    manifest = [checkpoint_manifest.MANIFEST] if size_of(folder / checkpoint_manifest.MANIFEST) is not None else []
    for name in [*checkpoint_files(folder), *manifest]:
        (target / name).parent.mkdir(parents=True, exist_ok=True)  # additional_chat_templates/
        try:
            os.link(folder / name, target / name)
        except OSError:
            shutil.copy2(folder / name, target / name)
    return target


def staged_only(out: Path, repo_id: str, recorded: bool = False) -> list[Path]:
    """The staged copies of steps neither recorded on `repo_id` (`pushed_revisions`) nor on disk: checkpoints deleted
    while their upload ran, left unpushed by a killed or stopped job, or failed for good; `recorded`: those of steps
    recorded on `repo_id` instead. Only the run's own staging folder, never a link: a person's folder of that name is
    none of the run's."""
    root, own = out / STAGING, run_files.read(out)
    if root.is_symlink() or not root.is_dir() or (own is not None and STAGING not in own):
        return []
    pushed, on_disk = {s for s, _ in pushed_revisions(out, repo_id)}, {step_of(f) for f in own_checkpoints(out)}
    staged = [p for p in root.glob("checkpoint-*") if p.is_dir() and not p.is_symlink() and p.name[11:].isdigit()]
    return sorted((p for p in staged if step_of(p) not in on_disk and (step_of(p) in pushed) == recorded), key=step_of)


def deleted_step(staged: Path, not_whole: Exception | None = None) -> str:
    """What is said of a step pushed from its staged copy: the checkpoint is gone (and the copy `not_whole`)."""
    said = f"{staged.name} was deleted while its upload ran (save_total_limit, or by hand)"
    return said if not_whole is None else f"{said}, and its copy in {STAGING} is not whole: {not_whole}"


def push_checkpoints(api, run_dir: Path, repo_id: str, check_free=lambda: None, records=None) -> list[dict]:
    """push_to_hub.py --checkpoints: each of the run's own complete checkpoints, then each step left only as its
    staged copy, to its branch, but where the branch holds it already; returns the records written. `check_free()`
    (push_to_hub.py's run-lock check, raising its refusal) is asked again before each staged copy is pushed and before
    it is removed: a job started since the command's start pushes and removes the same copies. `records`: a list of
    the caller's the records are added to as they are written, which keeps those written before such a refusal."""
    records, branches = [] if records is None else records, set()
    with contextlib.suppress(RepositoryNotFoundError):  # a repo not created yet has no branches
        branches = {b.name for b in api.list_repo_refs(repo_id).branches}
    for folder in own_checkpoints(run_dir):  # its mark asked in push_one_checkpoint, where a failed read is recorded
        records.extend(push_one_checkpoint(api, run_dir, repo_id, folder, branches))
    # Listed after the uploads above (minutes): a job running beside this command (a requeue) stages each checkpoint
    # it saves, whose copy is no deleted step's while the checkpoint is there
    for staged in staged_only(run_dir, repo_id):
        records.extend(push_one_checkpoint(api, run_dir, repo_id, staged, branches, staged=True, check_free=check_free))
    # A copy of a step recorded on the Hub: a command killed between recording its push and removing the copy left it,
    # and each later run skipped the step, the deleted checkpoint's weights kept on the disk for good
    for staged in staged_only(run_dir, repo_id, recorded=True):
        check_free()
        shutil.rmtree(staged, ignore_errors=True)
    return records


def push_one_checkpoint(
    api, run_dir: Path, repo_id: str, folder: Path, branches: set, staged=False, check_free=lambda: None
) -> list[dict]:
    """`folder` (a checkpoint, or a `staged` copy) to its branch, checked as the run's pusher checks it, skipped where
    the branch holds it already: the record written. `check_free()` is asked before a staged copy is pushed, and
    before it is removed."""
    step = step_of(folder)
    branch = branch_name(step)
    try:
        if staged:
            # Its checkpoint saved since: the job's own upload, not this command's. The look unanswered (ESTALE, EIO) is
            # ReadFailed, recorded: Python 3.14's exists() said False, and the copy was pushed and removed while its
            # checkpoint is there; raised, it ended the command
            with reading():
                if writes.exists(run_dir / folder.name):
                    return []
            check_free()
            print(f"{deleted_step(folder)}: pushing its copy in {run_dir / STAGING}", flush=True)
        elif not marked(folder):
            print(f"Skipped {folder.name}: no {MARKER} mark (written only once a checkpoint is whole)", flush=True)
            return []
        entry = checked_push(api, run_dir, repo_id, folder, branches)
    except Exception as e:
        # The upload's failure has `.attempts`; one after it (the record of a push made) ends the command
        if not isinstance(e, (NotPushable, ReadFailed)) and not hasattr(e, "attempts"):
            raise
        # NotPushable: cut short, or damaged (its SHA-256, as the upload hashes it): no run of the command can ever
        # push it, so `pushable: false`, not among the steps "run the same command again" pushes
        never = isinstance(e, NotPushable)
        error = deleted_step(folder, e) if staged and never else why(e)
        warn(f"{folder.name} was not pushed to {repo_id}@{branch}: {error}")
        attempts = None if isinstance(e, (NotPushable, ReadFailed)) else e.attempts  # none made, or the Hub's failure
        entry = record_checkpoint(
            run_dir, repo_id, step, "failed", attempts=attempts, error=error, pushable=False if never else None
        )
        if not never:  # not damaged (ReadFailed), or the Hub failing: a staged copy kept, for the command run again
            return [entry]
    if staged:
        # On the Hub now, or no whole copy to push ever: removed, else every later run of the command found it again
        # (a damaged one failing each time, "run the same command again"); never under a job started meanwhile
        check_free()
        shutil.rmtree(folder, ignore_errors=True)
    return [entry]


def checked_push(api, run_dir: Path, repo_id: str, folder: Path, branches: set) -> dict:
    """`folder` to its branch, skipped where the branch holds it already; NotPushable where it is not whole or damaged
    (before any upload): the record written."""
    step = step_of(folder)
    branch = branch_name(step)
    names = pushable_files(folder)
    remote = remote_files(api, repo_id, branch) if branch in branches else None
    # its files' reads (ReadFailed: recorded, where the OSError ended push_to_hub.py), not the Hub's: requests' errors
    # are OSErrors too
    with reading():
        held = remote is not None and holds(remote, folder, names)
    if held:
        print(f"Skipped {folder.name}: {repo_id}@{branch} already holds it", flush=True)
        return record_checkpoint(run_dir, repo_id, step, "present", files=names)
    return push_checkpoint(api, repo_id, folder, step, run_dir)


def held_for_staging(out: Path, repo_id: str) -> Path | None:
    """The run's newest own complete checkpoint whose latest record says its push failed before any upload (no
    `attempts`: its staging, or a read, failed), one a command can push (not `pushable: false`), with no staged copy:
    the one an earlier job's rotation kept for its staging. Not one whose upload failed: its copy was staged, and
    kept, or removed for a newer failure's (`_keep`, one at a time), which the job chose; held, it took the one hold
    from an older checkpoint whose staging failed, which the resume's rotation then deleted, on neither disk nor Hub."""
    latest = latest_checkpoint_records(out, repo_id).values()
    failed = {r["step"] for r in latest if r["status"] == "failed" and r.get("pushable", True) and "attempts" not in r}
    for folder in reversed(own_checkpoints(out)):
        if step_of(folder) in failed and not writes.exists(out / STAGING / folder.name) and is_complete(folder):
            return folder
    return None


class CheckpointPusher(TrainerCallback):
    """Pushes each complete checkpoint to branch `step-<N>` in a background thread (main process only), placed after
    `CompleteMarker`; `finish` waits, bounded, for uploads still running."""

    def __init__(self, repo_id: str, token: str, private: bool | None, output_dir: str | Path):
        self.repo_id, self.token, self.private = repo_id, token, private
        self.out = Path(output_dir)
        self.queue: queue.Queue = queue.Queue()
        self.pending: dict[int, Path] = {}  # step -> staged folder, until its upload ends
        # Steps whose upload failed for good: their staged copy is kept, the step's last where its checkpoint is gone
        self.kept: set[int] = set()
        # Steps whose checkpoint could not be staged (a read failing): tried again at each save; the newest kept by
        # rotation meanwhile (checkpoints.unstaged), an older one deleted since recorded lost (`_retry_unstaged`)
        self.not_staged: set[int] = set()
        self.thread: threading.Thread | None = None
        self.hold_again()

    def hold_again(self) -> None:
        """The hold an earlier job's pusher had (checkpoints.unstaged is in memory only), made again before a resume
        settles: its rotation (CompleteMarker's on_train_begin) comes before `submit_left` stages the checkpoint again,
        and a requeue deleted the one kept for its staging, its record left `failed` for a push "later" of nothing.
        Built on the main process alone (build_run), before the trainer's callbacks run."""
        try:
            folder = held_for_staging(self.out, self.repo_id)
        except OSError as e:  # rank 0 alone: a warning, never an OSError the other ranks would wait on
            warn(
                f"the checkpoint an earlier job could not stage for {self.repo_id} could not be looked for "
                f"({cause(e)}); save_total_limit may delete it before it is pushed"
            )
            return
        if folder is not None:
            self.not_staged.add(step_of(folder))
            unstaged.clear()
            unstaged.add(folder.absolute())

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run first pushes its own complete checkpoints a stopped job left unpushed."""
        if state.is_world_process_zero:
            self.submit_left()

    def submit_left(self) -> None:
        """The run's own complete checkpoints (never a person's copy) and staged copies not recorded on the Hub,
        queued: a stopped job's, or those a stop request gave up at the end of training. Their records or folders
        unread (ESTALE, EIO): a warning, the push left for push_to_hub.py. Called on rank 0 alone (on_train_begin),
        an OSError raised ended rank 0 while the other ranks waited in their next collective."""
        try:
            self._submit_left()
        except OSError as e:
            warn(
                f"the checkpoints an earlier job left unpushed to {self.repo_id} could not be listed ({cause(e)}); "
                f"training goes on: `{push_command(self.out, '--checkpoints')}` pushes them later"
            )

    def _submit_left(self) -> None:
        done = {s for s, _ in pushed_revisions(self.out, self.repo_id)}
        for folder in own_checkpoints(self.out):
            if step_of(folder) not in done:
                self.submit(folder)
        for staged in staged_only(self.out, self.repo_id):
            self.submit_staged(staged)

    def submit_staged(self, staged: Path) -> None:
        """A staged copy pushed as it is, checked as a checkpoint is; one a kill cut short is recorded `failed`,
        saying the step is gone, not passed over without a word."""
        step = step_of(staged)
        if step in self.pending:
            return
        try:
            pushable_files(staged)
        except NotPushable as e:
            self._failed(step, None, deleted_step(staged, e), never=True)
            # Recorded once: kept, each requeued job found it again and wrote its `failed` line anew
            shutil.rmtree(staged, ignore_errors=True)
            return
        except ReadFailed as e:  # not damaged: kept for the next job or push_to_hub.py (the end's clearing too)
            self.kept.add(step)
            self._failed(step, None, str(e), kept=staged)
            return
        print(f"{deleted_step(staged)}: pushing its copy in {self.out / STAGING}", flush=True)
        self._queue(step, staged)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._retry_unstaged()
            self.submit(self.out / f"checkpoint-{state.global_step}")

    def _retry_unstaged(self) -> None:
        """After the save's rotation: each step whose staging failed tried again while its checkpoint is on disk
        (said once, at its failure), and one rotation deleted since (an older one, which it no longer kept) recorded
        `pushable: false`, its warning saying so, never "pushes it later"."""
        for step in sorted(self.not_staged):
            present = marked(self.out / f"checkpoint-{step}", None)
            if present:
                self.submit(self.out / f"checkpoint-{step}", retried=True)
            elif present is False:
                self._staged_or_not_pushable(self.out / f"checkpoint-{step}")
                self._failed(step, None, "it could not be staged before save_total_limit deleted it", never=True)

    def _unstaged(self, folder: Path, error: str, retried: bool) -> None:
        """`folder` could not be staged: recorded failed (once), and kept by rotation until it is, the newest alone (as
        `_keep` keeps staged copies): every checkpoint kept while reads fail would fill the disk."""
        step = step_of(folder)
        if not retried:
            self._failed(step, None, error)
        self.not_staged.add(step)
        if step >= max(self.not_staged):
            unstaged.clear()
            unstaged.add(folder.absolute())

    def submit(self, folder: Path, retried: bool = False) -> None:
        """`folder` staged and queued; `retried`: its earlier staging failed, and was said."""
        step = step_of(folder)
        if step in self.pending:
            return
        try:
            # never a checkpoint without its mark; its read failing (ReadFailed) too is a warning, never an OSError out
            # of on_save on rank 0 alone
            if not marked(folder):
                return
            pushable_files(folder)  # sizes only, in the training loop: the upload thread hashes (verified_additions)
        except NotPushable as e:
            self._staged_or_not_pushable(folder)  # no command pushes it: rotation lets it go
            self._failed(step, None, str(e), never=True)
            return
        except ReadFailed as e:  # in the training loop: a warning, the checkpoint left for a later push
            self._unstaged(folder, str(e), retried)
            return
        try:  # rank 0 alone (on_save): its OSError (an unanswered look, ESTALE) a warning, as the reads above are
            # Claimed as it is first made: a link or a person's folder of that name is moved aside, never staged into
            run_files.set_aside_if_not_own(self.out, STAGING)
            if run_files.read(self.out) is not None:  # a folder without a record (none made by a run of now): none
                run_files.claim(self.out, [STAGING])
        except OSError as e:  # nothing staged: the staging folder, perhaps a person's, is left as it is
            self._unstaged(folder, f"it could not be staged ({cause(e)})", retried)
            return
        try:
            staged = stage(folder, self.out / STAGING)
        except OSError as e:  # its manifest's read failing now (model_files raises it): no half copy left, no crash
            shutil.rmtree(self.out / STAGING / folder.name, ignore_errors=True)
            self._unstaged(folder, f"it could not be staged ({cause(e)})", retried)
            return
        self._staged_or_not_pushable(folder)  # its copy outlives it: rotation may delete it now
        self._queue(step, staged)

    def _staged_or_not_pushable(self, folder: Path) -> None:
        """`folder` no longer kept by rotation for its staging."""
        self.not_staged.discard(step_of(folder))
        unstaged.discard(folder.absolute())

    def _queue(self, step: int, staged: Path) -> None:
        """The upload of `staged` queued for the worker thread."""
        self.kept.discard(step)
        self.pending[step] = staged
        self.queue.put(step)
        if self.thread is None:
            # daemon: an upload hung on a dead network must not keep the job alive past `finish` (HfApi's
            # run_as_future's worker is joined at exit)
            self.thread = threading.Thread(target=self._work, name="dpotrain-hub-push", daemon=True)
            self.thread.start()

    def _work(self) -> None:
        api, repo_ready = HfApi(token=self.token), False
        while True:
            step = self.queue.get()
            staged = self.pending[step]
            try:
                with hub_switches.online_for_push():  # the run's own offline switch (a slow Hub at start) lifted
                    if not repo_ready:
                        with_retries(
                            lambda: api.create_repo(self.repo_id, private=self.private, exist_ok=True), "create_repo"
                        )
                        repo_ready = True
                    push_checkpoint(api, self.repo_id, staged, step, self.out)
            except UnrecordedPush as e:
                warn(f"{e}; training goes on")
            except Exception as e:  # noqa: BLE001 - a bug must not kill the worker thread: _failed records it
                # The copy may be the step's last (rotation deletes the checkpoint); a damaged one is none to keep
                if not isinstance(e, NotPushable):
                    self._keep(step)
                kept = staged if step in self.kept else None
                self._failed(step, getattr(e, "attempts", 1), why(e), kept, never=isinstance(e, NotPushable))
            finally:
                if step not in self.kept:
                    shutil.rmtree(staged, ignore_errors=True)
                self.pending.pop(step, None)
                self.queue.task_done()

    def _keep(self, step: int) -> None:
        """`step`'s staged copy kept after its upload failed for good, the newest alone: while the Hub fails every
        upload, each copy kept held a whole checkpoint once rotation deleted it, filling the disk past
        save_total_limit. An older one removed is said where it was its step's last copy."""
        for older in sorted(self.kept):
            present = marked(self.out / f"checkpoint-{older}", None)
            if present is None:  # not known whether it is its step's last copy: kept, nothing lost
                continue
            self.kept.discard(older)
            shutil.rmtree(self.out / STAGING / f"checkpoint-{older}", ignore_errors=True)
            if not present:
                warn(
                    f"the copy of checkpoint-{older} kept after its failed upload is removed for checkpoint-{step}'s "
                    f"(one is kept at a time): its checkpoint is deleted, so step {older} is on neither the disk nor "
                    "the Hub"
                )
        self.kept.add(step)

    def _failed(self, step: int, attempts: int | None, error: str, kept: Path | None = None, never=False) -> None:
        """`attempts`: None where none was made; `kept`: the staged copy kept; `never`: not pushable as it is
        (NotPushable: cut short, damaged), which push_to_hub.py checks as the run does."""
        lost = False if never else None  # `pushable: false`: push_to_hub.py names it lost, not one to run it again for
        try:
            record_checkpoint(self.out, self.repo_id, step, "failed", attempts=attempts, error=error, pushable=lost)
            recorded = f"Recorded in {self.out / PUSH_RECORD}"
        except OSError as e:  # raised here, it would end the thread, and the checkpoints queued after with it
            recorded = f"Not recorded ({cause(e)})"
        again = f"`{push_command(self.out, '--checkpoints')}` pushes it later"
        # a failure while recording a failure: said below, never raised
        present = marked(self.out / f"checkpoint-{step}", None)
        gone = present is False
        if present is None:
            error = f"{error}; whether checkpoint-{step} is still on disk could not be read"
        on_disk = f"{again} while it is still on disk"
        later = {  # by (a copy kept, the checkpoint gone)
            (True, True): f"{again} from its copy in {kept}, kept (the checkpoint was deleted)",
            (True, False): f"{on_disk}, or from its copy in {kept}, kept where save_total_limit deletes it",
            # a staged copy a kill cut short, or damaged: the command it named could not push it
            (False, True): "no command can push it: its checkpoint was deleted, and no whole copy of it is left",
            (False, False): on_disk,
        }[bool(kept), gone]
        if never and not gone:  # "pushes it later" was a promise the command could not keep: it refuses it too
            later = "no command can push it as it is: push_to_hub.py --checkpoints checks it as the run does"
        warn(
            f"checkpoint-{step} was not pushed to {self.repo_id}@{branch_name(step)} ({error}); training goes "
            f"on. {recorded}; {later}"
        )

    def _clear_staging(self) -> None:
        """Nothing pending: the staged copies removed, but a kept one whose checkpoint is gone; the folder and the
        run's claim on it too where none is left."""
        root = self.out / STAGING
        try:
            there = writes.is_dir(root) and not root.is_symlink()
        except OSError as e:  # unanswered (ESTALE): Python 3.14's is_dir() said no folder, and its kept copies disowned
            warn(f"{root} was left as it is: it could not be looked at ({cause(e)})")
            return
        if not there:
            run_files.disown(self.out, [STAGING])
            return
        kept = {f"checkpoint-{s}" for s in self.kept if not marked(self.out / f"checkpoint-{s}", None)}  # None: kept
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
            run_files.disown(self.out, [STAGING])  # gone: a folder of that name made later is a person's
            return
        for entry in root.iterdir():
            if entry.name in kept:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def finish(self, timeout: float, stop_asked=None) -> list[int]:
        """Wait up to `timeout` s for the uploads still running; returns the steps left (recorded). `stop_asked()`
        gives the wait up: the steps left recorded `unfinished`, PushStopped raised for the requeue, which pushes
        them (waited for, a hung Hub held the job until Slurm killed it, unrequeued at a time limit)."""
        deadline, stopped = time.monotonic() + timeout, False
        while not stopped:
            with self.queue.all_tasks_done:  # notified by the worker's task_done
                wait = deadline - time.monotonic()
                if not self.queue.unfinished_tasks or wait <= 0:
                    break
                self.queue.all_tasks_done.wait(wait if stop_asked is None else min(wait, 1.0))
            # Asked outside the queue's lock: the stop file's stat on a hung file system must not hold the worker's
            # task_done, and so the upload it waits for
            stopped = stop_asked is not None and stop_asked()
        left = sorted(self.pending)
        if not left:
            self._clear_staging()
            return left
        steps = ", ".join(map(str, left))
        # Given up: the process's end must not wait on them (Python's exit joins an LFS upload's pool workers, a
        # daemon thread's too), or a hung upload holds the job past its end
        abandon_threads()
        for step in left:
            error = "given up on a stop request" if stopped else "still uploading"
            record_checkpoint(self.out, self.repo_id, step, "unfinished", error=error)
        if stopped:
            warn(
                f"checkpoint uploads still running were given up on a stop request (steps {steps}), recorded "
                f"unfinished in {self.out / PUSH_RECORD}: the same command (the requeued job) pushes the ones still "
                "on disk, training nothing"
            )
            raise PushStopped
        warn(
            f"checkpoint uploads still running after {timeout:.0f} s were abandoned (steps {steps}): "
            f"`{push_command(self.out, '--checkpoints')}` pushes the ones still on disk"
        )
        return left

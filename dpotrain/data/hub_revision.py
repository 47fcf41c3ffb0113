"""The commit of a Hub data set a run trains on: decided once, when the run first starts, and kept by every resume.

A Hub data set's `main` moves whenever its owners push: a run requeued after such a push would go on with other pairs
than its step plan and reference log-probs were made for. So the run resolves `dataset_revision` to a commit once,
loads the data set at that commit and records it (`derived.data_identity`); a resume loads the recorded commit again,
and a `dataset_revision` naming another commit is refused as changed data are. Each Hub source of a mixture is read
at the commit its main has when the run starts (`mixture.pin`) and recorded by it; a resume reads the recorded commit
again (`mixture.kept`), wherever main is by then."""

import re
from pathlib import Path

from dpotrain.data import data
from dpotrain.recipe import run_record
from dpotrain.recipe.errors import ConfigError

KEY = "hub_commit"  # derived.data_identity's field for a Hub data set
COMMIT = re.compile(r"[0-9a-f]{40}")


def applies(name: str | None) -> bool:
    """A single data set read from the Hub (not a local file or folder)."""
    return bool(name) and not data.is_local(name)


def commit(name: str, revision: str | None, kind: str = "dataset", local_only: bool = False) -> str | None:
    """The commit `revision` (default: main) of the Hub `kind` ("dataset" or "model") `name` points to (a commit:
    itself): asked of the Hub (not with `local_only`), else read from the Hub cache's refs; None if neither says."""
    if revision and COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import HfApi
    from huggingface_hub.constants import HF_HUB_CACHE

    if not local_only:
        info = HfApi().dataset_info if kind == "dataset" else HfApi().model_info
        try:
            return info(name, revision=revision, timeout=10).sha
        except Exception:  # noqa: BLE001 - offline, no access: the cache's refs, else the load says
            pass
    ref = Path(HF_HUB_CACHE) / f"{kind}s--{name.replace('/', '--')}" / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def resolve(name: str, revision: str | None) -> str | None:
    """The commit `revision` points to now (`commit`); the revision itself where that cannot be told, so that the run
    still loads what it was asked for."""
    found = commit(name, revision)  # a resumed run's recorded commit, or one given by hand: itself
    return found if found and COMMIT.fullmatch(found) else revision


def identity(revision: str | None) -> dict | None:
    """What the run records of a Hub data set: the commit it loaded (nothing where it loaded a name, not a commit)."""
    return {KEY: revision} if revision and COMMIT.fullmatch(revision) else None


def kept(recipe, output_dir: str) -> str | None:
    """The commit a continued run (its resolved_config.json in `output_dir`) loads: the one it started on, unless a
    revision is given (then `changed` has compared it); None for a new run."""
    name, given = recipe.script.dataset_name, recipe.project.dataset_revision
    if given is not None or not applies(name):
        return None
    recorded = record(output_dir)
    # Of this data set (as mixture.kept checks each source's repo): another's run in the folder (a job starting afresh
    # there on other data, or a dry run going past the changed data's refusal) holds a commit that is none of its own
    if recorded is None or recorded.values.get("dataset_name", name) != name:
        return None
    return (recorded.data.data_identity or {}).get(KEY) or None


def record(output_dir: str):
    """The run record (resolved_config.json) in `output_dir`, or None: none, one refused by the output checks already
    (a dry run lists it), or one edited by hand after the run wrote it (a commit "fixed" there was loaded), whose
    values a resume does not use either (resume.say_hand_edit: it reads the checkpoint's own copy)."""
    path = Path(output_dir) / run_record.RESOLVED
    if run_record.edited_file(path):
        return None
    try:
        return run_record.read(path)
    except ConfigError:
        return None


def commit_of(identity: str) -> str | None:
    """The commit a Hub data set's `lengths.dataset_identity` (`hub:...@<commit>`) names; None where it names a
    revision's name (`...@main`: the commit could not be told when it was taken)."""
    found = identity.rsplit("@", 1)[-1][:40]
    return found if COMMIT.fullmatch(found) else None


def changed(recorded: str, name: str, given: str | None) -> str | None:
    """How a `dataset_revision` given on a resume differs from the commit the run trained on, or None."""
    if given is None:
        return None
    now = resolve(name, given)
    if now == recorded or not COMMIT.fullmatch(now):  # the same commit, or one the Hub cannot name here
        return None
    return f"{name} at {given} is commit {now[:12]}, the run trained on commit {recorded[:12]}"


def check_loaded(
    dataset,
    name: str,
    revision: str | None,
    prefetch: str,
    source: bool = False,
    evaluation: bool = False,
    recorded: bool = False,
) -> None:
    """The data set read is the commit asked for. Offline, `datasets` reads the copy it prepared last, whatever the
    revision (huggingface/datasets issue 7928); the prepared files sit in a folder named for their commit, so another
    commit's copy is refused rather than trained on, naming the command (`prefetch`, the run's
    `python scripts/prefetch.py ...`) that fetches this one and makes it the copy read last. A mixture's Hub `source`
    is read at its main's commit, or a resumed run's at the one its record holds, and prefetch.py takes no `--revision`
    for one: it fetches each source at main, or with the run's `--output_dir` at its recorded commit. `recorded`: the
    commit a resumed run's record holds, which `prefetch` (given the run's `--output_dir`) fetches; else prefetch.py
    is told the commit (`--revision`). `evaluation`: held-out pairs, which the run evaluates on."""
    files = [f["filename"] for f in getattr(dataset, "cache_files", None) or []]
    if not (revision and COMMIT.fullmatch(revision) and files) or any(f"/{revision}/" in f for f in files):
        return
    if source:
        fix = (
            f"fetch the mixture's sources where the Hub is reachable ({prefetch}: each at main, or a resumed run's at "
            "the commit its record holds), which makes each the copy read"
        )
    elif recorded:
        fix = (
            f"fetch it where the Hub is reachable ({prefetch}: the commit the run's record holds), which makes it the "
            "copy read, or start a new run"
        )
    else:
        fix = f"fetch that commit where the Hub is reachable ({prefetch} --revision {revision})"
    use = "evaluates on" if evaluation else "trains on"
    raise ConfigError(
        f"{name}: the copy read is not commit {revision[:12]}, which this run {use} ({Path(files[0]).parent}), "
        f"as datasets reads the copy cached last when HF_HUB_OFFLINE is set: {fix}"
    )

"""Push a finished run to the Hugging Face Hub from a machine that reaches it, when the job's nodes had no network.

    python scripts/push_to_hub.py outputs/think-dpo                          # to the run's hub_model_id
    python scripts/push_to_hub.py outputs/think-dpo --checkpoints            # and each checkpoint to a branch step-<N>
    python scripts/push_to_hub.py outputs/think-dpo --repo-id org/name --private

Uploads what the job would have pushed (dpotrain.hub.hub.push_run) to the repo's main branch: the model, tokenizer,
model card (README.md), training_curves.png, metrics and resolved config. With --checkpoints, first each complete
checkpoint still on disk goes to a branch `step-<N>` (model weights, config, tokenizer; never optimizer state), and a
step whose upload failed or was cut short after save_total_limit deleted it, from its copy in .hub_staging/:
save_total_limit has deleted the older ones, which no command can push any more. A branch or main that already holds
the same files is skipped, so running it again after an interruption pushes only what is missing. Outcomes are
appended to the run's hub_pushes.jsonl and the card lists the pushed revisions. A run that has not finished (stopped:
no run_complete.json, no final model) gets its complete checkpoints pushed with --checkpoints, and main nothing (one
with no complete checkpoint is refused saying so); a finished run with a missing piece is refused with what is
missing, and a finished run whose
weights are not one save's (model.safetensors beside a sharded index, a shard its index does not name) with those
files, or whose weights are cut short since (a copy of the folder stopped midway), before anything uploads. The repo
defaults to `hub_model_id` in the run's resolved_config.json. HF_TOKEN comes from .env, the environment or `hf auth
login`, and is never printed; write access to the repo is checked before anything uploads.
"""

import contextlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python scripts/push_to_hub.py` from anywhere
from dpotrain.recipe import venv  # noqa: E402

with venv.entry_point(ROOT, command=__name__ == "__main__"):  # the project's venv, then .env, then torch
    from transformers.hf_argparser import string_to_bool

    from dpotrain import output_folder
    from dpotrain.cluster import offline, run_lock
    from dpotrain.hub import hub, hub_push
    from dpotrain.recipe import cli, run_record
    from dpotrain.recipe.errors import ConfigError, RunError, cause, plural, run_command, unanswered, warn
    from dpotrain.train import checkpoints, run_files
    from dpotrain.train.resume import HEALTH_STOP


def check_is_a_run(run: Path) -> None:
    """A checkpoint's folder, or a folder no run wrote, refused as what it is: both were "not a finished run: missing
    run_complete.json (training has not finished: resume it with the same command)", of a run that had finished."""
    folder = run.resolve()
    if re.fullmatch(r"checkpoint-\d+", folder.name) and (folder.parent / run_record.RESOLVED).is_file():
        raise ConfigError(
            f"{run} is a checkpoint of the run in {folder.parent}: push that folder (`--checkpoints` also pushes each "
            "checkpoint on disk to a branch step-<N>)"
        )
    if not any((folder / name).is_file() for name in (run_record.RESOLVED, "run_files.json")):
        raise ConfigError(
            f"{run} is not a run's output folder (no resolved_config.json): pass the --output_dir a run wrote, "
            "e.g. outputs/think-dpo"
        )


def main(argv: list[str] | None = None) -> None:
    if __name__ != "__main__":  # an importer (the tests); a command read it before its imports, once
        venv.load_env(ROOT)  # HF_TOKEN
    parser = cli.Parser(prog="push_to_hub.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's output folder, e.g. outputs/think-dpo")
    parser.add_argument("--repo-id", "--hub_model_id", help="org/name to push to (default: hub_model_id of the run)")
    parser.add_argument(
        "--private",
        "--hub_private_repo",
        nargs="?",
        const=True,
        type=string_to_bool,
        metavar="BOOL",
        help="create the repo private: `--private`, or `--hub_private_repo true` as training spells it; false: public, "
        "as the run creates it (default: the run's hub_private_repo; unset there too: the namespace's default)",
    )
    parser.add_argument(
        "--checkpoints",
        action="store_true",
        help="also push each complete checkpoint on disk (and one left only in .hub_staging/) to a branch step-<N>",
    )
    args = parser.parse_args(argv)

    run = Path(args.run_dir)
    if not run.is_dir():
        raise ConfigError(f"{run} is not a folder: pass a run's output folder, e.g. outputs/think-dpo")
    # A damaged record of the run's files refused with this command's remedy (a run's says to pass another output_dir)
    fix = "it names the run's own files, the only ones pushed: restore it from a copy, or upload the files you choose "
    run_files.read(run, fix + "yourself (huggingface_hub's `hf upload`)")
    check_is_a_run(run)
    check_no_live_run(run)
    check_record_as_written(run)
    # The record of pushes, read before anything uploads: a line changed by hand was refused only once the checkpoints
    # had gone up, as the card's list of them was made. One unreadable (a folder in its place) is said as a push's
    # record that could not be written is.
    with contextlib.suppress(OSError):
        hub_push.read_pushes(run)
    problems = hub.run_folder_problems(run)
    stopped = stopped_checkpoints(run)
    if problems and not stopped:
        # It finished: a copy of its folder stopped midway, or a file deleted since (it was "not a finished run")
        if (run / hub.RUN_COMPLETE).is_file():
            raise ConfigError(
                f"{run} holds a finished run with files missing: {', '.join(problems)}: copy them again from the "
                "folder the run wrote (a copy of it stopped midway, or files deleted since); nothing was pushed"
            )
        if stop := health_stopped(run):  # a nonfinite stop writes no checkpoint: "resume it with the same command"
            # was the advice, a command such a run refuses
            raise ConfigError(
                f"{run} has not finished training (no {hub.RUN_COMPLETE}) and has no checkpoint to push: {stop}"
            )
        # Stopped before its first save ended (killed, a time limit): its model files were listed "missing", as if lost
        saved = [p.name for p in checkpoints.own_checkpoints(run)]
        none = (
            f"has no complete checkpoint ({', '.join(saved)}: a save cut short)"
            if saved
            else "has saved no checkpoint yet"
        )
        raise ConfigError(
            f"{run} has not finished training (no {hub.RUN_COMPLETE}) and {none}, so nothing of it can be pushed: "
            "resume it with the same command, then push it"
        )
    if not stopped:
        hub.check_one_model(run)  # before any upload: the checkpoints' come first
        hub.check_saved_model(run)  # by size here; by SHA-256 as main's push hashes each file (hub.push_run)
    if stopped and not args.checkpoints:
        steps = [checkpoints.step_of(p) for p in stopped]
        finish = health_stopped(run) or "resume it with the same command, then push it"
        raise ConfigError(
            f"{run} has not finished training (no {hub.RUN_COMPLETE}): {finish}; "
            f"add --checkpoints to push {', '.join(p.name for p in stopped)} now, to "
            f"{'branch' if len(stopped) == 1 else 'branches'} {', '.join(hub_push.branch_name(s) for s in steps)} "
            "(main gets only a finished model)"
        )
    saved = run / run_record.RESOLVED
    recorded = (run_record.read(saved) or run_record.of({})).settings  # the push it made
    repo_id = args.repo_id or recorded.hub_model_id
    if not repo_id:
        raise ConfigError(f"no repo to push to: pass --repo-id org/name ({saved} has no hub_model_id)")
    given = "--repo-id" if args.repo_id else f"hub_model_id of {saved}"
    hub.check_repo_id(repo_id, given, "pass --repo-id org/name")
    hub_push.retry_waits()  # before anything uploads
    # One meaning with the run's: None (unset) the namespace's default, false public (hub.create_repo)
    private = recorded.hub_private_repo if args.private is None else args.private

    from dpotrain.cluster.offline import hf_token

    token = hf_token()
    if not token:
        raise ConfigError(
            f"no Hugging Face token: add HF_TOKEN=... to .env, or run `hf auth login`{venv.hidden('HF_TOKEN')}"
        )
    if offline.is_offline():
        # Set by the project's .env (docs/hub.md's way for compute nodes, the login node sharing the project), `unset`
        # in a shell does nothing: .env sets it again at each command. A variable given with the command wins over it.
        again = shlex.join(["python", "scripts/push_to_hub.py", *(sys.argv[1:] if argv is None else argv)])
        env_file = ROOT / ".env"
        by_env = offline_in_env_file(env_file)
        raise ConfigError(
            f"HF_HUB_OFFLINE is set ({f'by {env_file}' if by_env else 'in the environment'}), so {run} cannot be "
            f"pushed to {repo_id} from here: where the Hub is reachable, run `HF_HUB_OFFLINE=0 {again}`"
            + (" (a variable set for the command wins over .env's)" if by_env else "")
        )
    # a bare name gets the user's namespace; never the run's own base model's repo
    repo_id = hub.check_write_access(repo_id, token, where="push_to_hub.py", base=recorded.model_name_or_path)
    hub.check_private(repo_id, token, private, where="push_to_hub.py")

    from huggingface_hub import HfApi

    api = HfApi(token=token)
    # The record of what this script pushes is the run's own file: --overwrite_output_dir replaces it with the rest of
    # the run, rather than keeping it as a user's file that the next run's pushes would be added to (a run written
    # before runs recorded their files has no record to add it to).
    if output_folder.read_manifest(run) is not None:
        run_files.claim(run, [hub_push.PUSH_RECORD])
    records: list[dict] = []  # the checkpoints' records as they are written: said even where the command ends early
    try:
        push(api, run, repo_id, token, private, args.checkpoints, finished=not stopped, records=records)
    except (ConfigError, RunError):  # one line naming the fix already (a push whose record could not be written)
        # the run lock's refusal mid-command too: the steps that failed before it keep their lines and fixes
        for line in closing_lines(run, records):
            warn(line)
        raise
    except Exception as e:  # noqa: BLE001 - the Hub past the retries (an outage, a network gone): one line
        for line in closing_lines(run, records):
            warn(line)
        if (line := unanswered(e)) is not None:  # a look the file server did not answer: its file and fix, not a rerun
            raise line from None
        raise RunError(
            f"pushing {run} to {repo_id} failed ({cause(e)}): run the same command again (what the Hub holds already "
            "is skipped)"
        ) from None
    said = closing_lines(run, records)
    for line in said[:-1]:  # said before the closing line, which names the steps a rerun can push
        warn(line)
    if said:
        # A push the Hub failed past the retries (or a read the file server did not answer) is a failure, exit 1, as
        # docs/hub.md says: the same command pushes it. Exit 2 (ConfigError) told a script retrying on 1 to fix its
        # input. A step to mend first, or that no command can push, is the folder's to fix: a refusal's 2.
        raise (RunError if rerun_pushes(records) else ConfigError)(said[-1])


def offline_in_env_file(env_file: Path) -> bool:
    """Whether `env_file` (the project's .env) is what set HF_HUB_OFFLINE: its value, where the environment had none."""
    from dotenv import dotenv_values

    value = dotenv_values(env_file).get("HF_HUB_OFFLINE") if env_file.is_file() else None
    return value is not None and os.environ.get("HF_HUB_OFFLINE") == value


def rerun_pushes(records: list[dict]) -> list[str]:
    """The branches among `records` whose push failed and that the same command, run again as it is, pushes: not
    those no command can push (`pushable: false`), nor those to mend first (a permission, a folder in its place)."""
    return [r["branch"] for r in failed_of(records) if r.get("pushable") is not False and not hub_push.needs_fix(r)]


def closing_lines(run: Path, records: list[dict]) -> list[str]:
    """What is said of the checkpoint pushes that failed among `records`: those no command can push, those to mend
    first, then those a rerun as it is pushes."""
    failed = failed_of(records)
    lost = [r for r in failed if r.get("pushable") is False]
    mend = [r for r in failed if r not in lost and hub_push.needs_fix(r)]  # a rerun as it is fails them again
    again = rerun_pushes(records)
    said = [never_pushed(run, lost)] if lost else []
    if mend:
        said.append(to_mend(run, mend))
    if again:
        said.append(f"{', '.join(again)} failed to push (see {run}/{hub_push.PUSH_RECORD}): run the same command again")
    return said


def to_mend(run: Path, mend: list[dict]) -> str:
    """The steps whose files no push reads until the user mends them (a permission, a folder in a file's place), each
    with its cause and fix: "run the same command again" alone failed them again, for ever. Their copies are kept."""
    why = "; ".join(f"{r['branch']}: {r['error']}" for r in sorted(mend, key=lambda r: r["step"]))
    return (
        f"{', '.join(r['branch'] for r in mend)} failed to push (see {run}/{hub_push.PUSH_RECORD}), and "
        f"{'it pushes' if len(mend) == 1 else 'they push'} only once mended: {why}; then run the same command again"
    )


def never_pushed(run: Path, lost: list[dict]) -> str:
    """The steps no command can push (a staged copy of a deleted checkpoint, cut short or damaged, removed; a
    checkpoint on disk that fails its check): "run the same command again" pushed nothing, and then said nothing."""
    why = []
    lost = sorted(lost, key=lambda r: r["step"])
    for record in lost:
        name = f"checkpoint-{record['step']}"
        try:
            on_disk = checkpoints.is_complete(run / name)
        except OSError as e:  # unanswered (ESTALE): on disk or deleted, not known; said so, not either
            why.append(
                f"{record['branch']}: {name} could not be looked at ({cause(e)}), so whether it is on disk is not "
                f"known, {record.get('error')}"
            )
            continue
        if on_disk:
            why.append(f"{record['branch']}: {name} on disk is not pushable as it is, {record.get('error')}")
        else:
            why.append(
                f"{record['branch']}: {name} was deleted, and its copy in {hub_push.STAGING} was not whole (removed)"
            )
    one = len(lost) == 1
    return (
        f"no command can push {', '.join(r['branch'] for r in lost)} (see {run}/{hub_push.PUSH_RECORD}), so "
        f"{'it is' if one else 'they are'} not on the Hub: {'; '.join(why)}"
    )


def check_record_as_written(run: Path) -> None:
    """Refuse a resolved_config.json edited after the run wrote it (its own SHA-256 disagrees): it went up to the Hub as
    the run's record (a `learning_rate` "fixed" there) beside a card and a model trained otherwise, exit 0, and its
    edited hub_model_id or base chose the repo."""
    if not run_record.edited_file(run / run_record.RESOLVED):
        return
    copy = next((f for f in reversed(checkpoints.own_checkpoints(run)) if (f / run_record.RESOLVED).is_file()), None)
    restore = (
        f"put back the run's own ({copy / run_record.RESOLVED} holds a copy)" if copy else "put back the run's own"
    )
    raise ConfigError(
        f"{run / run_record.RESOLVED} was edited after the run wrote it, and would reach the Hub as the record of a "
        f"run that was not trained so: {restore}; to push to another repo, pass --repo-id org/name; nothing was pushed"
    )


def check_no_live_run(run: Path) -> None:
    """A folder a live run holds (its run.lock: a requeued job) refused before anything is written: its own pusher
    pushes the same staged copies and removes each once pushed, under an upload of this command's (and the reverse)."""
    held = run_lock.live_holder(run)
    if held is None:
        return
    holder, age = held
    job = (holder or {}).get("slurm_job_id")
    try:  # what the job does, by its record: it said "pushes its own checkpoints" of a job that pushes nothing
        settings = (run_record.read(run / run_record.RESOLVED) or run_record.of({})).settings
    except (ConfigError, OSError):  # unread: said as a job that pushes nothing
        settings = run_record.of({}).settings
    does = "is still writing it (saving and deleting checkpoints as it trains)"
    if settings.push_checkpoints:
        does = "pushes its own checkpoints"
    elif settings.push_to_hub:
        does = f"{does}, and pushes its final model itself once it ends"
    raise ConfigError(
        f"{run} is in use by a running job ({run_lock.describe(holder, age)}; {run / run_lock.LOCK_FILE}), which "
        f"{does}: wait for it to end{f' (or stop it: scancel {job})' if job else ''}, then run this command again"
    )


def health_stopped(run: Path) -> str | None:
    """What stopped a run a health guard stopped (exit 3, its HEALTH_STOP record), and the rerun that finishes it; None
    for any other run. Such a run refuses the same command (resume.after_health_stop), which was the advice given."""
    path = run / HEALTH_STOP
    if not path.is_file():
        return None
    try:
        stop = json.loads(path.read_text())
    except (OSError, ValueError):  # a damaged record: the rerun's refusal names it
        stop = {}
    stop = stop if isinstance(stop, dict) else {}
    guard = stop.get("guard")
    what = f"the {guard} guard stopped it at step {stop.get('step')}" if guard else "a health guard stopped it"
    go_on = "" if stop.get("fatal") else " (or with --health_action warn to go on from its checkpoint)"
    return (
        f"{what} ({path}), and the same command is refused: fix the cause the stop named, then rerun it with "
        f"--overwrite_output_dir to start afresh{go_on}"
    )


def stopped_checkpoints(run: Path) -> list[Path]:
    """The run's own complete checkpoints where it has not finished (a stopped run: exit 75, or killed); [] for a
    finished run."""
    if (run / hub.RUN_COMPLETE).is_file():
        return []
    return [p for p in checkpoints.own_checkpoints(run) if hub_push.marked(p, True)]


def push(
    api, run: Path, repo_id: str, token: str, private: bool | None, with_checkpoints: bool, finished=True, records=None
) -> list[dict]:
    """The checkpoints (with --checkpoints) and main, each skipped where the Hub holds it already; returns the records
    of the checkpoint pushes that failed. A run that has not `finished` pushes its checkpoints alone: main holds only a
    finished model. `records`: the caller's list the checkpoints' records are added to as they are written."""
    records = [] if records is None else records
    if with_checkpoints:
        hub_push.with_retries(lambda: hub.create_repo(api, repo_id, private), "create_repo")
        # the run lock asked again at each staged copy: a job started since the check at the start is not raced
        hub_push.push_checkpoints(api, run, repo_id, check_free=lambda: check_no_live_run(run), records=records)
    elif isinstance(on_disk := unpushed_on_disk(run, repo_id), str):
        print(
            f"The run's checkpoints could not be counted ({on_disk}): add --checkpoints to push any not pushed yet",
            flush=True,
        )
    elif on_disk:
        print(
            f"{plural(len(on_disk), 'checkpoint')} on disk {'is' if len(on_disk) == 1 else 'are'} not pushed: add "
            f"--checkpoints to push {'it to a branch' if len(on_disk) == 1 else 'them to branches'} step-<N>",
            flush=True,
        )
    if not finished:
        stop = health_stopped(run)
        finish = (
            f"{stop}; once it has finished,"
            if stop
            else "resume the run with the same command, and once it has finished"
        )
        print(
            f"{run} has not finished training (no {hub.RUN_COMPLETE}): only its checkpoints are pushed (to branches "
            f"of {repo_id}), main is left as it was; {finish} run this command again to push its final model to main",
            flush=True,
        )
        return failed_of(records)
    # The card's branches are those of the repo pushed to (a stopped run has no card yet): pushed with --repo-id to
    # another repo than the run's, the card said its checkpoints "are branches of this repo", naming the run's repo
    hub.update_card_revisions(run, repo_id)
    main_files = hub_push.local_files(run, ignore=hub.IGNORE, allow=hub.own_files(run))  # as push_run uploads them
    if hub_push.remote_matches(api, repo_id, "main", run, main_files):
        print(f"Skipped main: {repo_id} already holds this run", flush=True)
        # confirmed: on the Hub
        hub_push.record_push(run, step=hub.finished_step(run), branch="main", status="present", repo=repo_id)
    else:
        print(f"Pushing {run} to {repo_id}{' (private)' if private else ''} ...", flush=True)
        url = hub.push_run(run, repo_id, token=token, private=private)
        print(f"Pushed to {url}", flush=True)
    return failed_of(records)


def unpushed_on_disk(run: Path, repo_id: str) -> list[Path] | str:
    """The run's own complete checkpoints on disk (never a person's copy) that hub_pushes.jsonl does not record on
    `repo_id` (those the run pushed itself were said "not pushed"), counted only for a note; why they could not be
    counted where a look went unanswered (ESTALE) or the record was unread: its error ended the push before main."""
    try:
        done = {step for step, _ in hub_push.pushed_revisions(run, repo_id)}
        return [
            p
            for p in checkpoints.own_checkpoints(run)
            if checkpoints.step_of(p) not in done and hub_push.marked(p, True)
        ]
    except (OSError, ConfigError) as e:  # a count for a note: the note says so, never ends the push
        return cause(e)


def failed_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] == "failed"]


if __name__ == "__main__":
    run_command(main)

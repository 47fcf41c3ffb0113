"""Fill the Hugging Face cache on a login node, so that a job on compute nodes without network finds everything.

    python scripts/prefetch.py --config configs/think.yaml
    python scripts/prefetch.py --config configs/instruct.yaml --model_name_or_path org/my-sft-model
    HF_HOME=/shared/hf python scripts/prefetch.py --config configs/think.yaml   # the cache the job will read

then run the job with HF_HUB_OFFLINE=1 (and the same HF_HOME). It fetches, at model_revision, the model's config,
weights (one format), tokenizer, chat template and generation config, and loads the data set exactly as training
does (datasets.load_dataset, so the prepared Arrow cache is the one the job reads). Last it checks the cache as an
offline job will, and says so. Any train_dpo.py override works here (--model_name_or_path, --model_revision,
--dataset_name, --dataset_config, --dataset_train_split, a mixture's --dataset_mixer_list, --dataset_mixer_eval_list
and their splits), plus --split and --revision (dataset_name's revision). Each Hub source of a mixture (the recipe's
`datasets:` and `eval_datasets:` too), and a Hub dataset_name without --revision, is loaded as training reads it: at
main, or, where the job's output folder holds a stopped run (its --output_dir, else the recipe's output_dir or
outputs/<run_name> in the project) or the job resumes a checkpoint (--resume_from_checkpoint), at the commit its record
holds, as its resume reads it (whether the job resumes decided as the run decides it: with --overwrite_output_dir it
resumes a complete checkpoint of the same settings); its local sources are left where they are.
HF_TOKEN comes from .env or the environment, for gated or private repos; it is never printed.
"""

import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python scripts/prefetch.py` from anywhere
from dpotrain.recipe import venv  # noqa: E402

with venv.entry_point(ROOT, command=__name__ == "__main__"):  # the project's venv, then .env, then torch
    from dpotrain import options, resolve
    from dpotrain.cluster import offline
    from dpotrain.data import hub_revision, mixture
    from dpotrain.recipe import cli
    from dpotrain.recipe.config import JobVariable, fields_set, parse_args, replaced
    from dpotrain.recipe.errors import ConfigError, cause, run_command


def main(argv: list[str] | None = None) -> None:
    offline.start_run()  # no answer from the Hub yet: one an earlier command in this process got is not this one's
    if __name__ != "__main__":  # an importer (the tests); a command read it before its imports, once
        venv.load_env(ROOT)  # HF_TOKEN for gated or private repos
    # The overrides it passes on are train_dpo.py's (the README's step 4 gives it --model_name_or_path): its --help
    # listed --config, --split and --revision alone, so a user reading it took the model for the recipe's only.
    overrides = (
        " Options not listed here (--model_name_or_path, --model_revision, --dataset_name, --dataset_config, "
        "--dataset_mixer_list, --output_dir, ...) are train_dpo.py fields: give it the job's overrides."
    )
    parser = cli.Parser(prog="prefetch.py", description=__doc__.split("\n\n")[0] + overrides)
    parser.add_argument("--config", help="the recipe the job runs, e.g. configs/think.yaml")
    parser.add_argument("--split", help="the training split (= --dataset_train_split)")
    parser.add_argument(
        "--revision",
        help="the data set's revision (branch, tag or commit); default: the recipe's dataset_revision, else main",
    )
    args, overrides = parser.parse_known_args(argv)
    recipe_args = (["--config", args.config] if args.config else []) + overrides
    recipe_args += ["--dataset_train_split", args.split] if args.split else []
    # --dry-run: a login node plans a GPU job, so transformers' "bf16 needs a GPU" check must not refuse the recipe.
    try:
        recipe = parse_args(recipe_args + ["--dry-run"])
    except JobVariable as refused:  # a path it reads named by the job's variable: its fix here, not a dry run's
        raise ConfigError(refused.before_job("prefetch.py fetches")) from None
    # Training's checks of the recipe alone (a model and data named, local files there): without them a forgotten
    # --config or a mistyped local file was "Nothing to fetch", and the job refused it later.
    resolve.check_values(recipe)
    options.check_model_path(recipe.model.model_name_or_path)
    options.check_revisions(recipe)  # a revision of a local model or data set: recorded by a run, never read
    model, script = recipe.model, recipe.script
    # The revision is dataset_name's: training reads a mixture's sources, the held-out ones beside dataset_name too, at
    # main, and a resumed run at the commits its record holds (stages.load_data), so they are fetched there: a stopped
    # run's in the folder the job uses (typed or not: a stopped run in the recipe's output_dir, or outputs/<run_name>,
    # resumes on its recorded commits as one typed does, and main was fetched for it) or the checkpoint it resumes,
    # unless the job starts afresh, decided as the run decides it (--overwrite_output_dir resumes a sound checkpoint of
    # the same settings). Read before anything downloads: a folder or checkpoint the run would refuse is refused here.
    job, note = job_folder(recipe, overrides), None
    checkpoint, out = recipe.training.resume_from_checkpoint, job.training.output_dir
    try:
        # The job is the stopped run's own. The run's lines about its folder ("training again from step 1") are the
        # job's to say: here one line says what the job is fetched for (below)
        with contextlib.redirect_stdout(io.StringIO()):
            decision = resolve.check_output_dir(job, resolve.AS_RECORDED)
    except ConfigError as refused:
        if "output_dir" in fields_set(overrides) or checkpoint:
            raise
        # The recipe's folder, untyped, refused (a finished run: `bash scripts/demo.sh`'s): the job that reads the
        # data is one given another --output_dir (or --overwrite_output_dir), a new run's, as the command a job prints
        # names it. Said where something is fetched: local files alone make the folder no matter here
        note = (
            f"note: a job without --output_dir would be refused ({refused}); fetching for a new run, as a job given "
            "another --output_dir or --overwrite_output_dir starts one"
        )
        decision = resolve.OutputDecision(None, True)
    recorded = resolve.continued_record(decision, out)  # a new folder's holds no record: main, as for a new run
    if decision.job_folder:  # named by the job's SLURM_ variables: made as the job starts, holding no stopped run
        said = f"The job's own folder, {out}, is new (Slurm names it as the job starts): fetching as for a new run"
        print(said, flush=True)
    if recorded and hub_revision.record(recorded) is not None:  # a run recorded there (a new folder holds none)
        # With --overwrite_output_dir the job resumes only where its settings are the record's, which this command is
        # not given (the one a job prints names its data flags alone)
        unless = (
            ", where its settings are that run's (with other settings it starts afresh on main: fetch for it with a "
            "new --output_dir)"
            if recipe.project.overwrite_output_dir
            else ""
        )
        print(f"The job resumes the run in {checkpoint or out}{unless}: its data as that run recorded it", flush=True)

    hub_model, hub_data = offline.is_hub_model(model.model_name_or_path), offline.hub_datasets(recipe)
    if not (hub_model or hub_data):
        print(f"Nothing to fetch: {model.model_name_or_path} and {script.dataset_name or 'the mixture'} are local.")
        return
    if note:
        print(note, flush=True)
    if args.revision and mixture.given(mixture.fields_of(recipe)):
        raise ConfigError(
            "--revision names dataset_name's revision, and this recipe has a mixture (each source is fetched at "
            "main, or at the commit a stopped run's record holds, given its --output_dir): remove --revision"
        )
    if offline.is_offline():  # nothing can download; say whether the cache already holds everything
        missing = offline.missing_artifacts(recipe)
        if missing:
            raise ConfigError(
                f"HF_HUB_OFFLINE is set, so nothing can download, and the cache lacks: {'; '.join(missing)}. "
                "Run this where the Hub is reachable, without HF_HUB_OFFLINE"
            )
        print("Everything is cached already (HF_HUB_OFFLINE is set, so nothing was downloaded).")
        return

    pieces = [f"model {model.model_name_or_path!r}"] * hub_model + [f"data set {s.path!r}" for s in hub_data]
    offline.check_hub_reachable(
        [f"prefetch.py downloads {' and '.join(pieces)}"],
        "run it on a machine with network (a login node), then the job with HF_HUB_OFFLINE=1 and the same HF_HOME; "
        "or fix HF_ENDPOINT / HTTPS_PROXY",
    )  # in seconds, not after huggingface_hub's minute of retries
    from dpotrain.cluster.offline import hf_token

    token = hf_token()
    if hub_model:
        fetch_model(model.model_name_or_path, model.model_revision, token)
    kept = mixture.kept(recipe, recorded) if recorded else {}
    if kept:
        said = f"Mixture sources at the commits the run in {checkpoint or out} recorded, which its resume reads"
        print(said, flush=True)
    # dataset_name's, the commit its resume loads (hub_revision.kept), unless a revision is given
    named_at = (
        args.revision or recipe.project.dataset_revision or (hub_revision.kept(recipe, recorded) if recorded else None)
    )
    named = mixture.Source(script.dataset_name, script.dataset_train_split, name=script.dataset_config)
    for source in hub_data:
        fetch_dataset(source, named_at if source == named else mixture.pinned(source, kept), token)
    offline.check_offline_artifacts(recipe, offline=True)
    home = f" and HF_HOME={os.environ['HF_HOME']}" if os.environ.get("HF_HOME") else ""
    print(f"Ready: a job with HF_HUB_OFFLINE=1{home} finds everything it reads from the Hub.")


def job_folder(recipe, overrides: list[str]):
    """`recipe` with the output folder the job uses: a relative one the job's command line does not name (the
    recipe's, or outputs/<run_name>) is the project's, where a Slurm job runs (scripts/launch.sh), wherever prefetch.py
    is typed; one typed is read where it is typed, as the job reads it in the folder submitted from. The job's own
    folder starting at a variable the job sets (`$SCR/run`) is wherever that variable leads: left as written."""
    out = recipe.training.output_dir
    typed, absolute = "output_dir" in fields_set(overrides), os.path.isabs(os.path.expanduser(out))
    if typed or absolute or (recipe.job_folder and out.startswith("$")):
        return recipe
    return replaced(recipe, training={"output_dir": str(ROOT / out)})


def fetch_model(repo_id: str, revision: str | None, token: str | None) -> None:
    from huggingface_hub import HfApi, snapshot_download

    try:
        files = offline.select_model_files(HfApi(token=token).list_repo_files(repo_id, revision=revision))
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=files, token=token))
    except Exception as e:  # noqa: BLE001 - whatever the Hub raised: hub_error names it and the fix
        raise ConfigError(hub_error(e, "model", repo_id, revision, token)) from None
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # stat follows the links into blobs/
    print(f"model   {repo_id}@{revision or 'main'}: {len(files)} files, {size / 1e9:.2f} GB -> {path}", flush=True)


def fetch_dataset(source: mixture.Source, revision: str | None, token: str | None) -> None:
    """One data set (dataset_name, or a mixture's Hub source) loaded at `revision` (None: main) as training loads it."""
    name, config, split = source.path, source.name, source.split
    try:
        dataset = mixture.read_source(source, revision=revision)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the Hub raised: hub_error names it and the fix
        raise ConfigError(hub_error(e, "dataset", name, revision, token)) from None
    folder = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
    if folder:
        # Offline, datasets reads the newest prepared copy of a data set (packaged_modules/cache/cache.py,
        # `_find_hash_in_cache`): make the copy just fetched the newest, so the job reads this revision.
        os.utime(folder)
    label = f"{name} [{config}]" if config else name
    print(f"dataset {label}@{revision or 'main'} split {split}: {len(dataset):,} rows -> {folder}", flush=True)


def hub_error(error: Exception, kind: str, name: str, revision: str | None, token: str | None) -> str:
    """One line that says what to do about a failed download."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    url = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{name}"
    text = cause(error)
    if isinstance(error, GatedRepoError) or "gated" in text:
        return f"{kind} {name!r} is gated: accept its terms at {url}, and put that account's HF_TOKEN in .env"
    if isinstance(error, RevisionNotFoundError) or "Revision" in text:
        return f"{kind} {name!r} has no revision {revision!r}: check --revision / --model_revision"
    if isinstance(error, RepositoryNotFoundError) or "doesn't exist on the Hub" in text:
        if not token:
            return (
                f"{kind} {name!r} is not on the Hub, or is private and no HF_TOKEN is set: check the name, or add "
                "HF_TOKEN to .env"
            )
        named, replace = offline.token_source(token)  # where the token came from: an HF_TOKEN in .env may not be it
        return (
            f"{kind} {name!r} is not on the Hub, or is private and {named} has no access to it: check the name, or "
            f"create a token at https://huggingface.co/settings/tokens with an account that may read it and {replace}"
        )
    if getattr(getattr(error, "response", None), "status_code", None) == 401 and token:
        return offline.invalid_token(token)  # where the token came from (HF_TOKEN, .env, a saved login) and its fix
    return f"could not fetch {kind} {name!r} ({text}): is the Hub reachable from here?"


if __name__ == "__main__":
    run_command(main)

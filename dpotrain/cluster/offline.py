"""Offline compute nodes: is everything a job reads already in the local Hugging Face cache?

Jobs on nodes without network run with `HF_HUB_OFFLINE=1` on the cache `scripts/prefetch.py` filled on a login node:
`check_offline_artifacts` stops a job that misses a piece in its first seconds, with the prefetch command, not minutes
later from inside transformers or datasets. Online, the Hub is asked once, within seconds: one that does not answer
refuses a download at once and turns a read of cached pieces offline.
"""

import fnmatch
import glob
import json
import os
import shlex
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from huggingface_hub import constants, get_token, try_to_load_from_cache
from huggingface_hub.utils import get_session

from dpotrain.data import builtin, hub_revision, mixture
from dpotrain.recipe import config, hub_switches, launcher, venv, writes
from dpotrain.recipe.errors import ConfigError, cause
from dpotrain.recipe.hub_switches import datasets_offline, is_offline, take_late_switches

# What a training job reads from a model repo, as prefetch selects it: configs, tokenizer, chat templates. Top-level
# files only, apart from the extra chat templates: repos keep other formats (GGUF, ONNX) in subfolders.
MODEL_FILES = (
    "*.json *.jinja additional_chat_templates/*.jinja tokenizer.model *.tiktoken merges.txt vocab.txt spiece.model"
).split()
WEIGHTS = ["model*.safetensors", "*.safetensors", "pytorch_model*.bin"]  # the first pattern a repo has wins
TOKENIZER_VOCAB = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# What from_pretrained needs of a model repo, as `missing_model_files` names the pieces.
NEEDED = ["config.json", "weights (model.safetensors or a sharded index)", "tokenizer_config.json", "a tokenizer file"]
# The fields whose values decide what the job reads; prefetch takes them as train_dpo.py does.
ARTIFACT_FIELDS = [
    *(("model", name) for name in ("model_name_or_path", "model_revision")),
    *(("script", name) for name in ("dataset_name", "dataset_config", "dataset_train_split")),
    ("project", "dataset_revision"),  # the commit, branch or tag the job trains on, not main
    *(("project", name) for name in (*mixture.TRAIN_FIELDS, *mixture.EVAL_FIELDS)),
]


def is_hub_model(name: str | None) -> bool:
    """A Hub repo id, not a `builtin:` model or a local folder."""
    if not name or builtin.is_builtin(name):
        return False
    return not (name.startswith((".", "/", "~")) or Path(name).expanduser().exists())


def hub_datasets(recipe) -> list[mixture.Source]:
    """Each Hub data set the job reads: `dataset_name`'s training split, else the mixtures' Hub sources."""
    values = mixture.fields_of(recipe)
    sources = [s for evaluation in (False, True) for s in mixture.parse(values, evaluation=evaluation) or []]
    script = recipe.script
    if not mixture.given(values):
        sources.append(mixture.Source(script.dataset_name, script.dataset_train_split, name=script.dataset_config))
    # a builder (`path: json` with data_dir or several data_files) reads local files: no Hub data set named json
    return [s for s in sources if not s.file and s.path not in mixture.BUILDERS and hub_revision.applies(s.path)]


def select_model_files(repo_files: list[str]) -> list[str]:
    """The files of a model repo that training reads: config, tokenizer, chat template and one set of weights."""
    top = [f for f in repo_files if "/" not in f]
    top_or_template = [f for f in repo_files if "/" not in f or f.startswith("additional_chat_templates/")]
    chosen = [f for f in top_or_template if any(fnmatch.fnmatch(f, p) for p in MODEL_FILES)]
    for pattern in WEIGHTS:  # one format only: a repo with both safetensors and .bin needs the safetensors
        if weights := [f for f in top if fnmatch.fnmatch(f, pattern)]:
            chosen += weights
            break
    return sorted(set(chosen))


def shards_of(index) -> list[str] | None:
    """The shard files a sharded model's index (a Path) names, sorted; None where it cannot be read as one."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def missing_model_files(repo_id: str, revision: str | None = None, weights: bool = True) -> list[str]:
    """What from_pretrained (`weights=False`: AutoTokenizer) would miss in the Hub cache for `repo_id` at `revision`."""

    def cached(filename: str) -> str | None:
        path = try_to_load_from_cache(repo_id, filename, revision=revision)
        return path if isinstance(path, str) else None

    missing = [] if cached("config.json") else [NEEDED[0]]
    index = next((p for p in map(cached, ("model.safetensors.index.json", "pytorch_model.bin.index.json")) if p), None)
    if weights and index:
        if (shards := shards_of(Path(index))) is None:
            # A damaged file is not fetched again while its blob is there: the cache keeps it under its commit's name
            missing.append(
                f"a readable {Path(index).name} (the cached copy {os.path.realpath(index)} is damaged: delete it)"
            )
        elif absent := [s for s in shards if not cached(s)]:
            missing.append(f"{len(absent)} of {len(shards)} weight shards ({absent[0]}{', ...' * (len(absent) > 1)})")
    elif weights and not (cached("model.safetensors") or cached("pytorch_model.bin")):
        missing.append(NEEDED[1])
    if not cached("tokenizer_config.json"):
        missing.append(NEEDED[2])
    if not any(map(cached, TOKENIZER_VOCAB)):
        missing.append(NEEDED[3])
    return missing


def cached_dataset(name: str, config: str | None = None, split: str = "train") -> tuple[Path | None, str | None]:
    """The folder an offline `datasets.load_dataset(name, config)` reads, or None and why it would fail: the newest
    prepared copy, `<HF_DATASETS_CACHE>/<namespace>___<snake_name>/<config>/<version>/<commit>/`, by datasets 5.2's
    rules (packaged_modules/cache/cache.py, `_find_hash_in_cache`)."""
    import datasets.config  # here: importing datasets takes seconds that --help and the refusals do not need
    from datasets.naming import camelcase_to_snakecase, filenames_for_dataset_split

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(datasets.config.HF_DATASETS_CACHE) / "___".join(parts)
    pattern = os.path.join(glob.escape(str(root)), glob.escape(config) if config else "*", "*", "*")
    found = [Path(p) for p in glob.glob(pattern) if os.path.isdir(p)]
    # datasets would stop on an interrupted download with a FileNotFoundError
    if broken := [p for p in found if not (p / "dataset_info.json").is_file()]:
        return None, f"an interrupted download left {broken[0]}: delete it"
    infos = {}
    for p in found:
        try:
            infos[p] = json.loads((p / "dataset_info.json").read_text())
        except (OSError, ValueError):  # datasets would stop on it with a traceback
            return None, f"the cached copy's {p / 'dataset_info.json'} is damaged: delete {p}"
    usable = [p for p in found if infos[p].get("config_name") == p.parts[-3]]
    if not usable:
        return None, "not cached" + (f" for config {config!r}" if config else "")
    newest = max(usable, key=lambda p: p.stat().st_mtime)
    configs = {p.parts[-3] for p in usable if p.parts[-2:] == newest.parts[-2:]}
    if config is None and len(configs) > 1:
        return None, f"several configurations cached ({', '.join(sorted(configs))}): set dataset_config"
    splits = infos[newest].get("splits") or {}
    if split not in splits:
        return None, f"the cached copy ({newest}) has no split {split!r}, only {sorted(splits)}"
    shard_lengths = splits[split].get("shard_lengths")
    files = filenames_for_dataset_split(
        str(newest), camelcase_to_snakecase(name.split("/")[-1]), split, "arrow", shard_lengths
    )
    if absent := [f for f in files if not os.path.isfile(f)]:
        return None, f"the cached copy ({newest}) lacks {Path(absent[0]).name}: delete the folder"
    return newest, None


def missing_artifacts(recipe, model: bool = True, dataset: bool = True, in_part: bool = False) -> list[str]:
    """One entry per Hub artifact of the recipe not fully cached; `in_part`: the model only where some of it is."""
    missing = []
    name, revision = recipe.model.model_name_or_path, recipe.model.model_revision
    if model and is_hub_model(name):
        absent = missing_model_files(name, revision)
        at = f" at revision {revision!r}" if revision not in (None, "main") else ""
        if absent == NEEDED:  # nothing of it at all
            if not in_part:
                missing.append(f"model {name!r}{at} is not cached")
        elif absent:
            missing.append(f"model {name!r}{at} lacks {', '.join(absent)}")
    for source in hub_datasets(recipe) if dataset else []:
        if source.data_files or source.data_dir:  # prepared under a hash of those files: datasets' own check decides
            continue
        _, why = cached_dataset(source.path, source.name, source.split)
        if why:
            missing.append(f"dataset {source.path!r}: {why}")
    return missing


def prefetch_command(recipe, output_dir: str | None = None) -> str:
    """`python scripts/prefetch.py ...` for this recipe, with the job's cache variables and overrides; `output_dir`: a
    resumed run's folder, whose record holds the commits its Hub data is fetched at."""
    args = ["python", venv.project_file("scripts/prefetch.py")]
    in_file = recipe.in_file  # as the run read it, once: numbers as written
    if recipe.config_path:
        args += ["--config", recipe.config_path]
    for part, field in ARTIFACT_FIELDS:
        value = getattr(getattr(recipe, part), field)
        default = next(f.default for f in fields(getattr(recipe, part)) if f.name == field)
        if value is not None and value != in_file.get(field, default):
            values = value if isinstance(value, list) else [value]  # a mixture's list, one word each
            args += [f"--{field}", *(v if isinstance(v, str) else json.dumps(v) for v in values)]
    # prefetch.py decides on the job's folder: one the job names, else the recipe's (a stopped run there, read without
    # it, had its commits fetched for a new job in another folder, which then refused that copy again)
    typed = "output_dir" in config.fields_set(recipe.command_line)
    # A recipe's `$SLURM_JOB_ID` in output_dir is set in the job alone: the login node is given the job's own folder
    expanded = "$" in str(in_file.get("output_dir", ""))
    folder = output_dir or (recipe.training.output_dir if typed or expanded else None)
    args += ["--output_dir", folder] if folder else []
    # A resume of a named checkpoint reads the commits its own record holds (resolve.trained_under), as prefetch.py does
    checkpoint = recipe.training.resume_from_checkpoint
    args += ["--resume_from_checkpoint", checkpoint] if folder and checkpoint else []
    # The folder's run replaced (a finished one, or other settings): without the flag prefetch.py refused it
    args += ["--overwrite_output_dir", "true"] if folder and recipe.project.overwrite_output_dir else []
    env = [
        f"{k}={shlex.quote(v)}" for k in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE") if (v := os.environ.get(k))
    ]
    return " ".join(env + [shlex.join(args)])  # the login node must fill the cache this job reads


def check_offline_artifacts(
    recipe, offline: bool | None = None, model: bool = True, output_dir=None, in_part: bool = False
) -> None:
    """Offline, refuse the job unless its Hub model and data set are cached. `offline=True`: as an offline job would
    (prefetch's proof); `model=False`: the data alone (a dry run). `in_part`: a dry run's, a model cached in part alone
    (a prefetch killed halfway, which nothing completes offline): one not cached at all it plans without."""
    model = model and (is_offline() if offline is None else offline)
    dataset = not in_part and (datasets_offline() if offline is None else offline)
    if not (model or dataset):
        return
    if missing := missing_artifacts(recipe, model=model, dataset=dataset, in_part=in_part):
        raise ConfigError(
            f"offline (HF_HUB_OFFLINE) and not in the local Hugging Face cache: {'; '.join(missing)}. "
            f"On a login node with network, run: {prefetch_command(recipe, output_dir)}"
        )


def check_hub_cache(recipe) -> None:
    """What the job downloads from the Hub (its model and data set, where not cached) goes into HF_HUB_CACHE first: one
    it cannot write in ended the run at the first download, a data set's in `NotADirectoryError`, the tokenizer's in a
    line naming its files as the fix, and the dry run said nothing. A cache holding them all is only read (a team's
    read-only cache)."""
    model, dataset = not is_offline(), not datasets_offline()  # offline, nothing is downloaded
    if not (model or dataset) or not (missing := missing_artifacts(recipe, model=model, dataset=dataset)):
        return
    folder = Path(constants.HF_HUB_CACHE)
    if problem := writes.unwritable(folder):
        raise ConfigError(
            f"the Hub cache {folder} is not writable ({problem[1]} in {problem[0]}), and the job downloads there what "
            f"it lacks ({'; '.join(missing)}): set HF_HUB_CACHE (or HF_HOME) to a writable folder"
        )


# --- a Hub that does not answer, said in seconds ----------------------------------------------------------------------

# A reachable Hub answers a HEAD request well within this; huggingface_hub's own retries of a request that cannot
# connect take 23 s to minutes per file before its first error.
PROBE_SECONDS = 3.0
# Longer than the deadline, so that `within` always speaks first; it only ends the abandoned thread's wait.
SOCKET_SECONDS = 2 * PROBE_SECONDS


class Background:
    """fn() in a daemon thread, its outcome read back by `result()` once `done` is set. Daemon: an HTTP call cannot be
    interrupted, and one that hangs must not keep the process alive."""

    def __init__(self, fn, name: str):
        self.done, self._outcome = threading.Event(), {}
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn):
        try:
            self._outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - result() raises it again in the waiting thread, whatever it is
            self._outcome["error"] = e
        finally:
            self.done.set()

    def result(self):
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def within(seconds: float, fn):
    """fn() with a deadline: huggingface_hub's HTTP client has no timeout, and a name lookup none at all, so on a node
    whose firewall drops packets a call would hang the job, GPUs allocated."""
    call = Background(fn, "dpotrain-hub-call")
    if not call.done.wait(seconds):
        raise TimeoutError(f"no answer within {seconds:g} s")
    return call.result()


def hub_unreachable() -> str | None:
    """Why HF_ENDPOINT gives no answer here within PROBE_SECONDS, or None when it answers, with any status: one HEAD
    request through huggingface_hub's own client (its proxy and certificate settings)."""
    try:
        within(PROBE_SECONDS, lambda: get_session().head(constants.ENDPOINT + "/", timeout=SOCKET_SECONDS))
    except Exception as e:  # noqa: BLE001 - any failure of the probe is its answer, named by cause()
        return f"{hub_switches.shown_endpoint()}: {cause(e)}"
    return None


def check_hub_reachable(missing: list[str], remedy: str, reads_hub: bool = False) -> None:
    """Refuse work that would download the `missing` pieces from a Hub that does not answer, naming `remedy`; nothing
    missing, cached Hub pieces are read offline if the Hub is silent."""
    if not missing and reads_hub:
        read_cache_if_silent()
    elif missing and (why := hub_answer()):
        raise ConfigError(f"{'; '.join(missing)}, and the Hugging Face Hub does not answer here ({why}): {remedy}")


@dataclass(frozen=True)
class HubAnswer:
    """The run's one answer from the Hub, once something rests on it (the launch's, for every rank): later checks take
    it, without asking."""

    why: str | None  # `hub_unreachable`'s: why HF_ENDPOINT gave no answer; None where it answered


# This run's HubAnswer; None: each check asks for itself. `start_run` empties it: an earlier run in this process
# (tests, a notebook) asked another Hub.
ANSWER: HubAnswer | None = None


def start_run() -> None:
    """A run, dry run, analysis or prefetch starts in this process: no answer from the Hub yet."""
    global ANSWER
    ANSWER = None
    hub_switches.SET_BY_RUN = False  # an earlier run's switch, turned off for its silent Hub, is not this one's


def hub_answer() -> str | None:
    """`hub_unreachable`: the run's answer where one was decided (`ANSWER`), else this process's, asked now."""
    return ANSWER.why if ANSWER else hub_unreachable()


def read_cache_if_silent() -> None:
    """Online, transformers and datasets ask the Hub of every cached file they read, and wait on one that never
    answers (a cached tokenizer: over 300 s). So the Hub is asked once, within PROBE_SECONDS, and where it does not
    answer this process and those it starts read the cache alone, as with HF_HUB_OFFLINE=1."""
    global ANSWER
    if is_offline():
        return
    if why := hub_answer():
        ANSWER = HubAnswer(why)  # offline for it: a later piece not cached is refused as on a silent Hub, unasked
        os.environ["HF_HUB_OFFLINE"] = "1"  # the processes it starts (data loader workers) read it at their import
        take_late_switches()  # this one's libraries read it at theirs
        hub_switches.turned_off_by_run()  # for reads alone: the run's pushes lift it (it passed the write check)
        if launcher.launched_main():  # every rank decides the same (`agree_on_hub`); one line says it for the launch
            print(
                f"The Hugging Face Hub does not answer here ({why}): models and data sets are read from the local "
                f"cache, offline (set HF_HUB_OFFLINE=1 to skip this wait of up to {PROBE_SECONDS:g} s)",
                file=sys.stderr,
                flush=True,
            )


def agree_on_hub(recipe) -> None:
    """Every rank, once the process group exists: the main process's answer from the Hub is every rank's `ANSWER`;
    ranks that asked for themselves could disagree, and read online what another read offline."""
    from dpotrain.cluster import collectives  # here: torch, which prefetch and the analyzer's refusals do not need

    global ANSWER
    asked, why = collectives.main_outcome(_ask_for_job, recipe)  # every rank in the collective, whatever it reads
    ANSWER = HubAnswer(why) if asked else None


def _ask_for_job(recipe) -> tuple[bool, str | None]:
    """(whether the job asks the Hub at all, and `hub_unreachable`'s answer), on the main process."""
    offline = is_offline() and datasets_offline()
    if offline or not (is_hub_model(recipe.model.model_name_or_path) or hub_datasets(recipe)):
        return False, None
    return True, hub_unreachable()


def check_job_reachable(recipe, model: bool = True, dataset: bool = True, output_dir=None) -> None:
    """A job that would download its model or data set refused at once, with the prefetch command, where the Hub does
    not answer, not after a minute of retries inside the libraries; one that reads them cached reads offline then."""
    silent = bool(ANSWER and ANSWER.why)  # offline for that reason: what is not cached is refused, with the remedy
    model, dataset = model and (silent or not is_offline()), dataset and (silent or not datasets_offline())
    reads = (model and is_hub_model(recipe.model.model_name_or_path)) or (dataset and bool(hub_datasets(recipe)))
    check_hub_reachable(
        missing_artifacts(recipe, model=model, dataset=dataset),
        f"on a machine with network, fill the cache with `{prefetch_command(recipe, output_dir)}` and run this with "
        "HF_HUB_OFFLINE=1 (or fix HF_ENDPOINT / HTTPS_PROXY)",
        reads,
    )


def hf_token() -> str | None:
    """HF_TOKEN, else the one `hf auth login` saved. A blank HF_TOKEN is none, as huggingface_hub reads it: taken as a
    login, it passed the dry run and failed the push."""
    try:
        # The saved login (or HUGGING_FACE_HUB_TOKEN) checked as HF_TOKEN is: a token file written by hand holding a
        # vertical tab went into the job's log in the HTTP client's "Illegal header value b'Bearer hf_...'", and a
        # non-ASCII letter (a zero-width space pasted with it) read as "could not reach the Hub", whose advice,
        # HF_HUB_OFFLINE=1, trained for hours and then failed the push the same way
        return usable_token(os.environ.get("HF_TOKEN", ""), "HF_TOKEN") or usable_token(get_token(), saved_login())
    except OSError as e:  # huggingface_hub allows for a missing file only (a HOME that is a file: a traceback)
        raise ConfigError(
            f"cannot read the saved Hugging Face token {constants.HF_TOKEN_PATH} ({e.strerror}): set HOME to your home "
            "folder, or HF_HOME to a folder of yours (the Hub libraries keep their login and caches there), or HF_TOKEN"
        ) from None


class InvalidToken(ConfigError):
    """The Hub's 401 for the token in use, said by `invalid_token`: every push fails the same way until the token is
    replaced. `refusal`: that line, which the run's own final push follows with the command that pushes it."""

    def __init__(self, refusal: str):
        super().__init__(refusal)
        self.refusal = refusal


def invalid_token(token: str | None) -> str:
    """The line for a token the Hub answers 401 (revoked, expired), naming where it came from and how to replace it
    there, never its value: "set HF_TOKEN in .env" was the advice whatever the source, and an HF_TOKEN the environment
    sets (an `export` in a shell profile) or a hub_token wins over .env's, so a new token there changed nothing."""
    named, replace = token_source(token)
    return f"{named} is invalid or expired: create a new one at https://huggingface.co/settings/tokens and {replace}"


def token_source(token: str | None) -> tuple[str, str]:
    """Where the token in use came from, for every line about it: the token named by its source, as the subject of a
    sentence ("the Hugging Face token in HF_TOKEN, set by /x/.env,"), and how to put another one in its place there
    ("set HF_TOKEN=... with it there"), never its value. HF_TOKEN, else the saved login (or HUGGING_FACE_HUB_TOKEN),
    else hub_token."""
    if token == _cleaned(os.environ.get("HF_TOKEN")):
        if env_file := venv.env_file_gave("HF_TOKEN"):
            return f"the Hugging Face token in HF_TOKEN, set by {env_file},", "set HF_TOKEN=... with it there"
        return (
            "the Hugging Face token in HF_TOKEN, set in the environment,",
            "export HF_TOKEN=... with it, or unset HF_TOKEN to use .env's or `hf auth login`'s (the environment's wins "
            "over both)",
        )
    try:
        saved = _cleaned(get_token())
    except OSError:  # an unreadable login file (hf_token names it): the token in use was not from there
        saved = None
    if token == saved and saved_login() == "HUGGING_FACE_HUB_TOKEN":  # the older variable: no file to log in to
        return (
            "the Hugging Face token in HUGGING_FACE_HUB_TOKEN",
            "set HF_TOKEN=... with it in .env (HF_TOKEN wins over it), or unset HUGGING_FACE_HUB_TOKEN",
        )
    if token == saved:
        return (
            f"the Hugging Face {saved_login().removeprefix('the ')}",
            "run `hf auth login` with it, or set HF_TOKEN=... in .env",
        )
    return (
        "the Hugging Face token given as hub_token (--hub_token, or the recipe's hub_token)",
        "give it there, or drop hub_token and set HF_TOKEN=... in .env",
    )


def _cleaned(token: str | None) -> str | None:
    """A token as huggingface_hub reads HF_TOKEN: line breaks and the white space around it dropped; None if empty."""
    return (token or "").replace("\r", "").replace("\n", "").strip() or None


def saved_login() -> str:
    """Where huggingface_hub's get_token finds the token when HF_TOKEN gives none: its older variable, else the file
    `hf auth login` writes."""
    if not os.environ.get("HF_TOKEN") and (os.environ.get("HUGGING_FACE_HUB_TOKEN") or "").strip():
        return "HUGGING_FACE_HUB_TOKEN"
    return f"the token saved in {constants.HF_TOKEN_PATH} (by `hf auth login`, or written there)"


def usable_token(token: str | None, named: str) -> str | None:
    """A token as the Hub's HTTP header carries it, read as huggingface_hub reads HF_TOKEN: its line breaks removed
    and the white space around it (a token file read whole keeps its newline), None where nothing is left. One still
    holding a space, a control character or a letter that is not ASCII is refused naming where it came from, never its
    value: the HTTP client's refusal quotes the header, and that line ("Illegal header value b'Bearer hf_...\\n'")
    went to the job's log."""
    token = _cleaned(token) or ""
    if any(not ("!" <= c <= "~") for c in token):
        raise ConfigError(
            f"{named} holds a space, a control character or a letter that is not ASCII inside the token (not shown): "
            "give the token alone (https://huggingface.co/settings/tokens)"
        )
    return token or None

"""Offline compute nodes and pushing afterwards: the cache check, scripts/prefetch.py, scripts/push_to_hub.py and the
write-access check.

The Hub is unreachable here, so the cache is built by writing real artifacts where the libraries look: the tiny model
in the hub cache layout, the data set through datasets' own builder under the name and commit a Hub load uses. A job
-like subprocess (HF_HOME and HF_HUB_OFFLINE set before anything imports) proves that transformers and datasets really
load them offline, and that the check agrees with the libraries on what is there and what is not.

What needs the Hub itself cannot be tested here: prefetch's downloads, push_run's upload, and the Hub's real answers to
whoami and auth-check. The scripts are run up to the last step before the network; check_write_access is run against
a local server that answers in the Hub's documented shapes.
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PYTHON, ROOT, ddp_config, in_child, python
from dpotrain.cluster import offline
from dpotrain.hub import hub
from dpotrain.recipe import venv
from dpotrain.recipe.errors import ConfigError, RunError
from hub_server import StandInHub

THINK = str(ROOT / "configs" / "think.yaml")
MODEL, DATASET = "org/tiny-olmo3", "org/Tiny-Prefs"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SECRET = "hf_SECRETdoNotLeak123"


def hub_cache_model(home: Path, repo_id: str, source: Path, skip: tuple[str, ...] = ()) -> None:
    """A model repo as huggingface_hub caches it: snapshots/<commit>/<files> and refs/main -> <commit>.

    Files are copied rather than linked to blobs/, the layout huggingface_hub itself uses where symlinks are not
    available; readers only follow the snapshot path.
    """
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        if f.name not in skip:
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def datasets_cache_dataset(home: Path, repo_id: str) -> None:
    """The bundled pairs, prepared by datasets' JSON builder as `load_dataset(repo_id)` prepares a Hub repo of JSON
    files: same cache folder (namespace, snake-cased name, config, version, commit) and same Arrow files."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    builder = Json(cache_dir=str(home / "datasets"), dataset_name=repo_id.split("/")[1], repo_id=repo_id, hash=COMMIT)
    # Set after construction: the builder refuses data files outside the Hub repo it is named for.
    builder.config.data_files = DataFilesDict.from_local_or_remote({"train": [str(ROOT / "data/smoke_prefs.jsonl")]})
    builder.download_and_prepare()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model_dir) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    hub_cache_model(home, MODEL, Path(tiny_model_dir))
    hub_cache_model(home, "org/tiny-no-weights", Path(tiny_model_dir), skip=("model.safetensors",))
    from safetensors.torch import load_file, save_file

    ddp = tmp_path_factory.mktemp("from-ddp")  # a state dict saved from a DDP-wrapped model: every name `module.`
    save_file({f"module.{k}": v for k, v in load_file(Path(tiny_model_dir, "model.safetensors")).items()}, ddp / "w")
    hub_cache_model(home, "org/tiny-from-ddp", Path(tiny_model_dir), skip=("model.safetensors",))
    shutil.copy(ddp / "w", home / "hub" / "models--org--tiny-from-ddp" / "snapshots" / COMMIT / "model.safetensors")
    datasets_cache_dataset(home, DATASET)
    return home


def job_env(home: Path, **extra) -> dict:
    """The environment of an offline job on a compute node whose cache is `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", **extra}


def run_script(script: str, args: list[str], env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python(), str(ROOT / "scripts" / script), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


def results_of(program: str, args: list[str], env: dict, fresh: bool = False) -> dict:
    """Run `program` (Python source) as a script in a process of its own; the dict it prints on its `RESULTS ` line.
    On the session's warm interpreter (`python()`: its imports paid once, ~7 CPU-s a process; the Hub libraries read
    this HF_HOME, HF_ENDPOINT and offline switches again, as a fresh one reads them at import: tests/helpers/warm.py),
    unless `fresh`: a fresh interpreter, for a claim about what the libraries read while being imported."""
    return results_together({"it": (program, args, env)}, fresh)["it"]


def results_together(programs: dict, fresh: bool = False) -> dict:
    """`results_of` for each `name: (program, args, env)` of `programs`, their processes started at once and run side
    by side: each is a process of its own as before, and where several wait out a silent Hub's probe (PROBE_SECONDS
    each, idle), the waits overlap instead of following one another. Their output goes to files, not pipes, so that
    none waits on a full pipe while another is read."""
    with tempfile.TemporaryDirectory(prefix="dpotrain-program-") as folder:
        started = {}
        try:
            for name, (source, args, env) in programs.items():
                own = Path(folder) / f"program-{len(started)}"
                own.mkdir()
                script = own / "program.py"  # a script, not `-c`: the warm client runs scripts
                script.write_text(COUNTED + source + ENDED)
                interpreter = PYTHON if fresh else python()
                with open(own / "stdout", "w") as stdout, open(own / "stderr", "w") as stderr:
                    process = subprocess.Popen(
                        [interpreter, str(script), *args], cwd=ROOT, env=env, stdout=stdout, stderr=stderr
                    )
                started[name] = (process, own)
            results = {}
            for name, (process, own) in started.items():
                process.wait(timeout=300)
                stdout, stderr = (own / "stdout").read_text(), (own / "stderr").read_text()
                line = next((x for x in stdout.splitlines() if x.startswith("RESULTS ")), None)
                assert line, f"{name}: {stdout[-2000:]}{stderr[-3000:]}"
                results[name] = json.loads(line.removeprefix("RESULTS "))
            return results
        finally:
            for process, _ in started.values():  # one that outlived its timeout, or another's failure
                process.kill()
                process.wait()


# Every program's prelude (`results_of`): each connection the process opens is counted (an audit hook sees every
# socket.connect), so that a test checks how often a command asked the Hub (none, once), not how many seconds it took,
# which the machine's load decides as much as the code. ASKED: connections to HF_ENDPOINT's port (any, where it names
# none); OPENED: the files opened (JOB).
COUNTED = r"""
import os as _os, sys as _sys
from urllib.parse import urlsplit as _urlsplit

ASKED, OPENED = [], []
_HUB_PORT = _urlsplit(_os.environ.get("HF_ENDPOINT") or "http://127.0.0.1").port

def _library_own(frame):
    # huggingface_hub's fetch of its agent registry (utils/_detect_agent.py: once a process, 3 s at most), made when
    # it first builds a request's headers, even for a local_files_only read: the library's request, not the command's
    while frame and frame.f_code.co_name != "_fetch_registry":
        frame = frame.f_back
    return frame is not None

def _count(event, args):
    if event == "socket.connect" and isinstance(args[1], tuple) and len(args[1]) >= 2:
        if (args[1][1] == _HUB_PORT or not _HUB_PORT) and not _library_own(_sys._getframe(1)):
            ASKED.append(args[1])
    elif event == "open" and isinstance(args[0], (str, bytes)):
        OPENED.append(_os.fsdecode(args[0]))

_sys.addaudithook(_count)
"""


# Every program's end, once its RESULTS line is printed: as the project's commands end (dpotrain/recipe/errors.py:
# `end_process`), its exit handlers run and the teardown of the stack it imported (1.4-2.8 CPU-s a process, freeing
# what the operating system frees at exit) is skipped. A program that raised ends the usual way, its traceback shown.
ENDED = r"""
from dpotrain.recipe.errors import end_process as _end_process

_end_process(0)
"""


# A probe's answer where the Hub is silent: `offline.within`'s, given once PROBE_SECONDS ran out.
PROBE_TIMEOUT = f"TimeoutError: no answer within {offline.PROBE_SECONDS:g} s"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the cache check, in a job-like process ----------------------------------------------------------------------

JOB = r"""
import json, sys
from dpotrain.cluster import offline
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

results = {}

def library(name, load):
    try:
        results[name] = load()
    except Exception as e:
        results[name] = "FAILED " + type(e).__name__

def check(name, *args):
    recipe = parse_args(["--config", sys.argv[1], "--dry-run", *args])
    asked, opened = len(ASKED), len(OPENED)
    try:
        offline.check_offline_artifacts(recipe)
        results[name] = "ok"
    except ConfigError as e:
        results[name] = str(e)
    results[name + "_asked"], results[name + "_opened"] = len(ASKED) - asked, OPENED[opened:]

from transformers import AutoModelForCausalLM, AutoProcessor
from dpotrain.data.data import load_preference_dataset

library("model", lambda: type(AutoModelForCausalLM.from_pretrained("org/tiny-olmo3")).__name__)
library("processor", lambda: AutoProcessor.from_pretrained("org/tiny-olmo3").eos_token)
library("dataset", lambda: len(load_preference_dataset("org/Tiny-Prefs", "train")))
library("library_without_weights", lambda: AutoModelForCausalLM.from_pretrained("org/tiny-no-weights"))
library("library_absent_dataset", lambda: load_preference_dataset("org/absent-prefs", "train"))

here = ["--model_name_or_path", "org/tiny-olmo3", "--dataset_name", "org/Tiny-Prefs"]
check("complete", *here)
check("absent_model", *here, "--model_name_or_path", "org/absent")
check("without_weights", *here, "--model_name_or_path", "org/tiny-no-weights")
check("absent_revision", *here, "--model_revision", "v2")
check("absent_dataset", *here, "--dataset_name", "org/absent-prefs")
check("absent_split", *here, "--dataset_train_split", "test")
check("recipe_as_is")
# A mixture's Hub sources, training and held-out, each as dataset_name is (its local sources are not looked at)
mix = ["--model_name_or_path", "org/tiny-olmo3", "--dataset_mixer_list", "org/Tiny-Prefs", "1.0",
       "data/smoke_prefs.jsonl", "10"]
check("mixture", *mix)
check("mixture_absent_source", *mix[:-2], "org/absent-prefs", "10")
check("mixture_absent_eval_source", *mix, "--dataset_mixer_eval_list", "org/Tiny-Prefs", "5", "org/absent-prefs", "5",
      "--dataset_mixer_eval_list_splits", "train")
results["local"] = "ok"
try:
    offline.check_offline_artifacts(parse_args(["--config", "configs/smoke.yaml"]))
except ConfigError as e:
    results["local"] = str(e)

import contextlib, importlib.util, io
spec = importlib.util.spec_from_file_location("prefetch", "scripts/prefetch.py")
prefetch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prefetch)
with contextlib.redirect_stdout(io.StringIO()) as out:
    prefetch.main(["--config", sys.argv[1], *here, "--split", "train"])
results["prefetch"] = out.getvalue()
with contextlib.redirect_stdout(io.StringIO()) as out:
    prefetch.main(["--config", sys.argv[1], *mix])
results["prefetch_mixture"] = out.getvalue()
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def offline_job(hf_home) -> dict:
    # fresh: HF_HOME and HF_HUB_OFFLINE set before anything imports, as on a compute node
    return results_of(JOB, [THINK], {**job_env(hf_home, HF_TOKEN=SECRET), "PYTHONPATH": str(ROOT)}, fresh=True)


@pytest.mark.slow
def test_the_cache_layout_is_the_one_the_libraries_read_offline(offline_job):
    assert offline_job["model"] == "Olmo3ForCausalLM"
    assert offline_job["processor"] == "<|im_end|>"  # the tokenizer with its config, not a bare one
    assert offline_job["dataset"] == 384
    assert SECRET not in json.dumps(offline_job)


@pytest.mark.slow
def test_check_passes_when_everything_is_cached_and_is_fast(offline_job):
    assert offline_job["complete"] == "ok"
    # fast by what it does: it reads the caches' small files (refs, configs, dataset_info.json), never a weight or data
    # file, and asks the network nothing
    opened = offline_job["complete_opened"]
    assert opened and not [f for f in opened if f.endswith((".safetensors", ".bin", ".arrow"))], opened
    assert offline_job["complete_asked"] == 0


@pytest.mark.slow
def test_check_skips_builtin_models_and_local_data(offline_job):
    assert offline_job["local"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, library_case, names",
    [
        ("absent_model", None, ["model 'org/absent' is not cached", "--model_name_or_path org/absent"]),
        (
            "without_weights",
            "library_without_weights",
            ["'org/tiny-no-weights' lacks weights (model.safetensors", "--model_name_or_path org/tiny-no-weights"],
        ),
        ("absent_revision", None, ["model 'org/tiny-olmo3' at revision 'v2' is not cached", "--model_revision v2"]),
        (
            "absent_dataset",
            "library_absent_dataset",
            ["dataset 'org/absent-prefs': not cached", "--dataset_name org/absent"],
        ),
        ("absent_split", None, ["has no split 'test', only ['train']", "--dataset_train_split test"]),
    ],
)
def test_a_missing_piece_is_refused_with_the_prefetch_command(offline_job, hf_home, case, library_case, names):
    message = offline_job[case]
    assert message.startswith("offline (HF_HUB_OFFLINE) and not in the local Hugging Face cache: ")
    assert f"run: HF_HOME={hf_home} python scripts/prefetch.py --config {THINK} " in message
    for name in names:
        assert name in message
    assert "\n" not in message
    if library_case:  # the library agrees: it fails on the same cache
        assert offline_job[library_case].startswith("FAILED")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, names",
    [
        ("mixture_absent_source", ["--dataset_mixer_list org/Tiny-Prefs 1.0 org/absent-prefs 10"]),
        (
            "mixture_absent_eval_source",
            ["--dataset_mixer_eval_list org/Tiny-Prefs 5 org/absent-prefs 5 --dataset_mixer_eval_list_splits train"],
        ),
    ],
)
def test_a_missing_source_of_a_mixture_is_named_with_the_prefetch_command(offline_job, hf_home, case, names):
    assert offline_job["mixture"] == "ok"  # its cached Hub source found, its local file not looked at
    message = offline_job[case]
    assert message.startswith(
        "offline (HF_HUB_OFFLINE) and not in the local Hugging Face cache: dataset "
        "'org/absent-prefs': not cached. On a login node"
    )
    assert f"run: HF_HOME={hf_home} python scripts/prefetch.py --config {THINK} " in message and "\n" not in message
    for name in names:
        assert name in message
    assert "Tiny-Prefs'" not in message  # the cached source is not named


@pytest.mark.slow
def test_the_shipped_recipe_names_its_hub_artifacts_and_no_overrides(offline_job, hf_home):
    message = offline_job["recipe_as_is"]
    assert "model 'geodesic-research/sfm-sft_dolci_think_unfiltered' is not cached" in message
    assert "dataset 'allenai/Dolci-Think-DPO-7B': not cached" in message
    assert message.endswith(f"run: HF_HOME={hf_home} python scripts/prefetch.py --config {THINK}")


def test_online_jobs_are_not_checked(monkeypatch):
    from huggingface_hub import constants

    from dpotrain.recipe.config import parse_args

    recipe = parse_args(
        ["--config", THINK, "--dry-run", "--model_name_or_path", "org/never", "--dataset_name", "o/never"]
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    offline.check_offline_artifacts(recipe)  # nothing cached, nothing refused
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # datasets' own switch alone: only the data set is looked at
    with pytest.raises(ConfigError, match="cache: dataset 'o/never': not cached. On a login node") as info:
        offline.check_offline_artifacts(recipe)
    assert "org/never'" not in str(info.value)


def test_a_dry_run_of_a_mixture_with_a_hub_source_it_cannot_read_names_the_prefetch(monkeypatch, capsys, tmp_path):
    """A dry run reads a mixture's sources: offline with a Hub source not cached, it ended on datasets' "Couldn't
    reach 'o/never' on the Hub (OfflineModeIsEnabled)", where the run refuses naming the prefetch command (and
    online with a Hub that does not answer, it waited on the libraries' retries); now the run's checks come first."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mix = ["--dataset_mixer_list", "o/never", "1.0", str(ROOT / "data" / "smoke_prefs.jsonl"), "10"]
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), *mix, "--output_dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, "--dry-run"]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and line.startswith(
        "error: offline (HF_HUB_OFFLINE) and not in the local Hugging Face cache: dataset 'o/never': not cached. "
        "On a login node with network, run: "
    ), line
    assert "scripts/prefetch.py" in line and "--dataset_mixer_list o/never 1.0" in line


def test_the_prefetch_command_fetches_the_data_sets_revision_the_job_trains(monkeypatch):
    """A job given --dataset_revision is told to prefetch that revision: the command named the data set alone, so
    prefetch filled the cache with main and the job, offline, still lacked the pairs it trains on."""
    from huggingface_hub import constants

    from dpotrain.recipe.config import parse_args

    for name in ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE"):  # the command names the caches it fills
        monkeypatch.delenv(name, raising=False)
    model = str(ROOT / "configs" / "models" / "olmo3-7b")  # a folder: only the data set is fetched
    here = ["--model_name_or_path", model, "--dataset_name", "o/prefs", "--dataset_revision", "v1.2"]
    command = offline.prefetch_command(parse_args(["--config", THINK, *here, "--dry-run"]))
    assert command == f"python scripts/prefetch.py --config {THINK} {' '.join(here)}"
    # prefetch fetches that revision, as the job trains on it (online here up to the download, which is stood in for)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    prefetch = load_script("prefetch")
    monkeypatch.setattr(prefetch.offline, "check_hub_reachable", lambda *args: None)
    fetched = []
    monkeypatch.setattr(prefetch, "fetch_dataset", lambda source, revision, token: fetched.append(revision))
    monkeypatch.setattr(prefetch.offline, "check_offline_artifacts", lambda *args, **kwargs: None)
    prefetch.main(command.split()[2:])
    assert fetched == ["v1.2"]


def test_prefetch_selects_one_weight_format_and_no_subfolders():
    files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "additional_chat_templates/tool_use.jinja",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "original/consolidated.safetensors",
        "onnx/config.json",
        "README.md",
        ".gitattributes",
    ]
    assert offline.select_model_files(files) == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "additional_chat_templates/tool_use.jinja",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )
    assert "pytorch_model.bin" in offline.select_model_files(["config.json", "pytorch_model.bin"])


# --- scripts/prefetch.py -----------------------------------------------------------------------------------------


def test_prefetch_has_nothing_to_fetch_for_local_recipes(capsys):
    load_script("prefetch").main(["--config", str(ROOT / "configs" / "smoke.yaml")])
    assert "Nothing to fetch: builtin:tiny-olmo3 and data/smoke_prefs.jsonl are local." in capsys.readouterr().out
    # a mixture's `path: json` reading a data_dir (or several data_files) is local files, not a Hub data set 'json'
    # (prefetch asked the Hub for it, refused where the Hub does not answer)
    builder = json.dumps({"path": "json", "data_dir": str(ROOT / "data")})
    load_script("prefetch").main(["--config", str(ROOT / "configs" / "smoke.yaml"), "--datasets", builder])
    assert "Nothing to fetch: builtin:tiny-olmo3 and the mixture are local." in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "no recipe and no model: pass --config "),
        (["--model_name_or_path", "builtin:tiny-olmo3"], "no dataset: set dataset_name"),
        (["--config", str(ROOT / "configs" / "smoke.yaml"), "--dataset_name", "nonexist.jsonl"], "does not exist"),
        (["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", "./my-modl"], "model folder"),
        (["--config", str(ROOT / "configs" / "smoke.yaml"), "--dataset_revision", "v2"], "names a commit of a Hub"),
        # The fields passed on are train_dpo.py's: its --help lists them, prefetch.py's names a few ("see --help").
        (["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_revison", "v2"], "see train_dpo.py --help$"),
    ],
)
def test_prefetch_refuses_what_the_job_would_refuse_instead_of_nothing_to_fetch(args, says, capsys):
    """Without --config (forgotten), prefetch said "Nothing to fetch: None and the mixture are local." and exited 0,
    and a mistyped local data set was "local" too: the user went on to a job that refused both. Refused here with
    training's own line."""
    with pytest.raises(ConfigError, match=says):
        load_script("prefetch").main(args)
    assert "Nothing to fetch" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "script, args",
    [
        ("analyze_dataset", ["--batch-size", "0"]),
        ("prefetch", ["--config", str(ROOT / "configs" / "smoke.yaml")]),
        ("preflight", ["--plot", "gaps.jpg"]),
        ("push_to_hub", ["/nonexistent/run"]),
        ("train_dpo", ["--config", str(ROOT / "configs" / "smoke.yaml"), "--max_steps", "0"]),
    ],
)
def test_hf_hub_offline_in_dotenv_turns_the_hub_libraries_off(script, args, monkeypatch, tmp_path):
    """docs/hub.md: HF_HUB_OFFLINE=1 in .env. huggingface_hub (which transformers asks) and datasets read it when
    imported, before a script (or train_dpo.py) read its .env: they downloaded all the same, and on a node without
    network the analyzer retried every tokenizer file for minutes (a cached tokenizer at a revision: past 2 minutes,
    against 8 s)."""
    from unittest import mock

    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the environment the libraries were imported in
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    if script == "train_dpo":
        import train_dpo as module
    else:
        with mock.patch.dict(os.environ):  # the analyzer hides GPUs on import
            module = load_script(script)
    (tmp_path / ".env").write_text("HF_HUB_OFFLINE=1\n")  # the project's .env, read where main() reads it
    read = venv.load_env
    monkeypatch.setattr(venv, "load_env", lambda root: read(tmp_path))
    seen = []  # train_dpo: as its run reads the recipe, after the .env
    if script == "train_dpo":
        parse = module.parse_args
        offline_now = lambda: constants.is_offline_mode() and datasets.config.HF_HUB_OFFLINE
        monkeypatch.setattr(module, "parse_args", lambda argv: seen.append(offline_now()) or parse(argv))
    with contextlib.suppress(ConfigError):
        module.main(args)
    if script == "train_dpo":  # imported, its run hands the switches back as they were (a notebook's next run)
        assert seen == [True] and not constants.is_offline_mode() and not datasets.config.HF_HUB_OFFLINE
    else:
        assert constants.is_offline_mode() and datasets.config.HF_HUB_OFFLINE


def test_prefetch_fetches_dataset_revision_for_dataset_name_alone(monkeypatch, capsys):
    """dataset_revision is dataset_name's commit: training reads the held-out mixture's sources at main. prefetch.py
    fetched them at dataset_name's commit too: a commit of another repo ('has no revision'), or another copy than the
    job reads."""
    script = load_script("prefetch")
    fetched = []
    monkeypatch.setattr(
        script, "fetch_dataset", lambda source, revision, token: fetched.append((source.path, revision))
    )
    monkeypatch.setattr(offline, "is_offline", lambda: False)  # downloads, where the Hub answers
    monkeypatch.setattr(offline, "check_hub_reachable", lambda *args: None)
    monkeypatch.setattr(offline, "check_offline_artifacts", lambda *args, **kwargs: None)
    commit = "a" * 40
    args = ["--dataset_name", "org/train", "--dataset_revision", commit, "--dataset_mixer_eval_list", "org/held", "10"]
    script.main(["--config", str(ROOT / "configs" / "smoke.yaml"), *args])
    assert sorted(fetched) == [("org/held", None), ("org/train", commit)]
    assert capsys.readouterr().out.endswith("finds everything it reads from the Hub.\n")


@pytest.mark.slow
def test_prefetch_offline_confirms_a_complete_cache(offline_job):
    assert (
        offline_job["prefetch"] == "Everything is cached already (HF_HUB_OFFLINE is set, so nothing was downloaded).\n"
    )


@pytest.mark.slow
def test_prefetch_offline_confirms_a_mixture_whose_hub_sources_are_cached(offline_job):
    assert offline_job["prefetch_mixture"] == (
        "Everything is cached already (HF_HUB_OFFLINE is set, so nothing was downloaded).\n"
    )


@pytest.mark.slow
def test_prefetch_offline_names_each_missing_hub_source_of_a_mixture(tmp_path):
    mix = ["--dataset_mixer_list", "org/set-a", "0.5", "data/smoke_prefs.jsonl", "10", "org/set-b", "100"]
    result = run_script("prefetch.py", ["--config", THINK, *mix], job_env(tmp_path / "empty"))
    assert result.returncode == 2
    assert result.stdout.strip().splitlines()[-1] == (
        "error: HF_HUB_OFFLINE is set, so nothing can download, and the cache lacks: model "
        "'geodesic-research/sfm-sft_dolci_think_unfiltered' is not cached; dataset 'org/set-a': not cached; dataset "
        "'org/set-b': not cached. Run this where the Hub is reachable, without HF_HUB_OFFLINE"
    )


@pytest.mark.slow
def test_prefetch_offline_with_an_empty_cache_says_so_in_one_line(tmp_path):
    result = run_script("prefetch.py", ["--config", THINK], job_env(tmp_path / "empty"))
    assert result.returncode == 2
    assert result.stdout.strip().splitlines()[-1] == (
        "error: HF_HUB_OFFLINE is set, so nothing can download, and the cache lacks: model "
        "'geodesic-research/sfm-sft_dolci_think_unfiltered' is not cached; dataset 'allenai/Dolci-Think-DPO-7B': "
        "not cached. Run this where the Hub is reachable, without HF_HUB_OFFLINE"
    )
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize(
    "error, says",
    [
        (
            "Dataset 'o/d' is a gated dataset on the Hub. You must be authenticated to access it.",
            "is gated: accept its terms at https://huggingface.co/datasets/o/d",
        ),
        ("Dataset 'o/d' doesn't exist on the Hub or cannot be accessed.", "is not on the Hub, or is private and no"),
        ("Revision 'v9' doesn't exist for dataset 'o/d' on the Hub.", "has no revision 'v9'"),
    ],
)
def test_prefetch_turns_download_errors_into_what_to_do(error, says):
    from datasets.exceptions import DatasetNotFoundError

    message = load_script("prefetch").hub_error(DatasetNotFoundError(error), "dataset", "o/d", "v9", None)
    assert says in message and "\n" not in message


# --- scripts/push_to_hub.py --------------------------------------------------------------------------------------


@pytest.fixture
def finished_run(tmp_path, tiny_model_dir) -> Path:
    """A run folder with every file a finished run has (the model is the tiny one; the card and plot are stand-ins)."""
    run = tmp_path / "outputs" / "think-dpo"
    shutil.copytree(tiny_model_dir, run)
    (run / "README.md").write_text("# think-dpo\n")
    (run / "training_curves.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (run / "run_complete.json").write_text('{"global_step": 1}\n')
    (run / "resolved_config.json").write_text(json.dumps({"hub_model_id": "org/from-config", "run_name": "x"}))
    (run / "checkpoint-1").mkdir()
    return run


def test_push_refuses_a_folder_that_is_not_a_finished_run(tmp_path):
    run = tmp_path / "outputs" / "half"
    (run / "checkpoint-100").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "resolved_config.json").write_text("{}")  # written at a run's start: a stopped run has it
    with pytest.raises(ConfigError) as info:
        load_script("push_to_hub").main([str(run)])
    assert str(info.value) == (
        f"{run} has not finished training (no run_complete.json) and has no complete checkpoint (checkpoint-100: a "
        "save cut short), so nothing of it can be pushed: resume it with the same command, then push it"
    )


@pytest.mark.parametrize("checkpoints", [[], ["--checkpoints"]])
def test_push_says_a_run_stopped_before_its_first_checkpoint_has_saved_none(tmp_path, checkpoints):
    """A run stopped before its first save (killed, a time limit) was "not a finished run: missing run_complete.json
    (...), config.json, tokenizer_config.json, model.safetensors, ...": a list of the model's files as if lost, and
    with --checkpoints the same, where the run has saved nothing yet to push."""
    run = tmp_path / "outputs" / "early"
    run.mkdir(parents=True)
    (run / "resolved_config.json").write_text("{}")  # written at a run's start
    with pytest.raises(ConfigError) as info:
        load_script("push_to_hub").main([str(run), *checkpoints])
    assert str(info.value) == (
        f"{run} has not finished training (no run_complete.json) and has saved no checkpoint yet, so nothing of it "
        "can be pushed: resume it with the same command, then push it"
    )


def test_push_names_a_finished_run_with_files_missing_as_what_it_is(finished_run):
    """A finished run (run_complete.json) whose card or weights are missing, a copy to a login node stopped midway: it
    was "not a finished run: missing README.md", naming no fix, of a run that had finished."""
    (finished_run / "README.md").unlink()
    (finished_run / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as info:
        load_script("push_to_hub").main([str(finished_run)])
    assert str(info.value) == (
        f"{finished_run} holds a finished run with files missing: tokenizer.json, README.md: copy them again from the "
        "folder the run wrote (a copy of it stopped midway, or files deleted since); nothing was pushed"
    )


def test_push_names_a_checkpoint_folder_or_a_folder_no_run_wrote_as_what_it_is(finished_run, tmp_path):
    """`push_to_hub.py outputs/think-dpo/checkpoint-1`, or a folder of one's own: each was "not a finished run: missing
    run_complete.json (training has not finished: resume it with the same command)", of a run that had finished."""
    with pytest.raises(ConfigError, match=rf"checkpoint-1 is a checkpoint of the run in {finished_run}: push that"):
        load_script("push_to_hub").main([str(finished_run / "checkpoint-1")])
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match="mine is not a run's output folder .no resolved_config.json.: pass the"):
        load_script("push_to_hub").main([str(tmp_path / "mine")])


@pytest.mark.parametrize("missing", ["run_complete.json", "model.safetensors", "README.md", "training_curves.png"])
def test_each_piece_of_a_finished_run_is_required(finished_run, missing):
    assert hub.run_folder_problems(finished_run) == []
    (finished_run / missing).unlink()
    assert [p.split(" ")[0] for p in hub.run_folder_problems(finished_run)] == [missing]


def test_a_sharded_model_needs_every_shard(finished_run):
    (finished_run / "model.safetensors").rename(finished_run / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (finished_run / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert hub.run_folder_problems(finished_run) == ["model-00002-of-00002.safetensors"]


def test_an_unreadable_index_is_named_not_a_traceback(finished_run):
    """push_to_hub.py of a run whose index was cut short (a full disk): json's JSONDecodeError, a traceback."""
    (finished_run / "model.safetensors").rename(finished_run / "model-00001-of-00001.safetensors")
    (finished_run / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    assert hub.run_folder_problems(finished_run) == ["model.safetensors.index.json (unreadable)"]


@pytest.mark.slow
def test_push_refuses_without_a_token(tmp_path, finished_run):
    # The command line as a user without a login runs it: no HF_TOKEN, an empty HF_HOME (no cached login).
    env = {**os.environ, "HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    result = run_script("push_to_hub.py", [str(finished_run)], env, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout.strip() == ("error: no Hugging Face token: add HF_TOKEN=... to .env, or run `hf auth login`")


@pytest.mark.parametrize(
    "args, repo",
    [
        ([], "org/from-config"),
        (["--repo-id", "me/other"], "me/other"),
        (["--private"], "org/from-config"),
        # training's spelling, with its value: was "unrecognized arguments: true" (the flag took none)
        (["--hub_private_repo", "true"], "org/from-config"),
        (["--private", "false"], "org/from-config"),
    ],
)
def test_push_goes_to_the_runs_hub_model_id_unless_told(monkeypatch, capsys, finished_run, args, repo):
    """Up to the last step before the network: offline, the push is refused naming the repo it would go to."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as info:
        load_script("push_to_hub").main([str(finished_run), *args])
    again = shlex.join(["python", "scripts/push_to_hub.py", str(finished_run), *args])
    assert str(info.value) == (
        f"HF_HUB_OFFLINE is set (in the environment), so {finished_run} cannot be pushed to {repo} from here: where "
        f"the Hub is reachable, run `HF_HUB_OFFLINE=0 {again}`"
    )
    assert SECRET not in str(info.value) + capsys.readouterr().out


def test_push_without_hub_model_id_asks_for_repo_id(monkeypatch, finished_run):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    (finished_run / "resolved_config.json").write_text(json.dumps({"hub_model_id": None}))
    with pytest.raises(ConfigError, match=r"no repo to push to: pass --repo-id org/name \(.*has no hub_model_id\)"):
        load_script("push_to_hub").main([str(finished_run)])


def test_push_refuses_a_repo_name_the_hub_refuses_before_asking_it(monkeypatch, finished_run):
    """It was sent to the write-access check, which said 'This machine cannot reach the Hub' for a name the Hub
    client refused."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with pytest.raises(ConfigError) as info:
        load_script("push_to_hub").main([str(finished_run), "--repo-id", "org/name@step-2"])
    assert str(info.value).startswith("--repo-id 'org/name@step-2' is not a Hugging Face repo name (")
    assert str(info.value).endswith(": pass --repo-id org/name")
    saved = finished_run / "resolved_config.json"
    saved.write_text(json.dumps({"hub_model_id": "my run"}))
    with pytest.raises(ConfigError, match=f"^hub_model_id of {re.escape(str(saved))} 'my run' is not a Hugging Face"):
        load_script("push_to_hub").main([str(finished_run)])


# --- check_write_access --------------------------------------------------------------------------------------------


def test_write_access_check_is_skipped_offline(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.check_write_access("org/name", SECRET)  # no network call, no refusal
    out = capsys.readouterr().out
    assert out.startswith("Skipped checking write access to org/name: HF_HUB_OFFLINE is set, so nothing is pushed")
    assert "python scripts/push_to_hub.py" in out and SECRET not in out


@pytest.fixture
def local_hub(monkeypatch):
    """huggingface_hub pointed at the recording stand-in, online: its real HTTP client, errors and parsing at work."""
    from huggingface_hub import constants

    hub_server = StandInHub()
    monkeypatch.setattr(constants, "ENDPOINT", hub_server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for repo in ("lab/mine", "lab/theirs", "lab/hidden", "me/read-only"):
        hub_server.state.add_repo(repo)
    # Existing repos this token may not write to: refused (403), or answered as if absent (404).
    hub_server.state.auth_status.update({"lab/theirs": 403, "lab/hidden": 404, "me/read-only": 403})
    yield hub_server.state
    hub_server.close()


def test_a_push_the_hub_fails_ends_push_to_hub_py_in_one_line(local_hub, monkeypatch, capsys, finished_run):
    """The Hub failing the upload past the retries (an outage, a network gone): push_to_hub.py ended in
    huggingface_hub's traceback, where a job's own final push says it in one line with the way on."""
    from dpotrain.hub.hub_push import read_pushes
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")
    local_hub.fail[("create_repo", None)] = -1  # no retry of huggingface_hub's own there: only this project's
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: load_script("push_to_hub").main([str(finished_run), "--repo-id", "lab/mine"]))
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith(f"error: pushing {finished_run} to lab/mine failed (HfHubHTTPError: ")
    assert err.splitlines()[-1].endswith(": run the same command again (what the Hub holds already is skipped)")
    assert [r["status"] for r in read_pushes(finished_run)] == ["started", "failed"]


def test_a_push_the_hub_refuses_names_the_hubs_reason(local_hub, monkeypatch, capsys, finished_run):
    """The Hub refusing the final commit (a 400: "Your push was rejected because it contains binary files", a quota):
    huggingface_hub puts the Hub's words on the line after "Bad request for commit endpoint:", and every line the
    project writes of an error keeps its first line alone (`cause`), so the push failed "(BadRequestError: Bad request
    for commit endpoint): run the same command again", which failed the same way with no word of why. The Hub's reason
    is on the line, and in the record of the push."""
    from dpotrain.hub.hub_push import read_pushes
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")
    local_hub.fail[("commit", "main")] = 1
    local_hub.fail_status, local_hub.fail_error = 400, "Your push was rejected because it contains binary files."
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: load_script("push_to_hub").main([str(finished_run), "--repo-id", "lab/mine"]))
    why = "BadRequestError: Bad request for commit endpoint: Your push was rejected because it contains binary files."
    assert ended.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: pushing {finished_run} to lab/mine failed ({why}): run the same command again (what the Hub holds "
        "already is skipped)"
    )
    assert read_pushes(finished_run)[-1]["error"] == why


def test_a_final_model_cut_short_since_the_run_is_refused_before_anything_uploads(local_hub, monkeypatch, finished_run):
    """A run folder whose model.safetensors was cut short after the run (an rsync or a copy to a login node stopped
    midway): push_to_hub.py pushed it to main, exit 0, 'Pushed to ...', replacing a good model with one no
    from_pretrained loads. Now refused in one line naming the file, before any upload."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")
    weights = finished_run / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ConfigError) as info:
        load_script("push_to_hub").main([str(finished_run), "--repo-id", "lab/mine"])
    assert str(info.value).startswith(
        f"{weights} is cut short: it has {size // 2:,} bytes, and its header says {size:,}"
    )
    assert str(info.value).endswith("nothing was pushed")
    assert not local_hub.commits


def test_a_card_pushed_to_another_repo_lists_that_repos_revisions_not_the_runs(local_hub, monkeypatch, finished_run):
    """A run that pushed its checkpoints to branches of org/from-config, pushed later with `--repo-id lab/mine`: the
    card uploaded to lab/mine said its checkpoints "are branches of this repo", naming org/from-config's, which lab/mine
    does not hold. Its revisions section is made for the repo pushed to (those hub_pushes.jsonl records there)."""
    from dpotrain.hub.hub_push import record_push

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("DPOTRAIN_HUB_RETRY_WAITS", "0")
    record_push(finished_run, step=1, branch="step-1", status="pushed", repo="org/from-config")
    card = finished_run / "README.md"
    card.write_text(card.read_text() + hub.revisions_section([(1, "step-1")], "org/from-config"))
    load_script("push_to_hub").main([str(finished_run), "--repo-id", "lab/mine"])
    [commit] = local_hub.commits
    assert commit["files"]["README.md"].decode() == "# think-dpo\n"
    load_script("push_to_hub").main([str(finished_run)])  # to the run's repo: its branches listed again
    assert local_hub.commits[-1]["repo"] == "org/from-config"
    assert "[`step-1`]" in local_hub.commits[-1]["files"]["README.md"].decode()


def test_write_access_against_the_hubs_answers(local_hub):
    assert hub.check_write_access("lab/mine", SECRET) == "lab/mine"  # exists, writable
    assert hub.check_write_access("lab/new", SECRET) == "lab/new"  # does not exist yet: created by the push
    assert hub.check_write_access("new-run", SECRET) == "me/new-run"  # the token user's namespace, spelled out
    for repo in ("lab/theirs", "lab/hidden"):
        with pytest.raises(ConfigError, match=f"^'me' cannot write to the existing repo {repo}: ask its owners"):
            hub.check_write_access(repo, SECRET)
    # Not found by the write check: whether the repo exists tells a refusal from a new repo.
    assert [r["kind"] for r in local_hub.project_requests()][-3:] == ["whoami", "auth_check", "model_info"]
    with pytest.raises(ConfigError, match="^the Hugging Face token 'cluster' has no write access to me/read-only: "):
        hub.check_write_access("read-only", SECRET)  # the user's own repo: the token lacks write access
    local_hub.whoami_status = 401
    with pytest.raises(ConfigError, match="^the Hugging Face token given as hub_token .* is invalid or expired"):
        hub.check_write_access("lab/mine", SECRET)


def test_a_token_the_hub_calls_invalid_is_named_by_its_source_with_the_fix_that_replaces_it(
    local_hub, tmp_path, monkeypatch
):
    """The Hub's 401 (a token revoked or expired) said "set HF_TOKEN in .env" wherever the token came from: an HF_TOKEN
    exported in a shell profile, or a --hub_token, wins over .env's, so a new token there changed nothing and the
    next job was refused the same way. The line names where the token in use came from and how to replace it there."""
    from huggingface_hub import constants

    local_hub.whoami_status = 401
    saved = tmp_path / "token"
    saved.write_text("hf_savedLOGIN\n")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    new = "create a new one at https://huggingface.co/settings/tokens"
    said = {}
    for source, token in [("hub_token", "hf_GIVEN"), ("environment", SECRET), ("dotenv", SECRET), ("login", None)]:
        monkeypatch.setenv("HF_TOKEN", SECRET)
        if source != "environment":  # .env's is taken where the environment sets none
            monkeypatch.delenv("HF_TOKEN")
        project = tmp_path / source
        project.mkdir()
        (project / ".env").write_text(f"HF_TOKEN={SECRET}\n" if source == "dotenv" else "")
        monkeypatch.setattr(venv, "ROOT", project)
        venv.load_env(project)
        with pytest.raises(ConfigError) as refused:
            hub.check_write_access("lab/mine", token or offline.hf_token())
        said[source] = str(refused.value)
    assert said == {
        "hub_token": "the Hugging Face token given as hub_token (--hub_token, or the recipe's hub_token) is invalid or "
        f"expired: {new} and give it there, or drop hub_token and set HF_TOKEN=... in .env",
        "environment": "the Hugging Face token in HF_TOKEN, set in the environment, is invalid or expired: "
        f"{new} and export HF_TOKEN=... with it, or unset HF_TOKEN to use .env's or `hf auth login`'s (the "
        "environment's wins over both)",
        "dotenv": f"the Hugging Face token in HF_TOKEN, set by {tmp_path}/dotenv/.env, is invalid or expired: {new} "
        "and set HF_TOKEN=... with it there",
        "login": f"the Hugging Face token saved in {saved} (by `hf auth login`, or written there) is invalid or "
        f"expired: {new} and run `hf auth login` with it, or set HF_TOKEN=... in .env",
    }


def test_prefetch_names_where_a_token_the_hub_calls_invalid_came_from(local_hub, tmp_path, monkeypatch):
    """prefetch.py's 401 said "the HF_TOKEN in use is invalid or expired" of a token `hf auth login` saved, with no
    HF_TOKEN set: a new HF_TOKEN would have fixed it, yet it sent the user looking for a variable they never set. Its
    line is the run's own (`offline.invalid_token`), naming the token's source and its fix there."""
    from huggingface_hub import constants

    saved = tmp_path / "token"
    saved.write_text("hf_savedLOGIN\n")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    local_hub.add_model_commit("org/base", {"config.json": b"{}"})
    # The Hub's answer to a revoked token, which huggingface_hub raises as a 401, not as a repo not found
    local_hub.fail[("tree", "main")] = -1
    local_hub.fail_status, local_hub.fail_error = 401, "Invalid credentials in Authorization header"
    with pytest.raises(ConfigError) as refused:
        load_script("prefetch").fetch_model("org/base", None, offline.hf_token())
    assert str(refused.value) == offline.invalid_token("hf_savedLOGIN")
    assert str(refused.value).startswith(f"the Hugging Face token saved in {saved} (by `hf auth login`"), refused.value


def test_prefetch_names_where_a_token_without_access_to_a_repo_came_from(local_hub, tmp_path, monkeypatch):
    """prefetch.py's answer to a repo it cannot see (absent, or private to another account) said "the HF_TOKEN in use
    has no access to it ... add HF_TOKEN to .env" of a token `hf auth login` saved, with no HF_TOKEN set. It names the
    token's source and how to put another token there, in `offline.invalid_token`'s words (`offline.token_source`)."""
    from huggingface_hub import constants

    saved = tmp_path / "token"
    saved.write_text("hf_savedLOGIN\n")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(ConfigError) as refused:
        load_script("prefetch").fetch_model("org/secret", None, offline.hf_token())
    named = f"the Hugging Face token saved in {saved} (by `hf auth login`"
    assert str(refused.value).startswith(f"model 'org/secret' is not on the Hub, or is private and {named}"), refused
    assert str(refused.value).endswith(
        "has no access to it: check the name, or create a token at https://huggingface.co/settings/tokens with an "
        "account that may read it and run `hf auth login` with it, or set HF_TOKEN=... in .env"
    ), refused.value


def test_a_push_to_the_repo_the_run_trains_from_is_refused_before_anything_runs(local_hub, finished_run, monkeypatch):
    """`--hub_model_id` naming the Hub repo the run trains from (as `model_name_or_path` spells it, in any case, or as a
    bare name the token's namespace completes to it) pushed the DPO model over the base on main, exit 0: runs started
    from the base later started from this one's model. Refused at the run's start, and by push_to_hub.py."""
    from dpotrain.recipe.config import parse_args

    argv = ["--config", "configs/smoke.yaml", "--push_to_hub", "true", "--model_name_or_path", "me/base-sft"]
    with pytest.raises(ConfigError, match="^hub_model_id 'Me/Base-SFT' is the model this run trains from"):
        hub.take_push_settings(parse_args([*argv, "--hub_model_id", "Me/Base-SFT"]))
    push = hub.take_push_settings(parse_args([*argv, "--hub_model_id", "base-sft"]))  # its namespace: the Hub's
    with pytest.raises(ConfigError, match="^hub_model_id 'me/base-sft' is the model this run trains from"):
        hub.check_write_access(push.repo_id, SECRET, base=push.base)
    assert hub.check_write_access("lab/mine", SECRET, base=push.base) == "lab/mine"  # another repo: pushed to
    monkeypatch.setenv("HF_TOKEN", SECRET)
    (finished_run / "resolved_config.json").write_text(
        json.dumps({"hub_model_id": "lab/mine", "model_name_or_path": "lab/mine"})
    )
    with pytest.raises(ConfigError, match="^hub_model_id 'lab/mine' is the model this run trains from.*--repo-id"):
        load_script("push_to_hub").main([str(finished_run)])
    assert not local_hub.commits


def test_a_new_repo_is_created_at_start_or_refused_there(local_hub):
    """The write check cannot tell whether a token may create a repo that does not exist yet: the run creates it at
    start, with the recipe's privacy, and the Hub's refusal (a read token, another's namespace) stops the run there,
    not at the push after training."""
    local_hub.create_status["other"] = 403
    assert hub.check_write_access("other/new", SECRET) == "other/new"  # no such repo: the check lets it through
    with pytest.raises(
        ConfigError,
        match="^the Hub refuses to create other/new with this Hugging Face token .*"
        "a --hub_model_id in a namespace it can write to",
    ):
        hub.create_at_start("other/new", SECRET, private=True)
    assert "other/new" not in local_hub.repos
    hub.create_at_start("lab/new", SECRET, private=True)
    assert "lab/new" in local_hub.repos
    hub.create_at_start("lab/mine", SECRET, private=False)  # exists: left as it is (the Hub's 409, exist_ok)
    assert [r["kind"] for r in local_hub.project_requests()][-1] == "create_repo"


def test_a_connection_dropped_as_the_repo_is_created_at_start_is_one_line_not_a_traceback(local_hub):
    """The write check passed, then the connection dropped (a proxy, the network) as the run created its repo, or read
    whether it is private: the job ended in httpx's RemoteProtocolError traceback (a 5xx there was one line)."""
    local_hub.drop[("create_repo", None)] = 1
    with pytest.raises(ConfigError) as info:
        hub.create_at_start("lab/new", SECRET, private=None)
    message = str(info.value)
    assert message.startswith("could not create lab/new on the Hub (RemoteProtocolError: Server disconnected")
    assert message.endswith("run the same command again") and SECRET not in message
    local_hub.drop[("model_info", None)] = 1
    with pytest.raises(ConfigError, match="^could not read whether lab/mine is private .RemoteProtocolError: "):
        hub.create_at_start("lab/mine", SECRET, private=True)
    with pytest.raises(RunError, match="^could not read whether lab/mine is private .RemoteProtocolError: "):
        local_hub.drop[("model_info", None)] = 1
        hub.check_private("lab/mine", SECRET, private=True, where="push_to_hub.py")


def test_the_output_stage_returns_the_push_it_claimed_and_leaves_the_one_given_as_it_was(
    local_hub, tmp_path, monkeypatch
):
    """The output stage names the push's repo with its namespace once the Hub says the token may write there
    (`stages.claim_repo`). It wrote that name into the push settings it was given (issue #54: no value patched after
    it is made, so a caller holding them saw them change): it returns new settings instead."""
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    monkeypatch.setenv("HF_TOKEN", SECRET)
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(tmp_path / "run")]
    recipe = parse_args([*argv, "--push_to_hub", "true", "--hub_model_id", "new-model"])
    launch = stages.checks(recipe)
    given = hub.take_push_settings(recipe, launch.engine)
    returned = stages.output_checks(recipe, launch, given)
    assert given.repo_id == "new-model"  # as the recipe names it
    assert returned[1].repo_id == "me/new-model" and "me/new-model" in local_hub.repos


def test_a_repo_created_at_start_without_hub_private_repo_takes_its_namespaces_default(local_hub):
    """hub_private_repo unset (None) is the namespace's default visibility, as transformers and huggingface_hub read
    it: an organization whose repos are private by default. It was sent as `public`."""
    for repo, private in [("lab/unset", None), ("lab/open", False), ("lab/closed", True)]:
        hub.create_at_start(repo, SECRET, private)
    assert local_hub.visibility == {"lab/unset": None, "lab/open": "public", "lab/closed": "private"}


def test_push_to_hub_py_gives_hub_private_repo_false_the_runs_meaning(local_hub, monkeypatch, finished_run):
    """`--hub_private_repo false` is a public repo, as the run creates it (`hub.create_repo`); unset, the namespace's
    default. push_to_hub.py turned false into unset (`private or None`): a run recorded public was pushed private in an
    organization whose repos are private by default."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    push = load_script("push_to_hub").main
    push([str(finished_run), "--repo-id", "lab/open", "--hub_private_repo", "false"])
    push([str(finished_run), "--repo-id", "lab/unset"])  # the run's own setting: unset
    assert local_hub.visibility == {"lab/open": "public", "lab/unset": None}


def test_a_private_push_to_a_public_repo_is_refused_before_anything_uploads(local_hub, monkeypatch, finished_run):
    """hub_private_repo / --private only make a new repo private: to an existing public repo the job pushed the model
    in public, and push_to_hub.py said "Pushing ... (private)"."""
    refusal = "^lab/mine is a public repo, which hub_private_repo / --private does not change .*`hf repos settings"
    with pytest.raises(ConfigError, match=refusal):
        hub.create_at_start("lab/mine", SECRET, private=True)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with pytest.raises(ConfigError, match=refusal):
        load_script("push_to_hub").main([str(finished_run), "--repo-id", "lab/mine", "--private"])
    assert not local_hub.commits
    hub.create_at_start("lab/mine", SECRET, private=None)  # the namespace's default: left to the repo
    hub.create_at_start("lab/new", SECRET, private=True)  # created private
    local_hub.visibility["lab/mine"] = "private"
    hub.create_at_start("lab/mine", SECRET, private=True)


def test_push_to_hub_refuses_a_repo_the_token_may_not_create_in_one_line_that_names_the_fix(
    local_hub, monkeypatch, finished_run
):
    """A read token, or another's namespace: the write check lets a repo that does not exist through, and the Hub's 403
    at creation came out as 'pushing ... failed (...): run the same command again', which fails the same way."""
    local_hub.create_status["other"] = 403
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with pytest.raises(ConfigError, match="^the Hub refuses to create other/new with this Hugging Face token .*"):
        load_script("push_to_hub").main([str(finished_run), "--repo-id", "other/new"])
    assert not local_hub.commits


def test_a_token_revoked_during_training_is_named_by_its_source_at_the_final_push(local_hub, monkeypatch, finished_run):
    """The write check passed at the start; the token revoked during training, the final push's repo creation got the
    Hub's 401, said as "the Hub refuses to create lab/new with this Hugging Face token: use a write token that may
    create repos in 'lab'", of a token that may: the invalid token's own line, naming where it came from."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    local_hub.create_status["lab"] = 401
    with pytest.raises(ConfigError) as refused:
        hub.push_run(finished_run, "lab/new", token=SECRET)
    assert str(refused.value) == offline.invalid_token(SECRET)
    assert str(refused.value).startswith("the Hugging Face token in HF_TOKEN, set in the environment, is invalid")
    assert not local_hub.commits


def test_write_access_says_when_the_hub_cannot_be_reached(monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as sock:  # a local port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ConfigError) as info:
        hub.check_write_access("me/run", SECRET)
    message = str(info.value)
    assert message.startswith("could not reach the Hugging Face Hub to check write access to me/run (Connect")
    assert "set HF_HUB_OFFLINE=1 and push afterwards with scripts/push_to_hub.py" in message
    assert SECRET not in message

    # push_to_hub.py itself, on a login node without network: run it elsewhere, not "push afterwards with it"; a Hub
    # it cannot reach is a failure (exit 1), as a push the Hub failed is, not a refused input (exit 2)
    with pytest.raises(RunError) as info:
        hub.check_write_access("me/run", SECRET, where="push_to_hub.py")
    message = str(info.value)
    assert "This machine cannot reach the Hub: run scripts/push_to_hub.py where it can" in message
    assert "push afterwards" not in message and "HF_HUB_OFFLINE=1" not in message


# --- a Hub that does not answer: refused in seconds, with the remedy ---------------------------------------------


@pytest.mark.slow
def test_the_probe_tells_a_silent_hub_from_one_that_answers(monkeypatch, counted_silent_endpoint):
    from huggingface_hub import constants

    silent_endpoint, asked = counted_silent_endpoint
    monkeypatch.setattr(constants, "ENDPOINT", silent_endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests' default; huggingface_hub would refuse at once
    start = time.perf_counter()
    why = offline.hub_unreachable()
    # Waited, then gave up, at the deadline: that answer is `within`'s own, given only once its join of PROBE_SECONDS
    # ran out (the request's socket timeout, SOCKET_SECONDS, would have said ReadTimeout), after one request.
    assert why == f"{silent_endpoint}: {PROBE_TIMEOUT}" and asked() == 1
    # The deadline the product promises, held: the margin is for a hang (huggingface_hub's retries: 23 s to minutes),
    # which no load of the machine's makes of a 3 s wait.
    assert time.perf_counter() - start < offline.PROBE_SECONDS + 20
    server = StandInHub()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        # any answer counts (the stand-in answers 404 here); None is an answer within the deadline, or `within` raised
        assert offline.hub_unreachable() is None
    finally:
        server.close()


@pytest.mark.slow
def test_a_job_with_everything_cached_on_a_silent_hub_reads_the_cache_offline(
    monkeypatch, hf_home, counted_silent_endpoint
):
    """Online, with model and data set in the cache, a silent Hub costs one probe: the libraries would ask it of every
    cached file they read (a cached tokenizer: minutes), so the job reads the cache offline, said in a line; with one
    piece not cached, the job is refused with the prefetch command."""
    import datasets.config
    import transformers.integrations.integration_utils  # noqa: F401 - its one "[INFO] Running in WANDB offline mode"
    from huggingface_hub import constants

    from dpotrain.recipe.config import parse_args

    silent_endpoint, asked = counted_silent_endpoint
    monkeypatch.setattr(constants, "ENDPOINT", silent_endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")
    for module, name in ((constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(module, name, False)  # restored after the job turns them on
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(offline, "ANSWER", None)  # an answer left by an earlier run in this process
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)  # datasets follows HF_HUB_OFFLINE
    # The caches are set above, as a user's default ones are found: the printed command then names no HF_HOME (the
    # suite's own HF_HOME, tests/conftest.py, would be named in it).
    monkeypatch.delenv("HF_HOME", raising=False)
    here = ["--config", THINK, "--model_name_or_path", MODEL, "--dataset_name", DATASET]
    with contextlib.redirect_stderr(io.StringIO()) as said:
        offline.check_job_reachable(parse_args([*here, "--dry-run"]))
    assert asked() == 1  # one probe, then the cache read offline: none of the libraries' requests for each file
    assert said.getvalue().startswith(
        f"The Hugging Face Hub does not answer here ({silent_endpoint}: "
    ) and said.getvalue().endswith(
        "models and data sets are read from the local cache, offline (set HF_HUB_OFFLINE=1 to skip this wait of up "
        f"to {offline.PROBE_SECONDS:g} s)\n"
    ), said.getvalue()
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"

    # offline now, for the silent Hub: a piece not cached is refused as on a silent Hub, with no second probe
    with pytest.raises(ConfigError) as info:
        offline.check_job_reachable(parse_args([*here, "--dataset_name", "org/absent-prefs", "--dry-run"]))
    assert str(info.value).startswith(
        f"dataset 'org/absent-prefs': not cached, and the Hugging Face Hub does not answer here ({silent_endpoint}: "
    )
    assert str(info.value).endswith(
        "on a machine with network, fill the cache with `python scripts/prefetch.py --config "
        f"{THINK} --model_name_or_path {MODEL} --dataset_name org/absent-prefs` and run this with HF_HUB_OFFLINE=1 "
        "(or fix HF_ENDPOINT / HTTPS_PROXY)"
    )
    assert asked() == 1


@pytest.mark.slow  # a probe of PROBE_SECONDS
def test_a_silent_hub_keeps_datasets_online_where_the_user_set_hf_datasets_offline_0(monkeypatch, silent_endpoint):
    """docs/hub.md: an explicit HF_DATASETS_OFFLINE=0 is the user's choice; the silent Hub turns the models offline
    and leaves datasets as asked."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", silent_endpoint)
    for module, name in ((constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(module, name, False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(offline, "ANSWER", None)  # an answer left by an earlier run in this process
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    with contextlib.redirect_stderr(io.StringIO()):
        offline.read_cache_if_silent()
    assert offline.ANSWER.why and constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    assert not datasets.config.HF_DATASETS_OFFLINE and not offline.datasets_offline()


# Two runs in one process (a notebook's): the first one's start agreeing on a Hub that does not answer, then a dry run
# with the Hub answering. Here, not in the test's process: huggingface_hub and datasets take HF_ENDPOINT at import.
def two_runs(closed: str, args: list[str]) -> None:
    """A run's start (train_dpo.run's Hub agreement) with the Hub at `closed` silent, then a dry run in the same process
    with the Hub back."""
    from huggingface_hub import constants

    import train_dpo
    from dpotrain.recipe.config import parse_args

    endpoint, constants.ENDPOINT = constants.ENDPOINT, closed
    offline.agree_on_hub(parse_args(args))  # the first run's start (train_dpo.run), its Hub silent
    assert offline.hub_answer().startswith(closed), offline.hub_answer()
    constants.ENDPOINT = endpoint
    train_dpo.main([*args, "--dry-run", "--json"])


@pytest.mark.slow  # a process of its own: a forked child of this one (`in_child`), the Hub's variables read again
def test_a_run_takes_no_hub_answer_from_a_run_before_it_in_this_process(tmp_path):
    """A launch's answer from the Hub is every rank's for that run alone: a dry run started after it in the same
    process asks for itself. The first run's Hub did not answer, the dry run's does: it stays online, where it took
    the first run's answer, said the Hub did not answer and turned this process offline. In a forked child of the test
    process (`in_child`), not a fresh interpreter (~6 CPU-s of imports for two checks of a few milliseconds)."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    server = StandInHub()
    server.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    with socket.socket() as sock:  # a local port that nothing listens on once closed: the first run's Hub
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = {k: None for k in os.environ if k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_TOKEN="")
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "none", "--output_dir", str(tmp_path)]
    args += ["--dataset_name", "", "--dataset_mixer_list", "org/prefs", "1.0"]
    try:
        code, stdout, stderr = in_child(lambda: two_runs(closed, args), env=env)
    finally:
        server.close()
    assert code == 0, stderr[-3000:]
    assert "does not answer" not in stderr, stderr[-3000:]
    assert json.loads(stdout[stdout.index("{\n") :])["derived"]["dataset_rows"] == 16


@pytest.mark.slow
def test_hf_hub_offline_in_dot_env_keeps_a_job_off_the_hub(tmp_path, hf_home, silent_endpoint):
    """docs/hub.md: `HF_HUB_OFFLINE=1` in `.env` does what it does in the environment. huggingface_hub and datasets
    read it once, as they are imported, and train_dpo.py read .env after its imports: this job, its model and data set
    cached, asked the silent Hub for every file it loaded (more than 60 s for the model's config alone), though the
    run's own checks took it for offline. The project is a copy of train_dpo.py beside the package, with its .env.
    HF_HOME, where the model and data set are cached, is given in .env alone: huggingface_hub and datasets take their
    cache folders from it as they are imported, and main()'s own reading of .env (an importer's) hands them only the
    offline switches, so this run finds its model only where .env is read before the imports. Read once: a command
    read it before its imports and again in main() (an importer's reading), each time twice (checked, then parsed)."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "train_dpo.py", project)
    (project / "dpotrain").symlink_to(ROOT / "dpotrain")
    (project / ".env").write_text(f"HF_HUB_OFFLINE=1\nHF_HOME={hf_home}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=silent_endpoint)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", MODEL, "--dataset_name", DATASET]
    args += ["--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--warmup_steps", "0", "--save_strategy", "no"]
    try:
        result = subprocess.run(
            [PYTHON, "-c", COUNTING_ENV_OPENS, str(project / "train_dpo.py"), *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=150,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job waited on the silent Hub: {(e.stdout or b'')[-2000:]!r}")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "run" / "run_complete.json").exists()
    assert ".env opened 1 time(s)" in result.stdout, result.stdout[-3000:]


# `python SCRIPT ARGS` as Python runs it (`__main__`, the script's folder first on sys.path), counting the opens of the
# script's `.env` (an audit hook: every open, whoever makes it), said as the process exits.
COUNTING_ENV_OPENS = r"""
import atexit, os, runpy, sys
script = sys.argv[1]
env_file = os.path.join(os.path.dirname(os.path.realpath(script)), ".env")
opened = []
def count(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.extend([1] if os.path.realpath(os.fsdecode(args[0])) == env_file else [])
sys.addaudithook(count)
atexit.register(lambda: print(f".env opened {len(opened)} time(s)", file=sys.stderr, flush=True))
sys.argv, sys.path[0] = sys.argv[1:], os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
"""


# Each command the way it runs, in one process that paid its imports first: what is counted is the command's own
# requests to the Hub (huggingface_hub's retries of one: 23 s and more per file), not those of the imports.
UNREACHABLE = r"""
import contextlib, importlib.util, io, json, os, sys
import train_dpo
from dpotrain.recipe.errors import run_cli

def script(name):
    spec = importlib.util.spec_from_file_location(name, f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

analyzer, prefetch = script("analyze_dataset"), script("prefetch")
model, out = sys.argv[1], sys.argv[2]
results = {}
def counted(name, main):
    stdout, stderr = io.StringIO(), io.StringIO()
    environment = dict(os.environ)  # each command in a fresh environment, as in a process of its own
    asked = len(ASKED)
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            run_cli(main)
        except SystemExit as e:
            code = e.code
    results[name] = {"asked": len(ASKED) - asked, "code": code, "stdout": stdout.getvalue(),
                     "stderr": stderr.getvalue()}
    for variable in set(os.environ) - set(environment):
        del os.environ[variable]
    os.environ.update(environment)

counted("analyzer", lambda: analyzer.main(["data/smoke_prefs.jsonl", "--tokenizer", model]))
smoke = ["--config", "configs/smoke.yaml", "--model_name_or_path", model, "--output_dir", out]
think = ["--config", "configs/think.yaml", "--model_name_or_path", model, "--output_dir", out]  # bf16: planned
counted("dry_run", lambda: train_dpo.main([*think, "--dry-run"]))
counted("prefetch", lambda: prefetch.main(["--config", "configs/smoke.yaml", "--model_name_or_path", model]))
counted("training", lambda: train_dpo.main(smoke))
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def silent_hub(tmp_path_factory, hf_home, tiny_model_dir):
    """This module's processes on a machine whose Hub does not answer (HF_ENDPOINT never replies, HF_HUB_OFFLINE
    unset), started together (`results_together`): most wait out a probe of PROBE_SECONDS, idle, and one after another
    those waits were ~30 s of a worker's time. Each is the process it was, with its own output folder and reference
    cache: `.endpoint`, `.results[name]` and `.outs[name]` (its output folder). The endpoint is the module's own, a
    port that listens and never accepts, as the session's `silent_endpoint`, whose queue holds one connection where
    these open several at once."""
    import socket

    folder = tmp_path_factory.mktemp("silent_hub")
    empty = tmp_path_factory.mktemp("empty_hf_home")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
        programs, outs = {}, {}

        def add(name, program, args, home=hf_home):
            outs[name] = folder / name / "run"
            cache = str(folder / name / "cache")
            env = base | dict(HF_HOME=str(home), HF_ENDPOINT=endpoint, PYTHONPATH=str(ROOT), DPOTRAIN_CACHE=cache)
            programs[name] = (program, [*args(outs[name])], env)

        # The analyzer, a dry run, prefetch and a training start on a Hub model name, as on a newcomer's laptop: no
        # network, an empty cache
        add("unreachable", UNREACHABLE, lambda out: ["org/not-cached-model", str(out)], home=empty)
        for command in ("analyzer", "training"):
            for data, source in (("local", "data/smoke_prefs.jsonl"), ("hub", DATASET)):
                add(f"{command}-{data}", CACHED, lambda out, c=command, d=source: [c, MODEL, d, str(out)])
        add("analyzer-mixture", CACHED, lambda out: ["analyzer_mixture", tiny_model_dir, DATASET, str(out)])
        add("model-not-cached", CACHED, lambda out: ["training", "org/not-cached-model", DATASET, str(out)])
        local = "data/smoke_prefs.jsonl"
        runs = ["org/tiny-from-ddp", local, "org/tiny-no-weights", local, MODEL, DATASET]
        add("dry-runs", DRY_RUNS, lambda out: [str(out), *runs])
        yield SimpleNamespace(endpoint=endpoint, results=results_together(programs), outs=outs)


@pytest.fixture(scope="module")
def unreachable(silent_hub) -> dict:
    """The analyzer, a dry run, prefetch and a training start on a Hub model name, on a machine whose Hub does not
    answer: no network (HF_ENDPOINT never replies), an empty cache, HF_HUB_OFFLINE unset, as a newcomer's laptop."""
    return silent_hub.results["unreachable"]


@pytest.mark.slow  # one process's imports, and three probes of 3 s (`silent_hub`)
@pytest.mark.parametrize("command", ["analyzer", "prefetch", "training"])
def test_an_unreachable_hub_is_refused_in_seconds_with_the_remedy(unreachable, silent_hub, command):
    silent_endpoint, result = silent_hub.endpoint, unreachable[command]
    # in seconds: refused on the probe's answer, its deadline ("no answer within 3 s"), after one request; never a
    # download's retries (each a request more)
    assert result["asked"] == 1 and result["code"] == 2, result
    error = result["stderr"].strip().splitlines()[-1]
    assert error.startswith("error: ") and "Traceback" not in result["stderr"], result
    assert f"the Hugging Face Hub does not answer here ({silent_endpoint}: {PROBE_TIMEOUT})" in error
    remedy = {
        "analyzer": "pass a local tokenizer folder with --tokenizer PATH (and a local data file), or fill the cache "
        "on a machine with network (`python scripts/prefetch.py --config configs/smoke.yaml --model_name_or_path "
        "org/not-cached-model`) and run this with HF_HUB_OFFLINE=1",
        "prefetch": "run it on a machine with network (a login node), then the job with HF_HUB_OFFLINE=1 and the same "
        "HF_HOME; or fix HF_ENDPOINT / HTTPS_PROXY",
        "training": "fill the cache with `HF_HOME=",  # the cache the job reads, then the command
    }[command]
    assert remedy in error, error
    if command == "training":
        # with the job's folder, which prefetch.py decides on (a stopped run's commits, else main)
        fetch = "python scripts/prefetch.py --config configs/smoke.yaml --model_name_or_path org/not-cached-model"
        assert f"{fetch} --output_dir " in error and "/run` and run this with HF_HUB_OFFLINE=1" in error, error


@pytest.mark.slow  # shares the fixture above
def test_a_dry_run_on_an_uncached_hub_model_plans_what_it_can_in_seconds(unreachable):
    """A dry run reads files on this machine only: it never waits on the Hub, and says how to get the config."""
    result = unreachable["dry_run"]
    assert result["asked"] == 0 and result["code"] is None, result  # nothing asked, so nothing to wait on
    assert (
        "memory/GPU:    not planned: the config of 'org/not-cached-model' is not in the local Hugging Face cache; a "
        "dry run loads nothing from the network: `HF_HOME="  # the cache the dry run read, then the command as it runs
    ) in result["stdout"], result["stdout"]
    assert (
        " python scripts/prefetch.py --config configs/think.yaml --model_name_or_path org/not-cached-model "
        "--output_dir "  # the job's folder, which prefetch.py decides on
    ) in result["stdout"], result["stdout"]
    assert "/run` on a machine with network fetches it" in result["stdout"], result["stdout"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# --- a cached Hub model on a machine whose Hub does not answer: read from the cache in seconds ------------------------

CACHED = """
import contextlib, importlib.util, io, json, sys
from dpotrain.recipe.errors import run_cli

command, model, data, out = sys.argv[1:5]
if command == "analyzer":
    spec = importlib.util.spec_from_file_location("analyze_dataset", "scripts/analyze_dataset.py")
    analyzer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(analyzer)
    main = lambda: analyzer.main([data, "--tokenizer", model])
elif command == "analyzer_mixture":
    spec = importlib.util.spec_from_file_location("analyze_dataset", "scripts/analyze_dataset.py")
    analyzer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(analyzer)
    main = lambda: analyzer.main(["--dataset_mixer_list", data, "1.0", "--tokenizer", model])
else:
    import train_dpo
    args = ["--config", "configs/smoke.yaml", "--model_name_or_path", model, "--dataset_name", data]
    args += ["--output_dir", out, "--max_steps", "1", "--warmup_steps", "0", "--save_strategy", "no"]
    main = lambda: train_dpo.main(args)
stdout, stderr, code = io.StringIO(), io.StringIO(), None
with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    try:
        run_cli(main)
    except SystemExit as e:
        code = e.code
said = {"stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
print("RESULTS " + json.dumps({"asked": len(ASKED), "code": code, **said}))
"""


@pytest.mark.slow  # a process each, a probe of PROBE_SECONDS, one training step of the tiny model (`silent_hub`)
@pytest.mark.parametrize(
    "command, data",
    # a dry run of the same: test_a_dry_run_refuses_the_cached_weights_of_a_hub_model_that_lack_its_tensors
    [("analyzer", "local"), ("analyzer", "hub"), ("training", "local"), ("training", "hub")],
)
def test_a_cached_hub_model_is_read_from_the_cache_in_seconds_when_the_hub_does_not_answer(silent_hub, command, data):
    """A login node behind a firewall, HF_HUB_OFFLINE unset, the model (and the Hub data set) in the local cache: the
    analyzer and the run waited on the silent Hub for the files they read from the cache (10 s a request, retried:
    over 300 s before the tokenizer had loaded). Now the Hub is asked once, within PROBE_SECONDS, and the libraries read
    the cache offline, said in a line."""
    silent_endpoint, result = silent_hub.endpoint, silent_hub.results[f"{command}-{data}"]
    assert result["code"] in (None, 0), result  # the analyzer returns 0, train_dpo.main None
    output = result["stdout"] + result["stderr"]
    # the libraries' own words where they wait on the Hub (the old run's: "Could not reach the Hub ([Errno 110]
    # Connection timed out). Using cached commit hash", then "Retrying in 1s [Retry 1/5]" for the chat templates)
    assert "Could not reach the Hub" not in output and "Retrying in" not in output, output
    said = f"The Hugging Face Hub does not answer here ({silent_endpoint}: "
    assert output.count(said) == 1 and "): models and data sets are read from the local cache, offline" in output
    # the probe, given up at its deadline, then the cache: one request, not the libraries' minutes of retries of one
    # for every cached file they read
    assert f"{said}{PROBE_TIMEOUT})" in output and result["asked"] == 1, result


# Dry runs on the smoke recipe, one after another in one process, each as in a process of its own (the environment
# restored): a dry run reads the cache alone, so what one asked or refused is its own.
DRY_RUNS = r"""
import contextlib, io, json, os, sys
import train_dpo
from dpotrain.recipe.errors import run_cli

out = sys.argv[1]
results = []
for model, data in zip(sys.argv[2::2], sys.argv[3::2]):  # (model, data set) after (model, data set)
    stdout, stderr, code, asked, environment = io.StringIO(), io.StringIO(), None, len(ASKED), dict(os.environ)
    args = ["--config", "configs/smoke.yaml", "--model_name_or_path", model, "--dataset_name", data]
    args += ["--max_steps", "1", "--warmup_steps", "0", "--save_strategy", "no"]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            run_cli(lambda: train_dpo.main([*args, "--output_dir", f"{out}-{len(results)}", "--dry-run"]))
        except SystemExit as e:
            code = e.code
    said = {"stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    results.append({"asked": len(ASKED) - asked, "code": code, **said})
    for variable in set(os.environ) - set(environment):
        del os.environ[variable]
    os.environ.update(environment)
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.slow  # a process, three dry runs (`silent_hub`)
def test_a_dry_run_refuses_the_cached_weights_of_a_hub_model_that_lack_its_tensors(silent_hub):
    """A Hub model's weights that lack some of its tensors (DDP's `module.` names) are refused by the dry run from the
    names in the cached files, with the line the run's load gives, and nothing asked of the Hub (its endpoint silent);
    a model whose weights are not cached is planned without them, as before. A dry run of a cached Hub model and data
    set reads the cache alone (local_files_only): it asks nothing, so it has no silent Hub to say."""
    silent_endpoint, model = silent_hub.endpoint, "org/tiny-from-ddp"
    refused, unweighted, cached = silent_hub.results["dry-runs"]
    assert refused["code"] == 2 and refused["asked"] == 0, refused
    assert [line for line in refused["stderr"].splitlines() if line.startswith("error: ")] == [
        f"error: the weights of {model} lack 25 of the model's 25 tensors (lm_head.weight, ...), which transformers "
        "would start at random; they hold 25 the model has no place for (module.lm_head.weight, ...): save the model "
        "with save_pretrained (a state dict saved from a wrapped model, DDP's or PEFT's, names its tensors with a "
        "prefix such as 'module.'), or copy in the missing weights"
    ]
    assert unweighted["code"] is None and unweighted["asked"] == 0, unweighted
    output = cached["stdout"] + cached["stderr"]
    assert cached["code"] is None and cached["asked"] == 0, cached
    # the libraries' own words where they wait on the Hub, and the run's where it found the Hub silent: none
    assert "Could not reach the Hub" not in output and "Retrying in" not in output, output
    assert f"The Hugging Face Hub does not answer here ({silent_endpoint}: " not in output, output


@pytest.mark.slow  # a process, a probe of PROBE_SECONDS (`silent_hub`)
def test_the_analyzer_reads_a_cached_mixture_hub_source_offline_when_the_hub_does_not_answer(silent_hub):
    """A mixture whose Hub source is cached, measured with a local tokenizer, HF_HUB_OFFLINE unset: the analyzer asked
    nothing first (its data set was the recipe, not a Hub name), and datasets waited on the silent Hub for the cached
    source. Now the Hub is asked once, within PROBE_SECONDS, and the source read from the cache, said in a line."""
    silent_endpoint, result = silent_hub.endpoint, silent_hub.results["analyzer-mixture"]
    output = result["stdout"] + result["stderr"]
    assert result["code"] in (None, 0), result
    assert output.count(f"The Hugging Face Hub does not answer here ({silent_endpoint}: ") == 1, output
    assert "Could not reach the Hub" not in output and "Retrying in" not in output, output
    assert result["asked"] == 1, result  # one probe, then the cache: not datasets' retries for the cached source


@pytest.mark.slow  # a 2-process launch: imports, a rendezvous, one training step of the tiny model
def test_a_launch_asks_a_silent_hub_once_for_every_rank(tmp_path, hf_home, counted_silent_endpoint):
    """The model cached, HF_HUB_OFFLINE unset, under `accelerate launch` of 2 processes: each rank asked the Hub for
    itself (2 connections), and a Hub answering one rank in time and another not left one offline, one online. The
    main process asks once, every rank takes its answer: one connection, one line, both ranks offline, trained."""
    from conftest import accelerate_launch, rank_python

    endpoint, asked = counted_silent_endpoint
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    bin_dir = os.path.dirname(PYTHON)
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, PATH=f"{bin_dir}:{env['PATH']}")
    env["DPOTRAIN_CACHE"] = str(tmp_path / "cache")
    # Plain DDP: which engine the ranks run does not matter to their agreeing on the Hub, and DeepSpeed's is the dearer
    # start (its ops and engine on every rank)
    launch = [*accelerate_launch(), "--config_file", str(ddp_config(tmp_path)), "--num_processes", "2"]
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", MODEL, "--max_steps", "1"]
    args += ["--warmup_steps", "0", "--save_strategy", "no", "--output_dir", str(tmp_path / "run")]
    cmd = [*launch, *rank_python(), str(ROOT / "train_dpo.py"), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert asked() == 1, (asked(), result.stdout[-3000:])
    assert result.stdout.count(f"The Hugging Face Hub does not answer here ({endpoint}: ") == 1, result.stdout[-3000:]
    assert "Could not reach the Hub" not in result.stdout and "Retrying in" not in result.stdout


@pytest.mark.slow  # a process, a probe of PROBE_SECONDS (`silent_hub`)
def test_a_model_not_cached_is_refused_once_a_silent_hub_turned_the_job_offline(silent_hub):
    """The data set cached, the model not: the data stage finds the Hub silent and reads the cache offline; the model
    is then refused in one line with the prefetch command, as on a silent Hub, not by transformers' offline error."""
    silent_endpoint, result = silent_hub.endpoint, silent_hub.results["model-not-cached"]
    assert result["code"] == 2 and result["asked"] == 1, result  # the data stage's probe, and no second one
    error = result["stderr"].strip().splitlines()[-1]
    assert error.startswith(
        "error: model 'org/not-cached-model' is not cached, and the Hugging Face Hub does not answer here "
        f"({silent_endpoint}: "
    ), error
    out = silent_hub.outs["model-not-cached"]
    fix = f"--model_name_or_path org/not-cached-model --dataset_name org/Tiny-Prefs --output_dir {out}"
    fix += "` and run this with HF_HUB_OFFLINE=1"
    assert error.endswith(f"{fix} (or fix HF_ENDPOINT / HTTPS_PROXY)"), error


# --- a Hub model cached in part (a prefetch killed halfway), read offline -------------------------------------------


def sharded_hub_model(hub, tiny_model_dir, folder: Path) -> str:
    """The tiny model saved in shards of 300 KB (3 of its 0.76 MB) with its tokenizer, committed to the stand-in Hub
    as `org/tiny-sharded`."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(folder, max_shard_size="300KB")
    for f in Path(tiny_model_dir).iterdir():  # the tokenizer and chat template beside the weights
        if not (folder / f.name).exists() and not f.name.startswith("model"):
            shutil.copy(f, folder / f.name)
    hub.state.add_model_commit("org/tiny-sharded", {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()})
    return "org/tiny-sharded"


def dry_run_on(hub, home: Path, model: str, out: Path, *args, offline: bool) -> subprocess.CompletedProcess:
    """`train_dpo.py` on the smoke recipe with `model`, against the stand-in Hub (HF_HUB_OFFLINE=1 when `offline`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=hub.endpoint, HF_TOKEN="", **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    smoke = ["--config", "configs/smoke.yaml", "--model_name_or_path", model, "--output_dir", str(out)]
    command = [python(), str(ROOT / "train_dpo.py"), *smoke, *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # processes of their own: prefetch twice, five dry runs, a run refused at its start
def test_an_offline_dry_run_lists_a_hub_model_cached_in_part_as_the_run_refuses_it(hub_home, tmp_path):
    """A prefetch killed halfway leaves the model's index and some of its shards in the Hub cache (or its config and
    tokenizer and no weights). Offline the run refused it at once (exit 2), but its dry run, launch.sh's preflight,
    was silent (exit 0), so a Slurm job failed only once srun had started its ranks. Offline nothing can fill the
    cache: the dry run lists it among what the run would refuse, in the run's own line; online it is not refused (the
    run downloads what is missing)."""
    hub, home = hub_home
    snapshot = next((home / "hub" / "models--org--tiny-sharded" / "snapshots").iterdir())
    shards = sorted(p.name for p in snapshot.glob("model-*.safetensors"))
    assert len(shards) > 1 and all((snapshot / s).is_symlink() for s in shards), shards  # huggingface_hub's layout
    (snapshot / shards[1]).unlink()
    refused = (
        "offline (HF_HUB_OFFLINE) and not in the local Hugging Face cache: model 'org/tiny-sharded' lacks 1 of "
        f"{len(shards)} weight shards ({shards[1]}). On a login node with network, run: HF_HOME={home} python "
    )
    dry = dry_run_on(hub, home, "org/tiny-sharded", tmp_path / "run", "--dry-run", offline=True)
    assert dry.returncode == 0, dry.stderr[-3000:]
    (listed,) = [line for line in dry.stdout.splitlines() if "HF_HUB_OFFLINE" in line and "would refuse" in line]
    assert listed.startswith(f"warning: the run would refuse: {refused}"), listed
    fetch = "scripts/prefetch.py --config configs/smoke.yaml --model_name_or_path org/tiny-sharded"
    assert listed.endswith(f"{fetch} --output_dir {tmp_path / 'run'}"), listed  # the job's folder: prefetch reads it
    run = dry_run_on(hub, home, "org/tiny-sharded", tmp_path / "run", offline=True)
    error = listed.replace("warning: the run would refuse:", "error:")
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == error, run.stderr[-3000:]
    # launch.sh's preflight: the dry run's JSON read by `job summary`, which ends the job before srun
    resolved = dry_run_on(hub, home, "org/tiny-sharded", tmp_path / "run", "--dry-run", "--json", offline=True)
    job = subprocess.run(
        [python(), "-m", "dpotrain.cluster.job", "summary"],
        input=resolved.stdout,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert job.returncode == 2 and error in job.stderr.splitlines(), job.stderr[-3000:]
    online = dry_run_on(hub, home, "org/tiny-sharded", tmp_path / "run", "--dry-run", offline=False)
    assert online.returncode == 0 and "would refuse" not in online.stdout, online.stdout[-3000:]

    for weights in snapshot.glob("model*"):  # the config and tokenizer alone
        weights.unlink()
    dry = dry_run_on(hub, home, "org/tiny-sharded", tmp_path / "run", "--dry-run", offline=True)
    assert (
        "warning: the run would refuse: offline (HF_HUB_OFFLINE) and not in the local Hugging Face cache: model "
        "'org/tiny-sharded' lacks weights (model.safetensors or a sharded index). On a login node with network, run: "
    ) in dry.stdout, dry.stdout[-3000:]
    prefetch(hub, home)  # the command it names, where the Hub is reachable: the cache whole again
    dry = dry_run_on(hub, home, "org/tiny-sharded", tmp_path / "run", "--dry-run", offline=True)
    assert dry.returncode == 0 and "would refuse" not in dry.stdout, dry.stdout[-3000:]


@pytest.fixture
def hub_home(tmp_path, tiny_model_dir):
    """The stand-in Hub serving `org/tiny-sharded`, and a Hugging Face cache that prefetch.py filled from it."""
    hub = StandInHub()
    try:
        sharded_hub_model(hub, tiny_model_dir, tmp_path / "sharded")
        home = tmp_path / "hf_home"
        prefetch(hub, home)
        yield hub, home
    finally:
        hub.close()


def prefetch(hub, home: Path) -> None:
    """`scripts/prefetch.py` for the smoke recipe on `org/tiny-sharded`, from the stand-in Hub into `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=hub.endpoint, HF_TOKEN="")
    args = ["--config", "configs/smoke.yaml", "--model_name_or_path", "org/tiny-sharded"]
    fetched = run_script("prefetch.py", args, env)
    assert fetched.returncode == 0 and "Ready: a job with HF_HUB_OFFLINE=1" in fetched.stdout, fetched.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_prefetch_command_of_a_job_resuming_a_checkpoint_names_it(monkeypatch):
    """An offline job resuming `--resume_from_checkpoint` reads its data's commits from that checkpoint's record: the
    command its refusal printed named the --output_dir alone, and prefetch.py, reading that folder's record (none for a
    new folder), fetched main."""
    from dpotrain.recipe.config import parse_args

    for name in ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    here = ["--dataset_name", "o/prefs", "--resume_from_checkpoint", "kept/checkpoint-4", "--output_dir", "new"]
    command = offline.prefetch_command(parse_args(["--config", THINK, *here, "--dry-run"]), "new")
    assert command.endswith(" --output_dir new --resume_from_checkpoint kept/checkpoint-4"), command

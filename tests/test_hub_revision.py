"""A Hub data set is trained at one commit (dpotrain/data/hub_revision.py): resolved when the run first starts,
recorded, and loaded again by every resume wherever `main` has moved; `dataset_revision` pins it by hand."""

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, python
from dpotrain.data import hub_revision
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.train.metrics import read_metrics
from dpotrain.train.preemption import STOPPED_EXIT

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]
FIRST, SECOND = "1" * 40, "2" * 40


def recipe(*args):
    return parse_args([*SMOKE, "--output_dir", "/tmp/unused", *args])


def test_a_resumed_run_keeps_the_commit_it_started_on(tmp_path):
    (tmp_path / "resolved_config.json").write_text(json.dumps({"derived": {"data_identity": {"hub_commit": FIRST}}}))
    r = recipe("--dataset_name", "org/prefs")
    assert hub_revision.kept(r, str(tmp_path)) == FIRST  # the data stage loads it (stages.load_data's `output`)
    assert r.project.dataset_revision is None  # the recipe, the user's intent, is left as parsed
    # A revision given by hand is the user's: kept as given (its commit is compared with the record instead)
    given = recipe("--dataset_name", "org/prefs", "--dataset_revision", SECOND)
    assert hub_revision.kept(given, str(tmp_path)) is None and given.project.dataset_revision == SECOND
    # A run recorded on a local data set (its files' content, not a commit) has nothing to keep
    (tmp_path / "resolved_config.json").write_text(json.dumps({"derived": {"data_identity": {"a.jsonl": {}}}}))
    assert hub_revision.kept(recipe("--dataset_name", "org/prefs"), str(tmp_path)) is None


def test_a_record_of_another_data_set_gives_no_commit_to_keep(tmp_path):
    """The run in the folder trained on org/a; a job there on org/b (starting afresh with --overwrite_output_dir, or
    prefetch.py deciding as it) loaded org/b at org/a's commit, which org/b has not: `no revision` every time."""
    from dpotrain import resolve

    old = recipe("--dataset_name", "org/a")
    written = resolve.resolved_config(old, {"data_identity": {"hub_commit": FIRST}})
    (tmp_path / "resolved_config.json").write_text(json.dumps(written))
    assert hub_revision.kept(old, str(tmp_path)) == FIRST
    assert hub_revision.kept(recipe("--dataset_name", "org/b"), str(tmp_path)) is None


def test_a_commit_edited_by_hand_in_the_record_is_not_the_one_a_continued_run_loads(tmp_path):
    """resolved_config.json holds its own digest (`written_sha256`): a commit "fixed" there by hand was loaded by the
    continued run, while its resume reads the checkpoint's own copy and says the edit is not used (the output checks
    give the data stage that copy's folder: stages.output_checks)."""
    from dpotrain.recipe import run_record

    path = tmp_path / "resolved_config.json"
    path.write_text(json.dumps(run_record.sealed({"derived": {"data_identity": {"hub_commit": FIRST}}})))
    r = recipe("--dataset_name", "org/prefs")
    assert hub_revision.kept(r, str(tmp_path)) == FIRST  # as the run wrote it
    edited = json.loads(path.read_text())
    edited["derived"]["data_identity"]["hub_commit"] = SECOND
    path.write_text(json.dumps(edited, indent=4))
    assert hub_revision.kept(r, str(tmp_path)) is None  # pinned as a new run's, not the edit


def test_a_resumed_mixture_keeps_the_commit_its_record_holds_for_each_hub_source(tmp_path):
    from dpotrain.data import mixture

    def read_at(commit):
        return {"identity": {"revision": f"hub:org/prefs:default:train@{commit}"}}

    mixed = recipe("--dataset_name", "", "--dataset_mixer_list", "org/prefs", "1.0", "data/smoke_prefs.jsonl", "1.0")
    record = tmp_path / "resolved_config.json"
    # Recorded under another spelling (`org/prefs` then `{"path": ...}`): the source at its place
    sources = [{"source": "org/prefs:default [train]", **read_at(FIRST)}, {"source": "data/smoke_prefs.jsonl [train]"}]
    record.write_text(json.dumps({"derived": {"data_sources": sources}}))
    assert mixture.kept(mixed, str(tmp_path)) == {"org/prefs": FIRST}
    other = recipe("--dataset_name", "", "--dataset_mixer_list", "org/other", "1.0", "data/smoke_prefs.jsonl", "1.0")
    assert mixture.kept(other, str(tmp_path)) == {}  # another repo at that place: not its commit
    # Read where no commit could be told (`...@main`): nothing kept, the source pinned as a new run's
    record.write_text(json.dumps({"derived": {"data_sources": [{"source": "org/prefs [train]", **read_at("main")}]}}))
    assert mixture.kept(mixed, str(tmp_path)) == {}
    assert mixture.kept(recipe("--dataset_name", "org/prefs"), str(tmp_path)) == {}  # no mixture
    # A held-out mixture's source, beside dataset_name too, is kept as a training source is (`eval_sources`)
    held = recipe("--dataset_name", "org/prefs", "--dataset_mixer_eval_list", "org/held", "1.0")
    eval_sources = [{"source": "org/held [test]", "identity": {"revision": f"hub:org/held:default:test@{SECOND}"}}]
    record.write_text(json.dumps({"derived": {"eval_sources": eval_sources}}))
    assert mixture.kept(held, str(tmp_path)) == {"org/held": SECOND}


def test_a_revision_given_on_a_resume_that_names_another_commit_is_changed_data():
    assert hub_revision.changed(FIRST, "org/prefs", None) is None  # none given: the run keeps its commit
    assert hub_revision.changed(FIRST, "org/prefs", FIRST) is None
    assert hub_revision.changed(FIRST, "org/prefs", SECOND) == (
        f"org/prefs at {SECOND} is commit {SECOND[:12]}, the run trained on commit {FIRST[:12]}"
    )


def test_only_a_commit_is_recorded_as_the_data_sets_identity():
    assert hub_revision.identity(FIRST) == {"hub_commit": FIRST}
    assert hub_revision.identity("main") is None and hub_revision.identity(None) is None


@pytest.mark.parametrize(
    "args, refusal",
    [
        (["--dataset_revision", FIRST], "'data/smoke_prefs.jsonl' is local: remove dataset_revision"),
        (
            ["--dataset_mixer_list", "data/smoke_prefs.jsonl", "1.0", "--dataset_revision", "v1"],
            "this run reads a mixture: remove dataset_revision",
        ),
    ],
    ids=["local", "mixture"],
)
def test_a_revision_for_data_that_is_not_one_hub_data_set_is_refused(args, refusal):
    from dpotrain import options

    r = recipe(*args)
    if "--dataset_mixer_list" in args:
        r.script.dataset_name = None  # the mixture replaces the recipe's dataset_name
    with pytest.raises(ConfigError, match=refusal):
        options.check_options(r)


# --- a run on a Hub data set whose main moves between attempts (the test Hub stand-in, tests/hub_server.py) ---------


@pytest.fixture
def hub():
    from hub_server import StandInHub

    server = StandInHub()
    yield server
    server.close()


def hub_script(hub, tmp_path, script: str, *args, env=None, exit_code=0) -> str:
    """`python SCRIPT ARGS` in the project against the stand-in, as a user runs it where the Hub is reachable (`env`
    over it: the offline switches), with the test's own caches; its output."""
    online = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    online.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(tmp_path / "hf_home"),
        HF_TOKEN="",
        HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
    )
    online.update(env or {})  # the offline switches, another cache
    result = subprocess.run(
        [python(), str(ROOT / script), *args],
        cwd=ROOT,
        env=online,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == exit_code, result.stdout[-3000:]
    return result.stdout


def train_online(hub, tmp_path, out, model_dir, *extra, env=None, exit_code=0) -> str:
    """The smoke recipe on the stand-in's `org/prefs`, as a user runs it where the Hub is reachable."""
    args = [
        *SMOKE,
        "--dataset_name",
        "org/prefs",
        "--model_name_or_path",
        model_dir,
        "--output_dir",
        str(out),
        "--logging_steps",
        "1",
        "--save_steps",
        "1",
        "--report_to",
        "none",
        *extra,
    ]
    return hub_script(hub, tmp_path, "train_dpo.py", *args, env=env, exit_code=exit_code)


@pytest.mark.slow
def test_a_hub_model_to_download_into_a_hub_cache_it_cannot_write_in_is_one_line_naming_the_cache(
    hub, tmp_path, tiny_model_dir
):
    """A Hub model not yet cached is downloaded into HF_HUB_CACHE (HF_HOME/hub) as it loads: one the run cannot write in
    (under a file here; a team's read-only cache, another user's HF_HOME) ended the run in `could not load the
    tokenizer of 'org/tiny' (NotADirectoryError: ...): a model folder needs its tokenizer files ... beside
    config.json`, naming a fix that was none (a Hub data set's in `NotADirectoryError`), and its dry run passed
    without a word. Both name the cache now."""
    hub.state.add_model_commit("org/tiny", {p.name: p.read_bytes() for p in Path(tiny_model_dir).iterdir()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": (ROOT / "data" / "smoke_prefs.jsonl").read_bytes()})
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = {"HF_HUB_CACHE": str(blocked / "hub")}
    line = (
        f"the Hub cache {blocked}/hub is not writable (Not a directory in {blocked}), and the job downloads there "
        "what it lacks (model 'org/tiny' is not cached; dataset 'org/prefs': not cached): set HF_HUB_CACHE (or "
        "HF_HOME) to a writable folder"
    )
    out = train_online(hub, tmp_path, tmp_path / "run", "org/tiny", env=env, exit_code=2)
    assert out.strip().splitlines()[-1] == f"error: {line}" and "Traceback" not in out, out[-3000:]
    out = train_online(hub, tmp_path, tmp_path / "dry", "org/tiny", "--dry-run", env=env)
    assert f"warning: the run would refuse: {line}" in out, out[-3000:]


def recorded_commit(out) -> str:
    return json.loads((out / "resolved_config.json").read_text())["derived"]["data_identity"]["hub_commit"]


@pytest.mark.slow
def test_a_run_resumed_after_the_data_sets_main_moved_trains_on_the_commit_it_started_on(hub, tmp_path, tiny_model_dir):
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:32]).encode()})  # 4 steps of 8
    one, run, stop = tmp_path / "one", tmp_path / "run", tmp_path / "stop"
    train_online(hub, tmp_path, one, tiny_model_dir)  # uninterrupted, on the first commit
    assert recorded_commit(one) == first
    stop.touch()  # preempted at step 1 (the reference is the uninterrupted run's, in the same cache)
    train_online(hub, tmp_path, run, tiny_model_dir, env={"DPOTRAIN_STOP_FILE": str(stop)}, exit_code=STOPPED_EXIT)
    stop.unlink()
    second = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[32:64]).encode()})  # main moves
    # Asked to go on with the new commit: other pairs than the checkpoint's, refused as changed data
    log = train_online(hub, tmp_path, run, tiny_model_dir, "--dataset_revision", second, exit_code=2)
    assert f"org/prefs at {second} is commit {second[:12]}, the run trained on commit {first[:12]}" in log, log

    shutil.copytree(run, tmp_path / "offline")  # the same stopped run, resumed below on a node without the Hub

    log = train_online(hub, tmp_path, run, tiny_model_dir)  # the requeue: the same command
    assert f"Resuming on org/prefs: commit {first[:12]}, the one this run started on (dataset_revision)" in log, log
    assert f"Resuming from {run}/checkpoint-1" in log
    assert recorded_commit(run) == first
    want, got = (read_metrics(d) for d in (one, run))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(want, got, strict=True))
    wa, wb = load_file(one / "model.safetensors"), load_file(run / "model.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-6
    # A new run takes main's new commit
    train_online(hub, tmp_path, tmp_path / "new", tiny_model_dir, "--max_steps", "2", "--save_strategy", "no")
    assert recorded_commit(tmp_path / "new") == second
    # Offline on a node whose data set cache lacks it: the refusal names prefetch.py with the run's folder, which, run
    # as printed, fetches the recorded commit into that cache (it named prefetch.py at main, which fetched main's)
    offline, stopped = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, tmp_path / "offline"
    fresh = {**offline, "HF_DATASETS_CACHE": str(tmp_path / "fresh")}
    log = train_online(hub, tmp_path, stopped, tiny_model_dir, env=fresh, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    words = shlex.split(error.split("On a login node with network, run: ")[1])
    assert words[1] == f"HF_DATASETS_CACHE={tmp_path / 'fresh'}" and words[-2:] == ["--output_dir", str(stopped)], error
    fetched = hub_script(hub, tmp_path, *words[3:], env=dict(w.split("=", 1) for w in words[:2]))
    assert f"dataset org/prefs@{first} split train: 32 rows -> {tmp_path / 'fresh'}" in fetched, fetched
    # Offline, datasets reads the copy it prepared last (the new commit's) whatever the revision: refused, not trained
    log = train_online(hub, tmp_path, stopped, tiny_model_dir, env=offline, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert f"error: org/prefs: the copy read is not commit {first[:12]}, which this run trains on (" in error, log
    # The command that fetches it, as it runs (it was `--config <recipe>`, a shell redirection when pasted): the run's
    # folder, whose record holds the commit, as a resumed mixture's refusal names it (it named `--revision <commit>`)
    fetch = error.split("fetch it where the Hub is reachable (")[1].split(": the commit the run's record holds)")[0]
    words = shlex.split(fetch)
    assert words[:2] == [f"HF_HOME={tmp_path / 'hf_home'}", f"HF_DATASETS_CACHE={tmp_path / 'datasets_cache'}"]
    assert words[2:6] == ["python", "scripts/prefetch.py", "--config", SMOKE[1]], fetch
    assert "--dataset_name org/prefs " in fetch and words[-2:] == ["--output_dir", str(stopped)], fetch
    # That command, where the Hub is reachable (its cache variables are the test's own), then the same offline job
    fetched = hub_script(hub, tmp_path, *words[3:])
    assert f"dataset org/prefs@{first} split train: 32 rows -> " in fetched, fetched
    log = train_online(hub, tmp_path, stopped, tiny_model_dir, env=offline)
    assert f"Resuming from {stopped}/checkpoint-1" in log, log
    assert recorded_commit(stopped) == first


@pytest.mark.slow
def test_a_resumed_mixture_reads_its_hub_sources_for_training_and_held_out_at_the_commits_it_started_on(
    hub, tmp_path, tiny_model_dir
):
    """A mixture's Hub source is read at the commit the run recorded, by every resume, as one Hub data set is: a push
    to its main after the run started changes nothing the run reads (it was refused, the run lost). A held-out
    mixture's Hub source is recorded and kept as a training source is: a resume after its main moved evaluates the
    pairs the run started with (it read main's new pairs, and the record held no commit for them). One run for both
    (each of its starts is a process of ~10 s)."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    held_first = hub.state.add_dataset_commit("org/held", {"test.jsonl": "".join(pairs[16:32]).encode()})
    local = tmp_path / "local.jsonl"
    local.write_text("".join(pairs[32:48]))
    mix = ["--dataset_name", "", "--dataset_mixer_list", "org/prefs", "1.0", str(local), "1.0"]
    mix += ["--dataset_mixer_eval_list", "org/held", "1.0", "--eval_strategy", "steps", "--eval_steps", "2"]
    run, stop = tmp_path / "run", tmp_path / "stop"
    # Its reference log-probs, cached for `run`: the reference stage alone (a stop file there before the run starts
    # would stop the stage itself), no training
    train_online(hub, tmp_path, tmp_path / "one", tiny_model_dir, *mix, "--reference_only", "true")
    stop.touch()  # preempted at step 1, after its checkpoint
    train_online(
        hub, tmp_path, run, tiny_model_dir, *mix, env={"DPOTRAIN_STOP_FILE": str(stop)}, exit_code=STOPPED_EXIT
    )
    assert (run / "checkpoint-1").is_dir()
    stop.unlink()
    shutil.copytree(run, tmp_path / "offline")  # the same stopped run, resumed below on a node without the Hub
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[48:72]).encode()})  # main: 24 other pairs
    hub.state.add_dataset_commit("org/held", {"test.jsonl": "".join(pairs[72:96]).encode()})  # main: 24 other pairs
    log = train_online(hub, tmp_path, run, tiny_model_dir, *mix)
    assert f"Resuming on mixture source org/prefs: commit {first[:12]}, the one this run started on\n" in log, log
    derived = json.loads((run / "resolved_config.json").read_text())["derived"]
    assert derived["dataset_rows"] == 32, derived["dataset_rows"]
    assert derived["data_sources"][0]["identity"] == {"revision": f"hub:org/prefs:default:train@{first}"}
    # The held-out source: the commit it started on, evaluated whole
    assert f"Resuming on mixture source org/held: commit {held_first[:12]}, the one this run started on\n" in log, log
    assert derived["eval_rows"] == 16, derived["eval_rows"]
    assert derived["eval_sources"][0]["identity"] == {"revision": f"hub:org/held:default:test@{held_first}"}

    # Offline, with main's new commit the copy datasets prepared last and the cache's refs/main (prefetch.py at main,
    # as the refusal below once said to run): the resume reads the commit its record holds, and that copy is refused,
    # not read as the newest copy cached, naming the command that fetches the recorded commit (it named prefetch.py at
    # main, which fetched this same copy again)
    hub_script(hub, tmp_path, "scripts/prefetch.py", *SMOKE, *mix)
    offline, stopped = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, tmp_path / "offline"
    log = train_online(hub, tmp_path, stopped, tiny_model_dir, *mix, env=offline, exit_code=2)
    assert f"Resuming on mixture source org/prefs: commit {first[:12]}, the one this run started on\n" in log, log
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert f"error: mixture source org/prefs [train]: the copy read is not commit {first[:12]}, " in error, log
    fetch = error.split("fetch the mixture's sources where the Hub is reachable (")[1].split(": each at main, ")[0]
    words = shlex.split(fetch)
    assert words[:2] == [f"HF_HOME={tmp_path / 'hf_home'}", f"HF_DATASETS_CACHE={tmp_path / 'datasets_cache'}"]
    assert words[2:4] == ["python", "scripts/prefetch.py"] and words[-2:] == ["--output_dir", str(stopped)], fetch
    # That command, where the Hub is reachable (its cache variables are the test's own), then the same offline job
    fetched = hub_script(hub, tmp_path, *words[3:])
    assert f"dataset org/prefs@{first} split train: 16 rows -> " in fetched, fetched
    log = train_online(hub, tmp_path, stopped, tiny_model_dir, *mix, env=offline)
    assert f"Resuming from {stopped}/checkpoint-1" in log, log
    derived = json.loads((stopped / "resolved_config.json").read_text())["derived"]
    assert derived["dataset_rows"] == 32, derived["dataset_rows"]
    assert derived["data_sources"][0]["identity"] == {"revision": f"hub:org/prefs:default:train@{first}"}


@pytest.mark.slow
def test_the_preflight_scores_the_pinned_commit_and_caches_its_lengths_under_it(hub, tmp_path, tiny_model_dir):
    """`--preflight --dataset_revision X --max_length auto` goes through the run's own data and lengths stages: it
    scores X's pairs, not main's, and the lengths it caches for X's key are X's (it read main's pairs and cached them
    under X's key when it loaded its data by a path of its own)."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:32]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[32:96]).encode()})  # main: 64 other pairs
    cache, report = tmp_path / "cache", tmp_path / "preflight.json"
    online = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    online.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(tmp_path / "hf_home"),
        HF_TOKEN="",
        DPOTRAIN_CACHE=str(cache),
        HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
    )
    args = [
        *SMOKE,
        "--dataset_name",
        "org/prefs",
        "--dataset_revision",
        first,
        "--max_length",
        "auto",
        "--json",
        str(report),
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path / "unused"),
    ]
    result = subprocess.run(
        [python(), str(ROOT / "scripts" / "preflight.py"), *args],
        cwd=ROOT,
        env=online,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 3), result.stdout[-3000:]  # 3: a verdict of "fail" on the tiny random model
    scored = json.loads(report.read_text())
    assert scored["quality_rows"] == 32 and scored["max_length"] != "auto", scored
    (cached,) = [json.loads(p.read_text()) for p in (cache / "lengths").glob("*.json")]
    assert first in json.dumps(cached["cache"]) and cached["rows"] == 32, cached


@pytest.mark.slow  # a process of its own
def test_a_first_dry_run_on_a_mixture_with_an_uncached_hub_source_passes(hub, tmp_path):
    """A mixture's Hub source, not yet in this machine's cache: its commit, looked up in the cache before the read, was
    its revision's name (`main`) and after the read the commit, so the first dry run was refused as data that changed
    while the run read it (a second one passed). The run resolves the source's commit once and reads it there."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    mixed = ["--dataset_name", "", "--dataset_mixer_list", "org/prefs", "1.0", "--dry-run", "--json"]
    shown = train_online(hub, tmp_path, tmp_path / "out", "builtin:tiny-olmo3", *mixed)
    assert json.JSONDecoder().raw_decode(shown[shown.index("{\n") :])[0]["derived"]["dataset_rows"] == 16


def dry_run_rows(shown: str) -> int:
    return json.JSONDecoder().raw_decode(shown[shown.index("{\n") :])[0]["derived"]["dataset_rows"]


@pytest.mark.slow  # processes of their own
def test_an_offline_mixture_source_whose_cache_last_prepared_another_commit_is_refused(hub, tmp_path):
    """Offline, datasets reads the copy of a data set it prepared last, whatever commit is asked (huggingface/datasets
    issue 7928). A mixture's Hub source is pinned offline to the commit the cache's refs/main names (prefetch.py
    fetched main), but a dry run on the login node since read main's next commit by its sha, which moves no ref: the
    offline job read that commit's 32 pairs as the pinned commit's 16, silently, and the analyzer cached their lengths
    under the pinned commit's key (given the data set alone at that commit, by --revision, too). All are refused with
    one line naming the prefetch command, which, run as printed, makes main the copy read and pinned again."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    mixed = ["--dataset_name", "", "--dataset_mixer_list", "org/prefs", "1.0"]
    hub_script(hub, tmp_path, "scripts/prefetch.py", *SMOKE, *mixed)  # refs/main: the first commit
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})
    dry = [*mixed, "--dry-run", "--json"]
    assert dry_run_rows(train_online(hub, tmp_path, tmp_path / "out", "builtin:tiny-olmo3", *dry)) == 32

    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    log = train_online(hub, tmp_path, tmp_path / "out", "builtin:tiny-olmo3", *dry, env=offline, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert f"error: mixture source org/prefs [train]: the copy read is not commit {first[:12]}, " in error, log
    fetch = error.split("fetch the mixture's sources where the Hub is reachable (")[1].split(": each at main, ")[0]
    words = shlex.split(fetch)
    assert words[:2] == [f"HF_HOME={tmp_path / 'hf_home'}", f"HF_DATASETS_CACHE={tmp_path / 'datasets_cache'}"]
    assert words[2:] == ["python", "scripts/prefetch.py", *SMOKE, *mixed, "--output_dir", str(tmp_path / "out")], fetch

    analyze = [*SMOKE, "--dataset_mixer_list", "org/prefs", "1.0"]  # the analyzer, reading the same source offline
    log = hub_script(hub, tmp_path, "scripts/analyze_dataset.py", *analyze, env=offline, exit_code=2)
    assert f"error: mixture source org/prefs [train]: the copy read is not commit {first[:12]}, " in log, log
    # The data set alone at that commit (--revision): it measured main's copy and cached it under the commit's key
    analyze = [*SMOKE, "--dataset_name", "org/prefs", "--revision", first]
    log = hub_script(hub, tmp_path, "scripts/analyze_dataset.py", *analyze, env=offline, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert f"error: org/prefs: the copy read is not commit {first[:12]}, " in error, log
    assert error.endswith(f" --revision {first})"), error  # no run to start anew
    # The data set alone, no --revision: the run pins it to refs/main's commit and refuses this copy; the analyzer read
    # it unpinned, measured the 32 pairs and cached them under that commit's key (a dry run then showed 32 pairs)
    analyze = [*SMOKE, "--dataset_name", "org/prefs"]
    log = hub_script(hub, tmp_path, "scripts/analyze_dataset.py", *analyze, env=offline, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert f"error: org/prefs: the copy read is not commit {first[:12]}, " in error, log
    assert not (tmp_path / "cache" / "lengths").exists()

    hub_script(hub, tmp_path, words[3], *words[4:])  # the command as printed (its caches are this test's)
    shown = train_online(hub, tmp_path, tmp_path / "out", "builtin:tiny-olmo3", *dry, env=offline)
    assert dry_run_rows(shown) == 32  # main's commit, pinned and read


@pytest.mark.slow  # processes of their own
def test_an_offline_held_out_source_whose_cache_last_prepared_another_commit_is_refused_as_evaluated_on(hub, tmp_path):
    """A held-out mixture's Hub source read offline from another commit's copy is refused as a training source is, and
    said of what the run does with it: it evaluates on those pairs (the refusal said "trains on")."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/held", {"test.jsonl": "".join(pairs[:16]).encode()})
    held = ["--dataset_name", str(ROOT / "data" / "smoke_prefs.jsonl"), "--dataset_mixer_eval_list", "org/held", "1.0"]
    hub_script(hub, tmp_path, "scripts/prefetch.py", *SMOKE, *held)  # refs/main: the first commit
    hub.state.add_dataset_commit("org/held", {"test.jsonl": "".join(pairs[16:48]).encode()})
    dry = [*held, "--eval_strategy", "steps", "--eval_steps", "2", "--dry-run", "--json"]
    train_online(hub, tmp_path, tmp_path / "out", "builtin:tiny-olmo3", *dry)  # main's next commit, read by its sha
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    log = train_online(hub, tmp_path, tmp_path / "out", "builtin:tiny-olmo3", *dry, env=offline, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    read = f"error: mixture source org/held [test]: the copy read is not commit {first[:12]}, "
    assert error.startswith(f"{read}which this run evaluates on ("), log


# The data stage of an offline job on a shared cache, into which a login node's prefetch.py of another commit finishes
# while the job checks the training pairs: its last act (os.utime) makes that commit's copy the one datasets reads
# next, the test split's (argv: that copy, then the job's arguments). Before the check's end, the check's own writes
# (datasets' cache files beside the copy read) would make the job's copy the newest again. A bare utime is not enough:
# the kernel stamps times from a coarse clock, so the touch and the check's last cache file can share a stamp, and then
# the directory listing's order chose (seen in CI); the touch is repeated until its stamp is past every other copy's.
RACED_JOB = """
import glob, os, sys, time
sys.path.insert(0, os.getcwd())  # the project's folder (hub_script's cwd), not this file's
from dpotrain import stages
from dpotrain.data import rows
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import run_command
check = rows.usable_pairs

def check_while_prefetch_ends(dataset, *args, **kwargs):
    usable = check(dataset, *args, **kwargs)
    if len(dataset) == 16:  # the training pairs'
        others = [c for c in glob.glob(os.path.join(os.path.dirname(sys.argv[1]), "*")) if c != sys.argv[1]]
        os.utime(sys.argv[1])
        while os.stat(sys.argv[1]).st_mtime_ns <= max(os.stat(c).st_mtime_ns for c in others):
            time.sleep(0.01)
            os.utime(sys.argv[1])
    return usable

def main():
    rows.usable_pairs = check_while_prefetch_ends
    recipe = parse_args(sys.argv[2:])
    print("eval rows:", stages.load_data(recipe, stages.checks(recipe), say=False).checked["eval_rows"])

run_command(main)
"""


@pytest.mark.slow  # processes of their own
def test_an_offline_test_split_read_from_another_commits_copy_is_refused_as_evaluated_on(hub, tmp_path, tiny_model_dir):
    """dataset_name's test split is checked as its training split is: offline, datasets reads whichever copy it
    prepared last, and the training split's check cannot vouch for the test split's read, which may find another copy
    (one prepared in between). Refused as evaluated on, naming the command that fetches the commit; without that check
    the run evaluated on the other commit's 12 held-out pairs as the pinned commit's 8."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    train = "".join(pairs[:16]).encode()
    first = hub.state.add_dataset_commit(
        "org/prefs", {"train.jsonl": train, "test.jsonl": "".join(pairs[16:24]).encode()}
    )
    second = hub.state.add_dataset_commit(
        "org/prefs", {"train.jsonl": train, "test.jsonl": "".join(pairs[24:36]).encode()}
    )
    fetch = [*SMOKE, "--dataset_name", "org/prefs", "--model_name_or_path", tiny_model_dir, "--revision"]
    for commit in (second, first):  # each copy prepared, the pinned commit's last: the one an offline job reads
        fetched = hub_script(hub, tmp_path, "scripts/prefetch.py", *fetch, commit)
        assert f"dataset org/prefs@{commit} split train: 16 rows -> " in fetched, fetched
    copies = tmp_path / "datasets_cache" / "org___prefs" / "default" / "0.0.0"
    job = [*fetch[:-1], "--dataset_revision", first, "--output_dir", str(tmp_path / "out"), "--eval_strategy", "steps"]
    (tmp_path / "job.py").write_text(RACED_JOB)
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log = hub_script(hub, tmp_path, str(tmp_path / "job.py"), str(copies / second), *job, env=offline, exit_code=2)
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    read = (
        f"error: org/prefs: the copy read is not commit {first[:12]}, which this run evaluates on ({copies / second})"
    )
    assert error.startswith(read), log
    assert error.endswith(f" --dataset_revision {first} --output_dir {tmp_path / 'out'} --revision {first})"), error
    # That command, as printed, where the Hub is reachable (its cache variables are the test's own); then the job,
    # with no other copy prepared during it, evaluates on the pinned commit's 8 held-out pairs
    words = shlex.split(error.split("fetch that commit where the Hub is reachable (")[1][:-1])
    assert words[2:4] == ["python", "scripts/prefetch.py"], words
    hub_script(hub, tmp_path, *words[3:])
    log = hub_script(hub, tmp_path, str(tmp_path / "job.py"), str(copies / first), *job, env=offline)
    assert "eval rows: 8\n" in log, log


def job_record(args: list[str], commit: str) -> dict:
    """resolved_config.json as the job run with `args` writes it, its data read at `commit`: a record whose run the job
    resumes (resolve.check_output_dir compares the settings, pairs per step included)."""
    from dpotrain import resolve, stages
    from dpotrain.recipe import run_record
    from dpotrain.recipe.config import parse_args

    recipe = parse_args([*args, "--dry-run"])
    derived = {"pairs_per_step": stages.checks(recipe).batch.pairs_per_step, "data_identity": {"hub_commit": commit}}
    return run_record.sealed(resolve.resolved_config(recipe, derived))


@pytest.mark.slow  # a process of its own
def test_prefetch_given_a_stopped_runs_folder_fetches_the_commit_its_record_holds_for_dataset_name(hub, tmp_path):
    """`prefetch.py --output_dir RUN` fetches what the resume reads: a mixture's recorded commits, and a single Hub
    data set's too (it fetched main, the copy an offline resume then refused, naming `--revision <commit>`)."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})  # main moved on
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps({"derived": {"data_identity": {"hub_commit": first}}}))
    fetched = hub_script(
        hub, tmp_path, "scripts/prefetch.py", *SMOKE, "--dataset_name", "org/prefs", "--output_dir", str(run)
    )
    assert f"dataset org/prefs@{first} split train: 16 rows -> " in fetched, fetched
    assert "Ready: a job with HF_HUB_OFFLINE=1" in fetched, fetched


@pytest.mark.slow  # a process of its own
def test_prefetch_given_a_stopped_runs_folder_whose_record_was_edited_fetches_the_commit_its_checkpoint_holds(
    hub, tmp_path
):
    """The run's resolved_config.json "fixed" by hand: its resume reads the checkpoint's own copy
    (resolve.trained_under) and loads the commit the run started on, but prefetch.py read the edited file as none
    (hub_revision.record) and fetched main, as for a new run: the offline resume then refused its cache. It reads the
    run as written too."""
    from conftest import sealed_checkpoint

    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})  # main moved on
    run = tmp_path / "run"
    args = [*SMOKE, "--dataset_name", "org/prefs", "--output_dir", str(run)]
    written = job_record(args, first)
    for folder in (run, sealed_checkpoint(run / "checkpoint-4")):  # as a run writes them: a copy in each checkpoint
        (folder / "resolved_config.json").write_text(json.dumps(written))
    (run / "resolved_config.json").write_text(json.dumps(written | {"learning_rate": 2e-4}))
    fetched = hub_script(hub, tmp_path, "scripts/prefetch.py", *args)
    assert f"dataset org/prefs@{first} split train: 16 rows -> " in fetched, fetched


@pytest.mark.slow  # a process of its own
def test_prefetch_with_overwrite_output_dir_fetches_what_the_run_resumes_on(hub, tmp_path):
    """`--overwrite_output_dir` over an unfinished run with a complete checkpoint and the same settings: the run
    resumes it, on the commit its record holds (resolve.check_output_dir), but prefetch.py took the flag for a fresh
    start and fetched main, the copy the offline resume then refused. It decides as the run does (one function)."""
    from conftest import sealed_checkpoint
    from dpotrain import resolve, stages
    from dpotrain.recipe.config import parse_args

    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})  # main moved on
    run = tmp_path / "run"
    args = [*SMOKE, "--dataset_name", "org/prefs", "--output_dir", str(run), "--overwrite_output_dir", "true"]
    for folder in (run, sealed_checkpoint(run / "checkpoint-4")):
        (folder / "resolved_config.json").write_text(json.dumps(job_record(args, first)))
    recipe = parse_args([*args, "--dry-run"])
    decided = resolve.check_output_dir(recipe, stages.checks(recipe).batch.pairs_per_step)
    assert decided.resume_from == str(run / "checkpoint-4") and not decided.start_afresh  # the run resumes it
    fetched = hub_script(hub, tmp_path, "scripts/prefetch.py", *args)
    assert f"dataset org/prefs@{first} split train: 16 rows -> " in fetched, fetched
    # What it assumed, as it cannot tell: the job's other settings may make it start afresh
    assert f"The job resumes the run in {run}, where its settings are that run's (with other settings" in fetched


@pytest.mark.slow  # a process of its own
def test_prefetch_reads_the_stopped_run_in_the_recipes_own_output_dir_untyped(hub, tmp_path):
    """A recipe that sets output_dir (as outputs/<run_name> is the default's): the job run again resumes the stopped
    run there, on the commit its record holds, but prefetch.py decided so only for an --output_dir typed on its command
    line, and fetched main, the copy the offline resume then refused. It decides on the folder the job uses."""
    from conftest import sealed_checkpoint

    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})  # main moved on
    run = tmp_path / "run"
    own = tmp_path / "my_recipe.yaml"
    own.write_text((ROOT / "configs" / "smoke.yaml").read_text() + f"output_dir: {run}\n")
    args = ["--config", str(own), "--dataset_name", "org/prefs"]
    for folder in (run, sealed_checkpoint(run / "checkpoint-4")):
        (folder / "resolved_config.json").write_text(json.dumps(job_record(args, first)))
    fetched = hub_script(hub, tmp_path, "scripts/prefetch.py", *args)
    assert f"dataset org/prefs@{first} split train: 16 rows -> " in fetched, fetched


@pytest.mark.slow  # a process of its own
def test_prefetch_fetches_main_past_a_finished_run_in_the_recipes_untyped_folder(hub, tmp_path):
    """The recipe's folder, untyped, holding a finished run (`bash scripts/demo.sh` leaves outputs/smoke-dpo so): a
    job without --output_dir is refused there, so the job that reads the data names another folder, a new run's.
    prefetch.py refused the folder, and left nothing fetched for that job; it says so in one line and fetches main."""
    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})  # main: 32 pairs
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "run_complete.json").write_text(json.dumps({"global_step": 8}))
    own = tmp_path / "my_recipe.yaml"
    own.write_text((ROOT / "configs" / "smoke.yaml").read_text() + f"output_dir: {finished}\n")
    fetched = hub_script(hub, tmp_path, "scripts/prefetch.py", "--config", str(own), "--dataset_name", "org/prefs")
    said = f"note: a job without --output_dir would be refused (output_dir '{finished}' already holds a finished run"
    assert said in fetched and "fetching for a new run, as a job given another --output_dir" in fetched, fetched
    assert "dataset org/prefs@main split train: 32 rows -> " in fetched, fetched


def test_the_prefetch_command_a_job_prints_names_the_folder_it_was_given(tmp_path):
    """prefetch.py decides on the job's folder, the recipe's where it is given none: the command an offline job
    printed named no --output_dir for a new run's folder, so a stopped run in the recipe's folder had its commits
    fetched, and the new job refused that copy again with the same command."""
    from dpotrain.cluster import offline

    job = parse_args([*SMOKE, "--dataset_name", "org/prefs", "--output_dir", str(tmp_path / "new")])
    assert offline.prefetch_command(job).endswith(f"--dataset_name org/prefs --output_dir {tmp_path / 'new'}")
    untyped = parse_args([*SMOKE, "--dataset_name", "org/prefs"])
    assert offline.prefetch_command(untyped).endswith("--dataset_name org/prefs")  # the recipe's, where prefetch looks


def test_prefetch_reads_an_untyped_relative_output_dir_in_the_project_where_the_job_runs(tmp_path, monkeypatch):
    """outputs/<run_name> (or a recipe's relative output_dir) is the project's in a Slurm job (scripts/launch.sh runs
    it there); prefetch.py typed in another folder reads that one, and a folder typed where it is typed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefetch", ROOT / "scripts" / "prefetch.py")
    prefetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefetch)
    monkeypatch.delenv("DPOTRAIN_SUBMIT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    untyped = parse_args([*SMOKE, "--dry-run"])
    assert prefetch.job_folder(untyped, SMOKE).training.output_dir == str(ROOT / "outputs" / "smoke-dpo")
    typed = ["--output_dir", "mine"]
    assert prefetch.job_folder(parse_args([*SMOKE, *typed, "--dry-run"]), typed).training.output_dir == "mine"


def test_a_checkpoint_resumed_into_a_folder_overwritten_reads_the_commits_its_record_holds(tmp_path):
    """--overwrite_output_dir over a finished run, with --resume_from_checkpoint from elsewhere: the run resumes that
    checkpoint's weights, optimizer and step, as any resume of it, but read its data at main (the folder is replaced,
    start_afresh), other pairs than the steps it skips were cut from. It reads the commit the checkpoint's record holds,
    as every other resume of it does; the flag replaces the folder, not the checkpoint's data."""
    from conftest import sealed_checkpoint
    from dpotrain import resolve, stages
    from dpotrain.cluster import offline

    checkpoint = sealed_checkpoint(tmp_path / "kept" / "checkpoint-4")
    out = tmp_path / "finished"
    out.mkdir()
    (out / "run_complete.json").write_text(json.dumps({"global_step": 8}))
    args = [*SMOKE, "--dataset_name", "org/prefs", "--output_dir", str(out)]
    args += ["--resume_from_checkpoint", str(checkpoint), "--overwrite_output_dir", "true"]
    (checkpoint / "resolved_config.json").write_text(json.dumps(job_record(args, FIRST)))
    r = parse_args(args)
    launch = stages.checks(r)
    decided = resolve.check_output_dir(r, launch.batch.pairs_per_step)
    assert decided.resume_from == str(checkpoint) and decided.start_afresh  # folder replaced, checkpoint resumed
    assert resolve.continued_record(decided, str(out)) == str(checkpoint)  # prefetch.py's folder of commits too
    assert hub_revision.kept(r, resolve.continued_record(decided, str(out))) == FIRST
    # The prefetch command an offline refusal names decides the same: with the flag, which the folder needs
    command = offline.prefetch_command(r, str(out))
    assert command.endswith(f"--output_dir {out} --resume_from_checkpoint {checkpoint} --overwrite_output_dir true")


@pytest.mark.slow  # a process of its own
def test_prefetch_given_a_checkpoint_to_resume_fetches_the_commit_its_record_holds(hub, tmp_path):
    """`--resume_from_checkpoint CKPT` (a checkpoint copied out of its run, resumed into a new folder): the resume
    loads the commit its own record copy holds (resolve.trained_under), but prefetch.py read --output_dir alone and
    fetched main, as for a new run: the offline resume then refused its cache."""
    from conftest import sealed_checkpoint

    pairs = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    first = hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[:16]).encode()})
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": "".join(pairs[16:48]).encode()})  # main moved on
    checkpoint = sealed_checkpoint(tmp_path / "kept" / "checkpoint-4")  # its run's folder gone: its copy alone
    resume = ("--resume_from_checkpoint", str(checkpoint), "--output_dir", str(tmp_path / "new"))
    written = job_record([*SMOKE, "--dataset_name", "org/prefs", *resume], first)
    (checkpoint / "resolved_config.json").write_text(json.dumps(written))
    fetched = hub_script(hub, tmp_path, "scripts/prefetch.py", *SMOKE, "--dataset_name", "org/prefs", *resume)
    assert f"dataset org/prefs@{first} split train: 16 rows -> " in fetched, fetched
    # A word, not a checkpoint: refused as the run refuses it, naming what to pass, before anything downloads
    refused = hub_script(
        hub, tmp_path, "scripts/prefetch.py", *SMOKE, "--dataset_name", "org/prefs", "--resume_from_checkpoint",
        "true", exit_code=2,
    )  # fmt: skip
    assert refused.startswith("error: resume_from_checkpoint 'true' is not a folder: it names a checkpoint-N"), refused


@pytest.mark.slow
def test_a_merge_loads_the_hub_base_at_the_commit_the_run_trained_on(hub, tmp_path, tiny_model_dir):
    """merge_lora true on a Hub base merged into the base at main's newest commit: an upload to main during training
    (the SFT model pushed again) gave a merged model of weights the adapter never trained on, and exit 0. The merge
    loads the base at the commit the run recorded (resolved_config.json's model_identity)."""
    import signal

    import torch
    from safetensors.torch import save_file

    from conftest import PAUSE_AT, pause_env, paused_pid

    files = {p.name: p.read_bytes() for p in Path(tiny_model_dir).iterdir() if p.is_file()}
    first = hub.state.add_model_commit("org/tiny", files)
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": (ROOT / "data" / "smoke_prefs.jsonl").read_bytes()})
    out, paused = tmp_path / "run", tmp_path / "paused"
    online = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    online.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_TOKEN="")
    online.update(HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"))
    online.update(pause_env("*/resolved_config.json", "*metrics.jsonl", paused))  # loaded, recorded, not trained
    args = [*SMOKE, "--dataset_name", "org/prefs", "--model_name_or_path", "org/tiny", "--output_dir", str(out)]
    args += ["--max_steps", "2", "--save_strategy", "no", "--report_to", "none", "--use_peft", "true"]
    args += ["--lora_target_modules", "q_proj", "--merge_lora", "true"]
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *args],
        cwd=ROOT,
        env=online,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pid = paused_pid(paused, proc)
        weights = {k: v + 1 for k, v in load_file(Path(tiny_model_dir) / "model.safetensors").items()}
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
        hub.state.add_model_commit(
            "org/tiny", files | {"model.safetensors": (tmp_path / "model.safetensors").read_bytes()}
        )
        os.kill(pid, signal.SIGCONT)
        log = proc.communicate(timeout=600)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["model_identity"]["hub_commit"] == first
    base, merged = (
        load_file(Path(tiny_model_dir) / "model.safetensors"),
        load_file(out / "merged" / "model.safetensors"),
    )
    assert all(torch.equal(base[n], merged[n]) for n in base if "q_proj" not in n)


@pytest.mark.slow
def test_a_lora_run_on_a_model_revision_records_it_in_every_adapter_config(hub, tmp_path, tiny_model_dir):
    """With --model_revision R, PEFT wrote no revision into adapter_config.json: loading the adapter as the model card
    says (AutoPeftModelForCausalLM) put it on the base's main, not on the weights it trained on. Every adapter saved
    (each checkpoint's, the final one) names R."""
    files = {p.name: p.read_bytes() for p in Path(tiny_model_dir).iterdir() if p.is_file()}
    first = hub.state.add_model_commit("org/tiny", files)
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": (ROOT / "data" / "smoke_prefs.jsonl").read_bytes()})
    out = tmp_path / "run"
    lora = ["--max_steps", "2", "--use_peft", "true", "--lora_target_modules", "q_proj", "--model_revision", first]
    train_online(hub, tmp_path, out, "org/tiny", *lora)
    for folder in (out, out / "checkpoint-1", out / "checkpoint-2"):
        assert json.loads((folder / "adapter_config.json").read_text())["revision"] == first, folder


@pytest.mark.slow
def test_a_hub_repo_holding_only_an_adapter_is_refused_naming_its_base(hub, tmp_path, lora_adapter):
    """`--model_name_or_path org/adapter`, a Hub repo holding a LoRA adapter alone (no config.json), ended in a
    traceback; a local adapter folder was refused in one line naming its base. The Hub repo is refused so too."""
    hub.state.add_model_commit("org/adapter", lora_adapter)
    hub.state.add_dataset_commit("org/prefs", {"train.jsonl": (ROOT / "data" / "smoke_prefs.jsonl").read_bytes()})
    log = train_online(hub, tmp_path, tmp_path / "run", "org/adapter", exit_code=2)
    line = log.strip().splitlines()[-1]
    assert "Traceback" not in log and line.startswith("error: model 'org/adapter' holds a LoRA adapter"), log[-3000:]
    assert "start from its base model (org/tiny) with --use_peft true for a new adapter" in line, line


@pytest.fixture
def lora_adapter(tiny_model_dir) -> dict:
    """A LoRA run's pushed files: its adapter (adapter_config.json naming the base org/tiny, its weights) and the
    tokenizer, no config.json."""
    config = {"peft_type": "LORA", "base_model_name_or_path": "org/tiny", "r": 8, "target_modules": ["q_proj"]}
    files = {p.name: p.read_bytes() for p in Path(tiny_model_dir).iterdir() if p.is_file() and "config" not in p.name}
    files = {n: b for n, b in files.items() if not n.endswith(".safetensors")}  # the tokenizer and its template
    return files | {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": b"weights"}


def test_prefetch_after_the_demo_says_nothing_to_fetch_without_a_note_on_the_folder(tmp_path, capsys):
    """prefetch.py --config configs/smoke.yaml after `bash scripts/demo.sh` (a finished run in the recipe's folder)
    printed "note: not the job's folder without --output_dir (... pass --output_dir for a new run, or
    --overwrite_output_dir to replace it): fetching as for a new run", then "Nothing to fetch": a fix for a fetch that
    never happens. With local model and data the folder decides nothing, and only "Nothing to fetch" is said."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefetch", ROOT / "scripts" / "prefetch.py")
    prefetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefetch)
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "run_complete.json").write_text(json.dumps({"global_step": 8}))
    own = tmp_path / "my_recipe.yaml"
    own.write_text((ROOT / "configs" / "smoke.yaml").read_text() + f"output_dir: {finished}\n")
    prefetch.main(["--config", str(own)])
    said = capsys.readouterr().out
    assert "note:" not in said and said.strip().startswith("Nothing to fetch: builtin:tiny-olmo3"), said

"""The Hub stand-in serves data set repos that the real `datasets` and huggingface_hub read at a revision.

A data set repo gets two commits of a small JSON Lines preference file; a subprocess with a fresh HF_HOME and
HF_DATASETS_CACHE, HF_ENDPOINT at the stand-in and neither offline switch set (huggingface_hub reads them at import)
loads it by its first commit's sha and by `main`, as `datasets.load_dataset` and as this project's loader do, and asks
`HfApi().dataset_info` and `dataset_identity` which commit `main` is.
"""

import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import PYTHON, ROOT
from hub_server import StandInHub

REPO = "org/prefs"


def jsonl(rows: list[tuple[str, str]]) -> bytes:
    return b"".join(json.dumps({"chosen": c, "rejected": r}).encode() + b"\n" for c, r in rows)


FIRST = [("The sky is blue.", "The sky is green."), ("2 + 2 = 4", "2 + 2 = 5"), ("Paris", "Lyon")]
SECOND = [("Water boils at 100 C.", "Water boils at 50 C."), ("Yes.", "No."), ("Oslo", "Bergen"), ("a", "b")]


@pytest.fixture
def hub():
    server = StandInHub()
    yield server
    server.close()


@pytest.fixture
def commits(hub) -> tuple[str, str]:
    first = hub.state.add_dataset_commit(REPO, {"train.jsonl": jsonl(FIRST)})
    second = hub.state.add_dataset_commit(REPO, {"train.jsonl": jsonl(SECOND)})
    return first, second


def run_online(hub, tmp_path, code: str) -> dict:
    """`code` run in a fresh Python against the stand-in; it prints one JSON object, returned here."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(tmp_path / "hf_home"),
        HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
        HF_TOKEN="",
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [PYTHON, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def pairs(rows: dict) -> list[tuple[str, str]]:
    return list(zip(rows["chosen"], rows["rejected"], strict=True))


@pytest.mark.slow
def test_load_dataset_reads_a_commit_by_sha_and_main_at_its_head(hub, commits, tmp_path):
    first, second = commits
    seen = run_online(
        hub,
        tmp_path,
        f"""
import json, datasets, huggingface_hub
print(json.dumps({{
    "first": datasets.load_dataset("{REPO}", revision="{first}", split="train")[:],
    "main": datasets.load_dataset("{REPO}", revision="main", split="train")[:],
    "default": datasets.load_dataset("{REPO}", split="train")[:],
    "sha": huggingface_hub.HfApi().dataset_info("{REPO}").sha,
    "sha_first": huggingface_hub.HfApi().dataset_info("{REPO}", revision="{first}").sha,
}}))
""",
    )
    assert pairs(seen["first"]) == FIRST
    assert pairs(seen["main"]) == pairs(seen["default"]) == SECOND
    assert (seen["sha"], seen["sha_first"]) == (second, first)

    # Every request was one the stand-in knows; the data file was read at each commit, once each.
    asked = hub.state.project_requests()
    assert not [r for r in asked if r["kind"] == "unknown"], asked
    fetched = [r["revision"] for r in hub.state.of("dataset_file") if r["method"] == "GET"]
    assert fetched == [first, second], fetched
    assert all(r["auth"] is None for r in asked)  # HF_TOKEN="": no token sent, none needed


@pytest.mark.slow
def test_the_projects_loader_and_identity_read_a_hub_data_set_at_a_revision(hub, commits, tmp_path):
    first, second = commits
    seen = run_online(
        hub,
        tmp_path,
        f"""
import json
from dpotrain.data.data import load_preference_dataset
from dpotrain.data.lengths import dataset_identity
stream = load_preference_dataset("{REPO}", "train", None, revision="{first}", streaming=True)
print(json.dumps({{
    "first": load_preference_dataset("{REPO}", "train", None, revision="{first}")[:],
    "main": load_preference_dataset("{REPO}", "train", None)[:],
    "streamed": [[row["chosen"], row["rejected"]] for row in stream],
    "identity": dataset_identity("{REPO}"),
    "identity_first": dataset_identity("{REPO}", revision="{first}"),
}}))
""",
    )
    assert pairs(seen["first"]) == FIRST
    assert pairs(seen["main"]) == SECOND
    assert [tuple(p) for p in seen["streamed"]] == FIRST
    assert seen["identity"] == f"hub:{REPO}:default:train@{second}"
    assert seen["identity_first"] == f"hub:{REPO}:default:train@{first}"
    asked = hub.state.project_requests()
    assert not [r for r in asked if r["kind"] == "unknown"], asked


def test_files_answer_head_and_byte_ranges_and_unknown_revisions_are_refused(hub, commits):
    first, _ = commits
    url = f"{hub.endpoint}/datasets/{REPO}/resolve/{first}/train.jsonl"
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD")) as head:
        assert head.headers["X-Repo-Commit"] == first
        assert int(head.headers["Content-Length"]) == len(jsonl(FIRST)) and head.read() == b""
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=2-9"})) as part:
        assert (part.status, part.read()) == (206, jsonl(FIRST)[2:10])
        assert part.headers["Content-Range"] == f"bytes 2-9/{len(jsonl(FIRST))}"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{hub.endpoint}/datasets/{REPO}/resolve/{'0' * 40}/train.jsonl")
    assert (missing.value.code, missing.value.headers["X-Error-Code"]) == (404, "RevisionNotFound")


@pytest.mark.slow
def test_a_mixtures_hub_source_is_read_and_known_at_the_commit_it_was_pinned_to(hub, commits, tmp_path):
    """mixture.pin resolves a Hub source's main once; the source is read at that commit and known by it before and
    after the read, whatever main is by then (here it is another commit): a first read on an empty cache was refused
    as data that changed while it was read, its commit unknown before the read and known after."""
    first, second = commits
    seen = run_online(
        hub,
        tmp_path,
        f"""
import json
from dpotrain.data import mixture
from dpotrain.recipe.config import parse_args
recipe = parse_args(["--config", "{ROOT / "configs" / "smoke.yaml"}", "--output_dir", "{tmp_path / "out"}",
                     "--dataset_name", "", "--dataset_mixer_list", "{REPO}", "1.0"])
plain = mixture.Source("{REPO}", "train")
files = mixture.Source("{REPO}", "train", data_files="train.jsonl")
pins = {{"{REPO}": "{first}"}}
before = mixture.dataset_id(recipe, local_only=True, pins=pins)  # a dry run's: the cache holds nothing yet
print(json.dumps({{
    "pin": mixture.pin([plain, files, mixture.Source("data/smoke_prefs.jsonl", "train")]),
    "plain": mixture.read_source(plain, say=False, revision="{first}")[:],
    "files": mixture.read_source(files, say=False, revision="{first}")[:],
    "same_key": mixture.dataset_id(recipe, local_only=True, pins=pins) == before,
    "identity": mixture.identity_of(plain, "{first}"),
}}))
""",
    )
    assert seen["pin"] == {REPO: second}  # main now; a local source has no commit
    assert pairs(seen["plain"]) == pairs(seen["files"]) == FIRST  # the pinned commit's rows, not main's
    assert seen["same_key"]
    assert seen["identity"] == {"revision": f"hub:{REPO}:default:train@{first}"}

"""A Hub data set is trained at one commit (dpotrain/data/hub_revision.py): resolved when the run first starts,
recorded, and loaded again by every resume wherever `main` has moved; `dataset_revision` pins it by hand."""

import json

import pytest

from conftest import ROOT
from dpotrain.data import hub_revision
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]
FIRST, SECOND = "1" * 40, "2" * 40


def recipe(*args):
    return parse_args([*SMOKE, "--output_dir", "/tmp/unused", *args])


def test_a_resumed_run_keeps_the_commit_it_started_on(tmp_path):
    (tmp_path / "resolved_config.json").write_text(json.dumps({"derived": {"data_identity": {"hub_commit": FIRST}}}))
    r = recipe("--dataset_name", "org/prefs")
    assert hub_revision.keep(r, str(tmp_path)) == f"org/prefs: commit {FIRST[:12]}, the one this run started on " \
        "(dataset_revision)"  # fmt: skip
    assert r.project.dataset_revision == FIRST
    # A revision given by hand is the user's: kept as given (its commit is compared with the record instead)
    given = recipe("--dataset_name", "org/prefs", "--dataset_revision", SECOND)
    assert hub_revision.keep(given, str(tmp_path)) is None and given.project.dataset_revision == SECOND
    # A run recorded on a local data set (its files' content, not a commit) has nothing to keep
    (tmp_path / "resolved_config.json").write_text(json.dumps({"derived": {"data_identity": {"a.jsonl": {}}}}))
    assert hub_revision.keep(recipe("--dataset_name", "org/prefs"), str(tmp_path)) is None


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
        (["--dataset_mixer_list", "data/smoke_prefs.jsonl", "1.0", "--dataset_revision", "v1"],
         "this run reads a mixture: remove dataset_revision"),
    ],
    ids=["local", "mixture"],
)  # fmt: skip
def test_a_revision_for_data_that_is_not_one_hub_data_set_is_refused(args, refusal):
    from dpotrain import options

    r = recipe(*args)
    if "--dataset_mixer_list" in args:
        r.script.dataset_name = None  # the mixture replaces the recipe's dataset_name
    with pytest.raises(ConfigError, match=refusal):
        options.check_options(r)

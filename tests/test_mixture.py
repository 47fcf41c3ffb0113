"""Issue #40: preference data from several sources (dpotrain/data/mixture.py), in TRL's `datasets:` spelling and
open-instruct's `--dataset_mixer_list`.

The held-out mixture: three local files written with the real `datasets` library, in three shapes and formats (TRL's
explicit prompt as JSON Lines, UltraFeedback-binarized as Parquet, HH-RLHF strings as CSV), taken as a fraction, a
count and an upsampled fraction. Counts are read from the run's own records (resolved_config.json, the dry run's).
"""

import gzip
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import datasets
import numpy as np
import pytest
from test_data_shapes import explicit_prompt, hh, ultrafeedback, with_images
from test_refusals import refused

import train_dpo
from conftest import ROOT, launch_smoke, run_train
from dpotrain import resolve, stages
from dpotrain.data import builtin, chat_template, data, lengths, mixture, rows
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, run_cli

SMOKE = str(ROOT / "configs" / "smoke.yaml")
ROWS = {"trl": 40, "uf": 30, "hh": 20}
# floor(0.5 x 40), 12 of 30, floor(1.5 x 20): every hh row once, then 10 of them again
TAKEN = {"trl": 20, "uf": 12, "hh": 30}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixture")
    datasets.Dataset.from_list(explicit_prompt(ROWS["trl"])).to_json(folder / "trl.jsonl")
    datasets.Dataset.from_list(ultrafeedback(ROWS["uf"])).to_parquet(folder / "uf.parquet")
    datasets.Dataset.from_list(hh(ROWS["hh"])).to_csv(folder / "hh.csv", index=False)
    return {
        name: str(folder / f"{name}.{suffix}") for name, suffix in (("trl", "jsonl"), ("uf", "parquet"), ("hh", "csv"))
    }


def mixer(files) -> list[str]:
    return ["--dataset_mixer_list", files["trl"], "0.5", files["uf"], "12", files["hh"], "1.5"]


def by_source(records: list[dict], files) -> dict:
    names = {path: name for name, path in files.items()}
    return {names[r["source"].split(" [")[0]]: r for r in records}


# --- the two spellings ------------------------------------------------------------------------------------------------


def test_both_spellings_name_the_same_sources(tmp_path, files):
    recipe_file = tmp_path / "mix.yaml"
    recipe_file.write_text(
        "bf16: false\ndatasets:\n"
        f"  - path: {files['trl']}\n    amount: 0.5\n"
        f"  - path: {files['uf']}\n    amount: 12\n"
        f"  - path: csv\n    data_files: {files['hh']}\n    amount: 1.5\n"
    )
    from_yaml = mixture.parse(mixture.fields_of(parse_args(["--config", str(recipe_file)])))
    from_cli = mixture.parse(mixture.fields_of(parse_args(["--config", SMOKE, *mixer(files)])))
    assert [(s.spec(), s.amount) for s in from_yaml] == [(s.spec(), s.amount) for s in from_cli]
    assert [s.amount for s in from_cli] == ["0.5", "12", "1.5"]


def test_a_command_line_source_written_as_the_help_says_in_yaml_is_read_as_one(files):
    """`--datasets` takes its sources "in YAML", as the help says: `{path: a.jsonl, amount: 0.5}` (YAML's flow style,
    not JSON) was read as the name of a Hub data set, `'{path: a.jsonl, amount: 0.5}': not cached, and the Hub does
    not answer`, with a prefetch command that fetched nothing. Read as the mapping it is; one neither JSON nor YAML is
    refused naming how to write it."""
    as_yaml = parse_args(["--config", SMOKE, "--datasets", f"{{path: {files['trl']}, amount: 0.5}}"])
    as_json = parse_args(["--config", SMOKE, "--datasets", json.dumps({"path": files["trl"], "amount": 0.5})])
    read = [[(s.path, s.amount) for s in mixture.parse(mixture.fields_of(r))] for r in (as_yaml, as_json)]
    assert read[0] == read[1] == [(files["trl"], "0.5")]
    with pytest.raises(ConfigError, match=r"is not a mapping .* \{path: a.jsonl, amount: 0.5\}"):
        broken = parse_args(["--config", SMOKE, "--datasets", f"{{path: {files['trl']}, amount: [0.5}}"])
        mixture.parse(mixture.fields_of(broken))


def test_a_command_line_mixture_written_as_a_yaml_block_is_read_as_its_sources(files):
    """The help's YAML in its block style, as a recipe writes it: `- path: a.jsonl<newline>  amount: 0.5` was read as
    the name of a Hub data set ("does not exist ... give a Hub name like org/dataset"), and so was one mapping's block
    (`path: a.jsonl<newline>amount: 0.5`) and a flow list (`[{path: a.jsonl}, {path: b.jsonl}]`). Each reads as the
    recipe's `datasets:` list does, and is recorded so (JSON entries, what a requeued run and a resume compare)."""
    trl, uf = files["trl"], files["uf"]
    expected = [(trl, "0.5"), (uf, "12")]
    for words in (
        [f"- path: {trl}\n  amount: 0.5\n- path: {uf}\n  amount: 12\n"],
        [f"path: {trl}\namount: 0.5", f"{{path: {uf}, amount: 12}}"],
        [f"[{{path: {trl}, amount: 0.5}}, {{path: {uf}, amount: 12}}]"],
    ):
        recipe = parse_args(["--config", SMOKE, "--datasets", *words])
        assert [(s.path, s.amount) for s in mixture.parse(mixture.fields_of(recipe))] == expected, words
        assert [json.loads(w)["path"] for w in recipe.project.datasets] == [trl, uf]
    with pytest.raises(ConfigError, match=r"is not a mapping .* \{path: a.jsonl, amount: 0.5\}"):
        parse_args(["--config", SMOKE, "--datasets", f"- path: {trl}\n  amount: 0.5\n bad: [\n"])


def test_a_split_its_data_files_mapping_does_not_name_is_refused_naming_the_field_that_chose_it(files):
    """`data_files: {train: a.jsonl}` as an `eval_datasets:` entry (the held-out split defaults to test): the run read
    the training sources, then stopped on datasets' "ValueError: Unknown split "test". Should be one of ['train']",
    naming neither the field that chose the split nor the fix. Refused as the recipe is read, as a folder's is."""
    entry = json.dumps({"path": "json", "data_files": {"train": files["trl"]}})
    recipe = parse_args(["--config", SMOKE, "--datasets", entry, "--eval_datasets", entry])
    assert [s.split for s in mixture.parse(mixture.fields_of(recipe))] == ["train"]
    with pytest.raises(ConfigError) as refused:
        mixture.parse(mixture.fields_of(recipe), evaluation=True)
    assert str(refused.value).endswith(
        "has no split 'test': set `split` in its `eval_datasets:` entry (or --dataset_test_split, every entry's "
        "default) to one of ['train']"
    )


@pytest.mark.parametrize("amount", ["100000000000000000000.0", "1000000000000000.0"])
def test_an_upsampling_whose_row_numbers_outgrow_the_memory_is_refused_in_one_line(amount, files):
    """`--dataset_mixer_list pairs.jsonl 100000000.0` (1.0 meant) stopped in a traceback as the mixture was taken:
    numpy's "Unable to allocate 29.8 GiB", or at 1e20 "OverflowError: Python int too large to convert to C long".
    Refused in one line naming the pairs it takes and a smaller amount; an upsampling that fits is taken."""
    with pytest.raises(ConfigError, match=r"takes [\d,]+ pairs \([\d,]+ times each\), whose row numbers alone need "):
        mixture.take(mixture.Source(files["hh"], "train", amount=amount), 20, seed=42)
    assert len(mixture.take(mixture.Source(files["hh"], "train", amount="1000.0"), 20, seed=42)) == 20_000


@pytest.mark.parametrize("key", ["path", "split", "data_dir"])
def test_an_entrys_name_or_path_written_as_a_list_is_refused_naming_the_fix(key, files):
    """`path: [a.jsonl]` (a list where one source is named) was asked of the Hub as the data set "['a.jsonl']" ("not
    cached, and the Hub does not answer", with a prefetch command), and `split: [train]` was refused as datasets'
    slice syntax. Refused naming the field and how several files are given."""
    entry = {"path": files["trl"], key: [files["trl"] if key == "path" else "train"]}
    recipe = parse_args(["--config", SMOKE, "--datasets", json.dumps(entry)])
    with pytest.raises(ConfigError, match=rf"{key} is a list, where it names one .*: write one \(several files"):
        mixture.parse(mixture.fields_of(recipe))


def test_the_command_lines_data_set_replaces_the_recipe_files_mixture(tmp_path, files):
    """The command line wins for every field: a mixture there replaced the recipe file's dataset_name, while a
    `--dataset_name` beside a recipe file's mixture was refused ("dataset_name ... and a mixture: ... remove
    dataset_name"), by the run, its dry run and prefetch.py. The recipe's held-out mixture stays."""
    recipe_file = tmp_path / "mix.yaml"
    recipe_file.write_text(
        f"bf16: false\ndatasets: [{{path: {files['trl']}}}]\ndataset_mixer_list_splits: [train]\n"
        f"eval_datasets: [{{path: {files['uf']}}}]\n"
    )
    recipe = parse_args(["--config", str(recipe_file), "--dataset_name", files["hh"]])
    mixture.check(recipe)
    assert recipe.script.dataset_name == files["hh"] and mixture.parse(mixture.fields_of(recipe)) is None
    assert [s.path for s in mixture.parse(mixture.fields_of(recipe), evaluation=True)] == [files["uf"]]
    # a mixture in the other spelling replaces the recipe file's ("two mixtures: ... keep one"), held-out ones too
    other = ["--dataset_mixer_list", files["hh"], "1.0", "--dataset_mixer_eval_list", files["trl"], "1.0"]
    recipe = parse_args(["--config", str(recipe_file), *other])
    mixture.check(recipe)
    assert [(s.path, s.split) for s in mixture.parse(mixture.fields_of(recipe))] == [(files["hh"], "train")]
    assert [s.path for s in mixture.parse(mixture.fields_of(recipe), evaluation=True)] == [files["trl"]]
    # the recipe file's dataset_name goes with its configuration and commit (each refused beside a mixture)
    recipe_file.write_text("bf16: false\ndataset_name: org/prefs\ndataset_config: sub\ndataset_revision: v1\n")
    recipe = parse_args(["--config", str(recipe_file), *other])
    mixture.check(recipe)
    assert (recipe.script.dataset_name, recipe.script.dataset_config, recipe.project.dataset_revision) == (None,) * 3
    with pytest.raises(ConfigError, match="dataset_config 'sub' and a mixture"):
        mixture.check(parse_args(["--config", str(recipe_file), *other, "--dataset_config", "sub"]))
    recipe_file.write_text(
        f"bf16: false\ndataset_mixer_list: [{files['trl']}, '1.0']\ndataset_mixer_list_splits: [x]\n"
    )
    recipe = parse_args(["--config", str(recipe_file), "--datasets", json.dumps({"path": files["hh"]})])
    assert [s.path for s in mixture.parse(mixture.fields_of(recipe))] == [files["hh"]]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--dataset_mixer_list", "a.jsonl"], "SOURCE AMOUNT pairs"),
        (["--dataset_mixer_list", "a.jsonl", "1e3"], "with a decimal point"),
        (["--dataset_mixer_list", "a.jsonl", "0"], "above 0"),
        (["--dataset_mixer_list", "a.jsonl", "1.0", "--dataset_name", "b.jsonl"], "dataset_name 'b.jsonl' and a"),
        # dataset_name's configuration, recorded while no source was read with it
        (["--dataset_mixer_list", "a.jsonl", "1.0", "--dataset_config", "sub"], "`name:` in a `datasets:` entry"),
        (["--dataset_mixer_list", "a.jsonl", "1.0", "a.jsonl", "0.5"], "named twice"),
        (["--dataset_mixer_list", "a.jsonl", "1.0", "--dataset_mixer_list_splits", "train", "test", "x"], "3 splits"),
        (["--datasets", '{"path": "a.jsonl", "fraction": 0.5, "amount": 1.0}'], "keep one"),
        (["--datasets", '{"path": "a.jsonl", "fraction": 0.5}', '{"path": "b.jsonl"}'], "for some"),
        (["--datasets", '{"path": "a.jsonl", "weight": 2}'], "unknown key ['weight']"),  # it read "key(s)"
        (["--datasets", '{"path": "a.jsonl", "weight": 2, "x": 1}'], "unknown keys ['weight', 'x']"),
        # TRL's list of names: one string was read a character at a time after loading (no column(s) ['c', 'h', ...]),
        # a number was a traceback
        (["--datasets", '{"path": "a.jsonl", "columns": "chosen"}'], "columns 'chosen' is not a list of column"),
        (["--datasets", '{"path": "a.jsonl", "columns": 5}'], "write them as a list (columns: [prompt, chosen,"),
        (["--datasets", '{"path": "a.jsonl", "columns": ["chosen", 3]}'], "columns ['chosen', 3] is not a list"),
        # TRL's shares are normalized: a NaN or infinite one left none to size the mixture (a traceback at load)
        (["--datasets", '{"path": "a.jsonl", "fraction": NaN}', '{"path": "b.jsonl", "fraction": 1}'], "finite"),
        (["--datasets", '{"path": "a.jsonl", "fraction": Infinity}', '{"path": "b.jsonl", "fraction": 1}'], "finite"),
        # quoted in the recipe: text, which "must be a finite number" did not say
        (
            ["--datasets", '{"path": "a.jsonl", "fraction": "0.5"}'],
            "fraction '0.5' must be a finite number >= 0: write it",
        ),
        (["--datasets", '{"path": "a.jsonl"}', "--streaming", "true"], "streaming: true"),
        (["--datasets", '{"path": "a.jsonl"}', "--test_split_size", "0.1"], "test_split_size"),
        # beside dataset_name (no mixture) it was read by nothing: no held-out split, not a word said
        (["--test_split_size", "0.1"], "test_split_size is not supported"),
        # a split every source names otherwise: the run trained on `train` (384 pairs, not validation's 200), not a word
        (
            ["--dataset_mixer_list", "a.jsonl", "1.0", "--dataset_mixer_list_splits", "train"]
            + ["--dataset_train_split", "validation"],
            "dataset_train_split 'validation' would be ignored: --dataset_mixer_list_splits names every source's",
        ),
        (
            ["--datasets", '{"path": "a.jsonl", "split": "train"}', "--dataset_train_split", "validation"],
            "dataset_train_split 'validation' would be ignored: every `datasets:` entry names its own `split`",
        ),
        (
            ["--dataset_mixer_eval_list", "a.jsonl", "1.0", "--dataset_mixer_eval_list_splits", "test"]
            + ["--dataset_test_split", "validation"],
            "dataset_test_split 'validation' would be ignored: --dataset_mixer_eval_list_splits names every",
        ),
    ],
)
def test_a_mixture_written_wrong_is_one_line(args, says):
    with pytest.raises(ConfigError, match=None) as e:
        resolve.check_values(parse_args(["--config", SMOKE, *args]))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_configuration_name_on_a_local_file_source_is_refused_as_dataset_config_is(files, tmp_path):
    """`{path: pairs.jsonl, name: foo}` (or `path: json` with that file as data_files) trained the file as it is, the
    name read by nothing and recorded as the source `pairs.jsonl:foo [train]`; dataset_config on such a dataset_name
    is refused. A saved data set has none either; a Hub data set's name is its configuration."""
    datasets.Dataset.from_list(explicit_prompt(4)).save_to_disk(tmp_path / "saved")
    entries = [
        {"path": files["trl"], "name": "foo"},
        {"path": "json", "data_files": files["trl"], "name": "foo"},
        {"path": str(tmp_path / "saved"), "name": "foo"},
    ]
    for entry, flag in [(e, f) for e in entries for f in ("--datasets", "--eval_datasets")]:
        recipe = parse_args(["--config", SMOKE, flag, json.dumps(entry), "--eval_strategy", "steps"])
        with pytest.raises(ConfigError) as e:
            resolve.check_values(recipe)
        assert "`name` 'foo' names a configuration of a Hub data set" in str(e.value), str(e.value)
        assert str(e.value).endswith("which has none: remove `name` from its entry")
    hub = {"path": "org/prefs", "name": "foo"}
    resolve.check_values(
        parse_args(["--config", SMOKE, "--datasets", json.dumps(hub), json.dumps(entries[0] | {"name": None})])
    )


def test_a_configuration_name_on_a_folder_without_configs_names_the_fix(files, tmp_path):
    """A folder of shards with no README.md `configs:` has one configuration: `name: foo` (or dataset_config foo) failed
    in datasets (`BuilderConfig 'foo' not found`), said as `... put the pairs there as .jsonl, .json, .parquet or .csv
    files of one format`, which they were. `default` is its own name, and reads it."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(files["trl"], shards / "a.jsonl")
    for readme in (None, "# Pairs\n"):
        if readme:
            (shards / "README.md").write_text(readme)
        with pytest.raises(ConfigError) as e:
            mixture.read_source(mixture.Source(str(shards), "train", name="foo"), say=False)
        assert str(e.value) == (
            f"dataset folder {str(shards)!r} has no configuration 'foo': its files are one data set (no README.md "
            "`configs:` names others): remove dataset_config (a mixture source: its `name`)"
        )
    assert len(mixture.read_source(mixture.Source(str(shards), "train", name="default"), say=False)) == ROWS["trl"]


def test_a_split_option_some_source_reads_is_not_refused():
    """--dataset_train_split is the default of each source that names no split, and agrees with one that names it."""
    for args in (
        ["--dataset_mixer_list", "a.jsonl", "1.0", "--dataset_train_split", "validation"],
        ["--dataset_mixer_list", "a.jsonl", "1.0", "--dataset_mixer_list_splits", "validation"]
        + ["--dataset_train_split", "validation"],
        ["--datasets", '{"path": "a.jsonl", "split": "train"}', '{"path": "b.jsonl"}', "--dataset_train_split", "v"],
    ):
        sources = mixture.parse(mixture.fields_of(parse_args(["--config", SMOKE, *args])))
        assert {s.split for s in sources} >= {args[-1]}


def test_one_source_through_a_symlink_or_a_relative_path_is_refused_as_twice(files, tmp_path, monkeypatch):
    """`good.jsonl` and `alias.jsonl -> good.jsonl` planned every pair twice (the same path twice was refused)."""
    good = tmp_path / "data" / "good.jsonl"
    good.parent.mkdir()
    shutil.copy(files["trl"], good)
    (tmp_path / "alias.jsonl").symlink_to(good)
    monkeypatch.chdir(tmp_path)
    spellings = [
        ["--dataset_mixer_list", str(good), "1.0", "alias.jsonl", "0.5"],  # a symlink
        ["--dataset_mixer_list", "data/good.jsonl", "1.0", "./data/../data/good.jsonl", "0.5"],  # two relative paths
        ["--datasets", json.dumps({"path": "data/good.jsonl"}), json.dumps({"path": "json", "data_files": str(good)})],
        # a file has one split, whatever the mixture calls it
        [
            "--dataset_mixer_list",
            "data/good.jsonl",
            "1.0",
            "alias.jsonl",
            "1.0",
            "--dataset_mixer_list_splits",
            "train",
            "test",
        ],
    ]
    monkeypatch.setenv("HOME", str(tmp_path))  # a recipe's `~/` (the shell expands the command line's)
    spellings += [
        ["--datasets", json.dumps({"path": "~/data/good.jsonl"}), json.dumps({"path": str(good)})],
        ["--datasets", json.dumps({"path": "~/alias.jsonl"}), json.dumps({"path": "json", "data_files": str(good)})],
    ]
    for args in spellings:
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, *args]))
        assert "the same data in the mixture: give it once, with one amount (an amount of 2.0 trains" in str(e.value)
    # Two files with the same content are two sources, as the user may mean (a copy kept apart on purpose).
    shutil.copy(good, tmp_path / "copy.jsonl")
    resolve.check_values(
        parse_args(["--config", SMOKE, "--dataset_mixer_list", "alias.jsonl", "1.0", "copy.jsonl", "1.0"])
    )


def test_a_file_a_pattern_or_a_folder_reads_again_is_refused_as_read_twice(files, tmp_path, monkeypatch):
    """A glob (or a folder of shards) that also matches a file another source names, or a `data_files` list naming a
    file its pattern matches too: datasets reads the file each time, and the dry run planned its pairs twice (`a
    mixture of 2 sources: 60 rows` from 40 pairs), silently, while the same file named twice is refused."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        shutil.copy(files["trl"], shards / name)
    monkeypatch.chdir(tmp_path)
    pattern = {"path": "json", "data_files": "shards/*.jsonl"}
    both = "both read {}: its pairs would train twice; give each file to one source".format
    for args, says in [
        (["--datasets", json.dumps(pattern), json.dumps({"path": "shards/a.jsonl"})], both(shards / "a.jsonl")),
        (["--dataset_mixer_list", "shards", "1.0", "shards/b.jsonl", "0.5"], both(shards / "b.jsonl")),
        (
            ["--datasets", json.dumps({**pattern, "data_files": ["shards/*.jsonl", "shards/b.jsonl"]})],
            f"reads {shards / 'b.jsonl'} twice (named twice in its data_files, or matched again by a pattern",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, *args]))
        assert says in str(e.value), args
    # Patterns that match other files are other sources, and so are two splits of a folder (its files by name).
    other = json.dumps({**pattern, "data_files": "shards/a*.jsonl"})
    resolve.check_values(parse_args(["--config", SMOKE, "--datasets", other, json.dumps({"path": "shards/b.jsonl"})]))
    for name in ("a.jsonl", "b.jsonl"):
        (shards / name).rename(shards / name.replace("a.", "train.").replace("b.", "test."))
    splits = [json.dumps({"path": "shards", "split": split}) for split in ("train", "test")]
    resolve.check_values(parse_args(["--config", SMOKE, "--datasets", *splits]))
    with pytest.raises(ConfigError, match="both read"):
        resolve.check_values(parse_args(["--config", SMOKE, "--datasets", splits[0], '{"path": "shards/train.jsonl"}']))
    with pytest.raises(ConfigError, match="both read"):  # a builder reading the folder
        folder = json.dumps({"path": "json", "data_dir": "shards"})
        resolve.check_values(parse_args(["--config", SMOKE, "--datasets", folder, '{"path": "shards/train.jsonl"}']))


def test_a_file_one_source_reads_twice_is_refused_naming_the_upsampling(files, tmp_path, monkeypatch):
    """`data_files: [a.jsonl, a.jsonl]` (or two spellings of it) reads the file twice, its pairs trained twice; a
    pattern that matches a file and a link to it did so silently (`*.jsonl` with alias.jsonl -> a.jsonl: 40 pairs read
    as 80), and so did a `dataset_name` folder holding such a link. Compared as datasets resolves the names (each match
    by its real path); the refusal names the file and the upsampling that trains pairs twice on purpose."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs").mkdir()
    shutil.copy(files["trl"], tmp_path / "pairs" / "a.jsonl")
    a = tmp_path / "pairs" / "a.jsonl"
    twice = (
        f"reads {a} twice (named twice in its data_files, or matched again by a pattern, a folder or a link to it): "
        "its pairs would train twice; read it once (remove the duplicate name, or narrow the pattern or folder), and "
        "to train its pairs twice on purpose give the file alone as a mixture source with `amount: 2.0` (--datasets "
    )
    for data_files in (
        ["pairs/a.jsonl", "pairs/a.jsonl"],
        ["pairs/a.jsonl", "./pairs/a.jsonl"],
        ["pairs/a.jsonl", str(a)],
        {"train": ["pairs/a.jsonl", "pairs/../pairs/a.jsonl"]},
    ):
        with pytest.raises(ConfigError) as e:
            resolve.check_values(
                parse_args(["--config", SMOKE, "--datasets", json.dumps({"path": "json", "data_files": data_files})])
            )
        assert twice in str(e.value) and "\n" not in str(e.value), data_files
    resolve.check_values(parse_args(["--config", SMOKE, "--datasets", '{"path": "pairs/a.jsonl", "amount": 2.0}']))
    (tmp_path / "pairs" / "alias.jsonl").symlink_to(a)  # a link beside the file it names
    glob = json.dumps({"path": "json", "data_files": "pairs/*.jsonl"})
    for args, says in [
        (["--datasets", glob], f"mixture source json [train] data_files=pairs/*.jsonl {twice}"),
        (["--dataset_name", "pairs"], f"dataset pairs [train] {twice}"),
    ]:
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, *args]))
        assert says in str(e.value), args
        # The upsampling it names works as written: `amount: 2.0` on the source itself read the file twice still, and
        # a `dataset_name` has no amount at all (the refusal said to give "the source" one).
        words = shlex.split(str(e.value).rpartition("(--datasets ")[2].removesuffix(")"))
        assert json.loads(words[0]) == {"path": str(a), "amount": 2.0}, args
        resolve.check_values(parse_args(["--config", SMOKE, "--datasets", *words]))


def test_a_held_out_file_read_twice_is_refused_as_evaluated_on_naming_the_held_out_flag(files, tmp_path, monkeypatch):
    """A held-out mixture's file read twice (by one source, by two, or named twice) was refused as "its pairs would
    train twice", and the fix named --datasets, which would train the held-out pairs: said as evaluated on, naming
    --eval_datasets."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(files["trl"], tmp_path / "a.jsonl")
    twice = json.dumps({"path": "json", "data_files": ["a.jsonl", "./a.jsonl"]})
    for held, says in [
        ([twice], "its pairs would be evaluated on twice; read it once"),
        (
            [json.dumps({"path": "json", "data_files": "*.jsonl"}), json.dumps({"path": "a.jsonl"})],
            "its pairs would be evaluated on twice; give each file to one source",
        ),
        ([json.dumps({"path": "a.jsonl"})] * 2, "an amount of 2.0 evaluates on every pair twice"),
    ]:
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, "--eval_datasets", *held]))
        assert says in str(e.value) and "train" not in str(e.value).replace("[train]", ""), str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve.check_values(parse_args(["--config", SMOKE, "--eval_datasets", twice]))
    words = shlex.split(str(e.value).rpartition("(--eval_datasets ")[2].removesuffix(")"))
    assert json.loads(words[0]) == {"path": str(tmp_path / "a.jsonl"), "amount": 2.0}, str(e.value)
    resolve.check_values(parse_args(["--config", SMOKE, "--eval_datasets", *words]))  # the upsampling it names


def test_two_sources_of_one_file_are_refused_whatever_split_or_columns_they_name(files, tmp_path, monkeypatch):
    """A file has one split whatever a source calls it, and `columns` keeps columns without renaming them: two sources
    of one file train its same chosen/rejected pairs twice (or two seeded samples of them), so they are refused as the
    same source is, pointing to `amount: 2.0` for pairs meant twice."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(files["trl"], tmp_path / "a.jsonl")
    whole = {"path": "json", "data_files": "a.jsonl"}
    for other in (
        {"path": "json", "data_files": {"test": "a.jsonl"}, "split": "test"},
        {"path": "json", "data_files": "*.jsonl", "columns": ["chosen", "rejected"]},
    ):
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, "--datasets", json.dumps(whole), json.dumps(other)]))
        assert f"both read {tmp_path / 'a.jsonl'}: its pairs would train twice; give each file to one source" in str(
            e.value
        ) and "`amount: 2.0` on one source trains them twice on purpose" in str(e.value), other


def test_data_files_that_match_no_file_are_named_before_anything_loads(files, tmp_path, monkeypatch):
    """`path: json` with a `data_files` pattern matching nothing: the load ended in `could not load mixture source
    ...: StopIteration`, naming neither the pattern nor the fix."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(files["trl"], tmp_path / "a.jsonl")
    for data_files, says in [
        ("pairs/*.jsonl", f"data_files 'pairs/*.jsonl' matches no file (looked in {tmp_path}): check the path or"),
        (
            [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
            f"data_files '{tmp_path / 'b.jsonl'}' matches no file:",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            resolve.check_values(
                parse_args(["--config", SMOKE, "--datasets", json.dumps({"path": "json", "data_files": data_files})])
            )
        assert says in str(e.value)
    source = json.dumps({"path": "json", "data_files": "*.jsonl"})
    resolve.check_values(parse_args(["--config", SMOKE, "--datasets", source]))


def test_data_files_are_matched_as_datasets_matches_them(files, tmp_path, monkeypatch):
    """`pairs/**/*.jsonl` reads pairs/a.jsonl and pairs/sub/deep/b.jsonl (datasets' `**` is any depth, Python's glob
    one folder): it was refused as matching no file, while the load read both. `~` datasets does not expand: the load
    failed on it (StopIteration), refused now with the fix."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs" / "sub" / "deep").mkdir(parents=True)
    shutil.copy(files["trl"], tmp_path / "pairs" / "a.jsonl")
    shutil.copy(files["trl"], tmp_path / "pairs" / "sub" / "deep" / "b.jsonl")
    for pattern in ("pairs/**/*.jsonl", "pairs/**"):
        source = json.dumps({"path": "json", "data_files": pattern})
        resolve.check_values(parse_args(["--config", SMOKE, "--datasets", source]))
    source = json.dumps({"path": "json", "data_files": "~/pairs/*.jsonl"})
    with pytest.raises(ConfigError, match="datasets does not expand ~ in data_files: give the full path"):
        resolve.check_values(parse_args(["--config", SMOKE, "--datasets", source]))


def test_a_sources_identity_holds_the_files_its_pattern_reads(files, tmp_path, monkeypatch):
    """The files a `data_files` pattern names are recorded (resume's comparison, the analyzer's cache key) as the load
    matches them: `pairs/**/*.jsonl` reads pairs/a.jsonl too, which Python's glob left out of the record, so an edit of
    that file was resumed on and its old lengths reused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs" / "sub").mkdir(parents=True)
    shutil.copy(files["trl"], tmp_path / "pairs" / "a.jsonl")
    shutil.copy(files["trl"], tmp_path / "pairs" / "sub" / "b.jsonl")
    source = mixture.Source("json", "train", data_files="pairs/**/*.jsonl")
    assert sorted(mixture.identity_of(source)["files"]) == ["a.jsonl", "sub/b.jsonl"]
    assert sorted(p.name for p in mixture._files_read(source)) == ["a.jsonl", "b.jsonl"]  # what the load reads


def test_a_note_beside_a_folders_shards_is_not_data_a_resume_compares(files, tmp_path):
    """datasets reads a folder's files of one format (`notes.txt` beside .jsonl shards is left out, and a new run
    trains the shards alone), but the files compared on resume held every file: a note written into the data folder
    between two attempts refused the requeued job as `dataset content: ...: notes.txt is new since the run started`.
    A shard added or edited is still refused."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(files["trl"], shards / "a.jsonl")
    (shards / "b.jsonl.gz").write_bytes(gzip.compress(Path(files["trl"]).read_bytes()))
    source = mixture.Source(str(shards), "train", amount="1.0")
    recorded = [{"source": source.spec(), "identity": mixture.identity_of(source)}]
    (shards / "notes.txt").write_text("exported from run 12\n")
    assert sorted(p.name for p in mixture._files_read(source)) == ["a.jsonl", "b.jsonl.gz"]
    assert mixture._sources_changed([source], recorded) is None
    shutil.copy(files["trl"], shards / "c.jsonl")
    assert mixture._sources_changed([source], recorded).endswith("c.jsonl is new since the run started")


def test_a_readme_of_prose_beside_a_folders_shards_is_not_data_a_resume_compares(files, tmp_path):
    """A README.md is compared for the `configs:` (or `dataset_info:`) its YAML header gives, which choose the files
    and how they read; one of prose alone, written into the data folder between two attempts, refused the requeued
    job as `dataset content: ...: README.md is new since the run started`. A header that chooses other files is
    refused by them, and an edited header by its content."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(files["trl"], shards / "a.jsonl")
    shutil.copy(files["trl"], shards / "b.jsonl")
    source = mixture.Source(str(shards), "train", amount="1.0")
    recorded = [{"source": source.spec(), "identity": mixture.identity_of(source)}]
    (shards / "README.md").write_text("# Our preference pairs\n\nExported from run 12.\n")
    assert mixture._sources_changed([source], recorded) is None
    (shards / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: a.jsonl\n---\n")
    assert "README.md is new since the run started" in mixture._sources_changed([source], recorded)
    recorded = [{"source": source.spec(), "identity": mixture.identity_of(source)}]
    assert mixture._sources_changed([source], recorded) is None
    (shards / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: b.jsonl\n---\n")
    assert "b.jsonl is new since the run started" in mixture._sources_changed([source], recorded)


def test_two_configurations_of_a_cloned_hub_data_set_are_two_sources(files, tmp_path, monkeypatch):
    """A folder whose README.md names its files by configuration (a Hub data set cloned): `name: en` and `name: de`
    read en/ and de/, and were refused as both reading a file (every file of the folder taken as each one's split);
    a configuration that reads the other's file too is refused."""
    monkeypatch.chdir(tmp_path)
    for lang in ("en", "de"):
        (tmp_path / "ds" / lang).mkdir(parents=True)
        shutil.copy(files["trl"], tmp_path / "ds" / lang / "train.jsonl")
    configs = [("en", "en/train.jsonl"), ("de", "de/train.jsonl"), ("all", "*/train.jsonl")]
    card = "".join(f"- config_name: {n}\n  data_files:\n  - split: train\n    path: '{p}'\n" for n, p in configs)
    (tmp_path / "ds" / "README.md").write_text(f"---\nconfigs:\n{card}---\n")
    two = [json.dumps({"path": "ds", "name": lang}) for lang in ("en", "de")]
    resolve.check_values(parse_args(["--config", SMOKE, "--datasets", *two]))
    with pytest.raises(ConfigError, match=f"both read {tmp_path / 'ds' / 'en' / 'train.jsonl'}"):
        resolve.check_values(parse_args(["--config", SMOKE, "--datasets", two[0], '{"path": "ds", "name": "all"}']))


def test_a_recipes_relative_source_not_in_the_folder_run_in_is_the_projects(tmp_path, monkeypatch):
    """A recipe's `datasets:` naming `data/my_pairs.jsonl` (as the shipped recipes suggest) run from another folder
    was refused ("dataset 'data/smoke_prefs.jsonl' does not exist (looked in ...)") while the same recipe's
    dataset_name is the project's (config.RECIPE_PATHS); a Slurm job's `--dataset_mixer_list my.jsonl 1.0` was looked
    for in the project alone. Mixture sources follow the fields' rules; a file where the command runs stays its own."""
    project = str(ROOT / "data" / "smoke_prefs.jsonl")
    entries = {
        "a file": ("datasets", {"path": "data/smoke_prefs.jsonl", "amount": 0.5}),
        "data_files": ("datasets", {"path": "json", "data_files": ["data/smoke_prefs.jsonl"]}),
        "held out": ("eval_datasets", {"path": "data/smoke_prefs.jsonl"}),
        "mixer": ("dataset_mixer_list", "data/smoke_prefs.jsonl"),
    }
    monkeypatch.chdir(tmp_path)

    def sources(yaml_lines, *argv, evaluation=False):
        (tmp_path / "mix.yaml").write_text("bf16: false\n" + yaml_lines)
        recipe = parse_args(["--config", str(tmp_path / "mix.yaml"), *argv])
        mixture.check(recipe)
        return mixture.parse(mixture.fields_of(recipe), evaluation)

    for what, (field, entry) in entries.items():
        value = f"[{entry}, '1.0']" if field == "dataset_mixer_list" else f"[{json.dumps(entry)}]"
        extra = f"datasets: [{json.dumps({'path': project})}]\n" if field == "eval_datasets" else ""
        [source] = sources(f"{field}: {value}\n{extra}", evaluation=field == "eval_datasets")
        assert source.identity() == project, (what, source)
    pattern = {"path": "json", "data_files": {"train": "data/smoke_*.jsonl"}}
    [source] = sources(f"datasets: [{json.dumps(pattern)}]\n")
    assert source.data_files == {"train": str(ROOT / "data" / "smoke_*.jsonl")}
    folder = {"path": "json", "data_dir": "data", "data_files": "smoke_prefs.jsonl"}  # its data_files are its folder's
    [source] = sources(f"datasets: [{json.dumps(folder)}]\n")
    assert (source.data_dir, source.data_files) == (str(ROOT / "data"), "smoke_prefs.jsonl")
    (tmp_path / "data").mkdir()
    shutil.copy(project, tmp_path / "data" / "smoke_prefs.jsonl")  # a file of that name here: this folder's
    [source] = sources("datasets: [{path: data/smoke_prefs.jsonl}]\n")
    assert source.spec() == "data/smoke_prefs.jsonl [train]"
    # The command line's are the folder's, and a Slurm job's the submit folder's where found there
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(tmp_path))
    [source] = sources("", "--dataset_mixer_list", "data/smoke_prefs.jsonl", "1.0")
    assert source.identity() == str(tmp_path / "data" / "smoke_prefs.jsonl")
    [source] = sources("", "--datasets", json.dumps({"path": "json", "data_files": "data/smoke_prefs.jsonl"}))
    assert source.identity() == str(tmp_path / "data" / "smoke_prefs.jsonl")


def test_a_builders_data_dir_is_recorded_and_compared_by_its_own_files(files, tmp_path, monkeypatch):
    """`path: json` with `data_dir: pairs` (datasets reads the folder's files, data_files relative to it) was recorded
    as every file of the working folder: a pair edited in pairs/ resumed silently, and any file written where the run
    was started (a log) refused the resume as changed data."""
    (tmp_path / "pairs").mkdir()
    shutil.copy(files["trl"], tmp_path / "pairs" / "trl.jsonl")
    shutil.copy(files["hh"], tmp_path / "pairs" / "hh.csv")
    monkeypatch.chdir(tmp_path)
    cases = [
        ({"path": "json", "data_dir": "pairs"}, {"trl.jsonl", "hh.csv"}, "trl.jsonl"),
        ({"path": "csv", "data_dir": "pairs", "data_files": "hh.csv"}, {"hh.csv"}, "hh.csv"),
    ]
    for entry, read, edited in cases:
        recipe = parse_args(["--config", SMOKE, "--datasets", json.dumps(entry)])
        [source] = mixture.parse(mixture.fields_of(recipe))
        identity = mixture.identity_of(source)
        assert set(identity["files"]) == read, identity
        # a run's folder inside the folder read whole would be read as pairs at its next start: refused
        assert ("pairs" in stages.data_folders(recipe)) == ("data_files" not in entry)
        recorded = {"data_sources": [{"source": source.spec(), "identity": identity}]}
        (tmp_path / "run.log").write_text("a file beside the data")
        assert mixture.content_changed(recipe, recorded) is None, entry
        cache_key = mixture.dataset_id(recipe, local_only=True)
        with open(tmp_path / "pairs" / edited, "a") as f:
            f.write(Path(tmp_path / "pairs" / edited).read_text().splitlines()[-1] + "\n")
        changed = mixture.content_changed(recipe, recorded)
        assert changed and f"{edited} has " in changed, (entry, changed)
        # the analyzer's lengths of the old pairs are not those of the edited files (an IndexError, or stale lengths)
        assert mixture.dataset_id(recipe, local_only=True) != cache_key, entry


def test_a_report_is_never_written_over_a_file_a_builders_glob_reads(files, tmp_path, monkeypatch):
    """`path: json` with `data_files: [glob/a*.jsonl, ...]` or `{train: ...}`: the analyzer's `--json glob/a.jsonl`
    wrote its report over the data file, which the list of inputs named only by its pattern (or not at all)."""
    from dpotrain.recipe import writes

    (tmp_path / "glob").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        shutil.copy(files["trl"], tmp_path / "glob" / name)
    monkeypatch.chdir(tmp_path)
    for data_files in (["glob/a*.jsonl", "glob/b.jsonl"], {"train": ["glob/a*.jsonl", "glob/b.jsonl"]}):
        entry = json.dumps({"path": "json", "data_files": data_files})
        inputs = writes.input_files(
            *mixture.local_files(mixture.fields_of(parse_args(["--config", SMOKE, "--datasets", entry])))
        )
        with pytest.raises(ConfigError, match="is one of this command's inputs"):
            writes.check_not_input("--json", "glob/a.jsonl", inputs)
    # one pattern is read as datasets reads it, every file it matches (it was taken for a file, refused as missing)
    recipe = parse_args(["--config", SMOKE, "--datasets", json.dumps({"path": "json", "data_files": "glob/*.jsonl"})])
    mixture.check(recipe)
    joined, mix = mixture.load(
        mixture.parse(mixture.fields_of(recipe)), 42, rows.RowRules(say=False), {}, "x", identify=True
    )
    assert len(joined) == 2 * ROWS["trl"] and set(mix.records[0]["identity"]["files"]) == {"a.jsonl", "b.jsonl"}
    (tmp_path / "glob" / "[ab].jsonl").write_text(Path(files["trl"]).read_text().splitlines(True)[0])  # its name
    [source] = mixture.parse(
        mixture.fields_of(
            parse_args(["--config", SMOKE, "--datasets", json.dumps({"path": "json", "data_files": "glob/[ab].jsonl"})])
        )
    )
    assert source.file == "glob/[ab].jsonl"


def test_a_data_files_source_whose_files_give_a_column_two_types_names_it(tmp_path):
    """`data_files: shards/*.jsonl` whose files write an unread `score` as a number in one and text in the other said
    `could not load mixture source ...: ArrowInvalid: Failed to parse string: 'high' as a scalar of type int64`."""
    shards = tmp_path / "shards"
    shards.mkdir()
    line = {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}
    (shards / "a.jsonl").write_text(json.dumps({**line, "score": 1}) + "\n")
    (shards / "b.jsonl").write_text(json.dumps({**line, "score": "high"}) + "\n")
    source = mixture.Source("json", "train", data_files=str(shards / "*.jsonl"))
    with pytest.raises(ConfigError) as e:
        mixture.read_source(source, say=False)
    assert "column 'score' is int64 in a.jsonl and string in b.jsonl, and datasets reads its files as" in str(e.value)
    assert str(e.value).startswith(f"mixture source {source.spec()}: column 'score'")


@pytest.mark.parametrize("inside", [False, True])
def test_shards_whose_texts_json_takes_for_dates_in_one_are_refused_naming_the_fix_that_reads(inside, tmp_path):
    """Answers that all look like dates in one shard (`"2024-01-10"`) are typed as timestamps there, and as text in
    the other: refused saying "write it with one type in every file", which it was. The line says why, and the fix
    it names, each file a source of its own, reads the texts as written. `inside`: the dates inside a column, a row's
    chat_template_kwargs `date_string`, where the line still said "write it with one type"."""
    shards = tmp_path / "shards"
    shards.mkdir()
    dated = [{"prompt": f"When {i}?", "chosen": f"2024-01-{10 + i}", "rejected": "Unknown."} for i in range(3)]
    other = {"prompt": "Who?", "chosen": "Ada.", "rejected": "Bob."}
    if inside:
        dated = [{**r, "chosen": "Soon.", "chat_template_kwargs": {"date_string": r["chosen"]}} for r in dated]
        other["chat_template_kwargs"] = {"date_string": "10 January 2024"}
    (shards / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dated))
    (shards / "b.jsonl").write_text(json.dumps(other) + "\n")
    with pytest.raises(ConfigError) as e:
        data.load_preference_dataset(str(shards), say=False)
    line = str(e.value)
    assert "datasets' JSON reader takes the texts of a.jsonl for dates" in line and "one type in every" not in line, (
        line
    )
    assert "name each file as a source of a mixture" in line
    source = mixture.Source(str(shards / "a.jsonl"), "train")
    pairs = rows.usable_pairs(mixture.read_source(source, say=False), rows.RowRules(say=False), {}, "k")
    assert [p["chosen"] for p in pairs] == [r["chosen"] for r in dated]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_shards_one_of_which_has_a_column_more_are_refused_naming_it(tmp_path, suffix):
    """A folder of shards (or a `data_files` glob) whose later export added an unread `id` column: datasets fails with
    `CastError: Couldn't cast`, said as `could not load mixture source ...: CastError: Couldn't cast` (a glob) or as
    `... put the pairs there as .jsonl, .json, .parquet or .csv files of one format` (a folder), which they were. The
    line names the column, the two files and the fixes: one source per file reads them."""
    shards = tmp_path / "shards"
    shards.mkdir()
    line = {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}
    for name, row in (("a", line), ("b", {**line, "id": "x-1"})):
        shard = datasets.Dataset.from_list([row, row])
        shard.to_json(shards / f"{name}.jsonl") if suffix == "jsonl" else shard.to_parquet(shards / f"{name}.parquet")
    said = f"column 'id' is in b.{suffix} and not in a.{suffix}, and datasets reads its files as one table"
    glob_source = mixture.Source("json" if suffix == "jsonl" else "parquet", "train", data_files=str(shards / "*"))
    for source in (glob_source, mixture.Source(str(shards), "train")):
        with pytest.raises(ConfigError) as e:
            mixture.read_source(source, say=False)
        assert said in str(e.value) and "name each file as a source of a mixture" in str(e.value), str(e.value)
    each = [mixture.read_source(mixture.Source(str(p), "train"), say=False) for p in sorted(shards.iterdir())]
    assert [len(d) for d in each] == [2, 2]


def test_a_local_folder_source_that_fails_to_load_names_its_file_not_the_hub(files, tmp_path, monkeypatch):
    """A folder of data files was loaded by the name as written and, failing, said `could not load data set ... from
    the Hub: DatasetGenerationError: An error occurred while generating the dataset`: naming neither the folder's file
    nor the fix; and a recipe's `~/pairs` (the shell expands the command line's) was a Hub repo id to datasets."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(files["trl"], shards / "a.jsonl")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(mixture.read_source(mixture.Source("~/shards", "train"), say=False)) == ROWS["trl"]
    with open(shards / "b.jsonl", "w") as f:
        f.write('{"chosen": "a", "rejected": "b"}\n{"chosen": oops}\n')
    with pytest.raises(ConfigError) as e:
        mixture.read_source(mixture.Source(str(shards), "train"), say=False)
    assert (
        str(e.value)
        == f"{shards / 'b.jsonl'}:2: not valid JSON (Expecting value at column 12): fix or remove that line"
    )
    notes = tmp_path / "notes"  # no data file: datasets reads it as text, and finds no row
    notes.mkdir()
    (notes / "readme.txt").write_text("")
    with pytest.raises(ConfigError) as e:
        mixture.read_source(mixture.Source(str(notes), "train"), say=False)
    assert str(e.value).startswith(f"could not read the local folder {str(notes)!r} as a data set (SchemaInference")
    assert str(e.value).endswith(
        "it holds readme.txt; put the pairs there as .jsonl, .json, .parquet or .csv files of one format, or name one "
        "file as the data set"
    )


def test_a_folder_of_data_files_in_two_formats_is_refused_before_anything_loads(files, tmp_path):
    """datasets reads a folder's files of one format (the most files') and leaves the others out: a folder holding
    `a.jsonl` and `b.csv` trained a.jsonl's pairs alone, silently (as a source or as dataset_name)."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    shutil.copy(files["trl"], folder / "a.jsonl")
    shutil.copy(files["hh"], folder / "b.csv")
    for args in (["--dataset_mixer_list", str(folder), "1.0"], ["--dataset_name", str(folder)]):
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, *args]))
        assert str(e.value) == (
            f"dataset folder {str(folder)!r} holds data files of 2 formats (json: a.jsonl; csv: b.csv), and datasets "
            "reads a folder's files of one format only, leaving the others out: convert them to one format, or name "
            "each file as a source of a mixture (docs/data.md)"
        )
    (folder / "b.csv").unlink()
    (folder / "README.md").write_text("notes\n")  # a file datasets leaves out itself
    shutil.copy(files["trl"], folder / "c.json")  # .json and .jsonl: one format to datasets
    resolve.check_values(parse_args(["--config", SMOKE, "--dataset_name", str(folder)]))


def test_a_folder_whose_notes_outnumber_its_pairs_files_is_refused_naming_them(files, tmp_path):
    """datasets reads a folder as its commonest suffix: two notes (`.txt`) beside one pairs.jsonl made it read
    the notes as a text data set and leave the pairs out, refused as `has no chosen/rejected columns (it has
    ['text'])`: rename the columns or pick a preference data set`, naming neither the notes nor the fix. One note beside
    the pairs is left out by datasets itself (a draw goes to the pairs' format), and read as ever."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    shutil.copy(files["trl"], folder / "a.jsonl")
    (folder / "notes.txt").write_text("exported 2026-11-02\n")
    (folder / "todo.txt").write_text("dedupe\n")
    for args in (["--dataset_mixer_list", str(folder), "1.0"], ["--dataset_name", str(folder)]):
        with pytest.raises(ConfigError) as e:
            resolve.check_values(parse_args(["--config", SMOKE, *args]))
        assert str(e.value) == (
            f"dataset folder {str(folder)!r} holds 2 files of another format than its pairs (notes.txt, todo.txt), and "
            "datasets reads a folder's files of its commonest format only: it would read them (text) and leave the "
            "pairs out: move them out of the folder"
        )
    (folder / "todo.txt").unlink()
    resolve.check_values(parse_args(["--config", SMOKE, "--dataset_name", str(folder)]))
    assert len(data.load_preference_dataset(str(folder), say=False)) == len(Path(files["trl"]).read_text().splitlines())


def test_csv_files_read_as_one_source_are_read_as_text_as_one_file_is(tmp_path):
    """Several CSV files as one source (a `data_files` list or glob, a folder of them): pandas guessed each file's
    types on its own, so answers of numbers in one file and words in another could not be joined (`could not load
    mixture source ...: DatasetGenerationError: An error occurred while generating the dataset`), and a file of
    numbers had `1.50` read as the float 1.5. One CSV file is read as written, as text: so are these."""
    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / "a.csv").write_text("prompt,chosen,rejected\nHow much?,1.50,2\nAnd now?,3.0,4\n")
    (folder / "b.csv").write_text("prompt,chosen,rejected\nSay yes.,yes,no\n")
    files = [str(folder / "a.csv"), str(folder / "b.csv")]
    for source in (
        mixture.Source("csv", "train", data_files=files),
        mixture.Source("csv", "train", data_files=str(folder / "*.csv")),
        mixture.Source(str(folder), "train"),  # a folder of data files
    ):
        loaded = mixture.read_source(source, say=False)
        assert sorted(loaded["chosen"]) == ["1.50", "3.0", "yes"], source
    alone = mixture.read_source(mixture.Source("csv", "train", data_files=str(folder / "a*.csv")), say=False)
    assert alone["chosen"] == ["1.50", "3.0"] and alone["rejected"] == ["2", "4"]


def test_json_shards_whose_field_mixes_types_are_read_as_written_as_one_file_is(tmp_path):
    """A field whose type differs between rows (a number as one answer) in a folder of JSON shards, a glob, a list or
    a data_dir: datasets stores it as JSON and read every answer that looks like JSON (`"0"`, `"2"`) back as a
    number, so every row was refused as not text (`every row of the train split (24 of 24) fails one check`). One
    file was read again as written; so are its shards, in the order datasets reads them."""
    pairs = [{"prompt": f"{i} + {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(24)]
    pairs[7]["chosen"] = 14  # in the first shard, whose first rows decide the types datasets reads all with
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[:12]))
    (folder / "b.json").write_text(json.dumps(pairs[12:]))  # a JSON array beside JSON Lines: one builder, json
    expected = [str(2 * i) for i in range(24) if i != 7]
    for source in (
        mixture.Source(str(folder), "train"),  # a folder of data files, read as dataset_name reads it
        mixture.Source("json", "train", data_files=str(folder / "*")),
        mixture.Source("json", "train", data_files=[str(folder / "a.jsonl"), str(folder / "b.json")]),
        mixture.Source("json", "train", data_dir=str(folder)),
    ):
        derived = {}
        read = rows.usable_pairs(mixture.read_source(source, say=False), rows.RowRules(True, say=False), derived, "x")
        assert read["chosen"] == expected and read["prompt"][1:3] == ["1 + 1?", "2 + 2?"], source
        assert derived["x"]["dropped"] == 1 and derived["x"]["first"][0]["index"] == 7, source


def test_a_source_refused_whole_or_a_bad_row_of_a_glob_names_its_source(
    files, cli, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Among several sources, a source holding images was refused as `the data set holds images`, and a bad row of a
    `path: json` source with a `data_files` glob was located `row 3 (from 0) of json`: neither said which source. The
    row is named by the file the glob read it from, and its line."""
    vision = with_images(tmp_path, lambda image: [image])
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_mixer_list", files["trl"], "1.0", vision, "1.0")
    assert line.startswith(f"error: mixture source {vision} [train]: the data set holds images"), line
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"datasets:\n  - path: {files['trl']}\n  - path: {vision}\n")
    assert cli.main(["--config", str(recipe), "--tokenizer", tiny_model_dir, "--num-proc", "1"]) == 2
    assert f"error: mixture source {vision} [train]: the data set holds images" in capsys.readouterr().err
    (tmp_path / "glob").mkdir()
    pairs = [json.loads(line) for line in Path(files["trl"]).read_text().splitlines()]
    pairs[3]["chosen"] = None
    (tmp_path / "glob" / "a.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    glob = json.dumps({"path": "json", "data_files": str(tmp_path / "glob" / "*.jsonl")})
    line = refused(tmp_path, monkeypatch, capsys, "--datasets", json.dumps({"path": files["uf"]}), glob)
    assert f"(line 4 of {tmp_path / 'glob' / 'a.jsonl'}; fix" in line, line


def test_a_bad_row_of_a_folder_source_is_named_by_its_file_and_line(files, tmp_path, monkeypatch, capsys):
    """A folder source is read as one data set, its files one after another: its bad row was located `row 8 (from 0) of
    shards`, no file to open among the folder's."""
    pairs = [json.loads(line) for line in Path(files["trl"]).read_text().splitlines()]
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[:6]))
    pairs[2]["chosen"] = None
    (tmp_path / "shards" / "b.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[:4]))
    line = refused(
        tmp_path, monkeypatch, capsys, "--dataset_mixer_list", files["trl"], "1.0", str(tmp_path / "shards"), "1.0"
    )
    assert "row 8, column 'chosen'" in line and "(line 3 of shards/b.jsonl; fix" in line, line


def test_trls_shares_near_the_float_limit_are_shares():
    """`fraction: 1e308` on two sources is finite and accepted: their sum overflowed to inf, every weight was 0, and
    the load ended in a traceback (min() arg is an empty sequence)."""
    sources = [mixture.Source(name, "train", share=1e308) for name in ("a.jsonl", "b.jsonl")]
    assert mixture.share_rows(sources, [40, 30]) == [30, 30]
    near = [mixture.Source(name, "train", share=x) for name, x in (("a.jsonl", 1e308), ("b.jsonl", 5e307))]
    plain = [mixture.Source(name, "train", share=x) for name, x in (("a.jsonl", 2.0), ("b.jsonl", 1.0))]
    assert mixture.share_rows(near, [40, 30]) == mixture.share_rows(plain, [40, 30]) == [40, 20]


def test_a_trl_share_that_takes_no_pair_is_refused_as_an_amount_that_takes_none_is():
    """`fraction: 0.001` beside `fraction: 1`: TRL's first round(weight x total) rows were round(0.1) = 0, and the
    run trained without the source it named (its record `taken: 0`); a share of 0, written, stays the user's."""
    sources = [mixture.Source("a.jsonl", "train", share=0.001), mixture.Source("b.jsonl", "train", share=1.0)]
    with pytest.raises(ConfigError) as e:
        mixture.share_rows(sources, [100, 100])
    assert str(e.value) == (
        "source a.jsonl [train] has 100 usable rows and fraction 0.001 takes none of them (TRL's rule: "
        "round(0.000999 x 100.1) = 0): give it a larger fraction, or give each source an "
        "`amount` instead (a fraction or count of that source alone)"
    )
    sources[0] = mixture.Source("a.jsonl", "train", share=0.01)
    assert mixture.share_rows(sources, [100, 100]) == [1, 100]
    sources[0] = mixture.Source("a.jsonl", "train", share=0.0)
    assert mixture.share_rows(sources, [100, 100]) == [0, 100]


def test_a_count_above_the_rows_is_refused_a_fraction_upsamples(files):
    count = mixture.Source(files["hh"], "train", amount="21")
    with pytest.raises(ConfigError, match="has 20 usable rows and the mixture asks for 21.*1.05"):
        mixture.take(count, 20, seed=42)
    taken = mixture.take(mixture.Source(files["hh"], "train", amount="2.5"), 20, seed=42)
    assert len(taken) == 50 and sorted(set(taken.tolist())) == list(range(20))  # every row twice, then 10 of them
    assert (mixture.take(mixture.Source(files["hh"], "train", amount="2.5"), 20, seed=42) == taken).all()
    assert not (
        mixture.take(mixture.Source(files["hh"], "train", amount="0.5"), 20, seed=7)
        == mixture.take(mixture.Source(files["hh"], "train", amount="0.5"), 20, seed=42)
    ).all()


@pytest.mark.parametrize(("usable", "count", "fraction"), [(40, 100, "2.5"), (3, 100, "33.4"), (7, 9, "1.3")])
def test_the_fraction_offered_for_a_count_above_the_rows_takes_that_count(files, usable, count, fraction):
    """The fraction offered beside a count above the rows takes that count (33.33 was offered for 100 of 3 rows: it
    takes 99), and none is offered where it would be refused (`--dataset_mixer_list tr.jsonl 1e26`'s advice was
    "2500000000000000226492416.00 takes every row", whose row numbers outgrow any memory)."""
    with pytest.raises(ConfigError) as refused:
        mixture.take(mixture.Source(files["hh"], "train", amount=str(count)), usable, seed=42)
    assert f"ask for {usable} or fewer, or write a fraction to upsample ({fraction} takes every row" in str(
        refused.value
    )
    assert len(mixture.take(mixture.Source(files["hh"], "train", amount=fraction), usable, seed=42)) == count
    with pytest.raises(ConfigError) as refused:
        mixture.take(mixture.Source(files["hh"], "train", amount="9" * 26), 40, seed=42)
    assert str(refused.value).endswith(f"the mixture asks for {'9' * 26}: ask for 40 or fewer")


def test_an_amount_yaml_read_as_a_boolean_is_refused_naming_that_reading(files):
    """`{path: tr.jsonl, amount: yes}` was refused as "amount 'true'", a word the user never wrote."""
    recipe = parse_args(["--config", SMOKE, "--datasets", f"{{path: {files['trl']}, amount: yes}}"])
    with pytest.raises(ConfigError) as refused:
        mixture.parse(mixture.fields_of(recipe))
    assert "amount is the boolean true, which YAML reads from an unquoted yes, no, on or off" in str(refused.value)


def test_a_source_draws_the_same_rows_however_its_path_is_spelled(files, tmp_path, monkeypatch):
    """Rows are drawn by what the source is (`Source.identity`), so a relative name, a full path and a link to the file
    draw the same rows; another file, or a Hub data set's other split, another sample."""
    monkeypatch.chdir(Path(files["hh"]).parent)
    (tmp_path / "link.csv").symlink_to(files["hh"])
    spellings = ["hh.csv", "./hh.csv", files["hh"], str(tmp_path / "link.csv")]
    draws = [mixture.take(mixture.Source(name, "train", amount="0.5"), 20, seed=42) for name in spellings]
    assert all(np.array_equal(draws[0], draw) for draw in draws[1:])
    other = mixture.take(mixture.Source(files["trl"], "train", amount="0.5"), 20, seed=42)
    hub = [mixture.take(mixture.Source("org/set", split, amount="0.5"), 20, seed=42) for split in ("train", "test")]
    assert not np.array_equal(draws[0], other) and not np.array_equal(*hub)


def test_a_builders_pattern_or_data_dir_draws_the_same_rows_however_it_is_spelled(files, tmp_path, monkeypatch):
    """`{path: json, data_files: 'pairs/*.jsonl', amount: 0.5}` drew its rows by the pattern as written: `./pairs/...`,
    its full path (a Slurm job's) or a link to the folder each drew another half of the same files than the dry run and
    the analyzer had measured. Drawn by the files' real paths, they draw the same rows; another folder, others."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs").mkdir()
    shutil.copy(files["trl"], tmp_path / "pairs" / "a.jsonl")
    (tmp_path / "link").symlink_to(tmp_path / "pairs")
    (tmp_path / "other").mkdir()
    shutil.copy(files["trl"], tmp_path / "other" / "a.jsonl")
    patterns = ["pairs/*.jsonl", "./pairs/*.jsonl", str(tmp_path / "pairs" / "*.jsonl"), "link/*.jsonl", ["pairs/*"]]
    sources = [mixture.Source("json", "train", data_files=p, amount="0.5") for p in patterns]
    sources += [mixture.Source("json", "train", data_dir=d, amount="0.5") for d in ("pairs", str(tmp_path / "link"))]
    draws = [mixture.take(s, 40, seed=42) for s in sources]
    assert all(np.array_equal(draws[0], draw) for draw in draws[:4]), [s.identity() for s in sources]
    assert np.array_equal(draws[5], draws[6])
    other = mixture.Source("json", "train", data_files="other/*.jsonl", amount="0.5")
    assert not np.array_equal(draws[0], mixture.take(other, 40, seed=42))


def test_an_amount_that_takes_no_pair_is_refused_as_an_amount_of_0_is(files):
    """`--dataset_mixer_list big.jsonl 1.0 small.jsonl 0.01`: floor(0.01 x 20) = 0, and the run trained without the
    source it named (`took 0 (0.01)`), while an amount of 0 is refused as written."""
    with pytest.raises(ConfigError, match=r"has 20 usable rows and amount 0.01 takes none of them \(floor\(0.01 x 20"):
        mixture.take(mixture.Source(files["hh"], "train", amount="0.01"), 20, seed=42)
    assert len(mixture.take(mixture.Source(files["hh"], "train", amount="0.05"), 20, seed=42)) == 1
    # A source of one row: it read "has 1 usable rows ... takes none of them"
    with pytest.raises(ConfigError, match=r"has 1 usable row and amount 0.5 takes none \(floor\(0.5 x 1\) = 0\)"):
        mixture.take(mixture.Source(files["hh"], "train", amount="0.5"), 1, seed=42)
    with pytest.raises(ConfigError, match="has 1 usable row and the mixture asks for 2: "):
        mixture.take(mixture.Source(files["hh"], "train", amount="2"), 1, seed=42)
    one = {"source": "a.jsonl [train]", "rows_read": 1, "rows_usable": 1, "taken": 1, "amount": "1.0"}
    assert mixture.describe({**one, "upsampled": False}).startswith("a.jsonl [train]: 1 row, took 1 (1.0)")


def test_a_source_max_length_drops_is_counted_and_one_it_drops_whole_is_refused(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """Pairs of one source dropped at max_length (their prompts alone fill it): the record, summary and model card
    said the source's pairs were taken, nothing of the drop; every pair of it dropped, the run trained on the other
    source alone, exit code 0, the only word the mixture's count of pairs dropped."""
    from dpotrain.hub import hub

    smoke = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:24]]
    for row in smoke[16:]:
        for side in ("chosen", "rejected"):
            row[side][0]["content"] += " please" * 400
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text("".join(json.dumps(row) + "\n" for row in smoke[:20]))  # 4 of them long: dropped, counted
    long.write_text("".join(json.dumps(row) + "\n" for row in smoke[16:]))  # every one long
    args = ["--model_name_or_path", tiny_model_dir, "--max_length", "256", "--max_tokens_per_microbatch", "512"]
    args += ["--dataset_mixer_list", str(short), "1.0"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), *args, "--dry-run"]))
    out = capsys.readouterr().out
    assert ended.value.code in (0, None), out
    (record,) = json.loads((tmp_path / "run.dry-run.json").read_text())["derived"]["data_sources"]
    assert record["taken"] == 20 and record["dropped_at_max_length"] == 4
    assert (
        "took 20 (1.0), " in out and "of the tokens; 4 of them dropped at max_length (the prompt alone fills it)" in out
    )
    assert "| 20, 4 dropped at max_length |" in hub.sources_section([record])
    error = refused(tmp_path, monkeypatch, capsys, *args, str(long), "1.0")
    assert f"mixture source {long} [train]: max_length 256 leaves none of its 8 pairs anything to learn" in error
    assert "would train nothing (8 dropped: the prompt alone fills it" in error and "or remove the source" in error


def test_a_held_out_source_max_length_drops_whole_is_refused(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """A held-out mixture source whose every pair max_length drops (the prompt alone fills it): the run evaluated on
    the other source alone, without a word, its record naming the source as evaluated. Refused as a training source
    is, before the model loads, naming the source, a max_length that keeps it, and removing it."""
    smoke = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:24]]
    for row in smoke[16:]:
        for side in ("chosen", "rejected"):
            row[side][0]["content"] += " please" * 400
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text("".join(json.dumps(row) + "\n" for row in smoke[:16]))
    long.write_text("".join(json.dumps(row) + "\n" for row in smoke[16:]))  # every one long
    args = ["--model_name_or_path", tiny_model_dir, "--max_length", "256", "--max_tokens_per_microbatch", "512"]
    args += ["--dataset_mixer_list", str(short), "1.0", "--eval_strategy", "steps", "--eval_steps", "2"]
    error = refused(
        tmp_path, monkeypatch, capsys, *args, "--dataset_mixer_eval_list", str(short), "1.0", str(long), "1.0"
    )
    shortest = min(len(json.dumps(row)) for row in smoke[16:])  # a bound: the prompt's tokens are fewer than its chars
    assert f"held-out mixture source {long} [test]: max_length 256 drops all of its 8 pairs" in error, error
    assert "the prompt alone fills it, the shortest is " in error and "or remove the source" in error, error
    fix = int(error.split("pass --max_length ")[1].split(" or more (it keeps the shortest), or remove")[0])
    assert 256 < fix < shortest, error


# --- the held-out mixture, trained --------------------------------------------------------------------------------


def held_out(folder: Path) -> dict[str, Path]:
    """Two held-out sources of 10 and 8 pairs, for `held_out_mixture`."""
    held = {}
    for name, n, seed in (("held_a", 10, 13), ("held_b", 8, 17)):
        held[name] = folder / f"{name}.jsonl"
        datasets.Dataset.from_list(builtin.make_preference_rows(n, seed=seed)).to_json(held[name])
    return held


def held_out_mixture(held: dict[str, Path]) -> list[str]:
    """`--dataset_mixer_eval_list` of `held_out`'s sources (6 pairs and half of 8), evaluated at step 2."""
    return [
        *("--dataset_mixer_eval_list", str(held["held_a"]), "6", str(held["held_b"]), "0.5"),
        *("--eval_strategy", "steps", "--eval_steps", "2"),
    ]


@pytest.fixture(scope="module")
def one_process(files, tmp_path_factory):
    """The mixture trained for 2 steps on one process, evaluated on a held-out mixture at step 2, and its dry run (one
    run for both: what a training mixture records does not depend on a held-out one, which the record keeps apart)."""
    out = tmp_path_factory.mktemp("run") / "out"
    held = held_out(out.parent)
    args = ["--config", SMOKE, *mixer(files), *held_out_mixture(held), "--output_dir", str(out)]
    args += ["--max_steps", "2", "--save_steps", "2"]
    dry = run_train([*args, "--dry-run"])
    assert dry.returncode == 0, dry.stdout[-3000:]
    run = run_train(args)
    assert run.returncode == 0, run.stdout[-3000:]
    planned = json.loads((out.parent / "out.dry-run.json").read_text())
    return out, dry.stdout, planned, json.loads((out / "resolved_config.json").read_text()), held


@pytest.mark.slow
def test_the_run_trains_exactly_the_pairs_the_mixture_names(one_process, files):
    out, _, _, resolved, _ = one_process
    sources = by_source(resolved["derived"]["data_sources"], files)
    assert {name: r["taken"] for name, r in sources.items()} == TAKEN
    assert {name: r["rows_read"] for name, r in sources.items()} == ROWS
    assert {name: r["upsampled"] for name, r in sources.items()} == {"trl": False, "uf": False, "hh": True}
    assert resolved["derived"]["dataset_rows"] == sum(TAKEN.values())
    assert abs(sum(r["token_share"] for r in sources.values()) - 1) < 1e-3
    assert all(r["identity"]["files"] for r in sources.values())  # each file's SHA-256


@pytest.mark.slow
def test_the_dry_run_and_the_model_card_describe_it_as_the_run_records_it(one_process, files):
    out, printed, planned, resolved, _ = one_process
    recorded = resolved["derived"]["data_sources"]
    keys = ("source", "rows_read", "rows_usable", "taken", "upsampled", "taken_sha256", "tokens", "token_share")
    assert [{k: r[k] for k in keys} for r in planned["derived"]["data_sources"]] == [
        {k: r[k] for k in keys} for r in recorded
    ]
    card = (out / "README.md").read_text()
    for r in recorded:
        assert mixture.describe(r) in printed
        name = r["source"].split(" [")[0].split(":")[0]  # a local file by its name alone, not this machine's path
        source = r["source"].replace(name, Path(name).name if Path(name).is_file() else name, 1)
        assert f"| `{source}` | {r['rows_read']} |" in card and f"{r['token_share']:.1%}" in card


@pytest.mark.slow
def test_two_processes_take_the_same_pairs(one_process, files, tmp_path):
    out = tmp_path / "two"
    launch_smoke(2, [*mixer(files), "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no"])
    two = json.loads((out / "resolved_config.json").read_text())["derived"]["data_sources"]
    one = one_process[3]["derived"]["data_sources"]
    assert [(r["taken"], r["taken_sha256"], r["tokens"]) for r in two] == [
        (r["taken"], r["taken_sha256"], r["tokens"]) for r in one
    ]


@pytest.mark.slow
def test_a_resumed_run_with_another_mixture_or_changed_file_is_refused(one_process, files, tmp_path):
    out, held = one_process[0], one_process[4]
    same = parse_args(
        ["--config", SMOKE, *mixer(files), *held_out_mixture(held), "--output_dir", str(out), "--max_steps", "2"]
    )
    assert resolve.changed_settings(same, out, 8) == []
    other = [*mixer(files)[:-1], "1.0"]  # the HH source once instead of 1.5 times
    changed = resolve.changed_settings(
        parse_args(["--config", SMOKE, *other, *held_out_mixture(held), "--max_steps", "2"]), out, 8
    )
    assert changed and changed[0].startswith("dataset_mixer_list:")
    copy = tmp_path / "out"
    copy.mkdir()
    (copy / "resolved_config.json").write_text((out / "resolved_config.json").read_text())
    with open(files["trl"], "rb") as f:
        original = f.read()
    try:
        with open(files["trl"], "ab") as f:
            f.write(original.splitlines(keepends=True)[0])
        changed = resolve.changed_settings(same, copy, 8)
        assert changed and changed[0].startswith("dataset content: ") and "trl.jsonl" in changed[0]
    finally:
        with open(files["trl"], "wb") as f:
            f.write(original)


@pytest.mark.slow
def test_a_dry_run_with_relative_names_draws_the_pairs_the_job_with_full_paths_trains(one_process, files, tmp_path):
    """launch.sh passes a Slurm job's relative paths in full, and a source's rows were drawn by its spelling: the dry
    run (and the analyzer) typed in the files' folder as `trl.jsonl 0.5 ...` measured other pairs than the job trained
    (another taken_sha256 per sampled source). Drawn by what the source is (its real path), they are the same pairs."""
    folder = Path(files["trl"]).parent
    relative = ["--dataset_mixer_list", "trl.jsonl", "0.5", "uf.parquet", "12", "hh.csv", "1.5"]
    args = ["--config", SMOKE, *relative, "--output_dir", str(tmp_path / "new"), "--max_steps", "2", "--dry-run"]
    dry = run_train(args, cwd=folder)
    assert dry.returncode == 0, dry.stdout[-3000:]
    planned = json.loads((tmp_path / "new.dry-run.json").read_text())["derived"]["data_sources"]
    recorded = one_process[3]["derived"]["data_sources"]
    assert [(r["taken"], r["taken_sha256"]) for r in planned] == [(r["taken"], r["taken_sha256"]) for r in recorded]
    assert [r["drawn_by"] for r in recorded] == [str(Path(files[name]).resolve()) for name in ("trl", "uf", "hh")]


@pytest.mark.slow
def test_a_continued_run_draws_each_source_as_its_record_says(one_process, files, tmp_path, monkeypatch):
    """A continued run draws each source's pairs by what its record says drew them (`drawn_by`), however the source is
    named now. A record written before `drawn_by` drew by the source's spelling then, which is read from its `source`:
    the steps left train the pairs the run started on, not the ones a new run would draw."""
    from dpotrain.recipe import run_record

    monkeypatch.chdir(Path(files["trl"]).parent)
    recipe = parse_args(
        ["--config", SMOKE, "--dataset_mixer_list", "trl.jsonl", "0.5", "uf.parquet", "12", "hh.csv", "1.5"]
    )
    names = ("trl", "uf", "hh")
    now = [f"{n}.{suffix} [train]" for n, suffix in zip(names, ("jsonl", "parquet", "csv"), strict=True)]
    assert mixture.drawn_by(recipe, str(one_process[0])) == {
        n: str(Path(files[k]).resolve()) for n, k in zip(now, names, strict=True)
    }
    record = json.loads((one_process[0] / "resolved_config.json").read_text())
    del record[run_record.SEAL]
    for entry in record["derived"]["data_sources"]:
        del entry["drawn_by"]
    (tmp_path / "resolved_config.json").write_text(json.dumps(run_record.sealed(record)))
    spellings = {n: f"{files[k]} [train]" for n, k in zip(now, names, strict=True)}
    assert mixture.drawn_by(recipe, str(tmp_path)) == spellings
    # and the draw itself: trl.jsonl's 0.5 is a seeded sample, its spelling then another one than its real path
    trl = mixture.Source(files["trl"], "train", amount="0.5")
    by_spelling, by_path = (mixture.take(trl, 40, 42, drawn_by=key) for key in (spellings[now[0]], trl.identity()))
    assert not np.array_equal(by_spelling, by_path)


# --- refusals by source -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_bad_row_is_named_by_its_source_and_line(files, tmp_path):
    rows = explicit_prompt(10)
    rows[6]["rejected"] = None
    bad = tmp_path / "bad.jsonl"
    datasets.Dataset.from_list(rows).to_json(bad)
    result = run_train(
        [
            "--config",
            SMOKE,
            "--dataset_mixer_list",
            files["uf"],
            "1.0",
            str(bad),
            "1.0",
            "--dry-run",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert result.returncode != 0
    error = next(line for line in result.stdout.splitlines() if line.startswith("error:"))
    assert f"line 7 of {bad};" in error and "'rejected'" in error  # by its path: another source's bad.jsonl apart


@pytest.mark.slow
def test_skip_invalid_counts_per_source(files, tmp_path):
    rows = explicit_prompt(10)
    rows[2]["chosen"] = rows[2]["rejected"]
    bad = tmp_path / "bad.jsonl"
    datasets.Dataset.from_list(rows).to_json(bad)
    result = run_train(
        [
            "--config",
            SMOKE,
            "--dataset_mixer_list",
            files["uf"],
            "1.0",
            str(bad),
            "1.0",
            "--dry-run",
            "--skip_invalid",
            "true",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert result.returncode == 0, result.stdout[-2000:]
    derived = json.loads((tmp_path / "out.dry-run.json").read_text())["derived"]
    assert (
        list(derived["invalid_rows"]) == [f"{bad} [train]"]
        and derived["invalid_rows"][f"{bad} [train]"]["dropped"] == 1
    )
    assert [(r["rows_read"], r["rows_usable"], r["taken"]) for r in derived["data_sources"]] == [
        (30, 30, 30),
        (10, 9, 9),
    ]


# --- TRL's recipe -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trls_datasets_recipe_trains(files, tmp_path):
    """`datasets:` as TRL's docs write it (path: json + data_files; TRL's `fraction` shares: normalized, the largest
    mixture that needs no row twice, the first rows), refused as "unknown key 'datasets'" before."""
    recipe = (
        (ROOT / "configs" / "smoke.yaml")
        .read_text()
        .replace(
            "dataset_name: data/smoke_prefs.jsonl",
            f"datasets:\n  - path: json\n    data_files: {files['trl']}\n    fraction: 0.75\n"
            f"  - path: parquet\n    data_files: [{files['uf']}]\n    fraction: 0.25\n    split: train\n",
        )
    )
    (tmp_path / "trl.yaml").write_text(recipe)
    out = tmp_path / "out"
    result = run_train(["--config", str(tmp_path / "trl.yaml"), "--output_dir", str(out), "--max_steps", "2"])
    assert result.returncode == 0, result.stdout[-3000:]
    sources = json.loads((out / "resolved_config.json").read_text())["derived"]["data_sources"]
    # weights 0.75/0.25; largest total with no source short: min(40 / 0.75, 30 / 0.25) = 53.3 -> 40 and 13 rows
    assert [r["taken"] for r in sources] == [40, 13]
    assert (out / "run_complete.json").exists()


# --- the reference cache, reused pair by pair -------------------------------------------------------------------------


def complete_cache(cache) -> dict:
    (folder,) = [p.parent for p in (cache / "reference").glob("*/complete.npz")]
    with np.load(folder / "complete.npz") as f:
        return {k: np.asarray(f[k]) for k in f.files}


@pytest.mark.slow
def test_a_source_added_scores_only_its_pairs_with_the_values_a_fresh_run_gets(files, tmp_path):
    """The mixture scored once (--reference-only), then trained with a fourth source: the first three sources' pairs
    come from the first run's cache (counted in the run's record), only the new ones are scored, and every pair's
    values equal a fresh scoring of the whole new mixture (fp32: the pairs met other micro-batches there)."""
    more = tmp_path / "more.jsonl"
    datasets.Dataset.from_list(builtin.make_preference_rows(8, seed=11)).to_json(more)
    shared, fresh = tmp_path / "shared-cache", tmp_path / "fresh-cache"
    first = run_train(["--config", SMOKE, *mixer(files), "--reference-only"], env={"DPOTRAIN_CACHE": str(shared)})
    assert first.returncode == 0 and f"reference log-probs (train): {sum(TAKEN.values())} scored" in first.stdout
    (old,) = (shared / "reference").iterdir()
    out = tmp_path / "out"
    grown = [*mixer(files), str(more), "8"]
    second = run_train(
        # 2 steps of 35: every one of the 70 pairs trained (the reference stage scores those the steps train)
        ["--config", SMOKE, *grown, "--output_dir", str(out), "--max_steps", "2", "--pairs_per_step", "35"]
        + ["--save_strategy", "no"],
        env={"DPOTRAIN_CACHE": str(shared)},
    )
    assert second.returncode == 0, second.stdout[-3000:]
    record = json.loads((out / "resolved_config.json").read_text())["derived"]["reference"]["train"]
    assert (record["reused_from_other_runs"], record["scored"]) == (sum(TAKEN.values()), 8), record
    assert f"{sum(TAKEN.values())} reused from other runs' caches" in second.stdout
    shutil.rmtree(old)  # the first run's cache: what is left is the second run's own
    again = run_train(["--config", SMOKE, *grown, "--reference-only"], env={"DPOTRAIN_CACHE": str(fresh)})
    assert again.returncode == 0 and f"reference log-probs (train): {sum(TAKEN.values()) + 8} scored" in again.stdout
    reused, scored = complete_cache(shared), complete_cache(fresh)
    assert (reused["digests"] == scored["digests"]).all()
    for side in ("chosen", "rejected"):
        relative = np.abs(reused[side] - scored[side]) / np.maximum(1, np.abs(scored[side]))
        assert relative.max() <= 1e-5, (side, relative.max())


# --- a preempted mixture run --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_preempted_run_resumes_on_the_same_pairs_in_the_same_steps(files, tmp_path):
    """A stop request (the stop file Slurm's trap writes, tests/test_preemption.py) already there when training starts
    stops the run at step 1 with a checkpoint (the reference comes from the uninterrupted run's cache, so the stage has
    nothing to stop); the rerun of the same command resumes and ends like the uninterrupted run: the same per-source
    pairs, the same loss at every step, the same weights."""
    from safetensors.torch import load_file

    from dpotrain.train.preemption import STOPPED_EXIT

    args = ["--config", SMOKE, *mixer(files), "--max_steps", "4", "--logging_steps", "1", "--save_steps", "1000"]
    whole, stopped, stop_file = tmp_path / "whole", tmp_path / "stopped", tmp_path / "stop"
    assert run_train([*args, "--output_dir", str(whole)]).returncode == 0
    stop_file.touch()
    first = run_train([*args, "--output_dir", str(stopped)], env={"DPOTRAIN_STOP_FILE": str(stop_file)})
    assert first.returncode == STOPPED_EXIT, first.stdout[-3000:]
    assert stop_file.with_name("stop.checkpointed").read_text().startswith(f"checkpoint {stopped}/checkpoint-1 ")
    stop_file.unlink()
    rerun = run_train([*args, "--output_dir", str(stopped)], env={"DPOTRAIN_STOP_FILE": str(stop_file)})
    assert rerun.returncode == 0 and f"Resuming from {stopped}/checkpoint-1" in rerun.stdout, rerun.stdout[-3000:]

    def per_step(out) -> list[tuple]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["rewards/margins"]) for r in map(json.loads, lines) if "loss" in r]

    def sources(out) -> list[tuple]:
        records = json.loads((out / "resolved_config.json").read_text())["derived"]["data_sources"]
        return [(r["source"], r["taken"], r["taken_sha256"]) for r in records]

    assert sources(stopped) == sources(whole)
    assert [s for s, *_ in per_step(stopped)] == [1, 2, 3, 4]
    for (_, *got), (_, *want) in zip(per_step(stopped), per_step(whole), strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    expected, got = load_file(str(whole / "model.safetensors")), load_file(str(stopped / "model.safetensors"))
    assert all((got[k] - w).abs().max().item() < 1e-6 for k, w in expected.items())


# --- the held-out mixture ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_evaluation_runs_on_the_held_out_mixture(one_process):
    """`--dataset_mixer_eval_list`: the held-out pairs are taken as a training mixture's are, recorded per source
    (`derived.eval_sources`, the dry run's the same), scored by the reference stage and evaluated on."""
    out, _, planned, resolved, held = one_process
    derived, planned = resolved["derived"], planned["derived"]
    recorded = [(r["source"], r["rows_read"], r["taken"], r["taken_sha256"]) for r in derived["eval_sources"]]
    # the split defaults to dataset_test_split; a local file is read whole under that name
    assert [r[:3] for r in recorded] == [(f"{held['held_a']} [test]", 10, 6), (f"{held['held_b']} [test]", 8, 4)]
    assert [(r["source"], r["taken"], r["taken_sha256"]) for r in planned["eval_sources"]] == [
        (s, taken, sha) for s, _, taken, sha in recorded
    ]
    assert derived["eval_rows"] == 10 and derived["reference"]["eval"]["pairs"] == 10
    assert derived["dataset_rows"] == sum(TAKEN.values())  # the training mixture is untouched by the held-out one
    evaluated = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [2]


@pytest.mark.slow
def test_eval_strategy_with_a_training_mixture_but_no_held_out_one_is_refused(files, tmp_path):
    result = run_train(
        [
            "--config",
            SMOKE,
            *mixer(files),
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--dry-run",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert result.returncode != 0
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert "eval_strategy with a training mixture needs its held-out pairs" in error
    assert "--dataset_mixer_eval_list SOURCE AMOUNT" in error and "Mixture:" not in result.stdout  # before any read


@pytest.mark.slow
def test_the_preflight_reads_the_mixture_training_takes_and_never_writes_over_a_source(files, tmp_path):
    """scripts/preflight.py (`PREFLIGHT=1` in the sbatch scripts) judges the pairs the run trains on: the mixture's,
    taken as training takes them, not `dataset_name` (unset with a mixture)."""
    from conftest import python

    def preflight(*extra):
        command = [
            python(),
            str(ROOT / "scripts" / "preflight.py"),
            "--config",
            SMOKE,
            *mixer(files),
            "--sample",
            "8",
            "--output_dir",
            str(tmp_path / "out"),
            *extra,
        ]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)

    report = tmp_path / "preflight.json"
    result = preflight("--json", str(report))
    assert result.returncode in (0, 3), result.stdout[-2000:] + result.stderr[-2000:]
    judged = json.loads(report.read_text())
    assert judged["quality_rows"] == sum(TAKEN.values()), judged
    sources = mixture.parse(mixture.fields_of(parse_args(["--config", SMOKE, *mixer(files)])))
    assert judged["setup"]["dataset"] == [s.spec() for s in sources]
    before = Path(files["trl"]).read_bytes()
    refused = preflight("--json", files["trl"])
    assert refused.returncode != 0 and "is one of this command's inputs" in refused.stderr, refused.stderr[-2000:]
    assert Path(files["trl"]).read_bytes() == before


@pytest.mark.parametrize("order", ["with them first", "without them first"])
def test_a_source_with_chat_template_kwargs_joins_one_without_them(order, tmp_path):
    """One source's rows carry chat_template_kwargs, the other's none: the other's were joined as null, and TRL's
    `**chat_template_kwargs` failed on them after the model had loaded (TypeError: 'NoneType' object is not a
    mapping); written second, the join itself failed (cannot cast the struct to null)."""
    with_them = [p | {"chat_template_kwargs": {"enable_thinking": False}} for p in builtin.make_preference_rows(4)]
    files = {"with": with_them, "without": builtin.make_preference_rows(6, seed=9)}
    for name, pairs in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    names = ["with", "without"] if order == "with them first" else ["without", "with"]
    argv = [
        "--config",
        SMOKE,
        "--dataset_mixer_list",
        *(x for n in names for x in (str(tmp_path / f"{n}.jsonl"), "1.0")),
    ]
    sources = mixture.parse(mixture.fields_of(parse_args(argv)))
    joined, _ = mixture.load(sources, 42, rows.RowRules(say=False), {}, "invalid_rows")
    kwargs = [row["chat_template_kwargs"] for row in joined]
    assert sorted(kwargs, key=str) == [{"enable_thinking": False}] * 4 + [{}] * 6


def test_a_source_without_chat_template_kwargs_trains_none_of_the_others(tmp_path, tiny_model_dir):
    """One source's rows give `effort`, the other's give nothing. The other's rows reached TRL as `{"effort": None}`
    (the joined column's keys with no value), which a template's `is defined` takes as given: every one of them
    trained a system turn `Effort: None` that neither file holds, with no word said. They get none now."""
    template = tmp_path / "effort.jinja"
    own = (Path(tiny_model_dir) / "chat_template.jinja").read_text()
    template.write_text(
        "{% if effort is defined %}<|im_start|>system\nEffort: {{ effort }}<|im_end|>\n{% endif %}" + own
    )
    with_them = [p | {"chat_template_kwargs": {"effort": "high"}} for p in builtin.make_preference_rows(4)]
    files = {"with": with_them, "without": builtin.make_preference_rows(6, seed=9)}
    for name, pairs in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    argv = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--chat_template_path", str(template)]
    argv += ["--output_dir", str(tmp_path / "run"), "--dataset_mixer_list"]
    argv += [str(tmp_path / "with.jsonl"), "1.0", str(tmp_path / "without.jsonl"), "1.0"]
    recipe = parse_args(argv)
    pairs = stages.load_data(recipe, stages.checks(recipe), say=False).train
    tokenizer = lengths.recipe_tokenizer(recipe)
    efforts = []
    for row in pairs:  # as TRL's tokenize_fn renders each prompt: `**example.get("chat_template_kwargs", {})`
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, **row.get("chat_template_kwargs", {}))
        efforts.append(text.split("Effort: ")[1].split("<")[0] if "Effort: " in text else None)
    assert efforts == ["high"] * 4 + [None] * 6  # 'None' six times before


@pytest.mark.parametrize("order", ["plain first", "plain last"])
def test_sources_whose_messages_have_other_fields_join(order, tmp_path):
    """A source whose messages carry a `name` (or `tool_calls`) beside one whose messages have only role and content:
    datasets reads the first as Json messages (or a struct of more fields), and the join cast the second to the first's
    type, a TypeError traceback (Couldn't cast array of type string to {'role': ..., 'content': ...}) when the plain
    source came first. Each row is joined as written, its fields and no others."""

    def written(n, seed, **fields):
        return [
            {side: [m | fields if m["role"] == "user" else m for m in pair[side]] for side in ("chosen", "rejected")}
            for pair in builtin.make_preference_rows(n, seed=seed)
        ]

    files = {"plain": written(4, 1), "named": written(5, 2, name="bob"), "weighed": written(3, 3, weight="1")}
    for name, pairs in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    names = ["plain", "named", "weighed"] if order == "plain first" else ["named", "weighed", "plain"]
    argv = [
        "--config",
        SMOKE,
        "--dataset_mixer_list",
        *(x for n in names for x in (str(tmp_path / f"{n}.jsonl"), "1.0")),
    ]
    joined, _ = mixture.load(mixture.parse(mixture.fields_of(parse_args(argv))), 42, rows.RowRules(say=False), {}, "x")
    users = sorted((row["prompt"][-1] for row in joined), key=str)
    fields = [sorted(k for k, v in user.items() if v is not None) for user in users]
    assert sorted(map(tuple, fields)) == sorted(
        [("content", "role")] * 4 + [("content", "name", "role")] * 5 + [("content", "role", "weight")] * 3
    )


def test_sources_with_tools_as_json_text_and_as_a_list_join(tmp_path):
    """TRL takes a row's `tools` as a list or as JSON text (json.loads): two sources that write them each way joined
    in a traceback (cannot cast the list to a string). Each row's tools reach the template as its list."""
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    files = {
        "text": [p | {"tools": json.dumps(tools)} for p in builtin.make_preference_rows(3, seed=1)],
        "list": [p | {"tools": tools} for p in builtin.make_preference_rows(4, seed=2)],
    }
    for name, pairs in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    argv = [
        "--config",
        SMOKE,
        "--dataset_mixer_list",
        *(x for n in files for x in (str(tmp_path / f"{n}.jsonl"), "1.0")),
    ]
    joined, _ = mixture.load(mixture.parse(mixture.fields_of(parse_args(argv))), 42, rows.RowRules(say=False), {}, "x")
    assert [chat_template.template_kwargs(row)["tools"] for row in joined] == [tools] * 7


def test_the_analyzer_says_each_source_is_read_in_its_own_shape(files, cli, tiny_model_dir, capsys):
    """The analyzer's report on a mixture of HH-RLHF strings and UltraFeedback rows said `Rows read as: message lists
    with a prompt column`, the form the sources' pairs are read into, a shape none of the files has (under the
    sources' own `Data` lines, which said what each is)."""
    argv = ["--dataset_mixer_list", files["hh"], "1.0", files["uf"], "1.0", "--tokenizer", tiny_model_dir]
    assert cli.main([*argv, "--num-proc", "1"]) == 0
    out, err = capsys.readouterr()
    assert "HH-RLHF strings" in err and "UltraFeedback" in err
    assert "with a prompt column" not in out + err, out
    assert "Rows read as: message lists, each source read in its own shape (its Data line)" in out, out


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--datasets", '{{"path": "{folder}", "split": "validation"}}'], "`split` in its `datasets:` entry"),
        (
            ["--datasets", "{folder}", "--dataset_train_split", "validation"],
            "`split` in its `datasets:` entry (or --dataset_train_split, every entry's default)",
        ),
        (
            ["--dataset_mixer_list", "{folder}", "1.0", "--dataset_mixer_list_splits", "validation"],
            "--dataset_mixer_list_splits",
        ),
        (
            ["--dataset_mixer_list", "{folder}", "1.0", "--dataset_train_split", "validation"],
            "--dataset_mixer_list_splits (or --dataset_train_split, every source's default)",
        ),
    ],
    ids=["entry", "entry-default", "mixer", "mixer-default"],
)
def test_a_source_without_the_split_names_the_field_that_chose_it(args, flag, tmp_path, monkeypatch, capsys):
    """A mixture source (a Hub data set or a folder of split files, read alike) lacking the split said "choose one
    of [...]", where the single data set's refusal names its option: the line names the field that chose the split."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    for split in ("train", "test"):  # datasets reads a file named for a split as that split
        shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", folder / f"{split}.jsonl")
    error = refused(tmp_path, monkeypatch, capsys, *(a.format(folder=folder) for a in args), "--dry-run")
    assert error == f"error: dataset {str(folder)!r} has no split 'validation': set {flag} to one of ['test', 'train']"


@pytest.mark.parametrize("held_out", ["same file", "another file"])
def test_held_out_pairs_the_run_also_trains_on_are_noted_once(held_out, tmp_path, files, capsys):
    """The training file given again as held-out pairs (here spelled another way) went through without a word, its
    eval loss measuring pairs the model trained on. Not refused (tests do it on purpose): one `note:` line naming the
    source, from the main process; none for held-out pairs of their own."""
    trained = str(Path(files["trl"]).parent / ".." / Path(files["trl"]).parent.name / "trl.jsonl")  # another spelling
    given = files["trl"] if held_out == "same file" else files["uf"]
    recipe = parse_args(
        ["--config", SMOKE, "--dataset_name", trained, "--eval_strategy", "steps", "--output_dir", str(tmp_path)]
        + ["--dataset_mixer_eval_list", given, "1.0"]
    )
    stages.load_data(recipe, stages.checks(recipe))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    if held_out == "another file":
        assert notes == []
        return
    assert notes == [
        f"note: the held-out pairs of {files['trl']} [test] are pairs this run also trains on: their eval loss "
        "measures pairs the model has seen, not how it does on new ones (held-out pairs of their own: "
        "--dataset_mixer_eval_list FILE 1.0)"
    ]


def test_one_file_evaluated_on_its_own_split_is_read_as_that_split_and_noted(tmp_path, files, capsys):
    """One local file with `--eval_strategy steps --dataset_test_split train`: its one split is the training split, so
    the held-out split asked exists. It was refused as a file of one split, the fix offered being to name the file
    'train.jsonl' and 'train.jsonl'. Read as that split, with the note that the model trains on those pairs."""
    recipe = parse_args(
        ["--config", SMOKE, "--dataset_name", files["trl"], "--eval_strategy", "steps", "--output_dir", str(tmp_path)]
        + ["--dataset_test_split", "train"]
    )
    pairs = stages.load_data(recipe, stages.checks(recipe))
    assert len(pairs.eval) == len(pairs.train) > 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: the held-out pairs of {files['trl']} [train] are pairs this run also trains on: their eval loss "
        "measures pairs the model has seen, not how it does on new ones (held-out pairs of their own: "
        "--dataset_mixer_eval_list FILE 1.0)"
    ]


def test_a_held_out_file_a_training_glob_or_folder_reads_is_noted(tmp_path, files, monkeypatch):
    """`datasets: [{path: json, data_files: 'pairs/*.jsonl'}]` (or the folder `pairs/`) with `pairs/b.jsonl` held out:
    the held-out file is trained on through the pattern, and no note was said (the same file named as a training source
    was): the eval loss measured trained pairs in silence. A copy of the file elsewhere is another source."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs").mkdir()
    for name in ("a", "b"):
        shutil.copy(files["trl"], tmp_path / "pairs" / f"{name}.jsonl")
    shutil.copy(files["trl"], tmp_path / "copy.jsonl")
    glob_source = json.dumps({"path": "json", "data_files": "pairs/*.jsonl"})
    for training in (["--datasets", glob_source], ["--dataset_mixer_list", "pairs", "1.0"]):
        for held, noted in (("pairs/b.jsonl", True), ("copy.jsonl", False)):
            values = mixture.fields_of(
                parse_args(["--config", SMOKE, *training, "--dataset_mixer_eval_list", held, "1"])
            )
            assert mixture.also_trained(values) == ([f"{held} [test]"] if noted else []), (training, held)


def test_a_dry_run_that_leaves_a_hub_data_set_unread_still_notes_held_out_pairs_it_trains_on(tmp_path, capsys):
    """A Hub `dataset_name` and no training mixture: the dry run returns before reading the data, and said nothing of
    held-out pairs the run trains on, which docs/data.md says it does, as the run does."""
    recipe = parse_args(
        ["--config", SMOKE, "--dataset_name", "org/prefs", "--eval_strategy", "steps", "--output_dir", str(tmp_path)]
        + ["--dataset_mixer_eval_list", "org/prefs", "1.0", "--dataset_mixer_eval_list_splits", "train", "--dry-run"]
    )
    pairs = stages.load_data(recipe, stages.checks(recipe))
    assert pairs.train is None  # not read: on the Hub
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: the held-out pairs of org/prefs [train] are pairs this run also trains on: their eval loss measures "
        "pairs the model has seen, not how it does on new ones (held-out pairs of their own: "
        "--dataset_mixer_eval_list FILE 1.0)"
    ]


@pytest.mark.parametrize("columns", ["instruction alone", "instruction beside input"])
def test_a_sources_columns_are_kept_before_its_prompt_column_is_found(columns, tmp_path):
    """An Alpaca-shaped source (string answers, the prompt in `instruction`) with `columns: [instruction, chosen,
    rejected]`, TRL's way to keep what is read: the columns were kept only after `instruction` had been renamed
    `prompt`, so the entry was refused as naming a column the file has (`no column ['instruction'] (it has [...,
    'prompt', ...])`), and beside an `input` column the entry that leaves `input` out was refused as holding two
    prompts. TRL keeps the columns right after the load; so does the run now, and reads `instruction` as the prompt."""
    pairs = [
        {"id": i, "instruction": f"Add {i} and 2.", "chosen": f" {i + 2}.", "rejected": f" {i + 3}."} for i in range(8)
    ]
    if columns == "instruction beside input":
        pairs = [p | {"input": ""} for p in pairs]
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    entry = {"path": str(path), "columns": ["instruction", "chosen", "rejected"]}
    sources = mixture.parse(mixture.fields_of(parse_args(["--config", SMOKE, "--datasets", json.dumps(entry)])))
    joined, mix = mixture.load(sources, 42, rows.RowRules(say=False), {}, "invalid_rows")
    assert mix.records[0]["taken"] == 8
    assert joined[0] == {"prompt": "Add 0 and 2.", "chosen": " 2.", "rejected": " 3."}


def test_a_sources_tools_reach_the_template_without_fields_only_another_source_writes(tmp_path, tiny_model_dir):
    """One source's tools list `required` parameters, the other's none (an optional field of a tool's JSON schema).
    The join typed `tools` as a struct of both sources' fields, so the other source's tools reached the template with
    `"required": null`, which a template writes (`tools | tojson`, as tool-calling templates do): every one of its
    prompts trained a tool definition its file does not hold. Each source's tools are joined as written now."""

    def tools(**extra):
        parameters = {"type": "object", "properties": {"city": {"type": "string"}}, **extra}
        return [{"type": "function", "function": {"name": "weather", "description": "d", "parameters": parameters}}]

    files = {
        "required": [p | {"tools": tools(required=["city"])} for p in builtin.make_preference_rows(3, seed=1)],
        "optional": [p | {"tools": tools()} for p in builtin.make_preference_rows(4, seed=2)],
    }
    for name, pairs in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    argv = ["--config", SMOKE, "--dataset_mixer_list"]
    argv += [x for name in files for x in (str(tmp_path / f"{name}.jsonl"), "1.0")]
    joined, _ = mixture.load(mixture.parse(mixture.fields_of(parse_args(argv))), 42, rows.RowRules(say=False), {}, "x")
    tokenizer = lengths.load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}" + tokenizer.chat_template
    written = [
        json.loads(tokenizer.apply_chat_template(row["prompt"], tools=row["tools"], tokenize=False).split("\n")[0])
        for row in joined
    ]
    assert written == [t for pairs in files.values() for t in (p["tools"][0] for p in pairs)]  # `"required": null`


@pytest.mark.parametrize(
    "args",
    [
        ["--dataset_name", "org/prefs", "--dataset_train_split", "train[:10%]"],
        ["--dataset_mixer_list", "data/smoke_prefs.jsonl", "1.0", "--dataset_mixer_list_splits", "train[50%:]"],
    ],
)
def test_a_split_written_as_a_slice_is_refused_naming_the_amount(args, tmp_path, monkeypatch, capsys):
    """datasets' `train[:10%]`: a Hub data set's passed the dry run (it reads no Hub data) and failed in the job, a
    local file's was datasets' "Split name should match '^\\w+(\\.\\w+)*$'", neither naming how to train part of it."""
    line = refused(tmp_path, monkeypatch, capsys, *args, "--dry-run")
    assert line.startswith("error: split 'train[") and "is datasets' slice syntax" in line, line
    assert line.endswith("with a mixture's amount (--dataset_mixer_list <data> 1000, or 0.25 of it), or --max_steps")

"""Inputs changed between attempts, as they change: the base model re-exported with other weights at the same path, its
chat template edited, a shard of a data set folder replaced. A rerun resumes only on what the run trained on, or is
refused naming the file (docs/reliability.md, "Checkpoints and resuming").

One run (4 steps, checkpoints at 2 and 4) of a copy of the tiny model on a folder of three JSONL shards is shared;
each case starts from its folder as a kill after checkpoint-4 leaves it, changes an input in place, and puts the
input back as it was (bytes and time) when it ends."""

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_faults import FINAL, STEPS

from conftest import ROOT, in_child, python, smoke_recipe
from dpotrain.data import data_identity, mixture
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.resolve import check_output_dir

ARGS = [
    "--config",
    str(ROOT / "configs" / "smoke.yaml"),
    "--max_steps",
    str(STEPS),
    "--save_steps",
    "2",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
]
SHARDS = 3


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_model_dir):
    """The finished run, its model folder (a copy of the tiny model) and its data folder (three shards of 16 pairs)."""
    root = tmp_path_factory.mktemp("inputs")
    model, shards = root / "model", root / "shards"
    shutil.copytree(tiny_model_dir, model)
    shards.mkdir()
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    for i in range(SHARDS):
        (shards / f"part-{i}.jsonl").write_text("".join(lines[16 * i : 16 * (i + 1)]))
    out = root / "run"
    result = subprocess.run(
        command(out, model, shards), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return out, model, shards


def command(out, model, data) -> list[str]:
    return [
        python(),
        str(ROOT / "train_dpo.py"),
        *ARGS,
        "--output_dir",
        str(out),
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
    ]


@pytest.fixture
def stopped(first_run, tmp_path):
    """The run's folder as a kill after checkpoint-4 left it (in place of the finished run, whose paths it records),
    the model and data folders as they were; both are put back, bytes and times, after the test."""
    out, model, shards = first_run
    kept = tmp_path / "kept"
    for folder in (out, model, shards):
        shutil.copytree(folder, kept / folder.name)  # copy2: times kept
    for name in FINAL:
        (out / name).unlink()
    yield out, model, shards
    for folder in (out, model, shards):
        shutil.rmtree(folder)
        shutil.copytree(kept / folder.name, folder)


def refusal(out, model, data) -> str:
    """The rerun's refusal: `check_output_dir`, what train_dpo.py runs before anything loads."""
    recipe = parse_args(command(out, model, data)[2:])
    with pytest.raises(ConfigError) as refused:
        check_output_dir(recipe, 8)
    return str(refused.value)


def resumes_from(out, model, data) -> str | None:
    return check_output_dir(parse_args(command(out, model, data)[2:]), 8).resume_from


def reexport(source, model, scale: float) -> None:
    """The model of `source` saved at `model`, each weight moved by `scale` x noise (0: the same weights)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(source))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in loaded.parameters():
            parameter.add_(scale * torch.randn_like(parameter))
    loaded.save_pretrained(str(model))


@pytest.mark.slow
def test_the_run_records_every_file_of_its_model_and_of_its_data_folder(first_run):
    derived = json.loads((first_run[0] / "resolved_config.json").read_text())["derived"]
    assert sorted(derived["data_identity"]) == [f"part-{i}.jsonl" for i in range(SHARDS)]  # it was None
    files = derived["model_identity"]["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= set(files), files


@pytest.mark.slow
def test_a_model_re_exported_with_other_weights_at_the_same_path_is_refused(stopped, tmp_path):
    out, model, shards = stopped
    size = (model / "model.safetensors").stat().st_size
    reexport(model, model, 0.01)
    assert (model / "model.safetensors").stat().st_size == size  # the same size: only the content tells
    # The same command, as a requeue runs it: one line, before anything loads.
    result = subprocess.run(
        command(out, model, shards), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"error: output_dir {str(out)!r} holds an unfinished run with other settings (model: "
        f"{model}: model.safetensors has other content (SHA-256 "
    ), last
    assert "Resuming" not in result.stdout and "Loading" not in result.stdout
    # Re-exported with the weights it had: a new time, the same bytes; the run resumes.
    reexport(tmp_path / "kept" / "model", model, 0.0)
    assert resumes_from(out, model, shards) == str(out / "checkpoint-4")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "config.json"])
def test_an_edited_template_or_tokenizer_file_of_the_model_folder_is_refused(stopped, name):
    out, model, shards = stopped
    path = model / name
    text = path.read_text()
    if name == "chat_template.jinja":  # the assistant's turn opened with a space: pairs tokenized another way
        path.write_text(text.replace("<|im_start|>assistant", "<|im_start|>assistant ", 1))
    elif name == "config.json":  # fewer positions: the cap of `max_length: auto`'s choice, and another model
        path.write_text(json.dumps(json.loads(text) | {"max_position_embeddings": 256}, indent=2))
    else:  # the same size, one character changed
        path.write_text(text.replace('"<|endoftext|>"', '"<|endoftexT|>"', 1))
    assert path.read_text() != text
    message = refusal(out, model, shards)
    assert f"(model: {model}: {name} has " in message, message


@pytest.mark.slow
def test_a_replaced_shard_of_a_data_folder_is_refused_and_the_original_resumes(stopped):
    out, _, shards = stopped
    shard = shards / "part-1.jsonl"
    original = shard.read_bytes()
    other = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[100:116]
    shard.write_text("".join(other))  # 16 other pairs in place of the shard's 16
    message = refusal(out, stopped[1], shards)
    assert "(dataset content: part-1.jsonl has " in message, message
    (shards / "part-3.jsonl").write_text("".join(other))  # a shard added: more pairs in the same folder
    shard.write_bytes(original)
    assert "(dataset content: part-3.jsonl is new since the run started)" in refusal(out, stopped[1], shards)
    (shards / "part-3.jsonl").unlink()
    assert resumes_from(out, stopped[1], shards) == str(out / "checkpoint-4")  # its own bytes, a new time


def test_a_mixture_sources_data_files_and_shard_folders_are_known_by_content(tmp_path):
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        (shards / f"part-{i}.jsonl").write_text("".join(lines[16 * i : 16 * (i + 1)]))
    entries = [
        {"path": str(shards)},
        {"path": "json", "data_files": [str(shards / "part-0.jsonl"), str(shards / "part-1.jsonl")]},
    ]
    recipes = [
        parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--datasets", json.dumps(e)]) for e in entries
    ]
    records = []
    for recipe in recipes:
        (source,) = mixture.parse(mixture.fields_of(recipe))
        records.append({"data_sources": [{"source": source.spec(), "identity": mixture.identity_of(source)}]})
    assert [sorted(r["data_sources"][0]["identity"]["files"]) for r in records] == [
        ["part-0.jsonl", "part-1.jsonl"]
    ] * 2
    (shards / "part-1.jsonl").write_text("".join(lines[40:56]))
    for recipe, record in zip(recipes, records, strict=True):
        why = mixture.content_changed(recipe, record)
        assert why and why.endswith("part-1.jsonl has 22412 bytes, the run trained on 14312"), why


def test_another_data_file_copied_over_with_its_size_and_time_is_refused_and_a_chmod_resumes(tmp_path):
    """A data file's size and modification time say "unchanged" only while its change time agrees: `cp -p` of other
    pairs of the same size over the file (a job staging data the way docs/reliability.md advises for models) keeps
    both, and was resumed on as the pairs the run trained on. A chmod or a move changes only the change time: the
    file is hashed again and resumes."""
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    record = data_identity.of_files({"pairs.jsonl": data})
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "a", "chosen": "x", "rejected": "c"}\n')
    then = data.stat()
    os.utime(other, ns=(then.st_atime_ns, then.st_mtime_ns))
    time.sleep(0.05)  # past a coarse file-system clock tick: the copy's change time is a later one
    data.chmod(0o600)
    assert data_identity.changed_files(record, {"pairs.jsonl": data}) is None  # hashed again: the same pairs
    subprocess.run(["cp", "-p", str(other), str(data)], check=True)
    now = data.stat()
    assert (now.st_size, now.st_mtime_ns) == (then.st_size, then.st_mtime_ns)
    why = data_identity.changed_files(record, {"pairs.jsonl": data})
    assert why and why.startswith("pairs.jsonl has other content (SHA-256"), why


@pytest.mark.parametrize("given", ["file", "folder"])
def test_a_data_file_replaced_with_its_time_kept_is_read_anew_not_from_datasets_older_copy(given, tmp_path):
    """datasets keeps its Arrow copy of a local file by the file's path and modification time alone: other pairs put in
    its place with that time kept (`cp -p`, `rsync -a`, `tar x` of another export) were read from the copy of the old
    ones, and a new run trained on the 16 pairs the file held before, recording the SHA-256 of the 40 it holds now.
    The copy is made again where a data file changed after it (by its change time, which no copy keeps)."""
    from dpotrain.data import data

    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    folder = tmp_path / "pairs"
    folder.mkdir()
    path = folder / "part-0.jsonl"
    path.write_text("".join(lines[:16]))
    name = str(path if given == "file" else folder)
    assert len(data.load_preference_dataset(name, say=False)) == 16
    other = tmp_path / "other.jsonl"
    other.write_text("".join(lines[100:140]))
    then = path.stat()
    os.utime(other, ns=(then.st_atime_ns, then.st_mtime_ns))
    subprocess.run(["cp", "-p", str(other), str(path)], check=True)
    assert path.stat().st_mtime_ns == then.st_mtime_ns
    loaded = data.load_preference_dataset(name, say=False)
    assert len(loaded) == 40 and loaded[0]["chosen"] == json.loads(lines[100])["chosen"]
    assert len(data.load_preference_dataset(name, say=False)) == 40  # unchanged since: the copy made now is read


def first_answer(row: dict) -> dict:
    return {"answer": row["chosen"][-1]["content"]}


@pytest.mark.parametrize("given", ["Dataset", "DatasetDict"])
def test_a_saved_data_sets_arrow_file_replaced_is_not_read_through_the_old_pairs_map_caches(given, tmp_path):
    """datasets names the caches of maps over a saved split (`cache-*.arrow` beside its data: TRL's tokenization, the
    rows' checks) by the fingerprint its state.json holds: another export's `data-*.arrow` copied over the split's
    (state.json kept) was read through the old pairs' caches, and a new run trained on the old pairs' tokens (its
    num_tokens the old run's) under a record of the new file's SHA-256. A saved split is known by its files now."""
    import datasets

    from dpotrain.data import data

    lines = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()]
    saved, other = tmp_path / "saved", tmp_path / "other"
    for folder, rows in ((saved, lines[:16]), (other, lines[100:116])):
        made = datasets.Dataset.from_list(rows)
        (made if given == "Dataset" else datasets.DatasetDict({"train": made})).save_to_disk(folder)
    split = "" if given == "Dataset" else "train"
    mapped = data.load_preference_dataset(str(saved), say=False).map(first_answer)
    assert mapped[0]["answer"] == lines[0]["chosen"][-1]["content"]
    assert any(p.name.startswith("cache-") for p in (saved / split).iterdir())  # the map's cache, beside the data
    shutil.copy(other / split / "data-00000-of-00001.arrow", saved / split / "data-00000-of-00001.arrow")
    mapped = data.load_preference_dataset(str(saved), say=False).map(first_answer)
    assert mapped[0]["answer"] == lines[100]["chosen"][-1]["content"]


def test_large_weights_are_known_by_their_ends_and_time(tmp_path):
    """A file over 2 MiB is hashed at its ends only: a re-export with other weights in its middle (the same size, the
    same first and last MiB) is still refused, by its new time; the `touch` the message gives puts a copy right, in a
    folder with a space in its name too (typed back, it touched two other paths)."""
    path = tmp_path / "my sft" / "model.safetensors"
    path.parent.mkdir()
    weights = {"a.first": torch.zeros(300_000), "b.middle": torch.zeros(300_000), "c.last": torch.zeros(300_000)}
    save_file(weights, str(path))
    assert path.stat().st_size > 3 * data_identity.ENDS
    record = data_identity.of_files({"model.safetensors": path}, ends=True)
    assert "sha256_ends" in record["model.safetensors"] and "sha256" not in record["model.safetensors"]
    # A re-export comes later than the export it replaces: past the file system's clock tick (coarse, a few ms, on
    # some kernels), which a test writing twice in a row would not be.
    time.sleep(0.05)
    save_file({**weights, "b.middle": torch.ones(300_000)}, str(path))  # only the middle tensor differs
    why = data_identity.changed_files(record, {"model.safetensors": path})
    assert why.startswith("model.safetensors was rewritten since the run started"), why
    # The same bytes, copied without keeping the time: the printed command gives the file back the recorded time.
    save_file(weights, str(path))
    why = data_identity.changed_files(record, {"model.safetensors": path})
    touch = why[why.index("`touch") + 1 : why.index("` gives")]
    subprocess.run(touch, shell=True, check=True)
    assert data_identity.changed_files(record, {"model.safetensors": path}) is None
    save_file({**weights, "a.first": torch.ones(300_000)}, str(path))  # the first MiB differs
    assert "other content (its first and last MiB differ" in data_identity.changed_files(
        record, {"model.safetensors": path}
    )


def test_a_hub_model_is_known_by_the_commit_its_revision_resolved_to(tmp_path, monkeypatch):
    """Offline, the commit is read from the local Hub cache's refs, as transformers reads them; a download after the
    model's owners pushed moves `refs/main`, and the rerun is refused instead of loading the new weights."""
    import huggingface_hub.constants

    from dpotrain.data import model_identity

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    refs = tmp_path / "hub" / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", "org/model"])
    record = model_identity.of(recipe)
    assert record == {"hub_commit": "a" * 40}
    assert model_identity.changed(recipe, record) is None
    (refs / "main").write_text("b" * 40)
    assert model_identity.changed(recipe, record) == (
        f"org/model at main is commit {'b' * 12}, the run started on commit {'a' * 12}"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_an_output_folder_inside_a_folder_of_data_files_is_refused_at_start(dry_run, tmp_path, capsys):
    """Issue 53 item 13: datasets reads every file under a data folder, so a run's output folder inside it was read as
    new data (its PNG even made datasets read the folder as images), and every requeue was refused for "changed data".
    Refused in one line at start, naming both folders, in the run and the dry run, before anything is written."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text(
        "".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(True)[:16])
    )
    out = shards / "run"
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*ARGS, "--dataset_name", str(shards), "--output_dir", str(out), *dry_run]))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: output_dir {str(out)!r} is inside the data folder {str(shards)!r}"), line
    assert "pass an --output_dir outside it" in line
    assert not out.exists() and not (shards / "run.dry-run.json").exists()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_an_output_folder_where_a_data_files_glob_matches_its_own_files_is_refused_at_start(dry_run, tmp_path, capsys):
    """A mixture source `data_files: pairs/**/*.jsonl` with the run's folder under pairs/: the glob matched no file of
    the run at its first start, which trained; every rerun and requeue then read its metrics.jsonl as a source and was
    refused ("a mixture source '.../metrics.jsonl' is in output_dir: copy it out"). Refused at the first start."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    pairs = tmp_path / "pairs"
    pairs.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", pairs / "a.jsonl")
    recipe = tmp_path / "glob.yaml"
    smoke = (ROOT / "configs" / "smoke.yaml").read_text()
    source = f"datasets: [{{path: json, data_files: '{pairs}/**/*.jsonl'}}]"
    recipe.write_text(smoke.replace("dataset_name: data/smoke_prefs.jsonl", source))
    out, args = pairs / "run", [str(recipe) if arg == ARGS[1] else arg for arg in ARGS]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*args, "--output_dir", str(out), *dry_run]))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: output_dir {str(out)!r} is where the data_files glob '{pairs}/**/*.jsonl'"), line
    assert f"({out}/metrics.jsonl)" in line and not out.exists()
    # Beside the data, where the glob reaches none of its files, the same recipe plans
    with pytest.raises(SystemExit) as planned:
        run_cli(lambda: train_dpo.main([*args, "--output_dir", str(tmp_path / "run"), "--dry-run"]))
    assert not planned.value.code, capsys.readouterr().err[-2000:]


def test_an_output_folder_inside_the_data_folder_bound_under_another_name_is_refused(tmp_path):
    """The data folder mounted a second time elsewhere (a bind mount, which no link resolves): `--dataset_name
    /gpfs/me/shards --output_dir /scratch/me/shards/run` of one folder trained, then read its own files as data. The
    dry run as its process ends it (`run_cli`), in a forked child whose own mount namespace holds the bind mount
    (`in_child`): a fresh interpreter under `unshare` imported the stack again (~6 CPU-s) for a refusal."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    shards, bound = tmp_path / "shards", tmp_path / "bound"
    shards.mkdir()
    bound.mkdir()
    (shards / "part-0.jsonl").write_text(
        "".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(True)[:16])
    )
    out = bound / "run"
    args = [*ARGS, "--dataset_name", str(shards), "--output_dir", str(out), "--dry-run"]
    code, _, stderr = in_child(lambda: run_cli(lambda: train_dpo.main(args)), bind=[(shards, bound)])
    line = stderr.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert line.startswith(f"error: output_dir {str(out)!r} is inside the data folder {str(shards)!r}"), line
    assert not (shards / "run").exists()


def test_a_saved_data_set_or_a_data_file_is_known_without_the_run_folder_beside_it(tmp_path):
    """Where the run's folder inside the data's folder is not read as data (a data set saved with `save_to_disk`: its
    split's Arrow files; a data file: itself), it works: the data identity and the analyzer's cache key ignore it."""
    import datasets

    from dpotrain.data import builtin, lengths

    saved, file = tmp_path / "saved", tmp_path / "files" / "pairs.jsonl"
    datasets.Dataset.from_list(builtin.make_preference_rows(8, seed=1)).save_to_disk(str(saved))
    file.parent.mkdir()
    file.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(True)[:8]))
    for name in (str(saved), str(file)):
        recorded, key = data_identity.of_files(data_identity.files(name)), lengths.dataset_identity(name)
        run = Path(name).parent / "run" if Path(name).is_file() else Path(name) / "run"
        (run / "checkpoint-2").mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        (run / "checkpoint-2" / "model.safetensors").write_bytes(b"weights")
        assert data_identity.changed(recorded, name) is None and lengths.dataset_identity(name) == key, name


@pytest.mark.slow
def test_a_resume_says_which_package_versions_dropout_and_max_length_auto_its_checkpoint_trained_with(
    tmp_path, tiny_model_dir, capsys
):
    """Three things a checkpoint may have been trained with that a resume now does otherwise, each said on one line,
    and the run goes on (a refusal would strand every queued job at an upgrade). One run and one resume for the three:
    the checkpoint is resealed as an older version would have written it in all three ways.

    Package versions: a requeue after `pip install -U transformers` resumed in silence, and the record it rewrote kept
    no versions: what the checkpoint's steps were trained under was known nowhere. Each checkpoint's record now holds
    them, and a resume under others says which.

    Dropout: a model with attention_dropout 0.1 in its config trained with it on until disable_dropout reached the
    rates a model applies itself (dropout.py); a checkpoint of that version resumed without it, and nothing said so.
    The run now records the dropout it trains with (`derived.dropout`), and a resume whose checkpoint trained with
    other (or, recorded before the field, maybe other) dropout says which.

    `max_length: auto` is decided again at each start; where it now chooses another length than the checkpoint's
    (another version's choice, or the model's positions read otherwise after an upgrade: the model's files themselves
    are compared), the resume trained the steps left at the new length, its record rewritten, and said nothing. It
    goes on at the checkpoint's length now."""
    import train_dpo
    from dpotrain.recipe import run_record
    from dpotrain.train import agreement, resume

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    argv = [*ARGS[:2], "--model_name_or_path", str(model), "--max_steps", "2", "--save_steps", "2"]
    argv += ["--max_length", "auto", "--report_to", "none", "--output_dir", str(out)]
    train_dpo.main(argv)
    checkpoint = out / "checkpoint-2"
    for folder in (out, checkpoint):
        assert json.loads((folder / "resolved_config.json").read_text())["derived"]["packages"] == (
            agreement.recorded_versions()
        )
    record = json.loads((checkpoint / "resolved_config.json").read_text())
    assert record["derived"]["dropout"] == []  # disable_dropout (the default): none on in training
    assert record["max_length"] == 512
    for name in FINAL:  # as a kill after the last checkpoint leaves the folder
        (out / name).unlink()

    def as_an_older_version_wrote_it(record):
        record["derived"]["packages"].update(transformers="4.57.0")  # under an older transformers
        record["derived"].pop("dropout")  # before the field was kept
        record["max_length"] = record["derived"]["max_length"]["max_length"] = 1024  # its auto rounded 95% up

    resealed(checkpoint, as_an_older_version_wrote_it)
    capsys.readouterr()
    train_dpo.main(argv)
    said = capsys.readouterr().out
    now = agreement.package_versions()["transformers"]
    assert (
        f"note: {checkpoint} was trained under other package versions (transformers 4.57.0 -> {now}); the steps after "
        "it are trained under this run's" in said
    )
    assert (
        f"note: {checkpoint}'s record does not say what dropout it trained with: written before the record kept it, "
        "it may have trained with the dropout its model applies itself on (attention_dropout 0.1 in its config), which "
        "disable_dropout now turns off; the steps after it train with none" in said
    )
    assert (
        f"note: max_length: auto chooses 512 now, and {checkpoint} trained at 1,024 (chosen at the run's start): the "
        "steps after it train at 1,024, as it did" in said
    )
    resumed = json.loads((out / "resolved_config.json").read_text())
    assert resumed["max_length"] == 1024 and resumed["derived"]["max_length"]["max_length"] == 1024
    # A record that says the checkpoint trained with dropout on; one that says what the run does now says nothing.
    on = run_record.of(record | {"derived": record["derived"] | {"dropout": ["attention_dropout 0.1"]}})
    assert resume.dropout_changed("ckpt", on, [], {"attention_dropout": 0.1}) == (
        "note: ckpt trained with dropout attention_dropout 0.1, and the steps after it train with none (another "
        "version of dropout.disable), as resolved_config.json now records (derived.dropout)"
    )
    assert resume.dropout_changed("ckpt", run_record.of(record), [], {"attention_dropout": 0.1}) is None


def resealed(checkpoint: Path, edit) -> None:
    """`checkpoint` as another version wrote and sealed it: `edit` changes its record in place (the record is covered
    by its manifest, sealed again)."""
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.checkpoints import MARKER

    record = json.loads((checkpoint / "resolved_config.json").read_text())
    edit(record)
    (checkpoint / "resolved_config.json").write_text(json.dumps(record))
    mark = (checkpoint / MARKER).read_text()
    for name in (MARKER, "MANIFEST.json"):
        (checkpoint / name).unlink()
    checkpoint_manifest.seal(checkpoint, MARKER, mark, is_main=True)


@pytest.mark.slow
def test_a_model_init_kwargs_key_changed_between_attempts_is_refused_and_one_for_loading_alone_resumes(stopped):
    """model_init_kwargs reach from_pretrained as config overrides (`rms_norm_eps`, `attention_dropout`): another model
    than the checkpoint's steps were trained on. It was a may-change field, and the rerun resumed on it in silence."""
    out, model, shards = stopped
    parse = lambda *extra: parse_args([*command(out, model, shards)[2:], *extra])  # noqa: E731
    with pytest.raises(ConfigError) as refused:
        check_output_dir(parse("--model_init_kwargs", '{"rms_norm_eps": 1e-06}'), 8)
    assert f"error: output_dir {str(out)!r} holds an unfinished run with other settings (model_init_kwargs: " in (
        f"error: {refused.value}"
    ), refused.value
    assert "rms_norm_eps" in str(refused.value) and "--overwrite_output_dir" in str(refused.value)
    # The keys the run decides itself (recorded as the model loaded) and how it loads the files are not a change.
    for kwargs in (None, '{"low_cpu_mem_usage": true}'):
        extra = ["--model_init_kwargs", kwargs] if kwargs else []
        assert check_output_dir(parse(*extra), 8).resume_from == str(out / "checkpoint-4")


@pytest.mark.parametrize("given", ["test split", "held-out mixture"])
def test_held_out_pairs_edited_between_attempts_are_refused_and_other_ones_named_resume(
    given, tmp_path, tiny_model_dir, splits
):
    """The held-out pairs' files are the run's too: edited in place between attempts, the resume evaluated other pairs
    than its first attempt in silence (eval curves across it not comparable). A saved DatasetDict's test split (its
    own folder, which the training record leaves out) and a held-out mixture's file are refused naming the file; other
    held-out pairs named (a setting that may change), or no evaluation, resume."""
    import datasets

    from dpotrain import resolve, stages

    data, held, run = tmp_path / "pairs", tmp_path / "held.jsonl", tmp_path / "run"
    shutil.copytree(splits, data)
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    held.write_text("".join(lines[:8]))
    mixed = ["--dataset_mixer_eval_list", str(held), "1.0"] if given == "held-out mixture" else []
    args = [*ARGS[:2], "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(run)]
    args += ["--eval_strategy", "steps", "--eval_steps", "2", "--report_to", "none", *mixed]
    recipe = parse_args(args)
    record = resolve.resolved_config(recipe, {"pairs_per_step": 8})
    record["derived"].update(stages.load_data(recipe, stages.checks(recipe)).checked)  # as the run records them
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps(record))
    assert resolve.changed_settings(recipe, run, 8) == []
    if mixed:
        held.write_text("".join(lines[8:16]))  # 8 other pairs in place of the 8 evaluated on
        name = f"{held} [test]: held.jsonl"
    else:  # another test split's Arrow file copied over the recorded one
        other = datasets.Dataset.from_list([json.loads(line) for line in lines[:12]])
        datasets.DatasetDict({"train": other, "test": other}).save_to_disk(tmp_path / "other")
        name = "test/data-00000-of-00001.arrow"
        shutil.copy(tmp_path / "other" / name, data / name)
    (changed,) = resolve.changed_settings(recipe, run, 8)
    assert changed.startswith(f"held-out content: {name} has ") and "the run evaluated on" in changed, changed
    assert resolve.changed_settings(parse_args([*args, "--eval_strategy", "no"]), run, 8) == []
    if mixed:  # another file named for the held-out pairs: a setting that may change
        shutil.copy(held, tmp_path / "held_2.jsonl")
        assert (
            resolve.changed_settings(
                parse_args([*args[:-3], *mixed[:1], str(tmp_path / "held_2.jsonl"), "1.0"]), run, 8
            )
            == []
        )


def test_a_split_files_folders_test_file_edited_between_attempts_is_said_to_be_evaluated_on(tmp_path, tiny_model_dir):
    """A folder of split files (train.jsonl, test.jsonl) is recorded whole, as datasets reads it: its test.jsonl edited
    between attempts refused the resume saying "the run trained on" that file, whose pairs the run only evaluates on
    (a held-out mixture's file and a saved data set's test split said "evaluated on"). Its train.jsonl is trained on."""
    from dpotrain import resolve, stages

    data, run = tmp_path / "pairs", tmp_path / "run"
    data.mkdir()
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:48]))
    (data / "test.jsonl").write_text("".join(lines[48:56]))
    recipe = smoke_recipe(
        run, tiny_model_dir, "--dataset_name", str(data), "--eval_strategy", "steps", "--eval_steps", "2"
    )
    record = resolve.resolved_config(recipe, {"pairs_per_step": 8})
    record["derived"].update(stages.load_data(recipe, stages.checks(recipe)).checked)  # as the run records them
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps(record))
    assert resolve.changed_settings(recipe, run, 8) == []
    (data / "test.jsonl").write_text("".join(lines[56:60]))  # 4 other pairs in place of the 8 evaluated on
    (changed,) = resolve.changed_settings(recipe, run, 8)
    assert changed.startswith("dataset content: test.jsonl has ") and "the run evaluated on " in changed, changed
    (data / "test.jsonl").write_text("".join(lines[48:56]))  # as recorded again (hashed: the same content)
    (data / "train.jsonl").write_text("".join(lines[:40]))
    (changed,) = resolve.changed_settings(recipe, run, 8)
    assert changed.startswith("dataset content: train.jsonl has ") and "the run trained on " in changed, changed


@pytest.mark.parametrize("recorded", ["no", "steps"])
def test_a_split_files_folders_test_file_the_run_does_not_evaluate_on_does_not_block_its_resume(
    recorded, tmp_path, tiny_model_dir
):
    """A folder of split files is recorded whole: under `--eval_strategy no` (no held-out pair read), its test.jsonl
    edited between attempts refused the resume saying "the run trained on" it. A file the run neither trains nor
    evaluates on resumes, whether the first attempt evaluated or not; its train.jsonl edited is still refused."""
    from dpotrain import resolve, stages

    data, run = tmp_path / "pairs", tmp_path / "run"
    data.mkdir()
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:48]))
    (data / "test.jsonl").write_text("".join(lines[48:56]))
    evals = ["--eval_strategy", "steps", "--eval_steps", "2"] if recorded == "steps" else ["--eval_strategy", "no"]
    first = smoke_recipe(run, tiny_model_dir, "--dataset_name", str(data), *evals)
    record = resolve.resolved_config(first, {"pairs_per_step": 8})
    record["derived"].update(stages.load_data(first, stages.checks(first)).checked)  # as the run records them
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps(record))
    recipe = smoke_recipe(run, tiny_model_dir, "--dataset_name", str(data), "--eval_strategy", "no")
    (data / "test.jsonl").write_text("".join(lines[56:60]))  # 4 other pairs in place of the 8 held out
    assert resolve.changed_settings(recipe, run, 8) == []
    (data / "train.jsonl").write_text("".join(lines[:40]))
    (changed,) = resolve.changed_settings(recipe, run, 8)
    assert changed.startswith("dataset content: train.jsonl has ") and "the run trained on " in changed, changed


def test_a_mixture_sources_split_files_folder_is_compared_on_the_split_it_reads(tmp_path, tiny_model_dir):
    """A mixture source that is a folder of split files is recorded whole: its test.jsonl, which the source (reading
    train) never reads, edited between attempts refused the resume as "the run trained on" it. Its train.jsonl edited
    is still refused."""
    from dpotrain import resolve, stages

    data, run = tmp_path / "pairs", tmp_path / "run"
    data.mkdir()
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:48]))
    (data / "test.jsonl").write_text("".join(lines[48:56]))
    recipe = smoke_recipe(run, tiny_model_dir, "--dataset_mixer_list", str(data), "1.0", "--eval_strategy", "no")
    record = resolve.resolved_config(recipe, {"pairs_per_step": 8})
    record["derived"].update(stages.load_data(recipe, stages.checks(recipe)).checked)  # as the run records them
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps(record))
    (data / "test.jsonl").write_text("".join(lines[56:60]))  # 4 other pairs in place of the 8 held out
    assert resolve.changed_settings(recipe, run, 8) == []
    (data / "train.jsonl").write_text("".join(lines[:40]))
    (changed,) = resolve.changed_settings(recipe, run, 8)
    assert changed.startswith(f"dataset content: {data} [train]: train.jsonl has ") and "the run trained on " in changed


@pytest.mark.parametrize("given", ["card", "plain", "card as a mixture source"])
def test_a_data_folders_record_holds_only_the_files_the_run_reads(given, tmp_path, tiny_model_dir):
    """A data folder was recorded whole: every file in it, also files its README.md's `configs:` do not read (an old
    export, notes) and, in a plain folder, files no split reads. Such a file deleted (or, where the record is old, one
    gone) refused a resume that would train on the very same pairs; each was hashed at every start too. Only the files
    the run reads are recorded (with the card that chooses them); the pairs it trains on edited are still refused."""
    from dpotrain import resolve, stages

    data, run = tmp_path / "pairs", tmp_path / "run"
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    read = data / ("data/pairs.jsonl" if given.startswith("card") else "train.jsonl")
    read.parent.mkdir(parents=True)
    read.write_text("".join(lines[:48]))
    (data / "unused").mkdir()
    if given.startswith("card"):  # a data file of any format: the card names what is read
        (data / "unused" / "old.csv").write_text("prompt,chosen,rejected\na,b,c\n")
    else:  # a plain folder refuses a data file no split reads: files of no data format, and a test split
        (data / "unused" / "export.log").write_text("done\n")
        (data / "test.jsonl").write_text("".join(lines[48:56]))
    (data / "notes.txt").write_text("exported from the SFT mix, 2026-11\n")
    if given.startswith("card"):
        card = "- config_name: default\n  data_files:\n  - split: train\n    path: data/pairs.jsonl\n"
        (data / "README.md").write_text(f"---\nconfigs:\n{card}---\n")
    named = ["--dataset_mixer_list", str(data), "1.0"] if "mixture" in given else ["--dataset_name", str(data)]
    recipe = smoke_recipe(run, tiny_model_dir, *named, "--eval_strategy", "no")
    record = resolve.resolved_config(recipe, {"pairs_per_step": 8})
    record["derived"].update(stages.load_data(recipe, stages.checks(recipe)).checked)  # as the run records them
    run.mkdir()
    (run / "resolved_config.json").write_text(json.dumps(record))
    files = record["derived"].get("data_identity") or record["derived"]["data_sources"][0]["identity"]["files"]
    assert sorted(files) == sorted({read.relative_to(data).as_posix()} | ({"README.md"} if "card" in given else set()))
    (data / "notes.txt").unlink()
    shutil.rmtree(data / "unused")
    assert resolve.changed_settings(recipe, run, 8) == []
    if given == "plain":  # its test split, not recorded as the first attempt did not evaluate: eval_* may change
        evaluating = smoke_recipe(run, tiny_model_dir, *named, "--eval_strategy", "steps", "--eval_steps", "2")
        assert resolve.changed_settings(evaluating, run, 8) == []
    read.write_text("".join(lines[:40]))
    (changed,) = resolve.changed_settings(recipe, run, 8)
    assert " has " in changed and "the run trained on " in changed, changed


def test_the_project_commit_is_read_from_a_checkout_whose_path_holds_a_space(tmp_path, monkeypatch):
    """`git rev-parse --show-toplevel HEAD`'s answer was split on whitespace: a checkout under "my runs/dpotrain" gave
    three words, and every record said no commit (nothing compared at a resume). Read line by line now."""
    from dpotrain.train import agreement

    root = tmp_path / "my checkout"
    root.mkdir()
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr(agreement, "ROOT", root.resolve())
    assert agreement.project_commit() == head


@pytest.mark.slow
def test_the_project_commit_is_asked_of_git_by_the_main_process_alone(tmp_path, tiny_model_dir):
    """Only the main process writes the record, and every rank ran git for it (N gits at each start, each one a wait
    on a file server that hangs). A `git` first on PATH notes the rank of each call asking the commit."""
    from conftest import launch_smoke

    shim, asked = tmp_path / "bin", tmp_path / "asked"
    shim.mkdir()
    (shim / "git").write_text(
        f'#!/bin/sh\ncase "$*" in *--show-toplevel*) echo "rank ${{RANK:-?}}" >> {shlex.quote(str(asked))};; esac\n'
        f'exec {shlex.quote(shutil.which("git"))} "$@"\n'
    )
    (shim / "git").chmod(0o755)
    out = tmp_path / "run"
    path = f"{shim}:{os.path.dirname(python())}:{os.environ['PATH']}"
    args = ["--model_name_or_path", tiny_model_dir, "--max_steps", "2", "--save_strategy", "no", "--report_to", "none"]
    launch_smoke(2, [*args, "--output_dir", str(out)], env={"PATH": path})
    assert asked.read_text().splitlines() == ["rank 0"]
    now = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["packages"]["dpotrain"] == now


@pytest.mark.slow
def test_an_edited_config_json_of_the_model_init_kwargs_subfolder_is_refused(tmp_path, tiny_model_dir):
    """`model_init_kwargs: {subfolder: sub}` loads the weights and config from sub/: the run recorded the top folder's
    files alone, so sub/config.json edited between attempts (`rms_norm_eps`) resumed in silence, the checkpoint trained
    on under another model. The same edit of the top folder's config.json is refused (above)."""
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny_model_dir, model)
    (model / "sub").mkdir()
    for name in ("config.json", "model.safetensors"):  # the top folder's stay: the run's checks read them there
        shutil.copy2(model / name, model / "sub" / name)
    sub = ["--model_init_kwargs", '{"subfolder": "sub"}']
    cmd = [*command(out, model, ROOT / "data" / "smoke_prefs.jsonl"), *sub]
    result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    for name in FINAL:  # as a kill after checkpoint-4 leaves it
        (out / name).unlink()
    recipe = parse_args(cmd[2:])
    assert check_output_dir(recipe, 8).resume_from == str(out / "checkpoint-4")
    config = model / "sub" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 0.5'))
    with pytest.raises(ConfigError) as refused:
        check_output_dir(recipe, 8)
    assert f"(model: {model}: sub/config.json has " in str(refused.value), str(refused.value)


@pytest.mark.slow
def test_a_training_file_changed_while_the_held_out_pairs_are_read_is_recorded_as_trained(tmp_path, tiny_model_dir):
    """The run hashes its training file for its record (the content a resume is compared with, the model card's
    SHA-256). It hashed it only after the held-out pairs were read, past the look that refuses a file changed during
    the read: pairs.jsonl rewritten then (a new export landing as the job starts) was recorded as the data trained on,
    while the run trained the rows it had read, and a requeued attempt resumed on the new pairs, no word said. The
    record is now the content read."""
    import hashlib
    import signal

    from conftest import PAUSE_AT, pause_env, paused_pid, python

    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    data, held = tmp_path / "pairs.jsonl", tmp_path / "held.jsonl"
    data.write_text("".join(lines[:32]))
    held.write_text("".join(lines[300:308]))
    read = hashlib.sha256(data.read_bytes()).hexdigest()
    out, paused = tmp_path / "run", tmp_path / "paused"
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", tiny_model_dir]
    args += ["--dataset_name", str(data), "--dataset_mixer_eval_list", str(held), "1.0", "--eval_strategy", "steps"]
    args += ["--eval_steps", "1", "--max_steps", "1", "--warmup_steps", "0", "--output_dir", str(out)]
    env = {**os.environ, **pause_env("", f"*/{held.name}", paused)}  # stopped as the held-out file is first opened
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        pid = paused_pid(paused, proc)
        data.write_text("".join(lines[32:64]))  # other pairs, once the training pairs were read
        os.kill(pid, signal.SIGCONT)
        output = proc.communicate(timeout=600)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    recorded = json.loads((out / "resolved_config.json").read_text())["derived"]["data_identity"]["pairs.jsonl"]
    assert recorded["sha256"] == read  # the new file's before

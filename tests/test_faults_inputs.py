"""Faults in what a run trusts between its attempts, besides its output folder: the reference cache, the lock reached
by another path, the data edited without a trace in its size and time (docs/reliability.md)."""

import io
import json
import os
import shutil
import zipfile

import datasets
import numpy as np
import pytest
import torch

from conftest import ROOT, built, in_child, ready, smoke_recipe
from dpotrain.data import builtin
from dpotrain.reference import reference

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def scored(tmp_path, model_dir, rows):
    """The run's reference columns after its stage (what training reads), on the run's own checks and builder."""
    recipe = smoke_recipe(tmp_path / "out", model_dir, "--save_strategy", "no")
    trainer = ready(built(recipe, datasets.Dataset.from_list(rows)))
    return trainer.train_dataset["ref_chosen_logps"], trainer.train_dataset["ref_rejected_logps"]


def other_weights(tiny_model_dir, folder):
    """A copy of the tiny model with other weights (another fine-tune saved in its place), the same tokenizer."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_reference_cache_file_copied_in_from_another_key_is_named_and_scored_again(tmp_path, tiny_model_dir, capsys):
    """A cache file is the scores of its key's model, data and settings; the folder's name alone said which. Another
    model's `complete.npz` copied into this run's folder (same pair count) was read as this run's reference: training
    went on against the other weights' log-probs, in silence."""
    rows = builtin.make_preference_rows(16, seed=3)
    other = other_weights(tiny_model_dir, tmp_path / "other-model")
    foreign = scored(tmp_path / "a", other, rows)
    own = scored(tmp_path / "b", tiny_model_dir, rows)
    assert foreign != own
    folders = {p.parent for p in reference.cache_dir().glob("*/complete.npz")}
    (mine,) = (f for f in folders if json.loads((f / "identity.json").read_text())["model"] == tiny_model_dir)
    (theirs,) = folders - {mine}
    shutil.copy(theirs / reference.COMPLETE, mine / reference.COMPLETE)
    capsys.readouterr()

    again = scored(tmp_path / "c", tiny_model_dir, rows)
    err = capsys.readouterr().err
    assert f"warning: the reference cache file {mine / reference.COMPLETE} is damaged (it holds the scores of " in err
    assert f"cache key {theirs.name}" in err and "its pairs are scored again" in err
    assert again == own  # this model's scores, not the copied ones


def test_a_part_copied_in_from_another_key_lends_no_pair(tmp_path, monkeypatch, capsys):
    """The same for an interrupted attempt's part, and for the pairs other runs' finished caches lend by digest: a file
    whose key is not its folder's is not read as that folder's scores (a file written before files named their key
    still is)."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path))
    mine = reference.Store.for_identity({"pairs": 3, "tokens_sha256": "x"})
    theirs = reference.Store.for_identity({"pairs": 3, "tokens_sha256": "y"})
    theirs.write_part("a", 0, [0, 1], [-1.0, -2.0], [-3.0, -4.0])
    (part,) = theirs.folder.glob("part-*.npz")
    mine.folder.mkdir(parents=True)
    shutil.copy(part, mine.folder / part.name)
    assert np.isnan(mine.parts()[0]).all()
    assert f"(it holds the scores of cache key {theirs.folder.name}" in capsys.readouterr().err
    assert not (mine.folder / part.name).exists() and part.exists()  # the copy removed, its original left

    # A finished cache in a folder with another key's identity.json lends nothing by digest.
    digests = np.arange(48, dtype=np.uint8).reshape(3, 16)
    ident = {"pairs": 3, "tokens_sha256": "y", "model": "m"}
    theirs.write_complete(ident, np.zeros(3, dtype=np.float32), np.zeros(3, dtype=np.float32), digests)
    lender = tmp_path / "reference" / "lender"
    lender.mkdir()
    shutil.copy(theirs.folder / reference.COMPLETE, lender / reference.COMPLETE)
    (lender / "identity.json").write_text(json.dumps({**ident, "tokens_sha256": "z"}))
    shutil.rmtree(theirs.folder)
    chosen, rejected = np.full((2, 3), np.nan, dtype=np.float32)
    ask = {**ident, "tokens_sha256": "w"}
    assert reference.fill_from_other_caches(reference.cache_dir(), mine.folder, ask, digests, chosen, rejected) == 0

    # The file written before files named their key: read as before.
    with np.load(lender / reference.COMPLETE) as f:
        kept = {k: f[k] for k in f.files if k != "key"}
    np.savez(lender / reference.COMPLETE, **kept)
    assert reference.fill_from_other_caches(reference.cache_dir(), mine.folder, ask, digests, chosen, rejected) == 3


@pytest.mark.slow
def test_one_output_folder_reached_by_two_paths_is_locked_for_both(tmp_path):
    """The lock is a file in the folder itself, not keyed on the path a job names it by: a job that reaches a live
    run's folder through a symbolic link (or the real path, where the first came through the link) is refused."""
    import subprocess
    import sys

    from dpotrain.cluster import run_lock

    real = tmp_path / "scratch" / "run"
    link = tmp_path / "outputs-run"
    link.symlink_to(real, target_is_directory=True)  # the folder does not exist yet: the first run makes it
    holder = (
        "import sys, time; from pathlib import Path; from dpotrain.cluster import run_lock; "
        "assert run_lock.acquire(Path(sys.argv[1])) is None; print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(link)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert (real / run_lock.LOCK_FILE).is_file()
        for path in (real, tmp_path / "scratch" / ".." / "scratch" / "run", link):
            refused = run_lock.acquire(path)
            assert refused and f"is in use by another run (host {os.uname().nodename}, pid {proc.pid}" in refused
    finally:
        proc.kill()
        proc.wait()
    assert run_lock.acquire(real) is None  # its holder gone: taken over
    run_lock.release()


@pytest.mark.slow
def test_weights_replaced_keeping_their_size_and_time_are_refused_before_the_reference_is_scored(
    tmp_path, tiny_model_dir
):
    """A weights file over 2 MiB is known by its size and time until they change (data_identity.py): one replaced by
    another fine-tune's of the same size, its time put back, passed the model's check, and the resume scored its
    reference anew from the other weights (another cache key) and trained the steps past its checkpoint against it,
    exit code 0. The loaded weights' hash, recorded at the start, is compared once the model loads."""
    import subprocess

    from safetensors.torch import load_file, save_file
    from test_faults import ARGS, FINAL

    from conftest import python

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    padding = {"format": "pt", "note": "x" * (3 << 20)}  # the tiny model's 0.8 MB made a large file, known by its ends
    save_file(load_file(weights), str(weights), metadata=padding)
    cmd = [python(), str(ROOT / "train_dpo.py"), *ARGS, "--output_dir", str(out), "--model_name_or_path", str(model)]
    run = lambda: subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # noqa: E731
    first = run()
    assert first.returncode == 0, first.stdout[-3000:]
    for name in FINAL:  # a kill after checkpoint-2: steps 3 and 4 left to train
        (out / name).unlink()
    shutil.rmtree(out / "checkpoint-4")

    then = weights.stat()
    other = {k: v + 0.01 * torch.randn_like(v) for k, v in load_file(weights).items()}
    save_file(other, str(weights), metadata=padding)
    os.utime(weights, ns=(then.st_atime_ns, then.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (then.st_size, then.st_mtime_ns)

    again = run()
    assert again.returncode == 2 and "Traceback" not in again.stdout, again.stdout[-3000:]
    last = again.stdout.strip().splitlines()[-1]
    checkpoint = out / "checkpoint-2"
    assert last.startswith(f"error: model '{model}': the weights loaded are not those {checkpoint} was "), last
    assert "reference log-probs (train)" not in again.stdout and not (out / "checkpoint-4").exists()


@pytest.mark.slow
def test_what_a_kill_while_writing_the_reference_cache_leaves_is_never_read_and_is_removed(
    tmp_path, tiny_model_dir, capsys
):
    """A SIGKILL while a cache file is written leaves its temporary (`.complete.npz.<host>.<pid>.tmp`, cut short), never
    the file: the next attempt reads the whole file, or scores again. The temporaries stayed in the cache forever (up
    to a complete file's size each, one per kill); a live writer's stays, it may be writing."""
    import socket
    import subprocess
    import sys

    rows = builtin.make_preference_rows(16, seed=3)
    first = scored(tmp_path / "a", tiny_model_dir, rows)
    (folder,) = {p.parent for p in reference.cache_dir().glob("*/complete.npz")}
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, dead = socket.gethostname(), int(gone.stdout)
    whole = (folder / reference.COMPLETE).read_bytes()
    left = [folder / f".complete.npz.{host}.{dead}.tmp", folder / f".part-20261130-abc123-r0.npz.{host}.{dead}.tmp"]
    for path in left:
        path.write_bytes(whole[: len(whole) // 2])
    writing = folder / f".complete.npz.{host}.{os.getppid()}.tmp"  # a live process's: its write may be under way
    writing.write_bytes(whole[:100])
    capsys.readouterr()

    again = scored(tmp_path / "b", tiny_model_dir, rows)
    out = capsys.readouterr().out
    assert again == first and "all 16 pairs reused" in out
    for path in left:
        assert f"Removed {path}: left by a write to the reference cache killed midway" in out
        assert not path.exists()
    assert writing.exists()


@pytest.mark.slow
def test_datasets_cache_filling_up_while_the_pairs_are_prepared_is_named_with_its_variable(tmp_path):
    """datasets' cache with room for its copy of the data file (checked at start) but not for the tokenized copies its
    `map` writes next (about twice the file, for the smoke data): pyarrow's failed write names no file, and the run
    ended in `error: the disk is full: a file could not be written: free space there, then rerun`, naming no place.
    The cache whose disk has no room is found, and named with the variable that moves it. The command as its process
    ends it (`run_cli`), in a forked child whose own mount namespace holds a 1 MiB tmpfs at the cache (`in_child`): a
    fresh interpreter under `unshare` imported the stack again (~6 CPU-s) for a run that ends before its model loads."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    cache = tmp_path / "datasets-cache"
    cache.mkdir()
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--max_steps", "2", "--output_dir", str(out)]
    env = {"HF_DATASETS_CACHE": str(cache)}
    code, stdout, stderr = in_child(lambda: run_cli(lambda: train_dpo.main(args)), tmpfs=[(cache, "1m")], env=env)
    assert code != 0 and "Traceback" not in stdout + stderr, (stdout + stderr)[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the disk is full: a file could not be written in datasets' cache, {cache}, "), last
    assert last.endswith("or set HF_DATASETS_CACHE (or HF_HOME) to a folder with room, then rerun"), last
    assert not (out / "checkpoint-2").exists()  # before training: nothing trained, nothing to resume


def test_a_flipped_bit_in_a_reference_cache_file_is_caught_by_its_crc(tmp_path, monkeypatch, capsys):
    """A failing disk or a bad copy that flips one bit of the scores (the file's size and shape unchanged): np.load
    checks each array's CRC-32 in the zip, so the file is named damaged and its pairs scored again, never read."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path))
    store = reference.Store.for_identity({"pairs": 64, "tokens_sha256": "x"})
    scores = -np.arange(64, dtype=np.float32)
    store.write_complete({"pairs": 64}, scores, scores, np.zeros((64, 16), dtype=np.uint8))
    path = store.folder / reference.COMPLETE
    data = bytearray(path.read_bytes())
    at = data.find(scores.tobytes())
    assert at > 0  # the chosen scores, stored uncompressed
    at += 4 * 10  # pair 10's
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.complete() is None
    assert f"warning: the reference cache file {path} is damaged (BadZipFile: Bad CRC-32" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.slow
def test_what_a_kill_while_writing_the_length_cache_leaves_is_removed_by_the_next_analysis(tmp_path, capsys):
    """A writer of the length-analysis cache (DPOTRAIN_CACHE/lengths) SIGKILLed midway leaves its temporary
    (`.<key>.npz.<host>.<pid>.tmp`, cut short), never the file: it stayed there forever, one per kill. The next look-up
    of that key removes it, says so in a line, and measures again; a live writer's stays, it may be writing."""
    import signal
    import socket
    import subprocess
    import sys

    from dpotrain.data import lengths

    cache, dataset_id = tmp_path / "lengths", "pairs-under-test"
    writer = f"""
import time
from dpotrain.data import builtin, lengths
from dpotrain.recipe.writes import replacing
at, _ = lengths._cached_at({dataset_id!r}, builtin.build_tokenizer(), {str(cache)!r})
with replacing(at.with_suffix(".npz"), "wb") as f:  # the path save_cache writes, its first MiB out
    f.write(b"x" * (1 << 20))
    f.flush()
    print("writing", flush=True)
    time.sleep(120)
"""
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tokenizer = builtin.build_tokenizer()
    at, _ = lengths._cached_at(dataset_id, tokenizer, cache)
    (killed,) = cache.iterdir()
    assert killed.name == f".{at.name}.npz.{socket.gethostname()}.{proc.pid}.tmp" and killed.stat().st_size == 1 << 20
    live = cache / f".{at.name}.json.{socket.gethostname()}.{os.getppid()}.tmp"  # a live process's: may be writing
    live.write_text("{")
    capsys.readouterr()

    assert lengths.cached_measure(dataset_id, tokenizer, cache) is None  # nothing whole was cached: measured again
    said = capsys.readouterr().err
    line = f"Removed {killed}: left by a write to the length-analysis cache killed midway (its process is gone)\n"
    assert said == line, said
    rows = datasets.Dataset.from_list(builtin.make_preference_rows(8, seed=1))
    lengths.analyse(rows, tokenizer, 0.99, dataset_id, cache, progress=False)
    assert sorted(p.name for p in cache.iterdir()) == sorted([live.name, f"{at.name}.json", f"{at.name}.npz"])
    assert lengths.cached_measure(dataset_id, tokenizer, cache) is not None


def written(path, data: bytes) -> None:
    """`data` at `path` as a new file, not written over the old one: ext4 (auto_da_alloc) flushes a file truncated and
    written again to the disk as it is closed, ~6 ms a write on this VM, against ~0.3 ms for a new one. The readers
    under test see the same bytes at the same path either way; the sweeps below write each file thousands of times."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def flipped_copies(data: bytes, offsets=None):
    """`data` with one bit flipped at each byte in turn (or at each of `offsets`), the low bit and the high: a failing
    disk, a bad copy."""
    for at in range(len(data)) if offsets is None else offsets:
        for bit in (0x01, 0x80):
            flipped = bytearray(data)
            flipped[at] ^= bit
            yield at, bytes(flipped)


def zip_structure_and_samples(data: bytes) -> list[int]:
    """The offsets of an .npz file to flip a bit at: every byte of the zip's own structure (each member's local
    header, the central directory and its end record, where the crashes were), and of each member its npy header's
    magic, version and length, its padding's first byte and newline, and its array's first, middle and last bytes.
    The rest of a member is its CRC-32's, as those samples are: a sweep of every byte of both files (session 39) had,
    outside this set, only outcomes it has within it (`Bad CRC-32`; the complete file read whole where its digests,
    which `complete()` does not read, were hit), and within it every other (each zip error, KeyError, EOFError,
    OSError, pickled data)."""
    keep = set(range(len(data)))
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        at = info.header_offset  # the local header: 30 bytes, then its own name and extra field
        start = (
            at
            + 30
            + int.from_bytes(data[at + 26 : at + 28], "little")
            + int.from_bytes(data[at + 28 : at + 30], "little")
        )
        end = start + info.compress_size
        newline = data.index(b"\n", start)  # the npy header ends at its newline, padded with spaces before it
        padding = data.rindex(b"}", start, newline) + 1
        keep -= set(range(start + 10, end))  # past the npy magic (6 bytes), version (2) and header length (2)
        keep |= {padding, newline, newline + 1, (newline + 1 + end) // 2, end - 1}
    return sorted(keep)


def test_a_flipped_bit_in_a_reference_cache_file_is_the_file_or_damaged_never_a_crash(tmp_path, monkeypatch, capsys):
    """A bit of `complete.npz` and of a part flipped in turn, at every byte of their zip structure and samples of
    each member (`zip_structure_and_samples`): a flip in the zip's central directory (its compression method, version
    or flags) raised NotImplementedError or RuntimeError ("encrypted") out of np.load, and the run stopped at start
    with a traceback instead of naming the file and scoring its pairs again. Each reader of the cache (this key's
    complete file and parts, and other runs' complete files lending pairs by digest) returns the file's scores or
    nothing, never others."""
    from dpotrain.reference import reuse

    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path))
    ident = {"pairs": 3, "tokens_sha256": "x", "dtype": "float32"}
    store = reference.Store.for_identity(ident)
    scores, digests = np.array([-1.5, -2.5, -3.5], dtype=np.float32), np.eye(3, 16, dtype=np.uint8)
    store.write_complete(ident, scores, scores - 1, digests)
    complete = store.folder / reference.COMPLETE
    intact = complete.read_bytes()
    other = reference.Store.for_identity({**ident, "tokens_sha256": "y"})  # a run whose data changed in part
    for at, data in flipped_copies(intact, zip_structure_and_samples(intact)):
        written(complete, data)
        got = store.complete()
        if got is None:
            assert f"{complete} is damaged" in capsys.readouterr().err, at
        else:
            assert got[0].tolist() == scores.tolist() and got[1].tolist() == (scores - 1).tolist(), at
        written(complete, data)
        chosen, rejected = np.full((2, 3), np.nan, dtype=np.float32)
        reuse.fill_from_other_caches(tmp_path / "reference", other.folder, ident, digests, chosen, rejected)
        assert np.isnan(chosen).all() or chosen.tolist() == scores.tolist(), at

    store.write_part("a", 0, [0, 2], [-1.0, -3.0], [-2.0, -4.0])
    part = store.folder / "part-a-r0.npz"
    intact = part.read_bytes()
    for at, data in flipped_copies(intact, zip_structure_and_samples(intact)):
        written(part, data)
        chosen, rejected = store.parts()
        if np.isnan(chosen).all():
            assert f"{part} is damaged" in capsys.readouterr().err, at
        else:
            assert chosen[[0, 2]].tolist() == [-1.0, -3.0] and rejected[[0, 2]].tolist() == [-2.0, -4.0], at
            assert np.isnan(chosen[1]), at


def test_a_flipped_bit_in_the_length_caches_zip_directory_is_named_damaged_never_a_crash(tmp_path, capsys):
    """A flip in the zip's central directory of the length-analysis cache (its compression method, version or flags)
    raised NotImplementedError or RuntimeError ("encrypted") out of np.load, and every run reading it (`max_length:
    auto`, the analyzer) stopped with a traceback: the reference cache's reader turned them into the file's damage,
    this one did not."""
    from dpotrain.data import lengths

    cache, dataset_id, tokenizer = tmp_path / "lengths", "pairs-under-test", builtin.build_tokenizer()
    rows = datasets.Dataset.from_list(builtin.make_preference_rows(8, seed=1))
    lengths.analyse(rows, tokenizer, 0.99, dataset_id, cache, progress=False)
    (path,) = cache.glob("*.npz")
    intact, whole = path.read_bytes(), lengths.cached_measure(dataset_id, tokenizer, cache)[0]
    directory = intact.index(b"PK\x01\x02")  # the central directory, to the end
    damaged = 0
    for at, data in flipped_copies(intact):
        if at < directory:
            continue
        written(path, data)
        found = lengths.cached_measure(dataset_id, tokenizer, cache)
        if found is None:
            assert f"the length cache file {path} is damaged" in capsys.readouterr().err, at
            damaged += 1
        else:
            assert found[0].chosen.tolist() == whole.chosen.tolist(), at
    assert damaged


def test_a_bug_in_a_cache_reader_raises_and_is_not_taken_for_a_damaged_file(tmp_path, capsys):
    """`read_cache` took TypeError and AttributeError for a damaged file's: a bug in a reader (an argument missed, a
    name misspelled) removed a whole cache file with a warning and computed it all again, at every start, in silence.
    Only what reading a damaged file raises (every cut and flipped bit of the caches, in these tests) is damage."""
    from dpotrain.recipe import records

    path = tmp_path / "cache.npz"
    np.savez(path, chosen=np.zeros(3, dtype=np.float32))

    def buggy(p):
        with np.load(p) as f:
            return f["chosen"].astype()  # TypeError (its dtype missed): a bug, not the file

    with pytest.raises(TypeError):
        records.read_cache(path, buggy, "test", "it is computed again")
    assert path.is_file() and "damaged" not in capsys.readouterr().err


def test_a_damaged_index_or_dataset_info_in_the_hub_cache_is_named_with_its_fix_not_a_traceback(tmp_path, monkeypatch):
    """A sharded model's index or a prepared data set's dataset_info.json damaged in the Hub cache (a disk fault, a copy
    cut short) stopped the offline check with a JSONDecodeError traceback. It is named, with the file to delete: the
    cache keeps a file under its commit's name and does not fetch it again while its blob is there."""
    import datasets.config
    from huggingface_hub import constants

    from dpotrain.cluster import offline

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c0ffee")
    snapshot, blob = repo / "snapshots" / "c0ffee", repo / "blobs" / "9a1b"
    snapshot.mkdir(parents=True)
    blob.parent.mkdir()
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (snapshot / name).write_text("{}")
    blob.write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"')  # cut short
    (snapshot / "model.safetensors.index.json").symlink_to(blob)  # huggingface_hub's layout: a link to its blob
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    named = f"a readable model.safetensors.index.json (the cached copy {blob} is damaged: delete it)"
    assert offline.missing_model_files("org/tiny") == [named]
    blob.write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')  # whole again: its shard is missing
    assert offline.missing_model_files("org/tiny") == ["1 of 1 weight shards (model-00001-of-00002.safetensors)"]

    prepared = tmp_path / "datasets" / "org___pairs" / "default" / "0.0.0" / "d00d"
    prepared.mkdir(parents=True)
    (prepared / "dataset_info.json").write_bytes(b'{"config_name": "def\xffault"')
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    damaged = f"the cached copy's {prepared / 'dataset_info.json'} is damaged: delete {prepared}"
    assert offline.cached_dataset("org/pairs") == (None, damaged)


def test_datasets_copy_cut_short_between_attempts_is_named_and_made_again(tmp_path, monkeypatch, capsys):
    """datasets' Arrow copy of the pairs (`json-train.arrow`) or of a map over them (`cache-*.arrow`) cut short between
    attempts (a node lost while it was copied, a cleaner, a full disk) was read as whole: the run stopped at `error:
    could not read dataset file 'pairs.jsonl': OSError: Expected to be able to read 44344 bytes for message body`,
    blaming the data file, which was whole, at every requeue, or with a traceback at the map. Each Arrow file ends with
    the stream's end mark: one without it is named, removed and made again."""
    import datasets

    from dpotrain.data import data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:24]))
    loaded = data.load_preference_dataset(str(pairs), say=False)
    mapped = loaded.map(lambda row: {"n": len(row["chosen"])}).to_list()  # datasets' cache of a map over the copy
    rows = loaded.to_list()
    del loaded  # memory-mapped: the file cut below under it would be a bus error, not the next attempt's read
    (copy,) = (tmp_path / "hf").rglob("json-train.arrow")
    (cached,) = copy.parent.glob("cache-*.arrow")
    for path in (copy, cached):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    again = data.load_preference_dataset(str(pairs), say=False)
    said = capsys.readouterr().err
    assert f"warning: datasets' copy of {pairs} in {copy.parent} has files cut short " in said, said
    assert f"({cached.name}, {copy.name}; " in said and "made again from the data" in said, said
    assert again.to_list() == rows
    assert again.map(lambda row: {"n": len(row["chosen"])}).to_list() == mapped


def test_a_length_cache_file_copied_in_from_another_key_is_named_and_measured_again(tmp_path, capsys):
    """The analyzer's lengths (DPOTRAIN_CACHE/lengths/<key>.npz) of another data set copied over this one's name (a
    cache restored from a backup, a copy between machines): a run under `max_length: auto` chose its length from the
    other pairs, recording "100.0% of 24 pairs fit untruncated" for a data set of 48 rows, and the dry run planned
    24 pairs' reference and layout, all in silence. Each file names its key, as the reference cache's do."""
    from dpotrain.data import lengths

    cache, tokenizer = tmp_path / "lengths", builtin.build_tokenizer()
    for rows, dataset_id in ((8, "eight-pairs"), (24, "twenty-four-pairs")):
        pairs = datasets.Dataset.from_list(builtin.make_preference_rows(rows, seed=1))
        lengths.analyse(pairs, tokenizer, 0.99, dataset_id, cache, progress=False)
    mine, _ = lengths._cached_at("eight-pairs", tokenizer, cache)
    theirs, _ = lengths._cached_at("twenty-four-pairs", tokenizer, cache)
    assert lengths.cached_measure("eight-pairs", tokenizer, cache)[0].rows == 8
    shutil.copy(theirs.with_suffix(".npz"), mine.with_suffix(".npz"))
    capsys.readouterr()

    assert lengths.cached_measure("eight-pairs", tokenizer, cache) is None  # not the 24 other pairs' lengths
    said = capsys.readouterr().err
    assert said == (
        f"warning: the length cache file {mine.with_suffix('.npz')} is damaged (it holds the lengths of cache key "
        f"{theirs.name}, another data set, tokenizer or chat template than its name's: a file copied in from "
        "another); it is removed and its lengths are measured again by the next analysis (`max_length: auto`, "
        "scripts/analyze_dataset.py)\n"
    ), said
    assert not mine.with_suffix(".npz").exists() and theirs.with_suffix(".npz").exists()
    assert lengths.cached_measure("twenty-four-pairs", tokenizer, cache)[0].rows == 24  # its own name: read


@pytest.mark.parametrize("where", ["a pair's column", "a message's field"])
def test_a_json_lines_key_written_twice_is_refused_with_its_line(where, tmp_path, monkeypatch, capsys):
    """A JSON Lines object with a key written twice (`{"chosen": ..., "rejected": ..., "chosen": ...}`, a line
    joined by hand or an export's string template) is JSON to Python, but pyarrow refuses it: the run stopped with
    `could not read dataset file ...: DatasetGenerationError: An error occurred while generating the dataset`,
    naming neither the line nor the key. Now the line and the key, as a line that is not JSON is named."""
    from test_refusals import pair, refused

    lines = [json.dumps(pair(f"Blue {i}.", f"Green {i}.")) for i in range(6)]
    if where == "a pair's column":
        lines[3] = lines[3][:-1] + ', "chosen": ' + json.dumps(pair("Red.")["chosen"]) + "}"
        key = "chosen"
    else:
        lines[3] = lines[3].replace('"content": "Blue 3."', '"content": "Blue 3.", "content": "Red."')
        key = "content"
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    error = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert error == f"error: {path}:4: key {key!r} written twice in one object: keep one, on that line", error


def test_a_field_json_lines_first_give_after_10_mib_is_refused_with_its_line(tmp_path, monkeypatch, capsys):
    """datasets types a JSON Lines file by its first 10 MiB: a field first given after them (a late row's message
    `name`, a tool call, chat_template_kwargs) failed the read, and the run stopped with `could not read dataset file
    ...: DatasetGenerationError: An error occurred while generating the dataset`, naming neither line, field nor fix.
    Now the line and the field, and the fix said there (that line moved to the top) reads."""
    from test_refusals import pair, refused

    from dpotrain.data import data

    long = "Blue, " * 400  # ~2.4 KB a line: 4,500 lines pass 10 MiB
    rows = [pair(f"{long}{i}.", f"Green {i}.") for i in range(4500)]
    late = pair("Red.", "Green.")
    late["chosen"][0] = {**late["chosen"][0], "name": "bob"}  # a copy: the prompt's messages are shared
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r) + "\n" for r in [*rows, late]]
    path.write_text("".join(lines))
    error = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert error.startswith(f"error: {path}:4501: field 'chosen[].name' is first given here, after the file's first"), (
        error
    )
    assert "move this line to the top of the file" in error
    path.write_text("".join([lines[-1], *lines[:-1]]))
    assert data.load_preference_dataset(str(path), say=False)[0]["chosen"][0]["name"] == "bob"

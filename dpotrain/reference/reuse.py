"""Pairs reused across cache keys (docs/reference.md, "Pair by pair across runs"): a run whose data changed in part
scores only the pairs no earlier run has scored under the same model and settings. A finished cache stores a digest
per pair (`pair_digests`); a run without a finished cache of its own key takes, by digest, the pairs of the finished
caches whose identity equals its own in everything but the data (`DATA_KEYS`). Caches written before digests were
stored are not reused."""

import collections
import hashlib
import json
from pathlib import Path

import numpy as np

from dpotrain.data.pair_lengths import pair_columns
from dpotrain.recipe.records import UNREADABLE, npz

DIGEST_BYTES = 16
DATA_KEYS = ("tokens_sha256", "pairs")  # what of a cache's identity names its data, not how its numbers are computed
IDENTITY = "identity.json"  # a finished key's identity, beside its complete.npz: what other runs compare with theirs
KEY_ARRAY = "key"  # the array of each cache file that names the key (its folder's name) it was scored under


def key_of(npz) -> str | None:
    """The cache key a file of the stage was scored under (the name of the folder it was written in); None for a file
    written before files named their key."""
    return str(npz[KEY_ARRAY]) if KEY_ARRAY in npz.files else None


def load_arrays(path: Path, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> tuple[str | None, list]:
    """(`key_of`, the `names` arrays, then the `optional` ones: None where the file has none) of a cache file. A
    flipped bit in the zip's directory is BadZipFile too (`zip_damage`): named and scored again, never a traceback."""
    with npz(path) as f:
        found = [np.asarray(f[name]) for name in names]
        return key_of(f), found + [np.asarray(f[name]) if name in f.files else None for name in optional]


def pair_digests(dataset) -> np.ndarray:
    """`[pairs, 16]` uint8: each pair's digest over its token ids (the columns' lengths too, so ids moved from one
    column to the next make another digest). Arrow buffers, one sha256 per pair."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    columns = []
    for name in pair_columns(dataset):
        column = table.column(name).combine_chunks()
        lengths = np.asarray(pc.list_value_length(column), dtype=np.int64)
        ids = np.asarray(column.flatten(), dtype=np.int64)
        columns.append((lengths, ids, np.concatenate([[0], np.cumsum(lengths)])))
    out = np.empty((len(dataset), DIGEST_BYTES), dtype=np.uint8)
    for i in range(len(dataset)):
        h = hashlib.sha256()
        for lengths, ids, starts in columns:
            h.update(lengths[i].tobytes())
            h.update(ids[starts[i] : starts[i + 1]].tobytes())
        out[i] = np.frombuffer(h.digest()[:DIGEST_BYTES], dtype=np.uint8)
    return out


def fill_from_other_caches(
    caches: Path, own: Path, ident: dict, digests: np.ndarray, chosen: np.ndarray, rejected: np.ndarray
) -> int:
    """Fills the pairs of `chosen` / `rejected` still NaN from other finished caches under `caches` whose identity
    equals `ident` but for the data; returns how many pairs it filled. Unreadable caches are passed over (their own
    runs name and remove them)."""
    wanted = _without_data(ident)
    keys = collections.defaultdict(list)  # a digest -> the pairs still to fill that have it
    for i in np.flatnonzero(np.isnan(chosen)):
        keys[digests[i].tobytes()].append(i)
    filled = 0
    for folder in sorted(caches.iterdir()) if caches.is_dir() else []:
        if not keys:
            break
        if folder == own or _identity(folder) != wanted:
            continue
        found = _complete_with_digests(folder)
        if found is None:
            continue
        for other, (c, r) in zip(*found, strict=True):
            mine = keys.pop(other.tobytes(), None)
            if mine is not None:
                chosen[mine], rejected[mine] = c, r
                filled += len(mine)
    return filled


def _without_data(ident: dict) -> dict:
    return {k: v for k, v in ident.items() if k not in DATA_KEYS}


def _identity(folder: Path) -> dict | None:
    try:
        return _without_data(json.loads((folder / IDENTITY).read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def _complete_with_digests(folder: Path):
    """(digests, [(chosen, rejected)] per pair) of a finished cache that stored digests, else None."""
    try:
        key, (digests, chosen, rejected) = load_arrays(folder / "complete.npz", ("digests", "chosen", "rejected"))
    except UNREADABLE:  # no digests (KeyError: written before they were stored), or damaged
        return None
    if key not in (None, folder.name):  # a copy of another key's file: its folder's identity.json does not say how
        return None  # it was scored
    if not (digests.shape == (len(chosen), DIGEST_BYTES) and chosen.shape == rejected.shape == (len(chosen),)):
        return None
    if not (np.isfinite(chosen).all() and np.isfinite(rejected).all()):  # inf: an overflow's (`Store.parts`)
        return None
    return digests, list(zip(chosen.tolist(), rejected.tolist(), strict=True))

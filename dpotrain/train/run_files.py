"""The run's record of its own files in its output folder (`run_files.json`), which `--overwrite_output_dir` removes
exactly: checkpoints are added by name before their first file (`claim`), listed again once marked complete
(`completed`) and dropped when rotation deletes them (`disown`). Main process only."""

import json
import time
from pathlib import Path

from dpotrain.recipe import records as run_records
from dpotrain.recipe import writes
from dpotrain.recipe.errors import ConfigError

MANIFEST = "run_files.json"
# What records written before checkpoints were recorded by name hold for them: read as the folder's checkpoint folders.
OLD_CHECKPOINTS = "checkpoint-[0-9]*"
# The record's format: 2 records the files a finished run writes at its end (its card, plot, merged model) as it
# writes them; records without it named them from the run's start, written or not (`output_folder.read_manifest`).
FORMAT = 2


# What to do about a damaged record: it is read first as the record of the run already in the folder, which a new
# command would resume or replace; without it no file there can be told the run's, so none is touched.
DAMAGED_FIX = (
    "it is the record of the run already in that folder (the files it wrote, told from anyone else's), so nothing "
    "there is replaced, resumed or removed: pass another --output_dir, or check that folder and remove it yourself"
)


def _record(out: Path, fix: str = DAMAGED_FIX) -> dict | None:
    path = Path(out) / MANIFEST
    record = run_records.read_record(path, fix)
    if record is None:
        return None
    names = record.get("names")
    if not isinstance(names, list):
        why = "no list of names"
    elif odd := [n for n in names if not isinstance(n, str)]:  # replacing the run hashes and compares them as names
        why = f"a name that is not text: {odd[0]!r}"
    # The run records only its folder's own entries: a path out of it (edited in by hand, `../base/model.safetensors`,
    # an absolute one) was followed, the final save deleting that file as an earlier attempt's weights.
    elif odd := [n for n in names if n in ("", ".", "..") or "/" in n]:
        why = f"a name that is not one of the folder's own entries: {odd[0]!r}"
    else:
        return record
    raise ConfigError(f"{path} is unreadable ({why}): {fix}")


def read(out: Path, fix: str = DAMAGED_FIX) -> list[str] | None:
    """The names as recorded; None when there is no record. `fix`: what to do where it is damaged."""
    record = _record(out, fix)
    return None if record is None else record["names"]


def of_this_format(out: Path) -> bool:
    """Whether the record is of `FORMAT` (a record written before formats has none)."""
    return (_record(out) or {}).get("format") == FORMAT


# The checkpoints marked complete: one of them whose folder is gone was moved or deleted after the run saved it
# (`checkpoints.gone`). A name claimed alone may be a save killed before its folder was made, which a rerun passes over.
COMPLETE = "complete"


def write(out: str | Path, names: list[str], complete: list[str] | None = None) -> None:
    """The record of `names`, of which `complete` (the record's own list where None) are checkpoints marked complete."""
    names = list(dict.fromkeys(names))
    if complete is None:
        complete = completed(Path(out)) if writes.exists(Path(out) / MANIFEST) else []
    record = {
        "format": FORMAT,
        "names": names,
        COMPLETE: [n for n in dict.fromkeys(complete) if n in names],
        "written_by": "train_dpo.py: these are the run's own files; "
        "--overwrite_output_dir replaces these and nothing else",
    }
    writes.write_text(Path(out) / MANIFEST, json.dumps(record, indent=1) + "\n")


def claim(out: str | Path, names) -> None:
    known = read(Path(out)) or []
    added = [n for n in names if n not in known]
    if added or not writes.exists(Path(out) / MANIFEST):
        write(out, known + added)


def completed(out: Path, name: str | None = None) -> list[str]:
    """The checkpoints the record lists as marked complete; with `name`, that one added to the list first (the
    main process, once its COMPLETE mark is written). An older record lists none."""
    record = _record(Path(out)) or {"names": []}
    done = _listed_complete(record)
    if name is not None and name in record["names"] and name not in done:
        done.append(name)
        write(out, record["names"], done)
    return done


def incomplete(out: str | Path, name: str) -> bool:
    """Drops `name` from the checkpoints listed as marked complete: the run removes that folder (to write the step
    again, `checkpoints.clear_for_save`; rotation), and a kill before its record is rewritten is no checkpoint gone.
    True if it was listed."""
    record = _record(Path(out))
    done = _listed_complete(record) if record is not None else []
    if name in done:
        write(out, record["names"], [n for n in done if n != name])
    return name in done


def _listed_complete(record: dict) -> list[str]:
    """A read record's checkpoints marked complete, of its names (an edited list's odd entries left out)."""
    listed = record.get(COMPLETE)
    return [n for n in listed if isinstance(n, str) and n in record["names"]] if isinstance(listed, list) else []


def disown(out: str | Path, names) -> None:
    """Drops `names` from the run's record: checkpoints rotation deleted are no longer there to be the run's."""
    known = read(Path(out))
    if known is not None and set(names) & set(known):
        write(out, [n for n in known if n not in set(names)])


def set_aside_if_not_own(out: str | Path, name: str) -> bool:
    """Main process, before the run writes `name` in `out` (a checkpoint, its card, its plot): one there the run's
    record does not name (a person's, put there while the run ran) is renamed `<stem>.not-this-run-<time><suffix>`,
    said in a line, never written over. True if one was. Without a record nothing is moved, but a link: a run
    makes none, so one is never its own, whatever the record names (written through or cleared, it reaches another
    folder)."""
    path = Path(out) / name
    own = read(Path(out))
    if not path.is_symlink() and (own is None or name in own or not writes.exists(path)):
        return False
    aside = path.with_name(f"{path.stem}.not-this-run-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
    path.rename(aside)
    why = "a link, which no run makes" if aside.is_symlink() else f"not this run's ({MANIFEST})"
    print(f"Moved {path} to {aside}: {why}, and the run writes its own {name} there", flush=True)
    return True


def remove_dead_temporaries(out: Path, names) -> None:
    """Main process, before the run writes in `out`: the temporaries its own records' writers left there when killed
    mid-write (`writes.dead_temporaries`), which nothing else would ever remove, said in a line. A person's files, and
    a live writer's, stay."""
    for path in writes.remove_dead_temporaries(Path(out), [MANIFEST, *names]):
        print(f"Removed {path}: left by a write killed midway (its process is gone)", flush=True)

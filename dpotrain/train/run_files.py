"""The run's record of its own files in its output folder (`run_files.json`), which `--overwrite_output_dir` removes
exactly: checkpoints are added by name before their first file (`claim`) and dropped when rotation deletes them
(`disown`). Main process only."""

import json
from pathlib import Path

from dpotrain.recipe import records as run_records
from dpotrain.recipe import writes
from dpotrain.recipe.errors import ConfigError

MANIFEST = "run_files.json"


def read(out: Path) -> list[str] | None:
    """The names as recorded; None when there is no record."""
    fix = "it lists the run's own files; move the folder aside and pass a new --output_dir"
    record = run_records.read_record(Path(out) / MANIFEST, fix)
    if record is None:
        return None
    if not isinstance(record.get("names"), list):
        raise ConfigError(f"{Path(out) / MANIFEST} is unreadable (no list of names): {fix}")
    return record["names"]


def write(out: str | Path, names: list[str]) -> None:
    record = {
        "names": list(dict.fromkeys(names)),
        "written_by": "train_dpo.py: these are the run's own files; "
        "--overwrite_output_dir replaces these and nothing else",
    }
    writes.write_text(Path(out) / MANIFEST, json.dumps(record, indent=1) + "\n")


def claim(out: str | Path, names) -> None:
    known = read(Path(out)) or []
    added = [n for n in names if n not in known]
    if added or not (Path(out) / MANIFEST).exists():
        write(out, known + added)


def disown(out: str | Path, names) -> None:
    """Drops `names` from the run's record: checkpoints rotation deleted are no longer there to be the run's."""
    known = read(Path(out))
    if known is not None and set(names) & set(known):
        write(out, [n for n in known if n not in set(names)])

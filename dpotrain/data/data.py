"""Load a preference data set: from the Hub, a JSONL/JSON/Parquet/CSV file, or a folder saved with `save_to_disk`."""

import codecs
import collections
import functools
import glob
import hashlib
import itertools
import json
import lzma
import os
import re
import shlex
import shutil
import zlib
from pathlib import Path

from dpotrain.data import data_identity, shapes
from dpotrain.recipe import upstream, venv
from dpotrain.recipe.errors import ConfigError, cause, plural, size, warn
from dpotrain.recipe.writes import unwritable

# datasets' own suffixes for these builders (its _EXTENSION_TO_MODULE): a file of them is read as its folder's would be
LOCAL_SUFFIXES = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".arrow": "arrow",  # an Arrow file (IPC stream or file), as save_to_disk writes a split's `data-*.arrow`
}
JSON_LINES = (".jsonl", ".ndjson")
DELIMITERS = {".csv": ",", ".tsv": "\t"}  # datasets reads `.tsv` as CSV separated by tabs
# Codecs datasets reads a text data file through, by its suffix (`x.jsonl.gz`): each one's name, and how its stream
# begins (a file named for one that begins otherwise is not compressed so)
COMPRESSIONS = {".gz": ("gzip", b"\x1f\x8b"), ".bz2": ("bzip2", b"BZh"), ".xz": ("xz", b"\xfd7zXZ\x00")}
REQUIRED_COLUMNS = ("chosen", "rejected")
# Names public preference sets give a string prompt (Alpaca's `instruction`, Orca's `question`): `prompt_column`
PROMPT_NAMES = ("instruction", "question", "input", "query", "problem", "request")


def format_suffix(path: Path) -> str:
    """The suffix that says a data file's format, under a compression's (`pairs.jsonl.gz`: .jsonl)."""
    return path.with_suffix("").suffix if path.suffix in COMPRESSIONS else path.suffix


def builder_of(path: Path) -> str | None:
    """datasets' builder for a data file, or None (Parquet and Arrow compress inside the file: `x.parquet.gz` is not
    read)."""
    builder = LOCAL_SUFFIXES.get(format_suffix(path))
    return None if builder in ("parquet", "arrow") and path.suffix in COMPRESSIONS else builder


def lower_suffix(path: Path) -> Path:
    """`path` with its format's suffix (and a compression's after it) in lower case: `P.JSONL.GZ` is P.jsonl.gz."""
    suffixes = "".join(path.suffixes[-2:] if path.suffix.lower() in COMPRESSIONS else path.suffixes[-1:])
    return path.with_name(path.name.removesuffix(suffixes) + suffixes.lower())


def open_data(path: Path, mode: str = "rb", **text):
    """A data file's content through the codec its suffix names (fsspec's, which datasets reads it with)."""
    import fsspec

    return fsspec.open(str(path), mode, compression="infer", **text)


def looks_like_path(name: str) -> bool:
    """Written as a path, not a Hub repo id (`org/name`), or under a folder that exists here (a mistyped local path)."""
    return name.startswith((".", "/", "~")) or name.count("/") >= 2 or ("/" in name and Path(name).parent.is_dir())


def is_local(name: str) -> bool:
    """A path the user means as a local file or folder (a Hub name is `org/name` and does not exist on disk)."""
    path = Path(name).expanduser()
    return builder_of(path) is not None or looks_like_path(name) or path.exists()


def local_path(name: str) -> Path:
    """A local data set's path as given, `~` expanded; the folder the command runs in (`.`, `./`) by its full path:
    datasets names a folder's data set after the folder, and refused `.`, which has no name, as unreadable."""
    path = Path(name).expanduser()
    return path.resolve() if not path.name and path.is_dir() else path


def check_dataset_name(name: str | None) -> None:
    if not name:
        raise ConfigError("no dataset: set dataset_name in the recipe or pass --dataset_name (Hub name or local file)")
    path = Path(name).expanduser()
    if is_local(name) and not path.exists():
        where = ""
        if not path.is_absolute():  # looked for here, and for a Slurm job where it was submitted too
            here, submitted = str(Path.cwd()), os.environ.get("DPOTRAIN_SUBMIT_DIR")
            also = f" and {submitted} (where the job was submitted)" if submitted and submitted != here else ""
            where = f" (looked in {here}{also})"
        if matched := _pattern_files(path):
            source = f"{{path: {builder_of(path) or 'json'}, data_files: '{name}'}}"
            raise ConfigError(
                f"dataset {name!r} is a pattern (it matches {plural(matched, 'file')}), and dataset_name names one "
                "file or folder: give the folder that holds them (every data file in it is read), or the pattern as "
                f"a mixture source's data_files (datasets: [{source}])"
            )
        raise ConfigError(
            f"dataset {name!r} does not exist{where}: check the path, or give a Hub name like org/dataset"
        )
    if path.exists() and not (path.is_file() or path.is_dir()):
        # A pipe (`--dataset_name <(zcat pairs.jsonl.gz)`), a device, a socket: it was sent to the Hub ("could not load
        # data set '/dev/fd/63' from the Hub"), and a pipe is empty once read, where a run reads its data more than
        # once (its checksum, the load, each resume's comparison)
        raise ConfigError(
            f"dataset {name!r} is not a file or a folder (a pipe or a device): write the pairs to a file first "
            "(.jsonl, or .jsonl.gz as it is) and give that file"
        )
    if path.exists():
        check_read_as_named(name, path)
    if path.is_dir() and not data_identity.saved(path):
        check_one_format(name, path)
    if path.is_file() and path.suffix in LOCAL_SUFFIXES:
        check_file_kind(path)
    if path.is_file() and path.suffix in COMPRESSIONS:
        check_compressed(path)


def _pattern_files(path: Path) -> int:
    """How many files a path written as a glob (`shards/*.jsonl`, `**`) names, 0 if it is none."""
    if not any(c in str(path) for c in "*?["):
        return 0
    return sum(1 for p in glob.glob(str(path), recursive=True) if Path(p).is_file())


def check_read_as_named(name: str, path: Path) -> None:
    """datasets reads local paths as fsspec patterns (`[1]` matches `1`, `?` and `*` neighbours, `::` chains file
    systems): a file's path is escaped (`as_files`), a folder's cannot be (datasets joins its patterns to it), nor
    `::`: refused."""
    where = os.path.abspath(path)
    folder = path.is_dir() and not data_identity.saved(path)  # load_from_disk reads a saved folder by its path
    found = "::" if "::" in where else next((c for c in "[]*?" if c in where), None) if folder else None
    if found:
        raise ConfigError(
            f"dataset {name!r}: its path {where} holds {found!r}, which datasets reads as a pattern in "
            f"{'a folder of data files' if folder else 'a file'} (other files, or none, would be read as the data): "
            f"rename it, or move it to a path without {found!r}"
        )


def as_files(path: Path) -> str:
    """A data file as datasets' `data_files` takes it literally: absolute, its pattern characters escaped."""
    return glob.escape(os.path.abspath(path))


SUFFIX_OF = {"parquet": ".parquet", "json lines": ".jsonl", "a json array": ".json"}


def file_kind(path: Path) -> str | None:
    """What a data file holds, from its first and last bytes: parquet, json lines, a json array, or None."""
    with open(path, "rb") as f:
        head = f.read(4096)
        if head[:4] == b"PAR1":
            f.seek(-4, 2)
            return "parquet" if f.read(4) == b"PAR1" else None
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    return {b"{": "json lines", b"[": "a json array"}.get(text[:1])


def check_file_kind(path: Path) -> None:
    """Refuses a file whose suffix says another format than it holds, saying how to name it."""
    if found := misnamed(path):
        raise ConfigError(found)


def misnamed(path: Path) -> str | None:
    """Why a data file is not what its suffix says (a `.parquet` cut short, or holding JSON Lines), or None."""
    kind = file_kind(path)
    fits = {".parquet": kind == "parquet", ".csv": kind is None, ".tsv": kind is None, ".arrow": kind is None}.get(
        path.suffix, kind != "parquet"
    )
    if fits:
        return None
    if kind is None:  # a .parquet holding neither JSON nor a whole Parquet file: nothing to rename it to
        return _not_parquet(path)
    return (
        f"dataset file {str(path)!r} is named {path.suffix} but holds {kind}: rename it to "
        f"{path.with_suffix(SUFFIX_OF[kind]).name!r} (the suffix decides how it is read)"
    )


def _not_parquet(path: Path) -> str:
    """Why a `.parquet` file is not read as one: begun as Parquet but without its end (the footer datasets reads first:
    a copy or a download stopped midway), or not Parquet at all."""
    with open(path, "rb") as f:
        begun = f.read(4) == b"PAR1"
    if begun:
        return (
            f"dataset file {str(path)!r} is cut short: it begins as Parquet but lacks Parquet's end (its footer, "
            f"which says where its rows are; {size(path.stat().st_size)} were written or copied): copy it again, or "
            "write it again (Dataset.to_parquet)"
        )
    return (
        f"dataset file {str(path)!r} is named .parquet but is not Parquet (nor JSON): write the pairs to it as "
        "Parquet (Dataset.to_parquet), or give it the suffix of the format it holds (.jsonl, .csv, ...)"
    )


def check_compressed(path: Path) -> None:
    """Refuses a file named `.gz`, `.bz2` or `.xz` that is not compressed so (plain JSON Lines renamed `x.jsonl.gz`):
    it is read through that codec, which fails in a traceback naming no file (`BadGzipFile`). An empty one is left to
    the check of empty files."""
    codec, magic = COMPRESSIONS[path.suffix]
    with open(path, "rb") as f:
        head = f.read(len(magic))
    if head and not head.startswith(magic):
        raise ConfigError(
            f"dataset file {str(path)!r} is named {path.suffix} but is not {codec}-compressed (the suffix decides how "
            f"it is read): rename it to {path.with_suffix('').name!r} if it holds the pairs uncompressed, or compress "
            f"it with {codec}"
        )


def broken_compression(path: Path) -> str | None:
    """Why a compressed data file cannot be read to its end, or None: cut short (its stream stops before the codec's
    end mark: a copy or a download stopped midway) or damaged. Decompresses the whole file: called only where reading
    it failed, whose error (`EOFError: Compressed file ended ...`) names neither the file nor the fix."""
    if path.suffix not in COMPRESSIONS:
        return None
    codec = COMPRESSIONS[path.suffix][0]
    try:
        with open_data(path) as f:
            while f.read(1 << 20):
                pass
    except EOFError:
        return (
            f"dataset file {str(path)!r} is cut short: its {codec} stream stops before its end (a copy or a download "
            "stopped midway): copy it again"
        )
    except Exception as e:  # noqa: BLE001 - each codec names damage its own way (OSError, LZMAError, zlib.error)
        return f"dataset file {str(path)!r} is damaged: {codec} cannot read it ({cause(e)}): copy it again"
    return None


def check_one_format(name: str, path: Path) -> None:
    """Refuses a folder of several formats: datasets reads only the commonest (`infer_module_for_data_files_list`),
    silently; unless its README.md names its files (`configs:`)."""
    from datasets.data_files import FILES_TO_IGNORE

    readme = path / "README.md"
    if readme.is_file() and "configs:" in readme.read_text(encoding="utf-8", errors="replace"):
        return
    kinds, others = {}, []
    for file, p in (data_identity.files(str(path)) or {}).items():
        if p.name not in FILES_TO_IGNORE and p.suffix.lower() in LOCAL_SUFFIXES:
            kind = "tsv" if p.suffix.lower() == ".tsv" else LOCAL_SUFFIXES[p.suffix.lower()]  # read with other sep
            kinds.setdefault(kind, []).append(file)
        elif p.name not in FILES_TO_IGNORE and p.suffix.lower() in upstream.data_extensions():
            others.append(file)  # notes (.txt, .md), images, ...: another format datasets reads a folder as
    if kinds and others:
        _check_read_as_pairs(name, path, others)
    if len(kinds) > 1:
        held = "; ".join(
            f"{kind}: {', '.join(files[:2])}{', ...' if len(files) > 2 else ''}" for kind, files in kinds.items()
        )
        raise ConfigError(
            f"dataset folder {name!r} holds data files of {len(kinds)} formats ({held}), and datasets reads a folder's "
            "files of one format only, leaving the others out: convert them to one format, or name each file as a "
            "source of a mixture (docs/data.md)"
        )


def _check_read_as_pairs(name: str, path: Path, others: list[str]) -> None:
    """Refuses a folder of data files that datasets reads as another format's files, which outnumber the pairs' (two
    notes.txt beside one pairs.jsonl, two plots beside it): the pairs were left out, and the folder refused as a data
    set with no chosen/rejected columns (it has ['text']), naming neither the files nor the fix."""
    import datasets

    try:
        module = datasets.load_dataset_builder(str(path)).name
    except Exception:  # noqa: BLE001 - not resolvable here: the load says why, in one line
        return
    if module in LOCAL_SUFFIXES.values():
        return
    shown = f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}"
    raise ConfigError(
        f"dataset folder {name!r} holds {plural(len(others), 'file')} of another format than its pairs ({shown}), "
        f"and datasets reads a folder's files of its commonest format only: it would read them ({module}) and leave "
        "the pairs out: move them out of the folder"
    )


def check_split_files(name: str, path: Path) -> None:
    """Refuses a folder whose files are named by split (`train.jsonl`, `test.jsonl`) beside data files no split's name
    matches (`more_pairs.jsonl`): datasets reads the named splits' files alone (`get_data_patterns`), so those pairs
    would be left out in silence, and a folder with `test.jsonl` and `pairs.jsonl` would offer `test` to train on;
    unless its README.md names its files (`configs:`)."""
    from datasets.data_files import DEFAULT_PATTERNS_ALL, FILES_TO_IGNORE, DataFilesDict, get_data_patterns

    readme = path / "README.md"
    if readme.is_file() and "configs:" in readme.read_text(encoding="utf-8", errors="replace"):
        return
    try:
        patterns = get_data_patterns(str(path))
        splits = DataFilesDict.from_patterns(patterns, base_path=str(path))
    except Exception:  # noqa: BLE001 - no data file at all: the load says what the folder holds
        return
    if patterns == DEFAULT_PATTERNS_ALL:  # no file named by split: the folder is one data set, every file trained
        _check_held_out_names(name, path)
        return
    read = {Path(f).resolve() for found in splits.values() for f in found}
    left = [
        file
        for file, p in (data_identity.files(str(path)) or {}).items()
        if builder_of(p)
        and p.name not in FILES_TO_IGNORE  # dataset_info.json, config.json: never data
        and p.resolve() not in read
        and not any(part.startswith("__") for part in Path(file).parts)
    ]
    if left:
        named = "; ".join(f"{split}: {', '.join(Path(f).name for f in found[:2])}" for split, found in splits.items())
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise ConfigError(
            f"dataset folder {name!r} names its files by split ({named}), and datasets then reads those alone: "
            f"{', '.join(left[:3])}{more} would be left out: name each data file by its split (train.jsonl, "
            "train-2.jsonl, test.jsonl), or move it out of the folder"
        )


# Words of a file name (in lower case, between non-letters) that say it holds held-out pairs where datasets reads no
# split from it (`Test.jsonl`, `testset.jsonl`, `heldout.jsonl`: its split names are lower-case, between separators)
HELD_OUT_WORDS = {"test", "testing", "testset", "tst", "eval", "evaluation", "evalset", "validation", "valid", "val"}
HELD_OUT_WORDS |= {"valset", "validset", "dev", "devset", "heldout", "holdout"}


def _check_held_out_names(name: str, path: Path) -> None:
    """Refuses a folder read whole (no file named by split as datasets reads split names) one of whose data files is
    named as held-out pairs: it would be trained on, in silence."""
    from datasets.data_files import FILES_TO_IGNORE

    found = (data_identity.files(str(path)) or {}).items()
    files = [file for file, p in found if builder_of(p) and p.name not in FILES_TO_IGNORE]
    for file in files if len(files) > 1 else ():
        stem = str(Path(file).with_suffix("")).lower()
        if HELD_OUT_WORDS & set(re.findall(r"[a-z]+", stem)) or re.search(r"(held|hold)[^a-z]*out", stem):
            raise ConfigError(
                f"dataset folder {name!r} is read as one data set, every file of it trained, since none of its files "
                "is named by split as datasets reads split names (train, test, validation in lower case, alone or "
                f"between separators: prefs_test.jsonl): {file} would be trained on, though its name says held-out "
                "pairs: name the files by split (train.jsonl, test.jsonl), or move it out of the folder"
            )


def load_preference_dataset(
    name: str,
    split: str = "train",
    config: str | None = None,
    revision: str | None = None,
    streaming: bool = False,
    say: bool = True,
    split_flag: str | None = None,
    select=None,
):
    """The `split` of data set `name`, checked for `chosen`/`rejected`. `split_flag`: the option that chose `split`;
    `select`: what is kept of the split before it is read (a mixture entry's `columns`, `kept_columns`)."""
    import datasets

    check_dataset_name(name)
    path = local_path(name)
    if not data_identity.saved(path):
        check_datasets_cache()  # a saved data set is read in place; any other is written to the cache first
    if path.is_dir() and data_identity.saved(path):
        # datasets cannot read a split saved with no rows back (IndexError inside load_from_disk)
        if empty := _empty_saved_splits(path):
            splits, them = plural(len(empty), "split", count=False), "it" if len(empty) == 1 else "them"
            raise ConfigError(f"dataset {name!r}: {splits} {empty} saved with no rows; remove {them} or save rows")
        loaded = _known_by_its_files(datasets.load_from_disk(str(path)), path)
    elif path.is_file():
        builder = builder_of(path)
        if builder is None and builder_of(lower := lower_suffix(path)) is not None:
            raise ConfigError(  # `PAIRS.JSONL` (a Windows export): "use .jsonl" did not say what was wrong with it
                f"dataset file {name!r}: a data file's suffix is read in lower case only (as datasets reads a "
                f"folder's files): rename it to {lower.name!r}"
            )
        if builder is None:
            raise ConfigError(
                f"dataset file {name!r}: use .jsonl, .json, .parquet, .arrow or .csv (.ndjson, .tsv; or .jsonl.gz, "
                f".csv.gz, ...: {', '.join(COMPRESSIONS)}) (docs/data.md)"
            )
        if path.stat().st_size == 0 or not _has_rows(path):  # datasets: "Instruction 'train' corresponds to no data!"
            empty = "is empty" if path.stat().st_size == 0 else "has no rows"
            raise ConfigError(f"dataset file {name!r} {empty}: it needs {_row_form(path)}")
        text = _csv_columns_as_text(path) if builder == "csv" else None  # a CSV cell is text
        sep = {"sep": "\t"} if format_suffix(path) == ".tsv" else {}
        files = {split: as_files(path)}
        if not streaming:
            check_cache_room(builder, data_files=files, features=text, **sep)
        try:
            loaded = load_as_text(text, load_dataset, builder, data_files=files, streaming=streaming, **sep)
        except Exception as e:  # noqa: BLE001 - datasets names neither the file's line nor the fix
            raise ConfigError(_bad_line(path) or f"could not read dataset file {str(path)!r}: {cause(e)}") from None
        if builder in ("json", "csv") and not streaming:
            _check_utf8(loaded[split], path)
        if builder == "json" and format_suffix(path) not in JSON_LINES and (found := lone_surrogate(path)):
            raise ConfigError(found)  # datasets read the array with the half character dropped: not the text written
        if builder == "json" and not streaming:
            loaded[split] = exact_mixed_fields(loaded[split], split, builder, data_files=files)
    elif path.is_dir():  # a folder of data files: by its path (a recipe's `~/prefs` is no Hub name)
        check_folder_config(name, path, config)
        check_split_files(name, path)
        csv = [p for p in (data_identity.files(str(path)) or {}).values() if format_suffix(p) in DELIMITERS]
        if not streaming:
            check_cache_room(str(path), name=config, features=csv_text_features(csv))
        try:  # a folder of CSV files: read as text, as one file is (it is read as CSV where they are the most files)
            loaded = load_as_text(csv_text_features(csv), load_dataset, str(path), name=config, streaming=streaming)
        except Exception as e:  # noqa: BLE001 - said to come "from the Hub", naming neither its file nor the fix
            raise ConfigError(_unreadable_folder(name, path, e)) from None
        if not streaming and split in loaded:
            loaded[split] = exact_mixed_fields(loaded[split], split, str(path), name=config)
    else:
        try:
            loaded = load_dataset(name, name=config, revision=revision, streaming=streaming)
        except Exception as e:  # noqa: BLE001 - unknown name, no access, no network: one line, not a traceback
            raise ConfigError(f"could not load data set {name!r} from the Hub: {cause(e)}") from None
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in loaded:
            how = f"set {split_flag} to" if split_flag else "choose"
            raise ConfigError(f"dataset {name!r} has no split {split!r}: {how} one of {sorted(loaded)}")
        loaded = loaded[split]
    loaded = select(loaded) if select else loaded
    check_columns(loaded, name)
    return prompt_column(loaded, name, split, say)


def kept_columns(dataset, columns, what: str):
    """`columns` of `dataset` alone (a mixture entry's `columns`, TRL's `select_columns` right after the load), kept
    before the split is read: after, an Alpaca `instruction` named there had been renamed `prompt` (refused as no
    such column), and one chosen beside `input` refused as two prompts."""
    if missing := [c for c in columns if c not in dataset.column_names]:
        raise ConfigError(
            f"{what}: no {plural(len(missing), 'column', count=False)} {missing} (it has "
            f"{sorted(dataset.column_names)}): fix `columns`"
        )
    return dataset.select_columns(list(columns))


def prompt_column(dataset, name: str, split: str = "train", say: bool = True):
    """String answers with no `prompt` column: the one `PROMPT_NAMES` column read as the prompt (TRL would take the
    answers' common start); two such columns refused."""
    columns = dataset.column_names or []
    if "prompt" in columns:
        return dataset
    first = next(iter(dataset), None) or {}
    chosen, rejected = first.get("chosen"), first.get("rejected")
    if _answers_alone(chosen) and _answers_alone(rejected):  # message lists without the turns they answer
        if waiting := _conversation_column(itertools.islice(dataset, CONVERSATION_ROWS)):
            raise ConfigError(
                f"dataset {name!r} has answers that are assistant messages alone, no `prompt` column and, in column "
                f"{waiting!r} (not read), a conversation waiting for its answer: every pair would have no prompt; "
                f"rename {waiting!r} to `prompt`"
            )
    if not isinstance(chosen, str) or not isinstance(rejected, str) or shapes.is_hh(chosen):
        return dataset  # message lists (the conversations hold the prompt), or HH-RLHF strings
    if waiting := _conversation_column(itertools.islice(dataset, CONVERSATION_ROWS)):
        raise ConfigError(
            f"dataset {name!r} has string answers, no `prompt` column and, in column {waiting!r} (not read), a "
            "conversation waiting for its answer: the answers would be read without it as their prompt; rename "
            f"{waiting!r} to `prompt` and write each answer as a "
            "message list ([{'role': 'assistant', 'content': ...}]), or remove the column"
        )
    found = [c for c in PROMPT_NAMES if c in columns]
    if not found:
        return dataset
    if len(found) > 1:
        raise ConfigError(
            f"dataset {name!r} has string answers, no `prompt` column and {len(found)} that may hold it "
            f"({', '.join(sorted(found))}): rename the one that holds the prompt to `prompt` (or join them into it)"
        )
    (column,) = found
    # Text by its type and values where they are known (a stream's: its first row): a first row's null (a row without
    # its question) left the column unread, and every row trained with an empty prompt
    feature, table = (dataset.features or {}).get(column), getattr(getattr(dataset, "data", None), "table", None)
    if feature is not None and table is not None:
        text = getattr(feature, "dtype", None) in ("string", "large_string")
        text = text and table[column].null_count < table.num_rows  # an empty column holds no prompt
    else:
        text = isinstance(first.get(column), str)
    if not text:
        return dataset
    # Read as the prompt also where the first row's answers start with it: the `prompt` column's reading takes each
    # pair's repetition out (shapes.Shape.repeats_prompt). Left unread for that, every other row lost its question:
    # a chit-chat first row (`Hello` answered `Hello! ...`) trained the rest with the answers' common start, often none.
    if say:
        print(
            f"Data ({split}): column {column!r} read as the prompt (there is no `prompt` column; chosen and rejected "
            "are the answers to it)",
            flush=True,
        )
    return dataset.rename_column(column, "prompt")


# Rows read for a conversation column: a first row's empty list (a pair without one) hid the conversations of the rest
CONVERSATION_ROWS = 64


def _answers_alone(side) -> bool:
    """A side written as assistant messages alone (no turn before the answer)."""
    return (
        isinstance(side, list)
        and bool(side)
        and all(isinstance(m, dict) and m.get("role") == "assistant" for m in side)
    )


def _conversation_column(rows) -> str | None:
    """A column not read whose value, in one of `rows`, is a message list (`role` or ShareGPT's `from`) ending with the
    user's turn."""
    for row in rows:
        for column, value in row.items():
            if column in ("chosen", "rejected", *shapes.KEPT_COLUMNS) or not isinstance(value, list) or not value:
                continue
            last = value[-1]
            if all(isinstance(m, dict) for m in value) and (last.get("role") or last.get("from")) in ("user", "human"):
                return column
    return None


def _row_form(path: Path) -> str:
    """What a pair is in a file of this format."""
    if builder_of(path) == "csv":
        return "a header line naming chosen and rejected (optionally prompt), then one pair per line"
    if format_suffix(path) in JSON_LINES:
        return "one JSON object per line with chosen/rejected"
    if format_suffix(path) == ".json":
        return "a JSON array of objects with chosen/rejected, or one such object per line"
    return "one pair per row, with chosen/rejected"


def _has_rows(path: Path) -> bool:
    """Whether a local file holds a row, from its head only (every rank checks it); undecided counts as yes."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows > 0
    if builder_of(path) == "arrow":
        return _arrow_has_rows(path)
    if builder_of(path) == "csv":
        return _csv_has_rows(path)
    if builder_of(path) != "json":
        return True
    try:
        with open_data(path, "rt", encoding="utf-8-sig", errors="replace") as f:  # a byte-order mark is no row
            for line in f:  # up to the first non-blank line
                if line.strip():
                    head = line.strip() + f.read(4096)
                    return not (head.startswith("[") and head[1:].lstrip().startswith("]"))
    # A compressed file cut short or damaged within its head: undecided, and the load names it (`broken_compression`)
    except (EOFError, OSError, ValueError, lzma.LZMAError, zlib.error):
        return True
    return False


def _csv_has_rows(path: Path) -> bool:
    """Whether a CSV file holds a record after its header line, blank lines skipped as pandas skips them: a header
    alone (an export of no rows) was datasets' 'Instruction "train" corresponds to no data!', naming neither file nor
    fix. Undecided (a damaged compressed file, a field past csv's limit) counts as yes: the load says why."""
    import csv

    try:
        with open_data(path, "rt", newline="", encoding="utf-8-sig", errors="replace") as f:
            records = csv.reader(f, delimiter=DELIMITERS.get(format_suffix(path), ","))
            next(records, None)  # the header
            return any(records)  # a blank line is an empty record
    except (EOFError, OSError, ValueError, csv.Error, lzma.LZMAError, zlib.error):
        return True


def _arrow_has_rows(path: Path) -> bool:
    """Whether an Arrow file (an IPC stream, as save_to_disk writes, or an IPC file) holds a row, read as datasets'
    arrow builder reads it, mapped, not copied; undecided (not Arrow) counts as yes: the load says why."""
    import pyarrow as pa

    try:
        return any(_arrow_batch_rows(path))
    except (pa.ArrowInvalid, OSError):
        return True


def _arrow_batch_rows(path: Path):
    """The rows of each record batch of an Arrow file (an IPC stream or file), one by one, the file mapped, not
    copied; pyarrow's ArrowInvalid where it is not Arrow."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            yield from (batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            yield from (reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def csv_text_features(paths):
    """`_csv_columns_as_text` for CSV files read as one data set (pandas' per-file types could not be joined); None
    where a file is not `.csv` or `.tsv` (compressed or not, all alike) or the headers differ."""
    paths = [Path(p) for p in paths]
    # By the format under a compression: a folder of `.csv.gz` shards is CSV too (its quotes were never checked)
    if not paths or len({format_suffix(p) for p in paths}) > 1 or format_suffix(paths[0]) not in DELIMITERS:
        return None
    first = _csv_columns_as_text(paths[0])
    return first if all(_csv_columns_as_text(p) == first for p in paths[1:]) else None


# The end-of-stream mark that closes every Arrow file datasets writes (its copy of the data, its caches of maps)
ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _known_by_its_files(loaded, path: Path):
    """A saved data set (each split of one) whose fingerprint is its files' as they are now. datasets names the caches
    of maps over a split (TRL's tokenization, the rows' checks: `cache-*.arrow`, written beside its data) by the
    fingerprint its state.json holds, which no change of its Arrow files moves: other pairs' `data-*.arrow` copied in
    were read through the old pairs' caches, and a new run trained on the old pairs' tokens under a record of the new
    files' SHA-256. Keyed by the state.json and each data file's stamp (`data_identity.stamp`: size, times, inode)."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        return datasets.DatasetDict({k: _known_by_its_files(v, path / k) for k, v in loaded.items()})
    digest = hashlib.sha256((path / "state.json").read_bytes())
    for found in loaded.cache_files:
        file = Path(found["filename"])
        digest.update(f"{file.resolve()}:{data_identity.stamp(file)};".encode())
    return loaded.select_columns(loaded.column_names, new_fingerprint=digest.hexdigest()[:16])


def cached_by_datasets(dataset, *key) -> dict:
    """`map` arguments that put the cache of a map over `dataset` in datasets' cache where datasets would write it
    beside the user's own files: a data set saved with `save_to_disk` is read in place, and datasets writes the caches
    of maps over it (`cache-*.arrow`) into its folder, which the run does not own (shared, or read-only: the run
    failed there). Once one map caches in datasets' cache, every map after it (TRL's tokenization, the assistant
    turns' labels) caches beside that one. Named by `dataset`'s fingerprint (its files as they are now,
    `_known_by_its_files`, and the rows kept) and `key` (the map's function and what it is given), so that the next
    run reuses it. {} for a data set datasets copied into its cache (a file's, a Hub data set's), or held in memory."""
    import datasets
    from datasets.fingerprint import Hasher

    files = [Path(found["filename"]).resolve() for found in dataset.cache_files]
    cache = Path(datasets.config.HF_DATASETS_CACHE).expanduser().resolve()
    if not files or files[0].is_relative_to(cache):
        return {}
    check_datasets_cache()
    saved = files[0].parent
    folder = cache / "saved_to_disk" / f"{saved.name}-{hashlib.sha256(str(saved).encode()).hexdigest()[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    fingerprint = Hasher.hash([upstream.dataset_fingerprint(dataset), *key])
    return {"cache_file_name": str(folder / f"cache-{fingerprint}.arrow"), "new_fingerprint": fingerprint}


# What of load_dataset's arguments load_dataset_builder does not take
NOT_THE_BUILDERS = ("split", "streaming", "keep_in_memory", "verification_mode", "num_proc", "save_infos")


def load_dataset(*args, **kwargs):
    """`datasets.load_dataset`, its Arrow copy remade where a cleaner removed files of it (datasets takes it as made and
    fails naming a cache file), a file of it was cut short (`_cut_short`) or its data changed since it was made
    (`_remove_older_copy`)."""
    import datasets

    again, builder = {}, _local_builder(args, kwargs)
    _remove_older_copy(builder)  # made again from the files as they are now
    if cut := _cut_short(builder):
        named = _named(args[0], kwargs.get("data_files"))
        warn(
            f"datasets' copy of {named} in {cut[0].parent} has files cut short since it was made "
            f"({', '.join(p.name for p in cut)}; a copy or a write stopped midway): removed, and made again from the "
            "data"
        )
        for path in cut:  # looked at again: another rank of the run may have made it again meanwhile
            if not _whole(path):
                path.unlink(missing_ok=True)
        if any(not p.name.startswith("cache-") for p in cut):  # its own copy, not only a map's cache over it
            again = {"download_mode": datasets.DownloadMode.REUSE_CACHE_IF_EXISTS}
    try:
        return datasets.load_dataset(*args, **again, **kwargs)
    except FileNotFoundError as e:
        cache = Path(datasets.config.HF_DATASETS_CACHE)
        words = map(Path, str(e).replace('"', "'").split("'"))
        lost = next(
            (p for p in words if p.is_absolute() and any(map(p.is_relative_to, (cache, cache.resolve())))), None
        )
        if lost is None or kwargs.get("streaming"):
            raise
    named = _named(args[0], kwargs.get("data_files"))
    warn(
        f"datasets' copy of {named} in {lost.parent} has lost files since it was made ({lost.name} is "
        "missing): it is made again from the data"
    )
    # The raw files a Hub data set downloaded are kept; only the Arrow copy is prepared again.
    return datasets.load_dataset(*args, download_mode=datasets.DownloadMode.REUSE_CACHE_IF_EXISTS, **kwargs)


def _local_builder(args, kwargs):
    """The builder of a local load (a folder, or a builder's `data_files`), whose copy datasets keeps in its cache;
    None for a Hub data set (its builder would ask the Hub once more), a streamed one, or one the load refuses."""
    import datasets

    if kwargs.get("streaming") or not (kwargs.get("data_files") or Path(args[0]).expanduser().is_dir()):
        return None
    try:
        return datasets.load_dataset_builder(*args, **{k: v for k, v in kwargs.items() if k not in NOT_THE_BUILDERS})
    except Exception:  # noqa: BLE001 - the load itself says what is wrong
        return None


def _older_than_its_data(builder) -> bool:
    """Whether datasets' copy of a local load was made before one of its data files last changed. datasets knows a
    local file by its path and modification time alone: a file replaced by other pairs with that time kept (`cp -p`,
    `rsync -a`, `tar x` of another export; or written twice within a coarse file system's clock tick) was read from
    the old copy, and the run trained on the pairs the file held before, under a record of the new file's SHA-256.
    The change time, which no copy keeps (a link's own too: a link pointed elsewhere), is compared with the copy's
    `dataset_info.json`, written once the copy is made; a chmod or a move makes it again too, which costs one read."""
    made = Path(builder.cache_dir) / "dataset_info.json"
    try:
        if not made.is_file():
            return False
        copied = made.stat().st_mtime_ns
        files = [Path(f) for found in (builder.config.data_files or {}).values() for f in found if "://" not in f]
        return any(max(f.stat().st_ctime_ns, f.lstat().st_ctime_ns) >= copied for f in files)
    except OSError:  # a file gone or unreadable: the load says so
        return False


def _remove_older_copy(builder) -> None:
    """datasets' copy of a local load removed where its data changed since it was made (`_older_than_its_data`), so
    that the load makes it again from the files as they are (made again over it, datasets would check the new pairs
    against the old copy's counts and fail). Decided again under the lock datasets prepares a copy under: another
    rank of the run may have made it again meanwhile, or be reading it."""
    from filelock import FileLock

    if builder is None or not _older_than_its_data(builder):
        return
    folder = Path(builder.cache_dir)
    try:
        with FileLock(f"{folder}_builder.lock"):
            if _older_than_its_data(builder):
                aside = folder.with_name(f"{folder.name}.older-{os.getpid()}")
                folder.rename(aside)  # at once: a load started meanwhile finds none and makes it
                shutil.rmtree(aside, ignore_errors=True)
    except OSError as e:
        raise ConfigError(
            f"datasets' copy of the data in {folder} was made before a data file last changed, and could not be "
            f"removed ({cause(e)}): remove that folder, then rerun"
        ) from None


def _cut_short(builder) -> list[Path]:
    """The Arrow files of datasets' copy of a local load (its own, and its caches of maps over it: `cache-*.arrow`)
    that lack the end mark every one is closed with: cut short (a node lost while the cache was copied, a cleaner, a
    full disk). datasets reads them as whole and fails in pyarrow, `Expected to be able to read N bytes for message
    body`, naming no file, at every attempt. Written under a temporary name and renamed, a whole file always ends so.
    One read of 8 bytes a file; a Hub data set's copy is not looked at (its builder would ask the Hub once more)."""
    if builder is None:
        return []
    return [path for path in sorted(Path(builder.cache_dir).glob("*.arrow")) if not _whole(path)]


def _whole(path: Path) -> bool:
    """Whether an Arrow file ends with the end mark (True where it is gone: nothing of it is left to remove)."""
    try:
        with open(path, "rb") as f:
            f.seek(-len(ARROW_END), os.SEEK_END)  # OSError: shorter than the mark
            return f.read() == ARROW_END
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _named(name: str, data_files) -> str:
    """What a load reads, as a person named it: a builder's (`json`) data files, else the data set or folder."""
    if isinstance(data_files, dict):
        data_files = [f for found in data_files.values() for f in ([found] if isinstance(found, str) else found)]
    return ", ".join(map(str, [data_files] if isinstance(data_files, str) else data_files)) if data_files else name


# A CSV cell is read as written: pandas' default reads `None`, `NA`, `N/A`, `null`, `nan` (and more) as null, so such an
# answer was refused as "missing (null)", or dropped and counted so with skip_invalid; an empty cell alone is null
CSV_AS_WRITTEN = {"keep_default_na": False, "na_values": [""]}


def load_as_text(features, load, *args, **kwargs):
    """`load(*args, features=features, **kwargs)`, else with `features=None` where reading all columns as text fails.
    `features` (`csv_text_features`) names CSV files: their cells are read as written (`CSV_AS_WRITTEN`)."""
    try:
        return load(*args, features=features, **(kwargs if features is None else {**CSV_AS_WRITTEN, **kwargs}))
    except Exception:  # not CSV after all (a card's `configs:` choosing a folder's JSON file beside CSV files)
        if features is None:
            raise
        return load(*args, features=None, **kwargs)


def _csv_columns_as_text(path: Path):
    """Features reading every column of a CSV file as text (pandas would infer `42` an int, `1.50` a float); None where
    the header has no names or one twice."""
    import csv

    import datasets

    with open_data(path, "rt", newline="", encoding="utf-8-sig", errors="replace") as f:
        header = next(csv.reader(f, delimiter=DELIMITERS.get(format_suffix(path), ",")), None)
    # pandas' name for a column without one (the index `DataFrame.to_csv` writes first)
    header = [name or f"Unnamed: {i}" for i, name in enumerate(header or [])]
    if not header or len(set(header)) != len(header):
        return None
    if bad := _stray_quote(path):
        raise ConfigError(bad)
    return datasets.Features({name: datasets.Value("string") for name in header})


def _stray_quote(path: Path) -> str | None:
    """The first record with a cell that starts with `"` but is not one quoted cell, or None. pandas reads a cell
    starting with `"` as quoted (a `.tsv` too) and reads a bad one without a word: `"Hi" she said` trained as
    `Hi she said`, and a quote left open ran the cell on over the next lines' tabs and rows up to the next `"`, pairs
    lost. Python's csv in strict mode stops at exactly those cells; a damaged file is left to the load to name."""
    import csv
    import sys

    separator, limit = DELIMITERS.get(format_suffix(path), ","), csv.field_size_limit(sys.maxsize)  # a long answer
    try:
        with open_data(path, "rt", newline="", encoding="utf-8-sig", errors="replace") as f:
            reader, start = csv.reader(f, delimiter=separator, strict=True), 1
            try:
                for _ in reader:
                    start = reader.line_num + 1
            except csv.Error:
                return (
                    f'{path}:{start}: a cell starts with \'"\' but is not one quoted cell ("...", each " inside '
                    "written twice), and would be read without its quotes or run on into the lines after it: quote "
                    'that cell whole ("""Hi"" she said") or fix that line'
                )
    except (EOFError, OSError, ValueError, lzma.LZMAError, zlib.error):
        return None
    finally:
        csv.field_size_limit(limit)
    return None


def _empty_saved_splits(path: Path) -> list[str]:
    """Splits of a `save_to_disk` folder (a Dataset's own folder counts as one) that hold no data file."""
    states = [path / "state.json"] if (path / "state.json").exists() else sorted(path.glob("*/state.json"))
    return [s.parent.name for s in states if not upstream.saved_data_files(json.loads(s.read_text()))]


def _check_utf8(dataset, path: Path) -> None:
    """pyarrow's JSON reader keeps invalid UTF-8, which fails later naming neither file nor line: validated here."""
    import pyarrow as pa

    try:
        dataset.data.table.validate(full=True)
    except pa.ArrowInvalid as e:
        if "UTF8" not in str(e):
            raise
        raise ConfigError(_invalid_utf8(path) or f"dataset file {str(path)!r} is not valid UTF-8") from None


def mixed_type_columns(dataset) -> list[str]:
    """The columns a pair is read from that datasets stores as Json: a field whose type differs between rows."""
    from datasets.utils.json import get_json_field_paths_from_feature

    features = dataset.features
    return [
        c for c in ("prompt", "chosen", "rejected") if c in features and get_json_field_paths_from_feature(features[c])
    ]


def _json_kwargs(dataset) -> list[str]:
    """chat_template_kwargs where datasets stores it as Json (rows of objects and rows of text): Json decodes a row's
    text that reads as a JSON object into that object, where a column of text alone is refused with its fix (TRL
    spreads `**chat_template_kwargs`): read as written, a text is refused alike, whatever the other rows hold."""
    from datasets.utils.json import get_json_field_paths_from_feature

    feature = dataset.features.get("chat_template_kwargs")
    return ["chat_template_kwargs"] if feature is not None and get_json_field_paths_from_feature(feature) else []


def json_quoted_columns(dataset) -> list[str]:
    """The columns a pair is read from (its answers, tools, chat_template_kwargs) holding a text written as a JSON
    string (`"Hello"`, quotes included, on one line). datasets types a JSON Lines field by the file's first 10 MiB;
    where a later chunk holds another type there (a number, or text parts, where the first chunk had text), it reads
    that chunk's field as JSON and casts it to text: every value of the chunk came back quoted, its newlines as `\\n`,
    with no Json feature to find it by (`mixed_type_columns`), and trained so. A text quoted as written costs one more
    read of the file (`exact_mixed_fields`), nothing else."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def strings(array):  # every text inside a column's nested lists and structs
        kind = array.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            yield from strings(array.flatten())
        elif pa.types.is_struct(kind):
            for field in array.flatten():
                yield from strings(field)
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            yield array

    table = dataset.data.table
    # the template's own inputs too: a tool's `"default": "auto"` or a row's `effort` came back quoted alike
    columns = [c for c in ("prompt", "chosen", "rejected", *shapes.KEPT_COLUMNS) if c in table.column_names]
    return [
        c
        for c in columns
        if any(
            pc.any(pc.match_substring_regex(text, '^".*"$')).as_py()
            for chunk in table[c].chunks
            for text in strings(chunk)
        )
    ]


def dated_columns(dataset) -> list[str]:
    """The columns a pair is read from (its answers, tools, chat_template_kwargs) that Arrow's JSON reader typed as a
    date or time anywhere inside: it reads text such as `"2024-07-26"` or `"2024-07-26 10:30:00"` as a timestamp, so an
    answer that is a date was refused as not text, and a row's `chat_template_kwargs` `{"date_string": "2024-07-26"}`
    reached the template as the integer 1721952000000. JSON has no dates: such a value was always text."""
    schema = dataset.data.table.schema
    return [
        c
        for c in ("prompt", "chosen", "rejected", *shapes.KEPT_COLUMNS)
        if c in schema.names and _temporal(schema.field(c).type)
    ]


def _temporal(kind) -> bool:
    """Whether an Arrow type holds a date or time anywhere inside (a list's values, a struct's fields)."""
    import pyarrow as pa

    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _temporal(kind.value_type)
    if pa.types.is_struct(kind):
        return any(_temporal(kind.field(i).type) for i in range(kind.num_fields))
    return pa.types.is_temporal(kind)


def exact_mixed_fields(dataset, split: str, *load_args, **load_kwargs):
    """datasets stores a field of mixed types as JSON but keeps text that reads as JSON (`"42"` came back 42), and
    Arrow reads text that looks like a date as one (`dated_columns`): such pair columns are read again from the JSON
    files the load (`load_args`/`load_kwargs`) read, each value as written."""
    import datasets

    # both: a pair column of mixed types left a quoted tools or chat_template_kwargs column as datasets cast it
    mixed = list(dict.fromkeys(mixed_type_columns(dataset) + json_quoted_columns(dataset) + _json_kwargs(dataset)))
    mixed += [c for c in dated_columns(dataset) if c not in mixed]
    if not mixed:
        return dataset
    try:
        files = [Path(f) for f in datasets.load_dataset_builder(*load_args, **load_kwargs).config.data_files[split]]
    except Exception:  # noqa: BLE001 - not resolvable again: left as datasets has it
        return dataset
    if not all(f.is_file() and builder_of(f) == "json" for f in files):  # a Hub data set's: not read twice
        return dataset
    rows = []
    for file in files:
        with open_data(file, "rt", encoding="utf-8-sig", newline="") as f:
            text = f.read()
        array = text.lstrip().startswith("[")
        # lines end at "\n" alone, as datasets reads them: `splitlines` also splits at U+2028, \x85 and \x0c, which
        # JSON keeps unescaped inside a string (a scraped text's line separator), cutting a row in two
        rows += json.loads(text) if array else [json.loads(x) for x in text.split("\n") if x.strip()]
    if len(rows) != len(dataset):  # not read row for row as datasets read it: left as datasets has it
        return dataset
    for column in mixed:  # each value JSON-encoded, so that text stays text
        values = [None if row.get(column) is None else json.dumps(row[column]) for row in rows]
        dataset = dataset.remove_columns(column).add_column(column, values, feature=datasets.Json())
    return dataset


def _invalid_utf8(path: Path) -> str | None:
    """`file:line: not valid UTF-8 ...` for the first line of `path` that is not UTF-8, or None. UTF-16 without its
    byte-order mark decodes (its NULs are UTF-8), and was "not valid JSON" at column 2."""
    with open_data(path) as f:
        for number, line in enumerate(f, 1):
            if venv.is_utf16(line):
                return (
                    f"{path}:{number}: not valid UTF-8 (it is UTF-16 text): save the file as UTF-8 (from UTF-16: "
                    "`iconv -f utf-16 -t utf-8`)"
                )
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (
                    f"{path}:{number}: not valid UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1}): save "
                    "the file as UTF-8 (from Latin-1: `iconv -f latin1 -t utf-8`), or fix that line"
                )
    return None


@functools.cache
def check_datasets_cache() -> None:
    """Names an unwritable datasets cache (datasets' error names the data file), once per process."""
    import datasets

    folder = Path(datasets.config.HF_DATASETS_CACHE)
    if problem := unwritable(folder):
        raise ConfigError(
            f"the datasets cache {folder} is not writable ({problem[1]} in {problem[0]}), and datasets caches every "
            "data set it reads there, local files too: set HF_HOME (or HF_DATASETS_CACHE) to a writable folder"
        )


def check_cache_room(*args, **kwargs) -> None:
    """Refuses before the copy where the cache's disk has less room than the files: datasets copies them as Arrow at
    their first read and fails partway on a full disk. `args`, `kwargs`: `load_dataset`'s."""
    import datasets

    # As `load_as_text` reads: CSV files with their cells as written, else (not CSV after all) as given
    tried = [{**CSV_AS_WRITTEN, **kwargs}, kwargs] if kwargs.get("features") is not None else [kwargs]
    for given in tried:
        try:
            builder = datasets.load_dataset_builder(*args, **given)
            break
        except Exception:  # noqa: BLE001 - unreadable: the load's own one-line refusal follows
            continue
    else:
        return
    if Path(builder.cache_dir).exists():
        return  # copied at an earlier read: read from there
    files = [Path(f) for found in (builder.config.data_files or {}).values() for f in found]
    need = sum(f.stat().st_size for f in files if f.is_file())  # local files: a URL's size is not known here
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    free = shutil.disk_usage(next(p for p in (cache, *cache.absolute().parents) if p.exists())).free
    if free < need:
        raise ConfigError(
            f"the datasets cache {cache} has {size(free)} free, and datasets first copies the data set's "
            f"{size(need)} of files into it (as Arrow, about their size): set HF_DATASETS_CACHE (or HF_HOME) to a "
            "folder on a disk with room, or make room there"
        )


def check_folder_config(name: str, path: Path, config: str | None) -> None:
    """Refuses a cloned Hub data set (README.md `configs:`) read with no configuration where it has no default, or one
    it lacks (datasets' error reads as an unreadable folder)."""
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        card = DatasetCard.load(path / "README.md").data if (path / "README.md").is_file() else None
        configs = MetadataConfigs.from_dataset_card_data(card) if card else {}
        default = configs.get_default_config_name() if configs else None
    except Exception:  # noqa: BLE001 - a card datasets cannot read: the load refuses it, in one line
        return
    if not configs and config not in (None, "default"):
        # datasets' `BuilderConfig 'foo' not found` was said as a folder to put in files of one format
        raise ConfigError(
            f"dataset folder {name!r} has no configuration {config!r}: its files are one data set (no README.md "
            "`configs:` names others): remove dataset_config (a mixture source: its `name`)"
        )
    names = ", ".join(configs)
    if config is None and default is None and configs:
        raise ConfigError(
            f"dataset folder {name!r} has {len(configs)} configurations (its README.md's configs: {names}) and no "
            "default: choose one with dataset_config (--dataset_config NAME; a mixture source: its `name`)"
        )
    if config is not None and configs and config not in configs:
        raise ConfigError(
            f"dataset folder {name!r} has no configuration {config!r}: choose one of {names} (its README.md's "
            "configs) as dataset_config"
        )


def _unreadable_folder(name: str, path: Path, error: Exception) -> str:
    """Why a folder of data files did not load: a file's bad line, else datasets' cause and what the folder holds."""
    found = data_identity.files(str(path)) or {}
    if line := first_bad_file(found.values()):
        return line
    if differ := column_types_differ(f"dataset folder {name!r}", found):
        return differ
    error = error.__cause__ or error
    held = ", ".join(list(found)[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "") or "no file"
    # datasets: 'Instruction "train" corresponds to no data!', as if the folder's format were wrong
    if found and not any(_has_rows(p) for p in found.values()):
        return f"dataset folder {name!r} has no rows: none of its files ({held}) holds a pair; put the pairs in them"
    # One split's files alone empty (a test.jsonl made for held-out pairs not written yet): the same words of datasets'
    # were said of the whole folder's format ("put the pairs there as .jsonl ... files of one format")
    empty = [n for n, p in found.items() if not _has_rows(p)]
    if empty and "corresponds to no data" in str(error):
        return (
            f"dataset folder {name!r}: {', '.join(empty)} holds no pair, and datasets reads a file named for a split "
            "as that split, which cannot be empty: put pairs in it, or remove it"
        )
    return (
        f"could not read the local folder {name!r} as a data set ({cause(error)}): datasets reads the files under it "
        f"as one data set, and it holds {held}; put the pairs there as .jsonl, .json, .parquet or .csv files of one "
        "format, or name one file as the data set"
    )


def first_bad_file(paths) -> str | None:
    """Why the first of a failed load's data files cannot be read as its suffix says (`_bad_line`), or None."""
    return next(filter(None, map(_bad_line, paths)), None)


def unreadable_stream(name: str, error: Exception) -> str:
    """Why a streamed data set failed as its rows were read (a stream is read lazily, past the load's checks): a local
    file's damage (`_bad_line`), else datasets' cause."""
    path = Path(name).expanduser()
    found = (data_identity.files(str(path)) or {}).values() if path.is_dir() else [path] if path.is_file() else []
    return (
        first_bad_file(found) or f"could not read data set {name!r} as it streamed: {cause(error.__cause__ or error)}"
    )


def column_types_differ(what: str, found: dict) -> str | None:
    """The first column two data files of a folder or of a source's `data_files` (`found`, by name) give two types (a
    `score` a number in one file, text in another), or that one file has and another lacks, which datasets cannot join
    into one table, or None. Read on the failure's path alone: pyarrow parses each file whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    not_read = f"it is not read: a pair is read from {', '.join(shapes.ROW_COLUMNS)}"
    seen, columns_of = {}, {}
    for file, p in found.items():
        try:
            if format_suffix(p) == ".parquet":
                schema = pq.read_schema(p)
            elif builder_of(p) == "json":
                schema = _json_schema(p)
            else:
                continue
        except Exception:  # noqa: BLE001 - a file pyarrow cannot read alone is the cause itself: datasets' is said
            return None
        columns_of[file] = set(schema.names)
        for field in schema:
            first = seen.setdefault(field.name, (field.type, file))
            if pa.types.is_null(first[0]):
                seen[field.name] = first = (field.type, file)
            widened = pa.types.is_floating(first[0]) and pa.types.is_integer(field.type)  # datasets casts it (1 -> 1.0)
            differ = _type_kind(first[0]) != _type_kind(field.type)
            if differ and not pa.types.is_null(field.type) and not widened:
                why = "a pair is read from it" if field.name in shapes.ROW_COLUMNS else not_read
                fix = f"write it with one type in every file, or remove it ({why}), or name"
                # JSON has no dates: pyarrow types a file's texts that all look like one (`"2024-07-26"`) as
                # timestamps, so texts written alike differ in type, and writing them alike was no fix
                # (inside a column too: chat_template_kwargs' `date_string`, whose fix was "write it with one type")
                json_dates = [f for t, f in (first, (field.type, file)) if _temporal(t)]
                if json_dates and builder_of(found[json_dates[0]]) == "json":
                    fix = (
                        f"datasets' JSON reader takes the texts of {json_dates[0]} for dates, as each looks like one "
                        "(2024-07-26), though they are text as written: name"
                    )
                return (
                    f"{what}: column {field.name!r} is {first[0]} in {first[1]} and {field.type} in "
                    f"{file}, and datasets reads its files as one table, one type to a column: {fix} each file as a "
                    "source of a mixture, read on its own (docs/data.md)"
                )
    # A column some files lack (a later export's `id`), read or not: datasets' CastError said only "Couldn't cast",
    # and the line after it asked for files of one format, which they were
    for name in dict.fromkeys(n for names in columns_of.values() for n in sorted(names)):
        if lacking := [file for file, names in columns_of.items() if name not in names]:
            having = next(file for file, names in columns_of.items() if name in names)
            why = "a pair is read from it" if name in shapes.ROW_COLUMNS else not_read
            return (
                f"{what}: column {name!r} is in {having} and not in {lacking[0]}, and datasets reads its files as one "
                f"table, the same columns in each: write it in every file, or remove it ({why}), or name each file as "
                "a source of a mixture, read on its own (docs/data.md)"
            )
    return None


def _json_schema(path: Path):
    """The columns of a JSON data file as datasets types them: JSON Lines (also under a `.json` name, which datasets
    reads as such first) by pyarrow's JSON reader, from a binary handle (a multi-GB file is not decoded whole); a
    `.json` array of rows turned into JSON Lines first, as datasets does (so "2024-01-01" is a timestamp in both).
    Raises ValueError for a JSON shape that is neither (an object of columns: datasets' `field`), not compared."""
    import pyarrow as pa
    import pyarrow.json

    with open_data(path) as f:
        start = f.read(len(codecs.BOM_UTF8) + 4096)
        start = start.removeprefix(codecs.BOM_UTF8)  # datasets skips a byte-order mark before it looks for "["
        if format_suffix(path) in JSON_LINES or not start.lstrip().startswith(b"["):
            f.seek(0)
            return pa.json.read_json(f).schema
        rows = json.loads(start + f.read())
    if not all(isinstance(row, dict) for row in rows):
        raise ValueError("not an array of rows")
    lines = "\n".join(json.dumps(row) for row in rows).encode()
    return pa.json.read_json(pa.BufferReader(lines)).schema


def _type_kind(t):
    """A column type as datasets joins files by it: string widths, integer widths, float widths and a struct's key
    order (`{"role", "content"}` in one file, `{"content", "role"}` in another) are one type to it."""
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return "int" if pa.types.is_integer(t) else "float"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", _type_kind(t.value_type))
    if pa.types.is_struct(t):
        return ("struct", tuple(sorted((f.name, _type_kind(f.type)) for f in t)))
    return str(t)


def _bad_line(path: Path) -> str | None:
    """A data file's first line that is not UTF-8 or, JSON, where it stops being JSON (a JSON Lines line: not a JSON
    object), or None."""
    if broken := broken_compression(path):  # read first: every reading below would fail in it
        return broken
    if path.suffix in LOCAL_SUFFIXES and (found := misnamed(path)):  # a folder's file: one file is checked up front
        return found
    if builder_of(path) in ("json", "csv") and (found := _invalid_utf8(path)):  # wrapped by datasets
        return found
    if builder_of(path) == "csv":
        return _long_csv_record(path)
    if builder_of(path) != "json":
        return None
    # utf-8-sig, as datasets reads it: a byte-order mark (Windows tools write one) is not line 1's error
    with open_data(path, "rt", encoding="utf-8-sig", errors="replace") as f:
        if format_suffix(path) not in JSON_LINES and (array := _json_document_error(path, f)) is not False:
            return array or lone_surrogate(path)
        f.seek(0)
        # A key written twice in one object, at any depth, is valid JSON to json.loads (the last value kept), but
        # pyarrow refuses it, which reached the user as "An error occurred while generating the dataset" alone
        twice = []

        def once(items):
            keys = [k for k, _ in items]
            twice.extend(k for k in keys if keys.count(k) > 1)
            return dict(items)

        offset, typed = 0, set()  # the fields the rows of the file's first chunk give (`_given_fields`)
        for number, line in enumerate(f, 1):
            start, offset = offset, offset + len(line.encode("utf-8", errors="replace"))
            if not line.strip():
                continue
            twice.clear()
            try:
                row = json.loads(line.rstrip("\n"), object_pairs_hook=once)
            except json.JSONDecodeError as e:
                return f"{_not_json(path, number, e)}: fix or remove that line"
            if not isinstance(row, dict):
                return f"{path}:{number}: a JSON {type(row).__name__}, not an object: each line is one pair"
            if twice:
                return f"{path}:{number}: key {twice[0]!r} written twice in one object: keep one, on that line"
            # datasets types JSON Lines by their first chunk: a field first given after it (a late row's tool call,
            # a message's `name`, chat_template_kwargs) failed the read, said as "An error occurred while generating
            # the dataset" alone
            given = _given_fields(row)
            if start < JSON_CHUNK:
                typed |= given
            elif new := sorted(given - typed):
                return (
                    f"{path}:{number}: field {new[0]!r} is first given here, after the file's first "
                    f"{size(JSON_CHUNK)}, by which datasets types the whole file (a field first given later fails the "
                    "read): move this line to the top of the file, or remove the field"
                )
    return lone_surrogate(path)


# The bytes of a JSON Lines file datasets' json builder reads and types at once (JsonConfig.chunksize)
JSON_CHUNK = 10 << 20


def _given_fields(value, at: str = "") -> set[str]:
    """The fields a JSON value gives a value (not null), at any depth: `chosen[].name`, `chat_template_kwargs.x`."""
    if isinstance(value, list):
        return {f"{at}[]", *(f for item in value for f in _given_fields(item, f"{at}[]"))} if value else set()
    if not isinstance(value, dict):
        return set()
    return {
        f
        for key, v in value.items()
        if v is not None
        for f in {f"{at}.{key}".lstrip("."), *_given_fields(v, f"{at}.{key}".lstrip("."))}
    }


# A \uXXXX escape of a UTF-16 surrogate (with the low half after a high one), after an even run of backslashes: an
# escape, not the text `\\ud83d`
SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*(\\u[dD][89a-fA-F][0-9a-fA-F]{2}(?:\\u[dD][c-fC-F][0-9a-fA-F]{2})?)")


def lone_surrogate(path: Path) -> str | None:
    """`file:line: a lone UTF-16 surrogate ...` for a JSON file's first escape of half a character (a UTF-16 string
    cut inside an emoji, as json.dumps writes it), or None: it is not text, so pyarrow refuses JSON Lines that hold
    one (naming neither line nor fix) and a JSON array was read with the character dropped, trained as other text."""
    if not _holds_surrogate_escape(path):  # nearly every file: read once in chunks, not line by line into str
        return None
    with open_data(path, "rt", encoding="utf-8-sig", errors="replace") as f:
        for number, line in enumerate(f, 1):
            for found in SURROGATE_ESCAPE.finditer(line) if "\\u" in line else ():
                if len(found.group(1)) == 6:  # one half alone: a whole character is a high and a low escape
                    return (
                        f"{path}:{number}: a lone UTF-16 surrogate ({found.group(1)}) at column {found.start(1) + 1}, "
                        "half of a character and not text (a string cut inside an emoji): remove it or write the "
                        "whole character, on that line"
                    )
    return None


def _holds_surrogate_escape(path: Path) -> bool:
    """Whether a `\\uD...` escape occurs in the file (escaped or not: `lone_surrogate` tells), read in bounded chunks: a
    minified JSON array is one line, which a line scan holds whole; every rank reads the file after it loads."""
    tail = b""
    with open_data(path) as f:
        while block := f.read(1 << 24):  # 16 MiB at a time
            window = tail + block
            if b"\\ud" in window or b"\\uD" in window:
                return True
            tail = window[-2:]  # an escape split between two chunks
    return False


def _long_csv_record(path: Path) -> str | None:
    """The first CSV record with more cells than the header, which pandas refuses ("Expected 3 fields in line 3, saw
    4"; fewer are read as null, and said so with their row), or None."""
    import csv

    separator = DELIMITERS.get(format_suffix(path), ",")
    with open_data(path, "rt", newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f, delimiter=separator)
        header, start = next(reader, None) or [], reader.line_num + 1
        for record in reader:
            if header and len(record) > len(header):
                return (
                    f"{path}:{start}: {len(record)} cells where the header names {len(header)}: quote the cell that "
                    f'holds a {separator!r} ("..."), or fix that line'
                )
            start = reader.line_num + 1
    return None


def _json_document_error(path: Path, f) -> str | None | bool:
    """A `.json` file read as one document (an array of pairs): where it stops being JSON, None where it is JSON;
    False where it is JSON Lines under that suffix (datasets reads it so; checked line by line)."""
    text = f.read()
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        first = text.lstrip().split("\n", 1)[0]
        if not text.lstrip().startswith("[") and _is_json(first):  # one object per line
            return False
        return f"{_not_json(path, e.lineno, e)}: fix the file there"
    return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _not_json(path: Path, line: int, e: json.JSONDecodeError) -> str:
    # json's "Unterminated string starting at" (and "Invalid control character at") end in the "at" written here
    return f"{path}:{line}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"


def check_columns(dataset, name: str) -> None:
    columns = dataset.column_names or []
    if not (missing := [c for c in REQUIRED_COLUMNS if c not in columns]):
        _check_by_column(dataset, name)
        return
    first = next(iter(dataset), None) or {}
    for key, value in first.items():  # `{"data": [{"chosen": ...}, ...]}`: datasets reads the whole file as one row
        if isinstance(value, list) and value and isinstance(value[0], dict) and set(REQUIRED_COLUMNS) <= set(value[0]):
            # a command to paste: the file's path and the filter quoted, `.["key"]` for a key that is no jq name
            field = f".{key}" if re.fullmatch(r"[A-Za-z_]\w*", key, re.ASCII) else f".[{json.dumps(key)}]"
            path = Path(name).expanduser()  # quoted, a shell would not expand its ~
            jq = f" (`{shlex.join(['jq', '-c', f'{field}[]', str(path)])} > pairs.jsonl`)" if path.is_file() else ""
            raise ConfigError(
                f"dataset {name!r} wraps its pairs in a JSON object (under {key!r}), which datasets reads as one row "
                f"that has no chosen/rejected: write the pairs as JSON Lines, one per line{jq}, or as a JSON array"
            )
    raise ConfigError(
        f"dataset {name!r} has no {'/'.join(missing)} {plural(len(missing), 'column', count=False)} (it has "
        f"{sorted(columns)}): DPO needs `chosen` and `rejected` (message lists or strings), optionally `prompt`; "
        "rename the columns or pick a preference data set"
    )


def _check_by_column(dataset, name: str) -> None:
    """Refuses `{"chosen": [...], "rejected": [...]}` (a dict of columns), which datasets reads as one row; a pair's
    side is never a list of strings or of message lists."""
    if getattr(dataset, "num_rows", None) != 1:
        return
    first = next(iter(dataset), None) or {}
    sides = [first.get(c) for c in REQUIRED_COLUMNS]
    if all(isinstance(v, list) and len(v) > 1 and not any(isinstance(x, dict) for x in v) for v in sides):
        raise ConfigError(
            f"dataset {name!r} is written by column (one JSON object whose chosen and rejected are lists of "
            f"{len(sides[0]):,} and {len(sides[1]):,} values), which datasets reads as one row: write the pairs as "
            f"JSON Lines, one pair per line (`pandas.read_json({name!r}).to_json('pairs.jsonl', orient='records', "
            "lines=True)`), or as a JSON array of pairs"
        )


def row_location(name: str, index: int, split: str = "train", files: list[Path] | None = None) -> str:
    """Where row `index` (from 0) of `split` is, as a person finds it: 'line 8 of my.jsonl', 'line 9 of my.csv' (where
    its record starts), 'line 3 of shards/b.jsonl' (a folder of data files), else 'row 7 (from 0) of my.parquet'.
    `files`: the files `name` is read from, in datasets' order (a builder's data_files or data_dir: `files_read`)."""
    return row_locations(name, [index], split, files=files)[index]


def row_locations(name: str, indices, split: str = "train", shown: str | None = None, files=None) -> dict[int, str]:
    """`row_location` of each of `indices`, the file read once (the rows `--skip_invalid` lists). `shown`: the name the
    file is called by (a folder's file, by its path from the folder's parent). `files`: as `row_location`'s, or what
    gives them, asked only here (a mixture source's, resolved again only where a row is named)."""
    path, wanted = local_path(name), sorted(set(indices))
    files = files() if callable(files) else files
    folder = None  # a folder of data files: each named by its path in it
    if files is None and path.is_dir() and not data_identity.saved(path) and not (path / "README.md").is_file():
        files, folder = files_read(str(path), split), path  # a cloned Hub data set (a README) reads other files
    if files is not None:
        found, first = {}, 0
        for file in files:  # counted up to the file of the last row wanted (a folder of many large shards)
            if not wanted or first > wanted[-1] or (rows := _rows_in(file)) is None:
                break
            inside = [i - first for i in wanted if first <= i < first + rows]
            # datasets lists the files by their resolved paths, whether the folder was given relative or by a link
            in_folder = folder and f"{path.name}/{Path(os.path.relpath(file.resolve(), path.resolve())).as_posix()}"
            named = in_folder or _shown_file(file)
            found |= {i + first: where for i, where in row_locations(str(file), inside, split, named).items()}
            first += rows
        return {i: found.get(i) or f"row {i} (from 0) of {path.name if path.exists() else name}" for i in wanted}
    shown, lines = shown or path.name, {}
    if path.is_file() and wanted and (starts := _record_lines(path)) is not None:
        asked = set(wanted)
        found = enumerate(itertools.islice(starts, wanted[-1] + 1))
        lines = {row: line for row, line in found if row in asked and line is not None}
    return {
        i: f"line {lines[i]} of {shown}" if i in lines else f"row {i} (from 0) of {shown if path.exists() else name}"
        for i in wanted
    }


def files_read(path: str, split: str, **builder) -> list[Path] | None:
    """The local files datasets reads `split` of `path` from (a folder, or a builder such as `json` with `builder`'s
    `data_files` or `data_dir`), in its order; None where they do not resolve again (a mixture's Hub source)."""
    import datasets

    try:
        files = [Path(f) for f in datasets.load_dataset_builder(path, **builder).config.data_files[split]]
    except Exception:  # noqa: BLE001 - not resolvable again: the rows are named by their index
        return None
    return files if all(f.is_file() for f in files) else None


def _shown_file(file: Path) -> str:
    """A data file named as a person finds it: by its path from the working folder, where it is under it."""
    relative = os.path.relpath(file)
    return relative if not relative.startswith("..") else str(file)


def _record_lines(path: Path):
    """The line each row of a JSON Lines or CSV file (or a JSON file's array) starts on, as datasets reads its rows (a
    blank line holds none: pandas skips it in a CSV; a CSV's header is no row), one by one; None for a file of another
    format."""
    if format_suffix(path) in JSON_LINES or format_suffix(path) == ".json" and file_kind(path) == "json lines":
        return _json_lines(path)
    if format_suffix(path) == ".json" and file_kind(path) == "a json array":
        return _array_items(path)
    if format_suffix(path) in DELIMITERS:
        return _csv_records(path)
    return None


def _array_items(path: Path):
    """The line each item of a JSON file's one array starts on, None for an item that shares its line with another
    (an array written on one line: its rows are named by their position)."""
    with open_data(path, "rt", encoding="utf-8-sig") as f:
        text = f.read()
    decoder, between, at = json.JSONDecoder(), re.compile(r"[\s,]*"), text.index("[") + 1
    starts, line, counted = [], 1, 0
    while (at := between.match(text, at).end()) < len(text) and text[at] != "]":
        line, counted = line + text.count("\n", counted, at), at
        starts.append(line)
        at = decoder.raw_decode(text, at)[1]
    shared = {n for n, count in collections.Counter(starts).items() if count > 1}
    yield from (None if n in shared else n for n in starts)


def _json_lines(path: Path):
    with open_data(path) as f:
        yield from (number for number, line in enumerate(f, 1) if line.strip())


def _csv_records(path: Path):
    import csv

    with open_data(path, "rt", newline="", encoding="utf-8", errors="replace") as f:
        reader, start, header = csv.reader(f, delimiter=DELIMITERS[format_suffix(path)]), 1, True
        for cells in reader:
            if cells and not header:
                yield start  # the line the record starts on (a quoted field may span lines)
            header = header and not cells
            start = reader.line_num + 1


def _rows_in(path: Path) -> int | None:
    """The rows datasets reads from one data file (a JSON Lines file's non-blank lines, a CSV's records but its header,
    a Parquet file's rows, a JSON array's items, an Arrow file's rows), or None (one that does not read)."""
    import pyarrow.parquet as pq

    try:
        if (starts := _record_lines(path)) is not None:
            return sum(1 for _ in starts)
        if format_suffix(path) == ".parquet":
            return pq.ParquetFile(path).metadata.num_rows
        if builder_of(path) == "arrow":
            return sum(_arrow_batch_rows(path))
        if format_suffix(path) == ".json":
            with open_data(path, "rt", encoding="utf-8-sig") as f:
                return len(json.load(f))
    except (OSError, ValueError, EOFError):  # pyarrow's ArrowInvalid is a ValueError
        return None
    return None

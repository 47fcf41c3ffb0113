"""Preference data from several sources: TRL's `datasets:` list and open-instruct's `--dataset_mixer_list` as one list
of `Source`s, each checked row by row, its pairs taken by a generator seeded with the recipe's seed and the source's
spelling: the same pairs on every rank, node and rerun (docs/data.md "Several sources").
"""

import collections
import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import re
import shlex
from pathlib import Path

import numpy as np

from dpotrain.data import cuts, data, data_identity, hub_revision, lengths, rows
from dpotrain.recipe import config, upstream
from dpotrain.recipe.errors import ConfigError, cause, plural, size
from dpotrain.recipe.refused import said

ENTRY_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction", "amount")
BUILDERS = config.MIXTURE_BUILDERS
TRAIN_FIELDS, EVAL_FIELDS = config.MIXTURE_SPELLINGS  # (TRL's field, open-instruct's, its splits)
# What a run does with a mixture's pairs, as its refusals say it: {evaluation: (would ..., it ..., to ...)}
USES = {False: ("train", "trains", "train"), True: (f"be {data_identity.EVALUATED}", "evaluates on", "evaluate on")}


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    split: str
    name: str | None = None  # the data set's configuration (datasets' `name`, this project's dataset_config)
    data_dir: str | None = None
    data_files: object = None
    columns: tuple | None = None
    amount: str | None = None  # as written: "0.5" a fraction, "1000" a count, None every row
    share: float | None = None  # TRL's `fraction`
    # The field that chose `split`, for a missing split's refusal; not part of what the source is.
    split_from: str | None = dataclasses.field(default=None, compare=False)

    @property
    def file(self) -> str | None:
        """The one local file a TRL entry `path: json, data_files: x.jsonl` names, read as `dataset_name: x.jsonl`;
        None for a pattern (datasets reads its matches)."""
        files = self.data_files
        if isinstance(files, list) and len(files) == 1:
            files = files[0]
        one = isinstance(files, str) and (not glob.has_magic(files) or os.path.isfile(os.path.expanduser(files)))
        return files if self.path in BUILDERS and one and not self.data_dir else None

    @property
    def local(self) -> str | None:
        """The local file or folder the source is read from, or None (a Hub data set)."""
        return self.file or (self.path if data.is_local(self.path) else None)

    @property
    def hub(self) -> bool:
        """Whether the source is a Hub data set repo (read at a revision), not a local file or folder or a builder."""
        return not self.local and self.path not in BUILDERS

    @property
    def where(self) -> str:
        """The name rows are located in (`data.row_location`): a builder's glob or data_dir by its spec, not `json`."""
        return self.file or (self.spec() if self.path in BUILDERS else self.path)

    def spec(self) -> str:
        """One line naming the source: `data/a.jsonl [train]`, `org/set:config [train]`."""
        extra = f" data_files={self.data_files}" if self.data_files and not self.file else ""
        extra += f" data_dir={self.data_dir}" if self.data_dir else ""
        return f"{self.file or self.path}{':' + self.name if self.name else ''} [{self.split}]{extra}"

    def identity(self) -> str:
        """What the source is, whatever its spelling: a local file by its real path (one split, whatever its name), a
        local folder by its real path and what is read of it, a builder's files (`path: json` with a `data_files`
        glob or a `data_dir`) by their real paths, a Hub data set by its spec."""
        if self.path in BUILDERS and not self.file:
            # As written (`gl/*.jsonl`, `./gl/*.jsonl`, its full path in a Slurm job), each spelling drew other pairs
            base = os.path.realpath(os.path.expanduser(self.data_dir or "."))  # data_files are read from there

            def real(entry):  # a path or glob, a list of them, or {split: either}
                if isinstance(entry, dict | list):
                    return {k: real(v) for k, v in entry.items()} if isinstance(entry, dict) else list(map(real, entry))
                return (
                    os.path.realpath(os.path.join(base, entry))
                    if isinstance(entry, str) and "://" not in entry
                    else entry
                )

            files = real(self.data_files)
            return dataclasses.replace(self, data_dir=self.data_dir and base, data_files=files).spec()
        if not self.local:
            return self.spec()
        where = os.path.realpath(os.path.expanduser(self.local))
        if self.file or os.path.isfile(where):  # `~/a.jsonl` too (a recipe's is not expanded by a shell)
            return where
        return dataclasses.replace(self, path=where).spec()

    def written(self) -> str:
        return self.amount if self.amount is not None else (f"share {self.share}" if self.share is not None else "all")


# --- parsing ----------------------------------------------------------------------------------------------------------


def given(values: dict, evaluation: bool = False) -> bool:
    return any(values.get(f) for f in (EVAL_FIELDS if evaluation else TRAIN_FIELDS)[:2])


def fields_of(recipe) -> dict:
    """The recipe's values a mixture is read from (the analyzer passes a recipe file's mapping instead)."""
    s, p = recipe.script, recipe.project
    names = ("dataset_name", "dataset_train_split", "dataset_test_split", "dataset_config")
    return {
        **{n: getattr(s, n) for n in names},
        **{n: getattr(p, n) for n in (*TRAIN_FIELDS, *EVAL_FIELDS)},
        "streaming": p.streaming,
        "test_split_size": p.test_split_size,
        "dataset_revision": p.dataset_revision,
    }


def also_trained(values: dict) -> list[str]:
    """The held-out sources the run also trains on (the same local file, or the same Hub data set, configuration and
    split, however spelled: `Source.identity`; or a file a training source reads, through a pattern or a folder), by
    their specs. Not refused: a smoke run evaluating on its training file is a test's or a check's choice; but the
    eval loss then measures pairs the model trained on."""
    name = values.get("dataset_name")

    def split_of_name(kind: str) -> list[Source]:  # dataset_name's split, where no mixture names the pairs
        return [Source(name, values.get(f"dataset_{kind}_split") or kind, values.get("dataset_config"))] if name else []

    trained = parse(values) or split_of_name("train")
    held = parse(values, evaluation=True) or split_of_name("test")
    seen = {s.identity() for s in trained}
    # A held-out file that a training glob or folder reads was not said: its identity is not the pattern's
    read = {p for s in trained for p in _files_read(s)}
    return [s.spec() for s in held if s.identity() in seen or read & set(_files_read(s))]


def parse(values: dict, evaluation: bool = False) -> list[Source] | None:
    """The training (or evaluation) mixture's sources, checked as written; None where there is no mixture."""
    names = EVAL_FIELDS if evaluation else TRAIN_FIELDS
    flag, (entries, mixer, splits) = names[0], (values.get(f) for f in names)
    kind = "test" if evaluation else "train"
    uses = USES[evaluation]
    default_split = values.get(f"dataset_{kind}_split") or kind
    default_from = f"--dataset_{kind}_split"
    if not evaluation and values.get("test_split_size") is not None:  # with dataset_name too: read by nothing else
        raise ConfigError(
            "test_split_size is not supported (TRL splits without a seed, so a requeued run would "
            "evaluate on other pairs): name the held-out pairs with `eval_datasets:` (--dataset_mixer_eval_list FILE "
            "1.0), or remove test_split_size"
        )
    if not entries and not mixer:
        if splits:
            raise ConfigError(f"{names[2]} without a mixer list: give --{names[1]} SOURCE AMOUNT ... too")
        return None
    if entries and mixer:
        raise ConfigError(f"two mixtures: `{flag}:` and --{names[1]}: keep one")
    if values.get("streaming"):
        raise ConfigError(
            "streaming: true with a mixture: sources are counted and sampled, which needs their rows; "
            "remove streaming (each source is read once, before the model loads)"
        )
    if not evaluation and values.get("dataset_name"):
        raise ConfigError(
            f"dataset_name {values['dataset_name']!r} and a mixture: a mixture names every source; put "
            "that data set in the mixture or remove dataset_name"
        )
    if not evaluation and values.get("dataset_config"):  # dataset_name's: recorded, and read of no source
        raise ConfigError(
            f"dataset_config {values['dataset_config']!r} and a mixture: it names dataset_name's configuration, and "
            "a mixture's sources have their own (`name:` in a `datasets:` entry); put it there or remove dataset_config"
        )
    sources = (
        [_entry(e, default_split, flag, default_from) for e in config.entry_words(entries, flag)]
        if entries
        else _mixer(mixer, splits, default_split, f"--{names[2]}", default_from)
    )
    _check_split_read(sources, values.get(f"dataset_{kind}_split"), kind, f"--{names[2]}" if mixer else flag)
    shares = [s.share is not None for s in sources]
    if any(shares) and not all(shares):
        raise ConfigError(
            f"`fraction` is given for some `{flag}:` entries only: TRL's shares need one on every entry "
            "(or use `amount`, a fraction or count of each source on its own)"
        )
    seen = [s.identity() for s in sources]  # by what each source is: a symlink or a relative path is no other source
    twice = next((i for i, s in enumerate(seen) if seen.index(s) < i), None)
    if twice is not None:
        first, again = sources[seen.index(seen[twice])].spec(), sources[twice].spec()
        what = f"source {first} is named twice" if first == again else f"sources {first} and {again} are the same data"
        raise ConfigError(
            f"{what} in the mixture: give it once, with one amount (an amount of 2.0 {uses[1]} every pair twice)"
        )
    _check_read_once(sources, evaluation=evaluation)
    return sources


def _check_split_read(sources: list[Source], split: str | None, kind: str, named_by: str) -> None:
    """Refuses a --dataset_{kind}_split that no source reads: it is the default of each source naming no split, and
    where every one names its own (another), the run read those with not a word said (`train`, not `validation`)."""
    if split in (None, kind) or any(s.split == split for s in sources):  # TRL's default, or read
        return
    mixer = named_by.startswith("--")  # --dataset_mixer_list_splits; else the `datasets:` entries' own
    where = f"{named_by} names every source's split" if mixer else f"every `{named_by}:` entry names its own `split`"
    read = ", ".join(sorted({s.split for s in sources}))
    unread = said(f"dataset_{kind}_split_unread", where=where, read=read, kind=kind, split=split)
    raise ConfigError(f"dataset_{kind}_split {split!r} {unread}")


def _check_read_once(sources: list[Source], what: str = "mixture source", evaluation: bool = False) -> None:
    """Refuses a local file read twice, by two sources or by one (datasets reads a file as often as it is matched): its
    pairs would train (`evaluation`: be evaluated on) twice, silently. Whatever split or columns: a file has one
    split."""
    read = [_files_read(s) for s in sources]
    counts = collections.Counter(p for files in read for p in files)
    twice = next((p for files in read for p in files if counts[p] > 1), None)
    if twice is None:
        return
    by = [s.spec() for s, files in zip(sources, read, strict=True) if twice in files]
    (did, does, do), flag = USES[evaluation], TRAIN_FIELDS[0] if not evaluation else EVAL_FIELDS[0]
    if len(by) == 1:
        # `amount: 2.0` on this source would still read the file twice (four times over): the file alone takes it
        again = json.dumps({"path": str(twice), "amount": 2.0})
        raise ConfigError(
            f"{what} {by[0]} reads {twice} twice (named twice in its data_files, or matched again by a pattern, a "
            f"folder or a link to it): its pairs would {did} twice; read it once (remove the duplicate name, or "
            f"narrow the pattern or folder), and to {do} its pairs twice on purpose give the file alone as a mixture "
            f"source with `amount: 2.0` (--{flag} {shlex.quote(again)})"
        )
    raise ConfigError(
        f"mixture sources {by[0]} and {by[1]} both read {twice}: its pairs would {did} twice; give each file to one "
        f"source (narrow the pattern or the folder, or remove the other source): `amount: 2.0` on one source {does} "
        "them twice on purpose"
    )


def _files_read(source: Source) -> list:
    """The local files a source reads, a file once per time datasets reads it; none for a Hub data set."""
    read_from = _read_from(source)
    if read_from is None or (source.path in BUILDERS and not (source.file or source.data_files or source.data_dir)):
        return []  # a builder with nothing to read (not the working folder's files)
    where, split, data_dir, data_files = read_from
    folder = os.path.expanduser(os.path.join(where, data_dir or ""))
    if not data_files and os.path.isdir(folder) and not data_identity.saved(Path(folder)):
        return _split_files(folder, split, None if data_dir else source.name, source.path not in BUILDERS)
    if source.file or not data_files:  # one file, or a saved folder's own
        return [p.resolve() for p in (data_identity.files(where, split, data_dir) or {}).values()]
    # each entry matched as the load matches it, by real path: a glob matching a file and a link to it reads it twice
    entries = [e for e in data_identity.entries(data_files, split) if isinstance(e, str)]
    return [Path(f).resolve() for e in entries for f in data_identity.load_matches(folder, e)]


def _split_files(folder: str, split: str, name: str | None = None, inferred: bool = True) -> list:
    """The files of a data folder datasets reads as `split`: by its README.md's `configs:` for configuration `name`,
    else by their names (`train.jsonl`; every file where none is named so); `inferred`: of the format datasets infers
    for the folder (not a builder's `data_dir`, `path: json`, which reads every file)."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    from datasets.load import infer_module_for_data_files

    try:
        base, patterns = _card_patterns(folder, name) or (folder, get_data_patterns(folder))
        # As datasets' load: the files of the format it infers (`notes.txt` beside .jsonl shards is not read, and was
        # recorded as read, so a note added or removed between attempts refused the resume as changed data)
        allowed = {"allowed_extensions": upstream.data_extensions()} if inferred else {}
        found = DataFilesDict.from_patterns(patterns, base_path=base, **allowed)
        if inferred:
            module, _ = infer_module_for_data_files(found)
            found = found.filter(extensions=upstream.data_extensions(module))
        found = found.get(split, [])
    except Exception:  # noqa: BLE001 - no data file or configuration: the load says so
        return []
    return [Path(f).resolve() for f in found]


def _card_patterns(folder: str, name: str | None) -> tuple | None:
    """The folder and `data_files` patterns of configuration `name` (else the default) by README.md's `configs:`; None
    where it names none (KeyError: no such configuration)."""
    from datasets.data_files import get_data_patterns, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    readme = Path(folder) / "README.md"
    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data) if readme.is_file() else None
    if not configs:
        return None
    config = configs[name or configs.get_default_config_name()]
    base = os.path.join(folder, config.get("data_dir") or "")
    files = config.get("data_files")
    return base, sanitize_patterns(files) if files else get_data_patterns(base)


def of_sources(sources: list) -> str:
    """How the dry run and the model card name a mixture: 'a mixture of 3 sources', 'a mixture of 1 source'."""
    return f"a mixture of {plural(len(sources), 'source')}"


def local_files(values: dict) -> list[str]:
    """The names the training and held-out mixtures are read from: what a report must never be written over."""
    found = []
    for evaluation in (False, True):
        for source in parse(values, evaluation) or []:
            files = source.data_files if isinstance(source.data_files, list) else [source.data_files]
            found += [source.file or source.path, *(f for f in files if isinstance(f, str)), source.data_dir]
            if source.path in BUILDERS and source.data_files and not source.file:
                # the files a glob or a {split: files} mapping reads (the analyzer's --json wrote over a glob's match)
                found += [str(p) for p in (data_identity.files(*_read_from(source)) or {}).values()]
    return [f for f in found if f]


def patterns(values: dict) -> list[str]:
    """Each local source's `data_files` globs, absolute as the load resolves them (`data_identity.load_matches`): a
    glob matches files made after the run started too, its own among them (`output_folder.check_outside_data`)."""
    found = []
    for source in [s for evaluation in (False, True) for s in parse(values, evaluation) or []]:
        if (read_from := _read_from(source)) is None or source.file:
            continue
        where, split, data_dir, data_files = read_from
        base = os.path.abspath(os.path.expanduser(os.path.join(where, data_dir or "")))
        entries = [e for e in data_identity.entries(data_files, split) if isinstance(e, str) and "://" not in e]
        found += [os.path.join(base, e) for e in entries if glob.has_magic(e)]
    return found


def _entry(entry, split: str, flag: str, split_from: str) -> Source:
    if isinstance(entry, str):
        try:
            entry = json.loads(entry)
        except ValueError:
            entry = {"path": entry}  # `--datasets a.jsonl b.jsonl`: whole sources (YAML: config.entry_words)
    if not isinstance(entry, dict):
        raise ConfigError(f"`{flag}:` entry {entry!r}: each is a mapping with `path` (and name, split, amount, ...)")
    if unknown := sorted(set(entry) - set(ENTRY_KEYS)):
        raise ConfigError(
            f"`{flag}:` entry {entry.get('path')!r}: unknown {plural(len(unknown), 'key', count=False)} {unknown}; "
            f"an entry takes {', '.join(ENTRY_KEYS)}"
        )
    # `split: no` read as YAML's false fell back to the default split, `name: no` was asked for as False
    if texts := [k for k in ("path", "name", "split", "data_dir") if isinstance(entry.get(k), bool)]:
        raise ConfigError(
            f"`{flag}:` entry {entry.get('path')!r}: {texts[0]} is the boolean {json.dumps(entry[texts[0]])}, which "
            f"YAML reads from an unquoted yes, no, on or off: quote it ({texts[0]}: 'no')"
        )
    # `path: [a.jsonl]` was asked of the Hub as the data set "['a.jsonl']", `split: [train]` refused as slice syntax
    if listed := [k for k in ("path", "name", "split", "data_dir") if isinstance(entry.get(k), list | dict)]:
        raise ConfigError(
            f"`{flag}:` entry {entry}: {listed[0]} is a {type(entry[listed[0]]).__name__}, where it names one "
            f"{'source' if listed[0] == 'path' else listed[0]}: write one (several files are one source's "
            "`data_files: [...]` with `path: json`, or an entry each)"
        )
    if not entry.get("path"):
        raise ConfigError(
            f"`{flag}:` entry {entry}: no `path` (a Hub name, a local file or folder, or "
            "json/csv/parquet with data_files)"
        )
    if entry.get("fraction") is not None and entry.get("amount") is not None:
        raise ConfigError(
            f"`{flag}:` entry {entry['path']!r}: `fraction` (TRL's share of the mixture) and `amount` "
            "(a fraction or count of this source): keep one"
        )
    share = entry.get("fraction")
    # YAML's .nan and .inf are floats too: normalized, no share would be left to size a mixture
    if share is not None and not (type(share) in (int, float) and math.isfinite(share) and share >= 0):  # not bool
        # "0.5" quoted in the recipe is text: "must be a finite number" read as a refusal of 0.5 itself
        fix = f": write it unquoted (fraction: {share})" if isinstance(share, str) and _number_text(share) else ""
        raise ConfigError(f"`{flag}:` entry {entry['path']!r}: fraction {share!r} must be a finite number >= 0{fix}")
    amount = entry.get("amount")
    if isinstance(amount, bool):  # `amount: yes` was refused as "amount 'true'", a word the user never wrote
        raise ConfigError(
            f"`{flag}:` entry {entry['path']!r}: amount is the boolean {json.dumps(amount)}, which YAML reads from an "
            "unquoted yes, no, on or off: write a fraction of the source with a decimal point (1.0 for every row, "
            "2.5 upsamples) or a count of pairs without one (1000), or leave amount out for every row"
        )
    amount = None if amount is None else _amount(json.dumps(amount) if not isinstance(amount, str) else amount)
    columns = entry.get("columns")
    # a list of names, as TRL's: one string would be read a character at a time, after the source loaded
    if columns is not None and (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)):
        raise ConfigError(
            f"`{flag}:` entry {entry['path']!r}: columns {columns!r} is not a list of column names: write them as a "
            "list (columns: [prompt, chosen, rejected])"
        )
    source = Source(
        str(entry["path"]),
        str(entry.get("split") or split),
        entry.get("name"),
        entry.get("data_dir"),
        entry.get("data_files"),
        tuple(columns) if columns else None,
        amount,
        None if share is None else float(share),
        f"`split` in its `{flag}:` entry"
        + ("" if entry.get("split") else f" (or {split_from}, every entry's default)"),
    )
    # `data_files: {train: a.jsonl}` names its splits: another was refused by datasets once the other sources had
    # loaded ("ValueError: Unknown split"), naming neither the field that chose it nor the fix
    if isinstance(files := source.data_files, dict) and source.split not in files:
        raise ConfigError(
            f"mixture source {source.spec()} has no split {source.split!r}: set {source.split_from} to one of "
            f"{sorted(map(str, files))}"
        )
    return source


def _mixer(tokens: list, splits: list | None, split: str, flag: str, split_from: str) -> list[Source]:
    tokens = [str(t) for t in tokens]
    if len(tokens) % 2:
        raise ConfigError(
            f"--dataset_mixer_list takes SOURCE AMOUNT pairs, got {len(tokens)} values ({tokens}): "
            "give each source its amount (1.0 for every row)"
        )
    pairs = list(zip(tokens[::2], tokens[1::2], strict=True))
    chosen_by = flag if splits else f"{flag} (or {split_from}, every source's default)"
    splits = list(splits or [split])
    if len(splits) not in (1, len(pairs)):
        raise ConfigError(
            f"--dataset_mixer_list_splits has {len(splits)} splits for {len(pairs)} sources: give one "
            "for all, or one per source"
        )
    splits = splits * len(pairs) if len(splits) == 1 else splits
    return [
        Source(name, s, amount=_amount(a), split_from=chosen_by) for (name, a), s in zip(pairs, splits, strict=True)
    ]


def _number_text(text: str) -> bool:
    """Whether `text` reads as a finite number >= 0 (a fraction quoted in the recipe)."""
    try:
        return math.isfinite(value := float(text)) and value >= 0
    except ValueError:
        return False


def _amount(text: str) -> str:
    """open-instruct's rule: with a decimal point a fraction of the source, without one a count of pairs."""
    text = text.strip()
    if re.fullmatch(r"[0-9]+|[0-9]*\.[0-9]*", text) and text != "." and float(text) > 0:
        return text
    raise ConfigError(
        f"amount {text!r}: write a fraction of the source with a decimal point (0.5, 1.0, 2.5 "
        "upsamples) or a count of pairs without one (1000), above 0"
    )


def check(recipe) -> None:
    """The recipe's data, checked from the recipe alone: one source (dataset_name) or a mixture's spelling."""
    values = fields_of(recipe)
    train = parse(values)
    held_out = parse(values, evaluation=True)
    for name in [recipe.script.dataset_name] if train is None else [s.local for s in train if s.local]:
        data.check_dataset_name(name)
    s = recipe.script
    if train is None and data.is_local(s.dataset_name):  # a folder holding a file and a link to it reads it twice
        _check_read_once([Source(s.dataset_name, s.dataset_train_split, s.dataset_config)], "dataset")
    for source in [*(train or []), *(held_out or [])]:
        _check_found(source)
        _check_no_config(source)
    for split in {s.dataset_train_split, s.dataset_test_split, *(x.split for x in [*(train or []), *(held_out or [])])}:
        if split and "[" in split:  # datasets refused it naming no fix, a Hub data set's not before the job ran
            raise ConfigError(
                f"split {split!r} is datasets' slice syntax, and a split is read here whole, by its name: train on "
                "part of it with a mixture's amount (--dataset_mixer_list <data> 1000, or 0.25 of it), or --max_steps"
            )


def _check_no_config(source: Source) -> None:
    """Refuses an entry's `name` (a Hub data set's configuration) on a local file or a saved data set, which have
    none: it was read by nothing and recorded in the source's name (`a.jsonl:foo [train]`), as dataset_config for such
    a dataset_name is refused (options.check_dataset_config)."""
    where = Path(os.path.expanduser(source.local)) if source.name is not None and source.local else None
    if where is not None and (where.is_file() or data_identity.saved(where)):
        what = "a file" if where.is_file() else "a data set saved by save_to_disk"
        raise ConfigError(
            f"mixture source {source.spec()}: `name` {source.name!r} names a configuration of a Hub data set, and "
            f"{source.local!r} is {what}, which has none: remove `name` from its entry"
        )


def _check_found(source: Source) -> None:
    """Refuses a builder's `data_files` entry that matches no local file: datasets ends in a bare `StopIteration` (a
    pattern) or names the file but not the source."""
    if source.path not in BUILDERS or source.file or not source.data_files:
        return
    base, split, _, data_files = _read_from(source)
    for entry in data_identity.entries(data_files, split):
        if isinstance(entry, str) and "://" not in entry and not data_identity.load_matches(base, entry):
            where = "" if os.path.isabs(entry) else f" (looked in {os.path.abspath(os.path.expanduser(base))})"
            home = " (datasets does not expand ~ in data_files: give the full path)" if entry.startswith("~") else ""
            raise ConfigError(
                f"mixture source {source.spec()}: data_files {entry!r} matches no file{where}{home}: check the path or "
                "pattern"
            )


# --- taking the rows --------------------------------------------------------------------------------------------------


def take(
    source: Source, usable: int, seed: int, share_rows: int | None = None, drawn_by: str | None = None
) -> np.ndarray:
    """The indices (into the source's usable rows) the mixture takes, in the source's order within each repeat.
    `drawn_by`: what a continued run's rows were drawn by (its record's, `drawn_by`), else what the source is."""
    if share_rows is not None:  # TRL's fraction: the first rows
        return np.arange(share_rows)
    if source.amount is None:
        return np.arange(usable)
    # One generator per source: the recipe's seed and what the source is (`Source.identity`: a file by its real path),
    # not its position, the process or its spelling, which a Slurm job changes (launch.sh passes a relative path
    # in full): by its spelling, the job trained other pairs than its dry run and the analyzer had measured
    key = int.from_bytes(hashlib.sha256((drawn_by or source.identity()).encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed, key])
    if "." not in source.amount:
        count = int(source.amount)
        if count > usable:
            raise ConfigError(
                f"source {source.spec()} has {plural(usable, 'usable row')} and the mixture asks for {count}: ask for "
                f"{usable} or fewer{_upsampling(usable, count)}"
            )
        return np.sort(rng.choice(usable, count, replace=False))
    wanted = int(float(source.amount) * usable)  # floor, as open-instruct
    if wanted == 0 and usable:  # an amount of 0 is refused as written; one that floors to 0 took none, silently
        raise ConfigError(
            f"source {source.spec()} has {plural(usable, 'usable row')} and amount {source.amount} takes "
            f"{'none of them' if usable > 1 else 'none'} "
            f"(floor({source.amount} x {usable}) = 0): give a larger amount (1 takes one pair) or remove the source"
        )
    _check_room(source, usable, wanted)
    whole, rest = divmod(wanted, usable)
    return np.concatenate([np.tile(np.arange(usable), whole), np.sort(rng.choice(usable, rest, replace=False))])


def _upsampling(usable: int, count: int) -> str:
    """The fraction that takes `count` pairs of `usable` rows, offered where it would be taken: the shortest decimal
    whose floor(fraction x usable) is `count` (2.50 was offered for 100 of 40, 33.33 for 100 of 3, which takes 99); none
    where those pairs' row numbers outgrow the memory (`_check_room`), which refused the 2.5e24 offered for 1e26."""
    if _room_needed(count) is not None:
        return ""
    for digits in range(1, 20):
        text = f"{math.ceil(count * 10**digits / usable) / 10**digits:.{digits}f}"
        if int(float(text) * usable) == count:
            return f", or write a fraction to upsample ({text} takes every row and a seeded sample of the rest)"
    return ""


def _room_needed(wanted: int) -> tuple[int, int] | None:
    """(bytes, memory) where the row numbers of `wanted` pairs outgrow this machine's memory, else None."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not told: left to the allocation
        return None
    return (wanted * 8, memory) if wanted * 8 > memory else None


def _check_room(source: Source, usable: int, wanted: int) -> None:
    """Refuses an upsampling whose row numbers (8 bytes each, held again by the data set's index of them and by the
    sampler's order) outgrow this machine's memory: `--dataset_mixer_list pairs.jsonl 100000000.0` (meant 1.0) stopped
    in a traceback, numpy's "Unable to allocate 29.8 GiB" (1e20: "Python int too large to convert to C long")."""
    if (needed := _room_needed(wanted)) is not None:
        raise ConfigError(
            f"source {source.spec()} has {plural(usable, 'usable row')} and amount {source.amount} takes "
            f"{wanted:,} pairs ({wanted // usable:,} times each), whose row numbers alone need {size(needed[0])}, "
            f"more than this machine's {size(needed[1])} of memory: give a smaller amount (2.0 takes every pair twice)"
        )


def share_rows(sources: list[Source], usable: list[int]) -> list[int | None]:
    """TRL's `fraction` rule (trl/scripts/utils.py:get_dataset): normalized shares, the largest mixture in which no
    source gives more rows than it has, the first round(share x total) rows of each."""
    if sources[0].share is None:
        return [None] * len(sources)
    shares = [s.share for s in sources]
    if math.isinf(sum(shares)):  # finite shares near the float limit (1e308): their sum overflows, every weight 0
        shares = [x / max(shares) for x in shares]
    total_share = sum(shares)
    if total_share <= 0:
        raise ConfigError("every `fraction` of the mixture is 0: give at least one source a share above 0")
    weights = [x / total_share for x in shares]
    total = min(n / w for n, w in zip(usable, weights, strict=True) if w > 0)
    rows = [round(w * total) for w in weights]
    # TRL drops a source whose share rounds to no row, silently (a total of 0: `load` refuses the empty mixture)
    dropped = [i for i, (w, r) in enumerate(zip(weights, rows, strict=True)) if w and not r]
    if total and dropped:
        i = dropped[0]
        raise ConfigError(
            f"source {sources[i].spec()} has {plural(usable[i], 'usable row')} and fraction {sources[i].share:g} takes "
            f"{'none of them' if usable[i] > 1 else 'none'} (TRL's rule: round({weights[i]:.3g} x {total:.4g}) = 0): "
            "give it a larger fraction, or give each source an `amount` instead (a fraction or count of that source "
            "alone)"
        )
    return rows


# --- loading ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mix:
    """Each source's record (`data_sources`), and each joined row's source (`source_of_row`: index into `records`)."""

    records: list
    source_of_row: np.ndarray

    def measures(self, measured) -> bool:
        """Whether `measured` (a cached analysis) holds every pair of this mix once, in its order: else the cache is
        of other rows (read under another rows check, the data changed), whose shares and lengths are not these."""
        return np.array_equal(measured.index, np.arange(len(self.source_of_row)))

    def with_token_shares(self, measured, max_length: int | None = None, truncation_mode: str = "keep_start") -> list:
        """`records`, each with its share of the mixture's tokens (prompt with each answer, as measured) and, at a
        known `max_length`, its pairs the trainer drops there (`dropped_at_max_length`: the prompt alone fills it),
        so that a source's `taken` is not read as the pairs it trained."""
        if len(measured.index) and int(measured.index.max()) >= len(self.source_of_row):
            # Lengths of rows the mixture does not hold were an IndexError traceback before the model loaded
            raise ConfigError(
                f"the lengths measured reach pair {int(measured.index.max())}, and the mixture the run reads holds "
                f"{len(self.source_of_row)} pairs: an out-of-date length cache; measure the mixture again "
                "(python scripts/analyze_dataset.py --config RECIPE)"
            )
        of = self.source_of_row[measured.index]
        tokens = 2 * measured.prompt.astype(np.int64) + measured.chosen + measured.rejected
        per = np.bincount(of, weights=tokens, minlength=len(self.records))
        total = float(per.sum()) or 1.0
        records = [
            {**r, "tokens": int(n), "token_share": round(float(n) / total, 4)}
            for r, n in zip(self.records, per, strict=True)
        ]
        if max_length is not None and truncation_mode == "keep_start":
            gone = cuts.drops(measured.prompt, max_length, truncation_mode)
            dropped = np.bincount(of[gone], minlength=len(self.records))
            for record, n in zip(records, dropped, strict=True):
                record["dropped_at_max_length"] = int(n)
        return records

    def check_cuts(
        self, measured, max_length: int, truncation_mode: str, max_positions: int | None, budget: int | None = None
    ) -> None:
        """Refuse a source none of whose pairs keeps anything to learn at `max_length` (each dropped, its prompt alone
        filling it, or cut until both answers are the same tokens): the mixture as a whole may still teach
        (`cuts.check`), and the run trained on without that source while its record, summary and model card said
        it was taken, with its share of the tokens. The advice is `cuts.check`'s, on that source's pairs."""
        of = self.source_of_row[measured.index]
        for i, record in enumerate(self.records):
            mine = of == i
            prompt = measured.prompt[mine]
            shared = measured.shared[mine] if measured.shared is not None else None
            teach, dropped, same = (
                cuts.teaching(prompt, shared, max_length, truncation_mode) if len(prompt) else (1, 0, 0)
            )
            if teach:
                continue
            fits = cuts.recommend(prompt + np.maximum(measured.chosen[mine], measured.rejected[mine]), cuts.COVERAGE)
            why = [f"{dropped:,} dropped: the prompt alone fills it, the shortest is {int(prompt.min()):,} tokens"]
            why = (why if dropped else []) + ([f"{same:,} cut until both answers are the same tokens"] if same else [])
            raise ConfigError(
                f"mixture source {record['source']}: max_length {max_length:,} leaves none of its {len(prompt):,} "
                f"pairs anything to learn, so it would train nothing ({'; '.join(why)}): "
                f"{cuts.advice(fits, max_positions, budget)}, or remove the source"
            )

    def check_held_out_drops(self, measured, max_length: int, max_positions: int | None, chosen: str = "") -> None:
        """Refuse a held-out source every pair of which the trainer drops at `max_length` (keep_start: the prompt alone
        fills it): the run evaluated on the other sources alone while its record named the source as evaluated.
        `chosen`: whose max_length it is, where the user did not give it (auto's, chosen from the training pairs)."""
        of = self.source_of_row[measured.index]
        for i, record in enumerate(self.records):
            prompt = measured.prompt[of == i]
            if not len(prompt) or not cuts.drops(prompt, max_length, "keep_start").all():
                continue
            shortest = int(prompt.min())
            keeps = f"pass --max_length {shortest + 1} or more (it keeps the shortest), or remove the source"
            if max_positions and shortest >= max_positions:  # no max_length the model takes keeps one of its pairs
                keeps = f"remove the source (the model's {max_positions:,} positions hold none of its prompts)"
            raise ConfigError(
                f"held-out mixture source {record['source']}: max_length {max_length:,}{chosen} drops all of its "
                f"{len(prompt):,} pairs (the prompt alone fills it, the shortest is {shortest:,} tokens), so the run "
                f"would evaluate without it: {keeps}"
            )


def read_source(source: Source, say: bool = True, revision: str | None = None):
    """One source's rows, as the one-source loader reads them; a Hub source's at `revision` (`pin`), else its main."""
    # `columns` kept first, as TRL does: before the source's prompt column is found (`data.prompt_column`)
    what = f"mixture source {source.spec()}"
    select = functools.partial(data.kept_columns, columns=source.columns, what=what) if source.columns else None
    if source.file:
        loaded = data.load_preference_dataset(source.file, source.split, say=say, select=select)
    elif source.data_files or source.data_dir:  # a builder or Hub repo with its own files: datasets reads it
        data.check_datasets_cache()
        # CSV files read as text, as one file is (data.csv_text_features)
        text = None
        if source.path == "csv":
            text = data.csv_text_features((data_identity.files(*_read_from(source)) or {}).values())
        files = dict(name=source.name, data_dir=source.data_dir, data_files=source.data_files, split=source.split)
        hub = {"revision": revision} if revision else {}  # a builder or local folder has no revision to read at
        if not source.hub:  # files datasets copies into its cache: room for them first
            data.check_cache_room(source.path, features=text, **{k: v for k, v in files.items() if k != "split"})
        try:
            loaded = data.load_as_text(text, data.load_dataset, source.path, **files, **hub)
        except Exception as e:  # noqa: BLE001 - DatasetGenerationError says only that one occurred: its cause says what
            found = (data_identity.files(*_read_from(source)) or {}) if not source.hub else {}
            if bad := data.first_bad_file(found.values()):  # a file cut short or misnamed, named with its fix
                raise ConfigError(f"mixture source {source.spec()}: {bad}") from None
            if differ := data.column_types_differ(f"mixture source {source.spec()}", found):
                raise ConfigError(differ) from None
            raise ConfigError(f"could not load mixture source {source.spec()}: {cause(e.__cause__ or e)}") from None
        if not source.hub:  # a Hub repo's files are not read twice
            del files["split"]
            loaded = data.exact_mixed_fields(loaded, source.split, source.path, **files)
        loaded = data.prompt_column(select(loaded) if select else loaded, source.spec(), source.split, say)
    else:
        loaded = data.load_preference_dataset(
            source.path, source.split, source.name, revision, say=say, split_flag=source.split_from, select=select
        )
    data.check_columns(loaded, source.spec())
    return loaded


def load(
    sources: list[Source],
    seed: int,
    rules: rows.RowRules,
    checked: dict,
    key: str,
    *,
    identify: bool = False,
    pins: dict | None = None,
    prefetch: str | None = None,
    drawn: dict | None = None,
):
    """The mixture's pairs joined in the written order, and its `Mix`. Each source's rows read by `rules` (held out
    where `rules.evaluation`): bad rows refused by source and line, or with skip_invalid dropped and counted under
    `checked[key]`. `pins`: the commit each Hub source is read at (`pin`); `prefetch`: the command that fetches the
    sources (`offline.prefetch_command`), named where a copy read is not; `drawn`: what a continued run's sources'
    rows were drawn by (`drawn_by`), by their specs now."""
    import datasets

    usable, records, dropped, dated = [], [], {}, {}
    for source in sources:
        revision = pinned(source, pins)
        raw = read_source(source, rules.say, revision)
        spec = source.spec()  # its rows dropped are counted under it
        # Offline, datasets reads the copy it prepared last, whatever the commit: refused, not trained as the pinned one
        hub_revision.check_loaded(raw, f"mixture source {spec}", revision, prefetch, True, rules.evaluation)
        try:
            where = {"split": spec, "source": source.where, "dated": dated, "mixed": True}
            if source.local and (file := Path(source.where).expanduser()).is_file():
                where["source_files"] = [file]  # named by its path: two sources' train.jsonl told apart
            elif not (source.data_dir or source.name or source.data_files):  # a folder read whole: found in its files
                where["source_split"] = source.split
            elif not source.hub:  # a data_files glob or a data_dir: found in the files it reads
                given = {"data_dir": source.data_dir, "data_files": source.data_files, "name": source.name}
                where["source_files"] = functools.partial(data.files_read, source.path, source.split, **given)
            pairs = rows.usable_pairs(raw, rules, dropped, spec, **where)
        except ConfigError as e:  # a refusal of the whole source (it holds images, no rows) names which one
            if spec in str(e) or isinstance(e, rows.InvalidRowError):
                raise
            raise ConfigError(f"mixture source {spec}: {e}") from None
        usable.append(pairs)
        record = {"source": spec, "amount": source.written(), "rows_read": len(raw), "rows_usable": len(pairs)}
        if identify:  # the content, as one source's is recorded (data_identity): a Hub set by its revision
            record["identity"] = identity_of(source, revision)
        records.append(record)
    shares = share_rows(sources, [len(p) for p in usable])
    draws = [draw_key(s, drawn) for s in sources]
    taken = [take(s, len(p), seed, n, by) for s, p, n, by in zip(sources, usable, shares, draws, strict=True)]
    for record, picked, pairs, by in zip(records, taken, usable, draws, strict=True):
        digest = hashlib.sha256(np.asarray(picked, dtype=np.int64).tobytes()).hexdigest()[:16]
        record.update(taken=len(picked), upsampled=len(picked) > len(pairs), taken_sha256=digest)
        record["drawn_by"] = by  # what drew them, which the run's next attempt draws by (`drawn_by`)
    rows.say_dated(dated, [s.spec() for s in sources])  # one template: its warning once, not once a source
    if dropped:
        checked[key] = dropped
    _check_same_kind(usable, sources)
    parts = [p.select(t) for p, t in zip(usable, taken, strict=True) if len(t)]
    if not parts:
        raise ConfigError("the mixture takes no pair: give some source a larger amount")
    joined = rows.no_null_kwargs(datasets.concatenate_datasets(_aligned(parts)))  # a source without them: none
    source_of_row = np.concatenate([np.full(len(t), i) for i, t in enumerate(taken)])
    if rules.say:
        for r in records:
            print(
                f"Mixture: {r['source']}: {r['rows_usable']} usable of {r['rows_read']} rows, took {r['taken']} "
                f"({r['amount']}{', upsampled' if r['upsampled'] else ''})",
                flush=True,
            )
    return joined, Mix(records, source_of_row)


def _check_same_kind(parts, sources) -> None:
    """Message lists and plain text cannot train together (one chat template, or none): refused by source."""
    kinds = {s.spec(): isinstance(p[0]["chosen"], list) for s, p in zip(sources, parts, strict=True) if len(p)}
    if len(set(kinds.values())) > 1:
        lists, text = ([k for k, conversational in kinds.items() if conversational == c] for c in (True, False))
        raise ConfigError(
            f"the mixture joins message lists ({', '.join(lists)}) and plain text ({', '.join(text)}): a run applies "
            "the chat template to all or none; convert the text source to messages (HH-RLHF: hh_format: messages)"
        )


def _aligned(parts: list) -> list:
    """The sources' columns made equal (None where a source lacks one) and of one type (`_union`) to join."""
    columns = {c for p in parts for c in p.column_names}
    out = []
    for p in parts:
        for c in sorted(columns - set(p.column_names)):
            p = p.add_column(c, [None] * len(p))
        out.append(p.select_columns(sorted(columns)))
    features = out[0].features.copy()
    for p in out[1:]:
        for c, feature in p.features.items():
            features[c] = _union(features[c], feature)
    try:
        return [p.cast(features) if p.features != features else p for p in out]
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ConfigError(
            f"the mixture's sources hold their columns in types that cannot be joined ({cause(e)}): write each "
            "source's prompt, chosen and rejected the same way (message lists of role/content, or text)"
        ) from None


def _union(a, b):
    """A type holding the values of both: null takes the other's; structs of the same fields take both's types;
    anything else mixed (`tools` as JSON text in one source, a list in another; structs of other fields) is datasets'
    Json, which reads each back as written."""
    import datasets

    if a == b or getattr(b, "dtype", None) == "null" or isinstance(a, datasets.Json):
        return a
    if getattr(a, "dtype", None) == "null" or isinstance(b, datasets.Json):
        return b
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        # Not a struct of both's fields: each row would get the fields only the other source writes, as null, and
        # the template renders them (a tool's `"required": null` in its JSON, a message's `name` of None)
        return {k: _union(a[k], b[k]) for k in a}
    if type(a) is type(b) and isinstance(a, datasets.List | datasets.LargeList):
        return dataclasses.replace(a, feature=_union(a.feature, b.feature))
    return datasets.Json()


def describe(record: dict) -> str:
    """One source as the dry run, the analyzer and the model card say it: rows, taken, share of the tokens."""
    dropped = record["rows_read"] - record["rows_usable"]
    text = f"{record['source']}: {plural(record['rows_read'], 'row', ',')}"
    text += f" ({dropped:,} invalid dropped)" if dropped else ""
    text += f", took {record['taken']:,} ({record['amount']}{', upsampled' if record['upsampled'] else ''})"
    if "token_share" in record:
        text += f", {record['token_share']:.1%} of the tokens"
    if cut := record.get("dropped_at_max_length"):
        text += f"; {cut:,} of them dropped at max_length (the prompt alone fills it)"
    return text


# --- identity ---------------------------------------------------------------------------------------------------------


def _read_from(source: Source) -> tuple | None:
    """What `data_identity` reads a source's files from: its file or folder, or a builder's `data_dir` (else the working
    folder) and its `data_files`, not the whole folder; None for a Hub data set (its `data_files` are the repo's)."""
    if source.path in BUILDERS and not source.file:
        return source.data_dir or ".", source.split, None, source.data_files
    return (source.local, source.split, source.data_dir, source.data_files) if source.local else None


def pin(sources: list[Source], kept: dict | None = None) -> dict[str, str]:
    """The commit each Hub source is read at, by its repo: `kept` (a continued run's record's) as they are; else its
    main's now, asked of the Hub once (else read from its cache). The run knows the rows by it before and after the
    read, so neither a push between the two looks nor a first read that fills the cache (a name, then a commit) is
    taken for changed data. A source whose commit cannot be told (offline, no refs/main in the cache: prefetched at a
    --revision, or copied without refs) is read at main, the copy datasets prepared last, and recorded as `...@main`."""
    repos = {s.path for s in sources if s.hub}
    taken = {repo: sha for repo, sha in (kept or {}).items() if repo in repos}
    found = {repo: hub_revision.commit(repo, None) for repo in sorted(repos - set(taken))}
    return taken | {repo: sha for repo, sha in found.items() if sha and hub_revision.COMMIT.fullmatch(sha)}


def kept(recipe, output_dir: str) -> dict[str, str]:
    """The commit each Hub source of a continued run's mixtures (training and held-out) was read at, by repo, as its
    record holds it (`data_sources`' and `eval_sources`' identities): the resume reads it again, as a Hub data set's
    resume loads its commit (`hub_revision.kept`). One read unpinned (`pin`: recorded as `...@main`), or that the
    record holds no commit for, is pinned as a new run's."""
    found = {}
    for source, was in _continued(recipe, output_dir):
        revision = (was.get("identity") or {}).get("revision") or ""
        commit = hub_revision.commit_of(revision)
        # Of this repo (a dry run goes on past a changed mixture's refusal: another repo's commit is none of its)
        if source.hub and commit and revision.startswith(f"hub:{source.path}:"):
            found[source.path] = commit
    return found


def draw_key(source: Source, drawn: dict | None) -> str:
    """What `source`'s rows are drawn by (`take`): a continued run's record's (`drawn`, by spec: `drawn_by`), else
    what the source is (`Source.identity`)."""
    return (drawn or {}).get(source.spec()) or source.identity()


def drawn_by(recipe, output_dir: str) -> dict[str, str]:
    """What a continued run's sources' rows (training and held-out) were drawn by, by their specs now: its record's
    `drawn_by`, else (a record written before it) the source's spelling then, which drew them. The run goes on with
    the pairs it started on however its sources are named now (config.same_sources)."""
    found = {}
    for source, was in _continued(recipe, output_dir):
        then = was.get("drawn_by") or was.get("source")
        if isinstance(then, str):
            found[source.spec()] = then
    return found


def _continued(recipe, output_dir: str):
    """(source, its entry in the record's `data_sources` or `eval_sources`, {} for none) of a continued run's
    mixtures, training and held-out."""
    values = fields_of(recipe)
    recorded = hub_revision.record(output_dir) if given(values) or given(values, evaluation=True) else None
    for evaluation, field in ((False, "data_sources"), (True, "eval_sources")):
        sources = parse(values, evaluation) or []
        yield from zip(sources, _entries(sources, getattr(recorded.data, field) if recorded else None), strict=True)


def _recorded(sources: list[Source], records: list | None) -> list[dict]:
    """Each source's identity as `records` (a record's `data_sources` or `eval_sources`) hold it, {} for none."""
    return [entry.get("identity") or {} for entry in _entries(sources, records)]


def _entries(sources: list[Source], records: list | None) -> list[dict]:
    """Each source's entry in `records`, {} for none: by its spec, else at its place (a source recorded under another
    spelling, config.same_sources)."""
    records = records or []
    by_spec = {r.get("source"): r for r in records}
    placed = records if len(records) == len(sources) else [{}] * len(sources)
    return [by_spec.get(s.spec(), p) for s, p in zip(sources, placed, strict=True)]


def pinned(source: Source, pins: dict | None) -> str | None:
    """The commit `pin` resolved a Hub source to, or None (a local source or builder, or none pinned)."""
    return (pins or {}).get(source.path) if source.hub else None


def identity_of(source: Source, revision: str | None = None) -> dict:
    """A local source's files (`data_identity.of_files`), or a Hub source's revision (`revision`: the commit it was read
    at; else its main's now)."""
    files = _files_record(source)
    if files is not None:
        return {"files": files}
    return {"revision": lengths.dataset_identity(source.path, source.split, source.name, revision, local_only=False)}


def _files_record(source: Source, held=frozenset()) -> dict | None:
    """`data_identity.of_files` of the files of a local source the run reads (`_compared`: those and the card that
    chooses them; `held`: its folder's files evaluated on), not every file of its folder: a file no split reads (an old
    export beside a card's `configs:`, notes) deleted refused a resume of the same pairs. None for a Hub data set."""
    found = data_identity.files(*read_from) if (read_from := _read_from(source)) else None
    if found is None:
        return None
    if (reads := _compared(source)) is not None:  # None: it reads none here, and the load says why
        found = {name: path for name, path in found.items() if path.resolve() in reads | held}
    return data_identity.of_files(found)


def data_identity_of(recipe) -> dict | None:
    """The record of dataset_name's local files the run reads (`_files_record`; a folder of split files' test split with
    them, where the run evaluates on it: `_read_by`); None for a Hub data set."""
    return _files_record(*_read_by(recipe))


def _read_by(recipe) -> tuple[Source, set]:
    """dataset_name as a source, and the files of its folder of split files the run evaluates on (its test split)."""
    s = recipe.script
    folder = Path(s.dataset_name).expanduser()
    evaluates = recipe.training.eval_strategy != "no" and folder.is_dir() and not data_identity.saved(folder)
    held = set(_split_files(str(folder), s.dataset_test_split, s.dataset_config)) if evaluates else set()
    return Source(s.dataset_name, s.dataset_train_split, s.dataset_config), held


def content_changed(recipe, derived: dict) -> str | None:
    """How the training data's content differs from the run's record (`derived`'s `data_identity` or `data_sources`).
    A mixture's Hub sources are not compared: a resume reads each at the commit its record holds (`kept`)."""
    sources = parse(fields_of(recipe))
    if sources is None:
        s, old = recipe.script, derived.get("data_identity")
        if isinstance(old, dict) and hub_revision.KEY in old:  # a Hub data set, by its commit
            return hub_revision.changed(old[hub_revision.KEY], s.dataset_name, recipe.project.dataset_revision)
        # A folder of split files' test split: the pairs the run evaluates on, recorded with the training files
        source, held = _read_by(recipe)
        reads = _compared(source)
        reads = reads and reads | held
        return data_identity.changed(old, s.dataset_name, s.dataset_train_split, evaluated=held, reads=reads)
    return _sources_changed(sources, derived.get("data_sources"))


def held_out_changed(recipe, derived: dict) -> str | None:
    """How the held-out pairs' local files differ from the run's record: a held-out mixture's (`eval_sources`), else
    dataset_name's test split's where the training record leaves them out (`eval_identity`). A record of neither
    (written before they were compared) is not compared; Hub sources are read at their recorded commits (`kept`)."""
    sources, s = parse(fields_of(recipe), evaluation=True), recipe.script
    if sources is None:
        held = derived.get("eval_identity")
        return data_identity.changed(held, s.dataset_name, s.dataset_test_split, read=data_identity.EVALUATED)
    return _sources_changed(sources, derived.get("eval_sources"), data_identity.EVALUATED)


def _sources_changed(sources: list[Source], records: list | None, read: str = data_identity.TRAINED) -> str | None:
    for source, was in zip(sources, _recorded(sources, records), strict=True):
        read_from = _read_from(source)
        if not (was.get("files") and read_from):
            continue
        if why := data_identity.changed(was["files"], *read_from, read, reads=_compared(source)):
            return f"{source.spec()}: {why}"
    return None


def _compared(source: Source) -> set | None:
    """The files a source's record is compared on: those it reads (a folder of split files is recorded whole, and the
    source reads its split's), and the card that chooses them (README.md's `configs:`); None where it reads none here
    (the load says why)."""
    found = _files_read(source)
    if not found:
        return None
    where, _, data_dir, _ = _read_from(source)
    card = Path(os.path.expanduser(os.path.join(where, data_dir or "")), "README.md")
    # The card where it has a YAML header, which datasets reads (`configs:`, `dataset_info:`): a README.md of prose
    # alone, written into the data folder between two attempts, refused the requeued job as changed data
    header = card.is_file() and re.match(r"\ufeff?\s*---", card.read_text(encoding="utf-8", errors="replace"))
    return {*found, *([card.resolve()] if header else [])}


def dataset_id(
    recipe, local_only: bool = False, revision: str | None = None, pins: dict | None = None, drawn: dict | None = None
) -> str:
    """The analyzer's cache key for the training data: one source's identity, or its sources' identities, amounts and
    the seed. `revision`: the commit the run loads, if known; `pins`: a mixture's Hub sources' (`pin`); `drawn`: what
    a continued run's sources' rows were drawn by (`drawn_by`)."""
    values = fields_of(recipe) | ({} if revision is None else {"dataset_revision": revision})
    p = recipe.project
    return dataset_id_of(values, recipe.training.seed, p.hh_format, local_only, pins, p.assistant_turns, drawn)


def dataset_id_of(
    values: dict,
    seed: int,
    hh_format: str,
    local_only: bool = False,
    pins: dict | None = None,
    assistant_turns: str = "final",
    drawn: dict | None = None,
) -> str:
    """`dataset_id`'s key from the recipe's data fields; `assistant_turns` keys it only where it is `all`
    (`lengths.turns_key`: `final` recipes keep the keys their caches were written under); `drawn`: `dataset_id`'s."""
    identity = functools.partial(lengths.dataset_identity, local_only=local_only, hh_format=hh_format)
    sources = parse(values)
    if sources is None:
        name, split = values["dataset_name"], values["dataset_train_split"]
        config, revision = values.get("dataset_config"), values.get("dataset_revision")
        return identity(name, split, config, revision, assistant_turns=assistant_turns)
    # Keyed by what drew the rows (`take`): a resume's by its record's, the rows it takes
    parts = [
        [_content_id(s, identity, hh_format, pinned(s, pins)), draw_key(s, drawn), s.written(), s.columns]
        for s in sources
    ]
    # `all` drops pairs `final` keeps (an empty earlier answer): another key; `final`'s, as before it was read
    keyed = [parts, seed, *(["assistant_turns:all"] if lengths.turns_key(assistant_turns) else [])]
    digest = hashlib.sha256(json.dumps(keyed, default=str).encode()).hexdigest()[:16]
    return f"mixture:{digest}"


def _content_id(source: Source, identity, hh_format: str, revision: str | None = None) -> str:
    """One source's part of the analyzer's cache key: `identity` of its file, folder or Hub data set; a builder's the
    files it reads, by path and `data_identity.stamp` (`identity` would take the builder's name for a Hub data set)."""
    if source.path not in BUILDERS or source.file:
        return identity(source.file or source.path, source.split, source.name, revision)
    found = data_identity.files(*_read_from(source)) or {}
    stamp = [[str(p.resolve()), data_identity.stamp(p)] for _, p in sorted(found.items())]
    return f"local:{hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]}:{hh_format}"

"""Which max_length to train with: token lengths of a preference data set, exactly as TRL's DPOTrainer sees them.

    # a recipe's data set and tokenizer (its per-device batch size for the padding figures)
    CUDA_VISIBLE_DEVICES="" python scripts/analyze_dataset.py --config configs/think.yaml --json think.json

    # a Hub data set (HF_TOKEN from .env); the recipe in configs/ that trains on it gives the tokenizer
    CUDA_VISIBLE_DEVICES="" python scripts/analyze_dataset.py allenai/Dolci-Think-DPO-7B

    # a local file with any tokenizer; a quick look at 2,000 seeded rows; a histogram
    python scripts/analyze_dataset.py data/smoke_prefs.jsonl --tokenizer builtin:tiny-olmo3 --sample 2000 --plot h.png

CPU only (it hides GPUs itself) and it loads a tokenizer, never model weights. Every row is analysed unless --sample;
rows the trainer cannot use stop it with the row index and column (exit 2), or with --skip-invalid (or the recipe's
skip_invalid) are counted and listed. The markdown report goes to stdout. A complete analysis (no --sample; with
--skip-invalid, of the rows the run keeps) is also cached, so that training with `max_length: auto` on the same data
set revision, tokenizer and chat template reuses it: in $DPOTRAIN_CACHE/lengths, else ~/.cache/dpotrain/lengths (a
few numbers a pair; a line on stderr names the file; on a cluster, set DPOTRAIN_CACHE to a shared folder the jobs read).
"""

import contextlib
import functools
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a login node or a laptop: never touch a GPU, even where there is one

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python scripts/analyze_dataset.py` from anywhere
from dpotrain.recipe import venv  # noqa: E402

with venv.entry_point(ROOT, command=__name__ == "__main__"):  # the project's venv, then .env, then torch
    from transformers.hf_argparser import string_to_bool

    from dpotrain import options, output_folder
    from dpotrain.cluster import offline
    from dpotrain.data import chat_template, cuts, data, hub_revision, lengths, lengths_report, mixture, rows, shapes
    from dpotrain.data.positions import check as check_positions
    from dpotrain.data.positions import model_limit
    from dpotrain.data.rows import InvalidRowError
    from dpotrain.plan import memory
    from dpotrain.recipe import cli, config, recipe_file, writes
    from dpotrain.recipe.errors import ConfigError, cause, run_command, warn

DEFAULT_DATASET = "allenai/Dolci-Instruct-DPO"  # OLMo 3's released Instruct DPO data
# The paths a recipe names that the analyzer reads, each taken on its command line under the run's name too
ANALYZER_FIELDS = ("dataset_name", "model_name_or_path", "chat_template_path")


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.Parser(
        prog="analyze_dataset.py",
        description="Token lengths of a DPO data set as TRL's DPOTrainer tokenizes it, and the max_length to use. "
        "Flags are spelled as train_dpo.py spells them too (--model_name_or_path, --skip_invalid, --dataset_name).",
    )
    p.add_argument(
        "dataset",
        nargs="?",
        help=f"Hub name, or a local JSONL/JSON/Parquet/CSV file or saved folder (docs/data.md) [recipe's, else "
        f"{DEFAULT_DATASET}]",
    )
    p.add_argument("--dataset_name", dest="dataset_flag", help="the data set, as train_dpo.py names it")
    p.add_argument("--config", help="recipe (configs/*.yaml) giving dataset, tokenizer, batch size and max_length")
    # The run's command-line mixture (README: Your data), measured as the run reads it: a source and an amount each.
    p.add_argument("--dataset_mixer_list", nargs="+", help="a mixture, as train_dpo.py takes it: SOURCE AMOUNT ...")
    p.add_argument("--dataset_mixer_list_splits", nargs="+", help="the mixture's split, or one per source")
    p.add_argument("--datasets", nargs="+", help="a mixture, as train_dpo.py takes it: TRL's sources, in YAML or JSON")
    # The run's held-out pairs, as train_dpo.py takes them: measured and counted at the length as the run drops them
    p.add_argument("--dataset_mixer_eval_list", nargs="+", help="the held-out mixture, as train_dpo.py takes it")
    p.add_argument("--dataset_mixer_eval_list_splits", nargs="+", help="the held-out mixture's split, or one a source")
    p.add_argument("--eval_datasets", nargs="+", help="the held-out mixture, as train_dpo.py takes it: TRL's sources")
    p.add_argument("--eval_strategy", help="steps or epoch: the held-out pairs are measured [the recipe's, else no]")
    p.add_argument("--eval_steps", help="as train_dpo.py's, which a held-out mixture asks for [the recipe's]")
    p.add_argument(
        "--tokenizer",
        "--model_name_or_path",
        help="tokenizer name or path (the model's) [the recipe's model_name_or_path]",
    )
    # The run's tokenizer, as train_dpo.py loads it: at its revision, with its own code (an auto_map) where allowed
    p.add_argument("--model_revision", help="the model's revision (branch, tag or commit) [the recipe's, else main]")
    p.add_argument(
        "--trust_remote_code",
        type=string_to_bool,
        help="true: load a tokenizer with its own code, as training with it does [the recipe's, else false]",
    )
    p.add_argument(
        "--chat_template_path",
        help="the chat template to tokenize with, as training's "
        "chat_template_path: a .jinja file or a folder holding chat_template.jinja [the recipe's, else the "
        "model's own]",
    )
    p.add_argument(
        "--split", "--dataset_train_split", help="split to analyse [the recipe's dataset_train_split, else train]"
    )
    p.add_argument("--dataset_config", help="the Hub data set's configuration (subset) [the recipe's dataset_config]")
    p.add_argument(
        "--revision",
        "--dataset_revision",
        help="Hub data set revision (branch, tag or commit); default: the recipe's dataset_revision, else main",
    )
    p.add_argument("--sample", type=int, help="analyse N rows drawn with --seed instead of every row")
    # train_dpo.py's --seed, which draws a mixture's rows: as the analyzer's own sample seed, a mixture was measured on
    # the rows the recipe's seed draws, not the run's
    p.add_argument(
        "--seed",
        type=int,
        help="the run's seed, as train_dpo.py's: the rows a mixture takes, --sample's rows and the shuffled-batch "
        "padding figures [the recipe's seed, else 42]",
    )
    p.add_argument(
        "--num-proc", type=int, default=lengths.available_cpus(), help="tokenizing processes [the CPUs available]"
    )
    p.add_argument(
        "--candidates",
        type=int,
        nargs="+",
        default=[],
        help="max_length values to report on, "
        f"besides {', '.join(map(str, lengths.REPORT_LENGTHS))}, the recipe's and the recommended one",
    )
    # The run's two flags, read over the recipe as training reads them: another length judged without editing it
    p.add_argument("--max_length", help="the max_length whose cuts the report ends with, as training's [the recipe's]")
    p.add_argument("--truncation_mode", help="keep_start or keep_end, as training's [the recipe's, else keep_start]")
    p.add_argument(  # how each pair splits into prompt and answers, as training's: other lengths, cached apart
        "--assistant_turns", help="final or all: the assistant turns trained, as training's [the recipe's, else final]"
    )
    p.add_argument(
        "--coverage",
        "--auto_coverage",
        type=float,
        help="fraction of pairs that must fit untruncated: the recommendation is the smallest multiple of "
        f"{lengths.STEP} reaching it, shown with its packed compute [the recipe's auto_coverage, else "
        f"{lengths.DEFAULT_COVERAGE}]",
    )
    p.add_argument(
        "--gpu_memory_gib",
        type=float,
        help="GPU memory to plan each max_length for, with the recipe's "
        "model, engine and processes (README: Long traces) [the recipe's gpu_memory_gib]",
    )
    # `~` expanded: after `--json=` a shell leaves it, and the check advised creating a folder named `~` here
    p.add_argument("--json", type=os.path.expanduser, help="write the report as JSON here")
    p.add_argument("--plot", type=os.path.expanduser, help="write a PNG histogram of total length here")
    p.add_argument(
        "--skip-invalid",
        nargs="?",
        const=True,
        type=string_to_bool,  # train_dpo.py's spellings of true and false
        help="count and list bad rows instead of stopping at one (alone, or true/false) [the recipe's skip_invalid, "
        "else false]",
    )
    p.add_argument("--streaming", action="store_true", help="stream the data set (larger than memory or disk)")
    p.add_argument(
        "--hh-format",
        choices=shapes.HH_FORMATS,
        help="HH-RLHF strings: through the chat template as messages, or as raw text, as training with the same "
        "hh_format does [the recipe's hh_format, else messages]",
    )
    p.add_argument(
        "--batch-size",
        "--per_device_train_batch_size",
        type=int,
        help="pairs per device for the padding figures "
        "[the run's: the recipe's per_device_train_batch_size, else TRL's 8 without a token budget and "
        f"{lengths.DEFAULT_BATCH_SIZE} with one]",
    )
    args = p.parse_args(argv)
    if args.dataset_flag and args.dataset and args.dataset_flag != args.dataset:
        raise ConfigError(f"two data sets named: {args.dataset!r} and --dataset_name {args.dataset_flag!r}: keep one")
    args.dataset = args.dataset or args.dataset_flag
    typed = "--datasets" if args.datasets else "--dataset_mixer_list" if args.dataset_mixer_list else None
    if args.dataset and typed:  # both typed: which one to measure is not for the analyzer to guess
        raise ConfigError(
            f"a data set ({args.dataset!r}) and {typed}: a mixture names every source; put that data set "
            "in the mixture or remove it"
        )
    args.mixture_flag = typed
    return args


def read_run(args: argparse.Namespace):
    """The recipe as the run reads it (`config.parse_args`, planning as a dry run does: this machine's GPUs do not
    matter), with this command's flags over it. Without --config, the recipe in configs/ that trains on the data set;
    without one, the run's defaults (no recipe: `config_path` None)."""
    # A mixture names its own sources: the recipe that trains on the default data set is not the one meant.
    path = args.config or (None if args.mixture_flag else recipe_for(args.dataset or DEFAULT_DATASET))
    flags = {
        "model_name_or_path": args.tokenizer,
        "model_revision": args.model_revision,
        "trust_remote_code": args.trust_remote_code,
        "dataset_name": args.dataset,
        "dataset_train_split": args.split,
        "dataset_config": args.dataset_config,
        "dataset_revision": args.revision,
        "chat_template_path": args.chat_template_path,
        "hh_format": args.hh_format,
        "max_length": args.max_length,
        "seed": args.seed,
        "truncation_mode": args.truncation_mode,
        "assistant_turns": args.assistant_turns,
        "auto_coverage": args.coverage,
        "gpu_memory_gib": args.gpu_memory_gib,
        "skip_invalid": args.skip_invalid,
        "dataset_mixer_list": args.dataset_mixer_list,
        "dataset_mixer_list_splits": args.dataset_mixer_list_splits,
        "datasets": args.datasets,
        "dataset_mixer_eval_list": args.dataset_mixer_eval_list,
        "dataset_mixer_eval_list_splits": args.dataset_mixer_eval_list_splits,
        "eval_datasets": args.eval_datasets,
        "eval_strategy": args.eval_strategy,
        "eval_steps": args.eval_steps,
    }
    words = [
        word
        for name, value in flags.items()
        if value is not None
        for word in (f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)]))
    ]
    try:
        return config.parse_args([*(["--config", path] if path else []), *words, "--dry-run"])
    except config.JobVariable as refused:  # the job's path, on its command line: an sbatch dry run is after the job
        raise ConfigError(refused.before_job("the analyzer reads the recipe", ANALYZER_FIELDS)) from None


def recipe_for(dataset: str) -> str | None:
    """The recipe in configs/ that trains on `dataset`, as a person types its path (relative to the folder they run
    in when it lies inside, else absolute). Of several, one that names its model: think-32b.yaml, first by name, leaves
    the model to the command line, and think.yaml gives the tokenizer and chat template (docs/max_length.md)."""
    found = [(path, recipe) for path in sorted((ROOT / "configs").glob("*.yaml")) if (recipe := _read(path, dataset))]
    path = next((path for path, recipe in found if recipe.get("model_name_or_path")), found[0][0] if found else None)
    if path is None:
        return None
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _read(path: Path, dataset: str) -> dict | None:
    """The recipe at `path` if it trains on `dataset`. A recipe there that does not read (a person's draft, a misspelt
    key) is refused only when it names this data set: before, it stopped the analysis of every data set."""
    try:
        recipe = config.read_recipe(str(path), planning=True)  # a login node: the job sets its SLURM_ variables
    except ConfigError:
        loose = recipe_file.loosely(path)  # what the draft names, as far as its YAML reads
        if isinstance(loose, dict) and _same_data(loose.get("dataset_name"), dataset):
            raise
        return None
    return recipe if _same_data(recipe.get("dataset_name"), dataset) else None


def _same_data(named, dataset: str) -> bool:
    """Whether a recipe's `dataset_name` is `dataset`: a local one by where the run finds each (`./data/x.jsonl`,
    `data/x.jsonl` and its full path are one file), a Hub name as written."""
    if named == dataset:
        return True
    place = config.recorded_place(dataset)
    return isinstance(named, str) and place is not None and config.recorded_place(named) == place


def main(argv=None) -> int:
    """Exit status: 0, or 2 after one line `error: ...` (bad input: which row, which column, what to do)."""
    offline.start_run()  # no answer from the Hub yet: one an earlier command in this process got is not this one's
    if __name__ != "__main__":  # an importer (the tests); a command read it before its imports, once
        venv.load_env(ROOT)  # HF_TOKEN for gated or private data sets
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from transformers.utils import logging as transformers_logging

    # Not "Token indices sequence length is longer than the specified maximum": measuring long rows is the point.
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        return analyze(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        transformers_logging.set_verbosity(verbosity)


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_args(args: argparse.Namespace) -> None:
    """Values and output paths, checked before an analysis that may take minutes."""
    for flag, value in (("--batch-size", args.batch_size), ("--sample", args.sample), ("--num-proc", args.num_proc)):
        if value is not None and value < 1:
            raise ConfigError(
                f"{flag} must be >= 1 (got {value})" + (", or leave it out" if flag != "--num-proc" else "")
            )
    # numpy's seeds: the padding figures' shuffle would fail after the analysis
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise ConfigError(
            f"--seed {args.seed} is out of range: give one from 0 to 2**32 - 1, or leave it out (the recipe's, else 42)"
        )
    bad = [n for n in args.candidates if n < 1]
    if bad:
        raise ConfigError(f"--candidates are max_length values and must be >= 1 (got {bad[0]})")
    if long := [n for n in args.candidates if n > options.LONGEST_MAX_LENGTH]:  # the run's bound on max_length
        raise ConfigError(options.too_long("--candidates", long[0]))
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(f"--plot {args.plot!r}: the histogram is an image, name it with one of {PLOT_SUFFIXES}")
    output_folder.check_report_paths({"--json": args.json, "--plot": args.plot})


def every_row_invalid(checked, split: str, name: str, tokenizer=None) -> None:
    """Every row bad is refused as the run refuses it (the check they all fail, no `--skip-invalid` offered: it left
    "no valid rows to analyse (24 invalid)", naming no reason). `tokenizer`: the one the rows were measured with,
    whose generation prompt tells what fits (`chat_template.misfit`)."""
    if checked.rows and len(checked.invalid) == checked.rows:
        raise ConfigError(rows.every_row_invalid(checked, split, name, tokenizer))


def analyze(args: argparse.Namespace) -> int:
    check_args(args)
    run = read_run(args)
    options.check_max_length(run.training)  # 0 was no length at all, -5 a candidate row of negative sizes
    # A held-out mixture named without eval_strategy, which the run refuses: the analysis measured none of it, unsaid
    if mixture.given(mixture.fields_of(run), evaluation=True):
        options.check_evaluation(run)
    script, training, project, recipe_path = run.script, run.training, run.project, run.config_path
    # The recipe's streaming, refused as the run refuses it (the analyzer's own --streaming is how it reads, no setting)
    options.check_streaming(run, f" (in {recipe_path})" if recipe_path else "")
    # The rows the run skips (the recipe's skip_invalid, or the flag over it): it stopped at a row the run drops
    args.skip_invalid = project.skip_invalid
    args.seed = training.seed  # the run's (the flag over the recipe's): a mixture's rows, --sample's, the padding's
    fields = mixture.fields_of(run)
    mixed = not args.dataset and mixture.given(fields)  # a mixture: read as training reads it, then measured
    if mixed and args.streaming:  # the flag's own name: the mixture's check names the recipe's `streaming: true`
        raise ConfigError(
            "--streaming with a mixture: its sources are counted and sampled, which needs their rows: remove "
            "--streaming (each source is read whole, as training reads it)"
        )
    if not mixed:  # the run's checks of one data set (test_split_size, a file read twice): a mixture's load makes them
        mixture.check(run)
    name = recipe_path if mixed else script.dataset_name or DEFAULT_DATASET
    # What the report calls the data: a mixture typed on the command line is that, not the recipe (or None)
    shown = f"the {args.mixture_flag} mixture" if mixed and args.mixture_flag else name
    split, subset, hh_format = script.dataset_train_split, script.dataset_config, project.hh_format
    options.check_dataset_config(None if mixed else name, subset)  # as the run: a file has no configuration
    if not args.dataset:  # the recipe's data set at the recipe's commit (or --revision's), as training reads it
        args.revision = project.dataset_revision
    if args.revision is not None and not hub_revision.applies(None if mixed else name):
        # as training refuses dataset_revision there: the report recorded a revision nothing was read at
        reads = "the recipe reads a mixture (each source at main)" if mixed else f"{name!r} is local"
        raise ConfigError(
            f"revision {args.revision!r} (--revision, or the recipe's dataset_revision) names a commit of a Hub data "
            f"set, and {reads}: remove it"
        )
    tokenizer_name, template = run.model.model_name_or_path, project.chat_template_path
    revision = run.model.model_revision  # the recipe's: the tokenizer training loads is the one measured with
    if not tokenizer_name:
        raise ConfigError(f"no tokenizer for {name!r}: pass --tokenizer NAME_OR_PATH or --config configs/<recipe>.yaml")
    chat_template.check(template)  # before anything loads
    lengths.check_tokenizer_folder(tokenizer_name)  # configs/models/*: a shape, no tokenizer; said before anything
    # the run's (None for `max_length: auto`); without a recipe TRL's default is no one's choice, --max_length is
    current = training.max_length if recipe_path or args.max_length else None
    target = project.auto_coverage
    if not 0 < target <= 1:  # named as given: the command line's flag (either spelling), else the recipe's key
        given = "--coverage (--auto_coverage)" if args.coverage is not None else f"auto_coverage in {recipe_path}"
        raise ConfigError(
            f"{given} must be in (0, 1] (got {target:g}): the share of pairs to leave whole, "
            f"{lengths.DEFAULT_COVERAGE:g} by default"
        )
    if hh_format not in shapes.HH_FORMATS:
        raise ConfigError(f"hh_format {hh_format!r} in {recipe_path}: choose one of {', '.join(shapes.HH_FORMATS)}")
    # The padding figures' batch: the run's pairs per micro-batch (TRL's 8 where nothing sets it) without a token
    # budget; a recipe with one pads no fixed batch, so they show OLMo 3's 4 pairs unless it gives a batch size
    fixed = "per_device_train_batch_size" in run.given or project.max_tokens_per_microbatch is None
    given_batch = training.per_device_train_batch_size if fixed else None
    batch_size = args.batch_size or given_batch or lengths.DEFAULT_BATCH_SIZE
    sources = mixture.local_files(fields) if mixed else []
    inputs = writes.input_files(
        name, *sources, recipe_path, tokenizer_name, template
    )  # a report never replaces what it describes
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        writes.check_not_input(flag, path, inputs)
    output_folder.check_reports_outside_data({"--json": args.json, "--plot": args.plot}, [name, *sources])
    print(
        f"Analysing {shown} ({split}) with the tokenizer of {tokenizer_name}"
        + (f" at revision {revision}" if revision not in (None, "main") else "")
        + (f" and the chat template {chat_template.named(template)}" if template else "")
        + (f" (recipe {recipe_path})" if recipe_path else ""),
        file=sys.stderr,
        flush=True,
    )

    options.check_model_path(tokenizer_name)  # a mistyped folder: not transformers' "Repo id must be in the form"
    # A tokenizer's own code (trust_remote_code) is imported from a copy written there: as the run's checks refuse it,
    # not transformers' NotADirectoryError or PermissionError as the tokenizer loads
    options.check_modules_cache(run)
    remedy = fetch_remedy(tokenizer_name, name, subset, recipe_path, args)
    # A mixture's Hub sources too (its `name` is the recipe): datasets waited on a silent Hub for a cached one, 300 s+.
    sources = mixed and not offline.datasets_offline() and bool(offline.hub_datasets(run))
    reads_hub = offline.is_hub_model(tokenizer_name) or hub_revision.applies(name) or sources  # silent: cache, offline
    downloads = hub_downloads(tokenizer_name, revision, name, subset, split, args)
    downloads += offline.missing_artifacts(run, model=False) if sources else []
    offline.check_hub_reachable(downloads, remedy, reads_hub)
    try:
        tokenizer = lengths.recipe_tokenizer(run)
    except ConfigError:  # its own line, naming the fix (a config.json value transformers refuses)
        raise
    except Exception as e:  # noqa: BLE001 - unknown name, offline, gated: one line
        if "trust_remote_code" in str(e) or "contains custom code" in str(e):  # transformers names no flag of ours
            raise ConfigError(
                f"the tokenizer of {tokenizer_name!r} runs its own code (auto_map in its tokenizer_config.json or "
                "config.json): read it, then give --trust_remote_code true"
            ) from None
        hint = f": {remedy}" if offline.is_hub_model(tokenizer_name) and offline.is_offline() else ""
        raise ConfigError(f"could not load the tokenizer of {tokenizer_name!r} ({cause(e)}){hint}") from None
    # A mixture's Hub sources at one commit each, decided once as the run decides them (mixture.pin): the keys before
    # and after the read and the read itself each asked for main (a push between them: a refusal to cache, as of data
    # still being written), and offline the copy datasets prepared last was measured and cached under refs/main's key.
    pins = mixture.pin(mixture.parse(fields)) if mixed else None
    # One Hub data set at the commit the run trains on (stages.pin_data), offline refs/main's: read unpinned, the copy
    # datasets prepared last was measured, whatever commit it holds, and cached under main's commit
    pinned = hub_revision.resolve(name, args.revision) if not mixed and hub_revision.applies(name) else args.revision
    # What the cache is keyed by, taken before the rows are read: a file still written during the analysis has another
    # identity by its end, under which the rows measured would stand for rows they never were.
    # The rows the run drops under its assistant_turns (an empty earlier answer under `all`: rows.read_row) are the
    # ones dropped or refused here, and `all`'s lengths are keyed apart from `final`'s (lengths.turns_key)
    turns = project.assistant_turns
    identify = (
        functools.partial(mixture.dataset_id_of, fields, training.seed, hh_format, pins=pins, assistant_turns=turns)
        if mixed
        else functools.partial(
            lengths.dataset_identity, name, split, subset, pinned, hh_format=hh_format, assistant_turns=turns
        )
    )
    dataset_id = identify()
    with contextlib.redirect_stdout(sys.stderr):  # what loading says of the rows and columns: stdout is the report's
        dataset, mix = (
            load(args, name, split, subset, pinned, offline.prefetch_command(run))
            if not mixed
            else mixture.load(
                mixture.parse(fields),
                training.seed,
                # the recipe's chat_template_path named in each source's line, as the run names it
                rows.RowRules(args.skip_invalid, hh_format, turns, tokenizer, project.chat_template_path),
                {},
                "invalid_rows",
                pins=pins,
                prefetch=offline.prefetch_command(run),
            )
        )

    indices = None
    if args.sample:
        dataset, indices = sample(dataset, args.sample, args.seed)
        if indices is None:  # every row: a complete analysis, reported and cached as one (not "a sample of N rows")
            args.sample = None
    try:
        m = lengths.measure(
            dataset,
            tokenizer,
            num_proc=args.num_proc,
            skip_invalid=args.skip_invalid,
            indices=indices,
            progress=True,
            hh_format=hh_format,
            assistant_turns=turns,
        )
    except InvalidRowError as e:  # where the row is in the user's file (a sample keeps the rows' own indices)
        if e.index == 0 and indices is None and not args.streaming:  # a stream is not read twice: its row's line
            checked = rows.check_dataset(
                dataset, rows.RowRules(True, hh_format, turns, tokenizer, project.chat_template_path)
            )
            every_row_invalid(checked, split, name)
        raise e.located(name, split) from None
    except Exception as e:  # noqa: BLE001 - a stream is first read here: a damaged file fails inside datasets
        if not args.streaming:
            raise
        raise ConfigError(data.unreadable_stream(name, e)) from None
    if m.rows == 0:
        every_row_invalid(rows.RowCheck(len(m.invalid), m.invalid, m.seconds), split, name, tokenizer)
    if mix:  # measured as the pairs its sources are read into (a prompt column): that is no source's own shape
        kind = "message lists" if m.conversational else "plain text"
        m.shape = f"{kind}, each source read in its own shape (its Data line); {m.shape.split('; ', 1)[-1]}"
    print(f"Read as {m.shape}", file=sys.stderr, flush=True)
    for warning in (lengths.missing_bos(m, tokenizer), lengths.unopened_turn(m, tokenizer)):  # the dry run's
        if warning:  # judged on every pair measured here
            warn(warning)
    # The run's data stage's warning of a template that writes today's date (a mixture's load said it already):
    # measured with it, the lengths are that day's, and the cache is keyed on the template, not on the day
    if not mix and (first := rows.first_usable(dataset, hh_format, tokenizer)):
        rows.say_if_dated(*first)
    for i, r in enumerate(mix.with_token_shares(m) if mix else []):  # each source's share, and its own lengths
        spread = lengths.percentiles(m.total[mix.source_of_row[m.index] == i])
        spread = (
            f"p50 {spread['p50']}, p95 {spread['p95']}, max {spread['max']}"
            if spread["max"] is not None
            else "none measured"
        )
        print(f"Source {mixture.describe(r)}; pair lengths {spread}")
    candidates = [*args.candidates, *([current] if current else [])]
    # The model's config, read once for the position cap and the memory line: from the Hub where this machine reaches
    # it and has no copy (a login node), else the local cache; not readable, neither uses it (the memory line says why)
    model = memory.model_config_or_reason(run, local_only=False)
    positions = model_limit(model[0])[0] if model[0] is not None else None
    report = lengths.summarize(
        m,
        target=target,
        candidates=candidates,
        batch_size=batch_size,
        seed=args.seed,
        rows_seen=m.rows + len(m.invalid),
        max_positions=positions,
        truncation_mode=training.truncation_mode,
        dataset=shown,
        split=split,
        revision=args.revision,
        tokenizer=tokenizer_name,
        # the recipe's or --chat_template_path, named as the run's Data line names it (a folder's .jinja file)
        chat_template=chat_template.named(template),
        sample={"rows": args.sample, "seed": args.seed} if args.sample else None,
    )
    if not mix and m.invalid:  # where each listed row is in the user's files ('line 9 of pairs.jsonl'), read once
        listed = report["invalid"]["rows"][: lengths_report.LISTED]
        where = data.row_locations(name, [p["index"] for p in listed], split)
        for p in listed:
            p["where"] = where[p["index"]]
    print(lengths_report.to_markdown(report, current, "--max_length" if args.max_length else "recipe"))
    # The counts training will record at its max_length: `auto`'s is the recommendation; a recipe's or command line's
    # `null` trains unbounded (train_dpo.py --max_length null, without a token budget), cutting nothing.
    unbounded = current is None and not run.max_length_auto and bool(recipe_path or args.max_length)
    at = None if unbounded else current or report["recommended_max_length"]
    cut = cuts.count(m.prompt, m.chosen, m.rejected, at, training.truncation_mode)
    print(f"Cut at {cuts.line(cut)}", file=sys.stderr)
    r = report["recommendation"]
    doubled = r["doubled"]  # None at the model's positions: no longer length a run takes
    longer = (
        f"; {doubled['max_length']} would cover {doubled['coverage']:.1%} for {doubled['compute']:+.1%} packed compute"
        if doubled
        else ""
    )
    print(
        f"Recommended max_length: {r['max_length']} (covers {r['coverage']:.1%} of pairs; target {target:.1%}{longer})"
    )
    if r["capped"]:
        line = lengths.capped_line(r)
        print(line[0].upper() + line[1:])
    named = "--max_length" if args.max_length else "the recipe's max_length"
    over_budget(run, current, named, r["max_length"], unbounded)
    if current is not None:  # the run's refusal of a length that leaves too few pairs anything to learn (its checks)
        try:
            mode, budget = training.truncation_mode, project.max_tokens_per_microbatch
            cuts.check(m.prompt, m.chosen, m.rejected, m.shared, current, mode, "the pairs measured", positions, budget)
            if mix:  # each source of a mixture on its own too
                mix.check_cuts(m, current, mode, positions, budget)
        except ConfigError as e:  # said after the report, which stands, as over_budget says the budget's refusal
            warn(f"training refuses {named} {current:,}: {e}")
    if current is not None and model[0] is not None:  # a length past the model's positions, which the run refuses
        try:  # where the pairs reach past them: every pair measured here is what the run reads from the cache
            check_positions(model[0], tokenizer_name, current, m, whole_split=not args.sample)
        except ConfigError as e:
            warn(f"training refuses {named} {current:,}: {e}")
    longest = None if args.sample else int(m.total.max(initial=0))  # every pair measured: what reaches the model
    report["memory"] = memory_per_gpu(run, [*candidates, r["max_length"]], longest, model)

    if args.json:
        writes.write_text(args.json, json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        lengths_report.plot(m, report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if not args.sample:  # invalid rows listed (--skip-invalid): the rest are the pairs the run keeps, as it skips them
        cache(m, report, tokenizer, dataset_id, identify(), name)
    if training.eval_strategy != "no":  # after the cache: a held-out split the run refuses loses no analysis
        held_out(run, tokenizer, at, None if mixed else pinned, offline.prefetch_command(run))
    if caches := lengths.written_outside(dataset):  # a home quota fills: said, measured
        print(f"Caches: {caches}", file=sys.stderr)
    return 0


def held_out(run, tokenizer, max_length: int | None, revision: str | None, prefetch: str) -> None:
    """The held-out pairs of a recipe that evaluates, read, measured and counted at `max_length` by the run's code: the
    run drops those whose prompt alone fills it (and refuses a length that leaves too few), and says so in this line."""
    from dpotrain import stages

    sources = mixture.parse(mixture.fields_of(run), evaluation=True)
    pins = mixture.pin(sources) if sources else None  # a held-out mixture's Hub sources, at one commit each
    with contextlib.redirect_stdout(sys.stderr):  # what reading says of the rows: stdout is the report's
        pairs = stages.held_out_pairs(run, revision, tokenizer, pins, prefetch)
    _, counted = stages.held_out_cuts(pairs, tokenizer, max_length, run)
    print(f"Held-out pairs at {cuts.line(counted)}", file=sys.stderr)


def over_budget(run, current: int | None, named: str, recommended: int, unbounded: bool = False) -> None:
    """A length reported on that the recipe's token budget cannot hold (`max_tokens_per_microbatch` < 2 x max_length):
    training refuses it before it starts, and `max_length: auto`'s choice too. Said in the run's words, after the
    report, which stands: the budget is the recipe's to raise. `unbounded`: max_length null, which no budget holds
    (reported as cutting nothing, and the run refused it, unsaid)."""
    from dpotrain import resolve

    budget = run.project.max_tokens_per_microbatch
    said = [(current, f"{named} {current:,}")] if current else [(None, f"{named} null")] if unbounded else []
    if recommended != current:
        said.append((recommended, f"the recommended max_length {recommended:,} (and max_length: auto's choice)"))
    for max_length, what in said if budget is not None else []:
        try:
            resolve.check_token_budget(budget, max_length)
        except ConfigError as e:
            warn(f"training refuses {what} with the recipe's max_tokens_per_microbatch: {e}")


def cache(m, report: dict, tokenizer, dataset_id: str, now: str, name: str) -> None:
    """The complete analysis kept for `max_length: auto`, keyed by the data as it was before it was read (`dataset_id`);
    not where the data changed since (`now`): neither key would describe the rows measured."""
    if now != dataset_id:
        warn(
            f"not cached for `max_length: auto`: the data ({name}) changed during the analysis (rows written "
            "to it meanwhile?): the report is of the rows as read; analyse again once the data set is complete"
        )
        return
    try:
        path = lengths.save_cache(m, report, dataset_id, tokenizer)
    except OSError as e:  # a full disk or quota, a read-only home: the report stands, the cache is an extra
        warn(
            f"not cached for `max_length: auto` ({cause(e)}): training measures the split again; make "
            f"room in {lengths.cache_root()}, or set DPOTRAIN_CACHE to a folder that takes it"
        )
    else:
        print(f"cached for `max_length: auto` in training: {path}", file=sys.stderr)


def load(args, name: str, split: str, subset: str | None, revision: str | None, prefetch: str):
    """One data set, and no mixture, at `revision` (a Hub data set's pinned commit). `prefetch`: the command that
    fetches it (`offline.prefetch_command`)."""
    try:
        loaded = data.load_preference_dataset(
            name, split, subset, revision=revision, streaming=args.streaming, split_flag="--split"
        )
    except ConfigError:  # already one line that names the fix
        raise
    except Exception as e:  # noqa: BLE001 - unknown Hub name, no access, offline, unreadable file: one line
        raise ConfigError(f"could not load data set {name!r} (split {split!r}): {cause(e)}") from None
    # A local JSON field whose type differs between rows is read again from the file, each value as written, only in
    # memory (data.exact_mixed_fields): streamed, "42" came back 42 and a valid row was refused as a number
    if args.streaming and data.is_local(name) and loaded.features is not None:
        if mixed := data.mixed_type_columns(loaded):
            raise ConfigError(
                f"--streaming: {name!r} holds values of more than one type in {' and '.join(mixed)} (text in one "
                "row, a number or a list in another), which a stream reads back otherwise than written (text such as "
                '"42" as the number 42): analyse it without --streaming, as training reads it'
            )
    # Offline, datasets reads the copy it prepared last, whatever the commit: refused as the run refuses it, before
    # another commit's lengths are measured and cached for `max_length: auto` under this one's key
    hub_revision.check_loaded(loaded, name, revision, prefetch)
    return loaded, None


def hub_downloads(
    tokenizer: str, revision: str | None, dataset: str, config: str | None, split: str, args
) -> list[str]:
    """What this analysis would download from the Hub: the tokenizer's files (at `revision`) and the data set, where not
    cached."""
    if offline.is_offline():
        return []  # nothing downloads; the libraries read the cache or fail at once
    missing = []
    if offline.is_hub_model(tokenizer) and offline.missing_model_files(tokenizer, revision, weights=False):
        missing.append(f"the tokenizer of {tokenizer!r} is not cached")
    if hub_revision.applies(dataset) and (args.streaming or not offline.cached_dataset(dataset, config, split)[0]):
        missing.append(f"data set {dataset!r} is not cached")
    return missing


def fetch_remedy(tokenizer: str, dataset: str, subset: str | None, recipe_path: str | None, args) -> str:
    """What to do where the Hub's files are out of reach: local files, or the cache filled elsewhere."""
    command = ["python", venv.project_file("scripts/prefetch.py"), *(["--config", recipe_path] if recipe_path else [])]
    if offline.is_hub_model(tokenizer):
        command += ["--model_name_or_path", tokenizer]
    if hub_revision.applies(dataset):
        command += ["--dataset_name", dataset, *(["--revision", args.revision] if args.revision else [])]
        command += ["--dataset_config", subset] if subset else []
    return (
        "pass a local tokenizer folder with --tokenizer PATH (and a local data file), or fill the cache on a machine "
        f"with network (`{shlex.join(command)}`) and run this with HF_HUB_OFFLINE=1"
    )


def memory_per_gpu(run, max_lengths: list[int], longest: int | None, model: tuple) -> dict:
    """Whether each max_length asked about (the recipe's, --candidates, the recommendation) fits the recipe's GPUs, and
    which --sequence_parallel_size carries one that does not (dpotrain/plan/long_traces.py): printed, and returned for
    the JSON report. Planned only for a recipe (its engine, processes and GPU memory)."""
    if run.config_path is None:
        return {"skipped": "no recipe: pass --config to plan memory for its GPUs"}
    from dpotrain import resolve
    from dpotrain.cluster.engine import from_config
    from dpotrain.plan import long_traces

    engine = from_config(run.project.accelerate_config)
    try:
        world, _ = resolve.world_size(run, planning=True, planned=engine)
    except ConfigError as e:  # an accelerate config accelerate refuses (the dry run says so too): the lengths stand
        found = {"skipped": str(e)}
    else:
        found = long_traces.carrying_groups(run, world, engine, max_lengths, longest, model)
    print(long_traces.line(found), file=sys.stderr if "skipped" in found else sys.stdout)
    return found


def sample(dataset, n: int, seed: int):
    """`n` rows drawn with `seed`, kept in data set order, and their original indices."""
    import datasets
    import numpy as np

    if n < 1:
        raise ConfigError(f"--sample must be >= 1 (got {n})")
    if isinstance(dataset, datasets.Dataset):
        if n >= len(dataset):
            return dataset, None
        indices = np.sort(np.random.default_rng(seed).choice(len(dataset), size=n, replace=False))
        return dataset.select(indices), indices
    # Streaming: a seeded reservoir over the whole stream (read, not tokenized), every row as likely as in memory; a
    # shuffle buffer of 10,000 rows drew from the stream's first rows only (a data set sorted by source or length:
    # lengths of its first part, reported as a sample of the whole). Each row's position kept, so messages name it.
    rng, picked, seen = np.random.default_rng(seed), [], 0
    for seen, row in enumerate(dataset, 1):
        if seen <= n:
            picked.append((seen - 1, row))
        elif (slot := rng.integers(seen)) < n:
            picked[slot] = (seen - 1, row)
    picked.sort(key=lambda kept: kept[0])
    # a stream that ends within n was read whole, the complete analysis (as in memory above)
    return datasets.Dataset.from_list([row for _, row in picked]), [i for i, _ in picked] if seen > n else None


if __name__ == "__main__":
    run_command(main)  # Ctrl-C mid-analysis too: one line, nothing cached

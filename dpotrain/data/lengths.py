"""Token lengths of a preference data set exactly as TRL's `DPOTrainer` sees them, and the `max_length` they call for.

Rows are read as training reads them (`rows.read_row`) and tokenized as `DPOTrainer._prepare_dataset` (TRL 1.16)
does: `row_lengths` by the trainer's own calls, one row at a time; method "batched" encodes a batch of rendered texts
in one fast-tokenizer call, each batch checked against `row_lengths` on its first row.

The recommendation is the smallest multiple of 512 leaving `coverage` of the pairs whole. `max_length: auto` reads an
analysis cached by the data set's and tokenizer's identity (not a `Dataset` fingerprint: a dry run without the data
finds it), or analyses the split and caches it (`analyse`). Tables and plot: `lengths_report.py`.
"""

import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import os
import shlex
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import numpy as np

from dpotrain.data import builtin, chat_template, cuts, data, data_identity, hub_revision, model_identity, rows, stops
from dpotrain.data.cuts import STEP, recommend
from dpotrain.data.rows import (
    ROW_COLUMNS,
    InvalidRowError,
    RowFormat,
    check_text_only,
    null_kwargs,
    read_row,
    split_row,
)
from dpotrain.recipe import launcher, upstream
from dpotrain.recipe import records as run_records
from dpotrain.recipe.errors import ConfigError, cause, plural, size, warn
from dpotrain.recipe.writes import folder_bytes, quiet_progress_bars, remove_dead_temporaries, replacing, write_text

# The report's cumulative distribution: common max_length choices, and a thinking data set's tail (16K-32K)
REPORT_LENGTHS = (2048, 4096, 8192, 12288, 16384, 24576, 32768)
PERCENTILES = (50, 90, 95, 99)
DEFAULT_COVERAGE = cuts.COVERAGE  # one default for the analyzer and `max_length: auto`
DEFAULT_BATCH_SIZE = 4  # the padding figures' pairs per device under a token budget, where no recipe says (OLMo 3: 4)


@functools.cache
def analysis_code() -> str:
    """A digest of the code whose numbers an analysis caches: the rows' reading (`rows.READING_MODULES`), the files'
    loading (data) and this module's measuring and recommending (cuts). It keys the cached analyses and their map's
    cache: a hand-bumped version, forgotten after an edit, reused the reports of the code before."""
    return rows.source_digest((*rows.READING_MODULES, sys.modules[__name__], data, cuts))


def _inputs(example: dict) -> list[tuple[object, dict]]:
    """(input, apply_chat_template kwargs) of the three texts DPOTrainer's tokenize_fn tokenizes: prompt (with the
    generation prompt), prompt+chosen, prompt+rejected. Plain text takes no kwargs."""
    # Imported here: trl.data_utils imports datasets, seconds that --help and the early refusals do not need
    from trl.data_utils import is_conversational

    prompt, conversational = example["prompt"], is_conversational(example)
    kwargs = chat_template.template_kwargs(example) if conversational else {}
    first = {"add_generation_prompt": True, **kwargs} if conversational else {}
    return [(prompt, first), (prompt + example["chosen"], kwargs), (prompt + example["rejected"], kwargs)]


def row_lengths(example: dict, tokenizer) -> tuple[int, int, int, int, int, int]:
    """`_split_lengths` of one split row, tokenized by the same calls as DPOTrainer's tokenize_fn."""
    return _split_lengths(*(upstream.tokenize(tokenizer, x, **kw)["input_ids"] for x, kw in _inputs(example)))


def _split_lengths(prompt_ids, chosen_ids, rejected_ids) -> tuple[int, int, int, int, int, int]:
    """(prompt, chosen, rejected, shared, first, shared_end) as TRL splits: the completion starts where the prompt and
    prompt+completion part; `shared`: tokens both completions start with; `first`: the first token's id (-1: none);
    `shared_end`: tokens both whole sequences end with (what keep_end keeps: `cuts.teaching`)."""
    from trl.data_utils import common_prefix_length

    n = min(common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids))
    shared = common_prefix_length(chosen_ids[n:], rejected_ids[n:])  # from the completions' start
    shared_end = common_prefix_length(chosen_ids[::-1], rejected_ids[::-1])  # from the sequences' end
    return n, len(chosen_ids) - n, len(rejected_ids) - n, shared, chosen_ids[0] if chosen_ids else -1, shared_end


def _render(example: dict, tokenizer) -> tuple[str, str, str]:
    """The three texts `row_lengths` tokenizes: chat template rendered (not tokenized) for message lists."""
    return tuple(
        tokenizer.apply_chat_template(x, tokenize=False, **kw) if isinstance(x, list) else x
        for x, kw in _inputs(example)
    )


def encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]`, through the Rust backend directly when there is one (no offsets: faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    if backend is None:
        return tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]
    # What transformers' fast-tokenizer __call__ sets before its own encode_batch (no truncation or padding).
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def _lengths_of_texts(texts: list[tuple[str, str, str]], tokenizer, conversational: bool):
    # apply_chat_template(tokenize=True) adds no special tokens; plain text's tokenizer(text=...) adds them
    ids = encode(tokenizer, [t for row in texts for t in row], add_special_tokens=not conversational)
    return [_split_lengths(*ids[i : i + 3]) for i in range(0, len(ids), 3)]


# --- a whole data set ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Measured:
    """Per-row token counts of the valid rows (in the order analysed) and the rows left out, with why."""

    index: np.ndarray  # the row's index in the data set
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    invalid: list[dict]  # {"index", "column", "problem"}
    conversational: bool
    shape: str = ""  # how the rows were read (shapes.Shape.describe)
    fast_path_mismatches: int = 0  # batches whose fast tokenization disagreed with row_lengths (then measured by it)
    seconds: float = 0.0
    # per pair [tokens both completions start with, tokens both sequences end with] (cuts.teaching: what keep_start and
    # keep_end cut until both sides are the same tokens); None: not measured
    shared: np.ndarray | None = None
    first: np.ndarray | None = None  # each pair's first token id as trained (`missing_bos`); None: not measured
    unopened: np.ndarray | None = None  # 1 where the answer starts with the turn's header (`unopened_turn`)

    @property
    def total(self) -> np.ndarray:
        return self.prompt + np.maximum(self.chosen, self.rejected)

    @property
    def rows(self) -> int:
        return len(self.index)


COUNTS = ("prompt", "chosen", "rejected", "shared", "first", "shared_end")  # `_split_lengths`' order
KEPT = ("shared", "first", "unopened")  # per-pair values a cached analysis keeps beside the lengths
KEY_ARRAY = "key"  # the array of each cached analysis that names its key (its file's name), as the reference cache's
STREAM_BLOCK = 16  # a stream is read this many batches per process at a time (memory bounded, processes busy)


class MeasureStopped(stops.PassStopped):
    """A stop was asked as a run measured every pair (`measure`'s stop_asked): nothing measured is kept."""


class _Refused(Exception):
    """An invalid row met inside `Dataset.map`: (position, column, problem), which pickle back from a worker."""


def _measure_batch(
    batch: dict, positions: list[int], tokenizer, fmt, method, skip_invalid, offset, code, no_kwargs=None
) -> dict:
    """`measure`'s `Dataset.map` function: per row its `COUNTS` (-1: invalid) and problem, and whether the batch fell
    back to `row_lengths`. `code` (`analysis_code`) only keys the map's cache; `no_kwargs`: what a row with a
    null `chat_template_kwargs` is rendered with (`rows.null_kwargs`)."""
    if stops.stopped():  # `stops.stoppable`; the error pickles from a worker
        raise MeasureStopped("stopped as the pairs were measured")
    examples, texts, counts, why = {}, [], {}, {}  # why: each row's problem, None for a valid one
    unopened = {}  # chat_template.answer_problem's judgement of each message pair (`unopened_turn`)
    for position, values in zip(positions, zip(*batch.values(), strict=True), strict=True):
        position += offset
        rendered = {}  # the template's texts, as its check rendered them: not rendered twice
        row = dict(zip(batch, values, strict=True))
        if "chat_template_kwargs" in row and row["chat_template_kwargs"] is None and no_kwargs is not None:
            # as the run's pairs are read (rows.no_null_kwargs): none
            row["chat_template_kwargs"] = no_kwargs
        example, problem = read_row(row, fmt, rendered, position == 0)  # as training
        unopened[position] = int(rendered.get("unopened", False))
        if problem is None:
            example = split_row(example, fmt)
            try:  # the template's refusals are read_row's (chat_template.answer_problem); the tokenizer may refuse
                if method == "batched":
                    done = rendered and tuple(rendered[c] for c in ("prompt", "chosen", "rejected"))
                    texts.append(done or _render(example, tokenizer))
                else:
                    counts[position] = row_lengths(example, tokenizer)
                examples[position] = example
            except Exception as e:  # noqa: BLE001 - the tokenizer's refusal, any kind, is the row's named problem
                problem = ("chosen", f"{type(e).__name__}: {e}")
        if problem and not skip_invalid:
            raise _Refused(position, *problem)
        why[position] = problem
    mismatch = False
    if method == "batched" and examples:
        counts = dict(zip(examples, _lengths_of_texts(texts, tokenizer, fmt.conversational), strict=True))
        first, example = next(iter(examples.items()))
        if counts[first] != row_lengths(example, tokenizer):
            mismatch, counts = True, {p: row_lengths(e, tokenizer) for p, e in examples.items()}
    out = {f"{k}_tokens": [counts[p][n] if p in counts else -1 for p in why] for n, k in enumerate(COUNTS)}
    out["unopened"] = [unopened[p] for p in why]
    out["problem_column"] = [problem and problem[0] for problem in why.values()]
    out["problem"] = [problem and problem[1] for problem in why.values()]
    out["mismatch"] = [mismatch and n == 0 for n in range(len(why))]
    return out


def measure(
    dataset,
    tokenizer,
    *,
    num_proc: int = 1,
    skip_invalid: bool = False,
    method: str = "batched",
    chunk_size: int = 256,
    indices=None,
    progress: bool = False,
    hh_format: str = "messages",
    assistant_turns: str = "final",
    stop_asked=None,
    read: bool = False,
) -> Measured:
    """Token lengths of every row of `dataset` (a `Dataset`, whose map datasets caches, or a streaming one) by
    `Dataset.map` over `num_proc` processes. `indices`: each row's original index when `dataset` is a selection.
    A bad row raises `InvalidRowError` unless `skip_invalid` lists it. `assistant_turns`: the recipe's (`read_row`).
    `stop_asked`: looked at as the rows are measured (`stops.stoppable`), `MeasureStopped` raised once it is true.
    `read`: the rows are the pairs the run read already (`rows.RowFormat.read`), not the user's data set."""
    import datasets

    if method not in ("batched", "reference"):
        raise ValueError(f"method must be 'batched' or 'reference', not {method!r}")
    start = time.perf_counter()
    names = dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)).keys())
    check_text_only(dataset)
    columns = [c for c in ROW_COLUMNS if c in names]
    dataset = dataset.select_columns(columns)
    first = next(iter(dataset), None)
    if first is None:
        raise ConfigError("the data set has no rows")
    fmt = RowFormat.of(first, columns, tokenizer.eos_token, hh_format, tokenizer, assistant_turns, read)
    check_tokenizer(tokenizer, fmt, first)
    kwargs = dict(
        tokenizer=tokenizer, fmt=fmt, method=method, skip_invalid=skip_invalid, offset=0, code=analysis_code()
    )
    try:
        with stops.stoppable(stop_asked):
            if isinstance(dataset, datasets.Dataset):
                with nullcontext() if progress else quiet_progress_bars():
                    counted = _map(dataset, kwargs, num_proc, chunk_size, "Tokenizing")
            else:
                counted = _map_stream(dataset, kwargs, num_proc, chunk_size, progress)
    except _Refused as e:  # the first invalid row: by its index in the user's data set
        position, column, problem = e.args
        raise InvalidRowError(int(indices[position]) if indices is not None else position, column, problem) from None
    c = counted.with_format("numpy")[:]
    index = np.asarray(indices if indices is not None else range(len(counted)), dtype=np.int64)
    valid = c["prompt_tokens"] >= 0
    bad = ~valid
    mismatches = int(c["mismatch"].sum())
    if mismatches:
        warn(
            f"the batched tokenization differed from TRL's in {plural(mismatches, 'chunk')}; "
            f"{'it was' if mismatches == 1 else 'those were'} measured one row at a time (exact, slower)"
        )
    counts = {k: c[f"{k}_tokens"][valid] for k in COUNTS}
    counts["shared"] = np.stack([counts["shared"], counts.pop("shared_end")], axis=1)  # Measured.shared's two columns
    return Measured(
        index=index[valid],
        **counts,
        unopened=c["unopened"][valid],
        invalid=[
            {"index": int(i), "column": column, "problem": problem}
            for i, column, problem in zip(index[bad], c["problem_column"][bad], c["problem"][bad], strict=True)
        ],
        conversational=fmt.conversational,
        shape=fmt.shape.describe(
            tokenizer.name_or_path, getattr(tokenizer, "chat_template_file", None), assistant_turns=assistant_turns
        ),
        fast_path_mismatches=mismatches,
        seconds=time.perf_counter() - start,
    )


def _map(dataset, kwargs: dict, num_proc: int, chunk_size: int, desc: str | None = None):
    """`_measure_batch` over `dataset` (`measure`'s columns out), in `num_proc` processes, none without a batch."""
    import datasets

    features = datasets.Features({f"{k}_tokens": datasets.Value("int64") for k in COUNTS})  # first_tokens: an id
    kinds = {"problem": "string", "problem_column": "string", "mismatch": "bool", "unopened": "int8"}
    features.update({column: datasets.Value(kind) for column, kind in kinds.items()})
    processes = min(num_proc, -(-len(dataset) // chunk_size))
    # Cached in datasets' cache, never beside the user's own saved data set (maybe read-only or shared)
    files, cache = dataset.cache_files, Path(datasets.config.HF_DATASETS_CACHE).resolve()
    in_cache = bool(files) and Path(files[0]["filename"]).resolve().is_relative_to(cache)
    # A multiprocess map swaps in a copy of os.environ (TOKENIZERS_PARALLELISM=false): the original put back
    environ = os.environ
    try:
        with mock.patch.dict(os.environ):
            return dataset.map(
                _measure_batch,
                batched=True,
                batch_size=chunk_size,
                with_indices=True,
                fn_kwargs=kwargs | {"no_kwargs": null_kwargs(dataset.features)},
                remove_columns=dataset.column_names,
                features=features,
                num_proc=processes if processes > 1 else None,
                keep_in_memory=not in_cache,
                desc=desc,
            )
    finally:
        os.environ = environ  # noqa: B003 - the process's own object back, not a new environment


def _map_stream(stream, kwargs: dict, num_proc: int, chunk_size: int, progress: bool):
    """A streaming data set, mapped in in-memory blocks: a stream larger than memory is never read far ahead."""
    from datasets import Dataset, concatenate_datasets
    from tqdm.auto import tqdm

    rows, done, size = iter(stream), [], chunk_size * num_proc * STREAM_BLOCK
    with tqdm(total=_known_rows(stream), unit="rows", desc="Tokenizing", disable=not progress) as bar:
        while block := list(itertools.islice(rows, size)):
            with quiet_progress_bars():
                block = Dataset.from_list(block, features=stream.features)
                done.append(_map(block, kwargs | {"offset": sum(map(len, done))}, num_proc, chunk_size))
            bar.update(len(block))
    return concatenate_datasets(done)


def check_tokenizer(tokenizer, fmt: RowFormat, first: dict | None = None) -> None:
    """What the rows need of the tokenizer, refused before the model loads: a chat template for message lists, an EOS
    token for plain-text completions (DPOTrainer's add_eos), plain text that would not train two BOS or EOS."""
    if not fmt.conversational:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"the tokenizer of {tokenizer.name_or_path} has no EOS token, and the data set's rows are plain text, "
                "whose completions the trainer ends with it: set eos_token in its tokenizer_config.json, or give the "
                "pairs as message lists (the chat template then ends each answer)"
            )
        _doubled_specials(tokenizer, first or {})
        return
    chat_template.require(tokenizer, fmt.shape.name)


def _doubled_specials(tokenizer, first: dict) -> None:
    """TRL tokenizes plain text with the tokenizer's special tokens: a BOS written in the prompt under a tokenizer that
    adds it, or an EOS it appends after TRL's add_eos, trains doubled. Judged on the first row."""
    bare, ids = tokenizer("a", add_special_tokens=False)["input_ids"], tokenizer("a")["input_ids"]
    start = next((n for n in range(len(ids)) if ids[n : n + len(bare)] == bare), 0)
    added_before, added_after = ids[:start], ids[start + len(bare) :]
    bos, eos, name = tokenizer.bos_token, tokenizer.eos_token, tokenizer.name_or_path
    text = first.get("prompt") if isinstance(first.get("prompt"), str) else first.get("chosen")
    if bos and tokenizer.bos_token_id in added_before and isinstance(text, str) and text.startswith(bos):
        raise ConfigError(
            f"the prompts begin with the BOS token {bos!r}, and the tokenizer of {name} adds it itself, so every "
            f"sequence would start with two: remove {bos!r} from the start of the prompts"
        )
    if tokenizer.eos_token_id in added_after:
        raise ConfigError(
            f"the tokenizer of {name} appends its EOS token {eos!r} to every text, and the trainer ends each "
            f"plain-text completion with it as well, so every answer would end in two: remove {eos!r} from the "
            "post_processor in its tokenizer.json, or give the pairs as message lists (the chat template then ends "
            "each answer)"
        )


NO_BOS = (
    "the chat template adds no BOS token, though the tokenizer adds one to plain text: sequences train without it (as "
    "they will be served with this template); add {{ bos_token }} at the template's start to train with it"
)


def missing_bos(m: Measured | None, tokenizer) -> str | None:
    """`NO_BOS` where message pairs train without the BOS their tokenizer adds to plain text: TRL encodes the rendered
    template without special tokens, so only the template writes BOS. Not refused: inference starts so too. Judged on
    every pair's first token (`m.first`): a template may write BOS for some pairs only; then it says how many."""
    bos = tokenizer.bos_token_id
    if m is None or m.first is None or bos is None or tokenizer("x")["input_ids"][:1] != [bos]:
        return None  # not measured, or the tokenizer adds no BOS to plain text (OLMo 3's): nothing is missing
    without = int(np.count_nonzero(m.first != bos))  # plain text starts with the tokenizer's own BOS: none here
    if without in (0, len(m.first)):
        return NO_BOS if without else None
    return NO_BOS.replace("no BOS token,", f"no BOS token to {without:,} of {plural(len(m.first), 'pair', ',')},", 1)


UNOPENED = (
    "the chat template's add_generation_prompt adds nothing, so {pairs} start their answers with the template's "
    "{header}, which trains as the answers' first tokens (and counts in their length, which sigmoid_norm divides by): "
    "give a chat template whose add_generation_prompt opens the assistant turn (chat_template_path)"
)


def unopened_turn(m: Measured | None, tokenizer) -> str | None:
    """`UNOPENED` where message pairs' answers start with the assistant turn's header: a template that ignores
    add_generation_prompt leaves it to the answer. Not refused. Judged on every pair measured."""
    if m is None or m.unopened is None or not (count := int(np.count_nonzero(m.unopened == 1))):
        return None
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    try:  # the header as a pair of its own shows it (the pairs' own are not kept)
        prompt = tokenizer.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(turns, tokenize=False)
        header = repr(whole[len(prompt) : whole.index("Hello.", len(prompt))]) if whole.startswith(prompt) else ""
    except Exception:  # noqa: BLE001 - a template that refuses this pair: the count alone
        header = ""
    pairs = f"{count:,} of {plural(len(m.unopened), 'pair', ',')}"
    return UNOPENED.format(pairs=pairs, header=f"assistant header ({header})" if header else "assistant header")


def _known_rows(dataset) -> int | None:
    try:
        return dataset.info.splits[dataset.split].num_examples
    except (AttributeError, KeyError, TypeError):
        return None


# --- the numbers -----------------------------------------------------------------------------------------------------
def percentiles(values: np.ndarray) -> dict:
    """p50/p90/p95/p99/max in tokens: the smallest length that at least that share of rows does not exceed."""
    if len(values) == 0:
        return {f"p{q}": None for q in PERCENTILES} | {"max": None}
    out = {f"p{q}": int(np.percentile(values, q, method="inverted_cdf")) for q in PERCENTILES}
    return out | {"max": int(values.max())}


def coverage(total: np.ndarray, max_length: int) -> float:
    """Fraction of rows whose prompt + longer completion fits in `max_length` (nothing truncated)."""
    return float(np.count_nonzero(total <= max_length) / len(total))


def padding(
    m: Measured, max_length: int, batch_size: int, seed: int | None = None, mode: str = "keep_start"
) -> tuple[int, float, float]:
    """(padded positions, padding fraction, padding per pair) in TRL's DataCollatorForPreference at `max_length`,
    batches of 2 * `batch_size` sequences padded to the longest. `seed`: the trainer's shuffled order; None: as is."""
    a, b = _sequences(m, max_length, mode)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(a))
        a, b = a[order], b[order]
    if len(a) == 0:
        return 0, 0.0, 0.0
    # a batch of more pairs than there are is one batch of them all (past 2**63, --batch-size was a traceback)
    starts = np.arange(0, len(a), min(batch_size, len(a)))
    longest = np.maximum.reduceat(np.maximum(a, b), starts)
    padded = int((2 * np.diff(np.append(starts, len(a))) * longest).sum())
    real = int((a + b).sum())  # the packed positions (`packed_positions`), in any order
    return padded, 1 - real / padded, (padded - real) / len(a)


def packed_positions(m: Measured, max_length: int, mode: str = "keep_start") -> tuple[int, int]:
    """Positions the packed forward runs over the pairs the trainer keeps at `max_length`: (unshared: (P + C) + (P + R),
    each cut at `max_length`; shared prompt: less one prompt per pair that keeps it whole)."""
    unshared = int(sum(s.sum() for s in _sequences(m, max_length, mode)))
    whole = m.prompt < max_length if mode == "keep_start" else m.total <= max_length
    return unshared, unshared - int(m.prompt[whole].sum())


def _sequences(m: Measured, max_length: int, mode: str = "keep_start") -> tuple[np.ndarray, np.ndarray]:
    """Each kept pair's prompt + chosen and prompt + rejected, cut at `max_length` (keep_start drops full prompts)."""
    kept = ~cuts.drops(m.prompt, max_length, mode)
    return tuple(np.minimum(m.prompt[kept] + side[kept], max_length) for side in (m.chosen, m.rejected))


def candidate(m: Measured, max_length: int, batch_size: int, seed: int, mode: str = "keep_start") -> dict:
    counted = cuts.count(m.prompt, m.chosen, m.rejected, max_length, mode)  # as training counts them
    padded, shuffled, wasted = padding(m, max_length, batch_size, seed, mode)
    unshared, shared = packed_positions(m, max_length, mode)
    return {
        "coverage": coverage(m.total, max_length),
        "truncated": counted["truncated"],
        "dropped": counted["dropped"],
        # Packed positions; `relative` and `relative_shared_prompt` are filled in by `summarize`
        "compute": {"positions": unshared, "positions_shared_prompt": shared},
        "padding": {
            "batch_size": batch_size,
            "padded": shuffled,  # the trainer shuffles
            "padded_dataset_order": padding(m, max_length, batch_size, None, mode)[1],
            "packed": 0.0,
            "padded_positions": padded,
            "packed_positions": unshared,
            "wasted_per_pair": wasted,
        },
    }


def recommendation(
    m: Measured, target: float = DEFAULT_COVERAGE, max_positions: int | None = None, truncation_mode: str = "keep_start"
) -> dict:
    """The recommended max_length (`recommend`) with the compute the next shorter multiple of 512 saves and doubling
    adds. Capped at `max_positions` (`capped`); raised where fewer than half the pairs would keep anything to learn,
    which training refuses (`raised`)."""
    total, mode = m.total, truncation_mode
    best = covering = recommend(total, target)
    # A low target may be met where most prompts alone fill max_length (cuts.check refuses): the next that teaches
    while best < total.max() and cuts.teaching(m.prompt, m.shared, best, mode)[0] < cuts.TEACHING * m.rows:
        best += STEP
    uncapped = cap = best
    if max_positions and best > max_positions:
        cap = int(max_positions)
        # no length the model takes keeps a pair: nothing to recommend or compare to
        if mode == "keep_start" and not np.any(m.prompt < cap):
            raise ConfigError(
                f"every one of the {m.rows:,} pairs measured has a prompt that alone fills the model's {cap:,} "
                f"positions (max_position_embeddings; the shortest prompt is {int(m.prompt.min()):,} tokens), so "
                "the trainer would drop them all at any max_length the model takes: shorten the prompts or remove "
                "these pairs, or train a model with more positions"
            )
        cuts.check(m.prompt, m.chosen, m.rejected, m.shared, cap, mode, "the data measured", cap)
        best = cap
        # Where every pair longer than the cap is dropped there, the smallest length keeping the others whole trains
        # the same tokens
        if mode == "keep_start" and not np.any((total > cap) & (m.prompt < cap)):
            best = min(cap, recommend(total, coverage(total, cap)))
    at_best = packed_positions(m, best, mode)

    def neighbour(n: int) -> dict:
        unshared, shared = packed_positions(m, n, mode)
        return {
            "max_length": n,
            "coverage": coverage(total, n) if n > 0 else 0.0,
            "compute": unshared / at_best[0] - 1,  # relative change of packed compute against the recommended
            "compute_shared_prompt": shared / at_best[1] - 1,
        }

    counted = cuts.count(m.prompt, m.chosen, m.rejected, best, mode)
    # a longer length to compare with: doubled, within the model's positions (a run refuses one past them)
    top = min(2 * best, max_positions or 2 * best)
    r = {
        "rule": f"smallest multiple of {STEP} leaving at least target_coverage of pairs whole",
        "target_coverage": target,
        "max_length": best,
        "coverage": coverage(total, best),
        "truncated": counted["truncated"],
        "dropped": counted["dropped"],
        "lower": neighbour(best - STEP),
        "doubled": neighbour(top) if top > best else None,
        "capped": None,
        "raised": None,
        "truncation_mode": mode,
    }
    if cap != uncapped:  # both before the reason, which says what the length is
        r["capped"] = {"max_position_embeddings": cap, "uncapped": uncapped}
    if uncapped != covering:
        r["raised"] = {"from": covering, "teaching": cuts.teaching(m.prompt, m.shared, covering, mode)[0]}
    r["reason"] = _reason(r, m.rows)
    if r["raised"]:
        teach = r["raised"]["teaching"]
        r["reason"] += (
            f"; raised from {covering:,}, the smallest multiple reaching the target, where only {teach:,} of "
            f"{m.rows:,} pairs keep anything to learn (their prompts alone fill it): training refuses fewer than "
            f"{cuts.TEACHING:.0%}"
        )
    if r["capped"]:
        r["reason"] += f"; {capped_line(r)}"
    return r


def capped_line(r: dict) -> str:
    """Why a capped recommendation is the length it is (`r`: a `recommendation` with `capped`)."""
    cap, best = r["capped"]["max_position_embeddings"], r["max_length"]
    line = (
        f"capped at the model's {cap:,} positions (max_position_embeddings): {r['target_coverage']:.1%} coverage "
        f"would need {r['capped']['uncapped']:,}, longer than the model can take"
    )
    if best < cap:
        line += (
            f"; {best:,} trains the same tokens: it leaves the same pairs whole ({r['coverage']:.1%}), and the pairs "
            "past it are dropped at any length the model takes (their prompts alone fill its positions)"
        )
    return line


def summarize(
    m: Measured,
    *,
    target: float = DEFAULT_COVERAGE,
    candidates=(),
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 42,
    rows_seen: int | None = None,
    max_positions: int | None = None,
    truncation_mode: str = "keep_start",
    **about,
) -> dict:
    """The JSON report. `about`: what was analysed (dataset, split, tokenizer, ...), copied in as given."""
    if m.rows == 0:
        raise ConfigError(f"no valid rows to analyse ({len(m.invalid)} invalid)")
    total = m.total
    chosen = recommendation(m, target, max_positions, truncation_mode)
    best = chosen["max_length"]
    shown = sorted(set(REPORT_LENGTHS) | {int(c) for c in candidates})
    lengths = sorted(set(shown) | {best} | ({chosen["doubled"]["max_length"]} if chosen["doubled"] else set()))
    report = {
        **about,
        "rows": m.rows,
        "format": "messages" if m.conversational else "text",
        "shape": m.shape,
        "total": percentiles(total),
        "prompt": percentiles(m.prompt),
        "chosen": percentiles(m.chosen),
        "rejected": percentiles(m.rejected),
        "coverage": {str(n): coverage(total, n) for n in shown},
        "candidates": {str(n): candidate(m, n, batch_size, seed, truncation_mode) for n in lengths},
        "recommended_max_length": best,
        "recommendation": chosen,
        "invalid": {"count": len(m.invalid), "rows": m.invalid},
        "fast_path_mismatches": m.fast_path_mismatches,
        "seconds": round(m.seconds, 2),
    }
    reference = report["candidates"][str(best)]["compute"]
    for compute in (c["compute"] for c in report["candidates"].values()):
        compute["relative"] = compute["positions"] / reference["positions"]
        compute["relative_shared_prompt"] = compute["positions_shared_prompt"] / reference["positions_shared_prompt"]
    if rows_seen is not None:
        report["rows_seen"] = rows_seen
    return report


def _reason(r: dict, rows: int) -> str:
    lower, doubled = r["lower"], r["doubled"]
    below = (
        f"{lower['max_length']:,} would leave {lower['coverage']:.1%} whole for {abs(lower['compute']):.1%} less "
        "compute"  # abs: an exact 0 negated printed "-0.0% less"
        if lower["max_length"] > 0
        else f"no smaller multiple of {STEP} exists"
    )
    target = f"{r['target_coverage']:.1%} of pairs whole"
    lead = f"the smallest multiple of {STEP} that leaves at least {target}"
    if short_of_target(r):
        lead = f"within the model's positions, below the target of {target}"
    elif r.get("raised"):  # the smallest multiple reaching the target is a shorter one (said after)
        lead = f"the smallest multiple of {STEP} that leaves at least {target} and half the pairs anything to learn"
    cut, dropped = r["truncated"], r["dropped"]
    where = "their start (keep_end)" if r.get("truncation_mode") == "keep_end" else "the end"  # the collator's cut
    reason = (
        f"max_length={r['max_length']:,} is {lead}: {r['coverage']:.1%} of {rows:,} pairs fit untruncated ({below}); "
        f"{plural(cut, 'pair', ',')} ({cut / rows:.1%}) {'is' if cut == 1 else 'are'} cut at {where} and {dropped:,} "
        f"dropped by the trainer because {'its' if dropped == 1 else 'their'} prompt alone fills max_length"
    )
    if doubled is None:  # at the model's positions: no longer length to offer
        return reason
    more = doubled["coverage"] - r["coverage"]
    return (
        f"{reason}. Packed, a longer max_length costs only the extra tokens of the longer pairs: "
        f"{longer(r)} would leave {more:.1%} more of the pairs whole for {doubled['compute']:+.1%} "
        f"packed compute ({doubled['compute_shared_prompt']:+.1%} with the prompt computed once per pair)"
    )


def short_of_target(r: dict) -> bool:
    """Whether a recommendation leaves fewer pairs whole than its target asks: capped at the model's positions
    (`capped_line` says why)."""
    return bool(r.get("capped")) and r["coverage"] < r["target_coverage"]


def longer(r: dict) -> str:
    """The longer length a recommendation is compared with, as said: doubled, or the model's positions where the
    doubling would reach past them."""
    n = r["doubled"]["max_length"]
    return f"doubling to {n:,}" if n == 2 * r["max_length"] else f"raising it to {n:,} (the model's positions)"


# --- max_length: auto, and its cache ---------------------------------------------------------------------------------
def load_tokenizer(
    name_or_path: str,
    revision: str | None = None,
    chat_template_path: str | None = None,
    local_files_only: bool = False,
    trust_remote_code: bool = False,
):
    """The tokenizer every stage and tool uses (`builtin:` built locally), with the recipe's chat template."""
    from transformers import AutoTokenizer

    if builtin.is_builtin(name_or_path):
        name_or_path = builtin.materialize_model(name_or_path)
    check_tokenizer_folder(name_or_path)
    check_sentencepiece(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name_or_path, revision=revision, local_files_only=local_files_only, trust_remote_code=trust_remote_code
        )
    except ValueError:
        check_bpe_files(name_or_path)
        raise
    except Exception as e:  # transformers reads config.json too (AutoConfig): a value it refuses is no ValueError
        if (refused := refused_config(name_or_path, e)) is None:
            raise
        raise refused from None
    return chat_template.apply(tokenizer, chat_template_path)


def refused_config(name: str, error: BaseException) -> ConfigError | None:
    """The one line for a config.json value transformers refuses (a quoted `"false"` or `"4096"` where it takes
    true/false or a number, `layer_types` of another length than `num_hidden_layers`): huggingface_hub's
    StrictDataclassError, which no except naming the model caught (a traceback from the tokenizer's load, the run's,
    the dry run's and the analyzer's alike); None for any other error."""
    from huggingface_hub.errors import StrictDataclassError

    if not isinstance(error, StrictDataclassError):
        return None
    import transformers

    return ConfigError(
        f"{name}: transformers {transformers.__version__} refuses a value of its config.json "
        f"({cause(error.__cause__ or error)}): write it as the field takes it (true/false and numbers unquoted), or "
        "copy config.json again from where the model came from"
    )


def recipe_tokenizer(recipe, model_path: str | None = None, local_files_only: bool = False):
    """`load_tokenizer` for a parsed recipe (`model_path`: the folder its model was materialized to)."""
    model, template = recipe.model, recipe.project.chat_template_path
    name = model_path or model.model_name_or_path
    return load_tokenizer(name, model.model_revision, template, local_files_only, recipe.training.trust_remote_code)


# Files of which a saved tokenizer has at least one (fast or slow, BPE or SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def holds_no_tokenizer(name_or_path: str) -> bool:
    """A local model folder with a config.json and no tokenizer file (configs/models/*: a shape, to plan memory)."""
    path = Path(name_or_path).expanduser()
    return (path / "config.json").is_file() and not any((path / f).is_file() for f in TOKENIZER_FILES)


def check_tokenizer_folder(name_or_path: str) -> None:
    """Refuses a model folder without a tokenizer in one line (transformers' error names neither folder nor fix)."""
    if holds_no_tokenizer(name_or_path):
        raise ConfigError(
            f"model folder {name_or_path!r} holds no tokenizer (config.json alone: a model's shape, enough to plan "
            "memory, not to tokenize): pass --model_name_or_path your model's Hub name (org/model) or the folder "
            "save_pretrained wrote, with its tokenizer.json"
        )


def check_sentencepiece(name_or_path: str) -> None:
    """A SentencePiece tokenizer.model without tokenizer.json needs sentencepiece, not installed: transformers then
    reads it as tiktoken's and says to install tiktoken. (A real tiktoken file, Llama 3's, is left to transformers.)"""
    path = Path(name_or_path).expanduser()
    if (path / "tokenizer.json").is_file() or importlib.util.find_spec("sentencepiece") is not None:
        return
    for name in ("tokenizer.model", "spiece.model"):
        if (path / name).is_file():
            with open(path / name, "rb") as f:
                first = f.readline(200).split()
            if len(first) == 2 and first[1].isdigit():  # tiktoken's
                return
            raise ConfigError(
                f"model folder {name_or_path!r} holds its tokenizer as a SentencePiece {name} alone (no "
                "tokenizer.json), which transformers reads with the sentencepiece package, not installed here: pip "
                "install sentencepiece"
            )


def check_bpe_files(name_or_path: str) -> None:
    """A folder whose tokenizer is vocab.json and merges.txt alone (no tokenizer.json, as older tokenizers were saved):
    transformers builds it only where its tokenizer class is the model type's own, else raises a ValueError that says
    to install sentencepiece or tiktoken (and the run took the files for damaged). Its class writes tokenizer.json."""
    import transformers

    path = Path(name_or_path).expanduser()
    if (path / "tokenizer.json").is_file() or not all((path / f).is_file() for f in ("vocab.json", "merges.txt")):
        return
    try:
        kind = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class") or "GPT2Tokenizer"
    except (OSError, ValueError):
        kind = "GPT2Tokenizer"
    folder = shlex.quote(str(path))
    raise ConfigError(
        f"model folder {name_or_path!r} holds its tokenizer as vocab.json and merges.txt alone (no tokenizer.json), "
        f"from which transformers {transformers.__version__} builds no tokenizer for this model's type (it needs a "
        "tokenizer.json): write one with the tokenizer's own class: python -c \"import sys; from transformers import "
        f'{kind} as T; T.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1])" {folder}'
    )


def dataset_identity(
    name: str,
    split: str = "train",
    config: str | None = None,
    revision: str | None = None,
    local_only: bool = False,
    hh_format: str = "messages",
    assistant_turns: str = "final",
) -> str:
    """What a cached report is valid for: a local data set's files and configuration, or a Hub data set's commit (else
    the revision name), `hh_format` (it reads HH-RLHF strings into other tokens) and `assistant_turns` (`turns_key`)."""
    reading = ("" if hh_format == "messages" else f":hh-{hh_format}") + turns_key(assistant_turns)
    path = Path(name).expanduser()
    if data.is_local(name):  # the files the split is read from (data_identity.files: not a run folder beside them)
        stamp = hashlib.sha256()
        for relative, f in sorted((data_identity.files(name, split) or {}).items()):
            stamp.update(f"{relative if f != path else ''}:{data_identity.stamp(f)};".encode())
        named = f":{config}" if config else ""  # none: the key as it was before configurations were told apart
        return f"local:{path.resolve()}{named}:{split}:{stamp.hexdigest()[:16]}{reading}"
    commit = hub_revision.commit(name, revision, local_only=local_only) or revision or "main"
    return f"hub:{name}:{config or 'default'}:{split}@{commit}{reading}"


def turns_key(assistant_turns: str) -> str:
    """The cache key's part for `assistant_turns`: `all` drops a pair with an empty earlier answer that `final` keeps
    (`rows.read_row`), so the two measure different rows and share no cache. Empty for `final`, the key as it was
    before the rows check read it: caches written for `final` recipes keep their keys and stay found."""
    return ":turns-all" if assistant_turns == "all" else ""


def tokenizer_identity(tokenizer) -> dict:
    """The tokenizer's name, a hash of everything that decides its ids, and the chat template text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # its JSON: vocab, merges, normalizer, ..., added tokens
    content = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    template = tokenizer.chat_template
    identity = {
        "name_or_path": model_identity.cache_name(tokenizer.name_or_path),
        "sha256": hashlib.sha256((content + str(tokenizer.eos_token)).encode()).hexdigest(),
        "chat_template": template if isinstance(template, str) else json.dumps(template, sort_keys=True),
    }
    # tokenizer_config.json's, outside the backend's JSON: special tokens written in the text are tokenized as text
    # (more tokens), by the trainer too. Keyed only where set, so that the analyses cached before stay found.
    if getattr(tokenizer, "split_special_tokens", False):
        identity["split_special_tokens"] = True
    if code := _own_code(tokenizer):  # the same files tokenize otherwise through it (trust_remote_code) than without
        identity["own_code"] = code
    return identity


def _own_code(tokenizer) -> dict[str, str] | None:
    """sha256 of each file of the tokenizer's own code (its class, loaded with trust_remote_code from the copy
    transformers wrote in its modules cache, and the files that imports relatively); None for transformers' own."""
    import inspect

    cls = type(tokenizer)
    if not cls.__module__.startswith("transformers_modules."):
        return None
    source = inspect.getsourcefile(cls)
    return model_identity.module_digests([source], Path(source).parent) if source else None


CACHE_FOLDERS = ("lengths", "reference")  # what this project writes in DPOTRAIN_CACHE: nothing else there is its


def cache_root() -> Path:
    """Where this project caches what it computed (length reports, reference log-probs)."""
    root = os.environ.get("DPOTRAIN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "dpotrain"


def written_outside(*read) -> str | None:
    """What reading and measuring the pairs `read` (data sets, None for one not loaded) wrote outside the run's folder,
    for a summary's one row: datasets' Arrow copy and maps, and this project's cache; None where neither holds any."""
    import datasets

    root = Path(datasets.config.HF_DATASETS_CACHE).resolve()
    files = [
        Path(f["filename"]).resolve() for d in read if d is not None for f in getattr(d, "cache_files", None) or []
    ]
    folders = sorted({f.parent for f in files if f.is_relative_to(root)})
    said = []
    if folders:
        where = str(folders[0]) if len(folders) == 1 else f"{len(folders)} folders under {root}"
        said.append(
            f"{size(folder_bytes(*folders))} in {where} (datasets' copy of the pairs as Arrow, made at their first "
            "read, and its maps: HF_DATASETS_CACHE or HF_HOME places it elsewhere)"
        )
    own = cache_root()
    # Its own folders there, not the whole: DPOTRAIN_CACHE may be a folder other projects cache in too (~/.cache),
    # whose files were counted as this project's, all of them walked at each start.
    if written := folder_bytes(*(own / name for name in CACHE_FOLDERS)):
        said.append(
            f"{size(written)} in {own} (this project's length analyses and reference log-probs: DPOTRAIN_CACHE "
            "places it elsewhere)"
        )
    return "; ".join(said) or None


def _cached_at(dataset_id: str, tokenizer, cache_dir: str | Path | None) -> tuple[Path, dict]:
    """Where the analysis of this data set with this tokenizer is cached (`.npz`, `.json` beside it), and its key."""
    identity = {"dataset": dataset_id, "tokenizer": tokenizer_identity(tokenizer), "code": analysis_code()}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / CACHE_FOLDERS[0]
    return folder / key, identity


def _remove_killed_writes(at: Path) -> None:
    """Removes what killed writes of this key left, of this host's gone writers only (another may be writing now)."""
    for path in remove_dead_temporaries(at.parent, [at.with_suffix(".npz").name, at.with_suffix(".json").name]):
        print(
            f"Removed {path}: left by a write to the length-analysis cache killed midway (its process is gone)",
            file=sys.stderr,
            flush=True,
        )


def save_cache(m: Measured, report: dict, dataset_id: str, tokenizer, cache_dir: str | Path | None = None) -> Path:
    """Keep a full analysis (per-row lengths + report) for later runs and dry runs; returns the report path."""
    at, identity = _cached_at(dataset_id, tokenizer, cache_dir)
    _remove_killed_writes(at)  # the analyzer saves without looking the key up first
    # Renamed into place: ranks may race here. The lengths first: a report is only ever found beside its lengths.
    with replacing(at.with_suffix(".npz"), "wb") as f:
        kept = {k: getattr(m, k) for k in KEPT if getattr(m, k) is not None}
        # Its key inside: a file copied over another key's name (a cache restored from a backup) is not read as
        # that data set's lengths (a run's `max_length: auto` chose from 24 other pairs, in silence).
        key = {KEY_ARRAY: np.asarray(at.name)}
        # Each pair by its place among the pairs the run keeps: the rows `skip_invalid` drops (which the analyzer lists
        # by their index in the file) are not in the run's data set, whose pairs these lengths are, in order
        index = np.arange(m.rows, dtype=np.int64)
        np.savez(f, **key, index=index, prompt=m.prompt, chosen=m.chosen, rejected=m.rejected, **kept)
    return write_text(at.with_suffix(".json"), json.dumps({**report, "cache": identity}, indent=1) + "\n")


def cached_measure(dataset_id: str, tokenizer, cache_dir: str | Path | None = None) -> tuple[Measured, Path] | None:
    """The per-row lengths cached for this data set, tokenizer and chat template, and its report's path; or None."""
    at, _ = _cached_at(dataset_id, tokenizer, cache_dir)
    _remove_killed_writes(at)
    report_path, lengths_path = at.with_suffix(".json"), at.with_suffix(".npz")
    if not report_path.exists():
        return None

    def lengths(path):
        with run_records.npz(path) as z:  # a flipped bit in its zip directory, a zeroed file: damage, no crash
            kept = {k: z[k] for k in KEPT if k in z.files}
            key = str(z[KEY_ARRAY]) if KEY_ARRAY in z.files else None  # None: written before files named their key
            return key, Measured(z["index"], z["prompt"], z["chosen"], z["rejected"], [], True, **kept)

    again = "its lengths are measured again by the next analysis (`max_length: auto`, scripts/analyze_dataset.py)"
    other = "the lengths of cache key {}, another data set, tokenizer or chat template than its name's: a file copied"
    measured = run_records.read_cache(lengths_path, lengths, "length", again, at.name, other + " in from another")
    return None if measured is None else (measured, report_path)


def analyse(
    dataset,
    tokenizer,
    coverage: float,
    dataset_id: str,
    cache_dir: str | Path | None = None,
    *,
    progress: bool = True,
    max_positions: int | None = None,
    truncation_mode: str = "keep_start",
    stop_asked=None,
) -> tuple[Measured, dict]:
    """Every pair's lengths, measured and cached, and the `max_length: auto` answer from them. `stop_asked`: a run's
    stop, looked at as the pairs are measured (`MeasureStopped`: nothing is cached)."""
    m = measure(dataset, tokenizer, num_proc=available_cpus(), progress=progress, stop_asked=stop_asked)
    about = {"dataset": dataset_id, "tokenizer": tokenizer.name_or_path}
    report = summarize(m, target=coverage, max_positions=max_positions, truncation_mode=truncation_mode, **about)
    try:
        path = save_cache(m, report, dataset_id, tokenizer, cache_dir)
    except OSError as e:  # a full disk or quota, a read-only cache: the run has its answer; the cache is an extra
        warn(
            f"the length analysis was not cached ({cause(e)}): the next run measures the split again; make "
            f"room in {cache_dir or cache_root()}, or set DPOTRAIN_CACHE to a folder that takes it"
        )
        path = None
    return m, _resolution(m, coverage, path, False, max_positions, truncation_mode)


def resolution_of(
    found: tuple[Measured, Path], coverage: float, max_positions: int | None = None, truncation_mode: str = "keep_start"
) -> dict:
    """The `max_length: auto` answer from a cached analysis (`cached_measure`'s)."""
    return _resolution(found[0], coverage, found[1], True, max_positions, truncation_mode)


# Shared by analyse and resolution_of, not one calling the other: tests count calls to either (a run decides once).
def _resolution(
    m: Measured, target: float, report_path: Path | None, cached: bool, max_positions: int | None, mode: str
) -> dict:
    """The `max_length: auto` answer: the recommendation's numbers and where its report is (None: not cached)."""
    r = recommendation(m, target, max_positions, mode)
    kept = ("max_length", "coverage", "target_coverage", "truncated", "dropped", "doubled", "reason", "capped")
    report = None if report_path is None else str(report_path)
    return {**{k: r[k] for k in kept}, "rows": m.rows, "cached": cached, "report": report}


def available_cpus() -> int:
    """The CPUs this process may use: its affinity (a Slurm step's cpuset) within its cgroup's CPU quota, which the
    affinity does not show (a login node's per-user limit, systemd's CPUQuota, a container's --cpus): a 64-core login
    node limiting each user to 2 CPUs got 64 tokenizing processes, each a tokenizer and its share of rows in memory."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, quota)) if quota else cpus


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int | None:
    """The fewest whole CPUs a CPU quota of this process's cgroup or an ancestor's allows (cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us over cpu.cfs_period_us, rounded up); None where none is set or none can be read."""
    try:
        lines = Path(own).read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy, at the root or (hybrid) in unified/
            folders, files = [Path(root), Path(root, "unified")], ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: its own mount, cpu/ or cpu,cpuacct/
            folders, files = [Path(root, controllers), Path(root, "cpu")], ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for folder in folders:
            parts = Path(path.lstrip("/")).parts
            for depth in range(len(parts), -1, -1):  # its own cgroup, then each ancestor: a parent's limit holds too
                at = folder.joinpath(*parts[:depth])
                try:  # a file unread or unreadable is no limit: the CPUs shown are then all there is to go by
                    quota, period = " ".join(at.joinpath(f).read_text() for f in files).split()[:2]
                    if quota not in ("max", "-1") and int(period) > 0:
                        quotas.append(-(-int(quota) // int(period)))
                except (OSError, ValueError):
                    continue
    return min(quotas) if quotas else None


PARALLEL_ROWS = 4096  # below this, a pool of processes (fork, the tokenizer pickled) costs more than it saves


def workers(dataset) -> int:
    """The processes `measure` is worth spreading `dataset` over: for a large one, this process's share of the CPUs
    (the node's processes of a launch measure at once, each its own copy: a mixture's pairs at a run's start; each
    taking every CPU, 8 ranks on a 64-core node forked 512 tokenizers), else this one."""
    if len(dataset) < PARALLEL_ROWS:
        return 1
    return max(1, available_cpus() // launcher.processes_per_node())

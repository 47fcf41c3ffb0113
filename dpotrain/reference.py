"""The reference stage: every pair's reference log-probs, scored once between the plan and training, kept on disk as
they are computed, and reused by any later run that would compute the same numbers.

The reference model is the policy before its first update, so its log-probs can be scored once and the second model
dropped from memory for the whole run. On a real data set this is hours of GPU time (150k pairs of ~5k tokens), so it
is a stage of its own, run by `train_dpo.py` after the model loads and before training (or alone, `--reference-only`):
- results are written per rank, atomically and synced to disk, every `reference_save_seconds` and whenever the stage
  stops; a restarted job (requeued, preempted, killed, or rerun by hand) keeps what was scored and scores only the
  rest; a damaged file (truncated by a crash or a full disk) is named in a warning and its pairs are scored again;
- a stop request (stop file, USR1, SIGTERM: `preemption.GracefulStop`) is honoured between micro-batches: every rank
  saves its part, the main process writes the marker that makes `scripts/launch.sh` requeue the job, and the run exits;
- rank 0 alone decides hit, partial or miss and broadcasts what it found, so ranks whose caches differ (node-local
  `DPOTRAIN_CACHE`) still enter the same collectives;
- each pair is scored with the training forward (`RecipeDPOTrainer.reference_log_probs`: TRL's own reference code
  around the packed or padded forward), in the micro-batches training meets it in first (epoch 0 of the plan), so at
  step 1 policy and reference agree to the last bit (TRL's precompute drifts: 2.4e-7 at step 1).

The cache key is what determines each pair's numbers and nothing else: the weights, every pair's token ids (so data set,
revision, tokenizer and chat template are covered, in-memory data sets too), max_length and truncation, LD-DPO's alpha,
dtype and autocast, attention implementation, the forward (packed or padded) and library versions. It leaves out the
micro-batch layout — world size, node count, token budget, pairs per step, max_steps — although which pairs share a
packed row changes the last bits of a sum: a run on another layout reuses the cache and starts ~1e-7 from ln 2 in fp32
instead of exactly on it (tests/test_reference.py measures it), far inside the step-1 health guard.
"""

import functools
import hashlib
import json
import os
import secrets
import socket
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .collectives import broadcast_from_main, gather_objects, max_over_ranks
from .errors import ConfigError
from .plan import COLUMNS, PairLengths

CACHE_VERSION = 2
COMPLETE = "complete.npz"
SAVE_SECONDS = 120  # default of `reference_save_seconds`
PROGRESS_SECONDS = 60  # a progress line in the (Slurm) log at most this often
# What numpy and zipfile raise on an empty, truncated or foreign file (or one without the expected arrays)
_UNREADABLE = (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile, zlib.error)


def cache_dir() -> Path:
    """`$DPOTRAIN_CACHE/reference`, else `~/.cache/dpotrain/reference` (a few bytes per pair)."""
    from .lengths import cache_root

    return cache_root() / "reference"


def check_writable() -> None:
    """The stage saves as it goes: an unwritable cache would lose hours of scoring. Checked before anything loads."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"the reference cache folder {folder} is not writable ({e.strerror}): set DPOTRAIN_CACHE "
                          "to a writable folder (on a cluster, one on a shared file system)") from None  # fmt: skip


def token_hash(dataset) -> str:
    """sha256 of every pair's token ids, in order (Arrow buffers: ~1 s per GB)."""
    import pyarrow.compute as pc

    h = hashlib.sha256()
    table = dataset.with_format("arrow")[:]
    for name in COLUMNS:
        h.update(name.encode())
        for chunk in table.column(name).chunks:
            h.update(np.asarray(pc.list_value_length(chunk), dtype=np.int64).tobytes())
            h.update(np.asarray(chunk.flatten(), dtype=np.int64).tobytes())
    return h.hexdigest()


def identity(trainer, dataset) -> dict:
    import transformers
    import trl

    model, args = trainer.model, trainer.args
    return {
        "version": CACHE_VERSION,
        "model": getattr(model.config, "_name_or_path", ""),
        "weights_sha256": trainer.weights_hash,
        "tokens_sha256": token_hash(dataset),
        "pairs": len(dataset),
        "max_length": args.max_length,
        "truncation_mode": args.truncation_mode,
        "ld_alpha": trainer.ld_alpha,
        "dtype": str(model.dtype),
        "autocast": "bf16" if args.bf16 else "fp16" if args.fp16 else None,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "forward": "packed" if trainer.packed else "padded",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
    }


class Store:
    """One key's folder: `complete.npz` once every pair is scored; until then `part-<attempt>-r<rank>.npz` files, each
    a rank's results of one attempt, rewritten atomically as they grow.

    Files are synced to disk before and after they are renamed into place, so a crash (a node losing power, a kill
    during a write) leaves either the old file or the new one. A file damaged anyway (a full disk, a file system that
    lost its last writes) is named in a warning, removed, and its pairs are scored again: it never stops a start."""

    def __init__(self, folder: Path, pairs: int):
        self.folder, self.pairs = folder, pairs

    @classmethod
    def for_identity(cls, ident: dict) -> "Store":
        key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
        return cls(cache_dir() / key, ident["pairs"])

    def complete(self) -> tuple[np.ndarray, np.ndarray] | None:
        path = self.folder / COMPLETE
        arrays = self._read(path, "chosen", "rejected")
        if arrays is None:
            return None
        chosen, rejected = arrays
        if not chosen.shape == rejected.shape == (self.pairs,):
            return self._damaged(path, f"arrays of shapes {chosen.shape}, {rejected.shape} for {self.pairs} pairs")
        if np.isnan(chosen).any() or np.isnan(rejected).any():
            return self._damaged(path, "pairs without a value")
        return chosen, rejected

    def parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Every pair scored by an interrupted attempt: NaN where not scored."""
        chosen = np.full(self.pairs, np.nan, dtype=np.float32)
        rejected = np.full(self.pairs, np.nan, dtype=np.float32)
        for path in sorted(self.folder.glob("part-*.npz")):
            arrays = self._read(path, "index", "chosen", "rejected")
            if arrays is None:
                continue
            index, c, r = arrays
            if not (index.ndim == 1 and index.shape == c.shape == r.shape and np.issubdtype(index.dtype, np.integer)):
                self._damaged(path, f"arrays of shapes {index.shape}, {c.shape}, {r.shape}")
            elif len(index) and (index.min() < 0 or index.max() >= self.pairs):
                self._damaged(path, f"pair indices outside 0..{self.pairs - 1}")
            else:
                chosen[index], rejected[index] = c, r
        return chosen, rejected

    def write_part(self, attempt: str, rank: int, index: list[int], chosen: list[float], rejected: list[float]) -> None:
        as32 = functools.partial(np.asarray, dtype=np.float32)
        self._write(f"part-{attempt}-r{rank}.npz", index=np.asarray(index, dtype=np.int64), chosen=as32(chosen),
                    rejected=as32(rejected))  # fmt: skip

    def write_complete(self, ident: dict, chosen: np.ndarray, rejected: np.ndarray) -> None:
        self._write(COMPLETE, chosen=chosen, rejected=rejected)
        (self.folder / "identity.json").write_text(json.dumps(ident, indent=1) + "\n")

    def remove_parts(self, attempt: str | None = None, rank: int | None = None) -> None:
        pattern = "part-*.npz" if attempt is None else f"part-{attempt}-r{rank}.npz"
        for path in self.folder.glob(pattern):
            path.unlink(missing_ok=True)

    def _write(self, name: str, **arrays) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        # Renamed into place: a reader never sees half a file. Unique per process (ranks may share the folder).
        tmp = self.folder / f".{name}.{socket.gethostname()}.{os.getpid()}.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it...
        os.replace(tmp, self.folder / name)
        folder = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(folder)  # ...and the new name is on disk before the run goes on (or deletes the parts it merged)
        finally:
            os.close(folder)

    def _read(self, path: Path, *names: str) -> list[np.ndarray] | None:
        """The named arrays of `path`; None if it does not exist or is damaged (then warned about and removed)."""
        try:
            with np.load(path) as f:
                return [np.asarray(f[name]) for name in names]
        except FileNotFoundError:  # none yet, or removed since the folder was listed (a finished attempt's part)
            return None
        except _UNREADABLE as e:
            return self._damaged(path, f"{type(e).__name__}: {e}")

    def _damaged(self, path: Path, why: str) -> None:
        """Called by the main process only (it alone reads the cache and broadcasts what it found), so every rank
        rescores the same pairs."""
        print(f"warning: the reference cache file {path} is damaged ({why}); it is removed and its pairs are scored "
              "again", file=sys.stderr, flush=True)  # fmt: skip
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a read-only cache: scored again next time too, but never a reason not to start
            pass
        return None


@dataclass
class Outcome:
    name: str
    pairs: int
    reused: int  # pairs found in the cache
    scored: int  # pairs scored by this attempt
    stopped: bool
    folder: Path

    def line(self) -> str:
        if self.stopped:
            return (f"reference log-probs ({self.name}): stopped with {self.reused + self.scored:,} of {self.pairs:,} "
                    f"pairs saved in {self.folder}; the same command scores only the rest")  # fmt: skip
        if not self.scored:
            return f"reference log-probs ({self.name}): all {self.pairs:,} pairs reused from {self.folder}"
        kept = f"{self.reused:,} reused from an interrupted run, " if self.reused else ""
        return f"reference log-probs ({self.name}): {kept}{self.scored:,} scored, cached in {self.folder}"


class _Progress:
    """Pairs done, total and time left, in the log (not a progress bar: Slurm logs keep every redraw)."""

    def __init__(self, name: str, total: int, done: int, tokens_todo: int, show: bool):
        self.name, self.total, self.done, self.tokens_todo, self.show = name, total, done, tokens_todo, show
        self.start = self.last = time.monotonic()
        self.tokens = 0

    def advance(self, pairs: int, tokens: int, force: bool = False) -> None:
        self.done += pairs
        self.tokens += tokens
        now = time.monotonic()
        if not self.show or (now - self.last < PROGRESS_SECONDS and not force):
            return
        self.last = now
        elapsed = now - self.start
        left = (self.tokens_todo - self.tokens) * elapsed / max(self.tokens, 1)
        share, speed = 100 * self.done / self.total, self.tokens / max(elapsed, 1e-9)
        print(f"reference log-probs ({self.name}): {self.done:,}/{self.total:,} pairs ({share:.1f}%), "
              f"{_duration(elapsed)} elapsed, ~{_duration(left)} left, {speed:,.0f} tokens/s", flush=True)  # fmt: skip


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run(trainer, dataset, name: str, layout: list[list[list[int]]], stop, save_seconds: float = SAVE_SECONDS):
    """`dataset` with `ref_chosen_logps` / `ref_rejected_logps` columns (None when stopped), and the Outcome.

    `layout[rank]` is the list of micro-batches rank `rank` scores, in order (every rank's, so all ranks know how many
    pairs each round scores). `stop` is the run's `GracefulStop`."""
    accelerator = trainer.accelerator
    rank, world = accelerator.process_index, accelerator.num_processes
    n = len(dataset)
    ident = broadcast_from_main(identity(trainer, dataset) if accelerator.is_main_process else None)
    store = Store.for_identity(ident)

    # Rank 0's cache decides, for everyone: node-local caches then cannot lead ranks into different collectives.
    found = None
    if accelerator.is_main_process:
        complete = store.complete()
        found = (True, *complete) if complete is not None else (False, *store.parts())
    is_complete, chosen, rejected = broadcast_from_main(found)
    reused = int(np.count_nonzero(~np.isnan(chosen)))
    if is_complete:
        return _with_columns(dataset, chosen, rejected), Outcome(name, n, n, 0, False, store.folder)

    todo = [[[i for i in mb if np.isnan(chosen[i])] for mb in mine] for mine in layout]
    todo = [[mb for mb in mine if mb] for mine in todo]
    rounds = max(len(mine) for mine in todo)
    tokens = PairLengths.of(dataset, trainer.args.max_length).tokens
    progress = _Progress(name, n, reused, int(sum(tokens[mb].sum() for mine in todo for mb in mine)),
                         accelerator.is_main_process)  # fmt: skip
    if accelerator.is_main_process:
        kept = f", {reused:,} kept from an interrupted run" if reused else ""
        print(f"reference log-probs ({name}): scoring {n - reused:,} of {n:,} pairs on {world} process(es){kept}; "
              f"saved to {store.folder} as they are scored", flush=True)  # fmt: skip
    attempt = broadcast_from_main(f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}")
    mine_index, mine_chosen, mine_rejected = [], [], []
    rows = dataset.select_columns(list(COLUMNS))
    lockstep = trainer.forward_needs_every_rank()
    last_save = time.monotonic()
    scorer = trainer.reference_scorer()
    was_training = scorer.training
    scorer.eval()
    try:
        for j in range(rounds):
            if max_over_ranks(int(stop.asked_here()), accelerator.device):
                store.write_part(attempt, rank, mine_index, mine_chosen, mine_rejected)
                accelerator.wait_for_everyone()
                return None, Outcome(name, n, reused, progress.done - reused, True, store.folder)
            batch = todo[rank][j] if j < len(todo[rank]) else None
            if batch is not None or lockstep:
                # A rank out of pairs still takes part in the forward's collectives (ZeRO-3, FSDP) with a pair of
                # the data set's, whose result is dropped.
                ids = batch if batch is not None else [int(np.argmin(tokens))]
                c, r = trainer.reference_log_probs(scorer, rows.__getitems__(ids))
                if batch is not None:
                    mine_index += batch
                    mine_chosen += c.float().cpu().tolist()
                    mine_rejected += r.float().cpu().tolist()
            done_now = [mine[j] for mine in todo if j < len(mine)]
            progress.advance(sum(map(len, done_now)), int(sum(tokens[mb].sum() for mb in done_now)))
            if time.monotonic() - last_save >= save_seconds:
                store.write_part(attempt, rank, mine_index, mine_chosen, mine_rejected)
                last_save = time.monotonic()
    finally:
        scorer.train(was_training)
    progress.advance(0, 0, force=True)

    for index, c, r in gather_objects((mine_index, mine_chosen, mine_rejected)):
        chosen[index], rejected[index] = c, r
    missing = np.flatnonzero(np.isnan(chosen) | np.isnan(rejected))
    if len(missing):
        raise RuntimeError(f"reference scoring left pairs {missing[:10].tolist()} unscored: the ranks disagree on the "
                           "data set (same data, seed and code on every node?)")  # fmt: skip
    if accelerator.is_local_main_process:  # every node keeps the result: node-local caches find it on a requeue
        store.write_complete(ident, chosen, rejected)
    accelerator.wait_for_everyone()
    store.remove_parts(attempt, rank)
    if accelerator.is_local_main_process:
        store.remove_parts()  # the interrupted attempts' parts, now in complete.npz
    return _with_columns(dataset, chosen, rejected), Outcome(name, n, reused, n - reused, False, store.folder)


def _with_columns(dataset, chosen: np.ndarray, rejected: np.ndarray):
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        if column in dataset.column_names:
            dataset = dataset.remove_columns(column)
    dataset = dataset.add_column("ref_chosen_logps", chosen.tolist())
    return dataset.add_column("ref_rejected_logps", rejected.tolist())


def run_stage(trainer, stop, save_seconds: float = SAVE_SECONDS) -> list[Outcome]:
    """The stage: the reference of the training set (and of the evaluation set), set on the trainer's data sets.
    Returns one Outcome per data set; the last one says `stopped` when a stop request ended the stage early."""
    outcomes = []
    if not trainer.precompute_ref_logps:  # a live reference model (sync_ref_model, or asked for)
        return outcomes
    for name in ("train", "eval"):
        dataset = trainer.train_dataset if name == "train" else trainer.eval_dataset
        if dataset is None:
            continue
        scored, outcome = run(trainer, dataset, name, trainer.reference_layout(name, len(dataset)), stop, save_seconds)
        outcomes.append(outcome)
        if trainer.accelerator.is_main_process:
            print(outcome.line(), flush=True)
        if outcome.stopped:
            break
        if name == "train":
            trainer.train_dataset = scored
        else:
            trainer.eval_dataset = scored
    trainer.reference_scored()
    return outcomes

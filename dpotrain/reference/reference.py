"""The reference stage (docs/reference.md): the reference log-probs of every pair the planned steps train, scored once
before training, saved as they are computed, and reused by any later run that would compute the same numbers.

The cache key (`identity`; not the micro-batch layout, which moves only the last fp32 bits), its folder (`Store`), the
stage's own micro-batches (`micro_batches`), and the loop every rank runs in lockstep (`run`).
"""

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import secrets
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dpotrain.cluster import run_lock
from dpotrain.cluster.collectives import broadcast_from_main, gather_objects, main_outcome, max_of_ranks
from dpotrain.data import model_identity
from dpotrain.data.pair_lengths import PairLengths, pair_columns
from dpotrain.forwards.packing import REFERENCE_KEYS
from dpotrain.plan.plan import RowLayout, StepPlan, cut_step, steps_of
from dpotrain.recipe import init_kwargs, upstream
from dpotrain.recipe import records as run_records
from dpotrain.recipe.errors import ConfigError, RunError, plural, said_by, warn
from dpotrain.recipe.writes import quiet_progress_bars, remove_dead_temporaries, replacing, unwritable, write_text
from dpotrain.reference.reuse import IDENTITY, KEY_ARRAY, fill_from_other_caches, load_arrays, pair_digests
from dpotrain.reference.scorer import ReferenceScorer

CACHE_VERSION = 2
COMPLETE = "complete.npz"
AGAIN = "its pairs are scored again"  # what follows a damaged cache file
PROGRESS_SECONDS = 60  # a progress line in the (Slurm) log at most this often
STOP_CHECK_SECONDS = 5.0  # the ranks agree on a stop request about this often (one small collective)
CHUNK_MICRO_BATCHES = 4  # micro-batches per rank the planner cuts at once (`micro_batches`)
WRITER = ("writer", "job", "started", "boot")  # the arrays of a part that name its writer (`_writer_beside`)
Layout = list[list[list[int]]]  # every rank's micro-batches, in order: [rank][micro-batch] -> pair indices


def cache_dir() -> Path:
    """`$DPOTRAIN_CACHE/reference`, else `~/.cache/dpotrain/reference` (a few bytes per pair)."""
    from dpotrain.data.lengths import CACHE_FOLDERS, cache_root

    return cache_root() / CACHE_FOLDERS[1]


def check_writable(folder: Path | None = None) -> None:
    """The stage saves as it goes: an unwritable cache would lose hours of scoring. Checked before anything loads,
    where the cache holds no complete reference this run could reuse (a team's read-only cache that holds one is
    read; its key, known once the model and data load, is checked again then, by `run`)."""
    if folder is None and any(cache_dir().glob(f"*/{COMPLETE}")):
        return
    folder = folder or cache_dir()
    if problem := unwritable(folder):
        raise ConfigError(
            f"the reference cache folder {folder} is not writable (cannot write in {problem[0]}: {problem[1]}): set "
            "DPOTRAIN_CACHE to a writable folder (on a cluster, one on a shared file system)"
        )


def token_hash(dataset) -> str:
    """sha256 of every pair's token ids, in order (Arrow buffers: ~1 s per GB)."""
    import pyarrow.compute as pc

    h = hashlib.sha256()
    table = dataset.with_format("arrow")[:]
    for name in pair_columns(dataset):  # with `assistant_turns: all`, which prompt tokens are scored too
        h.update(name.encode())
        for chunk in table.column(name).chunks:
            h.update(np.asarray(pc.list_value_length(chunk), dtype=np.int64).tobytes())
            h.update(np.asarray(chunk.flatten(), dtype=np.int64).tobytes())
    return h.hexdigest()


def identity(scorer: ReferenceScorer, dataset) -> dict:
    import transformers
    import trl

    model, args = scorer.policy, scorer.args
    # The model_init_kwargs that override its config build another model from the same weights (`rms_norm_eps`):
    # keyed by the weights alone, its reference was the model's own config's, reused. Added only where given, so
    # every other run keeps its key. Their values as the record writes them (json), whatever their type.
    overrides = init_kwargs.config_overrides(args.model_init_kwargs)
    overrides = {"config_overrides": json.loads(json.dumps(overrides, default=str))} if overrides else {}
    # The config builds the model too (config.json's `rms_norm_eps` edited, a Hub commit of the config alone): keyed
    # by the file, not the loaded config, which the run itself changes (use_cache, dtype), so every attempt keys alike.
    # A LoRA run's reference is its base, loaded from this same file.
    init = args.model_init_kwargs or {}
    # (the config of `subfolder` where given: keyed by the top folder's, an edit of the one the model is built from
    # reused the old config's scores)
    name, where = model.config.name_or_path, (init.get("revision"), init.get("cache_dir"), init.get("subfolder"))
    config = model_identity.config_sha256(name, *where)
    # A model's own code builds it too (`trust_remote_code`): its edited modeling file reused the old code's scores.
    # Added only where the run runs that code, so every other run keeps its key.
    if code := model_identity.code_sha256(name, *where) if args.trust_remote_code else None:
        overrides |= {"code_sha256": code}
    # FSDP2's bf16/fp16 computes from parameters cast to it, norms and softmax included, not under autocast as one
    # process, DDP (fp32 weights) do: keyed alike, an FSDP2 run reused their reference and the step-1 guard stopped it
    # (rewards 0.02-0.04 off on the demo's model). Added only there, so every other run keeps its key.
    if scorer.engine.name == "fsdp2" and (args.bf16 or args.fp16):
        overrides |= {"fsdp2_mixed_precision": "bf16" if args.bf16 else "fp16"}
    overrides |= float32_matmul(scorer.accelerator.device.type)
    return overrides | {
        "version": CACHE_VERSION,
        "model": model_identity.cache_name(model.config.name_or_path),
        "weights_sha256": scorer.weights_hash,
        "config_sha256": config,
        "tokens_sha256": token_hash(dataset),
        "pairs": len(dataset),
        "max_length": args.max_length,
        "truncation_mode": args.truncation_mode,
        "ld_alpha": scorer.ld_alpha,
        "dtype": str(model.dtype),
        "autocast": "bf16" if args.bf16 else "fp16" if args.fp16 else None,
        "attn_implementation": upstream.attn_implementation(model.config),
        "forward": "packed" if scorer.packed else "padded",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
    }


def float32_matmul(device_type: str) -> dict:
    """The key's part for TF32 (`tf32: true`, torch's own setting, or cuBLAS's override variable): on an Ampere or newer
    GPU it rounds float32 matmuls' inputs to a 10-bit mantissa, which moves the log-probs: every matmul of a float32
    run (bf16 false), and under bf16 autocast any a model computes in float32 outside it (a router kept in float32).
    Keyed alike, a run reused the scores of one with the other setting, and its rewards at step 1 measured the two
    settings' difference, not training. Added only on a GPU with TF32 on, so every other run keeps its key (on a CPU,
    where TF32 changes nothing, every run)."""
    overridden = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
    if device_type == "cuda" and (torch.backends.cuda.matmul.fp32_precision == "tf32" or overridden):
        return {"float32_matmul": "tf32"}
    return {}


def kept_parts(kept: int, beside: dict[str, int], verb: str) -> list[str]:
    """'5 kept from an interrupted run', '3 kept from parts saved by another run scoring now (pid 12 on node3)': the
    pairs of this key's parts, by whether their writer is known to be gone (`_writer_beside`)."""
    interrupted = kept - sum(beside.values())
    said = [f"{interrupted:,} {verb} from an interrupted run"] if interrupted else []
    return said + [f"{n:,} {verb} from parts saved by {who}" for who, n in beside.items() if n]


def _writer_beside(writer, job, started=None, boot=None) -> str | None:
    """'another run scoring now (pid 12 on node3)' where a part's writer may still be scoring (alive on this host, or
    on another host: no telling from here); None where it is known gone (its pid gone or taken by a process of another
    start or boot; this process; this Slurm job's on another host, requeued or its other nodes) or the part names no
    writer (written before parts did)."""
    host, _, pid = str(writer).rpartition(":")
    if writer is None or not pid.isdigit():
        return None
    if host != socket.gethostname():
        if job is not None and str(job) and str(job) == os.environ.get("SLURM_JOB_ID"):
            return None
        return f"another run, interrupted or scoring now (pid {pid} on {host})"
    # On this host its process tells, of this Slurm job's part too: one job runs several runs at once (a sweep's job
    # steps, `srun ... &`), and one of them was said `interrupted`, and its parts removed, while it scored on
    started, boot = (None if a is None else str(a) or None for a in (started, boot))  # '' where /proc is not
    if int(pid) == os.getpid() or not run_lock.alive_here({"pid": pid, "process_start": started, "boot_id": boot}):
        return None
    return f"another run scoring now (pid {pid} on {host})"


class Store:
    """One key's folder: `complete.npz` once every pair is scored, until then `part-<attempt>-r<rank>.npz` files
    rewritten atomically. A damaged file is warned about, removed and rescored; a failed write (a full disk) loses only
    the saving (`unsaved` says why)."""

    def __init__(self, folder: Path, pairs: int):
        self.folder, self.pairs = folder, pairs
        self.unsaved: str | None = None
        self.beside: dict[str, int] = {}  # what `parts` took from writers maybe still scoring: who -> pairs

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
        if not (np.isfinite(chosen).all() and np.isfinite(rejected).all()):  # inf: an overflow's, never a reference
            return self._damaged(path, "pairs without a finite value")
        return chosen, rejected

    def parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Every pair scored by an interrupted attempt: NaN where not scored."""
        chosen, rejected = np.full((2, self.pairs), np.nan, dtype=np.float32)
        for path in sorted(self.folder.glob("part-*.npz")):
            arrays = self._read(path, "index", "chosen", "rejected", optional=WRITER)
            if arrays is None:
                continue
            index, c, r, *writer = arrays
            if not (index.ndim == 1 and index.shape == c.shape == r.shape and np.issubdtype(index.dtype, np.integer)):
                self._damaged(path, f"arrays of shapes {index.shape}, {c.shape}, {r.shape}")
            elif len(index) and (index.min() < 0 or index.max() >= self.pairs):
                self._damaged(path, f"pair indices outside 0..{self.pairs - 1}")
            else:
                who = _writer_beside(*writer)
                if who:  # the pairs this part adds, said to be that writer's
                    fresh = int(np.count_nonzero(np.isnan(chosen[index])))
                    self.beside[who] = self.beside.get(who, 0) + fresh
                chosen[index], rejected[index] = c, r
        # A model that overflows scores inf, or NaN on one side, saved in a part before the stop check that refuses it:
        # read as scored, -inf went into complete.npz, and a NaN side raised "the ranks disagree". Scored again.
        unscored = ~(np.isfinite(chosen) & np.isfinite(rejected))
        chosen[unscored] = rejected[unscored] = np.nan
        return chosen, rejected

    def write_part(self, attempt: str, rank: int, index: list[int], chosen: list[float], rejected: list[float]) -> None:
        as32, index = functools.partial(np.asarray, dtype=np.float32), np.asarray(index, dtype=np.int64)
        # The writer, so that a run reading this part while its writer scores on says so, not `interrupted`
        writer = np.asarray(f"{socket.gethostname()}:{os.getpid()}")
        job = np.asarray(os.environ.get("SLURM_JOB_ID", ""))  # a requeue keeps it: its parts are its own earlier ones
        # Its start and boot: a pid alone, taken by another process once the writer is gone, reads as scoring now
        started, boot = (np.asarray(v or "") for v in (run_lock.process_start(os.getpid()), run_lock.boot_id()))
        arrays = dict(index=index, chosen=as32(chosen), rejected=as32(rejected), writer=writer, job=job)
        arrays |= dict(started=started, boot=boot)
        self._write(f"part-{attempt}-r{rank}.npz", **arrays)

    def write_complete(self, ident: dict, chosen: np.ndarray, rejected: np.ndarray, digests: np.ndarray) -> None:
        """With each pair's digest: a later run whose data changed in part reuses the pairs it shares (`reuse.py`)."""
        if self._write(COMPLETE, chosen=chosen, rejected=rejected, digests=digests):
            # Every pair is saved now: a part's save that failed before (a disk full for a while) lost nothing, and
            # the run's line and record said "not cached: the next run scores them again" of a cached reference
            self.unsaved = None
            try:  # only other runs read it, to share pairs: without it they score their own
                write_text(self.folder / IDENTITY, json.dumps(ident, indent=1) + "\n")
            except OSError as e:  # not `_not_saved`: the run's line and record said "not cached: the next run scores
                # them again" of a reference the next run reuses whole (a disk full after complete.npz)
                warn(
                    f"{IDENTITY} could not be written in {self.folder} ({e.strerror or e}): the reference is cached, "
                    "but runs of other data (a mixture's source edited) score its pairs again"
                )

    def remove_dead_temporaries(self) -> None:
        """Removes the temporaries that writes killed midway left here (nothing else would), of dead writers only."""
        parts = {p.name[1:].partition(".npz.")[0] + ".npz" for p in self.folder.glob(".part-*.npz.*.tmp")}
        for path in remove_dead_temporaries(self.folder, [COMPLETE, IDENTITY, *parts]):
            print(
                f"Removed {path}: left by a write to the reference cache killed midway (its process is gone)",
                flush=True,
            )

    def remove_part(self, attempt: str, rank: int) -> None:
        (self.folder / f"part-{attempt}-r{rank}.npz").unlink(missing_ok=True)

    def remove_gone_writers_parts(self, attempt: str | None = None) -> None:
        """Removes the parts (in `complete.npz` now) of writers known gone (`_writer_beside`), not `attempt`'s (its
        ranks remove their own). A live neighbour's stay (it reads them if stopped before it finishes), and another
        host's: its own end, or a later run of this key on its host once it is gone, removes them."""
        for path in self.folder.glob("part-*.npz"):
            if attempt is not None and path.name.startswith(f"part-{attempt}-r"):
                continue
            try:
                _, writer = load_arrays(path, (), optional=WRITER)
            except FileNotFoundError:
                continue  # its writer removed it meanwhile
            except run_records.UNREADABLE:
                writer = [None] * len(WRITER)  # damaged: no writer's, and in complete.npz
            if _writer_beside(*writer) is None:
                with contextlib.suppress(OSError):  # a read-only cache keeps them: never read past complete.npz
                    path.unlink(missing_ok=True)

    def _write(self, name: str, **arrays) -> bool:
        # Each file names its key (`KEY_ARRAY`): one copied into another key's folder is not read as its scores.
        try:
            with replacing(self.folder / name, "wb") as f:
                np.savez(f, **{KEY_ARRAY: np.asarray(self.folder.name)}, **arrays)
            return True
        except OSError as e:  # `replacing` has removed its temporary file: nothing half-written is left
            self._not_saved(e)
            return False

    def _not_saved(self, error: OSError) -> None:
        if self.unsaved is None:  # once per process: a full disk stays full
            warn(
                f"the reference cache could not be written in {self.folder} ({error.strerror or error}): "
                "scoring and training go on with the scores in memory, and a later run (a requeue too) scores the "
                "unsaved pairs again; free space there, or set DPOTRAIN_CACHE to a folder with room"
            )
        self.unsaved = error.strerror or str(error)

    def _read(self, path: Path, *names: str, optional: tuple[str, ...] = ()) -> list[np.ndarray] | None:
        """The named arrays of `path`; None if gone or damaged (warned about and removed). Main process only: it
        broadcasts what it found, so every rank rescores the same pairs."""

        load = functools.partial(load_arrays, names=names, optional=optional)
        other = "the scores of cache key {}, another model, data or settings than this folder's: a file copied in from"
        return run_records.read_cache(path, load, "reference", AGAIN, self.folder.name, other + " another cache folder")

    def _damaged(self, path: Path, why: str) -> None:
        return run_records.damaged_cache(path, why, "reference", AGAIN)


@dataclasses.dataclass
class Outcome:
    name: str
    pairs: int
    reused: int  # pairs found in the cache (the run's own key, or other runs' caches: `shared`)
    scored: int  # pairs scored by this attempt
    stopped: bool
    folder: Path
    shared: int = 0  # of `reused`: found in other runs' caches (same model and settings, other data: `reuse.py`)
    world: int = 1
    micro_batches: int = 0  # per process (fillers included)
    warmup_seconds: float | None = None  # the first micro-batch: kernels loaded, compiled, tuned
    tokens_per_second: float | None = None  # steady: real tokens over all processes after the first micro-batch
    unsaved: str | None = None  # why the cache could not be written (this process's), where it could not
    of: int | None = None  # the data set's pairs, where the run's steps train only `pairs` of them (`_run_on`)
    beside: dict[str, int] = dataclasses.field(default_factory=dict)  # of `reused`: `Store.beside`

    def line(self) -> str:
        head, done = f"reference log-probs ({self.name}):", f"{self.reused + self.scored:,} of {self.pairs:,} pairs"
        if self.stopped and self.unsaved:
            return (
                f"{head} stopped after {done}, not all saved ({self.unsaved} in {self.folder}); the same command "
                "scores the unsaved ones again"
            )
        if self.stopped:
            return f"{head} stopped with {done} saved in {self.folder}; the same command scores only the rest"
        if not self.scored and not self.shared:  # pairs found in other runs' caches were not in this folder: below
            return f"{head} all {self.pairs:,} pairs reused from {self.folder}"
        kept = "".join(f"{part}, " for part in kept_parts(self.reused - self.shared, self.beside, "reused"))
        if self.shared:
            kept += f"{self.shared:,} reused from other runs' caches (the same pairs, model and settings), "
        if not self.scored:  # every pair found, some in other runs' caches: not "cached in" a folder it may not be
            return f"{head} {kept}none scored"
        if self.unsaved:
            return (
                f"{head} {kept}{self.scored:,} scored, not cached ({self.unsaved} in {self.folder}): the next run "
                "scores them again"
            )
        return f"{head} {kept}{self.scored:,} scored, cached in {self.folder}"

    def stop_what(self) -> str:
        """What the stop line after a stopped stage says stopped (`line`, just above it, says what was kept)."""
        return f"reference log-probs ({self.name}) stopped"

    def speed_line(self) -> str | None:
        """'reference log-probs (train): warm-up 3.1 s (first micro-batch), then 81,234 tokens/s over 2 processes
        (40,617 per process) in 120 micro-batches each'; None when nothing was scored."""
        if self.stopped or not self.scored or self.warmup_seconds is None:
            return None
        speed, per_process = self.tokens_per_second, ""
        if speed is not None and self.world > 1:  # one process: the same number twice
            per_process = f" ({speed / self.world:,.0f} per process)"
        over = f"over {plural(self.world, 'process')}{per_process}"
        steady = "" if speed is None else f", then {speed:,.0f} tokens/s {over}"
        return (
            f"reference log-probs ({self.name}): warm-up {self.warmup_seconds:.1f} s (first micro-batch){steady} "
            f"in {plural(self.micro_batches, 'micro-batch', ',', many='micro-batches')} each"
        )

    def record(self) -> dict:
        """What the run records of the stage (resolved_config.json's `derived.reference`)."""
        warmup, speed = self.warmup_seconds, self.tokens_per_second
        return {
            "pairs": self.pairs,
            "reused": self.reused,
            "reused_from_other_runs": self.shared,
            "scored": self.scored,
            "micro_batches": self.micro_batches,
            "warmup_seconds": None if warmup is None else round(warmup, 3),
            "tokens_per_second": None if speed is None else round(speed, 1),
            **({"not_cached": self.unsaved} if self.unsaved else {}),
            **({"of": self.of} if self.of is not None else {}),
        }


class _Progress:
    """Pairs done, total and time left, in the log (not a bar: Slurm logs keep every redraw); warm-up timed apart."""

    def __init__(self, name: str, total: int, done: int, tokens_todo: int, show: bool):
        self.name, self.total, self.done, self.tokens_todo, self.show = name, total, done, tokens_todo, show
        self.began = self.start = self.last = time.monotonic()
        self.tokens = 0  # since the steady clock started
        self.warmup: float | None = None

    def steady(self, first_tokens: int, device) -> None:
        """The first micro-batch is done (waited for): from here on the clock measures steady work."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.start = self.last = time.monotonic()
        self.warmup = self.start - self.began
        self.tokens_todo -= first_tokens

    def advance(self, pairs: int, tokens: int, force: bool = False) -> None:
        self.done += pairs
        if self.warmup is not None:
            self.tokens += tokens
        now = time.monotonic()
        if not self.show or (now - self.last < PROGRESS_SECONDS and not force):
            return
        self.last = now
        share = f"{self.done:,}/{self.total:,} pairs ({100 * self.done / self.total:.1f}%)"
        if not self.tokens:  # one micro-batch: its warm-up, timed apart, left no steady work to time
            print(
                f"reference log-probs ({self.name}): {share} in {now - self.began:.1f} s, all in the first "
                "micro-batch (the warm-up, timed apart): no steady tokens/s to measure",
                flush=True,
            )
            return
        left = (self.tokens_todo - self.tokens) / max(self.speed(), 1e-9)
        print(
            f"reference log-probs ({self.name}): {share}, "
            f"{_duration(now - self.start)} elapsed, ~{_duration(left)} left, {self.speed():,.0f} tokens/s",
            flush=True,
        )

    def speed(self) -> float:
        """Real tokens (as training's `tokens_per_second` counts them) per second over all processes, since `steady`."""
        return self.tokens / max(time.monotonic() - self.start, 1e-9)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def non_finite(ident: dict) -> RunError:
    """A model that scores NaN or inf: its reference would make every loss NaN, and NaN reads as "not scored". Every
    rank raises it from the same reduced numbers; the main process writes its line."""
    precision = ", ".join(str(v) for v in (ident["dtype"], ident["autocast"] and f"{ident['autocast']} autocast") if v)
    return said_by(
        RunError(
            f"the reference log-probs of model {ident['model']} are NaN or infinite ({precision}): its weights hold "
            "NaN or inf (a diverged checkpoint?) or its activations overflow in this precision: check the model's "
            "weights, or load it in another precision (--dtype float32 or bfloat16, --bf16 rather than --fp16)"
        )
    )


class _StopChecks:
    """The ranks agree on a stop request in one collective about every `STOP_CHECK_SECONDS`, the first before any
    scoring; every rank sets the next check from the same reduced numbers. The same collective says whether any rank
    scored NaN or inf: refused within seconds, not after hours of scoring."""

    def __init__(self, stop, device, ident: dict, only: tuple[str, Store] | None = None):
        self.stop, self.device, self.ident = stop, device, ident
        self.only = only  # a reference-only run's (name, store): a failed save loses its one product
        self.every, self.next = 1, 0
        self.since = time.monotonic()

    def stop_now(self, j: int, results: "_Results") -> bool:
        if j != self.next:
            return False
        unsaved = self.only[1].unsaved if self.only else None
        here = [
            float(self.stop.asked_here()),
            time.monotonic() - self.since,
            results.non_finite(),
            float(bool(unsaved)),
        ]
        asked, slowest, bad, lost = max_of_ranks(here, self.device)
        if bad:
            raise non_finite(self.ident)
        if lost:  # every rank from the same numbers: not hours more of scoring that the exit would throw away
            name, store = self.only
            raise said_by(uncached(name, unsaved or "another process's write failed", store.folder, "stopped: they"))
        self.since = time.monotonic()
        if j > 0:  # the first interval is start-up, not scoring
            self.every = max(1, min(2 * self.every, round(self.every * STOP_CHECK_SECONDS / max(slowest, 1e-3))))
        self.next = j + self.every
        return bool(asked)


class _Prefetch:
    """Rows collated on a thread, `AHEAD` micro-batches ahead of the forward: each round's batch (pinned on CUDA), or
    None for a round this rank sits out."""

    AHEAD = 2

    def __init__(self, collate, rows, ids_per_round: list[list[int] | None], pin: bool):
        self.collate, self.rows, self.pin = collate, rows, pin
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reference-prefetch")
        self.rounds = iter(ids_per_round)
        self.ahead = deque(self.pool.submit(self._load, ids) for ids in itertools.islice(self.rounds, self.AHEAD))

    def _load(self, ids: list[int] | None):
        if ids is None:
            return None
        batch = self.collate(self.rows.__getitems__(ids))
        return {k: v.pin_memory() if self.pin and torch.is_tensor(v) else v for k, v in batch.items()}

    def next(self):
        for ids in itertools.islice(self.rounds, 1):
            self.ahead.append(self.pool.submit(self._load, ids))
        return self.ahead.popleft().result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)  # what is queued is dropped; a batch being collated is waited for


class _Results:
    """This rank's scores, kept on the device (a copy per micro-batch would wait for the GPU) until each save."""

    def __init__(self):
        self.index, self.chosen, self.rejected = [], [], []
        self.pending: list[torch.Tensor] = []  # [2, pairs] per micro-batch, on the device
        self.finite: torch.Tensor | None = None  # whether every score so far is finite, on the device (no wait)

    def add(self, pairs: list[int], chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        self.index += pairs
        both = torch.stack([chosen.float(), rejected.float()])
        self.pending.append(both)
        finite = torch.isfinite(both).all()
        self.finite = finite if self.finite is None else self.finite & finite

    def non_finite(self) -> float:
        """1.0 where a score so far is NaN or inf (read at the stop checks, which wait for the device anyway)."""
        return float(self.finite is not None and not bool(self.finite))

    def on_host(self) -> tuple[list[int], list[float], list[float]]:
        if self.pending:
            both = torch.cat(self.pending, dim=1).cpu()  # one copy, one wait for the device
            self.pending = []
            self.chosen += both[0].tolist()
            self.rejected += both[1].tolist()
        return self.index, self.chosen, self.rejected


def micro_batches(
    lengths: PairLengths,
    pairs,
    world: int,
    budget: int | None,
    pairs_per_micro_batch: int | None,
    padded: bool,
    seed: int,
    layout: RowLayout | None = None,
) -> Layout:
    """The stage's own micro-batches of `pairs`, cut by `plan.cut_step` at its budget, in chunks of about
    `CHUNK_MICRO_BATCHES` per rank (packing all at once takes minutes). Packed: a seeded random order (mixed lengths
    pack tightly); padded: longest first. Every rank computes the same cut."""
    pairs = np.asarray(pairs, dtype=np.int64)
    if len(pairs) < world:  # a resumed stage's last few pairs: one each, the other ranks sit out (or run fillers)
        return [[[int(pairs[r])]] if r < len(pairs) else [] for r in range(world)]
    if padded:
        order = pairs[np.lexsort((pairs, -lengths.longest[pairs]))]
    else:
        order = pairs[np.random.default_rng([seed, len(pairs)]).permutation(len(pairs))]
    if budget is None:
        per_chunk = world * CHUNK_MICRO_BATCHES * pairs_per_micro_batch
    else:
        cost = 2 * lengths.longest[pairs] if padded else lengths.tokens[pairs]
        per_chunk = max(world, round(world * CHUNK_MICRO_BATCHES * budget / max(float(cost.mean()), 1.0)))
    step = StepPlan(per_chunk, world, seed, budget, pairs_per_micro_batch, padded, layout)
    out: Layout = [[] for _ in range(world)]
    for chunk in steps_of(order, per_chunk, world):
        for rank, mine in enumerate(cut_step(chunk, lengths, step)):
            out[rank] += [mb for mb in mine if mb]  # a filler of the planner: the stage runs its own (`run`)
    return out


def stage_layout(scorer: ReferenceScorer, dataset) -> Layout:
    """Every rank's micro-batches of the reference stage over every pair of `dataset`, at the scorer's budget."""
    budget, pairs = scorer.budget()
    lengths, every = scorer.lengths(dataset), np.arange(len(dataset))
    padded, layout = not scorer.packed, scorer.layout()
    return micro_batches(lengths, every, scorer.world, budget, pairs, padded, scorer.args.seed, layout)


def run(scorer: ReferenceScorer, dataset, name: str, layout: Layout | None, stop, save_seconds: float, only=False):
    """`dataset` with the reference columns (None when stopped), and the Outcome. `layout[rank]`: that rank's
    micro-batches (None: `stage_layout`). `stop`: the run's `GracefulStop`. `only`: a reference-only run, whose one
    product is the cache: a save that fails ends it (`_StopChecks`)."""
    accelerator = scorer.accelerator
    rank, world, device = scorer.rank, scorer.world, accelerator.device
    n = len(dataset)
    ident = broadcast_from_main(identity(scorer, dataset) if accelerator.is_main_process else None)
    store = Store.for_identity(ident)

    # Rank 0's cache decides, for everyone: node-local caches then cannot lead ranks into different collectives.
    is_complete, chosen, rejected, digests, shared, beside = broadcast_from_main(
        _look_up(store, ident, dataset) if accelerator.is_main_process else None
    )
    reused = int(np.count_nonzero(~np.isnan(chosen)))
    if reused < n:  # pairs to score, saved as they are: refused in an unwritable cache before the first forward
        main_outcome(check_writable, store.folder)  # the main's refusal every rank's
    # ended(scored, stopped, ...)
    ended = functools.partial(Outcome, name, n, reused, folder=store.folder, shared=shared, beside=beside)
    if reused == n:  # a complete cache, or every pair found in other runs' caches: nothing to score
        # Kept under this run's key where it can be: a read-only cache (a team's) lends them the same way next time,
        # and writing there warned that "a later run scores the unsaved pairs again" of pairs nothing had lost
        if not is_complete and not broadcast_from_main(
            bool(unwritable(store.folder)) if accelerator.is_main_process else None
        ):
            _gather_and_keep(accelerator, store, ident, digests, "none", ([], [], []), chosen, rejected)
        return _with_columns(dataset, chosen, rejected), ended(0, False)

    todo, size = _todo(scorer, dataset, layout, chosen)
    tokens = PairLengths.of(dataset, scorer.args.max_length).tokens  # every sequence whole, as training counts them
    rounds, round_tokens, round_pairs = _rounds(todo, tokens)
    progress = _Progress(name, n, reused, sum(round_tokens), accelerator.is_main_process)
    if accelerator.is_main_process:
        kept = "".join(f", {part}" for part in kept_parts(reused - shared, beside, "kept"))
        kept += f", {shared:,} found in other runs' caches" if shared else ""
        print(
            f"reference log-probs ({name}): scoring {n - reused:,} of {n:,} pairs on {plural(world, 'process')} in "
            f"{plural(rounds, 'micro-batch', ',', many='micro-batches')} each{size}{kept}; saved to {store.folder} as "
            "they are scored",
            flush=True,
        )
    attempt = broadcast_from_main(f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}")
    # A rank out of pairs still joins the forward's collectives (ZeRO-3, FSDP) with a pair whose result is dropped
    mine = [todo[rank][j] if j < len(todo[rank]) else None for j in range(rounds)]
    feed = [ids if ids is not None else [int(np.argmin(tokens))] if scorer.every_rank else None for ids in mine]
    results, last_save = _Results(), time.monotonic()
    checks = _StopChecks(stop, device, ident, (name, store) if only else None)
    model = scorer.model()
    was_training = model.training
    model.eval()
    rows = dataset.select_columns(pair_columns(dataset))
    prefetch = _Prefetch(scorer.collate, rows, feed, device.type == "cuda")
    try:
        with scorer.context():
            for j in range(rounds):
                if checks.stop_now(j, results):
                    store.write_part(attempt, accelerator.process_index, *results.on_host())
                    accelerator.wait_for_everyone()
                    return None, ended(progress.done - reused, True, unsaved=store.unsaved)
                batch = prefetch.next()
                if batch is not None:
                    c, r = scorer.log_probs(model, batch)
                    if mine[j] is not None:
                        results.add(mine[j], c, r)
                if j == 0:  # the warm-up: the clock of the steady speed starts once the first forward is done
                    progress.steady(round_tokens[0], device)
                progress.advance(round_pairs[j], round_tokens[j] if j else 0)
                if time.monotonic() - last_save >= save_seconds:
                    store.write_part(attempt, accelerator.process_index, *results.on_host())
                    last_save = time.monotonic()
    finally:
        prefetch.close()
        model.train(was_training)
    scored = results.on_host()  # waits for the last forward: the clock stops after it
    progress.advance(0, 0, force=True)
    speed = progress.speed() if rounds > 1 else None
    _gather_and_keep(accelerator, store, ident, digests, attempt, scored, chosen, rejected)
    timing = dict(world=world, micro_batches=rounds, warmup_seconds=progress.warmup, tokens_per_second=speed)
    return _with_columns(dataset, chosen, rejected), ended(n - reused, False, unsaved=store.unsaved, **timing)


def check_cached(outcomes: list[Outcome]) -> None:
    """A reference-only run's one product is the cache (main process: its node's copy is the one read). Scores a full
    disk kept it from saving are lost as it exits: it exited 0, and the training job after it (`sbatch
    --dependency=afterok`) started and scored every pair again, on its smaller allocation."""
    for o in outcomes:
        if o.unsaved and not (o.folder / COMPLETE).is_file():
            raise uncached(o.name, o.unsaved, o.folder, "were scored but")


def uncached(name: str, why: str, folder: Path, what: str) -> RunError:
    return RunError(
        f"--reference_only: the reference log-probs ({name}) {what} could not be cached ({why} in {folder}), so the "
        "training run would score them again: free space there, or set DPOTRAIN_CACHE to a folder with room, and run "
        "it again"
    )


def _rounds(todo: list, tokens) -> tuple[int, list[int], list[int]]:
    """The rounds every rank runs, and each round's tokens and pairs over all ranks (the progress line's)."""
    rounds = max(len(mine) for mine in todo)
    round_tokens = [int(sum(tokens[mine[j]].sum() for mine in todo if j < len(mine))) for j in range(rounds)]
    round_pairs = [sum(len(mine[j]) for mine in todo if j < len(mine)) for j in range(rounds)]
    return rounds, round_tokens, round_pairs


def _look_up(store: Store, ident: dict, dataset) -> tuple:
    """The main process's reading of the cache: (complete?, chosen, rejected, digests, shared): its own, else an
    interrupted attempt's parts and other runs' pairs by digest."""
    store.remove_dead_temporaries()
    complete = store.complete()
    if complete is not None:
        store.remove_gone_writers_parts()  # left by a writer of another host, or one that finished before ours
        return True, *complete, None, 0, {}
    chosen, rejected = store.parts()
    digests = pair_digests(dataset)
    shared = fill_from_other_caches(cache_dir(), store.folder, ident, digests, chosen, rejected)
    return False, chosen, rejected, digests, shared, store.beside


def _todo(scorer: ReferenceScorer, dataset, layout, chosen: np.ndarray) -> tuple[list, str]:
    """Each rank's micro-batches of pairs still to score, and the size they were cut to (said at the start)."""
    size = ""
    if layout is None:
        # Cut over every pair, then the scored left out: a resumed stage scores the rest in the same micro-batches
        # an uninterrupted one would (the same numbers, bit for bit).
        layout = stage_layout(scorer, dataset)
        budget, pairs = scorer.budget()
        size = f" of up to {budget:,} positions" if budget else f" of up to {plural(pairs, 'pair')}"
    todo = [[[i for i in mb if np.isnan(chosen[i])] for mb in mine] for mine in layout]
    return [[mb for mb in mine if mb] for mine in todo], size


def _gather_and_keep(accelerator, store, ident, digests, attempt: str, mine: tuple, chosen, rejected) -> None:
    """Every rank's scores into `chosen` / `rejected` (all ranks), saved whole on every node, the parts removed."""
    gathered = gather_objects(mine)
    if not all(np.isfinite(c).all() and np.isfinite(r).all() for _, c, r in gathered):  # every rank sees the same
        raise non_finite(ident)  # NaN read as "unscored" below blamed the ranks' data sets
    for index, c, r in gathered:
        chosen[index], rejected[index] = c, r
    missing = np.flatnonzero(np.isnan(chosen) | np.isnan(rejected))
    if len(missing):
        raise RuntimeError(
            f"reference scoring left pairs {missing[:10].tolist()} unscored: the ranks disagree on the "
            "data set (same data, seed and code on every node?)"
        )
    if accelerator.is_local_main_process:  # every node keeps the result: node-local caches find it on a requeue
        store.write_complete(ident, chosen, rejected, digests)
    accelerator.wait_for_everyone()
    if not (store.folder / COMPLETE).is_file():  # not saved (a full disk): the parts keep their pairs for a later run
        return
    store.remove_part(attempt, accelerator.process_index)
    if accelerator.is_local_main_process:
        store.remove_gone_writers_parts(attempt)  # the interrupted attempts' parts, now in complete.npz


def _run_on(scorer: ReferenceScorer, dataset, pairs: np.ndarray, steps: int, name: str, stop, save_seconds, only):
    """`run` on the `pairs` of `dataset` the run trains, keyed by those alone; the others get NaN (never read)."""
    n = len(dataset)
    if len(pairs) == n:
        return run(scorer, dataset, name, None, stop, save_seconds, only)
    if scorer.accelerator.is_main_process:
        print(
            f"reference log-probs ({name}): only the {len(pairs):,} of {n:,} pairs the "
            f"{plural(steps, 'planned step', ',')} train are scored",
            flush=True,
        )
    part, outcome = run(scorer, dataset.select(pairs), name, None, stop, save_seconds, only)
    outcome = dataclasses.replace(outcome, of=n)
    if part is None:  # stopped
        return None, outcome
    chosen, rejected = np.full((2, n), np.nan, dtype=np.float32)
    chosen[pairs], rejected[pairs] = (part[column] for column in REFERENCE_KEYS)
    return _with_columns(dataset, chosen, rejected), outcome


def _with_columns(dataset, chosen: np.ndarray, rejected: np.ndarray):
    dataset = dataset.remove_columns([c for c in REFERENCE_KEYS if c in dataset.column_names])
    with quiet_progress_bars():  # add_column rewrites a filtered data set's index: "Flattening the indices", a bar
        for column, values in zip(REFERENCE_KEYS, (chosen, rejected), strict=True):
            dataset = dataset.add_column(column, values.tolist())
    return dataset


def run_stage(trainer, save_seconds: float, only: bool = False) -> list[Outcome]:
    """The stage: the training (and evaluation) set's reference, given to the trainer; one Outcome per data set.
    `only`: a reference-only run (`run`)."""
    outcomes = []
    if not trainer.precompute_ref_logps:  # a live reference model (sync_ref_model, or asked for)
        return outcomes
    scorer = ReferenceScorer(trainer)
    for name in ("train", "eval"):
        dataset = trainer.train_dataset if name == "train" else trainer.eval_dataset
        if dataset is None:
            continue
        trained = trainer.run_plan.trained if name == "train" else np.arange(len(dataset))  # every eval pair
        steps = trainer.run_plan.summary["pairs_trained"]["steps"]
        scored, outcome = _run_on(scorer, dataset, trained, steps, name, trainer.graceful_stop, save_seconds, only)
        outcomes.append(outcome)
        if trainer.accelerator.is_main_process:
            print(outcome.line(), flush=True)
            if outcome.speed_line():
                print(outcome.speed_line(), flush=True)
        if outcome.stopped:
            break
        trainer.use_reference(name, scored)
    scorer.finish()
    return outcomes

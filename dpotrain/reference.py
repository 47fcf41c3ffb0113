"""Reference log-probs, computed once before training with the training forward, and cached on disk.

The reference model is the policy before its first update, so its log-probs can be scored once and the second model
dropped from memory for the whole run. Done carelessly this breaks DPO's step-1 invariant (loss ln 2, rewards 0):
TRL's own precompute scores pairs in padded batches of another shape than training's, and the sums drift
(`../shared/seeds/000_*`, hypothesis 1; FACTS.md: ln 2 + 2.4e-7). Here each pair is scored with the packed forward
training uses, in the very micro-batches training runs it in first, in the same dtype and attention implementation.

The cache key is what determines the numbers and nothing else: the weights (TRL's hash of the module), the token ids
of every pair (so data set, revision, tokenizer and chat template are all covered, and in-memory data sets too),
max_length and truncation, LD-DPO's alpha, dtype, attention implementation, library versions, and which pairs share
a micro-batch. A requeued job, or a rerun with another learning rate, beta or output_dir, finds it. Each rank scores
the micro-batches it will train on first (so at step 1 policy and reference agree to the last bit, and the ranks are
balanced as in training), each pair once, gathered by index; a missing index is an error, never a silent zero.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from . import packing

CACHE_VERSION = 1
COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def cache_dir() -> Path:
    """`$DPOTRAIN_CACHE/reference`, else `~/.cache/dpotrain/reference` (a few bytes per pair)."""
    from .lengths import cache_root

    return cache_root() / "reference"


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


def pair_costs(dataset, max_length: int | None) -> np.ndarray:
    """Positions each pair takes in packed rows after truncation (as `packing.sequences` cuts them), from Arrow
    offsets: its cost in a micro-batch."""
    table = dataset.with_format("arrow")[:]
    import pyarrow.compute as pc

    prompt, chosen, rejected = (np.asarray(pc.list_value_length(table.column(c)), dtype=np.int64) for c in COLUMNS)
    sides = [prompt + chosen, prompt + rejected]
    if max_length is not None:
        sides = [np.minimum(s, max_length) for s in sides]
    return (sides[0] + sides[1]).astype(np.int64)


def cache_identity(trainer, dataset, plan: list[list[list[int]]]) -> dict:
    import transformers
    import trl

    model = trainer.model
    config = model.config
    return {
        "version": CACHE_VERSION,
        "model": getattr(config, "_name_or_path", ""),
        "weights_sha256": trainer._precompute_model_hash,
        "tokens_sha256": token_hash(dataset),
        "pairs": len(dataset),
        "max_length": trainer.args.max_length,
        "truncation_mode": trainer.args.truncation_mode,
        "ld_alpha": trainer.ld_alpha,
        "dtype": str(model.dtype),
        "autocast": "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else None,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "forward": "packed",
        "one_row": trainer.packed_collator.one_row,
        "hidden_size": trainer.packed_collator.hidden_size,
        # Which pairs share a packed row changes the last bits of the sums (kernels block the row differently), so
        # pairs are scored in the micro-batches training first runs them in, and that layout is part of the key.
        "micro_batches_sha256": hashlib.sha256(json.dumps(plan).encode()).hexdigest(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
    }


def cache_path(identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{key}.npz"


def load(path: Path, pairs: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not path.is_file():
        return None
    with np.load(path) as f:
        chosen, rejected = f["chosen"], f["rejected"]
    return (chosen, rejected) if len(chosen) == pairs == len(rejected) else None


def save(path: Path, identity: dict, chosen: np.ndarray, rejected: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")  # renamed into place: a reader never sees half a file
    np.savez(tmp, chosen=chosen, rejected=rejected)
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps(identity, indent=1) + "\n")


def score(trainer, dataset, name: str, plan: list[list[list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Summed reference log-probs of every pair's chosen and rejected completion, scored on all ranks: rank r scores
    the micro-batches `plan[r]`."""
    from tqdm.auto import tqdm

    accelerator = trainer.accelerator
    collate = trainer.packed_collator
    model = trainer.reference_scorer()
    was_training = model.training
    model.eval()
    found_index, found_chosen, found_rejected = [], [], []
    token_columns = dataset.select_columns(list(COLUMNS))
    batches = plan[accelerator.process_index]
    bar = tqdm(total=len(dataset), desc=f"Reference log-probs ({name})", disable=not accelerator.is_main_process,
               unit="pair")  # fmt: skip
    for batch_indices in batches:
        rows = token_columns[batch_indices]
        batch = collate([{c: rows[c][k] for c in COLUMNS} for k in range(len(batch_indices))])
        batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        padded = packing.padded_view(batch)
        # TRL's own reference computation (adapter disabled for PEFT, no grad, autocast, LD-DPO weighting), with the
        # packed forward standing in for the model call.
        chosen, rejected = trainer.compute_ref_log_probs(packing.PackedModel(model, batch), padded)
        found_index.append(torch.tensor(batch_indices, device=accelerator.device))
        found_chosen.append(chosen.float())
        found_rejected.append(rejected.float())
        bar.update(len(batch_indices) * accelerator.num_processes)  # ranks move in step: an estimate of the total
    bar.close()
    model.train(was_training)
    local = [torch.cat(x).cpu().tolist() if x else [] for x in (found_index, found_chosen, found_rejected)]
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        parts = [None] * accelerator.num_processes
        dist.all_gather_object(parts, local)  # ranks hold different numbers of pairs: objects, not tensors
    else:
        parts = [local]
    chosen_all = np.full(len(dataset), np.nan, dtype=np.float32)
    rejected_all = np.full(len(dataset), np.nan, dtype=np.float32)
    seen = np.zeros(len(dataset), dtype=np.int64)
    for index, chosen, rejected in parts:
        chosen_all[index] = chosen
        rejected_all[index] = rejected
        np.add.at(seen, np.asarray(index, dtype=np.int64), 1)
    if not (seen == 1).all():
        missing, twice = np.flatnonzero(seen == 0), np.flatnonzero(seen > 1)
        raise RuntimeError(f"reference scoring lost pairs {missing[:10].tolist()} or scored {twice[:10].tolist()} "
                           "twice: the ranks disagree on the data set (same data and seed on every node?)")  # fmt: skip
    return chosen_all, rejected_all


def add_reference_logps(trainer, dataset, name: str, plan: list[list[list[int]]]):
    """`dataset` with `ref_chosen_logps` / `ref_rejected_logps` columns, from the cache or scored now in the
    micro-batches `plan[rank]` (every rank's, so that the key is the same everywhere)."""
    accelerator = trainer.accelerator
    # Rank 0's view decides, so all ranks read or write one file; only it hashes the data set's tokens.
    identity_list = [cache_identity(trainer, dataset, plan) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(identity_list, from_process=0)
    identity = identity_list[0]
    path = cache_path(identity)
    cached = load(path, len(dataset))
    if cached is not None:
        if accelerator.is_main_process:
            print(f"Reference log-probs ({name}): reusing {path}", flush=True)
        chosen, rejected = cached
    else:
        chosen, rejected = score(trainer, dataset, name, plan)
        if accelerator.is_main_process:
            save(path, identity, chosen, rejected)
            print(f"Reference log-probs ({name}): {len(dataset)} pairs scored, cached in {path}", flush=True)
    accelerator.wait_for_everyone()
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        if column in dataset.column_names:
            dataset = dataset.remove_columns(column)
    dataset = dataset.add_column("ref_chosen_logps", chosen.tolist())
    return dataset.add_column("ref_rejected_logps", rejected.tolist())

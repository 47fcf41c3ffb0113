"""Rank agreement at start: what each rank decided alone, but all ranks must share, checked with one all-gather.

Each rank reads its own data, plans its own steps and finds its own checkpoint: a node-local cache or an older copy of
a folder gives ranks different plans or resume points, and the job hangs or trains on silently different steps; a node
launched with another recipe or command line steps its own copy with its own learning rate, and the weights drift.
Checked twice: the first half's decisions (`first_half_values`) before a replaced run's files are removed and the model
loads, then the trainer's plan (`values`) once TRL has tokenized the pairs.
"""

import hashlib
import json
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from dpotrain.cluster import engine
from dpotrain.cluster.collectives import gather_objects
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.recipe.errors import ConfigError, plural, said_by

# What to do when the ranks disagree on a value, by the value's name.
FIXES = {
    "the data set's lengths": "every node must read the same data (a node-local cache, or another copy of the file?)",
    "the evaluation set": "every node must read the same evaluation split (a node-local cache, or another copy?)",
    "the plan": "every node must run the same code and recipe on the same data",
    "max_length": "every node must see the same analyzer cache (or none) and recipe: under max_length auto it is "
    "the analyzer's choice from the cached lengths",
    "the pairs per step": "launch every node with the same recipe file and command line",
    "the resume point": "every node must see the same output_dir (a shared file system, not a node-local one)",
    "the output folder's state": "every node must see the same output_dir (a shared file system, not a node-local one)",
    "the engine": "launch every node with the same accelerate config",
    "the forward": "install the same attention kernels on every node (requirements-gpu.txt), give every node GPUs "
    "of one kind, and let every node read the same data and see the same analyzer cache (or none): the forward is "
    "decided from the pairs' lengths",
    "the memory plan": "give every node GPUs of one kind, and let every node read the same data and see the same "
    "analyzer cache (or none): the memory plan is made from each node's GPU and the pairs' lengths",
    "the packages": "install the same versions of torch, transformers, trl, accelerate and deepspeed on every node",
    "the reference's model": "every node must load the same model (the same path and revision)",
    "the model's weights": "every node must load the same weights: a model folder staged on each node's own disk "
    "must be the same copy, and a Hub model the same commit in each node's cache (--model_revision <commit>, or one "
    "shared HF_HOME)",
    "the reference's micro-batch": "give every node GPUs of one kind, or pass --gpu_memory_gib: the memory plan "
    "decides it from the GPU's memory",
    "the settings": "launch every node with the same recipe file and command line",
}

# Fields of the record (resolved_config.json) that may differ between the ranks of one run. `local_rank`: the
# deprecated `torch.distributed.launch` passes each process its own `--local_rank`. `config`: the recipe file's path,
# not what it says: every value it sets is compared field by field, and a node may read the same file at another mount
# point or from a copy staged beside it. Every other path is compared as given: one command line launches every node,
# so the same run names the same model, data and output_dir everywhere (the model's path is compared again by the
# build, "the reference's model"; the data by its lengths).
PER_RANK = ("local_rank", "config")


def digest(value) -> str:
    """A short, stable digest of a value: numpy arrays by their bytes, anything else by its JSON."""
    h = hashlib.sha256()
    if isinstance(value, np.ndarray):
        h.update(str(value.dtype).encode() + str(value.shape).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    else:
        h.update(json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def lengths_digest(lengths) -> str:
    """The plan's view of the data set (`PairLengths`): every pair's lengths, in order."""
    parts = [lengths.chosen, lengths.rejected, lengths.prompt, lengths.shared]
    return digest([digest(np.asarray(a)) for a in parts if a is not None])


def forward_digest(record: dict | None) -> str:
    """A forward's record (`ForwardChoice.record`) as the ranks compare it: what was chosen and the estimates weighed,
    not the analyzer cache its lengths were read from (`lengths_from`, also in the `reason` said): each rank's own
    DPOTRAIN_CACHE, node-local at another path on each node, where the same lengths decide the same forward."""
    if not record:
        return digest(record)
    decision = record.get("decision")
    kept = {key: value for key, value in record.items() if key != "reason"}
    if isinstance(decision, dict):
        kept["decision"] = {key: value for key, value in decision.items() if key != "lengths_from"}
    return digest(kept)


def plan_digest(planned) -> str:
    """Every epoch's steps, ranks and micro-batches (`plan.plan_run`), as pair indices."""
    h = hashlib.sha256()
    for epoch in planned:
        for step in epoch:
            for rank in step:
                h.update(b"".join(np.asarray(mb, dtype=np.int64).tobytes() + b"|" for mb in rank) + b"/")
            h.update(b";")
    return h.hexdigest()[:16]


def package_versions() -> dict:
    out = {}
    for name in ("torch", "transformers", "trl", "accelerate", "deepspeed"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# This project's own code, recorded beside the packages by its git commit (`project_commit`): a requeue that ran
# another checkout (a `git pull` between attempts, a job resumed from a colleague's copy) trained the steps after the
# checkpoint under other code in silence, where an upgraded package was said.
PROJECT = "dpotrain"
ROOT = Path(__file__).resolve().parents[2]


GIT_WAIT_S = 30  # git answers in well under a second; past this it is stuck (an NFS server not answering)


def project_commit() -> str | None:
    """The commit of the checkout this code runs from; None where it is no git checkout of its own (a copy without
    .git, one inside another repository) or git cannot say (not installed, stuck). Asked by the main process alone,
    where the record is written. `safe.directory`: a checkout of another user (a colleague's, shared) is read as it
    is, where git refused it ("dubious ownership") and the record said no commit."""
    command = ["git", "-c", f"safe.directory={ROOT}", "-C", str(ROOT), "rev-parse", "--show-toplevel", "HEAD"]
    try:
        git = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    try:
        stdout, _ = git.communicate(timeout=GIT_WAIT_S)
    except subprocess.TimeoutExpired:
        # Killed, not waited for: a git stuck in NFS I/O (D state) does not die until the server answers, and
        # subprocess.run(timeout=...) waits for it after the kill, unbounded; the run goes on, its commit unknown.
        git.kill()
        return None
    lines = stdout.splitlines()  # a checkout path may hold spaces
    if git.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != ROOT:
        return None
    return lines[1]


def recorded_versions() -> dict:
    """What a run's steps are trained under, as its record keeps it (`derived.packages`): the packages' versions and
    this project's commit."""
    return package_versions() | {PROJECT: project_commit()}


def upgraded(was, now: dict) -> str | None:
    """`name: old -> new` for each package whose version is not the one a checkpoint was trained under (its record's
    `derived.packages`); None where they agree, or where that record is older than the versions it keeps. The
    project's commit where both records know it (a copy without git says nothing of its code)."""
    if not isinstance(was, dict):
        return None
    known = [(name, v) for name, v in now.items() if name in was and (name != PROJECT or None not in (v, was[name]))]
    changed = [f"{name} {was[name]} -> {v}" for name, v in known if was[name] != v]
    return ", ".join(changed) or None


def settings(spec) -> dict[str, str]:
    """The recipe of the run (`RunSpec.as_run`) as resolved_config.json records it, field by field (each value's JSON),
    without `PER_RANK`: the learning rate, beta, loss, seed, warm-up, clipping... that each rank steps its own shard or
    copy with. Whole fields, not one digest, so that a refusal names the field that differs: about 6 KB a rank. Cheap:
    the record is made from values in memory (no data read); `as_run` is built once, for it and TRL's arguments."""
    resolved = spec.resolved_config({})
    for name in (*PER_RANK, "derived"):  # `derived`: the decisions, each compared under its own name
        resolved.pop(name)
    return {name: json.dumps(value, sort_keys=True, default=str) for name, value in resolved.items()}


def check(values: dict[str, str | dict]) -> None:
    """Every rank's `values` (name -> short digest or value, or a dict of them) against rank 0's, in one all-gather: the
    first difference is refused on every rank with the fix. Every rank calls it with the same names."""
    ranks = gather_objects(values)
    for name, mine in ranks[0].items():
        for rank, theirs in enumerate(ranks[1:], start=1):
            if theirs.get(name) != mine:
                fix = FIXES.get(name, "every node must run the same job")
                theirs, mine = _shown(theirs.get(name), mine)
                refusal = ConfigError(f"ranks disagree on {name}: rank {rank} has {theirs}, rank 0 has {mine}: {fix}")
                raise said_by(refusal)  # every rank's from the same gather: the main process's line says it


def check_nodes(name: str, value: str) -> None:
    """Every rank's `value` (a decision read from its own machine: its GPU, its kernels) against rank 0's in one
    all-gather, each with its node's name: the first difference is refused on every rank, naming both nodes, with the
    fix. Called where the decision is made, before the next collective, where `check` (a digest, after the first half)
    came only after the memory plan had been made from it. Every rank calls it with the same name."""
    ranks = gather_objects((socket.gethostname(), value))
    host, mine = ranks[0]
    for rank, (other, theirs) in enumerate(ranks[1:], start=1):
        if theirs != mine:
            fix = FIXES.get(name, "every node must run the same job")
            said = f"rank {rank} (node {other}) has {theirs}, rank 0 (node {host}) has {mine}"
            raise said_by(ConfigError(f"ranks disagree on {name}: {said}: {fix}"))


def folder_state(output) -> dict[str, str]:
    """What a rank decided of its output folder (resolve.OutputDecision): the run finished by this job, a final push to
    complete, the resume point. A rank ending on the first two while another trains left that one in a collective."""
    return {
        "finished by job": str(output.finished_by),
        "push left": str(output.push_left),
        "resume": str(output.resume_from),
    }


def _shown(theirs, mine) -> tuple[str, str]:
    """Two differing values as a refusal writes them: a dict's differing keys alone (the first 3), `key=value`."""
    if not (isinstance(theirs, dict) and isinstance(mine, dict)):
        return str(theirs), str(mine)
    keys = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
    more = f" (and {plural(len(keys) - 3, 'other')})" if len(keys) > 3 else ""
    return tuple(" ".join(f"{k}={d.get(k, '(none)')}" for k in keys[:3]) + more for d in (theirs, mine))


def _loaded_weights(trainer) -> str:
    """What "the model's weights" compares: the reference cache's key (TRL's hash, on every rank); with a live reference
    (no key) a fingerprint of the reference model each rank holds once built, which DDP leaves as each rank loaded it
    (it broadcasts the policy's weights alone), and which the run trains against at every step."""
    if not trainer.engine.loads_on_every_rank:
        return "rank 0's"
    if trainer.weights_hash is None and trainer.ref_model is not None:
        return engine.weights_sample(trainer.ref_model)[:16]
    return str(trainer.weights_hash)[:16]


def values(trainer, resume_from: str | None) -> dict[str, str]:
    """The values of a run that must be equal on every rank once its plan is made, for `check`."""
    evaluation = trainer.eval_dataset
    evaluation = "none" if evaluation is None else lengths_digest(PairLengths.of(evaluation, trainer.args.max_length))
    return {
        "the data set's lengths": lengths_digest(trainer.run_plan.lengths),
        # Its lengths, not its count alone: its batches are cut by both (plan.eval_batches).
        "the evaluation set": evaluation,
        "the plan": plan_digest(trainer.run_plan.epochs),
        "the resume point": str(resume_from),
        "the engine": trainer.engine.name,
        # Decided on each rank from the data's lengths and what is installed (forwards/choice.py): a node without a
        # kernel, or with another analyzer cache, would run another forward.
        "the forward": forward_digest(trainer.forward.record()),
        "the packages": digest(package_versions()),
        # The path, not the weights' hash: under ZeRO-3, and FSDP2 with RAM-efficient loading, only rank 0 has them.
        "the reference's model": str(trainer.model.config.name_or_path),
        # The weights as each rank loaded them from its own node's files (another copy, another commit in a node's
        # Hub cache): each rank scores its share of the reference stage with its own, before the engine hands every
        # rank the main process's, and rank 1's pairs were cached under rank 0's weights. Their hash (TRL's, taken on
        # every rank; the cache's key); None with a live reference, which has no hash.
        "the model's weights": _loaded_weights(trainer),
        # The memory plan's, from each rank's own GPU: another count of forwards would hang ZeRO-3's gathers.
        "the reference's micro-batch": str(trainer.reference_multiple),
    }


def first_half_values(spec) -> dict[str, str | dict]:
    """What the first half decided (`stages.RunSpec`) that must be equal on every rank, for an early `check`: before
    a replaced run's files are removed and the model loads, so ranks given different data are refused in seconds, the
    old run kept. Cheap: digests of lengths already in memory (the analyzer's, or the seeded sample's), and the recipe
    of the run; no data read."""
    counts, data = spec.lengths.pairs, spec.data
    evaluation = data.checked.get("eval_rows")  # not `data_identity`: the main process alone reads the files' hashes
    return {
        # Every pair's (the analyzer's) or a seeded sample's token lengths, and the rows and steps they make.
        "the data set's lengths": digest(["none" if counts is None else lengths_digest(counts), data.steps]),
        # By count alone: the first half has no lengths of the evaluation pairs (the analyzer measures, and the seeded
        # sample draws from, the training split), and measuring them here would tokenize them on every rank before
        # TRL does again. The build's `values` compares every evaluation pair's lengths before any step, but after
        # the old run's files went: other evaluation pairs of the same count cost a replaced run.
        "the evaluation set": "none" if data.eval is None else f"{evaluation} pairs",
        "max_length": str(spec.lengths.max_length),
        "the pairs per step": str(spec.pairs_per_step),
        "the engine": spec.launch.engine.name,
        "the forward": forward_digest(None if spec.forward.planned is None else spec.forward.planned.record()),
        "the packages": digest(package_versions()),
        "the reference's micro-batch": str(spec.memory.reference_multiple),
        # Found by each rank in its own view of output_dir: a node-local folder resumes one rank and starts another
        # afresh. Compared before the settings, which record it too, with its own fix.
        "the resume point": str(None if spec.output is None else spec.output.resume_from),
        # Last: a decision above that differs (max_length, the forward) is in the settings too, and its own name and
        # fix say more than theirs.
        "the settings": settings(spec),
    }

"""What a complete checkpoint holds: each file with its size and SHA-256, in MANIFEST.json, on disk before COMPLETE.

The mark says every rank finished writing; the manifest says what they wrote, so that a checkpoint damaged afterwards
(a file deleted, a copy cut short, a bad disk block) is named before it is resumed from. Sizes are checked before
anything loads, checksums (each rank its share) once processes have started. A checkpoint without a manifest, or
without optimizer or scheduler state, is never resumed from (transformers would go on with a fresh optimizer, silently).
"""

import errno
import fnmatch
import hashlib
import json
import os
import time
from pathlib import Path

from dpotrain.cluster.collectives import gather_objects, main_outcome, rank_and_world
from dpotrain.recipe.errors import plural
from dpotrain.recipe.writes import is_dir, is_file, write_text

MANIFEST = "MANIFEST.json"
DENIED = "cannot be read by this job"  # `checksum_problems`: a permission, never damage (resume.confirm refuses)
# The state a resume goes on with besides the weights, by the names each engine writes it under: one process, DDP and
# LoRA `optimizer.pt` and `scheduler.pt`; FSDP2 its optimizer's shards in `optimizer_0/`; DeepSpeed both in its
# `global_step*/` folder (the scheduler's in the model-states file).
STATE = {
    "optimizer.pt": ("optimizer.pt", "optimizer.bin", "optimizer_0/*", "global_step*/*optim_states.pt"),
    "scheduler.pt": ("scheduler.pt", "global_step*/*model_states.pt"),
}

# What a resume loads into the run from a checkpoint (weights, optimizer and scheduler state, RNG states,
# trainer_state.json, TR-DPO's moved reference, DeepSpeed's `latest` tag), by file name: one there that the manifest
# does not list was put there after the checkpoint was sealed (another run's, a copy cut short), and would be loaded
# unverified.
LOADED = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.distcp", "trainer_state.json", "latest")
# transformers loads a checkpoint as FSDP's when a folder's name holds this (Trainer._load_from_checkpoint), whatever
# the folder holds: an empty one put there failed every resume with "only supported when using PyTorch FSDP"
FSDP_FOLDER = "pytorch_model_fsdp"  # accelerate.utils.constants.FSDP_MODEL_NAME, which transformers copies
# Where a resume loads `LOADED` files from: the checkpoint's top level and the engines' state folders (DeepSpeed's
# `global_step*/`, FSDP2's weights' and optimizer's shards). A folder of another name is read by nothing: a conversion
# written into the checkpoint (`python zero_to_fp32.py . output_dir/`, as DeepSpeed's script saved there says) failed
# the check, and the run went back to the checkpoint before it and deleted this one as damaged.
LOADED_FOLDERS = ("global_step*", f"{FSDP_FOLDER}*", "optimizer_*")


class GoneWhileRead(FileNotFoundError):
    """A checkpoint's file gone while `seal` listed or checksummed it (`rm -rf <out>/checkpoint-*` to free space): a
    read, which `disk_full.folder_gone` says as one, where it said the file "could not be written"."""


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def listing(folder: Path, leave_out: tuple = ()) -> list[tuple[str, int]]:
    """Every file under `folder` (relative path, size), largest first; `leave_out`: top-level names left out."""
    files = [(path.relative_to(folder).as_posix(), path) for path in folder.rglob("*") if is_file(path)]
    found = [(rel, path.stat().st_size) for rel, path in files if rel not in leave_out]
    return sorted(found, key=lambda item: (-item[1], item[0]))


def seal(folder: Path, mark: str, mark_text: str, is_main: bool, model: list[str] | tuple = ()) -> None:
    """On every rank, once all have written `folder`: hash it (each rank its share); the main process writes
    MANIFEST.json, then the mark, each flushed to disk. `model`: the top-level names the model's save wrote (its
    weights, configs, tokenizer and the folders they hold), whose files the manifest names as the model's."""
    start = time.monotonic()
    # main_outcome, not a broadcast of the listing: an unanswered look (ESTALE) raised on the main process alone, the
    # other ranks waiting in the broadcast; now every rank raises it
    files = main_outcome(lambda: _listed(folder, mark) if is_main and is_dir(folder) else None)
    if files is None:
        return
    rank, world = rank_and_world()
    mine = {}
    for rel, _ in files[rank::world]:  # every `world`-th of the largest-first list: ranks read about as much
        try:
            mine[rel] = sha256(folder / rel)
        except OSError as e:  # a node that does not see the file: the manifest says so, the mark is not written
            mine[rel] = f"unreadable on rank {rank}: {e.strerror}"
    hashes = {rel: digest for part in gather_objects(mine) for rel, digest in part.items()}

    def write() -> None:  # the main process's; its refusal (a file a node does not see, a full disk) ends every rank,
        # which would otherwise go on into the next step's collective and wait there (NCCL: for ddp_timeout)
        for rel, why in hashes.items():
            if why.startswith("unreadable") and not is_file(folder / rel):  # the main process wrote it: deleted since
                raise GoneWhileRead(errno.ENOENT, os.strerror(errno.ENOENT), str(folder / rel))
            if why.startswith("unreadable"):
                raise OSError(f"{folder / rel}: {why} (every node must see the output folder: a shared file system)")
        entries = {rel: {"bytes": size, "sha256": hashes[rel]} for rel, size in files}
        saved = sorted(rel for rel in entries if rel.split("/")[0] in model)
        write_text(folder / MANIFEST, json.dumps({"files": entries, "model": saved}, indent=1) + "\n")
        write_text(folder / mark, mark_text)
        total = sum(size for _, size in files) / 2**20
        print(
            f"{folder.name}: {plural(len(files), 'file')} ({total:,.1f} MiB) checksummed by "
            f"{plural(world, 'process')} and marked {mark} in {time.monotonic() - start:.2f} s",
            flush=True,
        )

    main_outcome(write)  # every rank of a launch calls it, the main process writes


def _listed(folder: Path, mark: str) -> list[tuple[str, int]]:
    """`listing` of the folder `seal` seals; a file gone as it is listed: `GoneWhileRead`."""
    try:
        return listing(folder, leave_out=(MANIFEST, mark))
    except FileNotFoundError as e:
        raise GoneWhileRead(e.errno, e.strerror, e.filename) from None


def read(folder: Path) -> dict | None:
    """The manifest's files ({relative path: {"bytes", "sha256"}}), or None for a checkpoint written without one."""
    try:
        # not is_file(): False for every OSError on Python 3.14 (gh-118243), a read that failed (ESTALE) taken for none
        text = (folder / MANIFEST).read_text()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        files = json.loads(text)["files"]
        # Each entry as `seal` writes it: an edited one (no size, a size in words) would end the check in a traceback;
        # and of the folder's own files: a path out of it (`../../base/model.safetensors`, edited in) was verified as
        # the checkpoint's and deleted with it by rotation
        if all(type(e["bytes"]) is int and isinstance(e["sha256"], str) for e in files.values()) and all(
            map(inside, files)
        ):
            return files
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}  # a damaged manifest lists nothing: `problem` names it


def model_files(folder: Path) -> list[str] | None:
    """The files of the checkpoint's model (weights, configs, tokenizer, chat templates: what its save wrote), as its
    manifest names them; None for a manifest that names none (written before manifests did) or none at all. A read
    that failed (EIO, ESTALE) is raised: no damaged checkpoint, which a push refuses for good (and a staged copy it
    removes, the step's last)."""
    try:
        names = json.loads((folder / MANIFEST).read_text())["model"]
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError):
        return None
    return names if isinstance(names, list) and all(isinstance(n, str) and inside(n) for n in names) else None


def inside(relative: str) -> bool:
    """Whether a path a manifest lists is one of its folder's files, as `seal` lists them: relative, no `..`."""
    parts = Path(relative).parts
    return bool(parts) and not Path(relative).is_absolute() and ".." not in parts


def missing(folder: Path) -> list[str]:
    """What `folder` lacks of a checkpoint's proof: its manifest, the optimizer's and scheduler's state (as listed, or
    found on disk without a manifest)."""
    files = read(folder)
    names = list(files) if files is not None else [rel for rel, _ in listing(folder)] if is_dir(folder) else []
    lacking = [name for name, kinds in STATE.items() if not any(fnmatch.fnmatch(n, k) for n in names for k in kinds)]
    return ([MANIFEST] if files is None else []) + lacking


def problem(folder: Path) -> str | None:
    """Why `folder` fails its manifest, its state or its files' sizes, or None (checksums: `checksum_problems`)."""
    files = read(folder)
    if files == {}:
        return f"{MANIFEST} is unreadable"
    if lacking := missing(folder):  # `x is missing`, `x and y are missing`, `x, y and z are missing`
        listed = lacking[0] if len(lacking) == 1 else f"{', '.join(lacking[:-1])} and {lacking[-1]}"
        return f"{listed} {'is' if len(lacking) == 1 else 'are'} missing"
    for rel, entry in files.items():
        path = folder / rel
        if not is_file(path):  # `writes.looked`: unanswered, raised; never a sound checkpoint passed over
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{rel} has {size} bytes, {entry['bytes']} were written (cut short or replaced)"
    for rel, _ in listing(folder, leave_out=(MANIFEST,)):
        if rel not in files and loaded(rel):
            return f"{rel} is not in {MANIFEST} (written after the checkpoint was sealed, or copied in)"
    for entry in sorted(folder.iterdir()):
        if FSDP_FOLDER in entry.name and is_dir(entry) and not any(rel.startswith(f"{entry.name}/") for rel in files):
            return f"{entry.name}/ is not in {MANIFEST} (made after the checkpoint was sealed, or copied in)"
    return None


def loaded(relative: str) -> bool:
    """Whether a resume loads the checkpoint's file at `relative` (`LOADED`, where `LOADED_FOLDERS` says)."""
    parts = relative.split("/")
    where = len(parts) == 1 or any(fnmatch.fnmatch(parts[0], folder) for folder in LOADED_FOLDERS)
    return where and any(fnmatch.fnmatch(parts[-1], kind) for kind in LOADED)


def checksum_problems(folder: Path, rank: int, world: int) -> list[str]:
    """This rank's share of `folder`'s files whose SHA-256 differs from the manifest's."""
    files = read(folder) or {}
    ordered = sorted(files.items(), key=lambda item: (-item[1]["bytes"], item[0]))
    problems = []
    for rel, entry in ordered[rank::world]:
        try:
            if sha256(folder / rel) != entry["sha256"]:
                problems.append(f"{rel} does not match its checksum (damaged after it was written)")
        except PermissionError as e:  # not damage: a sound checkpoint passed over was deleted as its step was saved
            problems.append(f"{rel} {DENIED} ({e.strerror})")
        except OSError as e:
            problems.append(f"{rel} is unreadable ({e.strerror})")
    return problems


def total_bytes(folder: Path) -> int | None:
    """The bytes a checkpoint took on disk, by its manifest; None without one."""
    files = read(folder)
    return sum(entry["bytes"] for entry in files.values()) if files else None

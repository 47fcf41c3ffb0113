"""W&B wiring: one W&B run per output_dir, so a requeued or resumed job keeps logging to the same run."""

import os
import time
import uuid
from pathlib import Path

from transformers import TrainerCallback
from transformers.integrations.integration_utils import rewrite_logs

from dpotrain.recipe import records, run_record
from dpotrain.recipe.errors import warn
from dpotrain.recipe.writes import is_file, write_text
from dpotrain.train.metrics import METRICS_FILE, read_metrics

RUN_ID_FILE = ".wandb_run_id"


def files_folder(output_dir: str | os.PathLike) -> Path:
    """Where wandb writes its files (offline runs, logs): `wandb/` in WANDB_DIR, which `setup_wandb` sets to the output
    folder where the user set none."""
    return Path(os.environ.get("WANDB_DIR", "").strip() or output_dir) / "wandb"


def setup_wandb(training, *, resumes: bool) -> None:
    """The folder's W&B run, or a new one; `resumes`: whether this run goes on from a checkpoint."""
    if "wandb" not in (training.report_to or []):
        return
    out = Path(training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    id_file = out / RUN_ID_FILE
    recorded = id_file.read_text(errors="replace").strip() if is_file(id_file) else ""
    if recorded and not resumes and not os.environ.get("WANDB_RUN_ID", "").strip():
        recorded = _retired(out, recorded)
    # The user's WANDB_RUN_ID wins; else the folder's (none yet, or left empty by an older version killed while
    # writing it: a new W&B run)
    run_id = os.environ.get("WANDB_RUN_ID", "").strip() or recorded or uuid.uuid4().hex[:12]
    if recorded and run_id != recorded:  # the user's WANDB_RUN_ID, taken, but the curves are now in two W&B runs
        warn(
            f"WANDB_RUN_ID {run_id!r} is used: {out} logged to the W&B run {recorded!r} until now, and logs on to "
            f"{run_id!r} from here, and a rerun without WANDB_RUN_ID too (the folder's run is now {run_id!r}: "
            f"rerun with WANDB_RUN_ID={recorded} to go back to {recorded!r})"
        )
    if run_id != recorded:  # the folder's W&B run, also one the user named: a rerun without the variable goes on in it
        write_text(id_file, run_id)
    os.environ["WANDB_RUN_ID"] = run_id
    os.environ.setdefault("WANDB_RESUME", "allow")
    # Offline runs live next to the model they describe. A WANDB_DIR set empty is cleared (as any variable: `WANDB_DIR=`
    # over .env's), not kept: wandb wrote into the system's temporary folder (a node's /tmp, gone with the job).
    if not os.environ.get("WANDB_DIR", "").strip():
        os.environ["WANDB_DIR"] = str(out)
    # transformers' WandbCallback logs to "huggingface" where WANDB_PROJECT is not set, which nothing said: the curves
    # were looked for in the project the user had in mind. Said, not changed: a resumed run must stay in its project.
    if os.environ.get("WANDB_PROJECT") is None and os.environ.get("WANDB_MODE", "").lower() != "disabled":
        print(
            "note: W&B logs this run to the project 'huggingface' (transformers' default: WANDB_PROJECT is not set): "
            "set WANDB_PROJECT=... in .env, or in the recipe's env:, to log to another",
            flush=True,
        )


def _retired(out: Path, recorded: str) -> str:
    """`recorded`, or "" (a new W&B run) where an earlier attempt in `out` trained and logged to it but saved no
    checkpoint (killed before its first save), and this run trains from step 1 again: logged on in the same W&B run,
    W&B kept the earlier attempt's rows for the steps both logged and dropped this run's (it takes each step once), a
    changed learning rate included. An attempt stopped before training logged nothing there: its run is kept."""
    logged = [r["step"] for r in read_metrics(out / METRICS_FILE) if "loss" in r] if is_file(out / METRICS_FILE) else []
    if not logged:
        return recorded
    print(
        f"note: an earlier attempt in {out} logged steps {min(logged)}-{max(logged)} to the W&B run {recorded!r} and "
        "saved no checkpoint; this run trains from step 1 again, in a new W&B run (in that one, W&B would keep the "
        "earlier rows for those steps and drop this run's)",
        flush=True,
    )
    return ""


def keep_offline_runs(output_dir: str | Path) -> Path | None:
    """Move `<output_dir>/wandb` aside to `<output_dir>.wandb-offline-<time>/` before the folder is replaced, when it
    holds offline runs: they exist nowhere else until `wandb sync`."""
    source = Path(os.path.abspath(output_dir)) / "wandb"  # `--output_dir .`: a folder beside the one run in
    if not offline_run_folders(source):
        return None
    target = offline_runs_kept_in(output_dir, time.strftime("%Y%m%d-%H%M%S"))
    source.rename(target)
    return target


def offline_runs_kept_in(output_dir: str | Path, when: str) -> Path:
    """Where `keep_offline_runs` moves them: `<output_dir>.wandb-offline-<when>` beside the folder."""
    folder = Path(os.path.abspath(output_dir))
    return folder.with_name(f"{folder.name}.wandb-offline-{when}")


def offline_run_folders(folder: Path) -> list[Path]:
    """The folders under `folder` that hold W&B offline runs, at any depth: WANDB_DIR=<output_dir>/wandb puts them in
    <output_dir>/wandb/wandb/, which the run's `wandb` folder holds (and `--overwrite_output_dir` deleted)."""
    return sorted({p.parent for p in folder.rglob("offline-run-*")})


class WandbStepIsGlobalStep(TrainerCallback):
    """Log to W&B at `_step` = the optimizer step (wrapping `wandb.log` once WandbCallback started the run), so a
    resumed run's history holds every step once: WandbCallback logs without a step, so W&B numbers rows per process,
    an offline run resumed after a SIGKILL restarts at 0, and once synced W&B drops every row not above its last step.

    A resumed run first logs again metrics.jsonl's rows up to its checkpoint (`replay`): a SIGKILL loses the rows W&B
    still buffered, missing from W&B for good otherwise. A step W&B already has keeps its first values (online, rows
    below `starting_step` are not sent; offline, `wandb sync` drops them)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if "wandb" not in (args.report_to or []):  # W&B is optional: not imported (nor required) unless used
            return
        import wandb

        if wandb.run is None:
            return
        log_settings(wandb.run, Path(args.output_dir) / run_record.RESOLVED)
        if getattr(wandb.log, "at_global_step", False):
            return
        log = wandb.log

        def log_at_global_step(data, step=None, commit=None):
            step = data.get("train/global_step") if step is None else step  # WandbCallback.on_log adds it
            return log(data, step=None if step is None else int(step), commit=commit)

        log_at_global_step.at_global_step = True
        wandb.log = log_at_global_step
        if state.global_step and state.is_world_process_zero:
            replay(Path(args.output_dir) / METRICS_FILE, wandb.run.starting_step, state.global_step)


def log_settings(run, resolved: Path) -> None:
    """The run's settings (resolved_config.json, written before training begins) as the W&B run's config, over what
    WandbCallback logged: transformers' arguments as handed to TRL, `padding_free: false` for a packed run and
    `push_to_hub: false` for one that pushes (this project's own push), without the data set, LoRA or batching."""
    values = records.json_object(resolved) or {}
    settings = {k: v for k, v in values.items() if k not in ("derived", run_record.SEAL)}
    if settings:
        run.config.update(settings, allow_val_change=True)


def replay(path: Path, first: int, last: int) -> None:
    """Log metrics.jsonl's rows of steps `first` to `last` to W&B as WandbCallback logged them, at their own step."""
    import wandb

    for record in read_metrics(path):
        if first <= record["step"] <= last:
            logs = {k: v for k, v in record.items() if k not in ("step", "resumed_from")}
            wandb.log({**rewrite_logs(logs), "train/global_step": record["step"]})

"""What scripts/launch.sh asks the package, so that the script reads neither the recipe nor the record itself:
`engine <recipe> [<train args>]` names the accelerate config the job launches with, `summary` (the dry run's JSON on
stdin) prints the job's batch, memory plan and output folder, and ends the job (exit code 2) where the run would
refuse, `asks dry_run|preflight <recipe> [<train args>]` whether the job is a dry run or a preflight, `warning-lead
<script> [<submit line>]` how long before its time limit the job is warned to checkpoint (or, on stderr, that it is not,
with the fix), and `time-limit <lead> <where> <grace> <partition> <time left>` prints the log's line of how long a
checkpoint may take and refuses a time limit within the warning; `warned-start <lead> <where> <time left> <seconds>
<when>` refuses to requeue a job start its time-limit warning stopped before it saved anything; `killed-by-srun <job
id>` says what a SIGTERM sent to srun itself lost; `go-on <job id> [<array job id>]` how to go on from what a job Slurm
does not requeue saved."""

import contextlib
import functools
import os
import re
import shlex
import sys
from pathlib import Path

from dpotrain.recipe import config, recipe_file, records, run_record
from dpotrain.recipe.cli import TRUE
from dpotrain.recipe.config import ProjectArguments
from dpotrain.recipe.errors import ConfigError, plural, run_command, warn

ENGINE_FLAGS = ("--accelerate_config", "--accelerate-config")  # the field's flag, as the parser takes it


def engine(recipe: str, train_args: list[str] | None = None) -> str:
    """The accelerate config the job launches with: launch.sh's ACCELERATE_CONFIG, else an `--accelerate_config` among
    the job's arguments (the last, as the run's parser takes it: its dry run plans that one), else the recipe's own
    (think-32b.yaml names ZeRO-3); `none` (plain `python train_dpo.py`) or none given: the default,
    accelerate_config.yaml. ACCELERATE_CONFIG and an argument naming another file are refused: one would be ignored."""
    args, given = train_args or [], None
    for i, word in enumerate(args):
        flag, eq, value = word.partition("=")
        if flag in ENGINE_FLAGS:
            given = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    env = os.environ.get("ACCELERATE_CONFIG")
    if env and given is not None and given != env:
        raise ConfigError(
            f"ACCELERATE_CONFIG={env} and --accelerate_config {given} name different engines: keep one of them"
        )
    named = env or given
    named = os.path.expanduser(named) if named else named  # `--accelerate_config=~/z.yaml`: no shell expands that `~`
    if named and (there := config.in_submit_dir(named)) is not None and there.is_file():
        # The job's own (ACCELERATE_CONFIG=my_accel.yaml or an argument): the folder submitted from's where it is
        # there, as the command line's other paths (the job runs in the project, where it was refused as not found)
        return str(there)
    if named is None and (own := recipe_file.load(recipe).get("accelerate_config")) is not None:
        # as written, as the run reads it (`1.10` is no float 1.1), `~` its home: launch.sh's `-f` check took it as
        # written, and a recipe's `accelerate_config: ~/zero3.yaml` was refused as not found
        named = os.path.expanduser(recipe_file.written(own))
    return named if named and named.lower() != "none" else ProjectArguments.accelerate_config


def asks(field: str, recipe: str, train_args: list[str]) -> bool:
    """The job's arguments ask for a dry run (`field` dry_run) or a preflight (`preflight`), however they spell it, or
    its recipe does (`dry_run: true`) and they do not turn it off. Read from the arguments alone, a recipe's dry run was
    launched: every process of every node set up its engine to print the plan again, and the log ended "training exited
    with code 0"."""
    given = config.dry_run_flag(train_args, field)
    if given is not None:
        return given
    return str(recipe_file.load(recipe).get(field, False)).lower() in TRUE


def summary(text: str) -> int:
    """The lines a job's log shows of its dry run; what the run would refuse (a login missing, the output folder) as
    its own `error:` lines, and 2: the job ends in seconds, before any process starts."""
    start = max(text.find("{\n"), 0)  # a library may print a line of its own before the JSON
    r = run_record.parse(text[start:], "the dry run's output")
    b, world, memory = r.batching, r.launch.world_size, r.memory
    output = os.path.abspath(r.output.output_dir)  # where the run writes, whatever folder reads the log
    per_step = f"= {b.pairs_per_micro_batch} per process x {b.micro_batches_per_step} accumulation x "
    per_step += plural(world, "process")
    if tokens := b.max_tokens_per_microbatch:  # micro-batches cut by tokens: their count per step comes from the data
        per_step = f"over {plural(world, 'process')}, micro-batches of at most {tokens} packed tokens per process"
    taken = b.pairs_per_step_trained  # an epoch's last step takes what is left (all of an epoch under one step)
    if taken is not None and not taken.min == taken.max == b.pairs_per_step:
        per_step += f"; the steps take {taken} pairs"
    print(f"batch: {plural(b.pairs_per_step, 'pair')} per step {per_step}; output: {output}")
    if memory.per_gpu_gib:
        gpu = f"of {memory.gpu_memory_gib} GiB" if memory.gpu_memory_gib else f"(GPU memory {memory.gpu_memory_source})"
        print(f"memory plan: ~{memory.per_gpu_gib['total']} GiB per GPU {gpu} under {memory.engine}")
    elif memory.skipped:
        print(f"memory plan skipped: {memory.skipped}")
    # What the run would refuse, the engine launch.sh launches included (it gives the dry run its config): refused
    # here, before every node starts its processes.
    for refusal in r.output.would_refuse:
        print(f"error: {refusal}", file=sys.stderr)
    return 2 if r.output.would_refuse else 0


# `--signal=[{R|B}:]<sig>[@<seconds>]` (sbatch(1); no @: 60 s); B:USR1 is the warning launch.sh checkpoints on
SIGNAL = re.compile(r"(?P<flags>[RB]*:)?(?:SIG)?(?P<sig>\w+)(?:@(?P<lead>\d+))?")
_SIGNAL_LINE = re.compile(r"^#SBATCH\s+--signal[= ]", re.MULTILINE)


def warning_lead(script: str, submit_line: str = "", stored: str = "", allocation: bool = False) -> str:
    """`<seconds> <where it was set>` of the job's time-limit warning (empty for none), as sbatch resolves --signal: its
    command line over SBATCH_SIGNAL over the script's last `#SBATCH --signal`. Read from the script alone, `sbatch
    --signal=B:USR1@60 scripts/dpo_train.sh` was checked and timed against the script's 600 s. `submit_line`: the
    job's sbatch command (sacct's SubmitLine; empty where the cluster keeps no accounting). `stored`: the script as
    Slurm stored it at submission (`scontrol write batch_script`), whose #SBATCH lines the job was given: the file may
    have been edited since (a job pending or requeued for days), and read from it, a warning Slurm does not send was
    checked against the job's time limit. `allocation`: a job salloc or srun made, which has no batch script or
    shell: Slurm sends its --signal (salloc's or srun's) to the job's steps, the training processes among them, which
    stop on USR1 as on the stop file."""
    found, late = None, ""
    if allocation:
        words = submit_line.split()
        # salloc's and srun's own variables for --signal (SBATCH_SIGNAL is sbatch's), under their command line
        given = [os.environ[name] for name in ("SLURM_SIGNAL", "SALLOC_SIGNAL") if os.environ.get(name)]
        given += [w.removeprefix("--signal=") for w in words if w.startswith("--signal=")]
        given += [after for before, after in zip(words, words[1:], strict=False) if before == "--signal"]
        spec = SIGNAL.fullmatch(given[-1]) if given else None
        if spec and spec["sig"].upper() in ("USR1", "10"):
            return f"{spec['lead'] or 60} the allocation's --signal"
        warn(
            "no time-limit warning is set for this allocation (salloc, or a job srun made: no batch script; no "
            "--signal=USR1@<seconds>): at its time limit Slurm sends SIGTERM and kills it KillWait later (30 s by "
            "default): a checkpoint that takes longer is cut off, and the steps since the last one are lost; give "
            "salloc --signal=USR1@600 (srun --signal=USR1@600 for a job srun made), or submit the script with sbatch, "
            "whose `#SBATCH --signal=B:USR1@600` requeues the job too"
        )
        return ""
    with contextlib.suppress(OSError):  # no script (sbatch --wrap), or one gone
        text = stored or Path(script).read_text()
        # sbatch(1) reads #SBATCH lines only above the script's first command: one below it (appended as the warning
        # below says, `add ... to <script>`) is not the job's, and was taken for a warning Slurm never sends.
        command = re.search(r"^[ \t]*[^\s#]", text, re.MULTILINE)
        end = command.start() if command else len(text)
        given = re.findall(r"^#SBATCH\s+--signal[= ]\s*(\S+)", text[:end], re.MULTILINE)
        # sbatch drops a directive's double quotes (`--signal="B:USR1@600"` is B:USR1@600): kept, the warning was said
        # not to reach the batch shell, and a time limit within it was not refused (the job requeued at every start).
        found = (given[-1].replace('"', ""), script) if given else None  # the last one wins, as in sbatch
        if _SIGNAL_LINE.search(text[end:]):
            late = " (sbatch reads an #SBATCH line only above the script's first command)"
    if os.environ.get("SBATCH_SIGNAL"):
        found = (os.environ["SBATCH_SIGNAL"], "SBATCH_SIGNAL")
    try:
        words = shlex.split(submit_line)
    except ValueError:  # SubmitLine joins the words with spaces, quotes dropped: a lone quote of a script argument
        words = submit_line.split()
    for i, word in enumerate(words[1:], 1):  # sbatch's options, up to the script (after it: the script's arguments)
        if os.path.basename(word) == os.path.basename(script or "\0"):
            break
        if word == "--signal" and i + 1 < len(words):
            found = (words[i + 1], "sbatch's command line")
        elif word.startswith("--signal="):
            found = (word.removeprefix("--signal="), "sbatch's command line")
    if found is None:
        warn(
            "no time-limit warning is set for this job (no --signal=B:USR1@<seconds>): at its time limit "
            "Slurm sends SIGTERM and kills it KillWait later (30 s by default): a checkpoint that takes longer is cut "
            f"off, and the steps since the last one are lost; {_signal_fix(600, None, script)}{late}"
        )
        return ""
    spec = SIGNAL.fullmatch(found[0])
    if spec is None or "B" not in (spec["flags"] or "") or spec["sig"].upper() not in ("USR1", "10"):
        # sbatch(1): without B:, the signal goes to the job's steps (srun's processes), not to the batch shell
        why = " (without B:, Slurm signals the job's steps only)" if spec and "B" not in (spec["flags"] or "") else ""
        warn(
            f"the job's --signal={found[0]} ({found[1]}) does not send USR1 to the batch shell, "
            f"which checkpoints before the time limit{why}: {_signal_fix(spec and spec['lead'] or 600, *found)}"
        )
        return ""
    return f"{spec['lead'] or 60} {found[1]}"


def _signal_fix(lead, given: str | None, where: str) -> str:
    """The fix, where the job's --signal came from (or, with none, in its script): B:USR1 at the same lead."""
    signal = f"--signal=B:USR1@{lead}"
    if where == "SBATCH_SIGNAL":
        return f"set SBATCH_SIGNAL=B:USR1@{lead}"
    if where == "sbatch's command line":
        return f"submit with sbatch {signal}"
    in_script = f" {'in' if given else 'to'} {where}" if where else ""
    return f"{'use' if given else 'add'} `#SBATCH {signal}`{in_script} (or submit with sbatch {signal})"


def seconds_left(left: str) -> int | None:
    """squeue's %L (`[days-][hours:]minutes:seconds`) in seconds; None for no limit (UNLIMITED, NOT_SET, none)."""
    parts = re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+)*)", left.strip())
    if parts is None:
        return None
    return functools.reduce(lambda s, part: s * 60 + int(part), parts[2].split(":"), 0) + 86400 * int(parts[1] or 0)


def duration(seconds: int) -> str:
    """'10 minutes', '1 minute', '90 seconds': in whole minutes where it is some, else in seconds."""
    return plural(seconds // 60, "minute") if seconds and not seconds % 60 else plural(seconds, "second")


def checkpoint_window(lead: str, grace: str, partition: str) -> str:
    """The job's log line of how long a checkpoint may take (`lead`: warning_lead's seconds, empty for no warning;
    `grace`: the partition's preemption GraceTime)."""
    grace_text = f"{grace} s (partition {partition}'s preemption GraceTime)" if int(grace or 0) else ""
    if lead:
        return f"checkpoints must be written within {lead} s (time-limit warning)" + (
            grace_text and f" and {grace_text}"
        )
    if grace_text:
        return f"checkpoints must be written within {grace_text}; no time-limit warning is set"
    return (
        "checkpoints must be written within KillWait (30 s by default: scontrol show config): no time-limit warning is "
        f"set, and partition {partition or '(none)'} has no preemption GraceTime"
    )


def unseen_variable(lead: str, where: str) -> str:
    """What the job's lead line adds where the lead is its script's and an SBATCH_SIGNAL may have been set instead: a
    job submitted with --export=NONE, or a list of variables without ALL (Slurm puts it in SLURM_EXPORT_ENV), gets
    the warning of the submitting shell's SBATCH_SIGNAL but not the variable, and Slurm shows a job's --signal nowhere
    (neither `scontrol show job` nor a SLURM_* variable, Slurm 22.05): a job given @60 so was timed and checked
    against its script's @600."""
    exported = os.environ.get("SLURM_EXPORT_ENV", "")
    names = [item.split("=", 1)[0] for item in exported.split(",")]
    read_elsewhere = ("SBATCH_SIGNAL", "sbatch's command line", "the allocation's --signal")
    # A list naming SBATCH_SIGNAL passed it on: none was set where the job was submitted
    if not lead or where in read_elsewhere or names[0].upper() in ("", "ALL") or "SBATCH_SIGNAL" in names:
        return ""
    given = "--export=NONE" if exported.upper() == "NONE" else "an --export list without ALL"
    return (
        f"; {lead} s is what {where} sets: this job was submitted with {given}, so an SBATCH_SIGNAL in "
        "the shell that submitted it is not seen here, though Slurm sends its warning (a job's --signal is shown "
        "nowhere): set the lead in the script, or pass the variable on (--export=SBATCH_SIGNAL,...)"
    )


def check_time_left(lead: str, where: str, left: str) -> None:
    """Refuses a time limit (`left`, squeue's %L) within the warning: Slurm would send it at once, and the job would
    stop at its first step to save, at every requeue."""
    seconds = seconds_left(left)
    if lead and seconds is not None and seconds <= int(lead):
        raise ConfigError(
            f"the job's time limit ({left} left) is within its checkpoint warning (--signal=B:USR1@{lead}), which "
            "Slurm would send at once: every requeue would stop at its first step to save; submit with --time above "
            f"{duration(int(lead))}, or lower the @{lead} in {where}"
        )


# launch.sh's `warned-start` <when>: where the start was when the warning stopped it
WARNED_WHEN = {
    "before-launch": "before training was launched",
    "nothing-saved": "before this start saved anything (no reference pairs, no checkpoint)",
}


def check_warned_start(lead: str, where: str, left: str, started: str, when: str) -> None:
    """One rule for a job start that the time-limit warning stopped before it saved anything (`when`: before training
    was launched, or after, the run's processes saying they saved nothing: `.checkpointed`'s NOTHING_SAVED line;
    `started`: the seconds since the start): not requeued, where it was that warning (`left`, squeue's %L, within it;
    Slurm may send it up to 60 s early). Every requeue gets the same limit and would be warned as early, saving nothing
    again, start after start, until someone cancelled the job. A USR1 with more time left (`scancel --signal=USR1`) is
    requeued by launch.sh, as is a start that saved something (a checkpoint, reference pairs: the next one goes on
    from it). A time left within the warning at the job's start is this case foreseen, refused before the plan
    (`check_time_left`)."""
    seconds = seconds_left(left)
    if lead and seconds is not None and seconds <= int(lead) + 60:
        raise ConfigError(
            f"the time-limit warning (--signal=B:USR1@{lead}) came {WARNED_WHEN[when]}, in the job's start-up of "
            f"{started} s ({left} left): every requeue would be warned as early and never train, so the job is not "
            "requeued; submit with a --time longer than the warning, the start-up and some training, or lower the "
            f"@{lead} in {where}: the same command goes on from the newest checkpoint"
        )


def newest_complete(out: Path) -> int:
    """The step of the newest `checkpoint-N` in `out` marked COMPLETE (dpotrain/train/checkpoints.py: the one a
    requeue goes on from; read here without that module's imports); 0: none."""
    found = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)]
    return max((step for step in found if (out / f"checkpoint-{step}" / "COMPLETE").is_file()), default=0)


def killed_by_srun(out: Path, job: str) -> str:
    """The job's log line where srun itself was sent the SIGTERM (`scancel --signal=TERM --full`: every process of the
    job, srun among them) while the job runs on: srun answers a SIGTERM it receives with a SIGKILL of its tasks
    ("srun: forcing job termination"), whatever they handle, and no signal handling around it can spare them (srun
    takes SIGTERM back from an ignored one and waits for it), so the training processes never saved. What was lost,
    read from the output folder `out`: the steps metrics.jsonl logged past the newest complete checkpoint; and how to
    stop with a checkpoint."""
    saved = newest_complete(out)
    steps = [r["step"] for r in records.read(out / "metrics.jsonl", step=True) if "loss" in r]
    since = f"since checkpoint-{saved}" if saved else "since the run's start (no complete checkpoint)"
    back = f"goes on from {out / f'checkpoint-{saved}'}" if saved else "starts the run again"
    if steps and steps[-1] > saved:  # a step is logged after its end: one trained, not yet logged, is lost too
        logged = f"{saved + 1} to {steps[-1]}" if steps[-1] > saved + 1 else f"{steps[-1]}"
        lost = f"the steps trained {since} are lost: {logged} (the last logged), and any after it"
    else:
        lost = f"any step trained {since} is lost (none was logged past it)"
    return (
        "srun was sent the SIGTERM too (scancel --signal=TERM --full signals every process of the job, srun among "
        'them), and srun kills its training processes at once on a SIGTERM ("srun: forcing job termination"), before '
        f"they could save: {lost}; its requeue {back}. To stop a job with a checkpoint, "
        f"signal its training processes alone, `scancel --signal=TERM {job}` (what a preemption sends), or its batch "
        f"shell with the time-limit warning's signal, `scancel --signal=USR1 --batch {job}`"
    )


def go_on(out: str, *ids: str) -> str:
    """How to go on from what a stopped job saved where Slurm does not requeue it (a `scancel`, a job submitted with
    `--no-requeue`). The same command again, but where the output folder is named after the job (`output_dir:
    /scratch/runs/$SLURM_JOB_ID`, docs/running.md; `ids`: the job's id and its array's), a new job names a new folder:
    that advice started the run again from step 0, the saved checkpoints left in the old folder. Then the folder is
    named on the command line, which the new job resumes from (a folder merely holding the id is named all the same:
    naming the folder a run resumes from is never wrong)."""
    named = [i for i in ids if i and re.search(rf"(?<![0-9]){re.escape(i)}(?![0-9])", out)]
    if not named:
        return "submit the same command again to go on from what was saved"
    return (
        f"submit the same command again with --output_dir {shlex.quote(out)} to go on from what was saved (its folder "
        f"is named after this job's id {named[0]}: a new job's id names a new folder, which would start the run from "
        "step 0)"
    )


def main(argv: list[str] | None = None) -> int:
    verb, *args = (sys.argv[1:] if argv is None else argv) or [""]
    if verb == "engine" and args:
        print(engine(args[0], args[1:]))
        return 0
    if verb == "summary" and not args:
        return summary(sys.stdin.read())
    if verb == "asks" and len(args) > 1 and args[0] in ("dry_run", "preflight"):  # exit 0 when the job asks for it
        return 0 if asks(*args[:2], args[2:]) else 1
    if verb == "warning-lead" and len(args) in (1, 2, 3, 4):  # the 4th: batch, or allocation (launch.sh)
        print(warning_lead(*args[:3], allocation=args[3:] == ["allocation"]))
        return 0
    if verb == "time-limit" and len(args) == 5:  # <lead> <where> <grace> <partition> <time left>
        lead, where, grace, partition, left = args
        # in the log also above a refusal
        print(checkpoint_window(lead, grace, partition) + unseen_variable(lead, where), flush=True)
        check_time_left(lead, where, left)  # a refusal: one error: line, exit 2
        return 0
    if verb == "killed-by-srun" and len(args) == 1:  # <job id>, the dry run's JSON on stdin
        text = sys.stdin.read()
        record = run_record.parse(text[max(text.find("{\n"), 0) :], "the dry run's output")
        warn(killed_by_srun(Path(os.path.abspath(record.output.output_dir)), args[0]))
        return 0
    if verb == "go-on" and len(args) in (1, 2):  # <job id> [<array job id>], the dry run's JSON on stdin
        text = sys.stdin.read()
        record = run_record.parse(text[max(text.find("{\n"), 0) :], "the dry run's output")
        print(go_on(os.path.abspath(record.output.output_dir), *args))
        return 0
    if verb == "warned-start" and len(args) == 5 and args[4] in WARNED_WHEN:
        check_warned_start(*args)  # <lead> <where> <time left> <seconds since the start> <when>
        return 0
    raise ConfigError(
        "usage: python -m dpotrain.cluster.job engine <recipe> [<train args>] | summary < <the dry run's JSON> | "
        "asks dry_run|preflight <recipe> [<train args>] | "
        "warning-lead <script> [<submit line> [<stored script> [batch|allocation]]] | "
        "time-limit <lead> <where> <grace> <partition> <time left> | warned-start <lead> <where> <time left> "
        "<seconds since the start> before-launch|nothing-saved | killed-by-srun <job id> < <the dry run's JSON> | "
        "go-on <job id> [<array job id>] < <the dry run's JSON>"
    )


if __name__ == "__main__":
    run_command(main)

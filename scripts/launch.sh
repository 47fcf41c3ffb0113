#!/usr/bin/env bash
# The launcher behind scripts/dpo_train.sh and scripts/dpo_instruct_train.sh; runs in the batch shell of a job.
#
# Environment (all optional except RECIPE, which the sbatch scripts set):
#   RECIPE=configs/think.yaml            the recipe passed to train_dpo.py --config
#   DPOTRAIN_ROOT=<the submit folder>    the project folder, for a copy of this file outside one (the sbatch scripts set it)
#   ACCELERATE_CONFIG=<an --accelerate_config argument, else the recipe's, else accelerate_config.yaml>   the engine
#   VENV=.venv                           the project's virtual environment (bash scripts/setup_env.sh)
#   MAIN_PROCESS_PORT=<from the job id>  rendezvous port on the first node (20000-29999: two jobs sharing a node
#                                        do not collide; one in use there: the next free one. Given: checked, kept)
#   (GPUs per node: the job's --gpus-per-node, 4 or 8: accelerate's --num_processes and the memory plan follow it)
#   CPU_PROCESSES_PER_NODE=1             processes per node when the job has no GPUs (--gpus-per-node=0)
#   DPOTRAIN_STOP_FILE=<project>/logs/.stop-%j   the job's stop file (%j: the job id), in a folder every node sees
#                                        and the job can write (a read-only project: give one elsewhere)
#   LAUNCH_PRINT_ONLY=1                  print the srun + accelerate launch line and exit (used by the tests)
#   PREFLIGHT=1                          first score a sample with the base model (scripts/preflight.py); stop on fail
#                                        (true/yes too; 0, false, no or unset: none; another word is refused)
# Arguments: passed to train_dpo.py after the recipe (e.g. --learning_rate 5e-7 --max_steps 100).
set -euo pipefail
# A stop signal before the traps below are set (the time-limit warning's USR1 in a job's start-up, `scancel --signal`)
# ended the batch shell by bash's default action: the job FAILED without a line in its log, never requeued. Noted from
# here (the sbatch scripts note one from their start: DPOTRAIN_EARLY_STOP), and answered instead of the launch.
early_stop=${DPOTRAIN_EARLY_STOP:-}
unset DPOTRAIN_EARLY_STOP
trap 'early_stop=USR1' USR1
trap 'early_stop=${early_stop:-TERM}' TERM
# All of it read before it runs (one { } block, to its last line): the job's batch shell runs this file for the whole
# training, and bash reads a script as it goes, so one written over in place meanwhile (an editor saving over it, `cp`
# of a newer checkout) was read on at the old offset once training ended: a finished job failed on half a line.
{

# Run directly (`bash scripts/launch.sh`, in an allocation too), the folder it was typed in is the one relative paths
# are read in, as a job's folder submitted from is (dpotrain/recipe/config.py), and the project is the one this file
# is in: SLURM_SUBMIT_DIR, where salloc ran, or the folder typed in held none ("no virtual environment at .venv").
typed_in=$PWD
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -f $here/train_dpo.py ]] || here=""  # a copy of this file outside a project: as before
# The sbatch scripts find the project (Slurm runs a spool copy of them), run its launch.sh and set DPOTRAIN_ROOT to it.
# The project this file is in comes first, as in the sbatch scripts: a DPOTRAIN_ROOT exported for another checkout (as
# an edited copy of them asks) ran that checkout's train_dpo.py and venv under `bash ~/dpotrain-exp/scripts/launch.sh`.
cd "${here:-${DPOTRAIN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}}"
[[ -n ${DPOTRAIN_SUBMIT_DIR:-} || $typed_in == "$PWD" ]] || export DPOTRAIN_SUBMIT_DIR=$typed_in
# Unset: one error: line (bash's own `${RECIPE:?}` printed "scripts/launch.sh: line 27: RECIPE: set RECIPE ...").
[[ -n ${RECIPE:-} ]] || { echo "error: set RECIPE, e.g. RECIPE=configs/think.yaml bash scripts/launch.sh" >&2; exit 1; }
die() { echo "error: $*" >&2; exit 1; }
# A quoted ~ (`RECIPE="~/recipes/think.yaml" sbatch ...`) reaches the job as typed: bash expands one only unquoted, at
# the start of a word. The job looked for a folder named `~` ("recipe ~/recipes/think.yaml not found"); it is the home
# folder, as the shell would have made it (`~user/`: that user's, from the passwd database).
home_path() {
  local name=$1 value=$2 user home
  [[ $value == "~"* ]] || { printf '%s\n' "$value"; return 0; }
  user=${value%%/*}
  user=${user#"~"}
  if [[ -z $user ]]; then
    home=${HOME:-}
    [[ -n $home ]] || die "$name=$value: HOME is not set, so its ~ names no folder: give the full path"
  else
    home=$(getent passwd "$user" | cut -d: -f6) || home=""
    [[ -n $home ]] || die "$name=$value: there is no user $user for its ~: give the full path"
  fi
  printf '%s\n' "${home%/}${value#"~$user"}"
}
RECIPE=$(home_path RECIPE "$RECIPE")
[[ -z ${ACCELERATE_CONFIG:-} ]] || ACCELERATE_CONFIG=$(home_path ACCELERATE_CONFIG "$ACCELERATE_CONFIG")
# A relative RECIPE is the one in the folder submitted from where it is there, as a relative path on the job's command
# line is (dpotrain/recipe/config.py); else the project's (configs/think.yaml). Looked for in the project alone,
# `RECIPE=my.yaml sbatch /path/to/dpotrain/scripts/dpo_train.sh` from the recipe's folder was refused as not found.
submitted=${DPOTRAIN_SUBMIT_DIR:-$PWD}
# The sbatch scripts' own default (DPOTRAIN_RECIPE_GIVEN empty) is the project's: submitted from another checkout, the
# job ran this project's code on that checkout's configs/think.yaml.
given=${DPOTRAIN_RECIPE_GIVEN-1}
if [[ -n $given && $RECIPE != /* && $submitted != "$PWD" && -f $submitted/$RECIPE ]]; then RECIPE=$submitted/$RECIPE; fi
# A job submitted with --export=NONE (or under a site's SBATCH_EXPORT=NONE), or with a list of variables without ALL,
# starts without the variables of the shell sbatch ran in (Slurm: SLURM_EXPORT_ENV): `RECIPE=configs/instruct.yaml
# sbatch --export=NONE scripts/dpo_train.sh` trained the script's default recipe without a word. Said where the recipe
# is that default (a list naming RECIPE gave it).
exported=${SLURM_EXPORT_ENV:-}
if [[ -n $exported && -z $given && ,${exported^^}, != *,ALL,* ]]; then
  how="an --export list without ALL or RECIPE ($exported)"
  [[ ${exported^^} != NONE ]] || how="--export=NONE (sbatch's option, or SBATCH_EXPORT)"
  echo "warning: this job was submitted with $how, so a RECIPE, ACCELERATE_CONFIG, VENV or PREFLIGHT set in the" \
    "shell sbatch ran in is not seen here: it runs the script's default recipe, $RECIPE; pass them on (sbatch" \
    "--export=ALL,RECIPE=configs/my.yaml ...)" >&2
fi
VENV=$(home_path VENV "${VENV:-.venv}")  # quoted, its ~ was "no virtual environment at ~/venvs/dpo" (home_path)
case $VENV in /*) VENV_BIN=$VENV/bin ;; *) VENV_BIN=$PWD/$VENV/bin ;; esac

[[ -x "$VENV/bin/accelerate" ]] || die "no virtual environment at $VENV: run \`bash scripts/setup_env.sh\` on the login node"
# Its python must run here: a venv made with a Python this node does not have (a module the job did not load, a pyenv
# in a home the node does not mount) ended the job in bash's "launch.sh: line 88: .venv/bin/python: No such file or
# directory", or the loader's "error while loading shared libraries: libpython3.11.so.1.0".
if ! ran=$("$VENV/bin/python" -c '' 2>&1); then
  [[ -e $VENV/bin/python ]] || ran="it links to $(readlink -m -- "$VENV/bin/python"), which is not there"
  die "the virtual environment's python, $VENV/bin/python, does not run on $(hostname -s) (${ran##*$'\n'}): load" \
    "the module of the Python it was made with (the sbatch script's \`module load\` lines), or make it again with a" \
    "Python every node has"
fi
# --help (-h, --help-all): train_dpo.py's help, which names this script's command too, and nothing else. It came after
# the job's banner and its time-limit lines (`bash scripts/dpo_train.sh --help` outside Slurm: "no time-limit
# warning is set for this job"), from the dry run the job plans with.
for arg in "$@"; do
  case $arg in -h | --help | --help-all) exec "$VENV/bin/python" train_dpo.py "$arg" ;; esac
done
# A folder is there: "not found" of it sent the user looking for it
[[ ! -d "$RECIPE" ]] || die "recipe $RECIPE is a folder, not a recipe file: set RECIPE=${RECIPE%/}/<name>.yaml"
[[ -f "$RECIPE" ]] || die "recipe $RECIPE not found: set RECIPE=configs/<name>.yaml (see configs/)"
# The engine: ACCELERATE_CONFIG, else an --accelerate_config among the arguments, else the recipe's own
# (configs/think-32b.yaml names ZeRO-3); the package reads the recipe (dpotrain/cluster/job.py), as training does. The
# dry run and every node's train_dpo.py get it last: they plan and record the engine launched.
ACCELERATE_CONFIG=$("$VENV/bin/python" -m dpotrain.cluster.job engine "$RECIPE" "$@")
# PREFLIGHT read as the recipe's yes/no fields are (dpotrain/recipe/cli.py: TRUE, FALSE): `PREFLIGHT=true` (or yes)
# was compared with 1 alone, so the job trained for hours without the preflight it was asked for, and said nothing.
case ${PREFLIGHT:-0} in
  [Tt]rue | TRUE | [Yy]es | YES | 1 | [TtYy]) PREFLIGHT=1 ;;
  [Ff]alse | FALSE | [Nn]o | NO | 0 | [FfNn]) PREFLIGHT=0 ;;
  *) die "PREFLIGHT='$PREFLIGHT' is not a yes or no: give PREFLIGHT=1 for the preflight before training, or unset it" ;;
esac
# From the job id, below Linux's ephemeral port range: two jobs on one node must not meet at the same port. Jobs whose
# ids differ by a multiple of 10000, or any other process, may hold it there: `free_port` moves it to a free one.
PORT_GIVEN=${MAIN_PROCESS_PORT:+1}
# One given is a port every node can meet at: a word or one past 65535 ended the job in a traceback from free_port's
# check, 0 (each node's agent a free port of its own) was launched as the meeting point, `08` was bound as port 8.
if [[ -n $PORT_GIVEN ]] && ! [[ $MAIN_PROCESS_PORT =~ ^[1-9][0-9]{3,4}$ && $MAIN_PROCESS_PORT -ge 1024 &&
  $MAIN_PROCESS_PORT -le 65535 ]]; then
  die "MAIN_PROCESS_PORT='$MAIN_PROCESS_PORT' is not a port: give a whole number from 1024 to 65535, free on the" \
    "first node, or unset it for a free port from the job id"
fi
MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-$((20000 + ${SLURM_JOB_ID:-9500} % 10000))}
# Slurm sets it to 1 or more; one exported by hand is read too: 0 was launched as `srun --nodes=0` of 0 processes, an
# empty one as one node whatever the allocation, and a word ended the job in bash's "two: unbound variable".
NNODES=${SLURM_JOB_NUM_NODES-1}
[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "SLURM_JOB_NUM_NODES='$NNODES' is not a number of nodes: Slurm sets it to the" \
  "job's nodes (1 or more); unset it (one node), or submit with sbatch --nodes=N"
# --gpus-per-node sets SLURM_GPUS_PER_NODE ("4" or "h100:4"); a --gres=gpu:4 job only has SLURM_GPUS_ON_NODE.
GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}
# Read as numbers below: anything else ended the job in bash's "abc: unbound variable", or planned 0 processes and was
# refused naming WORLD_SIZE, which the user never set.
[[ $GPUS_PER_NODE =~ ^[0-9]+$ ]] || die "cannot read the GPUs per node from Slurm's '$GPUS_PER_NODE'" \
  "(SLURM_GPUS_PER_NODE, SLURM_GPUS_ON_NODE): submit with --gpus-per-node=N (4 or 8; 0 for a CPU-only job)"
# GPUs asked per task (--gpus-per-task, --tres-per-task=gres/gpu:N) are bound to tasks: the one task per node that
# launches (launch_line) sees one task's GPUs, while it starts a process for every GPU of the node.
# Those variables may be another job's: one submitted from inside a job (an `salloc --gpus-per-task=1` shell) inherits
# them through sbatch's --export=ALL, and was refused for GPUs it never asked for. Where Slurm answers, its record of
# this job (TresPerTask=) decides; inherited, they are dropped, as srun would ask them for the training step too.
if [[ -n ${SLURM_GPUS_PER_TASK:-} || ${SLURM_TRES_PER_TASK:-} == *gpu* ]] &&
  record=$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null) && [[ -n $record ]] &&
  [[ $(grep -o 'TresPerTask=[^ ]*' <<<"$record" || true) != *gpu* ]]; then
  unset SLURM_GPUS_PER_TASK
  [[ ${SLURM_TRES_PER_TASK:-} != *gpu* ]] || unset SLURM_TRES_PER_TASK
fi
# The same for the GPU requests of an `salloc --gpus=1` shell (or --gpus-per-socket, --cpus-per-gpu, --ntasks-per-gpu),
# which srun read as its own options: the training step asked for that shell's one GPU, or srun refused it after the
# dry run ("Invalid generic resource (gres) specification", "--ntasks-per-node is mutually exclusive with
# --ntasks-per-gpu"). Dropped where Slurm's record of this job has no such request of its own.
if [[ -n ${SLURM_GPUS:-}${SLURM_GPUS_PER_SOCKET:-}${SLURM_CPUS_PER_GPU:-}${SLURM_NTASKS_PER_GPU:-} ]] &&
  record=$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null) && [[ -n $record ]]; then
  [[ $record == *" TresPerJob="* ]] || unset SLURM_GPUS
  [[ $record == *" TresPerSocket="* ]] || unset SLURM_GPUS_PER_SOCKET
  [[ $record == *" CpusPerTres="* ]] || unset SLURM_CPUS_PER_GPU
  [[ $record =~ NtasksPerTRES:[1-9] ]] || unset SLURM_NTASKS_PER_GPU
fi
if [[ -n ${SLURM_GPUS_PER_TASK:-} || ${SLURM_TRES_PER_TASK:-} == *gpu* ]]; then
  die "the job asks for GPUs per task (--gpus-per-task): launch.sh starts one task per node, which starts a process" \
    "per GPU: submit with --gpus-per-node=N and --ntasks-per-node=1, as scripts/dpo_train.sh does"
fi
if [[ "$GPUS_PER_NODE" -gt 0 ]]; then
  PROCS_PER_NODE=$GPUS_PER_NODE
else
  PROCS_PER_NODE=${CPU_PROCESSES_PER_NODE:-1}  # CPU-only cluster or CI: DeepSpeed on CPU with gloo
  [[ $PROCS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "CPU_PROCESSES_PER_NODE=$PROCS_PER_NODE is not a number of" \
    "processes: give a whole number of 1 or more (the processes per node of a job without GPUs), or unset it (1)"
fi
NUM_PROCESSES=$((NNODES * PROCS_PER_NODE))  # accelerate's --num_processes is the TOTAL over all nodes

# The command every node runs. \$SLURM_PROCID is escaped: it must be read on each node inside srun, not here,
# or every node gets machine rank 0 and the rendezvous hangs (accelerate issue #2816). Each node says in the log
# which rank it read, where it meets the others and how many CPUs its training processes may use (nproc: their
# sched_getaffinity).
# torchrun's agent (inside accelerate launch), on SIGTERM, signals the workers again and SIGKILLs them after ~30 s:
# a checkpoint that takes longer than that, asked for by Slurm's own SIGTERM on preemption, would be lost. So the
# agent ignores SIGTERM (an ignored signal stays ignored across exec, and torchrun's --signals-to-handle, read from
# PET_SIGNALS_TO_HANDLE, keeps it from installing its handler): the workers, which Slurm signals too, checkpoint and
# exit, and the agent with them. USR1 alike: Slurm sends a step's processes `scancel --signal=USR1 <job>` and an
# allocation's `--signal=USR1@...`, which the workers save on, and which ended the agent by its default action: the
# step ended at once, and Slurm killed the workers mid-save.
# The venv's bin comes first on PATH, as activating it would: DeepSpeed compiles its JIT ops (on CPU its shared-memory
# communication op, on GPUs any op not prebuilt) with the `ninja` found on PATH, which the venv has and a node may
# not (the build then fails: "Ninja is required to load C++ extensions"), or has in another version, which does not
# recognise what the other built (its build log hashes commands differently): each op is compiled again, ~45 s on
# 2 cores.
# Each path and argument is a word for the node's bash (%q), inside the double quotes of `bash -c "..."`, which the
# batch shell reads first: its \ " $ ` are escaped so that reading hands it on unchanged. A project folder, recipe or
# accelerate config with a space, or an argument with a $ or ", then reaches train_dpo.py as it was given.
node_word() {
  printf '%q' "$1" | sed 's/[\\"$`]/\\&/g'
}
# --export=ALL: the step gets the batch shell's environment (PATH, the stop file, DPOTRAIN_*) whatever the job was
# submitted with. `sbatch --export=NONE` or `--export=RECIPE=...` (its variables alone, not ALL) is handed on to every
# srun of the job (SLURM_EXPORT_ENV): the step started with no PATH, and failed at once, after the dry run had passed
# ("execve(): bash: No such file or directory").
# --ntasks: one launcher per node whatever tasks the job asked for. srun takes the job's count (SLURM_NTASKS) over its
# own --ntasks-per-node=1 ("can't honor --ntasks-per-node"): `sbatch --ntasks-per-node=4` started 4 `accelerate launch`
# on each node, machine ranks past the machines, and the job failed, then requeued itself, over and over.
# Inside a job step (`srun --pty bash`, the usual way to a shell on a node, then `bash scripts/dpo_train.sh`), that
# step holds the job's CPUs: srun waited for them to start the training step, silently, until the job's time limit.
# --overlap lets the training step share them with the shell's step, which only waits for it. The batch shell and
# salloc's shell are in no step (no SLURM_STEP_ID): their launch line is unchanged.
overlap=""
[[ -z ${SLURM_STEP_ID:-} ]] || overlap=" --overlap"
# --mem=0: the step has all of the job's memory on each node. srun reads SLURM_MEM_PER_NODE/_CPU/_GPU as its --mem
# options, and a job submitted from inside another (an `salloc --mem=8G` shell) inherits that one's through sbatch's
# --export=ALL, where the script's --mem=0 sets none: the training step was held to the other job's 8 GB, or, with its
# SLURM_MEM_PER_GPU, refused ("srun: error: Invalid generic resource (gres) specification") after the dry run.
launch_line() {
  local main_addr=$1; shift
  local train_args="" arg
  for arg in "$@"; do train_args+=" $(node_word "$arg")"; done
  cat <<LINE
srun --nodes=$NNODES --ntasks=$NNODES --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL --mem=0$overlap bash -c "trap '' TERM USR1; export PATH=$(node_word "$VENV_BIN"):\\\$PATH PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT; echo \"node \\\$SLURMD_NODENAME: machine rank \\\$SLURM_PROCID of $NNODES, rendezvous $main_addr:$MAIN_PROCESS_PORT, $NUM_PROCESSES processes, \\\$(nproc) CPUs\"; exec $(node_word "$VENV")/bin/accelerate launch \
--config_file $(node_word "$ACCELERATE_CONFIG") \
--num_machines $NNODES \
--num_processes $NUM_PROCESSES \
--machine_rank \\\$SLURM_PROCID \
--main_process_ip $main_addr \
--main_process_port $MAIN_PROCESS_PORT \
--deepspeed_multinode_launcher standard \
--rdzv_backend static \
train_dpo.py --config $(node_word "$RECIPE")$train_args --accelerate_config $(node_word "$ACCELERATE_CONFIG")"
LINE
}

# The first node of the job hosts the rendezvous. scontrol expands any host list; the fallback covers the common
# forms (gpu07, gpu[07-10,12], a,b) where no Slurm config is at hand (printing the line in tests).
first_node() {
  local list=$1 first
  if first=$(scontrol show hostnames "$list" 2>/dev/null | head -n 1) && [[ -n "$first" ]]; then
    echo "$first"
  elif [[ $list =~ ^([^,\[]+)\[([0-9]+) ]]; then
    echo "${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
  else
    echo "${list%%,*}"
  fi
}
main_addr=$(first_node "${SLURM_JOB_NODELIST:-$(hostname -s)}")

# The rendezvous port, free on the first node, decided once here and written into the launch line, so every node
# meets there. Slurm runs this batch shell on the job's first node, where the port is bound as the rendezvous will
# bind it (torch's store: every address); on another node (a setup that starts it elsewhere) it is left unchecked.
# Past the first 100 ports from the job's, or a MAIN_PROCESS_PORT given that is in use, the job ends in one line
# (a port taken between this check and the rendezvous is still torch's "address already in use").
free_port() {
  [[ $main_addr == "${SLURMD_NODENAME:-$(hostname -s)}" ]] || return 0
  local tries=100 found
  [[ -z $PORT_GIVEN ]] || tries=1
  found=$("$VENV/bin/python" -c '
import socket, sys
start, tries = int(sys.argv[1]), int(sys.argv[2])
for i in range(tries):
    port = 20000 + (start - 20000 + i) % 10000 if tries > 1 else start
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            continue
    print(port)
    break
' "$MAIN_PROCESS_PORT" "$tries")
  if [[ -z $found && -n $PORT_GIVEN ]]; then
    die "MAIN_PROCESS_PORT=$MAIN_PROCESS_PORT is in use on $main_addr (another job or process listens there):" \
      "choose another, or unset it for a free port from the job id"
  fi
  [[ -n $found ]] || die "no free rendezvous port on $main_addr among the 100 from $MAIN_PROCESS_PORT (20000 + job" \
    "id mod 10000): set MAIN_PROCESS_PORT to a free port"
  [[ $found == "$MAIN_PROCESS_PORT" ]] || echo "rendezvous port $MAIN_PROCESS_PORT is in use on $main_addr: using" \
    "$found" >&2
  MAIN_PROCESS_PORT=$found
}

# The arguments as the log shows them: the value of a flag named like a secret (--hub_token hf_...,
# --wandb_api_key=..., --client_secret ...) is masked, so a token given on the command line never reaches the
# Slurm log. Only what is printed is masked; train_dpo.py gets the real values. (`--max_tokens_per_microbatch` is
# not a secret: a name part must be exactly token, secret, password or api_key.)
SECRET_NAME='(^|[_.-])(token|secret|password|api[_-]?key)([_.-]|$)'
SHOWN_ARGS=()
mask_next=0
for arg in "$@"; do
  name=${arg%%=*}; name=${name#--}; name=${name,,}
  if ((mask_next)); then
    SHOWN_ARGS+=(REDACTED); mask_next=0
  elif [[ $arg == -* && $name =~ $SECRET_NAME ]]; then
    if [[ $arg == *=* ]]; then SHOWN_ARGS+=("${arg%%=*}=REDACTED"); else SHOWN_ARGS+=("$arg"); mask_next=1; fi
  else
    SHOWN_ARGS+=("$arg")
  fi
done

if [[ "${LAUNCH_PRINT_ONLY:-0}" == 1 ]]; then
  free_port
  launch_line "$main_addr" "${SHOWN_ARGS[@]}"
  exit 0
fi

# --- checks, each with its fix, before any GPU time is spent ---
[[ -f "$ACCELERATE_CONFIG" ]] || die "accelerate config $ACCELERATE_CONFIG not found: set ACCELERATE_CONFIG"
# The stop file (below): set before the dry run, which refuses a folder it cannot write in (dpotrain/train/preemption.py).
# One per job, in the project's logs/, or where a DPOTRAIN_STOP_FILE given says (the refusal of a project the job cannot
# write in names it; set over here, the job was refused again whatever it was set to): its %j the job id, as in sbatch's
# --output, else the job id after it, so that two jobs submitted with one exported do not stop each other.
stop_file=${DPOTRAIN_STOP_FILE:-$PWD/logs/.stop-%j}
[[ $stop_file == *%j* ]] || stop_file+=-%j
[[ $stop_file == /* ]] || stop_file=$submitted/$stop_file
export DPOTRAIN_STOP_FILE=${stop_file//%j/${SLURM_JOB_ID:-$$}}
mkdir -p "$(dirname "$DPOTRAIN_STOP_FILE")" 2>/dev/null || die "cannot make the folder of the job's stop file" \
  "$DPOTRAIN_STOP_FILE: set DPOTRAIN_STOP_FILE=<a folder every node sees and the job can write>/stop-%j (%j: the job id)"
rm -f "$DPOTRAIN_STOP_FILE" "$DPOTRAIN_STOP_FILE.checkpointed" "$DPOTRAIN_STOP_FILE.health" "$DPOTRAIN_STOP_FILE.refused"
# srun forwards each process's stdout and stderr to this log in chunks of bytes, interleaved: a chunk that ended inside
# a progress bar's block character (3 bytes of UTF-8) left bytes that are no UTF-8 between the step lines, and grep
# called the log a binary file. tqdm (every library's bars) reads its defaults from TQDM_* variables: its ASCII bar,
# unless the user chose one (the dry run's bars too: one kind of bar in the log).
export TQDM_ASCII="${TQDM_ASCII:- 123456789#}"

# The job's restarts as Slurm counts them (scontrol's Restarts=), over a SLURM_RESTART_COUNT found in the environment:
# a job submitted from inside another job (a pipeline's batch job that was itself requeued) inherits that job's through
# sbatch's --export=ALL, which Slurm leaves as it is at a first start. Its first start was then taken for a requeue: a
# `scancel` of it logged "Slurm has requeued job <id> itself" and it stayed cancelled, and a --resume_from_checkpoint
# went on from a newer checkpoint instead of the one named (dpotrain/train/resume.py).
if [[ -n ${SLURM_JOB_ID:-} ]] && restarts=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Restarts=[0-9]*'); then
  export SLURM_RESTART_COUNT=${restarts#Restarts=}
fi
echo "=== DPO job ${SLURM_JOB_ID:-local} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0} at $(date -Is) ==="
# The job's log is where sbatch's --output put it (the sbatch scripts: the folder submitted from), not in the project.
# (Each field read to the end of its line: a folder's name may hold spaces.)
log=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *StdOut=//p' || true)
echo "project: $PWD  log: ${log:-this terminal}"
echo "nodes: $NNODES (${SLURM_JOB_NODELIST:-$(hostname -s)}), processes per node: $PROCS_PER_NODE, total: $NUM_PROCESSES"
# The code the job runs: its commit, "(dirty)" where tracked files changed. Outside a git checkout (a release's tarball)
# `git diff` fails with 129, not a change's 1: every job there was logged "git: unknown (dirty)".
commit=$(git rev-parse --short HEAD 2>/dev/null) || commit=unknown
git diff --quiet 2>/dev/null || [[ $? != 1 ]] || commit+=" (dirty)"
echo "gpus per node: $GPUS_PER_NODE  git: $commit"
echo "recipe: $RECIPE  accelerate: $ACCELERATE_CONFIG  args: ${SHOWN_ARGS[*]}"

# `sbatch scripts/dpo_train.sh --preflight` (or a recipe's `preflight: true`): train_dpo.py's preflight instead of
# training, on this node as PREFLIGHT=1 runs it, is all the job does; exit 3 for a doomed run. It ran inside the dry run
# below, in place of the plan, and the job failed with "the dry run's output: not a run's record" whatever it found.
if "$VENV/bin/python" -m dpotrain.cluster.job asks preflight "$RECIPE" "$@"; then
  "$VENV/bin/python" train_dpo.py --config "$RECIPE" "$@"
  exit 0  # (set -e: a preflight that fails ends the job with its code)
fi
# `sbatch scripts/dpo_train.sh --dry-run` (or a recipe's `dry_run: true`): the plan at this job's size, checked on its
# node, is all the job does. Launched, every process of every node set up its engine first (a rendezvous, DeepSpeed's
# ops: minutes) to print it again, and the log ended "training exited with code 0".
if "$VENV/bin/python" -m dpotrain.cluster.job asks dry_run "$RECIPE" "$@"; then
  # Outside a Slurm job (`bash scripts/dpo_train.sh --dry-run` typed on a login node to preview the job) there is no
  # job to count GPUs in: the plan is this machine's, one process without a GPU, and a newcomer read its refusal
  # ("ZeRO-2 on 1 GPU needs ~199 GiB") as the 4-GPU job's. On stderr: `--dry-run --json` prints JSON alone on stdout.
  [[ -n ${SLURM_JOB_ID:-} ]] || echo "note: not in a Slurm job: planned for this machine alone (processes:" \
    "$NUM_PROCESSES, GPUs per node: $GPUS_PER_NODE), not the job the script asks for; the job's plan:" \
    "sbatch <the script> --dry-run, or python train_dpo.py --config $RECIPE --dry-run with the same arguments" >&2
  WORLD_SIZE=$NUM_PROCESSES GPUS_PER_NODE=$PROCS_PER_NODE "$VENV/bin/python" train_dpo.py --config "$RECIPE" "$@" \
    --accelerate_config "$ACCELERATE_CONFIG"
  exit 0  # (set -e: a dry run that fails ends the job with its code)
fi

# Outside a Slurm job (`bash scripts/dpo_train.sh`, sbatch forgotten) srun, outside an allocation, asked Slurm for a job
# of its own without the script's #SBATCH lines (no GPUs: one CPU process; no time-limit warning, no requeue), or where
# no Slurm answers failed, and the log blamed a node: "srun stopped every node; the first 'srun: error: <node>' ...".
# Refused first, alone: after the time-limit lines ("no time-limit warning is set for this job") and a plan of this
# machine, not of the job, it came last, the warning's fix beside it the wrong one.
[[ -n ${SLURM_JOB_ID:-} ]] || die "not in a Slurm job, so there are no nodes to launch on: submit the script with" \
  "sbatch (sbatch scripts/dpo_train.sh <arguments>), or run it inside an allocation (salloc)"

# How long a checkpoint may take: what the time-limit warning leaves (--signal=B:USR1@<seconds>, as sbatch resolves it:
# its command line, SBATCH_SIGNAL, the submitted script) and the partition's preemption GraceTime. The training processes say when a save took longer.
# Command= is the submitted path, then the script's arguments, joined by spaces: the longest start that is a file.
record=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null || true)
script=$(sed -n 's/^ *Command=//p' <<<"$record")
# An allocation (salloc, or a job srun made: BatchFlag=0) has no batch script: its Command= is `(null)` or srun's
# command, and the warning's fix said to add an #SBATCH line to <folder>/(null) or <folder>/bash.
kind="batch"
[[ $record != *BatchFlag=0* ]] || { kind=allocation; script=""; }
[[ -z $script || $script == /* ]] || script=${SLURM_SUBMIT_DIR:-$PWD}/$script  # relative to where it was submitted
while [[ $script == *" "* && ! -f $script ]]; do script=${script% *}; done
# An sbatch --signal (or SBATCH_SIGNAL) overrides the script's: the command line is read where accounting keeps it.
submit_line=$(timeout 20 sacct -j "${SLURM_JOB_ID:-0}" -X -n -P -o SubmitLine 2>/dev/null | head -n 1 || true)
# The script's #SBATCH lines as Slurm stored them at submission: the file may have been edited since (the job pending
# or requeued for days), and a --signal read from it was checked against the job's time limit instead of Slurm's.
stored=$(timeout 20 scontrol write batch_script "${SLURM_JOB_ID:-0}" - 2>/dev/null || true)
read -r lead lead_from < <("$VENV/bin/python" -m dpotrain.cluster.job warning-lead "${script:-}" "$submit_line" \
  "$stored" "$kind") || true
grace=$(scontrol show partition "${SLURM_JOB_PARTITION:-}" 2>/dev/null | grep -o 'GraceTime=[0-9]*' | cut -d= -f2 || true)
# No warning: no save-time warning against one either (0), and warning-lead has said what that means and the fix.
export DPOTRAIN_SAVE_WARN_S=${lead:-0} DPOTRAIN_GRACE_S=${grace:-0}

# A time limit within that warning: Slurm sends it at once, so the job would stop at its first step to checkpoint, and
# each requeue again (a start, a step, a save, over and over). Refused, before anything is planned or launched; the
# line of how long a checkpoint may take otherwise (dpotrain/cluster/job.py: time_limit).
left=$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %L 2>/dev/null || true)  # [days-]hours:minutes:seconds, or UNLIMITED
"$VENV/bin/python" -m dpotrain.cluster.job time-limit "${lead:-}" "${lead_from:-}" "${grace:-0}" \
  "${SLURM_JOB_PARTITION:-}" "$left"

# The resolved run (and the refusals of train_dpo.py: unknown keys, a batch of 128 pairs this world size cannot
# reach, ...) at the size of the whole job, in seconds and before any GPU work.
# A refusal is one `error:` line on stderr (this log), and set -e ends the job here.
# The memory plan per GPU is for this job's engine (ACCELERATE_CONFIG) and size; a plan that cannot fit is refused.
# (--dry-run after the job's arguments: a `--dry_run false` among them, turning off a recipe's, must not turn off this one)
# A stop that came before it (the time-limit warning in a long start-up, `scancel --signal` at the banner) launches
# nothing in this start (below): the plan and a preflight are the next start's, not done here for nothing (the dry run
# alone imported the whole stack and read the data: ~6 CPU-s for the smoke recipe, minutes for a large recipe's data).
if [[ -z $early_stop ]]; then
  resolved=$(WORLD_SIZE=$NUM_PROCESSES GPUS_PER_NODE=$PROCS_PER_NODE "$VENV/bin/python" train_dpo.py --config "$RECIPE" \
    "$@" --accelerate_config "$ACCELERATE_CONFIG" --dry-run --json)
  # Its batch, memory plan and output folder in the log, read from its record (dpotrain/cluster/job.py); what the run
  # would refuse (a login missing, a push without a token, the output folder) ends the job here with the run's own
  # lines and exit code 2, in seconds, instead of after starting every process.
  # None: this start is a requeue of the job that finished its run, or a rerun completing a finished run's final push,
  # which the dry run said on stderr, reading none of the recipe's inputs (moved away once the run finished, they
  # failed the job: its `afterok` dependents never started). The launched processes say there is nothing to do (or
  # push, the main process alone), and end with 0.
  [[ -z $resolved ]] || "$VENV/bin/python" -m dpotrain.cluster.job summary <<<"$resolved"

  # PREFLIGHT=1: the base model's gap between chosen and rejected on a sample, here on the batch node; a doomed run
  # (exit 3) or bad input ends the job in minutes, before the launch.
  if [[ -n $resolved && "${PREFLIGHT:-0}" == 1 ]]; then
    "$VENV/bin/python" scripts/preflight.py --config "$RECIPE" "$@" || die "preflight exited $?: see its report above"
  fi
fi

# Requeue after a stop request (`$1`: what was saved), so the job goes on from it. Slurm requeues a preempted job on its
# own only if it still runs when the GraceTime is over; one that saved and exited within it would end COMPLETED. The
# job's state tells the stops to requeue after (still RUNNING: a preemption within its GraceTime, the time-limit
# warning, `scancel --signal`; or Reason=TimeLimit: saved just after the limit) from those not to: `scancel` (the
# same SIGTERM, but the user wants the job to end) and a preemption past its GraceTime or `scontrol requeue` (Slurm has
# requeued it).
# `$2`: where the start was when stopped, where it saved nothing (before-launch, nothing-saved; empty: it saved some).
# How to go on where Slurm does not requeue the job: the same command, naming the output folder where it is named after
# the job's id (dpotrain/cluster/job.py: go_on); without the dry run's record (none in this start), the same command.
go_on() {
  [[ -n ${resolved:-} ]] && "$VENV/bin/python" -m dpotrain.cluster.job go-on "$SLURM_JOB_ID" \
    "${SLURM_ARRAY_JOB_ID:-}" <<<"$resolved" 2>/dev/null || echo "submit the same command again to go on from what was saved"
}
requeue_after_stop() {
  local saved=$1 job refused
  rm -f "$DPOTRAIN_STOP_FILE" "$DPOTRAIN_STOP_FILE.checkpointed"
  # Not a Slurm job: the stopped run's code (dpotrain/train/preemption.py STOPPED_EXIT), which `accelerate launch` turns
  # into 1 for any worker's non-zero exit.
  [[ -n "${SLURM_JOB_ID:-}" ]] || { echo "=== $(date -Is) $saved; not a Slurm job: run the same command to go on ==="; exit 75; }
  # One rule for the time-limit warning: a start it stopped before anything was saved (before the launch, or the run's
  # processes said so) is not requeued, since every requeue would be warned as early and save nothing again: one
  # before the launch ended the job in one line, one after it (a model still loading, 0 reference pairs saved)
  # requeued, start after start, until someone cancelled the job. Refused naming --time (dpotrain/cluster/job.py:
  # check_warned_start); a USR1 with more time left (`scancel --signal=USR1`) requeues.
  if [[ -n ${2:-} && ($early_stop == USR1 || -n $warned) ]]; then
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null || true)
    "$VENV/bin/python" -m dpotrain.cluster.job warned-start "${lead:-}" "${lead_from:-}" "$left" "$SECONDS" "$2" || exit
  fi
  job=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*\|Reason=[^ ]*\|Restarts=[0-9]*\|BatchFlag=[0-9]*' | tr '\n' ' ' || true)
  # Run directly in an allocation (salloc: no batch script), Slurm cannot requeue it ("Only batch jobs are accepted"):
  # the user's command goes on from what was saved, as outside Slurm.
  if [[ $job == *BatchFlag=0* ]]; then
    echo "=== $(date -Is) $saved; an allocation (salloc) is not requeued: run the same command to go on ==="
    exit 75
  fi
  if [[ -z $job || $job == *JobState=RUNNING* || $job == *Reason=TimeLimit* ]]; then
    echo "=== $(date -Is) $saved; requeueing job $SLURM_JOB_ID ==="
    if ! refused=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
      # E.g. a job submitted with --no-requeue. Not COMPLETED: an `afterok` dependency must not start on it.
      die "Slurm refused to requeue job $SLURM_JOB_ID ($refused): $(go_on)"
    fi
  elif [[ $job != *"Restarts=${SLURM_RESTART_COUNT:-0} "* ]]; then
    echo "=== $(date -Is) $saved; Slurm has requeued job $SLURM_JOB_ID itself (scontrol requeue, or a preemption" \
      "past its GraceTime) ==="
  else
    echo "=== $(date -Is) $saved; job $SLURM_JOB_ID was cancelled (scancel), so it is not requeued: $(go_on) ==="
  fi
  exit 0
}

# --- preemption and time limit: checkpoint, then requeue ---
# --signal=B:USR1@... reaches this shell only; the trap creates a stop file that every rank checks at the end of
# each optimizer step (dpotrain/train/preemption.py). A trap runs only between foreground commands, so srun runs in the
# background and this shell waits for it.
signalled="" warned=""  # the last stop signal; warned: a USR1 (the time-limit warning's) came in this start
# Called by the traps below, which shellcheck does not follow into a quoted command: it took the body for unreachable.
# shellcheck disable=SC2317
stop_request() {
  signalled=$1
  [[ $1 != USR1 ]] || warned=1
  echo "=== $(date -Is) signal received: checkpointing at the next optimizer step (SIG$1) ==="
  # The signal's name in it: a rank still importing its libraries takes the file for this start's request, not for one
  # left from before it (dpotrain/train/preemption.py, SIGNALLED)
  printf 'SIG%s\n' "$1" >"$DPOTRAIN_STOP_FILE"
}

# Slurm >= 22.05 no longer passes the job's --cpus-per-task on to srun: without this, on a cluster that binds
# tasks to their CPUs, every node's GPU processes, data-loader workers and tokenization share one core.
[[ -n "${SLURM_CPUS_PER_TASK:-}" ]] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
# The CPU binding Slurm applied to a step's tasks (SLURM_CPU_BIND=quiet,mask_cpu:0x1 with its _LIST, _TYPE, _VERBOSE),
# which srun reads back as its --cpu-bind: a job submitted from inside a step (`srun --pty bash`) inherits them through
# sbatch's --export=ALL, and its training step was bound to that step's CPUs ("1 CPUs" in its node line for a job of 32).
# Slurm sets no _LIST in a batch or salloc shell; a SLURM_CPU_BIND exported by hand (none, cores) has none and is kept.
[[ -z ${SLURM_CPU_BIND_LIST:-} ]] || unset SLURM_CPU_BIND SLURM_CPU_BIND_LIST SLURM_CPU_BIND_TYPE SLURM_CPU_BIND_VERBOSE

free_port  # last, right before the launch: the dry run and a preflight take minutes
# From here a stop makes the stop file, which the run reads as asked before it started (a stop after step 1, saved).
trap 'stop_request USR1' USR1
trap 'stop_request TERM' TERM
# Run directly in an allocation (salloc), a terminal's Ctrl-C reaches this shell and srun, which only reports its tasks:
# untrapped, it ended this shell at once, salloc gave the allocation back, and Slurm killed the run KillWait (30 s)
# into its checkpoint. A stop request, as the run takes Ctrl-C outside Slurm.
trap 'stop_request INT' INT
# One that came before (noted by the traps at the top) launches nothing: nothing was trained in this start. The
# time-limit warning would come as early in every requeue, which would never train: refused, naming --time
# (requeue_after_stop). Any other (`scancel --signal`, the warning of a job given more time) requeues.
if [[ -n $early_stop ]]; then
  requeue_after_stop "SIG$early_stop came before training was launched: nothing trained in this start" before-launch
fi
echo "launch: $(launch_line "$main_addr" "${SHOWN_ARGS[@]}")"
line=$(launch_line "$main_addr" "$@")
# `set +e` inside: under set -e a background `eval` whose command fails ends with 1, whatever the command's own code
# (bash 5.2), so srun's 143 on Slurm's SIGTERM read as 1, a node's failure: the wait below for the save was skipped and
# the log blamed a node. The layout is the same (this shell, a subshell, srun under it).
{ set +e; eval "$line"; } &
pid=$!
while :; do
  wait "$pid" && rc=0 || rc=$?
  kill -0 "$pid" 2>/dev/null || break  # a trapped signal interrupts `wait`: keep waiting for srun itself
done
# srun itself was sent the SIGTERM while the job runs on (`scancel --signal=TERM --full`: every process of the job, srun
# among them): srun answers it with a SIGKILL of its tasks ("srun: forcing job termination"), which no trap or ignored
# signal around it prevents (it takes SIGTERM back and waits for it), so the training processes were killed before
# they saved. Waited for KillWait, then FAILED with "Slurm ended the job", neither true: said as it is,
# with what was lost and how to stop with a checkpoint, and requeued as the stop request it was.
if [[ $signalled == TERM && $rc -gt 128 && ! -f "$DPOTRAIN_STOP_FILE.checkpointed" &&
  $(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null || true) == *"JobState=RUNNING "* ]]; then
  "$VENV/bin/python" -m dpotrain.cluster.job killed-by-srun "$SLURM_JOB_ID" <<<"$resolved" || true
  requeue_after_stop "srun killed the training processes before they saved (its SIGTERM)"
fi
# When Slurm ends the job (scancel, the time limit, a preemption past its GraceTime) srun is signalled too and exits
# at once, while the training processes may still be saving: wait for them as long as Slurm lets them run. Slurm
# signals the step a moment before this shell (2 ms in a CI run), so srun can be gone before the trap has run: no
# signal noted yet is Slurm's SIGTERM on its way, and this shell ended the job before the save (a slow one was lost).
if [[ ($signalled == TERM || -z $signalled) && $rc -gt 128 && ! -f "$DPOTRAIN_STOP_FILE.checkpointed" ]]; then
  kill_wait=$(scontrol show config 2>/dev/null | awk '$1 == "KillWait" {print $3}' || true)
  echo "=== $(date -Is) srun ended on Slurm's SIGTERM: waiting up to ${kill_wait:-30} s (KillWait) for the training" \
    "processes to save ==="
  for ((i = 0; i < ${kill_wait:-30}; i++)); do
    [[ -f "$DPOTRAIN_STOP_FILE.checkpointed" ]] && break
    # Slurm's SIGTERM, landing in this wait (the step's came first), ends the sleep too, a child in the batch step:
    # under set -e its 143 ended this shell mid-wait, and the job with it, neither requeued nor saying what was saved.
    sleep 1 || true
  done
fi

# Requeue after a stop request, so the job goes on from what was saved (requeue_after_stop): the file's first line says
# what; a second (dpotrain/train/preemption.py: NOTHING_SAVED), that this start saved nothing.
if [[ -f "$DPOTRAIN_STOP_FILE.checkpointed" ]]; then
  nothing=""
  [[ $(sed -n 2p "$DPOTRAIN_STOP_FILE.checkpointed") != "nothing saved" ]] || nothing="nothing-saved"
  requeue_after_stop "$(head -n 1 "$DPOTRAIN_STOP_FILE.checkpointed")" "$nothing"
fi
rm -f "$DPOTRAIN_STOP_FILE"
if [[ $rc == 0 ]]; then
  echo "=== $(date -Is) training exited with code 0 ==="
elif [[ -f "$DPOTRAIN_STOP_FILE.health" ]]; then
  # A health guard stopped the run (dpotrain/publish.py wrote its line): no failure that the same command goes on
  # from (it is refused), and the job's code is the run's 3, not the 1 accelerate makes of any worker's.
  rm -f "$DPOTRAIN_STOP_FILE.health"
  echo "=== $(date -Is) training stopped by a health guard (its 'health:' line above says which, and what to do);" \
    "the job is not requeued, and the same command is refused (docs/health.md) ===" >&2
  exit 3
elif [[ -f "$DPOTRAIN_STOP_FILE.refused" ]]; then
  # A training process ended on its one `error:` line (dpotrain/recipe/errors.py wrote the file): accelerate makes its
  # 2 (or 1) a 1, and this line sent the reader to a traceback there was none of.
  rm -f "$DPOTRAIN_STOP_FILE.refused"
  echo "=== $(date -Is) training refused to go on (exit code $rc): its 'error:' line above says why and what to do" \
    "===" >&2
elif [[ $signalled == TERM && $rc -gt 128 ]]; then
  echo "=== $(date -Is) Slurm ended the job before its save was complete: a rerun goes on from what was saved" \
    "before (the newest complete checkpoint) ===" >&2
else
  # --kill-on-bad-exit: the first node whose process fails takes the others down at once, instead of them
  # waiting in a collective until the time limit. srun names that node in its first `srun: error:` line.
  echo "=== $(date -Is) training failed with exit code $rc: srun stopped every node; the first 'srun: error: <node>'" \
    "line above names the node that failed, and its traceback is above that; once it is fixed, the same sbatch" \
    "command goes on from the newest complete checkpoint ===" >&2
fi
exit "$rc"
}

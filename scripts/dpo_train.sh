#!/usr/bin/env bash
# DPO with OLMo 3's recipe, "think" variant (configs/think.yaml), one process per GPU.
#   sbatch scripts/dpo_train.sh                                   # 1 node x 4 GPUs, 128 pairs per step
#   sbatch --gpus-per-node=8 scripts/dpo_train.sh                 # nodes of 8 GPUs: 8 processes per node, planned for 8
#   sbatch --nodes=4 scripts/dpo_train.sh                         # 16 GPUs, still 128 pairs per step
#   sbatch scripts/dpo_train.sh --learning_rate 8e-8              # any train_dpo.py override after the script
#   RECIPE=configs/smoke.yaml sbatch --gpus-per-node=0 --cpus-per-task=2 scripts/dpo_train.sh --max_steps 4 --output_dir outputs/smoke-slurm  # CPU path
# From any folder: sbatch /path/to/dpotrain/scripts/dpo_train.sh (the job finds the project from the script's path).
# Follow: tail -f dpo-think-<jobid>.out, in the folder you submitted from (its banner names the full
# path). Preempted or out of time: it checkpoints and requeues itself.
#SBATCH --job-name=dpo-think
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1          # crucial: one launcher per node; accelerate starts one process per GPU
#SBATCH --gpus-per-node=4            # EDIT: your nodes' GPUs (4 or 8); launch.sh starts one process per GPU and
                                     # plans memory for them (or pass --gpus-per-node=8 to sbatch)
#SBATCH --cpus-per-task=32           # EDIT: CPU cores per node for data loading and tokenization (~8 per GPU)
#SBATCH --mem=0                      # EDIT: the node's whole memory (0); or a size, e.g. --mem=512G on shared nodes
#SBATCH --time=24:00:00              # EDIT: your partition's limit; the job requeues itself to go on
#SBATCH --output=%x-%j.out           # in the folder you submit from: Slurm opens it before this
                                     # script runs, so a folder named here must already exist
#SBATCH --open-mode=append           # a requeued job appends to the same log
#SBATCH --requeue
#SBATCH --signal=B:USR1@600          # 10 minutes before the limit: checkpoint (saving a 7B ZeRO-2 state takes minutes)
##SBATCH --partition=gpu             # EDIT: remove one '#' and name your partition
##SBATCH --account=my-account        # EDIT: remove one '#' and name your account

# A stop signal in the job's first moments (the time-limit warning's USR1, `scancel --signal`), before launch.sh set
# its traps, ended this shell by bash's default action: the job FAILED without a line in its log, never requeued.
# Noted for launch.sh (its own traps note one from its first line), which answers it instead of launching.
unset DPOTRAIN_EARLY_STOP
trap 'export DPOTRAIN_EARLY_STOP=USR1' USR1
trap 'export DPOTRAIN_EARLY_STOP=${DPOTRAIN_EARLY_STOP:-TERM}' TERM

# EDIT: modules your cluster needs, e.g.
# module load cuda/12.8

set -euo pipefail  # after `module`: environment-modules' shell functions read unset variables

# A RECIPE given is looked for in the folder submitted from first (launch.sh); this default is the project's own, not
# the configs/think.yaml of another checkout submitted from.
export DPOTRAIN_RECIPE_GIVEN=${RECIPE:+1}
export RECIPE=${RECIPE:-configs/think.yaml}
# sbatch runs a copy of this script from its spool folder: the project is the one the submitted script lives in
# (scontrol's Command=; run with bash, this script's own folder), else the folder the job starts in (where it was
# submitted, or --chdir). That folder first ran another checkout's code: `sbatch ~/dpotrain-exp/scripts/dpo_train.sh`
# typed in ~/dpotrain ran ~/dpotrain's launch.sh and train_dpo.py.
# Command= is the submitted path, then the script's arguments, joined by spaces: the path may hold spaces too, so the
# longest start of it that is this script (beside launch.sh).
submitted=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=//p' || true)
# A relative one is where sbatch read it, the folder it ran in (a path found under `--chdir DIR` is made absolute):
# read from DIR, where the job starts, it was missed, or was another checkout's.
[[ -z $submitted || $submitted == /* ]] || submitted=${SLURM_SUBMIT_DIR:-$PWD}/$submitted
while [[ $submitted == *" "* && ! ( -f $submitted && -f $(dirname "$(readlink -f -- "$submitted")")/launch.sh ) ]]; do
  submitted=${submitted% *}
done
# A project's scripts folder: launch.sh beside, train_dpo.py above. A copy of scripts/ elsewhere (~/jobs/scripts/, its
# launch.sh too) submitted from the project is not one: it ran ~/jobs/scripts/launch.sh in ~/jobs, with no project.
# A link to the script (~/bin/dpo.sh) is then read where it points: its own folder holds no project.
root=""
for script in "$submitted" "$(readlink -f -- "$submitted" 2>/dev/null)" "$0" "$(readlink -f -- "$0")"; do
  here=$(dirname "$script")
  if [[ -n $script && -f $here/launch.sh && -f $here/../train_dpo.py ]]; then root=$(cd "$here/.." && pwd); break; fi
done
# Else a DPOTRAIN_ROOT the user exported (an edited copy of this script kept outside the project), else the folder the
# job was submitted from.
root=${root:-${DPOTRAIN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}}
# Else (no scontrol to name the script) the folder the job starts in: `sbatch --chdir ~/dpotrain` typed elsewhere.
[[ -n ${DPOTRAIN_ROOT:-} || -f $root/train_dpo.py ]] || root=$PWD
if [[ ! -f $root/scripts/launch.sh || ! -f $root/train_dpo.py ]]; then
  echo "error: found no dpotrain project beside the submitted script or in $root: submit the project's" \
    "scripts/dpo_train.sh (or a link to it), or export DPOTRAIN_ROOT=/path/to/dpotrain before sbatch" >&2
  exit 2
fi
export DPOTRAIN_ROOT=$root
# The job runs in the project; a relative --dataset_name means the folder it was submitted from (recipe/config.py):
# the folder Slurm starts the job in, `sbatch --chdir DIR`'s DIR where given (Slurm reads the script's own relative
# path there and writes the log there), else where sbatch ran (SLURM_SUBMIT_DIR, which --chdir leaves as it is).
export DPOTRAIN_SUBMIT_DIR=$PWD
exec bash "$root/scripts/launch.sh" "$@"

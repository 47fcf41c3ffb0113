#!/usr/bin/env bash
# DPO with OLMo 3's recipe, "think" variant (configs/think.yaml), on 4 GPUs per node. From the project root:
#   sbatch scripts/dpo_train.sh                                   # 1 node x 4 GPUs, 128 pairs per step
#   sbatch --nodes=4 scripts/dpo_train.sh                         # 16 GPUs, still 128 pairs per step
#   sbatch scripts/dpo_train.sh --learning_rate 8e-8              # any train_dpo.py override after the script
#   RECIPE=configs/smoke.yaml sbatch --gpus-per-node=0 --cpus-per-task=2 scripts/dpo_train.sh --max_steps 4  # CPU path
# Follow: tail -f logs/dpo-think-<jobid>.out. Preempted or out of time: it checkpoints and requeues itself.
#SBATCH --job-name=dpo-think
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1          # crucial: one launcher per node; accelerate starts one process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32           # EDIT: CPU cores per node for data loading and tokenization
#SBATCH --time=24:00:00              # EDIT: your partition's limit; the job requeues itself to go on
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append           # a requeued job appends to the same log
#SBATCH --requeue
#SBATCH --signal=B:USR1@600          # 10 minutes before the limit: checkpoint (saving a 7B ZeRO-2 state takes minutes)
##SBATCH --partition=gpu             # EDIT: remove one '#' and name your partition
##SBATCH --account=my-account        # EDIT: remove one '#' and name your account

# EDIT: modules your cluster needs, e.g.
# module load cuda/12.8

set -euo pipefail  # after `module`: environment-modules' shell functions read unset variables

export RECIPE=${RECIPE:-configs/think.yaml}
exec bash "${SLURM_SUBMIT_DIR:-.}/scripts/launch.sh" "$@"

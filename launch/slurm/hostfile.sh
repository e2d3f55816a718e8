#!/bin/bash
# Write a DeepSpeed hostfile for the current Slurm allocation ("node slots=N" per line), for running the
# `deepspeed` launcher (pdsh/ssh) instead of srun:
#   bash launch/slurm/hostfile.sh > hostfile && deepspeed --hostfile hostfile launch/pretrain.py --zero 3 ...
# Slots per node: GPUS_PER_NODE if set, else the GPUs the job has on a node, else the node's own task count
# (SLURM_TASKS_PER_NODE, e.g. "3,1" or "2(x3),1" for --ntasks without --ntasks-per-node), else 1.
set -euo pipefail
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
SLOTS=()
if [[ -n ${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}} ]]; then
  for _ in "${HOSTS[@]}"; do SLOTS+=("${GPUS_PER_NODE:-$SLURM_GPUS_ON_NODE}"); done
elif [[ -n ${SLURM_TASKS_PER_NODE:-} ]]; then
  IFS=, read -ra groups <<<"$SLURM_TASKS_PER_NODE"
  for g in "${groups[@]}"; do
    if [[ $g =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      for ((i = 0; i < BASH_REMATCH[2]; i++)); do SLOTS+=("${BASH_REMATCH[1]}"); done
    else
      SLOTS+=("$g")
    fi
  done
fi
for i in "${!HOSTS[@]}"; do echo "${HOSTS[$i]} slots=${SLOTS[$i]:-${SLURM_NTASKS_PER_NODE:-1}}"; done

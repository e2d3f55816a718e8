#!/bin/bash
# Write a DeepSpeed hostfile for the current Slurm allocation ("node slots=N" per line), for running the
# `deepspeed` launcher (pdsh/ssh) instead of srun:
#   bash launch/slurm/hostfile.sh > hostfile && deepspeed --hostfile hostfile launch/pretrain.py --zero 3 ...
# Slots per node: GPUS_PER_NODE if set, else the GPUs the job has on a node, else its tasks per node.
set -euo pipefail
SLOTS=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}
for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do echo "$h slots=$SLOTS"; done

#!/bin/bash
# Write a DeepSpeed hostfile for the current Slurm allocation ("node slots=GPUs" per line), for running the
# `deepspeed` launcher (pdsh/ssh) instead of srun:
#   bash launch/slurm/hostfile.sh > hostfile && deepspeed --hostfile hostfile launch/pretrain.py --zero 3 ...
set -euo pipefail
GPUS=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do echo "$h slots=$GPUS"; done

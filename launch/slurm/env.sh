# Site settings sourced by pretrain.sbatch: edit for your cluster (modules, virtualenv, NCCL/network).
# module load cuda/12.4 nccl
# source /path/to/venv/bin/activate
export NCCL_ASYNC_ERROR_HANDLING=1      # a dead rank ends the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# export NCCL_SOCKET_IFNAME=ib0  NCCL_IB_HCA=mlx5
# The rendezvous is derived in each task by pretrain/distributed.py (first node of the step, port 20000 + job
# id mod 20000); set it here only to override, e.g. for a firewall:  export MASTER_PORT=29500
true

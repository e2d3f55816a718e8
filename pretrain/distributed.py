"""Who am I in the job: rank, world size, device. Read from the launcher's environment (torchrun and the
deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK; Slurm's srun sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n) not in (None, ""):
            return int(os.environ[n])
    return default


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is visible")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def dist_env(requested_device: str = "auto") -> DistEnv:
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    return DistEnv(rank, world, local, resolve_device(requested_device, local))


def init_process_group(env: DistEnv, backend: str = "auto") -> None:
    """Start torch.distributed when there is more than one process (no-op otherwise or if already up)."""
    if env.world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    if backend == "auto":
        backend = "nccl" if env.device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= dist.get_world_size()
    return x


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()

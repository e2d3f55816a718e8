"""Who am I in the job: rank, world size, device. Read from the launcher's environment: torchrun and the
deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK; one task per GPU under `srun` gives SLURM_PROCID /
SLURM_STEP_NUM_TASKS / SLURM_LOCALID, and the master address comes from the job's node list. Under srun
the values are exported as RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT too, so DeepSpeed and
torch.distributed see the same job."""
from __future__ import annotations

import os
import re
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


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[007-014],login2' -> 'gpu007' (zero padding kept), what
    `scontrol show hostnames | head -1` prints, for machines where scontrol is not on the PATH."""
    depth, first = 0, ""
    for ch in nodelist.strip():  # the first top-level comma ends the first entry
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            break
        first += ch
    # each bracket group: take its first item, and of a range its start
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def slurm_master() -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for a Slurm job: the first node of the job, and a port derived from the
    job id so that two jobs sharing a node do not collide."""
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
    job = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    return first_host(nodes), 20000 + job % 20000


def dist_env(requested_device: str = "auto") -> DistEnv:
    # SLURM_STEP_NUM_TASKS is set inside an srun step only: a plain `python` in an salloc shell (where
    # SLURM_NTASKS is the allocation's size) stays one process instead of waiting for ranks that never come
    under_srun = "RANK" not in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ or \
        ("RANK" not in os.environ and "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ
         and "SLURM_STEP_ID" in os.environ)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", *(("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if under_srun else ()), default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if under_srun:
        addr, port = slurm_master()
        for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local), ("MASTER_ADDR", addr),
                     ("MASTER_PORT", port)):
            os.environ.setdefault(k, str(v))
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

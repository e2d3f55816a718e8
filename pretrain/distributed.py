"""Who am I in the job: rank, world size, device, and where the ranks meet. Read from the launcher's
environment: torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT;
one task per GPU under `srun` gives only Slurm's own variables (SLURM_PROCID / SLURM_STEP_NUM_TASKS /
SLURM_LOCALID / SLURM_STEP_NODELIST / SLURM_JOB_ID), from which this module derives the rendezvous (the one
place that does: launch/slurm/pretrain.sbatch sets none of it) and exports the five variables, so DeepSpeed
and torch.distributed see the same job."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.logs import get_logger

logger = get_logger(__name__)


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


def auto_device_type() -> str:
    """What `--device auto` means everywhere (training and evaluation): CUDA where it is visible, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """This rank's training device: `auto` and `cuda` take GPU local_rank (modulo the visible ones); a
    missing CUDA under `cuda` is an error (pretrain.trainer.check_device says it first, in user terms)."""
    if requested == "cpu" or (requested == "auto" and auto_device_type() == "cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is visible")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing on this host listens on now, picked by the kernel (bind to port 0). For a
    rendezvous that only this machine's processes join (one process without a launcher, tests, the
    one-host benchmarks): a fixed default such as 29500 collides when two such jobs share a node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    """(MASTER_ADDR, MASTER_PORT) of a Slurm job step, computed alike by every task without talking to the
    others: the step's first node (where srun places rank 0) and 20000 + job id mod 20000, so that jobs
    sharing a node do not collide and a requeued job (same id) meets on the same port again."""
    nodes = (os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
             or os.environ.get("SLURM_NODELIST") or "127.0.0.1")
    job = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    return first_host(nodes), 20000 + job % 20000


def in_srun_step() -> bool:
    """A task of an srun step that no other launcher started. SLURM_STEP_NUM_TASKS exists only inside a
    step: the batch shell and a plain `python` in an salloc shell (where SLURM_NTASKS is the allocation's
    size) stay one process instead of waiting for ranks that never come; RANK set means torchrun or the
    deepspeed launcher runs inside the step and owns the ranks."""
    return "RANK" not in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def dist_env(requested_device: str = "auto") -> DistEnv:
    under_srun = in_srun_step()
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", *(("SLURM_STEP_NUM_TASKS",) if under_srun else ()), default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if under_srun:
        addr, port = slurm_master()
        # setdefault: a MASTER_ADDR/MASTER_PORT set on purpose (e.g. in the site's env.sh) wins
        for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local), ("MASTER_ADDR", addr),
                     ("MASTER_PORT", port)):
            os.environ.setdefault(k, str(v))
    return DistEnv(rank, world, local, resolve_device(requested_device, local))


def init_process_group(env: DistEnv, backend: str = "auto") -> None:
    """Start torch.distributed when there is more than one process (no-op otherwise or if already up)."""
    if env.world_size == 1 or is_distributed():
        return
    if backend == "auto":
        backend = "nccl" if env.device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    # where a hanging start waits: the first thing to check on a new cluster (rank 0 says it)
    logger.info(f"rendezvous {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, {env.world_size} ranks, {backend}")
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)


def is_distributed() -> bool:
    """torch.distributed is up (several processes, or DeepSpeed's group of one)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    if get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= dist.get_world_size()
    return x


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The element-wise maximum of a few flags over all ranks (the list itself in one process)."""
    if get_world_size() == 1:
        return values
    t = torch.tensor(values, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's value of a small picklable object, on every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's value of a small picklable object, in rank order, on every rank."""
    if get_world_size() == 1:
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out

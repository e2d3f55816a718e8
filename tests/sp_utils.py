"""Run a function on N CPU processes joined by gloo (torch.multiprocessing spawn), for the
sequence-parallel tests. A worker that raises fails the test with its traceback."""
from __future__ import annotations

import datetime
import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, fn: Callable, args: tuple, timeout_s: float | None) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    if os.environ["TRITON_INTERPRET"] == "1":  # conftest's interpreter speed-up, which spawn does not import
        from tests.conftest import _speed_up_triton_interpreter
        _speed_up_triton_interpreter()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timeout)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable, world: int, *args, timeout_s: float | None = None) -> None:
    """fn(rank, world, *args) on `world` processes; `fn` must be a module-level function. `timeout_s`: how
    long a collective may wait for the other ranks before it fails (gloo's default: 30 minutes)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), fn, args, timeout_s), nprocs=world, join=True)

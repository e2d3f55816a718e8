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


def reduced_grads(model, world: int) -> dict:
    """The group's gradients, averaged over its ranks as data parallelism over all ranks averages them."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = g / world
    return out


def check_grads(what: str, got: dict, want: dict, rel: float = 2e-6) -> None:
    """Every gradient of `want` matched by `got` within `rel` of its largest entry (the default allows for
    HGRN2, which computes its gates in fp32 even in a float64 model)."""
    for name, g in want.items():
        err = (got[name] - g).abs().max().item()
        assert err <= rel * g.abs().max().item() + 1e-12, f"{what}: gradient of {name} off by {err:.3g}"


def check_against_one_process(base, x, y, cu, cols: slice, what: str, world: int, rel: float = 2e-6,
                              **plan_kw) -> None:
    """A copy of `base` under a SequenceParallelPlan (`plan_kw`) on this rank's columns `cols` of the batch
    (x, y, packed by `cu` or not) gives the logits and loss of `base` on the whole sequences, and, averaged
    over the ranks, every parameter gradient (`check_grads`, within `rel`). Leaves base's gradients set."""
    import copy

    from ops.sequence_parallel import SequenceParallel
    from pretrain.sequence_parallel import SequenceParallelPlan
    base.zero_grad()
    with torch.no_grad():
        logits_ref = base(x, cu_seqlens=cu)
    loss_ref = base(x, y, cu_seqlens=cu)
    loss_ref.backward()
    model = copy.deepcopy(base)
    model.zero_grad()
    SequenceParallelPlan(model, SequenceParallel(), **plan_kw)
    with torch.no_grad():
        logits = model(x[:, cols].contiguous(), cu_seqlens=cu)
    torch.testing.assert_close(logits, logits_ref[:, cols], rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: logits\n{m}")
    loss = model(x[:, cols].contiguous(), y[:, cols].contiguous(), cu_seqlens=cu)
    assert abs(loss.item() - loss_ref.item()) < 1e-12, (what, loss.item(), loss_ref.item())
    loss.backward()
    check_grads(what, reduced_grads(model, world), {n: p.grad for n, p in base.named_parameters()}, rel)

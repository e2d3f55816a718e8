"""Sequence parallelism under torch.compile (CPU, gloo, the `aot_eager` backend: Dynamo and AOTAutograd, no
Inductor code generation). The model with the sequence-parallel plan is compiled as the trainer compiles it
(`TorchTrainModule.compile`: each block); with the sequences split over 2 ranks, the loss and every
parameter gradient equal the eager single-process run on whole sequences (fp32), for TNL, HGRN2 and
cosFormer2, and for HGRN2 with packed documents that cross the rank boundary (through the Triton kernels, as
on a GPU), with and without activation checkpointing. The state exchange stays inside the compiled block
graph: the blocks compile to one shared graph with no graph break."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ops import set_default_impl
from ops.sequence_parallel import SequenceParallel, segment_prefix
from pretrain.config import OptimConfig
from pretrain.sequence_parallel import SequenceParallelPlan
from pretrain.train_module import TorchTrainModule
from tests.sp_utils import spawn_gloo
from tests.test_sequence_parallel_model import TOL, T, batch, reference, tiny
from tests.test_sequence_parallel_ops import GLOBAL_CU



def _compiled_run(model, ids, targets, cu):
    """Compile `model` the trainer's way, run one forward + backward; returns the loss, the gradients, the
    graph-break reasons and the number of graphs Dynamo built."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    # several processes: the trainer's engine reduces in autograd's hooks (DDP), no fused accumulation
    TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32",
                     fuse_grad_accumulation=False).compile(backend="aot_eager")
    model.zero_grad()
    loss = model(ids, targets=targets, cu_seqlens=cu)
    loss.backward()
    breaks = [reason.split("\n")[0] for reason in counters["graph_break"]]
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, breaks, graphs


def run_arch(rank: int, world: int, arch: str, packed: bool, ac: str) -> None:
    base = tiny(arch)
    cu = torch.tensor(GLOBAL_CU, dtype=torch.int32) if packed else None
    _, loss_ref, grads_ref = reference(base, *batch(10), cu)
    what = f"{arch} packed={packed} activation checkpointing {ac}, rank {rank}"

    model = copy.deepcopy(base)
    model.set_activation_checkpointing(ac)
    plan = SequenceParallelPlan(model, SequenceParallel())  # the default group: both ranks
    seg = T // world
    ids, targets = (x[:, rank * seg:(rank + 1) * seg].contiguous() for x in batch(10))
    if packed:
        # packed documents through the Triton kernels (the interpreter here), as on a GPU: the CPU twin
        # loops over documents on the host, which breaks any compiled graph. The kernels' custom ops
        # return tensors whose length their launch plan picks at run time, which Dynamo captures only
        # with this switch (fullgraph=True implies it)
        set_default_impl("triton")
        try:
            with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
                loss, grads, breaks, graphs = _compiled_run(model, ids, targets, cu)
        finally:
            set_default_impl("auto")
    else:
        loss, grads, breaks, graphs = _compiled_run(model, ids, targets, cu)

    torch.testing.assert_close(loss, loss_ref, **TOL, msg=lambda m: f"{what}: loss\n{m}")
    for name, g in grads.items():  # the ranks' gradients average to the whole run's
        dist.all_reduce(g)
        g /= world
        torch.testing.assert_close(g, grads_ref[name], **TOL, msg=lambda m: f"{what}: gradient of {name}\n{m}")
    # the exchange is part of the block graph, and the blocks share one graph (per-layer constants are inputs)
    assert not breaks, f"{what}: graph breaks {breaks}"
    assert graphs == 1, f"{what}: {graphs} graphs for {len(model.blocks)} blocks"

    plan.remove()  # the mixers get their own classes back
    assert all(type(b.token_mixer) is type(o.token_mixer) for b, o in zip(model.blocks, base.blocks))


def _worker(rank: int, world: int) -> None:
    # packed documents once (the layout code is shared by both ops; the Triton interpreter is slow)
    for arch, packed, ac in (("tnl", False, "full"), ("hgrn2", False, "none"), ("hgrn2", True, "none"),
                             ("cos2", False, "mlp")):
        run_arch(rank, world, arch, packed, ac)
    dist.barrier()


def test_compiled_model_segments_match_whole_sequences():
    spawn_gloo(_worker, 2)


def _prefix_loss(sp, state, transfer, continues, weight):
    return (segment_prefix(sp, state, transfer, continues) * weight).sum()


def _inductor_worker(rank: int, world: int) -> None:
    sp = SequenceParallel()
    g = torch.Generator().manual_seed(rank)
    rows, H, dk, dv = 2, 2, 3, 4
    state = torch.randn(rows, H, dk, dv, generator=g, requires_grad=True)
    transfer = torch.rand(rows, H, dk, 1, generator=g).requires_grad_(True)
    continues = torch.tensor([rank > 0, rank == 2])
    weight = torch.randn(rows, H, dk, dv, generator=g)
    want = _prefix_loss(sp, state, transfer, continues, weight)
    want_grads = torch.autograd.grad(want, [state, transfer])
    torch._dynamo.reset()
    compiled = torch.compile(_prefix_loss, backend="inductor", fullgraph=True)
    got = compiled(sp, state, transfer, continues, weight)
    got_grads = torch.autograd.grad(got, [state, transfer])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    dist.barrier()


def test_exchange_compiles_with_inductor():
    """The exchange alone compiled by Inductor (3 ranks) gives the eager values and gradients, and every
    rank runs the backward's reduce-scatter in its backward: a compiled graph that can see that a rank
    uses none of the gathered states folds that rank's gradient to zeros and runs its reduce-scatter in
    the forward, where it waits for ranks that are at another collective (caught by the short timeout)."""
    spawn_gloo(_inductor_worker, 3, timeout_s=120)

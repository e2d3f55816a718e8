"""Sequence parallelism under torch.compile (CPU, gloo, the `aot_eager` backend: Dynamo and AOTAutograd, no
Inductor code generation). The model with the sequence-parallel plan is compiled as the trainer compiles it
(`TorchTrainModule.compile`: each block); with the sequences split over 2 ranks, the loss and every
parameter gradient equal the eager single-process run on whole sequences (fp32), for TNL, HGRN2 and
cosFormer2, and for HGRN2 with packed documents that cross the rank boundary (through the Triton kernels, as
on a GPU). The state exchange stays inside the compiled block graph: the blocks compile to one shared graph
with no graph break."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ops import set_default_impl
from ops.sequence_parallel import SequenceParallel
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
    TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32").compile(backend="aot_eager")
    model.zero_grad()
    loss = model(ids, targets=targets, cu_seqlens=cu)
    loss.backward()
    breaks = [reason.split("\n")[0] for reason in counters["graph_break"]]
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, breaks, graphs


def run_arch(rank: int, world: int, arch: str, packed: bool) -> None:
    base = tiny(arch)
    cu = torch.tensor(GLOBAL_CU, dtype=torch.int32) if packed else None
    _, loss_ref, grads_ref = reference(base, *batch(10), cu)
    what = f"{arch} packed={packed} rank {rank}"

    model = copy.deepcopy(base)
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
    for arch, packed in (("tnl", False), ("hgrn2", False), ("hgrn2", True), ("cos2", False)):
        run_arch(rank, world, arch, packed)
    dist.barrier()


def test_compiled_model_segments_match_whole_sequences():
    spawn_gloo(_worker, 2)

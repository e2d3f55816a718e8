"""LASP-2 state exchange of the linear-attention ops (ops.sequence_parallel) on CPU with gloo: each rank
runs its segment of the sequences under `sequence_parallel`; its outputs and the gradients of its q, k, v
and log forget gates must equal the same slices of the single-process run over whole sequences, for 2
and 4 ranks, dense and packed documents that cross rank boundaries, both ops, the chunked twin and the
Triton kernels (interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ops import gated_linear_attn, lightning_attn
from ops.sequence_parallel import Segments, SequenceParallel, sequence_parallel
from tests.sp_utils import spawn_gloo

B, T, H, DV = 2, 24, 2, 4
# documents of the packed case: over the flattened [B*T]; row starts (0, 24) are document starts, as the
# loader makes them. With 2 ranks (segments of 12): a document starting exactly at a segment start (12), a
# segment continuing a document and resetting inside (36..47). With 4 (segments of 6): segments without
# any document start (18..23, 36..41), whose state passes through, and resets inside segments.
GLOBAL_CU = [0, 5, 11, 12, 24, 30, 31, 47, 48]


def local_layout(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The local cu_seqlens of rank `rank`'s segments (rows packed one after another) and whether each
    row's segment continues the previous rank's document, derived from GLOBAL_CU."""
    seg = T // world
    starts = set(GLOBAL_CU[:-1])
    cu, cont = [], []
    for b in range(B):
        lo = b * T + rank * seg
        cont.append(lo not in starts)
        cu.append(b * seg)
        cu += [b * seg + s - lo for s in sorted(starts) if lo < s < lo + seg]
    return torch.tensor(cu + [B * seg], dtype=torch.int32), torch.tensor(cont)


def inputs(op: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    dk = 8 if op == "nodecay" else 4
    q, k = (torch.randn(B, T, H, dk, generator=g) * 0.5 for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=g)
    x = None
    if op == "lightning":
        x = torch.tensor([0.9, 0.6])
    elif op == "gla":
        x = torch.nn.functional.logsigmoid(torch.randn(B, T, H, dk, generator=g) * 2 + 1)
    do = torch.randn(B, T, H, DV, generator=g)
    return q, k, v, x, do


def call(op, q, k, v, x, cu, impl):
    fn = gated_linear_attn if op == "gla" else lightning_attn
    return fn(q, k, v, x, output_final_state=True, cu_seqlens=cu, impl=impl)


def run_case(rank, world, op, impl, packed, seed, group=None):
    q, k, v, x, do = inputs(op, seed)
    leaves = [q, k, v] + ([x] if op == "gla" else [])

    def grads_of(tensors, fwd):
        ts = [t.clone().requires_grad_(True) for t in tensors]
        o, S = fwd(*ts)
        return o, S, ts

    # the single-process run over whole sequences
    cu = torch.tensor(GLOBAL_CU, dtype=torch.int32) if packed else None
    shape = (1, B * T) if packed else (B, T)
    o_ref, S_ref, ref = grads_of(leaves, lambda *t: call(op, *(a.reshape(*shape, *a.shape[2:]) for a in t[:3]),
                                                         t[3].reshape(*shape, H, -1) if op == "gla" else x, cu, impl))
    (o_ref.reshape(B, T, H, DV) * do).sum().backward()

    # this rank's segments
    seg = T // world
    sl = slice(rank * seg, (rank + 1) * seg)
    local = [t[:, sl].contiguous() for t in leaves]
    sp = SequenceParallel(group)
    lcu, cont = local_layout(rank, world)
    sp.segments = Segments(rows=B, continues=cont) if packed else Segments()
    lshape = (1, B * seg) if packed else (B, seg)
    with sequence_parallel(sp):
        o, S, mine = grads_of(local, lambda *t: call(op, *(a.reshape(*lshape, *a.shape[2:]) for a in t[:3]),
                                                     t[3].reshape(*lshape, H, -1) if op == "gla" else x,
                                                     lcu if packed else None, impl))
    (o.reshape(B, seg, H, DV) * do[:, sl]).sum().backward()

    what = f"{op} {impl} packed={packed} rank {rank}/{world}"
    torch.testing.assert_close(o.reshape(B, seg, H, DV), o_ref.reshape(B, T, H, DV)[:, sl], rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what}: output\n{m}")
    for name, a, r in zip("q k v log_f".split(), mine, ref):
        torch.testing.assert_close(a.grad, r.grad[:, sl], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}: grad of {name}\n{m}")
    if not packed and rank == world - 1:  # the last segment's final state is the sequences' final state
        torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: final state\n{m}")


CASES = [(op, impl, packed) for op in ("lightning", "nodecay", "gla") for impl in ("chunked", "triton")
         for packed in (False, True)
         # the kernels' initial-state interface (dense, and per document when packed) with 2 ranks; the
         # other Triton combinations add only interpreter time
         if impl == "chunked" or (op, packed) in (("lightning", False), ("gla", False), ("lightning", True))]


def groups_of(size: int, world: int):
    """Sequence-parallel groups of `size` consecutive ranks (every rank creates every group, as
    new_group requires); returns this rank's group and its rank in it."""
    mine = None
    for first in range(0, world, size):
        g = dist.new_group(list(range(first, first + size)))
        if first <= dist.get_rank() < first + size:
            mine = g
    return mine, dist.get_rank() % size


def _worker(rank, world):
    # 4 processes: one group of 4, then two groups of 2 (sequence parallel inside, data parallel across)
    for size in (4, 2):
        group, sp_rank = groups_of(size, world)
        for i, (op, impl, packed) in enumerate(CASES):
            if impl == "triton" and size == 4:
                continue
            run_case(sp_rank, size, op, impl, packed, seed=100 + i, group=group)
    fresh_start(sp_rank, size, group)
    dist.barrier()


def fresh_start(rank, world, group):
    # every segment starts a document: no state crosses ranks, whatever the neighbours hold
    q, k, v, x, do = inputs("lightning", 7)
    seg = T // world
    sp = SequenceParallel(group)
    sp.segments = Segments(continues=torch.zeros(B, dtype=torch.bool))
    sl = slice(rank * seg, (rank + 1) * seg)
    with sequence_parallel(sp):
        o = lightning_attn(q[:, sl], k[:, sl], v[:, sl], x, impl="chunked")
    torch.testing.assert_close(o, lightning_attn(q[:, sl], k[:, sl], v[:, sl], x, impl="chunked"))
    with pytest.raises(ValueError, match="initial state"):
        with sequence_parallel(sp):
            lightning_attn(q[:, sl], k[:, sl], v[:, sl], x, initial_state=torch.zeros(B, H, 4, DV))


def test_segments_match_whole_sequences():
    pytest.importorskip("triton")
    spawn_gloo(_worker, 4)


# ----------------------------------------------------------------------------------------------------
# the GLA summary's suffix sums (one process)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5, 64, 65, 200, 257])
def test_suffix_after_matches_float64_and_scans_time_briefly(T):
    """suffix_after = sum_{u>t} x_u along time, against a float64 loop, values and gradient, at lengths
    around the inner block; and no cumsum longer than the block runs along a dimension that is not the
    last (CUDA runs such a scan one thread per column through every step: the cost it avoids)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ops.sequence_parallel import _SCAN_BLOCK, suffix_after

    class LongScans(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.cumsum:
                x, dim = args[0], args[1] % args[0].dim()
                if dim != x.dim() - 1 and x.shape[dim] > _SCAN_BLOCK:
                    self.seen.append(tuple(x.shape))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(T)
    x = (-torch.rand(2, T, 3, 4, generator=g) * 8).requires_grad_()
    w = torch.randn(2, T, 3, 4, generator=g)
    with LongScans() as mode:
        got = suffix_after(x)
        (got * w).sum().backward()
    assert not mode.seen, f"long scans along time: {mode.seen}"
    x64 = x.detach().double()
    want = torch.zeros_like(x64)
    for t in range(T - 2, -1, -1):
        want[:, t] = want[:, t + 1] + x64[:, t + 1]
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    # d/dx_u of sum_t w_t after_t = sum_{t < u} w_t
    dwant = torch.cat([torch.zeros_like(w[:, :1]), w.double().cumsum(1)[:, :-1]], dim=1)
    torch.testing.assert_close(x.grad.double(), dwant, rtol=1e-6, atol=1e-5)

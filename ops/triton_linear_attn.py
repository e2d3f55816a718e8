"""The `triton` implementation of `lightning_attn` and `gated_linear_attn`: one differentiable
torch.library custom op per op (forward and backward ops, autograd registered) around the kernels of
`ops.triton_scan` and `ops.triton_gla_intra`, launched by the plan `ops.tuning` chooses for the shape.
Importing this module registers it (`ops/__init__.py` does so when Triton is installed); the public ops in
`ops.linear_attention` check the arguments before they get here.

Gradients flow to q, k, v, log_f and the initial state (and from the final state, when it is used).
A lightning `decay` is a fixed per-head constant (TNL does not learn it): it gets no gradient.
float64 inputs take the chunked plain-PyTorch twin (float64 is only ever a reference), and so do
sequences of no tokens (the walks of an empty sequence have no chunk to end on, so they would write no
final state and no initial state's gradient).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

from ops import tuning
from ops.checks import check_triton_device
from ops.config import get_config
from ops.linear_attention import register_impl
from ops.reference import log_decay
from ops.triton_launch import launch, on_input_device
from ops.tuning import launch_options
from ops.triton_gla_intra import (TAME_SPAN, gla_A_sub_kernel, gla_A_tame_kernel, gla_cumsum_kernel, gla_dg_kernel,
                                  gla_dqk_sub_kernel, gla_dqk_tame_kernel, gla_intra_out_kernel, gla_state_grad_kernel)
from ops.triton_scan import (dk_scan_kernel, dq_scan_kernel, dv_scan_kernel, fwd_scan_kernel,
                             seg_combine_kernel, seg_local_kernel)

BT = tuning.BT  # chunk length
LOG_BT = BT.bit_length() - 1  # the levels of the intra-chunk pairs of chunks that are not tame
# GLA d log_f: anchored every this many chunks (gla_dg_kernel). Its error is that of a sum over one run of
# ANCHOR_CHUNKS * BT tokens at any T; the anchor states cost 2 * K * V * 4 bytes per run and head
# (fp32, transient in the backward): at K = V = 128, 512 bytes per token and head. On an H200, bf16, 21 cases
# of gates and shapes: d log_f's error at most 3.5e-3 against 4.8e-3 with runs of 8 chunks (the bar is 5e-3),
# for up to 1.1% more fwd+bwd GPU time, median 0.9% (docs/kernels.md, Accuracy).
ANCHOR_CHUNKS = 4
# GLA's dq / dk walks for bf16 inputs: their fp32 operand as a bf16 hi + lo pair and two bf16 products
# (ops.triton_scan.dot_exact; 3-13% faster per walk than tf32 operands on an H100, docs/kernels.md), or
# tf32 operands (False). The accuracy cases of the pairs (tests/test_kernels_gpu.py,
# test_gla_walks_on_bf16_pairs_vs_float64 and, with this default, test_bf16_vs_float64) pass on an H100.
WALK_PAIRS = True
# GLA chunks that are not tame: the pairs inside aligned blocks of up to 2^LEVEL_BLOCKS rows (as many as the
# chunk's largest single-step decay allows, gla_cumsum_kernel) as one product with a reference per block
# (ops.triton_gla_intra._blocks) instead of a product per level: with gates in [-20, 0], 3 levels of 6 by
# levels, the other 3 by one product. 0: every level its own product. Checked against the float64 twin on
# CPU (tests/test_kernels.py). Off: on an H200 it took 0.97-1.01x the level products' time and its one
# rounding shared by three levels put d log_f's error at 4.7-5.1e-3 with gates in [-20, 0] (docs/kernels.md).
LEVEL_BLOCKS = 0


def _np2(x: int) -> int:
    # plain Python: triton.next_power_of_2 is a constexpr function in newer Triton releases, whose wrapper
    # costs microseconds per call, and a fwd+bwd calls this a dozen times
    return 1 << max(4, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    # plain Python for the same reason: triton.cdiv is a constexpr function too (Triton 3.6, 3.9)
    return -(-int(a) // int(b))


def _prec(x: Tensor) -> str:
    # fp32 inputs (the CPU tests, fp32 runs) want full-precision dots, not tf32's 10-bit mantissa
    return "ieee" if x.dtype == torch.float32 else "tf32"


_DUMMIES: dict[tuple, Tensor] = {}


def _cached(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A one-element tensor for pointer arguments the kernel never reads (made once per device)."""
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[key]


def _layout(q: Tensor, cu_seqlens: Tensor | None) -> tuple[int, int, Tensor]:
    """(sequences N, padded length T (packed: the total), cu as int32 or a dummy)."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return B, T, _cached(q.device, torch.int32)
    return cu_seqlens.numel() - 1, T, cu_seqlens.to(torch.int32).contiguous()


# the (sequence, chunk) table of the last packed layout: (a weak reference to its cu_seqlens, that tensor's
# version counter, T, the table). Every layer of a model gets the same cu_seqlens tensor, so only the first
# layer of a forward reads the lengths back (a host sync: the GPU idles until the host has caught up);
# the identity of a live tensor and its version counter (which any in-place change bumps) make a stale hit
# impossible. A tensor made under torch.inference_mode has no version counter, so an in-place change could
# not be told from the same lengths: its table is built at every call and not kept.
_LAST_TABLE: list = []


def _chunk_table(cu_seqlens: Tensor | None, N: int, T: int) -> tuple[int, Tensor | None]:
    """Number of chunks and, for packed input, the (sequence, chunk) pair of each (a host sync, once per
    cu_seqlens tensor)."""
    if cu_seqlens is None:
        return N * _cdiv(T, BT), None
    tracked = not cu_seqlens.is_inference()
    if _LAST_TABLE and tracked:
        ref, version, t, rows, table = _LAST_TABLE[0]
        if ref() is cu_seqlens and version == cu_seqlens._version and t == T:
            return rows, table
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pairs = [(n, c) for n, ln in enumerate(lens) for c in range(_cdiv(ln, BT))]
    table = torch.tensor(pairs, dtype=torch.int32, device=cu_seqlens.device).reshape(-1, 2).contiguous()
    if tracked:
        _LAST_TABLE[:] = [(weakref.ref(cu_seqlens), cu_seqlens._version, T, len(pairs), table)]
    return len(pairs), table


def _plan(op: str, q: Tensor, v: Tensor, N: int, T: int, varlen: bool, measure=None) -> tuning.Plan:
    return tuning.plan(op, N, q.shape[2], T, q.shape[3], v.shape[3], q.device, varlen, measure)


def _dummy(q: Tensor) -> Tensor:
    return _cached(q.device, torch.float32)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)  # stands for "no tensor" among a custom op's outputs


def _seg_marker(q: Tensor, plan: tuning.Plan) -> Tensor:
    # the segment length travels to the backward as the length of this (tiny) tensor: a custom op's
    # output of data-dependent size needs no host sync and no graph break under torch.compile
    return torch.empty(plan.seg_chunks, dtype=torch.int8, device=q.device)


# ----------------------------------------------------------------------------------------------------
# shared launches
# ----------------------------------------------------------------------------------------------------

def _two_level(a, x, g, log_lam, init, cu, N, T, plan, gated, reverse, extra_plain=False):
    """The split layout's chained segment states [N*H, S-1, K, V] (see ops.triton_scan): forward
    (reverse=False; a = k, x = v): slot j = the state at the start of segment j+1, init = h0; backward
    (a = q, x = do): slot j = the state gradient at the end of segment j, init = d(final state).
    extra_plain: also return the chain without `init` (gated backward: the dk walks leave the final
    state's gradient to gla_state_grad_kernel)."""
    H, K, V = a.shape[2], a.shape[3], x.shape[3]
    S, SC = plan.segments, plan.seg_chunks
    slots = torch.empty(N * H, S - 1, K, V, dtype=torch.float32, device=a.device)
    dec = torch.empty(N * H, S - 1, K, dtype=torch.float32, device=a.device)
    cl, cc = plan.launch["local"], plan.launch["combine"]
    bk, bv = min(cl["block"], _np2(K)), min(cl["block_v"], _np2(V))
    common = dict(H=H, K=K, V=V, BT=BT, VARLEN=cu.numel() > 1)
    launch(seg_local_kernel, (_cdiv(K, bk) * _cdiv(V, bv), N * H, S - 1),
        a, x, g, log_lam, slots, dec, cu, T, SC, S - 1, BK=bk, BV=bv, GATED=gated,
        HAS_DECAY=gated or log_lam is not None, REVERSE=reverse, F32=gated, PREC=_prec(a), **common,
        **launch_options(cl))
    plain = slots.clone() if extra_plain else None
    bk, bv = min(cc["block"], _np2(K)), min(cc["block_v"], _np2(V))
    grid = (_cdiv(K, bk) * _cdiv(V, bv), N * H)
    launch(seg_combine_kernel, grid, slots, dec, init if init is not None else slots, cu, T, SC, S - 1, BK=bk, BV=bv,
                             REVERSE=reverse, HAS_INIT=init is not None, **common, **launch_options(cc))
    if plain is not None:
        launch(seg_combine_kernel, grid, plain, dec, plain, cu, T, SC, S - 1, BK=bk, BV=bv, REVERSE=reverse,
                                 HAS_INIT=False, **common, **launch_options(cc))
    return slots, plain


def _fwd(q, k, v, g, log_lam, A, h0, cu, N, T, gated, plan):
    """o, final state, and the chained segment start states (split layout; else an empty tensor)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    S, SC = plan.segments, plan.seg_chunks
    Hs = _two_level(k, v, g, log_lam, h0, cu, N, T, plan, gated, reverse=False)[0] if S > 1 else None
    c = plan.launch["fwd"]
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    launch(fwd_scan_kernel, (_cdiv(V, c["block"]), N * H, S),
        q, k, v, g, log_lam, A, o, h0 if h0 is not None else ht, ht, Hs if Hs is not None else ht, cu, T,
        SC, max(S - 1, 1), H=H, K=K, V=V, BT=BT, BK=_np2(K), BV=c["block"], GATED=gated,
        HAS_DECAY=log_lam is not None or gated, HAS_H0=h0 is not None, VARLEN=cu.numel() > 1,
        PREC=_prec(q), **launch_options(c))
    return o, ht, (Hs.reshape(-1) if Hs is not None else q.new_empty(0, dtype=torch.float32))


def _bwd_walks(q, k, v, g, log_lam, A, do, h0, dht, Hs, cu, N, T, gated, plan, dq=None, dk=None, anchors=None):
    """dq, dk, dv, dh0. Gated: dq, dk are the given fp32 buffers holding the intra-chunk parts, onto which
    the walks add the inter-chunk parts. anchors (gated): (state buffer, gradient buffer, AC), into which
    the dq and dk walks store d log_f's anchors (see gla_dg_kernel), or None."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    S, SC = plan.segments, plan.seg_chunks
    SM1 = max(S - 1, 1)
    common = dict(H=H, K=K, V=V, BT=BT, GATED=gated, HAS_DECAY=log_lam is not None or gated,
                  VARLEN=cu.numel() > 1, PREC=_prec(q))
    cq, ck, cv = plan.launch["dq"], plan.launch["dk"], plan.launch["dv"]
    if not gated:
        dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if h0 is not None else None
    # gated: the final state's gradient reaches dk, d(initial state) and d log_f through
    # gla_state_grad_kernel instead (see there), so the dk walks start from dh = 0
    dht_k = None if gated else dht
    Hs = Hs.view(N * H, S - 1, K, V) if S > 1 else _dummy(q)
    anc_h, anc_dh, AC = anchors if anchors is not None else (_dummy(q), _dummy(q), 1)
    split = gated and q.dtype == torch.bfloat16 and tuning._FORCED.get("walk_split", WALK_PAIRS)
    # the three walks are independent: on CUDA, dq and dk run on side streams next to dv
    side = _side_streams(q.device)
    cur = torch.cuda.current_stream(q.device) if side else None
    if side:
        side[0].wait_stream(cur)
    with _on(side, 0):
        launch(dq_scan_kernel, (_cdiv(K, cq["block"]), N * H, S),
            k, v, g, log_lam, do, dq, h0 if h0 is not None else dq, Hs, anc_h, cu, T, SC, SM1, AC,
            BK=cq["block"], BV=_np2(V), HAS_H0=h0 is not None, ANCHOR=anchors is not None, SPLIT=split, **common,
            **launch_options(cq))
    if S > 1:
        Es, Es_plain = _two_level(q, do, g, log_lam, dht, cu, N, T, plan, gated, reverse=True,
                                  extra_plain=gated and dht is not None)
        Es_k = Es_plain if gated and dht is not None else Es
    else:
        Es = Es_k = _dummy(q)
    if side:
        side[1].wait_stream(cur)
    with _on(side, 1):
        launch(dk_scan_kernel, (_cdiv(K, ck["block"]), N * H, S),
            q, v, g, log_lam, do, dk, dht_k if dht_k is not None else dk, dh0 if dh0 is not None else dk, Es_k,
            anc_dh, cu, T, SC, SM1, AC, BK=ck["block"], BV=_np2(V), HAS_DHT=dht_k is not None,
            STORE_DH0=dh0 is not None, ANCHOR=anchors is not None, SPLIT=split, **common, **launch_options(ck))
    launch(dv_scan_kernel, (_cdiv(V, cv["block"]), N * H, S),
        q, k, g, log_lam, A, do, dv, dht if dht is not None else dv, Es, cu, T, SC, SM1,
        BK=_np2(K), BV=cv["block"], HAS_DHT=dht is not None, **common, **launch_options(cv))
    for st in side:
        cur.wait_stream(st)  # every later use of dq, dk (and of freed inputs) orders after the walks
    return dq, dk, dv, dh0


_STREAMS: dict[int, tuple] = {}


def _side_streams(device: torch.device) -> tuple:
    if device.type != "cuda" or not get_config().side_streams:
        return ()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _STREAMS:
        _STREAMS[idx] = (torch.cuda.Stream(idx), torch.cuda.Stream(idx))
    return _STREAMS[idx]


def _on(side: tuple, i: int):
    return torch.cuda.stream(side[i]) if side else contextlib.nullcontext()


def _contig(*xs):
    return tuple(None if x is None else x.contiguous() for x in xs)


# ----------------------------------------------------------------------------------------------------
# lightning attention
# ----------------------------------------------------------------------------------------------------

# Both ops are torch.library custom ops with registered autograd: torch.compile then keeps each call as
# one opaque node of its graph (no graph break; Dynamo does not trace the launches, the plan choice, the
# stream cache or the host-side chunk table of packed GLA input), and eager mode runs exactly the same code.

def _lightning_forward(q, k, v, log_lam, h0, cu, N, T, plan):
    return _fwd(q, k, v, None, log_lam, None, h0, cu, N, T, False, plan)


def _lightning_backward(q, k, v, log_lam, h0, dht, Hs, do, cu, N, T, plan):
    return _bwd_walks(q, k, v, None, log_lam, None, do, h0, dht, Hs, cu, N, T, False, plan)


@on_input_device
def _lightning_fwd_impl(q: Tensor, k: Tensor, v: Tensor, log_lam: Tensor | None, h0: Tensor | None,
                   cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, k, v, h0 = _contig(q, k, v, h0)
    N, T, cu = _layout(q, cu_seqlens)

    def measure(p):
        do = torch.randn_like(v)
        return tuning.candidate_ms(lambda: _lightning_backward(q, k, v, log_lam, h0, None,
                                                               _lightning_forward(q, k, v, log_lam, h0, cu, N, T, p)[2],
                                                               do, cu, N, T, p))
    plan = _plan("lightning", q, v, N, T, cu_seqlens is not None, measure)
    o, ht, Hs = _lightning_forward(q, k, v, log_lam, h0, cu, N, T, plan)
    return o, ht, Hs, _seg_marker(q, plan)


_lightning_fwd = torch.library.custom_op("linscale::lightning_attn_fwd", _lightning_fwd_impl, mutates_args=())


@_lightning_fwd.register_fake
def _(q, k, v, log_lam, h0, cu_seqlens):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ctx = torch.library.get_ctx()
    return (v.new_empty(v.shape), q.new_empty((N, q.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32),
            q.new_empty((ctx.new_dynamic_size(),), dtype=torch.float32),
            q.new_empty((ctx.new_dynamic_size(),), dtype=torch.int8))


@on_input_device
def _lightning_bwd_impl(q: Tensor, k: Tensor, v: Tensor, log_lam: Tensor | None, h0: Tensor | None,
                   cu_seqlens: Tensor | None, Hs: Tensor, seg: Tensor, do: Tensor, dht: Tensor | None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, k, v, h0, do, dht = _contig(q, k, v, h0, do, dht)
    N, T, cu = _layout(q, cu_seqlens)
    plan = _replan("lightning", q, v, N, T, cu_seqlens, seg)
    dq, dk, dv, dh0 = _lightning_backward(q, k, v, log_lam, h0, dht, Hs, do.to(v.dtype), cu, N, T, plan)
    return dq, dk, dv, dh0 if dh0 is not None else _empty(q)


_lightning_bwd = torch.library.custom_op("linscale::lightning_attn_bwd", _lightning_bwd_impl, mutates_args=())


def _replan(op, q, v, N, T, cu_seqlens, seg) -> tuning.Plan:
    """The backward's plan: the forward's segment length (it owns the chained states), the launch configs
    of the shape."""
    p = _plan(op, q, v, N, T, cu_seqlens is not None)
    nc = _cdiv(T, BT)
    return tuning.Plan(seg_chunks=seg.shape[0], segments=_cdiv(nc, seg.shape[0]), launch=p.launch,
                       source=p.source)


@_lightning_bwd.register_fake
def _(q, k, v, log_lam, h0, cu_seqlens, Hs, seg, do, dht):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            h0.new_empty(h0.shape, dtype=torch.float32) if h0 is not None else _empty(q))


def _lightning_setup(ctx, inputs, output) -> None:
    q, k, v, log_lam, h0, cu_seqlens = inputs
    ctx.set_materialize_grads(False)  # see _gla_setup
    ctx.save_for_backward(q, k, v, log_lam, h0, cu_seqlens, output[2], output[3])


def _lightning_grads(ctx, do, dht, bwd):
    q, k, v, log_lam, h0, cu_seqlens, Hs, seg = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dh0 = bwd(q, k, v, log_lam, h0, cu_seqlens, Hs, seg, do, dht)
    return dq, dk, dv, None, dh0 if h0 is not None else None, None


def _lightning_autograd(ctx, do, dht, _dHs, _dseg):
    return _lightning_grads(ctx, do, dht, _lightning_bwd)


torch.library.register_autograd("linscale::lightning_attn_fwd", _lightning_autograd, setup_context=_lightning_setup)


def _eager_entry(name: str, fwd_impl, setup, grads, bwd_impl) -> type[torch.autograd.Function]:
    """Eager mode's entry for one op (see `_eager`): a torch.autograd.Function with the custom op's
    forward, backward and saved tensors, without the dispatcher's Python layers around them. It returns
    the op's two public outputs (o and the final state)."""

    def forward(ctx, *inputs):
        out = fwd_impl(*inputs)
        setup(ctx, inputs, out)
        return out[0], out[1]

    def backward(ctx, do, dht):
        return grads(ctx, do, dht, bwd_impl)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(backward)})


_LightningEager = _eager_entry("_LightningEager", _lightning_fwd_impl, _lightning_setup, _lightning_grads,
                               _lightning_bwd_impl)


def _eager(*xs: Tensor | None) -> bool:
    """Whether a call takes the autograd.Function entry instead of the custom op: plain tensors outside
    torch.compile. Both run the same forward and backward; the custom op's dispatch (schema checks, its
    autograd wrapper, a second dispatch for the backward) costs a few hundred microseconds of host time
    per fwd+bwd, which small shapes wait for. Under torch.compile, and for fake tensors or other tensor
    subclasses, the custom op stays the one opaque node."""
    return not torch.compiler.is_compiling() and all(x is None or type(x) is Tensor for x in xs)


def lightning_attn_triton(q: Tensor, k: Tensor, v: Tensor, decay: Tensor | None,
                          initial_state: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    check_triton_device("lightning_attn", q, "chunked")
    if q.dtype == torch.float64 or q.shape[1] == 0:
        return _registered_fallback("lightning_attn")(q, k, v, decay, initial_state, cu_seqlens)
    # TNL's decay is a fixed constant: no gradient reaches it (its log is taken outside the graph of q, k, v)
    log_lam = None if decay is None else log_decay(decay, torch.float32).contiguous()
    if _eager(q, k, v, initial_state, cu_seqlens):
        return _LightningEager.apply(q, k, v, log_lam, initial_state, cu_seqlens)
    o, ht, _, _ = _lightning_fwd(q, k, v, log_lam, initial_state, cu_seqlens)
    return o, ht


# ----------------------------------------------------------------------------------------------------
# gated linear attention
# ----------------------------------------------------------------------------------------------------

def _tame_span() -> float:
    # chunks whose 32-row halves decay by at most exp(-span) take the tame kernels' products, the others
    # the level kernels; the test-only seam (ops.testing.force_plan(tame_span=-1)) sends every chunk through
    # the level kernels
    return min(tuning._FORCED.get("tame_span", TAME_SPAN), TAME_SPAN)


def _level_blocks() -> int:
    # the test-only seam (ops.testing.force_plan(level_blocks=...)) turns the block products on or off
    return int(tuning._FORCED.get("level_blocks", LEVEL_BLOCKS))


def _anchor_chunks() -> int:
    # the test-only seam (ops.testing.force_plan(anchor_chunks=...)) sets other spacings
    return int(tuning._FORCED.get("anchor_chunks", ANCHOR_CHUNKS))


def _gla_cumsum(g, cu, T, chunks):
    """(bc, tame): the chunk-local cumulative log-decay of every chunk (fp32; the intra-chunk kernels and
    the walks read it, and the backward keeps it in place of log f), and per (chunk, head) the chunk's
    flag at its first token (the backward reads it, so both passes agree)."""
    H, K = g.shape[2], g.shape[3]
    n_chunks, table = chunks
    bc = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    tame = torch.empty(g.shape[:3], dtype=torch.int32, device=g.device)
    launch(gla_cumsum_kernel, (n_chunks, H), g, bc, tame, cu, table if table is not None else cu, T, _cdiv(T, BT),
                                     H=H, K=K, BT=BT, BK=_np2(K), TAME_SPAN=_tame_span(), MAX_LB=_level_blocks(),
                                     VARLEN=table is not None)
    return bc, tame


def _intra_out(A, x, cu, T, chunks, transposed):
    """A x (or A^T x) per chunk, fp32 [B, T, H, V]: the intra-chunk part of o (x = v) or of dv (x = do)."""
    n_chunks, table = chunks
    H, V = x.shape[2], x.shape[3]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bv = min(64, _np2(V))
    launch(gla_intra_out_kernel, (n_chunks, _cdiv(V, bv), H),
        A, x, out, cu, table if table is not None else cu, T, _cdiv(T, BT), H=H, V=V, BT=BT, BV=bv,
        TRANSPOSED=transposed, VARLEN=table is not None, PREC=_prec(x), num_warps=4, num_stages=1)
    return out


def _gla_forward(q, k, v, g, h0, cu, N, T, chunks, plan):
    """o, final state, A (the intra-chunk weights of every chunk), the tame flags, the chained states."""
    H, K = q.shape[2], q.shape[3]
    n_chunks, table = chunks
    bc, tame = _gla_cumsum(g, cu, T, chunks)
    A = torch.empty(q.shape[0] * T, H, BT, dtype=torch.float32, device=q.device)
    ca, cs = plan.launch["A"], plan.launch["A_sub"]
    tab, NT, vl = table if table is not None else cu, _cdiv(T, BT), table is not None
    launch(gla_A_tame_kernel, (n_chunks, H),
        q, k, bc, A, tame, cu, tab, T, NT, TAME_SPAN=TAME_SPAN, H=H, K=K, BT=BT, BK=min(ca["block"], _np2(K)),
        VARLEN=vl, PREC=_prec(q), **launch_options(ca))
    launch(gla_A_sub_kernel, (n_chunks, H),
        q, k, bc, A, tame, cu, tab, T, NT, H=H, K=K, BT=BT, BK=min(cs["block"], _np2(K)), LOG_BT=LOG_BT,
        BLOCKS=_level_blocks() > 0, TAME_SPAN=TAME_SPAN, VARLEN=vl, PREC=_prec(q), **launch_options(cs))
    # the walks read b (not log f) and the intra-chunk part A v (not A)
    o, ht, Hs = _fwd(q, k, v, bc, None, _intra_out(A, v, cu, T, chunks, False), h0, cu, N, T, True, plan)
    return o, ht, A, tame, Hs, bc


def _gla_backward(q, k, v, bc, h0, A, tame, Hs, do, dht, cu, N, T, chunks, plan, dg_dtype):
    """dq, dk, dv, d log_f (in dg_dtype), dh0. bc: the forward's chunk-local cumulative log-decay, kept in
    place of log f (the same size in fp32; no cumulative sum again)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    n_chunks, table = chunks
    # the intra-chunk dq, dk first (fp32 buffers, every chunk written by one of the two kernels), then the
    # walks add the inter-chunk parts
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    ct, cs = plan.launch["dqk"], plan.launch["dqk_sub"]
    tab, NT, vl = table if table is not None else cu, _cdiv(T, BT), table is not None
    att = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)  # do_t . v_t
    launch(gla_dqk_tame_kernel, (n_chunks, H),
        q, k, v, bc, do, dq, dk, att, tame, cu, tab, T, NT, TAME_SPAN=TAME_SPAN, H=H, K=K, V=V, BT=BT,
        BK=min(ct["block"], _np2(K)), BV=_np2(V), VARLEN=vl, PREC=_prec(q), **launch_options(ct))
    bks = min(cs["block"], _np2(K))
    kbp = tuning.key_blocks(cs, K)
    launch(gla_dqk_sub_kernel, (n_chunks, _cdiv(_cdiv(K, bks), kbp), H),
        q, k, v, bc, do, dq, dk, att, tame, cu, tab, T, NT, H=H, K=K, V=V, BT=BT, BK=bks, BV=min(64, _np2(V)),
        LOG_BT=LOG_BT, BLOCKS=_level_blocks() > 0, TAME_SPAN=TAME_SPAN, VARLEN=vl, PREC=_prec(q), KEY_BLOCKS=kbp,
        **launch_options(cs))
    # d log_f's anchors: the state and its gradient at every AC-th chunk boundary, stored by the dq / dk
    # walks (one slot per AC * BT tokens of the whole batch; see anchor_block)
    AC = _anchor_chunks()
    anchors = None
    if _cdiv(T, BT) > AC:
        slots = _cdiv(q.shape[0] * T, AC * BT)
        anchors = tuple(torch.empty(slots, H, K, V, dtype=torch.float32, device=q.device) for _ in range(2)) + (AC,)
    dq, dk, dv, dh0 = _bwd_walks(q, k, v, bc, None, _intra_out(A, do, cu, T, chunks, True), do, h0, dht, Hs,
                                 cu, N, T, True, plan, dq=dq, dk=dk, anchors=anchors)
    dgx = dkx = None
    if dht is not None:  # the final state's gradient, in its direct (non-cancelling) form
        dgx = torch.empty(bc.shape, dtype=torch.float32, device=bc.device)
        dkx = torch.empty(bc.shape, dtype=torch.float32, device=bc.device)
        bks = min(32, _np2(K))
        launch(gla_state_grad_kernel, (_cdiv(K, bks), N * H),
            k, v, bc, dht, h0 if h0 is not None else dht, dgx, dkx, dh0 if dh0 is not None else dht, cu, T,
            H=H, K=K, V=V, BT=BT, BK=bks, BV=_np2(V), HAS_H0=h0 is not None, VARLEN=cu.numel() > 1,
            num_warps=4)
    dg = torch.empty(bc.shape, dtype=dg_dtype, device=bc.device)
    dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)
    cg = plan.launch["dg"]
    bkg = min(cg["block"], _np2(K))
    anc_h, anc_dh = anchors[:2] if anchors is not None else (_dummy(q), _dummy(q))
    NA = _cdiv(_cdiv(T, BT), AC)  # runs per sequence (dense input)
    launch(gla_dg_kernel, (_cdiv(K, bkg), H, N * NA if table is None else n_chunks),
        q, k, att, dq, dk, dg, dgx if dgx is not None else dg, dkx if dkx is not None else dg,
        dq_out, dk_out, anc_h, anc_dh, cu, table if table is not None else cu, T, AC, NA, H=H, K=K, V=V,
        BT=BT, BK=bkg, BV=_np2(V), HAS_DS=dgx is not None, ANCHOR=anchors is not None,
        VARLEN=table is not None, **launch_options(cg))
    return dq_out, dk_out, dv, dg, dh0


@on_input_device
def _gla_fwd_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None, cu_seqlens: Tensor | None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, g, h0 = _contig(q, k, v, g, h0)
    N, T, cu = _layout(q, cu_seqlens)
    chunks = _chunk_table(cu_seqlens, N, T)

    def measure(p):
        do = torch.randn_like(v)

        def run():
            _, _, A, tame, Hs, bc = _gla_forward(q, k, v, g, h0, cu, N, T, chunks, p)
            _gla_backward(q, k, v, bc, h0, A, tame, Hs, do, None, cu, N, T, chunks, p, g.dtype)
        return tuning.candidate_ms(run)
    plan = _plan("gla", q, v, N, T, cu_seqlens is not None, measure)
    o, ht, A, tame, Hs, bc = _gla_forward(q, k, v, g, h0, cu, N, T, chunks, plan)
    # a fresh tensor: a custom op's outputs must not be shared between calls (the table may be cached)
    table = chunks[1].clone() if chunks[1] is not None else q.new_empty((0, 2), dtype=torch.int32)
    # bc, and log f's dtype as an empty tensor: the backward keeps these instead of log f itself
    return o, ht, A, tame, table, Hs, _seg_marker(q, plan), bc, g.new_empty(0)


_gla_fwd = torch.library.custom_op("linscale::gated_linear_attn_fwd", _gla_fwd_impl, mutates_args=())


@_gla_fwd.register_fake
def _(q, k, v, g, h0, cu_seqlens):
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ctx = torch.library.get_ctx()
    # packed input: one table row per (sequence, chunk), a count known only from the lengths' values
    rows = 0 if cu_seqlens is None else ctx.new_dynamic_size()
    return (v.new_empty(v.shape), q.new_empty((N, H, K, v.shape[3]), dtype=torch.float32),
            q.new_empty((B * T, H, BT), dtype=torch.float32), q.new_empty((B, T, H), dtype=torch.int32),
            q.new_empty((rows, 2), dtype=torch.int32),
            q.new_empty((ctx.new_dynamic_size(),), dtype=torch.float32),
            q.new_empty((ctx.new_dynamic_size(),), dtype=torch.int8),
            q.new_empty(g.shape, dtype=torch.float32), g.new_empty((0,)))


@on_input_device
def _gla_bwd_impl(q: Tensor, k: Tensor, v: Tensor, bc: Tensor, g_like: Tensor, h0: Tensor | None,
                  cu_seqlens: Tensor | None, A: Tensor, tame: Tensor, table: Tensor, Hs: Tensor, seg: Tensor,
                  do: Tensor, dht: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, h0, do, dht = _contig(q, k, v, h0, do, dht)
    N, T, cu = _layout(q, cu_seqlens)
    chunks = (N * _cdiv(T, BT), None) if cu_seqlens is None else (table.shape[0], table)
    plan = _replan("gla", q, v, N, T, cu_seqlens, seg)
    dq, dk, dv, dg, dh0 = _gla_backward(q, k, v, bc, h0, A, tame, Hs, do.to(v.dtype), dht, cu, N, T, chunks, plan,
                                        g_like.dtype)
    return dq, dk, dv, dg, dh0 if dh0 is not None else _empty(q)


_gla_bwd = torch.library.custom_op("linscale::gated_linear_attn_bwd", _gla_bwd_impl, mutates_args=())


@_gla_bwd.register_fake
def _(q, k, v, bc, g_like, h0, cu_seqlens, A, tame, table, Hs, seg, do, dht):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g_like.new_empty(bc.shape),
            h0.new_empty(h0.shape, dtype=torch.float32) if h0 is not None else _empty(q))


def _gla_setup(ctx, inputs, output) -> None:
    q, k, v, g, h0, cu_seqlens = inputs
    # an unused final state (training) must reach the backward as None, not as zeros: zeros would run
    # gla_state_grad_kernel's two extra walks per call for nothing
    ctx.set_materialize_grads(False)
    # log f itself is not kept: the forward's bc (its chunk-local cumulative sum, the same size in fp32)
    # stands in for it, and an empty tensor for its dtype
    ctx.save_for_backward(q, k, v, h0, cu_seqlens, *output[2:])


def _gla_grads(ctx, do, dht, bwd):
    q, k, v, h0, cu_seqlens, A, tame, table, Hs, seg, bc, g_like = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dh0 = bwd(q, k, v, bc, g_like, h0, cu_seqlens, A, tame, table, Hs, seg, do, dht)
    return dq, dk, dv, dg, dh0 if h0 is not None else None, None


def _gla_autograd(ctx, do, dht, _dA, _dtame, _dtable, _dHs, _dseg, _dbc, _dg_like):
    return _gla_grads(ctx, do, dht, _gla_bwd)


torch.library.register_autograd("linscale::gated_linear_attn_fwd", _gla_autograd, setup_context=_gla_setup)


_GlaEager = _eager_entry("_GlaEager", _gla_fwd_impl, _gla_setup, _gla_grads, _gla_bwd_impl)


def gated_linear_attn_triton(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor,
                             initial_state: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    check_triton_device("gated_linear_attn", q, "chunked")
    if q.dtype == torch.float64 or q.shape[1] == 0:
        return _registered_fallback("gated_linear_attn")(q, k, v, log_f, initial_state, cu_seqlens)
    if _eager(q, k, v, log_f, initial_state, cu_seqlens):
        return _GlaEager.apply(q, k, v, log_f, initial_state, cu_seqlens)
    o, ht, *_ = _gla_fwd(q, k, v, log_f, initial_state, cu_seqlens)
    return o, ht


def _registered_fallback(op: str):
    from ops.linear_attention import _IMPLS  # the chunked twin, as registered (varlen included)
    return _IMPLS[op]["chunked"]


register_impl("lightning_attn", "triton", lightning_attn_triton)
register_impl("gated_linear_attn", "triton", gated_linear_attn_triton)

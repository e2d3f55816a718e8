"""The `triton` implementation of `lightning_attn` and `gated_linear_attn`: one differentiable
torch.library custom op per op (forward and backward ops, autograd registered) around the kernels of
`ops.triton_scan` and `ops.triton_gla_intra`. Importing this module registers it (`ops/__init__.py` does
so when Triton imports); the public ops in `ops.linear_attention` check the arguments before they get here.

Gradients flow to q, k, v, log_f and the initial state (and from the final state, when it is used).
A lightning `decay` is a fixed per-head constant (TNL does not learn it): it gets no gradient.
float64 inputs take the chunked plain-PyTorch twin (Triton's float64 dot is not what these kernels are
tuned for, and float64 is only ever a reference).
"""
from __future__ import annotations

import json
import os

import torch
import triton
from torch import Tensor

from ops.linear_attention import register_impl
from ops.triton_gla_intra import (TAME_SPAN, gla_A_kernel, gla_A_tame_kernel, gla_cumsum_kernel,
                                  gla_dg_kernel, gla_dqk_intra_kernel, gla_dqk_tame_kernel,
                                  gla_state_grad_kernel)
from ops.triton_scan import bwd_scans_kernel, dk_scan_kernel, dq_scan_kernel, dv_scan_kernel, fwd_scan_kernel

BT = 64  # chunk length
BC = 16  # sub-chunk length of the gated intra-chunk products
BK_INTRA = 32  # key block of the element-wise [BC, BC, BK] tiles
# chunks whose strongest channel decays by at most exp(-TAME) take the direct intra-chunk products (tests
# lower it to force the sub-chunk path; above TAME_SPAN it would be unsafe, see ops.triton_gla_intra)
TAME = TAME_SPAN


def _np2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 16))


def _prec(x: Tensor) -> str:
    # fp32 inputs (the CPU tests, fp32 runs) want full-precision dots, not tf32's 10-bit mantissa
    return "ieee" if x.dtype == torch.float32 else "tf32"


# Tile width of the split dimension, warps and pipeline stages per scan kernel (H200-tuned, see
# docs/kernels.md). Each scan holds whole the dimension it reduces over and splits the other, so each
# (sequence, head) gets a few programs. `TUNE[kernel] = {...}` overrides (used by the tuning sweep).
TUNE: dict[str, dict[str, int]] = json.loads(os.environ.get("LINSCALE_TUNE", "{}"))


# all three backward scans in one launch (`bwd_scans_kernel`) when LINSCALE_FUSED_BWD=1, else three
# (measured on the H200, B=4 H=16 T=8192 D=128: no faster for lightning, 0.95 vs 0.91 ms, and much
# slower for GLA, whose roles share the register budget of the largest: off by default)
FUSED_BWD = os.environ.get("LINSCALE_FUSED_BWD", "0") == "1"


def _cfg(kernel: str, K: int, V: int, gated: bool = False) -> dict[str, int]:
    Kp, Vp = _np2(K), _np2(V)
    if kernel == "bwd":  # the fused backward: warps / stages shared by its three roles
        cfg = {"block": 0, "num_warps": 4, "num_stages": 2 if Kp <= 128 else 1}
        cfg.update(TUNE.get(kernel, {}))
        return cfg
    split = Vp if kernel in ("fwd", "dv") else Kp
    wide = max(Kp, Vp) >= 128
    if kernel in ("fwd", "dv"):  # hold all of K: 8 warps, 3 stages fit in shared memory up to K = 128
        cfg = {"block": 64, "num_warps": 8 if wide and (kernel == "fwd" or Kp <= 128) else 4,
               # gated: its g tile and fp32 dot operands too (2 stages: 156 KB of shared memory and half
               # the register spills of 3 stages at K = 128, in an sm_90 compile); gated K=256: 1 stage
               "num_stages": (2 if gated else 3) if Kp <= 128 else 1 if gated else 2}
    else:  # hold all of V: narrow key blocks, more programs
        cfg = {"block": 32 if Kp <= 128 else 64, "num_warps": 4, "num_stages": 2}
    cfg.update(TUNE.get(kernel, {}))
    cfg["block"] = min(cfg["block"], split)
    return cfg


def _check_device(q: Tensor) -> None:
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the `triton` ops implementation needs CUDA tensors (or TRITON_INTERPRET=1 for the "
                         "CPU interpreter); use impl='chunked' on CPU")


def _layout(q: Tensor, cu_seqlens: Tensor | None) -> tuple[int, int, int, Tensor]:
    """(sequences N, padded length T, max chunks per sequence, cu as int32 or a dummy)."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return B, T, triton.cdiv(T, BT), q.new_zeros(1, dtype=torch.int32)
    return cu_seqlens.numel() - 1, T, 0, cu_seqlens.to(torch.int32).contiguous()


def _chunk_table(cu_seqlens: Tensor | None, N: int, T: int) -> tuple[int, Tensor | None]:
    """Number of chunks and, for packed input, the (sequence, chunk) pair of each (host sync)."""
    if cu_seqlens is None:
        return N * triton.cdiv(T, BT), None
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pairs = [(n, c) for n, ln in enumerate(lens) for c in range(triton.cdiv(ln, BT))]
    table = torch.tensor(pairs, dtype=torch.int32, device=cu_seqlens.device).reshape(-1, 2).contiguous()
    return len(pairs), table


# ----------------------------------------------------------------------------------------------------
# shared launches
# ----------------------------------------------------------------------------------------------------

def _fwd(q, k, v, g, log_lam, A, h0, cu, N, T, gated):
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    c = _cfg("fwd", K, V, gated)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(V, c["block"]), N * H)
    fwd_scan_kernel[grid](q, k, v, g, log_lam, A, o, h0 if h0 is not None else ht, ht, cu, T,
                          H=H, K=K, V=V, BT=BT, BK=_np2(K), BV=c["block"], GATED=gated,
                          HAS_DECAY=log_lam is not None or gated, HAS_H0=h0 is not None,
                          VARLEN=cu.numel() > 1, PREC=_prec(q), num_warps=c["num_warps"],
                          num_stages=c["num_stages"])
    return o, ht


def _bwd_scans(q, k, v, g, log_lam, A, do, h0, dht, cu, N, T, gated, dq=None, dk=None):
    """dq, dk, dv, dh0. Gated: dq, dk are the given fp32 buffers holding the intra-chunk parts, onto which
    the scans add the inter-chunk parts."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    common = dict(H=H, K=K, V=V, BT=BT, GATED=gated, HAS_DECAY=log_lam is not None or gated,
                  VARLEN=cu.numel() > 1, PREC=_prec(q))
    cq, ck, cv = _cfg("dq", K, V, gated), _cfg("dk", K, V, gated), _cfg("dv", K, V, gated)
    launch = lambda c: dict(num_warps=c["num_warps"], num_stages=c["num_stages"])  # noqa: E731
    if not gated:
        dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if h0 is not None else None
    # gated: the final state's gradient reaches dk, d(initial state) and d log_f through
    # gla_state_grad_kernel instead (see there), so the dk scan starts from dh = 0
    dht_k = None if gated else dht
    if FUSED_BWD:  # the three scans in one launch (co-resident, see bwd_scans_kernel)
        c = _cfg("bwd", K, V, gated)
        NH = N * H
        n = (triton.cdiv(V, cv["block"]) + triton.cdiv(K, ck["block"]) + triton.cdiv(K, cq["block"])) * NH
        bwd_scans_kernel[(n,)](
            q, k, v, g, log_lam, A, do, dq, dk, dv, h0 if h0 is not None else dq,
            dht_k if dht_k is not None else dk, dht if dht is not None else dv, dh0 if dh0 is not None else dk,
            cu, T, NH, BKQ=cq["block"], BKK=ck["block"], BVV=cv["block"], BKF=_np2(K), BVF=_np2(V),
            HAS_H0=h0 is not None, HAS_DHT_K=dht_k is not None, HAS_DHT_V=dht is not None,
            STORE_DH0=dh0 is not None, **common, num_warps=c["num_warps"], num_stages=c["num_stages"])
        return dq, dk, dv, dh0
    # the three scans are independent and each is latency-bound with few programs: on CUDA run
    # dq and dk on side streams, concurrently with dv
    side = _side_streams(q.device)
    cur = torch.cuda.current_stream(q.device) if side else None
    for st in side:
        st.wait_stream(cur)
    with _on(side, 0):
        dq_scan_kernel[(triton.cdiv(K, cq["block"]), N * H)](
            k, v, g, log_lam, do, dq, h0 if h0 is not None else dq, cu, T,
            BK=cq["block"], BV=_np2(V), HAS_H0=h0 is not None, **common, **launch(cq))
    with _on(side, 1):
        dk_scan_kernel[(triton.cdiv(K, ck["block"]), N * H)](
            q, v, g, log_lam, do, dk, dht_k if dht_k is not None else dk, dh0 if dh0 is not None else dk,
            cu, T, BK=ck["block"], BV=_np2(V), HAS_DHT=dht_k is not None, STORE_DH0=dh0 is not None, **common,
            **launch(ck))
    dv_scan_kernel[(triton.cdiv(V, cv["block"]), N * H)](
        q, k, g, log_lam, A, do, dv, dht if dht is not None else dv, cu, T,
        BK=_np2(K), BV=cv["block"], HAS_DHT=dht is not None, **common, **launch(cv))
    for st in side:
        cur.wait_stream(st)  # every later use of dq, dk (and of freed inputs) orders after the scans
    return dq, dk, dv, dh0


_STREAMS: dict[int, tuple] = {}


def _side_streams(device: torch.device) -> tuple:
    if device.type != "cuda" or os.environ.get("LINSCALE_SCAN_STREAMS", "1") == "0":
        return ()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _STREAMS:
        _STREAMS[idx] = (torch.cuda.Stream(idx), torch.cuda.Stream(idx))
    return _STREAMS[idx]


def _on(side: tuple, i: int):
    import contextlib
    return torch.cuda.stream(side[i]) if side else contextlib.nullcontext()


def _contig(*xs):
    return tuple(None if x is None else x.contiguous() for x in xs)


# ----------------------------------------------------------------------------------------------------
# lightning attention
# ----------------------------------------------------------------------------------------------------

# Both ops are torch.library custom ops with registered autograd: torch.compile then keeps each call as
# one opaque node of its graph (no graph break; Dynamo does not trace the launches, the stream cache or
# the host-side chunk table of packed GLA input), and eager mode runs exactly the same code.

def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)  # stands for "no tensor" among a custom op's outputs


@torch.library.custom_op("linscale::lightning_attn_fwd", mutates_args=())
def _lightning_fwd(q: Tensor, k: Tensor, v: Tensor, log_lam: Tensor | None, h0: Tensor | None,
                   cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    q, k, v, h0 = _contig(q, k, v, h0)
    N, T, _, cu = _layout(q, cu_seqlens)
    return _fwd(q, k, v, None, log_lam, None, h0, cu, N, T, gated=False)


@_lightning_fwd.register_fake
def _(q, k, v, log_lam, h0, cu_seqlens):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(v.shape), q.new_empty((N, q.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)


@torch.library.custom_op("linscale::lightning_attn_bwd", mutates_args=())
def _lightning_bwd(q: Tensor, k: Tensor, v: Tensor, log_lam: Tensor | None, h0: Tensor | None,
                   cu_seqlens: Tensor | None, do: Tensor, dht: Tensor | None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, k, v, h0, do, dht = _contig(q, k, v, h0, do, dht)
    N, T, _, cu = _layout(q, cu_seqlens)
    dq, dk, dv, dh0 = _bwd_scans(q, k, v, None, log_lam, None, do.to(v.dtype), h0, dht, cu, N, T,
                                 gated=False)
    return dq, dk, dv, dh0 if dh0 is not None else _empty(q)


@_lightning_bwd.register_fake
def _(q, k, v, log_lam, h0, cu_seqlens, do, dht):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            h0.new_empty(h0.shape, dtype=torch.float32) if h0 is not None else _empty(q))


def _lightning_setup(ctx, inputs, output) -> None:
    q, k, v, log_lam, h0, cu_seqlens = inputs
    ctx.set_materialize_grads(False)  # see _gla_setup
    ctx.save_for_backward(q, k, v, log_lam, h0, cu_seqlens)


def _lightning_backward(ctx, do, dht):
    q, k, v, log_lam, h0, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dh0 = _lightning_bwd(q, k, v, log_lam, h0, cu_seqlens, do, dht)
    return dq, dk, dv, None, dh0 if h0 is not None else None, None


torch.library.register_autograd("linscale::lightning_attn_fwd", _lightning_backward, setup_context=_lightning_setup)


def lightning_attn_triton(q: Tensor, k: Tensor, v: Tensor, decay: Tensor | None,
                          initial_state: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    _check_device(q)
    if q.dtype == torch.float64:
        return _registered_fallback("lightning_attn")(q, k, v, decay, initial_state, cu_seqlens)
    # TNL's decay is a fixed constant: no gradient reaches it (its log is taken outside the graph of q, k, v)
    log_lam = None if decay is None else decay.detach().float().log().contiguous()
    return _lightning_fwd(q, k, v, log_lam, initial_state, cu_seqlens)


# ----------------------------------------------------------------------------------------------------
# gated linear attention
# ----------------------------------------------------------------------------------------------------

def _gla_cumsum(g, cu, T, chunks, tame=None):
    """(bc, tame): per (chunk, head) the tame flag at the chunk's first token (computed, or the given
    flags of the forward pass), and for the other chunks the chunk-local cumulative log-decay (fp32)
    that the sub-chunk kernels read."""
    H, K = g.shape[2], g.shape[3]
    n_chunks, table = chunks
    bc = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    set_flags = tame is None
    if set_flags:
        tame = torch.empty(g.shape[:3], dtype=torch.int32, device=g.device)
    gla_cumsum_kernel[(n_chunks, H)](g, bc, tame, cu, table if table is not None else cu, T, triton.cdiv(T, BT),
                                     H=H, K=K, BT=BT, BK=_np2(K), TAME_SPAN=min(TAME, TAME_SPAN),
                                     SET_FLAGS=set_flags, VARLEN=table is not None)
    return bc, tame


def _gla_A(q, k, g, bc, tame, cu, N, T, chunks):
    """The intra-chunk weights of every chunk: the tame ones directly, the others by sub-chunks."""
    H, K = q.shape[2], q.shape[3]
    n_chunks, table = chunks
    A = torch.empty(q.shape[0] * T, H, BT, dtype=torch.float32, device=q.device)
    # H200, T = 8192: 32-wide key blocks, 4 warps 0.239 ms, 8 warps 0.274 (both GPU-tested)
    ca = {"block": 32, "num_warps": 4, **TUNE.get("A", {})}
    gla_A_tame_kernel[(n_chunks, H)](
        q, k, g, A, tame, cu, table if table is not None else cu, T, triton.cdiv(T, BT),
        TAME_SPAN=TAME_SPAN, H=H, K=K, BT=BT, BK=min(ca["block"], _np2(K)), VARLEN=table is not None,
        PREC=_prec(q), num_warps=ca["num_warps"])
    gla_A_kernel[(n_chunks, BT // BC, H)](
        q, k, bc, A, tame, cu, table if table is not None else cu, T, triton.cdiv(T, BT),
        H=H, K=K, BT=BT, BC=BC, BK=min(BK_INTRA, _np2(K)), VARLEN=table is not None, PREC=_prec(q),
        num_warps=4)
    return A


# The scans carry only what needs the walk (the state); the intra-chunk parts come from kernels parallel
# over chunks: A from `gla_A_tame_kernel` for tame chunks (see `ops.triton_gla_intra.gla_cumsum_kernel`)
# and from the sub-chunk `gla_A_kernel` for the others (gates near 0); intra dq / dk likewise from
# `gla_dg_kernel` and `gla_dqk_intra_kernel`. The forward's A, tame flags and (sequence, chunk) table of
# packed input (its one host sync) are kept for the backward.

@torch.library.custom_op("linscale::gated_linear_attn_fwd", mutates_args=())
def _gla_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None,
             cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, g, h0 = _contig(q, k, v, g, h0)
    N, T, _, cu = _layout(q, cu_seqlens)
    chunks = _chunk_table(cu_seqlens, N, T)
    bc, tame = _gla_cumsum(g, cu, T, chunks)
    A = _gla_A(q, k, g, bc, tame, cu, N, T, chunks)
    o, ht = _fwd(q, k, v, g, None, A, h0, cu, N, T, gated=True)
    table = chunks[1] if chunks[1] is not None else q.new_empty((0, 2), dtype=torch.int32)
    return o, ht, A, tame, table


@_gla_fwd.register_fake
def _(q, k, v, g, h0, cu_seqlens):
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # packed input: one table row per (sequence, chunk), a count known only from the lengths' values
    rows = 0 if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
    return (v.new_empty(v.shape), q.new_empty((N, H, K, v.shape[3]), dtype=torch.float32),
            q.new_empty((B * T, H, BT), dtype=torch.float32), q.new_empty((B, T, H), dtype=torch.int32),
            q.new_empty((rows, 2), dtype=torch.int32))


@torch.library.custom_op("linscale::gated_linear_attn_bwd", mutates_args=())
def _gla_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None, cu_seqlens: Tensor | None,
             A: Tensor, tame: Tensor, table: Tensor, do: Tensor, dht: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, g, h0, do, dht = _contig(q, k, v, g, h0, do, dht)
    N, T, _, cu = _layout(q, cu_seqlens)
    if cu_seqlens is None:
        n_chunks, table = N * triton.cdiv(T, BT), None
    else:
        n_chunks = table.shape[0]
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    do = do.to(v.dtype)
    # the intra-chunk dq, dk first (fp32 buffers, every chunk written by one of the two kernels), then
    # the scans add the inter-chunk parts
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    grid, cu_tab, NT = (n_chunks, H), table if table is not None else cu, triton.cdiv(T, BT)
    # H200, T = 8192 (each GPU-tested): key blocks of 16 at 4 warps 0.534 ms; 32/4 0.585, 64/4 0.601, 32/8 0.845
    ct = {"block": 16, "num_warps": 4, **TUNE.get("dqk", {})}
    gla_dqk_tame_kernel[grid](q, k, v, g, do, dq, dk, tame, cu, cu_tab, T, NT, TAME_SPAN=TAME_SPAN, H=H, K=K,
                              V=V, BT=BT, BK=min(ct["block"], _np2(K)), BV=_np2(V), VARLEN=table is not None,
                              PREC=_prec(q), num_warps=ct["num_warps"])
    bc, _ = _gla_cumsum(g, cu, T, (n_chunks, table), tame)
    gla_dqk_intra_kernel[grid](q, k, v, bc, do, dq, dk, tame, cu, cu_tab, T, NT, H=H, K=K, V=V, BT=BT, BC=BC,
                               BK=min(BK_INTRA, _np2(K)), BV=_np2(V), VARLEN=table is not None, PREC=_prec(q),
                               num_warps=4)
    dq, dk, dv, dh0 = _bwd_scans(q, k, v, g, None, A, do, h0, dht, cu, N, T, gated=True, dq=dq, dk=dk)
    dgx = dkx = None
    if dht is not None:  # the final state's gradient, in its direct (non-cancelling) form
        dgx = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        dkx = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        bks = min(32, _np2(K))
        gla_state_grad_kernel[(triton.cdiv(K, bks), N * H)](
            k, v, g, dht, h0 if h0 is not None else dht, dgx, dkx, dh0 if dh0 is not None else dht, cu, T,
            H=H, K=K, V=V, BT=BT, BK=bks, BV=_np2(V), HAS_H0=h0 is not None, VARLEN=cu.numel() > 1,
            num_warps=4)
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)
    cg = {"block": 64, "num_warps": 4, **TUNE.get("dg", {})}
    bkg = min(cg["block"], _np2(K))
    gla_dg_kernel[(triton.cdiv(K, bkg), N * H)](
        q, k, v, do, dq, dk, dg, dgx if dgx is not None else dg, dkx if dkx is not None else dg,
        dq_out, dk_out, cu, T, H=H, K=K, V=V, BT=BT, BK=bkg, BV=_np2(V), HAS_DS=dgx is not None,
        VARLEN=cu.numel() > 1, num_warps=cg["num_warps"])
    return dq_out, dk_out, dv, dg, dh0 if dh0 is not None else _empty(q)


@_gla_bwd.register_fake
def _(q, k, v, g, h0, cu_seqlens, A, tame, table, do, dht):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            h0.new_empty(h0.shape, dtype=torch.float32) if h0 is not None else _empty(q))


def _gla_setup(ctx, inputs, output) -> None:
    q, k, v, g, h0, cu_seqlens = inputs
    # an unused final state (training) must reach the backward as None, not as zeros: zeros would run
    # gla_state_grad_kernel's two extra walks per call for nothing
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, h0, cu_seqlens, *output[2:])


def _gla_backward(ctx, do, dht, _dA, _dtame, _dtable):
    q, k, v, g, h0, cu_seqlens, A, tame, table = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dh0 = _gla_bwd(q, k, v, g, h0, cu_seqlens, A, tame, table, do, dht)
    return dq, dk, dv, dg, dh0 if h0 is not None else None, None


torch.library.register_autograd("linscale::gated_linear_attn_fwd", _gla_backward, setup_context=_gla_setup)


def gated_linear_attn_triton(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor,
                             initial_state: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    _check_device(q)
    if q.dtype == torch.float64:
        return _registered_fallback("gated_linear_attn")(q, k, v, log_f, initial_state, cu_seqlens)
    o, ht, *_ = _gla_fwd(q, k, v, log_f, initial_state, cu_seqlens)
    return o, ht


def _registered_fallback(op: str):
    from ops.linear_attention import _IMPLS  # the chunked twin, as registered (varlen included)
    return _IMPLS[op]["chunked"]


register_impl("lightning_attn", "triton", lightning_attn_triton)
register_impl("gated_linear_attn", "triton", gated_linear_attn_triton)

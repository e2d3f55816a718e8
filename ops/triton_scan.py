"""Chunk-scan Triton kernels shared by `lightning_attn` and `gated_linear_attn`.

One program owns one (sequence, head) and a block of the state's key or value columns, and walks the
sequence chunk by chunk carrying the fp32 state in registers, so no per-chunk state is ever written to
memory. Per chunk of BT tokens (b = inclusive cumulative log-decay inside the chunk, b_L its last row):

    o      = A v + (q * exp(b)) h                      A = intra-chunk masked weights
    h_next = exp(b_L) h + (k * exp(b_L - b))^T v

Every exponent is <= 0, so the decay factors lie in [0, 1]: strong decays underflow to exactly 0, never
to inf or NaN, however long the sequence. Two decay kinds share the code (constexpr GATED):
  * scalar per head (lightning / TNL; cosFormer2 passes no decay at all: HAS_DECAY=False): b_i = (i+1) log(lambda);
    A = (q k^T) * lambda^(i-j) is formed here on tensor cores;
  * per key channel (GLA / HGRN2): b = cumsum(log_f) per channel; A comes precomputed for every chunk
    from `ops.triton_gla_intra` (in parallel over chunks, off the latency-bound walks), and so do the
    intra-chunk parts of dq and dk: the gated dq / dk scans add their inter-chunk terms onto them.

Precision (GLA): every product of the gated scans takes fp32 operands (tf32 on tensor cores for bf16
inputs; bf16 operands gave d log_f ~2e-2 and o ~1.2e-2 against float64, over the GPU tests' 1e-2:
d log_f is a cancelling sum of q dq - k dk). The scalar decay keeps bf16 operands.

Backward is three independent scans: dq walks forward (state h), dk and dv walk backward (state dh,
the gradient of the state at the chunk's end); each recomputes the small products it needs instead of
reading stored activations. Sequences come either as the rows of a [B, T] batch or packed with
`cu_seqlens` (B == 1): `bos`/`eos` bound each program's walk, which is also the state reset.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _seq_bounds(cu, i_n, T, VARLEN: tl.constexpr):
    if VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def _program(i_k, i_v, i_nh, log_lam, cu, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, GATED: tl.constexpr, HAS_DECAY: tl.constexpr,
             VARLEN: tl.constexpr):
    """What every scan program starts from: its head, sequence start and length, its key / value columns
    (block i_k of BK, block i_v of BV) with their masks, the scalar log-decay (0. when gated or none),
    and the offsets / mask of its [BK, BV] block of a [N, H, K, V] state tensor."""
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask = offs_k < K
    vmask = offs_v < V
    ll = 0.
    if not GATED and HAS_DECAY:
        ll = tl.load(log_lam + i_h).to(tl.float32)
    hp = i_nh.to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :]
    return i_h, bos, eos - bos, offs_k, offs_v, kmask, vmask, ll, hp, kmask[:, None] & vmask[None, :]


@triton.jit
def _chunk_rows(c, offs_t, L, BT: tl.constexpr):
    """Chunk c's rows inside the sequence, which of them are real, and how many."""
    rows = c * BT + offs_t
    return rows, rows < L, tl.minimum(L - c * BT, BT)


@triton.jit
def _step(s, a, x, w, b_last, F32: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One chunk of a state walk: s <- exp(b_last)^T * s + (a * w)^T x (w: the rows' decay weights), the
    product on fp32 operands when F32 (tf32 for bf16 inputs), else on a's dtype; without decay s + a^T x.
    Forward walks: a = k, x = v, w = exp(b_L - b); backward walks: a = q, x = do, w = exp(b)."""
    if DECAY:
        if F32:
            return s * tl.exp(tl.trans(b_last)) + tl.dot(tl.trans(a.to(tl.float32) * w), x.to(tl.float32),
                                                          input_precision=PREC)
        return s * tl.exp(tl.trans(b_last)) + tl.dot(tl.trans((a * w).to(a.dtype)), x, input_precision=PREC)
    return s + tl.dot(tl.trans(a), x, input_precision=PREC)


@triton.jit
def _decay_rows(g, ll, bos, rows, rmask, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask,
                n_valid, GATED: tl.constexpr, HAS_DECAY: tl.constexpr, BT: tl.constexpr):
    """Inclusive cumulative log-decay inside the chunk: b [BT, BK] (GATED) or [BT, 1], and b_L [1, BK]
    or [1, 1] (its value at the chunk's last valid row). Padded rows carry g = 0."""
    if GATED:
        p = g + ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
        gt = tl.load(p, mask=rmask[:, None] & kmask[None, :], other=0.).to(tl.float32)
        b = tl.cumsum(gt, axis=0)
        b_last = tl.sum(gt, axis=0)[None, :]
    else:
        if HAS_DECAY:
            idx = tl.arange(0, BT).to(tl.float32)
            b = (ll * (idx + 1.))[:, None]
            b_last = tl.zeros([1, 1], dtype=tl.float32) + ll * n_valid.to(tl.float32)
        else:
            b = tl.zeros([BT, 1], dtype=tl.float32)
            b_last = tl.zeros([1, 1], dtype=tl.float32)
    return b, b_last


@triton.jit
def _scalar_mask(ll, BT: tl.constexpr, HAS_DECAY: tl.constexpr, TRANSPOSED: tl.constexpr):
    """lambda^(i-j) on i >= j, else 0 (or its transpose): the intra-chunk weights of the scalar decay."""
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    if TRANSPOSED:
        keep = i <= j
        dist = (j - i).to(tl.float32)
    else:
        keep = i >= j
        dist = (i - j).to(tl.float32)
    if HAS_DECAY:
        return tl.where(keep, tl.exp(ll * tl.where(keep, dist, 0.)), 0.)
    return tl.where(keep, 1., 0.)


@triton.jit
def _load_rows(ptr, bos, rows, rmask, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask):
    p = ptr + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    return tl.load(p, mask=rmask[:, None] & cmask[None, :], other=0.)


@triton.jit
def _store_rows(ptr, x, bos, rows, rmask, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask):
    p = ptr + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _load_A(A, bos, rows, rmask, i_h, H: tl.constexpr, BT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The precomputed intra-chunk weights of the rows' chunk, [BT, BT] (row = query position)."""
    cols = tl.arange(0, BT)
    if TRANSPOSED:
        p = A + ((bos + rows) * H + i_h)[None, :] * BT + cols[:, None]
        return tl.load(p, mask=rmask[None, :], other=0.)
    p = A + ((bos + rows) * H + i_h)[:, None] * BT + cols[None, :]
    return tl.load(p, mask=rmask[:, None], other=0.)


@triton.jit
def fwd_scan_kernel(q, k, v, g, log_lam, A, o, h0, ht, cu, T,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_H0: tl.constexpr,
                    VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(V, BV), N * H); BK >= K holds every key column."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = _program(
        0, i_v, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    offs_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h += tl.load(h0 + hp, mask=hmask, other=0.).to(tl.float32)
    for c in range(0, tl.cdiv(L, BT)):
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # A precomputed for every chunk (ops.triton_gla_intra): tame and sub-chunk alike
            b_o = tl.dot(_load_A(A, bos, rows, rmask, i_h, H, BT, False), b_v.to(tl.float32), input_precision=PREC)
            b_o += tl.dot(b_q.to(tl.float32) * tl.exp(b), h, input_precision=PREC)
        else:
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, False)
            b_o = tl.dot(b_A.to(dt), b_v, input_precision=PREC)
        if not GATED:
            if HAS_DECAY:
                b_o += tl.dot((b_q * tl.exp(b)).to(dt), h.to(dt), input_precision=PREC)
            else:
                b_o += tl.dot(b_q, h.to(dt), input_precision=PREC)
        h = _step(h, b_k, b_v, tl.exp(tl.minimum(b_last - b, 0.)), b_last, False, GATED or HAS_DECAY, PREC)
        _store_rows(o, b_o, bos, rows, rmask, i_h, H, V, offs_v, vmask)
    tl.store(ht + hp, h, mask=hmask)


@triton.jit
def _dq_scan(i_k, i_nh, k, v, g, log_lam, do, dq, h0, cu, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_H0: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(K, BK), N * H); BV >= V. dq = (do h^T) * exp(b) + intra: (do v^T * D) k formed here when
    scalar, read from dq when gated."""
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = _program(
        i_k, 0, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    offs_t = tl.arange(0, BT)
    dt = k.dtype.element_ty
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h += tl.load(h0 + hp, mask=hmask, other=0.).to(tl.float32)
    for c in range(0, tl.cdiv(L, BT)):
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # GLA: fp32 operands (tf32 for bf16 inputs): d log_f is a cancelling sum of q dq - k dk
            b_dq = tl.dot(b_do.to(tl.float32), tl.trans(h), input_precision=PREC)
        else:
            b_dq = tl.dot(b_do, tl.trans(h.to(dt)), input_precision=PREC)
        if GATED or HAS_DECAY:
            b_dq = b_dq * tl.exp(b)
        # gated: fp32 operands, the state's bf16 rounding dominated d log_f's error (8e-3 -> 2e-3)
        h = _step(h, b_k, b_v, tl.exp(tl.minimum(b_last - b, 0.)), b_last, GATED, GATED or HAS_DECAY, PREC)
        if not GATED:
            b_dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, False)
            b_dq += tl.dot(b_dA.to(dt), b_k, input_precision=PREC)
        if GATED:  # onto the intra-chunk part, already in dq (ops.triton_gla_intra)
            b_dq += _load_rows(dq, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        _store_rows(dq, b_dq, bos, rows, rmask, i_h, H, K, offs_k, kmask)


@triton.jit
def _dk_scan(i_k, i_nh, q, v, g, log_lam, do, dk, dht, dh0, cu, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(K, BK), N * H); BV >= V; walks backward. dk = (v dh^T) * exp(b_L - b) + intra: (do v^T * D)^T q
    formed here when scalar, read from dk when gated; also writes d(initial state)."""
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = _program(
        i_k, 0, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    offs_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dh += tl.load(dht + hp, mask=hmask, other=0.).to(tl.float32)
    NC = tl.cdiv(L, BT)
    for cc in range(0, NC):
        c = NC - 1 - cc
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # see the dq scan
            b_dk = tl.dot(b_v.to(tl.float32), tl.trans(dh), input_precision=PREC)
        else:
            b_dk = tl.dot(b_v, tl.trans(dh.to(dt)), input_precision=PREC)
        if GATED or HAS_DECAY:
            b_dk = b_dk * tl.exp(tl.minimum(b_last - b, 0.))
        dh = _step(dh, b_q, b_do, tl.exp(b), b_last, GATED, GATED or HAS_DECAY, PREC)  # gated: fp32, as dq
        if not GATED:
            # (do v^T * D)^T = (v do^T) * D^T
            b_dAt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, True)
            b_dk += tl.dot(b_dAt.to(dt), b_q, input_precision=PREC)
        if GATED:  # as dq
            b_dk += _load_rows(dk, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        _store_rows(dk, b_dk, bos, rows, rmask, i_h, H, K, offs_k, kmask)
    if STORE_DH0:
        tl.store(dh0 + hp, dh, mask=hmask)


@triton.jit
def _dv_scan(i_v, i_nh, q, k, g, log_lam, A, do, dv, dht, cu, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(V, BV), N * H); BK >= K; walks backward. dv = A^T do + (k * exp(b_L - b)) dh."""
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = _program(
        0, i_v, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    offs_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dh += tl.load(dht + hp, mask=hmask, other=0.).to(tl.float32)
    NC = tl.cdiv(L, BT)
    for cc in range(0, NC):
        c = NC - 1 - cc
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # the forward's A, every chunk
            b_At = _load_A(A, bos, rows, rmask, i_h, H, BT, True)
        else:
            b_At = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, True)
        if GATED:  # fp32 operands (tf32 for bf16 inputs), as in the other gated scans
            b_dv = tl.dot(b_At, b_do.to(tl.float32), input_precision=PREC)
            b_dv += tl.dot(b_k.to(tl.float32) * tl.exp(tl.minimum(b_last - b, 0.)), dh, input_precision=PREC)
        else:
            b_dv = tl.dot(b_At.to(dt), b_do, input_precision=PREC)
        if not GATED:
            if HAS_DECAY:
                b_dv += tl.dot((b_k * tl.exp(tl.minimum(b_last - b, 0.))).to(dt), dh.to(dt), input_precision=PREC)
            else:
                b_dv += tl.dot(b_k, dh.to(dt), input_precision=PREC)
        dh = _step(dh, b_q, b_do, tl.exp(b), b_last, False, GATED or HAS_DECAY, PREC)
        _store_rows(dv, b_dv, bos, rows, rmask, i_h, H, V, offs_v, vmask)


# ----------------------------------------------------------------------------------------------------
# kernels: one scan each, or all three backward scans in one launch
# ----------------------------------------------------------------------------------------------------

@triton.jit
def dq_scan_kernel(k, v, g, log_lam, do, dq, h0, cu, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_H0: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr):
    _dq_scan(tl.program_id(0), tl.program_id(1), k, v, g, log_lam, do, dq, h0, cu, T,
             H, K, V, BT, BK, BV, GATED, HAS_DECAY, HAS_H0, VARLEN, PREC)


@triton.jit
def dk_scan_kernel(q, v, g, log_lam, do, dk, dht, dh0, cu, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    _dk_scan(tl.program_id(0), tl.program_id(1), q, v, g, log_lam, do, dk, dht, dh0, cu, T,
             H, K, V, BT, BK, BV, GATED, HAS_DECAY, HAS_DHT, STORE_DH0, VARLEN, PREC)


@triton.jit
def dv_scan_kernel(q, k, g, log_lam, A, do, dv, dht, cu, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr):
    _dv_scan(tl.program_id(0), tl.program_id(1), q, k, g, log_lam, A, do, dv, dht, cu, T,
             H, K, V, BT, BK, BV, GATED, HAS_DECAY, HAS_DHT, VARLEN, PREC)


@triton.jit
def bwd_scans_kernel(q, k, v, g, log_lam, A, do, dq, dk, dv, h0, dht_k, dht_v, dh0, cu, T, NH,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BKQ: tl.constexpr, BKK: tl.constexpr, BVV: tl.constexpr, BKF: tl.constexpr,
                     BVF: tl.constexpr, GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_H0: tl.constexpr,
                     HAS_DHT_K: tl.constexpr, HAS_DHT_V: tl.constexpr, STORE_DH0: tl.constexpr,
                     VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(V, BVV) * NH + cdiv(K, BKK) * NH + cdiv(K, BKQ) * NH,): the three backward scans in one
    launch, a program's index picking its role (dv, dk, dq blocks, in that order; BKF, BVF >= K, V). Each scan alone is
    latency-bound with a few hundred programs; in one grid they are co-resident and hide each other's
    latency, which separate launches (even on separate streams) did not achieve."""
    pid = tl.program_id(0)
    n_v = tl.cdiv(V, BVV) * NH
    n_k = tl.cdiv(K, BKK) * NH
    if pid < n_v:
        _dv_scan(pid // NH, pid % NH, q, k, g, log_lam, A, do, dv, dht_v, cu, T,
                 H, K, V, BT, BKF, BVV, GATED, HAS_DECAY, HAS_DHT_V, VARLEN, PREC)
    elif pid < n_v + n_k:
        p = pid - n_v
        _dk_scan(p // NH, p % NH, q, v, g, log_lam, do, dk, dht_k, dh0, cu, T,
                 H, K, V, BT, BKK, BVF, GATED, HAS_DECAY, HAS_DHT_K, STORE_DH0, VARLEN, PREC)
    else:
        p = pid - n_v - n_k
        _dq_scan(p // NH, p % NH, k, v, g, log_lam, do, dq, h0, cu, T,
                 H, K, V, BT, BKQ, BVF, GATED, HAS_DECAY, HAS_H0, VARLEN, PREC)

"""Intra-chunk parts of gated linear attention (per-channel decay), in Triton.

Inside a chunk the weight of key j for query i is sum_d q_id k_jd exp(b_id - b_jd) (b the cumulative
log-decay). Written as (q * exp(b)) (k * exp(-b))^T it overflows as soon as a chunk's decay passes
e^-88 (HGRN2's gates near 0). So the chunk is cut into sub-chunks of BC = 16 rows and:
  * sub-chunk pairs I > J use tensor cores with the reference r = b at I's first row:
    (q_I * exp(b_I - r)) (k_J * exp(r - b_J))^T, both exponents <= 0;
  * diagonal pairs are formed element-wise in a [BC, BC, BK] tile with exponents masked to i >= j.
Nothing exceeds 1 before the products, so nothing overflows; tiny weights underflow to exactly 0.

`gla_A_kernel` writes A [tokens, H, BT] (row = query, column = key position inside the chunk);
`gla_dqk_intra_kernel` adds the intra-chunk dq, dk (from dA = do v^T) to the inter-chunk parts that
the scans of `ops.triton_scan` left in fp32 buffers. `gla_dg_kernel` turns dq, dk into d log_f via
d log_f_s = sum_{t >= s} (q_t dq_t - k_t dk_t) (+ the final state's term), a reverse cumulative sum
per sequence that involves no exponentials at all.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ops.triton_scan import _seq_bounds


@triton.jit
def _chunk_of(chunks, pid, T, NT, VARLEN: tl.constexpr):
    """(sequence index, first token, chunk start inside the sequence, sequence length) of a chunk."""
    if VARLEN:
        i_n = tl.load(chunks + 2 * pid)
        i_c = tl.load(chunks + 2 * pid + 1)
    else:
        i_n = pid // NT
        i_c = pid % NT
    return i_n, i_c


@triton.jit
def _sub_b(g, bos, t0, s, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask,
           BT: tl.constexpr, BC: tl.constexpr):
    """Cumulative log-decay (from the chunk start at t0) of sub-chunk s's rows: [BC, BK] fp32."""
    rows_all = t0 + tl.arange(0, BT)
    before = (rows_all < t0 + s * BC) & (rows_all < L)
    p = g + ((bos + rows_all) * H + i_h)[:, None] * K + offs_k[None, :]
    offset = tl.sum(tl.load(p, mask=before[:, None] & kmask[None, :], other=0.).to(tl.float32), axis=0)
    rows = t0 + s * BC + tl.arange(0, BC)
    rmask = rows < L
    p = g + ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
    gs = tl.load(p, mask=rmask[:, None] & kmask[None, :], other=0.).to(tl.float32)
    return offset[None, :] + tl.cumsum(gs, axis=0)


@triton.jit
def _sub_rows(x, bos, t0, s, L, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask, BC: tl.constexpr):
    rows = t0 + s * BC + tl.arange(0, BC)
    rmask = rows < L
    p = x + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    return tl.load(p, mask=rmask[:, None] & cmask[None, :], other=0.).to(tl.float32)


@triton.jit
def _first_row(b, BC: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, BC)[:, None] == 0, b, 0.), axis=0)[None, :]


@triton.jit
def gla_A_kernel(q, k, g, A, cu, chunks, T, NT,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 BK: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, BT // BC, H): rows of sub-chunk I of A, every column of the chunk."""
    pid = tl.program_id(0)
    i_I = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_c = _chunk_of(chunks, pid, T, NT, VARLEN)
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    t0 = i_c * BT
    rows = t0 + i_I * BC + tl.arange(0, BC)
    rmask = rows < L
    dt = q.dtype.element_ty
    cols = tl.arange(0, BC)
    a_row = A + ((bos + rows) * H + i_h)[:, None] * BT + cols[None, :]
    causal = tl.arange(0, BC)[:, None] >= cols[None, :]
    for J in range(0, BT // BC):
        acc = tl.zeros([BC, BC], dtype=tl.float32)
        if J <= i_I:
            for kb in range(0, tl.cdiv(K, BK)):
                offs_k = kb * BK + tl.arange(0, BK)
                kmask = offs_k < K
                b_q = _sub_rows(q, bos, t0, i_I, L, i_h, H, K, offs_k, kmask, BC)
                b_I = _sub_b(g, bos, t0, i_I, L, i_h, H, K, offs_k, kmask, BT, BC)
                if J < i_I:
                    b_k = _sub_rows(k, bos, t0, J, L, i_h, H, K, offs_k, kmask, BC)
                    b_J = _sub_b(g, bos, t0, J, L, i_h, H, K, offs_k, kmask, BT, BC)
                    r = _first_row(b_I, BC)
                    acc += tl.dot((b_q * tl.exp(b_I - r)).to(dt), tl.trans((b_k * tl.exp(r - b_J)).to(dt)),
                                  input_precision=PREC)
                else:
                    b_k = _sub_rows(k, bos, t0, i_I, L, i_h, H, K, offs_k, kmask, BC)
                    d = b_I[:, None, :] - b_I[None, :, :]
                    w = tl.where(causal[:, :, None], tl.exp(tl.where(causal[:, :, None], d, 0.)), 0.)
                    acc += tl.sum(b_q[:, None, :] * b_k[None, :, :] * w, axis=2)
        tl.store(a_row + J * BC, acc.to(A.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def gla_dqk_intra_kernel(q, k, v, g, do, dq, dk, cu, chunks, T, NT,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, BT // BC, H * cdiv(K, BK)); dq, dk hold the inter-chunk parts (fp32) and are
    updated in place for sub-chunk S's rows and key block kb."""
    pid = tl.program_id(0)
    i_S = tl.program_id(1)
    i_hk = tl.program_id(2)
    NKB = tl.cdiv(K, BK)
    i_h = i_hk // NKB
    kb = i_hk % NKB
    i_n, i_c = _chunk_of(chunks, pid, T, NT, VARLEN)
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    t0 = i_c * BT
    offs_k = kb * BK + tl.arange(0, BK)
    kmask = offs_k < K
    offs_v = tl.arange(0, BV)
    vmask = offs_v < V
    dt = do.dtype.element_ty
    NCS = BT // BC
    b_S = _sub_b(g, bos, t0, i_S, L, i_h, H, K, offs_k, kmask, BT, BC)
    b_q = _sub_rows(q, bos, t0, i_S, L, i_h, H, K, offs_k, kmask, BC)
    b_k = _sub_rows(k, bos, t0, i_S, L, i_h, H, K, offs_k, kmask, BC)
    b_do = _sub_rows(do, bos, t0, i_S, L, i_h, H, V, offs_v, vmask, BC).to(dt)
    b_v = _sub_rows(v, bos, t0, i_S, L, i_h, H, V, offs_v, vmask, BC).to(dt)
    r = _first_row(b_S, BC)
    acc_q = tl.zeros([BC, BK], dtype=tl.float32)
    for J in range(0, i_S):
        b_vJ = _sub_rows(v, bos, t0, J, L, i_h, H, V, offs_v, vmask, BC).to(dt)
        b_kJ = _sub_rows(k, bos, t0, J, L, i_h, H, K, offs_k, kmask, BC)
        b_J = _sub_b(g, bos, t0, J, L, i_h, H, K, offs_k, kmask, BT, BC)
        dA = tl.dot(b_do, tl.trans(b_vJ), input_precision=PREC)
        acc_q += tl.dot(dA.to(dt), (b_kJ * tl.exp(r - b_J)).to(dt), input_precision=PREC)
    acc_q = acc_q * tl.exp(b_S - r)
    # diagonal sub-chunk, element-wise
    i_ = tl.arange(0, BC)[:, None]
    j_ = tl.arange(0, BC)[None, :]
    causal = i_ >= j_
    dA = tl.where(causal, tl.dot(b_do, tl.trans(b_v), input_precision=PREC), 0.)
    d = b_S[:, None, :] - b_S[None, :, :]
    w = tl.where(causal[:, :, None], tl.exp(tl.where(causal[:, :, None], d, 0.)), 0.) * dA[:, :, None]
    acc_q += tl.sum(w * b_k[None, :, :], axis=1)
    acc_k = tl.sum(w * b_q[:, None, :], axis=0)
    for I in range(i_S + 1, NCS):
        b_doI = _sub_rows(do, bos, t0, I, L, i_h, H, V, offs_v, vmask, BC).to(dt)
        b_qI = _sub_rows(q, bos, t0, I, L, i_h, H, K, offs_k, kmask, BC)
        b_I = _sub_b(g, bos, t0, I, L, i_h, H, K, offs_k, kmask, BT, BC)
        rI = _first_row(b_I, BC)
        dAt = tl.dot(b_v, tl.trans(b_doI), input_precision=PREC)  # [S rows, I rows] = dA_IS^T
        acc_k += tl.exp(rI - b_S) * tl.dot(dAt.to(dt), (b_qI * tl.exp(b_I - rI)).to(dt), input_precision=PREC)
    rows = t0 + i_S * BC + tl.arange(0, BC)
    rmask = rows < L
    p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
    m = rmask[:, None] & kmask[None, :]
    tl.store(dq + p, tl.load(dq + p, mask=m, other=0.) + acc_q, mask=m)
    tl.store(dk + p, tl.load(dk + p, mask=m, other=0.) + acc_k, mask=m)


@triton.jit
def gla_dg_kernel(q, k, dq, dk, dg, dg_T, cu, T,
                  H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  HAS_DGT: tl.constexpr, VARLEN: tl.constexpr):
    """grid (cdiv(K, BK), N * H): d log_f = reverse cumsum of (q dq - k dk) over each sequence."""
    i_k = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    offs_k = i_k * BK + tl.arange(0, BK)
    kmask = offs_k < K
    carry = tl.zeros([BK], dtype=tl.float32)
    if HAS_DGT:
        carry += tl.load(dg_T + i_nh.to(tl.int64) * K + offs_k, mask=kmask, other=0.)
    NC = tl.cdiv(L, BT)
    for cc in range(0, NC):
        rows = (NC - 1 - cc) * BT + tl.arange(0, BT)
        m = (rows < L)[:, None] & kmask[None, :]
        p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
        x = (tl.load(q + p, mask=m, other=0.).to(tl.float32) * tl.load(dq + p, mask=m, other=0.)
             - tl.load(k + p, mask=m, other=0.).to(tl.float32) * tl.load(dk + p, mask=m, other=0.))
        tl.store(dg + p, (tl.cumsum(x, axis=0, reverse=True) + carry[None, :]).to(dg.dtype.element_ty), mask=m)
        carry += tl.sum(x, axis=0)

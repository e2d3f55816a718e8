"""Chunk-parallel Triton kernels shared by `lightning_attn` and `gated_linear_attn`.

The work splits into a short serial part and a wide parallel one (the layout of fla and of the
Lightning Attention papers). Per chunk c of BT tokens (b = inclusive cumulative log-decay inside the
chunk, b_L its last row; H_c the state at the chunk's start, D_c the gradient of the state at its end):

    serial, `state_scan_kernel`, one program per (sequence, head, key block, value block):
        forward   H_{c+1} = exp(b_L) H_c + (k * exp(b_L - b))^T v        writes H_c for every chunk
        reverse   D_{c-1} = exp(b_L) D_c + (q * exp(b))^T do             writes D_c for every chunk
    parallel, one program per (chunk, head, block):
        `chunk_out_kernel`  o  = A v + (q * exp(b)) H_c
        `chunk_dv_kernel`   dv = A^T do + (k * exp(b_L - b)) D_c
        `chunk_dqk_kernel`  dq = exp(b) * (do H_c^T + dA (k * exp(-b))),   dA = do v^T masked
                            dk = exp(b_L - b) * (v D_c^T) + intra

The serial scans carry only the K x V state update (one tensor-core product per chunk); everything else
runs with thousands of programs. The backward recomputes H from k, v (no state is kept between the
passes: it would cost K x V per chunk, per layer, for the whole backward), concurrently with the
reverse scan, which reads only q and do.

A (the intra-chunk weights) is formed as in `ops.triton_scan`: the scalar decay as (q k^T) * lambda^(i-j);
per-channel decay as (q e^b)(k e^-b)^T for *tame* chunks, and precomputed by the sub-chunk kernels of
`ops.triton_gla_intra` for the others (masks select, no runtime branches around `tl.dot`). GLA keeps
fp32 states and fp32 dot operands (tf32 on tensor cores for bf16 inputs; see `ops.triton_scan` for the
precision budget); the scalar decay stores states in the input dtype, which is also how its products
read them.

State buffers hold one K x V slot per chunk: slot = n * NT + c for a [B, T] batch, and
bos // BT + n + c for packed sequences (`cu_seqlens`), which never collides (a sequence's last slot is
below the next one's first) and needs no host sync: cdiv(T, BT) + N slots bound it. `slot_seq` maps a
slot to its sequence (`torch.searchsorted` on the device); slots that fall in a gap return at once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ops.triton_scan import (TAME_SPAN, _causal, _decay_rows, _flag_rows, _k_over, _load_A, _load_rows,
                             _scalar_mask, _seq_bounds, _store_rows, _tame)


@triton.jit
def _slot_base(cu, i_n, bos, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """The state slot of a sequence's first chunk."""
    if VARLEN:
        return bos // BT + i_n
    return i_n.to(tl.int64) * NT


@triton.jit
def _chunk_at(slot_seq, cu, s, T, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(sequence, chunk inside it, bos, length) of state slot s."""
    if VARLEN:
        i_n = tl.load(slot_seq + s)
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
        c = s - (bos // BT + i_n)
    else:
        i_n = s // NT
        c = s % NT
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return i_n, c, bos, eos - bos


@triton.jit
def _state_ptr(states, s, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, offs_k, offs_v):
    return states + (s * H + i_h).to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :]


@triton.jit
def state_scan_kernel(a, x, g, log_lam, states, s0, sT, cu, T, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr,
                      STORE_ST: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(K, BK), cdiv(V, BV), N * H). Forward (a = k, x = v): writes H_c, the state at each
    chunk's start, then steps it. Reverse (a = q, x = do): writes D_c, the state gradient at each chunk's
    end, then steps it back. s0 starts the walk (initial state / final state's gradient); sT is where
    it ends (final state / initial state's gradient)."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_nh = tl.program_id(2)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    base = _slot_base(cu, i_n, bos, NT, BT, VARLEN)
    offs_t = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask = offs_k < K
    vmask = offs_v < V
    hmask = kmask[:, None] & vmask[None, :]
    # gated: fp32 operands (tf32 for bf16 inputs), see ops.triton_scan; scalar: the input dtype
    odt = tl.float32 if GATED else a.dtype.element_ty
    ll = 0.
    if not GATED and HAS_DECAY:
        ll = tl.load(log_lam + i_h).to(tl.float32)
    sp = i_nh.to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        h += tl.load(s0 + sp, mask=hmask, other=0.).to(tl.float32)
    NC = tl.cdiv(L, BT)
    for cc in range(0, NC):
        if REVERSE:
            c = NC - 1 - cc
        else:
            c = cc
        rows = c * BT + offs_t
        rmask = rows < L
        n_valid = tl.minimum(L - c * BT, BT)
        tl.store(_state_ptr(states, base + c, i_h, H, K, V, offs_k, offs_v),
                 h.to(states.dtype.element_ty), mask=hmask)
        b_a = _load_rows(a, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_x = _load_rows(x, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED or HAS_DECAY:
            if REVERSE:
                w = b_a.to(tl.float32) * tl.exp(b)
            else:
                w = b_a.to(tl.float32) * tl.exp(tl.minimum(b_last - b, 0.))
            h = h * tl.exp(tl.trans(b_last)) + tl.dot(tl.trans(w.to(odt)), b_x.to(odt), input_precision=PREC)
        else:
            h += tl.dot(tl.trans(b_a), b_x, input_precision=PREC)
    if STORE_ST:
        tl.store(sT + sp, h, mask=hmask)


@triton.jit
def chunk_out_kernel(q, k, v, g, log_lam, A, tame, states, o, slot_seq, cu, T, NT,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     GATED: tl.constexpr, HAS_DECAY: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (slots, cdiv(V, BV), H); BK >= K. o = A v + (q * exp(b)) H_c."""
    s = tl.program_id(0)
    i_v = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, c, bos, L = _chunk_at(slot_seq, cu, s, T, NT, BT, VARLEN)
    if c * BT < L:  # else a gap slot between packed sequences
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        kmask = offs_k < K
        vmask = offs_v < V
        rows = c * BT + offs_t
        rmask = rows < L
        n_valid = tl.minimum(L - c * BT, BT)
        dt = q.dtype.element_ty
        ll = 0.
        if not GATED and HAS_DECAY:
            ll = tl.load(log_lam + i_h).to(tl.float32)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        h = tl.load(_state_ptr(states, s, i_h, H, K, V, offs_k, offs_v),
                    mask=kmask[:, None] & vmask[None, :], other=0.)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:
            q_e32 = b_q.to(tl.float32) * tl.exp(b)
            tm = _flag_rows(_tame(tame, bos, c * BT, i_h, H), BT)
            b_A = tl.where(_causal(BT, False, False) & tm[:, None],
                           tl.dot(q_e32, tl.trans(_k_over(b_k, b, tl.float32)), input_precision=PREC), 0.)
            b_A += _load_A(A, bos, rows, rmask & (~tm), i_h, H, BT, False)  # the sub-chunk kernels' A
            b_o = tl.dot(b_A, b_v.to(tl.float32), input_precision=PREC)
            b_o += tl.dot(q_e32, h.to(tl.float32), input_precision=PREC)
        else:
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, False)
            b_o = tl.dot(b_A.to(dt), b_v, input_precision=PREC)
            if HAS_DECAY:
                b_o += tl.dot((b_q * tl.exp(b)).to(dt), h.to(dt), input_precision=PREC)
            else:
                b_o += tl.dot(b_q, h.to(dt), input_precision=PREC)
        _store_rows(o, b_o, bos, rows, rmask, i_h, H, V, offs_v, vmask)


@triton.jit
def chunk_dv_kernel(q, k, g, log_lam, A, tame, dstates, do, dv, slot_seq, cu, T, NT,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    GATED: tl.constexpr, HAS_DECAY: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (slots, cdiv(V, BV), H); BK >= K. dv = A^T do + (k * exp(b_L - b)) D_c."""
    s = tl.program_id(0)
    i_v = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, c, bos, L = _chunk_at(slot_seq, cu, s, T, NT, BT, VARLEN)
    if c * BT < L:
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        kmask = offs_k < K
        vmask = offs_v < V
        rows = c * BT + offs_t
        rmask = rows < L
        n_valid = tl.minimum(L - c * BT, BT)
        dt = q.dtype.element_ty
        ll = 0.
        if not GATED and HAS_DECAY:
            ll = tl.load(log_lam + i_h).to(tl.float32)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        dh = tl.load(_state_ptr(dstates, s, i_h, H, K, V, offs_k, offs_v),
                     mask=kmask[:, None] & vmask[None, :], other=0.)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:
            tm = _flag_rows(_tame(tame, bos, c * BT, i_h, H), BT)
            b_At = tl.where(_causal(BT, False, True) & tm[None, :],
                            tl.dot(_k_over(b_k, b, tl.float32), tl.trans(b_q.to(tl.float32) * tl.exp(b)),
                                   input_precision=PREC), 0.)
            b_At += _load_A(A, bos, rows, rmask & (~tm), i_h, H, BT, True)
            b_dv = tl.dot(b_At, b_do.to(tl.float32), input_precision=PREC)
            b_dv += tl.dot(b_k.to(tl.float32) * tl.exp(tl.minimum(b_last - b, 0.)), dh.to(tl.float32),
                           input_precision=PREC)
        else:
            b_At = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, True)
            b_dv = tl.dot(b_At.to(dt), b_do, input_precision=PREC)
            if HAS_DECAY:
                k_w = (b_k * tl.exp(tl.minimum(b_last - b, 0.))).to(dt)
                b_dv += tl.dot(k_w, dh.to(dt), input_precision=PREC)
            else:
                b_dv += tl.dot(b_k, dh.to(dt), input_precision=PREC)
        _store_rows(dv, b_dv, bos, rows, rmask, i_h, H, V, offs_v, vmask)


@triton.jit
def chunk_dqk_kernel(q, k, v, g, log_lam, tame, states, dstates, do, dq, dk, slot_seq, cu, T, NT,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     GATED: tl.constexpr, HAS_DECAY: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (slots, cdiv(K, BK), H); BV >= V. dq = exp(b) * (do H_c^T) + intra, dk = exp(b_L - b) * (v D_c^T)
    + intra. Gated: the intra parts of tame chunks only and strictly off the diagonal (the sub-chunk kernel
    and gla_dg_kernel add the rest); dq, dk are then fp32 buffers."""
    s = tl.program_id(0)
    i_k = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, c, bos, L = _chunk_at(slot_seq, cu, s, T, NT, BT, VARLEN)
    if c * BT < L:
        offs_t = tl.arange(0, BT)
        offs_k = i_k * BK + tl.arange(0, BK)
        offs_v = tl.arange(0, BV)
        kmask = offs_k < K
        vmask = offs_v < V
        rows = c * BT + offs_t
        rmask = rows < L
        n_valid = tl.minimum(L - c * BT, BT)
        dt = q.dtype.element_ty
        ll = 0.
        if not GATED and HAS_DECAY:
            ll = tl.load(log_lam + i_h).to(tl.float32)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        smask = kmask[:, None] & vmask[None, :]
        h = tl.load(_state_ptr(states, s, i_h, H, K, V, offs_k, offs_v), mask=smask, other=0.)
        dh = tl.load(_state_ptr(dstates, s, i_h, H, K, V, offs_k, offs_v), mask=smask, other=0.)
        b, b_last = _decay_rows(g, ll, bos, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:
            tm = _flag_rows(_tame(tame, bos, c * BT, i_h, H), BT)
            b_dq = tl.dot(b_do.to(tl.float32), tl.trans(h.to(tl.float32)), input_precision=PREC)
            b_dA = tl.where(_causal(BT, True, False) & tm[:, None],
                            tl.dot(b_do, tl.trans(b_v), input_precision=PREC), 0.)
            b_dq += tl.dot(b_dA, _k_over(b_k, b, tl.float32), input_precision=PREC)
            b_dq = b_dq * tl.exp(b)
            b_dk = tl.dot(b_v.to(tl.float32), tl.trans(dh.to(tl.float32)), input_precision=PREC)
            b_dk = b_dk * tl.exp(tl.minimum(b_last - b, 0.))
            b_dAt = tl.where(_causal(BT, True, True) & tm[:, None],
                             tl.dot(b_v, tl.trans(b_do), input_precision=PREC), 0.)
            b_dk += (tl.dot(b_dAt, b_q.to(tl.float32) * tl.exp(b), input_precision=PREC)
                     * tl.exp(tl.minimum(-b, TAME_SPAN)))
        else:
            b_dq = tl.dot(b_do, tl.trans(h.to(dt)), input_precision=PREC)
            b_dk = tl.dot(b_v, tl.trans(dh.to(dt)), input_precision=PREC)
            if HAS_DECAY:
                b_dq = b_dq * tl.exp(b)
                b_dk = b_dk * tl.exp(tl.minimum(b_last - b, 0.))
            b_dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
            b_dq += tl.dot((b_dA * _scalar_mask(ll, BT, HAS_DECAY, False)).to(dt), b_k, input_precision=PREC)
            b_dk += tl.dot((tl.trans(b_dA) * _scalar_mask(ll, BT, HAS_DECAY, True)).to(dt), b_q,
                           input_precision=PREC)
        _store_rows(dq, b_dq, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        _store_rows(dk, b_dk, bos, rows, rmask, i_h, H, K, offs_k, kmask)

"""Intra-chunk parts of gated linear attention (per-channel decay), in Triton.

Inside a chunk of BT = 64 rows the weight of key j for query i is sum_d q_id k_jd exp(b_id - b_jd) (b the
cumulative log-decay, i >= j). Written as (q * exp(b)) (k * exp(-b))^T it overflows fp32 as soon as a
channel decays past e^-88 inside the chunk, which gates of log f = -2 per step already reach. These
kernels use a scheme that is stable for every gate value and costs the same for all of them (secondary
chunking, as fla's chunk_gla): the chunk is cut into sub-chunks of BC = 16 rows, and

  * for a sub-chunk S and the keys of earlier sub-chunks, the reference r = b at the row just before S:
    (q_S * exp(b_S - r)) (k_j * exp(r - b_j))^T, one tensor-core product, every exponent <= 0
    (b never increases), so both factors lie in [0, 1] and their product is the weight itself;
  * the 16 x 16 diagonal block element-wise, exp(c_i - c_j) with c the cumulative log-decay inside the
    sub-chunk (exponent <= 0 on i >= j): one key row at a time (DIAG_LOOP) or as one [16, 16, BK] tile
    (the launch config's `diag` picks; same arithmetic).

No factor ever exceeds 1, so nothing overflows for any log f <= 0; a weight that underflows to 0 is below
1e-38 of the diagonal weight exp(0) = 1 of its row, so dropping it changes no result.

`gla_A_kernel` writes A [tokens, H, BT] (row = query, column = key position inside the chunk);
`gla_dqk_intra_kernel` writes the intra-chunk dq, dk (from dA = do v^T, strictly below the diagonal) into
fp32 buffers, onto which the walks of `ops.triton_scan` add the inter-chunk parts. `gla_dg_kernel` turns
dq, dk into d log_f via d log_f_s = sum_{t >= s} (q_t dq_t - k_t dk_t) (+ the final state's term), a
reverse cumulative sum per sequence that involves no exponentials at all (the diagonal i == j terms,
equal on both sides, are left out of it and added to dq, dk only afterwards); in the split layout each
segment starts from the sum of the later segments' totals (`gla_dg_tot_kernel`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ops.triton_scan import _and, _program, _segment, _seq_bounds


@triton.jit
def _chunk_of(chunks, pid, T, NT, VARLEN: tl.constexpr):
    """(sequence index, chunk index inside the sequence) of a chunk: from the (sequence, chunk) table of
    packed input, or from the program id of a dense batch (NT chunks per sequence)."""
    if VARLEN:
        i_n = tl.load(chunks + 2 * pid)
        i_c = tl.load(chunks + 2 * pid + 1)
    else:
        i_n = pid // NT
        i_c = pid % NT
    return i_n, i_c


@triton.jit
def _tile(x, bos, rows, L, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask):
    p = x + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    return tl.load(p, mask=(rows < L)[:, None] & cmask[None, :], other=0.)


@triton.jit
def _exp0(x):
    """exp of an exponent that is <= 0 on every real row; padded rows (g loaded as 0) or masked-out pairs
    could make it positive, and their inf times a zero input would be NaN, so clamp."""
    return tl.exp(tl.minimum(x, 0.))


@triton.jit
def _sub_chunk_decays(g, bos, t0, i_S, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask,
                      BT: tl.constexpr, BC: tl.constexpr):
    """For sub-chunk i_S of the chunk starting at t0 and key columns offs_k: b_c [BT, BK] the chunk's
    cumulative log-decay, r [1, BK] its value at the row before the sub-chunk (0 for the first), c [BC, BK]
    the cumulative log-decay inside the sub-chunk (so b = r + c on its rows)."""
    rows_c = t0 + tl.arange(0, BT)
    rows_S = t0 + i_S * BC + tl.arange(0, BC)
    g_c = _tile(g, bos, rows_c, L, i_h, H, K, offs_k, kmask).to(tl.float32)
    b_c = tl.cumsum(g_c, axis=0)
    before = (tl.arange(0, BT) < i_S * BC)[:, None]
    r = tl.sum(tl.where(before, g_c, 0.), axis=0)[None, :]
    c = tl.cumsum(_tile(g, bos, rows_S, L, i_h, H, K, offs_k, kmask).to(tl.float32), axis=0)
    return b_c, r, c


@triton.jit
def gla_A_kernel(q, k, g, A, cu, chunks, T, NT,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 BK: tl.constexpr, DIAG_LOOP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, BT // BC, H): rows of sub-chunk S of A, every column of the chunk (see the module
    docstring): earlier sub-chunks by one tensor-core product per key block (fp32 operands: tf32 for bf16
    inputs), the diagonal block (DIAG_LOOP: one key row at a time, else as one [BC, BC, BK] tile), zeros
    after it."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_S = tl.program_id(1)
    i_h = tl.program_id(2)
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    t0 = i_c * BT
    s0 = t0 + i_S * BC
    rows_S = s0 + tl.arange(0, BC)
    rows_c = t0 + tl.arange(0, BT)
    before = (tl.arange(0, BT) < i_S * BC)[:, None]
    ii = tl.arange(0, BC)
    acc = tl.zeros([BC, BT], dtype=tl.float32)
    acc_d = tl.zeros([BC, BC], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        offs_k = kb * BK + tl.arange(0, BK)
        kmask = offs_k < K
        b_c, r, c = _sub_chunk_decays(g, bos, t0, i_S, L, i_h, H, K, offs_k, kmask, BT, BC)
        q_S = _tile(q, bos, rows_S, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        k_c = _tile(k, bos, rows_c, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        k_w = tl.where(before, k_c * _exp0(r - b_c), 0.)
        acc += tl.dot(q_S * _exp0(c), tl.trans(k_w), input_precision=PREC)
        if DIAG_LOOP:
            # key row jj: its decay c_j summed as the loop goes (no reduction over rows), its k from memory
            c_j = tl.zeros([1, BK], dtype=tl.float32)
            p_j = ((bos + s0) * H + i_h) * K + offs_k
            for jj in tl.static_range(BC):
                m_j = kmask & (offs_k * 0 + s0 + jj < L)
                c_j += tl.load(g + p_j, mask=m_j, other=0.).to(tl.float32)[None, :]
                k_j = tl.load(k + p_j, mask=m_j, other=0.).to(tl.float32)[None, :]
                col = tl.sum(q_S * k_j * tl.exp(tl.minimum(c - c_j, 0.)), axis=1)
                acc_d += tl.where(ii[None, :] == jj, col[:, None], 0.)
                p_j += H * K
        else:  # the whole block as one [BC, BC, BK] tile
            k_S = _tile(k, bos, rows_S, L, i_h, H, K, offs_k, kmask).to(tl.float32)
            causal = (ii[:, None] >= ii[None, :])[:, :, None]
            w = tl.where(causal, _exp0(tl.where(causal, c[:, None, :] - c[None, :, :], 0.)), 0.)
            acc_d += tl.sum(q_S[:, None, :] * k_S[None, :, :] * w, axis=2)
    rmask = (rows_S < L)[:, None]
    cols = tl.arange(0, BT)[None, :]
    a_row = A + ((bos + rows_S) * H + i_h)[:, None] * BT
    # three stores to disjoint columns: earlier sub-chunks, the diagonal block (causal), zeros after it
    tl.store(a_row + cols, acc, mask=rmask & (cols < i_S * BC))
    tl.store(a_row + cols, tl.zeros([BC, BT], dtype=tl.float32), mask=rmask & (cols >= (i_S + 1) * BC))
    tl.store(a_row + i_S * BC + ii[None, :], tl.where(ii[:, None] >= ii[None, :], acc_d, 0.), mask=rmask)


@triton.jit
def gla_dqk_intra_kernel(q, k, v, g, do, dq, dk, cu, chunks, T, NT,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DIAG_LOOP: tl.constexpr,
                         VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, BT // BC, H): the intra-chunk dq, dk (fp32) of sub-chunk S's rows, to which the dq /
    dk walks then add the inter-chunk parts. dA = do v^T strictly below the diagonal (the i == j terms do
    not depend on the gates and cancel in q dq - k dk: `gla_dg_kernel` adds them after forming d log_f).
    dq_S takes the keys of earlier sub-chunks (reference: b at the row before S), dk_S the queries of later
    ones (reference: b at S's last row): one tensor-core product each, every factor in [0, 1]; then the
    diagonal block one key row at a time, whose weights serve dq and dk alike."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_S = tl.program_id(1)
    i_h = tl.program_id(2)
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    t0 = i_c * BT
    s0 = t0 + i_S * BC
    rows_S = s0 + tl.arange(0, BC)
    rows_c = t0 + tl.arange(0, BT)
    idx_c = tl.arange(0, BT)
    before = (idx_c < i_S * BC)[:, None]
    after = (idx_c >= (i_S + 1) * BC)[:, None]
    ii = tl.arange(0, BC)
    offs_v = tl.arange(0, BV)
    vmask = offs_v < V
    do_S = _tile(do, bos, rows_S, L, i_h, H, V, offs_v, vmask)
    v_S = _tile(v, bos, rows_S, L, i_h, H, V, offs_v, vmask)
    dA_row = tl.dot(do_S, tl.trans(_tile(v, bos, rows_c, L, i_h, H, V, offs_v, vmask)))  # [BC, BT]
    dA_col = tl.dot(_tile(do, bos, rows_c, L, i_h, H, V, offs_v, vmask), tl.trans(v_S))  # [BT, BC]
    dA_d = tl.where(ii[:, None] > ii[None, :], tl.dot(do_S, tl.trans(v_S)), 0.)  # strictly lower
    rmask = (rows_S < L)[:, None]
    for kb in range(0, tl.cdiv(K, BK)):
        offs_k = kb * BK + tl.arange(0, BK)
        kmask = offs_k < K
        b_c, r, c = _sub_chunk_decays(g, bos, t0, i_S, L, i_h, H, K, offs_k, kmask, BT, BC)
        r2 = r + tl.sum(tl.where((ii == BC - 1)[:, None], c, 0.), axis=0)[None, :]  # b at S's last row
        q_S = _tile(q, bos, rows_S, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        q_c = _tile(q, bos, rows_c, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        k_c = _tile(k, bos, rows_c, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        # dq_S += exp(b_S - r) * (dA[S, :S] (k exp(r - b))[:S])          (fp32 operands: tf32)
        k_w = tl.where(before, k_c * _exp0(r - b_c), 0.)
        acc_q = tl.dot(dA_row, k_w, input_precision=PREC) * _exp0(c)
        # dk_S += exp(r2 - b_S) * (dA[S+1:, S]^T (q exp(b - r2))[S+1:]),  r2 - b_S = (r2 - r) - c
        q_w = tl.where(after, q_c * _exp0(b_c - r2), 0.)
        acc_k = tl.dot(tl.trans(dA_col), q_w, input_precision=PREC) * _exp0(r2 - r - c)
        if DIAG_LOOP:
            c_j = tl.zeros([1, BK], dtype=tl.float32)
            p_j = ((bos + s0) * H + i_h) * K + offs_k
            for jj in tl.static_range(BC):  # key row jj of the diagonal block, as in gla_A_kernel
                m_j = kmask & (offs_k * 0 + s0 + jj < L)
                c_j += tl.load(g + p_j, mask=m_j, other=0.).to(tl.float32)[None, :]
                k_j = tl.load(k + p_j, mask=m_j, other=0.).to(tl.float32)[None, :]
                wd = tl.sum(tl.where(ii[None, :] == jj, dA_d, 0.), axis=1)[:, None] * tl.exp(tl.minimum(c - c_j, 0.))
                acc_q += wd * k_j  # dq_i += dA_ij w_ij k_j
                acc_k += tl.where((ii == jj)[:, None], tl.sum(wd * q_S, axis=0)[None, :], 0.)  # dk_j += sum_i
                p_j += H * K
        else:  # the whole block as one [BC, BC, BK] tile
            k_S = _tile(k, bos, rows_S, L, i_h, H, K, offs_k, kmask).to(tl.float32)
            strict = (ii[:, None] > ii[None, :])[:, :, None]
            w = tl.where(strict, _exp0(tl.where(strict, c[:, None, :] - c[None, :, :], 0.)), 0.) * dA_d[:, :, None]
            acc_q += tl.sum(w * k_S[None, :, :], axis=1)
            acc_k += tl.sum(w * q_S[:, None, :], axis=0)
        p = ((bos + rows_S) * H + i_h)[:, None] * K + offs_k[None, :]
        m = rmask & kmask[None, :]
        tl.store(dq + p, acc_q, mask=m)
        tl.store(dk + p, acc_k, mask=m)


@triton.jit
def _dg_x(q, k, dq, dk, bos, rows, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask):
    """q dq - k dk on the rows (dq, dk without their i == j terms), and the pieces it came from."""
    m = (rows < L)[:, None] & kmask[None, :]
    p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
    b_q = tl.load(q + p, mask=m, other=0.).to(tl.float32)
    b_k = tl.load(k + p, mask=m, other=0.).to(tl.float32)
    b_dq = tl.load(dq + p, mask=m, other=0.)
    b_dk = tl.load(dk + p, mask=m, other=0.)
    return b_q * b_dq - b_k * b_dk, b_q, b_k, b_dq, b_dk, p, m


@triton.jit
def gla_dg_tot_kernel(q, k, dq, dk, tot, cu, T, SC, SM1,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      VARLEN: tl.constexpr):
    """grid (cdiv(K, BK), N * H, SM1), split layout only: tot[N * H, SM1, K] slot j <- the sum of
    q dq - k dk over segment j+1 (0 past the sequence end)."""
    i_nh = tl.program_id(1)
    j = tl.program_id(2)
    i_h, bos, L, offs_k, _, kmask, _, _, _, _ = _program(
        tl.program_id(0), 0, i_nh, None, cu, T, H, K, V, BK, 16, True, True, VARLEN)
    c0, c1, _, _ = _segment(j + 1, L, SC, BT)
    acc = tl.zeros([BK], dtype=tl.float32)
    for c in range(c0, c1):
        x, _, _, _, _, _, _ = _dg_x(q, k, dq, dk, bos, c * BT + tl.arange(0, BT), L, i_h, H, K, offs_k, kmask)
        acc += tl.sum(x, axis=0)
    tl.store(tot + (i_nh.to(tl.int64) * SM1 + j) * K + offs_k, acc, mask=kmask)


@triton.jit
def gla_dg_kernel(q, k, v, do, dq, dk, dg, dgx, dkx, dq_out, dk_out, tot, cu, T, SC, SM1,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_DS: tl.constexpr, VARLEN: tl.constexpr):
    """grid (cdiv(K, BK), N * H, segments): d log_f = reverse cumsum of (q dq - k dk) over each sequence,
    from dq, dk without their i == j terms (those cancel exactly; left in, fp32 rounding of them swamps the
    tiny true gradient of gates near 0); segment s starts from the later segments' totals (tot). Then adds
    (do_t . v_t) k_t, (do_t . v_t) q_t and writes dq, dk. With a gradient on the final state (HAS_DS), dk
    held no part of it: its terms come from `gla_state_grad_kernel`, d log_f's directly (dgx) and dk's
    (dkx) added here after the cumsum."""
    i_nh = tl.program_id(1)
    i_s = tl.program_id(2)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, _, _, _ = _program(
        tl.program_id(0), 0, i_nh, None, cu, T, H, K, V, BK, BV, True, True, VARLEN)
    c0, c1, n_seg, _ = _segment(i_s, L, SC, BT)
    carry = tl.zeros([BK], dtype=tl.float32)
    for j in range(i_s, n_seg - 1):
        carry += tl.load(tot + (i_nh.to(tl.int64) * SM1 + j) * K + offs_k, mask=kmask, other=0.)
    for cc in range(0, tl.maximum(c1 - c0, 0)):
        rows = (c1 - 1 - cc) * BT + tl.arange(0, BT)
        x, b_q, b_k, b_dq, b_dk, p, m = _dg_x(q, k, dq, dk, bos, rows, L, i_h, H, K, offs_k, kmask)
        b_dg = tl.cumsum(x, axis=0, reverse=True) + carry[None, :]
        carry += tl.sum(x, axis=0)
        if HAS_DS:
            b_dg += tl.load(dgx + p, mask=m, other=0.)
            b_dk += tl.load(dkx + p, mask=m, other=0.)
        tl.store(dg + p, b_dg.to(dg.dtype.element_ty), mask=m)
        rmask = (rows < L)[:, None]
        pv = ((bos + rows) * H + i_h)[:, None] * V + offs_v[None, :]
        mv = rmask & vmask[None, :]
        a_tt = tl.sum(tl.load(do + pv, mask=mv, other=0.).to(tl.float32)
                      * tl.load(v + pv, mask=mv, other=0.).to(tl.float32), axis=1)[:, None]
        tl.store(dq_out + p, (b_dq + a_tt * b_k).to(dq_out.dtype.element_ty), mask=m)
        tl.store(dk_out + p, (b_dk + a_tt * b_q).to(dk_out.dtype.element_ty), mask=m)


@triton.jit
def _lin_rec(a1, x1, a2, x2):
    """Composition of z -> a1 z + x1, then z -> a2 z + x2 (for tl.associative_scan)."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def gla_state_grad_kernel(k, v, g, dht, h0, dgx, dkx, dh0, cu, T,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr):
    """grid (cdiv(K, BK), N * H), only when the loss reads the final state S_T (gradient dS).
    With W_s = prod_{t > s} f_t (per channel) and z_s = <S_s, dS> per key row (z_s = f_s z_{s-1} + k_s u_s,
    u_s = dS v_s):
        d log_f_s += W_s f_s z_{s-1}   (dgx)      dk_s += W_s u_s   (dkx)      dh0 += (prod_t f_t) dS
    The direct form: every term is a product of factors <= 1 and O(1) sums, so it keeps its relative
    precision for gates near 0, where the equivalent 'sum of all minus a suffix' form cancels.
    Pass 1 walks forward (z; writes f_s z_{s-1} into dgx and u into dkx), pass 2 backward (W)."""
    i_h, bos, L, offs_k, offs_v, kmask, vmask, _, hp, hmask = _program(
        tl.program_id(0), 0, tl.program_id(1), None, cu, T, H, K, V, BK, BV, True, True, VARLEN)
    offs_t = tl.arange(0, BT)
    dS = tl.load(dht + hp, mask=hmask, other=0.).to(tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_H0:
        z += tl.sum(tl.load(h0 + hp, mask=hmask, other=0.).to(tl.float32) * dS, axis=1)
    NC = tl.cdiv(L, BT)
    for c in range(0, NC):
        rows = c * BT + offs_t
        m = (rows < L)[:, None] & kmask[None, :]
        p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
        b_v = tl.load(v + ((bos + rows) * H + i_h)[:, None] * V + offs_v[None, :],
                      mask=(rows < L)[:, None] & vmask[None, :], other=0.).to(tl.float32)
        u = tl.dot(b_v, tl.trans(dS), input_precision="ieee")  # [BT, BK]: u_s = dS v_s
        a = tl.exp(tl.load(g + p, mask=m, other=0.).to(tl.float32))  # padded rows: f = 1
        # x of the previous row (0 at the chunk's first row: the carry z stands for it)
        rp = rows - 1
        mp = (rp >= c * BT)[:, None] & (rp < L)[:, None] & kmask[None, :]
        pp = ((bos + rp) * H + i_h)[:, None] * K + offs_k[None, :]
        b_vp = tl.load(v + ((bos + rp) * H + i_h)[:, None] * V + offs_v[None, :],
                       mask=(rp >= c * BT)[:, None] & (rp < L)[:, None] & vmask[None, :], other=0.).to(tl.float32)
        x_prev = tl.load(k + pp, mask=mp, other=0.).to(tl.float32) * tl.dot(b_vp, tl.trans(dS), input_precision="ieee")
        # zb_s = f_s z_{s-1} = f_s (zb_{s-1} + x_{s-1}): a linear recurrence, scanned inside the chunk
        A_, Y_ = tl.associative_scan((a, a * x_prev), 0, _lin_rec)
        zb = A_ * z[None, :] + Y_
        tl.store(dgx + p, zb, mask=m)
        tl.store(dkx + p, u, mask=m)
        x = tl.load(k + p, mask=m, other=0.).to(tl.float32) * u
        # z at the chunk's end: the last row's zb + x (a padded last row has zb = z_end and x = 0)
        z = tl.sum(tl.where((offs_t == BT - 1)[:, None], zb + x, 0.), axis=0)
    W = tl.full([BK], 1., dtype=tl.float32)
    for cc in range(0, NC):
        c = NC - 1 - cc
        rows = c * BT + offs_t
        m = (rows < L)[:, None] & kmask[None, :]
        p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
        rn = rows + 1  # f of the next row inside the chunk (1 past it: W carries the rest)
        mn = (rn < (c + 1) * BT)[:, None] & (rn < L)[:, None] & kmask[None, :]
        a_next = tl.exp(tl.load(g + ((bos + rn) * H + i_h)[:, None] * K + offs_k[None, :], mask=mn,
                                other=0.).to(tl.float32))
        w = tl.cumprod(a_next, axis=0, reverse=True) * W[None, :]  # W_s
        tl.store(dgx + p, w * tl.load(dgx + p, mask=m, other=0.), mask=m)
        tl.store(dkx + p, w * tl.load(dkx + p, mask=m, other=0.), mask=m)
        a0 = tl.exp(tl.load(g + p, mask=m, other=0.).to(tl.float32))
        W = tl.sum(tl.where((offs_t == 0)[:, None], w * a0, 0.), axis=0)
    if HAS_H0:
        tl.store(dh0 + hp, tl.load(dh0 + hp, mask=hmask, other=0.) + W[:, None] * dS, mask=hmask)

"""Intra-chunk parts of gated linear attention (per-channel decay), in Triton.

Inside a chunk of BT = 64 rows the weight of key j for query i is sum_d q_id k_jd exp(b_id - b_jd) (b the
cumulative log-decay, i >= j). Written as (q * exp(b)) (k * exp(-b))^T it overflows fp32 as soon as a
channel decays past e^-88 inside the chunk, which gates of log f = -2 per step already reach. These
kernels use a scheme that is exact and stable for every gate value and costs the same for all of them:
the pairs i > j are split by the highest bit in which their positions differ (level l = 0..5). A pair of
level l has i in the upper and j in the lower half of one aligned block of 2^(l+1) rows; with r = b at the
last row of that lower half,

    exp(b_i - b_j) = exp(b_i - r) * exp(r - b_j),       both exponents <= 0 (b never increases),

so per level one tensor-core product of (q * exp(b - r)) and (k * exp(r - b)), both factors in [0, 1],
kept on that level's pairs, gives those weights exactly; the diagonal (weight 1) is q_i . k_i. Six
levels cover every pair of a 64-row chunk. No factor exceeds 1, so nothing overflows for any
log f <= 0; a weight that underflows to 0 is below 1e-38 of the diagonal weight of its row, so dropping
it changes no result. (fla's chunk_gla splits the chunk into 16-row sub-chunks instead and forms their
16 x 16 diagonal blocks element-wise, one exp per pair and channel; here every pair's weight comes from
two per-row exps, 12 per row and channel in all, and dense products.)

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
def _level_factors(g_c, l: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The two factors of level l (pairs i > j of the chunk whose positions first differ in bit l, so i
    lies in the upper half of a block of 2^(l+1) rows and j in its lower half; r = b at the last row of
    that lower half). From g_c [BT, BK] (log-decays of the chunk's rows):
        fq_i = exp(b_i - r)  on rows with bit l set, else 0      (log: cumsum of g inside i's 2^l-block)
        fk_j = exp(r - b_j)  on rows with bit l clear, else 0    (log: the rest of j's 2^l-block after j)
    Both exponents are <= 0, so both factors lie in [0, 1], and fq_i fk_j = exp(b_i - b_j) exactly."""
    n: tl.constexpr = 1 << l
    g3 = tl.reshape(g_c, [BT // n, n, BK])
    c3 = tl.cumsum(g3, axis=1)
    c = tl.reshape(c3, [BT, BK])
    rest = tl.reshape(tl.sum(g3, axis=1, keep_dims=True) - c3, [BT, BK])
    up = (((tl.arange(0, BT) >> l) & 1) == 1)[:, None]
    f = tl.exp(tl.minimum(tl.where(up, c, rest), 0.))  # each row needs one of the two: one exp per element
    return tl.where(up, f, 0.), tl.where(up, 0., f)


@triton.jit
def _same_block(l: tl.constexpr, BT: tl.constexpr, kb, zero):
    """[BT, BT]: rows i and columns j in one block of 2^(l+1) rows (with the factors' masks: level l).
    `kb * zero` (zero: a run-time 0) ties the mask to the key-block loop: hoisted out of it, the six
    levels' masks (and masked dA copies) would stay live across the loop and spill registers."""
    i = tl.arange(0, BT) + kb * zero
    return (i[:, None] >> (l + 1)) == (i[None, :] >> (l + 1))


@triton.jit
def gla_A_kernel(q, k, g, A, cu, chunks, T, NT, zero,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr,
                 BK: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, H): A [tokens, H, BT] of the chunk (row = query, column = key position), zero above
    the diagonal. The diagonal is q_i . k_i (weight exp(0)); each level l of the module docstring adds
    one tensor-core product (q * fq)(k * fk)^T kept on the pairs of that level (fp32 operands: tf32 for
    bf16 inputs)."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_h = tl.program_id(1)
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    rows = i_c * BT + tl.arange(0, BT)
    ii = tl.arange(0, BT)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        offs_k = kb * BK + tl.arange(0, BK)
        kmask = offs_k < K
        g_c = _tile(g, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        q_c = _tile(q, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        k_c = _tile(k, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
        jj = ii + kb * zero
        acc += tl.where(jj[:, None] == jj[None, :], tl.dot(q_c, tl.trans(k_c), input_precision=PREC), 0.)
        for l in tl.static_range(LOG_BT):
            fq, fk = _level_factors(g_c, l, BT, BK)
            acc += tl.where(_same_block(l, BT, kb, zero), tl.dot(q_c * fq, tl.trans(k_c * fk), input_precision=PREC), 0.)
    p = A + ((bos + rows) * H + i_h)[:, None] * BT + ii[None, :]
    tl.store(p, acc, mask=(rows < L)[:, None])


@triton.jit
def gla_dqk_intra_kernel(q, k, v, g, do, dq, dk, cu, chunks, T, NT, zero,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         LOG_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, H): the intra-chunk dq, dk (fp32) of the chunk, to which the dq / dk walks then add
    the inter-chunk parts. dA = do v^T strictly below the diagonal (the i == j terms do not depend on the
    gates and cancel in q dq - k dk: `gla_dg_kernel` adds them after forming d log_f). Per level l, with
    dA_l = dA on that level's pairs:
        dq += fq * (dA_l (k * fk))        dk += fk * (dA_l^T (q * fq))
    two tensor-core products, the same factors for both."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_h = tl.program_id(1)
    bos, eos = _seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    rows = i_c * BT + tl.arange(0, BT)
    ii = tl.arange(0, BT)
    offs_v = tl.arange(0, BV)
    vmask = offs_v < V
    b_do = _tile(do, bos, rows, L, i_h, H, V, offs_v, vmask)
    b_v = _tile(v, bos, rows, L, i_h, H, V, offs_v, vmask)
    m = (rows < L)[:, None]
    # dq first, then dk (dA^T formed directly): one [BT, BT] matrix live at a time keeps the registers
    # below the spill limit at the cost of forming the factors twice
    for role in tl.static_range(2):
        if role == 0:
            dA = tl.where(ii[:, None] > ii[None, :], tl.dot(b_do, tl.trans(b_v)), 0.)
            out = dq
        else:
            dA = tl.where(ii[:, None] < ii[None, :], tl.dot(b_v, tl.trans(b_do)), 0.)  # dA^T
            out = dk
        for kb in range(0, tl.cdiv(K, BK)):
            offs_k = kb * BK + tl.arange(0, BK)
            kmask = offs_k < K
            g_c = _tile(g, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
            if role == 0:
                x_c = _tile(k, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
            else:
                x_c = _tile(q, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
            acc = tl.zeros([BT, BK], dtype=tl.float32)
            for l in tl.static_range(LOG_BT):
                fq, fk = _level_factors(g_c, l, BT, BK)
                dA_l = tl.where(_same_block(l, BT, kb, zero), dA, 0.)  # symmetric mask
                if role == 0:  # dq += fq * (dA_l (k * fk))
                    acc += fq * tl.dot(dA_l, x_c * fk, input_precision=PREC)
                else:  # dk += fk * (dA_l^T (q * fq))
                    acc += fk * tl.dot(dA_l, x_c * fq, input_precision=PREC)
            p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
            tl.store(out + p, acc, mask=m & kmask[None, :])


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
        x = _dg_x(q, k, dq, dk, bos, c * BT + tl.arange(0, BT), L, i_h, H, K, offs_k, kmask)[0]
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

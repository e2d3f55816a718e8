"""Intra-chunk parts of gated linear attention (per-channel decay), in Triton.

Inside a chunk the weight of key j for query i is sum_d q_id k_jd exp(b_id - b_jd) (b the cumulative
log-decay). Two forms, chosen per (chunk, head) by the chunk's gates (`gla_cumsum_kernel`):
  * tame chunks (in each 32-row half, no key channel decays by more than exp(-TAME_SPAN)): three
    tensor-core products per key block, one per block of the chunk's 2 x 2 half blocks on or below the
    diagonal. A diagonal half block factors exp(b_i - b_j) = exp(b_i - r) exp(r - b_j) with r per channel
    the middle of b's range over that half, so every factor lies within exp(+-TAME_SPAN / 2), far from
    fp32 overflow; the block of the second half's queries against the first half's keys takes r = b at
    the first half's last row, where both exponents are <= 0 whatever the gates
    (`gla_A_tame_kernel`, `gla_dqk_tame_kernel`);
  * the others (gates far below 0, flag <= 0): the pairs i > j split into levels by the highest bit in which
    their positions differ; a pair of level l has i in the upper and j in the lower half of one aligned
    block of 2^(l+1) rows, and exp(b_i - b_j) = exp(b_i - b_rho) exp(b_rho - b_j) with rho that lower
    half's last row, both factors <= 1 for any gates: one tensor-core product per level and key block
    over the whole chunk (`gla_A_sub_kernel`, `gla_dqk_sub_kernel`). Nothing overflows; tiny weights
    underflow to exactly 0. Optionally (`_blocks`, ops.triton_linear_attn.LEVEL_BLOCKS) the lowest levels,
    the pairs inside aligned blocks of 2^lb rows, are one product with a reference per block.
Each kernel's programs return at once for the other kind, so every chunk is written by exactly one.

`gla_A_*` write A [tokens, H, BT] (row = query, column = key position inside the chunk); `gla_dqk_*`
write the intra-chunk dq, dk (from dA = do v^T) into fp32 buffers, to which the walks of `ops.triton_scan`
then add the inter-chunk parts. `gla_dg_kernel` turns dq, dk into d log_f via
d log_f_s = sum_{t >= s} (q_t dq_t - k_t dk_t) (+ the final state's term), a reverse cumulative sum that
involves no exponentials at all (the diagonal i == j terms, equal on both sides, are left out of it and
added to dq, dk only afterwards). The sum runs only over a run of a few chunks: it starts from the exact
value at the run's end, <S, dS> per key row from the state and its gradient there (stored by the dq / dk
walks), so its rounding errors do not pile up over the sequence.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ops.reference import LOG_F_FLOOR
from ops.triton_scan import anchor_block, dot32, exp_ftz, seq_bounds, tf32_round, walk_program

# log f below LOG_F_FLOOR counts as LOG_F_FLOOR (see ops.reference): f is 0 in fp32 either way, and b, the
# chunk-local cumsum every later kernel reads, stays finite (log f = -inf made b_i - b_j NaN) and small
# enough to keep the differences of milder gates after a strong one
_FLOOR = tl.constexpr(LOG_F_FLOOR)


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


# A chunk is *tame* when in each of its 32-row halves no key channel decays by more than exp(-TAME_SPAN):
# then each half's diagonal block of intra-chunk weights exp(b_i - b_j) may be formed as
# exp(b_i - r) * exp(r - b_j) with r the middle of b's range over the half, every factor inside
# exp(+-TAME_SPAN / 2) (see gla_cumsum_kernel, _mid_range). The largest intermediate is in the dq / dk
# products, a sum over 64 rows of dA * k (or dA^T * q) times one factor: 64 e^70 |dA k| stays below fp32's
# 3.4e38 for |dA k| < 2e6; 140 rather than less puts most chunks of a strongly decaying layer (HGRN2's first,
# whose chunk spans reach 120-165) on one product per key block.
TAME_SPAN = 140.0


@triton.jit
def gla_cumsum_kernel(g, bc, tame, cu, chunks, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, TAME_SPAN: tl.constexpr, MAX_LB: tl.constexpr, VARLEN: tl.constexpr):
    """grid (chunks, H), in the forward: bc = the cumulative log-decay from each chunk's start (fp32), for
    every chunk: every later kernel (the intra-chunk products, the walks of `ops.triton_scan`, the
    two-level scan) reads it instead of summing log f itself, and the backward keeps it in place of log f.
    Also classifies each (chunk, head) and writes the flag at the chunk's first token (tame[token, head]):
    2 when no key channel decays by more than exp(-TAME_SPAN) across the whole chunk (the tame kernels'
    one product per key block), else 1 when that holds in each 32-row half (their half-block products;
    every factor within exp(+-TAME_SPAN / 2) either way), else -lb <= 0 (the level kernels): with G the
    chunk's largest single-step decay (max of -log f), lb the largest value <= MAX_LB with
    (2^lb - 1) G <= TAME_SPAN, so that no aligned block of 2^lb rows decays by more than exp(-TAME_SPAN)
    (gates in [-20, 0]: lb = 3; 0 when MAX_LB is 0)."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_h = tl.program_id(1)
    bos, eos = seq_bounds(cu, i_n, T, VARLEN)
    rows = i_c * BT + tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    m = (rows < eos - bos)[:, None] & (offs_k < K)[None, :]
    p = ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
    gt = tl.load(g + p, mask=m, other=0.).to(tl.float32)
    gt = tl.where(gt < _FLOOR, _FLOOR, gt)  # not tl.maximum: a NaN gate stays NaN (max.f32 drops it)
    # a half's span: its decay from its first row to its last, i.e. the gates of its other rows (padded
    # rows load log f = 0); the largest over the key channels and the two halves. The backward reads
    # these flags, so both passes agree.
    idx = tl.arange(0, BT)[:, None]
    inner = (idx % (BT // 2)) != 0
    s0 = tl.sum(tl.where(inner & (idx < BT // 2), gt, 0.), axis=0)
    s1 = tl.sum(tl.where(inner & (idx >= BT // 2), gt, 0.), axis=0)
    s_all = tl.sum(tl.where(idx > 0, gt, 0.), axis=0)  # the whole chunk's span
    flag = (-tl.min(tl.minimum(s0, s1), axis=0) <= TAME_SPAN).to(tl.int32)
    flag += (-tl.min(s_all, axis=0) <= TAME_SPAN).to(tl.int32)
    if MAX_LB > 0:
        G = -tl.min(tl.min(gt, axis=1), axis=0)  # padded rows load 0: no larger than the real rows'
        lb = 0
        for b in tl.static_range(1, MAX_LB + 1):
            lb = tl.where(((1 << b) - 1) * G <= TAME_SPAN, b, lb)
        flag = tl.where(flag == 0, -lb, flag)
    tl.store(tame + (bos + i_c * BT) * H + i_h, flag)
    tl.store(bc + p, tl.cumsum(gt, axis=0), mask=m)


@triton.jit
def _tame_flag(tame, bos, t0, i_h, H: tl.constexpr):
    return tl.load(tame + (bos + t0) * H + i_h)


@triton.jit
def _tile(x, bos, rows, L, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask):
    p = x + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    return tl.load(p, mask=(rows < L)[:, None] & cmask[None, :], other=0.)


@triton.jit
def _exp0(x):
    """exp of an exponent that is <= 0 on every real row; padded rows (b loaded as 0) could make it
    positive, and their inf times a zero input would be NaN, so clamp."""
    return exp_ftz(tl.minimum(x, 0.))


@triton.jit
def _mid_range(b, rows, L):
    """Per key channel, the middle of b's range over the real rows (a chunk or a half of one; b only
    falls, so every factor exp(+-(b - mid)) lies within exp(+-TAME_SPAN / 2) when the flag says so)."""
    hi = tl.max(tl.where((rows < L)[:, None], b, -1e30), axis=0)
    lo = tl.min(b, axis=0)  # padded rows load b = 0, above every real row's
    return (0.5 * (hi + lo))[None, :]


@triton.jit
def _mid_factors(b, r, LIM: tl.constexpr):
    """exp(b - r), exp(r - b), each exponent clamped to LIM (only padded rows reach it: their q, k are 0)."""
    return exp_ftz(tl.minimum(b - r, LIM)), exp_ftz(tl.minimum(r - b, LIM))


@triton.jit
def _qkb_tiles(q, k, bc, bos, rows, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask):
    b = _tile(bc, bos, rows, L, i_h, H, K, offs_k, kmask)
    b_q = _tile(q, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
    b_k = _tile(k, bos, rows, L, i_h, H, K, offs_k, kmask).to(tl.float32)
    return b, b_q, b_k


@triton.jit
def gla_A_tame_kernel(q, k, bc, A, tame, cu, chunks, T, NT, TAME_SPAN: tl.constexpr,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, H); only for tame chunks (the others return at once: `gla_A_sub_kernel` does them).
    Flag 2: A = (q exp(b - r)) (k exp(r - b))^T on i >= j, r per channel the middle of b's range over the
    chunk. Flag 1: A on i >= j by half blocks of BT / 2 rows (0: the first half, 1: the second; b the cumulative
    log-decay from the chunk's start):
        A00 = (q0 exp(b0 - r0)) (k0 exp(r0 - b0))^T     r0: the middle of b's range over half 0
        A11 = (q1 exp(b1 - r1)) (k1 exp(r1 - b1))^T     r1: the same over half 1
        A10 = (q1 exp(b1 - rB)) (k0 exp(rB - b0))^T     rB: b at half 0's last row (exponents <= 0)
    On a tame chunk every factor lies within exp(+-TAME_SPAN / 2) (entries above the diagonal may
    overflow in a diagonal block's product: the causal mask discards them). Formed here, in parallel over chunks,
    the forward and dv walks only read A v / A^T do instead of forming them at every step of their walks
    (fp32 operands: tf32 for bf16 inputs, as everywhere on the gated path)."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_h = tl.program_id(1)
    bos, eos = seq_bounds(cu, i_n, T, VARLEN)
    flag = _tame_flag(tame, bos, i_c * BT, i_h, H)
    BH: tl.constexpr = BT // 2
    LIM: tl.constexpr = TAME_SPAN / 2
    L = eos - bos
    if flag == 2:  # the whole chunk in one product per key block, r the middle of b's range over it
        rows = i_c * BT + tl.arange(0, BT)
        acc = tl.zeros([BT, BT], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            offs_k = kb * BK + tl.arange(0, BK)
            kmask = offs_k < K
            b, b_q, b_k = _qkb_tiles(q, k, bc, bos, rows, L, i_h, H, K, offs_k, kmask)
            eq, ek = _mid_factors(b, _mid_range(b, rows, L), LIM)
            acc += dot32(b_q * eq, tl.trans(b_k * ek), PREC)
        causal = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]
        p = A + ((bos + rows) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
        tl.store(p, tl.where(causal, acc, 0.), mask=(rows < L)[:, None])
    elif flag == 1:
        rows0 = i_c * BT + tl.arange(0, BH)
        rows1 = rows0 + BH
        a00 = tl.zeros([BH, BH], dtype=tl.float32)
        a10 = tl.zeros([BH, BH], dtype=tl.float32)
        a11 = tl.zeros([BH, BH], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            offs_k = kb * BK + tl.arange(0, BK)
            kmask = offs_k < K
            b0, q0, k0 = _qkb_tiles(q, k, bc, bos, rows0, L, i_h, H, K, offs_k, kmask)
            b1, q1, k1 = _qkb_tiles(q, k, bc, bos, rows1, L, i_h, H, K, offs_k, kmask)
            eq, ek = _mid_factors(b0, _mid_range(b0, rows0, L), LIM)
            a00 += dot32(q0 * eq, tl.trans(k0 * ek), PREC)
            eq, ek = _mid_factors(b1, _mid_range(b1, rows1, L), LIM)
            a11 += dot32(q1 * eq, tl.trans(k1 * ek), PREC)
            rB = tl.min(b0, axis=0)[None, :]
            a10 += dot32(q1 * _exp0(b1 - rB), tl.trans(k0 * _exp0(rB - b0)), PREC)
        causal = tl.arange(0, BH)[:, None] >= tl.arange(0, BH)[None, :]
        cols = tl.arange(0, BH)[None, :]
        p0 = A + ((bos + rows0) * H + i_h)[:, None] * BT + cols
        p1 = A + ((bos + rows1) * H + i_h)[:, None] * BT + cols
        m0 = (rows0 < L)[:, None]
        m1 = (rows1 < L)[:, None]
        tl.store(p0, tl.where(causal, a00, 0.), mask=m0)
        tl.store(p0 + BH, tl.zeros([BH, BH], dtype=tl.float32), mask=m0)
        tl.store(p1, a10, mask=m1)
        tl.store(p1 + BH, tl.where(causal, a11, 0.), mask=m1)


@triton.jit
def _store_half(ptr, x, bos, rows, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask):
    p = ptr + ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
    tl.store(p, x, mask=(rows < L)[:, None] & kmask[None, :])


@triton.jit
def _store_diag(att, d, bos, rows, L, i_h, H: tl.constexpr):
    """att[rows] <- the diagonal of the square tile d: do_t . v_t of dA = do v^T, which `gla_dg_kernel`
    adds to dq and dk (one fp32 per token and head, instead of do and v read again)."""
    n = tl.arange(0, d.shape[0])
    tl.store(att + (bos + rows) * H + i_h, tl.sum(tl.where(n[:, None] == n[None, :], d, 0.), axis=1),
             mask=rows < L)


@triton.jit
def gla_dqk_tame_kernel(q, k, v, bc, do, dq, dk, att, tame, cu, chunks, T, NT, TAME_SPAN: tl.constexpr,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, H); only for tame chunks (the others return at once: `gla_dqk_sub_kernel`).
    Writes their intra-chunk dq, dk (fp32), to which the dq / dk scans then add the inter-chunk parts,
    in the forms of `gla_A_tame_kernel` (same references), with dA = do v^T strictly below the diagonal
    (the i == j terms: see gla_dg_kernel; their weights do_t . v_t go to att).
    Flag 2: dq = exp(b - r) (dA (k exp(r - b))),
    dk = exp(r - b) (dA^T (q exp(b - r))). Flag 1, by half blocks:
        dq0 = exp(b0 - r0) (dA00 (k0 exp(r0 - b0)))
        dq1 = exp(b1 - r1) (dA11 (k1 exp(r1 - b1))) + exp(b1 - rB) (dA10 (k0 exp(rB - b0)))
        dk0 = exp(r0 - b0) (dA00^T (q0 exp(b0 - r0))) + exp(rB - b0) (dA10^T (q1 exp(b1 - rB)))
        dk1 = exp(r1 - b1) (dA11^T (q1 exp(b1 - r1)))
    every factor within exp(+-TAME_SPAN / 2) on a tame chunk. In parallel over chunks, these products
    stay off the scans' walks, which are latency-bound."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_h = tl.program_id(1)
    bos, eos = seq_bounds(cu, i_n, T, VARLEN)
    flag = _tame_flag(tame, bos, i_c * BT, i_h, H)
    BH: tl.constexpr = BT // 2
    LIM: tl.constexpr = TAME_SPAN / 2
    L = eos - bos
    if flag == 2:  # the whole chunk in one product per key block (r: the middle of b's range over it)
        rows = i_c * BT + tl.arange(0, BT)
        offs_v = tl.arange(0, BV)
        vmask = offs_v < V
        strict = tl.arange(0, BT)[:, None] > tl.arange(0, BT)[None, :]
        b_do = _tile(do, bos, rows, L, i_h, H, V, offs_v, vmask)
        b_v = _tile(v, bos, rows, L, i_h, H, V, offs_v, vmask)
        dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        _store_diag(att, dA, bos, rows, L, i_h, H)
        dA = tl.where(strict, dA, 0.)
        for kb in range(0, tl.cdiv(K, BK)):
            offs_k = kb * BK + tl.arange(0, BK)
            kmask = offs_k < K
            b, b_q, b_k = _qkb_tiles(q, k, bc, bos, rows, L, i_h, H, K, offs_k, kmask)
            eq, ek = _mid_factors(b, _mid_range(b, rows, L), LIM)
            _store_half(dq, dot32(dA, b_k * ek, PREC) * eq, bos, rows, L, i_h, H, K, offs_k, kmask)
            _store_half(dk, dot32(tl.trans(dA), b_q * eq, PREC) * ek, bos, rows, L, i_h, H, K, offs_k, kmask)
    elif flag == 1:
        rows0 = i_c * BT + tl.arange(0, BH)
        rows1 = rows0 + BH
        offs_v = tl.arange(0, BV)
        vmask = offs_v < V
        strict = tl.arange(0, BH)[:, None] > tl.arange(0, BH)[None, :]
        do0 = _tile(do, bos, rows0, L, i_h, H, V, offs_v, vmask)
        do1 = _tile(do, bos, rows1, L, i_h, H, V, offs_v, vmask)
        v0 = _tile(v, bos, rows0, L, i_h, H, V, offs_v, vmask)
        v1 = _tile(v, bos, rows1, L, i_h, H, V, offs_v, vmask)
        dA00 = tl.dot(do0, tl.trans(v0), input_precision=PREC)
        dA11 = tl.dot(do1, tl.trans(v1), input_precision=PREC)
        _store_diag(att, dA00, bos, rows0, L, i_h, H)
        _store_diag(att, dA11, bos, rows1, L, i_h, H)
        dA00 = tl.where(strict, dA00, 0.)
        dA11 = tl.where(strict, dA11, 0.)
        dA10 = tl.dot(do1, tl.trans(v0), input_precision=PREC)
        for kb in range(0, tl.cdiv(K, BK)):
            offs_k = kb * BK + tl.arange(0, BK)
            kmask = offs_k < K
            b0, q0, k0 = _qkb_tiles(q, k, bc, bos, rows0, L, i_h, H, K, offs_k, kmask)
            b1, q1, k1 = _qkb_tiles(q, k, bc, bos, rows1, L, i_h, H, K, offs_k, kmask)
            rB = tl.min(b0, axis=0)[None, :]
            fq1, fk0 = _exp0(b1 - rB), _exp0(rB - b0)  # both <= 1 whatever the gates
            eq0, ek0 = _mid_factors(b0, _mid_range(b0, rows0, L), LIM)
            eq1, ek1 = _mid_factors(b1, _mid_range(b1, rows1, L), LIM)
            # fp32 operands: tf32
            dq0 = dot32(dA00, k0 * ek0, PREC) * eq0
            dq1 = dot32(dA11, k1 * ek1, PREC) * eq1 + dot32(dA10, k0 * fk0, PREC) * fq1
            dk0 = dot32(tl.trans(dA00), q0 * eq0, PREC) * ek0 + dot32(tl.trans(dA10), q1 * fq1, PREC) * fk0
            dk1 = dot32(tl.trans(dA11), q1 * eq1, PREC) * ek1
            _store_half(dq, dq0, bos, rows0, L, i_h, H, K, offs_k, kmask)
            _store_half(dq, dq1, bos, rows1, L, i_h, H, K, offs_k, kmask)
            _store_half(dk, dk0, bos, rows0, L, i_h, H, K, offs_k, kmask)
            _store_half(dk, dk1, bos, rows1, L, i_h, H, K, offs_k, kmask)


@triton.jit
def gla_intra_out_kernel(A, x, out, cu, chunks, T, NT, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BV: tl.constexpr, TRANSPOSED: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, cdiv(V, BV), H): the intra-chunk part of an output, fp32, per chunk in parallel:
    out = A x (forward: x = v, out = o's intra-chunk part) or A^T x (backward: x = do, out = dv's). The
    forward and dv walks then add their one inter-chunk product to it instead of forming A x on every
    step of their latency-bound walks."""
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    i_v = tl.program_id(1)
    i_h = tl.program_id(2)
    bos, eos = seq_bounds(cu, i_n, T, VARLEN)
    L = eos - bos
    rows = i_c * BT + tl.arange(0, BT)
    rmask = rows < L
    cols = tl.arange(0, BT)
    if TRANSPOSED:  # A^T[j, i] = A[i, j]; rows past the end are masked, their columns are causal zeros
        a = tl.load(A + ((bos + rows) * H + i_h)[None, :] * BT + cols[:, None], mask=rmask[None, :], other=0.)
    else:
        a = tl.load(A + ((bos + rows) * H + i_h)[:, None] * BT + cols[None, :], mask=rmask[:, None], other=0.)
    offs_v = i_v * BV + tl.arange(0, BV)
    vmask = offs_v < V
    b_x = _tile(x, bos, rows, L, i_h, H, V, offs_v, vmask).to(tl.float32)
    p = ((bos + rows) * H + i_h)[:, None] * V + offs_v[None, :]
    tl.store(out + p, dot32(a, b_x, PREC), mask=rmask[:, None] & vmask[None, :])


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
def gla_dg_kernel(q, k, att, dq, dk, dg, dgx, dkx, dq_out, dk_out, anc_h, anc_dh, cu, chunks, T, AC, NA,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_DS: tl.constexpr, ANCHOR: tl.constexpr, VARLEN: tl.constexpr):
    """grid (cdiv(K, BK), H, runs): d log_f of one run of AC chunks, anchored at its end. Dense input:
    N * NA programs (NA runs per sequence); packed: one program per row of the (sequence, chunk) table,
    those whose chunk starts no run returning at once (so many short sequences cost no empty runs).
    With x_s = q_s dq_s - k_s dk_s (the i == j terms left out of dq, dk: they cancel exactly; left in,
    fp32 rounding of them swamps the tiny true gradient of gates near 0), for t in the run
        d log_f_t = sum_{s = t}^{e} x_s + <S_e, G_e>     (per key row; sum over the value columns)
    e the run's last row, S_e the state after it and G_e the gradient of S_e from the later tokens
    (0 after a sequence's last run). Exact: d log_f_t = <f_t S_{t-1}, dS_t> telescopes to the sum of
    x_s up to any row e plus d log_f_{e+1} = <S_e, f_{e+1} dS_{e+1}>. The anchor replaces the sum over
    the rest of the sequence, whose terms cancel while their rounding errors add up with T; so the error
    stays that of AC chunks at any T. S_e and G_e come from the dq and dk walks (`anchor_block`; the
    dk walks' gradient holds no part of the final state's). Then adds (do_t . v_t) k_t, (do_t . v_t) q_t
    (do_t . v_t from att, stored by the intra-chunk kernels) and writes dq, dk. With a gradient on the
    final state (HAS_DS), its terms come from
    `gla_state_grad_kernel`: d log_f's directly (dgx) and dk's (dkx), added here after the sum."""
    pid = tl.program_id(2)
    if VARLEN:
        i_n = tl.load(chunks + 2 * pid)
        i_c = tl.load(chunks + 2 * pid + 1)
        first = i_c % AC == 0
        i_a = i_c // AC
    else:
        i_n = pid // NA
        i_a = pid % NA
        first = i_a >= 0
    if first:
        i_h, bos, L, offs_k, offs_v, kmask, vmask, _, _, hmask = walk_program(
            tl.program_id(0), 0, i_n * H + tl.program_id(1), None, cu, T, H, K, V, BK, BV, True, True, VARLEN)
        NC = tl.cdiv(L, BT)
        c0 = i_a * AC
        c1 = tl.minimum(c0 + AC, NC)
        carry = tl.zeros([BK], dtype=tl.float32)
        if ANCHOR:
            if c1 < NC:  # <S_e, G_e> at the boundary before chunk c1
                b_h = tl.load(anchor_block(anc_h, bos, c1, AC, i_h, H, K, V, offs_k, offs_v, BT), mask=hmask,
                              other=0.)
                b_dh = tl.load(anchor_block(anc_dh, bos, c1, AC, i_h, H, K, V, offs_k, offs_v, BT), mask=hmask,
                               other=0.)
                carry += tl.sum(b_h * b_dh, axis=1)
        for cc in range(0, tl.maximum(c1 - c0, 0)):
            rows = (c1 - 1 - cc) * BT + tl.arange(0, BT)
            x, b_q, b_k, b_dq, b_dk, p, m = _dg_x(q, k, dq, dk, bos, rows, L, i_h, H, K, offs_k, kmask)
            b_dg = tl.cumsum(x, axis=0, reverse=True) + carry[None, :]
            carry += tl.sum(x, axis=0)
            if HAS_DS:
                b_dg += tl.load(dgx + p, mask=m, other=0.)
                b_dk += tl.load(dkx + p, mask=m, other=0.)
            tl.store(dg + p, b_dg.to(dg.dtype.element_ty), mask=m)
            a_tt = tl.load(att + (bos + rows) * H + i_h, mask=rows < L, other=0.)[:, None]
            tl.store(dq_out + p, (b_dq + a_tt * b_k).to(dq_out.dtype.element_ty), mask=m)
            tl.store(dk_out + p, (b_dk + a_tt * b_q).to(dk_out.dtype.element_ty), mask=m)


@triton.jit
def _lin_rec(a1, x1, a2, x2):
    """Composition of z -> a1 z + x1, then z -> a2 z + x2 (for tl.associative_scan)."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _gates_of(bc, bos, rows, t0, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask):
    """log f on `rows` of the chunk starting at t0, from bc (the chunk-local cumulative log-decay):
    b_s - b_{s-1}, b_{t0 - 1} = 0; 0 on rows past the end (f = 1)."""
    m = (rows < L)[:, None] & kmask[None, :]
    b = tl.load(bc + ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :], mask=m, other=0.)
    mp = (rows > t0)[:, None] & m
    b_prev = tl.load(bc + ((bos + rows - 1) * H + i_h)[:, None] * K + offs_k[None, :], mask=mp, other=0.)
    return tl.where(m, b - b_prev, 0.)


@triton.jit
def gla_state_grad_kernel(k, v, bc, dht, h0, dgx, dkx, dh0, cu, T,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr):
    """grid (cdiv(K, BK), N * H), only when the loss reads the final state S_T (gradient dS).
    With W_s = prod_{t > s} f_t (per channel) and z_s = <S_s, dS> per key row (z_s = f_s z_{s-1} + k_s u_s,
    u_s = dS v_s):
        d log_f_s += W_s f_s z_{s-1}   (dgx)      dk_s += W_s u_s   (dkx)      dh0 += (prod_t f_t) dS
    The direct form: every term is a product of factors <= 1 and O(1) sums, so it keeps its relative
    precision for gates near 0, where the equivalent 'sum of all minus a suffix' form cancels.
    Pass 1 walks forward (z; writes f_s z_{s-1} into dgx and u into dkx), pass 2 backward (W, from bc
    directly: W_s = W_end exp(b_last - b_s) inside a chunk). Pass 1's gates come from bc, the chunk-local
    cumulative log-decay (`_gates_of`); every use of them here is a factor exp(log f), whose relative
    error that difference leaves at about |b| * 2^-24."""
    i_h, bos, L, offs_k, offs_v, kmask, vmask, _, hp, hmask = walk_program(
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
        a = exp_ftz(_gates_of(bc, bos, rows, c * BT, L, i_h, H, K, offs_k, kmask))  # padded rows: f = 1
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
        # W_s = W * prod_{s < t <= chunk's last row} f_t = W * exp(b_last - b_s): no product to scan
        b = tl.load(bc + p, mask=m, other=0.)
        b_last = tl.load(bc + ((bos + c * BT + tl.minimum(L - c * BT, BT) - 1) * H + i_h) * K + offs_k,
                         mask=kmask, other=0.)[None, :]
        w = exp_ftz(tl.minimum(b_last - b, 0.)) * W[None, :]  # padded rows (b = 0) are masked below
        tl.store(dgx + p, w * tl.load(dgx + p, mask=m, other=0.), mask=m)
        tl.store(dkx + p, w * tl.load(dkx + p, mask=m, other=0.), mask=m)
        W = tl.sum(exp_ftz(b_last), axis=0) * W
    if HAS_H0:
        tl.store(dh0 + hp, tl.load(dh0 + hp, mask=hmask, other=0.) + W[:, None] * dS, mask=hmask)


# ----------------------------------------------------------------------------------------------------
# chunks that are not tame (flag 0): the pairs by levels
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _level_rho(l, BT: tl.constexpr):
    """Per row of a chunk, rho of level l: the last row of the lower half of the row's aligned block of
    2^(l+1) rows (see `_level`)."""
    idx = tl.arange(0, BT)
    return ((idx >> (l + 1)) << (l + 1)) + (1 << l) - 1


@triton.jit
def _level(b, b_rho, l, BT: tl.constexpr):
    """Level l of a chunk's pairs i > j: those whose highest differing bit (of their positions in the
    chunk) is l, i.e. i in the upper and j in the lower half of one aligned block of 2^(l+1) rows. With
    rho = that lower half's last row (`_level_rho`; b_rho: b on the rows rho), exp(b_i - b_j) =
    exp(b_i - b_rho) exp(b_rho - b_j), both exponents <= 0 for any gates. Returns the query-side factors
    (rows of upper halves; 0 on the others), the key-side factors (rows of lower halves; 0 on the others),
    one exp per element, and the [BT, BT] mask of the pairs within one block (symmetric). Rows past the end
    load b = 0: clamped, their q, k, dA are 0. `gla_A_sub_kernel` loads b_rho again from memory (taking it
    from the tile with tl.gather, as `gla_dqk_sub_kernel` does, made it take 1.6x the time with Triton 3.6
    on an H200: docs/kernels.md, GLA: the intra-chunk products)."""
    idx = tl.arange(0, BT)
    upper = (((idx >> l) & 1) == 1)[:, None]
    d = b - b_rho
    e = exp_ftz(tl.minimum(tl.where(upper, d, -d), 0.))
    return tl.where(upper, e, 0.), tl.where(upper, 0., e), (idx[:, None] >> (l + 1)) == (idx[None, :] >> (l + 1))


@triton.jit
def _level_dqk(b, b_q, b_k, dA, dAt, acc_q, acc_k, l, BT: tl.constexpr, PREC: tl.constexpr):
    """Level l of `gla_dqk_sub_kernel` (the pairs and factors of `_level`): adds f_q (dA_l (k f_k)) to
    acc_q and f_k (dA_l^T (q f_q)) to acc_k, b_rho taken from the tile of b in registers (tl.gather,
    through shared memory) instead of a load. One factor tile serving both sides, the other side's rows
    zeroed in each product's operand and result, builds with a smaller spill but took up to 0.5% more
    time than these two tiles on an H200 (docs/kernels.md, "Instructions per level"). The factors are
    `_level`'s arithmetic written out in this order: through `_level` the sm_90 build (Triton 3.9) spills
    168 B a thread instead of 152."""
    idx = tl.arange(0, BT)
    d = b - tl.gather(b, tl.broadcast_to(_level_rho(l, BT)[:, None], b.shape), axis=0)
    upper = (((idx >> l) & 1) == 1)[:, None]
    e = exp_ftz(tl.minimum(tl.where(upper, d, -d), 0.))
    same = (idx[:, None] >> (l + 1)) == (idx[None, :] >> (l + 1))
    f_q = tl.where(upper, e, 0.)
    f_k = tl.where(upper, 0., e)
    acc_q += tl.dot(tl.where(same, dA, 0.), _tf32(b_k * f_k, PREC), input_precision=PREC) * f_q
    acc_k += tl.dot(tl.where(same, dAt, 0.), _tf32(b_q * f_q, PREC), input_precision=PREC) * f_k
    return acc_q, acc_k


@triton.jit
def _blocks(b, bc, bos, t0, L, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask, lb, LIM: tl.constexpr,
            BT: tl.constexpr):
    """The pairs inside one aligned block of 2^lb rows (the levels below lb), as one product: r per row and
    channel the middle of b's range over the row's block (b only falls, so the block's first row and its
    last real row bound that range), exp(b - r) and exp(r - b) each within exp(+-TAME_SPAN / 2) on a chunk
    whose flag gives lb (gla_cumsum_kernel), clamped to LIM for padded rows (their q, k are 0). Returns the
    query-side factors, the key-side factors and the [BT, BT] mask of the pairs within one block
    (symmetric). The pairs across blocks may overflow in the product: the mask discards them. A chunk
    with lb = 0 has blocks of one row, whose only pair i == j the callers leave out: the product adds 0
    (computed anyway: a branch around it made the sm_90 build spill more)."""
    idx = tl.arange(0, BT)
    first = (idx >> lb) << lb
    last = tl.minimum(first + (1 << lb) - 1, L - 1 - t0)
    r = 0.5 * (_tile(bc, bos, t0 + first, L, i_h, H, K, offs_k, kmask)
               + _tile(bc, bos, t0 + last, L, i_h, H, K, offs_k, kmask))
    return (exp_ftz(tl.minimum(b - r, LIM)), exp_ftz(tl.minimum(r - b, LIM)),
            (idx[:, None] >> lb) == (idx[None, :] >> lb))


@triton.jit
def _level_chunk(chunks, tame, cu, T, NT, H: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr,
                 HEAD_AXIS: tl.constexpr):
    """The chunk (grid axis 0) and head (axis HEAD_AXIS) of a level kernel's program: whether the chunk is
    one of theirs (not tame: flag <= 0), lb (the first level taken by products, below it the pairs inside
    blocks of 2^lb rows: `_blocks`), the head, the sequence's start and length, the chunk's first row in it."""
    i_h = tl.program_id(HEAD_AXIS)
    i_n, i_c = _chunk_of(chunks, tl.program_id(0), T, NT, VARLEN)
    bos, eos = seq_bounds(cu, i_n, T, VARLEN)
    flag = _tame_flag(tame, bos, i_c * BT, i_h, H)
    return flag <= 0, tl.maximum(-flag, 0), i_h, bos, eos - bos, i_c * BT


@triton.jit
def _tf32(x, PREC: tl.constexpr):
    """x as a tensor-core operand of `dot32` (rounded to tf32 for PREC 'tf32'), for operands used by several
    products."""
    if PREC == "tf32":
        return tf32_round(x)
    return x


@triton.jit
def gla_A_sub_kernel(q, k, bc, A, tame, cu, chunks, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, LOG_BT: tl.constexpr, BLOCKS: tl.constexpr, TAME_SPAN: tl.constexpr,
                     VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (chunks, H); only for chunks that are not tame (flag <= 0; `gla_A_tame_kernel` does the others).
    A of the whole chunk by levels: the pairs i > j split by the highest bit in which their positions in
    the chunk differ (LOG_BT levels); a pair of level l has i in the upper and j in the lower half of one
    aligned block of 2^(l+1) rows, and with rho that lower half's last row
        exp(b_i - b_j) = exp(b_i - b_rho) exp(b_rho - b_j),
    both factors <= 1 for any gates (`_level`), so each level is one [BT, BK] x [BK, BT] tensor-core
    product of factor-scaled q and k per key block, kept on its own pairs; i == j has weight 1 (an fp32
    row sum). One program per chunk keeps the products large; every entry is written (0 above the
    diagonal, where no level has pairs). BLOCKS: the levels below the chunk's lb as one product over the
    blocks of 2^lb rows (`_blocks`)."""
    level, lb, i_h, bos, L, t0 = _level_chunk(chunks, tame, cu, T, NT, H, BT, VARLEN, 1)
    if not BLOCKS:
        lb = 0
    LIM: tl.constexpr = TAME_SPAN / 2
    if level:
        rows = t0 + tl.arange(0, BT)
        idx = tl.arange(0, BT)
        acc = tl.zeros([BT, BT], dtype=tl.float32)
        diag = tl.zeros([BT], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            offs_k = kb * BK + tl.arange(0, BK)
            kmask = offs_k < K
            b, b_q, b_k = _qkb_tiles(q, k, bc, bos, rows, L, i_h, H, K, offs_k, kmask)
            diag += tl.sum(b_q * b_k, axis=1)
            if BLOCKS:
                e_q, e_k, same = _blocks(b, bc, bos, t0, L, i_h, H, K, offs_k, kmask, lb, LIM, BT)
                acc += tl.where(same & (idx[:, None] > idx[None, :]),
                                dot32(b_q * e_q, tl.trans(b_k * e_k), PREC), 0.)
            for l in range(lb, LOG_BT):  # a loop, not unrolled: unrolled, the levels' tiles stay live at once
                b_rho = _tile(bc, bos, t0 + _level_rho(l, BT), L, i_h, H, K, offs_k, kmask)
                f_q, f_k, same = _level(b, b_rho, l, BT)
                acc += tl.where(same, dot32(b_q * f_q, tl.trans(b_k * f_k), PREC), 0.)
        acc += tl.where(idx[:, None] == idx[None, :], diag[:, None], 0.)
        p = A + ((bos + rows) * H + i_h)[:, None] * BT + idx[None, :]
        tl.store(p, acc, mask=(rows < L)[:, None])


@triton.jit
def gla_dqk_sub_kernel(q, k, v, bc, do, dq, dk, att, tame, cu, chunks, T, NT,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, LOG_BT: tl.constexpr, BLOCKS: tl.constexpr, TAME_SPAN: tl.constexpr,
                       VARLEN: tl.constexpr, PREC: tl.constexpr, KEY_BLOCKS: tl.constexpr):
    """grid (chunks, cdiv(cdiv(K, BK), KEY_BLOCKS), H); only for chunks that are not tame. The intra-chunk
    dq, dk (fp32) of the chunk in KEY_BLOCKS key blocks, one after another, by the levels of
    `gla_A_sub_kernel`: with dA = do v^T strictly below the diagonal (the i == j terms: see gla_dg_kernel),
    per level l (dA_l: dA on the level's pairs)
        dq += f_q (dA_l (k f_k))        dk += f_k (dA_l^T (q f_q))
    two tensor-core products per level sharing its factors, every factor <= 1 whatever the gates. dA is
    formed once per program (a bf16 product, [BT, BT]) rather than read back from memory. More key blocks
    a program form it fewer times and start fewer programs (where every chunk is tame, they all return at
    once); fewer spread more programs over the SMs. The first key block's programs store dA's diagonal
    into att, as `gla_dqk_tame_kernel`. BLOCKS: the levels below the chunk's lb as two products over the
    blocks of 2^lb rows (`_blocks`; the sums inside the products, at most 2^lb e^(TAME_SPAN / 2) |dA k|,
    stay far from fp32's range)."""
    i_kb = tl.program_id(1)
    level, lb, i_h, bos, L, t0 = _level_chunk(chunks, tame, cu, T, NT, H, BT, VARLEN, 2)
    if not BLOCKS:
        lb = 0
    LIM: tl.constexpr = TAME_SPAN / 2
    if level:
        rows = t0 + tl.arange(0, BT)
        idx = tl.arange(0, BT)
        dA = tl.zeros([BT, BT], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            offs_v = vb * BV + tl.arange(0, BV)
            vmask = offs_v < V
            dA += tl.dot(_tile(do, bos, rows, L, i_h, H, V, offs_v, vmask),
                         tl.trans(_tile(v, bos, rows, L, i_h, H, V, offs_v, vmask)), input_precision=PREC)
        if i_kb == 0:
            _store_diag(att, dA, bos, rows, L, i_h, H)
        dA = _tf32(tl.where(idx[:, None] > idx[None, :], dA, 0.), PREC)  # rounded once for every level
        dAt = tl.trans(dA)  # the level masks are symmetric: one transpose serves them all
        for j in range(0, KEY_BLOCKS):
            offs_k = (i_kb * KEY_BLOCKS + j) * BK + tl.arange(0, BK)
            kmask = offs_k < K
            b, b_q, b_k = _qkb_tiles(q, k, bc, bos, rows, L, i_h, H, K, offs_k, kmask)
            acc_q = tl.zeros([BT, BK], dtype=tl.float32)
            acc_k = tl.zeros([BT, BK], dtype=tl.float32)
            if BLOCKS:
                e_q, e_k, same = _blocks(b, bc, bos, t0, L, i_h, H, K, offs_k, kmask, lb, LIM, BT)
                acc_q += tl.dot(tl.where(same, dA, 0.), _tf32(b_k * e_k, PREC), input_precision=PREC) * e_q
                acc_k += tl.dot(tl.where(same, dAt, 0.), _tf32(b_q * e_q, PREC), input_precision=PREC) * e_k
                for l in range(lb, LOG_BT):
                    acc_q, acc_k = _level_dqk(b, b_q, b_k, dA, dAt, acc_q, acc_k, l, BT, PREC)
            else:
                # unrolled, so that each level's masks and gather indices are constants: 1.5% less fwd+bwd time
                # where every chunk takes the level kernels (gla_A_sub_kernel's loop stays a loop: unrolled, its
                # levels' tiles stayed live at once)
                for l in tl.static_range(0, LOG_BT):
                    acc_q, acc_k = _level_dqk(b, b_q, b_k, dA, dAt, acc_q, acc_k, l, BT, PREC)
            _store_half(dq, acc_q, bos, rows, L, i_h, H, K, offs_k, kmask)
            _store_half(dk, acc_k, bos, rows, L, i_h, H, K, offs_k, kmask)

"""Chunk-walk Triton kernels shared by `lightning_attn` and `gated_linear_attn`.

A *walk* program owns one (sequence, head), one block of the state's key or value columns and one
*segment* of the sequence (a run of SC chunks), and steps through its chunks carrying the fp32 state in
registers. Per chunk of BT tokens (b = inclusive cumulative log-decay inside the chunk, b_L its last row):

    o      = A v + (q * exp(b)) h                      A = intra-chunk masked weights
    h_next = exp(b_L) h + (k * exp(b_L - b))^T v

Two layouts share these kernels (`ops.tuning` picks one per shape):
  * scan: one segment per sequence (SC >= chunks): nothing but q, k, v (and gates) is read, no state is
    ever written to memory; parallel over batch x heads x column blocks only.
  * split: S segments per sequence, walked in parallel. Their start states come from a two-level scan:
    `seg_local_kernel` forms every segment's own contribution to the state at its end (a reduction over
    its chunks, parallel over segments and state blocks), `seg_combine_kernel` chains those S partial
    states (h_s+1 = exp(dec_s) h_s + local_s, elementwise). The backward does the same for the state
    gradient, in reverse. This multiplies the parallelism by S where batch x heads alone leaves SMs idle.

Every exponent is <= 0, so decay factors lie in [0, 1]: strong decays underflow to exactly 0, never to inf
or NaN, however long the sequence. Two decay kinds share the code (constexpr GATED):
  * scalar per head (lightning / TNL; cosFormer2 passes no decay at all: HAS_DECAY=False): b_i = (i+1) log(lambda);
    A = (q k^T) * lambda^(i-j) is formed here on tensor cores;
  * per key channel (GLA / HGRN2): b = cumsum(log_f) per channel inside each chunk; b itself, A and the
    intra-chunk parts of dq and dk come precomputed for every chunk from `ops.triton_gla_intra` (in
    parallel over chunks), so a gated walk step holds no cumsum and no intra-chunk product but A v;
    the gated dq / dk walks add their inter-chunk terms onto the intra-chunk parts.

Precision (GLA): the gated walks keep the fp32 state and the decayed q, k to more than bf16 precision in
their products: d log_f is a cancelling sum of q dq - k dk, and bf16 rounding of those operands was its
largest error. The forward and dv walks take tf32 operands rounded to nearest (`dot32`); in the dq / dk
walks the other operand is an input as loaded (v, do, already a tf32 value), so only the fp32 one is
rounded, or, with SPLIT (bf16 inputs, `ops.triton_linear_attn.WALK_PAIRS`, the default), taken as a bf16 hi + lo pair
in two bf16 products (`dot_exact`). The scalar decay keeps bf16 operands. The gated dq / dk walks also store the state and its
gradient every few chunks (`anchor_block`): d log_f's sum starts from their product there.

Backward is three independent walks: dq walks forward (state h), dk and dv walk backward (state dh, the
gradient of the state at the chunk's end); each recomputes the small products it needs instead of reading
stored activations. Sequences come either as the rows of a [B, T] batch or packed with `cu_seqlens`
(B == 1): `bos`/`eos` bound each program's walk, which is also the state reset.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def seq_bounds(cu, i_n, T, VARLEN: tl.constexpr):
    if VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def walk_program(i_k, i_v, i_nh, log_lam, cu, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, GATED: tl.constexpr, HAS_DECAY: tl.constexpr,
             VARLEN: tl.constexpr):
    """What every walk program starts from: its head, sequence start and length, its key / value columns
    (block i_k of BK, block i_v of BV) with their masks, the scalar log-decay (0. when gated or none),
    and the offsets / mask of its [BK, BV] block of a [N, H, K, V] state tensor."""
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos = seq_bounds(cu, i_n, T, VARLEN)
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
def mask_and(mask, cond):
    """mask & a scalar condition, in a form the CPU interpreter accepts too."""
    return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


@triton.jit
def segment_chunks(i_s, L, SC, BT: tl.constexpr):
    """Chunks [c0, c1) of segment i_s (SC chunks each) of a sequence of L tokens, the number of segments of
    that sequence, and whether i_s is its last (a segment past the end has c0 >= c1: an empty walk)."""
    NC = tl.cdiv(L, BT)
    c0 = i_s * SC
    c1 = tl.minimum(c0 + SC, NC)
    return c0, c1, tl.cdiv(NC, SC), (c1 == NC) & (c0 < NC)


@triton.jit
def _slot(buf, i_nh, j, SM1, K: tl.constexpr, V: tl.constexpr, offs_k, offs_v):
    """Pointers to a [BK, BV] block of slot j of a segment-state buffer [N * H, SM1, K, V]."""
    return buf + (i_nh.to(tl.int64) * SM1 + j) * K * V + offs_k[:, None] * V + offs_v[None, :]


@triton.jit
def _dh_start(dht, Es, hp, hmask, last, c0, c1, i_nh, i_s, SM1, K: tl.constexpr, V: tl.constexpr, offs_k, offs_v,
              BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr):
    """A backward walk's starting [BK, BV] block of dh: d(final state) for the sequence's last segment,
    else slot i_s of Es (the chained state gradients); an empty segment starts from zeros."""
    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dh += tl.load(dht + hp, mask=mask_and(hmask, last), other=0.).to(tl.float32)
    dh += tl.load(_slot(Es, i_nh, i_s, SM1, K, V, offs_k, offs_v), mask=mask_and(hmask, (c1 > c0) & (last == 0)),
                  other=0.)
    return dh


@triton.jit
def anchor_block(buf, bos, c, AC, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, offs_k, offs_v,
                 BT: tl.constexpr):
    """Pointers to a [BK, BV] block of the GLA d log_f anchor buffer [slots, H, K, V] at the boundary
    before chunk c of the sequence starting at token bos (an anchor every AC chunks). The slot is the
    boundary's token position divided by AC * BT: distinct for every anchor of every sequence, packed or
    not (anchors of one sequence lie exactly AC * BT apart, the next sequence's first one more than
    AC * BT later), and below cdiv(total tokens, AC * BT)."""
    slot = (bos + c * BT) // (AC * BT)
    base = buf + (slot * H + i_h) * (K * V)  # a scalar offset, then the block's int32 offsets
    return base + (offs_k[:, None] * V + offs_v[None, :])


@triton.jit
def _chunk_rows(c, offs_t, L, BT: tl.constexpr):
    """Chunk c's rows inside the sequence, which of them are real, and how many."""
    rows = c * BT + offs_t
    return rows, rows < L, tl.minimum(L - c * BT, BT)


if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter runs no inline PTX
    @triton.jit
    def exp_ftz(x):
        return tl.exp(x)
else:
    @triton.jit
    def exp_ftz(x):
        """exp(x) by one MUFU.EX2 (ex2.approx.ftz.f32 of x log2(e)). tl.exp's ex2.approx.f32 adds a range
        check and two multiplies per element to return results below 2^-126 as subnormals; every exp here
        is a decay factor (exponent <= 0) or a bounded tame-chunk factor, where a weight below 1e-38 adds
        nothing an fp32 sum can hold, so it flushes them to 0. Fewer instructions on every walk step."""
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _step(s, a, x, w, b_last, F32: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One chunk of a state walk: s <- exp(b_last)^T * s + (a * w)^T x (w: the rows' decay weights), the
    product on fp32 operands when F32 (tf32 for bf16 inputs), else on a's dtype; without decay s + a^T x.
    Forward walks: a = k, x = v, w = exp(b_L - b); backward walks: a = q, x = do, w = exp(b)."""
    if DECAY:
        return s * exp_ftz(tl.trans(b_last)) + _outer(a, x, w, F32, PREC)
    return s + tl.dot(tl.trans(a), x, input_precision=PREC)


@triton.jit
def tf32_round(x):
    """x (fp32) rounded to the nearest tf32 value (10-bit mantissa, ties away from zero, as cvt.rna.tf32).
    Tensor cores read only the top 19 bits of an fp32 operand, i.e. truncate it; truncation errors all
    point towards zero, and d log_f, a reverse cumulative sum of a cancelling difference, piles such a bias
    up with the length of the sum (2e-2 relative error for one sum over 64K tokens). Rounded operands leave
    only unbiased errors. Ties away from zero take two integer ops where ties to even take four; a tie needs
    the 13 dropped bits at exactly 0x1000, which the operands rounded here (sums, exp-scaled inputs; bf16
    inputs drop nothing) reach about once in 2^13, so the bias they add is far below truncation's.
    The carry of the add runs into the exponent exactly when rounding up must (and leaves inf an inf)."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def dot32(a, b, PREC: tl.constexpr):
    """a @ b for fp32 operands: tf32 tensor cores with round-to-nearest operands (PREC 'tf32', bf16
    inputs), or exact fp32 ('ieee', fp32 inputs)."""
    if PREC == "tf32":
        return tl.dot(tf32_round(a), tf32_round(b), input_precision="tf32")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def split_bf16(x):
    """x (fp32) as hi + lo, both bf16 (each rounded to nearest): hi + lo equals x to about 2^-17 relative,
    finer than a tf32 operand's 2^-11, with errors of either sign."""
    hi = x.to(tl.bfloat16)  # cvt.rn.bf16.f32 on the GPU (the CPU interpreter truncates instead)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dot_exact(a, b, acc, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b where a holds 16-bit input values (exact in tf32 and in bf16) and b is fp32.
    SPLIT (bf16 inputs): b as hi + lo bf16 (`split_bf16`), two bf16 tensor-core products on a as loaded:
    no conversion of a, half the operand bytes of tf32, and b kept to ~2^-17 instead of tf32's 2^-11.
    Else fp32 operands: tf32 with only b rounded (a is already a tf32 value), or exact fp32 ('ieee')."""
    if SPLIT:
        hi, lo = split_bf16(b)
        return tl.dot(a, lo, tl.dot(a, hi, acc))
    if PREC == "tf32":
        return tl.dot(a.to(tl.float32), tf32_round(b), acc, input_precision="tf32")
    return tl.dot(a.to(tl.float32), b, acc, input_precision=PREC)


@triton.jit
def dot_exact_rhs(a, b, acc, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b with a fp32 and b 16-bit input values: `dot_exact` with the roles swapped."""
    if SPLIT:
        hi, lo = split_bf16(a)
        return tl.dot(lo, b, tl.dot(hi, b, acc))
    if PREC == "tf32":
        return tl.dot(tf32_round(a), b.to(tl.float32), acc, input_precision="tf32")
    return tl.dot(a, b.to(tl.float32), acc, input_precision=PREC)


@triton.jit
def _outer(a, x, w, F32: tl.constexpr, PREC: tl.constexpr):
    """(a * w)^T x on fp32 operands when F32, else on a's dtype."""
    if F32:
        return dot32(tl.trans(a.to(tl.float32) * w), x.to(tl.float32), PREC)
    return tl.dot(tl.trans((a * w).to(a.dtype)), x, input_precision=PREC)


@triton.jit
def _decay_rows(g, ll, bos, c, rows, rmask, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, kmask,
                n_valid, GATED: tl.constexpr, HAS_DECAY: tl.constexpr, BT: tl.constexpr):
    """Inclusive cumulative log-decay inside chunk c: b [BT, BK] (GATED) or [BT, 1], and b_L [1, BK]
    or [1, 1] (its value at the chunk's last valid row). GATED: g is the chunk-local cumulative sum
    itself, formed for every chunk in parallel (`gla_cumsum_kernel`), so that no walk step waits on a
    cumsum; padded rows load b = 0 (their q, k, v are 0, and every factor formed from b stays <= 1)."""
    if GATED:
        p = g + ((bos + rows) * H + i_h)[:, None] * K + offs_k[None, :]
        b = tl.load(p, mask=rmask[:, None] & kmask[None, :], other=0.)
        pl = g + ((bos + c * BT + n_valid - 1) * H + i_h) * K + offs_k
        b_last = tl.load(pl, mask=kmask, other=0.)[None, :]
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
        return tl.where(keep, exp_ftz(ll * tl.where(keep, dist, 0.)), 0.)
    return tl.where(keep, 1., 0.)


@triton.jit
def _load_rows(ptr, bos, rows, rmask, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask):
    p = ptr + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    return tl.load(p, mask=rmask[:, None] & cmask[None, :], other=0.)


@triton.jit
def _store_rows(ptr, x, bos, rows, rmask, i_h, H: tl.constexpr, D: tl.constexpr, offs, cmask):
    p = ptr + ((bos + rows) * H + i_h)[:, None] * D + offs[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# ----------------------------------------------------------------------------------------------------
# the two-level scan of the split layout
# ----------------------------------------------------------------------------------------------------

@triton.jit
def seg_local_kernel(a, x, g, log_lam, slot, dec, cu, T, SC, SM1,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, GATED: tl.constexpr, HAS_DECAY: tl.constexpr,
                     REVERSE: tl.constexpr, F32: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(K, BK) * cdiv(V, BV), N * H, SM1): one segment's own part of a state, from zero.
    Forward (REVERSE=False; a = k, x = v): slot j <- sum over segment j's rows t of
    (k_t * exp(B_end - B_t))^T v_t, its state at the end had it started from 0.
    Backward (REVERSE=True; a = q, x = do): slot j <- sum over segment j+1's rows of (q_t * exp(B_t - B_start))^T do_t,
    the gradient its rows send to the state at its start.
    dec[N * H, SM1, K] <- the segment's whole log-decay (its chunks' b_L summed), which chains the slots
    (`seg_combine_kernel`). Segments past a sequence's end write zeros (never read)."""
    NV = tl.cdiv(V, BV)
    i_k = tl.program_id(0) // NV
    i_v = tl.program_id(0) % NV
    i_nh = tl.program_id(1)
    j = tl.program_id(2)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, _, hmask = walk_program(
        i_k, i_v, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    c0, c1, _, _ = segment_chunks(j + REVERSE, L, SC, BT)
    offs_t = tl.arange(0, BT)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    if GATED:
        carry = tl.zeros([1, BK], dtype=tl.float32)
    else:
        carry = tl.zeros([1, 1], dtype=tl.float32)
    n = tl.maximum(c1 - c0, 0)
    for cc in range(0, n):
        if REVERSE:
            c = c0 + cc
        else:
            c = c1 - 1 - cc
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_a = _load_rows(a, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_x = _load_rows(x, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        if GATED or HAS_DECAY:
            b, b_last = _decay_rows(g, ll, bos, c, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                    GATED, HAS_DECAY, BT)
            if REVERSE:  # weight of row t: exp(B_t - B_start), B_t - B_start = carry + b_t <= 0
                w = exp_ftz(tl.minimum(carry + b, 0.))
            else:  # exp(B_end - B_t) = exp(carry + b_L - b_t), carry = the later chunks' decay
                w = exp_ftz(tl.minimum(carry + b_last - b, 0.))
            acc += _outer(b_a, b_x, w, F32, PREC)
            carry += b_last
        else:
            acc += tl.dot(tl.trans(b_a), b_x, input_precision=PREC)
    tl.store(_slot(slot, i_nh, j, SM1, K, V, offs_k, offs_v), acc, mask=hmask)
    if i_v == 0:
        dp = dec + (i_nh.to(tl.int64) * SM1 + j) * K + offs_k
        tl.store(dp, tl.zeros([BK], dtype=tl.float32) + tl.sum(carry, axis=0), mask=kmask)


@triton.jit
def seg_combine_kernel(slot, dec, init, cu, T, SC, SM1,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr,
                       VARLEN: tl.constexpr):
    """grid (cdiv(K, BK) * cdiv(V, BV), N * H): chains the segments' partial states in place, elementwise.
    Forward: carry = h0; slot j <- exp(dec_j) carry + local_j = the state at the start of segment j+1.
    Backward (REVERSE): carry = d(final state); for j from the last down, slot j <- exp(dec_j) carry + local_j
    = the gradient of the state at the end of segment j."""
    NV = tl.cdiv(V, BV)
    i_k = tl.program_id(0) // NV
    i_v = tl.program_id(0) % NV
    i_nh = tl.program_id(1)
    _, bos, L, offs_k, offs_v, kmask, vmask, _, hp, hmask = walk_program(
        i_k, i_v, i_nh, None, cu, T, H, K, V, BK, BV, True, True, VARLEN)
    _, _, n_seg, _ = segment_chunks(0, L, SC, BT)
    carry = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        carry += tl.load(init + hp, mask=hmask, other=0.).to(tl.float32)
    for jj in range(0, n_seg - 1):
        if REVERSE:
            j = n_seg - 2 - jj
        else:
            j = jj
        p = _slot(slot, i_nh, j, SM1, K, V, offs_k, offs_v)
        d = tl.load(dec + (i_nh.to(tl.int64) * SM1 + j) * K + offs_k, mask=kmask, other=0.)
        carry = exp_ftz(d)[:, None] * carry + tl.load(p, mask=hmask, other=0.)
        tl.store(p, carry, mask=hmask)


# ----------------------------------------------------------------------------------------------------
# the walks
# ----------------------------------------------------------------------------------------------------

@triton.jit
def fwd_scan_kernel(q, k, v, g, log_lam, A, o, h0, ht, Hs, cu, T, SC, SM1,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_H0: tl.constexpr,
                    VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(V, BV), N * H, segments); BK >= K holds every key column. Segment s > 0 starts from
    slot s-1 of Hs (the split layout's chained states); the sequence's last segment writes the final state.
    GATED: g holds the chunk-local cumulative log-decay, A the intra-chunk part of o (A v, fp32)."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_s = tl.program_id(2)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = walk_program(
        0, i_v, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    c0, c1, _, last = segment_chunks(i_s, L, SC, BT)
    offs_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h += tl.load(h0 + hp, mask=mask_and(hmask, i_s == 0), other=0.).to(tl.float32)
    h += tl.load(_slot(Hs, i_nh, i_s - 1, SM1, K, V, offs_k, offs_v), mask=mask_and(hmask, i_s > 0), other=0.)
    for c in range(c0, c1):
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, c, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # A: here the intra-chunk part A v itself, fp32, formed for every chunk in parallel
            b_o = _load_rows(A, bos, rows, rmask, i_h, H, V, offs_v, vmask)
            b_o += dot32(b_q.to(tl.float32) * exp_ftz(b), h, PREC)
        else:
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, False)
            b_o = tl.dot(b_A.to(dt), b_v, input_precision=PREC)
            if HAS_DECAY:
                b_o += tl.dot((b_q * exp_ftz(b)).to(dt), h.to(dt), input_precision=PREC)
            else:
                b_o += tl.dot(b_q, h.to(dt), input_precision=PREC)
        h = _step(h, b_k, b_v, exp_ftz(tl.minimum(b_last - b, 0.)), b_last, False, GATED or HAS_DECAY, PREC)
        _store_rows(o, b_o, bos, rows, rmask, i_h, H, V, offs_v, vmask)
    tl.store(ht + hp, h, mask=mask_and(hmask, last))


@triton.jit
def dq_scan_kernel(k, v, g, log_lam, do, dq, h0, Hs, anc, cu, T, SC, SM1, AC,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_H0: tl.constexpr,
                   ANCHOR: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """grid (cdiv(K, BK), N * H, segments); BV >= V. dq = (do h^T) * exp(b) + intra: (do v^T * D) k formed
    here when scalar, read from dq when gated. Segment s > 0 starts from the forward's chained state.
    ANCHOR (GLA): also stores the state before every AC-th chunk into `anc` (see `anchor_block`), one
    side of d log_f's anchors (`gla_dg_kernel`)."""
    i_k = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_s = tl.program_id(2)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = walk_program(
        i_k, 0, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    c0, c1, _, _ = segment_chunks(i_s, L, SC, BT)
    offs_t = tl.arange(0, BT)
    dt = k.dtype.element_ty
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h += tl.load(h0 + hp, mask=mask_and(hmask, i_s == 0), other=0.).to(tl.float32)
    h += tl.load(_slot(Hs, i_nh, i_s - 1, SM1, K, V, offs_k, offs_v), mask=mask_and(hmask, i_s > 0), other=0.)
    for c in range(c0, c1):
        if ANCHOR:
            if (c % AC == 0) & (c > 0):
                tl.store(anchor_block(anc, bos, c, AC, i_h, H, K, V, offs_k, offs_v, BT), h, mask=hmask)
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, c, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # GLA: the state kept to fp32 precision: d log_f is a cancelling sum of q dq - k dk
            b_dq = dot_exact(b_do, tl.trans(h), None, SPLIT, PREC) * exp_ftz(b)
            kw = tl.trans(b_k.to(tl.float32) * exp_ftz(tl.minimum(b_last - b, 0.)))
            h = dot_exact_rhs(kw, b_v, h * exp_ftz(tl.trans(b_last)), SPLIT, PREC)
        else:
            b_dq = tl.dot(b_do, tl.trans(h.to(dt)), input_precision=PREC)
            if HAS_DECAY:
                b_dq = b_dq * exp_ftz(b)
            h = _step(h, b_k, b_v, exp_ftz(tl.minimum(b_last - b, 0.)), b_last, False, HAS_DECAY, PREC)
        if GATED:  # onto the intra-chunk part, already in dq (ops.triton_gla_intra)
            b_dq += _load_rows(dq, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        else:
            b_dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, False)
            b_dq += tl.dot(b_dA.to(dt), b_k, input_precision=PREC)
        _store_rows(dq, b_dq, bos, rows, rmask, i_h, H, K, offs_k, kmask)


@triton.jit
def dk_scan_kernel(q, v, g, log_lam, do, dk, dht, dh0, Es, anc, cu, T, SC, SM1, AC,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   STORE_DH0: tl.constexpr, ANCHOR: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                   SPLIT: tl.constexpr):
    """grid (cdiv(K, BK), N * H, segments); BV >= V; walks backward. dk = (v dh^T) * exp(b_L - b) + intra:
    (do v^T * D)^T q formed here when scalar, read from dk when gated. The sequence's last segment starts
    from d(final state), the others from slot s of Es (the chained state gradients); segment 0 writes
    d(initial state). ANCHOR (GLA): also stores dh at the boundary before every AC-th chunk into `anc`,
    the other side of d log_f's anchors (`gla_dg_kernel`)."""
    i_k = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_s = tl.program_id(2)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = walk_program(
        i_k, 0, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    c0, c1, _, last = segment_chunks(i_s, L, SC, BT)
    offs_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    dh = _dh_start(dht, Es, hp, hmask, last, c0, c1, i_nh, i_s, SM1, K, V, offs_k, offs_v, BK, BV, HAS_DHT)
    for cc in range(0, tl.maximum(c1 - c0, 0)):
        c = c1 - 1 - cc
        if ANCHOR:  # dh here: the gradient of the state at chunk c's end
            if ((c + 1) % AC == 0) & ((c + 1) * BT < L):
                tl.store(anchor_block(anc, bos, c + 1, AC, i_h, H, K, V, offs_k, offs_v, BT), dh, mask=hmask)
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_v = _load_rows(v, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, c, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # see the dq walk
            b_dk = dot_exact(b_v, tl.trans(dh), None, SPLIT, PREC) * exp_ftz(tl.minimum(b_last - b, 0.))
            qw = tl.trans(b_q.to(tl.float32) * exp_ftz(b))
            dh = dot_exact_rhs(qw, b_do, dh * exp_ftz(tl.trans(b_last)), SPLIT, PREC)
        else:
            b_dk = tl.dot(b_v, tl.trans(dh.to(dt)), input_precision=PREC)
            if HAS_DECAY:
                b_dk = b_dk * exp_ftz(tl.minimum(b_last - b, 0.))
            dh = _step(dh, b_q, b_do, exp_ftz(b), b_last, False, HAS_DECAY, PREC)
        if GATED:  # as dq
            b_dk += _load_rows(dk, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        else:
            # (do v^T * D)^T = (v do^T) * D^T
            b_dAt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, True)
            b_dk += tl.dot(b_dAt.to(dt), b_q, input_precision=PREC)
        _store_rows(dk, b_dk, bos, rows, rmask, i_h, H, K, offs_k, kmask)
    if STORE_DH0:
        tl.store(dh0 + hp, dh, mask=mask_and(hmask, i_s == 0))


@triton.jit
def dv_scan_kernel(q, k, g, log_lam, A, do, dv, dht, Es, cu, T, SC, SM1,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATED: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr):
    """grid (cdiv(V, BV), N * H, segments); BK >= K; walks backward. dv = A^T do + (k * exp(b_L - b)) dh.
    Starts as the dk walk. GATED: A holds A^T do itself (fp32, formed in parallel over chunks)."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_s = tl.program_id(2)
    i_h, bos, L, offs_k, offs_v, kmask, vmask, ll, hp, hmask = walk_program(
        0, i_v, i_nh, log_lam, cu, T, H, K, V, BK, BV, GATED, HAS_DECAY, VARLEN)
    c0, c1, _, last = segment_chunks(i_s, L, SC, BT)
    offs_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    dh = _dh_start(dht, Es, hp, hmask, last, c0, c1, i_nh, i_s, SM1, K, V, offs_k, offs_v, BK, BV, HAS_DHT)
    for cc in range(0, tl.maximum(c1 - c0, 0)):
        c = c1 - 1 - cc
        rows, rmask, n_valid = _chunk_rows(c, offs_t, L, BT)
        b_q = _load_rows(q, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_k = _load_rows(k, bos, rows, rmask, i_h, H, K, offs_k, kmask)
        b_do = _load_rows(do, bos, rows, rmask, i_h, H, V, offs_v, vmask)
        b, b_last = _decay_rows(g, ll, bos, c, rows, rmask, i_h, H, K, offs_k, kmask, n_valid,
                                GATED, HAS_DECAY, BT)
        if GATED:  # A: here the intra-chunk part A^T do itself (fp32, formed in parallel); fp32 operands
            b_dv = _load_rows(A, bos, rows, rmask, i_h, H, V, offs_v, vmask)
            b_dv += dot32(b_k.to(tl.float32) * exp_ftz(tl.minimum(b_last - b, 0.)), dh, PREC)
        else:
            b_At = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * _scalar_mask(ll, BT, HAS_DECAY, True)
            b_dv = tl.dot(b_At.to(dt), b_do, input_precision=PREC)
            if HAS_DECAY:
                b_dv += tl.dot((b_k * exp_ftz(tl.minimum(b_last - b, 0.))).to(dt), dh.to(dt), input_precision=PREC)
            else:
                b_dv += tl.dot(b_k, dh.to(dt), input_precision=PREC)
        dh = _step(dh, b_q, b_do, exp_ftz(b), b_last, False, GATED or HAS_DECAY, PREC)
        _store_rows(dv, b_dv, bos, rows, rmask, i_h, H, V, offs_v, vmask)


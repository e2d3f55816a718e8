"""cosFormer2's feature map phi(silu(x)) for q and k in one Triton kernel, forward and backward.

phi(z)_t = [z cos(t theta), z sin(t theta)] per head. Inductor's code for the plain ops evaluates a cosine
for every output element: 4 per (token, channel) and sequence (q and k, the cos and the sin half), and the
angle in float64 each time. Here a program owns a tile of tokens x channels of one head, evaluates the
angles, their cosine and sine once, and applies them to q and k of every sequence of the batch: the
trigonometry is amortised over 2 B tensors and the kernel is bound by memory (read x, write 2 x). The
backward does the same for dx and adds dtheta per tile into an fp32 partial buffer (one row per token
block), summed by torch: deterministic, no atomics.

Angles: t theta is formed in float64 and reduced modulo 2 pi there, then rounded once to fp32, so cos and
sin see an argument in [-pi, pi] with an error of about 1e-7 rad at any position (t theta reaches 8192 rad
at 8K tokens and 65536 at 64K; rounding it to fp32 before the reduction would cost up to 4e-3 rad there).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton_launch import launch, on_input_device

# (tokens per program, largest channel block, warps) of the forward and the backward kernel
FWD_LAUNCH = (8, 128, 4)
BWD_LAUNCH = (8, 64, 2)


def channel_block(e: int, most: int) -> int:
    """Channels per program: the largest power of two up to `most` that divides the head width e, so that
    a tile never crosses a head and its loads and stores stay contiguous."""
    return math.gcd(e, most)


@triton.jit
def _tile(pos, theta, T, E: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """A program's tile, BT tokens x BC channels of one head: the tokens, the channels' columns in x
    [.., H e] and in the output [.., H, 2e] (its cos half), the token mask, and cos, sin of t theta (fp32,
    the angle reduced in float64) with the positions as fp32."""
    h = tl.program_id(1) // (E // BC)
    j = (tl.program_id(1) % (E // BC)) * BC + tl.arange(0, BC)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    p = tl.load(pos + t, mask=t < T, other=0).to(tl.float64)
    th = tl.load(theta + h * E + j).to(tl.float64)
    ang = p[:, None] * th[None, :]
    # 2 pi as two parts that fp32 holds exactly (Triton types a Python float literal as fp32): the
    # reduction is then exact to ~1e-14 rad per turn
    n = tl.floor(ang * 0.15915494309189535 + 0.5)
    red = (ang - n * 6.2831854820251465 - n * -1.7484555314695172e-07).to(tl.float32)
    return t, h * E + j, h * (2 * E) + j, (t < T)[:, None], tl.cos(red), tl.sin(red), p.to(tl.float32)


@triton.jit
def _fwd_one(x, o, rows, in_col, out_col, m, c, s, E: tl.constexpr, D: tl.constexpr):
    xv = tl.load(x + rows[:, None] * D + in_col[None, :], mask=m, other=0.).to(tl.float32)
    z = xv * tl.sigmoid(xv)
    base = o + rows[:, None] * (2 * D) + out_col[None, :]
    tl.store(base, (z * c).to(o.dtype.element_ty), mask=m)
    tl.store(base + E, (z * s).to(o.dtype.element_ty), mask=m)


@triton.jit
def silu_lrpe_fwd_kernel(q, k, theta, pos, qo, ko, B, T, E: tl.constexpr, D: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr):
    t, in_col, out_col, m, c, s, _ = _tile(pos, theta, T, E, BT, BC)
    for b in range(B):
        rows = (b * T + t).to(tl.int64)
        _fwd_one(q, qo, rows, in_col, out_col, m, c, s, E, D)
        _fwd_one(k, ko, rows, in_col, out_col, m, c, s, E, D)


@triton.jit
def _bwd_one(x, g, dx, rows, in_col, out_col, m, c, s, E: tl.constexpr, D: tl.constexpr):
    """Writes dx for one tile and returns its dtheta contribution per token, divided by the position."""
    xv = tl.load(x + rows[:, None] * D + in_col[None, :], mask=m, other=0.).to(tl.float32)
    sig = tl.sigmoid(xv)
    z = xv * sig
    base = g + rows[:, None] * (2 * D) + out_col[None, :]
    gc = tl.load(base, mask=m, other=0.).to(tl.float32)
    gs = tl.load(base + E, mask=m, other=0.).to(tl.float32)
    dz = gc * c + gs * s
    tl.store(dx + rows[:, None] * D + in_col[None, :], (dz * sig * (1. + xv * (1. - sig))).to(dx.dtype.element_ty),
             mask=m)
    return z * (gs * c - gc * s)


@triton.jit
def silu_lrpe_bwd_kernel(q, k, theta, pos, gq, gk, dq, dk, dtheta_part, B, T, E: tl.constexpr, D: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr):
    t, in_col, out_col, m, c, s, pf = _tile(pos, theta, T, E, BT, BC)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for b in range(B):
        rows = (b * T + t).to(tl.int64)
        acc += _bwd_one(q, gq, dq, rows, in_col, out_col, m, c, s, E, D)
        acc += _bwd_one(k, gk, dk, rows, in_col, out_col, m, c, s, E, D)
    tl.store(dtheta_part + tl.program_id(0).to(tl.int64) * D + in_col, tl.sum(pf[:, None] * acc, axis=0))


def _grid(T: int, H: int, e: int, bt: int, bc: int) -> tuple[int, int]:
    return triton.cdiv(T, bt), H * (e // bc)


# Custom ops with registered autograd, as the other kernels: one opaque node under torch.compile (Inductor
# cannot fuse a Triton kernel of ours, and has nothing to fuse here: the op reads the projections' outputs
# and writes what the linear-attention op reads).

@torch.library.custom_op("linscale::silu_lrpe_fwd", mutates_args=())
@on_input_device
def _silu_lrpe_fwd(q: Tensor, k: Tensor, theta: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    B, T, D = q.shape
    H, e = theta.shape
    q, k = q.contiguous(), k.contiguous()
    qo = q.new_empty(B, T, H, 2 * e)
    ko = k.new_empty(B, T, H, 2 * e)
    bt, bc, warps = FWD_LAUNCH
    bc = channel_block(e, bc)
    launch(silu_lrpe_fwd_kernel, _grid(T, H, e, bt, bc), q, k, theta.contiguous(), pos.contiguous(), qo, ko, B, T,
           E=e, D=D, BT=bt, BC=bc, num_warps=warps)
    return qo, ko


@_silu_lrpe_fwd.register_fake
def _(q, k, theta, pos):
    B, T, _ = q.shape
    H, e = theta.shape
    return q.new_empty(B, T, H, 2 * e), k.new_empty(B, T, H, 2 * e)


@torch.library.custom_op("linscale::silu_lrpe_bwd", mutates_args=())
@on_input_device
def _silu_lrpe_bwd(q: Tensor, k: Tensor, theta: Tensor, pos: Tensor, gq: Tensor, gk: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    B, T, D = q.shape
    H, e = theta.shape
    q, k = q.contiguous(), k.contiguous()
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    bt, bc, warps = BWD_LAUNCH
    bc = channel_block(e, bc)
    grid = _grid(T, H, e, bt, bc)
    part = torch.empty(grid[0], D, dtype=torch.float32, device=q.device)
    launch(silu_lrpe_bwd_kernel, grid, q, k, theta.contiguous(), pos.contiguous(), gq.contiguous(),
           gk.contiguous(), dq, dk, part, B, T, E=e, D=D, BT=bt, BC=bc, num_warps=warps)
    return dq, dk, part.sum(0).view(H, e)


@_silu_lrpe_bwd.register_fake
def _(q, k, theta, pos, gq, gk):
    return q.new_empty(q.shape), k.new_empty(k.shape), theta.new_empty(theta.shape, dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    q, k, theta, pos = inputs
    ctx.save_for_backward(q, k, theta, pos)


def _backward(ctx, gq, gk):
    q, k, theta, pos = ctx.saved_tensors
    shape = (*q.shape[:2], *theta.shape[:1], 2 * theta.shape[1])
    gq = q.new_zeros(shape) if gq is None else gq  # an output that took no part in the loss
    gk = k.new_zeros(shape) if gk is None else gk
    dq, dk, dtheta = _silu_lrpe_bwd(q, k, theta, pos, gq, gk)
    return dq, dk, dtheta.to(theta.dtype), None


torch.library.register_autograd("linscale::silu_lrpe_fwd", _backward, setup_context=_setup)


def silu_lrpe_triton(q: Tensor, k: Tensor, theta: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [B, T, H e]; theta [H, e]; positions [T] (integers) -> phi(silu(q)), phi(silu(k)) [B, T, H, 2e]."""
    return _silu_lrpe_fwd(q, k, theta, positions)

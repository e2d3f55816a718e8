"""cosFormer2's feature map for queries and keys: LRPE (cosine) of silu'd projections.

    phi(z)_t = [z cos(t theta), z sin(t theta)] per head,  z = silu(x),

so phi(q_t) . phi(k_s) = sum_j q_j k_j cos((t - s) theta_j): only relative positions count.

`silu_lrpe` with impl 'auto' (the default) runs the fused Triton kernel (`ops.triton_lrpe`) on CUDA, eager
or compiled, and the plain-PyTorch twin `silu_lrpe_reference` elsewhere (CPU, no Triton, float64, or an
ops impl that names a reference). Both compute in fp32 (float64 for float64 inputs) and return the
inputs' dtype; tests/test_kernels_lrpe.py checks the kernel against the float64 twin.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ops.checks import check_triton_device
from ops.config import triton_or_reference
from ops.optional import HAVE_TRITON

if HAVE_TRITON:  # Triton is optional; a broken kernel module must still fail loudly
    from ops.triton_lrpe import silu_lrpe_triton
else:
    silu_lrpe_triton = None


def lrpe_impl(x: Tensor, impl: str | None = None) -> str:
    """The implementation `silu_lrpe` runs for x: 'triton' or 'reference' (see the module docstring)."""
    return triton_or_reference("silu_lrpe", silu_lrpe_triton is not None,
                               x.is_cuda and silu_lrpe_triton is not None and x.dtype != torch.float64, impl)


def _check(q: Tensor, k: Tensor, theta: Tensor, positions: Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"silu_lrpe: q and k must both be [batch, tokens, heads * head_dim], got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if theta.dim() != 2 or theta.shape[0] * theta.shape[1] != q.shape[-1]:
        raise ValueError(f"silu_lrpe: theta must be [heads, head_dim] with heads * head_dim = {q.shape[-1]} "
                         f"(q's last dim), got {tuple(theta.shape)}")
    if positions.shape != (q.shape[1],) or positions.is_floating_point():
        raise ValueError(f"silu_lrpe: positions must be [tokens] = [{q.shape[1]}] integers, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if not (q.is_floating_point() and k.is_floating_point() and theta.is_floating_point()):
        raise ValueError(f"silu_lrpe: q, k and theta must be floating point, got {q.dtype}, {k.dtype}, "
                         f"{theta.dtype}")
    # the kernel reads every operand on q's device (torch.arange(T) without a device is on the CPU)
    for name, x in (("k", k), ("theta", theta), ("positions", positions)):
        if x.device != q.device:
            raise ValueError(f"silu_lrpe: {name} is on {x.device}, q on {q.device}; move it there "
                             f"(e.g. torch.arange(T, device=q.device) for the positions)")


def silu_lrpe(q: Tensor, k: Tensor, theta: Tensor, positions: Tensor, *, impl: str | None = None
              ) -> tuple[Tensor, Tensor]:
    """phi(silu(q)) and phi(silu(k)), heads split.

    Args:
        q, k: [B, T, H * e], the query and key projections before the activation.
        theta: [H, e], the angles (a learned parameter; its gradient is fp32-accumulated).
        positions: [T], the tokens' absolute positions (integers; a segment of a longer sequence starts
            where the segment starts).
        impl: None (the process default), 'auto', 'triton', or 'reference' (or another reference name:
            the plain-PyTorch twin).
    Returns:
        two [B, T, H, 2e] tensors in q's dtype: [z cos(t theta), z sin(t theta)] per head."""
    _check(q, k, theta, positions)
    if lrpe_impl(q, impl) == "triton":
        check_triton_device("silu_lrpe", q, "reference")
        return silu_lrpe_triton(q, k, theta, positions)
    return silu_lrpe_reference(q, k, theta, positions)


def silu_lrpe_reference(q: Tensor, k: Tensor, theta: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The plain-PyTorch twin (autograd derives its backward). sin(x) is written as cos(x - pi/2): one
    cosine per output element and no concatenation, which a compiler would evaluate both halves for. The
    angles t theta are formed in float64, reduced modulo 2 pi there (as the kernel does), and rounded once
    to the compute precision."""
    heads = theta.shape
    return (lrpe_reference(F.silu(q).unflatten(-1, heads), theta, positions),
            lrpe_reference(F.silu(k).unflatten(-1, heads), theta, positions))


def lrpe_reference(z: Tensor, theta: Tensor, positions: Tensor) -> Tensor:
    """LRPE alone: z [..., T, H, e] -> [..., T, H, 2e] = [z cos(t theta), z sin(t theta)], computed in fp32
    (float64 for a float64 z) and returned in z's dtype. The angle t theta reaches 1e4-1e6 rad at long
    positions: it is reduced to [-pi, pi] in float64 before the one rounding to fp32, so its error stays
    ~1e-7 rad at any position (rounded unreduced it would be t theta * 6e-8: 4e-3 rad at 64K tokens), and
    the output does not depend on where a sequence starts (decoding at an offset, a sequence-parallel
    segment)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    phase = torch.tensor([0.0, math.pi / 2], device=z.device, dtype=torch.float64)
    ang = positions.to(torch.float64)[:, None, None] * theta.to(torch.float64)
    # round() passes no gradient, so d ang / d theta stays t
    ang = ang - (2 * math.pi) * torch.round(ang * (0.5 / math.pi))
    ang = ang[:, :, None, :] - phase[:, None]
    return (z.to(acc)[..., None, :] * ang.to(acc).cos()).flatten(-2).to(z.dtype)

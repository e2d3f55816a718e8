"""Fused RMSNorm / SRMSNorm (weightless) forward and backward in Triton, one program per row block.

Statistics in fp32; the forward saves only the per-row 1/rms (4 bytes a row), the backward recomputes
x_hat. The weight gradient is reduced per program into an fp32 partial buffer, then summed by torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton_launch import on_input_device

ROWS = 16  # rows per program in the backward (amortises the weight-gradient partials)


@triton.jit
def _rms_fwd_kernel(x, w, y, rstd, n_rows, D: tl.constexpr, eps, BD: tl.constexpr, HAS_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < D
    xr = tl.load(x + row * D + cols, mask=m, other=0.).to(tl.float32)
    r = 1. / tl.sqrt(tl.sum(xr * xr, axis=0) / D + eps)
    out = xr * r
    if HAS_W:
        out = out * tl.load(w + cols, mask=m, other=0.).to(tl.float32)
    tl.store(y + row * D + cols, out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + row, r)


@triton.jit
def _rms_bwd_kernel(x, w, dy, rstd, dx, dw_part, n_rows, D: tl.constexpr, BD: tl.constexpr,
                    ROWS: tl.constexpr, HAS_W: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    m = cols < D
    wr = tl.load(w + cols, mask=m, other=0.).to(tl.float32) if HAS_W else 1.
    acc = tl.zeros([BD], dtype=tl.float32)
    for i in range(0, ROWS):
        row = pid.to(tl.int64) * ROWS + i
        mm = m & ((row + cols * 0) < n_rows)
        xr = tl.load(x + row * D + cols, mask=mm, other=0.).to(tl.float32)
        g = tl.load(dy + row * D + cols, mask=mm, other=0.).to(tl.float32)
        r = tl.load(rstd + row + cols * 0, mask=mm, other=0.)  # the row's 1/rms, broadcast
        xh = xr * r
        if HAS_W:
            acc += g * xh
        gw = g * wr
        out = r * (gw - xh * (tl.sum(gw * xh, axis=0) / D))
        tl.store(dx + row * D + cols, out.to(dx.dtype.element_ty), mask=mm)
    if HAS_W:
        tl.store(dw_part + pid.to(tl.int64) * D + cols, acc, mask=m)


# A torch.library custom op with registered autograd, like the linear-attention ops: one opaque node
# under torch.compile, the same code in eager mode.

@torch.library.custom_op("linscale::rms_norm_fwd", mutates_args=())
@on_input_device
def _rms_fwd(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """y (x's shape and dtype) and the fp32 1/rms of each row."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    # the kernels read the gains at unit stride: a strided view (w[::2]) would be read as its base
    weight = weight.contiguous() if weight is not None else None
    n, D = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    BD = triton.next_power_of_2(D)
    _rms_fwd_kernel[(n,)](x2, weight if weight is not None else x2, y, rstd, n, D, eps, BD=BD,
                          HAS_W=weight is not None, num_warps=4 if BD <= 2048 else 8)
    return y.view(x.shape), rstd


@_rms_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)


@torch.library.custom_op("linscale::rms_norm_bwd", mutates_args=())
@on_input_device
def _rms_bwd(x: Tensor, weight: Tensor | None, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """dx, and dw (fp32; empty without a weight)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous() if weight is not None else None
    n, D = x2.shape
    dy2 = dy.reshape(n, D).contiguous()
    dx = torch.empty_like(x2)
    n_prog = triton.cdiv(n, ROWS)
    dw_part = torch.empty(n_prog, D, dtype=torch.float32, device=x2.device) if weight is not None else None
    BD = triton.next_power_of_2(D)
    _rms_bwd_kernel[(n_prog,)](x2, weight if weight is not None else x2, dy2, rstd, dx,
                               dw_part if dw_part is not None else rstd, n, D, BD=BD, ROWS=ROWS,
                               HAS_W=weight is not None, num_warps=4 if BD <= 2048 else 8)
    dw = dw_part.sum(0) if dw_part is not None else x.new_empty(0, dtype=torch.float32)
    return dx.view(x.shape), dw


@_rms_bwd.register_fake
def _(x, weight, rstd, dy):
    return x.new_empty(x.shape), x.new_empty((x.shape[-1],) if weight is not None else (0,), dtype=torch.float32)


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_bwd(x, weight, rstd, dy)
    return dx, None if weight is None else dw.to(weight.dtype), None


torch.library.register_autograd("linscale::rms_norm_fwd", _rms_backward, setup_context=_rms_setup)


def rms_norm_triton(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    return _rms_fwd(x, weight, eps)[0]

"""RMSNorm (with a learned gain) and SRMSNorm (weightless), computed in fp32 and cast back.

`rms_norm` with impl 'auto' (the default) picks per call:
- eager on CUDA with Triton: the fused Triton kernel (`ops.triton_norm`, one opaque custom op);
- inside torch.compile: the plain-PyTorch twin `rms_norm_reference`, which Inductor fuses with its
  neighbours (the residual add before it, the bf16 cast of its output for the next matmul, the
  gradient's sum after it), so that a compiled block does not pay a separate pass over the fp32
  residual stream for each norm;
- elsewhere (CPU, no Triton, or an ops impl that names a reference, 'chunked' / 'recurrent'): the twin.
impl 'triton' forces the kernel, compiled or not. Both paths compute the same function in fp32 and
return x's dtype (tests/test_kernels_norm.py checks both against a float64 reference)."""
from __future__ import annotations

import torch
from torch import Tensor

from ops.checks import check_triton_device
from ops.config import triton_or_reference
from ops.optional import HAVE_TRITON

if HAVE_TRITON:  # Triton is optional; a broken kernel module must still fail loudly
    from ops.triton_norm import rms_norm_triton
else:
    rms_norm_triton = None


def _on_triton_device(x: Tensor) -> bool:
    """Whether 'auto' may run the Triton kernel on x's device."""
    return x.is_cuda and rms_norm_triton is not None


def norm_impl(x: Tensor, impl: str | None = None) -> str:
    """The implementation `rms_norm` runs for x: 'triton' or 'reference' (see the module docstring)."""
    return triton_or_reference("rms_norm", rms_norm_triton is not None,
                               _on_triton_device(x) and not torch.compiler.is_compiling(), impl)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, impl: str | None = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) [* weight] over the last dim; weight None is SRMSNorm.

    Args:
        x: [..., D], any float dtype; statistics are taken in fp32.
        weight: [D] gain, or None.
        eps: added to the mean square.
        impl: None (the process default), 'auto', 'triton', or a reference name.
    Returns:
        x's shape and dtype."""
    _check(x, weight)
    if norm_impl(x, impl) == "triton":
        check_triton_device("rms_norm", x, "reference")
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def _check(x: Tensor, weight: Tensor | None) -> None:
    # the kernel reads D gains from `weight` whatever its shape: a shorter one would be read past its end
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"rms_norm: `x` must be a floating tensor [..., D], got {got}")
    if weight is None:
        return
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (x.shape[-1],):
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"rms_norm: `weight` must be [D] = [{x.shape[-1]}] (x's last dim) or None, got {got}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: `weight` is on {weight.device}, `x` on {x.device}")


def rms_norm_reference(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """The plain-PyTorch twin (a float64 x is computed in float64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)

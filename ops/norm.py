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
    if norm_impl(x, impl) == "triton":
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """The plain-PyTorch twin (a float64 x is computed in float64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)

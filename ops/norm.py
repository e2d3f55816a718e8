"""RMSNorm (with a learned gain) and SRMSNorm (weightless), computed in fp32 and cast back.

`rms_norm` runs the fused Triton kernel (`ops.triton_norm`) on CUDA when Triton imports, and the
plain-PyTorch twin `rms_norm_reference` elsewhere or when the ops impl (`ops.config.OpsConfig.impl`)
names a reference one ('chunked', 'recurrent')."""
from __future__ import annotations

import torch
from torch import Tensor

from ops.config import get_config
from ops.optional import HAVE_TRITON

if HAVE_TRITON:  # Triton is optional; a broken kernel module must still fail loudly
    from ops.triton_norm import rms_norm_triton
else:
    rms_norm_triton = None


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, impl: str | None = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) [* weight] over the last dim; weight None is SRMSNorm.
    impl: None (the process default), 'auto' (Triton on CUDA), 'triton', or a reference name."""
    name = impl or get_config().impl
    if name == "triton" or (name == "auto" and x.is_cuda and rms_norm_triton is not None):
        if rms_norm_triton is None:
            raise ValueError("rms_norm: impl='triton' needs Triton installed")
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """The plain-PyTorch twin."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)

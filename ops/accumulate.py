"""A product added into an fp32 buffer by the matmul itself.

`out += a @ b` with low-precision operands and an fp32 `out`: on CUDA one cuBLAS call whose epilogue reads
`out` and writes the fp32 sum (`torch.addmm(..., out_dtype=torch.float32)`), instead of the product's
low-precision write, its fp32 cast and a separate add, three passes over `out`'s size. The sum is also
the more accurate one: the product is not rounded to bf16 before it is added. Elsewhere (CPU, fp32 or
fp64 operands) the operands are cast to `out`'s dtype and added by `addmm_`.
"""
from __future__ import annotations

import torch
from torch import Tensor

_LOW = (torch.bfloat16, torch.float16)


def _fp32_epilogue(a: Tensor, b: Tensor, dtype: torch.dtype) -> bool:
    """Whether cuBLAS can give a @ b in `dtype` from its epilogue: CUDA, low-precision operands, fp32 out."""
    return a.is_cuda and a.dtype in _LOW and b.dtype == a.dtype and dtype == torch.float32


def add_product_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """out += a @ b in place, in out's dtype; returns out.

    Args:
        out: [m, n] accumulator (fp32 for the fused CUDA path; any float dtype otherwise).
        a: [m, k]; b: [k, n], of one dtype.
    Returns:
        `out`.
    """
    if _fp32_epilogue(a, b, out.dtype):
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    return out.addmm_(a.to(out.dtype), b.to(out.dtype))


def product(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a @ b as a new tensor of `dtype`; from low-precision operands on CUDA straight from the matmul's
    fp32 epilogue (no low-precision product to cast)."""
    if _fp32_epilogue(a, b, dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(dtype) @ b.to(dtype)

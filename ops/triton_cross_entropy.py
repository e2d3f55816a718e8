"""Triton kernel of the fused loss: the softmax pass over one chunk of logits rows.

For each row of a [R, V] logits chunk: log-sum-exp (online, in fp32), the target's logit, and, when asked,
the gradient of the mean loss with respect to the logits, written over the logits in place:
    dlogits = (softmax(logits) - onehot(target)) * scale,  scale = 1/n_valid (0 for an ignored row)
Row offsets are computed in int64, so a chunk may hold any number of elements (a chunk of 32768 rows x
100,280 columns is 3.3e9 elements, past int32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _ce_rows_kernel(logits, stride_row, targets, lse_out, target_logit_out, scale, V, ignore_index,
                    BV: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    t = tl.load(targets + row)
    valid = t != ignore_index
    t_safe = tl.where(valid, t, 0)
    # pass 1: per-lane running max and sum of exponentials, combined once at the end
    m_lane = tl.full([BV], float("-inf"), tl.float32)
    s_lane = tl.zeros([BV], dtype=tl.float32)
    for start in range(0, V, BV):
        cols = start + tl.arange(0, BV)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, x)
        # a lane that has seen only -inf (padding) keeps m = -inf; shifting by 0 there avoids inf - inf
        shift = tl.where(m_new == float("-inf"), 0., m_new)
        s_lane = s_lane * tl.exp(m_lane - shift) + tl.exp(x - shift)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    lse = m + tl.log(tl.sum(s_lane * tl.exp(m_lane - m), axis=0))
    tl.store(lse_out + row, lse)
    tl.store(target_logit_out + row, tl.load(base + t_safe).to(tl.float32))
    if WRITE_GRAD:
        sc = tl.where(valid, tl.load(scale), 0.)
        for start in range(0, V, BV):
            cols = start + tl.arange(0, BV)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == t_safe, 1., 0.)
            tl.store(base + cols, (g * sc).to(logits.dtype.element_ty), mask=mask)


def ce_rows_triton(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int,
                   write_grad: bool) -> tuple[Tensor, Tensor]:
    """lse [R] and target logit [R] (fp32) of a [R, V] chunk (unit stride along V); with `write_grad`
    the chunk is overwritten with the loss gradient (scale: a one-element fp32 tensor, 1/n_valid)."""
    R, V = logits.shape
    lse = torch.empty(R, dtype=torch.float32, device=logits.device)
    tgt = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R:
        _ce_rows_kernel[(R,)](logits, logits.stride(0), targets, lse, tgt, scale, V, ignore_index,
                              BV=4096, WRITE_GRAD=write_grad, num_warps=8)
    return lse, tgt

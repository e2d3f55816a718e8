"""Weight gradients accumulated by the matmul that makes them (one process, no DeepSpeed).

Under bf16 autocast on fp32 weights, each projection's weight gradient is a bf16 product, cast to fp32 by
the backward of the weight's cast, then added into `.grad` by autograd's eager accumulation: three passes
over every weight for every micro-batch after the first (the product's bf16 write, the cast, the fp32 add),
each a memory-bound kernel of its own. Here the block's bias-free projections compute their weight gradient
as one product that adds into an fp32 buffer (`main_grad`) in its epilogue: `main_grad += dY^T X`, with
fp32 output from bf16 operands (cuBLAS), as Megatron-LM's gradient-accumulation fusion does. It is also
the more accurate sum: each micro-batch's gradient is no longer rounded to bf16 before it is added.

Autograd hands these weights no gradient (their `.grad` stays None through the backward). The train
module exposes the buffers as `.grad` before clipping and the optimizer step (`expose`), and zeroes them
after it (`reset`). DDP and DeepSpeed reduce gradients in hooks on autograd's accumulation, which these
weights no longer reach: the fusion is for the one-process engine only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@torch.library.custom_op("linscale::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: Tensor, grad_out: Tensor, x: Tensor) -> None:
    """main_grad [out, in] += grad_out[..., out]^T x[..., in], summed over every leading position."""
    g = grad_out.reshape(-1, grad_out.shape[-1]).t()
    a = x.reshape(-1, x.shape[-1])
    if main_grad.is_cuda and g.dtype in (torch.bfloat16, torch.float16) and main_grad.dtype == torch.float32:
        torch.addmm(main_grad, g, a, out_dtype=torch.float32, out=main_grad)  # fp32 epilogue, in place
    else:
        main_grad.addmm_(g.to(main_grad.dtype), a.to(main_grad.dtype))


@accumulate_weight_grad.register_fake
def _(main_grad: Tensor, grad_out: Tensor, x: Tensor) -> None:
    return None


class _Linear(torch.autograd.Function):
    """y = x W^T in the autocast dtype (or x's); the backward gives dx and adds dW into main_grad."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, main_grad: Tensor) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xc, wc = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, wc, main_grad)
        ctx.x_dtype = x.dtype
        return F.linear(xc, wc)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        xc, wc, main_grad = ctx.saved_tensors
        grad_out = grad_out.to(wc.dtype)
        accumulate_weight_grad(main_grad, grad_out, xc)
        return (grad_out @ wc).to(ctx.x_dtype), None, None


class AccumulatingLinear(nn.Linear):
    """nn.Linear (no bias) whose weight gradient is added into `self.main_grad` by its own product.
    Made from an nn.Linear in place by `fuse`: the same parameters, the same state_dict."""
    main_grad: Tensor

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)
        return _Linear.apply(x, self.weight, self.main_grad)


def fuse(model: nn.Module) -> list[tuple[nn.Parameter, Tensor]]:
    """Turn the bias-free nn.Linear modules of `model.blocks` into AccumulatingLinear, each with a zeroed
    `main_grad` buffer of its weight's dtype (fp32 weights under autocast; not in the state_dict). Call
    before compiling. Returns (weight, main_grad) of each, the weights whose gradients now live in the
    buffers (empty for a model without blocks)."""
    pairs = []
    for block in getattr(model, "blocks", []):
        for m in block.modules():
            if type(m) is nn.Linear and m.bias is None and m.weight.requires_grad:
                m.__class__ = AccumulatingLinear
                m.register_buffer("main_grad", torch.zeros_like(m.weight), persistent=False)
                pairs.append((m.weight, m.main_grad))
    return pairs


def expose(pairs: list[tuple[nn.Parameter, Tensor]]) -> None:
    """The buffers as the weights' `.grad`, for clipping and the optimizer step."""
    for p, g in pairs:
        p.grad = g


@torch.no_grad()
def reset(pairs: list[tuple[nn.Parameter, Tensor]]) -> None:
    """Zero the buffers for the next step (the optimizer's zero_grad only drops `.grad`)."""
    if pairs:
        torch._foreach_zero_([g for _, g in pairs])

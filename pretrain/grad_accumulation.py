"""Weight gradients accumulated by the matmul that makes them (one process, no DeepSpeed).

Under bf16 autocast on fp32 weights, each projection's weight gradient is a bf16 product, cast to fp32 by
the backward of the weight's cast, then added into `.grad` by autograd's eager accumulation: three passes
over every weight for every micro-batch after the first (the product's bf16 write, the cast, the fp32 add),
each a memory-bound kernel of its own. Here the block's bias-free projections compute their weight gradient
as one product that adds into an fp32 buffer (`main_grad`) in its epilogue: `main_grad += dY^T X`, with
fp32 output from bf16 operands (cuBLAS), as Megatron-LM's gradient-accumulation fusion does. It is also
the more accurate sum: each micro-batch's gradient is no longer rounded to bf16 before it is added.

The tied embedding and LM head ([V, d], 154M parameters at 1B) get a buffer too: the embedding's backward
adds its rows into it, and the fused loss adds the head's gradient into it in its backward
(`ops.linear_cross_entropy(weight_grad_into=...)`). Autograd's path writes a dense [V, d] embedding
gradient, scales the head's, sums the two, then adds the sum into `.grad`: about 5 GB of memory traffic a
micro-batch at 1B, against one pass over [V, d] here.

Autograd hands these weights no gradient (their `.grad` stays None through the backward). The train
module exposes the buffers as `.grad` before clipping and the optimizer step (`expose`), and zeroes them
after it (`reset`). DDP and DeepSpeed reduce gradients in hooks on autograd's accumulation, which these
weights no longer reach: the fusion is for the one-process engine only.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ops.accumulate import add_product_


def fusion_wanted(setting: str, world_size: int, accumulation: int) -> bool:
    """Whether `--grad-accum-fusion setting` fuses the weight-gradient accumulation of a run with
    `world_size` processes and `accumulation` micro-batches a step. 'auto': one process (DDP and DeepSpeed
    reduce in autograd's hooks) taking more than one micro-batch a step. With one micro-batch there is
    nothing to accumulate, so nothing to save, and the buffers would cost memory: they hold the blocks'
    fp32 gradients through the whole step, where autograd makes each `.grad` only as the backward reaches
    its weight, after it has freed the activations above it. The peak, at the start of the backward, then
    holds 4 bytes a block parameter more: 3.4 GiB at 1B (measured on an H100 at 1 x 65536 tokens, every
    architecture), enough to run out of memory with `--activation-checkpointing auto`, whose estimate
    counts the gradients as autograd makes them. 'off': never."""
    if setting not in ("auto", "off"):
        raise ValueError(f"grad_accum_fusion {setting!r}: choose auto or off")
    return setting == "auto" and world_size == 1 and accumulation > 1


@torch.library.custom_op("linscale::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: Tensor, grad_out: Tensor, x: Tensor) -> None:
    """main_grad [out, in] += grad_out[..., out]^T x[..., in], summed over every leading position."""
    add_product_(main_grad, grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


@accumulate_weight_grad.register_fake
def _(main_grad: Tensor, grad_out: Tensor, x: Tensor) -> None:
    return None


class _Linear(torch.autograd.Function):
    """y = x W^T in the autocast dtype (or x's); the backward gives dx and adds dW into main_grad."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, main_grad: Tensor, weight_cast: Tensor | None) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xc = x.to(dtype)
        wc = weight_cast if weight_cast is not None and weight_cast.dtype == dtype else weight.to(dtype)
        ctx.save_for_backward(xc, wc)
        # not saved: another use of the weight whose backward runs first (two forwards, one backward) adds into it
        ctx.main_grad = main_grad
        ctx.x_dtype = x.dtype
        return F.linear(xc, wc)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        xc, wc = ctx.saved_tensors
        grad_out = grad_out.to(wc.dtype)
        accumulate_weight_grad(ctx.main_grad, grad_out, xc)
        return (grad_out @ wc).to(ctx.x_dtype), None, None, None


class AccumulatingLinear(nn.Linear):
    """nn.Linear (no bias) whose weight gradient is added into `self.main_grad` by its own product.
    Made from an nn.Linear in place by `fuse`: the same parameters, the same state_dict. Inside
    `cast_weights_once`, `weight_cast` holds the weight in the autocast dtype, made once for all the
    step's micro-batches; outside it is None and each call casts the weight.

    `recomputed` (kept by `models.lm.Block.set_recompute`): the projection lies in the part of a block that
    activation checkpointing recomputes. It then runs as a plain nn.Linear, because inside a compiled
    checkpointed block the Function's saved input and weight would be kept instead of recomputed, and the
    block would keep most of its activations (docs/training.md, "Weight gradients accumulated by their own
    matmul"). Autograd hands its weight the gradient: into the buffer in place once `expose` has set the
    buffer as `.grad` (the train module's step does so before its micro-batches), else `expose` adds it in."""
    main_grad: Tensor
    weight_cast: Tensor | None
    recomputed: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if self.recomputed or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)
        return _Linear.apply(x, self.weight, self.main_grad, self.weight_cast)


@contextlib.contextmanager
def cast_weights_once(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Within: every fused projection's weight cast to `dtype` once, the copy used by every micro-batch's
    forward and backward; dropped on exit. Autocast would cast the fp32 weight again in each micro-batch:
    a memory-bound pass over every block weight (6 bytes a parameter) per micro-batch after the first. The
    weights must not change inside (the train module's step changes them after its micro-batches). Only
    the projections that keep their activations take part: their forward saves the cast weights for the
    backward anyway, so the step's peak memory is unchanged; a recomputed one (`AccumulatingLinear.recomputed`)
    drops them after its forward and keeps casting its own. `dtype` None: nothing is cast (fp32 training)."""
    mods = [] if dtype is None else [m for m in model.modules() if isinstance(m, AccumulatingLinear) and not m.recomputed]
    with torch.no_grad():
        for m in mods:
            m.weight_cast = m.weight.to(dtype)
    try:
        yield
    finally:
        for m in mods:
            m.weight_cast = None


class _Embedding(torch.autograd.Function):
    """Row lookup whose backward adds the gradient rows into main_grad (`index_put_` with accumulation:
    sorted by id on CUDA, so the sum is deterministic) instead of building a dense [V, d] gradient."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, main_grad: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.main_grad = main_grad  # not saved: the tied head's backward adds into it first
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ids, = ctx.saved_tensors
        main_grad = ctx.main_grad
        main_grad.index_put_((ids.reshape(-1),), grad_out.reshape(-1, grad_out.shape[-1]).to(main_grad.dtype),
                             accumulate=True)
        return None, None, None


class AccumulatingEmbedding(nn.Embedding):
    """nn.Embedding (no padding row, no max_norm) whose weight gradient is added into `self.main_grad`.
    The tied LM head adds its part into the same buffer (models.lm passes it to the fused loss as
    `weight_grad_into`), so the tied weight's two gradients are never summed in a [V, d] tensor of their
    own nor added into `.grad`: one pass over [V, d] a micro-batch instead of five."""
    main_grad: Tensor

    def forward(self, ids: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(ids)
        return _Embedding.apply(ids, self.weight, self.main_grad)


def _fusable_embedding(m: nn.Module) -> bool:
    return (type(m) is nn.Embedding and m.weight.requires_grad and m.padding_idx is None and m.max_norm is None
            and not m.sparse)


def fuse(model: nn.Module) -> list[tuple[nn.Parameter, Tensor]]:
    """Turn the bias-free nn.Linear modules of `model.blocks` into AccumulatingLinear, and the model's
    `embed` (the tied embedding and LM head) into AccumulatingEmbedding, each with a zeroed `main_grad`
    buffer of its weight's dtype (fp32 weights under autocast; not in the state_dict). Modules fused
    already (a second train module over the same model) are taken as they are, their buffers zeroed. Call
    before compiling. Returns (weight, main_grad) of each, the weights whose gradients now live in the
    buffers (empty for a model without blocks)."""
    pairs = []
    blocks = getattr(model, "blocks", [])
    for block in blocks:
        for m in block.modules():
            if type(m) is nn.Linear and m.bias is None and m.weight.requires_grad:
                m.__class__ = AccumulatingLinear
                m.register_buffer("main_grad", torch.zeros_like(m.weight), persistent=False)
                m.register_buffer("weight_cast", None, persistent=False)
            if type(m) is AccumulatingLinear:
                pairs.append((m.weight, m.main_grad.zero_()))
        if hasattr(block, "set_recompute"):  # the block tells its new projections which of them it recomputes
            block.set_recompute(block.recompute)
    embed = getattr(model, "embed", None)
    if len(blocks) and _fusable_embedding(embed):
        embed.__class__ = AccumulatingEmbedding
        embed.register_buffer("main_grad", torch.zeros_like(embed.weight), persistent=False)
    if type(embed) is AccumulatingEmbedding:
        pairs.append((embed.weight, embed.main_grad.zero_()))
    return pairs


def unfuse(model: nn.Module) -> None:
    """Undo `fuse`: plain nn.Linear and nn.Embedding again, without buffers, so that autograd hands their
    weights their gradients (a model fused by an earlier train module, trained now without the fusion)."""
    for m in model.modules():
        if type(m) in (AccumulatingLinear, AccumulatingEmbedding):
            m.__class__ = nn.Linear if type(m) is AccumulatingLinear else nn.Embedding
            for name in ("main_grad", "weight_cast"):
                m._buffers.pop(name, None)
            m.__dict__.pop("recomputed", None)


@torch.no_grad()
def expose(pairs: list[tuple[nn.Parameter, Tensor]]) -> None:
    """The buffers as the weights' `.grad`, for clipping and the optimizer step (a weight frozen since gets
    none). A gradient that autograd did hand a fused weight into a `.grad` of its own (a path around the
    fused modules, such as the tied weight used as a plain head by `LanguageModel.logits`) is added in, not
    dropped. The train module calls it before the micro-batches too: autograd then adds what it hands a
    fused weight (a projection that activation checkpointing recomputes, `AccumulatingLinear.recomputed`)
    into the buffer in place, where a `.grad` of its own would hold 4 more bytes a parameter through the
    backward."""
    for p, g in pairs:
        if not p.requires_grad:  # frozen after fusing: no gradient, so the optimizer leaves it alone
            continue
        if p.grad is not None and p.grad is not g:
            g.add_(p.grad)
        p.grad = g


@torch.no_grad()
def reset(pairs: list[tuple[nn.Parameter, Tensor]]) -> None:
    """Zero the buffers for the next step (the optimizer's zero_grad only drops `.grad`)."""
    if pairs:
        torch._foreach_zero_([g for _, g in pairs])

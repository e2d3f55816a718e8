"""Cross-entropy fused with the LM head, chunked over tokens.

With v = 100,280 the logits of one 8192-token sequence are 3.3 GB in fp32; this op never holds more than
`chunk_size` rows of them. The gradient is computed in the forward pass, chunk by chunk, while each
chunk's logits are at hand (the loss is the last node of the graph, so its gradient is known up to the
scalar that reaches the backward): per chunk one head matmul for the logits, one softmax pass that turns
them into their gradient in place (`ops.triton_cross_entropy` on CUDA, its plain-PyTorch twin
`_ce_rows_torch` elsewhere), and the two matmuls of the gradients. The backward only scales the stored
gradients. Three head matmuls instead of the four of a recomputing backward.

The op is a `torch.library` custom op, so torch.compile keeps it as one opaque node. Traced as plain
tensor code instead, Inductor fused the unrolled chunk loop into one kernel over all N rows that gathered
each row's target logit from its chunk at the address `V*row - V*chunk_start + target`, with int32
indexing because every single buffer is below 2^31 elements. Once a chunk starts past row 2^31 / V
(21,414 at v = 100,280; with 4096-row chunks: from N > 24,576 tokens) the address overflows: an illegal
memory access on the GPU (and the fused kernel held every chunk's logits alive at once).
docs/training.md has the details and a plain-PyTorch reproducer.
"""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ops.accumulate import add_product_, product
from ops.optional import HAVE_TRITON

if HAVE_TRITON:  # Triton is optional; a broken kernel module must still fail loudly
    from ops.triton_cross_entropy import ce_rows_triton
else:
    ce_rows_triton = None


def _ce_rows_torch(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int,
                   write_grad: bool) -> tuple[Tensor, Tensor]:
    """The plain-PyTorch twin of `ops.triton_cross_entropy.ce_rows_triton` (same contract)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    bad = valid & ((targets < 0) | (targets >= logits.shape[1]))
    safe_t = torch.where(valid & ~bad, targets, torch.zeros_like(targets))
    tgt = torch.where(bad, float("nan"), x.gather(1, safe_t[:, None]).squeeze(1))
    if write_grad:
        g = (x - lse[:, None]).exp_()
        g.scatter_add_(1, safe_t[:, None], -torch.ones_like(g[:, :1]))
        g.mul_(torch.where(bad, float("nan"), valid.to(acc) * scale.to(acc))[:, None])
        logits.copy_(g)
    return lse, tgt


def _rows_impl(logits: Tensor):
    if logits.is_cuda and ce_rows_triton is not None and logits.dtype != torch.float64:
        return ce_rows_triton
    return _ce_rows_torch


@torch.library.custom_op("linscale::linear_cross_entropy", mutates_args=())
def _linear_ce(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_size: int,
               compute_dtype: torch.dtype, with_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Mean loss (0-dim, fp32; fp64 for fp64 compute), and with `with_grad` its gradients with respect to
    `hidden` (hidden's dtype) and `weight` (weight's dtype; summed over chunks in fp32); empty otherwise."""
    with torch.autocast(hidden.device.type, enabled=False):  # every cast here is explicit
        n = hidden.shape[0]
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
        w = weight.to(compute_dtype)
        valid = targets != ignore_index
        n_valid = valid.sum().clamp(min=1)
        scale = (1.0 / n_valid.to(acc)).reshape(1)
        rows = _rows_impl(hidden)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else hidden.new_empty(0)
        grad_w = None
        for s in range(0, n, chunk_size):
            h = hidden[s:s + chunk_size].to(compute_dtype)
            logits = h @ w.t()                       # [rows, V] in the compute dtype
            t = targets[s:s + chunk_size]
            lse, tgt = rows(logits, t, scale, ignore_index, with_grad)
            loss += ((lse - tgt) * valid[s:s + chunk_size]).sum(dtype=acc)
            if with_grad:                            # `logits` now holds d(mean loss)/d(logits)
                grad_hidden[s:s + chunk_size] = logits @ w
                # summed in `acc` by the matmul's epilogue: no [V, d] product to round, cast and add
                grad_w = product(logits.t(), h, acc) if grad_w is None else add_product_(grad_w, logits.t(), h)
        loss = loss / n_valid.to(acc)
        if not with_grad:
            return loss, grad_hidden, weight.new_empty(0)
        if grad_w is None:  # no rows
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    return loss, grad_hidden, grad_w.to(weight.dtype)


@_linear_ce.register_fake
def _(hidden, weight, targets, ignore_index, chunk_size, compute_dtype, with_grad):
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    return (hidden.new_empty((), dtype=acc), hidden.new_empty(hidden.shape if with_grad else (0,)),
            weight.new_empty(weight.shape if with_grad else (0,)))


def _linear_ce_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], output[2])


def _linear_ce_backward(ctx, grad_loss, _grad_h, _grad_w):
    grad_hidden, grad_w = ctx.saved_tensors
    if grad_hidden.numel() == 0 and grad_w.numel() == 0:
        raise RuntimeError("linear_cross_entropy: the forward ran without gradients (no input required "
                           "grad, or grad mode was off), so there are none to return")
    return (grad_hidden * grad_loss.to(grad_hidden.dtype), grad_w * grad_loss.to(grad_w.dtype),
            None, None, None, None, None)


torch.library.register_autograd("linscale::linear_cross_entropy", _linear_ce_backward,
                                setup_context=_linear_ce_setup)


class _LinearCEInto(torch.autograd.Function):
    """The op with the weight's gradient added into a buffer in the backward, `into += grad_loss * dW`
    (one pass over [V, d]), instead of being handed to autograd: no scaled copy, no sum with the tied
    embedding's own gradient, no accumulation into `.grad` (pretrain/grad_accumulation.py). The weight
    gets no gradient from autograd."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, compute_dtype, into):
        loss, grad_hidden, grad_w = _linear_ce(hidden, weight, targets, ignore_index, chunk_size, compute_dtype,
                                               True)
        ctx.save_for_backward(grad_hidden, grad_w)
        ctx.into = into
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_w = ctx.saved_tensors
        ctx.into.addcmul_(grad_w, grad_loss.to(grad_w.dtype))
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                         chunk_size: int = 4096, weight_grad_into: Tensor | None = None) -> Tensor:
    """Mean cross-entropy of softmax(hidden @ weight^T) against targets, ignoring `ignore_index` (the
    mean over the other rows; 0 when every row is ignored).

    Args:
        hidden: [N, d] final hidden states.
        weight: [V, d] the (tied) output embedding.
        targets: [N] integer class ids in [0, V), or ignore_index. An id out of that range makes the loss
            and the gradients NaN on every device (a check would read the ids back, a host sync on a GPU;
            models.lm and the trainer check the ids on the host before they reach the op).
        chunk_size: rows of logits held at a time ([chunk_size, V] in the compute dtype).
        weight_grad_into: a buffer of weight's shape (fp32 under autocast, else weight's dtype) into which
            the backward adds the weight's gradient, in place of handing it to autograd (the weight then
            gets none); for a caller that accumulates the gradient itself. Used only when the weight's
            gradient is computed (grad mode on, the weight requiring grad).
    Returns:
        the 0-dim loss (fp32; fp64 for an fp64 `hidden`). Under autocast the head matmuls run in the
        autocast dtype, as `hidden @ weight.t()` would; the gradients reach `hidden` and `weight` in
        their own dtypes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: `hidden` [N, d] and `weight` [V, d] must share d, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"linear_cross_entropy: `hidden` and `weight` must be floating point, got "
                         f"{hidden.dtype} and {weight.dtype}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: `targets` must be [N={hidden.shape[0]}], got {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        # .long() would truncate class ids given as floats without a word
        raise ValueError(f"linear_cross_entropy: `targets` must be integer class ids, got {targets.dtype}")
    if not (targets.device == weight.device == hidden.device):
        raise ValueError(f"linear_cross_entropy: `hidden`, `weight` and `targets` must be on one device, got "
                         f"{hidden.device}, {weight.device} and {targets.device}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive integer, got {chunk_size!r}")
    chunk_size = int(chunk_size)
    dev = hidden.device.type
    compute_dtype = hidden.dtype
    if hidden.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        compute_dtype = torch.get_autocast_dtype(dev)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if with_grad and weight_grad_into is not None and weight.requires_grad:
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
        if (weight_grad_into.shape != weight.shape or weight_grad_into.device != weight.device
                or weight_grad_into.dtype not in (acc, weight.dtype)):
            kinds = str(acc) if acc == weight.dtype else f"{acc} or {weight.dtype}"
            raise ValueError(f"linear_cross_entropy: `weight_grad_into` must be a {kinds} buffer "
                             f"of weight's shape {tuple(weight.shape)} on {weight.device}, got "
                             f"{weight_grad_into.dtype} {tuple(weight_grad_into.shape)} on {weight_grad_into.device}")
        return _LinearCEInto.apply(hidden, weight, targets.long(), ignore_index, chunk_size, compute_dtype,
                                   weight_grad_into)
    return _linear_ce(hidden, weight, targets.long(), ignore_index, chunk_size, compute_dtype, with_grad)[0]

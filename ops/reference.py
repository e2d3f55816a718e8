"""Plain-PyTorch twins of the linear-attention kernels.

Two forms of each op, with the semantics of docs/kernels.md and the `[batch, time, heads, dim]` layout:

* ``*_recurrent``: the step-by-step recurrence, literally the equation. It is the ground truth the tests
  run in float64, and the decoding path for one new token.
* ``*_chunked``: the chunked algorithm (masked products inside a chunk, a state recurrence between
  chunks). It is what the Triton kernels implement, and the fallback on CPU.

States are ``[B, H, Dk, Dv]`` and are kept in float32 (or float64 when the inputs are float64) whatever
the input dtype. Variable-length input (``cu_seqlens``, batch 1) is handled by ``run_varlen``: each
document starts from its own initial state, so nothing leaks across a document boundary.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def state_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# Gated ops: a log forget gate below this counts as this value. exp(-104) rounds to 0 in fp32 (below half
# the smallest subnormal), so such a gate forgets the whole state either way (in float64 the floor moves
# results by less than e^-104, relative). Without it the chunked forms' cumulative sums b break: log f =
# -inf (a hard reset) or two gates near -3.4e38 make b -inf, and b_i - b_j NaN; a gate of -1e4 leaves b so
# large that the differences b_i - b_j of the milder gates after it keep only fp32's absolute resolution
# there (1e-3). The step-by-step recurrence needs no floor (exp(-inf) = 0).
LOG_F_FLOOR = -104.0


# ----------------------------------------------------------------------------------------------------
# lightning attention: scalar decay per head
# ----------------------------------------------------------------------------------------------------

def log_decay(decay: Tensor, dtype: torch.dtype) -> Tensor:
    """log(decay) in `dtype`, the log taken at the decay's own precision (fp32 at least) before rounding:
    TNL's last layers have decays within 1e-7 of 1, which fp32 cannot hold (its spacing below 1 is 6e-8),
    while their logs (the rates) it holds to 6e-8 of themselves. A float64 decay keeps them exact."""
    return decay.detach().to(torch.promote_types(decay.dtype, torch.float32)).log().to(dtype)


def lightning_attn_recurrent(q: Tensor, k: Tensor, v: Tensor, decay: Tensor | None,
                             initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """o_t = S_t^T q_t with S_t = decay * S_{t-1} + k_t v_t^T."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    sd = state_dtype(q)
    S = q.new_zeros(B, H, Dk, Dv, dtype=sd) if initial_state is None else initial_state.to(sd).clone()
    lam = None if decay is None else decay.to(sd).view(1, H, 1, 1)
    out = []
    for t in range(T):
        kt, vt, qt = k[:, t].to(sd), v[:, t].to(sd), q[:, t].to(sd)
        if lam is not None:
            S = S * lam
        S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", qt, S))
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, Dv, dtype=sd)
    return o.to(v.dtype), S


def lightning_attn_chunked(q: Tensor, k: Tensor, v: Tensor, decay: Tensor | None,
                           initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked form. Decay powers are exp(n * log(decay)) with n >= 0 only, so nothing overflows;
    strong decays underflow harmlessly to 0."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    sd = state_dtype(q)
    S = q.new_zeros(B, H, Dk, Dv, dtype=sd) if initial_state is None else initial_state.to(sd).clone()
    log_lam = torch.zeros(H, dtype=sd, device=q.device) if decay is None else log_decay(decay, sd)
    C = chunk_size
    idx = torch.arange(C, device=q.device, dtype=sd)
    # rel[i, j] = i - j for i >= j; masked entries get -inf so exp() gives exactly 0
    rel = idx.view(C, 1) - idx.view(1, C)
    causal = rel >= 0
    outs = []
    for start in range(0, T, C):
        n = min(C, T - start)
        qc = q[:, start:start + n].to(sd).transpose(1, 2)  # [B,H,n,Dk]
        kc = k[:, start:start + n].to(sd).transpose(1, 2)
        vc = v[:, start:start + n].to(sd).transpose(1, 2)
        r = rel[:n, :n]
        lr = log_lam.view(H, 1, 1) * r.clamp(min=0)
        D = torch.where(causal[:n, :n], lr.exp(), torch.zeros((), dtype=sd, device=q.device))  # [H,n,n]
        o = (qc @ kc.transpose(-1, -2) * D) @ vc
        q_decay = (log_lam.view(H, 1) * (idx[:n] + 1)).exp().view(1, H, n, 1)  # decay^(i+1)
        o = o + (qc * q_decay) @ S
        k_decay = (log_lam.view(H, 1) * (n - 1 - idx[:n])).exp().view(1, H, n, 1)  # decay^(n-1-j)
        S = S * (log_lam * n).exp().view(1, H, 1, 1) + (kc * k_decay).transpose(-1, -2) @ vc
        outs.append(o.transpose(1, 2))
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(B, 0, H, Dv, dtype=sd)
    return o.to(v.dtype), S


# ----------------------------------------------------------------------------------------------------
# gated linear attention: data-dependent per-key-channel decay
# ----------------------------------------------------------------------------------------------------

def gated_linear_attn_recurrent(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor,
                                initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """S_t = diag(exp(log_f_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    sd = state_dtype(q)
    S = q.new_zeros(B, H, Dk, Dv, dtype=sd) if initial_state is None else initial_state.to(sd).clone()
    out = []
    for t in range(T):
        f = log_f[:, t].to(sd).exp().unsqueeze(-1)  # [B,H,Dk,1]
        S = S * f + k[:, t].to(sd).unsqueeze(-1) * v[:, t].to(sd).unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(sd), S))
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, Dv, dtype=sd)
    return o.to(v.dtype), S


def gated_linear_attn_chunked(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor,
                              initial_state: Tensor | None = None, chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """Chunked form. Inside a chunk the pairwise weights exp(b_i - b_j) (b the inclusive cumulative
    log-decay) are formed directly, never as exp(b_i) * exp(-b_j), so gates near 0 cannot overflow.
    That costs a [n, n, Dk] tensor per chunk, hence the small default chunk. The pairs of a token with
    itself (the diagonal of A, a chunk's last key in the state) have weight exp(0) = 1 whatever the gates
    and take no part in b: through b_i - b_i their O(1) gradients would cancel in d log_f only up to
    rounding, an error far larger than d log_f itself where gates are strong (relative error 1.5 in fp32
    with log f in [-20, -19], 1.0 in float64 in [-60, -59])."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    sd = state_dtype(q)
    S = q.new_zeros(B, H, Dk, Dv, dtype=sd) if initial_state is None else initial_state.to(sd).clone()
    C = chunk_size
    below = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # pairs i > j
    outs = []
    for start in range(0, T, C):
        n = min(C, T - start)
        qc = q[:, start:start + n].to(sd).transpose(1, 2)  # [B,H,n,Dk]
        kc = k[:, start:start + n].to(sd).transpose(1, 2)
        vc = v[:, start:start + n].to(sd).transpose(1, 2)
        b = log_f[:, start:start + n].to(sd).clamp(min=LOG_F_FLOOR).transpose(1, 2).cumsum(dim=2)  # [B,H,n,Dk], <= 0
        diff = b.unsqueeze(3) - b.unsqueeze(2)  # [B,H,i,j,Dk] = b_i - b_j
        diff = diff.masked_fill(~below[:n, :n].view(1, 1, n, n, 1), float("-inf"))
        A = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, diff.exp()) + torch.diag_embed((qc * kc).sum(-1))
        o = A @ vc + (qc * b.exp()) @ S
        b_last = b[:, :, -1:, :]  # [B,H,1,Dk]
        k_decay = torch.cat([(b_last - b[:, :, :-1]).exp(), torch.ones_like(b_last)], dim=2)  # exp(b_last - b_j)
        S = S * b_last.transpose(-1, -2).exp() + (kc * k_decay).transpose(-1, -2) @ vc
        outs.append(o.transpose(1, 2))
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(B, 0, H, Dv, dtype=sd)
    return o.to(v.dtype), S


# ----------------------------------------------------------------------------------------------------
# variable-length (packed) input
# ----------------------------------------------------------------------------------------------------

def run_varlen(fn: Callable[..., tuple[Tensor, Tensor]], cu_seqlens: Tensor, q: Tensor, k: Tensor, v: Tensor,
               per_token: Tensor | None, shared: Tensor | None, initial_state: Tensor | None
               ) -> tuple[Tensor, Tensor]:
    """Run `fn` on each document of a packed batch-1 input separately. `per_token` is a [1,T,...] tensor
    sliced with the documents (log_f); `shared` is passed whole (decay). initial_state is [N,H,Dk,Dv]."""
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[i:i + 1]
        extra = shared if per_token is None else per_token[:, s:e]
        o, S = fn(q[:, s:e], k[:, s:e], v[:, s:e], extra, h0)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)

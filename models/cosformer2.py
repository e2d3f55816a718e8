"""cosFormer2 token mixer and its TPE: linear attention with no decay, made position-aware twice.

LRPE (cosine) on q and k:  phi(z)_t = [z * cos(t theta), z * sin(t theta)]  (theta learned per head)
so phi(q_t) . phi(k_s) = sum_j q_j k_j cos((t - s) theta_j), then o_t = sum_{s<=t} (phi(q_t) . phi(k_s)) v_s.
TPE, once after the embedding: a per-channel diagonal recurrence with e states per channel,
u_{t,c,j} = a_j u_{t-1,c,j} + B_{c,j} x_{t,c},  y_{t,c} = sum_j u_{t,c,j};  x <- x + y.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig
from models.layers import LowRankGate, Norm, sglu, split_heads
from models.spec import ArchSpec, ModelExtra
from ops import lightning_attn, silu_lrpe


class Tpe(ModelExtra):
    """The TPE recurrence, evaluated in parallel as a causal convolution with the kernel
    K[n, c] = sum_j B[c, j] a_j^n (by FFT in fp32, O(T log T), as Toeplitz mixers usually are; the FFT's
    rounding reaches earlier positions at the 1e-7 level, exact zero in float64); decoding carries
    u [batch, d, e] instead."""

    # a = sigmoid(w) near 1: w rounded to bf16 moves 1 - a (the memory length) by percents
    fp32_params = ("decay_logit",)

    def __init__(self, d: int, n_states: int, init_bound: float):
        super().__init__()
        self.init_bound = init_bound
        self.decay_logit = nn.Parameter(torch.empty(n_states))
        self.in_weight = nn.Parameter(torch.empty(d, n_states))
        self.init_extra()

    @torch.no_grad()
    def init_extra(self) -> None:
        # decays spread from fast (1 - a = 0.5) to slow (1 - a = 1e-3, a memory of ~1000 tokens)
        n = self.decay_logit.numel()
        one_minus_a = torch.logspace(math.log10(0.5), -3, n, device=self.decay_logit.device)
        self.decay_logit.copy_(torch.log1p(-one_minus_a) - torch.log(one_minus_a))
        self.in_weight.uniform_(-self.init_bound, self.init_bound)

    def input_delta(self, x: Tensor, state: dict | None, cu_seqlens: Tensor | None) -> Tensor:
        return self(x, state=state, cu_seqlens=cu_seqlens)

    def forward(self, x: Tensor, state: dict | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        if cu_seqlens is not None:  # packed documents (batch 1): each starts from a zero state
            bounds = cu_seqlens.tolist()
            return torch.cat([self(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
        # fp32 throughout, also under a bf16 autocast (which would cast the kernel matmul, and FFTs
        # have no bf16 kernels)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self._recurrence(x, state)

    def _recurrence(self, x: Tensor, state: dict | None) -> Tensor:
        B, T, d = x.shape
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        log_a = F.logsigmoid(self.decay_logit.to(acc))                           # [e]
        n = torch.arange(T, device=x.device, dtype=acc)
        powers = torch.exp(n[:, None] * log_a[None, :])                          # a^n, [T, e]
        w = self.in_weight.to(acc)                                               # [d, e]
        xf = x.to(acc)
        kernel = powers @ w.t()                                                  # [T, d]
        L = 2 * T
        y = torch.fft.irfft(torch.fft.rfft(xf, n=L, dim=1) * torch.fft.rfft(kernel, n=L, dim=0)[None], n=L, dim=1)[:, :T]
        if state is not None:
            u0 = state.get("u")
            if u0 is not None:  # carried states keep decaying: a^(t+1) u0
                y = y + torch.einsum("tj,bcj->btc", powers * log_a.exp(), u0)
            # u_T = a^T u0 + B * sum_s a^(T-1-s) x_s
            u = torch.einsum("bsc,sj->bcj", xf, powers.flip(0)) * w[None]
            if u0 is not None:
                u = u + u0 * torch.exp(T * log_a)[None, None, :]
            state["u"] = u
        return y.to(x.dtype)


class Cos2TokenMixer(nn.Module):
    # the angles multiply positions: theta rounded to bf16 (up to 2^-8 of itself) turns a token t positions
    # away by t times that, radians off at a thousand tokens
    fp32_params = ("theta",)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, e = cfg.d_model, cfg.head_dim
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.theta = nn.Parameter(torch.empty(cfg.n_heads, e))
        self.init_extra()
        self.gate = LowRankGate(d, cfg.gate_rank)
        self.norm = Norm(d, cfg.norm_type, cfg.norm_eps)
        self.out_proj = nn.Linear(d, d, bias=False)
        # True in a fully checkpointed block: the feature map runs as plain ops there, which the checkpoint
        # recomputes instead of keeping the kernel's inputs (models.lm.Block.set_recompute)
        self.recomputed = False

    @torch.no_grad()
    def init_extra(self) -> None:
        e = self.theta.shape[1]
        self.theta.copy_(10000.0 ** (-torch.arange(e, dtype=torch.float32, device=self.theta.device) / e))

    def forward(self, x: Tensor, state: dict | None = None, pos: int | Tensor = 0,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """`pos`: the first token's position, or the T tokens' positions (a segment of a longer sequence)."""
        t = positions(pos, x.shape[1], x.device)
        q, k = silu_lrpe(self.q_proj(x), self.k_proj(x), self.theta, t,
                         impl="reference" if self.recomputed and self.training else None)
        v = split_heads(self.v_proj(x), self.n_heads)
        h0 = None if state is None else state.get("S")
        o, S = lightning_attn(q, k, v, None, initial_state=h0, output_final_state=True,
                              cu_seqlens=cu_seqlens, check_values=False)
        if state is not None:
            state["S"] = S
        o = self.norm(o.reshape(x.shape).to(x.dtype))
        return self.out_proj(o * self.gate(x))


def positions(pos: int | Tensor, n_tokens: int, device: torch.device) -> Tensor:
    """The n tokens' absolute positions: from `pos` on, or `pos` itself where it holds them."""
    return pos.to(device) if isinstance(pos, Tensor) else torch.arange(pos, pos + n_tokens, device=device)


def paper_params(cfg: ModelConfig) -> int:
    l, d, g, t, e = cfg.n_layers, cfg.d_model, cfg.d_glu, cfg.gate_rank, cfg.head_dim
    return 4 * l * d * d + 2 * l * d * t + 3 * l * d * g + d * e


def extra_params(cfg: ModelConfig) -> int:
    return cfg.n_layers * cfg.d_model + cfg.head_dim  # LRPE angles (h*e = d per layer), TPE decays (e)


def layer_flops(cfg: ModelConfig, n: int) -> float:
    d, h, g, t, B = cfg.d_model, cfg.n_heads, cfg.d_glu, cfg.gate_rank, cfg.head_dim
    C = 8 * n * d * d + 8 * n * d * d / h + 2 * n * d * d / (B * h) + 6 * n * B * d + n * B * h + 4 * n * t * d + 2 * n * d
    return 3 * C + 18 * n * d * g + 3 * n * g


def model_flops(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    return 12 * batch * seq_len * cfg.d_model * cfg.head_dim  # the TPE


def tpe(cfg: ModelConfig) -> Tpe:
    return Tpe(cfg.d_model, cfg.head_dim, cfg.tpe_init_bound)


def tpe_sp_carry(tpe: Tpe, x: Tensor, cu_seqlens: Tensor | None, sp) -> Tensor:
    """The TPE state carried in from the ranks before a sequence-parallel segment (see
    pretrain.sequence_parallel.tpe_carry, which holds the rank exchange)."""
    from pretrain.sequence_parallel import tpe_carry  # the parallelism sits outside the model file
    return tpe_carry(tpe, x, cu_seqlens, sp)


SPEC = ArchSpec(
    name="cos2", title="cosFormer2", token_mixer=Cos2TokenMixer, channel_mixer=sglu, default_norm="srmsnorm",
    paper_params=paper_params, extra_params=extra_params, layer_flops=layer_flops, model_flops=model_flops,
    extras={"tpe": tpe}, aliases=("cosformer2",), layer_overrides={"410m": 25}, sequence_parallel=True,
    norms_per_layer=3,
    sp_positions=True, sp_carries={"tpe": tpe_sp_carry},
    act_bytes_per_d=51,
    paper_law={"L": (3.5877, -0.0756), "N_opt": (2.65e8, 0.6516), "D_opt": (4.23e10, 0.4529)},
    color="#d62728")

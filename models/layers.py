"""Building blocks shared by the four architectures: norms, channel mixers, the low-rank output gate."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig
from ops import rms_norm


class Norm(nn.Module):
    """RMSNorm with a learned gain ('rmsnorm', LLaMA) or without one ('srmsnorm', TNL's SRMSNorm)."""

    def __init__(self, dim: int, kind: str, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if kind == "rmsnorm" else None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """The channel mixers: W_down [(X W_u) * act(X W_v)]. LLaMA's SwiGLU has act = silu; the linear
    models' SGLU has no activation at all."""

    def __init__(self, d: int, g: int, activation: bool):
        super().__init__()
        self.activation = activation
        self.up_proj = nn.Linear(d, g, bias=False)
        self.gate_proj = nn.Linear(d, g, bias=False)
        self.down_proj = nn.Linear(g, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        return self.down_proj(self.up_proj(x) * (F.silu(gate) if self.activation else gate))


class LowRankGate(nn.Module):
    """sigmoid(X W_gdown W_gup) with W_gdown d x t, W_gup t x d (TNL and cos2 output gate)."""

    def __init__(self, d: int, t: int):
        super().__init__()
        self.down = nn.Linear(d, t, bias=False)
        self.up = nn.Linear(t, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.up(self.down(x)))


def swiglu(cfg: ModelConfig) -> GatedMLP:
    """LLaMA's channel mixer: W_down [(X W_u) * silu(X W_v)]."""
    return GatedMLP(cfg.d_model, cfg.d_glu, activation=True)


def sglu(cfg: ModelConfig) -> GatedMLP:
    """The linear models' channel mixer: W_down [(X W_u) * (X W_v)], no activation."""
    return GatedMLP(cfg.d_model, cfg.d_glu, activation=False)


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """[B, T, H*e] -> [B, T, H, e] (the ops' layout)."""
    return x.view(*x.shape[:-1], n_heads, x.shape[-1] // n_heads)

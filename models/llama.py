"""LLaMA token mixer: multi-head causal softmax attention with RoPE (the softmax baseline)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig
from models.layers import split_heads, swiglu
from models.spec import ArchSpec


def rope_table(max_len: int, head_dim: int, base: float, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, e/2] of the rotation angles, formed in float64 and rounded once to `dtype`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the RoPE tables for a module cast to `dtype`: float64 for a float64 model (a
    reference, exact end to end), fp32 for every other dtype (a bf16 table would round the angles)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + e/2) by position-dependent angles; x [B, T, H, e], cos/sin [T, e/2].
    Computed at the tables' precision (fp32, float64 for a float64 model), returned in x's dtype."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.max_seq_len = cfg.n_heads, cfg.max_seq_len
        self.head_dim, self.rope_base = cfg.head_dim, cfg.rope_base
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        cos, sin = rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        """Module casts (`model.to(torch.bfloat16)`, `load_pretrained(dtype=...)`, `.double()`) reach the RoPE
        tables too, which are constants, not weights: rounded to bf16, cos and sin are off by up to 2^-8 of
        themselves at every position, unlike the fp32 tables the model was trained with. After the cast the
        tables are fp32 again (float64 for a float64 model), taken from the values before the cast or
        recomputed, on the device the cast chose."""
        before = self.rope_cos.dtype, self.rope_cos, self.rope_sin
        super()._apply(fn, recurse)
        want = table_dtype(self.rope_cos.dtype)
        if self.rope_cos.dtype == before[0] == want:
            return self
        device = self.rope_cos.device
        if want == torch.float64 and before[0] != torch.float64:
            cos, sin = rope_table(self.max_seq_len, self.head_dim, self.rope_base, want)
        else:
            cos, sin = before[1], before[2]
        self.rope_cos, self.rope_sin = cos.to(device=device, dtype=want), sin.to(device=device, dtype=want)
        return self

    def forward(self, x: Tensor, state: dict | None = None, pos: int = 0, cu_seqlens: Tensor | None = None) -> Tensor:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (state reset at document starts) is for the linear models; LLaMA "
                             "runs documents packed with a plain causal mask")
        B, T, _ = x.shape
        if pos + T > self.max_seq_len:
            raise ValueError(f"llama: position {pos + T} exceeds the RoPE table (max_seq_len={self.max_seq_len}); "
                             f"training: pass --model max_seq_len={pos + T} (or model_overrides: {{max_seq_len: "
                             f"{pos + T}}} in --config); a loaded model: load_pretrained(path, max_seq_len={pos + T})")
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        q = apply_rope(split_heads(self.q_proj(x), self.n_heads), cos, sin)
        k = apply_rope(split_heads(self.k_proj(x), self.n_heads), cos, sin)
        v = split_heads(self.v_proj(x), self.n_heads)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, e] for SDPA
        mask, causal = None, True
        if state is not None:
            if "k" in state:
                k, v = _append_kv(state, k, v)
                # queries sit at the end of the key sequence: query i sees keys 0 .. pos + i
                causal = False
                if T > 1:
                    qi = torch.arange(T, device=x.device)[:, None] + pos
                    mask = torch.arange(k.shape[2], device=x.device)[None, :] <= qi
            else:
                state["k"], state["v"], state["len"] = k, v, T
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and T > 1)
        return self.out_proj(o.transpose(1, 2).reshape(B, T, -1))


def _append_kv(state: dict, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The cache's keys and values [B, H, len, e] with k, v appended. The buffers grow by doubling, so a
    generation of n tokens copies O(n) cached entries in all, where concatenating at every step copies the
    whole cache each time (O(n^2))."""
    n, t = state["len"], k.shape[2]
    if n + t > state["k"].shape[2]:
        cap = max(2 * state["k"].shape[2], n + t)
        for name in ("k", "v"):
            old = state[name]
            state[name] = old.new_empty(*old.shape[:2], cap, old.shape[3])
            state[name][:, :, :n] = old[:, :, :n]
    state["k"][:, :, n:n + t] = k
    state["v"][:, :, n:n + t] = v
    state["len"] = n + t
    return state["k"][:, :, :n + t], state["v"][:, :, :n + t]


def rebuild_rope(model: nn.Module, device) -> None:
    """The RoPE tables are not saved (recomputable, and sized by max_seq_len, which a load may override)."""
    cfg = model.config
    dtype = table_dtype(model.embed.weight.dtype)
    cos, sin = rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_base, dtype)
    cos, sin = cos.to(device), sin.to(device)
    for block in model.blocks:
        block.token_mixer.rope_cos, block.token_mixer.rope_sin = cos, sin


def check_config(cfg: ModelConfig) -> None:
    """RoPE rotates the channel pairs (i, i + e/2) of each head, so the head width must be even (an odd one
    would fail only at the first forward, in a shape mismatch inside `apply_rope`)."""
    if cfg.head_dim % 2:
        raise ValueError(f"model config: LLaMA's RoPE rotates pairs of channels, so the head width e = d/h must be "
                         f"even; d_model={cfg.d_model} / n_heads={cfg.n_heads} gives e = {cfg.head_dim}: choose "
                         f"d_model and n_heads with an even quotient (the paper's sizes have e = 128)")


def paper_params(cfg: ModelConfig) -> int:
    l, d, g = cfg.n_layers, cfg.d_model, cfg.d_glu
    return 4 * l * d * d + 3 * l * d * g


def layer_flops(cfg: ModelConfig, n: int) -> int:
    d, h, g = cfg.d_model, cfg.n_heads, cfg.d_glu
    return 24 * n * d * d + 12 * n * n * d + 9 * n * n * h + 18 * n * d * g + 3 * n * g


SPEC = ArchSpec(
    name="llama", title="LLaMA", token_mixer=LlamaAttention, channel_mixer=swiglu, default_norm="rmsnorm",
    paper_params=paper_params, layer_flops=layer_flops, context_limited=True, act_bytes_per_d=36,
    rebuild_buffers=rebuild_rope, check_config=check_config,
    paper_law={"L": (3.7087, -0.0798), "N_opt": (1.82e8, 0.7118), "D_opt": (2.56e10, 0.5102)},
    color="#1f77b4")

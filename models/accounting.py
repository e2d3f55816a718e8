"""Parameter and FLOPs accounting: the one place the paper's formulas live.

Notation as the paper: l layers, d width, h heads, e = d/h head width, g GLU width, v vocab, n sequence
length, b batch (sequences), t gate rank, B = e the block (chunk) size of the linear kernels.
FLOPs are training FLOPs per step (forward + backward, multiply-add = 2, backward = 2x forward).
"""
from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig


def paper_non_embedding_params(cfg: ModelConfig) -> int:
    """The paper's non-embedding parameter formula (norm gains and other O(d) terms left out)."""
    l, d, g, t, e = cfg.n_layers, cfg.d_model, cfg.d_glu, cfg.gate_rank, cfg.head_dim
    if cfg.arch == "llama":
        return 4 * l * d * d + 3 * l * d * g
    if cfg.arch == "tnl":
        return 4 * l * d * d + 2 * l * d * t + 3 * l * d * g
    if cfg.arch == "hgrn2":
        return 4 * l * d * d + 3 * l * d * g + l * d
    return 4 * l * d * d + 2 * l * d * t + 3 * l * d * g + d * e  # cos2


def exact_params(cfg: ModelConfig) -> dict[str, int]:
    """Every parameter the models build, by formula; tests check it against numel. The small terms the
    paper omits: RMSNorm gains (LLaMA), cos2's learned LRPE angles (h*e = d per layer) and TPE decays (e)."""
    l, d, e, v = cfg.n_layers, cfg.d_model, cfg.head_dim, cfg.vocab_size
    norm_gain = d if cfg.norm_type == "rmsnorm" else 0
    extra = (2 * l + 1) * norm_gain
    if cfg.arch == "cos2":
        extra += l * d + e
    non_emb = paper_non_embedding_params(cfg) + extra
    return {"non_embedding": non_emb, "embedding": v * d, "total": non_emb + v * d}


def _token_mixer_core(cfg: ModelConfig, n: int) -> float:
    """The paper's C for the linear models (forward FLOPs of one layer's token mixer, per sequence)."""
    d, h, t = cfg.d_model, cfg.n_heads, cfg.gate_rank
    Bk = cfg.head_dim
    if cfg.arch == "tnl":
        return 8 * n * d * d + 4 * n * d * d / h + n * d * d / (Bk * h) + 4 * n * Bk * d + n * Bk * h + 4 * n * t * d + 2 * n * d
    if cfg.arch == "hgrn2":
        return 8 * n * d * d + 4 * n * d * d / h + n * d * d / (Bk * h) + 4 * n * Bk * d + n * Bk * h + 5 * n * d
    if cfg.arch == "cos2":
        return 8 * n * d * d + 8 * n * d * d / h + 2 * n * d * d / (Bk * h) + 6 * n * Bk * d + n * Bk * h + 4 * n * t * d + 2 * n * d
    raise ValueError(f"no linear token-mixer formula for {cfg.arch}")


def flops_per_step(cfg: ModelConfig, batch: int, seq_len: int, include_embedding: bool = True) -> float:
    """Training FLOPs of one step of `batch` sequences of `seq_len` tokens, by the paper's formulas.
    `include_embedding=False` drops the 12*b*n*d*v LM-head term, as the paper's PFLOPs table does."""
    b, n = batch, seq_len
    l, d, h, g, v, e = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_glu, cfg.vocab_size, cfg.head_dim
    emb = 12 * b * n * d * v if include_embedding else 0
    if cfg.arch == "llama":
        return b * l * (24 * n * d * d + 12 * n * n * d + 9 * n * n * h + 18 * n * d * g + 3 * n * g) + emb
    body = b * l * (3 * _token_mixer_core(cfg, n) + 18 * n * d * g + 3 * n * g) + emb
    if cfg.arch == "hgrn2":
        body += 12 * d * l
    if cfg.arch == "cos2":
        body += 12 * b * n * d * e
    return float(body)


@dataclass
class ModelInfo:
    arch: str
    size: str | None
    params_non_embedding: int
    params_total: int
    params_non_embedding_paper: int
    flops_per_step: float
    flops_per_step_non_embedding: float
    flops_per_token: float
    batch: int
    seq_len: int


def model_info(cfg: ModelConfig, batch: int = 480, seq_len: int = 8192) -> ModelInfo:
    p = exact_params(cfg)
    f = flops_per_step(cfg, batch, seq_len, include_embedding=True)
    return ModelInfo(arch=cfg.arch, size=cfg.size, params_non_embedding=p["non_embedding"],
                     params_total=p["total"], params_non_embedding_paper=paper_non_embedding_params(cfg),
                     flops_per_step=f, flops_per_step_non_embedding=flops_per_step(cfg, batch, seq_len, False),
                     flops_per_token=f / (batch * seq_len), batch=batch, seq_len=seq_len)

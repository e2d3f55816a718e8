"""Parameter and FLOPs accounting: the model-wide sums around each architecture's own formulas (its
`ArchSpec`: paper_params, extra_params, layer_flops, model_flops, written next to its model code).

Notation as the paper: l layers, d width, h heads, e = d/h head width, g GLU width, v vocab, n sequence
length, b batch (sequences), t gate rank, B = e the block (chunk) size of the linear kernels.
FLOPs are training FLOPs per step (forward + backward, multiply-add = 2, backward = 2x forward).
"""
from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.registry import get_arch


def paper_non_embedding_params(cfg: ModelConfig) -> int:
    """The paper's non-embedding parameter formula (norm gains and other O(d) terms left out)."""
    return get_arch(cfg.arch).paper_params(cfg)


def exact_params(cfg: ModelConfig) -> dict[str, int]:
    """Every parameter the models build, by formula; tests check it against numel. The small terms the
    paper omits: RMSNorm gains (LLaMA by default; every architecture with `norm_type='rmsnorm'`, each
    block's `norms_per_layer` and the final norm) and each architecture's `extra_params` (cos2's learned
    LRPE angles, h*e = d per layer, and TPE decays, e)."""
    spec = get_arch(cfg.arch)
    l, d, v = cfg.n_layers, cfg.d_model, cfg.vocab_size
    norm_gain = d if cfg.norm_type == "rmsnorm" else 0
    extra = (spec.norms_per_layer * l + 1) * norm_gain + spec.extra_params(cfg)
    non_emb = paper_non_embedding_params(cfg) + extra
    return {"non_embedding": non_emb, "embedding": v * d, "total": non_emb + v * d}


def flops_per_step(cfg: ModelConfig, batch: int, seq_len: int, include_embedding: bool = True) -> float:
    """Training FLOPs of one step of `batch` sequences of `seq_len` tokens, by the paper's formulas.
    `include_embedding=False` drops the 12*b*n*d*v LM-head term, as the paper's PFLOPs table does."""
    spec = get_arch(cfg.arch)
    b, n = batch, seq_len
    emb = 12 * b * n * cfg.d_model * cfg.vocab_size if include_embedding else 0
    return b * cfg.n_layers * spec.layer_flops(cfg, n) + emb + spec.model_flops(cfg, b, n)


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
    """Parameters and FLOPs of `cfg` at `batch` sequences of `seq_len` tokens. The FLOPs are floats for
    every architecture (an all-integer formula such as LLaMA's would otherwise give an int, and a JSON
    reader one type for one architecture and another for the next)."""
    p = exact_params(cfg)
    f = float(flops_per_step(cfg, batch, seq_len, include_embedding=True))
    return ModelInfo(arch=cfg.arch, size=cfg.size, params_non_embedding=p["non_embedding"],
                     params_total=p["total"], params_non_embedding_paper=paper_non_embedding_params(cfg),
                     flops_per_step=f, flops_per_step_non_embedding=float(flops_per_step(cfg, batch, seq_len, False)),
                     flops_per_token=f / (batch * seq_len), batch=batch, seq_len=seq_len)

"""The one model config dataclass. Sizes live in `models.sizes`, architectures in `models.registry`; this
holds the shape and the choices."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

VOCAB_SIZE = 100_280  # cl100k_base has 100,277 ids; padded for tensor-core friendly shapes


def _positive(name: str, value: int) -> None:
    if int(value) <= 0:
        raise ValueError(f"model config: {name} must be a positive integer, got {value}")


@dataclass
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    d_glu: int
    vocab_size: int = VOCAB_SIZE
    gate_rank: int | None = None          # t of the output gate; None -> head width e
    max_seq_len: int = 8192               # LLaMA's RoPE table; linear models have no limit
    rope_base: float = 10000.0
    norm_type: str | None = None          # 'rmsnorm' (learned gain) | 'srmsnorm'; None -> the arch's default
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tnl_decay_schedule: str = "code"      # 'code' (authors' released code) | 'paper' (TNL paper's formula)
    tpe_init_bound: float = 1e-3          # cos2 TPE input weights B ~ U(-b, b): near zero, see docs
    size: str | None = field(default=None, compare=False)  # registry name, for logs only

    def __post_init__(self) -> None:
        from models.registry import get_arch  # the registry imports the model files, which import this one
        spec = get_arch(self.arch)
        self.arch = spec.name
        self.check_shape(self.n_layers, self.d_model, self.n_heads, self.d_glu)
        for name in ("vocab_size", "max_seq_len"):
            _positive(name, getattr(self, name))
        if self.norm_type is None:
            self.norm_type = spec.default_norm
        if self.norm_type not in ("rmsnorm", "srmsnorm"):
            raise ValueError(f"model config: norm_type {self.norm_type!r}; choose rmsnorm or srmsnorm")
        if self.tnl_decay_schedule not in ("code", "paper"):
            raise ValueError(f"model config: tnl_decay_schedule {self.tnl_decay_schedule!r}; choose code or paper")
        if self.gate_rank is None:
            self.gate_rank = self.head_dim
        _positive("gate_rank", self.gate_rank)
        spec.check_config(self)  # what this architecture alone needs (LLaMA's RoPE: an even head width)
        for name, low, closed in (("rope_base", 0.0, False), ("norm_eps", 0.0, False), ("init_std", 0.0, False),
                                  ("tpe_init_bound", 0.0, True)):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and (v >= low if closed else v > low)):
                raise ValueError(f"model config: {name} must be a finite number {'>=' if closed else '>'} {low:g}, "
                                 f"got {getattr(self, name)}")

    @staticmethod
    def check_shape(n_layers: int, d_model: int, n_heads: int, d_glu: int) -> None:
        """Raise ValueError (what is wrong) unless the shape is one every architecture can build."""
        for name, value in (("n_layers", n_layers), ("d_model", d_model), ("n_heads", n_heads), ("d_glu", d_glu)):
            _positive(name, value)
        if d_model % n_heads:
            raise ValueError(f"model config: head count n_heads={n_heads} does not divide the width "
                             f"d_model={d_model}; the head width e = d/h must be whole")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

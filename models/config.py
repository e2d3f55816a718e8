"""The one model config dataclass. Sizes live in `models.sizes`, architectures in `models.registry`; this
holds the shape and the choices."""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields

VOCAB_SIZE = 100_280  # cl100k_base has 100,277 ids; padded for tensor-core friendly shapes


def _positive(name: str, value: int) -> int:
    """`value` as a plain int, or ValueError naming the field. Sizes must be integers, not merely numbers
    int() accepts: 2.7 layers would build range(2.7) deep inside the model, True would pass as one layer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"model config: {name} must be a positive integer, got {value!r} "
                         f"({type(value).__name__}); give {name} as a whole number")
    if value <= 0:
        raise ValueError(f"model config: {name} must be a positive integer, got {value}")
    return int(value)


def _finite(name: str, value: float, low: float, closed: bool) -> float:
    """`value` as a plain float, or ValueError naming the field. A real number only: float() would pass the
    string '1e-6' (a hand-edited config.json) through to fail at the first forward, deep inside torch, and
    True as 1.0 (a norm epsilon or init std of 1, a model of another behaviour without a word)."""
    bound = f"a finite number {'>=' if closed else '>'} {low:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"model config: {name} must be {bound}, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not (math.isfinite(v) and (v >= low if closed else v > low)):
        raise ValueError(f"model config: {name} must be {bound}, got {value}")
    return v


def _head_count_fix(d_model: int, n_heads: int) -> str:
    """The nearest head counts that divide d_model and the nearest widths n_heads divides."""
    below = max(h for h in range(1, min(n_heads, d_model) + 1) if d_model % h == 0)
    above = next((h for h in range(n_heads + 1, d_model + 1) if d_model % h == 0), None)
    heads = f"n_heads={below}" + (f" or {above}" if above else "")
    lo = d_model - d_model % n_heads
    widths = (f"d_model={lo} or {lo + n_heads}" if lo else f"d_model={n_heads}")
    return f"choose {heads} for d_model={d_model}, or {widths} for n_heads={n_heads}"


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
        self.n_layers, self.d_model, self.n_heads, self.d_glu = self.check_shape(
            self.n_layers, self.d_model, self.n_heads, self.d_glu)
        for name in ("vocab_size", "max_seq_len"):
            setattr(self, name, _positive(name, getattr(self, name)))
        if self.norm_type is None:
            self.norm_type = spec.default_norm
        if self.norm_type not in ("rmsnorm", "srmsnorm"):
            raise ValueError(f"model config: norm_type {self.norm_type!r}; choose rmsnorm or srmsnorm")
        if self.tnl_decay_schedule not in ("code", "paper"):
            raise ValueError(f"model config: tnl_decay_schedule {self.tnl_decay_schedule!r}; choose code or paper")
        if self.gate_rank is None:
            self.gate_rank = self.head_dim
        self.gate_rank = _positive("gate_rank", self.gate_rank)
        spec.check_config(self)  # what this architecture alone needs (LLaMA's RoPE: an even head width)
        for name, low, closed in (("rope_base", 0.0, False), ("norm_eps", 0.0, False), ("init_std", 0.0, False),
                                  ("tpe_init_bound", 0.0, True)):
            setattr(self, name, _finite(name, getattr(self, name), low, closed))

    @staticmethod
    def check_shape(n_layers: int, d_model: int, n_heads: int, d_glu: int) -> tuple[int, int, int, int]:
        """The shape as plain ints; ValueError (what is wrong and how to fix it) unless it is one every
        architecture can build."""
        n_layers, d_model, n_heads, d_glu = (_positive(name, value) for name, value in (
            ("n_layers", n_layers), ("d_model", d_model), ("n_heads", n_heads), ("d_glu", d_glu)))
        if d_model % n_heads:
            raise ValueError(f"model config: head count n_heads={n_heads} does not divide the width "
                             f"d_model={d_model}; the head width e = d/h must be whole: "
                             f"{_head_count_fix(d_model, n_heads)}")
        return n_layers, d_model, n_heads, d_glu

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

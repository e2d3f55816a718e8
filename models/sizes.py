"""The size registry: the one copy of the paper's model shapes (its appendix table, head width 128).

1B uses h=12, g=4096: the paper prints h=16, g=5632, but its own parameter and FLOPs counts come out only
with these (see docs/architectures.md). 410M has 26 layers for LLaMA and HGRN2, 25 for TNL and cos2
(each architecture's `layer_overrides`).
`tiny` and `mini` are ours, for CPU runs, tests and small scaling sweeps. The `l<L>d<D>` sizes are ours too, for
small scaling studies on one GPU (docs/studies/): the paper's smallest size's GLU width (g = 3d) and, from
d = 128 up, its head width (e = d/h = 128), with d/l in the paper's range (39-128; 48 to 128 here). Below
d = 128 one head of width e = d is the closest the paper's proportions go (its head width would need d >= 128),
and one layer the fewest: `l1d32` has d/l = 32, under the paper's range. They reach down to the N at which the
compute-optimal size of a one-GPU study lies (docs/studies/mini_bilingual/README.md)."""
from __future__ import annotations

from models.config import ModelConfig
from models.registry import get_arch

# size -> (layers, width, heads, glu width)
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 128, 2, 384),
    "mini": (4, 256, 2, 768),
    "70m": (6, 512, 4, 1536),
    "160m": (12, 768, 6, 2048),
    "410m": (26, 1024, 8, 2816),
    "1b": (32, 1536, 12, 4096),
    "3b": (35, 2560, 20, 6912),
    "7b": (32, 4096, 32, 11008),
    "l1d32": (1, 32, 1, 96),
    "l1d48": (1, 48, 1, 144),
    "l1d64": (1, 64, 1, 192),
    "l1d96": (1, 96, 1, 288),
    "l1d128": (1, 128, 1, 384),
    "l2d128": (2, 128, 1, 384),
    "l2d256": (2, 256, 2, 768),
    "l4d256": (4, 256, 2, 768),
    "l4d384": (4, 384, 3, 1152),
}
PAPER_SIZES = ("70m", "160m", "410m", "1b", "3b", "7b")


def canonical_size(size: str) -> str:
    """The registry name of `size` (case-insensitive); a clear error for unknown names."""
    if not isinstance(size, str):
        raise ValueError(f"size must be a size name, got {size!r}; choose from {', '.join(SIZES)}")
    key = size.lower()
    if key not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    return key


def model_config(arch: str, size: str, /, **overrides) -> ModelConfig:
    """The config of `arch` at registry `size`; keyword overrides replace any ModelConfig field (a custom
    shape overrides n_layers, d_model, n_heads, d_glu and names itself with `size=`)."""
    spec = get_arch(arch)
    key = canonical_size(size)
    l, d, h, g = SIZES[key]
    l = spec.layer_overrides.get(key, l)  # e.g. 410M: 25 layers for TNL and cos2
    base = dict(arch=spec.name, n_layers=l, d_model=d, n_heads=h, d_glu=g, size=key)
    bad = set(overrides) - set(ModelConfig.__dataclass_fields__)
    if bad:
        raise ValueError(f"unknown model config field(s) {sorted(bad)}; "
                         f"known: {sorted(ModelConfig.__dataclass_fields__)}")
    if "arch" in overrides and get_arch(overrides["arch"]).name != spec.name:
        raise ValueError(f"model override arch={overrides['arch']} contradicts the architecture {spec.name}; "
                         f"choose the architecture with --arch, not with --model arch=")
    base.update(overrides)
    return ModelConfig(**base)

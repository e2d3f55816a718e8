"""Token-mixing and fused ops. Each op has a plain-PyTorch twin (`ops.reference`, `ops.norm`,
`ops.cross_entropy`); Triton kernels register themselves as the `triton` implementation."""
from ops.cross_entropy import linear_cross_entropy
from ops.linear_attention import (available_impls, gated_linear_attn, lightning_attn, register_impl,
                                  set_default_impl)
from ops.norm import rms_norm

try:  # Triton is optional: without it every op runs on its plain-PyTorch twin
    import ops.triton_linear_attn  # noqa: F401  (registers the `triton` implementation)
except ImportError:
    pass

__all__ = ["lightning_attn", "gated_linear_attn", "linear_cross_entropy", "rms_norm", "register_impl",
           "set_default_impl", "available_impls"]

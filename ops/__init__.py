"""Token-mixing and fused ops. Each op has a plain-PyTorch twin (`ops.reference`, `ops.norm`,
`ops.cross_entropy`); the Triton kernels register themselves as the `triton` implementation when Triton is
installed. Run-time options: `ops.config` (OpsConfig, set_config)."""
from ops.config import OpsConfig, get_config, set_config
from ops.cross_entropy import linear_cross_entropy
from ops.linear_attention import (available_impls, gated_linear_attn, lightning_attn, register_impl,
                                  set_default_impl)
from ops.lrpe import silu_lrpe
from ops.norm import rms_norm
from ops.optional import HAVE_TRITON

if HAVE_TRITON:  # without Triton every op runs on its plain-PyTorch twin
    import ops.triton_linear_attn  # noqa: F401  (registers the `triton` implementation)

__all__ = ["lightning_attn", "gated_linear_attn", "linear_cross_entropy", "rms_norm", "silu_lrpe",
           "register_impl", "set_default_impl", "available_impls", "OpsConfig", "get_config", "set_config", "HAVE_TRITON"]

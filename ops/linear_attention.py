"""Public linear-attention ops: argument checks, then dispatch to an implementation.

Implementations register under a name: ``recurrent`` and ``chunked`` (plain PyTorch, `ops.reference`)
are always there; ``triton`` is registered by `ops.triton_linear_attn` when Triton is installed. ``auto`` (the default of
`ops.config.OpsConfig.impl`) picks Triton on CUDA, the chunked twin elsewhere, and the recurrence for a
single decoding step.
"""
from __future__ import annotations

import warnings
from typing import Callable

from torch import Tensor

from ops import reference
from ops import sequence_parallel as _sp
from ops.checks import check_decay, check_log_f, check_qkv, check_state_and_lengths
from ops.config import get_config, set_config

# an implementation takes (q, k, v, decay_or_log_f, initial_state, cu_seqlens) -> (o, final_state)
Impl = Callable[..., tuple[Tensor, Tensor]]
_IMPLS: dict[str, dict[str, Impl]] = {"lightning_attn": {}, "gated_linear_attn": {}}


def register_impl(op: str, name: str, fn: Impl) -> None:
    _IMPLS[op][name] = fn


def available_impls(op: str) -> list[str]:
    return sorted(_IMPLS[op])


def set_default_impl(name: str) -> None:
    """Process-wide choice ('auto', 'triton', 'chunked', 'recurrent'): shorthand for
    `ops.config.set_config(impl=name)` (the `--ops-impl` run flag sets it through the run's ops config)."""
    if name not in ("auto", "recurrent", "chunked") and name not in _IMPLS["lightning_attn"]:
        raise ValueError(f"ops impl {name!r} is not available here; choose from auto, "
                         f"{', '.join(available_impls('lightning_attn'))}")
    set_config(impl=name)


def _auto_triton(op: str) -> bool:
    # `auto` takes the Triton kernels on CUDA for both ops (each passed tests/test_kernels_gpu.py);
    # OpsConfig.gla_triton=False keeps gated_linear_attn on its chunked twin
    return op == "lightning_attn" or get_config().gla_triton


# the widest heads (Dk, Dv) the Triton kernels take: measured on an H100 (fwd+bwd, bf16, with an initial
# state, against the float64 twin); wider heads ask for more than the 227 KiB of shared memory a block may
# use there (GLA at Dk = Dv = 256: 228 KiB; docs/kernels.md, Head widths)
TRITON_MAX_WIDTHS = {"lightning_attn": (256, 256), "gated_linear_attn": (512, 128)}


def triton_fits(op: str, k_width: int, v_width: int) -> bool:
    """Whether the Triton kernels take heads this wide (key width Dk, value width Dv): the walks hold a
    whole head's key or value dimension in one program's tiles (`TRITON_MAX_WIDTHS`)."""
    max_k, max_v = TRITON_MAX_WIDTHS[op]
    return k_width <= max_k and v_width <= max_v


# CUDA launches at most 65,535 programs along a grid's second and third axes; the walks put one program per
# (sequence, head) on the second: a micro-batch of many short packed documents can pass it
MAX_GRID_Y = 65_535

_WARNED: set[tuple] = set()


def _too_wide(op: str, q: Tensor, v: Tensor) -> str:
    K, V = q.shape[-1], v.shape[-1]
    limits = "; ".join(f"{name}: Dk <= {mk}, Dv <= {mv}" for name, (mk, mv) in TRITON_MAX_WIDTHS.items())
    return (f"{op}: heads of Dk = {K}, Dv = {V} are wider than the Triton kernels take ({limits}; "
            f"docs/kernels.md, Head widths). Use more, narrower heads (n_heads, so that d_model / n_heads "
            f"fits), or impl='chunked' (the PyTorch twin: runs at any width, tens of times slower)")


def _too_many_sequences(op: str, sequences: int, heads: int) -> str:
    return (f"{op}: {sequences} sequences (packed documents count one each) x {heads} heads = "
            f"{sequences * heads} programs, past CUDA's {MAX_GRID_Y} along the walks' grid axis (docs/kernels.md, "
            f"Head widths). Give fewer sequences to one call: fewer tokens per micro-batch when documents are "
            f"short, or impl='chunked' (the PyTorch twin, far slower)")


def _triton_refusal(op: str, q: Tensor, v: Tensor, sequences: int) -> tuple[tuple, str] | None:
    """Why the Triton kernels cannot take this call ((warning key, message)), or None."""
    if not triton_fits(op, q.shape[-1], v.shape[-1]):
        return (op, q.shape[-1], v.shape[-1]), _too_wide(op, q, v)
    if sequences * q.shape[2] > MAX_GRID_Y:
        return (op, "grid"), _too_many_sequences(op, sequences, q.shape[2])
    return None


def _resolve(op: str, impl: str | None, q: Tensor, v: Tensor, cu_seqlens: Tensor | None = None) -> Impl:
    name = impl or get_config().impl
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if name == "auto":
        if q.shape[1] == 1:
            name = "recurrent"
        elif q.is_cuda and "triton" in _IMPLS[op] and _auto_triton(op):
            name = "triton"
            refusal = _triton_refusal(op, q, v, sequences)
            if refusal is not None:
                name = "chunked"
                key, why = refusal
                if key not in _WARNED:
                    _WARNED.add(key)
                    warnings.warn(why + "; auto takes the chunked twin", stacklevel=3)
        else:
            name = "chunked"
    if name not in _IMPLS[op]:
        raise ValueError(f"{op}: implementation {name!r} is not available; choose from auto, "
                         f"{', '.join(available_impls(op))}")
    if name == "triton" and (refusal := _triton_refusal(op, q, v, sequences)) is not None:
        raise ValueError(refusal[1])
    return _IMPLS[op][name]


def _with_varlen(fn: Callable[..., tuple[Tensor, Tensor]], per_token: bool) -> Impl:
    """Lift a dense (q, k, v, x, h0) reference into one that also takes cu_seqlens."""
    def run(q, k, v, x, initial_state, cu_seqlens):
        if cu_seqlens is None:
            return fn(q, k, v, x, initial_state)
        return reference.run_varlen(fn, cu_seqlens, q, k, v, x if per_token else None,
                                    None if per_token else x, initial_state)
    return run


register_impl("lightning_attn", "recurrent", _with_varlen(reference.lightning_attn_recurrent, per_token=False))
register_impl("lightning_attn", "chunked", _with_varlen(reference.lightning_attn_chunked, per_token=False))
register_impl("gated_linear_attn", "recurrent", _with_varlen(reference.gated_linear_attn_recurrent, per_token=True))
register_impl("gated_linear_attn", "chunked", _with_varlen(reference.gated_linear_attn_chunked, per_token=True))


def lightning_attn(q: Tensor, k: Tensor, v: Tensor, decay: Tensor | None = None,
                   initial_state: Tensor | None = None, output_final_state: bool = False,
                   cu_seqlens: Tensor | None = None, *, impl: str | None = None,
                   check_values: bool = True) -> Tensor | tuple[Tensor, Tensor]:
    """o_t = sum_{s<=t} decay^(t-s) (q_t . k_s) v_s per head; q, k [B,T,H,Dk], v [B,T,H,Dv], decay [H]
    in (0, 1] or None (no decay). Returns o [B,T,H,Dv] (dtype of v), and the final state
    [B or N, H, Dk, Dv] in fp32 when `output_final_state`. `check_values=False` skips the checks that
    read tensor values (they synchronise a GPU); the models pass it since they build valid values."""
    check_qkv("lightning_attn", q, k, v)
    check_decay("lightning_attn", q, decay, check_values)
    check_state_and_lengths("lightning_attn", q, v, initial_state, cu_seqlens, check_values)
    fn = _resolve("lightning_attn", impl, q, v, cu_seqlens)
    o, state = _sp.run("lightning_attn", fn, q, k, v, decay, initial_state, cu_seqlens)
    return (o, state) if output_final_state else o


def gated_linear_attn(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor,
                      initial_state: Tensor | None = None, output_final_state: bool = False,
                      cu_seqlens: Tensor | None = None, *, impl: str | None = None,
                      check_values: bool = True) -> Tensor | tuple[Tensor, Tensor]:
    """S_t = diag(exp(log_f_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t; log_f [B,T,H,Dk] <= 0, -inf (a reset)
    included; below `ops.reference.LOG_F_FLOOR` (-104, where exp is 0 in fp32) it counts as that floor.
    Returns as `lightning_attn`."""
    check_qkv("gated_linear_attn", q, k, v)
    check_log_f("gated_linear_attn", q, log_f, check_values)
    check_state_and_lengths("gated_linear_attn", q, v, initial_state, cu_seqlens, check_values)
    fn = _resolve("gated_linear_attn", impl, q, v, cu_seqlens)
    o, state = _sp.run("gated_linear_attn", fn, q, k, v, log_f, initial_state, cu_seqlens)
    return (o, state) if output_final_state else o

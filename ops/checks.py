"""Argument checks shared by the public ops: each failure names the argument and what is allowed."""
from __future__ import annotations

import os

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            _fail(f"{op}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            _fail(f"{op}: `{name}` must be [batch, time, heads, dim], got shape {tuple(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            _fail(f"{op}: `{name}` has dtype {x.dtype}; use float16, bfloat16, float32 or float64")
    if q.shape != k.shape:
        _fail(f"{op}: `q` {tuple(q.shape)} and `k` {tuple(k.shape)} must have the same shape")
    if v.shape[:3] != q.shape[:3]:
        _fail(f"{op}: `v` {tuple(v.shape)} must match `q` {tuple(q.shape)} in batch, time and heads "
              f"(heads: q has {q.shape[2]}, v has {v.shape[2]})")
    if not (q.device == k.device == v.device):
        _fail(f"{op}: `q`, `k`, `v` must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"{op}: `q`, `k`, `v` must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_triton_device(op: str, x: Tensor, fallback: str) -> None:
    """A Triton kernel takes CUDA tensors (or any under TRITON_INTERPRET=1, the CPU interpreter); without
    this check a CPU tensor reaches the Triton launcher, which fails with "0 active drivers" or a pointer
    error that names neither the op nor the fix. `fallback`: the implementation to name instead."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        _fail(f"{op}: impl='triton' needs CUDA tensors, got {x.device} (or set TRITON_INTERPRET=1 for the "
              f"CPU interpreter); use impl='auto' or {fallback!r} off CUDA")


def check_state_and_lengths(op: str, q: Tensor, v: Tensor, initial_state: Tensor | None,
                            cu_seqlens: Tensor | None, check_values: bool) -> None:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    n_seq = B
    if cu_seqlens is not None:
        if B != 1:
            _fail(f"{op}: with `cu_seqlens` the input must be packed into batch 1, got batch {B}")
        if (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                or cu_seqlens.dtype not in (torch.int32, torch.int64)):
            _fail(f"{op}: `cu_seqlens` must be a 1-D int32/int64 tensor [0, ..., T] of at least 2 entries")
        if cu_seqlens.device != q.device:
            # the kernels read the lengths on the inputs' device
            _fail(f"{op}: `cu_seqlens` is on {cu_seqlens.device}, inputs on {q.device}; move it there "
                  f"(cu_seqlens.to(q.device))")
        if check_values:
            c = cu_seqlens.tolist()
            if c[0] != 0 or c[-1] != T:
                _fail(f"{op}: `cu_seqlens` must start at 0 and end at T={T}, got {c[0]} ... {c[-1]}")
            if any(b <= a for a, b in zip(c[:-1], c[1:])):
                _fail(f"{op}: `cu_seqlens` must be strictly increasing, got {c}")
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, Tensor):
            _fail(f"{op}: `initial_state` must be a torch.Tensor [sequences, heads, Dk, Dv] or None, "
                  f"got {type(initial_state).__name__}")
        want = (n_seq, H, Dk, Dv)
        if tuple(initial_state.shape) != want:
            _fail(f"{op}: `initial_state` must have shape [sequences, heads, Dk, Dv] = {list(want)}, "
                  f"got {list(initial_state.shape)}")
        if initial_state.device != q.device:
            _fail(f"{op}: `initial_state` is on {initial_state.device}, inputs on {q.device}")
        if not initial_state.is_floating_point():
            _fail(f"{op}: `initial_state` has dtype {initial_state.dtype}; use a floating dtype (states are "
                  f"kept in float32)")


def check_decay(op: str, q: Tensor, decay: Tensor | None, check_values: bool) -> None:
    if decay is None:
        return
    H = q.shape[2]
    if not isinstance(decay, Tensor) or decay.dim() != 1 or decay.numel() != H:
        shape = tuple(decay.shape) if isinstance(decay, Tensor) else type(decay).__name__
        _fail(f"{op}: `decay` must be a 1-D tensor of one value per head ({H}), got {shape}")
    if decay.device != q.device:
        _fail(f"{op}: `decay` is on {decay.device}, inputs on {q.device}")
    if not decay.is_floating_point():
        _fail(f"{op}: `decay` has dtype {decay.dtype}; use a floating dtype (values in (0, 1])")
    if check_values and not bool(((decay > 0) & (decay <= 1)).all()):
        _fail(f"{op}: `decay` must lie in (0, 1], got min {decay.min().item():.4g}, max {decay.max().item():.4g}")


def check_log_f(op: str, q: Tensor, log_f: Tensor, check_values: bool) -> None:
    if not isinstance(log_f, Tensor) or tuple(log_f.shape) != tuple(q.shape):
        shape = tuple(log_f.shape) if isinstance(log_f, Tensor) else type(log_f).__name__
        _fail(f"{op}: `log_f` must have the shape of `q` {tuple(q.shape)}, got {shape}")
    if log_f.device != q.device:
        _fail(f"{op}: `log_f` is on {log_f.device}, inputs on {q.device}")
    if not log_f.is_floating_point():
        # an integer or bool gate would be read as 0 (no forgetting) or as whole nats
        _fail(f"{op}: `log_f` has dtype {log_f.dtype}; use a floating dtype (float32 or the inputs' dtype)")
    # one reduction that also catches NaN (NaN > 0 is False): a NaN gate would spread through the state
    if check_values and not bool((log_f <= 0).all()):
        got = "NaN" if bool(log_f.isnan().any()) else f"max {log_f.max().item():.4g}"
        _fail(f"{op}: `log_f` is a log forget gate and must be <= 0 (not NaN), got {got}")

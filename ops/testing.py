"""Test-only seam: force the kernels' launch plan (layout and launch configurations).

Tests use it to run every layout at shapes where the shape rule would not pick it, and benchmark sweeps to
time the candidates. Production code never calls it: the plan comes from `ops.tuning`.

    with force_plan(seg_chunks=1):            # split layout, one chunk per segment
        ...
    with force_plan(seg_chunks=10**9):        # scan layout (one segment per sequence)
        ...
    with force_plan(launch={"fwd": {"num_warps": 4}}):
        ...
    with force_plan(tame_span=-1):           # GLA: every chunk through the sub-chunk kernels
        ...
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ops import tuning

SCAN = 1 << 30  # a segment length no sequence reaches: the scan layout


@contextmanager
def force_plan(seg_chunks: int | None = None, launch: dict | None = None,
               tame_span: float | None = None) -> Iterator[None]:
    """seg_chunks: segment length in chunks (SCAN: the scan layout); launch: per-kernel overrides;
    tame_span: GLA chunks decaying by at most exp(-tame_span) take the direct intra-chunk products
    (-1: none does, every chunk goes through the sub-chunk kernels)."""
    old = dict(tuning._FORCED)
    tuning._FORCED.clear()
    tuning._FORCED_VERSION[0] += 1
    if seg_chunks is not None:
        if seg_chunks < 1:
            raise ValueError(f"seg_chunks must be >= 1, got {seg_chunks}")
        tuning._FORCED["seg_chunks"] = int(seg_chunks)
    if launch:
        tuning._FORCED["launch"] = {k: dict(v) for k, v in launch.items()}
    if tame_span is not None:
        tuning._FORCED["tame_span"] = float(tame_span)
    try:
        yield
    finally:
        tuning._FORCED.clear()
        tuning._FORCED.update(old)
        tuning._FORCED_VERSION[0] += 1

"""Test-only seam: force the kernels' launch plan (layout and launch configurations).

Tests use it to run every layout at shapes where the shape rule would not pick it, and benchmark sweeps to
time the candidates. Production code never calls it: the plan comes from `ops.tuning`.

    with force_plan(seg_chunks=1):            # split layout, one chunk per segment
        ...
    with force_plan(seg_chunks=10**9):        # scan layout (one segment per sequence)
        ...
    with force_plan(launch={"fwd": {"num_warps": 4}}):
        ...
    with force_plan(tame_span=-1):           # GLA: every chunk through the level kernels
        ...
    with force_plan(anchor_chunks=1):        # GLA: d log_f anchored at every chunk boundary
        ...
    with force_plan(walk_split=True):        # GLA, bf16: the dq / dk walks on bf16 hi + lo pairs
        ...
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ops import tuning

SCAN = 1 << 30  # a segment length no sequence reaches: the scan layout


@contextmanager
def force_plan(seg_chunks: int | None = None, launch: dict | None = None,
               tame_span: float | None = None, anchor_chunks: int | None = None,
               walk_split: bool | None = None, level_blocks: int | None = None) -> Iterator[None]:
    """seg_chunks: segment length in chunks (SCAN: the scan layout); launch: per-kernel overrides;
    tame_span: GLA chunks decaying by at most exp(-tame_span) take the direct intra-chunk products
    (-1: none does, every chunk goes through the level kernels); anchor_chunks: GLA d log_f anchored
    every this many chunks (SCAN: never, one reverse sum over the whole sequence); walk_split: GLA's bf16
    dq / dk walks on bf16 hi + lo pairs (True) or tf32 operands (False) instead of the default
    (`ops.triton_linear_attn.WALK_PAIRS`, `ops.triton_scan.dot_exact`); level_blocks: GLA chunks that are
    not tame take the pairs inside blocks of up to 2^level_blocks rows as one product (0: a product per
    level; `ops.triton_linear_attn.LEVEL_BLOCKS`)."""
    # every argument checked before anything is set: a refused call leaves the enclosing settings as they were
    if seg_chunks is not None and seg_chunks < 1:
        raise ValueError(f"seg_chunks must be >= 1, got {seg_chunks}")
    if anchor_chunks is not None and anchor_chunks < 1:
        raise ValueError(f"anchor_chunks must be >= 1, got {anchor_chunks}")
    if level_blocks is not None and not 0 <= level_blocks <= 4:
        raise ValueError(f"level_blocks must be in 0..4 (blocks of at most 16 rows, under the 32-row halves "
                         f"of the tame kernels), got {level_blocks}")
    if launch:
        tuning.check_launch_overrides(launch)
    old = dict(tuning._FORCED)
    # nested calls add to the enclosing one's settings (a test forcing tame_span around a helper that
    # forces the layout keeps both)
    tuning._FORCED_VERSION[0] += 1
    if seg_chunks is not None:
        tuning._FORCED["seg_chunks"] = int(seg_chunks)
    if launch:
        merged = {k: dict(v) for k, v in tuning._FORCED.get("launch", {}).items()}
        for k, v in launch.items():
            merged[k] = {**merged.get(k, {}), **v}
        tuning._FORCED["launch"] = merged
    if tame_span is not None:
        tuning._FORCED["tame_span"] = float(tame_span)
    if anchor_chunks is not None:
        tuning._FORCED["anchor_chunks"] = int(anchor_chunks)
    if walk_split is not None:
        tuning._FORCED["walk_split"] = bool(walk_split)
    if level_blocks is not None:
        tuning._FORCED["level_blocks"] = int(level_blocks)
    try:
        yield
    finally:
        tuning._FORCED.clear()
        tuning._FORCED.update(old)
        tuning._FORCED_VERSION[0] += 1

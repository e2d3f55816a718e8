"""Mixing sources by token share.

Every sample is one window of seq_len+1 tokens from one source, so a source's token share is its share
of samples. Sample k of the global stream goes to the source furthest behind its target
(argmax over i of w_i*(k+1) - c_i, ties to the lower index): after any prefix of k samples each source
is within one sample of w_i*k. The rule uses only the per-source counts, which the loader state keeps,
so the order does not depend on batch size, world size or workers.
"""
from __future__ import annotations

import numpy as np


def normalise_weights(weights: list[float], names: list[str]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0:
        raise ValueError("no data sources to mix")
    if (w < 0).any() or not np.isfinite(w).all() or not w.max() > 0:
        raise ValueError(f"source weights must be non-negative with a positive sum, got "
                         f"{dict(zip(names, weights))}")
    with np.errstate(over="ignore"):
        total = w.sum()
    if not np.isfinite(total):  # weights near the float limit (1e308 each): inf, which would make every share 0
        w = w / w.max()
        total = w.sum()
    return w / total


def assign_sources(weights: np.ndarray, counts: list[int], n: int) -> list[tuple[int, int]]:
    """(source, window index within that source) of the next n samples; advances `counts` (samples
    taken per source so far) in place."""
    out = []
    k = sum(counts)
    for _ in range(n):
        k += 1
        best, best_gap = 0, -np.inf
        for i, w in enumerate(weights):
            gap = w * k - counts[i]
            if gap > best_gap + 1e-12:
                best, best_gap = i, gap
        out.append((best, counts[best]))
        counts[best] += 1
    return out

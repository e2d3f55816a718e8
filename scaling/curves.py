"""Each run's learning curve as a smooth law, and bootstrap replicates of the logged losses.

At a constant learning rate (the paper's schedule after warm-up) a run of fixed size N follows

    L(D) = e + b·D^(-beta)          D tokens; e, b, beta >= 0 per run

(the fixed-N section of L(N, D) = E + A/N^alpha + B/D^beta, with e = E + A/N^alpha). The fit minimises the
squared relative error, Σ w_i (L_i - e - b·D_i^-beta)² / L_i², ≈ least squares on log L for the percent-level
noise of training losses. Row weights w_i are each row's share of the log-token axis, so a run logged every k
steps (dense at the end in log D) weighs each decade of D alike, as the envelope's log-spaced C grid does.

For fixed beta the problem is linear in (e, b), so every fit is a scan over beta (closed-form (e, b) at each
grid value, with e clamped at 0) refined by golden-section search, and a second pass reweights by
the fitted curve. Everything is vectorised over rows of `log_loss`, so many bootstrap replicates of a run fit
in one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BETA_GRID = np.geomspace(0.005, 3.0, 96)
_GOLD = (np.sqrt(5.0) - 1.0) / 2.0


def row_weights(log_d: np.ndarray) -> np.ndarray:
    """Each row's share of the log-D axis (half the gap to each neighbour), normalised to mean 1."""
    log_d = np.asarray(log_d, dtype=np.float64)
    n = len(log_d)
    if n < 2:
        return np.ones(n)
    gap = np.diff(log_d)
    w = np.empty(n)
    w[0], w[-1] = gap[0] / 2, gap[-1] / 2
    w[1:-1] = (gap[:-1] + gap[1:]) / 2
    w = np.maximum(w, 1e-12)
    return w * (n / w.sum())


@dataclass
class CurveFit:
    """L(D) = e + b·(D/d_ref)^-beta, for R replicates (arrays of shape [R]); row 0 is the fit of the data."""
    e: np.ndarray
    b: np.ndarray
    beta: np.ndarray
    d_ref: float
    rmse_log: np.ndarray          # weighted rms of log residuals (inf where no valid curve fits)

    def rows(self, sl: slice) -> "CurveFit":
        """The fits of some replicates only (row 0: the data)."""
        return CurveFit(e=self.e[sl], b=self.b[sl], beta=self.beta[sl], d_ref=self.d_ref, rmse_log=self.rmse_log[sl])

    def log_loss(self, log_d: np.ndarray) -> np.ndarray:
        """[R, len(log_d)] log of the fitted loss at log D."""
        x = np.exp(-self.beta[:, None] * (np.asarray(log_d, dtype=np.float64)[None, :] - np.log(self.d_ref)))
        return np.log(self.e[:, None] + self.b[:, None] * x)


def _solve(wt, y, x):
    """Weighted least squares of y on [1, x] per row with e >= 0 (clamped to 0): (e, b, sse), each [R]; sse is
    inf where b <= 0 (no decreasing curve). e may exceed the lowest noisy row: the curve stays positive."""
    s0 = wt.sum(-1)
    s1 = (wt * x).sum(-1)
    s2 = (wt * x * x).sum(-1)
    sy = (wt * y).sum(-1)
    sxy = (wt * x * y).sum(-1)
    syy = (wt * y * y).sum(-1)
    det = s0 * s2 - s1 * s1
    with np.errstate(divide="ignore", invalid="ignore"):
        e = (s2 * sy - s1 * sxy) / det
        b = (s0 * sxy - s1 * sy) / det
        neg = ~(e >= 0)                           # also NaN (a degenerate x column): fall back to e = 0
        e = np.where(neg, 0.0, e)
        b = np.where(neg, sxy / s2, b)
    ok = (b > 0) & np.isfinite(b)
    sse = syy - 2 * e * sy - 2 * b * sxy + e * e * s0 + 2 * e * b * s1 + b * b * s2
    return e, b, np.where(ok, np.maximum(sse, 0.0), np.inf)


def _scan(wt, y, u):
    """Best beta on BETA_GRID per row, refined by golden-section search; u = log(D/d_ref)."""
    best_sse = np.full(len(y), np.inf)
    best_i = np.zeros(len(y), dtype=int)
    for i, beta in enumerate(BETA_GRID):
        x = np.exp(-beta * u)[None, :]
        _, _, sse = _solve(wt, y, x)
        better = sse < best_sse
        best_sse = np.where(better, sse, best_sse)
        best_i = np.where(better, i, best_i)
    lo = BETA_GRID[np.maximum(best_i - 1, 0)]
    hi = BETA_GRID[np.minimum(best_i + 1, len(BETA_GRID) - 1)]

    def sse_at(beta):
        return _solve(wt, y, np.exp(-beta[:, None] * u[None, :]))[2]

    c = hi - _GOLD * (hi - lo)
    d = lo + _GOLD * (hi - lo)
    fc, fd = sse_at(c), sse_at(d)
    for _ in range(40):
        left = fc < fd
        hi = np.where(left, d, hi)
        lo = np.where(left, lo, c)
        c_new = hi - _GOLD * (hi - lo)
        d_new = lo + _GOLD * (hi - lo)
        # reuse the surviving interior point, evaluate the new one
        c, d = np.where(left, c_new, d), np.where(left, c, d_new)
        fnew = sse_at(np.where(left, c, d))
        fc, fd = np.where(left, fnew, fd), np.where(left, fc, fnew)
    beta = (lo + hi) / 2
    e, b, sse = _solve(wt, y, np.exp(-beta[:, None] * u[None, :]))
    return e, b, beta, sse


def fit_curves(log_d: np.ndarray, log_loss: np.ndarray, weights: np.ndarray | None = None) -> CurveFit:
    """Fit L(D) = e + b·D^-beta to each row of `log_loss` ([R, n] or [n]) at the same log D ([n])."""
    log_d = np.asarray(log_d, dtype=np.float64)
    ll = np.atleast_2d(np.asarray(log_loss, dtype=np.float64))
    if ll.shape[-1] != len(log_d) or len(log_d) < 4:
        raise ValueError(f"a learning-curve fit needs >= 4 rows with matching shapes, got {ll.shape} and {len(log_d)}")
    w = row_weights(log_d) if weights is None else np.asarray(weights, dtype=np.float64)
    d_ref = float(np.exp(log_d[-1]))
    u = log_d - log_d[-1]
    y = np.exp(ll)
    e, b, beta, _ = _scan(w[None, :] / y ** 2, y, u)
    # second pass: weights from the fitted curve, not the noisy observation (which would favour low rows)
    fitted = e[:, None] + b[:, None] * np.exp(-beta[:, None] * u[None, :])
    fitted = np.where(np.isfinite(fitted) & (fitted > 0), fitted, y)
    e, b, beta, sse = _scan(w[None, :] / fitted ** 2, y, u)
    bad = ~np.isfinite(sse)              # no decreasing curve (b > 0, e >= 0) fits these rows
    e, b, beta = (np.where(bad, np.nan, v) for v in (e, b, beta))
    with np.errstate(divide="ignore", invalid="ignore"):
        resid = ll - np.log(e[:, None] + b[:, None] * np.exp(-beta[:, None] * u[None, :]))
    rmse = np.where(bad, np.inf, np.sqrt((w[None, :] * resid ** 2).sum(-1) / w.sum()))
    return CurveFit(e=e, b=b, beta=beta, d_ref=d_ref, rmse_log=rmse)


def block_bootstrap(resid: np.ndarray, n_rep: int, rng: np.random.Generator, block: int | None = None) -> np.ndarray:
    """[n_rep, n] residual series resampled in circular blocks of `block` consecutive rows (default n^(1/3)),
    which keeps the short-range correlation of training-loss noise that resampling single rows would lose."""
    n = len(resid)
    block = max(1, int(round(n ** (1 / 3)))) if block is None else max(1, int(block))
    n_blocks = -(-n // block)
    starts = rng.integers(0, n, size=(n_rep, n_blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(n_rep, -1)[:, :n] % n
    return resid[idx]

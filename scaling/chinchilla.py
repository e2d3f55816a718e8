"""Chinchilla approach 3 (Hoffmann et al. 2022): L(N, D) = E + A / N^alpha + B / D^beta, fit on every
(N, D, L) point of every run by minimising the Huber loss (delta = 1e-3) of the log-loss residual,

    sum_i Huber( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),   A = e^a, B = e^b, E = e^e,

with L-BFGS. The objective has many local minima, so it is evaluated on a grid of starts (the paper's grid,
alpha, beta in {0, .5, ..., 2}, e in {-1, -.5, ..., 1}, a, b in {0, 5, ..., 25}) and L-BFGS runs from the
`n_starts` best of them; the lowest final objective wins.

The compute-optimal allocation of the fitted law (`frontier`) is found numerically under the study's own
C(N, D) = fpt(N)·D, fpt being the training FLOPs per token of a model of N parameters: the paper's FLOPs are not
6·N·D (LLaMA's attention adds n²-terms; at small widths the GLU, norms and token mixers do not scale as N), so
a = β/(α+β), b = α/(α+β), exact when C ∝ N·D, can be off by several hundredths (more at small sizes).
fpt(N) is log-log interpolated between the sizes of the ladder and extended by its end segments' slopes.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
from scipy.optimize import minimize

HUBER_DELTA = 1e-3
START_GRID = {
    "a": np.arange(0.0, 25.1, 5.0),
    "b": np.arange(0.0, 25.1, 5.0),
    "e": np.arange(-1.0, 1.01, 0.5),
    "alpha": np.arange(0.0, 2.01, 0.5),
    "beta": np.arange(0.0, 2.01, 0.5),
}


@dataclass
class ChinchillaFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float         # Huber loss sum at the optimum
    n_points: int
    # compute-optimal allocation implied by the law when C ∝ N*D: N_opt ∝ C^a, D_opt ∝ C^b
    a: float
    b: float

    def __call__(self, n: np.ndarray, d: np.ndarray) -> np.ndarray:
        return self.E + self.A / np.asarray(n, dtype=np.float64) ** self.alpha + self.B / np.asarray(d, dtype=np.float64) ** self.beta

    def to_dict(self) -> dict:
        return asdict(self)


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber value and derivative, elementwise."""
    small = np.abs(r) <= delta
    val = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    return val, np.where(small, r, delta * np.sign(r))


def _objective(p: np.ndarray, ln: np.ndarray, ld: np.ndarray, ll: np.ndarray, delta: float) -> tuple[float, np.ndarray]:
    a, b, e, alpha, beta = p
    # LSE of the three terms with the max shifted out, written in numpy: scipy's logsumexp costs about three
    # times the rest of the objective in its array-API checks, and L-BFGS calls this thousands of times a fit
    t0, t1 = a - alpha * ln, b - beta * ld
    m = np.maximum(np.maximum(t0, t1), e)
    e0, e1, e2 = np.exp(t0 - m), np.exp(t1 - m), np.exp(e - m)
    s = e0 + e1 + e2
    val, dval = _huber(m + np.log(s) - ll, delta)
    g = dval / s                       # d pred / d (each term) is the softmax e_i / s over the three
    g0, g1 = g * e0, g * e1
    grad = np.array([g0.sum(), g1.sum(), (g * e2).sum(), -(g0 * ln).sum(), -(g1 * ld).sum()])
    return float(val.sum()), grad


def _grid_objective(starts: np.ndarray, ln: np.ndarray, ld: np.ndarray, ll: np.ndarray, delta: float) -> np.ndarray:
    out = np.empty(len(starts))
    for i in range(0, len(starts), 256):  # chunks keep the [starts, points] arrays small
        s = starts[i:i + 256]
        t1 = s[:, 0:1] - s[:, 3:4] * ln
        t2 = s[:, 1:2] - s[:, 4:5] * ld
        t3 = np.broadcast_to(s[:, 2:3], t1.shape)
        pred = np.logaddexp(np.logaddexp(t1, t2), t3)
        out[i:i + 256] = _huber(pred - ll, delta)[0].sum(axis=1)
    return out


def fit_chinchilla(n: np.ndarray, d: np.ndarray, loss: np.ndarray, delta: float = HUBER_DELTA,
                   n_starts: int = 32, extra_starts: list[ChinchillaFit] | None = None) -> ChinchillaFit:
    """The fit from the `n_starts` best grid starts and from each of `extra_starts` (a previous fit's optimum:
    a bootstrap replicate starts where the data's fit ended)."""
    n, d, loss = (np.asarray(v, dtype=np.float64) for v in (n, d, loss))
    ok = np.isfinite(n) & np.isfinite(d) & np.isfinite(loss) & (n > 0) & (d > 0) & (loss > 0)
    n, d, loss = n[ok], d[ok], loss[ok]
    if len(np.unique(n)) < 2:
        raise ValueError("Chinchilla fit: L(N, D) needs runs of >= 2 model sizes (N) to separate A/N^alpha "
                         f"from B/D^beta; got {len(np.unique(n))}")
    if len(n) < 6:
        raise ValueError(f"Chinchilla fit: 5 parameters need more points, got {len(n)}")
    ln, ld, ll = np.log(n), np.log(d), np.log(loss)
    starts = np.array(list(itertools.product(*(START_GRID[k] for k in ("a", "b", "e", "alpha", "beta")))))
    order = np.argsort(_grid_objective(starts, ln, ld, ll, delta))
    best = None
    warm = [np.array([np.log(max(f.A, 1e-300)), np.log(max(f.B, 1e-300)), np.log(max(f.E, 1e-300)), f.alpha, f.beta])
            for f in extra_starts or []]
    for p0 in [*warm, *starts[order[:n_starts]]]:
        sol = minimize(_objective, p0, args=(ln, ld, ll, delta), jac=True, method="L-BFGS-B",
                       bounds=[(None, None)] * 3 + [(0.0, None)] * 2,
                       options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or sol.fun < best.fun:
            best = sol
    a, b, e, alpha, beta = best.x
    s = alpha + beta
    return ChinchillaFit(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=float(alpha),
                         beta=float(beta), objective=float(best.fun), n_points=len(n),
                         a=float(beta / s) if s > 0 else float("nan"), b=float(alpha / s) if s > 0 else float("nan"))


def loglog_interpolator(sizes: list[tuple[float, float]]) -> Callable[[np.ndarray], np.ndarray]:
    """y(N) from (N, y) pairs of a ladder of sizes: log-log linear between them, extended beyond the ends by the
    end segments' slopes (one pair: y ∝ N). Vectorised over N."""
    pairs = sorted({float(n): float(y) for n, y in sizes}.items())
    if not pairs or any(n <= 0 or y <= 0 for n, y in pairs):
        raise ValueError(f"log-log interpolation needs positive (N, y) pairs, got {pairs}")
    ln, ly = (np.log([p[k] for p in pairs]) for k in (0, 1))
    if len(ln) == 1:
        ln, ly = np.append(ln, ln[0] + 1.0), np.append(ly, ly[0] + 1.0)
    s_lo, s_hi = (ly[1] - ly[0]) / (ln[1] - ln[0]), (ly[-1] - ly[-2]) / (ln[-1] - ln[-2])

    def f(n: np.ndarray) -> np.ndarray:
        x = np.log(np.asarray(n, dtype=np.float64))
        y = np.interp(x, ln, ly)
        y = np.where(x < ln[0], ly[0] + s_lo * (x - ln[0]), y)
        return np.exp(np.where(x > ln[-1], ly[-1] + s_hi * (x - ln[-1]), y))
    return f


# log N is searched over the ladder's range widened by this factor each way, on this many points per e-fold
FRONTIER_WIDEN = 1e4
FRONTIER_POINTS_PER_EFOLD = 100


def frontier(law: Callable[[np.ndarray, np.ndarray], np.ndarray], fpt: Callable[[np.ndarray], np.ndarray],
             c: np.ndarray, n_bounds: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """(N_opt, D_opt) at each C (FLOPs) of a loss law L(N, D) when C = fpt(N)·D: argmin over N of L(N, C/fpt(N)),
    on a log-N grid over n_bounds widened FRONTIER_WIDEN-fold each way, refined by a parabola through the best
    grid point and its neighbours. NaN where the minimum is on the grid's edge (no optimum inside it: e.g. a
    law whose N or D term vanishes)."""
    c = np.asarray(c, dtype=np.float64)
    lo, hi = np.log(n_bounds[0] / FRONTIER_WIDEN), np.log(n_bounds[1] * FRONTIER_WIDEN)
    x = np.linspace(lo, hi, int((hi - lo) * FRONTIER_POINTS_PER_EFOLD) + 1)
    nx = np.exp(x)
    f = fpt(nx)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        y = np.log(law(nx[None, :], c[:, None] / f[None, :]))                 # [C, grid]
    i = np.argmin(np.where(np.isfinite(y), y, np.inf), axis=1)
    inside = (i > 0) & (i < len(x) - 1)
    j = np.clip(i, 1, len(x) - 2)
    rows = np.arange(len(c))
    y0, y1, y2 = y[rows, j - 1], y[rows, j], y[rows, j + 1]
    den = y0 - 2 * y1 + y2
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(den > 0, 0.5 * (y0 - y2) / den, 0.0)
    xo = x[j] + np.clip(shift, -1, 1) * (x[1] - x[0])
    n_opt = np.where(inside, np.exp(xo), np.nan)
    return n_opt, c / fpt(np.where(inside, n_opt, 1.0)) * np.where(inside, 1.0, np.nan)

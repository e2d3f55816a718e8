"""Chinchilla approach 3 (Hoffmann et al. 2022): L(N, D) = E + A / N^alpha + B / D^beta, fit on every
(N, D, L) point of every run by minimising the Huber loss (delta = 1e-3) of the log-loss residual,

    sum_i Huber( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),   A = e^a, B = e^b, E = e^e,

with L-BFGS. The objective has many local minima, so it is evaluated on a grid of starts (the paper's grid,
alpha, beta in {0, .5, ..., 2}, e in {-1, -.5, ..., 1}, a, b in {0, 5, ..., 25}) and L-BFGS runs from the
`n_starts` best of them; the lowest final objective wins.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

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
    terms = np.stack([a - alpha * ln, b - beta * ld, np.full_like(ln, e)])
    pred = logsumexp(terms, axis=0)
    val, dval = _huber(pred - ll, delta)
    w = np.exp(terms - pred)           # d pred / d (each term): softmax over the three
    grad = np.array([(dval * w[0]).sum(), (dval * w[1]).sum(), (dval * w[2]).sum(),
                     -(dval * w[0] * ln).sum(), -(dval * w[1] * ld).sum()])
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
                   n_starts: int = 32) -> ChinchillaFit:
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
    for p0 in starts[order[:n_starts]]:
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

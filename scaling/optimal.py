"""Compute-optimal model size N_opt(C) and data size D_opt(C) from the handovers between adjacent model sizes.

Why not the envelope's winners (docs/scaling.md derives this): with a ladder of sizes N_1 < ... < N_K the
winner at C is a staircase in N. The steps of the smallest and largest size are cut by the data, not by a
competitor: below the handover N_1 -> N_2 the smallest size wins at every C, however small the optimum is
there, and above N_{K-1} -> N_K the largest wins at every C up to its last logged row. Those flat edge steps
pull a fitted exponent down, and more so the longer the edge runs are. Even the complete interior steps
carry one number each (their size) over a whole range of C: a line through K equal steps has (1 - 1/K²) of
the true slope.

What the data do pin down is where each step ends. Where the fitted learning curves of adjacent sizes N_k and
N_{k+1} cross, at compute C_x, both give the same loss, so (for unimodal iso-FLOP profiles) the optimum lies
between them: N_opt(C_x) = N_k·(N_{k+1}/N_k)^s with s in (0, 1). For a law whose iso-FLOP profile has the
same shape at every scale (any power-law frontier), s is the same at every handover, so the geometric mean
sqrt(N_k·N_{k+1}) is off by a constant factor — the coefficient of N_opt moves, its exponent does not — on a
geometric ladder of sizes, and by a small varying amount on an uneven one. D_opt at the handover is
C_x / sqrt(fpt_k·fpt_{k+1}) (fpt: training FLOPs per token). The fits are least squares of log N (log D) on
log C over the handover points.

A handover is used only when it is observed: the crossing lies inside both sizes' logged C ranges. Otherwise
the pair is reported (the larger size is already better at its first usable row, or the smaller is still
better when one of them stops — the run that stops while still winning is named).

An unobserved handover still bounds N_opt where the pair's overlap ends or begins (`Handover.n_opt_bound`): with
a unimodal iso-FLOP profile, a smaller size still better than a larger one at C means N_opt(C) < N_large (were
the optimum at or above N_large, the loss would fall with N up to it), and a larger size already better at C
means N_opt(C) > N_small. An observed handover puts N_opt(C_x) between the two sizes (sqrt(N_small·N_large) in
the fit). These are what a study whose smallest size wins throughout can say against another law's N_opt.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scaling.curves import CurveFit, fit_curves, row_weights
from scaling.runs import Run, size_label
from scaling.units import flops_to_pflop_days


def _pfd(flops: float) -> str:
    """C for a message, in the unit of the tables and of --c-min/--c-max."""
    return f"{flops_to_pflop_days(flops):.3g} PFLOP-days"

GRID_POINTS = 512   # log-C points per adjacent pair on which a crossing is bracketed, then interpolated
# above this many rows (a trainer logging every step), a size's rows are averaged within bins of log D before its
# learning curve is fitted (`log_d_groups`): the curve is smooth on that scale, and the fits of hundreds of
# replicates stay fast
MAX_CURVE_ROWS = 1000


def log_d_groups(log_d: np.ndarray, max_rows: int = MAX_CURVE_ROWS) -> np.ndarray:
    """First row of each group of sorted rows averaged into one fitted row: every row alone up to `max_rows`
    rows, else the rows inside each of `max_rows` equal bins of log D. Bins of log D, not equal row counts: a run
    logged every step has most of its rows in its last decade of D, and a group of its first k rows (steps 1..k)
    would span decades, where the mean of log L is far from the curve at the mean log D."""
    n = len(log_d)
    if n <= max_rows:
        return np.arange(n)
    edges = np.linspace(log_d[0], log_d[-1], max_rows + 1)
    bins = np.clip(np.searchsorted(edges, log_d, side="right") - 1, 0, max_rows - 1)
    return np.flatnonzero(np.concatenate([[True], np.diff(bins) > 0]))


@dataclass
class SizeCurve:
    """All usable rows of one model size (its runs pooled) and the fitted learning curve(s)."""
    n_params: float
    flops_per_token: float
    label: str
    runs: list[Run]
    log_d: np.ndarray              # sorted (weighted group means when the rows were grouped, `log_d_groups`)
    log_loss: np.ndarray
    weights: np.ndarray            # of each fitted row in the learning-curve fit (`run_row_weights`), mean 1
    row_run: np.ndarray            # which of `runs` each pooled row came from (before grouping)
    row_idx: np.ndarray            # ... and which of that run's rows
    row_weight: np.ndarray         # ... and its weight
    group_starts: np.ndarray       # first pooled row of each fitted row (np.add.reduceat boundaries)
    fit: CurveFit | None = None    # row 0: the data; further rows: bootstrap replicates

    def grouped(self, log_loss_rows: np.ndarray) -> np.ndarray:
        """[R, pooled rows] -> [R, fitted rows]: the weighted mean over each group."""
        w = self.row_weight
        return np.add.reduceat(log_loss_rows * w, self.group_starts, axis=-1) / np.add.reduceat(w, self.group_starts)

    @property
    def distinct_d(self) -> int:
        """How many different token counts the fitted rows have (runs of one size may log the same ones)."""
        return len(np.unique(self.log_d))

    @property
    def log_c_range(self) -> tuple[float, float]:
        return (float(self.log_d[0] + np.log(self.flops_per_token)), float(self.log_d[-1] + np.log(self.flops_per_token)))


def run_row_weights(log_d: np.ndarray) -> np.ndarray:
    """Each row's share of its run's log-D axis (scaling.curves.row_weights), summing to the run's log-D extent.
    Pooled over the runs of one size, each run then weighs by the decades of D it covers, whatever its logging
    interval: a run logged every step counts as much as one logged every 100 steps over the same tokens, and a
    second seed as much as the first."""
    log_d = np.asarray(log_d, dtype=np.float64)
    return row_weights(log_d) * max(float(np.ptp(log_d)), 1e-12) / len(log_d)


def size_curves(runs: list[Run]) -> list[SizeCurve]:
    """One SizeCurve per distinct model size, smallest first; the rows of all runs of one size are pooled, each
    weighted by its share of its own run's log-D axis (`run_row_weights`)."""
    by_n: dict[int, list[Run]] = {}
    for r in runs:
        by_n.setdefault(r.n_params, []).append(r)
    out = []
    for n in sorted(by_n):
        rs = by_n[n]
        d = np.concatenate([r.tokens for r in rs])
        loss = np.concatenate([r.loss for r in rs])
        src = np.concatenate([np.full(len(r.tokens), i) for i, r in enumerate(rs)])
        idx = np.concatenate([np.arange(len(r.tokens)) for r in rs])
        w = np.concatenate([run_row_weights(np.log(r.tokens)) for r in rs])
        order = np.argsort(d, kind="stable")
        d, loss, src, idx, w = d[order], loss[order], src[order], idx[order], w[order]
        w = w / w.mean()
        starts = log_d_groups(np.log(d))
        sc = SizeCurve(n_params=float(n), flops_per_token=float(np.mean([r.flops_per_token for r in rs])),
                       label=rs[0].label, runs=rs, log_d=np.log(d), log_loss=np.log(loss), weights=w, row_run=src,
                       row_idx=idx, row_weight=w, group_starts=starts)
        if len(starts) < len(d):
            sc.log_d, sc.log_loss = sc.grouped(sc.log_d[None, :])[0], sc.grouped(sc.log_loss[None, :])[0]
            group_w = np.add.reduceat(w, starts)
            sc.weights = group_w / group_w.mean()
        out.append(sc)
    return out


def fit_size_curves(curves: list[SizeCurve], log_loss_replicates: list[np.ndarray] | None = None) -> list[str]:
    """Fit each size's learning curve (to its data, or to [R, rows] replicates); returns notes for sizes with
    too few rows (they get fit = None)."""
    notes = []
    for k, sc in enumerate(curves):
        y = sc.log_loss if log_loss_replicates is None else log_loss_replicates[k]
        if sc.distinct_d < 4:
            sc.fit = None
            notes.append(f"size {sc.label}: {sc.distinct_d} usable row(s), a learning-curve fit needs >= 4")
            continue
        sc.fit = fit_curves(sc.log_d, y, sc.weights)
    return notes


@dataclass
class Handover:
    small: str
    large: str
    log_c: np.ndarray              # [R]: crossing per replicate (NaN where none was observed)
    n: float                       # sqrt(N_small·N_large)
    log_fpt: float                 # log sqrt(fpt_small·fpt_large)
    status: str = "ok"             # of replicate 0 (the data)
    reason: str = ""
    n_small: float = float("nan")
    n_large: float = float("nan")
    log_c_edge: float = float("nan")   # where an unobserved pair's verdict holds: the overlap's end (smaller_ahead)
                                       # or start (larger_ahead); log FLOPs

    @property
    def c(self) -> float:
        return float(np.exp(self.log_c[0]))

    @property
    def d(self) -> float:
        return float(np.exp(self.log_c[0] - self.log_fpt))

    def n_opt_bound(self) -> tuple[float, str, float] | None:
        """(C in FLOPs, relation, N): what the pair says about N_opt at C — "≈" sqrt(N_small·N_large) at an observed
        handover, "<" N_large where the smaller size was still ahead when the overlap ended, ">" N_small where the
        larger was ahead from the overlap's start; None where the sizes do not overlap or the crossing was cut out."""
        if self.status == "ok":
            return self.c, "≈", self.n
        if self.status == "smaller_ahead" and np.isfinite(self.log_c_edge):
            return float(np.exp(self.log_c_edge)), "<", self.n_large
        if self.status == "larger_ahead" and np.isfinite(self.log_c_edge):
            return float(np.exp(self.log_c_edge)), ">", self.n_small
        return None


def _pair(a: SizeCurve, b: SizeCurve) -> tuple[np.ndarray, str, float, str]:
    """Crossing log C of sizes a < b per replicate; the status of replicate 0, the log C where an unobserved
    pair's verdict holds (NaN otherwise) and the reason."""
    (a0, a1), (b0, b1) = a.log_c_range, b.log_c_range
    lo, hi = max(a0, b0), min(a1, b1)
    r = len(a.fit.e)
    if hi <= lo:
        return np.full(r, np.nan), "no_overlap", float("nan"), (
            f"{a.label} and {b.label} do not overlap in C ({a.label} ends at {_pfd(np.exp(a1))}, "
            f"{b.label} starts at {_pfd(np.exp(b0))}): no handover can be seen; train {a.label} longer")
    x = np.linspace(lo, hi, GRID_POINTS)
    # g > 0: the larger size has the lower loss
    g = a.fit.log_loss(x - np.log(a.flops_per_token)) - b.fit.log_loss(x - np.log(b.flops_per_token))
    up = (g[:, :-1] <= 0) & (g[:, 1:] > 0)
    has = up.any(axis=1)
    i = np.argmax(up, axis=1)
    rows = np.arange(r)
    g0, g1 = g[rows, i], g[rows, i + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        xc = x[i] + (x[i + 1] - x[i]) * (-g0) / (g1 - g0)
    xc = np.where(has, xc, np.nan)
    if has[0]:
        later_down = ((g[0, i[0] + 1:-1] > 0) & (g[0, i[0] + 2:] <= 0)).any()
        reason = (f"the curves of {a.label} and {b.label} cross back later in their overlap (noisy or "
                  f"mis-specified fits); the first crossing is used") if later_down else ""
        return xc, "ok", float("nan"), reason
    if (g[0] > 0).all():
        first = b.label if b0 >= a0 else a.label
        return xc, "larger_ahead", float(lo), (
            f"{b.label} is already better than {a.label} where their logged C ranges begin (at {_pfd(np.exp(lo))}, "
            f"the first usable row of {first}): their handover is not observed; log {first} from earlier "
            f"(or, with --skip-warmup, from a shorter warm-up)")
    ender = a if a1 <= b1 else b
    return xc, "smaller_ahead", float(hi), (
        f"{a.label} is still better than {b.label} where their overlap ends ({_pfd(np.exp(hi))}), where run "
        f"{'/'.join(r.name for r in ender.runs)} stops while still winning: train it past the C where {b.label} "
        f"overtakes {a.label}, or the handover is lost")


def handovers(curves: list[SizeCurve], c_min: float | None = None, c_max: float | None = None) -> list[Handover]:
    """The observed handover of each adjacent pair of fitted sizes (C bounds in FLOPs)."""
    fitted = [sc for sc in curves if sc.fit is not None]
    out = []
    for a, b in zip(fitted, fitted[1:]):
        log_c, status, edge, reason = _pair(a, b)
        h = Handover(small=a.label, large=b.label, log_c=log_c, n=float(np.sqrt(a.n_params * b.n_params)),
                     log_fpt=float(0.5 * np.log(a.flops_per_token * b.flops_per_token)), status=status, reason=reason,
                     n_small=a.n_params, n_large=b.n_params, log_c_edge=edge)
        if status == "ok":
            outside = np.zeros(len(log_c), dtype=bool)
            if c_min is not None:
                outside |= log_c < np.log(c_min)
            if c_max is not None:
                outside |= log_c > np.log(c_max)
            if outside[0]:
                h.status, h.reason = "outside_range", (f"handover {a.label} -> {b.label} at {_pfd(h.c)} is "
                                                       f"outside --c-min/--c-max")
            h.log_c = np.where(outside, np.nan, log_c)
        out.append(h)
    return out


def contradictions(hs: list[Handover]) -> list[str]:
    """Pairs of adjacent-size verdicts that no unimodal iso-FLOP profile with N_opt growing in C allows: one puts
    N_opt(C1) above some N (an observed handover, or the larger size ahead from the start) while another, at
    C2 >= C1, puts N_opt(C2) below a size <= that N (the smaller size still ahead). Noise, or a run that trains
    worse than its size should, makes such pairs; a handover among them is weak evidence for N_opt."""
    lower, upper = [], []   # (C FLOPs, N, pair) with N_opt(C) > N, resp. < N
    for h in hs:
        b = h.n_opt_bound()
        if b is None:
            continue
        c, rel, _ = b
        pair = f"{h.small} -> {h.large}"
        if rel in ("≈", ">"):
            lower.append((c, h.n_small, pair, "handover" if rel == "≈" else "larger ahead"))
        if rel in ("≈", "<"):
            upper.append((c, h.n_large, pair, "handover" if rel == "≈" else "smaller still ahead"))
    out = []
    for c1, n1, p1, w1 in lower:
        for c2, n2, p2, w2 in upper:
            if p1 != p2 and c2 >= c1 * (1 - 1e-9) and n2 <= n1:
                out.append(f"{p1} ({w1} at {_pfd(c1)}: N_opt > {n1:,.0f}) contradicts {p2} ({w2} at {_pfd(c2)}: "
                           f"N_opt < {n2:,.0f}) for an N_opt that grows with C; one of these sizes trains "
                           f"worse or noisier than its neighbours")
    return out


def line_fits(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares slope and intercept of y on x per row ([R, P], NaN = missing); NaN where < 2 points."""
    ok = np.isfinite(x) & np.isfinite(y)
    m = ok.sum(axis=1)
    xs, ys = np.where(ok, x, 0.0), np.where(ok, y, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mx, my = xs.sum(1) / m, ys.sum(1) / m
        dx = np.where(ok, x - mx[:, None], 0.0)
        sxx = (dx * dx).sum(1)
        slope = (dx * np.where(ok, y - my[:, None], 0.0)).sum(1) / sxx
        slope = np.where((m >= 2) & (sxx > 1e-12), slope, np.nan)
    return slope, my - slope * mx


@dataclass
class OptimalPoints:
    """The handover points used for N_opt/D_opt, per replicate: log C [R, P], log N [P], log D [R, P]."""
    handovers: list[Handover]
    log_c: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    log_n: np.ndarray = field(default_factory=lambda: np.empty(0))
    log_d: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))

    @property
    def used(self) -> list[Handover]:
        return [h for h in self.handovers if h.status == "ok"]


def optimal_points(hs: list[Handover]) -> OptimalPoints:
    used = [h for h in hs if h.status == "ok"]
    pts = OptimalPoints(handovers=hs)
    if used:
        pts.log_c = np.stack([h.log_c for h in used], axis=1)
        pts.log_n = np.log([h.n for h in used])
        pts.log_d = pts.log_c - np.array([h.log_fpt for h in used])[None, :]
    return pts


def describe(h: Handover) -> str:
    return f"{h.small} -> {h.large}" + (f" at C = {_pfd(h.c)} (N {size_label(h.n)}, D {h.d:.3g} tokens)"
                                        if h.status == "ok" else f": {h.reason}")

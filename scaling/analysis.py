"""One architecture's scaling study: envelope -> L(C) (power law and eps + power law), N_opt(C) and D_opt(C)
from the handovers between adjacent sizes (scaling.optimal), optionally Chinchilla approach 3; intervals from
replicates of the whole study; warnings for the ways a sweep silently misleads a fit.

C is in PFLOP-days in every fit (the paper's unit); FLOPs-unit coefficients are derived from those
(scaling.units). Which FLOPs count as C (with or without the embedding term) is decided when the runs are
read (scaling.runs) and named in every output.

Intervals: each run's logged log-losses are regenerated as its size's fitted learning curve (scaling.curves)
plus the run's own residuals resampled in blocks of consecutive rows; every fit is redone on every replicate
and each coefficient's interval is the spread of its replicates, symmetric about the estimate
(scaling.fits.symmetric_interval; the eps + power law's: percentiles). Replicates are whole studies, so the correlation
between neighbouring envelope points (they share runs) is kept, unlike a bootstrap over envelope points.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.registry import canonical_arch
from scaling.chinchilla import FRONTIER_WIDEN, ChinchillaFit, fit_chinchilla, frontier, loglog_interpolator
from scaling.curves import block_bootstrap, fit_curves
from scaling.envelope import Envelope, build_envelope, c_grid, inside_range, loss_at
from scaling.fits import (OffsetPowerLawFit, PowerLawFit, percentile_interval, fit_offset_power_law, fit_power_law,
                          offset_refit, with_replicate_intervals)
from scaling.optimal import (OptimalPoints, SizeCurve, contradictions, describe, handovers, line_fits,
                             optimal_points, size_curves)
from scaling.runs import Run, mixed_vocab
from scaling.units import PFLOP_DAY, flops_to_pflop_days

LOG_PFLOP_DAY = float(np.log(PFLOP_DAY))


@dataclass
class FitSettings:
    points_per_decade: int = 20       # C grid density (log-spaced)
    smooth_decades: float = 0.0       # half-width of the log-token box filter on each run's loss; 0 = off
    min_runs: int = 2                 # fit L(C) only at C where >= this many model sizes are present (seeds
                                      # of one size count once)
    envelope: str = "fitted"          # "fitted": envelope of each size's fitted learning curve; "logged": of the
                                      # logged (optionally --smooth'ed) losses
    c_min: float | None = None        # PFLOP-days; fit only C >= c_min
    c_max: float | None = None        # PFLOP-days; fit only C <= c_max
    n_boot: int = 200                 # study replicates for the intervals (0: no intervals)
    n_boot_offset: int = 100          # ... of them refitted with the (nonlinear, slower) eps + power law
    block: int | None = None          # residual block length in rows (default: rows^(1/3) per run)
    ci: float = 0.95
    seed: int = 0
    chinchilla: bool = False
    chinchilla_starts: int = 16       # L-BFGS runs from the best grid starts
    chinchilla_boot: int = 100        # bootstrap replicates over runs for the approach-3 allocation (0: none)
    chinchilla_max_tokens: float | None = None   # leave rows past this many tokens out of approach 3 (e.g. past
                                                 # one epoch of a repeated corpus)


@dataclass
class ChinchillaAllocation:
    """N_opt(C) = n_fit.coef·C^a and D_opt(C) = d_fit.coef·C^b (C in PFLOP-days) of a fitted L(N, D) under the
    architecture's C = fpt(N)·D, over `c_range`; intervals from the bootstrap over runs (percentiles)."""
    n_fit: PowerLawFit
    d_fit: PowerLawFit
    c_range: tuple[float, float]          # PFLOP-days: where the allocation was evaluated and fitted
    n_opt_range: tuple[float, float]      # N_opt at the two ends of c_range
    d_opt_range: tuple[float, float]
    ladder: tuple[float, float]           # the smallest and largest trained N
    param_ci: dict[str, tuple[float, float]] = field(default_factory=dict)   # E, A, B, alpha, beta
    n_replicates: int = 0
    ci_method: str = "none"               # "runs" (bootstrap over runs, percentiles) | "none"
    implied_a: float = float("nan")       # beta/(alpha+beta): the allocation were C ∝ N·D
    implied_b: float = float("nan")

    def to_dict(self) -> dict:
        return {"method": "Chinchilla approach 3: argmin_N L(N, C/fpt(N)) of the fitted L(N, D), fpt(N) log-log "
                          "interpolated between the trained sizes; power laws fitted over c_range",
                "a": self.n_fit.exponent, "a_ci": list(self.n_fit.exponent_ci), "n_coef": self.n_fit.coef,
                "n_coef_ci": list(self.n_fit.coef_ci), "b": self.d_fit.exponent, "b_ci": list(self.d_fit.exponent_ci),
                "d_coef": self.d_fit.coef, "d_coef_ci": list(self.d_fit.coef_ci),
                "c_range_pflop_days": list(self.c_range), "n_opt_range": list(self.n_opt_range),
                "d_opt_range": list(self.d_opt_range), "ladder_n": list(self.ladder),
                "param_ci": {k: list(v) for k, v in self.param_ci.items()}, "ci_method": self.ci_method,
                "n_replicates": self.n_replicates, "implied_a_if_c_prop_nd": self.implied_a,
                "implied_b_if_c_prop_nd": self.implied_b}


@dataclass
class ArchResult:
    arch: str
    runs: list[Run]
    envelope: Envelope | None = None
    fit_mask: np.ndarray | None = None
    loss_fit: PowerLawFit | None = None
    offset_fit: OffsetPowerLawFit | None = None
    n_fit: PowerLawFit | None = None
    d_fit: PowerLawFit | None = None
    chinchilla: ChinchillaFit | None = None
    chinchilla_alloc: ChinchillaAllocation | None = None
    curves: list[SizeCurve] = field(default_factory=list)
    optimal: OptimalPoints | None = None
    notes: list[str] = field(default_factory=list)      # why a fit is missing
    warnings: list[str] = field(default_factory=list)   # what in the runs may mislead a fit

    @property
    def sizes(self) -> list[str]:
        return list(dict.fromkeys(r.label for r in sorted(self.runs, key=lambda r: r.n_params)))

    def edge_summary(self) -> dict:
        """Envelope points by status in the L(C) fit range (edge-won points carry no N_opt information)."""
        if self.envelope is None or self.fit_mask is None:
            return {}
        st = self.envelope.status[self.fit_mask]
        c = flops_to_pflop_days(self.envelope.c[self.fit_mask])
        out = {}
        for k in ("interior", "edge_low", "edge_high", "alone"):
            sel = st == k
            out[k] = {"points": int(sel.sum()),
                      "c_range_pflop_days": [float(c[sel].min()), float(c[sel].max())] if sel.any() else None}
        return out


def _try(result: ArchResult, what: str, fn):
    try:
        return fn()
    except ValueError as err:
        result.notes.append(f"{what}: {err}")
        return None


# an end-of-run rise is reported when the median log-loss of a run's last tenth of rows is above that of an
# earlier tenth by more than RISE_MIN and by more than RISE_SE standard errors of the difference of two medians
RISE_MIN = 0.02
RISE_SE = 4.0


def end_rise(loss: np.ndarray) -> tuple[float, float] | None:
    """(median loss of the last tenth of rows, lowest median of an earlier tenth) when the run's loss rose at its
    end by more than its row-to-row noise explains, else None (also below 10 rows).

    Medians of tenths rather than the lowest row: the lowest noisy row sits several noise widths below the curve,
    so a rule against it must allow a rise of ~20% and lets a run that climbed 15% (a shift of N_opt's exponent
    of several interval widths) pass. The noise is the robust spread of consecutive differences, so the
    rule is as strict as the run's own noise allows."""
    ll = np.log(np.asarray(loss, dtype=np.float64))
    if len(ll) < 10:
        return None
    med = np.array([np.median(part) for part in np.array_split(ll, 10)])
    diff = np.diff(ll)
    sigma = 1.4826 * float(np.median(np.abs(diff - np.median(diff)))) / np.sqrt(2)   # per-row noise of log L
    m = len(ll) // 10
    se = 1.2533 * sigma * np.sqrt(2.0 / m)     # of the difference of two medians of m rows
    rise = float(med[-1] - med[:-1].min())
    if rise > max(RISE_MIN, RISE_SE * se):
        return float(np.exp(med[-1])), float(np.exp(med[:-1].min()))
    return None


def chinchilla_points(runs: list[Run], c: np.ndarray, smooth_decades: float = 0.0,
                      max_tokens: float | None = None) -> tuple[np.ndarray, ...]:
    """(N, D, L) of every run at the shared C grid points inside its range (and at D <= max_tokens): each run
    weighs by its log-C extent, not by how often it logged."""
    n, d, l = [], [], []
    for r in runs:
        lc = loss_at(r, c, smooth_decades)
        ok = np.isfinite(lc)
        if max_tokens is not None:
            ok &= c / r.flops_per_token <= max_tokens
        n.append(np.full(ok.sum(), float(r.n_params)))
        d.append(c[ok] / r.flops_per_token)
        l.append(lc[ok])
    return np.concatenate(n), np.concatenate(d), np.concatenate(l)


def _max_tokens_problem(runs: list[Run], c: np.ndarray, s: FitSettings, n_kept: np.ndarray) -> str | None:
    """Why approach 3 has nothing to fit once --chinchilla-max-tokens has cut the rows (fewer than two sizes
    left), naming the cut, else None: without it the fit's own error (too few sizes) hides the cause, most
    often a cap given in billions of tokens."""
    cap = s.chinchilla_max_tokens
    if cap is None or len(np.unique(n_kept)) >= 2:
        return None
    n_all = chinchilla_points(runs, c, s.smooth_decades)[0]
    if len(np.unique(n_all)) < 2:
        return None    # too few sizes with or without the cap: the fit says so
    first = min(float(r.tokens[0]) for r in runs)
    return (f"--chinchilla-max-tokens {cap:g} leaves {len(n_kept)} of {len(n_all)} points, of "
            f"{len(np.unique(n_kept))} model size(s); approach 3 needs >= 2 sizes. The cap counts tokens (the runs' "
            f"first rows are at >= {first:.3g} tokens; 2e10 for 20B): raise it")


CHINCHILLA_C_POINTS = 25   # log-spaced C points on which the approach-3 allocation is evaluated and fitted


def _allocation_line(fit: ChinchillaFit, fpt, c: np.ndarray, bounds: tuple[float, float]) -> tuple[np.ndarray, ...]:
    """Slopes and log-coefficients (C in PFLOP-days) of log N_opt and log D_opt on log C, and the two curves."""
    n_opt, d_opt = frontier(fit, fpt, c, bounds)
    if not np.isfinite(n_opt).all():   # no optimum in range at some C: no line over the whole range
        return (np.nan,) * 4 + (n_opt, d_opt)
    lc = np.log(flops_to_pflop_days(c))[None, :]
    sn, i_n = line_fits(lc, np.log(n_opt)[None, :])
    sd, i_d = line_fits(lc, np.log(d_opt)[None, :])
    return sn[0], i_n[0], sd[0], i_d[0], n_opt, d_opt


def chinchilla_allocation(fit: ChinchillaFit, runs: list[Run], c_lo: float, c_hi: float, s: FitSettings,
                          grid: np.ndarray) -> ChinchillaAllocation:
    """The approach-3 N_opt(C), D_opt(C) over [c_lo, c_hi] FLOPs, with the bootstrap over runs (s.chinchilla_boot
    replicates; points at the C `grid` as the fit's own)."""
    fpt = loglog_interpolator([(r.n_params, r.flops_per_token) for r in runs])
    bounds = (min(r.n_params for r in runs), max(r.n_params for r in runs))
    c = np.geomspace(c_lo, c_hi, CHINCHILLA_C_POINTS)
    sn, i_n, sd, i_d, n_opt, d_opt = _allocation_line(fit, fpt, c, bounds)
    if not (np.isfinite(n_opt).all() and np.isfinite(sn)):
        raise ValueError(f"the fitted L(N, D) (alpha {fit.alpha:.3g}, beta {fit.beta:.3g}) has no compute-optimal N "
                         f"within {FRONTIER_WIDEN:g}x of the trained sizes somewhere in the C range: no allocation")
    c_pfd = flops_to_pflop_days(c)
    none = (float("nan"), float("nan"))
    n_fit = PowerLawFit(coef=float(np.exp(i_n)), exponent=float(sn), coef_ci=none, exponent_ci=none,
                        n_points=len(c), r2=float("nan"), ci_method="none")
    d_fit = PowerLawFit(coef=float(np.exp(i_d)), exponent=float(sd), coef_ci=none, exponent_ci=none,
                        n_points=len(c), r2=float("nan"), ci_method="none")
    out = ChinchillaAllocation(n_fit=n_fit, d_fit=d_fit, c_range=(float(c_pfd[0]), float(c_pfd[-1])),
                               n_opt_range=(float(n_opt[0]), float(n_opt[-1])),
                               d_opt_range=(float(d_opt[0]), float(d_opt[-1])), ladder=(float(bounds[0]), float(bounds[1])),
                               implied_a=fit.a, implied_b=fit.b)
    if s.chinchilla_boot <= 0:
        return out
    pts = [chinchilla_points([r], grid, s.smooth_decades, s.chinchilla_max_tokens) for r in runs]
    rng = np.random.default_rng(s.seed)
    rows = []   # alpha, beta, E, A, B, a, log n_coef, b, log d_coef
    for _ in range(int(s.chinchilla_boot)):
        pick = rng.integers(0, len(runs), len(runs))
        n, d, l = (np.concatenate([pts[k][j] for k in pick]) for j in range(3))
        try:
            f = fit_chinchilla(n, d, l, n_starts=3, extra_starts=[fit])
        except ValueError:      # a draw of a single size: no law across N
            continue
        rsn, ri_n, rsd, ri_d, _, _ = _allocation_line(f, fpt, c, bounds)
        rows.append([f.alpha, f.beta, f.E, f.A, f.B, rsn, ri_n, rsd, ri_d])
    if not rows:
        return out
    p = np.array(rows)
    pi = lambda k: percentile_interval(p[:, k], s.ci)   # noqa: E731
    n_fit.exponent_ci, d_fit.exponent_ci = pi(5), pi(7)
    n_fit.coef_ci, d_fit.coef_ci = tuple(np.exp(pi(6))), tuple(np.exp(pi(8)))
    for fit_ in (n_fit, d_fit):
        fit_.ci_method, fit_.n_replicates = "runs-bootstrap", len(p)
    out.param_ci = {k: pi(j) for j, k in enumerate(("alpha", "beta", "E", "A", "B"))}
    # replicates whose law had no optimum in range are counted as drawn but carry NaN: say how many were usable
    out.n_replicates = int(np.isfinite(p[:, 5]).sum())
    out.ci_method = "runs-bootstrap"
    return out


def _replicate_runs(curves: list[SizeCurve], n_rep: int, rng: np.random.Generator,
                    block: int | None) -> dict[int, np.ndarray]:
    """id(run) -> [n_rep, rows] replicate losses: the size's fitted curve at the run's rows times the run's
    own log residuals, resampled in blocks. Runs of sizes without a curve fit keep their logged losses."""
    out = {}
    for sc in curves:
        for run in sc.runs:
            if sc.fit is None:
                out[id(run)] = np.broadcast_to(run.loss, (n_rep, len(run.loss)))
                continue
            fitted = sc.fit.log_loss(np.log(run.tokens))[0]
            resid = np.log(run.loss) - fitted
            out[id(run)] = np.exp(fitted[None, :] + block_bootstrap(resid, n_rep, rng, block))
    return out


def _replicate_curve_fits(curves: list[SizeCurve], reps: dict[int, np.ndarray]) -> None:
    """Extend each size's fit (row 0, the data) with fits to its replicate rows."""
    for sc in curves:
        if sc.fit is None:
            continue
        y = np.stack([np.log(reps[id(sc.runs[j])][:, i]) for j, i in zip(sc.row_run, sc.row_idx)], axis=1)
        rep = fit_curves(sc.log_d, sc.grouped(y), sc.weights)
        f = sc.fit
        f.e, f.b, f.beta = (np.concatenate([getattr(f, k)[:1], getattr(rep, k)]) for k in ("e", "b", "beta"))
        f.rmse_log = np.concatenate([f.rmse_log[:1], rep.rmse_log])


def _loss_table(runs: list[Run], curves: list[SizeCurve], c: np.ndarray, s: FitSettings,
                reps: dict[int, np.ndarray] | None) -> np.ndarray:
    """[R, runs, len(c)] loss of each run at each C inside its logged range (NaN outside): of the data (R = 1,
    reps None) or of every replicate. "fitted": the run's size's learning curve; "logged": its logged losses
    (interpolated, optionally smoothed); a size without a curve fit always uses its logged losses."""
    size_of = {id(r): sc for sc in curves for r in sc.runs}
    rows = []
    for r in runs:
        sc = size_of[id(r)]
        if s.envelope == "fitted" and sc.fit is not None:
            fit = sc.fit.rows(slice(0, 1) if reps is None else slice(1, None))
            inside = inside_range(r, c)
            out = np.full((len(fit.e), len(c)), np.nan)
            out[:, inside] = np.exp(fit.log_loss(np.log(c[inside] / r.flops_per_token)))
            rows.append(out)
        else:
            rows.append(loss_at(r, c, s.smooth_decades, loss=None if reps is None else reps[id(r)]).reshape(-1, len(c)))
    return np.stack(rows, axis=1)


def _overtaken_at_end(runs: list[Run], curves: list[SizeCurve], s: FitSettings) -> np.ndarray:
    """Per run: a larger size present at the run's own last row is at or below it there (the envelope's grid can
    put its last point inside a run just before a crossing that still lies inside the run)."""
    out = np.zeros(len(runs), dtype=bool)
    for i, run in enumerate(runs):
        at_end = _loss_table(runs, curves, np.array([float(run.compute[-1])]), s, None)[0][:, 0]
        out[i] = any(np.isfinite(at_end[k]) and r.n_params > run.n_params and at_end[k] <= at_end[i]
                     for k, r in enumerate(runs))
    return out


def _warn_ended_while_winning(res: ArchResult, env: Envelope) -> None:
    overtaken = env.overtaken_runs()
    for i, nxt, c in env.ended_while_winning():
        run, other = env.runs[i], env.runs[nxt]
        if run.n_params >= other.n_params or overtaken[i]:
            continue   # the largest present run ending hands over to a smaller one (the end of the data), another
                       # run of the same size goes on (that size has not stopped), or it was overtaken by its end
        res.warnings.append(
            f"run {run.name} ({run.label}) stops at C = {flops_to_pflop_days(c):.3g} PFLOP-days while still "
            f"winning the envelope; {other.name} ({other.label}) wins after it only because it stopped. Train "
            f"{run.name} past the C where the next size overtakes it")


def analyze_arch(arch: str, runs: list[Run], s: FitSettings | None = None) -> ArchResult:
    s = s or FitSettings()
    try:
        arch = canonical_arch(arch)   # an alias ("transnormer", "TNL") names the architecture the runs record
    except ValueError:
        pass                          # not registered: compared with the runs' names as given
    res = ArchResult(arch=arch, runs=runs)
    if not runs:
        res.notes.append("no runs")
        return res
    # one architecture's ladder: runs of another would enter its envelope and its handovers as if they were
    # further sizes of it (scaling.runs.group_by_arch splits a mixed list)
    others = sorted({r.arch for r in runs} - {arch})
    if others:
        names = ", ".join(f"{r.name} ({r.arch})" for r in runs if r.arch != arch)
        raise ValueError(f"analyze_arch({arch!r}) was given runs of other architectures ({', '.join(others)}: "
                         f"{names}); fit each architecture on its own runs (scaling.runs.group_by_arch)")
    mixed = mixed_vocab(runs)
    if mixed:
        raise ValueError(mixed)
    n_sizes = len({r.n_params for r in runs})
    if n_sizes < 2:
        res.notes.append(f"only one model size ({runs[0].label}, {len(runs)} run(s)): a scaling law across compute "
                         f"needs runs of >= 2 sizes; with one size the envelope is just that run's learning curve "
                         f"and N_opt cannot move")
        return res
    c_min = None if s.c_min is None else s.c_min * PFLOP_DAY
    c_max = None if s.c_max is None else s.c_max * PFLOP_DAY
    if s.envelope not in ("fitted", "logged"):
        raise ValueError(f"envelope {s.envelope!r}: choose fitted or logged")
    warm = [r for r in runs if r.warmup_tokens and r.tokens.size and r.tokens[0] <= r.warmup_tokens]
    if warm:
        which = ", ".join(f"{r.name}: warm-up ends at {r.warmup_tokens:.3g} tokens" for r in warm[:4])
        res.warnings.append(
            f"rows inside the lr warm-up are fitted for {len(warm)} run(s) ({which}{', ...' if len(warm) > 4 else ''}); "
            f"the learning curve there is not the constant-lr one L(D) = e + b*D^-beta describes: --skip-warmup "
            f"leaves them out")

    for r in runs:  # a run that diverged still has rows, and they would be fitted like any others
        rise = end_rise(r.loss)
        if rise is not None:
            tail, best = rise
            res.warnings.append(
                f"run {r.name} ({r.label}): its loss ends at {tail:.3g} (median of its last tenth of rows), "
                f"{tail / best:.3f}x the lowest median of an earlier tenth, {best:.3g}; did it diverge? Its rows are "
                f"fitted as they are: leave the run out, or resume it from a checkpoint before the rise")
    # learning curves of each size, then the replicate studies
    res.curves = size_curves(runs)
    for sc in res.curves:
        if sc.distinct_d < 4:
            res.notes.append(f"size {sc.label}: {sc.distinct_d} usable row(s); its learning curve (for N_opt/D_opt "
                             f"and the intervals) needs >= 4")
            continue
        fit = fit_curves(sc.log_d, sc.log_loss, sc.weights)
        if not np.isfinite(fit.rmse_log[0]):
            res.notes.append(f"size {sc.label}: no decreasing learning curve L(D) = e + b*D^-beta fits its rows "
                             f"(is the loss falling?); it is left out of N_opt/D_opt")
            continue
        sc.fit = fit
    n_rep = max(0, int(s.n_boot))
    reps = {}
    if n_rep:
        rng = np.random.default_rng(s.seed)
        reps = _replicate_runs(res.curves, n_rep, rng, s.block)
        _replicate_curve_fits(res.curves, reps)

    # the envelope, of the fitted learning curves or of the logged losses
    grid = c_grid(runs, s.points_per_decade)
    env = build_envelope(runs, c=grid, table=_loss_table(runs, res.curves, grid, s, None)[0])
    env.overtaken = _overtaken_at_end(runs, res.curves, s)
    res.envelope = env
    mask = env.mask(s.min_runs, c_min, c_max)
    res.fit_mask = mask
    _warn_ended_while_winning(res, env)

    # L(C): the envelope's points where >= min_runs sizes are present
    in_range = env.mask(1, c_min, c_max)
    if mask.sum() < 2 and (s.c_min is not None or s.c_max is not None) and in_range.sum() < 2:
        lo, hi = flops_to_pflop_days(env.c.min()), flops_to_pflop_days(env.c.max())
        given = [f"{flag} {v:g}" for flag, v in (("--c-min", s.c_min), ("--c-max", s.c_max)) if v is not None]
        res.notes.append(f"{' and '.join(given)} leave{'s' if len(given) == 1 else ''} {in_range.sum()} envelope "
                         f"point(s): the runs span C = {lo:.3g} to "
                         f"{hi:.3g} PFLOP-days; set the bounds inside that range")
    elif mask.sum() < 2:
        res.notes.append(f"{mask.sum()} envelope point(s) with >= {s.min_runs} model sizes present"
                         f"{' in the C range' if s.c_min or s.c_max else ''}: an L(C) fit needs >= 2 points; runs "
                         f"of neighbouring sizes must overlap in C (train each past the C where the next size "
                         f"overtakes it), or lower --min-runs")
    else:
        c = flops_to_pflop_days(env.c[mask])
        res.loss_fit = _try(res, "L(C)", lambda: fit_power_law(c, env.loss[mask], 0, s.seed, s.ci, "L(C)"))
        res.offset_fit = _try(res, "eps + power law", lambda: fit_offset_power_law(
            c, env.loss[mask], 0, s.seed, s.ci, "eps + power law"))
        unfitted = [sc.label for sc in res.curves if sc.fit is None]
        if n_rep and res.loss_fit is not None and len(unfitted) == len(res.curves):
            res.notes.append(f"no size has a learning-curve fit ({', '.join(unfitted)}): the run-bootstrap "
                             f"intervals resample the residuals around those fits, so L(C) is given without an "
                             f"interval; log >= 4 rows per size")
        elif n_rep and res.loss_fit is not None:
            if unfitted:
                res.notes.append(f"sizes {', '.join(unfitted)} have no learning-curve fit: their runs enter every "
                                 f"bootstrap replicate with their logged losses, so the intervals leave out their "
                                 f"noise")
            table = _loss_table(runs, res.curves, env.c[mask], s, reps)          # [R, runs, points]
            table = np.where(np.isfinite(table), table, np.inf)
            env_rep = np.log(table.min(axis=1))                                # [R, points]
            slope, icpt = line_fits(np.broadcast_to(np.log(c), env_rep.shape), env_rep)
            with_replicate_intervals(res.loss_fit, slope, icpt, s.ci)
            if res.offset_fit is not None and s.n_boot_offset > 0:
                p = np.array([offset_refit(res.offset_fit, c, np.exp(row)) for row in env_rep[:s.n_boot_offset]])
                o = res.offset_fit
                o.eps_ci, o.coef_ci, o.exponent_ci = (percentile_interval(p[:, 0], s.ci), percentile_interval(np.exp(p[:, 1]), s.ci),
                                                      percentile_interval(p[:, 2], s.ci))
                o.ci_method, o.n_replicates = "runs", len(p)

    # N_opt, D_opt: handovers between adjacent sizes
    hs = handovers(res.curves, c_min, c_max)
    pts = optimal_points(hs)
    res.optimal = pts
    for h in hs:
        if h.status == "outside_range":
            res.notes.append(f"handover {describe(h)}")
        elif h.status != "ok" or h.reason:
            res.warnings.append(f"handover {h.small} -> {h.large}: {h.reason}")
    res.warnings += [f"handovers: {w}" for w in contradictions(hs)]
    if len(pts.used) < 2:
        res.notes.append(f"N_opt/D_opt: {len(pts.used)} observed handover(s) between adjacent sizes; a power law "
                         f"in C needs >= 2 (see the handover lines above)")
    else:
        lc = pts.log_c - LOG_PFLOP_DAY
        ld = pts.log_d
        res.n_fit = fit_power_law(np.exp(lc[0]), np.exp(pts.log_n), 0, what="N_opt(C)")
        res.d_fit = fit_power_law(np.exp(lc[0]), np.exp(ld[0]), 0, what="D_opt(C)")
        if n_rep:
            sn, inn = line_fits(lc[1:], np.broadcast_to(pts.log_n, lc[1:].shape))
            sd, ind = line_fits(lc[1:], ld[1:])
            with_replicate_intervals(res.n_fit, sn, inn, s.ci)
            with_replicate_intervals(res.d_fit, sd, ind, s.ci)
            lost = int(np.isnan(pts.log_c[1:]).any(axis=1).sum())
            if lost > 0.05 * n_rep:
                res.warnings.append(f"N_opt/D_opt: {lost} of {n_rep} replicates lost at least one handover "
                                    f"(a crossing near the end of an overlap): the intervals rest on fewer points there")
    if s.chinchilla:
        n, d, l = chinchilla_points(runs, env.c, s.smooth_decades, s.chinchilla_max_tokens)
        cut = _max_tokens_problem(runs, env.c, s, n)
        if cut:
            res.notes.append(f"Chinchilla: {cut}")
        else:
            res.chinchilla = _try(res, "Chinchilla", lambda: fit_chinchilla(n, d, l, n_starts=s.chinchilla_starts))
        if res.chinchilla is not None:
            c_fit = env.c[mask] if mask.sum() >= 2 else env.c
            res.chinchilla_alloc = _try(res, "Chinchilla N_opt/D_opt", lambda: chinchilla_allocation(
                res.chinchilla, runs, float(c_fit.min()), float(c_fit.max()), s, env.c))
            al = res.chinchilla_alloc
            if al is not None and not (al.ladder[0] <= min(al.n_opt_range) and max(al.n_opt_range) <= al.ladder[1]):
                res.warnings.append(
                    f"Chinchilla N_opt(C) runs from {al.n_opt_range[0]:,.0f} to {al.n_opt_range[1]:,.0f} over the fit's "
                    f"C range, outside the trained sizes ({al.ladder[0]:,.0f} - {al.ladder[1]:,.0f}): the law is "
                    f"extrapolated in N there (and the FLOPs per token beyond the ladder's ends)")
    return res


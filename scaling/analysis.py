"""One architecture's scaling study: envelope -> L(C), eps + power law, N_opt(C), D_opt(C), and optionally
Chinchilla approach 3. C is in PFLOP-days in every fit (the paper's unit); FLOPs-unit coefficients are
derived from those (scaling.units)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scaling.chinchilla import ChinchillaFit, fit_chinchilla
from scaling.envelope import Envelope, build_envelope, loss_at
from scaling.fits import OffsetPowerLawFit, PowerLawFit, fit_offset_power_law, fit_power_law
from scaling.runs import Run
from scaling.units import flops_to_pflop_days


@dataclass
class FitSettings:
    points_per_decade: int = 20       # C grid density (log-spaced)
    smooth_decades: float = 0.0       # half-width of the log-token box filter on each run's loss; 0 = off
    min_runs: int = 2                 # fit only at C where >= this many runs are present (see docs/scaling.md)
    c_min: float | None = None        # FLOPs; fit only C >= c_min
    c_max: float | None = None        # FLOPs; fit only C <= c_max
    n_boot: int = 1000                # bootstrap resamples for the log-linear fits
    n_boot_offset: int = 200          # ... for the eps + power-law fit (nonlinear, slower)
    ci: float = 0.95
    seed: int = 0
    chinchilla: bool = False
    chinchilla_starts: int = 16       # L-BFGS runs from the best grid starts


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
    notes: list[str] = field(default_factory=list)   # why a fit is missing

    @property
    def sizes(self) -> list[str]:
        return list(dict.fromkeys(r.label for r in self.runs))


def _try(result: ArchResult, what: str, fn):
    try:
        return fn()
    except ValueError as err:
        result.notes.append(f"{what}: {err}")
        return None


def chinchilla_points(runs: list[Run], c: np.ndarray, smooth_decades: float = 0.0) -> tuple[np.ndarray, ...]:
    """(N, D, L) of every run at the shared C grid points inside its range: each run weighs by its log-C extent,
    not by how often it logged."""
    n, d, l = [], [], []
    for r in runs:
        lc = loss_at(r, c, smooth_decades)
        ok = np.isfinite(lc)
        n.append(np.full(ok.sum(), float(r.n_params)))
        d.append(c[ok] / r.flops_per_token)
        l.append(lc[ok])
    return np.concatenate(n), np.concatenate(d), np.concatenate(l)


def analyze_arch(arch: str, runs: list[Run], s: FitSettings | None = None) -> ArchResult:
    s = s or FitSettings()
    res = ArchResult(arch=arch, runs=runs)
    n_sizes = len({r.n_params for r in runs})
    if n_sizes < 2:
        res.notes.append(f"only one model size ({runs[0].label}, {len(runs)} run(s)): a scaling law across compute "
                         f"needs runs of >= 2 sizes; with one size the envelope is just that run's learning curve "
                         f"and N_opt cannot move")
        return res
    env = build_envelope(runs, s.points_per_decade, s.smooth_decades)
    res.envelope = env
    mask = env.mask(s.min_runs, s.c_min, s.c_max)
    res.fit_mask = mask
    if mask.sum() < 2:
        res.notes.append(f"{mask.sum()} envelope point(s) with >= {s.min_runs} runs present"
                         f"{' in the C range' if s.c_min or s.c_max else ''}: a fit needs >= 2 points; runs of "
                         f"neighbouring sizes must overlap in C (train each past the C where the next size "
                         f"overtakes it), or lower --min-runs")
        return res
    c = flops_to_pflop_days(env.c[mask])
    res.loss_fit = _try(res, "L(C)", lambda: fit_power_law(c, env.loss[mask], s.n_boot, s.seed, s.ci, "L(C)"))
    res.offset_fit = _try(res, "eps + power law", lambda: fit_offset_power_law(
        c, env.loss[mask], s.n_boot_offset, s.seed, s.ci, "eps + power law"))
    winners = np.unique(env.winner[mask])
    if len({runs[i].n_params for i in winners}) < 2:
        res.notes.append(f"N_opt/D_opt: every fitted envelope point is won by one size "
                         f"({runs[winners[0]].label}); a power law in C needs >= 2 winning sizes")
    else:
        res.n_fit = _try(res, "N_opt(C)", lambda: fit_power_law(c, env.n_opt[mask], s.n_boot, s.seed, s.ci, "N_opt(C)"))
        res.d_fit = _try(res, "D_opt(C)", lambda: fit_power_law(c, env.d_opt[mask], s.n_boot, s.seed, s.ci, "D_opt(C)"))
    if s.chinchilla:
        n, d, l = chinchilla_points(runs, env.c, s.smooth_decades)
        res.chinchilla = _try(res, "Chinchilla", lambda: fit_chinchilla(n, d, l, n_starts=s.chinchilla_starts))
    return res

"""The compute envelope: at each C, the lowest loss any run of one architecture reached with C FLOPs.

Runs are logged at their own token intervals, so each run's loss is first put on a shared C grid:
log-spaced (`points_per_decade` points per factor 10 of C), spanning the union of the runs' C ranges.
A run's loss at C is linear interpolation of log-loss in log-C between its two neighbouring logged rows;
a run takes part only inside its own logged C range (no extrapolation). The winner at C is the run with
the lowest interpolated loss there.

A point's winner is reported with its context (`Envelope.status`): "interior" when it has beaten a smaller and
a larger size (a smaller size is present at that C, or one stopped earlier after the winner had overtaken it
— learning curves of two sizes cross once, so that size would still lose — and a larger size is present),
"edge_low" / "edge_high" when no smaller / larger size competes there (it may win only because nothing smaller
/ larger exists there, or because a smaller run stopped while still winning), "alone" when its size is the only
one present (its seeds may be).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scaling.runs import Run


# The densest C grid allowed. At 1,000 points per decade neighbouring grid points are 0.23% apart in C, finer than
# any fit can use: the default envelope follows smooth fitted learning curves and L(C) is a line in log-log, so on
# synthetic studies the exponents at 100 and 1,000 points per decade agree to 1-2% of their 95% intervals. Each
# point costs memory per run and replicate (n_boot x runs x points floats: 200 x 20 runs x 10 decades x 1,000
# points = 320 MB) and a row of the JSON, so a denser grid only makes the fit slower and, far denser, exhausts the
# memory (10^9 per decade: ~10^10 points) or seems to hang.
MAX_POINTS_PER_DECADE = 1000
POINTS_PER_DECADE_WHY = (f"a grid finer than {MAX_POINTS_PER_DECADE} points per decade (0.23% steps in C) adds nothing "
                         f"the fits use (at 100 and 1000 they agree to a small fraction of their intervals), and every "
                         f"grid point costs memory per run and bootstrap replicate (and a row of the JSON)")


def check_points_per_decade(points_per_decade: int) -> None:
    if not isinstance(points_per_decade, (int, np.integer)) or isinstance(points_per_decade, bool) or \
            not 1 <= points_per_decade <= MAX_POINTS_PER_DECADE:
        raise ValueError(f"points_per_decade {points_per_decade!r}: out of range; allowed: an integer from 1 to "
                         f"{MAX_POINTS_PER_DECADE} ({POINTS_PER_DECADE_WHY})")


def c_grid(runs: list[Run], points_per_decade: int = 20) -> np.ndarray:
    """Log-spaced C (FLOPs) from the smallest first-logged C to the largest last-logged C over `runs`;
    `points_per_decade` from 1 to MAX_POINTS_PER_DECADE."""
    check_points_per_decade(points_per_decade)
    lo = min(float(r.compute[0]) for r in runs)
    hi = max(float(r.compute[-1]) for r in runs)
    n = max(2, int(np.ceil(np.log10(hi / lo) * points_per_decade)) + 1)
    return np.logspace(np.log10(lo), np.log10(hi), n)


def smooth_loss(tokens: np.ndarray, loss: np.ndarray, half_width_decades: float) -> np.ndarray:
    """Mean of log-loss over a window of +-half_width_decades in log10(tokens) around each row (a box filter in
    log-token space, so it means the same whatever the logging interval). 0 leaves the loss unchanged.
    `loss` may hold replicates along its first axis ([R, rows])."""
    if half_width_decades <= 0 or loss.shape[-1] < 3:
        return loss
    x = np.log10(tokens)
    ll = np.log(loss)
    csum = np.concatenate([np.zeros(ll.shape[:-1] + (1,)), np.cumsum(ll, axis=-1)], axis=-1)
    lo = np.searchsorted(x, x - half_width_decades, side="left")
    hi = np.searchsorted(x, x + half_width_decades, side="right")
    return np.exp((csum[..., hi] - csum[..., lo]) / (hi - lo))


def loss_at(run: Run, c: np.ndarray, smooth_decades: float = 0.0, loss: np.ndarray | None = None) -> np.ndarray:
    """The run's loss at each C (FLOPs), NaN outside its logged C range. `loss` replaces the run's logged
    losses (same rows), e.g. [R, rows] bootstrap replicates, giving [R, len(c)]."""
    rc = run.compute
    loss = smooth_loss(run.tokens, run.loss if loss is None else loss, smooth_decades)
    c = np.asarray(c, dtype=np.float64)
    out = np.full(loss.shape[:-1] + c.shape, np.nan)
    # the relative slack keeps a grid end point that logspace rounded a hair outside the run's range
    inside = (c >= rc[0] * (1 - 1e-9)) & (c <= rc[-1] * (1 + 1e-9))
    if len(rc) == 1:
        out[..., inside] = loss[..., :1]
        return out
    x = np.clip(np.log(c[inside]), np.log(rc[0]), np.log(rc[-1]))
    j = np.clip(np.searchsorted(np.log(rc), x, side="right") - 1, 0, len(rc) - 2)
    t = (x - np.log(rc[j])) / (np.log(rc[j + 1]) - np.log(rc[j]))
    ll = np.log(loss)
    out[..., inside] = np.exp(ll[..., j] * (1 - t) + ll[..., j + 1] * t)
    return out


@dataclass
class Envelope:
    runs: list[Run]
    c: np.ndarray            # FLOPs, grid points where at least one run is present
    loss: np.ndarray         # minimum loss over runs at each C
    winner: np.ndarray       # index into runs of the run with that minimum
    coverage: np.ndarray     # how many runs are present at each C
    sizes_present: np.ndarray | None = None   # how many distinct model sizes are present at each C (None: as
                                              # coverage); two seeds of one size are one size here
    overtaken: np.ndarray | None = None   # per run: a larger size was at or below it at its last row (None:
                                          # judged on the grid, by the winner at its last grid point)

    @property
    def n_opt(self) -> np.ndarray:
        """Non-embedding parameters (paper formula) of the winning run at each C."""
        return np.array([self.runs[i].n_params for i in self.winner], dtype=np.float64)

    @property
    def d_opt(self) -> np.ndarray:
        """Tokens the winning run had trained on when it reached C."""
        return self.c / np.array([self.runs[i].flops_per_token for i in self.winner])

    @property
    def status(self) -> np.ndarray:
        """Per point: interior | edge_low | edge_high | alone (see the module docstring)."""
        n = np.array([r.n_params for r in self.runs], dtype=np.float64)
        present = self.present
        nw = n[self.winner]
        hi = np.array([r.compute[-1] for r in self.runs])[:, None] * (1 + 1e-9)
        beaten_before = (self.c[None, :] > hi) & self.overtaken_runs()[:, None]
        smaller = ((present | beaten_before) & (n[:, None] < nw[None, :])).any(axis=0)
        larger = (present & (n[:, None] > nw[None, :])).any(axis=0)
        return np.where(smaller & larger, "interior", np.where(~smaller & ~larger, "alone",
                                                               np.where(smaller, "edge_high", "edge_low")))

    @property
    def present(self) -> np.ndarray:
        """[runs, points]: run i has logged rows around C."""
        lo = np.array([r.compute[0] for r in self.runs])[:, None] * (1 - 1e-9)
        hi = np.array([r.compute[-1] for r in self.runs])[:, None] * (1 + 1e-9)
        return (self.c[None, :] >= lo) & (self.c[None, :] <= hi)

    def overtaken_runs(self) -> np.ndarray:
        """Per run: whether a larger size had overtaken it by the end of its range (`overtaken` when set, else
        the winner at the run's last grid point is larger)."""
        if self.overtaken is not None:
            return np.asarray(self.overtaken, dtype=bool)
        n = np.array([r.n_params for r in self.runs], dtype=np.float64)
        out = np.zeros(len(self.runs), dtype=bool)
        for i, row in enumerate(self.present):
            where = np.nonzero(row)[0]
            out[i] = len(where) > 0 and n[self.winner[where[-1]]] > n[i]
        return out

    def ended_while_winning(self) -> list[tuple[int, int, float]]:
        """(run, next winner, C) for each run that wins the envelope at its last logged point while another run
        goes on: the winner changes there because the run stopped, not because it was overtaken."""
        out = []
        present = self.present
        for i in range(len(self.runs)):
            where = np.nonzero(present[i])[0]
            if len(where) == 0:
                continue
            last = where[-1]
            if self.winner[last] == i and last + 1 < len(self.c) and not present[i, last + 1]:
                out.append((i, int(self.winner[last + 1]), float(self.c[last])))
        return out

    def mask(self, min_sizes: int = 1, c_min: float | None = None, c_max: float | None = None) -> np.ndarray:
        """Points where at least `min_sizes` model sizes compete, within [c_min, c_max] FLOPs. Sizes, not runs:
        where only the seeds of one size are present the envelope is that size's learning curve, not a minimum
        over sizes, and counting its seeds as competitors would let the number of seeds move the L(C) fit."""
        m = (self.coverage if self.sizes_present is None else self.sizes_present) >= min_sizes
        if c_min is not None:
            m &= self.c >= c_min
        if c_max is not None:
            m &= self.c <= c_max
        return m


def build_envelope(runs: list[Run], points_per_decade: int = 20, smooth_decades: float = 0.0,
                   c: np.ndarray | None = None, table: np.ndarray | None = None) -> Envelope:
    """The envelope of the runs' logged (optionally smoothed) losses, or of `table` ([runs, len(c)] losses at the
    grid `c`, NaN where a run is absent), e.g. their fitted learning curves."""
    if not runs:
        raise ValueError("build_envelope needs at least one run")
    c = c_grid(runs, points_per_decade) if c is None else np.asarray(c, dtype=np.float64)
    if table is None:
        table = np.stack([loss_at(r, c, smooth_decades) for r in runs])   # [runs, C]
    present = np.isfinite(table)
    coverage = present.sum(axis=0)
    n = np.array([r.n_params for r in runs])
    sizes = sum(present[n == size].any(axis=0).astype(int) for size in np.unique(n))
    keep = coverage > 0
    table = np.where(present, table, np.inf)[:, keep]
    winner = np.argmin(table, axis=0)
    return Envelope(runs=runs, c=c[keep], loss=table[winner, np.arange(table.shape[1])],
                    winner=winner, coverage=coverage[keep], sizes_present=sizes[keep])


def inside_range(run: Run, c: np.ndarray) -> np.ndarray:
    """Grid points within the run's logged C range (the same slack as loss_at)."""
    return (c >= run.compute[0] * (1 - 1e-9)) & (c <= run.compute[-1] * (1 + 1e-9))

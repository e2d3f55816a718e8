"""Figure-1-style plots (matplotlib, Agg). Per architecture: the loss of every size against C with the envelope
and the L(C) fits; N_opt and D_opt against C with the envelope's winners (interior vs edge-won), the
handover points the fits use, and the fits with their 95% bands. One more figure compares architectures.

Conventions on every figure: C in PFLOP-days on the x axis, named for what it counts; colour = architecture
(one hue per architecture, its spec's `color`), shade = model size (light = small, dark = large, legend sorted
by size); sizes written as people write them (2.8B); loss on a log axis with plain tick labels (2.2, 2.4, ...).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402

from models.registry import arch_names, arch_title, get_arch  # noqa: E402
from scaling.analysis import ArchResult  # noqa: E402
from scaling.report import compute_name, loss_name  # noqa: E402
from scaling.runs import size_label  # noqa: E402
from scaling.units import flops_to_pflop_days  # noqa: E402

SIZE_MARKERS = "ovs^Dp*hX<>"


def arch_color(arch: str) -> str:
    """The architecture's hue (grey for one without a colour, or not registered)."""
    try:
        return get_arch(arch).color or "#7f7f7f"
    except ValueError:
        return "#7f7f7f"


def size_shades(arch: str, k: int) -> list[tuple[float, float, float]]:
    """k shades of the architecture's colour, light (small) to dark (large)."""
    base = np.array(to_rgb(arch_color(arch)))
    mix = np.linspace(0.55, -0.35, k) if k > 1 else np.array([0.0])
    return [tuple(np.clip(base + m * (1 - base) if m > 0 else base * (1 + m), 0, 1)) for m in mix]


def c_label(include_embedding: bool) -> str:
    return f"C (PFLOP-days): {compute_name(include_embedding)}"


def loss_axis(ax, lo: float, hi: float) -> None:
    """Plain, evenly stepped tick labels on a log loss axis (2.2, 2.4, ...) instead of powers of ten."""
    span = hi - lo
    step = next((s for s in (0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0) if span / s <= 8), 10.0)
    ticks = np.arange(np.floor(lo / step) * step, hi + step * 0.5, step)
    ticks = ticks[(ticks >= lo - 1e-12) & (ticks <= hi + 1e-12) & (ticks > 0)]
    decimals = max(0, int(-np.floor(np.log10(step) + 1e-9)))
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{t:.{decimals}f}" for t in ticks]))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_ylim(lo, hi)


def plain_log_ticks(ax, axis: str = "y") -> None:
    """Ticks at 1, 2, 5 x 10^k labelled as plain numbers (20, 50, 100) on a log axis."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _size_name(label: str, n: float) -> str:
    human = size_label(n)
    return human if label.lower() == human.lower() else f"{label} ({human})"


def _band(ax, x: np.ndarray, fit, color: str) -> None:
    """The fit's 95% band from its coefficient and exponent intervals (pivoting at the data's centre)."""
    lo, hi = fit.exponent_ci
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return
    xc = np.exp(np.mean(np.log(x)))
    yc = fit(xc)
    ys = np.stack([yc * (x / xc) ** e for e in (lo, hi)])
    ax.fill_between(x, ys.min(0), ys.max(0), color=color, alpha=0.12, lw=0)


def _fit_line(ax, c: np.ndarray, fit, color: str, label: str, style: str = "--", band: bool = False) -> None:
    x = np.logspace(np.log10(c.min()), np.log10(c.max()), 100)
    ax.plot(x, fit(x), style, color=color, lw=1.6, label=label)
    if band:
        _band(ax, x, fit, color)


_BOUND_MARKERS = {"<": "v", ">": "^", "≈": "D"}


def _n_opt_evidence(ax, r: ArchResult, color: str, c_span: tuple[float, float] | None, label: bool) -> bool:
    """What each adjacent pair says about N_opt (scaling.optimal.Handover.n_opt_bound: v = below the larger size,
    ^ = above the smaller, a bar between the two sizes at a handover) and the paper's N_opt(C) over `c_span`
    (PFLOP-days), extrapolated, dotted. Returns whether anything was drawn."""
    from scaling.paper import paper_law_at
    drawn = False
    for h in (r.optimal.handovers if r.optimal is not None else []):
        b = h.n_opt_bound()
        if b is None:
            continue
        c = float(flops_to_pflop_days(b[0]))
        if b[1] == "≈":
            ax.plot([c, c], [h.n_small, h.n_large], color=color, lw=1.5, alpha=0.8)
        ax.scatter([c], [b[2]], marker=_BOUND_MARKERS[b[1]], s=28, color=color, alpha=0.8, zorder=4,
                   label=None if drawn or not label else "N_opt bound of a size pair (v below, ^ above, | between)")
        drawn = True
    x = np.geomspace(*c_span, 50) if c_span is not None else None
    paper = paper_law_at(r.arch, "N_opt", x) if x is not None and drawn else None
    if paper is not None:
        ax.plot(x, paper, ":", color=color, lw=1.3, label="paper's N_opt(C), extrapolated" if label else None)
    return drawn


def plot_arch(r: ArchResult, out: Path, include_embedding: bool, loss_key: str = "loss") -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    color = arch_color(r.arch)
    runs = sorted(r.runs, key=lambda x: (x.n_params, x.name))
    sizes = sorted({x.n_params for x in runs})
    shade = dict(zip(sizes, size_shades(r.arch, len(sizes))))
    seen = set()
    for run in runs:
        label = None if run.n_params in seen else _size_name(run.label, run.n_params)
        seen.add(run.n_params)
        ax.plot(flops_to_pflop_days(run.compute), run.loss, lw=1.1, color=shade[run.n_params], label=label)
    losses = np.concatenate([x.loss for x in runs])
    env = r.envelope
    if env is not None:
        c = flops_to_pflop_days(env.c)
        m = r.fit_mask
        ax.plot(c[m], env.loss[m], color="black", lw=2.4, alpha=0.45, label="envelope (fitted range)")
        if r.loss_fit is not None:
            f = r.loss_fit
            _fit_line(ax, c[m], f, "black", f"L = {f.coef:.4f}·C^{f.exponent:.4f}")
        if r.offset_fit is not None:
            o = r.offset_fit
            _fit_line(ax, c[m], o, "dimgray", f"L = {o.eps:.3f} + {o.coef:.3g}·C^{o.exponent:.3f}", ":")
        status = env.status
        interior = status == "interior"
        for ax2, y, fit, name in ((axes[1], env.n_opt, r.n_fit, "N_opt"), (axes[2], env.d_opt, r.d_fit, "D_opt")):
            ax2.scatter(c[interior], y[interior], s=9, color=color, alpha=0.5, label="envelope winner (interior)")
            ax2.scatter(c[~interior], y[~interior], s=9, facecolors="none", edgecolors="gray", alpha=0.6,
                        label="edge-won (no smaller / larger size competing): not fitted")
            pts = r.optimal
            if pts is not None and pts.used:
                hc = flops_to_pflop_days(np.exp(pts.log_c[0]))
                hy = np.exp(pts.log_n) if name == "N_opt" else np.exp(pts.log_d[0])
                ax2.scatter(hc, hy, s=60, marker="D", color=color, edgecolors="black", zorder=5,
                            label="handover of adjacent sizes (fitted)")
            if name == "N_opt" and fit is None:
                _n_opt_evidence(ax2, r, "black", (float(c.min()), float(c.max())), label=True)
            al = r.chinchilla_alloc
            if al is not None:
                f3 = al.n_fit if name == "N_opt" else al.d_fit
                lo, hi = f3.exponent_ci
                ci = f" [{lo:.2f}, {hi:.2f}]" if np.isfinite(lo) else ""
                _fit_line(ax2, np.array(al.c_range), f3, color, f"approach 3: {name} = {f3.coef:.3g}·C^{f3.exponent:.3f}{ci}",
                          style="-.", band=True)
            if fit is not None and pts is not None and pts.used:
                lo, hi = fit.exponent_ci
                ci = f" [{lo:.3f}, {hi:.3f}]" if np.isfinite(lo) else ""
                span = np.array([hc.min() / 3, hc.max() * 3])   # the fit's support: its handovers
                _fit_line(ax2, span, fit, "black", f"{name} = {fit.coef:.3g}·C^{fit.exponent:.3f}{ci}", band=True)
    lo, hi = float(losses.min()), float(losses.max())
    axes[0].set_yscale("log")
    loss_axis(axes[0], lo * 0.98, hi * 1.02)
    return _finish(fig, axes, (f"{loss_name(loss_key)} (nats/token)", "N (non-embedding parameters)", "D (tokens)"), 8,
                   f"{arch_title(r.arch)}: loss, optimal model size and data size against compute",
                   out / f"scaling_{r.arch}.png", include_embedding, log_y=(False, True, True))


def plot_compare(results: list[ArchResult], out: Path, include_embedding: bool, loss_key: str = "loss") -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    lo, hi = np.inf, 0.0
    c_lo, c_hi = np.inf, 0.0
    for r in results:
        if r.envelope is None or not r.fit_mask.any():
            continue
        color = arch_color(r.arch)
        c = flops_to_pflop_days(r.envelope.c)
        m = r.fit_mask
        c_lo, c_hi = min(c_lo, c[m].min()), max(c_hi, c[m].max())
        axes[0].plot(c[m], r.envelope.loss[m], color=color, alpha=0.35, lw=2.5)
        lo, hi = min(lo, r.envelope.loss[m].min()), max(hi, r.envelope.loss[m].max())
        used = r.optimal.used if r.optimal is not None else []
        hc = flops_to_pflop_days(np.array([h.c for h in used])) if used else c[m]
        for ax, fit, span in zip(axes, (r.loss_fit, r.n_fit, r.d_fit), (c[m], hc, hc)):
            if fit is not None:
                span = np.array([span.min(), span.max()]) * ([1, 1] if ax is axes[0] else [1 / 3, 3])
                _fit_line(ax, span, fit, color, f"{arch_title(r.arch)}: {fit.coef:.4g}·C^{fit.exponent:.4f}",
                          band=ax is not axes[0])
        al = r.chinchilla_alloc
        if al is not None:
            for ax, fit in ((axes[1], al.n_fit), (axes[2], al.d_fit)):
                _fit_line(ax, np.array(al.c_range), fit, color,
                          f"{arch_title(r.arch)} (approach 3): {fit.coef:.3g}·C^{fit.exponent:.3f}", style="-.")
    axes[0].set_yscale("log")
    if np.isfinite(lo):
        loss_axis(axes[0], lo * 0.98, hi * 1.02)
    bounds = False
    alloc = any(r.chinchilla_alloc is not None for r in results)
    if all(r.n_fit is None for r in results) and np.isfinite(c_lo) and not alloc:
        for r in results:
            bounds |= _n_opt_evidence(axes[1], r, arch_color(r.arch), (c_lo, c_hi), label=False)
        if bounds:
            from matplotlib.lines import Line2D
            axes[1].legend(handles=[Line2D([], [], color=arch_color(r.arch), marker="v", ls=":", label=arch_title(r.arch))
                                    for r in results], fontsize=8, loc="lower right")
    if alloc and np.isfinite(c_lo):
        from scaling.paper import paper_law_at
        x = np.geomspace(c_lo, c_hi, 50)
        for r in results:
            for ax, law in ((axes[1], "N_opt"), (axes[2], "D_opt")):
                y = paper_law_at(r.arch, law, x)
                if y is not None:
                    ax.plot(x, y, ":", color=arch_color(r.arch), lw=1.2,
                            label=f"{arch_title(r.arch)}: paper's {law}(C), extrapolated")
    for ax, law, attr in ((axes[1], "N_opt", "n_fit"), (axes[2], "D_opt", "d_fit")):
        if ax is axes[1] and bounds:
            ax.text(0.02, 0.98, "no N_opt(C) fitted (< 2 handovers each); markers: what each pair of adjacent\n"
                    "sizes says about N_opt (v below the larger size, ^ above the smaller, | a handover);\n"
                    "dotted: the paper's N_opt(C), extrapolated", transform=ax.transAxes, ha="left", va="top",
                    fontsize=7.5, color="0.3")
            continue
        if all(getattr(r, attr) is None for r in results) and not alloc:
            # an empty panel would read as a plotting failure: say why it is empty, on the loss panel's C range
            if np.isfinite(c_lo):
                ax.set_xscale("log")
                ax.set_xlim(c_lo, c_hi)
            ax.text(0.5, 0.5, f"no {law}(C) fitted for any architecture:\nit needs >= 2 handovers between adjacent "
                    "sizes\n(see the fit notes)", transform=ax.transAxes, ha="center", va="center", fontsize=10,
                    color="0.35")
    return _finish(fig, axes, (f"{loss_name(loss_key)} (envelope and fit, nats/token)",
                               "N_opt (non-embedding parameters)", "D_opt (tokens)"), 8, "scaling laws by architecture",
                   out / "scaling_compare.png", include_embedding, log_y=(False, True, True))


def _finish(fig, axes, ylabels, legend_size: int, title: str, path: Path, include_embedding: bool,
            log_y=(True, True, True)) -> Path:
    for a, ylabel, logy in zip(axes, ylabels, log_y):
        a.set_xscale("log")
        if logy:
            a.set_yscale("log")
        a.set_xlabel(c_label(include_embedding), fontsize=8)
        a.set_ylabel(ylabel)
        a.grid(True, which="major", alpha=0.3)
        handles = a.get_legend_handles_labels()[0]
        if len(handles) > 10:
            # a legend of many sizes goes under its panel, where it cannot hide the curves
            ncol = 3
            a.legend(fontsize=legend_size, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol)
            fig.set_figheight(max(fig.get_figheight(), 5 + 0.2 * -(-len(handles) // ncol)))
        elif handles:
            a.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: list[ArchResult], out: str | Path, include_embedding: bool = False,
                loss_key: str = "loss") -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_arch(r, out, include_embedding, loss_key) for r in results]
    if sum(r.loss_fit is not None for r in results) >= 1:
        paths.append(plot_compare(results, out, include_embedding, loss_key))
    # a plot an earlier fit wrote into this folder and this one did not (an architecture no longer among the
    # runs; no comparison where nothing was fitted) would be read beside the new ones as current: remove the
    # figures this function names, and nothing else in the folder
    archs = {*arch_names(), *(r.arch for r in results)}
    ours = {out / "scaling_compare.png", *(out / f"scaling_{a}.png" for a in archs)}
    for stale in sorted(ours - set(paths)):
        stale.unlink(missing_ok=True)
    return paths

"""Figure-1-style plots (matplotlib, Agg): per architecture, loss curves of every size on log-log axes with the
envelope and the fits, and the envelope winners' N and D against C; plus one figure comparing architectures.
C is in PFLOP-days on every axis."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from scaling.analysis import ArchResult  # noqa: E402
from scaling.units import flops_to_pflop_days  # noqa: E402

ARCH_COLORS = {"llama": "tab:blue", "tnl": "tab:orange", "hgrn2": "tab:green", "cos2": "tab:red"}


def _fit_line(ax, c: np.ndarray, fit, color: str, label: str, style: str = "--") -> None:
    x = np.logspace(np.log10(c[0]), np.log10(c[-1]), 100)
    ax.plot(x, fit(x), style, color=color, lw=1.5, label=label)


def plot_arch(r: ArchResult, out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    cmap = plt.get_cmap("viridis")
    for k, run in enumerate(r.runs):
        ax.plot(flops_to_pflop_days(run.compute), run.loss, lw=1, alpha=0.8,
                color=cmap(k / max(1, len(r.runs) - 1)), label=f"{run.label} ({run.n_params / 1e6:.3g}M)")
    env = r.envelope
    if env is not None:
        c = flops_to_pflop_days(env.c)
        m = r.fit_mask
        ax.plot(c, env.loss, color="black", lw=2.2, alpha=0.5, label="envelope")
        if r.loss_fit is not None:
            f = r.loss_fit
            _fit_line(ax, c[m], f, "red", f"L = {f.coef:.4f}·C^{f.exponent:.4f}")
        if r.offset_fit is not None:
            o = r.offset_fit
            _fit_line(ax, c[m], o, "purple", f"L = {o.eps:.3f} + {o.coef:.3f}·C^{o.exponent:.3f}", ":")
        for ax2, y, fit, name in ((axes[1], env.n_opt, r.n_fit, "N_opt"), (axes[2], env.d_opt, r.d_fit, "D_opt")):
            ax2.scatter(c[m], y[m], s=10, color="black", label=f"envelope winner ({name})")
            ax2.scatter(c[~m], y[~m], s=10, facecolors="none", edgecolors="gray", label="not fitted (coverage / range)")
            if fit is not None:
                _fit_line(ax2, c[m], fit, "red", f"{name} = {fit.coef:.3g}·C^{fit.exponent:.3f}")
    return _finish(fig, axes, ("training loss", "N_opt (non-embedding params)", "D_opt (tokens)"), 7,
                   f"{r.arch}: loss, optimal model size and data size against compute", out / f"scaling_{r.arch}.png")


def plot_compare(results: list[ArchResult], out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for r in results:
        if r.envelope is None or not r.fit_mask.any():
            continue
        color = ARCH_COLORS.get(r.arch, None)
        c = flops_to_pflop_days(r.envelope.c)
        m = r.fit_mask
        axes[0].plot(c[m], r.envelope.loss[m], color=color, alpha=0.35, lw=2)
        for ax, fit in zip(axes, (r.loss_fit, r.n_fit, r.d_fit)):
            if fit is not None:
                _fit_line(ax, c[m], fit, color, f"{r.arch}: {fit.coef:.4g}·C^{fit.exponent:.4f}")
    return _finish(fig, axes, ("loss (envelope and fit)", "N_opt (non-embedding params)", "D_opt (tokens)"), 8,
                   "scaling laws by architecture", out / "scaling_compare.png")


def _finish(fig, axes, ylabels: tuple[str, ...], legend_size: int, title: str, path: Path) -> Path:
    """Log-log axes against C in PFLOP-days, legends, title; save and close."""
    for a, ylabel in zip(axes, ylabels):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("C (PFLOP-days)")
        a.set_ylabel(ylabel)
        a.grid(True, which="both", alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=legend_size)
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(results: list[ArchResult], out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_arch(r, out) for r in results]
    if sum(r.loss_fit is not None for r in results) >= 1:
        paths.append(plot_compare(results, out))
    return paths

"""Outputs of a scaling study: the Table-3-style Markdown tables, the JSON record, and the console summary."""
from __future__ import annotations

import math
from dataclasses import asdict

from scaling.analysis import ArchResult, FitSettings
from scaling.paper import PAPER_A_RANGE, PAPER_B_RANGE, PAPER_UNIT, paper_reference
from scaling.units import PFLOP_DAY, coef_pflop_days_to_flops, flops_to_pflop_days

UNITS = {
    "C": f"PFLOP-days (1 PFLOP-day = 1e15 * 86400 = {PFLOP_DAY:.3e} FLOPs) unless a key ends in _flops",
    "N": "non-embedding parameters, the paper's formula (models.accounting.paper_non_embedding_params)",
    "D": "training tokens",
    "L": "training loss as logged (nats/token)",
    "laws": "L = beta * C^alpha;  L = eps + beta * C^alpha;  N_opt = n_coef * C^a;  D_opt = d_coef * C^b",
}


def _ci(ci) -> str:
    lo, hi = ci
    return "" if not (math.isfinite(lo) and math.isfinite(hi)) else f" [{lo:.4g}, {hi:.4g}]"


def _law(coef: float, exponent: float, digits: int = 4) -> str:
    c = f"{coef:.{digits}f}" if 1e-3 <= abs(coef) < 1e4 else f"{coef:.3e}"
    return f"{c}·C^{exponent:.{digits}f}"


def _runs_record(r: ArchResult) -> list[dict]:
    out = []
    for run in r.runs:
        c = run.compute
        out.append({"path": str(run.path), "size": run.size, "n_params": run.n_params,
                    "n_params_exact": run.n_params_exact, "seq_len": run.seq_len,
                    "flops_per_token": run.flops_per_token, "rows_used": int(len(run.tokens)),
                    "rows_skipped": run.skipped, "tokens_max": float(run.tokens[-1]),
                    "c_range_pflop_days": [float(flops_to_pflop_days(c[0])), float(flops_to_pflop_days(c[-1]))]})
    return out


def arch_record(r: ArchResult) -> dict:
    rec: dict = {"sizes": r.sizes, "runs": _runs_record(r), "notes": r.notes, "paper": paper_reference(r.arch)}
    if r.envelope is not None:
        env, m = r.envelope, r.fit_mask
        rec["envelope"] = {
            "c_pflop_days": flops_to_pflop_days(env.c).tolist(), "loss": env.loss.tolist(),
            "winner": [env.runs[i].name for i in env.winner], "n_opt": env.n_opt.tolist(),
            "d_opt": env.d_opt.tolist(), "coverage": env.coverage.tolist(), "used_in_fit": m.tolist()}
        if m.any():
            rec["fit_c_range_pflop_days"] = [float(flops_to_pflop_days(env.c[m][0])),
                                             float(flops_to_pflop_days(env.c[m][-1]))]
    if r.loss_fit is not None:
        f = r.loss_fit
        rec.update(alpha=f.exponent, beta=f.coef, alpha_ci=list(f.exponent_ci), beta_ci=list(f.coef_ci),
                   beta_flops=coef_pflop_days_to_flops(f.coef, f.exponent), loss_fit_r2=f.r2,
                   n_points=f.n_points)
    if r.offset_fit is not None:
        o = r.offset_fit
        rec["eps_power_law"] = {**asdict(o), "coef_flops": coef_pflop_days_to_flops(o.coef, o.exponent)}
    if r.n_fit is not None:
        rec.update(a=r.n_fit.exponent, a_ci=list(r.n_fit.exponent_ci), n_coef=r.n_fit.coef,
                   n_coef_ci=list(r.n_fit.coef_ci), n_coef_flops=coef_pflop_days_to_flops(r.n_fit.coef, r.n_fit.exponent))
    if r.d_fit is not None:
        rec.update(b=r.d_fit.exponent, b_ci=list(r.d_fit.exponent_ci), d_coef=r.d_fit.coef,
                   d_coef_ci=list(r.d_fit.coef_ci), d_coef_flops=coef_pflop_days_to_flops(r.d_fit.coef, r.d_fit.exponent))
    if r.chinchilla is not None:
        rec["chinchilla"] = r.chinchilla.to_dict()
    return rec


def _strict(x):
    """NaN/inf (an interval that could not be computed) -> null, so the file is standard JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def to_json(results: list[ArchResult], settings: FitSettings, include_embedding: bool) -> dict:
    return _strict({"units": UNITS, "include_embedding_flops": include_embedding, "settings": asdict(settings),
                    "paper_unit": PAPER_UNIT, "archs": {r.arch: arch_record(r) for r in results}})


def markdown_tables(results: list[ArchResult], include_embedding: bool) -> str:
    emb = "with" if include_embedding else "without"
    lines = [f"C in PFLOP-days (1 PFLOP-day = {PFLOP_DAY:.2e} FLOPs), training FLOPs by the paper's formulas "
             f"{emb} the embedding term; N non-embedding parameters (paper formula); D tokens; 95% bootstrap intervals.",
             "",
             "| arch | sizes | fit C range (PFLOP-days) | L(C) | α | N_opt(C) | a | D_opt(C) | b | paper L(C) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rng = "—"
        if r.fit_mask is not None and r.fit_mask.any():
            c = flops_to_pflop_days(r.envelope.c[r.fit_mask])
            rng = f"{c[0]:.3g} – {c[-1]:.3g}"
        lf, nf, df = r.loss_fit, r.n_fit, r.d_fit
        ref = paper_reference(r.arch)
        paper = _law(ref["beta"], ref["alpha"]) if "beta" in ref else "—"
        lines.append("| " + " | ".join([
            r.arch, f"{len(r.sizes)}", rng,
            _law(lf.coef, lf.exponent) if lf else "—", f"{lf.exponent:.4f}{_ci(lf.exponent_ci)}" if lf else "—",
            _law(nf.coef, nf.exponent, 3) if nf else "—", f"{nf.exponent:.3f}{_ci(nf.exponent_ci)}" if nf else "—",
            _law(df.coef, df.exponent, 3) if df else "—", f"{df.exponent:.3f}{_ci(df.exponent_ci)}" if df else "—",
            paper]) + " |")
    lines += ["", f"Paper (C in PFLOP-days): N_opt exponents a in {PAPER_A_RANGE[0]}–{PAPER_A_RANGE[1]}, "
                  f"D_opt exponents b in {PAPER_B_RANGE[0]}–{PAPER_B_RANGE[1]} over the four architectures."]
    offs = [r for r in results if r.offset_fit is not None]
    if offs:
        lines += ["", "L(C) = ε + β·C^α (C in PFLOP-days):", "",
                  "| arch | ε | β | α | rmse of log L |", "|---|---|---|---|---|"]
        for r in offs:
            o = r.offset_fit
            lines.append(f"| {r.arch} | {o.eps:.4f}{_ci(o.eps_ci)} | {o.coef:.4f}{_ci(o.coef_ci)} | "
                         f"{o.exponent:.4f}{_ci(o.exponent_ci)} | {o.rmse_log:.2e} |")
    chs = [r for r in results if r.chinchilla is not None]
    if chs:
        lines += ["", "Chinchilla approach 3, L(N, D) = E + A/N^α + B/D^β (Huber δ=1e-3 on log L; implied "
                      "a = β/(α+β), b = α/(α+β) assume C ∝ N·D):", "",
                  "| arch | E | A | B | α | β | implied a | implied b | points |", "|---|---|---|---|---|---|---|---|---|"]
        for r in chs:
            f = r.chinchilla
            lines.append(f"| {r.arch} | {f.E:.4f} | {f.A:.4g} | {f.B:.4g} | {f.alpha:.4f} | {f.beta:.4f} | "
                         f"{f.a:.3f} | {f.b:.3f} | {f.n_points} |")
    return "\n".join(lines)


def console_summary(results: list[ArchResult], problems: list[str], include_embedding: bool) -> str:
    out = []
    for r in results:
        out.append(f"{r.arch}: {len(r.runs)} run(s), sizes {', '.join(r.sizes)}")
        for run in r.runs:
            skip = f", skipped {run.n_skipped} ({'; '.join(f'{k}: {v}' for k, v in run.skipped.items())})" \
                if run.skipped else ""
            out.append(f"  {run.name}: N={run.n_params / 1e6:.2f}M, {len(run.tokens)} rows used{skip}")
        for note in r.notes:
            out.append(f"  NOTE {note}")
    for p in problems:
        out.append(f"left out: {p}")
    out += ["", markdown_tables(results, include_embedding)]
    return "\n".join(out)

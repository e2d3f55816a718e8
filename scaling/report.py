"""Outputs of a scaling study: the Markdown tables (ours, and Table 3 side by side with the paper's), the JSON
record, and the console summary. Every table names the C it is in."""
from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from scaling.analysis import ArchResult, FitSettings
from scaling.paper import LAWS, PAPER, PAPER_INCLUDES_EMBEDDING, PAPER_TABLE3, PAPER_UNIT, paper_reference
from scaling.runs import size_label
from scaling.units import PFLOP_DAY, coef_pflop_days_to_flops, flops_to_pflop_days


def compute_name(include_embedding: bool) -> str:
    """What C counts, in words (printed on every table and plot)."""
    return ("training FLOPs including the embedding (LM-head) term" if include_embedding else
            "training FLOPs without the embedding term (the paper's C)")


def compute_short(include_embedding: bool) -> str:
    return "C with embedding FLOPs" if include_embedding else "C without embedding FLOPs (paper)"


def loss_name(loss_key: str = "loss") -> str:
    """What the fitted L is, in words: the metrics.jsonl key the fit read (`--loss-key`)."""
    return {"loss": "training loss", "val_loss": "validation loss"}.get(loss_key, f"'{loss_key}'")


def units(include_embedding: bool, loss_key: str = "loss") -> dict:
    return {
        "C": f"PFLOP-days (1 PFLOP-day = 1e15 * 86400 = {PFLOP_DAY:.3e} FLOPs) unless a key ends in _flops; "
             f"{compute_name(include_embedding)}, by the paper's formulas (models.accounting)",
        "N": "non-embedding parameters, the paper's formula (models.accounting.paper_non_embedding_params)",
        "D": "training tokens",
        "L": f"{loss_name(loss_key)} as logged (metrics.jsonl key '{loss_key}'; nats/token)",
        "laws": "L = beta * C^alpha;  L = eps + beta * C^alpha;  N_opt = n_coef * C^a;  D_opt = d_coef * C^b",
        "chinchilla_allocation": "N_opt(C), D_opt(C) of the approach-3 law L(N, D) under the architecture's own "
                                 "C = fpt(N)·D (argmin over N, fpt log-log interpolated between the sizes), power laws "
                                 "fitted over the L(C) fit's C range; intervals: percentiles of a bootstrap over runs",
        "intervals": "over replicate studies (each run's residuals resampled in blocks around its fitted learning "
                     "curve; every fit redone), ci_method 'runs': L(C), N_opt, D_opt symmetric about the estimate "
                     "(the longer arm of the replicates' percentile interval; coefficients in log space); "
                     "eps + power law: percentiles",
    }


def _ci(ci) -> str:
    lo, hi = ci
    return "" if not (math.isfinite(lo) and math.isfinite(hi)) else f" [{lo:.4g}, {hi:.4g}]"


def _law(coef: float, exponent: float, digits: int = 4) -> str:
    c = f"{coef:.{digits}f}" if 1e-3 <= abs(coef) < 1e4 else f"{coef:.3g}"
    return f"{c}·C^{exponent:.{digits}f}"


def _runs_record(r: ArchResult) -> list[dict]:
    out = []
    for run in r.runs:
        c = run.compute
        out.append({"path": str(run.path), "size": run.size, "n_params": run.n_params,
                    "n_params_exact": run.n_params_exact, "seq_len": run.seq_len,
                    "flops_per_token": run.flops_per_token, "rows_used": int(len(run.tokens)),
                    "rows_skipped": run.skipped, "warmup_tokens": run.warmup_tokens,
                    "tokens_max": float(run.tokens[-1]),
                    "c_range_pflop_days": [float(flops_to_pflop_days(c[0])), float(flops_to_pflop_days(c[-1]))]})
    return out


def _curve_record(r: ArchResult) -> list[dict]:
    out = []
    for sc in r.curves:
        rec = {"size": sc.label, "n_params": sc.n_params, "runs": [x.name for x in sc.runs],
               # every usable row of the size's runs; above scaling.optimal.MAX_CURVE_ROWS they are averaged in
               # bins of log D into fewer fitted points
               "rows": len(sc.row_idx), "fitted_points": len(sc.log_d)}
        if sc.fit is not None:
            f = sc.fit
            rec.update(e=float(f.e[0]), b=float(f.b[0] * f.d_ref ** f.beta[0]), beta=float(f.beta[0]),
                       rmse_log=float(f.rmse_log[0]), law="L(D) = e + b * D^-beta, D in tokens")
        out.append(rec)
    return out


def arch_record(r: ArchResult) -> dict:
    rec: dict = {"sizes": r.sizes, "runs": _runs_record(r), "notes": r.notes, "warnings": r.warnings,
                 "paper": paper_reference(r.arch), "learning_curves": _curve_record(r)}
    if r.envelope is not None:
        env, m = r.envelope, r.fit_mask
        rec["envelope"] = {
            "c_pflop_days": flops_to_pflop_days(env.c).tolist(), "loss": env.loss.tolist(),
            "winner": [env.runs[i].name for i in env.winner], "n_opt": env.n_opt.tolist(),
            "d_opt": env.d_opt.tolist(), "coverage": env.coverage.tolist(),
            "sizes_present": (env.coverage if env.sizes_present is None else env.sizes_present).tolist(),
            "used_in_fit": m.tolist(),
            "status": env.status.tolist()}
        rec["envelope_points_by_status"] = r.edge_summary()
        if m.any():
            rec["fit_c_range_pflop_days"] = [float(flops_to_pflop_days(env.c[m][0])),
                                             float(flops_to_pflop_days(env.c[m][-1]))]
    if r.optimal is not None:
        rec["handovers"] = [{"small": h.small, "large": h.large, "status": h.status, "reason": h.reason,
                             **({"c_pflop_days": float(flops_to_pflop_days(h.c)), "n": h.n, "d": h.d}
                                if h.status == "ok" else {}),
                             **({"n_opt_bound": {"c_pflop_days": float(flops_to_pflop_days(b[0])), "relation": b[1],
                                                 "n": b[2], "n_small": h.n_small, "n_large": h.n_large}} if (b := h.n_opt_bound()) else {})}
                            for h in r.optimal.handovers]
    if r.loss_fit is not None:
        f = r.loss_fit
        rec.update(alpha=f.exponent, beta=f.coef, alpha_ci=list(f.exponent_ci), beta_ci=list(f.coef_ci),
                   beta_flops=coef_pflop_days_to_flops(f.coef, f.exponent), loss_fit_r2=f.r2,
                   n_points=f.n_points, loss_ci_method=f.ci_method)
    if r.offset_fit is not None:
        o = r.offset_fit
        rec["eps_power_law"] = {**asdict(o), "coef_flops": coef_pflop_days_to_flops(o.coef, o.exponent)}
    if r.n_fit is not None:
        rec.update(a=r.n_fit.exponent, a_ci=list(r.n_fit.exponent_ci), n_coef=r.n_fit.coef,
                   n_coef_ci=list(r.n_fit.coef_ci), n_coef_flops=coef_pflop_days_to_flops(r.n_fit.coef, r.n_fit.exponent),
                   n_points_opt=r.n_fit.n_points, opt_ci_method=r.n_fit.ci_method, n_replicates=r.n_fit.n_replicates)
    if r.d_fit is not None:
        rec.update(b=r.d_fit.exponent, b_ci=list(r.d_fit.exponent_ci), d_coef=r.d_fit.coef,
                   d_coef_ci=list(r.d_fit.coef_ci), d_coef_flops=coef_pflop_days_to_flops(r.d_fit.coef, r.d_fit.exponent))
    if r.chinchilla is not None:
        rec["chinchilla"] = r.chinchilla.to_dict()
        if r.chinchilla_alloc is not None:
            al = r.chinchilla_alloc
            rec["chinchilla"]["allocation"] = {
                **al.to_dict(), "n_coef_flops": coef_pflop_days_to_flops(al.n_fit.coef, al.n_fit.exponent),
                "d_coef_flops": coef_pflop_days_to_flops(al.d_fit.coef, al.d_fit.exponent)}
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


def to_json(results: list[ArchResult], settings: FitSettings, include_embedding: bool,
            warnings: list[str] | None = None, loss_key: str = "loss", selection: dict | None = None) -> dict:
    """The JSON record; `selection` names the settings that chose the rows (the CLI's --skip-tokens, --skip-warmup,
    --seq-len), so that the record says which data the fits describe."""
    return _strict({"units": units(include_embedding, loss_key), "include_embedding_flops": include_embedding,
                    "compute": compute_name(include_embedding), "loss_key": loss_key,
                    "selection": dict(selection or {}), "settings": asdict(settings),
                    "paper_unit": PAPER_UNIT, "paper_source": PAPER, "warnings": list(warnings or []),
                    "archs": {r.arch: arch_record(r) for r in results}})


def _fit_cell(f, digits: int = 4) -> tuple[str, str]:
    if f is None:
        return "—", "—"
    return _law(f.coef, f.exponent, digits), f"{f.exponent:.{digits}f}{_ci(f.exponent_ci)}"


def markdown_tables(results: list[ArchResult], include_embedding: bool, loss_key: str = "loss") -> str:
    lines = [f"C in PFLOP-days (1 PFLOP-day = {PFLOP_DAY:.2e} FLOPs) of {compute_name(include_embedding)}; "
             f"N non-embedding parameters (paper formula); D tokens; L the {loss_name(loss_key)} (metrics.jsonl "
             f"`{loss_key}`, nats/token). Intervals: 95% over replicate studies "
             f"(each run's residuals resampled around its fitted learning curve, every fit redone). N_opt and D_opt "
             f"are fitted to the handovers between adjacent sizes, not to the envelope's winners (docs/scaling.md).",
             "",
             "| arch | sizes | fit C range (PFLOP-days) | L(C) | α | N_opt(C) | a | D_opt(C) | b | handovers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rng = "—"
        if r.fit_mask is not None and r.fit_mask.any():
            c = flops_to_pflop_days(r.envelope.c[r.fit_mask])
            rng = f"{c[0]:.3g} – {c[-1]:.3g}"
        lf, nf, df = r.loss_fit, r.n_fit, r.d_fit
        used = len(r.optimal.used) if r.optimal is not None else 0
        pairs = len(r.optimal.handovers) if r.optimal is not None else 0
        lines.append("| " + " | ".join([r.arch, f"{len(r.sizes)}", rng, *_fit_cell(lf), *_fit_cell(nf, 3),
                                         *_fit_cell(df, 3), f"{used} of {pairs}"]) + " |")
    lines += ["", table3_side_by_side(results, include_embedding, loss_key)]
    offs = [r for r in results if r.offset_fit is not None]
    if offs:
        lines += ["", f"L(C) = ε + β·C^α ({compute_short(include_embedding)}, PFLOP-days):", "",
                  "| arch | ε | β | α | rmse of log L |", "|---|---|---|---|---|"]
        for r in offs:
            o = r.offset_fit
            lines.append(f"| {r.arch} | {o.eps:.4f}{_ci(o.eps_ci)} | {o.coef:.4g}{_ci(o.coef_ci)} | "
                         f"{o.exponent:.4f}{_ci(o.exponent_ci)} | {o.rmse_log:.2e} |")
    edges = [r for r in results if r.edge_summary()]
    if edges:
        lines += ["", "Envelope points in the L(C) fit range by winner (edge-won points — no smaller / larger size "
                      "competing there: none present, and no smaller one overtaken earlier — are not evidence of "
                      "N_opt; the N_opt/D_opt fits use the handovers):", "",
                  "| arch | interior | edge-won, no smaller competing | edge-won, no larger competing | one size |",
                  "|---|---|---|---|---|"]
        for r in edges:
            e = r.edge_summary()
            cell = {k: f"{v['points']}" + (f" ({v['c_range_pflop_days'][0]:.3g} – {v['c_range_pflop_days'][1]:.3g})"
                                           if v["points"] else "") for k, v in e.items()}
            lines.append(f"| {r.arch} | {cell['interior']} | {cell['edge_low']} | {cell['edge_high']} | {cell['alone']} |")
    chs = [r for r in results if r.chinchilla is not None]
    if chs:
        lines += ["", "Chinchilla approach 3, L(N, D) = E + A/N^α + B/D^β (Huber δ=1e-3 on log L; α, β intervals: "
                      "bootstrap over runs; a = β/(α+β), b = α/(α+β) hold only if C ∝ N·D):", "",
                  "| arch | E | A | B | α | β | a if C ∝ N·D | b if C ∝ N·D | points |", "|---|---|---|---|---|---|---|---|---|"]
        for r in chs:
            f = r.chinchilla
            pc = r.chinchilla_alloc.param_ci if r.chinchilla_alloc is not None else {}
            lines.append(f"| {r.arch} | {f.E:.4f} | {f.A:.4g} | {f.B:.4g} | {f.alpha:.4f}{_ci(pc.get('alpha', _NO_CI))} | "
                         f"{f.beta:.4f}{_ci(pc.get('beta', _NO_CI))} | {f.a:.3f} | {f.b:.3f} | {f.n_points} |")
        lines += ["", allocation_table(results)]
    return "\n".join(lines)


_NO_CI = (float("nan"), float("nan"))


def _alloc_rows(r: ArchResult) -> list[tuple[str, object, object]]:
    """(method, N_opt fit, D_opt fit) of each method that gave N_opt/D_opt for the architecture."""
    out = []
    if r.n_fit is not None:
        out.append(("handovers", r.n_fit, r.d_fit))
    if r.chinchilla_alloc is not None:
        out.append(("approach 3", r.chinchilla_alloc.n_fit, r.chinchilla_alloc.d_fit))
    return out


def allocation_table(results: list[ArchResult]) -> str:
    """N_opt(C), D_opt(C) per architecture and method (handovers; Chinchilla approach 3) beside the paper's."""
    lines = ["N_opt(C) = coef·C^a, D_opt(C) = coef·C^b by method (C in PFLOP-days; 95% intervals — handovers: "
             "replicate studies; approach 3: percentiles of a bootstrap over runs, its allocation computed under "
             "the architecture's own FLOPs per token, not C ∝ N·D) beside the paper's Table 3:", "",
             "| arch | method | C range (PFLOP-days) | N_opt(C) | a (95%) | paper a | D_opt(C) | b (95%) | paper b | "
             "N_opt over the range |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        paper = PAPER_TABLE3.get(r.arch)
        for method, nf, df in _alloc_rows(r):
            if method == "approach 3":
                al = r.chinchilla_alloc
                rng = f"{al.c_range[0]:.3g} – {al.c_range[1]:.3g}"
                span = f"{size_label(al.n_opt_range[0])} – {size_label(al.n_opt_range[1])} (trained " \
                       f"{size_label(al.ladder[0])} – {size_label(al.ladder[1])})"
            else:
                hc = flops_to_pflop_days(np.exp(r.optimal.log_c[0]))
                rng, span = f"{hc.min():.3g} – {hc.max():.3g}", f"{len(r.optimal.used)} handovers"
            lines.append("| " + " | ".join([
                r.arch, method, rng, _law(nf.coef, nf.exponent, 3), f"{nf.exponent:.3f}{_ci(nf.exponent_ci)}",
                f"{paper['N_opt'][1]:.4f}" if paper else "—", _law(df.coef, df.exponent, 3),
                f"{df.exponent:.3f}{_ci(df.exponent_ci)}", f"{paper['D_opt'][1]:.4f}" if paper else "—", span]) + " |")
    return "\n".join(lines)


def table3_side_by_side(results: list[ArchResult], include_embedding: bool, loss_key: str = "loss") -> str:
    """The paper's Table 3 next to ours: L(C), N_opt(C), D_opt(C) per architecture, coefficient and exponent."""
    like = include_embedding == PAPER_INCLUDES_EMBEDDING
    head = (f"Table 3 side by side (C in PFLOP-days; ours: {compute_short(include_embedding)}; paper: {PAPER_UNIT}"
            + ("" if like else "; NOT like for like: rerun without --embedding-flops to compare")
            + ("" if loss_key == "loss" else f"; our L(C) is the {loss_name(loss_key)}, the paper's the training "
                                             f"loss")
            + "; approach-3 rows: the allocation of the fitted L(N, D), intervals from a bootstrap over runs):")
    lines = [head, "", "| arch | law | ours | exponent (95%) | paper | paper exponent | Δ exponent | ours / paper at C=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        paper = PAPER_TABLE3.get(r.arch)
        al = r.chinchilla_alloc
        rows = [(law, f"{law}(C)", f) for law, f in zip(LAWS, (r.loss_fit, r.n_fit, r.d_fit))]
        if al is not None:   # the handover rows say their method once approach 3 stands beside them
            rows = [rows[0], ("N_opt", "N_opt(C) handovers", r.n_fit), ("D_opt", "D_opt(C) handovers", r.d_fit),
                    ("N_opt", "N_opt(C) approach 3", al.n_fit), ("D_opt", "D_opt(C) approach 3", al.d_fit)]
        for law, name, f in rows:
            pc = paper[law] if paper else None
            ours, exp = _fit_cell(f, 4)
            lines.append("| " + " | ".join([
                r.arch, name, ours, exp,
                _law(*pc, 4) if pc else "—", f"{pc[1]:.4f}" if pc else "—",
                f"{f.exponent - pc[1]:+.4f}" if (f is not None and pc) else "—",
                f"{f.coef / pc[0]:.3g}" if (f is not None and pc) else "—"]) + " |")
    return "\n".join(lines)


def console_summary(results: list[ArchResult], problems: list[str], include_embedding: bool,
                    warnings: list[str] | None = None, loss_key: str = "loss") -> str:
    out = [f"C: {compute_name(include_embedding)}, in PFLOP-days; L: the {loss_name(loss_key)} "
           f"(metrics.jsonl '{loss_key}')"]
    for w in warnings or []:
        out.append(f"WARNING {w}")
    for r in results:
        out.append(f"{r.arch}: {len(r.runs)} run(s), sizes {', '.join(r.sizes)}")
        for run in r.runs:
            skip = f", skipped {run.n_skipped} ({'; '.join(f'{k}: {v}' for k, v in run.skipped.items())})" \
                if run.skipped else ""
            out.append(f"  {run.name}: N={size_label(run.n_params)}, seq_len {run.seq_len}, {len(run.tokens)} rows "
                       f"used{skip}")
        if r.optimal is not None:
            used = [h for h in r.optimal.handovers if h.status == "ok"]
            if used:
                out.append("  handovers used for N_opt/D_opt: " + "; ".join(
                    f"{h.small}->{h.large} at {flops_to_pflop_days(h.c):.3g} PFLOP-days" for h in used))
        e = r.edge_summary()
        if e:
            out.append(f"  envelope points in the fit range: {e['interior']['points']} interior, "
                       f"{e['edge_low']['points']} edge-won with no smaller size competing, "
                       f"{e['edge_high']['points']} with no larger, {e['alone']['points']} with one size (edge-won points are not used for N_opt)")
        for w in r.warnings:
            out.append(f"  WARNING {w}")
        for note in r.notes:
            out.append(f"  NOTE {note}")
    for p in problems:
        out.append(f"left out: {p}")
    out += ["", markdown_tables(results, include_embedding, loss_key)]
    return "\n".join(out)

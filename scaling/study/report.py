"""The study report: scaling-law fits (launch/fit_scaling.py on the study's runs: Table 3, Figure 1), the
evaluation table of every snapshot (commonsense metrics replayed from stored scores where the study scores
them remotely), metric-against-compute plots, and report.md comparing the study with the paper.

    STUDY/report/fits.json, table3.md, fit_console.txt, plots/scaling_*.png    (the fit)
    STUDY/report/eval/results.csv, results.json                                (every evaluated snapshot)
    STUDY/report/metrics_vs_compute.png                                        (key metrics against C)
    STUDY/report/report.md
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np

from checkpoints.layout import EXPORTS, METRICS, MODEL_CONFIG
from models.registry import arch_title
from scaling.study.config import StudyConfig
from scaling.study.plan import RunPlan
from scaling.study.stages import CSR_REQUESTS, csr_tasks, eval_dir

MARKERS = "osD^vP*Xh"
# headline metrics of the compute plot: (column of results.csv, axis label, log scale)
HEADLINE = (("valid_loss/loss", "validation loss (nats/token)", False),
            ("wikitext2/word_perplexity", "WikiText-2 word perplexity", True),
            ("lambada_openai/perplexity", "LAMBADA perplexity", True),
            ("lambada_openai/acc", "LAMBADA accuracy", False),
            ("csr/avg", "commonsense average (paper metrics)", False))


def report_dir(study: StudyConfig) -> Path:
    return study.out / "report"


# -- fits ----------------------------------------------------------------------------------------------

def fit_runs(plans: list[RunPlan]) -> tuple[list[RunPlan], list[RunPlan]]:
    """(runs fitted, runs left out): only a run trained to its planned step enters the fit. The rows of a
    failed, stopped or still running run end where it ended, not where the plan does: the envelope would
    take its last rows as the size's, and a larger size as winning after it only because it stopped (a false
    handover); a diverged run's last rows are not a learning curve at all."""
    from scaling.study.stages import train_done
    fitted = [p for p in plans if train_done(p)]
    return fitted, [p for p in plans if p not in fitted and (p.run_dir / METRICS).is_file()]


FIT_OUTPUTS = ("fits.json", "table3.md", "fit_console.txt")


def clear_fit_outputs(study: StudyConfig) -> None:
    """Remove what an earlier fit wrote. Every report fits afresh; a fit that writes nothing this time (no run
    trained to its planned step, a rejected fit.args, an architecture no longer in the study, none fitted so
    no comparison plot) must not leave the earlier fit's table and Figure-1 plots to be read, and shown in
    report.md, as the current ones."""
    out = report_dir(study)
    for name in FIT_OUTPUTS:
        (out / name).unlink(missing_ok=True)
    for png in (out / "plots").glob("scaling_*.png") if (out / "plots").is_dir() else []:
        png.unlink()


def run_fit(study: StudyConfig, plans: list[RunPlan], log=print) -> dict | None:
    """launch/fit_scaling.py over the runs trained to their planned step (`fit_runs`); its console output is
    kept in fit_console.txt. Returns fits.json (None when nothing could be fitted)."""
    import importlib.util
    out = report_dir(study)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    clear_fit_outputs(study)
    fitted, left_out = fit_runs(plans)
    if left_out:
        log(f"[study] report: not trained to their planned step, left out of the fit: "
            f"{', '.join(p.name for p in left_out)}")
    runs = [str(p.run_dir) for p in fitted]
    if not runs:
        msg = "no run is trained to its planned step yet; nothing to fit"
        (out / "fit_console.txt").write_text(msg + "\n")
        log(f"[study] report: {msg}")
        return None
    script = Path(__file__).resolve().parents[2] / "launch" / "fit_scaling.py"
    spec = importlib.util.spec_from_file_location("linscale_fit_scaling", script)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)  # type: ignore[union-attr]
    argv = [*runs, "--json", str(out / "fits.json"), "--markdown", str(out / "table3.md"),
            "--plots", str(out / "plots"), *study.fit_args]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = fit.main(argv)
        except SystemExit as err:  # argparse rejecting fit.args
            rc = err.code
    (out / "fit_console.txt").write_text(buf.getvalue())
    log(buf.getvalue().rstrip())
    if rc not in (0, 1) or not (out / "fits.json").is_file():
        raise RuntimeError(f"launch/fit_scaling.py {' '.join(argv)} failed (exit {rc}); see {out / 'fit_console.txt'}")
    return json.loads((out / "fits.json").read_text())


# -- evaluation table ----------------------------------------------------------------------------------

def replayed_csr(study: StudyConfig, plan: RunPlan, log=print) -> dict[str, dict]:
    """snapshot name -> {task: metrics} from the run's stored commonsense scores (lm-eval replays them);
    the metrics are cached next to the scores. Scores made for other requests (tasks, limit), weights or
    scoring window than the study's now are left out, named (the evaluate stage scores them again)."""
    src = eval_dir(study, plan.name) / "csr_scores"
    if study.evaluation.csr != "replay" or not csr_tasks(study) or not src.is_dir():
        return {}
    from evaluation.request_replay import read_requests, replay, task_manager
    from scaling.study.stages import stored_csr_scores
    req = read_requests(eval_dir(study) / CSR_REQUESTS)
    manager = None
    out = {}
    for f in sorted(src.glob("*.json")):
        if f.name.endswith(".metrics.json"):
            continue
        rec, why = stored_csr_scores(study, plan, f.stem, req)
        if rec is None:
            log(f"[study] {f}: {why}; left out of the report (evaluate the run again)")
            continue
        cache = f.with_name(f.stem + ".metrics.json")
        if cache.is_file() and json.loads(cache.read_text()).get("key") == rec["key"]:
            out[f.stem] = json.loads(cache.read_text())["metrics"]
            continue
        manager = manager or task_manager()
        metrics = replay(req, rec["scores"], manager=manager, max_length=(rec.get("key") or {}).get("window"))
        cache.write_text(json.dumps({"key": rec["key"], "metrics": metrics}, indent=1))
        out[f.stem] = metrics
    return out


def _cached_rows(study: StudyConfig, plan: RunPlan, log=print) -> dict[str, dict]:
    """Rows from the sweep's per-(snapshot, task) cache, only results made with the study's settings now
    (`cached_evaluation`; a stale one is named in the log and left out): what a sweep that stopped before
    writing its table had finished too. Snapshot facts come from the export's config.json, else from the
    snapshot's name."""
    from checkpoints.layout import parse_step
    from scaling.study.stages import cached_evaluation
    cache = eval_dir(study, plan.name) / "cache" / plan.name
    rows = {}
    for snap_dir in sorted(cache.glob("step_*")) if cache.is_dir() else []:
        results = {}
        for f in sorted(snap_dir.glob("*.json")):
            metrics, why = cached_evaluation(study, plan, snap_dir.name, f.stem)
            if metrics is not None:
                results[f.stem] = metrics
            elif why.startswith("stale"):
                log(f"[study] report: {plan.name}/{snap_dir.name} {f.stem} left out, {why}")
        if not results:
            continue
        meta = {}
        export_cfg = plan.run_dir / EXPORTS / snap_dir.name / MODEL_CONFIG
        if export_cfg.is_file():
            meta = json.loads(export_cfg.read_text())
        rows[snap_dir.name] = {"run": plan.name, "snapshot": snap_dir.name, "arch": plan.arch, "size": plan.size,
                               "step": meta.get("step", parse_step(snap_dir.name)), "tokens": meta.get("tokens"),
                               "flops": meta.get("flops"), "path": None, "results": results}
    return rows


def _errors(row: dict) -> dict[str, dict]:
    """The failed tasks of a sweep row (a snapshot that cannot be loaded, SCROLLS offline): not cached, so
    only its table says why they are missing."""
    return {t: res for t, res in row.get("results", {}).items() if isinstance(res, dict) and "error" in res}


def evaluation_rows(study: StudyConfig, plans: list[RunPlan], log=print) -> list[dict]:
    """Every evaluated snapshot of the study: the current results of each run's cache, with the snapshot facts
    and failures of its sweep table (whose numbers may be of earlier settings: they are taken from the cache),
    and replayed commonsense metrics."""
    rows = []
    for p in plans:
        d = eval_dir(study, p.name)
        by_snap: dict[str, dict] = _cached_rows(study, p, log)
        if (d / "results.json").is_file():
            for r in json.loads((d / "results.json").read_text())["snapshots"]:
                results = {**_errors(r), **by_snap.get(r["snapshot"], {}).get("results", {})}
                if results:
                    by_snap[r["snapshot"]] = {**r, "results": results}
        for snap, metrics in replayed_csr(study, p, log).items():
            if snap not in by_snap:
                rec = json.loads((d / "csr_scores" / f"{snap}.json").read_text())["snapshot"]
                by_snap[snap] = {**rec, "path": None, "results": {}}
            by_snap[snap]["results"].update(metrics)
        rows += [by_snap[k] for k in sorted(by_snap)]
    for r in rows:  # C of each snapshot, non-embedding (the paper's), from the plan's shape
        plan = next((p for p in plans if p.name == r["run"]), None)
        if plan is not None and r.get("step"):
            r["flops_non_embedding"] = plan.flops_non_embedding / plan.steps * r["step"]
    return rows


def write_evaluation(study: StudyConfig, rows: list[dict]) -> Path | None:
    if not rows:
        return None
    from evaluation.sweep import write_tables
    out = report_dir(study) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    write_tables(rows, list(study.evaluation.tasks), out)
    return out


def plot_metrics_vs_compute(study: StudyConfig, rows: list[dict], path: Path) -> Path | None:
    """One panel per headline metric against non-embedding C (PFLOP-days): colour = architecture,
    marker = size, a line through each run's snapshots."""
    from evaluation.sweep import flat_metrics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scaling.plots import arch_color
    from scaling.units import flops_to_pflop_days
    flats = [flat_metrics(r) for r in rows]
    panels = [h for h in HEADLINE if any(h[0] in f for f in flats)]
    if not panels:
        return None
    sizes = [s.name for s in study.sizes]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.6 * len(panels), 9.0), 4.4), squeeze=False)
    for ax, (key, label, logy) in zip(axes[0], panels):
        for arch in study.archs:
            for k, size in enumerate(sizes):
                pts = sorted((flops_to_pflop_days(r["flops_non_embedding"]), f[key]) for r, f in zip(rows, flats)
                             if r.get("arch") == arch and r.get("size") == size and key in f
                             and r.get("flops_non_embedding") and math.isfinite(f[key]))
                if pts:
                    ax.plot(*zip(*pts), marker=MARKERS[k % len(MARKERS)], ms=4, lw=1, color=arch_color(arch),
                            alpha=0.85)
        ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("C, non-embedding (PFLOP-days)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=arch_color(a), lw=2, label=arch_title(a)) for a in study.archs]
    handles += [Line2D([], [], color="gray", marker=MARKERS[k % len(MARKERS)], lw=0, label=s)
                for k, s in enumerate(sizes)]
    fig.legend(handles=handles, loc="lower center", ncol=max(len(study.archs), len(sizes)), fontsize=8,
               frameon=False)
    fig.suptitle(f"{study.name}: evaluated snapshots against compute (colour: architecture, marker: size)")
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- comparisons with the paper --------------------------------------------------------------------------

def equal_compute_ranking(fits: dict, points: int = 4) -> tuple[list[float], dict[str, list[float]]]:
    """Envelope loss of each architecture at `points` log-spaced C (PFLOP-days) inside the range where every
    architecture's envelope is fitted."""
    env = {a: r["envelope"] for a, r in fits.get("archs", {}).items() if r.get("envelope")}
    spans = {}
    for a, e in env.items():
        c = np.asarray(e["c_pflop_days"], dtype=float)
        used = np.asarray(e.get("used_in_fit", [True] * len(c)), dtype=bool)
        if used.any():
            spans[a] = (c[used].min(), c[used].max())
    if len(spans) < 2:
        return [], {}
    lo, hi = max(s[0] for s in spans.values()), min(s[1] for s in spans.values())
    if not lo < hi:
        return [], {}
    grid = np.logspace(np.log10(lo), np.log10(hi), points)
    out = {}
    for a in spans:
        c = np.asarray(env[a]["c_pflop_days"], dtype=float)
        loss = np.asarray(env[a]["loss"], dtype=float)
        out[a] = np.exp(np.interp(np.log(grid), np.log(c), np.log(loss))).tolist()
    return grid.tolist(), out


def paper_ranking(c_pflop_days: float) -> list[str]:
    from scaling.paper import PAPER_LOSS_FIT, paper_law_at
    return sorted(PAPER_LOSS_FIT, key=lambda a: paper_law_at(a, "L", c_pflop_days))


def n_opt_evidence(fits: dict) -> list[str]:
    """Per architecture and adjacent size pair, what the pair says about N_opt at one C (fits.json's
    `n_opt_bound`: ≈ at an observed handover, between the two sizes; < or > where the pair's overlap ended or began
    with one size ahead) next to the paper's N_opt(C) there, extrapolated, and whether the two agree."""
    from scaling.paper import paper_law_at
    lines = []
    for a, r in fits.get("archs", {}).items():
        for h in r.get("handovers", []):
            b = h.get("n_opt_bound")
            if not b:
                continue
            c, rel, n = b["c_pflop_days"], b["relation"], b["n"]
            pn = paper_law_at(a, "N_opt", c)
            lo, hi = b.get("n_small", n), b.get("n_large", n)
            agree = "—" if pn is None else {"<": pn < n, ">": pn > n, "≈": lo < pn < hi}[rel]
            here = f"{rel} {n:,.0f}" + (f" ({lo:,.0f} – {hi:,.0f})" if rel == "≈" else "")
            lines.append(f"| {arch_title(a)} | {h['small']} → {h['large']} | {h['status']} | {c:.3g} | {here} | "
                         f"{'—' if pn is None else f'{pn:,.0f}'} | "
                         f"{agree if isinstance(agree, str) else ('yes' if agree else 'no')} |")
    if not lines:
        return []
    return ["| arch | pair | status | C (PFLOP-days) | N_opt(C) here | paper N_opt(C) | consistent |",
            "|---|---|---|---|---|---|---|", *lines]


def _with_ci(x, ci, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    ok = ci and all(v is not None and math.isfinite(v) for v in ci)
    return f"{x:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ok else "")


def exponent_table(fits: dict) -> list[str]:
    """α of L(C), and a, b of N_opt/D_opt by method (handovers; Chinchilla approach 3), beside the paper's
    Table 3, from fits.json."""
    from scaling.paper import PAPER_TABLE3
    lines = ["| arch | α ours | α paper | method | a ours (95%) | a paper | b ours (95%) | b paper |",
             "|---|---|---|---|---|---|---|---|"]
    for a, r in fits.get("archs", {}).items():
        paper = PAPER_TABLE3.get(a, {})
        pa = _fmt(paper["N_opt"][1]) if paper else "—"
        pb = _fmt(paper["D_opt"][1]) if paper else "—"
        al = (r.get("chinchilla") or {}).get("allocation")
        methods = []
        if r.get("a") is not None or al is None:
            methods.append(("handovers", r.get("a"), r.get("a_ci"), r.get("b"), r.get("b_ci")))
        if al is not None:
            methods.append(("approach 3", al["a"], al["a_ci"], al["b"], al["b_ci"]))
        for m, ea, ca, eb, cb in methods:
            lines.append(f"| {arch_title(a)} | {_fmt(r.get('alpha'))} | {_fmt(paper['L'][1]) if paper else '—'} | "
                         f"{m} | {_with_ci(ea, ca)} | {pa} | {_with_ci(eb, cb)} | {pb} |")
    return lines


def _fmt(x, digits: int = 4) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def final_snapshot_table(study: StudyConfig, rows: list[dict]) -> list[str]:
    """Per size, each architecture's last evaluated snapshot: the headline metrics."""
    from evaluation.sweep import flat_metrics
    last: dict[tuple[str, str], dict] = {}
    for r in rows:
        k = (r.get("arch"), r.get("size"))
        if not flat_metrics(r):  # a snapshot whose evaluation failed (failed_evaluations): not the last evaluated
            continue
        if r.get("step") is not None and (k not in last or r["step"] > last[k]["step"]):
            last[k] = r
    keys = [h for h in HEADLINE if any(h[0] in flat_metrics(r) for r in last.values())]
    if not keys:
        return []
    lines = ["| size | arch | step | " + " | ".join(h[1] for h in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for s in study.sizes:
        for a in study.archs:
            r = last.get((a, s.name))
            if r is None:
                continue
            f = flat_metrics(r)
            lines.append(f"| {s.name} | {arch_title(a)} | {r['step']} | "
                         + " | ".join(_fmt(f.get(h[0])) for h in keys) + " |")
    return lines


def failed_evaluations(rows: list[dict]) -> list[str]:
    """One line per snapshot with a task that failed in the last evaluation (its sweep table's error), so that a
    missing number in the report says why."""
    from evaluation.sweep import row_errors
    return [f"- {r['run']} {r['snapshot']}: {' '.join(row_errors(r).split())[:400]}" for r in rows if row_errors(r)]


def csr_ordering(study: StudyConfig, rows: list[dict]) -> list[str]:
    """Architectures ordered by the commonsense average of their last snapshot, per size."""
    from evaluation.sweep import flat_metrics
    lines = []
    for s in study.sizes:
        best = {}
        for r in rows:
            f = flat_metrics(r)
            if r.get("size") == s.name and "csr/avg" in f and r.get("step") is not None:
                if r["arch"] not in best or r["step"] > best[r["arch"]][0]:
                    best[r["arch"]] = (r["step"], f["csr/avg"])
        if len(best) >= 2:
            order = sorted(best, key=lambda a: -best[a][1])
            lines.append(f"- {s.name}: " + " > ".join(f"{arch_title(a)} {best[a][1]:.4f}" for a in order))
    return lines


def write_markdown(study: StudyConfig, plans: list[RunPlan], fits: dict | None, rows: list[dict],
                   figures: list[Path], status_table: str, fit_error: str | None = None) -> Path:
    from scaling.units import flops_to_pflop_days
    out = report_dir(study)
    lines = [f"# Scaling study `{study.name}`", "",
             f"{len(plans)} runs: {', '.join(arch_title(a) for a in study.archs)} at sizes "
             f"{', '.join(s.name for s in study.sizes)}; sequence length {study.seq_len}, "
             f"{study.global_batch_tokens:,} tokens per step; total planned compute "
             f"{flops_to_pflop_days(sum(p.flops_non_embedding for p in plans)):.3g} PFLOP-days non-embedding "
             f"({flops_to_pflop_days(sum(p.flops for p in plans)):.3g} with the embedding term).", "",
             "## Runs", "", "```", status_table, "```", ""]
    left_out = fit_runs(plans)[1]
    if left_out:
        lines += [f"Left out of the scaling-law fit, not trained to their planned step: "
                  f"{', '.join(p.name for p in left_out)}.", ""]
    if fit_error:
        console = out / "fit_console.txt"
        last = console.read_text().strip().splitlines()[-1:] if console.is_file() else []
        lines += ["## Scaling laws (Table 3 style)", "",
                  f"The fit failed: `{last[0] if last else fit_error}` (the whole output: fit_console.txt).", ""]
    if fits:
        table = (out / "table3.md").read_text() if (out / "table3.md").is_file() else ""
        lines += ["## Scaling laws (Table 3 style)", "", table.strip(), ""]
        grid, ranking = equal_compute_ranking(fits)
        if grid:
            lines += ["## Lowest loss at equal compute", "",
                      "Envelope loss at C inside every architecture's fitted range (C in PFLOP-days as in the fit):", "",
                      "| C | " + " | ".join(arch_title(a) for a in ranking) + " | lowest |",
                      "|---|" + "---|" * (len(ranking) + 1)]
            for i, c in enumerate(grid):
                best = min(ranking, key=lambda a: ranking[a][i])
                lines.append(f"| {c:.3g} | " + " | ".join(f"{ranking[a][i]:.4f}" for a in ranking)
                             + f" | {arch_title(best)} |")
            paper_c = (1.0, 100.0)
            lines += ["", "The paper's fits order the architectures at C = "
                      + " and ".join(f"{c:g}" for c in paper_c) + " PFLOP-days as: "
                      + "; ".join(" < ".join(arch_title(a) for a in paper_ranking(c)) for c in paper_c)
                      + " (lowest loss first).", ""]
        lines += ["## Exponents against the paper", "", *exponent_table(fits)]
        notes = [f"- {a}: {n}" for a, r in fits.get("archs", {}).items() for n in r.get("notes", [])]
        if notes:
            lines += ["", "Fit notes:", "", *notes]
        evidence = n_opt_evidence(fits)
        if evidence:
            lines += ["", "## What each pair of adjacent sizes says about N_opt(C)", "",
                      "At an observed handover N_opt lies between the two sizes (≈ their geometric mean, the point the "
                      "N_opt fit uses); where the smaller size was still ahead when the pair's overlap ended, "
                      "N_opt(C) < the larger size there (a unimodal iso-FLOP profile); where the larger was ahead from "
                      "the start, N_opt(C) > the smaller. The paper's N_opt(C) is its Table 3 law at that C "
                      "(\"consistent\": inside the bound, or between the two sizes at a handover).", "", *evidence]
        lines += [""]
    if rows:
        lines += ["## Evaluation (last evaluated snapshot of each run)", "", *final_snapshot_table(study, rows), ""]
        order = csr_ordering(study, rows)
        if order:
            lines += ["Commonsense average, highest first:", "", *order, ""]
        failed = failed_evaluations(rows)
        if failed:
            lines += ["Not evaluated (the error of the last evaluation; `run` again evaluates them once the cause is "
                      "fixed):", "", *failed, ""]
    if figures:
        lines += ["## Figures", ""] + [f"![{f.stem}]({f.relative_to(out)})" for f in figures] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def write_report(study: StudyConfig, plans: list[RunPlan], status_table: str, log=print) -> Path:
    out = report_dir(study)
    out.mkdir(parents=True, exist_ok=True)
    fit_error = None
    try:
        fits = run_fit(study, plans, log)
    except RuntimeError as err:  # e.g. too few logged steps to fit: the rest of the report still holds
        fits, fit_error = None, str(err)
        for stale in ("fits.json", "table3.md"):
            (out / stale).unlink(missing_ok=True)
        log(f"[study] report: {err}; the report goes on without the fits")
    rows = evaluation_rows(study, plans, log)
    write_evaluation(study, rows)
    figures = sorted((out / "plots").glob("scaling_*.png")) if (out / "plots").is_dir() else []
    if rows:
        p = plot_metrics_vs_compute(study, rows, out / "metrics_vs_compute.png")
        if p is not None:
            figures.append(p)
    path = write_markdown(study, plans, fits, rows, figures, status_table, fit_error)
    log(f"[study] report: {path}")
    return path

"""Calibration of the scaling fits' intervals: seeded synthetic studies from a known L(N, D), each written in
the trainer's run format, read and fitted exactly as launch/fit_scaling.py does, and the fraction of repeats
whose 95% interval holds the exact frontier exponents a and b of the generating law (scaling.synthetic.
frontier_exponents, which minimises the law itself). CPU only; not part of the test suite.

    python launch/bench_scaling_calibration.py --repeats 60 --out calibration.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402

from scaling.analysis import FitSettings, analyze_arch  # noqa: E402
from scaling.fits import percentile_interval  # noqa: E402
from scaling.runs import load_runs  # noqa: E402
from scaling.synthetic import LossLaw, frontier_exponents, size_ladder, write_sweep  # noqa: E402
from pretrain.argtypes import positive_int  # noqa: E402

STUDIES = {
    # a = 0.618, D_opt ~ 20 N near 1B; the paper's six sizes
    "a618_paper_sizes_1pct": dict(arch="tnl", law=LossLaw(E=1.8, A=40.0, B=845.0, alpha=0.2, beta=0.3236),
                                  sizes=["70m", "160m", "410m", "1b", "3b", "7b"], noise=0.01),
    # Chinchilla's published law (a = 0.452 if C were 6ND), LLaMA's FLOPs (attention terms included), seven
    # sizes from 3.4M to 6.5B, noisier logs
    "chinchilla_llama_7_sizes_2pct": dict(arch="llama", law=LossLaw(),
                                          sizes=["mini", "70m", "160m", "410m", "1b", "3b", "7b"], noise=0.02),
    # a trainer logging every step: 5000 rows per run, no extra early rows, noisier losses
    "a618_paper_sizes_dense_2pct": dict(arch="tnl", law=LossLaw(E=1.8, A=40.0, B=845.0, alpha=0.2, beta=0.3236),
                                        sizes=["70m", "160m", "410m", "1b", "3b", "7b"], noise=0.02, rows=5000,
                                        early_rows=0),
    # many sizes (where a line through the envelope's winners is worst): sixteen uneven steps from 3.7M to 7.7B
    "a618_16_sizes_1pct": dict(arch="tnl", law=LossLaw(E=1.8, A=40.0, B=845.0, alpha=0.2, beta=0.3236),
                               sizes=size_ladder("tnl", 16), noise=0.01),
}


def one(study: dict, seed: int, n_boot: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        write_sweep(d, study["arch"], study["sizes"], study["law"], noise=study["noise"], seed=seed,
                    n_rows=study.get("rows", 300), early_rows=study.get("early_rows", 40))
        runs, _ = load_runs([d])
    res = analyze_arch(study["arch"], runs, FitSettings(n_boot=n_boot, n_boot_offset=0, seed=seed))
    if res.n_fit is None:
        return {"seed": seed, "fitted": False, "notes": res.notes}
    c = np.exp(res.optimal.log_c[0])
    a, b = frontier_exponents(study["law"], sorted({(float(r.n_params), r.flops_per_token) for r in runs}),
                              float(c.min()), float(c.max()))
    # the tool's interval, and for comparison the plain percentile interval of the same replicates
    pct = {k: list(percentile_interval(f.exponent_samples, 0.95)) for k, f in (("a", res.n_fit), ("b", res.d_fit))}
    return {"seed": seed, "fitted": True, "a_true": a, "b_true": b, "a": res.n_fit.exponent,
            "a_ci": list(res.n_fit.exponent_ci), "b": res.d_fit.exponent, "b_ci": list(res.d_fit.exponent_ci),
            "a_ci_percentile": pct["a"], "b_ci_percentile": pct["b"], "handovers": len(res.optimal.used)}


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["fitted"]]
    out = {"repeats": len(rows), "fitted": len(ok)}
    for k in ("a", "b"):
        est = np.array([r[k] for r in ok])
        tru = np.array([r[f"{k}_true"] for r in ok])
        lo = np.array([r[f"{k}_ci"][0] for r in ok])
        hi = np.array([r[f"{k}_ci"][1] for r in ok])
        plo = np.array([r[f"{k}_ci_percentile"][0] for r in ok])
        phi = np.array([r[f"{k}_ci_percentile"][1] for r in ok])
        out[k] = {"coverage": float(np.mean((lo <= tru) & (tru <= hi))), "mean_width": float(np.mean(hi - lo)),
                  "coverage_percentile": float(np.mean((plo <= tru) & (tru <= phi))),
                  "mean_width_percentile": float(np.mean(phi - plo)),
                  "bias": float(np.mean(est - tru)), "sd": float(np.std(est)), "truth": float(np.mean(tru))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--studies", nargs="+", default=list(STUDIES), choices=list(STUDIES))
    p.add_argument("--repeats", type=positive_int, default=60)
    p.add_argument("--n-boot", type=positive_int, default=200, help="replicates per fit (the CLI's default)")
    p.add_argument("--out", type=Path, help="write every repeat and the summary as JSON")
    a = p.parse_args()
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"CPU ({platform.processor() or platform.machine()})",
              "n_boot": a.n_boot, "studies": {}}
    for name in a.studies:
        t0 = time.time()
        rows = []
        for seed in range(a.repeats):
            rows.append(one(STUDIES[name], seed, a.n_boot))
            r = rows[-1]
            if r["fitted"]:
                print(f"{name} seed {seed}: a {r['a']:.4f} [{r['a_ci'][0]:.4f}, {r['a_ci'][1]:.4f}] true {r['a_true']:.4f}"
                      f" | b {r['b']:.4f} [{r['b_ci'][0]:.4f}, {r['b_ci'][1]:.4f}] true {r['b_true']:.4f}", flush=True)
            else:
                print(f"{name} seed {seed}: not fitted ({r['notes']})", flush=True)
        s = summary(rows)
        s["seconds"] = time.time() - t0
        print(json.dumps({name: s}), flush=True)
        report["studies"][name] = {"summary": s, "repeats": rows, "setup": {
            k: (v.__dict__ if isinstance(v, LossLaw) else [getattr(x, "size", x) for x in v] if k == "sizes" else v)
            for k, v in STUDIES[name].items()}}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(lambda argv: main()))

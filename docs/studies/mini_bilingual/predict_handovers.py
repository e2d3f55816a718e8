"""Where the envelope should change hands between adjacent sizes, predicted before training them.

Two predictions for each adjacent pair of `--sizes` (registry names) and each architecture:

- from this study's own runs of `--fit-sizes` (`--runs`, the committed metrics.jsonl; by default the four
  sizes trained before the smaller ones were chosen): Chinchilla's L(N, D) = E + A/N^alpha +
  B/D^beta (scaling.chinchilla) fitted to every run's training loss, averaged over +-10% windows at 25
  log-spaced token counts from `--d-min` to the run's end; each size's learning curve is then L(N, C / fpt) and
  the handover is where the larger size's curve drops below the smaller's (fpt: non-embedding training FLOPs
  per token at the study's sequence length, the paper's C);
- from the paper's Table 3: the C at which its N_opt(C) equals sqrt(N_small * N_large), the point that the
  study's N_opt fit assigns to a handover (scaling.optimal).

Both are extrapolations (the first to sizes below the fitted ones, the second five decades below the paper's
compute), so they bracket where to look rather than say where it is. Printed: the handover C and the tokens
each size of the pair has read there (a run must go past the smaller size's tokens for the handover to be seen).

    python docs/studies/mini_bilingual/predict_handovers.py --d-min 1e6 2e6
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from models import model_config, paper_non_embedding_params
from models.accounting import flops_per_step
from models.registry import get_arch
from scaling.chinchilla import fit_chinchilla
from scaling.units import PFLOP_DAY

HERE = Path(__file__).resolve().parent


def run_curve(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return np.array([r["tokens"] for r in rows], dtype=float), np.array([r["loss"] for r in rows], dtype=float)


def fitted_law(arch: str, runs: Path, d_min: float, sizes: list[str]):
    n, d, loss = [], [], []
    for size in sizes:
        run = runs / f"{arch}-{size}"
        if not (run / "metrics.jsonl").is_file():
            continue
        tokens, lo = run_curve(run / "metrics.jsonl")
        if tokens[-1] <= d_min * 1.1:
            continue
        for g in np.geomspace(d_min, tokens[-1], 25):
            m = (tokens > g / 1.1) & (tokens < g * 1.1)
            n.append(paper_non_embedding_params(model_config(arch, size)))
            d.append(g)
            loss.append(np.exp(np.log(lo[m]).mean()))
    return fit_chinchilla(np.array(n), np.array(d), np.array(loss))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=HERE / "runs", help="folder of <arch>-<size>/ run folders")
    ap.add_argument("--sizes", nargs="+", default=["l1d32", "l1d48", "l1d64", "l1d96", "l1d128", "l2d128"])
    ap.add_argument("--archs", nargs="+", default=["llama", "tnl", "hgrn2", "cos2"])
    ap.add_argument("--fit-sizes", nargs="+", default=["l1d128", "l2d128", "l2d256", "l4d256"],
                    help="the sizes whose runs the L(N, D) fit reads")
    ap.add_argument("--d-min", type=float, nargs="+", default=[1e6, 2e6], help="first token count fitted")
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    c = np.geomspace(1e9, 1e19, 20001)   # FLOPs
    for arch in args.archs:
        cfgs = [model_config(arch, s) for s in args.sizes]
        ns = [paper_non_embedding_params(x) for x in cfgs]
        fpt = [flops_per_step(x, 1, args.seq_len, include_embedding=False) / args.seq_len for x in cfgs]
        k_n, a_n = get_arch(arch).paper_law["N_opt"]
        print(f"\n{arch}: N {', '.join(f'{s} {n / 1e3:.0f}k' for s, n in zip(args.sizes, ns))}")
        laws = []
        for d_min in args.d_min:
            law = fitted_law(arch, args.runs, d_min, args.fit_sizes)
            laws.append((d_min, law))
            print(f"  fit from {d_min:.0e} tokens: E={law.E:.2f} A={law.A:.3g} alpha={law.alpha:.3f} "
                  f"B={law.B:.3g} beta={law.beta:.3f}")
        print(f"  {'pair':<16}" + "".join(f"{'fit from ' + format(dm, '.0e'):>34}" for dm, _ in laws)
              + f"{'paper N_opt(C)':>34}")
        for i in range(len(args.sizes) - 1):
            cells = []
            for _, law in laws:
                small, large = law(ns[i], c / fpt[i]), law(ns[i + 1], c / fpt[i + 1])
                up = np.nonzero((small[:-1] <= large[:-1]) & (small[1:] > large[1:]))[0]
                if len(up):
                    cx = c[up[0] + 1]
                    cells.append(f"{cx / PFLOP_DAY:.2e} PFd, D {cx / fpt[i] / 1e6:.0f}M/{cx / fpt[i + 1] / 1e6:.0f}M")
                else:
                    cells.append("never" if (small < large).all() else "larger always ahead")
            cx = (np.sqrt(ns[i] * ns[i + 1]) / k_n) ** (1 / a_n) * PFLOP_DAY
            cells.append(f"{cx / PFLOP_DAY:.2e} PFd, D {cx / fpt[i] / 1e6:.0f}M/{cx / fpt[i + 1] / 1e6:.0f}M")
            print(f"  {args.sizes[i] + '->' + args.sizes[i + 1]:<16}" + "".join(f"{x:>34}" for x in cells))


if __name__ == "__main__":
    main()

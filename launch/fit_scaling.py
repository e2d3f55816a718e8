"""Scaling-law fits from training runs: L(C), N_opt(C), D_opt(C) per architecture (DESIGN §8, docs/scaling.md).

    python launch/fit_scaling.py runs/* --json fits.json --plots plots/ [--no-embedding-flops] [--chinchilla]

C is in PFLOP-days (1 PFLOP-day = 8.64e19 FLOPs), recomputed from each run's config with the paper's formulas.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling.analysis import FitSettings, analyze_arch  # noqa: E402
from scaling.report import console_summary, to_json  # noqa: E402
from scaling.runs import RunError, group_by_arch, load_runs  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    d = FitSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (config.json + metrics.jsonl), or folders of them")
    p.add_argument("--json", type=Path, help="write every fit, the envelopes and the settings here")
    p.add_argument("--markdown", type=Path, help="write the Table-3-style tables here")
    p.add_argument("--plots", type=Path, help="write Figure-1-style PNGs into this directory")
    p.add_argument("--no-embedding-flops", action="store_true",
                   help="leave the 12*b*n*d*v LM-head term out of C (the paper's PFLOPs table does)")
    p.add_argument("--chinchilla", action="store_true", help="also fit L(N,D) = E + A/N^alpha + B/D^beta (approach 3)")
    p.add_argument("--loss-key", default="loss", help="metrics.jsonl key to fit (e.g. val_loss)")
    p.add_argument("--skip-tokens", type=float, default=0.0, help="ignore rows before this many tokens (warm-up)")
    p.add_argument("--points-per-decade", type=int, default=d.points_per_decade, help="C grid density")
    p.add_argument("--smooth", type=float, default=d.smooth_decades,
                   help="half-width in decades of tokens of the loss box filter (0 = off; ~0.02 for noisy logs)")
    p.add_argument("--min-runs", type=int, default=d.min_runs, help="fit only at C where this many runs are present")
    p.add_argument("--c-min", type=float, help="fit only C >= this (FLOPs)")
    p.add_argument("--c-max", type=float, help="fit only C <= this (FLOPs)")
    p.add_argument("--n-boot", type=int, default=d.n_boot, help="bootstrap resamples (0 = no intervals)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--skip-bad", action="store_true", help="leave out unreadable run directories instead of failing")
    return p.parse_args(argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    include_embedding = not args.no_embedding_flops
    try:
        runs, problems = load_runs(args.runs, include_embedding, args.loss_key, args.skip_tokens, args.skip_bad)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    settings = FitSettings(points_per_decade=args.points_per_decade, smooth_decades=args.smooth,
                           min_runs=args.min_runs, c_min=args.c_min, c_max=args.c_max, n_boot=args.n_boot,
                           n_boot_offset=min(args.n_boot, FitSettings.n_boot_offset), seed=args.seed,
                           chinchilla=args.chinchilla)
    results = [analyze_arch(arch, rs, settings) for arch, rs in group_by_arch(runs).items()]
    print(console_summary(results, problems, include_embedding))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(results, settings, include_embedding), indent=1))
        print(f"\nwrote {args.json}")
    if args.markdown:
        from scaling.report import markdown_tables
        args.markdown.write_text(markdown_tables(results, include_embedding) + "\n")
        print(f"wrote {args.markdown}")
    if args.plots:
        from scaling.plots import write_plots
        for path in write_plots(results, args.plots):
            print(f"wrote {path}")
    if not any(r.loss_fit is not None for r in results):
        print("error: no architecture could be fitted (see NOTE lines above)", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Scaling-law fits from training runs: L(C), N_opt(C), D_opt(C) per architecture (docs/scaling.md).

    python launch/fit_scaling.py runs/* --json fits.json --markdown table.md --plots plots/ [--chinchilla]

C is in PFLOP-days (1 PFLOP-day = 8.64e19 FLOPs), recomputed from each run's config with the paper's formulas;
by default it is the paper's C, training FLOPs without the embedding term (--embedding-flops adds it).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling.analysis import FitSettings, analyze_arch  # noqa: E402
from scaling.report import console_summary, to_json  # noqa: E402
from scaling.runs import RunError, group_by_arch, load_runs, select_seq_len  # noqa: E402
from scaling.units import PFLOP_DAY  # noqa: E402
from pretrain.argtypes import non_negative_float, non_negative_int, positive_float, positive_int  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402

# no study reaches 1e9 PFLOP-days (8.6e28 FLOPs); a bound that large was given in FLOPs
MAX_PLAUSIBLE_PFLOP_DAYS = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    d = FitSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (config.json + metrics.jsonl), or folders of them")
    p.add_argument("--json", type=Path, help="write every fit, the envelopes and the settings here")
    p.add_argument("--markdown", type=Path, help="write the tables (ours, and Table 3 beside the paper's) here")
    p.add_argument("--plots", type=Path, help="write Figure-1-style PNGs into this directory")
    p.add_argument("--embedding-flops", action="store_true",
                   help="count the 12*b*n*d*v embedding (LM-head) FLOPs in C; the default leaves them out, as the "
                        "paper's C does")
    p.add_argument("--no-embedding-flops", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--chinchilla", action="store_true", help="also fit L(N,D) = E + A/N^alpha + B/D^beta (approach 3)")
    p.add_argument("--loss-key", default="loss", help="metrics.jsonl key to fit (e.g. val_loss)")
    p.add_argument("--skip-tokens", type=non_negative_float, default=0.0, help="ignore rows before this many tokens")
    p.add_argument("--skip-warmup", action="store_true",
                   help="ignore the rows of each run's lr warm-up (steps <= optim.warmup_steps of its own config)")
    p.add_argument("--seq-len", type=positive_int, help="fit only runs trained at this context length")
    p.add_argument("--points-per-decade", type=positive_int, default=d.points_per_decade, help="C grid density")
    p.add_argument("--envelope", choices=["fitted", "logged"], default=d.envelope,
                   help="envelope of each size's fitted learning curve L(D) = e + b*D^-beta (default), or of the "
                        "logged losses (noisier: the minimum over runs favours lucky rows)")
    p.add_argument("--smooth", type=non_negative_float, default=d.smooth_decades,
                   help="with --envelope logged: half-width in decades of tokens of a box filter on each run's loss "
                        "(0 = off; ~0.02 for noisy logs)")
    p.add_argument("--min-runs", type=positive_int, default=d.min_runs, help="fit L(C) only at C where this many runs are present")
    p.add_argument("--c-min", type=positive_float, help="fit only C >= this, in PFLOP-days (the unit of the tables)")
    p.add_argument("--c-max", type=positive_float, help="fit only C <= this, in PFLOP-days (the unit of the tables)")
    p.add_argument("--n-boot", type=non_negative_int, default=d.n_boot, help="replicate studies for the intervals (0 = none)")
    p.add_argument("--block", type=positive_int, default=d.block,
                   help="residual block length in rows for the replicates (default: rows^(1/3) per run)")
    p.add_argument("--seed", type=non_negative_int, default=d.seed)
    p.add_argument("--skip-bad", action="store_true", help="leave out unreadable run directories instead of failing")
    return p.parse_args(argv)


def check_c_bounds(args: argparse.Namespace) -> str | None:
    """An error message when --c-min/--c-max cannot be PFLOP-days (most likely FLOPs), else None."""
    for flag, v in (("--c-min", args.c_min), ("--c-max", args.c_max)):
        if v is None:
            continue
        if not v > 0:
            return f"{flag} {v}: C bounds are positive, in PFLOP-days"
        if v > MAX_PLAUSIBLE_PFLOP_DAYS:
            return (f"{flag} {v:g} is in FLOPs, it seems: C is in PFLOP-days here, as the tables print it "
                    f"(1 PFLOP-day = {PFLOP_DAY:.3g} FLOPs), so use {flag} {v / PFLOP_DAY:.4g}")
    if args.c_min is not None and args.c_max is not None and args.c_min >= args.c_max:
        return f"--c-min {args.c_min:g} is not below --c-max {args.c_max:g}"
    return None


def warmup_warnings(runs, skip_tokens: float, skip_warmup: bool) -> list[str]:
    """--skip-tokens that ends inside a run's warm-up: a cut meant to drop the warm-up that does not."""
    if skip_warmup or skip_tokens <= 0:
        return []
    short = [r for r in runs if r.warmup_tokens and skip_tokens < r.warmup_tokens]
    if not short:
        return []
    return [f"--skip-tokens {skip_tokens:.3g} ends before the lr warm-up of {len(short)} run(s) "
            f"({', '.join(f'{r.name}: {r.warmup_tokens:.3g} tokens' for r in short[:4])}"
            f"{', ...' if len(short) > 4 else ''}); rows inside the warm-up are fitted. --skip-warmup drops each "
            f"run's own warm-up"]


def _main(argv=None) -> int:
    args = parse_args(argv)
    include_embedding = args.embedding_flops
    bad = check_c_bounds(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        runs, problems = load_runs(args.runs, include_embedding, args.loss_key, args.skip_tokens, args.skip_bad,
                                   skip_warmup=args.skip_warmup)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    settings = FitSettings(points_per_decade=args.points_per_decade, smooth_decades=args.smooth, envelope=args.envelope,
                           min_runs=args.min_runs, c_min=args.c_min, c_max=args.c_max, n_boot=args.n_boot,
                           n_boot_offset=min(args.n_boot, FitSettings.n_boot_offset), block=args.block,
                           seed=args.seed, chinchilla=args.chinchilla)
    warnings = warmup_warnings(runs, args.skip_tokens, args.skip_warmup)
    results = []
    for arch, rs in group_by_arch(runs).items():
        rs, seq_warn = select_seq_len(rs, args.seq_len)
        warnings += seq_warn
        if rs:
            results.append(analyze_arch(arch, rs, settings))
    print(console_summary(results, problems, include_embedding, warnings))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(results, settings, include_embedding, warnings), indent=1))
        print(f"\nwrote {args.json}")
    if args.markdown:
        from scaling.report import markdown_tables
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_tables(results, include_embedding) + "\n")
        print(f"wrote {args.markdown}")
    if args.plots:
        from scaling.plots import write_plots
        for path in write_plots(results, args.plots, include_embedding):
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

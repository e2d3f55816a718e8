"""Scaling-law fits from training runs: L(C), N_opt(C), D_opt(C) per architecture (docs/scaling.md).

    python launch/fit_scaling.py runs/* --json fits.json --markdown table.md --plots plots/ [--chinchilla]

C is in PFLOP-days (1 PFLOP-day = 8.64e19 FLOPs), recomputed from each run's config with the paper's formulas;
by default it is the paper's C, training FLOPs without the embedding term (--embedding-flops adds it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints.atomic import make_output_dir  # noqa: E402
from scaling.analysis import analyze_arch  # noqa: E402
from scaling.fit_config import FitScalingConfig  # noqa: E402
from scaling.report import console_summary, to_json  # noqa: E402
from scaling.runs import (METRICS_FILE, RunError, group_by_arch, load_runs, logged_tokens_per_step,  # noqa: E402
                          mixed_vocab, select_seq_len)
from scaling.units import PFLOP_DAY  # noqa: E402
from pretrain.cli import parse_config_args  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402

# no study reaches 1e9 PFLOP-days (8.6e28 FLOPs); a bound that large was given in FLOPs
MAX_PLAUSIBLE_PFLOP_DAYS = 1e9


def parse_args(argv: list[str] | None = None) -> FitScalingConfig:
    return parse_config_args(FitScalingConfig, argv, __doc__)


def check_c_bounds(args: FitScalingConfig) -> str | None:
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


def prepare_outputs(args: FitScalingConfig) -> None:
    """Make the folders of --json, --markdown and --plots before any fit runs, so that a path that cannot be
    written (a file in the way, a directory given as --json) is one error line up front, not a traceback after
    the fits (and their bootstrap) are done."""
    for flag, f in (("--json", args.json), ("--markdown", args.markdown)):
        if f is None:
            continue
        if f.is_dir():
            raise IsADirectoryError(f"{flag} {f}: is a directory; give a file path, e.g. {f / ('fits.json' if flag == '--json' else 'table.md')}")
        make_output_dir(f.parent, f"{flag} {f}")
    if args.plots is not None:
        make_output_dir(args.plots, f"--plots {args.plots}")


def warmup_warnings(runs, skip_tokens: float, skip_warmup: bool) -> list[str]:
    """--skip-warmup for runs whose config does not say where their warm-up ends (it drops nothing of them), and
    --skip-tokens that ends inside a run's warm-up: a cut meant to drop the warm-up that does not."""
    if skip_warmup:
        unknown = [r for r in runs if r.warmup_tokens is None]
        if not unknown:
            return []
        return [f"--skip-warmup drops nothing of {len(unknown)} run(s) "
                f"({', '.join(r.name for r in unknown[:4])}{', ...' if len(unknown) > 4 else ''}): their "
                f"config.json has no optim.warmup_steps (or no batch size to turn it into tokens), so the rows of "
                f"their warm-up, if any, are fitted; add optim.warmup_steps to config.json, or cut the rows with "
                f"--skip-tokens"]
    if skip_tokens <= 0:
        return []
    short = [r for r in runs if r.warmup_tokens and skip_tokens < r.warmup_tokens]
    if not short:
        return []
    return [f"--skip-tokens {skip_tokens:.3g} ends before the lr warm-up of {len(short)} run(s) "
            f"({', '.join(f'{r.name}: {r.warmup_tokens:.3g} tokens' for r in short[:4])}"
            f"{', ...' if len(short) > 4 else ''}); rows inside the warm-up are fitted. --skip-warmup drops each "
            f"run's own warm-up"]


def skip_tokens_unit_warnings(runs, skip_tokens: float) -> list[str]:
    """--skip-tokens below one optimizer step of every run: it can drop at most a run's very first row, so it
    was most likely meant in billions (7.9 for the paper's 7.9B-token warm-up) and drops nothing."""
    if skip_tokens <= 0:
        return []
    per_step = [t for t in (logged_tokens_per_step(r.path / METRICS_FILE) for r in runs) if t]
    if not per_step or skip_tokens >= min(per_step):
        return []
    return [f"--skip-tokens {skip_tokens:g} is less than one optimizer step of every run (the smallest batch is "
            f"{min(per_step):.4g} tokens): it counts tokens, not billions of them (7.9e9 for 7.9B)"]


def conflicting_flags(args: FitScalingConfig) -> str | None:
    """An error message for flags that ask for opposite things, else None."""
    if args.embedding_flops and args.no_embedding_flops:
        return ("--embedding-flops and --no-embedding-flops ask for two different C; give one (C without the "
                "embedding term, the paper's, is the default)")
    return None


def _main(argv=None) -> int:
    args = parse_args(argv)
    include_embedding = args.embedding_flops
    bad = conflicting_flags(args) or check_c_bounds(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    prepare_outputs(args)
    try:
        runs, problems = load_runs(args.runs, include_embedding, args.loss_key, args.skip_tokens, args.skip_bad,
                                   skip_warmup=args.skip_warmup)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    settings = args.settings()
    warnings = skip_tokens_unit_warnings(runs, args.skip_tokens) + warmup_warnings(runs, args.skip_tokens,
                                                                                  args.skip_warmup)
    if args.smooth > 0 and args.envelope != "logged":
        warnings.append(f"--smooth {args.smooth:g} smooths the logged losses of --envelope logged (and the points of "
                        f"--chinchilla); the {args.envelope} envelope does not use them, so it is not smoothed")
    results = []
    lengths = sorted({r.seq_len for r in runs})
    if args.seq_len is not None and args.seq_len not in lengths:
        print(f"error: --seq-len {args.seq_len}: no run was trained at that context length (the runs have "
              f"{lengths}); pass one of those, or leave --seq-len out", file=sys.stderr)
        return 2
    by_arch = group_by_arch(runs)
    for rs in by_arch.values():
        mixed = mixed_vocab(rs)
        if mixed:
            print(f"error: {mixed}", file=sys.stderr)
            return 2
    for arch, rs in by_arch.items():
        rs, seq_warn = select_seq_len(rs, args.seq_len)
        warnings += seq_warn
        if rs:
            results.append(analyze_arch(arch, rs, settings))
    print(console_summary(results, problems, include_embedding, warnings, args.loss_key))
    if args.json:
        selection = {"skip_tokens": args.skip_tokens, "skip_warmup": args.skip_warmup, "seq_len": args.seq_len}
        args.json.write_text(json.dumps(to_json(results, settings, include_embedding, warnings, args.loss_key,
                                                selection), indent=1))
        print(f"\nwrote {args.json}")
    if args.markdown:
        from scaling.report import markdown_tables
        args.markdown.write_text(markdown_tables(results, include_embedding, args.loss_key) + "\n")
        print(f"wrote {args.markdown}")
    if args.plots:
        from scaling.plots import write_plots
        for path in write_plots(results, args.plots, include_embedding, args.loss_key):
            print(f"wrote {path}")
    if not any(r.loss_fit is not None for r in results):
        print("error: no architecture could be fitted (the NOTE and WARNING lines above say why)", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

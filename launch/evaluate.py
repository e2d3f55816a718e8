"""Evaluate every exported snapshot of one or more runs (see docs/evaluation.md).

    python launch/evaluate.py runs/tnl-1b --suite paper
    python launch/evaluate.py runs/*/ --suite quick --out eval_all
    python launch/evaluate.py runs/tnl-1b/exports/step_00010000 --tasks wikitext2 niah_standard --limit 8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# replace (not prepend) this folder on the path: as "evaluate.py" it would shadow HF's `evaluate`
# package, which lm-eval's SCROLLS tasks import
sys.path[0] = str(Path(__file__).resolve().parents[1])

from evaluation.sweep import SUITES, SweepConfig, sweep  # noqa: E402
from pretrain.argtypes import positive_int, ranged  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402

TASKS = sorted(set(SUITES["paper"]) | {"valid_loss"})  # what --tasks accepts (the paper suite, plus held-out loss)


def parse_args(argv: list[str] | None = None) -> SweepConfig:
    d = SweepConfig(runs=[])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (with exports/*/) or export directories")
    p.add_argument("--suite", choices=sorted(SUITES), default=d.suite)
    p.add_argument("--tasks", nargs="+", choices=TASKS, metavar="TASK",
                   help=f"instead of the suite, any of: {' '.join(TASKS)}")
    p.add_argument("--out", help="results folder (default: <first run>/eval)")
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size)
    p.add_argument("--limit", type=positive_int, help="examples per task (smoke runs)")
    p.add_argument("--max-length", type=ranged(int, ge=2), help="scoring window (default: each snapshot's training context)")
    p.add_argument("--niah-lengths", type=positive_int, nargs="+", default=d.niah_lengths)
    p.add_argument("--niah-depths", type=ranged(float, ge=0, le=100), nargs="+", default=d.niah_depths,
                   help="needle depths in percent of the haystack")
    p.add_argument("--niah-trials", type=positive_int, default=d.niah_trials)
    p.add_argument("--niah-scoring", choices=["exact", "partial"], default=d.niah_scoring,
                   help="exact: a reply scores 10 only with the exact value, else 1; partial: credit per correct "
                        "leading digit (docs/evaluation.md)")
    p.add_argument("--niah-threshold", type=ranged(float, ge=1, le=10), default=d.niah_threshold,
                   help="a cell succeeds when its mean score >= this (for the NIAH score's penalty)")
    p.add_argument("--niah-haystack", nargs="+", default=d.niah_haystack, help="text files (default: Gutenberg books)")
    p.add_argument("--valid-shards", nargs="+", default=d.valid_shards, help="uint32 token files (globs)")
    p.add_argument("--valid-seq-len", type=positive_int, default=d.valid_seq_len)
    p.add_argument("--valid-windows", type=positive_int, default=d.valid_windows)
    p.add_argument("--force", action="store_true", help="ignore cached results")
    a = p.parse_args(argv)
    for r in a.runs:
        if not Path(r).exists():
            raise FileNotFoundError(f"{r}: no such run or export directory (give runs/NAME, whose exports/ "
                                    f"launch/export.py writes, or runs/NAME/exports/step_N)")
    return SweepConfig(**{k: v for k, v in vars(a).items()})


def _main(argv: list[str] | None = None) -> int:
    sweep(parse_args(argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

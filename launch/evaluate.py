"""Evaluate every exported snapshot of one or more runs (see docs/evaluation.md).

    python launch/evaluate.py runs/tnl-1b --suite paper
    python launch/evaluate.py runs/*/ --suite quick --out eval_all
    python launch/evaluate.py runs/tnl-1b/exports/step_00010000 --tasks wikitext2 niah_standard --limit 8
"""
from __future__ import annotations

import sys
from pathlib import Path

# replace (not prepend) this folder on the path: as "evaluate.py" it would shadow HF's `evaluate`
# package, which lm-eval's SCROLLS tasks import
sys.path[0] = str(Path(__file__).resolve().parents[1])

from evaluation.sweep import SweepConfig, sweep  # noqa: E402
from pretrain.cli import parse_config_args  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> SweepConfig:
    """The sweep config from the command line: one flag per SweepConfig field (`--batch-size` -> batch_size)."""
    cfg = parse_config_args(SweepConfig, argv, __doc__)
    for r in cfg.runs:
        if not Path(r).exists():
            raise FileNotFoundError(f"{r}: no such run or export directory (give runs/NAME, whose exports/ "
                                    f"launch/export.py writes, or runs/NAME/exports/step_N)")
    return cfg


def _main(argv: list[str] | None = None) -> int:
    sweep(parse_args(argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

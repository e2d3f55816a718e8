"""Test-only seam: fault injection. Production runs never set these; tests do, to exercise the paths that
real faults take (a NaN loss on some rank, a run of bad steps) without waiting for one.

    LINSCALE_INJECT_NONFINITE=5,7   the loss of steps 5 and 7 (0-based) is made NaN, on every rank

An environment variable, not a flag, because the multi-process tests start their ranks through launchers
(torchrun, deepspeed) that pass the environment on; it is not part of the run config and never recorded.
"""
from __future__ import annotations

import os

INJECT_NONFINITE = "LINSCALE_INJECT_NONFINITE"


def injected_nonfinite_steps() -> set[int]:
    """The steps whose loss a test asked to be non-finite (empty in a normal run)."""
    raw = os.environ.get(INJECT_NONFINITE, "")
    try:
        return {int(s) for s in raw.split(",") if s.strip()}
    except ValueError:
        raise ValueError(f"{INJECT_NONFINITE}={raw!r}: expected comma-separated step numbers, e.g. 5,7") from None

"""argparse types for the numeric flags of the commands in launch/: a value of the wrong type or outside
its range is a usage error naming the flag, the value and what is allowed (`argument --limit: -2: out of
range; allowed: >= 1`), never a traceback or a silently odd result later."""
from __future__ import annotations

import argparse
import math
from typing import Callable


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    parts = [f"{op} {v:g}" for op, v in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if v is not None]
    return " and ".join(parts)


def ranged(kind: type, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> Callable[[str], int | float]:
    """An argparse `type` reading an int or float (`kind`) that must satisfy the given bounds.

    Args:
        kind: int or float.
        ge, gt, le, lt: the bounds (>=, >, <=, <); None for no bound. Floats must also be finite.
    Returns:
        a callable for `add_argument(type=...)`; its __name__ reads well in argparse's messages.
    """
    allowed = _bounds(ge, gt, le, lt)
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}{' ' + allowed if allowed else ''}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: not a finite number")
        if ((ge is not None and not value >= ge) or (gt is not None and not value > gt)
                or (le is not None and not value <= le) or (lt is not None and not value < lt)):
            raise argparse.ArgumentTypeError(f"{text}: out of range; allowed: {allowed}")
        return value

    parse.__name__ = f"{kind.__name__} {allowed}".strip()
    return parse


positive_int = ranged(int, ge=1)
non_negative_int = ranged(int, ge=0)
positive_float = ranged(float, gt=0)
non_negative_float = ranged(float, ge=0)
fraction = ranged(float, ge=0, le=1)


def int_list(lo: int | None = None, hi: int | None = None, example: str = "1,2,4") -> Callable[[str], list[int]]:
    """An argparse `type` reading a comma-separated list of whole numbers, each in [lo, hi] (None: no bound)."""
    span = ("" if lo is None else f" from {lo}") + ("" if hi is None else f" to {hi}")

    def parse(text: str) -> list[int]:
        try:
            items = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            items = []
        if not items or (lo is not None and min(items) < lo) or (hi is not None and max(items) > hi):
            raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers{span}, comma-separated, e.g. {example}")
        return items
    return parse


def name_arg(resolve: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse `type` for one registry name: `resolve` (e.g. models.registry.canonical_arch) returns the
    registry's name or raises ValueError with the choices, which becomes the usage error."""
    def parse(text: str) -> str:
        try:
            return resolve(text.strip())
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def name_list(resolve: Callable[[str], str]) -> Callable[[str], list[str]]:
    """An argparse `type` for a comma-separated list of registry names, each through `resolve` (name_arg)."""
    one = name_arg(resolve)

    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r}: empty; give comma-separated names")
        return [one(x) for x in names]
    return parse

"""Compute units. Fits are done with C in PFLOP-days (the paper's unit: with C in FLOPs its coefficients,
e.g. L = 3.7087 * C^-0.0798, would predict losses below 0.1 at 1e21 FLOPs)."""
from __future__ import annotations

import numpy as np

PFLOP_DAY = 1e15 * 86400  # FLOPs in one PFLOP-day: 1e15 FLOP/s sustained for 86,400 s


def flops_to_pflop_days(flops: float | np.ndarray) -> float | np.ndarray:
    return flops / PFLOP_DAY


def pflop_days_to_flops(pflop_days: float | np.ndarray) -> float | np.ndarray:
    return pflop_days * PFLOP_DAY


def coef_pflop_days_to_flops(coef: float, exponent: float) -> float:
    """y = k * C_pfd^e  ==  (k * PFLOP_DAY^-e) * C_flops^e: the coefficient of the same law with C in FLOPs."""
    return float(coef * PFLOP_DAY ** (-exponent))

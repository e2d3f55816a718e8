"""The settings of launch/fit_scaling.py: one field per flag (the command line is derived from them by
pretrain.cli), and the fit's own settings (`scaling.analysis.FitSettings`) made from them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pretrain.argtypes import non_negative_float, non_negative_int, positive_float, positive_int, ranged
from pretrain.cli import option
from scaling.analysis import FitSettings
from scaling.envelope import MAX_POINTS_PER_DECADE, POINTS_PER_DECADE_WHY

_FIT = FitSettings()  # the fit's own defaults


def points_per_decade_arg(text: str) -> int:
    """--points-per-decade: an integer from 1 to MAX_POINTS_PER_DECADE; the error says why the bound."""
    value = ranged(int, ge=1)(text)
    if value > MAX_POINTS_PER_DECADE:
        raise argparse.ArgumentTypeError(f"{text}: out of range; allowed: >= 1 and <= {MAX_POINTS_PER_DECADE}: "
                                         f"{POINTS_PER_DECADE_WHY}")
    return value


points_per_decade_arg.__name__ = f"int >= 1 and <= {MAX_POINTS_PER_DECADE}"


@dataclass
class FitScalingConfig:
    """What launch/fit_scaling.py does; its command line is derived from these fields (pretrain.cli)."""
    runs: list[str] = option(positional=True, help="run directories (config.json + metrics.jsonl), or folders of them")
    json: Path | None = option(None, help="write every fit, the envelopes and the settings here")
    markdown: Path | None = option(None, help="write the tables (ours, and Table 3 beside the paper's) here")
    plots: Path | None = option(None, help="write Figure-1-style PNGs into this directory")
    embedding_flops: bool = option(False, help="count the 12*b*n*d*v embedding (LM-head) FLOPs in C; the default "
                                               "leaves them out, as the paper's C does")
    no_embedding_flops: bool = option(False, hidden=True)  # the default; the flag is still accepted
    chinchilla: bool = option(False, help="also fit L(N,D) = E + A/N^alpha + B/D^beta (approach 3) and its "
                                          "N_opt(C), D_opt(C) under each architecture's FLOPs per token")
    chinchilla_boot: int = option(_FIT.chinchilla_boot, type=non_negative_int,
                                  help="bootstrap replicates over runs for the approach-3 N_opt/D_opt intervals (0 = none)")
    chinchilla_max_tokens: float | None = option(None, type=positive_float,
                                                 help="leave rows past this many tokens out of approach 3 (e.g. "
                                                      "past one epoch of a repeated corpus)")
    loss_key: str = option("loss", help="metrics.jsonl key to fit (e.g. val_loss)")
    skip_tokens: float = option(0.0, type=non_negative_float, help="ignore rows before this many tokens")
    skip_warmup: bool = option(False, help="ignore the rows of each run's lr warm-up (steps <= optim.warmup_steps "
                                           "of its own config)")
    seq_len: int | None = option(None, type=positive_int, help="fit only runs trained at this context length")
    points_per_decade: int = option(_FIT.points_per_decade, type=points_per_decade_arg,
                                    help=f"C grid density: log-spaced points per factor 10 of C, 1 to "
                                         f"{MAX_POINTS_PER_DECADE} (a finer grid changes no fit)")
    envelope: str = option(_FIT.envelope, choices=["fitted", "logged"],
                           help="envelope of each size's fitted learning curve L(D) = e + b*D^-beta, or of the "
                                "logged losses (noisier: the minimum over runs favours lucky rows)")
    smooth: float = option(_FIT.smooth_decades, type=non_negative_float,
                           help="with --envelope logged: half-width in decades of tokens of a box filter on each "
                                "run's loss (0 = off; ~0.02 for noisy logs)")
    min_runs: int = option(_FIT.min_runs, type=positive_int, help="fit L(C) only at C where this many model sizes "
                                                                  "are present (seeds of one size count once)")
    c_min: float | None = option(None, type=positive_float,
                                 help="fit only C >= this, in PFLOP-days (the unit of the tables)")
    c_max: float | None = option(None, type=positive_float,
                                 help="fit only C <= this, in PFLOP-days (the unit of the tables)")
    n_boot: int = option(_FIT.n_boot, type=non_negative_int, help="replicate studies for the intervals (0 = none)")
    block: int | None = option(_FIT.block, type=positive_int, help="residual block length in rows for the replicates "
                                                "(default: rows^(1/3) per run)")
    seed: int = option(_FIT.seed, type=non_negative_int)
    skip_bad: bool = option(False, help="leave out unreadable run directories instead of failing")

    def settings(self) -> FitSettings:
        return FitSettings(points_per_decade=self.points_per_decade, smooth_decades=self.smooth,
                           envelope=self.envelope, min_runs=self.min_runs, c_min=self.c_min, c_max=self.c_max,
                           n_boot=self.n_boot, n_boot_offset=min(self.n_boot, FitSettings.n_boot_offset),
                           block=self.block, seed=self.seed, chinchilla=self.chinchilla,
                           chinchilla_boot=self.chinchilla_boot, chinchilla_max_tokens=self.chinchilla_max_tokens)

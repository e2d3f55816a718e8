"""Synthetic runs drawn from a known loss law, written in the trainer's run-directory format, for tests and the
worked example in docs/scaling.md:

    L(N, D) = E + A / N^alpha + B / D^beta        N non-embedding params (paper formula), D tokens

With C ∝ N*D (as the paper's FLOPs are, up to the attention terms) the compute-optimal frontier of this law is
N_opt ∝ C^(beta/(alpha+beta)), D_opt ∝ C^(alpha/(alpha+beta)), and for E = 0 it is exactly
L_opt ∝ C^(-alpha*beta/(alpha+beta)): the reference values a fit of the runs should recover.

    python -m scaling.synthetic OUT_DIR [--arch llama tnl ...] [--sizes tiny mini 70m ...] [--noise 0.01]
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from models.accounting import paper_non_embedding_params
from models.config import ModelConfig
from models.registry import arch_names
from models.sizes import model_config
from scaling.chinchilla import loglog_interpolator
from scaling.runs import compute_per_token


@dataclass
class LossLaw:
    E: float = 1.69        # Chinchilla's published fit, a realistic shape
    A: float = 406.4
    B: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28

    def __call__(self, n: float | np.ndarray, d: float | np.ndarray) -> np.ndarray:
        return self.E + self.A / np.asarray(n, dtype=np.float64) ** self.alpha + self.B / np.asarray(d, dtype=np.float64) ** self.beta

    @property
    def a(self) -> float:
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    @property
    def loss_exponent(self) -> float:
        """Exponent of the reducible loss along the frontier: L_opt - E ∝ C^this."""
        return -self.alpha * self.beta / (self.alpha + self.beta)


def write_run(out: str | Path, cfg: ModelConfig, law: LossLaw, max_tokens: float, seq_len: int = 2048,
              global_batch: int = 8, n_rows: int = 300, noise: float = 0.0, seed: int = 0,
              nan_every: int = 0, drop_frac: float = 0.0, truncate_last: bool = False, early_rows: int = 0,
              warmup_steps: int | None = None, extra_config: dict | None = None) -> Path:
    """One run directory with ~n_rows rows logged every k steps up to max_tokens, plus `early_rows` log-spaced
    rows over the 16x fewer steps before the first of them (a trainer's first logs). noise is the std of a
    multiplicative log-normal factor on the loss; nan_every > 0 writes a NaN loss on every such row;
    drop_frac leaves rows out at random; truncate_last cuts the final line in half (a crash mid-write);
    warmup_steps is written as the config's optim.warmup_steps."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens_per_step = seq_len * global_batch
    steps = max(1, int(max_tokens // tokens_per_step))
    log_every = max(1, steps // n_rows)
    n = paper_non_embedding_params(cfg)
    fpt = compute_per_token(cfg, seq_len, include_embedding=True)
    config = {"model": cfg.to_dict(), "train": {"seq_len": seq_len, "global_batch": global_batch, "lr": 3e-4},
              "synthetic_law": asdict(law)}
    if warmup_steps is not None:
        config["optim"] = {"warmup_steps": warmup_steps}
    config.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    lines = []
    # early rows cover the 16x of steps before the first regular row, log-spaced (a trainer's first logs)
    early = ([int(x) for x in np.unique(np.round(np.geomspace(max(1, log_every / 16), log_every, early_rows + 1)[:-1]))]
             if early_rows and log_every > 1 else [])
    for i, step in enumerate([*early, *range(log_every, steps + 1, log_every)]):
        if drop_frac and rng.random() < drop_frac:
            continue
        tokens = step * tokens_per_step
        loss = float(law(n, tokens)) * math.exp(noise * rng.standard_normal())
        if nan_every and i % nan_every == nan_every - 1:
            loss = float("nan")
        lines.append(json.dumps({"step": step, "tokens": tokens, "loss": loss, "lr": 3e-4,
                                 "flops": fpt * tokens}))
    text = "\n".join(lines) + "\n"
    if truncate_last and lines:
        text = "\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2]
    (out / "metrics.jsonl").write_text(text)
    return out


def frontier(law: LossLaw, flops_per_token, c: np.ndarray, n_bounds: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """The law's exact compute-optimal N and D at each C (FLOPs) under a FLOPs-per-token function of N:
    N_opt(C) = argmin_N L(N, C / fpt(N)) by bounded scalar minimisation (no C ∝ N·D assumption), D = C/fpt(N).
    The reference a fit of synthetic runs should recover: with the paper's FLOPs, fpt is not exactly 6N, so
    the exponents differ slightly from beta/(alpha+beta)."""
    from scipy.optimize import minimize_scalar
    n_opt = []
    for cc in np.asarray(c, dtype=np.float64):
        r = minimize_scalar(lambda x: float(law(np.exp(x), cc / flops_per_token(np.exp(x)))),
                            bounds=(np.log(n_bounds[0]), np.log(n_bounds[1])), method="bounded",
                            options={"xatol": 1e-10})
        n_opt.append(np.exp(r.x))
    n_opt = np.array(n_opt)
    return n_opt, np.asarray(c, dtype=np.float64) / np.array([flops_per_token(x) for x in n_opt])


def frontier_exponents(law: LossLaw, sizes: list[tuple[float, float]], c_lo: float, c_hi: float,
                       points: int = 25) -> tuple[float, float]:
    """Exponents (a, b) of the law's exact frontier over [c_lo, c_hi] FLOPs, for a ladder of (N, FLOPs per token)
    `sizes`: fpt(N) is log-log interpolated between them and extended by the end segments' slopes."""
    n = np.array(sorted(x for x, _ in sizes), dtype=np.float64)
    c = np.geomspace(c_lo, c_hi, points)
    n_opt, d_opt = frontier(law, loglog_interpolator(sizes), c, (n[0] / 20, n[-1] * 20))
    if not ((n_opt > n[0] / 19).all() and (n_opt < n[-1] * 19).all()):
        raise ValueError("the law's optimum left the searched range of N: widen the ladder or the C range")
    return float(np.polyfit(np.log(c), np.log(n_opt), 1)[0]), float(np.polyfit(np.log(c), np.log(d_opt), 1)[0])


def size_ladder(arch: str, k: int, n_min: float = 3e6, n_max: float = 7e9, aspect: float = 100.0) -> list[ModelConfig]:
    """k model shapes whose non-embedding parameters are about geometric from n_min to n_max: width a multiple
    of the paper's head width 128 near (aspect·N/12)^(1/3), layers to match N ~ 12·layers·width² (so
    width/layers ~ aspect), GLU width 3·width. The rounding makes the steps uneven (as real ladders are);
    sizes are named l<layers>d<width>."""
    out = []
    for n in np.geomspace(n_min, n_max, k):
        d = max(128, int(round((n * aspect / 12) ** (1 / 3) / 128)) * 128)
        layers = max(1, int(round(n / (12 * d * d))))
        out.append(model_config(arch, "70m", n_layers=layers, d_model=d, n_heads=d // 128, d_glu=3 * d,
                                size=f"l{layers}d{d}"))
    return out


def write_sweep(out_root: str | Path, arch: str, sizes: list[str | ModelConfig], law: LossLaw,
                tokens_per_param: float = 400.0, seed: int = 0, **run_kwargs) -> list[Path]:
    """One run per size (a registry name, or a ModelConfig such as size_ladder's), each trained to
    tokens_per_param * N tokens, long past its compute-optimal point so neighbouring sizes overlap in C and
    the envelope has a crossover to find."""
    paths = []
    for k, size in enumerate(sizes):
        cfg = size if isinstance(size, ModelConfig) else model_config(arch, size)
        size = cfg.size
        n = paper_non_embedding_params(cfg)
        paths.append(write_run(Path(out_root) / f"{cfg.arch}-{size}", cfg, law, tokens_per_param * n,
                               seed=seed * 1000 + k, **run_kwargs))
    return paths


def _main(argv: list[str] | None = None) -> None:
    from pretrain.argtypes import non_negative_float, non_negative_int, positive_int
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="directory to write run directories into (one per arch and size)")
    p.add_argument("--arch", nargs="+", default=list(arch_names()))
    p.add_argument("--sizes", nargs="+", default=["tiny", "mini", "70m", "160m", "410m", "1b", "3b", "7b"])
    p.add_argument("--noise", type=non_negative_float, default=0.01, help="std of the multiplicative log-normal loss noise")
    p.add_argument("--rows", type=positive_int, default=300, help="about this many logged rows per run")
    p.add_argument("--early-rows", type=non_negative_int, default=40,
                   help="log-spaced rows before the first regular one (a trainer's first logs)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    args = p.parse_args(argv)
    for j, arch in enumerate(args.arch):
        # a slightly different law per arch so the worked example's table has something to compare
        law = LossLaw(E=1.69 - 0.03 * j, A=406.4, B=410.7 * (1 - 0.05 * j), alpha=0.34, beta=0.28 + 0.01 * j)
        paths = write_sweep(args.out, arch, args.sizes, law, seed=args.seed + j, noise=args.noise, n_rows=args.rows,
                            early_rows=args.early_rows)
        print(f"{arch}: {len(paths)} runs, law {law} (a = {law.a:.3f}, b = {law.b:.3f})")


def main(argv: list[str] | None = None) -> int:
    """A bad size or architecture ends in one `error:` line and exit code 2, not a traceback."""
    from pretrain.errors import run_cli
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

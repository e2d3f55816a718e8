"""The plan of a study: every run with its name, shape, non-embedding N, token budget, steps, compute C by
the project's FLOPs accounting (models.accounting) and snapshot schedule, and the exact launch/pretrain.py
flags that train it. The flags are parsed by pretrain's own parser, so the plan describes the run config
the trainer will use, not a copy of it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaling.study.config import StudyConfig

# pretrain's CPU presets fill these when a flag is absent (pretrain/config.py SMALL_SIZE_PRESETS); the study
# passes every one explicitly so that a run of a registry size like `tiny` follows the study's recipe
PRESET_FIELDS = ("train.seq_len", "train.global_batch_tokens", "train.micro_batch", "train.max_steps",
                 "optim.lr", "optim.warmup_steps", "train.log_every", "train.eval_every",
                 "checkpoint.snapshot_every_tokens", "checkpoint.snapshot_log_points")
# the base registry size under the overrides of a custom shape: one without a CPU preset
CUSTOM_BASE_SIZE = "70m"


@dataclass
class RunPlan:
    name: str                      # <arch>-<size>
    arch: str
    size: str
    shape: tuple[int, int, int, int]   # (n_layers, d_model, n_heads, d_glu)
    n_params: int                  # non-embedding, the paper's formula
    n_params_total: int            # every parameter, embedding included
    tokens_budget: int
    tokens_per_step: int
    steps: int
    tokens: int                    # steps x tokens_per_step (>= the budget)
    flops: float                   # training FLOPs, paper formulas, embedding term included
    flops_non_embedding: float     # the paper's C (its FLOPs table leaves the embedding out)
    snapshot_steps: list[int]
    run_dir: Path
    argv: list[str] = field(default_factory=list)   # launch/pretrain.py flags (without --resume)

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.n_params


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def run_settings(study: StudyConfig, arch: str, size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(recipe fields, model overrides) of one run: the study recipe, then per_run entries for the arch, the
    size and the arch-size (later wins)."""
    from pretrain.config import SECTIONS
    fields: dict[str, Any] = {}
    for path in PRESET_FIELDS:  # the paper defaults, so that no CPU preset applies
        section, name = path.split(".")
        fields[path] = SECTIONS[section].__dataclass_fields__[name].default
    fields.update(study.recipe)
    model = dict(study.model)
    for key in (arch, size, f"{arch}-{size}"):
        for k, v in study.per_run.get(key, {}).items():
            if k.startswith("model."):
                model[k[len("model."):]] = v
            else:
                fields[k] = v
    return fields, model


def pretrain_argv(study: StudyConfig, arch: str, size: str, run_dir: Path, steps: int, tokens: int) -> list[str]:
    spec = study.size(size)
    fields, model = run_settings(study, arch, size)
    fields.update({"train.seq_len": study.seq_len, "train.global_batch_tokens": study.global_batch_tokens,
                   "train.max_steps": steps, "train.max_tokens": tokens,
                   "checkpoint.snapshot_every_tokens": study.snapshot_every_tokens,
                   "checkpoint.snapshot_log_points": study.snapshot_log_points})
    argv = ["--arch", arch, "--out", str(run_dir)]
    if spec.registry:
        argv += ["--size", size]
    else:
        argv += ["--size", CUSTOM_BASE_SIZE]
        model = {**dict(zip(("n_layers", "d_model", "n_heads", "d_glu"), spec.shape)), "size": size, **model}
    if study.data is not None:
        argv += ["--data", study.data]
    from pretrain.config import flag_name
    for path, v in fields.items():
        if v is not None:
            argv += [flag_name(path), _value(v)]
    for k, v in model.items():
        argv += ["--model", f"{k}={_value(v)}"]
    return argv


def snapshot_steps(every_tokens: int, log_points: int, tokens_per_step: int, steps: int) -> list[int]:
    """The steps the checkpoint manager will snapshot at (its SnapshotSchedule), plus the final step."""
    from checkpoints.schedule import SnapshotSchedule
    sched = SnapshotSchedule(every_tokens, log_points, tokens_per_step, steps * tokens_per_step)
    return sorted(set(sched.steps(steps)) | {steps})


def _parse_run_config(name: str, argv: list[str]):
    """pretrain's config of one run's flags. A value pretrain's argparse rejects (recipe.optim.lr: abc) would
    print pretrain's whole usage under study.py's name and exit; it becomes one error naming the recipe field."""
    import contextlib
    import io

    from pretrain.config import SECTIONS, flag_name, parse_config
    err_text = io.StringIO()
    try:
        with contextlib.redirect_stderr(err_text):
            return parse_config(argv)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"study config: run {name}: the pretrain config is invalid: {err}") from None
    except SystemExit:
        lines = [ln for ln in err_text.getvalue().splitlines() if "error:" in ln]
        msg = lines[-1].split("error:", 1)[1].strip() if lines else err_text.getvalue().strip()
        flags = {flag_name(f"{sec}.{f}"): f"{sec}.{f}" for sec, cls in SECTIONS.items()
                 for f in cls.__dataclass_fields__}
        for flag, path in flags.items():
            if msg.startswith(f"argument {flag}:") or msg.startswith(f"argument {flag}/"):
                msg = f"{path} (recipe or per_run; pretrain flag {flag}):{msg.split(':', 1)[1]}"
                break
        raise ValueError(f"study config: run {name}: {msg}") from None


def plan_study(study: StudyConfig) -> list[RunPlan]:
    """One RunPlan per (size, arch), sizes in the config's order (small to large is the natural one)."""
    from models.accounting import exact_params, flops_per_step, paper_non_embedding_params
    plans = []
    for spec in study.sizes:
        for arch in study.archs:
            name = f"{arch}-{spec.name}"
            run_dir = study.out / "runs" / name
            budget = study.budget(arch, spec.name)
            tokens_per_step = study.global_batch_tokens
            steps = math.ceil(budget / tokens_per_step)
            argv = pretrain_argv(study, arch, spec.name, run_dir, steps, budget)
            cfg = _parse_run_config(name, argv)
            mcfg = cfg.model()
            batch = cfg.global_batch
            per_step = flops_per_step(mcfg, batch, cfg.train.seq_len)
            per_step_ne = flops_per_step(mcfg, batch, cfg.train.seq_len, include_embedding=False)
            plans.append(RunPlan(
                name=name, arch=arch, size=spec.name,
                shape=(mcfg.n_layers, mcfg.d_model, mcfg.n_heads, mcfg.d_glu),
                n_params=paper_non_embedding_params(mcfg), n_params_total=exact_params(mcfg)["total"],
                tokens_budget=budget, tokens_per_step=tokens_per_step, steps=steps, tokens=steps * tokens_per_step,
                flops=steps * per_step, flops_non_embedding=steps * per_step_ne,
                snapshot_steps=snapshot_steps(cfg.checkpoint.snapshot_every_tokens, cfg.checkpoint.snapshot_log_points,
                                              tokens_per_step, steps),
                run_dir=run_dir, argv=argv))
    return plans


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_plan(study: StudyConfig, plans: list[RunPlan]) -> str:
    """The plan as a table, then the totals (compute in FLOPs and PFLOP-days)."""
    from scaling.units import flops_to_pflop_days
    head = ["run", "shape l/d/h/g", "N (non-emb)", "N total", "tokens", "D/N", "steps", "C (FLOPs)",
            "C non-emb", "snapshots at steps"]
    rows = [[p.name, "/".join(map(str, p.shape)), _si(p.n_params), _si(p.n_params_total), _si(p.tokens),
             f"{p.tokens_per_param:.3g}", str(p.steps), f"{p.flops:.3e}", f"{p.flops_non_embedding:.3e}",
             ",".join(map(str, p.snapshot_steps))] for p in plans]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    total = sum(p.flops for p in plans)
    total_ne = sum(p.flops_non_embedding for p in plans)
    ns = sorted({p.n_params for p in plans})
    out = [f"study {study.name}: {len(plans)} runs ({len(study.archs)} archs x {len(study.sizes)} sizes), "
           f"seq_len {study.seq_len}, {study.global_batch_tokens:,} tokens per step, data "
           f"{study.data or '(embedded default corpus)'}", f"directory {study.out}", "",
           line(head), line(["-" * w for w in widths]), *map(line, rows), "",
           f"total compute: {total:.4e} FLOPs = {flops_to_pflop_days(total):.4g} PFLOP-days (embedding term "
           f"included); {total_ne:.4e} FLOPs = {flops_to_pflop_days(total_ne):.4g} PFLOP-days non-embedding "
           f"(the paper's C)",
           f"total tokens: {sum(p.tokens for p in plans):,}; non-embedding N spans {ns[0]:,} - {ns[-1]:,} "
           f"({ns[-1] / ns[0]:.3g}x)"]
    return "\n".join(out)

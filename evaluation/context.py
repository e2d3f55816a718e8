"""The context length a model was trained at, read from its export, and the scoring window derived from it.

Perplexity (rolling windows) and lm-eval requests are scored in windows of the training context by default: a
model trained at 2K and scored in 8K windows is measured on positions it never saw in training (and a linear
model's recurrent state carries 4x more history than it learnt to use). The model config's `max_seq_len` is
no substitute: for LLaMA it is the RoPE table (at least 8192), for the linear models a default that says
nothing about training.

Where the training context is recorded (first match wins):
1. the export's config.json `train_seq_len` (written by checkpoints.export),
2. the run's config.json `train.seq_len` (written by the trainer), for an export at RUN/exports/step_N, a
   snapshot at RUN/snapshots/step_N, or an export whose config.json names its source snapshot
   (`source.path` = RUN/snapshots/step_N).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from checkpoints.layout import EXPORTS, MODEL_CONFIG, RUN_CONFIG, SNAPSHOTS
from pretrain.logs import get_logger

logger = get_logger(__name__)


def _positive_int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_dirs_of(export_dir: str | Path, meta: dict | None = None) -> list[Path]:
    """Run directories an export may belong to: RUN for RUN/exports/step_N and RUN/snapshots/step_N (a
    snapshot loaded as it is), and the run of its source."""
    export_dir = Path(export_dir)
    meta = _read_json(export_dir / MODEL_CONFIG) if meta is None else meta
    out = []
    if export_dir.parent.name in (EXPORTS, SNAPSHOTS):
        out.append(export_dir.parent.parent)
    src = (meta.get("source") or {}).get("path") if isinstance(meta.get("source"), dict) else None
    if isinstance(src, str) and src:
        out.append(Path(src).parent.parent)
    return list(dict.fromkeys(out))


def training_context(export_dir: str | Path) -> int | None:
    """Tokens per training sequence of the model exported at `export_dir`, or None when nothing records it."""
    meta = _read_json(Path(export_dir) / MODEL_CONFIG)
    found = _positive_int(meta.get("train_seq_len"))
    if found:
        return found
    for run in run_dirs_of(export_dir, meta):
        found = _positive_int((_read_json(run / RUN_CONFIG).get("train") or {}).get("seq_len"))
        if found:
            return found
    return None


def scoring_window(export_dir: str | Path | None, max_seq_len: int, override: int | None = None,
                   warn: Callable[[str], None] | None = logger.warning) -> int:
    """The window to score in: `override` if given, else the training context, else `max_seq_len` (with a
    warning that says why, so a wrong window is never silent)."""
    if override:
        return int(override)
    ctx = training_context(export_dir) if export_dir is not None else None
    if ctx:
        return ctx
    if warn is not None:
        where = f"{export_dir}" if export_dir is not None else "an in-memory model"
        warn(f"the training context of {where} is not recorded (no train_seq_len in its config.json, "
             f"no run config.json beside it); scoring in windows of max_seq_len = {max_seq_len}. Pass "
             f"--max-length / max_length= the training sequence length to score as trained.")
    return int(max_seq_len)

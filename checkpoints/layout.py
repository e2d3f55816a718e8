"""Where things live in a run directory (the one place for these names):

    RUN/checkpoints/step_00001000/   resume checkpoint (module/, trainer/, meta.json, manifest.json)
    RUN/checkpoints/step_00002000.tmp/   one being written (never loaded; removed at the next start)
    RUN/checkpoints/latest           name of the newest published checkpoint, written last
    RUN/snapshots/step_00000100/     weights-only snapshot (model.safetensors, meta.json, manifest.json)
    RUN/exports/step_00000100/       self-contained export (model.safetensors, config.json)
"""
from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
EXPORTS = "exports"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_dirs(parent: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_N` directory under parent (complete or not), oldest first."""
    if not parent.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in parent.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def tmp_dirs(parent: Path) -> list[Path]:
    """Directories left by saves that never finished (`step_N.tmp`) or by an interrupted replace (`.trash`)."""
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.endswith((TMP_SUFFIX, ".trash")))

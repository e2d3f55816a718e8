"""Checkpoints: resume checkpoints, weights-only snapshots on a schedule, and export to self-contained
model directories (docs/checkpoints.md). The names below are loaded on first use, so that a light module
of the package (layout, atomic) can be imported without the manager and torch."""
from __future__ import annotations

import importlib

_LAZY = {"CHECKPOINTS": "layout", "EXPORTS": "layout", "SNAPSHOTS": "layout", "step_name": "layout",
         "CheckpointManager": "manager", "apply_retention": "manager", "find_resume_checkpoint": "manager",
         "verify": "manifest", "write_manifest": "manifest", "SnapshotSchedule": "schedule"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'checkpoints' has no attribute {name!r}")
    return getattr(importlib.import_module(f"checkpoints.{_LAZY[name]}"), name)


__all__ = sorted(_LAZY)

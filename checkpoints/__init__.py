"""Checkpoints: resume checkpoints, weights-only snapshots on a schedule, and export to self-contained
model directories (docs/checkpoints.md)."""
from checkpoints.layout import CHECKPOINTS, EXPORTS, SNAPSHOTS, step_name
from checkpoints.manager import CheckpointManager, apply_retention, attach_to_trainer, find_resume_checkpoint
from checkpoints.manifest import verify, write_manifest
from checkpoints.schedule import SnapshotSchedule

__all__ = ["CheckpointManager", "SnapshotSchedule", "attach_to_trainer", "apply_retention", "find_resume_checkpoint",
           "verify", "write_manifest", "step_name", "CHECKPOINTS", "SNAPSHOTS", "EXPORTS"]

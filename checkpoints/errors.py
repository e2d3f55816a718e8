"""Checkpoint errors the user acts on (the message says what happened and what to do). Entry points print
them as one line without a traceback (pretrain/errors.py); `exit_code` is the command's exit status."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A run directory or checkpoint problem the user must resolve (choose, move, convert, free space)."""
    exit_code = 2


class RunDirectoryBusy(CheckpointError):
    """Another live process holds the run directory's lock."""


class SaveFailed(CheckpointError):
    """A checkpoint or snapshot could not be written (disk full, I/O error); the partial save is removed
    and the previous checkpoints are untouched."""
    exit_code = 4

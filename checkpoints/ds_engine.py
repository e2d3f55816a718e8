"""Background saving of DeepSpeed checkpoints: a DeepSpeed checkpoint engine that, instead of writing,
copies each state DeepSpeed hands it into our host staging buffers and keeps it for a later write.

`engine.save_checkpoint` stays in charge of what is saved and where (the ZeRO shards, file names,
the recovery script, its barriers), so the files are exactly DeepSpeed's and load with
`engine.load_checkpoint` and `ds_to_universal`. Only the torch.save calls move: `staged_save_checkpoint`
runs save_checkpoint with this engine swapped in (the training thread: a copy to host memory), and the
returned `write()` does the writing later (the background thread), hashing each file as it is written.

Why not DeepSpeed's own engines (0.19): the decoupled engine hands the live state to a spawned writer
process and, at the next optimizer step, waits for that write to finish (`_commit_decoupled_checkpoint`
before `_take_model_step`), so at most one step's forward/backward overlaps the write; its ZeRO
optimizer state is passed without a copy. The fast engine writes synchronously (through libaio, which
must be built). See docs/checkpoints.md.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable

from checkpoints.hashio import FileRecord, save_torch
from checkpoints.staging import StagingBuffers, tensors_in


def _snapshot_objects(staged: Any) -> Any:
    """Deep-copy the non-tensor parts of a staged state (e.g. a loss scaler object that training keeps
    changing) while keeping the staged tensors themselves (already private host copies)."""
    memo = {id(t): t for t in tensors_in(staged)}
    try:
        return copy.deepcopy(staged, memo)
    except Exception:  # noqa: BLE001 - an object that cannot be copied: keep the reference
        return staged


class StagingCheckpointEngine:
    """Implements DeepSpeed's CheckpointEngine interface (create/save/load/commit/makedirs...)."""

    def __init__(self, buffers: StagingBuffers, base) -> None:
        self.name = "LinscaleStagingCheckpointEngine"
        self.buffers = buffers
        self.base = base  # the engine's own engine: loads and anything else go to it
        self.pending: list[tuple[Path, Any]] = []

    # -- what save_checkpoint calls -------------------------------------------------------------------
    def create(self, info) -> None:
        pass

    def makedirs(self, path, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        # keyed by file name: each file keeps its own host buffer from one save to the next
        staged = self.buffers.stage(state_dict, key=os.path.basename(path))
        self.pending.append((Path(path), _snapshot_objects(staged)))

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed then skips its own clone to pageable CPU memory (we copy into our buffers)
        return False

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def load(self, path: str, map_location=None):
        return self.base.load(path, map_location=map_location)

    def __getattr__(self, name: str):  # anything newer DeepSpeed asks of an engine
        return getattr(self.base, name)


def staged_save_checkpoint(engine, buffers: StagingBuffers, save: Callable[[], None]) -> Callable[[], dict]:
    """Run `save()` (which calls engine.save_checkpoint) with the staging engine swapped in; return
    `write()`, which writes the staged files and returns {path: FileRecord}."""
    original = engine.checkpoint_engine
    staging = StagingCheckpointEngine(buffers, original)
    engine.checkpoint_engine = staging
    try:
        save()
    finally:
        engine.checkpoint_engine = original
    pending = staging.pending

    def write() -> dict[Path, FileRecord]:
        return {path: save_torch(state, path) for path, state in pending}
    return write


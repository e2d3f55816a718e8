"""Resharding a DeepSpeed ZeRO checkpoint for another rank count: DeepSpeed's universal checkpoint
(deepspeed.checkpoint.ds_to_universal), made once, next to the ZeRO files, the first time a checkpoint is
resumed on a different number of ranks. DeepSpeedTrainModule.load_state then loads <module>/universal."""
from __future__ import annotations

import shutil
from argparse import Namespace
from pathlib import Path

from checkpoints.atomic import publish_dir
from checkpoints.layout import DEEPSPEED_DIR, UNIVERSAL_DIR


def needs_universal(module_dir: Path, saved_world: int, world: int) -> bool:
    module_dir = Path(module_dir)
    return saved_world != world and (module_dir / DEEPSPEED_DIR).is_dir() and not (module_dir / UNIVERSAL_DIR).is_dir()


def make_universal(module_dir: Path) -> Path:
    """Convert <module>/deepspeed into <module>/universal (written under a temporary name, then renamed,
    so an interrupted conversion is redone rather than half-loaded). Derived data: not in the manifest."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    module_dir = Path(module_dir)
    final, tmp = module_dir / UNIVERSAL_DIR, module_dir / (UNIVERSAL_DIR + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    ds_to_universal(Namespace(input_folder=str(module_dir / DEEPSPEED_DIR), output_folder=str(tmp),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True))
    publish_dir(tmp, final)
    return final

"""Where things live in a run directory (the one place for these names):

    RUN/config.json                  the run's configuration (RUN_CONFIG)
    RUN/metrics.jsonl, RUN/summary.json, RUN/deepspeed_config.json, RUN/slurm_attempt.json
    RUN/checkpoints/step_00001000/   resume checkpoint (module/, trainer/, meta.json, manifest.json)
    RUN/checkpoints/step_00002000.tmp/   one being written (never loaded; removed at the next start)
    RUN/checkpoints/latest           name of the newest published checkpoint, written last
    RUN/snapshots/step_00000100/     weights-only snapshot (model.safetensors, meta.json, manifest.json);
                                     `models.load_pretrained` loads it as it is
    RUN/exports/step_00000100/       self-contained export (model.safetensors, config.json)

Inside a resume checkpoint, module/ holds the train module's files: model.pt + optimizer.pt (plain
PyTorch) or deepspeed/ (ZeRO shards, plus universal/ once resharded for another rank count).
"""
from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
EXPORTS = "exports"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
TRASH_SUFFIX = ".trash"

# files of the run directory
RUN_CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
SLURM_ATTEMPT = "slurm_attempt.json"  # launch/slurm/pretrain.sbatch: how its last attempt ended
DEEPSPEED_CONFIG = "deepspeed_config.json"
TENSORBOARD = "tensorboard"
EVAL = "eval"                       # launch/evaluate.py's results of the run's snapshots, by default

# inside a checkpoint, snapshot or export
META = "meta.json"                  # checkpoints and snapshots: kind, step, tokens, model config, ...
MANIFEST = "manifest.json"          # every file's size and checksum, written last
MODULE_DIR = "module"               # the train module's files
TRAINER_DIR = "trainer"             # one trainer-state file per rank
PARTS_DIR = "parts"                 # per-rank "done" markers while a checkpoint is written
MODEL_WEIGHTS = "model.safetensors"  # the weights of a snapshot or an export
MODEL_CONFIG = "config.json"        # an export's model config (models.save_pretrained)
TORCH_MODEL = "model.pt"            # plain PyTorch module: weights ...
TORCH_OPTIMIZER = "optimizer.pt"    # ... and optimizer state
DEEPSPEED_DIR = "deepspeed"         # DeepSpeed module: the ZeRO shards (its checkpoint tag)
UNIVERSAL_DIR = "universal"         # the same, resharded for another rank count
DEEPSPEED_META = "deepspeed_meta.json"
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
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.endswith((TMP_SUFFIX, TRASH_SUFFIX)))

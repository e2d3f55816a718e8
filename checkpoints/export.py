"""Export snapshots and resume checkpoints to self-contained model directories,
RUN/exports/step_XXXXXXXX/{model.safetensors, config.json}, in the format of `models.save_pretrained`
(loaded by `models.load_pretrained` on one device without DeepSpeed). config.json carries the model
config (arch, size, dimensions), the tokenizer, and step / tokens / FLOPs trained."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from checkpoints.atomic import file_in_the_way
from checkpoints.consolidate import consolidated_state_dict, read_meta
from checkpoints.errors import CheckpointError
from checkpoints.layout import (CHECKPOINTS, EXPORTS, MANIFEST, MODEL_CONFIG, MODEL_WEIGHTS, RUN_CONFIG, SNAPSHOTS,
                                step_dirs, step_name)
from checkpoints.manifest import verify

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Source:
    step: int
    kind: str   # 'snapshot' | 'checkpoint'
    path: Path
    # a snapshot's checkpoint of the same step: the same weights, exported when the snapshot is corrupt
    fallback: Source | None = None


def find_sources(run_dir: Path) -> dict[str, list[Source]]:
    """Complete (manifest present) snapshots and resume checkpoints of a run, oldest first."""
    run_dir = Path(run_dir)
    out = {}
    for kind, sub in (("snapshot", SNAPSHOTS), ("checkpoint", CHECKPOINTS)):
        out[kind] = [Source(s, kind, p) for s, p in step_dirs(run_dir / sub) if (p / MANIFEST).is_file()]
    return out


def select(run_dir: Path, which: str | int) -> list[Source]:
    """which: 'default' (every snapshot; the newest checkpoint when the run has none), 'all' (every
    snapshot and every retained checkpoint), or a step number. A snapshot wins over a checkpoint of the
    same step (it is smaller to read)."""
    found = find_sources(run_dir)
    snaps, ckpts = found["snapshot"], found["checkpoint"]
    if not snaps and not ckpts:
        raise FileNotFoundError(f"{run_dir}: no complete snapshot ({run_dir}/{SNAPSHOTS}/step_N) or checkpoint "
                                f"({run_dir}/{CHECKPOINTS}/step_N) to export; is it a run directory?")
    by_step: dict[int, Source] = {}
    for s in ckpts + snaps:  # snapshots last: they replace a checkpoint of the same step (kept as fallback)
        if s.kind == "snapshot" and s.step in by_step:
            s.fallback = by_step[s.step]
        by_step[s.step] = s
    if isinstance(which, int):
        if which not in by_step:
            raise ValueError(f"--step {which}: {run_dir} has no complete snapshot or checkpoint of that step; "
                             f"available: {', '.join(map(str, sorted(by_step)))}")
        return [by_step[which]]
    if which == "all":
        return [by_step[s] for s in sorted(by_step)]
    if which == "default":  # without snapshots: the checkpoints newest first (export_run takes the first intact)
        return snaps if snaps else list(reversed(ckpts))
    raise ValueError(f"which={which!r}; expected 'default', 'all' or a step number")


def export_config(meta: dict, source: Source, dtype: str) -> dict:
    """The extra fields of config.json (save_pretrained adds model, tokenizer and dtype)."""
    from models import ModelConfig, exact_params
    model = ModelConfig.from_dict(meta["model"])
    extra = {"arch": model.arch, "size": model.size, "step": meta["step"], "tokens": meta["tokens"],
             "flops": meta["flops"], "flops_non_embedding": meta.get("flops_non_embedding"),
             "source": {"kind": source.kind, "path": str(source.path.resolve()), "run": source.path.parents[1].name,
                        "manifest": source_digest(source)},
             "export_dtype": dtype, "code": meta.get("code")}
    # the training context: evaluation scores in windows of it (evaluation.context)
    train = (meta.get("config") or {}).get("train") or _run_train_config(source)
    if isinstance(train.get("seq_len"), int):
        extra["train_seq_len"] = train["seq_len"]
    try:
        extra["params"] = exact_params(model)
    except Exception:  # accounting is informative only; never block an export on it
        pass
    return extra


def _run_train_config(source: Source) -> dict:
    """The `train` section of the run's config.json (RUN/snapshots/step_N -> RUN/config.json), or {}."""
    try:
        train = json.loads((source.path.parents[1] / RUN_CONFIG).read_text()).get("train")
    except (OSError, ValueError, AttributeError):
        return {}
    return train if isinstance(train, dict) else {}


def source_digest(source: Source) -> str | None:
    """The identity of a snapshot or checkpoint: a digest of its manifest, which lists every file's size
    and checksum. A run resumed from an earlier checkpoint writes a new step N whose digest differs from
    the abandoned branch's step N."""
    try:
        return hashlib.sha256((source.path / MANIFEST).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def already_exported(out: Path, source: Source, dtype: str) -> bool:
    """An export of this very source (same step, same manifest) in this dtype is at `out`."""
    cfg = out / MODEL_CONFIG
    if not (cfg.is_file() and (out / MODEL_WEIGHTS).is_file()):
        return False
    try:
        meta = json.loads(cfg.read_text())
    except ValueError:
        return False
    digest = source_digest(source)
    return (meta.get("step") == source.step and meta.get("export_dtype") == dtype and digest is not None
            and (meta.get("source") or {}).get("manifest") == digest)


def check_destination(out: Path) -> None:
    """Refuse to write an export over something that is not one: `save_pretrained` replaces the folder at
    `out` whole, so a file there, or a folder holding other files (notes, results put there by hand),
    would be deleted. An earlier export (its config.json and weights) or an empty folder is replaced."""
    out = Path(out)
    blocker = file_in_the_way(out)
    if blocker is not None:
        raise NotADirectoryError(f"cannot export to {out}: {blocker} is a file, not a directory; move it away")
    is_export = (out / MODEL_CONFIG).is_file() and (out / MODEL_WEIGHTS).is_file()
    if out.is_dir() and any(out.iterdir()) and not is_export:
        found = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise CheckpointError(f"cannot export to {out}: the folder exists and holds no export ({found}), and "
                              f"exporting would replace it; move it away, then export again")


def export_one(source: Source, out: Path, dtype: str = "fp32") -> Path:
    from models import LanguageModel, ModelConfig, save_pretrained
    meta = read_meta(source.path)
    state = consolidated_state_dict(source.path)
    with torch.device("meta"):
        model = LanguageModel(ModelConfig.from_dict(meta["model"]))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{source.path}: weights do not fit the model config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    return save_pretrained(model, out, DTYPES[dtype], extra=export_config(meta, source, dtype))


def export_run(run_dir: Path, which: str | int = "default", dtype: str = "fp32", force: bool = False,
               log: Callable[[str], None] = print) -> list[Path]:
    """Export the selected snapshots/checkpoints of a run; already exported ones are skipped (unless
    force). A corrupt source is skipped with a warning (a corrupt snapshot for its checkpoint of the same
    step, where there is one). Returns the export directories written or found."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}; choose {' or '.join(DTYPES)}")
    run_dir = Path(run_dir)
    sources = select(run_dir, which)
    newest_intact_only = which == "default" and all(s.kind == "checkpoint" for s in sources)
    done, problems = [], []
    n = 1 if newest_intact_only else len(sources)
    for i, first in enumerate(sources, 1):
        out = run_dir / EXPORTS / step_name(first.step)
        src: Source | None = first
        while src is not None:  # a corrupt snapshot: its checkpoint of the same step holds the same weights
            label = f"[{min(i, n)}/{n}] step {src.step} ({src.kind})"
            if not force and already_exported(out, src, dtype):
                log(f"{label}: already exported at {out}, skipped")
                done.append(out)
                break
            problem = verify(src.path)
            if problem is None:
                check_destination(out)
                t0 = time.perf_counter()
                export_one(src, out, dtype)
                log(f"{label} -> {out} ({dtype}, {time.perf_counter() - t0:.1f} s)")
                done.append(out)
                break
            problems.append(f"{src.path}: {problem}")
            log(f"{label}: WARNING: {src.path} is incomplete or corrupt ({problem}); skipped"
                + ("; trying its checkpoint of the same step" if src.fallback is not None else "")
                + ("; trying the next older checkpoint" if newest_intact_only and i < len(sources) else ""))
            src = src.fallback
        if newest_intact_only and src is not None:
            break
    if not done:
        raise ValueError(f"{run_dir}: nothing exported, every selected source is incomplete or corrupt: "
                         + "; ".join(problems) + ". Resume training to write a new checkpoint, or export "
                         "another step with --step N")
    return done

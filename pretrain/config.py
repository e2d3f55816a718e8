"""Run configuration: one dataclass per component, defaults that reproduce the paper (DESIGN §5).

Every CLI flag maps to exactly one field (`--micro-batch` -> train.micro_batch); a YAML file given with
`--config` sets fields first and flags override it. The resolved config is written to the run directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from models import ModelConfig, model_config

PAPER_GLOBAL_BATCH_TOKENS = 480 * 8192

# The paper's recipe is meant for GPUs. The CPU-sized models carry a preset so that
# `python launch/pretrain.py` trains in minutes on a laptop; any flag the user gives still wins.
SMALL_SIZE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"train.seq_len": 128, "train.global_batch_tokens": 4 * 128, "train.micro_batch": 4,
             "train.max_steps": 200, "optim.lr": 3e-3, "optim.warmup_steps": 20, "train.log_every": 10,
             "train.eval_every": 50, "checkpoint.snapshot_every_tokens": 0, "checkpoint.snapshot_log_points": 0},
    "mini": {"train.seq_len": 256, "train.global_batch_tokens": 16 * 256, "train.micro_batch": 16,
             "train.max_steps": 1000, "optim.lr": 1e-3, "optim.warmup_steps": 100, "train.log_every": 10,
             "train.eval_every": 200, "checkpoint.snapshot_every_tokens": 0, "checkpoint.snapshot_log_points": 0},
}


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 2000       # linear warm-up from 0, then constant (the paper's schedule)
    grad_clip: float = 1.0


@dataclass
class TrainConfig:
    seq_len: int = 8192
    global_batch_tokens: int = PAPER_GLOBAL_BATCH_TOKENS
    micro_batch: int = 1
    max_steps: int | None = None
    max_tokens: int | None = None
    seed: int = 0
    precision: str = "auto"        # auto: bf16 autocast on CUDA, fp32 on CPU | bf16 | fp32
    device: str = "auto"           # auto | cpu | cuda
    activation_checkpointing: bool = False
    compile: bool = False
    ops_impl: str = "auto"         # auto | triton | chunked | recurrent (see ops.linear_attention)
    doc_reset: bool = False        # reset linear-attention state at document starts (cu_seqlens)
    log_every: int = 1
    eval_every: int = 0            # validation loss every N steps (0: never)
    eval_batches: int = 8
    allow_inexact_batch: bool = False  # accept a global batch the micro-batch/world size cannot reach exactly
    max_bad_steps: int = 5         # non-finite loss/grad steps in a row before the run stops
    spike_factor: float = 3.0      # log a loss spike when loss > factor x running mean


@dataclass
class DistConfig:
    zero: int = 0                  # DeepSpeed ZeRO stage; 0 with one process runs plain PyTorch
    deepspeed_config: str | None = None  # a user JSON merged over the generated DeepSpeed config
    backend: str = "auto"          # auto: nccl on CUDA, gloo on CPU


@dataclass
class CheckpointConfig:
    save_every: int = 1000         # resume checkpoint every N steps (0: only at the end / on signal)
    keep_last: int = 3
    # weights-only snapshots for evaluation sweeps and scaling fits (never removed by retention): every
    # 2B tokens (~500 paper steps) plus 8 log-spaced early points; the CPU presets turn them off
    snapshot_every_tokens: int = 2_000_000_000
    snapshot_log_points: int = 8
    async_save: bool = True


@dataclass
class RunConfig:
    arch: str = "tnl"
    size: str = "tiny"
    data: str | None = None        # None: the embedded default corpus; a data YAML; a prepared dataset dir
    out: str | None = None         # run directory; default runs/<arch>-<size>
    resume: str | None = None      # 'auto', a checkpoint directory, or None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out or f"runs/{self.arch}-{self.size}")

    def model(self) -> ModelConfig:
        overrides = dict(self.model_overrides)
        if self.arch == "llama" or self.model_overrides.get("arch") == "llama":
            overrides.setdefault("max_seq_len", max(self.train.seq_len, 8192))
        return model_config(self.arch, self.size, **overrides)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = self.model().to_dict()
        d["train"]["global_batch"] = self.global_batch
        return d

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.train.global_batch_tokens // self.train.seq_len


# ----------------------------------------------------------------------------------------------------
# CLI: flags derived from the dataclasses, so a flag and its field cannot drift apart
# ----------------------------------------------------------------------------------------------------

SECTIONS = {"optim": OptimConfig, "train": TrainConfig, "dist": DistConfig, "checkpoint": CheckpointConfig}
TOP_LEVEL = ("arch", "size", "data", "out", "resume")
# short flag names where the issue fixes them; everything else is --<field-name>
FLAG_NAMES = {"dist.zero": "zero", "checkpoint.save_every": "save-every", "checkpoint.keep_last": "keep-last"}


def _flag(path: str) -> str:
    return "--" + FLAG_NAMES.get(path, path.split(".")[-1]).replace("_", "-")


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _field_type(f: dataclasses.Field):
    t = str(f.type)
    if "bool" in t:
        return _parse_bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a linear-complexity LM (or the LLaMA baseline).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file of config fields (nested as the dataclasses); flags override it")
    p.add_argument("--arch", default=None, help="llama | tnl | hgrn2 | cos2 (alias cosformer2)")
    p.add_argument("--size", default=None, help="tiny | mini | 70m | 160m | 410m | 1b | 3b | 7b")
    p.add_argument("--data", default=None, help="data YAML or prepared dataset dir (default: embedded corpus)")
    p.add_argument("--out", default=None, help="run directory (default runs/<arch>-<size>)")
    p.add_argument("--resume", default=None, help="'auto' (newest complete checkpoint) or a checkpoint dir")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field, e.g. --model max_seq_len=16384 (repeatable)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    for section, cls in SECTIONS.items():
        g = p.add_argument_group(section)
        for f in fields(cls):
            path = f"{section}.{f.name}"
            kind = _field_type(f)
            if kind is _parse_bool:
                g.add_argument(_flag(path), dest=path, nargs="?", const=True, type=_parse_bool, default=None,
                               help=f"{path} (default {f.default})")
            else:
                g.add_argument(_flag(path), dest=path, type=kind, default=None, help=f"{path} (default {f.default})")
    return p


def _set(cfg: RunConfig, path: str, value: Any) -> None:
    if "." in path:
        section, name = path.split(".", 1)
        if section not in SECTIONS or name not in {f.name for f in fields(SECTIONS[section])}:
            raise ValueError(f"unknown config field {path!r}")
        setattr(getattr(cfg, section), name, value)
    else:
        if path not in TOP_LEVEL and path != "model_overrides":
            raise ValueError(f"unknown config field {path!r}; top-level fields: {', '.join(TOP_LEVEL)}")
        setattr(cfg, path, value)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in SECTIONS:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _parse_override(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise ValueError(f"--model expects FIELD=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    return k.strip(), yaml.safe_load(v)


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Config from (defaults) <- (size preset for CPU sizes) <- (YAML --config) <- (flags)."""
    args = build_parser().parse_args(argv)
    explicit: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise FileNotFoundError(f"--config {path}: no such file")
        explicit.update(_flatten(yaml.safe_load(path.read_text()) or {}))
    for k, v in vars(args).items():
        if k in ("config", "model", "local_rank") or v is None:
            continue
        explicit[k] = v
    overrides = dict(explicit.pop("model_overrides", {}) or {})
    overrides.update(dict(_parse_override(s) for s in args.model))
    cfg = RunConfig()
    for key in ("arch", "size"):
        if key in explicit:
            setattr(cfg, key, str(explicit.pop(key)))
    for k, v in SMALL_SIZE_PRESETS.get(cfg.size.lower(), {}).items():
        if k not in explicit:
            _set(cfg, k, v)
    for k, v in explicit.items():
        _set(cfg, k, v)
    cfg.model_overrides = overrides
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    cfg.model()  # raises a clear error for an unknown arch/size or a bad override
    t = cfg.train
    if t.seq_len <= 0 or t.global_batch_tokens <= 0 or t.micro_batch <= 0:
        raise ValueError("seq_len, global_batch_tokens and micro_batch must be positive")
    if t.global_batch_tokens % t.seq_len:
        raise ValueError(f"global_batch_tokens={t.global_batch_tokens} is not a whole number of sequences of "
                         f"seq_len={t.seq_len}; use a multiple, e.g. {max(1, t.global_batch_tokens // t.seq_len) * t.seq_len}")
    if t.precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision {t.precision!r}; choose auto, bf16 or fp32")
    if cfg.dist.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {cfg.dist.zero}; choose 0, 1, 2 or 3")


def gradient_accumulation(global_batch: int, world_size: int, micro_batch: int, allow_inexact: bool = False) -> int:
    """Micro-steps per optimizer step so that world_size x micro_batch x accumulation == global_batch;
    refuses combinations that cannot reach it exactly, naming micro-batches (or global batches) that can.
    With allow_inexact the nearest reachable batch is used (the trainer logs and counts the real one)."""
    per_rank, rem = divmod(global_batch, world_size)
    if rem == 0 and per_rank % micro_batch == 0:
        return per_rank // micro_batch
    if allow_inexact:
        return max(1, round(global_batch / (world_size * micro_batch)))
    inexact = max(1, round(global_batch / (world_size * micro_batch)))
    inexact_note = (f"or pass --allow-inexact-batch (gives {world_size} x {micro_batch} x {inexact} = "
                    f"{world_size * micro_batch * inexact} sequences per step)")
    if rem:
        unit = world_size * micro_batch
        lower, upper = max(1, global_batch // unit) * unit, -(-global_batch // unit) * unit
        near = sorted({lower, upper})
        sizes = [w for w in range(max(1, world_size // 2), 2 * world_size + 1) if global_batch % w == 0]
        sizes = sorted(sizes, key=lambda w: abs(w - world_size))[:4]
        raise ValueError(
            f"global batch of {global_batch} sequences cannot be split evenly over {world_size} ranks, so no "
            f"micro batch reaches it exactly; use a global batch of {' or '.join(map(str, near))} sequences "
            f"(--global-batch-tokens = that x --seq-len) with --micro-batch {micro_batch}"
            + (f", run on {' or '.join(map(str, sorted(sizes)))} ranks" if sizes else "")
            + f", {inexact_note}")
    valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    below = [m for m in valid if m <= micro_batch]
    suggest = below[-1] if below else valid[0]
    raise ValueError(f"micro batch {micro_batch} x {world_size} ranks cannot reach the global batch of {global_batch} "
                     f"sequences exactly ({per_rank} per rank); use --micro-batch {suggest} "
                     f"(valid: {', '.join(map(str, valid[:12]))}{' ...' if len(valid) > 12 else ''}) "
                     f"{inexact_note}")


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2))


def config_from_dict(d: dict) -> RunConfig:
    """Inverse of RunConfig.to_dict (used to resume a run with its own config)."""
    cfg = RunConfig()
    for k in TOP_LEVEL + ("model_overrides",):
        if k in d:
            setattr(cfg, k, d[k])
    for section, cls in SECTIONS.items():
        known = {f.name for f in fields(cls)}
        setattr(cfg, section, cls(**{k: v for k, v in d.get(section, {}).items() if k in known}))
    return cfg

"""Run configuration: one dataclass per component, defaults that reproduce the paper's recipe.

Every CLI flag maps to exactly one field (`--micro-batch` -> train.micro_batch); a YAML file given with
`--config` sets fields first and flags override it. The resolved config is written to the run directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import yaml

from models import ModelConfig, model_config
from models.registry import ACCEPTED_ARCH_NAMES, arch_names, canonical_arch, get_arch
from models.sizes import SIZES, canonical_size
from ops.config import OpsConfig
from pretrain.errors import ConfigError
from pretrain.yaml_files import yaml_load

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


def param(default: Any = None, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None, choices: tuple | None = None, casefold: bool = False, path: bool = False,
          inf: bool = False, default_factory: Callable[[], Any] | None = None) -> Any:
    """A config field with what values it allows, checked for every field at parse time (`validate`):
    a range (ge/gt/le/lt) for numbers, `choices` for enumerations, `path=True` for free-form paths.
    Every int, float and str field carries one of them (tests/test_bad_inputs.py checks that).
    Numbers must be finite; `inf=True` also accepts +inf where it means "no limit" (a clipping threshold
    or a spike factor that is never reached). An open upper bound alone does not: `--lr inf` or
    `--weight-decay inf` would turn every weight into inf or NaN in the first update."""
    meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt), ("choices", choices)) if v is not None}
    if inf:
        meta["inf"] = True
    if casefold:
        meta["casefold"] = True
    if path:
        meta["path"] = True
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class OptimConfig:
    lr: float = param(3e-4, gt=0)
    weight_decay: float = param(0.1, ge=0)
    beta1: float = param(0.9, ge=0, lt=1)
    beta2: float = param(0.95, ge=0, lt=1)
    eps: float = param(1e-8, gt=0)
    warmup_steps: int = param(2000, ge=0)      # linear warm-up from 0, then constant (the paper's schedule)
    grad_clip: float = param(1.0, ge=0, inf=True)  # max global gradient norm; 0 (or inf) turns clipping off


@dataclass
class TrainConfig:
    seq_len: int = param(8192, ge=1)
    global_batch_tokens: int = param(PAPER_GLOBAL_BATCH_TOKENS, ge=1)
    micro_batch: int = param(1, ge=1)
    max_steps: int | None = param(None, ge=0)
    max_tokens: int | None = param(None, ge=0)
    seed: int = param(0, ge=0, lt=2**63)
    precision: str = param("auto", choices=("auto", "bf16", "fp32"))  # auto: bf16 autocast on CUDA, fp32 on CPU
    device: str = param("auto", choices=("auto", "cpu", "cuda"))
    # recompute activations in the backward (models.lm.AC_MODES): none | mlp (each chosen block's channel
    # mixer) | full (each chosen block) | auto (on CUDA the cheapest setting pretrain.memory estimates to
    # fit the GPU: none, else full on the fewest blocks); a bare --activation-checkpointing means full
    activation_checkpointing: str = param("none", choices=("none", "mlp", "full", "auto"), casefold=True)
    ac_fraction: float = param(1.0, gt=0, le=1)  # share of the blocks checkpointed, spread over the depth (not auto)
    # auto: torch.compile on CUDA (plain PyTorch and every ZeRO stage), eager on CPU; --no-compile
    compile: str = param("auto", choices=("auto", "true", "false"), casefold=True)
    # auto: the blocks' weight gradients are added into fp32 buffers by the matmul that makes them
    # (pretrain/grad_accumulation.py) where one process trains without DeepSpeed on several micro-batches a
    # step (grad_accumulation.fusion_wanted); off: autograd's own
    grad_accum_fusion: str = param("auto", choices=("auto", "off"), casefold=True)
    doc_reset: bool = False        # reset linear-attention state at document starts (cu_seqlens)
    log_every: int = param(1, ge=1)
    eval_every: int = param(0, ge=0)            # validation loss every N steps (0: never)
    eval_batches: int = param(8, ge=1)         # validation set: this many batches of 8 sequences (any micro-batch)
    allow_inexact_batch: bool = False  # accept a global batch the micro-batch/world size cannot reach exactly
    max_bad_steps: int = param(5, ge=0)         # stop after this many non-finite steps in a row (0: never stop)
    spike_factor: float = param(3.0, gt=1, inf=True)  # log a loss spike when loss > factor x running mean
    # profile optimizer step N (CUDA kernels and the GPU's idle gaps: pretrain/profiling.py) into
    # <run>/profile-step-N-rank-R.json and one log line; 0: none
    profile_step: int = param(0, ge=0)


@dataclass
class DistConfig:
    zero: int = param(0, choices=(0, 1, 2, 3))  # DeepSpeed ZeRO stage; 0 with one process runs plain PyTorch
    deepspeed_config: str | None = param(None, path=True)  # a user JSON merged over the generated DeepSpeed config
    backend: str = param("auto", choices=("auto", "nccl", "gloo", "mpi", "ucc"))  # auto: nccl on CUDA, gloo on CPU
    # sequence parallelism (linear models): each sequence split over N consecutive ranks, which exchange
    # linear-attention states (pretrain/sequence_parallel.py); the data-parallel size is world size / N
    sp: int = param(1, ge=1)


@dataclass
class CheckpointConfig:
    save_every: int = param(1000, ge=0)         # resume checkpoint every N steps (0: only at the end / on signal)
    keep_last: int = param(3, ge=0)             # resume checkpoints kept (0: all)
    # weights-only snapshots for evaluation sweeps and scaling fits (never removed by retention): every
    # 2B tokens (~500 paper steps) plus 8 log-spaced early points; the CPU presets turn them off
    snapshot_every_tokens: int = param(2_000_000_000, ge=0)
    snapshot_log_points: int = param(8, ge=0)
    async_save: bool = True


# the shortest RoPE table a context-limited model (LLaMA) is built with: the paper's 8K context, or seq_len if longer
MIN_ROPE_TABLE = 8192


@dataclass
class RunConfig:
    arch: str = param("tnl", choices=ACCEPTED_ARCH_NAMES, casefold=True)  # models.registry
    size: str = param("tiny", choices=tuple(SIZES), casefold=True)
    data: str | None = param(None, path=True)  # None: the embedded default corpus; a data YAML; a prepared dataset dir
    out: str | None = param(None, path=True)   # run directory; default runs/<arch>-<size>
    # 'auto' (in any case: `Auto`, `AUTO`; resume_target), a checkpoint directory, or None
    resume: str | None = param(None, path=True)
    # start afresh in a run directory that holds an earlier run (its files are moved aside, not deleted)
    overwrite: bool = False
    model_overrides: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)  # kernel options (ops.config), flags --ops-<field>

    @property
    def run_dir(self) -> Path:
        return Path(self.out or f"runs/{self.arch}-{self.size}")

    def model(self) -> ModelConfig:
        overrides = dict(self.model_overrides)
        if get_arch(self.model_overrides.get("arch", self.arch)).context_limited:  # a RoPE table to size
            overrides.setdefault("max_seq_len", max(self.train.seq_len, MIN_ROPE_TABLE))
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

SECTIONS = {"optim": OptimConfig, "train": TrainConfig, "dist": DistConfig, "checkpoint": CheckpointConfig,
            "ops": OpsConfig}
TOP_LEVEL = ("arch", "size", "data", "out", "resume", "overwrite")
# short flag names for the commonest fields (as README and the Slurm script use them); everything else is --<field-name>
FLAG_NAMES = {"model_overrides": "model", "dist.zero": "zero", "checkpoint.save_every": "save-every",
              "checkpoint.keep_last": "keep-last"}


def flag_name(path: str) -> str:
    if path.startswith("ops."):  # --ops-impl, --ops-autotune, ...
        return "--" + path.replace(".", "-").replace("_", "-")
    return "--" + FLAG_NAMES.get(path, path.split(".")[-1]).replace("_", "-")


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


# fields whose flag may be given bare (`--compile`), with the value a bare flag means; the value is a
# string checked against the field's choices by `validate`, like every other field
OPTIONAL_VALUE_FLAGS = {"train.compile": "true", "train.activation_checkpointing": "full"}


def _field_type(f: dataclasses.Field):
    t = str(f.type)
    if "bool" in t:
        return _parse_bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


# what a field's value means where its range alone does not say (shown by --help after the range)
FIELD_NOTES = {"optim.grad_clip": "the largest global gradient norm; 0 or inf turns clipping off",
               "train.spike_factor": "inf never logs a spike"}


def _help(path: str, f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else None
    allowed = allowed_values(f.metadata)
    note = FIELD_NOTES.get(path)
    return f"{path} (default {default}" + (f"; {allowed}" if allowed else "") + (f"; {note}" if note else "") + ")"


def build_parser() -> argparse.ArgumentParser:
    # each field's help carries its real default and allowed values (the parser's own defaults are None)
    p = argparse.ArgumentParser(description="Pretrain a linear-complexity LM (or the LLaMA baseline).")
    p.add_argument("--config", help="YAML file of config fields (nested as the dataclasses); flags override it")
    p.add_argument("--arch", default=None, help=" | ".join(arch_names()) + " (aliases: "
                   + ", ".join(a for a in ACCEPTED_ARCH_NAMES if a not in arch_names()) + ")")
    p.add_argument("--size", default=None, help=" | ".join(SIZES) + f" (default tiny; {' and '.join(SMALL_SIZE_PRESETS)} "
                   "bring a CPU preset: short sequences, small batches, a few hundred steps, no snapshots, for "
                   "any value no flag or --config sets; the defaults shown below are the paper's)")
    p.add_argument("--data", default=None, help="data YAML or prepared dataset dir (default: embedded corpus)")
    p.add_argument("--out", default=None, help="run directory (default runs/<arch>-<size>)")
    p.add_argument("--resume", default=None, help="'auto' in any case (this run's newest complete checkpoint; a "
                                                  "fresh start when it has none) or a checkpoint dir (a directory "
                                                  "named like auto: ./Auto)")
    p.add_argument("--overwrite", nargs="?", const=True, type=_parse_bool, default=None,
                   help="start afresh in a run directory that holds an earlier run: its checkpoints, snapshots "
                        "and logs are moved to RUN/overwritten-<time>/ (not deleted)")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field, e.g. --model max_seq_len=16384 (repeatable)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    for section, cls in SECTIONS.items():
        g = p.add_argument_group(section)
        for f in fields(cls):
            path = f"{section}.{f.name}"
            kind = _field_type(f)
            if path in OPTIONAL_VALUE_FLAGS:
                g.add_argument(flag_name(path), dest=path, nargs="?", const=OPTIONAL_VALUE_FLAGS[path], default=None,
                               help=_help(path, f) + f"; the bare flag means {OPTIONAL_VALUE_FLAGS[path]}")
            elif kind is _parse_bool:
                g.add_argument(flag_name(path), dest=path, nargs="?", const=True, type=_parse_bool, default=None,
                               help=_help(path, f))
            else:
                g.add_argument(flag_name(path), dest=path, type=kind, default=None, help=_help(path, f))
    p.add_argument("--no-compile", dest="train.compile", action="store_const", const="false",
                   help="train eagerly (train.compile=false), also on CUDA")
    return p


def _set(cfg: RunConfig, path: str, value: Any) -> None:
    if "." in path:
        section, name = path.split(".", 1)
        if section not in SECTIONS or name not in {f.name for f in fields(SECTIONS[section])}:
            known = ", ".join(f"{section}.{f.name}" for f in fields(SECTIONS[section])) if section in SECTIONS \
                else ", ".join(SECTIONS)
            raise ConfigError(f"unknown config field {path!r}; known: {known}")
        setattr(getattr(cfg, section), name, value)
    else:
        if path not in TOP_LEVEL and path != "model_overrides":
            raise ConfigError(f"unknown config field {path!r}; top-level fields: {', '.join(TOP_LEVEL)}, "
                              f"model_overrides, and the sections {', '.join(SECTIONS)}")
        setattr(cfg, path, value)


def flatten_sections(d: dict, prefix: str = "") -> dict[str, Any]:
    """A config mapping with its sections' fields as dotted keys (`train.seq_len`); other values (`model`,
    `model_overrides`) stay whole."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in SECTIONS:
            out.update(flatten_sections(v, key + "."))
        else:
            out[key] = v
    return out


def _parse_override(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise ConfigError(f"--model {s!r}: expected FIELD=VALUE, e.g. --model max_seq_len=16384")
    k, v = s.split("=", 1)
    try:
        value = yaml.safe_load(v)
    except yaml.YAMLError:
        value = v
    return k.strip(), value


def load_yaml_mapping(path: Path, what: str) -> dict:
    """A YAML file that must hold a mapping; syntax errors name the file, line and column (read from the
    file object, so the YAML error carries its name; see pretrain.errors.describe)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path}: no such file")
    with open(path, encoding="utf-8") as f:
        if path.suffix.lower() == ".json":
            # YAML 1.1 reads JSON's 1e-06 (no dot in the mantissa) as a string: a run's config.json is JSON
            try:
                raw = json.load(f)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{what} {path}: not valid JSON (line {err.lineno}, column {err.colno}: "
                                  f"{err.msg})") from None
        else:
            raw = yaml_load(f)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of config fields (e.g. `train: {{seq_len: 4096}}`), "
                          f"got a {type(raw).__name__}")
    return raw


def from_run_config(raw: dict, where: str) -> dict:
    """A config mapping with the entries a run's config.json adds to its fields turned back into fields, so
    that `--config runs/X/config.json` trains that run again (with `--out` elsewhere, and flags on top):
    `train.global_batch` (sequences per step) must agree with global_batch_tokens / seq_len and is dropped;
    the resolved `model` section becomes model overrides for each field that differs from what --arch,
    --size and seq_len give by themselves (the file's `model_overrides` and `--model` flags win over it).
    Its `resume` and `overwrite` are dropped: they record how that start was asked for (a resume, a start
    over an earlier run), and carried into another start they would resume or move aside a run nobody
    named on this command line. A hand-written config without those entries passes unchanged."""
    raw = dict(raw)
    train = raw.get("train")
    if isinstance(raw.get("model"), dict) or (isinstance(train, dict) and "global_batch" in train):
        raw.pop("resume", None)
        raw.pop("overwrite", None)
    if isinstance(train, dict) and "global_batch" in train:
        train = dict(train)
        sequences = train.pop("global_batch")
        raw["train"] = train
        tokens, seq_len = train.get("global_batch_tokens"), train.get("seq_len")
        if not (isinstance(tokens, int) and isinstance(seq_len, int) and seq_len > 0):
            raise ConfigError(f"--config {where}: train.global_batch is derived (global_batch_tokens / seq_len); set "
                              f"train.global_batch_tokens (sequences x seq_len) instead")
        if sequences != tokens // seq_len:
            raise ConfigError(f"--config {where}: train.global_batch {sequences} disagrees with train.global_batch_tokens "
                              f"{tokens} / train.seq_len {seq_len} = {tokens // seq_len}; it is derived from them: set "
                              f"train.global_batch_tokens (sequences x seq_len) and leave global_batch out")
    model = raw.pop("model", None)
    if model is None:
        return raw
    if not isinstance(model, dict):
        raise ConfigError(f"--config {where}: `model` must be a mapping of ModelConfig fields (as a run's config.json "
                          f"holds it), got {model!r}; to change model fields use model_overrides: {{FIELD: VALUE}}")
    arch, size = str(raw.get("arch", RunConfig.arch)), str(raw.get("size", RunConfig.size))
    try:
        base = model_config(arch, size).to_dict()
    except (KeyError, ValueError):
        return raw  # an unknown arch or size: validate() names it
    seq_len = (raw.get("train") or {}).get("seq_len", TrainConfig.seq_len)
    derived = {}
    for k, v in model.items():
        if k in ("arch", "size") or base.get(k, object()) == v:
            continue
        if k == "max_seq_len" and get_arch(arch).context_limited and isinstance(seq_len, int) \
                and v == max(seq_len, MIN_ROPE_TABLE):   # what RunConfig.model() sizes the RoPE table to by itself
            continue
        derived[k] = v
    given = raw.get("model_overrides") or {}
    raw["model_overrides"] = {**derived, **given} if isinstance(given, dict) else given
    return raw


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Config from (defaults) <- (size preset for CPU sizes) <- (YAML --config) <- (flags)."""
    args = build_parser().parse_args(argv)
    explicit: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if args.config:
        from_file = flatten_sections(from_run_config(load_yaml_mapping(Path(args.config), "--config"), args.config))
        explicit.update(from_file)
        origin.update({k: f"--config {args.config}" for k in from_file})
    for k, v in vars(args).items():
        if k in ("config", "model", "local_rank") or v is None:
            continue
        explicit[k] = v
        origin.pop(k, None)
    overrides = explicit.pop("model_overrides", {}) or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"model_overrides in --config {args.config}: expected a mapping FIELD: VALUE, "
                          f"got {overrides!r}")
    overrides = dict(overrides)
    overrides.update(dict(_parse_override(s) for s in args.model))
    cfg = RunConfig()
    for key in ("arch", "size"):
        if key in explicit:
            setattr(cfg, key, str(explicit.pop(key)))
    preset = {}
    for k, v in SMALL_SIZE_PRESETS.get(cfg.size.lower(), {}).items():
        if k not in explicit:
            _set(cfg, k, v)
            preset[k] = v
    for k, v in explicit.items():
        _set(cfg, k, v)
    cfg.model_overrides = overrides
    cfg.preset_values = preset  # not a field: not in config.json; for messages (preset_note)
    validate(cfg, origin)
    return cfg


BATCH_FIELDS = ("train.seq_len", "train.global_batch_tokens", "train.micro_batch")


def preset_note(cfg: RunConfig) -> str:
    """The tail of a batch-shape error naming the batch values a CPU size's preset set where no flag gave
    them (a user who passed only --seq-len otherwise reads of a --micro-batch 4 they never set), or ''."""
    given = {k: v for k, v in getattr(cfg, "preset_values", {}).items() if k in BATCH_FIELDS}
    if not given:
        return ""
    return (f" (the {cfg.size} preset set " + ", ".join(f"{flag_name(k)} {v}" for k, v in given.items())
            + ", which no flag gave: pass those flags too)")


# ----------------------------------------------------------------------------------------------------
# validation: every field against its declared range or choices (see `param`)
# ----------------------------------------------------------------------------------------------------

def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def allowed_values(meta) -> str:
    """What a field allows, in words: 'one of a, b, c', '>= 0', '>= 0 and < 1', '>= 0, or inf'."""
    if "choices" in meta:
        return "one of " + ", ".join(map(str, meta["choices"]))
    lo = (">=", meta["ge"]) if "ge" in meta else (">", meta["gt"]) if "gt" in meta else None
    hi = ("<=", meta["le"]) if "le" in meta else ("<", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        text = f"{lo[0]} {_num(lo[1])} and {hi[0]} {_num(hi[1])}"
    elif lo or hi:
        op, v = lo or hi
        text = f"{op} {_num(v)}"
    else:
        text = ""
    return f"{text}, or inf" if text and meta.get("inf") else text


def field_kind(f: dataclasses.Field) -> str:
    t = str(f.type)
    for k in ("bool", "int", "float", "str"):
        if k in t:
            return k
    return "other"


_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _coerce(kind: str, value: Any) -> Any:
    """`value` as the field's type; raises ValueError when it is not one (YAML gives strings for '1e-3')."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, (str, int)):
            return _parse_bool(str(value))
        raise ValueError
    if kind == "int":
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value.strip().replace("_", ""))
        raise ValueError
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value)
        raise ValueError
    if kind == "str":
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    return value


def choice_word(f: dataclasses.Field, value: Any) -> Any:
    """The word a YAML file most likely held where YAML 1.1 read a boolean: `grad_accum_fusion: off` and
    `compile: no` arrive as False, which a field whose choices are words (auto, off) would refuse as 'False'.
    Other values pass unchanged."""
    choices = f.metadata.get("choices") if isinstance(value, bool) else None
    if not choices or not all(isinstance(c, str) for c in choices):
        return value
    return next((c for c in choices if yaml.safe_load(c) is value), value)


def check_field(f: dataclasses.Field, value: Any, label: str) -> Any:
    """`value` coerced to the field's type and checked against its range/choices; ConfigError (naming
    `label`, the value and what is allowed) otherwise."""
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{label}: a value is required ({allowed_values(f.metadata) or _KIND_WORDS.get(field_kind(f), '')})")
    kind = field_kind(f)
    value = choice_word(f, value)
    try:
        value = _coerce(kind, value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ConfigError(f"{label} {value!r}: expected {_KIND_WORDS.get(kind, kind)}"
                          + (f" ({allowed_values(f.metadata)})" if allowed_values(f.metadata) else "")) from None
    meta = f.metadata
    if kind in ("int", "float") and isinstance(value, float) and not math.isfinite(value) and "choices" not in meta:
        if meta.get("inf"):  # +inf means no limit; NaN and -inf mean nothing
            if value != math.inf:
                what = "not a number" if math.isnan(value) else "out of range"
                raise ConfigError(f"{label} {value}: {what}; allowed: {allowed_values(meta)}")
        else:
            raise ConfigError(f"{label} {value}: must be a finite number ({allowed_values(meta)})")
    if "choices" in meta:
        ok = value.lower() in [str(c).lower() for c in meta["choices"]] if meta.get("casefold") and isinstance(value, str) \
            else value in meta["choices"]
        if not ok:
            raise ConfigError(f"{label} {value!r}: not allowed; choose {allowed_values(meta)}")
    bad = (("ge" in meta and not value >= meta["ge"]) or ("gt" in meta and not value > meta["gt"])
           or ("le" in meta and not value <= meta["le"]) or ("lt" in meta and not value < meta["lt"]))
    if bad:
        shown = _num(value) if isinstance(value, (int, float)) else repr(value)
        raise ConfigError(f"{label} {shown}: out of range; allowed: {allowed_values(meta)}")
    return value


def _label(path: str, origin: dict[str, str]) -> str:
    flag = flag_name(path) if "." in path else f"--{path}"
    return f"{flag} ({path} in {origin[path]})" if path in origin else flag


def _check_model_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """--model FIELD=VALUE: the field must exist and the value have its type (checked here so the message
    names the field; ModelConfig then checks the values themselves)."""
    known = {f.name: f for f in fields(ModelConfig)}
    out = {}
    for k, v in overrides.items():
        if k not in known:
            raise ConfigError(f"--model {k}={v}: unknown model field {k!r}; known: {', '.join(sorted(known))}")
        f = known[k]
        optional = "None" in str(f.type)
        if v is None and optional:
            out[k] = None
            continue
        kind = field_kind(f)
        try:
            out[k] = _coerce(kind, v)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            raise ConfigError(f"--model {k}={v}: {k} expects {_KIND_WORDS.get(kind, kind)}") from None
    return out


def model_overrides_from_flags(values: list[str]) -> dict[str, Any]:
    """Repeated `--model FIELD=VALUE` flags as ModelConfig overrides, each field known and each value of its
    type (ConfigError naming the flag otherwise); launch/model_info.py takes the same flags as this CLI."""
    return _check_model_overrides(dict(_parse_override(s) for s in values))


def describe_model_flags(arch: str, size: str, overrides: dict[str, Any]) -> str:
    """The flags that chose a model, as the prefix of an error about it: `--arch tnl --size tiny --model ...`."""
    return f"--arch {arch} --size {size}" + "".join(f" --model {k}={v}" for k, v in overrides.items())


def validate(cfg: RunConfig, origin: dict[str, str] | None = None) -> None:
    """Every field against its declared type and range/choices, then the checks that involve several."""
    origin = origin or {}
    cfg.train.activation_checkpointing = ac_mode(cfg.train)  # a YAML true/false still means none/full
    for f in fields(RunConfig):
        if f.name in SECTIONS or f.name == "model_overrides":
            continue
        setattr(cfg, f.name, check_field(f, getattr(cfg, f.name), _label(f.name, origin)))
    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        for f in fields(cls):
            path = f"{section}.{f.name}"
            setattr(obj, f.name, check_field(f, getattr(obj, f.name), _label(path, origin)))
    # the registry's names, whatever the spelling (`TNL`, `transnormer`, `1B`): the run directory
    # (runs/<arch>-<size>) and config.json must not depend on it, or a `--resume auto` spelt another way
    # would look in another directory and start afresh
    cfg.arch, cfg.size = canonical_arch(cfg.arch), canonical_size(cfg.size)
    cfg.model_overrides = _check_model_overrides(cfg.model_overrides)
    try:
        model = cfg.model()
    except ValueError as err:
        raise ConfigError(f"{describe_model_flags(cfg.arch, cfg.size, cfg.model_overrides)}: {err}") from None
    t = cfg.train
    if get_arch(model.arch).context_limited and model.max_seq_len < t.seq_len:
        # caught here, not at the first forward: positions past the RoPE table have no encoding
        raise ConfigError(f"--model max_seq_len={model.max_seq_len}: {get_arch(model.arch).title}'s RoPE table is "
                          f"shorter than --seq-len {t.seq_len}; pass --model max_seq_len={t.seq_len} or larger "
                          f"(model_overrides: {{max_seq_len: {t.seq_len}}} in --config), or leave it out (the "
                          f"default fits --seq-len)")
    if t.global_batch_tokens % t.seq_len:
        raise ConfigError(f"--global-batch-tokens {t.global_batch_tokens} is not a whole number of sequences of "
                          f"--seq-len {t.seq_len}; use a multiple, e.g. "
                          f"{max(1, t.global_batch_tokens // t.seq_len) * t.seq_len}{preset_note(cfg)}")
    if cfg.dist.sp > 1:
        spec = get_arch(cfg.arch)
        if not spec.sequence_parallel:
            able = ", ".join(a for a in arch_names() if get_arch(a).sequence_parallel)
            raise ConfigError(f"--sp {cfg.dist.sp}: sequence parallelism is for the linear models ({able}), "
                              f"whose layers pass only a fixed-size state between ranks; {spec.title}'s token mixer "
                              f"needs every earlier token: use --sp 1")
        if t.seq_len % cfg.dist.sp:
            # the number of processes is checked later (the trainer's), so name both: following the first
            # advice alone would only reach the second error
            raise ConfigError(f"--sp {cfg.dist.sp} must divide --seq-len {t.seq_len} (each rank takes an equal "
                              f"segment of every sequence) and the number of processes (each group is --sp "
                              f"ranks); use e.g. --seq-len {max(1, t.seq_len // cfg.dist.sp) * cfg.dist.sp}, or an "
                              f"--sp that divides both")
    if t.doc_reset and get_arch(cfg.arch).name == "llama":
        raise ConfigError("--doc-reset resets the linear models' recurrent state at document starts; LLaMA keeps no "
                          "state and runs packed documents with a plain causal mask: leave --doc-reset out")
    if cfg.dist.deepspeed_config and cfg.dist.zero == 0:  # it would be ignored without a word
        raise ConfigError(f"--deepspeed-config {cfg.dist.deepspeed_config} is read only by DeepSpeed, and this run "
                          f"is plain PyTorch/DDP (--zero 0): pass --zero 1, 2 or 3 with it, or drop it")
    cfg.resume = resume_target(cfg.resume, _label("resume", origin))
    if cfg.overwrite and cfg.resume == "auto":
        raise ConfigError(f"--overwrite and --resume auto contradict each other: --resume auto continues the "
                          f"run in {cfg.run_dir}, --overwrite starts it afresh; pass one of them")
    t.activation_checkpointing = t.activation_checkpointing.lower()
    t.compile = str(t.compile).lower()


def resume_target(resume: str | None, label: str = "--resume") -> str | None:
    """--resume as the trainer reads it: 'auto' in any case (`Auto`, `AUTO`) is the keyword 'auto'; anything
    else a checkpoint path. `auto` itself is always the keyword. Another spelling of it that also names
    something here (a directory `./Auto`) is ambiguous and refused, naming both ways to say it."""
    if resume is None or resume == "auto" or resume.strip().lower() != "auto":
        return resume
    if Path(resume).exists():
        raise ConfigError(f"{label} {resume}: ambiguous: 'auto' in any case means this run's newest complete "
                          f"checkpoint, and {resume} is also a path here ({Path(resume).resolve()}); pass "
                          f"--resume auto for the newest checkpoint, or --resume ./{resume.strip()} for that path")
    return "auto"


def ac_mode(t: TrainConfig) -> str:
    """The activation-checkpointing mode; a boolean (a YAML `true`, or a config written when the field was
    a switch) or true/false mean full or none."""
    v = t.activation_checkpointing
    if isinstance(v, bool) or str(v).lower() in ("true", "false"):
        return "full" if str(v).lower() == "true" else "none"
    return str(v).lower()


def resolve_compile(cfg: RunConfig, device_type: str) -> bool:
    """--compile auto: on for CUDA (torch.compile is worth 2-3x; the plain PyTorch path and every DeepSpeed
    ZeRO stage compile each block in place), off on CPU, where compiling costs more than it saves."""
    c = str(cfg.train.compile).lower()
    if c != "auto":
        return c == "true"
    return device_type == "cuda"


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
        # rank counts at which this micro batch reaches the batch exactly: the batch must split evenly over
        # the ranks *and* each rank's share must be whole micro batches (480 on 48 ranks is 10 a rank,
        # which --micro-batch 4 cannot reach)
        sizes = [w for w in range(max(1, world_size // 2), 2 * world_size + 1) if global_batch % (w * micro_batch) == 0]
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

"""The study config: one YAML file naming the architectures, sizes, token budgets, data, sequence length,
recipe, snapshot schedule, evaluation and fit settings, and the Slurm resources of a scaling study.

Every key is checked when the file is read; an unknown key, a size that is neither a registry name nor a
complete shape, or a token budget that misses a size is a `StudyConfigError` saying what to write instead.
Relative paths (`out`, `data`) are taken from the directory `launch/study.py` is started in, so the same
file works from a laptop and from a Slurm job (which starts in the submit directory). See docs/study.md."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models.config import ModelConfig
from models.registry import arch_names, canonical_arch
from models.sizes import SIZES
from pretrain.config import choice_word
from pretrain.yaml_files import yaml_load

SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "d_glu")
RECIPE_SECTIONS = ("train", "optim", "checkpoint", "dist")
# what the study sets itself on every run: a recipe may not set these (the message says where they go)
STUDY_OWNED = {"train.seq_len": "seq_len", "train.global_batch_tokens": "global_batch_tokens",
               "train.max_steps": "tokens", "train.max_tokens": "tokens",
               "checkpoint.snapshot_every_tokens": "snapshots.every_tokens",
               "checkpoint.snapshot_log_points": "snapshots.log_points"}
SNAPSHOT_CHOICES = ("all", "final")
CSR_MODES = ("direct", "replay")
TOP_KEYS = ("name", "out", "data", "archs", "sizes", "tokens", "seq_len", "global_batch_tokens", "recipe", "model",
            "per_run", "snapshots", "evaluation", "fit", "slurm")


class StudyConfigError(ValueError):
    """A study config that cannot be used; the message names the key and what is allowed."""


@dataclass
class SizeSpec:
    """A model size: a registry name (models/sizes.py), or a custom shape with a name of its own."""
    name: str
    shape: tuple[int, int, int, int] | None = None   # (n_layers, d_model, n_heads, d_glu) for a custom size

    @property
    def registry(self) -> bool:
        return self.shape is None


@dataclass
class EvalSpec:
    tasks: list[str] = field(default_factory=lambda: ["wikitext2", "lambada_openai"])
    limit: int | None = None            # examples per task (documents for WikiText-2); None: all
    batch_size: int = 16
    max_length: int | None = None       # scoring window; None: the study's seq_len (the training context)
    valid_windows: int = 64             # validation windows of seq_len + 1 tokens (task valid_loss)
    snapshots: str | int = "all"        # all | final | k (the last k snapshots of each run)
    export_dtype: str = "fp32"
    device: str = "auto"
    dtype: str = "auto"
    csr: str = "direct"                 # direct: lm-eval on the evaluating machine | replay (see docs/study.md)


@dataclass
class SlurmSpec:
    """Per stage, extra `#SBATCH` options (e.g. "--partition=gpu", "--gpus-per-node=8") and environment
    variables for the job script (pretrain.sbatch reads ZERO, MICRO, ...)."""
    train: list[str] = field(default_factory=list)
    evaluate: list[str] = field(default_factory=list)
    fit: list[str] = field(default_factory=list)
    train_env: dict[str, str] = field(default_factory=dict)
    max_parallel: int | None = None     # at most this many array tasks of one stage at once (%N)


@dataclass
class StudyConfig:
    name: str
    path: Path | None                   # the YAML file (None when built in Python)
    out: Path
    data: str | None
    archs: list[str]
    sizes: list[SizeSpec]
    tokens: dict[str, int]              # size -> token budget of its runs; arch-size -> that one run's budget
    seq_len: int = 8192
    global_batch_tokens: int = 480 * 8192
    recipe: dict[str, Any] = field(default_factory=dict)      # "section.field" -> value, for every run
    model: dict[str, Any] = field(default_factory=dict)       # ModelConfig overrides, every run
    per_run: dict[str, dict[str, Any]] = field(default_factory=dict)  # arch | size | arch-size -> overrides
    snapshot_log_points: int = 8
    snapshot_every_tokens: int = 0
    evaluation: EvalSpec = field(default_factory=EvalSpec)
    fit_args: list[str] = field(default_factory=list)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    overrides: list[str] = field(default_factory=list)        # KEY=VALUE applied over the file (load_study)

    def size(self, name: str) -> SizeSpec:
        return next(s for s in self.sizes if s.name == name)

    def budget(self, arch: str, size: str) -> int:
        """The token budget of the run arch-size: its own entry if the config gives one, else its size's."""
        return self.tokens.get(f"{arch}-{size}", self.tokens[size])


# variables of launch/slurm/pretrain.sbatch that the study sets for every run, and the study keys behind them
STUDY_OWNED_ENV = {"RUN_DIR": "out (the runs go to STUDY/runs/<run>)", "DATA": "data",
                   "MICRO": "recipe.train.micro_batch (or per_run)", "GLOBAL_BATCH_TOKENS": "global_batch_tokens",
                   "ZERO": "recipe.dist.zero (or per_run)"}


def _err(msg: str) -> StudyConfigError:
    return StudyConfigError(f"study config: {msg}")


def _int(value: Any, key: str, minimum: int = 1) -> int:
    """Integers, also written as 4e6 or 4_000_000 in YAML."""
    if isinstance(value, bool):
        raise _err(f"{key} must be an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            raise _err(f"{key} must be an integer, got {value!r}") from None
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise _err(f"{key} must be a whole number, got {value!r}")
        value = int(value)
    if not isinstance(value, int) or value < minimum:
        raise _err(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _plain_name(name: str) -> bool:
    """A name that can name a directory by itself: not empty, no slash or whitespace, no leading dot."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\") \
        and not any(c.isspace() for c in name)


def _sizes(raw: Any) -> list[SizeSpec]:
    if not isinstance(raw, list) or not raw:
        raise _err("sizes must be a non-empty list of registry names (e.g. 70m) or shapes "
                   "{name: s1, n_layers: 2, d_model: 128, n_heads: 1, d_glu: 384}")
    out: list[SizeSpec] = []
    for i, s in enumerate(raw):
        if isinstance(s, (str, int)) and not isinstance(s, bool):
            key = str(s).lower()
            if key not in SIZES:
                raise _err(f"sizes[{i}] {s!r} is not a registry size ({', '.join(SIZES)}); give a shape instead: "
                           f"{{name: {s}, n_layers: L, d_model: D, n_heads: H, d_glu: G}}")
            out.append(SizeSpec(key))
        elif isinstance(s, dict):
            unknown = set(s) - {"name", *SHAPE_KEYS}
            missing = [k for k in ("name", *SHAPE_KEYS) if k not in s]
            if unknown or missing:
                raise _err(f"sizes[{i}]: a custom size needs exactly name, {', '.join(SHAPE_KEYS)}"
                           + (f"; missing {missing}" if missing else "") + (f"; unknown {sorted(unknown)}" if unknown else ""))
            name = str(s["name"]).lower()
            if not _plain_name(name):
                raise _err(f"sizes[{i}]: name {s['name']!r} must be a short name without spaces or slashes "
                           f"(it names the run directory, runs/<arch>-<size>, and its evaluation folder)")
            shape = tuple(_int(s[k], f"sizes[{i}].{k}") for k in SHAPE_KEYS)
            if name in SIZES and SIZES[name] != shape:
                raise _err(f"sizes[{i}]: name {name!r} is a registry size with another shape {SIZES[name]}; "
                           f"choose another name or leave the shape out")
            try:
                ModelConfig.check_shape(*shape)
            except ValueError as err:
                raise _err(f"sizes[{i}] ({name}): {err}") from None
            out.append(SizeSpec(name, None if SIZES.get(name) == shape else shape))  # type: ignore[arg-type]
        else:
            raise _err(f"sizes[{i}] must be a registry name or a shape mapping, got {s!r}")
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise _err(f"sizes repeat a name: {names}")
    return out


def _tokens(raw: Any, sizes: list[SizeSpec], archs: list[str]) -> dict[str, int]:
    """{size: budget} for every size, plus {arch-size: budget} for the runs that differ from their size's."""
    if raw is None:
        raise _err("tokens is required: the token budget of every run (one number, or {size: tokens}, "
                   "optionally with {arch-size: tokens} entries for single runs)")
    if isinstance(raw, dict):
        budget = {str(k).lower(): _int(v, f"tokens.{k}") for k, v in raw.items()}
        names = {s.name for s in sizes}
        runs = {f"{a}-{s}" for a in archs for s in names}
        unknown = set(budget) - names - runs
        missing = [s.name for s in sizes if s.name not in budget]
        if unknown or missing:
            raise _err("tokens: give one budget per size (and optionally arch-size: tokens for single runs, "
                       f"e.g. {archs[0]}-{sizes[0].name})" + (f"; missing {missing}" if missing else "")
                       + (f"; neither a size nor an arch-size of this study: {sorted(unknown)}" if unknown else ""))
        return budget
    n = _int(raw, "tokens")
    return {s.name: n for s in sizes}


def _recipe(raw: Any, where: str, allow_model: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Nested {section: {field: value}} -> {"section.field": value}, checked against the pretrain config."""
    from pretrain.config import SECTIONS
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise _err(f"{where} must be a mapping of sections ({', '.join(RECIPE_SECTIONS)})")
    flat: dict[str, Any] = {}
    model: dict[str, Any] = {}
    for section, fields_ in raw.items():
        if allow_model and section == "model":
            model.update(_model(fields_, f"{where}.model"))
            continue
        if section not in SECTIONS or not isinstance(fields_, dict):
            allowed = ", ".join(RECIPE_SECTIONS + (("model",) if allow_model else ()))
            raise _err(f"{where}.{section}: expected one of the sections {allowed}, each a mapping of fields")
        known = SECTIONS[section].__dataclass_fields__
        for k, v in fields_.items():
            path = f"{section}.{k}"
            if k not in known:
                raise _err(f"{where}.{path} is not a field of the pretrain config; known in {section}: "
                           f"{', '.join(known)}")
            if path in STUDY_OWNED:
                raise _err(f"{where}.{path} is set by the study: use the study key '{STUDY_OWNED[path]}' instead")
            flat[path] = choice_word(known[k], v)
    return flat, model


def _model(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _err(f"{where} must be a mapping of ModelConfig fields")
    known = ModelConfig.__dataclass_fields__
    bad = [k for k in raw if k not in known or k in (*SHAPE_KEYS, "arch", "size")]
    if bad:
        raise _err(f"{where}: {bad} cannot be set here (shapes go in sizes, arch in archs); ModelConfig fields: "
                   f"{', '.join(k for k in known if k not in (*SHAPE_KEYS, 'arch', 'size'))}")
    return dict(raw)


def _evaluation(raw: Any) -> EvalSpec:
    from evaluation.sweep import CSR_TASKS, SCROLLS_TASKS
    spec = EvalSpec()
    if raw is None:
        return spec
    if not isinstance(raw, dict):
        raise _err("evaluation must be a mapping")
    known = EvalSpec.__dataclass_fields__
    for k, v in raw.items():
        if k not in known:
            raise _err(f"evaluation.{k} is unknown; known: {', '.join(known)}")
        setattr(spec, k, v)
    valid = {"wikitext2", "lambada_openai", "valid_loss", "niah_easy", "niah_standard", *CSR_TASKS, *SCROLLS_TASKS}
    if not isinstance(spec.tasks, list) or not all(isinstance(t, str) for t in spec.tasks):
        raise _err("evaluation.tasks must be a list of task names")
    if not spec.tasks:
        # an empty list would evaluate nothing while `status` counted every snapshot as evaluated
        raise _err("evaluation.tasks is empty: list the tasks to evaluate (e.g. [valid_loss]), or leave the "
                   "evaluation out with `run --stages train,export`")
    bad = [t for t in spec.tasks if t not in valid]
    if bad:
        raise _err(f"evaluation.tasks: unknown {bad}; choose from {', '.join(sorted(valid))}")
    if spec.limit is not None:
        spec.limit = _int(spec.limit, "evaluation.limit")
    if spec.max_length is not None:
        spec.max_length = _int(spec.max_length, "evaluation.max_length")
    spec.batch_size = _int(spec.batch_size, "evaluation.batch_size")
    spec.valid_windows = _int(spec.valid_windows, "evaluation.valid_windows")
    if isinstance(spec.snapshots, (str, bool)):  # YAML reads no, off and on as booleans
        if spec.snapshots not in SNAPSHOT_CHOICES:
            raise _err(f"evaluation.snapshots {spec.snapshots!r}: choose all, final, or a number (the last k)")
    else:
        spec.snapshots = _int(spec.snapshots, "evaluation.snapshots")
    if spec.export_dtype not in ("fp32", "bf16"):
        raise _err(f"evaluation.export_dtype {spec.export_dtype!r}: choose fp32 or bf16")
    from evaluation.sweep import SWEEP_DTYPES
    if spec.dtype not in SWEEP_DTYPES:
        # the sweep resolves it only when it loads a model: after the training, and in every `status`
        raise _err(f"evaluation.dtype {spec.dtype!r}: choose {', '.join(SWEEP_DTYPES)} (auto: bfloat16 on a GPU, "
                   f"float32 on the CPU)")
    if spec.device != "auto":
        from evaluation.devices import device_kind
        try:
            if not isinstance(spec.device, str):
                raise ValueError(spec.device)
            device_kind(spec.device)
        except ValueError:
            raise _err(f"evaluation.device {spec.device!r}: use auto, cpu, cuda or cuda:N") from None
    if spec.csr not in CSR_MODES:
        raise _err(f"evaluation.csr {spec.csr!r}: choose direct (lm-eval where the snapshots are evaluated) or "
                   f"replay (requests built here, scored on the evaluating machine, metrics computed by the report)")
    return spec


def _slurm(raw: Any) -> SlurmSpec:
    spec = SlurmSpec()
    if raw is None:
        return spec
    if not isinstance(raw, dict):
        raise _err("slurm must be a mapping: train/evaluate/fit (lists of sbatch options), train_env, max_parallel")
    for k, v in raw.items():
        if k in ("train", "evaluate", "fit"):
            if not isinstance(v, list) or not all(isinstance(o, str) and o.startswith("-") for o in v):
                raise _err(f"slurm.{k} must be a list of sbatch options such as \"--partition=gpu\"")
            setattr(spec, k, list(v))
        elif k == "train_env":
            if not isinstance(v, dict):
                raise _err("slurm.train_env must map variable names to values (e.g. {NCCL_DEBUG: WARN})")
            owned = sorted(set(map(str, v)) & set(STUDY_OWNED_ENV))
            if owned:
                # the study sets these for every run from its plan, and passes the run's own flags after
                # pretrain.sbatch's: a value here would be overridden by them, or train other runs than planned
                raise _err("slurm.train_env sets " + ", ".join(owned) + ", which the study sets for each run from "
                           "its plan; set " + "; ".join(f"{e} with {STUDY_OWNED_ENV[e]}" for e in owned) + " instead")
            spec.train_env = {str(a): str(b) for a, b in v.items()}
        elif k == "max_parallel":
            spec.max_parallel = _int(v, "slurm.max_parallel")
        else:
            raise _err(f"slurm.{k} is unknown; known: train, evaluate, fit, train_env, max_parallel")
    return spec


def parse_study(raw: dict, path: Path | None = None, base: Path | None = None) -> StudyConfig:
    """A StudyConfig from the YAML's mapping; relative paths are resolved against `base` (default: cwd)."""
    if not isinstance(raw, dict):
        raise _err("the file must hold a mapping (name, data, archs, sizes, tokens, ...)")
    unknown = set(raw) - set(TOP_KEYS)
    if unknown:
        raise _err(f"unknown key(s) {sorted(unknown)}; known: {', '.join(TOP_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not _plain_name(name):
        raise _err("name is required: a short name without spaces or slashes (it names the study directory)")
    base = Path(base or Path.cwd())
    for key in ("out", "data"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise _err(f"{key} must be a path (a string), got {raw[key]!r}"
                       + (": write the data config in its own YAML file and give its path" if key == "data" and
                          isinstance(raw[key], dict) else ""))
    out = Path(raw.get("out") or f"studies/{name}")
    out = out if out.is_absolute() else base / out
    data = raw.get("data")
    if data is not None:
        data = str(data if Path(data).is_absolute() else base / data)
    archs_raw = raw.get("archs", list(arch_names()))
    if not isinstance(archs_raw, list) or not archs_raw:
        raise _err(f"archs must be a non-empty list from {', '.join(arch_names())}")
    if not all(isinstance(a, str) for a in archs_raw):
        raise _err(f"archs must be a list of names from {', '.join(arch_names())}; got {archs_raw!r}")
    try:
        archs = list(dict.fromkeys(canonical_arch(a) for a in archs_raw))
    except ValueError as err:
        raise _err(f"archs: {err}") from None
    sizes = _sizes(raw.get("sizes"))
    tokens = _tokens(raw.get("tokens"), sizes, archs)
    seq_len = _int(raw.get("seq_len", 8192), "seq_len")
    gbt = _int(raw.get("global_batch_tokens", 480 * 8192), "global_batch_tokens")
    if gbt % seq_len:
        raise _err(f"global_batch_tokens={gbt} is not a whole number of sequences of seq_len={seq_len}; "
                   f"use a multiple of {seq_len}, e.g. {max(1, gbt // seq_len) * seq_len}")
    short = {k: v for k, v in tokens.items() if v < gbt}
    if short:
        # steps = ceil(tokens / global_batch_tokens): a budget below one step would train a whole step, up to
        # global_batch_tokens / tokens times the budget asked for, and put that run at the wrong D and C
        k, v = min(short.items(), key=lambda kv: kv[1])
        raise _err(f"tokens{'' if isinstance(raw.get('tokens'), (int, float, str)) else '.' + k}={v:,} is less than "
                   f"one step of global_batch_tokens={gbt:,}: the run would train {gbt:,} tokens, "
                   f"{gbt / v:.3g}x its budget; give it at least {gbt:,} tokens, or lower global_batch_tokens "
                   f"(a multiple of seq_len={seq_len})"
                   + (f" (also below one step: {', '.join(sorted(set(short) - {k}))})" if len(short) > 1 else ""))
    recipe, _ = _recipe(raw.get("recipe"), "recipe")
    model = _model(raw.get("model"), "model")
    per_run: dict[str, dict[str, Any]] = {}
    keys = set(archs) | {s.name for s in sizes} | {f"{a}-{s.name}" for a in archs for s in sizes}
    per_run_raw = raw.get("per_run") or {}
    if not isinstance(per_run_raw, dict):
        raise _err(f"per_run must be a mapping of an arch, a size or an arch-size to its recipe changes, e.g. "
                   f"{{llama: {{train: {{micro_batch: 2}}}}}}; got {per_run_raw!r}")
    for k, v in per_run_raw.items():
        k = str(k).lower()
        if k not in keys:
            raise _err(f"per_run.{k}: not an arch, a size or an arch-size of this study ({', '.join(sorted(keys))})")
        flat, m = _recipe(v, f"per_run.{k}", allow_model=True)
        per_run[k] = {**flat, **{f"model.{a}": b for a, b in m.items()}}
    snaps = raw.get("snapshots") or {}
    if not isinstance(snaps, dict) or set(snaps) - {"log_points", "every_tokens"}:
        raise _err("snapshots must be a mapping with log_points (log-spaced early snapshots) and/or every_tokens")
    log_points = _int(snaps.get("log_points", 8), "snapshots.log_points", 0)
    every = _int(snaps.get("every_tokens", 0), "snapshots.every_tokens", 0)
    if not log_points and not every:
        raise _err("snapshots: log_points and every_tokens are both 0, so no run would leave a snapshot to evaluate")
    fit = raw.get("fit") or {}
    if not isinstance(fit, dict) or set(fit) - {"args"} or not isinstance(fit.get("args", []), list) \
            or not all(isinstance(a, str) for a in fit.get("args", [])):
        raise _err("fit must be a mapping {args: [extra launch/fit_scaling.py flags, as strings]}, e.g. "
                   "{args: ['--c-min', '1e18']}")
    return StudyConfig(name=name, path=path, out=out, data=data, archs=archs, sizes=sizes, tokens=tokens,
                       seq_len=seq_len, global_batch_tokens=gbt, recipe=recipe, model=model, per_run=per_run,
                       snapshot_log_points=log_points, snapshot_every_tokens=every,
                       evaluation=_evaluation(raw.get("evaluation")), fit_args=[str(a) for a in fit.get("args", [])],
                       slurm=_slurm(raw.get("slurm")))


def apply_overrides(raw: Any, overrides: list[str]) -> Any:
    """`raw` with each "dotted.key=VALUE" set (VALUE read as YAML: 4e6, [l1d128], {device: cpu}, cpu), in order.
    Mappings on the way are created; a key is checked afterwards like any key of the file."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        raise _err("the file must hold a mapping (name, data, archs, sizes, tokens, ...)")
    raw = copy.deepcopy(raw)
    for item in overrides:
        key, eq, text = str(item).partition("=")
        parts = key.strip().split(".")
        if not eq or not all(p.strip() for p in parts):
            raise _err(f"override {item!r}: write KEY=VALUE with a dotted key, e.g. tokens=4e6, "
                       f"recipe.train.device=cpu, sizes=[l1d128]")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise _err(f"override {item!r}: the value is not valid YAML: {err}") from None
        node = raw
        for i, part in enumerate(parts[:-1]):
            part = part.strip()
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise _err(f"override {item!r}: {'.'.join(parts[:i + 1])} is {node[part]!r}, not a mapping to set "
                           f"{parts[i + 1].strip()!r} in")
            node = node[part]
        node[parts[-1].strip()] = value
    return raw


def load_study(path: str | Path, base: Path | None = None, overrides: list[str] | None = None) -> StudyConfig:
    """The study of a YAML file; `overrides` ("dotted.key=VALUE") replace keys of the file before it is checked,
    e.g. a small dry run of the real config: tokens=2048 sizes=[l1d128] recipe.train.device=cpu."""
    path = Path(path)
    if path.is_dir():
        raise _err(f"{path} is a folder: give the study YAML file itself with --config (see docs/study.md)")
    if not path.is_file():
        raise _err(f"{path}: no such file (give the study YAML with --config; see docs/study.md)")
    try:
        raw = yaml_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        from pretrain.errors import describe
        raise _err(describe(err).replace("<unicode string>", str(path))) from None
    except UnicodeDecodeError as err:
        raise _err(f"{path} is not a UTF-8 text file ({err.reason} at byte {err.start}): give the study YAML with "
                   f"--config") from None
    if raw is None:
        raise _err(f"{path} is empty: write the study's keys (name, archs, sizes, tokens, ...; see docs/study.md)")
    study = parse_study(apply_overrides(raw, list(overrides or [])), path.resolve(), base)
    study.overrides = list(overrides or [])
    return study

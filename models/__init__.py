"""The four architectures (LLaMA, TNL, HGRN2, cosFormer2; `models.registry` lists them), the size registry
and the accounting."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from models.accounting import exact_params, flops_per_step, model_info, paper_non_embedding_params
from models.config import ModelConfig
from models.lm import InferenceCache, LanguageModel
from models.registry import arch_names, canonical_arch, get_arch, register_arch
from models.sizes import PAPER_SIZES, SIZES, model_config

def build_model(arch: str, size: str, **overrides) -> LanguageModel:
    """`arch` a registered architecture (llama, tnl, hgrn2, cos2, alias cosformer2); `size` a registry name;
    overrides replace ModelConfig fields (e.g. vocab_size=512 for a test, max_seq_len=16384)."""
    return LanguageModel(model_config(arch, size, **overrides))


def build_from_config(cfg: ModelConfig) -> LanguageModel:
    return LanguageModel(cfg)


def save_pretrained(model: LanguageModel, path: str | Path, dtype: torch.dtype = torch.float32,
                    extra: dict | None = None) -> Path:
    """A self-contained directory: model.safetensors + config.json (model config, tokenizer, extra info).
    Written under a temporary name and published by rename (checkpoints.atomic.publish_dir): a reader
    sees the old directory or the new one, never half of one and never none. `dtype` (e.g. bf16, to halve
    the file) casts every weight but the `fp32_parameter_names`, which stay fp32. A model wrapped by
    torch.compile or DistributedDataParallel is saved as the model inside, under its own parameter names."""
    from safetensors.torch import save_file

    from checkpoints.atomic import publish_dir
    from checkpoints.layout import MODEL_CONFIG, MODEL_WEIGHTS, TMP_SUFFIX
    from data_pipeline.tokenizer import ENCODING_NAME
    model = _unwrapped(model)
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if tmp.exists():  # left by an interrupted save
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # the parameters a low-precision cast would round past their use keep fp32 (LanguageModel.fp32_parameter_names)
    keep = set(model.fp32_parameter_names())
    state = {k: v.detach().to(torch.promote_types(dtype, torch.float32) if k in keep else dtype).contiguous().cpu()
             for k, v in model.state_dict().items()}
    save_file(state, str(tmp / MODEL_WEIGHTS))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp / MODEL_WEIGHTS, 0o666 & ~mask)  # safetensors writes 0600; readable like the other files
    meta = {"model": model.config.to_dict(), "tokenizer": ENCODING_NAME, "dtype": str(dtype).replace("torch.", "")}
    meta.update(extra or {})
    (tmp / MODEL_CONFIG).write_text(json.dumps(meta, indent=2))
    publish_dir(tmp, path)
    return path


def _unwrapped(model) -> LanguageModel:
    """The LanguageModel inside `torch.compile(model)` (its `_orig_mod`) or a DistributedDataParallel /
    DataParallel wrapper (its `module`): their state dicts prefix every name (`_orig_mod.`, `module.`), so
    the weights would be saved under names no model loads, and the fp32 parameters, looked up by their plain
    names, would be rounded with the rest. ValueError for anything else that is not a LanguageModel."""
    inner = model
    while not isinstance(inner, LanguageModel):
        if isinstance(getattr(inner, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            inner = inner._orig_mod
        elif isinstance(inner, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            inner = inner.module
        else:
            raise ValueError(f"save_pretrained takes a models.LanguageModel (or one wrapped by torch.compile or "
                             f"DistributedDataParallel), got {type(model).__name__}")
    return inner


def _read_json(file: Path) -> dict:
    """A JSON object from `file`, or ValueError naming the file (a bare JSONDecodeError names none)."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({err}); the directory is damaged: export it again "
                         f"(python launch/export.py RUN --step N --force)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def pretrained_meta(path: str | Path) -> dict:
    """The metadata of a directory `load_pretrained` reads: an export's config.json, or a snapshot's
    meta.json (RUN/snapshots/step_N: the same model config and fp32 weights, no export needed). A resume
    checkpoint is refused with the command that exports it."""
    from checkpoints.layout import META, MODEL_CONFIG, MODEL_WEIGHTS
    path = Path(path)
    if (path / MODEL_CONFIG).is_file() and (path / MODEL_WEIGHTS).is_file():
        return _read_json(path / MODEL_CONFIG)
    meta = _read_json(path / META) if (path / META).is_file() else {}
    if meta.get("kind") == "snapshot" and (path / MODEL_WEIGHTS).is_file():
        return meta
    if meta.get("kind") == "checkpoint":
        raise FileNotFoundError(f"{path} is a resume checkpoint (model and optimizer state in the engine's "
                                f"layout); load a snapshot of the run, or export this checkpoint first: "
                                f"python launch/export.py {path.parent.parent} --step {meta.get('step')}")
    # say what is there and what is missing: "expects an export" alone leaves a user guessing which file
    if not path.exists():
        found = "it does not exist"
    elif not path.is_dir():
        found = "it is a file, not a directory"
    else:
        present = [f for f in (MODEL_CONFIG, META, MODEL_WEIGHTS) if (path / f).is_file()]
        missing = MODEL_WEIGHTS if present and MODEL_WEIGHTS not in present else MODEL_CONFIG
        found = (f"it holds {' and '.join(present)} but no {missing}" if present
                 else f"it holds neither {MODEL_CONFIG}, {META} nor {MODEL_WEIGHTS}")
    raise FileNotFoundError(f"{path}: load_pretrained expects an export ({MODEL_CONFIG} + {MODEL_WEIGHTS}, made "
                            f"with launch/export.py) or a snapshot (RUN/snapshots/step_N: {META} + {MODEL_WEIGHTS}); "
                            f"{found}")


def _config_from_meta(path: Path, meta: dict, overrides: dict) -> ModelConfig:
    """The model config a directory's metadata describes, with `overrides`; ValueError naming the file and the
    field for a config that is missing or incomplete."""
    from checkpoints.layout import META, MODEL_CONFIG
    source = path / (MODEL_CONFIG if (path / MODEL_CONFIG).is_file() else META)
    model = meta.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{source}: no model config (a 'model' object with arch, n_layers, d_model, n_heads, "
                         f"d_glu); export the run again (python launch/export.py RUN --step N --force)")
    unknown = sorted(set(overrides) - set(ModelConfig.__dataclass_fields__))
    if unknown:  # a misspelt override would otherwise load the saved value without a word
        raise ValueError(f"unknown model config field(s) {unknown}; known: "
                         f"{', '.join(ModelConfig.__dataclass_fields__)}")
    cfg_dict = {**model, **overrides}
    required = [f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in cfg_dict]
    if missing:
        raise ValueError(f"{source}: the model config lacks {', '.join(missing)}; it names the model's shape, so "
                         f"the weights cannot be placed without it: export the run again")
    try:
        return ModelConfig.from_dict(cfg_dict)
    except ValueError as err:
        given = f" with the overrides {_describe(overrides)}" if overrides else ""
        raise ValueError(f"{source}{given}: {err}") from None


def _describe(overrides: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in overrides.items())


def _check_weights_fit(path: Path, model: LanguageModel, state: dict, overrides: dict) -> None:
    """ValueError unless `state` has exactly the model's parameter names and shapes: a config.json from another
    model (another architecture, a changed width) names what differs and, where the weights' names are
    those of another registered architecture, which one, instead of PyTorch's load_state_dict error."""
    from checkpoints.layout import MODEL_WEIGHTS
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    missing, unexpected = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    wrong = [f"{k} {list(have[k])} (the config gives {list(want[k])})" for k in sorted(want.keys() & have.keys())
             if want[k] != have[k]]
    if not (missing or unexpected or wrong):
        return
    cfg = model.config
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong)):
        if names:
            parts.append(f"{len(names)} {label}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}")
    hint = "the config and the weights do not belong together; export the run again"
    if overrides:
        hint = (f"the overrides {_describe(overrides)} change the model the weights were saved from; leave out "
                f"those that change its shape")
    elif missing or unexpected:
        for other in arch_names():
            if other == cfg.arch:
                continue
            try:
                with torch.device("meta"):
                    keys = set(LanguageModel(dataclasses.replace(cfg, arch=other)).state_dict())
            except ValueError:
                continue
            if keys == set(have):
                hint = f"the weights are those of a {other} model: the config's arch ({cfg.arch}) is wrong"
                break
    raise ValueError(f"{path / MODEL_WEIGHTS} does not fit the model its config describes (arch={cfg.arch}, "
                     f"n_layers={cfg.n_layers}, d_model={cfg.d_model}, n_heads={cfg.n_heads}, d_glu={cfg.d_glu}, "
                     f"vocab_size={cfg.vocab_size}): {'; '.join(parts)}. {hint[0].upper() + hint[1:]}")


def _load_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this machine has, or ValueError naming it: an unknown name would otherwise
    surface as the weights file being 'unreadable' (and the advice to export it again), a GPU this machine
    lacks as an allocator error from inside safetensors."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"load_pretrained: device {device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"load_pretrained: device {str(device)!r}, but CUDA is not available on this machine; "
                             f"load with device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"load_pretrained: device {str(device)!r}, but this machine has {count} CUDA device(s) "
                             f"(cuda:0 .. cuda:{count - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"load_pretrained: device {str(device)!r}, but MPS is not available on this machine; "
                         f"load with device='cpu'")
    return dev


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    **overrides) -> LanguageModel:
    """Load an export (model.safetensors + config.json) or a snapshot (model.safetensors + meta.json) on one
    device, without DeepSpeed. Overrides replace config fields (e.g. max_seq_len=16384 to evaluate LLaMA past
    its training length)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from checkpoints.layout import MODEL_WEIGHTS
    path = Path(path)
    device = _load_device(device)
    meta = pretrained_meta(path)
    cfg = _config_from_meta(path, meta, overrides)
    with torch.device("meta"):
        model = LanguageModel(cfg)
    try:
        state = load_file(str(path / MODEL_WEIGHTS), device=str(device))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path / MODEL_WEIGHTS}: unreadable ({err}); the file is damaged or incomplete: "
                         f"export the run again (python launch/export.py RUN --step N --force)") from None
    _check_weights_fit(path, model, state, overrides)
    model.load_state_dict(state, strict=True, assign=True)
    # buffers that are not saved (LLaMA's RoPE tables) are rebuilt on the target device
    get_arch(model.config.arch).rebuild_buffers(model, device)
    if dtype is not None:
        model.cast_for_inference(dtype)
    return model.eval()


__all__ = ["build_model", "build_from_config", "load_pretrained", "save_pretrained", "model_config", "ModelConfig",
           "LanguageModel", "InferenceCache", "SIZES", "PAPER_SIZES", "arch_names", "canonical_arch", "get_arch",
           "register_arch", "exact_params", "paper_non_embedding_params", "flops_per_step", "model_info",
           "pretrained_meta"]

"""The four architectures (LLaMA, TNL, HGRN2, cosFormer2; `models.registry` lists them), the size registry
and the accounting."""
from __future__ import annotations

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
    sees the old directory or the new one, never half of one and never none."""
    from safetensors.torch import save_file

    from checkpoints.atomic import publish_dir
    from checkpoints.layout import MODEL_CONFIG, MODEL_WEIGHTS, TMP_SUFFIX
    from data_pipeline.tokenizer import ENCODING_NAME
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if tmp.exists():  # left by an interrupted save
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / MODEL_WEIGHTS))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp / MODEL_WEIGHTS, 0o666 & ~mask)  # safetensors writes 0600; readable like the other files
    meta = {"model": model.config.to_dict(), "tokenizer": ENCODING_NAME, "dtype": str(dtype).replace("torch.", "")}
    meta.update(extra or {})
    (tmp / MODEL_CONFIG).write_text(json.dumps(meta, indent=2))
    publish_dir(tmp, path)
    return path


def pretrained_meta(path: str | Path) -> dict:
    """The metadata of a directory `load_pretrained` reads: an export's config.json, or a snapshot's
    meta.json (RUN/snapshots/step_N: the same model config and fp32 weights, no export needed). A resume
    checkpoint is refused with the command that exports it."""
    from checkpoints.layout import META, MODEL_CONFIG, MODEL_WEIGHTS
    path = Path(path)
    if (path / MODEL_CONFIG).is_file() and (path / MODEL_WEIGHTS).is_file():
        return json.loads((path / MODEL_CONFIG).read_text())
    meta = json.loads((path / META).read_text()) if (path / META).is_file() else {}
    if meta.get("kind") == "snapshot" and (path / MODEL_WEIGHTS).is_file():
        return meta
    if meta.get("kind") == "checkpoint":
        raise FileNotFoundError(f"{path} is a resume checkpoint (model and optimizer state in the engine's "
                                f"layout); load a snapshot of the run, or export this checkpoint first: "
                                f"python launch/export.py {path.parent.parent} --step {meta.get('step')}")
    raise FileNotFoundError(f"{path}: load_pretrained expects an export ({MODEL_CONFIG} + {MODEL_WEIGHTS}, made "
                            f"with launch/export.py) or a snapshot (RUN/snapshots/step_N: {META} + {MODEL_WEIGHTS})")


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    **overrides) -> LanguageModel:
    """Load an export (model.safetensors + config.json) or a snapshot (model.safetensors + meta.json) on one
    device, without DeepSpeed. Overrides replace config fields (e.g. max_seq_len=16384 to evaluate LLaMA past
    its training length)."""
    from safetensors.torch import load_file

    from checkpoints.layout import MODEL_WEIGHTS
    path = Path(path)
    meta = pretrained_meta(path)
    cfg_dict = dict(meta["model"])
    unknown = sorted(set(overrides) - set(ModelConfig.__dataclass_fields__))
    if unknown:  # a misspelt override would otherwise load the saved value without a word
        raise ValueError(f"unknown model config field(s) {unknown}; known: {', '.join(ModelConfig.__dataclass_fields__)}")
    cfg_dict.update(overrides)
    with torch.device("meta"):
        model = LanguageModel(ModelConfig.from_dict(cfg_dict))
    state = load_file(str(path / MODEL_WEIGHTS), device=str(device))
    model.load_state_dict(state, strict=True, assign=True)
    # buffers that are not saved (LLaMA's RoPE tables) are rebuilt on the target device
    get_arch(model.config.arch).rebuild_buffers(model, device)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


__all__ = ["build_model", "build_from_config", "load_pretrained", "save_pretrained", "model_config", "ModelConfig",
           "LanguageModel", "InferenceCache", "SIZES", "PAPER_SIZES", "arch_names", "canonical_arch", "get_arch",
           "register_arch", "exact_params", "paper_non_embedding_params", "flops_per_step", "model_info",
           "pretrained_meta"]

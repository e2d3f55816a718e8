"""Full fp32 weights from what a run saved, on one process and without a process group: a snapshot
(model.safetensors), a plain-PyTorch resume checkpoint (module/model.pt) or a DeepSpeed ZeRO one
(module/deepspeed/, consolidated with DeepSpeed's zero_to_fp32). The one place that knows these layouts
for reading; the writers are CheckpointManager and the train modules' save_state."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from checkpoints.layout import DEEPSPEED_DIR, META, MODEL_WEIGHTS, MODULE_DIR, TORCH_MODEL


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def consolidated_state_dict(path: Path) -> dict[str, Tensor]:
    """Weights of the snapshot or resume checkpoint at `path` as {name: fp32 CPU tensor}."""
    path = Path(path)
    if (path / MODEL_WEIGHTS).is_file():
        from safetensors.torch import load_file
        return load_file(str(path / MODEL_WEIGHTS))
    module_dir = path / MODULE_DIR
    if (module_dir / TORCH_MODEL).is_file():
        state = torch.load(module_dir / TORCH_MODEL, map_location="cpu", weights_only=True)
        return {k: v.float() for k, v in state.items()}
    if (module_dir / DEEPSPEED_DIR).is_dir():
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError as err:
            raise ImportError(f"{path} is a DeepSpeed ZeRO checkpoint; consolidating it needs deepspeed "
                              f"(pip install -c constraints.txt deepspeed), or export a snapshot instead") from err
        with _shapes_as_torch_size():
            state = get_fp32_state_dict_from_zero_checkpoint(str(module_dir), tag=DEEPSPEED_DIR)
        return {k: v.float() for k, v in state.items()}
    raise FileNotFoundError(f"{path}: no {MODEL_WEIGHTS} (snapshot), {MODULE_DIR}/{TORCH_MODEL} (PyTorch "
                            f"checkpoint) or {MODULE_DIR}/{DEEPSPEED_DIR}/ (DeepSpeed checkpoint) found")


@contextmanager
def _shapes_as_torch_size() -> Iterator[None]:
    """zero_to_fp32 reads ZeRO-3 parameter shapes with `.numel()`, which only a torch.Size has. ZeRO-3
    checkpoints whose model states hold the shapes as plain tuples (written by a background save whose
    host copy did not keep the torch.Size type) would fail with `'tuple' object has no attribute 'numel'`;
    their shapes are turned back into torch.Size as DeepSpeed reads them, so those checkpoints export too."""
    import deepspeed.utils.zero_to_fp32 as z2f
    parse = z2f.parse_model_states

    def parse_with_sizes(files):
        states = parse(files)
        for st in states:
            st.param_shapes = [type(group)((k, torch.Size(v)) for k, v in group.items()) if isinstance(group, dict)
                               else group for group in st.param_shapes]
        return states
    z2f.parse_model_states = parse_with_sizes
    try:
        yield
    finally:
        z2f.parse_model_states = parse

"""Run-time options of the ops: one object, set programmatically (`set_config`) or by the run config's
`ops` section (flags `--ops-<field>`, YAML), which the trainer records in the run's config.json.

No environment variable selects kernels: a process that sets nothing runs the defaults.
Launch configurations are not options: `ops.tuning` chooses them per shape and GPU.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

IMPLS = ("auto", "triton", "chunked", "recurrent")


@dataclass
class OpsConfig:
    """impl: 'auto' (Triton kernels on CUDA, the chunked PyTorch twin elsewhere, the recurrence for a
    single decoding step), 'triton', 'chunked' or 'recurrent', for every op of the process.
    gla_triton: whether 'auto' takes the Triton `gated_linear_attn` on CUDA (False: its chunked twin).
    side_streams: run the backward's dq and dk walks on two side streams next to the dv walk (off by
    default: in training steps the walks one after another on one stream were faster, docs/kernels.md).
    autotune: time the candidate layouts of each new shape on its first use and keep the fastest in an
    on-disk cache (`tune_cache`), instead of the measured per-GPU rule of `ops.tuning`.
    tune_cache: that cache's JSON file; '' is ~/.cache/linscale/kernel-tune.json (entries keyed by GPU)."""
    # metadata: what values the run config's parser accepts (pretrain.config checks every field with it)
    impl: str = field(default="auto", metadata={"choices": IMPLS})
    gla_triton: bool = True
    side_streams: bool = False
    autotune: bool = False
    tune_cache: str = field(default="", metadata={"path": True})

    def validate(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"ops impl {self.impl!r} is not one of {', '.join(IMPLS)}")
        for name in ("gla_triton", "side_streams", "autotune"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ops config field {name!r} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.tune_cache, (str, os.PathLike)):
            # read only when a new shape is autotuned on a GPU, where a Path(...) TypeError would name no field
            raise ValueError(f"ops config field 'tune_cache' must be a file path ('' for "
                             f"~/.cache/linscale/kernel-tune.json), got {self.tune_cache!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_CONFIG = OpsConfig()


def get_config() -> OpsConfig:
    """The process-wide ops config (the object itself: read it, change it with `set_config`)."""
    return _CONFIG


def set_config(cfg: OpsConfig | None = None, **fields) -> OpsConfig:
    """Replace the process-wide config by `cfg`, or change some of its fields: set_config(impl='chunked')."""
    global _CONFIG
    new = dataclasses.replace(cfg if cfg is not None else _CONFIG, **fields)
    new.validate()
    _CONFIG = new
    return new


def triton_or_reference(op: str, kernel_installed: bool, auto_runs_kernel: bool, impl: str | None = None) -> str:
    """'triton' or 'reference' for an op with one Triton kernel and a plain-PyTorch twin (rms_norm,
    silu_lrpe): `impl` (default: the process config's) 'triton' demands the kernel, 'auto' takes it when
    `auto_runs_kernel` (the op's own condition on its input), anything else runs the twin."""
    name = impl or get_config().impl
    if name == "triton":
        if not kernel_installed:
            raise ValueError(f"{op}: impl='triton' needs Triton installed (pip install triton), "
                             "or choose impl 'auto'")
        return "triton"
    return "triton" if name == "auto" and auto_runs_kernel else "reference"

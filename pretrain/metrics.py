"""Where a run's numbers go: metrics.jsonl (one object per logged step), TensorBoard scalars, and a
console line with rate and ETA. Only rank 0 writes."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from checkpoints.layout import METRICS, TENSORBOARD

# dense bf16 tensor-core peak, for MFU
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "H800": 989e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in PEAK_BF16_FLOPS.items():
        if key in name:
            return v
    return None


def _fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        self.file = open(run_dir / METRICS, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / TENSORBOARD))
            except Exception as err:  # tensorboard is optional for a run
                print(f"[linscale] tensorboard disabled: {err}", file=sys.stderr)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class Progress:
    """One console line per log step: step/total, loss, lr, tokens/s, MFU, ETA."""

    def __init__(self, total_steps: int | None, enabled: bool):
        self.total, self.enabled = total_steps, enabled
        self.start = time.time()

    def line(self, step: int, row: dict, steps_done_this_session: int) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        eta = float("nan")
        if self.total and steps_done_this_session:
            eta = elapsed / steps_done_this_session * (self.total - step)
        parts = [f"step {step}" + (f"/{self.total}" if self.total else ""), f"loss {row['loss']:.4f}",
                 f"lr {row['lr']:.2e}",
                 "compiling" if row.get("tokens_per_s") is None else f"{row['tokens_per_s']:,.0f} tok/s"]
        if row.get("mfu") is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if row.get("val_loss") is not None:
            parts.append(f"val {row['val_loss']:.4f}")
        parts.append(f"ETA {_fmt_duration(eta)}")
        print(" | ".join(parts), flush=True)

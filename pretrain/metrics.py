"""Where a run's numbers go: metrics.jsonl (one object per logged step), TensorBoard scalars, and a
console line with rate and ETA. Only rank 0 writes."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from checkpoints.layout import METRICS, TENSORBOARD
from pretrain.logs import get_logger

logger = get_logger(__name__)

# dense bf16 tensor-core peak per GPU (NVIDIA's datasheets print twice these, "with sparsity"), for MFU,
# matched against torch.cuda.get_device_name in this order: the PCIe and NVL boards of a chip run at lower
# clocks and power than its SXM module ("NVIDIA H100 PCIe" 756 TFLOP/s, "NVIDIA H100 NVL" and "NVIDIA H200
# NVL" 835), so their names must be tried before the bare chip name, which is the SXM part ("NVIDIA H100
# 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB": 989)
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H800 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12,
                   "H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def logged_row_at(run_dir: Path, step: int) -> dict:
    """The metrics.jsonl row of `step` in `run_dir` (the last one written for it), or {}: what a start that
    trains nothing (a finished run resumed) reports as its final loss."""
    row: dict = {}
    try:
        with open(Path(run_dir) / METRICS, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if isinstance(r, dict) and r.get("step") == step:
                    row = r
    except OSError:
        pass
    return row


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` (None on CPU or an unlisted GPU: no MFU is logged)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name: str) -> float | None:
    """The dense bf16 peak of the GPU called `name` (as torch.cuda.get_device_name gives it), or None."""
    for key, v in PEAK_BF16_FLOPS.items():  # most specific first
        if key.lower() in name.lower():
            return v
    return None


def _fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def drop_partial_last_line(path: Path) -> int:
    """Cut a row that a crash or a full disk left half-written at the end of a jsonl file (a later append
    would glue the next row onto it). Returns the bytes removed."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, 2)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            keep, pos = 0, size
            while pos > 0:  # the last newline, read backwards in blocks
                start = max(0, pos - (1 << 16))
                f.seek(start)
                i = f.read(pos - start).rfind(b"\n")
                if i >= 0:
                    keep = start + i + 1
                    break
                pos = start
            f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0


class MetricsLogger:
    """Rank 0 appends one JSON row per logged step to RUN/metrics.jsonl (and TensorBoard scalars). A row
    that cannot be written (a full disk) does not raise: `failed` then says why, nothing more is written,
    and the training loop stops at the step boundary without a checkpoint of the unlogged steps (resuming
    replays them from the newest checkpoint, so no row is missing).

    `purge_step`: the first step this start logs (a resume's next step). Rows of that step and later that an
    earlier attempt wrote to TensorBoard are hidden by its reader (a restart record at that step), so a
    replayed step is shown once rather than as a second, backwards segment of each curve; metrics.jsonl keeps
    both copies (the later one supersedes)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, purge_step: int | None = None):
        self.enabled = enabled
        self.file = None
        self.tb = None
        self.failed: str | None = None
        self.path = Path(run_dir) / METRICS
        if not enabled:
            return
        cut = drop_partial_last_line(self.path)
        if cut:
            logger.warning(f"{self.path}: removed a half-written last row ({cut} bytes; its step is replayed)")
        self.file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / TENSORBOARD), purge_step=purge_step)
            except Exception as err:  # tensorboard is optional for a run
                logger.warning(f"tensorboard disabled: {err}")

    def log(self, row: dict) -> None:
        if not self.enabled or self.failed is not None:
            return
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as err:
            from checkpoints.disk import write_failure
            self.failed = write_failure(self.path, err)
            self.close()
            return
        if self.tb is not None:
            try:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                        self.tb.add_scalar(f"train/{k}", v, row["step"])
            except OSError as err:  # TensorBoard is a view of metrics.jsonl: training goes on without it
                logger.warning(f"tensorboard disabled: {err}")
                self._close_tb()

    def _close_tb(self) -> None:
        tb, self.tb = self.tb, None
        if tb is not None:
            try:
                tb.close()
            except OSError:
                pass

    def close(self) -> None:
        """Idempotent; never raises for a write that cannot complete (that is reported through `failed`)."""
        f, self.file = self.file, None
        if f is not None:
            try:
                f.close()
            except OSError as err:
                if self.failed is None:
                    from checkpoints.disk import write_failure
                    self.failed = write_failure(self.path, err)
        self._close_tb()


class Progress:
    """One console line per log step: step/total, loss, lr, tokens/s, MFU, ETA."""

    def __init__(self, total_steps: int | None, enabled: bool):
        self.total, self.enabled = total_steps, enabled
        self.start = time.time()

    def line(self, step: int, row: dict, steps_done_this_session: int, one_off_s: float = 0.0,
             one_off_steps: int = 0) -> None:
        """`one_off_s`, `one_off_steps`: the time and the steps of this process that do not recur (compiles,
        the first step, a profiled step; SpeedMonitor's excluded_total_s/excluded_steps_total). The ETA is
        the remaining steps at the mean time of the others, validation and checkpoint saves included: a
        first step that compiled for minutes would otherwise be charged to every step still to come."""
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        eta = float("nan")
        timed = steps_done_this_session - one_off_steps
        if self.total and step >= self.total:
            eta = 0.0
        elif self.total and timed > 0:
            eta = max(0.0, elapsed - one_off_s) / timed * (self.total - step)
        parts = [f"step {step}" + (f"/{self.total}" if self.total else ""), f"loss {row['loss']:.4f}",
                 f"lr {row['lr']:.2e}",
                 "compiling" if row.get("tokens_per_s") is None else f"{row['tokens_per_s']:,.0f} tok/s"]
        if row.get("mfu") is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if row.get("val_loss") is not None:
            parts.append(f"val {row['val_loss']:.4f}")
        parts.append(f"ETA {_fmt_duration(eta)}")
        print(" | ".join(parts), flush=True)

"""Where a training step's GPU time goes: one step under the torch profiler (CUDA activity only, so the
profiler adds little host work), summarised as kernel time by class, the top kernels, and the GPU's idle
gaps (the union of the kernels' intervals over all streams against the step's wall time; a gap is the GPU
waiting for the host), grouped by the kernels on either side. `launch/bench_train.py --profile` and
`launch/pretrain.py --profile-step N` (`StepProfiler`) both use it."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from pretrain.callbacks import Callback, TrainProgress
from pretrain.logs import get_logger
from pretrain.monitors import SpeedMonitor

logger = get_logger(__name__)

# kernel classes, by kernel-name fragments (first match wins)
KERNEL_CLASSES = [
    ("linear attention (Triton)", ("scan_kernel", "gla_", "_lin_rec", "seg_local", "seg_combine")),
    ("cos2 feature map (Triton)", ("silu_lrpe",)),
    ("softmax attention (SDPA)", ("flash", "fmha", "sdpa", "attention")),
    ("loss softmax pass (Triton)", ("_ce_rows",)),
    ("RMSNorm (Triton)", ("_rms_",)),
    ("matmul (cuBLAS)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "splitk")),
    ("fused elementwise (Inductor)", ("triton_poi", "triton_red", "triton_per", "triton_")),
    ("optimizer (fused AdamW)", ("adam", "multi_tensor")),
    ("FFT (cos2 TPE)", ("fft",)),
    ("eager elementwise / reductions", ("elementwise", "reduce_kernel", "vectorized", "index", "gather",
                                        "scatter", "embedding", "copy", "fill", "cat")),
]
# profiler rows that are not kernels: operators, ranges, and "Command Buffer Full" (the host waiting for
# room in the launch queue)
NOT_KERNELS = ("aten::", "linscale::", "ProfilerStep", "autograd::", "Command Buffer Full")


def classify(name: str) -> str:
    low = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def idle_gaps(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """The gaps in the union of the kernels' [start, end) intervals, whatever the number of streams (kernels
    that overlap count once): each as (start, end, the kernel that last ended before it, the kernel after it)."""
    gaps: list[tuple[float, float, str, str]] = []
    end, last = None, ""
    for s, e, name in sorted(intervals):
        if end is not None and s > end:
            gaps.append((end, s, last, name))
        if end is None or e >= end:
            end, last = e, name
    return gaps


def summarize(kernel_events: Iterable[tuple[str, float, float, float]], wall: float) -> dict:
    """The summary of one profiled step from its kernels as (name, start s, end s, self time s) and the
    step's wall time (s)."""
    kernels: dict[str, float] = {}
    intervals = []
    for name, start, end, self_s in kernel_events:
        kernels[name] = kernels.get(name, 0.0) + self_s
        intervals.append((start, end, name[:60]))
    gaps = idle_gaps(intervals)
    idle = sum(end - start for start, end, _, _ in gaps)
    busy = (max(iv[1] for iv in intervals) - min(iv[0] for iv in intervals) - idle) if intervals else 0.0
    by_pair: dict[str, float] = {}
    for start, end, before, after in gaps:
        by_pair[f"{before} -> {after}"] = by_pair.get(f"{before} -> {after}", 0.0) + end - start
    total = sum(kernels.values()) or 1.0
    classes: dict[str, float] = {}
    for k, s in kernels.items():
        c = classify(k)
        classes[c] = classes.get(c, 0.0) + s
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_s": wall, "kernel_s": total, "gpu_busy_s": busy, "gpu_busy_share": busy / wall if wall else None,
            "idle_gaps": len(gaps), "idle_s": idle,
            "idle_by_kernel_pair": [{"pair": k, "s": v} for k, v in sorted(by_pair.items(), key=lambda kv: -kv[1])[:15]],
            "classes": {c: {"s": s, "share": s / total} for c, s in sorted(classes.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": k[:120], "s": s, "share": s / total} for k, s in top]}


def _kernel_events(prof) -> list[tuple[str, float, float, float]]:
    out = []
    for e in prof.events():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0 and not e.key.startswith(NOT_KERNELS):
            out.append((e.key, e.time_range.start / 1e6, e.time_range.end / 1e6, us / 1e6))
    return out


def profile_call(fn: Callable[[], object]) -> dict:
    """`summarize` of one call of fn (CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        wall = time.time() - t0
    return summarize(_kernel_events(prof), wall)


def describe(summary: dict, waits: int = 3) -> str:
    """One log line: how busy the GPU was, the largest kernel classes, the longest waits."""
    busy = summary["gpu_busy_share"]
    classes = ", ".join(f"{c} {v['share']:.0%}" for c, v in list(summary["classes"].items())[:4])
    longest = "; ".join(f"{w['pair']} {w['s'] * 1e3:.1f} ms" for w in summary["idle_by_kernel_pair"][:waits])
    return (f"GPU busy {busy:.1%} of {summary['wall_s']:.3f} s ({summary['idle_gaps']} idle gaps, "
            f"{summary['idle_s'] * 1e3:.1f} ms); kernel time by class: {classes}; longest waits: {longest or 'none'}")


class StepProfiler(Callback):
    """`--profile-step N`: optimizer step N under the profiler (CUDA only), its summary written to
    <run>/profile-step-N-rank-R.json by every rank and logged in one line by rank 0. The step, with the time
    spent reading its trace, is kept out of tokens/s through `speed` (the SpeedMonitor), when given."""

    def __init__(self, step: int, device: torch.device, run_dir: Path, rank: int,
                 speed: SpeedMonitor | None = None) -> None:
        self.step, self.device, self.run_dir, self.rank, self.speed = step, device, Path(run_dir), rank, speed
        self._prof, self._t0, self._since = None, 0.0, 0.0

    def post_attach(self) -> None:
        if self.device.type != "cuda":
            logger.warning(f"--profile-step {self.step}: the profile records CUDA kernels, and this run is on "
                           f"{self.device.type}: no step is profiled")

    def pre_step(self, progress: TrainProgress) -> None:
        if self.device.type == "cuda" and progress.step + 1 == self.step:  # the step about to run is number step
            from torch.profiler import ProfilerActivity, profile
            self._since = time.time()  # the profiler's start-up is kept out of tokens/s too
            torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
            self._t0 = time.time()

    def post_train_batch(self, progress: TrainProgress, result) -> None:
        if self._prof is None:
            return
        torch.cuda.synchronize()
        wall = time.time() - self._t0
        self._prof.__exit__(None, None, None)
        summary = summarize(_kernel_events(self._prof), wall)
        self._prof = None
        path = self.run_dir / f"profile-step-{self.step}-rank-{self.rank}.json"
        path.write_text(json.dumps({"step": self.step, "rank": self.rank, **summary}, indent=1))
        logger.info(f"step {self.step} profiled ({path.name}): {describe(summary)}")
        if self.speed is not None:
            self.speed.exclude_step(progress.step, self._since)

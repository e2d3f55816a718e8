"""Launch plans of the linear-attention kernels: the layout (how many segments each sequence is split
into) and every kernel's launch configuration, chosen per shape and GPU.

Layouts (`ops.triton_scan`): *scan* walks every (sequence, head) from start to end in one program per
column block; *split* cuts each sequence into S segments of SC chunks, forms their start states by a
two-level scan and walks the segments in parallel. A walk is latency-bound: a program takes about the same
time per chunk whatever else runs, so the time of a walk kernel is (chunks per walk) x (waves of programs).
With batch x heads x column blocks below the number of SMs the scan layout leaves SMs idle and S segments
cut the time almost S-fold; once the programs fill the GPU, splitting only adds the two-level scan.

The rule (`_segments`): from 64 chunks a sequence on, the fastest S measured on this GPU for the batch x
heads count (`launch/bench_kernels.py --sweep`; docs/kernels.md, Layouts), else a wave model of the walks
(programs run in waves of what the SMs hold; time = waves x chunks a segment); sequences of 32-63 chunks
take a table scaled between its counts, capped so that a segment keeps a few chunks; shorter ones are never
split. With `OpsConfig.autotune` the candidates are
timed instead, on the first use of each shape, and the winner is kept in an on-disk cache keyed by GPU
and shape. Either way the criterion is the GPU's time with the host's launch work hidden (`gpu_ms`), the
time a training step sees.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from checkpoints.atomic import atomic_write_text
from ops.config import get_config

BT = 64  # chunk length of every kernel


@dataclass(frozen=True)
class Plan:
    """seg_chunks: chunks per segment (SC); segments: S = cdiv(chunks of the longest sequence, SC);
    launch: per kernel {'block', 'num_warps', 'num_stages'}; source: rule, autotune or forced."""
    seg_chunks: int
    segments: int
    launch: dict = field(default_factory=dict)
    source: str = "rule"

    @property
    def layout(self) -> str:
        return "scan" if self.segments == 1 else "split"


# Sequences of _SHORT_CHUNKS chunks or more (T >= 4096): the fastest segment count S measured per GPU (name
# substring), op and batch x heads count, as (S at 64-255 chunks, S at 256 chunks or more): fwd+bwd GPU time,
# D = 128, `launch/bench_kernels.py --sweep` at T = 8K, 32K and 64K (lightning with TNL's decays and without
# decay, GLA with HGRN2's gates and with log f in [-20, 0]; docs/kernels.md, Layouts, and
# docs/bench_kernels/sweep-h200*.json). Counts and GPUs not in it take the wave model (`_wave_segments`).
_MEASURED = {
    "H200": {
        "lightning": {8: (8, 8), 12: (16, 16), 16: (4, 8), 20: (3, 16), 24: (8, 8), 32: (4, 4), 40: (3, 8),
                      48: (4, 4)},
        "gla": {8: (8, 8), 12: (16, 16), 16: (4, 12), 24: (8, 8), 32: (4, 4)},
    },
}
_LONG_CHUNKS = 256  # where the second S of a _MEASURED entry starts
# The wave model: a walk kernel runs its programs in waves of as many as the SMs hold (two programs of 4
# warps an SM at the walks' 172-255 registers a thread: _WALK_WARPS_PER_SM), each walking its segment's
# chunks at about the same time per chunk; its time is (waves) x (chunks a segment), and each segment adds
# _SEG_COST chunk-steps of two-level scan and launch tail. Fitted to the 54 cells of the H200 sweeps: the S
# it picks is within 4.2% of the fastest in every cell, median 1.000 (docs/kernels.md, Layouts).
_WALK_WARPS_PER_SM = 8
_SEG_COST = 0.4
# Sequences of 32-63 chunks (T = 2048-4095) start from this table (the fastest S per batch x heads count
# measured at T >= 32K on an H100, scaled as 1 / (batch x heads) from the nearest count in log scale and by
# the GPU's SM count), then keep segments of at least _SHORT_SEG or _MIN_SEG chunks (below).
_TABLE = {
    "H100": {"lightning": {12: 12, 24: 8, 32: 6, 64: 1}, "gla": {12: 12, 24: 8, 32: 6, 64: 1}},
}
# the shortest segment (in chunks) that still paid for its share of the two-level scan
_MIN_SEG = {"lightning": 8, "gla": 8}
# Sequences of fewer than _SHORT_CHUNKS chunks (T < 4096) split into segments of at least _SHORT_SEG
# chunks where batch x heads is at most _SHORT_HEADS and the keys at most 128 wide: at T = 2048, S = 6
# (segments of 6 chunks) was the fastest at 12 and 24 sequence-heads for lightning and GLA at D = 128,
# 7-14% less GPU time than S = 4 on an H200 and 1-8% on an H100; at 32 sequence-heads S = 6 was 7-12%
# slower than S = 4, and with cosFormer2's 256-wide keys S = 4 or 2 was the fastest on the H100
# (docs/kernels.md, Layouts).
_SHORT_CHUNKS, _SHORT_SEG, _SHORT_HEADS = 64, 5, 24
# sequences shorter than this many chunks (T < 2048) are never split (unmeasured there; a segment keeps
# at least `_MIN_SEG` chunks anyway). From 32 chunks on the rule is the table's, for the GPU's time: in
# training the host enqueues kernels ahead of the GPU, so launch work is hidden and a split that shortens
# the walks pays even where an isolated call is bound by its launches (docs/kernels.md, Layouts).
_MIN_SPLIT_CHUNKS = 32
_SMS_OF_TABLE = {"H100": 132}
# the split layout's segment-state buffers stay below this (packed input with many sequences)
_MAX_SEG_BYTES = 1 << 30


def _over_seg_cap(p: Plan, NH: int, K: int, V: int) -> bool:
    """Whether plan `p`'s segment states (fp32 [NH, segments - 1, K, V]) exceed _MAX_SEG_BYTES."""
    return NH * (p.segments - 1) * K * V * 4 > _MAX_SEG_BYTES


def _np2(x: int) -> int:
    return 1 << max(4, (int(x) - 1).bit_length())


def _gpu(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return p.name, p.multi_processor_count
    return "cpu", 132  # the interpreter: any count; the tests force their layouts


def _table(gpu: str) -> tuple[dict, int]:
    for key, val in _TABLE.items():
        if key in gpu:
            return val, _SMS_OF_TABLE[key]
    key = next(iter(_TABLE))
    return _TABLE[key], _SMS_OF_TABLE[key]


def default_launch(op: str, K: int, V: int, device: torch.device) -> dict[str, dict]:
    """Launch configs of every kernel (tile of the split dimension, warps, stages). The walks hold whole
    the dimension they reduce over and split the other; chosen by sweeps on H100/H200 at D = 128 (their
    registers and spills at these configs: `launch/bench_kernels.py --resources`, docs/kernels.md)."""
    gated = op == "gla"
    Kp, Vp = _np2(K), _np2(V)
    wide = max(Kp, Vp) >= 128
    walk_v = {"block": min(64, Vp), "num_stages": (2 if gated else 3) if Kp <= 128 else 1 if gated else 2}
    launch = {
        "fwd": {**walk_v, "num_warps": 8 if wide else 4},
        "dv": {**walk_v, "num_warps": 8 if wide and Kp <= 128 else 4},
        "dq": {"block": min(32 if Kp <= 128 else 64, Kp), "num_warps": 4, "num_stages": 2},
        "dk": {"block": min(32 if Kp <= 128 else 64, Kp), "num_warps": 4, "num_stages": 2},
        "local": {"block": min(32 if gated else 64, Kp), "block_v": Vp if gated else min(64, Vp), "num_warps": 4,
                  "num_stages": 2},
        "combine": {"block": min(16, Kp), "block_v": Vp, "num_warps": 4, "num_stages": 1},
        # GLA intra-chunk kernels (each GPU-tested): tame chunks' A and dq / dk at 32-wide key blocks, 4 warps;
        # the level kernels (flag 0) at 32-wide key blocks, 4 warps (fwd+bwd GPU time over 9 shapes, H100
        # and H200, docs/kernels.md, Launch configurations; 64-wide d log_f blocks, 1.5% faster there, spill
        # 3.9 KB a thread in Triton 3.9's compile and are not used)
        "A": {"block": min(32, Kp), "num_warps": 4, "num_stages": 1},
        "dqk": {"block": min(32, Kp), "num_warps": 4, "num_stages": 1},
        "A_sub": {"block": min(32, Kp), "num_warps": 4, "num_stages": 1},
        "dqk_sub": {"block": min(32, Kp), "num_warps": 4, "num_stages": 1},
        "dg": {"block": min(32, Kp), "num_warps": 4, "num_stages": 1},
    }
    if not gated and Kp == 128:
        # lightning with keys padded to 128 (TNL's heads): value blocks of 32 at 4 warps in the forward and
        # dv walks, 3 stages in the dq / dk walks and the segment sums: 9-14% less fwd+bwd GPU time than the
        # rule above, at five shapes from 1 x 12 to 16 x 12 on an H200 (docs/kernels.md, Launch
        # configurations); the widths not swept keep the rule (cosFormer2's 256-wide keys: 3 stages were 2%
        # slower at T = 8192)
        for name in ("fwd", "dv"):
            launch[name].update(block=min(32, Vp), num_warps=4)
        for name in ("dq", "dk", "local"):
            launch[name]["num_stages"] = 3
    if gated and Kp == 128:
        # the A level kernel capped at 168 registers a thread (204 uncapped): a 64 B spill, but 3 programs
        # an SM instead of 2; 1-3% less fwd+bwd GPU time where every chunk takes the level kernels, the
        # others unchanged, on an H200 (docs/kernels.md, Launch configurations). The dq / dk level kernel
        # capped likewise spilled 560 B and took 7-9% longer.
        launch["A_sub"]["maxnreg"] = 168
    return launch


# maxnreg (a cap on registers a thread) trades spills for more programs per SM; key_blocks (the key blocks
# one program of the dq / dk level kernel walks, 1 when unset) trades programs for fewer dA products
_LAUNCH_KEYS = {"block": (1, 256), "block_v": (1, 256), "num_warps": (1, 16), "num_stages": (1, 8),
                "maxnreg": (32, 255), "key_blocks": (1, 16)}
_ANY_INT = ("num_stages", "maxnreg")  # the other keys take powers of two
_ONLY_FOR = {"key_blocks": ("dqk_sub",)}  # keys that one kernel reads: elsewhere a variant would time nothing


def launch_options(c: dict) -> dict:
    """A kernel's launch config as Triton launch options (a register cap only where the config sets one)."""
    kw = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
    if "maxnreg" in c:
        kw["maxnreg"] = c["maxnreg"]
    return kw


def _blocks_over(c: dict, K: int) -> int:
    """How many of a kernel's blocks (config `c`) cover K keys padded to a power of two."""
    Kp = _np2(K)
    return -(-Kp // min(c["block"], Kp))


def key_blocks(c: dict, K: int) -> int:
    """Key blocks one program of the dq / dk level kernel takes: its config's key_blocks (1 when unset), at
    most the number of its key blocks over K keys padded to a power of two."""
    return min(c.get("key_blocks", 1), _blocks_over(c, K))


def check_launch_overrides(over: dict, where: str = "launch overrides") -> None:
    """Raise ValueError, naming the entry and what is allowed, unless `over` is {kernel: {key: value}} with
    kernels of `default_launch`, keys among block / block_v / num_warps / num_stages / maxnreg / key_blocks
    (this one for dqk_sub only) and powers of two in their ranges (num_stages, maxnreg: any integer in it).
    A misspelt kernel or key would otherwise be ignored, and a variant would time the defaults under another
    name."""
    kernels = sorted(default_launch("gla", 128, 128, torch.device("cpu")))
    if not isinstance(over, dict):
        raise ValueError(f"{where}: expected {{kernel: {{key: value}}}}, got {type(over).__name__}")
    for name, cfg in over.items():
        if name not in kernels:
            raise ValueError(f"{where}: unknown kernel {name!r}; the kernels are {', '.join(kernels)}")
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: {name}: expected {{key: value}}, got {cfg!r}")
        for key, value in cfg.items():
            if key not in _LAUNCH_KEYS:
                raise ValueError(f"{where}: {name}: unknown key {key!r}; the keys are {', '.join(_LAUNCH_KEYS)}")
            if name not in _ONLY_FOR.get(key, (name,)):
                raise ValueError(f"{where}: {name}.{key}: only {', '.join(_ONLY_FOR[key])} reads {key}")
            lo, hi = _LAUNCH_KEYS[key]
            pow2 = key not in _ANY_INT
            if (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi
                    or (pow2 and value & (value - 1))):
                kind = "a power of two" if pow2 else "an integer"
                raise ValueError(f"{where}: {name}.{key} = {value!r}; expected {kind} in [{lo}, {hi}]")


def _segments(gpu: str, sms: int, op: str, NH: int, K: int, V: int, nc_avg: int, nc_max: int,
              launch: dict) -> int:
    if nc_avg < _MIN_SPLIT_CHUNKS:
        return 1
    if nc_avg >= _SHORT_CHUNKS:
        s = _measured_segments(gpu, op, NH, nc_avg)
        if s is None:
            s = _wave_segments(NH, nc_avg, sms, _walk_warps(launch, K), _MIN_SEG[op])
        else:
            s = min(s, nc_avg // _MIN_SEG[op])  # entries measured on longer sequences
    else:
        table, table_sms = _table(gpu)
        counts = table[op]
        nh = NH * table_sms / sms  # the same load per SM on this GPU
        near = min(counts, key=lambda c: abs(math.log(c / nh)))
        s = int(round(counts[near] * near / nh)) if nh < max(counts) else 1
        short = nh <= _SHORT_HEADS and K <= 128
        s = max(1, min(s, nc_avg // (_SHORT_SEG if short else _MIN_SEG[op])))
    while s > 1 and NH * (math.ceil(nc_max / math.ceil(nc_avg / s)) - 1) * K * V * 4 > _MAX_SEG_BYTES:
        s -= 1
    return s


def _measured_segments(gpu: str, op: str, NH: int, nc: int) -> int | None:
    """The measured S of `_MEASURED` for this GPU, op and batch x heads count, or None."""
    for key, ops in _MEASURED.items():
        if key in gpu and NH in ops[op]:
            return ops[op][NH][nc >= _LONG_CHUNKS]
    return None


def _walk_warps(launch: dict, K: int) -> int:
    """Warps a (sequence, head, segment) takes in a walk kernel: its key blocks of the dq walk times their
    warps (16 at K = 128 in every op's default configs: 4 blocks of 32 keys x 4 warps)."""
    return _blocks_over(launch["dq"], K) * launch["dq"]["num_warps"]


def _wave_segments(NH: int, nc: int, sms: int, warps_per_segment: int, min_seg: int) -> int:
    """The candidate S (segments of at least min_seg chunks) of least modelled walk time: waves of
    programs x chunks a segment + _SEG_COST a segment (see `_WALK_WARPS_PER_SM`); the fewer segments on a
    tie; no split where the sequence-heads alone fill a wave."""
    at_once = max(1.0, sms * _WALK_WARPS_PER_SM / warps_per_segment)  # (sequence, head, segment)s a wave
    if NH >= at_once:  # the scan's programs fill the SMs already: segments would only add the two-level scan
        return 1
    best = (float(nc), 1)  # the scan layout: one wave, no two-level scan
    for s in _candidates(nc):
        sc = math.ceil(nc / s)
        segs = math.ceil(nc / sc)
        if segs < 2 or sc < min_seg:
            continue
        cost = math.ceil(NH * segs / at_once) * sc + _SEG_COST * segs
        if cost < best[0] - 1e-9:
            best = (cost, segs)
    return best[1]


# test-only seam (ops.testing): a forced segment length and launch overrides (the version keys the cache)
_FORCED: dict = {}
_FORCED_VERSION = [0]


def _make(seg_chunks: int, nc_max: int, launch: dict, source: str) -> Plan:
    sc = max(1, min(int(seg_chunks), max(nc_max, 1)))
    return Plan(seg_chunks=sc, segments=max(1, math.ceil(nc_max / sc)), launch=launch, source=source)


_PLANS: dict[tuple, Plan] = {}  # per shape: the plan is asked for on every call, so keep it


def plan(op: str, N: int, H: int, T: int, K: int, V: int, device: torch.device, varlen: bool,
         measure: Callable[[Plan], float] | None = None) -> Plan:
    """The plan for `op` ('lightning' or 'gla') on N sequences of H heads, K / V wide; T is the padded
    length of each sequence, or for packed input (varlen) the total length of all N."""
    cfg = get_config()
    # the device names the GPU, so a cached plan needs no device-property query
    # the config's fields that choose a plan, not id(cfg): a freed config's id is reused by the next one, whose
    # plans would then come from the old setting
    key = (op, N, H, T, K, V, device, varlen, cfg.autotune, cfg.tune_cache, _FORCED_VERSION[0])
    hit = _PLANS.get(key)
    if hit is None:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        gpu, sms = _gpu(device)
        hit = _PLANS[key] = _plan(op, N, H, T, K, V, device, varlen, measure, cfg, gpu, sms)
    return hit


def _plan(op, N, H, T, K, V, device, varlen, measure, cfg, gpu, sms) -> Plan:
    nc_max = max(1, math.ceil(T / BT))
    nc_avg = max(1, math.ceil(T / N / BT)) if varlen else nc_max
    launch = default_launch(op, K, V, device)
    for name, over in _FORCED.get("launch", {}).items():
        launch[name] = {**launch.get(name, {}), **over}
    if _FORCED.get("seg_chunks") is not None:
        return _make(_FORCED["seg_chunks"], nc_max, launch, "forced")
    s = _segments(gpu, sms, op, N * H, K, V, nc_avg, nc_max, launch)
    rule = _make(math.ceil(nc_avg / s), nc_max, launch, "rule")
    if not (cfg.autotune and measure is not None and device.type == "cuda"):
        return rule
    # "gpu": timed by gpu_ms (entries timed by wall time, which favoured fewer launches, are not reused)
    key = f"{op}|N{N}|H{H}|T{T}|K{K}|V{V}|{'varlen' if varlen else 'dense'}|gpu"
    hit = _cached_seg_chunks(cfg.tune_cache, gpu, key)
    if hit is not None:
        p = _make(hit, nc_max, launch, "autotune")
        if hit >= nc_avg or not _over_seg_cap(p, N * H, K, V):
            return p
        # not one the tuner could have stored (it times no such candidate, below): a hand-edited entry
        warnings.warn(f"the kernel tuning cache {_usable_path(cfg.tune_cache)}: entry {gpu} / {key} = {hit} needs "
                      f"more than {_MAX_SEG_BYTES >> 20} MiB of segment states; timing this shape again")
    best = None
    for s in _candidates(nc_avg):
        p = _make(math.ceil(nc_avg / s), nc_max, launch, "autotune")
        # one segment length per sequence (s = 1) always stays, as in the rule: packed input with many
        # sequences may exceed the cap at every S, and the tuner must still return a plan
        if s > 1 and _over_seg_cap(p, N * H, K, V):
            continue
        ms = measure(p)
        if best is None or ms < best[0]:
            best = (ms, p)
    _store(cfg.tune_cache, gpu, key, best[1].seg_chunks)
    return best[1]


_CYCLES_PER_MS: list[float] = []


def _calibrate() -> float:
    """GPU clock cycles per ms of `torch.cuda._sleep`, after a spin that lifts the clocks from idle."""
    torch.cuda._sleep(50_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(10_000_000)
    e.record()
    e.synchronize()
    return 10_000_000 / max(s.elapsed_time(e), 1e-3)


def gpu_ms(fn: Callable[[], object], calls: int = 1, reps: int = 3, budget_ms: float | None = None) -> float:
    """Median GPU time (ms) of one call of `fn`, with the host's launch work hidden: each batch of
    `calls` calls (with `budget_ms`: as many as take about that long, 3 to 50) is enqueued behind a
    `torch.cuda._sleep`, so the CUDA events around the batch time the GPU only. A batch counts only if
    the GPU was still asleep when the host had enqueued all of it (else the batch runs again behind a sleep
    twice as long, and every later sleep keeps that factor). A training step sees this time (its host runs
    ahead of the GPU); a lone call's wall time is the larger of it and the host's time per call."""
    if not _CYCLES_PER_MS:
        _CYCLES_PER_MS.append(_calibrate())
    fn()  # first use: compilation, plans, caches
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - t0) * 1e3  # the larger of the host's and the GPU's time
    if budget_ms is not None:
        calls = max(3, min(50, int(budget_ms / max(once_ms, 1e-3))))
    # scale: how much longer than nominal a sleep must be to hide the host (a stale clock calibration, a
    # slow host); it only grows, so a batch run again behind a longer sleep does not fall back afterwards
    sleep_ms, scale, times, fails = 2 * calls * once_ms + 1, 1.0, [], 0
    while len(times) < reps:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(_CYCLES_PER_MS[0] * sleep_ms * scale))
        s.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        e.record()
        hidden = not s.query()  # the GPU had not reached the batch when the host finished it
        e.synchronize()
        if hidden:
            times.append(s.elapsed_time(e) / calls)
            sleep_ms, fails = 2 * host_ms + 1, 0
            continue
        fails += 1
        if fails > 10:  # 1024 times the nominal sleep in a row
            raise RuntimeError("gpu_ms: the host never finished enqueuing before the GPU woke (a call "
                               "that synchronises with the GPU cannot be timed this way)")
        scale *= 2
    return sorted(times)[len(times) // 2]


def candidate_ms(fn: Callable[[], object]) -> float:
    """The autotuner's time of one candidate layout (fwd+bwd): `gpu_ms` over batches of about 10 ms, the
    median of 5, as `launch/bench_kernels.py --sweep` times them. Timed by three single calls, the
    autotuner in a TNL 1B training step picked S = 16 for 2 x 12 heads at T = 8192, where the sweep timed
    S = 8 at 0.615 ms and S = 16 at 0.663 (one H200)."""
    return gpu_ms(fn, reps=5, budget_ms=10)


def _candidates(nc: int) -> list[int]:
    return [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if s == 1 or nc // s >= 2]


def cache_path(name: str = "") -> Path:
    return Path(name).expanduser() if name else Path.home() / ".cache" / "linscale" / "kernel-tune.json"


def _usable_path(name: str) -> Path | None:
    """cache_path, or None with a warning where it has no home to resolve (a rank under a user id without
    a home directory or HOME): the cache then stays in the process."""
    try:
        return cache_path(name)
    except RuntimeError as e:  # Path.home / expanduser: "Could not determine home directory"
        warnings.warn(f"the kernel tuning cache {name or '~/.cache/linscale/kernel-tune.json'} has no home "
                      f"directory to live in ({e}); timings stay in this process (set OpsConfig.tune_cache to a "
                      f"writable file to keep them)")
        return None


def _load_cache(name: str) -> dict:
    """The cache's {gpu: {shape key: seg_chunks}}; {} (with a warning naming the file) when it is missing,
    unreadable, not JSON or not of that form. The cache only saves timing: a bad file must not stop a run,
    and is replaced by the next write."""
    p = _usable_path(name)
    if p is None:
        return {}
    try:
        cache = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.warn(f"the kernel tuning cache {p} is unreadable ({e}); ignoring it and timing each shape "
                      f"again (the file is rewritten then; or point OpsConfig.tune_cache elsewhere)")
        return {}
    if not isinstance(cache, dict) or not all(isinstance(v, dict) for v in cache.values()):
        warnings.warn(f"the kernel tuning cache {p} is not {{gpu: {{shape: segment chunks}}}} (written by another "
                      f"program or version?); ignoring it and timing each shape again (the file is rewritten then)")
        return {}
    return cache


def _cached_seg_chunks(name: str, gpu: str, key: str) -> int | None:
    """The cached segment length of `key` on `gpu`, or None (absent, or not a positive integer: then a
    warning naming the file, and the shape is timed again rather than run with a made-up value)."""
    hit = _load_cache(name).get(gpu, {}).get(key)
    if hit is None:
        return None
    if isinstance(hit, bool) or not isinstance(hit, int) or hit < 1:
        warnings.warn(f"the kernel tuning cache {_usable_path(name)}: entry {gpu} / {key} = {hit!r} is not a "
                      f"positive integer; timing this shape again")
        return None
    return hit


def _store(name: str, gpu: str, key: str, seg_chunks: int) -> None:
    """Add one entry to the file as it is now (re-read, so that entries other processes wrote since this one
    last read it are kept; one written between that read and this write may still be lost, and is timed
    again), written atomically. A cache that cannot be written (read-only or full file system, no home)
    costs the timing of later processes only: a warning, and the run goes on with the plan."""
    p = _usable_path(name)
    if p is None:
        return
    cache = _load_cache(name)
    cache.setdefault(gpu, {})[key] = seg_chunks
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps(cache, indent=1, sort_keys=True))
    except OSError as e:
        warnings.warn(f"the kernel tuning cache {p} cannot be written ({e}); this process keeps its timings "
                      f"in memory (point OpsConfig.tune_cache at a writable file to keep them)")

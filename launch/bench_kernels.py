"""Benchmark the linear-attention kernels against fla and SDPA in one process (CUDA only).

    python launch/bench_kernels.py --matrix [--json out.json] [--T 2048 8192 32768 65536]
    python launch/bench_kernels.py --matrix --timing gpu --shapes 1x12 --T 2048   # GPU time, host work hidden
    python launch/bench_kernels.py --sweep [--json sweep.json]        # every layout of ours per cell
    python launch/bench_kernels.py --warmup --ops la gla               # compile into the Triton cache
    python launch/bench_kernels.py --profile --shapes 1x12 --T 8192 --ops gla1   # per-kernel time, ours and fla
    python launch/bench_kernels.py --resources                          # no GPU: sm_90 compile of every kernel
    python launch/bench_kernels.py --host --shapes 1x12 --T 2048 8192 --ops gla1 la0   # host (CPU) time per call
    python launch/bench_kernels.py --launches variants.json --timing gpu --ops gla16   # launch configs vs defaults
    python launch/bench_kernels.py --report a.json b.json               # no GPU: --matrix JSON files as tables

--matrix: shapes (batch x heads) 1x12, 2x12, 1x32, 4x16, 16x12 (head width 128; cos2's keys 256) x T x ops
    la0 / laL  lightning_attn with TNL's layer-0 / last-layer decays (32 layers)   anchor fla chunk_lightning_attn
    nodecay    lightning_attn without decay, Dk = 256 (cosFormer2)                anchor fla chunk_linear_attn
    gla1/gla16/gla32  gated_linear_attn with the gates of HGRN2 layer 1 / 16 / 32 of 32 (models/hgrn2.py's
               own gate code on random inputs)                                     anchor fla chunk_gla
    glaW       gated_linear_attn with log f uniform in [-20, 0] (every chunk on the sub-chunk path)
plus torch SDPA (causal, flash) at each shape where it takes under a second. Each cell: median
fwd+bwd time of `triton.testing.do_bench` (bf16; with --timing gpu, `ops.tuning.gpu_ms`: the GPU's time
alone, as a training step whose host runs ahead sees it), fla/ours, and the floor max(bytes / bandwidth, FLOPs /
matmul rate) (bytes: inputs read once, outputs written once; FLOPs: the chunked algorithm's tensor-core
work, backward = 2 x forward). Cells that would not fit in GPU memory are skipped. Ours runs with the
default plan (`ops.tuning`); --sweep times every candidate layout instead (no anchors). --resume FILE
keeps the cells of an earlier --json file and measures only the others (a matrix too long for one job
runs in several). --host measures where the CPU time of one fwd+bwd goes (launch counts, Python profile).
--report prints the cells of one or more --matrix JSON files as a table (ours / fla ms and fla / ours per
op, a column per op) and fla / ours summarised per op and over all cells.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops import gated_linear_attn, lightning_attn  # noqa: E402
from pretrain.argtypes import positive_int  # noqa: E402

# measured rates (docs/benchmarks.md): bf16 dense matmul, device copy
PEAKS = {"H200": (700e12, 4.2e12), "H100": (650e12, 3.0e12)}
C = 64
SHAPES = [(1, 12), (2, 12), (1, 32), (4, 16), (16, 12)]
OPS = ["la0", "laL", "nodecay", "gla1", "gla16", "gla32", "glaW"]
N_LAYERS = 32
AUTOTUNE_CACHE = "TRITON_CACHE_AUTOTUNING"  # Triton keeps autotuning results in its cache directory
LABEL = {"la0": "lightning, TNL layer-0 decays", "laL": "lightning, TNL last-layer decays",
         "nodecay": "lightning, no decay (cos2, Dk=256)", "gla1": "GLA, HGRN2 layer-1 gates",
         "gla16": "GLA, HGRN2 layer-16 gates", "gla32": "GLA, HGRN2 layer-32 gates",
         "glaW": "GLA, log f uniform in [-20, 0]"}


def _peaks() -> tuple[float, float]:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAKS.items() if k in name), PEAKS["H100"])


def _hgrn2_gates(B: int, T: int, H: int, layer: int, seed: int = 0):
    """(q, k, v, log_f) as HGRN2 layer `layer` (0-based, of 32) forms them: models/hgrn2.py's mixer on
    random inputs x ~ N(0, 1), PyTorch's default init of its projections, the forget-gate projection scaled
    so that f = x W_fg has standard deviation 3 (layer 0: log f down to about -10). The mixer's call of
    gated_linear_attn is intercepted to take its arguments."""
    import models.hgrn2 as hg
    from models.config import ModelConfig
    d = H * 128
    torch.manual_seed(seed + layer)
    cfg = ModelConfig(arch="hgrn2", n_layers=N_LAYERS, d_model=d, n_heads=H, d_glu=4 * d)
    mixer = hg.Hgrn2TokenMixer(cfg, layer).cuda()
    with torch.no_grad():
        mixer.fg_proj.weight.mul_(3.0 * math.sqrt(3.0))  # default init: std(f) = 1/sqrt(3)
    betas = hg.HgrnLowerBounds(N_LAYERS, d).cuda()()
    got = {}

    def capture(q, k, v, log_f, **kw):
        got.update(q=q, k=k, v=v, g=log_f)
        return torch.zeros_like(v), None
    orig, hg.gated_linear_attn = hg.gated_linear_attn, capture
    try:
        with torch.no_grad():
            for b in range(B):  # one sequence at a time keeps the projections' memory small
                mixer(torch.randn(1, T, d, device="cuda"), betas[layer])
                for name in ("q", "k", "v", "g"):
                    got.setdefault("all_" + name, []).append(got[name])
    finally:
        hg.gated_linear_attn = orig
        del mixer
    q, k, v = (torch.cat(got["all_" + n]).to(torch.bfloat16).contiguous() for n in ("q", "k", "v"))
    g = torch.cat(got["all_g"]).float().contiguous()
    return q, k, v, g


def _case(op: str, B: int, T: int, H: int):
    """(make_inputs, ours, fla or None, flops_fwd, bytes_fwd+bwd) for one cell."""
    dev, bf, D = "cuda", torch.bfloat16, 128
    Dk = 2 * D if op == "nodecay" else D
    el = B * T * H

    def rnd(*s):
        return (torch.randn(*s, device=dev) * 0.5).to(bf)
    flops = 2 * el * (C * Dk + C * D + 2 * Dk * D)
    io = 2 * el * (2 * Dk + 2 * D) + 2 * el * (4 * Dk + 3 * D)
    try:
        import fla.ops as fo
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"# fla not importable ({type(e).__name__}: {e}); anchors skipped", flush=True)
        fo = None
    if op in ("la0", "laL"):
        from models.tnl import tnl_decays
        layer = 0 if op == "la0" else N_LAYERS - 1
        decay = torch.tensor(tnl_decays(H, layer, N_LAYERS), device=dev)
        mk = lambda: [rnd(B, T, H, D), rnd(B, T, H, D), rnd(B, T, H, D)]  # noqa: E731
        ours = lambda q, k, v: lightning_attn(q, k, v, decay, check_values=False)  # noqa: E731
        fla = None if fo is None else (lambda q, k, v: fo.chunk_lightning_attn(
            q, k, v, layer_idx=layer, num_layers=N_LAYERS, scale=1.0)[0])
        return mk, ours, fla, flops, io
    if op == "nodecay":
        mk = lambda: [rnd(B, T, H, Dk), rnd(B, T, H, Dk), rnd(B, T, H, D)]  # noqa: E731
        ours = lambda q, k, v: lightning_attn(q, k, v, None, check_values=False)  # noqa: E731
        fla = None if fo is None else (lambda q, k, v: fo.chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0])
        return mk, ours, fla, flops, io
    if op == "glaW":
        def mk():
            q, k, v = rnd(B, T, H, D), rnd(B, T, H, D), rnd(B, T, H, D)
            return [q, k, v, -20.0 * torch.rand(B, T, H, D, device=dev)]
    else:
        layer = {"gla1": 0, "gla16": 15, "gla32": 31}[op]
        mk = lambda: list(_hgrn2_gates(B, T, H, layer))  # noqa: E731
    ours = lambda q, k, v, g: gated_linear_attn(q, k, v, g, check_values=False)  # noqa: E731
    fla = None if fo is None else (lambda q, k, v, g: fo.chunk_gla(q, k, v, g, scale=1.0)[0])
    return mk, ours, fla, flops, io + 4 * el * D + 8 * el * D


def _fwd_bwd_ms(fn, inputs, rep: int, timing: str = "wall") -> float:
    """Median ms of one fwd+bwd: wall time (do_bench), or with timing='gpu' the GPU's time alone
    (`ops.tuning.gpu_ms`, calls for about `rep` ms a batch)."""
    from triton.testing import do_bench
    leaves = [t.requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    do = torch.randn_like(out)
    if timing == "gpu":
        from ops.tuning import gpu_ms
        # autograd.grad: no .grad to accumulate between calls
        return gpu_ms(lambda: torch.autograd.grad(fn(*leaves), leaves, do), reps=5, budget_ms=rep)

    def step():
        fn(*leaves).backward(do)
    return do_bench(step, warmup=max(5, rep // 4), rep=rep, return_mode="median", grad_to_none=leaves)


def _fits(op: str, B: int, T: int, H: int, budget: float) -> bool:
    """A rough peak: inputs, their gradients, fla's per-chunk states and A, twice over for safety."""
    el = B * T * H * 128
    per = (2 if op == "nodecay" else 1) * 2 * 2 + 2 * 2 + (8 if op.startswith("gla") else 0) + 4
    return el * per * 2 < budget


def _header(extra: str = "", timing: str = "wall") -> dict:
    import triton
    mm, bw = _peaks()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": str(datetime.date.today()), "dtype": "bf16", "matmul_peak": mm, "bandwidth": bw,
            "timing": timing}
    try:
        import fla
        meta["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        meta["fla"] = None
    meta["autotune_cache"] = os.environ.get(AUTOTUNE_CACHE, "")
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  fla {meta['fla']}  "
          f"{meta['date']}  bf16 fwd+bwd medians ({meta['timing']} time); floor uses {mm / 1e12:.0f} TFLOP/s, {bw / 1e12:.1f} TB/s {extra}",
          flush=True)
    return meta


def _dump(path: str | None, meta: dict, rows: list) -> None:
    if path:
        Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def matrix(a) -> None:
    meta = _header(timing=a.timing)
    mm, bw = meta["matmul_peak"], meta["bandwidth"]
    budget = torch.cuda.get_device_properties(0).total_memory * 0.8
    rows = _resumed(a.resume)
    done = {(r["B"], r["H"], r["T"], r["op"]) for r in rows}
    t_start = time.time()
    if "fla" not in a.skip:
        print("# fla autotunes its kernels on first use: a cell's fla time may take minutes to come in (Triton's "
              f"on-disk autotuning cache, {AUTOTUNE_CACHE}=1, keeps the choices for later processes on this machine)",
              flush=True)
    print("| shape | T | op | ours ms | fla ms | fla/ours | floor ms | layout | elapsed s |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for B, H in a.shapes:
        for T in a.T:
            for op in a.ops:
                if (B, H, T, op) in done:
                    continue
                if not _fits(op, B, T, H, budget):
                    print(f"| {B}x{H} | {T} | {op} | skipped (memory) |||||", flush=True)
                    continue
                mk, ours, fla, flops, io = _case(op, B, T, H)
                floor = max(io / bw, 3 * flops / mm) * 1e3
                ins = mk()
                row = {"B": B, "H": H, "T": T, "op": op, "floor_ms": floor}
                try:
                    row["ours_ms"] = _fwd_bwd_ms(ours, [t.clone() for t in ins], a.rep, a.timing)
                except Exception as e:
                    row["ours_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["layout"] = _layout_of(op, B, T, H)
                if fla is not None and "fla" not in a.skip:
                    try:
                        row["fla_ms"] = _fwd_bwd_ms(fla, [t.clone() for t in ins], a.rep, a.timing)
                    except Exception as e:  # an anchor failing must not hide our numbers
                        row["fla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                del ins
                torch.cuda.empty_cache()
                rows.append(row)
                ratio = row["fla_ms"] / row["ours_ms"] if "fla_ms" in row and "ours_ms" in row else None
                print(f"| {B}x{H} | {T} | {op} | {row.get('ours_ms', float('nan')):.3f} | "
                      f"{row.get('fla_ms', float('nan')):.3f} | {ratio if ratio is None else f'{ratio:.2f}'} | "
                      f"{floor:.3f} | {row['layout']} | {time.time() - t_start:.0f} |"
                      f"{'' if 'fla_error' not in row else ' fla: ' + row['fla_error'][:60]}"
                      f"{'' if 'ours_error' not in row else ' ours: ' + row['ours_error'][:100]}", flush=True)
                _dump(a.json, meta, rows)
            if "sdpa" not in a.skip and (B, H, T, "sdpa") not in done and B * H * T * T * 128 * 4 * 3.5 / mm < 1.0:
                q, k, v = (torch.randn(B, H, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                ms = _fwd_bwd_ms(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                 [q, k, v], a.rep, a.timing)
                rows.append({"B": B, "H": H, "T": T, "op": "sdpa", "ours_ms": ms})
                print(f"| {B}x{H} | {T} | sdpa (causal, D=128) | {ms:.3f} ||||| ", flush=True)
                del q, k, v
                torch.cuda.empty_cache()
                _dump(a.json, meta, rows)
    s = matrix_summary(rows).get("all")
    if s:
        print(f"# cells with fla: {s['cells']}; fla/ours min {s['min']:.2f}, median {s['median']:.2f}, max "
              f"{s['max']:.2f}; cells below 1.0: {s['below_1']} (per op: --report {a.json or 'FILE'})", flush=True)


def matrix_summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """fla / ours over the cells that timed both, per op and over all of them ('all'): the number of cells,
    min, median, max and the number below 1.0 (fla faster)."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if "ours_ms" in r and "fla_ms" in r:
            x = r["fla_ms"] / r["ours_ms"]
            ratios.setdefault(r["op"], []).append(x)
            ratios.setdefault("all", []).append(x)
    return {op: {"cells": len(v), "min": min(v), "median": statistics.median(v), "max": max(v),
                 "below_1": sum(x < 1.0 for x in v)} for op, v in ratios.items()}


def matrix_report(rows: list[dict]) -> str:
    """The --matrix cells as a markdown table, a row per (B x H, T) and a column per op, each cell
    'ours / fla ms (fla / ours)' (bold below 1.0; 'ours ms' alone without an fla time), then the summary."""
    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    cells = {(r["B"], r["H"], r["T"], r["op"]): r for r in rows if r["op"] in ops}
    keys = sorted({(B, H, T) for B, H, T, _ in cells}, key=lambda k: (SHAPES.index(k[:2]) if k[:2] in SHAPES
                                                                     else len(SHAPES), k[:2], k[2]))
    out = ["| B x H | T | " + " | ".join(ops) + " | ours' layout |", "|---|---|" + "---|" * len(ops) + "---|"]
    for B, H, T in keys:
        parts, layout = [], ""
        for op in ops:
            r = cells.get((B, H, T, op))
            if r is None or "ours_ms" not in r:
                parts.append("—")
                continue
            layout = layout or r.get("layout", "")
            if "fla_ms" not in r:
                parts.append(f"{r['ours_ms']:.3f}")
                continue
            x = r["fla_ms"] / r["ours_ms"]
            text = f"{r['ours_ms']:.3f} / {r['fla_ms']:.3f} ({x:.2f})"
            parts.append(f"**{text}**" if x < 1.0 else text)
        out.append(f"| {B} x {H} | {T} | " + " | ".join(parts) + f" | {layout} |")
    summary = matrix_summary(rows)
    if summary:
        out += ["", "| op | cells | fla / ours min | median | max | cells below 1.0 |", "|---|---:|---:|---:|---:|---:|"]
        for op in ops + ["all"]:
            if op in summary:
                s = summary[op]
                out.append(f"| {op} | {s['cells']} | {s['min']:.2f} | {s['median']:.2f} | {s['max']:.2f} | "
                           f"{s['below_1']} |")
    return "\n".join(out)


def report(paths: list[str]) -> None:
    """Print the cells of --matrix JSON files as one table; a cell in several files: the last file's."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"--report {path}: cannot read it as JSON ({type(e).__name__}: {e})")
        cells = [r for r in data.get("rows", []) if r.get("op") in OPS] if isinstance(data, dict) else []
        if not cells or not all("ours_ms" in r or "ours_error" in r for r in cells):
            sys.exit(f"--report {path}: not a --matrix JSON file (its rows must hold ours_ms; --launches, "
                     "--sweep and --profile files hold other results)")
        for r in cells:
            rows[(r["B"], r["H"], r["T"], r["op"])] = r
        m = data.get("meta", {})
        print(f"# {path}: {m.get('device', '?')}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, "
              f"fla {m.get('fla', '?')}, {m.get('date', '?')}, timing {m.get('timing', 'wall')}")
    print(matrix_report(list(rows.values())))


def _resumed(path: str | None) -> list:
    """The rows of an earlier --json file (each keeps the meta of its own run under "run")."""
    if not path:
        return []
    old = json.loads(Path(path).read_text())
    rows = [dict(r, run=r.get("run", old["meta"])) for r in old["rows"] if "ours_ms" in r]
    print(f"# resumed {len(rows)} cells from {path}", flush=True)
    return rows


def _each_impl(a, anchor: bool = True):
    """(B, H, T, op, 'ours' or 'fla', fn, inputs) for every cell of the shapes, T and ops asked for that
    fits in memory: ours, then (with anchor) fla unless skipped, on the same inputs (made once per cell,
    freed after it)."""
    budget = torch.cuda.get_device_properties(0).total_memory * 0.8
    for B, H in a.shapes:
        for T in a.T:
            for op in a.ops:
                if not _fits(op, B, T, H, budget):
                    continue
                mk, ours, fla, *_ = _case(op, B, T, H)
                ins = mk()
                for name, fn in (("ours", ours), ("fla", fla if anchor else None)):
                    if fn is not None and not (name == "fla" and "fla" in a.skip):
                        yield B, H, T, op, name, fn, ins
                del ins
                torch.cuda.empty_cache()


def host(a) -> None:
    """Where the host (CPU) time of one fwd+bwd goes, per op and shape: the time to enqueue N calls
    (no synchronisation inside, so it is the host's own time unless something syncs), the process CPU
    time, the wall time with the final sync, the CUDA kernel launches per call (torch profiler), and the
    Python functions that take the host time (cProfile, by own time and by cumulative time)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx
    _header("(host)")
    n = 20
    for B, H, T, op, name, fn, ins in _each_impl(a):
        leaves = [t.clone().requires_grad_(True) for t in ins]
        do = torch.randn_like(fn(*leaves))

        def step():
            fn(*leaves).backward(do)
            for t in leaves:
                t.grad = None
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            step()
        t1, c1 = time.perf_counter(), time.process_time()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        launches = sum(e.count for e in ev if "LaunchKernel" in e.key) / 5
        kern = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 5 / 1e3
        print(f"## host {op} {name} {B}x{H} T={T}: enqueue {(t1 - t0) / n * 1e3:.3f} ms/call, "
              f"CPU {(c1 - c0) / n * 1e3:.3f} ms/call, wall with sync {(t2 - t0) / n * 1e3:.3f} ms/call, "
              f"{launches:.0f} kernel launches/call, kernel time {kern:.3f} ms/call", flush=True)
        rows = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
        for e in rows:
            print(f"   cpu self {e.self_cpu_time_total / 5 / 1e3:7.3f} ms  x{e.count / 5:5.1f}  {e.key[:80]}")
        if name == "ours":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                step()
            pr.disable()
            torch.cuda.synchronize()
            for order in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(28)
                print(f"### cProfile {op} {B}x{H} T={T}, 10 calls, by {order}")
                print("\n".join(buf.getvalue().splitlines()[6:]), flush=True)
        del leaves, do


def _layout_of(op: str, B: int, T: int, H: int) -> str:
    """The layout ours ran with (the plan it cached for this shape: the rule's, or the autotuned one)."""
    from ops import tuning
    key = ("gla" if op.startswith("gla") else "lightning", B, H, T, 256 if op == "nodecay" else 128, 128)
    plans = [p for k, p in tuning._PLANS.items() if k[:6] == key]
    if not plans:
        return "?"
    p = plans[-1]
    return (p.layout if p.segments == 1 else f"split S={p.segments}") + (" (autotuned)" if p.source == "autotune" else "")


def sweep(a) -> None:
    """Every candidate layout of ours per cell: the measurement behind ops.tuning's rule."""
    from ops import tuning
    from ops.testing import SCAN, force_plan
    meta = _header("(sweep)", a.timing)
    budget = torch.cuda.get_device_properties(0).total_memory * 0.8
    rows = []
    for op in a.ops:
        kind = "gla" if op.startswith("gla") else "lightning"
        for B, H in a.shapes:
            for T in a.T:
                if not _fits(op, B, T, H, budget):
                    continue
                mk, ours, *_ = _case(op, B, T, H)
                ins = mk()
                nc = math.ceil(T / C)
                res = {}
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                for s in tuning._candidates(nc):
                    if s > a.max_segments or (s > 1 and B * H * 2 * s > 8 * sms):  # far past one wave
                        continue
                    sc = SCAN if s == 1 else math.ceil(nc / s)
                    with force_plan(seg_chunks=sc, launch=a.launch):
                        try:
                            res[s] = _fwd_bwd_ms(ours, [t.clone() for t in ins], a.rep, a.timing)
                        except Exception as e:
                            print(f"# {op} {B}x{H} T={T} S={s}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                rule = tuning.plan(kind, B, H, T, 256 if op == "nodecay" else 128, 128, torch.device("cuda"), False)
                best = min(res, key=res.get) if res else None
                rows.append({"op": op, "B": B, "H": H, "T": T, "ms": res, "best": best, "rule": rule.segments})
                print(f"{op:8s} {B}x{H:<3d} T={T:6d} best S={best} ({res.get(best, float('nan')):.3f} ms) "
                      f"rule S={rule.segments} ({res.get(rule.segments, float('nan')):.3f})  "
                      + " ".join(f"{s}:{ms:.3f}" for s, ms in res.items()), flush=True)
                del ins
                torch.cuda.empty_cache()
                _dump(a.json, meta, rows)


def variant_summary(cells: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each variant's time relative to the cell's 'default', over the cells that timed both: median, min,
    max and the number of cells (the table docs/kernels.md gives for each sweep)."""
    ratios: dict[str, list[float]] = {}
    for times in cells.values():
        base = times.get("default")
        if not base:
            continue
        for name, ms in times.items():
            if name != "default":
                ratios.setdefault(name, []).append(ms / base)
    return {name: {"median": statistics.median(r), "min": min(r), "max": max(r), "cells": len(r)}
            for name, r in ratios.items()}


PLAN_KEYS = ("tame_span", "anchor_chunks", "walk_split", "level_blocks")  # ops.testing.force_plan's settings besides launches


def parse_variants(text: str, source: str) -> dict[str, tuple[dict, dict]]:
    """`--launches` FILE's variants, 'default' first: {name: (launch overrides {kernel: {key: value}},
    plan settings)}. A variant's optional "plan" entry sets `ops.testing.force_plan`'s other settings
    (PLAN_KEYS; e.g. {"plan": {"tame_span": 120}}: GLA's tame threshold lowered). Every variant is checked
    before the first one is timed; a bad one raises ValueError naming it."""
    from ops.tuning import check_launch_overrides
    variants = {"default": (dict(), dict())}
    for name, over in json.loads(text).items():
        over = dict(over)
        plan = over.pop("plan", {})
        bad = sorted(set(plan) - set(PLAN_KEYS))
        if bad:
            raise ValueError(f"{source}: variant {name!r}: unknown plan setting(s) {bad}; "
                             f"choose from {list(PLAN_KEYS)}")
        check_launch_overrides(over, f"{source}: variant {name!r}")
        variants[name] = (over, plan)
    return variants


def launches(a) -> None:
    """Launch-config variants against the defaults, in one process: `--launches FILE` holds
    {name: {kernel: {key: value}, "plan": {setting: value}}} (`parse_variants`); every variant (and the
    defaults, as 'default') is timed per cell with the default layout. Writes {cell: {variant: ms}} and each
    variant's summary over the cells to --json, and prints the summary, fastest first."""
    from ops.testing import force_plan
    variants = parse_variants(Path(a.launches).read_text(), f"--launches {a.launches}")
    meta = _header("(launch variants)", a.timing)
    res: dict[str, dict[str, float]] = {}
    for B, H, T, op, _, ours, ins in _each_impl(a, anchor=False):
        cell = res.setdefault(f"{B}x{H} T{T} {op}", {})
        for name, (over, plan) in variants.items():
            with force_plan(launch=over, **plan):
                cell[name] = _fwd_bwd_ms(ours, [t.clone() for t in ins], a.rep, a.timing)
            print(f"| {B}x{H} | {T} | {op} | {name} | {cell[name]:.4f} | "
                  f"{cell[name] / cell['default']:.3f} |", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"meta": meta, "cells": res, "summary": variant_summary(res)},
                                               indent=1))
    summary = variant_summary(res)  # over every cell: what the last --json write holds
    print("\n| variant | cells | time / default, median | range |\n|---|---:|---:|---|")
    for name, r in sorted(summary.items(), key=lambda kv: kv[1]["median"]):
        print(f"| {name} | {r['cells']} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} |")


def warmup(a) -> None:
    """Run each op once per layout at a small T, compiling every kernel variant into the Triton cache
    (run several of these in parallel processes: the first compile is what takes long)."""
    from ops.testing import SCAN, force_plan
    for op in a.ops:
        B, H = a.shapes[0]
        mk, ours, *_ = _case(op, B, a.T[0], H)
        for sc in (SCAN, 2):
            with force_plan(seg_chunks=sc, launch=a.launch):
                ins = [t.requires_grad_(True) for t in mk()]
                ours(*ins).float().sum().backward()
        torch.cuda.synchronize()
        print(f"# warm: {op}", flush=True)


def profile(a) -> None:
    """Per-kernel CUDA time of one fwd+bwd (torch profiler, mean of 10 calls) for ours and fla, at every
    shape, T and op given: which kernels take the time, side by side with the anchor's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx
    meta = _header("(profile)")
    out = []
    for B, H, T, op, name, fn, ins in _each_impl(a):
        inputs = [t.clone().requires_grad_(True) for t in ins]
        do = torch.randn_like(fn(*inputs))
        for _ in range(3):
            torch.autograd.grad(fn(*inputs), inputs, do)
        torch.cuda.synchronize()
        n = 10
        with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                torch.autograd.grad(fn(*inputs), inputs, do)
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.self_device_time_total / n / 1e3, e.count / n)
                       for e in prof.key_averages() if e.self_device_time_total > 0), key=lambda r: -r[1])
        total = sum(ms for _, ms, _ in rows)
        print(f"## {op} {name} {B}x{H} T={T}: CUDA time per fwd+bwd (mean of {n}), "
              f"{sum(c for *_, c in rows):.0f} kernels", flush=True)
        for key, ms, cnt in rows[:18]:
            print(f"  {ms:8.4f} ms  x{cnt:4.1f}  {key[:90]}")
        print(f"  {total:8.4f} ms  total", flush=True)
        out.append({"op": op, "impl": name, "B": B, "H": H, "T": T, "total_ms": total,
                    "kernels": [{"name": k, "ms": ms, "calls": c} for k, ms, c in rows]})
        del inputs, do
        _dump(a.json, meta, out)


def resources(a) -> None:
    """Shared memory (limit 232448 bytes per block on H100/H200), registers and local-memory stack per
    thread (> 0: spills) of every kernel at its default launch config, from an ahead-of-time sm_90
    compile with this machine's Triton (the GPU image's Triton may differ a little)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import ops.triton_gla_intra as G
    import ops.triton_scan as S
    from ops import tuning
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def usage(fn, names, types, consts, c):
        sig = {**dict(zip(names.split(), types)), **{k: "constexpr" for k in consts}}
        # specialised as the launcher specialises a real call: 16-byte aligned tensors and ints divisible by
        # 16 (T and the chunk counts at the usual shapes); without it every load is scalar
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(types))}
        t0 = time.time()
        kern = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=tuning.launch_options(c))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
        return (f"smem {kern.metadata.shared:6d}  regs {reg.group(1) if reg else '?'}  "
                f"stack {stack.group(1) if stack else '?'}  ({time.time() - t0:.0f} s)")

    P, F32, I, i32 = "*bf16", "*fp32", "*i32", "i32"
    D = a.D
    for gated, K, V in [(False, D, D), (False, 2 * D, D), (True, D, D)]:
        L = tuning.default_launch("gla" if gated else "lightning", K, V, torch.device("cuda"))
        L = {name: {**c, **a.launch.get(name, {})} for name, c in L.items()}
        Kp, Vp = tuning._np2(K), tuning._np2(V)
        base = dict(H=16, K=K, V=V, BT=64, VARLEN=False)
        walk = dict(base, GATED=gated, HAS_DECAY=True, PREC="tf32")
        rows = [
            ("fwd", S.fwd_scan_kernel, "q k v g log_lam A o h0 ht Hs cu T SC SM1", [P, P, P, F32, F32, F32, P, F32, F32, F32, I, i32, i32, i32],
             dict(walk, BK=Kp, BV=L["fwd"]["block"], HAS_H0=True)),
            ("dq", S.dq_scan_kernel, "k v g log_lam do dq h0 Hs anc cu T SC SM1 AC",
             [P, P, F32, F32, P, F32, F32, F32, F32, I, i32, i32, i32, i32],
             dict(walk, BK=L["dq"]["block"], BV=Vp, HAS_H0=True, ANCHOR=gated, SPLIT=gated)),
            ("dk", S.dk_scan_kernel, "q v g log_lam do dk dht dh0 Es anc cu T SC SM1 AC",
             [P, P, F32, F32, P, F32, F32, F32, F32, F32, I, i32, i32, i32, i32],
             dict(walk, BK=L["dk"]["block"], BV=Vp, HAS_DHT=False, STORE_DH0=True, ANCHOR=gated, SPLIT=gated)),
            ("dv", S.dv_scan_kernel, "q k g log_lam A do dv dht Es cu T SC SM1", [P, P, F32, F32, F32, P, P, F32, F32, I, i32, i32, i32],
             dict(walk, BK=Kp, BV=L["dv"]["block"], HAS_DHT=True)),
            ("local", S.seg_local_kernel, "a x g log_lam slot dec cu T SC SM1", [P, P, F32, F32, F32, F32, I, i32, i32, i32],
             dict(walk, BK=min(L["local"]["block"], Kp), BV=min(L["local"]["block_v"], Vp), REVERSE=True, F32=gated)),
            ("combine", S.seg_combine_kernel, "slot dec init cu T SC SM1", [F32, F32, F32, I, i32, i32, i32],
             dict(base, BK=min(L["combine"]["block"], Kp), BV=min(L["combine"]["block_v"], Vp), REVERSE=True, HAS_INIT=True)),
        ]
        if gated:
            rows += [
                ("cumsum", G.gla_cumsum_kernel, "g bc tame cu chunks T NT", [F32, F32, I, I, I, i32, i32],
                 dict(H=16, K=K, BT=64, BK=Kp, TAME_SPAN=G.TAME_SPAN, MAX_LB=3 if a.level_blocks else 0,
                      VARLEN=False)),
                ("A", G.gla_A_tame_kernel, "q k bc A tame cu chunks T NT", [P, P, F32, F32, I, I, I, i32, i32],
                 dict(TAME_SPAN=G.TAME_SPAN, H=16, K=K, BT=64, BK=L["A"]["block"], VARLEN=False, PREC="tf32")),
                ("A_sub", G.gla_A_sub_kernel, "q k bc A tame cu chunks T NT", [P, P, F32, F32, I, I, I, i32, i32],
                 dict(H=16, K=K, BT=64, BK=L["A_sub"]["block"], LOG_BT=6, BLOCKS=a.level_blocks,
                      TAME_SPAN=G.TAME_SPAN, VARLEN=False, PREC="tf32")),
                ("dqk_sub", G.gla_dqk_sub_kernel, "q k v bc do dq dk att tame cu chunks T NT",
                 [P, P, P, F32, P, F32, F32, F32, I, I, I, i32, i32],
                 dict(base, BK=L["dqk_sub"]["block"], BV=min(64, Vp), LOG_BT=6, BLOCKS=a.level_blocks,
                      TAME_SPAN=G.TAME_SPAN, PREC="tf32",
                      KEY_BLOCKS=tuning.key_blocks(L["dqk_sub"], K))),
                ("dqk", G.gla_dqk_tame_kernel, "q k v bc do dq dk att tame cu chunks T NT",
                 [P, P, P, F32, P, F32, F32, F32, I, I, I, i32, i32],
                 dict(base, TAME_SPAN=G.TAME_SPAN, BK=L["dqk"]["block"], BV=Vp, PREC="tf32")),
                ("intra_out", G.gla_intra_out_kernel, "A x out cu chunks T NT", [F32, P, F32, I, I, i32, i32],
                 dict(H=16, V=V, BT=64, BV=min(64, Vp), TRANSPOSED=True, VARLEN=False, PREC="tf32")),
                ("dg", G.gla_dg_kernel, "q k att dq dk dg dgx dkx dq_out dk_out anc_h anc_dh cu chunks T AC NA",
                 [P, P, F32, F32, F32, F32, F32, F32, P, P, F32, F32, I, I, i32, i32, i32],
                 dict(base, BK=L["dg"]["block"], BV=Vp, HAS_DS=False, ANCHOR=True)),
            ]
        for name, fn, names, types, consts in rows:
            c = L.get(name, {"num_warps": 4, "num_stages": 1})
            try:
                res = usage(fn, names, types, consts, c)
            except Exception as e:  # out of resources etc.
                res = f"failed: {type(e).__name__}: {str(e)[:160]}"
            print(f"{'gla' if gated else 'lightning'} K={K} V={V} {name:7s} {c}  {res}", flush=True)


def _shape(s: str) -> tuple[int, int]:
    """'BxH', sequences by heads, both >= 1."""
    try:
        b, h = (int(x) for x in s.lower().split("x"))
    except ValueError:
        b = h = 0
    if min(b, h) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: give batch x heads as BxH with both >= 1, e.g. 2x12")
    return b, h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--matrix", action="store_true", help="the benchmark matrix with fla and SDPA anchors")
    mode.add_argument("--sweep", action="store_true", help="time every candidate layout of ours per cell")
    mode.add_argument("--warmup", action="store_true", help="compile every kernel variant (both layouts), time nothing")
    mode.add_argument("--profile", action="store_true", help="per-kernel CUDA time of ours and fla per shape, T and op")
    mode.add_argument("--resources", action="store_true", help="sm_90 compile of every kernel (no GPU needed)")
    mode.add_argument("--host", action="store_true", help="host (CPU) time per fwd+bwd: launches, Python profile")
    mode.add_argument("--launches", default=None, metavar="FILE",
                    help="time the launch-config variants of this JSON file {name: {kernel: {key: value}}} "
                         "against the defaults, per cell, in one process (ours only)")
    mode.add_argument("--report", nargs="+", default=None, metavar="FILE",
                      help="print --matrix JSON files as one table with fla / ours per op (no GPU needed)")
    ap.add_argument("--shapes", type=_shape, nargs="+", default=SHAPES, metavar="BxH")
    ap.add_argument("--T", type=positive_int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    ap.add_argument("--skip", nargs="*", default=[], choices=["fla", "sdpa"], help="fla and/or sdpa: leave those anchors out")
    ap.add_argument("--rep", type=positive_int, default=60, help="do_bench time budget per measurement, ms")
    ap.add_argument("--max-segments", type=positive_int, default=32, help="--sweep: largest segment count tried")
    ap.add_argument("--launch", type=json.loads, default={}, help="--sweep/--warmup/--resources: launch overrides, JSON "
                    "{kernel: {key: value}} (through the test-only seam ops.testing.force_plan)")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after every cell)")
    ap.add_argument("--resume", default=None, help="--matrix: an earlier --json file; its cells are kept, not re-run")
    ap.add_argument("--D", type=positive_int, default=128, help="--resources: head width")
    ap.add_argument("--level-blocks", action="store_true",
                    help="--resources: GLA's level kernels with the block products (ops.triton_linear_attn.LEVEL_BLOCKS)")
    ap.add_argument("--timing", choices=["wall", "gpu"], default="wall",
                    help="--matrix/--sweep: wall time per call (do_bench: the larger of the host's and the "
                         "GPU's time), or the GPU's time alone with the host's launch work hidden (as in a "
                         "training step, where the host runs ahead)")
    a = ap.parse_args()
    if a.launch:
        from ops.tuning import check_launch_overrides
        check_launch_overrides(a.launch, "--launch")
    if a.resources:
        return resources(a)
    if a.report:
        return report(a.report)
    if not torch.cuda.is_available():
        from pretrain.errors import UserError
        raise UserError("bench_kernels needs a CUDA device (only --resources and --report run without one)")
    # fla's kernels autotune on first use (minutes a process); with Triton's on-disk autotuning cache a
    # later process on the same machine reuses the configs fla chose, instead of timing them again
    os.environ.setdefault(AUTOTUNE_CACHE, "1")
    if a.sweep:
        return sweep(a)
    if a.warmup:
        return warmup(a)
    if a.profile:
        return profile(a)
    if a.host:
        return host(a)
    if a.launches:
        return launches(a)
    return matrix(a)


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(lambda argv: main()))

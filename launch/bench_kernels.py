"""Benchmark the linear-attention kernels against their anchors in one run (CUDA only).

    python launch/bench_kernels.py [--T 2048 8192 32768] [--B 4] [--H 16] [--D 128]
                                   [--ops la gla gla-subchunk nodecay sdpa] [--skip NAME ...] [--profile]
    python launch/bench_kernels.py --resources [--D 128]   # no GPU needed: sm_90 compile of the scans

Medians of triton.testing.do_bench for forward, backward and forward+backward, bf16, with achieved
TFLOP/s, GB/s and the floor max(bytes / bandwidth, FLOPs / matmul rate). Anchors: fla
`chunk_lightning_attn` (TNL-style g_gamma decay), `chunk_gla`, `chunk_linear_attn(normalize=False)`
and torch SDPA causal; a missing fla is reported, not fatal. FLOPs count the chunked algorithm's
tensor-core work (full 64x64 intra tiles; backward = 2 x forward); bytes count each input read once and
each output written once.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops import gated_linear_attn, lightning_attn  # noqa: E402

# measured rates (docs/benchmarks.md, ../shared/ENVIRONMENT.md): bf16 dense matmul, device copy
PEAKS = {"H200": (700e12, 4.2e12), "H100": (650e12, 3.0e12)}
C = 64


def _peaks() -> tuple[float, float]:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAKS.items() if k in name), PEAKS["H100"])


def _cases(op: str, B: int, T: int, H: int, D: int):
    """(label, make_inputs, ours, anchors {name: fn}, flops_fwd, bytes_fwd, bytes_bwd)."""
    dev, bf = "cuda", torch.bfloat16
    Dk = 2 * D if op == "nodecay" else D
    Dv = D

    def rnd(*s):
        return (torch.randn(*s, device=dev) * 0.5).to(bf).requires_grad_(True)

    el = B * T * H
    if op == "sdpa":
        mk = lambda: [rnd(B, H, T, D) for _ in range(3)]  # noqa: E731
        ours = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        flops = 4 * B * H * T * T * D / 2
        return "sdpa causal", mk, ours, {}, flops, 2 * 4 * el * D, 2 * 8 * el * D
    flops = 2 * el * (C * Dk + C * Dv + 2 * Dk * Dv)
    io_f = 2 * el * (2 * Dk + 2 * Dv)
    io_b = 2 * el * (4 * Dk + 3 * Dv)
    try:
        import fla.ops as fo
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"# fla not importable ({e}); anchors skipped")
        fo = None
    if op == "la":
        from models.tnl import tnl_decays
        decay = torch.tensor(tnl_decays(H, 0, 24), device=dev)
        mk = lambda: [rnd(B, T, H, Dk), rnd(B, T, H, Dk), rnd(B, T, H, Dv)]  # noqa: E731
        ours = lambda q, k, v: lightning_attn(q, k, v, decay, check_values=False)  # noqa: E731
        anchors = {} if fo is None else {
            "fla chunk_lightning_attn": lambda q, k, v: fo.chunk_lightning_attn(q, k, v, layer_idx=0, num_layers=24,
                                                                                scale=1.0)[0]}
        return "lightning_attn (TNL decay)", mk, ours, anchors, flops, io_f, io_b
    if op == "nodecay":
        mk = lambda: [rnd(B, T, H, Dk), rnd(B, T, H, Dk), rnd(B, T, H, Dv)]  # noqa: E731
        ours = lambda q, k, v: lightning_attn(q, k, v, None, check_values=False)  # noqa: E731
        anchors = {} if fo is None else {
            "fla chunk_linear_attn": lambda q, k, v: fo.chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]}
        return f"lightning_attn no decay (cos2, Dk={Dk})", mk, ours, anchors, flops, io_f, io_b
    # gla: log forget gates as HGRN2 makes them (almost every chunk tame). gla-subchunk: the same inputs
    # with no chunk marked tame, i.e. the speed of the path that gates near 0 take
    def mk():
        q, k, v = rnd(B, T, H, D), rnd(B, T, H, D), rnd(B, T, H, D)
        g = F.logsigmoid(torch.randn(B, T, H, D, device=dev) * 2 + 3).requires_grad_(True)
        return [q, k, v, g]
    ours = lambda q, k, v, g: gated_linear_attn(q, k, v, g, check_values=False)  # noqa: E731
    if op == "gla-subchunk":
        import ops.triton_linear_attn as TL

        def ours(q, k, v, g):  # noqa: F811
            old, TL.TAME = TL.TAME, -1.0
            try:
                return gated_linear_attn(q, k, v, g, check_values=False)
            finally:
                TL.TAME = old
        return "gated_linear_attn, sub-chunk path", mk, ours, {}, flops, io_f + 4 * el * D, io_b + 8 * el * D
    anchors = {} if fo is None else {
        "fla chunk_gla": lambda q, k, v, g: fo.chunk_gla(q, k, v, g, scale=1.0)[0]}
    return "gated_linear_attn (HGRN2)", mk, ours, anchors, flops, io_f + 4 * el * D, io_b + 8 * el * D


def _time(fn, inputs) -> dict[str, float]:
    from triton.testing import do_bench
    def fwd():
        return fn(*inputs)
    out = fwd()
    do = torch.randn_like(out)

    def bwd_only():
        out.backward(do, retain_graph=True)

    def fwd_bwd():
        fn(*inputs).backward(do)
    res = {"fwd": do_bench(fwd, return_mode="median"),
           "bwd": do_bench(bwd_only, return_mode="median", grad_to_none=inputs),
           "fwd+bwd": do_bench(fwd_bwd, return_mode="median", grad_to_none=inputs)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--ops", nargs="+", default=["la", "gla", "nodecay", "sdpa"])
    ap.add_argument("--skip", nargs="*", default=[], help="skip anchors whose name contains one of these "
                    "(fla chunk_gla autotunes for minutes on first use)")
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA times of ours (fwd+bwd) at the "
                    "first T instead of the table")
    ap.add_argument("--warmup-only", action="store_true", help="run each case once (JIT-compile into the "
                    "Triton cache, e.g. several configs in parallel processes) and time nothing")
    ap.add_argument("--resources", action="store_true", help="compile the scan kernels for sm_90 on this "
                    "machine (no GPU needed) and print shared memory, registers and spill stack per thread")
    a = ap.parse_args()
    if a.resources:
        return _resources(a.D)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA device")
    mm, bw = _peaks()
    import triton
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{datetime.date.today()}  B={a.B} H={a.H} D={a.D} bf16; floor uses {mm / 1e12:.0f} TFLOP/s, "
          f"{bw / 1e12:.1f} TB/s")
    import ops.triton_linear_attn as TL
    print(f"# launch overrides (LINSCALE_TUNE): {TL.TUNE or 'none'}")
    if a.profile:
        return _profile(a)
    print("| op | T | impl | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd GB/s | floor ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in a.T:
        for op in a.ops:
            label, mk, ours, anchors, flops, io_f, io_b = _cases(op, a.B, T, a.H, a.D)
            flops_fb = 3 * flops if op != "sdpa" else 3.5 * flops
            floor = max((io_f + io_b) / bw, flops_fb / mm) * 1e3
            anchors = {n: f for n, f in anchors.items() if not any(s in n for s in a.skip)}
            for name, fn in [("ours" if op != "sdpa" else "torch sdpa", ours), *anchors.items()]:
                if a.warmup_only:
                    ins = mk()
                    fn(*ins).float().sum().backward()
                    torch.cuda.synchronize()
                    continue
                try:
                    r = _time(fn, mk())
                except Exception as e:  # an anchor failing must not hide our numbers
                    print(f"| {label} | {T} | {name} | failed: {type(e).__name__}: {str(e)[:80]} |||||")
                    continue
                fb = r["fwd+bwd"] / 1e3
                print(f"| {label} | {T} | {name} | {r['fwd']:.3f} | {r['bwd']:.3f} | {r['fwd+bwd']:.3f} | "
                      f"{flops_fb / fb / 1e12:.0f} | {(io_f + io_b) / fb / 1e9:.0f} | {floor:.3f} |", flush=True)
            torch.cuda.empty_cache()


def _resources(D: int) -> None:
    """Shared memory (limit 232448 bytes per block on H100/H200), registers and local-memory stack per
    thread (> 0: spills) of each scan kernel at its launch config, from an ahead-of-time sm_90 compile
    with this machine's Triton (the GPU image's Triton may differ a little)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import ops.triton_linear_attn as TL
    import ops.triton_scan as S
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def usage(fn, args, consts, c):
        sig = {**dict(args), **{k: "constexpr" for k in consts}}
        kern = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
        return f"smem {kern.metadata.shared:6d}  regs {reg.group(1) if reg else '?'}  stack {stack.group(1) if stack else '?'}"

    P, F, I = "*bf16", "*fp32", "*i32"
    for gated, K, V in [(False, D, D), (False, 2 * D, D), (True, D, D)]:
        base = dict(H=16, K=K, V=V, BT=64, GATED=gated, HAS_DECAY=True, VARLEN=False, PREC="tf32")
        Kp, Vp = TL._np2(K), TL._np2(V)
        rows = [("fwd", S.fwd_scan_kernel, "q k v g log_lam A o h0 ht cu T", [P, P, P, F, F, F, P, F, F, I, "i32"],
                 lambda c: dict(BK=Kp, BV=c["block"], HAS_H0=True)),
                ("dq", S.dq_scan_kernel, "k v g log_lam do dq h0 cu T", [P, P, F, F, P, F, F, I, "i32"],
                 lambda c: dict(BK=c["block"], BV=Vp, HAS_H0=True)),
                ("dk", S.dk_scan_kernel, "q v g log_lam do dk dht dh0 cu T", [P, P, F, F, P, F, F, F, I, "i32"],
                 lambda c: dict(BK=c["block"], BV=Vp, HAS_DHT=False, STORE_DH0=True)),
                ("dv", S.dv_scan_kernel, "q k g log_lam A do dv dht cu T", [P, P, F, F, F, P, P, F, I, "i32"],
                 lambda c: dict(BK=Kp, BV=c["block"], HAS_DHT=True))]
        for name, fn, names, types, extra in rows:
            c = TL._cfg(name, K, V, gated)
            try:
                res = usage(fn, zip(names.split(), types), {**base, **extra(c)}, c)
            except Exception as e:  # out of resources etc.
                res = f"failed: {type(e).__name__}: {str(e)[:120]}"
            print(f"{'gla' if gated else 'lightning'} K={K} V={V} {name:3s} {c}  {res}", flush=True)


def _profile(a) -> None:
    from torch.profiler import ProfilerActivity, profile
    for op in a.ops:
        label, mk, ours, *_ = _cases(op, a.B, a.T[0], a.H, a.D)
        inputs = mk()
        out = ours(*inputs)
        do = torch.randn_like(out)
        for _ in range(3):  # compile and warm up
            ours(*inputs).backward(do)
        torch.cuda.synchronize()
        n = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                ours(*inputs).backward(do)
            torch.cuda.synchronize()
        print(f"## {label}, T={a.T[0]}: CUDA time per fwd+bwd (mean of {n})")
        rows = sorted(((e.key, e.self_device_time_total / n / 1e3) for e in prof.key_averages()), key=lambda r: -r[1])
        for key, ms in rows[:14]:
            print(f"  {ms:8.3f} ms  {key[:90]}")
        print(f"  {sum(ms for _, ms in rows):8.3f} ms  total", flush=True)


if __name__ == "__main__":
    main()

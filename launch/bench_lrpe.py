"""cosFormer2's feature map phi(silu(.)) for q and k: the fused Triton op against what Inductor makes of it.

    python launch/bench_lrpe.py [--json lrpe.json]
    python launch/bench_lrpe.py --sweep     # the launch configurations (ops.triton_lrpe.FWD/BWD_LAUNCH)

Per shape (batch x tokens x heads x head width, bf16, forward + backward), in one process:
- ours: `ops.silu_lrpe`, the Triton kernel (`ops.triton_lrpe`);
- inductor: the plain-PyTorch twin `ops.lrpe.silu_lrpe_reference` under torch.compile, which is what a
  compiled cosFormer2 block runs without the kernel;
- the floor: the bytes the op must move (read x, write 2 x; read 2 x of gradients and x, write dx: 28
  bytes a token and channel for q and k together) at the GPU's measured copy bandwidth.
Times are GPU time (`ops.tuning.gpu_ms`: the host's launches hidden, as a training step sees them),
medians of 5 batches.

`--sweep` times the forward and the backward kernel alone under every candidate launch configuration
(tokens per program, largest channel block, warps) at 1B's 2 x 8192 tokens, then the six best of those at
1 x 32768, and prints the best of each kernel by the geometric mean over both shapes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (batch, tokens, heads, head width): 1B at 2K / 8K / 32K / 64K tokens a sequence, 410M, 7B
SHAPES = [(16, 2048, 12, 128), (2, 8192, 12, 128), (1, 32768, 12, 128), (1, 65536, 12, 128),
          (4, 8192, 8, 128), (1, 8192, 32, 128), (2, 8192, 32, 128)]


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    import torch

    from ops.tuning import gpu_ms
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (gpu_ms(lambda: y.copy_(x), reps=5) / 1e3)


def measure(B: int, T: int, H: int, e: int, bandwidth: float) -> dict:
    import torch

    from ops.lrpe import silu_lrpe, silu_lrpe_reference
    from ops.tuning import gpu_ms
    d = H * e
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    k = torch.randn(B, T, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    theta = (10000.0 ** (-torch.arange(e, device="cuda") / e)).repeat(H, 1).requires_grad_(True)
    t = torch.arange(T, device="cuda")
    gout = torch.randn(B, T, H, 2 * e, device="cuda", generator=g).to(torch.bfloat16)
    compiled = torch.compile(silu_lrpe_reference, fullgraph=True)

    def step(fn):
        def run():
            oq, ok = fn(q, k, theta, t)
            torch.autograd.backward([oq, ok], [gout, gout])
            q.grad = k.grad = theta.grad = None
        return run
    row = {"B": B, "T": T, "H": H, "e": e}
    row["ours_ms"] = gpu_ms(step(silu_lrpe), reps=5, budget_ms=50)
    row["inductor_ms"] = gpu_ms(step(compiled), reps=5, budget_ms=50)
    row["floor_ms"] = 28 * B * T * d / bandwidth * 1e3
    return row


SWEEP = [(64, 64, 4)] + [(bt, bc, w) for bt in (8, 16, 32) for bc in (64, 128) for w in (2, 4, 8)]


def sweep() -> dict:
    """{config: {shape: (fwd ms, bwd ms)}} over `SWEEP`, and the best config of each kernel."""
    import math

    import torch

    import ops.triton_lrpe as K
    from ops.tuning import gpu_ms
    kept = (K.FWD_LAUNCH, K.BWD_LAUNCH)
    data: dict = {}
    cfgs = SWEEP
    shapes = [(2, 8192, 12, 128), (1, 32768, 12, 128)]
    try:
        for B, T, H, e in shapes:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, T, H * e, device="cuda", generator=g).to(torch.bfloat16)
            k = torch.randn_like(q)
            theta = (10000.0 ** (-torch.arange(e, device="cuda") / e)).repeat(H, 1)
            t = torch.arange(T, device="cuda")
            gout = torch.randn(B, T, H, 2 * e, device="cuda", generator=g).to(torch.bfloat16)
            for cfg in cfgs:
                K.FWD_LAUNCH = K.BWD_LAUNCH = cfg
                fwd = gpu_ms(lambda: K._silu_lrpe_fwd(q, k, theta, t), reps=3, budget_ms=20)
                bwd = gpu_ms(lambda: K._silu_lrpe_bwd(q, k, theta, t, gout, gout), reps=3, budget_ms=20)
                data.setdefault(cfg, {})[f"{B}x{T}"] = (fwd, bwd)
                print(f"{B} x {T} x {H} x {e}  {cfg}  fwd {fwd:.4f} ms  bwd {bwd:.4f} ms", flush=True)
            cfgs = sorted(cfgs, key=lambda c: sum(data[c][f"{B}x{T}"]))[:6]
    finally:
        K.FWD_LAUNCH, K.BWD_LAUNCH = kept
    best = {}
    for i, name in ((0, "fwd"), (1, "bwd")):
        score = {c: math.exp(sum(math.log(v[i]) for v in r.values()) / len(r))
                 for c, r in data.items() if len(r) == len(shapes)}
        best[name] = min(score, key=score.get)
        print(f"best {name}: {best[name]} (geometric mean {score[best[name]]:.4f} ms)")
    return {"configs": {str(c): r for c, r in data.items()}, "best": {k: list(v) for k, v in best.items()}}


def main(argv: list[str] | None = None) -> int:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--sweep", action="store_true", help="time the candidate launch configurations instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        from pretrain.errors import UserError
        raise UserError("bench_lrpe needs a CUDA GPU (it times GPU kernels)")
    if args.sweep:
        res = sweep()
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return 0
    bw = copy_bandwidth()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "dtype": "bf16", "copy_bandwidth": bw}
    print(f"{meta['device']}, torch {meta['torch']}, {meta['date']}, bf16 fwd+bwd GPU-time medians; "
          f"floor at the measured copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| B x T x H x e | ours ms | inductor ms | inductor / ours | floor ms | floor / ours |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for B, T, H, e in SHAPES:
        r = measure(B, T, H, e, bw)
        rows.append(r)
        print(f"| {B} x {T} x {H} x {e} | {r['ours_ms']:.3f} | {r['inductor_ms']:.3f} | "
              f"{r['inductor_ms'] / r['ours_ms']:.2f} | {r['floor_ms']:.3f} | {r['floor_ms'] / r['ours_ms']:.2f} |",
              flush=True)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(main))

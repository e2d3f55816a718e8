"""One compiled block of a model, forward and backward: its time and its kernels.

    python launch/bench_block.py --arch cos2 --size 1b --batch 2 --seq 8192

Builds block `--layer` of the model (`models.lm.Block`, compiled as `TorchTrainModule.compile` compiles it,
bf16 autocast on fp32 weights), runs forward and backward on random input `--repeat` times after a few
warm-up calls, and prints the median and minimum time (CUDA events) and the kernels of three profiled
calls (device time per call, calls per block). Where `launch/bench_train.py` profiles a whole training
step, this isolates the per-block work, so that two formulations of a block's elementwise parts can be
compared in one process (import the module, patch the method, call `measure` again).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def layer_kwargs(arch: str, cfg, layer: int, device) -> dict:
    """The per-layer inputs the language model hands this block (TNL's decays, HGRN2's lower bound)."""
    from models import get_arch
    kwargs: dict = {}
    for name, build in get_arch(arch).extras.items():
        extra = build(cfg).to(device)
        inputs = extra.layer_inputs(cfg.n_layers, device) if hasattr(extra, "layer_inputs") else None
        if inputs:
            kwargs.update({k: v.detach().requires_grad_(v.requires_grad) for k, v in inputs[layer].items()})
    return kwargs


def measure(arch: str, size: str, batch: int, seq: int, layer: int = 1, repeat: int = 25, top: int = 15) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from models import model_config
    from models.lm import Block
    from pretrain.train_module import allow_data_dependent_outputs

    dev = torch.device("cuda")
    allow_data_dependent_outputs()
    torch._dynamo.reset()
    cfg = model_config(arch, size)
    torch.manual_seed(0)
    block = Block(cfg, layer).to(dev)
    block.compile()
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(batch, seq, cfg.d_model, device=dev, generator=g).requires_grad_()
    grad = torch.randn(batch, seq, cfg.d_model, device=dev, generator=g)

    def call() -> None:
        kwargs = layer_kwargs(arch, cfg, layer, dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block(x, **kwargs)
        y.backward(grad)

    t0 = time.time()
    call()
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    for _ in range(3):
        call()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0)
        if us > 0 and not e.key.startswith(("aten::", "linscale::", "autograd::", "Command Buffer Full")):
            k = kernels.setdefault(e.key, [0.0, 0.0])
            k[0] += us / 3e3
            k[1] += e.count / 3
    return {"arch": arch, "size": size, "batch": batch, "seq": seq, "device": torch.cuda.get_device_name(dev),
            "median_ms": statistics.median(times), "min_ms": min(times), "compile_s": compile_s,
            "kernel_ms": sum(v[0] for v in kernels.values()),
            "kernels": [{"name": k, "ms": v[0], "calls": v[1]} for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]}


def _main(argv: list[str] | None = None) -> int:
    from models import model_config
    from pretrain.argtypes import positive_int, ranged
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="tnl")
    p.add_argument("--size", default="1b")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences (>= 1)")
    p.add_argument("--seq", type=positive_int, default=8192, help="tokens per sequence (>= 1)")
    p.add_argument("--layer", type=ranged(int, ge=0), default=1, help="which block (its per-layer inputs)")
    p.add_argument("--repeat", type=positive_int, default=25, help="timed calls (>= 1)")
    args = p.parse_args(argv)
    n_layers = model_config(args.arch, args.size).n_layers  # an unknown size ends in one error line here
    if args.layer >= n_layers:
        p.error(f"--layer {args.layer}: {args.arch} {args.size} has blocks 0..{n_layers - 1}")
    import torch
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it times compiled GPU kernels)")
    r = measure(args.arch, args.size, args.batch, args.seq, args.layer, args.repeat)
    print(f"{r['arch']} {r['size']} block, {r['batch']} x {r['seq']} tokens, {r['device']}: forward + backward "
          f"median {r['median_ms']:.3f} ms (min {r['min_ms']:.3f}), kernels {r['kernel_ms']:.3f} ms, "
          f"first call {r['compile_s']:.1f} s")
    for k in r["kernels"]:
        print(f"  {k['ms']:7.3f} ms  x{k['calls']:4.1f}  {k['name'][:110]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    from pretrain.errors import run_cli
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""One compiled block of a model, forward and backward: its time and its kernels.

    python launch/bench_block.py --arch cos2 --size 1b --batch 2 --seq 8192

Builds block `--layer` of the model (`models.lm.Block`, compiled as `TorchTrainModule.compile` compiles it,
bf16 autocast on fp32 weights), runs forward and backward on random input `--repeat` times after a few
warm-up calls, and prints the median and minimum time (CUDA events) and the kernels of three profiled
calls (device time per call, calls per block). Where `launch/bench_train.py` profiles a whole training
step, this isolates the per-block work, so that two formulations of a block's elementwise parts can be
compared in one process (import the module, patch the method, call `measure` again).

    python launch/bench_block.py --arch tnl --size 1b --kept      # the activations it keeps, per token

`--kept` instead counts the activations the compiled block keeps for its backward (saved-tensor hooks,
each storage once) at `--seq` and at half of it, and prints the difference per token: the bytes a block
adds to the peak for each token of a micro-batch, in bytes per d (the unit of an architecture's
`act_bytes_per_d` in `pretrain/memory.py`), and lists the tensors kept at `--seq` that the shorter run did
not keep (shape by shape), each in bytes per d per token of `--seq`. Weights and per-layer tables
do not grow with the tokens and drop out of the difference. It runs on CPU too, where Inductor's CPU
code may keep another set than the GPU's and the linear-attention ops run their PyTorch twins, which
keep per-chunk tensors the Triton kernels do not.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

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


class _Saved:
    """What the pack hook hands autograd for a saved tensor: a holder autograd keeps as long as the graph
    node that saved it, so a weak reference to it tells a tensor kept for the backward from one whose node
    was freed in the forward already (a branch whose output was dropped)."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t) -> None:
        self.t = t


def saved_storages(call: Callable[[], Any]) -> tuple[Any, dict[int, tuple[tuple, Any, int]]]:
    """Run `call` and record every tensor autograd keeps for the backward of what it builds, once per
    storage: {storage address: (shape, dtype, storage bytes)}. Returns call's result with the records (the
    saved tensors live as long as that result's graph). Tensors saved by a node freed before `call` returns
    are left out: they are not kept, and their memory may be handed to a later tensor at the same address,
    which would then be counted under the freed one's record."""
    import weakref

    import torch
    saved: list = []

    def pack(t):
        # detached (the same storage): a saved output held with its grad_fn would form a cycle through its
        # own node, which outlives the dropped graph until the garbage collector runs
        holder = _Saved(t.detach())
        st = t.untyped_storage()
        saved.append((weakref.ref(holder), st.data_ptr(), tuple(t.shape), t.dtype, st.nbytes()))
        return holder
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        out = call()
    seen: dict[int, tuple[tuple, Any, int]] = {}
    for ref, ptr, shape, dtype, nbytes in saved:
        if ref() is not None:
            seen.setdefault(ptr, (shape, dtype, nbytes))
    return out, seen


def kept_per_token(arch: str, size: str, batch: int, seq: int, layer: int = 1, device: str = "cuda",
                   compile: bool = True) -> dict:
    """Activation bytes block `layer` keeps for its backward per token (bf16 autocast on fp32 weights, as
    in training): the saved storages at `seq` less those at `seq // 2`, over the tokens between."""
    import torch

    from models import model_config
    from models.lm import Block
    from pretrain.train_module import allow_data_dependent_outputs

    dev = torch.device(device)
    allow_data_dependent_outputs()
    cfg = model_config(arch, size)
    torch.manual_seed(0)
    block = Block(cfg, layer).to(dev)
    if compile:
        block.compile()
    lengths = (max(1, seq // 2), seq)
    if lengths[0] == lengths[1]:
        raise ValueError(f"--seq {seq}: needs at least 2 tokens (it compares {seq} with half of it)")
    totals, runs = [], []
    for t in lengths:
        torch._dynamo.reset()  # a graph of its own for each length, static as in training (one shape a run)
        x = torch.randn(batch, t, cfg.d_model, device=dev).requires_grad_()
        kwargs = layer_kwargs(arch, cfg, layer, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y, kept = saved_storages(lambda: block(x, **kwargs))
        totals.append(sum(nbytes for _, _, nbytes in kept.values()))
        runs.append(list(kept.values()))
        del y
    per_token = (totals[1] - totals[0]) / (batch * (lengths[1] - lengths[0]))
    # listed: what the longer run keeps beyond the shorter one's, shape by shape (weights and tables are
    # in both and drop out, as they do from the difference; per-chunk tensors are listed by their extra copies)
    spare = Counter((shape, dtype) for shape, dtype, _ in runs[0])
    tensors = []
    for shape, dtype, nbytes in sorted(runs[1], key=lambda r: -r[2]):
        if spare[(shape, dtype)] > 0:
            spare[(shape, dtype)] -= 1
            continue
        tensors.append({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                        "bytes_per_d": nbytes / (batch * seq) / cfg.d_model})
    return {"arch": arch, "size": size, "batch": batch, "seq": seq, "d_model": cfg.d_model, "device": str(dev),
            "compiled": compile, "bytes_per_token": per_token, "bytes_per_d": per_token / cfg.d_model,
            "tensors": [r for r in tensors if r["bytes_per_d"] >= 0.01]}


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
    p.add_argument("--kept", action="store_true",
                   help="count the activations the block keeps per token instead of timing it (CPU too)")
    args = p.parse_args(argv)
    n_layers = model_config(args.arch, args.size).n_layers  # an unknown size ends in one error line here
    if args.layer >= n_layers:
        p.error(f"--layer {args.layer}: {args.arch} {args.size} has blocks 0..{n_layers - 1}")
    import torch
    if args.kept:
        r = kept_per_token(args.arch, args.size, args.batch, args.seq, args.layer,
                           "cuda" if torch.cuda.is_available() else "cpu")
        head = (f"{r['arch']} {r['size']} block {args.layer}, compiled, bf16 autocast, {r['device']}: keeps "
                f"{r['bytes_per_token']:,.0f} bytes a token = {r['bytes_per_d']:.1f} bytes per d (d = {r['d_model']}); "
                f"at {r['batch']} x {r['seq']} tokens:")
        rows = [f"{t['bytes_per_d']:6.2f} bytes per d  {t['dtype']:9s} {t['shape']}" for t in r["tensors"]]
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (it times compiled GPU kernels; --kept runs on CPU too)")
        r = measure(args.arch, args.size, args.batch, args.seq, args.layer, args.repeat)
        head = (f"{r['arch']} {r['size']} block, {r['batch']} x {r['seq']} tokens, {r['device']}: forward + backward "
                f"median {r['median_ms']:.3f} ms (min {r['min_ms']:.3f}), kernels {r['kernel_ms']:.3f} ms, "
                f"first call {r['compile_s']:.1f} s")
        rows = [f"{k['ms']:7.3f} ms  x{k['calls']:4.1f}  {k['name'][:110]}" for k in r["kernels"]]
    print("\n  ".join([head, *rows]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    from pretrain.errors import run_cli
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

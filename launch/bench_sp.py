"""Sequence-parallel throughput and overhead (`--sp`), one launch per configuration.

    # training step of a model, each sequence split over all ranks (or --sp of them), random tokens:
    torchrun --nproc_per_node 8 launch/bench_sp.py train --arch tnl --size 1b --seq 524288 --out bench/sp
    # one linear-attention layer: the op on its segment with the state exchange, against the same op on the
    # segment alone (the exchange's cost) and on the whole sequence in one process:
    torchrun --nproc_per_node 2 launch/bench_sp.py op --op lightning --seq 8192 --heads 16 --dim 128 --out bench/sp
    python launch/bench_sp.py report bench/sp          # the tables of what is measured so far

`train` runs `pretrain.train_module.TorchTrainModule` (DDP over all ranks, bf16 autocast on CUDA, AdamW,
clipping) with the plan of `pretrain.sequence_parallel`, and reports the median step time, tokens/s and
tokens/s per device. Without a process group (plain `python`) it runs the same model unsplit: the
single-device anchor. Each launch writes `<out>/<mode>-<name>.json` on rank 0 (device, dtype, date, shape).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pretrain.argtypes import non_negative_int, positive_int  # noqa: E402
from pretrain.process_exit import exit_process  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _setup() -> tuple[int, int, torch.device]:
    from pretrain.distributed import dist_env, init_process_group
    env = dist_env("auto")
    init_process_group(env)
    return env.rank, env.world_size, env.device


def _timed(fn, device, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if dist.is_initialized():  # the slowest rank sets the pace
        # NCCL reduces device tensors only
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t = t.cpu()
        times = t.tolist()
    return times


def _write(out: str, name: str, row: dict) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"{name}.json"
    path.write_text(json.dumps(row, indent=2))
    print(json.dumps(row), flush=True)


def _meta(device: torch.device, world: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return {"device": name, "ranks": world, "date": dt.date.today().isoformat(), "torch": torch.__version__}


def bench_train(a) -> None:
    from models import build_model
    from pretrain.config import OptimConfig
    from pretrain.train_module import TorchTrainModule
    rank, world, device = _setup()
    sp_size = a.sp or world
    torch.manual_seed(0)
    model = build_model(a.arch, a.size, **({"vocab_size": a.vocab} if a.vocab else {}))
    model.set_activation_checkpointing(a.ac)
    sp, dp_rank, dp = None, 0, 1
    if world > 1:
        from pretrain.sequence_parallel import SequenceParallelPlan, build_groups
        sp, dp_rank, dp = build_groups(sp_size)
        if sp.size > 1:
            SequenceParallelPlan(model, sp, equal_segments=True)  # every rank a seq / sp segment, as the trainer splits
    precision = "bf16" if device.type == "cuda" else "fp32"
    module = TorchTrainModule(model, OptimConfig(warmup_steps=0), device, precision, ddp=world > 1)
    if a.compile:
        module.compile()
    g = torch.Generator().manual_seed(dp_rank)
    ids = torch.randint(0, model.config.vocab_size, (a.micro_batch, a.seq + 1), generator=g)
    seg = a.seq // (sp.size if sp is not None else 1)
    lo = (sp.rank if sp is not None else 0) * seg
    batch = {"input_ids": ids[:, lo:lo + seg].contiguous(), "targets": ids[:, lo + 1:lo + seg + 1].contiguous()}
    step = [0]

    def one():
        module.train_step([batch], step[0])
        step[0] += 1
    times = _timed(one, device, a.warmup, a.steps)
    med = statistics.median(times)
    tokens = dp * a.micro_batch * a.seq
    row = {"mode": "train", "arch": a.arch, "size": a.size, "seq": a.seq, "sp": sp.size if sp else 1, "dp": dp,
           "micro_batch": a.micro_batch, "ac": a.ac, "compile": a.compile, "dtype": precision,
           "step_s": med, "steps_s": times, "tokens_per_s": tokens / med, "tokens_per_s_per_device": tokens / med / world,
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           **_meta(device, world)}
    _write(a.out, f"train-{a.arch}-{a.size}-s{a.seq}-w{world}-sp{row['sp']}", row)


def bench_op(a) -> None:
    from ops import gated_linear_attn, lightning_attn
    from ops.sequence_parallel import SequenceParallel, sequence_parallel
    rank, world, device = _setup()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seg = a.seq // world
    g = torch.Generator().manual_seed(rank)
    shape = (a.batch, seg, a.heads, a.dim)
    q, k, v = (torch.randn(shape, generator=g).mul(0.3).to(device, dtype).requires_grad_() for _ in range(3))
    if a.op == "lightning":
        x = torch.full((a.heads,), 0.999, device=device)
        fn = lightning_attn
    else:
        x = torch.nn.functional.logsigmoid(torch.randn(shape, generator=g) + 4).to(device).requires_grad_()
        fn = gated_linear_attn
    do = torch.randn(shape, generator=g).to(device, dtype)
    sp = SequenceParallel() if world > 1 else None

    def run(parallel: bool):
        def go():
            with sequence_parallel(sp if parallel else None):
                o = fn(q, k, v, x, check_values=False)
            o.backward(do)
        return go
    local = _timed(run(False), device, a.warmup, a.steps)
    split = _timed(run(True), device, a.warmup, a.steps) if sp is not None else local
    state_bytes = a.batch * a.heads * (a.dim * a.dim + a.dim + 1) * 4
    row = {"mode": "op", "op": a.op, "seq": a.seq, "batch": a.batch, "heads": a.heads, "dim": a.dim, "dtype": str(dtype),
           "segment_s": statistics.median(local), "segment_with_exchange_s": statistics.median(split),
           "exchange_s": statistics.median(split) - statistics.median(local),
           "gathered_bytes_per_rank": state_bytes * world, **_meta(device, world)}
    _write(a.out, f"op-{a.op}-s{a.seq}-h{a.heads}-d{a.dim}-w{world}", row)


def report(out: str) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    train = [r for r in rows if r["mode"] == "train"]
    if train:
        print("| arch | size | seq | ranks | sp | tokens/s | tokens/s per device | step s | peak GiB | device | date |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(train, key=lambda r: (r["arch"], r["size"], r["seq"], r["ranks"])):
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") else "-"
            print(f"| {r['arch']} | {r['size']} | {r['seq']} | {r['ranks']} | {r['sp']} | {r['tokens_per_s']:.0f} | "
                  f"{r['tokens_per_s_per_device']:.0f} | {r['step_s']:.3f} | {mem} | {r['device']} | {r['date']} |")
    ops_ = [r for r in rows if r["mode"] == "op"]
    if ops_:
        print("\n| op | seq | B x H x D | ranks | segment fwd+bwd ms | with exchange ms | exchange ms | gathered KiB | device | date |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(ops_, key=lambda r: (r["op"], r["seq"], r["ranks"])):
            print(f"| {r['op']} | {r['seq']} | {r['batch']}x{r['heads']}x{r['dim']} | {r['ranks']} | "
                  f"{r['segment_s'] * 1e3:.2f} | {r['segment_with_exchange_s'] * 1e3:.2f} | {r['exchange_s'] * 1e3:.2f} | "
                  f"{r['gathered_bytes_per_rank'] / 1024:.0f} | {r['device']} | {r['date']} |")


def main(argv: list[str] | None = None) -> None:
    from models.registry import arch_names, get_arch
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("train", help="training-step throughput of a model")
    t.add_argument("--arch", default="tnl", choices=[a for a in arch_names() if get_arch(a).sequence_parallel])
    t.add_argument("--size", default="1b")
    t.add_argument("--vocab", type=positive_int, default=None, help="vocabulary override (small CPU runs)")
    t.add_argument("--seq", type=positive_int, default=32768)
    t.add_argument("--sp", type=positive_int, default=None, help="sequence-parallel degree (default: all ranks)")
    t.add_argument("--micro-batch", type=positive_int, default=1)
    t.add_argument("--ac", default="full", choices=["none", "mlp", "full"], help="activation checkpointing")
    t.add_argument("--compile", action="store_true", help="regional torch.compile of the blocks")
    o = sub.add_parser("op", help="one linear-attention layer with and without the state exchange")
    o.add_argument("--op", default="lightning", choices=["lightning", "gla"])
    o.add_argument("--seq", type=positive_int, default=8192)
    o.add_argument("--batch", type=positive_int, default=1)
    o.add_argument("--heads", type=positive_int, default=16)
    o.add_argument("--dim", type=positive_int, default=128)
    for s in (t, o):
        s.add_argument("--warmup", type=non_negative_int, default=2)
        s.add_argument("--steps", type=positive_int, default=5)
        s.add_argument("--out", default="bench_results/sp")
    r = sub.add_parser("report", help="print the tables of the results in a folder")
    r.add_argument("dir")
    a = p.parse_args(argv)
    if a.mode == "report":
        return report(a.dir)
    try:
        (bench_train if a.mode == "train" else bench_op)(a)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from pretrain.errors import run_cli
    exit_process(run_cli(main))

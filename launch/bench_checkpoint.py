"""Checkpoint save time and training stall, synchronous vs background (docs/benchmarks.md, "Checkpoints").

    python launch/bench_checkpoint.py --arch llama --size 70m --seq-len 2048 --json out.json

For one model: the median step time with no saving; a blocking save (what the loop would wait for
without background saving: copy, write, fsync, checksums, publish); then background saves, where the
stall is the time the save call holds the loop (staging to pinned host memory) plus the extra time of
the steps that ran while the writer was busy, against the median step. The first background save also
allocates the pinned buffers (reported apart: later saves reuse them). Weights-only snapshots likewise.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pretrain.config import parse_config  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_step(tr: Trainer) -> float:
    t0 = time.perf_counter()
    micro = [tr.loader.next_batch() for _ in range(tr.accum)]
    tr.module.train_step(micro, tr.step)
    tr.step += 1
    tr.tokens += tr.tokens_per_step
    tr.flops += tr.flops_per_step
    sync()
    return time.perf_counter() - t0


def background(tr: Trainer, start, base: float) -> dict:
    """Start a background save with `start()`, keep training until the writer is idle."""
    mgr = tr.checkpointer
    t0 = time.perf_counter()
    start()
    call = time.perf_counter() - t0
    steps = []
    while mgr.writer.busy:
        steps.append(one_step(tr))
    mgr.writer.wait()
    total = time.perf_counter() - t0
    extra = sum(s - base for s in steps)
    return {"call_s": call, "steps_during_write": len(steps), "extra_step_time_s": extra,
            "stall_s": call + max(0.0, extra), "write_s": mgr.history[-1]["write_s"], "wall_s": total}


def bench(args) -> dict:
    out_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    cfg = parse_config(["--arch", args.arch, "--size", args.size, "--seq-len", str(args.seq_len),
                        "--global-batch-tokens", str(args.seq_len * args.micro_batch), "--micro-batch",
                        str(args.micro_batch), "--out", str(out_dir), "--save-every", "0", "--keep-last", "1",
                        "--eval-every", "0", "--warmup-steps", "10", "--snapshot-every-tokens", "0"])
    tr = Trainer(cfg)
    mgr = tr.checkpointer
    params = sum(p.numel() for p in tr.model.parameters())
    one_step(tr)
    reserve = mgr.after_step  # the first after_step pins the staging buffers in the writer thread
    t0 = time.perf_counter()
    reserve()
    reserve_call = time.perf_counter() - t0
    reserve_steps = []
    while mgr.writer.busy:
        reserve_steps.append(one_step(tr))
    mgr.writer.wait()
    reserve_wall = time.perf_counter() - t0
    for _ in range(args.warmup):
        one_step(tr)
    base = statistics.median(one_step(tr) for _ in range(args.steps))
    res = {"arch": args.arch, "size": args.size, "params": params, "seq_len": args.seq_len,
           "micro_batch": args.micro_batch,
           "reserve": {"call_s": reserve_call, "wall_s": reserve_wall, "steps_during": len(reserve_steps),
                       "extra_step_time_s": sum(s - base for s in reserve_steps)},
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "step_s": base, "checksum": __import__("checkpoints.manifest", fromlist=["DEFAULT_ALGO"]).DEFAULT_ALGO}

    t0 = time.perf_counter()
    mgr.save(blocking=True)
    res["checkpoint_sync_s"] = time.perf_counter() - t0
    ckpt = out_dir / "checkpoints"
    res["checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) // 1  # one kept
    one_step(tr)
    res["checkpoint_async_first"] = background(tr, lambda: mgr.save(blocking=False), base)
    one_step(tr)
    res["checkpoint_async"] = background(tr, lambda: mgr.save(blocking=False), base)

    one_step(tr)
    t0 = time.perf_counter()
    mgr.snapshot(blocking=True)
    res["snapshot_sync_s"] = time.perf_counter() - t0
    one_step(tr)
    res["snapshot_async_first"] = background(tr, lambda: mgr.snapshot(blocking=False), base)
    one_step(tr)
    res["snapshot_async"] = background(tr, lambda: mgr.snapshot(blocking=False), base)
    mgr.writer.wait()          # not at_end: its final checkpoint would cost another full write here
    mgr.signal.uninstall()
    # control: the same number of steps with no writer, against the same median (the noise floor)
    n = res["checkpoint_async"]["steps_during_write"]
    res["control_extra_step_time_s"] = sum(one_step(tr) - base for _ in range(n))
    for key in ("checkpoint", "snapshot"):
        res[f"{key}_stall_ratio"] = res[f"{key}_async"]["stall_s"] / res[f"{key}_sync_s"]
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="70m")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--run-dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    args = p.parse_args()
    res = bench(args)
    line = json.dumps(res)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint save time and training stall, synchronous vs background (docs/benchmarks.md, "Checkpoints").

    python launch/bench_checkpoint.py --arch llama --size 70m --seq-len 2048 --json out.json
    python launch/bench_checkpoint.py --pin-bench 4      # ways of page-locking 4 GB next to training

For one model: the median step time with no saving; the pinning phase (the staging buffers page-locked a
bounded piece per step, at `--pin-fraction` of the step time); a blocking save (what the loop would wait
for without background saving: copy, write + checksum in one pass, fsync, publish); then background
saves, where the stall is the time the save call holds the loop (staging to pinned host memory) plus the
extra time of the steps that ran while the writer was busy, against the median step. Weights-only
snapshots likewise. `--pin-bench GB` instead compares ways of page-locking host memory while a
launch-bound loop runs on the GPU (what holds a step, for how long).
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
from pretrain.argtypes import non_negative_int, positive_float, positive_int, ranged  # noqa: E402


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


def steps_while_writing(tr: Trainer) -> list[float]:
    """Train until the checkpoint writer is idle; the step times."""
    steps = []
    while tr.checkpointer.writer.busy:
        steps.append(one_step(tr))
    tr.checkpointer.writer.wait()
    return steps


def background(tr: Trainer, start, base: float) -> dict:
    """Start a background save with `start()`, keep training until the writer is idle."""
    mgr = tr.checkpointer
    t0 = time.perf_counter()
    start()
    call = time.perf_counter() - t0
    steps = steps_while_writing(tr)
    total = time.perf_counter() - t0
    extra = sum(s - base for s in steps)
    return {"call_s": call, "steps_during_write": len(steps), "extra_step_time_s": extra,
            "stall_s": call + max(0.0, extra), "write_s": mgr.history[-1]["write_s"], "wall_s": total}


def bench(args) -> dict:
    out_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    cfg = parse_config(["--arch", args.arch, "--size", args.size, "--seq-len", str(args.seq_len),
                        "--global-batch-tokens", str(args.seq_len * args.micro_batch), "--micro-batch",
                        str(args.micro_batch), "--out", str(out_dir), "--save-every", "0", "--keep-last", "1",
                        "--eval-every", "0", "--warmup-steps", "10", "--snapshot-every-tokens", "0",
                        "--snapshot-log-points", "0"])
    tr = Trainer(cfg)
    mgr = tr.checkpointer
    mgr.pin_fraction = args.pin_fraction
    params = sum(p.numel() for p in tr.model.parameters())
    one_step(tr)
    # the first post_step allocates + touches the staging buffers in the writer thread
    t0 = time.perf_counter()
    mgr.post_step()
    reserve_call = time.perf_counter() - t0
    reserve_steps = steps_while_writing(tr)
    reserve_wall = time.perf_counter() - t0
    for _ in range(args.warmup):
        one_step(tr)
    base = statistics.median(one_step(tr) for _ in range(args.steps))
    # pinning phase: steps with post_step (which page-locks a bounded piece each time) until all is pinned
    pin_steps, t0 = [], time.perf_counter()
    while not mgr._module_buffers.fully_pinned and time.perf_counter() - t0 < args.pin_max_s:
        t1 = time.perf_counter()
        one_step(tr)
        mgr.post_step()
        pin_steps.append(time.perf_counter() - t1)
    pin_steps_s = [round(x, 4) for x in pin_steps]
    res = {"arch": args.arch, "size": args.size, "params": params, "seq_len": args.seq_len,
           "micro_batch": args.micro_batch,
           "reserve": {"call_s": reserve_call, "wall_s": reserve_wall, "steps_during": len(reserve_steps),
                       "max_step_s": max(reserve_steps, default=0.0),
                       "extra_step_time_s": sum(s - base for s in reserve_steps)},
           "pinning": {"fraction": args.pin_fraction, "steps": len(pin_steps), "wall_s": time.perf_counter() - t0,
                       "max_step_s": max(pin_steps, default=0.0),
                       "extra_step_time_s": sum(s - base for s in pin_steps), "step_times_s": pin_steps_s,
                       **mgr._module_buffers.stats()},
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "step_s": base, "checksum": __import__("checkpoints.manifest", fromlist=["DEFAULT_ALGO"]).DEFAULT_ALGO}
    if args.only_pinning:
        mgr.signal.uninstall()
        return res

    t0 = time.perf_counter()
    mgr.save(blocking=True)
    res["checkpoint_sync_s"] = time.perf_counter() - t0
    res["checkpoint_sync_write_s"] = mgr.history[-1]["write_s"]
    ckpt = out_dir / "checkpoints"
    res["checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) // 1  # one kept
    res["checkpoint_async"] = []
    for _ in range(args.saves):
        one_step(tr)
        res["checkpoint_async"].append(background(tr, lambda: mgr.save(blocking=False), base))

    one_step(tr)
    t0 = time.perf_counter()
    mgr.snapshot(blocking=True)
    res["snapshot_sync_s"] = time.perf_counter() - t0
    one_step(tr)
    res["snapshot_async_first"] = background(tr, lambda: mgr.snapshot(blocking=False), base)  # pageable buffers
    mgr.writer.wait()          # not at_end: its final checkpoint would cost another full write here
    mgr.signal.uninstall()
    # control: the same number of steps with no writer, against the same median (the noise floor)
    n = res["checkpoint_async"][-1]["steps_during_write"]
    res["control_extra_step_time_s"] = sum(one_step(tr) - base for _ in range(n))
    res["checkpoint_stall_ratios"] = [a["stall_s"] / res["checkpoint_sync_s"] for a in res["checkpoint_async"]]
    res["snapshot_stall_ratio"] = res["snapshot_async_first"]["stall_s"] / res["snapshot_sync_s"]
    return res


def _fake_step(a: "torch.Tensor", launches: int) -> float:
    """A launch-bound step (like a small model at micro batch 1): many small kernels, then a sync."""
    t0 = time.perf_counter()
    for _ in range(launches):
        a = torch.tanh(a @ a) * 0.5
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def pin_bench(gb: float, launches: int = 2000) -> list[dict]:
    """Ways of getting `gb` GB of page-locked host memory while a loop of GPU steps runs, each reported
    as: how long it took, the longest step meanwhile, and the steps' total time over the median."""
    from checkpoints.staging import PAGE
    nbytes = int(gb * 2**30) // PAGE * PAGE
    a = torch.randn(256, 256, device="cuda")
    for _ in range(3):
        _fake_step(a, launches)
    base = statistics.median(_fake_step(a, launches) for _ in range(10))
    rows: list[dict] = []
    try:
        _pin_methods(rows, nbytes, a, launches, base)
    except Exception as err:  # noqa: BLE001 - keep the rows measured so far
        rows.append({"error": repr(err)})
    return rows


def _pin_methods(rows: list[dict], nbytes: int, a, launches: int, base: float) -> None:
    import threading
    from checkpoints import cuda_host
    from checkpoints.staging import StagingBuffers

    def alongside(name: str, work) -> None:
        """Run work() in a thread while stepping; report the steps' behaviour."""
        box: dict = {}
        th = threading.Thread(target=lambda: box.update(s=_timed(work)))
        th.start()
        steps = []
        while th.is_alive():
            steps.append(_fake_step(a, launches))
        th.join()
        rows.append({"method": name, "gb": nbytes / 2**30, "work_s": box.get("s"), "step_base_s": base,
                     "steps": len(steps), "max_step_s": max(steps, default=0.0),
                     "extra_s": sum(s - base for s in steps)})

    # 1. what the manager did before: pinned allocation (cudaHostAlloc) in a background thread
    alongside("pin_memory=True alloc in a thread", lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # give the cached pinned block back
    # 2. allocating + touching pageable memory in a thread (what the reserve job does now)
    buf = StagingBuffers()
    alongside("touch pageable in a thread", lambda: buf.reserve({"x": torch.empty(nbytes, dtype=torch.uint8)}))
    arena = buf._arenas[""]
    arena.pinnable = cuda_host.available()
    # 3. cudaHostRegister of that memory in 64 MB pieces, back to back, in a thread
    def register_all():
        while arena.pin_next():
            pass
    alongside("cudaHostRegister 64 MB pieces in a thread", register_all)
    reg_s = rows[-1]["work_s"]
    buf.release()
    # 4. the same pieces registered between steps in the training thread, 10 % of a step at most
    buf = StagingBuffers()
    buf.reserve({"x": torch.empty(nbytes, dtype=torch.uint8)})
    buf._arenas[""].pinnable = cuda_host.available()
    steps, t0 = [], time.perf_counter()
    while not buf.fully_pinned and time.perf_counter() - t0 < 20.0:
        t1 = time.perf_counter()
        _fake_step(a, launches)
        buf.pin_some(0.1 * base)
        steps.append(time.perf_counter() - t1)
    rows.append({"method": "cudaHostRegister between steps (10% budget)", "gb": nbytes / 2**30,
                 "pinned_share": buf.stats()["pinned"] / max(1, buf.stats()["pieces"]),
                 "work_s": time.perf_counter() - t0, "step_base_s": base, "steps": len(steps),
                 "max_step_s": max(steps, default=0.0), "extra_s": sum(s - base for s in steps),
                 "register_gb_per_s": nbytes / 2**30 / reg_s if reg_s else None})
    # 5. staging up to 1 GiB from the GPU into registered pieces, touched pageable and fresh pageable memory
    staged = min(nbytes, 2**30)
    src = {"x": torch.empty(staged, dtype=torch.uint8, device="cuda")}
    pinned, touched = StagingBuffers(), StagingBuffers()
    pinned.reserve(src)
    while pinned.pin_some(10.0):
        pass
    touched.reserve(src)
    touched._arenas[""].pinnable = False
    for name, b in (("registered pieces", pinned), ("pageable touched", touched), ("pageable fresh", StagingBuffers())):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.stage(src)
        # GiB (2^30 bytes) per second, like every size in these rows
        rows.append({"method": f"stage {staged / 2**30:.3g} GiB GPU -> {name}",
                     "gb_per_s": staged / 2**30 / (time.perf_counter() - t0),
                     "pinned_pieces": b.stats()["pinned"]})
    pinned.release()
    buf.release()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="70m")
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--warmup", type=non_negative_int, default=5)
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--saves", type=positive_int, default=2, help="background checkpoint saves to time")
    p.add_argument("--pin-fraction", type=ranged(float, ge=0, le=1), default=0.1,
                   help="share of a step spent page-locking staging buffers while they are not all pinned")
    p.add_argument("--only-pinning", action="store_true", help="stop after the pinning phase")
    p.add_argument("--pin-max-s", type=positive_float, default=60.0, help="stop the pinning phase after this long")
    p.add_argument("--pin-bench", type=positive_float, default=None, metavar="GB",
                   help="compare ways of page-locking GB of host memory next to a GPU loop, then exit")
    p.add_argument("--run-dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    args = p.parse_args()
    res = pin_bench(args.pin_bench) if args.pin_bench else bench(args)
    line = json.dumps(res)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(lambda argv: main()))

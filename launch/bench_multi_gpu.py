"""Multi-GPU measurements of `deepspeed launch/pretrain.py`: ZeRO scaling, the 7B command, resume on another
GPU count. Each scenario launches the real command (`deepspeed --num_gpus N launch/pretrain.py ...`, with
NCCL_NVLS_ENABLE=0), reads the run's metrics.jsonl and its log, and writes one JSON per cell under --out.

    python launch/bench_multi_gpu.py --only scaling --out $OUT/mgpu     # ZeRO-1/2/3 x TNL, LLaMA 1B x 1-8 GPUs
    python launch/bench_multi_gpu.py --only 7b --archs tnl --out $OUT/mgpu        # 7B, ZeRO-3, 8 GPUs
    python launch/bench_multi_gpu.py --only resume --out $OUT/mgpu      # ZeRO-3 8 -> 4 and 4 -> 8 GPUs
    python launch/bench_multi_gpu.py --report $OUT/mgpu                 # the markdown tables of what is there
    python launch/bench_multi_gpu.py --rehearse --out /tmp/mgpu         # every scenario, tiny, on CPU (gloo)

Scenarios:
- scaling: for each arch, ZeRO stage and GPU count, `--steps` steps at the same global batch
  (`--global-seqs` sequences of `--seq-len`): median tokens/s per GPU over the steps after `--warm`,
  scaling efficiency = (tokens/s per GPU on N) / (tokens/s per GPU on the fewest GPUs measured, 1 when
  present), MFU (the trainer's, by the paper's FLOPs), peak memory per GPU (nvidia-smi, sampled every
  second, the largest GPU; and rank 0's torch peak).
- 7b: `--size 7b --zero 3` on `--gpus` GPUs, per arch, in phases (`--phases`, so that the 10-minute
  commands can take them one at a time; the run directory stays in --work):
  train (tokens/s, MFU, memory, the checkpoint's save time and the snapshot's), export (the snapshot to
  bf16 safetensors), eval (WikiText-2 word perplexity of the export on one GPU), resume (load time and the
  next steps' losses). The run directory is deleted after the resume phase (--keep-runs keeps it).
- resume: for each pair A:B, a reference run on A GPUs saves at step `--steps`/2 and goes on to `--steps`;
  that checkpoint is resumed on B GPUs (the first resume converts it to a DeepSpeed universal checkpoint,
  timed). Checked: the loader's next global batches after the checkpoint are byte-identical on A and on B
  ranks and to an uninterrupted one-rank loader (the data stream), every step is logged once with the
  tokens continuing, and the resumed losses follow the reference's within --loss-rtol (bf16 on GPUs).

Run directories live under --work (default /tmp/linscale_mgpu) and are deleted after each cell: a 1B ZeRO
checkpoint is ~15 GB, a 7B ZeRO-3 one ~85 GB (weights, Adam moments and fp32 partitions, 12 bytes a
parameter); each phase checks the free space first. Cells with a JSON in --out are skipped, and
--time-budget stops starting new cells in time, so a matrix fills over several device commands.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from models.registry import canonical_arch  # noqa: E402
from models.sizes import canonical_size  # noqa: E402
from pretrain.distributed import free_port  # noqa: E402
from pretrain.argtypes import (int_list, name_arg, name_list, non_negative_float, non_negative_int,  # noqa: E402
                               positive_float, positive_int, ranged)

SCENARIOS = ("scaling", "7b", "resume")
PHASES = ("train", "export", "eval", "resume")
BYTES_PER_PARAM_ZERO = 12  # a DeepSpeed checkpoint with fp32 weights: weights + Adam's two moments, fp32


@dataclass
class Plan:
    """What each scenario runs; `gpu_plan` is the GPU matrix, `rehearsal_plan` the same at toy scale."""
    device: str                                   # cuda | cpu
    archs: list[str]
    size: str
    seq_len: int
    global_seqs: int
    micro_batch: int
    steps: int
    warm: int
    counts: list[int]
    stages: list[int]
    big_archs: list[str]
    big_size: str
    big_gpus: int
    big_global_seqs: int
    big_steps: int
    big_resume_steps: int
    resume_arch: str
    resume_size: str
    resume_pairs: list[tuple[int, int]]
    resume_steps: int
    loss_rtol: float
    extra: list[str] = field(default_factory=list)   # flags added to the scaling and resume commands
    big_extra: list[str] = field(default_factory=list)  # flags added to the 7b scenario's commands
    data: str | None = None


def gpu_plan() -> Plan:
    return Plan(device="cuda", archs=["tnl", "llama"], size="1b", seq_len=8192, global_seqs=32, micro_batch=1,
                steps=12, warm=4, counts=[1, 2, 4, 8], stages=[1, 2, 3],
                big_archs=["tnl", "hgrn2"], big_size="7b", big_gpus=8, big_global_seqs=64, big_steps=8,
                big_resume_steps=2, resume_arch="tnl", resume_size="1b", resume_pairs=[(8, 4), (4, 8)],
                resume_steps=8, loss_rtol=5e-3)


def rehearsal_plan() -> Plan:
    return Plan(device="cpu", archs=["tnl", "llama"], size="tiny", seq_len=32, global_seqs=8, micro_batch=1,
                steps=5, warm=2, counts=[1, 2, 4], stages=[1, 2, 3],
                big_archs=["tnl", "hgrn2"], big_size="tiny", big_gpus=2, big_global_seqs=4, big_steps=4,
                big_resume_steps=2, resume_arch="tnl", resume_size="tiny", resume_pairs=[(4, 2), (2, 4)],
                resume_steps=8, loss_rtol=2e-5,
                extra=["--model", "vocab_size=256", "--lr", "3e-3"],
                # the 7b rehearsal keeps the real vocabulary: its export is evaluated on WikiText-2 text
                big_extra=["--lr", "3e-3"])


# ------------------------------------------------------------------------------------------------------
# measurement arithmetic (pure functions: tested on hand-made inputs)
# ------------------------------------------------------------------------------------------------------

def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def throughput(rows: list[dict], gpus: int, warm: int) -> dict:
    """Medians over the logged steps after the first `warm` (start-up, compilation, allocator warm-up),
    leaving out steps without a rate (compiling) or skipped. tokens_per_s in metrics.jsonl is the whole
    job's (every rank), so per GPU divides by the GPU count."""
    timed = [r for r in rows if r["step"] > warm and r.get("tokens_per_s") and not r.get("skipped")]
    if not timed:
        return {"timed_steps": 0}
    rates = [r["tokens_per_s"] for r in timed]
    tps = statistics.median(rates)
    out = {"timed_steps": len(timed), "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / gpus,
           # the spread of the timed steps: steady steps sit close to the median, a step that waits does not
           "tokens_per_s_per_gpu_range": [min(rates) / gpus, max(rates) / gpus],
           "step_time_s": statistics.median(r["step_time_s"] for r in timed if r.get("step_time_s"))}
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    if mfus:
        out["mfu"] = statistics.median(mfus)
    for key in ("max_memory_gb", "max_memory_reserved_gb", "max_rss_gb"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            out["rank0_" + key] = max(vals)
    return out


def scaling_efficiency(cells: list[dict]) -> list[dict]:
    """Adds `efficiency` to each cell: its tokens/s per GPU over that of the same arch, ZeRO stage, sequence
    length, global batch and micro-batch on the fewest GPUs measured (`efficiency_base_gpus`; 1 when the
    one-GPU cell exists). 1.0 = linear."""
    def key(c: dict) -> tuple:
        return (c["arch"], c["size"], c["zero"], c.get("seq_len"), c.get("global_batch_seqs"), c.get("micro_batch"))

    base: dict[tuple, dict] = {}
    for c in cells:
        k = key(c)
        if c.get("tokens_per_s_per_gpu") and (k not in base or c["gpus"] < base[k]["gpus"]):
            base[k] = c
    out = []
    for c in cells:
        c = dict(c)
        b = base.get(key(c))
        if b is not None and c.get("tokens_per_s_per_gpu"):
            c["efficiency"] = c["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
            c["efficiency_base_gpus"] = b["gpus"]
        out.append(c)
    return out


def parse_log(lines: list[tuple[float, str]]) -> dict:
    """Times and facts from a pretrain log whose lines carry the seconds since launch: checkpoint and
    snapshot write times, the resume line (and its seconds from the line before it, which is the load),
    the universal conversion, the first step, and the first compiled step (graphs built, its own seconds)."""
    out: dict = {}
    for t, line in lines:
        m = re.search(r"checkpoint (step_\d+) saved \((blocking|background, stall ([\d.]+) s), written in ([\d.]+) s", line)
        if m:
            out.setdefault("checkpoints", []).append({"name": m.group(1), "stall_s": float(m.group(3) or 0),
                                                      "blocking": m.group(2) == "blocking",
                                                      "write_s": float(m.group(4)), "at_s": t})
        m = re.search(r"snapshot (step_\d+) saved \(\d+ tokens, written in ([\d.]+) s\)", line)
        if m:
            out.setdefault("snapshots", []).append({"name": m.group(1), "write_s": float(m.group(2)), "at_s": t})
        if "converting it to a DeepSpeed universal checkpoint" in line:
            out["universal_start_s"] = t
        m = re.search(r"resumed from (\S+) at step (\d+), (\d+) tokens(?: \(saved by (\d+) ranks, resumed on (\d+)\))?", line)
        if m:
            out["resume"] = {"path": m.group(1), "step": int(m.group(2)), "tokens": int(m.group(3)),
                             "saved_world": int(m.group(4)) if m.group(4) else None,
                             "world": int(m.group(5)) if m.group(5) else None, "at_s": t}
            if "universal_start_s" in out:
                out["resume"]["convert_and_load_s"] = t - out["universal_start_s"]
        if "[linscale] rendezvous" in line and "rendezvous_s" not in out:
            out["rendezvous_s"] = t
        if re.search(r"\[linscale\] \S+ \S+: [\d.]+M non-embedding", line) and "engine_ready_s" not in out:
            out["engine_ready_s"] = t
        if "_do_optimizer_sanity_check" in line and "optimizer_check_s" not in out:
            out["optimizer_check_s"] = t  # DeepSpeed's initialize, just before it builds the ZeRO optimizer
        if re.match(r"step 1/", line) and "first_step_s" not in out:
            out["first_step_s"] = t
        m = re.search(r"step \d+: torch\.compile built (\d+) graph\(s\); the step took ([\d.]+) s", line)
        if m and not out.get("compile"):  # the first compiled step: its wall time, compilation included
            out["compile"] = {"graphs": int(m.group(1)), "step_s": float(m.group(2)), "at_s": t}
    out.setdefault("compile", None)  # None: no compiled step logged (an eager run)
    return out


def resume_load_s(fresh: dict, resumed: dict) -> float | None:
    """Seconds a resume spends loading, by difference: (mark -> "resumed from") of the resumed run minus
    (mark -> the model line, i.e. the rest of the engine build) of a fresh run on the same GPU count. The
    mark is DeepSpeed's optimizer check inside initialize when both logs have it (less start-up noise),
    else the rendezvous line. On a busy CPU the difference is noise; at 7B the load dominates it."""
    r = resumed.get("resume")
    if not r or "engine_ready_s" not in fresh:
        return None
    key = "optimizer_check_s" if "optimizer_check_s" in fresh and "optimizer_check_s" in resumed else "rendezvous_s"
    return (r["at_s"] - resumed.get(key, 0.0)) - (fresh["engine_ready_s"] - fresh.get(key, 0.0))


def compare_losses(reference: list[dict], resumed: list[dict], first: int, last: int, rtol: float) -> dict:
    """Resumed steps first..last against the uninterrupted reference: each step logged once, tokens
    continuing, the largest relative loss difference, and the median relative change of the reference
    loss from one step to the next (a shifted data stream shows differences of that size)."""
    ref = {r["step"]: r for r in reference}
    steps = [r["step"] for r in resumed]
    got = {r["step"]: r for r in resumed}
    wanted = list(range(first, last + 1))
    rel = [abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in wanted if s in got and s in ref]
    jumps = sorted(abs(ref[s + 1]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"])
                   for s in wanted[:-1] if s in ref and s + 1 in ref)
    tokens_ok = all(got[s]["tokens"] == ref[s]["tokens"] for s in wanted if s in got and s in ref)
    out = {"steps": wanted, "each_once": sorted(steps) == wanted, "tokens_continue": tokens_ok,
           "max_rel_diff": max(rel) if len(rel) == len(wanted) else None,
           "first_rel_diff": rel[0] if rel else None,
           "median_rel_step_change": statistics.median(jumps) if jumps else None, "rtol": rtol,
           "pairs": [[s, ref.get(s, {}).get("loss"), got.get(s, {}).get("loss")] for s in wanted]}
    out["ok"] = bool(out["each_once"] and tokens_ok and out["max_rel_diff"] is not None
                     and out["max_rel_diff"] <= rtol)
    return out


def stream_digests(data: str | None, seq_len: int, global_seqs: int, micro_batch: int, seed: int,
                   loader_state: dict, world: int, steps: int) -> list[str]:
    """sha256 of each of the next `steps` global batches as `world` ranks read them after `loader_state`
    (every rank's micro-batches of a step, concatenated in rank order: the global batch)."""
    from data_pipeline import build_loader
    loaders = []
    for rank in range(world):
        ld = build_loader(data, seq_len, global_seqs, micro_batch, rank=rank, world_size=world, seed=seed)
        ld.load_state_dict(loader_state)
        loaders.append(ld)
    out = []
    for _ in range(steps):
        h = hashlib.sha256()
        for ld in loaders:
            for _ in range(ld.accum):
                b = ld.next_batch()
                # each row's ids and its last target (the one token the ids do not hold), row by row: the
                # same bytes whatever the micro-batch size that splits the global batch
                for ids, tgt in zip(b["input_ids"], b["targets"]):
                    h.update(ids.numpy().tobytes())
                    h.update(tgt[-1:].numpy().tobytes())
        out.append(h.hexdigest()[:16])
    return out


def uninterrupted_digests(data: str | None, seq_len: int, global_seqs: int, seed: int, skip: int,
                          steps: int) -> list[str]:
    """The same digests from a one-rank loader that starts at step 0 and reads `skip` steps first."""
    from data_pipeline import build_loader
    ld = build_loader(data, seq_len, global_seqs, global_seqs, rank=0, world_size=1, seed=seed)
    for _ in range(skip):
        ld.next_batch()
    state = ld.state_dict()
    return stream_digests(data, seq_len, global_seqs, 1, seed, state, 1, steps)


def data_stream_check(data: str | None, plan: Plan, ckpt: Path, worlds: tuple[int, int], steps: int) -> dict:
    """The loader state saved in `ckpt` (rank 0's trainer file; the state is global), continued on each
    of `worlds` rank counts and from scratch on one rank: the next global batches must be identical."""
    import torch

    from checkpoints.layout import META, TRAINER_DIR
    meta = json.loads((ckpt / META).read_text())
    files = sorted((ckpt / TRAINER_DIR).iterdir())
    state = torch.load(files[0], map_location="cpu", weights_only=False)["loader"]
    seed = int(state["seed"])
    runs = {f"{w} ranks": stream_digests(data, plan.seq_len, plan.global_seqs, plan.micro_batch, seed, state, w, steps)
            for w in worlds}
    runs["1 rank from step 0"] = uninterrupted_digests(data, plan.seq_len, plan.global_seqs, seed, int(meta["step"]), steps)
    first = next(iter(runs.values()))
    return {"checkpoint_step": int(meta["step"]), "steps": steps, "digests": runs,
            "identical": all(d == first for d in runs.values())}


# ------------------------------------------------------------------------------------------------------
# launching
# ------------------------------------------------------------------------------------------------------

class GpuMemorySampler:
    """Largest memory.used of each GPU (MiB) while a command runs, from nvidia-smi once a second."""

    def __init__(self, gpus: int):
        self.gpus, self.peak = gpus, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True) if shutil.which("nvidia-smi") else None

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in q.splitlines():
                i, used = (int(x) for x in line.split(","))
                if i < self.gpus:
                    self.peak[i] = max(self.peak.get(i, 0), used)

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def result(self) -> dict:
        if not self.peak:
            return {}
        return {"gpu_peak_gib": {str(i): round(v / 1024, 2) for i, v in sorted(self.peak.items())},
                "max_gpu_peak_gib": round(max(self.peak.values()) / 1024, 2)}


def launch_env(plan: Plan) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    # NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM): on shared hosts a program using
    # it can take the GPUs out of service
    e.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    e["PYTHONUNBUFFERED"] = "1"
    if plan.device == "cpu":
        e.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return e


def deepspeed_cmd(gpus: int, port: int, flags: list[str]) -> list[str]:
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    if not Path(launcher).exists():
        launcher = None
    head = [launcher] if launcher else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return head + ["--num_gpus", str(gpus), "--master_port", str(port), str(ROOT / "launch" / "pretrain.py"), *flags]


def shell_line(cmd: list[str]) -> str:
    return "NCCL_NVLS_ENABLE=0 " + " ".join(cmd).replace(str(ROOT) + "/", "")


def run_logged(cmd: list[str], env: dict, log: Path, timeout: float, gpus: int = 0,
               stop_on: str | None = None) -> tuple[int, list, dict, float]:
    """Runs cmd in its own process group, lines timestamped (seconds since launch) into `log` and echoed;
    kills the group at `timeout`, or once a line matches `stop_on` (exit code then 0: a throughput cell
    needs nothing after its last step, and skipping the end-of-run checkpoint saves its write and disk).
    Returns (exit code, [(t, line)], GPU memory peaks, wall seconds)."""
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh, GpuMemorySampler(gpus) as mem:
        fh.write("$ " + shell_line(cmd) + "\n")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        stopped = False
        try:
            for line in proc.stdout:
                t = time.time() - t0
                line = line.rstrip("\n")
                lines.append((t, line))
                fh.write(f"[{t:8.2f}] {line}\n")
                if line.startswith(("step ", "[linscale]", "error", "Traceback")) or "Error" in line:
                    print(f"  [{t:7.1f}s] {line[-200:]}", flush=True)
                if stop_on and not stopped and re.search(stop_on, line):
                    stopped = True
                    time.sleep(0.5)  # the metrics row is written before the console line; let it reach disk
                    os.killpg(proc.pid, signal.SIGKILL)
                    fh.write(f"[{time.time() - t0:8.2f}] (stopped by the benchmark after the last step)\n")
            rc = proc.wait()
            if stopped:
                rc = 0
        except BaseException:  # Ctrl-C, SIGTERM, a timeout of the caller: never leave the ranks running
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            timer.cancel()
    return rc, lines, mem.result(), time.time() - t0


def pretrain_flags(plan: Plan, arch: str, size: str, zero: int, out: Path, steps: int, global_seqs: int,
                   *extra: str, big: bool = False) -> list[str]:
    flags = ["--arch", arch, "--size", size, "--zero", str(zero), "--seq-len", str(plan.seq_len),
             "--global-batch-tokens", str(global_seqs * plan.seq_len), "--micro-batch", str(plan.micro_batch),
             "--max-steps", str(steps), "--log-every", "1", "--eval-every", "0", "--device", plan.device,
             "--snapshot-log-points", "0", "--out", str(out)]
    if plan.data:
        flags += ["--data", plan.data]
    return flags + list(plan.big_extra if big else plan.extra) + list(extra)


def free_gib(path: Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free / 2**30


def need_disk(path: Path, gib: float, what: str) -> None:
    free = free_gib(path)
    if free < gib:
        raise SystemExit(f"error: {what} needs about {gib:.0f} GiB free under {path}, only {free:.0f} GiB is; "
                         f"free space or pass --work on a larger disk")


def param_count(arch: str, size: str, extra: list[str]) -> int:
    from models import exact_params, model_config
    overrides = {}
    for i, f in enumerate(extra):
        if f == "--model":
            k, v = extra[i + 1].split("=", 1)
            overrides[k] = int(v) if v.isdigit() else v
    return exact_params(model_config(arch, size, **overrides))["total"]


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


class BenchRun:
    def __init__(self, args, plan: Plan):
        self.args, self.plan = args, plan
        self.out, self.work = Path(args.out), Path(args.work)
        self.t0 = time.time()
        self.env = launch_env(plan)
        self.skipped_for_time: list[str] = []

    def done_cell(self, scenario: str, name: str) -> dict | None:
        """A cell already measured: in --out, or in a --done folder (results of earlier commands)."""
        for d in [self.out, *map(Path, self.args.done or [])]:
            f = d / scenario / f"{name}.json"
            if f.is_file():
                cell = json.loads(f.read_text())
                if cell.get("exit_code", 0) == 0 and (scenario != "resume" or cell.get("ok") is not None):
                    return cell
        return None

    def next_port(self) -> int:
        return free_port()  # a fresh one per launch: the last launch's port may still be held

    def settled(self, scenario: str, name: str, results: list[dict], need: float) -> bool:
        """True when the cell needs no run now: measured before (its result joins `results`) or no time left
        for it (`need` seconds; it is listed as skipped)."""
        prior = self.done_cell(scenario, name)
        if prior is not None:
            results.append(prior)
            return True
        if not self.time_left(need):
            self.skipped_for_time.append(name)
            return True
        return False

    def time_left(self, need: float) -> bool:
        if self.args.time_budget and time.time() - self.t0 + need > self.args.time_budget:
            return False
        return True

    def common(self) -> dict:
        import torch
        return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "device": (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo)"),
                "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                "torch": torch.__version__, "rehearsal": self.plan.device == "cpu",
                "extra_flags": self.plan.extra}


# ------------------------------------------------------------------------------------------------------
# scenarios
# ------------------------------------------------------------------------------------------------------

def scaling(s: BenchRun) -> list[dict]:
    p = s.plan
    done = []
    for arch in p.archs:
        for zero in p.stages:
            for n in p.counts:
                name = f"{arch}-{p.size}-z{zero}-g{n}"
                path = s.out / "scaling" / f"{name}.json"
                if s.settled("scaling", name, done, s.args.cell_estimate):
                    continue
                run = s.work / name
                shutil.rmtree(run, ignore_errors=True)
                if p.device == "cuda":
                    need_disk(s.work, 1.2 * BYTES_PER_PARAM_ZERO * param_count(arch, p.size, p.extra) / 2**30,
                              f"{name} (its end-of-run checkpoint)")
                flags = pretrain_flags(p, arch, p.size, zero, run, p.steps, p.global_seqs, "--save-every", "0",
                                       "--snapshot-every-tokens", "0", "--warmup-steps", "2000")
                cmd = deepspeed_cmd(n, s.next_port(), flags)
                print(f"[scaling] {name}: {shell_line(cmd)}", flush=True)
                rc, lines, mem, wall = run_logged(cmd, s.env, s.out / "logs" / f"scaling-{name}.log",
                                                  s.args.cell_timeout, n, stop_on=rf"^step {p.steps}/{p.steps}\b")
                rows = read_metrics(run)
                cell = {**s.common(), "scenario": "scaling", "arch": arch, "size": p.size, "zero": zero, "gpus": n,
                        "seq_len": p.seq_len, "global_batch_seqs": p.global_seqs, "micro_batch": p.micro_batch,
                        "accumulation": p.global_seqs // (n * p.micro_batch), "steps": p.steps, "warm": p.warm,
                        "command": shell_line(cmd), "exit_code": rc, "wall_s": round(wall, 1),
                        **throughput(rows, n, p.warm), **mem, **parse_log(lines)}
                if rc != 0:
                    cell["log_tail"] = [ln for _, ln in lines[-30:]]
                write_json(path, cell)
                if not s.args.keep_runs:
                    shutil.rmtree(run, ignore_errors=True)
                done.append(cell)
    cells = scaling_efficiency(done)
    write_json(s.out / "scaling.json", {"cells": cells, "not_run_for_time": s.skipped_for_time})
    return cells


def big(s: BenchRun) -> list[dict]:
    p = s.plan
    results = []
    phases = [ph for ph in PHASES if ph in s.args.phases]
    for arch in p.big_archs:
        name = f"{arch}-{p.big_size}-z3-g{p.big_gpus}"
        run = s.work / name
        path = s.out / "7b" / f"{name}.json"
        # a copy beside the run directory carries the earlier phases over to the next command (a new $OUT)
        carried = s.work / f"{name}.json"
        src = path if path.is_file() else carried if carried.is_file() else None
        cell = json.loads(src.read_text()) if src else {"scenario": "7b", "arch": arch,
                                                                   "size": p.big_size, "zero": 3,
                                                                   "gpus": p.big_gpus, "phases": {}}
        tokens_per_step = p.big_global_seqs * p.seq_len
        for ph in phases:
            if ph in cell["phases"] and cell["phases"][ph].get("exit_code") == 0:
                continue
            if not s.time_left(s.args.cell_estimate):
                s.skipped_for_time.append(f"{name}:{ph}")
                continue
            n_params = param_count(arch, p.big_size, p.big_extra)
            if ph == "train":
                shutil.rmtree(run, ignore_errors=True)
                if p.device == "cuda":  # checkpoint + snapshot (fp32) + room for the resume's second checkpoint
                    need_disk(s.work, (2 * BYTES_PER_PARAM_ZERO + 4) * n_params * 1.1 / 2**30, f"{name} train+resume")
                flags = pretrain_flags(p, arch, p.big_size, 3, run, p.big_steps, p.big_global_seqs,
                                       "--save-every", "0", "--keep-last", "1",
                                       "--snapshot-every-tokens", str(p.big_steps * tokens_per_step), big=True)
                cmd = deepspeed_cmd(p.big_gpus, s.next_port(), flags)
            elif ph == "export":
                cmd = [sys.executable, str(ROOT / "launch" / "export.py"), str(run), "--step", str(p.big_steps),
                       "--dtype", "bf16"]
            elif ph == "eval":
                from evaluation.local_data import eval_path
                eval_path("wikitext2_test")  # missing: a clear error naming $LINSCALE_SHARED_DATA, before any work
                cmd = [sys.executable, str(ROOT / "launch" / "evaluate.py"),
                       str(run / "exports" / f"step_{p.big_steps:08d}"), "--tasks", "wikitext2",
                       "--out", str(run / "eval"), "--device", p.device]
                if s.args.eval_limit:
                    cmd += ["--limit", str(s.args.eval_limit)]
            else:  # resume: the end-of-train checkpoint, a few more steps
                flags = pretrain_flags(p, arch, p.big_size, 3, run, p.big_steps + p.big_resume_steps,
                                       p.big_global_seqs, "--save-every", "0", "--keep-last", "1",
                                       "--snapshot-every-tokens", "0", "--resume", "auto", big=True)
                cmd = deepspeed_cmd(p.big_gpus, s.next_port(), flags)
            print(f"[7b] {name} {ph}: {shell_line(cmd)}", flush=True)
            gpus = p.big_gpus if ph in ("train", "resume") else 1
            rows_before = len(read_metrics(run))
            rc, lines, mem, wall = run_logged(cmd, s.env, s.out / "logs" / f"7b-{name}-{ph}.log", s.args.cell_timeout,
                                              gpus)
            res = {**s.common(), "command": shell_line(cmd), "exit_code": rc, "wall_s": round(wall, 1), **mem,
                   **parse_log(lines)}
            if ph == "train":
                res.update(throughput(read_metrics(run), p.big_gpus, p.warm))
                res.update({"seq_len": p.seq_len, "global_batch_seqs": p.big_global_seqs, "steps": p.big_steps,
                            "params": n_params})
                res["checkpoint_gib"] = round(_du(run / "checkpoints") / 2**30, 1)
                res["snapshot_gib"] = round(_du(run / "snapshots") / 2**30, 1)
            elif ph == "export":
                res["export_gib"] = round(_du(run / "exports") / 2**30, 2)
            elif ph == "eval":
                rj = run / "eval" / "results.json"
                if rj.is_file():
                    res["results"] = json.loads(rj.read_text()).get("snapshots")
                shutil.rmtree(run / "exports", ignore_errors=True)   # room for the resume's checkpoint
                shutil.rmtree(run / "snapshots", ignore_errors=True)
            else:
                rows = read_metrics(run)
                new = rows[rows_before:]
                res["resumed_steps"] = [{"step": r["step"], "tokens": r["tokens"], "loss": r["loss"]} for r in new]
                before = [r for r in rows[:rows_before] if r["step"] == p.big_steps]
                res["loss_at_checkpoint"] = before[-1]["loss"] if before else None
                res["steps_continue"] = [r["step"] for r in new] == list(range(p.big_steps + 1,
                                                                                p.big_steps + p.big_resume_steps + 1))
                res["load_s"] = resume_load_s(cell["phases"].get("train", {}), res)
            if rc != 0:
                res["log_tail"] = [ln for _, ln in lines[-30:]]
            cell["phases"][ph] = res
            write_json(path, cell)
            write_json(carried, cell)
            if rc != 0:
                break
        if "resume" in phases and not s.args.keep_runs and cell["phases"].get("resume", {}).get("exit_code") == 0:
            shutil.rmtree(run, ignore_errors=True)
            carried.unlink(missing_ok=True)
        results.append(cell)
    return results


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def resume(s: BenchRun) -> list[dict]:
    p = s.plan
    half = p.resume_steps // 2
    results = []
    for a, b in p.resume_pairs:
        name = f"{p.resume_arch}-{p.resume_size}-z3-g{a}to{b}"
        path = s.out / "resume" / f"{name}.json"
        if s.settled("resume", name, results, 2 * s.args.cell_estimate):
            continue
        ref, res_dir = s.work / f"{name}-ref", s.work / f"{name}-resumed"
        for d in (ref, res_dir):
            shutil.rmtree(d, ignore_errors=True)
        if p.device == "cuda":  # two checkpoints of the reference, its universal copy, the resumed run's end
            need_disk(s.work, 4.5 * BYTES_PER_PARAM_ZERO * param_count(p.resume_arch, p.resume_size, p.extra) / 2**30,
                      name)
        common = ("--warmup-steps", "2", "--snapshot-every-tokens", "0", "--keep-last", "0")
        cmd_ref = deepspeed_cmd(a, s.next_port(), pretrain_flags(p, p.resume_arch, p.resume_size, 3, ref, p.resume_steps,
                                                                 p.global_seqs, "--save-every", str(half), *common))
        print(f"[resume] {name} reference on {a}: {shell_line(cmd_ref)}", flush=True)
        rc1, lines1, mem1, wall1 = run_logged(cmd_ref, s.env, s.out / "logs" / f"resume-{name}-ref.log",
                                              s.args.cell_timeout, a)
        cell = {**s.common(), "scenario": "resume", "arch": p.resume_arch, "size": p.resume_size, "zero": 3,
                "from_gpus": a, "to_gpus": b, "checkpoint_step": half, "steps": p.resume_steps,
                "seq_len": p.seq_len, "global_batch_seqs": p.global_seqs,
                "reference": {"command": shell_line(cmd_ref), "exit_code": rc1, "wall_s": round(wall1, 1), **mem1,
                              **parse_log(lines1)}}
        ckpt = ref / "checkpoints" / f"step_{half:08d}"
        if rc1 == 0:
            cell["data_stream"] = data_stream_check(p.data, p, ckpt, (a, b), p.resume_steps - half)
            cmd_res = deepspeed_cmd(b, s.next_port(), pretrain_flags(p, p.resume_arch, p.resume_size, 3, res_dir,
                                                                     p.resume_steps, p.global_seqs, "--save-every", "0",
                                                                     "--resume", str(ckpt), *common))
            print(f"[resume] {name} resumed on {b}: {shell_line(cmd_res)}", flush=True)
            # stopped after its last step: its end-of-run checkpoint is not needed
            rc2, lines2, mem2, wall2 = run_logged(cmd_res, s.env, s.out / "logs" / f"resume-{name}-resumed.log",
                                                  s.args.cell_timeout, b,
                                                  stop_on=rf"^step {p.resume_steps}/{p.resume_steps}\b")
            cell["resumed"] = {"command": shell_line(cmd_res), "exit_code": rc2, "wall_s": round(wall2, 1), **mem2,
                               **parse_log(lines2)}
            if rc2 == 0:
                cell["losses"] = compare_losses(read_metrics(ref), read_metrics(res_dir), half + 1, p.resume_steps,
                                                p.loss_rtol)
                r = cell["resumed"].get("resume", {})
                cell["ok"] = bool(cell["losses"]["ok"] and cell["data_stream"]["identical"]
                                  and r.get("saved_world") == a and r.get("world") == b)
            else:
                cell["resumed"]["log_tail"] = [ln for _, ln in lines2[-30:]]
        else:
            cell["reference"]["log_tail"] = [ln for _, ln in lines1[-30:]]
        cell.setdefault("ok", False)
        write_json(path, cell)
        if not s.args.keep_runs:
            for d in (ref, res_dir):
                shutil.rmtree(d, ignore_errors=True)
        results.append(cell)
    return results


# ------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------

def _f(x, fmt="{:,.0f}", none="—"):
    return none if x is None else fmt.format(x)


def _head(*columns: str) -> list[str]:
    """A markdown table's header and rule; a column named with a trailing '>' is right-aligned."""
    names = [c.rstrip(">") for c in columns]
    rule = ["---:" if c.endswith(">") else "---" for c in columns]
    return ["| " + " | ".join(names) + " |", "|" + "|".join(rule) + "|"]


def _load(dirs: list[Path], scenario: str) -> list[dict]:
    """The cells of one scenario from several result folders (one per device command); a cell measured
    twice counts once, the newest file."""
    found: dict[str, tuple[float, dict]] = {}
    for d in dirs:
        for f in sorted((Path(d) / scenario).glob("*.json")):
            if f.stem not in found or f.stat().st_mtime > found[f.stem][0]:
                found[f.stem] = (f.stat().st_mtime, json.loads(f.read_text()))
    return [v for _, v in sorted(found.values(), key=lambda kv: json.dumps(kv[1].get("arch")))]


def _range(r: list[float] | None) -> str:
    """A [min, max] of tokens/s as '52.0-65.1k'; '—' where the cell has none."""
    return "—" if not r else f"{r[0] / 1e3:.1f}-{r[1] / 1e3:.1f}k"


def report(dirs: list[Path] | Path) -> str:
    dirs = [Path(d) for d in (dirs if isinstance(dirs, list) else [dirs])]
    parts = []
    cells = _load(dirs, "scaling")
    if cells:
        cells = sorted(scaling_efficiency(cells), key=lambda c: (c["arch"], c["size"], c["zero"], c["micro_batch"],
                                                                 c["gpus"]))

        def each(fmt) -> str:  # the cells' values of one setting, each once
            return ", ".join(dict.fromkeys(fmt(c) for c in cells))

        def timed(c: dict) -> str:
            return f"{c['warm'] + 1}-{c['steps']}"
        parts.append(f"Scaling: {each(lambda c: c['device'])}, {each(lambda c: c['date'][:10])}, seq "
                     f"{each(lambda c: str(c['seq_len']))}, global batch {each(lambda c: str(c['global_batch_seqs']))} "
                     f"sequences, median of steps {each(timed)}.\n")
        parts += _head("arch", "size", "ZeRO>", "GPUs>", "micro x accum>", "tokens/s per GPU>", "steps' range>",
                       "efficiency>", "MFU>",
                       "peak GiB per GPU (nvidia-smi, largest)>", "rank-0 torch peak GiB>",
                       "first compiled step s (graphs)>")
        for c in cells:
            mem0 = c.get("rank0_max_memory_gb", c.get("rank0_max_rss_gb"))
            eff = c.get("efficiency")
            comp = c.get("compile", "—")  # absent: a result written before the field existed
            comp = "eager" if comp is None else comp if comp == "—" else f"{comp['step_s']:.1f} ({comp['graphs']})"
            parts.append(f"| {c['arch']} | {c['size']} | {c['zero']} | {c['gpus']} | "
                         f"{c['micro_batch']} x {c['accumulation']} | "
                         f"{_f(c.get('tokens_per_s_per_gpu'))} | {_range(c.get('tokens_per_s_per_gpu_range'))} | "
                         f"{_f(eff, '{:.1%}') + ('' if c.get('efficiency_base_gpus', 1) == 1 or eff is None else ' (vs ' + str(c['efficiency_base_gpus']) + ')')} | "
                         f"{_f(c.get('mfu'), '{:.1%}')} | {_f(c.get('max_gpu_peak_gib'), '{:.1f}')} | "
                         f"{_f(mem0, '{:.1f}')} | {comp} |" + ("" if c["exit_code"] == 0 else f" exit {c['exit_code']}"))
    bigs = _load(dirs, "7b")
    if bigs:
        parts += [""] + _head("arch", "size", "GPUs>", "tokens/s per GPU>", "MFU>", "peak GiB per GPU>",
                              "checkpoint GiB>", "save s (stall / write)>", "snapshot write s>", "resume load s>",
                              "export s>", "WikiText-2 word ppl>")
        for c in bigs:
            ph = c["phases"]
            tr, ex, ev, rs = (ph.get(k, {}) for k in PHASES)
            ck = (tr.get("checkpoints") or [{}])[-1]
            sn = (tr.get("snapshots") or [{}])[-1]
            ppl = next((r.get("results", {}).get("wikitext2", {}).get("word_perplexity")
                        for r in ev.get("results") or []), None)
            parts.append(f"| {c['arch']} | {c['size']} | {c['gpus']} | {_f(tr.get('tokens_per_s_per_gpu'))} | "
                         f"{_f(tr.get('mfu'), '{:.1%}')} | {_f(tr.get('max_gpu_peak_gib'), '{:.1f}')} | "
                         f"{_f(tr.get('checkpoint_gib'), '{:.1f}')} | {_f(ck.get('stall_s'), '{:.1f}')} / "
                         f"{_f(ck.get('write_s'), '{:.1f}')} | {_f(sn.get('write_s'), '{:.1f}')} | "
                         f"{_f(rs.get('load_s'), '{:.1f}')} | {_f(ex.get('wall_s'), '{:.0f}')} | "
                         f"{_f(ppl, '{:.2f}')} |")
    res = _load(dirs, "resume")
    if res:
        parts += [""] + _head("arch", "size", "GPUs", "checkpoint step>", "data stream identical",
                              "steps once, tokens continue", "max rel loss diff>", "median rel step change>",
                              "convert + load s>", "ok")
        for c in res:
            lo = c.get("losses", {})
            r = (c.get("resumed") or {}).get("resume", {})
            parts.append(f"| {c['arch']} | {c['size']} | {c['from_gpus']} → {c['to_gpus']} | {c['checkpoint_step']} | "
                         f"{(c.get('data_stream') or {}).get('identical', '—')} | "
                         f"{lo.get('each_once', '—')}, {lo.get('tokens_continue', '—')} | "
                         f"{_f(lo.get('max_rel_diff'), '{:.1e}')} | {_f(lo.get('median_rel_step_change'), '{:.1e}')} | "
                         f"{_f(r.get('convert_and_load_s'), '{:.1f}')} | {c.get('ok')} |")
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------------

def synthetic_dataset(root: Path, vocab: int = 256, docs: int = 300) -> Path:
    """A small prepared dataset (token ids < vocab, each mostly following from the one before) for the
    CPU rehearsal: a tiny model learns it within a few steps, so losses differ from step to step."""
    import numpy as np

    from data_pipeline.shards import ShardWriter, SourceMeta, write_meta
    if (root / "train" / "meta.json").is_file():
        return root
    rng = np.random.default_rng(0)
    for split, n in (("train", docs), ("val", 16)):
        w = ShardWriter(root / split, "synthetic", shard_tokens=1 << 14)
        for _ in range(n):
            length = int(rng.integers(20, 200))
            ids = np.empty(length, dtype=np.int64)
            ids[0] = rng.integers(0, vocab)
            for i in range(1, length):
                ids[i] = rng.integers(0, vocab) if rng.random() < 0.3 else (ids[i - 1] * 5 + 3) % vocab
            w.add(ids)
        w.close()
        write_meta(root / split, [SourceMeta("synthetic", "en", 1.0, w.shard_entries(), w.documents, w.tokens)],
                   {"label": f"synthetic vocab {vocab}"})
    return root


def _raise_interrupt(*_):
    raise KeyboardInterrupt


def _pairs(s: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in p.split(":")) for p in s.split(",") if p]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"{s!r}: give FROM:TO GPU counts >= 1, comma-separated, e.g. 8:4,4:8")
    return pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/multi_gpu"), help="results (one JSON per cell)")
    ap.add_argument("--work", default="/tmp/linscale_mgpu", help="run directories (deleted after each cell)")
    ap.add_argument("--report", metavar="DIR", nargs="+", help="print the markdown tables of the results in "
                    "these folders (one per device command) and exit")
    ap.add_argument("--rehearse", action="store_true", help="tiny model on CPU (gloo), world sizes 1/2/4")
    ap.add_argument("--archs", type=name_list(canonical_arch)), ap.add_argument("--big-archs", type=name_list(canonical_arch))
    ap.add_argument("--size", type=name_arg(canonical_size)), ap.add_argument("--big-size", type=name_arg(canonical_size))
    ap.add_argument("--counts", type=int_list(1), help="GPU counts of the scaling scenario (default 1,2,4,8)")
    ap.add_argument("--stages", type=int_list(0, 3, "1,2,3"), help="ZeRO stages of the scaling scenario (default 1,2,3)")
    ap.add_argument("--pairs", type=_pairs, help="resume scenario, FROM:TO GPU counts (default 8:4,4:8)")
    ap.add_argument("--gpus", type=positive_int, help="GPUs of the 7b scenario (default 8)")
    ap.add_argument("--seq-len", type=positive_int), ap.add_argument("--global-seqs", type=positive_int)
    ap.add_argument("--micro-batch", type=positive_int), ap.add_argument("--steps", type=positive_int)
    ap.add_argument("--warm", type=non_negative_int, help="first steps left out of the medians")
    ap.add_argument("--big-steps", type=positive_int), ap.add_argument("--big-global-seqs", type=positive_int)
    ap.add_argument("--resume-steps", type=positive_int), ap.add_argument("--loss-rtol", type=ranged(float, gt=0))
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="7b scenario phases")
    ap.add_argument("--eval-limit", type=positive_int, help="documents of the WikiText-2 evaluation (smoke runs)")
    ap.add_argument("--data", help="--data of every pretrain command (default: the embedded corpus on GPUs, "
                                   "a synthetic dataset in the rehearsal)")
    ap.add_argument("--pretrain-args", default="", help="extra pretrain flags, e.g. '--compile true'")
    ap.add_argument("--time-budget", type=non_negative_float, default=0, help="seconds; start no cell that may not end in it")
    ap.add_argument("--cell-estimate", type=positive_float, default=120, help="seconds a cell is assumed to take")
    ap.add_argument("--cell-timeout", type=positive_float, default=580, help="seconds before a command is killed")
    ap.add_argument("--keep-runs", action="store_true")
    ap.add_argument("--done", nargs="+", metavar="DIR", help="results of earlier commands: their cells are skipped")
    ap.add_argument("--print-plan", action="store_true", help="print the settings of every scenario and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report([Path(d) for d in args.report]))
        return 0
    plan = rehearsal_plan() if args.rehearse else gpu_plan()
    for key in ("archs", "big_archs", "size", "big_size", "counts", "stages", "seq_len", "global_seqs", "micro_batch",
                "steps", "warm", "big_steps", "big_global_seqs", "resume_steps", "loss_rtol", "data"):
        if getattr(args, key) is not None:
            setattr(plan, key, getattr(args, key))
    if plan.warm >= plan.steps:
        ap.error(f"--warm {plan.warm} leaves none of the {plan.steps} steps to time: give --warm below --steps")
    if args.pairs is not None:
        plan.resume_pairs = args.pairs
    if args.gpus is not None:
        plan.big_gpus = args.gpus
    if args.rehearse and args.eval_limit is None:
        args.eval_limit = 3
    plan.extra += args.pretrain_args.split()
    plan.big_extra += args.pretrain_args.split()
    if plan.device == "cuda":
        import torch
        have = torch.cuda.device_count()
        want = max([*(plan.counts if "scaling" in args.only else []), *([plan.big_gpus] if "7b" in args.only else []),
                    *(max(p) for p in plan.resume_pairs if "resume" in args.only)], default=0)
        if have < want and not args.print_plan:
            raise SystemExit(f"error: the plan needs {want} GPUs and {have} are visible; pass --counts/--pairs/--gpus "
                             f"for fewer, or --rehearse for the CPU rehearsal")
        if plan.data is None and not args.print_plan:  # built once here, not by 8 ranks at once
            from data_pipeline.default_corpus import default_corpus_dir
            print(f"default corpus: {default_corpus_dir()}", flush=True)
    elif plan.data is None:
        plan.data = str(synthetic_dataset(Path(args.work) / "data"))
    for n in plan.counts:
        if plan.global_seqs % (n * plan.micro_batch):
            raise SystemExit(f"error: --global-seqs {plan.global_seqs} does not divide over {n} GPUs x micro batch "
                             f"{plan.micro_batch}; the scaling scenario keeps the global batch fixed")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    s = BenchRun(args, plan)
    if args.print_plan:
        print(json.dumps(plan.__dict__, indent=1))
        return 0
    print(f"linscale multi-GPU bench: {', '.join(args.only)} -> {s.out}", flush=True)
    runners = {"scaling": scaling, "7b": big, "resume": resume}
    for name in args.only:
        runners[name](s)
    if s.skipped_for_time:
        print(f"not started (time budget): {', '.join(s.skipped_for_time)}; run again with the same --out")
    print(report(s.out))
    (s.out / "tables.md").write_text(report(s.out))
    return 0


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(main))

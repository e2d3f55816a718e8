"""End-to-end training throughput: architectures x sizes x sequence lengths at the same tokens per step.

    python launch/bench_train.py                                     # 4 archs x 410m, 1b x 2K, 8K, 32K, 64K
    python launch/bench_train.py --archs tnl,llama --sizes 1b --seqs 8192 --out bench/train     # a subset
    python launch/bench_train.py --report bench/train                # the tables of what is measured so far
    python launch/bench_train.py --archs tnl --sizes 1b --seqs 8192 --ops side_streams=false  # a kernel option A/B

Each cell (arch, size, seq) runs the training step of `pretrain.train_module.TorchTrainModule` (the one
`launch/pretrain.py` runs on the plain PyTorch path: bf16 autocast, fused AdamW, clipping, regional
torch.compile) on random tokens, in a process of its own, and writes `<out>/<cell>.json`. Cells already in
`<out>` are skipped, so a matrix can be filled over several commands (`--time-budget` stops
starting new cells in time). Per cell: the first step's wall time (compilation), then the median of the
timed steps: tokens/s, MFU by the paper's FLOPs (`models.flops_per_step`), peak memory, graph breaks.
Micro-batches hold max(seq, 8192) tokens by default (one sequence from 8K on; accumulation makes up
the step). Activation checkpointing (`--ac auto`) takes the cheapest setting the memory estimate of
`pretrain.memory` says fits (none, else full checkpointing of the fewest blocks); when a step still runs
out of memory the cell retries with every block checkpointed, and the JSON keeps every attempt.
`--profile` adds the per-kernel-class share of one profiled step. Run under TORCH_LOGS=graph_breaks,
each cell's JSON also keeps Dynamo's graph-break log lines (`graph_break_log`; empty: no break).
`--grad-accum-fusion off` runs the step with autograd's own gradient accumulation (an A/B of
`pretrain/grad_accumulation.py`, named for it). `--ops FIELD=VALUE` runs the cells with those `ops.config.OpsConfig` options (named for them, so that an
A/B lands in one `--out`; the report compares each with the LLaMA cells of the same options if there are
any, else with the default ones). The ratio to LLaMA is against LLaMA's cells of the same size, length,
micro-batch and compile mode, the median of their rates where there are several; every JSON records the ops config the cell ran with and the commit,
marked `+dirty` when tracked files differed from it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.registry import canonical_arch  # noqa: E402
from models.sizes import canonical_size  # noqa: E402
from pretrain.argtypes import (int_list, name_list, non_negative_float, non_negative_int, positive_float,  # noqa: E402
                               positive_int, ranged)
from pretrain.profiling import profile_call  # noqa: E402

ARCHS = ["llama", "tnl", "hgrn2", "cos2"]  # the measured matrix: the paper's four, LLaMA the baseline
SIZES = ["410m", "1b"]
SEQS = [2048, 8192, 32768, 65536]
AC_MODES = ["none", "mlp", "full"]



def cell_name(arch: str, size: str, seq: int, micro_tokens: int, ac: str, ac_fraction: float, compile_: bool,
              ops: dict | None = None, grad_accum_fusion: str = "auto") -> str:
    frac = "" if ac_fraction == 1.0 else f"{ac_fraction:g}"
    return (f"{arch}-{size}-s{seq}-m{micro_tokens}-ac{ac}{frac}" + ("" if compile_ else "-eager")
            + "".join(f"-{k}-{_ops_value(v)}" for k, v in sorted((ops or {}).items()))
            + ("" if grad_accum_fusion == "auto" else f"-gaf-{grad_accum_fusion}"))


def _ops_value(v) -> str:
    # a value may be a path (tune_cache): only characters safe in a file name go into the cell's name
    return re.sub(r"[^A-Za-z0-9._=-]", "_", str(v).lower() if isinstance(v, bool) else str(v))


def _ops_arg(text: str) -> dict:
    try:
        return parse_ops(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(err)) from None


def ops_label(ops: dict | None) -> str:
    """'side_streams=false' for the ops options a cell ran with ('' for the defaults)."""
    return ",".join(f"{k}={_ops_value(v)}" for k, v in sorted((ops or {}).items()))


def variant_label(r: dict) -> str:
    """The options a result ran with beyond the defaults: its ops options and the gradient-accumulation
    fusion when off ('' for the defaults)."""
    off = ["grad_accum_fusion=off"] if r.get("grad_accum_fusion", "auto") != "auto" else []
    return ",".join([x for x in [ops_label(r.get("ops"))] if x] + off)


def parse_ops(text: str) -> dict:
    """`--ops FIELD=VALUE[,FIELD=VALUE...]`: options of ops.config.OpsConfig for every cell (an A/B of a
    kernel option end to end), each checked as the run config checks its `--ops-<field>` flags. Raises
    ValueError naming the fields and values it takes."""
    import dataclasses

    from ops.config import OpsConfig
    from pretrain.config import check_field
    fields = {f.name: f for f in dataclasses.fields(OpsConfig)}
    out: dict = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--ops {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        out[name] = check_field(fields[name], value, f"--ops {name}")
    return out


# ----------------------------------------------------------------------------------------------------
# one cell (runs in its own process)
# ----------------------------------------------------------------------------------------------------

def _graph_stats() -> dict:
    from torch._dynamo.utils import counters
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "graph_break_reasons": sorted(counters["graph_break"])[:10]}


def run_cell(spec: dict) -> dict:
    import torch

    from models import build_model, flops_per_step, get_arch, model_config
    from ops import get_config, set_config
    from pretrain.config import OptimConfig
    from pretrain.grad_accumulation import fusion_wanted
    from pretrain.memory import choose_checkpointing, configure_allocator, estimate_peak_gib
    from pretrain.metrics import peak_flops
    from pretrain.trainer import is_out_of_memory
    from pretrain.train_module import TorchTrainModule

    alloc_conf = configure_allocator()  # as launch/pretrain.py runs
    if spec.get("ops"):
        set_config(**spec["ops"])
    arch, size, seq = spec["arch"], spec["size"], spec["seq"]
    micro_tokens, tokens_per_step = spec["micro_tokens"], spec["tokens_per_step"]
    mb, accum = micro_tokens // seq, tokens_per_step // micro_tokens
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")  # CPU: only for a smoke test of the machinery
    total_gib = (torch.cuda.get_device_properties(dev).total_memory if cuda else
                 os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    mcfg = model_config(arch, size)
    if spec["ac"] == "auto":
        settings = [choose_checkpointing(mcfg, micro_tokens, 0.9 * total_gib)]
        if settings[0] != ("full", 1.0):
            settings.append(("full", 1.0))
    else:
        settings = [(spec["ac"], spec["ac_fraction"])]
    out = {**spec, "micro_batch": mb, "accumulation": accum, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "device_gib": round(total_gib, 1), "torch": torch.__version__, "alloc_conf": alloc_conf,
           "ops_config": get_config().to_dict(), "attempts": []}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    first = spec.get("attempt", 0)  # run_cell_attempts: one setting a process
    for mode, fraction in settings[first:first + 1]:
        torch._dynamo.reset()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        attempt = {"ac": mode, "ac_fraction": fraction,
                   "estimate_gib": round(estimate_peak_gib(mcfg, micro_tokens, mode, fraction), 1)}
        out["attempts"].append(attempt)
        module = None
        try:
            torch.manual_seed(0)
            with torch.device(dev):
                overrides = {"max_seq_len": max(seq, 8192)} if get_arch(arch).context_limited else {}
                model = build_model(arch, size, **overrides)
            attempt["checkpointed_blocks"] = len(model.set_activation_checkpointing(mode, fraction))
            module = TorchTrainModule(model, OptimConfig(warmup_steps=0), dev, "bf16" if cuda else "fp32",
                                      fuse_grad_accumulation=fusion_wanted(spec.get("grad_accum_fusion", "auto"), 1, accum))
            if spec["compile"]:
                module.compile()
            gen = torch.Generator().manual_seed(0)

            def batch():
                # on the host, as the loader yields them: the step copies them to the GPU as training does
                x = torch.randint(0, model.config.vocab_size, (mb, seq + 1), generator=gen)
                return {"input_ids": x[:, :-1].contiguous(), "targets": x[:, 1:].contiguous()}

            times, losses = [], []
            for i in range(spec["warmup"] + spec["steps"]):
                micro = [batch() for _ in range(accum)]
                sync()
                t0 = time.time()
                res = module.train_step(micro, i)  # reads the loss back: the step has finished
                times.append(time.time() - t0)
                losses.append(res.loss)
                if i == 0:
                    attempt["first_step_s"] = times[0]
                    print(f"[bench] {arch} {size} seq {seq} ac {mode}: first step {times[0]:.1f} s", flush=True)
            timed = times[spec["warmup"]:]
            step = statistics.median(timed)
            flops = flops_per_step(model.config, tokens_per_step // seq, seq)
            peak = peak_flops(dev)
            attempt.update({
                "status": "ok", "step_s": step, "step_s_all": times, "tokens_per_s": tokens_per_step / step,
                "mfu": flops / step / peak if peak else None, "flops_per_step": flops,
                "compile_s": max(0.0, times[0] - step) if spec["compile"] else 0.0,
                "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan"),
                "reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else float("nan"),
                "loss_first": losses[0], "loss_last": losses[-1], **_graph_stats()})
            if spec.get("profile") and cuda:
                attempt["profile"] = profile_call(lambda: module.train_step([batch() for _ in range(accum)], 99))
            out.update({k: attempt[k] for k in ("status", "ac", "ac_fraction", "tokens_per_s", "mfu", "peak_gib",
                                                  "step_s", "compile_s", "graph_breaks")})
            return out
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_out_of_memory(err):
                raise
            attempt.update({"status": "oom", "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
                            "error": str(err).splitlines()[0][:300]})
            print(f"[bench] {arch} {size} seq {seq} ac {mode}: out of memory", flush=True)
        finally:
            module = model = micro = None
    out["status"] = "oom"
    if first + 1 < len(settings):
        out["next_attempt"] = first + 1
    return out


# ----------------------------------------------------------------------------------------------------
# the matrix (parent process) and the report
# ----------------------------------------------------------------------------------------------------

def _commit() -> str | None:
    """The code's commit, '+dirty' where tracked files differ from it (the cell ran uncommitted code)."""
    if os.environ.get("LINSCALE_COMMIT"):
        return os.environ["LINSCALE_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=root, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def graph_break_lines(log: str, keep: int = 20) -> list[str]:
    """The lines of a TORCH_LOGS=graph_breaks log that report a break (at most `keep`, cut to 300 chars)."""
    return [ln[:300] for ln in log.splitlines() if "graph break" in ln.lower()][:keep]


def device_slug(name: str) -> str:
    """File-name form of a device name: results of different GPUs never stand for one another."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def _cell_process(spec: dict, timeout: float) -> dict:
    """One attempt of a cell (`run_cell`) in a fresh process: its result, or an error / timeout record."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--cell", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return {**spec, "status": "timeout", "timeout_s": timeout,
                "log_tail": ((err.stdout or b"").decode(errors="replace")
                             + (err.stderr or b"").decode(errors="replace"))[-3000:]}
    res = None
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            res = json.loads(line[len("BENCH_RESULT "):])
    if res is None:
        res = {**spec, "status": "error", "returncode": proc.returncode, "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    if "graph_breaks" in os.environ.get("TORCH_LOGS", ""):
        # the cell ran with Dynamo's graph-break log on: keep what it said (empty: no break)
        res["graph_break_log"] = graph_break_lines(proc.stdout + proc.stderr)
    return res


def run_cell_attempts(spec: dict, timeout: float) -> dict:
    """A cell's activation-checkpointing settings tried in turn (`run_cell`'s `settings`: with --ac auto, the
    memory estimate's choice, then every block), each in its own process, until one fits: a setting tried
    after an out-of-memory one then starts from a GPU the failed attempt no longer holds any memory of (in
    one process its tensors, compiled graphs and allocator state can stay behind and inflate the next
    attempt's peak). The result carries every attempt; `timeout` bounds the whole cell."""
    t0, before, i = time.time(), [], 0
    while True:
        res = _cell_process({**spec, "attempt": i}, max(30.0, timeout - (time.time() - t0)))
        res["attempts"] = before + res.get("attempts", [])
        nxt = res.pop("next_attempt", None)
        if res.get("status") != "oom" or nxt is None or time.time() - t0 >= timeout:
            res.pop("attempt", None)
            return res
        before, i = res["attempts"], nxt


def run_matrix(args) -> None:
    import torch
    slug = device_slug(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    cells = [(a, s, q) for s in args.sizes for q in args.seqs for a in args.archs]
    if args.order == "given":
        cells = [(a, s, q) for a in args.archs for s in args.sizes for q in args.seqs]
    for arch, size, seq in cells:
        micro = args.micro_tokens or max(seq, 8192)
        micro = max(micro, seq)
        if args.tokens_per_step % micro or micro % seq:
            print(f"[bench] skip {arch} {size} seq {seq}: {args.tokens_per_step} tokens per step is not a whole "
                  f"number of {micro}-token micro-batches of whole sequences", flush=True)
            continue
        name = cell_name(arch, size, seq, micro, args.ac, args.ac_fraction, not args.no_compile, args.ops,
                         args.grad_accum_fusion)
        # no '@' or other shell-special characters in the name: copies between machines keep every file
        path = out / f"{name}__{slug}.json"
        done = next((p for p in (path, out / f"{name}@{slug}.json") if p.exists()), None)  # '@': older results
        if done is not None and not args.force:
            print(f"[bench] {name}: measured already ({done})", flush=True)
            continue
        left = args.time_budget - (time.time() - start) if args.time_budget else None
        if left is not None and left < args.min_cell_s:
            print(f"[bench] time budget: {left:.0f} s left, not starting {name} (run again to continue)", flush=True)
            break
        spec = {"arch": arch, "size": size, "seq": seq, "micro_tokens": micro, "tokens_per_step": args.tokens_per_step,
                "ac": args.ac, "ac_fraction": args.ac_fraction, "compile": not args.no_compile,
                "warmup": args.warmup, "steps": args.steps, "profile": args.profile, "ops": args.ops,
                "grad_accum_fusion": args.grad_accum_fusion, "commit": _commit(),
                "date": dt.date.today().isoformat()}
        timeout = args.cell_timeout if left is None else max(30, min(args.cell_timeout, left))
        print(f"[bench] {name} ...", flush=True)
        t0 = time.time()
        res = run_cell_attempts(spec, timeout)
        res["wall_s"] = time.time() - t0
        if res["status"] in ("ok", "oom") or args.keep_failures:
            path.write_text(json.dumps(res, indent=1))
        else:
            (out / f"{name}__{slug}.failed.json").write_text(json.dumps(res, indent=1))
        print(f"[bench] {name}: {res['status']}" + (f", {res['tokens_per_s']:,.0f} tokens/s, MFU "
              f"{100 * (res.get('mfu') or 0):.1f}%, peak {res['peak_gib']:.1f} GiB, ac {res['ac']}, compile "
              f"{res['compile_s']:.0f} s" if res["status"] == "ok" else "") + f" ({res['wall_s']:.0f} s)", flush=True)
        if res["status"] not in ("ok", "oom"):
            print(res.get("log_tail", "")[-1500:], flush=True)


def load_results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json")) if not p.name.endswith(".failed.json")]


def _ac_label(r: dict) -> str:
    """'none', 'full', or 'full 11/32' (checkpointed blocks of all blocks)."""
    f = r.get("ac_fraction", 1.0)
    if r["ac"] == "none" or f == 1.0:
        return r["ac"]
    from models import model_config
    from models.lm import checkpointed_blocks
    n = model_config(r["arch"], r["size"]).n_layers
    return f"{r['ac']} {len(checkpointed_blocks(n, f))}/{n}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _breaks(r: dict) -> str:
    """The cell's graph-break count ('?' where its JSON does not record one): a cell with breaks measured
    a model torch.compile split into several graphs per block, slower than one graph."""
    n = r.get("graph_breaks")
    return "?" if n is None else str(n)


def report(out: Path) -> str:
    """The tables of the results in `out`, one set per device."""
    rows = load_results(out)
    if not rows:
        return f"no results in {out}"
    devices = sorted({r.get("device", "?") for r in rows})
    return "\n\n".join(_report_device([r for r in rows if r.get("device", "?") == d]) for d in devices)


def _micro_tokens(r: dict) -> int:
    return r.get("micro_tokens") or r.get("micro_batch", 1) * r["seq"]


def _reference_key(r: dict) -> tuple:
    """What a cell and its LLaMA reference share: size, length, tokens a micro-batch, compiled or eager."""
    return (r["size"], r["seq"], _micro_tokens(r), bool(r.get("compile", True)))


def _report_device(rows: list[dict]) -> str:
    # the ratio to LLaMA: against LLaMA's cells of the same size, length, micro-batch and compile mode (a
    # larger micro-batch or compiling speeds up every architecture, so such cells are not compared), the
    # median of their rates where a folder holds several (a job that ran LLaMA twice: which one the file
    # names sort last must not decide the ratio) (LLaMA run with the same ops options where there is one:
    # most options touch only the linear models)
    llama_rates: dict[tuple, list[float]] = {}
    for r in rows:
        if r["arch"] == "llama" and r.get("status") == "ok":
            llama_rates.setdefault(_reference_key(r) + (variant_label(r),), []).append(r["tokens_per_s"])
    llama = {k: statistics.median(v) for k, v in llama_rates.items()}
    devices = sorted({r.get("device", "?") for r in rows})
    dates = sorted({r.get("date", "?") for r in rows})
    commits = sorted({str(r.get("commit")) for r in rows})
    lines = [f"Device: {', '.join(devices)}; dates: {', '.join(dates)}; code: {', '.join(commits)}; "
             f"tokens per step: {', '.join(sorted({str(r['tokens_per_step']) for r in rows}))}", "",
             "| arch | size | seq | micro x accum | act. ckpt | tokens/s | MFU | peak GiB | vs LLaMA | first step s "
             "| graph breaks | date |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    order = {a: i for i, a in enumerate(ARCHS)}
    for r in sorted(rows, key=lambda r: (SIZES.index(r["size"]) if r["size"] in SIZES else 9, r["seq"],
                                         _micro_tokens(r), order.get(r["arch"], 9))):
        if r.get("status") != "ok":
            tried = ", ".join(f"{a['ac']}: {a.get('status')}" for a in r.get("attempts", []))
            lines.append(f"| {r['arch']} | {r['size']} | {r['seq']} | {r.get('micro_batch', '?')} x "
                         f"{r.get('accumulation', '?')} | {tried or '-'} | {r.get('status')} | | | | | | | "
                         f"{r.get('date', '?')} |")
            continue
        key = _reference_key(r)
        ref = llama.get(key + (variant_label(r),)) or llama.get(key + ("",))
        ratio = f"{r['tokens_per_s'] / ref:.3f}x" if ref else "-"
        first = next((a.get("first_step_s") for a in r["attempts"] if a.get("status") == "ok"), None)
        ac = _ac_label(r)
        if any(a.get("status") == "oom" for a in r["attempts"]):
            ac += " (" + ", ".join(a["ac"] for a in r["attempts"] if a.get("status") == "oom") + ": OOM)"
        arch = r["arch"] + (f" ({variant_label(r)})" if variant_label(r) else "")
        lines.append(f"| {arch} | {r['size']} | {r['seq']} | {r['micro_batch']} x {r['accumulation']} | {ac} | "
                     f"{r['tokens_per_s'] / 1e3:,.1f}k | {_pct(r.get('mfu'))} | {r['peak_gib']:.1f} | {ratio} | "
                     f"{first:.0f} | {_breaks(r)} | {r.get('date', '?')} |")
    # flatness: each model's fastest setting at each length against its fastest at the shortest length
    flat, seqs = [], sorted({r["seq"] for r in rows if r.get("status") == "ok"})
    for arch in ARCHS:
        for size in SIZES:
            best: dict[int, dict] = {}
            for r in rows:
                if r["arch"] == arch and r["size"] == size and r.get("status") == "ok":
                    if r["seq"] not in best or r["tokens_per_s"] > best[r["seq"]]["tokens_per_s"]:
                        best[r["seq"]] = r
            if len(best) > 1:
                base = best[min(best)]
                flat.append(f"| {arch} | {size} | " + " | ".join(
                    f"{best[q]['tokens_per_s'] / base['tokens_per_s']:.2f} ({_ac_label(best[q])}, "
                    f"{best[q]['micro_batch']} x {best[q]['accumulation']})" if q in best else ""
                    for q in seqs) + " |")
    if flat:
        lines += ["", "tokens/s of each model's fastest measured setting at each length, relative to its shortest "
                      "measured length (activation checkpointing and micro x accum in brackets):", "",
                  "| arch | size | " + " | ".join(map(str, seqs)) + " |", "|---|---|" + "---:|" * len(seqs)] + flat
    profiles = [r for r in rows if r.get("status") == "ok" and any("profile" in a for a in r["attempts"])]
    for r in profiles:
        p = next(a["profile"] for a in r["attempts"] if "profile" in a)
        busy = (f"; the GPU busy {p['gpu_busy_s']:.3f} s, {100 * p['gpu_busy_share']:.1f}% of the step"
                if p.get("gpu_busy_s") is not None else "")
        lines += ["", f"Kernel time of one step, {r['arch']} {r['size']} seq {r['seq']} (kernels {p['kernel_s']:.3f} s "
                      f"of a {p['wall_s']:.3f} s profiled step{busy}):", "", "| kernel class | share |", "|---|---:|"]
        lines += [f"| {c} | {100 * v['share']:.1f}% |" for c, v in p["classes"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--archs", default=ARCHS, type=name_list(canonical_arch), help="comma-separated")
    p.add_argument("--sizes", default=SIZES, type=name_list(canonical_size), help="comma-separated")
    p.add_argument("--seqs", default=SEQS, type=int_list(1, example="2048,8192"), help="comma-separated tokens per sequence (>= 1)")
    p.add_argument("--tokens-per-step", type=positive_int, default=65536)
    p.add_argument("--micro-tokens", type=positive_int, default=None, help="tokens per micro-batch (default max(seq, 8192))")
    p.add_argument("--ac", default="auto", choices=["auto"] + AC_MODES,
                   help="activation checkpointing (auto: the cheapest setting pretrain.memory says fits)")
    p.add_argument("--ac-fraction", type=ranged(float, gt=0, le=1), default=1.0, help="share of blocks checkpointed (not with auto)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps (the first compiles)")
    p.add_argument("--steps", type=positive_int, default=4, help="timed steps (median)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--ops", type=_ops_arg, default={}, metavar="FIELD=VALUE[,...]",
                   help="ops options (ops.config.OpsConfig) of every cell, e.g. side_streams=false; cells are "
                        "named for them, so an A/B runs into one --out")
    p.add_argument("--grad-accum-fusion", default="auto", choices=["auto", "off"],
                   help="the blocks' weight gradients added into fp32 buffers by their own matmul (auto, as "
                        "launch/pretrain.py on one process, for steps of several micro-batches) or by autograd "
                        "(off); off cells are named for it")
    p.add_argument("--profile", action="store_true", help="also profile one step (kernel classes)")
    p.add_argument("--order", default="size-seq", choices=["size-seq", "given"],
                   help="size-seq: by size, then length, then arch; given: arch, size, seq as listed")
    p.add_argument("--out", default="bench_results/train")
    p.add_argument("--force", action="store_true", help="re-measure cells already in --out")
    p.add_argument("--keep-failures", action="store_true", help="record failed cells as measured")
    p.add_argument("--time-budget", type=positive_float, default=None, help="seconds; start no cell after it is spent")
    p.add_argument("--min-cell-s", type=non_negative_float, default=60, help="do not start a cell with less time left")
    p.add_argument("--cell-timeout", type=positive_float, default=900)
    p.add_argument("--report", metavar="DIR", help="print the tables of the results in DIR and exit")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test of the machinery
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        res = run_cell(json.loads(args.cell))
        print("BENCH_RESULT " + json.dumps(res), flush=True)
        return 0
    if args.report:
        print(report(Path(args.report)))
        return 0
    import torch
    if not torch.cuda.is_available() and not args.allow_cpu:
        from pretrain.errors import UserError
        raise UserError("bench_train needs a CUDA GPU (it measures training throughput); --report works anywhere")
    run_matrix(args)
    print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(main))

"""Throughput of prepare (filter + dedup + tokenize + write) and of the loader reading shards."""
from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from .config import load_data_config
from .prepare import prepare


def bench_prepare(config: str, near: bool, workers: int = 0) -> dict:
    cfg = load_data_config(config)
    cfg.dedup.near = near
    out = Path(tempfile.mkdtemp(prefix="linscale-bench-"))
    try:
        cpu0 = _cpu()
        t0 = time.perf_counter()
        stats = prepare(cfg, out, workers=workers, progress=False)
        dt = time.perf_counter() - t0
        cpu = _cpu() - cpu0
        chars = sum(s["chars_in"] for s in stats["sources"])
        tokens = sum(s["tokens_written_before_global_dedup"] for s in stats["sources"])
        mb = sum(f.stat().st_size for src in cfg.sources for f in cfg.files(src)[0]) / 1e6
        return {"seconds": dt, "cpu_seconds": cpu, "tokens": tokens, "chars": chars, "tokens_per_s": tokens / dt,
                "tokens_per_cpu_s": tokens / cpu, "compressed_mb_per_s": mb / dt,
                "text_mchars_per_s": chars / dt / 1e6, "load_avg_1min": os.getloadavg()[0]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bench_tokenizer(config: str) -> dict:
    """tiktoken alone over the same documents (read and cleaned first, not timed), one process: the
    anchor that prepare's throughput is compared with."""
    from .filters import clean
    from .sources import Counts, iter_source
    from .tokenizer import encode_document_array, get_tokenizer
    cfg = load_data_config(config)
    texts = [clean(t) for s in cfg.sources for t, _ in iter_source(cfg, s, Counts(s.name))]
    get_tokenizer()
    cpu0, t0 = _cpu(), time.perf_counter()
    tokens = sum(len(encode_document_array(t)) for t in texts)
    cpu, dt = _cpu() - cpu0, time.perf_counter() - t0
    return {"seconds": dt, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / dt,
            "tokens_per_cpu_s": tokens / cpu}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the prepare workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_loader(config: str, seq_len: int = 2048, micro_batch: int = 16, steps: int = 200) -> dict:
    from . import build_loader
    cfg = load_data_config(config)
    cfg.dedup.near = False
    out = Path(tempfile.mkdtemp(prefix="linscale-bench-"))
    try:
        prepare(cfg, out, progress=False)
        ld = build_loader(str(out), seq_len, micro_batch, micro_batch)
        ld.next_batch()
        t0 = time.perf_counter()
        for _ in range(steps):
            ld.next_batch()
        dt = time.perf_counter() - t0
        return {"seconds": dt, "tokens": steps * micro_batch * seq_len,
                "tokens_per_s": steps * micro_batch * seq_len / dt}
    finally:
        shutil.rmtree(out, ignore_errors=True)

"""Prepare a dataset: sources -> clean/filter -> tokenize -> token shards, then a merge step that dedups
across everything and writes the train/val document indexes.

Work splits in two ways. Within a part, worker processes clean, filter, hash and tokenize batches of
documents (results come back in input order, so the output is the same for any worker count). Across
parts (processes on several machines, or Slurm array tasks: `--part i --num-parts n`), part i takes
files i, i+n, i+2n... of every source's sorted file list (a source with max_documents, like an hf
stream, goes whole to one part); each part writes its own token files and per-document keys. `merge`
then reads every part's keys, removes exact and near duplicates (the first document in the global
order (source, file, document) survives) and writes:

    OUT/tokens/<source>/p<part>-<k>.tokens.bin    token files (written by the parts, shared by the splits)
    OUT/parts/part-<i>/...                        per-part document keys and counts (merge input)
    OUT/train/, OUT/val/                          meta.json + document indexes the loader reads
    OUT/stats.json                                documents/tokens in and out per source and filter,
                                                  dedup counts, skipped input, timings
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import DataConfig, SourceConfig, part_file_indices
from .dedup import MinHasher, exact_keys, keyed_batch, shingle_hashes
from .filters import check_batch, clean_batch, prepare_tables
from .merge import run_all, write_part_records
from .shards import ShardWriter
from .sources import Counts, iter_file, iter_source, max_doc_chars, no_match_detail
from .tokenizer import encode_document_array, get_tokenizer

log = logging.getLogger("linscale.data")
BATCH_CHARS = 2_000_000  # documents are sent to workers in batches of about this many characters
IN_FLIGHT = 4  # batches queued per worker: keeps workers busy while bounding memory
# order key = source << 52 | file << 32 | document in file: the global order the dedup keeps first
_FILE_BITS, _DOC_BITS = 20, 32


@dataclass
class _Batch:
    source: int
    language: str
    texts: list[str]
    keys: list[int]


@dataclass
class _Done:
    """A processed batch: the surviving documents and what the filters removed."""
    source: int
    removed: Counter = field(default_factory=Counter)
    removed_chars: Counter = field(default_factory=Counter)
    keys: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    sigs: np.ndarray | None = None
    bands: np.ndarray | None = None
    tokens: list[np.ndarray] = field(default_factory=list)
    chars_in: int = 0


_WORKER: dict = {}


def _init_worker(cfg: DataConfig, pooled: bool = False) -> None:
    if pooled:
        _keep_heap()
        # Ctrl-C reaches the whole process group: the parent alone handles it (it stops the pool); a
        # worker that also raised KeyboardInterrupt would print a traceback of its own mid-batch
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (forked with it)
        _die_with_parent()
    _WORKER["cfg"] = cfg
    _WORKER["minhash"] = MinHasher(cfg.dedup.num_perm, cfg.dedup.bands, cfg.dedup.seed)
    get_tokenizer()


def _die_with_parent() -> None:
    """A pool worker ends when the prepare process does, however that ends (SIGKILL included): otherwise
    it waits for its next batch forever, holding its memory. Linux only (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


class _TermAsInterrupt:
    """SIGTERM (kill, a job scheduler's stop) in the prepare process raises KeyboardInterrupt, as Ctrl-C
    does: the pool is shut down in `finally` (its workers would otherwise be left running, orphaned),
    nothing of the part is recorded as done, and prepare_data exits with `interrupted` (130). Only in
    the main thread and only where SIGTERM has its default action (a caller's own handler stays)."""

    def __enter__(self):
        import threading
        self.old = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self.old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
        return False


# glibc malloc: arrays up to this size come from the heap, and the heap keeps up to _TRIM bytes of free
# memory at its top instead of returning it to the system
_MMAP_THRESHOLD, _TRIM = 32 << 20, 256 << 20


def _keep_heap() -> None:
    """Lets a worker reuse its heap for the batch-sized numpy temporaries (several MB each, freed after
    every step) instead of mapping fresh pages for each: glibc's default returns such blocks to the
    system, and zeroing and faulting the pages back in cost ~5% of prepare's CPU time. Pool workers only
    (the caller's process keeps its settings); a no-op where the C library is not glibc."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, _MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (32 MiB is glibc's largest allowed value)
    mallopt(-1, _TRIM)  # M_TRIM_THRESHOLD


def _process(batch: _Batch) -> _Done:
    """Clean, filter, hash and tokenize one batch (runs in a worker)."""
    cfg: DataConfig = _WORKER["cfg"]
    mh: MinHasher = _WORKER["minhash"]
    out = _Done(batch.source)
    out.chars_in = sum(map(len, batch.texts))
    texts = clean_batch(batch.texts)
    kb = keyed_batch(texts, batch.language)  # dedup keys and units, shared by the filters and dedup
    kept: list[int] = []
    for i, (text, key, reason) in enumerate(zip(texts, batch.keys, check_batch(texts, batch.language,
                                                                                 cfg.filters, kb))):
        if reason:
            out.removed[reason] += 1
            out.removed_chars[reason] += len(text)
            continue
        kept.append(i)
        out.keys.append(key)
    hashes = exact_keys(texts, kb)
    out.hashes = [hashes[i] for i in kept]
    if cfg.dedup.near:
        h, doc = shingle_hashes(kb, cfg.dedup.ngram, np.asarray(kept, np.int64))
        out.sigs = mh.signatures_flat(h, doc, len(kept))
        out.bands = mh.band_keys(out.sigs).reshape(-1, cfg.dedup.bands)
    kept = [texts[i] for i in kept]
    out.tokens = [encode_document_array(text) for text in kept]
    return out


def _ordered_map(pool: ProcessPoolExecutor, fn, items, window: int):
    """pool.map in input order with backpressure (map would submit the whole input at once, reading it
    ahead into memory). A worker that dies (the out-of-memory killer, a signal) raises
    BrokenProcessPool here instead of leaving the caller waiting for its batch forever."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield _result(pending.popleft())
    while pending:
        yield _result(pending.popleft())


def _result(future):
    try:
        return future.result()
    except BrokenProcessPool as err:
        raise RuntimeError("a prepare worker process died (killed by a signal: most often the out-of-memory "
                           "killer); nothing of this part was kept: run it again, with fewer --workers if "
                           "memory was short") from err


def _assigned_sources(cfg: DataConfig, part: int, num_parts: int):
    """(source index, config, (all files, patterns matching nothing)) for each source this part reads;
    None instead of files for a stream (`hf`), which one part reads whole."""
    for si, src in enumerate(cfg.sources):
        if src.type == "hf":
            if si % num_parts == part:  # a stream cannot be split by files: one part reads it all
                yield si, src, None
            continue
        files, missing = cfg.files(src)
        yield si, src, (files, missing)


def _batches(cfg: DataConfig, part: int, num_parts: int, counts: list[Counts]):
    for si, src, found in _assigned_sources(cfg, part, num_parts):
        texts, keys, size = [], [], 0
        if found is None:
            docs = ((t, (si << 52) | i) for i, (t, _) in enumerate(iter_source(cfg, src, counts[si])))
        else:
            files, missing = found
            if part == 0:
                for m in missing:
                    counts[si].skip("missing_files", m, no_match_detail(m))
            docs = _file_docs(cfg, src, si, files, part, num_parts, counts[si])
        for text, key in docs:
            texts.append(text)
            keys.append(key)
            size += len(text)
            if size >= BATCH_CHARS:
                yield _Batch(si, src.language, texts, keys)
                texts, keys, size = [], [], 0
        if texts:
            yield _Batch(si, src.language, texts, keys)


def _file_docs(cfg: DataConfig, src: SourceConfig, si: int, files: list[Path], part: int, num_parts: int,
               counts: Counts):
    for fi in part_file_indices(src, si, len(files), part, num_parts):
        if fi >= 1 << _FILE_BITS:
            raise ValueError(f"source {src.name!r} has more than {1 << _FILE_BITS} files")
        counts.files += 1
        for di, (text, _) in enumerate(iter_file(src, files[fi], counts, cfg.filters.max_line_bytes,
                                                 max_doc_chars(cfg))):
            if src.max_documents is not None and counts.raw_documents >= src.max_documents:
                return
            counts.raw_documents += 1
            counts.raw_chars += len(text)
            yield text, (si << 52) | (fi << _DOC_BITS) | di


def prepare_part(cfg: DataConfig, out: Path, part: int = 0, num_parts: int = 1, workers: int = 0,
                 progress: bool = True) -> dict:
    """Filter, hash and tokenize this part's share of the input into OUT/tokens and OUT/parts/part-<i>."""
    with _TermAsInterrupt():
        return _prepare_part(cfg, out, part, num_parts, workers, progress)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the platform has one (a Slurm task, taskset,
    a container's cpuset hold fewer than the machine), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _prepare_part(cfg: DataConfig, out: Path, part: int, num_parts: int, workers: int, progress: bool) -> dict:
    if not 0 <= part < num_parts:
        raise ValueError(f"part {part} is outside [0, {num_parts})")
    t0 = time.time()
    out = Path(out)
    pdir = out / "parts" / f"part-{part:05d}"
    _clear_part(cfg, out, part)
    pdir.mkdir(parents=True, exist_ok=True)
    inputs = cfg.part_inputs(part, num_parts)
    workers = workers or min(usable_cpus(), 8)
    counts = [Counts(s.name) for s in cfg.sources]
    removed = [Counter() for _ in cfg.sources]
    removed_chars = [Counter() for _ in cfg.sources]
    writers = [ShardWriter(out / "tokens", s.name, cfg.shard_tokens, prefix=f"p{part:05d}-")
               for s in cfg.sources]
    table: list[np.ndarray] = []  # per kept batch: int64 [documents, 5] (see merge.KEY...)
    band_rows: list[np.ndarray] = []
    sig_file = open(pdir / "sigs.u32", "wb")  # signatures stream to disk: no memory per document
    seen: set[int] = set()
    local_dups = [0] * len(cfg.sources)
    chars_in = tokens_out = 0
    bar = _Progress(f"prepare part {part}/{num_parts}") if progress else None
    get_tokenizer()  # loaded once here: forked workers share it instead of each parsing the BPE file
    prepare_tables()  # the same for the filters' character tables
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(cfg, True)) \
        if workers > 1 else None
    if pool is None:
        _init_worker(cfg)
    try:
        results = _ordered_map(pool, _process, _batches(cfg, part, num_parts, counts), IN_FLIGHT * workers) \
            if pool else map(_process, _batches(cfg, part, num_parts, counts))
        for done in results:
            si = done.source
            removed[si].update(done.removed)
            removed_chars[si].update(done.removed_chars)
            chars_in += done.chars_in
            w = writers[si]
            rows, keep = [], []
            for j, (key, h, toks) in enumerate(zip(done.keys, done.hashes, done.tokens)):
                if cfg.dedup.exact and h in seen:
                    local_dups[si] += 1
                    continue
                seen.add(h)
                shard, _ = w.add(toks)
                rows.append((key, np.uint64(h).astype(np.int64), len(toks), shard, w.last_offset))
                keep.append(j)
                tokens_out += len(toks)
            if rows:
                table.append(np.asarray(rows, np.int64).reshape(-1, 5))
                if cfg.dedup.near:
                    sig_file.write(np.ascontiguousarray(done.sigs[keep]).tobytes())
                    band_rows.append(done.bands[keep])
            if bar is not None:
                bar.update(done.chars_in, tokens_out)
    finally:
        if pool is not None:
            # queued batches are dropped; a batch a worker is on finishes (seconds), then the pool exits
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    sig_file.close()
    docs = np.concatenate(table) if table else np.zeros((0, 5), np.int64)
    np.save(pdir / "docs.npy", docs)
    bands = (np.concatenate(band_rows) if band_rows else np.zeros((0, cfg.dedup.bands), np.uint64)) \
        if cfg.dedup.near else None
    write_part_records(pdir, docs, bands, cfg.dedup.shards)
    sources = []
    for si, src in enumerate(cfg.sources):
        writers[si].close()
        sources.append({"name": src.name, "shards": writers[si].stems, "raw_documents": counts[si].raw_documents,
                        "raw_chars": counts[si].raw_chars, "files": counts[si].files,
                        "skipped_input": dict(counts[si].skipped), "removed_by_filter": dict(removed[si]),
                        "chars_removed_by_filter": dict(removed_chars[si]),
                        "exact_duplicates_in_part": local_dups[si], "documents": writers[si].documents,
                        "tokens": writers[si].tokens})
    info = {"part": part, "num_parts": num_parts, "config_fingerprint": cfg.fingerprint(), "inputs": inputs,
            "seconds": time.time() - t0, "workers": workers, "chars_in": chars_in, "tokens": tokens_out,
            "documents": len(docs), "sources": sources}
    (pdir / "part.json").write_text(json.dumps(info, indent=1))
    log.info("part %d/%d: %.1fM characters in, %.2fM tokens out, %.1f s (%.2fM tokens/s)", part, num_parts,
             chars_in / 1e6, tokens_out / 1e6, info["seconds"], tokens_out / max(info["seconds"], 1e-9) / 1e6)
    return info


def _clear_part(cfg: DataConfig, out: Path, part: int) -> None:
    """Before a part is (re)written: its completion record first (a part killed from here on is
    missing, not stale), then its files, and the merged dataset, whose indexes point into the token
    files about to be rewritten (the merge must run again over the new part)."""
    pdir = out / "parts" / f"part-{part:05d}"
    (pdir / "part.json").unlink(missing_ok=True)
    for f in (list(pdir.iterdir()) if pdir.is_dir() else []):
        f.unlink()
    for src in cfg.sources:
        for f in (out / "tokens" / src.name).glob(f"p{part:05d}-*"):
            f.unlink()
    merged = [d for d in ("train", "val", "merge", "stats.json") if (out / d).exists()]
    if merged:
        log.info("part %d is prepared again: removing the merged dataset's %s in %s (the merge runs again over "
                 "the new part)", part, ", ".join(merged), out)
    (out / "stats.json").unlink(missing_ok=True)
    for d in ("train", "val"):
        (out / d / "meta.json").unlink(missing_ok=True)  # first: a half-removed split is not a dataset
    for d in ("train", "val", "merge"):
        shutil.rmtree(out / d, ignore_errors=True)


def _clear_parts_from(cfg: DataConfig, out: Path, first: int) -> None:
    """Remove parts `first`, `first`+1, ... of OUT (records and token files): prepare run again on a used
    folder with a smaller --num-parts would otherwise leave them for the merge, which then refuses the
    mix of part counts after every part has been prepared (and the finished dataset removed)."""
    numbers = (d.name[len("part-"):] for d in (out / "parts").glob("part-*") if d.is_dir())
    stale = sorted(int(k) for k in numbers  # only the folders prepare names (part-00003), never a copy's
                   if k.isascii() and k.isdigit() and f"{int(k):05d}" == k and int(k) >= first)
    if stale:
        log.info("removing parts %s of an earlier prepare with more parts from %s", stale, out)
    for k in stale:
        _clear_part(cfg, out, k)
        (out / "parts" / f"part-{k:05d}").rmdir()
        for f in (out / "tokens").glob(f"*/p{k:05d}-*"):  # sources of an earlier config too
            f.unlink()


def merge(cfg: DataConfig, out: Path) -> dict:
    """Global dedup over all parts, the train/val split, the loader's indexes and stats.json: every stage
    of merge.py on this machine, one task after another."""
    t0 = time.time()
    stats = run_all(cfg, Path(out))
    stats["seconds"]["merge"] = time.time() - t0
    (Path(out) / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats


def summary(stats: dict) -> str:
    """A short human-readable table of stats.json."""
    lines = [f"{'source':<16}{'lang':<5}{'docs in':>10}{'filtered':>10}{'exact dup':>10}{'near dup':>10}"
             f"{'docs out':>10}{'tokens out':>14}{'share':>8}  skipped input"]
    top = max((s["weight"] for s in stats["sources"]), default=0.0) or 1.0  # scaled: 1e308 + 1e308 is inf
    wsum = sum(s["weight"] / top for s in stats["sources"]) or 1.0
    for s in stats["sources"]:
        lines.append(f"{s['name']:<16}{s['language']:<5}{s['documents_in']:>10}"
                     f"{sum(s['removed_by_filter'].values()):>10}{s['exact_duplicates']:>10}"
                     f"{s['near_duplicates']:>10}{sum(s['documents_out'].values()):>10}"
                     f"{sum(s['tokens_out'].values()):>14,}{s['weight'] / top / wsum:>8.1%}  "
                     f"{s['skipped_input'] or ''}")
    return "\n".join(lines)


def prepare(cfg: DataConfig, out: Path, workers: int = 0, part: int | None = None, num_parts: int = 1,
            do_merge: bool = True, progress: bool = True) -> dict | None:
    """One-machine default: every part in turn (usually one), then merge."""
    parts = range(num_parts) if part is None else [part]
    with _TermAsInterrupt():
        if part is None:  # every part is prepared here: parts of an earlier, larger --num-parts are stale
            _clear_parts_from(cfg, Path(out), num_parts)
        for p in parts:
            prepare_part(cfg, out, p, num_parts, workers, progress)
        return merge(cfg, out) if do_merge else None


PROGRESS_SECONDS = 60.0  # a progress line this often where stderr is not a terminal


class _Progress:
    """Progress of a part: a tqdm bar on a terminal; elsewhere (a batch job's log file, where tqdm draws
    nothing) an INFO line every PROGRESS_SECONDS, so that a part that runs for hours shows it is alive."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.chars = 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if getattr(sys.stderr, "isatty", lambda: False)():
            from tqdm import tqdm
            self.bar = tqdm(desc=desc, unit="ch", unit_scale=True, unit_divisor=1000, mininterval=1.0,
                            file=sys.stderr)

    def update(self, chars: int, tokens_out: int) -> None:
        self.chars += chars
        if self.bar is not None:
            self.bar.update(chars)
            self.bar.set_postfix_str(f"{tokens_out / 1e6:.1f}M tok")
            return
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            log.info("%s: %.1fM characters in, %.2fM tokens out, %.0f s (%.2fM characters/s)", self.desc,
                     self.chars / 1e6, tokens_out / 1e6, now - self.t0, self.chars / 1e6 / max(now - self.t0, 1e-9))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

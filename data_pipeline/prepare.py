"""Prepare a dataset: sources -> clean/filter -> tokenize -> token shards, then a merge step that dedups
across everything and writes the train/val document indexes.

Work splits in two ways. Within a part, worker processes clean, filter, hash and tokenize batches of
documents (results come back in input order, so the output is the same for any worker count). Across
parts (processes on several machines, or Slurm array tasks: `--part i --num-parts n`), part i takes
files i, i+n, i+2n... of every source's sorted file list; each part writes its own token files and
per-document keys. `merge` then reads every part's keys, removes exact and near duplicates (the first
document in the global order (source, file, document) survives) and writes:

    OUT/tokens/<source>/p<part>-<k>.tokens.bin    token files (written by the parts, shared by the splits)
    OUT/parts/part-<i>/...                        per-part document keys and counts (merge input)
    OUT/train/, OUT/val/                          meta.json + document indexes the loader reads
    OUT/stats.json                                documents/tokens in and out per source and filter,
                                                  dedup counts, skipped input, timings
"""
from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import DataConfig, SourceConfig, source_weights
from .dedup import MinHasher, exact_keys, keyed_batch, near_duplicates, shingles_batch
from .filters import FILTER_NAMES, check_batch, clean, prepare_tables
from .shards import ShardWriter, SourceMeta, order_digest, write_meta
from .sources import Counts, iter_file, iter_source
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


def _init_worker(cfg: DataConfig) -> None:
    _WORKER["cfg"] = cfg
    _WORKER["minhash"] = MinHasher(cfg.dedup.num_perm, cfg.dedup.bands, cfg.dedup.seed)
    get_tokenizer()


def _process(batch: _Batch) -> _Done:
    """Clean, filter, hash and tokenize one batch (runs in a worker)."""
    cfg: DataConfig = _WORKER["cfg"]
    mh: MinHasher = _WORKER["minhash"]
    out = _Done(batch.source)
    out.chars_in = sum(map(len, batch.texts))
    texts = [clean(t) for t in batch.texts]
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
        sh = shingles_batch(texts, batch.language, cfg.dedup.ngram, kb)
        out.sigs = mh.signatures([sh[i] for i in kept])
        out.bands = np.asarray([mh.band_keys(sig) for sig in out.sigs], dtype=np.uint64).reshape(-1, cfg.dedup.bands)
    kept = [texts[i] for i in kept]
    out.tokens = [encode_document_array(text) for text in kept]
    return out


def _ordered_map(pool, fn, items, window: int):
    """pool.imap with backpressure: imap's feeder thread would read the whole input ahead into memory."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


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
                    counts[si].skip("missing_files", m, "no file matches")
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
    for fi in range(part, len(files), num_parts):
        if fi >= 1 << _FILE_BITS:
            raise ValueError(f"source {src.name!r} has more than {1 << _FILE_BITS} files")
        counts.files += 1
        for di, (text, _) in enumerate(iter_file(src, files[fi], counts, cfg.filters.max_line_bytes)):
            if src.max_documents is not None and counts.raw_documents >= src.max_documents:
                return
            counts.raw_documents += 1
            counts.raw_chars += len(text)
            yield text, (si << 52) | (fi << _DOC_BITS) | di


def prepare_part(cfg: DataConfig, out: Path, part: int = 0, num_parts: int = 1, workers: int = 0,
                 progress: bool = True) -> dict:
    """Filter, hash and tokenize this part's share of the input into OUT/tokens and OUT/parts/part-<i>."""
    if not 0 <= part < num_parts:
        raise ValueError(f"part {part} is outside [0, {num_parts})")
    t0 = time.time()
    out = Path(out)
    pdir = out / "parts" / f"part-{part:05d}"
    pdir.mkdir(parents=True, exist_ok=True)
    workers = workers or min(os.cpu_count() or 1, 8)
    counts = [Counts(s.name) for s in cfg.sources]
    removed = [Counter() for _ in cfg.sources]
    removed_chars = [Counter() for _ in cfg.sources]
    writers = [ShardWriter(out / "tokens", s.name, cfg.shard_tokens, prefix=f"p{part:05d}-")
               for s in cfg.sources]
    recs = [{"keys": [], "hashes": [], "sigs": [], "bands": [], "shard": [], "row": []}
            for _ in cfg.sources]
    seen: set[int] = set()
    local_dups = [0] * len(cfg.sources)
    chars_in = tokens_out = 0
    bar = _bar(progress, f"prepare part {part}")
    get_tokenizer()  # loaded once here: forked workers share it instead of each parsing the BPE file
    prepare_tables()  # the same for the filters' character tables
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ctx.Pool(workers, _init_worker, (cfg,)) if workers > 1 else None
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
            r, w = recs[si], writers[si]
            for j, (key, h, toks) in enumerate(zip(done.keys, done.hashes, done.tokens)):
                if cfg.dedup.exact and h in seen:
                    local_dups[si] += 1
                    continue
                seen.add(h)
                shard, row = w.add(toks)
                r["keys"].append(key)
                r["hashes"].append(h)
                r["shard"].append(shard)
                r["row"].append(row)
                if cfg.dedup.near:
                    r["sigs"].append(done.sigs[j])
                    r["bands"].append(done.bands[j])
                tokens_out += len(toks)
            if bar is not None:
                bar.update(done.chars_in)
                bar.set_postfix_str(f"{tokens_out / 1e6:.1f}M tok")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    sources = []
    for si, src in enumerate(cfg.sources):
        writers[si].close()
        r = recs[si]
        np.savez(pdir / f"{src.name}.npz", keys=np.asarray(r["keys"], np.int64),
                 hashes=np.asarray(r["hashes"], np.uint64), shard=np.asarray(r["shard"], np.int32),
                 row=np.asarray(r["row"], np.int64),
                 sigs=np.asarray(r["sigs"], np.uint32).reshape(-1, cfg.dedup.num_perm),
                 bands=np.asarray(r["bands"], np.uint64).reshape(-1, cfg.dedup.bands))
        sources.append({"name": src.name, "shards": writers[si].stems, "raw_documents": counts[si].raw_documents,
                        "raw_chars": counts[si].raw_chars, "files": counts[si].files,
                        "skipped_input": dict(counts[si].skipped), "removed_by_filter": dict(removed[si]),
                        "chars_removed_by_filter": dict(removed_chars[si]),
                        "exact_duplicates_in_part": local_dups[si], "documents": writers[si].documents,
                        "tokens": writers[si].tokens})
    info = {"part": part, "num_parts": num_parts, "config_fingerprint": cfg.fingerprint(),
            "seconds": time.time() - t0, "workers": workers, "chars_in": chars_in, "tokens": tokens_out,
            "sources": sources}
    (pdir / "part.json").write_text(json.dumps(info, indent=1))
    log.info("part %d/%d: %.1fM characters in, %.2fM tokens out, %.1f s (%.2fM tokens/s)", part, num_parts,
             chars_in / 1e6, tokens_out / 1e6, info["seconds"], tokens_out / max(info["seconds"], 1e-9) / 1e6)
    return info


def merge(cfg: DataConfig, out: Path) -> dict:
    """Global dedup over all parts, the train/val split, and the loader's indexes and stats.json."""
    t0 = time.time()
    out = Path(out)
    parts = []
    for pj in sorted((out / "parts").glob("part-*/part.json")):
        parts.append((pj.parent, json.loads(pj.read_text())))
    if not parts:
        raise FileNotFoundError(f"no prepared parts under {out / 'parts'}; run the parts first")
    n_parts = parts[0][1]["num_parts"]
    have = sorted(p["part"] for _, p in parts)
    if have != list(range(n_parts)):
        raise ValueError(f"{out}: parts {sorted(set(range(n_parts)) - set(have))} of {n_parts} are missing")
    if any(p["config_fingerprint"] != cfg.fingerprint() for _, p in parts):
        raise ValueError(f"{out}: parts were prepared with another data config; prepare them again")
    # every document of every part, in one table
    cols = {k: [] for k in ("keys", "hashes", "shard", "row", "sigs", "bands", "part", "source")}
    for pdir, info in parts:
        for si, src in enumerate(cfg.sources):
            z = np.load(pdir / f"{src.name}.npz")
            n = len(z["keys"])
            for k in ("keys", "hashes", "shard", "row", "sigs", "bands"):
                cols[k].append(z[k])
            cols["part"].append(np.full(n, info["part"], np.int32))
            cols["source"].append(np.full(n, si, np.int32))
    t = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    n = len(t["keys"])
    drop_exact = np.zeros(n, bool)
    if cfg.dedup.exact and n:
        order = np.lexsort((t["keys"], t["hashes"]))
        h = t["hashes"][order]
        drop_exact[order[1:][h[1:] == h[:-1]]] = True
    drop_near = np.zeros(n, bool)
    if cfg.dedup.near and n:
        live = np.nonzero(~drop_exact)[0]
        drop_near[live] = near_duplicates(t["keys"][live], t["bands"][live], t["sigs"][live],
                                          cfg.dedup.threshold)
    keep = ~(drop_exact | drop_near)
    is_val = (t["hashes"] % np.uint64(1_000_000)) < np.uint64(round(cfg.val_fraction * 1_000_000))
    # token counts of kept documents decide the language split of the mix
    lengths = np.zeros(n, np.int64)
    part_shards: dict[tuple[int, int], list[str]] = {}
    for pdir, info in parts:
        for si, s in enumerate(info["sources"]):
            part_shards[(info["part"], si)] = s["shards"]
    doc_tables: dict[str, np.ndarray] = {}
    for i in range(n):
        stem = part_shards[(int(t["part"][i]), int(t["source"][i]))][int(t["shard"][i])]
        if stem not in doc_tables:
            doc_tables[stem] = np.load(out / "tokens" / f"{stem}.docs.npy")
        lengths[i] = doc_tables[stem][t["row"][i], 1]
    weights = {}
    for split, mask in (("train", keep & ~is_val), ("val", keep & is_val)):
        # each split's mix by language holds among the sources it has (a small source may have no val)
        tokens = {s.name: int(lengths[mask & (t["source"] == si)].sum()) for si, s in enumerate(cfg.sources)}
        present = [s for s in cfg.sources if tokens[s.name] > 0]
        w = source_weights(dataclasses.replace(cfg, sources=present), tokens) if present else {}
        weights.setdefault("train", w)
        metas = []
        for si, src in enumerate(cfg.sources):
            sel = np.nonzero(mask & (t["source"] == si))[0]
            sel = sel[np.argsort(t["keys"][sel], kind="stable")]  # the global order, whatever the parts
            metas.append(_write_index(out, split, src, w.get(src.name, 0.0), sel, t, part_shards, doc_tables, si))
        write_meta(out / split, metas, {"label": f"{cfg.name} [{split}]", "config_fingerprint": cfg.fingerprint()})
    stats = _stats(cfg, parts, t, drop_exact, drop_near, keep, is_val, lengths, weights["train"], time.time() - t0)
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats


def _write_index(out: Path, split: str, src, weight: float, sel: np.ndarray, t: dict, part_shards: dict,
                 doc_tables: dict, si: int) -> SourceMeta:
    """A source's index for one split: its documents `sel` (in global order) as offsets into all of the
    source's token files laid end to end (every part's, sorted by name)."""
    stems = sorted(stem for (p, s_), lst in part_shards.items() if s_ == si for stem in lst)
    sizes = [(out / "tokens" / f"{stem}.tokens.bin").stat().st_size // 4 for stem in stems]
    file_no = {stem: k for k, stem in enumerate(stems)}
    file_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.zeros((len(sel), 2), np.int64)
    for j, i in enumerate(sel):
        stem = part_shards[(int(t["part"][i]), si)][int(t["shard"][i])]
        off, length = doc_tables[stem][t["row"][i]]
        rows[j] = (file_start[file_no[stem]] + off, length)
    (out / split).mkdir(parents=True, exist_ok=True)
    name = f"{src.name}.index.npy"
    np.save(out / split / name, rows)
    return SourceMeta(src.name, src.language, weight, [], len(rows), int(rows[:, 1].sum()),
                      [f"../tokens/{stem}.tokens.bin" for stem in stems], sizes, name,
                      order_digest(t["keys"][sel], rows[:, 1]))


def _stats(cfg, parts, t, drop_exact, drop_near, keep, is_val, lengths, weights, merge_s) -> dict:
    per_source = []
    for si, src in enumerate(cfg.sources):
        infos = [p["sources"][si] for _, p in parts]
        mine = t["source"] == si
        skipped, removed, removed_chars = Counter(), Counter(), Counter()
        for s in infos:
            skipped.update(s["skipped_input"])
            removed.update(s["removed_by_filter"])
            removed_chars.update(s["chars_removed_by_filter"])
        per_source.append({
            "name": src.name, "language": src.language, "weight": weights.get(src.name, 0.0),
            "files": sum(s["files"] for s in infos),
            "documents_in": sum(s["raw_documents"] for s in infos),
            "chars_in": sum(s["raw_chars"] for s in infos),
            "skipped_input": dict(skipped),
            "removed_by_filter": {k: removed.get(k, 0) for k in FILTER_NAMES},
            "chars_removed_by_filter": {k: removed_chars.get(k, 0) for k in FILTER_NAMES},
            "exact_duplicates": int(drop_exact[mine].sum()) + sum(s["exact_duplicates_in_part"] for s in infos),
            "near_duplicates": int(drop_near[mine].sum()),
            "documents_out": {"train": int((keep & ~is_val & mine).sum()), "val": int((keep & is_val & mine).sum())},
            "tokens_out": {"train": int(lengths[keep & ~is_val & mine].sum()),
                           "val": int(lengths[keep & is_val & mine].sum())},
            "tokens_written_before_global_dedup": sum(s["tokens"] for s in infos),
        })
    return {"config": cfg.name, "config_fingerprint": cfg.fingerprint(), "parts": len(parts),
            "seconds": {"parts": [p["seconds"] for _, p in parts], "merge": merge_s},
            "dedup": {"exact": cfg.dedup.exact, "near": cfg.dedup.near, "threshold": cfg.dedup.threshold},
            "sources": per_source}


def summary(stats: dict) -> str:
    """A short human-readable table of stats.json."""
    lines = [f"{'source':<16}{'lang':<5}{'docs in':>10}{'filtered':>10}{'exact dup':>10}{'near dup':>10}"
             f"{'docs out':>10}{'tokens out':>14}{'share':>8}  skipped input"]
    wsum = sum(s["weight"] for s in stats["sources"]) or 1.0
    for s in stats["sources"]:
        lines.append(f"{s['name']:<16}{s['language']:<5}{s['documents_in']:>10}"
                     f"{sum(s['removed_by_filter'].values()):>10}{s['exact_duplicates']:>10}"
                     f"{s['near_duplicates']:>10}{sum(s['documents_out'].values()):>10}"
                     f"{sum(s['tokens_out'].values()):>14,}{s['weight'] / wsum:>8.1%}  "
                     f"{s['skipped_input'] or ''}")
    return "\n".join(lines)


def prepare(cfg: DataConfig, out: Path, workers: int = 0, part: int | None = None, num_parts: int = 1,
            do_merge: bool = True, progress: bool = True) -> dict | None:
    """One-machine default: every part in turn (usually one), then merge."""
    parts = range(num_parts) if part is None else [part]
    for p in parts:
        prepare_part(cfg, out, p, num_parts, workers, progress)
    return merge(cfg, out) if do_merge else None


def _bar(progress: bool, desc: str):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(desc=desc, unit="ch", unit_scale=True, unit_divisor=1000, mininterval=1.0,
                disable=None, file=sys.stderr)

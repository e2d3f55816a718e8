"""The merge after the prepare parts: global exact and near dedup, the train/val split, the loader's
indexes and stats.json, as stages of independent tasks (run here one after another, or as Slurm array
jobs, one task per array index; see docs/data.md):

    stage       tasks               reads                                   writes (OUT/merge/)
    exact       shards              every part's exact records of shard s   exact-<s>.npy: keys to drop
    pairs       bands x shards      every part's band-b records of shard s, pairs-<b>-<s>.npy: verified
                                    the signatures of multi-document          (member, center) pairs
                                    buckets (memory-mapped)
    components  1                   every pairs file, one batch at a time   near.npy: keys to drop
    index       sources             the parts' document tables, the drop    <source>.json; the source's
                                    lists of that source                      train/val indexes
    finish      1                   <source>.json of every source           meta.json of each split,
                                                                              stats.json

A part (prepare.prepare_part) writes, besides its token files, a document table in its key order
(global key = source << 52 | file << 32 | document in file, so the first document in the global order
is the smallest key), its MinHash signatures (raw uint32 [documents, num_perm]) and its exact and band
records already split into `dedup.shards` shards by hash. Every task reads one shard of every part,
so its memory is that shard's records (24 bytes a document a band; 16 for exact), not the corpus.

Near duplicates: within an LSH bucket (documents agreeing on a whole band), in key order, each
document is compared with the bucket's *centers*, the earlier documents that matched no earlier
center; it is linked to every center whose signature agreement reaches the threshold, and becomes a
center itself if it matched none. There is no cap on a bucket's size, so a cluster of any size ends in
one component. The components of all links (over all bands) keep their smallest key (the first in the
global order); every other member is dropped. An exact duplicate has its survivor's signature, so it
joins that survivor's component and changes nothing else; it is counted as exact.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np

from .config import DataConfig, source_weights
from .shards import SourceMeta, write_meta

log = logging.getLogger("linscale.data")
STAGES = ("exact", "pairs", "components", "index", "finish")
# columns of a part's document table (int64): global key, exact hash (bits), tokens, token file number
# in the part's writer for the source, offset in that file
KEY, HASH, LENGTH, SHARD, OFFSET = range(5)
_ROW_BITS = 40  # a signature's location: part << 40 | row


def shard_of(h: np.ndarray, shards: int) -> np.ndarray:
    """Shard of a hash or band key (the top bits; the bottom ones order the records within a shard)."""
    return ((h.astype(np.uint64) >> np.uint64(32)) * np.uint64(shards)) >> np.uint64(32)


def write_part_records(pdir: Path, docs: np.ndarray, bands: np.ndarray | None, shards: int) -> None:
    """A part's exact and band records, each file sorted by (shard, hash, key) with the shard
    boundaries beside it, so a merge task reads one contiguous slice of every part."""
    keys = docs[:, KEY]
    hashes = docs[:, HASH].view(np.uint64)
    _save_sharded(pdir / "exact", np.stack([hashes, keys.view(np.uint64)], 1), shards)
    if bands is not None:
        rows = np.arange(len(docs), dtype=np.uint64)
        for b in range(bands.shape[1]):
            _save_sharded(pdir / f"band-{b:03d}", np.stack([bands[:, b], keys.view(np.uint64), rows], 1), shards)


def _save_sharded(stem: Path, rec: np.ndarray, shards: int) -> None:
    s = shard_of(rec[:, 0], shards)
    order = np.lexsort((rec[:, 1].view(np.int64), rec[:, 0], s))
    np.save(f"{stem}.npy", rec[order])
    np.save(f"{stem}.offsets.npy", np.searchsorted(s[order], np.arange(shards + 1)).astype(np.int64))


class Parts:
    """The prepared parts of OUT, checked complete and made from this config."""

    def __init__(self, cfg: DataConfig, out: Path):
        self.cfg, self.out = cfg, Path(out)
        infos = [json.loads(p.read_text()) for p in sorted((self.out / "parts").glob("part-*/part.json"))]
        if not infos:
            raise FileNotFoundError(f"no prepared parts under {self.out / 'parts'}; run the parts first")
        counts = sorted({i["num_parts"] for i in infos})
        if len(counts) > 1:
            by = {c: sorted(i["part"] for i in infos if i["num_parts"] == c) for c in counts}
            raise ValueError(f"{self.out}: its parts were prepared with different --num-parts ("
                             + "; ".join(f"--num-parts {c}: parts {v}" for c, v in by.items())
                             + "); prepare every part with one --num-parts, into a fresh --out")
        n = counts[0]
        have = sorted(i["part"] for i in infos)
        if have != list(range(n)):
            raise ValueError(f"{self.out}: parts {sorted(set(range(n)) - set(have))} of {n} are missing "
                             f"(not prepared, or stopped before they finished); run them before the merge")
        if any(i["config_fingerprint"] != cfg.fingerprint() for i in infos):
            raise ValueError(f"{self.out}: parts were prepared with another data config; prepare them again")
        listed = {si: cfg.files(src)[0] for si, src in enumerate(cfg.sources) if src.type != "hf"}  # once
        stale = [i["part"] for i in infos if i.get("inputs") != cfg.part_inputs(i["part"], n, listed)]
        if stale:
            raise ValueError(f"{self.out}: parts {stale} of {n} were prepared from other input files than the "
                             f"config's paths hold now (files added, removed or changed since); prepare those "
                             f"parts again (--part i --num-parts {n}), or every part if files were added or removed")
        self.infos = infos
        self.n = n
        self._maps: dict = {}  # memory maps reused across the tasks run in this process

    def dir(self, p: int) -> Path:
        return self.out / "parts" / f"part-{p:05d}"

    def records(self, name: str, shard: int) -> np.ndarray:
        """Shard `shard` of every part's `name` records (exact, band-<b>), parts in order."""
        out = []
        for p in range(self.n):
            if (p, name) not in self._maps:
                self._maps[(p, name)] = (np.load(self.dir(p) / f"{name}.offsets.npy"),
                                         np.load(self.dir(p) / f"{name}.npy", mmap_mode="r"))
            off, rec = self._maps[(p, name)]
            part = np.array(rec[off[shard]:off[shard + 1]])
            if name.startswith("band"):
                part[:, 2] |= np.uint64(p << _ROW_BITS)
            out.append(part)
        return np.concatenate(out) if out else np.zeros((0, 3), np.uint64)

    def docs(self, p: int) -> np.ndarray:
        return np.load(self.dir(p) / "docs.npy", mmap_mode="r")

    def sigs(self, p: int) -> np.ndarray:
        n = self.infos[p]["documents"]
        if n == 0:
            return np.zeros((0, self.cfg.dedup.num_perm), np.uint32)
        return np.memmap(self.dir(p) / "sigs.u32", dtype=np.uint32, mode="r", shape=(n, self.cfg.dedup.num_perm))


def plan(cfg: DataConfig) -> dict[str, int]:
    """Number of tasks of each stage (Slurm: --array=0-(n-1))."""
    s = cfg.dedup.shards
    return {"exact": s if cfg.dedup.exact else 0, "pairs": cfg.dedup.bands * s if cfg.dedup.near else 0,
            "components": 1 if cfg.dedup.near else 0, "index": len(cfg.sources), "finish": 1}


def run_task(cfg: DataConfig, out: Path, stage: str, task: int, parts: Parts | None = None) -> None:
    """One task of one stage; its output is written atomically, so a failed task is simply run again.
    `parts` (the Parts of out) may be shared by tasks run in one process."""
    n = plan(cfg).get(stage)
    if n is None:
        raise ValueError(f"unknown merge stage {stage!r}; the stages are {STAGES}")
    if not 0 <= task < n:
        raise ValueError(f"stage {stage} has {n} tasks (0..{n - 1}); got task {task}")
    t0 = time.time()
    parts = parts or Parts(cfg, out)
    mdir = Path(out) / "merge"
    mdir.mkdir(parents=True, exist_ok=True)
    if stage == "exact":
        _save(mdir / f"exact-{task:04d}.npy", exact_drops(parts.records("exact", task)))
    elif stage == "pairs":
        b, s = divmod(task, cfg.dedup.shards)
        _save(mdir / f"pairs-{b:03d}-{s:04d}.npy",
              verified_pairs(parts.records(f"band-{b:03d}", s), parts, cfg.dedup.threshold))
    elif stage == "components":
        _need(mdir, [f"pairs-{b:03d}-{s:04d}.npy" for b in range(cfg.dedup.bands) for s in range(cfg.dedup.shards)],
              "pairs")
        _save(mdir / "near.npy", component_drops_streamed(_PairFiles(
            [mdir / f"pairs-{b:03d}-{s:04d}.npy" for b in range(cfg.dedup.bands) for s in range(cfg.dedup.shards)])))
    elif stage == "index":
        _write_source(cfg, parts, mdir, task)
    else:
        _finish(cfg, parts, mdir)
    log.debug("merge %s task %d: %.2f s", stage, task, time.time() - t0)


def run_all(cfg: DataConfig, out: Path) -> dict:
    """Every stage's tasks here, one after another (the one-machine merge)."""
    parts = Parts(cfg, out)
    for stage, n in plan(cfg).items():
        t0 = time.time()
        if stage == "pairs" and n:
            mdir = Path(out) / "merge"
            mdir.mkdir(parents=True, exist_ok=True)
            _run_pairs_batched(cfg, parts, mdir)
        for task in range(n if stage != "pairs" else 0):
            run_task(cfg, out, stage, task, parts)
        log.info("merge stage %s: %d tasks, %.1f s", stage, n, time.time() - t0)
    return json.loads((Path(out) / "stats.json").read_text())


class _PairFiles:
    """The pairs files, read one at a time on each pass."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __iter__(self):
        return (np.load(p) for p in self.paths)


def _save(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(path)


def _need(mdir: Path, names: list[str], stage: str) -> None:
    missing = [n for n in names if not (mdir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{mdir}: {len(missing)} outputs of stage {stage!r} are missing (first: "
                                f"{missing[0]}); run that stage's tasks first")


def exact_drops(rec: np.ndarray) -> np.ndarray:
    """Keys to drop among (hash, key) records: all but the smallest key of each hash, sorted."""
    if not len(rec):
        return np.zeros(0, np.int64)
    rec = rec[np.lexsort((rec[:, 1].view(np.int64), rec[:, 0]))]
    dup = np.zeros(len(rec), bool)
    dup[1:] = rec[1:, 0] == rec[:-1, 0]
    return np.sort(rec[dup, 1].view(np.int64))


def verified_pairs(rec: np.ndarray, parts: Parts, threshold: float, chunk: int = 1 << 17) -> np.ndarray:
    """(member, center) key pairs of the buckets in (band key, key, location) records whose signature
    agreement reaches threshold (see the module docstring). Every member is first compared with its
    bucket's first document, all buckets at once; the buckets where some member does not match it
    (several clusters in one bucket) go through _link_to_centers_all, all of them at once."""
    return _verified_pairs(rec, parts, threshold, chunk)[0]


def _verified_pairs(rec: np.ndarray, parts: Parts, threshold: float, chunk: int = 1 << 17
                    ) -> tuple[np.ndarray, np.ndarray]:
    """verified_pairs() and the band key of each pair's bucket."""
    if len(rec) < 2:
        return np.zeros((0, 2), np.int64), np.zeros(0, np.uint64)
    rec = rec[np.lexsort((rec[:, 1].view(np.int64), rec[:, 0]))]
    start = np.flatnonzero(np.concatenate([[True], rec[1:, 0] != rec[:-1, 0]]))
    size = np.diff(np.append(start, len(rec)))
    multi = np.flatnonzero(size > 1)
    need = int(np.ceil(threshold * parts.cfg.dedup.num_perm - 1e-9))  # agreeing positions needed
    sig_maps: dict = {}
    out, band = [], []
    i = 0
    while i < len(multi):  # buckets in chunks of about `chunk` members: bounded memory
        j = i + max(1, int(np.searchsorted(np.cumsum(size[multi[i:]]), chunk)))
        bs = multi[i:j]
        first = np.repeat(start[bs], size[bs])
        members = first + np.arange(len(first)) - np.repeat(np.cumsum(size[bs]) - size[bs], size[bs])
        sigs = _signatures(rec[members, 2], parts, sig_maps)
        first_sig = sigs[np.repeat(np.cumsum(size[bs]) - size[bs], size[bs])]
        ok = np.count_nonzero(sigs == first_sig, axis=1) >= need
        others = members != first
        bucket_of = np.repeat(np.arange(len(bs)), size[bs])
        clean = np.ones(len(bs), bool)
        clean[bucket_of[others & ~ok]] = False
        sel = others & ok & clean[bucket_of]
        out.append(np.stack([rec[members[sel], 1].view(np.int64), rec[first[sel], 1].view(np.int64)], 1))
        band.append(rec[first[sel], 0])
        pos = np.cumsum(size[bs]) - size[bs]
        mixed = np.flatnonzero(~clean)  # several clusters share the bucket
        if len(mixed):
            m, c, k = _link_to_centers_all(sigs, pos[mixed], size[bs[mixed]], need)
            out.append(np.stack([rec[members[m], 1].view(np.int64), rec[members[c], 1].view(np.int64)], 1))
            band.append(rec[start[bs[mixed[k]]], 0])
        i = j
    if not out:
        return np.zeros((0, 2), np.int64), np.zeros(0, np.uint64)
    return np.concatenate(out), np.concatenate(band)


PAIRS_RECORDS = 1 << 20  # band records per verified_pairs call of the one-machine merge (24 MB)


def _run_pairs_batched(cfg: DataConfig, parts: Parts, mdir: Path) -> None:
    """Every pairs task of a band, with consecutive shards of it taken together up to PAIRS_RECORDS
    records per call: a shard's buckets never span shards and the pairs of each are split back by the
    shard of their band key, so each pairs file holds what its own task writes (the same rows; the
    same order wherever a shard's buckets fit in one verified_pairs chunk), at a fraction of the
    fixed cost of one call per shard on a small corpus, with memory still bounded."""
    shards = cfg.dedup.shards
    for b in range(cfg.dedup.bands):
        name = f"band-{b:03d}"
        s = 0
        while s < shards:
            group = [parts.records(name, s)]
            while s + len(group) < shards and sum(map(len, group)) < PAIRS_RECORDS:
                nxt = parts.records(name, s + len(group))
                if sum(map(len, group)) + len(nxt) > PAIRS_RECORDS:
                    break  # read again as the next group's first shard
                group.append(nxt)
            pairs, keys = _verified_pairs(np.concatenate(group), parts, cfg.dedup.threshold)
            of = shard_of(keys, shards)
            for g in range(len(group)):
                _save(mdir / f"pairs-{b:03d}-{s + g:04d}.npy", pairs[of == s + g])
            s += len(group)


def _signatures(loc: np.ndarray, parts: Parts, maps: dict) -> np.ndarray:
    part = (loc >> np.uint64(_ROW_BITS)).astype(np.int64)
    row = (loc & np.uint64((1 << _ROW_BITS) - 1)).astype(np.int64)
    out = np.empty((len(loc), parts.cfg.dedup.num_perm), np.uint32)
    for p in np.unique(part):
        if p not in maps:
            maps[p] = parts.sigs(int(p))
        sel = part == p
        out[sel] = maps[p][row[sel]]
    return out


def _link_to_centers_all(sigs: np.ndarray, pos: np.ndarray, size: np.ndarray, need: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The links of every bucket k (rows pos[k]..pos[k]+size[k]-1 of sigs, keys increasing): each row
    linked to every earlier center it matches (at least `need` agreeing signature positions); a row that
    matches none is a center. All buckets at once, one round per center rank, each round comparing
    every bucket's current center with the rows after it. Returns (member row, center row, bucket) of
    each link, sorted by bucket, then center, then member."""
    rb = np.repeat(np.arange(len(pos)), size)
    rows = np.repeat(pos - np.cumsum(size) + size, size) + np.arange(len(rb))
    cur = pos.copy()
    matched = np.zeros(len(sigs), bool)
    found = []
    r = 0
    while len(rows):
        after = rows > cur[rb]
        rows, rb = rows[after], rb[after]
        hit = np.count_nonzero(sigs[rows] == sigs[cur[rb]], axis=1) >= need
        found.append((rows[hit], cur[rb[hit]], rb[hit], np.full(int(hit.sum()), r)))
        matched[rows[hit]] = True
        # a later center is compared with every row after it, matched or not; a bucket's next center is
        # its first unmatched row after this one, and a bucket without one is done
        free = np.flatnonzero(~matched[rows])
        fb = rb[free]
        nxt = free[np.concatenate([[True], fb[1:] != fb[:-1]])] if len(free) else free
        live = np.zeros(len(pos), bool)
        live[rb[nxt]] = True
        cur[rb[nxt]] = rows[nxt]
        rows, rb = rows[live[rb]], rb[live[rb]]
        r += 1
    m, c, k, rnd = (np.concatenate(x) for x in zip(*found)) if found else (np.zeros(0, np.int64),) * 4
    order = np.lexsort((m, rnd, k))
    return m[order], c[order], k[order]


PAIRS_BATCH = 1 << 22  # pairs joined per union step of the components task (64 MB of pairs)


def component_drops(pairs: np.ndarray) -> np.ndarray:
    """Keys to drop: every member of a connected component of the pairs but its smallest key, sorted."""
    return component_drops_streamed([pairs])


def component_drops_streamed(chunks, batch: int = PAIRS_BATCH) -> np.ndarray:
    """component_drops() over the pairs of an iterable of [k, 2] key arrays (every pairs file of the
    stage; called twice, so a sequence or a re-iterable), holding at any time the keys that occur in
    pairs (8 bytes each) and their labels (8 bytes each), plus one batch of pairs: the same pair comes
    from every band its documents share, so all pairs at once would hold each one up to `bands` times.
    Union-find by hooking roots to the smaller root and pointer jumping, vectorized, one batch after
    another onto the same labels (the components, and so the result, do not depend on the batching)."""
    nodes = _distinct_keys(chunks, batch)
    if not len(nodes):
        return np.zeros(0, np.int64)
    parent = np.arange(len(nodes), dtype=np.int64)  # label = index of a key in sorted order
    buf: list[np.ndarray] = []
    size = 0
    for c in chunks:
        if len(c):
            buf.append(np.asarray(c, np.int64).reshape(-1, 2))
            size += len(buf[-1])
        if size >= batch:
            parent = _join(parent, nodes, np.concatenate(buf))
            buf, size = [], 0
    if buf:
        parent = _join(parent, nodes, np.concatenate(buf))
    return nodes[parent != np.arange(len(nodes))]


def _distinct_keys(chunks, batch: int) -> np.ndarray:
    """Sorted distinct keys of all chunks, merged in as they come (never all chunks' keys at once)."""
    nodes = np.zeros(0, np.int64)
    pending: list[np.ndarray] = []
    size = 0
    for c in chunks:
        if len(c):
            pending.append(_unique(np.asarray(c, np.int64)))
            size += len(pending[-1])
        if size >= max(batch, len(nodes)):
            nodes = _unique(np.concatenate([nodes] + pending))
            pending, size = [], 0
    return _unique(np.concatenate([nodes] + pending)) if pending else nodes


def _unique(x: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hash-based unique took 3x longer on these keys)."""
    x = np.sort(x, axis=None)
    keep = np.ones(len(x), bool)
    keep[1:] = x[1:] != x[:-1]
    return x[keep]


def _join(parent: np.ndarray, nodes: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Links the pairs into the forest `parent` (every node pointing at its root, a component's root its
    smallest label) and returns it in the same state."""
    a, b = np.searchsorted(nodes, pairs[:, 0]), np.searchsorted(nodes, pairs[:, 1])
    del pairs
    while True:
        ra, rb = parent[a], parent[b]
        diff = ra != rb
        if not diff.any():
            return parent
        a, b, ra, rb = a[diff], b[diff], ra[diff], rb[diff]  # pairs already joined stay joined
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))  # hook the larger root under the smaller
        while True:  # pointer jumping until every node points at a root
            nxt = parent[parent]
            if np.array_equal(nxt, parent):
                break
            parent = nxt


def _write_source(cfg: DataConfig, parts: Parts, mdir: Path, si: int) -> None:
    """The train and val indexes of source si: its surviving documents in key order, file by file (each
    input file belongs to one part, whose table is in key order), as offsets into all of the source's
    token files laid end to end; two streaming passes (count, then fill), memory per file."""
    src = cfg.sources[si]
    lo, hi = si << 52, (si + 1) << 52
    exact_files = [f"exact-{t:04d}.npy" for t in range(plan(cfg)["exact"])]
    _need(mdir, exact_files, "exact")
    if cfg.dedup.near:
        _need(mdir, ["near.npy"], "components")
    drops = [np.load(mdir / f) for f in exact_files]
    exact = np.sort(np.concatenate(drops)) if drops else np.zeros(0, np.int64)
    exact = exact[(exact >= lo) & (exact < hi)]
    near = np.load(mdir / "near.npy") if cfg.dedup.near else np.zeros(0, np.int64)
    near = near[(near >= lo) & (near < hi)]
    near = np.setdiff1d(near, exact, assume_unique=True)
    stems, sizes, file_no = [], [], {}
    for p in range(parts.n):
        for k, stem in enumerate(parts.infos[p]["sources"][si]["shards"]):
            stems.append((stem, p, k))
    stems.sort()
    for j, (stem, p, k) in enumerate(stems):
        file_no[(p, k)] = j
        sizes.append((parts.out / "tokens" / f"{stem}.tokens.bin").stat().st_size // 4)
    file_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    threshold = np.uint64(round(cfg.val_fraction * 1_000_000))

    tables = [parts.docs(p) for p in range(parts.n)]
    bounds = [np.searchsorted(t[:, KEY], [lo, hi]) for t in tables]
    # the source's input files in order, each with the part that read it
    files = sorted((int(f), p) for p, (t, (a, b)) in enumerate(zip(tables, bounds))
                   for f in np.unique(np.asarray(t[a:b, KEY]) >> 32 & 0xFFFFF))
    file_of = [np.array([file_no[(p, k)] for k in range(len(parts.infos[p]["sources"][si]["shards"]))] or [0],
                        np.int64) for p in range(parts.n)]

    def chunks():
        """(part, document rows of this source) in key order: one input file at a time."""
        for f, p in files:
            t, (a, b) = tables[p], bounds[p]
            i, j = np.searchsorted(t[a:b, KEY], [lo | (f << 32), lo | ((f + 1) << 32)]) + a
            if j > i:
                yield p, np.asarray(t[i:j])

    def split_masks(rows):
        keep = ~np.isin(rows[:, KEY], exact) & ~np.isin(rows[:, KEY], near)
        val = (rows[:, HASH].view(np.uint64) % np.uint64(1_000_000)) < threshold
        return keep & ~val, keep & val

    counts = {"train": 0, "val": 0}
    for _, rows in chunks():
        tr, va = split_masks(rows)
        counts["train"] += int(tr.sum())
        counts["val"] += int(va.sum())
    from numpy.lib.format import open_memmap
    from .shards import OrderDigest
    index, digests, tokens, pos = {}, {}, {}, {"train": 0, "val": 0}
    for split in ("train", "val"):
        (parts.out / split).mkdir(parents=True, exist_ok=True)
        index[split] = open_memmap(parts.out / split / f"{src.name}.index.npy.tmp", mode="w+", dtype=np.int64,
                                   shape=(counts[split], 2))
        digests[split] = OrderDigest()
        tokens[split] = 0
    for p, rows in chunks():
        glob_off = file_start[file_of[p][rows[:, SHARD]]] + rows[:, OFFSET]
        for split, mask in zip(("train", "val"), split_masks(rows)):
            m = int(mask.sum())
            if m:
                index[split][pos[split]:pos[split] + m, 0] = glob_off[mask]
                index[split][pos[split]:pos[split] + m, 1] = rows[mask, LENGTH]
                digests[split].update(rows[mask, KEY], rows[mask, LENGTH])
                tokens[split] += int(rows[mask, LENGTH].sum())
                pos[split] += m
    result = {"source": src.name, "exact_duplicates": len(exact), "near_duplicates": len(near), "splits": {}}
    for split in ("train", "val"):
        index[split].flush()
        del index[split]
        tmp = parts.out / split / f"{src.name}.index.npy.tmp"
        tmp.replace(parts.out / split / f"{src.name}.index.npy")
        result["splits"][split] = {"documents": counts[split], "tokens": tokens[split],
                                   "index": f"{src.name}.index.npy", "order": digests[split].hexdigest(),
                                   "token_files": [f"../tokens/{s}.tokens.bin" for s, _, _ in stems],
                                   "token_file_tokens": sizes}
    tmp = mdir / f"source-{si:04d}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(mdir / f"source-{si:04d}.json")


def _finish(cfg: DataConfig, parts: Parts, mdir: Path) -> None:
    _need(mdir, [f"source-{si:04d}.json" for si in range(len(cfg.sources))], "index")
    res = [json.loads((mdir / f"source-{si:04d}.json").read_text()) for si in range(len(cfg.sources))]
    weights = {}
    for split in ("train", "val"):
        # each split's language mix holds among the sources it has (a small source may have no val)
        tokens = {s.name: r["splits"][split]["tokens"] for s, r in zip(cfg.sources, res)}
        present = [s for s in cfg.sources if tokens[s.name] > 0]
        w = source_weights(dataclasses.replace(cfg, sources=present), tokens) if present else {}
        weights.setdefault("train", w)
        metas = []
        for s, r in zip(cfg.sources, res):
            d = r["splits"][split]
            metas.append(SourceMeta(s.name, s.language, w.get(s.name, 0.0), [], d["documents"], d["tokens"],
                                    d["token_files"], d["token_file_tokens"], d["index"], d["order"]))
        write_meta(parts.out / split, metas, {"label": f"{cfg.name} [{split}]",
                                               "config_fingerprint": cfg.fingerprint()})
    stats = _stats(cfg, parts, res, weights["train"])
    (parts.out / "stats.json").write_text(json.dumps(stats, indent=1))


def _stats(cfg: DataConfig, parts: Parts, res: list[dict], weights: dict) -> dict:
    from .filters import FILTER_NAMES
    per_source = []
    for si, (src, r) in enumerate(zip(cfg.sources, res)):
        infos = [p["sources"][si] for p in parts.infos]
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
            "exact_duplicates": r["exact_duplicates"] + sum(s["exact_duplicates_in_part"] for s in infos),
            "near_duplicates": r["near_duplicates"],
            "documents_out": {k: r["splits"][k]["documents"] for k in ("train", "val")},
            "tokens_out": {k: r["splits"][k]["tokens"] for k in ("train", "val")},
            "tokens_written_before_global_dedup": sum(s["tokens"] for s in infos),
        })
    return {"config": cfg.name, "config_fingerprint": cfg.fingerprint(), "parts": parts.n,
            "seconds": {"parts": [p["seconds"] for p in parts.infos]},
            "dedup": {"exact": cfg.dedup.exact, "near": cfg.dedup.near, "threshold": cfg.dedup.threshold},
            "sources": per_source}

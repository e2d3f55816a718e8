"""The staged merge: the same drops as a one-process reference merge (no bucket cap), no surviving
copies of a large cluster, the stages' building blocks against plain Python, the Slurm-style CLI
steps against one prepare run."""
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import build_loader
from data_pipeline.config import parse_data_config
from data_pipeline.merge import Parts, component_drops, component_drops_streamed, exact_drops, plan, run_task
from data_pipeline.prepare import prepare
from data_utils import english_text

sys.path.insert(0, str(Path(__file__).parent))
from test_data_pipeline import _output_docs, _planted_corpus  # noqa: E402


def reference_near_duplicates(order, bands, sigs, threshold):
    """A single-process merge: a union-find over LSH buckets, each document linked to the first earlier
    member of its bucket whose signature agreement reaches the threshold, buckets of any size. Returns
    the mask of documents to drop."""
    n = len(order)
    parent = np.arange(n)

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rank = np.argsort(order, kind="stable")
    pos = np.empty(n, np.int64)
    pos[rank] = np.arange(n)
    for b in range(bands.shape[1] if n else 0):
        keys = bands[:, b]
        by_key = np.lexsort((pos, keys))
        bounds = np.nonzero(np.diff(keys[by_key]))[0] + 1
        for group in np.split(by_key, bounds):
            for j in range(1, len(group)):
                g = group[j]
                for h in group[:j]:
                    if find(g) == find(h):
                        break
                    if np.mean(sigs[g] == sigs[h]) >= threshold:
                        ra, rb = find(g), find(h)
                        if pos[ra] < pos[rb]:
                            parent[rb] = ra
                        else:
                            parent[ra] = rb
                        break
    roots = np.fromiter((find(i) for i in range(n)), dtype=np.int64, count=n)
    return roots != np.arange(n)


def _part_tables(cfg, out):
    """Every part's keys, hashes, signatures and band keys, in one table."""
    parts = Parts(cfg, out)
    keys, hashes, sigs, bands = [], [], [], []
    for p in range(parts.n):
        docs = np.asarray(parts.docs(p))
        keys.append(docs[:, 0])
        hashes.append(docs[:, 1].view(np.uint64))
        sigs.append(np.asarray(parts.sigs(p)))
        b = np.zeros((len(docs), cfg.dedup.bands), np.uint64)
        for k in range(cfg.dedup.bands):
            rec = np.load(parts.dir(p) / f"band-{k:03d}.npy")
            b[rec[:, 2].astype(np.int64), k] = rec[:, 0]
        bands.append(b)
    return np.concatenate(keys), np.concatenate(hashes), np.concatenate(sigs), np.concatenate(bands)


@pytest.mark.parametrize("num_parts", [1, 3])
def test_staged_merge_drops_what_the_single_process_merge_drops(shared_data, tmp_path, num_parts):
    _planted_corpus(shared_data, tmp_path, random.Random(3))
    cfg = parse_data_config({"name": "m", "val_fraction": 0, "dedup": {"shards": 3}, "sources": [
        {"name": lang, "language": lang, "type": "jsonl", "paths": [str(tmp_path / f"?_{lang}.jsonl")]}
        for lang in ("en", "zh")]})
    out = tmp_path / "ds"
    for p in range(num_parts):
        prepare(cfg, out, workers=1, part=p, num_parts=num_parts, do_merge=False, progress=False)
    for stage, n in plan(cfg).items():  # as separate array tasks would, in any order within a stage
        for task in random.Random(num_parts).sample(range(n), n):
            run_task(cfg, out, stage, task)
    keys, hashes, sigs, bands = _part_tables(cfg, out)
    order = np.lexsort((keys, hashes))
    dup = np.zeros(len(keys), bool)
    dup[order[1:][hashes[order][1:] == hashes[order][:-1]]] = True
    live = np.flatnonzero(~dup)
    near = np.zeros(len(keys), bool)
    near[live] = reference_near_duplicates(keys[live], bands[live], sigs[live], cfg.dedup.threshold)
    got_exact = np.concatenate([np.load(f) for f in sorted((out / "merge").glob("exact-*.npy"))])
    got_near = np.setdiff1d(np.load(out / "merge" / "near.npy"), got_exact)
    assert sorted(got_exact.tolist()) == sorted(keys[dup].tolist())
    assert sorted(got_near.tolist()) == sorted(keys[near].tolist())
    # the planted duplicates are there to find (exact copies across parts: one part drops its own)
    assert near.sum() > 20 and (dup.sum() > 20 or num_parts == 1)
    stats = json.loads((out / "stats.json").read_text())
    assert sum(s["near_duplicates"] for s in stats["sources"]) == near.sum()


@pytest.mark.parametrize("budget,calls", [(1, 5), (150, None), (1 << 20, 1)])
def test_grouped_pairs_tasks_write_what_each_task_writes(shared_data, tmp_path, monkeypatch, budget, calls):
    """The one-machine merge runs a band's pairs tasks in groups of shards (up to PAIRS_RECORDS band
    records): every pairs file is byte for byte the one its own task writes, for groups of one shard,
    of some and of all."""
    from data_pipeline import merge
    _planted_corpus(shared_data, tmp_path, random.Random(5))
    cfg = parse_data_config({"name": "m", "val_fraction": 0, "dedup": {"shards": 5}, "sources": [
        {"name": lang, "language": lang, "type": "jsonl", "paths": [str(tmp_path / f"?_{lang}.jsonl")]}
        for lang in ("en", "zh")]})
    out = tmp_path / "ds"
    prepare(cfg, out, workers=1, do_merge=False, progress=False)
    for task in range(plan(cfg)["pairs"]):
        run_task(cfg, out, "pairs", task)
    monkeypatch.setattr(merge, "PAIRS_RECORDS", budget)
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    seen = []
    inner = merge._verified_pairs
    monkeypatch.setattr(merge, "_verified_pairs", lambda rec, *a: seen.append(len(rec)) or inner(rec, *a))
    merge._run_pairs_batched(cfg, Parts(cfg, out), grouped)
    per_band = len(seen) / cfg.dedup.bands  # verified_pairs calls per band: 5 shards in groups
    assert per_band == calls if calls else 1 < per_band < 5
    names = sorted(f.name for f in (out / "merge").glob("pairs-*.npy"))
    assert names == sorted(f.name for f in grouped.glob("pairs-*.npy"))
    assert len(names) == cfg.dedup.bands * 5
    assert sum(len(np.load(out / "merge" / n)) for n in names) > 20  # pairs to compare
    for n in names:
        assert (out / "merge" / n).read_bytes() == (grouped / n).read_bytes(), n


def test_a_large_near_duplicate_cluster_leaves_one(tmp_path):
    """400 copies of a templated page, each with a few words changed (Jaccard ~0.9-0.97 to each other),
    among distinct pages: one copy survives, the first, and every distinct page stays."""
    rng = random.Random(11)
    template = english_text(rng, 400).split(" ")
    copies = []
    for _ in range(400):
        words = list(template)
        for i in rng.sample(range(len(words)), 3):
            words[i] = rng.choice(["blue", "seven", "river", "quietly", "north", "copper"])
        copies.append(" ".join(words))
    distinct = [english_text(rng, 300) for _ in range(40)]
    with open(tmp_path / "a.jsonl", "w") as f:
        for d in copies[:200] + distinct + copies[200:]:
            f.write(json.dumps({"text": d}) + "\n")
    cfg = parse_data_config({"name": "c", "val_fraction": 0, "dedup": {"exact": True, "near": True},
                             "sources": [{"name": "s", "language": "en", "type": "jsonl",
                                          "paths": [str(tmp_path / "a.jsonl")]}]})
    stats = prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    kept = _output_docs(tmp_path / "ds" / "train")["s"]
    assert sum(k in set(copies) for k in kept) == 1 and copies[0] in kept
    assert all(d in kept for d in distinct)
    assert stats["sources"][0]["near_duplicates"] + stats["sources"][0]["exact_duplicates"] == 399


def test_links_to_centers_against_plain_python():
    """Buckets of several clusters (members near two prototypes at once included): each member is linked
    to every earlier center it matches, and one that matches none becomes a center."""
    from data_pipeline.merge import _link_to_centers_all
    rng = np.random.default_rng(4)
    for _ in range(20):
        size = rng.integers(1, 30, rng.integers(1, 12))
        protos = rng.integers(0, 4, (5, 16))
        sigs = np.concatenate([protos[rng.integers(0, 5, s)] for s in size])
        sigs = np.where(rng.random(sigs.shape) < 0.2, rng.integers(0, 4, sigs.shape), sigs)
        pos = np.cumsum(size) - size
        need = int(rng.integers(8, 14))
        want = []
        for k, (a, n) in enumerate(zip(pos.tolist(), size.tolist())):
            centers = []
            for m in range(a, a + n):
                hits = [c for c in centers if sum(int(x == y) for x, y in zip(sigs[m], sigs[c])) >= need]
                want += [(k, c, m) for c in hits]
                if not hits:
                    centers.append(m)
        m, c, k = _link_to_centers_all(sigs, pos, size, need)
        assert list(zip(k.tolist(), c.tolist(), m.tolist())) == sorted(want)


def test_component_drops_and_exact_drops_against_plain_python():
    rng = random.Random(2)
    for _ in range(20):
        nodes = rng.sample(range(10_000), 60)
        pairs = [(rng.choice(nodes), rng.choice(nodes)) for _ in range(rng.randint(0, 80))]
        parent = {v: v for v in nodes}

        def find(v):
            while parent[v] != v:
                v = parent[v]
            return v
        for a, b in pairs:
            ra, rb = find(a), find(b)
            parent[max(ra, rb)] = min(ra, rb)
        touched = {v for p in pairs for v in p}
        want = sorted(v for v in touched if find(v) != v)
        arr = np.asarray(pairs, np.int64).reshape(-1, 2)
        assert component_drops(arr).tolist() == want
        # pairs in files of any size, joined in batches of any size: the same components
        cuts = sorted(rng.sample(range(len(arr) + 1), min(len(arr) + 1, 4)))
        chunks = [arr[a:b] for a, b in zip([0] + cuts, cuts + [len(arr)])]
        for batch in (1, 3, 1 << 20):
            assert component_drops_streamed(chunks, batch=batch).tolist() == want
    hashes = np.array([5, 3, 5, 5, 9, 3], np.uint64)
    keys = np.array([10, 4, 2, 30, 7, 1], np.int64)
    rec = np.stack([hashes, keys.view(np.uint64)], 1)
    assert exact_drops(rec).tolist() == [4, 10, 30]  # per hash all but the smallest key


def test_slurm_style_cli_steps_give_the_one_process_result(tmp_path, capsys):
    """launch/prepare_data.py as the array jobs run it: --merge-plan, the parts with --no-merge, then
    every task of every stage with --merge-stage/--task (in reverse order within a stage) gives the
    indexes and statistics of one prepare run; a stage run before the one it reads from, or a task out
    of range, is an error line naming the fix."""
    from launch_utils import load_launch_script
    cli = load_launch_script("prepare_data")
    rng = random.Random(5)
    docs = [english_text(rng, 120) for _ in range(30)]
    for i, name in enumerate(("a", "b", "c")):
        rows = docs[i * 10:(i + 1) * 10] + [docs[rng.randrange(30)] for _ in range(3)]  # copies across files
        rows.append(docs[rng.randrange(30)].replace(" the ", " a ", 2))  # near copies
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    conf = tmp_path / "c.yaml"
    conf.write_text("name: cli\nval_fraction: 0.1\ndedup: {shards: 2}\nsources:\n"
                    "  - {name: s, language: en, type: jsonl, paths: ['*.jsonl']}\n")
    out = str(tmp_path / "ds")

    def run(*args):
        capsys.readouterr()
        rc = cli.main(["--config", str(conf), "--out", out, "--workers", "1", "--no-progress", *map(str, args)])
        return rc, capsys.readouterr()

    rc, io = run("--merge-plan")
    steps = json.loads(io.out)
    assert rc == 0 and steps == {"exact": 2, "pairs": 32, "components": 1, "index": 1, "finish": 1}
    for p in range(2):
        assert run("--part", p, "--num-parts", 2, "--no-merge")[0] == 0
    rc, io = run("--merge-stage", "components", "--task", 0)
    assert rc == 2 and "stage 'pairs'" in io.err and "run that stage's tasks first" in io.err
    rc, io = run("--merge-stage", "exact", "--task", 2)
    assert rc == 2 and "stage exact has 2 tasks (0..1)" in io.err
    for stage, n in steps.items():
        for task in reversed(range(n)):
            assert run("--merge-stage", stage, "--task", task)[0] == 0
    cfg = parse_data_config({"name": "cli", "val_fraction": 0.1, "dedup": {"shards": 2}, "sources": [
        {"name": "s", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "*.jsonl")]}]})
    one = prepare(cfg, tmp_path / "one", workers=1, progress=False)
    got = json.loads((tmp_path / "ds" / "stats.json").read_text())
    assert one["sources"][0]["exact_duplicates"] + one["sources"][0]["near_duplicates"] >= 6
    for key in ("exact_duplicates", "near_duplicates", "documents_out"):
        assert got["sources"][0][key] == one["sources"][0][key], key
    for split in ("train", "val"):
        assert np.array_equal(np.load(tmp_path / "ds" / split / "s.index.npy")[:, 1],
                              np.load(tmp_path / "one" / split / "s.index.npy")[:, 1])
        assert _output_docs(tmp_path / "ds" / split) == _output_docs(tmp_path / "one" / split)

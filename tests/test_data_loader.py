"""The loader contract: windows, determinism, resume, world-size independence, mixing, doc starts."""
import json
import os
import random
import re
from collections import Counter

import numpy as np
import pytest
import torch

from data_pipeline import build_loader
from data_pipeline.shards import ShardWriter, SourceMeta, feistel_permutation, write_meta
from data_pipeline.tokenizer import EOT_ID

SEQ = 32


def _make_dataset(root, n_docs=(60, 45), seed=0):
    """Two sources of synthetic documents whose tokens say where they come from: token
    1000*(1+doc) + position in doc for source "a", plus 70_000 for source "b"
    (never equal to <|endoftext|>)."""
    rng = random.Random(seed)
    metas = []
    for s, (name, lang, w) in enumerate([("a", "en", 2.0), ("b", "zh", 1.0)]):
        writer = ShardWriter(root, name, shard_tokens=300)  # several shards per source
        for d in range(n_docs[s]):
            n = rng.randint(1, 120)
            writer.add([70_000 * s + 1000 * (1 + d) + k for k in range(n)] + [EOT_ID])
        writer.close()
        assert len(writer.stems) > 1
        metas.append(SourceMeta(name, lang, w, writer.shard_entries(), writer.documents, writer.tokens))
    write_meta(root, metas)
    return root


@pytest.fixture
def dataset(tmp_path):
    return str(_make_dataset(tmp_path / "ds"))


def _global_stream(data, steps, global_batch, world_size, micro, seed=0, start_state=None):
    """Per step, the global batch assembled from all ranks' micro-batches in rank order."""
    loaders = [build_loader(data, SEQ, global_batch, micro, r, world_size, seed) for r in range(world_size)]
    if start_state is not None:
        for ld in loaders:
            ld.load_state_dict(json.loads(json.dumps(start_state)))
    out = []
    for _ in range(steps):
        parts = []
        for ld in loaders:
            for _ in range(global_batch // (world_size * micro)):
                parts.append(ld.next_batch()["input_ids"])
        out.append(torch.cat(parts))
    return out, loaders[0].state_dict()


def test_windows_are_shifted_targets(dataset):
    ld = build_loader(dataset, SEQ, 8, 4)
    for _ in range(5):
        b = ld.next_batch()
        assert b["input_ids"].shape == (4, SEQ) and b["input_ids"].dtype == torch.long
        assert torch.equal(b["input_ids"][:, 1:], b["targets"][:, :-1])


def test_world_size_and_micro_batch_do_not_change_global_stream(dataset):
    ref, _ = _global_stream(dataset, 6, 8, 1, 8)
    for world, micro in [(1, 2), (2, 4), (2, 1), (4, 2), (8, 1)]:
        got, _ = _global_stream(dataset, 6, 8, world, micro)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (world, micro)


def test_global_order_independent_of_global_batch(dataset):
    a, _ = _global_stream(dataset, 4, 12, 1, 4)
    b, _ = _global_stream(dataset, 12, 4, 1, 4)
    assert torch.equal(torch.cat(a), torch.cat(b))


@pytest.mark.parametrize("new_world", [1, 2, 4])
def test_resume_at_random_step(dataset, new_world):
    rng = random.Random(new_world)
    for _ in range(3):
        k = rng.randint(1, 15)
        ref, _ = _global_stream(dataset, k + 5, 8, 2, 2)
        _, state = _global_stream(dataset, k, 8, 2, 2)
        got, _ = _global_stream(dataset, 5, 8, new_world, 8 // (new_world * 2) or 1, start_state=state)
        assert all(torch.equal(a, b) for a, b in zip(ref[k:], got))


def test_resume_mid_step_same_world(dataset):
    ld = build_loader(dataset, SEQ, 8, 2, rank=1, world_size=2)
    ref = [ld.next_batch()["input_ids"] for _ in range(7)]
    ld2 = build_loader(dataset, SEQ, 8, 2, rank=1, world_size=2)
    for _ in range(3):
        ld2.next_batch()
    state = ld2.state_dict()
    assert state["micro"] == 1
    ld3 = build_loader(dataset, SEQ, 8, 2, rank=1, world_size=2)
    ld3.load_state_dict(state)
    assert all(torch.equal(a, ld3.next_batch()["input_ids"]) for a in ref[3:])
    with pytest.raises(ValueError, match="middle of an optimizer step"):
        build_loader(dataset, SEQ, 8, 1, rank=0, world_size=4).load_state_dict(state)


def test_state_rejects_other_data_or_seq_len(dataset, tmp_path):
    state = build_loader(dataset, SEQ, 8, 4).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        build_loader(dataset, SEQ + 1, 8, 4).load_state_dict(state)
    other = str(_make_dataset(tmp_path / "other", n_docs=(61, 45)))
    with pytest.raises(ValueError, match="fingerprint"):
        build_loader(other, SEQ, 8, 4).load_state_dict(state)


def test_seed_changes_order_and_same_seed_repeats(dataset):
    a, _ = _global_stream(dataset, 3, 8, 1, 8, seed=1)
    b, _ = _global_stream(dataset, 3, 8, 1, 8, seed=1)
    c, _ = _global_stream(dataset, 3, 8, 1, 8, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_each_document_once_per_epoch_and_token_mix(dataset):
    """Source "a" read to the end of its first epoch holds every document exactly once, whole and in
    order; the window counts of the two sources follow the 2:1 weights."""
    ld = build_loader(dataset, SEQ, 4, 4)
    meta = json.load(open(f"{dataset}/meta.json"))["sources"]
    tokens_a = meta[0]["tokens"]
    stream = {0: [], 1: []}
    while len(stream[0]) * SEQ < tokens_a + SEQ:
        w = ld.next_batch()
        full = torch.cat([w["input_ids"], w["targets"][:, -1:]], 1).numpy()
        for row in full:
            first = row[1] if row[0] == EOT_ID else row[0]  # a window may start on a document end
            src = int(first >= 65_000)
            stream[src].append(row)
    ratio = len(stream[0]) / len(stream[1])
    assert abs(ratio - 2.0) / 2.0 < 0.02, ratio
    # consecutive windows of a source overlap by one token
    assert all(a[-1] == b[0] for a, b in zip(stream[0], stream[0][1:]))
    flat = np.concatenate([stream[0][0]] + [w[1:] for w in stream[0][1:]])[:tokens_a]
    docs = np.split(flat, np.nonzero(flat == EOT_ID)[0] + 1)[:-1]
    firsts = Counter(int(d[0]) // 1000 for d in docs)
    assert sorted(firsts) == list(range(1, meta[0]["documents"] + 1)) and set(firsts.values()) == {1}
    for d in docs:  # each document whole: positions 0..n-1 then EOT
        assert list(d[:-1] % 1000) == list(range(len(d) - 1))


def test_doc_starts_match_eot_positions(dataset):
    ld = build_loader(dataset, SEQ, 4, 4, doc_starts=True)
    for _ in range(3):
        b = ld.next_batch()
        ids = b["input_ids"].tolist()
        want = []
        for r, row in enumerate(ids):
            for t in range(SEQ):
                if t == 0 or row[t - 1] == EOT_ID:
                    want.append(r * SEQ + t)
        want.append(len(ids) * SEQ)
        assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].tolist() == want


def test_bad_batching_is_a_clear_error(dataset):
    with pytest.raises(ValueError, match="not a multiple of world size x micro batch"):
        build_loader(dataset, SEQ, 10, 4, world_size=2)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        build_loader(dataset, SEQ, 8, 2, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_loader(dataset + "_missing", SEQ, 8, 2)


def test_epoch_permutation_is_a_seeded_bijection():
    rng = random.Random(5)
    for n in [1, 2, 3, 5, 64, 1000, rng.randint(2, 50_000), (1 << 17) + 1]:
        p = feistel_permutation(np.arange(n), n, (0, 7, 1))
        assert np.array_equal(np.sort(p), np.arange(n))
        if n > 100:
            q = feistel_permutation(np.arange(n), n, (0, 7, 2))  # another epoch: another order
            assert (p != q).mean() > 0.9
            # no visible structure: neighbours are not near each other
            assert abs(np.corrcoef(p[:-1], p[1:])[0, 1]) < 0.1


def test_every_document_once_in_each_epoch_and_the_index_is_mapped(dataset):
    """Source "b" read for three epochs: each epoch holds every document once, whole, in an order of
    its own; the loader holds the index as a memory map, not a copy."""
    ld = build_loader(dataset, SEQ, 4, 4)
    store = ld.provider.stores[1]
    assert isinstance(store.index, np.memmap)
    meta = json.load(open(f"{dataset}/meta.json"))["sources"][1]
    need = 3 * meta["tokens"]
    stream = []
    while len(stream) < need:
        b = ld.next_batch()
        for row in torch.cat([b["input_ids"], b["targets"][:, -1:]], 1).numpy():
            first = row[1] if row[0] == EOT_ID else row[0]
            if first >= 65_000:
                stream.extend(row[1:] if stream else row)
    flat = np.asarray(stream[:need])
    orders = []
    for e in range(3):
        part = flat[e * meta["tokens"]:(e + 1) * meta["tokens"]]
        docs = np.split(part, np.nonzero(part == EOT_ID)[0] + 1)[:-1]
        firsts = [(int(d[0]) - 70_000) // 1000 for d in docs]
        assert sorted(firsts) == list(range(1, meta["documents"] + 1))
        orders.append(firsts)
    assert orders[0] != orders[1] != orders[2]


def test_resume_without_cursors_walks_to_the_same_place(dataset):
    ref, _ = _global_stream(dataset, 14, 8, 1, 8)
    _, state = _global_stream(dataset, 9, 8, 2, 2)
    assert state["cursors"] and len(state["cursors"]) == 2
    for cursors in (None, [[0, 0, 0], [0, 0, 0]]):  # missing, or stale: walked from there
        got, _ = _global_stream(dataset, 5, 8, 4, 1, start_state={**state, "cursors": cursors})
        assert all(torch.equal(a, b) for a, b in zip(ref[9:], got))


def test_dataset_smaller_than_one_global_batch_is_warned_about(dataset):
    """A train split with fewer distinct windows than one global batch repeats its documents in every
    step: a warning naming the sizes (on rank 0), not an error, since a smoke test of a large batch on a
    small corpus is legitimate; one global batch of exactly that many windows is quiet."""
    import logging
    meta = json.load(open(f"{dataset}/meta.json"))["sources"]
    distinct = sum((s["tokens"] - 1) // SEQ for s in meta)  # windows inside each source's first epoch
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    log = logging.getLogger("linscale.data")
    handler = Keep()
    log.addHandler(handler)
    try:
        build_loader(dataset, SEQ, distinct, 1).next_batch()
        assert seen == []
        build_loader(dataset, SEQ, distinct + 1, 1).next_batch()
        assert len(seen) == 1 and re.search(rf"holds {distinct} distinct sequences .* fewer than one global batch "
                                            rf"of {distinct + 1}: every step repeats", seen[0]), seen
        build_loader(dataset, SEQ, 2 * distinct, 2, rank=1, world_size=2)  # rank 0 alone says it
        assert len(seen) == 1
    finally:
        log.removeHandler(handler)


def test_sources_read_more_than_once_over_the_run_are_warned_about(dataset):
    """With a step limit, rank 0 logs the epochs the run reads of each source (its share of the windows
    over its distinct ones) and warns about each source read more than once, with those numbers; a run
    inside one epoch of every source gets the info line alone."""
    import logging
    meta = {s["name"]: s for s in json.load(open(f"{dataset}/meta.json"))["sources"]}
    weights = {n: s["weight"] for n, s in meta.items()}
    total_w = sum(weights.values())
    distinct = {n: (s["tokens"] - 1) // SEQ for n, s in meta.items()}
    batch = 4

    def epochs(steps):  # by hand: windows by token share, over each source's distinct windows
        return {n: weights[n] / total_w * steps * batch / distinct[n] for n in meta}

    seen: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.levelno, record.getMessage()))
    log = logging.getLogger("linscale.data")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        inside = max(1, int(min(distinct[n] / (weights[n] / total_w * batch) for n in meta)) - 1)
        assert max(epochs(inside).values()) <= 1
        build_loader(dataset, SEQ, batch, batch, planned_steps=inside)
        assert [lv for lv, _ in seen] == [logging.INFO], seen
        for n, e in epochs(inside).items():
            assert f"{n} {e:.3g}" in seen[0][1], (seen, n, e)
        seen.clear()
        many = 3 * max(distinct.values())
        build_loader(dataset, SEQ, batch, batch, planned_steps=many)
        warned = [m for lv, m in seen if lv == logging.WARNING]
        assert len(warned) == 1, seen
        for n, e in epochs(many).items():
            assert e > 1 and f"{n} {e:.2f}" in warned[0], (warned, n, e)
        assert "documents repeat" in warned[0]
        seen.clear()
        build_loader(dataset, SEQ, batch, batch)  # no step limit: nothing to say
        assert seen == []
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_token_file_cut_short_or_moved_is_named_as_such(dataset):
    """A token file whose size is not a whole number of uint32 tokens (cut off mid-token) is reported as
    cut short, with its byte count, and a missing one as moved or deleted, not as a file rewritten by
    another prepare."""
    meta = json.load(open(f"{dataset}/meta.json"))["sources"][1]
    path = f"{dataset}/{meta['token_files'][0]}"
    size = os.path.getsize(path)
    os.truncate(path, size - 2)
    with pytest.raises(ValueError, match=rf"{meta['token_files'][0]}: {size - 2} bytes, not a whole number of "
                                         rf"4-byte tokens .*cut short"):
        build_loader(dataset, SEQ, 8, 4)
    os.rename(path, path + ".moved")
    with pytest.raises(ValueError, match=rf"{meta['token_files'][0]}: missing, .*moved or deleted"):
        build_loader(dataset, SEQ, 8, 4)


def test_damaged_meta_or_index_names_the_file(dataset):
    """A meta.json or index cut short is a ValueError that names the file and says to prepare again,
    not a bare JSON or mmap error."""
    index = f"{dataset}/b.index.npy"
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) - 8)
    with pytest.raises(ValueError, match=r"b\.index\.npy.*prepare"):
        build_loader(dataset, SEQ, 8, 4)
    path = f"{dataset}/meta.json"
    text = open(path).read()
    open(path, "w").write(text[:len(text) // 2])
    with pytest.raises(ValueError, match=r"meta\.json: not valid JSON.*prepare"):
        build_loader(dataset, SEQ, 8, 4)


@pytest.mark.parametrize("key, value", [("eot_id", 50256), ("token_dtype", "uint16")])
def test_meta_of_another_token_format_is_refused(dataset, key, value):
    """The loader reads uint32 ids and finds documents by this tokenizer's <|endoftext|>: a split whose
    meta.json records another token width or end-of-text id is refused, naming the field."""
    path = f"{dataset}/meta.json"
    meta = json.load(open(path))
    meta[key] = value
    json.dump(meta, open(path, "w"))
    with pytest.raises(ValueError, match=rf"{key} {value!r}"):
        build_loader(dataset, SEQ, 8, 4)

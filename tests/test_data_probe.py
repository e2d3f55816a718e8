"""The pipeline against independent references: hand-built corpora whose documents are known one by one,
tiktoken called directly, and an uninterrupted or single-part run."""
import json
import random

import pytest

from data_pipeline.config import parse_data_config
from data_pipeline.prepare import prepare
from data_pipeline.shards import documents
from data_pipeline.tokenizer import EOT_ID, get_tokenizer
from data_utils import english_text


def _jsonl_corpus(folder, files=4, per_file=10, seed=1):
    """`files` jsonl files of `per_file` documents each, every one passing the default filters, in the
    order a source reads them (files sorted by name)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for f in range(files):
        with open(folder / f"f{f}.jsonl", "w") as fh:
            for d in range(per_file):
                text = f"File {f} document {d}. " + english_text(rng, 80)
                fh.write(json.dumps({"text": text}) + "\n")
                docs.append(text)
    return docs


def _tokens(split_dir, source):
    return [t.tolist() for t in documents(split_dir, source)]


@pytest.mark.parametrize("num_parts", [2, 3])
def test_max_documents_keeps_the_first_documents_whatever_the_number_of_parts(tmp_path, num_parts):
    """A source capped at 15 documents holds the first 15 of its file order (all 10 of the first file, 5 of
    the second), tokenized as tiktoken does, with any --num-parts: a cap counted within each part kept up
    to 15 per part, and other documents."""
    docs = _jsonl_corpus(tmp_path / "src")
    cfg = parse_data_config({"name": "cap", "val_fraction": 0, "dedup": {"near": False}, "sources": [
        {"name": "en", "language": "en", "type": "jsonl", "max_documents": 15,
         "paths": [str(tmp_path / "src" / "*.jsonl")]}]})
    enc = get_tokenizer()
    want = [enc.encode_ordinary(d) + [EOT_ID] for d in docs[:15]]
    for p in range(num_parts):  # as separate array tasks would, then the merge
        prepare(cfg, tmp_path / "ds", workers=1, part=p, num_parts=num_parts, do_merge=p == num_parts - 1,
                progress=False)
    assert _tokens(tmp_path / "ds" / "train", "en") == want
    stats = json.loads((tmp_path / "ds" / "stats.json").read_text())["sources"][0]
    assert stats["documents_in"] == 15 and stats["documents_out"] == {"train": 15, "val": 0}


def test_weights_on_some_sources_only_are_refused_when_the_config_is_read():
    """Half-given weights have no meaning (the mix splits by language or by weight, not both): refused at
    parse time, naming the sources, rather than by the merge after every part has been prepared."""
    with pytest.raises(ValueError, match=r"\['a'\] have a `weight` and \['b'\] do not"):
        parse_data_config({"sources": [{"name": "a", "language": "en", "paths": ["x"], "weight": 2},
                                       {"name": "b", "language": "zh", "paths": ["y"]}]})


def test_parquet_text_stored_as_binary_is_read(tmp_path):
    """A parquet text column written as plain binary (no UTF-8 annotation, as Hive and Impala write strings)
    gives its documents; a value that is not UTF-8 is skipped and counted, a null too."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = random.Random(3)
    docs = [f"Row {i}: " + english_text(rng, 60) for i in range(4)]
    values = [d.encode() for d in docs[:2]] + [b"bad \xff\xfe bytes " * 20, None] + [d.encode() for d in docs[2:]]
    pq.write_table(pa.table({"text": pa.array(values, pa.binary())}), tmp_path / "b.parquet")
    cfg = parse_data_config({"name": "bin", "val_fraction": 0, "dedup": {"near": False}, "sources": [
        {"name": "pq", "language": "en", "type": "parquet", "paths": [str(tmp_path / "b.parquet")]}]})
    stats = prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    enc = get_tokenizer()
    assert _tokens(tmp_path / "ds" / "train", "pq") == [enc.encode_ordinary(d) + [EOT_ID] for d in docs]
    assert stats["sources"][0]["skipped_input"] == {"invalid_utf8_lines": 1, "records_without_text": 1}


def test_default_workers_follow_the_cpus_the_process_may_use(tmp_path):
    """Without --workers a part starts one worker per CPU the process may run on (its affinity: a Slurm
    task's CPUs, taskset), not per CPU of the machine, which oversubscribes a task given a few cores."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs taskset and a machine of several CPUs")
    _jsonl_corpus(tmp_path / "src", files=1, per_file=3)
    (tmp_path / "c.yaml").write_text(json.dumps({"name": "w", "val_fraction": 0, "dedup": {"near": False},
                                                 "sources": [{"name": "en", "language": "en", "type": "jsonl",
                                                              "paths": ["src/*.jsonl"]}]}))
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(["taskset", "-c", "0", sys.executable, str(root / "launch" / "prepare_data.py"),
                          "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "ds"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    info = json.loads((tmp_path / "ds" / "parts" / "part-00000" / "part.json").read_text())
    assert info["workers"] == 1


def test_a_chinese_file_in_gbk_is_named_as_such_with_the_fix(shared_data, tmp_path, caplog):
    """Real Chinese text saved as GBK is skipped as binary (counted), the warning naming the encoding and an
    iconv command whose codec gives the text back exactly; a UTF-8 neighbour is read."""
    import gzip
    import logging
    text = gzip.open(shared_data / "train/zh/luxun/yecao.txt.gz", "rt", encoding="utf-8").read()[:20000]
    (tmp_path / "a_gbk.txt").write_bytes(text.encode("gbk"))
    (tmp_path / "b_utf8.txt").write_text(text, encoding="utf-8")
    cfg = parse_data_config({"name": "enc", "val_fraction": 0, "dedup": {"near": False}, "sources": [
        {"name": "s", "language": "zh", "type": "text", "paths": [str(tmp_path / "*.txt")]}]})
    with caplog.at_level(logging.WARNING, logger="linscale.data"):
        stats = prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    assert stats["sources"][0]["skipped_input"] == {"binary_files": 1}
    assert stats["sources"][0]["documents_out"]["train"] == 1
    warn = [r.getMessage() for r in caplog.records if "binary files" in r.getMessage()]
    assert len(warn) == 1 and str(tmp_path / "a_gbk.txt") in warn[0] and "GB18030/GBK" in warn[0]
    codec = warn[0].split("iconv -f ")[1].split(" ")[0]
    assert (tmp_path / "a_gbk.txt").read_bytes().decode(codec) == text


@pytest.mark.parametrize("unit", ["line", "blank_line"])
def test_every_newline_style_ends_a_line(tmp_path, unit):
    """A text file mixing \\n, \\r\\n and bare \\r line ends (a classic Mac OS file pasted into another) is split
    into documents as Python's universal newlines read it: per line, or per blank-line block."""
    import io
    rng = random.Random(4)
    docs = [f"Entry {i}: " + english_text(rng, 40) for i in range(9)]
    ends = ["\n", "\r\n", "\r"]
    if unit == "line":
        raw = "".join(d + ends[i % 3] for i, d in enumerate(docs))
    else:  # two lines a document, then a blank line, each document in its own style
        raw = "".join(d[:60] + ends[i % 3] + d[60:] + ends[i % 3] * 2 for i, d in enumerate(docs))
    (tmp_path / "mixed.txt").write_bytes(raw.encode())
    with io.open(tmp_path / "mixed.txt", encoding="utf-8", newline=None) as f:
        text = f.read()  # universal newlines: every style becomes \n
    want = [b for b in (text.split("\n") if unit == "line" else text.split("\n\n")) if b.strip()]
    assert len(want) == 9
    cfg = parse_data_config({"name": "nl", "val_fraction": 0, "dedup": {"near": False},
                             "filters": {"min_chars": 50}, "sources": [
        {"name": "t", "language": "en", "type": "text", "text_unit": unit, "paths": [str(tmp_path / "*.txt")]}]})
    prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    enc = get_tokenizer()
    assert _tokens(tmp_path / "ds" / "train", "t") == [enc.encode_ordinary(w) + [EOT_ID] for w in want]


def test_first_pass_stops_at_the_first_repeat_with_any_batch_shape(tmp_path):
    """first_pass() ends before the first window that reads past a source's first epoch, whatever the global
    and micro batch: its rows are those of a loader of one row a step (the reference, where each step is
    one window) up to a batch boundary, and no row past the first epoch."""
    import torch
    from data_pipeline import build_loader
    from data_pipeline.loader import first_pass
    from data_pipeline.shards import ShardWriter, SourceMeta, write_meta
    root = tmp_path / "ds"
    rng = random.Random(2)
    metas = []
    for s, (name, n_docs) in enumerate([("a", 40), ("b", 15)]):
        writer = ShardWriter(root, name, shard_tokens=500)
        for d in range(n_docs):
            writer.add([1000 * (s + 1) + (d * 7 + k) % 900 for k in range(rng.randint(5, 80))] + [EOT_ID])
        writer.close()
        metas.append(SourceMeta(name, "en", 1.0, writer.shard_entries(), writer.documents, writer.tokens))
    write_meta(root, metas)
    seq = 16
    ref = [b["input_ids"] for b in first_pass(build_loader(str(root), seq, 1, 1))]
    ref = torch.cat(ref)
    b_tokens = metas[1].tokens
    assert len(ref) > 8 and sum(bool(((r >= 2000) & (r < 3000)).any()) for r in ref) == (b_tokens - 1) // seq
    for global_batch, micro in ((3, 1), (5, 1), (6, 2), (7, 7)):
        got = torch.cat([b["input_ids"] for b in first_pass(build_loader(str(root), seq, global_batch, micro))])
        assert len(got) <= len(ref) and len(ref) - len(got) < micro and torch.equal(got, ref[:len(got)])


def _stream_documents(config, seq_len=64, batches=30):
    """The token documents (each ending in EOT) of a one-source streaming config, in stream order: with one
    source consecutive windows start seq_len apart, so the inputs laid end to end are the stream."""
    from data_pipeline import build_loader
    ld = build_loader(str(config), seq_len, 8, 8)
    stream = [t for _ in range(batches) for row in ld.next_batch()["input_ids"].tolist() for t in row]
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == EOT_ID:
            docs.append(cur)
            cur = []
    return docs  # (the cut-off document at the end is left out)


def test_streaming_max_documents_reads_the_same_documents_every_epoch(tmp_path):
    """Streaming a source capped at 15 documents reads the first 15 of its sorted file order — the ones
    prepare keeps (all 10 of f0, the first 5 of f1) — in every epoch: each run of 15 documents of the stream
    is that set, though each epoch reads the files in its own order. The cap used to count along each
    epoch's shuffled file order and took other files' documents in other epochs."""
    docs = _jsonl_corpus(tmp_path / "src")
    (tmp_path / "c.yaml").write_text(json.dumps({"name": "cap", "val_fraction": 0, "sources": [
        {"name": "en", "language": "en", "type": "jsonl", "max_documents": 15, "paths": ["src/*.jsonl"]}]}))
    enc = get_tokenizer()
    want = sorted(enc.encode_ordinary(d) + [EOT_ID] for d in docs[:15])
    got = _stream_documents(tmp_path / "c.yaml", batches=40)
    epochs = [got[i:i + 15] for i in range(0, len(got) - 14, 15)]
    assert len(epochs) >= 5
    for e, epoch in enumerate(epochs):
        assert sorted(epoch) == want, f"epoch {e} read other documents"
    assert len({tuple(map(tuple, epoch)) for epoch in epochs}) > 1  # the file order still changes per epoch


def _crcrlf_corpus():
    """Three documents of two lines; lines end in \\r\\n, \\n or \\r, and a document's last line in \\r\\r\\n:
    a bare \\r, then \\r\\n — a line end and a blank line, to Python's universal newlines."""
    rng = random.Random(6)
    docs = [[f"Part {i} line {k}: " + english_text(rng, 12) for k in range(2)] for i in range(3)]
    ends = ["\r\n", "\n", "\r"]
    return "".join(d[0] + ends[i] + d[1] + "\r\r\n" for i, d in enumerate(docs))


@pytest.mark.parametrize("unit", ["line", "blank_line", "file", "wikiextractor"])
def test_cr_cr_lf_ends_two_lines_as_universal_newlines_read_it(tmp_path, unit):
    """\\r\\r\\n is a bare \\r and then \\r\\n: two line ends, as Python's universal newlines (io.open, newline=None)
    read it. Per line, per blank-line block, a whole file read line by line (over max_line_bytes) and a
    WikiExtractor <doc> give the documents of that reading. The reader used to strip every \\r before the
    \\n, so the blank line between the blocks (and in the file and <doc>) was lost."""
    import io
    from data_pipeline.config import SourceConfig
    from data_pipeline.sources import Counts, iter_file
    raw = _crcrlf_corpus()
    if unit == "wikiextractor":
        raw = '<doc id="1" url="u" title="T">\r\r\n' + raw + "</doc>\r\r\n"
    (tmp_path / "a.txt").write_bytes(raw.encode())
    with io.open(tmp_path / "a.txt", encoding="utf-8", newline=None) as f:
        text = f.read()
    assert text.count("\n\n") >= 3 and "\r" not in text
    if unit == "line":
        want = [ln for ln in text.split("\n") if ln.strip()]
    elif unit == "blank_line":
        want = [b for b in text.split("\n\n") if b.strip()]
        assert len(want) == 3
    elif unit == "file":
        want = [text]
    else:
        want = [text.split("\n", 1)[1].rsplit("</doc>", 1)[0].rstrip("\n")]
    src = SourceConfig(name="s", language="en", type="wikiextractor" if unit == "wikiextractor" else "text",
                       text_unit="file" if unit == "wikiextractor" else unit, paths=[str(tmp_path / "a.txt")])
    counts = Counts("s")
    limit = 400  # the file (~700 bytes) is over it, its lines under it: text_unit file reads it line by line
    assert all(len(ln) < limit for ln in raw.encode().split(b"\n")) and len(raw) > limit
    got = [t for t, _ in iter_file(src, tmp_path / "a.txt", counts, limit)]
    from data_pipeline.filters import clean
    assert [clean(g) for g in got] == [w.strip() for w in want]  # clean: the reader leaves \r to it in a file
    assert dict(counts.skipped) == {}


def test_blank_lines_are_not_documents_with_text_unit_line(tmp_path):
    """With text_unit line a blank line (empty, or spaces and tabs, in any line-end style) is passed over:
    not a document read (documents_in) and not one removed as too_short. A real line under min_chars still
    is; the documents out are the non-blank lines, tokenized as tiktoken does."""
    rng = random.Random(9)
    lines = [f"Line {i}: " + english_text(rng, 30) for i in range(5)]
    raw = (lines[0] + "\n\n" + lines[1] + "\r\n  \t \r\n\r\n" + lines[2] + "\n" + "Too short.\n" + "\n \n"
           + lines[3] + "\r\r" + lines[4] + "\n\n")
    (tmp_path / "a.txt").write_bytes(raw.encode())
    cfg = parse_data_config({"name": "bl", "val_fraction": 0, "dedup": {"near": False},
                             "filters": {"min_chars": 50}, "sources": [
        {"name": "t", "language": "en", "type": "text", "text_unit": "line", "paths": [str(tmp_path / "a.txt")]}]})
    stats = prepare(cfg, tmp_path / "ds", workers=1, progress=False)["sources"][0]
    assert stats["documents_in"] == 6  # the five lines and "Too short."
    assert {k: v for k, v in stats["removed_by_filter"].items() if v} == {"too_short": 1}
    assert stats["skipped_input"] == {}
    enc = get_tokenizer()
    assert _tokens(tmp_path / "ds" / "train", "t") == [enc.encode_ordinary(ln) + [EOT_ID] for ln in lines]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_windows_1252_file_gets_one_hint_naming_the_encoding_and_the_fix(tmp_path, caplog):
    """An English file saved as Windows-1252 (curly quotes 0x93/0x94, dashes 0x96/0x97, an accented letter):
    its lines with those bytes are skipped and counted as before, and one warning for the file names the
    encoding and an iconv command whose codec gives the text back exactly. The same text in UTF-8 gives no
    hint and no skip; a UTF-8 file with one damaged line among non-ASCII ones (not a file to convert whole)
    and a Cyrillic Windows-1251 file (not Western text) get no Windows-1252 hint."""
    import logging
    rng = random.Random(11)
    text = "".join(f"Chapter {i}. \u201c{english_text(rng, 12)}\u201d \u2013 she said \u2014 caf\u00e9 {i}.\n"
                   f"{english_text(rng, 20)}\n" for i in range(8))
    (tmp_path / "a_cp1252.txt").write_bytes(text.encode("cp1252"))
    (tmp_path / "b_utf8.txt").write_text(text, encoding="utf-8")
    damaged = text.encode("utf-8").split(b"\n")
    damaged[4] = damaged[4][:20] + b"\xe2\x80" + damaged[4][20:]  # a UTF-8 sequence cut short in one line
    (tmp_path / "c_damaged.txt").write_bytes(b"\n".join(damaged))
    cyrillic = "".join(f"Line {i}: \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440 \u0438 "
                       f"\u0434\u0440\u0443\u0437\u044c\u044f.\nplain ascii line {i}\n" for i in range(8))
    (tmp_path / "d_cp1251.txt").write_bytes(cyrillic.encode("cp1251"))
    cfg = parse_data_config({"name": "enc", "val_fraction": 0, "dedup": {"near": False}, "sources": [
        {"name": "s", "language": "en", "type": "text", "text_unit": "line", "paths": [str(tmp_path / "*.txt")]}]})
    with caplog.at_level(logging.WARNING, logger="linscale.data"):
        stats = prepare(cfg, tmp_path / "ds", workers=1, progress=False)["sources"][0]
    assert stats["skipped_input"] == {"invalid_utf8_lines": 8 + 1 + 8}
    hints = [w for w in _warnings(caplog) if "iconv" in w]
    assert len(hints) == 1, hints
    assert str(tmp_path / "a_cp1252.txt") in hints[0] and "Windows-1252" in hints[0], hints[0]
    assert "8 line(s) not UTF-8" in hints[0] and "iconv -f cp1252 -t utf-8" in hints[0]
    codec = hints[0].split("iconv -f ")[1].split(" ")[0]
    assert (tmp_path / "a_cp1252.txt").read_bytes().decode(codec) == text


def test_a_windows_1252_file_with_no_utf8_line_is_named_as_such(tmp_path, caplog):
    """A Windows-1252 file whose head holds no UTF-8 line at all is skipped as binary, the warning naming
    Windows-1252 and iconv; a Cyrillic Windows-1251 one is not called Windows-1252 but told to find its
    encoding."""
    import logging
    from data_pipeline.config import SourceConfig
    from data_pipeline.sources import Counts, iter_file
    west = "".join(f"\u201cQuote {i}\u201d \u2013 na\u00efve caf\u00e9 r\u00e9sum\u00e9 \u00e0 la carte.\n" for i in range(40))
    cyr = "".join(f"\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 {i}.\n" for i in range(40))
    (tmp_path / "w.txt").write_bytes(west.encode("cp1252"))
    (tmp_path / "c.txt").write_bytes(cyr.encode("cp1251"))
    src = SourceConfig(name="s", language="en", type="text", text_unit="line")
    out = {}
    for name in ("w.txt", "c.txt"):
        counts = Counts("s")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="linscale.data"):
            assert list(iter_file(src, tmp_path / name, counts, 1 << 20)) == []
        assert dict(counts.skipped) == {"binary_files": 1}
        out[name] = " ".join(_warnings(caplog))
    assert "Windows-1252" in out["w.txt"] and "iconv -f cp1252 -t utf-8" in out["w.txt"]
    assert (tmp_path / "w.txt").read_bytes().decode("cp1252") == west
    assert "cp1252" not in out["c.txt"] and "find its encoding" in out["c.txt"], out["c.txt"]


def test_empty_files_are_counted_and_hold_no_document(tmp_path):
    """A file holding nothing (0 bytes, also once decompressed), only whitespace, no <doc> block (read as
    WikiExtractor output) or no rows (parquet) gives no document: it is counted under skipped_input `empty_files`, not read as
    an empty document that too_short removes (text_unit file) nor passed over without a word (the others)."""
    import gzip
    rng = random.Random(12)
    good = "A real document. " + english_text(rng, 60)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "good.txt").write_text(good)
    (tmp_path / "t" / "empty.txt").write_bytes(b"")
    (tmp_path / "t" / "blank.txt").write_bytes(b" \n\t\r\n\n")
    (tmp_path / "t" / "empty.txt.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "good.jsonl").write_text(json.dumps({"text": good + " (json)"}) + "\n")
    (tmp_path / "j" / "empty.jsonl").write_bytes(b"")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "wiki_00").write_text(f'<doc id="1" url="u" title="T">\n{good} (wiki)\n</doc>\n')
    (tmp_path / "w" / "wiki_01").write_text(good + " (plain text, no doc tags)\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"text": pa.array([good + " (parquet)"])}), tmp_path / "p" / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "p" / "b.parquet")
    cfg = parse_data_config({"name": "e", "val_fraction": 0, "dedup": {"exact": False, "near": False},
                             "filters": {"min_chars": 50}, "sources": [
        {"name": "t", "language": "en", "type": "text", "paths": [str(tmp_path / "t" / "*")]},
        {"name": "j", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "j" / "*")]},
        {"name": "w", "language": "en", "type": "wikiextractor", "paths": [str(tmp_path / "w" / "*")]},
        {"name": "p", "language": "en", "type": "parquet", "paths": [str(tmp_path / "p" / "*")]}]})
    stats = {s["name"]: s for s in prepare(cfg, tmp_path / "ds", workers=1, progress=False)["sources"]}
    assert {n: s["skipped_input"] for n, s in stats.items()} == {
        "t": {"empty_files": 3}, "j": {"empty_files": 1}, "w": {"empty_files": 1}, "p": {"empty_files": 1}}
    assert {n: (s["documents_in"], sum(s["removed_by_filter"].values())) for n, s in stats.items()} == {
        "t": (1, 0), "j": (1, 0), "w": (1, 0), "p": (1, 0)}


def test_huge_weights_mix_as_their_ratio(tmp_path):
    """Weights near the float limit (1.5e308 and 0.5e308: finite, accepted) mix as their ratio, 3:1: the
    loader's batches are those of weights 3 and 1. Their sum overflowed to inf and every share became 0,
    which mixed the sources 1:1."""
    from data_pipeline import build_loader
    from data_pipeline.shards import ShardWriter, SourceMeta, write_meta
    roots = {}
    for label, weights in (("ref", (3.0, 1.0)), ("huge", (1.5e308, 0.5e308))):
        root = roots[label] = tmp_path / label
        metas = []
        for s, (name, w) in enumerate(zip(("a", "b"), weights)):
            writer = ShardWriter(root, name, shard_tokens=500)
            for d in range(30):
                writer.add([1000 * (s + 1) + (d * 7 + k) % 900 for k in range(20)] + [EOT_ID])
            writer.close()
            metas.append(SourceMeta(name, "en", w, writer.shard_entries(), writer.documents, writer.tokens))
        write_meta(root, metas)
    ref, huge = (build_loader(str(roots[k]), 16, 16, 16).next_batch()["input_ids"] for k in ("ref", "huge"))
    firsts = [int(r[0]) // 1000 for r in ref]
    assert firsts.count(1) == 12 and firsts.count(2) == 4  # the reference mixes 3:1
    assert huge.tolist() == ref.tolist()


def test_mix_beside_a_weight_on_every_source_is_refused():
    """`mix` and a `weight` on every source: the weights alone set the shares and `mix` would be ignored
    without a word (a 2:1 mix read as the weights' 1:1); refused when the config is read, naming both and
    the fix. `mix` with no weights, or weights with no `mix`, are read."""
    two = [{"name": "a", "language": "en", "paths": ["x"]}, {"name": "b", "language": "zh", "paths": ["y"]}]
    with pytest.raises(ValueError, match=r"both `mix` and every source's `weight` are given.*remove `mix`"):
        parse_data_config({"mix": {"en": 2, "zh": 1}, "sources": [{**two[0], "weight": 1}, {**two[1], "weight": 1}]})
    assert parse_data_config({"mix": {"en": 2, "zh": 1}, "sources": two}).mix == {"en": 2.0, "zh": 1.0}
    assert [s.weight for s in parse_data_config({"sources": [{**two[0], "weight": 1}, {**two[1], "weight": 3}]}).sources] == [1, 3]


def test_a_data_config_that_is_missing_or_a_folder_is_named(tmp_path):
    """build_loader on a data config that does not exist, or a folder named *.yaml, or one whose source
    matches no file: an error naming the path, what is wrong and where relative paths are read from."""
    from data_pipeline import build_loader
    with pytest.raises(FileNotFoundError, match=r"data config .*missing\.yaml not found \(relative paths are read"):
        build_loader(str(tmp_path / "missing.yaml"), 16, 1, 1)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(IsADirectoryError, match=r"dir\.yaml is a folder, not a YAML file"):
        build_loader(str(tmp_path / "dir.yaml"), 16, 1, 1)
    (tmp_path / "c.yaml").write_text(json.dumps({"sources": [{"name": "s", "language": "en", "paths": ["no/*.txt"]}]}))
    with pytest.raises(FileNotFoundError, match=r"no input file matches for source 's' .*no/\*\.txt.*read from the "
                                                r"config's folder, " + str(tmp_path)):
        build_loader(str(tmp_path / "c.yaml"), 16, 1, 1)


def test_a_line_spanning_many_reads_is_read_whole(tmp_path):
    """A 16 MB line (a JSON record, max_line_bytes raised to hold it) arriving over many reads — here 1 KB a
    read, as read(n) may return less than n — is read whole, between the lines around it, its pieces joined
    once it ends (the time this takes: docs/benchmarks.md, "Reading one very long line")."""
    import io
    from data_pipeline.sources import Counts, _lines

    class Trickle:
        def __init__(self, data: bytes) -> None:
            self.buf = io.BytesIO(data)

        def read(self, n: int) -> bytes:
            return self.buf.read(min(n, 1024))

    line = b"word " * ((16 << 20) // 5)
    counts = Counts("s")
    got = list(_lines(Trickle(b"first\r\n" + line + b"\nlast"), 32 << 20, counts, "x"))
    assert [n for n, _ in got] == [1, 2, 3] and got[0][1] == "first" and got[2][1] == "last"
    assert got[1][1] == line.decode() and dict(counts.skipped) == {}

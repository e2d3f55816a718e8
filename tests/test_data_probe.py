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

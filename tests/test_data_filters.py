"""Cleaning, filters and MinHash against plain-Python references."""
import random
import re
import unicodedata

import numpy as np
import pytest

from data_pipeline.config import FilterConfig
import xxhash

from data_pipeline.dedup import _ASCII_SPACE, _NON_ASCII_SPACE, MinHasher, exact_key, gram_hashes, shingles, units
from data_pipeline.filters import (check, check_batch, clean, script_ratio, script_ratios, top_ngram_share,
                                   top_ngram_shares)
from data_pipeline.tokenizer import encode_document, encode_document_array

WORDS = ("alpha beta gamma delta river stone maple cloud winter harbor lantern copper velvet orchard "
         "signal meadow ember quartz willow falcon").split()


def _prose(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_clean_normalises():
    raw = "\ufeffCafe\u0301 line\r\nnext\x00\x07 line\rlast\u200b  "
    got = clean(raw)
    assert got == unicodedata.normalize("NFC", "Café line\nnext line\nlast")
    assert unicodedata.is_normalized("NFC", got)


def test_each_filter_fires_on_its_case():
    rng = random.Random(0)
    cfg = FilterConfig()
    good = _prose(rng, 300)
    assert check(good, "en", cfg) is None
    assert check("short text", "en", cfg) == "too_short"
    assert check("x" * 50 + " " + good, "en", FilterConfig(max_chars=100)) == "too_long"
    dup_lines = "\n".join([_prose(rng, 12)] * 5 + [_prose(rng, 12)])
    assert check(dup_lines, "en", cfg) == "dup_lines"
    para = _prose(rng, 60)
    dup_paras = "\n\n".join([para + " " + w for w in ("one", "two")] + [para + " one"] * 2)
    assert check(dup_paras, "en", FilterConfig(max_dup_line_fraction=1.0)) == "dup_paragraphs"
    spam = " ".join(["buy now"] * 60 + [_prose(rng, 40)])
    assert check(spam, "en", cfg) == "top_ngram"
    zh_text = "".join(rng.choice("天地玄黄宇宙洪荒日月盈昃辰宿列张寒来暑往秋收冬藏") for _ in range(300))
    assert check(zh_text, "zh", cfg) is None
    assert check(zh_text, "en", cfg) == "wrong_script"
    assert check(good, "zh", cfg) == "wrong_script"


def test_script_ratio_and_top_ngram_against_reference():
    rng = random.Random(1)
    text = _prose(rng, 200) + " 中文字符" * 30
    cjk = len(re.findall(r"[\u4e00-\u9fff]", text))
    latin = len(re.findall(r"[A-Za-z]", text))
    assert script_ratio(text, "zh") == pytest.approx(cjk / (cjk + latin))
    words = re.findall(r"\w+", text.lower())
    pairs = list(zip(words, words[1:]))
    top = max(set(pairs), key=pairs.count)
    want = pairs.count(top) * (len(top[0]) + len(top[1])) / sum(map(len, words))
    assert top_ngram_share(text, "en") == pytest.approx(want)


def _ref_shingles(text, lang, n=5):
    if lang == "zh":
        units = [c for c in text.lower() if not c.isspace()]
    else:
        units = re.findall(r"[^\W_]+", text.lower())
    return {tuple(units[i:i + n]) for i in range(len(units) - n + 1)}


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_shingles_and_minhash_estimate_jaccard(lang):
    rng = random.Random(2)
    mh = MinHasher(num_perm=256, bands=32)
    for changes in (2, 10, 40):
        if lang == "en":
            base = _prose(rng, 400).split()
            other = list(base)
            for i in rng.sample(range(len(other)), changes):
                other[i] = "zz" + str(i)
            a, b = " ".join(base), " ".join(other)
        else:
            base = [rng.choice("天地玄黄宇宙洪荒日月盈昃辰宿列张寒来暑往") for _ in range(600)]
            other = list(base)
            for i in rng.sample(range(len(other)), changes):
                other[i] = "秋"
            a, b = "".join(base), "".join(other)
        ra, rb = _ref_shingles(a, lang), _ref_shingles(b, lang)
        sa, sb = shingles(a, lang), shingles(b, lang)
        assert len(sa) == len(ra) and len(sb) == len(rb)  # no hash collisions at this size
        true_j = len(ra & rb) / len(ra | rb)
        assert len(np.intersect1d(sa, sb)) / len(np.union1d(sa, sb)) == pytest.approx(true_j)
        est = np.mean(mh.signature(sa) == mh.signature(sb))
        assert abs(est - true_j) < 0.08, (changes, est, true_j)


def test_exact_key_ignores_case_and_whitespace_only():
    assert exact_key("Hello  World\n") == exact_key("hello world")
    assert exact_key("hello world") != exact_key("hello worlds")


def _mixed_docs(rng, n=120):
    """Short, long, empty, spammy, mixed-script and tie-heavy documents, in one batch."""
    alphabet = "ab cΣİ中文\n\u3000é1"
    docs = ["", " ", "a", "ab cd", "ab ab", "ΑΣ' Α ΣΣ", "İstanbul İİ word word", "中文\u3000中文 中文中文中文中文",
            "x\n\ny\n\nx", "a b a b a b c", "e\u0301e\u0301 ﬀ ß", "a b c d e f"]
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            docs.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))))
        elif kind < 0.7:
            docs.append(_prose(rng, rng.randint(1, 400)))
        elif kind < 0.9:
            docs.append(" ".join(["buy now"] * rng.randint(1, 50) + [_prose(rng, rng.randint(0, 60))]))
        else:
            docs.append("".join(rng.choice("天地玄黄宇宙洪荒 ab") for _ in range(rng.randint(0, 3000))))
    docs.append(_prose(rng, 30_000))  # over the 100k-character sample
    return docs


def _ref_top_ngram_share(text, language):
    """One document, the n-grams counted in Python: the most frequent (ties: smallest hash), its first
    occurrence's length in characters, times its count, over all characters of the units."""
    n = 4 if language == "zh" else 2
    u, lengths = units(text[:100_000], language)
    if len(u) < n + 1:
        return 0.0
    g = [int(x) for x in gram_hashes(u, n)]
    counts = {}
    for x in g:
        counts[x] = counts.get(x, 0) + 1
    top = min(counts, key=lambda x: (-counts[x], x))
    first = g.index(top)
    return counts[top] * int(lengths[first:first + n].sum()) / int(lengths.sum())


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_batched_filters_match_one_document_at_a_time(lang):
    rng = random.Random(3)
    docs = _mixed_docs(rng)
    assert list(top_ngram_shares(docs, lang)) == [_ref_top_ngram_share(d, lang) for d in docs]
    assert list(script_ratios(docs, lang)) == [script_ratio(d, lang) for d in docs]
    for cfg in (FilterConfig(), FilterConfig(min_chars=0, min_chars_zh=0, max_dup_line_fraction=1.0,
                                             max_dup_paragraph_fraction=1.0)):
        want = [check(d, lang, cfg) for d in docs]
        assert len(set(want)) > 2  # the batch exercises several filters
        assert check_batch(docs, lang, cfg) == want
        assert check_batch(docs[::-1], lang, cfg) == want[::-1]


def test_exact_key_is_the_hash_of_split_and_joined_text():
    assert all(chr(c).isspace() == bool(_ASCII_SPACE[c]) for c in range(128))
    others = "".join(chr(c) for c in range(128, 0x110000) if chr(c).isspace())
    assert len(_NON_ASCII_SPACE.findall(others)) == len(others)
    rng = random.Random(4)
    pieces = ["Word", "ÄÖ", "中文", " ", "  ", "\n", "\t", "\x0b", "\x0c", "\x1c", "\u3000", "\xa0", "\u2009"]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.choice([10, 3000, 6000])))
        if rng.random() < 0.5:  # long texts without non-ASCII spaces take the numpy path
            text = _NON_ASCII_SPACE.sub("", text)
        want = xxhash.xxh3_64_intdigest(" ".join(text.lower().split()).encode("utf-8"))
        assert exact_key(text) == want
    assert exact_key(" \n" * 5000) == xxhash.xxh3_64_intdigest(b"")


def test_encode_document_array_matches_encode_document():
    for text in ["", "plain text", "special <|endoftext|> and <|fim_prefix|> stay text", "中文 😀 " * 40,
                 "lone \ud800 surrogate"]:
        assert encode_document_array(text).tolist() == encode_document(text)

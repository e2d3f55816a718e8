"""Cleaning, filters and MinHash against plain-Python references."""
import random
import re
import unicodedata

import numpy as np
import pytest

from data_pipeline.config import FilterConfig
from data_pipeline.dedup import MinHasher, exact_key, shingles
from data_pipeline.filters import check, clean, script_ratio, top_ngram_share

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

"""Cleaning and rule-based filters. clean() normalises; check() returns the name of the first filter a
document fails, or None. Both are pure functions of the text, so they run in worker processes and in
streaming mode alike."""
from __future__ import annotations

import re
import unicodedata
from collections import Counter

from .config import FilterConfig

# C0/C1 controls except tab and newline, plus BOM, zero-width no-break space and other format marks that
# carry no text
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\ufffe\u200b]")
_CJK = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
_LATIN = re.compile("[A-Za-z\u00c0-\u024f]")
_WORD = re.compile(r"\w+")
_PARA = re.compile(r"\n\s*\n")

FILTER_NAMES = ("too_short", "too_long", "dup_lines", "dup_paragraphs", "top_ngram", "wrong_script")


def clean(text: str) -> str:
    """NFC, Windows/Mac line ends to \\n, control characters removed, outer whitespace stripped."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    return unicodedata.normalize("NFC", text).strip()


def script_ratio(text: str, language: str) -> float:
    """Share of the source language's script among Latin and CJK letters (1.0 when there are none)."""
    sample = text[:100_000]  # the head of a long document decides; counting all of a book costs time
    cjk = len(_CJK.findall(sample))
    latin = len(_LATIN.findall(sample))
    if cjk + latin == 0:
        return 1.0
    return (cjk if language == "zh" else latin) / (cjk + latin)


def _dup_fraction(parts: list[str]) -> float:
    """Characters in parts that repeat an earlier part, over all characters."""
    seen: set[str] = set()
    dup = total = 0
    for p in parts:
        n = len(p)
        total += n
        if p in seen:
            dup += n
        else:
            seen.add(p)
    return dup / total if total else 0.0


def top_ngram_share(text: str, language: str) -> float:
    """Characters covered by the most frequent n-gram: word 2-grams (en) or character 4-grams (zh)."""
    sample = text[:200_000]
    if language == "zh":
        chars = [c for c in sample if not c.isspace()]
        grams = Counter("".join(chars[i:i + 4]) for i in range(len(chars) - 3))
        if not grams:
            return 0.0
        return grams.most_common(1)[0][1] * 4 / len(chars)
    words = _WORD.findall(sample)
    if len(words) < 2:
        return 0.0
    grams = Counter(zip(words, words[1:]))
    (a, b), count = grams.most_common(1)[0]
    return count * (len(a) + len(b)) / max(sum(map(len, words)), 1)


def check(text: str, language: str, cfg: FilterConfig) -> str | None:
    """Name of the first filter the cleaned text fails (see FILTER_NAMES), or None to keep it."""
    n = len(text)
    if n < (cfg.min_chars_zh if language == "zh" else cfg.min_chars):
        return "too_short"
    if n > cfg.max_chars:
        return "too_long"
    if _dup_fraction([ln.strip() for ln in text.split("\n") if ln.strip()]) > cfg.max_dup_line_fraction:
        return "dup_lines"
    paras = [p.strip() for p in _PARA.split(text) if p.strip()]
    if len(paras) > 1 and _dup_fraction(paras) > cfg.max_dup_paragraph_fraction:
        return "dup_paragraphs"
    if top_ngram_share(text, language) > cfg.max_top_ngram_share:
        return "top_ngram"
    if script_ratio(text, language) < cfg.min_script_ratio:
        return "wrong_script"
    return None

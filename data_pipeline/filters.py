"""Cleaning and rule-based filters. clean() normalises; check() returns the name of the first filter a
document fails, or None. Both are pure functions of the text, so they run in worker processes and in
streaming mode alike."""
from __future__ import annotations

import re
import unicodedata
import numpy as np

from .config import FilterConfig
from .dedup import gram_hashes, units

# C0/C1 controls except tab and newline, plus BOM, zero-width no-break space and other format marks that
# carry no text
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\ufffe\u200b]")
_PARA = re.compile(r"\n\s*\n")

FILTER_NAMES = ("too_short", "too_long", "dup_lines", "dup_paragraphs", "top_ngram", "wrong_script")


def clean(text: str) -> str:
    """NFC, Windows/Mac line ends to \\n, control characters removed, outer whitespace stripped."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    return unicodedata.normalize("NFC", text).strip()


def script_ratio(text: str, language: str) -> float:
    """Share of the source language's script among Latin and CJK letters (1.0 when there are none),
    over the first 100k characters."""
    cp = np.frombuffer(text[:100_000].encode("utf-32-le"), dtype=np.uint32)
    cjk = int(np.count_nonzero(((cp >= 0x3400) & (cp <= 0x9FFF)) | ((cp >= 0xF900) & (cp <= 0xFAFF))
                               | ((cp >= 0x20000) & (cp <= 0x2FA1F))))
    latin = int(np.count_nonzero(((cp | 0x20) >= 0x61) & ((cp | 0x20) <= 0x7A))
                + np.count_nonzero((cp >= 0xC0) & (cp <= 0x24F)))
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
    """Characters covered by the most frequent n-gram (counting every occurrence): word 2-grams (en) or
    character 4-grams (zh), over the first 100k characters (a sample: spam repeats throughout)."""
    n = 4 if language == "zh" else 2
    u, lengths = units(text[:100_000], language)
    if len(u) < n + 1:
        return 0.0
    g = gram_hashes(u, n)
    gs = np.sort(g)
    run_starts = np.concatenate([[0], np.nonzero(gs[1:] != gs[:-1])[0] + 1, [len(gs)]])
    counts = np.diff(run_starts)
    top = int(np.argmax(counts))
    first = int(np.argmax(g == gs[run_starts[top]]))  # one occurrence: its length in characters
    gram_chars = int(lengths[first:first + n].sum())
    return float(counts[top] * gram_chars / lengths.sum())


def check(text: str, language: str, cfg: FilterConfig) -> str | None:
    """Name of the first filter the cleaned text fails (see FILTER_NAMES), or None to keep it."""
    n = len(text)
    if n < (cfg.min_chars_zh if language == "zh" else cfg.min_chars):
        return "too_short"
    if n > cfg.max_chars:
        return "too_long"
    if _dup_fraction([ln for ln in map(str.strip, text.split("\n")) if ln]) > cfg.max_dup_line_fraction:
        return "dup_lines"
    paras = [p for p in map(str.strip, _PARA.split(text)) if p]
    if len(paras) > 1 and _dup_fraction(paras) > cfg.max_dup_paragraph_fraction:
        return "dup_paragraphs"
    if top_ngram_share(text, language) > cfg.max_top_ngram_share:
        return "top_ngram"
    if script_ratio(text, language) < cfg.min_script_ratio:
        return "wrong_script"
    return None

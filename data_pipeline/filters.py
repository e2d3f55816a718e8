"""Cleaning and rule-based filters. clean() normalises; check() returns the name of the first filter a
document fails, or None. Both are pure functions of the text, so they run in worker processes and in
streaming mode alike."""
from __future__ import annotations

import re
import unicodedata
import numpy as np

from .config import FilterConfig
from .dedup import gram_hashes, units_batch

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
    return float(script_ratios([text], language)[0])


def script_ratios(texts: list[str], language: str) -> np.ndarray:
    """script_ratio() of several documents, with one pass of numpy calls for all of them."""
    heads = [t[:100_000] for t in texts]
    cp = np.frombuffer("".join(heads).encode("utf-32-le"), dtype=np.uint32)
    cjk = (((cp >= 0x3400) & (cp <= 0x9FFF)) | ((cp >= 0xF900) & (cp <= 0xFAFF))
           | ((cp >= 0x20000) & (cp <= 0x2FA1F)))
    latin = (((cp | 0x20) >= 0x61) & ((cp | 0x20) <= 0x7A)) | ((cp >= 0xC0) & (cp <= 0x24F))
    bounds = np.zeros(len(heads) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, heads), np.int64, len(heads)), out=bounds[1:])
    n_cjk, n_latin = (np.concatenate([[0], np.cumsum(m, dtype=np.int64)])[bounds] for m in (cjk, latin))
    n_cjk, n_latin = np.diff(n_cjk), np.diff(n_latin)
    letters = n_cjk + n_latin
    mine = n_cjk if language == "zh" else n_latin
    # integer counts below 2**53: the float64 quotient is the same as Python's int / int
    return np.where(letters > 0, mine / np.maximum(letters, 1), 1.0)


def _dup_fraction(parts: list[str]) -> float:
    """Characters in parts that repeat an earlier part, over all characters: every part but the first
    of each distinct text is a repeat."""
    total = sum(map(len, parts))
    return (total - sum(map(len, set(parts)))) / total if total else 0.0


def top_ngram_share(text: str, language: str) -> float:
    """Characters covered by the most frequent n-gram (counting every occurrence): word 2-grams (en) or
    character 4-grams (zh), over the first 100k characters (a sample: spam repeats throughout)."""
    return float(top_ngram_shares([text], language)[0])


def top_ngram_shares(texts: list[str], language: str) -> np.ndarray:
    """top_ngram_share() of several documents, with one pass of numpy calls for all of them. Ties
    between n-grams go to the smallest hash and the share uses the n-gram's first occurrence, as for
    one document."""
    n = 4 if language == "zh" else 2
    out = np.zeros(len(texts))
    u, lengths, doc = units_batch([t[:100_000] for t in texts], language)
    # units of document d are [ub[d], ub[d + 1]); a document with fewer than n + 1 units scores 0
    ub = np.searchsorted(doc, np.arange(len(texts) + 1))
    scored = np.diff(ub) >= n + 1
    if len(u) < n or not scored.any():
        return out
    g = gram_hashes(u, n)  # every window, including ones across documents (dropped next)
    gpos = np.flatnonzero((doc[n - 1:] == doc[:len(g)]) & scored[doc[:len(g)]])
    g, gdoc = g[gpos], doc[gpos]
    # n-grams by (document, hash): the hash replaced by its rank among the batch's distinct hashes, so
    # that one int64 key sorts both
    by_hash = np.argsort(g)
    gs = g[by_hash]
    rank = np.empty(len(g), np.int64)
    rank[by_hash] = np.cumsum(np.concatenate([[True], gs[1:] != gs[:-1]])) - 1
    n_ranks = int(rank.max()) + 1
    key = np.sort(gdoc * n_ranks + rank)
    run_start = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    run_count = np.diff(np.append(run_start, len(key)))
    run_doc = key[run_start] // n_ranks
    doc_first_run = np.flatnonzero(np.concatenate([[True], run_doc[1:] != run_doc[:-1]]))
    best = np.maximum.reduceat(run_count, doc_first_run)
    # each document's most frequent n-gram; of a tie, the first run, which has the smallest hash
    top = np.flatnonzero(run_count == np.repeat(best, np.diff(np.append(doc_first_run, len(run_count)))))
    top = top[np.concatenate([[True], run_doc[top[1:]] != run_doc[top[:-1]]])]
    d = run_doc[top]
    top_rank = np.full(len(texts), -1, np.int64)
    top_rank[d] = key[run_start[top]] % n_ranks
    hits = np.flatnonzero(rank == top_rank[gdoc])  # occurrences of the top n-grams, in text order
    first = gpos[hits[np.concatenate([[True], gdoc[hits[1:]] != gdoc[hits[:-1]]])]]  # unit of the first
    cum = np.concatenate([[0], np.cumsum(lengths)])
    gram_chars = cum[first + n] - cum[first]
    out[d] = run_count[top] * gram_chars / (cum[ub[d + 1]] - cum[ub[d]])
    return out


def check(text: str, language: str, cfg: FilterConfig) -> str | None:
    """Name of the first filter the cleaned text fails (see FILTER_NAMES), or None to keep it."""
    return check_batch([text], language, cfg)[0]


def check_batch(texts: list[str], language: str, cfg: FilterConfig) -> list[str | None]:
    """check() of several documents of one language; the numpy filters run over groups of documents
    (see _groups) rather than one document at a time. Same results as check() on each."""
    reasons: list[str | None] = [None] * len(texts)
    pending = []  # documents that pass the per-document filters
    min_chars = cfg.min_chars_zh if language == "zh" else cfg.min_chars
    for i, text in enumerate(texts):
        n = len(text)
        if n < min_chars:
            reasons[i] = "too_short"
        elif n > cfg.max_chars:
            reasons[i] = "too_long"
        elif _dup_fraction(list(filter(None, map(str.strip, text.split("\n"))))) > cfg.max_dup_line_fraction:
            reasons[i] = "dup_lines"
        else:
            paras = list(filter(None, map(str.strip, _PARA.split(text))))
            if len(paras) > 1 and _dup_fraction(paras) > cfg.max_dup_paragraph_fraction:
                reasons[i] = "dup_paragraphs"
            else:
                pending.append(i)
    for group in _groups(pending, texts):
        docs = [texts[i] for i in group]
        for i, t, s in zip(group, top_ngram_shares(docs, language), script_ratios(docs, language)):
            if t > cfg.max_top_ngram_share:
                reasons[i] = "top_ngram"
            elif s < cfg.min_script_ratio:
                reasons[i] = "wrong_script"
    return reasons


GROUP_CHARS = 1 << 14  # 16k-32k measured fastest on the shared corpus (4k: +20%, 256k and up: +60%)


def _groups(indices: list[int], texts: list[str]):
    """indices split into runs of documents with about GROUP_CHARS characters (of the first 100k of each)
    together: enough documents to spread numpy's per-call cost, arrays small enough to stay in cache
    (large temporary arrays cost more in page faults than they save in calls)."""
    group, size = [], 0
    for i in indices:
        group.append(i)
        size += min(len(texts[i]), 100_000)
        if size >= GROUP_CHARS:
            yield group
            group, size = [], 0
    if group:
        yield group

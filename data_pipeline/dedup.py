"""Deduplication: exact (64-bit hash of the normalised text) and near-duplicate (MinHash + LSH).

Shingles are word 5-grams (en) or character 5-grams (zh), hashed with numpy over the text's code points
rather than string by string. MinHash uses the multiply-shift family h(x) = (a*x + b) >> 32 (a odd,
64-bit wrap-around), num_perm of them; LSH groups documents whose signatures agree on a whole band.
Per-document signatures and band keys are computed in the workers of each prepare part; the staged
merge (merge.py) links candidates whose estimated Jaccard reaches the threshold. The survivor of each
linked group is its first document in the global order, so the result does not depend on how the work
was split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash


def exact_key(text: str) -> int:
    """Hash of the text's dedup key (see key_codepoints: NFKC, case-folded, invisible characters dropped)
    with whitespace runs collapsed: two copies that differ only in case, spacing, full-width vs ASCII
    forms, soft hyphens or zero-width characters get the same key. xxh3-64 of the key's UTF-32LE bytes."""
    return exact_keys([text])[0]


def exact_keys(texts: list[str], kb: "KeyedBatch | None" = None) -> list[int]:
    """exact_key() of several documents, with one pass of numpy calls for all of them (reusing `kb`,
    their keyed_batch(), when given)."""
    cp, starts = (kb.cp, kb.starts) if kb is not None else key_codepoints(texts)
    space = _is_space(cp)
    keep = ~space
    keep[1:] |= ~space[:-1]  # of a run of spaces, the first stays, as " "
    body = np.where(space, np.uint32(32), cp)
    out = []
    ends = np.append(starts[1:] - 1, len(cp))  # documents are joined by one space
    for a, b in zip(starts, ends):
        k = body[a:b][keep[a:b]]
        # outer spaces go (a leading one can survive the run rule at the document's first position)
        lo, hi = 0, len(k)
        while lo < hi and k[lo] == 32:
            lo += 1
        while hi > lo and k[hi - 1] == 32:
            hi -= 1
        out.append(xxhash.xxh3_64_intdigest(k[lo:hi].tobytes()))
    return out


# What str.split() splits on (tests check the list against str.isspace)
_SPACE_CPS = np.array([9, 10, 11, 12, 13, 28, 29, 30, 31, 32, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                       0x2028, 0x2029, 0x202F, 0x205F, 0x3000], dtype=np.uint32)


def _is_space(cp: np.ndarray) -> np.ndarray:
    return _space_table().take(cp, mode="clip")


_TABLES: dict = {}


def _space_table() -> np.ndarray:
    if "space" not in _TABLES:
        t = np.zeros(int(_SPACE_CPS.max()) + 2, bool)  # the last entry (False) stands for all above
        t[_SPACE_CPS] = True
        _TABLES["space"] = t
    return _TABLES["space"]


# Characters that carry no text: dropped from dedup keys (soft hyphen, zero-width space / non-joiner /
# joiner, word joiner and invisible operators, BOM, combining grapheme joiner, Mongolian vowel separator,
# variation selectors). Two copies of a text differing only in these are the same text to a reader.
_INVISIBLE = [0xAD, 0x34F, 0x180E, *range(0x200B, 0x2010), *range(0x2060, 0x2065), 0xFEFF,
              *range(0xFE00, 0xFE10)]
# CJK punctuation with an ASCII counterpart that NFKC leaves alone
_CJK_PUNCT = {"。": ".", "、": ",", "「": '"', "」": '"', "『": '"', "』": '"', "“": '"', "”": '"',
              "‘": "'", "’": "'", "〈": "<", "〉": ">", "《": '"', "》": '"', "【": "[", "】": "]",
              "〔": "(", "〕": ")", "—": "-", "–": "-", "…": "."}
_KEY_LIMIT = 0x30000  # tables cover the BMP and the planes with compatibility characters


def code_string(cps: np.ndarray) -> str:
    """The code points as one string (lone surrogates allowed): a decode, where "".join(map(chr, ...))
    makes one object per character."""
    return np.asarray(cps, np.uint32).tobytes().decode("utf-32-le", "surrogatepass")


def _key_table() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(single, is_single, start, length, data): code point c of a dedup key becomes single[c] where
    is_single[c], else data[start[c]:start[c]+length[c]] — its NFKC form, lower-cased (empty for the
    invisible characters). Built once per process with one normalize call over all code points joined
    by NUL (a starter, so nothing composes across it)."""
    if "key" in _TABLES:
        return _TABLES["key"]
    import unicodedata
    cps = np.r_[1:0xD800, 0xE000:_KEY_LIMIT]
    joined = np.zeros(2 * len(cps) - 1, np.uint32)
    joined[::2] = cps
    # lower() of the joined forms is lower() of each: NUL is neither cased nor case-ignorable, so the
    # one context rule (final sigma) never looks across it
    forms = unicodedata.normalize("NFKC", code_string(joined)).lower().split("\0")
    assert len(forms) == len(cps)
    lens = np.fromiter(map(len, forms), np.int64, len(forms))
    chars = np.frombuffer("".join(forms).encode("utf-32-le", "surrogatepass"), np.uint32)
    one = lens == 1
    single = np.arange(_KEY_LIMIT, dtype=np.uint32)
    mapped = chars[(np.cumsum(lens) - lens)[one]]
    for k, v in _CJK_PUNCT.items():  # single characters, unchanged by lower()
        mapped[mapped == ord(k)] = ord(v)
    single[cps[one]] = mapped
    start = np.arange(_KEY_LIMIT, dtype=np.int64)
    length = np.ones(_KEY_LIMIT, np.int64)
    many = ~one
    start[cps[many]] = _KEY_LIMIT + np.cumsum(lens[many]) - lens[many]
    length[cps[many]] = lens[many]
    length[_INVISIBLE] = 0
    data = np.concatenate([single, chars[np.repeat(many, lens)]])
    _TABLES["key"] = (single, length == 1, start, length, data)
    return _TABLES["key"]


def key_codepoints(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The documents' dedup keys as one uint32 code point array, documents joined by a space, and the
    start of each document in it. A key is the text in NFKC form (full-width letters, digits and
    punctuation become ASCII, ligatures and compatibility ideographs their plain forms), lower-cased,
    CJK punctuation mapped to ASCII, and invisible characters (soft hyphen, zero-width characters)
    dropped. Mapped one code point at a time through a table (unicodedata.normalize is ~1 M
    characters/s on Chinese text, the table a gather)."""
    raw = np.frombuffer(" ".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    single, is_single, start, length, data = _key_table()
    doc_len = np.fromiter(map(len, texts), np.int64, len(texts))
    in_starts = np.zeros(len(texts), np.int64)
    if len(texts) > 1:
        np.cumsum(doc_len[:-1] + 1, out=in_starts[1:])
    if int(raw.max(initial=0)) >= _KEY_LIMIT:  # beyond the tables' planes: kept as they are
        c = np.minimum(raw, _KEY_LIMIT - 1)
        cp = np.where(raw >= _KEY_LIMIT, raw, single.take(c))
        bad = np.flatnonzero(~is_single.take(c) & (raw < _KEY_LIMIT))
    else:  # take(): a gather without fancy indexing's overhead
        c = raw
        cp = single.take(c)
        bad = np.flatnonzero(~is_single.take(c))
    if not len(bad):
        return cp, in_starts
    # expansions (ligatures, fractions) and dropped (invisible) characters: rare, handled at their
    # positions only; every other character is copied once by np.repeat
    n_bad = length[c[bad]]
    counts = np.ones(len(raw), np.int64)
    counts[bad] = n_bad
    cp = np.repeat(cp, counts)
    shift = np.concatenate([[0], np.cumsum(n_bad - 1)])  # extra characters before each bad position
    out_bad = bad + shift[:-1]  # where each bad position's expansion starts in the output
    grow = n_bad > 0
    if grow.any():
        reps = n_bad[grow]
        first = np.repeat(out_bad[grow], reps)
        within = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
        cp[first + within] = data[np.repeat(start[c[bad[grow]]], reps) + within]
    return cp, in_starts + shift[np.searchsorted(bad, in_starts)]


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: spreads linear combinations into well-mixed 64-bit values
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_rng = np.random.default_rng(12345)
_POS = _rng.integers(1, 2**63, size=64, dtype=np.uint64) | np.uint64(1)  # per offset in a word
_GRAM = _rng.integers(1, 2**63, size=16, dtype=np.uint64) | np.uint64(1)  # per offset in a shingle
_GRAM = np.concatenate([_GRAM, np.random.default_rng(54321).integers(1, 2**63, size=48, dtype=np.uint64) | np.uint64(1)])


def units(text: str, language: str) -> tuple[np.ndarray, np.ndarray]:
    """The document's dedup key (key_codepoints) as hashed units and their lengths in characters: words
    (maximal runs of letters/digits) for en, letters and digits one by one for zh."""
    u, lengths, _ = units_batch([text], language)
    return u, lengths


@dataclass
class KeyedBatch:
    """Documents' dedup keys (key_codepoints: cp, and each document's start in it) and their units (u,
    ulen, udoc as units_batch returns them), computed once and shared by the filters, the exact key
    and the shingles."""
    cp: np.ndarray
    starts: np.ndarray
    u: np.ndarray
    ulen: np.ndarray
    udoc: np.ndarray

    def unit_bounds(self) -> np.ndarray:
        """Document d's units are u[b[d]:b[d + 1]]."""
        return np.searchsorted(self.udoc, np.arange(len(self.starts) + 1))

    def slice(self, a: int, b: int) -> "KeyedBatch":
        """The documents a..b-1 alone, indices rebased to 0."""
        ub = np.searchsorted(self.udoc, [a, b])
        end = self.starts[b] - 1 if b < len(self.starts) else len(self.cp)
        return KeyedBatch(self.cp[self.starts[a]:end], self.starts[a:b] - self.starts[a],
                          self.u[ub[0]:ub[1]], self.ulen[ub[0]:ub[1]], self.udoc[ub[0]:ub[1]] - a)


def keyed_batch(texts: list[str], language: str) -> KeyedBatch:
    cp, starts = key_codepoints(texts)
    return KeyedBatch(cp, starts, *_units(cp, starts, language))


def units_batch(texts: list[str], language: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """units() of several documents at once (one pass of numpy calls for the whole batch rather than
    one a document): (units, lengths, document index of each unit), documents in order. A unit's hash
    depends only on its own characters, so it is the same as from units() of its document alone."""
    cp, starts = key_codepoints(texts)  # one space between documents: never a unit
    return _units(cp, starts, language)


def _units(cp: np.ndarray, starts: np.ndarray, language: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        if language == "zh":
            pos = np.flatnonzero(_is_word(cp))  # letters and digits: punctuation variants do not matter
            u = cp[pos].astype(np.uint64)
            return u, np.ones(len(u), np.int64), np.searchsorted(starts, pos, side="right") - 1
        is_word = _is_word(cp)
        if not is_word.any():
            return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        first = is_word.copy()  # first and last character of each word
        first[1:] &= ~is_word[:-1]
        last = is_word.copy()
        last[:-1] &= ~is_word[1:]
        word_starts = np.flatnonzero(first)
        lengths = np.flatnonzero(last) + 1 - word_starts
        # offset of each word character in its word: a running count that restarts at each word
        ends = np.cumsum(lengths)
        offset = np.ones(int(ends[-1]), np.int64)
        offset[ends[:-1]] = 1 - lengths[:-1]
        offset = np.cumsum(offset) - 1
        vals = cp[is_word].astype(np.uint64)
        vals += np.uint64(1)
        vals *= _POS[offset & 63]
        u = _mix(np.add.reduceat(vals, ends - lengths))
        return u, lengths, np.searchsorted(starts, word_starts, side="right") - 1


def gram_hashes(u: np.ndarray, n: int) -> np.ndarray:
    """Hash of every run of n consecutive units (not deduplicated)."""
    m = len(u) - n + 1
    acc = np.zeros(max(m, 0), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc += u[j:j + m] * _GRAM[j]
        return _mix(acc)


def shingles(text: str, language: str, n: int = 5) -> np.ndarray:
    """uint64 hashes of the document's n-gram shingles (unique): word n-grams for en, character
    n-grams for zh. A document shorter than n units is one shingle."""
    return shingles_batch([text], language, n)[0]


def shingles_batch(texts: list[str], language: str, n: int = 5, kb: KeyedBatch | None = None
                   ) -> list[np.ndarray]:
    """shingles() of several documents, the units computed with one pass of numpy calls for all (or
    taken from `kb`, their keyed_batch(), when given)."""
    kb = kb if kb is not None else keyed_batch(texts, language)
    bounds = kb.unit_bounds()
    out = []
    with np.errstate(over="ignore"):
        for a, b in zip(bounds[:-1], bounds[1:]):
            m = int(b - a)
            out.append(np.zeros(0, np.uint64) if m == 0 else _sorted_unique(gram_hashes(kb.u[a:b], min(n, m))))
    return out


def shingle_hashes(kb: KeyedBatch, n: int = 5, docs: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The shingles of the documents `docs` (default all) of a keyed batch as (hashes, index of the
    document in `docs`), with one pass of numpy calls for all and NOT deduplicated: each document's
    distinct hashes are its shingles(), which is all MinHash needs (a repeat never changes a minimum)."""
    d = len(kb.starts)
    docs = np.arange(d) if docs is None else np.asarray(docs, np.int64)
    where = np.full(d + 1, -1, np.int64)  # document -> its index in docs (-1: not wanted)
    where[docs] = np.arange(len(docs))
    bounds = kb.unit_bounds()
    m = np.diff(bounds)
    h = [np.zeros(0, np.uint64)]
    hd = [np.zeros(0, np.int64)]
    if len(kb.u) >= n:
        g = gram_hashes(kb.u, n)
        udoc = kb.udoc
        at = np.flatnonzero((udoc[n - 1:] == udoc[:len(g)]) & (where[udoc[:len(g)]] >= 0))
        h.append(g[at])
        hd.append(where[udoc[at]])
    short = np.flatnonzero((m > 0) & (m < n) & (where[:d] >= 0))  # fewer units than n: one shingle
    if len(short):
        with np.errstate(over="ignore"):
            h.append(np.concatenate([gram_hashes(kb.u[bounds[i]:bounds[i + 1]], int(m[i])) for i in short]))
        hd.append(where[short])
    return np.concatenate(h), np.concatenate(hd)


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    # np.unique is ~100x slower than sort+mask on uint64 in numpy 2.x
    x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])] if len(x) else x


def _is_word(cp: np.ndarray) -> np.ndarray:
    # ASCII letters and digits, and every non-ASCII letter-range code point (accents, Greek, CJK...):
    # one gather from a table (every code point from its last entry on is a word character)
    return _word_table().take(cp, mode="clip")


def _is_word_ranges(cp: np.ndarray) -> np.ndarray:
    """The definition _word_table() tabulates."""
    return (((cp >= 48) & (cp <= 57)) | ((cp >= 97) & (cp <= 122)) | ((cp >= 65) & (cp <= 90))
            | ((cp >= 0xC0) & ~((cp >= 0x2000) & (cp <= 0x2BFF)) & ~((cp >= 0x3000) & (cp <= 0x303F))
               & ~((cp >= 0xFF00) & (cp <= 0xFF0F))))


def _word_table() -> np.ndarray:
    if "word" not in _TABLES:
        _TABLES["word"] = _is_word_ranges(np.arange(0x10000, dtype=np.uint32))
    return _TABLES["word"]


class MinHasher:
    """One-permutation MinHash with densification by rotation (Li, Owen & Zhang 2012; Shrivastava & Li
    2014): each shingle is hashed once (seeded), its hash picks one of num_perm bins and the bin keeps
    the smallest 32-bit value; an empty bin takes the value of the next non-empty bin to its right
    (circularly) plus a step per bin passed. Two documents agree on a bin with probability equal to
    their Jaccard similarity, as with num_perm independent hash functions, at 1/num_perm of the cost.
    Band keys hash `bands` groups of num_perm/bands bins for LSH."""

    def __init__(self, num_perm: int = 128, bands: int = 16, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.seed = rng.integers(1, 2**63, dtype=np.uint64)
        self.num_perm, self.bands = num_perm, bands
        self.rows = num_perm // bands
        self.band_mult = rng.integers(1, 2**63, size=self.rows, dtype=np.uint64) | np.uint64(1)

    def signature(self, sh: np.ndarray) -> np.ndarray:
        """uint32 [num_perm]; all-ones for a document without shingles."""
        return self.signatures([sh])[0]

    def signatures(self, shingle_sets: list[np.ndarray]) -> np.ndarray:
        """uint32 [documents, num_perm]: signature() of several documents with one pass of numpy calls."""
        d = len(shingle_sets)
        lengths = np.fromiter(map(len, shingle_sets), np.int64, d)
        flat = np.concatenate(shingle_sets) if d else np.zeros(0, np.uint64)
        return self.signatures_flat(flat, np.repeat(np.arange(d), lengths), d)

    def signatures_flat(self, hashes: np.ndarray, doc: np.ndarray, d: int) -> np.ndarray:
        """uint32 [d, num_perm]: the signatures of d documents from all their shingle hashes and the
        document index of each (any order; repeats allowed, as shingle_hashes() gives them)."""
        k = self.num_perm
        lengths = np.bincount(doc, minlength=d) if len(doc) else np.zeros(d, np.int64)
        sig = np.full(d * k, 0xFFFFFFFF, np.uint32)
        if len(hashes):
            with np.errstate(over="ignore"):
                h = _mix(hashes.astype(np.uint64) ^ self.seed)
                bins = ((h >> np.uint64(32)) * np.uint64(k)) >> np.uint64(32)  # uniform in [0, k)
                flat = doc.astype(np.uint64) * np.uint64(k) + bins
                np.minimum.at(sig, flat.astype(np.int64), (h & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        sig = sig.reshape(d, k)
        filled = np.zeros((d, k), bool)
        if len(hashes):
            filled.reshape(-1)[flat.astype(np.int64)] = True
        empty = ~filled & (lengths[:, None] > 0)
        if empty.any():
            # next filled bin at or after j, circularly: over two copies side by side
            pos = np.where(np.concatenate([filled, filled], axis=1), np.arange(2 * k), 2 * k)
            nxt = np.minimum.accumulate(pos[:, ::-1], axis=1)[:, ::-1][:, :k]
            rows, cols = np.nonzero(empty)
            src = nxt[rows, cols]
            with np.errstate(over="ignore"):
                sig[rows, cols] = sig[rows, src % k] + (src - cols).astype(np.uint32) * np.uint32(0x9E3779B1)
        return sig

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """uint64 [bands] (or [documents, bands] for a [documents, num_perm] input): one hash per band of
        rows (band index mixed in, so bands never collide)."""
        sig = np.asarray(sig)
        with np.errstate(over="ignore"):
            rows = sig.reshape(*sig.shape[:-1], self.bands, self.rows).astype(np.uint64)
            keys = (rows * self.band_mult).sum(axis=-1, dtype=np.uint64)
            return _mix(keys + np.arange(self.bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))

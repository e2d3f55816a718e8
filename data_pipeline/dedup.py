"""Deduplication: exact (64-bit hash of the normalised text) and near-duplicate (MinHash + LSH).

Shingles are word 5-grams (en) or character 5-grams (zh), hashed with numpy over the text's code points
rather than string by string. MinHash uses the multiply-shift family h(x) = (a*x + b) >> 32 (a odd,
64-bit wrap-around), num_perm of them; LSH groups documents whose signatures agree on a whole band.
Per-document signatures and band keys are computed in the workers of each prepare part; the merge step
(near_duplicates) sees all parts and links candidates whose estimated Jaccard reaches the threshold.
The survivor of each linked group is its first document in the global order, so the result does not
depend on how the work was split.
"""
from __future__ import annotations

import re

import numpy as np
import xxhash


def exact_key(text: str) -> int:
    """Hash of the text with case and whitespace runs normalised (after clean()): the xxh3 of
    " ".join(text.lower().split()) in UTF-8, computed with numpy on long texts without non-ASCII spaces
    (three times faster there than splitting into words)."""
    low = text.lower()
    if len(low) < 4096 or (not low.isascii() and _NON_ASCII_SPACE.search(low)):
        return xxhash.xxh3_64_intdigest(" ".join(low.split()).encode("utf-8"))
    b = np.frombuffer(low.encode("utf-8"), dtype=np.uint8)
    space = _ASCII_SPACE[b]  # bytes of multi-byte UTF-8 characters are >= 0x80, never a space
    body = np.flatnonzero(~space)
    if not len(body):
        return xxhash.xxh3_64_intdigest(b"")
    b, space = b[body[0]:body[-1] + 1], space[body[0]:body[-1] + 1]
    keep = ~space
    keep[1:] |= ~space[:-1]  # of a run of spaces, the first stays, as " "
    return xxhash.xxh3_64_intdigest(np.where(space, np.uint8(32), b)[keep])


# what str.split() splits on: the ASCII whitespace bytes, and the other characters for which
# str.isspace() holds (tests check both lists against str.isspace)
_ASCII_SPACE = np.zeros(256, bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_NON_ASCII_SPACE = re.compile("[\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")


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


def units(text: str, language: str) -> tuple[np.ndarray, np.ndarray]:
    """The document as hashed units and their lengths in characters: lowercased words (maximal runs of
    letters/digits) for en, non-space characters for zh."""
    u, lengths, _ = units_batch([text], language)
    return u, lengths


def units_batch(texts: list[str], language: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """units() of several documents at once (one pass of numpy calls for the whole batch rather than
    one a document): (units, lengths, document index of each unit), documents in order. A unit's hash
    depends only on its own characters, so it is the same as from units() of its document alone."""
    low = [t.lower() for t in texts]  # per document: lowercasing may change a document's length
    # documents joined by a space: a space is neither a word character (en) nor a unit (zh)
    cp = np.frombuffer(" ".join(low).encode("utf-32-le"), dtype=np.uint32)
    starts = np.zeros(len(low), np.int64)  # first code point of each document in cp
    if len(low) > 1:
        np.cumsum(np.fromiter(map(len, low[:-1]), np.int64, len(low) - 1) + 1, out=starts[1:])
    with np.errstate(over="ignore"):
        if language == "zh":
            pos = np.flatnonzero(~np.isin(cp, _WHITESPACE))
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
    units_, _ = units(text, language)
    with np.errstate(over="ignore"):
        if len(units_) < n:
            if len(units_) == 0:
                return np.zeros(0, np.uint64)
            n = len(units_)
        return _sorted_unique(gram_hashes(units_, n))


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    # np.unique is ~100x slower than sort+mask on uint64 in numpy 2.x
    x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])] if len(x) else x


_WHITESPACE = np.array([ord(c) for c in " \t\n\r\x0b\x0c\u3000\u00a0"], dtype=np.uint32)


def _is_word(cp: np.ndarray) -> np.ndarray:
    # ASCII letters and digits, and every non-ASCII letter-range code point (accents, Greek, CJK...)
    return (((cp >= 48) & (cp <= 57)) | ((cp >= 97) & (cp <= 122)) | ((cp >= 65) & (cp <= 90))
            | ((cp >= 0xC0) & ~((cp >= 0x2000) & (cp <= 0x2BFF)) & ~((cp >= 0x3000) & (cp <= 0x303F))
               & ~((cp >= 0xFF00) & (cp <= 0xFF0F))))


class MinHasher:
    """num_perm multiply-shift hash functions, fixed by seed; signature = per-function minimum."""

    def __init__(self, num_perm: int = 128, bands: int = 16, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
        self.num_perm, self.bands = num_perm, bands
        self.rows = num_perm // bands
        self.band_mult = rng.integers(1, 2**63, size=self.rows, dtype=np.uint64) | np.uint64(1)

    def signature(self, sh: np.ndarray) -> np.ndarray:
        """uint32 [num_perm]; all-ones for a document without shingles."""
        # min of (v >> 32) is (min of v) >> 32, so the shift is done on the minima only
        best = np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
        buf = np.empty((self.num_perm, min(len(sh), 4096)), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(0, len(sh), 4096):
                block = sh[i:i + 4096]
                h = buf[:, :len(block)]
                np.multiply(self.a[:, None], block[None, :], out=h)
                h += self.b[:, None]
                np.minimum(best, h.min(axis=1), out=best)
        return (best >> np.uint64(32)).astype(np.uint32)

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """uint64 [bands]: one hash per band of rows (band index mixed in, so bands never collide)."""
        with np.errstate(over="ignore"):
            rows = sig.reshape(self.bands, self.rows).astype(np.uint64)
            keys = (rows * self.band_mult[None, :]).sum(axis=1, dtype=np.uint64)
            return _mix(keys + np.arange(self.bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def near_duplicates(order: np.ndarray, bands: np.ndarray, sigs: np.ndarray, threshold: float,
                    max_group: int = 64) -> np.ndarray:
    """Boolean mask of documents to drop: each document that is linked (same band key in some band and
    estimated Jaccard >= threshold) to a document earlier in `order` goes, the first of a linked group
    stays. order: int64 [n] global positions; bands: uint64 [n, bands]; sigs: uint32 [n, num_perm]."""
    n = len(order)
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rank = np.argsort(order, kind="stable")  # rank[k] = the document at global position k
    pos = np.empty(n, np.int64)
    pos[rank] = np.arange(n)
    for b in range(bands.shape[1] if n else 0):
        keys = bands[:, b]
        by_key = np.lexsort((pos, keys))
        k_sorted = keys[by_key]
        bounds = np.nonzero(np.diff(k_sorted))[0] + 1
        for group in np.split(by_key, bounds):
            if len(group) < 2:
                continue
            group = group[:max_group]  # a huge bucket is boilerplate; its head is enough
            for j in range(1, len(group)):
                g = group[j]
                for h in group[:j]:
                    if find(g) == find(h):
                        break
                    if np.mean(sigs[g] == sigs[h]) >= threshold:
                        ra, rb = find(g), find(h)
                        # the root of a group is its earliest document
                        if pos[ra] < pos[rb]:
                            parent[rb] = ra
                        else:
                            parent[ra] = rb
                        break
    roots = np.fromiter((find(i) for i in range(n)), dtype=np.int64, count=n)
    return roots != np.arange(n)

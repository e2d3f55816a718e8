"""Token shards on disk: what prepare_data writes and the loader memory-maps.

Layout of one split of a prepared dataset:

    SPLIT/meta.json             format version, tokenizer, sources: name, language, weight, documents,
                                tokens, token_files (paths relative to SPLIT), index, order
    SPLIT/<source>.index.npy    int64 [documents, 2]: (offset, length) of each document, the offset into
                                the source's token files laid end to end in the listed order
    <token file>.tokens.bin     uint32 token ids, documents back to back, each ending in <|endoftext|>

The index lists a source's documents in the corpus's global order (source, file, document in file), so
it is the same whatever the number of prepare parts, and the loader's epoch permutations (of index
positions) give the same sample stream. `order` is a digest of that order (documents' global keys and
lengths), which the loader's state carries: a state never resumes on another order. An index may list
a subset of its token files' documents: prepare writes the tokens once and the train and val indexes
(after dedup) point into the same files. Source and language are per source (in meta.json): every
document of a source shares them, and this keeps the index at 16 bytes a document; the loader
memory-maps it (the ranks of a node share the pages), never copies it.
"""
from __future__ import annotations

import bisect
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from checkpoints.atomic import atomic_write_text

from .tokenizer import ENCODING_NAME, EOT_ID

FORMAT_VERSION = 2
TOKEN_DTYPE = np.uint32
OPEN_TOKEN_FILES = 64  # memory maps a store keeps open (each holds a file descriptor)


@dataclass
class SourceMeta:
    name: str
    language: str
    weight: float
    shards: list[dict] = field(default_factory=list)  # writer entries; write_meta turns them into an index
    documents: int = 0
    tokens: int = 0
    token_files: list[str] = field(default_factory=list)  # relative to the split
    token_file_tokens: list[int] = field(default_factory=list)  # size of each, in tokens
    index: str = ""  # relative to the split
    order: str = ""  # digest of the document order


class ShardWriter:
    """Appends tokenized documents of one source to numbered shard files (a new file every `shard_tokens`).

    Several writers may write disjoint shard numbers of one source (multi-process prepare): pass
    `first_shard` to keep their file names apart."""

    def __init__(self, root: Path, source: str, shard_tokens: int = 1 << 28, first_shard: int = 0,
                 prefix: str = ""):
        self.root = Path(root)
        self.dir = self.root / source
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.next_shard = first_shard
        self.stems: list[str] = []  # paths relative to root, without suffix
        self.doc_tables: list[np.ndarray] = []  # per shard, (offset, length) of every document
        self.documents = 0
        self.tokens = 0
        self._file = None
        self._docs: list[tuple[int, int]] = []
        self._pos = 0

    def _open(self) -> None:
        stem = f"{self.prefix}{self.next_shard:05d}"
        self.next_shard += 1
        self.stems.append(f"{self.dir.name}/{stem}")
        self._file = open(self.dir / f"{stem}.tokens.bin", "wb")
        self._docs, self._pos = [], 0

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        docs = np.asarray(self._docs, dtype=np.int64).reshape(-1, 2)
        np.save(self.root / f"{self.stems[-1]}.docs.npy", docs)
        self.doc_tables.append(docs)
        self._file = None

    def add(self, ids) -> tuple[int, int]:
        """Append one document (token ids, already ending with <|endoftext|>); returns its
        (shard number in this writer, row in that shard's index)."""
        arr = np.asarray(ids, dtype=TOKEN_DTYPE)
        if self._file is None or self._pos >= self.shard_tokens:
            self._close()
            self._open()
        self._file.write(arr.tobytes())
        self._docs.append((self._pos, len(arr)))
        self.last_offset = self._pos
        self._pos += len(arr)
        self.documents += 1
        self.tokens += len(arr)
        return len(self.stems) - 1, len(self._docs) - 1

    def close(self) -> None:
        self._close()

    def shard_entries(self) -> list[dict]:
        """meta.json `shards` entries for every document written (paths relative to root)."""
        return [{"tokens": f"{s}.tokens.bin", "docs": f"{s}.docs.npy"} for s in self.stems]


def write_meta(root: Path, sources: list[SourceMeta], extra: dict | None = None) -> None:
    """meta.json of a split (written last: its presence marks a complete split). A source given as
    writer `shards` (ShardWriter.shard_entries(), paths relative to root) gets its index built here,
    its documents in the writers' order."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for s in sources:
        if s.shards and not s.index:
            s = _index_from_shards(root, s)
        d = {k: v for k, v in vars(s).items() if k != "shards"}
        out.append(d)
    meta = {"format_version": FORMAT_VERSION, "tokenizer": ENCODING_NAME, "eot_id": EOT_ID,
            "token_dtype": "uint32", "sources": out}
    meta.update(extra or {})
    atomic_write_text(root / "meta.json", json.dumps(meta, indent=1))


def _index_from_shards(root: Path, s: SourceMeta) -> SourceMeta:
    files, sizes, parts, base = [], [], [], 0
    for sh in s.shards:
        docs = np.load(root / sh["docs"]).reshape(-1, 2)
        size = (root / sh["tokens"]).stat().st_size // 4
        files.append(sh["tokens"])
        sizes.append(size)
        parts.append(docs + np.array([base, 0]))
        base += size
    index = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    name = f"{s.name}.index.npy"
    np.save(root / name, index.astype(np.int64))
    return SourceMeta(s.name, s.language, s.weight, [], len(index), int(index[:, 1].sum()), files, sizes, name,
                      order_digest(np.arange(len(index)), index[:, 1]))


class OrderDigest:
    """Digest of a document order, fed in pieces: the documents' global keys and token counts, in
    index order."""

    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, keys: np.ndarray, lengths: np.ndarray) -> None:
        self._h.update(np.stack([np.asarray(keys, np.int64), np.asarray(lengths, np.int64)], 1).tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:16]


def order_digest(keys: np.ndarray, lengths: np.ndarray) -> str:
    d = OrderDigest()
    d.update(keys, lengths)
    return d.hexdigest()


def read_meta(root: Path) -> dict:
    path = Path(root) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{root} is not a prepared dataset (no meta.json); create one with "
                                f"`python launch/prepare_data.py --config DATA.yaml --out {root}`")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the dataset is damaged (a copy cut short?): copy it "
                         f"again or prepare it again") from err
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{root}: shard format {meta.get('format_version')} is not the supported "
                         f"{FORMAT_VERSION}; prepare the data again with this version")
    if meta.get("tokenizer") != ENCODING_NAME:
        raise ValueError(f"{root} was tokenized with {meta.get('tokenizer')!r}, not {ENCODING_NAME!r}")
    # the loader maps the token files as TOKEN_DTYPE and finds document ends by EOT_ID
    for key, want in (("token_dtype", np.dtype(TOKEN_DTYPE).name), ("eot_id", EOT_ID)):
        if meta.get(key) != want:
            raise ValueError(f"{path}: {key} {meta.get(key)!r} where this version reads {want!r}: the dataset was "
                             f"written for another token format; prepare it again with this version")
    return meta


def documents(split_dir: Path, source: str):
    """The token arrays of a source's documents in index order (each ending in <|endoftext|>): for
    inspection and tests; training reads through TokenStore."""
    split_dir = Path(split_dir)
    meta = next(s for s in read_meta(split_dir)["sources"] if s["name"] == source)
    index = np.load(split_dir / meta["index"], mmap_mode="r")
    tokens = np.concatenate([np.fromfile(split_dir / f, dtype=TOKEN_DTYPE) for f in meta["token_files"]]
                            or [np.zeros(0, TOKEN_DTYPE)])
    for off, n in index:
        yield tokens[off:off + n]


class TokenStore:
    """All documents of one source, read as an endless stream of epochs without holding anything per
    document in memory: the index is memory-mapped, and epoch e is the index positions in the order of
    a seeded bijection of [0, documents) (feistel_permutation; no shuffle array), so position p of
    the stream is a pure function of (seed, p).

    A cursor (epoch, position in the epoch, stream offset of that document's start) moves forward
    over the documents' lengths as windows are read; reading behind it walks again from the start of
    that epoch. cursor_at() gives the cursor of any later offset, which the loader's state keeps, so
    that a resume seeks at once instead of walking an epoch."""

    BLOCK = 1024  # documents located at a time (one permutation call, one gather from the index)

    def __init__(self, root: Path, meta: SourceMeta, seed: int, stream_id: int):
        self.meta = meta
        self.root = Path(root)
        if not meta.index:
            raise ValueError(f"source {meta.name!r} in {root} has no index (format {FORMAT_VERSION} needed)")
        try:
            self.index = np.load(self.root / meta.index, mmap_mode="r")
        except (ValueError, EOFError) as err:  # a header or body cut short: numpy's message names no file
            raise ValueError(f"{self.root / meta.index}: not a readable index ({err}); the dataset is damaged "
                             f"(a copy cut short?): copy it again or prepare it again") from err
        self._index = self.index.view(np.ndarray)  # the same mapped pages without np.memmap's per-slice cost
        if self.index.ndim != 2 or self.index.shape[1] != 2 or len(self.index) != meta.documents:
            raise ValueError(f"{self.root / meta.index}: expected int64 [{meta.documents}, 2], "
                             f"found {self.index.shape}; the dataset is damaged, prepare it again")
        self.n = int(meta.documents)
        self.total = int(meta.tokens)
        if self.total == 0 or self.n == 0:
            raise ValueError(f"source {meta.name!r} in {root} holds no tokens")
        width = np.dtype(TOKEN_DTYPE).itemsize
        for name, size in zip(meta.token_files, meta.token_file_tokens):
            path = self.root / name
            found = path.stat().st_size if path.is_file() else None
            if found is None:
                raise ValueError(f"{path}: missing, where {self.root / 'meta.json'} lists it with {size} tokens: the "
                                 f"token files were moved or deleted (meta.json names them relative to the split "
                                 f"folder, so move a dataset's folders together); restore them or prepare the "
                                 f"dataset afresh")
            if found % width:  # ends inside a token: cut off (a copy or a full disk)
                raise ValueError(f"{path}: {found} bytes, not a whole number of {width}-byte tokens "
                                 f"({self.root / 'meta.json'} says {size} tokens): the file was cut short; copy "
                                 f"the dataset again or prepare it afresh")
            if found != int(size) * width:
                raise ValueError(
                    f"{path}: holds {found // width} tokens where {self.root / 'meta.json'} says {size}: the "
                    f"token files changed after the merge "
                    f"wrote this index (a part prepared again?); run the merge again (prepare_data.py --merge-only) "
                    f"or prepare the dataset afresh")
        self.file_start = np.concatenate([[0], np.cumsum(meta.token_file_tokens)]).astype(np.int64)
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self.seed, self.stream_id = seed, stream_id
        self.cursor = (0, 0, 0)  # (epoch, position in epoch, stream offset of that document)
        self._block = None  # (epoch, first position, offsets in files, lengths, token files, stream starts)

    def docs_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Index rows (documents) at the given positions of an epoch."""
        return feistel_permutation(positions, self.n, (self.seed, self.stream_id, epoch))

    def _file(self, k: int) -> np.ndarray:
        m = self._maps.get(k)
        if m is None:
            if len(self._maps) >= OPEN_TOKEN_FILES:
                self._maps.popitem(last=False)
            path = self.root / self.meta.token_files[k]
            size = int(self.meta.token_file_tokens[k])
            m = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(size,)).view(np.ndarray) if size \
                else np.zeros(0, TOKEN_DTYPE)
            self._maps[k] = m
        else:
            self._maps.move_to_end(k)
        return m

    def _fill(self, e: int, i: int, start: int) -> None:
        """Locate the documents at epoch e's positions [i, i + BLOCK): offset in its token file, length,
        token file, stream start (as Python lists: the per-window work is a few list look-ups)."""
        pos = np.arange(i, min(i + self.BLOCK, self.n))
        rows = self._index[self.docs_at(e, pos)]
        starts = np.empty(len(pos) + 1, np.int64)
        starts[0] = start
        np.cumsum(rows[:, 1], out=starts[1:])
        starts[1:] += start
        files = np.searchsorted(self.file_start, rows[:, 0], side="right") - 1
        local = rows[:, 0] - self.file_start[files]
        self._block = (e, i, local.tolist(), rows[:, 1].tolist(), files.tolist(), starts.tolist())

    def _locate(self, pos: int) -> int:
        """Make the block hold the document at stream offset pos; returns its row in the block."""
        if self._block is None or pos < self._block[5][0]:
            e, i, start = self.cursor
            if pos < start or pos >= (e + 1) * self.total:  # behind the cursor: walk that epoch again
                e = pos // self.total
                i, start = 0, e * self.total
            self._fill(e, i, start)
        while True:
            e, i, local, lengths, files, starts = self._block
            if pos < starts[-1]:
                return bisect.bisect_right(starts, pos) - 1
            nxt = i + len(lengths)
            self._fill(*((e, nxt) if nxt < self.n else (e + 1, 0)), starts[-1])

    def cursor_at(self, pos: int) -> tuple[int, int, int]:
        """The cursor of the document holding stream offset pos (moving this store's cursor there)."""
        j = self._locate(pos)
        e, i, _, _, _, starts = self._block
        self.cursor = (e, i + j, starts[j])
        return self.cursor

    def set_cursor(self, cursor) -> bool:
        """Adopt a saved cursor if it is consistent with this index (its document's span is in the
        epoch); False (and nothing changed) otherwise."""
        e, i, start = (int(x) for x in cursor)
        if not (0 <= i < self.n and e >= 0 and e * self.total <= start < (e + 1) * self.total):
            return False
        length = int(self._index[int(self.docs_at(e, np.array([i]))[0]), 1])
        if start + length > (e + 1) * self.total:
            return False
        self.cursor = (e, i, start)
        self._block = None
        return True

    def read(self, pos: int, n: int, out: np.ndarray) -> None:
        """Copy stream positions [pos, pos+n) into out[:n]."""
        done = 0
        while done < n:
            j = self._locate(pos + done)
            e, i, local, lengths, files, starts = self._block
            while done < n and j < len(lengths):
                skip = pos + done - starts[j]
                take = min(n - done, lengths[j] - skip)
                a = local[j] + skip
                out[done:done + take] = self._file(files[j])[a:a + take]
                done += take
                j += 1
        self.cursor = (e, i + j - 1, starts[j - 1])


def feistel_permutation(x: np.ndarray, n: int, key: tuple[int, ...], rounds: int = 4) -> np.ndarray:
    """A seeded bijection of [0, n) evaluated at x (any shape): a balanced 4-round Feistel network (a
    pseudo-random permutation, Luby-Rackoff) over the smallest even number of bits covering n, with
    cycle-walking for values that land outside [0, n). Round function: multiplicative hashing of the
    right half xor a round key. A dozen vector operations per call, no memory per element of [0, n)."""
    x = np.asarray(x, dtype=np.uint64)
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(64 - half)
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest(), "little")
    keys = [np.uint64((seed >> (64 * r)) & 0xFFFFFFFFFFFFFFFF) for r in range(rounds)]
    mult = np.uint64(0x9E3779B97F4A7C15)

    def once(v):
        left, right = v >> np.uint64(half), v & mask
        with np.errstate(over="ignore"):
            for k in keys:
                left, right = right, left ^ (((right ^ k) * mult) >> shift)
        return (left << np.uint64(half)) | right

    out = once(x)
    bad = out >= np.uint64(n)
    while bad.any():  # cycle-walking: apply again until inside the domain (expected < 4 times)
        out[bad] = once(out[bad])
        bad = out >= np.uint64(n)
    return out.astype(np.int64)

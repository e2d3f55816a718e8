"""Token shards on disk: what prepare_data writes and the loader memory-maps.

Layout of one split of a prepared dataset:

    SPLIT/meta.json             format version, tokenizer, sources: name, language, weight, documents,
                                tokens, shards = [{"tokens": path, "docs": path}] relative to SPLIT
    <shard>.tokens.bin          uint32 token ids, documents back to back, each ending in <|endoftext|>
    <shard>.docs.npy            int64 [n_docs, 2]: (offset, length) of each document in its token file

A docs index may list a subset of its token file's documents: prepare_data writes the tokens once and
the train and val indexes (after dedup) point into the same files. Source and language are per source
(in meta.json) rather than per document: every document of a source shares them, and this keeps the
index at 16 bytes a document.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .tokenizer import ENCODING_NAME, EOT_ID

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint32


@dataclass
class SourceMeta:
    name: str
    language: str
    weight: float
    shards: list[dict] = field(default_factory=list)  # {"tokens": path, "docs": path}, relative to the split
    documents: int = 0
    tokens: int = 0


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
    meta = {"format_version": FORMAT_VERSION, "tokenizer": ENCODING_NAME, "eot_id": EOT_ID,
            "token_dtype": "uint32", "sources": [vars(s) for s in sources]}
    meta.update(extra or {})
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(root) / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, Path(root) / "meta.json")  # meta.json last: its presence marks a complete dataset


def read_meta(root: Path) -> dict:
    path = Path(root) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{root} is not a prepared dataset (no meta.json); create one with "
                                f"`python launch/prepare_data.py --config DATA.yaml --out {root}`")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{root}: shard format {meta.get('format_version')} is not the supported "
                         f"{FORMAT_VERSION}; prepare the data again with this version")
    if meta.get("tokenizer") != ENCODING_NAME:
        raise ValueError(f"{root} was tokenized with {meta.get('tokenizer')!r}, not {ENCODING_NAME!r}")
    return meta


class TokenStore:
    """All documents of one source, memory-mapped, read as an endless stream of epochs.

    Epoch e is every document once, in a permutation seeded by (seed, source, e); the stream is the
    concatenation of epochs, so position p of the stream is a pure function of (seed, p)."""

    def __init__(self, root: Path, meta: SourceMeta, seed: int, stream_id: int):
        self.meta = meta
        root = Path(root)
        self.files = []
        shard_of, offsets, lengths = [], [], []
        for k, shard in enumerate(meta.shards):
            docs = np.load(root / shard["docs"]).reshape(-1, 2)
            path = root / shard["tokens"]
            size = path.stat().st_size // 4
            self.files.append(np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(size,))
                              if size else np.zeros(0, TOKEN_DTYPE))
            shard_of.append(np.full(len(docs), k, dtype=np.int32))
            offsets.append(docs[:, 0])
            lengths.append(docs[:, 1])
        self.doc_shard = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.doc_offset = np.concatenate(offsets) if offsets else np.zeros(0, np.int64)
        self.doc_len = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.total = int(self.doc_len.sum())
        if self.total == 0:
            raise ValueError(f"source {meta.name!r} in {root} holds no tokens")
        self.seed, self.stream_id = seed, stream_id
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        if e not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            perm = np.random.default_rng([self.seed, self.stream_id, e]).permutation(len(self.doc_len))
            cum = np.zeros(len(perm) + 1, dtype=np.int64)
            np.cumsum(self.doc_len[perm], out=cum[1:])
            self._epochs[e] = (perm, cum)
        return self._epochs[e]

    def read(self, pos: int, n: int, out: np.ndarray) -> None:
        """Copy stream positions [pos, pos+n) into out[:n]."""
        done = 0
        while done < n:
            e, off = divmod(pos + done, self.total)
            perm, cum = self._epoch(e)
            i = int(np.searchsorted(cum, off, side="right")) - 1
            while done < n and i < len(perm):
                d = perm[i]
                start = off - cum[i]
                take = min(n - done, int(self.doc_len[d] - start))
                base = self.doc_offset[d] + start
                out[done:done + take] = self.files[self.doc_shard[d]][base:base + take]
                done += take
                off += take
                i += 1

"""Streaming mode: a data config read, filtered, tokenized and packed on the fly, no prepare step.

Each source is an endless stream of epochs; epoch e reads the source's files in a permutation seeded by
(seed, source, e) (a Hugging Face stream in its own order; a source with max_documents: the files holding
its first max_documents documents in sorted file order, found once at start, each read up to its share of
them, so every epoch reads the same documents), cleans and filters every document, keeps the
ones of the requested split (val: the documents whose text hash falls in `val_fraction`, as in
prepare), and appends their tokens. Window j of a source is stream tokens [j*seq_len, j*seq_len+seq_len+1),
the same rule as for prepared shards, so the loader's order, mixing and resume are the same; resuming
replays the source streams up to the saved position (tokenizing what is skipped), which suits the small
runs streaming mode is for. Dedup needs a view of the whole corpus: use prepare_data for it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np

from .config import DataConfig, SourceConfig, load_data_config, source_weights
from .dedup import exact_key
from .filters import check_batch, clean_batch
from .loader import digest, stable_id
from .mixing import normalise_weights
from .sources import Counts, capped_files, check_inputs, iter_source, no_match_detail
from .tokenizer import encode_document_array

log = logging.getLogger("linscale.data")


class _SourceStream:
    def __init__(self, cfg: DataConfig, src: SourceConfig, seed: int, split: str):
        self.cfg, self.src, self.seed, self.split = cfg, src, seed, split
        self.counts = Counts(src.name)
        self.removed: Counter = Counter()
        self.files, missing = cfg.files(src) if src.type != "hf" else ([], [])
        for m in missing:
            self.counts.skip("missing_files", m, no_match_detail(m))
        if src.type != "hf" and not self.files:
            raise FileNotFoundError(f"source {src.name!r}: no input files match {src.paths}")
        # max_documents: the first that many raw documents in sorted file order, found once here and read
        # every epoch (a cap counted along each epoch's own file order would take other documents each time)
        self.limits: list[int] | None = None
        if src.max_documents is not None and src.type != "hf":
            capped = capped_files(cfg, src)
            if capped:  # (none: no file holds a document; the first epoch reads them all and says why)
                self.files, self.limits = [f for f, _ in capped], [n for _, n in capped]
                log.info("source %r: its first %d documents (max_documents %d) lie in %d of its files; every "
                         "epoch reads them", src.name, sum(self.limits), src.max_documents, len(capped))
        self.buf = np.zeros(0, np.uint32)
        self.base = 0  # stream position of buf[0]
        self.epoch = 0
        self._docs = self._epoch_docs()

    def prime(self) -> None:
        """Pull the first document now, so that a source without any (of this split) fails at
        construction, not in the middle of training. ValueError if there is none."""
        if self.base == 0 and len(self.buf) == 0:
            self.buf = np.asarray(next(self._docs), dtype=np.uint32)

    def _epoch_docs(self):
        while True:
            got = 0
            if self.src.type == "hf":
                raw = iter_source(self.cfg, self.src, self.counts)
            else:
                perm = np.random.default_rng([self.seed, stable_id(self.src.name), self.epoch]
                                             ).permutation(len(self.files))
                raw = iter_source(self.cfg, self.src, self.counts, [self.files[i] for i in perm],
                                  None if self.limits is None else [self.limits[i] for i in perm])
            threshold = round(self.cfg.val_fraction * 1_000_000)
            for group in _groups(raw):
                texts = clean_batch(group)
                for text, reason in zip(texts, check_batch(texts, self.src.language, self.cfg.filters)):
                    if reason:
                        self.removed[reason] += 1
                        continue
                    if ((exact_key(text) % 1_000_000) < threshold) != (self.split == "val"):
                        continue
                    got += 1
                    yield encode_document_array(text)
            if got == 0:
                raise ValueError(f"source {self.src.name!r} yields no {self.split} documents after filtering "
                                 f"(removed: {dict(self.removed)}, skipped: {dict(self.counts.skipped)})")
            self.epoch += 1

    def read(self, pos: int, n: int, out: np.ndarray) -> None:
        """Copy stream positions [pos, pos+n) into out. Positions move forward; a position behind the buffer
        (the loader given an earlier state) restarts the stream and replays it, as a fresh resume does."""
        if pos < self.base:
            self.buf, self.base, self.epoch = np.zeros(0, np.uint32), 0, 0
            self._docs = self._epoch_docs()
        base, have_end = self.base, self.base + len(self.buf)
        pieces = [self.buf]
        if have_end <= pos:  # all buffered tokens are behind the window
            pieces, base = [], have_end
        while have_end < pos + n:
            ids = np.asarray(next(self._docs), dtype=np.uint32)
            if have_end + len(ids) <= pos:  # skipping forward (resume): never hold what is passed
                have_end += len(ids)
                pieces, base = [], have_end
                continue
            pieces.append(ids)
            have_end += len(ids)
        buf = np.concatenate(pieces) if len(pieces) != 1 else pieces[0]
        start = pos - base
        out[:n] = buf[start:start + n]
        self.buf, self.base = buf[start:], pos  # the next window starts at or after pos


def _groups(raw, max_docs: int = 64, max_chars: int = 1 << 20):
    """Texts of (text, where) pairs in small groups, for the batched filters (check_batch)."""
    group, size = [], 0
    for text, _ in raw:
        group.append(text)
        size += len(text)
        if len(group) >= max_docs or size >= max_chars:
            yield group
            group, size = [], 0
    if group:
        yield group


def stream_sizes(cfg: DataConfig) -> dict[str, float]:
    """Bytes of each source, which split a language's share among its sources in streaming mode (no
    token counts yet). An `hf` source counts the bytes of its local data_files, else the size its
    dataset card states; one of unknown size (a hub stream without that information) gets the mean size
    of its language's other sources, so that it is not starved by a tiny placeholder."""
    sizes: dict[str, float | None] = {}
    for s in cfg.sources:
        if s.type == "hf":
            local = cfg.hf_local_bytes(s)  # 0 for empty local files: known, not unknown
            sizes[s.name] = float(local) if local is not None else _hf_card_bytes(s, cfg.hf_data_files(s))
        else:
            files, _ = cfg.files(s)
            sizes[s.name] = float(sum(f.stat().st_size for f in files))
    out = {}
    for s in cfg.sources:
        size = sizes[s.name]
        if size is None:
            known = [sizes[o.name] for o in cfg.sources if o.language == s.language and sizes[o.name]]
            size = sum(known) / len(known) if known else 1.0
            log.warning("source %r: size unknown before reading; it gets the mean share of the %s sources "
                        "(give every source a `weight` to set the mix yourself)", s.name, s.language)
        out[s.name] = float(size)
    return out


def _hf_card_bytes(src: SourceConfig, data_files: list[str] | None) -> float | None:
    # data_files go with the builder: without them a file-backed builder ("json", "parquet", ...) resolves
    # its files from the working directory, which it walks whole
    try:
        import datasets
        kwargs = {"data_files": data_files} if data_files else {}
        info = datasets.load_dataset_builder(src.dataset, src.subset, **kwargs).info
        split = (info.splits or {}).get(src.split)
        return float(split.num_bytes) if split is not None and split.num_bytes else None
    except Exception:  # no card, no network, or a builder that cannot say: size unknown
        return None


def input_files_key(cfg: DataConfig) -> dict[str, list]:
    """{source: [[path relative to the config's folder (or as matched), size in bytes], ...]} for the
    file-based sources; a moved data folder with relative globs keeps its key, a changed file does not."""
    out: dict[str, list] = {}
    for src in cfg.sources:
        if src.type == "hf":
            continue
        rows = []
        for f in cfg.files(src)[0]:
            try:
                rel = os.path.relpath(f, cfg.base_dir)
                size = f.stat().st_size
            except (OSError, ValueError):
                rel, size = str(f), None
            rows.append([rel, size])
        out[src.name] = rows
    return out


class StreamProvider:
    """WindowProvider over a data config, streamed (see module docstring)."""

    def __init__(self, cfg: DataConfig, seed: int, split: str = "train", label: str = "stream"):
        self.cfg = cfg
        check_inputs(cfg, label)  # a source matching no file: refused naming its patterns and the folder
        self.names = [s.name for s in cfg.sources]
        self.languages = [s.language for s in cfg.sources]
        sizes = stream_sizes(cfg)
        self.streams, self.dropped = [], []
        for s in cfg.sources:
            stream = _SourceStream(cfg, s, seed, split)
            try:
                stream.prime()
            except ValueError:
                if split == "train":
                    raise
                self.dropped.append(s.name)  # too few documents for a held-out share: no val data
                continue
            self.streams.append(stream)
        if not self.streams:
            raise ValueError(f"no source of {label} has {split} documents (val_fraction "
                             f"{cfg.val_fraction}); raise val_fraction or prepare the data")
        kept = [s for s in cfg.sources if s.name not in self.dropped]
        # the language mix holds among the sources that remain (a val split may lack some)
        w = source_weights(dataclasses.replace(cfg, sources=kept), sizes)
        self.weights = [w[s.name] for s in kept]
        self.names = [s.name for s in kept]
        self.languages = [s.language for s in kept]
        # the files as they are now (each source's relative paths and sizes, in the order read): a resume on
        # files added, removed or rewritten since would read other documents at the same positions, so it is
        # refused as other data (prepared shards are checked the same way, by their token counts)
        key = {"config": cfg.fingerprint(), "split": split, "weights": self.weights, "files": input_files_key(cfg)}
        capped = [s.name for s in cfg.sources if s.max_documents is not None and s.type != "hf"]
        if capped:  # which documents a capped source reads is part of what the stream is
            key["capped_sources"] = {"sources": capped, "select": "first in sorted file order"}
        self.fingerprint = digest(key)
        self.label = f"{label} [{split}, streaming]"

    @classmethod
    def from_config(cls, path: str | Path, seed: int, split: str = "train") -> "StreamProvider":
        return cls(load_data_config(path), seed, split, label=str(path))

    def window(self, source: int, index: int, seq_len: int, out: np.ndarray) -> None:
        self.streams[source].read(index * seq_len, seq_len + 1, out)

    def describe(self) -> str:
        w = normalise_weights(self.weights, self.names)
        return f"{self.label}: " + ", ".join(f"{n}({lang}) {share:.1%}"
                                             for n, lang, share in zip(self.names, self.languages, w))

"""Reading raw documents from a source: jsonl, parquet, text files, WikiExtractor <doc> files, gzip/zstd,
Hugging Face datasets streaming.

Malformed input never stops a run: a missing file, a binary file, a line that is not valid UTF-8 or
not valid JSON, an overlong line, a record without the text field are skipped, counted in
`Counts` under a named reason, and warned about with the file and line (the first few of each kind per
source, then a summary), while every good document around them is kept.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from .config import DataConfig, SourceConfig

log = logging.getLogger("linscale.data")
WARN_LIMIT = 5  # warnings per (source, reason); all are counted


@dataclass
class Counts:
    """What a reader skipped, by reason, for stats.json."""
    source: str
    skipped: Counter = field(default_factory=Counter)
    files: int = 0
    raw_documents: int = 0
    raw_chars: int = 0

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= WARN_LIMIT:
            log.warning("%s: skipped %s at %s%s", self.source, reason.replace("_", " "), where,
                        f" ({detail})" if detail else "")
            if self.skipped[reason] == WARN_LIMIT:
                log.warning("%s: further '%s' are counted, not shown", self.source, reason)


def open_binary(path: Path) -> BinaryIO:
    """Decompressing reader by suffix (.gz, .zst/.zstd), plain otherwise."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"),
                                                                            closefd=True))
    return open(path, "rb")


def _is_binary(head: bytes) -> bool:
    # text never holds NUL; a binary format shows many control bytes or bytes that are not UTF-8
    if not head:
        return False
    if b"\x00" in head:
        return True
    ctrl = sum(1 for b in head if b < 9 or 13 < b < 32)
    bad = head.decode("utf-8", errors="replace").count("\ufffd")
    return ctrl / len(head) > 0.05 or bad / len(head) > 0.1


def _lines(f: BinaryIO, limit: int, counts: Counts, where: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line without newline); lines over `limit` bytes and lines that are
    not UTF-8 are skipped and counted. Reads in blocks (much faster than readline); an overlong line is
    dropped as it streams past, never held whole."""
    lineno = 0
    tail = b""
    overlong = 0  # bytes of the overlong line being skipped, 0 when none
    block_size = min(1 << 18, limit + 1)  # small enough that a truncated archive loses little
    while True:
        block = f.read(block_size)
        if not block:
            break
        parts = block.split(b"\n")
        if overlong:
            overlong += len(parts[0])
            if len(parts) == 1:
                continue
            lineno += 1
            counts.skip("overlong_lines", f"{where}:{lineno}", f"{overlong} bytes > {limit}")
            overlong = 0
            parts = parts[1:]
        else:
            parts[0] = tail + parts[0]
        tail = parts.pop()
        for raw in parts:
            lineno += 1
            if len(raw) > limit:
                counts.skip("overlong_lines", f"{where}:{lineno}", f"{len(raw)} bytes > {limit}")
                continue
            try:
                yield lineno, raw.decode("utf-8").rstrip("\r")
            except UnicodeDecodeError as err:
                counts.skip("invalid_utf8_lines", f"{where}:{lineno}", str(err.reason))
        if len(tail) > limit:
            overlong, tail = len(tail), b""
    if overlong:
        counts.skip("overlong_lines", f"{where}:{lineno + 1}", f"{overlong} bytes > {limit}")
    elif tail:
        try:
            yield lineno + 1, tail.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as err:
            counts.skip("invalid_utf8_lines", f"{where}:{lineno + 1}", str(err.reason))


def _whole_file(f: BinaryIO, limit: int, counts: Counts, where: str) -> str | None:
    """A one-document file read at once (the fast path); None when it needs the line-by-line reader
    (invalid UTF-8 somewhere, or a file over the line limit), which then skips and counts the bad lines."""
    data = f.read(limit + 1)
    if len(data) > limit:  # large: the line reader streams it and skips any overlong line
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text


def _text_docs(lines: Iterator[tuple[int, str]], unit: str, where: str) -> Iterator[tuple[str, str]]:
    if unit == "line":
        for n, line in lines:
            yield line, f"{where}:{n}"
        return
    buf: list[str] = []
    start = 1
    for n, line in lines:
        if unit == "blank_line" and not line.strip():
            if buf:
                yield "\n".join(buf), f"{where}:{start}"
            buf = []
            continue
        if not buf:
            start = n
        buf.append(line)
    if buf:
        yield "\n".join(buf), f"{where}:{start}" if unit == "blank_line" else where


_DOC_OPEN = re.compile(r'^<doc\b[^>]*>\s*$')


def _wikiextractor_docs(lines: Iterator[tuple[int, str]], where: str, counts: Counts
                        ) -> Iterator[tuple[str, str]]:
    buf: list[str] | None = None
    start = 0
    for n, line in lines:
        if _DOC_OPEN.match(line):
            if buf is not None:
                counts.skip("unclosed_doc_tags", f"{where}:{start}")
                yield "\n".join(buf), f"{where}:{start}"
            buf, start = [], n
        elif line.strip() == "</doc>":
            if buf is None:
                counts.skip("stray_closing_tags", f"{where}:{n}")
            else:
                yield "\n".join(buf), f"{where}:{start}"
            buf = None
        elif buf is not None:
            buf.append(line)
    if buf:
        counts.skip("unclosed_doc_tags", f"{where}:{start}")
        yield "\n".join(buf), f"{where}:{start}"


def _jsonl_docs(lines: Iterator[tuple[int, str]], key: str, where: str, counts: Counts
                ) -> Iterator[tuple[str, str]]:
    for n, line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as err:
            counts.skip("bad_json_lines", f"{where}:{n}", str(err)[:80])
            continue
        text = rec.get(key) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            counts.skip("records_without_text", f"{where}:{n}", f"no string field {key!r}")
            continue
        yield text, f"{where}:{n}"


def _parquet_docs(path: Path, column: str, counts: Counts) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        counts.skip("files_without_column", str(path), f"no column {column!r}; has {pf.schema_arrow.names}")
        return
    row = 0
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
        for text in batch.column(0).to_pylist():
            row += 1
            if isinstance(text, str):
                yield text, f"{path}:row {row}"
            else:
                counts.skip("records_without_text", f"{path}:row {row}", "null or not a string")


def _hf_docs(cfg: DataConfig, src: SourceConfig, counts: Counts) -> Iterator[tuple[str, str]]:
    try:
        import datasets  # heavy; only for this source type
    except ImportError as err:
        raise RuntimeError(f"source {src.name!r} is type hf: install `datasets` "
                           f"(pip install -c constraints.txt datasets)") from err
    data_files = cfg.hf_data_files(src)
    kwargs = {"data_files": data_files} if data_files else {}
    try:
        ds = datasets.load_dataset(src.dataset, src.subset, split=src.split, streaming=True, **kwargs)
        records = iter(ds)
        first = next(records, None)
    except StopIteration:
        # datasets' file builders raise a bare StopIteration for files without any record (inside a
        # generator it would surface as "RuntimeError: generator raised StopIteration")
        counts.skip("empty_datasets", f"hf:{src.dataset}", f"no records in {data_files or src.dataset}")
        return
    except FileNotFoundError as err:
        raise FileNotFoundError(f"source {src.name!r} (type hf): {err}; relative data_files are resolved "
                                f"against the config file's folder {cfg.base_dir}") from err
    if first is None:
        counts.skip("empty_datasets", f"hf:{src.dataset}", f"no records in {data_files or src.dataset}")
        return
    for i, rec in enumerate(_chain_first(first, records)):
        text = rec.get(src.field)
        if isinstance(text, str):
            yield text, f"hf:{src.dataset}#{i}"
        else:
            counts.skip("records_without_text", f"hf:{src.dataset}#{i}", f"no string field {src.field!r}")


def _chain_first(first, rest):
    yield first
    yield from rest


def iter_file(src: SourceConfig, path: Path, counts: Counts, max_line_bytes: int
              ) -> Iterator[tuple[str, str]]:
    """(text, where) of every raw document in one file."""
    where = str(path)
    if src.type == "parquet":
        try:
            yield from _parquet_docs(path, src.column, counts)
        except Exception as err:  # pyarrow raises several types for a corrupt file
            counts.skip("unreadable_files", where, f"{type(err).__name__}: {err}"[:160])
        return
    try:
        with open_binary(path) as f:
            head = f.peek(8192)[:8192] if hasattr(f, "peek") else b""
            if _is_binary(head):
                counts.skip("binary_files", where)
                return
            if src.type == "text" and src.text_unit == "file":
                doc = _whole_file(f, max_line_bytes, counts, where)
                if doc is not None:
                    yield doc, where
                    return
                f.seek(0)
            lines = _lines(f, max_line_bytes, counts, where)
            if src.type == "jsonl":
                yield from _jsonl_docs(lines, src.field, where, counts)
            elif src.type == "wikiextractor":
                yield from _wikiextractor_docs(lines, where, counts)
            else:
                yield from _text_docs(lines, src.text_unit, where)
    except (OSError, EOFError, ValueError) as err:  # truncated gzip, corrupt zstd, unreadable
        counts.skip("unreadable_files", where, f"{type(err).__name__}: {err}"[:160])


def iter_source(cfg: DataConfig, src: SourceConfig, counts: Counts, files: list[Path] | None = None
                ) -> Iterator[tuple[str, str]]:
    """(text, where) of every raw document of a source, files in the given (default: sorted) order."""
    limit = src.max_documents
    start = counts.raw_documents  # the limit is per call: streaming reads a source once an epoch
    if src.type == "hf":
        gen = _hf_docs(cfg, src, counts)
    else:
        if files is None:
            files, missing = cfg.files(src)
            for m in missing:
                counts.skip("missing_files", m, "no file matches")
        gen = _iter_files(cfg, src, files, counts)
    for text, where in gen:
        if limit is not None and counts.raw_documents - start >= limit:
            return
        counts.raw_documents += 1
        counts.raw_chars += len(text)
        yield text, where


def _iter_files(cfg: DataConfig, src: SourceConfig, files: list[Path], counts: Counts):
    for path in files:
        if not path.is_file():
            counts.skip("missing_files", str(path), "no such file")
            continue
        counts.files += 1
        yield from iter_file(src, path, counts, cfg.filters.max_line_bytes)

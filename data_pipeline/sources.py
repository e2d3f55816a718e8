r"""Reading raw documents from a source: jsonl, parquet, text files, WikiExtractor <doc> files, compressed
with gzip, zstd, bzip2 or xz (by suffix), Hugging Face datasets streaming.

Malformed input never stops a run: a missing file, a binary file, a line that is not valid UTF-8 or
not valid JSON, a JSON string with a lone surrogate escape, an overlong line, a record without the text
field are skipped, counted in `Counts` under a named reason, and warned about with the file and line
(the first few of each kind per source, then a summary), while every good document around them is kept.
A compressed file that is truncated or corrupt keeps every record decompressed before the damage and is
counted once under `damaged_files`. Encoding is decided line by line (one line in another encoding is
skipped, not the file; a file whose skipped lines read as GBK, Big5 or Windows-1252 and whose other lines
are ASCII gets one warning naming the encoding and the iconv command); a UTF-8 byte-order mark is dropped.
A line ends at \n, \r\n or a bare \r, as Python's universal newlines read it (\r\r\n: two line ends). A
blank line is no document, and a file that gives none (empty, blank lines only) is counted as `empty_files`.
"""
from __future__ import annotations

import bz2
import contextlib
import io
import itertools
import json
import lzma
import logging
import os
import re
import zlib
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
    quiet: bool = False  # count without warning (a read whose warnings another read of the same files gives)
    notes: Counter = field(default_factory=Counter)  # hints about whole files shown, by kind (not in stats)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= WARN_LIMIT and not self.quiet:
            log.warning("%s: skipped %s at %s%s", self.source, reason.replace("_", " "), where,
                        f" ({detail})" if detail else "")
            if self.skipped[reason] == WARN_LIMIT:
                log.warning("%s: further '%s' are counted, not shown", self.source, reason)

    def note(self, kind: str, where: str, detail: str) -> None:
        """A hint about a whole file (what its skipped lines have in common, and the fix): warned about for
        the first few files of each kind per source; the lines themselves are counted under their reason."""
        self.notes[kind] += 1
        if self.notes[kind] <= WARN_LIMIT and not self.quiet:
            log.warning("%s: %s: %s", self.source, where, detail)
            if self.notes[kind] == WARN_LIMIT:
                log.warning("%s: further files with this hint (%s) are not shown", self.source, kind.replace("_", " "))


COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz"}
BOM = b"\xef\xbb\xbf"


def _decompressor(kind: str):
    if kind == "gzip":
        return zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
    if kind == "zstd":
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj()
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    return lzma.LZMADecompressor()


def _decompress_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [zlib.error, OSError, EOFError, ValueError, lzma.LZMAError]
    try:
        import zstandard
        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard is a dependency
        pass
    return tuple(errors)


class TolerantDecompressor(io.RawIOBase):
    """A decompressing reader that never raises on damaged input: it returns every byte it could
    decompress, then ends, and sets `damage` to what went wrong ('truncated' or 'corrupt (...)').
    Concatenated members/frames/streams are read one after the other; zero padding after the last is
    ignored (as gzip's own reader does). The input is fed in chunks of CHUNK bytes; a decompressor that
    fails inside one returns nothing of that call, so the member is then decompressed again from its
    start in pieces of SALVAGE bytes, up to the corrupt spot: only what follows the damage is lost (for
    zstd, with the rest of its block)."""

    CHUNK = 1 << 16
    SALVAGE = 256

    def __init__(self, path: Path, kind: str) -> None:
        self._file = open(path, "rb")
        self.kind = kind
        self._d = _decompressor(kind)
        self._fed = False
        self._out = b""
        self._done = False
        self.damage: str | None = None
        self._member_start = 0  # file offset where the current member / frame / stream begins
        self._member_out = 0  # bytes it has given so far

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out and not self._done:
            self._fill()
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _fill(self) -> None:
        chunk = self._file.read(self.CHUNK)
        if not chunk:
            if self._fed and not self._d.eof:
                self.damage = "truncated"
                if self.kind == "gzip":  # what deflate still holds of the last, cut-off block
                    try:
                        self._out += self._d.flush()
                    except zlib.error:
                        pass
            self._done = True
            return
        end = self._file.tell()
        out = []
        try:
            while chunk:
                if self._d.eof:  # a new member / frame / stream follows
                    if not chunk.strip(b"\0"):
                        break  # zero padding
                    self._d, self._fed = _decompressor(self.kind), False
                    self._member_start, self._member_out = end - len(chunk), 0
                self._fed = True
                out.append(self._d.decompress(chunk))
                self._member_out += len(out[-1])
                chunk = self._d.unused_data if self._d.eof else b""
        except _decompress_errors() as err:
            self.damage = f"corrupt ({type(err).__name__}: {' '.join(str(err).split())[:120]})"
            self._done = True
            out.append(self._salvage())
        self._out += b"".join(out)

    def _salvage(self) -> bytes:
        """What the current member gives before its corrupt spot beyond what it has given already,
        decompressed again from the member's start in small pieces."""
        d = _decompressor(self.kind)
        self._file.seek(self._member_start)
        got, extra = 0, []
        while not d.eof:
            piece = self._file.read(self.SALVAGE)
            if not piece:
                break
            try:
                o = d.decompress(piece)
            except _decompress_errors():
                break
            if got + len(o) > self._member_out:
                extra.append(o[max(0, self._member_out - got):])
            got += len(o)
        return b"".join(extra)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_binary(path: Path) -> BinaryIO:
    """Reader by suffix: decompressing (.gz, .zst/.zstd, .bz2, .xz; damage-tolerant, see
    TolerantDecompressor), plain otherwise. Both have `peek`."""
    kind = COMPRESSION.get(Path(path).suffix.lower())
    if kind is None:
        return open(path, "rb")
    return io.BufferedReader(TolerantDecompressor(Path(path), kind), buffer_size=1 << 18)


def damage_of(f: BinaryIO) -> str | None:
    """What went wrong decompressing `f` (None: nothing, or not compressed)."""
    return getattr(getattr(f, "raw", None), "damage", None)


def _is_binary(head: bytes) -> bool:
    """Text never holds NUL and hardly any other control bytes. Bytes that are not UTF-8 make a file binary
    only when no line of its head is UTF-8: a file with some good lines is read line by line, each line
    decided on its own (one line in another encoding is skipped, the rest kept)."""
    if not head:
        return False
    if b"\x00" in head:
        return True
    ctrl = sum(1 for b in head if b < 9 or 13 < b < 32)
    if ctrl / len(head) > 0.05:
        return True
    lines = [ln for ln in (head.split(b"\n")[:-1] or [head]) if ln.strip()]
    for ln in lines:
        try:
            ln.decode("utf-8")
            return False
        except UnicodeDecodeError:
            continue
    bad = head.decode("utf-8", errors="replace").count("\ufffd")
    return bad / len(head) > 0.1


# magic numbers of compressed files, for a file read as plain because its name lacks the suffix
_MAGIC = {b"\x1f\x8b": ".gz", b"\x28\xb5\x2f\xfd": ".zst", b"BZh": ".bz2", b"\xfd7zXZ\x00": ".xz"}


def _binary_detail(head: bytes) -> str:
    """What a file the reader calls binary most likely is, and the fix, for the warning."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or (
            len(head) >= 64 and max(head[0::2].count(0), head[1::2].count(0)) > 0.4 * len(head)):
        return "UTF-16/32 text, it seems: the sources read UTF-8; convert it (iconv -f UTF-16 -t utf-8)"
    for magic, suffix in _MAGIC.items():
        if head.startswith(magic):
            return f"compressed data without the {suffix} suffix that makes the reader decompress it: rename the file"
    legacy = _legacy_encoding(head)
    if legacy is not None:
        codec, label = legacy
        return (f"text in another encoding than UTF-8, {label} it seems: the sources read UTF-8; convert it "
                f"(iconv -f {codec} -t utf-8)")
    if not _control_heavy(head):
        return ("text in an encoding other than UTF-8 that is not GBK, Big5 or Windows-1252: the sources read "
                "UTF-8; find its encoding (file -i, uchardet) and convert it (iconv -f ENCODING -t utf-8)")
    return "NUL or control bytes: not a text file"


# the most frequent Han characters, simplified and traditional: legacy Chinese text decoded with its own
# codec is full of them, decoded with the other codec (or a byte soup decoded at all) hardly holds any
_COMMON_HAN = {"GB18030": "的一是不了在人有我他这个们中来上大为和国地到以说时要就出会也你对",
               "BIG5": "的一是不了在人有我他這個們中來上大為和國地到以說時要就出會也你對"}
_HIGH_RUN = re.compile(rb"[\x80-\xff]+")


def _control_heavy(data: bytes) -> bool:
    return b"\x00" in data or sum(1 for b in data if b < 9 or 13 < b < 32) > 0.05 * len(data)


def _looks_cp1252(data: bytes) -> bool:
    """Whether bytes that are not UTF-8 read as Western text in Windows-1252 (a superset of Latin-1's
    printable range): they decode (cp1252 leaves 0x81, 0x8D, 0x8F, 0x90, 0x9D undefined) and their non-ASCII
    bytes stand mostly alone between ASCII ones — curly quotes, dashes, an accented letter inside a word —
    where the multi-byte encodings (GBK, Big5, Shift-JIS) and the single-byte encodings of other alphabets
    (Cyrillic, Greek) put them in runs: a whole word or phrase."""
    runs = _HIGH_RUN.findall(data)
    if not runs:
        return False
    try:
        data.decode("cp1252")
    except UnicodeDecodeError:
        return False
    return sum(map(len, runs)) <= 1.5 * len(runs)


def _legacy_encoding(head: bytes) -> tuple[str, str] | None:
    """(iconv name, description) of the legacy encoding bytes that are not UTF-8 (and hold no NUL and
    hardly any control bytes) read as: Chinese GB18030/GBK or Big5 when that decoding is full of common Han
    characters, Windows-1252 when they read as Western text in it (_looks_cp1252). None otherwise."""
    if _control_heavy(head):
        return None
    best, best_share = None, 0.0
    for codec, common in _COMMON_HAN.items():
        for cut in range(4):  # the head may end inside a character
            try:
                text = head[:len(head) - cut].decode(codec.lower())
            except UnicodeDecodeError:
                continue
            han = sum(1 for c in text if "\u4e00" <= c <= "\u9fff")
            share = sum(text.count(c) for c in common) / han if han >= 20 else 0.0
            if share > best_share:
                best, best_share = codec, share
            break
    if best is not None and best_share > 0.05:  # ~20% in real text; garbage readings stay under 2%
        return best, "Chinese GB18030/GBK" if best == "GB18030" else "Chinese Big5"
    if _looks_cp1252(head):
        return "cp1252", "Windows-1252 (cp1252, a superset of Latin-1: curly quotes, dashes, accented letters)"
    return None


def _lines(f: BinaryIO, limit: int, counts: Counts, where: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line without its line end); lines over `limit` bytes and lines that
    are not UTF-8 are skipped and counted. A line ends at \\n; the one \\r before it is part of the line end
    (\\r\\n), any other \\r stays in the line (\\r\\r\\n is a bare \\r, then \\r\\n: two line ends, as Python's
    universal newlines read it; _split_bare_cr and clean() end lines there). Reads in blocks (much faster
    than readline); an overlong line is dropped as it streams past, never held whole. At the end of a file
    whose skipped non-UTF-8 lines read as one legacy encoding (and whose other lines are ASCII, so the whole
    file converts), one hint names the encoding and the iconv command (_BadLines.hint)."""
    lineno = 0
    held: list[bytes] = []  # the pieces of the line not ended yet, joined once it ends (a long line spans
    held_bytes = 0          # many blocks: adding each block to the bytes so far would copy it over and over)
    overlong = 0  # bytes of the overlong line being skipped, 0 when none
    bad = _BadLines()
    ascii_only = True  # every UTF-8 line so far is ASCII (else the file is UTF-8 with damaged lines: no hint)
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
        elif held:
            held.append(parts[0])
            held_bytes += len(parts[0])
            if len(parts) == 1:  # no line end in this block
                if held_bytes > limit:
                    overlong, held, held_bytes = held_bytes, [], 0
                continue
            parts[0] = b"".join(held)
        tail = parts.pop()
        held, held_bytes = ([tail], len(tail)) if tail else ([], 0)
        for raw in parts:
            lineno += 1
            if len(raw) > limit:
                counts.skip("overlong_lines", f"{where}:{lineno}", f"{len(raw)} bytes > {limit}")
                continue
            if raw[-1:] == b"\r":  # the \r of a \r\n line end (only one: see above)
                raw = raw[:-1]
            if raw[:3] == BOM:  # a byte-order mark (first line, or files concatenated): not text
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad.add(raw, err, counts, f"{where}:{lineno}")
                continue
            if ascii_only and not raw.isascii():
                ascii_only = False
            yield lineno, line
        if held_bytes > limit:
            overlong, held, held_bytes = held_bytes, [], 0
    tail = b"".join(held)
    if tail and damage_of(f) is not None:
        tail = b""  # the record cut off where a compressed stream is damaged: counted with the damaged file
    if overlong:
        counts.skip("overlong_lines", f"{where}:{lineno + 1}", f"{overlong} bytes > {limit}")
    elif tail:
        if tail[-1:] == b"\r":
            tail = tail[:-1]
        if tail[:3] == BOM:
            tail = tail[3:]
        try:
            line = tail.decode("utf-8")
        except UnicodeDecodeError as err:
            bad.add(tail, err, counts, f"{where}:{lineno + 1}")
        else:
            ascii_only = ascii_only and tail.isascii()
            yield lineno + 1, line
    if bad.count and ascii_only:
        bad.hint(counts, where)


class _BadLines:
    """A file's lines that are not UTF-8: counted (skipped) one by one, and a sample of their bytes kept for
    the hint about the whole file, given when its other lines are ASCII (else the file is UTF-8 with damaged
    lines, or mixes encodings, and converting it whole would garble its good lines)."""

    SAMPLE = 8192

    def __init__(self) -> None:
        self.count = 0
        self.sample: list[bytes] = []
        self.sample_bytes = 0

    def add(self, raw: bytes, err: UnicodeDecodeError, counts: Counts, where: str) -> None:
        counts.skip("invalid_utf8_lines", where, str(err.reason))
        self.count += 1
        if self.sample_bytes < self.SAMPLE:
            self.sample.append(raw[:self.SAMPLE - self.sample_bytes])
            self.sample_bytes += len(self.sample[-1]) + 1

    def hint(self, counts: Counts, where: str) -> None:
        legacy = _legacy_encoding(b"\n".join(self.sample))
        if legacy is None:
            return
        codec, label = legacy
        counts.note("legacy_encoding", where,
                    f"{self.count} line(s) not UTF-8, skipped; they read as {label}, it seems, and the file's other "
                    f"lines are ASCII: the sources read UTF-8, so convert the file (iconv -f {codec} -t utf-8) "
                    f"to keep those lines")


class _Prefixed:
    """`data` followed by the rest of `f`: the line reader over bytes the fast path already read."""

    def __init__(self, data: bytes, f: BinaryIO) -> None:
        self._data, self._f = data, f
        self.raw = getattr(f, "raw", None)  # for damage_of

    def read(self, n: int) -> bytes:
        if self._data:
            out, self._data = self._data[:n], self._data[n:]
            return out
        return self._f.read(n)


def _whole_file(f: BinaryIO, limit: int) -> tuple[str | None, bytes]:
    """A one-document file read at once (the fast path): (text, b"") , or (None, the bytes read) when it
    needs the line-by-line reader (invalid UTF-8 somewhere, or a file over the line limit), which then
    skips and counts the bad lines."""
    data = f.read(limit + 1)
    if len(data) > limit:  # large: the line reader streams it and skips any overlong line
        return None, data
    try:
        text = data[len(BOM):].decode("utf-8") if data.startswith(BOM) else data.decode("utf-8")
    except UnicodeDecodeError:
        return None, data
    return text, b""


def _text_docs(lines: Iterator[tuple[int, str]], unit: str, where: str, counts: Counts | None = None,
               max_chars: int | None = None) -> Iterator[tuple[str, str]]:
    """Documents of a text file: each line, each blank-line block, or the whole file. A blank line (nothing
    but whitespace) is no document: with text_unit `line` it is passed over, not counted (with `blank_line`
    it separates documents), and a file of nothing but whitespace holds none. A block or file growing past
    `max_chars` characters is no longer held: the rest of it streams past and it is skipped as
    `overlong_documents` (a whole corpus in one file read with text_unit `file` would otherwise be held
    whole, tens of times its size in memory, to be removed by `too_long`)."""
    lines = _split_bare_cr(lines)
    if unit == "line":
        for n, line in lines:
            if line.strip():
                yield line, f"{where}:{n}"
        return
    buf = _Capped(max_chars)
    start = 1
    for n, line in lines:
        if unit == "blank_line" and not line.strip():
            if buf:
                yield from buf.take(counts, f"{where}:{start}", unit)
            continue
        if not buf:
            start = n
        buf.append(line)
    if buf:
        for text, at in buf.take(counts, f"{where}:{start}" if unit == "blank_line" else where, unit):
            if text.strip():  # (a file of blank lines: no document)
                yield text, at


def _split_bare_cr(lines: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Lines ended by a bare carriage return (classic Mac OS files, or pieces of them pasted into others;
    the first \\r of \\r\\r\\n) as lines of their own, as Python's universal newlines read them; each keeps
    the number of the newline-ended line it was found in."""
    for n, line in lines:
        if "\r" in line:
            for piece in line.split("\r"):
                yield n, piece
        else:
            yield n, line


class _Capped:
    """The lines of one document being read, held only while they total at most `limit` characters;
    past that only their count is kept and take() skips the document as `overlong_documents`."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.lines: list[str] = []
        self.chars = 0  # characters of the document so far (lines joined by newlines)
        self.started = False

    def __bool__(self) -> bool:
        return self.started

    def append(self, line: str) -> None:
        self.chars += len(line) + self.started
        self.started = True
        if self.limit is not None and self.chars > self.limit:
            self.lines = []  # over the limit: nothing more is held
        else:
            self.lines.append(line)

    def take(self, counts: Counts | None, where: str, unit: str) -> Iterator[tuple[str, str]]:
        """The document (nothing if it went over the limit, counted), and a fresh start."""
        chars, over = self.chars, self.limit is not None and self.chars > self.limit
        text = "\n".join(self.lines)
        self.lines, self.chars, self.started = [], 0, False
        if not over:
            yield text, where
        elif counts is not None:
            counts.skip("overlong_documents", where, _overlong_detail(chars, self.limit, unit))


def _overlong_detail(chars: int, limit: int, unit: str) -> str:
    hint = {"file": "if the file holds many documents, set text_unit: blank_line or line for its source",
            "blank_line": "if it holds many documents, set text_unit: line for its source",
            "wikiextractor": "a <doc> block never closed, or far longer than any article"}.get(unit, "")
    return f"{chars} characters, more than {limit} (twice filters.max_chars)" + (f"; {hint}" if hint else "")


_DOC_OPEN = re.compile(r'^<doc\b[^>]*>\s*$')
_SURROGATE = re.compile("[\ud800-\udfff]")


def _wikiextractor_docs(lines: Iterator[tuple[int, str]], where: str, counts: Counts,
                        max_chars: int | None = None) -> Iterator[tuple[str, str]]:
    buf: _Capped | None = None  # the open <doc> block (see _Capped for max_chars)
    start = 0
    for n, line in _split_bare_cr(lines):
        if line.startswith("<doc") and _DOC_OPEN.match(line):  # the cheap test first
            if buf is not None:
                counts.skip("unclosed_doc_tags", f"{where}:{start}")
                yield from _doc_block(buf, counts, f"{where}:{start}")
            buf, start = _Capped(max_chars), n
        elif line.strip() == "</doc>":
            if buf is None:
                counts.skip("stray_closing_tags", f"{where}:{n}")
            else:
                yield from _doc_block(buf, counts, f"{where}:{start}")
            buf = None
        elif buf is not None:
            buf.append(line)
    if buf:
        counts.skip("unclosed_doc_tags", f"{where}:{start}")
        yield from _doc_block(buf, counts, f"{where}:{start}")


def _doc_block(buf: _Capped, counts: Counts, where: str) -> Iterator[tuple[str, str]]:
    """A <doc> block's text; an empty block (no line inside) is an empty document (too_short removes it)."""
    if not buf:
        yield "", where
    else:
        yield from buf.take(counts, where, "wikiextractor")


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
        # JSON can escape half of a surrogate pair ("\ud800"): a string no UTF encoding can hold
        if "\\u" in line and _SURROGATE.search(text):
            counts.skip("invalid_unicode_records", f"{where}:{n}", "lone surrogate escape in the text")
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
            if isinstance(text, bytes):
                # text stored as plain binary, without the UTF-8 annotation (Hive, Impala and older Spark
                # write strings so): decoded like a text file's line
                try:
                    text = (text[len(BOM):] if text.startswith(BOM) else text).decode("utf-8")
                except UnicodeDecodeError as err:
                    counts.skip("invalid_utf8_lines", f"{path}:row {row}", f"binary value: {err.reason}")
                    continue
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


def iter_file(src: SourceConfig, path: Path, counts: Counts, max_line_bytes: int,
              max_doc_chars: int | None = None) -> Iterator[tuple[str, str]]:
    """(text, where) of every raw document in one file. A document of several lines (text blocks and
    files, WikiExtractor blocks) over `max_doc_chars` characters is skipped as `overlong_documents`
    without being held whole (callers pass twice filters.max_chars: `too_long` would remove it anyway).
    A file read to its end that gave no document and nothing skipped (no bytes, only blank lines, no
    <doc> block, a parquet file without rows) is counted as `empty_files`."""
    where = str(path)
    skipped_before = sum(counts.skipped.values())
    if src.type == "parquet":
        rows = 0
        try:
            for item in _parquet_docs(path, src.column, counts):
                rows += 1
                yield item
        except Exception as err:  # pyarrow raises several types for a corrupt file
            counts.skip("unreadable_files", where, f"{type(err).__name__}: {err}"[:160])
            return
        if rows == 0 and sum(counts.skipped.values()) == skipped_before:
            counts.skip("empty_files", where, "no rows")
        return
    kept = 0
    try:
        with open_binary(path) as f:
            head = f.peek(8192)[:8192]
            if _is_binary(head):
                counts.skip("binary_files", where, _binary_detail(head))
                return
            docs: Iterator[tuple[str, str]]
            if src.type == "text" and src.text_unit == "file":
                doc, seen = _whole_file(f, max_line_bytes)
                if doc is not None and damage_of(f) is None:
                    docs = iter([(doc, where)] if doc.strip() else [])  # only whitespace: no document
                    if max_doc_chars is not None and len(doc) > max_doc_chars:  # as the line reader does
                        docs = iter(())
                        counts.skip("overlong_documents", where, _overlong_detail(len(doc), max_doc_chars, "file"))
                else:  # invalid UTF-8, too long, or damaged: line by line, what can be read
                    docs = _text_docs(_lines(_Prefixed(seen, f), max_line_bytes, counts, where), "file", where,
                                      counts, max_doc_chars)
            else:
                lines = _lines(f, max_line_bytes, counts, where)
                if src.type == "jsonl":
                    docs = _jsonl_docs(lines, src.field, where, counts)
                elif src.type == "wikiextractor":
                    docs = _wikiextractor_docs(lines, where, counts, max_doc_chars)
                else:
                    docs = _text_docs(lines, src.text_unit, where, counts, max_doc_chars)
            for item in docs:
                kept += 1
                yield item
            damage = damage_of(f)
            if damage is not None:
                counts.skip("damaged_files", where, f"{COMPRESSION[path.suffix.lower()]} stream {damage}; the "
                                                    f"{kept} document(s) before the damage are kept")
            elif kept == 0 and sum(counts.skipped.values()) == skipped_before:
                counts.skip("empty_files", where, _empty_detail(src, head))
    except OSError as err:  # unreadable: permissions, I/O errors
        counts.skip("unreadable_files", where, f"{type(err).__name__}: {err} ({kept} document(s) read before)"[:200])


def _empty_detail(src: SourceConfig, head: bytes) -> str:
    """Why a file gave no document (for the empty_files warning)."""
    if not head:
        return "0 bytes"
    if src.type == "wikiextractor":
        return "no <doc ...> block in it: is it a WikiExtractor output file? (type text reads plain text)"
    return "nothing but whitespace and blank lines"


def max_doc_chars(cfg: DataConfig) -> int:
    """The reader's limit on one document (iter_file): twice filters.max_chars. Cleaning shortens real
    text (line ends, entities, invisible characters) by far less than half, so what the reader skips is
    what `too_long` would remove after cleaning."""
    return 2 * cfg.filters.max_chars


def check_inputs(cfg: DataConfig, where: str = "data config") -> None:
    """Refuse a data config in which a file-based source matches no file at all (every pattern empty): it
    would give an empty dataset, or silently drop that source from the mix. A pattern that matches
    nothing next to others that match is only counted (`missing_files`) and warned about."""
    empty = []
    for src in cfg.sources:
        if src.type == "hf":
            continue
        files, missing = cfg.files(src)
        if not files:
            empty.append(f"source {src.name!r} ({', '.join(m + _folder_hint(m) for m in missing)})")
    if empty:
        raise FileNotFoundError(f"{where}: no input file matches for {'; '.join(empty)}. Fix the paths or globs "
                                f"(relative ones are read from the config's folder, {cfg.base_dir}) or remove "
                                f"the source")


def no_match_detail(pattern: str) -> str:
    """Why a source pattern gives no file, for the `missing_files` warning."""
    return "no file matches" + _folder_hint(pattern)


def _folder_hint(pattern: str) -> str:
    # a folder given as a path matches no file: its files are given with a glob
    if Path(pattern).is_dir():
        return f": it is a folder; give its files with a glob, e.g. {Path(pattern) / '*.jsonl'} or {Path(pattern) / '**' / '*'}"
    return ""


# what prepare writes inside --out (one sample path of each kind, relative to it): a source pattern that
# could match any of them would read the dataset's own outputs back as input
_OUTPUT_SAMPLES = ("tokens/{s}/p00000-00000.tokens.bin", "tokens/{s}/p00000-00000.docs.npy",
                   "parts/part-00000/part.json", "parts/part-00000/docs.npy", "parts/part-00000/sigs.u32",
                   "parts/part-00000/exact.npy", "parts/part-00000/band-000.offsets.npy",
                   "merge/exact-0000.npy", "merge/pairs-000-0000.npy", "merge/near.npy",
                   "merge/source-0000.json", "merge/source-0000.json.tmp", "train/meta.json",
                   "train/{s}.index.npy", "val/meta.json", "val/{s}.index.npy.tmp", "stats.json")


def _glob_regex(pattern: str) -> re.Pattern:
    """The paths glob.glob(pattern, recursive=True) can match, as a regular expression: `**` as a whole
    path component is any number of folders, `*` and `?` stay inside one component, `[...]` a class."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i) and (i == 0 or pattern[i - 1] == "/"):
            out.append("(?:[^/]*/)*")
            i += 3
            continue
        if pattern.startswith("**", i) and (i == 0 or pattern[i - 1] == "/") and i + 2 == n:
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in pattern[i + 2:]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1:j]
            neg = body.startswith("!")
            body = body[neg:].replace("\\", "\\\\").replace("[", "\\[")  # `-` stays a range, as in glob
            out.append("[" + ("^" if neg else "") + ("\\" if body.startswith("^") else "") + body + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    try:
        return re.compile("".join(out) + r"\Z")
    except re.error:  # a class glob cannot match either (a reversed range, `[z-a]`): the pattern matches nothing
        return re.compile(r"(?!)")


def _spellings(pattern: str) -> set[str]:
    """The pattern made absolute and normalized, and with its folders before the first wildcard resolved
    as glob reads them (through symlinks, `..` after a symlink): --out may be given under either spelling."""
    parts = Path(pattern).parts
    k = next((i for i, c in enumerate(parts) if re.search(r"[*?[]", c)), len(parts))
    return {os.path.abspath(pattern), str(Path(*parts[:k]).resolve().joinpath(*parts[k:]))}


def check_out_is_not_input(cfg: DataConfig, out, where: str = "data config") -> None:
    """Refuse a data config whose source paths match (or could match, once written) files prepare writes
    into `out`: the tokens, part records, merge outputs and indexes would be read back as documents of a
    later source or part, and the merge would then find the inputs changed under it."""
    out = Path(out).expanduser()
    real = out.resolve()
    roots = {os.path.abspath(out), str(real)}
    names = [s.name for s in cfg.sources]
    hits = []
    for src in cfg.sources:
        if src.type == "hf":
            continue
        files, _ = cfg.files(src)
        inside = [f for f in map(Path.resolve, files)
                  if real in f.parents and f.relative_to(real).parts[0] in _OUTPUT_DIRS]
        for pattern in src.paths:
            p = Path(pattern).expanduser()
            rxs = [_glob_regex(sp) for sp in _spellings(str(p if p.is_absolute() else Path(cfg.base_dir) / p))]
            if any(rx.match(f"{r}/{sample.format(s=name)}") for rx in rxs for r in roots
                   for sample in _OUTPUT_SAMPLES for name in names):  # any source's token files and indexes
                hits.append(f"source {src.name!r} ({pattern!r})")
                break
        else:
            if inside:
                hits.append(f"source {src.name!r} ({inside[0]})")
    if hits:
        raise ValueError(f"{where}: the paths of {'; '.join(hits)} match files that prepare writes into --out "
                         f"{out} (tokens/, parts/, merge/, train/, val/): the dataset would read its own output "
                         f"as input; give an --out outside the inputs' globs, or narrow the globs (e.g. *.jsonl)")


_OUTPUT_DIRS = ("tokens", "parts", "merge", "train", "val", "stats.json")


def iter_source(cfg: DataConfig, src: SourceConfig, counts: Counts, files: list[Path] | None = None,
                limits: list[int] | None = None) -> Iterator[tuple[str, str]]:
    """(text, where) of every raw document of a source, files in the given (default: sorted) order;
    `limits`: how many documents to read of each of those files (capped_files), at most."""
    limit = src.max_documents
    start = counts.raw_documents  # the limit is per call: streaming reads a source once an epoch
    if src.type == "hf":
        gen = _hf_docs(cfg, src, counts)
    else:
        if files is None:
            files, missing = cfg.files(src)
            for m in missing:
                counts.skip("missing_files", m, no_match_detail(m))
        gen = _iter_files(cfg, src, files, counts, limits)
    for text, where in gen:
        if limit is not None and counts.raw_documents - start >= limit:
            return
        counts.raw_documents += 1
        counts.raw_chars += len(text)
        yield text, where


def _iter_files(cfg: DataConfig, src: SourceConfig, files: list[Path], counts: Counts,
                limits: list[int] | None = None):
    for i, path in enumerate(files):
        if not path.is_file():
            counts.skip("missing_files", str(path), "no such file")
            continue
        counts.files += 1
        docs = iter_file(src, path, counts, cfg.filters.max_line_bytes, max_doc_chars(cfg))
        if limits is None:
            yield from docs
        else:
            with contextlib.closing(docs):  # the file is closed as soon as its share is read
                yield from itertools.islice(docs, limits[i])


def capped_files(cfg: DataConfig, src: SourceConfig) -> list[tuple[Path, int]]:
    """The files that hold a file-based source's first `max_documents` raw documents in its sorted file
    order — the documents prepare reads of it — each with how many of its documents those are (all of them
    but in the last file). Streaming reads exactly these every epoch, in a new file order each time, so the
    capped set does not change from one epoch to the next. Costs one read of those files up to the cap
    (decompressing and splitting into documents; no cleaning, filtering or tokenizing), counted quietly:
    the epochs' reads warn about what they skip."""
    quiet = Counts(src.name, quiet=True)
    out: list[tuple[Path, int]] = []
    left = src.max_documents
    assert left is not None and src.type != "hf"
    for path in cfg.files(src)[0]:
        if left <= 0:
            break
        if not path.is_file():
            continue
        with contextlib.closing(iter_file(src, path, quiet, cfg.filters.max_line_bytes, max_doc_chars(cfg))) as docs:
            n = sum(1 for _ in itertools.islice(docs, left))
        if n:
            out.append((path, n))
            left -= n
    return out

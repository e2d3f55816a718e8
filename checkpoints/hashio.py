"""Write checkpoint files and checksum them in the same pass: every byte is hashed as it is written, so a
save costs one pass over the data instead of a write followed by a full read-back for the manifest.

Written with os.write on big slices (the GIL is released during the system call) and hashed with xxh3,
which releases the GIL for large inputs: the background writer thread then barely competes with the
training thread for the interpreter. After the fsync the file's pages are dropped from the page cache
(posix_fadvise DONTNEED): a 12.7 GB checkpoint would otherwise evict what training reads (the
memory-mapped data shards).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from checkpoints.manifest import DEFAULT_ALGO, new_hasher

WRITE_SLICE = 256 << 20  # bytes per os.write / hash update: long GIL-free sections, bounded memory views


@dataclass(frozen=True)
class FileRecord:
    """What the manifest needs about a file, known once it is written."""
    size: int
    checksum: str | None
    algo: str

    def to_json(self) -> list:
        return [self.size, self.checksum, self.algo]

    @staticmethod
    def from_json(row: list) -> "FileRecord":
        return FileRecord(int(row[0]), row[1], str(row[2]))


class HashingFile:
    """A write-only binary file that hashes its bytes as they go out (a file object for torch.save)."""

    def __init__(self, path: Path, algo: str = DEFAULT_ALGO) -> None:
        self.path = Path(path)
        self.algo = algo
        self._hash = new_hasher(algo)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        for a in range(0, n, WRITE_SLICE):
            part = view[a:a + WRITE_SLICE]
            if self._hash is not None:
                self._hash.update(part)
            while part.nbytes:
                part = part[os.write(self._fd, part):]
        self.size += n
        return n

    def flush(self) -> None:  # os.write is unbuffered; durability comes from close()
        pass

    def close(self, fsync: bool = True) -> FileRecord:
        """Flush to disk (the manifest must not promise bytes a power loss could still take) and return
        the file's record."""
        if self._fd is not None:
            if fsync:
                os.fsync(self._fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(self._fd)
            self._fd = None
        return FileRecord(self.size, None if self._hash is None else self._hash.hexdigest(), self.algo)

    def __enter__(self) -> "HashingFile":
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def _no_zip_crc() -> Iterator[None]:
    """torch.save's zip writer computes a CRC32 of every record, a second pass over the bytes that our
    checksum makes redundant; newer torch can turn it off (files stay loadable by torch.load)."""
    try:
        from torch.utils.serialization import config
        cfg = config.save
        old = cfg.compute_crc32
    except (ImportError, AttributeError):
        yield
        return
    cfg.compute_crc32 = False
    try:
        yield
    finally:
        cfg.compute_crc32 = old


def save_torch(obj, path: Path, algo: str = DEFAULT_ALGO) -> FileRecord:
    """torch.save(obj, path), hashing the bytes while writing them."""
    with HashingFile(path, algo) as f, _no_zip_crc():
        torch.save(obj, f)
        return f.close()


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None,
                     algo: str = DEFAULT_ALGO) -> FileRecord:
    """A safetensors file (8-byte little-endian header length, JSON header, the tensors' bytes back to
    back) written straight from host tensors and hashed on the way; safetensors.load_file reads it."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    items, offset = [], 0
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"save_safetensors: tensor {name} is on {t.device}; stage it to the host first")
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"save_safetensors: tensor {name} has unsupported dtype {t.dtype}")
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        items.append(t)
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as the reference writer does
    with HashingFile(path, algo) as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in items:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy())
        return f.close()


def write_records(path: Path, records: dict[str, FileRecord]) -> None:
    """A rank's `parts/rank_R.done` marker: the records of the files it wrote (relative paths)."""
    from checkpoints.atomic import atomic_write_text
    atomic_write_text(Path(path), json.dumps({k: r.to_json() for k, r in records.items()}))


def read_records(path: Path) -> dict[str, FileRecord]:
    text = Path(path).read_text()
    return {k: FileRecord.from_json(v) for k, v in json.loads(text).items()} if text.strip() else {}

"""The manifest: every file of a checkpoint or snapshot with its size and checksum, written last inside
the directory. A directory without a manifest, or whose files do not match it, is incomplete (a save cut
short) or corrupt (a truncated or damaged file) and is never loaded."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from checkpoints.atomic import atomic_write_text

from checkpoints.layout import MANIFEST  # noqa: F401  (also imported from here)
MANIFEST_VERSION = 1
_CHUNK = 1 << 26  # large reads: fewer GIL hand-offs with the training thread while hashing in the background

try:  # xxh3 hashes at memory speed; sha256 (hashlib, always there) where xxhash is not installed
    import xxhash
    DEFAULT_ALGO = "xxh3_128"
except ImportError:  # pragma: no cover - depends on the machine
    xxhash = None
    DEFAULT_ALGO = "sha256"


def new_hasher(algo: str):
    if algo == "xxh3_128":
        if xxhash is None:
            return None
        return xxhash.xxh3_128()
    return hashlib.new(algo)


def file_checksum(path: Path, algo: str = DEFAULT_ALGO, fsync: bool = False) -> str | None:
    """Checksum of a file's bytes (None when `algo` is not available here). With fsync the file is also
    flushed to disk: the manifest must not promise bytes that a power loss could still take away."""
    h = new_hasher(algo)
    with open(path, "rb") as f:
        if h is not None:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return None if h is None else h.hexdigest()


def list_files(root: Path) -> list[str]:
    """Relative paths of the regular files under `root` (the manifest itself excluded), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, fn), root)
            if rel != MANIFEST:
                out.append(rel)
    return out


def write_manifest(root: Path, info: dict | None = None, algo: str = DEFAULT_ALGO, known: dict | None = None) -> dict:
    """Checksum (and fsync) every file under `root`, then write manifest.json atomically. Call it only when
    every file is complete: the manifest's presence is what marks the directory as complete.

    `known` maps relative paths to the records (`hashio.FileRecord`) of files hashed while they were
    written (and fsynced then): those are not read again when their size and algorithm match."""
    root = Path(root)
    known = known or {}
    files = {}
    for rel in list_files(root):
        p = root / rel
        size = p.stat().st_size
        rec = known.get(rel)
        if rec is not None and rec.size == size and rec.algo == algo:
            checksum = rec.checksum
        else:  # written by someone else (DeepSpeed, small JSON files): one read pass
            checksum = file_checksum(p, algo, fsync=True)
        files[rel] = {"size": size, "checksum": checksum}
    manifest = {"version": MANIFEST_VERSION, "algo": algo, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "files": files, "info": info or {}}
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(root: Path) -> dict:
    return json.loads((Path(root) / MANIFEST).read_text())


def verify(root: Path, checksums: bool = True) -> str | None:
    """None if `root` is complete and intact, else a one-line reason (for the warning that names it).
    Sizes are always compared; checksums too unless `checksums` is False (a quick scan)."""
    root = Path(root)
    if not root.is_dir():
        return "not a directory"
    if not (root / MANIFEST).is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = read_manifest(root)
        files = manifest["files"]
        algo = manifest["algo"]
    except (ValueError, KeyError, OSError) as err:
        return f"unreadable {MANIFEST} ({err})"
    for rel, entry in files.items():
        p = root / rel
        if not p.is_file():
            return f"file {rel} is missing"
        size = p.stat().st_size
        if size != entry["size"]:
            return f"file {rel} has {size} bytes, the manifest says {entry['size']} (truncated or damaged)"
    if checksums:
        for rel, entry in files.items():
            got = file_checksum(root / rel, algo)
            if got is not None and entry["checksum"] is not None and got != entry["checksum"]:
                return f"file {rel} does not match its {algo} checksum (damaged)"
    return None

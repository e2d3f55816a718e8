"""Crash-safe file-system steps. A reader must never see half of anything: files are written under a
temporary name, flushed to disk (fsync), then renamed; the directory holding the rename is fsynced too,
or a power loss could undo the rename while keeping the old name."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: readers see the old content or the new, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written `tmp` directory to `final`. An existing `final` (a stale or corrupt copy of
    the same step) is moved aside first and deleted after, so a crash in between leaves either the old
    or the new directory under a name resume recognises, plus at most some trash."""
    trash = final.with_name(final.name + ".trash")
    if trash.exists():
        shutil.rmtree(trash)
    if final.exists():
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)

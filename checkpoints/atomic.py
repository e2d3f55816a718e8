"""Crash-safe file-system steps. A reader must never see half of anything: files are written under a
temporary name, flushed to disk (fsync), then renamed; the directory holding the rename is fsynced too,
or a power loss could undo the rename while keeping the old name."""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path

from checkpoints.layout import TRASH_SUFFIX


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_in_the_way(path: str | Path) -> Path | None:
    """The file (not a directory) at `path` or at one of its parents, which keeps `path` from being made a
    folder, a dangling link included; None when there is none."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if (p.exists() or p.is_symlink()) and not p.is_dir()), None)


def make_output_dir(path: str | Path, what: str) -> Path:
    """Create the output folder `path` (and its parents) for the input `what` (a flag, e.g. `--out eval`),
    or raise NotADirectoryError naming what is in the way: one line at the command line (pretrain.errors),
    not mkdir's FileExistsError traceback when `path` or a parent is a file."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = file_in_the_way(path) or path
        raise NotADirectoryError(f"{what}: cannot create the folder {path} ({blocker} is a file, not a directory); "
                                 f"pass a folder path, or move {blocker} away") from None
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one step: readers see the old content or the new, never a mix. The
    temporary file's name is unique (mkstemp), not only the process id's: ranks on several hosts that share
    the folder may have the same pid, and would write into one temporary file. Nothing is left behind on
    failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it (mkstemp's 0600 hides it from a shared group)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 RENAME_EXCHANGE). False where the kernel, the C
    library or the file system cannot (nothing is changed then)."""
    global _renameat2
    if _renameat2 is None:
        try:
            _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


_renameat2 = None


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written `tmp` directory to `final`. An existing `final` (an older copy of the same
    thing) is swapped with `tmp` in one step where the system can, so a reader finds `final` at every
    instant, then the old copy (now under the `tmp` name) is removed. Elsewhere the old one is moved aside
    first and deleted after: a crash in between leaves the old or the new directory under a name resume
    recognises, plus at most some trash."""
    tmp, final = Path(tmp), Path(final)
    if final.exists() and exchange(tmp, final):
        fsync_dir(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    trash = final.with_name(final.name + TRASH_SUFFIX)
    if trash.exists():
        shutil.rmtree(trash)
    if final.exists():
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)

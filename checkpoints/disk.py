"""Disk space around saves: how much a save needs and has, which file system a path lives on, and whether
a failed write was the disk filling up (the cause is often buried: torch.save reports a full disk as
`[enforce fail at inline_container.cc] . unexpected pos N vs M`, with the ENOSPC only in its context)."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# a save is refused up front when it would leave less than this much free (file system metadata, logs):
# 64 MB, or 1% of a smaller file system
HEADROOM_BYTES = 64 << 20
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _existing(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path`."""
    p = _existing(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def device_of(path: Path) -> str:
    """'MOUNT (SOURCE, FSTYPE)' for messages, e.g. '/scratch (/dev/nvme0n1p2, ext4)'; the mount point alone
    where /proc/self/mounts is not readable."""
    mnt = mount_point(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[1].replace("\\040", " ") == str(mnt):
                    return f"{mnt} ({parts[0]}, {parts[2]})"
    except OSError:
        pass
    return str(mnt)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def headroom(path: Path) -> int:
    """Space a save must leave free (see HEADROOM_BYTES)."""
    return min(HEADROOM_BYTES, shutil.disk_usage(_existing(path)).total // 100)


def disk_full_cause(err: BaseException | None) -> BaseException | None:
    """The exception in `err`'s chain (cause/context) that says the disk or quota is full, or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in FULL_ERRNOS:
            return err
        text = str(err)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return err
        err = err.__cause__ or err.__context__
    return None


def looks_like_short_write(err: BaseException | None) -> bool:
    """torch's zip writer's report of a write that came up short (a full disk when it writes a path itself)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if "unexpected pos" in str(err) or "PytorchStreamWriter failed writing" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 when it does not exist)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for fn in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                pass
    return total


def write_failure(path: Path, err: BaseException) -> str:
    """What went wrong writing `path`, for one error line: the device and its free space when the disk or
    quota is full, else the OS error."""
    if disk_full_cause(err) is not None:
        return f"no space left on {device_of(path)} ({human_bytes(free_bytes(path))} free)"
    return " ".join(str(err).split()) or type(err).__name__

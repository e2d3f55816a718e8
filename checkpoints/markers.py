"""How the ranks hand a save over to rank 0, through the file system (no collectives: the writer threads
must never start one next to the training thread's).

Inside `step_N.tmp/parts/`, each rank R, once every file it writes for this save is written, fsynced and
its directories fsynced, publishes `rank_R.done` (the records of its files: size and checksum):

    1. write the records to `.rank_R.done.tmp` and fsync it;
    2. fsync `parts/` (the temporary entry is on disk);
    3. rename it to `rank_R.done` -- rank R's LAST operation anywhere in `step_N.tmp/`.

Rank 0 waits until every rank's `.done` is there, reads them, and only then removes `parts/`, writes the
manifest and publishes. Because a rank never touches the checkpoint after its rename, rank 0 may remove
`parts/` (or the whole directory, when the save is abandoned) the moment it sees the marker: there is no
window in which a rank still works in a directory rank 0 has removed. (A rank that fsyncs `parts/`
after its rename can find it gone: `FileNotFoundError: .../parts` on that rank, the save lost.)

A rank whose writing fails publishes `rank_R.failed` (its reason) instead, so rank 0 stops waiting at
once; rank 0 also stops when the training thread tells it that the save is abandoned (`abort`).

`HOOK`, when set (tests only), is called as HOOK(point, rank) at each step of the protocol, to inject
delays where a race would show.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from checkpoints.atomic import fsync_dir
from checkpoints.hashio import FileRecord

TIMEOUT_S = 3600.0  # rank 0 waits this long for the other ranks' files before giving up on a save
HOOK: Callable[[str, int], None] | None = None


def point(name: str, rank: int) -> None:
    if HOOK is not None:
        HOOK(name, rank)


def done_name(rank: int) -> str:
    return f"rank_{rank:05d}.done"


def failed_name(rank: int) -> str:
    return f"rank_{rank:05d}.failed"


def publish_done(parts: Path, rank: int, records: dict[str, FileRecord]) -> None:
    """Steps 1-3 above: after this returns, the caller must not touch the checkpoint directory again."""
    parts = Path(parts)
    tmp = parts / f".{done_name(rank)}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({k: r.to_json() for k, r in records.items()}))
        f.flush()
        point("marker_written", rank)
        os.fsync(f.fileno())
    point("marker_fsynced", rank)
    fsync_dir(parts)
    point("parts_fsynced", rank)
    os.replace(tmp, parts / done_name(rank))
    point("marker_published", rank)


def publish_failed(parts: Path, rank: int, reason: str) -> None:
    """Best effort (the disk may be full): tell rank 0 not to wait for this rank."""
    try:
        (Path(parts) / failed_name(rank)).write_text(reason)
    except OSError:
        pass


class SaveAbandoned(RuntimeError):
    """Rank 0 stopped waiting: another rank failed, or the training thread abandoned the save."""


def wait_for_all(parts: Path, world: int, abort: threading.Event | None = None,
                 timeout_s: float | None = None) -> dict[str, FileRecord]:
    """Rank 0: block until every rank has published `.done`; return the union of their records. Raises
    SaveAbandoned when a rank published `.failed`, `abort` is set, or `timeout_s` passes."""
    parts = Path(parts)
    deadline = time.monotonic() + (TIMEOUT_S if timeout_s is None else timeout_s)
    while True:
        names = set(os.listdir(parts))
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            reason = (parts / failed[0]).read_text(errors="replace").strip()
            raise SaveAbandoned(f"rank {int(failed[0][5:10])} could not write its part: {reason}")
        done = [n for n in names if n.startswith("rank_") and n.endswith(".done")]
        if len(done) >= world:
            break
        if abort is not None and abort.is_set():
            raise SaveAbandoned(f"abandoned while waiting for {world - len(done)} of {world} ranks")
        if time.monotonic() > deadline:
            raise SaveAbandoned(f"only {len(done)} of {world} ranks finished writing within "
                                f"{TIMEOUT_S if timeout_s is None else timeout_s:.0f} s")
        time.sleep(0.005)
    point("markers_seen", 0)
    records: dict[str, FileRecord] = {}
    for r in range(world):
        text = (parts / done_name(r)).read_text()
        if text.strip():
            records.update({k: FileRecord.from_json(v) for k, v in json.loads(text).items()})
    return records

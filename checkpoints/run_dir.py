"""One run per run directory: an exclusive lock, the run's identity, and what a start may do with what an
earlier run left there.

- Lock. Rank 0 holds `RUN/.lock` with `flock` for the whole process (the kernel drops it when the process
  dies, so a crashed run never leaves a stale lock behind). The file also records pid, host, start time
  and command, which the refusal message shows. Where the file system has no flock (some network file
  systems), the file is created exclusively instead and a leftover one is taken over when its pid is gone
  on this host.
- Identity. `RUN/run.json` holds a run id, made at a fresh start; every checkpoint records it, so
  `--resume auto` only ever continues this run's own history. A resume where run.json is missing (lost,
  or the checkpoints copied to a new --out) takes the id its newest checkpoint records.
- A fresh start (no `--resume`) in a directory that already holds a run (checkpoints, snapshots, exports
  or logged metrics) is refused; `--overwrite` moves those files into `RUN/overwritten-<time>/` first.
- Unfinished saves (`*.tmp`, `*.trash`) are removed, under the lock, before anything else is written.
- A file where `checkpoints/` or `snapshots/` goes is refused at start, not at the first save after hours
  of training.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

from checkpoints.atomic import atomic_write_text, file_in_the_way
from checkpoints.disk import device_of, free_bytes, human_bytes
from checkpoints.errors import CheckpointError, RunDirectoryBusy
from checkpoints.layout import (CHECKPOINTS, DEEPSPEED_CONFIG, EVAL, EXPORTS, META, METRICS, RUN_CONFIG,
                                SNAPSHOTS, SUMMARY, TENSORBOARD, step_dirs, tmp_dirs)
from pretrain.logs import get_logger

LOCK_FILE = ".lock"
RUN_INFO = "run.json"
# what a run writes at the top of its directory, besides the folders above (moved aside by --overwrite), and
# the evaluations of its snapshots (launch/evaluate.py's default output), which belong to the earlier run too
RUN_FILES = (METRICS, SUMMARY, RUN_CONFIG, DEEPSPEED_CONFIG, TENSORBOARD, RUN_INFO, EVAL)
OVERWRITTEN_PREFIX = "overwritten-"


logger = get_logger(__name__)


# ---------------------------------------------------------------------------------------------------
# the lock
# ---------------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shortened(text: str, most: int) -> str:
    """`text`, cut to `most` characters with a visible mark where it was cut (a command cut silently reads as
    if its last flag had no value)."""
    return text if len(text) <= most else text[:most - 6] + " [...]"


def _holder_text(info: dict) -> str:
    if not info:
        return "a process that left no details"
    cmd = info.get("command")
    return (f"pid {info.get('pid')} on host {info.get('host')}, since {info.get('started')}"
            + (f", slurm job {info['slurm_job']}" if info.get("slurm_job") else "")
            + (f", command: {cmd}" if cmd else ""))


class RunLock:
    """Exclusive lock on a run directory (see the module docstring). `acquire()` raises RunDirectoryBusy
    naming the holder; `release()` is idempotent and also runs when the object is collected."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._pidfile = False  # fallback mode: the file's existence is the lock

    def _details(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": _shortened(" ".join(sys.argv), 300), "slurm_job": os.environ.get("SLURM_JOB_ID")}

    def holder(self) -> str:
        """Who holds (or last held) the lock, as its file records it: pid, host, start, Slurm job, command."""
        return _holder_text(self._read())

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "RunLock":
        import fcntl
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # said in user terms by the caller
                raise PermissionError(err.errno, err.strerror, str(self.path)) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise RunDirectoryBusy(
                    f"run directory {self.run_dir} is in use by another run ({_holder_text(self._read())}); "
                    f"two runs writing one directory would mix their checkpoints and logs. Wait for it to end "
                    f"or stop it, or pass another --out") from None
            os.close(fd)  # no flock on this file system: fall back to an exclusively created pid file
            return self._acquire_pidfile()
        previous = self._read()
        if previous and previous.get("pid") not in (None, os.getpid()):
            logger.info(f"{self.path}: lock of an earlier run ({_holder_text(previous)}) was left behind; that run "
                  f"is gone (its lock was released), taking over")
        self._fd = fd
        self._write(fd)
        return self

    def _write(self, fd: int) -> None:
        data = json.dumps(self._details()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def _acquire_pidfile(self) -> "RunLock":
        host = socket.gethostname()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._read()
                job = os.environ.get("SLURM_JOB_ID")
                dead_here = holder.get("host") == host and isinstance(holder.get("pid"), int) \
                    and not _pid_alive(holder["pid"])
                # Slurm requeues a job under its own id only after its processes ended: the lock is the old
                # incarnation's, left by a kill that gave it no chance to remove it
                requeued = job is not None and holder.get("slurm_job") == job
                if not holder:  # empty: released by a flock-mode run, or just created by our own open()
                    self.path.unlink(missing_ok=True)
                    continue
                if dead_here or requeued:
                    why = f"no longer running on {host}" if dead_here else f"an earlier incarnation of Slurm job {job}"
                    logger.info(f"{self.path}: stale lock of pid {holder.get('pid')} ({why}); removed")
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunDirectoryBusy(
                    f"run directory {self.run_dir} is locked by {_holder_text(holder)} (this file system has no "
                    f"flock, so the lock is the file {self.path}). If that run is no longer running, delete "
                    f"{self.path} and start again; otherwise pass another --out") from None
            self._write(fd)
            os.close(fd)
            self._pidfile = True
            return self
        raise RunDirectoryBusy(f"could not take the lock {self.path}; delete it if no run is using {self.run_dir}")

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # an empty lock file: nobody holds it
            except OSError:
                pass
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        if self._pidfile:
            self.path.unlink(missing_ok=True)
            self._pidfile = False

    @property
    def held(self) -> bool:
        return self._fd is not None or self._pidfile

    def __del__(self) -> None:  # a Trainer that was never fitted or closed still lets go
        try:
            self.release()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


# ---------------------------------------------------------------------------------------------------
# what an earlier run left, and the run's identity
# ---------------------------------------------------------------------------------------------------

def previous_run(run_dir: Path) -> list[str]:
    """What an earlier run left in `run_dir`, in words (empty: nothing)."""
    run_dir = Path(run_dir)
    found = []
    for sub, what in ((CHECKPOINTS, "checkpoint"), (SNAPSHOTS, "snapshot"), (EXPORTS, "export")):
        steps = step_dirs(run_dir / sub)
        if steps:
            found.append(f"{len(steps)} {what}{'s' if len(steps) > 1 else ''} (newest {steps[-1][1].name})")
    metrics = run_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        with open(metrics, "rb") as f:
            rows = sum(1 for _ in f)
        found.append(f"metrics.jsonl with {rows} rows")
    return found


def read_run_id(run_dir: Path) -> str | None:
    try:
        return json.loads((Path(run_dir) / RUN_INFO).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def checkpoint_run_id(path: Path) -> str | None:
    """The run id a checkpoint's (or snapshot's) meta.json records (None: unknown, e.g. written before run ids
    existed, or unreadable)."""
    try:
        return json.loads((Path(path) / META).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def recorded_run_id(run_dir: Path) -> tuple[str, Path] | None:
    """The run id the newest checkpoint (else snapshot) of `run_dir` records, with that directory; None when
    none records one."""
    for sub in (CHECKPOINTS, SNAPSHOTS):
        for _, path in reversed(step_dirs(Path(run_dir) / sub)):
            run_id = checkpoint_run_id(path)
            if isinstance(run_id, str) and run_id:
                return run_id, path
    return None


def write_run_id(run_dir: Path, run_id: str | None = None) -> str:
    run_id = run_id or uuid.uuid4().hex
    atomic_write_text(Path(run_dir) / RUN_INFO, json.dumps({"run_id": run_id, "created": time.strftime(
        "%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname()}, indent=1) + "\n")
    return run_id


def move_aside(run_dir: Path) -> Path | None:
    """--overwrite: move everything an earlier run wrote into RUN/overwritten-<time>/ (a rename: instant, and
    nothing is lost). Returns that folder, or None when there was nothing to move."""
    run_dir = Path(run_dir)
    names = [n for n in (CHECKPOINTS, SNAPSHOTS, EXPORTS, *RUN_FILES) if (run_dir / n).exists()]
    if not names:
        return None
    dest = run_dir / (OVERWRITTEN_PREFIX + time.strftime("%Y%m%d-%H%M%S"))
    k = 1
    while dest.exists():
        k += 1
        dest = run_dir / (OVERWRITTEN_PREFIX + time.strftime("%Y%m%d-%H%M%S") + f"-{k}")
    dest.mkdir()
    for n in names:
        os.replace(run_dir / n, dest / n)
    return dest


def remove_unfinished_saves(run_dir: Path) -> list[Path]:
    """`step_N.tmp` (a save cut short) and `.trash` (an interrupted replace) under checkpoints/ and
    snapshots/: never loadable, removed. Call only while holding the run's lock."""
    removed = []
    for d in (Path(run_dir) / CHECKPOINTS, Path(run_dir) / SNAPSHOTS):
        for tmp in tmp_dirs(d):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _probe_writable(run_dir: Path) -> None:
    probe = run_dir / f".write_probe.{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        if err.errno == errno.ENOSPC:
            raise CheckpointError(f"run directory {run_dir}: no space left on {device_of(run_dir)} "
                                  f"({human_bytes(free_bytes(run_dir))} free); free some space or pass --out on "
                                  f"another disk") from None
        raise PermissionError(f"run directory {run_dir} is not writable ({err.strerror}); pass --out to a "
                              f"directory you can write") from None


def _refuse_files_in_the_way(run_dir: Path) -> None:
    """A file (or a dangling link) where the run's checkpoints/ or snapshots/ folder goes: refused now, before
    the first step, rather than found by the first save, after the steps before it were trained."""
    for sub in (CHECKPOINTS, SNAPSHOTS):
        path = run_dir / sub
        if file_in_the_way(path) is not None:
            raise NotADirectoryError(f"run directory {run_dir}: {path} is a file, not a directory, and the run's "
                                     f"{sub} are written there; move it away or pass another --out")


def _is_within(path: Path, root: Path) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
        return True
    except ValueError:
        return False


def open_run_directory(run_dir: Path, resume: str | None, overwrite: bool, is_main: bool) -> RunLock | None:
    """Prepare `run_dir` for a run (see the module docstring): on rank 0 take the lock, remove unfinished
    saves, check it is writable, refuse a fresh start over an earlier run (or move it aside with
    `overwrite`), and make sure RUN/run.json names the run. Returns the held lock (None on other ranks)."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = file_in_the_way(run_dir)
        why = f"{blocker} is a file, not a directory" if blocker is not None else err.strerror
        raise PermissionError(f"run directory {run_dir} cannot be created ({why}); pass --out to a "
                              f"directory you can write") from None
    if not is_main:
        return None
    try:
        lock = RunLock(run_dir).acquire()
    except PermissionError as err:
        raise PermissionError(f"run directory {run_dir} is not writable ({err.strerror}); pass --out to a "
                              f"directory you can write") from None
    try:
        for tmp in remove_unfinished_saves(run_dir):
            logger.info(f"removed {tmp} (a save that never finished)")
        _probe_writable(run_dir)
        if not overwrite:  # (--overwrite moves it aside with the rest)
            _refuse_files_in_the_way(run_dir)
        earlier = previous_run(run_dir)
        inside = resume not in (None, "auto") and _is_within(Path(resume), run_dir)
        if overwrite and inside:
            raise CheckpointError(f"--overwrite would move {resume} (the checkpoint to resume from) aside with the "
                                  f"rest of {run_dir}; drop --overwrite to go back to that checkpoint in this run")
        if overwrite:
            moved = move_aside(run_dir)
            if moved is not None:
                logger.info(f"--overwrite: the earlier run's files ({'; '.join(earlier) or 'logs'}) were moved to {moved}; "
                      f"delete that folder when you no longer need it")
            write_run_id(run_dir)
        elif not resume or not (resume == "auto" or inside):
            if earlier:
                raise CheckpointError(
                    f"run directory {run_dir} already holds a run ({'; '.join(earlier)}). Pass --resume auto to "
                    f"continue it (or --resume with one of its own checkpoints), --overwrite to start afresh (its files are moved to "
                    f"{run_dir}/{OVERWRITTEN_PREFIX}<time>/), or another --out")
            write_run_id(run_dir)
        elif read_run_id(run_dir) is None:
            # a resume without run.json (lost, or checkpoints copied into a new --out): a fresh id would make
            # every checkpoint "another run's", and --resume auto would refuse them from then on
            recorded = recorded_run_id(run_dir)
            write_run_id(run_dir, recorded[0] if recorded else None)
            if recorded:
                logger.info(f"{run_dir / RUN_INFO} was missing; the run's id {recorded[0]} is taken from "
                            f"{recorded[1]}")
    except BaseException:
        lock.release()
        raise
    return lock

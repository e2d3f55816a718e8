"""How far a run directory got, for launch/slurm/pretrain.sbatch (before and after each attempt of a job):

    python launch/slurm/attempt_result.py RUN_DIR            ->   "<step> <stop> <stop_step>"
    python launch/slurm/attempt_result.py RUN_DIR SINCE      ->   "<step> <stop> <stop_step> <new>"
    python launch/slurm/attempt_result.py --newest RUN_DIR   ->   "<checkpoint>@<mtime_ns>" or "none"

<step>: the step of the newest complete checkpoint on disk (its manifest present and every file the size the
manifest says; checksums are not read, which for a large model would take minutes), -1 when there is none.
<stop>: the `stop` field of RUN_DIR/summary.json ("finished", "signal"), "-" when there is no summary
(the trainer did not reach its end). <stop_step>: the summary's `step`, the step that run ended at (-1
without a summary): a summary left by an earlier attempt names a step at or before that attempt's
checkpoints, so the script can tell this attempt's summary from a stale one.
<new>: 1 when the newest complete checkpoint was written after SINCE (what --newest printed when the attempt
started), else 0. Its step alone cannot tell: an attempt that resumed an earlier checkpoint of the run (the
later ones set aside) or started afresh with --overwrite saves steps below the newest one it started with.
--newest: which file the newest complete checkpoint is (its folder and its manifest's modification time), so
that the script can tell whether an attempt saved one since an earlier moment, even one of the same step
(a run that --overwrite set aside had its own step 4)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Only the file-layout modules of the checkpoints package are needed; its __init__ imports torch (seconds of
# start-up on every attempt). A bare package object lets `checkpoints.layout` / `.manifest` import alone.
if "checkpoints" not in sys.modules:
    _pkg = types.ModuleType("checkpoints")
    _pkg.__path__ = [str(ROOT / "checkpoints")]
    sys.modules["checkpoints"] = _pkg

from checkpoints.layout import CHECKPOINTS, SUMMARY, step_dirs  # noqa: E402
from checkpoints.manifest import MANIFEST, verify  # noqa: E402


def _newest_complete(run_dir: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest checkpoint that passes the quick (size-only) verification, or None."""
    for step, path in reversed(step_dirs(Path(run_dir) / CHECKPOINTS)):
        if verify(path, checksums=False) is None:
            return step, path
    return None


def newest_complete_step(run_dir: Path) -> int:
    """The step of the newest checkpoint that passes the quick (size-only) verification, or -1."""
    newest = _newest_complete(run_dir)
    return newest[0] if newest else -1


def newest_complete(run_dir: Path) -> str:
    """'<folder>@<manifest mtime_ns>' of the newest checkpoint that passes the quick verification, or 'none'."""
    newest = _newest_complete(run_dir)
    return f"{newest[1].name}@{(newest[1] / MANIFEST).stat().st_mtime_ns}" if newest else "none"


def written_since(run_dir: Path, since: str) -> bool:
    """Whether the newest complete checkpoint was written after `since` (a `newest_complete` value): another
    checkpoint, or the same folder written again, whose manifest is not older than that one's. A checkpoint
    that was there before and became the newest because the later ones were set aside is not new."""
    now = newest_complete(run_dir)
    if now == "none" or now == since:
        return False
    if since == "none":
        return True
    try:
        return int(now.rpartition("@")[2]) >= int(since.rpartition("@")[2])
    except ValueError:
        return True


def stop_reason(run_dir: Path) -> tuple[str, int]:
    """The summary's (stop, step), ("-", -1) when there is none or it cannot be read."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY).read_text())
        return str(summary.get("stop") or "-"), int(summary.get("step", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return "-", -1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--newest":
        print(newest_complete(Path(sys.argv[2])))
    elif len(sys.argv) in (2, 3) and not sys.argv[1].startswith("-"):
        run = Path(sys.argv[1])
        new = [int(written_since(run, sys.argv[2]))] if len(sys.argv) == 3 else []
        print(newest_complete_step(run), *stop_reason(run), *new)
    else:
        sys.exit(f"usage: {sys.argv[0]} RUN_DIR [SINCE] | --newest RUN_DIR")

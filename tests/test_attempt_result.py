"""launch/slurm/attempt_result.py, which pretrain.sbatch reads after each attempt: the newest complete
checkpoint's step and the summary's stop reason and step, from a run directory laid out by hand."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def result(run_dir: Path) -> list[str]:
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "slurm" / "attempt_result.py"), str(run_dir)],
                       capture_output=True, text=True, timeout=60, check=True)
    return p.stdout.split()


def test_summary_gives_the_stop_reason_and_the_step_it_ended_at(tmp_path):
    assert result(tmp_path) == ["-1", "-", "-1"]  # nothing yet: no checkpoint, no summary
    (tmp_path / "summary.json").write_text(json.dumps({"step": 16, "stop": "finished", "final_loss": 5.0}))
    assert result(tmp_path) == ["-1", "finished", "16"]
    (tmp_path / "summary.json").write_text(json.dumps({"step": 4, "stop": "signal"}))
    assert result(tmp_path) == ["-1", "signal", "4"]
    (tmp_path / "summary.json").write_text('{"step": 16, "stop": "fini')  # cut short: as if absent
    assert result(tmp_path) == ["-1", "-", "-1"]
    (tmp_path / "summary.json").write_text('["not", "a", "summary"]')
    assert result(tmp_path) == ["-1", "-", "-1"]


def test_newest_tells_a_new_checkpoint_of_the_same_step_from_an_old_one(tmp_path):
    """--newest names the newest complete checkpoint's file, not only its step: pretrain.sbatch compares it with
    the job's first start to know whether an attempt of the job has saved (a run set aside by --overwrite had
    a checkpoint of the same step)."""
    import os
    newest = lambda: subprocess.run([sys.executable, str(ROOT / "launch" / "slurm" / "attempt_result.py"), "--newest",  # noqa: E731
                                     str(tmp_path)], capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert newest() == "none"
    ckpt = tmp_path / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"x" * 10)
    from checkpoints.manifest import write_manifest
    write_manifest(ckpt)
    first = newest()
    assert first.startswith("step_00000004@")
    os.utime(ckpt / "manifest.json", ns=(1, 1))   # the same step, written at another time
    assert newest() not in (first, "none")


def test_new_is_a_checkpoint_written_since_the_start_whatever_its_step(tmp_path):
    """RUN_DIR SINCE adds whether the newest checkpoint was written after SINCE (the attempt's start): a resume
    of an earlier checkpoint of the run, or --overwrite, saves a step below the newest one it started with,
    and that is progress all the same; a checkpoint that only became the newest because the later ones were
    set aside is not."""
    import os
    from checkpoints.manifest import write_manifest
    script = str(ROOT / "launch" / "slurm" / "attempt_result.py")

    def ckpt(step: int, mtime: int) -> None:
        path = tmp_path / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / "model.pt").write_bytes(b"x" * 10)
        write_manifest(path)
        os.utime(path / "manifest.json", ns=(mtime, mtime))

    def run(*args: str) -> list[str]:
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60,
                              check=True).stdout.split()
    assert run(str(tmp_path), "none") == ["-1", "-", "-1", "0"]
    ckpt(4, 10**18)
    ckpt(8, 2 * 10**18)
    start = run("--newest", str(tmp_path))[0]
    assert start.startswith("step_00000008@")
    assert run(str(tmp_path), start) == ["8", "-", "-1", "0"]          # nothing written
    assert run(str(tmp_path), "none") == ["8", "-", "-1", "1"]
    set_aside = tmp_path / "checkpoints" / "superseded"
    set_aside.mkdir()
    os.replace(tmp_path / "checkpoints" / "step_00000008", set_aside / "step_00000008")
    assert run(str(tmp_path), start) == ["4", "-", "-1", "0"]          # --resume step 4: step 8 set aside
    ckpt(6, 3 * 10**18)
    assert run(str(tmp_path), start) == ["6", "-", "-1", "1"]          # and step 6 saved after it

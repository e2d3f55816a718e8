"""How a rank ends (pretrain/process_exit.py): a rank of several finishes what the interpreter's exit
finishes first (a non-daemon thread such as a checkpoint writer, the atexit handlers, unflushed output) and
exits with the run's status without the object-by-object teardown where a library's thread can abort it; a
single process exits as usual."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from pretrain.process_exit import exit_process

out = Path(sys.argv[1])

class Finalized:
    def __del__(self):  # runs only in the interpreter's teardown
        (out / "teardown").write_text("ran")

KEEP = Finalized()

def slow_save():
    time.sleep(0.5)
    (out / "save").write_text("complete")

threading.Thread(target=slow_save, daemon=False).start()
idle = concurrent.futures.ThreadPoolExecutor(2)  # workers left waiting for work, as compile pools are
idle.submit(int).result()
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("last words, unflushed")
exit_process(7)
"""


def _run(tmp_path: Path, world: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LINSCALE_EXIT_TEARDOWN")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if world is not None:
        env["WORLD_SIZE"] = world
    # stdout to a pipe: block-buffered, so the last words are lost unless flushed before the exit
    return subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_rank_of_several_finishes_its_work_and_skips_the_teardown(tmp_path):
    res = _run(tmp_path, "2")
    assert res.returncode == 7, res.stderr
    assert res.stdout == "last words, unflushed"
    assert (tmp_path / "save").read_text() == "complete"  # the writer thread was waited for, not cut
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()


@pytest.mark.parametrize("world", [None, "1"])
def test_a_single_process_exits_through_the_full_teardown(tmp_path, world):
    res = _run(tmp_path, world)
    assert res.returncode == 7, res.stderr
    assert res.stdout == "last words, unflushed"
    assert (tmp_path / "save").read_text() == "complete"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").read_text() == "ran"

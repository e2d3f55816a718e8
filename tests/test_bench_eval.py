"""launch/bench_eval.py without a GPU: bad flags and the CPU refusal end in one error line, before any model
is built."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch" / "bench_eval.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_to_run_without_a_gpu():
    # --size tiny: were a model built before the refusal, it would take seconds, not the 1B's minutes
    proc = _run("--archs", "tnl", "--size", "tiny")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "needs a CUDA GPU" in proc.stderr


def test_unknown_arch_is_a_usage_error():
    proc = _run("--archs", "nosuch")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "invalid choice: 'nosuch'" in proc.stderr

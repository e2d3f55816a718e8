"""Test setup. TRITON_INTERPRET must be set before any module with @triton.jit is imported, so the
Triton kernels run (slowly, on tiny shapes) on a CPU-only machine."""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

# with 2 threads the first exp of a fresh process was once seen off by ~1e-4: warm it up
torch.exp(torch.zeros(1 << 16))

SHARED_DATA = Path(os.environ.get("LINSCALE_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """../shared/data (or $LINSCALE_SHARED_DATA); tests that need real corpora skip without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (set LINSCALE_SHARED_DATA)")
    return SHARED_DATA

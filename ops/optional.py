"""Whether Triton is installed. Only its absence is tolerated: any other error while importing the kernel
modules (a bug, a Triton too old for them) propagates, so a broken kernel never silently falls back to
the plain-PyTorch twins."""
from __future__ import annotations

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ModuleNotFoundError as e:  # not installed at all (a broken install raises something else)
    if e.name != "triton":
        raise
    HAVE_TRITON = False

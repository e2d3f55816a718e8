"""How a rank of a multi-process run ends.

A finished rank can still abort while its interpreter tears itself down: the communication library's C++
worker threads can hold tensors whose Python owners are freed during finalization, and a thread that then
asks for the GIL of a dying interpreter is killed with `terminate called without an active exception`
(SIGABRT, exit 134). The launcher (torchrun, deepspeed, Slurm) then reports a failed rank although the run
finished and everything was written. The teardown has nothing left to do for a rank whose process group is
destroyed, so a rank ends by doing what the interpreter's own exit does first (wait for non-daemon threads,
such as a checkpoint writer; run the `atexit` handlers; flush the streams) and then skips the object-by-object
teardown with `os._exit`.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

TEARDOWN_ENV = "LINSCALE_EXIT_TEARDOWN"  # "1": end through the interpreter's full teardown (debugging)


def several_ranks() -> bool:
    """The process is one rank of several (torchrun, deepspeed and an `srun` task all set WORLD_SIZE)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    except ValueError:
        return False


def exit_process(code: int) -> None:
    """End the process with exit status `code`. A single process exits normally (`sys.exit`); a rank of
    several waits for its non-daemon threads, runs the `atexit` handlers, flushes stdout/stderr and then
    leaves without the interpreter's teardown, so the status is `code` and never a teardown abort."""
    if not several_ranks() or os.environ.get(TEARDOWN_ENV, "0") not in ("", "0"):
        sys.exit(code)
    # what the interpreter does first at exit: tell idle executors' workers to stop (their threads would
    # otherwise wait for work forever), then join every non-daemon thread, so a save in flight is finished
    threading._shutdown()  # the interpreter's own first step at exit (CPython 3.10 and later have it)
    atexit._run_exitfuncs()  # logging's shutdown, tensorboard's writers, temporary folders, ...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach the reader
            pass
    os._exit(code)

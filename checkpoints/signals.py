"""Graceful stop on SIGTERM / SIGUSR1 (what Slurm and torchrun send before killing a job): the handler
only sets a flag; the training loop asks `requested()` before each step, stops at the step boundary,
and a checkpoint is written before a clean exit. Nothing is done inside the handler itself, which could
interrupt a half-finished optimizer step or collective."""
from __future__ import annotations

import signal
import sys
import threading

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopSignal:
    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers (main thread only; returns False elsewhere, e.g. inside a test runner thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        name = signal.Signals(signum).name
        if self.received is None:
            print(f"[linscale] received {name}: stopping after this step and writing a checkpoint",
                  file=sys.stderr, flush=True)
        self.received = self.received or name

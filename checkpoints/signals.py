"""Graceful stop on SIGTERM / SIGUSR1 (what Slurm and torchrun send before killing a job) and SIGINT
(Ctrl-C): the handler only sets a flag; the training loop asks before each step, stops at the step
boundary, and a checkpoint is written before a clean exit. Nothing is done inside the handler itself,
which could interrupt a half-finished optimizer step or collective. A second Ctrl-C exits at once (the
newest complete checkpoint stays; a save cut short is removed at the next start)."""
from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


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
        # print, not the logger: a handler that runs while the interrupted code holds logging's lock would
        # deadlock on it
        name = signal.Signals(signum).name
        if self.received is not None and name == "SIGINT":
            print("\n[linscale] second Ctrl-C: exiting now, without a checkpoint of this step (the newest "
                  "complete checkpoint stays; --resume auto continues from it)", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        if self.received is None:
            how = "Ctrl-C" if name == "SIGINT" else name
            print(f"\n[linscale] received {how}: stopping after this step and writing a checkpoint"
                  + (" (Ctrl-C again to exit at once)" if name == "SIGINT" else ""), file=sys.stderr, flush=True)
        self.received = self.received or name

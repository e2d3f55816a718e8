"""One background writer thread: at most one save in flight. A new save waits for the previous one (so
staging buffers can be reused and saves land in order); an error in the background is raised in the
training thread at the next call, never swallowed."""
from __future__ import annotations

import threading
import time
from typing import Callable


class BackgroundWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_duration_s: float | None = None

    def _run(self, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the training thread
            self._error = err
        self.last_duration_s = time.perf_counter() - t0

    def submit(self, fn: Callable[[], None], name: str = "checkpoint-writer") -> None:
        self.wait()
        # not a daemon: a save in flight when training ends (or crashes) is finished before the process exits
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=False)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """The last job has ended with an error that nobody has collected yet."""
        return self._error is not None and not self.busy

    def finish(self) -> BaseException | None:
        """Block until the job in flight (if any) is done; return (and clear) its error instead of raising."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        return err

    def wait(self) -> None:
        """Block until the save in flight (if any) is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background checkpoint save failed: {err}") from err

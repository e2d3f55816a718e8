"""Console logging of the training side (trainer, train modules, checkpoints): per-module loggers under
`linscale.`, one format, rank 0 only.

    logger = get_logger(__name__)
    logger.info("...")                                  # "[linscale] ..." on stdout, rank 0
    logger.warning("...")                               # "[linscale] WARNING: ..." on stderr, rank 0
    logger.info("...", extra={"all_ranks": True})       # every rank says it: "[linscale rank 3] ..."

Records go to the process's current sys.stdout / sys.stderr, looked up when written, so a redirected or
captured stream (pytest's capsys, a Slurm log) gets them. The rank is torch.distributed's once the process
group is up, else the launcher's RANK variable. The `linscale` logger does not propagate to the root
logger: configure it (level, more handlers) through logging.getLogger("linscale").
"""
from __future__ import annotations

import logging
import os
import sys

ROOT = "linscale"


def process_rank() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class RankZeroFilter(logging.Filter):
    """Lets a record through on rank 0, or on every rank when it carries all_ranks=True."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "all_ranks", False)) or process_rank() == 0


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        # Lines every rank writes interleave in one job log: each names its rank.
        tag = f"{ROOT} rank {process_rank()}" if getattr(record, "all_ranks", False) else ROOT
        text = f"[{tag}] {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class ConsoleHandler(logging.Handler):
    """INFO to stdout, WARNING and above to stderr (the streams of the moment, flushed per record)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        handler = ConsoleHandler()
        handler.setFormatter(ConsoleFormatter())
        handler.addFilter(RankZeroFilter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (pass __name__), under the configured `linscale` logger."""
    _configure()
    return logging.getLogger(f"{ROOT}.{name}")

"""When to take weights-only snapshots: every N tokens, plus log-spaced early points (a loss curve and an
evaluation sweep need dense points where the model changes fastest, at the start)."""
from __future__ import annotations

import math


class SnapshotSchedule:
    """Snapshot points in tokens trained. `every_tokens` > 0 gives the multiples of it; `log_points` > 0
    adds that many points spaced evenly in log(tokens) from the first step (`tokens_per_step`) up to the
    first regular point (or to `total_tokens` when there is no regular spacing), the end excluded.
    A point is taken at the first step whose token count reaches it."""

    def __init__(self, every_tokens: int, log_points: int, tokens_per_step: int, total_tokens: int | None = None):
        if every_tokens < 0 or log_points < 0:
            raise ValueError(f"snapshot schedule: snapshot_every_tokens={every_tokens} and snapshot_log_points="
                             f"{log_points} must be >= 0 (0 turns that part off)")
        if tokens_per_step <= 0:
            raise ValueError(f"snapshot schedule: tokens_per_step={tokens_per_step} must be positive")
        self.every_tokens = every_tokens
        self.tokens_per_step = tokens_per_step
        self.log_tokens: list[int] = []
        if log_points:
            end = every_tokens or total_tokens
            if not end:
                raise ValueError(f"snapshot_log_points={log_points} needs an end for the log spacing: set "
                                 f"--snapshot-every-tokens, or --max-steps/--max-tokens")
            self.log_tokens = log_spaced(tokens_per_step, end, log_points)

    @property
    def enabled(self) -> bool:
        return bool(self.every_tokens or self.log_tokens)

    def due(self, tokens_before: int, tokens_after: int) -> bool:
        """Whether the step that took the count from tokens_before to tokens_after reached a point."""
        if self.every_tokens and tokens_after // self.every_tokens > tokens_before // self.every_tokens:
            return True
        return any(tokens_before < p <= tokens_after for p in self.log_tokens)

    def steps(self, last_step: int) -> list[int]:
        """The steps (1-based, up to last_step) at which snapshots fall (those for which `due` holds): for
        logs, docs and a study's plan. Each point falls at the first step whose token count reaches it,
        ceil(point / tokens_per_step), computed from the points rather than by testing every step, which
        takes minutes for a plan of 1e8 steps."""
        t = self.tokens_per_step
        out = {-(-p // t) for p in self.log_tokens}
        if self.every_tokens:
            e = self.every_tokens
            if e <= t:   # every step's tokens reach a multiple of every_tokens
                out.update(range(1, last_step + 1))
            else:
                out.update(-(-(k * e) // t) for k in range(1, last_step * t // e + 1))
        return sorted(s for s in out if 1 <= s <= last_step)


def log_spaced(start: int, end: int, n: int) -> list[int]:
    """n integer points from `start` towards `end` (excluded), evenly spaced in log; duplicates merged."""
    if end <= start:
        return [start]
    ratio = math.log(end / start)
    return sorted({int(round(start * math.exp(ratio * i / n))) for i in range(n)})

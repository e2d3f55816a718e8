"""When to take weights-only snapshots: every N tokens, plus log-spaced early points (a loss curve and an
evaluation sweep need dense points where the model changes fastest, at the start).

The log-spaced points are a property of the run, fixed at its first start: every checkpoint records the
schedule (`SnapshotSchedule.record`, in its meta.json), and a resume follows the
recorded points (`resumed_schedule`), whatever --max-steps, --max-tokens or --snapshot-every-tokens say
now. Otherwise extending a run would move them: the points already taken would no longer match the
schedule, and the later ones would fall elsewhere."""
from __future__ import annotations

import json
import math
from pathlib import Path

from checkpoints.layout import META


class SnapshotSchedule:
    """Snapshot points in tokens trained. `every_tokens` > 0 gives the multiples of it; `log_points` > 0
    adds that many points spaced evenly in log(tokens) from the first step (`tokens_per_step`) up to the
    first regular point (or to `total_tokens` when there is no regular spacing), the end excluded.
    `log_end` gives that end instead (a resume keeps the one of the run's first start); `log_tokens` gives
    the points themselves (as recorded). A point is taken at the first step whose token count reaches it."""

    def __init__(self, every_tokens: int, log_points: int, tokens_per_step: int, total_tokens: int | None = None,
                 *, log_end: int | None = None, log_tokens: list[int] | None = None):
        if every_tokens < 0 or log_points < 0:
            raise ValueError(f"snapshot schedule: snapshot_every_tokens={every_tokens} and snapshot_log_points="
                             f"{log_points} must be >= 0 (0 turns that part off)")
        if tokens_per_step <= 0:
            raise ValueError(f"snapshot schedule: tokens_per_step={tokens_per_step} must be positive")
        self.every_tokens = every_tokens
        self.log_points = log_points
        self.tokens_per_step = tokens_per_step
        # the end of the log spacing: recorded even while log_points is 0, so that points asked for at a
        # resume are spaced over the run's first span too
        self.log_end: int | None = log_end if log_end is not None else (every_tokens or total_tokens or None)
        self.log_tokens: list[int] = []
        if log_tokens is not None:
            self.log_tokens = sorted(int(p) for p in log_tokens)
        elif log_points:
            if not self.log_end:
                raise ValueError(f"snapshot_log_points={log_points} needs an end for the log spacing: set "
                                 f"--snapshot-every-tokens, or --max-steps/--max-tokens")
            self.log_tokens = log_spaced(tokens_per_step, self.log_end, log_points)

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
        out = set(self.log_steps())
        if self.every_tokens:
            e = self.every_tokens
            if e <= t:   # every step's tokens reach a multiple of every_tokens
                out.update(range(1, last_step + 1))
            else:
                out.update(-(-(k * e) // t) for k in range(1, last_step * t // e + 1))
        return sorted(s for s in out if 1 <= s <= last_step)

    def log_steps(self) -> list[int]:
        """The steps at which the log-spaced points fall."""
        return sorted({-(-p // self.tokens_per_step) for p in self.log_tokens})

    def record(self) -> dict:
        """What a checkpoint records of the schedule (JSON-able): a resume rebuilds it with `from_record`."""
        return {"every_tokens": self.every_tokens, "log_points": self.log_points,
                "tokens_per_step": self.tokens_per_step, "log_end": self.log_end, "log_tokens": list(self.log_tokens)}

    @classmethod
    def from_record(cls, rec: dict) -> SnapshotSchedule:
        return cls(int(rec["every_tokens"]), int(rec["log_points"]), int(rec["tokens_per_step"]),
                   log_end=rec.get("log_end"), log_tokens=rec.get("log_tokens") or [])


def resumed_schedule(recorded: dict, every_tokens: int, log_points: int, tokens_per_step: int,
                     total_tokens: int | None) -> tuple[SnapshotSchedule, str | None]:
    """The schedule a resumed run follows, and a note to log (None: nothing to say). `recorded` is the
    checkpoint's (`SnapshotSchedule.record`); the other arguments are this start's flags.

    The regular spacing is this start's --snapshot-every-tokens (a change applies from the resume on, like
    any changed setting). The log-spaced points are the recorded ones, whatever --max-steps, --max-tokens
    or --snapshot-every-tokens say now. Only another --snapshot-log-points changes them: that many points
    are spaced over the recorded span (the first start's end), so that they are still the points of one
    schedule; those at or before the resumed step have passed and are not taken (0 turns them off)."""
    old = SnapshotSchedule.from_record(recorded)
    now_end = every_tokens or total_tokens or None
    if log_points == old.log_points:
        sched = SnapshotSchedule(every_tokens, log_points, tokens_per_step, log_end=old.log_end,
                                 log_tokens=old.log_tokens)
        note = None
        if old.log_tokens and now_end is not None and now_end != old.log_end:
            by = "--snapshot-every-tokens" if every_tokens else "--max-steps/--max-tokens"
            note = (f"snapshot log points keep the spacing of the run's first start: {len(old.log_tokens)} points from "
                    f"{tokens_per_step} to {old.log_end} tokens (steps {', '.join(map(str, old.log_steps()))}); "
                    f"spaced by this start's {by} they would end at {now_end} tokens and move")
        return sched, note
    end = old.log_end if old.log_end is not None else now_end
    if log_points and not end:
        raise ValueError(f"--snapshot-log-points {log_points} needs an end for the log spacing, and neither the "
                         f"checkpoint's schedule nor this run's flags give one: set --snapshot-every-tokens, or "
                         f"--max-steps/--max-tokens")
    sched = SnapshotSchedule(every_tokens, log_points, tokens_per_step, log_end=end)
    span = f" from {tokens_per_step} to {end} tokens" if end else ""
    note = (f"--snapshot-log-points {old.log_points} -> {log_points}: the log-spaced points are spaced anew over "
            f"the run's first span{span}"
            + (f" (steps {', '.join(map(str, sched.log_steps()))})" if sched.log_tokens else " (none)")
            + "; points the run has passed are not taken, and the snapshots already taken are kept")
    return sched, note


def planned_steps(max_steps: int | None, max_tokens: int | None, tokens_per_step: int) -> int | None:
    """The steps a run trains: the first of --max-steps and the step whose tokens reach --max-tokens (None
    when neither is set)."""
    steps = [max_steps] if max_steps is not None else []
    if max_tokens is not None:
        steps.append(math.ceil(max_tokens / tokens_per_step))
    return min(steps) if steps else None


def schedule_of_config(config: dict, tokens_per_step: int) -> SnapshotSchedule | None:
    """The schedule a run config (`RunConfig.to_dict()`, as a checkpoint's meta.json records it) gives at
    a start: for checkpoints written before the schedule itself was recorded. None when it names none."""
    ck, train = config.get("checkpoint") or {}, config.get("train") or {}
    try:
        every, log_points = int(ck.get("snapshot_every_tokens") or 0), int(ck.get("snapshot_log_points") or 0)
        steps = planned_steps(None if train.get("max_steps") is None else int(train["max_steps"]),
                              None if train.get("max_tokens") is None else int(train["max_tokens"]), tokens_per_step)
        total = steps * tokens_per_step if steps is not None else None
        return SnapshotSchedule(every, log_points, tokens_per_step, total)
    except (TypeError, ValueError, KeyError):
        return None


def recorded_schedule(checkpoint: Path) -> SnapshotSchedule | None:
    """The snapshot schedule checkpoint `checkpoint` (RUN/checkpoints/step_N) records in its meta.json (for
    a study's plan or a tool that lists a run's snapshot points without loading it); for a checkpoint
    written before the schedule was recorded, the one its recorded config gives. None when unreadable."""
    try:
        meta = json.loads((Path(checkpoint) / META).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(meta.get("snapshot_schedule"), dict):
        try:
            return SnapshotSchedule.from_record(meta["snapshot_schedule"])
        except (TypeError, ValueError, KeyError):
            return None
    tps = meta.get("tokens_per_step")
    return schedule_of_config(meta.get("config") or {}, int(tps)) if tps else None


def log_spaced(start: int, end: int, n: int) -> list[int]:
    """n integer points from `start` towards `end` (excluded), evenly spaced in log; duplicates merged."""
    if end <= start:
        return [start]
    ratio = math.log(end / start)
    return sorted({int(round(start * math.exp(ratio * i / n))) for i in range(n)})

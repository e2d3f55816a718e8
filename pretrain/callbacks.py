"""Callbacks: what the training loop does besides training, each behind the hooks it needs (the shape of
OLMo-core's trainer callbacks). The loop (`pretrain.trainer.Trainer.fit`) calls, in the order of its list:

    post_attach()                  once, when the trainer is built (the checkpointer resumes here)
    pre_train(progress)            once, when fit() starts the loop
    stop_requested() -> reason     before every step; a collective, so every rank stops at the same step
    pre_step(progress)             right before the train module's step
    post_train_batch(progress, result)   after the step, its counters already advanced
    wants_log() -> bool            force a metrics row for this step (a skipped step, a loss spike)
    pre_log_metrics(progress, row) add this callback's fields to the row about to be logged
    post_eval()                    after a validation pass (its time is not training time)
    post_step(progress)            after the row is logged: checkpoints, stopping on bad steps
    save_now()                     the run stops itself on purpose: write a resume checkpoint of this step
    post_train(stop_reason)        after the loop ('finished', 'signal', 'save_failed')
    close()                        on every way out of the trainer, errors included

A callback that keeps state across a resume returns it from `state_dict` (merged into the trainer's
state, so each key must be unique) and reads it back in `load_state_dict`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.train_module import StepResult


@dataclass
class TrainProgress:
    """How far the run is: optimizer steps, tokens and FLOPs trained (the trainer advances it)."""
    step: int = 0
    tokens: int = 0
    flops: float = 0.0


class Callback:
    """A no-op for every hook; subclasses override what they use."""

    def state_dict(self) -> dict:
        """State to keep across a resume (merged into the trainer's: keys must be unique)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Read back what state_dict returned (`state` is the trainer's whole state)."""

    def post_attach(self) -> None:
        """Once, when the trainer is built."""

    def pre_train(self, progress: TrainProgress) -> None:
        """Once, when fit() starts the loop (after a resume `progress` is not at step 0)."""

    def stop_requested(self) -> str | None:
        """A reason to stop before the next step, or None. Every rank calls it at every step, so it may be a
        collective; all ranks must return the same answer."""
        return None

    def pre_step(self, progress: TrainProgress) -> None:
        """Right before the train module's step number progress.step."""

    def post_train_batch(self, progress: TrainProgress, result: StepResult) -> None:
        """After the step, its counters already advanced; `result`: its loss, grad norm, whether skipped."""

    def wants_log(self) -> bool:
        """True to log a metrics row for this step whatever --log-every says."""
        return False

    def pre_log_metrics(self, progress: TrainProgress, row: dict) -> None:
        """Add this callback's fields to the row about to be logged (changed in place)."""

    def post_eval(self) -> None:
        """After a validation pass."""

    def post_step(self, progress: TrainProgress) -> None:
        """After the step's row is logged. May raise pretrain.monitors.TrainingStopped to end the run."""

    def save_now(self) -> None:
        """The run stops itself on purpose: write what must survive (a resume checkpoint) now."""

    def post_train(self, stop_reason: str) -> None:
        """After the loop: 'finished', 'signal', 'save_failed' or 'log_failed'."""

    def close(self) -> None:
        """On every way out of the trainer, errors included."""

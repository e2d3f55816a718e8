"""Run a study on this machine: one run after another (train -> export -> evaluate), then the report.

Stages run in this process, so a study of small models does not pay a Python and CUDA start per stage.
A stage that fails is recorded (STUDY/state/) and its run is left; the others go on. SIGTERM or SIGUSR1
(what Slurm and most schedulers send) and the optional deadline stop the study cleanly: a run in training
writes a checkpoint and the study ends; `run` again continues where it stopped."""
from __future__ import annotations

import signal
import threading
import time

from scaling.study.config import StudyConfig
from scaling.study.plan import RunPlan
from scaling.study.stages import (EVALUATE, EXPORT, RUN_STAGES, TRAIN, StageStopped, check_evaluation, evaluate,
                                  export, prepare_eval_inputs, tracked, train)

STAGE_FUNCTIONS = {TRAIN: train, EXPORT: export, EVALUATE: evaluate}


class Stopper:
    """A stop flag set by SIGTERM/SIGUSR1 outside training (the trainer has its own handler while it runs and
    checkpoints on the same signals) or by the deadline, which also signals the process so that a run in
    training stops at its next step."""

    def __init__(self, deadline_s: float | None):
        self.reason: str | None = None
        self._previous: dict = {}
        self._timer = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                self._previous[sig] = signal.signal(sig, self._handle)
        if deadline_s is not None:
            self._timer = threading.Timer(max(0.0, deadline_s), self._deadline)
            self._timer.daemon = True
            self._timer.start()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.reason = self.reason or signal.Signals(signum).name

    def _deadline(self) -> None:
        self.reason = self.reason or "deadline"
        import os
        os.kill(os.getpid(), signal.SIGUSR1)

    @property
    def stop(self) -> bool:
        return self.reason is not None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


def run_local(study: StudyConfig, plans: list[RunPlan], stages: tuple[str, ...] = RUN_STAGES,
              deadline_s: float | None = None, log=print) -> dict:
    """Returns {"done": [...], "failed": {run: error}, "stopped": reason or None} for this invocation."""
    t0 = time.time()
    if EVALUATE in stages:
        check_evaluation(study)  # before any training: a missing eval file must not surface hours later
        prepare_eval_inputs(study, log)
    stopper = Stopper(deadline_s)
    done, failed = [], {}
    try:
        for i, plan in enumerate(plans, 1):
            if stopper.stop:
                break
            log(f"[study] ({i}/{len(plans)}) {plan.name}  [{time.time() - t0:.0f}s]")
            for stage in stages:
                if stopper.stop:
                    break
                try:
                    tracked(study, plan.name, stage, STAGE_FUNCTIONS[stage], study, plan, log)
                except StageStopped as err:
                    log(f"[study] {err}")
                    stopper.reason = stopper.reason or "stopped"
                    break
                except Exception as err:  # noqa: BLE001 - recorded, the other runs go on
                    failed[plan.name] = f"{stage}: {type(err).__name__}: {err}"
                    log(f"[study] {plan.name}: {stage} FAILED: {type(err).__name__}: {err} "
                        f"(traceback in {study.out / 'state' / plan.name / (stage + '.json')})")
                    break
            else:
                done.append(plan.name)
    finally:
        stopper.close()
    if stopper.stop:
        log(f"[study] stopped ({stopper.reason}) after {time.time() - t0:.0f}s; run the same command again to continue")
    return {"done": done, "failed": failed, "stopped": stopper.reason}

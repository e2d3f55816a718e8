"""Run a study on this machine: one run after another (train -> export -> evaluate), then the report.

Stages run in this process, so a study of small models does not pay a Python and CUDA start per stage.
A stage that fails is recorded (STUDY/state/) and its run is left; the others go on. SIGTERM or SIGUSR1
(what Slurm and most schedulers send) and the optional deadline stop the study cleanly: a run in training
writes a checkpoint, a run in evaluation stops before its next snapshot or task (the finished results stay cached),
and the study ends; `run` again continues where it stopped. Each run is claimed for its stages
(`run_claimed`): a run that another process works on is left to it, so two runners of one study share its runs."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from scaling.study.config import StudyConfig
from scaling.study.plan import RunPlan
from scaling.study.stages import (EVALUATE, EXPORT, RUN_STAGES, TRAIN, RunBusy, StageStopped, check_evaluation,
                                  check_paths, eval_dir, evaluate, export, prepare_eval_inputs, run_claimed, tracked,
                                  train)

STAGE_FUNCTIONS = {TRAIN: train, EXPORT: export, EVALUATE: evaluate}
# stages that take the study's stop flag (`stop`: the reason, or None) and end early, cleanly, when it is set
STOPPABLE = (EVALUATE,)


class Stopper:
    """A stop flag set by SIGTERM/SIGUSR1 outside training (the trainer has its own handler while it runs and
    checkpoints on the same signals) or by the deadline, which also signals the process so that a run in
    training stops at its next step. The runner asks it between stages, the evaluate stage between snapshots
    and between tasks."""

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
    """Returns, for this invocation, {"done": [...], "failed": {run: error}, "busy": {run: why}, "stopped": reason
    or None, "stopped_in": [the run a stop ended mid-way], "seconds": wall time}; "busy" are runs another process
    works on (left to it)."""
    t0 = time.time()
    check_paths(study, stages)
    if EVALUATE in stages:
        check_evaluation(study)  # before any training: a missing eval file must not surface hours later
        prepare_eval_inputs(study, log)
    stopper = Stopper(deadline_s)
    done, failed, busy, stopped_in = [], {}, {}, []
    try:
        for i, plan in enumerate(plans, 1):
            if stopper.stop:
                break
            log(f"[study] ({i}/{len(plans)}) {plan.name}  [{time.time() - t0:.0f}s]")
            try:
                with run_claimed(study, plan.name):
                    outcome = _run_stages(study, plan, stages, stopper, log)
            except RunBusy as err:
                busy[plan.name] = str(err)
                log(f"[study] {err}")
                continue
            if outcome is None:
                done.append(plan.name)
            elif outcome == "stopped":
                stopped_in.append(plan.name)
            else:
                failed[plan.name] = outcome
    finally:
        stopper.close()
    if stopper.stop:
        log(f"[study] stopped ({stopper.reason}) after {time.time() - t0:.0f}s; run the same command again to continue")
    # a run left to another process that has finished it meanwhile is done, not left
    by_name = {p.name: p for p in plans}
    for name in [n for n in busy if _stages_done(study, by_name[n], stages)]:
        busy.pop(name)
        done.append(name)
    return {"done": done, "failed": failed, "busy": busy, "stopped": stopper.reason, "stopped_in": stopped_in,
            "seconds": time.time() - t0}


def _stages_done(study: StudyConfig, plan: RunPlan, stages: tuple[str, ...]) -> bool:
    from scaling.study.status import run_status
    s = run_status(study, plan)
    return ((TRAIN not in stages or s.train == "done")
            and (EXPORT not in stages or (s.to_evaluate > 0 and s.exported >= s.to_evaluate))
            and (EVALUATE not in stages or s.complete))


def _run_stages(study: StudyConfig, plan: RunPlan, stages: tuple[str, ...], stopper: Stopper, log) -> str | None:
    """The stages of one run: None when all are done, "stopped", or the failure ("stage: error")."""
    for stage in stages:
        if stopper.stop:
            return "stopped"
        # the evaluate stage asks the flag between snapshots and tasks (training has the trainer's own handler)
        extra = {"stop": lambda: stopper.reason} if stage in STOPPABLE else {}
        try:
            tracked(study, plan.name, stage, STAGE_FUNCTIONS[stage], study, plan, log, **extra)
        except RunBusy:
            raise
        except StageStopped as err:
            log(f"[study] {err}")
            stopper.reason = stopper.reason or "stopped"
            return "stopped"
        except Exception as err:  # noqa: BLE001 - recorded, the other runs go on
            log(f"[study] {plan.name}: {stage} FAILED: {type(err).__name__}: {err} "
                f"(traceback in {study.out / 'state' / plan.name / (stage + '.json')})")
            return f"{stage}: {type(err).__name__}: {err}"
    return None


def summary_lines(study: StudyConfig, plans: list[RunPlan], stages: tuple[str, ...], res: dict,
                  report: Path | None) -> list[str]:
    """What this invocation did, what failed or was left, and where the results are: the last lines of `run`."""
    names = [p.name for p in plans]
    stopped_in = [n for n in res.get("stopped_in", []) if n in names]
    reached = set(res["done"]) | set(res["failed"]) | set(res["busy"]) | set(stopped_in)
    not_reached = [n for n in names if n not in reached]
    lines = [f"[study] summary: {len(res['done'])} of {len(names)} run(s) through {', '.join(stages)} in "
             f"{res.get('seconds', 0):.0f}s"
             + (f"; failed: {len(res['failed'])}" if res["failed"] else "")
             + (f"; left to another process: {len(res['busy'])}" if res["busy"] else "")
             + (f"; stopped ({res['stopped']}) in {len(stopped_in)}, not reached: {len(not_reached)}"
                if res["stopped"] else "")]
    lines += [f"  failed  {run}: {why[:300]}" for run, why in res["failed"].items()]
    lines += [f"  busy    {why[:300]}" for why in res["busy"].values()]
    if res["stopped"] and stopped_in:
        lines.append(f"  stopped in: {', '.join(stopped_in)} (the same command continues it where it stopped)")
    if res["stopped"] and not_reached:
        lines.append(f"  not reached: {', '.join(not_reached)}")
    if res["failed"]:
        lines.append(f"  errors and tracebacks: {study.out / 'state'}/<run>/<stage>.json")
    lines.append(f"  runs: {study.out / 'runs'}/<run>/ (metrics.jsonl, summary.json, snapshots/, exports/); "
                 f"evaluation: {eval_dir(study)}/<run>/results.json")
    if report is not None:
        lines.append(f"  report: {report}")
    cfg = f"--config {study.path}" if study.path else "--config STUDY.yaml"
    lines.append(f"  progress of every run: python launch/study.py status {cfg}"
                 + "".join(f" --set {o}" for o in study.overrides))
    return lines

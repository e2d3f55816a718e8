"""What a study has done, read from its files (run directories, exports, the evaluation cache) and the stage
records, plus Slurm's view of submitted jobs where there is one. Nothing here changes the study."""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from checkpoints.layout import METRICS, MODEL_CONFIG, SLURM_ATTEMPT
from scaling.study.config import StudyConfig
from scaling.study.plan import RunPlan
from scaling.study.stages import (EVALUATE, EXPORT, TRAIN, csr_tasks, eval_dir, export_change, read_state,
                                  read_summary, run_change, selected_snapshot_steps, train_done)


@dataclass
class RunStatus:
    name: str
    train: str          # done | running | failed | stopped | partial | pending
    step: int
    steps: int
    snapshots: int
    exported: int
    evaluated: int      # snapshots whose every task is cached with the study's settings now
    to_evaluate: int    # snapshots selected for evaluation
    note: str = ""

    @property
    def complete(self) -> bool:
        return self.train == "done" and self.to_evaluate > 0 and self.evaluated >= self.to_evaluate


def _last_step(run_dir: Path) -> int:
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return 0
    step = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError, TypeError):
                continue
    return step


def _alive(rec: dict | None) -> bool:
    """A local stage record whose process still exists (only checkable on the same host)."""
    if not rec or rec.get("status") != "running" or rec.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(rec["pid"]), 0)
    except (OSError, KeyError, ValueError, TypeError):
        return False
    return True


def _failed_slurm_attempt(study: StudyConfig, plan: RunPlan) -> str:
    """'Slurm job J exited N ...' when the newest record of the run's training is a Slurm attempt
    (launch/slurm/pretrain.sbatch writes <run>/slurm_attempt.json) that failed, else ''. Finished jobs are
    invisible to squeue, and sacct needs accounting: the run directory keeps how the job ended."""
    from scaling.study.stages import state_path
    path = Path(plan.run_dir) / SLURM_ATTEMPT
    try:
        rec = json.loads(path.read_text())
        local = state_path(study, plan.name, TRAIN)
        if local.is_file() and local.stat().st_mtime > path.stat().st_mtime:
            return ""
        code = int(rec.get("exit", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return ""
    return f"Slurm job {rec.get('job_id')} exited {code} (stop: {rec.get('stop')})" if code else ""


def _evaluated(study: StudyConfig, plan: RunPlan, steps: list[int]) -> tuple[int, str]:
    """(snapshots whose every task has a current result, a note naming the stale ones). A result made with
    other settings than the study's now (another limit, scoring window, validation windows, ...) is not done:
    the evaluate stage makes it again."""
    from checkpoints.layout import step_name
    from scaling.study.stages import cached_evaluation, stored_csr_scores, sweep_tasks
    req = _requests(study)
    n, stale = 0, []
    for s in steps:
        snap = step_name(s)
        whys = {t: cached_evaluation(study, plan, snap, t)[1] for t in sweep_tasks(study)}
        if req is not False:
            whys["commonsense scores"] = stored_csr_scores(study, plan, snap, req)[1]
        n += not any(whys.values())
        # the first stale task of the snapshot, by name and setting: "wikitext2 made with limit=100, ..."
        stale += [f"{t} {w.removeprefix('stale: ')}" for t, w in whys.items() if w.startswith("stale")][:1]
    return n, f"{len(stale)} snapshot(s) stale: {stale[0]}" if stale else ""


def _requests(study: StudyConfig):
    """The commonsense request file with csr: replay (None where it is not made yet), else False."""
    from scaling.study.stages import CSR_REQUESTS
    if study.evaluation.csr != "replay" or not csr_tasks(study):
        return False
    from evaluation.request_replay import read_requests
    try:
        return read_requests(eval_dir(study) / CSR_REQUESTS)
    except (OSError, ValueError):
        return None


def run_status(study: StudyConfig, plan: RunPlan, jobs: dict[str, str] | None = None) -> RunStatus:
    """jobs: Slurm state of this run's stage jobs ({stage: 'RUNNING'|'PENDING'|'FAILED'|...}), if submitted."""
    from checkpoints.layout import EXPORTS, SNAPSHOTS, step_dirs, step_name
    from checkpoints.manifest import MANIFEST
    jobs = jobs or {}
    rec = read_state(study, plan.name, TRAIN)
    step = _last_step(plan.run_dir)
    note = ""
    if train_done(plan):
        train = "done"
    elif _alive(rec) or jobs.get(TRAIN) in ("RUNNING", "COMPLETING", "REQUEUED"):
        train = "running"
    elif jobs.get(TRAIN) == "PENDING":
        train = "queued"
    elif (rec and rec.get("status") == "failed") or jobs.get(TRAIN) in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                                                                         "TIMEOUT", "CANCELLED"):
        train = "failed"
        note = (rec or {}).get("error", "") or f"Slurm: {jobs.get(TRAIN)}"
    elif slurm_failure := _failed_slurm_attempt(study, plan):
        train = "failed"
        note = slurm_failure
    elif rec and rec.get("status") in ("stopped", "running"):
        train = "stopped"  # a local process that ended without a record of finishing: continue with `run`
    elif step:
        train = "partial"
    else:
        train = "pending"
    summary = read_summary(plan.run_dir)
    why = run_change(plan) if train != "done" else None
    if why:
        note = note or f"holds {why}: `run` retrains it"
    elif train != "done" and summary and summary.get("stop") == "finished" and int(summary.get("step") or 0) < plan.steps:
        note = note or f"finished at step {summary['step']} of a smaller budget: `run` continues it from its checkpoint"
    for stage in (EXPORT, EVALUATE):
        r = read_state(study, plan.name, stage)
        if r and r.get("status") == "failed" and not note:
            note = f"{stage}: {r.get('error', '')}"
        if jobs.get(stage) in ("RUNNING", "PENDING") and not note:
            note = f"{stage}: Slurm {jobs[stage].lower()}"
        elif jobs.get(stage) == "DEPENDENCY_NEVER_SATISFIED" and not note:
            note = f"{stage}: its Slurm job never starts (its training failed): `run --slurm` again"
    snaps = [s for s, _ in step_dirs(plan.run_dir / SNAPSHOTS)]
    complete = {s for s, d in step_dirs(plan.run_dir / SNAPSHOTS) if (d / MANIFEST).is_file()}
    missing = sorted(set(plan.snapshot_steps) - complete) if train == "done" and snaps else []
    if missing and not note:
        # the snapshot schedule does not change what a run trains to, so the run is kept; but the steps the plan
        # prints are not all there to evaluate
        note = (f"no snapshot at planned step(s) {','.join(map(str, missing[:4]))}{'...' if len(missing) > 4 else ''}"
                f" (trained under another snapshot schedule or budget)")
    exports = [s for s, p in step_dirs(plan.run_dir / EXPORTS) if (p / MODEL_CONFIG).is_file()]
    # a study copied without its weights (snapshots left behind) still shows what was exported and evaluated
    selected = selected_snapshot_steps(study, plan.run_dir) if snaps else exports
    # an export the export stage would make again (another export_dtype, another snapshot of the step) is not done
    exported = [s for s in exports if s in selected and not export_change(study, plan, step_name(s))]
    evaluated, stale = _evaluated(study, plan, selected)
    note = note or stale
    return RunStatus(plan.name, train, step, plan.steps, len(snaps), len(exported), evaluated, len(selected),
                     note[:100])


def study_status(study: StudyConfig, plans: list[RunPlan], jobs: dict[str, dict[str, str]] | None = None
                 ) -> list[RunStatus]:
    jobs = jobs or {}
    return [run_status(study, p, jobs.get(p.name)) for p in plans]


def format_status(statuses: list[RunStatus]) -> str:
    head = ["run", "train", "step", "snapshots", "exported", "evaluated", "note"]
    rows = [[s.name, s.train, f"{s.step}/{s.steps}", str(s.snapshots), f"{s.exported}/{s.to_evaluate}",
             f"{s.evaluated}/{s.to_evaluate}", s.note] for s in statuses]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    done = sum(s.complete for s in statuses)
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s.train] = counts.get(s.train, 0) + 1
    summary = (f"{done}/{len(statuses)} runs trained and evaluated; training: "
               + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows), "", summary])

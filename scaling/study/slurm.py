"""Run a study on Slurm: job arrays with dependencies, train -> export + evaluate -> report.

- train: one array, a task per run that still has to train, each task running `launch/slurm/pretrain.sbatch`
  (the project's job script: srun ranks, DeepSpeed, checkpoint and requeue on the time-limit warning) with
  the run's flags; `--resume auto` makes every restart and resubmission continue the run.
- export + evaluate: one array over the same runs in the same order, `--dependency=aftercorr` on the
  training array, so a run's evaluation starts as soon as that run has trained; `--kill-on-invalid-dep=yes`
  ends the evaluation task of a run whose training failed (else it would stay pending for good, and the
  report with it); runs that are trained already go into a second array without a dependency.
- report: one job after both (`afterany`, so a study with a failed run is still fitted and reported).

Runs whose training, export and evaluation are complete are left out; a run in a job that Slurm still
holds (pending or running) is not submitted twice. The scripts are written to STUDY/slurm/ (read them,
or submit them by hand) and every submission is appended to STUDY/slurm/submissions.jsonl, which
`launch/study.py status` reads to show the jobs' states."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from scaling.study.config import StudyConfig
from scaling.study.plan import RunPlan
from scaling.study.stages import EVALUATE, EXPORT, REPORT, TRAIN, evaluation_problems, prepare_eval_inputs, train_done
from scaling.study.status import run_status

ROOT = Path(__file__).resolve().parents[2]
SUBMISSIONS = "submissions.jsonl"


def _q(s) -> str:
    return shlex.quote(str(s))


def slurm_dir(study: StudyConfig) -> Path:
    return study.out / "slurm"


def _array(n: int, max_parallel: int | None) -> str:
    return f"0-{n - 1}" + (f"%{max_parallel}" if max_parallel else "")


def _header(study: StudyConfig, stage: str, n: int | None, options: list[str], extra: list[str]) -> list[str]:
    log = study.out / "logs" / (f"{stage}-%A_%a.out" if n is not None else f"{stage}-%j.out")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={study.name}-{stage}", f"#SBATCH --output={log}"]
    if n is not None:
        lines.append(f"#SBATCH --array={_array(n, study.slurm.max_parallel)}")
    lines += [f"#SBATCH {o}" for o in extra + options]
    return lines


def _cases(items: list[list[str]]) -> list[str]:
    out = ['case "$SLURM_ARRAY_TASK_ID" in']
    for i, body in enumerate(items):
        out.append(f"  {i}) " + "; ".join(body) + " ;;")
    out += ['  *) echo "[study] no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"]
    return out


def train_script(study: StudyConfig, plans: list[RunPlan]) -> str:
    """The training array: task i trains plans[i] through launch/slurm/pretrain.sbatch, which owns the
    launch (srun ranks), the stop signals and the requeue; this script only picks the run."""
    from pretrain.config import parse_config
    lines = _header(study, TRAIN, len(plans), study.slurm.train,
                    ["--requeue", "--signal=B:USR1@300", "--open-mode=append"])
    # pretrain.sbatch finds the repository as the submit directory: make it this checkout wherever sbatch ran
    lines += ["set -euo pipefail", f"cd {_q(ROOT)}", f"export SLURM_SUBMIT_DIR={_q(ROOT)}"]
    lines += [f"export {k}={_q(v)}" for k, v in study.slurm.train_env.items()]
    cases = []
    for p in plans:
        cfg = parse_config(p.argv)
        env = {"RUN_DIR": p.run_dir, "ZERO": cfg.dist.zero, "MICRO": cfg.train.micro_batch,
               "GLOBAL_BATCH_TOKENS": cfg.train.global_batch_tokens}
        if study.data is not None:
            env["DATA"] = study.data
        env = {k: v for k, v in env.items() if k not in study.slurm.train_env}
        cases.append([f"export {k}={_q(v)}" for k, v in env.items()]
                     + ["set -- " + " ".join(_q(a) for a in [p.arch, p.argv[p.argv.index("--size") + 1], *p.argv])])
    lines += _cases(cases)
    lines += ['echo "[study] array task $SLURM_ARRAY_TASK_ID: $RUN_DIR" >&2',
              "exec bash launch/slurm/pretrain.sbatch \"$@\""]
    return "\n".join(lines) + "\n"


def _sets(study: StudyConfig) -> str:
    """The --set overrides of this study, so that a job loads the config the submitter planned."""
    return "".join(f" --set {_q(o)}" for o in study.overrides)


def _study_command(study: StudyConfig, args: str) -> list[str]:
    """`launch/study.py ARGS --config ...` as a job runs it: from the directory the study is submitted from,
    where the YAML's relative `out` and `data` were resolved (the training array got them as absolute paths),
    so that the job loads the same study wherever the checkout is."""
    return [f"cd {_q(Path.cwd())}",
            f"exec {_q(sys.executable)} {_q(ROOT / 'launch' / 'study.py')} {args} --config {_q(study.path)}{_sets(study)}"]


def stage_script(study: StudyConfig, plans: list[RunPlan], name: str, stages: tuple[str, ...]) -> str:
    """The export / evaluate array: task i runs the stages of plans[i] in `launch/study.py stage`, which Slurm
    warns with SIGUSR1 two minutes before the time limit: an evaluation stops before its next snapshot or
    task, recorded as stopped, its finished results cached (the stage done again continues them)."""
    lines = _header(study, name, len(plans), study.slurm.evaluate, ["--signal=B:USR1@120"])
    # a warning that comes before Python has installed its handler must not end the job (USR1's default
    # action): ignored until then (the disposition carries across exec; the stage command sets its own)
    lines += ["set -euo pipefail", "trap '' USR1"]
    lines += _cases([[f"RUN={_q(p.name)}"] for p in plans])
    lines += _study_command(study, "stage")
    lines[-1] += f" --run \"$RUN\" --stages {','.join(stages)}"
    return "\n".join(lines) + "\n"


def report_script(study: StudyConfig) -> str:
    lines = _header(study, REPORT, None, study.slurm.fit, [])
    lines += ["set -euo pipefail", *_study_command(study, "report")]
    return "\n".join(lines) + "\n"


# a pending job whose dependency failed: Slurm never starts it (without --kill-on-invalid-dep it stays)
NEVER_RUNS = "DEPENDENCY_NEVER_SATISFIED"
HELD = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED")


def _sbatch(cmd: str, script: Path, dependency: str | None) -> str:
    args = [cmd, "--parsable"] + ([f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if dependency else []) \
        + [str(script)]
    try:
        res = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    except FileNotFoundError:
        raise RuntimeError(f"{cmd}: not found, this machine has no Slurm (nothing was submitted); run the study here "
                           f"without --slurm, or write the job scripts with --slurm --dry-run (into {script.parent}) to "
                           f"submit them where Slurm is") from None
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip().split(";")[0]


def read_submissions(study: StudyConfig) -> list[dict]:
    path = slurm_dir(study) / SUBMISSIONS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _task_states(study: StudyConfig, squeue: str = "squeue", sacct: str = "sacct") -> dict[str, str]:
    """{job id or JOB_TASK: state} of the study's submitted jobs: squeue for jobs Slurm holds, sacct (where
    accounting is on) for finished ones. A pending job whose dependency can never be satisfied (its run's
    training failed) is NEVER_RUNS."""
    ids = sorted({s["job_id"] for s in read_submissions(study)})
    states: dict[str, str] = {}
    if not ids:
        return states
    for cmd in ([sacct, "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ids)],
                [squeue, "-h", "-r", "-o", "%i|%T|%r", "-j", ",".join(ids)]):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if res.returncode != 0:
            continue
        for line in res.stdout.splitlines():
            if "|" in line:
                jid, st, *reason = line.split("|")
                st = st.strip().split()[0] if st.strip() else ""
                if st == "PENDING" and reason and "DependencyNeverSatisfied" in reason[0]:
                    st = NEVER_RUNS
                states[jid.strip()] = st
    return states


def _by_run(study: StudyConfig, states: dict[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for s in read_submissions(study):
        for i, run in enumerate(s["runs"]):
            key = f"{s['job_id']}_{i}" if s.get("array") else s["job_id"]
            st = states.get(key)
            if st:
                for stage in s["stages"]:
                    out.setdefault(run, {})[stage] = st
    return out


def job_states(study: StudyConfig, squeue: str = "squeue", sacct: str = "sacct") -> dict[str, dict[str, str]]:
    """{run: {stage: state}} for the study's submitted jobs (`_task_states`); the newest submission of a
    run and stage wins."""
    return _by_run(study, _task_states(study, squeue, sacct))


def submit(study: StudyConfig, plans: list[RunPlan], sbatch: str = "sbatch", squeue: str = "squeue",
           sacct: str = "sacct", dry_run: bool = False, log=print, scancel: str = "scancel") -> dict:
    """Write the scripts and submit what is missing; returns {"train": job, "evaluate": [jobs], "report": job}
    (job ids, or script paths with dry_run)."""
    out = slurm_dir(study)
    out.mkdir(parents=True, exist_ok=True)
    (study.out / "logs").mkdir(parents=True, exist_ok=True)
    prepare_eval_inputs(study, log)
    for problem in evaluation_problems(study):  # the jobs may see another file system: warn, do not refuse
        log(f"[study] WARNING: on this machine {problem}")
    tasks = _task_states(study, squeue, sacct)
    held = _by_run(study, tasks)
    busy = {r for r, st in held.items() if any(v in HELD for v in st.values())}
    stale = sorted(t for t, st in tasks.items() if st == NEVER_RUNS)
    if stale and not dry_run:
        # tasks that can never start (their run's training failed): they would hold a report job for good
        subprocess.run([scancel, *stale], capture_output=True, text=True)
        log(f"[study] cancelled {len(stale)} job(s) whose dependency failed: {', '.join(stale)}")
    to_train, to_eval, skipped = [], [], []
    for p in plans:
        if p.name in busy:
            log(f"[study] {p.name}: a job of it is still pending or running in Slurm; not submitted again")
            skipped.append(p.name)
            continue
        st = run_status(study, p)
        if st.complete:
            continue
        (to_eval if train_done(p) else to_train).append(p)
    result: dict = {"train": None, "evaluate": [], "report": None}
    if not to_train and not to_eval:
        log("[study] " + (f"{len(skipped)} run(s) still held by Slurm jobs, every other run is trained and "
                          f"evaluated" if skipped else "every run is trained and evaluated")
            + "; submitting only the report")
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def go(kind: str, script_text: str, runs: list[RunPlan] | None, stages: list[str], dep: str | None) -> str:
        path = out / f"{kind}-{stamp}.sbatch"
        path.write_text(script_text)
        if dry_run:
            log(f"[study] dry run: would submit {path}" + (f" --dependency={dep}" if dep else ""))
            return str(path)
        job = _sbatch(sbatch, path, dep)
        rec = {"time": stamp, "job_id": job, "script": str(path), "stages": stages, "array": runs is not None,
               "runs": [r.name for r in runs] if runs is not None else ["*"], "dependency": dep}
        with open(out / SUBMISSIONS, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"[study] submitted {kind}: job {job}" + (f" ({len(runs)} array tasks)" if runs else "")
            + (f", after {dep}" if dep else ""))
        return job

    if to_train:
        result["train"] = go("train", train_script(study, to_train), to_train, [TRAIN], None)
        result["evaluate"].append(go("evaluate", stage_script(study, to_train, "evaluate", (EXPORT, EVALUATE)),
                                     to_train, [EXPORT, EVALUATE], f"aftercorr:{result['train']}"))
    if to_eval:
        result["evaluate"].append(go("evaluate", stage_script(study, to_eval, "evaluate", (EXPORT, EVALUATE)),
                                     to_eval, [EXPORT, EVALUATE], None))
    deps = [j for j in ([result["train"]] + result["evaluate"]) if j]
    dep = "afterany:" + ":".join(deps) if deps else None
    result["report"] = go("report", report_script(study), None, [REPORT], dep)
    return result

"""The stages of one run (train -> export -> evaluate) and of the study (report), each a function that the
local executor calls in its own process and a Slurm job calls through `launch/study.py stage`. Every stage
skips what is already done, so running one again (a resubmission, a crash, a new run added to the config)
only does the missing work:

- train: `launch/pretrain.py <the plan's flags> --resume auto` (in-process); done when the run's
  summary.json says it finished at the planned step. A run directory that holds another run (other settings,
  another budget that its checkpoints cannot continue to) is moved aside first (`run_change`, `supersede`).
- export: the selected snapshots to RUN/exports/ (checkpoints.export; existing exports are kept).
- evaluate: evaluation.sweep over the run's exports into STUDY/eval/<run>/ (its per-(snapshot, task) cache
  skips work finished with the same settings, and `cached_evaluation` reads it the same way for status and
  report); with `evaluation.csr: replay` the commonsense tasks are scored from the study's request file into
  STUDY/eval/<run>/csr_scores/ instead, and the report turns scores into metrics. A stop (signal, deadline)
  ends it between snapshots and between tasks, its finished results kept.

Where a study keeps things:

    STUDY/runs/<run>/            run directories (config.json, metrics.jsonl, snapshots/, exports/, ...)
    STUDY/eval/<run>/            the run's evaluation (cache/, results.json, csr_scores/)
    STUDY/eval/valid_tokens.bin  validation windows from the data's held-out split (task valid_loss)
    STUDY/eval/csr_requests.json lm-eval requests for evaluation.csr = replay
    STUDY/state/<run>/<stage>.json  what each stage last did (status, pid/host or Slurm job, error)
    STUDY/state/<run>/.lock      the claim of the process working on the run (run_claimed)
    STUDY/superseded/<run>-<time>/  an earlier run of another budget or settings, moved aside by `train`
    STUDY/report/                fits, Table 3, plots, report.md
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Callable

from checkpoints.atomic import atomic_write_bytes, atomic_write_text
from checkpoints.layout import SUMMARY
from scaling.study.config import StudyConfig
from scaling.study.plan import RunPlan

TRAIN, EXPORT, EVALUATE = "train", "export", "evaluate"
RUN_STAGES = (TRAIN, EXPORT, EVALUATE)
REPORT = "report"
VALID_TOKENS = "valid_tokens.bin"
CSR_REQUESTS = "csr_requests.json"


class StageStopped(RuntimeError):
    """A stage ended early on purpose (a stop signal or the deadline); rerunning continues it."""


class RunBusy(RuntimeError):
    """Another live process works on the run (another `launch/study.py run` or Slurm stage task on the same study,
    or a training job in its run directory): the run is left to it, which is not a failure of the run."""


# -- state records ------------------------------------------------------------------------------------

def state_path(study: StudyConfig, run: str, stage: str) -> Path:
    return study.out / "state" / run / f"{stage}.json"


def write_state(study: StudyConfig, run: str, stage: str, status: str, **extra) -> None:
    path = state_path(study, run, stage)
    rec = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid(),
           "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID"), **extra}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(rec, indent=1))  # a full disk leaves the earlier record whole
    except OSError as err:
        raise OSError(err.errno, f"cannot write the stage record {path}: {err.strerror or err}") from None


def read_state(study: StudyConfig, run: str, stage: str) -> dict | None:
    path = state_path(study, run, stage)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def tracked(study: StudyConfig, run: str, stage: str, fn, *args, **kwargs):
    """Run a stage with its state recorded: running, then done / stopped / failed (with the error). Ctrl-C
    is a stop, not a failure of the stage: `run` again does the stage again (the trainer itself takes a
    Ctrl-C in training as a stop and checkpoints; elsewhere it arrives as KeyboardInterrupt). A run that
    another process turns out to hold (RunBusy) gets its earlier record back: the record describes the
    stage's last attempt, and this one did nothing."""
    previous = state_path(study, run, stage)
    previous = previous.read_bytes() if previous.is_file() else None
    write_state(study, run, stage, "running")
    try:
        result = fn(*args, **kwargs)
    except RunBusy:
        path = state_path(study, run, stage)
        if previous is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_bytes(path, previous)
        raise
    except StageStopped as err:
        write_state(study, run, stage, "stopped", error=str(err))
        raise
    except KeyboardInterrupt:
        write_state(study, run, stage, "stopped", error="interrupted (Ctrl-C)")
        raise
    except BaseException as err:
        write_state(study, run, stage, "failed", error=f"{type(err).__name__}: {err}",
                    traceback=traceback.format_exc()[-4000:])
        raise
    write_state(study, run, stage, "done")
    return result


@contextlib.contextmanager
def _locked(folder: Path, busy):
    """Hold `folder`'s lock (checkpoints.run_dir.RunLock, an flock the kernel drops when the process dies);
    RunBusy(busy(holder)) when another process holds it."""
    from checkpoints.errors import RunDirectoryBusy
    from checkpoints.run_dir import RunLock
    lock = RunLock(folder)
    try:
        lock.acquire()
    except RunDirectoryBusy:
        raise RunBusy(busy(lock.holder())) from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def run_claimed(study: StudyConfig, run: str):
    """Hold the run for this process across all its stages (STUDY/state/<run>/.lock). Two runners of one study (a
    second `run` started by mistake, or on purpose beside the first on another GPU), or a runner and a Slurm stage
    task, would otherwise train one run twice, export over each other's temporary files, or record the other's run
    as failed; with the claim the second leaves the run to the first (RunBusy) and goes on with the others."""
    folder = study.out / "state" / run
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder, lambda holder: f"{run}: left to the process that works on it ({holder})"):
        yield


@contextlib.contextmanager
def report_claimed(study: StudyConfig, log=print, poll_s: float = 1.0):
    """One report at a time (STUDY/state/.lock): a report clears the earlier fit's outputs before it fits, so two
    at once would remove each other's tables and plots. A second report waits for the first and then reports
    what is done by then."""
    from checkpoints.errors import RunDirectoryBusy
    from checkpoints.run_dir import RunLock
    folder = study.out / "state"
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder)
    waiting = False
    while True:
        try:
            lock.acquire()
            break
        except RunDirectoryBusy:
            if not waiting:
                log(f"[study] report: another process writes the report now ({lock.holder()}); waiting for it")
                waiting = True
            time.sleep(poll_s)
    try:
        yield
    finally:
        lock.release()


# -- train ---------------------------------------------------------------------------------------------

def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / SUMMARY).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# the settings that make two runs the same run (the budget aside): a run directory whose recorded config differs in
# any of them holds another run
RUN_IDENTITY = ("arch", "model", "optim", "train.seq_len", "train.global_batch_tokens", "train.seed", "train.doc_reset",
                "train.precision")
SUPERSEDED = "superseded"


def _field(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def run_change(plan: RunPlan) -> str | None:
    """Why the run in plan.run_dir cannot become the plan's run, or None (no run there yet, or the plan's run
    itself, or a shorter run of the same settings with a resume checkpoint to continue from: the learning rate
    is constant after the warm-up, so continuing it is the longer run). Otherwise the study trains the plan's
    run afresh (`supersede`): a run of another budget without a checkpoint to continue from, a longer run than
    the plan, or a run of other settings would mix two runs' metrics and evaluations."""
    from checkpoints.layout import CHECKPOINTS, RUN_CONFIG, step_dirs
    from checkpoints.manifest import MANIFEST
    from pretrain.config import parse_config
    try:
        old = json.loads((plan.run_dir / RUN_CONFIG).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as err:
        return f"its {RUN_CONFIG} cannot be read ({err})"
    new = json.loads(json.dumps(parse_config(plan.argv).to_dict()))
    for key in RUN_IDENTITY:
        a, b = _field(old, key), _field(new, key)
        if isinstance(a, dict) and isinstance(b, dict):  # fields added to the code since the run keep their old meaning
            diff = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
            if diff:
                return f"a run of other settings ({', '.join(f'{key}.{k} {a[k]!r}, the plan {b[k]!r}' for k in diff)})"
        elif a != b:
            return f"a run of other settings ({key} {a!r}, the plan {b!r})"
    steps = int(_field(old, "train.max_steps") or 0)
    if steps == plan.steps:
        return None
    if steps > plan.steps:
        return f"a run of {steps} steps, more than the plan's {plan.steps}"
    if any((p / MANIFEST).is_file() for _, p in step_dirs(plan.run_dir / CHECKPOINTS)):
        return None
    return f"a run of {steps} steps, no checkpoint to continue it to {plan.steps}"


def supersede(study: StudyConfig, plan: RunPlan, why: str, log=print) -> Path:
    """Move the run's directory, evaluation and export/evaluate records to STUDY/superseded/<run>-<time>/ (kept,
    not deleted), so that the plan's run starts afresh and nothing of the earlier run is read as its."""
    import shutil
    dest = study.out / SUPERSEDED / f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    dest.mkdir(parents=True)
    # the run directory last: it is what says the run must be moved aside (run_change), so a move cut short (a
    # kill) is done again by the next `run`, and the earlier run's evaluation never stays behind as the new run's
    eval_src = eval_dir(study, plan.name)
    if eval_src.exists():
        shutil.move(str(eval_src), str(dest / "eval"))
    for stage in (EXPORT, EVALUATE):
        rec = state_path(study, plan.name, stage)
        if rec.exists():
            (dest / "state").mkdir(exist_ok=True)
            shutil.move(str(rec), str(dest / "state" / rec.name))
    if plan.run_dir.exists():
        shutil.move(str(plan.run_dir), str(dest / "run"))
    log(f"[study] {plan.name}: {plan.run_dir} held {why}; moved to {dest}, training afresh")
    return dest


def train_done(plan: RunPlan) -> bool:
    s = read_summary(plan.run_dir)
    return bool(s) and s.get("stop") == "finished" and int(s.get("step") or 0) == plan.steps \
        and run_change(plan) is None


def _run_dir_busy(plan: RunPlan, holder: str) -> str:
    return f"{plan.name}: its run directory is in use by another process ({holder}); left to it"


@contextlib.contextmanager
def _run_dir_free(plan: RunPlan):
    """The run directory's own lock (the trainer's), held for a moment: a training process outside the study's
    claims (a Slurm task of `run --slurm`, a pretrain.py started by hand) keeps its directory, and is not moved
    aside under it or trained over."""
    if not plan.run_dir.is_dir():
        yield
        return
    with _locked(plan.run_dir, lambda holder: _run_dir_busy(plan, holder)):
        yield


def train(study: StudyConfig, plan: RunPlan, log=print) -> dict:
    """Train (or continue) one run in this process; returns the trainer's summary."""
    from checkpoints.errors import RunDirectoryBusy
    from checkpoints.run_dir import RunLock
    why = run_change(plan)
    if why is not None:
        with _run_dir_free(plan):
            supersede(study, plan, why, log)
    if train_done(plan):
        log(f"[study] {plan.name}: trained ({plan.steps} steps), skipped")
        return read_summary(plan.run_dir) or {}
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    log(f"[study] {plan.name}: training to {plan.steps} steps ({plan.tokens:,} tokens), resuming if possible")
    cfg = parse_config(plan.argv + ["--resume", "auto"])
    trainer = None
    try:
        trainer = Trainer(cfg)
        summary = trainer.fit()
    except RunDirectoryBusy:
        raise RunBusy(_run_dir_busy(plan, RunLock(plan.run_dir).holder())) from None
    finally:
        del trainer
        _free_memory()
    if summary.get("stop") != "finished":
        raise StageStopped(f"{plan.name}: training stopped at step {summary.get('step')} ({summary.get('stop')}); "
                           f"run the study again to continue from its checkpoint")
    return summary


def _free_memory() -> None:
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


# -- export --------------------------------------------------------------------------------------------

def selected_snapshot_steps(study: StudyConfig, run_dir: Path) -> list[int]:
    """Steps of the run's complete snapshots that the study evaluates (evaluation.snapshots)."""
    from checkpoints.layout import SNAPSHOTS, step_dirs
    from checkpoints.manifest import MANIFEST
    steps = [s for s, p in step_dirs(Path(run_dir) / SNAPSHOTS) if (p / MANIFEST).is_file()]
    which = study.evaluation.snapshots
    if which == "final":
        return steps[-1:]
    if isinstance(which, int):
        return steps[-which:]
    return steps


def export(study: StudyConfig, plan: RunPlan, log=print) -> list[Path]:
    from checkpoints.export import export_run
    steps = selected_snapshot_steps(study, plan.run_dir)
    if not steps:
        raise FileNotFoundError(f"{plan.name}: no complete snapshot in {plan.run_dir / 'snapshots'} to export "
                                f"(train the run first)")
    out = []
    for s in steps:
        out += export_run(plan.run_dir, s, study.evaluation.export_dtype, log=lambda m: log(f"    {m}"))
    log(f"[study] {plan.name}: {len(out)} snapshot(s) exported")
    return out


# -- evaluate ------------------------------------------------------------------------------------------

def eval_dir(study: StudyConfig, run: str | None = None) -> Path:
    return study.out / "eval" / run if run else study.out / "eval"


def csr_tasks(study: StudyConfig) -> list[str]:
    from evaluation.sweep import CSR_TASKS
    return [t for t in study.evaluation.tasks if t in CSR_TASKS]


def scoring_window(study: StudyConfig) -> int:
    """Perplexity and multiple-choice scoring window: the training context unless the config says."""
    return study.evaluation.max_length or study.seq_len


def prepare_eval_inputs(study: StudyConfig, log=print) -> None:
    """What every evaluate stage reads and only the study's own machine can make: the validation windows
    (from the data's held-out split, through the trainer's loader) and, for csr: replay, the lm-eval
    request file. Both are made once and reused."""
    e = study.evaluation
    out = eval_dir(study)
    out.mkdir(parents=True, exist_ok=True)
    path = out / VALID_TOKENS
    if "valid_loss" in e.tasks:
        if study.data is not None and not Path(study.data).exists() and path.is_file():
            check_valid_tokens(study)  # evaluating where the data is not: the file must fit the study's settings
        else:
            # made afresh from the data every time and compared: a file made for another seq_len, number of
            # windows or dataset would otherwise be scored as this study's validation set. An unchanged file is
            # left as it is (the evaluation cache keys on its size and time).
            import numpy as np

            from data_pipeline import build_loader
            loader = build_loader(study.data, study.seq_len, 1, 1, split="val", seed=0)
            windows = []
            for _ in range(e.valid_windows):
                b = loader.next_batch()
                windows.append(np.concatenate([b["input_ids"][0].numpy(), b["targets"][0, -1:].numpy()]))
            data = np.concatenate(windows).astype(np.uint32).tobytes()
            if not (path.is_file() and path.read_bytes() == data):
                replaced = path.is_file()
                atomic_write_bytes(path, data)
                log(f"[study] validation: {e.valid_windows} windows of {study.seq_len + 1} tokens from the held-out "
                    f"split -> {path}" + (" (replacing one made for other settings or data)" if replaced else ""))
    if e.csr == "replay" and csr_tasks(study):
        from evaluation.request_replay import read_requests, write_requests
        path = out / CSR_REQUESTS
        current = None
        if path.is_file():
            current = read_requests(path)
        if current is None or requests_changes(study, current):
            req = write_requests(path, csr_tasks(study), e.limit)
            log(f"[study] commonsense requests: {len(req['pairs']):,} (context, continuation) pairs for "
                f"{', '.join(req['tasks'])} at limit {e.limit} -> {path}")


# raw files each task reads on the evaluating machine (evaluation.local_data.EVAL_FILES keys)
TASK_FILES = {"wikitext2": ("wikitext2_test",), "lambada_openai": ("lambada_openai",), "piqa": ("piqa", "piqa_labels"),
              "siqa": ("siqa", "siqa_labels"), "arc_easy": ("arc_easy",), "arc_challenge": ("arc_challenge",),
              "boolq": ("boolq",), "openbookqa": ("openbookqa",), "winogrande": ("winogrande",),
              "hellaswag": ("hellaswag",)}


def check_paths(study: StudyConfig, stages: tuple[str, ...] = RUN_STAGES, data: bool = True) -> None:
    """The study directory can be written and the data is there, checked before any run starts: otherwise every
    run fails on its own with an OS error that names neither the study key nor the fix."""
    from scaling.study.config import StudyConfigError
    where = f" in {study.path}" if study.path else ""
    e = study.evaluation
    needs_data = TRAIN in stages or (EVALUATE in stages and "valid_loss" in e.tasks
                                     and not (eval_dir(study) / VALID_TOKENS).is_file())
    if data and needs_data and study.data is not None and not Path(study.data).exists():
        raise StudyConfigError(
            f"study config: data: {study.data} does not exist. Prepare the dataset there (python "
            f"launch/prepare_data.py --config DATA.yaml --out {study.data}), or set `data`{where} to a prepared "
            f"dataset or a data config (a relative path is taken from the directory study.py starts in, "
            f"{Path.cwd()}), or leave it out for the embedded default corpus")
    probe = study.out / "state" / f".write-test.{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        what = f"{err.strerror or err}" + (f": {err.filename}" if getattr(err, "filename", None) else "")
        raise StudyConfigError(f"study config: out: the study directory {study.out} cannot be created or written "
                               f"({what}); set `out`{where} (or --set out=DIR) to a folder this machine can "
                               f"write") from None


def check_valid_tokens(study: StudyConfig) -> None:
    """The validation windows file holds the study's windows of seq_len + 1 tokens, as many as it asks for (the
    sweep would score fewer, or cut windows of another length, without a word)."""
    path = eval_dir(study) / VALID_TOKENS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `launch/study.py plan --prepare` (or run) where the data "
                                f"is, before evaluating")
    want = study.evaluation.valid_windows * (study.seq_len + 1)
    have = path.stat().st_size // 4
    if have != want:
        raise ValueError(f"{path} holds {have:,} tokens, not the {study.evaluation.valid_windows} windows of "
                         f"seq_len + 1 = {study.seq_len + 1} tokens ({want:,}) that the study asks for: it was made "
                         f"for another evaluation.valid_windows or seq_len; run `launch/study.py plan --prepare` (or "
                         f"run) where the data is to make it again")


def evaluation_problems(study: StudyConfig) -> list[str]:
    """What the evaluate stage would miss on this machine (data files, lm-eval), found before any training:
    an evaluation that fails after hours of training is the costly way to learn it."""
    import importlib.util

    from evaluation import local_data
    here = sweep_tasks(study)
    problems = []
    for t in here:
        for name in TASK_FILES.get(t, ()):
            try:
                local_data.eval_path(name)
            except FileNotFoundError as err:
                problems.append(str(err))
    if "wikitext2" in here and importlib.util.find_spec("lm_eval") is None:
        problems.append("wikitext2 uses lm-eval's detokenizer file: install lm-eval, or put the files of its wheel "
                        "on PYTHONPATH (they need none of its dependencies)")
    direct_lm_eval = [t for t in here if t in csr_tasks(study) or t.startswith("scrolls_")]
    if direct_lm_eval:
        try:
            import lm_eval  # noqa: F401
        except ImportError as err:
            problems.append(f"{', '.join(direct_lm_eval)} run through lm-eval, which cannot be imported here ({err}); "
                            f"install it, or set evaluation.csr: replay to score the commonsense tasks without it")
    return problems


def check_evaluation(study: StudyConfig) -> None:
    problems = evaluation_problems(study)
    if problems:
        raise FileNotFoundError("evaluation cannot run on this machine:\n  - " + "\n  - ".join(problems))


def sweep_config(study: StudyConfig, run_dir: Path, tasks: list[str]):
    from evaluation.sweep import SweepConfig
    e = study.evaluation
    valid = [str(eval_dir(study) / VALID_TOKENS)] if "valid_loss" in tasks else []
    return SweepConfig(runs=[str(run_dir)], tasks=[t for t in tasks if t != "valid_loss"] or ["valid_loss"],
                       out=str(eval_dir(study, Path(run_dir).name)), device=e.device, dtype=e.dtype,
                       batch_size=e.batch_size, limit=e.limit, max_length=scoring_window(study),
                       valid_shards=valid, valid_seq_len=study.seq_len, valid_windows=e.valid_windows, plots=False)


def sweep_tasks(study: StudyConfig) -> list[str]:
    """The tasks the evaluate stage hands the sweep: with csr: replay the commonsense tasks are scored apart."""
    replay = study.evaluation.csr == "replay"
    return [t for t in study.evaluation.tasks if not (replay and t in csr_tasks(study))]


def evaluate(study: StudyConfig, plan: RunPlan, log=print, stop: Callable[[], str | None] | None = None) -> list[dict]:
    """Evaluate the run's exports; returns the sweep's rows (one per snapshot). `stop` (the study's stop flag:
    the reason, or None) is asked between snapshots and between tasks: a signal or the deadline ends the stage
    there (StageStopped) with every finished (snapshot, task) result cached, so the next `run` does the rest."""
    from evaluation.sweep import SweepStopped, sweep
    check_evaluation(study)
    tasks = sweep_tasks(study)
    if "valid_loss" in tasks:
        check_valid_tokens(study)
    try:
        rows = sweep(sweep_config(study, plan.run_dir, tasks), stop=stop) if tasks else []
    except SweepStopped as err:
        raise StageStopped(f"{plan.name}: {err}; the finished results are kept, run the study again to evaluate "
                           f"the rest") from None
    check_sweep_rows(plan, rows)
    if study.evaluation.csr == "replay" and csr_tasks(study):
        score_csr(study, plan, log, stop)
    return rows


class EvaluationFailed(RuntimeError):
    """Snapshots the sweep could not evaluate (an export that cannot be loaded, a task whose data cannot be had)."""


def check_sweep_rows(plan: RunPlan, rows: list[dict]) -> None:
    """The sweep goes on past a snapshot or task it cannot evaluate, with the error in that row: the stage is not
    done then (the run would count as evaluated, and `run` exit 0, with numbers missing). EvaluationFailed names
    each such snapshot and its errors; the results the sweep made are cached, and `run` again evaluates the rest."""
    from evaluation.sweep import row_errors
    failed = [(r.get("snapshot"), row_errors(r)) for r in rows if row_errors(r)]
    if failed:
        raise EvaluationFailed(f"{plan.name}: {len(failed)} of {len(rows)} snapshot(s) not evaluated: "
                               + "; ".join(f"{snap}: {why}" for snap, why in failed)
                               + ". The other results are kept; fix that and run the study again")


def csr_score_key(study: StudyConfig, req: dict, weights: dict) -> dict:
    """What a snapshot's stored commonsense scores were made with: the request file (its digest), the weights'
    fingerprint and the scoring window."""
    return {"requests": req["sha256"], "weights": weights, "window": scoring_window(study)}


def requests_changes(study: StudyConfig, req: dict) -> list[tuple[str, object, object]]:
    """(setting, in the request file, the study's) where the commonsense request file was made for other
    tasks or another limit than the study asks for (prepare_eval_inputs makes it again)."""
    want = {"tasks": csr_tasks(study), "limit": study.evaluation.limit}
    return [(k, req.get(k), v) for k, v in want.items() if req.get(k) != v]


def score_csr(study: StudyConfig, plan: RunPlan, log=print, stop: Callable[[], str | None] | None = None) -> None:
    """Scores of the study's commonsense requests for every export of the run, cached per snapshot; `stop` is
    asked before each snapshot (as in `evaluate`)."""
    from evaluation.request_replay import read_requests, score_requests
    from evaluation.sweep import find_snapshots, fingerprint, load_model
    req = read_requests(eval_dir(study) / CSR_REQUESTS)
    out = eval_dir(study, plan.name) / "csr_scores"
    out.mkdir(parents=True, exist_ok=True)
    cfg = sweep_config(study, plan.run_dir, ["valid_loss"])
    for snap in find_snapshots([str(plan.run_dir)]):
        key = csr_score_key(study, req, fingerprint(snap["path"]))
        path = out / f"{snap['snapshot']}.json"
        if path.is_file() and json.loads(path.read_text()).get("key") == key:
            continue
        reason = stop() if stop is not None else None
        if reason:
            raise StageStopped(f"{plan.name}: commonsense scoring stopped ({reason}) before {snap['snapshot']}; the "
                               f"finished scores are kept, run the study again to score the rest")
        t0 = time.time()
        model = load_model(snap, cfg, [])
        scores = score_requests(model, req, scoring_window(study), study.evaluation.batch_size)
        del model
        rec = {"key": key, "snapshot": {k: snap[k] for k in ("run", "snapshot", "arch", "size", "step", "tokens",
                                                               "flops")}, "scores": scores}
        atomic_write_text(path, json.dumps(rec))
        log(f"    {snap['snapshot']}: {len(scores):,} commonsense requests scored ({time.time() - t0:.1f}s)")


# -- what is evaluated: the caches against the study's settings now ------------------------------------

# the sweep's names of settings a study sets, as the study config names them
STUDY_NAMES = {"windows": "valid_windows", "window": "max_length"}
# settings whose values say nothing printed in a line: named only
OTHER_NAMES = {"weights": "weights (exported again)", "data": "evaluation data", "shards": "validation windows file",
               "haystack": "haystack", "requests": "request file", "key": "settings"}


def describe_stale(changes: list[tuple[str, object, object]]) -> str:
    """'stale: made with limit=100, study asks limit=200' (evaluation.sweep.key_changes' differences)."""
    plain = lambda v: v is None or isinstance(v, (bool, int, float, str))  # noqa: E731
    shown = [(STUDY_NAMES.get(k, k), a, b) for k, a, b in changes if plain(a) and plain(b) and k not in OTHER_NAMES]
    other = [OTHER_NAMES.get(k, k) for k, a, b in changes if not (plain(a) and plain(b)) or k in OTHER_NAMES]
    show = lambda v: "null" if v is None else str(v)  # noqa: E731  (as YAML writes it: limit null is all)
    parts = []
    if shown:
        parts.append("made with " + ", ".join(f"{k}={show(a)}" for k, a, _ in shown) + ", study asks "
                     + ", ".join(f"{k}={show(b)}" for k, _, b in shown))
    if other:
        parts.append("made with other " + ", ".join(dict.fromkeys(other)))
    return "stale: " + "; ".join(parts)


def _key_here(study: StudyConfig, plan: RunPlan, snapshot: str, task: str, cached: dict) -> dict:
    """The key the evaluate stage would give (snapshot, task) now (evaluation.sweep.cache_key). What this machine
    cannot know of the evaluating one is taken from the cached key: under dtype auto its dtype (bfloat16 on a GPU,
    where status may run on a login node), the digest of an evaluation file not here, the weights of an export
    whose weights were left behind, a validation windows file not collected with the results."""
    from checkpoints.layout import EXPORTS, MODEL_WEIGHTS
    from evaluation.sweep import cache_key, fingerprint, run_dtype, scoring_window_of
    cfg = sweep_config(study, plan.run_dir, [task])
    export = plan.run_dir / EXPORTS / snapshot
    snap = {"run": plan.name, "snapshot": snapshot, "path": str(export), "max_seq_len": None}
    old = cached.get("settings") if isinstance(cached.get("settings"), dict) else {}
    if cfg.dtype == "auto" and cfg.device != "cpu":
        dtype = old.get("dtype")
    else:  # an explicit dtype is the same on every device: resolved as on the CPU, without a word about a GPU
        dtype = run_dtype(dataclasses.replace(cfg, device="cpu"))
    weights = fingerprint(str(export)) if (export / MODEL_WEIGHTS).is_file() else cached.get("weights")
    key = cache_key(task, snap, cfg, scoring_window_of(snap, cfg, warn=None), dtype, weights or {})
    data, old_data = key["settings"].get("data"), old.get("data")
    if isinstance(data, dict) and isinstance(old_data, dict):
        key["settings"]["data"] = {k: old_data.get(k) if v is None else v for k, v in data.items()}
    if "shards" in key["settings"]:
        key["settings"]["shards"] = _collected_without(key["settings"]["shards"], old.get("shards"))
    return key


def _collected_without(now: list, cached) -> list:
    """The study's validation windows file as the cached key names it when it is not on this machine (results
    evaluated on another machine and collected without it): nothing here to tell it apart. A copy of it
    elsewhere (a moved study) matches through evaluation.sweep.same_key."""
    return cached if not now and isinstance(cached, list) and cached else now


def export_change(study: StudyConfig, plan: RunPlan, snapshot: str) -> str:
    """Why the run's export of `snapshot` is not the one the export stage would make now, or "": an export in
    another `evaluation.export_dtype`, or of another snapshot of that step (a branch the run abandoned when it
    resumed from an earlier checkpoint). The export stage makes it again, and the evaluation after it, so neither
    counts as done. What an export does not record, or a snapshot not on this machine (a study carried without
    its weights), is not held against it."""
    from checkpoints.export import Source, source_digest
    from checkpoints.layout import CHECKPOINTS, EXPORTS, MODEL_CONFIG, SNAPSHOTS
    try:
        meta = json.loads((plan.run_dir / EXPORTS / snapshot / MODEL_CONFIG).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(meta, dict):
        return ""
    dtype, want = meta.get("export_dtype"), study.evaluation.export_dtype
    if dtype is not None and dtype != want:
        return f"exported as {dtype}, study asks export_dtype={want}"
    made = (meta.get("source") or {}).get("manifest") if isinstance(meta.get("source"), dict) else None
    # the snapshot, or its checkpoint of the same step (what the export stage takes when the snapshot is corrupt)
    here = {source_digest(Source(meta.get("step"), kind, plan.run_dir / sub / snapshot))
            for kind, sub in (("snapshot", SNAPSHOTS), ("checkpoint", CHECKPOINTS))} - {None}
    if made and here and made not in here:
        return "exported from another snapshot of that step (an abandoned branch)"
    return ""


def cached_evaluation(study: StudyConfig, plan: RunPlan, snapshot: str, task: str) -> tuple[dict | None, str]:
    """(metrics, "") when the sweep's cached result for (snapshot, task) was made with what the study asks for
    now, else (None, why): "not evaluated", or "stale: made with limit=100, study asks limit=200" (the evaluate
    stage makes it again). Status counts, and the report shows, only current results."""
    from evaluation.sweep import key_changes, read_cache
    rec = read_cache(eval_dir(study, plan.name) / "cache" / plan.name / snapshot / f"{task}.json")
    if rec is None or not isinstance(rec.get("key"), dict):
        return None, "not evaluated"
    why = export_change(study, plan, snapshot)
    if why:
        return None, f"stale: {why}"
    changes = key_changes(rec["key"], _key_here(study, plan, snapshot, task, rec["key"]))
    return (None, describe_stale(changes)) if changes else (rec["metrics"], "")


def stored_csr_scores(study: StudyConfig, plan: RunPlan, snapshot: str, req: dict | None) -> tuple[dict | None, str]:
    """(the record, "") when the snapshot's stored commonsense scores were made for the study's requests (tasks,
    limit), weights and window now, else (None, why) as in cached_evaluation. `req`: the request file (None:
    not made yet)."""
    from checkpoints.layout import EXPORTS, MODEL_WEIGHTS
    from evaluation.sweep import fingerprint
    path = eval_dir(study, plan.name) / "csr_scores" / f"{snapshot}.json"
    try:
        rec = json.loads(path.read_text())
        cached = rec["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, "not evaluated"
    if req is None:
        return None, "not evaluated"
    changes = requests_changes(study, req)
    if changes:
        return None, describe_stale(changes)
    why = export_change(study, plan, snapshot)
    if why:
        return None, f"stale: {why}"
    export = plan.run_dir / EXPORTS / snapshot
    weights = fingerprint(str(export)) if (export / MODEL_WEIGHTS).is_file() else cached.get("weights")
    key = csr_score_key(study, req, weights)
    changes = [(k, cached.get(k), v) for k, v in key.items() if cached.get(k) != v]
    return (None, describe_stale(changes)) if changes else (rec, "")

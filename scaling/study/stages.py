"""The stages of one run (train -> export -> evaluate) and of the study (report), each a function that the
local executor calls in its own process and a Slurm job calls through `launch/study.py stage`. Every stage
skips what is already done, so running one again (a resubmission, a crash, a new run added to the config)
only does the missing work:

- train: `launch/pretrain.py <the plan's flags> --resume auto` (in-process); done when the run's
  summary.json says it finished at the planned step. A run directory that holds another run (other settings,
  another budget that its checkpoints cannot continue to) is moved aside first (`run_change`, `supersede`).
- export: the selected snapshots to RUN/exports/ (checkpoints.export; existing exports are kept).
- evaluate: evaluation.sweep over the run's exports into STUDY/eval/<run>/ (its per-(snapshot, task) cache
  skips finished work); with `evaluation.csr: replay` the commonsense tasks are scored from the study's
  request file into STUDY/eval/<run>/csr_scores/ instead, and the report turns scores into metrics.

Where a study keeps things:

    STUDY/runs/<run>/            run directories (config.json, metrics.jsonl, snapshots/, exports/, ...)
    STUDY/eval/<run>/            the run's evaluation (cache/, results.json, csr_scores/)
    STUDY/eval/valid_tokens.bin  validation windows from the data's held-out split (task valid_loss)
    STUDY/eval/csr_requests.json lm-eval requests for evaluation.csr = replay
    STUDY/state/<run>/<stage>.json  what each stage last did (status, pid/host or Slurm job, error)
    STUDY/superseded/<run>-<time>/  an earlier run of another budget or settings, moved aside by `train`
    STUDY/report/                fits, Table 3, plots, report.md
"""
from __future__ import annotations

import gc
import json
import os
import socket
import time
import traceback
from pathlib import Path

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


# -- state records ------------------------------------------------------------------------------------

def state_path(study: StudyConfig, run: str, stage: str) -> Path:
    return study.out / "state" / run / f"{stage}.json"


def write_state(study: StudyConfig, run: str, stage: str, status: str, **extra) -> None:
    path = state_path(study, run, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid(),
           "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID"), **extra}
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.rename(path)


def read_state(study: StudyConfig, run: str, stage: str) -> dict | None:
    path = state_path(study, run, stage)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def tracked(study: StudyConfig, run: str, stage: str, fn, *args, **kwargs):
    """Run a stage with its state recorded: running, then done / stopped / failed (with the error). Ctrl-C
    is a stop, not a failure of the stage: `run` again does the stage again (the trainer itself takes a
    Ctrl-C in training as a stop and checkpoints; elsewhere it arrives as KeyboardInterrupt)."""
    write_state(study, run, stage, "running")
    try:
        result = fn(*args, **kwargs)
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


# -- train ---------------------------------------------------------------------------------------------

def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / SUMMARY).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# the settings that make two runs the same run (the budget aside): a run directory whose recorded config differs in
# any of them holds another run
RUN_IDENTITY = ("arch", "model", "optim", "train.seq_len", "train.global_batch_tokens", "train.seed", "train.doc_reset")
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
    for src, name in ((plan.run_dir, "run"), (eval_dir(study, plan.name), "eval")):
        if src.exists():
            shutil.move(str(src), str(dest / name))
    for stage in (EXPORT, EVALUATE):
        rec = state_path(study, plan.name, stage)
        if rec.exists():
            (dest / "state").mkdir(exist_ok=True)
            shutil.move(str(rec), str(dest / "state" / rec.name))
    log(f"[study] {plan.name}: {plan.run_dir} held {why}; moved to {dest}, training afresh")
    return dest


def train_done(plan: RunPlan) -> bool:
    s = read_summary(plan.run_dir)
    return bool(s) and s.get("stop") == "finished" and int(s.get("step") or 0) == plan.steps \
        and run_change(plan) is None


def train(study: StudyConfig, plan: RunPlan, log=print) -> dict:
    """Train (or continue) one run in this process; returns the trainer's summary."""
    why = run_change(plan)
    if why is not None:
        supersede(study, plan, why, log)
    if train_done(plan):
        log(f"[study] {plan.name}: trained ({plan.steps} steps), skipped")
        return read_summary(plan.run_dir) or {}
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    log(f"[study] {plan.name}: training to {plan.steps} steps ({plan.tokens:,} tokens), resuming if possible")
    cfg = parse_config(plan.argv + ["--resume", "auto"])
    trainer = Trainer(cfg)
    try:
        summary = trainer.fit()
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
    if "valid_loss" in e.tasks and not (out / VALID_TOKENS).is_file():
        import numpy as np

        from data_pipeline import build_loader
        loader = build_loader(study.data, study.seq_len, 1, 1, split="val", seed=0)
        windows = []
        for _ in range(e.valid_windows):
            b = loader.next_batch()
            windows.append(np.concatenate([b["input_ids"][0].numpy(), b["targets"][0, -1:].numpy()]))
        tmp = out / (VALID_TOKENS + ".tmp")
        np.concatenate(windows).astype(np.uint32).tofile(tmp)
        tmp.rename(out / VALID_TOKENS)
        log(f"[study] validation: {e.valid_windows} windows of {study.seq_len + 1} tokens from the held-out split "
            f"-> {out / VALID_TOKENS}")
    if e.csr == "replay" and csr_tasks(study):
        from evaluation.request_replay import read_requests, write_requests
        path = out / CSR_REQUESTS
        current = None
        if path.is_file():
            current = read_requests(path)
        if current is None or current["tasks"] != csr_tasks(study) or current["limit"] != e.limit:
            req = write_requests(path, csr_tasks(study), e.limit)
            log(f"[study] commonsense requests: {len(req['pairs']):,} (context, continuation) pairs for "
                f"{', '.join(req['tasks'])} at limit {e.limit} -> {path}")


# raw files each task reads on the evaluating machine (evaluation.local_data.EVAL_FILES keys)
TASK_FILES = {"wikitext2": ("wikitext2_test",), "lambada_openai": ("lambada_openai",), "piqa": ("piqa", "piqa_labels"),
              "siqa": ("siqa", "siqa_labels"), "arc_easy": ("arc_easy",), "arc_challenge": ("arc_challenge",),
              "boolq": ("boolq",), "openbookqa": ("openbookqa",), "winogrande": ("winogrande",),
              "hellaswag": ("hellaswag",)}


def evaluation_problems(study: StudyConfig) -> list[str]:
    """What the evaluate stage would miss on this machine (data files, lm-eval), found before any training:
    an evaluation that fails after hours of training is the costly way to learn it."""
    import importlib.util

    from evaluation import local_data
    e = study.evaluation
    replay = e.csr == "replay"
    here = [t for t in e.tasks if not (replay and t in csr_tasks(study))]
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


def evaluate(study: StudyConfig, plan: RunPlan, log=print) -> list[dict]:
    """Evaluate the run's exports; returns the sweep's rows (one per snapshot)."""
    from evaluation.sweep import sweep
    check_evaluation(study)
    e = study.evaluation
    replay = e.csr == "replay"
    tasks = [t for t in e.tasks if not (replay and t in csr_tasks(study))]
    if "valid_loss" in tasks and not (eval_dir(study) / VALID_TOKENS).is_file():
        raise FileNotFoundError(f"{eval_dir(study) / VALID_TOKENS} is missing: run `launch/study.py plan` (or run) "
                                f"where the data is, before evaluating")
    rows = sweep(sweep_config(study, plan.run_dir, tasks)) if tasks else []
    if replay and csr_tasks(study):
        score_csr(study, plan, log)
    return rows


def score_csr(study: StudyConfig, plan: RunPlan, log=print) -> None:
    """Scores of the study's commonsense requests for every export of the run, cached per snapshot."""
    from evaluation.request_replay import read_requests, score_requests
    from evaluation.sweep import find_snapshots, fingerprint, load_model
    req = read_requests(eval_dir(study) / CSR_REQUESTS)
    out = eval_dir(study, plan.name) / "csr_scores"
    out.mkdir(parents=True, exist_ok=True)
    cfg = sweep_config(study, plan.run_dir, ["valid_loss"])
    for snap in find_snapshots([str(plan.run_dir)]):
        key = {"requests": req["sha256"], "weights": fingerprint(snap["path"]), "window": scoring_window(study)}
        path = out / f"{snap['snapshot']}.json"
        if path.is_file() and json.loads(path.read_text()).get("key") == key:
            continue
        t0 = time.time()
        model = load_model(snap, cfg, [])
        scores = score_requests(model, req, scoring_window(study), study.evaluation.batch_size)
        del model
        rec = {"key": key, "snapshot": {k: snap[k] for k in ("run", "snapshot", "arch", "size", "step", "tokens",
                                                               "flops")}, "scores": scores}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.rename(path)
        log(f"    {snap['snapshot']}: {len(scores):,} commonsense requests scored ({time.time() - t0:.1f}s)")

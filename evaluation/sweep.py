"""Evaluate every exported snapshot of one or more runs: `python launch/evaluate.py RUN_DIR... --suite paper`.

Snapshots are RUN/exports/*/ (each loadable by models.load_pretrained, config.json holding step, tokens,
flops) or export directories given directly. Each (snapshot, task) result is cached as JSON under
OUT/cache/<run>/<snapshot>/<task>.json together with the settings and the snapshot's fingerprint (size and
mtime of its weights), so a rerun skips finished work and redoes only what changed. The table is written
as OUT/results.csv and OUT/results.json, with one plot per metric against C (PFLOP-days) and against tokens
under OUT/plots/ (metrics with at least two snapshots of a run), and NIAH heatmaps under OUT/niah/.
"""
from __future__ import annotations

import csv
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from checkpoints.atomic import atomic_write_text, make_output_dir
from checkpoints.layout import EVAL, EXPORTS, MODEL_CONFIG, MODEL_WEIGHTS, TMP_SUFFIX, TRASH_SUFFIX, parse_step
from evaluation.context import scoring_window, training_context
from pretrain.argtypes import positive_int, ranged
from pretrain.cli import option
from pretrain.logs import get_logger

logger = get_logger(__name__)

CSR_TASKS = ("boolq", "piqa", "siqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# the metric the paper reports for each commonsense task
CSR_METRIC = {"boolq": "acc", "piqa": "acc", "siqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc",
              "arc_easy": "acc", "arc_challenge": "acc_norm", "openbookqa": "acc_norm"}
# the paper's CSR average (its Table 4 "CSR avg") is over these seven: SIQA is evaluated but not averaged
CSR_AVG_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# lm-eval's SCROLLS tasks: they download tau/scrolls from the HF hub, so they run only where it is reachable
SCROLLS_TASKS = ("scrolls_qasper", "scrolls_quality", "scrolls_narrativeqa", "scrolls_qmsum",
                 "scrolls_contractnli", "scrolls_govreport", "scrolls_summscreenfd")
# each SCROLLS task's score as the SCROLLS benchmark reports it: F1, exact match, or for the summarization
# tasks the geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L (`scrolls_score`)
SCROLLS_METRIC = {"scrolls_qasper": "f1", "scrolls_narrativeqa": "f1", "scrolls_quality": "em",
                  "scrolls_contractnli": "em", "scrolls_qmsum": "rouge_gm", "scrolls_govreport": "rouge_gm",
                  "scrolls_summscreenfd": "rouge_gm"}
SWEEP_DTYPES = ("auto", "float32", "bfloat16")  # --dtype (auto: bfloat16 on a GPU, float32 on the CPU)
COUNTS = {"examples", "documents", "words", "bytes", "tokens", "windows", "loglikelihood", "window",
          "truncated"}  # table only, not plotted
SUITES = {
    "quick": ("wikitext2", "lambada_openai"),
    "paper": ("wikitext2", "lambada_openai", *CSR_TASKS, "niah_easy", "niah_standard", *SCROLLS_TASKS),
}


TASKS = tuple(sorted(set(SUITES["paper"]) | {"valid_loss"}))  # what --tasks accepts: the paper suite, held-out loss


@dataclass
class SweepConfig:
    """The sweep's settings; launch/evaluate.py derives its command line from these fields (pretrain.cli)."""
    runs: list[str] = option(positional=True, help="run directories (with exports/*/) or export directories")
    suite: str = option("quick", choices=sorted(SUITES))
    tasks: list[str] | None = option(None, choices=TASKS, metavar="TASK",
                                     help=f"instead of the suite, any of: {' '.join(TASKS)}")
    out: str | None = option(None, help="results folder (default: <first run>/eval)")
    device: str = option("auto")
    dtype: str = option("auto", choices=list(SWEEP_DTYPES))
    batch_size: int = option(8, type=positive_int)
    limit: int | None = option(None, type=positive_int,
                               help="examples per task (smoke runs; documents for WikiText-2)")
    max_length: int | None = option(None, type=ranged(int, ge=2),
                                    help="scoring window (default: each snapshot's training context)")
    niah_lengths: list[int] = option(factory=lambda: [1024, 2048, 4096, 6144, 8192, 10240, 12288, 14336, 16384],
                                     type=positive_int)
    niah_depths: list[float] = option(factory=lambda: [float(d) for d in range(0, 101, 10)],
                                      type=ranged(float, ge=0, le=100), help="needle depths in percent of the haystack")
    niah_trials: int = option(1, type=positive_int)
    niah_scoring: str = option("exact", choices=["exact", "partial"],
                               help="exact: a reply scores 10 only with the exact value, else 1; partial: credit "
                                    "per correct leading digit (docs/evaluation.md)")
    niah_threshold: float = option(5.5, type=ranged(float, ge=1, le=10),
                                   help="a cell succeeds when its mean score >= this (for the NIAH score's penalty)")
    niah_haystack: list[str] = option(factory=list, help="text files (default: Gutenberg books)")
    valid_shards: list[str] = option(factory=list, help="held-out data for the task valid_loss: a dataset folder "
                                     "of launch/prepare_data.py (its val split) or uint32 token files (globs)")
    valid_seq_len: int = option(2048, type=positive_int)
    valid_windows: int = option(256, type=positive_int)
    force: bool = option(False, help="ignore cached results")
    # metric plots; off where tables of many sweeps are merged later (set by code, no flag)
    plots: bool = option(True, cli=False)


# -- discovery --------------------------------------------------------------------------------------------

def is_export(path: Path) -> bool:
    return (path / MODEL_CONFIG).is_file() and (path / MODEL_WEIGHTS).is_file()


def run_dir_of(path: Path) -> Path:
    """The run directory of a path given on the command line: an export's run (RUN/exports/step_N -> RUN;
    an export elsewhere: its parent folder), or the path itself."""
    if is_export(path):
        return path.parent.parent if path.parent.name == EXPORTS else path.parent
    return path


def find_snapshots(paths: list[str], keep_damaged: bool = False) -> list[dict]:
    """One record per exported snapshot (run name, path, arch, size, step, tokens, flops), in step order. An export
    whose config.json does not parse (cut short) is an error, or with `keep_damaged` a record holding `error` (what
    is wrong and the command that exports it again), named in a warning: the sweep reports it in its table and
    evaluates the others."""
    found, seen = [], set()
    for p in map(Path, paths):
        run_dir = run_dir_of(p)
        run = run_dir.resolve().name  # `evaluate.py .` inside a run: its folder's name
        if is_export(p):
            exports = [p]
        else:
            # not hidden folders, nor an export being written or removed (*.tmp, *.trash)
            entries = sorted(d for d in (p / EXPORTS).glob("*") if d.is_dir() and not d.name.startswith(".")
                             and not d.name.endswith((TMP_SUFFIX, TRASH_SUFFIX)))
            exports = [e for e in entries if is_export(e)]
            for e in entries:
                if not is_export(e):  # exports are published whole, so this one was damaged or copied in part
                    missing = " and ".join(f for f in (MODEL_CONFIG, MODEL_WEIGHTS) if not (e / f).is_file())
                    step = parse_step(e.name)
                    logger.warning(f"{e}: not an export (no {missing}); skipped. Export that step again (launch/"
                                   f"export.py {p} --step {step if step is not None else 'N'} --force) or remove it")
            if not exports:
                raise FileNotFoundError(f"{p}: neither an export directory (config.json + model.safetensors) "
                                        f"nor a run directory with exports/*/ (run launch/export.py first)")
        for e in exports:
            if e.resolve() in seen:  # one export reached twice (a run and one of its exports, a symlink)
                continue
            seen.add(e.resolve())
            try:
                meta = json.loads((e / MODEL_CONFIG).read_text())
            except ValueError as err:
                step = parse_step(e.name)
                msg = (f"{e / MODEL_CONFIG}: not valid JSON ({err}); export that step again (launch/export.py "
                       f"{run_dir if e.parent.name == EXPORTS else 'RUN'} --step {step if step is not None else 'N'} "
                       f"--force) or leave it out")
                if not keep_damaged:
                    raise ValueError(msg) from None
                logger.warning(f"{msg}; the other snapshots are evaluated")
                found.append({"run": run, "run_dir": str(run_dir.resolve()), "snapshot": e.name,
                              "path": str(e.resolve()), "arch": None, "size": None, "step": step, "tokens": None,
                              "flops": None, "flops_non_embedding": None, "train_seq_len": None,
                              "max_seq_len": None, "n_params": None, "error": msg})
                continue
            model = meta.get("model") if isinstance(meta, dict) else None
            if not isinstance(model, dict):
                raise ValueError(f"{e / MODEL_CONFIG}: no \"model\" section, so not an export of launch/export.py "
                                 f"(a Hugging Face model folder?); give directories written by launch/export.py")
            found.append({"run": run, "run_dir": str(run_dir.resolve()),
                          "snapshot": e.name, "path": str(e.resolve()), "arch": model.get("arch"),
                          "size": model.get("size"), "step": meta.get("step"), "tokens": meta.get("tokens"),
                          "flops": meta.get("flops"), "flops_non_embedding": meta.get("flops_non_embedding"),
                          "train_seq_len": training_context(e), "max_seq_len": model.get("max_seq_len"),
                          "n_params": _n_params(model)})
    _distinct_run_names(found)
    found.sort(key=lambda r: (r["run"], r["step"] if r["step"] is not None else -1, r["snapshot"]))
    return found


def _distinct_run_names(found: list[dict]) -> None:
    """Two runs of one name in different folders (/a/tnl, /b/tnl) are two runs: their names take as many
    parent folders as it takes to tell them apart (a/tnl, b/tnl), in the tables, plots and cache."""
    dirs: dict[str, set[str]] = {}
    for r in found:
        dirs.setdefault(r["run"], set()).add(r["run_dir"])
    for name, paths in dirs.items():
        if len(paths) < 2:
            continue
        parts = {d: Path(d).parts for d in paths}
        depth = 2
        while depth < max(map(len, parts.values())) and \
                len({"/".join(v[-depth:]) for v in parts.values()}) < len(paths):
            depth += 1
        label = {d: "/".join(v[-depth:]) for d, v in parts.items()}
        for r in found:
            if r["run"] == name:
                r["run"] = label[r["run_dir"]]


def _n_params(model: dict) -> int | None:
    """Non-embedding parameters (the paper's formula) of an export's model config, for ordering sizes."""
    try:
        from models import ModelConfig, paper_non_embedding_params
        return int(paper_non_embedding_params(ModelConfig.from_dict(model)))
    except Exception:  # an unknown config only loses its place in the legend order
        return None


def fingerprint(export: str) -> dict:
    st = (Path(export) / MODEL_WEIGHTS).stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def matched_files(patterns: list[str]) -> list[str]:
    """The files a list of globs matches now, sorted, each once: a file matched by two patterns (`val/*.bin
    val/shard0.bin`, or one spelt two ways) is read once, or its tokens would weigh twice in the mean."""
    seen, out = set(), []
    for f in sorted({f for pat in patterns for f in glob.glob(pat)}):
        if not os.path.isfile(f):  # a folder a pattern also matches (`val/*` with val/old/ in it) holds no tokens
            continue
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def _files_key(patterns: list[str]) -> list:
    """The files a list of globs matches now, each with size and mtime: a result over them is stale when a
    file is added, removed or rewritten."""
    return _stat_key(matched_files(patterns))


def _stat_key(files: list[str]) -> list:
    """[file, size, mtime] of each file, in the order given (None, None for one that is gone)."""
    out = []
    for f in files:
        try:
            st = Path(f).stat()
        except OSError:
            out.append([f, None, None])
            continue
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


def _valid_key(entries: list[str]) -> list:
    """The held-out data of --valid-shards as it is now: token files with size and mtime, and for a prepared
    dataset the digest of its val split's meta.json (sources, token counts, document order)."""
    from evaluation.perplexity import is_prepared_dataset
    out = []
    for d in entries:
        if is_prepared_dataset(d):
            meta = Path(d) / "val" / "meta.json"
            meta = meta if meta.is_file() else Path(d) / "meta.json"
            out.append([str(Path(d).resolve()), hashlib.sha256(meta.read_bytes()).hexdigest()[:16]])
    return out + _files_key([d for d in entries if not is_prepared_dataset(d)])


@functools.lru_cache(maxsize=256)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def file_digest(path: str | Path) -> str | None:
    """A digest of a file's content (None when it does not exist): the same file copied or moved elsewhere keeps
    it, an edited, cut or replaced one does not."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return _digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def data_key(task: str, cfg: SweepConfig) -> dict:
    """The content of the evaluation data a task reads now ({file name: digest}): a cached result is stale when
    $LINSCALE_SHARED_DATA points at another copy of the data, or a file was repaired or replaced."""
    from evaluation import local_data
    if task.startswith("niah_") and not cfg.niah_haystack:
        return {f.name: file_digest(f) for f in local_data.haystack_files()}
    base = local_data.shared_data_dir() / "eval"
    return {local_data.EVAL_FILES[n]: file_digest(base / local_data.EVAL_FILES[n])
            for n in local_data.TASK_FILES.get(task, ())}


def same_key(cached: dict | None, key: dict) -> bool:
    """Whether a cached result's key matches. A result cached before the data's digest was part of the key
    (no settings.data) matches on everything else: it is not redone on the mere upgrade. Validation files
    (settings.shards) match by name, size and time, or digest, wherever they are (`_moved`)."""
    if not isinstance(cached, dict):
        return False
    settings = cached.get("settings")
    if isinstance(settings, dict) and "data" not in settings:
        key = {**key, "settings": {k: v for k, v in key["settings"].items() if k != "data"}}
    if isinstance(settings, dict) and _moved(settings.get("shards"), key["settings"].get("shards")):
        key = {**key, "settings": {**key["settings"], "shards": settings["shards"]}}
    return cached == key


def _moved(cached, now) -> bool:
    """Whether two validation-file keys (`_valid_key`) name the same files at other paths: each entry of the
    same file name and the same size and time (a token file) or digest (a prepared dataset's meta), as a
    study copied or moved with its files' times kept (rsync -a, cp -a) holds them."""
    if not (isinstance(cached, list) and isinstance(now, list)) or len(cached) != len(now) or cached == now:
        return False
    return all(isinstance(a, list) and isinstance(b, list) and len(a) == len(b) >= 2
               and Path(str(a[0])).name == Path(str(b[0])).name and a[1:] == b[1:] and None not in b[1:]
               for a, b in zip(cached, now))


def key_changes(cached: dict | None, key: dict) -> list[tuple[str, object, object]]:
    """(setting, cached value, value now) for each setting of `key` (cache_key) that a cached result's key
    differs in, "weights" for the weights' fingerprint; [] when the cached result is current (same_key)."""
    if same_key(cached, key):
        return []
    if not isinstance(cached, dict) or not isinstance(cached.get("settings"), dict):
        return [("key", cached, key)]
    old, new = cached["settings"], key["settings"]
    names = [k for k in new if k != "data" or "data" in old] + [k for k in old if k not in new]
    out = [(k, old.get(k), new.get(k)) for k in names if old.get(k) != new.get(k)]
    if cached.get("weights") != key.get("weights"):
        out.append(("weights", cached.get("weights"), key.get("weights")))
    return out or [("key", cached, key)]


# -- the per-(snapshot, task) cache -----------------------------------------------------------------------

def cache_path(out: Path, snap: dict, task: str) -> Path:
    return Path(out) / "cache" / snap["run"] / snap["snapshot"] / f"{task}.json"


def cache_key(task: str, snap: dict, cfg: SweepConfig, window: int | None = None, dtype: str | None = None,
              weights: dict | None = None) -> dict:
    """What a cached (snapshot, task) result was made with: the task's settings (task_settings) and the
    snapshot's weights (`weights`: its fingerprint, read from the export when not given). The one definition
    of a result's identity: the sweep reuses a result only under an equal key, and a study's status and
    report count and show only such results."""
    return {"settings": task_settings(task, cfg, window, dtype),
            "weights": weights if weights is not None else fingerprint(snap["path"])}


def read_cache(path: Path) -> dict | None:
    """A cache entry ({key, metrics, seconds}), or None where there is none or it is damaged (a miss, not the
    end of the sweep)."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("metrics"), dict) else None


def write_cache(path: Path, key: dict, metrics: dict, seconds: float) -> None:
    """Written whole or not at all (a temporary file renamed): a sweep stopped or killed mid-write leaves no
    half-written entry to be read as a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "metrics": metrics, "seconds": seconds}, indent=1))


# -- tasks ------------------------------------------------------------------------------------------------

def scoring_window_of(snap: dict, cfg: SweepConfig, warn=None) -> int:
    """--max-length, else the snapshot's training context, else its config's max_seq_len (with a warning)."""
    return scoring_window(snap["path"], snap.get("max_seq_len") or 8192, cfg.max_length, warn=warn)


def run_dtype(cfg: SweepConfig) -> str:
    """The dtype the models run in ('auto' resolved for the device), e.g. 'bfloat16'."""
    from evaluation.devices import resolve_device, resolve_dtype
    return str(resolve_dtype(cfg.dtype, resolve_device(cfg.device))).removeprefix("torch.")


def task_settings(task: str, cfg: SweepConfig, window: int | None = None, dtype: str | None = None) -> dict:
    """Everything a cached result depends on besides the weights (`window`: the resolved scoring window;
    `dtype`: run_dtype(cfg), computed here when not given): the dtype the model runs in, and the input
    files as they are now (not only their patterns)."""
    s = {"task": task, "limit": cfg.limit, "max_length": window if window is not None else cfg.max_length,
         "dtype": dtype or run_dtype(cfg), "data": data_key(task, cfg)}
    if task.startswith("niah_"):
        # the haystack files in the order given: their text laid end to end, so another order is another haystack
        s.update(lengths=cfg.niah_lengths, depths=cfg.niah_depths, trials=cfg.niah_trials,
                 haystack=_stat_key(cfg.niah_haystack), scoring=cfg.niah_scoring, threshold=cfg.niah_threshold,
                 placement="token_depth")
        if cfg.niah_trials > 1:
            # results keyed without cell_mean averaged the trials as a running sum of s/trials, which can land
            # an ulp below the threshold (one trial alone is the same either way)
            s["cell_mean"] = "fsum"
    if task == "valid_loss":
        # scored on windows of valid_seq_len, all of them up to valid_windows: --limit and the scoring window of
        # the other tasks do not change it, so changing them must not throw its results away
        del s["limit"], s["max_length"]
        s.update(shards=_valid_key(cfg.valid_shards), seq_len=cfg.valid_seq_len, windows=cfg.valid_windows)
    return s


def niah_config(task: str, cfg: SweepConfig):
    """The NIAH settings of task niah_easy / niah_standard under the sweep's flags."""
    from evaluation.niah import NiahConfig
    return NiahConfig(mode=task.removeprefix("niah_"), lengths=tuple(cfg.niah_lengths), depths=tuple(cfg.niah_depths),
                      trials=cfg.niah_trials, haystack=tuple(cfg.niah_haystack), batch_size=cfg.batch_size,
                      scoring=cfg.niah_scoring, threshold=cfg.niah_threshold)


def run_tasks(tasks: list[str], model, snap: dict, cfg: SweepConfig, out: Path) -> dict[str, dict]:
    """Metrics (a flat dict of numbers, plus detail) for each task, run on an already loaded model."""
    from evaluation import perplexity
    results: dict[str, dict] = {}
    window = scoring_window_of(snap, cfg)
    lm_eval_tasks = [t for t in tasks if t in CSR_TASKS or t in SCROLLS_TASKS]
    for t in tasks:
        if t == "wikitext2":
            results[t] = perplexity.wikitext_perplexity(model, max_length=window, batch_size=cfg.batch_size,
                                                        limit=cfg.limit)
            results[t]["window"] = window
        elif t == "lambada_openai":
            results[t] = perplexity.lambada_openai(model, max_length=window, batch_size=cfg.batch_size,
                                                   limit=cfg.limit)
            results[t]["window"] = window
        elif t == "valid_loss":
            datasets = [d for d in cfg.valid_shards if perplexity.is_prepared_dataset(d)]
            files = matched_files([pat for pat in cfg.valid_shards if pat not in datasets])
            windows = itertools.chain(*(perplexity.prepared_val_windows(d, cfg.valid_seq_len) for d in datasets),
                                      perplexity.token_windows(files, cfg.valid_seq_len + 1))
            first = next(windows, None)
            if first is None:
                held = " and ".join(([f"the val split of the {len(datasets)} prepared dataset(s)"] if datasets else [])
                                    + ([f"the {len(files)} file(s) matched"] if files else []))
                raise ValueError(f"--valid-shards {' '.join(cfg.valid_shards)}: {held} hold no window of "
                                 f"--valid-seq-len {cfg.valid_seq_len} + 1 tokens (each file is cut into whole "
                                 f"windows); pass a smaller --valid-seq-len or more held-out data")
            results[t] = perplexity.validation_loss(model, itertools.chain([first], windows), cfg.batch_size,
                                                    cfg.valid_windows)
        elif t.startswith("niah_"):
            from evaluation import niah
            res = niah.run_niah(model, niah_config(t, cfg), progress=lambda msg: logger.info(f"    {msg}"))
            png = niah.plot_heatmap(res, out / "niah" / snap["run"] / f"{snap['snapshot']}_{t}.png",
                                    title=f"{snap['run']} {snap['snapshot']} {t}")
            m = res["metrics"]
            results[t] = {"acc_avg": m["acc_avg"], "weighted_avg_acc": m["weighted_avg_acc"],
                          "niah_score": m["niah_score"], "heatmap": str(png), "detail": res}
    if lm_eval_tasks:
        results.update(run_lm_eval(model, lm_eval_tasks, cfg, window))
    return results


def run_lm_eval(model, tasks: list[str], cfg: SweepConfig, window: int | None = None, lm=None,
                task_manager=None) -> dict[str, dict]:
    """The commonsense tasks (local configs) and SCROLLS through lm-eval, with the adapter around the
    loaded model (or `lm`, an lm-eval model given instead, and `task_manager`, one that keeps built tasks:
    evaluation.request_replay records and replays requests through them). A task whose data cannot be had
    is reported with its error and not cached."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evaluation.lm_eval_adapter import LinscaleLM, tasks_dir
    if lm is None:
        lm = LinscaleLM(model=model, batch_size=cfg.batch_size, max_length=window or cfg.max_length)
    tm = task_manager or TaskManager(include_path=str(tasks_dir()))
    names = {t: (f"{t}_local" if t in CSR_TASKS else t) for t in tasks}
    out: dict[str, dict] = {}
    runnable = []
    for t, name in names.items():  # SCROLLS fails offline at download: keep it from sinking the others
        try:
            if t in SCROLLS_TASKS:
                tm.load_task_or_group([name])
            runnable.append(t)
        except Exception as err:  # noqa: BLE001  (any download/config failure means "unavailable")
            out[t] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    if runnable:
        res = lm_eval.simple_evaluate(model=lm, tasks=[names[t] for t in runnable], limit=cfg.limit,
                                      task_manager=tm, num_fewshot=0, log_samples=False)
        for t in runnable:
            r = res["results"].get(names[t], {})
            metrics = {k.split(",")[0]: v for k, v in r.items()
                       if "," in k and "stderr" not in k and isinstance(v, (int, float))}
            if t in CSR_METRIC:
                metrics["paper"] = metrics.get(CSR_METRIC[t])
            if t in SCROLLS_METRIC:
                metrics.update(scrolls_score(t, metrics))
            truncated = getattr(lm, "truncated", None)
            if isinstance(truncated, dict) and t in CSR_METRIC:
                # items whose context was cut from the left to fit the window (lm-eval's truncation)
                metrics["truncated"] = len(truncated.get(names[t], ()))
            out[t] = metrics
    return out


def scrolls_score(task: str, metrics: dict) -> dict:
    """The SCROLLS benchmark's score of `task` from lm-eval's metrics: {'scrolls': F1 or exact match as
    given}, and for GovReport, SummScreenFD and QMSum also 'rouge_gm', the geometric mean of ROUGE-1, ROUGE-2
    and ROUGE-L, which SCROLLS reports for them (0 where one of the three is 0). {} where the metric it needs
    is missing."""
    out = {}
    if SCROLLS_METRIC[task] == "rouge_gm":
        parts = [metrics.get(k) for k in ("rouge1", "rouge2", "rougeL")]
        if any(not isinstance(p, (int, float)) for p in parts):
            return {}
        out["rouge_gm"] = 0.0 if min(parts) <= 0 else math.prod(parts) ** (1 / 3)
    value = out.get("rouge_gm", metrics.get(SCROLLS_METRIC[task]))
    if isinstance(value, (int, float)):
        out["scrolls"] = value
    return out


# -- the sweep ------------------------------------------------------------------------------------------

def check_task_data(tasks: list[str], cfg: SweepConfig) -> None:
    """The files each task reads exist, checked before any model is loaded: a missing evaluation file or
    haystack is named at once, not after the first snapshot's earlier tasks have run."""
    from evaluation import local_data
    from evaluation.niah import default_haystack_files
    for t in tasks:
        for name in local_data.TASK_FILES.get(t, ()):
            local_data.eval_path(name)      # FileNotFoundError naming the file and $LINSCALE_SHARED_DATA
    if any(t.startswith("niah_") for t in tasks):
        if not cfg.niah_haystack:
            default_haystack_files()
        for f in cfg.niah_haystack:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"--niah-haystack {f}: {'a folder' if os.path.isdir(f) else 'no such file'}; "
                                        f"give text files (plain or .gz), or leave the flag out for the Gutenberg "
                                        f"books of the shared data folder")


def load_model(snap: dict, cfg: SweepConfig, tasks: list[str]):
    from evaluation.devices import resolve_device, resolve_dtype
    from models import load_pretrained
    device = resolve_device(cfg.device)
    overrides = {}
    need = max(cfg.niah_lengths) + 64 if any(t.startswith("niah_") for t in tasks) else 0
    if "valid_loss" in tasks:
        need = max(need, cfg.valid_seq_len)
    if any(t in ("wikitext2", "lambada_openai") or t in CSR_TASKS or t in SCROLLS_TASKS for t in tasks):
        need = max(need, scoring_window_of(snap, cfg))
    meta = json.loads((Path(snap["path"]) / MODEL_CONFIG).read_text())
    if need > meta["model"].get("max_seq_len", 0):
        overrides["max_seq_len"] = need  # LLaMA's RoPE table must cover the longest input the tasks feed
    return load_pretrained(snap["path"], device=device, dtype=resolve_dtype(cfg.dtype, device), **overrides)


def check_vocab(snap: dict, tasks: list[str]) -> None:
    """Text tasks feed the tokenizer's ids: a model with a smaller vocabulary (a toy or synthetic-data
    model) cannot take them; say so before loading it rather than at its first forward."""
    text = [t for t in tasks if t != "valid_loss"]
    if not text:
        return
    from data_pipeline.tokenizer import get_tokenizer
    vocab = json.loads((Path(snap["path"]) / MODEL_CONFIG).read_text())["model"].get("vocab_size")
    n_vocab = get_tokenizer().n_vocab
    if vocab is not None and vocab < n_vocab:
        raise ValueError(f"{snap['path']}: the model's vocab_size {vocab} is smaller than the tokenizer's {n_vocab:,} "
                         f"ids, so the text tasks {', '.join(text)} cannot run on it; evaluate it with --tasks "
                         f"valid_loss --valid-shards (token files of its own vocabulary)")


class SweepStopped(RuntimeError):
    """The sweep ended early because `stop` asked it to; the (snapshot, task) results it finished are cached,
    and a sweep started again does only the rest."""


def _check_stop(stop: Callable[[], str | None] | None, where: str) -> None:
    reason = stop() if stop is not None else None
    if reason:
        raise SweepStopped(f"evaluation stopped ({reason}) {where}")


def sweep(cfg: SweepConfig, stop: Callable[[], str | None] | None = None) -> list[dict]:
    """Evaluate every snapshot (rows of the table, one per snapshot). `stop`, asked before each snapshot and
    each task, returns why to stop (a signal, a deadline) or None: the sweep then raises SweepStopped at once,
    its finished results cached and no table written (the previous one stays until a sweep completes)."""
    tasks = list(cfg.tasks or SUITES[cfg.suite])
    if cfg.valid_shards and "valid_loss" not in tasks:
        tasks.insert(0, "valid_loss")
    unknown = [t for t in tasks if t not in {"wikitext2", "lambada_openai", "valid_loss", "niah_easy",
                                              "niah_standard", *CSR_TASKS, *SCROLLS_TASKS}]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}")
    if any(t.startswith("niah_") for t in tasks):
        from evaluation.niah import SCORINGS, check_lengths
        if cfg.niah_scoring not in SCORINGS:
            raise ValueError(f"--niah-scoring {cfg.niah_scoring!r}; choose one of {SCORINGS}")
        for t in tasks:     # before any model is loaded: the grid, and each length holds the needle and question
            if t.startswith("niah_"):
                check_lengths(niah_config(t, cfg))
    from evaluation.perplexity import is_prepared_dataset
    datasets = [d for d in cfg.valid_shards if is_prepared_dataset(d)]
    if "valid_loss" in tasks and not datasets and not matched_files(cfg.valid_shards):
        folders = [pat for pat in cfg.valid_shards if os.path.isdir(pat)]
        raise ValueError("task valid_loss needs held-out data: pass --valid-shards with a dataset folder written by "
                         "launch/prepare_data.py (its val split) or flat uint32 token files (globs), e.g. a study's "
                         "eval/valid_tokens.bin"
                         + (f"; {folders[0]} is a folder but not a prepared dataset (no val/meta.json): give the "
                            f"token files in it, e.g. '{Path(folders[0]) / '*.bin'}'" if folders
                            else f"; nothing matches {' '.join(cfg.valid_shards)}" if cfg.valid_shards else ""))
    dtype = run_dtype(cfg)  # also checks --device before anything is loaded
    snaps = find_snapshots(cfg.runs, keep_damaged=True)
    # the default out is in the first run given
    out = Path(cfg.out) if cfg.out else (run_dir_of(Path(cfg.runs[0])) / EVAL if cfg.runs else Path(EVAL))
    make_output_dir(out, f"--out {out}" if cfg.out else f"the results folder {out} (default: <first run>/eval)")
    for snap in snaps:      # a model that cannot take the text tasks at all is the first thing to say
        if not snap.get("error"):
            check_vocab(snap, tasks)
    check_task_data(tasks, cfg)
    logger.info(f"evaluating {len(snaps)} snapshot(s) x {len(tasks)} task(s) -> {out}")
    rows = []
    for n, snap in enumerate(snaps, 1):
        label = f"[{n}/{len(snaps)}] {snap['run']}/{snap['snapshot']} (step {snap['step']})"
        _check_stop(stop, f"before {label}")
        if snap.get("error"):   # a damaged export: its row says why it has no numbers
            logger.warning(f"{label}: not evaluated, its config.json is damaged (warned above)")
            rows.append({**snap, "results": {t: {"error": snap["error"]} for t in tasks}})
            continue
        rows.append({**snap, "results": _sweep_snapshot(snap, tasks, cfg, out, dtype, label, stop)})
    write_tables(rows, tasks, out)
    if cfg.plots:
        plot_metrics(rows, out)
    return rows


def _sweep_snapshot(snap: dict, tasks: list[str], cfg: SweepConfig, out: Path, dtype: str, label: str,
                    stop: Callable[[], str | None] | None) -> dict[str, dict]:
    """One snapshot's results: the cached ones of the same key, the others run (and cached) in turn."""
    try:
        fp = fingerprint(snap["path"])
    except OSError as err:   # gone since the sweep found it: reported in its row, the other snapshots go on
        msg = (f"cannot read {snap['path']}: {err.strerror or err} (removed or replaced since the sweep started); "
               f"evaluate it again when it is back (launch/export.py RUN --step {snap['step']} --force exports it)")
        logger.warning(f"{label}: {msg}; skipped")
        return {t: {"error": msg} for t in tasks}
    window = scoring_window_of(snap, cfg, warn=logger.warning)
    cached, todo = {}, []
    for t in tasks:
        rec = None if cfg.force else read_cache(cache_path(out, snap, t))
        if rec is not None and same_key(rec.get("key"), cache_key(t, snap, cfg, window, dtype, fp)):
            cached[t] = rec["metrics"]
        else:
            todo.append(t)
    logger.info(f"{label}: {len(cached)} cached, {len(todo)} to run {todo if todo else ''}")
    if not todo:
        return cached
    t0 = time.time()
    try:
        model = load_model(snap, cfg, todo)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001  (a damaged export must not sink the other snapshots)
        msg = f"cannot load {snap['path']}: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
        logger.warning(f"{label}: {msg}; skipped (export that step again: launch/export.py RUN "
                       f"--step {snap['step']} --force)")
        return {**cached, **{t: {"error": msg} for t in todo}}
    for t in todo:
        _check_stop(stop, f"in {label} before {t}")
        t1 = time.time()
        try:
            res = run_tasks([t], model, snap, cfg, out).get(t, {"error": "no result"})
        except ValueError as err:
            # a check deep in the scoring code cannot say which snapshot and task it was given
            raise ValueError(f"{snap['run']}/{snap['snapshot']}, task {t}: {err}") from err
        secs = time.time() - t1
        if "error" not in res:
            write_cache(cache_path(out, snap, t), cache_key(t, snap, cfg, window, dtype, fp), res, secs)
        logger.info(f"    {t}: {short(res)} ({secs:.1f}s)")
        cached[t] = res
    del model
    logger.info(f"    done in {time.time() - t0:.1f}s")
    return cached


def short(res: dict) -> str:
    keys = [k for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return ", ".join(f"{k}={res[k]:.4g}" for k in keys[:4]) or str(res.get("error", ""))[:120]


def flat_metrics(row: dict) -> dict[str, float]:
    """task/metric -> number, numbers only (details such as NIAH cells stay in the JSON)."""
    flat = {}
    for t, res in row["results"].items():
        for k, v in res.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                flat[f"{t}/{k}"] = float(v)
    avg = csr_average({t: res.get("paper") for t, res in row["results"].items()})
    if avg is not None:
        flat["csr/avg"] = avg
    return flat


def csr_average(paper_scores: dict[str, float | None]) -> float | None:
    """The paper's CSR average: the mean of the paper's metric (CSR_METRIC) over CSR_AVG_TASKS, the seven
    tasks of its Table 4 (SIQA, also evaluated, is not part of it). None unless all seven are present."""
    vals = [paper_scores.get(t) for t in CSR_AVG_TASKS]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
        return None
    return sum(vals) / len(vals)


def row_errors(row: dict) -> str:
    """'task: error; ...' for the tasks of a snapshot that failed (an export that cannot be loaded, SCROLLS
    offline), on one line: in the CSV a failed task is otherwise only a row of empty cells, like one not run."""
    return "; ".join(f"{t}: {' '.join(str(res['error']).split())}" for t, res in row["results"].items()
                     if isinstance(res, dict) and res.get("error"))


def write_tables(rows: list[dict], tasks: list[str], out: Path) -> None:
    base = ["run", "snapshot", "arch", "size", "n_params", "step", "tokens", "flops", "flops_non_embedding", "path"]
    flats = [flat_metrics(r) for r in rows]
    cols = sorted({k for f in flats for k in f})
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(base + cols + ["errors"])
        for r, f in zip(rows, flats):
            w.writerow([r.get(b) for b in base] + [f.get(c, "") for c in cols] + [row_errors(r)])
    (out / "results.json").write_text(json.dumps({"tasks": tasks, "snapshots": rows}, indent=1, default=str))


def compute_axis(rows: list[dict]) -> tuple[str, str]:
    """The C to plot against (the key of each row) and its axis label: the paper's C (training FLOPs without
    the embedding term) when every snapshot records it, else the full count, named as such."""
    if rows and all(isinstance(r.get("flops_non_embedding"), (int, float)) for r in rows):
        return "flops_non_embedding", "C (PFLOP-days): training FLOPs without the embedding term (the paper's C)"
    return "flops", "C (PFLOP-days): training FLOPs including the embedding term"


def run_styles(rows: list[dict]) -> dict[str, dict]:
    """Legend order and look of each run in the sweep plots: runs sorted by architecture (registry
    order), then size; colour = the architecture's hue, shade light (small) to dark (large) and a marker per
    size; label = architecture, size as people write it (2.8B), run name. {run: {label, color, marker}}."""
    from models.registry import arch_order, arch_title
    from scaling.plots import SIZE_MARKERS, size_shades
    from scaling.runs import size_label
    runs = {}
    for r in sorted(rows, key=lambda r: r.get("arch") is None):   # a damaged export's row names no arch
        runs.setdefault(r["run"], (r.get("arch") or "?", r.get("n_params") or 0))
    order = sorted(runs, key=lambda run: (arch_order(runs[run][0]), runs[run][0], runs[run][1], run))
    style = {}
    for arch in {a for a, _ in runs.values()}:
        sizes = sorted({n for a, n in runs.values() if a == arch})
        for k, (n, shade) in enumerate(zip(sizes, size_shades(arch, len(sizes)))):
            style[(arch, n)] = (shade, SIZE_MARKERS[k % len(SIZE_MARKERS)])
    out = {}
    for run in order:
        arch, n = runs[run]
        color, marker = style[(arch, n)]
        out[run] = {"label": f"{arch_title(arch)} {size_label(n) if n else '?'} ({run})", "color": color,
                    "marker": marker}
    return out


def plot_metrics(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per metric and x axis (C in PFLOP-days, tokens): a line per run through its snapshots, styled by
    run_styles. Metrics no run has two snapshots of are left out: a plot of single points shows nothing a
    table does not."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scaling.plots import plain_log_ticks
    from scaling.units import flops_to_pflop_days
    flats = [flat_metrics(r) for r in rows]
    metrics = sorted({k for f in flats for k in f if k.split("/")[-1] not in COUNTS})
    c_key, c_text = compute_axis(rows)
    styles = run_styles(rows)
    order = list(styles)
    written = []
    for x, xlabel in ((c_key, c_text), ("tokens", "training tokens")):
        for m in metrics:
            series = {}
            for run in order:
                pts = sorted((flops_to_pflop_days(r[x]) if x != "tokens" else r[x], f[m])
                             for r, f in zip(rows, flats)
                             if r["run"] == run and m in f and isinstance(r.get(x), (int, float)) and r[x] > 0
                             and math.isfinite(f[m]))
                if pts:
                    series[run] = pts
            if not any(len(p) >= 2 for p in series.values()):
                continue
            # a legend of many runs goes beside the axes, where it cannot hide the lines
            outside = len(series) > 6
            fig, ax = plt.subplots(figsize=(8.5 if outside else 6, 4 if len(series) <= 24 else 5.5))
            for run, pts in series.items():
                st = styles[run]
                ax.plot(*zip(*pts), marker=st["marker"], ms=4, color=st["color"], label=st["label"])
            ax.set_xscale("log")
            if "perplexity" in m:
                ax.set_yscale("log")
                plain_log_ticks(ax, "y")
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(m)
            if outside:
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                          ncol=2 if len(series) > 24 else 1)
            else:
                ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            path = out / "plots" / f"{m.replace('/', '__')}_vs_{'compute' if x != 'tokens' else 'tokens'}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written

"""Reading training runs: a run directory's config.json + metrics.jsonl -> clean (tokens, loss) series with
compute C recomputed from the paper's FLOPs formulas (models.accounting), never read from the log, so the
embedding term can be switched in or out. The default C is the paper's: training FLOPs without the embedding
(LM-head) term, as its FLOPs table and Table 1 count them.

Rows that cannot be used are skipped and counted by reason; a bad row never stops a fit. Rows the trainer
flagged (`loss_spike`, or `skipped` for a step whose update was dropped) are left out. On request the rows of
the learning-rate warm-up (steps <= optim.warmup_steps of the run's config) are left out too: the
constant-learning-rate learning curve the fits assume starts after it."""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from models.accounting import exact_params, flops_per_step, paper_non_embedding_params
from models.config import ModelConfig
from models.registry import arch_order
from checkpoints.layout import METRICS, RUN_CONFIG

CONFIG_FILE = RUN_CONFIG
METRICS_FILE = METRICS


class RunError(ValueError):
    """A path given as a run that cannot be read as one; the message says what is missing."""


@dataclass
class Run:
    path: Path
    arch: str
    size: str | None
    cfg: ModelConfig
    seq_len: int
    n_params: int              # non-embedding, the paper's formula (models.accounting.paper_non_embedding_params)
    n_params_exact: int        # non-embedding, every parameter the model builds (exact_params)
    flops_per_token: float     # training FLOPs per token, paper formula, embedding term per include_embedding
    include_embedding: bool
    tokens: np.ndarray         # strictly increasing, > 0
    loss: np.ndarray           # finite, > 0
    skipped: dict[str, int] = field(default_factory=dict)
    warmup_tokens: float | None = None   # tokens at the end of the lr warm-up (None: the config does not say)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def label(self) -> str:
        return self.size or size_label(self.n_params)

    @property
    def compute(self) -> np.ndarray:
        """C in FLOPs at each kept row."""
        return self.tokens * self.flops_per_token

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


def size_label(n_params: float) -> str:
    """A parameter count as people write it: 85M, 334M, 2.8B, 460K."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n_params >= div:
            v = n_params / div
            return f"{v:.2g}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n_params:.0f}"


def compute_per_token(cfg: ModelConfig, seq_len: int, include_embedding: bool = False) -> float:
    """C(tokens) = flops_per_token * tokens. Per token, not per step: LLaMA's n^2 terms make it depend on seq_len."""
    return flops_per_step(cfg, 1, seq_len, include_embedding) / seq_len


def _warmup_tokens(config: dict, seq_len: int, logged_per_step: float | None = None) -> float | None:
    """optim.warmup_steps x tokens per step: as the run logged them (`logged_per_step`), else as its config
    asked (train.global_batch_tokens, or global_batch x seq_len). They differ under --allow-inexact-batch,
    where the trainer runs the nearest batch the ranks can reach (512 sequences for 480) and config.json keeps
    the request."""
    steps = (config.get("optim") or {}).get("warmup_steps")
    per_step = logged_per_step or _configured_tokens_per_step(config, seq_len)
    if not isinstance(steps, (int, float)) or isinstance(steps, bool) or not per_step:
        return None
    return float(steps) * float(per_step)


# the log's tokens per step may differ from the config's batch (--allow-inexact-batch runs the nearest batch the
# ranks can reach, a few percent off; a batch counted without padding is smaller), but not by this factor: a log
# that counts thousands, millions or billions of tokens is off by a factor of 1e3 or more
TOKENS_PER_STEP_MAX_RATIO = 100.0


def _configured_tokens_per_step(config: dict, seq_len: int) -> float | None:
    train = config.get("train") or {}
    per_step = train.get("global_batch_tokens") or (train.get("global_batch") or 0) * seq_len
    return float(per_step) if isinstance(per_step, (int, float)) and not isinstance(per_step, bool) and per_step > 0 \
        else None


def _tokens_unit_problem(path: Path, config: dict, seq_len: int, logged_per_step: float | None) -> str | None:
    """Why the log's `tokens` cannot be token counts of the configured run, else None. C is computed from them
    (FLOPs per token x tokens), so a log in billions of tokens would put every run 1e9x too low in C, and the
    fits would report coefficients off by as much without any other sign."""
    want = _configured_tokens_per_step(config, seq_len)
    if not logged_per_step or not want:
        return None
    ratio = logged_per_step / want
    if 1 / TOKENS_PER_STEP_MAX_RATIO <= ratio <= TOKENS_PER_STEP_MAX_RATIO:
        return None
    unit = next((name for name, k in (("billions", 1e-9), ("millions", 1e-6), ("thousands", 1e-3))
                 if abs(np.log10(ratio / k)) < 0.5), None)
    return (f"{path}: {METRICS_FILE} counts {logged_per_step:.4g} tokens per step (tokens / step of its rows) but "
            f"{CONFIG_FILE} trains {want:.4g} per step (train.global_batch_tokens, or global_batch x seq_len), "
            f"{ratio:.3g}x as many" + (f": its tokens look like {unit} of tokens" if unit else "")
            + "; C is computed from the logged tokens, so they must count tokens. Rewrite the log's tokens as "
            "token counts (or fix the config's batch), or leave the run out (--skip-bad)")


def _read_config(path: Path) -> tuple[ModelConfig, int, dict]:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except ValueError as err:   # not JSON, or not UTF-8 text (a binary file in its place)
        raise RunError(f"{path}: {CONFIG_FILE} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise RunError(f"{path}: {CONFIG_FILE} holds a JSON {type(config).__name__}, not an object with 'model' and "
                       f"'train' (as launch/pretrain.py writes it)")
    # the sections read below; a hand-edited file with one of them as a string or a list would otherwise end in
    # an AttributeError far from the file that caused it
    for key, example in (("train", '{"seq_len": 2048, ...}'), ("optim", '{"warmup_steps": 2000, ...}')):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise RunError(f"{path}: {CONFIG_FILE} '{key}' is a JSON {type(config[key]).__name__}, not an object "
                           f"(e.g. {example})")
    if not isinstance(config.get("model"), dict):
        raise RunError(f"{path}: {CONFIG_FILE} has no 'model' object (a ModelConfig dict)")
    try:
        cfg = ModelConfig.from_dict(config["model"])
    except (TypeError, ValueError) as err:
        raise RunError(f"{path}: {CONFIG_FILE} 'model' is not a valid ModelConfig: {err}") from err
    seq_len = (config.get("train") or {}).get("seq_len")
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise RunError(f"{path}: {CONFIG_FILE} needs train.seq_len (a positive int) to compute FLOPs per token, "
                       f"got {seq_len!r}")
    return cfg, seq_len, config


def _number(row: dict, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _object_rows(path: Path) -> Iterator[dict]:
    """The rows of a metrics.jsonl that parse as JSON objects, in order (others are passed over)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield row


def logged_tokens_per_step(path: Path) -> float | None:
    """Tokens per optimizer step as a metrics.jsonl logs them (tokens / step of its first row that has both),
    or None."""
    for row in _object_rows(path):
        tokens, step = _number(row, "tokens"), _number(row, "step")
        if tokens is not None and step and step > 0 and math.isfinite(tokens) and tokens > 0:
            return tokens / step
    return None


def read_metrics(path: Path, loss_key: str = "loss", min_tokens: float = 0.0, warmup_tokens: float | None = None
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """(tokens, loss, skipped-by-reason) from a metrics.jsonl. A resumed trainer appends and re-logs steps it had
    logged before the crash; the later log of a step wins and the earlier rows from that step on are dropped.
    Rows the trainer flagged as a loss spike or a skipped step are dropped; so are rows with tokens <=
    warmup_tokens (the warm-up), when given."""
    skipped: Counter = Counter()
    kept: list[tuple[float, float, float, str | None]] = []   # (order key, tokens, loss-or-nan, flag)
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped["unparseable line (e.g. truncated)"] += 1
            continue
        if not isinstance(row, dict):
            skipped["not a JSON object"] += 1
            continue
        tokens = _number(row, "tokens")
        if tokens is None or not math.isfinite(tokens):
            skipped["no tokens"] += 1
            continue
        step = _number(row, "step")
        key = step if step is not None else tokens
        # drop rows a resumed run logs again (same or later step than this one)
        while kept and kept[-1][0] >= key:
            kept.pop()
            skipped["superseded by a later log of the same step (resume)"] += 1
        loss = _number(row, loss_key)
        flag = ("flagged loss_spike by the trainer" if row.get("loss_spike") is True else
                "flagged skipped (no update) by the trainer" if row.get("skipped") is True else None)
        kept.append((key, tokens, math.nan if loss is None else loss, flag))

    toks, losses = [], []
    for _, tokens, loss, flag in kept:
        if flag is not None:
            skipped[flag] += 1
        elif not math.isfinite(loss):
            skipped[f"{loss_key} missing or not finite"] += 1
        elif loss <= 0:
            skipped[f"{loss_key} <= 0"] += 1
        elif tokens <= 0:
            skipped["tokens <= 0 (no compute yet)"] += 1
        elif warmup_tokens is not None and tokens <= warmup_tokens:
            skipped["in the lr warm-up (--skip-warmup)"] += 1
        elif tokens < min_tokens:
            skipped["below --skip-tokens"] += 1
        elif toks and tokens <= toks[-1]:
            skipped["tokens not increasing"] += 1
        else:
            toks.append(tokens)
            losses.append(loss)
    return np.asarray(toks, dtype=np.float64), np.asarray(losses, dtype=np.float64), dict(skipped)


def load_run(path: str | Path, include_embedding: bool = False, loss_key: str = "loss",
             min_tokens: float = 0.0, skip_warmup: bool = False) -> Run:
    path = Path(path)
    missing = [f for f in (CONFIG_FILE, METRICS_FILE) if not (path / f).is_file()]
    if missing:
        why = (f"missing {METRICS_FILE}, its loss log: a run that has not logged a step yet, or whose log was lost"
               if missing == [METRICS_FILE] else f"missing {' and '.join(missing)}")
        raise RunError(f"{path}: not a run directory ({why}); a run holds {CONFIG_FILE} and {METRICS_FILE} as written "
                       f"by launch/pretrain.py. Leave it out with --skip-bad (or give the other runs by name)")
    cfg, seq_len, config = _read_config(path)
    logged_per_step = logged_tokens_per_step(path / METRICS_FILE)
    bad_unit = _tokens_unit_problem(path, config, seq_len, logged_per_step)
    if bad_unit:
        raise RunError(bad_unit)
    warmup = _warmup_tokens(config, seq_len, logged_per_step)
    tokens, loss, skipped = read_metrics(path / METRICS_FILE, loss_key, min_tokens,
                                         warmup if skip_warmup else None)
    return Run(path=path, arch=cfg.arch, size=cfg.size, cfg=cfg, seq_len=seq_len,
               n_params=paper_non_embedding_params(cfg), n_params_exact=exact_params(cfg)["non_embedding"],
               flops_per_token=compute_per_token(cfg, seq_len, include_embedding),
               include_embedding=include_embedding, tokens=tokens, loss=loss, skipped=skipped,
               warmup_tokens=warmup)


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / METRICS_FILE).is_file()


def find_run_dirs(paths: list[str | Path], problems: list[str] | None = None) -> list[Path]:
    """Each path is a run directory, or a directory whose immediate subdirectories hold runs (`runs/`).
    A path that is neither raises RunError, or is noted in `problems` when a list is given (`--skip-bad`)."""
    found: list[Path] = []
    for p in map(Path, paths):
        msg = None
        if not p.exists():
            msg = f"{p}: no such file or directory"
        elif not p.is_dir():
            msg = f"{p}: not a directory; give run directories (each with {CONFIG_FILE} and {METRICS_FILE})"
        elif (p / CONFIG_FILE).exists() or (p / METRICS_FILE).exists():
            found.append(p)   # load_run says which file is missing
        else:
            # a child with one of the two files is a damaged run (load_run says which file is missing);
            # one with neither is another kind of folder (plots/, eval/) and is passed over
            children = sorted(c for c in p.iterdir() if c.is_dir()
                              and ((c / CONFIG_FILE).exists() or (c / METRICS_FILE).exists()))
            if not children:
                msg = (f"{p}: not a run directory (no {CONFIG_FILE} / {METRICS_FILE}) and no run directories "
                       f"inside it")
            found.extend(children)
        if msg is not None:
            if problems is None:
                raise RunError(msg)
            problems.append(msg)
    if not found:
        raise RunError("no runs found: give one or more run directories (e.g. runs/*)"
                       + (f" ({'; '.join(problems)})" if problems else ""))
    unique: dict[Path, Path] = {}  # one run under two spellings (runs/x and $PWD/runs/x, a symlink) once
    for f in found:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def load_runs(paths: list[str | Path], include_embedding: bool = False, loss_key: str = "loss",
              min_tokens: float = 0.0, skip_bad: bool = False, skip_warmup: bool = False
              ) -> tuple[list[Run], list[str]]:
    """All runs under `paths`, and the reasons for any left out (only with skip_bad; otherwise RunError)."""
    runs, problems = [], []
    for p in find_run_dirs(paths, problems if skip_bad else None):
        try:
            run = load_run(p, include_embedding, loss_key, min_tokens, skip_warmup)
        except RunError as err:
            if not skip_bad:
                raise
            problems.append(str(err))
            continue
        if len(run.tokens) == 0:
            msg = no_rows_message(p, run.skipped, loss_key)
            if not skip_bad:
                raise RunError(msg)
            problems.append(msg)
            continue
        copy = next((r for r in runs if same_run(r, run)), None)
        if copy is not None:
            problems.append(f"{p}: a copy of {copy.path} (the same model, context length and logged rows), counted "
                            f"once: two copies would weigh twice in every fit and count as two runs (`coverage`) at "
                            f"every C")
            continue
        runs.append(run)
    if not runs:
        raise RunError("no usable runs: " + "; ".join(problems))
    return runs, problems


def logged_losses(path: Path) -> list[str]:
    """The keys of a metrics.jsonl's rows that hold a number and name a loss (`loss`, `val_loss`, ...), in the order
    first seen."""
    keys: dict[str, None] = {}
    for row in _object_rows(path):
        keys.update((k, None) for k, v in row.items()
                    if "loss" in k and isinstance(v, (int, float)) and not isinstance(v, bool))
    return list(keys)


def no_rows_message(path: Path, skipped: dict[str, int], loss_key: str) -> str:
    """Why a run has no row to fit, and what to do: an empty log, a log without the fitted loss (naming the
    losses it does log), or rows all skipped for the reasons counted."""
    fix = "leave the run out with --skip-bad (or give the other runs by name)"
    if not skipped:
        return (f"{path}: no usable rows in {METRICS_FILE}: it holds no rows (a run stopped before its first log, or "
                f"its log was lost); {fix}, or train the run until it logs")
    missing = f"{loss_key} missing or not finite"
    if skipped.get(missing) and set(skipped) <= {missing, "no tokens", "unparseable line (e.g. truncated)",
                                                 "not a JSON object"}:
        others = [k for k in logged_losses(path / METRICS_FILE) if k != loss_key]
        return (f"{path}: no usable rows in {METRICS_FILE}: no row has a finite '{loss_key}', the loss fitted "
                f"(skipped: {skipped})" + (f"; it logs {', '.join(others)} (--loss-key {others[0]} fits that loss, "
                                           f"in every run); or {fix}" if others else f"; {fix}"))
    return f"{path}: no usable rows in {METRICS_FILE} (skipped: {skipped}); {fix}"


def same_run(a: Run, b: Run) -> bool:
    """Whether two run directories hold one run (a copy: `cp -r runs/x backup/x`): the same model config and
    context length, and the same logged (tokens, loss) rows. Two seeds of one size differ in their losses."""
    return (a.cfg == b.cfg and a.seq_len == b.seq_len and a.tokens.shape == b.tokens.shape
            and bool(np.array_equal(a.tokens, b.tokens)) and bool(np.array_equal(a.loss, b.loss)))


def group_by_arch(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs per architecture, architectures in registry order (the paper's), runs by size."""
    out: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (arch_order(r.arch), r.arch, r.n_params, r.name)):
        out.setdefault(r.arch, []).append(r)
    return out


def mixed_vocab(runs: list[Run]) -> str | None:
    """Why one architecture's runs cannot be fitted together when they were trained with different vocabularies
    (model.vocab_size), else None. Loss per token depends on the tokenizer (a token of a 32K vocabulary carries
    less text than one of a 100K vocabulary, and is easier to predict), so on one envelope the runs of one
    vocabulary would seem to beat the other's at every C, and N_opt would follow the tokenizer, not the size."""
    by_vocab: dict[int, list[str]] = {}
    for r in runs:
        by_vocab.setdefault(r.cfg.vocab_size, []).append(r.name)
    if len(by_vocab) < 2:
        return None
    which = "; ".join(f"vocab_size {v}: {', '.join(names)}" for v, names in sorted(by_vocab.items()))
    return (f"{runs[0].arch} runs were trained with different vocabularies ({which}): loss per token depends on "
            f"the tokenizer, so their losses are not comparable on one envelope; fit the runs of one vocabulary at "
            f"a time")


def select_seq_len(runs: list[Run], seq_len: int | None = None) -> tuple[list[Run], list[str]]:
    """One architecture's runs restricted to one training context length, and warnings.

    Loss per token depends on the context it was trained at, so runs of one size at 2K and at 8K are two
    studies, not two samples of one: mixing them puts the wrong run on the envelope. With `seq_len` given,
    only runs at that length are kept. Otherwise, when some size has runs at several lengths, the length that
    the most sizes were trained at is kept (ties: the longer) and the rest are named; when the lengths differ
    only between sizes, all runs are kept with a warning."""
    if not runs:
        return [], []
    lens = sorted({r.seq_len for r in runs})
    arch = runs[0].arch
    if seq_len is not None:
        kept = [r for r in runs if r.seq_len == seq_len]
        out = [r for r in runs if r.seq_len != seq_len]
        warn = [f"--seq-len {seq_len}: left out {len(out)} run(s) at other context lengths "
                f"({', '.join(f'{r.name} ({r.seq_len})' for r in out)})"] if out else []
        if not kept:
            warn.append(f"no {arch} run was trained at seq_len {seq_len} (have {lens})")
        return kept, warn
    if len(lens) == 1:
        return runs, []
    by_size: dict[int, set[int]] = {}
    for r in runs:
        by_size.setdefault(r.n_params, set()).add(r.seq_len)
    mixed = [n for n, s in by_size.items() if len(s) > 1]
    if not mixed:
        return runs, [f"{arch}: sizes were trained at different context lengths "
                      f"({', '.join(f'{r.label}: {r.seq_len}' for r in sorted(runs, key=lambda r: r.n_params))}); "
                      f"loss per token depends on the context, so the envelope compares unlike runs: fit one "
                      f"context length with --seq-len"]
    count = {L: sum(L in s for s in by_size.values()) for L in lens}
    keep = max(lens, key=lambda L: (count[L], L))
    kept = [r for r in runs if r.seq_len == keep]
    out = [r for r in runs if r.seq_len != keep]
    sizes = ", ".join(size_label(n) for n in sorted(mixed))
    return kept, [f"{arch}: sequence-length variants of one size ({sizes}) at {lens}: fitting only seq_len {keep} "
                  f"(the most sizes), left out {', '.join(f'{r.name} ({r.seq_len})' for r in out)}; choose "
                  f"another with --seq-len"]

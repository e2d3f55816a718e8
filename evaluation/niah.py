"""Needle in a haystack, as the paper ran it, and its metrics.

A haystack of real text (user files, or the Gutenberg books under train/en of the shared data folder) hides a needle
that pairs a random key with a random 7-digit value, so the answer cannot be guessed:
- standard mode: the needle states only the answer ("The special magic number for K is V."); the question
  comes at the end of the prompt;
- easy mode: the needle holds question and answer ("Question: ... Answer: ... is V."), and the same
  question is asked again at the end.
The prompt ends with "... The special magic number for K is", the model continues greedily, and a
deterministic scorer maps the reply to s in [1, 10] (`score_reply`): by default strictly, 10 for the exact
value and 1 otherwise; `scoring="partial"` gives credit per correct leading digit. The needle sits at the
stated depth counted in haystack tokens (the achieved depth is reported per cell). Each cell (depth, context
length) averages `trials` needles; every prompt of one length has exactly that many tokens, so a whole
column decodes as one batch. `summarize` turns the score matrix into the paper's metrics.
"""
from __future__ import annotations

import gzip
import json
import math
import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_pipeline.tokenizer import EOT_ID, get_tokenizer
from evaluation import local_data

DEFAULT_LENGTHS = (1024, 2048, 4096, 6144, 8192, 10240, 12288, 14336, 16384)
DEFAULT_DEPTHS = tuple(range(0, 101, 10))  # percent of the haystack before the needle


# -- metrics --------------------------------------------------------------------------------------------

def runs_down(column: Sequence[bool]) -> int:
    """Number of maximal runs of equal values in a sequence (e.g. [1,1,0,1] -> 3)."""
    return 1 + sum(1 for a, b in zip(column, column[1:]) if a != b) if len(column) else 0


def column_penalty(success: Sequence[bool]) -> float:
    """p = 1 if every depth succeeds, 0 if none does, else 2^((1-n)/2), n = runs of equal values."""
    if all(success):
        return 1.0
    if not any(success):
        return 0.0
    return 2.0 ** ((1 - runs_down(success)) / 2)


def check_grid(depths: Sequence[float], lengths: Sequence[int]) -> None:
    """The metrics weight depth i by alpha_d^i and length j by alpha_c^j, so the grid must be in increasing
    order: refuse (rather than silently sort) a grid given in any other order, repeats included."""
    for name, values, flag, example, default in (
            ("depths", list(depths), "--niah-depths", "0 50 100", DEFAULT_DEPTHS),
            ("lengths", list(lengths), "--niah-lengths", "1024 2048 4096", DEFAULT_LENGTHS)):
        if not values:
            raise ValueError(f"NIAH {name}: the grid is empty, so there is no cell to score and no metric; give at "
                             f"least one ({flag} {example}; without the flag: {' '.join(map(str, default))})")
        if any(b <= a for a, b in zip(values, values[1:])):
            raise ValueError(f"NIAH {name} must be strictly increasing (the weights follow the order), got "
                             f"{values}; give them sorted, e.g. {sorted(set(values))}")
    if min(depths) < 0 or max(depths) > 100:
        raise ValueError(f"NIAH depths are percentages in [0, 100], got {list(depths)}")
    if min(lengths) <= 0:
        raise ValueError(f"NIAH lengths are token counts > 0, got {list(lengths)}")


def summarize(scores, depths: Sequence[float], lengths: Sequence[int], alpha_d: float = 1.5,
              alpha_c: float = 1.5, threshold: float = 5.5) -> dict:
    """The paper's NIAH metrics from scores[depth i, length j], each s in [1, 10]; accuracy a = (s-1)/9.

    acc_at_length[j]   mean over depths of a[:, j]
    acc_upto_length[j] mean of a[:, :j+1]
    acc_avg            mean of a
    weighted_avg_acc   Σ W·a / Σ W with W = outer(α_d^i, α_c^j) (later depths, longer contexts weigh more)
    niah_score         Σ W·a·p_j / Σ W, p_j = column_penalty(s[:, j] >= threshold)
    Lengths and depths must be strictly increasing (the weights follow the index; see check_grid)."""
    check_grid(depths, lengths)
    s = np.asarray(scores, dtype=np.float64)
    if s.shape != (len(depths), len(lengths)):
        raise ValueError(f"scores must be [depths={len(depths)}, lengths={len(lengths)}], got {s.shape}")
    if alpha_d <= 1 or alpha_c <= 1:
        raise ValueError(f"alpha_d and alpha_c must be > 1 (geometric weights), got {alpha_d}, {alpha_c}")
    if np.isnan(s).any() or (s < 1).any() or (s > 10).any():
        raise ValueError("scores must lie in [1, 10]")
    a = (s - 1) / 9
    w = np.outer(alpha_d ** np.arange(len(depths)), alpha_c ** np.arange(len(lengths)))
    p = np.array([column_penalty(list(s[:, j] >= threshold)) for j in range(len(lengths))])
    return {
        "acc_at_length": {int(L): float(a[:, j].mean()) for j, L in enumerate(lengths)},
        "acc_upto_length": {int(L): float(a[:, :j + 1].mean()) for j, L in enumerate(lengths)},
        "acc_avg": float(a.mean()),
        "weighted_avg_acc": float((w * a).sum() / w.sum()),
        "niah_score": float((w * a * p[None, :]).sum() / w.sum()),
        "penalty": {int(L): float(p[j]) for j, L in enumerate(lengths)},
        "alpha_d": alpha_d, "alpha_c": alpha_c, "threshold": threshold,
    }


# -- the task -------------------------------------------------------------------------------------------

SCORINGS = ("exact", "partial")


def score_reply(reply: str, value: str, scoring: str = "exact") -> float:
    """Deterministic 1-10 from the first run of digits in the reply. "exact" (the default success rule):
    10 when it is exactly the value, else 1. "partial": 10 when exact, else 1 + 9·k/len(value) with k the
    number of leading digits it gets right (capped below 10): with 7 digits, 4 right already scores 6.1, above
    the default success threshold 5.5, so partial scores pair with a higher threshold if success must mean
    the exact value."""
    if scoring not in SCORINGS:
        raise ValueError(f"NIAH scoring {scoring!r}; choose one of {SCORINGS}")
    found = re.search(r"\d+", reply)
    if found is None:
        return 1.0
    digits = found.group(0)
    if digits == value:
        return 10.0
    if scoring == "exact":
        return 1.0
    k = 0
    while k < min(len(digits), len(value)) and digits[k] == value[k]:
        k += 1
    return 1.0 + 9.0 * min(k, len(value) - 1) / len(value)


@dataclass
class Needle:
    key: str
    value: str

    def text(self, mode: str) -> tuple[str, str]:
        """(needle inserted into the haystack, question appended at the end)."""
        q = f"What is the special magic number for {self.key}?"
        a = f"The special magic number for {self.key} is"
        if mode == "standard":
            return f" {a} {self.value}.", f"\n\n{q} {a}"
        if mode == "easy":
            return f" Question: {q} Answer: {a} {self.value}.", f"\n\nQuestion: {q} Answer: {a}"
        raise ValueError(f"NIAH mode {mode!r}; choose standard or easy")


def random_needle(rng: random.Random) -> Needle:
    key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
    return Needle(key=key, value=str(rng.randrange(1_000_000, 10_000_000)))


def default_haystack_files() -> list[Path]:
    files = local_data.haystack_files()
    if not files:
        raise FileNotFoundError(f"no haystack text under {local_data.shared_data_dir() / local_data.HAYSTACK_DIR}: "
                                f"pass haystack files (plain or .gz text)")
    return files


def strip_gutenberg(text: str) -> str:
    """The book without Project Gutenberg's licence header and footer (kept as is if there are none)."""
    start = re.search(r"\*\*\* ?START OF[^\n]*\n", text)
    end = re.search(r"\n[^\n]*\*\*\* ?END OF", text)
    return text[start.end() if start else 0:end.start() if end and (not start or end.start() > start.end()) else None]


def haystack_tokens(files: Sequence[str | Path] | None, n_tokens: int) -> list[int]:
    """At least n_tokens of real text, documents joined by blank lines (cycled if the files are short; a file
    with no text adds nothing, so a haystack is never blank lines alone)."""
    files = [Path(f) for f in (files or default_haystack_files())]
    tok = get_tokenizer()
    out: list[int] = []
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        try:
            with opener(f, "rt", encoding="utf-8", errors="replace") as fh:
                text = strip_gutenberg(fh.read()).strip()
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise ValueError(f"haystack file {f}: not a readable gzip file ({err}); is it cut short? Give it whole, "
                             f"or as plain text without the .gz suffix") from None
        if text:
            out += tok.encode_ordinary(text + "\n\n")
        if len(out) >= n_tokens:
            return out
    if not out:
        raise ValueError(f"the haystack files {', '.join(map(str, files))} hold no text; give text files (plain "
                         f"or .gz)")
    return out * -(-n_tokens // len(out))


def insertion_point(n_hay: int, depth: float) -> int:
    """Haystack tokens before the needle for `depth` percent: round(depth/100 · n_hay), so the achieved depth
    100·at/n_hay is within half a token of the stated one (0 and 100 are the two ends). The needle text is
    inserted as its own tokens (starting with a space), so it is never merged into the text around it, even
    mid-sentence: moving it to a sentence boundary would shift every needle earlier by a different amount."""
    if not 0 <= depth <= 100:
        raise ValueError(f"NIAH depth {depth} is not a percentage in [0, 100]")
    return min(n_hay, max(0, round(depth / 100 * n_hay)))


@dataclass
class NiahConfig:
    mode: str = "standard"
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 1
    seed: int = 0
    haystack: tuple[str, ...] = ()          # files; empty -> the shared data's train/en/gutenberg
    max_new_tokens: int = 12
    batch_size: int = 8
    alpha_d: float = 1.5
    alpha_c: float = 1.5
    threshold: float = 5.5                 # success: cell score >= threshold (exact scoring: at least half the trials exact)
    scoring: str = "exact"                 # "exact" | "partial" (score_reply)


def build_prompt(hay: list[int], needle: Needle, mode: str, length: int, depth: float,
                 info: dict | None = None) -> list[int]:
    """<|endoftext|> + haystack with the needle at `depth` + question: exactly `length` tokens. `info`, if
    given, receives the needle's token position and the achieved depth (percent of the haystack before it)."""
    tok = get_tokenizer()
    needle_text, question = needle.text(mode)
    n_ids, q_ids = tok.encode_ordinary(needle_text), tok.encode_ordinary(question)
    n_hay = length - 1 - len(n_ids) - len(q_ids)
    if n_hay < 0:
        raise ValueError(f"context length {length} is too short for the needle and question "
                         f"({len(n_ids) + len(q_ids) + 1} tokens); use lengths of at least that")
    if len(hay) < n_hay:
        raise ValueError(f"haystack of {len(hay)} tokens is shorter than the {n_hay} a {length}-token prompt needs")
    h = hay[:n_hay]
    at = insertion_point(n_hay, depth)
    if info is not None:
        info.update(needle_token=1 + at, achieved_depth=100.0 * at / n_hay if n_hay else 0.0)
    return [EOT_ID] + h[:at] + n_ids + h[at:] + q_ids


def draw_needles(cfg: NiahConfig) -> dict[tuple[int, int, int], Needle]:
    """The needle of every (trial, depth index, length index), drawn from `cfg.seed`: a rerun asks the same."""
    rng = random.Random(cfg.seed)
    return {(t, i, j): random_needle(rng) for t in range(cfg.trials)
            for i in range(len(cfg.depths)) for j in range(len(cfg.lengths))}


def prompt_overhead(needle: Needle, mode: str) -> int:
    """Tokens of a prompt that are not haystack: <|endoftext|>, the needle and the question."""
    tok = get_tokenizer()
    needle_text, question = needle.text(mode)
    return 1 + len(tok.encode_ordinary(needle_text)) + len(tok.encode_ordinary(question))


def check_lengths(cfg: NiahConfig, needles: dict | None = None) -> None:
    """Every context length holds its needles and the question (checked before any model runs: a length too short
    would end the task after the model was loaded)."""
    check_grid(cfg.depths, cfg.lengths)
    needles = draw_needles(cfg) if needles is None else needles
    need = {j: max(prompt_overhead(n, cfg.mode) for (_, _, jj), n in needles.items() if jj == j)
            for j in range(len(cfg.lengths))}
    short = [(L, need[j]) for j, L in enumerate(cfg.lengths) if L < need[j]]
    if short:
        least = max(need.values())
        raise ValueError(f"NIAH {cfg.mode}: context length{'s' if len(short) > 1 else ''} "
                         f"{', '.join(str(L) for L, _ in short)} too short for the needle and the question "
                         f"({', '.join(f'{n} tokens at {L}' for L, n in short)}, with <|endoftext|>), so no "
                         f"haystack fits around them; give --niah-lengths of at least {least} (the paper's lengths "
                         f"start at 1024)")


def run_niah(model, cfg: NiahConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Scores of every cell, the metrics and each reply. The needle and the haystack offset of a trial
    are drawn from `seed`, so a rerun asks exactly the same questions."""
    from evaluation.scoring import generate_tokens
    tok = get_tokenizer()
    check_grid(cfg.depths, cfg.lengths)
    if cfg.scoring not in SCORINGS:
        raise ValueError(f"NIAH scoring {cfg.scoring!r}; choose one of {SCORINGS}")
    lengths, depths = list(cfg.lengths), list(cfg.depths)
    needles = draw_needles(cfg)
    check_lengths(cfg, needles)
    stride = 997  # haystack offset between trials: different text, same books
    hay = haystack_tokens(cfg.haystack or None, max(lengths) + stride * cfg.trials)
    scores = np.zeros((len(depths), len(lengths)))
    achieved = np.zeros((len(depths), len(lengths)))
    cells = []
    for j, L in enumerate(lengths):
        keys = [(t, i, j) for t in range(cfg.trials) for i in range(len(depths))]
        infos = [{} for _ in keys]
        prompts = [build_prompt(hay[stride * t:], needles[(t, i, j)], cfg.mode, L, depths[i], info)
                   for (t, i, _), info in zip(keys, infos)]
        replies = generate_tokens(model, prompts, cfg.max_new_tokens, cfg.batch_size, eos_id=EOT_ID,
                                  stop=lambda new: re.search(r"\d\D", tok.decode(new)) is not None)
        trial_scores: dict[int, list[float]] = {}
        trial_depths: dict[int, list[float]] = {}
        for (t, i, _), r, info in zip(keys, replies, infos):
            text = tok.decode(r)
            s = score_reply(text, needles[(t, i, j)].value, cfg.scoring)
            trial_scores.setdefault(i, []).append(s)
            trial_depths.setdefault(i, []).append(info["achieved_depth"])
            cells.append({"length": L, "depth": depths[i], "achieved_depth": info["achieved_depth"],
                          "needle_token": info["needle_token"], "trial": t, "key": needles[(t, i, j)].key,
                          "value": needles[(t, i, j)].value, "reply": text, "score": s,
                          "exact": s == 10.0})
        for i in trial_scores:
            # the correctly rounded mean (sum, then divide): adding s/trials trial by trial rounds at each
            # step, which puts half of 10 trials exact at 5.5 or at 5.499999999999998 by which trials they
            # are, so that a cell at the threshold would pass or fail by the order of its trials
            scores[i, j] = math.fsum(trial_scores[i]) / cfg.trials
            achieved[i, j] = math.fsum(trial_depths[i]) / cfg.trials
        if progress is not None:
            progress(f"niah {cfg.mode} length {L}: mean score {scores[:, j].mean():.2f}")
    metrics = summarize(scores, depths, lengths, cfg.alpha_d, cfg.alpha_c, cfg.threshold)
    return {"mode": cfg.mode, "depths": list(depths), "lengths": list(lengths), "scores": scores.tolist(),
            "achieved_depths": achieved.tolist(),
            "max_depth_error": float(np.abs(achieved - np.asarray(depths, dtype=float)[:, None]).max()),
            "metrics": metrics, "cells": cells, "config": asdict(cfg)}


def plot_heatmap(result: dict, path: str | Path, title: str | None = None) -> Path:
    """The paper's heatmap: depth (rows, 0% at top) by context length, colour = score 1 (red) .. 10 (green)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap
    s = np.asarray(result["scores"])
    depths, lengths, m = result["depths"], result["lengths"], result["metrics"]
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    # a floor on the size keeps the two-line title and the colour bar's label inside small grids
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 0.7 * len(lengths)), max(3.2, 1.4 + 0.4 * len(depths))))
    im = ax.imshow(s, cmap=cmap, vmin=1, vmax=10, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_xticks(np.arange(-0.5, len(lengths)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(depths)), minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    fig.colorbar(im, ax=ax, label="score")
    scoring = (result.get("config") or {}).get("scoring")
    head = title or f"NIAH ({result['mode']}{f', {scoring} scoring' if scoring else ''})"
    ax.set_title(f"{head}\navg acc {m['acc_avg']:.3f} · weighted {m['weighted_avg_acc']:.3f} · "
                 f"NIAH score {m['niah_score']:.3f}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_result(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1))


"""Gold answers of every commonsense task, as lm-eval scores them through our loaders and task YAMLs, against an
independent parse of the raw files under eval/ of the shared data folder (each item's gold answer text, and the label
distribution). Where a second official file exists it is the reference (OpenBookQA's test.tsv, WinoGrande's
dev-labels.lst, HellaSwag's original klosax text), so a loader cannot agree with itself by construction."""
from __future__ import annotations

import bz2
import csv
import json
import re
from collections import Counter
from pathlib import Path

import pytest

TASKS = ("boolq", "piqa", "siqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _lines(path: Path) -> list[str]:
    return [x.strip() for x in path.read_text().splitlines() if x.strip()]


# -- independent readers: (item key, gold answer text) per item, in file order --------------------------------

def raw_boolq(d: Path) -> list[str]:
    out = []
    for r in _jsonl(d / "boolq" / "val.jsonl"):
        assert r["label"] in ("true", "false", True, False), r["label"]
        out.append("yes" if r["label"] in ("true", True) else "no")
    return out


def raw_piqa(d: Path) -> list[str]:
    rows, labels = _jsonl(d / "piqa" / "valid.jsonl"), _lines(d / "piqa" / "valid-labels.lst")
    return [r["sol1"] if y == "0" else r["sol2"] for r, y in zip(rows, labels, strict=True)]


def raw_siqa(d: Path) -> list[str]:
    rows, labels = _jsonl(d / "siqa" / "dev.jsonl"), _lines(d / "siqa" / "dev-labels.lst")
    return [r["answer" + "ABC"[int(y) - 1]] for r, y in zip(rows, labels, strict=True)]


def raw_arc(path: Path) -> list[str]:
    out = []
    for r in _jsonl(path):
        (text,) = [c["text"] for c in r["question"]["choices"] if c["label"] == r["answerKey"]]
        out.append(text)
    return out


def raw_openbookqa(d: Path) -> list[str]:
    """From the official test.tsv (a different file from the jsonl the loader reads)."""
    with open(d / "openbookqa" / "test.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    out = []
    for r in rows:
        choices = dict(re.findall(r"\(([A-D])\) (.*?)(?= \([A-D]\) |$)", r["Choices"]))
        out.append(choices[r["Answer Key"].strip()])
    return out


def raw_winogrande(d: Path) -> list[int]:
    """Official dev labels (1 = option1): the index of the filled-in context that is correct."""
    return [int(y) - 1 for y in _lines(d / "winogrande" / "dev-labels.lst")]


def raw_hellaswag(d: Path) -> list[tuple[str, str]]:
    """(context, gold ending) from klosax's original 6-lines-per-item text, not the converted jsonl."""
    lines = bz2.open(d / "hellaswag" / "hellaswag_val_full.txt.bz2", "rt", encoding="utf-8").read().split("\n")
    items = []
    for i in range(0, len(lines) - 5, 6):
        ctx, label, endings = lines[i], int(lines[i + 1]), lines[i + 2:i + 6]
        items.append((ctx, endings[label]))
    return items


# -- what the harness scores --------------------------------------------------------------------------------

def harness_gold(task, doc) -> tuple[int, list[str]]:
    """The gold index exactly as lm-eval's ConfigurableTask.process_results derives it for multiple_choice."""
    choices = task.doc_to_choice(doc)
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        gold = choices.index(gold) if gold in choices else -100
    assert isinstance(gold, int) and 0 <= gold < len(choices), (gold, choices)
    return gold, choices


@pytest.fixture(scope="module")
def harness_tasks():
    from lm_eval.tasks import TaskManager, get_task_dict

    from conftest import SHARED_DATA
    from evaluation.lm_eval_adapter import tasks_dir
    eval_dir = SHARED_DATA / "eval"
    missing = [t for t in ("boolq/val.jsonl", "piqa/valid.jsonl", "siqa/dev.jsonl", "arc/ARC-Easy-Test.jsonl",
                           "openbookqa/test.tsv", "winogrande/dev-labels.lst", "hellaswag/hellaswag_val_full.txt.bz2")
               if not (eval_dir / t).exists()]
    if missing:
        pytest.skip(f"evaluation files missing under {eval_dir}: {missing}")
    tm = TaskManager(include_path=str(tasks_dir()), metadata={"data_dir": str(eval_dir)})
    tasks = get_task_dict([f"{t}_local" for t in TASKS], tm)
    return eval_dir, {t: tasks[f"{t}_local"] for t in TASKS}


def _golds(task) -> list[tuple[int, list[str], dict]]:
    return [(*harness_gold(task, doc), doc) for doc in task.eval_docs]


def _check_texts(task, expected: list[str]) -> None:
    got = _golds(task)
    assert len(got) == len(expected)
    wrong = [i for i, ((g, ch, _), e) in enumerate(zip(got, expected)) if ch[g].strip() != e.strip()]
    assert not wrong, f"{len(wrong)} gold answers differ from the raw file, first items {wrong[:5]}"
    # the distribution of the gold answer's position, counted both ways
    by_harness = Counter(g for g, _, _ in got)
    by_raw = Counter(ch.index(next(c for c in ch if c.strip() == e.strip())) for (_, ch, _), e in zip(got, expected))
    assert by_harness == by_raw
    assert len(by_harness) > 1, f"every gold answer is choice {list(by_harness)}: a degenerate label column"


def test_boolq_gold_labels(harness_tasks):
    eval_dir, tasks = harness_tasks
    expected = raw_boolq(eval_dir)
    _check_texts(tasks["boolq"], expected)
    counts = Counter(ch[g] for g, ch, _ in _golds(tasks["boolq"]))
    assert counts == Counter(expected)
    assert counts["yes"] == 2033 and counts["no"] == 1237    # the SuperGLUE val split's published balance


@pytest.mark.parametrize("task", ["piqa", "siqa", "arc_easy", "arc_challenge", "openbookqa"])
def test_multiple_choice_gold_labels(harness_tasks, task):
    eval_dir, tasks = harness_tasks
    expected = {"piqa": lambda: raw_piqa(eval_dir), "siqa": lambda: raw_siqa(eval_dir),
                "arc_easy": lambda: raw_arc(eval_dir / "arc" / "ARC-Easy-Test.jsonl"),
                "arc_challenge": lambda: raw_arc(eval_dir / "arc" / "ARC-Challenge-Test.jsonl"),
                "openbookqa": lambda: raw_openbookqa(eval_dir)}[task]()
    _check_texts(tasks[task], expected)


def test_winogrande_gold_labels(harness_tasks):
    eval_dir, tasks = harness_tasks
    expected = raw_winogrande(eval_dir)
    got = [g for g, _, _ in _golds(tasks["winogrande"])]
    assert got == expected
    assert Counter(got) == Counter(expected) and len(set(got)) == 2


def test_hellaswag_gold_labels(harness_tasks):
    from lm_eval.tasks.hellaswag.utils import preprocess  # lm-eval's own normalisation of endings
    eval_dir, tasks = harness_tasks
    expected = raw_hellaswag(eval_dir)
    got = _golds(tasks["hellaswag"])
    assert len(got) == len(expected) == 10042
    wrong = [i for i, ((g, ch, doc), (ctx, ending)) in enumerate(zip(got, expected))
             if ch[g] != preprocess(ending) or doc["query"] != preprocess(ctx)]
    assert not wrong, f"{len(wrong)} HellaSwag items differ from the original text, first {wrong[:5]}"
    assert len(Counter(g for g, _, _ in got)) == 4


def test_boolq_label_parser_refuses_what_it_cannot_read():
    from evaluation.local_data import boolq_label
    assert [boolq_label(x) for x in ("true", "false", "False", True, False, 1, 0)] == [1, 0, 0, 1, 0, 1, 0]
    for bad in ("yes", "", None, 2):
        with pytest.raises(ValueError, match="BoolQ label"):
            boolq_label(bad)

"""Where the evaluation data lives and how each local file becomes the records the evaluations expect.

Default layout: the eval/ folder of the shared data folder (`shared/data` beside the checkout's own folder;
override with $LINSCALE_SHARED_DATA, or a `data_dir` argument / lm-eval `--metadata '{"data_dir": ...}'`, or an
explicit file path). The commonsense
loaders return the schema of the HF dataset that lm-eval's own task reads, so the task YAMLs under
evaluation/tasks/ keep lm-eval's prompts; see docs/evaluation.md for the two converted formats
(HellaSwag, WinoGrande).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

EVAL_FILES = {
    "wikitext2_test": "wikitext-2-raw/wiki.test.raw",
    "wikitext2_valid": "wikitext-2-raw/wiki.valid.raw",
    "lambada_openai": "lambada/lambada_test.jsonl",
    "piqa": "piqa/valid.jsonl",
    "piqa_labels": "piqa/valid-labels.lst",
    "siqa": "siqa/dev.jsonl",
    "siqa_labels": "siqa/dev-labels.lst",
    "arc_easy": "arc/ARC-Easy-Test.jsonl",
    "arc_challenge": "arc/ARC-Challenge-Test.jsonl",
    "boolq": "boolq/val.jsonl",
    "openbookqa": "openbookqa/test.jsonl",
    "winogrande": "winogrande/winogrande_llmfoundry_format.jsonl",
    "hellaswag": "hellaswag/hellaswag_val_from_klosax.jsonl",
}
# the EVAL_FILES each task reads (part of an evaluation's cache key: a result is stale when they change)
TASK_FILES = {"wikitext2": ("wikitext2_test",), "lambada_openai": ("lambada_openai",), "boolq": ("boolq",),
              "piqa": ("piqa", "piqa_labels"), "siqa": ("siqa", "siqa_labels"), "hellaswag": ("hellaswag",),
              "winogrande": ("winogrande",), "arc_easy": ("arc_easy",), "arc_challenge": ("arc_challenge",),
              "openbookqa": ("openbookqa",)}
HAYSTACK_DIR = "train/en/gutenberg"


def shared_data_dir() -> Path:
    """The shared data folder: $LINSCALE_SHARED_DATA, else `shared/data` beside the checkout's folder. The
    checkout is this module's, or, for a copy installed into site-packages (`pip install .`, which the plain
    `lm_eval` command imports), the one the working directory is in."""
    if "LINSCALE_SHARED_DATA" in os.environ:
        return Path(os.environ["LINSCALE_SHARED_DATA"])
    candidates = [REPO_ROOT.parent / "shared" / "data"]
    cwd = Path.cwd().resolve()
    candidates += [p.parent / "shared" / "data" for p in (cwd, *cwd.parents)
                   if (p / "evaluation" / "local_data.py").is_file()]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def haystack_files() -> list[Path]:
    """NIAH's default haystack: the books under HAYSTACK_DIR (gzipped or plain text); [] when there are none."""
    d = shared_data_dir() / HAYSTACK_DIR
    return sorted(d.glob("*.txt.gz")) + sorted(d.glob("*.txt"))


def eval_path(name: str, data_dir: str | Path | None = None) -> Path:
    """The file of evaluation set `name` (a key of EVAL_FILES) under data_dir (default shared eval dir)."""
    base = Path(data_dir) if data_dir is not None else shared_data_dir() / "eval"
    path = base / EVAL_FILES[name]
    if not path.exists():
        raise FileNotFoundError(f"{name}: {path} not found. Point $LINSCALE_SHARED_DATA at the shared data "
                                f"folder (holding eval/ and train/) or pass data_dir / an explicit path")
    return path


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """The records of a JSON-lines file, each a JSON object holding the `required` keys. A line that does not
    parse (a file cut short), a record of another kind, or a file with no record is an error naming the file
    and line: evaluating on what is left would report a number over a silently different set."""
    rows = []
    # utf-8-sig: a byte-order mark (a file saved by some Windows editors) is not part of the first record
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}, line {n}: not valid JSON ({err}); is the file cut short? Restore it "
                                 f"from the shared data folder") from None
            if not isinstance(row, dict) or any(k not in row for k in required):
                missing = [k for k in required if not isinstance(row, dict) or k not in row]
                raise ValueError(f"{path}, line {n}: a record without {', '.join(map(repr, missing)) or 'an object'}"
                                 f" (expected the keys {', '.join(required)}); is this the right file?")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no records (an empty file); restore it from the shared data folder")
    return rows


def read_labels(path: str | Path, n: int | None = None, of: str | Path | None = None) -> list[str]:
    """The non-empty lines of a labels file; with `n`, exactly n of them (one per record of the file `of`)."""
    # utf-8-sig: a byte-order mark would stick to the first label ('\ufeff1'), which check_label then refuses as
    # a label of another convention although the labels are right
    labels = [x.strip() for x in Path(path).read_text(encoding="utf-8-sig").splitlines() if x.strip()]
    if n is not None and len(labels) != n:
        raise ValueError(f"{path}: {len(labels)} labels for the {n} records of {of}; the two files do not belong "
                         f"together (one is cut short?)")
    return labels


# -- perplexity sets ------------------------------------------------------------------------------------

def wikitext_documents(path: str | Path | None = None) -> list[str]:
    """The raw WikiText pages, split as EleutherAI/wikitext_document_level (lm-eval's `wikitext` data)
    splits wiki.*.raw: a new page starts at each level-1 heading line (' = Title = '); lines keep their
    own text and are joined with '\\n'; an empty page before the first heading is dropped."""
    path = Path(path or eval_path("wikitext2_test"))
    text = path.read_text(encoding="utf-8")
    pages, current = [], []
    for line in text.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            page = "\n".join(current)
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    if not any(p.strip() for p in pages):
        raise ValueError(f"{path}: no text (an empty file); restore wiki.test.raw from the shared data folder")
    return pages


def lambada_texts(path: str | Path | None = None) -> list[str]:
    return [r["text"] for r in read_jsonl(path or eval_path("lambada_openai"), ("text",))]


# -- lm-eval custom_dataset loaders (called with the task's metadata as keyword arguments) --------------

def _dataset(split: str, rows: list[dict]):
    import datasets
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def load_wikitext(data_dir: str | None = None, **_) -> "datasets.DatasetDict":
    return _dataset("test", [{"page": p} for p in wikitext_documents(eval_path("wikitext2_test", data_dir))])


def load_lambada_openai(data_dir: str | None = None, **_):
    return _dataset("test", [{"text": t} for t in lambada_texts(eval_path("lambada_openai", data_dir))])


def check_label(value, allowed, path: str | Path, item: int, note: str) -> None:
    """A gold label must name one of the item's choices. lm-eval scores a label outside them as a wrong answer
    for every model (with only a logged warning), so a labels file of another convention (0-based where 1-based
    is expected, or the reverse) would lower the accuracy silently: refuse it, naming the file and the item."""
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{path}: item {item} has the gold label {value!r}; expected one of {shown} ({note}). "
                         f"Is this the file of that task, in its original numbering?")


def load_piqa(data_dir: str | None = None, **_):
    path, labels_path = eval_path("piqa", data_dir), eval_path("piqa_labels", data_dir)
    rows = read_jsonl(path, ("goal", "sol1", "sol2"))
    labels = read_labels(labels_path, len(rows), path)
    for i, y in enumerate(labels, 1):
        check_label(y, ("0", "1"), labels_path, i, "PIQA labels are 0 for sol1, 1 for sol2")
    return _dataset("validation", [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(y)}
                                   for r, y in zip(rows, labels, strict=True)])


def load_siqa(data_dir: str | None = None, **_):
    path, labels_path = eval_path("siqa", data_dir), eval_path("siqa_labels", data_dir)
    rows = read_jsonl(path, ("context", "question", "answerA", "answerB", "answerC"))
    labels = read_labels(labels_path, len(rows), path)
    for i, y in enumerate(labels, 1):
        check_label(y, ("1", "2", "3"), labels_path, i, "Social IQa labels are 1-based: 1 = answerA")
    return _dataset("validation", [{**r, "label": y} for r, y in zip(rows, labels, strict=True)])


def _ai2_multiple_choice(name: str, data_dir: str | None, question_key: str):
    path = eval_path(name, data_dir)
    rows = []
    for i, r in enumerate(read_jsonl(path, ("id", "question", "answerKey")), 1):
        choices = r["question"]["choices"]
        labels = [c["label"] for c in choices]
        # the task configs look the key up among the choice labels (OpenBookQA's with leading spaces stripped)
        key = r["answerKey"].lstrip() if name == "openbookqa" and isinstance(r["answerKey"], str) else r["answerKey"]
        check_label(key, labels, path, i, "the answerKey must be the label of one of the item's choices")
        rows.append({"id": r["id"], question_key: r["question"]["stem"], "answerKey": r["answerKey"],
                     "choices": {"text": [c["text"] for c in choices], "label": labels}})
    return _dataset("test", rows)


def load_arc_easy(data_dir: str | None = None, **_):
    return _ai2_multiple_choice("arc_easy", data_dir, "question")


def load_arc_challenge(data_dir: str | None = None, **_):
    return _ai2_multiple_choice("arc_challenge", data_dir, "question")


def load_openbookqa(data_dir: str | None = None, **_):
    return _ai2_multiple_choice("openbookqa", data_dir, "question_stem")


def boolq_label(raw) -> int:
    """1 (answer "yes") or 0 from a BoolQ label: JSON true/false, the strings 'true'/'false' of the SuperGLUE
    release, or 1/0. Anything else is an error: bool('false') is True, so a lenient cast scores every item
    against "yes"."""
    if isinstance(raw, bool):
        return int(raw)
    if isinstance(raw, int) and raw in (0, 1):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return int(raw.strip().lower() == "true")
    raise ValueError(f"BoolQ label {raw!r}: expected true/false (JSON or string) or 1/0")


def load_boolq(data_dir: str | None = None, **_):
    return _dataset("validation", [{"question": r["question"], "passage": r["passage"], "idx": r["idx"],
                                    "label": boolq_label(r["label"])}
                                   for r in read_jsonl(eval_path("boolq", data_dir), ("question", "passage", "idx", "label"))])


def load_hellaswag(data_dir: str | None = None, **_):
    """Our jsonl holds ctx = 'activity_label: ctx_a ctx_b' (klosax's conversion); it is split back into
    lm-eval's fields with ctx_b empty, so lm-eval's own process_docs builds the query. Lost in the
    conversion: lm-eval capitalises ctx_b, which here stays as klosax wrote it."""
    path = eval_path("hellaswag", data_dir)
    rows = []
    for i, r in enumerate(read_jsonl(path, ("ind", "ctx", "endings", "label")), 1):
        check_label(str(r["label"]), [str(k) for k in range(len(r["endings"]))], path, i,
                    "a 0-based index into the item's endings")
        label, _, ctx = r["ctx"].partition(": ")
        rows.append({"ind": r["ind"], "activity_label": label, "ctx_a": ctx, "ctx_b": "",
                     "endings": r["endings"], "label": str(r["label"])})
    return _dataset("validation", rows)


def load_winogrande(data_dir: str | None = None, **_):
    """llm-foundry's WinoGrande: context_options = sentence up to the blank with each option filled in,
    continuation = the rest after the blank; the same partial scoring lm-eval's winogrande does."""
    path = eval_path("winogrande", data_dir)
    rows = read_jsonl(path, ("context_options", "continuation", "gold"))
    for i, r in enumerate(rows, 1):
        g = r["gold"]
        # winogrande_doc_to_text takes int(gold): an int or a string of digits (a bool is an int, but no index)
        gold = int(g) if (isinstance(g, int) and not isinstance(g, bool)) or (isinstance(g, str) and g.isdigit()) else g
        check_label(gold, list(range(len(r["context_options"]))), path, i,
                    "a 0-based index into context_options (llm-foundry's format; dev-labels.lst counts from 1)")
    return _dataset("validation", rows)


def winogrande_doc_to_text(doc: dict) -> int:
    return int(doc["gold"])  # an index: lm-eval then scores the continuation after each context option


def winogrande_doc_to_choice(doc: dict) -> list[str]:
    return list(doc["context_options"])


def winogrande_doc_to_target(doc: dict) -> str:
    return doc["continuation"]

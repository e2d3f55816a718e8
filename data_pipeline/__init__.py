"""Data pipeline: sources -> filters -> dedup -> tokenize -> token shards -> the resumable loader.

The trainer needs only build_loader(); see docs/data.md."""
from __future__ import annotations

import logging
from pathlib import Path

from .tokenizer import EOT_ID, ENCODING_NAME, encode_batch, encode_document, get_tokenizer

SPLITS = ("train", "val")


def build_loader(data: str | None, seq_len: int, global_batch: int, micro_batch: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, doc_starts: bool = False,
                 split: str = "train", sp_rank: int = 0, sp_size: int = 1,
                 planned_steps: int | None = None) -> "Loader":
    """The loader of one rank.

    data: None for the embedded default corpus; a folder written by launch/prepare_data.py (its
    `train`/`val` split, or the folder itself if it holds meta.json); or a data config `*.yaml`,
    streamed (filter -> tokenize -> pack on the fly, no prepare step).
    split: "train" or "val" (held-out documents, for validation loss).
    sp_rank, sp_size: this rank's place in its sequence-parallel group (rank, world_size count
    data-parallel ranks); it gets its segment of every sequence.
    planned_steps: the run's step limit, if any: rank 0 logs how many epochs of each source it reads, and
    warns about a source read more than once (its documents repeat).
    """
    from .loader import Loader, ShardProvider, repeated_sources, repeats_within_a_step, source_epochs
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if data is None:
        from .default_corpus import default_corpus_dir
        provider = ShardProvider(default_corpus_dir() / split, seed)
    elif str(data).endswith((".yaml", ".yml")):
        from .streaming import StreamProvider
        provider = StreamProvider.from_config(data, seed, split)
    else:
        root = Path(data)
        if not root.exists():
            raise FileNotFoundError(f"--data {data}: no such file or folder (give a prepared dataset "
                                    f"folder, a data config .yaml, or nothing for the default corpus)")
        if (root / split / "meta.json").is_file():
            root = root / split
        elif split != "train" or not (root / "meta.json").is_file():
            raise FileNotFoundError(f"{data} has no {split!r} split ({root / split / 'meta.json'} missing)")
        provider = ShardProvider(root, seed)
    loader = Loader(provider, seq_len, global_batch, micro_batch, rank, world_size, seed, doc_starts,
                    sp_rank=sp_rank, sp_size=sp_size)
    if split != "train" or rank != 0:  # (validation reads its first windows only, up to the first repeat)
        return loader
    log = logging.getLogger("linscale.data")
    warning = repeats_within_a_step(provider, seq_len, global_batch)
    if warning:
        log.warning(warning)
        return loader
    epochs = source_epochs(provider, seq_len, global_batch, planned_steps)
    if epochs:
        log.info(f"the planned {planned_steps} steps read " + ", ".join(f"{n} {e:.3g}" for n, e in epochs.items())
                 + " epochs of the sources")
        warning = repeated_sources(provider, epochs, planned_steps, global_batch, seq_len)
        if warning:  # the embedded corpus is for trying the system out: repeating it is expected there
            (log.info if data is None else log.warning)(warning)
    return loader


def __getattr__(name: str):
    # the loader (and torch with it) is imported on first use: the prepare and merge tasks never need it
    if name in ("Loader", "ShardProvider", "doc_boundaries"):
        from . import loader
        return getattr(loader, name)
    raise AttributeError(name)


__all__ = ["build_loader", "Loader", "doc_boundaries", "EOT_ID", "ENCODING_NAME", "encode_batch",
           "encode_document", "get_tokenizer"]

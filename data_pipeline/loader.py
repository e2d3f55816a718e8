"""The resumable distributed loader: a deterministic global stream of windows, sliced per rank.

The global stream is a sequence of samples; sample k is window j of source i, where i comes from the
token-share schedule (mixing.py) and j counts that source's windows so far. Window j of a source is the
tokens [j*seq_len, j*seq_len + seq_len + 1) of the source's stream (consecutive windows overlap by one
token, so every token is a target exactly once). Each optimizer step consumes `global_batch`
consecutive samples; rank r of W takes samples [r*B/W, (r+1)*B/W) of the step, in B/(W*micro_batch)
micro-batches. Nothing here depends on W or workers, so a run resumed on another world size continues
the identical global stream.

With sequence parallelism (sp_size N > 1) the N ranks of a sequence-parallel group form one data-parallel
rank: each reads the same samples and keeps its segment, tokens [s*seq_len/N, (s+1)*seq_len/N) of every
window (s its rank in the group); `cu_seqlens` (doc_starts) still describes the whole windows, so that the
model's plan can tell which documents cross into a segment. The sample order depends on neither W nor N.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from .mixing import assign_sources, normalise_weights
from .shards import SourceMeta, TokenStore, read_meta
from .tokenizer import EOT_ID

STATE_VERSION = 2
# the epoch permutation scheme: part of the fingerprint, so that a state never resumes on another scheme
PERMUTATION = "feistel4-v1"


class WindowProvider(Protocol):
    """Fills one window of a source's token stream. Requests for one source come in increasing
    window order, except after load_state_dict of an earlier position (a streaming provider then replays
    that source's stream from its start)."""
    names: list[str]
    languages: list[str]
    weights: list[float]
    fingerprint: str

    def window(self, source: int, index: int, seq_len: int, out: np.ndarray) -> None: ...

    def describe(self) -> str: ...

    # optional, for providers that can seek (ShardProvider): cursors(counts, seq_len) gives where each
    # source's stream stands after counts[i] windows, for the loader state; seek(cursors) restores it


class ShardProvider:
    """Windows read from a prepared dataset's memory-mapped token shards."""

    def __init__(self, root: Path, seed: int, weights: dict[str, float] | None = None):
        self.root = Path(root)
        meta = read_meta(self.root)
        srcs = [SourceMeta(**s) for s in meta["sources"] if s["tokens"] > 0]
        if not srcs:
            raise ValueError(f"prepared dataset {root} holds no tokens")
        self.names = [s.name for s in srcs]
        self.languages = [s.language for s in srcs]
        weights = weights or {}
        unknown = set(weights) - set(self.names)
        if unknown:
            raise ValueError(f"weights name unknown sources {sorted(unknown)}; {root} has {self.names}")
        self.weights = [float(weights.get(s.name, s.weight)) for s in srcs]
        # stream ids come from the source name, so adding or removing another source leaves its order alone
        self.stores = [TokenStore(self.root, s, seed, stable_id(s.name)) for s in srcs]
        # the order digest of each source: the same documents in another order is other data
        self.fingerprint = digest({"sources": [(s.name, s.tokens, s.documents, s.order) for s in srcs],
                                    "weights": self.weights, "permutation": PERMUTATION})
        self.label = meta.get("label", str(self.root))

    def window(self, source: int, index: int, seq_len: int, out: np.ndarray) -> None:
        self.stores[source].read(index * seq_len, seq_len + 1, out)

    def distinct_windows(self, seq_len: int) -> list[int]:
        """Windows of each source inside its first epoch; later ones repeat its documents."""
        return [max(0, (st.total - 1) // seq_len) for st in self.stores]

    def cursors(self, counts: list[int], seq_len: int) -> list:
        return [list(st.cursor_at(c * seq_len)) for st, c in zip(self.stores, counts)]

    def seek(self, cursors: list) -> None:
        for st, c in zip(self.stores, cursors):
            st.set_cursor(c)  # an inconsistent cursor is ignored: the store then walks to the position

    def describe(self) -> str:
        w = normalise_weights(self.weights, self.names)
        parts = [f"{n}({lang}) {share:.1%} of {st.total / 1e6:.2f}M tok"
                 for n, lang, share, st in zip(self.names, self.languages, w, self.stores)]
        return f"{self.label}: " + ", ".join(parts)


class Loader:
    """See the module docstring. Use build_loader() rather than constructing this directly."""

    def __init__(self, provider: WindowProvider, seq_len: int, global_batch: int, micro_batch: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, doc_starts: bool = False,
                 sp_rank: int = 0, sp_size: int = 1):
        _check_batching(seq_len, global_batch, micro_batch, rank, world_size)
        if sp_size < 1 or not 0 <= sp_rank < sp_size or seq_len % sp_size:
            raise ValueError(f"sequence parallelism: seq_len {seq_len} must split into {sp_size} equal segments "
                             f"(and 0 <= sp rank {sp_rank} < {sp_size}); choose a --seq-len that --sp divides")
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.provider = provider
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.doc_starts = doc_starts
        self.per_rank = global_batch // world_size
        self.accum = self.per_rank // micro_batch
        self.weights = normalise_weights(provider.weights, provider.names)
        # position at the start of the current step: global samples consumed and samples per source
        self.samples = 0
        self.counts = [0] * len(provider.names)
        self.micro = 0
        self._plan: list[tuple[int, int]] = []
        self._next_counts: list[int] = []
        self._buf = np.empty((micro_batch, seq_len + 1), dtype=np.uint32)

    def _start_step(self) -> None:
        counts = list(self.counts)
        plan = assign_sources(self.weights, counts, self.global_batch)
        self._plan = plan[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
        self._next_counts = counts

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self.micro == 0:
            self._start_step()
        chunk = self._plan[self.micro * self.micro_batch:(self.micro + 1) * self.micro_batch]
        for row, (src, idx) in enumerate(chunk):
            self.provider.window(src, idx, self.seq_len, self._buf[row])
        self.micro += 1
        if self.micro == self.accum:
            self.micro = 0
            self.samples += self.global_batch
            self.counts = self._next_counts
        window = torch.from_numpy(self._buf.astype(np.int64))
        batch = {"input_ids": window[:, :-1], "targets": window[:, 1:]}
        if self.doc_starts:
            batch["cu_seqlens"] = doc_boundaries(batch["input_ids"])  # over the whole windows
        seg = self.seq_len // self.sp_size
        cols = slice(self.sp_rank * seg, (self.sp_rank + 1) * seg)
        for key in ("input_ids", "targets"):
            batch[key] = batch[key][:, cols].contiguous()
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """A few integers per source, the same on every rank: position at the start of the current step
        and, for prepared data, each source's cursor there (so a resume seeks without walking)."""
        cursors = self.provider.cursors(self.counts, self.seq_len) if hasattr(self.provider, "cursors") else None
        return {"version": STATE_VERSION, "fingerprint": self.provider.fingerprint, "seed": self.seed,
                "seq_len": self.seq_len, "samples": self.samples, "counts": list(self.counts),
                "micro": self.micro, "global_batch": self.global_batch, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "cursors": cursors}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not {STATE_VERSION}")
        for key, mine in (("fingerprint", self.provider.fingerprint), ("seed", self.seed),
                          ("seq_len", self.seq_len)):
            if state[key] != mine:
                what = ("the data, its document order or the permutation scheme differ"
                        if key == "fingerprint" else "")
                raise ValueError(f"loader state was saved with {key}={state[key]!r} but this loader has "
                                 f"{mine!r}{': ' + what if what else ''}; resume with the same data, seed "
                                 f"and seq_len")
        if len(state["counts"]) != len(self.counts) or sum(state["counts"]) != state["samples"]:
            raise ValueError("loader state is inconsistent (per-source counts do not add up)")
        if state["micro"] and (state["world_size"], state["global_batch"], state["micro_batch"]) != \
                (self.world_size, self.global_batch, self.micro_batch):
            raise ValueError("loader state was saved in the middle of an optimizer step; it can only be "
                             "resumed with the same world size, global batch and micro batch")
        self.samples = int(state["samples"])
        self.counts = [int(c) for c in state["counts"]]
        if state.get("cursors") and hasattr(self.provider, "seek"):
            self.provider.seek(state["cursors"])
        self.micro = 0
        if state["micro"]:
            self._start_step()
            self.micro = int(state["micro"])

    def describe(self) -> str:
        return (f"{self.provider.describe()} | seq_len {self.seq_len}, global batch {self.global_batch} "
                f"= {self.world_size} ranks x micro {self.micro_batch} x accumulation {self.accum}, seed {self.seed}"
                + (f"; segment {self.sp_rank + 1} of {self.sp_size} of each sequence" if self.sp_size > 1 else ""))


def doc_boundaries(input_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens over the flattened [B*T] input: int32 offsets where a segment starts, plus B*T at the
    end. A segment starts at every row start and after every <|endoftext|>; a row that begins
    mid-document starts a segment too (the state is reset there, as at a row start anyway)."""
    b, t = input_ids.shape
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == EOT_ID
    flat = torch.nonzero(starts.reshape(-1), as_tuple=False).reshape(-1)
    return torch.cat([flat, torch.tensor([b * t])]).to(torch.int32)


def stack_batches(batches: list[dict[str, torch.Tensor]], seq_len: int) -> dict[str, torch.Tensor]:
    """Batches of this loader joined along the batch dimension, as one batch of all their rows would be:
    `cu_seqlens` (over whole windows of seq_len tokens) shifted by each batch's first row."""
    out = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "targets")}
    if "cu_seqlens" in batches[0]:
        cu, rows = [], 0
        for b in batches:
            cu.append(b["cu_seqlens"][:-1] + rows * seq_len)
            rows += len(b["input_ids"])
        out["cu_seqlens"] = torch.cat(cu + [torch.tensor([rows * seq_len], dtype=torch.int32)]).to(torch.int32)
    return out


def first_pass(loader: Loader) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches up to the first that would read past one of its sources' first epoch: a held-out
    set read further would weigh some text twice. Unbounded for providers that cannot count their windows
    without reading them (streaming)."""
    provider = loader.provider
    caps = provider.distinct_windows(loader.seq_len) if hasattr(provider, "distinct_windows") else None
    while True:
        batch = loader.next_batch()
        # the windows this batch holds (loader.counts moves only at a step's end, after all its micro-batches)
        m = loader.micro or loader.accum
        served = loader._plan[(m - 1) * loader.micro_batch:m * loader.micro_batch]
        if caps is not None and any(idx >= caps[src] for src, idx in served):
            return
        yield batch


def repeats_within_a_step(provider: WindowProvider, seq_len: int, global_batch: int) -> str | None:
    """A warning when the sources that are mixed in hold fewer distinct windows (whole windows inside their
    first epoch) than one global batch: every step then repeats their documents, most likely a dataset or
    batch size given by mistake for a real run (a smoke test of a large model on a small corpus is not, so
    it is a warning, not an error). None when a step fits, and for providers that cannot count without
    reading (streaming)."""
    if not isinstance(provider, ShardProvider):
        return None
    mixed = [i for i, w in enumerate(provider.weights) if w > 0]
    windows = provider.distinct_windows(seq_len)
    have = sum(windows[i] for i in mixed)
    if have >= global_batch:
        return None
    tokens = sum(provider.stores[i].total for i in mixed)
    return (f"{provider.describe()}: holds {have} distinct sequences of {seq_len + 1} tokens ({tokens:,} tokens), "
            f"fewer than one global batch of {global_batch}: every step repeats its documents. For a real run "
            f"lower the global batch (--global-batch-tokens) or --seq-len, or prepare more data")


def repeated_sources(provider: WindowProvider, epochs: dict[str, float], steps: int, global_batch: int,
                     seq_len: int) -> str | None:
    """A warning naming each source that the planned run reads more than once (`epochs`: source_epochs), whose
    documents then repeat: the mix wraps a small source around by design, so it is a warning. None when every
    source stays inside one epoch."""
    over = ", ".join(f"{n} {e:.2f}" for n, e in epochs.items() if e > 1)
    if not over:
        return None
    return (f"{provider.describe()}: the planned {steps} steps of {global_batch} x {seq_len} tokens read a source "
            f"more than once (epochs: {over}), so its documents repeat; prepare more data for it, or lower its "
            f"weight")


def source_epochs(provider: WindowProvider, seq_len: int, global_batch: int, steps: int | None
                  ) -> dict[str, float]:
    """{source: epochs the planned steps read of it} for every source with a positive weight; {} when the
    run has no step limit or the provider cannot count its windows without reading them (streaming)."""
    if not isinstance(provider, ShardProvider) or not steps:
        return {}
    share = normalise_weights(provider.weights, provider.names)
    windows = provider.distinct_windows(seq_len)
    out = {}
    for name, w, have in zip(provider.names, share, windows):
        if w > 0:
            out[name] = math.inf if have == 0 else float(w) * steps * global_batch / have
    return out


def _check_batching(seq_len: int, global_batch: int, micro_batch: int, rank: int, world_size: int) -> None:
    if seq_len < 1 or micro_batch < 1 or global_batch < 1 or world_size < 1:
        raise ValueError(f"seq_len, global_batch, micro_batch and world_size must be positive, got "
                         f"{seq_len}, {global_batch}, {micro_batch}, {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if global_batch % world_size:  # no micro batch can help: the batch does not split over the ranks
        unit = world_size * micro_batch
        near = sorted({max(1, global_batch // unit) * unit, -(-global_batch // unit) * unit})
        raise ValueError(f"global batch {global_batch} is not a multiple of world size x micro batch "
                         f"= {world_size} x {micro_batch}: it does not split evenly over {world_size} ranks; "
                         f"choose a global batch of {' or '.join(map(str, near))}")
    if global_batch % (world_size * micro_batch):
        raise ValueError(f"global batch {global_batch} is not a multiple of world size x micro batch "
                         f"= {world_size} x {micro_batch}; choose a micro batch that divides {global_batch // world_size}")


def stable_id(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]

"""Copy a state (nested dicts/lists/tuples of tensors) to host memory, so it can be written in the
background while training goes on changing the live tensors.

Each state gets one flat host buffer (an arena), reused from one save to the next while the shapes and
dtypes stay the same; every tensor of the state is a view at a fixed offset. The arena starts pageable and
is page-locked afterwards in pieces of PIECE_BYTES (`pin_some`, called between training steps with a time
budget), because pinning gigabytes at once holds the training thread's CUDA calls for seconds (see
cuda_host.py). Copies into a piece that is not pinned yet are simply synchronous, so a save that comes
before the pinning is done is still correct, only its staging is slower.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Iterator

import torch

from checkpoints import cuda_host

PAGE = 4096
ALIGN = 64                 # every tensor starts at a multiple of this (any dtype's element size divides it)
PIECE_BYTES = 64 << 20     # unit of page-locking: ~10-20 ms of cudaHostRegister each (see docs/benchmarks.md)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested state, in a fixed order (dict insertion order, then sequence order)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def _rebuild(obj: Any, views: Iterator[torch.Tensor]) -> Any:
    """`obj` with its tensors replaced, in `tensors_in` order, by the next items of `views`."""
    if isinstance(obj, torch.Tensor):
        return next(views)
    if isinstance(obj, dict):
        out = {k: _rebuild(v, views) for k, v in obj.items()}
        if type(obj) is not dict:
            try:
                out = type(obj)(out)  # OrderedDict (a module's state_dict) stays one
            except TypeError:
                pass
        if hasattr(obj, "_metadata") and type(out) is not dict:  # module versions, read by load_state_dict
            out._metadata = getattr(obj, "_metadata")
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_rebuild(v, views) for v in obj))
    if isinstance(obj, (list, tuple)):
        items = [_rebuild(v, views) for v in obj]
        if type(obj) in (list, tuple):
            return type(obj)(items)
        # a subclass keeps its type: DeepSpeed's ZeRO-3 model states hold each parameter's shape as a
        # torch.Size, and zero_to_fp32 calls .numel() on it (a plain tuple has none)
        try:
            return type(obj)(items)
        except TypeError:
            return items if isinstance(obj, list) else tuple(items)
    return obj  # numbers, strings, None, other objects: the caller copies them if they can change


def _unpin(storage: torch.Tensor, ptrs: list[int]) -> None:
    for p in ptrs:
        try:
            cuda_host.unregister(p)
        except Exception:  # noqa: BLE001 - freeing at teardown must not raise
            pass
    ptrs.clear()


class _Arena:
    """One flat, page-aligned host buffer holding every tensor of one state at a fixed offset."""

    def __init__(self, signature: tuple, pinnable: bool, piece_bytes: int) -> None:
        self.signature = signature
        offsets, total = [], 0
        for shape, dtype in signature:
            offsets.append(total)
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            total += -(-n // ALIGN) * ALIGN
        span = -(-max(total, 1) // PAGE) * PAGE
        self.storage = torch.empty(span + PAGE, dtype=torch.uint8)  # pageable; pages appear when touched
        self.start = (-self.storage.data_ptr()) % PAGE              # so every piece is page aligned
        self.nbytes = total
        self.piece_bytes = piece_bytes
        self.bounds = list(range(0, span, piece_bytes)) + [span]
        # Each view gets a storage of its own over its bytes (torch.frombuffer), not a slice of the arena's:
        # torch.save writes a tensor's whole storage, so slices would each drag the full arena into a file.
        raw = memoryview(self.storage.numpy())
        self.views = []
        for (shape, dtype), off in zip(signature, offsets):
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if n == 0:
                self.views.append(torch.empty(shape, dtype=dtype))
                continue
            flat = torch.frombuffer(raw, dtype=torch.uint8, count=n, offset=self.start + off)
            self.views.append(flat.view(dtype).view(shape))
        self.offsets = offsets
        self.touched = 0           # pieces whose pages exist (written once)
        self.pinned = 0            # pieces page-locked, always a prefix
        self.pinnable = pinnable and cuda_host.available()
        self._pinned_ptrs: list[int] = []
        # unpin before the memory goes back to the allocator (the finalizer keeps `storage` alive until then)
        self._finalizer = weakref.finalize(self, _unpin, self.storage, self._pinned_ptrs)
        self._finalizer.atexit = False

    @property
    def pieces(self) -> int:
        return len(self.bounds) - 1

    def _piece_ptr(self, i: int) -> tuple[int, int]:
        return self.storage.data_ptr() + self.start + self.bounds[i], self.bounds[i + 1] - self.bounds[i]

    def touch(self) -> None:
        """Fault in every page (in the caller's thread): registering untouched memory would do it under
        the driver's lock."""
        while self.touched < self.pieces:
            a, b = self.bounds[self.touched], self.bounds[self.touched + 1]
            self.storage[self.start + a: self.start + b].fill_(0)
            self.touched += 1

    def pin_next(self) -> bool:
        """Page-lock the next touched piece; False when there is nothing (more) to do."""
        if not self.pinnable or self.pinned >= min(self.touched, self.pieces):
            return False
        ptr, n = self._piece_ptr(self.pinned)
        if not cuda_host.register(ptr, n):
            self.pinnable = False  # the driver refused (e.g. a locked-memory limit): stay pageable
            return False
        self._pinned_ptrs.append(ptr)
        self.pinned += 1
        return True

    def copy_in(self, tensors: list[torch.Tensor]) -> bool:
        """Copy `tensors` into their views; returns whether any copy was an asynchronous GPU copy."""
        used_cuda = False
        for src, dst, off in zip(tensors, self.views, self.offsets):
            src = src.detach()
            if src.numel() == 0:
                continue
            if not src.is_cuda:
                dst.copy_(src)
                continue
            used_cuda = True
            s, d = src.reshape(-1), dst.view(-1)
            es = src.element_size()
            # split at piece boundaries: a copy must not straddle a pinned and a pageable piece
            a = off
            end = off + s.numel() * es
            while a < end:
                b = min(end, (a // self.piece_bytes + 1) * self.piece_bytes)
                d[(a - off) // es:(b - off) // es].copy_(s[(a - off) // es:(b - off) // es], non_blocking=True)
                a = b
        self.touched = self.pieces  # a full copy wrote every page
        return used_cuda


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


class StagingBuffers:
    """Host copies of states, one arena per `key`, reused while a state's shapes and dtypes stay the same.

    Threads: `reserve` may run in a background thread; `stage` and `pin_some` run in the training thread,
    and `stage` only while no background write reads the arenas (the manager waits for the writer first).
    """

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        if piece_bytes % PAGE:
            raise ValueError(f"piece_bytes={piece_bytes} must be a multiple of {PAGE}")
        self.piece_bytes = piece_bytes
        self._arenas: dict[str, _Arena] = {}

    def _arena(self, key: str, tensors: list[torch.Tensor]) -> _Arena:
        sig = _signature(tensors)
        arena = self._arenas.get(key)
        if arena is None or arena.signature != sig:
            arena = _Arena(sig, pinnable=any(t.is_cuda for t in tensors), piece_bytes=self.piece_bytes)
            self._arenas[key] = arena  # the old one (if any) is unpinned and freed when dropped
        return arena

    def reserve(self, obj: Any, key: str = "") -> None:
        """Allocate and touch the arena that stage(obj, key) will use, without copying (only shapes and
        dtypes of `obj` are read). Meant for a background thread, right after the first training step."""
        self._arena(key, list(tensors_in(obj))).touch()

    def stage(self, obj: Any, key: str = "") -> Any:
        """A copy of `obj` whose tensors are views into host memory sharing nothing with the originals.
        The copy stays valid until the next stage() with the same key."""
        tensors = list(tensors_in(obj))
        arena = self._arena(key, tensors)
        # A fresh arena (no reserve: DeepSpeed's first save) is faulted in first: a GPU copy into untouched
        # pageable memory ran at 1.0 GB/s on an H200 host, into touched memory at 14.5 GB/s, and touching
        # 4 GB took 0.5 s (docs/benchmarks.md).
        arena.touch()
        if arena.copy_in(tensors):
            torch.cuda.synchronize()  # the non-blocking copies must land before anyone reads them
        return _rebuild(obj, iter(arena.views))

    def pin_some(self, budget_s: float) -> int:
        """Page-lock pieces until `budget_s` seconds are spent (at least one piece when any is left).
        Returns how many were pinned. Called between steps, in the training thread (the CUDA device)."""
        t0 = time.perf_counter()
        done = 0
        for arena in list(self._arenas.values()):
            while arena.pin_next():
                done += 1
                if time.perf_counter() - t0 >= budget_s:
                    return done
        return done

    @property
    def fully_pinned(self) -> bool:
        """Nothing left that pin_some could do."""
        return all(not a.pinnable or a.pinned >= a.pieces for a in self._arenas.values())

    def stats(self) -> dict:
        return {"bytes": sum(a.nbytes for a in self._arenas.values()),
                "pieces": sum(a.pieces for a in self._arenas.values()),
                "pinned": sum(a.pinned for a in self._arenas.values())}

    def release(self) -> None:
        """Unpin and free every arena (no write may be using them)."""
        for arena in self._arenas.values():
            arena._finalizer()
        self._arenas.clear()

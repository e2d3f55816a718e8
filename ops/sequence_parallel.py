"""Sequence parallelism for the linear-attention ops: the LASP-2 state exchange.

Each micro-batch's sequences are split along time over the `size` ranks of a sequence-parallel group;
rank r holds the r-th of `size` consecutive segments of every sequence (the trainer's are of equal length;
nothing here depends on the other ranks' lengths). A linear-attention layer needs from the ranks before it
only one fixed-size state per sequence, so a layer runs as:

1. each rank summarises its segment: the state S_r its tokens build from zero (from the segment start or
   from its last document start, whichever is later), the factor D_r by which the segment decays a state
   that enters it (the product of its decays; 0 when a document starts inside the segment), and whether
   its first token continues the previous rank's document (g_r);
2. one all-gather of (S, D, g) over the group (per sequence H x Dk x Dv + H x Dk + 1 numbers per rank);
3. each rank forms its incoming state by the scan C_r = D_r * g_r C_{r-1} + S_r, I_r = g_r C_{r-1}
   (every rank scans all ranks and selects its own prefix: see `segment_prefix`);
4. the op runs on the local segment with `initial_state` = I_r (the ops' initial-state interface; with
   `cu_seqlens` only the segment's first document gets it).

The backward mirrors it through autograd: the op returns the initial state's gradient, the scan is plain
tensor algebra, and the all-gather's backward sums every rank's gradient for a state onto the rank that
owns it (a reduce-scatter), from where it flows into k, v and the decays of that rank's segment.

Nothing here is model code: `sequence_parallel(sp)` makes `lightning_attn` and `gated_linear_attn` run this
way for the calls made inside it (the model plan in `pretrain.sequence_parallel` enters it around the
model's forward), and `segment_prefix` serves any other diagonal recurrence (cosFormer2's TPE).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
import torch.utils.checkpoint
from torch import Tensor

from ops.reference import log_decay, state_dtype


@dataclass
class Segments:
    """Where the local tokens sit in the micro-batch's sequences.

    Args:
        rows: sequences in the micro-batch. Without `cu_seqlens` the ops read it from the batch dimension;
            with `cu_seqlens` (packed into one row of rows x seg_len tokens) it must be given here.
        continues: [rows] bool, True where the row's first local token continues the document that the
            previous rank's segment of that row ends in. None: every row continues on ranks > 0 (one
            document per sequence, or no document resets).
    """
    rows: int | None = None
    continues: Tensor | None = None


class SequenceParallel:
    """A sequence-parallel group and the segment layout of the micro-batch being run.

    Args:
        group: the process group of the ranks that share each sequence (None: the default group).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        # the functional collective needs the group itself, not None for the default one
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.segments = Segments()
        self._rank_index = {torch.device("cpu"): torch.tensor([self.rank])}

    def rank_index(self, device: torch.device) -> Tensor:
        """[1] int64 tensor holding this rank (the scan of `segment_prefix` selects by it). Made once per
        device, outside compiled code, so that a compiled graph takes it as an input, never a constant."""
        device = torch.device(device)
        if device not in self._rank_index:
            index = self._rank_index[torch.device("cpu")].to(device)
            if torch.compiler.is_compiling():
                return index
            self._rank_index[device] = index
        return self._rank_index[device]

    def continues(self, rows: int, device: torch.device) -> Tensor:
        c = self.segments.continues
        if c is None:
            return torch.full((rows,), self.rank > 0, dtype=torch.bool, device=device)
        if c.numel() != rows:
            raise ValueError(f"sequence parallel: `continues` has {c.numel()} entries for {rows} rows")
        return c.to(device=device, dtype=torch.bool)


_ACTIVE: list[SequenceParallel] = []


@contextlib.contextmanager
def sequence_parallel(sp: SequenceParallel | None) -> Iterator[None]:
    """Run the linear-attention ops called inside as segments of `sp`'s sequences (None: no-op)."""
    if sp is None:
        yield
        return
    enter(sp)
    try:
        yield
    finally:
        leave()


def enter(sp: SequenceParallel) -> None:
    """`sequence_parallel` split in two, for module hooks (a forward pre-hook enters, a forward hook
    registered with always_call=True leaves)."""
    _ACTIVE.append(sp)


def leave() -> None:
    _ACTIVE.pop()


def active() -> SequenceParallel | None:
    return _ACTIVE[-1] if _ACTIVE else None


# ----------------------------------------------------------------------------------------------------
# the collective and the scan
# ----------------------------------------------------------------------------------------------------

# The all-gather is a functional collective (a traceable op with its own autograd formula, the same one
# DTensor and FSDP2 use under torch.compile): Dynamo keeps it inside the compiled block graph, so the
# token mixer compiles without a graph break and Inductor schedules it like any other op. Its backward is
# a reduce-scatter: each rank receives the sum over ranks of the gradient of the slice it contributed.
# torch 2.13 renames it; the GPU image's torch has only the old name.
_all_gather_autograd = (getattr(fcol, "all_gather_single_autograd", None)
                        or getattr(fcol, "all_gather_tensor_autograd"))


def _all_gather(x: Tensor, sp: SequenceParallel) -> Tensor:
    """[n, ...] -> [size, n, ...], rank r's tensor at index r; differentiable (see above)."""
    every = _all_gather_autograd(x.contiguous(), 0, sp.group)   # ranks' tensors one after another in dim 0
    return every.view(sp.size, *x.shape)


def segment_prefix(sp: SequenceParallel, state: Tensor, transfer: Tensor, continues: Tensor) -> Tensor:
    """The state that enters this rank's segment of each row (steps 2 and 3 of the module docstring).

    Args:
        sp: the sequence-parallel group.
        state: [rows, *S] the state the local segment builds from zero (from its last document start).
        transfer: [rows, *F], F broadcastable to S: the factor by which the segment decays an incoming
            state (0 where a document starts inside the segment).
        continues: [rows] bool, whether the segment's first token continues the previous rank's document.

    Returns:
        [rows, *S]: sum_{r' < r} (prod_{r' < j < r} D_j) S_{r'}, cut at documents that do not continue;
        zero on the first rank. Differentiable in `state` and `transfer` (on every rank).
    """
    rows, s_shape, f_shape = state.shape[0], state.shape[1:], transfer.shape[1:]
    n_s, n_f = state[0].numel(), transfer[0].numel()
    packed = torch.cat([state.reshape(rows, n_s), transfer.to(state.dtype).reshape(rows, n_f),
                        continues.to(state.dtype).reshape(rows, 1)], dim=1)
    every = _all_gather(packed, sp)                                        # [size, rows, n]
    # Every rank runs the same scan, over all ranks, and picks its own prefix by a tensor index: a
    # compiled graph then cannot tell which prefix is used. The backward's reduce-scatter must run on every
    # rank, in the same place: with the scan cut at this rank, the first rank would use nothing of the
    # gathered tensor (autograd would skip the collective's backward there), and any stand-in dependency
    # (x * 0) is constant-folded by Inductor, which then moves that rank's collective into the forward
    # graph, out of step with the other ranks.
    carry = torch.zeros((rows, *s_shape), dtype=state.dtype, device=state.device)
    prefixes = [carry]
    for r in range(sp.size - 1):
        S = every[r, :, :n_s].reshape(rows, *s_shape)
        D = every[r, :, n_s:n_s + n_f].reshape(rows, *f_shape)
        g = every[r, :, -1].reshape(rows, *([1] * len(s_shape)))
        carry = D * (g * carry) + S
        prefixes.append(carry)
    mine = torch.stack(prefixes).index_select(0, sp.rank_index(state.device))[0]
    g = continues.to(state.dtype).reshape(rows, *([1] * len(s_shape)))
    return g * mine


# ----------------------------------------------------------------------------------------------------
# segment summaries and the sequence-parallel ops
# ----------------------------------------------------------------------------------------------------

def _row_layout(cu_seqlens: Tensor, rows: int, seg: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each row of a packed [rows*seg] input: the index of its first document, the local offset of its
    last document start (tokens before it do not reach the row's final state) and whether a document
    starts inside it (after its first token)."""
    starts = cu_seqlens[:-1].long()
    row_start = torch.arange(rows, device=starts.device) * seg
    first_doc = torch.searchsorted(starts, row_start)
    last_doc = torch.searchsorted(starts, row_start + seg) - 1
    last_start = starts[last_doc] - row_start
    return first_doc, last_start, last_start > 0


def _fp32(x: Tensor):
    """States stay in fp32 under a bf16 autocast (which would run the summing einsum in bf16)."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def _rows_and_seg(sp: SequenceParallel, q: Tensor, cu_seqlens: Tensor | None, op: str) -> tuple[int, int]:
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return B, T
    rows = sp.segments.rows
    if rows is None or rows < 1 or T % rows:
        raise ValueError(f"{op} under sequence parallelism with cu_seqlens: the packed row of {T} tokens must "
                         f"be `Segments.rows` sequences of equal length; rows is {rows}")
    return rows, T // rows


def _finish(sp: SequenceParallel, fn: Callable, q, k, v, x, S, D, rows, cu_seqlens, first_doc):
    incoming = segment_prefix(sp, S, D, sp.continues(rows, q.device))
    if cu_seqlens is None:
        h0 = incoming
    else:  # only each row's first document enters with a carried state
        n_docs = cu_seqlens.numel() - 1
        h0 = incoming.new_zeros(n_docs, *incoming.shape[1:]).index_copy(0, first_doc, incoming)
    return fn(q, k, v, x, h0, cu_seqlens)


def _lightning_summary(k: Tensor, v: Tensor, decay: Tensor | None, keep: Tensor | None, inner: Tensor | None,
                       rows: int, seg: int) -> tuple[Tensor, Tensor]:
    """S [rows, H, Dk, Dv] = sum_t decay^(seg-1-t) k_t v_t^T over the kept tokens (from the row's last
    document start), and the transfer D [rows, H, Dk, 1] = decay^seg (0 where a document starts inside)."""
    H, Dk, Dv = k.shape[2], k.shape[3], v.shape[3]
    sd = state_dtype(k)
    log_lam = torch.zeros(H, dtype=sd, device=k.device) if decay is None else log_decay(decay, sd)
    t = torch.arange(seg, device=k.device, dtype=sd)
    w = torch.exp(log_lam[None, :] * (seg - 1 - t)[:, None]).expand(rows, seg, H)
    D = torch.exp(log_lam * seg).expand(rows, H)
    if keep is not None:
        w = w * keep.to(sd)[:, :, None]
        D = D * (~inner).to(sd)[:, None]
    with _fp32(k):
        S = torch.einsum("bthk,bth,bthv->bhkv", k.reshape(rows, seg, H, Dk).to(sd), w,
                         v.reshape(rows, seg, H, Dv).to(sd))
    return S, D[:, :, None, None].expand(rows, H, Dk, 1)


# steps of the inner scan of `suffix_after`
_SCAN_BLOCK = 64


def suffix_after(x: Tensor) -> Tensor:
    """sum_{u > t} x_u along dim 1 (0 at the last step), summed from the end, never as a difference of
    prefix sums: with x = log f <= 0 every partial sum has one sign, so nothing cancels.

    Two levels: a reverse scan inside blocks of 64 steps, then one over the blocks' totals along the last
    dimension. CUDA scans a dimension that is not the last with one thread per column walking every step
    (at 32K tokens x 12 heads x 128 channels: 1,536 threads, 32K steps each); here the long scan runs
    along the last dimension and the one along time is 64 steps long.

    Args:
        x: [rows, T, ...].
    Returns:
        [rows, T, ...], x's dtype.
    """
    rows, T, rest = x.shape[0], x.shape[1], x.shape[2:]
    b = _SCAN_BLOCK
    xb = torch.nn.functional.pad(x, (0, 0) * len(rest) + (0, -T % b)).view(rows, -1, b, *rest)
    within = _sum_after(xb, 2)
    later = _sum_after(xb.sum(2).movedim(1, -1), -1).movedim(-1, 1)            # [rows, blocks, ...]
    return (within + later.unsqueeze(2)).reshape(rows, -1, *rest)[:, :T]


def _sum_after(x: Tensor, dim: int) -> Tensor:
    """sum_{u > t} x_u along `dim` in one scan from the end."""
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x.narrow(dim, 1, x.shape[dim] - 1), torch.zeros_like(last)], dim=dim).flip(dim) \
        .cumsum(dim).flip(dim)


def _gla_summary(k: Tensor, v: Tensor, log_f: Tensor, keep: Tensor | None, inner: Tensor | None,
                 rows: int, seg: int) -> tuple[Tensor, Tensor]:
    """S = sum_t exp(sum_{u>t} log_f_u) * k_t v_t^T over the kept tokens, D = exp(sum_t log_f_t)."""
    H, Dk, Dv = k.shape[2], k.shape[3], v.shape[3]
    sd = state_dtype(k)
    lf = log_f.reshape(rows, seg, H, Dk).to(sd)
    w = suffix_after(lf).exp()
    D = lf.sum(1).exp()                                                        # [rows, H, Dk]
    if keep is not None:
        w = w * keep.to(sd)[:, :, None, None]
        D = D * (~inner).to(sd)[:, None, None]
    with _fp32(k):
        S = torch.einsum("bthk,bthv->bhkv", k.reshape(rows, seg, H, Dk).to(sd) * w,
                         v.reshape(rows, seg, H, Dv).to(sd))
    return S, D[..., None]


def _summarise(sp: SequenceParallel, summary: Callable, q: Tensor, k: Tensor, v: Tensor, x: Tensor | None,
               cu_seqlens: Tensor | None, op: str):
    rows, seg = _rows_and_seg(sp, q, cu_seqlens, op)
    first_doc = keep = inner = None
    if cu_seqlens is not None:
        first_doc, last_start, inner = _row_layout(cu_seqlens, rows, seg)
        keep = torch.arange(seg, device=q.device)[None, :] >= last_start[:, None]
    args = (k, v, x, keep, inner, rows, seg)
    if torch.is_grad_enabled():
        # recomputed in the backward: the fp32 [tokens, H, Dk] intermediates would otherwise stay alive
        # for every layer (at 64K tokens a rank, 12 heads of 128: 0.4 GB each)
        S, D = torch.utils.checkpoint.checkpoint(summary, *args, use_reentrant=False)
    else:
        S, D = summary(*args)
    return S, D, rows, first_doc


def lightning_attn_sp(sp: SequenceParallel, fn: Callable, q: Tensor, k: Tensor, v: Tensor,
                      decay: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """`lightning_attn` on this rank's segments; `fn` is the chosen implementation (q, k, v, decay,
    initial_state, cu_seqlens) -> (o, final_state). Returns what `fn` returns for the local segment (its
    final state is the sequence's final state on the last rank)."""
    S, D, rows, first_doc = _summarise(sp, _lightning_summary, q, k, v, decay, cu_seqlens, "lightning_attn")
    return _finish(sp, fn, q, k, v, decay, S, D, rows, cu_seqlens, first_doc)


def gated_linear_attn_sp(sp: SequenceParallel, fn: Callable, q: Tensor, k: Tensor, v: Tensor,
                         log_f: Tensor, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """`gated_linear_attn` on this rank's segments (as `lightning_attn_sp`)."""
    S, D, rows, first_doc = _summarise(sp, _gla_summary, q, k, v, log_f, cu_seqlens, "gated_linear_attn")
    return _finish(sp, fn, q, k, v, log_f, S, D, rows, cu_seqlens, first_doc)


def run(op: str, fn: Callable, q: Tensor, k: Tensor, v: Tensor, x: Tensor | None,
        initial_state: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """Dispatch point of the public ops: `fn` as is, or under the active sequence-parallel group."""
    sp = active()
    if sp is None or sp.size == 1:
        return fn(q, k, v, x, initial_state, cu_seqlens)
    if initial_state is not None:
        raise ValueError(f"{op}: an initial state cannot be passed under sequence parallelism (the state that "
                         f"enters each rank's segment comes from the ranks before it); call it without "
                         f"initial_state, or run it on the whole sequence on one rank (outside "
                         f"`sequence_parallel`) to start from a state")
    body = lightning_attn_sp if op == "lightning_attn" else gated_linear_attn_sp
    return body(sp, fn, q, k, v, x, cu_seqlens)

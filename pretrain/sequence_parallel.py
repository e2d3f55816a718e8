"""Sequence parallelism (`--sp N`) applied to a linear language model from outside, as torchtitan applies
its parallelisms: the model code is the one-device code; this plan attaches hooks that

* turn the micro-batch's document layout (`cu_seqlens` over the full sequences) into the local one, and
  record where the local segment sits (`ops.sequence_parallel.Segments`). A rank's segment is its input:
  the trainer splits every sequence into N equal segments, but the segments may have any lengths (in rank
  order); where a rank needs to know where its segment starts (packed documents, cos2's positions), the
  ranks exchange their segments' lengths (`segment_starts`);
* run the model's forward inside `ops.sequence_parallel.sequence_parallel` (and each token mixer, through a
  subclass of its class, when activation checkpointing recomputes it in the backward), so that
  `lightning_attn` and `gated_linear_attn` exchange states with the other ranks of the group (LASP-2), a
  recomputed mixer with the document layout and positions of the micro-batch it recomputes;
* give cosFormer2's LRPE the tokens' global positions and carry its TPE recurrence across ranks with the
  same exchange;
* make the loss the mean over all counted tokens of the group's sequences (the value every rank reports) while
  each rank's gradient is that of its own tokens' share of it, scaled so that the data-parallel gradient
  average over all ranks (DDP or DeepSpeed, which see every rank as data parallel) gives exactly the
  gradient of the mean loss over the dp groups' sequences.

Norms, MLPs, embeddings and the loss run on the local segment. Ranks [k*N, (k+1)*N) form sequence-parallel
group k (neighbours share a node, where the exchange is cheapest); group k is data-parallel rank k.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from models.lm import IGNORE_INDEX
from models.registry import arch_names, get_arch
from ops.sequence_parallel import Segments, SequenceParallel, active, enter, leave, segment_prefix


def build_groups(sp_size: int) -> tuple[SequenceParallel, int, int]:
    """The sequence-parallel group of this rank (every rank must call it: group creation is collective).
    Returns (its SequenceParallel, data-parallel rank, data-parallel size)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"--sp {sp_size} must divide the number of ranks ({world})")
    mine = None
    for first in range(0, world, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = group
    return SequenceParallel(mine), rank // sp_size, world // sp_size


def segment_starts(sp: SequenceParallel, seg_len: int, device: torch.device) -> Tensor:
    """[size + 1] int64 on `device`: where each rank's segment starts in the sequences (entry r) and the
    sequences' length (the last entry), from every rank's segment length. One all-gather of one number a
    rank, queued like any op: reading the result on the host waits for it (and for the work before it)."""
    mine = torch.full((1,), seg_len, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(sp.size)]
    dist.all_gather(every, mine, group=sp.group)
    return torch.cat([mine.new_zeros(1), torch.cat(every).cumsum(0)])


def local_documents(cu_seqlens: Tensor, rows: int, start: int, seg_len: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """From cu_seqlens over the full sequences (flattened [rows, seq_len], as the loader and a one-rank run
    give it) to those of this rank's segment, tokens [start, start + seg_len) of each sequence: the offsets
    of document starts in its flattened [rows, seg_len] segments, every row start included (the ops run
    each row's segment as documents), and for each row whether its first token continues the document the
    previous rank's segment of that row ends in."""
    T = seq_len
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != rows * T:
        raise ValueError(f"under sequence parallelism cu_seqlens describes the full sequences: it must run from "
                         f"0 to {rows} x {T} = {rows * T} (rows x seq_len, the ranks' segments together), got "
                         f"{bounds[0]} ... {bounds[-1]}; the local [{rows}, {seg_len}] segment is cut out of them "
                         f"by the plan")
    starts = set(bounds[:-1])
    # one device runs packed rows as one long row, so a document without a start at a row boundary carries
    # its state from the end of one sequence into the next; here the last rank of row b - 1 never hands its
    # state to the first rank of row b, so such a layout would give other numbers: refuse it
    joined = [b for b in range(1, rows) if b * T not in starts]
    if joined:
        raise ValueError(f"under sequence parallelism every sequence starts a document: cu_seqlens must hold "
                         f"each row start (multiples of seq_len {T}), but {joined[0] * T} (row {joined[0]}) is "
                         f"missing; a document that runs on from one row into the next trains only without "
                         f"--sp (the loader's document offsets always start each row)")
    local, continues = [], []
    for b in range(rows):
        lo = b * T + start
        continues.append(lo not in starts)
        local.append(b * seg_len)
        local += [b * seg_len + s - lo for s in bounds[:-1] if lo < s < lo + seg_len]
    local.append(rows * seg_len)
    return (torch.tensor(local, dtype=cu_seqlens.dtype, device=cu_seqlens.device),
            torch.tensor(continues, dtype=torch.bool))


class SequenceParallelPlan:
    """The hooks of one model. Keep the object: `remove()` takes them off again."""

    def __init__(self, model: nn.Module, sp: SequenceParallel, equal_segments: bool = False):
        """`equal_segments`: every rank's segment has the same length (the trainer splits so), so a rank's
        segment starts at rank x its length and the ranks need not exchange their lengths."""
        arch = model.config.arch
        spec = get_arch(arch)
        if not spec.sequence_parallel:
            able = ", ".join(a for a in arch_names() if get_arch(a).sequence_parallel)
            raise ValueError(f"--sp (sequence parallelism) is for the linear models ({able}), whose "
                             f"layers pass only a fixed-size state between ranks; --arch {arch} has softmax "
                             f"attention over the whole sequence: train it with --sp 1")
        # a second plan would scale the loss's gradient twice and enter the exchange twice; refuse it before
        # anything is attached, so the model keeps the one plan it has
        if any(isinstance(block.token_mixer, _SequenceParallelMixer) for block in model.blocks):
            raise ValueError("this model already has a sequence-parallel plan (SequenceParallelPlan applied "
                             "before); call remove() on that plan first, or keep using it")
        self.model, self.sp, self.equal_segments = model, sp, equal_segments
        self.positions: Tensor | None = None  # global positions of the local tokens (as the model flattens them)
        # the layout of each packed micro-batch still in flight, by its local cu_seqlens (the very tensor the
        # token mixers receive): a mixer recomputed in the backward must run with the layout of the forward
        # it repeats, which is not the latest one when several forwards run before their backwards
        self._layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.mixers_take_positions = spec.sp_positions
        # the model's forward runs inside the exchange: entered and left by model hooks, outside the
        # compiled blocks (Dynamo cannot trace a change of the active group inside an activation-checkpointed
        # block, and would run such a block eagerly)
        self.handles = [model.register_forward_pre_hook(self._localise, with_kwargs=True),
                        model.register_forward_hook(self._loss, with_kwargs=True),
                        model.register_forward_hook(self._leave, always_call=True)]
        # each token mixer gets cos2's global positions, and enters the exchange when it runs outside the
        # model's forward (an eager block recomputed by activation checkpointing in the backward), through a
        # subclass of its class (one per plan and class, as FSDP2's fully_shard swaps classes), not hooks of
        # its own: torch.compile guards on a module's hook ids, so per-mixer hooks would give every compiled
        # block its own graph (and past Dynamo's recompile limit, eager blocks)
        self._classes: list[tuple[nn.Module, type]] = []
        subclasses: dict[type, type] = {}
        for block in model.blocks:
            mixer = block.token_mixer
            cls = type(mixer)
            if cls not in subclasses:
                subclasses[cls] = type(f"SequenceParallel{cls.__name__}", (_SequenceParallelMixer, cls),
                                       {"_sp_plan": self})
            self._classes.append((mixer, cls))
            mixer.__class__ = subclasses[cls]
        # an extra may run packed documents by calling itself on each (cos2's TPE): carry once, outside
        self._depth: dict[int, int] = {}
        for name, carry in spec.sp_carries.items():
            extra = model.get_submodule(name)
            self._depth[id(extra)] = 0
            self.handles += [extra.register_forward_pre_hook(self._extra_enter),
                             extra.register_forward_hook(partial(self._extra_leave, carry), with_kwargs=True,
                                                         always_call=True)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for mixer, cls in self._classes:
            mixer.__class__ = cls

    # -- per micro-batch: the segment layout ------------------------------------------------------------
    def _localise(self, module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        if kwargs.get("cache") is not None or (len(args) > 2 and args[2] is not None):
            raise ValueError("sequence parallelism is for training and evaluation on whole sequences; decode "
                             "with the model on one rank (no --sp)")
        rows, seg = input_ids.shape
        cu = kwargs.get("cu_seqlens")
        if len(args) > 3:
            raise ValueError("pass cu_seqlens to a sequence-parallel model as a keyword")
        self.sp.rank_index(input_ids.device)  # made here, outside the compiled blocks
        if cu is None:
            self.sp.segments = Segments(rows=rows, continues=None)
            self.positions = self._dense_positions(seg, input_ids.device)
        else:
            # the documents are cut on the host, which needs where this rank's segment starts (exchanged only
            # for segments of other lengths, where reading it waits for the queued work)
            start, T = self._segment_start(seg, input_ids.device)
            local, continues = local_documents(cu, rows, start, seg, T)
            # on the ids' device already, so the model's own move keeps this object (the key of `_layouts`)
            local = local.to(input_ids.device)
            kwargs = dict(kwargs, cu_seqlens=local)
            self.sp.segments = Segments(rows=rows, continues=continues)
            # the model flattens packed rows into one: row b's tokens sit at b x seq_len + their position
            t = torch.arange(seg, device=input_ids.device)
            rows_at = torch.arange(rows, device=input_ids.device)[:, None] * T
            self.positions = (rows_at + start + t[None, :]).reshape(-1)
            self._layouts[local] = (self.sp.segments, self.positions)
        enter(self.sp)
        return args, kwargs

    def _dense_positions(self, seg: int, device: torch.device) -> Tensor | None:
        """The global positions of the local tokens of sequences without documents, for mixers that take
        them (None for the others, which need nothing from the other ranks here): where this rank's segment
        starts comes from the ranks' segment lengths, on the device (nothing waits for it)."""
        if not self.mixers_take_positions:
            return None
        if self.equal_segments:
            return self.sp.rank * seg + torch.arange(seg, device=device)
        return segment_starts(self.sp, seg, device)[self.sp.rank] + torch.arange(seg, device=device)

    def _segment_start(self, seg: int, device: torch.device) -> tuple[int, int]:
        """(where this rank's segment starts, the sequences' length) on the host."""
        if self.equal_segments:
            return self.sp.rank * seg, seg * self.sp.size
        edges = segment_starts(self.sp, seg, device).tolist()
        return edges[self.sp.rank], edges[-1]

    def layout_of(self, x: Tensor, cu_seqlens: Tensor | None) -> tuple[Segments, Tensor | None]:
        """The segment layout and global positions of the micro-batch whose token-mixer input is `x` (the
        local `cu_seqlens` the mixer got): without documents from the shape and the ranks' segment lengths
        (exchanged again: every rank recomputes the same mixers in the same order, as it repeats their state
        exchange), else as `_localise` made them for that micro-batch."""
        if cu_seqlens is None:
            return Segments(rows=x.shape[0]), self._dense_positions(x.shape[1], x.device)
        layout = self._layouts.get(cu_seqlens)
        if layout is None:
            raise RuntimeError("sequence parallelism: a token mixer runs outside the model's forward with "
                               "document offsets the plan did not make; call the model, not its blocks")
        return layout

    def _leave(self, module, args, output):
        if active() is self.sp:  # not when `_localise` refused the input before entering
            leave()
        return output

    # -- extras with a recurrence along the sequence (cos2's TPE): the same exchange, the spec's carry ---
    def _extra_enter(self, module, args):
        self._depth[id(module)] += 1

    def _extra_leave(self, carry, module, args, kwargs, y):
        self._depth[id(module)] -= 1
        if self._depth[id(module)] or y is None:
            return y
        x = args[0] if args else kwargs["x"]
        with torch.autocast(device_type=x.device.type, enabled=False):
            return y + carry(module, x, kwargs.get("cu_seqlens"), self.sp).to(y.dtype)

    # -- the loss: the group's mean, with each rank's gradient its own share ----------------------------
    def _loss(self, module, args, kwargs, out):
        targets = kwargs.get("targets", args[1] if len(args) > 1 else None)
        if targets is None:
            return out
        count = (targets != IGNORE_INDEX).sum().to(out.dtype)
        mine = torch.where(count > 0, out, torch.zeros_like(out)) * count
        totals = torch.stack([mine.detach(), count])
        dist.all_reduce(totals, group=self.sp.group)
        # a group whose targets are all ignored has loss 0 (as one process has), not 0 / 0
        tokens = totals[1].clamp(min=1)
        mean = totals[0] / tokens
        # gradient: size x (own tokens' loss sum) / (group's tokens), so that averaging gradients over all
        # ranks (dp x size of them) gives the dp-average of the group mean's gradient; value: the mean
        scaled = mine * self.sp.size / tokens
        return scaled + (mean - scaled).detach()


class _SequenceParallelMixer:
    """Mixed in before a token mixer's class by the plan (which sets `_sp_plan` on the subclass): the
    mixer's forward runs inside the plan's sequence-parallel exchange."""
    _sp_plan: SequenceParallelPlan

    def forward(self, *args, **kwargs):
        plan = self._sp_plan
        if active() is plan.sp:  # inside the model's forward: nothing to change (nothing for Dynamo to trace)
            if plan.mixers_take_positions:  # cos2's LRPE: relative positions through absolute angles
                kwargs["pos"] = plan.positions
            return super().forward(*args, **kwargs)
        # recomputed by activation checkpointing in the backward: later forwards (micro-batches whose losses
        # are summed before one backward) may have set the plan's layout since, so take this input's own
        segments, positions = plan.layout_of(args[0] if args else kwargs["x"], kwargs.get("cu_seqlens"))
        if plan.mixers_take_positions:
            kwargs["pos"] = positions
        latest, plan.sp.segments = plan.sp.segments, segments
        enter(plan.sp)
        try:
            return super().forward(*args, **kwargs)
        finally:
            leave()
            plan.sp.segments = latest


def tpe_carry(tpe: nn.Module, x: Tensor, cu_seqlens: Tensor | None, sp: SequenceParallel) -> Tensor:
    """What the TPE state carried in from the ranks before adds to the local output: with I the state
    [rows, d, e] entering a row's segment, y_t += sum_j a_j^(t+1) I_j for the tokens of the segment's first
    document. The TPE recurrence u_t = a u_{t-1} + B x_t is a diagonal one, so its segment summary is
    S = sum_s a^(seg-1-s) B x_s with transfer a^seg, exchanged by `segment_prefix` like the attention states."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = sp.segments.rows if cu_seqlens is not None else x.shape[0]
    seg = x.shape[0] * x.shape[1] // rows
    d = x.shape[-1]
    log_a = F.logsigmoid(tpe.decay_logit.to(acc))                              # [e]
    w_in = tpe.in_weight.to(acc)                                                # [d, e]
    t = torch.arange(seg, device=x.device, dtype=acc)
    to_end = torch.exp((seg - 1 - t)[:, None] * log_a[None, :]).expand(rows, seg, -1)   # a^(seg-1-t)
    from_start = torch.exp((t + 1)[:, None] * log_a[None, :]).expand(rows, seg, -1)     # a^(t+1)
    transfer = torch.exp(seg * log_a).expand(rows, -1)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        row_start = torch.arange(rows, device=x.device) * seg
        last = starts[torch.searchsorted(starts, row_start + seg) - 1] - row_start       # last document start
        nxt = torch.searchsorted(starts, row_start, right=True)                          # first start after the row's
        first_end = torch.where(nxt < starts.numel(), starts[nxt.clamp(max=starts.numel() - 1)] - row_start,
                                torch.full_like(row_start, seg)).clamp(max=seg)
        to_end = to_end * (t[None, :] >= last[:, None]).to(acc)[..., None]
        from_start = from_start * (t[None, :] < first_end[:, None]).to(acc)[..., None]
        transfer = transfer * (last == 0).to(acc)[:, None]
    xr = x.reshape(rows, seg, d).to(acc)
    state = torch.einsum("btc,btj,cj->bcj", xr, to_end, w_in)                   # [rows, d, e]
    incoming = segment_prefix(sp, state, transfer[:, None, :], sp.continues(rows, x.device))
    return torch.einsum("btj,bcj->btc", from_start, incoming).reshape(x.shape)

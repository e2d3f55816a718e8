"""Sequence parallelism applied to the linear models (pretrain.sequence_parallel) on CPU with gloo: with
the sequences split over 4 ranks, and over 2 ranks in each of 2 data-parallel groups (DDP over all 4), the
logits, the loss and every parameter gradient equal the single-process run on whole sequences (fp32),
for TNL, HGRN2 and cosFormer2, with and without packed documents that cross rank boundaries; and over 3
ranks in float64, micro-batches run forward before one backward under activation checkpointing, ignored
targets spread unevenly over the ranks or covering a whole micro-batch, and segments of unequal length."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from models import build_model
from models.lm import IGNORE_INDEX
from ops.sequence_parallel import SequenceParallel
from pretrain.sequence_parallel import SequenceParallelPlan, local_documents
from tests.sp_utils import check_against_one_process, check_grads, reduced_grads, spawn_gloo
from tests.test_sequence_parallel_ops import GLOBAL_CU, groups_of

B, T, V = 2, 24, 97
TOL = dict(rtol=2e-5, atol=2e-6)


def tiny(arch: str):
    torch.manual_seed(0)
    # a TPE input weight far from its near-zero init, so that a wrong TPE carry shows in every output
    return build_model(arch, "tiny", n_layers=2, d_model=32, n_heads=2, d_glu=64, vocab_size=V,
                       tpe_init_bound=0.3)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def reference(model, ids, targets, cu):
    """logits, loss and gradients of the single-process run on whole sequences."""
    model.zero_grad()
    logits = model(ids, cu_seqlens=cu).detach()
    loss = model(ids, targets, cu_seqlens=cu)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check(what, got, want):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}\n{m}")


def run_arch(rank, world, size, arch, packed, ddp, ac):
    group, sp_rank = groups_of(size, world)
    dp_rank, dp_size = rank // size, world // size
    base = tiny(arch)
    cu = torch.tensor(GLOBAL_CU, dtype=torch.int32) if packed else None
    refs = [reference(base, *batch(10 + d), cu) for d in range(dp_size)]
    logits_ref, loss_ref, grads_ref = refs[dp_rank]

    model = copy.deepcopy(base)
    model.zero_grad()
    if ac:
        model.set_activation_checkpointing("full")
    sp = SequenceParallel(group)
    # both ways to place the segments: declared equal (as the trainer does: no exchange) and exchanged
    SequenceParallelPlan(model, sp, equal_segments=ddp)
    seg = T // size
    cols = slice(sp_rank * seg, (sp_rank + 1) * seg)
    ids, targets = (x[:, cols].contiguous() for x in batch(10 + dp_rank))
    what = f"{arch} packed={packed} sp={size} dp={dp_size} ac={ac} rank {rank}"
    with torch.no_grad():
        check(f"{what}: logits", model(ids, cu_seqlens=cu), logits_ref[:, cols])
    run = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    loss = run(ids, targets=targets, cu_seqlens=cu)
    check(f"{what}: loss", loss.detach(), loss_ref)
    loss.backward()
    for name, p in model.named_parameters():
        g = p.grad
        if ddp:  # DDP averaged over all ranks: the mean over data-parallel groups of their runs' gradients
            want = sum(r[2][name] for r in refs) / dp_size
        else:    # one group: its ranks' gradients average to the whole run's
            g = g.clone()
            dist.all_reduce(g, group=group)
            g /= size
            want = grads_ref[name]
        check(f"{what}: gradient of {name}", g, want)


def _worker(rank, world):
    for arch in ("tnl", "hgrn2", "cos2"):
        for packed in (False, True):
            run_arch(rank, world, 4, arch, packed, ddp=False, ac=arch == "hgrn2" and packed)
            run_arch(rank, world, 2, arch, packed, ddp=True, ac=False)
    dist.barrier()


def test_model_segments_match_whole_sequences():
    spawn_gloo(_worker, 4)


def split(x, rank, world):
    seg = x.shape[1] // world
    return x[:, rank * seg:(rank + 1) * seg].contiguous()


def _layouts_worker(rank, world):
    g = torch.Generator().manual_seed(7)
    # two packed micro-batches of 21-token sequences (7 tokens a rank) with other document layouts, and a
    # dense one of another length (other positions for cos2's LRPE)
    mbs = []
    for rows, t, cu in ((2, 21, [0, 3, 7, 12, 21, 27, 28, 40, 42]), (2, 21, [0, 14, 21, 42]), (1, 15, None)):
        ids = torch.randint(0, V, (rows, t + 1), generator=g)
        mbs.append((ids[:, :-1], ids[:, 1:], None if cu is None else torch.tensor(cu)))
    for arch in ("tnl", "hgrn2", "cos2"):
        base = tiny(arch).double()
        base.set_activation_checkpointing("full")
        model = copy.deepcopy(base)
        SequenceParallelPlan(model, SequenceParallel())
        # every micro-batch's forward before one backward: the blocks recomputed in the backward must
        # run with their own micro-batch's documents and positions, not the last forward's
        sum(base(x, y, cu_seqlens=cu) for x, y, cu in mbs).backward()
        sum(model(split(x, rank, world), split(y, rank, world), cu_seqlens=cu) for x, y, cu in mbs).backward()
        check_grads(f"{arch}, forwards of 3 micro-batches, then one backward, rank {rank}",
                    reduced_grads(model, world), {n: p.grad for n, p in base.named_parameters()})

        # ignored targets spread unevenly (all of rank 0's first row), then a micro-batch with all ignored:
        # the group's mean over the counted tokens, and 0 with nothing counted, as in one process
        x, y, cu = mbs[0]
        for ignored in (lambda t: t[0, :t.shape[1] // world], lambda t: t):
            y2 = y.clone()
            ignored(y2).fill_(IGNORE_INDEX)
            base.zero_grad()
            model.zero_grad()
            want = base(x, y2, cu_seqlens=cu)
            want.backward()
            got = model(split(x, rank, world), split(y2, rank, world), cu_seqlens=cu)
            got.backward()
            what = f"{arch}, {int((y2 == IGNORE_INDEX).sum())} ignored targets, rank {rank}"
            assert torch.isfinite(got) and abs(got.item() - want.item()) < 1e-12, (what, got.item(), want.item())
            check_grads(what, reduced_grads(model, world), {n: p.grad for n, p in base.named_parameters()})
    dist.barrier()


def test_three_ranks_micro_batch_layouts_and_ignored_targets():
    """float64, 3 ranks, sequences of 21 tokens (not a chunk multiple): gradients of several micro-batches
    run forward before one backward under full activation checkpointing, and losses with ignored targets
    spread unevenly over the ranks or covering a whole micro-batch, equal the single process's."""
    spawn_gloo(_layouts_worker, 3)


def test_local_documents_and_llama_refused():
    cu = torch.tensor(GLOBAL_CU, dtype=torch.int32)
    # segments of 6 tokens on rank 1 of 4: row 0 holds 6..11 (document 5..10 continues; 11 starts one),
    # row 1 holds 30..35 (30 and 31 start documents)
    local, cont = local_documents(cu, 2, 6, 6, 24)
    assert local.tolist() == [0, 5, 6, 7, 12] and cont.tolist() == [True, False]
    local, cont = local_documents(cu, 2, 18, 6, 24)  # rank 3: 18..23: no start; 42..47: 47 starts one
    assert local.tolist() == [0, 6, 11, 12] and cont.tolist() == [True, True]
    # a segment of another length, 10 tokens from 3: row 0 holds 3..12 (document 0..4 continues; 5, 11 and
    # 12 start documents), row 1 holds 27..36 (document 24..29 continues; 30 and 31 start documents)
    local, cont = local_documents(cu, 2, 3, 10, 24)
    assert local.tolist() == [0, 2, 8, 9, 10, 13, 14, 20] and cont.tolist() == [True, True]
    with pytest.raises(ValueError, match="full sequences"):
        local_documents(torch.tensor([0, 3, 12], dtype=torch.int32), 2, 0, 6, 24)
    # a document running from row 0 into row 1 (no start at 24): one device carries the state across the
    # rows (they run as one packed row), the ranks cannot (row 1's first rank never sees row 0's last
    # rank's state), so every rank refuses it rather than train on other numbers
    for r in range(4):
        with pytest.raises(ValueError, match="every sequence starts a document"):
            local_documents(torch.tensor([0, 5, 30, 48], dtype=torch.int32), 2, 6 * r, 6, 24)
    with pytest.raises(ValueError, match="linear models"):
        SequenceParallelPlan(build_model("llama", "tiny", n_layers=1, d_model=32, n_heads=2, d_glu=64,
                                         vocab_size=V), None)


# segments of unequal length: a rank's segment is its input, starting where the ranks before it end (two
# splits of the 24-token sequences over 3 ranks: rank 1's segment is the longest in one, the shortest in the
# other, so no rank's start is its rank times its length)
SPLITS = ((5, 12, 7), (10, 3, 11))


def _columns(split, rank):
    start = sum(split[:rank])
    return slice(start, start + split[rank])


def _unequal_worker(rank, world, arch):
    base = tiny(arch).double()
    for packed in (False, True):
        cu = torch.tensor(GLOBAL_CU, dtype=torch.int32) if packed else None
        for split in SPLITS:
            cols = _columns(split, rank)
            x, y = batch(20)
            check_against_one_process(base, x, y, cu, cols, f"{arch} packed={packed} segments {split}, rank {rank}",
                                      world)

        # full activation checkpointing, both splits' micro-batches forward before one backward: the blocks
        # recomputed in the backward run with their own micro-batch's segment, not the last forward's
        base.zero_grad()
        base.set_activation_checkpointing("full")
        model = copy.deepcopy(base)
        SequenceParallelPlan(model, SequenceParallel())
        mbs = [batch(30 + i) for i in range(len(SPLITS))]
        sum(base(x, y, cu_seqlens=cu) for x, y in mbs).backward()
        sum(model(x[:, _columns(split, rank)].contiguous(), y[:, _columns(split, rank)].contiguous(), cu_seqlens=cu)
            for (x, y), split in zip(mbs, SPLITS)).backward()
        check_grads(f"{arch} packed={packed} segments {SPLITS} under activation checkpointing, rank {rank}",
                    reduced_grads(model, world), {n: p.grad for n, p in base.named_parameters()})
        base.set_activation_checkpointing("none")
    dist.barrier()


@pytest.mark.parametrize("arch", ["tnl", "hgrn2", "cos2", "llama"])
def test_unequal_segments_match_whole_sequences(arch):
    """Segments of unequal length over 3 ranks (float64, dense and packed documents): logits, loss and
    gradients equal the single process's on whole sequences, also for two micro-batches of different splits
    run forward before one backward under full activation checkpointing. cosFormer2's LRPE angles take each
    rank's true segment start. LLaMA is refused by the plan, whatever the split."""
    if arch == "llama":
        with pytest.raises(ValueError, match="linear models"):
            SequenceParallelPlan(tiny(arch), None)
        return
    spawn_gloo(_unequal_worker, 3, arch, timeout_s=120)

"""Sequence parallelism at its edges: a plan applied twice to one model is refused with one clear error
and leaves the model as it was; an initial state under sequence parallelism is refused saying what to do;
and segments longer than one 64-token chunk, not a multiple of it, with document starts on a rank
boundary, on a chunk boundary and one token either side of both, give the logits, loss and every
parameter gradient of the single process on whole sequences (float64, TNL, HGRN2, cosFormer2)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models import build_model
from ops import lightning_attn
from ops.sequence_parallel import SequenceParallel, sequence_parallel
from pretrain.sequence_parallel import SequenceParallelPlan
from tests.sp_utils import check_against_one_process, spawn_gloo

V = 97


def tiny(arch: str):
    torch.manual_seed(0)
    return build_model(arch, "tiny", n_layers=2, d_model=32, n_heads=2, d_glu=64, vocab_size=V,
                       tpe_init_bound=0.3)


def _hooks(model) -> tuple[int, int]:
    return len(model._forward_pre_hooks), len(model._forward_hooks)


def test_second_plan_on_one_model_is_refused_and_changes_nothing():
    model = tiny("tnl")
    plan = SequenceParallelPlan(model, None)
    before = _hooks(model), [type(b.token_mixer) for b in model.blocks]
    with pytest.raises(ValueError, match="already has a sequence-parallel plan.*remove"):
        SequenceParallelPlan(model, None)
    # nothing of the refused plan stays attached (its loss hook would scale the gradient a second time)
    assert (_hooks(model), [type(b.token_mixer) for b in model.blocks]) == before
    plan.remove()
    SequenceParallelPlan(model, None).remove()  # after remove() a new plan may be applied


def _initial_state_worker(rank, world):
    q = k = v = torch.randn(1, 4, 2, 4)
    with pytest.raises(ValueError, match=r"initial state.*without initial_state.*outside `sequence_parallel`"):
        with sequence_parallel(SequenceParallel()):
            lightning_attn(q, k, v, torch.tensor([0.9, 0.8]), initial_state=torch.zeros(1, 2, 4, 4))


def test_initial_state_under_sp_says_what_to_do():
    spawn_gloo(_initial_state_worker, 2, timeout_s=60)


# 2 rows of 130 tokens over 2 ranks: 65-token segments (one chunk and one token). Row 0: documents start
# at 64 (a chunk boundary), 65 (the rank boundary), 66, and 129 (the last token); row 1 (from 130): one
# document crosses the rank boundary, one starts one token before it.
T, CU = 130, [0, 64, 65, 66, 129, 130, 194, 260]


def _long_segments_worker(rank, world):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    seg = T // world
    cols = slice(rank * seg, (rank + 1) * seg)
    for arch in ("tnl", "hgrn2", "cos2"):
        for cu in (None, torch.tensor(CU, dtype=torch.int32)):
            check_against_one_process(tiny(arch).double(), x, y, cu, cols, f"{arch} packed={cu is not None} rank {rank}",
                                      world, rel=1e-9, equal_segments=True)
    dist.barrier()


def test_segments_longer_than_a_chunk_with_documents_at_rank_and_chunk_boundaries():
    spawn_gloo(_long_segments_worker, 2, timeout_s=120)

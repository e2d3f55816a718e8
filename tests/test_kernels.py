"""The Triton linear-attention kernels against the float64 step-by-step recurrence, on CPU under the
Triton interpreter (conftest sets TRITON_INTERPRET=1). Tiny odd shapes: T is never a chunk multiple.
Every layout is forced on in turn (`ops.testing.force_plan`): the scan layout (one walk per sequence) and
the split layout (segments of one or two chunks, their start states from the two-level scan). Every
output and every input's gradient (q, k, v, log_f, initial state; the final state's gradient flows back
too) must agree to relative error < 1e-3 in fp32."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import ops  # noqa: E402
from ops import gated_linear_attn, lightning_attn  # noqa: E402
from ops import reference as R  # noqa: E402
from ops.testing import SCAN, force_plan  # noqa: E402
from ops.triton_scan import dot32, split_bf16, tf32_round  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

TOL = 1e-3
# layout name -> segment length in chunks (T <= 130 here: 1-3 chunks per sequence)
LAYOUTS = {"scan": SCAN, "split1": 1, "split2": 2}


def test_triton_kernels_registered():
    """Triton is installed (this module did not skip), so the kernels must have registered: an error in
    a kernel module must fail here, not fall back to the PyTorch twins unnoticed."""
    assert ops.HAVE_TRITON
    for op in ("lightning_attn", "gated_linear_attn"):
        assert "triton" in ops.available_impls(op), f"{op}: the triton implementation did not register"
    from ops.cross_entropy import ce_rows_triton
    from ops.norm import rms_norm_triton
    assert ce_rows_triton is not None and rms_norm_triton is not None, "the fused loss / norm kernels did not load"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _make(kind, T, H, Dk, Dv, N=1, gate_scale=3.0, gate_shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(N, T, H, Dk), r(N, T, H, Dk) * 0.5, r(N, T, H, Dv)
    if kind == "gla":
        x = F.logsigmoid(r(N, T, H, Dk) * gate_scale + gate_shift)
    elif kind == "la":
        x = torch.linspace(0.55, 0.99, H)  # includes TNL's strongest, exp(-0.5) ~ 0.61
    else:
        x = None
    return q, k, v, x


def _recurrent64(kind, q, k, v, x, h0):
    if kind == "gla":
        return R.gated_linear_attn_recurrent(q, k, v, x, h0)
    return R.lightning_attn_recurrent(q, k, v, None if x is None else x.double(), h0)


def _check_against_recurrence(kind, q, k, v, x, h0, cu=None, state_grad=True, layout="scan", anchor_chunks=None):
    """Run the triton impl in `layout` and the float64 recurrence (per document when packed) and compare
    outputs, final states and the gradients of every differentiable input (the loss also reads the
    final state unless `state_grad` is False). anchor_chunks: GLA d log_f's anchor spacing (default: the
    kernels' own, which these short sequences never reach)."""
    ins = [q, k, v] + ([h0] if h0 is not None else []) + ([x] if kind == "gla" else [])
    ins = [t.clone().requires_grad_(True) for t in ins]
    q_, k_, v_ = ins[:3]
    h0_ = ins[3] if h0 is not None else None
    x_ = ins[-1] if kind == "gla" else x
    f = gated_linear_attn if kind == "gla" else lightning_attn
    with force_plan(seg_chunks=LAYOUTS[layout], anchor_chunks=anchor_chunks):
        o, S = f(q_, k_, v_, x_, initial_state=h0_, output_final_state=True, cu_seqlens=cu, impl="triton")
        gen = torch.Generator().manual_seed(1)
        do, dS = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen) * float(state_grad)
        grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), ins)

    ins64 = [t.detach().double().requires_grad_(True) for t in ins]
    q6, k6, v6 = ins64[:3]
    h6 = ins64[3] if h0 is not None else None
    x6 = ins64[-1] if kind == "gla" else x
    bounds = [0, q.shape[1]] if cu is None else cu.tolist()
    outs, states = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        xi = x6[:, s:e] if kind == "gla" else x6
        oi, Si = _recurrent64(kind, q6[:, s:e], k6[:, s:e], v6[:, s:e], xi,
                              None if h6 is None else h6[i:i + 1] if cu is not None else h6)
        outs.append(oi)
        states.append(Si)
    ro, rS = torch.cat(outs, 1), torch.cat(states, 0)
    rgrads = torch.autograd.grad((ro * do.double()).sum() + (rS * dS.double()).sum(), ins64)
    names = ["dq", "dk", "dv"] + (["dh0"] if h0 is not None else []) + (["dlog_f"] if kind == "gla" else [])
    errs = {"o": rel(o, ro), "S": rel(S, rS), **{n: rel(a, b) for n, a, b in zip(names, grads, rgrads)}}
    assert all(torch.isfinite(t).all() for t in (o, S, *grads)), "non-finite output or gradient"
    assert all(e < TOL for e in errs.values()), errs


@pytest.mark.parametrize("kind,T,Dk,Dv,layout", [
    ("la", 83, 32, 16, "scan"), ("la", 83, 32, 16, "split1"), ("la", 130, 16, 32, "split2"),
    ("nodecay", 77, 32, 16, "scan"), ("nodecay", 130, 24, 24, "split1"),
    ("gla", 83, 32, 16, "scan"), ("gla", 83, 32, 16, "split1"), ("gla", 130, 24, 16, "split2"),
    # one head of the study sizes' width (models/sizes.py l1d48): 48 padded to a 64-wide block
    ("la", 83, 48, 48, "split1"), ("gla", 83, 48, 48, "scan"),
    # TNL's 128-wide heads: lightning's launch configs there split the values into 32-wide blocks
    ("la", 83, 128, 128, "split1"),
])
def test_matches_recurrence(kind, T, Dk, Dv, layout):
    q, k, v, x = _make(kind, T, 2, Dk, Dv)
    h0 = torch.randn(1, 2, Dk, Dv) * 0.5
    _check_against_recurrence(kind, q, k, v, x, h0, layout=layout)


@pytest.mark.parametrize("kind,layout", [("la", "split1"), ("nodecay", "scan"), ("gla", "split1")])
def test_batch_without_initial_state(kind, layout):
    q, k, v, x = _make(kind, 70, 2, 16, 16, N=2, seed=3)
    _check_against_recurrence(kind, q, k, v, x, None, layout=layout)


@pytest.mark.parametrize("gates,layout", [("-20", "scan"), ("-20", "split1"), ("near1", "split1"),
                                          ("uniform", "scan"), ("uniform", "split2")])
def test_gla_any_gate_value(gates, layout):
    """One scheme for every log f in [-20, 0]: gates at the floor (a chunk's cumulative decay reaches
    e^-1280, far past where the direct (q e^b)(k e^-b)^T factorisation overflows), near 1 (log f ~ -1e-6),
    and log f drawn uniformly from [-20, 0] per step and channel."""
    q, k, v, _ = _make("gla", 77 if gates != "uniform" else 130, 2, 16, 16, seed=5)
    g = torch.Generator().manual_seed(6)
    if gates == "-20":
        x = -20.0 + torch.rand(q.shape, generator=g)  # [-20, -19]
    elif gates == "near1":
        x = -1e-6 * torch.rand(q.shape, generator=g)
    else:
        x = -20.0 * torch.rand(q.shape, generator=g)
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16), state_grad=False, layout=layout)


@pytest.mark.parametrize("layout", ["scan", "split1"])
def test_gla_gates_near_zero_with_final_state_grad(layout):
    """Gates near 0 and a loss on the final state: d log_f's final-state term is formed directly
    (gla_state_grad_kernel), not as 'all minus a suffix', so it keeps its relative precision; in the split
    layout the dk walks start from state gradients chained without it."""
    q, k, v, x = _make("gla", 77, 2, 16, 16, gate_scale=1.0, gate_shift=-12.0, seed=5)
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16), state_grad=True, layout=layout)


@pytest.mark.parametrize("layout,anchor_chunks,gates", [("scan", 1, "uniform"), ("split1", 2, "mixed"),
                                                        ("split2", 1, "uniform")])
def test_gla_dlogf_anchors(layout, anchor_chunks, gates):
    """d log_f anchored at chunk boundaries (each run's reverse sum starts from <S, dS> at its end, from
    the states the dq / dk walks store): exact in every layout, with an initial state, a loss on the final
    state (gla_state_grad_kernel's terms on top) and gates anywhere in [-20, 0]."""
    q, k, v, x = _make("gla", 200, 2, 24, 16, N=2, seed=23)
    if gates == "uniform":
        x = -20.0 * torch.rand(x.shape, generator=torch.Generator().manual_seed(24))
    _check_against_recurrence("gla", q, k, v, x, torch.randn(2, 2, 24, 16) * 0.5, layout=layout,
                              anchor_chunks=anchor_chunks)


@pytest.mark.parametrize("layout,anchor_chunks", [("scan", 1), ("split1", 2)])
def test_gla_dlogf_anchors_packed(layout, anchor_chunks):
    """Packed documents with anchors: 17 tokens (no anchor), 180 (three chunks: anchors inside it; its
    boundaries off the chunk grid of the batch), 40; every document's last run starts from zero."""
    q, k, v, x = _make("gla", 237, 2, 16, 16, seed=29, gate_shift=-1.0)
    cu = torch.tensor([0, 17, 197, 237])
    _check_against_recurrence("gla", q, k, v, x, torch.randn(3, 2, 16, 16), cu=cu, layout=layout,
                              anchor_chunks=anchor_chunks)


def test_gla_dlogf_error_does_not_grow_with_T():
    """d log_f as one reverse sum over the whole sequence adds up the rounding errors of terms that cancel,
    so its error grows with T (at T = 64K in bf16 past the 5e-3 bar); anchored at chunk boundaries it
    stays at the level of dq, dk. In fp32 at T = 1024 with gates at -20: the sequence-long sum's error is
    ~27x dq's, the anchored one's ~7x (rel err vs float64). The unanchored run checks that this length
    shows the difference."""
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(1, 1024, 1, 16, generator=g) * 0.5 for _ in range(3))
    inputs = (q, k, v, torch.full((1, 1024, 1, 16), -20.0), torch.randn(1, 1024, 1, 16, generator=g))
    dq, dk, _, dg = _grad_errs_at_anchors(inputs, 1)
    assert dg < 10 * max(dq, dk), (dg, dq, dk)
    dg_long = _grad_errs_at_anchors(inputs, SCAN)[3]
    assert dg_long > 2 * dg, (dg_long, dg)


def _grad_errs_at_anchors(inputs, anchor_chunks):
    """Relative errors of dq, dk, dv, d log_f (scan layout, loss (o * do).sum()) against the float64 twin,
    d log_f anchored every anchor_chunks chunks (None: the default). inputs: q, k, v, log_f, do."""
    q, k, v, x, do = inputs
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, x)]
    with force_plan(seg_chunks=SCAN, anchor_chunks=anchor_chunks):
        grads = torch.autograd.grad((gated_linear_attn(*ins, impl="triton") * do).sum(), ins)
    i64 = [t.detach().double().requires_grad_(True) for t in ins]
    ref = torch.autograd.grad((R.gated_linear_attn_chunked(*i64)[0] * do.double()).sum(), i64)
    return [rel(a, b) for a, b in zip(grads, ref)]


def test_gla_dlogf_default_anchors_with_gpu_rounding(monkeypatch):
    """The default anchor spacing (4 chunks) against 8, with the GPU's tf32 operands emulated (`tf32_round`
    on every product's fp32 operands, forced here for fp32 inputs). Moderate gates (log f in [-5, 0]),
    whose chunks take the tame kernels' products: q's side and k's side of each intra-chunk pair round
    different operands, and the reverse sum carries the difference along a run, so its error follows the
    run's length (on an H200 in bf16, 3.5e-3 against 4.7e-3: docs/kernels.md, Accuracy)."""
    import ops.triton_linear_attn as tla
    monkeypatch.setattr(tla, "_prec", lambda x: "tf32")
    assert tla.ANCHOR_CHUNKS < 8
    g = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(1, 1024, 1, 32, generator=g) * 0.5 for _ in range(3))
    inputs = (q, k, v, -5.0 * torch.rand(1, 1024, 1, 32, generator=g), torch.randn(1, 1024, 1, 32, generator=g))
    default, eight = _grad_errs_at_anchors(inputs, None)[3], _grad_errs_at_anchors(inputs, 8)[3]
    assert default < 0.85 * eight and default < 3.5e-3, (default, eight)


@pytest.mark.parametrize("layout", ["scan", "split1"])
def test_gla_level_path(layout):
    """Every chunk through the level kernels (the path of chunks that are not tame), forced with mild
    gates, so that both paths are checked on the same inputs."""
    q, k, v, x = _make("gla", 130, 2, 24, 16, seed=11)
    with force_plan(tame_span=-1):
        _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 24, 16) * 0.5, layout=layout)


@pytest.mark.parametrize("layout,gates", [("scan", "uniform"), ("split1", "-20"), ("split2", "uniform")])
def test_gla_level_path_packed(layout, gates):
    """The level kernels on packed documents of 5, 40, 101 and 3 tokens (boundaries inside the levels'
    blocks, a document shorter than a level-4 block, a last chunk of 37 rows), gates uniform in [-20, 0]
    or in [-20, -19], every chunk forced onto the level path; 16-wide key blocks over Dk = 24, so that the
    (chunk, key block) programs include a partly masked block."""
    T = 149
    q, k, v, _ = _make("gla", T, 2, 24, 16, seed=37)
    g = torch.Generator().manual_seed(38)
    u = torch.rand(1, T, 2, 24, generator=g)
    x = -20.0 * u if gates == "uniform" else -20.0 + u
    cu = torch.tensor([0, 5, 45, 146, 149])
    with force_plan(tame_span=-1, launch={"A_sub": {"block": 16}, "dqk_sub": {"block": 16}}):
        _check_against_recurrence("gla", q, k, v, x, torch.randn(4, 2, 24, 16) * 0.5, cu=cu, layout=layout)


@pytest.mark.parametrize("key_blocks,level_blocks", [(2, 0), (4, 0), (2, 3)])
def test_gla_level_dqk_walks_key_blocks(key_blocks, level_blocks):
    """dq / dk level programs that each take several key blocks (launch key key_blocks): 8-wide blocks over
    Dk = 24 make three, so with 2 a program's second block can lie wholly past the keys, and with 4 one
    program takes all of them; the packed documents and gates of `test_gla_level_path_packed`, every chunk
    on the level path, with the unrolled levels and with the block products."""
    T = 149
    q, k, v, _ = _make("gla", T, 2, 24, 16, seed=37)
    x = -20.0 * torch.rand(1, T, 2, 24, generator=torch.Generator().manual_seed(38))
    cu = torch.tensor([0, 5, 45, 146, 149])
    plan = {"level_blocks": level_blocks} if level_blocks else {}
    with force_plan(tame_span=-1, launch={"dqk_sub": {"block": 8, "key_blocks": key_blocks}}, **plan):
        _check_against_recurrence("gla", q, k, v, x, torch.randn(4, 2, 24, 16) * 0.5, cu=cu, layout="split1")


@pytest.mark.parametrize("layout", ["scan", "split1"])
def test_gla_level_blocks(layout):
    """The level kernels with the pairs inside aligned blocks taken by one product (force_plan(level_blocks=4)):
    four chunks that are not tame, with largest single-step decays 6, 20, 30 and 100, get blocks of 16, 8,
    4 and 2 rows (flags -4, -3, -2, -1) and must all match the float64 recurrence; the last chunk holds
    44 rows, so its last block of 16 is partly padding. (No single step decays by more than e^-104,
    ops.reference.LOG_F_FLOOR, so blocks of 2 rows are always within TAME_SPAN.)"""
    import ops.triton_linear_attn as TL
    T = 236
    q, k, v, _ = _make("gla", T, 1, 16, 16, seed=41)
    u = torch.rand(1, T, 1, 16, generator=torch.Generator().manual_seed(42))
    x = torch.empty(1, T, 1, 16)
    x[:, :64] = -6.0 + 0.5 * u[:, :64]          # G 6: 15 G <= 140
    x[:, 64:128] = -20.0 * u[:, 64:128]         # G < 20: 7 G <= 140 < 15 G
    x[:, 128:192] = -30.0 + u[:, 128:192]       # G 30: 3 G <= 140 < 7 G
    x[:, 192:] = -5.0 * u[:, 192:]
    x[:, 200, :, 3] = -100.0                    # G 100: G <= 140 < 3 G
    with force_plan(level_blocks=4):
        _, flags = TL._gla_cumsum(x, torch.zeros(1, dtype=torch.int32), T, (4, None))
        assert flags[0, ::64, 0].tolist() == [-4, -3, -2, -1], flags[0, ::64, 0]
        _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 1, 16, 16) * 0.5, layout=layout)
    _, flags = TL._gla_cumsum(x, torch.zeros(1, dtype=torch.int32), T, (4, None))
    assert flags[0, ::64, 0].tolist() == [0, 0, 0, 0]  # the default: a product per level


@pytest.mark.parametrize("layout,gates", [("scan", "uniform"), ("split2", "-20")])
def test_gla_level_blocks_packed(layout, gates):
    """The block products (blocks of 8 rows) on the packed documents of `test_gla_level_path_packed`: block
    boundaries and document boundaries inside one chunk, a last chunk of 37 rows, 16-wide key blocks."""
    T = 149
    q, k, v, _ = _make("gla", T, 2, 24, 16, seed=37)
    u = torch.rand(1, T, 2, 24, generator=torch.Generator().manual_seed(38))
    x = -20.0 * u if gates == "uniform" else -20.0 + u
    cu = torch.tensor([0, 5, 45, 146, 149])
    with force_plan(level_blocks=3, launch={"A_sub": {"block": 16}, "dqk_sub": {"block": 16}}):
        _check_against_recurrence("gla", q, k, v, x, torch.randn(4, 2, 24, 16) * 0.5, cu=cu, layout=layout)


def test_gla_mixed_tame_and_level_chunks():
    """One sequence whose first chunk is tame and whose second is not (and the reverse in the other
    head): both paths in one launch."""
    import ops.triton_linear_attn as TL
    T = 120
    q, k, v, _ = _make("gla", T, 2, 16, 16, seed=13)
    x = torch.full((1, T, 2, 16), -0.05)
    x[:, 64:, 0] = -5.0  # head 0: chunk 1's first half decays by e^-155 -> level path
    x[:, :64, 1] = -5.0  # head 1: chunk 0
    _, flags = TL._gla_cumsum(x, torch.zeros(1, dtype=torch.int32), T, (2, None))
    assert flags[0, [0, 64]].tolist() == [[2, 0], [0, 2]]
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16), layout="split1")


@pytest.mark.parametrize("T,layout,flags0", [(114, "scan", [1, 1]), (130, "split1", [1, 1, 2])])
def test_gla_tame_by_halves(T, layout, flags0):
    """Head 0: chunks that decay far past what one product over the whole chunk could hold (log f about
    -3: e^-190 across a chunk) but by at most e^-96 across each 32-row half take the tame kernels'
    half-block products (flag 1); head 1 (log f about -1.5: e^-95 across a chunk) one product over the
    chunk (flag 2), in the same launch. The last chunk holds 50 rows (its second half part padding; flag 1)
    or 2 (flag 2)."""
    import ops.triton_linear_attn as TL
    q, k, v, _ = _make("gla", T, 2, 24, 16, seed=23)
    x = -3.0 + 0.1 * torch.rand(1, T, 2, 24, generator=torch.Generator().manual_seed(24))
    x[:, :, 1] *= 0.5
    _, flags = TL._gla_cumsum(x, torch.zeros(1, dtype=torch.int32), T, (triton.cdiv(T, 64), None))
    assert flags[0, ::64, 0].tolist() == flags0, flags[0, ::64]
    assert flags[0, ::64, 1].tolist() == [2] * len(flags0), flags[0, ::64]
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 24, 16) * 0.5, layout=layout)


@pytest.mark.parametrize("layout", ["scan", "split1"])
def test_gla_tame_by_halves_packed(layout):
    """Packed documents of 30 and 100 tokens with log f about -3: the second document's first chunk (its
    rows start mid-way through the batch's chunk grid) takes the half blocks (flag 1), the first document
    and the second one's 36-row last chunk one product (flag 2), in one launch."""
    import ops.triton_linear_attn as TL
    T = 130
    q, k, v, _ = _make("gla", T, 2, 24, 16, seed=29)
    x = -3.0 + 0.1 * torch.rand(1, T, 2, 24, generator=torch.Generator().manual_seed(30))
    cu = torch.tensor([0, 30, 130])
    _, flags = TL._gla_cumsum(x, cu.to(torch.int32), T, TL._chunk_table(cu, 2, T))
    assert flags[0, [0, 30, 94], 0].tolist() == [2, 1, 2], flags[0, [0, 30, 94]]
    _check_against_recurrence("gla", q, k, v, x, torch.randn(2, 2, 24, 16) * 0.5, cu=cu, layout=layout)


@pytest.mark.parametrize("kind,layout", [("la", "scan"), ("la", "split1"), ("gla", "scan"), ("gla", "split1")])
def test_cu_seqlens_resets_state(kind, layout):
    """Packed documents (lengths 17, 70, 40: boundaries inside chunks; the 70-token one spans two chunks,
    hence two segments in split1) match separate runs, each from its own initial state."""
    q, k, v, x = _make(kind, 127, 2, 16, 16, seed=7, gate_shift=-1.0 if kind == "gla" else 0.0)
    cu = torch.tensor([0, 17, 87, 127])
    _check_against_recurrence(kind, q, k, v, x, torch.randn(3, 2, 16, 16), cu=cu, layout=layout)


@pytest.mark.parametrize("kind", ["la", "gla"])
def test_backward_uses_the_forward_segments(kind):
    """The backward walks from the forward's chained segment states, so it must use the forward's
    segment length even if the plan for the shape changes in between."""
    q, k, v, x = _make(kind, 130, 2, 16, 16, seed=19)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([x.clone().requires_grad_(True)] if kind == "gla" else [])
    f = gated_linear_attn if kind == "gla" else lightning_attn
    with force_plan(seg_chunks=1):
        o = f(*ins[:3], ins[3] if kind == "gla" else x, impl="triton")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    with force_plan(seg_chunks=2):
        grads = torch.autograd.grad((o * do).sum(), ins)
    i64 = [t.detach().double().requires_grad_(True) for t in ins]
    ro, _ = _recurrent64(kind, *i64[:3], i64[3] if kind == "gla" else x, None)
    rgrads = torch.autograd.grad((ro * do.double()).sum(), i64)
    errs = [rel(a, b) for a, b in zip(grads, rgrads)]
    assert all(e < TOL for e in errs), errs


def _gates_past_the_floor(T, H, D, seed):
    """Mild gates (log f in [-0.01, 0]) with, in every other key channel, a hard reset (log f = -inf) at a
    chunk's first token (64) and mid-chunk (30, 100), and -1e4 and -3e38 (two of which overflow a sum to
    -inf) a few tokens before milder ones of the same chunk."""
    x = -0.01 * torch.rand(1, T, H, D, generator=torch.Generator().manual_seed(seed))
    ch = torch.arange(D) % 2 == 1
    for t, val in ((30, -float("inf")), (64, -float("inf")), (100, -float("inf")), (10, -1e4), (75, -1e4),
                   (110, -3e38), (111, -3e38)):
        x[:, t, :, ch] = val
    return x


@pytest.mark.parametrize("layout", ["scan", "split1", "split2"])
def test_gla_gates_below_the_floor(layout):
    """log f below -104 (exp underflows to 0 in fp32) counts as -104 (ops.reference.LOG_F_FLOOR): a hard
    reset by log f = -inf gave NaN (the chunk-local cumsum b went -inf, b_i - b_j NaN), and -1e4 before
    milder gates left b too large for their differences (rel err 4e-3 in fp32). Every output and gradient
    against the float64 recurrence, which takes exp(-inf) = 0 as it is; the chunked twin too."""
    T = 130
    q, k, v, _ = _make("gla", T, 2, 16, 16, seed=61)
    x = _gates_past_the_floor(T, 2, 16, seed=62)
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16), layout=layout)
    if layout == "scan":
        o, S = gated_linear_attn(q, k, v, x, output_final_state=True, impl="chunked")
        ro, rS = R.gated_linear_attn_recurrent(q.double(), k.double(), v.double(), x.double())
        assert rel(o, ro) < TOL and rel(S, rS) < TOL, (rel(o, ro), rel(S, rS))


@pytest.mark.parametrize("kind", ["la", "gla"])
def test_empty_sequence_keeps_the_initial_state(kind):
    """T = 0: the final state is the initial state and its gradient passes through unchanged (the walks of
    an empty sequence have no chunk to end on: the kernels left both uninitialised)."""
    f = gated_linear_attn if kind == "gla" else lightning_attn
    q, v = torch.randn(2, 0, 2, 16), torch.randn(2, 0, 2, 8)
    x = torch.zeros(2, 0, 2, 16) if kind == "gla" else torch.tensor([0.9, 0.5])
    h0 = torch.randn(2, 2, 16, 8, requires_grad=True)
    o, S = f(q, q, v, x, initial_state=h0, output_final_state=True, impl="triton")
    assert o.shape == (2, 0, 2, 8) and torch.equal(S, h0.detach())
    dS = torch.randn(S.shape)
    (dh0,) = torch.autograd.grad((S * dS).sum(), [h0])
    assert torch.equal(dh0, dS)
    _, S = f(q, q, v, x, output_final_state=True, impl="triton")
    assert torch.equal(S, torch.zeros(2, 2, 16, 8))


def test_packed_gla_under_inference_mode():
    """Packed GLA input under torch.inference_mode (evaluation): the cached (sequence, chunk) table was
    keyed by cu_seqlens' version counter, which inference tensors do not have (RuntimeError). Their table
    is built at each call; a change of lengths in place is seen; the outputs match the float64
    recurrence per document, and a tensor first used under inference mode still trains afterwards."""
    q, k, v, x = _make("gla", 70, 2, 16, 16, seed=71, gate_shift=-1.0)

    def ref(bounds):
        docs = [R.gated_linear_attn_recurrent(*(t[:, s:e].double() for t in (q, k, v, x)))[0]
                for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(docs, 1)
    with torch.inference_mode():
        cu = torch.tensor([0, 30, 70])
        assert rel(gated_linear_attn(q, k, v, x, cu_seqlens=cu, impl="triton"), ref([0, 30, 70])) < TOL
        cu[1] = 5  # in place: no version counter to tell
        assert rel(gated_linear_attn(q, k, v, x, cu_seqlens=cu, impl="triton"), ref([0, 5, 70])) < TOL
    cu = torch.tensor([0, 30, 70])
    with torch.inference_mode():
        gated_linear_attn(q, k, v, x, cu_seqlens=cu, impl="triton")
    q_ = q.clone().requires_grad_(True)
    o = gated_linear_attn(q_, k, v, x, cu_seqlens=cu, impl="triton")
    (dq,) = torch.autograd.grad((o * v).sum(), [q_])
    q6 = q.double().requires_grad_(True)
    ro = torch.cat([R.gated_linear_attn_recurrent(q6[:, s:e], *(t[:, s:e].double() for t in (k, v, x)))[0]
                    for s, e in ((0, 30), (30, 70))], 1)
    (rdq,) = torch.autograd.grad((ro * v.double()).sum(), [q6])
    assert rel(o, ro) < TOL and rel(dq, rdq) < TOL


def test_argument_types_and_nan_gates_refused_by_name():
    """A list for `cu_seqlens` or `initial_state`, and a NaN gate, are refused with a ValueError naming the
    argument (they raised AttributeError from inside the checks, or ran on and spread NaN)."""
    q, v = torch.randn(1, 10, 2, 16), torch.randn(1, 10, 2, 8)
    lf = -torch.rand(1, 10, 2, 16)
    with pytest.raises(ValueError, match="`cu_seqlens` must be a 1-D int32/int64 tensor"):
        gated_linear_attn(q, q, v, lf, cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match="`initial_state` must be a torch.Tensor .* got list"):
        lightning_attn(q, q, v, None, initial_state=[[0.0]])
    lf[0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"`log_f` .* must be <= 0 \(not NaN\), got NaN"):
        gated_linear_attn(q, q, v, lf, impl="triton")


def test_non_contiguous_inputs():
    """Views with a transposed memory layout give the same result as their contiguous copies."""
    base = torch.randn(1, 2, 60, 16)  # [B, H, T, D] storage, viewed as [B, T, H, D]
    q, k, v = ((base + i).transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    lf = F.logsigmoid(torch.randn(1, 2, 60, 16)).transpose(1, 2)
    o1 = gated_linear_attn(q, k, v, lf, impl="triton")
    o2 = gated_linear_attn(q.contiguous(), k.contiguous(), v.contiguous(), lf.contiguous(), impl="recurrent")
    assert rel(o1, o2) < TOL


def test_auto_stays_on_reference_off_cuda():
    """On CPU `auto` must not pick the kernels (they only run under the interpreter there)."""
    calls = []
    orig = ops.linear_attention._IMPLS["lightning_attn"]["triton"]
    ops.linear_attention._IMPLS["lightning_attn"]["triton"] = lambda *a: calls.append(1) or orig(*a)
    try:
        q = torch.randn(1, 20, 2, 16)
        lightning_attn(q, q, q, None)
    finally:
        ops.linear_attention._IMPLS["lightning_attn"]["triton"] = orig
    assert calls == []


def test_auto_on_cuda_follows_the_ops_config():
    """`auto` on a CUDA tensor: Triton for both ops; gated_linear_attn falls back to the chunked twin when
    the ops config says gla_triton=False; impl='chunked' in the config sends both to the twins."""
    from types import SimpleNamespace
    from ops import linear_attention as LA
    q = SimpleNamespace(is_cuda=True, shape=(1, 64, 2, 16))
    impls = LA._IMPLS
    old = ops.get_config()
    try:
        assert LA._resolve("lightning_attn", None, q, q) is impls["lightning_attn"]["triton"]
        ops.set_config(gla_triton=False)
        assert LA._resolve("gated_linear_attn", None, q, q) is impls["gated_linear_attn"]["chunked"]
        ops.set_config(gla_triton=True)
        assert LA._resolve("gated_linear_attn", None, q, q) is impls["gated_linear_attn"]["triton"]
        ops.set_config(impl="chunked")
        assert LA._resolve("lightning_attn", None, q, q) is impls["lightning_attn"]["chunked"]
    finally:
        ops.set_config(old)


def test_head_widths_the_triton_kernels_take():
    """The measured limits (docs/kernels.md, Head widths): what ran on an H100 fits, what asked for more
    shared memory than a block may use does not."""
    from ops.linear_attention import triton_fits
    for K, V in [(16, 16), (128, 128), (256, 128), (128, 256), (256, 256)]:
        assert triton_fits("lightning_attn", K, V)
    for K, V in [(320, 128), (384, 128), (512, 128), (128, 512), (512, 512)]:
        assert not triton_fits("lightning_attn", K, V)
    for K, V in [(16, 16), (128, 128), (256, 64), (320, 128), (384, 128), (512, 128)]:
        assert triton_fits("gated_linear_attn", K, V)
    for K, V in [(256, 256), (128, 256), (128, 512), (512, 512), (1024, 64)]:
        assert not triton_fits("gated_linear_attn", K, V)


def test_too_wide_heads_name_the_fix():
    """impl='triton' on heads wider than the kernels take: a ValueError that names the widths and the
    fixes, before any kernel is launched; `auto` on CUDA takes the chunked twin instead, warning once per
    width."""
    import warnings
    from types import SimpleNamespace
    from ops import linear_attention as LA
    q = torch.randn(1, 9, 2, 320)
    with pytest.raises(ValueError, match=r"Dk = 320, Dv = 320 .*more, narrower heads.*impl='chunked'"):
        lightning_attn(q, q, q, None, impl="triton")
    v = torch.randn(1, 9, 2, 512)
    with pytest.raises(ValueError, match=r"gated_linear_attn: heads of Dk = 320, Dv = 512"):
        gated_linear_attn(q, q, v, -torch.rand(1, 9, 2, 320), impl="triton")
    wide_q, wide_v = SimpleNamespace(is_cuda=True, shape=(1, 64, 2, 384)), SimpleNamespace(shape=(1, 64, 2, 128))
    LA._WARNED.clear()
    with pytest.warns(UserWarning, match="auto takes the chunked twin"):
        assert LA._resolve("lightning_attn", None, wide_q, wide_v) is LA._IMPLS["lightning_attn"]["chunked"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per width
        assert LA._resolve("lightning_attn", None, wide_q, wide_v) is LA._IMPLS["lightning_attn"]["chunked"]
        # GLA takes Dk = 384 at Dv = 128 on the kernels
        assert LA._resolve("gated_linear_attn", None, wide_q, wide_v) is LA._IMPLS["gated_linear_attn"]["triton"]


def test_more_sequences_than_the_grid_takes_name_the_fix():
    """One walk program per (sequence, head) on the grid's second axis, which CUDA caps at 65,535: packed
    input of that many documents x heads is refused under impl='triton' before a launch, naming the fix, and
    `auto` on CUDA takes the chunked twin with one warning; one fewer takes the kernels."""
    import warnings
    from types import SimpleNamespace
    from ops import linear_attention as LA
    H = 16
    q, v = SimpleNamespace(is_cuda=True, shape=(1, 70_000, H, 64)), SimpleNamespace(shape=(1, 70_000, H, 64))
    many = SimpleNamespace(shape=(LA.MAX_GRID_Y // H + 2,))   # cu_seqlens of 4096 documents: 65,536 programs
    fits = SimpleNamespace(shape=(LA.MAX_GRID_Y // H + 1,))   # 4095 documents: 65,520 programs
    for op in ("lightning_attn", "gated_linear_attn"):
        with pytest.raises(ValueError, match=rf"{op}: 4096 sequences .* x 16 heads = 65536 programs.*fewer tokens "
                                             rf"per micro-batch.*impl='chunked'"):
            LA._resolve(op, "triton", q, v, many)
        assert LA._resolve(op, "triton", q, v, fits) is LA._IMPLS[op]["triton"]
        LA._WARNED.clear()
        with pytest.warns(UserWarning, match="65536 programs.*auto takes the chunked twin"):
            assert LA._resolve(op, "auto", q, v, many) is LA._IMPLS[op]["chunked"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert LA._resolve(op, "auto", q, v, many) is LA._IMPLS[op]["chunked"]
            assert LA._resolve(op, "auto", q, v, fits) is LA._IMPLS[op]["triton"]
    # dense batches count their rows
    wide_batch = SimpleNamespace(is_cuda=True, shape=(LA.MAX_GRID_Y // H + 1, 8, H, 64))
    with pytest.raises(ValueError, match="4096 sequences"):
        LA._resolve("lightning_attn", "triton", wide_batch, wide_batch)


@triton.jit
def _round_kernel(x, y, a, b, c, N: tl.constexpr, M: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y + offs, tf32_round(tl.load(x + offs)))
    r = tl.arange(0, M)
    ta = tl.load(a + r[:, None] * M + r[None, :])
    tb = tl.load(b + r[:, None] * M + r[None, :])
    tl.store(c + r[:, None] * M + r[None, :], dot32(ta, tb, "tf32"))


def test_tf32_operands_round_to_nearest():
    """The gated kernels' tf32 products take operands rounded to the nearest tf32 value (ties away from
    zero, as cvt.rna.tf32), not truncated as tensor cores read them: truncation biases every product
    towards zero, and d log_f (a sequence-long reverse cumsum) accumulates that bias. Checked bit for bit
    against numpy, including ties, the largest finite value (which rounds up to inf) and inf itself."""
    import numpy as np
    import triton

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.randint(-20, 20, (4000,), generator=g).float(),
                   torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -11 + 2 ** -20, 0.0, -0.0,
                                 torch.finfo(torch.float32).max, float("inf"), -float("inf"),
                                 1 + 2 ** -11 - 2 ** -23])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    y = torch.empty_like(x)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    c = torch.empty(16, 16)
    _round_kernel[(1,)](x, y, a, b, c, N=n, M=16)
    bits = x.numpy().view(np.uint32).astype(np.uint64)
    keep = bits >> 13
    rest = bits & 0x1FFF
    up = rest >= 0x1000  # ties away from zero (the sign bit is apart from the magnitude)
    want = (((keep + up) << 13) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(y.numpy(), want)
    # ties away from zero; above a tie: up; below: down; max rounds to inf; inf stays inf
    assert y[4000:4004].tolist() == [1 + 2 ** -10, 1 + 4 * 2 ** -11, -(1 + 2 ** -10), 1 + 2 ** -10]
    assert y[4006:4010].tolist() == [float("inf"), float("inf"), -float("inf"), 1.0]
    rounded = lambda t: torch.from_numpy(  # noqa: E731
        (((t.numpy().view(np.uint32).astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32)).view(np.float32))
    torch.testing.assert_close(c, rounded(a).double().mm(rounded(b).double()).float(), rtol=1e-5, atol=1e-5)


@triton.jit
def _split_kernel(x, hi, lo, N: tl.constexpr):
    offs = tl.arange(0, N)
    h, low = split_bf16(tl.load(x + offs))
    tl.store(hi + offs, h)
    tl.store(lo + offs, low)


def test_bf16_pairs_keep_fp32_operands():
    """GLA's bf16 dq / dk walks take the fp32 state (and the decayed q, k) as a bf16 hi + lo pair in their
    products: hi is x in bf16, lo the rest x - hi in bf16. On the GPU both round to nearest (within 2^-17
    of x, relative; tests/test_kernels_gpu.py checks the walks' accuracy); the CPU interpreter truncates
    both, which still keeps hi + lo within 2^-14, against 2^-7 for bf16 alone."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    x = torch.randn(n, generator=g) * 10 ** torch.randint(-30, 30, (n,), generator=g).float()
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    _split_kernel[(1,)](x, hi, lo, N=n)
    assert ((hi.double() - x.double()).abs() <= 2 ** -7 * x.double().abs()).all()
    err = (hi.double() + lo.double() - x.double()) / x.double().abs()
    assert err.abs().max() <= 2 ** -14
    assert (lo != 0).float().mean() > 0.9  # lo carries the bits bf16 drops


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_gla_backward_keeps_the_cumsum_not_log_f(gate_dtype):
    """The backward keeps the forward's chunk-local cumulative log-decay (fp32, log f's size) in place of
    log f, so log f itself is not held for the backward; d log_f still comes back in log f's dtype and
    matches the float64 recurrence's, with a loss on the final state (whose gradient kernel takes its
    gates from that cumulative sum)."""
    q, k, v, x = _make("gla", 130, 2, 16, 16, seed=51)
    x = x.to(gate_dtype).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, S = gated_linear_attn(q, k, v, x, output_final_state=True, impl="triton")
    assert not any(t.numel() and t.data_ptr() == x.data_ptr() for t in saved), "log f was kept for the backward"
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    gen = torch.Generator().manual_seed(2)
    do, dS = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    (dx,) = torch.autograd.grad((o * do).sum() + (S * dS).sum(), [x])
    assert dx.dtype == gate_dtype
    x6 = x.detach().double().requires_grad_(True)
    ro, rS = R.gated_linear_attn_recurrent(q.double(), k.double(), v.double(), x6, None)
    (rdx,) = torch.autograd.grad((ro * do.double()).sum() + (rS * dS.double()).sum(), [x6])
    assert rel(dx, rdx) < (TOL if gate_dtype == torch.float32 else 1e-2)


def test_a_register_cap_override_reaches_the_level_kernels(monkeypatch):
    """A launch override's maxnreg (bench_kernels --launches variants) goes to the kernels it names as a
    Triton launch option and to no other. Without an override only the default cap reaches a launch:
    gla_A_sub_kernel's at 128-wide keys, none at 16. The interpreter ignores launch options, so the outputs
    stay those of the float64 recurrence."""
    import ops.triton_linear_attn as tla
    seen = []
    real = tla.launch

    def spy(kernel, grid, *args, **kw):
        seen.append((getattr(kernel, "__name__", getattr(getattr(kernel, "fn", None), "__name__", "?")),
                     kw.get("maxnreg")))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(tla, "launch", spy)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=g) for _ in range(3))
    lf = -20 * torch.rand(1, 70, 2, 16, generator=g)  # every chunk on the level kernels
    with force_plan(launch={"A_sub": {"maxnreg": 168}, "dqk_sub": {"maxnreg": 96}}):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v, lf)]
        o = gated_linear_attn(*ins, impl="triton")
        o.sum().backward()
    caps = {name: cap for name, cap in seen if cap is not None}
    assert caps == {"gla_A_sub_kernel": 168, "gla_dqk_sub_kernel": 96}, seen
    ref = R.gated_linear_attn_recurrent(*(t.double() for t in (q, k, v, lf)))[0]
    assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-3
    seen.clear()
    gated_linear_attn(q, k, v, lf, impl="triton")
    assert seen and all(cap is None for _, cap in seen)
    seen.clear()
    q, k, v = (torch.randn(1, 64, 1, 128, generator=g) for _ in range(3))
    lf = -20 * torch.rand(1, 64, 1, 128, generator=g)
    gated_linear_attn(q, k, v, lf, impl="triton")
    assert {name: cap for name, cap in seen if cap is not None} == {"gla_A_sub_kernel": 168}, seen


# ----------------------------------------------------------------------------------------------------
# the fused loss's softmax pass (ops.triton_cross_entropy)
# ----------------------------------------------------------------------------------------------------

def _ce64(h, w, t, ignore_index):
    """Mean cross-entropy by its definition in float64 (0 when every row is ignored)."""
    logits = h.double() @ w.double().t()
    keep = t != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    tgt = logits.gather(1, torch.where(keep, t, 0)[:, None]).squeeze(1)
    return ((lse - tgt) * keep).sum() / keep.sum().clamp(min=1)


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_fused_loss_kernel_strided_targets_odd_vocab(monkeypatch, ignore_index):
    """The loss through the Triton softmax pass: a vocabulary one past the kernel's 4096-column block, 37
    rows in chunks of 5, ignored rows (ignore_index negative, and one inside the vocabulary), and targets
    that are a strided view (a column of [N, 2]): the kernel read them at unit stride, so every row but
    the first took another row's target (loss 7.39 against 6.41). Loss and gradients against float64."""
    import ops.cross_entropy as CE
    from ops.triton_cross_entropy import ce_rows_triton
    monkeypatch.setattr(CE, "_rows_impl", lambda logits: ce_rows_triton)  # CPU stands in for CUDA
    g = torch.Generator().manual_seed(0)
    N, d, V = 37, 16, 4097
    h = torch.randn(N, d, generator=g).requires_grad_(True)
    w = torch.randn(V, d, generator=g).requires_grad_(True)
    pairs = torch.randint(0, V, (N, 2), generator=g)
    pairs[::4, 0] = ignore_index
    t = pairs[:, 0]
    assert not t.is_contiguous()
    loss = ops.linear_cross_entropy(h, w, t, ignore_index=ignore_index, chunk_size=5)
    grads = torch.autograd.grad(loss, [h, w])
    h64, w64 = (x.detach().double().requires_grad_(True) for x in (h, w))
    ref = _ce64(h64, w64, t, ignore_index)
    rgrads = torch.autograd.grad(ref, [h64, w64])
    assert abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    for a, b in zip(grads, rgrads):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fused_loss_rows_with_targets_out_of_range_are_nan(impl):
    """A target outside [0, V) other than ignore_index: the kernel read the logit at row * V + target, in
    another row or past the chunk (no error, a wrong finite loss; on a GPU possibly an illegal address),
    and the twin raised an index error from gather (on a GPU a device-side assert). Both now give that row
    a NaN target logit and gradient, without a host sync; the other rows are exact, the ignored one 0."""
    import ops.cross_entropy as CE
    from ops.triton_cross_entropy import ce_rows_triton
    rows = ce_rows_triton if impl == "triton" else CE._ce_rows_torch
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 10, generator=g)
    t = torch.tensor([1, 10, -100, -3, 9])
    want = logits.double()
    lse, tgt = rows(logits, t, torch.tensor([0.25]), -100, True)
    bad = torch.tensor([False, True, False, True, False])
    assert tgt[bad].isnan().all() and not tgt[~bad].isnan().any()
    assert torch.allclose(lse.double(), torch.logsumexp(want, -1), atol=1e-6)
    assert torch.allclose(tgt[[0, 4]].double(), want[[0, 4], [1, 9]], atol=1e-6)
    assert logits[bad].isnan().all() and not logits[~bad].isnan().any()
    grad = (want.softmax(-1) - F.one_hot(t.clamp(0, 9), 10).double()) * 0.25
    assert torch.allclose(logits[[0, 4]].double(), grad[[0, 4]], atol=1e-6)
    assert torch.equal(logits[2], torch.zeros(10))


@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_decays_within_fp32_spacing_of_one_keep_their_rate(impl):
    """TNL's last layer has lambda = exp(-s * 1e-5), within 1e-7 of 1, where fp32 steps by 6e-8: rounding
    lambda itself moves the rate -log(lambda) by up to half. A float64 decay is taken to its log at that
    precision, so o_t = sum_n lambda^n (q . k = v = 1) follows the float64 closed form; the old fp32
    rounding was 2e-5 off at T = 2047."""
    T, H, D = 2047, 2, 16
    rates = torch.tensor([2 ** -8 * 1e-5, 2 ** -2 * 1e-5], dtype=torch.float64)
    decay = torch.exp(-rates)
    q = k = torch.full((1, T, H, D), 0.25)          # q . k = 1
    v = torch.ones(1, T, H, D)
    o = lightning_attn(q, k, v, decay, impl=impl)
    n = torch.arange(T, dtype=torch.float64)
    want = torch.cumsum(torch.exp(-rates[None, :] * n[:, None]), dim=0)   # [T, H]
    torch.testing.assert_close(o[0, :, :, 0].double(), want, rtol=2e-6, atol=0)

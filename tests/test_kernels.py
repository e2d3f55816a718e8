"""The Triton linear-attention kernels against the float64 step-by-step recurrence, on CPU under the
Triton interpreter (conftest sets TRITON_INTERPRET=1). Tiny odd shapes: T is never a chunk multiple.
Every output and every input's gradient (q, k, v, log_f, initial state; the final state's gradient
flows back too) must agree to relative error < 1e-3 in fp32."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import ops  # noqa: E402
from ops import gated_linear_attn, lightning_attn  # noqa: E402
from ops import reference as R  # noqa: E402

pytestmark = pytest.mark.skipif("triton" not in ops.available_impls("lightning_attn"),
                                reason="the triton implementation did not register")
TOL = 1e-3


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


def _check_against_recurrence(kind, q, k, v, x, h0, cu=None, state_grad=True):
    """Run the triton impl and the float64 recurrence (per document when packed) and compare
    outputs, final states and the gradients of every differentiable input (the loss also reads the
    final state unless `state_grad` is False)."""
    ins = [q, k, v] + ([h0] if h0 is not None else []) + ([x] if kind == "gla" else [])
    ins = [t.clone().requires_grad_(True) for t in ins]
    q_, k_, v_ = ins[:3]
    h0_ = ins[3] if h0 is not None else None
    x_ = ins[-1] if kind == "gla" else x
    f = gated_linear_attn if kind == "gla" else lightning_attn
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


@pytest.mark.parametrize("kind,T,Dk,Dv", [
    ("la", 83, 32, 16), ("la", 130, 16, 32), ("nodecay", 77, 32, 16), ("nodecay", 65, 24, 24),
    ("gla", 83, 32, 16), ("gla", 50, 24, 16),
])
def test_matches_recurrence(kind, T, Dk, Dv):
    q, k, v, x = _make(kind, T, 2, Dk, Dv)
    h0 = torch.randn(1, 2, Dk, Dv) * 0.5
    _check_against_recurrence(kind, q, k, v, x, h0)


@pytest.mark.parametrize("kind", ["la", "nodecay", "gla"])
def test_batch_without_initial_state(kind):
    q, k, v, x = _make(kind, 70, 2, 16, 16, N=2, seed=3)
    _check_against_recurrence(kind, q, k, v, x, None)


@pytest.mark.parametrize("shift", [-12.0, 14.0])
def test_gla_extreme_gates(shift):
    """Gates near 0 (log_f ~ -12 per step: a chunk's cumulative decay passes e^-88, the naive
    q exp(b), k exp(-b) factorisation overflows) and near 1 (log_f ~ -1e-6)."""
    q, k, v, x = _make("gla", 77, 2, 16, 16, gate_scale=1.0, gate_shift=shift, seed=5)
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16), state_grad=False)


def test_gla_gates_near_zero_with_final_state_grad():
    """Gates near 0 and a loss on the final state: d log_f's final-state term is formed directly
    (gla_state_grad_kernel), not as 'all minus a suffix', so it keeps its relative precision."""
    q, k, v, x = _make("gla", 77, 2, 16, 16, gate_scale=1.0, gate_shift=-12.0, seed=5)
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16), state_grad=True)


@pytest.fixture
def subchunk_only(monkeypatch):
    """Mark no chunk tame: every chunk takes the sub-chunk kernels (the path of gates near 0)."""
    import ops.triton_linear_attn as TL
    monkeypatch.setattr(TL, "TAME", -1.0)


@pytest.mark.parametrize("T", [83, 130])
def test_gla_subchunk_path(subchunk_only, T):
    q, k, v, x = _make("gla", T, 2, 24, 16, seed=11)
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 24, 16) * 0.5)


def test_gla_mixed_tame_and_subchunk_chunks():
    """One sequence whose first chunk is tame and whose second is not (and the reverse in the other
    head): both paths in one launch."""
    import ops.triton_linear_attn as TL
    T = 120
    q, k, v, _ = _make("gla", T, 2, 16, 16, seed=13)
    x = torch.full((1, T, 2, 16), -0.05)
    x[:, 64:, 0] = -3.0  # head 0: chunk 1 decays by e^-168 -> sub-chunk path
    x[:, :64, 1] = -3.0  # head 1: chunk 0
    _, flags = TL._gla_cumsum(x, torch.zeros(1, dtype=torch.int32), T, (2, None))
    assert flags[0, [0, 64]].tolist() == [[1, 0], [0, 1]]
    _check_against_recurrence("gla", q, k, v, x, torch.randn(1, 2, 16, 16))


def test_gla_backward_uses_the_forward_chunk_split(monkeypatch):
    """The backward takes each chunk down the path the forward chose (its saved flags), even if the
    threshold changed in between; recomputing the split would drop intra-chunk gradient terms."""
    import ops.triton_linear_attn as TL
    q, k, v, x = _make("gla", 90, 2, 16, 16, gate_shift=2.0, seed=19)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, x)]
    o = gated_linear_attn(*ins, impl="triton")
    monkeypatch.setattr(TL, "TAME", -1.0)  # would mark every chunk for the sub-chunk kernels
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((o * do).sum(), ins)
    i64 = [t.detach().double().requires_grad_(True) for t in ins]
    ro, _ = R.gated_linear_attn_recurrent(*i64)
    rgrads = torch.autograd.grad((ro * do.double()).sum(), i64)
    errs = [rel(a, b) for a, b in zip(grads, rgrads)]
    assert all(e < TOL for e in errs), errs


@pytest.mark.parametrize("kind", ["la", "gla", "gla-subchunk"])
def test_cu_seqlens_resets_state(kind, monkeypatch):
    """Packed documents (lengths 17, 70, 40: boundaries inside chunks) match separate runs."""
    if kind == "gla-subchunk":
        import ops.triton_linear_attn as TL
        monkeypatch.setattr(TL, "TAME", -1.0)
        kind = "gla"
    q, k, v, x = _make(kind, 127, 2, 16, 16, seed=7, gate_shift=-1.0 if kind == "gla" else 0.0)
    cu = torch.tensor([0, 17, 87, 127])
    _check_against_recurrence(kind, q, k, v, x, torch.randn(3, 2, 16, 16), cu=cu)


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


@pytest.mark.parametrize("kind", ["la", "gla"])
def test_fused_backward_launch(kind, monkeypatch):
    """The three backward scans in one launch (LINSCALE_FUSED_BWD=1) give the same gradients."""
    import ops.triton_linear_attn as TL
    monkeypatch.setattr(TL, "FUSED_BWD", True)
    q, k, v, x = _make(kind, 70, 2, 16, 24, seed=17)
    _check_against_recurrence(kind, q, k, v, x, torch.randn(1, 2, 16, 24))


def test_auto_on_cuda_picks_only_gpu_validated_kernels(monkeypatch):
    """`auto` on a CUDA tensor: Triton for both ops (GPU-validated); gated_linear_attn falls back to the
    chunked twin when switched off (LINSCALE_GLA_TRITON=0)."""
    from types import SimpleNamespace
    from ops import linear_attention as LA
    q = SimpleNamespace(is_cuda=True, shape=(1, 64, 2, 16))
    impls = LA._IMPLS
    assert LA._resolve("lightning_attn", "auto", q) is impls["lightning_attn"]["triton"]
    monkeypatch.setitem(LA._AUTO_TRITON, "gated_linear_attn", False)  # LINSCALE_GLA_TRITON=0
    assert LA._resolve("gated_linear_attn", "auto", q) is impls["gated_linear_attn"]["chunked"]
    monkeypatch.setitem(LA._AUTO_TRITON, "gated_linear_attn", True)
    assert LA._resolve("gated_linear_attn", "auto", q) is impls["gated_linear_attn"]["triton"]

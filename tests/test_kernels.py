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
    """Known limit (docs/kernels.md): with gates near 0 and a loss on the final state, d log_f is the
    small difference of O(1) terms (d log_f = reverse cumsum of q dq - k dk plus the final state's
    term), so its fp32 error is small against those terms, not against its own tiny size."""
    q, k, v, x = _make("gla", 77, 2, 16, 16, gate_scale=1.0, gate_shift=-12.0, seed=5)
    ins = [t.clone().requires_grad_(True) for t in (q, k, x)]
    o, S = gated_linear_attn(ins[0], ins[1], v, ins[2], output_final_state=True, impl="triton")
    gen = torch.Generator().manual_seed(1)
    do, dS = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    dq, dk, dx = torch.autograd.grad((o * do).sum() + (S * dS).sum(), ins)
    x64 = x.double().requires_grad_(True)
    ro, rS = R.gated_linear_attn_recurrent(q.double(), k.double(), v.double(), x64)
    rdx, = torch.autograd.grad((ro * do.double()).sum() + (rS * dS.double()).sum(), [x64])
    scale = (q * dq).norm() + (k * dk).norm()
    assert ((dx.double() - rdx).norm() / scale).item() < 1e-6
    assert rel(dx, rdx) < 2e-2


@pytest.mark.parametrize("kind", ["la", "gla"])
def test_cu_seqlens_resets_state(kind):
    """Packed documents (lengths 17, 70, 40: boundaries inside chunks) match separate runs."""
    q, k, v, x = _make(kind, 127, 2, 16, 16, seed=7, gate_shift=-4.0 if kind == "gla" else 0.0)
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

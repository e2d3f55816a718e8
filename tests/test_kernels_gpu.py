"""GPU checks of the Triton linear-attention kernels at real shapes, bf16, against the float64 chunked
twin (itself checked against the step-by-step recurrence in tests/test_kernels.py). Skipped without
CUDA; on a GPU machine run `TRITON_INTERPRET=0 pytest tests/test_kernels_gpu.py` (conftest turns the
interpreter on unless told otherwise)."""
import os

import pytest
import torch
import torch.nn.functional as F

from ops import gated_linear_attn, lightning_attn
from ops import reference as R

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="compiled kernels wanted: run with TRITON_INTERPRET=0")]
DEV = "cuda"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _decays(H):
    from models.tnl import tnl_decays
    return torch.tensor(tnl_decays(H, 0, 24), device=DEV)  # layer 0: the strongest decays


def _inputs(B, T, H, Dk, Dv, kind, gate=None):
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: (torch.randn(*s, device=DEV, generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    q, k, v = r(B, T, H, Dk), r(B, T, H, Dk), r(B, T, H, Dv)
    if kind == "gla":
        if gate is None:
            x = F.logsigmoid(torch.randn(B, T, H, Dk, device=DEV, generator=g) * 3 + 2)
        else:
            x = torch.full((B, T, H, Dk), gate, device=DEV)
    else:
        x = _decays(H) if kind == "la" else None
    return q, k, v, x


def _run(kind, q, k, v, x, h0=None, impl="triton", cu=None):
    f = gated_linear_attn if kind == "gla" else lightning_attn
    return f(q, k, v, x, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl=impl)


def _ref64(kind, q, k, v, x, h0=None):
    d = lambda t: None if t is None else t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    if kind == "gla":
        return R.gated_linear_attn_chunked(d(q), d(k), d(v), d(x), d(h0))
    return R.lightning_attn_chunked(d(q), d(k), d(v), None if x is None else x.double(), d(h0))


@pytest.mark.parametrize("kind,Dk,Dv", [("la", 128, 128), ("la", 64, 96), ("nodecay", 256, 128),
                                        ("nodecay", 96, 64), ("gla", 128, 128), ("gla", 256, 64),
                                        ("gla", 96, 64), ("gla-subchunk", 128, 128)])
def test_bf16_grads_vs_float64(kind, Dk, Dv, monkeypatch):
    if kind == "gla-subchunk":  # no chunk tame: every chunk through the sub-chunk kernels
        import ops.triton_linear_attn as TL
        monkeypatch.setattr(TL, "TAME", -1.0)
        kind = "gla"
    B, T, H = 2, 1000 + 37, 4
    q, k, v, x = _inputs(B, T, H, Dk, Dv, kind)
    h0 = torch.randn(B, H, Dk, Dv, device=DEV) * 0.1
    ins = [t.requires_grad_(True) for t in (q, k, v, h0)] + ([x.requires_grad_(True)] if kind == "gla" else [])
    o, S = _run(kind, q, k, v, x, h0)
    do, dS = torch.randn_like(o), torch.randn_like(S)
    grads = torch.autograd.grad((o.float() * do).sum() + (S * dS).sum(), ins)
    d64 = [t.detach().double().requires_grad_(True) for t in ins]
    ro, rS = (R.gated_linear_attn_chunked(d64[0], d64[1], d64[2], d64[4], d64[3]) if kind == "gla" else
              R.lightning_attn_chunked(d64[0], d64[1], d64[2], None if x is None else x.double(), d64[3]))
    rg = torch.autograd.grad((ro * do.double()).sum() + (rS * dS.double()).sum(), d64)
    errs = {"o": rel(o, ro), "S": rel(S, rS)}
    errs.update({n: rel(a, b) for n, a, b in zip(["dq", "dk", "dv", "dh0", "dlog_f"], grads, rg)})
    print(kind, Dk, Dv, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.parametrize("kind,gate", [("la", None), ("nodecay", None), ("gla", None), ("gla", -30.0),
                                       ("gla", -1e-6)])
def test_long_sequence_finite(kind, gate):
    """T = 32K: TNL's strongest decays, cos2's undecayed sums, HGRN2 gates near 0 and near 1."""
    B, T, H = 1, 32768, 16
    Dk = 256 if kind == "nodecay" else 128
    q, k, v, x = _inputs(B, T, H, Dk, 128, kind, gate)
    ins = [q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)]
    if kind == "gla":
        ins.append(x.requires_grad_(True))
    o, S = _run(kind, q, k, v, x)
    grads = torch.autograd.grad(o.float().square().mean() * 1e-2, ins)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        ro, rS = _ref64(kind, q, k, v, x)
    print(kind, gate, "o", rel(o, ro), "S", rel(S, rS))
    assert rel(o, ro) < 1e-2 and rel(S, rS) < 1e-2


@pytest.mark.parametrize("kind", ["la", "gla"])
def test_varlen_matches_separate_runs(kind):
    H, D = 8, 128
    lens = [1500, 77, 2600, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
    q, k, v, x = _inputs(1, sum(lens), H, D, D, kind)
    o, S = _run(kind, q, k, v, x, cu=cu)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xs = x[:, s:e] if kind == "gla" else x
        oi, Si = _run(kind, q[:, s:e], k[:, s:e], v[:, s:e], xs)
        assert rel(o[:, s:e], oi) < 1e-3 and rel(S[i:i + 1], Si) < 1e-3


def test_rms_norm_bf16():
    from ops.norm import rms_norm, rms_norm_reference
    x = torch.randn(4096, 2048, device=DEV).to(torch.bfloat16).requires_grad_(True)
    w = (torch.rand(2048, device=DEV) + 0.5).requires_grad_(True)
    y = rms_norm(x, w)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad((y.float() * dy).sum(), [x, w])
    x6, w6 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y6 = rms_norm_reference(x6, w6)
    dx6, dw6 = torch.autograd.grad((y6 * dy.double()).sum(), [x6, w6])
    assert rel(y, y6) < 1e-2 and rel(dx, dx6) < 1e-2 and rel(dw, dw6) < 1e-2

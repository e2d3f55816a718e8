"""Closed-form elementwise pieces of the models against the formulas they replace, in float64 and fp32."""
import pytest
import torch
import torch.nn.functional as F

from models.hgrn2 import TINY, forget_gate

F_VALUES = [-120, -90, -60, -30, -5, -1, -0.1, 0, 0.1, 1, 5, 17, 30, 60, 120.0]
BETAS = [0, 1e-30, 1e-3, 0.3, 0.5, 0.9, 0.999, 0.9999999]


def log_space_gate(f, beta):
    """HGRN2's gate as written in log space: log(lambda) = logaddexp(log max(beta, tiny), log1p(-beta) +
    logsigmoid(f)), k = -expm1(log lambda)."""
    log_lam = torch.logaddexp(beta.clamp_min(TINY).log(), torch.log1p(-beta) + F.logsigmoid(f))
    return log_lam, -torch.expm1(log_lam)


def grid(dtype):
    f = torch.tensor(F_VALUES, dtype=dtype)[:, None].expand(len(F_VALUES), len(BETAS)).clone()
    return f, torch.tensor(BETAS, dtype=dtype)


def test_forget_gate_matches_the_log_space_formula_in_float64():
    f, beta = grid(torch.float64)
    f1, b1 = f.clone().requires_grad_(), beta.clone().requires_grad_()
    f0, b0 = f.clone().requires_grad_(), beta.clone().requires_grad_()
    log_lam, k = forget_gate(f1, b1)
    log_lam0, k0 = log_space_gate(f0, b0)
    torch.testing.assert_close(log_lam, log_lam0, rtol=1e-12, atol=1e-13)
    # k where the log-space form still has digits left (it cancels for lambda near 1)
    ok = k0 > 1e-6
    torch.testing.assert_close(k[ok], k0[ok], rtol=1e-9, atol=0)
    g_log, g_k = torch.randn_like(log_lam), torch.randn_like(k)
    (log_lam * g_log + k * g_k).sum().backward()
    (log_lam0 * g_log + k0 * g_k).sum().backward()
    torch.testing.assert_close(f1.grad, f0.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(b1.grad, b0.grad, rtol=1e-10, atol=0)


def test_forget_gate_k_is_exact_where_lambda_is_near_one():
    # lambda = beta + (1 - beta) sigmoid(f): 1 - lambda = (1 - beta) sigmoid(-f), e.g. 1e-3 * e^-30
    f, beta = torch.tensor([30.0, 60.0]), torch.tensor([0.999, 0.999])
    _, k = forget_gate(f, beta)
    exact = (1 - beta.double()) * torch.sigmoid(-f.double())
    torch.testing.assert_close(k.double(), exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_forget_gate_fp32_against_float64(dtype):
    f, beta = grid(dtype)
    log_lam, k = forget_gate(f, beta)
    ref_log, ref_k = forget_gate(f.double(), beta.double())
    assert torch.isfinite(log_lam).all() and (log_lam <= 0).all()
    torch.testing.assert_close(log_lam.double(), ref_log, rtol=0, atol=4e-6)
    big = ref_k > 1e-30
    torch.testing.assert_close(k.double()[big], ref_k[big], rtol=2e-6, atol=0)
    fg, bg = f.clone().requires_grad_(), beta.clone().requires_grad_()
    out = forget_gate(fg, bg)
    (out[0].sum() + out[1].sum()).backward()
    assert torch.isfinite(fg.grad).all() and torch.isfinite(bg.grad).all()


def test_forget_gate_gradcheck():
    g = torch.Generator().manual_seed(0)
    f = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 4).requires_grad_()
    beta = torch.tensor([0.01, 0.1, 0.5, 0.9, 0.99], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(forget_gate, (f, beta))


# ---------------------------------------------------------------------------------------------------
# cosFormer2's LRPE
# ---------------------------------------------------------------------------------------------------

def lrpe_concat(z, theta, t):
    """The LRPE as its definition reads: [z cos(t theta), z sin(t theta)], angles in z's precision."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    ang = t.to(acc)[:, None, None] * theta.to(acc)[None]
    zf = z.to(acc)
    return torch.cat([zf * ang.cos(), zf * ang.sin()], dim=-1).to(z.dtype)


def lrpe(z, theta, t):
    from ops.lrpe import lrpe_reference
    return lrpe_reference(z, theta, t)


@pytest.mark.parametrize("start", [0, 7, 8000])
def test_lrpe_matches_the_concatenated_form_in_float64(start):
    g = torch.Generator().manual_seed(start)
    B, T, H, e = 2, 37, 3, 8
    theta = (10000.0 ** (-torch.arange(e, dtype=torch.float64) / e)).repeat(H, 1) * (1 + torch.rand(H, 1, generator=g, dtype=torch.float64))
    t = torch.arange(start, start + T)
    z = torch.randn(B, T, H, e, generator=g, dtype=torch.float64)
    z1, th1 = z.clone().requires_grad_(), theta.clone().requires_grad_()
    z0, th0 = z.clone().requires_grad_(), theta.clone().requires_grad_()
    out, ref = lrpe(z1, th1, t), lrpe_concat(z0, th0, t)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-11)
    gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * gout).sum().backward()
    (ref * gout).sum().backward()
    torch.testing.assert_close(z1.grad, z0.grad, rtol=1e-12, atol=1e-11)
    torch.testing.assert_close(th1.grad, th0.grad, rtol=1e-10, atol=1e-9)


def test_lrpe_fp32_is_as_close_to_float64_as_the_concatenated_form():
    # t theta reaches 8000 rad: rounded to fp32 unreduced (the concatenated form) it is off by ~5e-4 rad;
    # the twin reduces it modulo 2 pi in float64 first, so it can only be closer
    g = torch.Generator().manual_seed(1)
    theta = torch.rand(4, 16, generator=g) + 0.1
    t = torch.arange(8000, 8100)
    z = torch.randn(1, 100, 4, 16, generator=g)
    exact = lrpe_concat(z.double(), theta.double(), t)
    err_new = (lrpe(z, theta, t).double() - exact).abs().max()
    err_old = (lrpe_concat(z, theta, t).double() - exact).abs().max()
    assert err_new <= 1.5 * err_old + 1e-6, (err_new, err_old)
    # bf16 in, bf16 out, as under autocast
    assert lrpe(z.bfloat16(), theta, t).dtype == torch.bfloat16


@pytest.mark.parametrize("start", [8000, 65_536, 1_000_000])
def test_lrpe_fp32_angles_are_reduced_before_rounding(start):
    """The fp32 twin against the definition in float64 at long positions: t theta is reduced modulo 2 pi in
    float64 before its one rounding, so the error stays at fp32 rounding (~1e-7 rad) wherever the sequence
    starts; rounded unreduced it would be ~t theta * 6e-8 rad (4e-3 at 64K, 0.03 at 1M)."""
    g = torch.Generator().manual_seed(2)
    theta = torch.rand(3, 16, generator=g) + 0.1
    t = torch.arange(start, start + 70)
    z = torch.randn(1, 70, 3, 16, generator=g)
    z32, th32 = z.clone().requires_grad_(), theta.clone().requires_grad_()
    z64, th64 = z.double().requires_grad_(), theta.double().requires_grad_()
    out, exact = lrpe(z32, th32, t), lrpe_concat(z64, th64, t)
    assert (out.double() - exact).abs().max().item() < 2e-6
    gout = torch.randn(out.shape, generator=g)
    dz, dth = torch.autograd.grad((out * gout).sum(), [z32, th32])
    dz6, dth6 = torch.autograd.grad((exact * gout.double()).sum(), [z64, th64])
    assert ((dz.double() - dz6).norm() / dz6.norm()).item() < 1e-6
    assert ((dth.double() - dth6).norm() / dth6.norm()).item() < 1e-6


def test_cos2_mixer_output_does_not_depend_on_the_start_position():
    """LRPE is relative (phi(q_t) . phi(k_s) depends on t - s only), so a cos2 token mixer without a state
    gives the same output wherever its tokens start: what decoding at an offset and a sequence-parallel
    segment rely on. In fp32 against the float64 mixer at position 0."""
    from models.config import ModelConfig
    from models.cosformer2 import Cos2TokenMixer
    torch.manual_seed(0)
    cfg = ModelConfig(arch="cos2", n_layers=1, d_model=32, n_heads=2, d_glu=64, vocab_size=50)
    mixer = Cos2TokenMixer(cfg, 0)
    with torch.no_grad():
        for p in (mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight):
            p.normal_(0, 0.3)
    mixer64 = Cos2TokenMixer(cfg, 0).double()
    mixer64.load_state_dict(mixer.state_dict())
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        want = mixer64(x.double(), pos=0)
        for start in (0, 10_000, 1_000_000):
            got = mixer(x, pos=start).double()
            assert ((got - want).norm() / want.norm()).item() < 2e-6, start


# ---------------------------------------------------------------------------------------------------
# the plain-op forms that fully checkpointed blocks run
# ---------------------------------------------------------------------------------------------------

def _grads(fn, *args):
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    wrt = [x for x in leaves if x.requires_grad]
    return outs, torch.autograd.grad(loss, wrt)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forget_gate_plain_ops_equal_the_function(dtype):
    """Values bitwise equal to the autograd.Function's (a checkpointed block must not change the loss),
    gradients equal to its hand-written backward (float64: to 1e-12; fp32: to rounding) and finite where
    one branch of the select is infinite (beta = 0, f = -120: k = 1, log1p(-k) = -inf unselected).
    Below the floor (beta < tiny) d k / d beta differs: the Function differentiates k as 1 - lambda with
    lambda floored, the plain ops k = (1 - beta) sigmoid(-f) itself; beta is below tiny only at layer 0,
    where beta = 0 by construction and its gradient reaches no parameter."""
    f, beta = grid(dtype)
    (o1, k1), g1 = _grads(lambda a, b: forget_gate(a, b, recomputed=True), f, beta)
    (o0, k0), g0 = _grads(lambda a, b: forget_gate(a, b), f, beta)
    assert torch.equal(o1, o0) and torch.equal(k1, k0)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-30)
    assert all(torch.isfinite(g).all() for g in g1)
    floored = beta >= TINY
    torch.testing.assert_close(g1[0], g0[0], **tol)
    torch.testing.assert_close(g1[1][floored], g0[1][floored], **tol)

"""cosFormer2's fused feature map phi(silu(.)) for q and k (`ops.silu_lrpe`): the Triton kernel under the
interpreter against the float64 plain-PyTorch twin and against the LRPE's definition."""
import os

import pytest
import torch

pytest.importorskip("triton")

import ops.lrpe as L  # noqa: E402
from ops.lrpe import lrpe_reference, silu_lrpe, silu_lrpe_reference  # noqa: E402


def definition(x, theta, t):
    """phi(silu(x)) as the paper writes it, in float64: [z cos(t theta), z sin(t theta)] per head."""
    H, e = theta.shape
    z = torch.nn.functional.silu(x.double()).unflatten(-1, (H, e))
    ang = t.double()[:, None, None] * theta.double()
    return torch.cat([z * ang.cos(), z * ang.sin()], dim=-1)


def inputs(B, T, H, e, start, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, H * e, generator=g) * 2).to(dtype)
    k = (torch.randn(B, T, H * e, generator=g) * 2).to(dtype)
    theta = (10000.0 ** (-torch.arange(e) / e)).repeat(H, 1) * (1 + torch.rand(H, 1, generator=g))
    return q, k, theta, torch.arange(start, start + T)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("B,T,H,e,start", [(2, 37, 3, 8, 0), (1, 70, 2, 12, 8000), (3, 5, 1, 16, 65_000),
                                           (1, 129, 2, 64, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_fwd_bwd_against_float64(B, T, H, e, start, dtype):
    """Outputs, dq, dk and dtheta of the kernel against the float64 twin: token counts that are not a
    multiple of the 64-token tile, head widths whose channel block is 4, 8, 16 and 64, positions past 64K
    (angles of 1e4-6e4 rad)."""
    q, k, theta, t = inputs(B, T, H, e, start, dtype)
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_(), theta.clone().requires_grad_()]
    oq, ok = silu_lrpe(*leaves, t, impl="triton")
    assert oq.dtype == dtype and oq.shape == (B, T, H, 2 * e)
    g = torch.Generator().manual_seed(1)
    gq, gk = torch.randn(oq.shape, generator=g).to(dtype), torch.randn(ok.shape, generator=g).to(dtype)
    grads = torch.autograd.grad((oq.float() * gq.float()).sum() + (ok.float() * gk.float()).sum(), leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, theta)]
    rq, rk = silu_lrpe_reference(*ref_leaves, t)
    ref = torch.autograd.grad((rq * gq.double()).sum() + (rk * gk.double()).sum(), ref_leaves)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel(oq, rq) < tol and rel(ok, rk) < tol
    for a, b in zip(grads, ref):
        assert rel(a, b) < tol, (rel(a, b), tol)
    torch.testing.assert_close(rq, definition(q, theta, t), rtol=0, atol=1e-10)  # sin as cos(x - pi/2)


def test_kernel_angles_are_reduced_in_float64():
    """At positions near 1M (angles up to 1e6 rad) the kernel's fp32 output stays within 1e-5 of the
    definition in float64; rounding t theta to fp32 before the cosine would be off by up to 0.03."""
    q, k, theta, t = inputs(1, 40, 2, 8, 1_000_000, torch.float32)
    oq, _ = silu_lrpe(q, k, theta, t, impl="triton")
    want = definition(q, theta, t)
    assert (oq.double() - want).abs().max().item() < 1e-5
    H, e = theta.shape
    rounded = (t.float()[:, None, None] * theta.float()).double()  # the angle rounded to fp32 first
    z = torch.nn.functional.silu(q.double()).unflatten(-1, (H, e))
    assert (z * rounded.cos() - want[..., :e]).abs().max().item() > 1e-3


def test_an_output_left_out_of_the_loss_gets_a_zero_gradient():
    q, k, theta, t = inputs(2, 20, 2, 8, 3, torch.float32)
    leaves = [x.clone().requires_grad_() for x in (q, k, theta)]
    oq, _ = silu_lrpe(*leaves, t, impl="triton")
    dq, dk, dth = torch.autograd.grad(oq.sum(), leaves)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, theta)]
    rq, _ = silu_lrpe_reference(*ref_leaves, t)
    rdq, rdk, rdth = torch.autograd.grad(rq.sum(), ref_leaves, allow_unused=True)
    assert rel(dq, rdq) < 1e-5 and rel(dth, rdth) < 1e-5
    assert torch.equal(dk, torch.zeros_like(dk))


def test_lrpe_is_relative():
    """phi(q_t) . phi(k_s) = sum_j q_j k_j cos((t - s) theta_j), unchanged when both positions shift."""
    _, _, theta, _ = inputs(1, 1, 2, 8, 0, torch.float64)
    theta = theta.double()
    q = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    t, s = 9, 4
    want = (q[0, t] * k[0, s] * torch.cos((t - s) * theta)).sum(-1)
    for start in (0, 100):
        pos = torch.arange(start, start + 12)
        got = (lrpe_reference(q, theta, pos)[0, t] * lrpe_reference(k, theta, pos)[0, s]).sum(-1)
        torch.testing.assert_close(got, want)


def test_the_custom_op_registrations():
    """Schema, fake (meta) kernel and autograd registration agree with the real kernel (torch.library's
    own checks), so the op traces under torch.compile."""
    from ops.triton_lrpe import _silu_lrpe_fwd
    q, k, theta, t = inputs(2, 9, 2, 8, 5, torch.float32)
    torch.library.opcheck(_silu_lrpe_fwd, (q.requires_grad_(), k, theta.requires_grad_(), t),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_dispatch(monkeypatch):
    q, k, theta, t = inputs(1, 4, 1, 8, 0, torch.float32)
    assert L.lrpe_impl(q) == "reference"  # CPU
    assert L.lrpe_impl(q, "triton") == "triton"
    assert L.lrpe_impl(q, "reference") == "reference"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert L.lrpe_impl(q) == "triton"
    assert L.lrpe_impl(q.double()) == "reference"
    assert L.lrpe_impl(q, "chunked") == "reference"


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, th, t: (q, k[:, :-1], th, t), "q and k must both be"),
    (lambda q, k, th, t: (q, k, th[:, :-1], t), "theta must be"),
    (lambda q, k, th, t: (q, k, th, t.float()), "positions must be"),
    (lambda q, k, th, t: (q, k, th, t[:-1]), "positions must be"),
])
def test_bad_inputs_name_the_argument(bad, match):
    q, k, theta, t = inputs(1, 4, 2, 8, 0, torch.float32)
    with pytest.raises(ValueError, match=match):
        silu_lrpe(*bad(q, k, theta, t))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_operands_off_q_device_and_integer_inputs_are_refused(impl):
    """Positions made by torch.arange(T) without a device sit on the CPU while q is on the GPU: the kernel
    was handed a CPU pointer (Triton's pointer error, naming neither the argument nor the fix). Every
    operand off q's device, and integer q, k or theta, is a ValueError naming it on either path. The
    meta device stands in for another device."""
    q, k, theta, t = inputs(1, 4, 2, 8, 0, torch.float32)
    with pytest.raises(ValueError, match=r"positions is on meta, q on cpu.*torch.arange\(T, device=q.device\)"):
        silu_lrpe(q, k, theta, t.to("meta"), impl=impl)
    with pytest.raises(ValueError, match="theta is on meta"):
        silu_lrpe(q, k, theta.to("meta"), t, impl=impl)
    with pytest.raises(ValueError, match="k is on meta"):
        silu_lrpe(q, k.to("meta"), theta, t, impl=impl)
    with pytest.raises(ValueError, match="must be floating point"):
        silu_lrpe(q.long(), k.long(), theta, t, impl=impl)


def test_triton_on_cpu_tensors_names_the_fix(monkeypatch):
    """impl='triton' with CPU tensors outside the interpreter: a ValueError naming the op and the fix
    (it failed inside Triton's launcher with "0 active drivers")."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, theta, t = inputs(1, 4, 2, 8, 0, torch.float32)
    with pytest.raises(ValueError, match=r"silu_lrpe: impl='triton' needs CUDA tensors, got cpu.*'reference'"):
        silu_lrpe(q, k, theta, t, impl="triton")


def test_mixer_positions_of_a_segment():
    """The token mixer given a segment's positions equals the mixer given the segment's first position; a
    shift of every position leaves it unchanged (only relative positions count), a gap does not."""
    from models import model_config
    from models.cosformer2 import Cos2TokenMixer
    torch.manual_seed(0)
    mixer = Cos2TokenMixer(model_config("cos2", "tiny"), 0).double()
    x = torch.randn(1, 10, mixer.q_proj.in_features, dtype=torch.float64)
    torch.testing.assert_close(mixer(x, pos=5), mixer(x, pos=torch.arange(5, 15)))
    torch.testing.assert_close(mixer(x, pos=5), mixer(x, pos=0))
    gapped = torch.cat([torch.arange(0, 5), torch.arange(50, 55)])
    assert not torch.allclose(mixer(x, pos=gapped), mixer(x, pos=0))


def test_every_swept_launch_configuration_computes_the_same(monkeypatch):
    """Each candidate of `launch/bench_lrpe.py --sweep` (tokens per program, channel block, warps), set as
    the kernels' launch configuration, gives the twin's outputs and gradients: the sweep only picks
    among correct kernels. Head width 128 so that every channel block (64, 128) is taken whole."""
    import importlib.util
    from pathlib import Path

    import ops.triton_lrpe as K
    path = Path(__file__).resolve().parents[1] / "launch" / "bench_lrpe.py"
    spec = importlib.util.spec_from_file_location("bench_lrpe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    q, k, theta, t = inputs(2, 19, 2, 128, 300, torch.float32)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, theta)]
    rq, rk = silu_lrpe_reference(*ref_leaves, t)
    ref = torch.autograd.grad(rq.sum() + 2 * rk.sum(), ref_leaves)
    assert (K.FWD_LAUNCH in bench.SWEEP) and (K.BWD_LAUNCH in bench.SWEEP)
    cfgs = bench.SWEEP
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter runs a program the same way for any warp count: one candidate per tile shape
        cfgs = list({cfg[:2]: cfg for cfg in cfgs}.values())
    for cfg in cfgs:
        monkeypatch.setattr(K, "FWD_LAUNCH", cfg)
        monkeypatch.setattr(K, "BWD_LAUNCH", cfg)
        leaves = [x.clone().requires_grad_() for x in (q, k, theta)]
        oq, ok = silu_lrpe(*leaves, t, impl="triton")
        grads = torch.autograd.grad(oq.sum() + 2 * ok.sum(), leaves)
        assert rel(oq, rq) < 1e-5 and rel(ok, rk) < 1e-5, cfg
        assert all(rel(a, b) < 1e-5 for a, b in zip(grads, ref)), cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_the_benchmark_refuses_to_run_without_a_gpu():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "launch" / "bench_lrpe.py")], capture_output=True, text=True,
                          cwd=root)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr

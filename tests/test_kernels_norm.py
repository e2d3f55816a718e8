"""The fused Triton RMSNorm / SRMSNorm against the float64 plain-PyTorch twin, under the interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from ops.norm import rms_norm, rms_norm_reference  # noqa: E402


@pytest.mark.parametrize("D,with_weight", [(48, True), (100, False), (64, True)])
def test_rms_norm_fwd_bwd(D, with_weight):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 13, D, generator=g) * 3).requires_grad_(True)  # 39 rows: not a multiple of 16
    w = (torch.rand(D, generator=g) + 0.5).requires_grad_(True) if with_weight else None
    y = rms_norm(x, w, 1e-6, impl="triton")
    dy = torch.randn(y.shape, generator=g)
    ins = [x] + ([w] if with_weight else [])
    grads = torch.autograd.grad((y * dy).sum(), ins)
    ins64 = [t.detach().double().requires_grad_(True) for t in ins]
    y64 = rms_norm_reference(ins64[0], ins64[1] if with_weight else None, 1e-6)
    grads64 = torch.autograd.grad((y64 * dy.double()).sum(), ins64)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, y64) < 1e-5
    for a, b in zip(grads, grads64):
        assert rel(a, b) < 1e-5


def test_rms_norm_reference_on_cpu_by_default():
    x = torch.randn(4, 32)
    assert torch.equal(rms_norm(x), rms_norm_reference(x))

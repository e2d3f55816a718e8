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


# ----------------------------------------------------------------------------------------------------
# which implementation runs: the Triton kernel eagerly, the PyTorch twin under torch.compile
# ----------------------------------------------------------------------------------------------------

def _graph_ops(fn, *args) -> list[str]:
    """The call targets of the graph torch.compile captures for fn(*args) (no code generation)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    torch._dynamo.reset()
    return [t for g in graphs for t in g]


def test_auto_runs_triton_eagerly_and_the_fusable_twin_under_compile(monkeypatch):
    """impl 'auto' on a Triton device: the Triton op eagerly; inside torch.compile the plain-PyTorch
    twin (no custom-op node: Inductor can fuse it with the residual add and the casts around it);
    impl 'triton' keeps the op under compile too. The device test is patched so that CPU stands in
    for CUDA (the Triton interpreter runs the kernel)."""
    import ops.norm as N
    monkeypatch.setattr(N, "_on_triton_device", lambda x: True)
    x, w = torch.randn(5, 32), torch.rand(32) + 0.5
    assert N.norm_impl(x) == "triton"
    called = []
    monkeypatch.setattr(N, "rms_norm_triton", lambda *a: called.append(1) or rms_norm_reference(*a))
    rms_norm(x, w)
    assert called == [1]
    monkeypatch.undo()
    monkeypatch.setattr(N, "_on_triton_device", lambda x: True)
    auto_ops = _graph_ops(lambda x, w: N.rms_norm(x, w), x, w)
    assert not any("rms_norm_fwd" in t for t in auto_ops) and any("rsqrt" in t for t in auto_ops), auto_ops
    forced = _graph_ops(lambda x, w: N.rms_norm(x, w, impl="triton"), x, w)
    assert any("rms_norm_fwd" in t for t in forced), forced
    # a CPU tensor without the patch: the twin, eagerly as compiled
    monkeypatch.undo()
    assert N.norm_impl(x) == "reference"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_compiled_norm_matches_float64_and_the_triton_kernel(dtype, tol):
    """What a compiled block computes around a norm -- residual add, norm with gain, a matmul's input --
    compiled by Inductor (the twin, fused), and eagerly through the Triton kernel (interpreter): both
    within `tol` (relative, the input dtype's rounding) of the float64 result, forward and every
    gradient, and both return the input's dtype. D = 96 is not a power of two; 37 rows are not a
    multiple of the kernel's row block."""
    g = torch.Generator().manual_seed(1)
    D = 96
    x = (torch.randn(37, D, generator=g) * 2).to(dtype)
    r = torch.randn(37, D, generator=g).to(dtype)
    w = (torch.rand(D, generator=g) + 0.5).to(dtype)
    proj = (torch.randn(D, 24, generator=g) / D ** 0.5).to(dtype)
    dy = torch.randn(37, 24, generator=g)

    def block(x, r, w, proj, impl):
        h = x + r
        return rms_norm(h, w, 1e-6, impl=impl) @ proj, h

    def run(fn, impl, cast):
        ins = [t.detach().to(cast).requires_grad_(True) for t in (x, r, w, proj)]
        y, h = fn(*ins, impl)
        grads = torch.autograd.grad((y * dy.to(cast)).sum(), ins)
        return y, h, grads

    y64, _, g64 = run(block, None, torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    try:
        yc, hc, gc = run(compiled, "auto", dtype)
    finally:
        torch._dynamo.reset()
    yt, ht, gt = run(block, "triton", dtype)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    for y, h, grads in ((yc, hc, gc), (yt, ht, gt)):
        assert y.dtype == dtype and h.dtype == dtype
        assert rel(y, y64) < tol
        for a, b in zip(grads, g64):
            assert a.dtype == dtype and rel(a, b) < tol


def test_reference_is_float64_for_float64_input():
    """The twin computes a float64 input in float64 (it is the tests' reference)."""
    x = torch.randn(3, 40, dtype=torch.float64) * 1e3 + 7
    y = rms_norm_reference(x)
    exact = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert y.dtype == torch.float64 and (y - exact).abs().max().item() < 1e-13


def _norm64(x, w, eps=1e-6):
    """RMSNorm by its definition in float64, independent of ops.norm."""
    x = x.double()
    y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return y if w is None else y * w.double()


def test_triton_norm_takes_a_strided_gain():
    """A gain that is a strided view (every other entry of a larger parameter) is read as that view: the
    kernels read the gains at unit stride, so they took the view's first D entries of its base (relative
    error 1.4 in y and dx). Forward and both gradients against float64; D = 80 is not a power of two."""
    g = torch.Generator().manual_seed(2)
    D = 80
    x = torch.randn(2, 7, D, generator=g).requires_grad_(True)
    base = (torch.rand(2 * D, generator=g) + 0.5).requires_grad_(True)
    y = rms_norm(x, base[::2], 1e-6, impl="triton")
    dy = torch.randn(y.shape, generator=g)
    grads = torch.autograd.grad((y * dy).sum(), [x, base])
    x64, b64 = (t.detach().double().requires_grad_(True) for t in (x, base))
    y64 = _norm64(x64, b64[::2])
    grads64 = torch.autograd.grad((y64 * dy.double()).sum(), [x64, b64])
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, y64) < 1e-5
    for a, b in zip(grads, grads64):
        assert rel(a, b) < 1e-5
    assert torch.equal(grads[1][1::2], torch.zeros(D))  # the entries the view skips get no gradient


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_norm_inputs_name_the_argument(impl):
    """A gain of another width was read past its end by the kernel (no error, garbage out); one of shape
    [D, 1] broadcast in the twin; an integer x ran. Each is a ValueError naming the argument, on either
    path, before any kernel runs."""
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"`weight` must be \[D\] = \[16\]"):
        rms_norm(x, torch.ones(8), impl=impl)
    with pytest.raises(ValueError, match=r"`weight` must be \[D\] = \[16\]"):
        rms_norm(x, torch.ones(16, 1), impl=impl)
    with pytest.raises(ValueError, match="`x` must be a floating tensor"):
        rms_norm(torch.ones(4, 16, dtype=torch.long), None, impl=impl)
    with pytest.raises(ValueError, match="`weight` is on meta"):
        rms_norm(x, torch.ones(16, device="meta"), impl=impl)


def test_triton_norm_on_cpu_tensors_names_the_fix(monkeypatch):
    """impl='triton' with CPU tensors outside the interpreter: a ValueError naming the op and the fix
    (it failed inside Triton's launcher with "0 active drivers")."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"rms_norm: impl='triton' needs CUDA tensors, got cpu.*'reference'"):
        rms_norm(torch.randn(4, 16), None, impl="triton")

"""The plain-PyTorch twins against a float64 step-by-step recurrence, and the public ops' input checks."""
import pytest
import torch

import ops
from ops import reference as R

torch.manual_seed(0)


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def naive_lightning(q, k, v, decay):
    """o_t = sum_{s<=t} decay^(t-s) (q_t . k_s) v_s, literally (the definition, O(T^2))."""
    B, T, H, _ = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            w = (q[:, t] * k[:, s]).sum(-1)  # [B, H]
            if decay is not None:
                w = w * decay ** (t - s)
            o[:, t] += w[..., None] * v[:, s]
    return o


@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (37, 8), (64, 16)])
def test_lightning_forms_agree_with_definition(T, chunk):
    q, k, v = rand(2, T, 3, 5), rand(2, T, 3, 5), rand(2, T, 3, 7)
    decay = torch.tensor([0.3, 0.9, 1.0], dtype=torch.float64)
    want = naive_lightning(q, k, v, decay)
    o_rec, _ = R.lightning_attn_recurrent(q, k, v, decay)
    o_chk, _ = R.lightning_attn_chunked(q, k, v, decay, chunk_size=chunk)
    torch.testing.assert_close(o_rec, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o_chk, want, rtol=1e-10, atol=1e-10)


def test_lightning_no_decay_and_states():
    q, k, v = rand(1, 29, 2, 4), rand(1, 29, 2, 4), rand(1, 29, 2, 6)
    h0 = rand(1, 2, 4, 6)
    o1, s1 = R.lightning_attn_recurrent(q, k, v, None, h0)
    o2, s2 = R.lightning_attn_chunked(q, k, v, None, h0, chunk_size=8)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2)
    # the final state is sum_s k_s v_s^T + h0 without decay
    torch.testing.assert_close(s1, h0 + torch.einsum("bthk,bthv->bhkv", k, v))
    # splitting the sequence and carrying the state changes nothing
    oa, sa = R.lightning_attn_chunked(q[:, :11], k[:, :11], v[:, :11], None, h0, chunk_size=8)
    ob, sb = R.lightning_attn_chunked(q[:, 11:], k[:, 11:], v[:, 11:], None, sa, chunk_size=8)
    torch.testing.assert_close(torch.cat([oa, ob], 1), o1)
    torch.testing.assert_close(sb, s1)


@pytest.mark.parametrize("T,chunk", [(1, 4), (23, 5), (40, 16)])
def test_gla_forms_agree(T, chunk):
    q, k, v = rand(2, T, 2, 6), rand(2, T, 2, 6), rand(2, T, 2, 3)
    log_f = -torch.rand(2, T, 2, 6, dtype=torch.float64) * 4
    h0 = rand(2, 2, 6, 3)
    o1, s1 = R.gated_linear_attn_recurrent(q, k, v, log_f, h0)
    o2, s2 = R.gated_linear_attn_chunked(q, k, v, log_f, h0, chunk_size=chunk)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)


def test_gla_extreme_gates_stay_finite():
    """Gates near 0 (log_f = -60) and exactly 1 (log_f = 0): no overflow into inf/NaN in the chunked form."""
    T = 50
    q, k, v = rand(1, T, 1, 4), rand(1, T, 1, 4), rand(1, T, 1, 4)
    log_f = torch.zeros(1, T, 1, 4, dtype=torch.float64)
    log_f[..., :2] = -60.0
    o1, _ = R.gated_linear_attn_recurrent(q, k, v, log_f)
    o2, _ = R.gated_linear_attn_chunked(q.float(), k.float(), v.float(), log_f.float(), chunk_size=16)
    assert torch.isfinite(o2).all()
    torch.testing.assert_close(o2.double(), o1, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["lightning", "gla"])
def test_gradients_of_chunked_match_recurrence(op):
    T = 19
    q, k, v = (rand(1, T, 2, 4).requires_grad_() for _ in range(3))
    if op == "lightning":
        x = torch.tensor([0.7, 0.95], dtype=torch.float64)
        f_rec, f_chk = R.lightning_attn_recurrent, lambda *a: R.lightning_attn_chunked(*a, chunk_size=8)
    else:
        x = (-torch.rand(1, T, 2, 4, dtype=torch.float64)).requires_grad_()
        f_rec, f_chk = R.gated_linear_attn_recurrent, lambda *a: R.gated_linear_attn_chunked(*a, chunk_size=8)
    h0 = rand(1, 2, 4, 4).requires_grad_()
    inputs = [q, k, v, h0] + ([x] if x.requires_grad else [])
    w_o, w_s = rand(1, T, 2, 4), rand(1, 2, 4, 4)

    def grads(fn):
        o, s = fn(q, k, v, x, h0)
        return torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), inputs)

    for g1, g2 in zip(grads(f_rec), grads(f_chk)):
        torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-9)


def naive_gla(q, k, v, log_f, h0):
    """S_t = diag(f_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t, one (batch, head) and one token at a time."""
    B, T, H, _ = q.shape
    outs, states = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64), []
    for b in range(B):
        for h in range(H):
            S = h0[b, h]
            for t in range(T):
                S = log_f[b, t, h].exp()[:, None] * S + torch.outer(k[b, t, h], v[b, t, h])
                outs[b, t, h] = S.T @ q[b, t, h]
            states.append(S)
    return outs, torch.stack(states).view(B, H, *states[0].shape)


@pytest.mark.parametrize("lo,dtype,tol", [(-20.0, torch.float32, 1e-4), (-60.0, torch.float64, 1e-12)])
def test_gla_chunked_dlogf_under_strong_gates(lo, dtype, tol):
    """d log_f of the chunked twin where every gate forgets nearly all (log f in [lo, lo + 1]): d log_f is
    then about e^lo times the other gradients, and the pairs of a token with itself (weight exp(b_i - b_i)
    = 1) put O(1) terms into b's gradient that cancel only up to rounding: relative error 1.5 in fp32 at
    [-20, -19], 1.0 in float64 at [-60, -59]. Every gradient against the float64 recurrence."""
    g = torch.Generator().manual_seed(3)
    T, H, K, V = 37, 2, 6, 5
    q, k, v = (torch.randn(1, T, H, d, generator=g, dtype=torch.float64) for d in (K, K, V))
    log_f = lo + torch.rand(1, T, H, K, generator=g, dtype=torch.float64)
    h0 = torch.randn(1, H, K, V, generator=g, dtype=torch.float64)
    w_o, w_s = torch.randn(1, T, H, V, generator=g, dtype=torch.float64), torch.randn(1, H, K, V, generator=g, dtype=torch.float64)

    def grads(fn, dt):
        ins = [t.to(dt).requires_grad_() for t in (q, k, v, log_f, h0)]
        o, s = fn(*ins)
        return torch.autograd.grad((o.double() * w_o).sum() + (s.double() * w_s).sum(), ins)

    got = grads(lambda *a: R.gated_linear_attn_chunked(*a, chunk_size=8), dtype)
    want = grads(naive_gla, torch.float64)
    for name, a, b in zip(["dq", "dk", "dv", "dlog_f", "dh0"], got, want):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < tol, (name, err)


@pytest.mark.parametrize("name", ["lightning_attn", "gated_linear_attn"])
def test_varlen_equals_separate_documents(name):
    cu = torch.tensor([0, 7, 8, 30])
    q, k, v = rand(1, 30, 2, 4), rand(1, 30, 2, 4), rand(1, 30, 2, 3)
    extra = torch.tensor([0.5, 0.99], dtype=torch.float64) if name == "lightning_attn" else -torch.rand(1, 30, 2, 4, dtype=torch.float64)
    fn = getattr(ops, name)
    o, s = fn(q, k, v, extra, cu_seqlens=cu, output_final_state=True)
    assert s.shape == (3, 2, 4, 3)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        e = extra if name == "lightning_attn" else extra[:, a:b]
        o_i, s_i = fn(q[:, a:b], k[:, a:b], v[:, a:b], e, output_final_state=True, impl="recurrent")
        torch.testing.assert_close(o[:, a:b], o_i)
        torch.testing.assert_close(s[i:i + 1], s_i)


def test_public_op_errors_name_the_argument():
    q = torch.randn(1, 5, 2, 4)
    with pytest.raises(ValueError, match="decay"):
        ops.lightning_attn(q, q, q, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="decay"):
        ops.lightning_attn(q, q, q, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="log_f"):
        ops.gated_linear_attn(q, q, q, torch.rand(1, 5, 2, 4))
    with pytest.raises(ValueError, match="heads"):
        ops.lightning_attn(q, q, torch.randn(1, 5, 3, 4))
    with pytest.raises(ValueError, match="`q`"):
        ops.lightning_attn(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="dtype"):
        ops.lightning_attn(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.lightning_attn(q, q, q, cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.lightning_attn(q, q, q, cu_seqlens=torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        ops.lightning_attn(q, q, q, initial_state=torch.zeros(1, 2, 4, 5))
    with pytest.raises(ValueError, match="implementation"):
        ops.lightning_attn(q, q, q, impl="nope")


def test_non_contiguous_inputs():
    base = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    q = base.transpose(1, 2)  # [1, 9, 2, 4], not contiguous
    o = ops.lightning_attn(q, q, q, torch.tensor([0.9, 0.8], dtype=torch.float64))
    o_ref = ops.lightning_attn(q.contiguous(), q.contiguous(), q.contiguous(),
                               torch.tensor([0.9, 0.8], dtype=torch.float64), impl="recurrent")
    torch.testing.assert_close(o, o_ref)


def test_linear_cross_entropy_matches_full_logits():
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(100, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 100, (50,))
    t[3] = -100
    loss = ops.linear_cross_entropy(h, w, t, chunk_size=7)
    gh, gw = torch.autograd.grad(loss, [h, w])
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t)
    rh, rw = torch.autograd.grad(ref, [h, w])
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


def test_linear_cross_entropy_backward_keeps_the_forwards_autocast():
    """Under bf16 autocast with an fp32 hidden state (a training step), the backward's head matmuls run
    in bf16 as the forward's did, so the gradients equal the unfused head + loss under the same autocast
    (run in fp32 outside autocast they were 3e-2 off that and, on a GPU, several times slower)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=g, requires_grad=True)
    w = torch.randn(1000, 64, generator=g, requires_grad=True)
    t = torch.randint(0, 1000, (300,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy(h, w, t, chunk_size=128)
        ref = torch.nn.functional.cross_entropy((h @ w.t()).float(), t)
    grads, rgrads = torch.autograd.grad(loss, [h, w]), torch.autograd.grad(ref, [h, w])
    for a, b in zip(grads, rgrads):  # grad w: from the bf16 logits gradient, summed in fp32
        assert float((a - b).norm() / b.norm()) < 5e-3


def test_linear_cross_entropy_adds_the_weight_gradient_into_a_buffer():
    """`weight_grad_into`: the backward adds grad_loss x dW into the buffer (over two calls: their sum)
    and hands the weight nothing; the hidden gradient is unchanged. Against the unfused head + loss."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(90, 12, dtype=torch.float64, generator=g, requires_grad=True)
    buf = torch.zeros(90, 12, dtype=torch.float64)
    ref_w = torch.zeros_like(buf)
    for scale in (0.25, 3.0):
        h = torch.randn(41, 12, dtype=torch.float64, generator=g, requires_grad=True)
        t = torch.randint(0, 90, (41,), generator=g)
        t[5] = -100
        (ops.linear_cross_entropy(h, w, t, chunk_size=8, weight_grad_into=buf) * scale).backward()
        rh, rw = torch.autograd.grad(torch.nn.functional.cross_entropy(h @ w.t(), t) * scale, [h, w])
        torch.testing.assert_close(h.grad, rh, rtol=1e-12, atol=1e-15)
        ref_w += rw
        assert w.grad is None
        torch.testing.assert_close(buf, ref_w, rtol=1e-12, atol=1e-15)
    before = buf.clone()
    with torch.no_grad():  # no gradient computed: the buffer is left alone
        ops.linear_cross_entropy(h, w, t, weight_grad_into=buf)
    assert torch.equal(buf, before)
    for bad in (torch.zeros(90, 11, dtype=torch.float64), torch.zeros(90, 12, dtype=torch.float16)):
        with pytest.raises(ValueError, match="weight_grad_into"):
            ops.linear_cross_entropy(h, w, t, weight_grad_into=bad)


def test_argument_dtypes_and_devices_are_checked_by_name():
    """Integer gates, decays and states ran (an integer log f reads as 0 or whole nats; a bool one was
    refused as "max 1"), and `cu_seqlens` on another device than the inputs reached the kernels as a
    pointer of that device. Each is a ValueError naming the argument; the meta device stands in for a
    GPU."""
    q, v = torch.randn(1, 10, 2, 16), torch.randn(1, 10, 2, 8)
    lf = -torch.rand(1, 10, 2, 16) - 1
    for bad in (lf.long(), lf < -1.5):
        with pytest.raises(ValueError, match=r"`log_f` has dtype torch\.(int64|bool); use a floating dtype"):
            ops.gated_linear_attn(q, q, v, bad)
    with pytest.raises(ValueError, match=r"`decay` has dtype torch\.int64"):
        ops.lightning_attn(q, q, v, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"`initial_state` has dtype torch\.int64"):
        ops.lightning_attn(q, q, v, None, initial_state=torch.zeros(1, 2, 16, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`cu_seqlens` is on meta, inputs on cpu; move it there"):
        ops.lightning_attn(q, q, v, None, cu_seqlens=torch.tensor([0, 4, 10], device="meta"), check_values=False)


def test_triton_impl_on_cpu_tensors_names_the_fix(monkeypatch):
    """impl='triton' with CPU tensors outside the Triton interpreter: a ValueError naming the op, the
    device and the implementation to use instead."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 10, 2, 16)
    with pytest.raises(ValueError, match=r"gated_linear_attn: impl='triton' needs CUDA tensors, got cpu.*'chunked'"):
        ops.gated_linear_attn(q, q, q, -torch.rand(1, 10, 2, 16), impl="triton")


def test_linear_cross_entropy_bad_targets_name_the_argument():
    """Class ids out of [0, V) other than ignore_index (an index error from inside the op's chunk loop)
    make the loss and gradients NaN without reading the ids back; float class ids (silently truncated by
    .long()), integer hidden states (ran) and a non-integer chunk size: ValueErrors naming what is wrong."""
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    for t in (torch.tensor([1, 2, 10, 3]), torch.tensor([-100, -5, 2, -7])):
        hh = h.clone().requires_grad_()
        loss = ops.linear_cross_entropy(hh, w, t, chunk_size=2)
        loss.backward()
        assert loss.isnan() and hh.grad.isnan().any()
    assert ops.linear_cross_entropy(h, w, torch.tensor([3, 3, 3, 3]), ignore_index=3).item() == 0.0
    with pytest.raises(ValueError, match=r"`targets` must be integer class ids, got torch.float32"):
        ops.linear_cross_entropy(h, w, torch.tensor([1.0, 2.0, 3.7, 3.0]))
    with pytest.raises(ValueError, match="must be floating point"):
        ops.linear_cross_entropy(h.int(), w, torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="on one device"):
        ops.linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4], device="meta"))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 2.5"):
        ops.linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4]), chunk_size=2.5)

"""torch.compile sees each Triton linear-attention call as one custom-op node: a whole forward + backward
compiles without graph breaks (fullgraph=True), and the compiled results equal eager ones. Runs on CPU
through the Triton interpreter with the `aot_eager` backend (Dynamo + AOTAutograd, no Inductor codegen)."""
import pytest
import torch
import torch.nn.functional as F

from ops import gated_linear_attn, lightning_attn


def _inputs(gated: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=g) for _ in range(3))
    x = F.logsigmoid(torch.randn(1, 70, 2, 16, generator=g) * 2 + 2) if gated else torch.tensor([0.6, 0.9])
    h0 = torch.randn(2, 2, 16, 16, generator=g)
    return q, k, v, x, h0


def _loss(gated: bool, q, k, v, x, h0, cu):
    f = gated_linear_attn if gated else lightning_attn
    o, S = f(q, k, v, x, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl="triton",
             check_values=False)
    return (o * o).sum() + S.sum()


@pytest.mark.parametrize("gated", [False, True])
def test_compiled_op_is_one_graph_and_matches_eager(gated):
    torch._dynamo.reset()
    q, k, v, x, h0 = _inputs(gated)
    cu = torch.tensor([0, 30, 70])  # packed: the GLA op builds its chunk table on the host, inside the op
    leaves = [q, k, v, h0] + ([x] if gated else [])

    def run(fn):
        ins = [t.clone().requires_grad_(True) for t in leaves]
        xx = ins[4] if gated else x
        loss = fn(gated, ins[0], ins[1], ins[2], xx, ins[3], cu)
        return loss.detach(), torch.autograd.grad(loss, ins)

    ref_loss, ref_grads = run(_loss)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    loss, grads = run(compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["tnl", "hgrn2"])
def test_compiled_tiny_model_has_no_graph_break(arch):
    """A whole forward + loss with packed documents (the shape of a training step) compiles as one graph
    and gives the eager loss."""
    from models import build_model
    from ops import set_default_impl
    torch._dynamo.reset()
    set_default_impl("triton")
    try:
        torch.manual_seed(0)
        model = build_model(arch, "tiny", vocab_size=256)
        ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
        cu = torch.tensor([0, 25, 40, 80])
        eager = model(ids, targets=ids, cu_seqlens=cu)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, targets=ids, cu_seqlens=cu)
    finally:
        set_default_impl("auto")
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_unused_final_state_reaches_the_backward_as_none(compiled, monkeypatch):
    """Training returns the final state but never reads it: its gradient must reach the GLA backward as
    None, not as materialised zeros (those would launch the final-state gradient kernel's two extra walks
    per layer, for nothing), eagerly and under torch.compile."""
    import ops.triton_linear_attn as TL
    torch._dynamo.reset()
    seen = []
    orig = TL._gla_backward  # called by the custom op (compiled) and by the eager entry alike

    def spy(*args):
        seen.append(args[9] is None)  # dht, the final state's gradient
        return orig(*args)
    monkeypatch.setattr(TL, "_gla_backward", spy)
    q, k, v, x, _ = (t.requires_grad_(True) for t in _inputs(True))

    def loss_o_only(q, k, v, x):
        o, _S = gated_linear_attn(q, k, v, x, output_final_state=True, impl="triton", check_values=False)
        return (o * o).sum()
    fn = torch.compile(loss_o_only, backend="aot_eager", fullgraph=True) if compiled else loss_o_only
    fn(q, k, v, x).backward()
    assert seen == [True]


@pytest.mark.parametrize("gated", [False, True])
def test_eager_entry_runs_the_custom_ops_code(gated, monkeypatch):
    """Eager calls on plain tensors take the autograd.Function entry, not the custom op (whose dispatch
    costs host time); both run the same forward and backward, so outputs and gradients are bitwise equal,
    with an initial state, packed input and a loss on the final state."""
    import ops.triton_linear_attn as TL
    q, k, v, x, h0 = _inputs(gated)
    cu = torch.tensor([0, 30, 70])
    leaves = [q, k, v, h0] + ([x] if gated else [])
    name = "_gla_fwd" if gated else "_lightning_fwd"
    op = getattr(TL, name)
    calls = []

    def spy(*args):
        calls.append(1)
        return op(*args)

    def run():
        ins = [t.clone().requires_grad_(True) for t in leaves]
        loss = _loss(gated, ins[0], ins[1], ins[2], ins[4] if gated else x, ins[3], cu)
        return loss.detach(), torch.autograd.grad(loss, ins)

    monkeypatch.setattr(TL, name, spy)
    eager_loss, eager_grads = run()
    assert calls == []  # the eager entry never dispatched through the custom op
    monkeypatch.setattr(TL, "_eager", lambda *xs: False)  # every call through the custom op
    op_loss, op_grads = run()
    assert calls == [1]
    assert torch.equal(eager_loss, op_loss)
    for a, b in zip(eager_grads, op_grads):
        assert torch.equal(a, b)

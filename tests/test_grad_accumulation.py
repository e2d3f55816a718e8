"""Weight gradients accumulated by their own matmul (pretrain/grad_accumulation.py) against autograd's
accumulation: the same gradients over several micro-batches in float64, eager and compiled (one graph,
no break, checkpointed blocks too), the same training run through the train module, the buffers zeroed
between steps and absent from the state_dict."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from models import build_model
from pretrain import grad_accumulation as GA
from pretrain.config import OptimConfig
from pretrain.train_module import TorchTrainModule

ARCHS = ["llama", "tnl", "hgrn2", "cos2"]


def _tiny(arch: str, n_layers: int = 2):
    torch.manual_seed(0)
    return build_model(arch, "tiny", vocab_size=256, n_layers=n_layers)


def _micro_batches(n: int = 3, rows: int = 2, seq: int = 29) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (rows, seq + 1), generator=g) for _ in range(n)]


def _accumulate(model, batches) -> None:
    for ids in batches:
        (model(ids[:, :-1], targets=ids[:, 1:]) / len(batches)).backward()


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_gradients_equal_autograds_over_micro_batches(arch):
    ref = _tiny(arch).double()
    model = copy.deepcopy(ref)
    pairs = GA.fuse(model)
    fused = [p for p, _ in pairs]
    kinds = {type(m).__name__ for m in model.blocks.modules()}
    assert "AccumulatingLinear" in kinds and "Linear" not in kinds  # every projection of every block
    assert type(model.embed) is GA.AccumulatingEmbedding and any(p is model.embed.weight for p in fused)
    batches = _micro_batches()
    _accumulate(ref, batches)
    _accumulate(model, batches)
    assert all(p.grad is None for p in fused)  # autograd hands the fused weights nothing
    GA.expose(pairs)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    GA.reset(pairs)
    assert all(float(g.abs().max()) == 0.0 for _, g in pairs)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_gradients_compiled_one_graph_with_checkpointed_blocks(arch):
    """Regional compile of the fused blocks (one of three checkpointed whole): no graph break, the
    blocks' two kinds give two graphs, and the gradients are the eager fused ones."""
    from torch._dynamo.utils import counters
    ref = _tiny(arch, n_layers=3)
    ref.set_activation_checkpointing("full", 0.5)
    model = copy.deepcopy(ref)
    batches = _micro_batches(2)
    _accumulate(ref, batches)
    torch._dynamo.reset()
    counters.clear()
    module = TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32", fuse_grad_accumulation=True)
    module.compile(backend="aot_eager")
    try:
        _accumulate(model, batches)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 2
    finally:
        torch._dynamo.reset()
    GA.expose(module.fused_grads)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def _recomputed_projections(model, mode: str, blocks: list[int]) -> set[int]:
    """ids of the projections that activation checkpointing `mode` on `blocks` runs again in the backward."""
    parts = {"full": lambda b: [b], "mlp": lambda b: [b.channel_norm, b.channel_mixer]}[mode]
    return {id(m) for i in blocks for part in parts(model.blocks[i]) for m in part.modules()
            if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("arch,mode,fuse_first", [("tnl", "full", False), ("llama", "mlp", False),
                                                  ("hgrn2", "full", True), ("cos2", "mlp", True)])
def test_recomputed_projections_take_autograds_path_into_the_same_buffers(arch, mode, fuse_first):
    """The projections that activation checkpointing recomputes run as plain linears (inside a compiled
    checkpointed block the fused Function's saved input would be kept, not recomputed), whether the
    checkpointing is set before the fusion or after it: autograd hands exactly those weights a gradient,
    `expose` adds it into the buffers, and every gradient equals autograd's in float64. Switching the
    checkpointing off again puts every projection back on the fused path."""
    ref = _tiny(arch, n_layers=3).double()
    model = copy.deepcopy(ref)
    if fuse_first:
        pairs = GA.fuse(model)
    blocks = model.set_activation_checkpointing(mode, 0.5)
    if not fuse_first:
        pairs = GA.fuse(model)
    ref.set_activation_checkpointing(mode, 0.5)
    assert blocks and len(blocks) < 3
    expected = _recomputed_projections(model, mode, blocks)
    projections = [m for m in model.blocks.modules() if isinstance(m, GA.AccumulatingLinear)]
    assert {id(m) for m in projections if m.recomputed} == expected
    batches = _micro_batches(2)
    _accumulate(ref, batches)
    _accumulate(model, batches)
    assert {id(m) for m in projections if m.weight.grad is not None} == expected
    GA.expose(pairs)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    model.set_activation_checkpointing("none")
    assert not any(m.recomputed for m in projections)
    GA.reset(pairs)
    model.zero_grad(set_to_none=True)
    _accumulate(model, batches)
    assert all(m.weight.grad is None for m in projections)


def test_gradients_autograd_hands_recomputed_projections_go_into_their_buffers_in_place(monkeypatch):
    """With the buffers set as `.grad` before the backward (as the train module's step does), the
    gradients autograd hands the recomputed projections are added into the buffers in place, with no
    tensor of their own, and equal autograd's in float64; a train module's step with checkpointed blocks
    matches one without the fusion."""
    ref = _tiny("tnl", n_layers=3).double()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.set_activation_checkpointing("full", 0.5)
    pairs = GA.fuse(model)
    GA.expose(pairs)
    batches = _micro_batches(2)
    _accumulate(ref, batches)
    _accumulate(model, batches)
    assert all(p.grad is g for p, g in pairs)
    GA.expose(pairs)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    seen = []  # at each call of expose in a step: whether every weight holding a gradient holds its buffer

    def spy(pairs):
        seen.append(all(p.grad is g for p, g in pairs if p.grad is not None))
        expose(pairs)
    expose = GA.expose
    monkeypatch.setattr(GA, "expose", spy)
    steps = [_micro_batches(3) for _ in range(2)]
    runs = {}
    for fused in (False, True):
        net = _tiny("tnl", n_layers=3).double()
        net.set_activation_checkpointing("full", 0.5)
        module = TorchTrainModule(net, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"), "fp32",
                                  fuse_grad_accumulation=fused)
        mbs = [[{"input_ids": ids[:, :-1], "targets": ids[:, 1:]} for ids in step] for step in steps]
        runs[fused] = ([module.train_step(mb, i) for i, mb in enumerate(mbs)], net)
    assert seen and all(seen)
    for a, b in zip(runs[False][0], runs[True][0]):
        assert a.loss == pytest.approx(b.loss, rel=1e-12) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-10)
    for p, q in zip(runs[True][1].parameters(), runs[False][1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_inductor_keeps_the_accumulation_in_the_graph():
    """Inductor (the GPU's backend) compiles the fused block whole: no break at the mutating custom op,
    and the buffer holds the sum of two micro-batches."""
    ref = _tiny("tnl", n_layers=1)
    model = copy.deepcopy(ref)
    pairs = GA.fuse(model)
    batches = _micro_batches(2)
    torch._dynamo.reset()
    try:
        model.blocks[0] = torch.compile(model.blocks[0], backend="inductor", fullgraph=True)
        _accumulate(model, batches)
    finally:
        torch._dynamo.reset()
    _accumulate(ref, batches)
    GA.expose(pairs)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_train_module_steps_match_autograds_and_zero_the_buffers():
    steps = [_micro_batches(3) for _ in range(3)]
    runs = {}
    for fused in (False, True):
        model = _tiny("hgrn2")
        module = TorchTrainModule(model, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"), "fp32",
                                  fuse_grad_accumulation=fused)
        mbs = [[{"input_ids": ids[:, :-1], "targets": ids[:, 1:]} for ids in step] for step in steps]
        runs[fused] = ([module.train_step(mb, i) for i, mb in enumerate(mbs)], model)
        assert (len(module.fused_grads) > 0) == fused
        assert all(p.grad is None for p in model.parameters())
        assert all(float(g.abs().max()) == 0.0 for _, g in module.fused_grads)
    (plain, m0), (fused, m1) = runs[False], runs[True]
    for a, b in zip(plain, fused):
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert m1.state_dict().keys() == m0.state_dict().keys()  # the buffers are not part of the checkpoint
    for (name, p), q in zip(m1.named_parameters(), m0.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_gradient_around_the_fused_modules_is_added_not_dropped():
    """The tied weight used as a plain head (`logits`, outside the fused loss) gets its gradient from
    autograd; `expose` adds it to the buffer's (the embedding's rows) instead of replacing one by the other."""
    ref = _tiny("llama").double()
    model = copy.deepcopy(ref)
    pairs = GA.fuse(model)
    ids = _micro_batches(1)[0]
    for m in (ref, model):
        logits = m(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
    assert model.embed.weight.grad is not None  # the head's part, from autograd
    GA.expose(pairs)
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad, rtol=1e-12, atol=1e-14)


def test_no_grad_forward_skips_the_function_and_ddp_refuses_the_fusion():
    model = _tiny("tnl")
    GA.fuse(model)
    ids = _micro_batches(1)[0]
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (*ids.shape, 256)
    with pytest.raises(ValueError, match="one process"):
        TorchTrainModule(_tiny("tnl"), OptimConfig(), torch.device("cpu"), "fp32", ddp=True,
                         fuse_grad_accumulation=True)


def test_trainer_fuses_in_one_process_and_off_opts_out(tmp_path):
    """auto fuses one process's accumulation over several micro-batches; a step of one micro-batch has
    nothing to accumulate and keeps autograd's `.grad` (made only as the backward reaches each weight, where
    the buffers would hold every block's fp32 gradient from the start of the backward); off opts out."""
    from checkpoint_utils import make_dataset, run_flags
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    data = make_dataset(tmp_path / "data")
    trainers = {}
    try:
        for name, extra in (("on", ()), ("off", ("--grad-accum-fusion", "off")), ("one", ("--micro-batch", "6"))):
            trainers[name] = Trainer(parse_config(run_flags(tmp_path / name, data, 1, *extra)))
        assert (trainers["on"].accum, trainers["one"].accum) == (6, 1)
        assert len(trainers["on"].module.fused_grads) > 0
        assert trainers["off"].module.fused_grads == [] and trainers["one"].module.fused_grads == []
    finally:
        for t in trainers.values():
            t.close()


def test_fusion_is_wanted_for_one_process_accumulating_micro_batches():
    assert GA.fusion_wanted("auto", 1, 2) and GA.fusion_wanted("auto", 1, 8)
    assert not GA.fusion_wanted("auto", 1, 1)   # one micro-batch: nothing to accumulate
    assert not GA.fusion_wanted("auto", 2, 8)   # DDP reduces in autograd's hooks
    assert not GA.fusion_wanted("off", 1, 8)
    with pytest.raises(ValueError, match="auto or off"):
        GA.fusion_wanted("on", 1, 8)


def test_weights_cast_once_a_step_give_the_same_training_bit_for_bit(monkeypatch):
    """bf16 steps of the compiled train module with each projection's weight cast once a step
    (`cast_weights_once`) against a cast in every micro-batch: the same losses, gradient norms and
    weights bit for bit, no more graphs, and no cast kept after the step."""
    from torch._dynamo.utils import counters
    steps = [_micro_batches(3) for _ in range(3)]
    runs = {}
    for once in (True, False):
        if not once:
            monkeypatch.setattr(GA, "cast_weights_once", lambda model, dtype: contextlib.nullcontext())
        torch._dynamo.reset()
        counters.clear()
        model = _tiny("tnl")
        module = TorchTrainModule(model, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"), "bf16",
                                  fuse_grad_accumulation=True)
        module.compile(backend="aot_eager")
        try:
            mbs = [[{"input_ids": ids[:, :-1], "targets": ids[:, 1:]} for ids in step] for step in steps]
            runs[once] = ([module.train_step(mb, i) for i, mb in enumerate(mbs)], model,
                          counters["stats"]["unique_graphs"])
        finally:
            torch._dynamo.reset()
        assert all(getattr(m, "weight_cast", None) is None for m in model.modules())
    (res1, m1, graphs1), (res0, m0, graphs0) = runs[True], runs[False]
    assert graphs1 == graphs0
    assert [(r.loss, r.grad_norm) for r in res1] == [(r.loss, r.grad_norm) for r in res0]
    for (name, p), q in zip(m1.named_parameters(), m0.parameters()):
        assert torch.equal(p, q), name


def test_the_cast_made_once_is_the_one_the_projections_use():
    """Inside `cast_weights_once` a projection multiplies by the stored cast, not by a fresh cast of its
    weight (a stored cast of zeros gives zeros); outside, by its weight."""
    model = _tiny("llama", n_layers=1)
    GA.fuse(model)
    proj = model.blocks[0].token_mixer.q_proj
    x = torch.randn(3, proj.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with GA.cast_weights_once(model, torch.bfloat16):
            assert all(m.weight_cast is not None for m in model.modules() if isinstance(m, GA.AccumulatingLinear))
            assert proj.weight_cast.dtype == torch.bfloat16 and torch.equal(proj.weight_cast, proj.weight.bfloat16())
            proj.weight_cast = torch.zeros_like(proj.weight_cast)
            assert float(proj(x).abs().max()) == 0.0
        assert proj.weight_cast is None and float(proj(x).abs().max()) > 0.0
        # a recomputed projection keeps casting its own weight; the others of its block are cast once
        glu = model.blocks[0].channel_mixer
        model.set_activation_checkpointing("mlp")
        with GA.cast_weights_once(model, torch.bfloat16):
            assert proj.weight_cast is not None
            assert all(m.weight_cast is None for m in glu.modules() if isinstance(m, GA.AccumulatingLinear))
        model.set_activation_checkpointing("full")
        with GA.cast_weights_once(model, torch.bfloat16):
            assert all(m.weight_cast is None for m in model.modules() if isinstance(m, GA.AccumulatingLinear))


def test_a_weight_frozen_after_the_module_is_built_is_left_alone():
    """A weight frozen (requires_grad False) after the train module was built gets no gradient from autograd,
    and AdamW skips it; the fused path must leave it alone too: no head gradient added into the tied
    embedding's buffer, no zero buffer exposed as `.grad` (AdamW's weight decay would still move it)."""
    ids = _micro_batches(1)[0]
    for fused in (False, True):
        model = _tiny("tnl", n_layers=1)
        module = TorchTrainModule(model, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"), "fp32",
                                  fuse_grad_accumulation=fused)
        frozen = {"embed": model.embed.weight, "q_proj": model.blocks[0].token_mixer.q_proj.weight}
        for p in frozen.values():
            p.requires_grad_(False)
        before = {n: p.detach().clone() for n, p in frozen.items()}
        module.train_step([{"input_ids": ids[:, :-1], "targets": ids[:, 1:]}], 0)
        for n, p in frozen.items():
            assert torch.equal(p, before[n]), f"fused={fused}: frozen {n} moved by {float((p - before[n]).abs().max())}"


def test_a_second_train_module_on_an_already_fused_model_still_trains():
    """`fuse` on a model whose projections are already AccumulatingLinear (a second TorchTrainModule over the
    same model) must not leave their gradients in buffers that nothing exposes: the step updates the weights."""
    ids = _micro_batches(1)[0]
    model = _tiny("tnl", n_layers=1)
    TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32")
    module = TorchTrainModule(model, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"), "fp32")
    before = [p.detach().clone() for p in model.parameters()]
    res = module.train_step([{"input_ids": ids[:, :-1], "targets": ids[:, 1:]}], 0)
    assert res.grad_norm > 0
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # and without the fusion over a fused model: autograd's gradients again, no buffer left behind
    module = TorchTrainModule(model, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"), "fp32",
                              fuse_grad_accumulation=False)
    assert not any(isinstance(m, (GA.AccumulatingLinear, GA.AccumulatingEmbedding)) for m in model.modules())
    before = [p.detach().clone() for p in model.parameters()]
    assert module.train_step([{"input_ids": ids[:, :-1], "targets": ids[:, 1:]}], 1).grad_norm > 0
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_two_forwards_before_one_backward_give_autograds_gradients():
    """Two losses of one fused model summed and backpropagated once (each projection used twice before its
    backward runs): autograd's path handles it, the fused one must give the same gradients."""
    ref = _tiny("tnl", n_layers=1).double()
    model = copy.deepcopy(ref)
    pairs = GA.fuse(model)
    a, b = _micro_batches(2)
    for m in (ref, model):
        (m(a[:, :-1], targets=a[:, 1:]) + m(b[:, :-1], targets=b[:, 1:])).backward()
    GA.expose(pairs)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)

"""The fused weight-gradient accumulation on a GPU (skipped on CPU): cuBLAS's fp32-epilogue product against
a float64 reference at a 1B block's shapes, and the compiled training step against autograd's own
accumulation."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _mlp(d: int, g: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d, g, bias=False), torch.nn.SiLU(), torch.nn.Linear(g, d, bias=False))
    for m in net:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)
    return net.cuda()


def test_bf16_fused_accumulation_is_closer_to_float64_than_autograds():
    """Four micro-batches of 8192 tokens through d 2048 -> 6144 -> 2048 under bf16 autocast: the fused
    sum (fp32 epilogue, no bf16 rounding per micro-batch) is no further from the float64 gradient than
    autograd's (each micro-batch's product rounded to bf16, then added in fp32)."""
    from pretrain import grad_accumulation as GA
    d, g, n, micro = 2048, 6144, 8192, 4
    ref = _mlp(d, g)
    plain, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    ref = ref.double()
    pairs = GA.fuse(torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([fused])}))
    assert len(pairs) == 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(micro):
        x = torch.randn(1, n, d, device="cuda", generator=gen)
        ref(x.double()).square().mean().div(micro).backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            plain(x).float().square().mean().div(micro).backward()
            fused(x).float().square().mean().div(micro).backward()
    GA.expose(pairs)
    for r, p, f in zip(ref.parameters(), plain.parameters(), fused.parameters()):
        assert f.grad.dtype == torch.float32
        err_plain = float((p.grad.double() - r.grad).norm() / r.grad.norm())
        err_fused = float((f.grad.double() - r.grad).norm() / r.grad.norm())
        assert err_fused < 2e-2 and err_fused <= 1.05 * err_plain, (err_fused, err_plain)


@pytest.mark.parametrize("arch", ["tnl", "llama"])
def test_compiled_fused_training_step_matches_autograds(arch):
    from models import build_model
    from pretrain.config import OptimConfig
    from pretrain.train_module import TorchTrainModule
    gen = torch.Generator().manual_seed(0)
    steps = [[torch.randint(0, 4096, (2, 2049), generator=gen) for _ in range(3)] for _ in range(2)]
    results = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = build_model(arch, "l2d256", vocab_size=4096)
        module = TorchTrainModule(model, OptimConfig(lr=1e-3, warmup_steps=0), torch.device("cuda"), "bf16",
                                  fuse_grad_accumulation=fuse)
        module.compile()
        results[fuse] = [module.train_step([{"input_ids": ids[:, :-1], "targets": ids[:, 1:]} for ids in step], i)
                         for i, step in enumerate(steps)]
        assert (len(module.fused_grads) > 0) == fuse
    torch._dynamo.reset()
    for a, b in zip(results[False], results[True]):
        assert not a.skipped and not b.skipped
        assert b.loss == pytest.approx(a.loss, rel=1e-2) and b.grad_norm == pytest.approx(a.grad_norm, rel=3e-2)


def test_fp32_epilogue_products_against_float64_at_the_heads_shape():
    """`ops.accumulate` at the LM head's shape (100,280 x 4096 rows x 1536, bf16 operands): the product and
    the in-place sum of two come out of the matmul in fp32, orders of magnitude closer to float64 than a
    bf16 product cast to fp32."""
    from ops.accumulate import add_product_, product
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = [torch.randn(100_280, 4096, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    b = [torch.randn(4096, 1536, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    ref = a[0].double() @ b[0].double() + a[1].double() @ b[1].double()
    out = add_product_(product(a[0], b[0], torch.float32), a[1], b[1])
    rounded = (a[0] @ b[0]).float() + (a[1] @ b[1]).float()
    err = float((out.double() - ref).norm() / ref.norm())
    err_rounded = float((rounded.double() - ref).norm() / ref.norm())
    assert out.dtype == torch.float32 and err < 1e-5 and err * 50 < err_rounded, (err, err_rounded)


def test_tied_weight_gradient_into_the_buffer_matches_autograds_and_repeats_bitwise():
    """A 4096-token micro-batch of a full-vocabulary model under bf16 autocast, twice: the fused tied weight's
    gradient (embedding rows by index_put_, the head's by the loss's backward) equals autograd's dense
    embedding gradient + head gradient, and two identical runs give the same bits (the row sums are sorted
    by id, not atomic)."""
    from pretrain import grad_accumulation as GA
    from models import build_model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 2049), generator=gen).cuda()  # many repeated ids
    grads = []
    for fuse in (False, True, True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = build_model("llama", "l2d256", vocab_size=100_280)
        pairs = GA.fuse(model) if fuse else []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids[:, :-1], targets=ids[:, 1:], check_ids=False).backward()
        GA.expose(pairs)
        grads.append(model.embed.weight.grad.clone())
    plain, fused, again = grads
    assert torch.equal(fused, again)
    assert float((fused - plain).norm() / plain.norm()) < 1e-5


def _saved_gib(arch: str, ac: str, fuse: bool) -> float:
    """GiB of the distinct GPU storages autograd keeps for the backward after one compiled bf16 forward of
    two blocks at 1B widths (d 1536), one sequence of 8192 tokens."""
    from models import build_model
    from pretrain.config import OptimConfig
    from pretrain.train_module import TorchTrainModule
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(arch, "1b", n_layers=2, vocab_size=4096)
    model.set_activation_checkpointing(ac)
    module = TorchTrainModule(model, OptimConfig(warmup_steps=0), torch.device("cuda"), "bf16",
                              fuse_grad_accumulation=fuse)
    module.compile()
    ids = torch.randint(0, 4096, (1, 8193), device="cuda")
    for _ in range(2):  # the first compiles
        saved = {}

        def pack(t):
            if t.is_cuda:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), module.autocast():
            loss = model(ids[:, :-1], targets=ids[:, 1:], check_ids=False)
        loss.backward()
    torch._dynamo.reset()
    return sum(saved.values()) / 2**30


@pytest.mark.parametrize("arch", ["tnl", "llama"])
def test_compiled_checkpointed_blocks_keep_only_their_input_with_the_fusion(arch):
    """Compiled, every block checkpointed: the fused projections keep no more than plain ones (the fused
    Function's saved input and weight, kept instead of recomputed, made checkpointing save a quarter of
    what it should), and far less than the blocks without checkpointing."""
    fused, plain, kept = _saved_gib(arch, "full", True), _saved_gib(arch, "full", False), _saved_gib(arch, "none", True)
    assert fused <= 1.05 * plain + 0.01, (fused, plain)
    assert fused < 0.5 * kept, (fused, kept)

"""Training at long context on a GPU: the fused loss past 2^31 logits, two compiled training steps at 64K
tokens per micro-batch (a linear model and LLaMA), and the out-of-memory path. Skipped without CUDA.

Run on a GPU machine with TRITON_INTERPRET=0: `TRITON_INTERPRET=0 python -m pytest -q tests/test_train_gpu.py`.
"""
import gc
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU and compiled Triton kernels (TRITON_INTERPRET=0)")
DEV = "cuda"
V = 100_280


def test_loss_rows_kernel_past_int32_offsets():
    """One chunk of 22,000 rows x 100,280 logits (2.2e9 elements): the rows past 2^31 / V = 21,414 are
    right (their offsets need int64), against the plain-PyTorch twin on the same rows."""
    from ops.cross_entropy import _ce_rows_torch
    from ops.triton_cross_entropy import ce_rows_triton
    R = 22_000
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = (torch.randn(R, V, device=DEV, generator=g) * 2).to(torch.bfloat16)
    targets = torch.randint(0, V, (R,), device=DEV, generator=g)
    targets[-3] = -100
    scale = torch.tensor([1 / (R - 1)], device=DEV)
    tail = logits[-64:].clone()
    lse, tgt = ce_rows_triton(logits, targets, scale, -100, write_grad=True)
    ref_lse, ref_tgt = _ce_rows_torch(tail, targets[-64:], scale, -100, write_grad=True)
    torch.testing.assert_close(lse[-64:], ref_lse, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tgt[-64:], ref_tgt, rtol=0, atol=0)
    torch.testing.assert_close(logits[-64:].float(), tail.float(), rtol=1e-2, atol=1e-9)
    assert float(logits[-3].float().abs().max()) == 0.0  # the ignored row gets no gradient


def test_compiled_loss_at_64k_tokens_matches_eager():
    """The configuration that crashed Inductor (tokens x vocab > 2^31), compiled, against eager."""
    from ops import linear_cross_entropy
    torch._dynamo.reset()
    N, d = 65_536, 1024
    g = torch.Generator(device=DEV).manual_seed(0)
    h0 = torch.randn(N, d, device=DEV, generator=g)
    w0 = torch.randn(V, d, device=DEV, generator=g) * 0.02
    t = torch.randint(0, V, (N,), device=DEV, generator=g)

    def run(fn):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), h.grad, w.grad

    eager = run(linear_cross_entropy)
    compiled = run(torch.compile(linear_cross_entropy, fullgraph=True))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(compiled[1:], eager[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    # and the loss is right: the unfused reference on the first rows' logits
    ref = torch.nn.functional.cross_entropy((h0[:4096].bfloat16() @ w0.bfloat16().t()).float(), t[:4096],
                                            reduction="sum")
    part = linear_cross_entropy(h0[:4096], w0, t[:4096]) * 4096
    assert abs(float(part) - float(ref)) / float(ref) < 2e-3


@pytest.mark.parametrize("arch", ["tnl", "llama"])
def test_two_compiled_steps_at_64k_tokens_per_micro_batch(arch):
    """A 410m-wide model (2 blocks, full vocabulary) trains two compiled steps on one 65,536-token
    sequence: the first loss equals the eager one, both are finite, and the second step (same batch)
    has a lower loss."""
    from models import build_model
    from pretrain.config import OptimConfig
    from pretrain.train_module import TorchTrainModule
    torch._dynamo.reset()
    seq = 65_536
    over = {"max_seq_len": seq} if arch == "llama" else {}
    torch.manual_seed(0)
    with torch.device(DEV):
        model = build_model(arch, "410m", n_layers=2, **over)
    x = torch.randint(0, V, (1, seq + 1), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    batch = {"input_ids": x[:, :-1], "targets": x[:, 1:]}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        eager_loss = float(model(batch["input_ids"], targets=batch["targets"]))
    module = TorchTrainModule(model, OptimConfig(lr=1e-3, warmup_steps=0), torch.device(DEV), "bf16")
    module.compile()
    first = module.train_step([batch], 0)
    second = module.train_step([batch], 1)
    torch.cuda.synchronize()
    assert abs(first.loss - eager_loss) < 2e-3 * eager_loss, (first.loss, eager_loss)
    assert torch.isfinite(torch.tensor([first.loss, second.loss, first.grad_norm])).all()
    assert second.loss < first.loss


@pytest.mark.parametrize("arch", ["tnl", "hgrn2", "cos2", "llama"])
def test_a_compiled_micro_batch_from_the_loader_does_not_sync(arch):
    """A micro-batch as the loader yields it (CPU tensors) through the compiled forward and backward of a
    70m-wide model (2 blocks): no host sync anywhere (CUDA's sync debug mode raises on one), so the host
    stays ahead of the GPU across micro-batches. The CPU twin of this test patches the value readers
    (tests/test_train_batches.py)."""
    from models import build_model
    from pretrain.config import OptimConfig
    from pretrain.train_module import TorchTrainModule
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(DEV):
        model = build_model(arch, "70m", n_layers=2)
    module = TorchTrainModule(model, OptimConfig(warmup_steps=0), torch.device(DEV), "bf16")
    module.compile()

    def batch(seed):
        x = torch.randint(0, V, (2, 1025), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": x[:, :-1].contiguous(), "targets": x[:, 1:].contiguous()}

    module.forward_loss(batch(0)).backward()  # compiles, plans the kernels, copies TNL's decays once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = module.forward_loss(batch(1))
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_out_of_memory_is_recognised():
    """A micro-batch far past the device's memory raises an error the trainer turns into its message."""
    from models import build_model
    from pretrain.trainer import is_out_of_memory
    with torch.device(DEV):
        model = build_model("llama", "410m", n_layers=1, max_seq_len=65_536)
    ids = torch.zeros(64, 65_536, dtype=torch.long, device=DEV)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids, targets=ids).backward()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        recognised = is_out_of_memory(e)
    else:
        pytest.fail("a 4M-token micro-batch of a 410m LLaMA fit in memory")
    # the exception's traceback held the forward's frames and their activations until here: freed now, the
    # cache can go back to the device, which later tests' subprocesses need
    del model, ids
    gc.collect()
    torch.cuda.empty_cache()
    assert recognised


@pytest.mark.parametrize("arch", ["tnl", "hgrn2", "cos2", "llama"])
def test_compiled_checkpointed_block_keeps_only_its_input(arch):
    """A fully checkpointed block, compiled as the trainer compiles it, under bf16 autocast: the tensors it
    saves for the backward are its fp32 input, the weights and buffers, nothing that grows with the tokens beyond
    4 d bytes a token (a hand-written autograd.Function inside would keep its inputs too: cos2's LRPE
    8 d, HGRN2's forget gate 4 d more)."""
    from models import build_model
    from pretrain.train_module import allow_data_dependent_outputs
    allow_data_dependent_outputs()
    saved_per_len = {}
    for T in (4096, 8192):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(arch, "410m", n_layers=3, max_seq_len=8192).to(DEV)
        model.set_activation_checkpointing("full", 1.0)
        for block in model.blocks:
            block.compile()
        # weights and LLaMA's RoPE tables (views of buffers sized by max_seq_len) are not activations
        held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved, inside = [0], [False]

        def pack(t):
            if inside[0] and t.untyped_storage().data_ptr() not in held:
                saved[0] += t.numel() * t.element_size()
            return t
        model.blocks[1].register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        model.blocks[1].register_forward_hook(lambda *a: inside.__setitem__(0, False))
        ids = torch.randint(0, 50_000, (1, T), device=DEV)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, targets=ids)
        loss.backward()
        saved_per_len[T] = saved[0]
    d = model.config.d_model
    assert (saved_per_len[8192] - saved_per_len[4096]) / 4096 <= 4 * d, saved_per_len


def test_profile_step_summarises_a_real_step(tmp_path):
    """--profile-step on the GPU: step 2 of a compiled 70m-wide TNL run (2 blocks) is profiled; its JSON
    holds the step's kernels (matmuls and the lightning walks among them) and a busy share in (0, 1]."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    torch.cuda.empty_cache()  # the run is another process: what this one's earlier tests cached is not its to use
    cmd = [sys.executable, str(root / "launch" / "pretrain.py"), "--arch", "tnl", "--size", "70m", "--model",
           "n_layers=2", "--device", "cuda", "--seq-len", "1024", "--global-batch-tokens", "4096",
           "--micro-batch", "2", "--max-steps", "3", "--warmup-steps", "0", "--save-every", "0",
           "--eval-every", "0", "--profile-step", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 2 profiled (profile-step-2-rank-0.json): GPU busy" in proc.stdout
    s = json.loads((out / "profile-step-2-rank-0.json").read_text())
    assert s["step"] == 2 and 0 < s["gpu_busy_share"] <= 1 and s["gpu_busy_s"] <= s["wall_s"]
    assert s["classes"]["matmul (cuBLAS)"]["s"] > 0 and s["classes"]["linear attention (Triton)"]["s"] > 0

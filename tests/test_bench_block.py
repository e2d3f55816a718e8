"""launch/bench_block.py without a GPU: the per-layer inputs it hands a block, and its refusal on CPU."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch_utils import load_launch_script

ROOT = Path(__file__).resolve().parents[1]


def load_bench_block():
    return load_launch_script("bench_block")


@pytest.mark.parametrize("arch,keys", [("tnl", {"decay"}), ("hgrn2", {"lower_bound"}), ("cos2", set()), ("llama", set())])
def test_block_gets_the_layer_inputs_of_the_language_model(arch, keys):
    bench_block = load_bench_block()
    from models import build_model, model_config
    cfg = model_config(arch, "tiny")
    kwargs = bench_block.layer_kwargs(arch, cfg, 1, torch.device("cpu"))
    assert set(kwargs) == keys
    model = build_model(arch, "tiny")
    for name in model.extra_names:  # the same values the language model passes to block 1
        inputs = getattr(model, name).layer_inputs(cfg.n_layers, torch.device("cpu")) or [{}] * cfg.n_layers
        for k, v in inputs[1].items():
            torch.testing.assert_close(kwargs[k], v.detach())
    if "lower_bound" in kwargs:  # a leaf that takes the bound's gradient, as in training
        assert kwargs["lower_bound"].requires_grad and kwargs["lower_bound"].is_leaf


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_to_run_without_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench_block.py"), "--arch", "tnl", "--size", "tiny"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_saved_storages_counts_each_kept_tensor_once():
    """Linear -> ReLU -> Linear in fp32: autograd keeps x (first weight's gradient), the ReLU's output
    (its own backward and the second weight's gradient: one storage) and the two weights; per token that
    is 4 (d + h) bytes, counted by hand."""
    bench_block = load_bench_block()
    d, h = 24, 40
    mlp = torch.nn.Sequential(torch.nn.Linear(d, h, bias=False), torch.nn.ReLU(), torch.nn.Linear(h, d, bias=False))
    totals = {}
    for T in (16, 48):
        x = torch.randn(T, d, requires_grad=True)
        y, kept = bench_block.saved_storages(lambda: mlp(x))
        totals[T] = sum(nbytes for _, _, nbytes in kept.values())
        assert totals[T] == 4 * (T * d + T * h + 2 * d * h)
        y.sum().backward()  # the recorded graph is the one autograd runs
        assert x.grad is not None
    assert (totals[48] - totals[16]) / 32 == 4 * (d + h)


def test_kept_per_token_of_a_block_on_cpu():
    """A tiny TNL block, eager on CPU under bf16 autocast: the kept bytes per token are at least the
    block's fp32 input (the first norm's backward needs it: 4 bytes per d), and the difference of two
    lengths leaves the weights out (they would weigh less per token at twice the length: the figure is the
    same at 256 and 512 tokens, whole 64-token chunks at either half)."""
    bench_block = load_bench_block()
    short = bench_block.kept_per_token("tnl", "tiny", 1, 256, device="cpu", compile=False)
    long = bench_block.kept_per_token("tnl", "tiny", 1, 512, device="cpu", compile=False)
    assert short["bytes_per_d"] >= 4
    assert short["bytes_per_token"] == pytest.approx(long["bytes_per_token"], rel=1e-6)
    assert short["tensors"] and all(t["bytes_per_d"] > 0 for t in short["tensors"])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        bench_block.kept_per_token("tnl", "tiny", 1, 1, device="cpu", compile=False)


def test_saved_storages_count_only_what_the_backward_keeps():
    """A branch whose output is dropped in the forward frees the tensors its nodes saved, and the allocator
    may hand their memory to a later tensor at the same address: only what the result's graph still holds
    counts (x, saved by x * x), not the dropped exps' outputs, however the memory was reused."""
    bench_block = load_bench_block()
    x = torch.randn(1000, requires_grad=True)

    def forward():
        x.exp().exp().sum()            # saves both exps' outputs, then its graph is dropped
        return (x * x).sum()           # saves x (twice, one storage)

    out, seen = bench_block.saved_storages(forward)
    assert list(seen.values()) == [((1000,), torch.float32, 4000)]
    out.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())

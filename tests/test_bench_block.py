"""launch/bench_block.py without a GPU: the per-layer inputs it hands a block, and its refusal on CPU."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_bench_block():
    # by file, not through sys.path: launch/ also holds pretrain.py, which would shadow the package
    spec = importlib.util.spec_from_file_location("bench_block", ROOT / "launch" / "bench_block.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

"""DeepSpeed ZeRO-3 resume on another GPU count, on real GPUs: a one-GPU run's checkpoint resumed on two
GPUs and a two-GPU run's on one must follow the uninterrupted run (bf16 on GPUs: within 5e-3 relative),
every step logged once. On GPUs the optimizer is fused AdamW, which refuses a `step` that DeepSpeed's
universal loader left on the CPU; the CPU suite (tests/test_checkpoint_world_size.py) cannot see that.
Skipped without two CUDA GPUs and DeepSpeed.

Run on a machine with two or more GPUs: `TRITON_INTERPRET=0 NCCL_NVLS_ENABLE=0 python -m pytest -q
tests/test_multi_gpu_gpu.py`.
"""
import os

import pytest
import torch

from checkpoint_utils import losses, make_dataset, run_flags, run_pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                                or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs two CUDA GPUs and compiled Triton kernels (TRITON_INTERPRET=0)")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


def gpu_flags(out, data, steps, *extra):
    # 8 sequences a step divide over one and two ranks; eager keeps each launch short
    return run_flags(out, data, steps, "--device", "cuda", "--zero", "3", "--compile", "false", *extra, batch=8)


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)])
def test_zero3_checkpoint_resumes_on_another_gpu_count(dataset, tmp_path, first, then, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    ref = tmp_path / "reference"
    run_pretrain(gpu_flags(ref, dataset, 8, "--save-every", "4"), nproc=first, timeout=600)
    resumed = tmp_path / "resumed"
    out = run_pretrain(gpu_flags(resumed, dataset, 8, "--save-every", "0",
                                 "--resume", str(ref / "checkpoints" / "step_00000004")),
                       nproc=then, timeout=600).stdout
    assert f"(saved by {first} rank{'s' if first > 1 else ''}, resumed on {then})" in out
    want, got = losses(ref), losses(resumed)
    assert sorted(got) == [5, 6, 7, 8] and all(len(v) == 1 for v in got.values()), got
    for step in range(5, 9):
        assert got[step][0] == pytest.approx(want[step][0], rel=5e-3), (step, got[step], want[step])

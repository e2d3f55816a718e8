"""pretrain/profiling.py: the idle gaps of a profiled step, its summary, and `--profile-step`'s callback
(hand-computed kernel timelines; the profiler itself needs CUDA)."""
from __future__ import annotations

import json
import time

import pytest
import torch

from pretrain import profiling as P
from pretrain.callbacks import TrainProgress


def test_idle_gaps_are_the_gaps_in_the_union_of_kernel_intervals():
    """Kernels on side streams overlap: a gap is time when no kernel ran, named by the kernel that last
    ended before it and the one after it."""
    assert P.idle_gaps([]) == []
    # a [0, 4) with b [1, 2) inside it and c [3, 6) over its end; gap [6, 8); d [8, 9) and e [9, 10) touch;
    # f [9.5, 9.7) ends inside e; gap [10, 12) before g
    kernels = [("c", 3.0, 6.0), ("a", 0.0, 4.0), ("b", 1.0, 2.0), ("e", 9.0, 10.0), ("d", 8.0, 9.0),
               ("f", 9.5, 9.7), ("g", 12.0, 13.0)]
    assert P.idle_gaps([(s, e, n) for n, s, e in kernels]) == [(6.0, 8.0, "c", "d"), (10.0, 12.0, "e", "g")]


def test_summary_of_a_step():
    """Three kernels over 10 s of a 12 s step: busy 7 s (the union), two gaps, shares by class."""
    events = [("ampere_bf16_gemm", 0.0, 4.0, 4.0), ("dq_scan_kernel", 6.0, 8.0, 2.0),
              ("triton_poi_fused_add", 9.0, 10.0, 1.0), ("ampere_bf16_gemm", 3.0, 4.0, 1.0)]
    s = P.summarize(events, wall=12.0)
    assert s["gpu_busy_s"] == pytest.approx(7.0) and s["gpu_busy_share"] == pytest.approx(7 / 12)
    assert (s["idle_gaps"], s["idle_s"]) == (2, pytest.approx(3.0))
    assert s["idle_by_kernel_pair"][0] == {"pair": "ampere_bf16_gemm -> dq_scan_kernel", "s": 2.0}
    assert s["classes"]["matmul (cuBLAS)"]["share"] == pytest.approx(5 / 8)
    assert s["classes"]["linear attention (Triton)"]["s"] == pytest.approx(2.0)
    assert s["top_kernels"][0]["name"] == "ampere_bf16_gemm"
    line = P.describe(s)
    assert line.startswith("GPU busy 58.3% of 12.000 s (2 idle gaps, 3000.0 ms)")
    assert "ampere_bf16_gemm -> dq_scan_kernel 2000.0 ms" in line


# which class each kernel module's launches belong to in a profile
KERNEL_MODULE_CLASS = {"triton_scan": "linear attention (Triton)", "triton_gla_intra": "linear attention (Triton)",
                       "triton_linear_attn": "linear attention (Triton)", "triton_lrpe": "cos2 feature map (Triton)",
                       "triton_norm": "RMSNorm (Triton)", "triton_cross_entropy": "loss softmax pass (Triton)"}


def test_every_kernel_of_ours_is_counted_with_its_op():
    """The profiler names a Triton kernel by its function name: each @triton.jit function of the kernel
    modules that a launch names (`*_kernel`) must fall in its op's class, not in Inductor's or "other"."""
    import ast
    from pathlib import Path
    ops_dir = Path(P.__file__).resolve().parents[1] / "ops"
    seen = 0
    for f in sorted(ops_dir.glob("triton_*.py")):
        kernels = [n.name for n in ast.parse(f.read_text()).body
                   if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel")]
        if kernels:
            assert f.stem in KERNEL_MODULE_CLASS, f"{f.name}: kernels with no class in this test"
        for name in kernels:
            assert P.classify(name) == KERNEL_MODULE_CLASS[f.stem], (f.name, name)
        seen += len(kernels)
    assert seen >= 15
    # Inductor's kernels and cuBLAS's keep their classes
    assert P.classify("triton_poi_fused_mul_silu_0") == "fused elementwise (Inductor)"
    assert P.classify("triton_red_fused__to_copy_add_mean_pow_1") == "fused elementwise (Inductor)"
    assert P.classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul (cuBLAS)"


def test_step_profiler_profiles_the_named_step_only(monkeypatch, tmp_path, capsys):
    """--profile-step 3: the profiler runs around step 3 alone (pre_step sees progress.step == 2, the step
    about to run), writes the rank's JSON and logs one line; on CPU it says it profiles nothing."""
    opened = []

    class FakeProfile:
        def __init__(self, activities):
            opened.append(activities)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return []

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr("torch.profiler.profile", FakeProfile)
    monkeypatch.setattr(P, "_kernel_events", lambda prof: [("gemm", 0.0, 1.0, 1.0), ("gemm", 1.5, 2.0, 0.5)])
    cb = P.StepProfiler(3, torch.device("cuda"), tmp_path, rank=1)
    for step in range(5):
        cb.pre_step(TrainProgress(step=step))
        cb.post_train_batch(TrainProgress(step=step + 1), None)
    assert len(opened) == 1
    out = json.loads((tmp_path / "profile-step-3-rank-1.json").read_text())
    assert out["step"] == 3 and out["idle_gaps"] == 1 and out["idle_by_kernel_pair"][0]["s"] == pytest.approx(0.5)
    assert "step 3 profiled (profile-step-3-rank-1.json): GPU busy" in capsys.readouterr().out
    P.StepProfiler(3, torch.device("cpu"), tmp_path, rank=0).post_attach()
    assert "no step is profiled" in capsys.readouterr().err


def test_profiled_step_is_kept_out_of_tokens_per_s(monkeypatch, tmp_path):
    """The profiled step, slowed by the profiler and by reading its trace, is not timed: the row that holds it
    rates the other steps only; a compile step profiled as well is kept out once."""
    import pretrain.monitors as M

    clock = [0.0]
    graphs = [0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(M, "compiled_graph_count", lambda: graphs[0])
    monkeypatch.setattr(P, "_kernel_events", lambda prof: [("gemm", 0.0, 1.0, 1.0)])

    class SlowProfile:  # starting the profiler and reading its trace each take 5 s of the clock
        def __init__(self, activities):
            pass

        def __enter__(self):
            clock[0] += 5.0
            return self

        def __exit__(self, *exc):
            clock[0] += 5.0
            return False

    monkeypatch.setattr("torch.profiler.profile", SlowProfile)

    def rates(profile_step: int, compile_steps: set[int], slow_steps: set[int] = frozenset()) -> list:
        clock[0] = 0.0
        speed = M.SpeedMonitor(torch.device("cpu"), 1000, 1e9, 1, None)
        speed.pre_train(TrainProgress(step=0))
        prof = P.StepProfiler(profile_step, torch.device("cuda"), tmp_path, rank=0, speed=speed)
        rows = []
        for step in range(6):  # steps of 1 s (a compile or slow step 30 s), one row every 3 steps
            for cb in (speed, prof):
                cb.pre_step(TrainProgress(step=step))
            clock[0] += 30.0 if step + 1 in compile_steps | slow_steps else 1.0
            graphs[0] += step + 1 in compile_steps
            for cb in (speed, prof):
                cb.post_train_batch(TrainProgress(step=step + 1), None)
            if (step + 1) % 3 == 0:
                row = {}
                speed.pre_log_metrics(TrainProgress(step=step + 1), row)
                rows.append(row["tokens_per_s"])
        return rows

    assert rates(profile_step=3, compile_steps=set()) == [pytest.approx(1000.0), pytest.approx(1000.0)]
    assert rates(profile_step=2, compile_steps=set()) == [pytest.approx(1000.0), pytest.approx(1000.0)]
    # step 1 compiles and is profiled: kept out once, its row rates steps 2 and 3 alone
    assert rates(profile_step=1, compile_steps={1}) == [pytest.approx(1000.0), pytest.approx(1000.0)]
    # an eager first step (Triton's JIT and autotuning, the optimizer's first call) is kept out as well;
    # a slow step later in the process is not
    assert rates(profile_step=5, compile_steps=set(), slow_steps={1}) == [pytest.approx(1000.0), pytest.approx(1000.0)]
    assert rates(profile_step=5, compile_steps=set(), slow_steps={2}) == [pytest.approx(1000.0 / 31 * 2),
                                                                          pytest.approx(1000.0)]

"""launch/bench_multi_gpu.py: its arithmetic on hand-computed inputs, its log parsing on the trainer's
own lines, the data-stream check (and that it can fail), and one CPU rehearsal of its resume scenario:
DeepSpeed ZeRO-3 trained on 2 ranks (gloo), resumed on 1 from the mid-run checkpoint (resharded through a
universal checkpoint), losses equal to the uninterrupted run's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from checkpoint_utils import ROOT, env

sys.path.insert(0, str(ROOT / "launch"))
import bench_multi_gpu as bench  # noqa: E402


def row(step, tps=None, mfu=None, skipped=False, **kw):
    return {"step": step, "tokens": 100 * step, "loss": 5.0 - 0.1 * step, "tokens_per_s": tps,
            "step_time_s": 100 / tps if tps else None, "mfu": mfu, "skipped": skipped, **kw}


def test_throughput_medians_after_warm_up_per_gpu():
    rows = [row(1, 10.0, 0.01, max_memory_gb=3.0), row(2, 900.0, 0.30), row(3, 1000.0, 0.40),
            row(4, 1200.0, 0.50, max_memory_gb=7.5), row(5, 5000.0, 0.9, skipped=True), row(6, None),
            row(7, 1100.0, 0.45)]
    t = bench.throughput(rows, gpus=4, warm=2)
    # timed: steps 3, 4, 7 (1-2 warm, 5 skipped, 6 without a rate)
    assert t["timed_steps"] == 3
    assert t["tokens_per_s"] == 1100.0 and t["tokens_per_s_per_gpu"] == 275.0
    assert t["mfu"] == 0.45 and t["rank0_max_memory_gb"] == 7.5
    assert t["step_time_s"] == pytest.approx(100 / 1100)
    assert t["tokens_per_s_per_gpu_range"] == [250.0, 300.0]  # 1000 and 1200 over 4 GPUs
    assert bench.throughput(rows[:2], gpus=1, warm=2) == {"timed_steps": 0}


def test_scaling_efficiency_against_the_fewest_gpus_of_the_same_arch_and_stage():
    def cell(arch, zero, gpus, per_gpu):
        return {"arch": arch, "size": "1b", "zero": zero, "gpus": gpus, "tokens_per_s_per_gpu": per_gpu}
    cells = [cell("tnl", 2, 8, 45_000), cell("tnl", 2, 1, 50_000), cell("tnl", 2, 4, 47_500),
             cell("tnl", 3, 2, 40_000), cell("tnl", 3, 8, 30_000), cell("llama", 2, 8, 10_000),
             cell("llama", 2, 2, None)]
    got = {(c["arch"], c["zero"], c["gpus"]): c for c in bench.scaling_efficiency(cells)}
    assert got["tnl", 2, 8]["efficiency"] == pytest.approx(0.9) and got["tnl", 2, 8]["efficiency_base_gpus"] == 1
    assert got["tnl", 2, 4]["efficiency"] == pytest.approx(0.95)
    assert got["tnl", 2, 1]["efficiency"] == 1.0
    # no one-GPU cell: the base is the fewest GPUs measured (2), and says so
    assert got["tnl", 3, 8]["efficiency"] == pytest.approx(0.75) and got["tnl", 3, 8]["efficiency_base_gpus"] == 2
    # a failed cell (no rate) is not a base and gets no efficiency
    assert got["llama", 2, 8]["efficiency"] == 1.0 and "efficiency" not in got["llama", 2, 2]
    # another micro-batch size is another measurement: never the base of a cell with a different one
    micro4 = dict(cell("tnl", 2, 2, 60_000), micro_batch=4)
    by_micro = bench.scaling_efficiency([dict(c, micro_batch=2) for c in cells[:3]] + [micro4])
    assert by_micro[-1]["efficiency"] == 1.0 and by_micro[-1]["efficiency_base_gpus"] == 2
    assert by_micro[0]["efficiency"] == pytest.approx(0.9)


def test_parse_log_reads_the_trainers_lines():
    lines = [(3.0, "[linscale] rendezvous 127.0.0.1:29686, 8 ranks, nccl"),
             (10.0, "[2026-11-24 01:28:51,012] [WARNING] [engine.py:2304:_do_optimizer_sanity_check] **** You are "
                    "using ZeRO with an untested optimizer, proceed with caution *****"),
             (20.0, "[linscale] /r/checkpoints/step_00000004: ZeRO checkpoint of 8 ranks, this run has 4; "
                    "converting it to a DeepSpeed universal checkpoint"),
             (95.5, "[linscale] resumed from /r/checkpoints/step_00000004 at step 4, 1048576 tokens "
                    "(saved by 8 ranks, resumed on 4)"),
             (96.0, "[linscale] tnl 1b: 918.6M non-embedding, 1072.6M total parameters; 6.2 TFLOPs/step"),
             (99.0, "step 5/8 | loss 9.1 | lr 3e-4 | 40,000 tok/s"),
             (140.0, "[linscale] checkpoint step_00000008 saved (background, stall 1.250 s, written in 12.40 s, "
                     "9 of 20 files hashed while written)"),
             (141.0, "[linscale] snapshot step_00000008 saved (2097152 tokens, written in 3.10 s)")]
    p = bench.parse_log(lines)
    assert p["resume"] == {"path": "/r/checkpoints/step_00000004", "step": 4, "tokens": 1048576, "saved_world": 8,
                           "world": 4, "at_s": 95.5, "convert_and_load_s": 75.5}
    assert p["checkpoints"] == [{"name": "step_00000008", "stall_s": 1.25, "blocking": False, "write_s": 12.4,
                                 "at_s": 140.0}]
    assert p["snapshots"][0]["write_s"] == 3.1 and p["rendezvous_s"] == 3.0 and p["engine_ready_s"] == 96.0
    assert "first_step_s" not in p  # a resumed run's first step is not step 1
    assert p["compile"] is None  # an eager run logs no compiled step
    # the load time of a same-world resume: its (rendezvous -> resumed) minus a fresh run's engine build
    fresh = {"rendezvous_s": 2.0, "engine_ready_s": 32.0}
    assert bench.resume_load_s(fresh, p) == pytest.approx((95.5 - 3.0) - 30.0)
    # measured from DeepSpeed's initialize when both runs logged it
    fresh["optimizer_check_s"] = 28.0
    assert bench.resume_load_s(fresh, p) == pytest.approx((95.5 - 10.0) - 4.0)
    # a compiled run: the first compiled step's graphs and its own seconds, from the trainer's line
    c = bench.parse_log([(41.1, "[linscale] tnl 1b: 918.6M non-embedding, 1072.6M total parameters; 985 TFLOPs/step"),
                         (63.51, "[linscale] step 1: torch.compile built 1 graph(s); the step took 22.4 s (compile "
                                 "time so far 22.4 s, not counted in tokens/s)"),
                         (63.52, "step 1/8 | loss 11.8228 | lr 1.50e-07 | compiling | ETA 1m13s"),
                         (70.0, "[linscale] step 9: torch.compile built 2 graph(s); the step took 5.0 s")])
    assert c["compile"] == {"graphs": 1, "step_s": 22.4, "at_s": 63.51} and c["first_step_s"] == 63.52


def test_compare_losses_passes_a_continuation_and_catches_a_shifted_stream():
    ref = [row(s) | {"loss": l} for s, l in zip(range(1, 9), [5.0, 4.7, 4.9, 4.4, 4.6, 4.2, 4.5, 4.1])]
    same = [dict(r, loss=r["loss"] * (1 + 1e-6)) for r in ref[4:]]
    ok = bench.compare_losses(ref, same, 5, 8, rtol=2e-5)
    assert ok["ok"] and ok["max_rel_diff"] == pytest.approx(1e-6, rel=1e-3) and ok["each_once"]
    # the data one step ahead: the losses of the next batches
    shifted = [dict(r, loss=ref[i + 5]["loss"] if i + 5 < 8 else 4.0) for i, r in enumerate(ref[4:])]
    bad = bench.compare_losses(ref, shifted, 5, 8, rtol=2e-5)
    assert not bad["ok"] and bad["max_rel_diff"] > 0.05
    # a step logged twice (replayed), or one missing, fails even with equal losses
    assert not bench.compare_losses(ref, same + same[-1:], 5, 8, rtol=2e-5)["ok"]
    assert not bench.compare_losses(ref, same[:-1], 5, 8, rtol=2e-5)["ok"]
    # tokens that do not continue (another global batch) fail
    assert not bench.compare_losses(ref, [dict(r, tokens=r["tokens"] * 2) for r in same], 5, 8, rtol=2e-5)["ok"]


def test_compare_losses_median_step_change_of_an_even_count():
    """Steps 5-9: four step-to-step changes, by hand |7-8|/8 = 0.125, |7.7-7|/7 = 0.1, |9.24-7.7|/7.7 = 0.2,
    |8.778-9.24|/9.24 = 0.05; sorted 0.05, 0.1, 0.125, 0.2: the median is (0.1 + 0.125) / 2 = 0.1125
    (the upper middle one alone, 0.125, was reported before)."""
    ref = [row(s) | {"loss": l} for s, l in zip(range(5, 10), [8.0, 7.0, 7.7, 9.24, 8.778])]
    out = bench.compare_losses(ref, ref, 5, 9, rtol=2e-5)
    assert out["median_rel_step_change"] == pytest.approx(0.1125, rel=1e-9)
    # an odd count: the middle one (steps 5-8: 0.1, 0.125, 0.2)
    assert bench.compare_losses(ref, ref[:4], 5, 8, rtol=2e-5)["median_rel_step_change"] == pytest.approx(0.125)


def test_data_stream_digests_do_not_depend_on_the_rank_count(tmp_path):
    from data_pipeline import build_loader
    data = str(bench.synthetic_dataset(tmp_path / "data", docs=60))
    seq, gb = 16, 8
    ld = build_loader(data, seq, gb, 2, rank=0, world_size=1, seed=3)
    for _ in range(3 * gb // 2):  # three global steps
        ld.next_batch()
    state = ld.state_dict()
    # every rank count and micro-batch size that divides the global batch reads the same global batches
    per_world = {(w, mb): bench.stream_digests(data, seq, gb, mb, 3, state, w, 3)
                 for w in (1, 2, 4, 8) for mb in (1, 2, 4, 8) if gb % (w * mb) == 0}
    assert len(per_world) == 10 and len(set(map(tuple, per_world.values()))) == 1
    one = per_world[1, 1]
    assert one == bench.uninterrupted_digests(data, seq, gb, 3, 3, 3)
    # the check can fail: one step off, or another seed, gives other batches
    assert one != bench.uninterrupted_digests(data, seq, gb, 3, 4, 3)
    assert one[:2] == bench.uninterrupted_digests(data, seq, gb, 3, 3, 2)
    assert one != bench.uninterrupted_digests(data, seq, gb, 4, 3, 3)


def test_report_renders_each_scenario(tmp_path):
    base = {"device": "cpu (gloo)", "date": "2026-01-01 00:00 UTC", "seq_len": 32, "global_batch_seqs": 8,
            "micro_batch": 1, "warm": 2, "steps": 5, "exit_code": 0, "size": "tiny"}
    for gpus, per_gpu in ((1, 100.0), (2, 90.0)):
        bench.write_json(tmp_path / "a" / "scaling" / f"tnl-tiny-z2-g{gpus}.json",
                         {**base, "arch": "tnl", "zero": 2, "gpus": gpus, "accumulation": 8 // gpus,
                          "tokens_per_s_per_gpu": per_gpu, "max_gpu_peak_gib": 3.26,
                          "tokens_per_s_per_gpu_range": [52_012.0, 65_094.0] if gpus == 1 else None,
                          "compile": {"graphs": 1, "step_s": 22.44, "at_s": 63.5} if gpus == 2 else None})
    bench.write_json(tmp_path / "b" / "resume" / "x.json",
                     {"arch": "tnl", "size": "tiny", "from_gpus": 4, "to_gpus": 2, "checkpoint_step": 4, "ok": True,
                      "data_stream": {"identical": True},
                      "losses": {"each_once": True, "tokens_continue": True, "max_rel_diff": 0.0,
                                 "median_rel_step_change": 8.7e-3},
                      "resumed": {"resume": {"convert_and_load_s": 1.54}}})
    text = bench.report([tmp_path / "a", tmp_path / "b"])
    assert text.startswith("Scaling: cpu (gloo), 2026-01-01, seq 32, global batch 8 sequences, median of steps 3-5.")
    assert "| tnl | tiny | 2 | 2 | 1 x 4 | 90 | — | 90.0% | — | 3.3 | — | 22.4 (1) |" in text
    assert "| tnl | tiny | 2 | 1 | 1 x 8 | 100 | 52.0-65.1k | 100.0% | — | 3.3 | — | eager |" in text
    assert "| tnl | tiny | 4 → 2 | 4 | True | True, True | 0.0e+00 | 8.7e-03 | 1.5 | True |" in text


def test_rehearsal_zero3_resume_on_fewer_ranks(tmp_path):
    """The script's resume scenario on CPU: ZeRO-3 on 2 ranks saves at step 3 and goes on to 6; that
    checkpoint resumed on 1 rank must log steps 4-6 once each with the reference's losses (fp32 on CPU:
    equal to rounding), after the universal conversion, and the data stream must be identical."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "launch" / "bench_multi_gpu.py"), "--rehearse", "--only", "resume",
           "--pairs", "2:1", "--resume-steps", "6", "--out", str(out), "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cell = json.loads((out / "resume" / "tnl-tiny-z3-g2to1.json").read_text())
    lo = cell["losses"]
    assert lo["steps"] == [4, 5, 6] and lo["each_once"] and lo["tokens_continue"]
    assert lo["max_rel_diff"] <= 2e-5
    # the tolerance is far below what a data shift would give
    assert lo["median_rel_step_change"] > 1e-3
    assert cell["data_stream"]["identical"] and len(cell["data_stream"]["digests"]) == 3
    r = cell["resumed"]["resume"]
    assert (r["step"], r["saved_world"], r["world"]) == (3, 2, 1) and r["convert_and_load_s"] > 0
    assert cell["ok"] is True
    assert "| 2 → 1 | 3 | True | True, True |" in (out / "tables.md").read_text()
    assert not (tmp_path / "work" / "tnl-tiny-z3-g2to1-ref").exists()  # run directories are removed


def test_cells_of_earlier_commands_are_skipped(tmp_path):
    """A scaling cell found in a --done folder is reused (nothing launched); the efficiency is computed
    over the reused and the new cells together."""
    from argparse import Namespace
    plan = bench.rehearsal_plan()
    plan.archs, plan.stages, plan.counts = ["tnl"], [2], [1, 2]
    for gpus, per_gpu in ((1, 100.0), (2, 80.0)):
        bench.write_json(tmp_path / "earlier" / "scaling" / f"tnl-tiny-z2-g{gpus}.json",
                         {"arch": "tnl", "size": "tiny", "zero": 2, "gpus": gpus, "exit_code": 0,
                          "tokens_per_s_per_gpu": per_gpu})
    args = Namespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"), time_budget=0, cell_estimate=1,
                     cell_timeout=1, keep_runs=False, done=[str(tmp_path / "earlier")])
    cells = bench.scaling(bench.BenchRun(args, plan))
    assert [c["gpus"] for c in cells] == [1, 2] and cells[1]["efficiency"] == pytest.approx(0.8)
    assert not (tmp_path / "out" / "logs").exists()  # nothing was launched

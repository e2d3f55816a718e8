"""launch/bench_train.py's report without a GPU: the ratio to LLaMA against hand-computed references."""
import json
from pathlib import Path

from launch_utils import load_launch_script


def load_bench_train():
    return load_launch_script("bench_train")


def _cell(arch: str, tokens_per_s: float, micro_batch: int = 2, compile_: bool = True, **extra) -> dict:
    """A measured cell as run_cell writes it (1B, seq 8192, 65,536 tokens a step)."""
    return {"arch": arch, "size": "1b", "seq": 8192, "micro_tokens": 8192 * micro_batch, "tokens_per_step": 65536,
            "micro_batch": micro_batch, "accumulation": 8 // micro_batch, "compile": compile_, "status": "ok",
            "ac": "none", "ac_fraction": 1.0, "tokens_per_s": tokens_per_s, "mfu": 0.5, "peak_gib": 46.0,
            "graph_breaks": 0, "device": "NVIDIA H200", "date": "2026-11-28",
            "attempts": [{"ac": "none", "status": "ok", "first_step_s": 10.0}], **extra}


def _ratios(report: str) -> dict[str, list[str]]:
    """{arch column: [its 'vs LLaMA' entries, in row order]} of the main table."""
    out: dict[str, list[str]] = {}
    for line in report.splitlines():
        cols = [c.strip() for c in line.strip("|").split("|")]
        if len(cols) == 12 and cols[0] not in ("arch", "---"):
            out.setdefault(cols[0], []).append(cols[8])
    return out


def _write(folder: Path, cells: dict[str, dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, cell in cells.items():
        (folder / f"{name}@nvidia-h200.json").write_text(json.dumps(cell))


def test_ratio_is_against_the_median_of_several_llama_cells(tmp_path):
    """A job that ran LLaMA twice (docs/bench_train/h200-x4-host/: 55,608.8 and 55,535.3 tokens/s): the
    reference is their median, 55,572.05, whatever order the file names sort in. By hand: TNL 72,017.2 /
    55,572.05 = 1.29593 -> 1.296x; the LLaMA cells 55,608.8 / 55,572.05 = 1.00066 -> 1.001x and 55,535.3 /
    55,572.05 = 0.99934 -> 0.999x. (Against the file sorted last alone, 55,535.3, TNL came out 1.297x.)"""
    bench_train = load_bench_train()
    _write(tmp_path, {"job-l1-llama-1b-s8192-m16384-acauto": _cell("llama", 55608.8),
                      "job-l2-llama-1b-s8192-m16384-acauto": _cell("llama", 55535.3),
                      "job-t1-tnl-1b-s8192-m16384-acauto": _cell("tnl", 72017.2)})
    ratios = _ratios(bench_train.report(tmp_path))
    assert ratios["tnl"] == ["1.296x"]
    assert sorted(ratios["llama"]) == ["0.999x", "1.001x"]


def test_ratio_is_against_llama_of_the_same_compile_mode(tmp_path):
    """An eager TNL cell against the eager LLaMA cell, a compiled one against the compiled LLaMA; by hand:
    eager 52,651 / 41,058 = 1.28236 -> 1.282x, compiled 60,606 / 51,829 = 1.16935 -> 1.169x. (Keyed without
    the compile mode, both took the compiled LLaMA, whose file sorts last: eager 1.016x.)"""
    bench_train = load_bench_train()
    _write(tmp_path, {"llama-1b-s8192-m16384-acauto": _cell("llama", 51829.0),
                      "llama-1b-s8192-m16384-acauto-eager": _cell("llama", 41058.0, compile_=False),
                      "tnl-1b-s8192-m16384-acauto": _cell("tnl", 60606.0),
                      "tnl-1b-s8192-m16384-acauto-eager": _cell("tnl", 52651.0, compile_=False)})
    ratios = _ratios(bench_train.report(tmp_path))
    assert sorted(ratios["tnl"]) == ["1.169x", "1.282x"]
    assert ratios["llama"] == ["1.000x", "1.000x"]


def test_ratio_is_per_micro_batch_and_options(tmp_path):
    """Each micro-batch against its own LLaMA, an ops variant against the LLaMA of the same options where
    there is one (docs/bench_train/h200-grad-accum-fusion/: 2 x 4 off 71,285.6 / 55,236.2 = 1.29056 ->
    1.291x; on 71,846.7 / 55,597.6 = 1.29226 -> 1.292x; 4 x 2 74,526.0 / 56,835.6 = 1.31125 -> 1.311x)."""
    bench_train = load_bench_train()
    _write(tmp_path, {"llama-1b-s8192-m16384-acauto": _cell("llama", 55597.6),
                      "llama-1b-s8192-m16384-acauto-gaf-off": _cell("llama", 55236.2, grad_accum_fusion="off"),
                      "llama-1b-s8192-m32768-acauto": _cell("llama", 56835.6, micro_batch=4),
                      "tnl-1b-s8192-m16384-acauto": _cell("tnl", 71846.7),
                      "tnl-1b-s8192-m16384-acauto-gaf-off": _cell("tnl", 71285.6, grad_accum_fusion="off"),
                      "tnl-1b-s8192-m32768-acauto": _cell("tnl", 74526.0, micro_batch=4)})
    ratios = _ratios(bench_train.report(tmp_path))
    assert ratios["tnl (grad_accum_fusion=off)"] == ["1.291x"]
    assert ratios["tnl"] == ["1.292x", "1.311x"]


def test_a_setting_after_an_out_of_memory_one_runs_in_a_fresh_process(monkeypatch):
    """--ac auto tries the memory estimate's choice, then every block checkpointed: each attempt is its own
    process (a failed attempt's memory cannot inflate the next one's peak), and the cell's result keeps
    every attempt in order."""
    bench = load_bench_train()
    calls = []

    def fake_process(spec, timeout):
        calls.append(spec["attempt"])
        if spec["attempt"] == 0:
            return {**spec, "status": "oom", "attempts": [{"ac": "full", "ac_fraction": 0.25, "status": "oom"}],
                    "next_attempt": 1}
        return {**spec, "status": "ok", "ac": "full", "ac_fraction": 1.0,
                "attempts": [{"ac": "full", "ac_fraction": 1.0, "status": "ok"}]}
    monkeypatch.setattr(bench, "_cell_process", fake_process)
    res = bench.run_cell_attempts({"arch": "tnl", "ac": "auto"}, timeout=600)
    assert calls == [0, 1]
    assert res["status"] == "ok" and [a["status"] for a in res["attempts"]] == ["oom", "ok"]
    assert "next_attempt" not in res and "attempt" not in res
    # the last setting out of memory too: the cell is recorded as such, with both attempts
    monkeypatch.setattr(bench, "_cell_process", lambda spec, timeout: {
        **spec, "status": "oom", "attempts": [{"status": "oom"}], **({"next_attempt": 1} if spec["attempt"] == 0 else {})})
    res = bench.run_cell_attempts({"arch": "tnl", "ac": "auto"}, timeout=600)
    assert res["status"] == "oom" and len(res["attempts"]) == 2


def test_run_cell_runs_only_the_attempt_it_is_given(monkeypatch):
    """run_cell (CPU, the tiny preset) out of memory at its first setting stops there and names the next one;
    given that one, it runs it alone."""
    import torch

    from pretrain.train_module import TorchTrainModule
    bench = load_bench_train()
    real = TorchTrainModule.train_step

    seen = []  # the checkpointing setting of each model built

    def step(self, micro, i):  # the setting without checkpointing runs out of memory
        if seen[-1] == "none":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, micro, i)

    def fake_ckpt(self, mode, fraction):
        seen.append(mode)
        return [] if mode == "none" else [0]
    from models.lm import LanguageModel
    monkeypatch.setattr(LanguageModel, "set_activation_checkpointing", fake_ckpt)
    monkeypatch.setattr(TorchTrainModule, "train_step", step)
    spec = {"arch": "tnl", "size": "tiny", "seq": 32, "micro_tokens": 64, "tokens_per_step": 128, "ac": "auto",
            "ac_fraction": 1.0, "compile": False, "warmup": 0, "steps": 1, "profile": False, "ops": None}
    res = bench.run_cell({**spec, "attempt": 0})
    assert seen == ["none"] and res["status"] == "oom" and res["next_attempt"] == 1
    assert [a["status"] for a in res["attempts"]] == ["oom"]
    res = bench.run_cell({**spec, "attempt": 1})
    assert seen == ["none", "full"] and res["status"] == "ok" and res["ac"] == "full"
    assert [a["ac"] for a in res["attempts"]] == ["full"] and "next_attempt" not in res

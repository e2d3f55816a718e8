"""The snapshot sweep: discovery, the per-(snapshot, task) cache, tables and plots."""
import csv
import json
import os

import numpy as np
import pytest
import torch

from evaluation import sweep as sw
from models import build_model, save_pretrained


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    for step in (10, 30):
        save_pretrained(build_model("hgrn2", "tiny", max_seq_len=32), tmp_path / "run_a" / "exports" / f"step_{step:08d}",
                        extra={"step": step, "tokens": step * 100, "flops": step * 1e9})
    return tmp_path / "run_a"


def test_sweep_caches_per_snapshot_and_task(run_dir, tmp_path, monkeypatch):
    shards = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, 100277, 3 * 17, dtype=np.uint32).tofile(shards)
    calls = []
    real = sw.run_tasks

    def counting(tasks, model, snap, cfg, out):
        calls.append((snap["snapshot"], tuple(tasks)))
        return real(tasks, model, snap, cfg, out)

    monkeypatch.setattr(sw, "run_tasks", counting)
    cfg = sw.SweepConfig(runs=[str(run_dir)], tasks=["valid_loss"], valid_shards=[str(shards)], valid_seq_len=16,
                         out=str(tmp_path / "out"), device="cpu", batch_size=2)
    rows = sw.sweep(cfg)
    assert [r["step"] for r in rows] == [10, 30]
    assert sorted(calls) == [("step_00000010", ("valid_loss",)), ("step_00000030", ("valid_loss",))]
    assert rows[0]["results"]["valid_loss"]["windows"] == 3 and rows[0]["results"]["valid_loss"]["tokens"] == 48

    calls.clear()
    again = sw.sweep(cfg)  # everything cached
    assert calls == []
    assert again[1]["results"] == rows[1]["results"]

    # new weights for one snapshot -> only that one reruns; changed settings -> everything reruns
    w = run_dir / "exports" / "step_00000030" / "model.safetensors"
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 10 ** 9))
    sw.sweep(cfg)
    assert calls == [("step_00000030", ("valid_loss",))]
    calls.clear()
    cfg.valid_windows = 2
    sw.sweep(cfg)
    assert len(calls) == 2

    out = tmp_path / "out"
    with open(out / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in table] == [10, 30] and float(table[0]["flops"]) == 1e10
    cached = json.loads((out / "cache" / "run_a" / "step_00000010" / "valid_loss.json").read_text())
    assert float(table[0]["valid_loss/windows"]) == 2
    assert float(table[0]["valid_loss/loss"]) == pytest.approx(cached["metrics"]["loss"], rel=1e-12)
    assert json.loads((out / "results.json").read_text())["snapshots"][0]["run"] == "run_a"
    assert (out / "plots" / "valid_loss__loss_vs_flops.png").exists()
    assert (out / "plots" / "valid_loss__loss_vs_tokens.png").exists()


def test_validation_loss_matches_forward_pass():
    from evaluation.scoring import validation_loss
    torch.manual_seed(0)
    model = build_model("tnl", "tiny", vocab_size=300).eval()
    windows = [torch.randint(0, 300, (9,)) for _ in range(3)] + [torch.randint(0, 300, (5,))]
    got = validation_loss(model, windows, batch_size=2)
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(model(w[None, :-1])[0], w[1:], reduction="sum") for w in windows]
    assert got["tokens"] == 8 * 3 + 4
    assert got["loss"] == pytest.approx(float(sum(nll)) / got["tokens"], rel=1e-5)


def test_find_snapshots_accepts_export_dirs(run_dir):
    snaps = sw.find_snapshots([str(run_dir / "exports" / "step_00000030")])
    assert len(snaps) == 1 and snaps[0]["run"] == "run_a" and snaps[0]["tokens"] == 3000
    with pytest.raises(FileNotFoundError):
        sw.find_snapshots([str(run_dir / "exports")])

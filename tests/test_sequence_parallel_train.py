"""`--sp N` end to end on CPU: the loader hands each rank of a sequence-parallel group its segment of the
same sequences (the global sample order unchanged), and a short training run with 2 data-parallel groups
of 2 sequence-parallel ranks under DeepSpeed ZeRO-1 (4 processes, gloo) logs the same loss and gradient
norm at every step as the single process on whole sequences."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from checkpoint_utils import ROOT, env, make_dataset, pretrain_cmd
from data_pipeline import build_loader
from pretrain.config import parse_config
from pretrain.errors import ConfigError

SEQ, BATCH, STEPS = 16, 8, 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


def test_loader_hands_each_sp_rank_its_segment(dataset):
    for world, sp in ((1, 2), (2, 2), (1, 4)):
        whole = [build_loader(str(dataset), SEQ, BATCH, 2, r, world, seed=3, doc_starts=True) for r in range(world)]
        parts = [[build_loader(str(dataset), SEQ, BATCH, 2, r, world, seed=3, doc_starts=True, sp_rank=s, sp_size=sp)
                  for s in range(sp)] for r in range(world)]
        for _ in range(2 * BATCH // (2 * world)):  # two optimizer steps
            for r in range(world):
                ref = whole[r].next_batch()
                got = [ld.next_batch() for ld in parts[r]]
                for key in ("input_ids", "targets"):
                    assert torch.equal(torch.cat([g[key] for g in got], dim=1), ref[key]), (world, sp, key)
                for g in got:  # documents are described over the whole sequences
                    assert torch.equal(g["cu_seqlens"], ref["cu_seqlens"])
    with pytest.raises(ValueError, match="equal segments"):
        build_loader(str(dataset), SEQ, BATCH, 2, sp_rank=0, sp_size=3)


def test_sp_flag_is_checked():
    with pytest.raises(ConfigError, match="linear models"):
        parse_config(["--arch", "llama", "--sp", "2"])
    with pytest.raises(ConfigError, match="divide --seq-len"):
        parse_config(["--arch", "tnl", "--sp", "3", "--seq-len", "16"])
    assert parse_config(["--arch", "hgrn2", "--sp", "4", "--seq-len", "16"]).dist.sp == 4


def run(dataset: Path, out: Path, nproc: int, *extra: str) -> list[dict]:
    flags = ["--arch", "cos2", "--size", "tiny", "--model", "vocab_size=256", "--data", str(dataset), "--out",
             str(out), "--seq-len", str(SEQ), "--global-batch-tokens", str(BATCH * SEQ), "--micro-batch", "2",
             "--max-steps", str(STEPS), "--warmup-steps", "2", "--lr", "3e-3", "--log-every", "1",
             "--eval-every", "0", "--save-every", "0", "--device", "cpu", "--seed", "0", "--doc-reset", *extra]
    e = env()
    e.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    proc = subprocess.run(pretrain_cmd(flags, nproc), env=e, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_with_sp_matches_one_process(dataset, tmp_path):
    pytest.importorskip("deepspeed")
    ref = run(dataset, tmp_path / "one", 0)
    got = run(dataset, tmp_path / "sp", 4, "--sp", "2", "--zero", "1")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[-1]["tokens"] == ref[-1]["tokens"] == STEPS * BATCH * SEQ
    for a, b in zip(got, ref):  # fp32: only the order of reductions differs
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"step {a['step']}: loss {a['loss']} vs {b['loss']}"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), f"step {a['step']}: grad norm"
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.03  # it trains
    ds = json.loads((tmp_path / "sp" / "deepspeed_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == BATCH // (2 * 2)  # 2 data-parallel groups x micro-batch 2


def test_sp_without_enough_processes_says_how_to_launch(dataset, tmp_path):
    """`--sp 2` started as one process (no torchrun): one `error:` line that names the flag and the launch
    that fixes it, no traceback, before any training."""
    flags = ["--arch", "tnl", "--size", "tiny", "--model", "vocab_size=256", "--data", str(dataset), "--out",
             str(tmp_path / "run"), "--seq-len", str(SEQ), "--global-batch-tokens", str(BATCH * SEQ),
             "--micro-batch", "2", "--max-steps", "1", "--device", "cpu", "--sp", "2"]
    proc = subprocess.run(pretrain_cmd(flags), env=env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--sp 2" in errors[0] and "torchrun --nproc_per_node 2" in errors[0] and "without --sp" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

"""Shared by tests/test_checkpoint*.py and tests/test_export*.py: a small prepared dataset with a small
vocabulary (so a tiny model trains in tens of milliseconds a step on CPU) and the flags of a tiny run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pretrain.distributed import free_port  # noqa: F401  (the tests' rendezvous ports)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Imported by a module that trains in its own process: tiny models train much faster on one intra-op
    thread, and do not stall when the machine is busy."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", name="dataset")
def small_dataset(tmp_path_factory) -> Path:
    """The importing module's `dataset`: 120 documents (fewer than make_dataset's default: quicker to write)."""
    return make_dataset(tmp_path_factory.mktemp("data"), docs=120)

# A sitecustomize.py body: the trainer (launch/pretrain.py) aborts with SIGABRT as its interpreter exits,
# after everything else it did, as a library thread torn down out of order at exit does. Prefixed with
# `if <condition>:` lines by the caller; no core file is written.
ABORT_AT_EXIT_HOOK = """
import atexit, os, resource, sys

def _abort():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()

if ABORT_HERE and sys.argv and sys.argv[0].endswith("pretrain.py"):
    atexit.register(_abort)  # registered first, so it runs last
"""


def make_dataset(root: Path, vocab: int = VOCAB, docs: int = 400, seed: int = 0) -> Path:
    """Train and val splits of token documents with learnable structure (each token mostly follows from
    the one before), written in the prepared-dataset format the loader reads."""
    from data_pipeline.shards import ShardWriter, SourceMeta, write_meta
    rng = np.random.default_rng(seed)
    for split, n in (("train", docs), ("val", max(4, docs // 20))):
        out = Path(root) / split
        w = ShardWriter(out, "synthetic", shard_tokens=1 << 14)
        for _ in range(n):
            length = int(rng.integers(20, 200))
            ids = np.empty(length, dtype=np.int64)
            ids[0] = rng.integers(0, vocab)
            noise = rng.random(length) < 0.3
            jumps = rng.integers(0, vocab, length)
            for i in range(1, length):
                ids[i] = jumps[i] if noise[i] else (ids[i - 1] * 5 + 3) % vocab
            w.add(ids)
        w.close()
        meta = SourceMeta("synthetic", "en", 1.0, w.shard_entries(), w.documents, w.tokens)
        write_meta(out, [meta], {"label": f"synthetic vocab {vocab}"})
    return Path(root)


def run_flags(out: Path, data: Path, steps: int, *extra: str, seed: int = 0, arch: str = "tnl",
              batch: int = 6, micro: int = 1, seq_len: int = 16) -> list[str]:
    return ["--arch", arch, "--size", "tiny", "--model", f"vocab_size={VOCAB}", "--data", str(data),
            "--out", str(out), "--seq-len", str(seq_len), "--global-batch-tokens", str(batch * seq_len),
            "--micro-batch", str(micro), "--max-steps", str(steps), "--eval-every", "0", "--log-every", "1",
            "--warmup-steps", "3", "--lr", "3e-3", "--seed", str(seed), "--device", "cpu", *extra]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def pretrain_cmd(flags: list[str], nproc: int = 0) -> list[str]:
    script = str(ROOT / "launch" / "pretrain.py")
    if nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), script, *flags]
    return [sys.executable, script, *flags]


def run_pretrain(flags: list[str], nproc: int = 0, check: bool = True, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(pretrain_cmd(flags, nproc), env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, list[float]]:
    """Every logged loss per step (a step replayed after a resume appears twice)."""
    out: dict[int, list[float]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["loss"])
    return out


def train_in_process(flags: list[str]):
    """A Trainer built and run in this process (faster than a subprocess); returns it after fit()."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    trainer = Trainer(parse_config(flags))
    trainer.fit()
    return trainer


def compare_losses(reference: Path, resumed: Path, first: int, last: int) -> dict:
    """Per-step losses of a resumed run against the uninterrupted reference over steps first..last: the
    steps present (each exactly once), tokens per logged row, the largest relative loss difference, and
    the median change of the reference loss from one step to the next (a data shift would show up as
    differences of that size). Used by the CPU tests and the GPU 1 -> 2 check (docs/checkpoints.md)."""
    ref, got = losses(reference), losses(resumed)
    steps = list(range(first, last + 1))
    rows = [json.loads(line) for line in (Path(resumed) / "metrics.jsonl").read_text().splitlines()]
    rel = [abs(got[s][0] - ref[s][0]) / abs(ref[s][0]) for s in steps if s in got and s in ref]
    jumps = sorted(abs(ref[s + 1][0] - ref[s][0]) / abs(ref[s][0]) for s in steps[:-1] if s in ref and s + 1 in ref)
    return {"steps_logged": sorted(got), "each_once": all(len(v) == 1 for v in got.values()),
            "tokens": [r["tokens"] for r in rows], "max_rel_diff": max(rel) if rel else None,
            "median_rel_step_change": jumps[len(jumps) // 2] if jumps else None,
            "pairs": [(s, ref.get(s, [None])[0], got.get(s, [None])[0]) for s in steps]}


if __name__ == "__main__":  # python tests/checkpoint_utils.py REFERENCE_RUN RESUMED_RUN FIRST LAST
    if len(sys.argv) != 5 or not all(a.isdigit() for a in sys.argv[3:]):
        sys.exit("usage: python tests/checkpoint_utils.py REFERENCE_RUN RESUMED_RUN FIRST_STEP LAST_STEP\n"
                 "compares the two runs' logged losses at steps FIRST_STEP..LAST_STEP (docs/checkpoints.md)")
    print(json.dumps(compare_losses(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])),
                     indent=1))

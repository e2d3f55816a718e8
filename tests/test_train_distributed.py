"""End-to-end training on CPU (gloo): one process, torchrun (DDP), DeepSpeed ZeRO-2 (torchrun) and ZeRO-3
(the `deepspeed` launcher), all on the same tiny model, data and global batch, each with a NaN injected
into the loss at one step. Every run must finish, skip exactly that step, lower the loss, and log the
same per-step losses as the single process (the global sample order does not depend on the world
size; fp32 on CPU, so only the reduction order differs) -- which also shows that the skipped step left
the weights and the optimizer untouched under DeepSpeed."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_utils import ROOT, env, free_port, make_dataset

pytest.importorskip("deepspeed")

STEPS = 30
INJECT = 10          # 0-based step whose loss is NaN: logged as step INJECT + 1
SEQ, BATCH = 16, 8   # global batch 8 x 16 tokens: 1 x 2 x 4 or 2 ranks x 2 x 2
METRIC_KEYS = {"step", "tokens", "loss", "lr", "flops", "tokens_per_s", "grad_norm"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


def flags(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--arch", "tnl", "--size", "tiny", "--model", "vocab_size=256", "--data", str(data), "--out", str(out),
            "--seq-len", str(SEQ), "--global-batch-tokens", str(BATCH * SEQ), "--micro-batch", "2",
            "--max-steps", str(STEPS), "--warmup-steps", "3", "--lr", "3e-3", "--log-every", "1",
            "--eval-every", "0", "--save-every", "0", "--device", "cpu", "--seed", "0", *extra]


def launch(how: str, args: list[str], port: int) -> subprocess.CompletedProcess:
    script = str(ROOT / "launch" / "pretrain.py")
    if how == "python":
        cmd = [sys.executable, script]
    elif how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), script]
    elif how == "deepspeed":
        launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
        cmd = [launcher, "--num_gpus", "2", "--master_port", str(port), script]
    e = env()
    # under DeepSpeed every step also checks that the logged grad norm is the norm of the gradients the update
    # used (all steps, rel 1e-5; pretrain/deepspeed_module.py): the cross-run comparison below cannot go further
    e.update({"LINSCALE_INJECT_NONFINITE": str(INJECT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
              "LINSCALE_VERIFY_GRAD_NORM": "1"})
    proc = subprocess.run(cmd + args, env=e, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, f"{how} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> list[dict]:
    """The single-process run (plain PyTorch): the path `python launch/pretrain.py` takes."""
    out = tmp_path_factory.mktemp("single") / "run"
    launch("python", flags(dataset, out), 0)
    return rows(out)


def check_run(r: list[dict], ref: list[dict], rtol: float, late_rtol: float = 0) -> None:
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))
    assert METRIC_KEYS <= set(r[0])
    skipped = [x["step"] for x in r if x["skipped"]]
    assert skipped == [INJECT + 1], f"expected only step {INJECT + 1} skipped, got {skipped}"
    assert r[-1]["bad_steps_total"] == 1
    assert not math.isfinite(r[INJECT]["loss"])
    good = [x for x in r if not x["skipped"]]
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in good)
    first, last = sum(x["loss"] for x in good[:3]) / 3, sum(x["loss"] for x in good[-3:]) / 3
    assert last < first - 0.5, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert r[-1]["tokens"] == STEPS * BATCH * SEQ
    # rounding differences from the reduction order grow with the steps: tight early, looser later (a
    # wrong accumulation scale, a lost micro-batch or a skipped step that moved the weights differ by %)
    for a, b in zip(r, ref):
        if not a["skipped"]:
            tol = rtol if a["step"] <= INJECT else late_rtol
            assert a["loss"] == pytest.approx(b["loss"], rel=tol), f"step {a['step']}: {a['loss']} vs {b['loss']}"
    # Grad norms across runs: only while the weights are still the same up to rounding (steps 1..INJECT: a
    # norm that is stale by a step, clipped (always 1.0 here: every norm is > 2), scaled by the world size or
    # missing parameters is off by far more than 2e-3). The gradient is first order in the weight drift where
    # the loss is second order (this tiny run at lr 3e-3 oscillates from step to step), so later the norms
    # of the same trajectory differ by up to ~20% while the losses agree to ~1e-3 -- a single process whose
    # only change is the accumulation split differs by ~1% too (docs/training.md, "Grad norms across
    # engines"). That the logged norm is right at every step is checked inside the DeepSpeed runs instead.
    for a, b in zip(r[:INJECT], ref[:INJECT]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-3), f"step {a['step']}"
        assert a["grad_norm"] > 1.0  # the clip threshold: clipping is on at every step, never flips


def test_single_process(reference):
    check_run(reference, reference, 0)


# ZeRO-3 reduces and clips on its own partition layout: its rounding differs from step 2 on (~1e-7) and,
# at this high learning rate, grows to ~1e-3 by step 30; DDP and ZeRO-2 stay within ~1e-5
@pytest.mark.parametrize("how,zero,late_rtol", [("torchrun", 0, 1e-3), ("torchrun", 2, 1e-3), ("deepspeed", 3, 5e-3)])
def test_two_processes_match_single(dataset, tmp_path, reference, how, zero, late_rtol):
    out = tmp_path / "run"
    proc = launch(how, flags(dataset, out, "--zero", str(zero)), free_port())
    check_run(rows(out), reference, rtol=1e-4, late_rtol=late_rtol)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop"] == "finished" and summary["step"] == STEPS
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    config = json.loads((out / "config.json").read_text())
    assert config["dist"]["zero"] == zero
    if zero:
        ds = json.loads((out / "deepspeed_config.json").read_text())
        assert ds["zero_optimization"]["stage"] == zero
        assert ds["train_batch_size"] == BATCH and ds["gradient_accumulation_steps"] == 2
        assert f"DeepSpeed ZeRO-{zero}" in proc.stdout
    else:
        assert "engine: DDP" in proc.stdout


def test_too_many_bad_steps_stop_with_a_checkpoint(dataset, tmp_path):
    out = tmp_path / "run"
    e = env()
    e["LINSCALE_INJECT_NONFINITE"] = "3,4,5"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"),
                           *flags(dataset, out, "--max-bad-steps", "3")], env=e, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    assert "3 non-finite steps in a row (limit --max-bad-steps 3)" in proc.stderr
    r = rows(out)
    assert [x["step"] for x in r if x["skipped"]] == [4, 5, 6]
    assert r[-1]["step"] == 6  # stopped right there
    latest = out / "checkpoints" / "latest"
    assert latest.exists() and (out / "checkpoints" / latest.read_text().strip()).is_dir()


def test_deepspeed_checkpoint_resume_continues_the_run(dataset, tmp_path, reference):
    """save_state/load_state of the DeepSpeed module through the checkpoint manager: a ZeRO-2 run stopped
    at step 6 and resumed with --resume auto logs the steps after 6 as the uninterrupted run does."""
    out = tmp_path / "run"
    base = flags(dataset, out, "--zero", "2", "--save-every", "3")
    i = base.index("--max-steps")
    first, second = list(base), list(base)
    first[i + 1], second[i + 1] = "6", "9"
    launch("torchrun", first, free_port())
    assert (out / "checkpoints" / "step_00000006" / "module" / "deepspeed").is_dir()
    launch("torchrun", second + ["--resume", "auto"], free_port())
    r = rows(out)
    assert [x["step"] for x in r] == list(range(1, 10))
    for a, b in zip(r[6:], reference[6:9]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), f"step {a['step']}"

"""Exact resume: a run interrupted by `kill -9` at a random step, and by SIGTERM at another, and resumed
with --resume auto each time, logs bitwise the same per-step losses as an uninterrupted run of the same
config (single CPU process), with no step or token skipped or repeated."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoint_utils import env, losses, make_dataset, pretrain_cmd, run_flags, run_pretrain

STEPS = 40
SAVE_EVERY = 4
TOKENS_PER_STEP = 6 * 16  # run_flags: batch 6 x seq_len 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


def start_and_interrupt(flags: list[str], run_dir: Path, at_step: int, sig: int) -> subprocess.Popen:
    """Start a training process and send `sig` once its metrics show step >= at_step."""
    proc = subprocess.Popen(pretrain_cmd(flags), env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= at_step:
                proc.send_signal(sig)
                break
        time.sleep(0.005)
    proc.wait(timeout=180)
    return proc


@pytest.mark.parametrize("seed", [0, 1])
def test_kill9_and_sigterm_resume_is_bitwise_exact(dataset, tmp_path, seed):
    rng = random.Random(1000 + seed)
    kill_at = rng.randint(3, 14)
    term_at = rng.randint(kill_at + 6, 28)

    reference = tmp_path / "reference"
    run_pretrain(run_flags(reference, dataset, STEPS, "--save-every", str(SAVE_EVERY), seed=seed))
    ref = losses(reference)
    assert sorted(ref) == list(range(1, STEPS + 1))

    run = tmp_path / "run"
    flags = run_flags(run, dataset, STEPS, "--save-every", str(SAVE_EVERY), "--resume", "auto", seed=seed)

    killed = start_and_interrupt(flags, run, kill_at, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{killed.stdout.read()[-2000:]}"
    killed_last = max(losses(run))
    assert killed_last < STEPS

    stopped = start_and_interrupt(flags, run, term_at, signal.SIGTERM)
    out = stopped.stdout.read()
    assert stopped.returncode == 0, out[-3000:]
    # resumed from the newest complete checkpoint at or before the kill (a save in flight may be lost)
    if "resumed from " in out:
        resumed_at = int(out.split("resumed from ")[1].split(" at step ")[1].split(",")[0])
    else:  # killed before the first checkpoint was complete: a fresh start
        assert "no complete checkpoint" in out, out[-3000:]
        resumed_at = 0
    assert resumed_at % SAVE_EVERY == 0 and killed_last - SAVE_EVERY - 1 <= resumed_at <= killed_last
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop"] == "signal" and summary["step"] < STEPS
    stop_step = summary["step"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stop_step:08d}"

    final = run_pretrain(flags)
    # a graceful stop saves the exact step it stopped at: the next run resumes there, nothing replayed
    assert f"at step {stop_step}, {stop_step * TOKENS_PER_STEP} tokens" in final.stdout

    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), "a step was skipped"
    for step, values in got.items():
        # every logged value of a step (a replay after the kill included) is bitwise the reference's
        assert all(v == ref[step][0] for v in values), (step, values, ref[step])
    replayed = {s for s, v in got.items() if len(v) > 1}
    assert replayed == set(range(resumed_at + 1, killed_last + 1))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens"] == r["step"] * TOKENS_PER_STEP for r in rows), "a token count skipped or repeated"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == STEPS and summary["tokens"] == STEPS * TOKENS_PER_STEP


def test_non_finite_streak_carries_over_a_resume(dataset, tmp_path):
    """--max-bad-steps counts the non-finite steps in a row across a resume: a run that ends in the middle of
    a streak (--max-steps 6, after two of the three non-finite steps 5-7) and is resumed stops at step 7, as
    the uninterrupted run does, rather than counting the limit afresh and training on."""
    e = {**env(), "LINSCALE_INJECT_NONFINITE": "4,5,6"}  # 0-based: the logged steps 5, 6 and 7

    def run(out: Path, steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(pretrain_cmd(run_flags(out, dataset, steps, "--max-bad-steps", "3", "--save-every", "0",
                                                     "--resume", "auto")),
                              env=e, capture_output=True, text=True, timeout=240)

    reference = run(tmp_path / "reference", 10)
    assert reference.returncode == 3 and "3 non-finite steps in a row" in reference.stderr, reference.stderr[-2000:]
    first = run(tmp_path / "run", 6)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run(tmp_path / "run", 10)
    assert resumed.returncode == 3, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "3 non-finite steps in a row (limit --max-bad-steps 3); stopped at step 7" in resumed.stderr
    ref, got = losses(tmp_path / "reference"), losses(tmp_path / "run")
    assert sorted(got) == sorted(ref) == list(range(1, 8))
    for step, values in got.items():
        assert [str(v) for v in values] == [str(ref[step][0])] * len(values), (step, values, ref[step])  # nan == nan

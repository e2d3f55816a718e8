"""launch/slurm/pretrain.sbatch run by bash as Slurm would run it, without a cluster: fake `srun` and
`scontrol` executables first on PATH and the SLURM_* variables of a 2-node x 1-task job set. The fake srun
starts one local Python process per task with the variables real srun gives each task (SLURM_PROCID,
SLURM_LOCALID, SLURM_STEP_NUM_TASKS, ...) and forwards SIGUSR1/SIGTERM to them, as srun does; the fake
scontrol resolves the node list and records every call. Checked: the rendezvous (MASTER_ADDR from
`scontrol show hostnames`, ranks from the Slurm variables, DeepSpeed ZeRO-2 over gloo); SIGUSR1 to the
batch shell mid-run (SIGTERM too) -> checkpoint, clean exit, `scontrol requeue <jobid>`; the requeued job
(SLURM_RESTART_COUNT=1, same command) resumes with --resume auto at the step after the checkpoint and
finishes without requeueing; a restart that crashes is not requeued on the strength of the earlier
attempt's summary."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint_utils import ROOT, VOCAB, make_dataset

pytest.importorskip("deepspeed")

SBATCH = ROOT / "launch" / "slurm" / "pretrain.sbatch"
NODELIST = "fakenode[01-02]"
# what the fake `scontrol show hostnames` prints: the first node "resolves" to this machine, so a
# MASTER_ADDR taken from anywhere else (e.g. the raw node list: fakenode01) would not rendezvous
HOSTNAMES = ["127.0.0.1", "fakenode02"]
TASKS = 2
SEQ, BATCH = 16, 8          # 8 x 16 tokens per step: 2 ranks x micro 2 x accumulation 2
MAX_STEPS = 80              # long enough that SIGUSR1 surely lands mid-run (a step takes ~20-50 ms here)
SIGNAL_AFTER = 3            # send SIGUSR1 once this many steps are logged

FAKE_SRUN = '''#!{python}
"""Fake srun: start SLURM_NTASKS local tasks of the command with the per-task Slurm variables, forward
SIGUSR1/SIGTERM/SIGINT to them, --kill-on-bad-exit, exit with the worst task status."""
import json, os, signal, subprocess, sys, time
args = sys.argv[1:]
opts = []
while args and args[0].startswith("-"):
    opts.append(args.pop(0))
n = int(os.environ["SLURM_NTASKS"])
per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", n))
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps({{"cmd": "srun", "opts": opts, "argv": args, "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
                        "MASTER_PORT": os.environ.get("MASTER_PORT"),
                        "site_env": os.environ.get("FAKE_SITE_ENV_SOURCED")}}) + "\\n")
procs = []
def forward(sig, frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, forward)
for r in range(n):
    env = dict(os.environ, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % per_node), SLURM_NODEID=str(r // per_node),
               SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_STEP_NUM_TASKS=str(n),
               SLURM_STEP_NUM_NODES=os.environ["SLURM_JOB_NUM_NODES"], SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"])
    procs.append(subprocess.Popen(args, env=env))
kill_on_bad_exit = "--kill-on-bad-exit=1" in opts or "--kill-on-bad-exit" in opts
while any(p.poll() is None for p in procs):
    if kill_on_bad_exit and any(p.poll() not in (None, 0) for p in procs):
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(0.05)
codes = [p.returncode for p in procs]
sys.exit(max((c if c >= 0 else 128 - c) for c in codes))
'''

FAKE_SCONTROL = '''#!/bin/bash
# fake scontrol: the two calls pretrain.sbatch makes, recorded
printf '%s\\n' "{{\\"cmd\\": \\"scontrol\\", \\"argv\\": \\"$*\\"}}" >> "$FAKE_SLURM_LOG"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' {hostnames}; exit 0; fi
if [[ $1 == requeue && -n $2 ]]; then exit 0; fi
echo "fake scontrol: unexpected call: $*" >&2; exit 1
'''


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), docs=120)


@pytest.fixture
def job(tmp_path: Path, dataset: Path):
    """Environment of the Slurm job (fakes on PATH) and the paths the test reads back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL.format(hostnames=" ".join(HOSTNAMES)))
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    site_env = tmp_path / "site_env.sh"
    site_env.write_text("export FAKE_SITE_ENV_SOURCED=yes\n")
    log = tmp_path / "slurm_calls.jsonl"
    run_dir = tmp_path / "run"
    job_id = 123000 + os.getpid() % 5000  # MASTER_PORT = 20000 + id % 20000: differs between test runs
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                   "MASTER_"))}
    e.update({
        # fakes first; then the interpreter running the tests, which is `python` inside the job
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), e.get("PATH", "")]),
        "PYTHONPATH": str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""),
        "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": NODELIST, "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2", "SLURM_NTASKS": str(TASKS), "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NAME": "linscale",
        "FAKE_SLURM_LOG": str(log), "LINSCALE_SLURM_ENV": str(site_env),
        "RUN_DIR": str(run_dir), "DATA": str(dataset), "ZERO": "2", "MICRO": "2",
        "GLOBAL_BATCH_TOKENS": str(BATCH * SEQ), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
    })
    return {"env": e, "log": log, "run_dir": run_dir, "job_id": job_id}


TRAIN_ARGS = ["--model", f"vocab_size={VOCAB}", "--seq-len", str(SEQ), "--max-steps", str(MAX_STEPS),
              "--warmup-steps", "3", "--lr", "3e-3", "--log-every", "1", "--eval-every", "0",
              "--save-every", "0", "--device", "cpu", "--seed", "0"]


def start(job: dict, *extra: str, restart: int = 0) -> subprocess.Popen:
    env = dict(job["env"])
    if restart:
        env["SLURM_RESTART_COUNT"] = str(restart)
    # own process group: on a failure the whole job (srun and its tasks) can be ended at once
    return subprocess.Popen(["bash", str(SBATCH), "tnl", "tiny", *TRAIN_ARGS, *extra], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"sbatch script did not finish in {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def calls(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


# USR1: `#SBATCH --signal=B:USR1@300` before the time limit; TERM: preemption or scancel
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_sbatch_preempt_requeue_resume(job, sig):
    run_dir, log, job_id = job["run_dir"], job["log"], job["job_id"]

    # -- attempt 1: the signal to the batch shell mid-run ---------------------------------------------
    proc = start(job)
    deadline = time.time() + 90
    while len(rows(run_dir)) < SIGNAL_AFTER:
        if proc.poll() is not None or time.time() > deadline:
            rc, out = finish(proc)
            pytest.fail(f"job ended (rc {rc}) or stalled before step {SIGNAL_AFTER}:\n{out[-5000:]}")
        time.sleep(0.05)
    os.kill(proc.pid, getattr(signal, sig))
    rc, out = finish(proc)
    assert rc == 0, out[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["step"]
    assert summary["stop"] == "signal", out[-3000:]
    assert SIGNAL_AFTER <= stopped_at < MAX_STEPS
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert f"received {sig}" in out and f"requeueing job {job_id}" in out

    c = calls(log)
    assert {"cmd": "scontrol", "argv": f"show hostnames {NODELIST}"} in c
    assert c[-1] == {"cmd": "scontrol", "argv": f"requeue {job_id}"}
    srun = [x for x in c if x["cmd"] == "srun"]
    assert len(srun) == 1
    assert srun[0]["MASTER_ADDR"] == HOSTNAMES[0]
    assert srun[0]["MASTER_PORT"] == str(20000 + job_id % 20000)
    assert srun[0]["site_env"] == "yes"  # the site file named by LINSCALE_SLURM_ENV was sourced
    argv = srun[0]["argv"]
    assert argv[argv.index("--resume") + 1] == "auto" and argv[argv.index("--zero") + 1] == "2"
    # both Slurm tasks joined one job: 2 ranks x micro 2 x accumulation 2 under DeepSpeed ZeRO-2
    assert "DeepSpeed ZeRO-2" in out and "2 ranks x micro 2 x accumulation 2" in out
    ds = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert ds["train_batch_size"] == BATCH and ds["gradient_accumulation_steps"] == 2
    first = rows(run_dir)
    assert [r["step"] for r in first] == list(range(1, stopped_at + 1))

    # -- a restart that crashes (bad flag): the stale stop=signal summary must not requeue it -----------
    proc = start(job, "--lr", "not-a-number", restart=1)
    rc, out = finish(proc)
    assert rc != 0 and "requeueing" not in out, out[-3000:]
    assert calls(log)[-1]["cmd"] == "srun"  # no scontrol requeue after it

    # -- attempt 2 (the requeued job): same command, resumes and finishes ----------------------------
    proc = start(job, restart=2)
    rc, out = finish(proc)
    assert rc == 0, out[-5000:]
    assert f"restart 2" in out
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'} at step {stopped_at}" in out
    assert "requeueing" not in out and calls(log)[-1]["cmd"] == "srun"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop"] == "finished" and summary["step"] == MAX_STEPS
    assert summary["tokens"] == MAX_STEPS * BATCH * SEQ
    r = rows(run_dir)
    # every step exactly once across the two attempts, tokens continuing from the checkpoint
    assert [x["step"] for x in r] == list(range(1, MAX_STEPS + 1))
    assert [x["tokens"] for x in r] == [s * BATCH * SEQ for s in range(1, MAX_STEPS + 1)]
    assert r[:stopped_at] == first
    assert r[-1]["loss"] < r[0]["loss"] - 0.5

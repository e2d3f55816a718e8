"""launch/slurm/pretrain.sbatch submitted to a real Slurm cluster: launch/slurm/local_cluster.sh (one
slurmctld, slurmd nodes n1 and n2 in partition `debug`, n3 in `low`/`high` for preemption, all on this
machine). A tiny TNL trains on CPU over gloo with DeepSpeed ZeRO-2, 2 ranks: one node x 2 tasks, or two
nodes x 1 task. Every scenario is a real job driven by real Slurm actions (scancel, scontrol requeue, a time
limit, a partition preemption, kill -9 of a rank), and each resumed run's per-step losses must equal those of
one uninterrupted reference job, bitwise.

The scenarios run as concurrent jobs (module fixture `outcomes`, one thread per job), so the whole module
costs about as long as its slowest scenario. To make "a signal in the middle of the run" deterministic on a
loaded machine, the jobs' Python processes import a test-only `sitecustomize` (through PYTHONPATH) that makes
the trainer wait, before a chosen step of a chosen attempt, until that rank has received a stop signal; the
wait changes no number of the run. The tests skip only where Slurm cannot be installed or started here (not
root, no apt-get); with LINSCALE_REQUIRE_SLURM=1 (set by .ci/run) they fail instead."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from checkpoint_utils import ABORT_AT_EXIT_HOOK, ROOT, VOCAB, make_dataset

pytest.importorskip("deepspeed")

SBATCH = ROOT / "launch" / "slurm" / "pretrain.sbatch"
STEPS = 16                      # every 2-rank scenario trains the same 16 steps as the reference
SEQ, BATCH, MICRO = 16, 8, 2    # 8 x 16 tokens per step: 2 ranks x micro 2 x accumulation 2
HOLD = 4                        # scenarios stop the first attempt after this step
TIMEOUT = 900                   # per scenario, seconds: generous, the CPU is shared
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

TRAIN_ARGS = ["--model", f"vocab_size={VOCAB}", "--seq-len", str(SEQ), "--max-steps", str(STEPS),
              "--warmup-steps", "3", "--lr", "3e-3", "--log-every", "1", "--eval-every", "0",
              "--save-every", "0", "--seed", "0"]

# Imported by every Python process of a job (PYTHONPATH). LINSCALE_TEST_HOLD="R:S,..." makes the trainer of
# attempt R (SLURM_RESTART_COUNT) wait before the step after S (S=first: at its first step of that attempt)
# until this rank has received a stop signal, then go on: the trainer stops there, as it would have had the
# signal arrived at that moment by chance.
HOOK = r'''
import importlib.util, os, sys, time

def _holds():
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    out = []
    for item in os.environ.get("LINSCALE_TEST_HOLD", "").split(","):
        if item and item.split(":")[0] == restart:
            out.append(item.split(":")[1])
    return out

def _patch(module):
    holds = set(_holds())
    if not hasattr(getattr(module, "CheckpointManager", None), "stop_requested"):
        print("[test-hold] ERROR: checkpoints.manager.CheckpointManager.stop_requested is gone", flush=True)
        return
    orig = module.CheckpointManager.stop_requested
    state = {"first": True}

    def stop_requested(self):
        step = self.progress.step
        if (state["first"] and "first" in holds) or str(step) in holds:
            holds.discard(str(step))
            holds.discard("first")
            print(f"[test-hold] rank {self.env.rank} waits at step {step} for a stop signal", flush=True)
            deadline = time.monotonic() + float(os.environ.get("LINSCALE_TEST_HOLD_MAX", "600"))
            while getattr(self.signal, "received", None) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        state["first"] = False
        return orig(self)

    module.CheckpointManager.stop_requested = stop_requested

class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "checkpoints.manager":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("LINSCALE_TEST_HOLD") and _holds():
    sys.meta_path.insert(0, _Finder())

# LINSCALE_TEST_STALL=R: the trainer of attempt R stalls as it starts, before it handles any signal (a model
# still loading), so that a stop there kills it with nothing saved
if (os.environ.get("LINSCALE_TEST_STALL") == os.environ.get("SLURM_RESTART_COUNT", "0") and sys.argv
        and sys.argv[0].endswith("pretrain.py")):
    print(f"[test-stall] rank {os.environ.get('SLURM_PROCID')} stalls at start", flush=True)
    time.sleep(float(os.environ.get("LINSCALE_TEST_HOLD_MAX", "600")))

# LINSCALE_TEST_ABORT_AT_EXIT=R: the trainer of rank R aborts at exit (checkpoint_utils.ABORT_AT_EXIT_HOOK)
ABORT_HERE = os.environ.get("LINSCALE_TEST_ABORT_AT_EXIT", "none") == os.environ.get("SLURM_PROCID")
''' + ABORT_AT_EXIT_HOOK


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stdout}{p.stderr}")
    return p


def job_info(job_id: str) -> dict[str, str]:
    p = sh("scontrol", "show", "job", "-o", job_id, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout)) if p.returncode == 0 else {}


def seconds(hms: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, rest = hms.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days) if days else 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


@dataclass
class Job:
    name: str
    id: str
    run_dir: Path
    log: Path
    states: list[str] = field(default_factory=list)  # JobState/Restarts transitions seen while polling

    def info(self) -> dict[str, str]:
        info = job_info(self.id)
        seen = f"{info.get('JobState')}/{info.get('Restarts')}"
        if info and (not self.states or self.states[-1] != seen):
            self.states.append(seen)
        return info

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def wait(self, what: str, cond, timeout: float = TIMEOUT):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            info = self.info()
            if "[test-hold] ERROR" in self.text():
                raise AssertionError(f"job {self.name}: the test hook failed:\n{self.text()[-3000:]}")
            got = cond(info)
            if got:
                return got
            if info.get("JobState") in TERMINAL and what != "end":
                raise AssertionError(f"job {self.name} ({self.id}) ended ({info.get('JobState')}) while waiting for "
                                     f"{what}; states {self.states}\n{self.text()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"job {self.name} ({self.id}): no {what} after {timeout} s; states {self.states}\n"
                             f"{self.text()[-4000:]}")

    def wait_held(self, restart: int, step: int | str) -> dict:
        """Until attempt `restart` waits in the test hold (its log says so on rank 0)."""
        marker = f"rank 0 waits at step {step}" if step != "first" else "rank 0 waits at step"
        def held(info):
            if info.get("JobState") != "RUNNING" or info.get("Restarts") != str(restart):
                return None
            return info if self.text().split(f"restart {restart} (cap")[-1].count(marker) else None
        return self.wait(f"hold of attempt {restart} at step {step}", held)

    def wait_end(self) -> dict:
        """Until the job is over for good: a final state whose processes have all exited."""
        return self.wait("end", lambda info: info if info.get("JobState") in TERMINAL else None)


@dataclass
class Outcome:
    job: Job
    info: dict
    rows: list[dict]
    log: str
    extra: dict = field(default_factory=dict)


class Cluster:
    def __init__(self, tmp: Path, data: Path):
        self.tmp, self.data = tmp, data
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
        if "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        env.update({
            # the job's `python` is the interpreter running the tests
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), env.get("PYTHONPATH", "")]),
            "DATA": str(data), "ZERO": "2", "MICRO": str(MICRO), "GLOBAL_BATCH_TOKENS": str(BATCH * SEQ),
            "OMP_NUM_THREADS": "1", "LINSCALE_TEST_HOLD_MAX": "300",
        })
        self.env = env
        self.jobs: list[Job] = []
        self.lock = threading.Lock()

    def submit(self, name: str, *sbatch_opts: str, nodes: int = 1, tasks_per_node: int = 2, hold: str = "",
               args: tuple[str, ...] = (), **env: str) -> Job:
        run_dir, log = self.tmp / name, self.tmp / f"{name}.out"
        e = {**self.env, "RUN_DIR": str(run_dir), "LINSCALE_TEST_HOLD": hold, **env}
        p = subprocess.run(["sbatch", "--parsable", f"--job-name=t-{name}", f"--output={log}", f"--nodes={nodes}",
                            f"--ntasks-per-node={tasks_per_node}", *sbatch_opts, str(SBATCH), "tnl", "tiny",
                            *TRAIN_ARGS, *args], env=e, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"sbatch failed: {p.stderr}"
        job = Job(name, p.stdout.strip().split(";")[0], run_dir, log)
        with self.lock:
            self.jobs.append(job)
        return job


# -- the scenarios: each drives one job (a thread each) and returns what the tests check ----------------------

def reference(c: Cluster) -> Outcome:
    job = c.submit("reference")
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def usr1_batch(c: Cluster) -> Outcome:
    """SIGUSR1 to the batch shell only (what --signal=B:USR1 does): checkpoint, requeue, resume."""
    job = c.submit("usr1_batch", hold=f"0:{HOLD}")
    job.wait_held(0, HOLD)
    sh("scancel", "--signal=USR1", "--batch", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def usr1_full_two_nodes(c: Cluster) -> Outcome:
    """2 nodes x 1 task; SIGUSR1 to the batch shell and every task at once."""
    job = c.submit("usr1_full", nodes=2, tasks_per_node=1, hold=f"0:{HOLD}")
    job.wait_held(0, HOLD)
    sh("scancel", "--signal=USR1", "--full", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def requeue_and_cap(c: Cluster) -> Outcome:
    """`scontrol requeue` (Slurm requeues attempt 0); then SIGUSR1 on attempt 1, which is past
    LINSCALE_MAX_RESTARTS=1: checkpoint, no requeue, the job completes at that step."""
    job = c.submit("requeue", hold="0:3,1:6", LINSCALE_MAX_RESTARTS="1")
    job.wait_held(0, 3)
    sh("scontrol", "requeue", job.id)
    job.wait_held(1, 6)
    sh("scancel", "--signal=USR1", "--batch", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def usr1_and_requeue(c: Cluster) -> Outcome:
    """SIGUSR1 and `scontrol requeue` together: Slurm requeues the job while the script is still asked to;
    the script must leave it at that (one restart) and the run must still finish bitwise."""
    job = c.submit("usr1_and_requeue", hold=f"0:{HOLD}")
    job.wait_held(0, HOLD)
    sh("scancel", "--signal=USR1", "--batch", job.id)
    sh("scontrol", "requeue", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def requeue_refused(c: Cluster) -> Outcome:
    """SIGUSR1 to a job submitted with --no-requeue: Slurm refuses the script's `scontrol requeue`; the
    script reports it and exits with the trainer's status (0) instead of failing."""
    job = c.submit("requeue_refused", "--no-requeue", tasks_per_node=1, hold=f"0:{HOLD}", ZERO="0")
    job.wait_held(0, HOLD)
    sh("scancel", "--signal=USR1", "--batch", job.id)
    info = job.wait_end()
    time.sleep(3)
    return Outcome(job, info, job.rows(), job.text(), {"after": job_info(job.id)})


def time_limit(c: Cluster) -> Outcome:
    """The time-limit warning of `--signal=B:USR1@100`, sent by Slurm. The job starts with 30 minutes; once the
    trainer is at step HOLD the limit is cut to leave 1-2 minutes (so that the warning comes at Slurm's next
    time-limit check, at most 30 s later, whatever the start-up took), and restored once the warning came,
    so that the requeued attempt has time to finish."""
    job = c.submit("time_limit", "--time=30", "--signal=B:USR1@100", hold=f"0:{HOLD}")
    info = job.wait_held(0, HOLD)
    limit = seconds(info["RunTime"]) // 60 + 2
    sh("scontrol", "update", f"JobId={job.id}", f"TimeLimit={limit}")
    job.wait("the time-limit warning", lambda i: "got SIGUSR1" in job.text())
    sh("scontrol", "update", f"JobId={job.id}", "TimeLimit=30")
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text(), {"cut_to_minutes": limit})


def preemption(c: Cluster) -> Outcome:
    """A job in partition `low` on n3 preempted (PreemptMode=REQUEUE) by an exclusive job in `high`."""
    job = c.submit("preempted", "--partition=low", hold=f"0:{HOLD}")
    job.wait_held(0, HOLD)
    p = sh("sbatch", "--parsable", "--partition=high", "--exclusive", "--job-name=t-preemptor",
           f"--output={c.tmp / 'preemptor.out'}", "--wrap", "sleep 1")
    high = p.stdout.strip().split(";")[0]
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text(), {"high": job_info(high)})


def user_cancel(c: Cluster) -> Outcome:
    job = c.submit("cancel", hold=f"0:{HOLD}")
    job.wait_held(0, HOLD)
    sh("scancel", job.id)
    info = job.wait_end()
    time.sleep(3)  # a requeue would show by now (the script has exited: the state is final)
    return Outcome(job, info, job.rows(), job.text(), {"after": job_info(job.id)})


def crash_kill(c: Cluster) -> Outcome:
    """kill -9 of rank 1 in the middle of the run (found by its job id and rank in /proc)."""
    job = c.submit("crash_kill", hold=f"0:{HOLD}")
    job.wait_held(0, HOLD)
    victims = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (b"launch/pretrain.py" in cmdline and f"SLURM_JOB_ID={job.id}".encode() in environ
                and b"SLURM_PROCID=1" in environ):
            victims.append(int(proc.name))
    assert len(victims) == 1, f"rank 1 of job {job.id}: found pids {victims}"
    os.kill(victims[0], 9)
    info = job.wait_end()
    time.sleep(3)
    return Outcome(job, info, job.rows(), job.text(), {"after": job_info(job.id)})


def crash_bad_flag(c: Cluster) -> Outcome:
    job = c.submit("crash_flag", tasks_per_node=1, args=("--lr", "not-a-number"), ZERO="0")
    info = job.wait_end()
    time.sleep(3)
    return Outcome(job, info, job.rows(), job.text(), {"after": job_info(job.id)})


def early_warning(c: Cluster) -> Outcome:
    """A time limit shorter than the warning: Slurm signals each attempt seconds after it starts."""
    job = c.submit("early_warning", "--time=1", "--signal=B:USR1@300", tasks_per_node=1, hold="0:first,1:first",
                   ZERO="0", LINSCALE_TEST_HOLD_MAX="120")
    info = job.wait_end()
    time.sleep(3)
    return Outcome(job, info, job.rows(), job.text(), {"after": job_info(job.id)})


def usr1_at_start(c: Cluster) -> Outcome:
    """SIGUSR1 as soon as the batch script runs (its first line is out; a signal before the script exists is
    dropped by Slurm): before srun, before the trainer has its handlers (it dies of the signal), or at its
    first step if it got that far. Either way no progress and no requeue, and the log must say so."""
    job = c.submit("usr1_at_start", tasks_per_node=1, hold="0:first,1:first", ZERO="0", LINSCALE_TEST_HOLD_MAX="120")
    job.wait("the script's first line", lambda i: "[sbatch]" in job.text())
    sh("scancel", "--signal=USR1", "--batch", job.id)
    info = job.wait_end()
    time.sleep(3)
    return Outcome(job, info, job.rows(), job.text(), {"after": job_info(job.id)})


def abort_at_exit(c: Cluster) -> Outcome:
    """Rank 1 aborts as its process exits, after the run finished and wrote its final checkpoint: srun kills
    the step and exits non-zero; nothing is lost, and the job must end COMPLETED, not FAILED."""
    job = c.submit("abort_at_exit", LINSCALE_TEST_ABORT_AT_EXIT="1")
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def out_and_overwrite_flags(c: Cluster) -> Outcome:
    """`--out DIR --overwrite` among the trainer's flags (no RUN_DIR) into a directory that holds an older
    run: the script inspects and requeues DIR; attempt 0 sets the old run aside, the requeued attempt 1
    continues this run (it takes neither --overwrite nor a --resume of the submission again)."""
    out = c.tmp / "out_flag"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # an older run in the same directory,
    old = out / "checkpoints" / f"step_{2 * HOLD:08d}"                  # further on than this run gets before
    old.mkdir(parents=True)                                              # its warning
    (old / "model.pt").write_bytes(b"x" * 10)
    from checkpoints.manifest import write_manifest
    write_manifest(old)
    job = c.submit("out_flag_env", hold=f"0:{HOLD}", args=("--out", str(out), "--overwrite"), RUN_DIR="")
    job.run_dir = out
    job.wait_held(0, HOLD)
    sh("scancel", "--signal=USR1", "--batch", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


def resume_path_requeued_at_start(c: Cluster) -> Outcome:
    """`--resume PATH` (another run's checkpoint at step HOLD) into a new run directory, and `scontrol requeue`
    while the first attempt's trainer is still starting: nothing of this job is saved, so the restart must
    resume from PATH again, not start from scratch with --resume auto."""
    src = c.tmp / "resume_src"
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "--arch", "tnl", "--size", "tiny",
                        "--data", str(c.data), "--out", str(src), "--device", "cpu", "--micro-batch", str(MICRO),
                        "--global-batch-tokens", str(BATCH * SEQ), *TRAIN_ARGS, "--max-steps", str(HOLD)],
                       env={**c.env, "LINSCALE_TEST_HOLD": ""}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = src / "checkpoints" / f"step_{HOLD:08d}"
    job = c.submit("resume_path", tasks_per_node=1, args=("--resume", str(ckpt)), ZERO="0", LINSCALE_TEST_STALL="0",
                   LINSCALE_TEST_HOLD_MAX="300")
    job.wait("the trainer stalling at start", lambda i: "[test-stall] rank 0 stalls" in job.text())
    sh("scontrol", "requeue", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text(), {"ckpt": ckpt})


def resume_earlier_checkpoint(c: Cluster) -> Outcome:
    """`--resume` of an earlier checkpoint of the same run (going back, e.g. before a loss spike): the trainer
    sets the later checkpoints aside, so the warning's checkpoint has a lower step than the newest one the job
    started with. It is progress all the same: the job must requeue and finish the run."""
    run_dir = c.tmp / "resume_earlier"
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "--arch", "tnl", "--size", "tiny",
                        "--data", str(c.data), "--out", str(run_dir), "--device", "cpu", "--micro-batch", str(MICRO),
                        "--global-batch-tokens", str(BATCH * SEQ), *TRAIN_ARGS, "--max-steps", str(2 * HOLD),
                        "--save-every", str(HOLD)],
                       env={**c.env, "LINSCALE_TEST_HOLD": ""}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    back = run_dir / "checkpoints" / f"step_{HOLD:08d}"
    job = c.submit("resume_earlier", tasks_per_node=1, hold=f"0:{HOLD + 2}", args=("--resume", str(back)), ZERO="0")
    job.wait_held(0, HOLD + 2)
    sh("scancel", "--signal=USR1", "--batch", job.id)
    info = job.wait_end()
    return Outcome(job, info, job.rows(), job.text())


SCENARIOS = [reference, usr1_batch, usr1_full_two_nodes, requeue_and_cap, usr1_and_requeue, requeue_refused,
             time_limit, preemption, user_cancel, crash_kill, crash_bad_flag, early_warning, usr1_at_start,
             abort_at_exit, out_and_overwrite_flags, resume_path_requeued_at_start, resume_earlier_checkpoint]


# -- fixtures --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(slurm_cluster, tmp_path_factory) -> dict[str, Outcome | BaseException]:
    tmp = tmp_path_factory.mktemp("slurm")
    c = Cluster(tmp, make_dataset(tmp / "data", docs=120))

    def run(scenario):
        t0 = time.monotonic()
        try:
            got = scenario(c)
            got.extra["seconds"] = time.monotonic() - t0
            return got
        except BaseException as err:  # noqa: BLE001 - reported by the scenario's own test
            err.add_note(traceback.format_exc())
            return err
        finally:
            print(f"[test_slurm] {scenario.__name__}: {time.monotonic() - t0:.0f} s", flush=True)

    # LINSCALE_SLURM_SCENARIOS=a,b runs only those (while working on one); the others' tests skip
    only = {x for x in os.environ.get("LINSCALE_SLURM_SCENARIOS", "").split(",") if x}
    chosen = [s for s in SCENARIOS if not only or s.__name__ in only or s is reference]
    with ThreadPoolExecutor(len(chosen)) as pool:
        results = dict(zip([s.__name__ for s in chosen], pool.map(run, chosen)))
    yield results
    for job in c.jobs:  # nothing of ours may outlive the module, whatever failed
        state = job_info(job.id).get("JobState")
        if state and state not in TERMINAL:
            subprocess.run(["scancel", job.id], capture_output=True)


def outcome(outcomes, name: str) -> Outcome:
    if name not in outcomes:
        pytest.skip(f"scenario {name} not in LINSCALE_SLURM_SCENARIOS")
    got = outcomes[name]
    if isinstance(got, BaseException):
        raise got
    return got


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows}  # a step logged twice (after a crash) keeps its last loss


def assert_bitwise(o: Outcome, ref: Outcome, steps: int = STEPS) -> None:
    got, want = losses(o.rows), losses(ref.rows)
    assert sorted(got) == list(range(1, steps + 1)), f"steps logged: {sorted(got)}"
    diff = {s: (got[s], want[s]) for s in got if got[s] != want[s]}
    assert not diff, f"losses differ from the uninterrupted run at steps {sorted(diff)}: {diff}"


def assert_truthful(o: Outcome) -> None:
    """Every 'checkpoint step N written' line names a complete checkpoint on disk."""
    for step in re.findall(r"checkpoint step (\d+) written", o.log):
        ckpt = o.job.run_dir / "checkpoints" / f"step_{int(step):08d}"
        assert (ckpt / "manifest.json").is_file(), f"the log claims {ckpt}, which is not a complete checkpoint"


# -- the tests -----------------------------------------------------------------------------------------------------

def test_reference_one_node_two_tasks(outcomes):
    o = outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "0", o.log[-3000:]
    assert [r["step"] for r in o.rows] == list(range(1, STEPS + 1))
    first, last = [r["loss"] for r in o.rows[:4]], [r["loss"] for r in o.rows[-4:]]
    assert sum(last) < sum(first) - 0.4, "the reference run did not learn"  # 0.1 a step on average
    # both tasks joined one DeepSpeed ZeRO-2 job over gloo, meeting where pretrain/distributed.py said
    assert "DeepSpeed ZeRO-2" in o.log and "2 ranks x micro 2 x accumulation 2" in o.log
    node = o.info["NodeList"]
    assert f"rendezvous {node}:{20000 + int(o.job.id) % 20000}, 2 ranks, gloo" in o.log
    assert json.loads((o.job.run_dir / "summary.json").read_text())["stop"] == "finished"
    assert "requeue" not in o.log.split("trainer exited")[-1]


def test_usr1_to_batch_shell_requeues_and_resumes_bitwise(outcomes):
    o, ref = outcome(outcomes, "usr1_batch"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    assert f"checkpoint step {HOLD} written" in o.log and f"requeued job {o.job.id}" in o.log
    assert f"resumed from {o.job.run_dir / 'checkpoints' / f'step_{HOLD:08d}'} at step {HOLD}" in o.log
    assert_bitwise(o, ref)
    assert_truthful(o)


def test_usr1_full_on_two_nodes_resumes_bitwise(outcomes):
    o, ref = outcome(outcomes, "usr1_full_two_nodes"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    assert o.info["NodeList"] == "n[1-2]" and "2 node(s) n[1-2], 2 task(s)" in o.log
    assert f"rendezvous n1:{20000 + int(o.job.id) % 20000}, 2 ranks" in o.log  # the first node of the step
    assert f"checkpoint step {HOLD} written" in o.log and f"requeued job {o.job.id}" in o.log
    assert_bitwise(o, ref)
    assert_truthful(o)


def test_scontrol_requeue_resumes_and_the_restart_cap_stops_requeueing(outcomes):
    o, ref = outcome(outcomes, "requeue_and_cap"), outcome(outcomes, "reference")
    assert o.info["Restarts"] == "1" and o.info["JobState"] == "COMPLETED", o.log[-4000:]
    first, second = o.log.split("restart 1 (cap 1)")
    # attempt 0: Slurm's requeue (SIGTERM); the script checkpoints and leaves the requeue to Slurm
    assert "got SIGTERM" in first and "SIGTERM: not requeueing" in first and "checkpoint step 3 written" in first
    assert "newest checkpoint: step 3" in second and "resumed from" in second
    # attempt 1: the warning at restart 1 with LINSCALE_MAX_RESTARTS=1: checkpoint, but no requeue
    assert "checkpoint step 6 written" in second and "not requeueing: restart 1 reached LINSCALE_MAX_RESTARTS=1" in second
    assert f"requeued job {o.job.id}" not in o.log
    summary = json.loads((o.job.run_dir / "summary.json").read_text())
    assert (summary["stop"], summary["step"]) == ("signal", 6)
    assert_bitwise(o, ref, steps=6)
    assert_truthful(o)


def test_usr1_with_slurm_requeue_restarts_once(outcomes):
    o, ref = outcome(outcomes, "usr1_and_requeue"), outcome(outcomes, "reference")
    assert o.info["Restarts"] == "1" and o.info["JobState"] == "COMPLETED", o.log[-4000:]
    first = o.log.split("restart 1 (cap")[0]
    assert "got SIGUSR1" in first and "got SIGTERM" in first and "SIGTERM: not requeueing" in first
    assert f"checkpoint step {HOLD} written" in first and f"requeued job {o.job.id}" not in o.log
    assert_bitwise(o, ref)
    assert_truthful(o)


def test_requeue_refused_by_slurm_keeps_the_trainers_exit_status(outcomes):
    o = outcome(outcomes, "requeue_refused")
    for info in (o.info, o.extra["after"]):
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", o.log[-3000:]
        assert info["ExitCode"] == "0:0"
    assert f"checkpoint step {HOLD} written" in o.log
    assert f"scontrol requeue {o.job.id}: " in o.log and f"requeued job {o.job.id}" not in o.log
    assert_truthful(o)


def test_time_limit_warning_requeues_and_resumes_bitwise(outcomes):
    o, ref = outcome(outcomes, "time_limit"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    first = o.log.split("restart 1 (cap")[0]
    assert first.count("got SIGUSR1") == 1 and "got SIGTERM" not in first  # the warning, before the limit
    assert f"checkpoint step {HOLD} written" in first and f"requeued job {o.job.id}" in first
    assert_bitwise(o, ref)
    assert_truthful(o)


def test_partition_preemption_requeued_by_slurm_resumes_bitwise(outcomes):
    o, ref = outcome(outcomes, "preemption"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    assert o.info["Partition"] == "low" and o.extra["high"].get("JobState") == "COMPLETED"
    first = o.log.split("restart 1 (cap")[0]
    assert "got SIGTERM" in first and "SIGTERM: not requeueing" in first and "requeued job" not in first
    assert f"checkpoint step {HOLD} written" in first
    assert f"resumed from {o.job.run_dir / 'checkpoints' / f'step_{HOLD:08d}'} at step {HOLD}" in o.log
    assert_bitwise(o, ref)
    assert_truthful(o)


def test_user_cancel_ends_the_job_with_a_checkpoint(outcomes):
    o = outcome(outcomes, "user_cancel")
    for info in (o.info, o.extra["after"]):
        assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", o.log[-3000:]
    assert "got SIGTERM" in o.log and "SIGTERM: not requeueing" in o.log and "requeued job" not in o.log
    assert f"checkpoint step {HOLD} written" in o.log
    assert (o.job.run_dir / "checkpoints" / f"step_{HOLD:08d}" / "manifest.json").is_file()
    assert json.loads((o.job.run_dir / "summary.json").read_text())["stop"] == "signal"
    assert_truthful(o)


def test_crash_of_a_rank_is_not_requeued(outcomes):
    o = outcome(outcomes, "crash_kill")
    for info in (o.info, o.extra["after"]):
        assert info["JobState"] == "FAILED" and info["Restarts"] == "0", o.log[-3000:]
    assert "no new checkpoint (newest: none)" in o.log and "requeue" not in o.log.split("trainer exited")[-1]
    assert not (o.job.run_dir / "checkpoints").exists() or not any((o.job.run_dir / "checkpoints").glob("step_*"))


def test_bad_flag_fails_with_the_trainers_exit_code(outcomes):
    o = outcome(outcomes, "crash_bad_flag")
    for info in (o.info, o.extra["after"]):
        assert info["JobState"] == "FAILED" and info["Restarts"] == "0", o.log[-3000:]
    assert info["ExitCode"] == "2:0", o.log[-3000:]  # the trainer's `error: ...` exit status, not the script's
    assert "--lr" in o.log and "trainer exited with 2" in o.log


def test_warning_before_the_time_limit_does_not_loop(outcomes):
    o = outcome(outcomes, "early_warning")
    for info in (o.info, o.extra["after"]):
        assert info["Restarts"] == "0" and info["JobState"] in {"COMPLETED", "FAILED"}, o.log[-3000:]
    assert "got SIGUSR1" in o.log and "requeued job" not in o.log
    assert "not requeueing" in o.log or "not starting it" in o.log, o.log[-3000:]
    assert_truthful(o)


def test_usr1_before_the_trainer_is_ready_is_reported_truthfully(outcomes):
    o = outcome(outcomes, "usr1_at_start")
    for info in (o.info, o.extra["after"]):
        assert info["Restarts"] == "0" and info["JobState"] in {"COMPLETED", "FAILED"}, o.log[-3000:]
    assert "got SIGUSR1" in o.log and "requeued job" not in o.log
    assert "not requeueing" in o.log or "not starting it" in o.log, o.log[-3000:]
    m = re.search(r"trainer exited with (\d+) \(stop: (\S+)\); (.*)", o.log)
    if m and m.group(2) != "signal":  # died of the signal in start-up: nothing may be claimed
        assert m.group(3).startswith("no new checkpoint"), o.log[-3000:]
    assert_truthful(o)


def test_a_rank_aborting_at_exit_after_the_run_finished_completes_the_job(outcomes):
    """The abort is real (srun reports it and the trainer's status is not 0), yet the run finished with its
    final checkpoint complete: the job ends COMPLETED, says why, and its losses are the reference's."""
    o, ref = outcome(outcomes, "abort_at_exit"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "0", o.log[-3000:]
    m = re.search(r"trainer exited with (\d+) \(stop: finished\); checkpoint step (\d+) written", o.log)
    assert m and m.group(1) != "0" and int(m.group(2)) == STEPS, o.log[-3000:]
    assert "Aborted" in o.log, o.log[-3000:]
    assert f"the run finished at step {STEPS} with its final checkpoint complete" in o.log
    assert "requeue" not in o.log.split("trainer exited")[-1]
    assert_bitwise(o, ref)
    assert_truthful(o)


def test_out_flag_names_the_run_and_restarts_neither_overwrite_nor_resume(outcomes):
    o, ref = outcome(outcomes, "out_and_overwrite_flags"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    assert f"checkpoint step {HOLD} written" in o.log and f"requeued job {o.job.id}" in o.log
    assert "restart 1: --overwrite was for the first attempt" in o.log
    assert f"resumed from {o.job.run_dir / 'checkpoints' / f'step_{HOLD:08d}'} at step {HOLD}" in o.log
    assert_bitwise(o, ref)
    assert_truthful(o)
    attempt = json.loads((o.job.run_dir / "slurm_attempt.json").read_text())
    assert (attempt["restart"], attempt["exit"], attempt["stop"], attempt["checkpoint"]) == (1, 0, "finished", STEPS)


def test_resuming_an_earlier_checkpoint_of_the_run_requeues_at_the_warning(outcomes):
    o = outcome(outcomes, "resume_earlier_checkpoint")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    first, second = o.log.split("restart 1 (cap")
    assert f"newest checkpoint: step {2 * HOLD}" in first
    assert f"checkpoint step {HOLD + 2} written" in first and f"requeued job {o.job.id}" in first, first[-3000:]
    assert "restart 1: resuming from the newest checkpoint (--resume auto)" in second
    assert f"resumed from {o.job.run_dir / 'checkpoints' / f'step_{HOLD + 2:08d}'} at step {HOLD + 2}" in second
    assert json.loads((o.job.run_dir / "summary.json").read_text())["step"] == STEPS
    # one rank, unlike the reference: the steps after the checkpoint gone back to repeat the earlier run's
    # losses bitwise (metrics.jsonl holds both), through the warning's checkpoint and the requeue
    assert sorted(losses(o.rows)) == list(range(1, STEPS + 1))
    earlier = {r["step"]: r["loss"] for r in reversed(o.rows)}   # each step's first row: the earlier run's
    assert [r["step"] for r in o.rows].count(HOLD + 1) == 2
    assert {s: earlier[s] for s in range(HOLD + 1, 2 * HOLD + 1)} == \
        {s: losses(o.rows)[s] for s in range(HOLD + 1, 2 * HOLD + 1)}
    assert_truthful(o)


def stand_in_srun(tmp_path: Path, **env: str) -> tuple[dict, Path]:
    """The environment of a job whose `srun` only writes the command line it got, one argument a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    argv = tmp_path / "srun-argv"
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {argv}\necho srun-called\n')
    (bin_dir / "srun").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "LINSCALE_"))}
    base.update(SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(ROOT), RUN_DIR=str(tmp_path / "run"), DATA="",
                PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), base.get("PATH", "")]), **env)
    return base, argv


@pytest.mark.parametrize("flag", [("--overwrite=true",), ("--overwrite", "yes"), ("--overwrite", "1")])
def test_overwrite_with_a_value_is_for_the_first_attempt_only(tmp_path, flag):
    """The trainer's --overwrite takes a value too; in every form it sets the run aside on the job's first
    start only: a restart that took it again would set aside what the attempts before it trained."""
    env, argv = stand_in_srun(tmp_path)
    args = ["bash", str(SBATCH), "tnl", "tiny", *flag, "--ops-tune-cache", "/tmp/a b", "--max-steps", "3"]
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert p.returncode == 0 and "srun-called" in p.stdout, p.stdout + p.stderr
    first = argv.read_text().splitlines()
    assert "--overwrite" in first and "--resume" not in first and first[-4:] == ["--ops-tune-cache", "/tmp/a b", "--max-steps", "3"]
    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)  # the first attempt saved
    (tmp_path / "run" / "checkpoints" / "step_00000002" / "model.pt").write_bytes(b"x")
    from checkpoints.manifest import write_manifest
    write_manifest(tmp_path / "run" / "checkpoints" / "step_00000002")
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**env, "SLURM_RESTART_COUNT": "1"})
    assert p.returncode == 0 and "--overwrite was for the first attempt" in p.stdout, p.stdout + p.stderr
    again = argv.read_text().splitlines()
    assert not any(a.startswith("--overwrite") for a in again) and "yes" not in again and "1" not in again, again
    assert again[again.index("--resume") + 1] == "auto" and again[-4:] == ["--ops-tune-cache", "/tmp/a b", "--max-steps", "3"]


def test_resume_auto_in_another_case_is_the_keyword_on_every_attempt(tmp_path):
    """The trainer reads `--resume Auto` as `auto`; so does the script: the first attempt passes the keyword,
    and a restart says nothing of resuming elsewhere than the first attempt asked."""
    env, argv = stand_in_srun(tmp_path)
    args = ["bash", str(SBATCH), "tnl", "tiny", "--resume", "Auto", "--max-steps", "3"]
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert p.returncode == 0 and "srun-called" in p.stdout, p.stdout + p.stderr
    first = argv.read_text().splitlines()
    assert first[first.index("--resume") + 1] == "auto", first
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"   # the first attempt saved
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"x")
    from checkpoints.manifest import write_manifest
    write_manifest(ckpt)
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**env, "SLURM_RESTART_COUNT": "1"})
    assert p.returncode == 0 and "not from --resume" not in p.stdout, p.stdout + p.stderr
    again = argv.read_text().splitlines()
    assert again[again.index("--resume") + 1] == "auto", again


def test_out_resume_and_overwrite_in_a_config_file_count_as_the_flags(tmp_path):
    """A --config YAML's out names the run directory the script inspects and requeues (the trainer writes
    there); its overwrite: true sets an earlier run aside on the first attempt only, as the flag does: a
    restart passes --resume auto and --overwrite false, which win over the file."""
    env, argv = stand_in_srun(tmp_path)
    env.pop("RUN_DIR")
    run = tmp_path / "from-config"
    config = tmp_path / "train.yaml"
    config.write_text(f"out: {run}\noverwrite: true\ntrain:\n  max_steps: 3\n")
    args = ["bash", str(SBATCH), "tnl", "tiny", "--config", str(config)]
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert p.returncode == 0 and "srun-called" in p.stdout, p.stdout + p.stderr
    first = argv.read_text().splitlines()
    assert first[first.index("--out") + 1] == str(run) and "--overwrite" in first and "--resume" not in first, first
    assert first[first.index("--config") + 1] == str(config)
    assert run.is_dir() and not (tmp_path / "runs").exists()
    ckpt = run / "checkpoints" / "step_00000002"   # the first attempt saved
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"x")
    from checkpoints.manifest import write_manifest
    write_manifest(ckpt)
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**env, "SLURM_RESTART_COUNT": "1"})
    assert p.returncode == 0 and "newest checkpoint: step 2" in p.stdout, p.stdout + p.stderr
    again = argv.read_text().splitlines()
    assert again[again.index("--resume") + 1] == "auto" and again[again.index("--overwrite") + 1] == "false", again
    # a RUN_DIR naming another directory than the file's out is refused before anything starts
    argv.unlink()
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**env, "RUN_DIR": str(tmp_path / "other")})
    assert p.returncode == 2 and "name two run directories" in p.stdout and not argv.exists(), p.stdout + p.stderr


@pytest.mark.parametrize("flag", [("--ou", "elsewhere"), ("--res=runs/x/checkpoints/step_00000004",), ("--overw",),
                                  ("--conf", "train.yaml")])
def test_abbreviations_of_the_flags_the_script_reads_are_refused(tmp_path, flag):
    """The trainer takes `--ou DIR` for `--out DIR`: the script would inspect and requeue runs/ARCH-SIZE while
    the run trained elsewhere (and never requeue it). Refused before anything starts."""
    env, argv = stand_in_srun(tmp_path)
    p = subprocess.run(["bash", str(SBATCH), "tnl", "tiny", *flag], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env=env)
    assert p.returncode == 2 and "write it in full" in p.stdout and not argv.exists(), p.stdout + p.stderr


def test_missing_arch_and_size_is_a_usage_error(tmp_path):
    job = {**os.environ, "SLURM_JOB_ID": "7"}
    p = subprocess.run(["bash", str(SBATCH), "--max-steps", "3"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=60, env={**job, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert p.returncode == 2 and "usage: sbatch launch/slurm/pretrain.sbatch ARCH SIZE" in p.stdout
    assert not (tmp_path / "runs").exists()
    p = subprocess.run(["bash", str(SBATCH), "tnl", "tiny", "--out", "a"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60, env={**job, "RUN_DIR": "b"})
    assert p.returncode == 2 and "name two run directories" in p.stdout


def test_outside_a_slurm_job_is_refused_with_the_way_to_run(tmp_path):
    """`bash pretrain.sbatch` outside any job: one line saying to submit it (it died on an unset variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run(["bash", str(SBATCH), "tnl", "tiny"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=60, env=env)
    assert p.returncode == 2 and "not inside a Slurm job" in p.stdout and "sbatch" in p.stdout, p.stdout + p.stderr
    assert "unbound variable" not in p.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("cap", ["abc", "20x", "1.5", "-1"])
def test_a_malformed_restart_cap_is_refused_before_training(tmp_path, cap):
    """LINSCALE_MAX_RESTARTS is read only at the warning, hours into a job: there bash arithmetic took "20x"
    for no cap at all and "abc" for an unset variable that ended the script after the checkpoint, with no
    requeue and no report. Anything but a whole number is a usage error before srun starts (a stand-in srun
    here records whether it was called)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\necho srun-called\n")
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "LINSCALE_"))}
    env.update(SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(ROOT), RUN_DIR=str(tmp_path / "run"), DATA="",
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]))

    def run(value: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SBATCH), "tnl", "tiny"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120, env={**env, "LINSCALE_MAX_RESTARTS": value})
    p = run(cap)
    assert p.returncode == 2 and f"LINSCALE_MAX_RESTARTS={cap}: expected a whole number" in p.stdout, p.stdout + p.stderr
    assert "srun-called" not in p.stdout
    p = run("3")  # a whole number goes on to srun, and says the cap
    assert p.returncode == 0 and "srun-called" in p.stdout and "(cap 3)" in p.stdout, p.stdout + p.stderr


def test_a_second_job_for_a_run_in_progress_leaves_its_files_alone(tmp_path):
    """A job whose RUN_DIR is held by a run in progress (its trainer's flock on RUN/.lock) stops before it
    touches anything: the running run's summary.json and slurm_attempt.json stay as they are, srun is not
    called, the log names the holder. Free again, the same job goes on to srun."""
    import fcntl
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\necho srun-called\n")
    (bin_dir / "srun").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text('{"stop": "finished"}')
    (run_dir / "slurm_attempt.json").write_text('{"job_id": "6"}')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "LINSCALE_"))}
    env.update(SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(ROOT), RUN_DIR=str(run_dir), DATA="",
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]))
    with open(run_dir / ".lock", "w") as holder:       # the other run's trainer, rank 0
        holder.write('{"pid": 4242, "host": "node-a"}')
        holder.flush()
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p = subprocess.run(["bash", str(SBATCH), "tnl", "tiny"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120, env=env)
    assert p.returncode == 2 and "is in use by another run" in p.stdout and '"pid": 4242' in p.stdout, p.stdout
    assert "srun-called" not in p.stdout
    assert (run_dir / "summary.json").read_text() == '{"stop": "finished"}'
    assert (run_dir / "slurm_attempt.json").read_text() == '{"job_id": "6"}'
    p = subprocess.run(["bash", str(SBATCH), "tnl", "tiny"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env=env)                # the lock released: this job starts
    assert p.returncode == 0 and "srun-called" in p.stdout, p.stdout + p.stderr


def test_a_second_job_that_passed_the_check_together_leaves_the_runs_attempt_record_alone(tmp_path):
    """Two jobs for one run directory that start together (an --array, two submissions) both pass the check
    before srun: the other job's trainer takes the lock while this one starts, and this job's trainer is
    refused (exit 2). This job must not write its failure over the running run's slurm_attempt.json, nor
    requeue. The stand-in srun here starts the other trainer (a process holding the lock) and exits 2."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "slurm_attempt.json").write_text('{"job_id": "6"}')
    pid_file = tmp_path / "holder.pid"
    env, _ = stand_in_srun(tmp_path)
    holder = tmp_path / "holder.py"   # the other job's trainer, rank 0: takes the lock and keeps it
    holder.write_text("import fcntl, os, sys, time\n"
                      "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                      "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                      "os.write(fd, b'{\"pid\": 4242, \"slurm_job\": \"8\"}')\n"
                      "open(sys.argv[2], 'w').write(str(os.getpid()))\n"
                      "time.sleep(120)\n")
    (tmp_path / "bin" / "srun").write_text(
        f"#!/bin/bash\npython {holder} {run_dir / '.lock'} {pid_file} >/dev/null 2>&1 &\n"
        f"while [[ ! -s {pid_file} ]]; do sleep 0.1; done\necho srun-called; exit 2\n")
    try:
        p = subprocess.run(["bash", str(SBATCH), "tnl", "tiny"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120, env=env)
    finally:
        if pid_file.is_file():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert p.returncode == 2 and "srun-called" in p.stdout, p.stdout + p.stderr
    assert (run_dir / "slurm_attempt.json").read_text() == '{"job_id": "6"}'
    assert "is in use by another run" in p.stdout and '"slurm_job": "8"' in p.stdout, p.stdout


def test_a_restart_before_any_checkpoint_repeats_the_first_attempts_resume(outcomes):
    o, ref = outcome(outcomes, "resume_path_requeued_at_start"), outcome(outcomes, "reference")
    assert o.info["JobState"] == "COMPLETED" and o.info["Restarts"] == "1", o.log[-3000:]
    first, second = o.log.split("restart 1 (cap")
    assert "[test-stall]" in first and "got SIGTERM" in first and "no new checkpoint (newest: none)" in first
    assert "repeating the first attempt's --resume" in second, second[-3000:]
    assert f"resumed from {o.extra['ckpt']} at step {HOLD}" in second, second[-3000:]
    # the restart trained from PATH's step on: no step of its own before it
    assert sorted(losses(o.rows)) == list(range(HOLD + 1, STEPS + 1)), sorted(losses(o.rows))


@pytest.mark.parametrize("size", [("--ntasks", "2"), ("--ntasks", "3", "--nodes", "2"), ()])
def test_any_job_size_is_accepted(slurm_cluster, size):
    """The job's size comes from the submission alone: `--ntasks N` (without --ntasks-per-node) is a size
    Slurm can place, so the script must not pin nodes or tasks per node that sbatch would keep beside it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    p = subprocess.run(["sbatch", "--test-only", *size, str(SBATCH), "tnl", "tiny"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "to start at" in p.stderr, p.stderr


def test_hostfile_slots_follow_each_nodes_tasks(tmp_path):
    """--ntasks without --ntasks-per-node: Slurm spreads the tasks unevenly (SLURM_TASKS_PER_NODE "3,2(x2),1");
    each node gets its own count. GPUs on the node win where the job has them."""
    (tmp_path / "scontrol").write_text("#!/bin/bash\nprintf 'n1\\nn2\\nn3\\nn4\\n'\n")
    (tmp_path / "scontrol").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE"))}
    base.update(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="n[1-4]")
    script = str(ROOT / "launch" / "slurm" / "hostfile.sh")

    def lines(**env):
        return subprocess.run(["bash", script], env={**base, **env}, capture_output=True, text=True,
                              check=True).stdout.split("\n")[:-1]
    assert lines(SLURM_TASKS_PER_NODE="3,2(x2),1") == ["n1 slots=3", "n2 slots=2", "n3 slots=2", "n4 slots=1"]
    assert lines(SLURM_TASKS_PER_NODE="4(x4)", SLURM_GPUS_ON_NODE="8")[0] == "n1 slots=8"
    assert lines() == [f"n{i} slots=1" for i in range(1, 5)]

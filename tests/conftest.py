"""Test setup. TRITON_INTERPRET must be set before any module with @triton.jit is imported, so the
Triton kernels run (slowly, on tiny shapes) on a CPU-only machine."""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one intra-op thread per test process: the suite runs two workers, and many tests start ranks or Slurm
# jobs of their own, on machines of a few cores, where a second thread per process only oversubscribes them
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

# with 2 threads the first exp of a fresh process was once seen off by ~1e-4: warm it up
torch.exp(torch.zeros(1 << 16))


def _speed_up_triton_interpreter() -> None:
    """The Triton interpreter re-patches triton.language on every call of a nested @triton.jit helper
    (tens of ms each, most of a kernel test's time). Within one kernel run, patch once per module the
    helpers come from; the kernels compute exactly the same."""
    try:
        from triton.runtime import interpreter as it
        grid_call, fn_call = it.GridExecutor.__call__, it.InterpretedFunction.__call__
    except (ImportError, AttributeError):  # no Triton, or a version laid out differently: run as is
        return
    if getattr(it, "_linscale_fast", False):
        return
    state = {"depth": 0, "seen": set()}

    def run_grid(self, *args, **kwargs):
        if state["depth"] == 0:
            state["seen"] = set()
        state["depth"] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["depth"] -= 1

    def call_helper(self, *args, **kwargs):
        key = id(self.fn.__globals__)
        if not state["depth"] or key not in state["seen"]:
            if state["depth"]:
                state["seen"].add(key)
            return fn_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    it.GridExecutor.__call__, it.InterpretedFunction.__call__ = run_grid, call_helper
    it._linscale_fast = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _speed_up_triton_interpreter()

SHARED_DATA = Path(os.environ.get("LINSCALE_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """The shared data folder (shared/data beside the checkout's folder, or $LINSCALE_SHARED_DATA); tests that need real corpora skip without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (set LINSCALE_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local Slurm cluster (launch/slurm/local_cluster.sh): used if already up (CI starts it in .ci/run),
    else started here and stopped after; skipped only where Slurm cannot be installed and CI does not require it."""
    import shutil
    import subprocess
    script = ROOT / "launch" / "slurm" / "local_cluster.sh"
    if shutil.which("bash") is None or not script.is_file():
        pytest.skip("bash and launch/slurm/local_cluster.sh are needed for the local Slurm cluster")
    status = subprocess.run(["bash", str(script), "status"], capture_output=True, text=True)
    started = False
    if status.returncode != 0:
        up = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=600)
        if up.returncode == 3 and not os.environ.get("LINSCALE_REQUIRE_SLURM"):
            pytest.skip(f"Slurm cannot be installed or started here: {up.stderr.strip()[-500:]}")
        assert up.returncode == 0, f"local_cluster.sh up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}"
        started = True
    yield
    if started:
        subprocess.run(["bash", str(script), "down"], capture_output=True, text=True, timeout=300)


# The files that take longest (seconds of a run of the suite on two CPU workers), started first: pytest-xdist
# hands whole files to the workers in queue order, and by default it queues them by test count, which put
# one-test files of a minute at the end, where one worker then ran alone. Longest first, the two end together.
LONG_FILES = ("test_study_gpu_script.py", "test_slurm.py", "test_kernels.py", "test_study.py", "test_bad_inputs.py",
              "test_train_long_context.py", "test_train_distributed.py", "test_checkpoint_world_size.py",
              "test_checkpoint_resume.py", "test_scaling_fits.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # the controller's queue keeps the order of the items below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order

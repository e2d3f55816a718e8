"""The ops config (one object, no environment switches, recorded in the run config), the launch
plan's shape rule and its on-disk autotune cache, and what `import ops` tolerates (only a missing Triton)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ops
from ops import tuning
from ops.config import OpsConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_config():
    old = ops.get_config()
    yield
    ops.set_config(old)


def test_config_validates(restore_config):
    with pytest.raises(ValueError, match="impl 'cuda'"):
        ops.set_config(impl="cuda")
    with pytest.raises(ValueError, match="autotune"):
        ops.set_config(autotune="yes")
    for bad in (None, 5):
        with pytest.raises(ValueError, match="'tune_cache' must be a file path"):
            ops.set_config(tune_cache=bad)
    assert ops.set_config(impl="chunked").impl == "chunked" and ops.get_config().impl == "chunked"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT)


def test_no_environment_variable_selects_kernels():
    """The kernel switches are config (set_config, the run config's ops section), never the environment:
    with every variable that once chose kernels set, a fresh process still runs the defaults."""
    r = _python("import ops, dataclasses; print(dataclasses.asdict(ops.get_config()))",
                LINSCALE_OPS='{"impl": "recurrent", "autotune": true}', LINSCALE_OPS_IMPL="recurrent",
                LINSCALE_GLA_TRITON="0", LINSCALE_TUNE="1", LINSCALE_FUSED_BWD="0", LINSCALE_SCAN_STREAMS="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(OpsConfig().to_dict())


def test_environment_variables_are_documented_and_none_in_ops_or_models():
    """Every LINSCALE_* variable the code reads is on docs/environment.md; the ops and models read none."""
    import re
    read = {}
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".sh", ".sbatch") or "tests" in path.relative_to(ROOT).parts[:1] \
                or any(p.startswith(".") for p in path.relative_to(ROOT).parts):
            continue
        for name in re.findall(r"\bLINSCALE_[A-Z_]+", path.read_text(errors="replace")):
            read.setdefault(name, set()).add(path.relative_to(ROOT).parts[0])
    documented = set(re.findall(r"\bLINSCALE_[A-Z_]+", (ROOT / "docs" / "environment.md").read_text()))
    assert "LINSCALE_INJECT_NONFINITE" in read and "LINSCALE_TRACEBACK" in read  # the scan sees the code
    assert set(read) <= documented, sorted(set(read) - documented)
    assert not {n for n, where in read.items() if where & {"ops", "models"}}


def test_run_config_records_the_ops_section(tmp_path):
    from pretrain.config import config_from_dict, parse_config, save_config
    cfg = parse_config(["--arch", "hgrn2", "--size", "tiny", "--ops-impl", "chunked", "--ops-autotune",
                        "--ops-side-streams", "true"])
    assert cfg.ops == OpsConfig(impl="chunked", autotune=True, side_streams=True)
    save_config(cfg, tmp_path / "config.json")
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["ops"] == {"impl": "chunked", "gla_triton": True, "side_streams": True, "autotune": True,
                        "tune_cache": ""}
    assert config_from_dict(d).ops == cfg.ops
    from pretrain.errors import ConfigError
    with pytest.raises(ConfigError, match="--ops-impl 'fast': not allowed"):
        parse_config(["--ops-impl", "fast"])


def test_missing_triton_falls_back_but_a_broken_kernel_module_fails():
    no_triton = ("import sys; sys.modules['triton'] = None\n"
                 "import ops; print(ops.HAVE_TRITON, ops.available_impls('lightning_attn'))")
    r = _python(no_triton)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False ['chunked', 'recurrent']"
    pytest.importorskip("triton")
    # every kernel module: with Triton installed, one that does not import stops `import ops`
    for module in ("ops.triton_scan", "ops.triton_cross_entropy"):
        r = _python(f"import sys; sys.modules[{module!r}] = None\nimport ops", TRITON_INTERPRET="1")
        assert r.returncode != 0 and module in r.stderr, (module, r.stderr[-500:])
    # a kernel module that raises while importing (a renamed symbol, say) is not taken for a missing Triton
    renamed = ("import sys, importlib.abc\n"
               "class Broken(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'ops.triton_norm':\n"
               "            raise ImportError('cannot import name rms_norm_fwd_kernel')\n"
               "sys.meta_path.insert(0, Broken())\nimport ops")
    r = _python(renamed, TRITON_INTERPRET="1")
    assert r.returncode != 0 and "rms_norm_fwd_kernel" in r.stderr, r.stderr[-500:]


def _plan(monkeypatch, B, H, T, op="lightning", K=128, gpu=("NVIDIA H100 80GB HBM3", 132)):
    monkeypatch.setattr(tuning, "_gpu", lambda device: gpu)
    tuning._PLANS.clear()  # the in-process plan cache is keyed by device, which names one GPU in a real process
    return tuning.plan(op, B, H, T, K, 128, torch.device("cuda"), False)


@pytest.mark.parametrize("op", ["lightning", "gla"])
def test_shape_rule_splits_only_where_heads_leave_sms_idle(monkeypatch, op):
    few = _plan(monkeypatch, 1, 12, 32768, op)  # 48 fwd walk programs on 132 SMs
    assert few.layout == "split" and few.segments > 8
    assert few.seg_chunks >= tuning._MIN_SEG[op]
    full = _plan(monkeypatch, 16, 12, 2048, op)  # 768 fwd walk programs
    assert full.layout == "scan" and full.segments == 1
    assert _plan(monkeypatch, 16, 12, 32768, op).layout == "scan"  # long, but the programs fill the GPU
    short = _plan(monkeypatch, 1, 12, 256, op)  # 4 chunks: too short to split
    assert short.layout == "scan"
    assert _plan(monkeypatch, 2, 12, 1024, op).layout == "scan"  # 16 chunks: below the split's length
    # 2K: one or two sequences of 12 heads split into segments of 6 chunks (the short sequences' length),
    # 32 sequence-heads into segments of 8, eight sequences (2K training) stay whole
    for B in (1, 2):
        p2k = _plan(monkeypatch, B, 12, 2048, op)
        assert (p2k.seg_chunks, p2k.segments) == (6, 6), (B, p2k)
        assert p2k.seg_chunks >= tuning._SHORT_SEG
    assert _plan(monkeypatch, 1, 32, 2048, op).seg_chunks == tuning._MIN_SEG[op]
    assert _plan(monkeypatch, 1, 12, 2048, op, K=256).seg_chunks == tuning._MIN_SEG[op]  # cosFormer2's keys
    assert _plan(monkeypatch, 8, 12, 2048, op).layout == "scan"
    # from 64 chunks on every segment keeps the general minimum again
    assert _plan(monkeypatch, 2, 12, 4096, op).seg_chunks >= tuning._MIN_SEG[op]
    for B, H in ((1, 8), (2, 8), (1, 20), (2, 20), (4, 12), (3, 12)):
        for T in (4096, 8192, 65536):
            assert _plan(monkeypatch, B, H, T, op).seg_chunks >= tuning._MIN_SEG[op]
    # 8K at 1B's micro-batch of two sequences: 24 sequence-heads in 8 segments on either GPU
    assert _plan(monkeypatch, 2, 12, 8192, op).segments == 8
    assert _plan(monkeypatch, 2, 12, 8192, op, gpu=("NVIDIA H200", 132)).segments == 8
    # the H200's measured entries: one sequence of 12 heads in 16 segments, of 32 heads (7B) in 4
    assert _plan(monkeypatch, 1, 12, 32768, op, gpu=("NVIDIA H200", 132)).segments == 16
    assert _plan(monkeypatch, 1, 32, 8192, op, gpu=("NVIDIA H200", 132)).segments == 4
    # ... capped at segments of 8 chunks where the sequences are shorter than measured
    assert _plan(monkeypatch, 1, 12, 4096, op, gpu=("NVIDIA H200", 132)).seg_chunks == 8
    # a GPU with half the SMs splits less
    half = _plan(monkeypatch, 1, 12, 65536, op, gpu=("Some GPU", 66)).segments
    assert half < _plan(monkeypatch, 1, 12, 65536, op, gpu=("Some GPU", 132)).segments


def _wave_time(NH, nc, S, at_once):
    """The wave model written out by hand: waves of programs times chunks a segment, plus a cost per segment."""
    if S == 1:
        return nc
    sc = -(-nc // S)
    segs = -(-nc // sc)
    return -(-NH * segs // at_once) * sc + tuning._SEG_COST * segs


def test_wave_model_counts_waves_of_walk_programs():
    # 132 SMs x 8 walk warps / 16 warps a (sequence, head, segment) = 66 at once
    assert tuning._walk_warps(tuning.default_launch("lightning", 128, 128, torch.device("cpu")), 128) == 16
    assert tuning._walk_warps(tuning.default_launch("gla", 128, 128, torch.device("cpu")), 128) == 16
    for NH in (1, 8, 12, 20, 24, 33, 48, 64, 100, 192):
        for nc in (64, 128, 512, 1024):
            s = tuning._wave_segments(NH, nc, 132, 16, 8)
            if NH >= 66:  # a wave of the scan's programs fills the SMs: never split
                assert s == 1, (NH, nc, s)
                continue
            cands = [c for c in tuning._candidates(nc) if c == 1 or -(-nc // c) >= 8]
            times = {c: _wave_time(NH, nc, c, 66) for c in cands}
            assert times[s] == min(times.values()), (NH, nc, s, times)
    # 12 sequence-heads at 32K: 16 segments make 192 of 66 at once, three waves of 32 chunks
    assert tuning._wave_segments(12, 512, 132, 16, 8) == 16
    # 64 fill one wave: splitting adds waves as fast as it shortens them
    assert tuning._wave_segments(64, 512, 132, 16, 8) == 1


def _sweep_cells(*names):
    for name in names:
        data = json.loads((ROOT / "docs" / "bench_kernels" / name).read_text())
        for r in data["rows"]:
            ms = {int(s): t for s, t in r["ms"].items() if t == t}
            if r["T"] >= 4096 and ms:
                yield data["meta"]["device"], r, ms


@pytest.mark.parametrize("wave_only", [False, True])
def test_rule_against_the_committed_sweeps(monkeypatch, wave_only):
    """The S the rule picks, against the fwd+bwd GPU times of every candidate S measured by
    `launch/bench_kernels.py --sweep` (docs/bench_kernels): with the H200's measured entries within 0.5% of
    the fastest in every H200 cell; the wave model alone (the rule where nothing was measured) within 8% in
    every cell of both GPUs and within 1% in the median."""
    if wave_only:
        monkeypatch.setattr(tuning, "_MEASURED", {})
    ratios = []
    for device, r, ms in _sweep_cells("sweep-h200.json", "sweep-h200-heads.json", "sweep-gpu-time-h100.json"):
        if not wave_only and "H200" not in device:
            continue
        op = "gla" if r["op"].startswith("gla") else "lightning"
        K = 256 if r["op"] == "nodecay" else 128
        S = _plan(monkeypatch, r["B"], r["H"], r["T"], op, K=K, gpu=(device, 132)).segments
        assert S in ms, (r["op"], r["B"], r["H"], r["T"], S, sorted(ms))
        ratios.append(ms[S] / min(ms.values()))
        assert ratios[-1] <= (1.08 if wave_only else 1.005), (r["op"], r["B"], r["H"], r["T"], S, ms)
    assert len(ratios) >= (72 if wave_only else 54)
    assert sorted(ratios)[len(ratios) // 2] <= 1.01


def test_autotune_times_candidates_once_and_caches_per_gpu(monkeypatch, tmp_path, restore_config):
    cache = tmp_path / "tune.json"
    ops.set_config(autotune=True, tune_cache=str(cache))
    calls = []

    def measure(p):  # pretend 4 segments are fastest
        calls.append(p.segments)
        return abs(p.segments - 4) + 1.0
    monkeypatch.setattr(tuning, "_gpu", lambda device: ("GPU-A", 132))
    args = ("lightning", 1, 12, 8192, 128, 128, torch.device("cuda"), False)
    p = tuning.plan(*args, measure=measure)
    assert p.segments == 4 and p.source == "autotune" and 1 in calls and len(calls) > 2
    n = len(calls)
    tuning._PLANS.clear()  # the in-process plan cache: this checks the file
    assert tuning.plan(*args, measure=measure).segments == 4 and len(calls) == n  # from the cache
    stored = json.loads(cache.read_text())
    assert list(stored) == ["GPU-A"] and list(stored["GPU-A"].values()) == [p.seg_chunks]
    monkeypatch.setattr(tuning, "_gpu", lambda device: ("GPU-B", 132))
    tuning._PLANS.clear()  # in a process a device is one GPU: the in-process cache is keyed by device
    tuning.plan(*args, measure=measure)
    assert len(calls) > n  # another GPU: measured again


_KEY = "lightning|N1|H12|T8192|K128|V128|dense|gpu"  # the cache's key of _TUNE_ARGS
_TUNE_ARGS = ("lightning", 1, 12, 8192, 128, 128, torch.device("cuda"), False)


def _tune(monkeypatch, cache: Path, best: int = 4, gpu: str = "GPU-A", args: tuple = _TUNE_ARGS,
          measure=None) -> tuning.Plan:
    """An autotuned plan with `cache` as the tuning cache, on a faked GPU where `best` segments time fastest."""
    ops.set_config(autotune=True, tune_cache=str(cache))
    monkeypatch.setattr(tuning, "_gpu", lambda device: (gpu, 132))
    tuning._PLANS.clear()
    return tuning.plan(*args, measure=measure or (lambda p: abs(p.segments - best) + 1.0))


@pytest.mark.parametrize("content", [
    "{not json", '{"GPU-A": {"' + _KEY + '": 3', "", "\x00\xff\xfe",  # corrupt, truncated, empty, binary
    "[1, 2]", '{"GPU-A": [16]}', '"text"',                                  # JSON of another form
    *(json.dumps({"GPU-A": {_KEY: v}}) for v in ("16", {"seg_chunks": 16}, True, 0, -3, 2.5)),  # bad entries
])
def test_autotune_cache_of_another_form_is_timed_again_with_a_warning(monkeypatch, tmp_path, restore_config,
                                                                      content):
    """A cache the tuner cannot use (corrupt, truncated, another program's JSON, an entry that is no
    positive integer) never stops the run nor sets the layout: a warning names the file, the shape is
    timed again, and the file is rewritten valid with the timed entry."""
    cache = tmp_path / "tune.json"
    cache.write_bytes(content.encode("latin-1"))
    with pytest.warns(UserWarning, match=str(cache)):
        p = _tune(monkeypatch, cache)
    assert p.segments == 4 and p.source == "autotune"  # the timed best, not the entry's value
    stored = json.loads(cache.read_text())
    assert stored["GPU-A"][_KEY] == p.seg_chunks


def test_autotune_cache_entry_beyond_the_segment_memory_cap_is_timed_again(monkeypatch, tmp_path, restore_config):
    """An entry the tuner never stores (its segment states above _MAX_SEG_BYTES) is not run."""
    args = ("lightning", 64, 16, 8192, 128, 128, torch.device("cuda"), False)  # 128 chunks a sequence
    cache = tmp_path / "tune.json"
    key = "lightning|N64|H16|T8192|K128|V128|dense|gpu"
    cache.write_text(json.dumps({"GPU-A": {key: 1}}))  # 128 segments: 64*16*127*128*128*4 B = 8 GiB
    with pytest.warns(UserWarning, match="segment states"):
        p = _tune(monkeypatch, cache, best=1, args=args)
    assert p.segments == 1 and json.loads(cache.read_text())["GPU-A"][key] == 128


@pytest.mark.parametrize("fail", ["mkdir", "replace"])
def test_autotune_cache_that_cannot_be_written_warns_and_keeps_the_plan(monkeypatch, tmp_path, restore_config,
                                                                        fail):
    """A read-only home or a full quota costs later processes their timing only: the run goes on with
    the timed plan, a warning names the file, and no temporary file is left behind."""
    import errno
    cache = tmp_path / "sub" / "tune.json"
    if fail == "mkdir":
        def refuse(self, *a, **k):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        monkeypatch.setattr(Path, "mkdir", refuse)
    else:
        cache.parent.mkdir()
        def refuse(src, dst):
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(dst))
        monkeypatch.setattr(os, "replace", refuse)
    with pytest.warns(UserWarning, match=f"{cache} cannot be written"):
        p = _tune(monkeypatch, cache)
    assert p.segments == 4 and not cache.exists()
    assert not list(tmp_path.rglob("*.tmp*"))


@pytest.mark.parametrize("name", ["", "~/tune.json"])
def test_autotune_cache_without_a_home_directory_warns_and_keeps_the_plan(monkeypatch, tmp_path, restore_config,
                                                                         name):
    """A rank under a user id with no home directory (no HOME, no passwd entry) cannot resolve the default
    cache nor `~`: the timings stay in the process, with a warning, instead of stopping the step."""
    def no_home(*a, **k):
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.chdir(tmp_path)  # where a `~` taken literally would land
    monkeypatch.setattr(Path, "home", classmethod(no_home))
    monkeypatch.setattr(Path, "expanduser", no_home)
    with pytest.warns(UserWarning, match="no home directory"):
        p = _tune(monkeypatch, name)
    assert p.segments == 4 and p.source == "autotune"


def test_autotune_cache_path_expands_the_home(monkeypatch, tmp_path, restore_config):
    """`--ops-tune-cache ~/x.json` from a YAML file or `--flag=~/...` (no shell expansion) means the home's file,
    not a folder named `~` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    p = _tune(monkeypatch, "~/tune.json")
    assert json.loads((tmp_path / "home" / "tune.json").read_text())["GPU-A"][_KEY] == p.seg_chunks
    assert not (tmp_path / "~").exists()


def test_autotune_cache_concurrent_writers_keep_every_entry_and_a_whole_file(monkeypatch, tmp_path,
                                                                            restore_config):
    """Ranks on several hosts share the cache (a network home) and may have the same process id: two
    writers at once must neither collide on a temporary file nor leave half a file; an entry another rank
    stored while this one was timing is kept."""
    cache = tmp_path / "tune.json"
    monkeypatch.setattr(os, "getpid", lambda: 4242)  # the other host's rank has the same pid
    other = ("lightning", 2, 12, 8192, 128, 128, torch.device("cuda"), False)
    other_key = "lightning|N2|H12|T8192|K128|V128|dense|gpu"
    real_replace = os.replace
    nested = []

    def replace(src, dst):  # the other rank writes its entry between this rank's write and its rename
        if not nested:
            nested.append(1)
            cfg = ops.get_config()
            tuning._PLANS.clear()
            tuning.plan(*other, measure=lambda p: abs(p.segments - 2) + 1.0)
            ops.set_config(cfg)
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    p = _tune(monkeypatch, cache)
    stored = json.loads(cache.read_text())  # a whole file
    assert stored["GPU-A"][_KEY] == p.seg_chunks and not list(tmp_path.glob(".*tmp*"))
    # an entry another rank stored while this one timed its candidates survives this one's write
    monkeypatch.setattr(os, "replace", real_replace)
    args3 = ("lightning", 4, 12, 8192, 128, 128, torch.device("cuda"), False)
    timed = []

    def measure(plan):
        if not timed:  # the other rank finishes its shape during this rank's timing
            cache.write_text(json.dumps({"GPU-A": {_KEY: p.seg_chunks, other_key: 64}}))
        timed.append(plan)
        return abs(plan.segments - 4) + 1.0
    _tune(monkeypatch, cache, args=args3, measure=measure)
    stored = json.loads(cache.read_text())["GPU-A"]
    assert stored[other_key] == 64 and stored[_KEY] == p.seg_chunks
    assert "lightning|N4|H12|T8192|K128|V128|dense|gpu" in stored


def test_autotune_of_packed_input_past_the_segment_memory_cap_keeps_one_segment_length(monkeypatch, tmp_path,
                                                                                        restore_config):
    """Packed input of many sequences: every split exceeds the segment-state cap; the tuner returns the
    rule's plan at that point (segments of the mean sequence's length), as the rule does, not nothing."""
    args = ("lightning", 64, 16, 64 * 2048, 128, 128, torch.device("cuda"), True)
    p = _tune(monkeypatch, tmp_path / "tune.json", args=args)
    monkeypatch.setattr(ops.get_config(), "autotune", False)
    tuning._PLANS.clear()
    rule = tuning.plan(*args)
    assert (p.seg_chunks, p.segments) == (rule.seg_chunks, rule.segments) == (32, 64)


def test_plans_follow_the_config_not_the_config_objects_id(monkeypatch, tmp_path, restore_config):
    """A new config whose object takes the id of a freed one gets the plan of its own setting: the rule
    with autotune off, the timed plan with it on."""
    monkeypatch.setattr(tuning, "_gpu", lambda device: ("GPU-A", 132))
    for i in range(12):  # set_config frees the previous object: its id comes back every second call
        auto = i % 4 < 2
        ops.set_config(autotune=auto, tune_cache=str(tmp_path / f"tune{i}.json"))
        p = tuning.plan(*_TUNE_ARGS, measure=lambda p: abs(p.segments - 4) + 1.0)
        assert p.source == ("autotune" if auto else "rule"), i
        assert (tmp_path / f"tune{i}.json").exists() == auto, i  # timed into its own cache


class _FakeGpu:
    """A CUDA stream and a host clock in simulated milliseconds, enough for `tuning.gpu_ms`: the GPU runs
    the enqueued work in order (a `_sleep` of c cycles takes c / cycles_per_ms), an event completes when
    the GPU reaches it, and the host advances only by the work its calls do (or by waiting on the GPU)."""

    def __init__(self, cycles_per_ms: float):
        self.cycles_per_ms, self.now, self.free_at = cycles_per_ms, 0.0, 0.0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = max(fake.free_at, fake.now)

            def query(self):
                return fake.now >= self.t

            def synchronize(self):
                fake.now = max(fake.now, self.t)

            def elapsed_time(self, other):
                return other.t - self.t
        self.Event = Event

    def _sleep(self, cycles: int) -> None:
        self.run(cycles / self.cycles_per_ms)

    def run(self, ms: float) -> None:  # enqueue work that takes the GPU ms
        self.free_at = max(self.free_at, self.now) + ms

    def synchronize(self) -> None:
        self.now = max(self.now, self.free_at)

    def perf_counter(self) -> float:
        return self.now / 1e3


@pytest.fixture
def fake_gpu(monkeypatch):
    import types
    gpu = _FakeGpu(cycles_per_ms=1.98e6)
    cuda = types.SimpleNamespace(Event=gpu.Event, _sleep=gpu._sleep, synchronize=gpu.synchronize)
    monkeypatch.setattr(tuning, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=gpu.perf_counter))
    monkeypatch.setattr(tuning, "_CYCLES_PER_MS", [])
    return gpu


def test_gpu_ms_hides_the_host_even_with_a_stale_clock_calibration(fake_gpu):
    """gpu_ms on a simulated stream: a call of 5 ms host work around 0.02 ms of GPU work times as 0.02 ms,
    with the sleep calibrated right and calibrated 50x too low (as at idle clocks: every first sleep too short
    to hide the host, so those batches must run again behind longer ones, not count); a GPU-bound call
    times as its GPU work; a call that waits for the GPU can never be hidden and is refused."""
    def host_bound():
        fake_gpu.now += 5.0
        fake_gpu.run(0.02)

    def gpu_bound():
        fake_gpu.now += 0.01
        fake_gpu.run(3.0)
    assert tuning.gpu_ms(host_bound, calls=4) == pytest.approx(0.02)
    assert tuning._CYCLES_PER_MS == [pytest.approx(1.98e6)]  # calibrated on the stream
    assert tuning.gpu_ms(gpu_bound) == pytest.approx(3.0)
    tuning._CYCLES_PER_MS[:] = [1.98e6 / 50]
    assert tuning.gpu_ms(host_bound, calls=4, reps=5) == pytest.approx(0.02)

    def synchronising():
        host_bound()
        fake_gpu.synchronize()
    with pytest.raises(RuntimeError, match="never finished enqueuing"):
        tuning.gpu_ms(synchronising)


@pytest.mark.parametrize("over,match", [
    ({"fwdd": {"num_warps": 4}}, "unknown kernel 'fwdd'; the kernels are "),
    ({"fwd": {"num_warp": 4}},
     r"fwd: unknown key 'num_warp'; the keys are block, block_v, num_warps, num_stages, maxnreg"),
    ({"A_sub": {"split": True}}, "A_sub: unknown key 'split'"),
    ({"dq": {"block": 48}}, r"dq.block = 48; expected a power of two in \[1, 256\]"),
    ({"dq": {"num_warps": 3}}, r"dq.num_warps = 3; expected a power of two"),
    ({"dq": {"num_stages": 0}}, r"dq.num_stages = 0; expected an integer in \[1, 8\]"),
    ({"dq": {"num_stages": True}}, "dq.num_stages = True"),
    ({"A_sub": {"maxnreg": 300}}, r"A_sub.maxnreg = 300; expected an integer in \[32, 255\]"),
    ({"A_sub": {"maxnreg": 16}}, r"A_sub.maxnreg = 16; expected an integer in \[32, 255\]"),
    ({"A_sub": {"key_blocks": 2}}, "A_sub.key_blocks: only dqk_sub reads key_blocks"),
    ({"dqk_sub": {"key_blocks": 3}}, r"dqk_sub.key_blocks = 3; expected a power of two in \[1, 16\]"),
    ({"dq": 4}, "dq: expected {key: value}"),
])
def test_launch_overrides_are_checked(over, match):
    """A misspelt kernel or key in a launch override (the test seam, bench_kernels --launch / --launches)
    is refused by name instead of being ignored, which would time the defaults under a variant's name."""
    from ops import tuning
    from ops.testing import force_plan
    with pytest.raises(ValueError, match=match):
        tuning.check_launch_overrides(over)
    with pytest.raises(ValueError, match=match):
        with force_plan(seg_chunks=2, launch=over):
            pass
    assert tuning._FORCED == {}  # a refused call sets nothing, not even its valid arguments


def test_launch_overrides_accept_every_default():
    """Every kernel's default config passes the check (the checked keys and ranges cover what the
    defaults use), for both ops and the head widths the kernels take."""
    import torch
    from ops import tuning
    for op, K, V in [("lightning", 128, 128), ("lightning", 256, 256), ("lightning", 48, 48), ("gla", 512, 128),
                     ("gla", 128, 128)]:
        tuning.check_launch_overrides(tuning.default_launch(op, K, V, torch.device("cpu")))


def test_lightning_narrow_launch_configs_only_where_swept():
    """The narrow walk configs (32-wide value blocks at 4 warps in the forward and dv walks, 3 stages in
    dq / dk / seg_local) apply to lightning at keys padded to 128, where they were measured; other key
    widths and GLA keep the general rule (wide tiles at 8 warps where K or V is 128 or more)."""
    import torch
    from ops import tuning
    cpu = torch.device("cpu")
    tnl = tuning.default_launch("lightning", 128, 128, cpu)
    assert [(tnl[n]["block"], tnl[n]["num_warps"]) for n in ("fwd", "dv")] == [(32, 4), (32, 4)]
    assert [tnl[n]["num_stages"] for n in ("dq", "dk", "local")] == [3, 3, 3]
    for op, K, V in [("lightning", 64, 128), ("lightning", 32, 256), ("gla", 128, 128)]:
        rule = tuning.default_launch(op, K, V, cpu)
        assert [(rule[n]["block"], rule[n]["num_warps"]) for n in ("fwd", "dv")] == [(64, 8), (64, 8)], (op, K, V)
        assert [rule[n]["num_stages"] for n in ("dq", "dk", "local")] == [2, 2, 2], (op, K, V)
    cos2 = tuning.default_launch("lightning", 256, 128, cpu)  # keys over 128: dv at 4 warps, stages 2
    assert (cos2["fwd"]["num_warps"], cos2["dv"]["num_warps"], cos2["dq"]["num_stages"]) == (8, 4, 2)

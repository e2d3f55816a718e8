"""The study runner (launch/study.py, scaling/study/): config checks, the plan against the FLOPs formulas, a
whole study end to end on CPU in local mode (train -> export -> evaluate -> fit -> report), finished work
skipped on a second run, a stopped study continued to the same losses as an uninterrupted one, and the Slurm
job arrays and dependencies it submits (with stand-ins for sbatch/squeue)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from checkpoint_utils import make_dataset

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "launch" / "study.py"
SHAPES = {"a": (1, 32, 2, 64), "b": (2, 64, 2, 128)}


def study_yaml(tmp: Path, data: Path, name: str = "t", tokens=1920, **extra) -> Path:
    cfg = {
        "name": name, "out": str(tmp / name), "data": str(data), "archs": ["llama", "hgrn2"],
        "sizes": [{"name": k, **dict(zip(("n_layers", "d_model", "n_heads", "d_glu"), v))} for k, v in SHAPES.items()],
        "tokens": tokens, "seq_len": 16, "global_batch_tokens": 96, "model": {"vocab_size": 256},
        "recipe": {"train": {"micro_batch": 6, "log_every": 1, "device": "cpu"}, "ops": {"impl": "chunked"},
                   "optim": {"lr": 3e-3, "warmup_steps": 3}, "checkpoint": {"save_every": 0}},
        "snapshots": {"log_points": 2},
        "evaluation": {"tasks": ["valid_loss"], "valid_windows": 4, "batch_size": 4},
        "fit": {"args": ["--n-boot", "20"]},
    }
    cfg.update(extra)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def study(*args, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, str(STUDY), *map(str, args)], env=env(), capture_output=True, text=True,
                         timeout=900, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"launch/study.py {' '.join(map(str, args))} exited {res.returncode}:\n"
                             f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[int, float] = {}
    for r in rows:
        out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


# -- config and plan ------------------------------------------------------------------------------------

def test_plan_follows_the_paper_flops_formulas(tmp_path, dataset):
    from scaling.study import load_study, plan_study
    cfg = load_study(study_yaml(tmp_path, dataset, tokens={"a": 1000, "b": 2000}))
    plans = {p.name: p for p in plan_study(cfg)}
    assert list(plans) == ["llama-a", "hgrn2-a", "llama-b", "hgrn2-b"]
    b, n, v = 96 // 16, 16, 256
    for p in plans.values():
        l, d, h, g = SHAPES[p.size]
        steps = math.ceil((1000 if p.size == "a" else 2000) / 96)
        assert (p.steps, p.tokens, p.tokens_per_step) == (steps, steps * 96, 96)
        if p.arch == "llama":  # the paper's LLaMA count, written out here
            per_step_ne = b * l * (24 * n * d * d + 12 * n * n * d + 9 * n * n * h + 18 * n * d * g + 3 * n * g)
            assert p.n_params == 4 * l * d * d + 3 * l * d * g
        else:
            e = d // h
            c = 8 * n * d * d + 4 * n * d * d / h + n * d * d / (e * h) + 4 * n * e * d + n * e * h + 5 * n * d
            per_step_ne = b * l * (3 * c + 18 * n * d * g + 3 * n * g) + 12 * d * l
            assert p.n_params == 4 * l * d * d + 3 * l * d * g + l * d
        assert p.flops_non_embedding == pytest.approx(steps * per_step_ne, rel=1e-12)
        assert p.flops - p.flops_non_embedding == pytest.approx(steps * 12 * b * n * d * v, rel=1e-12)
        # two log-spaced points from the first step, and the last step
        assert p.snapshot_steps[0] == 1 and p.snapshot_steps[-1] == steps and len(p.snapshot_steps) == 3
    # the flags parse to exactly this run
    from pretrain.config import parse_config
    rc = parse_config(plans["hgrn2-b"].argv)
    assert (rc.arch, rc.model().n_layers, rc.model().d_model, rc.model().size) == ("hgrn2", 2, 64, "b")
    assert (rc.train.max_steps, rc.train.seq_len, rc.optim.lr, rc.ops.impl) == (21, 16, 3e-3, "chunked")
    out = study("plan", "--config", tmp_path / "t.yaml").stdout
    assert "llama-a" in out and "total compute" in out and "PFLOP-days" in out


def test_plan_snapshot_steps_are_the_schedule_s_without_walking_every_step():
    """The plan's snapshot steps equal the checkpoint manager's schedule tested step by step (its due(), as the
    trainer asks it after every step), and a budget of 1e8+ steps (a mistyped one: 4e12 tokens for 4e6) plans
    at once instead of stalling the plan."""
    import itertools
    import time

    from checkpoints.schedule import SnapshotSchedule
    from scaling.study.plan import snapshot_steps
    for every, log_points, per_step, steps in itertools.product((0, 1, 7, 96, 100, 1000), (0, 1, 3, 8),
                                                                  (1, 16, 96, 97), (1, 2, 5, 37, 200)):
        if every or log_points:
            sched = SnapshotSchedule(every, log_points, per_step, steps * per_step)
            due = [s for s in range(1, steps + 1) if sched.due((s - 1) * per_step, s * per_step)]
            assert sched.steps(steps) == due
            expected = sorted(set(due) | {steps})
            assert snapshot_steps(every, log_points, per_step, steps) == expected, (every, log_points, per_step, steps)
    t0 = time.perf_counter()
    got = snapshot_steps(0, 8, 96, 3 * 10**7)
    assert time.perf_counter() - t0 < 2.0
    assert got[0] == 1 and got[-1] == 3 * 10**7 and len(got) == 9


def test_a_run_can_have_a_budget_of_its_own(tmp_path, dataset):
    """tokens: {size: n, arch-size: m}: the arch-size entry sets that one run's budget, the size's the others'."""
    from pretrain.config import parse_config
    from scaling.study import load_study, plan_study
    cfg = load_study(study_yaml(tmp_path, dataset, tokens={"a": 960, "b": 1920, "HGRN2-a": 2880}))
    plans = {p.name: p for p in plan_study(cfg)}
    assert {n: (p.tokens_budget, p.steps) for n, p in plans.items()} == {
        "llama-a": (960, 10), "hgrn2-a": (2880, 30), "llama-b": (1920, 20), "hgrn2-b": (1920, 20)}
    rc = parse_config(plans["hgrn2-a"].argv)
    assert (rc.train.max_steps, rc.train.max_tokens) == (30, 2880)
    assert plans["hgrn2-a"].snapshot_steps[-1] == 30


def test_registry_sizes_follow_the_study_recipe_not_the_cpu_presets(tmp_path, dataset):
    from scaling.study import load_study, plan_study
    path = study_yaml(tmp_path, dataset, sizes=["tiny"], tokens=96 * 300, archs=["tnl"])
    p = plan_study(load_study(path))[0]
    from pretrain.config import parse_config
    rc = parse_config(p.argv)
    # the tiny preset would stop at 200 steps with lr 3e-3 and no snapshots
    assert (rc.train.max_steps, rc.checkpoint.snapshot_log_points, rc.optim.warmup_steps) == (300, 2, 3)
    assert p.size == "tiny" and rc.model().size == "tiny"


@pytest.mark.parametrize("change, message", [
    ({"colour": 1}, "unknown key"),
    ({"sizes": ["huge"]}, "not a registry size"),
    ({"sizes": [{"name": "x", "n_layers": 2, "d_model": 60, "n_heads": 7, "d_glu": 3}]}, "does not divide"),
    ({"tokens": {"a": 100}}, "missing ['b']"),
    ({"tokens": {"a": 100, "llama-b": 200}}, "missing ['b']"),
    ({"tokens": {"a": 100, "b": 100, "tnl-a": 200}}, "neither a size nor an arch-size of this study: ['tnl-a']"),
    ({"tokens": None}, "tokens is required"),
    ({"recipe": {"train": {"seq_len": 8}}}, "use the study key 'seq_len'"),
    ({"recipe": {"train": {"bogus": 1}}}, "not a field of the pretrain config"),
    ({"global_batch_tokens": 100}, "not a whole number of sequences"),
    ({"per_run": {"gpt": {}}}, "not an arch, a size or an arch-size"),
    ({"evaluation": {"tasks": ["mmlu"]}}, "unknown ['mmlu']"),
    ({"evaluation": {"tasks": []}}, "evaluation.tasks is empty"),
    ({"evaluation": {"tasks": ["valid_loss"], "snapshots": False}}, "evaluation.snapshots False: choose all, final, "
                                                                    "or a number"),
    ({"snapshots": {"log_points": 0}}, "no run would leave a snapshot"),
    ({"archs": ["mamba"]}, "unknown arch"),
    ({"archs": [1]}, "archs must be a list of names"),
    ({"sizes": [{"name": "p/x", "n_layers": 1, "d_model": 32, "n_heads": 2, "d_glu": 64}]}, "without spaces or slashes"),
    ({"per_run": ["llama"]}, "per_run must be a mapping"),
    ({"fit": {"args": [1, 2]}}, "as strings"),
    ({"evaluation": {"tasks": ["valid_loss"], "device": "gpu9"}}, "evaluation.device 'gpu9'"),
    # the run's own --micro-batch comes after pretrain.sbatch's: MICRO here would silently not apply
    ({"slurm": {"train_env": {"MICRO": 4, "NCCL_DEBUG": "WARN"}}}, "sets MICRO, which the study sets for each run "
                                                                 "from its plan; set MICRO with recipe.train.micro_batch"),
])
def test_bad_configs_are_clear_errors(tmp_path, dataset, change, message):
    from scaling.study import StudyConfigError, load_study
    path = study_yaml(tmp_path, dataset, **change)
    with pytest.raises(StudyConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_study(path)


def test_a_recipe_value_pretrain_rejects_is_one_error_naming_the_field(tmp_path, dataset):
    """A recipe value of the wrong type reaches pretrain's argparse, which would print pretrain's whole usage
    under study.py's name: the study says which field of which run, in one line, and exits 2."""
    from scaling.study import load_study, plan_study
    path = study_yaml(tmp_path, dataset)
    with pytest.raises(ValueError, match=re.escape("run llama-a: optim.lr (recipe or per_run; pretrain flag --lr): "
                                                   "invalid float value: 'abc'")):
        plan_study(load_study(path, overrides=["recipe.optim.lr=abc"]))
    res = study("plan", "--config", path, "--set", "per_run.hgrn2-b.optim.lr=abc", check=False)
    assert res.returncode == 2 and "usage:" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: study config: run hgrn2-b: optim.lr (recipe or per_run; pretrain flag --lr): invalid float value: 'abc'"]


def test_overrides_replace_keys_of_the_file_and_are_checked_like_them(tmp_path, dataset):
    """`--set KEY=VALUE` (a dry run of the real config at a small scale): dotted keys into nested mappings, values
    read as YAML, later ones win, the file itself untouched; a bad key or value is the file's own error."""
    from scaling.study import StudyConfigError, load_study, plan_study
    path = study_yaml(tmp_path, dataset, tokens={"a": 1000, "b": 2000})
    text = path.read_text()
    cfg = load_study(path, overrides=["sizes=[{name: a, n_layers: 1, d_model: 32, n_heads: 2, d_glu: 64}]", "tokens=4e3", "recipe.train.micro_batch=3",
                                        "evaluation.limit=5", "per_run.hgrn2.optim.lr=2.0e-3", "out=elsewhere",
                                        "tokens=500"])
    assert [s.name for s in cfg.sizes] == ["a"] and cfg.tokens == {"a": 500}
    assert cfg.recipe["train.micro_batch"] == 3 and cfg.recipe["optim.lr"] == 3e-3
    assert cfg.per_run["hgrn2"] == {"optim.lr": 2e-3} and cfg.evaluation.limit == 5
    assert cfg.out == Path.cwd() / "elsewhere" and path.read_text() == text
    plans = {p.name: p for p in plan_study(cfg)}
    assert list(plans) == ["llama-a", "hgrn2-a"] and plans["llama-a"].steps == math.ceil(500 / 96)
    for bad, message in [("colour=1", "unknown key"), ("tokens", "write KEY=VALUE"), ("=3", "write KEY=VALUE"),
                         ("seq_len.x=1", "is 16, not a mapping"), ("sizes=[huge]", "not a registry size"),
                         ("tokens=[1", "not valid YAML")]:
        with pytest.raises(StudyConfigError, match=re.escape(message)):
            load_study(path, overrides=[bad])
    # Slurm jobs load the config again: they get the same overrides
    from scaling.study.slurm import report_script, stage_script
    cfg = load_study(path, overrides=["tokens=500", "evaluation.limit=5"])
    for script in (stage_script(cfg, plan_study(cfg), "evaluate", ("export", "evaluate")), report_script(cfg)):
        assert "--set tokens=500 --set evaluation.limit=5" in script
    res = study("plan", "--config", path, "--set", "sizes=[tiny]", "--set", "archs=[hgrn2]", "--set", "tokens=960")
    assert "hgrn2-tiny" in res.stdout and "llama" not in res.stdout and "hgrn2-a" not in res.stdout
    res = study("plan", "--config", path, "--set", "recipe.train.bogus=1", check=False)
    assert res.returncode == 2 and "recipe.train.bogus is not a field" in res.stderr


def test_report_without_a_fit_still_reports(tmp_path, dataset):
    """A fit that fails (here fit.args that launch/fit_scaling.py rejects; in a dry run, runs too short to fit)
    leaves the rest of the report: the status, the evaluation, and the fit's own error in report.md."""
    from scaling.study import load_study, plan_study
    from scaling.study.report import report_dir, write_report
    cfg = load_study(study_yaml(tmp_path, dataset, fit={"args": ["--bogus-flag"]}))
    plans = plan_study(cfg)
    plans[0].run_dir.mkdir(parents=True)
    (plans[0].run_dir / "metrics.jsonl").write_text("")
    (plans[0].run_dir / "summary.json").write_text(json.dumps({"stop": "finished", "step": plans[0].steps}))
    (report_dir(cfg)).mkdir(parents=True)
    (report_dir(cfg) / "fits.json").write_text("{}")          # from an earlier report: must not be shown as current
    path = write_report(cfg, plans, "STATUS TABLE", log=lambda m: None)
    text = path.read_text()
    assert "STATUS TABLE" in text and "The fit failed" in text and "--bogus-flag" in text
    assert not (report_dir(cfg) / "fits.json").exists()
    assert "unrecognized arguments: --bogus-flag" in (report_dir(cfg) / "fit_console.txt").read_text()


@pytest.mark.parametrize("fit_args", [[], ["--bogus-flag"]])
def test_a_report_without_a_new_fit_shows_no_earlier_fit(tmp_path, dataset, fit_args):
    """An earlier report's fit outputs (fits.json, table3.md, the Figure-1 plots) are not the current fit's when
    this report fits nothing (no run trained to its planned step, e.g. after raising the budget) or the fit
    fails: they are removed, and report.md embeds no scaling plot."""
    from scaling.study import load_study, plan_study
    from scaling.study.report import report_dir, write_report
    cfg = load_study(study_yaml(tmp_path, dataset, fit={"args": fit_args}))
    plans = plan_study(cfg)
    plans[0].run_dir.mkdir(parents=True)
    (plans[0].run_dir / "metrics.jsonl").write_text('{"step": 1, "tokens": 96, "loss": 5.0}\n')
    (plans[0].run_dir / "summary.json").write_text(json.dumps({"stop": "finished", "step": plans[0].steps - 1}))
    out = report_dir(cfg)
    (out / "plots").mkdir(parents=True)
    stale = [out / "fits.json", out / "table3.md", out / "plots" / "scaling_llama.png",
             out / "plots" / "scaling_compare.png"]
    for f in stale:                                            # from an earlier report of a finished study
        f.write_text("{}" if f.suffix == ".json" else "earlier fit")
    text = write_report(cfg, plans, "STATUS TABLE", log=lambda m: None).read_text()
    assert [f for f in stale if f.exists()] == []
    assert "scaling_" not in text and "Table 3" not in text.replace("Table 3 style)", "")
    assert f"Left out of the scaling-law fit, not trained to their planned step: {plans[0].name}" in text


def test_only_runs_trained_to_their_planned_step_are_fitted(tmp_path, dataset):
    """A run that failed, was stopped or still trains has logged rows up to where it ended: the fit leaves it
    out (its truncated curve would end the envelope early and fake a handover), and the report names it."""
    from scaling.study import load_study, plan_study
    from scaling.study.report import report_dir, write_report
    cfg = load_study(study_yaml(tmp_path, dataset, fit={"args": ["--bogus-flag"]}))
    plans = plan_study(cfg)
    done, failed, stopped = plans[0], plans[1], plans[2]
    for p in (done, failed, stopped):
        p.run_dir.mkdir(parents=True)
        (p.run_dir / "metrics.jsonl").write_text('{"step": 1, "tokens": 96, "loss": 5.0}\n')
    (done.run_dir / "summary.json").write_text(json.dumps({"stop": "finished", "step": done.steps}))
    (stopped.run_dir / "summary.json").write_text(json.dumps({"stop": "signal", "step": 1}))
    logged: list[str] = []
    text = write_report(cfg, plans, "STATUS TABLE", log=logged.append).read_text()
    fit_call = next(m for m in logged if "fit_scaling.py" in m)   # the fit's command line (it fails on --bogus-flag)
    assert str(done.run_dir) in fit_call
    assert str(failed.run_dir) not in fit_call and str(stopped.run_dir) not in fit_call
    assert f"Left out of the scaling-law fit, not trained to their planned step: {failed.name}, {stopped.name}" in text


# -- a whole study, locally -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_study(tmp_path_factory, dataset):
    tmp = tmp_path_factory.mktemp("study")
    path = study_yaml(tmp, dataset)
    res = study("run", "--config", path)
    return tmp, path, res


def test_local_study_trains_evaluates_fits_and_reports(finished_study):
    tmp, path, res = finished_study
    out = tmp / "t"
    from scaling.study import load_study, plan_study
    plans = plan_study(load_study(path))
    for p in plans:
        steps = losses(p.run_dir)
        assert sorted(steps) == list(range(1, p.steps + 1)), p.name       # every step logged once
        summary = json.loads((p.run_dir / "summary.json").read_text())
        assert summary["stop"] == "finished" and summary["step"] == p.steps
        snaps = sorted(d.name for d in (p.run_dir / "exports").iterdir())
        assert snaps == [f"step_{s:08d}" for s in p.snapshot_steps], p.name
        ev = json.loads((out / "eval" / p.name / "results.json").read_text())["snapshots"]
        assert [r["step"] for r in ev] == p.snapshot_steps
        vl = [r["results"]["valid_loss"]["loss"] for r in ev]
        assert all(math.isfinite(x) for x in vl) and vl[-1] < vl[0]     # the model learned
    fits = json.loads((out / "report" / "fits.json").read_text())
    assert set(fits["archs"]) == {"llama", "hgrn2"}
    for a in fits["archs"].values():
        assert a["alpha"] < 0 and len(a["sizes"]) == 2
    report = (out / "report" / "report.md").read_text()
    assert "Table 3" in report and "llama-b" in report and "Lowest loss at equal compute" in report
    for png in ("plots/scaling_llama.png", "plots/scaling_hgrn2.png", "plots/scaling_compare.png",
                "metrics_vs_compute.png"):
        assert (out / "report" / png).stat().st_size > 10_000, png
    rows = (out / "report" / "eval" / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + sum(len(p.snapshot_steps) for p in plans)
    status = study("status", "--config", path).stdout
    assert "4/4 runs trained and evaluated" in status
    # the last lines say what this command did and where the results are
    tail = res.stdout[res.stdout.index("[study] summary:"):].splitlines()
    assert tail[0].startswith("[study] summary: 4 of 4 run(s) through train, export, evaluate in "), tail
    assert f"  report: {out / 'report' / 'report.md'}" in tail and "failed" not in tail[0]
    assert any(x.startswith(f"  runs: {out / 'runs'}/<run>/") for x in tail)


def test_second_run_skips_finished_work(finished_study):
    tmp, path, _ = finished_study
    out = tmp / "t"
    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/exports/*/model.safetensors")}
    metrics = {p: p.read_text() for p in out.glob("runs/*/metrics.jsonl")}
    cache = {p: p.stat().st_mtime_ns for p in out.glob("eval/*/cache/*/*/*.json")}
    res = study("run", "--config", path, "--no-report")
    assert res.stdout.count("skipped") >= 4 and "training to" not in res.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/exports/*/model.safetensors")} == before
    assert {p: p.read_text() for p in out.glob("runs/*/metrics.jsonl")} == metrics
    assert {p: p.stat().st_mtime_ns for p in cache} == cache
    assert "0 to run" in res.stdout and "1 to run" not in res.stdout


def test_stopped_study_continues_to_the_losses_of_an_uninterrupted_one(finished_study, dataset):
    """SIGTERM (a scheduler's stop) in the middle of the first run's training: it checkpoints and the study
    ends with status 3; `run` again continues, and every run's per-step losses equal the uninterrupted
    study's bitwise."""
    import signal
    import time
    tmp, _, _ = finished_study
    path = study_yaml(tmp, dataset, name="u")
    proc = subprocess.Popen([sys.executable, str(STUDY), "run", "--config", str(path)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp / "u" / "runs" / "llama-a" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 6:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, out[-3000:]
    assert "stopped" in study("status", "--config", path).stdout
    assert not (tmp / "u" / "runs" / "hgrn2-a").exists()   # the study ended with the stopped run
    study("run", "--config", path)
    for name in ("llama-a", "hgrn2-a", "llama-b", "hgrn2-b"):
        assert losses(tmp / "u" / "runs" / name) == losses(tmp / "t" / "runs" / name), name


def test_ctrl_c_outside_training_is_a_stop_not_a_failure(tmp_path, dataset):
    """Ctrl-C during export or evaluation reaches the stage as KeyboardInterrupt: its record says stopped, and
    `status` does not show the run as failed (the stage runs again with the next `run`)."""
    from scaling.study import load_study, plan_study
    from scaling.study.stages import EXPORT, TRAIN, read_state, tracked
    from scaling.study.status import run_status
    cfg = load_study(study_yaml(tmp_path, dataset))
    plan = plan_study(cfg)[0]

    def interrupted(*_):
        raise KeyboardInterrupt
    for stage in (TRAIN, EXPORT):
        with pytest.raises(KeyboardInterrupt):
            tracked(cfg, plan.name, stage, interrupted)
        assert read_state(cfg, plan.name, stage)["status"] == "stopped"
    status = run_status(cfg, plan)
    assert status.train == "stopped" and "KeyboardInterrupt" not in status.note, status


def test_deadline_stops_before_the_next_stage(tmp_path, dataset):
    res = study("run", "--config", study_yaml(tmp_path, dataset), "--deadline", "0", check=False)
    assert res.returncode == 3 and "stopped (deadline)" in res.stdout
    assert not (tmp_path / "t" / "runs").exists()


def test_larger_budget_continues_the_runs(finished_study, dataset):
    """Raising the token budget of one size continues those runs from their final checkpoints."""
    tmp, path, _ = finished_study
    cfg = yaml.safe_load(path.read_text())
    cfg["tokens"] = {"a": 1920, "b": 2400}
    path.write_text(yaml.safe_dump(cfg))
    before = {n: losses(tmp / "t" / "runs" / n) for n in ("llama-a", "llama-b")}
    res = study("run", "--config", path, "--no-report", "--stages", "train")
    assert res.stdout.count("training to 25 steps") == 2
    assert losses(tmp / "t" / "runs" / "llama-a") == before["llama-a"]
    after = losses(tmp / "t" / "runs" / "llama-b")
    assert sorted(after) == list(range(1, 26)) and all(after[s] == before["llama-b"][s] for s in before["llama-b"])


def test_changed_budget_without_a_checkpoint_is_a_new_run(finished_study, dataset):
    """A run whose budget changed and that cannot be continued (no resume checkpoint: a study collected without
    its weights, or a machine that went back) or that is longer than the new plan trains afresh: the earlier run,
    its evaluation and stage records move to STUDY/superseded/, the new metrics hold each step once from step 1,
    and only the new run's snapshots are evaluated."""
    import shutil
    tmp, _, _ = finished_study
    shutil.copytree(tmp / "t", tmp / "v", ignore=shutil.ignore_patterns("report"))
    b_steps = json.loads((tmp / "v" / "runs" / "llama-b" / "config.json").read_text())["train"]["max_steps"]
    path = study_yaml(tmp, dataset, name="v", tokens={"a": 1920, "b": 96 * b_steps, "llama-a": 2400, "hgrn2-b": 960})
    shutil.rmtree(tmp / "v" / "runs" / "llama-a" / "checkpoints")
    before = {n: losses(tmp / "v" / "runs" / n) for n in ("llama-a", "hgrn2-b", "llama-b")}
    status = study("status", "--config", path).stdout
    for name, why in (("llama-a", "a run of 20 steps, no checkpoint to continue it to 25"),
                      ("hgrn2-b", f"a run of {b_steps} steps, more than the plan's 10")):
        line = next(x for x in status.splitlines() if x.startswith(name))
        assert " done " not in line and f"holds {why}: `run` retrains it" in line, line
    res = study("run", "--config", path, "--no-report", "--runs", "llama-a", "hgrn2-b", "llama-b")
    assert res.stdout.count("training afresh") == 2 and f"llama-b: trained ({b_steps} steps), skipped" in res.stdout
    aside = sorted((tmp / "v" / "superseded").iterdir())
    assert [p.name.rsplit("-", 2)[0] for p in aside] == ["hgrn2-b", "llama-a"]
    for d, name in zip(aside, ("hgrn2-b", "llama-a")):
        assert losses(d / "run") == before[name]                        # kept, not deleted
        assert (d / "eval" / "results.json").is_file() and (d / "state" / "evaluate.json").is_file()
    from scaling.study import load_study, plan_study
    plans = {p.name: p for p in plan_study(load_study(path))}
    for name, steps in (("llama-a", 25), ("hgrn2-b", 10)):
        rows = [json.loads(x)["step"] for x in (tmp / "v" / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert rows == list(range(1, steps + 1)), name                  # one row a step, none of the earlier run
        # a fresh start from the same seed: the steps both runs took agree with the earlier run's
        new = losses(tmp / "v" / "runs" / name)
        assert all(new[s] == before[name][s] for s in range(1, min(steps, len(before[name])) + 1)), name
        ev = json.loads((tmp / "v" / "eval" / name / "results.json").read_text())["snapshots"]
        assert [r["step"] for r in ev] == plans[name].snapshot_steps, name
    assert losses(tmp / "v" / "runs" / "llama-b") == before["llama-b"]
    assert "4/4 runs trained and evaluated" in study("status", "--config", path).stdout


def test_evaluate_stage_runs_without_lm_eval(finished_study):
    """Perplexity-type tasks, export loading and the sweep need no lm-eval (GPU images often lack it)."""
    import shutil
    tmp, path, _ = finished_study
    d = tmp / "t" / "eval" / "hgrn2-b"
    before = json.loads((d / "results.json").read_text())["snapshots"]
    shutil.rmtree(d)
    code = ("import sys, runpy; sys.modules['lm_eval'] = None; "
            f"sys.argv = ['study.py', 'stage', '--config', {str(path)!r}, '--run', 'hgrn2-b', '--stages', 'evaluate']; "
            f"runpy.run_path({str(STUDY)!r}, run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    after = json.loads((d / "results.json").read_text())["snapshots"]
    assert [r["results"]["valid_loss"]["loss"] for r in after] == [r["results"]["valid_loss"]["loss"] for r in before]


def test_missing_evaluation_data_is_found_before_training(tmp_path, dataset):
    path = study_yaml(tmp_path, dataset, evaluation={"tasks": ["valid_loss", "wikitext2", "piqa"]})
    res = subprocess.run([sys.executable, str(STUDY), "run", "--config", str(path)],
                         env={**env(), "LINSCALE_SHARED_DATA": str(tmp_path / "nowhere")},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "wiki.test.raw not found" in res.stderr and "piqa/valid.jsonl not found" in res.stderr
    assert "LINSCALE_SHARED_DATA" in res.stderr
    assert not (tmp_path / "t" / "runs").exists()   # nothing was trained


# -- faults, concurrent runners and changed configs ---------------------------------------------------------

def test_a_run_another_process_works_on_is_left_to_it_not_failed(tmp_path, dataset, monkeypatch):
    """Two runners of one study (a second `run` started by mistake, or beside the first on another GPU), or a runner
    beside a training job of the study: a run the other process trains (it holds the run directory) is left to it,
    not recorded as failed (its stage record stays the holder's), and the runner goes on with the others; the
    command exits 3 (not everything done here) and its summary says why."""
    from checkpoints.run_dir import RunLock
    from scaling.study import load_study, local, plan_study
    from scaling.study.stages import TRAIN, read_state, train, write_state
    cfg = load_study(study_yaml(tmp_path, dataset))
    plans = plan_study(cfg)
    held, called = plans[1], []

    def stage(study, plan, log):   # the held run goes through the real stage; the others need no training here
        return train(study, plan, log) if plan.name == held.name else called.append(plan.name)
    monkeypatch.setitem(local.STAGE_FUNCTIONS, TRAIN, stage)
    held.run_dir.mkdir(parents=True)
    lock = RunLock(held.run_dir).acquire()   # the other process, training this run
    try:
        write_state(cfg, held.name, TRAIN, "running")
        theirs = read_state(cfg, held.name, TRAIN)
        logged: list[str] = []
        res = local.run_local(cfg, plans, (TRAIN,), log=logged.append)
        assert read_state(cfg, held.name, TRAIN) == theirs
    finally:
        lock.release()
    assert res["failed"] == {}, res["failed"]
    assert called == [p.name for p in plans if p is not held] and list(res["busy"]) == [held.name]
    assert any(f"{held.name}: its run directory is in use by another process (pid {os.getpid()}" in m for m in logged)
    lines = local.summary_lines(cfg, plans, (TRAIN,), res, None)
    assert lines[0].startswith("[study] summary: 3 of 4 run(s)") and "left to another process: 1" in lines[0]


def test_two_runners_claim_each_run_for_one_of_them(tmp_path, dataset, monkeypatch):
    """A runner claims a run for all its stages (export and evaluation too, which the trainer's lock does not
    cover): a second runner leaves a claimed run alone, and a run no longer claimed is taken."""
    from scaling.study import load_study, local, plan_study
    from scaling.study.stages import EXPORT, TRAIN, run_claimed
    cfg = load_study(study_yaml(tmp_path, dataset))
    plans = plan_study(cfg)
    called = []
    for stage in (TRAIN, EXPORT):
        monkeypatch.setitem(local.STAGE_FUNCTIONS, stage,
                            lambda study, plan, log, s=stage: called.append((plan.name, s)))
    with run_claimed(cfg, plans[0].name):
        res = local.run_local(cfg, plans[:2], (TRAIN, EXPORT), log=lambda m: None)
    assert list(res["busy"]) == [plans[0].name] and called == [(plans[1].name, TRAIN), (plans[1].name, EXPORT)]
    res = local.run_local(cfg, plans[:1], (TRAIN, EXPORT), log=lambda m: None)
    assert res["busy"] == {} and res["done"] == [plans[0].name]


def test_a_second_report_waits_for_the_first(tmp_path, dataset):
    """A report clears the earlier fit's outputs before fitting: two at once (two runners ending together) would
    remove each other's tables and plots. `report` waits while another holds the study's report lock."""
    import time
    from scaling.study import load_study
    from scaling.study.stages import report_claimed
    path = study_yaml(tmp_path, dataset)
    cfg = load_study(path)
    with report_claimed(cfg):
        proc = subprocess.Popen([sys.executable, str(STUDY), "report", "--config", str(path)], env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(6)
        assert proc.poll() is None and not (tmp_path / "t" / "report" / "report.md").exists()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "another process writes the report now" in out, out[-2000:]
    assert (tmp_path / "t" / "report" / "report.md").is_file()


def test_yaml_words_read_as_booleans_keep_their_choice(tmp_path, dataset):
    """YAML 1.1 reads `off` and `no` as False: `grad_accum_fusion: off` must reach pretrain as off (one of its
    choices, auto or off), not as 'false', which it rejects while naming off as allowed."""
    from pretrain.config import parse_config
    from scaling.study import load_study, plan_study
    path = study_yaml(tmp_path, dataset)
    path.write_text(path.read_text() + "per_run:\n  hgrn2: {train: {grad_accum_fusion: off, compile: no}}\n")
    cfg = load_study(path, overrides=["recipe.train.grad_accum_fusion=off"])
    for p in plan_study(cfg):
        t = parse_config(p.argv).train
        assert (t.grad_accum_fusion, t.compile) == ("off", "false" if p.arch == "hgrn2" else "auto"), p.name


def test_a_run_of_another_precision_is_another_run(tmp_path, dataset):
    """train.precision changes the numbers a run trains to: a run directory of another precision holds another
    run (`run` moves it aside and trains afresh), like one of another optimizer or seed."""
    from pretrain.config import parse_config
    from scaling.study import load_study, plan_study
    from scaling.study.stages import run_change
    plan = plan_study(load_study(study_yaml(tmp_path, dataset)))[0]
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(parse_config(plan.argv).to_dict()))
    assert run_change(plan) is None
    other = plan_study(load_study(study_yaml(tmp_path, dataset), overrides=["recipe.train.precision=bf16"]))[0]
    assert run_change(other) == "a run of other settings (train.precision 'auto', the plan 'bf16')"


@pytest.mark.parametrize("change, message", [
    ({"data": "/nonexistent/data"}, "study config: data: /nonexistent/data does not exist. Prepare the dataset there"),
    ({"out": "FILE"}, "study config: out: the study directory {file} cannot be created or written (Not a directory"),
])
def test_missing_data_or_an_unwritable_study_directory_is_one_error_before_any_run(tmp_path, dataset, change,
                                                                                   message):
    """A `data` path that does not exist or an `out` that cannot be written is one error naming the study key and
    the fix, before any run starts (not the same OS error from every run in turn, naming pretrain's --data)."""
    file = tmp_path / "a_file"
    file.write_text("")
    change = {k: str(file) if v == "FILE" else v for k, v in change.items()}
    path = study_yaml(tmp_path, change.pop("data", dataset), **change)
    res = study("run", "--config", path, "--stages", "train", check=False)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [next(x for x in res.stderr.splitlines() if x.startswith("error:"))]
    assert message.format(file=file) in res.stderr and "[study]" not in res.stdout
    assert not (tmp_path / "t" / "runs").exists()


def test_validation_windows_follow_the_study_settings(tmp_path, dataset):
    """valid_tokens.bin is what the study's data, seq_len and evaluation.valid_windows give now: a file made for
    other settings is made again (equal to one made afresh), an unchanged one is left untouched (the evaluation
    cache keys on it), and where the data is not, a file of other settings is refused before it is scored."""
    from scaling.study import load_study
    from scaling.study.stages import VALID_TOKENS, check_valid_tokens, eval_dir, prepare_eval_inputs
    quiet = lambda m: None  # noqa: E731
    path = study_yaml(tmp_path, dataset)
    prepare_eval_inputs(load_study(path), quiet)
    cfg = load_study(path, overrides=["evaluation.valid_windows=7"])
    prepare_eval_inputs(cfg, quiet)
    fresh = load_study(path, overrides=["evaluation.valid_windows=7", f"out={tmp_path / 'fresh'}"])
    prepare_eval_inputs(fresh, quiet)
    made = eval_dir(cfg) / VALID_TOKENS
    assert made.read_bytes() == (eval_dir(fresh) / VALID_TOKENS).read_bytes()
    assert made.stat().st_size == 7 * (16 + 1) * 4
    mtime = made.stat().st_mtime_ns
    prepare_eval_inputs(cfg, quiet)
    assert made.stat().st_mtime_ns == mtime
    check_valid_tokens(cfg)
    elsewhere = load_study(path, overrides=["evaluation.valid_windows=9", f"data={tmp_path / 'not_here'}"])
    with pytest.raises(ValueError, match="made for another evaluation.valid_windows or seq_len"):
        prepare_eval_inputs(elsewhere, quiet)


def test_an_interrupted_move_aside_never_leaves_the_earlier_evaluation_as_the_new_run_s(tmp_path, dataset,
                                                                                         monkeypatch):
    """Moving a run of other settings aside is several moves; a kill between them must not leave the earlier run's
    evaluation in place with its run directory gone (the new run would be reported with the old numbers): the run
    directory moves last, so the next `run` sees the run still to be moved and finishes the move."""
    import shutil
    from pretrain.config import parse_config
    from scaling.study import load_study, plan_study
    from scaling.study.stages import EVALUATE, eval_dir, run_change, supersede, write_state
    old = plan_study(load_study(study_yaml(tmp_path, dataset)))[0]
    old.run_dir.mkdir(parents=True)
    (old.run_dir / "config.json").write_text(json.dumps(parse_config(old.argv).to_dict()))
    cfg = load_study(study_yaml(tmp_path, dataset), overrides=["recipe.optim.lr=1e-3"])
    plan = plan_study(cfg)[0]
    (eval_dir(cfg, plan.name) / "cache").mkdir(parents=True)
    write_state(cfg, plan.name, EVALUATE, "done")
    why = run_change(plan)
    real_move, moves = shutil.move, []

    def killed_after_one(src, dst):
        if moves:
            raise KeyboardInterrupt
        moves.append(src)
        return real_move(src, dst)
    monkeypatch.setattr(shutil, "move", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        supersede(cfg, plan, why, log=lambda m: None)
    assert plan.run_dir.exists() or not eval_dir(cfg, plan.name).exists()
    monkeypatch.setattr(shutil, "move", real_move)
    assert run_change(plan) is not None
    supersede(cfg, plan, run_change(plan), log=lambda m: None)
    assert not plan.run_dir.exists() and not eval_dir(cfg, plan.name).exists()


def test_a_stage_record_that_cannot_be_written_names_its_file_and_leaves_no_temporary(tmp_path, dataset,
                                                                                        monkeypatch):
    """A full disk while a stage record is written: the error names the record, the earlier record stays whole,
    and no empty temporary file is left beside it."""
    import errno
    from scaling.study import load_study
    from scaling.study.stages import read_state, state_path, write_state
    cfg = load_study(study_yaml(tmp_path, dataset))
    write_state(cfg, "llama-a", "train", "done")
    before = read_state(cfg, "llama-a", "train")

    def disk_full(fd):  # the temporary file exists, its data cannot reach the disk
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    record = state_path(cfg, "llama-a", "train")
    with pytest.raises(OSError, match=re.escape(f"cannot write the stage record {record}")):
        write_state(cfg, "llama-a", "train", "running")
    monkeypatch.undo()
    assert read_state(cfg, "llama-a", "train") == before
    assert [p.name for p in record.parent.iterdir()] == ["train.json"]


def test_status_names_planned_snapshots_a_kept_run_does_not_have(tmp_path, dataset):
    """The snapshot schedule does not change what a run trains to, so a finished run is kept when the schedule
    changes; `status` then says which of the plan's snapshot steps the run lacks instead of listing it as if the
    plan's steps were there to evaluate."""
    from checkpoints.manifest import MANIFEST
    from pretrain.config import parse_config
    from scaling.study import load_study, plan_study
    from scaling.study.status import run_status
    path = study_yaml(tmp_path, dataset)
    plan = plan_study(load_study(path))[0]
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(parse_config(plan.argv).to_dict()))
    (plan.run_dir / "summary.json").write_text(json.dumps({"stop": "finished", "step": plan.steps}))
    for s in plan.snapshot_steps:                        # what the schedule of log_points 2 left
        (plan.run_dir / "snapshots" / f"step_{s:08d}").mkdir(parents=True)
        (plan.run_dir / "snapshots" / f"step_{s:08d}" / MANIFEST).write_text("{}")
    assert run_status(load_study(path), plan).note == ""
    cfg = load_study(path, overrides=["snapshots.log_points=4"])
    new = plan_study(cfg)[0]
    expected = sorted(set(new.snapshot_steps) - set(plan.snapshot_steps))
    assert expected and plan.snapshot_steps != new.snapshot_steps
    status = run_status(cfg, new)
    assert status.train == "done"
    assert status.note.startswith(f"no snapshot at planned step(s) {','.join(map(str, expected))} (trained under "
                                  f"another snapshot schedule or budget)"), status.note


@pytest.mark.parametrize("content, message", [
    (None, "is a folder: give the study YAML file itself"),
    (b"\xff\xfe name: x", "is not a UTF-8 text file"),
    (b"", "is empty: write the study's keys"),
])
def test_a_config_that_is_not_a_study_file_is_a_clear_error(tmp_path, content, message):
    from scaling.study import StudyConfigError, load_study
    path = tmp_path / "study.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(StudyConfigError, match=re.escape(f"{path} {message}")):
        load_study(path)


# -- the evaluate stage: the settings of cached results, a stop between snapshots ----------------------------

EVAL_TASKS = ["valid_loss", "wikitext2"]


def fake_evaluation(tmp: Path, dataset: Path, monkeypatch, **evaluation):
    """A study whose first run has three exports (files only) and an evaluation whose models and tasks are
    stand-ins: load_model returns nothing, run_tasks records (snapshot, task) and returns the settings it was
    given, so a test sees what was evaluated, with which settings, in seconds."""
    from evaluation import sweep as sw
    from scaling.study import load_study, plan_study
    from scaling.study.stages import prepare_eval_inputs
    shared = tmp / "shared"
    (shared / "eval" / "wikitext-2-raw").mkdir(parents=True)
    (shared / "eval" / "wikitext-2-raw" / "wiki.test.raw").write_text(" = Title = \n\n Some text . \n")
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(shared))
    path = study_yaml(tmp, dataset, evaluation={"tasks": EVAL_TASKS, "valid_windows": 4, "batch_size": 4,
                                                "limit": 100, **evaluation})
    cfg = load_study(path)
    plan = plan_study(cfg)[0]
    for s in plan.snapshot_steps:
        d = plan.run_dir / "exports" / f"step_{s:08d}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"model": {"arch": plan.arch, "size": plan.size, "vocab_size": 100352,
                                                              "max_seq_len": 16}, "step": s, "tokens": 96 * s,
                                                    "flops": 1e9 * s, "train_seq_len": 16}))
        (d / "model.safetensors").write_bytes(f"weights of step {s}".encode())
    prepare_eval_inputs(cfg, lambda m: None)
    calls: list[tuple[str, str]] = []

    def run_tasks(tasks, model, snap, sweep_cfg, out):
        calls.append((snap["snapshot"], tasks[0]))
        return {t: {"loss": 1.0, "limit": sweep_cfg.limit, "max_length": sweep_cfg.max_length,
                    "windows": sweep_cfg.valid_windows} for t in tasks}
    monkeypatch.setattr(sw, "load_model", lambda *a: object())
    monkeypatch.setattr(sw, "run_tasks", run_tasks)
    return path, plan, calls


@pytest.mark.parametrize("change, task, stale", [
    ("evaluation.limit=200", "wikitext2", "made with limit=100, study asks limit=200"),
    ("evaluation.max_length=8", "wikitext2", "made with max_length=16, study asks max_length=8"),
    ("evaluation.valid_windows=3", "valid_loss", "made with valid_windows=4, study asks valid_windows=3"),
])
def test_evaluations_made_with_other_settings_are_stale_and_made_again(tmp_path, dataset, monkeypatch, change,
                                                                        task, stale):
    """A cached result made with other settings than the study asks for now (after an edit of study.yaml) is not
    done: `status` counts the snapshot as not evaluated and names the setting, the report leaves the stale number
    out (the other tasks' results stay), and the evaluate stage makes only that task again."""
    from scaling.study import load_study, plan_study
    from scaling.study.report import evaluation_rows
    from scaling.study.stages import evaluate, prepare_eval_inputs
    from scaling.study.status import format_status, run_status
    path, plan, calls = fake_evaluation(tmp_path, dataset, monkeypatch)
    quiet = lambda m: None  # noqa: E731
    evaluate(load_study(path), plan, quiet)
    assert len(calls) == 2 * 3
    status = run_status(load_study(path), plan)
    assert (status.evaluated, status.to_evaluate, status.note) == (3, 3, "")
    cfg = load_study(path, overrides=[change])
    plan = plan_study(cfg)[0]
    status = run_status(cfg, plan)
    assert (status.evaluated, status.to_evaluate) == (0, 3)
    assert status.note == f"3 snapshot(s) stale: {task} {stale}", status.note
    assert f"stale: {task} {stale}" in format_status([status])
    logged: list[str] = []
    rows = evaluation_rows(cfg, [plan], logged.append)
    other = next(t for t in EVAL_TASKS if t != task)
    assert [sorted(r["results"]) for r in rows] == [[other]] * 3
    assert sum(f"{task} left out, stale: {stale}" in m for m in logged) == 3, logged
    calls.clear()
    prepare_eval_inputs(cfg, quiet)
    evaluate(cfg, plan, quiet)
    assert calls == [(f"step_{s:08d}", task) for s in plan.snapshot_steps]
    status = run_status(cfg, plan)
    assert (status.evaluated, status.note) == (3, "")
    rows = evaluation_rows(cfg, [plan], quiet)
    made = {"limit": cfg.evaluation.limit, "max_length": cfg.evaluation.max_length or 16,
            "windows": cfg.evaluation.valid_windows}
    assert all({k: r["results"][task][k] for k in made} == made for r in rows), rows
    if change == "evaluation.limit=200":   # the command says the same, back at the file's own limit
        out = study("status", "--config", path).stdout
        line = next(x for x in out.splitlines() if x.startswith(plan.name))
        assert "0/3" in line and "3 snapshot(s) stale: wikitext2 made with limit=200, study asks limit=100" in line, out


def test_stored_commonsense_scores_of_other_requests_or_window_are_stale(tmp_path, dataset):
    """With csr: replay, a snapshot's stored scores are current only for the study's request file (tasks, limit),
    scoring window and weights: `status` names scores of a request file made for another limit, scored in another
    window or from weights exported again as stale, and does not count them."""
    from evaluation.request_replay import FORMAT
    from evaluation.sweep import fingerprint
    from scaling.study import load_study, plan_study
    from scaling.study.stages import CSR_REQUESTS, eval_dir
    from scaling.study.status import run_status
    path = study_yaml(tmp_path, dataset, evaluation={"tasks": ["piqa"], "limit": 5, "csr": "replay"})
    cfg = load_study(path)
    plan = plan_study(cfg)[0]
    req = {"format": FORMAT, "tasks": ["piqa"], "limit": 5, "sha256": "r1", "pairs": []}
    eval_dir(cfg).mkdir(parents=True)
    (eval_dir(cfg) / CSR_REQUESTS).write_text(json.dumps(req))
    export = plan.run_dir / "exports" / "step_00000001"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"w")
    scores = eval_dir(cfg, plan.name) / "csr_scores" / "step_00000001.json"
    scores.parent.mkdir(parents=True)
    scores.write_text(json.dumps({"key": {"requests": "r1", "weights": fingerprint(export), "window": 16},
                                  "scores": []}))
    status = run_status(cfg, plan)
    assert (status.evaluated, status.note) == (1, "")
    for change, why in (("evaluation.limit=6", "made with limit=5, study asks limit=6"),
                        ("evaluation.max_length=8", "made with max_length=16, study asks max_length=8")):
        status = run_status(load_study(path, overrides=[change]), plan)
        assert (status.evaluated, status.note) == (0, f"1 snapshot(s) stale: commonsense scores {why}")
    (export / "model.safetensors").write_bytes(b"exported again")
    status = run_status(cfg, plan)
    assert (status.evaluated, status.note) == (0, "1 snapshot(s) stale: commonsense scores made with other weights "
                                                  "(exported again)")


def test_an_export_the_export_stage_would_make_again_is_not_exported_nor_evaluated(tmp_path, dataset):
    """An export in another evaluation.export_dtype, or of another snapshot of its step (a branch the run
    abandoned), is made again by the export stage and evaluated again: `status` does not count it (nor its
    evaluation) as done, the report leaves its numbers out, and `run` redoes exactly those snapshots."""
    from scaling.study import load_study, plan_study
    from scaling.study.report import evaluation_rows
    from scaling.study.status import run_status
    path = study_yaml(tmp_path, dataset)
    study("run", "--config", path, "--runs", "llama-a", "--no-report")
    plan = plan_study(load_study(path))[0]
    n = len(plan.snapshot_steps)
    assert run_status(load_study(path), plan).complete
    bf16 = ["evaluation.export_dtype=bf16"]
    st = run_status(load_study(path, overrides=bf16), plan)
    assert (st.exported, st.evaluated, st.complete) == (0, 0, False), st
    assert st.note == f"{n} snapshot(s) stale: valid_loss exported as fp32, study asks export_dtype=bf16", st.note
    assert evaluation_rows(load_study(path, overrides=bf16), [plan], lambda m: None) == []
    res = study("run", "--config", path, "--runs", "llama-a", "--no-report", *(f"--set={o}" for o in bf16))
    assert (res.stdout + res.stderr).count("valid_loss: loss=") == n
    assert run_status(load_study(path, overrides=bf16), plan).complete
    # an export whose source is another snapshot of the step than the run's now
    first = plan.run_dir / "exports" / f"step_{plan.snapshot_steps[0]:08d}" / "config.json"
    meta = json.loads(first.read_text())
    meta["source"]["manifest"] = "0" * 16
    first.write_text(json.dumps(meta))
    st = run_status(load_study(path, overrides=bf16), plan)
    assert (st.exported, st.evaluated) == (n - 1, n - 1), st
    assert "1 snapshot(s) stale: valid_loss exported from another snapshot of that step" in st.note, st.note
    res = study("run", "--config", path, "--runs", "llama-a", "--no-report", *(f"--set={o}" for o in bf16))
    assert (res.stdout + res.stderr).count("valid_loss: loss=") == 1
    assert run_status(load_study(path, overrides=bf16), plan).complete


@pytest.mark.parametrize("stop_after", [1, 2], ids=["between-tasks", "between-snapshots"])
def test_a_stop_during_evaluation_ends_the_stage_there_and_run_continues_it(tmp_path, dataset, monkeypatch,
                                                                            stop_after):
    """SIGUSR1 (a scheduler's warning; the deadline sends the same) while a run is evaluated: the evaluate stage
    stops before the next task or snapshot, is recorded as stopped (not failed), keeps what it finished in the
    cache and writes nothing half-way (no temporary file, no table); `run` again evaluates only the rest."""
    import signal
    import threading
    from scaling.study import load_study, local
    from scaling.study.stages import EVALUATE, eval_dir, read_state
    from scaling.study.status import run_status
    assert threading.current_thread() is threading.main_thread()   # where the study's Stopper takes the signal
    path, plan, calls = fake_evaluation(tmp_path, dataset, monkeypatch)
    cfg = load_study(path)
    from evaluation import sweep as sw
    run_tasks = sw.run_tasks

    signals = []

    def signalled(*a):   # the signal arrives once, while the stop_after-th task runs
        res = run_tasks(*a)
        if len(calls) == stop_after and not signals:
            signals.append(os.kill(os.getpid(), signal.SIGUSR1))
        return res
    monkeypatch.setattr(sw, "run_tasks", signalled)
    logged: list[str] = []
    res = local.run_local(cfg, [plan], (EVALUATE,), log=logged.append)
    snaps = [f"step_{s:08d}" for s in plan.snapshot_steps]
    everything = [(s, t) for s in snaps for t in EVAL_TASKS]
    assert calls == everything[:stop_after]
    assert res["stopped"] == "SIGUSR1" and res["failed"] == {} and res["done"] == [], res
    rec = read_state(cfg, plan.name, EVALUATE)
    assert rec["status"] == "stopped" and "evaluation stopped (SIGUSR1)" in rec["error"], rec
    cache = eval_dir(cfg, plan.name) / "cache" / plan.name
    files = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert files == [f"{s}/{t}.json" for s, t in everything[:stop_after]]
    assert not (eval_dir(cfg, plan.name) / "results.json").exists()
    assert run_status(cfg, plan).evaluated == stop_after // 2
    calls.clear()
    res = local.run_local(cfg, [plan], (EVALUATE,), log=logged.append)
    assert res["stopped"] is None and res["done"] == [plan.name], res
    assert calls == everything[stop_after:]
    assert read_state(cfg, plan.name, EVALUATE)["status"] == "done"
    table = json.loads((eval_dir(cfg, plan.name) / "results.json").read_text())["snapshots"]
    assert [r["snapshot"] for r in table] == snaps and all(sorted(r["results"]) == sorted(EVAL_TASKS) for r in table)
    assert run_status(cfg, plan).evaluated == 3


# -- Slurm: the submitted job arrays and dependencies -------------------------------------------------------

def fake_slurm(bin_dir: Path, log: Path) -> None:
    """sbatch that records its arguments and answers job ids 101, 102, ...; squeue/sacct that know no jobs."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "sbatch").write_text(f"""#!/bin/bash
n=$(( $(wc -l < {log} 2>/dev/null || echo 0) + 101 ))
echo "$n $*" >> {log}
echo "$n"
""")
    for cmd in ("squeue", "sacct"):
        (bin_dir / cmd).write_text("#!/bin/bash\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def script_runs(script: Path, task: int) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment the training array's task `task` hands to pretrain.sbatch."""
    text = script.read_text().replace('exec bash launch/slurm/pretrain.sbatch "$@"',
                                      'printf "%s\\n" "$@"; echo ===; env')
    res = subprocess.run(["bash", "-c", text], env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task)},
                         capture_output=True, text=True, check=True)
    args, _, envs = res.stdout.partition("===\n")
    return args.splitlines(), dict(line.split("=", 1) for line in envs.splitlines() if "=" in line)


def test_slurm_submission_is_arrays_with_dependencies(tmp_path, dataset):
    log = tmp_path / "sbatch.log"
    fake_slurm(tmp_path / "bin", log)
    path = study_yaml(tmp_path, dataset, slurm={"train": ["--partition=cpu", "--time=10"], "max_parallel": 2,
                                                 "train_env": {"OMP_NUM_THREADS": 1}})
    e = {**env(), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, str(STUDY), "run", "--config", str(path), "--slurm"], env=e,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["101", "102", "103"]
    train, evaluate, report = calls
    assert "--dependency=aftercorr:101" in evaluate and "--dependency=afterany:101:102" in report
    train_script = Path(train[-1])
    text = train_script.read_text()
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --partition=cpu" in text and "#SBATCH --requeue" in text
    from pretrain.config import parse_config
    from scaling.study import load_study, plan_study
    plans = plan_study(load_study(path))
    for i, p in enumerate(plans):
        args, environ = script_runs(train_script, i)
        assert args[0] == p.arch and args[2:] == p.argv
        assert environ["RUN_DIR"] == str(p.run_dir) and environ["OMP_NUM_THREADS"] == "1"
        assert parse_config(args[2:]).to_dict() == parse_config(p.argv).to_dict()
    ev_text = Path(evaluate[-1]).read_text()
    assert "#SBATCH --array=0-3%2" in ev_text and "stage --config" in ev_text and "--stages export,evaluate" in ev_text
    assert "launch/study.py report" in Path(report[-1]).read_text()
    subs = [json.loads(line) for line in (tmp_path / "t" / "slurm" / "submissions.jsonl").read_text().splitlines()]
    assert [s["job_id"] for s in subs] == ["101", "102", "103"] and subs[0]["runs"] == [p.name for p in plans]
    assert (tmp_path / "t" / "eval" / "valid_tokens.bin").is_file() and (tmp_path / "t" / "logs").is_dir()


def test_slurm_resubmission_leaves_out_finished_runs(tmp_path, dataset):
    """Trained runs go into an evaluation array without a dependency; nothing is trained twice."""
    log = tmp_path / "sbatch.log"
    fake_slurm(tmp_path / "bin", log)
    path = study_yaml(tmp_path, dataset)
    from scaling.study import load_study, plan_study
    plans = plan_study(load_study(path))
    for p in plans[:2]:  # two runs have finished training
        p.run_dir.mkdir(parents=True)
        (p.run_dir / "summary.json").write_text(json.dumps({"stop": "finished", "step": p.steps}))
    e = {**env(), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, str(STUDY), "run", "--config", str(path), "--slurm"], env=e,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len(calls) == 4
    train, ev_after, ev_now, report = calls
    assert "#SBATCH --array=0-1" in Path(train[-1]).read_text()
    assert [script_runs(Path(train[-1]), i)[1]["RUN_DIR"] for i in (0, 1)] == [str(p.run_dir) for p in plans[2:]]
    assert "--dependency=aftercorr:101" in ev_after and not any(a.startswith("--dependency") for a in ev_now)
    assert "--dependency=afterany:101:102:103" in report


def test_slurm_resubmission_after_a_failed_training_task(tmp_path, dataset):
    """A run whose training task failed: its evaluation task (aftercorr) would never start. The evaluation
    arrays are submitted with --kill-on-invalid-dep=yes; a task Slurm still holds as never satisfiable is
    cancelled and its run submitted again, and `status` reads the failure from the run's Slurm attempt
    record (a finished job is invisible to squeue; sacct needs accounting)."""
    log = tmp_path / "sbatch.log"
    fake_slurm(tmp_path / "bin", log)
    path = study_yaml(tmp_path, dataset)
    e = {**env(), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    run = lambda: subprocess.run([sys.executable, str(STUDY), "run", "--config", str(path), "--slurm"],  # noqa: E731
                                 env=e, capture_output=True, text=True, timeout=300)
    res = run()
    assert res.returncode == 0, res.stderr[-2000:]
    calls = [line.split() for line in log.read_text().splitlines()]
    assert "--kill-on-invalid-dep=yes" in calls[1] and "--kill-on-invalid-dep=yes" in calls[2]
    from scaling.study import load_study, plan_study
    plans = plan_study(load_study(path))
    # task 1 of the training array failed; Slurm holds evaluation task 102_1 as never satisfiable
    plans[1].run_dir.mkdir(parents=True)
    (plans[1].run_dir / "slurm_attempt.json").write_text(json.dumps(
        {"job_id": "101", "restart": 0, "exit": 1, "stop": "-", "checkpoint": -1}))
    (tmp_path / "bin" / "squeue").write_text('#!/bin/bash\necho "102_1|PENDING|DependencyNeverSatisfied"\n')
    (tmp_path / "bin" / "scancel").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path / "scancel.log"}\n')
    (tmp_path / "bin" / "scancel").chmod(0o755)
    status = subprocess.run([sys.executable, str(STUDY), "status", "--config", str(path)], env=e,
                            capture_output=True, text=True, timeout=300).stdout
    row = next(line for line in status.splitlines() if line.startswith(plans[1].name))
    assert " failed " in row and "Slurm job 101 exited 1" in row, status
    res = run()
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "scancel.log").read_text().split() == ["102_1"]
    assert "not submitted again" not in res.stdout
    train = [line.split() for line in log.read_text().splitlines()][3]
    assert "#SBATCH --array=0-3" in Path(train[-1]).read_text()  # every untrained run, the failed one too


def test_study_sizes_keep_the_paper_proportions():
    """The registry's one-GPU study sizes: g = 3d (the paper's smallest size); head width 128 from d = 128 up and
    one head of width d below it; d/l in the paper's range (39-128) except the one-layer d = 32; non-embedding N
    by the paper's formula rising with the name's order and spanning more than 100x."""
    from models import model_config, paper_non_embedding_params
    names = [s for s in __import__("models").SIZES if s.startswith("l") and "d" in s[1:]]
    assert names == ["l1d32", "l1d48", "l1d64", "l1d96", "l1d128", "l2d128", "l2d256", "l4d256", "l4d384"]
    ns = []
    for s in names:
        c = model_config("llama", s)
        assert c.d_glu == 3 * c.d_model and s == f"l{c.n_layers}d{c.d_model}"
        assert c.head_dim == (128 if c.d_model >= 128 else c.d_model)
        assert 32 <= c.d_model / c.n_layers <= 128
        ns.append(paper_non_embedding_params(c))
    assert ns == sorted(ns) and ns[-1] / ns[0] > 100


@pytest.mark.parametrize("arch", ["llama", "tnl", "hgrn2", "cos2"])
@pytest.mark.parametrize("size", ["l1d32", "l1d48", "l1d64", "l1d96", "l1d128", "l2d256"])
def test_study_size_parameter_counts(arch, size):
    """Every parameter the model builds at a study size, against the paper's non-embedding formulas written out
    here (l layers, d width, g = 3d, t = e = head width: 4ld² + 3ldg, TNL + 2ldt, HGRN2 + ld, cosFormer2 + 2ldt + de)
    plus the small terms the paper leaves out (LLaMA's RMSNorm gains, cosFormer2's LRPE angles and TPE decays)."""
    import torch
    from models import build_model, exact_params, model_config, paper_non_embedding_params
    l, d = int(size[1:size.index("d")]), int(size[size.index("d") + 1:])
    e = min(d, 128)
    g, t = 3 * d, e
    paper = {"llama": 4 * l * d * d + 3 * l * d * g,
             "tnl": 4 * l * d * d + 2 * l * d * t + 3 * l * d * g,
             "hgrn2": 4 * l * d * d + 3 * l * d * g + l * d,
             "cos2": 4 * l * d * d + 2 * l * d * t + 3 * l * d * g + d * e}[arch]
    extra = {"llama": (2 * l + 1) * d, "tnl": 0, "hgrn2": 0, "cos2": l * d + e}[arch]
    cfg = model_config(arch, size)
    assert paper_non_embedding_params(cfg) == paper
    with torch.device("meta"):
        model = build_model(arch, size)
    numel = sum(p.numel() for p in model.parameters())
    emb = model.embed.weight.numel()
    assert emb == cfg.vocab_size * d
    assert numel - emb == paper + extra
    assert exact_params(cfg) == {"non_embedding": paper + extra, "embedding": emb, "total": numel}


# -- Slurm: a real local cluster (launch/slurm/local_cluster.sh) ----------------------------------------------

def test_study_on_a_real_slurm_cluster(slurm_cluster, finished_study, dataset):
    """`run --slurm` on the local cluster: the training array (through launch/slurm/pretrain.sbatch), the
    evaluation array after it, the report job last; every run's per-step losses equal the local study's."""
    import time
    tmp, _, _ = finished_study
    path = study_yaml(tmp, dataset, name="s", slurm={"train": ["--time=20"], "evaluate": ["--time=20"],
                                                      "fit": ["--time=20"]})
    e = {**env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, str(STUDY), "run", "--config", str(path), "--slurm"], env=e,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    subs = [json.loads(line) for line in (tmp / "s" / "slurm" / "submissions.jsonl").read_text().splitlines()]
    assert [s["stages"] for s in subs] == [["train"], ["export", "evaluate"], ["report"]]
    ids = [s["job_id"] for s in subs]
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(ids)], capture_output=True, text=True)
        if q.returncode == 0 and not q.stdout.strip():
            break
        time.sleep(3)
    else:
        subprocess.run(["scancel", *ids], capture_output=True)
        pytest.fail("the study's jobs did not finish within 15 minutes")
    logs = "\n".join(f"{p.name}:\n{p.read_text()[-1500:]}" for p in sorted((tmp / "s" / "logs").glob("*.out")))
    status = study("status", "--config", path).stdout
    assert "4/4 runs trained and evaluated" in status, status + logs
    assert (tmp / "s" / "report" / "report.md").is_file(), logs
    # the local study's runs may have been continued past this plan by other tests: compare this plan's steps
    from scaling.study import load_study, plan_study
    plan_steps = {p.name: p.steps for p in plan_study(load_study(path))}
    for name in ("llama-a", "hgrn2-a", "llama-b", "hgrn2-b"):
        got, ref = losses(tmp / "s" / "runs" / name), losses(tmp / "t" / "runs" / name)
        assert sorted(got) == list(range(1, plan_steps[name] + 1)), name
        assert got == {s: ref[s] for s in got}, name
    # resubmitted, a complete study submits only its report
    res = subprocess.run([sys.executable, str(STUDY), "run", "--config", str(path), "--slurm"], env=e,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0 and "submitting only the report" in res.stdout, res.stdout[-2000:]


def test_exponent_table_labels_each_method_beside_the_paper():
    """The report's exponents: handover a/b where observed, approach-3 a/b (with intervals) where fitted, and the
    paper's Table 3 values (scaling.paper) on every row; an architecture with neither says so."""
    from scaling.paper import PAPER_TABLE3
    from scaling.study.report import exponent_table
    fits = {"archs": {
        "llama": {"alpha": -0.09, "chinchilla": {"allocation": {"a": 0.8123, "a_ci": [0.5, 0.95], "b": 0.4321,
                                                                "b_ci": [0.3, None]}}},
        "tnl": {"alpha": -0.07, "a": 0.61, "a_ci": [0.55, 0.67], "b": 0.41, "b_ci": [0.35, 0.47],
                "chinchilla": {"allocation": {"a": 0.57, "a_ci": [0.45, 0.9], "b": 0.43, "b_ci": [0.1, 0.55]}}},
        "hgrn2": {"alpha": -0.08}}}
    rows = exponent_table(fits)
    by = {(r.split(" | ")[0].strip("| "), r.split(" | ")[3]): r for r in rows[2:]}
    assert set(by) == {("LLaMA", "approach 3"), ("TNL", "handovers"), ("TNL", "approach 3"), ("HGRN2", "handovers")}
    llama = by[("LLaMA", "approach 3")]
    assert "0.812 [0.500, 0.950]" in llama and f"{PAPER_TABLE3['llama']['N_opt'][1]:.4g}" in llama
    assert "| 0.432 |" in llama                                         # an interval with a missing end is not printed
    assert f"{PAPER_TABLE3['llama']['D_opt'][1]:.4g}" in llama
    assert "0.610 [0.550, 0.670]" in by[("TNL", "handovers")]
    assert "| — |" in by[("HGRN2", "handovers")]


def test_the_stage_command_of_a_slurm_job_stops_an_evaluation_and_continues_it(tmp_path, dataset, monkeypatch):
    """`launch/study.py stage` (what a Slurm array task runs; Slurm warns it with SIGUSR1 before the time limit)
    takes the signal as the study's runner does: the evaluation stops before its next task, the stage is
    recorded as stopped, the command exits 3, and the same command again evaluates only the rest (exit 0)."""
    import signal
    from evaluation import sweep as sw
    from launch_utils import load_launch_script
    from scaling.study import load_study
    from scaling.study.slurm import stage_script
    from scaling.study.stages import EVALUATE, read_state
    path, plan, calls = fake_evaluation(tmp_path, dataset, monkeypatch)
    run_tasks = sw.run_tasks

    def signalled(*a):
        res = run_tasks(*a)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return res
    monkeypatch.setattr(sw, "run_tasks", signalled)
    cli = load_launch_script("study")
    argv = ["stage", "--config", str(path), "--run", plan.name, "--stages", "evaluate"]
    assert cli.main(argv) == 3
    assert len(calls) == 3 and read_state(load_study(path), plan.name, EVALUATE)["status"] == "stopped"
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is the command's only
    assert cli.main(argv) == 0
    assert len(calls) == 2 * 3 and read_state(load_study(path), plan.name, EVALUATE)["status"] == "done"
    script = stage_script(load_study(path), [plan], "evaluate", ("export", "evaluate"))
    assert "#SBATCH --signal=B:USR1@120" in script and script.index("trap '' USR1") < script.index("exec ")

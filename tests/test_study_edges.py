"""The study runner at its edges: config values of the wrong kind, a budget below one step, a snapshot the
evaluation cannot load, a report or a Slurm submission where they cannot be made, and the summary of a study
stopped mid-run."""
from __future__ import annotations

import json
import re
import sys

import pytest
import yaml

from test_study import dataset, study, study_yaml  # noqa: F401  (dataset: the module's fixture)


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("change, message", [
    # the sweep resolved it only when it loaded a model: after the training, and in every `status` (a KeyError)
    ({"evaluation": {"tasks": ["valid_loss"], "dtype": "fp16"}},
     "evaluation.dtype 'fp16': choose auto, float32, bfloat16"),
    ({"data": 5}, "data must be a path (a string), got 5"),
    ({"data": {"sources": ["x"]}}, "data must be a path (a string), got {'sources': ['x']}: write the data config in "
                                   "its own YAML file and give its path"),
    ({"out": ["studies/x"]}, "out must be a path (a string), got ['studies/x']"),
    # steps = ceil(tokens / 96): 50 tokens would train 96
    ({"tokens": 50}, "tokens=50 is less than one step of global_batch_tokens=96: the run would train 96 tokens, "
                     "1.92x its budget; give it at least 96 tokens, or lower global_batch_tokens"),
    ({"tokens": {"a": 960, "b": 960, "llama-b": 48}}, "tokens.llama-b=48 is less than one step of "
                                                     "global_batch_tokens=96: the run would train 96 tokens, 2x"),
])
def test_values_of_the_wrong_kind_are_one_error_naming_the_key(tmp_path, dataset, change, message):  # noqa: F811
    from scaling.study import StudyConfigError, load_study
    path = study_yaml(tmp_path, dataset)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **change}))
    with pytest.raises(StudyConfigError, match=re.escape(message)):
        load_study(path)
    for command in ("plan", "status"):
        res = study(command, "--config", path, check=False)
        assert res.returncode == 2 and one_error_line(res.stderr).startswith("error: study config: "), res.stderr


def test_a_budget_of_exactly_one_step_is_planned_as_one_step(tmp_path, dataset):  # noqa: F811
    from scaling.study import load_study, plan_study
    plans = plan_study(load_study(study_yaml(tmp_path, dataset, tokens=96)))
    assert {(p.steps, p.tokens) for p in plans} == {(1, 96)}


def test_a_snapshot_the_evaluation_cannot_load_fails_the_stage_and_the_report_says_why(tmp_path, dataset):  # noqa: F811
    """The sweep goes on past an export it cannot load, with the error in that snapshot's row. The study
    records the evaluate stage as failed (not done), `run` exits 1 naming the snapshot, the report's evaluation
    table shows the last snapshot that was evaluated (with its cached number) and lists the failure; once the
    export is made again, `run` evaluates the rest and exits 0."""
    from scaling.study import load_study, plan_study
    from scaling.study.stages import EVALUATE, read_state
    from scaling.study.status import run_status
    path = study_yaml(tmp_path, dataset, archs=["llama"], tokens=960,
                      sizes=[{"name": "a", "n_layers": 1, "d_model": 32, "n_heads": 2, "d_glu": 64}])
    study("run", "--config", path, "--no-report")
    cfg = load_study(path)
    plan = plan_study(cfg)[0]
    first, *_, last = [f"step_{s:08d}" for s in plan.snapshot_steps]
    (plan.run_dir / "exports" / last / "model.safetensors").write_bytes(b"damaged")
    cache = tmp_path / "t" / "eval" / plan.name / "cache" / plan.name
    for f in (cache / last).iterdir():
        f.unlink()
    res = study("run", "--config", path, check=False)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    rec = read_state(cfg, plan.name, EVALUATE)
    assert rec["status"] == "failed" and f"1 of {len(plan.snapshot_steps)} snapshot(s) not evaluated: {last}: " \
        f"valid_loss: cannot load" in rec["error"], rec
    assert f"  failed  {plan.name}: evaluate: EvaluationFailed: " in res.stdout
    st = run_status(cfg, plan)
    assert not st.complete and st.evaluated == len(plan.snapshot_steps) - 1 and st.note.startswith("evaluate: ")
    report = (tmp_path / "t" / "report" / "report.md").read_text()
    second_last = plan.snapshot_steps[-2]
    loss = json.loads((cache / f"step_{second_last:08d}" / "valid_loss.json").read_text())["metrics"]["loss"]
    table = report[report.index("## Evaluation"):]
    assert f"| a | LLaMA | {second_last} | {loss:.4g} |" in table, table
    assert f"- {plan.name} {last}: valid_loss: cannot load" in table, table
    # a Slurm array task runs the stage through `stage`: it fails the same way, in one line (exit 1: `aftercorr`)
    res = study("stage", "--config", path, "--run", plan.name, "--stages", "evaluate", check=False)
    assert res.returncode == 1 and one_error_line(res.stderr).startswith(
        f"error: {plan.name}: evaluate failed: EvaluationFailed: {plan.name}: 1 of {len(plan.snapshot_steps)} "
        f"snapshot(s) not evaluated: {last}: valid_loss: cannot load"), res.stderr
    # exported again (the study exports a step whose folder is gone), the next run evaluates only that snapshot
    import shutil
    shutil.rmtree(plan.run_dir / "exports" / last)
    res = study("run", "--config", path)
    assert "0 cached, 1 to run" in res.stderr + res.stdout and read_state(cfg, plan.name, EVALUATE)["status"] == "done"
    assert run_status(cfg, plan).complete and (cache / first / "valid_loss.json").is_file()
    assert "Not evaluated" not in (tmp_path / "t" / "report" / "report.md").read_text()


def test_stage_with_runs_besides_run_is_one_error_and_touches_no_run(tmp_path, dataset):  # noqa: F811
    """`stage` works on the run --run names; --runs beside it (the option of the other commands) made it work on
    the first run of --runs instead, without a word."""
    path = study_yaml(tmp_path, dataset)
    res = study("stage", "--config", path, "--run", "llama-a", "--runs", "hgrn2-a", "--stages", "export", check=False)
    assert res.returncode == 2 and one_error_line(res.stderr).startswith("error: stage works on one run: name it "
                                                                         "with --run alone"), res.stderr
    assert not (tmp_path / "t" / "state").exists()


def test_run_slurm_on_a_machine_without_slurm_is_one_error(tmp_path, dataset):  # noqa: F811
    path = study_yaml(tmp_path, dataset)
    res = study("run", "--config", path, "--slurm", "--sbatch", str(tmp_path / "no" / "sbatch"), check=False)
    line = one_error_line(res.stderr)
    assert res.returncode == 1 and line.startswith(f"error: {tmp_path / 'no' / 'sbatch'}: not found, this machine "
                                                   f"has no Slurm (nothing was submitted); run the study here without "
                                                   f"--slurm, or write the job scripts with --slurm --dry-run"), line
    assert not (tmp_path / "t" / "slurm" / "submissions.jsonl").exists()


def test_a_report_into_a_study_directory_that_cannot_be_written_is_one_error(tmp_path, dataset):  # noqa: F811
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = study("report", "--config", study_yaml(tmp_path, dataset, out=str(blocker / "study")), check=False)
    assert res.returncode == 2 and "error: study config: out: the study directory " \
        f"{blocker / 'study'} cannot be created or written" in one_error_line(res.stderr), res.stderr


def test_the_summary_names_the_run_a_stop_ended_apart_from_the_runs_not_reached(tmp_path, dataset, monkeypatch):  # noqa: F811
    """A stop in the middle of a run's training: the summary says the study stopped in that run (it continues
    from its checkpoint), and only the runs after it are not reached."""
    from scaling.study import load_study, plan_study
    from scaling.study import local
    from scaling.study.stages import TRAIN, StageStopped
    cfg = load_study(study_yaml(tmp_path, dataset))
    plans = plan_study(cfg)

    def stopped(study, plan, log=print):
        raise StageStopped(f"{plan.name}: training stopped at step 3 (signal)")
    monkeypatch.setitem(local.STAGE_FUNCTIONS, TRAIN, stopped)
    res = local.run_local(cfg, plans, (TRAIN,), log=lambda m: None)
    assert res["stopped"] == "stopped" and res["done"] == [] and res["stopped_in"] == [plans[0].name]
    lines = local.summary_lines(cfg, plans, (TRAIN,), res, None)
    assert lines[0].endswith(f"; stopped (stopped) in 1, not reached: {len(plans) - 1}"), lines[0]
    assert f"  stopped in: {plans[0].name} (the same command continues it where it stopped)" in lines
    assert f"  not reached: {', '.join(p.name for p in plans[1:])}" in lines


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

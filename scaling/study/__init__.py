"""Scaling studies as one job: a YAML config -> a plan of runs -> training, export and evaluation of every
run (locally one after another, or as Slurm job arrays with dependencies) -> fits, tables, plots and a
report. The entry point is launch/study.py; see docs/study.md.

    config.py  the study YAML and its checks        plan.py    runs, FLOPs, snapshot schedules, pretrain flags
    stages.py  train / export / evaluate of a run    local.py   the local executor
    slurm.py   job arrays and dependencies           status.py  what is done, running, failed
    report.py  fits, evaluation table, plots, report.md
"""
from scaling.study.config import StudyConfig, StudyConfigError, load_study, parse_study
from scaling.study.plan import RunPlan, format_plan, plan_study

__all__ = ["StudyConfig", "StudyConfigError", "load_study", "parse_study", "RunPlan", "plan_study", "format_plan"]

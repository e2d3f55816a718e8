"""Run a scaling study from one YAML file: plan every run, train, export and evaluate them (locally or on
Slurm), show what is done, and write the fits, tables, plots and report. See docs/study.md.

    python launch/study.py plan   --config study.yaml      # runs, N, tokens, FLOPs, snapshots; total compute
    python launch/study.py run    --config study.yaml      # locally, one run after another, then the report
    python launch/study.py run    --config study.yaml --slurm    # job arrays: train -> export+evaluate -> report
    python launch/study.py status --config study.yaml      # done / running / failed, per run and stage
    python launch/study.py report --config study.yaml      # Table 3, Figure 1, metric-vs-compute, report.md

Every stage skips finished work, so `run` again after a crash, a stop or a config change (a new size, a
larger token budget) does only what is missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# replace (not prepend) this folder on the path: its evaluate.py would shadow HF's `evaluate`, which lm-eval imports
sys.path[0] = str(Path(__file__).resolve().parents[1])

from scaling.study.config import StudyConfigError, load_study  # noqa: E402
from scaling.study.plan import format_plan, plan_study  # noqa: E402
from scaling.study.stages import RUN_STAGES  # noqa: E402


def _stages(s: str) -> tuple[str, ...]:
    stages = tuple(x.strip() for x in s.split(",") if x.strip())
    bad = [x for x in stages if x not in RUN_STAGES]
    if bad or not stages:
        raise argparse.ArgumentTypeError(f"stages must be a comma list of {', '.join(RUN_STAGES)}, got {s!r}")
    return stages


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", required=True, type=Path, help="the study YAML")
    common.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="replace a key of the config, dotted for nested keys, VALUE as YAML (repeatable): "
                             "--set tokens=4096 --set sizes=[l1d128] --set recipe.train.device=cpu")
    common.add_argument("--runs", nargs="+", metavar="RUN", help="only these runs (names as in the plan, arch-size)")
    pl = sub.add_parser("plan", parents=[common], help="print the plan and its total compute")
    pl.add_argument("--prepare", action="store_true",
                    help="also write the evaluation inputs (validation windows from the data; lm-eval requests for "
                         "evaluation.csr: replay), for evaluating on machines without the data or lm-eval")
    r = sub.add_parser("run", parents=[common], help="train, export, evaluate every run, then report")
    r.add_argument("--stages", type=_stages, default=RUN_STAGES, help="comma list of train,export,evaluate")
    r.add_argument("--deadline", type=float, help="stop cleanly after this many seconds (a run in training "
                                                   "checkpoints); run again to continue")
    r.add_argument("--no-report", action="store_true", help="skip the report at the end")
    r.add_argument("--slurm", action="store_true", help="submit job arrays to Slurm instead of running here")
    r.add_argument("--dry-run", action="store_true", help="with --slurm: write the job scripts, submit nothing")
    r.add_argument("--sbatch", default="sbatch", help=argparse.SUPPRESS)
    sub.add_parser("status", parents=[common], help="what is done, running, failed")
    sub.add_parser("report", parents=[common], help="fits, tables, plots and report.md from what is done")
    s = sub.add_parser("stage", parents=[common], help="run stages of one run (what a Slurm array task calls)")
    s.add_argument("--run", required=True, help="the run's name (arch-size)")
    s.add_argument("--stages", type=_stages, default=RUN_STAGES)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        study = load_study(args.config, overrides=args.overrides)
        plans = plan_study(study)
    except (StudyConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    names = [p.name for p in plans]
    if args.command == "stage" and args.runs:
        # `stage` works on one run, --run's: given --runs too it would pick one of them without a word
        print("error: stage works on one run: name it with --run alone (--runs is for plan, run, status and "
              "report)", file=sys.stderr)
        return 2
    wanted = getattr(args, "runs", None) or ([args.run] if getattr(args, "run", None) else None)
    if wanted:
        unknown = [w for w in wanted if w not in names]
        if unknown:
            print(f"error: no run {unknown} in the plan; runs: {', '.join(names)}", file=sys.stderr)
            return 2
        plans = [p for p in plans if p.name in wanted]

    if args.command == "plan":
        print(format_plan(study, plans))
        if args.prepare:
            from scaling.study.stages import check_paths, prepare_eval_inputs
            try:
                check_paths(study, ("evaluate",))
            except StudyConfigError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            prepare_eval_inputs(study)
        return 0
    if args.command == "status":
        from scaling.study.slurm import job_states
        from scaling.study.status import format_status, study_status
        print(format_status(study_status(study, plans, job_states(study))))
        return 0
    if args.command == "report":
        from scaling.study.stages import check_paths
        try:
            check_paths(study, ())  # the report is written into the study directory
        except StudyConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        report(study, plans)
        return 0
    if args.command == "stage":
        from scaling.study.local import STAGE_FUNCTIONS, STOPPABLE, Stopper
        from scaling.study.stages import RunBusy, StageStopped, run_claimed, tracked
        # SIGTERM / SIGUSR1 (a Slurm time-limit warning, scancel) end an evaluation between snapshots and tasks
        stopper = Stopper(None)
        stage = None
        try:
            with run_claimed(study, plans[0].name):
                for stage in args.stages:
                    extra = {"stop": lambda: stopper.reason} if stage in STOPPABLE else {}
                    tracked(study, plans[0].name, stage, STAGE_FUNCTIONS[stage], study, plans[0], **extra)
        except RunBusy as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except StageStopped as err:
            print(f"[study] {plans[0].name}: {err}; the same stage again continues it", file=sys.stderr)
            return 3
        except Exception as err:  # noqa: BLE001 - recorded with its traceback by `tracked`, as under `run`
            if stage is None:
                raise
            from scaling.study.stages import state_path
            print(f"error: {plans[0].name}: {stage} failed: {type(err).__name__}: {err} (traceback in "
                  f"{state_path(study, plans[0].name, stage)})", file=sys.stderr)
            return 1
        finally:
            stopper.close()
        return 0
    # run
    print(format_plan(study, plans), flush=True)
    if args.slurm:
        from scaling.study.slurm import submit
        from scaling.study.stages import check_paths
        try:
            check_paths(study, args.stages, data=False)  # the data is read on the cluster's nodes
            submit(study, plans, sbatch=args.sbatch, dry_run=args.dry_run)
        except StudyConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except (RuntimeError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    from scaling.study.local import run_local, summary_lines
    try:
        res = run_local(study, plans, args.stages, args.deadline)
    except (StudyConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    written = None
    if not args.no_report and not res["stopped"]:
        written = report(study, plan_study(study))
    print("\n".join(summary_lines(study, plans, args.stages, res, written)), flush=True)
    if res["failed"]:
        print("failed: " + "; ".join(f"{k}: {v}" for k, v in res["failed"].items()), file=sys.stderr)
        return 1
    # 3: not everything is done here (a stop, or runs left to another process); the same command continues
    return 3 if res["stopped"] or res["busy"] else 0


def report(study, plans) -> Path:
    """Status table, fits, evaluation table, plots and report.md; returns report.md's path."""
    from scaling.study.report import write_report
    from scaling.study.slurm import job_states
    from scaling.study.stages import report_claimed
    from scaling.study.status import format_status, study_status
    with report_claimed(study):
        table = format_status(study_status(study, plans, job_states(study)))
        print(table)
        return write_report(study, plans, table)


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(main))

"""Prepare a dataset from a data config: filter, dedup, tokenize into token shards for the loader.

    python launch/prepare_data.py --config launch/configs/data/shared_2to1.yaml --out data/shared_2to1
    # at scale: the parts as one Slurm array, then each merge stage as an array (--merge-plan: task counts)
    python launch/prepare_data.py --config C.yaml --out D --part $SLURM_ARRAY_TASK_ID --num-parts N --no-merge
    python launch/prepare_data.py --config C.yaml --out D --merge-stage exact --task $SLURM_ARRAY_TASK_ID
    ...  pairs, components, index, finish (each after the previous one has finished)
    python launch/prepare_data.py --config C.yaml --out D --merge-only      # all merge stages here
"""
import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.config import load_data_config  # noqa: E402
from data_pipeline.merge import STAGES, plan, run_task  # noqa: E402
from data_pipeline.prepare import merge, prepare, summary  # noqa: E402
from data_pipeline.sources import check_inputs, check_out_is_not_input  # noqa: E402
from pretrain.argtypes import non_negative_int  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="data config YAML (see docs/data.md)")
    p.add_argument("--out", required=True, help="output folder (use a fresh one per config)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (default: the CPUs this process may use, max 8)")
    p.add_argument("--part", type=int, default=None, help="prepare only this part (0-based)")
    p.add_argument("--num-parts", type=int, default=1, help="how many parts the input is split into")
    p.add_argument("--no-merge", action="store_true", help="do not run the merge (dedup + indexes) step")
    p.add_argument("--merge-only", action="store_true", help="only merge parts prepared earlier (all stages)")
    p.add_argument("--merge-stage", choices=STAGES, help="run one task of one merge stage (with --task)")
    p.add_argument("--task", type=non_negative_int, default=None, help="the task of --merge-stage (0-based)")
    p.add_argument("--merge-plan", action="store_true", help="print the merge stages and their task counts")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.num_parts < 1:
        p.error(f"--num-parts {a.num_parts}: out of range; allowed: >= 1")
    if a.part is not None and not 0 <= a.part < a.num_parts:
        p.error(f"--part {a.part}: out of range; allowed: 0 to {a.num_parts - 1} (--num-parts {a.num_parts})")
    if a.workers < 0:
        p.error(f"--workers {a.workers}: out of range; allowed: >= 0 (0: one per CPU, at most 8)")
    if a.task is not None and not a.merge_stage:
        p.error("--task goes with --merge-stage (which merge stage's task to run)")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        p.error(f"--out {a.out}: a file, not a folder; give a new folder for the dataset")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    cfg = load_data_config(a.config)
    if a.merge_plan:
        print(json.dumps(plan(cfg)))
        return 0
    check_out_is_not_input(cfg, Path(a.out), f"--config {a.config}")
    if a.merge_stage:
        if a.task is None:
            p.error("--merge-stage needs --task (0 .. tasks-1; --merge-plan prints the counts)")
        run_task(cfg, Path(a.out), a.merge_stage, a.task)
        return 0
    if a.merge_only:
        stats = merge(cfg, Path(a.out))
    else:
        check_inputs(cfg, f"--config {a.config}")
        stats = prepare(cfg, Path(a.out), a.workers, a.part, a.num_parts, not a.no_merge, not a.no_progress)
    if stats is not None:
        print(summary(stats))
        print(f"wrote {a.out}/train, {a.out}/val and {a.out}/stats.json")
        empty = [s["name"] for s in stats["sources"] if not sum(s["tokens_out"].values())]
        if len(empty) == len(stats["sources"]):
            raise ValueError(f"--config {a.config}: the dataset in {a.out} holds no tokens: {_removed(stats)}. "
                             f"{_advice(stats)}")
        for s in stats["sources"]:
            if s["name"] in empty:
                print(f"WARNING source {s['name']!r} contributed no tokens: {_removed({'sources': [s]})}",
                      file=sys.stderr)
    else:
        print(json.dumps({"part": a.part, "out": a.out}))
    return 0


def _removed(stats: dict) -> str:
    """Where the documents of `stats`' sources went, largest first (for an empty output's message)."""
    gone: dict[str, int] = {}
    docs_in = 0
    for s in stats["sources"]:
        docs_in += s["documents_in"]
        for k, v in s["removed_by_filter"].items():
            gone[f"filter {k}"] = gone.get(f"filter {k}", 0) + v
        gone["exact duplicates"] = gone.get("exact duplicates", 0) + s["exact_duplicates"]
        gone["near duplicates"] = gone.get("near duplicates", 0) + s["near_duplicates"]
        for k, v in (s["skipped_input"] or {}).items():
            gone[f"skipped input ({k})"] = gone.get(f"skipped input ({k})", 0) + v
    top = sorted(((v, k) for k, v in gone.items() if v), reverse=True)[:4]
    if not docs_in:  # every record skipped as input (wrong type or field, ...) or no record at all
        return "the inputs held no documents" + (" (" + ", ".join(f"{k}: {v}" for v, k in top) + ")" if top else "")
    return f"of {docs_in} documents read, removed by " + ", ".join(f"{k}: {v}" for v, k in top)


def _advice(stats: dict) -> str:
    """What to change for an empty output: the filters if they removed most, else the inputs."""
    docs_in = sum(s["documents_in"] for s in stats["sources"])
    filtered = sum(sum(s["removed_by_filter"].values()) for s in stats["sources"])
    if docs_in and filtered * 2 >= docs_in:
        return "Loosen those filters in the config's `filters:` section (docs/data.md), or check the inputs"
    return ("Check the inputs against the config: each source's `type`, `field`/`column` and `text_unit` "
            "(docs/data.md), and the warnings above, which name the files and lines skipped")


def main(argv=None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv, prog="prepare_data")


if __name__ == "__main__":
    sys.exit(main())

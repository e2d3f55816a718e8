"""Export a run's snapshots (or resume checkpoints, also DeepSpeed ZeRO ones) to self-contained model
directories RUN_DIR/exports/step_XXXXXXXX/ (model.safetensors + config.json), loadable with
models.load_pretrained on one device without DeepSpeed. See docs/checkpoints.md.

    python launch/export.py RUN_DIR              # every snapshot (the newest checkpoint if there are none)
    python launch/export.py RUN_DIR --all        # every snapshot and every retained checkpoint
    python launch/export.py RUN_DIR --step 1000 --dtype bf16
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints.export import DTYPES, export_run  # noqa: E402
from checkpoints.layout import CHECKPOINTS, SNAPSHOTS, parse_step  # noqa: E402
from pretrain.errors import run_cli  # noqa: E402


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="run directory (holds snapshots/ and checkpoints/)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every snapshot and every retained checkpoint")
    which.add_argument("--step", type=int, help="only this step (a snapshot, else a checkpoint)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights dtype of the export")
    p.add_argument("--force", action="store_true", help="export again even if already exported")
    args = p.parse_args(argv)
    if not args.run_dir.is_dir():
        raise NotADirectoryError(f"{args.run_dir} is not a directory (give a run directory, e.g. runs/tnl-70m)")
    step = parse_step(args.run_dir.resolve().name)
    if step is not None and args.run_dir.resolve().parent.name in (CHECKPOINTS, SNAPSHOTS):
        run = args.run_dir.resolve().parent.parent
        raise NotADirectoryError(f"{args.run_dir} is one checkpoint or snapshot, not a run directory: pass its run "
                                 f"and the step, launch/export.py {run} --step {step}")
    done = export_run(args.run_dir, args.step if args.step is not None else ("all" if args.all else "default"),
                      args.dtype, args.force)
    print(f"{len(done)} export(s) under {args.run_dir / 'exports'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

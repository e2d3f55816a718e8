"""Pretrain a model: `python launch/pretrain.py --arch tnl --size tiny` (one process, CPU or GPU),
`torchrun --nproc_per_node N launch/pretrain.py ...`, or `deepspeed launch/pretrain.py --zero 2 ...`.
All flags: `python launch/pretrain.py --help`. Errors and exit codes: docs/errors.md."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    try:
        from pretrain.trainer import main  # a Ctrl-C while torch imports ends here too, without a traceback
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)

"""Pretrain a model: `python launch/pretrain.py --arch tnl --size tiny` (one process, CPU or GPU),
`torchrun --nproc_per_node N launch/pretrain.py ...`, or `deepspeed launch/pretrain.py --zero 2 ...`.
All flags: `python launch/pretrain.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

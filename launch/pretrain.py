"""Pretrain a model: `python launch/pretrain.py --arch tnl --size tiny` (one process, CPU or GPU),
`torchrun --nproc_per_node N launch/pretrain.py ...`, or `deepspeed launch/pretrain.py --zero 2 ...`.
All flags: `python launch/pretrain.py --help`. Errors and exit codes: docs/errors.md."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    from pretrain.process_exit import exit_process
    try:
        from pretrain.trainer import main  # a Ctrl-C while torch imports ends here too, without a traceback
        code = main()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = 130
    exit_process(code)  # a rank of several: its exit status is the run's, never an abort in the teardown

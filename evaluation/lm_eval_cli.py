"""`python -m evaluation.lm_eval_cli ARGS`: lm-eval's own command line, with the `linscale` model
registered and evaluation/tasks/ (the local-data task configs) added to --include_path.

    python -m evaluation.lm_eval_cli --model linscale --model_args pretrained=EXPORT_DIR --tasks csr_local

As every linscale command, it runs under the user-error handler (pretrain.errors.run_cli): a bad input (an
export that does not exist or has no weights, a bad model_args value, a missing evaluation file) ends in one
`error:` line and exit code 2, not a traceback; LINSCALE_TRACEBACK=1 shows the traceback.
"""
from __future__ import annotations

import sys

import evaluation  # noqa: F401  (registers the model)
from evaluation.lm_eval_adapter import tasks_dir
from pretrain.errors import run_cli


def _main(argv: list[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv and not any(a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(tasks_dir())]
    sys.argv = [sys.argv[0]] + argv
    cli_evaluate()
    return 0


def main(argv: list[str] | None = None) -> int:
    """lm-eval's CLI on `argv` (default: the command line); returns the exit code."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

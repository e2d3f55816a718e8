"""`python -m evaluation.lm_eval_cli ARGS`: lm-eval's own command line, with the `linscale` model
registered and evaluation/tasks/ (the local-data task configs) added to --include_path.

    python -m evaluation.lm_eval_cli --model linscale --model_args pretrained=EXPORT_DIR --tasks csr_local
"""
from __future__ import annotations

import sys

import evaluation  # noqa: F401  (registers the model)
from evaluation.lm_eval_adapter import tasks_dir


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv and not any(a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(tasks_dir())]
    sys.argv = [sys.argv[0]] + argv
    cli_evaluate()


if __name__ == "__main__":
    main()

"""User errors and the one top-level handler every entry point in launch/ runs its main under.

A user error is a bad flag, config, file, directory or environment: something the user fixes. Its
message names the input, says what is wrong and how to fix it; the command prints it as one line
(`error: ...`) and exits non-zero, never with a Python traceback. Anything else is a bug and keeps its
traceback. `LINSCALE_TRACEBACK=1` shows the traceback of a user error too (for debugging linscale).

Exit codes: 0 done; 2 bad input (as argparse); 3 training stopped itself (too many non-finite steps);
4 a checkpoint or another output could not be written (a full disk); 130 interrupted (Ctrl-C before training started,
or a second Ctrl-C).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Sequence

EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_SAVE_FAILED = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what the shell reports for `yes | head`


class UserError(Exception):
    """Bad input the user can fix; the message says what is wrong and what to do. `exit_code` is what the
    command exits with."""
    exit_code = EXIT_USAGE


class OutputFailed(UserError):
    """A file of the run could not be written (a full disk); the message names the file and the device."""
    exit_code = EXIT_SAVE_FAILED


class ConfigError(UserError, ValueError):
    """A flag or config value outside what is allowed (a ValueError, so callers that catch those still do)."""


# Errors of the standard library that reach the top level only from our own checks of user input (a file
# that does not exist, a value out of range, a directory that cannot be written, a YAML typo, a package
# that is not installed). The packages below pretrain/ raise these with a full message.
def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [UserError, ValueError, FileNotFoundError, NotADirectoryError,
                                        IsADirectoryError, PermissionError, ImportError]
    try:
        import yaml
        types.append(yaml.YAMLError)
    except ImportError:  # pragma: no cover - yaml is a dependency
        pass
    try:
        from checkpoints.errors import CheckpointError
        types.append(CheckpointError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def describe(err: BaseException) -> str:
    """One line for a user error (YAML errors get file, line and column)."""
    try:
        import yaml
    except ImportError:  # pragma: no cover
        yaml = None
    if yaml is not None and isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        m = err.problem_mark
        where = f"{m.name}, line {m.line + 1}, column {m.column + 1}"
        what = " ".join(x for x in (err.context, err.problem) if x)
        if isinstance(err, yaml.constructor.ConstructorError):  # well-formed YAML with a bad value or a key twice
            return f"YAML error in {where}: {what}"
        return f"YAML syntax error in {where}: {what}; fix the file (YAML needs consistent indentation, " \
               f"`key: value` pairs and closed brackets/quotes)"
    if yaml is not None and isinstance(err, yaml.YAMLError):
        return f"YAML error: {' '.join(str(err).split())}"
    text = " ".join(str(err).split()) if "\n" not in str(err).strip() else str(err).strip()
    return text or type(err).__name__


def exit_code(err: BaseException) -> int:
    return int(getattr(err, "exit_code", EXIT_USAGE))


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
            prog: str | None = None) -> int:
    """Run `main(argv)` and turn user errors into one `error:` line and an exit code (see the module
    docstring). Returns the exit code (0 when main returns None)."""
    if os.environ.get("LINSCALE_TRACEBACK", "0") not in ("", "0"):
        rc = main(argv)
        return 0 if rc is None else int(rc)
    prefix = f"{prog}: " if prog else ""
    try:
        rc = main(argv)
    except KeyboardInterrupt:
        print(f"\n{prefix}interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (`model_info.py | head`): nothing more to say to it. stdout goes to
        # /dev/null so that the interpreter's last flush at exit does not raise the same error again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except _user_error_types() as err:  # noqa: B030 - a tuple computed once per call
        if getattr(err, "quiet", False):  # the same error is reported by rank 0
            return exit_code(err)
        rank = os.environ.get("RANK")
        tag = f"[rank {rank}] " if rank not in (None, "", "0") else ""
        print(f"{tag}{prefix}error: {describe(err)}", file=sys.stderr, flush=True)
        return exit_code(err)
    except OSError as err:  # a full disk or quota is the user's to fix; any other OS error keeps its traceback
        from checkpoints.disk import disk_full_cause, write_failure
        if disk_full_cause(err) is None:
            raise
        where = f"{err.filename}: " if getattr(err, "filename", None) else ""
        path = Path(err.filename) if getattr(err, "filename", None) else Path.cwd()
        print(f"{prefix}error: {where}cannot write: {write_failure(path, err)}; free space there, or write to a "
              f"bigger disk (for a run: move the run directory and pass it as --out, then --resume auto)",
              file=sys.stderr, flush=True)
        return EXIT_SAVE_FAILED
    return 0 if rc is None else int(rc)

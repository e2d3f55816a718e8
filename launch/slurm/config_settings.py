"""The run-directory settings of a training `--config` file, for launch/slurm/pretrain.sbatch:

    python launch/slurm/config_settings.py CONFIG   ->   three lines: out, resume, overwrite

Each line is empty where the file does not set it; overwrite is `true` or `false`. The script treats them
as it treats the flags `--out`, `--resume` and `--overwrite` (a flag on the command line wins): it must
inspect and requeue the directory the trainer writes, and give a restart `--resume auto` rather than the
file's first-attempt `resume`/`overwrite`. A run's config.json given as `--config` carries neither
(pretrain.config.from_run_config). A file that cannot be read ends in one `error:` line and exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pretrain.config import from_run_config, load_yaml_mapping  # noqa: E402
from pretrain.errors import ConfigError, run_cli  # noqa: E402


def run_settings(path: Path) -> tuple[str, str, str]:
    """(out, resume, overwrite) as the file sets them, '' where it does not."""
    raw = from_run_config(load_yaml_mapping(Path(path), "--config"), str(path))
    values = []
    for key in ("out", "resume"):
        v = raw.get(key)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"--config {path}: `{key}` must be a path (a string), got {v!r}")
        values.append(v or "")
    overwrite = raw.get("overwrite")
    if overwrite is not None and not isinstance(overwrite, bool):
        raise ConfigError(f"--config {path}: `overwrite` must be true or false, got {overwrite!r}")
    values.append("" if overwrite is None else str(overwrite).lower())
    if any("\n" in v for v in values):
        raise ConfigError(f"--config {path}: a path with a line break in `out` or `resume`")
    return tuple(values)


def _main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: {Path(sys.argv[0]).name} CONFIG", file=sys.stderr)
        return 2
    print("\n".join(run_settings(Path(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(_main, prog="config_settings.py"))

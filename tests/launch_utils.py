"""Load a script of launch/ as a module, for tests of its functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_launch_script(name: str) -> ModuleType:
    """launch/<name>.py as a module. By file, not through sys.path: launch/ also holds pretrain.py, which
    would shadow the package of that name."""
    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

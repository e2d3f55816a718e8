"""Command lines derived from a config dataclass: every field one flag (`--batch-size` -> batch_size), so a
flag and its field cannot drift apart. Used by the entry points with one flat config object
(launch/evaluate.py, launch/fit_scaling.py); the run config of launch/pretrain.py, nested in sections and
layered over YAML, has its own parser in `pretrain.config`.

A field's `metadata` says how its flag looks:
    help       the help text
    choices    the values allowed (argparse refuses others, naming them)
    metavar    the value's name in the help
    type       the argparse type, where the annotation's is too loose (pretrain.argtypes: ranges)
    positional the field is a positional argument (lists: one or more)
    hidden     a flag kept working but left out of --help
    cli        False: the field has no flag (set by code only)
The flag's type follows the annotation: bool fields are switches (`--force`), list[...] take one or more
values, int, float, Path and str parse as such; `X | None` fields default to None.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_SCALARS = {"int": int, "float": float, "Path": Path, "str": str}


def _kind(annotation: Any) -> tuple[str, bool]:
    """('bool' | 'int' | 'float' | 'Path' | 'str', is_list) from a field's annotation (a string under
    `from __future__ import annotations`)."""
    t = str(annotation).replace("typing.", "").replace(" | None", "").replace("Optional[", "").strip()
    is_list = t.startswith("list[")
    if is_list:
        t = t[len("list["):-1]
    for name in ("bool", "float", "int", "Path"):
        if t == name:
            return name, is_list
    return "str", is_list


def option(default: Any = None, *, help: str = "", factory: Any = None, **meta: Any) -> Any:
    """A config field with its flag's metadata: `option(8, help="...")`, `option(factory=list, ...)`
    for a mutable default, `option(positional=True)` for a required positional argument."""
    meta = {"help": help, **meta}
    if meta.get("positional"):
        return dataclasses.field(metadata=meta)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument per field of the dataclass `cls` (see the module docstring)."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("cli", True) is False:
            continue
        kind, is_list = _kind(f.type)
        help_text = argparse.SUPPRESS if meta.get("hidden") else meta.get("help", "")
        if meta.get("positional"):
            parser.add_argument(f.name, nargs="+" if is_list else None, type=_SCALARS[kind], help=help_text,
                                metavar=meta.get("metavar"))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs a default (or make the field positional)")
        if help_text is not argparse.SUPPRESS and not (default is None or default is False or default in ([], "")):
            help_text = f"{help_text} (default {default})".strip()
        if kind == "bool" and not is_list:
            parser.add_argument(flag_name(f), dest=f.name, action="store_true", default=default, help=help_text)
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "type": meta.get("type", _SCALARS[kind]), "default": default,
                                  "help": help_text}
        if is_list:
            kwargs["nargs"] = "+"
        for key in ("choices", "metavar"):
            if key in meta:
                kwargs[key] = meta[key]
        parser.add_argument(flag_name(f), **kwargs)


def config_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, cls)
    return parser


def parse_config_args(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """An instance of the dataclass `cls` from the command line `argv` (default: sys.argv[1:])."""
    args = config_parser(cls, description).parse_args(argv)
    return cls(**vars(args))

"""The architecture registry: the one place architectures are listed.

Adding an architecture: write `models/<name>.py` with its token mixer and a module-level `SPEC = ArchSpec(...)`
(models.spec), and add that spec to `BUILTIN` below. Code outside the package (a test, a plug-in) calls
`register_arch(spec)` instead. docs/architectures.md walks through it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Iterator

from models import cosformer2, hgrn2, llama, tnl
from models.spec import ArchSpec

BUILTIN: tuple[ArchSpec, ...] = (llama.SPEC, tnl.SPEC, hgrn2.SPEC, cosformer2.SPEC)

_SPECS: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}


def register_arch(spec: ArchSpec, *, replace: bool = False) -> ArchSpec:
    """Make `spec` buildable by name (`--arch`, ModelConfig.arch). Names and aliases are lower case and may
    not collide with another architecture's unless `replace`."""
    names = (spec.name, *spec.aliases)
    if any(n != n.lower() for n in names):
        raise ValueError(f"architecture names are lower case: {names}")
    if not replace:
        taken = [n for n in names if n in _SPECS or n in _ALIASES]
        if taken:
            raise ValueError(f"architecture name(s) {taken} already registered; pick another name or pass replace=True")
    _SPECS[spec.name] = spec
    for alias in spec.aliases:
        _ALIASES[alias] = spec.name
    return spec


def unregister_arch(name: str) -> None:
    """Remove an architecture registered with `register_arch` (the built-in ones stay)."""
    if name in {s.name for s in BUILTIN}:
        raise ValueError(f"{name!r} is a built-in architecture")
    spec = _SPECS.pop(name)
    for alias in spec.aliases:
        _ALIASES.pop(alias, None)


def canonical_arch(arch: str) -> str:
    """The registry name of `arch` (case-insensitive; aliases resolved); a clear error for unknown names."""
    if not isinstance(arch, str):
        raise ValueError(f"arch must be an architecture name, got {arch!r}; choose from {', '.join(_SPECS)}")
    a = arch.lower()
    a = _ALIASES.get(a, a)
    if a not in _SPECS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(_SPECS)} "
                         f"(aliases: {', '.join(f'{k}->{v}' for k, v in _ALIASES.items())})")
    return a


def get_arch(arch: str) -> ArchSpec:
    """The spec of `arch` (any accepted name)."""
    return _SPECS[canonical_arch(arch)]


def arch_names() -> tuple[str, ...]:
    """The registered architectures, in registration order (the paper's four first)."""
    return tuple(_SPECS)


def arch_title(arch: str) -> str:
    """The printed name of `arch`; the name itself for an architecture that is not registered."""
    spec = _SPECS.get(_ALIASES.get(arch, arch))
    return spec.title if spec else arch


def arch_order(arch: str) -> int:
    """Sort key: registration order, unknown names last."""
    names = arch_names()
    return names.index(arch) if arch in names else len(names)


class AcceptedArchNames(Sequence):
    """Every accepted `--arch` value (names, then aliases), read from the registry at each use, so an
    architecture registered after a config class was defined is still a valid choice."""

    def _names(self) -> tuple[str, ...]:
        return (*_SPECS, *_ALIASES)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


ACCEPTED_ARCH_NAMES = AcceptedArchNames()

for _spec in BUILTIN:
    register_arch(_spec)

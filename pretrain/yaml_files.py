"""YAML config files read with a key given twice refused (training, study and data configs alike).

Torch-free, so that the data tools can read their configs without importing the training stack."""
from __future__ import annotations

from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last silently, so a
    `lr:` written again further down a long config would replace the first without a word."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: PyYAML's own error names it
                break
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} a second time (first at line {first.start_mark.line + 1}); "
                    f"keep one of them", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def yaml_load(stream) -> Any:
    """yaml.safe_load, refusing a key repeated in one mapping (the error names both lines)."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass

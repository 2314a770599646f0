"""Classes chosen by name on the command line (`--reasoning-parser`, `--tool-call-parser`).

Each family keeps a table `name -> "module:Class"`, so adding one is one module and one
line, and only the chosen class's module is ever imported (a parser may pull in what the
others do not need).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping


def import_class(path: str) -> type:
    """`"package.module:Class"` -> the class, its module imported now."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def named_class(kind: str, table: Mapping[str, str], name: str) -> type:
    """The class `table` lists as `name`; an unknown name raises ValueError naming the
    `kind` ("reasoning parser") and the known names, sorted."""
    if name not in table:
        raise ValueError(f"Unknown {kind} {name!r}; Pagoda has {', '.join(sorted(table))}.")
    return import_class(table[name])

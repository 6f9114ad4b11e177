"""`option(default, help)`: a config dataclass field that becomes a command-line flag (`cli`).

Apart from `cli` so that `configs` can declare its fields with it while `cli` reads `configs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def option(
    default: Any,
    help: str | None = None,
    *,
    positional: bool = False,
    deprecated: Sequence[str] = (),
) -> Any:
    """A dataclass field with a default and the help text its command-line flag shows.

    Without `help`, the field gives a new default to a flag a base config declared (a pipeline's
    `global_batch_size: int = option(256)` over the library's), and keeps that flag's help.
    `positional=True` makes it an optional positional argument instead of a flag (an input file).
    `{name}` in the help is replaced by the config class's attribute `name` (e.g. `{data_folder}`).
    `deprecated`: the flag's former names, still accepted for one version with a warning.
    """
    metadata = {"positional": positional, "deprecated": tuple(deprecated)}
    if help is not None:
        metadata["help"] = help
    return dataclasses.field(default=default, metadata=metadata)


def help_of(config_class: type, name: str) -> str:
    """A field's help: its own, else that of the nearest base config declaring the field."""
    for klass in config_class.__mro__:
        field = getattr(klass, "__dataclass_fields__", {}).get(name)
        if field is not None and "help" in field.metadata:
            return str(field.metadata["help"])
    return ""

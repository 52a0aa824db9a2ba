"""Settings written once: every option of a service is one field of a frozen dataclass.

A field made with `option()` carries its default, its --help text and what its flag needs beyond
what its type implies. A service's flags, the keys of its mesh.toml table and the command line
`stagemesh up` hands the service are all read off those fields, so an option added later is its
field (and its rows in docs/CONFIG.md) and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any

# add_argument keywords a field's annotation implies; a tuple field is a flag given once per item.
_IMPLIED: dict[str, dict[str, Any]] = {
    "bool": {"action": argparse.BooleanOptionalAction},
    "int": {"type": int},
    "float": {"type": float},
}


def option(default: Any, help: str, *, mesh: bool = True, **flag: Any) -> Any:
    """A settings field. `mesh`: False for an option that `stagemesh up` sets itself (a bound
    address, the mesh's [security] files), so it is no key of the service's mesh.toml table.
    `flag`: add_argument keywords beyond those the annotation implies (choices, metavar, a
    parsing `type`, action)."""
    return dataclasses.field(default=default, metadata={"help": help, "mesh": mesh, "flag": flag})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, options: Iterable[dataclasses.Field], *, show_default: bool) -> None:
    """One flag per field, in the order given. `show_default`: append "(default: ...)" to each
    help text (else the texts say it themselves)."""
    for f in options:
        text = f.metadata["help"] + (f" (default: {f.default!r})" if show_default else "")
        implied = _IMPLIED.get(f.type if isinstance(f.type, str) else f.type.__name__, {})
        # argparse appends to a list default; the field keeps an (immutable) tuple.
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        parser.add_argument(flag(f.name), default=default, help=text, **{**implied, **f.metadata["flag"]})


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` as parsed into `args` (repeated flags as tuples)."""
    parsed = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return {name: tuple(v) if isinstance(v, list) else v for name, v in parsed.items()}


def mesh_keys(cls: type) -> list[str]:
    """The keys of the service's mesh.toml table: its fields but those `stagemesh up` sets."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("mesh", True)]


def to_flags(settings: Any) -> list[str]:
    """The command line that gives a service these settings; unset (None or "") options are left
    to the service's defaults."""
    out: list[str] = []
    for f in dataclasses.fields(settings):
        value, name = getattr(settings, f.name), flag(f.name)
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        elif isinstance(value, tuple):
            out += [part for item in value for part in (name, str(item))]
        elif value is not None and value != "":
            out += [name, str(value)]
    return out

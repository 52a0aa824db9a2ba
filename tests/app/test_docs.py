"""Every flag of every command is documented in docs/CONFIG.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from stagemesh.cli import _parser
from stagemesh.core import envflags

DOC = (Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md").read_text()


def test_every_flag_is_documented():
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for command, parser in sub.choices.items():
        section = DOC.split(f"### `stagemesh {command}`", 1)
        body = section[1].split("###", 1)[0] if len(section) == 2 else ""
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and f"`{flag}" not in body and f", {flag}`" not in body:
                    missing.append(f"{command} {flag}")
    assert not missing, f"undocumented flags: {missing}"


SERVICE_COMMANDS = ("up", "gateway", "stage", "cache")


def environment_table() -> str:
    """The table of docs/CONFIG.md's "Environment variables of the service commands", as the
    parsers give it: one row per variable, the commands that read it, what kind of value it takes."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    rows: dict[tuple[str, str, str], list[str]] = {}
    for command in SERVICE_COMMANDS:
        for action, name in envflags.bindings(sub.choices[command]):
            kind = "boolean" if envflags.is_boolean(action) else "list" if envflags.is_list(action) else "value"
            rows.setdefault((name, str(envflags.long_flag(action)), kind), []).append(command)
    lines = ["| variable | flag | commands | value |", "|---|---|---|---|"]
    lines += [f"| `{name}` | `{flag}` | {', '.join(c)} | {kind} |" for (name, flag, kind), c in sorted(rows.items())]
    return "\n".join(lines)


def test_every_variable_of_the_service_commands_is_documented():
    section = DOC.split("## Environment variables of the service commands", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    expected = environment_table()
    assert table == expected, f"docs/CONFIG.md's table of variables should read:\n{expected}"

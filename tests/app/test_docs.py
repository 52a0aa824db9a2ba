"""Every flag of every command is documented in docs/CONFIG.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from stagemesh.cli import _parser

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

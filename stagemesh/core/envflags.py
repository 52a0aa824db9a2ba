"""STAGEMESH_* environment variables for the flags of the service commands (docs/CONFIG.md).

A parser that reads the environment gives every long flag `--some-flag` a variable,
STAGEMESH_SOME_FLAG. A variable that is set and not empty acts as if its flag had been given on
the command line with that value, so argparse's own type and choices check it; a flag that is on
the command line wins over its variable. A list flag (one given once per item, like the gateway's
`--stage`) takes whitespace-separated items; a flag without a value (`--enable-dlo`,
`--no-enable-dlo`) takes a boolean: 1/true/yes/on or 0/false/no/off. Flags added to a parser later
get their variable with no further code.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

PREFIX = "STAGEMESH_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
# Actions that accumulate into their destination: a sentinel there would break them, None does not.
_ACCUMULATING = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction)
_NOT_GIVEN = object()
# variable -> (flag, destination) of each value this process took from the environment, so that a
# refusal after parsing (a value argparse's type accepts but the service does not) can name it.
_taken: dict[str, tuple[str, str]] = {}


def variable(action: argparse.Action) -> str | None:
    """The variable of a flag: from its first long option string. None for help, version, an
    alias (a flag whose default is SUPPRESS: it shares its main flag's variable) and positionals."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.default is argparse.SUPPRESS:
        return None
    flag = long_flag(action)
    return PREFIX + flag[2:].upper().replace("-", "_") if flag else None


def long_flag(action: argparse.Action) -> str | None:
    """The first long option string (`--x` of `--x/--no-x`)."""
    return next((o for o in action.option_strings if o.startswith("--")), None)


def is_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or isinstance(action.nargs, int)


def is_boolean(action: argparse.Action) -> bool:
    return action.nargs == 0


def bindings(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.Action, str]]:
    """(flag, variable) for every flag of `parser` that has a variable."""
    for action in parser._actions:
        name = variable(action)
        if name is not None:
            yield action, name


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser that reads STAGEMESH_* variables once `read_environment` made it do so
    (only the service commands do: a client command's parser is left as argparse makes it)."""

    reads_environment = False

    def parse_known_args(  # type: ignore[override]  # one signature for argparse's overloads
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> Any:
        if not self.reads_environment:
            return super().parse_known_args(args, namespace)
        args = list(args) if args is not None else None
        parsed, extras = super().parse_known_args(args, namespace)  # help, usage errors: as without it
        given = self._given(args)
        for action, name in bindings(self):
            raw = os.environ.get(name, "")
            if raw and action.dest not in given:
                self._apply(parsed, action, name, raw)
                _taken[name] = (long_flag(action) or name, action.dest)
        return parsed, extras

    def _given(self, args: list[str] | None) -> set[str]:
        """Destinations set on the command line: the arguments parsed again, sentinels for defaults."""
        sentinels = {a: None if isinstance(a, _ACCUMULATING) else _NOT_GIVEN for a, _ in bindings(self)}
        saved = {action: action.default for action in sentinels}
        try:
            for action, sentinel in sentinels.items():
                action.default = sentinel
            again, _ = super().parse_known_args(args, argparse.Namespace())
        finally:
            for action, default in saved.items():
                action.default = default
        return {a.dest for a, sentinel in sentinels.items() if getattr(again, a.dest, sentinel) is not sentinel}

    def _apply(self, namespace: argparse.Namespace, action: argparse.Action, name: str, raw: str) -> None:
        try:
            if is_boolean(action):
                word = raw.strip().lower()
                if word not in TRUE + FALSE:
                    raise argparse.ArgumentError(action, f"not a boolean; allowed: {', '.join(TRUE + FALSE)}")
                if isinstance(action, argparse.BooleanOptionalAction):
                    setattr(namespace, action.dest, word in TRUE)
                elif word in TRUE:
                    action(self, namespace, [], name)
            elif isinstance(action, argparse._AppendAction):
                for item in raw.split():  # one item per repetition of the flag
                    action(self, namespace, self._get_values(action, [item]), name)
            else:
                action(self, namespace, self._get_values(action, raw.split() if is_list(action) else [raw]), name)
        except argparse.ArgumentError as exc:
            self.error(f"environment variable {name}={raw!r} (for {long_flag(action)}): {exc.message}")


def explain(message: str) -> str:
    """`message`, with the variables that set the flags (or the settings of the same name) it
    names: "--port: ... (--port was taken from STAGEMESH_PORT)"."""
    named = [
        f"{flag} was taken from {name}"
        for name, (flag, dest) in _taken.items()
        if any(re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", message) for word in (flag, dest))
    ]
    return f"{message} ({'; '.join(named)})" if named else message


def read_environment(parser: argparse.ArgumentParser) -> None:
    """Make `parser` (an EnvParser) read the variables of its flags; each flag's help names its
    variable."""
    if not isinstance(parser, EnvParser):
        raise TypeError(f"{parser.prog}: environment variables need an EnvParser, not {type(parser).__name__}")
    parser.reads_environment = True
    for action, name in bindings(parser):
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {name}]".lstrip()

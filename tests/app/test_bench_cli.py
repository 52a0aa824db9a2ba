"""The benchmarks' command lines, checked without running a benchmark: every script in bench/ and
bench/investigations/ builds its parser (`build_parser()`) on a machine without a GPU, accepts
`--output`, keeps its older spellings as aliases of the shared options, and parses every
`python -m bench.NAME ...` command the docs quote."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts)
    for folder in ("bench", "bench/investigations")
    for path in (REPO / folder).glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()
)
# older spelling -> the destination of the shared option it stands for, and a value to give it
OLD_SPELLINGS = {
    "--json": ("output", ["x.json"], "x.json"),
    "--out": ("output", ["x.json"], "x.json"),
    "--rounds": ("repeats", ["3"], 3),
    "--cycles": ("repeats", ["3"], 3),
    "--passes": ("repeats", ["3"], 3),
    "--folder": ("model_dir", ["some/folder"], "some/folder"),
    "--tiny": ("preset", [], "tiny-flux"),
    "--tiny-flux": ("preset", [], "tiny-flux"),
    "--model": ("preset", ["flux"], "flux"),
}
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def parser_of(script: str) -> argparse.ArgumentParser:
    return importlib.import_module(script).build_parser()


def required_positionals(parser: argparse.ArgumentParser) -> list[str]:
    """A placeholder for each positional argument the parser requires (the plots' JSON source)."""
    return ["placeholder" for a in parser._actions if not a.option_strings and a.nargs is None]


def test_every_script_is_found():
    assert "bench.dlo" in SCRIPTS and "bench.investigations.fp8_rebuild" in SCRIPTS
    assert not any(name.endswith(("common", "meshes", "serving")) for name in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_accepts_output(script):
    parser = parser_of(script)
    args = parser.parse_args([*required_positionals(parser), "--output", "result.file"])
    assert args.output == "result.file"


@pytest.mark.parametrize("script", SCRIPTS)
def test_shared_options_come_from_the_common_helpers(script):
    """bench/common.py's helpers name the value of each shared option (a hand-made one would not)."""
    metavars = {"--output": ("PATH", "PNG"), "--repeats": ("N",), "--model-dir": ("PATH",)}
    parser = parser_of(script)
    for flag, expected in metavars.items():
        action = parser._option_string_actions.get(flag)
        assert action is None or action.metavar in expected, f"{script}: {flag} is not added by bench/common.py"
    preset = parser._option_string_actions.get("--preset")
    assert preset is None or "the model: " in preset.help, f"{script}: --preset is not added by bench/common.py"


@pytest.mark.parametrize("script", SCRIPTS)
def test_older_spellings_are_aliases_of_the_shared_options(script):
    parser = parser_of(script)
    for flag, (dest, values, parsed) in OLD_SPELLINGS.items():
        action = parser._option_string_actions.get(flag)
        if action is None:
            continue
        assert action.dest == dest, f"{script}: {flag} goes to {action.dest}, not {dest}"
        new = "--" + dest.replace("_", "-")
        assert new in parser._option_string_actions, f"{script}: {flag} without {new}"
        args = parser.parse_args([*required_positionals(parser), flag, *values])
        assert getattr(args, dest) == parsed, f"{script}: {flag} {values} gave {getattr(args, dest)!r}"


def test_model_family_keeps_the_size_chosen():
    parser = parser_of("bench.dlo")
    assert parser.parse_args([]).preset == "flux-sized"
    assert parser.parse_args(["--model", "flux"]).preset == "flux"
    assert parser.parse_args(["--model", "flux", "--tiny-flux"]).preset == "tiny-flux"
    assert parser.parse_args(["--tiny-flux", "--model", "flux"]).preset == "tiny-flux"
    assert parser.parse_args(["--model", "dit", "--preset", "tiny"]).preset == "tiny"
    assert parser.parse_args(["--preset", "tiny", "--model", "dit"]).preset == "tiny"


def test_plots_take_the_figure_as_an_option_or_as_before():
    parser = parser_of("bench.plot_dlo")
    assert parser.parse_args(["r.json", "old.png"]).output == "old.png"
    assert parser.parse_args(["r.json", "--output", "new.png"]).output == "new.png"
    assert parser.parse_args(["r.json"]).output == "docs/img/dlo_flux.png"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_does_not_edit_sys_path(script):
    source = (REPO / Path(*script.split("."))).with_suffix(".py").read_text()
    assert "sys.path" not in source, f"{script} edits sys.path; it runs as `python -m {script}`"


def documented_commands(text: str) -> list[str]:
    """`python -m bench...` commands in a markdown text: inline code spans (which may wrap lines)
    and the lines of code blocks (a trailing backslash continues a line, `#` starts a comment)."""
    found = []
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            found.append(line.split(" #", 1)[0])
    inline = re.sub(r"```.*?```", "", text, flags=re.S)
    found += re.findall(r"`([^`]+)`", inline)
    commands = []
    for span in found:
        span = " ".join(span.split())
        start = re.search(r"python -m bench\.[a-z_.]+( |$)", span)  # not a placeholder such as bench.NAME
        if start:
            commands.append(span[start.start() :].replace("[", "").replace("]", ""))
    return commands


DOCUMENTED = sorted(
    {(doc.relative_to(REPO).as_posix(), c) for doc in DOCS for c in documented_commands(doc.read_text())}
)


def test_the_docs_quote_commands():
    assert len(DOCUMENTED) > 30
    old_form = re.compile(r"python3? (\S+ )?bench/\S+\.py")
    for doc in DOCS:
        assert not old_form.search(" ".join(doc.read_text().split())), f"{doc}: a bench/X.py command; use python -m"


@pytest.mark.parametrize(("doc", "command"), DOCUMENTED)
def test_documented_command_parses(doc, command):
    # a one-letter placeholder (`--concurrency C`, one run per value of C) stands for a number
    words = ["1" if re.fullmatch(r"[A-Z]", word) else word for word in shlex.split(command)]
    script = words[2]
    assert script in SCRIPTS, f"{doc}: {command}: no such script"
    try:
        parser_of(script).parse_args(words[3:])
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{command}` does not parse (exit {exc.code})")

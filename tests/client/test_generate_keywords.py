"""generate()'s keywords, written once as GenerateOptions: a type checker still refuses a
misspelled one or a value of the wrong type, and so does the client at run time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stagemesh.client import GenerateOptions
from stagemesh.client.requests import KEYWORDS, generation_params

REPO = Path(__file__).resolve().parents[2]

# Each line marked `# refused: NAME` must get a mypy error naming NAME; no other line may get one.
CALLS = """\
import stagemesh

client = stagemesh.Client()
one: stagemesh.GenerationResult = client.generate("a", width=64, output_format="jpeg", timeout=5.0)
many: list[stagemesh.GenerationResult] = client.generate("a", num_images=2, on_progress=print)
options: stagemesh.GenerateOptions = {"steps": 4, "seed": 1, "request_id": "r-1"}
either = client.generate("a", **options)
client.generate("a", widht=64)  # refused: widht
client.generate("a", output_format="gif")  # refused: generate
client.generate("a", num_images="2")  # refused: generate


async def main(aclient: stagemesh.AsyncClient) -> None:
    first: stagemesh.GenerationResult = await aclient.generate("a", strength=0.5, init_image=b"")
    listed: list[stagemesh.GenerationResult] = await aclient.generate("a", num_images=3)
    await aclient.generate("a", stpes=3)  # refused: stpes
"""


def test_mypy_refuses_a_misspelled_keyword_and_a_wrong_value(tmp_path):
    snippet = tmp_path / "calls.py"
    snippet.write_text(CALLS)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--cache-dir", str(tmp_path / "cache")]
        + ["--follow-imports=silent", "--no-error-summary", str(snippet)],
        cwd=REPO,  # mypy finds this checkout's stagemesh from here
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors: dict[int, str] = {}
    for match in re.finditer(r"^.*calls\.py:(\d+): error: (.*)$", checked.stdout, re.MULTILINE):
        errors[int(match.group(1))] = errors.get(int(match.group(1)), "") + match.group(2)
    expected = {
        number: marked.group(1)
        for number, line in enumerate(CALLS.splitlines(), start=1)
        if (marked := re.search(r"# refused: (\w+)", line))
    }
    assert set(errors) == set(expected), checked.stdout + checked.stderr
    for number, name in expected.items():
        assert f'"{name}"' in errors[number], errors[number]


def test_the_keywords_are_the_documented_ones():
    api = (REPO / "docs" / "API.md").read_text()
    documented = re.search(r"`generate\(prompt, \*, ([^)]*)\)`", api)
    assert documented is not None
    names = {name.split("=")[0] for name in documented.group(1).split(", ")}
    assert names == KEYWORDS | {"on_progress"}
    assert set(GenerateOptions.__optional_keys__) == KEYWORDS  # every keyword may be left out


def test_a_misspelled_keyword_is_refused_at_run_time_too():
    with pytest.raises(TypeError, match="unexpected keyword argument 'widht'"):
        generation_params("a", widht=64)  # type: ignore[call-arg]


def test_left_out_and_none_are_the_same():
    assert generation_params("a") == generation_params("a", width=None, seed=None, timeout=None, request_id=None)
    assert generation_params("a").output_format == generation_params("a", output_format="png").output_format


def test_adapters_are_a_mapping_or_names_and_pairs():
    def sent(adapters) -> list[tuple[str, float]]:
        return [(a.name, a.scale) for a in generation_params("a", adapters=adapters).adapters]

    assert sent({"ink": 0.5, "film": 1.5}) == [("ink", 0.5), ("film", 1.5)]
    assert sent(["ink", ("film", 0.25)]) == [("ink", 1.0), ("film", 0.25)]
    assert sent(None) == [] and sent([]) == []
    with pytest.raises(TypeError, match="not the string 'ink'"):
        generation_params("a", adapters="ink")

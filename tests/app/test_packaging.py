"""The wheel carries what an installation needs: the license, the API's .proto files, the typing
marker, the playground's static files and complete metadata; it is built from what the Dockerfile
copies, so the image's install step has everything it reads."""

from __future__ import annotations

import email.parser
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 120


def dockerfile_copies() -> list[str]:
    """The repository paths the Dockerfile copies into its build stage, in order."""
    sources = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += words[1:-1]
    return sources


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from exactly what the Dockerfile copies (so the image builds too)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("the build backend (setuptools) is not installed and cannot be fetched offline")
    # Build from a copy: setuptools writes build/ and *.egg-info/ into the source tree.
    source = tmp_path_factory.mktemp("source")
    for name in dockerfile_copies():
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(REPO / name, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        timeout=BUILD_TIMEOUT_S,
    )
    (path,) = out.glob("stagemesh-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def test_wheel_ships_license_protos_and_typing_marker(wheel):
    names = set(wheel.namelist())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    protos = {p.name for p in (REPO / "protos" / "stagemesh" / "v1").glob("*.proto")}
    assert protos, "no .proto sources in protos/stagemesh/v1"
    assert {f"stagemesh/v1/{p}" for p in protos} <= names
    assert "stagemesh/py.typed" in names
    # the gateway's playground page, served from the installed package
    static = {p.name for p in (REPO / "gateway" / "http" / "static").iterdir()}
    assert {"index.html", "playground.js", "playground.css"} <= static
    assert {f"stagemesh/gateway/http/static/{name}" for name in static} <= names
    assert not any(n.startswith(("tests/", "bench/", "scripts/", "training/")) for n in names)


def test_wheel_ships_the_trained_weights_and_their_checksums(wheel):
    folder = "stagemesh/stage_service/models/trained"
    sums = wheel.read(f"{folder}/SHA256SUMS").decode()
    listed = [line.split()[1] for line in sums.splitlines()]
    assert sorted(listed) == ["config.json", "dit/model.safetensors", "lm/model.safetensors"]
    for line in sums.splitlines():
        digest, name = line.split()
        assert hashlib.sha256(wheel.read(f"{folder}/{name}")).hexdigest() == digest, name
    assert f"{folder}/training.json" in wheel.namelist()


def test_the_wheel_installs_only_the_stagemesh_package(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"stagemesh"}, sorted(tops)
    # the top-level service folders land inside it, each module once
    names = set(wheel.namelist())
    for service in ("gateway", "stage_service", "cache_service"):
        assert f"stagemesh/{service}/server.py" in names
        assert f"stagemesh/{service}/__init__.py" in names
    assert "stagemesh/stage_service/engine/dispatch.py" in names


def test_wheel_metadata(wheel):
    (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = email.parser.Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Author"] == "the stagemesh authors"
    assert metadata["Keywords"]
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    requires = [r.replace(" ", "") for r in metadata.get_all("Requires-Dist")]
    assert any(r.startswith("protobuf") and "<8" in r for r in requires), requires
    # The base install (client, gateway, cache service) pulls no torch; the stage extra does.
    base = {re.split(r"[<>=!~;\[]", r, maxsplit=1)[0] for r in requires if ";" not in r}
    assert not base & {"torch", "safetensors", "diffusers", "transformers"}, sorted(base)
    assert {"numpy", "pillow", "grpcio"} <= base, sorted(base)
    stage = {re.split(r"[<>=!~;]", r, maxsplit=1)[0] for r in requires if 'extra=="stage"' in r}
    assert {"torch", "safetensors"} <= stage, requires
    assert 'stagemesh[stage];extra=="test"' in requires, requires
    entry_points = wheel.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    assert "stagemesh = stagemesh.cli:main" in entry_points

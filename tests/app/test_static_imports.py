"""Type checkers resolve every stagemesh.* module from outside the checkout.

The services' code lives in the top-level folders gateway/, stage_service/ and cache_service/,
reached as stagemesh.<service> through stagemesh/'s links; the editable install is a plain path
entry to the checkout, which static tools read (an import hook, setuptools' default for this
layout, is invisible to them). Each check imports every module from a file in a temporary
folder, so nothing of the checkout's own folder layout helps the tool.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def _structure():
    spec = importlib.util.spec_from_file_location("check_structure", REPO / "scripts" / "check_structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _outside_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # what the installation gives, nothing else
    return env


@pytest.fixture(scope="module")
def importer(tmp_path_factory) -> Path:
    """A file, outside the checkout, that imports every module of the service folders and of
    stagemesh/ (the generated stubs left out: the tools read them through their .pyi)."""
    folder = tmp_path_factory.mktemp("elsewhere")
    where = subprocess.run(
        [sys.executable, "-c", "import stagemesh; print(stagemesh.__file__)"],
        cwd=folder,
        env=_outside_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if where.returncode != 0 or not where.stdout.strip().startswith(str(REPO)):
        pytest.skip("stagemesh is not installed editable from this checkout (scripts/setup-env.sh does that)")
    modules = sorted(m for m in _structure().find_modules(REPO) if not m.startswith("stagemesh.v1."))
    assert {"stagemesh.gateway.server", "stagemesh.stage_service.server", "stagemesh.cache_service.server"} <= set(
        modules
    )
    (folder / "imports_all.py").write_text("".join(f"import {m}\n" for m in modules))
    return folder / "imports_all.py"


def test_mypy_resolves_every_module_from_outside_the_checkout(importer):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            sys.executable,
            "--no-incremental",
            "--follow-imports=skip",
            importer.name,
        ],
        cwd=importer.parent,
        env=_outside_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_pyright_resolves_every_module_from_outside_the_checkout(importer):
    pyright = shutil.which("basedpyright", path=str(Path(sys.executable).parent))
    if pyright is None:
        pytest.skip("basedpyright (the dev extra) is not installed")
    result = subprocess.run(
        [pyright, "--pythonpath", sys.executable, "--level", "error", importer.name],
        cwd=importer.parent,
        env=_outside_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 errors" in result.stdout

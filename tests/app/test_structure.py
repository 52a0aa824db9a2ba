"""scripts/check_structure.py: the tree keeps its layers, and the check sees what breaks them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_structure.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=120)


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for package in path.relative_to(root).parents:
            if package != Path("."):
                (root / package / "__init__.py").touch()
    return root


def test_the_tree_keeps_its_structure():
    result = check(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stagemesh.core" in result.stdout and "stagemesh.stage_service.engine" in result.stdout


def test_finds_a_cycle_and_an_upward_import(tmp_path):
    root = plant(
        tmp_path,
        {
            # The cycle runs through an import inside a function and one under TYPE_CHECKING.
            "stagemesh/core/a.py": "def f():\n    from stagemesh.core import b\n",
            "stagemesh/core/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stagemesh.core.a import f\n"
            ),
            "stage_service/engine/run.py": "",
            "stage_service/platform.py": "from .engine import run\n",
        },
    )
    result = check(root)
    assert result.returncode == 1, result.stdout
    assert "import cycle: stagemesh.core.a <-> stagemesh.core.b" in result.stdout
    assert (
        "stagemesh.stage_service.platform imports stagemesh.stage_service.engine.run"
        " (upward between stage service rooms)" in result.stdout
    )


def test_finds_imports_across_layers(tmp_path):
    root = plant(
        tmp_path,
        {
            "stagemesh/config.py": "",
            "stagemesh/weight_store/store.py": "",
            "stagemesh/core/auth.py": (
                "import stagemesh.gateway.server\nimport stagemesh.config\nfrom stagemesh.weight_store import store\n"
            ),
            "gateway/server.py": "from stagemesh.cache_service.server import serve\n",
            "cache_service/server.py": "def serve(): ...\n",
            "stage_service/runner.py": "",
        },
    )
    result = check(root)
    assert result.returncode == 1, result.stdout
    for expected in (
        "stagemesh.core.auth imports stagemesh.gateway.server (the shared layers import no service",
        "stagemesh.core.auth imports stagemesh.config (the shared layers",
        "stagemesh.core.auth imports stagemesh.weight_store.store (stagemesh.core is below",
        "stagemesh.gateway.server imports stagemesh.cache_service.server (one service imports another)",
        "stagemesh.stage_service.runner: stagemesh.stage_service.runner is in no room",
    ):
        assert expected in result.stdout


def test_finds_a_stage_dependency_the_base_install_would_import(tmp_path):
    root = plant(
        tmp_path,
        {
            "gateway/server.py": "from stagemesh.core import codec\n",
            # Inside a function counts: the base install would fail when it runs.
            "stagemesh/core/codec.py": "def decode():\n    from torch.nn import functional\n",
            "stage_service/server.py": "import torch\n",  # the stage may
        },
    )
    result = check(root)
    assert result.returncode == 1, result.stdout
    assert (
        "stagemesh/core/codec.py:2: stagemesh.core.codec imports torch, which only the stage extra installs; "
        "reached from the base install by stagemesh.core.codec <- stagemesh.gateway.server" in result.stdout
    )
    assert "stagemesh.stage_service.server imports torch" not in result.stdout


def test_finds_a_service_imported_by_its_bare_name(tmp_path):
    root = plant(
        tmp_path,
        {
            "gateway/server.py": "",
            "stage_service/server.py": "from gateway import server\n",
            "tests/test_x.py": "import cache_service.server\n",
        },
    )
    (root / "cache_service").mkdir()
    (root / "cache_service" / "server.py").write_text("")
    result = check(root)
    assert result.returncode == 1, result.stdout
    assert "stage_service/server.py:1: imports gateway by its bare name" in result.stdout
    assert "tests/test_x.py:1: imports cache_service.server by its bare name" in result.stdout


def test_finds_the_package_importing_the_training_code(tmp_path):
    root = plant(
        tmp_path,
        {
            "stagemesh/__init__.py": "",
            "stage_service/models/weights.py": "from training.shapes import render\n",
            "training/shapes.py": "",
        },
    )
    result = check(root)
    assert result.returncode == 1, result.stdout
    assert (
        "stage_service/models/weights.py:1: stagemesh.stage_service.models.weights imports training, "
        "a folder of the repository that an installation does not have" in result.stdout
    )


def test_reads_the_service_folders_once_through_their_links(tmp_path):
    # stagemesh/gateway is a link to the top-level folder, as in the repository: its modules are
    # counted once, under their dotted names, and a violation names the real file.
    root = plant(tmp_path, {"stagemesh/core/auth.py": "", "gateway/server.py": "import stagemesh.config\n"})
    (root / "stagemesh" / "config.py").write_text("")
    (root / "stagemesh" / "gateway").symlink_to("../gateway")
    result = check(root)
    assert result.returncode == 1, result.stdout
    assert "gateway/server.py:1: stagemesh.gateway.server imports stagemesh.config (a service imports" in result.stdout
    assert result.stdout.count("stagemesh.gateway.server imports") == 1

"""The committed stubs in stagemesh/v1/ must be exactly what protos/stagemesh/v1/*.proto generate."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_generated_stubs_match_the_protos(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_protos.py"), str(tmp_path)], check=True)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "stagemesh" / "v1").iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in (REPO / "stagemesh" / "v1").iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ: run python scripts/gen_protos.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run python scripts/gen_protos.py"


def test_every_proto_has_stubs():
    protos = {p.stem for p in (REPO / "protos" / "stagemesh" / "v1").glob("*.proto")}
    stubs = {p.name.removesuffix("_pb2.py") for p in (REPO / "stagemesh" / "v1").glob("*_pb2.py")}
    assert protos, "no .proto sources in protos/stagemesh/v1"
    assert protos == stubs

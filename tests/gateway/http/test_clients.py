"""The client commands against a gateway whose data plane needs an API key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stagemesh.client.channel import API_KEY_ENV, TOKEN_FILE_ENV
from stagemesh.core import auth
from tests.gateway.http.conftest import API_KEY, TOKEN
from tests.support.meshproc import REPO

pytestmark = pytest.mark.mesh


def _stagemesh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, TOKEN_FILE_ENV, auth.TOKEN_ENV)}
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_status_and_generate_send_the_key(http_mesh, tmp_path):
    refused = _stagemesh("status", "--address", http_mesh.address)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    listed = _stagemesh("status", "--address", http_mesh.address, "--api-key-file", str(key_file))
    assert listed.returncode == 0 and "diffusion" in listed.stdout, listed.stderr
    out = tmp_path / "out.png"
    made = _stagemesh(
        "generate", "a boat", "--size", "16", "--steps", "1", "--address", http_mesh.address, "-o", str(out),
        env={API_KEY_ENV: API_KEY},
    )  # fmt: skip
    assert made.returncode == 0 and out.read_bytes().startswith(b"\x89PNG"), made.stderr


def test_sleep_all_lists_the_stages_with_the_control_token(http_mesh):
    # `--all` asks ListStages first: the control token opens it too. Stage 0 cannot sleep, so the
    # call ends UNIMPLEMENTED, after the listing went through.
    done = _stagemesh("sleep", "--all", "--address", http_mesh.address, env={auth.TOKEN_ENV: TOKEN})
    assert done.returncode == 1 and "UNIMPLEMENTED" in done.stderr, done.stderr


def test_the_python_client_sends_its_key_as_x_api_key(http_mesh, monkeypatch):
    from stagemesh import Client
    from stagemesh.client.errors import UnauthenticatedError

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with Client(http_mesh.address, api_key=API_KEY, retries=0) as client:
        assert [s.kind for s in client.list_stages()] == ["ar", "diffusion"]
    with Client(http_mesh.address, retries=0) as client, pytest.raises(UnauthenticatedError, match="missing API key"):
        client.list_stages()

"""One mesh with the HTTP API on, shared by this package's mesh tests: an API key on the data
plane, a bearer token on the control calls, stage 0 without sleep support (its Sleep is
UNIMPLEMENTED, 501 over HTTP), stage 1 with a metrics port (the disconnect tests watch its work)
and up to 200 steps (a request that outlasts the gateway's stop grace)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.support.meshproc import Mesh, segments_of, shm_entries, start_mesh

API_KEY = "sk-test-data-plane-key"
TOKEN = "control-plane-token"
MAX_REQUEST_BYTES = 1024 * 1024


def _secret(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    os.chmod(path, 0o600)
    return str(path)


def _config(root: Path, model_dir: str) -> Path:
    path = root / "mesh.toml"
    path.write_text(f"""
[mesh]
log_level = "info"

[gateway]
port = 0
http_port = 0
api_key_file = "{_secret(root / "api-key", API_KEY)}"
max_request_bytes = {MAX_REQUEST_BYTES}

[security]
token_file = "{_secret(root / "token", TOKEN)}"

[cache]
root = "{root / "cache-root"}"

[[stages]]
kind = "ar"
model_dir = "{model_dir}"
threads = 1
enable_sleep = false
max_steps = 200

[[stages]]
kind = "diffusion"
model_dir = "{model_dir}"
threads = 1
max_size = 512
max_steps = 200
max_prompt_bytes = 256
metrics_port = 0
""")
    return path


@pytest.fixture(scope="package")
def http_mesh(tmp_path_factory, model_dir) -> Mesh:
    root = tmp_path_factory.mktemp("http-mesh")
    shm_before = shm_entries()
    running = start_mesh(_config(root, model_dir), root / "mesh.log")
    yield running
    assert running.stop() == 0, running.logs()[-3000:]
    leaked = segments_of(shm_entries() - shm_before, running.child_pids())
    assert not leaked, f"shared-memory segments left behind: {leaked}"
    logs = running.logs()
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]


@pytest.fixture(scope="package")
def base_url(http_mesh) -> str:
    return f"http://{http_mesh.http_address}"


@pytest.fixture
def client(base_url):
    """httpx on the HTTP API with the API key."""
    with httpx.Client(base_url=base_url, headers=bearer(API_KEY), timeout=120) as c:
        yield c


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}

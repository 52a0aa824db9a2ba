"""`stagemesh gateway --http-port` on its own, without an API key, in front of the package mesh's
stages (which take only callers holding the mesh's token, so this gateway holds it too): the
ready file names the HTTP address, the data routes are open, the control routes take the token,
a gateway without the token is refused by the stages (503, naming the fix), and SIGTERM with a stream in flight
stops it cleanly (exit 0, the stream ended by a last error event once the grace has passed, the
stage's work freed). With a certificate, the HTTP port speaks HTTPS."""

from __future__ import annotations

import signal
import ssl

import httpx
import pytest

from stagemesh.core import readyfile
from tests.core.test_security import make_certificates
from tests.gateway.http.conftest import TOKEN, bearer
from tests.gateway.http.rawhttp import LONG, WAIT_S, open_request, read_until, wait_for
from tests.support.meshproc import spawn_service

pytestmark = pytest.mark.mesh


SMALL = {"prompt": "a", "size": "16x16", "num_inference_steps": 1}


def test_an_open_gateway_serves_http_and_stops_cleanly_mid_stream(http_mesh, tmp_path):
    stages = http_mesh.child_addresses()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    flags = ["--stage", stages["stage-0"], "--stage", stages["stage-1"], "--http-port", "0"]
    gateway = spawn_service("gateway", ["gateway", *flags, "--token-file", str(token_file)], tmp_path)
    try:
        gateway.wait_bound()
        http = readyfile.read(gateway.ready_path)["http"]
        with httpx.Client(base_url=f"http://{http}", timeout=60) as client:
            # No API key configured: the data routes are open; control takes the token.
            wait = httpx.Timeout(WAIT_S)
            assert client.get("/health", timeout=wait).status_code in (200, 503)
            assert client.get("/v1/models").json()["data"][0]["id"] == "stagemesh"
            assert client.post("/v1/omni/pause").status_code == 401
            assert client.post("/v1/omni/pause", headers=bearer(TOKEN)).status_code == 200
            assert client.post("/v1/omni/resume", headers=bearer(TOKEN)).status_code == 200
            assert client.post("/v1/images/generations", json=SMALL, timeout=wait).status_code == 200

        metrics = http_mesh.metrics_addresses()["stage-1"]
        sock = open_request(http, {**LONG, "stream": True})
        read_until(sock, b"image_generation.progress")
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(WAIT_S) == 0, gateway.logs()[-3000:]
        sock.settimeout(WAIT_S)
        rest = b""
        while chunk := sock.recv(65536):  # until the gateway closes the connection
            rest += chunk
        sock.close()
        # Past the stop's grace the stream ends with an error event that says why.
        last = rest.rsplit(b"event: ", 1)[-1]  # (the body is chunked: framing lies between events)
        assert last.startswith(b"error\n") and b"the gateway is stopping" in last, rest[-500:]
        wait_for(metrics, lambda s: s[1] == 0)  # and the stage dropped the request
        assert "Traceback" not in gateway.logs()
    finally:
        gateway.stop()


def test_a_gateway_without_the_mesh_token_is_refused_by_the_stages(http_mesh, tmp_path):
    stages = http_mesh.child_addresses()
    flags = ["--stage", stages["stage-0"], "--stage", stages["stage-1"], "--http-port", "0"]
    gateway = spawn_service("gateway", ["gateway", *flags], tmp_path)
    try:
        gateway.wait_bound()
        http = readyfile.read(gateway.ready_path)["http"]
        with httpx.Client(base_url=f"http://{http}", timeout=WAIT_S) as client:
            refused = client.post("/v1/images/generations", json=SMALL)
        # Not the caller's fault: no 401 sending them after a key; the operator's fix is named.
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "refused the gateway's credential" in message and "--token-file" in message, message
        assert "Traceback" not in gateway.logs()
    finally:
        assert gateway.stop() == 0, gateway.logs()[-3000:]


def test_with_a_certificate_the_http_api_speaks_https(http_mesh, tmp_path):
    pki = make_certificates(tmp_path)
    stages = http_mesh.child_addresses()
    flags = ["--stage", stages["stage-0"], "--stage", stages["stage-1"], "--http-port", "0"]
    gateway = spawn_service(
        "gateway", ["gateway", *flags, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])], tmp_path
    )
    try:
        gateway.wait_bound()
        http = readyfile.read(gateway.ready_path)["http"]
        with httpx.Client(base_url=f"https://{http}", verify=ssl.create_default_context(cafile=pki["ca"])) as client:
            assert client.get("/v1/models", timeout=WAIT_S).json()["data"][0]["id"] == "stagemesh"
        with pytest.raises(httpx.HTTPError):  # no plaintext on the same port
            httpx.get(f"http://{http}/v1/models", timeout=WAIT_S)
    finally:
        assert gateway.stop() == 0, gateway.logs()[-3000:]

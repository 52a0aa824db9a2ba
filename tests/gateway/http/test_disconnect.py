"""A client that closes its connection mid-generation cancels the work: the gateway cancels its
Execute call to the stage, and the stage frees the request (its queue empties) long before the
request would have finished. Watched through stage 1's own metrics, over a real socket close."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.http.conftest import API_KEY

pytestmark = pytest.mark.mesh

# The largest, longest request the mesh allows: seconds of denoising on the CPU.
LONG = {"prompt": "a long night", "size": "512x512", "num_inference_steps": 50, "seed": 11}
SMALL = {"prompt": "a short day", "size": "16x16", "num_inference_steps": 1, "seed": 1}
WAIT_S = 120.0  # only a bound on a failing test: the conditions below hold or never do


def _stage_metrics(address: str) -> tuple[float, float]:
    """(Execute calls that ended CANCELLED, requests admitted and not finished) of stage 1."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    cancelled = depth = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "stagemesh_requests_total" and s.labels.get("code") == "CANCELLED":
                cancelled += s.value if s.labels.get("method", "").endswith("/Execute") else 0.0
            elif s.name == "stagemesh_stage_queue_depth":
                depth = s.value
    return cancelled, depth


def _wait_for(address: str, condition) -> tuple[float, float]:
    deadline = time.monotonic() + WAIT_S
    while not condition(sample := _stage_metrics(address)):
        assert time.monotonic() < deadline, f"stage 1 metrics never met the condition: {sample}"
        time.sleep(0.05)
    return sample


def _open_request(http_address: str, body: dict) -> socket.socket:
    host, port = http_address.rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    sock.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\n"
        + f"host: {http_address}\r\nauthorization: Bearer {API_KEY}\r\n".encode()
        + f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> None:
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended before {marker!r}: {seen[-500:]!r}"
        seen += chunk


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_client_that_disconnects_cancels_the_work_in_the_stage(http_mesh, client, stream):
    stage = http_mesh.metrics_addresses()["stage-1"]
    cancelled_before, _ = _wait_for(stage, lambda s: s[1] == 0)
    sock = _open_request(http_mesh.http_address, {**LONG, "stream": stream})
    try:
        if stream:
            _read_until(sock, b"image_generation.progress")  # stage 1 is denoising
        else:
            _wait_for(stage, lambda s: s[1] >= 1)  # stage 1 has the request
    finally:
        sock.close()
    cancelled, depth = _wait_for(stage, lambda s: s[0] > cancelled_before and s[1] == 0)
    assert (cancelled, depth) == (cancelled_before + 1, 0)
    assert client.post("/v1/images/generations", json=SMALL).status_code == 200
    if not stream:
        assert "client went away; generation cancelled" in http_mesh.logs()

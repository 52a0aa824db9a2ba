"""Raw HTTP over a socket (so a test can close it for real) and stage 1's work as its metrics say."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.http.conftest import API_KEY

# The largest, longest request the package mesh allows: tens of seconds of denoising on the CPU,
# longer than the gateway's stop grace (5 s).
LONG = {"prompt": "a long night", "size": "512x512", "num_inference_steps": 200, "seed": 11}
WAIT_S = 120.0  # only a bound on a failing test: the conditions waited for hold or never do


def stage_metrics(address: str) -> tuple[float, float]:
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


def wait_for(address: str, condition) -> tuple[float, float]:
    deadline = time.monotonic() + WAIT_S
    while not condition(sample := stage_metrics(address)):
        assert time.monotonic() < deadline, f"stage 1 metrics never met the condition: {sample}"
        time.sleep(0.05)
    return sample


def open_request(http_address: str, body: dict) -> socket.socket:
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


def read_until(sock: socket.socket, marker: bytes) -> None:
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended before {marker!r}: {seen[-500:]!r}"
        seen += chunk

"""A client that closes its connection mid-generation cancels the work: the gateway cancels its
Execute call to the stage, and the stage frees the request (its queue empties) long before the
request would have finished. Watched through stage 1's own metrics, over a real socket close."""

from __future__ import annotations

import pytest

from tests.gateway.http.rawhttp import LONG, open_request, read_until, wait_for

pytestmark = pytest.mark.mesh

SMALL = {"prompt": "a short day", "size": "16x16", "num_inference_steps": 1, "seed": 1}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_client_that_disconnects_cancels_the_work_in_the_stage(http_mesh, client, stream):
    stage = http_mesh.metrics_addresses()["stage-1"]
    cancelled_before, _ = wait_for(stage, lambda s: s[1] == 0)
    sock = open_request(http_mesh.http_address, {**LONG, "stream": stream})
    try:
        if stream:
            read_until(sock, b"image_generation.progress")  # stage 1 is denoising
        else:
            wait_for(stage, lambda s: s[1] >= 1)  # stage 1 has the request
    finally:
        sock.close()
    cancelled, depth = wait_for(stage, lambda s: s[0] > cancelled_before and s[1] == 0)
    assert (cancelled, depth) == (cancelled_before + 1, 0)
    assert client.post("/v1/images/generations", json=SMALL).status_code == 200
    if not stream:
        assert "client went away; generation cancelled" in http_mesh.logs()

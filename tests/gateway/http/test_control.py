"""The control routes (/v1/omni/sleep, wakeup, pause, resume) through a real mesh: the same
semantics as the gRPC calls (a wakeup naming no stage is SKIPPED, a sleep naming none refused),
behind the same bearer token. Every test leaves the mesh awake with generation open."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from tests.gateway.http.conftest import API_KEY, TOKEN, bearer
from tests.support.sleep_mesh import stage_calls

pytestmark = pytest.mark.mesh

SMALL = {"prompt": "a boat", "size": "16x16", "num_inference_steps": 1, "seed": 3}


@pytest.fixture
def control(base_url):
    with httpx.Client(base_url=base_url, headers=bearer(TOKEN), timeout=120) as c:
        yield c
        # Whatever a test did: awake and open for the next one.
        c.post("/v1/omni/wakeup", json={"stage_ids": [1]})
        c.post("/v1/omni/resume")


def _curl(url: str, body: dict) -> tuple[int, dict]:
    """POST with the real curl binary, as an operator would."""
    curl = shutil.which("curl")
    assert curl, "curl is not installed"
    done = subprocess.run(
        [curl, "-sS", "-X", "POST", url, "-H", f"authorization: Bearer {TOKEN}", "-H", "content-type: application/json"]
        + ["-d", json.dumps(body), "-w", "\n%{http_code}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    text, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(text)


def test_curl_sleeps_and_wakes_a_stage(base_url, client, control):
    status, slept = _curl(f"{base_url}/v1/omni/sleep", {"stage_ids": [1], "level": 1})
    assert status == 200 and slept["status"] == "SUCCESS", slept
    assert [(a["stage_id"], a["status"], a["level"]) for a in slept["acks"]] == [(1, "SUCCESS", 1)]
    health = client.get("/health")
    assert health.status_code == 503
    assert [s["state"] for s in health.json()["stages"]] == ["serving", "sleeping"]
    refused = client.post("/v1/images/generations", json=SMALL)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "failed_precondition"
    assert "stage 1 is asleep" in refused.json()["error"]["message"]

    status, woken = _curl(f"{base_url}/v1/omni/wakeup", {"stage_ids": [1]})
    assert status == 200 and woken["status"] == "SUCCESS" and len(woken["acks"]) == 1, woken
    status, again = _curl(f"{base_url}/v1/omni/wakeup", {"stage_ids": [1]})
    assert (status, again) == (200, {"status": "SKIPPED", "reason": "target stages are not sleeping", "acks": []})
    # An AR pipeline stays paused after a wake until resume, as over gRPC.
    assert client.post("/v1/images/generations", json=SMALL).status_code == 409
    assert control.post("/v1/omni/resume").json() == {"status": "SUCCESS", "generation_paused": False}
    assert client.post("/v1/images/generations", json=SMALL).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("body", [{"stage_ids": []}, {}], ids=["empty", "absent"])
def test_wakeup_naming_no_stage_is_skipped_and_calls_no_stage(http_mesh, client, control, body):
    assert control.post("/v1/omni/sleep", json={"stage_ids": [1], "level": 1}).json()["status"] == "SUCCESS"
    calls = stage_calls(http_mesh, "WakeUpStage")
    reply = control.post("/v1/omni/wakeup", json=body)
    assert (reply.status_code, reply.json()) == (
        200,
        {"status": "SKIPPED", "reason": "target stages are not sleeping", "acks": []},
    )
    assert stage_calls(http_mesh, "WakeUpStage") == calls
    assert [s["state"] for s in client.get("/health").json()["stages"]] == ["serving", "sleeping"]


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("sleep", {"stage_ids": []}, 400, "stage_ids"),
        ("sleep", {"stage_ids": [9]}, 400, "stage_ids"),
        ("sleep", {"stage_ids": [1], "level": 3}, 400, "level"),
        ("sleep", {"stage_ids": "1"}, 400, "stage_ids"),
        ("sleep", {"stage": [1]}, 400, "stage"),
        ("wakeup", {"stage_ids": [1], "level": 1}, 400, "level"),
        ("sleep", {"stage_ids": [0]}, 501, None),  # stage 0 runs without sleep support
    ],
)
def test_refused_control_calls_say_why(control, client, route, body, status, param):
    reply = control.post(f"/v1/omni/{route}", json=body)
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (status, param), error
    if status == 501:
        assert error["code"] == "unimplemented" and "cannot sleep" in error["message"]
    assert client.post("/v1/images/generations", json=SMALL).status_code == 200  # admission untouched


def test_control_routes_need_the_token_not_the_key(base_url):
    for headers in ({}, bearer(API_KEY), bearer("wrong")):
        reply = httpx.post(f"{base_url}/v1/omni/pause", headers=headers, timeout=30)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"


def test_pause_refuses_generation_and_streams_until_resume(control, client):
    assert control.post("/v1/omni/pause").json() == {"status": "SUCCESS", "generation_paused": True}
    for stream in (False, True):
        refused = client.post("/v1/images/generations", json={**SMALL, "stream": stream})
        assert refused.status_code == 409, refused.text  # refused before any event is streamed
        assert "paused" in refused.json()["error"]["message"]
    assert control.post("/v1/omni/resume").status_code == 200
    assert client.post("/v1/images/generations", json=SMALL).status_code == 200

"""The playground page over plain HTTP (no browser): `GET /` and its files, with their content
types and security headers, nothing secret or from another origin in them; and the read route the
page polls, /v1/omni/stages, against gRPC ListStages and a request in flight."""

from __future__ import annotations

import re
import time
from html.parser import HTMLParser

import httpx
import pytest

from stagemesh.gateway.http.playground import CONTENT_SECURITY_POLICY
from stagemesh.v1 import gateway_pb2
from tests.gateway.http.conftest import API_KEY, TOKEN, bearer
from tests.gateway.http.rawhttp import open_request, read_until

pytestmark = pytest.mark.mesh

ASSETS = {
    "/playground/playground.js": "text/javascript; charset=utf-8",
    "/playground/playground.css": "text/css; charset=utf-8",
    "/playground/favicon.svg": "image/svg+xml",
}
SMALL = {"prompt": "a kite", "size": "16x16", "num_inference_steps": 1, "seed": 5}


class _References(HTMLParser):
    """Every src and href of a page, and whether it has inline script or style."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline: list[str] = []

    def handle_starttag(self, tag, attrs):
        named = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "script" and "src" not in named:
            self.inline.append("<script> without src")
        if tag == "style" or "style" in named or any(k.startswith("on") for k in named):
            self.inline.append(f"<{tag}> with inline style or handler")


@pytest.fixture(scope="module")
def anonymous(base_url):
    """httpx with no key and no token: what a browser opening the page sends."""
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def test_the_page_is_served_open_as_html_under_a_strict_policy(anonymous):
    page = anonymous.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    policy = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'"
    assert policy["connect-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "<title>stagemesh playground</title>" in page.text
    assert 'for="prompt"' in page.text and 'id="prompt"' in page.text


def test_the_page_loads_only_its_own_files_and_has_no_inline_code(anonymous):
    html = _References()
    html.feed(anonymous.get("/").text)
    assert html.inline == []
    assert sorted(html.urls) == sorted(ASSETS)  # relative to the gateway: no other origin, no CDN
    for url, content_type in ASSETS.items():
        asset = anonymous.get(url)
        assert asset.status_code == 200, url
        assert asset.headers["content-type"] == content_type
        assert asset.headers["x-content-type-options"] == "nosniff"
        # No absolute URL in the code or style (the SVG's namespace is a name, never fetched).
        text = asset.text.replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text), url


def test_no_secret_is_served_to_an_anonymous_browser(anonymous):
    for url in ("/", *ASSETS):
        served = anonymous.get(url)
        for secret in (API_KEY, TOKEN):
            assert secret not in served.text, url
            assert all(secret not in value for value in served.headers.values()), url


def test_an_unknown_playground_file_is_a_404_in_the_api_error_shape(anonymous):
    missing = anonymous.get("/playground/secrets.txt")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert anonymous.get("/playground/").status_code == 404


def test_the_stages_route_needs_the_key_and_says_what_list_stages_says(anonymous, http_mesh):
    refused = anonymous.get("/v1/omni/stages")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated"
    assert anonymous.get("/v1/omni/stages", headers=bearer(TOKEN)).status_code == 200  # the token works too
    body = anonymous.get("/v1/omni/stages", headers=bearer(API_KEY)).json()
    with http_mesh.channel() as channel:
        listed = http_mesh.gateway(channel).ListStages(
            gateway_pb2.ListStagesRequest(), timeout=30, metadata=tuple(bearer(API_KEY).items())
        )
    assert body["generation_paused"] is listed.generation_paused is False
    fields = ("stage_id", "kind", "replicas", "workers", "device", "supports_sleep", "max_batch_size", "sleep_level")
    assert [tuple(s[f] for f in fields) for s in body["stages"]] == [
        tuple(getattr(s, f) for f in fields) for s in listed.stages
    ]
    # The package mesh: stage 0 runs without sleep support, stage 1 with it, one worker each.
    assert [(s["kind"], s["state"], s["supports_sleep"], s["workers"]) for s in body["stages"]] == [
        ("ar", "serving", False, 1),
        ("diffusion", "serving", True, 1),
    ]
    limits = body["limits"]
    assert (limits["max_pixels_side"], limits["max_inference_steps"], limits["max_prompt_bytes"]) == (512, 200, 256)
    assert limits["pixel_multiple"] == 16 and limits["max_num_images"] >= 1


def test_the_stages_route_shows_a_request_in_stage_1_s_queue(client, http_mesh):
    client.post("/v1/images/generations", json=SMALL).raise_for_status()
    stages = client.get("/v1/omni/stages").json()["stages"]
    assert all(s["mean_batch_size"] >= 1 for s in stages), stages  # each stage has run a batch
    long = {"prompt": "a slow tide", "size": "256x256", "num_inference_steps": 200, "seed": 2, "stream": True}
    sock = open_request(http_mesh.http_address, long)
    try:
        read_until(sock, b"image_generation.progress")  # stage 1 is denoising it
        busy = {s["stage_id"]: s["queue_depth"] for s in client.get("/v1/omni/stages").json()["stages"]}
    finally:
        sock.close()  # cancels the work
    assert busy == {0: 0, 1: 1}
    deadline = time.monotonic() + 60
    while any(s["queue_depth"] for s in client.get("/v1/omni/stages").json()["stages"]):
        assert time.monotonic() < deadline, "the cancelled request stayed in stage 1's queue"
        time.sleep(0.1)

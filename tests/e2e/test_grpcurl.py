"""The mesh from the outside with grpcurl: reflection, health, and calls by name from JSON, with no
.proto files at hand."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess

import pytest
from PIL import Image

GRPCURL = shutil.which("grpcurl")
pytestmark = [pytest.mark.mesh, pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary on PATH")]
GATEWAY = "stagemesh.v1.GatewayService"
INVALID_ARGUMENT_EXIT = 64 + 3  # grpcurl exits with 64 + the status code of a failed RPC


def grpcurl(*args: str, data: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [GRPCURL, "-plaintext", "-max-time", str(int(timeout))]
    if data is not None:
        argv += ["-d", json.dumps(data)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout + 10)


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one JSON document per response message, one after the other."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while (pos := _skip_space(text, pos)) < len(text):
        message, pos = decoder.raw_decode(text, pos)
        out.append(message)
    return out


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def test_list_shows_the_gateway_health_and_reflection(mesh):
    done = grpcurl(mesh.address, "list")
    assert done.returncode == 0, done.stderr
    services = set(done.stdout.split())
    assert {GATEWAY, "grpc.health.v1.Health"} <= services
    assert services & {"grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}


def test_describe_lists_the_generate_methods(mesh):
    done = grpcurl(mesh.address, "describe", GATEWAY)
    assert done.returncode == 0, done.stderr
    for method in (
        "rpc Generate (",
        "returns ( stream .stagemesh.v1.GenerateResponse )",
        "rpc GenerateUnary (",
        "rpc ListStages (",
    ):
        assert method in done.stdout, done.stdout


def test_unary_generate_from_json_returns_a_png_of_the_asked_size(mesh):
    params = {"prompt": "a lighthouse at dusk", "width": 64, "height": 32, "num_inference_steps": 2, "seed": "5"}
    done = grpcurl("-d", json.dumps({"params": params}), mesh.address, f"{GATEWAY}/GenerateUnary")
    assert done.returncode == 0, done.stderr
    [reply] = json_messages(done.stdout)
    result = reply["result"]
    assert (result["width"], result["height"], result["seed"]) == (64, 32, "5")
    image = Image.open(io.BytesIO(base64.b64decode(result["png"])))
    assert image.format == "PNG" and image.size == (64, 32)


def test_streaming_generate_from_json_prints_progress_then_the_result(mesh):
    params = {"prompt": "streamed", "width": 32, "height": 16, "numInferenceSteps": 3}  # JSON names work too
    done = grpcurl(mesh.address, f"{GATEWAY}/Generate", data={"params": params})
    assert done.returncode == 0, done.stderr
    messages = json_messages(done.stdout)
    kinds = [next(iter(m)) for m in messages]
    assert kinds[:2] == ["stage_started", "stage_started"], kinds
    assert messages[1]["stage_started"] == {"stage_id": 1, "kind": "diffusion"}
    steps = [(m["denoising_step"]["step"], m["denoising_step"]["total"]) for m in messages if "denoising_step" in m]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert kinds[-1] == "result" and kinds.count("result") == 1
    assert Image.open(io.BytesIO(base64.b64decode(messages[-1]["result"]["png"]))).size == (32, 16)


def test_bad_size_is_invalid_argument_naming_the_field(mesh):
    params = {"prompt": "x", "width": 32, "height": 17}
    done = grpcurl(mesh.address, f"{GATEWAY}/GenerateUnary", data={"params": params})
    assert done.returncode == INVALID_ARGUMENT_EXIT, (done.returncode, done.stderr)
    assert "Code: InvalidArgument" in done.stderr
    assert "params.height" in done.stderr and "multiples of 16 from 16 to 512" in done.stderr
    assert done.stdout.strip() == ""


def test_bad_size_error_details_as_json(mesh):
    done = grpcurl("-format-error", mesh.address, f"{GATEWAY}/Generate", data={"params": {"width": 4096}})
    assert done.returncode == INVALID_ARGUMENT_EXIT, (done.returncode, done.stderr)
    assert done.stdout.strip() == ""
    [status] = json_messages(done.stderr)  # the error, as a google.rpc.Status in JSON
    assert status["code"] == 3
    [detail] = status["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    [violation] = detail["field_violations"]
    assert violation["field"] == "params.width" and "512" in violation["description"]


@pytest.mark.parametrize("service", ["", GATEWAY])
def test_health_check_says_serving(mesh, service):
    done = grpcurl(mesh.address, "grpc.health.v1.Health/Check", data={"service": service})
    assert done.returncode == 0, done.stderr
    assert json_messages(done.stdout) == [{"status": "SERVING"}]


def test_list_stages_by_name(mesh):
    done = grpcurl(mesh.address, f"{GATEWAY}/ListStages")
    assert done.returncode == 0, done.stderr
    [reply] = json_messages(done.stdout)
    assert [(s.get("stage_id", 0), s["kind"], s["state"]) for s in reply["stages"]] == [
        (0, "ar", "STAGE_STATE_SERVING"),
        (1, "diffusion", "STAGE_STATE_SERVING"),
    ]

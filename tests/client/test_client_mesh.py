"""stagemesh.Client through a real mesh (`stagemesh up`): images, progress events, control calls,
the CLI over the client; the gateway's x-request-id in response metadata; google.rpc.RetryInfo on
a RESOURCE_EXHAUSTED (a result over the gateway's undelivered-bytes bound) and an UNAVAILABLE (a
gateway whose stage is not there), retried by gRPC after the gateway's pushback."""

from __future__ import annotations

import re
import socket
import time

import grpc
import numpy as np
import pytest
from PIL import Image

import stagemesh
from bench.stalled_clients import GENERATE_PATH, stalled_request
from stagemesh import Client, DenoisingStep, RetryPolicy, StageStarted, StageState, cli
from stagemesh.core import errors
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import spawn_service, start_mesh, write_config
from tests.support.stalled_h2 import StalledClients

pytestmark = pytest.mark.mesh

RPC_TIMEOUT_S = 60.0
# Small results pass (a 64x48 tensor is 37 KB) even side by side; a 512x512 tensor (3 MiB) passes
# only alone, and while a client leaves it unread every other result is refused.
MAX_UNDELIVERED_BYTES = 1024 * 1024
HEX_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def client_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("client-mesh")
    config = write_config(
        root / "mesh.toml", model_dir, extra_gateway=f"max_undelivered_bytes = {MAX_UNDELIVERED_BYTES}"
    )
    mesh = start_mesh(config, root / "mesh.log")
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]
    assert "Traceback" not in mesh.logs()


@pytest.fixture
def client(client_mesh, monkeypatch):
    for name in ("STAGEMESH_TOKEN", "STAGEMESH_TOKEN_FILE", "STAGEMESH_API_KEY", "STAGEMESH_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    with Client(client_mesh.address, timeout=RPC_TIMEOUT_S) as made:
        yield made


def test_generate_returns_a_png_of_the_requested_size_and_saves_it(client, tmp_path):
    result = client.generate("a lighthouse", width=64, height=48, steps=2, seed=3)
    assert (result.format, result.width, result.height, result.seed, result.index) == ("png", 64, 48, 3, 0)
    assert (result.image.format, result.image.size, result.image.mode) == ("PNG", (64, 48), "RGB")
    assert HEX_ID.fullmatch(result.request_id), result.request_id
    assert set(result.stage_latency_ms) == {0, 1} and all(ms > 0 for ms in result.stage_latency_ms.values())
    saved = result.save(tmp_path / "lighthouse.png")
    assert saved.read_bytes() == result.bytes
    assert np.array_equal(np.asarray(Image.open(saved)), np.asarray(result.image))


def test_a_tensor_result_is_the_png_before_encoding(client):
    png = client.generate("a lighthouse", width=64, height=48, steps=2, seed=3)
    tensor = client.generate("a lighthouse", width=64, height=48, steps=2, seed=3, output_format="tensor")
    assert tensor.format == "tensor" and tensor.tensor.shape == (48, 64, 3) and tensor.tensor.dtype == np.float32
    assert 0.0 <= float(tensor.tensor.min()) and float(tensor.tensor.max()) <= 1.0
    assert np.array_equal(np.asarray(tensor.image), np.asarray(png.image))


def test_on_progress_sees_both_stages_every_step_and_the_result(client):
    events: list[object] = []
    result = client.generate("a boat", width=32, height=32, steps=3, seed=1, on_progress=events.append)
    assert events == [
        StageStarted(0, "ar"),
        StageStarted(1, "diffusion"),
        *(DenoisingStep(1, step, 3, 0) for step in (1, 2, 3)),
        result,
    ]
    assert result.image.size == (32, 32)


def test_list_stages_sleep_wake_pause_resume_through_the_client(client):
    listing = client.list_stages()
    assert [(s.stage_id, s.kind, s.state) for s in listing] == [
        (0, "ar", StageState.SERVING),
        (1, "diffusion", StageState.SERVING),
    ]
    assert not listing.generation_paused and all(s.replicas == 1 and s.device == "cpu" for s in listing)
    try:
        slept = client.sleep([1], level=1)
        assert slept.ok and [(a.stage_id, a.rank, a.ok, a.level) for a in slept.acks] == [(1, 0, True, 1)]
        stage_1 = client.list_stages().stages[1]
        assert (stage_1.state, stage_1.sleep_level) == (StageState.SLEEPING, 1)
        with pytest.raises(stagemesh.FailedPreconditionError, match="stage 1 is asleep"):
            client.generate("while asleep", width=32, height=32, steps=1)
        woken = client.wake_up([1])
        assert woken.ok and woken.status == "success" and woken.acks[0].level == 1
        assert client.wake_up().status == "skipped"  # None: every stage; none sleeps
        client.resume()  # a pipeline with an AR stage stays paused after a wake
        assert client.generate("awake", width=32, height=32, steps=1).width == 32
        client.pause()
        assert client.list_stages().generation_paused
        with pytest.raises(stagemesh.FailedPreconditionError, match="generation is paused"):
            client.generate("paused", width=32, height=32, steps=1)
    finally:
        client.wake_up()
        client.resume()
    assert client.generate("open again", width=32, height=32, steps=1).width == 32


def test_the_cli_generates_through_the_client(client_mesh, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("STAGEMESH_TOKEN_FILE", raising=False)
    out = tmp_path / "cli.png"
    argv = ["generate", "a boat", "--address", client_mesh.address, "--size", "32", "--steps", "2", "--seed", "4"]
    assert cli.main([*argv, "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "stage 0 (ar) started" in printed.err and "stage 1 (diffusion) started" in printed.err
    assert "2/2" in printed.err and printed.out.startswith(f"wrote {out} (32x32, seed 4, request ")
    assert Image.open(out).size == (32, 32)


def test_the_cli_passes_negative_prompt_init_image_and_strength(client_mesh, client, tmp_path, monkeypatch):
    monkeypatch.delenv("STAGEMESH_TOKEN_FILE", raising=False)
    start = tmp_path / "start.png"
    start.write_bytes(client.generate("a start", width=32, height=32, steps=2, seed=5).bytes)
    wanted = {"width": 32, "height": 32, "steps": 2, "seed": 6, "guidance_scale": 4.0}
    plain = client.generate("a boat", **wanted).bytes
    steered = client.generate("a boat", negative_prompt="fog", init_image=str(start), strength=0.5, **wanted).bytes
    assert steered != plain
    argv = ["generate", "a boat", "--address", client_mesh.address, "--size", "32", "--steps", "2", "--seed", "6"]
    argv += ["--guidance", "4", "--negative-prompt", "fog", "--init-image", str(start), "--strength", "0.5"]
    out = tmp_path / "cli.png"
    assert cli.main([*argv, "-o", str(out)]) == 0
    assert out.read_bytes() == steered


# ---- x-request-id in response metadata ------------------------------------------------------------
def _echoed(metadata) -> str | None:
    return dict(metadata or ()).get("x-request-id")


SMALL = generation_pb2.GenerationParams(prompt="ids", width=32, height=32, num_inference_steps=1, seed=2)
BAD = generation_pb2.GenerationParams(prompt="ids", width=17, height=32, num_inference_steps=1)


def test_the_gateway_sends_the_request_id_back_given_or_generated(client_mesh):
    with client_mesh.channel() as channel:
        gateway = client_mesh.gateway(channel)
        reply, call = gateway.GenerateUnary.with_call(
            gateway_pb2.GenerateUnaryRequest(params=SMALL, request_id="given-1"), timeout=RPC_TIMEOUT_S
        )
        assert _echoed(call.initial_metadata()) == "given-1" == reply.result.request_id
        reply, call = gateway.GenerateUnary.with_call(
            gateway_pb2.GenerateUnaryRequest(params=SMALL), metadata=(("x-request-id", "meta-1"),), timeout=60
        )
        assert _echoed(call.initial_metadata()) == "meta-1" == reply.result.request_id
        reply, call = gateway.GenerateUnary.with_call(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=60)
        generated = _echoed(call.initial_metadata())
        assert generated == reply.result.request_id and HEX_ID.fullmatch(generated or "")

        stream = gateway.Generate(gateway_pb2.GenerateRequest(params=SMALL, request_id="stream-1"), timeout=60)
        first = next(stream)
        assert first.HasField("stage_started") and _echoed(stream.initial_metadata()) == "stream-1"
        assert [e.result.request_id for e in stream if e.HasField("result")] == ["stream-1"]

        for method, request in (
            ("GenerateUnary", gateway_pb2.GenerateUnaryRequest(params=BAD, request_id="bad-1")),
            ("Generate", gateway_pb2.GenerateRequest(params=BAD, request_id="bad-1")),
        ):
            with pytest.raises(grpc.RpcError) as info:
                reply = getattr(gateway, method)(request, timeout=60)
                list(reply) if method == "Generate" else None
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert _echoed(info.value.trailing_metadata()) == "bad-1", method
        with pytest.raises(grpc.RpcError) as info:
            gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=BAD), timeout=60)
        assert HEX_ID.fullmatch(_echoed(info.value.trailing_metadata()) or "")


def test_a_client_error_names_its_request_id_and_fields(client):
    with pytest.raises(stagemesh.InvalidArgumentError) as info:
        client.generate("ids", width=17, height=32, request_id="bad-2")
    assert info.value.request_id == "bad-2" and info.value.retry_delay is None
    assert [v.field for v in info.value.field_violations] == ["params.width"]
    assert client.generate("ids", width=32, height=32, steps=1, request_id="good-2").request_id == "good-2"


# ---- google.rpc.RetryInfo -------------------------------------------------------------------------
def test_resource_exhausted_carries_retry_info(client_mesh, client):
    stalled = StalledClients(client_mesh.address, GENERATE_PATH, stalled_request(512, 1), 1)
    try:
        deadline = time.monotonic() + 120
        # Its events are a few bytes; past 10 KB the gateway is sending the result the client never reads.
        while stalled.calls[0].data_bytes < 10_000:
            assert time.monotonic() < deadline and not stalled.calls[0].ended, stalled.calls[0]
            time.sleep(0.1)
        with Client(client_mesh.address, timeout=RPC_TIMEOUT_S, retries=0) as once:
            with pytest.raises(stagemesh.ResourceExhaustedError) as info:
                once.generate("refused", width=64, height=48, steps=1, output_format="tensor")
        assert "max_undelivered_bytes" in info.value.details
        assert info.value.retry_delay == errors.RESOURCE_EXHAUSTED_RETRY_DELAY_S
        assert info.value.request_id
    finally:
        stalled.close()
    deadline = time.monotonic() + 60
    while True:  # the gateway frees the bytes once it sees the stalled connection gone
        try:
            assert client.generate("after", width=32, height=32, steps=1).width == 32
            break
        except stagemesh.ResourceExhaustedError:
            assert time.monotonic() < deadline, "the undelivered result was never given back"
            time.sleep(0.2)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unavailable_carries_retry_info_and_is_retried_after_the_gateways_delay(tmp_path):
    """A gateway whose one stage is not there answers UNAVAILABLE; gRPC's retry policy asks it
    again after the pushback it sent, and the last error says how long to wait."""
    gateway = spawn_service("gateway", ["gateway", "--stage", f"127.0.0.1:{_closed_port()}"], tmp_path)
    try:
        address = gateway.wait_bound()
        with Client(address, timeout=RPC_TIMEOUT_S, retries=RetryPolicy(max_attempts=3)) as client:
            with pytest.raises(stagemesh.UnavailableError) as info:
                client.generate("nowhere", width=32, height=32, steps=1)
    finally:
        assert gateway.stop() == 0, gateway.logs()[-3000:]
    assert "stage 0" in info.value.details and info.value.retry_delay == errors.UNAVAILABLE_RETRY_DELAY_S
    refused = [line for line in gateway.logs().splitlines() if '"rpc refused"' in line and '"GenerateUnary"' in line]
    assert len(refused) == 3 and all('"UNAVAILABLE"' in line for line in refused), refused
    assert info.value.request_id and info.value.request_id in refused[-1]


def test_several_jpeg_images_from_a_starting_image_round_trip(client):
    start = Image.new("RGB", (48, 32), (30, 160, 220))
    ask = dict(num_images=2, output_format="jpeg", quality=80, init_image=start, strength=0.5, steps=4, seed=20)
    results = client.generate("the same, at dusk", **ask)
    assert [(r.index, r.seed, r.format) for r in results] == [(0, 20, "jpeg"), (1, 21, "jpeg")]
    for result in results:
        # The size is the starting image's: width and height were left unset.
        assert (result.image.format, result.image.size, result.width, result.height) == ("JPEG", (48, 32), 48, 32)
    assert results[0].bytes != results[1].bytes
    events: list[object] = []
    streamed = client.generate("the same, at dusk", **ask, on_progress=events.append)
    assert [r.bytes for r in streamed] == [r.bytes for r in results]
    # int(4 * 0.5) steps run, for each image.
    steps = sorted((e.index, e.step, e.total) for e in events if isinstance(e, DenoisingStep))
    assert steps == [(0, 1, 2), (0, 2, 2), (1, 1, 2), (1, 2, 2)]

"""stagemesh.Client and AsyncClient against a real gRPC server on port 0 that records what reaches
it (tests/support/recording_gateway.py): every argument reaches the wire, results and events come
back typed, errors carry their details, and gRPC's own retry policy (counted server-side) retries
UNAVAILABLE and nothing else."""

from __future__ import annotations

import asyncio
import io
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import stagemesh
from stagemesh import (
    AsyncClient,
    Client,
    DenoisingStep,
    GenerationResult,
    RetryPolicy,
    StageStarted,
    StageState,
)
from stagemesh.core import errors
from stagemesh.v1 import generation_pb2
from tests.support.recording_gateway import Recorder, ServerThread, unavailable

TOKEN = "wire-token-" + "w" * 20


@pytest.fixture(scope="module")
def server():
    running = ServerThread(token=TOKEN)
    yield running
    running.close()


@pytest.fixture
def recorder(server) -> Recorder:
    server.recorder.attempts.clear()
    server.recorder.failures.clear()
    server.recorder.delays.clear()
    return server.recorder


@pytest.fixture
def client(server, recorder, monkeypatch):
    for name in ("STAGEMESH_TOKEN", "STAGEMESH_TOKEN_FILE", "STAGEMESH_API_KEY", "STAGEMESH_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    with Client(server.address, token=TOKEN, timeout=30) as made:
        yield made


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="PNG")
    return out.getvalue()


# ---- what reaches the wire -------------------------------------------------------------------------
def test_every_generate_argument_reaches_the_wire(client, recorder, tmp_path):
    init = _png((200, 10, 10))
    client.generate(
        "a red fox",
        width=48,
        height=32,
        steps=3,
        guidance_scale=2.5,
        seed=11,
        negative_prompt="blurry",
        num_images=2,
        output_format="webp",
        quality=70,
        init_image=init,
        strength=0.6,
        request_id="fox-1",
    )
    [attempt] = recorder.of("GenerateUnary")
    expected = generation_pb2.GenerationParams(
        prompt="a red fox",
        width=48,
        height=32,
        num_inference_steps=3,
        guidance_scale=2.5,
        seed=11,
        negative_prompt="blurry",
        num_images=2,
        output_format=generation_pb2.OUTPUT_FORMAT_WEBP,
        quality=70,
        init_image=init,
        strength=0.6,
    )
    assert attempt.request.params == expected
    assert attempt.request.request_id == "fox-1"
    assert "authorization" not in attempt.metadata  # the token goes on control calls only


def test_unset_arguments_stay_unset_on_the_wire(client, recorder):
    client.generate("plain")
    params = recorder.of("GenerateUnary")[0].request.params
    for name in ("width", "height", "num_inference_steps", "guidance_scale", "seed", "negative_prompt", "num_images"):
        assert not params.HasField(name), name
    assert params.output_format == generation_pb2.OUTPUT_FORMAT_PNG and params.init_image == b""


@pytest.mark.parametrize("kind", ["path", "pil"])
def test_an_init_image_is_sent_from_a_path_or_a_pil_image(client, recorder, tmp_path, kind):
    path = tmp_path / "start.png"
    path.write_bytes(_png((10, 200, 10)))
    image = str(path) if kind == "path" else Image.open(path)
    client.generate("from a start", init_image=image, strength=0.5)
    sent = recorder.of("GenerateUnary")[0].request.params.init_image
    assert Image.open(io.BytesIO(sent)).getpixel((3, 3)) == (10, 200, 10)


def test_arguments_the_client_cannot_send_are_refused_before_any_call(client, recorder):
    with pytest.raises(ValueError, match="output_format = 'gif'"):
        client.generate("x", output_format="gif")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="init_image"):
        client.generate("x", init_image=3.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        client.generate("x", timeout=0)
    assert recorder.attempts == []


# ---- results --------------------------------------------------------------------------------------
def test_a_result_exposes_its_image_bytes_and_metadata(client, tmp_path):
    result = client.generate("a boat", width=48, height=32, seed=5, request_id="boat-1")
    assert isinstance(result, GenerationResult)
    assert (result.format, result.width, result.height, result.seed, result.index) == ("png", 48, 32, 5, 0)
    assert result.request_id == "boat-1" and result.stage_latency_ms == {0: 1.5, 1: 2.5}
    assert result.bytes.startswith(b"\x89PNG")
    assert (result.image.format, result.image.size) == ("PNG", (48, 32))
    with pytest.raises(ValueError, match="not a tensor"):
        _ = result.tensor
    same = result.save(tmp_path / "boat.png")
    assert same.read_bytes() == result.bytes  # the bytes as sent, not re-encoded
    converted = result.save(tmp_path / "boat.jpg")
    assert Image.open(converted).format == "JPEG"


@pytest.mark.parametrize("fmt,pil_name", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_jpeg_and_webp_results(client, fmt, pil_name):
    result = client.generate("a boat", width=32, height=16, output_format=fmt, quality=80)
    assert result.format == fmt
    assert (result.image.format, result.image.size) == (pil_name, (32, 16))


def test_a_tensor_result_as_array_image_and_npy(client, tmp_path):
    result = client.generate("a boat", width=16, height=8, output_format="tensor")
    assert result.format == "tensor"
    assert result.tensor.shape == (8, 16, 3) and result.tensor.dtype == np.float32
    assert len(result.bytes) == 8 * 16 * 3 * 4
    assert result.image.size == (16, 8) and result.image.mode == "RGB"
    assert np.array_equal(np.load(result.save(tmp_path / "t.npy")), result.tensor)
    assert Image.open(result.save(tmp_path / "t.png")).size == (16, 8)


def test_num_images_returns_a_list_by_index_unary_and_streaming(client):
    unary = client.generate("three", num_images=3, seed=100)
    events: list[object] = []
    streamed = client.generate("three", num_images=3, seed=100, on_progress=events.append)
    for results in (unary, streamed):
        assert [r.index for r in results] == [0, 1, 2]
        assert [r.seed for r in results] == [100, 101, 102]
    assert [r.bytes for r in unary] == [r.bytes for r in streamed]
    assert [e.index for e in events if isinstance(e, DenoisingStep) and e.step == 1] == [0, 1, 2]


def test_on_progress_streams_every_event_in_order(client, recorder):
    events: list[object] = []
    result = client.generate("a boat", steps=3, on_progress=events.append)
    assert recorder.of("Generate") and not recorder.of("GenerateUnary")
    assert events[:2] == [StageStarted(0, "ar"), StageStarted(1, "diffusion")]
    assert events[2:5] == [DenoisingStep(1, step, 3, 0) for step in (1, 2, 3)]
    assert events[5] == result and len(events) == 6


def test_an_error_in_on_progress_ends_the_call_and_reaches_the_caller(client):
    def boom(event: object) -> None:
        raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        client.generate("a boat", on_progress=boom)
    assert client.generate("still serving").width == 32


# ---- control calls --------------------------------------------------------------------------------
def test_list_stages_returns_typed_stages(client):
    listing = client.list_stages()
    assert listing.generation_paused and len(listing) == 2
    first, second = listing
    assert (first.stage_id, first.kind, first.state) == (0, "ar", StageState.SERVING)
    assert (second.replicas, second.state, second.sleep_level) == (2, StageState.SLEEPING, 1)


def test_control_calls_carry_the_token_and_sleep_defaults_to_every_stage(client, recorder):
    result = client.sleep(level=1)
    [sleep] = recorder.of("Sleep")
    assert list(sleep.request.stage_ids) == [0, 1] and sleep.request.level == 1  # from ListStages
    assert sleep.metadata["authorization"] == f"Bearer {TOKEN}"
    assert result.ok and result.status == "success"
    assert [(a.stage_id, a.ok, a.level, a.freed_bytes) for a in result.acks] == [
        (0, True, 1, 2**20),
        (1, True, 1, 2**20),
    ]
    woken = client.wake_up([1])
    assert (woken.status, woken.reason) == ("skipped", "target stages are not sleeping")
    assert list(recorder.of("WakeUp")[0].request.stage_ids) == [1]
    client.pause()
    client.resume()
    assert [a.method for a in recorder.attempts][-2:] == ["PauseGeneration", "ResumeGeneration"]


def test_a_control_call_without_the_token_is_unauthenticated(server, monkeypatch):
    monkeypatch.delenv("STAGEMESH_TOKEN", raising=False)
    monkeypatch.delenv("STAGEMESH_TOKEN_FILE", raising=False)
    with Client(server.address, timeout=30) as anonymous:
        with pytest.raises(stagemesh.UnauthenticatedError) as info:
            anonymous.pause()
    assert info.value.code.name == "UNAUTHENTICATED" and "missing bearer token" in info.value.details


# ---- the environment ------------------------------------------------------------------------------
def test_address_token_file_and_api_key_come_from_the_environment(server, recorder, monkeypatch, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("STAGEMESH_ADDRESS", server.address)
    monkeypatch.setenv("STAGEMESH_TOKEN", "not-this-one")  # the file wins
    monkeypatch.setenv("STAGEMESH_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("STAGEMESH_API_KEY", "key-123")
    with Client() as client:
        assert client.address == server.address
        client.pause()
        client.list_stages()
    pause, listing = recorder.attempts
    assert pause.metadata["authorization"] == f"Bearer {TOKEN}" and pause.metadata["x-api-key"] == "key-123"
    assert listing.metadata["x-api-key"] == "key-123" and "authorization" not in listing.metadata


def test_unusable_settings_are_refused_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEMESH_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(stagemesh.StagemeshError, match=r"\$STAGEMESH_TOKEN_FILE: cannot read token file"):
        Client("127.0.0.1:1")
    monkeypatch.delenv("STAGEMESH_TOKEN_FILE")
    with pytest.raises(errors.InvalidArgument, match="--tls-ca: cannot read"):
        Client("127.0.0.1:1", tls_ca=tmp_path / "absent.pem")
    with pytest.raises(errors.InvalidArgument, match="api_key: printable ASCII"):
        Client("127.0.0.1:1", api_key="k\u00e9y")
    with pytest.raises(ValueError, match="retries = 5"):
        Client("127.0.0.1:1", retries=5)
    for bad, words in (
        ({"max_attempts": 6}, "max_attempts = 6: allowed 2 to 5"),
        ({"initial_backoff_s": 0.0}, "initial_backoff_s = 0.0: allowed 0.001 seconds or more"),
        ({"retryable_codes": ("UNAVAILBLE",)}, "retryable_codes ['UNAVAILBLE']"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            RetryPolicy(**bad)


# ---- errors ---------------------------------------------------------------------------------------
def test_invalid_argument_carries_its_field_violations_and_request_id(client, recorder):
    recorder.failures["GenerateUnary"] = [
        errors.InvalidArgument(
            [
                errors.FieldViolation("params.width", "17 is not a multiple of 16"),
                errors.FieldViolation("params.height", "0"),
            ]
        )
    ]
    with pytest.raises(stagemesh.InvalidArgumentError) as info:
        client.generate("x", width=17, height=0, request_id="bad-1")
    error = info.value
    assert [(v.field, v.description) for v in error.field_violations] == [
        ("params.width", "17 is not a multiple of 16"),
        ("params.height", "0"),
    ]
    assert error.request_id == "bad-1" and error.retry_delay is None
    assert str(error) == "INVALID_ARGUMENT:\n  params.width: 17 is not a multiple of 16\n  params.height: 0"
    assert isinstance(error, stagemesh.CallError) and isinstance(error, stagemesh.StagemeshError)


def test_a_deadline_that_passes_is_deadline_exceeded(client, recorder):
    recorder.delays["ListStages"] = lambda: asyncio.sleep(5)
    with pytest.raises(stagemesh.DeadlineExceededError):
        client.list_stages(timeout=0.2)


# ---- retries --------------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_unavailable_is_retried_until_the_server_answers(client, recorder, streaming):
    method = "Generate" if streaming else "GenerateUnary"
    recorder.failures[method] = unavailable(2)
    result = client.generate("again", on_progress=(lambda e: None) if streaming else None)
    assert result.width == 32
    assert len(recorder.of(method)) == 3


def test_a_request_larger_than_grpcs_default_retry_buffer_is_retried_too(client, recorder):
    recorder.failures["GenerateUnary"] = unavailable(1)
    init = bytes(range(256)) * 4096  # 1 MiB; gRPC's default buffer (256 KiB) would commit it unretried
    assert client.generate("big start", init_image=init, strength=0.5).width == 32
    attempts = recorder.of("GenerateUnary")
    assert len(attempts) == 2 and attempts[1].request.params.init_image == init


def test_retries_stop_at_max_attempts_and_the_error_says_when_to_retry(server, recorder):
    recorder.failures["GenerateUnary"] = unavailable(10)
    with Client(server.address, timeout=30, retries=RetryPolicy(max_attempts=3, initial_backoff_s=0.01)) as client:
        with pytest.raises(stagemesh.UnavailableError) as info:
            client.generate("never")
    assert len(recorder.of("GenerateUnary")) == 3
    assert info.value.retry_delay == errors.UNAVAILABLE_RETRY_DELAY_S
    assert "attempt 3" in info.value.details and info.value.request_id


def test_retries_zero_sends_once(server, recorder):
    recorder.failures["ListStages"] = unavailable(1)
    with Client(server.address, timeout=30, retries=0) as client:
        with pytest.raises(stagemesh.UnavailableError):
            client.list_stages()
    assert len(recorder.of("ListStages")) == 1


def test_resource_exhausted_is_retried_only_when_the_policy_names_it(server, recorder):
    full = [errors.ResourceExhausted("stage queue is full (1 waiting); retry later")]
    recorder.failures["GenerateUnary"] = list(full)
    with Client(server.address, timeout=30) as client:
        with pytest.raises(stagemesh.ResourceExhaustedError) as info:
            client.generate("busy")
    assert len(recorder.of("GenerateUnary")) == 1
    assert info.value.retry_delay == errors.RESOURCE_EXHAUSTED_RETRY_DELAY_S
    recorder.failures["GenerateUnary"] = list(full)
    policy = RetryPolicy(retryable_codes=("UNAVAILABLE", "RESOURCE_EXHAUSTED"))
    with Client(server.address, timeout=30, retries=policy) as client:
        assert client.generate("busy").width == 32
    assert len(recorder.of("GenerateUnary")) == 3


def test_a_stopped_then_restarted_server_is_reached_by_retrying(recorder):
    """Stopped: the port refuses the first attempt (a raw listener that closes the connection,
    so the test knows the attempt failed); then the server serves on the port again and a later
    attempt of the same call is answered."""
    server = ServerThread(recorder)
    policy = RetryPolicy(initial_backoff_s=0.5)  # attempts over ~7 s: past gRPC's 1 s reconnect backoff
    try:
        with Client(server.address, timeout=60, retries=policy) as client:
            assert client.list_stages().generation_paused  # connected
            server.stop()
            recorder.attempts.clear()
            refusing = socket.create_server(("127.0.0.1", server.port))
            outcome: list[object] = []
            caller = threading.Thread(target=lambda: outcome.append(_listing_or_error(client)))
            caller.start()
            refusing.settimeout(30)
            connection, _ = refusing.accept()  # the first attempt reached the stopped port
            connection.close()
            refusing.close()
            server.start()
            caller.join(60)
        assert len(outcome) == 1 and outcome[0] == "listed", outcome
        assert len(recorder.of("ListStages")) == 1  # the failed attempt never reached a server
    finally:
        server.close()


def _listing_or_error(client: Client) -> object:
    try:
        return "listed" if len(client.list_stages()) == 2 else "wrong listing"
    except stagemesh.CallError as exc:
        return exc


# ---- AsyncClient ----------------------------------------------------------------------------------
def test_async_client_generates_streams_controls_and_retries(server, recorder, monkeypatch):
    monkeypatch.delenv("STAGEMESH_API_KEY", raising=False)
    recorder.failures["GenerateUnary"] = unavailable(1)

    async def scenario() -> None:
        async with AsyncClient(server.address, token=TOKEN, timeout=30, api_key="async-key") as client:
            result = await client.generate("async", width=16, height=16, request_id="a-1")
            assert (result.width, result.request_id) == (16, "a-1")
            seen: list[object] = []

            async def on_progress(event: object) -> None:
                await asyncio.sleep(0)
                seen.append(event)

            images = await client.generate("async", num_images=2, steps=1, on_progress=on_progress)
            assert [i.index for i in images] == [0, 1] and seen[-1] == images[1]
            assert sum(isinstance(e, DenoisingStep) for e in seen) == 2
            listing = await client.list_stages()
            assert [s.kind for s in listing] == ["ar", "diffusion"]
            assert (await client.sleep([1], level=2)).ok
            assert (await client.wake_up()).status == "skipped"
            await client.pause()
            await client.resume()
            recorder.failures["ListStages"] = [errors.FailedPrecondition("generation is paused")]
            with pytest.raises(stagemesh.FailedPreconditionError, match="generation is paused"):
                await client.list_stages()

    asyncio.run(scenario())
    assert len(recorder.of("GenerateUnary")) == 2  # one retry of UNAVAILABLE
    assert recorder.of("Sleep")[0].metadata["authorization"] == f"Bearer {TOKEN}"
    assert {a.metadata.get("x-api-key") for a in recorder.attempts} == {"async-key"}


def test_a_cancelled_async_generate_cancels_its_call_on_the_server(server, recorder):
    started, cancelled = threading.Event(), threading.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    recorder.delays["Generate"] = slow

    async def scenario() -> None:
        async with AsyncClient(server.address, timeout=60) as client:
            task = asyncio.ensure_future(client.generate("slow", on_progress=lambda e: None))
            assert await asyncio.to_thread(started.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(cancelled.wait, 30), "the server still runs the cancelled call"
            recorder.delays.clear()
            assert (await client.generate("after")).width == 32

    asyncio.run(scenario())


def test_the_package_exports_the_client_lazily():
    light = "import sys, stagemesh; print(sorted(m for m in ('grpc', 'numpy', 'PIL', 'torch') if m in sys.modules))"
    repo = Path(__file__).resolve().parents[2]  # "-c" imports from the working directory first
    done = subprocess.run(
        [sys.executable, "-c", light], cwd=repo, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
    assert stagemesh.Client is Client and stagemesh.AsyncClient is AsyncClient
    assert stagemesh.StagemeshError is errors.StagemeshError
    assert "Client" in dir(stagemesh)
    with pytest.raises(AttributeError):
        _ = stagemesh.NoSuchName  # type: ignore[attr-defined]


def test_saving_to_an_unknown_suffix_writes_the_bytes_as_sent(client, tmp_path):
    result = client.generate("raw")
    assert Path(result.save(tmp_path / "image.bin")).read_bytes() == result.bytes

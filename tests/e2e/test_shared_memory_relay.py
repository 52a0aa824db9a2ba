"""Stage outputs through /dev/shm (core/shared_tensors.py) in a real mesh: `stagemesh up` turns it
on, and with STAGEMESH_SHM_MIN_BYTES=1 every output goes through a segment: the first stage's
hidden states, which the gateway passes on unread, and the picture, which it reads.
A second gateway started alone over the same stages (no --shared-memory: the picture inside the
gRPC messages) gives the same PNG and tensor bytes, and no segment outlives a request, a
cancelled one included. A stage called directly sends its picture in a segment when asked, and
refuses segment names that are not a relay's of its own user, naming the field."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from stagemesh.core import codec, shared_tensors
from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.support.meshproc import clean_mesh, segments_of, shm_entries, spawn_service

pytest.importorskip("torch")

SIZE = 256
TIMEOUT_S = 180.0


def _config(path: Path, model_dir: Path) -> Path:
    stage = f'model_dir = "{model_dir}"\nthreads = 1\n'
    path.write_text(
        f'[gateway]\nport = 0\n\n[cache]\nroot = "{path.parent / "cache"}"\n\n'
        f'[[stages]]\nkind = "ar"\n{stage}\n[[stages]]\nkind = "diffusion"\n{stage}max_size = {SIZE}\n'
    )
    return path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("relay")
    env = {**os.environ, shared_tensors.MIN_BYTES_ENV: "1"}
    with clean_mesh(_config(folder / "mesh.toml", tiny_model), folder / "mesh.log", env=env) as running:
        yield running


def _params(output_format: str = "png", steps: int = 1) -> generation_pb2.GenerationParams:
    return generation_pb2.GenerationParams(
        prompt="a red square",
        width=SIZE,
        height=SIZE,
        num_inference_steps=steps,
        seed=7,
        output_format=getattr(generation_pb2, f"OUTPUT_FORMAT_{output_format.upper()}"),
    )


def _unary(address: str, output_format: str) -> generation_pb2.GenerationResult:
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateUnaryRequest(params=_params(output_format))
        return stub.GenerateUnary(request, timeout=TIMEOUT_S).result


def _relay_segments(mesh) -> set[str]:
    return {s for s in segments_of(shm_entries(), mesh.child_pids()) if "-relay-" in s}


def test_segments_give_the_bytes_the_messages_give(mesh, tmp_path):
    stages = mesh.child_addresses()
    alone = spawn_service("gateway", ["gateway", "--stage", stages["stage-0"], "--stage", stages["stage-1"]], tmp_path)
    try:
        address = alone.wait_bound()
        for output_format in ("png", "tensor"):
            shared = _unary(mesh.address, output_format)
            inline = _unary(address, output_format)
            assert shared.WhichOneof("image") == inline.WhichOneof("image") == output_format
            assert getattr(shared, output_format) == getattr(inline, output_format)
        assert not shared.tensor.shm_name  # a client never gets a segment's name
        assert len(shared.tensor.data) == SIZE * SIZE * 3 * 4
    finally:
        assert alone.stop() == 0
    assert not _relay_segments(mesh)


def _execute(address: str, inputs: dict, shared: bool) -> dict[str, tensor_pb2.Tensor]:
    """One Execute straight to a stage: its outputs, joined."""
    request = stage_pb2.ExecuteRequest(
        request_id=f"direct-{shared}", params=_params(), inputs=inputs, outputs_in_shared_memory=shared
    )
    outputs: dict[str, tensor_pb2.Tensor] = {}
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        for response in stage_pb2_grpc.StageServiceStub(channel).Execute(request, timeout=TIMEOUT_S):
            for name, piece in response.outputs.outputs.items():
                outputs[name] = codec.join_rows(outputs.get(name), piece)
    return outputs


@pytest.fixture(scope="module")
def hidden_states(mesh) -> tensor_pb2.Tensor:
    """The first stage's output for _params(), asked of it directly."""
    return _execute(mesh.child_addresses()["stage-0"], {}, shared=False)["hidden_states"]


def test_a_stage_asked_for_segments_sends_its_outputs_in_them(mesh, hidden_states):
    """The caller owns each segment: reading it gives the bytes the message would have held, and
    unlinks it; a segment of the first stage's is read by the second."""
    first = _execute(mesh.child_addresses()["stage-0"], {}, shared=True)["hidden_states"]
    assert first.shm_name and not first.data
    stage = mesh.child_addresses()["stage-1"]
    inline = _execute(stage, {"hidden_states": hidden_states}, shared=False)["image"]
    shared = _execute(stage, {"hidden_states": first}, shared=True)["image"]
    assert not (shared_tensors.SHM_DIR / first.shm_name).exists()
    assert not inline.shm_name and len(inline.data) == SIZE * SIZE * 3  # uint8 pixels for the PNG
    assert shared.shm_name and not shared.data
    assert (shared_tensors.SHM_DIR / shared.shm_name).is_file()
    assert bytes(codec.payload(shared, "image")) == inline.data
    assert not (shared_tensors.SHM_DIR / shared.shm_name).exists()


def test_cancelled_requests_leave_no_segment(mesh):
    with grpc.insecure_channel(mesh.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for delay_s in (0.05, 0.2, 0.5, 1.0, 1.5):
            call = stub.Generate(gateway_pb2.GenerateRequest(params=_params(steps=2)), timeout=TIMEOUT_S)
            time.sleep(delay_s)
            call.cancel()
        # The last one, left to finish, is served: the stages are fine after the cancellations.
        reply = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params()), timeout=TIMEOUT_S)
        assert reply.result.png.startswith(b"\x89PNG")
    deadline = time.monotonic() + 10
    while _relay_segments(mesh) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _relay_segments(mesh)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../../etc/passwd", "is not a stagemesh relay segment"),
        ("stagemesh-1-relay-" + "0" * 32, "no segment"),
    ],
)
def test_a_stage_refuses_names_that_are_not_relay_segments(mesh, hidden_states, name, why):
    hidden = tensor_pb2.Tensor(dtype=hidden_states.dtype, shape=hidden_states.shape, shm_name=name)
    request = stage_pb2.ExecuteRequest(request_id="r", params=_params(), inputs={"hidden_states": hidden})
    with grpc.insecure_channel(mesh.child_addresses()["stage-1"]) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Execute(request, timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[hidden_states].shm_name" in info.value.details() and why in info.value.details()

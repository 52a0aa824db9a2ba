"""One malformed request must not fail the well-formed requests batched with it, nor show them
its error. The stage refuses malformed inputs before admission (INVALID_ARGUMENT naming
`inputs[name]`, on the wire form, before a step can take seconds); a request whose fault only the
runner finds (models.contract.ItemError) fails alone while its batch-mates run again without it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stagemesh.core import errors
from stagemesh.core.params import Params
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import generation_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2

COND_DIM = 64  # the embedded DiT's conditioning width (PipelineConfig.tiny())
SMALL = generation_pb2.GenerationParams(prompt="p", width=64, height=64, num_inference_steps=2, seed=1)


def _violations(exc: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(exc)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad)
    return {v.field: v.description for v in bad.field_violations}


def _tensor(rows: int, cols: int = COND_DIM, dtype: torch.dtype = torch.float32) -> tensor_pb2.Tensor:
    return tensors.to_proto(torch.zeros(rows, cols, dtype=dtype))


@pytest.mark.mesh
@pytest.mark.parametrize(
    ("inputs", "field", "words"),
    [
        ({}, "inputs[hidden_states]", "missing"),
        ({"hidden_states": _tensor(6, 63)}, "inputs[hidden_states]", "allowed: [N, 64]"),
        ({"hidden_states": _tensor(250_000)}, "inputs[hidden_states]", "N from 1 to"),
        ({"hidden_states": _tensor(6, dtype=torch.int32)}, "inputs[hidden_states]", "dtype"),
        ({"hidden_states": _tensor(6), "extra": _tensor(1)}, "inputs[extra]", "takes no such input"),
    ],
    ids=["missing", "wrong-width", "absurd-rows", "integer", "unknown-name"],
)
def test_a_stage_refuses_malformed_inputs_before_admission_naming_them(mesh, inputs, field, words):
    with grpc.insecure_channel(mesh.child_addresses()["stage-1"]) as channel:
        request = stage_pb2.ExecuteRequest(params=SMALL, inputs=inputs)
        with pytest.raises(grpc.RpcError) as refused:
            list(stage_pb2_grpc.StageServiceStub(channel).Execute(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in _violations(refused.value)[field]


def test_a_request_the_runner_rejects_fails_alone_and_its_batch_mates_still_run(tiny_model):
    torch.set_num_threads(1)
    settings = StageSettings(stage_id=1, kind="diffusion", model_dir=str(tiny_model), threads=1, max_batch_size=4)
    executor = Executor(settings)
    engine = Engine(executor, "diffusion", max_batch_size=4, max_queue=8)
    params = Params("p", 64, 64, 2, 4.0, 1, "tensor")
    good = {"hidden_states": torch.randn(6, COND_DIM)}
    bad = {"hidden_states": torch.randn(6, COND_DIM + 1)}  # past the stage's own check, as a bug could be

    async def one(request_id: str, inputs: dict) -> object:
        try:
            async for event in engine.run(request_id, params, inputs):
                if isinstance(event, OutputsEvent):
                    return event.outputs["image"].shape
        except errors.StagemeshError as exc:
            return exc
        return None

    async def scenario() -> list[object]:
        await asyncio.to_thread(executor.start, 120)
        engine.start()
        try:
            # Admitted together, so they are batched together (same size, steps and guidance).
            return await asyncio.gather(one("good-1", good), one("bad-request", bad), one("good-2", good))
        finally:
            await engine.close()

    try:
        first, failed, second = asyncio.run(scenario())
    finally:
        executor.shutdown()
    assert first == second == (64, 64, 3)
    assert isinstance(failed, errors.InvalidArgument) and "hidden_states must be" in str(failed)
    assert "good-" not in str(failed)

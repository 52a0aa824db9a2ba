"""Generate through a real mesh with the generated Python stubs."""

from __future__ import annotations

import io
import uuid

import numpy
import pytest
import torch
from PIL import Image

from stagemesh.v1 import gateway_pb2, generation_pb2

pytestmark = pytest.mark.mesh


def _params(**kw) -> generation_pb2.GenerationParams:
    base = dict(prompt="a lighthouse at dusk", width=64, height=48, num_inference_steps=3, seed=7)
    base.update(kw)
    return generation_pb2.GenerationParams(**base)


def _unary(stub, **kw) -> generation_pb2.GenerationResult:
    return stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params(**kw)), timeout=120).result


def test_streaming_generate_reports_progress_then_a_png(mesh):
    with mesh.channel() as channel:
        events = list(mesh.gateway(channel).Generate(gateway_pb2.GenerateRequest(params=_params()), timeout=120))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "stage_started" and events[0].stage_started.stage_id == 0
    assert events[0].stage_started.kind == "ar"
    stage1 = kinds.index("stage_started", 1)
    assert events[stage1].stage_started.stage_id == 1
    steps = [(e.denoising_step.step, e.denoising_step.total) for e in events if e.HasField("denoising_step")]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert kinds[-1] == "result" and kinds.count("result") == 1
    result = events[-1].result
    image = Image.open(io.BytesIO(result.png))
    assert image.format == "PNG" and image.size == (64, 48) and image.mode == "RGB"
    assert result.seed == 7 and result.width == 64 and result.height == 48
    assert set(result.stage_latency_ms) == {"0", "1"}


def test_same_seed_same_bytes_other_seed_differs(mesh):
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        first = _unary(stub, seed=11).png
        again = _unary(stub, seed=11).png
        other = _unary(stub, seed=12).png
        other_prompt = _unary(stub, seed=11, prompt="a different prompt").png
    assert first == again
    assert first != other
    assert first != other_prompt


def test_tensor_output_matches_png(mesh):
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        png = _unary(stub, seed=5).png
        raw = _unary(stub, seed=5, output_format=generation_pb2.OUTPUT_FORMAT_TENSOR)
    assert raw.WhichOneof("image") == "tensor"
    assert raw.tensor.dtype == "float32" and list(raw.tensor.shape) == [48, 64, 3]
    values = torch.frombuffer(bytearray(raw.tensor.data), dtype=torch.float32).reshape(48, 64, 3)
    assert 0.0 <= values.min() and values.max() <= 1.0
    pixels = torch.tensor(numpy.array(Image.open(io.BytesIO(png)))).float()
    assert torch.equal((values * 255).round(), pixels)


def test_defaults_fill_unset_fields_and_random_seed_is_reported(mesh):
    params = generation_pb2.GenerationParams(prompt="defaults", num_inference_steps=1)
    with mesh.channel() as channel:
        result = (
            mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=120).result
        )
    # The embedded model was trained at 64 x 64: requests leaving the size unset get that.
    assert (result.width, result.height) == (64, 64)
    assert Image.open(io.BytesIO(result.png)).size == (64, 64)
    assert result.seed > 0


def test_request_id_from_metadata_reaches_every_stage_log(mesh):
    request_id = f"test-{uuid.uuid4().hex}"
    with mesh.channel() as channel:
        result = (
            mesh.gateway(channel)
            .GenerateUnary(
                gateway_pb2.GenerateUnaryRequest(params=_params(num_inference_steps=1)),
                metadata=(("x-request-id", request_id),),
                timeout=120,
            )
            .result
        )
    assert result.request_id == request_id
    logs = [line for line in mesh.logs().splitlines() if request_id in line]
    services = {s for s in ("gateway", "stage-0", "stage-1") if any(f'"service": "{s}"' in line for line in logs)}
    assert services == {"gateway", "stage-0", "stage-1"}, logs


def test_list_stages(mesh):
    with mesh.channel() as channel:
        reply = mesh.gateway(channel).ListStages(gateway_pb2.ListStagesRequest(), timeout=10)
    assert [(s.stage_id, s.kind) for s in reply.stages] == [(0, "ar"), (1, "diffusion")]
    assert all(s.state == gateway_pb2.STAGE_STATE_SERVING and s.replicas == 1 for s in reply.stages)
    assert all(s.device == "cpu" for s in reply.stages)


def test_concurrent_requests_each_get_their_own_result(mesh):
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        futures = [
            stub.GenerateUnary.future(gateway_pb2.GenerateUnaryRequest(params=_params(seed=s)), timeout=120)
            for s in range(6)
        ]
        results = [f.result().result for f in futures]
        alone = _unary(stub, seed=3).png
    assert [r.seed for r in results] == list(range(6))
    assert len({r.png for r in results}) == 6
    # Batched with others or run alone, a request gets its own picture. Batch composition may
    # move float rounding (a pixel by one level), never the content.
    batched = numpy.asarray(Image.open(io.BytesIO(results[3].png))).astype(int)
    single = numpy.asarray(Image.open(io.BytesIO(alone))).astype(int)
    assert numpy.abs(batched - single).max() <= 1
    assert (batched != single).mean() < 0.01

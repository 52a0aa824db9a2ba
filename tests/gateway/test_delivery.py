"""The gateway counts a result by its picture's length plus a bound on its other fields
(delivery.result_bytes), instead of encoding it to learn its size: the count must never fall
below the size the result has on the wire."""

from __future__ import annotations

import os

import pytest

from stagemesh.gateway.delivery import RESULT_FIELDS_BOUND, result_bytes
from stagemesh.v1 import generation_pb2, tensor_pb2


def _result(**picture) -> generation_pb2.GenerationResult:
    return generation_pb2.GenerationResult(
        request_id="r" * 128,  # the longest request id a client may send
        width=4096, height=4096, seed=2**64 - 1, index=7, num_frames=81, fps=24, output_format=5,
        stage_latency_ms={str(i): 123456.789 for i in range(16)},
        step_cache="taylorseer", step_cache_skipped=10**6, step_cache_passes=10**6,
        **picture,
    )  # fmt: skip


@pytest.mark.parametrize(
    "picture",
    [
        {},
        {"png": os.urandom(3_000_000)},
        {"mp4": os.urandom(100)},
        {"tensor": tensor_pb2.Tensor(dtype="float32", shape=[1024, 1024, 3], data=bytes(12 * 1024 * 1024))},
    ],
    ids=["none", "png", "mp4", "tensor"],
)
def test_the_count_bounds_the_size_on_the_wire(picture):
    result = _result(**picture)
    assert result.ByteSize() <= result_bytes(result) <= result.ByteSize() + RESULT_FIELDS_BOUND

"""The torch-free side of the tensor codec: the checks on a stagemesh.v1.Tensor and its numpy view
(what the gateway decodes the last stage's image with)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from stagemesh.core import codec
from stagemesh.core.errors import InvalidArgument
from stagemesh.v1 import tensor_pb2


def _message(dtype: str, shape: list[int], data: bytes) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)


@pytest.mark.parametrize(
    "dtype, fmt, values",
    [
        ("float32", "<4f", (0.0, 1.5, -2.25, 0.0078125)),
        ("float16", "<4e", (0.0, 1.5, -2.25, 65504.0)),
        ("float64", "<4d", (0.0, 1.5, -2.25, 1e300)),
        ("int64", "<4q", (0, -1, 2**62, -(2**63))),
        ("uint8", "<4B", (0, 1, 128, 255)),
        ("bool", "<4?", (True, False, True, True)),
    ],
)
def test_array_holds_the_little_endian_values(dtype, fmt, values):
    array = codec.to_array(_message(dtype, [2, 2], struct.pack(fmt, *values)))
    assert array.shape == (2, 2)
    assert array.reshape(-1).tolist() == list(values)


def test_bfloat16_widens_exactly_to_float32():
    wanted = np.array([1.0, -2.5, 0.0078125, 3.3895314e38], dtype=np.float32)
    upper_halves = (wanted.view("<u4") >> 16).astype("<u2")  # these values fit bfloat16 exactly
    array = codec.to_array(_message("bfloat16", [4], upper_halves.tobytes()))
    assert array.dtype == np.float32 and np.array_equal(array, wanted)


def test_empty_tensors_decode():
    assert codec.to_array(_message("float32", [0, 3], b"")).shape == (0, 3)


@pytest.mark.parametrize(
    "message, field, match",
    [
        (
            _message("float32", [2, 2], bytes(15)),
            "inputs[x].data",
            r"holds 15 bytes, shape \[2, 2\] of float32 needs 16",
        ),
        (_message("complex128", [1], bytes(16)), "inputs[x].dtype", "unknown dtype 'complex128'; allowed: .*bfloat16"),
        (_message("uint8", [-1], b""), "inputs[x].shape", "dimensions must be >= 0"),
    ],
)
def test_inconsistent_messages_are_refused_naming_the_field(message, field, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        codec.to_array(message, "inputs[x]")
    assert [v.field for v in info.value.violations] == [field]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.uint8, np.int8, np.int32, np.int64, np.bool_])
def test_arrays_go_out_little_endian_and_come_back(dtype):
    array = (np.arange(12) % 3).astype(dtype).reshape(3, 4).T  # not contiguous
    message = codec.from_array(array)
    assert list(message.shape) == [4, 3] and np.array_equal(codec.to_array(message), array)
    big = array.astype(np.dtype(dtype).newbyteorder(">"))
    assert codec.from_array(big).data == message.data  # the wire is little-endian whatever the host's order


def test_an_array_without_a_wire_dtype_is_refused():
    with pytest.raises(ValueError, match="complex64 array has no stagemesh.v1.Tensor dtype; allowed: .*float32"):
        codec.from_array(np.zeros(2, np.complex64))


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("max_bytes", [1, 48, 100, 10_000])
def test_rows_split_and_join_back(rows, max_bytes):
    """A video's frames in pieces under a message bound: whole rows each, joined back exactly."""
    array = np.arange(rows * 4 * 3, dtype="<f4").reshape(rows, 4, 3)
    message = codec.from_array(array)
    pieces = codec.split_rows(message, max_bytes)
    row_bytes = 4 * 3 * 4
    assert all(len(p.data) <= max(max_bytes, row_bytes) for p in pieces)
    assert sum(p.shape[0] for p in pieces) == rows
    whole = None
    for piece in pieces:
        whole = codec.join_rows(whole, piece)
    assert whole == message


def test_a_piece_of_another_shape_does_not_join():
    first = codec.from_array(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(InvalidArgument) as info:
        codec.join_rows(first, codec.from_array(np.zeros((2, 4), dtype=np.float32)), "outputs[video]")
    assert info.value.violations[0].field == "outputs[video]"

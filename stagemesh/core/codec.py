"""stagemesh.v1.Tensor (raw little-endian bytes, a dtype name and a shape): the dtypes, the checks
every decoder makes, and numpy arrays to and from them.

Torch-free on purpose: the gateway decodes the last stage's image with it, and a gateway-only
install has no torch. The stage's torch conversions build on these checks
(stage_service/transport/tensors.py).
"""

from __future__ import annotations

import numpy as np

from stagemesh.core import shared_tensors
from stagemesh.core.errors import InvalidArgument
from stagemesh.v1 import tensor_pb2

# dtype name -> bytes per element; the names are torch's (str(dtype) without "torch.").
ITEM_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
DTYPES = tuple(ITEM_BYTES)
# numpy has no bfloat16: its raw 16 bits are read as uint16 and widened (see to_array).
_NUMPY = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float64": "<f8",
    "uint8": "u1",
    "int8": "i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "bool": "?",
}
_NAMES = {np.dtype(code): name for name, code in _NUMPY.items() if name != "bfloat16"}


def checked_shape(message: tensor_pb2.Tensor, field: str = "tensor") -> tuple[int, ...]:
    """The message's shape, once its dtype is known and its bytes are exactly what dtype and shape
    need (for a segment's bytes, checked when it is read: `payload`); INVALID_ARGUMENT naming
    `field` otherwise."""
    shape, expected = _shape_and_bytes(message, field)
    if message.shm_name:
        if message.data:
            raise InvalidArgument.field(f"{field}.data", "set together with shm_name; a tensor has one or the other")
        return shape
    if len(message.data) != expected:
        raise InvalidArgument.field(
            f"{field}.data", f"holds {len(message.data)} bytes, shape {list(shape)} of {message.dtype} needs {expected}"
        )
    return shape


def _shape_and_bytes(message: tensor_pb2.Tensor, field: str) -> tuple[tuple[int, ...], int]:
    item_bytes = ITEM_BYTES.get(message.dtype)
    if item_bytes is None:
        raise InvalidArgument.field(f"{field}.dtype", f"unknown dtype {message.dtype!r}; allowed: {sorted(DTYPES)}")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument.field(f"{field}.shape", "dimensions must be >= 0")
    expected = item_bytes
    for d in shape:
        expected *= d
    return shape, expected


def nbytes(message: tensor_pb2.Tensor, field: str = "tensor") -> int:
    """The bytes dtype and shape need (where they are: `data` or a segment)."""
    return _shape_and_bytes(message, field)[1]


def payload(message: tensor_pb2.Tensor, field: str = "tensor") -> bytes | memoryview:
    """The tensor's bytes: its `data`, or its shared-memory segment's, read (and unlinked) now."""
    if not message.shm_name:
        return message.data
    _, expected = _shape_and_bytes(message, field)
    return shared_tensors.take(message.shm_name, expected, field)


def materialized(message: tensor_pb2.Tensor, field: str = "tensor") -> tensor_pb2.Tensor:
    """The message with its bytes in `data` (what a client is sent: never a segment's name)."""
    if not message.shm_name:
        return message
    return tensor_pb2.Tensor(dtype=message.dtype, shape=message.shape, data=bytes(payload(message, field)))


def to_pixels(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] float in [0, 1] -> uint8: scaled in float32, rounded half to even, clamped. The
    one conversion of an image to the pixels PNG, JPEG and WebP encode, wherever it runs (the
    stage before it sends an image for such a format, the gateway for any other); uint8 pixels
    pass as they are."""
    if image.dtype == np.uint8:
        return image
    return (image.astype(np.float32, copy=False) * np.float32(255.0)).round().clip(0, 255).astype(np.uint8)


def to_array(message: tensor_pb2.Tensor, field: str = "tensor") -> np.ndarray:
    """The message as a numpy array: a read-only view of its bytes, except bfloat16, which numpy
    lacks and which is widened to float32 (exactly: bfloat16 is float32's upper 16 bits)."""
    shape = checked_shape(message, field)
    data = payload(message, field)
    if message.dtype == "bfloat16":
        bits = np.frombuffer(data, dtype=_NUMPY["bfloat16"]).astype("<u4") << 16
        return bits.view("<f4").reshape(shape)
    return np.frombuffer(data, dtype=_NUMPY[message.dtype]).reshape(shape)


def from_array(array: np.ndarray) -> tensor_pb2.Tensor:
    """A numpy array as a message (what the gateway sends a stage it built from, say, a decoded
    image). numpy's dtypes only: there is no bfloat16 to send."""
    name = _NAMES.get(array.dtype.newbyteorder("<"))
    if name is None:
        allowed = sorted(n for n in DTYPES if n != "bfloat16")
        raise ValueError(f"a {array.dtype} array has no stagemesh.v1.Tensor dtype; allowed: {allowed}")
    little = np.ascontiguousarray(array, dtype=np.dtype(_NUMPY[name]))
    return tensor_pb2.Tensor(dtype=name, shape=list(array.shape), data=little.tobytes())


def split_rows(message: tensor_pb2.Tensor, max_bytes: int) -> list[tensor_pb2.Tensor]:
    """The tensor as pieces of whole rows (slices of its first axis) of at most `max_bytes` each
    (a single row larger than that is one piece): a video's frames sent in several messages,
    each under gRPC's message size limit. `join_rows` puts them back together."""
    if len(message.data) <= max_bytes or len(message.shape) == 0 or message.shape[0] < 2:
        return [message]
    rows = int(message.shape[0])
    row_bytes = len(message.data) // rows
    per_piece = max(1, max_bytes // max(row_bytes, 1))
    return [
        tensor_pb2.Tensor(
            dtype=message.dtype,
            shape=[min(per_piece, rows - start), *message.shape[1:]],
            data=message.data[start * row_bytes : (start + per_piece) * row_bytes],
        )
        for start in range(0, rows, per_piece)
    ]


def join_rows(whole: tensor_pb2.Tensor | None, piece: tensor_pb2.Tensor, field: str = "tensor") -> tensor_pb2.Tensor:
    """`piece`'s rows appended to `whole`'s (None: the first piece); both must agree in dtype and
    in every axis but the first."""
    if whole is None:
        return piece
    if whole.shm_name or piece.shm_name:
        raise InvalidArgument.field(field, "a tensor in shared memory comes whole, never in pieces")
    if piece.dtype != whole.dtype or list(piece.shape[1:]) != list(whole.shape[1:]) or not piece.shape:
        raise InvalidArgument.field(
            field,
            f"a piece of {piece.dtype} {list(piece.shape)} does not continue {whole.dtype} {list(whole.shape)}",
        )
    return tensor_pb2.Tensor(
        dtype=whole.dtype, shape=[whole.shape[0] + piece.shape[0], *whole.shape[1:]], data=whole.data + piece.data
    )

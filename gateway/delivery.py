"""A bound on result bytes held for clients that have not taken them. A Generate's result stays in
the gateway's memory until its client has read it; a client that grants no HTTP/2 flow-control
window never does, and grpc gives a server no way to drop one such call. So the gateway counts
the bytes of results whose calls have not ended, and refuses a result that would go over the
bound with RESOURCE_EXHAUSTED instead of holding it too."""

from __future__ import annotations

from typing import Any, cast

import grpc

from stagemesh.core import errors, logs
from stagemesh.v1 import generation_pb2

log = logs.get_logger("stagemesh.gateway")

# Above what a result's fields other than its picture take on the wire (ids, sizes, seed, the
# per-stage latencies): a result is counted as its picture plus this, never less than it is.
RESULT_FIELDS_BOUND = 4096


def result_bytes(result: generation_pb2.GenerationResult) -> int:
    """An upper bound of the result's size on the wire, from its picture's length. Not ByteSize:
    protobuf finds that by encoding the whole message, milliseconds for a picture's megabytes,
    which the gateway would then pay again to send it."""
    kind = result.WhichOneof("image")
    if kind is None:
        return RESULT_FIELDS_BOUND
    picture = result.tensor.data if kind == "tensor" else getattr(result, kind)
    return len(picture) + RESULT_FIELDS_BOUND


class DeliveryBudget:
    def __init__(self, max_bytes: int):
        self._max_bytes = max_bytes
        self.held_bytes = 0

    def take(self, size: int, context: grpc.aio.ServicerContext) -> None:
        """Count `size` until the call ends; refuse it when the bound would be passed (a single
        result larger than the bound is let through when nothing else is held)."""
        if self.held_bytes and self.held_bytes + size > self._max_bytes:
            log.warning("result refused: undelivered results at the bound", held_bytes=self.held_bytes)
            raise errors.ResourceExhausted(
                f"{self.held_bytes} bytes of results are still waiting for clients to read them "
                f"(the gateway's max_undelivered_bytes is {self._max_bytes}); retry later, and read "
                "streams as they arrive"
            )
        self.held_bytes += size
        context.add_done_callback(cast(Any, _GiveBack(self, size)))


class _GiveBack:
    """Run once the call ends (read, cancelled, or its connection gone): the bytes are free again."""

    def __init__(self, budget: DeliveryBudget, size: int):
        self._budget = budget
        self._size = size

    def __call__(self, _context: object) -> None:
        self._budget.held_bytes -= self._size

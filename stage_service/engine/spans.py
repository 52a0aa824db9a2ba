"""A request's spans inside the stage, under the Execute call's server span (core/tracing.py):

    queue wait        admitted -> handed to a worker group (again after a batch mate's failure)
    batch             handed to the group -> the worker's answer (COMPUTE_DONE, or the result in
                      step mode); linked to the server spans of the other requests it ran with
      worker compute  the worker took the batch -> its forward pass returned
    output delivery   the forward pass returned -> the request has its outputs (device-to-host
                      copy, packing, the result pipe, unpacking)

The worker process makes no span of its own: it stamps each batch with wall-clock times
(transport.protocol.BatchTiming) and the spans are made here, on the event loop. One batch serves
requests of several traces, each of which gets the worker's times under its own batch span; a
worker that dies (os._exit after a collective failure, SIGKILL when hung) cannot lose spans it
never buffered; and the workers need no exporter, connection or export thread beside the device
loop. Both processes read the same host clock.

Made only while tracing is on: StageRequest.trace stays None otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from stagemesh.core import tracing
from stagemesh.stage_service.transport.protocol import BatchTiming

if TYPE_CHECKING:
    from opentelemetry.trace import Span

LEFT = "CANCELLED: the caller went away or its deadline passed"


class RequestSpans:
    """The spans of one request still open, each ended as the request moves on."""

    def __init__(self, waiting: int) -> None:
        self.parent = tracing.current_context()  # the Execute call's server span, current in run()
        self._queue: Span | None = None
        self._batch: Span | None = None
        self._delivery: Span | None = None
        self._queued(waiting)

    def _start(self, name: str, parent: Any = None, **kwargs: Any) -> Span:
        return tracing.start_span(name, parent=parent if parent is not None else self.parent, **kwargs)

    def _queued(self, waiting: int) -> None:
        self._queue = self._start("queue wait", attributes={"stagemesh.queue.waiting_before": waiting})

    def dispatched(self, group: int, mates: Sequence[RequestSpans], kind: str) -> None:
        if self._queue is not None:
            tracing.end_span(self._queue)
            self._queue = None
        attributes = {"stagemesh.batch.kind": kind, "stagemesh.batch.size": len(mates), "stagemesh.worker.group": group}
        links = [m.parent for m in mates if m is not self]
        self._batch = self._start(kind.replace("_", " "), attributes=attributes, links=links)

    def computed(self, timing: BatchTiming | None) -> None:
        batch, self._batch = self._batch, None
        if batch is None:
            return
        if timing is not None:
            attributes = {"stagemesh.worker.rank": timing.rank, "stagemesh.worker.pid": timing.pid}
            compute = self._start("worker compute", batch, attributes=attributes, start_ns=timing.started_ns)
            tracing.end_span(compute, end_ns=timing.computed_ns)
        tracing.end_span(batch)
        self._delivery = self._start("output delivery", start_ns=timing.computed_ns if timing is not None else None)

    def requeued(self, reason: str) -> None:
        """A batch mate's input failed the batch before it ran: this request waits at the head of
        the queue for another."""
        if self._batch is not None:
            tracing.end_span(self._batch, reason)
            self._batch = None
        self._queued(0)

    def finished(self, error: str | None = None) -> None:
        """The request has its outputs (or its error): every span still open ends."""
        for span in (self._queue, self._batch, self._delivery):
            if span is not None:
                tracing.end_span(span, error)
        self._queue = self._batch = self._delivery = None


class Traced(Protocol):
    """A request as seen here (engine.request.StageRequest)."""

    trace: RequestSpans | None


def dispatched(requests: Sequence[Traced], group: int, kind: str) -> None:
    mates = [r.trace for r in requests if r.trace is not None]
    for spans in mates:
        spans.dispatched(group, mates, kind)


def computed(requests: Sequence[Traced], done: Any) -> None:
    """`done`: the worker's answer (protocol.ComputeDone, or executor.StepOutputs)."""
    timing = getattr(done, "timing", None)
    for r in requests:
        if r.trace is not None:
            r.trace.computed(timing)

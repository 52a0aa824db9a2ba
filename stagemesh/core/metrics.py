"""Prometheus metrics of one service process, served over HTTP at /metrics when `--metrics-port`
(mesh.toml `metrics_port`) is set. The RPC metrics every service shares are named here; each
service registers its own readings (its `metrics.py`); docs/OPERATIONS.md lists them all.

RPC metrics come from a grpc.aio server interceptor rather than from `servicer_method`: only
there are the codes visible that no servicer sets — a call refused by the auth interceptor, a
call gRPC cancelled because the client went away or its deadline passed, health checks,
reflection and unknown methods.
"""

from __future__ import annotations

import argparse
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from stagemesh.core import errors, logs

log = logs.get_logger("stagemesh.core.metrics")

PORT_HELP = (
    "serve Prometheus metrics over HTTP at /metrics on this port, bound to --host; "
    "0 picks a free one (logged, and written to the ready file); unset: no metrics endpoint"
)
# Seconds: a health check takes about a millisecond, a large diffusion request minutes.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# A call that gRPC ends this close to (or after) its deadline, with no status of its own, ran out
# of time; earlier, its client went away.
DEADLINE_SLACK_S = 0.01
UNKNOWN_METHOD = "unknown"  # label of calls to methods no service has: no label per guessed name

_KINDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def check_port(port: int | None, option: str) -> None:
    """Refuse a metrics port outside 0..65535, naming the option; None means off."""
    if port is None:
        return
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"{option} = {port!r}: allowed 0 (a free port) to 65535, or unset for no metrics endpoint")


def port_argument(text: str) -> int:
    """argparse type of --metrics-port."""
    try:
        port = int(text)
        check_port(port, "--metrics-port")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; allowed: 0 (a free port) to 65535") from None
    return port


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=port_argument, default=None, metavar="PORT", help=PORT_HELP)


@dataclass(frozen=True)
class Reading:
    """One value read from a service's domain objects at scrape time."""

    name: str
    doc: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()
    counter: bool = False  # exposed as `<name>_total`


Reader = Callable[[], Iterable[Reading]]


class ServiceMetrics:
    """The metrics of one service process. With `port` None it is off: no interceptor, no
    endpoint, and prometheus_client is not even imported."""

    def __init__(self, service: str, host: str, port: int | None):
        self.service = service
        self.host = host
        self.port = port
        self.address = ""
        self._http: Any = None
        self._thread: threading.Thread | None = None
        if port is None:
            return
        # Imported only when on: every CLI command parses these flags, most never serve metrics.
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        # A registry of our own: nothing leaks in from libraries that use the global default.
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_* (CPU, resident memory, open fds)
        labels = ["service", "method"]
        self._requests = Counter(
            "stagemesh_requests",
            "RPCs finished, by method and final status code",
            [*labels, "code"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "stagemesh_request_latency_seconds",
            "time from the handler's start until the RPC ended",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._in_flight = Gauge(
            "stagemesh_requests_in_flight", "RPCs being handled now", labels, registry=self.registry
        )
        self._readers = _Readings(service)
        self.registry.register(self._readers)

    @property
    def enabled(self) -> bool:
        return self.port is not None

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Put first in the server's list: it then also sees what later interceptors refuse."""
        return [_RpcInterceptor(self)] if self.enabled else []

    def add_readings(self, reader: Reader) -> None:
        if self.enabled:
            self._readers.readers.append(reader)

    def start(self) -> str:
        """Serve /metrics; returns the address ('' when off)."""
        if self.port is None:
            return ""
        from prometheus_client import start_http_server

        try:
            self._http, self._thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            raise errors.Unavailable(f"cannot bind --metrics-port {self.host}:{self.port}: {exc}") from None
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"{host}:{self._http.server_port}"
        log.info("metrics listening", address=self.address, url=f"http://{self.address}/metrics")
        return self.address

    def stop(self) -> None:
        if self._http is not None and self._thread is not None:  # started together
            self._http.shutdown()
            self._http.server_close()
            self._thread.join()
            self._http = None

    # RPC accounting (event-loop thread) ---------------------------------------------------------
    def rpc_started(self, method: str) -> None:
        self._in_flight.labels(self.service, method).inc()

    def rpc_ended(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self._in_flight.labels(self.service, method).dec()
        self._requests.labels(self.service, method, code.name).inc()
        self._latency.labels(self.service, method).observe(seconds)

    def rpc_refused(self, method: str, code: grpc.StatusCode) -> None:
        """A call that never reached a handler (unknown method, failing interceptor)."""
        self._requests.labels(self.service, method, code.name).inc()


class _Readings:
    """A collector over the readers' values, grouped into one family per name."""

    def __init__(self, service: str):
        self.service = service
        self.readers: list[Reader] = []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for reader in list(self.readers):
            try:
                readings = list(reader())
            except Exception:  # one failing reader must not fail the whole scrape
                log.exception("metrics reader failed")
                continue
            for r in readings:
                family = families.get(r.name)
                if family is None:
                    kind = CounterMetricFamily if r.counter else GaugeMetricFamily
                    family = families[r.name] = kind(r.name, r.doc, labels=["service", *(k for k, _ in r.labels)])
                family.add_metric([self.service, *(v for _, v in r.labels)], r.value)
        return list(families.values())


def final_code(set_code: Any, ended: grpc.StatusCode | None, time_remaining: float | None) -> grpc.StatusCode:
    """The status an RPC ended with: what abort()/set_code() set, else how the handler ended
    (returned: OK; raised: UNKNOWN), else gRPC cancelled the handler (deadline or client gone)."""
    if isinstance(set_code, grpc.StatusCode):
        return set_code
    if ended is not None:
        return ended
    if time_remaining is not None and time_remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class _Call:
    """One RPC. The wrapper notes how the handler ended; the context's done callback, which gRPC
    runs once the call is over whatever happened (even when the handler task was cancelled while
    writing), records the final code."""

    def __init__(self, metrics: ServiceMetrics, method: str, context: grpc.aio.ServicerContext):
        self.metrics = metrics
        self.method = method
        self.ended: grpc.StatusCode | None = None
        self.started = time.perf_counter()
        metrics.rpc_started(method)
        # The stub declares the callback as a class rather than a callable protocol.
        context.add_done_callback(self._done)  # type: ignore[arg-type]

    def _done(self, context: grpc.aio.ServicerContext) -> None:
        code = final_code(context.code(), self.ended, context.time_remaining())
        self.metrics.rpc_ended(self.method, code, time.perf_counter() - self.started)


def _observe_unary(behavior: Callable, metrics: ServiceMetrics, method: str) -> Callable:
    async def observed(request, context):
        call = _Call(metrics, method, context)
        try:
            reply = await behavior(request, context)
        except Exception:
            call.ended = grpc.StatusCode.UNKNOWN  # an abort() has set its code, which wins
            raise
        call.ended = grpc.StatusCode.OK
        return reply

    return observed


def _observe_stream(behavior: Callable, metrics: ServiceMetrics, method: str) -> Callable:
    async def observed(request, context):
        call = _Call(metrics, method, context)
        try:
            async for item in behavior(request, context):
                yield item
        except Exception:
            call.ended = grpc.StatusCode.UNKNOWN
            raise
        call.ended = grpc.StatusCode.OK

    return observed


def _observe(handler: grpc.RpcMethodHandler, metrics: ServiceMetrics, method: str) -> grpc.RpcMethodHandler:
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, kind)
    # gRPC picks the calling convention by the behavior's type: the wrapper keeps it.
    if inspect.isasyncgenfunction(behavior):
        wrapped = _observe_stream(behavior, metrics, method)
    elif inspect.iscoroutinefunction(behavior):
        wrapped = _observe_unary(behavior, metrics, method)
    else:
        return handler  # a synchronous handler (none of ours): left as it is
    # gRPC's handlers are namedtuples; the stub declares an abstract class without _replace.
    return handler._replace(**{kind: wrapped})  # type: ignore[attr-defined]


class _RpcInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: ServiceMetrics):
        self._metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method.lstrip("/")
        try:
            handler = await continuation(details)
        except Exception:
            self._metrics.rpc_refused(method, grpc.StatusCode.UNKNOWN)
            raise
        if handler is None:  # gRPC answers UNIMPLEMENTED "Method not found!"
            self._metrics.rpc_refused(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED)
            return None
        return _observe(handler, self._metrics, method)

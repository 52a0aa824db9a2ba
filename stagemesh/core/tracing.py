"""OpenTelemetry traces of requests across the mesh (docs/OPERATIONS.md, "Tracing").

One switch: tracing is on when OTEL_TRACES_EXPORTER names an exporter (`otlp`, `console`), off when
it is unset or `none` (or OTEL_SDK_DISABLED=true). Off, nothing of OpenTelemetry is imported and
every hook is one test of `ON`. On, `configure` builds the SDK's tracer provider from the
standard OTEL_* variables, and every service:

- starts a server span for each call of its own services (`TracingInterceptor`; the gateway's HTTP
  middleware does the same), continuing the caller's W3C trace context (`traceparent`), with the
  call's status: ERROR and `CODE: message` for a refused or failed call;
- binds `trace_id` and `span_id` beside `request_id` for the log lines of the call;
- passes the context on (`outgoing`) to the calls it makes.

A span is never made current inside an async generator (a context token set in one task may be
reset in another); its parent is given explicitly, or is the context the server span made current
for the whole call.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from stagemesh.core import errors, logs
from stagemesh.core.metrics import final_code

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

log = logs.get_logger("stagemesh.core.tracing")

EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
SDK_DISABLED_ENV = "OTEL_SDK_DISABLED"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
EXPORTERS = ("otlp", "console")
# The OTLP exporter's protocol when neither protocol variable is set: gRPC, as the Python SDK's
# own `otlp` exporter (its package comes with the `tracing` extra).
DEFAULT_PROTOCOL = "grpc"
_EXPORTER_PACKAGES = {
    "grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "http/protobuf": "opentelemetry-exporter-otlp-proto-http",
}
# Calls a service's own machinery repeats (the gateway asks each stage to describe itself every
# half second while it loads): a span only when the caller's trace continues in them.
POLLED_METHODS = frozenset({"stagemesh.v1.StageService/DescribeStage"})
# Only the mesh's own services are traced: health checks and reflection are polled and say nothing.
TRACED_PREFIX = "stagemesh."
TRACER_NAME = "stagemesh"
# How long a stopping service waits for its last spans to be exported: a collector that cannot be
# reached would hold the stop for the exporter's whole retry timeout.
FLUSH_ON_STOP_S = 5.0

ON = False
_provider: Any = None
_tracer: Any = None


def exporters_wanted(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters OTEL_TRACES_EXPORTER names ([]: tracing off); an unknown name is refused."""
    if environ.get(SDK_DISABLED_ENV, "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get(EXPORTER_ENV, "").split(",") if n.strip()]
    names = [n for n in names if n != "none"]
    for name in names:
        if name not in EXPORTERS:
            raise errors.InvalidArgument.field(
                f"${EXPORTER_ENV}", f"{name!r} is not an exporter; allowed: {', '.join(EXPORTERS)}, none"
            )
    return list(dict.fromkeys(names))


def configure(default_service_name: str) -> bool:
    """Turn tracing on for this process if OTEL_TRACES_EXPORTER asks for it; whether it is on.
    `default_service_name` names the process unless OTEL_SERVICE_NAME (or service.name in
    OTEL_RESOURCE_ATTRIBUTES) does."""
    global ON, _provider, _tracer
    names = exporters_wanted()
    if not names:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise errors.InvalidArgument.field(
            f"${EXPORTER_ENV}", "tracing needs the OpenTelemetry SDK: pip install 'stagemesh[tracing]'"
        ) from None
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    # OTEL_TRACES_SAMPLER and its argument; flushed by shutdown() at the stop, bounded, not at exit.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))  # OTEL_BSP_*
    trace.set_tracer_provider(provider)
    _forward_sdk_logs()
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)
    ON = True
    log.info("tracing on", exporters=names, service_name=resource.attributes.get(SERVICE_NAME))
    return True


class _ToServiceLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, record.getMessage(), logger=record.name)


def _forward_sdk_logs() -> None:
    """The SDK reports failed exports through the logging module: as the service's own JSON lines,
    one event a line like every other (Python's last-resort handler would print plain text)."""
    sdk_log = logging.getLogger("opentelemetry")
    sdk_log.addHandler(_ToServiceLog())
    sdk_log.propagate = False


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # One line per span on stdout: the JSON log lines on stderr stay one event per line.
        return ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + os.linesep)
    named_by = next((v for v in PROTOCOL_ENVS if os.environ.get(v, "").strip()), None)
    protocol = os.environ[named_by].strip() if named_by else DEFAULT_PROTOCOL
    if protocol not in _EXPORTER_PACKAGES:
        raise errors.InvalidArgument.field(
            f"${named_by}", f"{protocol!r} is not an OTLP protocol; allowed: {', '.join(_EXPORTER_PACKAGES)}"
        )
    module = "grpc" if protocol == "grpc" else "http"
    try:
        # Reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT, _INSECURE, _CERTIFICATE ...
        exporter = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{module}.trace_exporter")
    except ImportError:
        raise errors.InvalidArgument.field(
            f"${EXPORTER_ENV}", f"OTLP over {protocol} needs pip install {_EXPORTER_PACKAGES[protocol]}"
        ) from None
    return exporter.OTLPSpanExporter()


def shutdown(timeout_s: float = FLUSH_ON_STOP_S) -> None:
    """Export what is still buffered, waiting at most `timeout_s`: the service is stopping."""
    global ON
    if _provider is None or not ON:
        return
    ON = False
    flush = threading.Thread(target=_provider.shutdown, name="trace-flush", daemon=True)
    flush.start()
    flush.join(timeout_s)
    if flush.is_alive():
        log.warning("spans not exported before the stop", waited_s=timeout_s)


# spans ----------------------------------------------------------------------------------------
def start_span(
    name: str,
    *,
    kind: str = "internal",
    parent: Context | Span | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Iterable[Context | Span] = (),
    start_ns: int | None = None,
) -> Span:
    """A started span (tracing must be on). `parent`: a span or context; None: the current one.
    `links`: spans (or contexts) of other traces this one relates to (a batch's other requests)."""
    from opentelemetry import trace

    assert _tracer is not None, "tracing is on"
    span_kind = {
        "internal": trace.SpanKind.INTERNAL,
        "server": trace.SpanKind.SERVER,
        "client": trace.SpanKind.CLIENT,
    }[kind]
    return _tracer.start_span(
        name,
        context=_as_context(parent),
        kind=span_kind,
        attributes=dict(attributes or {}),
        links=[trace.Link(_span_of(link).get_span_context()) for link in links],
        start_time=start_ns,
        record_exception=False,
        set_status_on_exception=False,
    )


def end_span(span: Span, error: str | None = None, end_ns: int | None = None) -> None:
    """End `span`; with `error` (`CODE: what happened`), as failed for that reason."""
    if error is not None:
        fail(span, error)
    span.end(end_time=end_ns)


def fail(span: Span, error: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, error))
    span.set_attribute("error.type", error.split(":", 1)[0])


def describe(exc: BaseException) -> str:
    """What a span that ended with `exc` says: the status the caller gets and why."""
    if isinstance(exc, errors.StagemeshError):
        return f"{errors.status_name(exc)}: {exc}"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED: the caller went away or its deadline passed"
    return f"INTERNAL: {type(exc).__name__}"


class SpanScope:
    """`with span(...) as s:` where `s` is the span, or None when tracing is off. Not made
    current (see the module's docstring): children name it as their parent."""

    def __init__(self, name: str, kwargs: dict[str, Any]):
        self.span = start_span(name, **kwargs)

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, kind, exc, traceback) -> None:
        end_span(self.span, describe(exc) if exc is not None else None)


class _Off:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> None:
        return None


_OFF = _Off()


def span(name: str, **kwargs: Any) -> SpanScope | _Off:
    """A span around a block (start_span's arguments); nothing at all while tracing is off."""
    return SpanScope(name, kwargs) if ON else _OFF


def current_context() -> Context:
    from opentelemetry import context

    return context.get_current()


def annotate_current(**attributes: Any) -> None:
    """Attributes on the current span (the call's server span), `stagemesh.` prefixed."""
    if ON:
        from opentelemetry import trace

        current = trace.get_current_span()
        for key, value in attributes.items():
            current.set_attribute(f"stagemesh.{key}", value)


def fail_current(error: str) -> None:
    """Mark the current span (the call's server span) as failed, saying why."""
    if ON:
        from opentelemetry import trace

        current = trace.get_current_span()
        if current.is_recording():
            fail(current, error)


def _as_context(parent: Context | Span | None) -> Context | None:
    from opentelemetry import trace

    if parent is None or isinstance(parent, dict):  # a Context is a dict
        return parent
    return trace.set_span_in_context(parent)


def _span_of(item: Context | Span) -> Span:
    from opentelemetry import trace

    return trace.get_current_span(item) if isinstance(item, dict) else item


# propagation ----------------------------------------------------------------------------------
def outgoing(parent: Context | Span | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata (or headers) carrying `parent`'s trace context (`traceparent`, `tracestate`) to
    the callee; the current context when None; () while tracing is off."""
    if not ON:
        return ()
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=_as_context(parent))  # OTEL_PROPAGATORS: W3C by default
    return tuple(carrier.items())


def incoming(pairs: Iterable[tuple[Any, Any]]) -> Context:
    """The caller's trace context from its metadata or (ASGI, bytes) headers; empty if none."""
    from opentelemetry import propagate

    carrier = {_text(k).lower(): _text(v) for k, v in pairs}
    return propagate.extract(carrier)


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def continues_a_trace(context: Context) -> bool:
    from opentelemetry import trace

    return trace.get_current_span(context).get_span_context().is_valid


def log_fields(span: Span) -> dict[str, str]:
    ids = span.get_span_context()
    return {"trace_id": format(ids.trace_id, "032x"), "span_id": format(ids.span_id, "016x")}


class ServerSpan:
    """The span of one call a service answers, current (and its ids bound to the log lines)
    from `enter` until `leave`, on the task that handles the call."""

    def __init__(self, name: str, parent: Context, attributes: Mapping[str, Any]):
        self.span = start_span(name, kind="server", parent=parent, attributes=attributes)
        self._ended = False
        self._tokens: Any = None

    def rename(self, name: str) -> None:
        self.span.update_name(name)

    def enter(self) -> None:
        from opentelemetry import context, trace

        self._tokens = (
            context.attach(trace.set_span_in_context(self.span)),
            structlog.contextvars.bind_contextvars(**log_fields(self.span)),
        )

    def leave(self) -> None:
        from opentelemetry import context

        attached, bound = self._tokens
        structlog.contextvars.reset_contextvars(**bound)
        context.detach(attached)

    def end(self, error: str | None = None, **attributes: Any) -> None:
        if self._ended:
            return
        self._ended = True
        self.span.set_attributes(attributes)
        noted = getattr(self.span, "status", None)  # the SDK's spans have one
        if error is not None and (noted is None or noted.is_ok):  # a reason noted on the way wins
            fail(self.span, error)
        self.span.end()


# gRPC servers ---------------------------------------------------------------------------------
def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [TracingInterceptor()] if ON else []


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A server span per call of the service's own methods. First in the server's list, so that it
    also sees the calls later interceptors refuse (UNAUTHENTICATED)."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method.lstrip("/")
        if handler is None or not method.startswith(TRACED_PREFIX) or not ON:
            return handler
        parent = incoming(details.invocation_metadata or ())
        if method in POLLED_METHODS and not continues_a_trace(parent):
            return handler
        service, _, name = method.partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrapped = _traced(behavior, method, parent, attributes)
                # gRPC's handlers are namedtuples; the stub declares an abstract class without _replace.
                return handler._replace(**{kind: wrapped}) if wrapped is not None else handler  # type: ignore[attr-defined]
        return handler


def _ending(call: ServerSpan, outcome: dict[str, grpc.StatusCode]) -> Callable[[grpc.aio.ServicerContext], None]:
    """The call's done callback: gRPC runs it once the call is over, whatever ended it."""

    def done(context: grpc.aio.ServicerContext) -> None:
        code = final_code(context.code(), outcome.get("ended"), context.time_remaining())
        details = context.details()
        if isinstance(details, bytes):
            details = details.decode("utf-8", "replace")
        error = None
        if code != grpc.StatusCode.OK:
            error = f"{code.name}: {details}" if details else describe_code(code)
        call.end(error, **{"rpc.grpc.status_code": code.value[0]})

    return done


def describe_code(code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.CANCELLED:
        return "CANCELLED: the caller went away"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "DEADLINE_EXCEEDED: the call's deadline passed"
    return code.name


def _traced(behavior: Callable, method: str, parent: Context, attributes: Mapping[str, Any]) -> Callable | None:
    def begin(context: grpc.aio.ServicerContext, outcome: dict) -> ServerSpan:
        call = ServerSpan(method, parent, attributes)
        # The stub declares the callback as a class rather than a callable protocol.
        context.add_done_callback(_ending(call, outcome))  # type: ignore[arg-type]
        call.enter()
        return call

    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            outcome: dict[str, grpc.StatusCode] = {}
            call = begin(context, outcome)
            try:
                async for item in behavior(request, context):
                    yield item
            except Exception:
                outcome["ended"] = grpc.StatusCode.UNKNOWN  # an abort() has set its code, which wins
                raise
            finally:
                call.leave()
            outcome["ended"] = grpc.StatusCode.OK

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def unary(request, context):
            outcome: dict[str, grpc.StatusCode] = {}
            call = begin(context, outcome)
            try:
                reply = await behavior(request, context)
            except Exception:
                outcome["ended"] = grpc.StatusCode.UNKNOWN
                raise
            finally:
                call.leave()
            outcome["ended"] = grpc.StatusCode.OK
            return reply

        return unary
    return None  # a synchronous handler (none of ours): left as it is


# HTTP servers ---------------------------------------------------------------------------------
def http_server_span(method: str, path: str, headers: Sequence[tuple[bytes, bytes]], polled: bool) -> ServerSpan | None:
    """The span of one HTTP request (None when tracing is off, or for a `polled` path whose caller
    sent no trace context), continuing the caller's `traceparent`."""
    if not ON:
        return None
    parent = incoming(headers)
    if polled and not continues_a_trace(parent):
        return None
    attributes = {"http.request.method": method, "url.path": path}
    # Named by its route once routed (a path no route matches must not become a span name).
    return ServerSpan(method, parent, attributes)

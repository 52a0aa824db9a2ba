"""The ASGI layer around the routes: the request id (x-request-id in, and back on the response),
the request's server span when tracing is on (continuing the caller's `traceparent`), the bound
on request bodies (413 past the gateway's --max-request-bytes), one log line per request, and a
last-resort 500 in OpenAI's error shape instead of a traceback."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagemesh.core import errors, logs, tracing
from stagemesh.core.params import check_request_id
from stagemesh.gateway.http.errors import REQUEST_TOO_LARGE, error_body, error_response, internal, invalid

log = logs.get_logger("stagemesh.gateway.http")

_REQUEST_ID = logs.REQUEST_ID_HEADER.encode()
# Asked every few seconds by probes: traced only when the caller's trace continues in it.
_POLLED_PATHS = frozenset({"/health"})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestContext:
    def __init__(self, app: ASGIApp, max_request_bytes: int):
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, _REQUEST_ID)
        refusal = None
        try:
            if given is not None:
                check_request_id(given)
        except errors.InvalidArgument as exc:
            refusal, given = error_response(*invalid(exc.violations)), None
        request_id = given or logs.new_request_id()
        outcome: dict[str, Any] = {"status": None}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (_REQUEST_ID, request_id.encode())]
                outcome["status"] = message["status"]
            await send(message)

        started = time.perf_counter()
        traced = None
        if tracing.ON:
            polled = scope["path"] in _POLLED_PATHS
            traced = tracing.http_server_span(scope["method"], scope["path"], scope.get("headers", ()), polled)
        with logs.bound_request(request_id):
            if traced is not None:
                traced.enter()
                tracing.annotate_current(request_id=request_id)
            try:
                if refusal is not None:
                    await refusal(scope, receive, send_with_id)
                else:
                    await self._bounded(scope, receive, send_with_id)
            except Exception:
                log.exception("http request failed", method=scope["method"], path=scope["path"])
                if outcome["status"] is None:
                    answer = error_response(*internal(f"{scope['method']} {scope['path']}"))
                    await answer(scope, receive, send_with_id)
            finally:
                log.info(
                    "http done",
                    method=scope["method"],
                    path=scope["path"],
                    status=outcome["status"] or "client gone",
                    ms=round((time.perf_counter() - started) * 1e3, 2),
                )
                if traced is not None:
                    traced.leave()
                    _end_span(traced, scope, outcome["status"])

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body (at most max_request_bytes), then hand it to the app; what the app
        receives after it comes from the connection (http.disconnect when the client goes)."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before the request was complete: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over the gateway's max_request_bytes ({self.max_request_bytes} bytes)"
        response = error_response(REQUEST_TOO_LARGE, error_body(REQUEST_TOO_LARGE, message, None, "request_too_large"))
        await response(scope, receive, send)


def _end_span(traced: tracing.ServerSpan, scope: Scope, status: int | None) -> None:
    """Named by the route that answered (`POST /v1/images/generations`), failed for a status of
    400 or more; an error response has already said why (http/errors.py)."""
    route = getattr(scope.get("route"), "path", None)
    if route is not None:
        traced.rename(f"{scope['method']} {route}")
    attributes: dict[str, Any] = {"http.route": route} if route is not None else {}
    if status is None:
        traced.end("CANCELLED: the client went away", **attributes)
        return
    attributes["http.response.status_code"] = status
    traced.end(f"HTTP {status}" if status >= 400 else None, **attributes)

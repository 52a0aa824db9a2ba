"""The gateway's HTTP port: uvicorn serving the HTTP app on the gateway's own event loop, beside
the grpc.aio server, so both call the same Pipeline and ControlPlane objects."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from stagemesh.core import errors, logs, rpc

log = logs.get_logger("stagemesh.gateway.http")

BACKLOG = 2048
# uvicorn's own bound on the stop, a backstop past ours: by then every generation has been ended.
UVICORN_EXTRA_GRACE_S = 5


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway's stop (serve.run) owns SIGTERM and
    SIGINT and stops this server with the gRPC one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """Bound and listening before the ready file is written, so its address is live when read."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
        # they are TCP, and accepted sockets inherit it from this one. With Nagle on, uvicorn's
        # two writes of a response (head, body) waited for the client's delayed ACK: +40 ms.
        sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    except OSError as exc:
        raise errors.Unavailable(f"cannot bind --http-port {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise errors.Unavailable(f"cannot bind --http-port {host}:{port}: {exc}") from None
    sock.setblocking(False)
    return sock


class HttpListener:
    def __init__(
        self, app: FastAPI, host: str, port: int, *, tls_cert: str | None, tls_key: str | None, grace_s: float
    ):
        self._stopping: asyncio.Event = app.state.stopping
        self._video_jobs = getattr(app.state, "video_jobs", None)
        self._grace_s = grace_s
        self._socket = _bind(host, port)
        bound = self._socket.getsockname()[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.scheme = "https" if tls_cert else "http"
        config = uvicorn.Config(
            app,
            lifespan="off",
            ws="none",
            log_config=None,  # the gateway's structlog lines say what happened; uvicorn's own stay quiet
            log_level="warning",
            access_log=False,
            server_header=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            # As gRPC's bound on calls in handling: past it, 503 at once rather than a queue.
            limit_concurrency=rpc.MAX_CONCURRENT_RPCS,
            timeout_graceful_shutdown=int(grace_s) + UVICORN_EXTRA_GRACE_S,
            proxy_headers=False,  # nothing here reads the client's address or scheme
        )
        try:
            config.load()  # now: a key uvicorn cannot use refuses the start instead of the HTTP port alone
        except BaseException:
            self._socket.close()
            raise
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        self._task.add_done_callback(self._ended)
        log.info("http listening", address=self.address, url=f"{self.scheme}://{self.address}/v1")

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("http server failed", reason=str(task.exception()))

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish within the grace, then end the rest: each
        is answered 503 (a stream gets a last error event) and its stages' work is cancelled."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        done, _ = await asyncio.wait({self._task}, timeout=self._grace_s)
        if not done:
            log.info("http requests still running after the grace; ending them")
            self._stopping.set()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._video_jobs is not None:  # jobs still running are cancelled with their stage calls
            await self._video_jobs.close()

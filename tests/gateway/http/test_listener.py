"""The HTTP listener on its own: what it binds, and how its connections are set up."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fastapi import FastAPI

from stagemesh.core import errors
from stagemesh.gateway.http.listener import HttpListener


def _app() -> FastAPI:
    app = FastAPI()
    app.state.stopping = asyncio.Event()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    return app


def test_connections_have_nagle_off_so_a_response_s_two_writes_are_not_held_back():
    async def run() -> list[int]:
        listener = HttpListener(_app(), "127.0.0.1", 0, tls_cert=None, tls_key=None, grace_s=1)
        listener.start()
        try:
            host, port = listener.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            connections = list(listener._server.server_state.connections)
            flags = [
                c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for c in connections
            ]
            writer.close()
            return flags
        finally:
            await listener.stop()

    flags = asyncio.run(run())
    assert flags and all(flags), flags


def test_a_port_taken_is_refused_naming_the_option():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.Unavailable, match=f"--http-port 127.0.0.1:{port}"):
            HttpListener(_app(), "127.0.0.1", port, tls_cert=None, tls_key=None, grace_s=1)


def test_a_listener_never_started_stops_and_frees_its_port():
    listener = HttpListener(_app(), "127.0.0.1", 0, tls_cert=None, tls_key=None, grace_s=1)
    port = int(listener.address.rsplit(":", 1)[1])
    asyncio.run(listener.stop())
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # free again

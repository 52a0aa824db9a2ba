"""HTTP/2 clients that open a gRPC call and then never grant flow-control window: they answer the
server's SETTINGS and PINGs (so the connection stays healthy) but send no WINDOW_UPDATE, so the
server can send them 64 KiB and no more. Written on raw sockets: no HTTP/2 library is needed."""

from __future__ import annotations

import asyncio
import struct
import threading
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
STREAM_ID = 1


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (lengths under 127)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


@dataclass
class StalledCall:
    data_bytes: int = 0  # DATA payload the server managed to send
    reset: bool = False  # the server reset the stream (RST_STREAM) or the connection (GOAWAY)
    ended: bool = False  # trailers (HEADERS with END_STREAM) arrived


async def _stall(host: str, port: int, path: str, message: bytes, call: StalledCall, stop: asyncio.Event) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    headers = b"".join(
        _literal(k, v)
        for k, v in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{host}:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    body = b"\x00" + struct.pack(">I", len(message)) + message
    writer.write(PREFACE + _frame(SETTINGS, 0, 0))
    writer.write(_frame(HEADERS, END_HEADERS, STREAM_ID, headers) + _frame(DATA, END_STREAM, STREAM_ID, body))
    await writer.drain()
    reading = asyncio.ensure_future(_answer_frames(reader, writer, call))
    await stop.wait()
    reading.cancel()
    writer.close()


async def _answer_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, call: StalledCall) -> None:
    while True:
        head = await reader.readexactly(9)
        length = int.from_bytes(head[:3], "big")
        kind, flags = head[3], head[4]
        payload = await reader.readexactly(length)
        if kind == SETTINGS and not flags & ACK:
            writer.write(_frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            writer.write(_frame(PING, ACK, 0, payload))
        elif kind == DATA:
            call.data_bytes += length
        elif kind in (RST_STREAM, GOAWAY):
            call.reset = True
        elif kind == HEADERS and flags & END_STREAM:
            call.ended = True
        await writer.drain()


class StalledClients:
    """`count` connections, one stalled call each, held open on a thread of their own until close()."""

    def __init__(self, address: str, path: str, message: bytes, count: int):
        host, port = address.rsplit(":", 1)
        self.calls = [StalledCall() for _ in range(count)]
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()

        async def hold_all() -> None:
            await asyncio.gather(*(_stall(host, int(port), path, message, c, self._stop) for c in self.calls))

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(hold_all(),), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

"""A DNS server for tests: answers A and AAAA queries over UDP from a table the test controls, so a
`dns://127.0.0.1:PORT/name:port` target resolves to addresses of the test's choosing without
/etc/hosts or a real resolver. gRPC's resolver (c-ares) and the gateway's control calls both ask it.

Authoritative for the names in its table; NXDOMAIN for any other; an empty answer for a type a
name has no address of. TTL 0, so no cache holds an answer past the table changing.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from collections import Counter

_A, _AAAA = 1, 28
_RESPONSE_AUTHORITATIVE = 0x8400
_RECURSION_DESIRED = 0x0100
_NXDOMAIN, _FORMERR = 3, 1


class DnsStub:
    def __init__(self, records: dict[str, list[str]], host: str = "127.0.0.1"):
        self._records = {name.lower().rstrip("."): list(addresses) for name, addresses in records.items()}
        self._lock = threading.Lock()
        self.queries: Counter[tuple[str, int]] = Counter()  # (name, qtype) -> how many were asked
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.1)  # a recvfrom blocked in the thread does not notice close(): poll
        self._closed = threading.Event()
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="dns-stub", daemon=True)
        self._thread.start()

    def target(self, name: str, port: int) -> str:
        """The gRPC target that resolves `name` here."""
        return f"dns://{self.address}/{name}:{port}"

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self._records[name.lower().rstrip(".")] = list(addresses)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> DnsStub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                message, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            reply = self._answer(message)
            if reply is not None:
                self._sock.sendto(reply, peer)

    def _answer(self, message: bytes) -> bytes | None:
        try:
            qid, flags, questions = struct.unpack(">HHH", message[:6])
            labels, offset = [], 12
            while message[offset]:
                length = message[offset]
                labels.append(message[offset + 1 : offset + 1 + length].decode("ascii"))
                offset += 1 + length
            qtype, _qclass = struct.unpack(">HH", message[offset + 1 : offset + 5])
        except (struct.error, IndexError, UnicodeDecodeError):
            return None  # not a query we can read: let the client time out
        question = message[12 : offset + 5]
        name = ".".join(labels).lower()
        self.queries[name, qtype] += 1
        with self._lock:
            addresses = self._records.get(name)
        head = _RESPONSE_AUTHORITATIVE | (flags & _RECURSION_DESIRED)
        if questions != 1:
            return struct.pack(">HHHHHH", qid, head | _FORMERR, 0, 0, 0, 0)
        if addresses is None:
            return struct.pack(">HHHHHH", qid, head | _NXDOMAIN, 1, 0, 0, 0) + question
        answers = [self._record(a, qtype) for a in addresses]
        records = [r for r in answers if r is not None]
        return struct.pack(">HHHHHH", qid, head, 1, len(records), 0, 0) + question + b"".join(records)

    @staticmethod
    def _record(address: str, qtype: int) -> bytes | None:
        ip = ipaddress.ip_address(address)
        if (qtype, ip.version) not in ((_A, 4), (_AAAA, 6)):
            return None
        # the name as a pointer to the question's (offset 12), class IN, TTL 0
        return struct.pack(">HHHIH", 0xC00C, qtype, 1, 0, len(ip.packed)) + ip.packed

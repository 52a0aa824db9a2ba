"""Asking one DNS server for the addresses of a name: the A and AAAA records of a
`dns://SERVER/name:port` stage target.

gRPC's own resolver sends the data plane's queries to SERVER; the gateway's control calls (which
reach every replica) must ask the same server, or they would see other replicas than the data
plane, or none where only SERVER knows the name. Plain UDP with an EDNS0 buffer, as a stub
resolver asks a recursive one: no TCP fallback, so an answer too large for one datagram (some
seventy addresses) is an error that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import socket
import struct

QUERY_TIMEOUT_S = 2.0
ATTEMPTS = 2  # UDP may lose a datagram: ask again once before giving up
UDP_PAYLOAD_BYTES = 1232  # the EDNS0 size DNS operators agree on (no IP fragmentation)
DEFAULT_PORT = 53

_A, _AAAA, _OPT, _IN = 1, 28, 41, 1
_RESPONSE, _TRUNCATED, _RECURSION_DESIRED = 0x8000, 0x0200, 0x0100
_NXDOMAIN = 3
_FAMILY = {_A: (socket.AF_INET, 4), _AAAA: (socket.AF_INET6, 16)}


class DnsError(OSError):
    """The name could not be resolved (an OSError, as the system resolver's failures are)."""


def server_address(authority: str) -> tuple[str, int]:
    """(ip, port) of a target's authority, `IP[:PORT]` or `[IPv6][:PORT]`, as gRPC accepts it;
    ValueError for anything else (a host name cannot name the server that resolves names)."""
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port = rest.removeprefix(":")
    elif authority.count(":") == 1:
        host, port = authority.split(":")
    else:
        host, port = authority, ""
    ipaddress.ip_address(host)  # ValueError unless an IP address
    number = int(port) if port else DEFAULT_PORT
    if not 0 < number < 65536:
        raise ValueError(f"port {number} is out of range")
    return host, number


def query(qid: int, name: str, qtype: int) -> bytes:
    labels = [label.encode("idna") for label in name.rstrip(".").split(".")]
    if not name or any(not 0 < len(label) < 64 for label in labels):
        raise DnsError(f"{name!r} is not a DNS name")
    header = struct.pack(">HHHHHH", qid, _RECURSION_DESIRED, 1, 0, 0, 1)
    question = b"".join(bytes([len(label)]) + label for label in labels) + b"\0" + struct.pack(">HH", qtype, _IN)
    edns = b"\0" + struct.pack(">HHIH", _OPT, UDP_PAYLOAD_BYTES, 0, 0)
    return header + question + edns


def _skip_name(message: bytes, offset: int) -> int:
    while True:
        length = message[offset]
        if length >= 0xC0:  # a compression pointer ends the name
            return offset + 2
        if length == 0:
            return offset + 1
        offset += 1 + length


def addresses(message: bytes, qid: int, qtype: int, name: str) -> list[str]:
    """The addresses of type `qtype` in the answer to query `qid` (CNAME records are skipped: a
    recursive server puts the records of the name they lead to in the same answer)."""
    try:
        rid, flags, questions, answers = struct.unpack(">HHHH", message[:8])
        if rid != qid or not flags & _RESPONSE:
            raise DnsError(f"{name}: the DNS server's answer is not to the query sent")
        if flags & _TRUNCATED:
            raise DnsError(f"{name}: the DNS server's answer does not fit one datagram (too many addresses)")
        rcode = flags & 0xF
        if rcode == _NXDOMAIN:
            raise DnsError(f"{name}: no such name (NXDOMAIN)")
        if rcode:
            raise DnsError(f"{name}: the DNS server answered with error code {rcode}")
        offset = 12
        for _ in range(questions):
            offset = _skip_name(message, offset) + 4
        found = []
        family, size = _FAMILY[qtype]
        for _ in range(answers):
            offset = _skip_name(message, offset)
            rtype, _rclass, _ttl, length = struct.unpack(">HHIH", message[offset : offset + 10])
            data = message[offset + 10 : offset + 10 + length]
            offset += 10 + length
            if rtype == qtype and len(data) == size:
                found.append(socket.inet_ntop(family, data))
        return found
    except (struct.error, IndexError):
        raise DnsError(f"{name}: the DNS server's answer is malformed") from None


async def _ask(server: tuple[str, int], name: str, qtype: int) -> list[str]:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.connect(server)  # the kernel then drops datagrams from anyone else
        for _ in range(ATTEMPTS):
            qid = secrets.randbits(16)
            await loop.sock_sendall(sock, query(qid, name, qtype))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(QUERY_TIMEOUT_S):
                    while True:  # a late answer to an earlier attempt is not this one's
                        reply = await loop.sock_recv(sock, 65535)
                        if reply[:2] == qid.to_bytes(2, "big"):
                            return addresses(reply, qid, qtype, name)
    raise DnsError(f"{name}: no answer from the DNS server {server[0]}:{server[1]}")


async def lookup(name: str, server: tuple[str, int]) -> list[str]:
    """Every IPv4 then IPv6 address `server` gives for `name`; DnsError when it gives none."""
    results = await asyncio.gather(_ask(server, name, _A), _ask(server, name, _AAAA), return_exceptions=True)
    found = [address for result in results if isinstance(result, list) for address in result]
    if found:  # one family is enough: a server may refuse AAAA queries it cannot answer
        return found
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if isinstance(failure, ConnectionRefusedError):  # ICMP port unreachable: nothing listens there
        raise DnsError(f"{name}: nothing answers DNS at {server[0]}:{server[1]}")
    if failure is not None:
        raise failure  # a DnsError naming the cause, or a bug
    raise DnsError(f"{name}: the DNS server {server[0]}:{server[1]} has no address for it")

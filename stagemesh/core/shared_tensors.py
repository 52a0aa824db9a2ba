"""Tensor bytes handed between the processes of one mesh on one host through /dev/shm, instead of
inside a gRPC message (stagemesh.v1.Tensor.shm_name).

A stage whose caller shares its host writes each large output into a fresh segment and sends its
name; the gateway passes that name on to the next stage (or reads the segment itself, for the
last stage's picture), and whoever reads a segment unlinks it. On the H200 an encoder's prompt
embeddings (8 MB for FLUX.2 [klein]) took about 75 ms through two gRPC hops and their protobuf
copies; through a segment, one copy in and one mapping out (docs/perf-notes/mesh-overhead.md).

Names are `stagemesh-<writer pid>-relay-<128 random bits>`: unguessable, and of the shape the
stage's sweeps of a dead process's segments already match (stage_service/transport/ipc.py). A
reader takes only names of that shape, owned by its own uid and exactly as large as the tensor's
dtype and shape say. Torch-free: the gateway reads segments too.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from stagemesh.core import logs
from stagemesh.core.errors import InvalidArgument
from stagemesh.v1 import tensor_pb2

SHM_DIR = Path("/dev/shm")
# Smaller outputs stay inside the message: a segment costs a file and a mapping.
MIN_BYTES_ENV = "STAGEMESH_SHM_MIN_BYTES"
DEFAULT_MIN_BYTES = 1 << 20
_warned: set[str] = set()
log = logs.get_logger("stagemesh.shared_tensors")
_NAME = re.compile(r"stagemesh-[0-9]+-relay-[0-9a-f]{32}")


def min_bytes() -> int:
    """Outputs of at least this many bytes go through a segment: $STAGEMESH_SHM_MIN_BYTES (a whole
    number >= 0, read at each use), else DEFAULT_MIN_BYTES; a bad value warns once and is ignored."""
    raw = os.environ.get(MIN_BYTES_ENV)
    if raw is None:
        return DEFAULT_MIN_BYTES
    if raw.strip().isdigit():
        return int(raw)
    if raw not in _warned:
        _warned.add(raw)
        log.warning("invalid shared-memory bound; using the default", variable=MIN_BYTES_ENV, value=raw)
    return DEFAULT_MIN_BYTES


def local_peer(peer: str) -> bool:
    """Whether a gRPC peer (`context.peer()`) is on this host: a loopback address or a Unix socket.
    A stage writes segments only for such a caller; one on another host could never read them."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host == "::1" or host.startswith("::ffff:127.")
    return False


def relay_name(owner_pid: int) -> str:
    return f"stagemesh-{owner_pid}-relay-{secrets.token_hex(16)}"


def export(data: memoryview, owner_pid: int) -> str:
    """A new segment (mode 0600) holding `data`'s bytes; its name."""
    name = relay_name(owner_pid)
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        # write(2), not a mapping: the kernel fills the new pages without a fault for each 4 KiB.
        rest = data.cast("B")
        while rest:
            rest = rest[os.write(fd, rest) :]
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return name


def take(name: str, nbytes: int, field: str = "tensor") -> memoryview:
    """The segment's bytes as a private, writable mapping (no copy), its name unlinked at once.
    INVALID_ARGUMENT naming `field` for a name that is not a relay segment of ours or that holds
    other than `nbytes` bytes."""
    if not _NAME.fullmatch(name):
        raise InvalidArgument.field(f"{field}.shm_name", f"{name!r} is not a stagemesh relay segment")
    path = SHM_DIR / name
    try:
        # Non-blocking: a FIFO under a relay's name must not stall the reader (it is then refused).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidArgument.field(
            f"{field}.shm_name", f"no segment {name!r} on this host (already read, or written on another host)"
        ) from None
    except OSError as exc:  # a link, a name we may not open
        raise InvalidArgument.field(f"{field}.shm_name", f"{name!r} cannot be read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise InvalidArgument.field(f"{field}.shm_name", f"{name!r} is not a segment of this user")
        if info.st_size != nbytes:
            raise InvalidArgument.field(
                f"{field}.shm_name", f"{name!r} holds {info.st_size} bytes; dtype and shape need {nbytes}"
            )
        path.unlink(missing_ok=True)
        if nbytes == 0:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)


def discard(messages: Iterable[tensor_pb2.Tensor]) -> None:
    """Unlink the segments of these messages that nobody read (a request that failed or was
    cancelled between two stages); those already read are gone, which is fine."""
    unlink(m.shm_name for m in messages if m.shm_name)


def unlink(names: Iterable[str]) -> None:
    """Unlink relay segments by name (gone already is fine; other names are left alone)."""
    for name in names:
        if _NAME.fullmatch(name):
            (SHM_DIR / name).unlink(missing_ok=True)

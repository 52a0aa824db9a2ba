"""Process helpers: supervised children must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable

_PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "STAGEMESH_PARENT_PID"


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Have Linux send `sig` to this process when its supervisor dies.

    The supervisor is `parent_pid`, or the pid in $STAGEMESH_PARENT_PID; with neither (a
    service started by hand) nothing is done, so a standalone service keeps its own lifetime.
    """
    if parent_pid is None:
        raw = os.environ.get(PARENT_PID_ENV)
        if not raw:
            return
        parent_pid = int(raw)
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    # The parent may have died before prctl took effect.
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], interval_s: float = 0.5) -> None:
    """Call `on_orphaned` (in a daemon thread) once `parent_pid` is no longer our parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        on_orphaned()

    if os.getppid() != parent_pid:
        on_orphaned()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_env(extra: dict[str, str] | None = None, unset: Iterable[str] = ()) -> dict[str, str]:
    """Environment for a supervised child: ours without `unset`, plus the marker that ties it to us."""
    env = dict(os.environ)
    for name in unset:
        env.pop(name, None)
    env[PARENT_PID_ENV] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def free_port() -> int:
    """A loopback port free at the time of asking (for a rendezvous that rank 0 will bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

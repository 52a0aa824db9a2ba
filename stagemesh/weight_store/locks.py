"""The runtime cache's file-lock protocol (flock(2) on files under `root/locks/`).

- `root/locks/<key>.lock`: publication lock. LOCK_EX while somebody checks, rebuilds or
  publishes the entry of `key`. The cache service holds it for a PublishSession stream; without
  the service a stage takes the very same lock itself, so both paths exclude each other.
- `root/locks/<key>.consumers`: consumer lock. Every process that maps the entry holds LOCK_SH
  for as long as it maps it; eviction takes LOCK_EX|LOCK_NB and skips the entry if that fails.
  It lies outside the entry directory so renaming or removing the entry never touches a lock.

flock locks belong to the open file description and vanish when the last descriptor closes, so a
dead process (SIGKILL included) releases what it held. Files are opened O_NOFOLLOW|O_CLOEXEC,
mode 0600; lock files are never unlinked (unlinking a lock file races with its next opener).
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from pathlib import Path

from stagemesh.core import errors

LOCK_DIR = "locks"
PUBLISH_SUFFIX = ".lock"
CONSUMER_SUFFIX = ".consumers"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.05


def is_valid_key(key: str) -> bool:
    return isinstance(key, str) and bool(_KEY_RE.fullmatch(key))


def require_key(key: str, field: str = "key") -> str:
    """The key itself, or InvalidArgument naming `field`: only 64 lowercase hex chars, so a key
    can never name a path outside the root."""
    if not is_valid_key(key):
        raise errors.InvalidArgument.field(field, "must be a layout key: exactly 64 lowercase hex characters")
    return key


def lock_path(root: Path, key: str, suffix: str) -> Path:
    return Path(root) / LOCK_DIR / f"{require_key(key)}{suffix}"


def open_lock_file(path: Path) -> int:
    """A descriptor on the lock file, created 0600; a symlink in its place is refused."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


class FileLock:
    """One flock on one lock file. `release()` is idempotent; closing the fd drops the lock."""

    _fd: int | None  # None once released

    def __init__(self, path: Path, fd: int, shared: bool):
        self.path, self._fd, self.shared = path, fd, shared
        self._mu = threading.Lock()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        with self._mu:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def try_lock(path: Path, *, shared: bool = False) -> FileLock | None:
    """The lock at once, or None when another holder conflicts."""
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return FileLock(path, fd, shared)


def acquire(
    path: Path, timeout_s: float, *, shared: bool = False, cancelled: threading.Event | None = None
) -> FileLock | None:
    """The lock within `timeout_s`, else None (also when `cancelled` is set while waiting).

    flock has no timeout and a blocked flock cannot be interrupted from another thread, so this
    polls LOCK_NB with a short backoff; a waiter that gives up never ends up holding the lock.
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = _POLL_MIN_S
    while True:
        held = try_lock(path, shared=shared)
        if held is not None:
            return held
        remaining = deadline - time.monotonic()
        if remaining <= 0 or (cancelled is not None and cancelled.is_set()):
            return None
        if cancelled is not None:
            cancelled.wait(min(pause, remaining))
        else:
            time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL_MAX_S)


def publication_lock(
    root: Path, key: str, timeout_s: float, cancelled: threading.Event | None = None
) -> FileLock | None:
    return acquire(lock_path(root, key, PUBLISH_SUFFIX), timeout_s, cancelled=cancelled)


def consumer_lock(root: Path, key: str) -> FileLock | None:
    """Shared consumer lock; None only while an evictor holds it exclusively (entry going away)."""
    return try_lock(lock_path(root, key, CONSUMER_SUFFIX), shared=True)


def count_holders(path: Path) -> int:
    """How many open file descriptions hold a flock on `path`, read from /proc/locks.

    Lines look like `3: FLOCK  ADVISORY  READ 1234 fd:01:5678 0 EOF` (device major:minor in
    hex, inode in decimal); waiters are marked `->` and not counted. Without /proc/locks, a
    non-blocking exclusive try says only whether there is at least one holder.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        probe = try_lock(path)
        if probe is None:
            return 1
        probe.release()
        return 0
    count = 0
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->" or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                count += 1
        except ValueError:
            continue
    return count


def live_consumers(root: Path, key: str) -> int:
    return count_holders(lock_path(root, key, CONSUMER_SUFFIX))

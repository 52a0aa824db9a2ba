"""The one gRPC piece of the runtime cache client: a PublishSession held open as a lock.

While a `PublishLease` lives, the cache service holds the key's publication lock for us; if this
process dies the stream breaks and the service releases it.
"""

from __future__ import annotations

import queue
import threading

import grpc

from stagemesh.core import auth, tls
from stagemesh.v1 import cache_pb2, cache_pb2_grpc


class ServiceUnreachable(Exception):
    """The cache service did not answer; callers fall back to the local flock protocol."""


class LeaseTimeout(Exception):
    """The service did not grant the lock within the lock timeout."""


class LeaseLost(Exception):
    """The session broke while we held the lock (the service died): someone else may hold it now."""


class PublishLease:
    """Open with `PublishLease.open(...)`; `release(published)` ends the session and returns
    once the service has ended it too (so the lock is free when it returns)."""

    def __init__(self, channel: grpc.Channel, key: str, lock_timeout_s: float):
        self._channel = channel
        self._outbox: queue.Queue = queue.Queue()
        self._outbox.put(cache_pb2.PublishSessionRequest(key=key, lock_timeout_seconds=lock_timeout_s))
        # A publication session is a cache mutation: it carries the token when one is configured.
        self._responses = cache_pb2_grpc.CacheServiceStub(channel).PublishSession(
            self._requests(), metadata=auth.bearer_metadata(auth.load_token(None))
        )
        self.existing_valid = False
        self._open = True
        self._ended = threading.Event()  # the response stream ended (the watcher saw it)
        self._broken = ""
        self._watching = False

    @classmethod
    def open(cls, address: str, key: str, lock_timeout_s: float, connect_timeout_s: float = 1.0) -> PublishLease:
        channel = tls.channel(address, tls.env_ca())  # the stage exports its --tls-ca for us
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise ServiceUnreachable(f"cache service {address} not reachable within {connect_timeout_s:g} s") from None
        lease = cls(channel, key, lock_timeout_s)
        try:
            first = next(lease._responses)
        except grpc.RpcError as exc:
            lease._close_channel()
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise LeaseTimeout(exc.details()) from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise ServiceUnreachable(exc.details()) from None
            raise
        except StopIteration:
            lease._close_channel()
            raise ServiceUnreachable("cache service ended the session without an answer") from None
        if not first.granted:
            lease.release(False)
            raise LeaseTimeout("cache service did not grant the lock")
        lease.existing_valid = first.existing_valid
        lease._watching = True
        threading.Thread(target=lease._watch, name="publish-lease-watch", daemon=True).start()
        return lease

    def _watch(self) -> None:
        """Read the stream while we hold the lock: it ends early only if the session broke."""
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as exc:
            self._broken = exc.details() or exc.code().name
        else:
            self._broken = "the cache service ended the session"
        self._ended.set()

    def check_held(self) -> None:
        """Raise LeaseLost unless the service still holds the lock for us."""
        if self._open and self._ended.is_set():
            raise LeaseLost(f"publication lock lost: {self._broken}")

    def _requests(self):
        while (message := self._outbox.get()) is not None:
            yield message

    def release(self, published: bool) -> None:
        if not self._open:
            return
        self._open = False
        self._outbox.put(cache_pb2.PublishSessionRequest(done=True, published=published))
        self._outbox.put(None)
        if self._watching:
            self._ended.wait()  # the watcher sees the stream end once the service released the lock
        else:
            try:
                for _ in self._responses:
                    pass  # the stream ends when the service has released the lock
            except grpc.RpcError:
                pass  # service gone: its lock went with it
        self._close_channel()

    def _close_channel(self) -> None:
        self._outbox.put(None)
        self._channel.close()

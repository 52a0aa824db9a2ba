"""The one gRPC piece of the runtime cache client: a PublishSession held open as a lock.

While a `PublishLease` lives, the cache service holds the key's publication lock for us; if this
process dies the stream breaks and the service releases it.
"""

from __future__ import annotations

import queue

import grpc

from stagemesh.core import auth, tls
from stagemesh.v1 import cache_pb2, cache_pb2_grpc


class ServiceUnreachable(Exception):
    """The cache service did not answer; callers fall back to the local flock protocol."""


class LeaseTimeout(Exception):
    """The service did not grant the lock within the lock timeout."""


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
        return lease

    def _requests(self):
        while (message := self._outbox.get()) is not None:
            yield message

    def release(self, published: bool) -> None:
        if not self._open:
            return
        self._open = False
        self._outbox.put(cache_pb2.PublishSessionRequest(done=True, published=published))
        self._outbox.put(None)
        try:
            for _ in self._responses:
                pass  # the stream ends when the service has released the lock
        except grpc.RpcError:
            pass  # service gone: its lock went with it
        self._close_channel()

    def _close_channel(self) -> None:
        self._outbox.put(None)
        self._channel.close()

"""Where a client connects and how: address, TLS, credentials, deadline and retry policy, from the
client's arguments or the environment, and the gRPC channel they make."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import grpc

from stagemesh.core import auth, errors, rpc, tls
from stagemesh.v1 import gateway_pb2

ADDRESS_ENV = "STAGEMESH_ADDRESS"
TOKEN_FILE_ENV = "STAGEMESH_TOKEN_FILE"
API_KEY_ENV = "STAGEMESH_API_KEY"
DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 600.0
API_KEY_HEADER = "x-api-key"
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
# gRPC caps a retry policy's attempts at 5 (gRFC A6); more would be cut silently.
MAX_ATTEMPTS = 5
MIN_BACKOFF_S = 0.001  # gRPC refuses a service config whose backoff is 0
# gRPC keeps a request until the call commits, so that it can send it again; past this size it
# does not retry. Room for an init_image as large as the gateway accepts by default (4 MiB).
RETRY_BUFFER_BYTES = 4 * 1024 * 1024


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's own retry policy (the channel's service config), applied to every gateway method.

    A call that fails with one of `retryable_codes` before any response arrived is sent again, at
    most `max_attempts` times in all, after a backoff of `initial_backoff_s` growing by
    `backoff_multiplier` up to `max_backoff_s` (each ±20 %), or after the delay the server asks
    for (grpc-retry-pushback-ms, which the gateway sends with UNAVAILABLE). Every attempt counts
    against the call's one deadline.
    """

    max_attempts: int = MAX_ATTEMPTS
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("UNAVAILABLE",)

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"max_attempts = {self.max_attempts}: allowed 2 to {MAX_ATTEMPTS} (gRPC's cap)")
        for name in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= MIN_BACKOFF_S):
                raise ValueError(f"{name} = {value!r}: allowed {MIN_BACKOFF_S:g} seconds or more")
        if not (math.isfinite(self.backoff_multiplier) and self.backoff_multiplier > 0):
            raise ValueError(f"backoff_multiplier = {self.backoff_multiplier!r}: allowed above 0")
        known = {c.name for c in grpc.StatusCode} - {"OK"}
        unknown = [c for c in self.retryable_codes if c not in known]
        if unknown or not self.retryable_codes:
            raise ValueError(f"retryable_codes {unknown or '()'}: allowed one or more of {sorted(known)}")

    @classmethod
    def of(cls, retries: int | RetryPolicy) -> RetryPolicy | None:
        """`retries` as a policy: an int is the number of retries after the first attempt (0: none)."""
        if isinstance(retries, RetryPolicy):
            return retries
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries < MAX_ATTEMPTS:
            raise ValueError(f"retries = {retries!r}: allowed a RetryPolicy or 0 to {MAX_ATTEMPTS - 1}")
        return cls(max_attempts=retries + 1) if retries else None

    def service_config(self) -> dict[str, Any]:
        return {
            "methodConfig": [
                {
                    "name": [{"service": SERVICE_NAME}],
                    "retryPolicy": {
                        "maxAttempts": self.max_attempts,
                        "initialBackoff": _duration(self.initial_backoff_s),
                        "maxBackoff": _duration(self.max_backoff_s),
                        "backoffMultiplier": self.backoff_multiplier,
                        "retryableStatusCodes": list(self.retryable_codes),
                    },
                }
            ]
        }


@dataclass(frozen=True)
class Connection:
    """What a client resolved: an argument wins, else its environment variable, else the default."""

    address: str
    tls_ca: str | None
    token: str | None = field(repr=False)
    api_key: str | None = field(repr=False)
    timeout: float
    retry: RetryPolicy | None

    @classmethod
    def resolve(
        cls,
        address: str | None,
        tls_ca: str | os.PathLike[str] | None,
        token: str | None,
        api_key: str | None,
        timeout: float | None,
        retries: int | RetryPolicy,
    ) -> Connection:
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_S
        check_timeout(timeout)
        return cls(
            address=address or default_address(),
            tls_ca=os.fspath(tls_ca) if tls_ca else tls.env_ca(),
            token=_header_value(token, "token") if token else _env_token(),
            api_key=_header_value(api_key or os.environ.get(API_KEY_ENV) or None, "api_key"),
            timeout=timeout,
            retry=RetryPolicy.of(retries),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        options = rpc.channel_options()
        if self.retry is None:
            return [*options, ("grpc.enable_retries", 0)]
        return [
            *options,
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(self.retry.service_config())),
            ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
        ]

    def open(self, *, aio: bool) -> Any:
        """A grpc (aio=False) or grpc.aio channel; an unreadable CA bundle raises errors.InvalidArgument."""
        return tls.channel(self.address, self.tls_ca, self.channel_options(), aio=aio)

    def metadata(self, *, control: bool = False) -> tuple[tuple[str, str], ...]:
        """The API key on every call; the bearer token on control calls only (where the gateway checks it)."""
        key = ((API_KEY_HEADER, self.api_key),) if self.api_key else ()
        return (*key, *(auth.bearer_metadata(self.token) if control else ()))

    def deadline(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        check_timeout(timeout)
        return timeout


def _duration(seconds: float) -> str:
    """A protobuf JSON Duration ("0.2s"): decimal seconds, never an exponent."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def check_timeout(timeout: float) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (0 < timeout < math.inf):
        raise ValueError(f"timeout = {timeout!r}: allowed a number of seconds above 0")


def _env_token() -> str | None:
    """$STAGEMESH_TOKEN_FILE's content, else $STAGEMESH_TOKEN, else None (core.auth's rules)."""
    path = os.environ.get(TOKEN_FILE_ENV)
    return auth.load_token(path, f"${TOKEN_FILE_ENV}") if path else auth.load_token(None)


def _header_value(value: str | None, name: str) -> str | None:
    # gRPC metadata values must be printable ASCII; refused here rather than by the channel mid-call.
    if value is not None and not all(" " <= c <= "~" for c in value):
        raise errors.InvalidArgument.field(name, "printable ASCII on one line only (it is sent as gRPC metadata)")
    return value


DEFAULT_RETRY = RetryPolicy()

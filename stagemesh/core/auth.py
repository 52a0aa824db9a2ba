"""Bearer-token auth for control calls (Sleep, WakeUp, Pause, Resume, cache mutations), and the
gateway's optional API key for its data plane (Generate, GenerateUnary, ListStages, HTTP).

The token comes from a file (`--token-file`, `[security] token_file`) or $STAGEMESH_TOKEN, the
API key from a file (`--api-key-file`, `[gateway] api_key_file`), never from a flag carrying the
value: command lines are visible to every user through `ps`. When a secret is configured, a
server interceptor refuses the methods it protects without it (UNAUTHENTICATED); every other
method (health, reflection, and whatever no configured secret protects) stays open.
"""

from __future__ import annotations

import argparse
import hmac
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import grpc

from stagemesh.core import errors, logs, rpc

TOKEN_ENV = "STAGEMESH_TOKEN"
HEADER = "authorization"
SCHEME = "bearer"

log = logs.get_logger("stagemesh.core.auth")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help=f"file holding the bearer token that control calls must carry (default: ${TOKEN_ENV}; "
        "neither: control calls are open)",
    )


def load_token(token_file: str | None, option: str = "--token-file") -> str | None:
    """The configured token: the file's content if a file is named, else $STAGEMESH_TOKEN, else None."""
    if not token_file:
        return _valid(os.environ.get(TOKEN_ENV) or None, f"${TOKEN_ENV}")
    return read_secret_file(token_file, option, "token")


def load_api_key(api_key_file: str | None, option: str = "--api-key-file") -> str | None:
    """The data plane's API key: the file's content if a file is named, else None (no environment
    fallback: a variable left in a shell must not close a gateway's data plane by surprise)."""
    return read_secret_file(api_key_file, option, "API key") if api_key_file else None


def read_secret_file(secret_file: str, option: str, what: str) -> str:
    """One secret (`what`: "token", "API key") from a file: printable ASCII on one line."""
    path = Path(secret_file).expanduser()
    try:
        text = path.read_text(encoding="ascii")
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument.field(option, f"cannot read {what} file {path}: {exc}") from None
    secret = text.rstrip("\r\n")  # editors and `echo` add a trailing newline
    if not secret:
        raise errors.InvalidArgument.field(option, f"{what} file {path} is empty; put the {what} in it")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(f"{what} file is readable by group or others; chmod 600 it", path=str(path))
    _valid(secret, option, what)
    return secret


def _valid(secret: str | None, where: str, what: str = "token") -> str | None:
    # gRPC metadata and HTTP header values must be printable ASCII without line breaks.
    if secret is not None and not all(0x20 <= ord(c) < 0x7F for c in secret):
        raise errors.InvalidArgument.field(where, f"the {what} must be printable ASCII on one line")
    return secret


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata a client adds to a control call; empty without a token."""
    return ((HEADER, f"Bearer {token}"),) if token else ()


def check_bearer(metadata: Iterable[tuple[str, str | bytes]] | None, *tokens: str) -> None:
    """Raise Unauthenticated unless `metadata` carries `authorization: Bearer <t>` for one of `tokens`
    (keys compared in lower case, as gRPC metadata and ASGI headers both give them)."""
    values = [v for k, v in metadata or () if k == HEADER]
    if not values:
        raise errors.Unauthenticated("missing bearer token")
    value = values[0] if isinstance(values[0], str) else bytes(values[0]).decode("latin-1")
    scheme, _, presented = value.partition(" ")
    given = presented.strip().encode("latin-1", errors="replace")
    # compare_digest against every accepted secret, without stopping at the first match: the time
    # taken depends neither on how much of a secret matched nor on which one did.
    matches = [hmac.compare_digest(given, token.encode()) for token in tokens]
    if scheme.lower() != SCHEME or not any(matches):
        raise errors.Unauthenticated("invalid bearer token")


def control_methods(service_name: str, names: Iterable[str]) -> frozenset[str]:
    """Full gRPC method paths (`/package.Service/Method`) of a service's protected methods."""
    return frozenset(f"/{service_name}/{name}" for name in names)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses the `protected` methods unless they carry one of `tokens`."""

    def __init__(self, tokens: Iterable[str], protected: Iterable[str]):
        self._tokens = tuple(tokens)
        self._protected = frozenset(protected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._protected:
            return handler
        try:
            check_bearer(handler_call_details.invocation_metadata, *self._tokens)
        except errors.Unauthenticated as exc:
            log.warning("call refused", method=handler_call_details.method, reason=str(exc))
            return _refusal(handler, exc)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, exc: errors.StagemeshError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `exc`'s status."""
    code, message, trailing = rpc.status_for(exc)

    async def refuse(request_or_iterator, context):
        await context.abort(code, message, trailing_metadata=trailing)

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def interceptors(
    token: str | None, protected: Iterable[str], also_accepted: str | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a server installs: none when no token is configured. `also_accepted`: a
    second secret the protected methods take too (the control token on the data plane)."""
    if not token:
        return []
    return [BearerTokenInterceptor([token, *([also_accepted] if also_accepted else [])], protected)]

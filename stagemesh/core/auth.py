"""Bearer-token auth for control calls (Sleep, WakeUp, Pause, Resume), for every call to a stage
or a cache service (the gateway and the stages send the mesh's token on theirs), and the
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
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from stagemesh.core import errors, logs, rpc

TOKEN_ENV = "STAGEMESH_TOKEN"
HEADER = "authorization"
SCHEME = "bearer"
# Where stagemesh.Client sends its API key (on every call, beside the token on control calls).
API_KEY_HEADER = "x-api-key"


def token_file_help(protects: str) -> str:
    """The help of a service's --token-file; `protects`: the calls the token guards."""
    return (
        f"file holding the bearer token that {protects} must carry (default: ${TOKEN_ENV}; "
        f"neither: {protects} are open)"
    )


TOKEN_FILE_HELP = token_file_help("control calls")

log = logs.get_logger("stagemesh.core.auth")


def add_arguments(parser: argparse.ArgumentParser, protects: str = "control calls") -> None:
    """`protects`: the calls the token guards, as the flag's help names them."""
    parser.add_argument("--token-file", default=None, metavar="PATH", help=token_file_help(protects))


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


def _first(metadata: Iterable[tuple[str, str | bytes]], key: str) -> str | None:
    """The first value of `key` (keys in lower case, as gRPC metadata and ASGI headers give them)."""
    for k, v in metadata:
        if k == key:
            return v if isinstance(v, str) else bytes(v).decode("latin-1")
    return None


def _matches(presented: str, secrets: Iterable[str]) -> bool:
    given = presented.strip().encode("latin-1", errors="replace")
    # compare_digest against every accepted secret, without stopping at the first match: the time
    # taken depends neither on how much of a secret matched nor on which one did.
    return any([hmac.compare_digest(given, secret.encode()) for secret in secrets])


def check_bearer(metadata: Iterable[tuple[str, str | bytes]] | None, *tokens: str) -> None:
    """Raise Unauthenticated unless `metadata` carries `authorization: Bearer <t>` for one of `tokens`."""
    value = _first(metadata or (), HEADER)
    if value is None:
        raise errors.Unauthenticated("missing bearer token")
    scheme, _, presented = value.partition(" ")
    if scheme.lower() != SCHEME or not _matches(presented, tokens):
        raise errors.Unauthenticated("invalid bearer token")


def check_api_key(metadata: Iterable[tuple[str, str | bytes]] | None, api_key: str, token: str | None = None) -> None:
    """The data plane's check: `authorization: Bearer <key>` (as OpenAI clients send it) or
    `x-api-key: <key>` (as stagemesh.Client does); the control token is accepted as a bearer too."""
    pairs = list(metadata or ())
    header_key = _first(pairs, API_KEY_HEADER)
    if header_key is not None and _matches(header_key, [api_key]):
        return
    bearer = _first(pairs, HEADER)
    if bearer is None and header_key is None:
        raise errors.Unauthenticated("missing API key: send authorization: Bearer KEY (or x-api-key: KEY)")
    scheme, _, presented = (bearer or "").partition(" ")
    if scheme.lower() != SCHEME or not _matches(presented, [api_key, *([token] if token else [])]):
        raise errors.Unauthenticated("invalid API key")


def control_methods(service_name: str, names: Iterable[str]) -> frozenset[str]:
    """Full gRPC method paths (`/package.Service/Method`) of a service's protected methods."""
    return frozenset(f"/{service_name}/{name}" for name in names)


def every_method(service: ServiceDescriptor) -> frozenset[str]:
    """Full gRPC method paths of every method of `service` (health and reflection are other services)."""
    return control_methods(service.full_name, (method.name for method in service.methods))


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses the `protected` methods unless `check` passes their metadata."""

    def __init__(self, check: Callable[[Iterable[tuple[str, str | bytes]] | None], None], protected: Iterable[str]):
        self._check = check
        self._protected = frozenset(protected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._protected:
            return handler
        try:
            self._check(handler_call_details.invocation_metadata)
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


def interceptors(token: str | None, protected: Iterable[str]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a server installs for its control calls: none when no token is configured."""
    return [SecretInterceptor(lambda metadata: check_bearer(metadata, token), protected)] if token else []


def api_key_interceptors(
    api_key: str | None, protected: Iterable[str], token: str | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The gateway's data-plane interceptors: none when no API key is configured (see check_api_key)."""
    if not api_key:
        return []
    return [SecretInterceptor(lambda metadata: check_api_key(metadata, api_key, token), protected)]

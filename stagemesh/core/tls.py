"""TLS for every listener (`--tls-cert`/`--tls-key`) and the one helper that opens channels.

Every channel in the mesh (gateway -> stages, stage workers -> cache service, the supervisor's
health checks, the CLI) comes from `channel()`: TLS verified against a CA bundle when one is
given, plaintext otherwise.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from stagemesh.core import errors

CA_ENV = "STAGEMESH_TLS_CA"
HEALTH_PORT_HELP = (
    "also answer grpc.health.v1 (and nothing else) in plaintext on this port, bound to --host, for "
    "health probes that cannot speak TLS (the kubelet's gRPC probes); 0 picks a free one; unset: none"
)
CERT_HELP = "serve TLS with this certificate chain; needs --tls-key (default: plaintext)"
KEY_HELP = "private key of --tls-cert (default: plaintext)"
CA_HELP = (
    "CA bundle that verifies the services this one calls; set it when they serve TLS (default: plaintext channels)"
)


def health_port_argument(text: str) -> int:
    """argparse type of --health-port."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; allowed: 0 (a free port) to 65535")
    return port


def add_arguments(parser: argparse.ArgumentParser, *, client: bool = True) -> None:
    """--tls-cert/--tls-key for the listener; --tls-ca for a service that calls other services."""
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help=CERT_HELP)
    parser.add_argument("--tls-key", default=None, metavar="PEM", help=KEY_HELP)
    parser.add_argument("--health-port", type=health_port_argument, default=None, metavar="PORT", help=HEALTH_PORT_HELP)
    if client:
        parser.add_argument("--tls-ca", default=None, metavar="PEM", help=CA_HELP)


def read_pem(path: str, option: str) -> bytes:
    resolved = Path(path).expanduser()
    try:
        data = resolved.read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument.field(option, f"cannot read {resolved}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise errors.InvalidArgument.field(option, f"{resolved} is not a PEM file")
    return data


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials | None:
    """Credentials for ServiceHost; None (plaintext) when neither file is given."""
    if not cert and not key:
        return None
    if not (cert and key):
        missing = "--tls-key" if cert else "--tls-cert"
        raise errors.InvalidArgument.field(missing, "--tls-cert and --tls-key go together; give both or neither")
    return grpc.ssl_server_credentials([(read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))])


def channel_credentials(ca: str | None, option: str = "--tls-ca") -> grpc.ChannelCredentials | None:
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, option)) if ca else None


def env_ca() -> str | None:
    return os.environ.get(CA_ENV) or None


def channel(target: str, ca: str | None = None, options: Sequence[tuple[str, Any]] = (), *, aio: bool = False):
    """A channel to `target`: TLS verified by the CA bundle `ca`, or plaintext without one.

    `aio` picks grpc.aio (for servers' event loops) over the blocking API (CLI, worker threads).
    """
    credentials = channel_credentials(ca)
    options = list(options)
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, credentials, options=options)

"""Flags of `stagemesh gateway` (kept free of heavy imports so the CLI starts fast)."""

from __future__ import annotations

import argparse

from stagemesh.core import auth, logs, metrics, tls

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_STAGE_UNRESPONSIVE_S = 10.0
MIN_STAGE_UNRESPONSIVE_S = 2.0
DEFAULT_MAX_UNDELIVERED_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_IMAGES_PER_REQUEST = 8


def check_http_port(port: int | None, option: str) -> None:
    """Refuse an HTTP port outside 0..65535, naming the option; None means off."""
    if port is None:
        return
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"{option} = {port!r}: allowed 0 (a free port) to 65535, or unset for no HTTP API")


def http_port_argument(text: str) -> int:
    """argparse type of --http-port."""
    try:
        port = int(text)
        check_http_port(port, "--http-port")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; allowed: 0 (a free port) to 65535") from None
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="ADDRESSES",
        help="a stage's address, in pipeline order; repeat per stage. Replicas: comma-separated "
        "addresses or one dns:///name:port target (balanced by gRPC round_robin), or "
        "dns://SERVER/name:port to ask the DNS server SERVER (IP[:PORT] or [IPv6][:PORT], port 53 by default) "
        "rather than the system's resolver",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request accepted; larger ones get RESOURCE_EXHAUSTED (default: 4 MiB)",
    )
    parser.add_argument(
        "--stage-unresponsive-s",
        type=float,
        default=DEFAULT_STAGE_UNRESPONSIVE_S,
        help="a stage none of whose replicas answers a health check (asked every second) for this long "
        "is cut off: its calls in flight end UNAVAILABLE and new ones are refused at once until it "
        f"answers again; at least {MIN_STAGE_UNRESPONSIVE_S:g} (default: {DEFAULT_STAGE_UNRESPONSIVE_S:g})",
    )
    parser.add_argument(
        "--max-undelivered-bytes",
        type=int,
        default=DEFAULT_MAX_UNDELIVERED_BYTES,
        help="result bytes the gateway holds for calls whose clients have not read them yet (e.g. a "
        "client that grants no flow-control window); a result over the bound gets RESOURCE_EXHAUSTED "
        "(default: 64 MiB)",
    )
    parser.add_argument(
        "--max-images-per-request",
        type=int,
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        help="most images one Generate may ask for (GenerationParams.num_images); more get INVALID_ARGUMENT "
        f"naming params.num_images (default: {DEFAULT_MAX_IMAGES_PER_REQUEST})",
    )
    parser.add_argument(
        "--http-port",
        type=http_port_argument,
        default=None,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/images/generations, /v1/images/edits, "
        "/v1/models, /health, /v1/omni/...) on this port, bound to --host, with TLS when --tls-cert "
        "is given; 0 picks a free one (logged, and written to the ready file as 'http'); unset: off",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="file holding the API key that Generate, GenerateUnary, ListStages and the HTTP data "
        "routes must carry as 'authorization: Bearer KEY' (the control token is accepted too); "
        "unset: the data plane is open",
    )
    tls.add_arguments(parser)  # --tls-ca verifies the stages
    auth.add_arguments(parser)  # the token also authorizes the gateway's control calls to the stages
    metrics.add_argument(parser)
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write {'address', 'pid'} (and 'metrics' with a metrics port, 'http' with an HTTP port) as "
        "JSON here once bound",
    )
    parser.add_argument("--log-level", default="info", choices=logs.LOG_LEVELS, help="log level (default: 'info')")

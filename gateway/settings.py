"""Every option of the gateway, written once: flags of `stagemesh gateway`, keys of mesh.toml's
[gateway] table (kept free of heavy imports so the CLI starts fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from stagemesh.core import auth, errors, logs, metrics, options, tls
from stagemesh.core.options import option

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_STAGE_UNRESPONSIVE_S = 10.0
MIN_STAGE_UNRESPONSIVE_S = 2.0
DEFAULT_MAX_UNDELIVERED_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
DEFAULT_MAX_VIDEO_JOBS = 32
# Under the 4 MiB most gRPC clients accept in one message by default.
DEFAULT_RESULT_CHUNK_BYTES = 2 * 1024 * 1024
DEFAULT_VIDEO_JOB_TIMEOUT_S = 3600.0
DEFAULT_VIDEO_RETENTION_S = 3600.0


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


class OutOfRange(ValueError):
    """An option's value outside what it allows; the message names the option as mesh.toml does."""

    def __init__(self, name: str, value: Any, number: str, bound: str) -> None:
        super().__init__(f"{name} = {value!r}: allowed {number}, {bound}")
        self.name, self.value, self.bound = name, value, bound


@dataclass(frozen=True)
class GatewaySettings:
    """Built once (from the flags, or by `stagemesh up` from mesh.toml) and passed whole. Options
    with mesh=False are no [gateway] keys: `stagemesh up` sets them itself ([mesh] host, the
    stages it started, the [security] files, its ready file) or leaves them unset."""

    host: str = option("127.0.0.1", "address to bind (default: 127.0.0.1)", mesh=False)
    port: int = option(0, "port to bind; 0 picks a free one (default: 0)")
    stage: tuple[str, ...] = option(
        (),
        "a stage's address, in pipeline order; repeat per stage. Replicas: comma-separated "
        "addresses or one dns:///name:port target (balanced by gRPC round_robin), or "
        "dns://SERVER/name:port to ask the DNS server SERVER (IP[:PORT] or [IPv6][:PORT], port 53 by default) "
        "rather than the system's resolver",
        mesh=False,
        action="append",
        metavar="ADDRESSES",
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, "largest request accepted; larger ones get RESOURCE_EXHAUSTED (default: 4 MiB)"
    )
    stage_unresponsive_s: float = option(
        DEFAULT_STAGE_UNRESPONSIVE_S,
        "a stage none of whose replicas answers a health check (asked every second) for this long "
        "is cut off: its calls in flight end UNAVAILABLE and new ones are refused at once until it "
        f"answers again; at least {MIN_STAGE_UNRESPONSIVE_S:g} (default: {DEFAULT_STAGE_UNRESPONSIVE_S:g})",
    )
    max_undelivered_bytes: int = option(
        DEFAULT_MAX_UNDELIVERED_BYTES,
        "result bytes the gateway holds for calls whose clients have not read them yet (e.g. a "
        "client that grants no flow-control window); a result over the bound gets RESOURCE_EXHAUSTED "
        "(default: 64 MiB)",
    )
    max_images_per_request: int = option(
        DEFAULT_MAX_IMAGES_PER_REQUEST,
        "most images one Generate may ask for (GenerationParams.num_images); more get INVALID_ARGUMENT "
        f"naming params.num_images (default: {DEFAULT_MAX_IMAGES_PER_REQUEST})",
    )
    shared_memory: bool = option(
        False,
        "the stages run on this host as this user: their large outputs (prompt embeddings, pictures) "
        "come through /dev/shm instead of inside the gRPC messages (stagemesh up: always on)",
        mesh=False,
    )
    result_chunk_bytes: int = option(
        DEFAULT_RESULT_CHUNK_BYTES,
        "Generate sends a result larger than this (a video) as ResultChunk events of at most this many "
        f"bytes ahead of its result event (default: {DEFAULT_RESULT_CHUNK_BYTES}, under gRPC clients' "
        "usual 4 MiB message limit)",
    )
    max_video_jobs: int = option(
        DEFAULT_MAX_VIDEO_JOBS,
        "most video jobs (POST /v1/videos) held at once, running or finished and not yet expired; "
        f"more get 429 (default: {DEFAULT_MAX_VIDEO_JOBS})",
    )
    video_job_timeout_s: float = option(
        DEFAULT_VIDEO_JOB_TIMEOUT_S,
        "a video job still running this long after its creation is cancelled (its stage work freed) "
        f"and fails (default: {DEFAULT_VIDEO_JOB_TIMEOUT_S:g})",
    )
    video_retention_s: float = option(
        DEFAULT_VIDEO_RETENTION_S,
        "a finished (completed, failed or cancelled) video job and its MP4 are kept this long, then "
        f"forgotten: GET answers 404 (default: {DEFAULT_VIDEO_RETENTION_S:g})",
    )
    http_port: int | None = option(
        None,
        "also serve the OpenAI-compatible HTTP API (/v1/images/generations, /v1/images/edits, "
        "/v1/models, /health, /v1/omni/...) on this port, bound to --host, with TLS when --tls-cert "
        "is given; 0 picks a free one (logged, and written to the ready file as 'http'); unset: off",
        type=http_port_argument,
        metavar="PORT",
    )
    api_key_file: str | None = option(
        None,
        "file holding the API key that Generate, GenerateUnary, ListStages and the HTTP data "
        "routes must carry as 'authorization: Bearer KEY' (the control token is accepted too); "
        "unset: the data plane is open",
        metavar="PATH",
    )
    tls_cert: str | None = option(None, tls.CERT_HELP, mesh=False, metavar="PEM")
    tls_key: str | None = option(None, tls.KEY_HELP, mesh=False, metavar="PEM")
    health_port: int | None = option(
        None, tls.HEALTH_PORT_HELP, mesh=False, type=tls.health_port_argument, metavar="PORT"
    )
    tls_ca: str | None = option(None, tls.CA_HELP, mesh=False, metavar="PEM")  # verifies the stages
    # The token also authorizes the gateway's control calls to the stages.
    token_file: str | None = option(None, auth.TOKEN_FILE_HELP, mesh=False, metavar="PATH")
    metrics_port: int | None = option(None, metrics.PORT_HELP, type=metrics.port_argument, metavar="PORT")
    ready_file: str | None = option(
        None,
        "write {'address', 'pid'} (and 'metrics' with a metrics port, 'http' with an HTTP port) as "
        "JSON here once bound",
        mesh=False,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", tuple(self.stage))
        metrics.check_port(self.metrics_port, "metrics_port")
        check_http_port(self.http_port, "http_port")
        if self.api_key_file is not None and not isinstance(self.api_key_file, str):
            raise ValueError(f"api_key_file: must be a file path (a string), not {self.api_key_file!r}")
        for name, number, bound, allowed in (
            (
                "stage_unresponsive_s",
                "a number of seconds",
                f"{MIN_STAGE_UNRESPONSIVE_S:g} or more",
                lambda v: v >= MIN_STAGE_UNRESPONSIVE_S,
            ),
            ("max_undelivered_bytes", "a whole number of bytes", "above 0", lambda v: v > 0 and isinstance(v, int)),
            ("max_images_per_request", "a whole number", "1 or more", lambda v: v >= 1 and isinstance(v, int)),
            ("max_video_jobs", "a whole number", "1 or more", lambda v: v >= 1 and isinstance(v, int)),
            (
                "result_chunk_bytes",
                "a whole number of bytes",
                "1024 or more",
                lambda v: v >= 1024 and isinstance(v, int),
            ),
            ("video_job_timeout_s", "a number of seconds", "above 0", lambda v: v > 0),
            ("video_retention_s", "a number of seconds", "above 0", lambda v: v > 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not allowed(value):
                raise OutOfRange(name, value, number, bound)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        options.add_arguments(parser, fields(cls), show_default=False)  # the help texts name their defaults
        parser.add_argument("--log-level", default="info", choices=logs.LOG_LEVELS, help="log level (default: 'info')")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewaySettings:
        """A value out of range is refused as a bad option, naming its flag."""
        try:
            return cls(**options.values(cls, args))
        except OutOfRange as exc:
            shown = f"{exc.value:g}" if isinstance(exc.value, float) else str(exc.value)
            raise errors.InvalidArgument.field(options.flag(exc.name), f"{shown}: allowed {exc.bound}") from None

    def to_flags(self) -> list[str]:
        return options.to_flags(self)

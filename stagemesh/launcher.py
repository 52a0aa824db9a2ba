"""`stagemesh up`: the whole mesh on one machine (cache service, stages in order, gateway)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace

from stagemesh.config import MeshConfig, SecurityConfig
from stagemesh.core import auth, errors, logs, startup, tls
from stagemesh.gateway.settings import GatewaySettings
from stagemesh.stage_service.settings import DEFAULT_RUNTIME_CACHE_DIR, StageSettings
from stagemesh.supervisor import Child, StartFailed, Supervisor, service_argv

log = logs.get_logger("stagemesh.up")


def _stage_argv(
    stage: StageSettings, config: MeshConfig, cache_address: list[str], level: list[str]
) -> Callable[[int], list[str]]:
    def argv(port: int) -> list[str]:
        flags = replace(_with_cache(stage, config, cache_address), port=port, ready_file=None).to_flags()
        return service_argv("stage", *flags, *level)

    return argv


def _with_cache(stage: StageSettings, config: MeshConfig, cache_address: list[str]) -> StageSettings:
    """A stage that uses the runtime cache publishes through this mesh's cache service, into the
    directory that service manages, unless its table says otherwise; a compiling stage keeps its
    compiled code under that directory too."""
    if not stage.dlo_enable_runtime_cache:
        if stage.compile_mode() == "regional" and stage.dlo_runtime_cache_dir == DEFAULT_RUNTIME_CACHE_DIR:
            return replace(stage, dlo_runtime_cache_dir=config.cache.root)
        return stage
    return replace(
        stage,
        dlo_runtime_cache_service=stage.dlo_runtime_cache_service or (cache_address[0] if cache_address else ""),
        dlo_runtime_cache_dir=(
            config.cache.root
            if stage.dlo_runtime_cache_dir == DEFAULT_RUNTIME_CACHE_DIR
            else stage.dlo_runtime_cache_dir
        ),
    )


def _security_flags(security: SecurityConfig, *names: str) -> list[str]:
    """Paths only: the token itself never goes on a command line, where `ps` would show it."""
    return [
        flag
        for name in names
        if getattr(security, name)
        for flag in ("--" + name.replace("_", "-"), getattr(security, name))
    ]


def _metrics_flags(port: int | None) -> list[str]:
    return ["--metrics-port", str(port)] if port is not None else []


def _gateway_settings(config: MeshConfig, port: int, stage_addresses: list[str], gateway: Child) -> GatewaySettings:
    """mesh.toml's [gateway] with the mesh's host, its [security] files and the stages' addresses.
    A restart keeps the HTTP port the gateway first bound (as it keeps the gRPC port), so clients'
    addresses stay valid."""
    http_port = config.gateway.http_port
    bound = gateway.ready.get("http", "")
    if http_port is not None and bound:
        http_port = int(bound.rsplit(":", 1)[1])
    security = {k: v for k, v in vars(config.security).items() if v}
    # Every stage is a child of this process on this host, as this user: outputs can go through /dev/shm.
    return replace(
        config.gateway,
        host=config.host,
        port=port,
        stage=tuple(stage_addresses),
        http_port=http_port,
        shared_memory=True,
        **security,
    )


def _children(
    config: MeshConfig, stage_addresses: list[str], cache_address: list[str]
) -> tuple[Child, list[Child], Child]:
    level = ["--log-level", config.log_level]
    served = _security_flags(config.security, "tls_cert", "tls_key", "token_file")
    budget = ["--max-bytes", str(config.cache.max_bytes)] if config.cache.max_bytes is not None else []
    cache = Child(
        "cache",
        lambda port: service_argv(
            "cache",
            "--host",
            config.host,
            "--port",
            str(port),
            "--root",
            config.cache.root,
            *budget,
            *served,
            *_metrics_flags(config.cache.metrics_port),
            *level,
        ),
        port=config.cache.port,
    )
    stages = [
        Child(
            f"stage-{s.stage_id}",
            _stage_argv(s, config, cache_address, level),
            port=s.port,
            stop_group="stages",
        )
        for s in config.stages
    ]
    gateway = Child(
        "gateway",
        # argv is called once `gateway` is assigned
        lambda port: service_argv(
            "gateway", *_gateway_settings(config, port, stage_addresses, gateway).to_flags(), *level
        ),
        port=config.gateway.port,
    )
    return cache, stages, gateway


def banner(
    address: str,
    security: SecurityConfig | None = None,
    env_token: bool = False,
    http: str = "",
    api_key_file: str = "",
) -> str:
    """What to run next; with TLS and a token, hints that work as printed (the token never shows).
    `http`: the HTTP API's address when it is on."""
    security = security or SecurityConfig()
    ca = f" --tls-ca {security.tls_ca}" if security.tls else ""
    transport = f"-cacert {security.tls_ca}" if security.tls else "-plaintext"
    lines = [
        f"stagemesh: gateway serving on {address}",  # tests and scripts take the address from this line
        f"  try: stagemesh generate 'a lighthouse at dusk' --address {address}{ca} -o out.png",
        f'  or:  grpcurl {transport} -d \'{{"params": {{"prompt": "a lighthouse", "width": 256, '
        f'"height": 256}}}}\' {address} stagemesh.v1.GatewayService/GenerateUnary',
    ]
    if http:
        lines += _http_hints(http, security, api_key_file)
    if security.token_file or env_token:
        source = f"$(cat {security.token_file})" if security.token_file else f"${auth.TOKEN_ENV}"
        flag = f" --token-file {security.token_file}" if security.token_file else ""
        lines += [
            f"  control calls need the bearer token: stagemesh pause --address {address}{ca}{flag}",
            f'       grpcurl {transport} -H "authorization: Bearer {source}" '
            f"{address} stagemesh.v1.GatewayService/PauseGeneration",
        ]
    lines.append("  Ctrl-C stops the mesh.")
    return "\n".join(lines)


def _http_hints(http: str, security: SecurityConfig, api_key_file: str) -> list[str]:
    scheme, ca = ("https", f" --cacert {security.tls_ca}") if security.tls else ("http", "")
    key = f' -H "authorization: Bearer $(cat {api_key_file})"' if api_key_file else ""
    return [
        f"stagemesh: HTTP API (OpenAI-compatible) on {scheme}://{http}/v1",  # read by tests and scripts too
        f"  try: curl -s{ca}{key} {scheme}://{http}/v1/images/generations -H 'content-type: application/json' "
        '-d \'{"prompt": "a lighthouse", "size": "256x256"}\'',
    ]


async def up(config: MeshConfig, unset_env: frozenset[str] = frozenset()) -> int:
    """`unset_env`: variables the children must not inherit (see main)."""
    supervisor = Supervisor(config.supervision, tls_ca=config.security.tls_ca or None, unset_env=unset_env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stage_addresses: list[str] = []
    cache_address: list[str] = []
    cache, stages, gateway = _children(config, stage_addresses, cache_address)
    try:
        needs_cache = [s.dlo_enable_runtime_cache for s in config.stages]
        starting = asyncio.ensure_future(
            _start_all(supervisor, cache, stages, gateway, stage_addresses, cache_address, needs_cache)
        )
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not starting.done():
            starting.cancel()
            return 0
        address = starting.result()
        text = banner(
            address,
            config.security,
            env_token=bool(os.environ.get(auth.TOKEN_ENV)),
            http=gateway.ready.get("http", ""),
            api_key_file=config.gateway.api_key_file or "",
        )
        print(text, flush=True)
        return await supervisor.watch(stop)
    except StartFailed as exc:
        failed = exc
    finally:
        await asyncio.to_thread(supervisor.stop_all)
    # After the children's stop lines, so the reason is the last thing `up` says.
    print(f"stagemesh: {failed}", file=sys.stderr, flush=True)
    return 1


async def _start_all(
    supervisor: Supervisor,
    cache: Child,
    stages: list[Child],
    gateway: Child,
    stage_addresses: list[str],
    cache_address: list[str],
    needs_cache: list[bool],
) -> str:
    """Every child as early as what it needs allows: stages that do not publish through the
    cache service start beside it; the gateway starts once every stage has bound its port (it
    waits for them to serve itself), so its start overlaps their loading."""
    loop = asyncio.get_running_loop()
    bound = [loop.create_future() for _ in stages]

    async def stage_after_cache(i: int) -> str:
        address = await cache_started
        if not cache_address:
            cache_address.append(address)  # its command line names the cache service
        return await supervisor.start(stages[i], bound[i])

    cache_started: asyncio.Future[str] = asyncio.ensure_future(supervisor.start(cache))
    starting = [
        asyncio.ensure_future(stage_after_cache(i) if needs_cache[i] else supervisor.start(s, bound[i]))
        for i, s in enumerate(stages)
    ]
    gateway_started: asyncio.Future | None = None
    try:
        # A stage that fails before binding fails its task: wait on both.
        for i, task in enumerate(starting):
            await asyncio.wait({bound[i], task}, return_when=asyncio.FIRST_COMPLETED)
            if not bound[i].done():
                await task  # raises its StartFailed
        address = await cache_started
        if not cache_address:
            cache_address.append(address)
        stage_addresses.extend(b.result() for b in bound)
        gateway_started = asyncio.ensure_future(supervisor.start(gateway))
        await asyncio.gather(*starting)
        address = await gateway_started
    except BaseException:
        tasks: list[asyncio.Future] = [cache_started, *starting, *([gateway_started] if gateway_started else [])]
        for pending in tasks:
            pending.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # no failure left unretrieved
        raise
    startup.report(children=len(stages) + 2)
    return address


def _check_security_files(security: SecurityConfig) -> None:
    """Refuse unreadable [security] files before any child starts, naming the key."""
    for name in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(security, name):
            tls.read_pem(getattr(security, name), f"[security] {name}")
    if security.token_file:
        auth.load_token(security.token_file, "[security] token_file")


def _check_api_key_file(path: str | None) -> None:
    if path:
        auth.load_api_key(path, "[gateway] api_key_file")


def main(
    config_path: str | None, log_level: str | None, model: str | None = None, unset_env: frozenset[str] = frozenset()
) -> int:
    """`unset_env`: the services' STAGEMESH_* flag variables. mesh.toml configures the children,
    so a variable meant for a service started alone (STAGEMESH_PORT, STAGEMESH_TLS_CA, ...) must
    not reach every child `up` starts."""
    from stagemesh import config as mesh_config

    try:
        config = mesh_config.load(config_path, model)
        if log_level:
            config = replace(config, log_level=log_level)
    except (OSError, ValueError) as exc:  # unreadable file, bad TOML (a ValueError), unknown or bad keys
        # (an incomplete --model folder too)
        print(f"stagemesh: invalid config {config_path or model}: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        _check_security_files(config.security)
        _check_api_key_file(config.gateway.api_key_file)
    except errors.StagemeshError as exc:
        print(f"stagemesh: invalid config {config_path}: {exc}", file=sys.stderr, flush=True)
        return 2
    logs.configure("up", config.log_level)
    startup.begin("up")
    return asyncio.run(up(config, unset_env))

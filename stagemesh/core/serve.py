"""The life cycle every service shares: bind, announce, load, serve, stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from stagemesh.core import envflags, errors, logs, procutil, readyfile, tracing
from stagemesh.core.metrics import ServiceMetrics
from stagemesh.core.rpc import ServiceHost

log = logs.get_logger("stagemesh.core.serve")

STOP_GRACE_S = 5.0


async def run(
    host: ServiceHost,
    *,
    ready_file: str | None,
    load: Callable[[], Awaitable[None]] | None = None,
    close: Callable[[], Awaitable[None]] | None = None,
    metrics: ServiceMetrics | None = None,
    ready_info: Mapping[str, str] | None = None,
    stop_listeners: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until a stop signal. Health stays NOT_SERVING until `load` has finished.

    `ready_info`: more addresses for the ready file (listeners bound before this is called);
    `stop_listeners`: stops them, run alongside the gRPC server's stop so both share its grace."""
    procutil.die_with_parent()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # First: a metrics port that cannot be bound refuses the start before anything listens.
    metrics_address = metrics.start() if metrics is not None else ""
    await host.set_serving(False)
    await host.start()
    if ready_file:
        readyfile.write(
            ready_file, host.address, metrics=metrics_address, health=host.health_address, **(ready_info or {})
        )
    log.info("listening", address=host.address, **({"health": host.health_address} if host.health_address else {}))
    try:
        if load is not None:
            loader = asyncio.ensure_future(load())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not loader.done():
                loader.cancel()
                await asyncio.gather(loader, return_exceptions=True)
            else:
                loader.result()
        if not stop.is_set():
            await host.set_serving(True)
            log.info("serving", address=host.address)
            await stop.wait()
    finally:
        log.info("stopping", address=host.address)
        await host.set_serving(False)
        if stop_listeners is not None:
            await asyncio.gather(host.stop(STOP_GRACE_S), stop_listeners())
        else:
            await host.stop(STOP_GRACE_S)
        if close is not None:
            await close()
        if metrics is not None:
            metrics.stop()
        tracing.shutdown()  # the spans of the last calls go out before the process does
        log.info("stopped")


# Exit codes of a refused start. 2, as argparse and `stagemesh up` use for a refused option or
# config; 1 when the options are fine but the start failed (port taken, a worker that cannot load).
EXIT_BAD_OPTION = 2
EXIT_START_FAILED = 1
# Set by `stagemesh up` for each child: where a refused start writes its one-line reason, so the
# supervisor's own last line can say why the child exited.
FAILURE_FILE_ENV = "STAGEMESH_FAILURE_FILE"


def record_failure(reason: str) -> None:
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        try:
            with open(path, "w") as out:
                out.write(reason)
        except OSError:
            pass  # the log line has the reason too


def main(
    service: str,
    coroutine: Coroutine[Any, Any, None],
    *,
    option_errors: tuple[type[Exception], ...] = (),
    start_errors: tuple[type[Exception], ...] = (),
) -> None:
    """Run a service to completion. A refused start ends with one log line naming the cause and
    no traceback: exit 2 for errors.InvalidArgument and the service's `option_errors` (e.g. an
    incomplete model folder), exit 1 for other StagemeshErrors, OSError (a path that cannot be
    read or created; the message names it) and the service's `start_errors`. Any other exception
    is a bug: logged with its traceback, exit 1."""
    bad_option: tuple[type[Exception], ...] = (errors.InvalidArgument, *option_errors)
    failed_start: tuple[type[Exception], ...] = (errors.StagemeshError, OSError, *start_errors)
    try:
        asyncio.run(coroutine)
        # Stopped cleanly: a second stop signal during interpreter teardown must not turn exit 0 into -15.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except bad_option as exc:
        _refused(service, exc, EXIT_BAD_OPTION)
    except failed_start as exc:
        _refused(service, exc, EXIT_START_FAILED)
    except Exception:
        log.exception(f"{service} failed")
        record_failure(f"{service} failed unexpectedly; its log has the traceback")
        raise SystemExit(EXIT_START_FAILED) from None


def _refused(service: str, exc: Exception, code: int) -> None:
    reason = envflags.explain(str(exc))
    log.error(f"{service} failed to start", reason=reason)
    record_failure(reason)
    raise SystemExit(code) from None

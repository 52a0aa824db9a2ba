"""Start child services in order, wait until each is SERVING, restart the ones that die (with
backoff, bounded), and stop them all in reverse order (the children of one stop group at once)."""

from __future__ import annotations

import asyncio
import collections
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.config import SupervisionConfig
from stagemesh.core import logs, procutil, readyfile, serve, startup, tls
from stagemesh.core.backoff import Backoff

log = logs.get_logger("stagemesh.supervisor")

POLL_S = 0.2
BACKOFF = Backoff((0.5, 1.0, 2.0, 4.0, 8.0))


class StartFailed(RuntimeError):
    pass


@dataclass(eq=False)
class Child:
    """One supervised service. `argv(port)` builds its command line for a given port. Children
    next to one another in reverse start order with the same non-empty `stop_group` are stopped
    at once (a mesh's stages: none needs another to stop)."""

    name: str
    argv: Callable[[int], list[str]]
    port: int = 0
    stop_group: str = ""
    address: str = ""
    ready: dict = field(default_factory=dict)  # the ready file it last wrote (further addresses: "http")
    process: subprocess.Popen | None = None
    restarts: collections.deque = field(default_factory=collections.deque)


class Supervisor:
    def __init__(
        self, settings: SupervisionConfig, *, tls_ca: str | None = None, unset_env: frozenset[str] = frozenset()
    ):
        self._settings = settings
        self._tls_ca = tls_ca  # verifies children that serve TLS; None: plaintext health checks
        self._unset_env = unset_env  # variables of ours the children must not see
        self._children: list[Child] = []
        self._run_dir = Path(tempfile.mkdtemp(prefix="stagemesh-"))
        self._stopping = False

    async def start(self, child: Child, bound: asyncio.Future | None = None) -> str:
        """Start a child and return its address once grpc.health reports SERVING. `bound`, when
        given, gets the address as soon as the child has bound its port (it may load for long
        after that). The time from start to serving is a start-up phase of `up`."""
        self._children.append(child)
        with startup.phase(f"start {child.name}"):
            await self._launch(child, bound)
        return child.address

    async def _launch(self, child: Child, bound: asyncio.Future | None = None) -> None:
        ready = self._run_dir / f"{child.name}.ready"
        ready.unlink(missing_ok=True)
        argv = [*child.argv(child.port), "--ready-file", str(ready)]
        failure = self._failure_file(child)
        failure.unlink(missing_ok=True)
        env = procutil.child_env({serve.FAILURE_FILE_ENV: str(failure)}, unset=self._unset_env)
        # Popen returns at once; the child is then watched with poll(), as every restart is.
        child.process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)  # noqa: ASYNC220
        log.info("started", child=child.name, pid=child.process.pid)
        deadline = time.monotonic() + self._settings.ready_timeout_s
        while (info := readyfile.read(ready)) is None:
            self._check_alive(child, deadline)
            await asyncio.sleep(POLL_S / 4)
        child.address = info["address"]
        child.ready = info
        child.port = int(child.address.rsplit(":", 1)[1])  # a restart reuses the port its peers know
        if bound is not None and not bound.done():
            bound.set_result(child.address)
        async with tls.channel(child.address, self._tls_ca, aio=True) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            health_failure = ""
            while True:
                self._check_alive(child, deadline)
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError as exc:
                    if exc.details() != health_failure:  # once per reason, e.g. a certificate not naming the host
                        health_failure = exc.details() or ""
                        log.warning("health check failed", child=child.name, reason=health_failure)
                await asyncio.sleep(POLL_S)
        log.info(
            "serving",
            child=child.name,
            address=child.address,
            **({"http": child.ready["http"]} if "http" in child.ready else {}),
        )

    def _failure_file(self, child: Child) -> Path:
        return self._run_dir / f"{child.name}.failure"

    def _check_alive(self, child: Child, deadline: float) -> None:
        assert child.process is not None, "the child was started"
        code = child.process.poll()
        if code is not None:
            failure = self._failure_file(child)
            reason = failure.read_text(errors="replace").strip() if failure.is_file() else ""
            because = f": {reason}" if reason else " (its log above says why)"
            raise StartFailed(f"{child.name} exited with code {code} before it was serving{because}")
        if time.monotonic() > deadline:
            raise StartFailed(f"{child.name} not serving after {self._settings.ready_timeout_s:.0f} s")

    async def watch(self, stop: asyncio.Event) -> int:
        """Restart children that die until `stop` is set; 1 if one keeps dying, else 0."""
        while not stop.is_set():
            for child in self._children:
                code = child.process.poll() if child.process else None
                if code is not None and not stop.is_set():
                    if not await self._restart(child, code):
                        return 1
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
            except TimeoutError:
                pass
        return 0

    async def _restart(self, child: Child, code: int) -> bool:
        now = time.monotonic()
        window = self._settings.restart_window_s
        while child.restarts and now - child.restarts[0] > window:
            child.restarts.popleft()
        if len(child.restarts) >= self._settings.max_restarts:
            log.error("giving up", child=child.name, restarts=len(child.restarts), window_s=window)
            return False
        delay = BACKOFF.delay(len(child.restarts))
        child.restarts.append(now)
        log.warning("child exited; restarting", child=child.name, exit_code=code, delay_s=delay)
        await asyncio.sleep(delay)
        try:
            await self._launch(child)
        except StartFailed as exc:
            log.error("restart failed", child=child.name, reason=str(exc))
        return True

    def stop_all(self) -> None:
        """SIGTERM in reverse start order, a stop group at once; SIGKILL what does not stop in time."""
        for wave in self._stop_waves():
            running = [(c, c.process) for c in wave if c.process is not None and c.process.poll() is None]
            for _, proc in running:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self._settings.stop_timeout_s  # each child's own grace
            for child, proc in running:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("did not stop in time; killing", child=child.name)
                    proc.kill()
                    proc.wait()
                log.info("stopped", child=child.name, exit_code=proc.returncode)
        for leftover in self._run_dir.glob("*"):
            leftover.unlink(missing_ok=True)
        self._run_dir.rmdir()

    def _stop_waves(self) -> list[list[Child]]:
        """The children in reverse start order, neighbours of one stop group in one wave."""
        waves: list[list[Child]] = []
        for child in reversed(self._children):
            if waves and child.stop_group and waves[-1][-1].stop_group == child.stop_group:
                waves[-1].append(child)
            else:
                waves.append([child])
        return waves


def service_argv(command: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "stagemesh", command, *flags]

"""Clients for the stage services.

Data-plane calls (Execute) go over one channel per stage whose replicas gRPC's round_robin
balances. Control calls (SleepStage, WakeUpStage, DescribeStage) must reach every replica, so
they go concurrently over one channel per replica address; a `dns:` target is resolved at call
time to find the replicas behind the name (by the DNS server it names, as gRPC's resolver does).
With a token, every call but the health check carries it: a stage refuses the others without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.core import auth, converters, errors, logs, rpc, tls, tracing
from stagemesh.core.acks import WorkerAck
from stagemesh.core.params import Limits
from stagemesh.gateway import dns
from stagemesh.v1 import control_pb2, generation_pb2, stage_pb2, stage_pb2_grpc

log = logs.get_logger("stagemesh.gateway")

_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_DNS_SCHEME = "dns:"
_DEFAULT_PORT = 443  # gRPC's default when a target names no port
NO_WORKER_RANK = -1  # rank of the ACK that stands for a replica that did not answer
# A replica that went away (a crash, a restart) is dialled again with gRPC's exponential backoff;
# capped here (gRPC's own cap is 120 s) so that a restarted replica is used again within seconds.
RECONNECT_BACKOFF_MAX_S = 5.0


def channel_target(addresses: list[str]) -> str:
    """One gRPC target for a stage: `dns:///name:port`, a single address, or an ipv4/ipv6 list."""
    if len(addresses) == 1:
        return addresses[0]
    if all(a.startswith("[") for a in addresses):
        return "ipv6:" + ",".join(addresses)
    return "ipv4:" + ",".join(addresses)


@dataclass(frozen=True)
class DnsTarget:
    """A `dns:[//SERVER/]host[:port]` target: the name, its port, and the DNS server it names
    (None: the system's resolver)."""

    host: str
    port: int
    server: tuple[str, int] | None = None


def dns_target(target: str) -> DnsTarget | None:
    """The parts of a `dns:` target; None for any other target. A SERVER that is not an IP
    address (gRPC's resolver takes no other) is refused naming --stage."""
    if not target.startswith(_DNS_SCHEME):
        return None
    rest = target[len(_DNS_SCHEME) :]
    server = None
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
        if authority:
            try:
                server = dns.server_address(authority)
            except ValueError as exc:
                raise errors.InvalidArgument.field(
                    "--stage", f"{target}: the DNS server must be IP[:PORT] or [IPv6][:PORT] ({exc})"
                ) from None
    if rest.startswith("["):  # [v6]:port
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host, port = rest, ""
    return DnsTarget(host, int(port) if port else _DEFAULT_PORT, server)


def _address(sockaddr: tuple, family: int) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


async def resolve(target: DnsTarget) -> list[str]:
    """Every address the target's name resolves to (as round_robin sees them), in resolver order."""
    if target.server is not None:
        found = await dns.lookup(target.host, target.server)
        return [_address((ip, target.port), socket.AF_INET6 if ":" in ip else socket.AF_INET) for ip in found]
    infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(_address(sockaddr, family) for family, _, _, _, sockaddr in infos))


@dataclass(frozen=True)
class ReplicaAcks:
    """One replica's part of a sleep or wake: its workers' ACKs, or one ERROR ACK naming it."""

    address: str
    acks: list[control_pb2.WorkerAck]

    @property
    def ok(self) -> bool:
        return all(a.status == control_pb2.ACK_STATUS_SUCCESS for a in self.acks)


def aggregate(replies: list[stage_pb2.DescribeStageResponse]) -> stage_pb2.DescribeStageResponse:
    """The stage as the replicas that answered describe it: memory, workers and load summed, ready only
    if all are, asleep (at the deepest level) if any is, since round_robin would route into it."""
    total = stage_pb2.DescribeStageResponse()
    total.CopyFrom(replies[0])
    total.ready = all(r.ready for r in replies)
    total.supports_sleep = all(r.supports_sleep for r in replies)
    # What every replica can use: round_robin may send a request to any of them.
    total.supports_negative_prompt = all(r.supports_negative_prompt for r in replies)
    total.supports_init_image = all(r.supports_init_image for r in replies)
    total.supports_adapters = all(r.supports_adapters for r in replies)
    total.sleep_level = max(r.sleep_level for r in replies)
    total.device_memory_bytes = sum(r.device_memory_bytes for r in replies)
    total.workers = sum(r.workers for r in replies)
    total.queue_depth = sum(r.queue_depth for r in replies)
    total.batches = sum(r.batches for r in replies)
    total.batched_requests = sum(r.batched_requests for r in replies)
    total.device = ",".join(dict.fromkeys(r.device for r in replies))
    return total


@dataclass(frozen=True)
class ReplicaFailure:
    """A replica that did not answer: the error naming it, and the same error without its address."""

    error: errors.StagemeshError
    unnamed: errors.StagemeshError


@dataclass
class StageClient:
    stage_id: int
    addresses: list[str]
    kind: str = ""
    limits: Limits | None = None
    supports_sleep: bool = False
    sleep_level: int = 0
    supports_negative_prompt: bool = False
    supports_init_image: bool = False
    supports_adapters: bool = False
    tls_ca: str | None = None  # CA bundle verifying the stage's certificate; None: plaintext
    token: str | None = field(default=None, repr=False)  # sent on every call but health checks

    def __post_init__(self) -> None:
        self._dns = dns_target(self.addresses[0]) if len(self.addresses) == 1 else None
        self._channel = self._open(channel_target(self.addresses))
        self._auth_metadata = auth.bearer_metadata(self.token)
        # Why the stage is cut off (see gateway.watch); None while it answers.
        self.unresponsive: str | None = None
        # Calls in flight (Execute and control) -> the reason they were cut off ("" while they run).
        self._calls: dict[grpc.aio.Call, str] = {}
        self._stub = stage_pb2_grpc.StageServiceStub(self._channel)
        # Control channels, one per replica address. A single address needs no second channel.
        self._replicas: dict[str, tuple[grpc.aio.Channel, stage_pb2_grpc.StageServiceStub]] = {}
        if self._dns is None and len(self.addresses) == 1:
            self._replicas[self.addresses[0]] = (self._channel, self._stub)
        elif self._dns is None:
            self._replicas = {a: self._open_replica(a) for a in self.addresses}

    def _open(self, target: str) -> grpc.aio.Channel:
        options = [
            *rpc.channel_options(),
            ("grpc.service_config", _ROUND_ROBIN),
            ("grpc.max_reconnect_backoff_ms", int(RECONNECT_BACKOFF_MAX_S * 1000)),
        ]
        if self.tls_ca and len(self.addresses) > 1:
            # An ipv4:/ipv6: list is no host name; verify the replicas' certificates against the first host.
            options.append(("grpc.ssl_target_name_override", self.addresses[0].rsplit(":", 1)[0].strip("[]")))
        elif self.tls_ca and self._dns is not None and target != self.addresses[0]:
            # A resolved replica address: verify it against the name the target gave, as round_robin does.
            options.append(("grpc.ssl_target_name_override", self._dns.host))
        return tls.channel(target, self.tls_ca, options, aio=True)

    def _open_replica(self, address: str):
        channel = self._open(address)
        return channel, stage_pb2_grpc.StageServiceStub(channel)

    @property
    def replica_count(self) -> int:
        """Replicas behind this stage: its addresses, or what its DNS name last resolved to."""
        return len(self._replicas) or len(self.addresses)

    @property
    def name(self) -> str:
        return f"stage {self.stage_id} ({self.kind or 'unknown kind'})"

    async def close(self) -> None:
        channels = {id(c): c for c, _ in self._replicas.values()} | {id(self._channel): self._channel}
        await asyncio.gather(*(c.close() for c in channels.values()))

    async def _replica_stubs(self) -> dict[str, stage_pb2_grpc.StageServiceStub]:
        """address -> stub of every replica; a DNS name is resolved again on every call."""
        return {a: stub for a, (_, stub) in (await self._replica_channels()).items()}

    async def _replica_channels(self) -> dict[str, tuple[grpc.aio.Channel, stage_pb2_grpc.StageServiceStub]]:
        """address -> (channel, stub) of every replica, resolving a DNS name again."""
        if self._dns is not None:
            try:
                found = await resolve(self._dns)
            except OSError as exc:
                raise errors.Unavailable(f"{self.name}: cannot resolve {self._dns.host}: {exc}") from None
            for address in found:
                if address not in self._replicas:
                    self._replicas[address] = self._open_replica(address)
            gone = [self._replicas.pop(a)[0] for a in list(self._replicas) if a not in found]
            await asyncio.gather(*(c.close() for c in gone))  # replicas no longer behind the name
        return dict(self._replicas)

    async def answers_health_check(self, timeout: float) -> bool:
        """Whether any replica answers a health Check within `timeout`. Any answer counts, NOT_SERVING
        too: a stage that answers refuses calls itself; only one that says nothing holds them."""
        try:
            replicas = await self._replica_channels()
        except errors.Unavailable:
            return False
        request = health_pb2.HealthCheckRequest()

        async def one(channel: grpc.aio.Channel) -> bool:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
            except grpc.aio.AioRpcError:
                return False
            return True

        return any(await asyncio.gather(*(one(channel) for channel, _ in replicas.values())))

    def mark_unresponsive(self, reason: str) -> int:
        """Refuse new calls with `reason` and end those in flight UNAVAILABLE; how many were cut."""
        self.unresponsive = reason
        for call in self._calls:
            self._calls[call] = reason
            call.cancel()
        return len(self._calls)

    def mark_responsive(self) -> None:
        self.unresponsive = None

    async def _each_replica(
        self, method: str, request, only: Collection[str] | None = None, **kwargs
    ) -> list[tuple[str, Any]]:
        """Call `method` (with the token) on every replica at once, or on those of them whose
        address is in `only`: (address, reply or ReplicaFailure) per replica; the reply's type is
        the one `method` returns."""
        stubs = await self._replica_stubs()
        multiple = len(stubs) > 1 or self._dns is not None
        if only is not None:
            stubs = {a: stub for a, stub in stubs.items() if a in only}
        metadata = (*kwargs.pop("metadata", ()), *self._auth_metadata)
        if tracing.ON:  # the stages' spans join the trace of the call that asks
            metadata = (*metadata, *tracing.outgoing())

        async def one(address: str, stub):
            try:
                if self.unresponsive:
                    raise errors.Unavailable(self.unresponsive)
                call = getattr(stub, method)(request, metadata=metadata, **kwargs)
                with self._cut_off_as_unavailable(call):
                    return await call
            except grpc.aio.AioRpcError as exc:
                return ReplicaFailure(self._domain_error(exc, address if multiple else None), self._domain_error(exc))
            except errors.Unavailable as exc:  # the watch cut the stage off: no replica answers
                return ReplicaFailure(exc, exc)

        replies = await asyncio.gather(*(one(a, s) for a, s in stubs.items()))
        return list(zip(stubs, replies))

    async def each_replica(self, method: str, request, timeout: float | None) -> list[tuple[str, Any]]:
        """`method` on every replica: (address, reply or ReplicaFailure) each."""
        return await self._each_replica(method, request, timeout=timeout)

    @staticmethod
    def _first_error_if_none_answered(results: list[tuple[str, object]]) -> None:
        failures = [r for _, r in results if isinstance(r, ReplicaFailure)]
        if failures and len(failures) == len(results):
            raise failures[0].error

    async def describe(self, timeout: float, wait_for_ready: bool = False) -> stage_pb2.DescribeStageResponse:
        """Describe every replica and aggregate (see `aggregate`); replicas that do not answer are
        left out, and the stage is unavailable only when none answers."""
        results = await self._each_replica(
            "DescribeStage", stage_pb2.DescribeStageRequest(), timeout=timeout, wait_for_ready=wait_for_ready
        )
        self._first_error_if_none_answered(results)
        replies = [r for _, r in results if not isinstance(r, ReplicaFailure)]
        for address, result in results:
            if isinstance(result, ReplicaFailure):
                log.info("replica did not answer", stage_id=self.stage_id, replica=address, reason=str(result.error))
            elif result.kind != replies[0].kind:
                log.warning(
                    "replicas of one stage run different kinds",
                    stage_id=self.stage_id,
                    replica=address,
                    kind=result.kind,
                    expected=replies[0].kind,
                )
        reply = aggregate(replies)
        self.kind = reply.kind
        self.limits = converters.limits_from_proto(reply.limits)
        self.supports_sleep = reply.supports_sleep
        self.sleep_level = reply.sleep_level
        self.supports_negative_prompt = reply.supports_negative_prompt
        self.supports_init_image = reply.supports_init_image
        self.supports_adapters = reply.supports_adapters
        return reply

    async def awake_replicas(self, timeout: float) -> list[str]:
        """The addresses of the replicas that answer ready, able to sleep and awake (replicas that
        do not answer, or still load, are left out)."""
        results = await self._each_replica("DescribeStage", stage_pb2.DescribeStageRequest(), timeout=timeout)
        return [
            address
            for address, r in results
            if not isinstance(r, ReplicaFailure) and r.ready and r.supports_sleep and not r.sleep_level
        ]

    async def sleep(self, level: int, timeout: float | None, only: Collection[str] | None = None) -> list[ReplicaAcks]:
        """Put every replica to sleep, or those whose address is in `only`."""
        request = stage_pb2.SleepStageRequest(level=level)
        return await self._control("SleepStage", request, level, timeout, only)

    async def wake(self, timeout: float | None, level: int = 0) -> list[ReplicaAcks]:
        """`level`: the level the stage sleeps at, for the ACK of a replica that does not answer."""
        return await self._control("WakeUpStage", stage_pb2.WakeUpStageRequest(), level, timeout)

    async def _control(
        self, method: str, request, level: int, timeout: float | None, only: Collection[str] | None = None
    ) -> list[ReplicaAcks]:
        """Every replica's ACKs (or those of the replicas in `only`), in replica order. When no
        replica answers, the call fails with the first replica's status (as a single replica's
        would); otherwise a replica that failed gets one ERROR ACK (rank NO_WORKER_RANK) and its
        workers' error messages name its address."""
        results = await self._each_replica(method, request, only, timeout=timeout)
        self._first_error_if_none_answered(results)
        named = self.replica_count > 1 or self._dns is not None
        out = []
        for address, result in results:
            if isinstance(result, ReplicaFailure):
                # Every failed ACK of a replica starts with `replica ADDRESS:` (docs/API.md).
                failed = WorkerAck(
                    self.stage_id, NO_WORKER_RANK, False, level, error=f"replica {address}: {result.unnamed}"
                )
                acks = [converters.worker_ack_to_proto(failed)]
            else:
                acks = list(result.acks)
                for ack in acks:
                    if named and ack.status != control_pb2.ACK_STATUS_SUCCESS:
                        ack.error = f"replica {address}: {ack.error}"
            out.append(ReplicaAcks(address, acks))
        return out

    async def execute(
        self,
        request_id: str,
        params: generation_pb2.GenerationParams,
        inputs,
        timeout: float,
        on_started=None,
        images: int = 1,
        trace_parent: Any = None,
        shared_memory: bool = False,
    ) -> AsyncIterator[stage_pb2.ExecuteResponse]:
        """Stream one request through the stage; `on_started` is awaited once the stage answered.
        `images`: how many requests of this id are sent at once (the images of one Generate).
        `trace_parent`: the span the stage's spans belong under (None: tracing is off).
        `shared_memory`: large outputs may come as shared-memory segments, which the caller owns."""
        if self.unresponsive:
            raise errors.Unavailable(self.unresponsive)
        request = stage_pb2.ExecuteRequest(
            request_id=request_id, params=params, inputs=inputs, outputs_in_shared_memory=shared_memory
        )
        metadata = (*rpc.outgoing_metadata(request_id, images), *self._auth_metadata)
        if trace_parent is not None:
            metadata = (*metadata, *tracing.outgoing(trace_parent))
        call = self._stub.Execute(request, timeout=timeout, metadata=metadata)
        try:
            with self._cut_off_as_unavailable(call):
                async for response in call:
                    if on_started is not None:
                        await on_started()
                        on_started = None
                    yield response
        except grpc.aio.AioRpcError as exc:
            raise self._domain_error(exc) from None
        finally:
            call.cancel()  # no-op when finished; frees the stage's slot when we stop early

    @contextlib.contextmanager
    def _cut_off_as_unavailable(self, call: grpc.aio.Call) -> Iterator[None]:
        """While `call` runs, the watch may cut the stage off (mark_unresponsive cancels the call):
        that cancellation ends as UNAVAILABLE naming why. Our own caller's cancellation stays one."""
        self._calls[call] = ""
        try:
            yield
        except asyncio.CancelledError:
            cut_because = self._calls.get(call)
            task = asyncio.current_task()
            if not cut_because or (task is not None and task.cancelling()):
                raise
            raise errors.Unavailable(cut_because) from None
        finally:
            self._calls.pop(call, None)

    def _domain_error(self, exc: grpc.aio.AioRpcError, replica: str | None = None) -> errors.StagemeshError:
        """`replica`: the address to name when the stage has several."""
        code = exc.code()
        name = f"{self.name} replica {replica}" if replica else self.name
        if code == grpc.StatusCode.UNAVAILABLE:
            return errors.Unavailable(f"{name} is unavailable: {exc.details()}")
        if code == grpc.StatusCode.CANCELLED:
            return errors.Cancelled(f"{name}: {exc.details()}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            # The stage refused the gateway's own credential: not the caller's fault, and a 401
            # would send them after a key they do not need. The operator's fix is named instead.
            log.error("stage refused the gateway's credential", stage_id=self.stage_id, replica=replica)
            return errors.Unavailable(
                f"{name} refused the gateway's credential ({exc.details()}): the gateway needs the "
                "mesh's token (--token-file)"
            )
        if code == grpc.StatusCode.INTERNAL:
            # A stage's bug: its own words may name exception classes or the other requests of its
            # batch. The caller learns which stage failed; the details stay in the logs.
            log.error("stage failed internally", stage_id=self.stage_id, replica=replica, details=exc.details())
            return errors.UpstreamError(code, f"{name} failed internally; its log has the details")
        # Pass the stage's status through unchanged, rich details included.
        trailing = [(k, v) for k, v in (exc.trailing_metadata() or ()) if k == _STATUS_DETAILS_KEY]
        details = exc.details() or ""
        return errors.UpstreamError(code, f"{name}: {details}" if replica else details, trailing)

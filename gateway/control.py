"""Admission and the control plane: pause/resume generation, sleep and wake stages.

The loop operators run is pause -> abort -> sleep -> update -> wake -> resume: Sleep closes
admission and leaves it closed; a pipeline with an AR stage stays paused after WakeUp until
ResumeGeneration, a diffusion-only pipeline reopens by itself.

The operator's Sleep holds until their WakeUp: a replica that reports awake meanwhile (its
process was restarted and loaded its weights again) is put back to sleep at the level asked for
(keep_asleep, which gateway.watch runs every second), so that the stages, ListStages and
admission agree again and the device memory the operator freed stays free.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from stagemesh.core import errors, logs
from stagemesh.core.backoff import Backoff
from stagemesh.core.tasks import finish_even_if_cancelled
from stagemesh.gateway.stages import ReplicaAcks, StageClient
from stagemesh.v1 import control_pb2

log = logs.get_logger("stagemesh.control")

DEFAULT_SLEEP_LEVEL = 2
DESCRIBE_TIMEOUT_S = 2.0  # asking a stage whether it sleeps
NOT_SLEEPING_REASON = "target stages are not sleeping"
# A Sleep or WakeUp waits for the stages' answers at least this long, even when its caller's
# deadline is shorter: the stages finish the change anyway, and the record must learn the outcome.
STAGE_ANSWER_FLOOR_S = 300.0
# A replica that keep_asleep could not put back to sleep is tried again after these pauses.
RESLEEP_BACKOFF = Backoff((1.0, 2.0, 4.0, 8.0, 16.0, 30.0))


class Admission:
    """Who may start a Generate, and how many are between admission and submission."""

    def __init__(self) -> None:
        self._paused = False
        self._closing = 0  # pauses and sleeps waiting for admitted calls to be submitted
        self.sleeping: dict[int, int] = {}  # stage id -> sleep level
        self._admitting = 0
        self._changed = asyncio.Condition()

    @property
    def paused(self) -> bool:
        """Paused, or a pause or sleep is closing admission (new calls are refused meanwhile)."""
        return self._paused or self._closing > 0

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = value

    def check(self) -> None:
        if self.sleeping:
            stage_id = min(self.sleeping)
            raise errors.FailedPrecondition(
                f"stage {stage_id} is asleep (level {self.sleeping[stage_id]}); WakeUp it first"
            )
        if self.paused:
            raise errors.FailedPrecondition("generation is paused; ResumeGeneration reopens it")

    def enter(self) -> AdmissionTicket:
        self.check()
        self._admitting += 1
        return AdmissionTicket(self)

    async def _leave(self) -> None:
        self._admitting -= 1
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        """Refuse new calls and wait until none is between admission and submission; then stay
        paused. A wait that is cancelled (its caller's deadline passed, or it went away) leaves
        admission as it was before."""
        self._closing += 1
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._admitting == 0)
            self._paused = True
        finally:
            self._closing -= 1


@dataclass
class AdmissionTicket:
    admission: Admission
    released: bool = field(default=False)

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self.admission._leave()


@dataclass(frozen=True)
class ControlResult:
    status: control_pb2.ControlStatus
    acks: list[control_pb2.WorkerAck]
    reason: str = ""


class ControlPlane:
    def __init__(self, stages: list[StageClient], admission: Admission):
        self._stages = stages
        self._admission = admission
        self._lock = asyncio.Lock()  # one sleep/wake at a time
        # stage id -> level: the stages the operator put to sleep and has not asked to wake since.
        # Unlike admission.sleeping it ends with every WakeUp, also one that some replica failed:
        # keep_asleep must not put back to sleep what the operator asked to wake.
        self._asleep_by_request: dict[int, int] = {}
        self._changes = 0  # Sleeps and WakeUps done: keep_asleep acts only if none ran meanwhile
        self._resleep_failures: dict[tuple[int, str], tuple[int, float]] = {}  # (stage, replica) -> (count, retry at)

    @property
    def has_ar_stage(self) -> bool:
        return any(s.kind == "ar" for s in self._stages)

    def restore(self) -> None:
        """After a (re)start, take the sleeping set from what the stages report."""
        self._admission.sleeping = {s.stage_id: s.sleep_level for s in self._stages if s.sleep_level}
        self._asleep_by_request = dict(self._admission.sleeping)
        self._admission.paused = bool(self._admission.sleeping) and self.has_ar_stage

    def _validate(
        self, stage_ids: list[int], level: int | None = None, *, need_stage: bool = False
    ) -> list[errors.FieldViolation]:
        violations = []
        valid = f"allowed: stage ids 0 to {len(self._stages) - 1}"
        if need_stage and not stage_ids:
            # An empty Sleep would answer SUCCESS having done nothing; `stagemesh sleep --all` names every stage.
            violations.append(errors.FieldViolation("stage_ids", f"name at least one stage; {valid}"))
        unknown = sorted({i for i in stage_ids if not 0 <= i < len(self._stages)})
        if unknown:
            violations.append(errors.FieldViolation("stage_ids", f"unknown stage id(s) {unknown}; {valid}"))
        if level is not None and level not in (1, 2):
            violations.append(errors.FieldViolation("level", f"{level} is not a sleep level; allowed: 1 or 2"))
        return violations

    @contextlib.asynccontextmanager
    async def _changing(self) -> AsyncIterator[None]:
        """One Sleep or WakeUp at a time; each one counted once it is over (see keep_asleep)."""
        async with self._lock:
            try:
                yield
            finally:
                self._changes += 1

    async def sleep(self, stage_ids: list[int], level: int | None, timeout: float | None) -> ControlResult:
        # Once begun it runs to its end, so the record of sleeping stages learns what the stages did.
        return await finish_even_if_cancelled(self._sleep(stage_ids, level, _stage_timeout(timeout)), "sleep")

    async def wake(self, stage_ids: list[int], timeout: float | None) -> ControlResult:
        return await finish_even_if_cancelled(self._wake(stage_ids, _stage_timeout(timeout)), "wake")

    async def _sleep(self, stage_ids: list[int], level: int | None, timeout: float | None) -> ControlResult:
        level = DEFAULT_SLEEP_LEVEL if level is None else level
        violations = self._validate(stage_ids, level, need_stage=True)
        if violations:
            raise errors.InvalidArgument(violations)  # refused before admission is touched
        targets = [self._stages[i] for i in dict.fromkeys(stage_ids)]
        for stage in targets:
            if not stage.supports_sleep:
                raise errors.Unimplemented(f"{stage.name} cannot sleep (configured without sleep support)")
        async with self._changing():
            await self._admission.close()
            replies = await asyncio.gather(*(s.sleep(level, timeout) for s in targets))
            sleeping = self._admission.sleeping
            for stage, replicas in zip(targets, replies):
                # One replica asleep is enough to mark the stage: round_robin would route work into
                # it, and WakeUp must still reach it. The ERROR status reports the others.
                if any(r.ok for r in replicas):
                    sleeping[stage.stage_id] = max(level, sleeping.get(stage.stage_id, 0))
                    self._asleep_by_request[stage.stage_id] = sleeping[stage.stage_id]
                _log_failed("sleep", stage, replicas)
        log.info("stages asleep", stage_ids=[s.stage_id for s in targets], level=level)
        acks = _flat(replies)
        return ControlResult(_overall(acks), acks)

    async def _wake(self, stage_ids: list[int], timeout: float | None) -> ControlResult:
        violations = self._validate(stage_ids)
        if violations:
            raise errors.InvalidArgument(violations)
        async with self._changing():
            asleep = await self._asleep([self._stages[i] for i in dict.fromkeys(stage_ids)])
            targets = [self._stages[i] for i in asleep]
            if not targets:  # also when no stage is named: none of them sleeps
                return ControlResult(control_pb2.CONTROL_STATUS_SKIPPED, [], NOT_SLEEPING_REASON)
            sleeping = self._admission.sleeping
            for stage in targets:
                self._asleep_by_request.pop(stage.stage_id, None)
            replies = await asyncio.gather(*(s.wake(timeout, asleep[s.stage_id]) for s in targets))
            for stage, replicas in zip(targets, replies):
                if all(r.ok for r in replicas):  # awake only once no replica sleeps
                    sleeping.pop(stage.stage_id, None)
                _log_failed("wake", stage, replicas)
            if not self.has_ar_stage:
                self._admission.paused = False  # diffusion-only pipelines reopen by themselves
        log.info("stages awake", stage_ids=[s.stage_id for s in targets])
        acks = _flat(replies)
        return ControlResult(_overall(acks), acks)

    async def _asleep(self, stages: list[StageClient]) -> dict[int, int]:
        """stage id -> sleep level of those of `stages` that sleep: by this gateway's record, or by
        what the stage reports (one put to sleep by a direct SleepStage, or before a restart)."""
        reported = await asyncio.gather(*(_reported_sleep_level(s) for s in stages))
        recorded = self._admission.sleeping
        return {
            s.stage_id: max(level, recorded.get(s.stage_id, 0))
            for s, level in zip(stages, reported)
            if level or s.stage_id in recorded
        }

    async def keep_asleep(self, stage: StageClient) -> None:
        """Put back to sleep, at the level asked for, the replicas of `stage` that report awake
        while the operator's last word on the stage was Sleep: a replica restarted (its new process
        comes up awake, its weights loaded) or one woken by its own WakeUpStage; only the gateway's
        WakeUp ends it. A Sleep or WakeUp that runs meanwhile wins: the replicas are looked at
        again at the next call. A replica that fails to sleep is tried again after RESLEEP_BACKOFF.
        Errors are logged, never raised."""
        level = self._asleep_by_request.get(stage.stage_id)
        if not level:
            for key in [k for k in self._resleep_failures if k[0] == stage.stage_id]:
                del self._resleep_failures[key]
            return
        changes = self._changes
        try:
            awake = await stage.awake_replicas(DESCRIBE_TIMEOUT_S)
        except errors.StagemeshError as exc:  # a DNS name that does not resolve
            log.info("stage did not say whether it sleeps", stage_id=stage.stage_id, reason=str(exc))
            return
        now = time.monotonic()
        due = [a for a in awake if self._resleep_failures.get((stage.stage_id, a), (0, 0.0))[1] <= now]
        if not due:
            return
        async with self._lock:
            if self._changes != changes or self._asleep_by_request.get(stage.stage_id) != level:
                return  # a Sleep or WakeUp ran since the replicas were asked
            log.warning(
                "replicas awake while their stage sleeps; putting them back to sleep",
                stage_id=stage.stage_id,
                replicas=due,
                sleep_level=level,
            )
            try:
                replicas = await stage.sleep(level, STAGE_ANSWER_FLOOR_S, only=due)
            except errors.StagemeshError as exc:
                replicas = [
                    ReplicaAcks(a, [control_pb2.WorkerAck(status=control_pb2.ACK_STATUS_ERROR, error=str(exc))])
                    for a in due
                ]
        for replica in replicas:
            key = (stage.stage_id, replica.address)
            if replica.ok:
                self._resleep_failures.pop(key, None)
                log.info("replica asleep again", stage_id=stage.stage_id, replica=replica.address, sleep_level=level)
                continue
            failures = self._resleep_failures.get(key, (0, 0.0))[0] + 1
            self._resleep_failures[key] = (failures, time.monotonic() + RESLEEP_BACKOFF.delay(failures - 1))
        _log_failed("keep asleep", stage, replicas)

    async def pause(self) -> None:
        """Cancelled while admitted calls are still being submitted: generation stays as it was."""
        await self._admission.close()
        log.info("generation paused")

    def resume(self) -> None:
        self._admission.paused = False
        log.info("generation resumed")


def _stage_timeout(caller_remaining: float | None) -> float | None:
    return None if caller_remaining is None else max(caller_remaining, STAGE_ANSWER_FLOOR_S)


async def _reported_sleep_level(stage: StageClient) -> int:
    """The deepest level any replica of `stage` reports; 0 when none answers (the record decides)."""
    try:
        return (await stage.describe(DESCRIBE_TIMEOUT_S)).sleep_level
    except errors.StagemeshError as exc:
        log.info("stage did not say whether it sleeps", stage_id=stage.stage_id, reason=str(exc))
        return 0


def _flat(replies: list[list[ReplicaAcks]]) -> list[control_pb2.WorkerAck]:
    """Every ACK: stage by stage in call order, replica by replica in address order."""
    return [ack for replicas in replies for replica in replicas for ack in replica.acks]


def _log_failed(op: str, stage: StageClient, replicas: list[ReplicaAcks]) -> None:
    failed = [r.address for r in replicas if not r.ok]
    if failed:
        log.warning(
            "replicas failed", op=op, stage_id=stage.stage_id, failed=failed, done=[r.address for r in replicas if r.ok]
        )


def _overall(acks: list[control_pb2.WorkerAck]) -> control_pb2.ControlStatus:
    ok = all(a.status == control_pb2.ACK_STATUS_SUCCESS for a in acks)
    return control_pb2.CONTROL_STATUS_SUCCESS if ok else control_pb2.CONTROL_STATUS_ERROR

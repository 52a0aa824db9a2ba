"""Sleep and wake of one stage: close admission, let running batches finish, then ask every
worker (which drains its async outputs first) and collect one ACK per worker."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from stagemesh.core import errors, logs
from stagemesh.core.tasks import finish_even_if_cancelled
from stagemesh.stage_service.engine.dispatch import Engine
from stagemesh.stage_service.executor.multiproc import Executor

log = logs.get_logger("stagemesh.control")


@dataclass(frozen=True)
class Ack:
    rank: int
    ok: bool
    level: int
    freed_bytes: int = 0
    latency_ms: float = 0.0
    error: str = ""


class StageControl:
    def __init__(self, stage_name: str, engine: Engine, executor: Executor, supports_sleep: bool):
        self._stage_name = stage_name
        self._engine = engine
        self._executor = executor
        self.supports_sleep = supports_sleep
        self.level = 0
        self._lock = asyncio.Lock()  # one sleep or wake at a time
        engine.on_worker_restarted = self._resleep

    def _require_support(self) -> None:
        if not self.supports_sleep:
            raise errors.Unimplemented(f"{self._stage_name} is configured without sleep support (enable_sleep = false)")

    async def sleep(self, level: int) -> list[Ack]:
        self._require_support()
        if level not in (1, 2):
            raise errors.InvalidArgument.field("level", f"{level} is not a sleep level; allowed: 1 or 2")
        return await finish_even_if_cancelled(self._sleep(level), "sleep")

    async def wake(self) -> list[Ack]:
        self._require_support()
        return await finish_even_if_cancelled(self._wake(), "wake")

    async def _sleep(self, level: int) -> list[Ack]:
        async with self._lock:
            started = time.perf_counter()
            await self._engine.close_admission(f"{self._stage_name} is asleep (level {level}); call WakeUp first")
            acks = await self._fan_out("sleep", level, {"level": level})
            if all(a.ok for a in acks):
                self.level = max(self.level, level)
            elif not self.level:
                await self._undo_partial_sleep(acks)
            log.info(
                "stage asleep",
                level=level,
                ms=round((time.perf_counter() - started) * 1e3, 1),
                freed_bytes=sum(a.freed_bytes for a in acks),
            )
            return acks

    async def _wake(self) -> list[Ack]:
        async with self._lock:
            if not self.level:
                return []
            acks = await self._fan_out("wake", self.level, {})
            if all(a.ok for a in acks):
                self.level = 0
                self._engine.open_admission()
            return acks

    async def _undo_partial_sleep(self, acks: list[Ack]) -> None:
        """Some worker could not sleep: wake the ones that did and serve again, as before the call."""
        for group in self._engine.live_groups():
            ranks = set(self._executor.groups[group].output_ranks)
            slept = {a.ok for a in acks if a.rank in ranks}
            if slept == {True, False}:
                # Part of a group slept: its ranks wake through a collective that a rank still
                # awake never joins. The group restarts instead, and comes up awake.
                self._engine.restart_group(group, "a rank of the group could not sleep")
            elif slept == {True}:
                await asyncio.wrap_future(self._executor.control(group, "wake"))
        self._engine.open_admission()
        log.error("sleep failed; stage stays awake", errors=[a.error for a in acks if not a.ok])

    async def _fan_out(self, op: str, level: int, args: dict) -> list[Ack]:
        calls = {
            rank: fut
            for g in self._engine.live_groups()
            for rank, fut in self._executor.control_each(g, op, **args).items()
        }
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in calls.values()), return_exceptions=True)
        acks = []
        for rank, result in zip(calls, results):
            if isinstance(result, BaseException):
                acks.append(Ack(rank, False, level, error=str(result)))
            else:
                acks.append(Ack(rank, True, level, result["freed_bytes"], result["latency_ms"]))
        # A worker being restarted can neither free nor take back memory now: it fails the call,
        # as one that died during it does, so the caller learns the stage is not where it asked.
        # One ACK per worker: one that died during the call has its ACK already.
        acks += [
            Ack(
                rank,
                False,
                level,
                error=f"worker {rank} died and is being restarted; retry once the stage serves again",
            )
            for group in self._engine.restarting_groups()
            for rank in self._executor.groups[group].output_ranks
            if rank not in calls
        ]
        return sorted(acks, key=lambda a: a.rank)

    async def _resleep(self, group: int) -> None:
        """A group restarted while the stage sleeps comes up with its weights loaded: put it back."""
        if self.level:
            await asyncio.wrap_future(self._executor.control(group, "sleep", level=self.level))

"""The gateway's watches on its stages.

StageWatch: a stage process that is stopped (SIGSTOP) or wedged keeps its port open and accepts
connections, so calls to it would wait for their whole deadline. Every second each stage replica
is asked a health Check with a short timeout; a stage none of whose replicas has answered for
`unresponsive_s` is cut off: its calls in flight end UNAVAILABLE and new ones are refused at once,
until one of its replicas answers again.

SleepWatch: every second the replicas of each stage the operator put to sleep (and has not woken
since) are asked whether they sleep; one that came back awake (restarted) is put back to sleep
(ControlPlane.keep_asleep).
"""

from __future__ import annotations

import asyncio
import time

from stagemesh.core import logs
from stagemesh.gateway.control import ControlPlane
from stagemesh.gateway.stages import StageClient

log = logs.get_logger("stagemesh.gateway")

CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 1.0


class StageWatch:
    def __init__(self, stages: list[StageClient], unresponsive_s: float):
        self._stages = stages
        self._unresponsive_s = unresponsive_s
        self._silent_since: dict[int, float] = {}  # stage id -> when its first unanswered check was sent

    async def run(self) -> None:
        """Check every stage each CHECK_INTERVAL_S until cancelled."""
        while True:
            round_started = time.monotonic()
            await asyncio.gather(*(self._check(stage, round_started) for stage in self._stages))
            await asyncio.sleep(max(0.0, round_started + CHECK_INTERVAL_S - time.monotonic()))

    async def _check(self, stage: StageClient, sent_at: float) -> None:
        if await stage.answers_health_check(CHECK_TIMEOUT_S):
            self._silent_since.pop(stage.stage_id, None)
            if stage.unresponsive:
                stage.mark_responsive()
                log.warning("stage answers again; routing to it", stage_id=stage.stage_id)
            return
        since = self._silent_since.setdefault(stage.stage_id, sent_at)
        silent_s = time.monotonic() - since
        if silent_s >= self._unresponsive_s and not stage.unresponsive:
            reason = (
                f"{stage.name} has not answered a health check for {silent_s:.1f} s (the gateway's "
                f"stage_unresponsive_s is {self._unresponsive_s:g} s); it is refused until it answers: "
                "check that its process runs and is not stopped, and its log"
            )
            cut = stage.mark_unresponsive(reason)
            log.error("stage unresponsive; failing its calls", stage_id=stage.stage_id, calls_cut=cut)


class SleepWatch:
    def __init__(self, stages: list[StageClient], control: ControlPlane):
        self._stages = stages
        self._control = control

    async def run(self) -> None:
        """Keep the sleeping stages asleep each CHECK_INTERVAL_S until cancelled."""
        while True:
            round_started = time.monotonic()
            await asyncio.gather(*(self._control.keep_asleep(stage) for stage in self._stages))
            await asyncio.sleep(max(0.0, round_started + CHECK_INTERVAL_S - time.monotonic()))

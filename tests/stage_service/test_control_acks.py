"""A stage answers a Sleep or WakeUp with one ACK per worker, also when a worker dies during the
call (it used to report the dead worker twice: once for the failed call, once as restarting)."""

from __future__ import annotations

import asyncio
import os
import signal

import torch

from stagemesh.stage_service.control import StageControl
from stagemesh.stage_service.engine.dispatch import Engine
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.settings import StageSettings


def test_a_worker_killed_during_sleep_gets_one_error_ack(tiny_model):
    torch.set_num_threads(1)
    settings = StageSettings(stage_id=1, kind="diffusion", model_dir=str(tiny_model), threads=1, workers=2)

    async def scenario():
        executor = Executor(settings, on_death=lambda group, why: engine.worker_died(group, why))
        engine = Engine(executor, "diffusion", max_batch_size=1, max_queue=8)
        control = StageControl("stage 1 (diffusion)", engine, executor, supports_sleep=True)
        await asyncio.to_thread(executor.start, 120)
        engine.start()
        try:
            victim = executor.groups[1].workers[0].process.pid
            os.kill(victim, signal.SIGSTOP)  # it cannot answer the sleep before it dies
            sleeping = asyncio.create_task(control.sleep(2))
            await asyncio.sleep(0.5)
            os.kill(victim, signal.SIGKILL)
            return await asyncio.wait_for(sleeping, 60)
        finally:
            await engine.close()
            await asyncio.to_thread(executor.shutdown)

    acks = asyncio.run(scenario())
    assert sorted(a.rank for a in acks) == [0, 1], acks  # one ACK per worker
    assert [a.ok for a in sorted(acks, key=lambda a: a.rank)] == [True, False]
    assert "worker 1" in next(a.error for a in acks if a.rank == 1)

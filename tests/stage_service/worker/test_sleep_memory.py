"""A stage's real worker process put to sleep and woken 20 times at levels 1 and 2 through the
stage's own control path (StageControl -> Engine -> Executor -> worker): once a warm-up cycle of
each level has made every buffer the worker keeps, its resident memory (read from
/proc/<worker>/statm) stays within 2 %, awake and asleep. On the CPU the weights' "device" memory
is host memory, so this covers both: a level-1 host buffer made afresh per sleep, staging kept
per wake or a checkpoint mapping left behind would each show as a step of the weights' size
(about 60 MB here, 15 % of the worker's RSS). The stage is built in-process, as `stagemesh stage` builds it, because the
command regenerates the embedded model at one of its preset sizes, and the tiny one's weights
(2 MB) would hide in the worker's 2 % noise."""

from __future__ import annotations

import asyncio
import resource

import torch

from stagemesh.stage_service.control import StageControl
from stagemesh.stage_service.engine.dispatch import Engine
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.config import DiTConfig, LMConfig, PipelineConfig
from stagemesh.stage_service.models.weights import DIT_FILE, ensure_model_dir
from stagemesh.stage_service.settings import StageSettings

CYCLES = 20
FLAT = 0.02
# Weights (~60 MB) well above the worker's 2 % noise (~8 MB), small enough to copy 44 times fast.
MODEL = PipelineConfig(lm=LMConfig(), dit=DiTConfig(hidden_size=384, depth=6, num_heads=6, cond_dim=64))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_twenty_sleep_wake_cycles_at_levels_1_and_2_keep_the_worker_rss_flat(tmp_path):
    torch.set_num_threads(1)
    model = ensure_model_dir(tmp_path / "model", MODEL)
    weight_bytes = (model / DIT_FILE).stat().st_size  # the DiT and decoder: what the sleep manages
    settings = StageSettings(stage_id=1, kind="diffusion", model_dir=str(model), threads=1)
    awake: list[int] = []
    asleep: dict[int, list[int]] = {1: [], 2: []}

    async def scenario() -> int:
        executor = Executor(settings, on_death=lambda group, why: engine.worker_died(group, why))
        engine = Engine(executor, "diffusion", max_batch_size=1, max_queue=8)
        control = StageControl("stage 1 (diffusion)", engine, executor, supports_sleep=True)
        await asyncio.to_thread(executor.start, 120)
        engine.start()
        try:
            worker = executor.groups[0].workers[0].process.pid

            async def cycle(level: int) -> tuple[int, int]:
                acks = await control.sleep(level)
                assert [(a.ok, a.level) for a in acks] == [(True, level)], acks
                sleeping = _rss(worker)
                acks = await control.wake()
                assert [a.ok for a in acks] == [True], acks
                return sleeping, _rss(worker)

            for level in (1, 2):  # warm-up: the level-1 host buffer, allocator pools, threads
                await cycle(level)
            for n in range(CYCLES):
                level = 1 + n % 2
                sleeping, woken = await cycle(level)
                asleep[level].append(sleeping)
                awake.append(woken)
            assert executor.groups[0].workers[0].process.pid == worker  # never restarted
            return worker
        finally:
            await engine.close()
            await asyncio.to_thread(executor.shutdown)

    asyncio.run(scenario())
    for name, samples in (("awake", awake), ("asleep at level 1", asleep[1]), ("asleep at level 2", asleep[2])):
        first = samples[0]
        spread = [round(s / first - 1, 4) for s in samples]
        assert all(abs(d) <= FLAT for d in spread), (name, first, spread)
    # The measurement sees the weights: a sleep gives their memory back.
    assert awake[0] - asleep[2][0] > 0.8 * weight_bytes, (awake[0], asleep[2][0], weight_bytes)

"""DP waves (docs/DLO.md): DP waves of a DLO AllGather stage, on real worker processes that form a real
gloo group on the CPU. Engine level (Executor + Engine + StageControl as the stage service wires
them) with dp_size 2 and 3, and one `stagemesh up` whose diffusion stage runs with dp_size 2.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from stagemesh.core import errors
from stagemesh.core.params import Params
from stagemesh.stage_service.control import StageControl
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent, ProgressEvent
from stagemesh.stage_service.engine.wave_rules import WAVE_TIMEOUT_ENV, WaveFailed, WaveRequest, run_wave
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.runners import WorkItem, build_runner
from stagemesh.stage_service.settings import DloOptions, StageSettings
from stagemesh.stage_service.transport.tensors import encoded_form
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import segments_of, shm_entries, start_mesh, write_config

SIZE, STEPS = 64, 3
COND_DIM = 64  # the tiny preset's DiT


def _params(seed: int, **kw) -> Params:
    base = dict(
        prompt=f"prompt {seed}",
        width=SIZE,
        height=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        seed=seed,
        output_format="png",
    )
    return Params(**{**base, **kw})


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {"hidden_states": torch.randn(3 + seed % 4, COND_DIM, generator=g)}  # lengths differ


@pytest.fixture(scope="module")
def reference(tiny_model):
    """seed -> the image a dp_size 1 DLO stage draws for that request alone (batch_invariant's rows)."""
    rows = StageSettings(kind="diffusion").max_batch_size
    runner = build_runner("diffusion", tiny_model, dlo=DloOptions(enable_dlo=True), invariant_rows=rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    cache: dict = {}

    def image(seed: int, **kw) -> torch.Tensor:
        key = (seed, tuple(sorted(kw.items())))
        if key not in cache:
            item = WorkItem(f"ref-{seed}", _params(seed, **kw), _inputs(seed))
            # As the worker hands it back for a PNG request: the gateway's uint8 pixels.
            cache[key] = encoded_form(runner.run([item])[0], item.params.output_format)["image"].clone()
        return cache[key]

    yield image
    torch.set_num_threads(threads)


class Stage:
    """What serve_stage wires, without the gRPC server."""

    def __init__(self, model: Path, dp: int) -> None:
        settings = StageSettings(
            stage_id=1, kind="diffusion", model_dir=str(model), threads=1, enable_dlo=True, dp_size=dp
        )
        self.executor = Executor(settings, on_death=lambda group, why: self.engine.worker_died(group, why))
        self.engine = Engine(self.executor, "diffusion", max_batch_size=4, max_queue=64)
        self.control = StageControl(self.executor.stage_name, self.engine, self.executor, True)

    async def generate(
        self, seed: int, progress: asyncio.Event | None = None, explicit_steps: bool = True, **kw
    ) -> torch.Tensor:
        async for event in self.engine.run(f"req-{seed}", _params(seed, **kw), _inputs(seed), explicit_steps):
            if isinstance(event, ProgressEvent) and progress is not None:
                progress.set()
            if isinstance(event, OutputsEvent):
                return event.outputs["image"]
        raise AssertionError("no output")

    def pid(self, rank: int) -> int:
        return self.executor._workers[rank].process.pid

    async def ping(self) -> list[dict]:
        [group] = self.executor.groups  # the DP ranks are one group; each rank answers
        answers = await asyncio.wrap_future(self.executor.control(group.index, "ping"))
        return [answers[rank] for rank in group.ranks]


@contextlib.asynccontextmanager
async def running(model: Path, dp: int):
    stage = Stage(model, dp)
    try:
        await asyncio.to_thread(stage.executor.start, 120)
        stage.engine.start()
        yield stage
    finally:
        await stage.engine.close()
        await asyncio.to_thread(stage.executor.shutdown)


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def _check_waves(stage: Stage, dp: int, reference) -> None:
    pings = await stage.ping()
    assert [p["dlo"]["world"] for p in pings] == [dp] * dp
    assert {p["dlo"]["host_mode"] for p in pings} == {"sharded"}  # each rank keeps its shard

    # dp + 1 concurrent compatible requests: one full wave, then a wave of one (fillers).
    seeds = list(range(dp + 1))
    images = await asyncio.gather(*(stage.generate(s) for s in seeds))
    for s, image in zip(seeds, images):
        assert torch.equal(image, reference(s)), f"seed {s} differs from dp_size 1"
    assert stage.engine.dispatcher.counts == {"waves": 2, "requests": dp + 1, "fillers": dp - 1}
    assert torch.equal(await stage.generate(7), reference(7))  # alone: every other rank fills
    assert stage.engine.dispatcher.counts["fillers"] == 2 * (dp - 1)

    # Invalid members are refused before dispatch, naming the field; the others still run.
    # A request with other steps waits for a wave of its own.
    results = await asyncio.gather(
        stage.generate(10),
        stage.generate(11, prompt=" "),
        stage.generate(12),
        stage.generate(13, explicit_steps=False),
        stage.generate(14, num_inference_steps=2),
        return_exceptions=True,
    )
    for bad, field in ((results[1], "params.prompt"), (results[3], "params.num_inference_steps")):
        assert isinstance(bad, errors.InvalidArgument), bad
        assert [v.field for v in bad.violations] == [field]
    assert torch.equal(results[0], reference(10)) and torch.equal(results[2], reference(12))
    assert torch.equal(results[4], reference(14, num_inference_steps=2))


async def _check_sleep_wake(stage: Stage, dp: int, reference) -> None:
    acks = await stage.control.sleep(1)
    assert sorted(a.rank for a in acks) == list(range(dp)) and all(a.ok for a in acks), acks
    with pytest.raises(errors.FailedPrecondition):
        await stage.generate(20)
    acks = await stage.control.wake()
    assert len(acks) == dp and all(a.ok for a in acks), acks
    images = await asyncio.gather(*(stage.generate(s) for s in (21, 22)))
    assert torch.equal(images[0], reference(21)) and torch.equal(images[1], reference(22))


async def _check_fail_closed(stage: Stage, dp: int, fault: str, reference) -> None:
    victim = dp - 1
    old_pids = [stage.pid(r) for r in range(dp)]
    if fault == "stop":  # a hung rank: the wave timeout ends the wave
        os.kill(stage.pid(victim), signal.SIGSTOP)
        started = time.monotonic()
        wave = [asyncio.create_task(stage.generate(30 + i)) for i in range(dp)]
    else:  # a rank dies in the middle of a wave
        stepping = asyncio.Event()
        started = time.monotonic()
        wave = [
            asyncio.create_task(stage.generate(30 + i, stepping, width=256, height=256, num_inference_steps=50))
            for i in range(dp)
        ]
        await asyncio.wait_for(stepping.wait(), 30)
        os.kill(stage.pid(victim), signal.SIGKILL)
    for task in wave:
        with pytest.raises(errors.Unavailable, match=r"stage 1 \(diffusion\).*DP wave"):
            await task
    assert time.monotonic() - started < 10, "the wave did not fail closed in seconds"

    # Recovery: every rank is a new process in a new group, and the next wave runs.
    await _until(lambda: stage.engine.serving and not stage.engine._in_flight[0])
    assert all(stage.pid(r) != old for r, old in enumerate(old_pids))
    images = await asyncio.gather(*(stage.generate(s) for s in (40, 41)))
    assert torch.equal(images[0], reference(40)) and torch.equal(images[1], reference(41))
    # The fillers' outputs arrive after the real ones and are dropped: nothing stays behind.
    await _until(stage.executor.outputs.is_empty, 10)


def test_the_dp_ranks_are_the_workers():
    s = StageSettings(kind="diffusion", enable_dlo=True, dp_size=3)
    assert s.worker_processes() == 3 and s.dp_group_size() == 3
    assert StageSettings(kind="diffusion", enable_dlo=True, dp_size=3, workers=3).worker_processes() == 3
    # No group without AllGather (or DLO), but dp_size still counts the data-parallel workers.
    assert StageSettings(kind="diffusion", enable_dlo=True, dp_size=3, dlo_use_allgather=False).worker_processes() == 3
    assert StageSettings(kind="diffusion", enable_dlo=True, dp_size=3, dlo_use_allgather=False).dp_group_size() == 1
    with pytest.raises(ValueError, match="workers = 2 with dp_size = 3.*set workers = 3"):
        StageSettings(kind="diffusion", enable_dlo=True, dp_size=3, workers=2)
    with pytest.raises(ValueError, match="every DP rank needs its own GPU"):
        StageSettings(kind="diffusion", device="cuda:1", enable_dlo=True, dp_size=2)


def test_a_failing_rank_ends_the_wave_without_waiting_for_the_timeout():
    def dispatch(rank, request, shape):
        f: cf.Future = cf.Future()
        if rank == 1:
            f.set_exception(RuntimeError("rank 1 broke"))
        return f  # rank 0 waits for rank 1 in a collective: it never answers

    started = time.monotonic()
    with pytest.raises(WaveFailed, match=r"rank\(s\) \[1\] failed: rank 1 broke"):
        run_wave([WaveRequest("a", _params(1))], 2, dispatch, timeout_s=60)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("dp,fault", [(2, "kill"), (3, "stop")])
def test_dp_waves_on_real_gloo_ranks(tiny_model, reference, monkeypatch, dp, fault):
    monkeypatch.setenv(WAVE_TIMEOUT_ENV, "2")

    async def scenario() -> None:
        async with running(tiny_model, dp) as stage:
            await _check_waves(stage, dp, reference)
            await _check_sleep_wake(stage, dp, reference)
            await _check_fail_closed(stage, dp, fault, reference)

    asyncio.run(scenario())


@pytest.mark.mesh
def test_a_mesh_with_dp_waves_draws_the_same_pngs(tmp_path, model_dir, mesh):
    config = write_config(tmp_path / "mesh.toml", model_dir)
    # The diffusion stage is the file's last table: these keys land on it.
    config.write_text(config.read_text() + "enable_dlo = true\ndp_size = 2\n")
    shm_before = shm_entries()
    dp_mesh = start_mesh(config, tmp_path / "mesh.log")
    try:
        params = [
            generation_pb2.GenerationParams(
                prompt="a lighthouse", width=64, height=48, num_inference_steps=3, seed=seed
            )
            for seed in (1, 2, 3)
        ]
        got = {}
        for name, m in (("default", mesh), ("dp", dp_mesh)):
            with m.channel() as channel:
                stub = m.gateway(channel)
                got[name] = [
                    stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=p), timeout=120).result.png
                    for p in params
                ]
        assert got["dp"] == got["default"]
        assert len(set(got["dp"])) == 3
        assert '"dp group' not in dp_mesh.logs()  # no wave failed on the way
    finally:
        assert dp_mesh.stop() == 0, dp_mesh.logs()[-3000:]
    leaked = segments_of(shm_entries() - shm_before, dp_mesh.child_pids())
    assert not leaked, f"shared-memory segments left behind: {leaked}"

"""The images of one Generate (one request id, announced with their count) share a batch even when
they arrive a few milliseconds apart; a request without the hint is dispatched at once; a hint
whose images never come costs at most a short wait."""

from __future__ import annotations

import asyncio

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent
from stagemesh.stage_service.engine.image_groups import GROUP_WAIT_S, ImageGroups
from stagemesh.stage_service.engine.request import StageRequest
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.settings import StageSettings

COND_DIM = 64


def _request(request_id: str, images: int, arrived: float = 0.0) -> StageRequest:
    return StageRequest(request_id, Params("p", 64, 64, 2, 4.0, 1, "tensor"), {}, images=images, arrived=arrived)


def test_a_request_waits_for_its_images_until_they_arrive_or_the_wait_is_over():
    groups = ImageGroups()
    first = _request("r", 3, arrived=10.0)
    groups.join(first)
    assert groups.hold_for(first, [first], max_batch=4, now=10.0) == pytest.approx(GROUP_WAIT_S)
    assert groups.hold_for(first, [first], max_batch=4, now=10.0 + GROUP_WAIT_S) == 0.0  # waited enough
    mates = [_request("r", 3, 10.001), _request("r", 3, 10.002)]
    for mate in mates:
        groups.join(mate)
    assert groups.hold_for(first, [first, *mates], max_batch=4, now=10.003) == 0.0  # all three are here
    # A full batch of them goes at once, even before the rest have arrived.
    assert ImageGroups().hold_for(_request("s", 8), [_request("s", 8)] * 2, max_batch=2, now=0.0) == 0.0
    # No hint, nothing to wait for.
    assert groups.hold_for(_request("t", 1), [], max_batch=4, now=0.0) == 0.0
    for r in [first, *mates]:
        groups.leave(r)
    assert not groups._groups  # nothing kept once they are gone


@pytest.fixture
def engine_on_worker(tiny_model):
    """A real diffusion worker behind an engine; records the size of every batch it is given."""
    torch.set_num_threads(1)
    settings = StageSettings(stage_id=1, kind="diffusion", model_dir=str(tiny_model), threads=1, max_batch_size=4)
    executor = Executor(settings)
    sizes: list[int] = []
    submit = executor.submit

    def recording_submit(group, items, on_progress=None):
        sizes.append(len(items))
        return submit(group, items, on_progress)

    executor.submit = recording_submit  # type: ignore[method-assign]  # observed, not replaced
    engine = Engine(executor, "diffusion", max_batch_size=4, max_queue=16)
    yield executor, engine, sizes
    executor.shutdown()


def _run(executor, engine, requests: list[tuple[str, int, int]], gap_s: float) -> list[tuple[int, ...]]:
    """Admit (request id, images, seed) requests `gap_s` apart; the image shape each gets."""
    params = [Params("p", 64, 64, 2, 4.0, seed, "tensor") for _, _, seed in requests]
    inputs = {"hidden_states": torch.randn(6, COND_DIM, generator=torch.Generator().manual_seed(0))}

    async def one(i: int) -> tuple[int, ...]:
        await asyncio.sleep(i * gap_s)
        request_id, images, _ = requests[i]
        async for event in engine.run(request_id, params[i], inputs, images=images):
            if isinstance(event, OutputsEvent):
                return tuple(event.outputs["image"].shape)
        raise AssertionError("no output")

    async def scenario() -> list[tuple[int, ...]]:
        await asyncio.to_thread(executor.start, 120)
        engine.start()
        try:
            return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))
        finally:
            await engine.close()

    return asyncio.run(scenario())


def test_images_of_one_request_arriving_apart_share_one_batch(engine_on_worker):
    executor, engine, sizes = engine_on_worker
    shapes = _run(executor, engine, [("gen", 4, seed) for seed in range(4)], gap_s=0.003)
    assert shapes == [(64, 64, 3)] * 4
    assert sizes == [4]


def test_requests_without_the_hint_go_at_once_and_a_hint_never_fulfilled_only_waits(engine_on_worker):
    executor, engine, sizes = engine_on_worker
    shapes = _run(executor, engine, [("a", 1, 1), ("b", 1, 2), ("lonely", 3, 3)], gap_s=0.003)
    assert shapes == [(64, 64, 3)] * 3
    assert sizes[0] == 1  # the first went alone, nothing held it back
    assert sum(sizes) == 3  # the lonely one ran after its short wait

"""Worker groups, the executor's unit of dispatch, death and restart: how a stage's settings map
to groups, the group call (answers of the output ranks, or the first error), and a real TP group
of two CPU processes on gloo: a batch reaches every rank and is answered once, and the death of
any rank fails the group's pending calls once and restarts the whole group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import os
import signal
import time
import weakref

import pytest
import torch

from stagemesh.core import errors
from stagemesh.core.params import Params
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent
from stagemesh.stage_service.executor.group import GroupCall, first_answer
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.settings import StageSettings


def _groups(**values) -> list[tuple[list[int], list[int], bool]]:
    settings = StageSettings(**{"kind": "diffusion", "model_dir": "unused", **values})
    return [(g.ranks, g.output_ranks, g.waves) for g in Executor(settings).groups]


def test_settings_map_to_groups():
    assert _groups(workers=3) == [([0], [0], False), ([1], [1], False), ([2], [2], False)]
    assert _groups(tensor_parallel_size=2) == [([0, 1], [0], False)]  # rank 0 answers for both
    assert _groups(enable_dlo=True, dp_size=2) == [([0, 1], [0, 1], True)]  # every wave rank answers
    # dp_size counts data-parallel processes also without a DP group (it used to start one worker)
    assert _groups(enable_dlo=True, dlo_use_allgather=False, dp_size=2) == [([0], [0], False), ([1], [1], False)]
    assert _groups(dp_size=2, workers=2) == [([0], [0], False), ([1], [1], False)]


def test_workers_and_dp_size_that_disagree_are_refused_naming_both():
    with pytest.raises(ValueError, match="workers = 3 with dp_size = 2"):
        StageSettings(kind="diffusion", dp_size=2, workers=3)


def test_a_group_call_answers_with_the_output_ranks_or_the_first_error_at_once():
    parts: list[cf.Future] = [cf.Future(), cf.Future()]
    call = GroupCall(parts, [0, 1], [0])
    parts[0].set_result("rank 0")
    assert not call.future.done()  # rank 1 has not answered yet
    parts[1].set_result("rank 1")
    assert call.future.result(0) == {0: "rank 0"}

    parts = [cf.Future(), cf.Future()]
    call = GroupCall(parts, [0, 1], [0, 1])
    each = call.by_output_rank()
    parts[1].set_exception(errors.Unavailable("rank 1 died"))
    with pytest.raises(errors.Unavailable, match="rank 1 died"):
        call.future.result(0)  # rank 0 still computes: the error does not wait for it
    parts[0].set_result("rank 0")
    assert each[0].result(0) == "rank 0" and isinstance(each[1].exception(0), errors.Unavailable)


def _item(steps: int, size: int = 64) -> WorkItem:
    cond = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    return WorkItem("r", Params("p", size, size, steps, 4.0, 11, "tensor"), {"hidden_states": cond})


def _tp_settings(tiny_model) -> StageSettings:
    return StageSettings(
        stage_id=1, kind="diffusion", model_dir=str(tiny_model), threads=1, step_execution=True, tensor_parallel_size=2
    )


def test_a_batch_reaches_every_tp_rank_and_is_answered_once(tiny_model):
    torch.set_num_threads(1)
    ex = Executor(_tp_settings(tiny_model))
    try:
        ex.start(120)
        steps: list[tuple[int, int]] = []
        _, fut = ex.submit(0, [_item(3)], lambda step, total: steps.append((step, total)))
        # Rank 0 cannot finish without rank 1 in each collective: the answer proves both ran it.
        [outputs] = fut.result(120)
        assert outputs["image"].shape == (64, 64, 3)
        assert steps == [(1, 3), (2, 3), (3, 3)]  # progress from the output rank only
        answers = ex.control(0, "ping").result(60)
        assert list(answers) == [0] and answers[0]["rank"] == 0
        # Every rank answered the control call (its stats came with its Ack), none still owes one.
        assert all(w.stats is not None and not w.pending for w in ex.groups[0].workers)
    finally:
        ex.shutdown()


def test_a_dead_rank_fails_the_group_once_and_the_whole_group_restarts(tiny_model):
    torch.set_num_threads(1)
    deaths: list[tuple[int, str]] = []

    def on_death(group: int, why: str) -> None:  # wired as the stage service wires it
        deaths.append((group, why))
        engine.worker_died(group, why)

    ex = Executor(_tp_settings(tiny_model), on_death=on_death)
    engine = Engine(ex, "diffusion", max_batch_size=1, max_queue=8)

    async def scenario() -> None:
        await asyncio.to_thread(ex.start, 120)
        engine.start()
        old = [w.process.pid for w in ex.groups[0].workers]
        stepping = asyncio.Event()
        failures: list[BaseException] = []

        async def long_request() -> None:
            params = Params("p", 256, 256, 50, 4.0, 1, "tensor")
            try:
                async for _ in engine.run("long", params, _item(1).inputs):
                    stepping.set()
            except errors.Unavailable as exc:
                failures.append(exc)

        task = asyncio.create_task(long_request())
        await asyncio.wait_for(stepping.wait(), 60)
        pending_ping = ex.control(0, "ping")
        os.kill(old[1], signal.SIGKILL)  # the rank that is not the output rank
        await asyncio.wait_for(task, 10)
        # Rank 1's death, or rank 0 failing in a collective under it: either way UNAVAILABLE, once.
        assert len(failures) == 1 and (
            "worker 1 died" in str(failures[0]) or "failed with its group" in str(failures[0])
        )
        assert isinstance(pending_ping.exception(5), errors.Unavailable)

        deadline = time.monotonic() + 120
        while not (deaths and engine.serving and ex.groups[0].down_rank() is None):
            assert time.monotonic() < deadline, "the group did not come back"
            await asyncio.sleep(0.1)
        new = [w.process.pid for w in ex.groups[0].workers]
        assert all(n != o for n, o in zip(new, old)), "every rank of the group is a new process"
        async for event in engine.run("again", _item(2).params, _item(2).inputs):
            if isinstance(event, OutputsEvent):
                assert event.outputs["image"].shape == (64, 64, 3)
        # One death for the group, not one per rank: the restart's own kills are no news.
        assert [group for group, _ in deaths] == [0]
        await engine.close()

    try:
        asyncio.run(scenario())
    finally:
        ex.shutdown()


class _Answer:
    """Stands for a batch's outputs (tensors over shared-memory slots the worker reuses)."""


@pytest.mark.parametrize("how", ["first answer", "by output rank"])
def test_an_answer_is_freed_by_reference_counting_once_its_caller_drops_it(how):
    """A reference cycle through the futures would keep a batch's outputs (and the shared-memory
    slots under them) alive until the garbage collector runs: the worker, finding no free slot,
    would fault in a fresh segment for every output."""
    gc.disable()
    try:
        part: cf.Future = cf.Future()
        call = GroupCall([part], [0], [0])
        out = first_answer(call) if how == "first answer" else call.by_output_rank()[0]
        answer = _Answer()
        alive = weakref.ref(answer)
        part.set_result(answer)
        del answer
        assert out.result(0) is alive()
        del out, call, part
        assert alive() is None, "the answer outlived every reference to it"
    finally:
        gc.enable()

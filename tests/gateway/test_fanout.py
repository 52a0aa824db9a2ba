"""gateway.fanout.merged on real asyncio streams: items as they come, the first failure cancels
the others and waits for their cleanup, and so does a reader that stops early."""

from __future__ import annotations

import asyncio

import pytest

from stagemesh.gateway.fanout import merged


class Stream:
    """An async generator that yields `items` (one per tick), then fails or waits forever, and
    records whether its cleanup ran."""

    def __init__(self, items: list[str], fail: bool = False, forever: bool = False) -> None:
        self.items, self.fail, self.forever = items, fail, forever
        self.closed = False

    async def run(self):
        try:
            for item in self.items:
                await asyncio.sleep(0)
                yield item
            if self.fail:
                raise ValueError("image failed")
            if self.forever:
                await asyncio.Event().wait()
        finally:
            self.closed = True


def test_every_item_of_every_stream_with_its_index():
    async def go():
        streams = [Stream(["a", "b"]), Stream(["c"]), Stream([])]
        got = [pair async for pair in merged([s.run() for s in streams])]
        return got, streams

    got, streams = asyncio.run(go())
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")]
    assert [item for i, item in got if i == 0] == ["a", "b"]  # each stream's own order
    assert all(s.closed for s in streams)


def test_the_first_failure_cancels_the_others_and_is_raised():
    async def go():
        streams = [Stream(["a"], forever=True), Stream(["b"], fail=True), Stream([], forever=True)]
        seen = []
        with pytest.raises(ValueError, match="image failed"):
            async for pair in merged([s.run() for s in streams]):
                seen.append(pair)
        return seen, streams

    seen, streams = asyncio.run(go())
    assert (1, "b") in seen
    assert all(s.closed for s in streams)  # the waiting streams were cancelled and cleaned up


def test_a_reader_that_stops_early_cancels_every_stream():
    async def go():
        streams = [Stream(["a"], forever=True), Stream(["b"], forever=True)]
        reader = merged([s.run() for s in streams])
        first = await reader.__anext__()
        await reader.aclose()
        return first, streams

    first, streams = asyncio.run(go())
    assert first in ((0, "a"), (1, "b"))
    assert all(s.closed for s in streams)


def test_a_cancelled_reader_cancels_every_stream():
    async def go():
        streams = [Stream([], forever=True), Stream([], forever=True)]

        async def read():
            async for _ in merged([s.run() for s in streams]):
                pass

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return streams

    assert all(s.closed for s in asyncio.run(go()))

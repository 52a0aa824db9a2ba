"""Several event streams run at once, read as one (the images of one request)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Ended:
    error: BaseException | None = None


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of the stream, item) for every item of every stream, in the order they come. The
    first stream that fails cancels the others, waits until they have ended (so their calls are
    cancelled and their resources freed), then its error is raised; closing or cancelling the
    reader does the same."""
    queue: asyncio.Queue[tuple[int, T | _Ended]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, _Ended(exc)))
        else:
            queue.put_nowait((index, _Ended()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, _Ended):
                if item.error is not None:
                    raise item.error
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Wait for their cleanup (a stage call cancelled, its slot freed) before going on.
        await asyncio.gather(*tasks, return_exceptions=True)

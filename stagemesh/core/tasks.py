"""Work that must finish once begun, whoever was waiting for it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from stagemesh.core import logs

log = logs.get_logger("stagemesh.tasks")

T = TypeVar("T")

# Strong references: the event loop keeps only weak ones to tasks, and these outlive their callers.
_RUNNING: set[asyncio.Future] = set()


async def finish_even_if_cancelled(change: Coroutine[Any, Any, T], what: str) -> T:
    """Run `change` to its end even if the caller's deadline passes or it goes away (a sleep or wake
    half done would leave a stage closed with its memory still held); the caller that stays gets
    the result. A failure that no caller is left to hear is logged, naming `what`."""
    task = asyncio.ensure_future(change)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    task.add_done_callback(lambda done: _log_unheard(done, what))
    return await asyncio.shield(task)


def _log_unheard(task: asyncio.Future, what: str) -> None:
    # Retrieving the exception also keeps asyncio from warning that nobody did.
    if not task.cancelled() and task.exception() is not None:
        log.info(f"{what} ended with an error", reason=str(task.exception()))

"""Executor side of async output: futures for outputs that arrive after COMPUTE_DONE, a cache for
outputs nobody waits for yet, and the split of one batch output into per-request outputs.

All state sits behind one lock. An output is removed from every map when it is handed out, so
nothing is left behind once each request has taken its result.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

from stagemesh.core import envconfig, errors, logs

log = logs.get_logger("stagemesh.outputs")

TIMEOUT_ENV = "STAGEMESH_ASYNC_OUTPUT_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
_warned_values: set[str] = set()


def output_timeout() -> float:
    """Seconds to wait for an output, read from the environment at every wait."""
    return envconfig.positive_seconds(
        TIMEOUT_ENV, DEFAULT_TIMEOUT_S, _warned_values, log, "ignoring bad async output timeout"
    )


def split_id(batch_id: str, request_key: str) -> str:
    return f"{batch_id}/{request_key}"


def resolve_future(fut: cf.Future, result: Any = None, exc: BaseException | None = None) -> bool:
    """Settle a future unless its waiter cancelled (or someone settled) it first; never raises.
    Returns whether this call settled it."""
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except cf.InvalidStateError:
        return False
    return True


class OutputRegistry:
    def __init__(self, stage_name: str):
        self._stage_name = stage_name
        self._lock = threading.Lock()
        self._waiting: dict[str, cf.Future] = {}
        self._cached: dict[str, Any] = {}
        self._splits: dict[str, list[str]] = {}  # batch id -> per-request ids, in batch order
        self._owner: dict[str, int] = {}  # output id (batch or single) -> worker rank
        self._discarded: set[str] = set()  # ids whose requests went away before delivery

    # producer side (the result pump) -----------------------------------------------------------
    def expect(self, output_id: str, rank: int) -> None:
        with self._lock:
            self._owner[output_id] = rank

    def deliver(self, output_id: str, result: Any = None, exc: BaseException | None = None) -> None:
        """An OUTPUT_READY, already unpacked: resolve a waiter, split a batch, or cache it."""
        with self._lock:
            self._owner.pop(output_id, None)
            sub_ids = self._splits.pop(output_id, None)
            if sub_ids is None:
                self._resolve_locked(output_id, result, exc)
                return
            for i, sub_id in enumerate(sub_ids):
                self._owner.pop(sub_id, None)
                self._resolve_locked(sub_id, None if exc else result[i], exc)

    # consumer side (the engine) -----------------------------------------------------------------
    def split(self, batch_id: str, request_keys: list[str]) -> list[str]:
        """Register per-request ids for a batch output; splits it now if it already arrived."""
        sub_ids = [split_id(batch_id, key) for key in request_keys]
        with self._lock:
            if batch_id in self._cached:
                batch = self._cached.pop(batch_id)
                for i, sub_id in enumerate(sub_ids):
                    self._resolve_locked(
                        sub_id, *((None, batch) if isinstance(batch, BaseException) else (batch[i], None))
                    )
                return sub_ids
            self._splits[batch_id] = sub_ids
            owner = self._owner.get(batch_id)
            if owner is not None:
                for sub_id in sub_ids:
                    self._owner[sub_id] = owner
        return sub_ids

    def future(self, output_id: str) -> cf.Future:
        """A future for one output; already resolved (and uncached) when it arrived before."""
        with self._lock:
            fut = self._waiting.get(output_id)
            if fut is not None:
                return fut
            fut = cf.Future()
            if output_id in self._cached:
                cached = self._cached.pop(output_id)
                resolve_future(fut, *((None, cached) if isinstance(cached, BaseException) else (cached, None)))
            else:
                self._waiting[output_id] = fut
            return fut

    def wait_output_ready(self, output_id: str, timeout_s: float | None = None) -> Any:
        """Blocking wait for one output (bounded by STAGEMESH_ASYNC_OUTPUT_TIMEOUT)."""
        timeout_s = output_timeout() if timeout_s is None else timeout_s
        fut = self.future(output_id)
        try:
            return fut.result(timeout_s)
        except cf.TimeoutError:
            self.discard(output_id)
            raise self.timeout_error(output_id, timeout_s) from None

    def timeout_error(self, output_id: str, timeout_s: float) -> errors.Unavailable:
        log.error("async output timed out", output_id=output_id, timeout_s=timeout_s, **self.pending_summary())
        return errors.Unavailable(f"{self._stage_name}: output {output_id} not ready after {timeout_s:g} s")

    def discard(self, output_id: str) -> None:
        """Forget an output whose request went away (cached result or waiting future)."""
        with self._lock:
            if self._cached.pop(output_id, None) is None and output_id in self._owner_or_split_locked():
                self._discarded.add(output_id)
            fut = self._waiting.pop(output_id, None)
        if fut is not None:
            fut.cancel()

    def _owner_or_split_locked(self) -> set[str]:
        pending = set(self._owner)
        for sub_ids in self._splits.values():
            pending.update(sub_ids)
        return pending

    # failures -------------------------------------------------------------------------------------
    def fail_rank(self, rank: int, exc: BaseException) -> None:
        """A worker died: everything it still owed fails now."""
        with self._lock:
            # A split batch owns its per-request ids: fail them through the batch, exactly once
            # (resolving one twice would cache the second error where nobody ever takes it).
            members = {sub_id for sub_ids in self._splits.values() for sub_id in sub_ids}
            owed = [oid for oid, owner in self._owner.items() if owner == rank and oid not in members]
            for oid in owed:
                self._owner.pop(oid, None)
                for sub_id in self._splits.pop(oid, [oid]):
                    self._owner.pop(sub_id, None)
                    self._resolve_locked(sub_id, None, exc)

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            self._cached.clear()
            self._discarded.clear()
            self._splits.clear()
            self._owner.clear()
        for fut in waiting.values():
            resolve_future(fut, exc=exc)

    def pending_summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "waiting": sorted(self._waiting),
                "cached": sorted(self._cached),
                "splits": {k: list(v) for k, v in self._splits.items()},
            }

    def is_empty(self) -> bool:
        with self._lock:
            return not (self._waiting or self._cached or self._splits or self._owner or self._discarded)

    def _resolve_locked(self, output_id: str, result: Any, exc: BaseException | None) -> None:
        if output_id in self._discarded:
            self._discarded.discard(output_id)
            return
        fut = self._waiting.pop(output_id, None)
        if fut is not None:
            resolve_future(fut, result, exc)
        elif exc is not None:
            self._cached[output_id] = exc
        else:
            self._cached[output_id] = result

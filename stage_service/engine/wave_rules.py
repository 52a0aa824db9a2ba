"""DP waves: with AllGather and dp_size > 1, one step runs up to dp_size requests, one per rank.

Every rank must enter every weight collective in the same order, so all requests of a wave
follow the same denoising path: the same explicit num_inference_steps, size and guidance. A rank
without a request of its own runs a filler: a copy of the wave's first request (its output is
dropped).
A wave is checked before anything is dispatched; a wave whose ranks do not all answer within
the wave timeout fails for every request in it (fail closed), and the next wave runs as usual.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stagemesh.core import envconfig, logs
from stagemesh.core.params import BATCH_KEY_FIELDS, Params

log = logs.get_logger("stagemesh.offload.waves")

WAVE_TIMEOUT_ENV = "STAGEMESH_DLO_DP_WAVE_TIMEOUT"
DEFAULT_WAVE_TIMEOUT_S = 600.0
_warned_values: set[str] = set()  # bad values already reported


class WaveRejected(ValueError):
    """A wave that must not run; `field` names the request field at fault (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class WaveFailed(RuntimeError):
    """Not every rank answered: every request of the wave fails."""


@dataclass(frozen=True)
class WaveRequest:
    request_id: str
    params: Params
    # False when the caller left num_inference_steps to the stage's default (a wave refuses it).
    explicit_steps: bool = True


def wave_timeout() -> float:
    """Seconds a wave may take, from the environment at each call (bad values: the default)."""
    return envconfig.positive_seconds(
        WAVE_TIMEOUT_ENV, DEFAULT_WAVE_TIMEOUT_S, _warned_values, log, "invalid wave timeout; using the default"
    )


def check_wave(requests: Sequence[WaveRequest], dp_size: int) -> None:
    """Raise WaveRejected unless the requests can run together as one wave."""
    if not 1 <= len(requests) <= dp_size:
        raise WaveRejected("requests", f"a wave holds 1 to {dp_size} requests, got {len(requests)}")
    for r in requests:
        if not r.params.prompt.strip():
            raise WaveRejected("prompt", f"{r.request_id}: a DP wave needs a non-empty prompt")
        if not r.explicit_steps:
            raise WaveRejected(
                "num_inference_steps",
                f"{r.request_id}: num_inference_steps must be explicit in a DP "
                "wave (every rank enters each weight collective)",
            )
    head = requests[0]
    for r in requests[1:]:
        for field, mine, shared in zip(BATCH_KEY_FIELDS, r.params.batch_key(), head.params.batch_key()):
            if mine != shared:
                raise WaveRejected(
                    field,
                    f"{r.request_id}: {field} {mine!r} differs from {shared!r} of {head.request_id} "
                    "in the same DP wave",
                )


def assign(requests: Sequence[WaveRequest], dp_size: int) -> list[WaveRequest | None]:
    """Rank -> its request; None: that rank runs a filler."""
    return list(requests) + [None] * (dp_size - len(requests))


Dispatch = Callable[[int, WaveRequest | None, WaveRequest], cf.Future]


def run_wave(
    requests: Sequence[WaveRequest], dp_size: int, dispatch: Dispatch, timeout_s: float | None = None
) -> list[Any]:
    """Check, dispatch one request (or a filler copy of `requests[0]`) per rank, and wait for
    all of them. Returns the results of the real requests, in order; raises WaveRejected before any
    dispatch, WaveFailed when a rank fails or does not answer in time."""
    check_wave(requests, dp_size)
    timeout_s = wave_timeout() if timeout_s is None else timeout_s
    futures = [dispatch(rank, request, requests[0]) for rank, request in enumerate(assign(requests, dp_size))]
    # A failed rank ends the wave at once: its peers would wait for it in a collective.
    done, pending = cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_EXCEPTION)
    missing = [rank for rank, f in enumerate(futures) if f in pending]
    failed = [rank for rank, f in enumerate(futures) if f in done and (f.cancelled() or f.exception() is not None)]
    if missing or failed:
        for f in pending:
            f.cancel()
        ids = [r.request_id for r in requests]
        log.error(
            "dp wave failed closed", missing_ranks=missing, failed_ranks=failed, requests=ids, timeout_s=timeout_s
        )
        if failed:
            first = futures[failed[0]]
            assert first is not None  # a failed rank was dispatched
            why = f"rank(s) {failed} failed: {'cancelled' if first.cancelled() else first.exception()}"
        else:
            why = f"rank(s) {missing} did not answer within {timeout_s:g} s"
        raise WaveFailed(f"DP wave failed: {why}")  # the request ids go to the log, not to batch-mates
    return [futures[rank].result() for rank in range(len(requests))]

"""DP waves: validation before dispatch, shadow ranks, fail-closed timeout."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from structlog.testing import capture_logs

from stagemesh.core.params import Params
from stagemesh.stage_service.engine.wave_rules import (
    WAVE_TIMEOUT_ENV,
    WaveFailed,
    WaveRejected,
    WaveRequest,
    run_wave,
    wave_timeout,
)


def _req(rid: str, **kw) -> WaveRequest:
    base = dict(prompt="a cat", width=256, height=256, num_inference_steps=8, guidance_scale=4.0, seed=1)
    fields = {**base, **kw}
    explicit = fields["num_inference_steps"] is not None  # None: left to the stage's default
    if not explicit:
        fields["num_inference_steps"] = base["num_inference_steps"]
    return WaveRequest(rid, Params(output_format="png", **fields), explicit)


def _answering(calls: list):
    def dispatch(rank, request, shape):
        calls.append((rank, request.request_id if request else None, shape.request_id))
        f = cf.Future()
        f.set_result(f"image-{request.request_id}" if request else "shadow")
        return f

    return dispatch


def test_a_valid_wave_runs_one_request_per_rank_and_shadows_the_rest():
    calls: list = []
    out = run_wave([_req("a"), _req("b", prompt="a dog")], 3, _answering(calls), timeout_s=5)
    assert out == ["image-a", "image-b"]
    assert calls == [(0, "a", "a"), (1, "b", "a"), (2, None, "a")]


@pytest.mark.parametrize(
    "second,field",
    [
        (dict(num_inference_steps=9), "num_inference_steps"),
        (dict(num_inference_steps=None), "num_inference_steps"),
        (dict(width=512), "width"),
        (dict(height=128), "height"),
        (dict(guidance_scale=1.0), "guidance_scale"),
        (dict(prompt="  "), "prompt"),
    ],
)
def test_an_invalid_wave_is_refused_before_any_dispatch_and_the_next_one_runs(second, field):
    calls: list = []
    with pytest.raises(WaveRejected) as err:
        run_wave([_req("a"), _req("b", **second)], 2, _answering(calls), timeout_s=5)
    assert err.value.field == field and "b" in str(err.value) and calls == []
    assert run_wave([_req("c"), _req("d")], 2, _answering(calls), timeout_s=5) == ["image-c", "image-d"]
    with pytest.raises(WaveRejected, match="1 to 2 requests"):
        run_wave([_req("x")] * 3, 2, _answering(calls))


def test_a_silent_rank_fails_the_whole_wave_within_the_timeout():
    def dispatch(rank, request, shape):
        f = cf.Future()
        if rank == 0:
            f.set_result("image")
        return f  # rank 1 never answers

    start = time.monotonic()
    with capture_logs() as logs, pytest.raises(WaveFailed, match=r"rank\(s\) \[1\] did not answer"):
        run_wave([_req("a"), _req("b")], 2, dispatch, timeout_s=0.2)
    assert time.monotonic() - start < 5
    assert any(e["event"] == "dp wave failed closed" for e in logs)


def test_a_failing_rank_fails_the_whole_wave():
    def dispatch(rank, request, shape):
        f = cf.Future()
        if rank == 1:
            f.set_exception(RuntimeError("boom"))
        else:
            f.set_result("ok")
        return f

    with pytest.raises(WaveFailed, match="boom"):
        run_wave([_req("a"), _req("b")], 2, dispatch, timeout_s=5)


def test_wave_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(WAVE_TIMEOUT_ENV, raising=False)
    assert wave_timeout() == 600.0
    monkeypatch.setenv(WAVE_TIMEOUT_ENV, "2.5")
    assert wave_timeout() == 2.5
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(WAVE_TIMEOUT_ENV, bad)
        assert wave_timeout() == 600.0

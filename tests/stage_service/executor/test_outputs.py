"""Async output rules 5, 6 and 8 (docs/ARCHITECTURE.md), the output registry (executor/outputs.py): outputs cached
until someone waits, futures resolved by delivery, batch splits in either order, discards, the
output timeout read from the environment at every wait, failures for one rank or all.

Real threads; no GPU, nothing faked.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
from structlog.testing import capture_logs

from stagemesh.core import errors
from stagemesh.stage_service.executor import outputs
from stagemesh.stage_service.executor.outputs import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    OutputRegistry,
    output_timeout,
)

STAGE = "stage 1 (diffusion)"
WAIT_S = 10.0


def oid(n: int) -> str:
    return f"{n:032x}"


# ---- point 8: the timeout variable ------------------------------------------------------------


def _warnings(logs, value):
    return [
        e
        for e in logs
        if e["event"] == "ignoring bad async output timeout" and e["value"] == value and e["log_level"] == "warning"
    ]


@pytest.mark.parametrize("raw, expected", [("1800", 1800.0), ("45.5", 45.5), ("0.25", 0.25), (" 30 ", 30.0)])
def test_timeout_env_valid_values(monkeypatch, raw, expected):
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with capture_logs() as logs:
        assert output_timeout() == expected
    assert not logs


def test_timeout_env_unset_is_the_default(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    with capture_logs() as logs:
        assert output_timeout() == DEFAULT_TIMEOUT_S == 600.0
    assert not logs


@pytest.mark.parametrize("raw", ["", "abc", "30s", "0", "-1", "nan", "inf", "-0.0"])
def test_timeout_env_bad_values_fall_back_with_one_warning_per_value(monkeypatch, raw):
    monkeypatch.setattr(outputs, "_warned_values", set())
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with capture_logs() as logs:
        assert output_timeout() == 600.0
        assert output_timeout() == 600.0
        assert output_timeout() == 600.0
    assert len(_warnings(logs, raw)) == 1, logs
    # Another bad value warns once more; the first one stays quiet.
    monkeypatch.setenv(TIMEOUT_ENV, raw + "x")
    with capture_logs() as logs:
        assert output_timeout() == 600.0
        monkeypatch.setenv(TIMEOUT_ENV, raw)
        assert output_timeout() == 600.0
    assert len(_warnings(logs, raw + "x")) == 1 and not _warnings(logs, raw)


def test_timeout_is_read_at_every_call_not_frozen_at_import(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "1800")
    assert output_timeout() == 1800.0
    monkeypatch.setenv(TIMEOUT_ENV, "45.5")
    assert output_timeout() == 45.5
    monkeypatch.delenv(TIMEOUT_ENV)
    assert output_timeout() == 600.0


def test_wait_output_ready_uses_the_env_timeout_at_each_wait(monkeypatch):
    reg = OutputRegistry(STAGE)
    monkeypatch.setenv(TIMEOUT_ENV, "0.05")
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable, match=r"not ready after 0\.05 s"):
        reg.wait_output_ready(oid(1))
    assert time.monotonic() - t0 < 5
    monkeypatch.setenv(TIMEOUT_ENV, "0.1")
    with pytest.raises(errors.Unavailable, match=r"not ready after 0\.1 s"):
        reg.wait_output_ready(oid(2))
    assert reg.is_empty()


def test_timeout_names_what_is_pending_and_a_late_output_leaves_nothing():
    reg = OutputRegistry(STAGE)
    for n in (1, 2, 3):
        reg.expect(oid(n), 0)
    reg.deliver(oid(2), ["cached"])  # arrived, nobody took it yet
    reg.split(oid(3), ["ka", "kb"])
    other = reg.future(oid(3) + "/ka")
    with capture_logs() as logs, pytest.raises(errors.Unavailable) as info:
        reg.wait_output_ready(oid(1), timeout_s=0.05)
    assert STAGE in str(info.value) and oid(1) in str(info.value)
    [event] = [e for e in logs if e["event"] == "async output timed out"]
    assert event["log_level"] == "error" and event["output_id"] == oid(1) and event["timeout_s"] == 0.05
    assert event["cached"] == [oid(2)]
    assert event["waiting"] == [oid(3) + "/ka"]
    assert event["splits"] == {oid(3): [oid(3) + "/ka", oid(3) + "/kb"]}
    # The late output of the timed-out request is dropped, not cached forever.
    reg.deliver(oid(1), ["late"])
    assert reg.wait_output_ready(oid(2), timeout_s=1) == ["cached"]
    reg.deliver(oid(3), ["a", "b"])
    assert other.result(1) == "a" and reg.future(oid(3) + "/kb").result(1) == "b"
    assert reg.is_empty()


# ---- points 5 and 6: the registry -----------------------------------------------------------------


def test_cached_output_is_handed_out_once_and_removed():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    reg.deliver(oid(1), ["x"])
    assert not reg.is_empty()
    assert reg.wait_output_ready(oid(1), timeout_s=1) == ["x"]
    assert reg.is_empty()


def test_waiting_future_is_resolved_by_delivery():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    fut = reg.future(oid(1))
    assert reg.future(oid(1)) is fut  # one future per output
    assert not fut.done()
    reg.deliver(oid(1), ["y"])
    assert fut.result(0) == ["y"] and reg.is_empty()


def test_wait_output_ready_blocks_until_another_thread_delivers():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    got = cf.Future()
    t = threading.Thread(target=lambda: got.set_result(reg.wait_output_ready(oid(1), timeout_s=WAIT_S)))
    t.start()
    while not reg.pending_summary()["waiting"]:  # the waiter has registered
        time.sleep(0.001)
    reg.deliver(oid(1), ["z"])
    assert got.result(WAIT_S) == ["z"]
    t.join()
    assert reg.is_empty()


def test_error_delivery_reaches_the_waiter_and_the_late_waiter():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    reg.expect(oid(2), 0)
    fut = reg.future(oid(1))
    reg.deliver(oid(1), exc=errors.StagemeshError("boom1"))
    reg.deliver(oid(2), exc=errors.StagemeshError("boom2"))
    with pytest.raises(errors.StagemeshError, match="boom1"):
        fut.result(0)
    with pytest.raises(errors.StagemeshError, match="boom2"):
        reg.wait_output_ready(oid(2), timeout_s=1)
    assert reg.is_empty()


def test_split_registered_before_the_output_arrives():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    subs = reg.split(oid(1), ["k0", "k1", "k2"])
    assert subs == [f"{oid(1)}/k0", f"{oid(1)}/k1", f"{oid(1)}/k2"]
    futs = [reg.future(s) for s in subs[:2]]
    reg.deliver(oid(1), ["r0", "r1", "r2"])
    assert [f.result(0) for f in futs] == ["r0", "r1"]
    assert reg.wait_output_ready(subs[2], timeout_s=1) == "r2"  # resolved into the cache, taken once
    assert reg.is_empty()


def test_split_registered_after_the_output_arrived():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    reg.deliver(oid(1), ["r0", "r1"])  # OUTPUT_READY before the engine registered the split
    subs = reg.split(oid(1), ["a", "b"])
    assert reg.pending_summary()["splits"] == {}
    assert reg.future(subs[1]).result(0) == "r1"
    assert reg.future(subs[0]).result(0) == "r0"
    assert reg.is_empty()


@pytest.mark.parametrize("split_first", [True, False])
def test_failed_batch_output_fails_every_request(split_first):
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    if split_first:
        subs = reg.split(oid(1), ["a", "b"])
        reg.deliver(oid(1), exc=errors.StagemeshError("packing failed"))
    else:
        reg.deliver(oid(1), exc=errors.StagemeshError("packing failed"))
        subs = reg.split(oid(1), ["a", "b"])
    for s in subs:
        with pytest.raises(errors.StagemeshError, match="packing failed"):
            reg.future(s).result(0)
    assert reg.is_empty()


def test_discard_before_and_after_delivery_leaves_nothing():
    reg = OutputRegistry(STAGE)
    for n in (1, 2, 3):
        reg.expect(oid(n), 0)
    fut = reg.future(oid(1))
    reg.discard(oid(1))  # the request went away while its output was on its way
    assert fut.cancelled()
    reg.deliver(oid(1), ["dropped"])
    reg.deliver(oid(2), ["cached"])
    reg.discard(oid(2))  # ... or after it arrived
    subs = reg.split(oid(3), ["a", "b"])
    reg.discard(subs[0])  # one request of a batch went away
    fut_b = reg.future(subs[1])
    reg.deliver(oid(3), ["ra", "rb"])
    assert fut_b.result(0) == "rb"
    assert reg.is_empty(), reg.pending_summary()


def test_fail_rank_fails_only_that_ranks_outputs_and_leaves_nothing():
    reg = OutputRegistry(STAGE)
    dead = errors.Unavailable(f"{STAGE} worker 0 died (exit code -9)")
    reg.expect(oid(1), 0)  # single, waited for
    reg.expect(oid(2), 0)  # batch, split registered, both waited for
    reg.expect(oid(3), 0)  # batch, split registered, one request discarded
    reg.expect(oid(4), 0)  # COMPUTE_DONE seen, split not registered yet
    reg.expect(oid(5), 1)  # another rank
    f1 = reg.future(oid(1))
    subs2 = reg.split(oid(2), ["a", "b"])
    f2 = [reg.future(s) for s in subs2]
    subs3 = reg.split(oid(3), ["a", "b"])
    reg.discard(subs3[0])
    f3 = reg.future(subs3[1])
    f5 = reg.future(oid(5))
    reg.fail_rank(0, dead)
    for f in [f1, *f2, f3]:
        assert isinstance(f.exception(0), errors.Unavailable) and "stage" in str(f.exception(0))
    assert not f5.done()
    # The batch whose split was not registered yet fails through its split.
    subs4 = reg.split(oid(4), ["a"])
    with pytest.raises(errors.Unavailable):
        reg.future(subs4[0]).result(0)
    reg.deliver(oid(5), ["ok"])
    assert f5.result(0) == ["ok"]
    assert reg.is_empty(), reg.pending_summary()


def test_fail_all_fails_waiters_and_clears_every_map():
    reg = OutputRegistry(STAGE)
    reg.expect(oid(1), 0)
    reg.expect(oid(2), 1)
    f1 = reg.future(oid(1))
    reg.split(oid(2), ["a"])
    f2 = reg.future(f"{oid(2)}/a")
    reg.expect(oid(3), 0)
    reg.deliver(oid(3), ["cached"])
    reg.fail_all(errors.Unavailable(f"{STAGE}: executor shut down"))
    for f in (f1, f2):
        with pytest.raises(errors.Unavailable, match="executor shut down"):
            f.result(0)
    assert reg.is_empty()


def test_concurrent_cancellation_while_delivering_never_raises_and_leaves_nothing():
    reg = OutputRegistry(STAGE)
    n = 300
    futs = []
    for i in range(n):
        reg.expect(oid(i), i % 2)
        futs.append(reg.future(oid(i)))
    start = threading.Barrier(2)
    errors_seen: list[BaseException] = []

    def deliver():
        start.wait()
        try:
            for i in range(n):
                reg.deliver(oid(i), [i])
        except BaseException as exc:  # noqa: BLE001 - collected; the test asserts there is none
            errors_seen.append(exc)

    def cancel():
        start.wait()
        for i in range(0, n, 2):
            futs[i].cancel()

    threads = [threading.Thread(target=deliver), threading.Thread(target=cancel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors_seen
    assert all(f.done() for f in futs)
    assert all(f.result(0) == [i] for i, f in enumerate(futs) if not f.cancelled())
    assert reg.is_empty()

"""Sleep and wake through a real mesh (`stagemesh up`) with the generated stubs: the rows of the
reference behaviour table (vLLM-Omni /v1/omni/sleep and /wakeup, section 6.2) for a mesh whose
stages can sleep — sleep with the default level, empty ids, the sleeping set updated; wake,
skipped when not sleeping or naming no stage, partial, removing only the requested ids, round
trip — then sleep under a stream of generates, and a clean stop (of the mesh these modules share,
at the end of the session: tests/e2e/conftest.py). The same rows through the CLI and grpcurl, and a mesh without
sleep support, are in tests/e2e/test_sleep_wake_clients.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from stagemesh.v1 import gateway_pb2

# The mesh fixtures are found by name: importing them here is how this module uses them.
from tests.support.sleep_mesh import (  # noqa: F401
    BIG,
    NOT_SLEEPING,
    RPC_TIMEOUT_S,
    SERVING,
    SKIPPED,
    SLEEPING,
    SMALL,
    SUCCESS,
    assert_acks,
    assert_all_serving,
    awake_and_open,
    channel,
    field_violations,
    generate,
    list_stages,
    put_to_sleep,
    reference,
    refused,
    resume,
    rpc_done,
    stage_calls,
    states,
    stub,
    wake_up,
)

pytestmark = pytest.mark.mesh


# ---- sleep ----------------------------------------------------------------------------------------
def test_sleep_defaults_to_level_2_acks_every_worker_and_updates_the_sleeping_set(stub):
    reply = put_to_sleep(stub, [0, 1])  # no level: the default, 2
    assert reply.status == SUCCESS
    assert_acks(reply.acks, [0, 1], level=2)
    listing = list_stages(stub)
    assert [(s.stage_id, s.state, s.sleep_level) for s in listing.stages] == [(0, SLEEPING, 2), (1, SLEEPING, 2)]
    assert listing.generation_paused


def test_sleep_with_no_stage_ids_is_refused_and_puts_nothing_to_sleep(stub, sleepy, reference):
    calls = stage_calls(sleepy, "SleepStage")
    error = refused(lambda: put_to_sleep(stub, [], level=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "stage_ids" in field_violations(error)
    assert stage_calls(sleepy, "SleepStage") == calls
    assert_all_serving(stub)  # admission untouched, too
    assert generate(stub) == reference


@pytest.mark.parametrize(
    "method, request_, fields",
    [
        ("Sleep", gateway_pb2.SleepRequest(stage_ids=[2]), {"stage_ids"}),
        ("Sleep", gateway_pb2.SleepRequest(stage_ids=[0, -1], level=1), {"stage_ids"}),
        ("Sleep", gateway_pb2.SleepRequest(stage_ids=[1], level=3), {"level"}),
        ("Sleep", gateway_pb2.SleepRequest(stage_ids=[1], level=0), {"level"}),
        ("Sleep", gateway_pb2.SleepRequest(stage_ids=[5], level=3), {"stage_ids", "level"}),
        ("WakeUp", gateway_pb2.WakeUpRequest(stage_ids=[0, 9]), {"stage_ids"}),
    ],
    ids=["sleep-unknown-id", "sleep-negative-id", "level-3", "level-0", "both", "wake-unknown-id"],
)
def test_bad_arguments_are_invalid_argument_and_leave_admission_open(stub, sleepy, reference, method, request_, fields):
    calls = stage_calls(sleepy, "SleepStage") + stage_calls(sleepy, "WakeUpStage")
    exc = refused(lambda: getattr(stub, method)(request_, timeout=RPC_TIMEOUT_S))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    violations = field_violations(exc)
    assert set(violations) == fields, violations
    if "stage_ids" in fields:
        assert "0 to 1" in violations["stage_ids"], violations  # the valid range
    if "level" in fields:
        assert "1 or 2" in violations["level"], violations
    assert_all_serving(stub)  # generation_paused is false, nothing sleeps
    assert stage_calls(sleepy, "SleepStage") + stage_calls(sleepy, "WakeUpStage") == calls
    assert generate(stub) == reference


def test_generate_during_sleep_fails_at_once_naming_the_stage(stub):
    assert put_to_sleep(stub, [1], level=1).status == SUCCESS
    events = []

    def stream():
        events.extend(stub.Generate(gateway_pb2.GenerateRequest(params=SMALL), timeout=RPC_TIMEOUT_S))

    for call in (stream, lambda: generate(stub)):
        started = time.monotonic()
        exc = refused(call)
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        assert "stage 1" in exc.details() and "asleep" in exc.details(), exc.details()
        assert time.monotonic() - started < 5.0  # refused at admission, not after a stage timed out
    assert events == []  # not even a stage_started event: nothing was admitted


# ---- wake -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
def test_round_trip_gives_the_same_png_and_the_ar_pipeline_stays_paused_until_resume(stub, reference, level):
    assert put_to_sleep(stub, [0, 1], level=level).status == SUCCESS
    reply = wake_up(stub, [0, 1])
    assert reply.status == SUCCESS and reply.reason == ""
    assert_acks(reply.acks, [0, 1], level=level)  # the level each stage woke from
    listing = list_stages(stub)
    assert [(s.state, s.sleep_level) for s in listing.stages] == [(SERVING, 0), (SERVING, 0)]
    assert listing.generation_paused  # an AR pipeline waits for ResumeGeneration
    exc = refused(lambda: generate(stub))
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "paused" in exc.details(), exc
    resume(stub)
    assert not list_stages(stub).generation_paused
    assert generate(stub) == reference  # byte-identical to before the sleep


def test_wake_when_not_sleeping_is_skipped_and_calls_no_stage(stub, sleepy):
    calls = stage_calls(sleepy, "WakeUpStage")
    for stage_ids in ([0, 1], [1], [1, 1]):
        reply = wake_up(stub, stage_ids)
        assert (reply.status, reply.reason, list(reply.acks)) == (SKIPPED, NOT_SLEEPING, [])
    # A stage logs `rpc done` before it answers, so a call would already be in the log.
    assert stage_calls(sleepy, "WakeUpStage") == calls
    assert_all_serving(stub)
    # The counter does see real calls: one per woken stage.
    put_to_sleep(stub, [1], level=1)
    wake_up(stub, [1])
    assert rpc_done(sleepy, "WakeUpStage").get("stage-1", 0) >= 1
    assert stage_calls(sleepy, "WakeUpStage") == calls + 1


def test_wake_with_no_stage_ids_is_skipped_and_wakes_nothing(stub, sleepy):
    put_to_sleep(stub, [1], level=1)
    calls = stage_calls(sleepy, "WakeUpStage")
    reply = wake_up(stub, [])
    assert (reply.status, reply.reason, list(reply.acks)) == (SKIPPED, NOT_SLEEPING, [])
    assert stage_calls(sleepy, "WakeUpStage") == calls
    assert states(stub)[1] == (SLEEPING, 1)


def test_partial_wake_wakes_only_the_sleeping_stage(stub, sleepy):
    assert put_to_sleep(stub, [1], level=1).status == SUCCESS
    assert states(stub) == {0: (SERVING, 0), 1: (SLEEPING, 1)}
    calls = rpc_done(sleepy, "WakeUpStage")
    reply = wake_up(stub, [0, 1])
    assert reply.status == SUCCESS
    assert_acks(reply.acks, [1], level=1)  # no ACK for stage 0: it was not called
    after = rpc_done(sleepy, "WakeUpStage")
    assert after.get("stage-0", 0) == calls.get("stage-0", 0)
    assert after.get("stage-1", 0) == calls.get("stage-1", 0) + 1
    assert states(stub) == {0: (SERVING, 0), 1: (SERVING, 0)}


def test_wake_removes_only_the_requested_ids(stub, reference):
    assert put_to_sleep(stub, [0, 1], level=1).status == SUCCESS
    reply = wake_up(stub, [1])
    assert reply.status == SUCCESS
    assert_acks(reply.acks, [1], level=1)
    assert states(stub) == {0: (SLEEPING, 1), 1: (SERVING, 0)}
    resume(stub)  # resuming does not wake anything: stage 0 still refuses
    exc = refused(lambda: generate(stub))
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "stage 0" in exc.details(), exc
    reply = wake_up(stub, [0])
    assert reply.status == SUCCESS
    assert_acks(reply.acks, [0], level=1)
    resume(stub)
    assert generate(stub) == reference


def test_duplicate_wake_is_harmless(stub, reference):
    put_to_sleep(stub, [1], level=2)
    first = wake_up(stub, [1, 1])
    assert first.status == SUCCESS
    assert_acks(first.acks, [1], level=2)  # one ACK, not two
    again = wake_up(stub, [1])
    assert (again.status, again.reason, list(again.acks)) == (SKIPPED, NOT_SLEEPING, [])
    resume(stub)
    assert generate(stub) == reference


def test_sleeping_deeper_then_waking_reloads(stub, reference):
    """Level 1, then level 2 on top (drops the host copy): the stage reports the deeper level and
    wakes from it by reloading the checkpoint."""
    put_to_sleep(stub, [1], level=1)
    deeper = put_to_sleep(stub, [1], level=2)
    assert deeper.status == SUCCESS and [a.level for a in deeper.acks] == [2]
    assert states(stub)[1] == (SLEEPING, 2)
    woken = wake_up(stub, [1])
    assert [a.level for a in woken.acks] == [2]
    resume(stub)
    assert generate(stub) == reference


# ---- sleep and generate at the same time ---------------------------------------------------------
@pytest.mark.parametrize("trigger", ["stage_started", "denoising_step"])
def test_sleep_waits_for_a_generate_being_admitted_or_in_flight(stub, trigger):
    """`stage_started` (of stage 0): the call is between admission and submission, the window a
    Sleep must wait for. `denoising_step`: stage 1 is running it, and a sleeping stage first lets
    its running batch finish."""
    reached = threading.Event()
    outcome: dict = {}

    def run():
        try:
            for event in stub.Generate(gateway_pb2.GenerateRequest(params=BIG), timeout=RPC_TIMEOUT_S):
                which = event.WhichOneof("event")
                if which == trigger:
                    reached.set()
                if which == "result":
                    outcome["png"] = event.result.png
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["code"], outcome["details"] = exc.code(), exc.details()
        finally:
            reached.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert reached.wait(RPC_TIMEOUT_S)
        assert "code" not in outcome, outcome  # still running when the Sleep goes out
        reply = put_to_sleep(stub, [0, 1])
    finally:
        thread.join(RPC_TIMEOUT_S)
    assert reply.status == SUCCESS
    assert_acks(reply.acks, [0, 1], level=2)
    if trigger == "denoising_step":
        assert outcome["code"] == grpc.StatusCode.OK, outcome
    else:
        assert outcome["code"] in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), outcome
        if outcome["code"] != grpc.StatusCode.OK:
            assert "asleep" in outcome["details"], outcome
    if outcome["code"] == grpc.StatusCode.OK:
        wake_up(stub, [0, 1])
        resume(stub)
        assert generate(stub, BIG) == outcome["png"]  # and the woken stages draw it the same


def test_twenty_cycles_under_a_stream_of_generates_lose_no_request(stub, reference):
    cond = threading.Condition()
    state = {"resumes": 0, "ok": 0, "ok_at_resume": 0, "stop": False}
    outcomes: list[tuple] = []

    def client(params):
        while True:
            with cond:
                if state["stop"]:
                    return
                seen = state["resumes"]
            try:
                png = generate(stub, params)
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    return  # asserted below
                with cond:  # refused: wait for the next ResumeGeneration, not a busy loop
                    cond.wait_for(lambda seen=seen: state["stop"] or state["resumes"] > seen, RPC_TIMEOUT_S)
                continue
            outcomes.append((grpc.StatusCode.OK, png))
            with cond:
                state["ok"] += 1
                cond.notify_all()

    threads = [threading.Thread(target=client, args=(SMALL,)) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for cycle in range(20):
            level = 1 + cycle % 2
            with cond:  # let at least one Generate through since the last resume: calls really overlap
                assert cond.wait_for(
                    lambda: state["ok"] > state["ok_at_resume"] or not any(t.is_alive() for t in threads), RPC_TIMEOUT_S
                )
            assert any(t.is_alive() for t in threads), outcomes[-3:]
            slept = put_to_sleep(stub, [0, 1], level=level)
            assert slept.status == SUCCESS, slept
            assert_acks(slept.acks, [0, 1], level)
            woken = wake_up(stub, [0, 1])
            assert woken.status == SUCCESS, woken
            assert_acks(woken.acks, [0, 1], level)
            resume(stub)
            with cond:
                state["resumes"] += 1
                state["ok_at_resume"] = state["ok"]
                cond.notify_all()
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        for t in threads:
            t.join(RPC_TIMEOUT_S)
    codes = [code for code, _ in outcomes]
    unexpected = [o for o in outcomes if o[0] not in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION)]
    assert not unexpected, unexpected
    assert codes.count(grpc.StatusCode.OK) >= 20
    for code, payload in outcomes:
        if code == grpc.StatusCode.OK:
            assert payload == reference
        else:
            assert "asleep" in payload or "paused" in payload, payload
    assert generate(stub) == reference

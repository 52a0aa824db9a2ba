"""Sleep and wake through a real mesh (`stagemesh up`: cache, ar stage, diffusion stage, gateway),
with the generated stubs, grpcurl and the CLI.

Sleep mutates the mesh, so this module runs its own meshes and never the shared session one:
`sleepy` (both stages can sleep) and, for the "cannot sleep" row, `sleepless` (enable_sleep =
false). Every test leaves `sleepy` awake with generation open (the `awake_and_open` fixture).

Rows of the reference behaviour table (vLLM-Omni /v1/omni/sleep and /wakeup, section 6.2):
sleep success with default level, empty ids, sleeping set updated, not supported (501 there,
UNIMPLEMENTED here); wake success, skipped when not sleeping, partial, empty, removes only the
requested ids, round trip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stagemesh import cli
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2
from tests.meshproc import (
    REPO,
    Mesh,
    descendants,
    shm_entries,
    start_mesh,
    write_config,
)

SMALL = generation_pb2.GenerationParams(prompt="a small boat", width=64, height=48, num_inference_steps=2, seed=7)
# Big enough that its image (512*512*3 float32 = 3 MB) travels through shared memory, long enough
# (12 denoising steps) that a Sleep can arrive while it runs.
BIG = generation_pb2.GenerationParams(prompt="a long walk", width=512, height=512, num_inference_steps=12, seed=9)
SUCCESS = control_pb2.CONTROL_STATUS_SUCCESS
SKIPPED = control_pb2.CONTROL_STATUS_SKIPPED
ACK_SUCCESS = control_pb2.ACK_STATUS_SUCCESS
SERVING = gateway_pb2.STAGE_STATE_SERVING
SLEEPING = gateway_pb2.STAGE_STATE_SLEEPING
NOT_SLEEPING = "target stages are not sleeping"
RPC_TIMEOUT_S = 60.0
GRPCURL = shutil.which("grpcurl")
GATEWAY = "stagemesh.v1.GatewayService"
needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary on PATH")


# ---- meshes ---------------------------------------------------------------------------------------
def _owned_segments(pids: set[int]) -> set[str]:
    """/dev/shm segments of these processes: `stagemesh-<owner pid>-<rank>-...`. Other meshes (other
    test runs on this machine) have segments of their own; only ours count."""
    return {e for e in shm_entries() if e.startswith("stagemesh-") and e.split("-")[1] in {str(p) for p in pids}}


def _stopped_cleanly(mesh: Mesh, pids: set[int]) -> None:
    code = mesh.stop()
    assert code == 0, mesh.logs()[-3000:]
    leaked = _owned_segments(pids)
    assert not leaked, f"shared-memory segments left behind: {leaked}"


def _start(root, model_dir, extra_stage: str = "") -> Mesh:
    mesh = start_mesh(write_config(root / "mesh.toml", model_dir, extra_stage=extra_stage), root / "mesh.log")
    mesh.pids = {mesh.process.pid, *descendants(mesh.process.pid)}  # services and their workers
    assert len(mesh.pids) >= 1 + 4, mesh.pids  # supervisor, cache, 2 stages (+ workers), gateway
    return mesh


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory, model_dir):
    mesh = _start(tmp_path_factory.mktemp("sleepy"), model_dir)
    yield mesh
    if mesh.process.poll() is None:  # test_zz_... stops it; this covers runs that deselect it
        _stopped_cleanly(mesh, mesh.pids)


@pytest.fixture(scope="module")
def sleepless(tmp_path_factory, model_dir):
    mesh = _start(tmp_path_factory.mktemp("sleepless"), model_dir, extra_stage="enable_sleep = false")
    yield mesh
    _stopped_cleanly(mesh, mesh.pids)


@pytest.fixture(scope="module")
def channel(sleepy):
    with sleepy.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(sleepy, channel):
    return sleepy.gateway(channel)


@pytest.fixture(scope="module")
def reference(stub) -> bytes:
    """SMALL's PNG before anything in this module slept."""
    return _generate(stub, SMALL)


@pytest.fixture(autouse=True)
def awake_and_open(request):
    """Start each test from (and return the mesh to) all stages awake, generation open."""
    if "stub" not in request.fixturenames:
        yield
        return
    stub = request.getfixturevalue("stub")
    request.getfixturevalue("reference")  # taken before the first test can put anything to sleep
    yield
    if request.getfixturevalue("sleepy").process.poll() is not None:
        return
    stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=RPC_TIMEOUT_S)
    stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)
    _assert_all_serving(stub)


# ---- helpers --------------------------------------------------------------------------------------
def _generate(stub, params=SMALL) -> bytes:
    reply = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S)
    assert reply.result.png.startswith(b"\x89PNG")
    return reply.result.png


def _sleep(stub, stage_ids, level=None) -> gateway_pb2.SleepResponse:
    request = gateway_pb2.SleepRequest(stage_ids=stage_ids)
    if level is not None:
        request.level = level
    return stub.Sleep(request, timeout=RPC_TIMEOUT_S)


def _wake(stub, stage_ids) -> gateway_pb2.WakeUpResponse:
    return stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=stage_ids), timeout=RPC_TIMEOUT_S)


def _resume(stub) -> None:
    stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)


def _list(stub) -> gateway_pb2.ListStagesResponse:
    return stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S)


def _states(stub) -> dict[int, tuple[int, int]]:
    return {s.stage_id: (s.state, s.sleep_level) for s in _list(stub).stages}


def _assert_all_serving(stub) -> None:
    listing = _list(stub)
    assert [(s.stage_id, s.state, s.sleep_level) for s in listing.stages] == [(0, SERVING, 0), (1, SERVING, 0)]
    assert not listing.generation_paused


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def _violations(exc: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(exc)
    assert status is not None, "no google.rpc.Status in the trailers"
    out = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.update({v.field: v.description for v in bad.field_violations})
    return out


def _assert_acks(acks, stage_ids, level) -> None:
    assert sorted((a.stage_id, a.rank) for a in acks) == [(i, 0) for i in sorted(stage_ids)]  # one worker each
    for ack in acks:
        assert ack.status == ACK_SUCCESS and ack.error == "", ack
        assert ack.level == level, ack
        assert ack.freed_bytes > 0, ack  # measured: storage released (CPU) / device memory (GPU)
        assert ack.latency_ms >= 0, ack


def _rpc_done(mesh: Mesh, method: str) -> dict[str, int]:
    """How often each service logged `rpc done` for `method` (stage log lines are JSON)."""
    counts: dict[str, int] = {}
    for line in mesh.logs().splitlines():
        if method not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "rpc done" and entry.get("method") == method:
            counts[entry.get("service", "?")] = counts.get(entry.get("service", "?"), 0) + 1
    return counts


def _stage_calls(mesh: Mesh, method: str) -> int:
    return sum(n for service, n in _rpc_done(mesh, method).items() if service.startswith("stage"))


# ---- sleep ----------------------------------------------------------------------------------------
def test_sleep_defaults_to_level_2_acks_every_worker_and_updates_the_sleeping_set(stub):
    reply = _sleep(stub, [0, 1])  # no level: the default, 2
    assert reply.status == SUCCESS
    _assert_acks(reply.acks, [0, 1], level=2)
    listing = _list(stub)
    assert [(s.stage_id, s.state, s.sleep_level) for s in listing.stages] == [(0, SLEEPING, 2), (1, SLEEPING, 2)]
    assert listing.generation_paused


def test_sleep_with_no_stage_ids_succeeds_and_puts_nothing_to_sleep(stub, sleepy, reference):
    calls = _stage_calls(sleepy, "SleepStage")
    reply = _sleep(stub, [], level=2)
    assert reply.status == SUCCESS and list(reply.acks) == []
    assert _stage_calls(sleepy, "SleepStage") == calls
    _assert_all_serving(stub)  # admission untouched, too
    assert _generate(stub) == reference


def test_sleep_of_a_stage_without_sleep_support_is_unimplemented(sleepless):
    with sleepless.channel() as ch:
        stub = sleepless.gateway(ch)
        for stage_ids, named in (([1], "stage 1"), ([0, 1], "stage 0")):
            exc = _refused(lambda ids=stage_ids: _sleep(stub, ids, level=1))
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED, exc
            assert named in exc.details() and "sleep" in exc.details(), exc.details()
        listing = _list(stub)
        assert [(s.state, s.sleep_level) for s in listing.stages] == [(SERVING, 0), (SERVING, 0)]
        assert not listing.generation_paused  # refused before admission was closed
        assert _stage_calls(sleepless, "SleepStage") == 0  # refused at the gateway
        _generate(stub)
        reply = _wake(stub, [0, 1])
        assert (reply.status, reply.reason, list(reply.acks)) == (SKIPPED, NOT_SLEEPING, [])


@pytest.mark.parametrize("method, request_, fields", [
    ("Sleep", gateway_pb2.SleepRequest(stage_ids=[2]), {"stage_ids"}),
    ("Sleep", gateway_pb2.SleepRequest(stage_ids=[0, -1], level=1), {"stage_ids"}),
    ("Sleep", gateway_pb2.SleepRequest(stage_ids=[1], level=3), {"level"}),
    ("Sleep", gateway_pb2.SleepRequest(stage_ids=[1], level=0), {"level"}),
    ("Sleep", gateway_pb2.SleepRequest(stage_ids=[5], level=3), {"stage_ids", "level"}),
    ("WakeUp", gateway_pb2.WakeUpRequest(stage_ids=[0, 9]), {"stage_ids"}),
], ids=["sleep-unknown-id", "sleep-negative-id", "level-3", "level-0", "both", "wake-unknown-id"])
def test_bad_arguments_are_invalid_argument_and_leave_admission_open(stub, sleepy, reference, method, request_, fields):
    calls = _stage_calls(sleepy, "SleepStage") + _stage_calls(sleepy, "WakeUpStage")
    exc = _refused(lambda: getattr(stub, method)(request_, timeout=RPC_TIMEOUT_S))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    violations = _violations(exc)
    assert set(violations) == fields, violations
    if "stage_ids" in fields:
        assert "0 to 1" in violations["stage_ids"], violations  # the valid range
    if "level" in fields:
        assert "1 or 2" in violations["level"], violations
    _assert_all_serving(stub)  # generation_paused is false, nothing sleeps
    assert _stage_calls(sleepy, "SleepStage") + _stage_calls(sleepy, "WakeUpStage") == calls
    assert _generate(stub) == reference


def test_generate_during_sleep_fails_at_once_naming_the_stage(stub):
    assert _sleep(stub, [1], level=1).status == SUCCESS
    events = []

    def stream():
        events.extend(stub.Generate(gateway_pb2.GenerateRequest(params=SMALL), timeout=RPC_TIMEOUT_S))

    for call in (stream, lambda: _generate(stub)):
        started = time.monotonic()
        exc = _refused(call)
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        assert "stage 1" in exc.details() and "asleep" in exc.details(), exc.details()
        assert time.monotonic() - started < 5.0  # refused at admission, not after a stage timed out
    assert events == []  # not even a stage_started event: nothing was admitted


# ---- wake -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
def test_round_trip_gives_the_same_png_and_the_ar_pipeline_stays_paused_until_resume(stub, reference, level):
    assert _sleep(stub, [0, 1], level=level).status == SUCCESS
    reply = _wake(stub, [0, 1])
    assert reply.status == SUCCESS and reply.reason == ""
    _assert_acks(reply.acks, [0, 1], level=level)  # the level each stage woke from
    listing = _list(stub)
    assert [(s.state, s.sleep_level) for s in listing.stages] == [(SERVING, 0), (SERVING, 0)]
    assert listing.generation_paused  # an AR pipeline waits for ResumeGeneration
    exc = _refused(lambda: _generate(stub))
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "paused" in exc.details(), exc
    _resume(stub)
    assert not _list(stub).generation_paused
    assert _generate(stub) == reference  # byte-identical to before the sleep


def test_wake_when_not_sleeping_is_skipped_and_calls_no_stage(stub, sleepy):
    calls = _stage_calls(sleepy, "WakeUpStage")
    for stage_ids in ([0, 1], [1], [1, 1]):
        reply = _wake(stub, stage_ids)
        assert (reply.status, reply.reason, list(reply.acks)) == (SKIPPED, NOT_SLEEPING, [])
    # A stage logs `rpc done` before it answers, so a call would already be in the log.
    assert _stage_calls(sleepy, "WakeUpStage") == calls
    _assert_all_serving(stub)
    # The counter does see real calls: one per woken stage.
    _sleep(stub, [1], level=1)
    _wake(stub, [1])
    assert _rpc_done(sleepy, "WakeUpStage").get("stage-1", 0) >= 1
    assert _stage_calls(sleepy, "WakeUpStage") == calls + 1


def test_wake_with_no_stage_ids_is_skipped_and_wakes_nothing(stub, sleepy):
    _sleep(stub, [1], level=1)
    calls = _stage_calls(sleepy, "WakeUpStage")
    reply = _wake(stub, [])
    assert (reply.status, reply.reason, list(reply.acks)) == (SKIPPED, NOT_SLEEPING, [])
    assert _stage_calls(sleepy, "WakeUpStage") == calls
    assert _states(stub)[1] == (SLEEPING, 1)


def test_partial_wake_wakes_only_the_sleeping_stage(stub, sleepy):
    assert _sleep(stub, [1], level=1).status == SUCCESS
    assert _states(stub) == {0: (SERVING, 0), 1: (SLEEPING, 1)}
    calls = _rpc_done(sleepy, "WakeUpStage")
    reply = _wake(stub, [0, 1])
    assert reply.status == SUCCESS
    _assert_acks(reply.acks, [1], level=1)  # no ACK for stage 0: it was not called
    after = _rpc_done(sleepy, "WakeUpStage")
    assert after.get("stage-0", 0) == calls.get("stage-0", 0)
    assert after.get("stage-1", 0) == calls.get("stage-1", 0) + 1
    assert _states(stub) == {0: (SERVING, 0), 1: (SERVING, 0)}


def test_wake_removes_only_the_requested_ids(stub, reference):
    assert _sleep(stub, [0, 1], level=1).status == SUCCESS
    reply = _wake(stub, [1])
    assert reply.status == SUCCESS
    _assert_acks(reply.acks, [1], level=1)
    assert _states(stub) == {0: (SLEEPING, 1), 1: (SERVING, 0)}
    _resume(stub)  # resuming does not wake anything: stage 0 still refuses
    exc = _refused(lambda: _generate(stub))
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "stage 0" in exc.details(), exc
    reply = _wake(stub, [0])
    assert reply.status == SUCCESS
    _assert_acks(reply.acks, [0], level=1)
    _resume(stub)
    assert _generate(stub) == reference


def test_duplicate_wake_is_harmless(stub, reference):
    _sleep(stub, [1], level=2)
    first = _wake(stub, [1, 1])
    assert first.status == SUCCESS
    _assert_acks(first.acks, [1], level=2)  # one ACK, not two
    again = _wake(stub, [1])
    assert (again.status, again.reason, list(again.acks)) == (SKIPPED, NOT_SLEEPING, [])
    _resume(stub)
    assert _generate(stub) == reference


def test_sleeping_deeper_then_waking_reloads(stub, reference):
    """Level 1, then level 2 on top (drops the host copy): the stage reports the deeper level and
    wakes from it by reloading the checkpoint."""
    _sleep(stub, [1], level=1)
    deeper = _sleep(stub, [1], level=2)
    assert deeper.status == SUCCESS and [a.level for a in deeper.acks] == [2]
    assert _states(stub)[1] == (SLEEPING, 2)
    woken = _wake(stub, [1])
    assert [a.level for a in woken.acks] == [2]
    _resume(stub)
    assert _generate(stub) == reference


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
        reply = _sleep(stub, [0, 1])
    finally:
        thread.join(RPC_TIMEOUT_S)
    assert reply.status == SUCCESS
    _assert_acks(reply.acks, [0, 1], level=2)
    if trigger == "denoising_step":
        assert outcome["code"] == grpc.StatusCode.OK, outcome
    else:
        assert outcome["code"] in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), outcome
        if outcome["code"] != grpc.StatusCode.OK:
            assert "asleep" in outcome["details"], outcome
    if outcome["code"] == grpc.StatusCode.OK:
        _wake(stub, [0, 1])
        _resume(stub)
        assert _generate(stub, BIG) == outcome["png"]  # and the woken stages draw it the same


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
                png = _generate(stub, params)
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
                assert cond.wait_for(lambda: state["ok"] > state["ok_at_resume"]
                                     or not any(t.is_alive() for t in threads), RPC_TIMEOUT_S)
            assert any(t.is_alive() for t in threads), outcomes[-3:]
            slept = _sleep(stub, [0, 1], level=level)
            assert slept.status == SUCCESS, slept
            _assert_acks(slept.acks, [0, 1], level)
            woken = _wake(stub, [0, 1])
            assert woken.status == SUCCESS, woken
            _assert_acks(woken.acks, [0, 1], level)
            _resume(stub)
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
    assert _generate(stub) == reference


# ---- CLI ------------------------------------------------------------------------------------------
def _cli_process(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagemesh", *argv], cwd=REPO, check=False, capture_output=True, text=True,
                          timeout=RPC_TIMEOUT_S)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    """The same entry point in this process (it imports torch: 3 s per process on 2 cores)."""
    capsys.readouterr()
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_cli_sleep_status_wakeup_pause_resume(stub, sleepy, capsys, reference):
    a = ("--address", sleepy.address)
    done = _cli_process("sleep", *a, "--stage", "1", "--level", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "SUCCESS", done.stdout
    assert lines[1].strip().startswith("stage 1 rank 0: SUCCESS level 1"), done.stdout
    assert _states(stub)[1] == (SLEEPING, 1)

    done = _cli_process("status", *a)
    assert done.returncode == 0, done.stderr
    stage_1 = next(line for line in done.stdout.splitlines() if line.split()[:2] == ["1", "diffusion"])
    assert "sleeping" in stage_1 and "(sleep level 1)" in stage_1, done.stdout
    assert "generation: paused" in done.stdout

    code, out = _cli(capsys, "wakeup", *a, "--stage", "1")
    assert code == 0 and out.splitlines()[0] == "SUCCESS", out
    assert "stage 1 rank 0: SUCCESS level 1" in out
    code, out = _cli(capsys, "wakeup", *a, "--stage", "1")
    assert code == 0 and out.strip() == f"SKIPPED ({NOT_SLEEPING})", out
    assert _states(stub)[1] == (SERVING, 0) and _list(stub).generation_paused

    code, out = _cli(capsys, "resume", *a)
    assert (code, out.strip()) == (0, "ok")
    code, out = _cli(capsys, "status", *a)
    assert code == 0 and "generation: open" in out and "sleeping" not in out, out
    code, out = _cli(capsys, "pause", *a)
    assert (code, out.strip()) == (0, "ok")
    code, out = _cli(capsys, "status", *a)
    assert code == 0 and "generation: paused" in out, out
    assert _refused(lambda: _generate(stub)).code() == grpc.StatusCode.FAILED_PRECONDITION
    code, out = _cli(capsys, "resume", *a)
    assert (code, out.strip()) == (0, "ok")
    assert _generate(stub) == reference


def test_cli_reports_a_bad_level(stub, sleepy, capsys):
    capsys.readouterr()
    code = cli.main(["sleep", "--address", sleepy.address, "--stage", "1", "--level", "3"])
    err = capsys.readouterr().err
    assert code == 1 and "INVALID_ARGUMENT" in err and "level:" in err, err
    _assert_all_serving(stub)


# ---- grpcurl --------------------------------------------------------------------------------------
def _grpcurl(address: str, method: str, data: dict | None = None, *flags: str) -> subprocess.CompletedProcess:
    argv = [GRPCURL, "-plaintext", "-max-time", "60", *flags, "-d", json.dumps(data or {}), address, f"{GATEWAY}/{method}"]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)


def _json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, (done.returncode, done.stderr)
    return json.loads(done.stdout)


def _exit_code(code: grpc.StatusCode) -> int:
    return 64 + code.value[0]  # grpcurl exits with 64 + the status code of a failed RPC


def _ack_rows(reply: dict) -> list[tuple]:
    """(stage_id, rank, status, level, freed_bytes) per ACK; proto3 JSON leaves zeros out."""
    return [(a.get("stage_id", 0), a.get("rank", 0), a["status"], a.get("level", 0), int(a.get("freed_bytes", 0)))
            for a in reply.get("acks", [])]


@needs_grpcurl
def test_grpcurl_sleep_wake_rows(sleepy, stub, reference):
    addr = sleepy.address
    reply = _json(_grpcurl(addr, "Sleep", {"stage_ids": [0, 1]}))  # default level
    assert reply["status"] == "CONTROL_STATUS_SUCCESS"
    rows = _ack_rows(reply)
    assert [r[:4] for r in rows] == [(0, 0, "ACK_STATUS_SUCCESS", 2), (1, 0, "ACK_STATUS_SUCCESS", 2)], reply
    assert all(r[4] > 0 for r in rows) and all(float(a.get("latency_ms", 0)) >= 0 for a in reply["acks"])

    listing = _json(_grpcurl(addr, "ListStages"))
    assert [(s.get("stage_id", 0), s["state"], s.get("sleep_level")) for s in listing["stages"]] == [
        (0, "STAGE_STATE_SLEEPING", 2), (1, "STAGE_STATE_SLEEPING", 2)]
    assert listing["generation_paused"] is True

    done = _grpcurl(addr, "GenerateUnary", {"params": {"prompt": "x", "width": 32, "height": 32}})
    assert done.returncode == _exit_code(grpc.StatusCode.FAILED_PRECONDITION), done.stderr
    assert "FailedPrecondition" in done.stderr and "stage 0" in done.stderr

    reply = _json(_grpcurl(addr, "WakeUp", {"stage_ids": [0, 1]}))
    assert reply["status"] == "CONTROL_STATUS_SUCCESS"
    assert [r[:4] for r in _ack_rows(reply)] == [(0, 0, "ACK_STATUS_SUCCESS", 2), (1, 0, "ACK_STATUS_SUCCESS", 2)]

    for data in ({"stage_ids": [0, 1]}, {}):  # not sleeping / empty list
        reply = _json(_grpcurl(addr, "WakeUp", data))
        assert reply == {"status": "CONTROL_STATUS_SKIPPED", "reason": NOT_SLEEPING}, reply

    reply = _json(_grpcurl(addr, "Sleep", {"stage_ids": [], "level": 2}))
    assert reply == {"status": "CONTROL_STATUS_SUCCESS"}, reply  # no ACKs, nothing asleep

    reply = _json(_grpcurl(addr, "Sleep", {"stage_ids": [1], "level": 1}))
    assert [r[:4] for r in _ack_rows(reply)] == [(1, 0, "ACK_STATUS_SUCCESS", 1)]
    reply = _json(_grpcurl(addr, "WakeUp", {"stage_ids": [0, 1]}))  # partial: only 1 sleeps
    assert reply["status"] == "CONTROL_STATUS_SUCCESS"
    assert [r[:4] for r in _ack_rows(reply)] == [(1, 0, "ACK_STATUS_SUCCESS", 1)]

    assert _json(_grpcurl(addr, "ResumeGeneration")) == {}
    listing = _json(_grpcurl(addr, "ListStages"))
    assert [s["state"] for s in listing["stages"]] == ["STAGE_STATE_SERVING"] * 2
    assert not listing.get("generation_paused", False)
    assert _generate(stub) == reference


@needs_grpcurl
@pytest.mark.parametrize("data, field", [({"stage_ids": [1], "level": 3}, "level"),
                                         ({"stage_ids": [4]}, "stage_ids")])
def test_grpcurl_bad_sleep_is_invalid_argument_with_a_field_violation(sleepy, stub, data, field):
    done = _grpcurl(sleepy.address, "Sleep", data, "-format-error")
    assert done.returncode == _exit_code(grpc.StatusCode.INVALID_ARGUMENT), (done.returncode, done.stderr)
    status = json.loads(done.stderr)
    assert status["code"] == 3
    [detail] = status["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert [v["field"] for v in detail["field_violations"]] == [field]
    _assert_all_serving(stub)


@needs_grpcurl
def test_grpcurl_sleep_without_support_is_unimplemented(sleepless):
    done = _grpcurl(sleepless.address, "Sleep", {"stage_ids": [1], "level": 1})
    assert done.returncode == _exit_code(grpc.StatusCode.UNIMPLEMENTED), (done.returncode, done.stderr)
    assert "Unimplemented" in done.stderr and "stage 1" in done.stderr


# ---- last: the mesh stops cleanly after all of the above ------------------------------------------
def test_zz_mesh_stops_cleanly_and_leaves_no_shared_memory(sleepy, stub, reference):
    assert _generate(stub, BIG)  # one more output through shared memory right before the stop
    _stopped_cleanly(sleepy, sleepy.pids)

"""Sleep and wake through a real mesh (`stagemesh up`) from the command line and grpcurl, and a
mesh whose diffusion stage cannot sleep (the "not supported" row: UNIMPLEMENTED here, 501 in the
reference system) through the stubs and grpcurl. The stub rows are in tests/e2e/test_sleep_wake.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
import pytest

from stagemesh import cli
from tests.support.meshproc import REPO

# The mesh fixtures are found by name: importing them here is how this module uses them.
from tests.support.sleep_mesh import (  # noqa: F401
    NOT_SLEEPING,
    RPC_TIMEOUT_S,
    SERVING,
    SKIPPED,
    SLEEPING,
    SUCCESS,
    assert_acks,
    assert_all_serving,
    awake_and_open,
    channel,
    generate,
    list_stages,
    put_to_sleep,
    reference,
    refused,
    resume,
    sleepless,
    stage_calls,
    start_sleep_mesh,
    states,
    stopped_cleanly,
    stub,
    wake_up,
)

pytestmark = pytest.mark.mesh

GRPCURL = shutil.which("grpcurl")
GATEWAY = "stagemesh.v1.GatewayService"
needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary on PATH")


# ---- a mesh without sleep support ---------------------------------------------------------------
def test_sleep_of_a_stage_without_sleep_support_is_unimplemented(sleepless):
    with sleepless.channel() as ch:
        gateway = sleepless.gateway(ch)
        for stage_ids, named in (([1], "stage 1"), ([0, 1], "stage 0")):
            exc = refused(lambda ids=stage_ids: put_to_sleep(gateway, ids, level=1))
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED, exc
            assert named in exc.details() and "sleep" in exc.details(), exc.details()
        listing = list_stages(gateway)
        assert [(s.state, s.sleep_level) for s in listing.stages] == [(SERVING, 0), (SERVING, 0)]
        assert not listing.generation_paused  # refused before admission was closed
        assert stage_calls(sleepless, "SleepStage") == 0  # refused at the gateway
        generate(gateway)
        reply = wake_up(gateway, [0, 1])
        assert (reply.status, reply.reason, list(reply.acks)) == (SKIPPED, NOT_SLEEPING, [])


# ---- CLI ------------------------------------------------------------------------------------------
def _cli_process(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", *argv],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=RPC_TIMEOUT_S,
    )


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
    assert states(stub)[1] == (SLEEPING, 1)

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
    assert states(stub)[1] == (SERVING, 0) and list_stages(stub).generation_paused

    code, out = _cli(capsys, "resume", *a)
    assert (code, out.strip()) == (0, "ok")
    code, out = _cli(capsys, "status", *a)
    assert code == 0 and "generation: open" in out and "sleeping" not in out, out
    code, out = _cli(capsys, "pause", *a)
    assert (code, out.strip()) == (0, "ok")
    code, out = _cli(capsys, "status", *a)
    assert code == 0 and "generation: paused" in out, out
    assert refused(lambda: generate(stub)).code() == grpc.StatusCode.FAILED_PRECONDITION
    code, out = _cli(capsys, "resume", *a)
    assert (code, out.strip()) == (0, "ok")
    assert generate(stub) == reference


def test_cli_reports_a_bad_level(stub, sleepy, capsys):
    capsys.readouterr()
    code = cli.main(["sleep", "--address", sleepy.address, "--stage", "1", "--level", "3"])
    err = capsys.readouterr().err
    assert code == 1 and "INVALID_ARGUMENT" in err and "level:" in err, err
    assert_all_serving(stub)


# ---- grpcurl --------------------------------------------------------------------------------------
def _grpcurl(address: str, method: str, data: dict | None = None, *flags: str) -> subprocess.CompletedProcess:
    argv = [
        GRPCURL,
        "-plaintext",
        "-max-time",
        "60",
        *flags,
        "-d",
        json.dumps(data or {}),
        address,
        f"{GATEWAY}/{method}",
    ]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)


def _json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, (done.returncode, done.stderr)
    return json.loads(done.stdout)


def _exit_code(code: grpc.StatusCode) -> int:
    return 64 + code.value[0]  # grpcurl exits with 64 + the status code of a failed RPC


def _ack_rows(reply: dict) -> list[tuple]:
    """(stage_id, rank, status, level, freed_bytes) per ACK; proto3 JSON leaves zeros out."""
    return [
        (a.get("stage_id", 0), a.get("rank", 0), a["status"], a.get("level", 0), int(a.get("freed_bytes", 0)))
        for a in reply.get("acks", [])
    ]


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
        (0, "STAGE_STATE_SLEEPING", 2),
        (1, "STAGE_STATE_SLEEPING", 2),
    ]
    assert listing["generation_paused"] is True

    done = _grpcurl(addr, "GenerateUnary", {"params": {"prompt": "x", "width": 32, "height": 32}})
    assert done.returncode == _exit_code(grpc.StatusCode.FAILED_PRECONDITION), done.stderr
    assert "FailedPrecondition" in done.stderr and "stage 0" in done.stderr

    reply = _json(_grpcurl(addr, "WakeUp", {"stage_ids": [0, 1]}))
    assert reply["status"] == "CONTROL_STATUS_SUCCESS"
    assert [r[:4] for r in _ack_rows(reply)] == [(0, 0, "ACK_STATUS_SUCCESS", 2), (1, 0, "ACK_STATUS_SUCCESS", 2)]

    reply = _json(_grpcurl(addr, "WakeUp", {"stage_ids": [0, 1]}))  # not sleeping
    assert reply == {"status": "CONTROL_STATUS_SKIPPED", "reason": NOT_SLEEPING}, reply

    # An empty list names no stage: Sleep refuses it, WakeUp finds none of them sleeping.
    done = _grpcurl(addr, "Sleep", {"stage_ids": []})
    assert done.returncode == _exit_code(grpc.StatusCode.INVALID_ARGUMENT), (done.returncode, done.stderr)
    assert "stage_ids" in done.stderr
    assert _json(_grpcurl(addr, "WakeUp", {"stage_ids": []})) == {
        "status": "CONTROL_STATUS_SKIPPED",
        "reason": NOT_SLEEPING,
    }

    reply = _json(_grpcurl(addr, "Sleep", {"stage_ids": [1], "level": 1}))
    assert [r[:4] for r in _ack_rows(reply)] == [(1, 0, "ACK_STATUS_SUCCESS", 1)]
    reply = _json(_grpcurl(addr, "WakeUp", {"stage_ids": [0, 1]}))  # partial: only 1 sleeps
    assert reply["status"] == "CONTROL_STATUS_SUCCESS"
    assert [r[:4] for r in _ack_rows(reply)] == [(1, 0, "ACK_STATUS_SUCCESS", 1)]

    assert _json(_grpcurl(addr, "ResumeGeneration")) == {}
    listing = _json(_grpcurl(addr, "ListStages"))
    assert [s["state"] for s in listing["stages"]] == ["STAGE_STATE_SERVING"] * 2
    assert not listing.get("generation_paused", False)
    assert generate(stub) == reference


@needs_grpcurl
@pytest.mark.parametrize("data, field", [({"stage_ids": [1], "level": 3}, "level"), ({"stage_ids": [4]}, "stage_ids")])
def test_grpcurl_bad_sleep_is_invalid_argument_with_a_field_violation(sleepy, stub, data, field):
    done = _grpcurl(sleepy.address, "Sleep", data, "-format-error")
    assert done.returncode == _exit_code(grpc.StatusCode.INVALID_ARGUMENT), (done.returncode, done.stderr)
    status = json.loads(done.stderr)
    assert status["code"] == 3
    [detail] = status["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert [v["field"] for v in detail["field_violations"]] == [field]
    assert_all_serving(stub)


@needs_grpcurl
def test_grpcurl_sleep_without_support_is_unimplemented(sleepless):
    done = _grpcurl(sleepless.address, "Sleep", {"stage_ids": [1], "level": 1})
    assert done.returncode == _exit_code(grpc.StatusCode.UNIMPLEMENTED), (done.returncode, done.stderr)
    assert "Unimplemented" in done.stderr and "stage 1" in done.stderr


# ---- a buffer prepared at start -------------------------------------------------------------------
def test_a_mesh_preparing_its_sleep_buffer_at_start_compacts_and_round_trips(tmp_path, model_dir):
    """sleep_host_buffer = "at_start": each worker prepares the level-1 buffer and moves its
    weights through it into one allocation before it reports ready; the images are the same
    before and after, and after a level-1 and a level-2 round trip."""
    mesh = start_sleep_mesh(tmp_path, model_dir, extra_stage='sleep_host_buffer = "at_start"')
    try:
        assert mesh.logs().count("weights compacted into one allocation through the sleep host buffer") == 2
        with mesh.channel() as ch:
            gateway = mesh.gateway(ch)
            before = generate(gateway)
            for level in (1, 2):
                reply = put_to_sleep(gateway, [0, 1], level=level)
                assert reply.status == SUCCESS
                assert_acks(reply.acks, [0, 1], level=level)
                assert wake_up(gateway, [0, 1]).status == SUCCESS
                resume(gateway)
                assert generate(gateway) == before, f"after a level-{level} round trip"
    finally:
        stopped_cleanly(mesh, mesh.pids)

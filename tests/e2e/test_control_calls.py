"""Control calls at their edges, through a real mesh (`stagemesh up`) and the real CLI: an empty
stage list is refused by Sleep and skipped by WakeUp, `--all` names every stage, a stage put to
sleep behind the gateway's back is woken, one woken behind its back is put to sleep again, a
replica that does not answer is named first in its ACK, and a stage's internal error reaches the
caller in words, without another request's id or an exception class."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from stagemesh import cli
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2, stage_pb2, stage_pb2_grpc
from tests.support.meshproc import spawn_service, start_mesh, write_config
from tests.support.sleep_mesh import stage_calls

pytestmark = pytest.mark.mesh

RPC_TIMEOUT_S = 60.0
SUCCESS = control_pb2.CONTROL_STATUS_SUCCESS
SERVING = health_pb2.HealthCheckResponse.SERVING
SMALL = generation_pb2.GenerationParams(prompt="a boat", width=32, height=32, num_inference_steps=1, seed=3)


@pytest.fixture(scope="module")
def control_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("robust-control")
    mesh = start_mesh(write_config(root / "mesh.toml", model_dir), root / "mesh.log")
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]


@pytest.fixture(scope="module")
def gateway(control_mesh):
    with control_mesh.channel() as channel:
        yield control_mesh.gateway(channel)


@pytest.fixture(autouse=True)
def awake_and_open(gateway):
    yield
    gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=RPC_TIMEOUT_S)
    gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)


def _sleep_levels(gateway) -> list[int]:
    listing = gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S)
    return [s.sleep_level for s in listing.stages]


def _violations(exc: grpc.RpcError) -> dict[str, str]:
    detail = rpc_status.from_call(exc).details[0]
    bad = error_details_pb2.BadRequest()
    detail.Unpack(bad)
    return {v.field: v.description for v in bad.field_violations}


def test_sleep_with_an_empty_stage_list_is_invalid_argument_naming_stage_ids(gateway):
    with pytest.raises(grpc.RpcError) as info:
        gateway.Sleep(gateway_pb2.SleepRequest(), timeout=RPC_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "stage ids 0 to 1" in _violations(info.value)["stage_ids"]
    assert _sleep_levels(gateway) == [0, 0]
    assert not gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S).generation_paused


def test_wakeup_with_an_empty_stage_list_is_skipped_and_calls_no_stage(gateway, control_mesh):
    """As for stages that are awake: no stage is named, so none of them sleeps."""
    assert gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=RPC_TIMEOUT_S).status == SUCCESS
    calls = stage_calls(control_mesh, "WakeUpStage")
    reply = gateway.WakeUp(gateway_pb2.WakeUpRequest(), timeout=RPC_TIMEOUT_S)
    assert (reply.status, reply.reason, list(reply.acks)) == (
        control_pb2.CONTROL_STATUS_SKIPPED,
        "target stages are not sleeping",
        [],
    )
    assert stage_calls(control_mesh, "WakeUpStage") == calls
    assert _sleep_levels(gateway) == [0, 1]  # stage 1 still asleep


def test_cli_sleep_and_wakeup_all_reach_every_stage(gateway, control_mesh, capsys):
    address = ("--address", control_mesh.address)
    capsys.readouterr()
    assert cli.main(["sleep", *address, "--all", "--level", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "SUCCESS", out
    assert "stage 0 rank 0: SUCCESS" in out and "stage 1 rank 0: SUCCESS" in out, out
    assert _sleep_levels(gateway) == [1, 1]
    assert cli.main(["wakeup", *address, "--all"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "SUCCESS"
    assert _sleep_levels(gateway) == [0, 0]


@pytest.mark.parametrize("targets", [[], ["--all", "--stage", "1"]], ids=["neither", "both"])
def test_cli_sleep_needs_exactly_one_of_all_and_stage(control_mesh, capsys, targets):
    with pytest.raises(SystemExit) as info:
        cli.main(["sleep", "--address", control_mesh.address, *targets])
    assert info.value.code == 2
    assert "--all" in capsys.readouterr().err


def test_wakeup_wakes_a_stage_put_to_sleep_by_its_own_sleep_stage(gateway, control_mesh):
    stage_address = control_mesh.child_addresses()["stage-1"]
    with grpc.insecure_channel(stage_address) as channel:
        stage = stage_pb2_grpc.StageServiceStub(channel)
        slept = stage.SleepStage(stage_pb2.SleepStageRequest(level=1), timeout=RPC_TIMEOUT_S)
        assert all(a.status == control_pb2.ACK_STATUS_SUCCESS for a in slept.acks)
        assert _sleep_levels(gateway) == [0, 1]
        reply = gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RPC_TIMEOUT_S)
        assert reply.status == SUCCESS, reply
        assert [(a.stage_id, a.level) for a in reply.acks] == [(1, 1)]
        assert stage.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=RPC_TIMEOUT_S).sleep_level == 0
    assert gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=RPC_TIMEOUT_S).result.png


def test_a_stage_woken_behind_the_gateways_back_is_put_back_to_sleep(gateway, control_mesh):
    """The operator's Sleep holds until the gateway's WakeUp: the gateway's watch sees the stage
    awake and puts it to sleep again at the level asked for, within seconds."""
    assert gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=RPC_TIMEOUT_S).status == SUCCESS
    with grpc.insecure_channel(control_mesh.child_addresses()["stage-1"]) as channel:
        stage = stage_pb2_grpc.StageServiceStub(channel)
        woken = stage.WakeUpStage(stage_pb2.WakeUpStageRequest(), timeout=RPC_TIMEOUT_S)
        assert [a.status for a in woken.acks] == [control_pb2.ACK_STATUS_SUCCESS]
        woken_at = time.monotonic()
        while stage.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=RPC_TIMEOUT_S).sleep_level != 1:
            assert time.monotonic() - woken_at < 10.0, "stage 1 was not put back to sleep"
            time.sleep(0.1)
    assert _sleep_levels(gateway) == [0, 1]
    with pytest.raises(grpc.RpcError) as refused:
        gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stage 1" in refused.value.details()
    assert "replicas awake while their stage sleeps" in control_mesh.logs()
    reply = gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RPC_TIMEOUT_S)
    assert reply.status == SUCCESS and [(a.stage_id, a.level) for a in reply.acks] == [(1, 1)]
    time.sleep(2.0)  # two rounds of the watch: a WakeUp through the gateway is not undone
    assert _sleep_levels(gateway) == [0, 0]
    gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)
    assert gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=RPC_TIMEOUT_S).result.png


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _second_gateway(control_mesh, tmp_path, name: str, stage_specs: list[str]):
    flags = [flag for spec in stage_specs for flag in ("--stage", spec)]
    service = spawn_service(name, ["gateway", *flags], tmp_path)
    address = service.wait_bound()
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + RPC_TIMEOUT_S
    # SERVING once every stage described itself to this gateway.
    while health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=RPC_TIMEOUT_S).status != SERVING:
        assert time.monotonic() < deadline, service.logs()[-3000:]
        time.sleep(0.1)
    return service, channel


def test_the_ack_of_a_replica_that_does_not_answer_starts_with_replica_address(control_mesh, tmp_path):
    stages = control_mesh.child_addresses()
    gone = f"127.0.0.1:{_free_port()}"
    service, channel = _second_gateway(
        control_mesh, tmp_path, "gateway-2", [stages["stage-0"], f"{stages['stage-1']},{gone}"]
    )
    try:
        second = gateway_pb2_grpc.GatewayServiceStub(channel)
        reply = second.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=RPC_TIMEOUT_S)
        failed = [a for a in reply.acks if a.status != control_pb2.ACK_STATUS_SUCCESS]
        assert reply.status == control_pb2.CONTROL_STATUS_ERROR and len(failed) == 1, reply
        assert failed[0].error.startswith(f"replica {gone}: "), failed[0].error
        assert failed[0].rank == -1
        reply = second.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RPC_TIMEOUT_S)
        assert [a.error for a in reply.acks if a.error][0].startswith(f"replica {gone}: "), reply
    finally:
        channel.close()
        assert service.stop() == 0, service.logs()[-3000:]


def test_a_stage_error_names_no_request_id_nor_exception_class(control_mesh, tmp_path):
    """A gateway in front of the diffusion stage alone: the stage lacks its encoder's inputs. It
    used to fail every batch with its own message naming a request of the batch (INTERNAL); now it
    refuses each request before admission, naming the input. (A worker's own failure text is kept
    from callers by the executor: tests/stage_service/executor/test_executor.py.)"""
    service, channel = _second_gateway(control_mesh, tmp_path, "gateway-3", [control_mesh.child_addresses()["stage-1"]])
    ids = [f"batch-mate-{i}" for i in range(4)]
    failures: dict[str, grpc.RpcError] = {}

    def call(request_id: str) -> None:
        request = gateway_pb2.GenerateUnaryRequest(params=SMALL, request_id=request_id)
        try:
            gateway_pb2_grpc.GatewayServiceStub(channel).GenerateUnary(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            failures[request_id] = exc

    try:
        callers = [threading.Thread(target=call, args=(i,)) for i in ids]
        for t in callers:
            t.start()
        for t in callers:
            t.join(RPC_TIMEOUT_S)
        assert sorted(failures) == ids
        for exc in failures.values():
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
            assert "inputs[hidden_states]: missing" in exc.details(), exc.details()
            assert not any(i in exc.details() for i in ids), exc.details()
            assert "Error" not in exc.details(), exc.details()
    finally:
        channel.close()
        assert service.stop() == 0, service.logs()[-3000:]

"""DLO through a real mesh (`stagemesh up`): stage 1 streams its DiT blocks, with no resident
layer and with one, and the image bytes equal those of a mesh without DLO; sleep and wake of the
DLO stage free its slots and resident weights and give the same bytes afterwards.

The DLO meshes start once for the module, in parallel with the session's plain mesh (the
reference); the sleep tests run last and leave every stage awake with generation open.
"""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import pytest

from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import DIT_FILE, ensure_model_dir
from stagemesh.v1 import control_pb2, gateway_pb2
from stagemesh.weight_store.checkpoint import read_index
from tests.support.meshproc import Mesh, parallel_meshes, start_mesh, unary_png, write_config

pytestmark = pytest.mark.mesh

DLO_MESHES = {
    "dlo": "enable_dlo = true",  # dp_size 1: no collective, complete blocks from the mapping
    "dlo-resident": "enable_dlo = true\ndlo_use_allgather = false\ndlo_resident_layers = 1",
}
# (width, height, steps, seed, prompt): several sizes, seeds and step counts.
CASES = [
    (64, 48, 3, 1, "a lighthouse at dusk"),
    (128, 64, 2, 2, "a red fox"),
    (32, 96, 4, 3, "rain on a tin roof"),
    (256, 256, 2, 4, "a boat"),
]
RPC_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, model_dir, request) -> dict[str, Mesh]:
    ensure_model_dir(Path(model_dir), PipelineConfig.tiny())  # once, before any stage loads it
    roots = {name: tmp_path_factory.mktemp(name) for name in DLO_MESHES}

    def start(name: str) -> Mesh:
        config = write_config(roots[name] / "mesh.toml", Path(model_dir), extra_diffusion=DLO_MESHES[name])
        return start_mesh(config, roots[name] / "mesh.log")

    reference: list[Mesh] = []
    # The shared reference mesh starts meanwhile, unless it already runs.
    with parallel_meshes(
        {name: functools.partial(start, name) for name in DLO_MESHES},
        lambda: reference.append(request.getfixturevalue("mesh")),
    ) as started:
        yield {"reference": reference[0], **started}


def test_dlo_stage_gives_the_same_png_bytes_as_without(meshes):
    # That DLO really runs in these stages shows in what their sleep frees (test below).
    for case in CASES:
        want = unary_png(meshes["reference"], *case)
        for name in DLO_MESHES:
            assert unary_png(meshes[name], *case) == want, (name, case)


def _sleep_wake(m: Mesh, level: int) -> tuple[int, int]:
    """Sleep stage 1 at `level`, wake it, reopen generation: (freed, taken back) bytes."""
    with m.channel() as channel:
        stub = m.gateway(channel)
        slept = stub.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=level), timeout=RPC_TIMEOUT_S)
        assert slept.status == control_pb2.CONTROL_STATUS_SUCCESS
        [ack] = slept.acks
        assert (ack.stage_id, ack.status, ack.level) == (1, control_pb2.ACK_STATUS_SUCCESS, level)
        with pytest.raises(grpc.RpcError) as refused:
            unary_png(m, *CASES[0])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        woken = stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RPC_TIMEOUT_S)
        [back] = woken.acks
        assert (back.status, back.level) == (control_pb2.ACK_STATUS_SUCCESS, level)
        # A pipeline with an AR stage stays paused after wake until it is resumed.
        stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)
    return ack.freed_bytes, back.freed_bytes


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_of_a_dlo_stage_keep_the_png_bytes(meshes, model_dir, level):
    want = [unary_png(meshes["reference"], *case) for case in CASES[:2]]
    index = read_index(Path(model_dir) / DIT_FILE)
    model_bytes = sum(r.nbytes for r in index.values())
    block0 = sum(r.nbytes for name, r in index.items() if name.startswith("dit.blocks.0."))
    freed = {}
    for name in DLO_MESHES:
        freed[name], taken = _sleep_wake(meshes[name], level)
        assert 0 < freed[name] < model_bytes and taken >= freed[name], name
        assert [unary_png(meshes[name], *case) for case in CASES[:2]] == want, name
    # Less than the model: the streamed blocks are not the stage's device memory (DLO is on).
    # Slots are alike in both; the resident layer is the only difference in what sleep frees.
    assert freed["dlo-resident"] - freed["dlo"] == block0

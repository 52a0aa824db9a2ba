"""Async output (docs/ARCHITECTURE.md) end to end: a mesh with async output (the default) and a mesh with
`step_execution = true` (the synchronous path) get the same 200 mixed-size requests, sent
concurrently to both. Requests that cannot share a batch give byte-identical PNGs; requests that
do get batched (differently in each mesh) each get their own picture, equal up to 8-bit rounding
of batch-dependent float noise. Afterwards no shared-memory segment of either mesh survives.

Two real `stagemesh up` processes (cache, AR stage, diffusion stage, gateway each), real gRPC; the
async one is the session's shared mesh.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import itertools
import random
from pathlib import Path

import numpy
import pytest
from PIL import Image

from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import descendants, shm_entries, start_mesh, write_config

pytestmark = pytest.mark.mesh

N_REQUESTS = 200
PARALLEL = 8
PROMPTS = ["a lighthouse at dusk", "two cats", "", "ein Haus am See", "x" * 40]


def _segments() -> set[str]:
    return {e for e in shm_entries() if e.startswith("stagemesh-")}


def _owner(segment: str) -> int | None:
    parts = segment.split("-")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


@pytest.fixture(scope="module")
def two_meshes(tmp_path_factory, model_dir, request):
    """The session's mesh (async output, the default; tests/conftest.py checks its stop) and a mesh
    with `step_execution = true`, which starts while the session's comes up (unless it runs already)."""
    from stagemesh.stage_service.models.config import PipelineConfig
    from stagemesh.stage_service.models.weights import ensure_model_dir

    ensure_model_dir(Path(model_dir), PipelineConfig.tiny())  # once, before two meshes look for it
    before = _segments()
    root = tmp_path_factory.mktemp("mesh-step")
    config = (write_config(root / "mesh.toml", model_dir, extra_stage="step_execution = true"), root / "mesh.log")
    with cf.ThreadPoolExecutor(1) as pool:  # start both at once: each takes a while to come up
        starting = pool.submit(start_mesh, *config)
        try:
            shared = request.getfixturevalue("mesh")
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().stop()
            raise
        step = starting.result()
    meshes = {"async": shared, "step": step}
    pids = {step.process.pid, *descendants(step.process.pid)}
    try:
        yield meshes
    finally:
        code = step.stop()
    assert code == 0, step.logs()[-3000:]
    leaked = {s for s in _segments() - before if _owner(s) in pids}
    assert not leaked, f"shared-memory segments left behind by the step mesh: {leaked}"


SHAPES = list(itertools.product((16, 32, 48, 64), (16, 32)))


def _unbatchable_requests() -> list[generation_pb2.GenerationParams]:
    """200 mixed requests, no two with the same (size, steps, guidance): none can share a
    diffusion batch, so each image is computed the same way in both meshes however the
    requests interleave."""
    rng = random.Random(20240611)
    keys = list(itertools.product(SHAPES, (1, 2), [1.0 + 0.5 * k for k in range(13)]))
    rng.shuffle(keys)
    return [
        generation_pb2.GenerationParams(
            prompt=rng.choice(PROMPTS), width=w, height=h, num_inference_steps=steps, guidance_scale=g, seed=1000 + i
        )
        for i, ((w, h), steps, g) in enumerate(keys[:N_REQUESTS])
    ]


def _batchable_requests() -> list[generation_pb2.GenerationParams]:
    """200 mixed requests over few batch keys, so batches of up to 4 form and get split."""
    rng = random.Random(7)
    return [
        generation_pb2.GenerationParams(
            prompt=rng.choice(PROMPTS), width=w, height=h, num_inference_steps=rng.choice((1, 2)), seed=5000 + i
        )
        for i, (w, h) in enumerate(rng.choice(SHAPES[:3]) for _ in range(N_REQUESTS))
    ]


def _run_all(mesh, params: list[generation_pb2.GenerationParams]) -> list[generation_pb2.GenerationResult]:
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)

        def one(p):
            return stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=p), timeout=120).result

        with cf.ThreadPoolExecutor(PARALLEL) as pool:
            return list(pool.map(one, params))


def _run_on_both(meshes, params) -> dict[str, list[generation_pb2.GenerationResult]]:
    """Both meshes work at the same time, each with PARALLEL requests in flight."""
    with cf.ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(_run_all, mesh, params) for name, mesh in meshes.items()}
        results = {name: fut.result(timeout=600) for name, fut in runs.items()}
    for name, res in results.items():
        assert len(res) == len(params), name
        for p, r in zip(params, res):
            assert (r.seed, r.width, r.height) == (p.seed, p.width, p.height), name
    return results


def _pixels(png: bytes) -> numpy.ndarray:
    return numpy.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=numpy.int16)


def test_async_and_step_execution_give_identical_png_bytes(two_meshes):
    params = _unbatchable_requests()
    assert len({(p.width, p.height) for p in params}) == 8 and {p.num_inference_steps for p in params} == {1, 2}
    results = _run_on_both(two_meshes, params)
    for i, (a, s) in enumerate(zip(results["async"], results["step"])):
        assert a.png == s.png, f"request {i} ({params[i]}) differs between async and step execution"
    for p, r in zip(params, results["async"]):
        assert _pixels(r.png).shape == (p.height, p.width, 3)
    assert len({r.png for r in results["async"]}) == N_REQUESTS  # distinct pictures, not one blob


def test_batched_requests_each_get_their_own_picture_on_both_paths(two_meshes):
    """Batches form (and are split) differently in the two meshes. The float result of a batch
    depends (in the last bits) on its batch mates, so an 8-bit pixel may round the other way now
    and then; anything more (a request given a batch mate's picture, a corrupted or reused
    buffer) shows up as a large difference."""
    params = _batchable_requests()
    results = _run_on_both(two_meshes, params)
    identical = 0
    for i, (a, s) in enumerate(zip(results["async"], results["step"])):
        if a.png == s.png:
            identical += 1
            continue
        pa, ps = _pixels(a.png), _pixels(s.png)
        assert pa.shape == ps.shape == (params[i].height, params[i].width, 3)
        diff = numpy.abs(pa - ps)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, f"request {i} ({params[i]}): not rounding noise"
    assert identical >= 0.9 * N_REQUESTS
    assert len({r.png for r in results["async"]}) == N_REQUESTS


def _stage_cmdlines(mesh) -> list[list[str]]:
    out = []
    for pid in descendants(mesh.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode() for a in argv if a]
        if "stage" in argv and "--kind" in argv:
            out.append(argv)
    return out


def test_each_mesh_runs_the_output_path_it_was_configured_for(two_meshes):
    """Both stages of the step mesh run with --step-execution, both of the async mesh without."""
    for name, mesh in two_meshes.items():
        stages = _stage_cmdlines(mesh)
        assert sorted(a[a.index("--kind") + 1] for a in stages) == ["ar", "diffusion"], stages
        flag = "--step-execution" if name == "step" else "--no-step-execution"
        assert all(flag in a for a in stages), (name, stages)
        with mesh.channel() as channel:
            reply = mesh.gateway(channel).ListStages(gateway_pb2.ListStagesRequest(), timeout=10)
        assert all(s.state == gateway_pb2.STAGE_STATE_SERVING for s in reply.stages)

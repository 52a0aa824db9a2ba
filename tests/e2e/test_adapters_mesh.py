"""LoRA adapters through a real mesh (`stagemesh up --model` over a tiny random-weight FLUX folder,
encoder + diffusion stages, CPU): random-weight adapters registered from lora_dir and loaded at
run time give the bytes of diffusers' own pipeline with `load_lora_weights` + `set_adapters` at
the same scale; concurrent requests with different adapters each get their own image; the
device bound moves the least recently used adapter to the host; bad input is refused naming the
field; adapters survive sleep at either level."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from stagemesh.gateway.images import encode_png
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2
from tests.support.meshproc import Mesh, start_mesh
from tests.support.sleep_mesh import field_violations

pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")

RPC_TIMEOUT_S = 120.0
CASE = dict(prompt="a red fox", width=32, height=32, num_inference_steps=2, guidance_scale=3.5, seed=1)
TOKEN = "adapter-control-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CONFIG = """[gateway]
port = 0
http_port = 0

[security]
token_file = "{root}/token"

[cache]
root = "{root}/cache"

[[stages]]
kind = "encoder"
threads = 1

[[stages]]
kind = "diffusion"
threads = 1
lora_dir = "{loras}"
max_device_adapters = 1
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from stagemesh.stage_service.models.adapters.synthetic import write_random_lora
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("lora")
    flux = write_tiny(root / "flux", "flux")
    sd3 = write_tiny(root / "sd3", "sd3")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(flux / "transformer")
    loras = root / "loras"
    write_random_lora(loras / "ink.safetensors", transformer, rank=4, seed=1)
    # Loaded at run time; kept out of lora_dir's top level until then (a folder, as save_lora_weights writes).
    spare = root / "spare"
    write_random_lora(spare / "pytorch_lora_weights.safetensors", transformer, rank=8, seed=2)
    # Another model's layer names: refused at load.
    sd3_transformer = diffusers.SD3Transformer2DModel.from_pretrained(sd3 / "transformer")
    write_random_lora(spare / "wrong.safetensors", sd3_transformer, rank=4, seed=3)
    return {"flux": flux, "loras": loras, "spare": spare}


@pytest.fixture(scope="module")
def mesh(folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-mesh")
    config = root / "mesh.toml"
    config.write_text(CONFIG.format(root=root, loras=folders["loras"]))
    (root / "token").write_text(TOKEN + "\n")
    (root / "token").chmod(0o600)
    m = start_mesh(config, root / "mesh.log", ("--model", str(folders["flux"])))
    yield m
    assert m.stop() == 0, m.logs()[-3000:]
    assert "Traceback" not in m.logs()


def _reference(folder: Path, adapters: list[tuple[Path, str, float]]) -> bytes:
    """diffusers' own pipeline with `load_lora_weights` + `set_adapters`, one thread as the stages."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True)
        for path, name, _ in adapters:
            pipe.load_lora_weights(str(path), adapter_name=name)
        if adapters:
            pipe.set_adapters([n for _, n, _ in adapters], [s for _, _, s in adapters])
        image = pipe(**{k: v for k, v in CASE.items() if k != "seed"}, output_type="pt",
                     generator=torch.Generator().manual_seed(CASE["seed"])).images[0]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return encode_png(image.permute(1, 2, 0).float().numpy())


def _params(*adapters: tuple[str, float]) -> generation_pb2.GenerationParams:
    return generation_pb2.GenerationParams(
        **CASE, adapters=[generation_pb2.AdapterChoice(name=n, scale=s) for n, s in adapters]
    )


def _png(m: Mesh, *adapters: tuple[str, float]) -> bytes:
    with m.channel() as channel:
        reply = m.gateway(channel).GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=_params(*adapters)), timeout=RPC_TIMEOUT_S
        )
    return reply.result.png


def _listed(m: Mesh) -> dict[str, control_pb2.AdapterInfo]:
    with m.channel() as channel:
        reply = m.gateway(channel).ListAdapters(control_pb2.ListAdaptersRequest(), timeout=RPC_TIMEOUT_S, metadata=AUTH)
    return {a.name: a for a in reply.adapters}


def _load(m: Mesh, name: str, path: str) -> control_pb2.LoadAdapterResponse:
    with m.channel() as channel:
        return m.gateway(channel).LoadAdapter(
            control_pb2.LoadAdapterRequest(name=name, path=path), timeout=RPC_TIMEOUT_S, metadata=AUTH
        )


@pytest.mark.mesh
def test_adapters_give_diffusers_own_bytes_and_switch_per_request(mesh, folders):
    ink = folders["loras"] / "ink.safetensors"
    base = _png(mesh)
    assert base == _reference(folders["flux"], [])
    assert _png(mesh, ("ink", 0.8)) == _reference(folders["flux"], [(ink, "ink", 0.8)])
    assert _png(mesh) == base  # back to the base model: nothing of the adapter stays
    assert _png(mesh, ("ink", 0.8)) != base

    # Loaded at run time from inside lora_dir, then two at once.
    shutil.copytree(folders["spare"], folders["loras"] / "film", ignore=shutil.ignore_patterns("wrong*"))
    loaded = _load(mesh, "film", "film")
    assert [(a.name, a.stage_id, a.source) for a in loaded.adapters] == [("film", 1, "film")]
    film = folders["loras"] / "film"
    assert _png(mesh, ("film", 1.0)) == _reference(folders["flux"], [(film, "film", 1.0)])
    both = [(ink, "ink", 0.5), (film, "film", 1.5)]
    assert _png(mesh, ("ink", 0.5), ("film", 1.5)) == _reference(folders["flux"], both)


@pytest.mark.mesh
def test_concurrent_requests_with_different_adapters_each_get_their_own_image(mesh):
    alone = {name: _png(mesh, *(((name, 1.0),) if name else ())) for name in ("ink", "")}
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [(name, pool.submit(_png, mesh, *(((name, 1.0),) if name else ()))) for name in ("ink", "") * 3]
        for name, future in futures:
            assert future.result() == alone[name], name
    assert alone["ink"] != alone[""]


@pytest.mark.mesh
def test_list_reports_bytes_and_the_device_bound_moves_the_least_recently_used_out(mesh, folders):
    if "film" not in _listed(mesh):
        shutil.copytree(folders["spare"], folders["loras"] / "film", ignore=shutil.ignore_patterns("wrong*"))
        _load(mesh, "film", "film")
    _png(mesh, ("ink", 1.0))
    listed = _listed(mesh)
    assert listed["ink"].on_device and not listed["film"].on_device  # max_device_adapters = 1
    # Rank 8 vs rank 4 on the same layers: twice the bytes.
    assert listed["film"].bytes == 2 * listed["ink"].bytes > 0
    assert listed["ink"].layers == listed["film"].layers > 0
    _png(mesh, ("film", 1.0))
    listed = _listed(mesh)
    assert listed["film"].on_device and not listed["ink"].on_device


@pytest.mark.mesh
def test_bad_adapter_input_is_refused_naming_it(mesh, folders):
    gateway = lambda channel: mesh.gateway(channel)  # noqa: E731
    with mesh.channel() as channel:
        with pytest.raises(grpc.RpcError) as unknown:
            gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params(("nope", 1.0))))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope'" in unknown.value.details() and "params.adapters[0].name" in unknown.value.details()

        with pytest.raises(grpc.RpcError) as scale:
            gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params(("ink", 9.5))))
        assert scale.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.adapters[0].scale" in field_violations(scale.value)

        many = _params(*((f"a{i}", 1.0) for i in range(5)))
        with pytest.raises(grpc.RpcError) as too_many:
            gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=many))
        assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 4" in field_violations(too_many.value)["params.adapters"]

        (folders["loras"] / "_runtime").mkdir(exist_ok=True)
        shutil.copy(folders["spare"] / "wrong.safetensors", folders["loras"] / "_runtime" / "wrong.safetensors")
        with pytest.raises(grpc.RpcError) as mismatch:
            load = control_pb2.LoadAdapterRequest(name="wrong", path="_runtime/wrong.safetensors")
            gateway(channel).LoadAdapter(load, metadata=AUTH)
        assert mismatch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # SD3's first adapted layer; FLUX's blocks have no context_pre_only attention there.
        assert "which the transformer lacks" in field_violations(mismatch.value)["path"]

        with pytest.raises(grpc.RpcError) as outside:
            outside_path = control_pb2.LoadAdapterRequest(name="x", path="../spare/wrong.safetensors")
            gateway(channel).LoadAdapter(outside_path, metadata=AUTH)
        assert outside.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside" in field_violations(outside.value)["path"]

        with pytest.raises(grpc.RpcError) as gone:
            gateway(channel).UnloadAdapter(control_pb2.UnloadAdapterRequest(name="nope"), metadata=AUTH)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in gone.value.details()
    assert "wrong" not in _listed(mesh)


@pytest.mark.mesh
def test_adapters_survive_sleep_and_unload_drops_one(mesh, folders):
    want = _png(mesh, ("ink", 0.8))
    with mesh.channel() as channel:
        gateway = mesh.gateway(channel)
        for level in (1, 2):
            gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=level), timeout=RPC_TIMEOUT_S, metadata=AUTH)
            with pytest.raises(grpc.RpcError) as asleep:
                _load(mesh, "late", "ink.safetensors")
            assert asleep.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "WakeUp" in asleep.value.details()
            gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RPC_TIMEOUT_S, metadata=AUTH)
            assert _png(mesh, ("ink", 0.8)) == want, level
        (folders["loras"] / "_runtime").mkdir(exist_ok=True)
        shutil.copy(folders["loras"] / "ink.safetensors", folders["loras"] / "_runtime" / "ink2.safetensors")
        _load(mesh, "ink2", "_runtime/ink2.safetensors")
        assert gateway.UnloadAdapter(control_pb2.UnloadAdapterRequest(name="ink2"), metadata=AUTH).stage_ids == [1]
        with pytest.raises(grpc.RpcError) as gone:
            _png(mesh, ("ink2", 1.0))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert _png(mesh, ("ink", 0.8)) == want


@pytest.mark.mesh
def test_control_calls_need_the_token(mesh):
    with mesh.channel() as channel:
        for call, request in (
            (mesh.gateway(channel).ListAdapters, control_pb2.ListAdaptersRequest()),
            (mesh.gateway(channel).LoadAdapter, control_pb2.LoadAdapterRequest(name="x", path="ink.safetensors")),
            (mesh.gateway(channel).UnloadAdapter, control_pb2.UnloadAdapterRequest(name="ink")),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=RPC_TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "ink" in _listed(mesh)


@pytest.mark.mesh
def test_over_http_an_adapter_is_a_model_and_adapters_set_several(mesh):
    import base64

    import httpx
    import openai

    base_url = f"http://{mesh.http_address}"
    sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)
    models = [m.id for m in sdk.models.list().data]
    assert models[0] == "stagemesh" and "ink" in models
    extra = {k: CASE[k] for k in ("seed", "num_inference_steps", "guidance_scale")}

    def png(**kwargs) -> bytes:
        reply = sdk.images.generate(prompt=CASE["prompt"], size="32x32", **kwargs)
        return base64.b64decode(reply.data[0].b64_json)

    assert png(model="ink", extra_body=extra) == _png(mesh, ("ink", 1.0))
    several = {**extra, "adapters": [{"name": "ink", "scale": 0.8}]}
    assert png(extra_body=several) == _png(mesh, ("ink", 0.8))
    with pytest.raises(openai.NotFoundError) as unknown:
        png(model="nope", extra_body=extra)
    assert "'nope'" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as scale:
        png(extra_body={**extra, "adapters": [{"name": "ink", "scale": 20}]})
    assert scale.value.param == "adapters[0].scale"

    auth = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base_url, timeout=RPC_TIMEOUT_S) as http:
        assert http.get("/v1/omni/adapters").status_code == 401
        listed = http.get("/v1/omni/adapters", headers=auth).json()["adapters"]
        assert {"name": "ink", "stage_id": 1, "on_device": True}.items() <= next(
            a for a in listed if a["name"] == "ink"
        ).items()
        loaded = http.post("/v1/omni/adapters", headers=auth, json={"name": "ink3", "path": "ink.safetensors"})
        assert loaded.status_code == 200 and loaded.json()["adapters"][0]["name"] == "ink3"
        assert png(model="ink3", extra_body=extra) == _png(mesh, ("ink", 1.0))  # the same file
        assert http.delete("/v1/omni/adapters/ink3", headers=auth).json() == {"name": "ink3", "stage_ids": [1]}
        gone = http.delete("/v1/omni/adapters/ink3", headers=auth)
        assert gone.status_code == 404 and "'ink3'" in gone.json()["error"]["message"]


@pytest.mark.mesh
def test_the_python_client_names_adapters_and_drives_them(mesh):
    from stagemesh import Client
    from stagemesh.client.errors import NotFoundError

    with Client(mesh.address, token=TOKEN, timeout=RPC_TIMEOUT_S) as client:
        options = {k: CASE[k] for k in ("width", "height", "guidance_scale", "seed")}
        result = client.generate(CASE["prompt"], steps=CASE["num_inference_steps"], adapters={"ink": 0.8}, **options)
        assert result.bytes == _png(mesh, ("ink", 0.8))
        loaded = client.load_adapter("ink4", "ink.safetensors")
        assert [(a.name, a.stage_id) for a in loaded] == [("ink4", 1)]
        assert {"ink", "ink4"} <= {a.name for a in client.list_adapters()}
        same = client.generate(CASE["prompt"], steps=CASE["num_inference_steps"], adapters=["ink4"], **options)
        assert same.bytes == _png(mesh, ("ink", 1.0))
        assert client.unload_adapter("ink4") == [1]
        with pytest.raises(NotFoundError):
            client.unload_adapter("ink4")


@pytest.mark.mesh
def test_the_command_line_generates_with_adapters(mesh, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "ink.png"
    args = ["--size", "32", "--steps", "2", "--guidance", "3.5", "--seed", "1", "--adapter", "ink=0.8", "-o", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh", "generate", CASE["prompt"], "--address", mesh.address, *args],
        capture_output=True,
        text=True,
        timeout=RPC_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == _png(mesh, ("ink", 0.8))
    refused = subprocess.run(
        [sys.executable, "-m", "stagemesh", "generate", "x", "--address", mesh.address, "--adapter", "nope"],
        capture_output=True,
        text=True,
        timeout=RPC_TIMEOUT_S,
    )
    assert refused.returncode == 1 and "'nope'" in refused.stderr

    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)

    def adapters(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "stagemesh", "adapters", "--address", mesh.address, "--token-file", str(token)]
        return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=RPC_TIMEOUT_S)

    loaded = adapters("--load", "ink7=ink.safetensors")
    assert loaded.returncode == 0 and loaded.stdout.startswith("ink7  stage 1 rank 0"), loaded.stderr
    listed = adapters().stdout.splitlines()
    assert any(line.startswith("ink7 ") and line.endswith("ink.safetensors") for line in listed), listed
    assert adapters("--unload", "ink7").stdout.strip() == "unloaded ink7 from stage(s) 1"
    gone = adapters("--unload", "ink7")
    assert gone.returncode == 1 and "'ink7'" in gone.stderr


@pytest.mark.mesh
def test_a_restarted_worker_holds_what_the_stage_holds(mesh):
    """Last in the file: it unloads lora_dir's `ink`. A killed diffusion worker comes back with
    lora_dir's adapters, drops the one unloaded since the start and loads the one loaded since."""
    import os
    import signal
    import time

    from tests.e2e.test_faults import child_pid
    from tests.e2e.test_lifecycle import worker_pids

    want = _png(mesh, ("ink", 1.0))
    _load(mesh, "ink6", "ink.safetensors")
    with mesh.channel() as channel:
        mesh.gateway(channel).UnloadAdapter(control_pb2.UnloadAdapterRequest(name="ink"), metadata=AUTH)
    stage = child_pid(mesh, "stage", 1)
    [worker] = worker_pids(stage)
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while True:  # the restart takes seconds; until then the stage answers UNAVAILABLE
        try:
            png = _png(mesh, ("ink6", 1.0))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
            time.sleep(0.5)
    assert png == want
    listed = _listed(mesh)
    assert "ink6" in listed and "ink" not in listed
    assert "adapter not restored" not in mesh.logs()

"""Real diffusers-format checkpoints through `stagemesh up --model`: tiny FLUX-style and
SD3-style pipelines built from diffusers' own classes (random weights, tokenizers made offline),
saved with `save_pretrained`, served with and without DLO and with the VAE as its own stage; the
images equal those of diffusers' own pipeline for the same prompt, size, steps, guidance and seed.

The three meshes start once for the module, in parallel. SD3 without DLO runs through the same
runners in this process (the mesh path is the FLUX one's), which keeps the file's start-up cost
to three meshes.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from PIL import Image

from stagemesh.core.params import Params
from stagemesh.gateway.images import encode_png
from stagemesh.stage_service.models.diffusers_adapter import FolderError, check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny
from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2
from tests.support.meshproc import REPO, Mesh, parallel_meshes, start_mesh
from tests.support.pictures import assert_same_picture
from tests.support.sleep_mesh import field_violations

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

RPC_TIMEOUT_S = 60.0
STAGE = """
[[stages]]
kind = "{kind}"
threads = 1
{extra}
"""
# name -> (family, [(kind, extra keys)]); model_dir comes from --model.
MESHES = {
    "flux": ("flux", [("encoder", ""), ("diffusion", "")]),
    "flux-dlo": (
        "flux",
        [("encoder", ""), ("diffusion", ("enable_dlo = true\ndlo_use_allgather = false\ndlo_resident_layers = 1"))],
    ),
    # The VAE as its own stage, after a denoising stage under DLO.
    "sd3-split-dlo": ("sd3", [("encoder", ""), ("denoise", "enable_dlo = true"), ("decode", "")]),
}
# (width, height, steps, guidance, seed, prompt); guidance 1.0 turns SD3's CFG off.
CASES = [(32, 32, 2, 3.5, 1, "a red fox"), (48, 32, 3, 1.0, 2, "rain on a tin roof")]


def _config(path: Path, stages) -> Path:
    tables = "".join(STAGE.format(kind=k, extra=e) for k, e in stages)
    path.write_text(f'[gateway]\nport = 0\n\n[cache]\nroot = "{path.parent / "cache"}"\n{tables}')
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diffusers")
    return {family: write_tiny(root / family, family) for family in ("flux", "sd3")}


@pytest.fixture(scope="module")
def meshes(folders, tmp_path_factory) -> dict[str, Mesh]:
    def start(name: str) -> Mesh:
        family, stages = MESHES[name]
        root = tmp_path_factory.mktemp(name)
        return start_mesh(_config(root / "mesh.toml", stages), root / "mesh.log", ("--model", str(folders[family])))

    # diffusers' own images are computed while the meshes load.
    starters = {name: functools.partial(start, name) for name in MESHES}
    with parallel_meshes(starters, while_starting=lambda: _reference(tuple(folders.items()))) as started:
        yield started


@pytest.fixture(scope="module")
def reference(folders) -> dict[tuple, torch.Tensor]:
    return _reference(tuple(folders.items()))


@functools.cache
def _reference(folders: tuple[tuple[str, Path], ...]) -> dict[tuple, torch.Tensor]:
    """diffusers' own pipeline, one process, loaded as any user would, one thread as the stages."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for family, folder in folders:
            pipe = diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)
            for case in CASES:
                width, height, steps, guidance, seed, prompt = case
                image = pipe(
                    prompt=prompt,
                    width=width,
                    height=height,
                    num_inference_steps=steps,
                    guidance_scale=guidance,
                    output_type="pt",
                    generator=torch.Generator().manual_seed(seed),
                ).images[0]
                out[family, case] = image.permute(1, 2, 0).float()
    finally:
        torch.set_num_threads(threads)
    return out


def _generate(m: Mesh, case, output_format=generation_pb2.OUTPUT_FORMAT_PNG):
    width, height, steps, guidance, seed, prompt = case
    params = generation_pb2.GenerationParams(
        prompt=prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        output_format=output_format,
    )
    with m.channel() as channel:
        reply = m.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S)
    return reply.result


@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.mesh
def test_image_equals_diffusers_own_pipeline(meshes, reference, name):
    family = MESHES[name][0]
    for case in CASES:
        want = reference[family, case]
        assert _generate(meshes[name], case).png == encode_png(want.numpy()), (name, case)
        got = tensors.from_proto(_generate(meshes[name], case, generation_pb2.OUTPUT_FORMAT_TENSOR).tensor)
        assert_same_picture(got, want, (name, case))


def test_runners_in_process_equal_diffusers_own_pipeline(folders, reference):
    """SD3 without DLO: the encoder and diffusion runners a mesh's workers would load."""
    from stagemesh.stage_service.models.runners import WorkItem, build_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encoder = build_runner("encoder", folders["sd3"])
        diffusion = build_runner("diffusion", folders["sd3"])
        for case in CASES:
            width, height, steps, guidance, seed, prompt = case
            item = WorkItem("r", Params(prompt, width, height, steps, guidance, seed, "tensor"))
            [item.inputs] = encoder.run([item])
            [out] = diffusion.run([item])
            assert torch.equal(out["image"], reference["sd3", case]), case
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("stream_dtype", ["float8_e4m3fn", "int8"])
def test_8_bit_streaming_stays_close_to_diffusers_own_pipeline(folders, reference, stream_dtype):
    """FLUX under DLO with 8-bit weight streaming (dlo_stream_dtype), in process: the Linear
    weights of the streamed blocks are rounded once to 8 bits, so close, not equal."""
    from stagemesh.stage_service.models.runners import WorkItem, build_runner
    from stagemesh.stage_service.settings import DloOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encoder = build_runner("encoder", folders["flux"])
        opts = DloOptions(enable_dlo=True, dlo_use_allgather=False, dlo_stream_dtype=stream_dtype)
        diffusion = build_runner("diffusion", folders["flux"], dlo=opts)
        stats = diffusion.offload.stats()
        # The checkpoint mapping is not streamed from: its quantised form is packed privately.
        assert stats.stream_dtype == stream_dtype and stats.host_mode == "packed"
        for case in CASES:
            width, height, steps, guidance, seed, prompt = case
            item = WorkItem("r", Params(prompt, width, height, steps, guidance, seed, "tensor"))
            [item.inputs] = encoder.run([item])
            [out] = diffusion.run([item])
            want = reference["flux", case]
            cosine = torch.nn.functional.cosine_similarity(out["image"].flatten(), want.flatten(), dim=0)
            psnr = 10 * torch.log10(1 / (out["image"] - want).pow(2).mean())
            print(f"{stream_dtype} vs diffusers {case[:2]}: cosine {float(cosine):.6f}, PSNR {float(psnr):.1f} dB")
            assert cosine >= 0.995 and psnr >= 40 and not torch.equal(out["image"], want), (case, float(psnr))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.mesh
def test_progress_events_per_denoising_step(meshes):
    params = generation_pb2.GenerationParams(prompt="a boat", width=32, height=32, num_inference_steps=3, seed=4)
    with meshes["sd3-split-dlo"].channel() as channel:
        events = list(
            meshes["sd3-split-dlo"]
            .gateway(channel)
            .Generate(gateway_pb2.GenerateRequest(params=params), timeout=RPC_TIMEOUT_S)
        )
    started = [(e.stage_started.stage_id, e.stage_started.kind) for e in events if e.HasField("stage_started")]
    steps = [
        (e.denoising_step.stage_id, e.denoising_step.step, e.denoising_step.total)
        for e in events
        if e.HasField("denoising_step")
    ]
    assert started == [(0, "encoder"), (1, "denoise"), (2, "decode")]
    assert steps == [(1, 1, 3), (1, 2, 3), (1, 3, 3)]
    assert events[-1].result.png.startswith(b"\x89PNG")


@pytest.mark.mesh
def test_size_off_the_pipelines_multiple_is_invalid_argument(meshes):
    # FLUX packs 2x2 latent patches: sizes must be multiples of 2 * the VAE scale factor (4).
    with pytest.raises(grpc.RpcError) as refused:
        _generate(meshes["flux"], (30, 32, 2, 3.5, 1, "a red fox"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.width" in refused.value.details() and "multiple of 4" in refused.value.details()


def _start_picture(width: int, height: int) -> bytes:
    """A deterministic starting image (colour gradients), as PNG bytes."""
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    return encode_png(torch.stack([xs, ys, (xs - ys).abs()], dim=-1).numpy())


@pytest.mark.mesh
def test_flux_img2img_through_the_mesh_equals_diffusers_img2img_pipeline(meshes, folders):
    start = _start_picture(48, 32)
    params = generation_pb2.GenerationParams(
        prompt="a red fox", init_image=start, strength=0.6, num_inference_steps=5, guidance_scale=3.5, seed=3
    )
    with meshes["flux"].channel() as channel:
        reply = (
            meshes["flux"]
            .gateway(channel)
            .GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S)
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stage's worker runs
    try:
        pipe = diffusers.FluxImg2ImgPipeline.from_pretrained(folders["flux"], local_files_only=True)
        want = pipe(
            prompt="a red fox",
            image=Image.open(io.BytesIO(start)).convert("RGB"),
            strength=0.6,
            width=48,
            height=32,
            num_inference_steps=5,
            guidance_scale=3.5,
            output_type="pt",
            generator=torch.Generator().manual_seed(3),
        ).images[0]
    finally:
        torch.set_num_threads(threads)
    assert (reply.result.width, reply.result.height) == (48, 32)  # the starting image's size
    assert reply.result.png == encode_png(want.permute(1, 2, 0).float().numpy())


@pytest.mark.mesh
def test_a_negative_prompt_on_flux_is_invalid_argument_naming_it(meshes):
    params = generation_pb2.GenerationParams(
        prompt="a red fox", negative_prompt="blurry", width=32, height=32, num_inference_steps=2, seed=1
    )
    with meshes["flux"].channel() as channel, pytest.raises(grpc.RpcError) as refused:
        meshes["flux"].gateway(channel).GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    violations = field_violations(refused.value)
    assert list(violations) == ["params.negative_prompt"], violations


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("name", ["flux", "flux-dlo"])
@pytest.mark.mesh
def test_sleep_and_wake_give_the_same_image(meshes, reference, name, level):
    m = meshes[name]
    want = _generate(m, CASES[0]).png
    with m.channel() as channel:
        stub = m.gateway(channel)
        slept = stub.Sleep(gateway_pb2.SleepRequest(stage_ids=[0, 1], level=level), timeout=RPC_TIMEOUT_S)
        assert [(a.stage_id, a.status, a.level) for a in slept.acks] == [
            (0, control_pb2.ACK_STATUS_SUCCESS, level),
            (1, control_pb2.ACK_STATUS_SUCCESS, level),
        ]
        assert all(a.freed_bytes > 0 for a in slept.acks)
        with pytest.raises(grpc.RpcError) as refused:
            _generate(m, CASES[0])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        woken = stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=RPC_TIMEOUT_S)
        assert all(a.status == control_pb2.ACK_STATUS_SUCCESS for a in woken.acks)
    # No AR stage: generation reopens by itself after the wake.
    assert _generate(m, CASES[0]).png == want


def _without(folder: Path, component: str, into: Path) -> Path:
    """A copy of `folder` (components linked, not copied) that lacks `component`."""
    into.mkdir()
    shutil.copy(folder / "model_index.json", into)
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name != component:
            os.symlink(entry, into / entry.name)
    return into


def test_a_folder_without_its_vae_is_refused_at_start(folders, tmp_path):
    broken = _without(folders["flux"], "vae", tmp_path / "no-vae")
    config = _config(tmp_path / "mesh.toml", [("encoder", ""), ("diffusion", "")])
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh", "up", "--config", str(config), "--model", str(broken)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    want = (
        f"checkpoint {broken} is missing component 'vae' (model_index.json lists it; expected folder {broken / 'vae'})"
    )
    assert want in done.stderr


def test_folder_errors_name_what_is_missing(folders, tmp_path):
    # The encoder stage needs no VAE: only the stages that load a component check it.
    no_vae = _without(folders["flux"], "vae", tmp_path / "no-vae")
    assert check_stage_folder(no_vae, "encoder").pipeline_class == "FluxPipeline"
    with pytest.raises(FolderError, match="missing component 'vae'"):
        check_stage_folder(no_vae, "decode")
    no_weights = _without(folders["sd3"], "transformer", tmp_path / "no-weights")
    (no_weights / "transformer").mkdir()
    shutil.copy(folders["sd3"] / "transformer" / "config.json", no_weights / "transformer")
    with pytest.raises(FolderError, match="component 'transformer' has no safetensors weights"):
        check_stage_folder(no_weights, "diffusion")
    with pytest.raises(FolderError, match="it has no model_index.json"):
        check_stage_folder(tmp_path, "encoder")
    unknown = _without(folders["flux"], "", tmp_path / "unknown-class")
    index = json.loads((unknown / "model_index.json").read_text())
    (unknown / "model_index.json").unlink()
    (unknown / "model_index.json").write_text(json.dumps({**index, "_class_name": "OtherPipeline"}))
    from stagemesh.stage_service.models.diffusers_adapter.families import family_of

    with pytest.raises(FolderError, match="'OtherPipeline' is not supported"):
        family_of(check_stage_folder(unknown, "encoder"))


def test_stage_order_and_kinds_are_checked_before_start(folders, tmp_path):
    from stagemesh import config

    def load(*kinds: str):
        return config.load(_config(tmp_path / "mesh.toml", [(k, "") for k in kinds]), folders["sd3"])

    assert [s.kind for s in load("encoder", "denoise", "decode").stages] == ["encoder", "denoise", "decode"]
    with pytest.raises(ValueError, match="last stage must be of kind 'diffusion' or 'decode'"):
        load("encoder", "denoise")
    with pytest.raises(ValueError, match="'decode' stage comes right after a 'denoise' stage"):
        load("encoder", "diffusion", "decode")
    with pytest.raises(ValueError, match="kind 'ar' cannot be served from a diffusers folder"):
        load("ar", "diffusion")
    # --model alone: the folder's encoder stage, then its diffusion stage.
    default = config.load(None, folders["flux"])
    assert [(s.kind, s.model_dir) for s in default.stages] == [
        ("encoder", str(folders["flux"])),
        ("diffusion", str(folders["flux"])),
    ]

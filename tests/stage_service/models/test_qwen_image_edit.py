"""Qwen-Image-Edit through a real mesh (`stagemesh up --model`): a tiny random-weight folder
written by `stagemesh synthesize --family qwen-image-edit` gives, for an image to edit and a
prompt, the PNG bytes of diffusers' QwenImageEditPipeline loaded from the same folder with the
same seed and arguments, over gRPC and HTTP's /v1/images/edits, with and without true CFG; a
request without the image, or with a strength, is INVALID_ARGUMENT naming the field.

The reference pipeline is given the processor the stage builds (vl_processor.load_processor:
the PIL image processor and the tokenizer, no video processor, which would need torchvision).
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from stagemesh.gateway.images import encode_png
from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import REPO, Mesh, parallel_meshes, start_mesh
from tests.support.sleep_mesh import field_violations

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

RPC_TIMEOUT_S = 120.0
CONFIG = """[gateway]
port = 0
http_port = 0

[cache]
root = "{cache}"

[[stages]]
kind = "encoder"
threads = 1

[[stages]]
kind = "diffusion"
threads = 1
"""
# (width, height, steps, true_cfg_scale, seed, prompt, negative prompt): true CFG runs only with
# a negative prompt (QwenImageEditPipeline's rule); the output has the edit image's size.
CASES = [(48, 32, 2, 4.0, 1, "make it night", "blurry"), (48, 32, 2, 4.0, 1, "make it night", "")]


def _edit_image(width: int, height: int) -> np.ndarray:
    return (np.random.default_rng(7).random((height, width, 3)) * 255).astype(np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _synthesize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", "synthesize", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen-image-edit") / "tiny"
    done = _synthesize("--family", "qwen-image-edit", "--size", "tiny", str(out))
    assert done.returncode == 0, done.stderr
    assert f"{out}: QwenImageEditPipeline (tiny, random weights)" in done.stdout
    return out


# (folder, case) -> diffusers' image: the mesh tests and the split test compare with the same ones.
_REFERENCES: dict[tuple[Path, tuple], torch.Tensor] = {}


def _reference(folder: Path, cases=tuple(CASES)) -> dict[tuple, torch.Tensor]:
    """diffusers' QwenImageEditPipeline from the folder, given the stage's processor, one thread
    as the stages run: [H, W, 3] float32 per case, each computed once."""
    missing = [case for case in cases if (folder, case) not in _REFERENCES]
    if missing:
        for case, image in _run_pipeline(folder, missing).items():
            _REFERENCES[folder, case] = image
    return {case: _REFERENCES[folder, case] for case in cases}


def _run_pipeline(folder: Path, cases: list[tuple]) -> dict[tuple, torch.Tensor]:
    from stagemesh.stage_service.models.diffusers_adapter.vl_processor import load_processor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        processor = load_processor(folder / "processor")
        pipe = diffusers.QwenImageEditPipeline.from_pretrained(folder, local_files_only=True, processor=processor)
        out = {}
        for case in cases:
            width, height, steps, guidance, seed, prompt, negative = case
            out[case] = pipe(
                image=Image.fromarray(_edit_image(width, height)),
                prompt=prompt,
                negative_prompt=negative or None,
                width=width,
                height=height,
                num_inference_steps=steps,
                true_cfg_scale=guidance,
                generator=torch.Generator().manual_seed(seed),
                output_type="pt",
            ).images[0]
        return {case: image.permute(1, 2, 0).float() for case, image in out.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory) -> Iterator[tuple[Mesh, dict]]:
    """The mesh, and diffusers' images computed while it starts."""
    root = tmp_path_factory.mktemp("edit-mesh")
    config = root / "mesh.toml"
    config.write_text(CONFIG.format(cache=root / "cache"))
    reference: dict = {}
    with parallel_meshes(
        {"edit": lambda: start_mesh(config, root / "mesh.log", ("--model", str(folder)))},
        while_starting=lambda: reference.update(_reference(folder)),
    ) as started:
        yield started["edit"], reference
        logs = started["edit"].logs()
        assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]


@pytest.fixture(scope="module")
def mesh(served) -> Mesh:
    return served[0]


@pytest.fixture(scope="module")
def reference(served) -> dict[tuple, torch.Tensor]:
    return served[1]


def _params(case, output_format=generation_pb2.OUTPUT_FORMAT_PNG, image=True, **extra):
    width, height, steps, guidance, seed, prompt, negative = case
    if image:
        extra["init_image"] = _png(_edit_image(width, height))
    return generation_pb2.GenerationParams(
        prompt=prompt,
        negative_prompt=negative,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        output_format=output_format,
        **extra,
    )


def _generate(m: Mesh, params: generation_pb2.GenerationParams):
    with m.channel() as channel:
        reply = m.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S)
    return reply.result


def test_the_folder_keeps_the_published_layout(folder):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    config = json.loads((folder / "processor" / "preprocessor_config.json").read_text())
    assert config["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (folder / "processor" / "tokenizer.json").is_file()


def test_the_processor_is_built_without_a_video_processor(folder):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from stagemesh.stage_service.models.diffusers_adapter.vl_processor import load_processor

    processor = load_processor(folder / "processor")
    assert isinstance(processor, transformers.Qwen2VLProcessor)
    assert type(processor.image_processor) is Qwen2VLImageProcessorPil
    assert not hasattr(processor, "video_processor")
    # The image becomes its grid of patches and as many image tokens as merged patches.
    text = ["<|vision_start|><|image_pad|><|vision_end|>x"]
    inputs = processor(text=text, images=Image.new("RGB", (64, 48)), return_tensors="pt")
    grid = inputs["image_grid_thw"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (inputs["input_ids"][0] == pad).sum().item() == grid[0] * grid[1] * grid[2] // 4


@pytest.mark.mesh
def test_an_edit_equals_diffusers_own_pipeline(mesh, reference):
    got = {}
    for case in CASES:
        want = reference[case]
        assert _generate(mesh, _params(case)).png == encode_png(want.numpy()), case
        got[case] = tensors.from_proto(_generate(mesh, _params(case, generation_pb2.OUTPUT_FORMAT_TENSOR)).tensor)
        assert torch.equal(got[case], want), (case, (got[case] - want).abs().max())
    # The negative prompt steers (true CFG). On the tensor path: on these random weights the
    # guided and unguided images differ by less than one 8-bit step.
    assert not torch.equal(*got.values())


@pytest.mark.mesh
def test_http_images_edits_gives_the_same_png(mesh, reference):
    case = CASES[0]
    width, height, steps, guidance, seed, prompt, negative = case
    form = {
        "prompt": prompt,
        "negative_prompt": negative,
        "seed": str(seed),
        "num_inference_steps": str(steps),
        "guidance_scale": str(guidance),
    }
    files = {"image": ("edit.png", _png(_edit_image(width, height)), "image/png")}
    reply = httpx.post(f"http://{mesh.http_address}/v1/images/edits", data=form, files=files, timeout=RPC_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["size"] == f"{width}x{height}"
    assert base64.b64decode(body["data"][0]["b64_json"]) == encode_png(reference[case].numpy())


@pytest.mark.mesh
def test_an_edit_without_its_image_is_invalid_argument_naming_it(mesh):
    with pytest.raises(grpc.RpcError) as refused:
        _generate(mesh, _params(CASES[1], image=False, width=48, height=32))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert list(field_violations(refused.value)) == ["params.init_image"]
    # The same over HTTP: a generation (no image) names the edit's `image` field.
    reply = httpx.post(
        f"http://{mesh.http_address}/v1/images/generations",
        json={"prompt": "a red hat", "size": "48x32"},
        timeout=RPC_TIMEOUT_S,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "image", reply.text


@pytest.mark.mesh
def test_a_strength_is_invalid_argument_for_an_edit(mesh):
    with pytest.raises(grpc.RpcError) as refused:
        _generate(mesh, _params(CASES[1], strength=0.5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert list(field_violations(refused.value)) == ["params.strength"]


def test_split_denoise_under_dlo_and_decode_equal_diffusers(folder):
    """The denoise stage (transformer blocks streamed by DLO) hands latents to the decode stage,
    whose image is diffusers' within the last bits DLO's aligned weight copies round to on the
    CPU (docs/MODELS.md, "Layerwise offload")."""
    from stagemesh.core.params import Params
    from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT, WorkItem
    from stagemesh.stage_service.models.diffusers_adapter import build_runner
    from stagemesh.stage_service.settings import DloOptions

    width, height, steps, guidance, seed, prompt, negative = case = CASES[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        image = torch.from_numpy(_edit_image(width, height))
        params = Params(prompt, width, height, steps, guidance, seed, "tensor", negative_prompt=negative)
        work = WorkItem("r", params, {INIT_IMAGE_INPUT: image})
        [embeddings] = build_runner("encoder", folder).run([work])
        work.inputs.update(embeddings)
        dlo = DloOptions(enable_dlo=True, dlo_use_allgather=False)
        [latents] = build_runner("denoise", folder, dlo=dlo).run([work])
        [split] = build_runner("decode", folder).run([WorkItem("r", params, latents)])
        torch.testing.assert_close(split["image"], _reference(folder, [case])[case], rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_full_size_is_qwen_image_at_its_published_dimensions(folder, tmp_path):
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import _empty, full_components

    transformer = _empty(full_components("qwen-image-edit", folder, text_layers=1)["transformer"])
    assert sum(p.numel() for p in transformer.parameters()) / 1e9 == pytest.approx(20.43, abs=0.01)

"""FLUX.2 [dev] (Flux2Pipeline, Mistral3 text encoder) as a served family.

A tiny random-weight folder written by `stagemesh synthesize --family flux2` (the published
layout: its tokenizer the PixtralProcessor's files) served by `stagemesh up --model` gives the
PNG bytes of diffusers' own Flux2Pipeline loaded from that folder, with the same seed and
arguments. PixtralProcessor cannot be built without torchvision (not installed), so both sides
read the prompt through prompt_processor.TextProcessor loaded from the folder's tokenizer files,
which runs ProcessorMixin's text path as PixtralProcessor does. The denoise -> decode split under
DLO (the pipeline's packed latents unpacked by the decode stage) equals the resident bytes.

One mesh for the module (encoder -> diffusion, resident); diffusers' reference is computed while
it starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from stagemesh.gateway.images import encode_png
from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import REPO, Mesh, parallel_meshes, start_mesh
from tests.support.sleep_mesh import field_violations

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

RPC_TIMEOUT_S = 120.0
# (width, height, steps, guidance, seed, prompt): guidance is an embedding, every step one pass.
CASES = [(32, 32, 2, 4.0, 1, "a red fox"), (48, 32, 2, 2.5, 2, "rain on a tin roof")]
OTHER_PROMPT = (32, 32, 2, 4.0, 1, "a boat")  # CASES[0] but the prompt
OTHER_GUIDANCE = (32, 32, 2, 1.5, 1, "a red fox")  # CASES[0] but the guidance
CONFIG = """[gateway]
port = 0

[cache]
root = "{cache}"

[[stages]]
kind = "encoder"
threads = 1

[[stages]]
kind = "diffusion"
threads = 1
"""


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
    out = tmp_path_factory.mktemp("flux2") / "tiny"
    done = _synthesize("--family", "flux2", "--size", "tiny", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{out}: Flux2Pipeline (tiny, random weights)" in done.stdout
    return out


def _reference_pipeline(folder: Path):
    """Flux2Pipeline from the folder, as a user without torchvision loads it: the processor
    model_index.json names cannot be built, so it is given the one built from its files."""
    from stagemesh.stage_service.models.diffusers_adapter.prompt_processor import load_text_processor

    pipe = diffusers.Flux2Pipeline.from_pretrained(folder, local_files_only=True, tokenizer=None)
    pipe.tokenizer = load_text_processor(folder / "tokenizer")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers_image(pipe, case) -> torch.Tensor:
    width, height, steps, guidance, seed, prompt = case
    out = pipe(
        prompt=prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        output_type="pt",
        generator=torch.Generator().manual_seed(seed),
    ).images
    return out[0].permute(1, 2, 0).float()


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    """(the mesh, diffusers' images by case), the latter computed on one thread (as the stages
    run) while the mesh starts."""
    root = tmp_path_factory.mktemp("flux2-mesh")
    config = root / "mesh.toml"
    config.write_text(CONFIG.format(cache=root / "cache"))
    reference: dict[tuple, torch.Tensor] = {}

    def compute() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            pipe = _reference_pipeline(folder)
            for case in [*CASES, OTHER_PROMPT, OTHER_GUIDANCE]:
                reference[case] = _diffusers_image(pipe, case)
        finally:
            torch.set_num_threads(threads)

    def start() -> Mesh:
        return start_mesh(config, root / "mesh.log", ("--model", str(folder)))

    with parallel_meshes({"flux2": start}, while_starting=compute) as started:
        yield started["flux2"], reference


def _params(case, output_format=generation_pb2.OUTPUT_FORMAT_PNG, **extra) -> generation_pb2.GenerationParams:
    width, height, steps, guidance, seed, prompt = case
    return generation_pb2.GenerationParams(
        prompt=prompt,
        width=width,
        height=height,
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


def test_the_folder_has_flux2_devs_published_layout(folder):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline"
    assert index["tokenizer"] == ["transformers", "PixtralProcessor"]
    assert index["text_encoder"] == ["transformers", "Mistral3ForConditionalGeneration"]
    processor = json.loads((folder / "tokenizer" / "processor_config.json").read_text())
    assert processor["processor_class"] == "PixtralProcessor"
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    assert transformer["guidance_embeds"] is True
    text = json.loads((folder / "text_encoder" / "config.json").read_text())["text_config"]
    # hidden states 10, 20 and 30 are stacked: the transformer reads 3 x the LM's width
    assert text["num_hidden_layers"] >= 30 and transformer["joint_attention_dim"] == 3 * text["hidden_size"]


@pytest.mark.mesh
def test_image_equals_diffusers_own_pipeline(served):
    mesh, reference = served
    for case in CASES:
        want = reference[case]
        assert _generate(mesh, _params(case)).png == encode_png(want.numpy()), case
        got = tensors.from_proto(_generate(mesh, _params(case, generation_pb2.OUTPUT_FORMAT_TENSOR)).tensor)
        assert torch.equal(got, want), (case, (got - want).abs().max())


@pytest.mark.mesh
def test_the_prompt_and_the_guidance_embedding_steer_the_image(served):
    """The prompt reaches the transformer past the system message (512 tokens hold both), and
    the guidance scale is an input even at one pass a step."""
    mesh, reference = served
    base = _generate(mesh, _params(CASES[0])).png
    for case in (OTHER_PROMPT, OTHER_GUIDANCE):
        png = _generate(mesh, _params(case)).png
        assert png == encode_png(reference[case].numpy()), case
        assert png != base, case


@pytest.mark.mesh
def test_a_negative_prompt_or_a_starting_image_is_invalid_argument_naming_it(served):
    mesh, _ = served
    with pytest.raises(grpc.RpcError) as refused:
        _generate(mesh, _params(CASES[0], negative_prompt="blurry"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert list(field_violations(refused.value)) == ["params.negative_prompt"]
    start = encode_png(torch.rand(32, 32, 3).numpy())
    with pytest.raises(grpc.RpcError) as refused:
        # FLUX.2's `image` conditions on a reference picture; it is no start to noise.
        _generate(mesh, _params(CASES[0], init_image=start, strength=0.5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "params.init_image" in field_violations(refused.value)


def test_denoise_under_dlo_then_decode_equals_the_resident_stage(folder):
    """The denoise stage hands on Flux2Pipeline's packed latents; the decode stage's tail
    (unpacking by position ids, the VAE's batch-norm scale, unpatching) gives the image the
    resident diffusion stage gives, PNG for PNG."""
    from stagemesh.core.params import Params
    from stagemesh.stage_service.models.contract import WorkItem
    from stagemesh.stage_service.models.diffusers_adapter import build_runner
    from stagemesh.stage_service.settings import DloOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = WorkItem("r", Params("a red fox", 48, 32, 2, 4.0, 3, "tensor"))
        [work.inputs] = build_runner("encoder", folder).run([work])
        [resident] = build_runner("diffusion", folder).run([work])
        dlo = DloOptions(enable_dlo=True, dlo_use_allgather=False)
        denoise = build_runner("denoise", folder, dlo=dlo)
        assert denoise.offload is not None
        [latents] = denoise.run([work])
        # packed: (48 / 4) x (32 / 4) tokens (the tiny VAE halves the side, then 2 x 2 patches)
        assert latents["latents"].shape == (12 * 8, 16)
        [split] = build_runner("decode", folder).run([WorkItem("r", work.params, latents)])
        assert encode_png(split["image"].numpy()) == encode_png(resident["image"].numpy())
        # On the CPU, DLO's aligned block copies may round the last bits differently (MODELS.md).
        torch.testing.assert_close(split["image"], resident["image"], rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_prompt_processor_takes_text_only(folder):
    from stagemesh.stage_service.models.diffusers_adapter.prompt_processor import load_text_processor

    processor = load_text_processor(folder / "tokenizer")
    with pytest.raises(ValueError, match="takes text only"):
        processor(images=[torch.zeros(3, 14, 14)], text=["[IMG]"])


def test_full_size_is_flux2_devs_published_dimensions(folder):
    """On meta: the 32 B transformer with its guidance embedding, and Mistral Small 3.1's
    width with at least 31 layers (hidden state 30 is read before the final norm)."""
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import (
        FULL_SIZE_FAMILIES,
        _empty,
        full_components,
    )

    assert "flux2" in FULL_SIZE_FAMILIES
    parts = full_components("flux2", folder, text_layers=2)
    transformer: Any = _empty(parts["transformer"])
    assert sum(p.numel() for p in transformer.parameters()) / 1e9 == pytest.approx(32.22, abs=0.01)
    config = transformer.config
    assert (config.num_layers, config.num_single_layers, config.num_attention_heads) == (8, 48, 48)
    assert config.guidance_embeds and config.joint_attention_dim == 15360
    text_encoder: Any = _empty(parts["text_encoder"])
    text = text_encoder.config.text_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (5120, 32768, 31)
    assert 3 * text.hidden_size == config.joint_attention_dim
    published: Any = _empty(full_components("flux2", folder, text_layers=None)["text_encoder"])
    assert published.config.text_config.num_hidden_layers == 40

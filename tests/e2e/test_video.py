"""Wan 2.2 video through real meshes (`stagemesh up --model`): tiny text-to-video and
image-to-video folders built from diffusers' own classes (random weights, two experts split at
boundary_ratio, tokenizer made offline), served whole, and split with the transformer under DLO
and the VAE as its own stage. The frames equal those of diffusers' WanPipeline /
WanImageToVideoPipeline loaded from the same folder with the same arguments and seed: byte for
byte on the tensor path, within a stated PSNR through H.264 (lossy) and animated WebP.

The same meshes answer the HTTP API's video jobs, through the openai SDK's videos client and
through curl, and the CLI's `generate --video`.
"""

from __future__ import annotations

import functools
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from stagemesh.client import Client
from stagemesh.core.params import DEFAULT_QUALITY
from stagemesh.gateway.videos import decode_mp4, encode_video
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2
from tests.support.meshproc import REPO, Mesh, parallel_meshes, start_mesh
from tests.support.sleep_mesh import field_violations

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("av")
pytest.importorskip("ftfy")  # WanImageToVideoPipeline's prompt cleaning

from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny  # noqa: E402

# The openai SDK warns on every videos call that OpenAI's own hosted video API is to close.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RPC_TIMEOUT_S = 120.0
# Small enough that the tensor results of CASES come in several ResultChunk events.
CHUNK_BYTES = 16384
GATEWAY = f"[gateway]\nport = 0\nhttp_port = 0\nresult_chunk_bytes = {CHUNK_BYTES}\nmax_video_jobs = 8\n"
STAGE = '\n[[stages]]\nkind = "{kind}"\nthreads = 1\n{extra}'
MESHES = {
    "t2v": ("t2v", [("encoder", ""), ("diffusion", "")]),
    # The denoising stage streams both experts' blocks (DLO); the VAE decodes in its own stage.
    "t2v-split-dlo": (
        "t2v",
        [("encoder", ""), ("denoise", "enable_dlo = true\ndlo_use_allgather = false"), ("decode", "")],
    ),
    "i2v": ("i2v", [("encoder", ""), ("diffusion", "")]),
}
# (width, height, num_frames, steps, guidance, seed, prompt, negative prompt); guidance 1.0 runs
# without the unconditional pass. The UniPC schedule of 2 steps has t = 999 (the high-noise
# expert, above boundary_ratio 0.875) then 750 (the low-noise one): both experts run.
CASES = [
    (32, 32, 5, 2, 3.0, 1, "a red fox", "blurry"),
    (48, 32, 9, 2, 1.0, 2, "rain on a tin roof", ""),
]
# H.264 (yuv420p, CRF 5 at the default quality 90) and WebP at quality 90 against the exact
# frames quantised to 8 bits: measured about 40 dB and 33 dB on these random-weight videos.
MP4_MIN_PSNR_DB = 30.0
WEBP_MIN_PSNR_DB = 25.0


def _config(path: Path, stages) -> Path:
    tables = "".join(STAGE.format(kind=k, extra=e) for k, e in stages)
    path.write_text(f'{GATEWAY}\n[cache]\nroot = "{path.parent / "cache"}"\n{tables}')
    return path


def _start_image(width: int, height: int) -> bytes:
    pixels = (np.random.default_rng(7).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan")
    return {"t2v": write_tiny(root / "t2v", "wan"), "i2v": write_tiny(root / "i2v", "wan-i2v")}


@pytest.fixture(scope="module")
def meshes(folders, tmp_path_factory) -> dict[str, Mesh]:
    def start(name: str) -> Mesh:
        family, stages = MESHES[name]
        root = tmp_path_factory.mktemp(name)
        return start_mesh(_config(root / "mesh.toml", stages), root / "mesh.log", ("--model", str(folders[family])))

    with parallel_meshes({name: functools.partial(start, name) for name in MESHES}) as started:
        yield started


@functools.cache
def _pipeline(folder: Path):
    return diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)


@functools.cache
def reference(folder: Path, case, image: bytes | None = None) -> np.ndarray:
    """diffusers' own pipeline, loaded as a user would, one thread as the stages: float32
    [frames, height, width, 3] in [0, 1]. Computed once per arguments (several tests compare
    against the same video); read-only, so that no test can change another's reference."""
    frames = _reference(folder, case, image)
    frames.setflags(write=False)
    return frames


def _reference(folder: Path, case, image: bytes | None) -> np.ndarray:
    width, height, frames, steps, guidance, seed, prompt, negative = case
    extra = {"image": Image.open(io.BytesIO(image))} if image is not None else {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _pipeline(folder)(
            prompt=prompt,
            negative_prompt=negative or None,
            width=width,
            height=height,
            num_frames=frames,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            **extra,
        ).frames[0]
    finally:
        torch.set_num_threads(threads)


def _params(case, output_format=generation_pb2.OUTPUT_FORMAT_TENSOR, image: bytes = b""):
    width, height, frames, steps, guidance, seed, prompt, negative = case
    return generation_pb2.GenerationParams(
        prompt=prompt,
        negative_prompt=negative or None,
        width=width,
        height=height,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        output_format=output_format,
        init_image=image,
    )


def _unary(mesh: Mesh, params) -> generation_pb2.GenerationResult:
    with mesh.channel() as channel:
        request = gateway_pb2.GenerateUnaryRequest(params=params)
        return mesh.gateway(channel).GenerateUnary(request, timeout=RPC_TIMEOUT_S).result


def _as_array(result: generation_pb2.GenerationResult) -> np.ndarray:
    tensor = result.tensor
    assert tensor.dtype == "float32"
    return np.frombuffer(tensor.data, dtype="<f4").reshape(tuple(tensor.shape))


def psnr(decoded: np.ndarray, frames: np.ndarray) -> float:
    """Of 8-bit frames against float frames in [0, 1] quantised as the gateway does."""
    exact = (frames.astype(np.float32) * np.float32(255.0)).round().clip(0, 255)
    mse = float(np.mean((decoded.astype(np.float64) - exact) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.mesh
@pytest.mark.parametrize("name", ["t2v", "t2v-split-dlo"])
@pytest.mark.parametrize("case", CASES, ids=["guided", "unguided"])
def test_frames_equal_wan_pipeline(meshes, folders, name, case):
    result = _unary(meshes[name], _params(case))
    width, height, frames = case[:3]
    assert (result.num_frames, result.fps, result.width, result.height) == (frames, 16, width, height)
    got = _as_array(result)
    assert got.shape == (frames, height, width, 3)
    want = reference(folders["t2v"], case)
    assert got.tobytes() == want.astype(np.float32).tobytes()


@pytest.mark.mesh
def test_image_to_video_equals_pipeline(meshes, folders):
    case = CASES[0]
    image = _start_image(case[0], case[1])
    result = _unary(meshes["i2v"], _params(case, image=image))
    assert _as_array(result).tobytes() == reference(folders["i2v"], case, image).astype(np.float32).tobytes()


@pytest.mark.mesh
def test_large_result_streams_in_chunks_with_progress(meshes, folders):
    """Generate sends the tensor in ResultChunk events of at most result_chunk_bytes, then a
    result event without payload; the client puts them back together."""
    case = CASES[1]
    with meshes["t2v"].channel() as channel:
        stream = (
            meshes["t2v"]
            .gateway(channel)
            .Generate(gateway_pb2.GenerateRequest(params=_params(case)), timeout=RPC_TIMEOUT_S)
        )
        events = list(stream)
    chunks = [e.result_chunk for e in events if e.HasField("result_chunk")]
    (result,) = [e.result for e in events if e.HasField("result")]
    total = case[2] * case[1] * case[0] * 3 * 4
    assert len(chunks) == -(-total // CHUNK_BYTES)
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert result.chunked_bytes == total and result.tensor.data == b""
    assert [c.offset for c in chunks] == list(range(0, total, CHUNK_BYTES))
    want = reference(folders["t2v"], case).astype(np.float32).tobytes()
    assert b"".join(c.data for c in chunks) == want
    steps = [(e.denoising_step.step, e.denoising_step.total) for e in events if e.HasField("denoising_step")]
    assert steps == [(1, 2), (2, 2)]

    seen = []
    with Client(meshes["t2v"].address) as client:
        video = client.generate_video(
            case[6], width=case[0], height=case[1], num_frames=case[2], steps=case[3], guidance_scale=case[4],
            seed=case[5], output_format="tensor", on_progress=seen.append,
        )  # fmt: skip
    assert video.frames.tobytes() == want
    assert any(getattr(e, "step", None) == 2 for e in seen)


@pytest.mark.mesh
def test_mp4_and_animated_webp(meshes, folders):
    case = CASES[0]
    want = reference(folders["t2v"], case)
    with Client(meshes["t2v"].address) as client:
        mp4 = client.generate_video(case[6], negative_prompt=case[7], width=32, height=32, num_frames=5, steps=2,
                                    guidance_scale=3.0, seed=1)  # fmt: skip
        webp = client.generate_video(case[6], negative_prompt=case[7], width=32, height=32, num_frames=5, steps=2,
                                     guidance_scale=3.0, seed=1, output_format="webp", fps=8)  # fmt: skip
    assert mp4.format == "mp4" and mp4.bytes[4:8] == b"ftyp"
    frames, rate = decode_mp4(mp4.bytes)
    assert frames.shape == want.shape and rate == 16.0
    assert psnr(frames, want) >= MP4_MIN_PSNR_DB
    # The stage sends the frames as uint8 pixels: the MP4 is the one the gateway's encoder makes
    # of the pipeline's float frames (decoded, since a last-bit difference of a float frame, see
    # tests/support/pictures.py, can move a pixel by one level and so the stream's bytes).
    ours, _ = decode_mp4(encode_video(want, "mp4", 16, DEFAULT_QUALITY))
    assert np.mean((frames.astype(np.float64) - ours) ** 2) <= 1.0  # 0 where the floats agree bit for bit
    with Image.open(io.BytesIO(webp.bytes)) as animation:
        animation.load()  # a frame's duration is known once it is read
        assert (animation.format, animation.n_frames, animation.info["duration"]) == ("WEBP", 5, 125)
    assert psnr(webp.frames, want) >= WEBP_MIN_PSNR_DB


@pytest.mark.mesh
@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"num_frames": 6}, "params.num_frames", "4k + 1 from 1 to 81 (1, 5, 9, 13, ... 81)"),
        ({"num_frames": 85}, "params.num_frames", "4k + 1 from 1 to 81"),
        ({"output_format": generation_pb2.OUTPUT_FORMAT_PNG}, "params.output_format", "MP4"),
        ({"strength": 0.5}, "params.strength", "allowed: unset"),
        ({"fps": 0}, "params.fps", "1 to 120"),
    ],
)
def test_refuses_what_wan_cannot_take(meshes, change, field, says):
    params = _params(CASES[0])
    for name, value in change.items():
        setattr(params, name, value)
    with pytest.raises(grpc.RpcError) as caught:
        _unary(meshes["t2v"], params)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in field_violations(caught.value)[field]


@pytest.mark.mesh
def test_text_to_video_refuses_a_start_image(meshes):
    with pytest.raises(grpc.RpcError) as caught:
        _unary(meshes["t2v"], _params(CASES[0], image=_start_image(32, 32)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot start from an image" in field_violations(caught.value)["params.init_image"]


def _openai(mesh: Mesh):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(api_key="unused", base_url=f"http://{mesh.http_address}/v1", max_retries=0)


@pytest.mark.mesh
def test_openai_sdk_video_job(meshes, folders):
    import openai

    case = CASES[0]
    client = _openai(meshes["t2v"])
    knobs = {"num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 1, "negative_prompt": "blurry"}
    job = client.videos.create(prompt=case[6], size="32x32", extra_body=knobs)
    assert job.status in ("queued", "in_progress") and job.id.startswith("video_")
    done = client.videos.poll(job.id, poll_interval_ms=100)
    assert (done.status, done.progress, done.size, done.seconds) == ("completed", 100, "32x32", "0.3125")
    assert done.expires_at is not None and done.completed_at is not None
    mp4 = client.videos.download_content(job.id).read()
    frames, _ = decode_mp4(mp4)
    assert psnr(frames, reference(folders["t2v"], case)) >= MP4_MIN_PSNR_DB
    assert job.id in [v.id for v in client.videos.list()]
    deleted = client.videos.delete(job.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (job.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="x", size="32x32", extra_body={"num_frames": 6})
    assert refused.value.body["param"] == "num_frames" and "4k + 1" in refused.value.body["message"]


@pytest.mark.mesh
def test_openai_sdk_image_to_video_with_input_reference(meshes, folders):
    case = CASES[0]
    image = _start_image(32, 32)
    client = _openai(meshes["i2v"])
    knobs = {"num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 1, "negative_prompt": "blurry"}
    job = client.videos.create(prompt=case[6], input_reference=("start.png", image, "image/png"), extra_body=knobs)
    assert client.videos.poll(job.id, poll_interval_ms=100).status == "completed"
    frames, _ = decode_mp4(client.videos.download_content(job.id).read())
    assert psnr(frames, reference(folders["i2v"], case, image)) >= MP4_MIN_PSNR_DB


def _curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True, check=True)


def _wait_for(base: str, job_id: str) -> dict:
    """Poll the job until it finishes (its own progress, not a measured time)."""
    for _ in range(600):
        job = json.loads(_curl(f"{base}/videos/{job_id}").stdout)
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {job}")


@pytest.mark.mesh
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_json_and_multipart(meshes, folders, tmp_path):
    base = f"http://{meshes['i2v'].http_address}/v1"
    body = {"prompt": "a red fox", "seconds": 0.25, "fps": 16, "num_inference_steps": 2, "seed": 1, "size": "32x32"}
    # Image-to-video needs its start image: JSON cannot carry it (only a form's file field can).
    refused = json.loads(_curl("-X", "POST", f"{base}/videos", "-H", "content-type: application/json",
                               "-d", json.dumps(body)).stdout)  # fmt: skip
    assert refused["error"]["param"] == "input_reference", refused
    start = tmp_path / "start.png"
    start.write_bytes(_start_image(32, 32))
    form = [x for k, v in body.items() for x in ("-F", f"{k}={v}")]
    job = json.loads(_curl("-X", "POST", f"{base}/videos", *form, "-F", f"input_reference=@{start}").stdout)
    assert (job["object"], job["num_frames"], job["fps"]) == ("video", 5, 16), job
    assert _wait_for(base, job["id"])["status"] == "completed"
    out = tmp_path / "out.mp4"
    _curl("-o", str(out), f"{base}/videos/{job['id']}/content")
    frames, _ = decode_mp4(out.read_bytes())
    # 0.25 s at 16 fps is 5 frames; guidance unset is the stage's default_guidance (4.0).
    case = (32, 32, 5, 2, 4.0, 1, "a red fox", "")
    assert psnr(frames, reference(folders["i2v"], case, start.read_bytes())) >= MP4_MIN_PSNR_DB
    deleted = json.loads(_curl("-X", "DELETE", f"{base}/videos/{job['id']}").stdout)
    assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}


@pytest.mark.mesh
def test_deleting_a_running_job_frees_its_stage(meshes):
    """A long job deleted while it denoises: its stage call is cancelled (the stage's queue
    empties and its Execute never completes) and the next job runs."""
    mesh = meshes["t2v"]
    client = _openai(mesh)
    knobs = {"num_frames": 81, "num_inference_steps": 100, "seed": 3}
    created = client.videos.with_raw_response.create(prompt="a long one", size="128x128", extra_body=knobs)
    job, request_id = created.parse(), created.headers["x-request-id"]
    with mesh.channel() as channel:
        gateway = mesh.gateway(channel)

        def queued() -> list[int]:
            return [s.queue_depth for s in gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=10).stages]

        for _ in range(600):  # until the denoising stage reports a step
            if client.videos.retrieve(job.id).progress > 0:
                break
            time.sleep(0.05)
        assert queued()[1] == 1 and client.videos.retrieve(job.id).progress < 50
        client.videos.delete(job.id)
        for _ in range(600):
            if not any(queued()):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the deleted job's stage work was not freed")
    executes = [
        line
        for line in mesh.logs().splitlines()
        if request_id in line and '"Execute"' in line and '"stage-1"' in line and "rpc done" in line
    ]
    assert executes == [], "the denoising stage finished the deleted job"
    short = client.videos.create(prompt="after", size="32x32", extra_body={"num_frames": 1, "num_inference_steps": 1})
    assert client.videos.poll(short.id, poll_interval_ms=100).status == "completed"


@pytest.mark.mesh
def test_cli_generate_video(meshes, tmp_path):
    out = tmp_path / "fox.mp4"
    flags = ["--video", "--size", "32", "--frames", "5", "--steps", "2", "--seed", "1", "-o", str(out)]
    command = [sys.executable, "-m", "stagemesh", "generate", "a red fox", "--address", meshes["t2v"].address, *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RPC_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert "denoising [" in done.stderr and "5 frames at 16 fps" in done.stdout
    frames, rate = decode_mp4(out.read_bytes())
    assert frames.shape == (5, 32, 32, 3) and rate == 16.0


@pytest.mark.mesh
def test_a_video_past_grpcs_message_limit_streams_and_unary_refuses_it(meshes):
    """81 frames of 272 x 256 as float32 are 67.7 MB, past the 64 MiB one message may hold: the
    stage hands them to the gateway in one shared-memory segment (`stagemesh up`; in pieces of whole
    frames otherwise: test_output_messages.py), Generate hands them on in chunks,
    and GenerateUnary, which cannot chunk, refuses naming Generate."""
    params = generation_pb2.GenerationParams(
        prompt="a long one", width=272, height=256, num_frames=81, num_inference_steps=1, guidance_scale=1.0,
        seed=4, output_format=generation_pb2.OUTPUT_FORMAT_TENSOR,
    )  # fmt: skip
    total = 81 * 256 * 272 * 3 * 4
    assert total > 64 * 1024 * 1024
    with Client(meshes["t2v"].address) as client:
        video = client.generate_video(
            "a long one", width=272, height=256, num_frames=81, steps=1, guidance_scale=1.0, seed=4,
            output_format="tensor",
        )  # fmt: skip
    assert video.frames.shape == (81, 256, 272, 3) and video.frames.nbytes == total
    with pytest.raises(grpc.RpcError) as caught:
        _unary(meshes["t2v"], params)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "call Generate" in caught.value.details()


@pytest.mark.mesh
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_frames(meshes, folders, level):
    """Both experts, the VAE and (split with DLO) the streamed blocks' engines sleep and come
    back: level 2 reloads each from its own safetensors files."""
    mesh = meshes["t2v-split-dlo"]
    stages = [0, 1, 2]
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        slept = stub.Sleep(gateway_pb2.SleepRequest(stage_ids=stages, level=level), timeout=RPC_TIMEOUT_S)
        assert [(a.stage_id, a.status) for a in slept.acks] == [(s, control_pb2.ACK_STATUS_SUCCESS) for s in stages]
        assert all(a.freed_bytes > 0 for a in slept.acks)
        woken = stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=stages), timeout=RPC_TIMEOUT_S)
        assert all(a.status == control_pb2.ACK_STATUS_SUCCESS for a in woken.acks)
    got = _as_array(_unary(mesh, _params(CASES[0])))
    # Woken, the weights are re-read into new buffers: the same values, aligned anew (see
    # tests/support/pictures.py); frames are checked to their last bits, as pictures.
    want = reference(folders["t2v"], CASES[0]).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

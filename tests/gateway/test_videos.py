"""The gateway's video side without a mesh: frames to MP4 (PyAV) and animated WebP and back, and
the video job store's bounds (number, age, retention) and cancellation. The jobs run over a
stand-in for the pipeline's generate() (an async generator of the same events): the HTTP tests in
tests/e2e/test_video.py run them over a real mesh."""

from __future__ import annotations

import asyncio
import io
import time

import numpy as np
import pytest
from PIL import Image, ImageSequence

from stagemesh.core import errors
from stagemesh.core.events import DenoisingStep
from stagemesh.core.params import Params
from stagemesh.gateway import videos
from stagemesh.gateway.video_jobs import COMPLETED, FAILED, VideoJobs
from stagemesh.v1 import generation_pb2

pytest.importorskip("av")


def _clip(frames: int = 9, size: int = 48) -> np.ndarray:
    """A smooth moving gradient in [0, 1]: what H.264 keeps well."""
    y, x = np.mgrid[0:size, 0:size] / size
    return np.stack([np.stack([(x + t / frames) % 1, y, np.full_like(x, 0.4)], -1) for t in range(frames)])


def _psnr(decoded: np.ndarray, frames: np.ndarray) -> float:
    exact = videos.to_uint8(frames).astype(np.float64)
    return float(10 * np.log10(255.0**2 / np.mean((decoded.astype(np.float64) - exact) ** 2)))


def test_mp4_decodes_back_to_its_frames_and_rate():
    clip = _clip()
    data = videos.encode_video(clip, "mp4", fps=12, quality=90)
    frames, rate = videos.decode_mp4(data)
    assert frames.shape == (9, 48, 48, 3) and rate == 12.0
    assert _psnr(frames, clip) > 28  # 4:2:0 chroma blurs the wrap-around edge: about 31 dB


def test_quality_sets_the_crf():
    assert (videos.crf_for(100), videos.crf_for(1), videos.crf_for(90)) == (0, 51, 5)
    clip = _clip()
    small, large = (len(videos.encode_video(clip, "mp4", 16, q)) for q in (10, 100))
    assert small < large


def test_animated_webp_holds_every_frame_at_the_rate():
    clip = _clip(frames=4)
    data = videos.encode_video(clip, "webp", fps=10, quality=95)
    with Image.open(io.BytesIO(data)) as animation:
        animation.load()
        assert (animation.n_frames, animation.info["duration"]) == (4, 100)
        frames = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(animation)])
    assert _psnr(frames, clip) > 25


def test_an_image_format_is_no_video():
    with pytest.raises(ValueError, match="no video format"):
        videos.encode_video(_clip(), "png", 16, 90)


# ---- jobs --------------------------------------------------------------------------------------------
PARAMS = Params("p", 32, 32, 4, 1.0, 1, "mp4", num_frames=5, fps=16)


class _Generations:
    """generate() as the pipeline's: progress events, then one result; `gate` holds it mid-way."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.cancelled = 0
        self.fail: errors.StagemeshError | None = None

    async def generate(self, request_id, params, time_remaining):
        try:
            yield DenoisingStep(1, 1, 4, 0)
            await self.gate.wait()
            if self.fail is not None:
                raise self.fail
            yield DenoisingStep(1, 4, 4, 0)
            yield generation_pb2.GenerationResult(request_id=request_id, mp4=b"video")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def _settle(jobs: VideoJobs, job_id: str, status: str) -> None:
    """Let the job's task run until it reaches `status` (the event loop's turns, no clock)."""
    for _ in range(100):
        if jobs.get(job_id).status == status:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"job {job_id} is {jobs.get(job_id).status}, not {status}")


def test_a_job_reports_progress_then_its_result():
    async def run():
        gen = _Generations()
        jobs = VideoJobs(gen, max_jobs=4, timeout_s=60, retention_s=60)  # type: ignore[arg-type]
        job = jobs.create(PARAMS, "r1")
        await _settle(jobs, job.id, "in_progress")
        assert jobs.get(job.id).progress == 25 and jobs.expires_at(job) is None
        gen.gate.set()
        await _settle(jobs, job.id, COMPLETED)
        assert (job.progress, job.result.mp4) == (100, b"video")
        assert jobs.expires_at(job) == pytest.approx(job.finished_at + 60)

    asyncio.run(run())


def test_jobs_are_bounded_in_number_and_forgotten_after_retention():
    async def run():
        gen = _Generations()
        gen.gate.set()
        jobs = VideoJobs(gen, max_jobs=2, timeout_s=60, retention_s=30)  # type: ignore[arg-type]
        first, second = jobs.create(PARAMS, "a"), jobs.create(PARAMS, "b")
        await _settle(jobs, second.id, COMPLETED)
        with pytest.raises(errors.ResourceExhausted, match="max_video_jobs"):
            jobs.create(PARAMS, "c")
        first.finished_at = time.time() - 31  # its retention has passed
        with pytest.raises(errors.NotFound, match="expired"):
            jobs.get(first.id)
        jobs.create(PARAMS, "c")  # room again

    asyncio.run(run())


def test_deleting_a_running_job_cancels_its_generation():
    async def run():
        gen = _Generations()
        jobs = VideoJobs(gen, max_jobs=2, timeout_s=60, retention_s=30)  # type: ignore[arg-type]
        job = jobs.create(PARAMS, "a")
        await _settle(jobs, job.id, "in_progress")
        await jobs.delete(job.id)
        assert gen.cancelled == 1
        with pytest.raises(errors.NotFound):
            jobs.get(job.id)

    asyncio.run(run())


def test_a_failed_generation_fails_its_job_with_the_reason():
    async def run():
        gen = _Generations()
        gen.fail = errors.DeadlineExceeded("deadline passed before stage 1")
        gen.gate.set()
        jobs = VideoJobs(gen, max_jobs=2, timeout_s=60, retention_s=30)  # type: ignore[arg-type]
        job = jobs.create(PARAMS, "a")
        await _settle(jobs, job.id, FAILED)
        assert isinstance(job.error, errors.DeadlineExceeded) and job.result is None

    asyncio.run(run())

"""Video jobs (the HTTP API's /v1/videos): a generation that runs in the background while its
client polls it. Jobs are bounded in number (max_jobs, running or finished), a running job is
cancelled once older than `timeout_s` (its stage calls with it), and a finished job's result is
kept `retention_s` after it finished, then forgotten. Deleting a job cancels its work."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, field

from stagemesh.core import errors, logs
from stagemesh.core.params import Params
from stagemesh.gateway.pipeline import DenoisingStep, Pipeline
from stagemesh.v1 import generation_pb2

log = logs.get_logger("stagemesh.gateway.videos")

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"


@dataclass
class VideoJob:
    id: str
    params: Params
    created_at: float
    status: str = QUEUED
    progress: int = 0  # percent
    finished_at: float | None = None
    result: generation_pb2.GenerationResult | None = None
    error: errors.StagemeshError | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in (COMPLETED, FAILED)


class VideoJobs:
    def __init__(self, pipeline: Pipeline, max_jobs: int, timeout_s: float, retention_s: float) -> None:
        self._pipeline = pipeline
        self.max_jobs = max_jobs
        self.timeout_s = timeout_s
        self.retention_s = retention_s
        self._jobs: dict[str, VideoJob] = {}

    def expires_at(self, job: VideoJob) -> float | None:
        return None if job.finished_at is None else job.finished_at + self.retention_s

    def create(self, params: Params, request_id: str) -> VideoJob:
        """Start a job; RESOURCE_EXHAUSTED while max_jobs are held."""
        self._forget_expired()
        if len(self._jobs) >= self.max_jobs:
            raise errors.ResourceExhausted(
                f"{len(self._jobs)} video jobs are held (the gateway's max_video_jobs); delete finished ones "
                f"(DELETE /v1/videos/ID) or retry once they expire ({self.retention_s:g} s after they finish)"
            )
        job = VideoJob(id=f"video_{secrets.token_hex(12)}", params=params, created_at=time.time())
        self._jobs[job.id] = job
        job.task = asyncio.ensure_future(self._run(job, request_id))
        return job

    def get(self, job_id: str) -> VideoJob:
        self._forget_expired()
        job = self._jobs.get(job_id)
        if job is None:
            raise errors.NotFound(
                f"no video job {job_id!r}: never created here, deleted, or expired ({self.retention_s:g} s after "
                "it finished)"
            )
        return job

    def list(self) -> list[VideoJob]:
        self._forget_expired()
        return sorted(self._jobs.values(), key=lambda j: j.created_at, reverse=True)

    async def delete(self, job_id: str) -> VideoJob:
        """Forget the job; a running one is cancelled first, its stage calls with it."""
        job = self.get(job_id)
        del self._jobs[job_id]
        await _cancel(job)
        return job

    async def close(self) -> None:
        jobs, self._jobs = list(self._jobs.values()), {}
        await asyncio.gather(*(_cancel(job) for job in jobs))

    def _forget_expired(self) -> None:
        now = time.time()
        for job in list(self._jobs.values()):
            expires = self.expires_at(job)
            if expires is not None and expires <= now:
                del self._jobs[job.id]

    async def _run(self, job: VideoJob, request_id: str) -> None:
        try:
            with logs.bound_request(request_id):
                async for event in self._pipeline.generate(request_id, job.params, self.timeout_s):
                    job.status = IN_PROGRESS
                    if isinstance(event, DenoisingStep) and event.total:
                        job.progress = min(99, max(job.progress, 100 * event.step // event.total))
                    elif isinstance(event, generation_pb2.GenerationResult):
                        job.result = event
            job.status, job.progress = COMPLETED, 100
        except errors.StagemeshError as exc:
            job.status, job.error = FAILED, exc
            log.info("video job failed", job=job.id, reason=str(exc))
        except Exception as exc:  # a bug: the job fails, the gateway goes on
            log.exception("video job failed", job=job.id)
            job.status, job.error = FAILED, errors.StagemeshError(f"internal error: {type(exc).__name__}")
        finally:
            job.finished_at = time.time()


async def _cancel(job: VideoJob) -> None:
    if job.task is not None and not job.task.done():
        job.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job.task

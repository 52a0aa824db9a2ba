"""The stage service's own Prometheus readings: readiness, workers, sleep, queue, device memory.

Readers run on the metrics HTTP server's thread at scrape time and only read plain attributes
of the domain objects.
"""

from __future__ import annotations

from collections.abc import Callable

from stagemesh.core.metrics import Reader, Reading
from stagemesh.stage_service.control import StageControl
from stagemesh.stage_service.engine.dispatch import Engine
from stagemesh.stage_service.executor.multiproc import Executor


def stage_readings(engine: Engine, executor: Executor, control: StageControl, ready: Callable[[], bool]) -> Reader:

    def read() -> list[Reading]:
        return [
            Reading("stagemesh_stage_ready", "1 once the model is loaded and a worker runs", int(ready())),
            Reading("stagemesh_stage_workers_up", "worker processes (ranks) serving", len(engine.live_ranks())),
            Reading("stagemesh_stage_sleep_level", "0: awake, 1 or 2: asleep at that level", control.level),
            Reading(
                "stagemesh_stage_queue_depth",
                "requests admitted and not finished (waiting or running)",
                engine.queue_depth,
            ),
            Reading("stagemesh_stage_waiting_requests", "admitted requests not yet handed to a worker", engine.waiting),
            Reading(
                "stagemesh_stage_batches",
                "batches handed to the workers (DP waves not counted)",
                engine.batches,
                counter=True,
            ),
            Reading(
                "stagemesh_stage_batched_requests",
                "requests in those batches; over stagemesh_stage_batches_total, the mean batch size",
                engine.batched_requests,
                counter=True,
            ),
            Reading(
                "stagemesh_stage_device_memory_bytes",
                "device memory the workers use, as each last reported it",
                executor.device_memory_bytes(),
            ),
            Reading(
                "stagemesh_stage_offload_streamed_bytes",
                "bytes the DLO engines copied host to device, summed over workers and restarts",
                executor.offload_bytes_streamed,
                counter=True,
            ),
            Reading(
                "stagemesh_stage_step_cache_skipped_passes",
                "passes of step-cache-hooked modules (blocks; attention layers for taylorseer) served from "
                "the cache instead of computed, all workers",
                executor.step_cache_skipped,
                counter=True,
            ),
            Reading(
                "stagemesh_stage_step_cache_passes",
                "passes of step-cache-hooked modules, skipped or computed; the ratio is the fraction skipped",
                executor.step_cache_passes,
                counter=True,
            ),
            Reading(
                "stagemesh_stage_compute_seconds",
                "device seconds of the forward passes whose outputs came back, all workers; "
                "its rate per worker is the stage's busy fraction",
                executor.compute_seconds,
                counter=True,
            ),
        ]

    return read

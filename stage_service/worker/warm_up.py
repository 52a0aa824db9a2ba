"""The first-image warm-up: one small batch at the stage's default size, run by each worker
after its model is loaded and before it reports ready.

The first forward pass of a process pays for what later ones reuse: cuBLAS and cuDNN choose
their kernels for each new shape, the caching allocator grows its pool, lazily compiled or
cached code (torch.compile's, captured step graphs) is built or loaded. Done here, the stage
reports ready only once the first request can run at steady speed. A warm-up that fails fails
the start: the worker answers LoadFailed naming the size and the cause, never a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagemesh.core import logs, startup
from stagemesh.core.params import Params
from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import Runner
from stagemesh.stage_service.settings import StageSettings

log = logs.get_logger("stagemesh.worker.warm_up")

# Enough steps to run every kernel of a step and of the scheduler's first and later steps.
MAX_STEPS = 2


class WarmUpFailed(RuntimeError):
    """The warm-up batch could not run; the message names its size and the cause."""


def wanted(settings: StageSettings, device: str) -> bool:
    if settings.warm_up == "auto":
        return platform.is_cuda(device)
    return settings.warm_up == "on"


def params_of(settings: StageSettings, runner: Runner) -> Params:
    """What a request leaving everything unset asks for, with at most MAX_STEPS steps."""
    limits = settings.limits(runner.limits())
    return Params(
        prompt="a warm-up",
        width=limits.default_size,
        height=limits.default_size,
        num_inference_steps=min(MAX_STEPS, limits.default_inference_steps),
        guidance_scale=limits.default_guidance_scale,
        seed=0,
        output_format="tensor",
    )


def warm_up(runner: Runner, settings: StageSettings, device: str, run: Callable[[list], Any] | None = None) -> None:
    """Run the warm-up batch when the settings ask for one, through `run` (the worker's own
    path: compiled blocks and step caches included; default `runner.run`); raises WarmUpFailed."""
    if not wanted(settings, device):
        return
    params = params_of(settings, runner)
    multiple = int(runner.limits().get("pixel_multiple", 1) or 1)
    where = f"{params.width}x{params.height}, {params.num_inference_steps} steps"
    if params.width % multiple:
        raise WarmUpFailed(
            f"warm-up ({where}): default_size {params.width} is not a multiple of the model's "
            f"pixel multiple {multiple}, so every request leaving the size unset would be refused; set "
            f"default_size to a multiple of {multiple} (or warm_up = 'off')"
        )
    items = runner.warm_up_items(params)
    if items is None:
        log.info("no warm-up for this stage kind", kind=settings.kind)
        return
    with startup.phase("warm-up", size=params.width, steps=params.num_inference_steps):
        try:
            (run or runner.run)(items)
            platform.current_stream(device).synchronize()
        except Exception as exc:
            raise WarmUpFailed(f"warm-up ({where}) failed: {type(exc).__name__}: {exc}") from exc

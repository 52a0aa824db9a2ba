"""Faster denoising for any runner's transformer: FP8 compute, regional compilation with its
compiled code kept on disk, and step caching. Model-agnostic: it finds the runner's denoiser
(`runner.transformer` for a diffusers folder, `runner.dit` for the embedded model) and acts on
the blocks the model declares repeated.

The worker calls `prepare(runner, settings, device)` once the runner is loaded, then runs every
batch through `Acceleration.run`. `Acceleration.warm_up(run_once)` compiles (or loads the
compiled code from disk) before the stage reports ready; without it, the first batch does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.stage_service.models.acceleration import compile as regional
from stagemesh.stage_service.models.acceleration.step_cache import Choice, StepCache, offered

log = logs.get_logger("stagemesh.acceleration")


def denoiser(runner: Any) -> nn.Module | None:
    """The runner's denoising transformer, or None for a runner without one."""
    for name in ("transformer", "dit"):
        model = getattr(runner, name, None)
        if isinstance(model, nn.Module):
            return model
    return None


class Acceleration:
    """What was applied to one runner's transformer, and the per-batch step cache."""

    def __init__(self, model: nn.Module | None, settings: Any, device: str) -> None:
        self.model = model
        self.compiled = False
        self.fp8_layers = 0
        self.cache_dir = ""
        self.step_cache: StepCache | None = None
        self.warmed = False
        self._device = device
        self._settings = settings

    def limits(self) -> dict[str, Any]:
        """What the stage tells callers: the step caches it offers."""
        offered = self.step_cache.offered if self.step_cache is not None else ("off",)
        return {"step_caches": list(offered)}

    def run(self, run: Callable[..., list[dict[str, torch.Tensor]]], batch: list, progress: Any = None) -> list:
        """`run(batch, progress)` under the batch's step cache; each output gains the counts."""
        if self.step_cache is None or not batch:
            outputs = run(batch, progress)
        else:
            with self.step_cache.batch(batch[0].params) as counted:
                outputs = run(batch, progress)
            outputs = [{**out, **counted} for out in outputs]
        if self.compiled and not self.warmed:
            self.warmed = True  # compiled (or loaded from the disk cache) by this first batch
            log.info("compiled blocks ready", **self.compile_stats())
        return outputs

    def warm_up(self, run_once: Callable[[], Any]) -> float:
        """Run `run_once` (one small batch) so compilation, or its load from the disk cache,
        happens now; returns the seconds it took."""
        started = time.perf_counter()
        run_once()
        seconds = time.perf_counter() - started
        if self.compiled and not self.warmed:
            log.info("compiled blocks ready", seconds=round(seconds, 3), **self.compile_stats())
        self.warmed = True
        return seconds

    def compile_stats(self) -> dict[str, Any]:
        if not self.compiled:
            return {"compiled": False}
        return {"compiled": True, "cache_dir": self.cache_dir, **regional.compile_counters()}

    def step_cache_counts(self) -> tuple[int, int]:
        """(block passes skipped, block passes) since start, every batch."""
        if self.step_cache is None:
            return 0, 0
        return self.step_cache.skipped_total, self.step_cache.passes_total

    def sleep_refusal(self, level: int) -> str | None:
        if level == 2 and self.fp8_layers:
            return (
                "sleep level 2 reloads the checkpoint's weights, not the FP8 ones compute_dtype = 'float8' "
                "made; use level 1"
            )
        return None


def prepare(runner: Any, settings: Any, device: str) -> Acceleration:
    """Apply the stage's compute_dtype, compile and step_cache options to the runner's
    transformer, in that order (FP8 layers are compiled with the blocks; the step cache's
    counters wrap the compiled code). Raises ValueError naming a refused combination."""
    model = denoiser(runner)
    accel = Acceleration(model, settings, device)
    mode = settings.compile_mode()
    if model is None:
        return accel
    if settings.compute_dtype == "float8":
        _apply_fp8(accel, model, settings, device)
    if mode == "regional":
        _apply_compile(accel, model, settings, device)
    # Image-parallel ranks would each decide from their own slice (the settings refuse it too).
    if settings.image_parallel_size() == 1 and (settings.step_cache != "off" or len(offered(model)) > 1):
        accel.step_cache = StepCache(model, Choice(settings.step_cache, settings.step_cache_threshold))
    return accel


def _apply_fp8(accel: Acceleration, model: nn.Module, settings: Any, device: str) -> None:
    from stagemesh.stage_service.models.acceleration import fp8

    fp8.check_device(device)  # the settings refused the CPU; this names a GPU older than sm89
    accel.fp8_layers = fp8.convert(model, settings.fp8_backend)
    log.info("FP8 compute", layers=accel.fp8_layers, backend=settings.fp8_backend)


def compile_options(settings: Any) -> dict[str, Any]:
    """What, beside the model, changes the compiled graphs (part of the disk cache's key)."""
    return {
        "compile": "regional",
        "fullgraph": settings.image_parallel_size() == 1,
        "compute_dtype": settings.compute_dtype,
        "fp8_backend": settings.fp8_backend if settings.compute_dtype else "",
        "dlo_stream_dtype": settings.dlo_stream_dtype if settings.enable_dlo else "",
    }


def _apply_compile(accel: Acceleration, model: nn.Module, settings: Any, device: str) -> None:
    options = compile_options(settings)
    material = regional.key_material(model, device, options)
    accel.cache_dir = str(regional.use_cache_dir(settings.dlo_runtime_cache_dir, material))
    # Sequence-parallel blocks hold their collectives: the graph breaks around them.
    blocks = regional.compile_blocks(model, fullgraph=options["fullgraph"])
    accel.compiled = True
    log.info("regional compile", blocks=blocks, cache_dir=accel.cache_dir)

"""Step caching: diffusers' cache hooks on a denoising transformer, chosen per batch, counted.

A method reuses the transformer blocks' results of an earlier denoising step where the input has
changed little (FirstBlockCache: the first block's residual; MagCache: the calibrated magnitude
ratio) or predicts them (TaylorSeer: a Taylor expansion every `interval` steps). The hooks come
from diffusers (`transformer.enable_cache(...)`); which methods a model offers is declared below,
by transformer class. Every request names its method (or inherits the stage's), and requests with
different choices never share a batch (they are part of Params.batch_key()).

Counting, read off the hooks themselves: every module a cache hook sits on (the blocks; for
TaylorSeer also the output projection) counts its calls, and the
forward the hook calls when it computes counts its runs; a pass the hook serves from its cache
never reaches that forward. Skipped = calls - runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagemesh.core.params import STEP_CACHE_OUTPUT, STEP_CACHES

OFF = "off"
# The methods each transformer class offers (mag needs the class's calibrated ratios). Only a
# diffusers CacheMixin takes the hooks: diffusers 0.42's SD3Transformer2DModel is none, so SD3
# offers no step cache.
OFFERED: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": ("first_block", "taylorseer", "mag"),
}
# The published defaults (diffusers' configs): threshold for first_block and mag, interval for taylorseer.
DEFAULT_THRESHOLD = {"first_block": 0.05, "mag": 0.06, "taylorseer": 5.0}


def offered(model: nn.Module) -> tuple[str, ...]:
    """The step caches this model offers, "off" first."""
    if not hasattr(model, "enable_cache"):
        return (OFF,)
    return (OFF, *OFFERED.get(type(model).__name__, ()))


@dataclass(frozen=True)
class Choice:
    method: str = OFF
    threshold: float = 0.0  # 0: the method's default

    def effective_threshold(self) -> float:
        return self.threshold if self.threshold > 0 else DEFAULT_THRESHOLD.get(self.method, 0.0)


def config_for(model: nn.Module, choice: Choice, steps: int) -> Any:
    """diffusers' config object of `choice` for a loop of `steps` steps."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    value = choice.effective_threshold()
    if choice.method == "first_block":
        return FirstBlockCacheConfig(threshold=value)
    if choice.method == "taylorseer":
        # Lite mode: its hooks sit on whole blocks (skipped on predicted steps) and the output
        # projection (predicted), outside the compiled block code; the full mode hooks the
        # attention layers inside the blocks, which a compiled block cannot call out to.
        return TaylorSeerCacheConfig(
            cache_interval=max(1, round(value)), taylor_factors_dtype=model.dtype, use_lite_mode=True
        )
    if choice.method == "mag":
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        return MagCacheConfig(threshold=value, num_inference_steps=steps, mag_ratios=FLUX_MAG_RATIOS)
    raise ValueError(f"step_cache = {choice.method!r}: allowed: {', '.join(STEP_CACHES)}")


class StepCache:
    """The hooks of one transformer: switched to each batch's choice, and their passes counted."""

    def __init__(self, model: nn.Module, default: Choice) -> None:
        self.model: Any = model  # a diffusers CacheMixin (enable_cache, cache_context, ...)
        self.offered = offered(model)
        if default.method not in self.offered:
            raise ValueError(
                f"step_cache = {default.method!r}: {type(model).__name__} offers {', '.join(self.offered)}"
            )
        self.default = default
        self._active: tuple[Choice, int] | None = None  # the hooks installed now, for that many steps
        self._undo: list[Callable[[], None]] = []  # takes the counters off the hooks
        self._calls = 0  # calls of hooked modules in this batch
        self._runs = 0  # of those, the ones that computed
        self.skipped_total = 0  # passes skipped since start (the stage's metric)
        self.passes_total = 0  # passes of hooked modules since start

    def choice(self, params: Any) -> Choice:
        method = params.step_cache if params.step_cache is not None else self.default.method
        if params.step_cache_threshold is not None:
            threshold = params.step_cache_threshold
        else:
            threshold = self.default.threshold if method == self.default.method else 0.0
        return Choice(method, float(threshold))

    def _switch(self, choice: Choice, steps: int) -> None:
        wanted = None if choice.method == OFF else (choice, steps if choice.method == "mag" else 0)
        if wanted == self._active:
            return
        if self._active is not None:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            self.model.disable_cache()
            self._active = None
        if wanted is not None:
            self.model.enable_cache(config_for(self.model, choice, steps))
            self._active = wanted
            self._count_hooked()

    def _count_hooked(self) -> None:
        """Count the calls of every module a hook sits on, and the calls its hook lets through."""
        for module in self.model.modules():
            registry = getattr(module, "_diffusers_hook", None)
            if registry is None or not registry.hooks:
                continue
            handle = module.register_forward_pre_hook(self._count_call)
            self._undo.append(handle.remove)
            for hook in registry.hooks.values():
                ref = getattr(hook, "fn_ref", None)
                if ref is not None and ref.original_forward is not None:
                    self._undo.append(_count_runs(ref, self))

    def _count_call(self, module: nn.Module, args: Any) -> None:
        self._calls += 1

    @contextlib.contextmanager
    def batch(self, params: Any) -> Iterator[dict[str, torch.Tensor]]:
        """Run one batch under its choice; the dict it yields receives STEP_CACHE_OUTPUT (the
        counts of this batch) once the batch is done, when a cache ran."""
        choice = self.choice(params)
        if choice.method not in self.offered:
            raise ValueError(
                f"step_cache = {choice.method!r}: {type(self.model).__name__} offers {', '.join(self.offered)}"
            )
        self._switch(choice, params.num_inference_steps)
        self._calls = self._runs = 0
        out: dict[str, torch.Tensor] = {}
        if self._active is None:
            yield out
            return
        try:
            with self.model.cache_context("denoise"):
                yield out
        finally:
            self.model._reset_stateful_cache()  # the next batch starts from its own first step
        skipped = max(0, self._calls - self._runs)
        self.skipped_total += skipped
        self.passes_total += self._calls
        method = STEP_CACHES.index(choice.method)
        out[STEP_CACHE_OUTPUT] = torch.tensor([skipped, self._calls, method], dtype=torch.int64)


def _count_runs(ref: Any, cache: StepCache) -> Callable[[], None]:
    """Wrap the forward a hook calls when it computes; returns what puts it back."""
    inner = ref.original_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        cache._runs += 1
        return inner(*args, **kwargs)

    ref.original_forward = counted

    def undo() -> None:
        ref.original_forward = inner

    return undo

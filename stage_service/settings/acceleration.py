"""The denoising-speed options of a stage (compile, compute_dtype, fp8_backend, step_cache) and
the combinations refused at start. Kept apart from the model code so reading the options does
not import torch."""

from __future__ import annotations

import math
from typing import Any

# "auto": "regional" on a CUDA device, "off" elsewhere.
COMPILE_MODES = ("auto", "regional", "off")
# "": the checkpoint's own dtype.
COMPUTE_DTYPES = ("", "float8")
FP8_BACKENDS = ("scaled_mm", "torchao")
# The kinds whose model is a denoising transformer (what compile, FP8 and step caching act on).
DENOISING_KINDS = ("diffusion", "denoise")


def compile_mode(o: Any) -> str:
    """'regional' or 'off' once 'auto' is resolved against the stage's device and kind."""
    if o.compile != "auto":
        return str(o.compile)
    on_gpu = str(o.device).startswith("cuda") and o.kind in DENOISING_KINDS
    # Tensor-parallel blocks all-reduce inside: those run eagerly (an explicit 'regional' is refused).
    return "regional" if on_gpu and o.tensor_parallel_size == 1 else "off"


def validate(o: Any) -> None:
    """Raise ValueError naming what to change; `o` is a StageSettings."""
    from stagemesh.core.params import STEP_CACHES

    if o.compile not in COMPILE_MODES:
        raise ValueError(f"compile = {o.compile!r}: allowed: {', '.join(COMPILE_MODES)}")
    if o.compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype = {o.compute_dtype!r}: allowed: '' (the checkpoint's dtype) or 'float8'")
    if o.fp8_backend not in FP8_BACKENDS:
        raise ValueError(f"fp8_backend = {o.fp8_backend!r}: allowed: {', '.join(FP8_BACKENDS)}")
    if o.step_cache not in STEP_CACHES:
        raise ValueError(f"step_cache = {o.step_cache!r}: allowed: {', '.join(STEP_CACHES)}")
    threshold = o.step_cache_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"step_cache_threshold = {threshold!r}: allowed: 0 (the method's default) or above")
    if threshold < 0:
        raise ValueError(f"step_cache_threshold = {threshold!r}: allowed: 0 (the method's default) or above")
    asked = [
        name
        for name, on in (
            (f"compile = {o.compile!r}", o.compile == "regional"),
            (f"compute_dtype = {o.compute_dtype!r}", bool(o.compute_dtype)),
            (f"step_cache = {o.step_cache!r}", o.step_cache != "off"),
        )
        if on
    ]
    if asked and o.kind not in DENOISING_KINDS:
        raise ValueError(
            f"{' and '.join(asked)} on a {o.kind!r} stage: these act on a denoising transformer "
            f"({' or '.join(map(repr, DENOISING_KINDS))} stages); leave them unset here"
        )
    if o.compile == "regional" and o.tensor_parallel_size > 1:
        raise ValueError(
            f"compile = 'regional' with tensor_parallel_size = {o.tensor_parallel_size}: the blocks all-reduce "
            "inside; set compile = 'off' (or 'auto', which is off here) or tensor_parallel_size = 1"
        )
    if o.step_cache != "off" and o.sp_size * (2 if o.cfg_parallel else 1) > 1:
        raise ValueError(
            f"step_cache = {o.step_cache!r} with sp_size = {o.sp_size} / cfg_parallel = {str(o.cfg_parallel).lower()}: "
            "each rank would decide from its own slice whether to skip the blocks, and ranks that skip "
            "differently never meet in their collectives; set step_cache = 'off' or sp_size = 1 and "
            "cfg_parallel = false"
        )
    if o.compute_dtype == "float8":
        _check_fp8(o)


def _check_fp8(o: Any) -> None:
    if not str(o.device).startswith("cuda"):
        raise ValueError(
            f"compute_dtype = 'float8' on device = {o.device!r}: FP8 matmuls (torch._scaled_mm, torchao) need a "
            "CUDA GPU of compute capability 8.9 or newer; use device = 'cuda' or leave compute_dtype unset"
        )
    if compile_mode(o) != "regional":
        raise ValueError(
            "compute_dtype = 'float8' with compile = 'off': the activations' FP8 quantisation is only fast "
            "fused into the compiled blocks; set compile = 'regional' (or 'auto' on a CUDA device)"
        )
    if o.dlo_stream_dtype == "int8":
        raise ValueError(
            "compute_dtype = 'float8' with dlo_stream_dtype = 'int8': the matmuls take FP8 weights; stream "
            "them as dlo_stream_dtype = 'float8_e4m3fn' (or in the model's dtype: leave it unset)"
        )
    if o.enable_dlo:
        raise ValueError(
            "compute_dtype = 'float8' with enable_dlo: the DLO engine streams the blocks' weights in the layout "
            "it loaded them in, not as FP8 layers; drop enable_dlo or leave compute_dtype unset"
        )
    if o.tensor_parallel_size > 1:
        raise ValueError(
            f"compute_dtype = 'float8' with tensor_parallel_size = {o.tensor_parallel_size}: the FP8 layers "
            "replace whole Linear layers, not TP shards; set tensor_parallel_size = 1 or leave compute_dtype unset"
        )

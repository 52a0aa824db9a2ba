"""DLO options of a stage (flags of `stagemesh stage`, keys of a [[stages]] table) and the
combinations refused at start."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from stagemesh.core.options import option

DEFAULT_RUNTIME_CACHE_DIR = "~/.cache/stagemesh/dlo-runtime-weights"
# "": blocks stream in the model's own dtype. Kept here (not in quant.py) so reading the options
# does not import torch.
STREAM_DTYPES = ("", "float8_e4m3fn", "int8")


def validate(o: Any) -> None:
    """Raise ValueError naming what to change; `o` is a StageSettings or DloOptions."""
    if o.dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {o.dp_size}")
    if o.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {o.tensor_parallel_size}")
    if o.dlo_resident_layers < 0:
        raise ValueError(f"dlo_resident_layers must be >= 0, got {o.dlo_resident_layers}")
    if o.dlo_resident_layers > 0 and o.dlo_use_allgather:
        raise ValueError(
            f"dlo_resident_layers = {o.dlo_resident_layers} needs no-AllGather (every AllGather "
            "rank must rebuild the same blocks): pass --dlo-no-use-allgather "
            "(dlo_use_allgather = false in mesh.toml) or set dlo_resident_layers = 0"
        )
    if o.dlo_enable_runtime_cache and o.dlo_use_allgather:
        raise ValueError(
            "dlo_enable_runtime_cache needs no-AllGather (the cache holds complete rank-local "
            "weights): pass --dlo-no-use-allgather (dlo_use_allgather = false in mesh.toml) or "
            "drop --dlo-enable-runtime-cache"
        )
    if o.dlo_stream_dtype not in STREAM_DTYPES:
        raise ValueError(
            f"dlo_stream_dtype must be one of {list(STREAM_DTYPES)} ('' streams the model's own dtype), "
            f"got {o.dlo_stream_dtype!r}"
        )
    if o.dlo_stream_dtype and not o.enable_dlo:
        raise ValueError(
            f"dlo_stream_dtype = {o.dlo_stream_dtype!r} needs enable_dlo (it sets how DLO streams blocks): "
            "pass --enable-dlo or leave dlo_stream_dtype unset"
        )
    timeout = o.dlo_runtime_cache_lock_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"dlo_runtime_cache_lock_timeout must be a finite number of seconds > 0, got {timeout!r}")


@dataclass(frozen=True)
class DloOptions:
    """The DLO options of a stage: StageSettings inherits them (flags of `stagemesh stage`, keys of
    a [[stages]] table) and the runners take them alone."""

    enable_dlo: bool = option(
        False, "stream the DiT's blocks from host memory through two device slots (distributed layerwise offload, DLO)"
    )
    dp_size: int = option(
        1,
        "data-parallel ranks of the stage: that many worker processes (as workers = N); "
        "with DLO AllGather on a diffusion stage they form the weight-sharding group and run "
        "requests in DP waves (see docs/DLO.md)",
    )
    dlo_use_allgather: bool = option(
        True,
        "DLO: each DP rank keeps 1/dp_size of every block and rebuilds it with "
        "AllGather; --dlo-no-use-allgather streams complete rank-local blocks",
    )
    dlo_resident_layers: int = option(
        0,
        "DLO: keep this many leading blocks on the device (needs "
        "--dlo-no-use-allgather and a model that declares eligible blocks)",
    )
    dlo_enable_runtime_cache: bool = option(
        False,
        "DLO: share final ordinary-loader weights through the node-local "
        "runtime-weight cache (needs --dlo-no-use-allgather)",
    )
    dlo_runtime_cache_dir: str = option(DEFAULT_RUNTIME_CACHE_DIR, "DLO runtime-weight cache root on a local disk")
    dlo_runtime_cache_lock_timeout: float = option(
        600.0, "DLO: seconds to wait for another process publishing the same runtime-cache layout (finite, > 0)"
    )
    dlo_runtime_cache_service: str = option(
        "",
        "DLO: address of the node's cache service, which holds the "
        "publication locks; empty (or unreachable): the same lock "
        "protocol on the directory itself. `stagemesh up` fills it in",
    )
    tensor_parallel_size: int = option(
        1,
        "tensor-parallel ranks of a diffusion stage: that many worker "
        "processes form one group and run every batch together; the direct "
        "mmap plan needs 1",
    )
    dlo_checkpoint_mmap: bool = option(
        True, "DLO: try the direct checkpoint mmap plan first; --no-dlo-checkpoint-mmap always uses the ordinary loader"
    )
    dlo_stream_dtype: str = option(
        "",
        "DLO: 'float8_e4m3fn' or 'int8' keeps the streamed blocks' Linear weights in that "
        "8-bit format on the host (per-output-channel bf16 scales, quantised once at load) and rebuilds them on "
        "the device before each block runs: about half the bytes per step; int8 rounds about a third as far "
        "from the weights as float8_e4m3fn; '' streams the model's own dtype (see docs/DLO.md)",
    )

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_settings(cls, settings: Any) -> DloOptions:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def allgather_active(self) -> bool:
        """AllGather moves weights only when there is more than one rank to gather from."""
        return self.dlo_use_allgather and self.dp_size > 1

    @property
    def forms_dp_group(self) -> bool:
        """The stage's dp_size ranks form one process group and run requests in DP waves."""
        return self.enable_dlo and self.allgather_active

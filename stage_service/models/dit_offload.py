"""The embedded DiT under DLO: host weights from the checkpoint mapping (or the ordinary
loader), the decoder and every non-block DiT tensor resident on the device, blocks streamed."""

from __future__ import annotations

from pathlib import Path

import torch

from stagemesh.stage_service.models.tp import TpGroup
from stagemesh.stage_service.models.weights import (
    DECODER_PREFIX,
    DIT_FILE,
    DIT_PREFIX,
    build_dit,
    load_dit,
    read_config,
)
from stagemesh.stage_service.offload import quant
from stagemesh.stage_service.offload.checkpoint import load_or_fallback
from stagemesh.stage_service.offload.collective import group_shape
from stagemesh.stage_service.offload.streamer import LayerwiseOffload
from stagemesh.stage_service.settings import DloOptions


def load_host_dit(model_dir: Path, tp: TpGroup | None = None, try_mmap: bool = True):
    """(dit, decoder, mapped, reason) on the host: checkpoint views when the plan is proven,
    else the ordinary loader's private tensors (reason says why; always so under TP > 1, where
    each rank slices its shards)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    # meta: the plan is checked before anything is allocated
    dit, decoder = build_dit(config, tp=tp)
    loaded: dict = {}

    def ordinary() -> None:
        loaded["dit"], loaded["decoder"] = load_dit(model_dir, "cpu", tp=tp)

    if not try_mmap:
        ordinary()
        reason: str | None = "dlo_checkpoint_mmap is off"
    else:
        reason = load_or_fallback(
            [model_dir / DIT_FILE], {DIT_PREFIX: dit, DECODER_PREFIX: decoder}, ordinary, 1 if tp is None else tp.size
        )
    if reason is not None:
        dit, decoder = loaded["dit"], loaded["decoder"]
    for m in (dit, decoder):
        m.eval().requires_grad_(False)
    return dit, decoder, reason is None, reason


def load_offloaded_dit(
    model_dir: Path, device: str | torch.device, opts: DloOptions, group=None, tp: TpGroup | None = None
):
    """(dit, decoder, engine, runtime-cache result or None). `group`: the DP process group for
    AllGather (dp_size > 1); `tp`: the rank's TP coordinate (its blocks hold only its shards)."""
    if opts.allgather_active and group is None:
        # The stage's executor forms the group; only a caller outside a stage gets here.
        raise ValueError(
            f"dp_size = {opts.dp_size} with AllGather needs the process group of "
            "the stage's DP ranks: pass group=, or use dp_size = 1 or "
            "--dlo-no-use-allgather"
        )
    assert not opts.allgather_active or group_shape(group)[0] == opts.dp_size, "the group is the stage's DP ranks"
    cached = None  # the runtime-cache entry the weights map, kept open while they are used
    if opts.dlo_enable_runtime_cache:
        from stagemesh.stage_service.models.runtime_weights import load_through_cache

        dit, decoder, mapped, cached = load_through_cache(
            model_dir,
            opts,
            tp,
            lambda: load_host_dit(model_dir, tp, opts.dlo_checkpoint_mmap),
            service_address=opts.dlo_runtime_cache_service or None,
            device=device,
        )
    else:
        dit, decoder, mapped, _ = load_host_dit(model_dir, tp, opts.dlo_checkpoint_mmap)
    decoder.to(device)
    # A group of one runs no collective: it streams its own complete blocks, like no-AllGather.
    use_allgather = opts.allgather_active
    engine = LayerwiseOffload(
        dit,
        device,
        resident_layers=opts.dlo_resident_layers,
        group=group if use_allgather else None,
        use_allgather=use_allgather,
        keep_source=mapped and not use_allgather,
        stream_dtype=quant.stream_dtype(opts.dlo_stream_dtype),
        # 8-bit weights of a runtime-cache entry are streamed from it as they are.
        quantized=cached.quantized if cached is not None else None,
    )
    return dit, decoder, engine, cached

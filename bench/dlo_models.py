"""The models bench/dlo.py measures, built with random weights that are identical in every build.

A model is built on "meta" and each parameter gets its values one tensor at a time, generated on
the device from a seed derived from its name (so the resident model, the DLO model and the
diffusers peer hold the same numbers) and stored where that build wants it: the device, or the
host block by block. No build ever holds the model twice.

- `dit`: the embedded DiT (`PipelineConfig.flux_sized()` or a tiny preset), guidance as a
  cond/uncond batch of 2.
- `flux`: diffusers' `FluxTransformer2DModel` from its default config with guidance embeddings on
  (FLUX.1-dev's shape: 11.9 B parameters), unchanged; `flux_model(tiny=True)` (the tiny-flux preset) for a CPU check.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from stagemesh.stage_service.models.config import DiTConfig, PipelineConfig
from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload, OffloadPlan, discover

TINY_DIT = PipelineConfig(dit=DiTConfig(hidden_size=256, depth=12, num_heads=4, cond_dim=64))
# Odd block counts (2 + 3), rope axes summing to the head dim.
TINY_FLUX = {
    "num_layers": 2,
    "num_single_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 16,
    "in_channels": 16,
    "axes_dims_rope": (4, 6, 6),
}
# Resident blocks come from the double-stream list, the first to run.
FLUX_PLAN = OffloadPlan(
    block_attrs={"": ("transformer_blocks", "single_transformer_blocks")}, resident_paths=("transformer_blocks",)
)


@dataclass(frozen=True)
class BenchModel:
    name: str
    dtype: torch.dtype
    build_meta: Callable[[], nn.Module]
    make_inputs: Callable[[int, int, torch.device], dict]  # (size, text tokens, device)
    forward: Callable[[nn.Module, dict], torch.Tensor]
    plan: OffloadPlan | None = None


# ---- values ----------------------------------------------------------------------------------
def _fill(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return t.normal_(0.0, 0.02, generator=gen)


def _inside(name: str, roots: set[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def materialize(
    module: nn.Module, prefix: str, device: torch.device, target: torch.device, skip: set[str] = frozenset()
) -> None:
    """Real values for every parameter under `module` (generated on `device`, stored on
    `target`), one tensor at a time; submodules named in `skip` are left alone."""
    for name, sub in module.named_modules():
        full = f"{prefix}{name}" if name else prefix.rstrip(".")
        if _inside(full, skip):
            continue
        for key, p in list(sub._parameters.items()):
            if p is None:
                continue
            qual = f"{full}.{key}" if full else key
            value = _fill(torch.empty(p.shape, dtype=p.dtype, device=device), qual, device)
            sub._parameters[key] = nn.Parameter(value.to(target), requires_grad=False)
        for key, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                raise ValueError(f"{full}.{key}: a buffer built on meta has no value to give")


def build_resident(bm: BenchModel, device: torch.device) -> nn.Module:
    model = bm.build_meta()
    materialize(model, "", device, device)
    return model


def build_host(bm: BenchModel, device: torch.device) -> nn.Module:
    """The whole model in ordinary host memory (what the diffusers peer starts from)."""
    model = bm.build_meta()
    materialize(model, "", device, torch.device("cpu"))
    return model


def build_offloaded(
    bm: BenchModel, device: torch.device, resident: int, group=None, stream_dtype: torch.dtype | None = None
) -> tuple[nn.Module, LayerwiseOffload]:
    """Non-block weights on the device; streamed blocks materialised on the host one at a time
    (inside the engine, straight into their packed buffers); resident blocks on the device.
    With a `group` the blocks are sharded across its ranks and rebuilt by AllGather; with
    `stream_dtype` float8_e4m3fn their Linear weights are streamed in FP8."""
    model = bm.build_meta()
    found = discover(model, bm.plan)
    paths = {id(b.module): b.path for b in found.blocks}
    materialize(model, "", device, device, skip=set(paths.values()))
    kept = {b.path for b in found.resident_candidates()[:resident]}

    def init_block(block: nn.Module) -> None:
        path = paths[id(block)]
        materialize(block, path + ".", device, device if path in kept else torch.device("cpu"))

    for block in found.blocks:
        if block.path in kept:
            init_block(block.module)
    engine = LayerwiseOffload(
        model,
        device,
        plan=bm.plan,
        resident_layers=resident,
        group=group,
        use_allgather=group is not None,
        init_block=init_block,
        stream_dtype=stream_dtype,
    )
    return model, engine


# ---- the embedded DiT ------------------------------------------------------------------------
def dit_model(config: PipelineConfig) -> BenchModel:
    def build_meta() -> nn.Module:
        with torch.device("meta"):
            return DiT(config.dit).to(config.torch_dtype).eval().requires_grad_(False)

    def make_inputs(size: int, tokens: int, device: torch.device) -> dict:
        c = config.dit
        side = size // c.vae_scale
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, c.latent_channels, side, side, generator=g)  # cond + uncond
        cond = torch.randn(2, tokens, c.cond_dim, generator=g).to(config.torch_dtype)
        return {"x": x.to(device), "t": torch.full((2,), 0.7, device=device), "cond": cond.to(device)}

    def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
        return model(inputs["x"], inputs["t"], inputs["cond"])

    return BenchModel("dit", config.torch_dtype, build_meta, make_inputs, forward)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


# ---- diffusers Flux --------------------------------------------------------------------------
def flux_model(tiny: bool = False, dtype: torch.dtype = torch.bfloat16) -> BenchModel:
    from diffusers import FluxTransformer2DModel

    kwargs = dict(TINY_FLUX) if tiny else {}

    def build_meta() -> nn.Module:
        # Built in its dtype: ModelMixin.to(dtype) warns about float32-only modules (Flux has none).
        with torch.device("meta"), _default_dtype(dtype):
            model = FluxTransformer2DModel(guidance_embeds=True, **kwargs)
        return model.eval().requires_grad_(False)

    config = build_meta().config

    def make_inputs(size: int, tokens: int, device: torch.device) -> dict:
        side = size // 16  # VAE 8x, then 2x2 patches packed into channels
        g = torch.Generator().manual_seed(0)
        rows = torch.arange(side).repeat_interleave(side)
        img_ids = torch.stack([torch.zeros_like(rows), rows, torch.arange(side).repeat(side)], 1)
        values = {
            "hidden_states": torch.randn(1, side * side, config.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(1, tokens, config.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=g),
            "timestep": torch.full((1,), 0.7),
            "guidance": torch.full((1,), 3.5),
            "img_ids": img_ids.float(),
            "txt_ids": torch.zeros(tokens, 3),
        }
        floating = {"hidden_states", "encoder_hidden_states", "pooled_projections"}
        return {k: (v.to(dtype) if k in floating else v).to(device) for k, v in values.items()}

    def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
        return model(**inputs, return_dict=False)[0]

    return BenchModel("tiny-flux" if tiny else "flux", dtype, build_meta, make_inputs, forward, FLUX_PLAN)

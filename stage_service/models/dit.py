"""Stage 1: a DiT denoiser (flow matching) with a small latent-to-RGB decoder."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.stage_service import platform
from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.contract import Progress
from stagemesh.stage_service.models.parallel import Axis, exchange_passes
from stagemesh.stage_service.models.sequence_parallel import Shard
from stagemesh.stage_service.models.sequence_parallel import attention as split_attention
from stagemesh.stage_service.models.tp import TpGroup, column, row, split
from stagemesh.stage_service.offload.plan import OffloadPlan

TIME_FREQ_DIM = 256
MIN_COND_BUCKET = 8


class CapturedSteps(Protocol):
    """Replays the denoising loop from captured graphs (models.step_graphs.StepGraphs)."""

    def denoise(
        self,
        x: torch.Tensor,
        cond: torch.Tensor,
        mask: torch.Tensor,
        steps: int,
        guidance_scale: float,
        progress: Progress | None = None,
        start: int = 0,
    ) -> torch.Tensor: ...


def timestep_embedding(t: torch.Tensor, dim: int = TIME_FREQ_DIM) -> torch.Tensor:
    """Sin/cos code of t in [0, 1] (scaled to 0..1000 so low frequencies still move)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = 1.0 / 10000.0 ** (torch.arange(half, device=pos.device) / half)
    args = pos.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def pos_embed_2d(grid_h: int, grid_w: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 2-D position code [grid_h * grid_w, dim]; computed per call so any size works."""
    ys, xs = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device), indexing="ij")
    return torch.cat([_sincos(ys.flatten(), dim // 2), _sincos(xs.flatten(), dim // 2)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention; self-attention when no context is given. Under TP each rank
    runs its own heads (q, k, v column-parallel) and the output projection is row-parallel.
    Under sequence parallelism (`shard`) x is this rank's slice of the tokens and self-attention
    reaches the whole sequence through the group; cross-attention needs nothing of the others."""

    def __init__(self, hidden: int, heads: int, tp: TpGroup | None = None) -> None:
        super().__init__()
        self.heads = heads if tp is None else split(heads, tp, "num_heads")  # this rank's heads
        self.q = column(hidden, hidden, tp)
        self.kv = column(hidden, 2 * hidden, tp, chunks=2)
        self.proj = row(hidden, hidden, tp)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        shard: Shard | None = None,
    ) -> torch.Tensor:
        k, v = self.kv(x if context is None else context).chunk(2, dim=-1)
        q, k, v = self._heads(self.q(x)), self._heads(k), self._heads(v)
        if shard is not None and context is None:
            out, _ = split_attention(q, k, v, shard)
        else:
            # key_mask [B, L] True = attend; broadcast over heads and queries.
            mask = None if key_mask is None else key_mask[:, None, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, n, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_hidden: int, tp: TpGroup | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads, tp)
        self.norm_cross = nn.LayerNorm(hidden, eps=1e-6)
        self.cross_attn = Attention(hidden, heads, tp)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            column(hidden, mlp_hidden, tp), nn.GELU(approximate="tanh"), row(mlp_hidden, hidden, tp)
        )
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor | None,
        shard: Shard | None = None,
    ) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN(c).chunk(6, dim=-1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1), shard=shard)
        x = x + self.cross_attn(self.norm_cross(x), context, context_mask)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(nn.Module):
    """Predicts the flow-matching velocity of latents [B, C, h, w] at time t."""

    # DLO streams `blocks`; its leading blocks may stay resident on the device.
    _offload_plan = OffloadPlan(block_attrs={"": ("blocks",)}, resident_paths=("blocks",))
    # What regional compilation compiles (diffusers' name for the same declaration).
    _repeated_blocks = ("DiTBlock",)

    def __init__(self, config: DiTConfig, tp: TpGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp  # None: TP1; the blocks' attention and MLP are split across tp.size ranks
        # Set by the runner (weights do not depend on it): the image tokens split across sp ranks.
        self.sequence_parallel: Axis | None = None
        c, p, hid = config.latent_channels, config.patch_size, config.hidden_size
        self.x_embed = nn.Linear(c * p * p, hid)
        self.t_embed = nn.Sequential(nn.Linear(TIME_FREQ_DIM, hid), nn.SiLU(), nn.Linear(hid, hid))
        self.cond_embed = nn.Sequential(nn.Linear(config.cond_dim, hid), nn.SiLU(), nn.Linear(hid, hid))
        # Unconditional tokens for classifier-free guidance.
        self.null_cond = nn.Parameter(torch.zeros(1, config.cond_dim))
        self.blocks = nn.ModuleList(DiTBlock(hid, config.num_heads, config.mlp_hidden, tp) for _ in range(config.depth))
        self.final = FinalLayer(hid, c * p * p)

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.config.patch_size
        x = x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def _unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b = x.shape[0]
        p, c = self.config.patch_size, self.config.latent_channels
        x = x.view(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, cond_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, C, h, w], t [B] in [0, 1], cond [B, L, cond_dim], cond_mask [B, L] (True=valid)."""
        _, _, h, w = x.shape
        p = self.config.patch_size
        if h % p or w % p:
            raise ValueError(f"latent size {h}x{w} is not a multiple of patch_size {p}")
        dtype = self.x_embed.weight.dtype
        pos = pos_embed_2d(h // p, w // p, self.config.hidden_size, x.device).to(dtype)
        tokens = self.x_embed(self._patchify(x.to(dtype))) + pos[None]
        c = self.t_embed(timestep_embedding(t).to(dtype))
        context = self.cond_embed(cond.to(dtype))
        sp = self.sequence_parallel
        shard = Shard(sp, tokens.shape[1]) if sp is not None and sp.split else None
        if shard is not None:
            tokens = shard.take(tokens, dim=1)
        for block in self.blocks:
            tokens = block(tokens, c, context, cond_mask, shard)
        out = self.final(tokens, c)
        if shard is not None:
            out = shard.gather(out, dim=1)
        return self._unpatchify(out, h, w)


class LatentDecoder(nn.Module):
    """Latents [B, C, h, w] -> RGB [B, 3, h*s, w*s] in [-1, 1], one 2x stage per factor of 2.

    GroupNorm after each conv keeps activations at unit scale whatever the weight scale, so
    the output still carries the latent's structure. The encoder is fixed, not learned: the
    first three latent channels are a preview of the picture (RGB before the tanh, at latent
    resolution) that the learned path adds to, and `encode` inverts that preview. So a starting
    image has a latent the decoder draws back close to it (image-to-image), and the trained
    decoder learned to draw pictures back from exactly these latents.
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.scale = config.vae_scale
        ch = config.decoder_channels
        groups = math.gcd(ch, 8)
        stages = config.vae_scale.bit_length() - 1
        self.conv_in = nn.Conv2d(config.latent_channels, ch, 3, padding=1)
        self.norm_in = nn.GroupNorm(groups, ch)
        self.ups = nn.ModuleList(nn.Conv2d(ch, ch, 3, padding=1) for _ in range(stages))
        self.norms = nn.ModuleList(nn.GroupNorm(groups, ch) for _ in range(stages))
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm_in(self.conv_in(z.to(self.conv_in.weight.dtype))))
        for conv, norm in zip(self.ups, self.norms):
            h = F.silu(norm(conv(F.interpolate(h, scale_factor=2, mode="nearest"))))
        preview = F.interpolate(_rgb_channels(z), scale_factor=self.scale, mode="nearest")
        return torch.tanh(self.conv_out(h) + preview.to(h.dtype))

    def encode(self, images: torch.Tensor, latent_channels: int) -> torch.Tensor:
        """RGB images [B, H, W, 3] uint8 -> latents [B, C, H/s, W/s] float32 whose preview is
        the image averaged over s x s blocks (channels past the third are 0)."""
        rgb = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        pooled = F.avg_pool2d(rgb, self.scale).clamp(-PREVIEW_LIMIT, PREVIEW_LIMIT)
        latents = torch.zeros(rgb.shape[0], latent_channels, *pooled.shape[2:], device=images.device)
        pre_tanh = torch.atanh(pooled)
        if latent_channels >= 3:
            latents[:, :3] = pre_tanh
        else:  # too few channels for colour: every one of them holds the grey level
            latents[:] = pre_tanh.mean(dim=1, keepdim=True)
        return latents


# The preview of a pure white or black block is this close to +-1 (atanh(1) is infinite).
PREVIEW_LIMIT = 0.995


def _rgb_channels(z: torch.Tensor) -> torch.Tensor:
    """The latent's preview channels as RGB [B, 3, h, w]: the first three, or the grey level of
    fewer."""
    if z.shape[1] >= 3:
        return z[:, :3]
    return z.mean(dim=1, keepdim=True).expand(-1, 3, -1, -1)


def cond_bucket(length: int) -> int:
    """The padded conditioning length for a longest row of `length`: a power of two, at least
    MIN_COND_BUCKET. Few distinct lengths keep the number of captured step graphs small; the
    padding is masked out."""
    return max(MIN_COND_BUCKET, 1 << (length - 1).bit_length())


def pad_conds(conds: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack [L_i, D] tensors into zero-padded [B, L, D] plus a validity mask [B, L], where L is
    `length` (default: the longest L_i)."""
    longest = max(c.shape[0] for c in conds)
    if length is not None:
        if length < longest:
            raise ValueError(f"pad length {length} is shorter than the longest cond ({longest})")
        longest = length
    out = conds[0].new_zeros(len(conds), longest, conds[0].shape[1])
    mask = torch.zeros(len(conds), longest, dtype=torch.bool, device=conds[0].device)
    for i, c in enumerate(conds):
        out[i, : c.shape[0]] = c
        mask[i, : c.shape[0]] = True
    return out, mask


def _check_sample_args(
    dit: DiT,
    conds: list[torch.Tensor],
    width: int,
    height: int,
    steps: int,
    seeds: list[int],
    negatives: list[torch.Tensor | None] | None = None,
) -> None:
    cfg = dit.config
    if not conds or len(conds) != len(seeds):
        raise ValueError(f"need one seed per cond and at least one ({len(conds)} vs {len(seeds)})")
    if negatives is not None and len(negatives) != len(conds):
        raise ValueError(f"need one negative (or None) per cond ({len(negatives)} vs {len(conds)})")
    for c in conds + [n for n in negatives or () if n is not None]:
        if c.dim() != 2 or c.shape[0] < 1 or c.shape[1] != cfg.cond_dim:
            raise ValueError(f"cond must be [L>=1, {cfg.cond_dim}], got {tuple(c.shape)}")
    m = cfg.pixel_multiple
    if width <= 0 or height <= 0 or width % m or height % m:
        raise ValueError(f"width and height must be positive multiples of {m}, got {width}x{height}")
    if steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {steps}")


def initial_noise(dit: DiT, width: int, height: int, seeds: list[int]) -> torch.Tensor:
    """Per-request CPU noise, so results do not depend on batch mates or on the device."""
    cfg = dit.config
    shape = (cfg.latent_channels, height // cfg.vae_scale, width // cfg.vae_scale)
    noise = [torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(s)) for s in seeds]
    return torch.stack(noise)


def velocity(
    dit: DiT,
    x: torch.Tensor,
    t: torch.Tensor,
    cond: torch.Tensor,
    mask: torch.Tensor,
    guided: bool,
    guidance: float | torch.Tensor,
    cfg: Axis | None = None,
) -> torch.Tensor:
    """The flow velocity of latents `x` at times `t` (one per DiT row), float32; with guidance
    `cond` holds the conditional rows then the unconditional ones. Under CFG parallelism (`cfg`
    split) it holds this rank's half alone and the two ranks exchange their predictions."""
    if guided and cfg is not None and cfg.split:
        v_c, v_u = exchange_passes(dit(x, t, cond, mask).float(), cfg)
        return v_u + guidance * (v_c - v_u)
    v = dit(torch.cat([x, x]) if guided else x, t, cond, mask).float()
    if not guided:
        return v
    v_c, v_u = v.chunk(2)
    return v_u + guidance * (v_c - v_u)


def _euler(
    dit: DiT,
    x: torch.Tensor,
    cond: torch.Tensor,
    mask: torch.Tensor,
    n: int,
    guidance_scale: float,
    progress: Progress | None,
    cfg: Axis | None,
    start: int = 0,
) -> torch.Tensor:
    """Steps start..n-1 of the n-step schedule from t = 1 to 0; progress counts the steps run."""
    guided = guidance_scale != 1.0
    for i in range(start, n):
        t, t_next = 1.0 - i / n, 1.0 - (i + 1) / n
        t_rows = torch.full((cond.shape[0],), t, device=x.device)
        x = x + (t_next - t) * velocity(dit, x, t_rows, cond, mask, guided, guidance_scale, cfg)
        if progress is not None:
            progress(i + 1 - start, n - start)
    return x


@dataclass(frozen=True)
class StartImages:
    """Image-to-image: where each row starts. `latents` [B, C, h, w] (LatentDecoder.encode) are
    noised to the time of step `first_step` of the schedule, and only the steps from there run."""

    latents: torch.Tensor
    first_step: int


def _start_latents(
    dit: DiT, width: int, height: int, seeds: list[int], steps: int, start: StartImages | None
) -> tuple[torch.Tensor, int]:
    """The latents denoising starts from and the step it starts at: noise at t = 1, or the
    starting images noised to t = 1 - first_step / steps (x_t = (1 - t) x_0 + t noise)."""
    noise = initial_noise(dit, width, height, seeds)
    if start is None:
        return noise, 0
    if not 0 <= start.first_step < steps or start.latents.shape != noise.shape:
        raise ValueError(
            f"start images need latents of shape {tuple(noise.shape)} and a first step in 0..{steps - 1}; "
            f"got {tuple(start.latents.shape)} and {start.first_step}"
        )
    t = 1.0 - start.first_step / steps
    return (1.0 - t) * start.latents.float().cpu() + t * noise, start.first_step


def sample(
    dit: DiT,
    decoder: LatentDecoder,
    conds: list[torch.Tensor],
    width: int,
    height: int,
    num_inference_steps: int,
    guidance_scale: float,
    seeds: list[int],
    progress: Progress | None = None,
    graphs: CapturedSteps | None = None,
    cfg: Axis | None = None,
    negatives: list[torch.Tensor | None] | None = None,
    start: StartImages | None = None,
) -> torch.Tensor:
    """Euler flow-matching sampler; returns images [B, height, width, 3] float32 in [0, 1].
    With `graphs` the steps are replayed from captured CUDA graphs (same arithmetic). With `cfg`
    (CFG parallel, guided) this rank runs one pass: rank 0 the conditional, rank 1 the
    unconditional; both hold the same latents after every step. `negatives`: per row, the
    conditioning guidance steers away from (a negative prompt's); None (or a None row) means the
    model's learned unconditional input. `start`: image-to-image."""
    _check_sample_args(dit, conds, width, height, num_inference_steps, seeds, negatives)
    device, dtype = dit.null_cond.device, dit.null_cond.dtype
    with torch.inference_mode():
        rows = [platform.to_device(c, device).to(dtype) for c in conds]
        if guidance_scale != 1.0:
            unconditional = negatives or [None] * len(conds)
            rows += [dit.null_cond if n is None else platform.to_device(n, device).to(dtype) for n in unconditional]
        # Padded to the length of all rows, as one rank would: equal masks, equal arithmetic.
        cond, mask = pad_conds(rows, cond_bucket(max(r.shape[0] for r in rows)))
        if guidance_scale != 1.0 and cfg is not None and cfg.split:
            cond, mask = cond.chunk(2)[cfg.rank], mask.chunk(2)[cfg.rank]
        # Latents stay float32 so the Euler sum does not drift in low precision.
        x, first = _start_latents(dit, width, height, seeds, num_inference_steps, start)
        x = platform.to_device(x, device)
        if graphs is not None:
            x = graphs.denoise(x, cond, mask, num_inference_steps, guidance_scale, progress, start=first)
        else:
            x = _euler(dit, x, cond, mask, num_inference_steps, guidance_scale, progress, cfg, start=first)
        rgb = decoder(x).float()
        # Channels last on the device: each request's image is then one contiguous slice, which
        # the output path ships without a strided gather on the host.
        return ((rgb + 1.0) / 2.0).clamp(0.0, 1.0).permute(0, 2, 3, 1).contiguous()

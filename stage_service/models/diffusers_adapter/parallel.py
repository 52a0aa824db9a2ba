"""Splitting a diffusers pipeline's denoising across ranks (models/parallel.py has the ranks'
layout): FLUX by sequence (sp_size), SD3 by its two guidance passes (cfg_parallel).

These are the families that declare `sequence_parallel` / `cfg_parallel`; their split runs the
written-out loop (sampling.sample over split_families), handed a family that wraps the
checkpoint's own.

- FLUX, sequence parallel: each rank passes the transformer its slice of the packed image
  tokens and of their position ids, and every attention runs through `SequenceParallelFluxAttn`
  (installed with the transformer's `set_attn_processor`): the module's own projections, norms
  and diffusers' rotary helper, with sequence_parallel.attention across the ranks. The text
  tokens stay whole on every rank. The velocity slices are gathered after each evaluation, so
  every rank steps the scheduler on the same latents.
- SD3, CFG parallel: rank 0 runs the unconditional rows, rank 1 the conditional ones, one
  unguided evaluation each; the two predictions are exchanged and combined as SD3 combines them.
"""

from __future__ import annotations

from typing import Any

import torch

from stagemesh.stage_service.models.diffusers_adapter.families import FAMILIES, Family
from stagemesh.stage_service.models.diffusers_adapter.split_families import SPLIT, SamplingFamily, Tensors
from stagemesh.stage_service.models.parallel import Axis, ImageParallel, exchange_passes
from stagemesh.stage_service.models.sequence_parallel import Shard, attention


def for_sampling(family: Family, transformer, parallel: ImageParallel) -> SamplingFamily:
    """The written-out denoising `sample` runs on this rank; refuses a split the family does
    not declare."""
    if parallel.sp.split and not family.sequence_parallel:
        covered = [f.pipeline_class for f in FAMILIES.values() if f.sequence_parallel]
        raise ValueError(
            f"sp_size = {parallel.sp.size} with {family.pipeline_class}: sequence parallelism covers "
            f"{', '.join(covered)} and the embedded DiT; set sp_size = 1"
        )
    if parallel.cfg.split and not family.cfg_parallel:
        why = family.negative_prompt_refusal or "CFG parallelism is not declared for it"
        raise ValueError(
            f"cfg_parallel = true with {family.pipeline_class}: {why}; set cfg_parallel = false "
            "(sp_size splits one image of it)"
        )
    sampling = SPLIT[family.pipeline_class]
    if parallel.sp.split:
        transformer.set_attn_processor(SequenceParallelFluxAttn())
        sampling = FluxSequenceParallel(sampling, parallel.sp)
    if parallel.cfg.split:
        sampling = CfgParallel(sampling, parallel.cfg)
    return sampling


def runs_unconditional(guidance_scale: float) -> bool:
    """Whether a CFG family (SD3) runs its unconditional pass at this guidance scale."""
    return guidance_scale > 1


class _Wrapped(SamplingFamily):
    """A family that does what `inner` does, except where a subclass says otherwise."""

    def __init__(self, inner: SamplingFamily) -> None:
        self.inner = inner
        self.pipeline_class = inner.pipeline_class
        self.packs_2x2 = inner.packs_2x2
        self.guided_inputs = inner.guided_inputs

    def latent_size(self, pixels: int, vae_scale: int) -> int:
        return self.inner.latent_size(pixels, vae_scale)

    def latent_channels(self, transformer) -> int:
        return self.inner.latent_channels(transformer)

    def to_model(self, latents: torch.Tensor) -> torch.Tensor:
        return self.inner.to_model(latents)

    def to_vae(self, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return self.inner.to_vae(latents, h, w)

    def set_schedule(self, scheduler, steps: int, h: int, w: int, transformer, device) -> None:
        self.inner.set_schedule(scheduler, steps, h, w, transformer, device)

    def conditioning(self, transformer, embeds: Tensors, guidance_scale: float, h: int, w: int) -> Tensors:
        return self.inner.conditioning(transformer, embeds, guidance_scale, h, w)

    def predict(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: Tensors, guidance_scale: float):
        return self.inner.predict(transformer, latents, t, cond, guidance_scale)


class FluxSequenceParallel(_Wrapped):
    """Each evaluation on this rank's slice of the packed image tokens [B, N, C]."""

    def __init__(self, inner: SamplingFamily, sp: Axis) -> None:
        super().__init__(inner)
        self.sp = sp

    def predict(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: Tensors, guidance_scale: float):
        shard = Shard(self.sp, latents.shape[1])
        local: dict[str, Any] = dict(cond)
        local["img_ids"] = shard.take(cond["img_ids"], dim=0)  # rotary positions of this slice
        text = cond["encoder_hidden_states"].shape[1]
        # Reaches every attention processor (FluxAttention passes the keywords its processor takes).
        local["joint_attention_kwargs"] = {"sp_shard": shard, "sp_text_tokens": text}
        mine = self.inner.predict(transformer, shard.take(latents, dim=1), t, local, guidance_scale)
        return shard.gather(mine, dim=1)


class SequenceParallelFluxAttn:
    """FLUX attention over image tokens split across a sequence-parallel group, text tokens
    whole on every rank. Double-stream blocks pass the text as `encoder_hidden_states`;
    single-stream blocks pass [text; image] as one sequence with `sp_text_tokens` naming the
    text's length. Without `sp_shard` (a call outside a split evaluation) it attends over what
    it is given, as diffusers' FluxAttnProcessor does."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb=None,
        sp_shard: Shard | None = None,
        sp_text_tokens: int = 0,
    ):
        if attention_mask is not None:
            raise ValueError("FLUX attention masks are not supported under sequence parallelism")

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, S, H*D] -> [B, S, H, D]
            return t.unflatten(-1, (-1, attn.head_dim))

        q = attn.norm_q(heads(attn.to_q(hidden_states)))
        k = attn.norm_k(heads(attn.to_k(hidden_states)))
        v = heads(attn.to_v(hidden_states))
        text = sp_text_tokens
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))), q], dim=1)
            k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))), k], dim=1)
            v = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), v], dim=1)
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sp_shard, text)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        text_out, image_out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())

    @staticmethod
    def _attend(q, k, v, shard: Shard | None, text: int) -> torch.Tensor:
        """[B, H, text + image, D] -> the same, attended over every rank's image tokens."""
        if shard is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        shared = (q[:, :, :text], k[:, :, :text], v[:, :, :text]) if text else None
        image_out, text_out = attention(q[:, :, text:], k[:, :, text:], v[:, :, text:], shard, shared)
        return image_out if text_out is None else torch.cat([text_out, image_out], dim=2)


class CfgParallel(_Wrapped):
    """Guided evaluations split over a CFG pair: the family's [unconditional; conditional] rows
    halved (rank 0 keeps the unconditional ones), each rank's prediction exchanged."""

    def __init__(self, inner: SamplingFamily, cfg: Axis) -> None:
        super().__init__(inner)
        self.cfg = cfg

    def conditioning(self, transformer, embeds: Tensors, guidance_scale: float, h: int, w: int) -> Tensors:
        cond = self.inner.conditioning(transformer, embeds, guidance_scale, h, w)
        if not runs_unconditional(guidance_scale):
            return cond
        return {name: t.chunk(2)[self.cfg.rank] for name, t in cond.items()}

    def predict(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: Tensors, guidance_scale: float):
        if not runs_unconditional(guidance_scale):
            return self.inner.predict(transformer, latents, t, cond, guidance_scale)
        # Guidance 1: the family's single unguided evaluation of these rows.
        mine = self.inner.predict(transformer, latents, t, cond, 1.0)
        uncond, text = exchange_passes(mine, self.cfg)
        return uncond + guidance_scale * (text - uncond)

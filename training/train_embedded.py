"""Train the embedded default pipeline (PipelineConfig.tiny) on the shapes data set.

    python -m training.train_embedded --out DIR [--seed 0]

Three phases on one thread, every random draw from one generator seeded with --seed:
1. the decoder learns to draw pictures back from their latents (LatentDecoder.encode, a fixed
   function, defines the latent space);
2. the language model and the DiT learn together: the LM predicts each caption's next byte, and
   the DiT's flow-matching loss flows back through the hidden states it reads, computed exactly
   as the AR stage computes them (the prompt's tokens plus the greedily decoded ones);
3. the LM is frozen and the DiT goes on alone, which is most of the steps at a third of the cost.
Some captions are replaced by the DiT's unconditional input, so classifier-free guidance and
negative prompts work.

Writes DIR as a model folder plus SHA256SUMS and training.json (the recipe), then prints how
well sampled pictures follow their captions. docs/MODELS.md has the expected checksums.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.stage_service.models.config import BOS_ID, EOS_ID, PAD_ID, PipelineConfig
from stagemesh.stage_service.models.dit import DiT, DiTBlock, LatentDecoder, pad_conds, sample
from stagemesh.stage_service.models.lm import CausalLM, KVCache, LMBlock
from stagemesh.stage_service.models.weights import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    DIT_FILE,
    LM_FILE,
    RECIPE_FILE,
    write_model_dir,
)
from training import shapes


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    image_size: int = 64
    decoder_steps: int = 150
    decoder_batch: int = 16
    decoder_lr: float = 2e-3
    decoder_latent_noise: float = 0.05  # the DiT's latents are never exact
    joint_steps: int = 500  # the LM learns with the DiT
    frozen_steps: int = 7000  # then the DiT alone
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 100
    lm_loss_weight: float = 0.2
    uncond_prob: float = 0.1  # captions replaced by the unconditional input
    generator_version: int = shapes.GENERATOR_VERSION


def _zero_(module: nn.Module) -> None:
    for p in module.parameters():
        nn.init.zeros_(p)


def build_models(config: PipelineConfig, seed: int) -> tuple[CausalLM, DiT, LatentDecoder]:
    """PyTorch's default initialisation, except that each DiT block's modulation and the output
    layers start at zero (adaLN-Zero: every block begins as the identity), and the decoder's
    learned path starts at zero (it begins as the latent's preview)."""
    torch.manual_seed(seed)
    lm, dit, decoder = CausalLM(config.lm), DiT(config.dit), LatentDecoder(config.dit)
    for block in dit.blocks:
        _zero_(cast(DiTBlock, block).adaLN[-1])
    _zero_(dit.final.adaLN[-1])
    _zero_(dit.final.linear)
    _zero_(decoder.conv_out)
    return lm, dit, decoder


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to zero."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def train_decoder(decoder: LatentDecoder, recipe: Recipe, gen: torch.Generator, channels: int) -> None:
    opt = torch.optim.AdamW(decoder.parameters(), lr=recipe.decoder_lr, weight_decay=0.0)
    for step in range(recipe.decoder_steps):
        _set_lr(opt, _lr_at(step, recipe.decoder_steps, recipe.decoder_lr, recipe.warmup))
        images, _ = shapes.batch(gen, recipe.decoder_batch, recipe.image_size)
        latents = decoder.encode(images, channels)
        latents = latents + recipe.decoder_latent_noise * torch.randn(latents.shape, generator=gen)
        target = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        loss = F.mse_loss(decoder(latents), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == recipe.decoder_steps - 1:
            print(f"decoder step {step:5d}  loss {loss.item():.5f}", flush=True)


def _padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, longest] and each row's length."""
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.full((len(seqs), int(lengths.max())), PAD_ID)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    return tokens, lengths


def _decode_step(
    lm: CausalLM, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """One token per row at its own position. `cache` holds the padded prompts' keys, then the
    decoded tokens' (the same for every row); `prompt_mask` [B, P] hides each row's padding.
    Attention does not depend on the order of its keys, so this is CausalLM.generate's step.
    Returns hidden [B, d], logits [B, V] and the cache with the new keys appended."""
    x = lm.tok_emb(tokens) + lm.pos_emb(positions)
    decoded = cache[0][0].shape[2] - prompt_mask.shape[1] + 1
    visible = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], decoded)], dim=1)[:, None, None]
    new_cache: KVCache = []
    for module, (past_k, past_v) in zip(lm.blocks, cache):
        block = cast(LMBlock, module)
        attn = block.attn
        b, d = x.shape
        q, k, v = attn.qkv(block.ln1(x)).view(b, 1, 3, attn.n_heads, d // attn.n_heads).permute(2, 0, 3, 1, 4)
        keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + attn.proj(out.reshape(b, d))
        x = x + block.mlp(block.ln2(x))
        new_cache.append((keys, values))
    hidden = lm.norm_f(x)
    return hidden, lm.lm_head(hidden), new_cache


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """CausalLM's choice of next token for each row: never BOS or PAD."""
    logits = logits.detach().float().clone()
    logits[:, [BOS_ID, PAD_ID]] = float("-inf")
    return logits.argmax(dim=-1)


def conditioning(lm: CausalLM, captions: list[str]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The hidden states the AR stage hands on for each caption (the prompt's, then those of up
    to decode_tokens greedily decoded tokens on the KV cache, as CausalLM.generate), with
    gradients; and the LM's next-byte loss on the captions (each ending in EOS)."""
    prompts = [lm.tokenizer.encode(c) for c in captions]
    tokens, lengths = _padded(prompts)
    hidden, logits, cache = lm(tokens)
    targets = torch.full(tokens.shape, -100)
    for i, p in enumerate(prompts):
        targets[i, : len(p)] = torch.tensor(p[1:] + [EOS_ID])
    lm_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    rows = torch.arange(len(prompts))
    states = [hidden[i, : len(p)] for i, p in enumerate(prompts)]
    extras: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = torch.ones(len(prompts), dtype=torch.bool)
    last_logits, positions = logits[rows, lengths - 1], lengths
    prompt_mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    for _ in range(lm.config.decode_tokens):
        nxt = _greedy(last_logits)
        live &= nxt != EOS_ID
        if not live.any():
            break
        step_hidden, last_logits, cache = _decode_step(lm, nxt, positions, cache, prompt_mask)
        for i in torch.nonzero(live).flatten().tolist():
            extras[i].append(step_hidden[i])
        positions = positions + 1
    conds = [torch.cat([s, torch.stack(e)]) if e else s for s, e in zip(states, extras)]
    return conds, lm_loss


class FrozenConditioning:
    """The hidden states of a frozen LM, each caption's computed once."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.known: dict[str, torch.Tensor] = {}

    def __call__(self, captions: list[str]) -> list[torch.Tensor]:
        missing = sorted(set(captions) - self.known.keys())
        if missing:
            with torch.no_grad():
                self.known.update(zip(missing, conditioning(self.lm, missing)[0]))
        return [self.known[c] for c in captions]


def train_pair(lm: CausalLM, dit: DiT, decoder: LatentDecoder, recipe: Recipe, gen: torch.Generator) -> None:
    """The first joint_steps train both models; then the LM is frozen and the DiT goes on alone
    (the LM's conditioning no longer changes, so each caption's is computed once)."""
    params = list(lm.parameters()) + list(dit.parameters())
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    channels = dit.config.latent_channels
    total = recipe.joint_steps + recipe.frozen_steps
    frozen: FrozenConditioning | None = None
    lm_loss = torch.zeros(())
    started = time.monotonic()
    for step in range(total):
        if step == recipe.joint_steps:
            lm.eval().requires_grad_(False)
            frozen = FrozenConditioning(lm)
        _set_lr(opt, _lr_at(step, total, recipe.lr, recipe.warmup))
        images, examples = shapes.batch(gen, recipe.batch, recipe.image_size)
        captions = [e.caption for e in examples]
        with torch.no_grad():
            x0 = decoder.encode(images, channels)
        if frozen is None:
            conds, lm_loss = conditioning(lm, captions)
        else:
            conds = frozen(captions)
        dropped = (torch.rand(recipe.batch, generator=gen) < recipe.uncond_prob).tolist()
        cond, mask = pad_conds([dit.null_cond if d else c for c, d in zip(conds, dropped)])
        noise = torch.randn(x0.shape, generator=gen)
        # Uniform times: the first sampling steps (t near 1) lay out the picture from the caption.
        t = torch.rand(recipe.batch, generator=gen)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        flow_loss = F.mse_loss(dit(xt, t, cond, mask), noise - x0)
        loss = flow_loss + recipe.lm_loss_weight * lm_loss if frozen is None else flow_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == total - 1:
            elapsed = time.monotonic() - started
            print(f"step {step:5d}  flow {flow_loss.item():.4f}  lm {lm_loss.item():.4f}  {elapsed:.0f}s", flush=True)


def caption_accuracy(lm: CausalLM, dit: DiT, decoder: LatentDecoder, size: int, count: int = 32) -> dict[str, float]:
    """The share of sampled pictures (8 steps, guidance 4) whose read-back attributes match a
    full caption's, per attribute."""
    gen = torch.Generator().manual_seed(12345)
    hits = dict.fromkeys(("colour", "background", "position", "shape", "size"), 0)
    with torch.inference_mode():
        for i in range(count):
            scene = shapes.random_scene(gen)
            cond = lm.encode_prompt(shapes.caption(scene, set(shapes.MENTION)))
            image = sample(dit, decoder, [cond], size, size, 8, 4.0, [i])[0]
            reading = shapes.read_picture(image)
            for key in hits:
                hits[key] += getattr(reading, key) == getattr(scene, key)
    return {k: v / count for k, v in hits.items()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_outputs(
    out: Path, config: PipelineConfig, models: tuple[CausalLM, DiT, LatentDecoder], recipe: Recipe
) -> str:
    """The model folder, its checksums and the recipe; returns the SHA256SUMS text."""
    out.mkdir(parents=True, exist_ok=False)
    write_model_dir(out, config, *models)
    sums = "".join(f"{_sha256(out / f)}  {f.as_posix()}\n" for f in (Path(CONFIG_FILE), LM_FILE, DIT_FILE))
    (out / CHECKSUM_FILE).write_text(sums)
    recipe_text = json.dumps({**asdict(recipe), "script": "training/train_embedded.py"}, indent=2, sort_keys=True)
    (out / RECIPE_FILE).write_text(recipe_text + "\n")
    return sums


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="model folder to write (must not exist)")
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--joint-steps", type=int, default=Recipe.joint_steps)
    parser.add_argument("--frozen-steps", type=int, default=Recipe.frozen_steps)
    parser.add_argument("--decoder-steps", type=int, default=Recipe.decoder_steps)
    args = parser.parse_args(argv)
    # One thread and deterministic kernels: the same seed gives the same bytes on this machine.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    recipe = Recipe(
        seed=args.seed, joint_steps=args.joint_steps, frozen_steps=args.frozen_steps, decoder_steps=args.decoder_steps
    )
    config = PipelineConfig.tiny()
    started, cpu_started = time.monotonic(), time.process_time()
    lm, dit, decoder = build_models(config, recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    train_decoder(decoder, recipe, gen, config.dit.latent_channels)
    train_pair(lm, dit, decoder, recipe, gen)
    for model in (lm, dit, decoder):
        model.eval().requires_grad_(False)
    print(write_outputs(args.out, config, (lm, dit, decoder), recipe), end="")
    print(f"trained in {time.monotonic() - started:.0f}s ({time.process_time() - cpu_started:.0f}s of CPU)")
    print("caption accuracy:", caption_accuracy(lm, dit, decoder, recipe.image_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

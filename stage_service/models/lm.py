"""Stage 0: a small causal transformer LM whose hidden states condition the DiT."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.stage_service.models.config import BOS_ID, EOS_ID, PAD_ID, LMConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class ByteTokenizer:
    """UTF-8 bytes as token ids, BOS first; long prompts are cut, never rejected."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 (room for BOS)")
        self.max_tokens = max_tokens

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")[: self.max_tokens - 1]
        return [BOS_ID, *data]

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        total = k.shape[2]
        mask = None
        if n > 1:
            # Query i sits at absolute position total - n + i and sees keys up to it.
            q_pos = torch.arange(total - n, total, device=x.device)[:, None]
            mask = torch.arange(total, device=x.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d)), (k, v)


class LMBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"), nn.Linear(4 * d_model, d_model)
        )

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn_out, present = self.attn(self.ln1(x), past)
        x = x + attn_out
        return x + self.mlp(self.ln2(x)), present


class CausalLM(nn.Module):
    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = ByteTokenizer(config.max_prompt_tokens)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(LMBlock(config.d_model, config.n_heads) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """tokens [B, n] continue the sequence held in `cache` (None: start fresh).

        Returns final-norm hidden states [B, n, d], logits [B, n, V] and the extended cache.
        """
        start = cache[0][0].shape[2] if cache else 0
        n = tokens.shape[1]
        if start + n > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + n} exceeds max_seq_len {self.config.max_seq_len}")
        pos = torch.arange(start, start + n, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)[None]
        new_cache: KVCache = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, cache[i] if cache else None)
            new_cache.append(present)
        hidden = self.norm_f(x)
        return hidden, self.lm_head(hidden), new_cache

    def _next_token(self, logits: torch.Tensor) -> int:
        # BOS and PAD are never produced; everything else, EOS included, may be.
        logits = logits.float().clone()
        logits[[BOS_ID, PAD_ID]] = float("-inf")
        return int(torch.argmax(logits))

    def generate(self, ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """Prefill `ids`, then greedily decode up to decode_tokens tokens on the KV cache.

        Returns all token ids (prompt + generated, EOS excluded) and their hidden states
        [T, d] as float32.
        """
        if not ids:
            raise ValueError("generate needs at least one token")
        device = self.tok_emb.weight.device
        with torch.inference_mode():
            hidden, logits, cache = self(torch.tensor([ids], device=device), None)
            states = [hidden[0]]
            out_ids = list(ids)
            for _ in range(self.config.decode_tokens):
                nxt = self._next_token(logits[0, -1])
                if nxt == EOS_ID:
                    break
                out_ids.append(nxt)
                hidden, logits, cache = self(torch.tensor([[nxt]], device=device), cache)
                states.append(hidden[0])
            return out_ids, torch.cat(states).float()

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """Hidden states [T, d_model] float32 of the prompt tokens and the decoded tokens."""
        return self.generate(self.tokenizer.encode(prompt))[1]

"""Attention over a sequence split across the ranks of a sequence-parallel group.

Each rank holds one contiguous slice of the sequence, every head of it. Two ways to attend over
the whole sequence:

- Ulysses (the head count divides by sp_size): one all-to-all turns [my tokens, every head]
  into [every token, my heads], attention runs on those heads alone, a second all-to-all turns
  the result back. Each rank sends and receives (sp - 1) / sp of its q, k, v and output.
- Ring (any head count): the key/value slices travel round the ring, one hop per turn, the next
  hop in flight while this one is attended; each rank attends its queries to every slice and
  merges the partial results by their log-sum-exp, in slice order, so every rank rounds alike.
  The partial attention is computed in float32 without a fused kernel: the fallback, not the
  fast path.

A sequence whose length sp_size does not divide is padded at its tail; padded keys are masked
out and padded queries dropped when the slices are gathered. Tokens that every rank holds whole
("shared": FLUX's text tokens, which come before the image tokens) take part as keys and
queries: under Ulysses each rank attends its heads of them and the output heads are gathered;
under ring every rank attends them, identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stagemesh.stage_service.models.parallel import Axis, gather_along

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a sequence of `total` tokens, padded to a multiple of the ranks."""

    axis: Axis
    total: int

    @property
    def local(self) -> int:
        return -(-self.total // self.axis.size)

    @property
    def padded(self) -> int:
        return self.local * self.axis.size

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of the whole sequence `x` along `dim`, zero-padded at the tail."""
        if x.shape[dim] != self.total:
            raise ValueError(f"sequence of {x.shape[dim]} tokens along dim {dim}, expected {self.total}")
        if self.padded != self.total:
            pad = list(x.shape)
            pad[dim] = self.padded - self.total
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        return x.narrow(dim, self.axis.rank * self.local, self.local)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence from every rank's slice `x`, padding dropped."""
        return gather_along(x, self.axis, dim).narrow(dim, 0, self.total)

    def valid_keys(self, chunk: int, device: torch.device) -> torch.Tensor | None:
        """Which keys of slice `chunk` are real tokens; None: all of them."""
        end = (chunk + 1) * self.local
        if end <= self.total:
            return None
        return torch.arange(chunk * self.local, end, device=device) < self.total


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: Shard, shared: QKV | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of this rank's queries over the whole sequence. q, k, v [B, H, local, D]
    (this rank's slice); `shared` (q, k, v) [B, H, L, D] tokens every rank holds whole, placed
    before the sequence. Returns (output of the slice, output of the shared tokens or None)."""
    heads = q.shape[1]
    if heads % shard.axis.size == 0:
        return _ulysses(q, k, v, shard, shared)
    return _ring(q, k, v, shard, shared)


# ---- Ulysses --------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=axis.group)
    return out


def _tokens_to_heads(qkv: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[3, B, H, n, D] (my tokens) -> [3, B, H/sp, sp*n, D] (every token, my heads)."""
    three, b, h, n, d = qkv.shape
    sp = axis.size
    send = qkv.view(three, b, sp, h // sp, n, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    got = _all_to_all(send, axis)  # got[j]: rank j's tokens, my heads
    return got.permute(1, 2, 3, 0, 4, 5).reshape(three, b, h // sp, sp * n, d)


def _heads_to_tokens(out: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[B, H/sp, sp*n, D] (every token, my heads) -> [B, H, n, D] (my tokens, every head)."""
    b, hs, total, d = out.shape
    sp = axis.size
    send = out.view(b, hs, sp, total // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(send, axis)  # got[j]: head group j of my tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, sp * hs, total // sp, d)


def _ulysses(q, k, v, shard: Shard, shared: QKV | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    axis = shard.axis
    q, k, v = _tokens_to_heads(torch.stack([q, k, v]), axis).unbind(0)
    hs = q.shape[1]
    mine = slice(axis.rank * hs, (axis.rank + 1) * hs)
    n_shared = 0
    if shared is not None:
        n_shared = shared[0].shape[2]
        q, k, v = (torch.cat([s[:, mine], t], dim=2) for s, t in zip(shared, (q, k, v)))
    mask = None
    if shard.padded != shard.total:
        keys = torch.arange(n_shared + shard.padded, device=q.device)
        mask = (keys < n_shared + shard.total)[None, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    shared_out = None
    if shared is not None:
        shared_out = gather_along(out[:, :, :n_shared].contiguous(), axis, 1)
        out = out[:, :, n_shared:]
    return _heads_to_tokens(out.contiguous(), axis), shared_out


# ---- ring -----------------------------------------------------------------------------------
def _partial(q, k, v, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(D)) v, log-sum-exp of the scores) over these keys, float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()), lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    out, lse = parts[0]
    for o, part_lse in parts[1:]:
        total = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - total) + o * torch.exp(part_lse - total)
        lse = total
    return out


class _Hop:
    """Send `kv` to the next rank of the ring and receive the previous rank's, asynchronously."""

    def __init__(self, kv: torch.Tensor, axis: Axis) -> None:
        self.incoming = torch.empty_like(kv)
        nxt = dist.get_global_rank(axis.group, (axis.rank + 1) % axis.size)
        prev = dist.get_global_rank(axis.group, (axis.rank - 1) % axis.size)
        ops = [
            dist.P2POp(dist.isend, kv, nxt, group=axis.group),
            dist.P2POp(dist.irecv, self.incoming, prev, group=axis.group),
        ]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self.incoming


def _ring(q, k, v, shard: Shard, shared: QKV | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    axis = shard.axis
    n_shared = 0 if shared is None else shared[0].shape[2]
    queries = q if shared is None else torch.cat([shared[0], q], dim=2)
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if shared is not None:
        parts[-1] = _partial(queries, shared[1], shared[2], None)
    kv = torch.stack([k, v]).contiguous()
    for turn in range(axis.size):
        chunk = (axis.rank - turn) % axis.size  # whose slice this rank holds now
        hop = _Hop(kv, axis) if turn < axis.size - 1 else None
        mask = shard.valid_keys(chunk, q.device)
        if mask is None or bool(mask.any()):  # a slice of padding alone adds nothing
            parts[chunk] = _partial(queries, kv[0], kv[1], mask)
        if hop is not None:
            kv = hop.wait()
    out = _merge([parts[c] for c in sorted(parts)]).to(q.dtype)
    if shared is None:
        return out, None
    return out[:, :, n_shared:], out[:, :, :n_shared]

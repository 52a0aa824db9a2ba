"""Batch invariance: a request's output does not depend on the requests it was batched with.

A denoising stage samples a batch as one, and the kernels under the model pick their blocking
by the shapes they are given, so the same request rounds differently in a batch of four than
alone. Measured on the embedded model (bench/batch_invariance.py, docs/PERFORMANCE.md):

- nn.Linear on [M, K] gives row 0 different bits for different M: on the CPU (MKL) for M = 1,
  for 2-3 and for 4 or more rows on one host, 1 / 2-10 / 11+ on another; on an H200 (cuBLAS,
  float32) in five classes from M = 1 to 8192. Every projection of the DiT has M = rows x tokens;
- Conv2d (the decoder) changes with the batch size, at small sizes on the CPU, from 64x64 up on
  the GPU;
- the conditioning is padded to the longest prompt of the batch, so its projections' M and the
  attention's key length depend on the batch mates (on the CPU the attention rounds differently
  for 8 keys padded to 16);
- LayerNorm, GroupNorm and scaled_dot_product_attention over the batch dimension, and each row
  of a Linear or Conv2d at a fixed shape wherever the row sits, gave the same bits everywhere.

So a request gets the same bytes whenever every kernel it passes through sees the same shapes:
- the embedded DiT runs every batch at a fixed number of requests (the stage's max_batch_size;
  copies of the first request fill a short batch and their outputs are dropped), and only
  requests whose conditioning pads to the same length share a pass (`padding_key`; the engine
  forms such batches, the runner splits any other) - full batches cost nothing extra;
- a runner that cannot do that (a diffusers pipeline) runs each request as a batch of its own
  (`run_items_alone`), which is exact on any device but gives up batching.
Noise is drawn per request from its own seed in both.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from stagemesh.stage_service.models.contract import ItemError, Progress, WorkItem
from stagemesh.stage_service.models.dit import cond_bucket

# Stage kinds whose runner samples a batch as one; every other kind already runs each request
# alone (the language model, the text encoders, the VAE of a decode stage).
BATCHED_KINDS = ("diffusion", "denoise")

RunBatch = Callable[[list[WorkItem], Progress | None], list[dict[str, torch.Tensor]]]


def padding_key(inputs: dict[str, torch.Tensor]) -> tuple:
    """What must be equal for two requests to share a batch under batch_invariant: the length
    each input tensor pads to in a batch (the embedded DiT's conditioning bucket; a tensor of
    fixed shape, e.g. a diffusers pipeline's prompt embeddings, gives every request the same key)."""
    return tuple(sorted((name, cond_bucket(t.shape[0]) if t.dim() else 0) for name, t in inputs.items()))


def groups_by_key(keys: Sequence[Hashable], size: int) -> list[list[int]]:
    """Indices with equal keys together, in order of first appearance, at most `size` per group."""
    by_key: dict[Hashable, list[list[int]]] = {}
    for index, key in enumerate(keys):
        groups = by_key.setdefault(key, [[]])
        if len(groups[-1]) == size:
            groups.append([])
        groups[-1].append(index)
    return [group for groups in by_key.values() for group in groups]


def run_in_groups(
    run: RunBatch, batch: list[WorkItem], groups: list[list[int]], progress: Progress | None = None
) -> list[dict[str, torch.Tensor]]:
    """`run` once per group of `batch` (lists of indices covering it), outputs in batch order.

    Progress stays in the items' own units: once group g of G has finished step s of n, the
    batch is at (g*n + s) / G steps, and each whole step is reported once, so callers see steps
    1..n of n as from one run (and may still abort between them). An ItemError names the
    item's index in `batch` (a padded run's filler counts as its group's first item).
    """
    if len(groups) == 1 and groups[0] == list(range(len(batch))):
        return run(batch, progress)
    outputs: list[dict[str, torch.Tensor] | None] = [None] * len(batch)
    reported = 0

    def group_progress(g: int) -> Progress:
        def report(step: int, total: int) -> None:
            nonlocal reported
            batch_step = (g * total + step) // len(groups)
            if batch_step > reported:
                reported = batch_step
                progress(batch_step, total)  # type: ignore[misc]  # only made with a progress

        return report

    for g, group in enumerate(groups):
        try:
            got = run([batch[i] for i in group], group_progress(g) if progress is not None else None)
        except ItemError as exc:
            raise ItemError(group[exc.index] if exc.index < len(group) else group[0], str(exc)) from exc
        for i, out in zip(group, got):
            outputs[i] = out
    assert all(out is not None for out in outputs), "every item belongs to one group"
    return outputs  # type: ignore[return-value]


def run_items_alone(
    run: RunBatch, batch: list[WorkItem], progress: Progress | None = None
) -> list[dict[str, torch.Tensor]]:
    """`run(batch, progress)` with each item as a batch of its own, in order (run_in_groups)."""
    return run_in_groups(run, batch, [[i] for i in range(len(batch))], progress)

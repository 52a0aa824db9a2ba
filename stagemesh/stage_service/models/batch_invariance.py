"""Batch invariance: a request's output does not depend on the requests it was batched with.

A denoising stage samples a batch as one, and the kernels under the model pick their blocking
by the shapes they are given, so the same request can round differently in a batch of four than
alone. Measured on the embedded model (torch 2.13, CPU, MKL/oneDNN, one or two threads):

- nn.Linear on [rows, K] rounds differently for 1, for 2-3 and for 4 or more rows (GEMV, a
  small-M GEMM and the blocked GEMM): the timestep embedding and every adaLN projection,
  which see one row per image, change with the batch;
- Conv2d at small spatial sizes (the decoder's first convolutions) changes with the batch;
- the conditioning is padded to the longest prompt of the batch, so the conditioning's shapes
  (and on a GPU, the kernels chosen for them) depend on the batch mates;
- token-wise Linear, LayerNorm, GroupNorm and scaled_dot_product_attention gave the same bits
  for every batch size tried; noise is drawn per request from its own seed already.

On a GPU cuBLAS and cuDNN choose kernels (tile shapes, split-K) by the problem size, batch
included, so no per-op patch is sure there either. The one arrangement that holds for every
kernel on every device is to give each request exactly the shapes it has when it runs alone:
`run_items_alone` runs a batch one item at a time, each as a batch of its own. The stage still
forms batches (admission, dispatch and the output path are shared), only the forward passes are
per request. What it costs is measured by bench/batch_invariance.py (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stagemesh.stage_service.models.contract import ItemError, Progress, WorkItem

# Stage kinds whose runner samples a batch as one; every other kind already runs each request
# alone (the language model, the text encoders, the VAE of a decode stage).
BATCHED_KINDS = ("diffusion", "denoise")

RunBatch = Callable[[list[WorkItem], Progress | None], list[dict[str, torch.Tensor]]]


def run_items_alone(
    run: RunBatch, batch: list[WorkItem], progress: Progress | None = None
) -> list[dict[str, torch.Tensor]]:
    """`run(batch, progress)` with each item as a batch of its own, in order.

    Progress stays in the items' own units: once item k of B has finished step s of n, the batch
    is at (k*n + s) / B steps, and each whole step is reported once, so callers see steps 1..n
    of n as from a batched run (and may still abort between them). An ItemError names the
    item's index in `batch`.
    """
    if len(batch) <= 1:
        return run(batch, progress)
    outputs: list[dict[str, torch.Tensor]] = []
    reported = 0

    def item_progress(k: int) -> Progress:
        def report(step: int, total: int) -> None:
            nonlocal reported
            batch_step = (k * total + step) // len(batch)
            if batch_step > reported:
                reported = batch_step
                progress(batch_step, total)  # type: ignore[misc]  # only made with a progress

        return report

    for k, item in enumerate(batch):
        try:
            outputs += run([item], item_progress(k) if progress is not None else None)
        except ItemError as exc:
            raise ItemError(k, str(exc)) from exc
    return outputs

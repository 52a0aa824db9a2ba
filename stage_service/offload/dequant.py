"""Rebuilding an 8-bit weight (FP8 or int8) in the model's dtype: out = q * scale, one scale per row.

Two ways, with the same result bit for bit (the 8-bit value widened to float32, times the scale
widened to float32, rounded once to out's dtype):
  - torch: `out.copy_(q)` then `out.mul_(scale)`: two passes, 7 bytes of memory traffic per
    element (read 1 + write 2, then read 2 + write 2). Used on the CPU and wherever Triton is not.
  - triton: one pass, 3 bytes per element. On the H200 a FLUX-size step rebuilds 11.8 G elements
    (docs/perf-notes/dlo.md): the two-pass rebuild took SM time from the compute that runs beside
    it and left the FP8 step 18 % over its transfer floor, which is why this kernel exists.
`KERNEL` picks ("auto": triton on a CUDA tensor when it can be imported, else torch).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

KERNELS = ("auto", "torch", "triton")
KERNEL = "auto"
_BLOCK = 4096  # elements per program: 4 KiB of 8-bit values in, 8 KiB out


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kernel: str | None = None) -> None:
    """out[r, c] = q[r, c] * scale[r] in out's dtype, written in place (no temporary)."""
    chosen = KERNEL if kernel is None else kernel
    if chosen not in KERNELS:
        raise ValueError(f"dequantize kernel = {chosen!r}; allowed: {', '.join(KERNELS)}")
    one_pass = _triton_kernel() if chosen != "torch" and out.is_cuda else None
    if one_pass is None:
        if chosen == "triton" and out.is_cuda:
            raise RuntimeError("dequantize kernel 'triton' asked for, but triton cannot be imported")
        out.copy_(q)
        out.mul_(scale.unsqueeze(1))
        return
    if not (out.is_contiguous() and q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("dequantize_into: out, q and scale must be contiguous")
    rows, cols = q.shape
    if rows * cols:
        grid = (-(-rows * cols // _BLOCK),)
        one_pass[grid](q, scale, out, rows * cols, cols, BLOCK=_BLOCK, num_warps=8)


@functools.cache
def _triton_kernel() -> Any:
    """The compiled-on-first-use Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _dequant_rows(q_ptr, scale_ptr, out_ptr, total, cols, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        q = tl.load(q_ptr + offs, mask=mask).to(tl.float32)
        s = tl.load(scale_ptr + offs // cols, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)

    return _dequant_rows

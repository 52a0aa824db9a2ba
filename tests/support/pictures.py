"""One check for "the same picture" where the two sides hold the same weights in differently
aligned memory.

A stage reads its transformer and VAE into buffers of its own (the direct load), DLO runs
blocks from its slots, a woken stage from re-read copies, while diffusers' CPU weights are
views into the safetensors mapping. On some CPUs MKL picks its kernels by alignment, so the
same arithmetic rounds the last bits of a float32 matmul differently (up to about 1e-6 here).
What a user receives, the encoded picture, must still be byte for byte the same.
"""

from __future__ import annotations

import numpy as np
import torch

from stagemesh.gateway.images import encode_png

LAST_BITS = 1e-5


def assert_same_picture(got, want, context=None) -> None:
    """Equal PNG bytes, and float values within the last bits (HWC in [0, 1])."""
    got_np, want_np = (x.float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (got, want))
    assert encode_png(got_np) == encode_png(want_np), context
    np.testing.assert_allclose(got_np, want_np, rtol=0, atol=LAST_BITS, err_msg=str(context))

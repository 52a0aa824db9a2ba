"""With batch_invariant (CPU, a real mesh): 200 mixed requests (seeds, prompts, sizes, steps,
guidance) give the same PNG bytes served one at a time and served concurrently, batched with one
another (tests/support/invariance.py)."""

from __future__ import annotations

import pytest

from tests.support.invariance import check_alone_equals_under_load, start_invariant_mesh

pytestmark = pytest.mark.mesh


def test_200_requests_give_the_same_bytes_alone_and_batched(tmp_path, model_dir):
    mesh = start_invariant_mesh(tmp_path, model_dir)
    try:
        check_alone_equals_under_load(mesh)
    finally:
        assert mesh.stop() == 0, mesh.logs()[-3000:]

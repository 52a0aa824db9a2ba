"""Run a function on N real processes that form one gloo group (CPU), and collect what each
returns. The function must live at module level (spawned processes import it) and return
picklable values: tensors are sent as numpy arrays, not as handles into the child's memory."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

import torch

from stagemesh.core.procutil import free_port

WAIT_S = 120.0


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_numpy(v) for v in value)
    return value


def _from_numpy(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _from_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_from_numpy(v) for v in value)
    return value


def _main(rank: int, world: int, address: str, fn: Callable, args: tuple, out) -> None:
    from stagemesh.stage_service.offload.collective import join_group, leave_group

    torch.set_num_threads(1)
    try:
        join_group(address, rank, world, "cpu", WAIT_S)
        result = fn(rank, world, *args)
        out.put((rank, _to_numpy(result), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
        raise
    finally:
        leave_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> dict[int, Any]:
    """fn(rank, world, *args) on `world` spawned processes of one gloo group; rank -> result."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_main, args=(r, world, address, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, value, error = out.get()
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            results[rank] = _from_numpy(value)
    finally:
        for p in procs:
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results

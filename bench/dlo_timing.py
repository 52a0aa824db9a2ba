"""The clocks of bench/dlo.py (and bench/dlo_multi_gpu.py): pinned H2D bandwidth, step time,
the resident model's slot windows, a DLO engine's own host-store bandwidth, and the timeline of
its host link (busy and idle time per step).

On a CUDA device device-side spans come from CUDA events read after one synchronize; on the CPU
from the host clock.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from bench import dlo_models as models
from stagemesh.stage_service import platform
from stagemesh.stage_service.offload import discover


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_bandwidth(nbytes: int, device: torch.device, repeats: int = 10, trials: int = 3) -> float:
    """Bytes per second of pinned host -> device copies of `nbytes`: the best of `trials` runs
    of `repeats` copies (a floor is what the link can do, not what one run of it did)."""
    host = platform.HostBuffer(nbytes, device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host.tensor, non_blocking=True)
    sync(device)
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            dev.copy_(host.tensor, non_blocking=True)
        sync(device)
        best = max(best, nbytes * repeats / (time.perf_counter() - start))
    host.close()
    return best


def step_time(
    bm: models.BenchModel, model: nn.Module, inputs: dict, device: torch.device, steps: int, warmup: int
) -> tuple[float, torch.Tensor]:
    """Steady-state seconds per forward, as inside a long request: the timed forwards follow the
    warm-up ones with no synchronize in between and are timed by marks on the compute stream, so
    each starts with the pipeline in flight (DLO's next block already on its way, the host ahead
    of the device). A synchronize before them would drain it, and the restart would be charged
    to the timed steps (see start_up_time)."""
    with torch.inference_mode():
        for _ in range(max(warmup, 1)):
            out = bm.forward(model, inputs)
        start = _mark(device)
        for _ in range(steps):
            out = bm.forward(model, inputs)
        end = _mark(device)
        sync(device)
    return _between(start, end) / steps, out.float().cpu()


def start_up_time(
    bm: models.BenchModel, model: nn.Module, inputs: dict, device: torch.device, steps: int, steady_s: float
) -> float:
    """What `steps` forwards started from an idle device (synchronized before and after, as
    the first steps of a request) take beyond `steps` steady-state ones: paid once per run of
    steps, not per step."""
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            bm.forward(model, inputs)
        sync(device)
    return time.perf_counter() - start - steps * steady_s


def _mark(device: torch.device):
    """A point in time: a CUDA event on the current stream, else the host clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _between(start, end) -> float:
    """Seconds from one `_mark` to another (CUDA events only once both have completed)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


def _mean_span(starts: list, ends: list, lag: int, skip: int) -> float:
    """Mean seconds from starts[k - lag] to ends[k] over the forwards after the first `skip`."""
    spans = [_between(starts[k - lag], ends[k]) for k in range(max(skip, lag), len(ends))]
    return sum(spans) / len(spans)


def slot_window_times(
    bm: models.BenchModel,
    model: nn.Module,
    inputs: dict,
    device: torch.device,
    counts: list[int],
    steps: int,
    warmup: int,
) -> dict[int, dict[str, float]]:
    """N -> {"resident_s": block 0's start to the N-th resident block's end (the blocks DLO
    would keep), "window_s": the last block's start in one forward to the end of the first
    streamed block in the next}: the compute during which DLO's link can fill only its two slots
    (the last block's slot frees as it ends; the next fill waits for the first streamed block).
    Averaged over the timed forwards; a pass of its own, so the hooks leave the step time alone."""
    found = discover(model, bm.plan)
    candidates = found.resident_candidates()
    counts = [n for n in counts if 0 < n < len(found.blocks)]
    if not counts or not candidates:
        return {}
    marks: dict[str, list] = {"first": [], "last": []}
    hooks = [
        found.blocks[0].module.register_forward_pre_hook(lambda *_: marks["first"].append(_mark(device))),
        found.blocks[-1].module.register_forward_pre_hook(lambda *_: marks["last"].append(_mark(device))),
    ]
    for n in counts:  # DLO caps N at the eligible blocks; so do these spans
        kept = candidates[:n]
        streamed = next(b for b in found.blocks if b.path not in {k.path for k in kept})
        marks[f"kept{n}"], marks[f"streamed{n}"] = [], []
        hooks.append(kept[-1].module.register_forward_hook(lambda *_, k=f"kept{n}": marks[k].append(_mark(device))))
        hooks.append(streamed.module.register_forward_hook(lambda *_, k=f"streamed{n}": marks[k].append(_mark(device))))
    try:
        with torch.inference_mode():
            for _ in range(warmup + max(steps, 2)):
                bm.forward(model, inputs)
        sync(device)  # once, after the pass: the events are read only now
    finally:
        for hook in hooks:
            hook.remove()
    skip = max(warmup, 1)
    return {
        n: {
            "resident_s": _mean_span(marks["first"], marks[f"kept{n}"], 0, skip),
            "window_s": _mean_span(marks["last"], marks[f"streamed{n}"], 1, skip),
        }
        for n in counts
    }


def store_bandwidth(engine, device: torch.device) -> float:
    """Bytes per second of one pass over every streamed block, copied from the engine's own host
    store into a scratch device buffer the way the engine copies it: tells whether this case's
    host buffers (placement, pinning) reach the bandwidth the floor assumes."""
    sizes = [engine.store.h2d_nbytes(i) for i in range(len(engine.layouts))]
    if not sizes:
        return 0.0
    scratch = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    stream = platform.current_stream(device)
    engine.store.fill(0, scratch, stream)  # warm-up
    sync(device)
    start = time.perf_counter()
    moved = sum(engine.store.fill(i, scratch, stream) for i in range(len(sizes)))
    sync(device)
    return moved / (time.perf_counter() - start)


def link_timeline(
    engine, bm: models.BenchModel, model: nn.Module, inputs: dict, device: torch.device, steps: int, warmup: int
) -> dict[str, float]:
    """Where the host link idles during DLO steps: every fill of a slot is bracketed by timing
    marks on the copy stream (the start mark passes once the slot's free-event wait has), over
    `steps` forwards after `warmup`. Returns per step: link busy and idle seconds, the
    longest idle gap and the streamed block it preceded, and the median and slowest fill rate
    (bytes/s). A pass of its own, so the marks leave the timed steps alone."""
    fills: list[tuple[int, int, object, object]] = []
    recording = False
    original = engine.store.fill

    def marked(i: int, target: torch.Tensor, stream) -> int:
        if not recording:
            return original(i, target, stream)
        start = _mark(device)  # the engine fills on its copy stream, the current one here
        sent = original(i, target, stream)
        fills.append((i, sent, start, _mark(device)))
        return sent

    engine.store.fill = marked
    try:
        with torch.inference_mode():
            for _ in range(warmup):
                bm.forward(model, inputs)
            sync(device)
            recording = True
            for _ in range(steps):
                bm.forward(model, inputs)
            sync(device)
    finally:
        engine.store.fill = original
    if not fills:
        return {}
    origin = fills[0][2]
    spans = [(i, n, _between(origin, a), _between(origin, b)) for i, n, a, b in fills]
    busy = sum(end - start for _, _, start, end in spans)
    gaps = [(spans[k + 1][2] - spans[k][3], spans[k + 1][0]) for k in range(len(spans) - 1)]
    widest = max(gaps, default=(0.0, -1))
    rates = sorted(n / (end - start) for _, n, start, end in spans if end > start)
    total = spans[-1][3] - spans[0][2]
    return {
        "link_busy_s": busy / steps,
        "link_idle_s": (total - busy) / steps,
        "widest_gap_s": widest[0],
        "widest_gap_before_block": widest[1],
        "fill_rate_median": rates[len(rates) // 2] if rates else 0.0,
        "fill_rate_min": rates[0] if rates else 0.0,
    }

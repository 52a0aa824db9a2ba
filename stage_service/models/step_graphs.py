"""Denoising steps replayed from captured CUDA graphs.

The default DiT at small sizes is launch-bound: one denoising step is hundreds of small kernels,
and the host issues them slower than the GPU runs them, so the step runs at the host's speed
(which drifts by tens of percent) and any other work on the launching thread slows it. A step
captured once as a CUDA graph is replayed with one launch (plus two tiny fills for the step's
time and step size), so the GPU, not the host, sets the pace.

One graph per batch shape (rows, latent size, conditioning length, dtype, guided or not), kept
up to `max_graphs` (the least recently used dropped, with its memory). A graph reads and writes
fixed device buffers: the latents are updated in place, step after step. The same code runs
without capture (each "replay" calls the step), so the CPU tests cover the buffer handling.

Graphs hold the addresses of the DiT's weights: sleep drops them (this is a device holder for
the sleep controller) and the next batch after wake captures afresh. Whoever else moves a weight
(a sleep controller not told about the graphs, a reload), the next batch sees the new addresses
and captures afresh too: a replay never reads memory the weights have left.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stagemesh.core import logs
from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import Progress
from stagemesh.stage_service.models.dit import DiT, velocity

log = logs.get_logger("stagemesh.step_graphs")

WARMUP_RUNS = 2  # torch: run a step on a side stream before capturing it (lazy inits, cuBLAS)
# Each graph keeps its own pool of activation memory; a new shape costs its first batch about
# WARMUP_RUNS + 1 steps of capture.
MAX_GRAPHS = 4


@dataclass
class _Step:
    """The fixed buffers of one captured step and its graph (None: replay = call)."""

    x: torch.Tensor  # latents [B, C, h, w] float32, updated in place by each replay
    t: torch.Tensor  # the step's time, one per DiT row
    dt: torch.Tensor  # t_next - t
    guidance: torch.Tensor
    cond: torch.Tensor
    mask: torch.Tensor
    run: Callable[[], None]
    graph: torch.cuda.CUDAGraph | None = field(default=None, init=False)  # set once captured

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()


class StepGraphs:
    def __init__(self, dit: DiT, capture: bool = True, max_graphs: int = MAX_GRAPHS) -> None:
        self._dit = dit
        self._capture = capture
        self._max = max(1, max_graphs)
        self._steps: collections.OrderedDict[tuple, _Step] = collections.OrderedDict()
        # The weight tensors (their storage can move; the tensors stay) and the addresses the
        # graphs were captured with. The list is walked once: walking the module costs ~30x more.
        self._weights = [*dit.parameters(), *dit.buffers()]
        self._weights_at: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self._steps)

    def denoise(
        self,
        x: torch.Tensor,
        cond: torch.Tensor,
        mask: torch.Tensor,
        steps: int,
        guidance_scale: float,
        progress: Progress | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """The Euler loop of `dit.sample` on `x` [B, C, h, w] (float32), steps start..steps-1;
        `cond`/`mask` hold the guided rows (conditional then unconditional) when guidance is on.
        Returns the latents in the step's buffer: read them before the next call."""
        guided = guidance_scale != 1.0
        weights_at = tuple(map(torch.Tensor.data_ptr, self._weights))
        if weights_at != self._weights_at:
            self._steps.clear()
            self._weights_at = weights_at
        step = self._step(x, cond, mask, guided)
        step.x.copy_(x)
        step.cond.copy_(cond)
        step.mask.copy_(mask)
        step.guidance.fill_(guidance_scale)
        for i in range(start, steps):
            t, t_next = 1.0 - i / steps, 1.0 - (i + 1) / steps
            step.t.fill_(t)
            step.dt.fill_(t_next - t)
            step.replay()
            if progress is not None:
                progress(i + 1 - start, steps - start)
        return step.x

    def release_device(self) -> int:
        """Drop every graph and buffer (sleep: the weights they point at are going away)."""
        self._steps.clear()
        return 0  # the sleep controller measures what the device got back

    def restore_device(self) -> int:
        return 0  # captured again by the next batch

    def _step(self, x: torch.Tensor, cond: torch.Tensor, mask: torch.Tensor, guided: bool) -> _Step:
        key = (tuple(x.shape), tuple(cond.shape), cond.dtype, guided, x.device)
        step = self._steps.get(key)
        if step is not None:
            self._steps.move_to_end(key)
            return step
        step = self._build(x, cond, mask, guided)
        self._steps[key] = step
        while len(self._steps) > self._max:
            self._steps.popitem(last=False)
        return step

    def _build(self, x: torch.Tensor, cond: torch.Tensor, mask: torch.Tensor, guided: bool) -> _Step:
        dev = x.device
        rows = cond.shape[0]
        buffers = dict(
            x=x.clone(),
            t=torch.ones(rows, device=dev),
            dt=torch.zeros((), device=dev),
            guidance=torch.ones((), device=dev),
            cond=cond.clone(),
            mask=mask.clone(),
        )
        dit = self._dit

        def run() -> None:
            s = buffers
            v = velocity(dit, s["x"], s["t"], s["cond"], s["mask"], guided, s["guidance"])
            s["x"].add_(s["dt"] * v)

        step = _Step(run=run, **buffers)
        if self._capture:
            try:
                step.graph = _capture(run, dev)
            except RuntimeError as exc:
                # A model or driver that cannot be captured still serves, at eager speed.
                platform.clear_cuda_error()
                self._capture = False
                log.warning("CUDA graph capture failed; denoising steps run eagerly from now on", error=str(exc))
        return step


def _capture(run: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """Warm `run` up on a side stream, then capture it (dt is 0: the warm-up leaves x as is)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the async output thread may wait on events or pin memory meanwhile, which
    # a global capture would count as an error.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    return graph

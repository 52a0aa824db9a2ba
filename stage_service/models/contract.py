"""The runner contract: what a worker process drives, and the types runners and workers share.

A runner turns a batch of `WorkItem`s into one output dict per item. The worker calls only what
`Runner` declares; a runner without an offload engine reports zero streamed bytes and no DLO
stats rather than lacking the attribute (`RunnerBase` gives those answers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from stagemesh.core.params import BATCH_KEY_FIELDS, Params

# Image-to-image: the starting image, torch.uint8 [height, width, 3] RGB, decoded by the gateway
# (named in core.params, which the gateway shares).
from stagemesh.core.params import INIT_IMAGE_INPUT as INIT_IMAGE_INPUT

# progress(step, total); may raise to abort the batch between steps.
Progress = Callable[[int, int], None]


@dataclass
class WorkItem:
    request_id: str
    params: Params
    # diffusion: {"hidden_states": Tensor[L, cond_dim]} from the AR stage
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def check_batch(batch: list[WorkItem]) -> None:
    """A batch is sampled as one: every item must share size, steps and guidance."""
    shared = batch[0].params.batch_key()
    for item in batch[1:]:
        mine = item.params.batch_key()
        if mine != shared:
            raise ValueError(f"{item.request_id}: {BATCH_KEY_FIELDS} {mine} differs from the batch's {shared}")


@dataclass(frozen=True)
class WeightFile:
    """A checkpoint file and the modules it fills, by key prefix (e.g. {"dit.": dit}). Tensors
    whose key starts with one of `skip` (e.g. "dit.blocks.3.") are someone else's to manage."""

    path: Path
    parts: dict[str, nn.Module]
    skip: tuple[str, ...] = ()

    def manages(self, key: str) -> bool:
        return not key.startswith(self.skip) if self.skip else True


class DeviceHolder(Protocol):
    """Device memory outside the weight files (e.g. DLO slots) that sleeps with them."""

    def release_device(self) -> int: ...  # bytes released

    def restore_device(self) -> int: ...  # bytes taken back


@dataclass(frozen=True)
class TensorSpec:
    """One input tensor a runner takes: its sizes (None: any size from 1 up to `max_size`) and
    whether it must be floating point. The stage checks every request's inputs against these
    before admission, so a malformed request is refused alone instead of failing its batch."""

    sizes: tuple[int | None, ...]
    max_size: int = 1 << 20
    floating: bool = True
    required: bool = True  # False: a request may leave it out (e.g. INIT_IMAGE_INPUT)


class ItemError(ValueError):
    """One item of a batch cannot run (the others can): `index` names it within the batch."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class Runner(Protocol):
    """What the worker calls. `kind` names the stage kind the runner serves; the two flags say
    whether the pipeline uses a negative prompt and a starting image (INIT_IMAGE_INPUT);
    `batch_invariant` whether it gives an item the same output whatever its batch mates."""

    kind: str
    batch_invariant: bool
    supports_negative_prompt: bool
    supports_init_image: bool

    def run(self, batch: list[WorkItem], progress: Progress | None = None) -> list[dict[str, torch.Tensor]]: ...

    def limits(self) -> dict[str, Any]: ...

    def weight_files(self) -> list[WeightFile]: ...

    def device_holders(self) -> list[DeviceHolder]: ...

    def offload_bytes(self) -> int: ...  # copied host -> device by the DLO engine since load; 0 without DLO

    def dlo_stats(
        self,
    ) -> dict[str, Any] | None: ...  # {"world", "host_mode", "host_bytes", "stream_dtype"}; None without DLO

    def sleep_refusal(self, level: int) -> str | None: ...  # why it cannot sleep at `level`; None: it can

    def input_specs(self) -> dict[str, TensorSpec] | None: ...  # the inputs it takes; None: not declared

    # The batch the worker runs once before it reports ready (its first-image warm-up), with
    # inputs shaped as the stage before sends them; None: this runner has no warm-up.
    def warm_up_items(self, params: Params) -> list[WorkItem] | None: ...


class RunnerBase:
    """What a runner without extra device memory, DLO or TP answers; a runner with a DLO engine
    sets `offload`."""

    offload: Any = None  # offload.streamer.LayerwiseOffload when enable_dlo is set
    # True: an item's output does not depend on its batch mates (batch_invariant, done by the runner).
    batch_invariant = False
    supports_negative_prompt = False
    supports_init_image = False

    def device_holders(self) -> list[DeviceHolder]:
        return []

    def offload_bytes(self) -> int:
        return self.offload.h2d_bytes if self.offload is not None else 0

    def dlo_stats(self) -> dict[str, Any] | None:
        if self.offload is None:
            return None
        stats = self.offload.stats()
        return {
            "world": stats.world,
            "host_mode": stats.host_mode,
            "host_bytes": stats.host_bytes,
            "stream_dtype": stats.stream_dtype,
        }

    def sleep_refusal(self, level: int) -> str | None:
        return None

    def input_specs(self) -> dict[str, TensorSpec] | None:
        return None  # the runner checks its inputs itself

    def warm_up_items(self, params: Params) -> list[WorkItem] | None:
        return None

"""Messages on the executor <-> worker queues (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stagemesh.stage_service.settings import StageSettings


@dataclass(frozen=True)
class DpGroup:
    """A torch.distributed group the ranks of a stage form: the DP ranks (DLO AllGather), the
    TP ranks (tensor_parallel_size > 1) or the ranks that split one image (sp_size > 1 or
    cfg_parallel)."""

    address: str  # tcp://127.0.0.1:PORT; rank 0 hosts the rendezvous store
    world_size: int
    timeout_s: float


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process starts with: the stage's settings whole (every option it reads is
    `spec.settings.X`) and what differs from rank to rank or from one start to the next."""

    settings: StageSettings
    rank: int
    parent_pid: int
    # Set when the ranks form one process group; a fresh address for every (re)start of it.
    dp_group: DpGroup | None = None
    # Set when the ranks are the TP ranks of one model.
    tp_group: DpGroup | None = None
    # Set when the ranks split each image (settings.sp_size ranks per pass, two passes with
    # settings.cfg_parallel).
    image_group: DpGroup | None = None
    # False: the rank runs every batch with the group's output rank and reports nothing of it.
    output_rank: bool = True


# executor -> worker
@dataclass(frozen=True)
class Execute:
    rpc_id: str
    items: list[Any]  # models.contract.WorkItems, their inputs packed by ipc.pack


@dataclass(frozen=True)
class Cancel:
    rpc_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Control:
    """A control call (drain, sleep, wake, ...). Answered by an Ack that bypasses the output path."""

    rpc_id: str
    op: str
    args: dict[str, Any] = field(default_factory=dict)


# worker -> executor
@dataclass(frozen=True)
class Heartbeat:
    """A serving worker is alive (its process runs and its Python threads are scheduled); sent
    every settings.HEARTBEAT_S."""


@dataclass(frozen=True)
class WorkerStats:
    """Figures a worker attaches to its replies (the stage service exports them as metrics)."""

    device_memory_bytes: int = 0  # allocated on the worker's device now
    offload_bytes: int = 0  # copied host -> device by the DLO engine since the process started
    step_cache_skipped: int = 0  # transformer block passes a step cache skipped since the process started
    step_cache_passes: int = 0  # block passes of the batches a step cache ran on, skipped or not


@dataclass(frozen=True)
class Ready:
    rank: int
    limits: dict[str, Any]
    device: str
    device_memory_bytes: int
    input_specs: dict[str, Any] | None = None  # models.contract.TensorSpec by input name; None: not declared
    # What the runner's pipeline can use beyond a prompt (Runner.supports_*).
    supports_negative_prompt: bool = False
    supports_init_image: bool = False
    # The worker's start-up phases (core.startup records), for the stage's start-up report.
    phases: tuple[dict[str, Any], ...] = ()
    # The LoRA adapters it registered from lora_dir; None: the runner applies no adapters.
    adapters: tuple[str, ...] | None = None


@dataclass(frozen=True)
class LoadFailed:
    rank: int
    message: str


@dataclass(frozen=True)
class Progress:
    rpc_id: str
    step: int
    total: int


@dataclass(frozen=True)
class BatchTiming:
    """When a worker took a batch and when its forward pass returned (wall clock, ns: the stage
    service turns them into the worker's spans), and which process ran it."""

    started_ns: int
    computed_ns: int
    rank: int
    pid: int


@dataclass(frozen=True)
class ComputeDone:
    """Async mode: the forward pass is queued on the device; its outputs follow as OutputReady."""

    rpc_id: str
    async_output_id: str
    stats: WorkerStats | None = None
    timing: BatchTiming | None = None


@dataclass(frozen=True)
class OutputReady:
    async_output_id: str
    payload: Any = None  # one packed dict per batch item
    error: str | None = None
    compute_seconds: float = 0.0  # device time of the forward pass that produced it


@dataclass(frozen=True)
class Ack:
    rpc_id: str
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    stats: WorkerStats | None = None


@dataclass(frozen=True)
class Result:
    """Step (synchronous) mode: the outputs themselves."""

    rpc_id: str
    outputs: list[Any] = field(default_factory=list)  # one packed dict per item
    stats: WorkerStats | None = None
    compute_seconds: float = 0.0  # device time of the forward pass
    timing: BatchTiming | None = None


@dataclass(frozen=True)
class Failure:
    rpc_id: str
    message: str
    cancelled: bool = False
    item: int | None = None  # the batch item that alone caused it (models.contract.ItemError)

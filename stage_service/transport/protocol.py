"""Messages on the executor <-> worker queues (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# When a worker prepares the level-1 sleep host buffer: by the first level-1 sleep, before it
# reports ready, or on threads once its model is loaded (worker/sleep.py).
SLEEP_HOST_BUFFERS = ("first_sleep", "at_start", "background")


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
    rank: int
    stage_id: int
    kind: str
    model_dir: str
    device: str
    parent_pid: int
    threads: int = 0
    # True: outputs are copied and packed on the worker's main thread (the synchronous path).
    step_execution: bool = False
    # Denoising steps from captured CUDA graphs (embedded DiT, CUDA, no DLO or TP).
    cuda_graphs: bool = True
    # When the level-1 sleep host buffer is prepared: one of SLEEP_HOST_BUFFERS.
    sleep_host_buffer: str = "first_sleep"
    # batch_invariant: the number of requests every forward pass runs with, so that a request's
    # kernels see the shapes they see when it runs alone (models.batch_invariance); 0: off.
    invariant_rows: int = 0
    # The stage's offload.config.DloOptions (frozen; typed loosely: transport sits below offload).
    dlo: Any = None
    # Set when the ranks form one process group; a fresh address for every (re)start of it.
    dp_group: DpGroup | None = None
    # Set when the ranks are the TP ranks of one model.
    tp_group: DpGroup | None = None
    # Set when the ranks split each image: sp_size ranks per pass, cfg_size (1 or 2) passes.
    image_group: DpGroup | None = None
    sp_size: int = 1
    cfg_size: int = 1
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
HEARTBEAT_S = 1.0  # how often a serving worker says it is alive, even in the middle of a batch


@dataclass(frozen=True)
class Heartbeat:
    """A serving worker is alive (its process runs and its Python threads are scheduled)."""


@dataclass(frozen=True)
class WorkerStats:
    """Figures a worker attaches to its replies (the stage service exports them as metrics)."""

    device_memory_bytes: int = 0  # allocated on the worker's device now
    offload_bytes: int = 0  # copied host -> device by the DLO engine since the process started


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
class ComputeDone:
    """Async mode: the forward pass is queued on the device; its outputs follow as OutputReady."""

    rpc_id: str
    async_output_id: str
    stats: WorkerStats | None = None


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


@dataclass(frozen=True)
class Failure:
    rpc_id: str
    message: str
    cancelled: bool = False
    item: int | None = None  # the batch item that alone caused it (models.contract.ItemError)

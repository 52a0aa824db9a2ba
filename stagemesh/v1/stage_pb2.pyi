from stagemesh.v1 import control_pb2 as _control_pb2
from stagemesh.v1 import generation_pb2 as _generation_pb2
from stagemesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SleepStageRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepStageResponse(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[_control_pb2.WorkerAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[_control_pb2.WorkerAck, _Mapping]]] = ...) -> None: ...

class WakeUpStageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpStageResponse(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[_control_pb2.WorkerAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[_control_pb2.WorkerAck, _Mapping]]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "params", "inputs", "outputs_in_shared_memory")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_IN_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    params: _generation_pb2.GenerationParams
    inputs: _containers.MessageMap[str, _tensor_pb2.Tensor]
    outputs_in_shared_memory: bool
    def __init__(self, request_id: _Optional[str] = ..., params: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., inputs: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., outputs_in_shared_memory: _Optional[bool] = ...) -> None: ...

class StageProgress(_message.Message):
    __slots__ = ("step", "total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class StageOutputs(_message.Message):
    __slots__ = ("outputs",)
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.MessageMap[str, _tensor_pb2.Tensor]
    def __init__(self, outputs: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("progress", "outputs")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    progress: StageProgress
    outputs: StageOutputs
    def __init__(self, progress: _Optional[_Union[StageProgress, _Mapping]] = ..., outputs: _Optional[_Union[StageOutputs, _Mapping]] = ...) -> None: ...

class StageLimits(_message.Message):
    __slots__ = ("pixel_multiple", "max_pixels_side", "max_inference_steps", "max_prompt_bytes", "default_size", "default_inference_steps", "default_guidance_scale", "max_guidance_scale", "frame_step", "max_num_frames", "default_num_frames", "default_fps", "requires_init_image")
    PIXEL_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_SIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    MAX_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    FRAME_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FPS_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_INIT_IMAGE_FIELD_NUMBER: _ClassVar[int]
    pixel_multiple: int
    max_pixels_side: int
    max_inference_steps: int
    max_prompt_bytes: int
    default_size: int
    default_inference_steps: int
    default_guidance_scale: float
    max_guidance_scale: float
    frame_step: int
    max_num_frames: int
    default_num_frames: int
    default_fps: int
    requires_init_image: bool
    def __init__(self, pixel_multiple: _Optional[int] = ..., max_pixels_side: _Optional[int] = ..., max_inference_steps: _Optional[int] = ..., max_prompt_bytes: _Optional[int] = ..., default_size: _Optional[int] = ..., default_inference_steps: _Optional[int] = ..., default_guidance_scale: _Optional[float] = ..., max_guidance_scale: _Optional[float] = ..., frame_step: _Optional[int] = ..., max_num_frames: _Optional[int] = ..., default_num_frames: _Optional[int] = ..., default_fps: _Optional[int] = ..., requires_init_image: _Optional[bool] = ...) -> None: ...

class DescribeStageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeStageResponse(_message.Message):
    __slots__ = ("stage_id", "kind", "ready", "limits", "device", "device_memory_bytes", "workers", "max_batch_size", "supports_sleep", "sleep_level", "supports_negative_prompt", "supports_init_image", "queue_depth", "batches", "batched_requests", "supports_adapters")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SLEEP_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_INIT_IMAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    kind: str
    ready: bool
    limits: StageLimits
    device: str
    device_memory_bytes: int
    workers: int
    max_batch_size: int
    supports_sleep: bool
    sleep_level: int
    supports_negative_prompt: bool
    supports_init_image: bool
    queue_depth: int
    batches: int
    batched_requests: int
    supports_adapters: bool
    def __init__(self, stage_id: _Optional[int] = ..., kind: _Optional[str] = ..., ready: _Optional[bool] = ..., limits: _Optional[_Union[StageLimits, _Mapping]] = ..., device: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., workers: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., supports_sleep: _Optional[bool] = ..., sleep_level: _Optional[int] = ..., supports_negative_prompt: _Optional[bool] = ..., supports_init_image: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., batches: _Optional[int] = ..., batched_requests: _Optional[int] = ..., supports_adapters: _Optional[bool] = ...) -> None: ...

from stagemesh.v1 import control_pb2 as _control_pb2
from stagemesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_STATE_UNSPECIFIED: _ClassVar[StageState]
    STAGE_STATE_SERVING: _ClassVar[StageState]
    STAGE_STATE_LOADING: _ClassVar[StageState]
    STAGE_STATE_UNAVAILABLE: _ClassVar[StageState]
    STAGE_STATE_SLEEPING: _ClassVar[StageState]
    STAGE_STATE_PAUSED: _ClassVar[StageState]
STAGE_STATE_UNSPECIFIED: StageState
STAGE_STATE_SERVING: StageState
STAGE_STATE_LOADING: StageState
STAGE_STATE_UNAVAILABLE: StageState
STAGE_STATE_SLEEPING: StageState
STAGE_STATE_PAUSED: StageState

class SleepRequest(_message.Message):
    __slots__ = ("stage_ids", "level")
    STAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    stage_ids: _containers.RepeatedScalarFieldContainer[int]
    level: int
    def __init__(self, stage_ids: _Optional[_Iterable[int]] = ..., level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("status", "acks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    status: _control_pb2.ControlStatus
    acks: _containers.RepeatedCompositeFieldContainer[_control_pb2.WorkerAck]
    def __init__(self, status: _Optional[_Union[_control_pb2.ControlStatus, str]] = ..., acks: _Optional[_Iterable[_Union[_control_pb2.WorkerAck, _Mapping]]] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("stage_ids",)
    STAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    stage_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("status", "reason", "acks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    status: _control_pb2.ControlStatus
    reason: str
    acks: _containers.RepeatedCompositeFieldContainer[_control_pb2.WorkerAck]
    def __init__(self, status: _Optional[_Union[_control_pb2.ControlStatus, str]] = ..., reason: _Optional[str] = ..., acks: _Optional[_Iterable[_Union[_control_pb2.WorkerAck, _Mapping]]] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("params", "request_id")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    params: _generation_pb2.GenerationParams
    request_id: str
    def __init__(self, params: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class StageStarted(_message.Message):
    __slots__ = ("stage_id", "kind")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    kind: str
    def __init__(self, stage_id: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class DenoisingStep(_message.Message):
    __slots__ = ("stage_id", "step", "total", "index")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    step: int
    total: int
    index: int
    def __init__(self, stage_id: _Optional[int] = ..., step: _Optional[int] = ..., total: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("stage_started", "denoising_step", "result", "result_chunk")
    STAGE_STARTED_FIELD_NUMBER: _ClassVar[int]
    DENOISING_STEP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RESULT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    stage_started: StageStarted
    denoising_step: DenoisingStep
    result: _generation_pb2.GenerationResult
    result_chunk: _generation_pb2.ResultChunk
    def __init__(self, stage_started: _Optional[_Union[StageStarted, _Mapping]] = ..., denoising_step: _Optional[_Union[DenoisingStep, _Mapping]] = ..., result: _Optional[_Union[_generation_pb2.GenerationResult, _Mapping]] = ..., result_chunk: _Optional[_Union[_generation_pb2.ResultChunk, _Mapping]] = ...) -> None: ...

class GenerateUnaryRequest(_message.Message):
    __slots__ = ("params", "request_id")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    params: _generation_pb2.GenerationParams
    request_id: str
    def __init__(self, params: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateUnaryResponse(_message.Message):
    __slots__ = ("result", "results")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    result: _generation_pb2.GenerationResult
    results: _containers.RepeatedCompositeFieldContainer[_generation_pb2.GenerationResult]
    def __init__(self, result: _Optional[_Union[_generation_pb2.GenerationResult, _Mapping]] = ..., results: _Optional[_Iterable[_Union[_generation_pb2.GenerationResult, _Mapping]]] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("stage_id", "kind", "replicas", "state", "sleep_level", "device_memory_bytes", "device", "workers", "supports_sleep", "max_batch_size", "queue_depth", "mean_batch_size")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SLEEP_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    kind: str
    replicas: int
    state: StageState
    sleep_level: int
    device_memory_bytes: int
    device: str
    workers: int
    supports_sleep: bool
    max_batch_size: int
    queue_depth: int
    mean_batch_size: float
    def __init__(self, stage_id: _Optional[int] = ..., kind: _Optional[str] = ..., replicas: _Optional[int] = ..., state: _Optional[_Union[StageState, str]] = ..., sleep_level: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., device: _Optional[str] = ..., workers: _Optional[int] = ..., supports_sleep: _Optional[bool] = ..., max_batch_size: _Optional[int] = ..., queue_depth: _Optional[int] = ..., mean_batch_size: _Optional[float] = ...) -> None: ...

class ListStagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListStagesResponse(_message.Message):
    __slots__ = ("stages", "generation_paused")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_PAUSED_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    generation_paused: bool
    def __init__(self, stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., generation_paused: _Optional[bool] = ...) -> None: ...

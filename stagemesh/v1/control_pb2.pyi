from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ControlStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_STATUS_UNSPECIFIED: _ClassVar[ControlStatus]
    CONTROL_STATUS_SUCCESS: _ClassVar[ControlStatus]
    CONTROL_STATUS_SKIPPED: _ClassVar[ControlStatus]
    CONTROL_STATUS_ERROR: _ClassVar[ControlStatus]

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_SUCCESS: _ClassVar[AckStatus]
    ACK_STATUS_ERROR: _ClassVar[AckStatus]
CONTROL_STATUS_UNSPECIFIED: ControlStatus
CONTROL_STATUS_SUCCESS: ControlStatus
CONTROL_STATUS_SKIPPED: ControlStatus
CONTROL_STATUS_ERROR: ControlStatus
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_SUCCESS: AckStatus
ACK_STATUS_ERROR: AckStatus

class WorkerAck(_message.Message):
    __slots__ = ("stage_id", "rank", "status", "freed_bytes", "latency_ms", "level", "error")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    rank: int
    status: AckStatus
    freed_bytes: int
    latency_ms: float
    level: int
    error: str
    def __init__(self, stage_id: _Optional[int] = ..., rank: _Optional[int] = ..., status: _Optional[_Union[AckStatus, str]] = ..., freed_bytes: _Optional[int] = ..., latency_ms: _Optional[float] = ..., level: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "source", "stage_id", "rank", "bytes", "on_device", "layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    stage_id: int
    rank: int
    bytes: int
    on_device: bool
    layers: int
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., stage_id: _Optional[int] = ..., rank: _Optional[int] = ..., bytes: _Optional[int] = ..., on_device: _Optional[bool] = ..., layers: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("stage_ids",)
    STAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    stage_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
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

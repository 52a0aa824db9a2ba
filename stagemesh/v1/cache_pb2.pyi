from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheEntry(_message.Message):
    __slots__ = ("key", "size_bytes", "file_count", "tensor_count", "last_used_unix", "live_consumers", "valid")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LIVE_CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    file_count: int
    tensor_count: int
    last_used_unix: float
    live_consumers: int
    valid: bool
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ..., file_count: _Optional[int] = ..., tensor_count: _Optional[int] = ..., last_used_unix: _Optional[float] = ..., live_consumers: _Optional[int] = ..., valid: _Optional[bool] = ...) -> None: ...

class ListEntriesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEntriesResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CacheEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[CacheEntry, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("root", "entry_count", "total_bytes", "invalid_entry_count", "stale_temp_dirs")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    INVALID_ENTRY_COUNT_FIELD_NUMBER: _ClassVar[int]
    STALE_TEMP_DIRS_FIELD_NUMBER: _ClassVar[int]
    root: str
    entry_count: int
    total_bytes: int
    invalid_entry_count: int
    stale_temp_dirs: int
    def __init__(self, root: _Optional[str] = ..., entry_count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., invalid_entry_count: _Optional[int] = ..., stale_temp_dirs: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("key", "budget_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    budget_bytes: int
    def __init__(self, key: _Optional[str] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted_keys", "freed_bytes", "skipped_in_use_keys", "remaining_bytes")
    EVICTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_IN_USE_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_BYTES_FIELD_NUMBER: _ClassVar[int]
    evicted_keys: _containers.RepeatedScalarFieldContainer[str]
    freed_bytes: int
    skipped_in_use_keys: _containers.RepeatedScalarFieldContainer[str]
    remaining_bytes: int
    def __init__(self, evicted_keys: _Optional[_Iterable[str]] = ..., freed_bytes: _Optional[int] = ..., skipped_in_use_keys: _Optional[_Iterable[str]] = ..., remaining_bytes: _Optional[int] = ...) -> None: ...

class PublishSessionRequest(_message.Message):
    __slots__ = ("key", "lock_timeout_seconds", "done", "published")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LOCK_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    key: str
    lock_timeout_seconds: float
    done: bool
    published: bool
    def __init__(self, key: _Optional[str] = ..., lock_timeout_seconds: _Optional[float] = ..., done: _Optional[bool] = ..., published: _Optional[bool] = ...) -> None: ...

class PublishSessionResponse(_message.Message):
    __slots__ = ("granted", "existing_valid")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    EXISTING_VALID_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    existing_valid: bool
    def __init__(self, granted: _Optional[bool] = ..., existing_valid: _Optional[bool] = ...) -> None: ...

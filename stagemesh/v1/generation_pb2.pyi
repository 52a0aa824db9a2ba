from stagemesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FORMAT_UNSPECIFIED: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_PNG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_TENSOR: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_JPEG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_WEBP: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_MP4: _ClassVar[OutputFormat]
OUTPUT_FORMAT_UNSPECIFIED: OutputFormat
OUTPUT_FORMAT_PNG: OutputFormat
OUTPUT_FORMAT_TENSOR: OutputFormat
OUTPUT_FORMAT_JPEG: OutputFormat
OUTPUT_FORMAT_WEBP: OutputFormat
OUTPUT_FORMAT_MP4: OutputFormat

class GenerationParams(_message.Message):
    __slots__ = ("prompt", "width", "height", "num_inference_steps", "guidance_scale", "seed", "output_format", "negative_prompt", "num_images", "quality", "init_image", "strength", "num_frames", "fps", "step_cache", "step_cache_threshold", "adapters")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    INIT_IMAGE_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output_format: OutputFormat
    negative_prompt: str
    num_images: int
    quality: int
    init_image: bytes
    strength: float
    num_frames: int
    fps: int
    step_cache: str
    step_cache_threshold: float
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterChoice]
    def __init__(self, prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., output_format: _Optional[_Union[OutputFormat, str]] = ..., negative_prompt: _Optional[str] = ..., num_images: _Optional[int] = ..., quality: _Optional[int] = ..., init_image: _Optional[bytes] = ..., strength: _Optional[float] = ..., num_frames: _Optional[int] = ..., fps: _Optional[int] = ..., step_cache: _Optional[str] = ..., step_cache_threshold: _Optional[float] = ..., adapters: _Optional[_Iterable[_Union[AdapterChoice, _Mapping]]] = ...) -> None: ...

class AdapterChoice(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class GenerationResult(_message.Message):
    __slots__ = ("request_id", "output_format", "width", "height", "seed", "png", "tensor", "jpeg", "webp", "mp4", "stage_latency_ms", "index", "step_cache_skipped", "step_cache_passes", "step_cache", "num_frames", "fps", "chunked_bytes")
    class StageLatencyMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PNG_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    JPEG_FIELD_NUMBER: _ClassVar[int]
    WEBP_FIELD_NUMBER: _ClassVar[int]
    MP4_FIELD_NUMBER: _ClassVar[int]
    STAGE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_PASSES_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_format: OutputFormat
    width: int
    height: int
    seed: int
    png: bytes
    tensor: _tensor_pb2.Tensor
    jpeg: bytes
    webp: bytes
    mp4: bytes
    stage_latency_ms: _containers.ScalarMap[str, float]
    index: int
    step_cache_skipped: int
    step_cache_passes: int
    step_cache: str
    num_frames: int
    fps: int
    chunked_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., output_format: _Optional[_Union[OutputFormat, str]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ..., png: _Optional[bytes] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., jpeg: _Optional[bytes] = ..., webp: _Optional[bytes] = ..., mp4: _Optional[bytes] = ..., stage_latency_ms: _Optional[_Mapping[str, float]] = ..., index: _Optional[int] = ..., step_cache_skipped: _Optional[int] = ..., step_cache_passes: _Optional[int] = ..., step_cache: _Optional[str] = ..., num_frames: _Optional[int] = ..., fps: _Optional[int] = ..., chunked_bytes: _Optional[int] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

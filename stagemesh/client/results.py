"""What the client's calls return: small frozen dataclasses, never raw protobuf messages.

numpy and PIL are imported only when a result is asked for `.tensor` or `.image`.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from stagemesh.core import converters, formats
from stagemesh.core.acks import WorkerAck
from stagemesh.core.events import DenoisingStep, StageStarted
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

_NUMPY_DTYPES = ("float32", "float16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")


@dataclass(frozen=True)
class TensorData:
    """A tensor result as it came: dtype name, shape, raw little-endian row-major bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: builtins.bytes = field(repr=False)


@dataclass(frozen=True)
class GenerationResult:
    """One generated image.

    `format` is "png", "jpeg", "webp" or "tensor"; `index` which of the request's num_images this
    is (from 0; image i used seed + i); `stage_latency_ms` the milliseconds each stage spent, by
    stage id.
    """

    request_id: str
    format: str
    width: int
    height: int
    seed: int
    index: int
    stage_latency_ms: dict[int, float]
    _encoded: builtins.bytes = field(repr=False, default=b"")
    # A video's frame count and rate; 0 for an image.
    num_frames: int = 0
    fps: int = 0
    _tensor: TensorData | None = field(repr=False, default=None)
    # Where a step cache ran: its method, and the block passes it served from the cache of all
    # those run ("" and 0 otherwise).
    step_cache: str = ""
    step_cache_skipped: int = 0
    step_cache_passes: int = 0

    @classmethod
    def from_proto(cls, msg: generation_pb2.GenerationResult) -> GenerationResult:
        which = msg.WhichOneof("image")
        tensor = None
        if which == "tensor":
            tensor = TensorData(msg.tensor.dtype, tuple(int(d) for d in msg.tensor.shape), msg.tensor.data)
        return cls(
            request_id=msg.request_id,
            format=converters.output_format_from_proto(msg.output_format) or which or formats.DEFAULT.name,
            width=msg.width,
            height=msg.height,
            seed=msg.seed,
            index=msg.index,
            stage_latency_ms={int(k): v for k, v in msg.stage_latency_ms.items()},
            _encoded=getattr(msg, which) if which in formats.ENCODED_NAMES else b"",
            _tensor=tensor,
            num_frames=msg.num_frames,
            fps=msg.fps,
            step_cache=msg.step_cache,
            step_cache_skipped=msg.step_cache_skipped,
            step_cache_passes=msg.step_cache_passes,
        )

    @property
    def frames(self) -> np.ndarray:
        """A video's frames: the float32 [frames, height, width, 3] array of a tensor result, else
        the decoded frames, uint8 RGB (MP4 through PyAV, the `video` extra; animated WebP
        through Pillow). ValueError for an image."""
        import numpy as np

        if not self.num_frames:
            raise ValueError("this result is an image, not a video; use .image")
        if self._tensor is not None:
            return self.tensor
        import io

        if self.format == formats.MP4.name:
            import av

            with av.open(io.BytesIO(self._encoded), mode="r") as container:
                return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        from PIL import Image, ImageSequence

        with Image.open(io.BytesIO(self._encoded)) as image:
            return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(image)])

    @property
    def bytes(self) -> builtins.bytes:
        """The encoded image (PNG, JPEG or WebP) as sent; for a tensor result its raw data."""
        return self._tensor.data if self._tensor is not None else self._encoded

    @property
    def tensor(self) -> np.ndarray:
        """A tensor result as a numpy array ([height, width, 3] float32 in [0, 1]); ValueError for
        an encoded result (ask for output_format="tensor")."""
        if self._tensor is None:
            raise ValueError(f"this result is {self.format}, not a tensor; ask for output_format='tensor'")
        import numpy as np

        if self._tensor.dtype not in _NUMPY_DTYPES:
            raise ValueError(f"a {self._tensor.dtype} tensor has no numpy dtype; use .bytes")
        return np.frombuffer(self._tensor.data, dtype=np.dtype(self._tensor.dtype).newbyteorder("<")).reshape(
            self._tensor.shape
        )

    @property
    def image(self) -> Image.Image:
        """The image as a PIL image (a tensor result is scaled from [0, 1] to 8-bit RGB)."""
        import io

        from PIL import Image

        if self._tensor is None:
            image = Image.open(io.BytesIO(self._encoded))
            image.load()
            return image
        import numpy as np

        # As the gateway encodes its PNGs: scale, round half to even, clamp.
        pixels = np.clip(np.rint(np.asarray(self.tensor, dtype=np.float32) * np.float32(255.0)), 0, 255)
        return Image.fromarray(pixels.astype(np.uint8))

    def save(self, path: str | Path) -> Path:
        """Write the image to `path`: the bytes as sent when the suffix matches the result's format
        (or names none), else converted to the format the suffix names (.png, .jpg/.jpeg, .webp);
        a tensor result to .npy as the array, to an image suffix as the 8-bit image."""
        path = Path(path)
        named = formats.by_suffix(path.suffix)  # save() converts when the suffix asks for another format
        wanted = named.name if named is not None else None
        if self.num_frames and self._tensor is None:
            if wanted not in (None, self.format):
                raise ValueError(
                    f"this video is {self.format}; save it to a .{self.format} path (or ask for that format)"
                )
            path.write_bytes(self._encoded)
        elif self._tensor is not None and path.suffix.lower() == ".npy":
            import numpy as np

            np.save(path, self.tensor)
        elif self._tensor is None and wanted in (None, self.format):
            path.write_bytes(self._encoded)
        else:
            self.image.convert("RGB").save(path)
        return path


# What on_progress receives, one per streamed event: a result is an event too.
ProgressEvent: TypeAlias = StageStarted | DenoisingStep | GenerationResult
# generate()'s on_progress; AsyncClient awaits what it returns when that is awaitable.
ProgressCallback: TypeAlias = Callable[[ProgressEvent], Any]


def event_from_proto(msg: gateway_pb2.GenerateResponse) -> ProgressEvent:
    progress = converters.progress_from_proto(msg)
    return progress if progress is not None else GenerationResult.from_proto(msg.result)


class StageState(enum.StrEnum):
    UNSPECIFIED = "unspecified"
    SERVING = "serving"
    LOADING = "loading"
    UNAVAILABLE = "unavailable"
    SLEEPING = "sleeping"
    PAUSED = "paused"


_STAGE_STATES = {
    v.number: StageState[v.name.removeprefix("STAGE_STATE_")] for v in gateway_pb2.StageState.DESCRIPTOR.values
}


@dataclass(frozen=True)
class StageInfo:
    """One stage as the gateway reports it, aggregated over its replicas."""

    stage_id: int
    kind: str
    replicas: int
    state: StageState
    sleep_level: int
    device: str
    device_memory_bytes: int


@dataclass(frozen=True)
class StageListing:
    """ListStages: the stages in pipeline order, and whether admission of Generate is closed.
    Iterating it (and len()) goes over the stages."""

    stages: list[StageInfo]
    generation_paused: bool

    def __iter__(self) -> Iterator[StageInfo]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    @classmethod
    def from_proto(cls, msg: gateway_pb2.ListStagesResponse) -> StageListing:
        return cls(
            stages=[
                StageInfo(
                    stage_id=s.stage_id,
                    kind=s.kind,
                    replicas=s.replicas,
                    state=_STAGE_STATES.get(s.state, StageState.UNSPECIFIED),
                    sleep_level=s.sleep_level,
                    device=s.device,
                    device_memory_bytes=s.device_memory_bytes,
                )
                for s in msg.stages
            ],
            generation_paused=msg.generation_paused,
        )


class ControlStatus(enum.StrEnum):
    UNSPECIFIED = "unspecified"
    SUCCESS = "success"
    SKIPPED = "skipped"  # nothing to do: no stage was called
    ERROR = "error"  # at least one worker failed; its ack says why


_CONTROL_STATUSES = {
    v.number: ControlStatus[v.name.removeprefix("CONTROL_STATUS_")] for v in control_pb2.ControlStatus.DESCRIPTOR.values
}


@dataclass(frozen=True)
class ControlResult:
    """The answer to sleep() or wake_up(): overall status, why it was skipped, one ack per worker."""

    status: ControlStatus
    reason: str
    acks: list[WorkerAck]

    @property
    def ok(self) -> bool:
        return self.status != ControlStatus.ERROR

    @classmethod
    def from_proto(cls, msg: gateway_pb2.SleepResponse | gateway_pb2.WakeUpResponse) -> ControlResult:
        return cls(
            status=_CONTROL_STATUSES.get(msg.status, ControlStatus.UNSPECIFIED),
            reason=getattr(msg, "reason", ""),
            acks=[converters.worker_ack_from_proto(a) for a in msg.acks],
        )

"""The output formats, in one table. Every side reads a format's names here: the domain's and
the client's name (also the GenerationResult oneof field that carries the image), the wire's
enum, Pillow's encoder and the file suffixes that name it. Light: the client imports it."""

from __future__ import annotations

from dataclasses import dataclass

from stagemesh.v1 import generation_pb2


@dataclass(frozen=True)
class Format:
    name: str
    wire: generation_pb2.OutputFormat
    # Pillow's encoder; None for a tensor, which is sent as it is, not encoded.
    pillow: str | None
    # File suffixes that ask for this format (lower case, with the dot).
    suffixes: tuple[str, ...]
    # Takes a quality (1-100).
    lossy: bool = False
    # Which results it can carry: a still image, a video (all frames), or both.
    image: bool = True
    video: bool = False

    @property
    def encoded(self) -> bool:
        """Bytes of a container (anything but a tensor)."""
        return self.name != "tensor"


PNG = Format("png", generation_pb2.OUTPUT_FORMAT_PNG, "PNG", (".png",))
TENSOR = Format("tensor", generation_pb2.OUTPUT_FORMAT_TENSOR, None, (), video=True)
JPEG = Format("jpeg", generation_pb2.OUTPUT_FORMAT_JPEG, "JPEG", (".jpg", ".jpeg"), lossy=True)
# For a video: animated WebP.
WEBP = Format("webp", generation_pb2.OUTPUT_FORMAT_WEBP, "WEBP", (".webp",), lossy=True, video=True)
# H.264 in MP4 (PyAV), video only.
MP4 = Format("mp4", generation_pb2.OUTPUT_FORMAT_MP4, None, (".mp4",), lossy=True, image=False, video=True)
# In the wire's enum order, as error messages list them.
FORMATS = (PNG, TENSOR, JPEG, WEBP, MP4)
# A request that names no format gets PNG, or MP4 from a video model.
DEFAULT = PNG
DEFAULT_VIDEO = MP4

NAMES = tuple(f.name for f in FORMATS)
IMAGE_NAMES = tuple(f.name for f in FORMATS if f.image)
VIDEO_NAMES = tuple(f.name for f in FORMATS if f.video)
ENCODED_NAMES = tuple(f.name for f in FORMATS if f.encoded)
LOSSY_NAMES = tuple(f.name for f in FORMATS if f.lossy)

_BY_NAME = {f.name: f for f in FORMATS}
_BY_WIRE: dict[int, Format] = {f.wire: f for f in FORMATS}
_BY_WIRE[generation_pb2.OUTPUT_FORMAT_UNSPECIFIED] = DEFAULT
_BY_SUFFIX = {suffix: f for f in FORMATS for suffix in f.suffixes}


def by_name(name: str) -> Format:
    """KeyError for a name outside NAMES."""
    return _BY_NAME[name]


def by_wire(value: int) -> Format | None:
    """The format an enum value stands for (UNSPECIFIED: the default); None for an unknown value."""
    return _BY_WIRE.get(value)


def by_suffix(suffix: str) -> Format | None:
    """The encoded format a file suffix (".JPG", ".webp") names; None for any other suffix."""
    return _BY_SUFFIX.get(suffix.lower())

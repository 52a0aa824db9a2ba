"""Videos out of the gateway: a video model's frames (float [frames, height, width, 3] in [0, 1])
as MP4 (H.264 through PyAV, yuv420p) or animated WebP (Pillow). Frames are quantised as images
are (images.to_uint8). Both block for as long as encoding takes: run them off the event loop."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
from PIL import Image

from stagemesh.core import formats
from stagemesh.gateway.images import to_uint8

# quality 1-100 -> x264's CRF 51-0 (0: the codec's lossless luma; chroma is still 4:2:0).
MAX_CRF = 51


def crf_for(quality: int) -> int:
    return round(MAX_CRF * (100 - quality) / 99)


def encode_mp4(frames: np.ndarray, fps: int, quality: int) -> bytes:
    """uint8 [frames, height, width, 3] RGB -> H.264 MP4 at `fps`. Width and height must be even
    (yuv420p), which every pixel multiple of a video model is."""
    try:
        import av
    except ImportError as exc:  # the `video` extra
        raise RuntimeError(f"MP4 results need PyAV: pip install 'stagemesh[video]' ({exc})") from None
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf_for(quality))}
        for pixels in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return buffer.getvalue()


def encode_webp(frames: np.ndarray, fps: int, quality: int) -> bytes:
    """uint8 [frames, height, width, 3] RGB -> animated WebP, each frame shown 1000 / fps ms."""
    images = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    buffer = io.BytesIO()
    images[0].save(
        buffer,
        format="WEBP",
        save_all=True,
        append_images=images[1:],
        duration=round(1000 / fps),
        loop=0,
        quality=quality,
    )
    return buffer.getvalue()


def encode_video(frames: np.ndarray, output_format: str, fps: int, quality: int) -> bytes:
    """float [frames, height, width, 3] in [0, 1] as MP4 or animated WebP."""
    pixels = to_uint8(frames)
    if output_format == formats.MP4.name:
        return encode_mp4(pixels, fps, quality)
    if output_format == formats.WEBP.name:
        return encode_webp(pixels, fps, quality)
    raise ValueError(f"{output_format!r} is no video format; allowed: mp4, webp")


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """An MP4's frames (uint8 [frames, height, width, 3] RGB) and its frame rate: how clients and
    tests read a result back."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        rate = float(stream.average_rate or 0)
    return np.stack(frames), rate

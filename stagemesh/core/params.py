"""Generation parameters: defaults and validation against a stage's limits.

Shared by the gateway (refuses bad input before any stage is called) and the stage service
(which never trusts its caller). Violations name the field and the allowed range.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field

from stagemesh.core import formats
from stagemesh.core.errors import FieldViolation, InvalidArgument

OUTPUT_PNG = formats.PNG.name
OUTPUT_TENSOR = formats.TENSOR.name
OUTPUT_JPEG = formats.JPEG.name
OUTPUT_WEBP = formats.WEBP.name
OUTPUT_MP4 = formats.MP4.name
OUTPUT_FORMATS = formats.NAMES
# Formats that take a quality.
LOSSY_FORMATS = formats.LOSSY_NAMES
DEFAULT_QUALITY = 90
MAX_QUALITY = 100
MAX_FPS = 120
# Image-to-image without a strength: how far from the starting image (diffusers' default).
DEFAULT_STRENGTH = 0.8
# The id travels to every stage as x-request-id metadata: printable ASCII, bounded.
MAX_REQUEST_ID_CHARS = 128
# Image-to-image: the name of the starting image among a stage's input tensors, torch.uint8
# [height, width, 3] RGB (decoded by the gateway).
INIT_IMAGE_INPUT = "init_image"
# Step caching: the methods a stage may offer ("off": every block of every step runs), and the
# output a denoising stage adds to an item's outputs when a cache ran: int64 [passes skipped,
# passes of the hooked modules, index of the method in STEP_CACHES]. The gateway reads it into
# the result.
STEP_CACHES = ("off", "first_block", "taylorseer", "mag")
STEP_CACHE_OUTPUT = "step_cache_passes"


@dataclass(frozen=True)
class Limits:
    pixel_multiple: int = 16
    max_pixels_side: int = 1024
    max_inference_steps: int = 100
    max_prompt_bytes: int = 2048
    default_size: int = 256
    default_inference_steps: int = 8
    default_guidance_scale: float = 4.0
    max_guidance_scale: float = 30.0
    # Images one request may ask for: the gateway's --max-images-per-request; a stage runs one
    # image per request (the gateway sends each image on its own).
    max_num_images: int = 1
    # What the pipeline (at the gateway) or the stage's model can use beyond a prompt.
    supports_negative_prompt: bool = False
    supports_init_image: bool = False
    # Step caches the denoising stage offers (the gateway, which does not know, accepts every name).
    step_caches: tuple[str, ...] = STEP_CACHES
    # Whether a stage of the pipeline applies LoRA adapters (a diffusers transformer).
    supports_adapters: bool = False

    # Video models: num_frames is frame_step * k + 1, from 1 to max_num_frames (0: the model
    # draws images and refuses video parameters).
    frame_step: int = 0
    max_num_frames: int = 0
    default_num_frames: int = 0
    default_fps: int = 0
    # An image-to-video model (the start image) or an image-editing one (the image it edits, no
    # strength): it cannot draw without init_image.
    requires_init_image: bool = False

    @property
    def video(self) -> bool:
        return self.frame_step > 0


# What requests sampled together must share, in the order of Params.batch_key().
BATCH_KEY_FIELDS = (
    "width",
    "height",
    "num_inference_steps",
    "guidance_scale",
    "strength",
    "step_cache",
    "step_cache_threshold",
    "num_frames",
    "adapters",  # requests with different adapter sets never share a transformer pass
)


# LoRA adapters one request may name, and the scale each may take (diffusers' set_adapters weight).
MAX_ADAPTERS_PER_REQUEST = 4
MAX_ADAPTER_SCALE = 8.0
# An adapter's name: what a stage registers it under (its file's or folder's name in lora_dir).
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


@dataclass(frozen=True)
class AdapterChoice:
    """One LoRA adapter a request applies, by the name a stage registered it under, at `scale`."""

    name: str
    scale: float = 1.0


@dataclass(frozen=True)
class InitImage:
    """A request's starting image: its size in pixels and, at the gateway, its encoded bytes
    (PNG, JPEG or WebP; the gateway decodes them and stages receive INIT_IMAGE_INPUT)."""

    width: int
    height: int
    data: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Params:
    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output_format: str
    # What the image should not show; "" means none (the pipeline's own unconditional input).
    negative_prompt: str = ""
    # Images from one request; image i is drawn with seed + i.
    num_images: int = 1
    # JPEG/WebP quality, 1-100.
    quality: int = DEFAULT_QUALITY
    # Image-to-image: how far from the starting image, in (0, 1]; None means text-to-image.
    strength: float | None = None
    # Image-to-image: the starting image (set exactly when strength is); image-to-video: the
    # first frame (strength unset).
    init_image: InitImage | None = None
    # Step caching for this request; None: the stage's own setting (its step_cache options).
    step_cache: str | None = None
    step_cache_threshold: float | None = None
    # LoRA adapters applied to the transformer, in the order given; () means the base model.
    adapters: tuple[AdapterChoice, ...] = ()
    # A video's frames and frame rate; 0 for an image.
    num_frames: int = 0
    fps: int = 0

    @property
    def video(self) -> bool:
        return self.num_frames > 0

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one diffusion batch (or one DP wave)."""
        return tuple(getattr(self, name) for name in BATCH_KEY_FIELDS)

    @property
    def first_step(self) -> int:
        """Where denoising starts in the schedule of num_inference_steps: 0 for text-to-image;
        with a starting image the last int(steps * strength) steps run (as diffusers' img2img)."""
        if self.strength is None:
            return 0
        return self.num_inference_steps - min(int(self.num_inference_steps * self.strength), self.num_inference_steps)


def check_request_id(value: str) -> None:
    """A client's own request id must be sendable as gRPC metadata to every hop."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument.field("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters (got {len(value)})")
    if not all(" " <= c <= "~" for c in value):
        raise InvalidArgument.field(
            "request_id", "printable ASCII only (0x20-0x7E): it is sent on as x-request-id metadata"
        )


def _check_side(name: str, value: int, limits: Limits, out: list[FieldViolation]) -> None:
    m, top = limits.pixel_multiple, limits.max_pixels_side
    allowed = f"allowed: multiples of {m} from {m} to {top}"
    if value <= 0:
        out.append(FieldViolation(name, f"must be positive, got {value}; {allowed}"))
    elif value > top:
        out.append(FieldViolation(name, f"{value} is above the maximum {top}; {allowed}"))
    elif value % m:
        out.append(FieldViolation(name, f"{value} is not a multiple of {m}; {allowed}"))


def _check_text(name: str, text: str, limits: Limits, out: list[FieldViolation]) -> None:
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_prompt_bytes:
        out.append(FieldViolation(name, f"is {size} bytes; allowed: at most {limits.max_prompt_bytes} UTF-8 bytes"))


def _image_size(
    width: int | None, height: int | None, image: InitImage | None, limits: Limits, out: list[FieldViolation]
) -> tuple[int, int]:
    """The output size: the given one, else the starting image's, else the default. A starting
    image fixes the size: a width or height that differs from it is refused."""
    if image is None:
        return (limits.default_size if width is None else width, limits.default_size if height is None else height)
    m, top = limits.pixel_multiple, limits.max_pixels_side
    if not all(0 < side <= top and side % m == 0 for side in (image.width, image.height)):
        out.append(
            FieldViolation(
                "params.init_image",
                f"is {image.width}x{image.height} pixels; allowed: width and height multiples of {m} from {m} to {top}",
            )
        )
    for name, given, own in (("width", width, image.width), ("height", height, image.height)):
        if given is not None and given != own:
            out.append(
                FieldViolation(
                    f"params.{name}",
                    f"{given} differs from the init_image's {name} {own}; allowed: unset or {own} "
                    "(an image-to-image result has its starting image's size)",
                )
            )
    return image.width, image.height


def _check_guidance_inputs(negative_prompt: str, guidance: float, limits: Limits, out: list[FieldViolation]) -> None:
    if not negative_prompt:
        return
    _check_text("params.negative_prompt", negative_prompt, limits, out)
    if not limits.supports_negative_prompt:
        out.append(
            FieldViolation(
                "params.negative_prompt", "this pipeline cannot use a negative prompt; allowed: unset or empty"
            )
        )
    elif guidance == 1.0:
        out.append(
            FieldViolation(
                "params.negative_prompt",
                "has no effect with guidance_scale 1.0 (no classifier-free guidance); allowed: unset or empty, "
                "or a guidance_scale above 1.0",
            )
        )


def _resolve_strength(
    strength: float | None, image: InitImage | None, steps: int, limits: Limits, out: list[FieldViolation]
) -> float | None:
    """The strength of an image-to-image request (default DEFAULT_STRENGTH); None without an image,
    for a video model (its starting image is the first frame) and for an image-editing model (an
    image model that requires init_image: the image it edits)."""
    if limits.video:
        if strength is not None:
            out.append(
                FieldViolation(
                    "params.strength",
                    f"{strength:g} given to a video model, which starts from init_image as its first frame; "
                    "allowed: unset",
                )
            )
        if image is not None and not limits.supports_init_image:
            out.append(
                FieldViolation("params.init_image", "this video model cannot start from an image; allowed: empty")
            )
        if image is None and limits.requires_init_image:
            out.append(
                FieldViolation(
                    "params.init_image",
                    "is empty; this image-to-video model starts from it; allowed: a PNG, JPEG or WebP image",
                )
            )
        return None
    if limits.requires_init_image:  # an edit model: it draws from noise, guided by init_image
        if strength is not None:
            out.append(
                FieldViolation(
                    "params.strength",
                    f"{strength:g} given to an image-editing model, which draws from noise guided by init_image; "
                    "allowed: unset",
                )
            )
        if image is None:
            out.append(
                FieldViolation(
                    "params.init_image",
                    "is empty; this image-editing model edits it; allowed: a PNG, JPEG or WebP image",
                )
            )
        return None
    if image is None:
        if strength is not None:
            out.append(
                FieldViolation(
                    "params.strength",
                    f"{strength:g} given without an init_image; allowed: unset for text-to-image, "
                    "above 0 up to 1 with an init_image",
                )
            )
        return None
    if not limits.supports_init_image:
        out.append(FieldViolation("params.init_image", "this pipeline cannot start from an image; allowed: empty"))
    strength = DEFAULT_STRENGTH if strength is None else float(strength)
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        out.append(FieldViolation("params.strength", f"{strength:g} is out of range; allowed: above 0 up to 1"))
    elif 1 <= steps and int(steps * strength) < 1:
        out.append(
            FieldViolation(
                "params.strength",
                f"{strength:g} x num_inference_steps {steps} leaves no denoising step; allowed: at least "
                f"{1 / steps:g} with {steps} steps (or more steps)",
            )
        )
    return strength


def _check_step_cache(name: str | None, threshold: float | None, limits: Limits, out: list[FieldViolation]) -> None:
    if name is not None and name not in limits.step_caches:
        out.append(
            FieldViolation(
                "params.step_cache",
                f"{name!r} is not offered here; allowed: unset (the stage's setting) or "
                f"{', '.join(limits.step_caches)}",
            )
        )
    if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
        out.append(
            FieldViolation(
                "params.step_cache_threshold",
                f"{threshold:g} is out of range; allowed: unset (the stage's setting) or above 0",
            )
        )


def check_adapter_name(name: str, field: str) -> None:
    """An adapter name a stage can register (a file name without its suffix)."""
    if not re.fullmatch(ADAPTER_NAME_PATTERN, name):
        raise InvalidArgument.field(
            field,
            f"{name!r} is not an adapter name; allowed: 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        )


def _check_adapters(adapters: tuple[AdapterChoice, ...], limits: Limits, out: list[FieldViolation]) -> None:
    if not adapters:
        return
    if not limits.supports_adapters:
        out.append(FieldViolation("params.adapters", "this pipeline applies no LoRA adapters; allowed: empty"))
        return
    if len(adapters) > MAX_ADAPTERS_PER_REQUEST:
        out.append(
            FieldViolation(
                "params.adapters", f"names {len(adapters)} adapters; allowed: at most {MAX_ADAPTERS_PER_REQUEST}"
            )
        )
    seen: set[str] = set()
    for i, choice in enumerate(adapters):
        try:
            check_adapter_name(choice.name, f"params.adapters[{i}].name")
        except InvalidArgument as exc:
            out.extend(exc.violations)
        if choice.name in seen:
            out.append(
                FieldViolation(f"params.adapters[{i}].name", f"{choice.name!r} is named twice; allowed: each once")
            )
        seen.add(choice.name)
        if not (math.isfinite(choice.scale) and -MAX_ADAPTER_SCALE <= choice.scale <= MAX_ADAPTER_SCALE):
            out.append(
                FieldViolation(
                    f"params.adapters[{i}].scale",
                    f"{choice.scale:g} is out of range; allowed: {-MAX_ADAPTER_SCALE:g} to {MAX_ADAPTER_SCALE:g}",
                )
            )


def _check_outputs(
    output_format: str, num_images: int, quality: int | None, limits: Limits, out: list[FieldViolation]
) -> None:
    allowed = formats.VIDEO_NAMES if limits.video else formats.IMAGE_NAMES
    what = "a video model" if limits.video else "an image model"
    if output_format not in allowed:
        known = output_format in OUTPUT_FORMATS
        out.append(
            FieldViolation(
                "params.output_format",
                f"{output_format.upper() if known else repr(output_format)} is "
                f"{'not an output of ' + what if known else 'unknown'}; allowed: {', '.join(map(str.upper, allowed))}",
            )
        )
    if not 1 <= num_images <= limits.max_num_images:
        out.append(
            FieldViolation("params.num_images", f"{num_images} is out of range; allowed: 1 to {limits.max_num_images}")
        )
    if quality is None:
        return
    if output_format not in LOSSY_FORMATS:
        lossy = [name.upper() for name in LOSSY_FORMATS if name in allowed]
        out.append(
            FieldViolation(
                "params.quality",
                f"applies to {' and '.join(lossy)} only, not {output_format.upper()}; allowed: unset, or 1 to "
                f"{MAX_QUALITY} with output_format {' or '.join(lossy)}",
            )
        )
    elif not 1 <= quality <= MAX_QUALITY:
        out.append(FieldViolation("params.quality", f"{quality} is out of range; allowed: 1 to {MAX_QUALITY}"))


def frame_counts(limits: Limits) -> str:
    """The frame counts a video model takes, as error messages name them."""
    step, top = limits.frame_step, limits.max_num_frames
    counts = list(range(1, top + 1, step))
    listed = ", ".join(map(str, counts[:4])) + (f", ... {counts[-1]}" if len(counts) > 4 else "")
    return f"{step}k + 1 from 1 to {top} ({listed})"


def _resolve_video(
    num_frames: int | None, fps: int | None, limits: Limits, out: list[FieldViolation]
) -> tuple[int, int]:
    """(num_frames, fps) of a video model's request, defaults filled; (0, 0) for an image model,
    which refuses both."""
    if not limits.video:
        for name, value in (("num_frames", num_frames), ("fps", fps)):
            if value is not None:
                out.append(
                    FieldViolation(
                        f"params.{name}", f"{value} given to an image model, which draws no video; allowed: unset"
                    )
                )
        return 0, 0
    frames = limits.default_num_frames if num_frames is None else num_frames
    if not (1 <= frames <= limits.max_num_frames and (frames - 1) % limits.frame_step == 0):
        out.append(FieldViolation("params.num_frames", f"{frames} frames; allowed: {frame_counts(limits)}"))
    rate = limits.default_fps if fps is None else fps
    if not 1 <= rate <= MAX_FPS:
        out.append(FieldViolation("params.fps", f"{rate} is out of range; allowed: 1 to {MAX_FPS}"))
    return frames, rate


def resolve(
    *,
    prompt: str,
    width: int | None,
    height: int | None,
    num_inference_steps: int | None,
    guidance_scale: float | None,
    seed: int | None,
    output_format: str,
    limits: Limits,
    negative_prompt: str = "",
    num_images: int | None = None,
    quality: int | None = None,
    strength: float | None = None,
    init_image: InitImage | None = None,
    step_cache: str | None = None,
    step_cache_threshold: float | None = None,
    adapters: tuple[AdapterChoice, ...] = (),
    num_frames: int | None = None,
    fps: int | None = None,
) -> Params:
    """Fill defaults (None means default) and validate; raises InvalidArgument listing every bad field."""
    violations: list[FieldViolation] = []
    width, height = _image_size(width, height, init_image, limits, violations)
    steps = limits.default_inference_steps if num_inference_steps is None else num_inference_steps
    guidance = limits.default_guidance_scale if guidance_scale is None else float(guidance_scale)

    _check_text("params.prompt", prompt, limits, violations)
    if init_image is None:  # else the size is the image's, checked as params.init_image
        _check_side("params.width", width, limits, violations)
        _check_side("params.height", height, limits, violations)
    if not 1 <= steps <= limits.max_inference_steps:
        violations.append(
            FieldViolation(
                "params.num_inference_steps", f"{steps} is out of range; allowed: 1 to {limits.max_inference_steps}"
            )
        )
    if not (math.isfinite(guidance) and 1.0 <= guidance <= limits.max_guidance_scale):
        violations.append(
            FieldViolation(
                "params.guidance_scale", f"{guidance} is out of range; allowed: 1.0 to {limits.max_guidance_scale}"
            )
        )
    _check_guidance_inputs(negative_prompt, guidance, limits, violations)
    strength = _resolve_strength(strength, init_image, steps, limits, violations)
    num_images = 1 if num_images is None else num_images
    _check_outputs(output_format, num_images, quality, limits, violations)
    _check_step_cache(step_cache, step_cache_threshold, limits, violations)
    _check_adapters(adapters, limits, violations)
    frames, rate = _resolve_video(num_frames, fps, limits, violations)
    if violations:
        raise InvalidArgument(violations)
    return Params(
        prompt=prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=secrets.randbits(63) if seed is None else int(seed),
        output_format=output_format,
        negative_prompt=negative_prompt,
        num_images=num_images,
        quality=DEFAULT_QUALITY if quality is None else quality,
        strength=strength,
        init_image=init_image,
        step_cache=step_cache,
        step_cache_threshold=None if step_cache_threshold is None else float(step_cache_threshold),
        adapters=tuple(adapters),
        num_frames=frames,
        fps=rate,
    )

"""Every option of one stage service: flags of `stagemesh stage`, keys of a [[stages]] table, and
what each of its worker processes is started with."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Any

from stagemesh.core import envflags, logs, metrics, options, tls
from stagemesh.core.options import option
from stagemesh.core.params import Limits
from stagemesh.stage_service.settings import acceleration
from stagemesh.stage_service.settings.dlo import DloOptions

# encoder / denoise / decode: stages of a diffusers-format folder (docs/MODELS.md)
KINDS = ("ar", "diffusion", "encoder", "denoise", "decode")
PRESETS = ("tiny", "flux-sized")
# The kinds that run a denoising loop, which sequence and CFG parallelism split.
IMAGE_PARALLEL_KINDS = ("diffusion", "denoise")
# When a worker prepares the level-1 sleep host buffer: by the first level-1 sleep, before it
# reports ready, or on threads once its model is loaded (worker/sleep.py).
SLEEP_HOST_BUFFERS = ("first_sleep", "at_start", "background")
# When a worker runs its first-image warm-up before reporting ready (worker/warm_up.py).
WARM_UPS = ("auto", "on", "off")
# Requests leaving width/height unset, where neither default_size nor the model names a size.
FALLBACK_SIZE = 256
# The largest side a stage takes when max_size is unset and its model names no bound.
DEFAULT_MAX_SIZE = 1024
# How often a serving worker says it is alive, even in the middle of a batch; hang_timeout_s
# must span two of them.
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class StageSettings(DloOptions):
    """Every option of one stage, written once: each field is a flag of `stagemesh stage` and a
    key of a [[stages]] table, and the executor hands the object whole to every worker process
    (plain values: it pickles). The DLO options (enable_dlo, dp_size, dlo_*,
    tensor_parallel_size) come from DloOptions, their one definition; the fields below are the
    stage's own."""

    stage_id: int = option(0, "position of this stage in the pipeline (0 = first)")
    kind: str = option(
        "ar",
        "what the stage runs: 'ar' (the language model) or 'diffusion' (DiT + decoder); "
        "for a diffusers-format model_dir also 'encoder' (text encoders), 'denoise' "
        "(diffusion without the VAE) and 'decode' (the VAE); see MODELS.md",
        choices=KINDS,
    )
    host: str = option("127.0.0.1", "address to bind (loopback by default)")
    port: int = option(0, "port to bind; 0 picks a free one (see --ready-file)")
    workers: int = option(1, "worker processes (one per rank / GPU)")
    device: str = option("cpu", "torch device for the workers: 'cpu', 'cuda' (rank i uses cuda:i) or 'cuda:N'")
    threads: int = option(0, "torch CPU threads per worker; 0 keeps torch's default")
    model_dir: str = option(
        "",
        "model folder: the embedded model's (config.json + safetensors) or a diffusers-format "
        "checkpoint (model_index.json); default: the embedded model's cache folder",
    )
    model_preset: str = option(
        "tiny", "dimensions used when the folder holds no weights yet: 'tiny' or 'flux-sized'", choices=PRESETS
    )
    max_batch_size: int = option(4, "most compatible requests run together as one batch")
    step_execution: bool = option(
        False,
        "copy and pack outputs on the worker's main thread (synchronous path) instead of "
        "handing them to the async output thread",
    )
    cuda_graphs: bool = option(
        True,
        "replay each denoising step of the embedded DiT from a captured CUDA graph (one launch "
        "per step instead of hundreds; on a CUDA device, without DLO, TP, sp_size or cfg_parallel); "
        "--no-cuda-graphs launches every kernel from Python",
    )
    batch_invariant: bool = option(
        True,
        "a request's output bytes do not depend on the requests it is batched with: a "
        "diffusion or denoise stage still forms batches but runs each request's forward passes with the "
        "shapes it has alone; --no-batch-invariant samples a batch as one (faster where kernels are "
        "launch-bound, but the same seed may round differently by one level in a few pixels)",
    )
    sp_size: int = option(
        1,
        "sequence-parallel ranks of a denoising stage: that many worker processes split the image "
        "tokens of every request and attend over them together (Ulysses all-to-all, ring attention where "
        "the head count does not divide); the embedded DiT and FLUX; see PARALLEL.md",
    )
    cfg_parallel: bool = option(
        False,
        "run the conditional and the unconditional pass of classifier-free guidance on two "
        "ranks (twice the worker processes; with sp_size, 2 x sp_size); the embedded DiT and SD3, not "
        "FLUX (its guidance is distilled); see PARALLEL.md",
    )
    compile: str = option(
        "auto",
        "compile the denoising transformer's repeated blocks with torch.compile ('regional'; compiled "
        "code kept on disk under dlo_runtime_cache_dir/compile, so a restarted or second stage on the node "
        "starts without compiling again) or run them eagerly ('off'); 'auto': 'regional' on a CUDA device, "
        "'off' on the CPU; see PERFORMANCE.md",
        choices=acceleration.COMPILE_MODES,
    )
    compute_dtype: str = option(
        "",
        "'float8': the denoising transformer's Linear layers run FP8 matmuls with per-row weight and "
        "per-token activation scales (CUDA, compute capability 8.9 or newer, with compile); '': the "
        "checkpoint's dtype",
        choices=acceleration.COMPUTE_DTYPES,
    )
    fp8_backend: str = option(
        "scaled_mm",
        "how compute_dtype = 'float8' runs: 'scaled_mm' (torch._scaled_mm, rowwise scales) or 'torchao' "
        "(Float8DynamicActivationFloat8WeightConfig with PerRow granularity; needs torchao)",
        choices=acceleration.FP8_BACKENDS,
    )
    step_cache: str = option(
        "off",
        "reuse transformer blocks' results between denoising steps (diffusers' cache hooks): 'first_block' "
        "(FirstBlockCache), 'taylorseer' (TaylorSeerCache), 'mag' (MagCache, FLUX only) or 'off'; a "
        "request may choose another (params.step_cache); quality must be judged on real weights",
    )
    step_cache_threshold: float = option(
        0.0,
        "step_cache's threshold (first_block, mag: larger skips more) or interval in steps (taylorseer); "
        "0: the method's published default; a request may set its own (params.step_cache_threshold)",
    )
    enable_sleep: bool = option(
        True,
        "accept SleepStage/WakeUpStage (freeing device memory on demand); --no-enable-sleep makes them UNIMPLEMENTED",
    )
    sleep_host_buffer: str = option(
        "first_sleep",
        "when each worker prepares the host buffer a level-1 sleep copies the weights into "
        "(page-locked, the size of the weights the sleep manages): 'first_sleep' (the first level-1 sleep "
        "also faults its pages in and locks them: seconds per 20 GB), 'at_start' (before the worker "
        "reports ready, moving the weights once through it into one device allocation) or 'background' "
        "(on threads once the model is loaded, while the worker serves); "
        "prepared ahead, the first sleep copies at link speed and the buffer holds that host memory for "
        "the worker's life, and the checkpoint is also kept mapped and page-locked from the first level-2 "
        "sleep on (its page cache: the weights' size again), so level-2 wakes copy at link speed too",
        choices=SLEEP_HOST_BUFFERS,
    )
    warm_up: str = option(
        "auto",
        "run one small batch at the stage's default size (default_size, at most 2 denoising steps) in each worker "
        "before the stage reports ready, so the first request finds the kernels chosen, the allocator's "
        "pool filled and compiled code loaded: 'on', 'off', or 'auto' (on for a CUDA device); a warm-up that "
        "fails fails the start, naming why",
        choices=WARM_UPS,
    )
    read_ahead: bool = option(
        True,
        "each worker reads the weight files its stage loads into the page cache on background threads from "
        "its first moment, while it still imports torch and diffusers, so the load finds them cached (up to "
        "half the available memory); --no-read-ahead leaves all reading to the load",
    )
    lora_dir: str = option(
        "",
        "folder of LoRA adapters a stage holding a diffusers transformer registers at start (each "
        "NAME.safetensors file, or folder NAME holding one, as adapter NAME) and LoadAdapter reads from; "
        'empty: none at start, and LoadAdapter is refused (OPERATIONS.md, "LoRA adapters")',
    )
    max_device_adapters: int = option(
        0,
        "most LoRA adapters each worker keeps on its device; past it the least recently used move to "
        "host memory and come back when a request names them; 0: no bound",
    )
    hang_timeout_s: float = option(
        30.0,
        "a worker process silent this long (no heartbeat, which it sends every second even "
        "while a batch runs) is taken as hung (stopped, or stuck outside Python): it is killed, what it "
        "owed fails with UNAVAILABLE, and its group restarts",
    )
    max_queue: int = option(256, "requests waiting beyond this are refused with RESOURCE_EXHAUSTED")
    max_size: int | None = option(
        None,
        "largest width/height in pixels accepted; unset: the model's own bound (2048 for a diffusers folder, "
        "whose families publish sizes up to 1664 px, e.g. Qwen-Image's 1328 x 1328; 1024 for the embedded model)",
        type=int,
    )
    max_frames: int = option(
        81,
        "video models: most frames a video may have (num_frames above it is refused; the model's own rule, "
        "e.g. Wan's 4k + 1, applies below it)",
    )
    max_steps: int = option(100, "largest num_inference_steps accepted")
    max_prompt_bytes: int = option(2048, "longest prompt accepted, in UTF-8 bytes")
    default_size: int | None = option(
        None,
        "width/height used when a request leaves them unset; unset: the model's own (64 for the embedded "
        "trained model, a diffusers folder's pipeline default, e.g. 1024 for FLUX.1, else 256), at most max_size",
        type=int,
    )
    default_steps: int = option(8, "num_inference_steps used when a request leaves it unset")
    default_guidance: float = option(4.0, "guidance_scale used when a request leaves it unset")
    max_guidance: float = option(30.0, "largest guidance_scale accepted")
    metrics_port: int | None = option(None, metrics.PORT_HELP, type=metrics.port_argument)  # unset: off
    ready_file: str | None = option(
        None, "write {'address', 'pid'} (and 'metrics' with a metrics port) as JSON here once the port is bound"
    )
    tls_cert: str = option("", "serve TLS with this certificate chain (PEM); needs --tls-key; empty: plaintext")
    tls_key: str = option("", "private key (PEM) of --tls-cert")
    tls_ca: str = option("", "CA bundle (PEM) verifying the cache service when it serves TLS; empty: plaintext channel")
    health_port: int | None = option(None, tls.HEALTH_PORT_HELP, type=tls.health_port_argument)
    token_file: str = option(
        "",
        "file holding the bearer token that every StageService call must carry (health and reflection stay "
        "open), also sent to the cache service when publishing; empty: $STAGEMESH_TOKEN, or none",
    )

    def __post_init__(self) -> None:
        _check_kind(self.kind)  # first: the other checks' advice assumes a known kind
        _check_counts(self)
        _check_sleep_host_buffer(self)
        if self.warm_up not in WARM_UPS:
            raise ValueError(f"warm_up = {self.warm_up!r}: allowed: {', '.join(WARM_UPS)}")
        _check_defaults_within_limits(self)
        if (
            isinstance(self.max_device_adapters, bool)
            or not isinstance(self.max_device_adapters, int)
            or (self.max_device_adapters < 0)
        ):
            raise ValueError(
                f"max_device_adapters = {self.max_device_adapters!r}: allowed a whole number, 0 (no bound) or more"
            )
        super().__post_init__()  # refused DLO combinations fail at start, saying what to change
        acceleration.validate(self)
        if self.dp_size > 1 and self.workers not in (1, self.dp_size):
            raise ValueError(
                f"workers = {self.workers} with dp_size = {self.dp_size}: both count the stage's "
                f"data-parallel worker processes; set workers = {self.dp_size} (or leave it at 1)"
            )
        if self.dp_group_size() > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"device = {self.device!r} with enable_dlo, AllGather and dp_size = "
                f"{self.dp_size}: every DP rank needs its own GPU; use device = 'cuda' "
                "(rank i uses cuda:i)"
            )
        self._check_image_parallel()
        self._check_tp()
        if not self.hang_timeout_s >= HEARTBEAT_S * 2:
            raise ValueError(
                f"hang_timeout_s = {self.hang_timeout_s!r}: allowed {HEARTBEAT_S * 2:g} s or more (workers "
                f"send a heartbeat every {HEARTBEAT_S:g} s)"
            )
        metrics.check_port(self.metrics_port, "metrics_port")
        port = self.health_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"health_port = {port!r}: allowed 0 (a free port) to 65535, or unset for none")

    def _check_tp(self) -> None:
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        if self.kind != "diffusion":
            raise ValueError(
                f"tensor_parallel_size = {tp} on a {self.kind!r} stage: tensor "
                "parallelism covers the diffusion stage only; set it to 1"
            )
        if self.dp_size > 1:
            raise ValueError(
                f"tensor_parallel_size = {tp} with dp_size = {self.dp_size}: "
                "run more stage replicas instead, or set dp_size = 1"
            )
        if self.workers not in (1, tp):
            raise ValueError(
                f"workers = {self.workers} with tensor_parallel_size = {tp}: the "
                f"TP ranks are the workers; set workers = {tp} (or leave it at 1)"
            )
        if self.device.startswith("cuda:"):
            raise ValueError(
                f"device = {self.device!r} with tensor_parallel_size = {tp}: every "
                "TP rank needs its own GPU; use device = 'cuda' (rank i uses cuda:i)"
            )

    def _check_image_parallel(self) -> None:
        if self.image_parallel_size() == 1:
            return
        split = ((f"sp_size = {self.sp_size}", self.sp_size > 1), ("cfg_parallel = true", self.cfg_parallel))
        names = " and ".join(part for part, on in split if on)
        if self.kind not in IMAGE_PARALLEL_KINDS:
            raise ValueError(
                f"{names} on a {self.kind!r} stage: sequence and CFG parallelism split the denoising "
                f"stage ({' or '.join(map(repr, IMAGE_PARALLEL_KINDS))}); set sp_size = 1 and cfg_parallel = false"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"{names} with tensor_parallel_size = {self.tensor_parallel_size}: tensor parallelism does "
                "not combine with sequence or CFG parallelism; set tensor_parallel_size = 1, or sp_size = 1 "
                "and cfg_parallel = false"
            )
        if self.dp_size > 1:
            raise ValueError(
                f"{names} with dp_size = {self.dp_size}: every rank runs each request with the others "
                "(no DP waves); run more stage replicas instead, or set dp_size = 1"
            )
        world = self.image_parallel_size()
        if self.workers not in (1, world):
            raise ValueError(
                f"workers = {self.workers} with {names}: the stage's {world} ranks are its workers; "
                f"set workers = {world} (or leave it at 1)"
            )
        if self.device.startswith("cuda:"):
            raise ValueError(
                f"device = {self.device!r} with {names}: every rank needs its own GPU; use "
                "device = 'cuda' (rank i uses cuda:i)"
            )

    def compile_mode(self) -> str:
        """'regional' or 'off': compile with 'auto' resolved against the device and kind."""
        return acceleration.compile_mode(self)

    def image_parallel_size(self) -> int:
        """Ranks that split each image: sp_size per pass, two passes with cfg_parallel; 1: none."""
        return self.sp_size * (2 if self.cfg_parallel else 1)

    def dp_group_size(self) -> int:
        """Ranks of the stage's DP group (DLO AllGather on a diffusion stage); 1: no group."""
        grouped = self.kind == "diffusion" and DloOptions.from_settings(self).forms_dp_group
        return self.dp_size if grouped else 1

    def worker_processes(self) -> int:
        """dp_size data-parallel ranks are that many processes, with or without a DP group."""
        return max(self.workers, self.dp_size, self.tensor_parallel_size, self.image_parallel_size())

    def invariant_rows(self) -> int:
        """Requests per forward pass under batch_invariant: the stage's largest batch; 0 without it.
        Also for the ranks of a DP wave, though each runs one request: a pass of one row rounds
        differently from the max_batch_size rows a one-rank stage runs that request with."""
        return self.max_batch_size if self.batch_invariant else 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        dlo = {f.name for f in fields(DloOptions)}
        # The stage's own options first in --help, then the offload ones.
        options.add_arguments(parser, sorted(fields(cls), key=lambda f: f.name in dlo), show_default=True)
        parser.add_argument(
            "--dlo-no-use-allgather",
            dest="dlo_use_allgather",
            action="store_false",
            default=argparse.SUPPRESS,
            help="same as --no-dlo-use-allgather",
        )
        parser.add_argument("--log-level", default="info", choices=logs.LOG_LEVELS, help="log level (default: 'info')")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StageSettings:
        try:
            return cls(**options.values(cls, args))
        except ValueError as exc:  # a refused combination: say what to change, no traceback
            print(f"stagemesh stage: error: {envflags.explain(str(exc))}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None  # a usage error, as argparse's own

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> StageSettings:
        known = options.mesh_keys(cls)
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown stage option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_flags(self) -> list[str]:
        return options.to_flags(self)

    def limits(self, runner_limits: dict[str, Any] | None = None) -> Limits:
        runner_limits = runner_limits or {}
        return Limits(
            pixel_multiple=int(runner_limits.get("pixel_multiple", 16)),
            max_pixels_side=self.largest_size(runner_limits),
            max_inference_steps=self.max_steps,
            max_prompt_bytes=min(
                self.max_prompt_bytes, int(runner_limits.get("max_prompt_bytes", self.max_prompt_bytes))
            ),
            default_size=self._default_size(runner_limits),
            default_inference_steps=self.default_steps,
            default_guidance_scale=self.default_guidance,
            max_guidance_scale=self.max_guidance,
            # A runner that declares none offers no step cache.
            step_caches=tuple(runner_limits.get("step_caches", ("off",))),
            # An image-to-video or an edit model: it cannot draw without init_image.
            requires_init_image=bool(runner_limits.get("requires_init_image", False)),
            **_video_limits(runner_limits, self.max_frames),
        )

    def largest_size(self, runner_limits: dict[str, Any]) -> int:
        """max_size, else the runner's own bound (runner_limits' max_size), else 1024."""
        return self.max_size if self.max_size is not None else int(runner_limits.get("max_size", DEFAULT_MAX_SIZE))

    def _default_size(self, runner_limits: dict[str, Any]) -> int:
        """The size set, else the model's own (where it was trained), capped at max_size and
        rounded down to the pixel multiple."""
        if self.default_size is not None:
            return self.default_size
        multiple = int(runner_limits.get("pixel_multiple", 16))
        size = min(int(runner_limits.get("native_size", FALLBACK_SIZE)), self.largest_size(runner_limits))
        return max(multiple, size - size % multiple)


def _video_limits(runner_limits: dict[str, Any], max_frames: int) -> dict[str, Any]:
    """A video model's frame rule (runner_limits' frame_step, default_num_frames, default_fps)
    capped by max_frames: the largest count it takes at or below both; {} for an image model."""
    step = int(runner_limits.get("frame_step", 0))
    if not step:
        return {}
    top = (max_frames - 1) // step * step + 1
    default = int(runner_limits.get("default_num_frames", top))
    return {
        "frame_step": step,
        "max_num_frames": top,
        "default_num_frames": min(default, top),
        "default_fps": int(runner_limits.get("default_fps", 16)),
    }


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}: not a stage kind; allowed: {', '.join(KINDS)}")


def _check_sleep_host_buffer(settings: StageSettings) -> None:
    mode = settings.sleep_host_buffer
    if mode not in SLEEP_HOST_BUFFERS:
        raise ValueError(f"sleep_host_buffer = {mode!r}: allowed: {', '.join(SLEEP_HOST_BUFFERS)}")
    if mode != "first_sleep" and not settings.enable_sleep:
        raise ValueError(
            f"sleep_host_buffer = {mode!r} with enable_sleep = false: it would hold host memory for a "
            "sleep that never comes; enable sleep or leave sleep_host_buffer at 'first_sleep'"
        )


# Options that count something and mean nothing below 1.
_AT_LEAST_ONE = (
    "workers",
    "sp_size",
    "max_batch_size",
    "max_size",
    "max_frames",
    "max_steps",
    "default_size",
    "default_steps",
)


def _check_counts(settings: StageSettings) -> None:
    for name in _AT_LEAST_ONE:
        value = getattr(settings, name)
        if value is None and name in ("default_size", "max_size"):
            continue  # unset: the model's own
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be a whole number of at least 1")


def _check_defaults_within_limits(settings: StageSettings) -> None:
    """A default above its limit would refuse every request that leaves the field unset."""
    for default, limit in (
        ("default_size", "max_size"),
        ("default_steps", "max_steps"),
        ("default_guidance", "max_guidance"),
    ):
        value, top = getattr(settings, default), getattr(settings, limit)
        if value is not None and top is not None and value > top:
            raise ValueError(
                f"{default} = {getattr(settings, default)!r} is above {limit} = {getattr(settings, limit)!r}: "
                f"every request leaving it unset would be refused; lower {default} or raise {limit}"
            )

"""Client commands of the CLI, over stagemesh.Client: `stagemesh generate` (with a progress bar),
`status`, `sleep`, `wakeup`, `pause`, `resume` and `adapters`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from stagemesh.client.channel import ADDRESS_ENV, DEFAULT_ADDRESS, default_address
from stagemesh.client.errors import CallError
from stagemesh.client.results import ControlResult, DenoisingStep, ProgressEvent, StageStarted
from stagemesh.client.sync import Client
from stagemesh.core import auth

__all__ = [
    "ADDRESS_ENV",
    "DEFAULT_ADDRESS",
    "adapters",
    "default_address",
    "generate",
    "pause",
    "resume",
    "sleep",
    "status",
]


def _client(args, *, control: bool = False) -> Client:
    """--address, --tls-ca (else $STAGEMESH_TLS_CA), --timeout; a control command's --token-file
    (else the client's own $STAGEMESH_TOKEN_FILE / $STAGEMESH_TOKEN); generate's and status's
    --api-key-file (else $STAGEMESH_API_KEY)."""
    token = auth.load_token(args.token_file) if control and args.token_file else None
    key_file = getattr(args, "api_key_file", None)
    api_key = auth.read_secret_file(key_file, "--api-key-file", "API key") if key_file else None
    return Client(args.address, tls_ca=args.tls_ca, token=token, api_key=api_key, timeout=args.timeout)


def _progress_bar(step: int, total: int, width: int = 30) -> str:
    filled = width * step // max(total, 1)
    return f"\r  denoising [{'#' * filled}{'.' * (width - filled)}] {step}/{total}"


def _print_progress(event: ProgressEvent) -> None:
    if isinstance(event, StageStarted):
        print(f"stage {event.stage_id} ({event.kind}) started", file=sys.stderr, flush=True)
    elif isinstance(event, DenoisingStep):
        end = "\n" if event.step == event.total else ""
        print(_progress_bar(event.step, event.total), end=end, file=sys.stderr, flush=True)


def _output_problem(path: Path) -> str | None:
    """Why the PNG could not be written there, asked before generating rather than after."""
    folder = path.parent
    if not folder.is_dir():
        return f"-o {path}: the folder {folder} does not exist"
    if path.is_dir():
        return f"-o {path}: is a folder; give a file name"
    if not os.access(folder, os.W_OK):
        return f"-o {path}: the folder {folder} is not writable"
    return None


def generate(args) -> int:
    if args.output is None:
        args.output = "out.mp4" if args.video else "out.png"
    problem = _output_problem(Path(args.output)) or _video_problem(args)
    if problem:
        print(f"stagemesh generate: {problem}", file=sys.stderr)
        return 2
    shared = {
        "width": args.width if args.width is not None else args.size,
        "height": args.height if args.height is not None else args.size,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "seed": args.seed,
        "negative_prompt": args.negative_prompt,
        "init_image": args.init_image,
    }
    with _client(args) as client:
        try:
            if args.video:
                result = client.generate_video(
                    args.prompt,
                    num_frames=args.frames,
                    fps=args.fps,
                    output_format="webp" if Path(args.output).suffix.lower() == ".webp" else "mp4",
                    on_progress=_print_progress,
                    **shared,
                )
            else:
                result = client.generate(
                    args.prompt, strength=args.strength, adapters=args.adapter, on_progress=_print_progress, **shared
                )
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1
    Path(args.output).write_bytes(result.bytes)
    frames = f", {result.num_frames} frames at {result.fps} fps" if result.num_frames else ""
    print(
        f"wrote {args.output} ({result.width}x{result.height}{frames}, seed {result.seed}, request {result.request_id})"
    )
    return 0


def _video_problem(args) -> str | None:
    """Video options without --video, or what a video cannot take."""
    if not args.video:
        given = [flag for flag, value in (("--frames", args.frames), ("--fps", args.fps)) if value is not None]
        return f"{', '.join(given)} need --video" if given else None
    if args.strength is not None:
        return "--strength is image-to-image's; a video starts from --init-image as its first frame"
    if args.adapter:
        return "--adapter applies to images; video models take no LoRA adapters yet"
    if Path(args.output).suffix.lower() not in (".mp4", ".webp"):
        return f"-o {args.output}: a video is written as .mp4 or .webp"
    return None


def status(args) -> int:
    with _client(args) as client:
        try:
            listing = client.list_stages()
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1
    print(f"{'stage':>5}  {'kind':<10} {'state':<12} {'replicas':>8}  {'device':<8} {'device memory':>14}")
    for s in listing:
        print(
            f"{s.stage_id:>5}  {s.kind:<10} {s.state.value:<12} {s.replicas:>8}  "
            f"{s.device or '-':<8} {s.device_memory_bytes / 2**20:>11.1f} MiB"
            + (f"  (sleep level {s.sleep_level})" if s.sleep_level else "")
        )
    print(f"generation: {'paused' if listing.generation_paused else 'open'}")
    return 0


def _print_control(result: ControlResult) -> int:
    reason = f" ({result.reason})" if result.reason else ""
    print(f"{result.status.name}{reason}")
    for ack in result.acks:
        line = (
            f"  stage {ack.stage_id} rank {ack.rank}: {'SUCCESS' if ack.ok else 'ERROR'} level {ack.level} "
            f"{ack.freed_bytes / 2**20:.1f} MiB in {ack.latency_ms:.1f} ms"
        )
        print(line + (f" ({ack.error})" if ack.error else ""))
    return 0 if result.ok else 1


def _stages(args) -> list[int] | None:
    """--stage ids, or None for --all (every stage the gateway lists)."""
    return None if args.all else list(args.stage)


def sleep(args) -> int:
    with _client(args, control=True) as client:
        try:
            level = args.level if args.level is not None else 2
            return _print_control(client.sleep(_stages(args), level))
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1


def wakeup(args) -> int:
    with _client(args, control=True) as client:
        try:
            return _print_control(client.wake_up(_stages(args)))
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1


def pause(args) -> int:
    with _client(args, control=True) as client:
        try:
            client.pause()
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1
    print("ok")
    return 0


def resume(args) -> int:
    with _client(args, control=True) as client:
        try:
            client.resume()
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1
    print("ok")
    return 0


def _print_adapters(infos) -> None:
    for a in infos:
        place = "on device" if a.on_device else "in host memory"
        print(
            f"{a.name}  stage {a.stage_id} rank {a.rank}  {a.bytes / 2**20:.1f} MiB {place}  "
            f"{a.layers} layers  {a.source}"
        )


def adapters(args) -> int:
    """No option lists them; --load NAME=PATH or --unload NAME changes them."""
    with _client(args, control=True) as client:
        try:
            if args.load is not None:
                name, sep, path = args.load.partition("=")
                if not sep:
                    print(f"stagemesh adapters: --load {args.load!r}: expected NAME=PATH", file=sys.stderr)
                    return 2
                _print_adapters(client.load_adapter(name, path))
            elif args.unload is not None:
                stages = client.unload_adapter(args.unload)
                print(f"unloaded {args.unload} from stage(s) {', '.join(map(str, stages))}")
            else:
                _print_adapters(client.list_adapters())
        except CallError as exc:
            print(exc.describe(), file=sys.stderr)
            return 1
    return 0

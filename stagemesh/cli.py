"""The `stagemesh` command: run a mesh or one service, or talk to a running gateway."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys


def _parser() -> argparse.ArgumentParser:
    # Only light modules here: client commands must not pay for importing torch.
    from stagemesh.cache_service import server as cache_server
    from stagemesh.client import commands as client
    from stagemesh.core import envflags, logs
    from stagemesh.gateway.settings import GatewaySettings
    from stagemesh.stage_service.settings import StageSettings

    parser = envflags.EnvParser(prog="stagemesh", description=__doc__)
    parser.add_argument("--version", action="version", version=f"stagemesh {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start cache, stages and gateway on this machine and supervise them")
    up.add_argument("--config", default=None, help="mesh.toml (default: the embedded two-stage pipeline)")
    up.add_argument("--log-level", default=None, choices=logs.LOG_LEVELS, help="overrides [mesh] log_level")
    up.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="serve a diffusers-format folder (model_index.json): an encoder stage and a "
        "diffusion stage over it; with --config, stage tables without model_dir use it",
    )
    envflags.read_environment(up)

    _add_synthesize(sub)

    for name, add_arguments, main_module, text in (
        ("gateway", GatewaySettings.add_arguments, "stagemesh.gateway.server", "run the public gateway service alone"),
        ("stage", StageSettings.add_arguments, "stagemesh.stage_service.entry", "run one stage service alone"),
        (
            "cache",
            cache_server.add_arguments,
            "stagemesh.cache_service.server",
            "run the node-local cache alone",
        ),
    ):
        p = sub.add_parser(name, help=text)
        add_arguments(p)
        envflags.read_environment(p)  # STAGEMESH_* for every flag, those added later included
        p.set_defaults(service_main=main_module)

    for name, text in (
        ("generate", "generate one image (or with --video one video) through a gateway"),
        ("status", "list the stages behind a gateway and their state"),
        ("sleep", "put stages to sleep (free their device memory)"),
        ("wakeup", "wake sleeping stages"),
        ("pause", "stop admitting Generate calls"),
        ("resume", "admit Generate calls again"),
        ("adapters", "list, load or unload the LoRA adapters of the stages holding the transformer"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--address",
            default=client.default_address(),
            help=f"gateway address (default: ${client.ADDRESS_ENV} or {client.DEFAULT_ADDRESS})",
        )
        p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds (default: 600)")
        p.add_argument(
            "--tls-ca",
            default=None,
            metavar="PEM",
            help="CA bundle that verifies a gateway serving TLS (default: $STAGEMESH_TLS_CA; neither: plaintext)",
        )
        if name in ("sleep", "wakeup", "pause", "resume", "adapters"):
            p.add_argument(
                "--token-file",
                default=None,
                metavar="PATH",
                help="file holding the bearer token for control calls (default: $STAGEMESH_TOKEN_FILE, else "
                "$STAGEMESH_TOKEN)",
            )
        else:
            p.add_argument(
                "--api-key-file",
                default=None,
                metavar="PATH",
                help="file holding the API key of a gateway started with --api-key-file "
                "(default: $STAGEMESH_API_KEY; neither: none sent)",
            )
        p.set_defaults(client_main=getattr(client, name))
        if name in ("sleep", "wakeup"):
            targets = p.add_mutually_exclusive_group(required=True)
            targets.add_argument(
                "--stage", type=int, action="append", default=[], help="stage id; repeat for several stages"
            )
            targets.add_argument("--all", action="store_true", help="every stage the gateway lists")
        if name == "adapters":
            change = p.add_mutually_exclusive_group()
            change.add_argument(
                "--load",
                metavar="NAME=PATH",
                default=None,
                help="load adapter NAME from PATH, inside each stage's lora_dir (default: list them)",
            )
            change.add_argument("--unload", metavar="NAME", default=None, help="drop adapter NAME everywhere")
        if name == "sleep":
            p.add_argument(
                "--level",
                type=int,
                default=None,
                help="1: keep weights in host memory; 2 (default): discard them, reload on wake",
            )
        if name == "generate":
            p.add_argument("prompt", help="the text prompt")
            p.add_argument("--size", type=int, default=None, help="width and height in pixels (default: the stage's)")
            p.add_argument("--width", type=int, default=None, help="overrides --size for the width")
            p.add_argument("--height", type=int, default=None, help="overrides --size for the height")
            p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the stage's)")
            p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the stage's)")
            p.add_argument("--seed", type=_seed, default=None, help=f"seed, 0 to {MAX_SEED} (default: random, printed)")
            p.add_argument("--negative-prompt", default=None, help="what to steer away from (models with guidance)")
            p.add_argument(
                "--init-image",
                default=None,
                metavar="FILE",
                help="image file to start from (image-to-image; with --video, an image-to-video model's first frame)",
            )
            p.add_argument(
                "--strength",
                type=float,
                default=None,
                help="with --init-image: how far from it to go, above 0 and at most 1 (default: the model's)",
            )
            p.add_argument(
                "--adapter",
                action="append",
                type=_adapter,
                default=None,
                metavar="NAME[=SCALE]",
                help="a LoRA adapter the stages hold, at SCALE (default 1.0); repeat for several",
            )
            p.add_argument(
                "-o", "--output", default=None, help="file to write (default: out.png; with --video, out.mp4)"
            )
            p.add_argument(
                "--video",
                action="store_true",
                help="generate a video (a video model): -o's suffix picks MP4 (.mp4) or animated WebP (.webp)",
            )
            p.add_argument("--frames", type=int, default=None, help="--video: frames (default: the model's)")
            p.add_argument("--fps", type=int, default=None, help="--video: frames per second (default: the model's)")
    return parser


# The families `stagemesh synthesize` writes (the diffusers adapter's synthetic.TINY_FAMILIES,
# named here since the parser imports nothing that needs torch).
SYNTHETIC_FAMILIES = (
    "flux",
    "sd3",
    "zimage",
    "qwen-image",
    "qwen-image-edit",
    "flux2-klein",
    "wan",
    "wan-i2v",
    "flux2",
)


def _add_synthesize(sub) -> None:
    p = sub.add_parser(
        "synthesize", help="write a diffusers-format folder of a model family with random weights (no download)"
    )
    p.add_argument("--family", required=True, choices=SYNTHETIC_FAMILIES, help="the model family")
    p.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "full"),
        help="tiny: shrunk configs for CPU smoke tests (default); full: the published dimensions",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="with --size full: the weights' dtype (default: bfloat16)",
    )
    p.add_argument(
        "--text-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --size full: keep at most N layers of each text encoder (their width stays)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("out", help="the folder to write (new or empty)")
    p.set_defaults(synthesize=True)


MAX_SEED = 2**64 - 1  # GenerationParams.seed is a uint64


def _adapter(text: str) -> tuple[str, float]:
    name, _, scale = text.partition("=")
    try:
        return name, float(scale) if scale else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME or NAME=SCALE (a number)") from None


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed; allowed: whole numbers from 0 to {MAX_SEED}")
    return value


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("stagemesh")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


# What `stagemesh stage` (and `up`, which starts stages) needs beyond the base install.
STAGE_EXTRA = ("torch", "safetensors")


def _missing_stage_extra() -> str | None:
    for name in STAGE_EXTRA:
        try:
            found = importlib.util.find_spec(name)
        except ImportError:  # a broken installation is as good as none
            found = None
        if found is None:
            return name
    return None


def _service_variables() -> frozenset[str]:
    """The STAGEMESH_* variables of the service commands' flags, which `up` keeps from its
    children, except STAGEMESH_MODEL_DIR: as before these variables existed, it names the folder
    of the embedded model for stages whose table names none."""
    from stagemesh.core import envflags

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = {name for command in ("gateway", "stage", "cache") for _, name in envflags.bindings(sub.choices[command])}
    return frozenset(names - {envflags.PREFIX + "MODEL_DIR"})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("up", "stage") and (missing := _missing_stage_extra()) is not None:
        print(
            f"stagemesh {args.command}: {missing} is not installed; a stage service needs the stage "
            "extra: pip install 'stagemesh[stage]'",
            file=sys.stderr,
        )
        return 2
    if args.command == "up":
        from stagemesh import launcher

        return launcher.main(args.config, args.log_level, args.model, unset_env=_service_variables())
    if getattr(args, "synthesize", False):
        if (missing := _missing_stage_extra()) is not None:
            print(
                f"stagemesh synthesize: {missing} is not installed: pip install 'stagemesh[diffusers]'", file=sys.stderr
            )
            return 2
        from stagemesh.stage_service.models.diffusers_adapter.synthetic.command import synthesize

        return synthesize(args)
    if hasattr(args, "service_main"):
        importlib.import_module(args.service_main).main(args)
        return 0
    from stagemesh.core import errors

    try:
        return args.client_main(args)
    except errors.StagemeshError as exc:  # an unreadable --tls-ca or --token-file
        print(f"stagemesh {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

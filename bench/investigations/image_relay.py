"""What the mesh does to one FLUX image beyond what diffusers' own pipeline does, piece by piece,
on the host: the serialisation and parsing of the stage outputs the gateway relays (the encoder's
embeddings to the diffusion stage, the image to the gateway), and the image's conversion to
pixels, with the image sent as float32 (before) and as uint8 pixels (now, for PNG/JPEG/WebP).

Both sides encode the same PNG (gateway.images.encode_png), which is therefore printed for scale
but is no part of the difference (the pixels path's PNG is checked to be the same bytes). The
gRPC transfers themselves and the worker's shared-memory hand-off are not in here
(bench/mesh_overhead.py and bench/investigations/output_send.py measure those).
Run: python -m bench.investigations.image_relay [--size 1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.core import codec
from stagemesh.gateway.images import encode_png, to_uint8
from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import stage_pb2

# FLUX.1's encoder outputs: T5 at 512 tokens x 4096, CLIP's pooled 768, in bf16.
EMBEDDINGS = {"prompt_embeds": (512, 4096), "pooled_prompt_embeds": (768,)}


def _ms(run: Callable[[], object], repeats: int) -> float:
    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e3


def _response(outputs: dict[str, torch.Tensor]) -> bytes:
    protos = {name: tensors.to_proto(t) for name, t in outputs.items()}
    return stage_pb2.ExecuteResponse(outputs=stage_pb2.StageOutputs(outputs=protos)).SerializeToString()


def image_path(image: torch.Tensor, as_pixels: bool, png: bool = False) -> Callable[[], object]:
    """The stage's encoding of its image reply, the gateway's parse and conversion to pixels
    (and with `png`, the gateway's PNG)."""

    def run() -> object:
        sent = tensors.image_pixels(image) if as_pixels else image
        reply = stage_pb2.ExecuteResponse.FromString(_response({"image": sent}))
        pixels = to_uint8(codec.to_array(reply.outputs.outputs["image"], "image"))
        return encode_png(pixels) if png else pixels

    return run


def embeddings_relay(embeds: dict[str, torch.Tensor]) -> Callable[[], object]:
    """Encoder reply -> gateway parse -> request to the diffusion stage -> its parse and tensors."""

    def run() -> object:
        reply = stage_pb2.ExecuteResponse.FromString(_response(embeds))
        request = stage_pb2.ExecuteRequest(inputs=dict(reply.outputs.outputs)).SerializeToString()
        parsed = stage_pb2.ExecuteRequest.FromString(request)
        return {name: tensors.from_proto(t) for name, t in parsed.inputs.items()}

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="image width and height (default: 1024)")
    add_repeats(parser, 5, "timed runs of each piece (default: 5)")
    add_output(parser, "image_relay")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    image = torch.rand(args.size, args.size, 3)
    embeds = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in EMBEDDINGS.items()}
    png = encode_png(image.numpy())
    assert image_path(image, True, png=True)() == png, "the pixels path must give the same PNG"
    figures = {
        "PNG encoding (both sides)": _ms(lambda: encode_png(image.numpy()), args.repeats),
        "float to pixels on the host (gateway.images.to_uint8)": _ms(lambda: to_uint8(image.numpy()), args.repeats),
        "image reply, float32: encode, parse, to pixels": _ms(image_path(image, False), args.repeats),
        "image reply, uint8: to pixels, encode, parse": _ms(image_path(image, True), args.repeats),
        "embeddings relayed encoder -> gateway -> diffusion": _ms(embeddings_relay(embeds), args.repeats),
    }
    print_table(["piece", "ms"], list(figures.items()), ".2f")
    write_json(args.output, "image_relay", {"size": args.size, "repeats": args.repeats, "ms": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the mesh does to one video's frames beyond what diffusers' own pipeline does, piece by
piece, on the host: the worker's shared-memory hand-off (ipc.Packer into its pool, the stage
service's unpack), the stage's outputs as Execute messages (server._encode_outputs: the proto, its
pieces under gRPC's message bound), their serialisation and parsing (gRPC's part, without the
socket), the gateway joining the pieces and turning them into MP4 bytes (Pipeline._result). The
frames travel as float32 (before: the pipeline's output_type="np") and as uint8 pixels (now: made
on the worker's device, transport.tensors.encoded_form; the float32 route is the tensor format's,
the gateway quantising). "beyond peer": the route's pieces less the quantisation the peer does
itself (gateway.images.to_uint8 inside encode_video). The MP4 encoding, the same on both sides,
is left out; the route's MP4 is checked to be the peer's bytes.
Run: python -m bench.investigations.video_relay [--size 832x480 --frames 17]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.core import codec
from stagemesh.core.params import Params
from stagemesh.gateway.images import to_uint8
from stagemesh.gateway.pipeline import _join_outputs
from stagemesh.gateway.videos import encode_mp4, encode_video
from stagemesh.stage_service import server
from stagemesh.stage_service.transport import ipc, tensors
from stagemesh.v1 import stage_pb2


class _Stage:
    name = "stage 1"


def _ms(run: Callable[[], object], repeats: int) -> float:
    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e3


def route(frames: torch.Tensor, params: Params, repeats: int, packer: ipc.Packer) -> tuple[dict, bytes]:
    """Each piece's mean ms over `repeats`, and the MP4 the route ends in."""
    sent = tensors.encoded_form({"video": frames}, params.output_format)
    held = {}

    def hand_off():
        held["outputs"] = ipc.unpack(packer.pack([sent]))[0]

    def encode():
        held["messages"] = server._encode_outputs(held["outputs"], params.output_format)

    def wire():
        blobs = [stage_pb2.ExecuteResponse(outputs=m).SerializeToString() for m in held["messages"]]
        held["parsed"] = [stage_pb2.ExecuteResponse.FromString(b) for b in blobs]

    def gateway():
        joined: dict = {}
        for response in held["parsed"]:
            _join_outputs(joined, response.outputs, _Stage())
        held["pixels"] = to_uint8(codec.to_array(joined["video"], "video"))

    pieces = {
        "quantise (worker)": _ms(lambda: tensors.encoded_form({"video": frames}, params.output_format), repeats),
        "shm hand-off": _ms(hand_off, repeats),
        "encode outputs": _ms(encode, repeats),
        "serialise + parse": _ms(wire, repeats),
        "join + pixels (gateway)": _ms(gateway, repeats),
    }
    return pieces, encode_mp4(held["pixels"], params.fps, params.quality)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="832x480", help="WIDTHxHEIGHT (default: 832x480)")
    p.add_argument("--frames", type=int, default=17, help="frames (default: 17)")
    add_repeats(p, 5, "passes per piece (default: 5)")
    add_output(p, "video-relay")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    torch.set_num_threads(1)  # as a CPU stage's worker
    frames = torch.rand(args.frames, height, width, 3, generator=torch.Generator().manual_seed(0))
    params = Params("p", width, height, 10, 5.0, 1, "mp4", num_frames=args.frames, fps=24)
    peer_ms = _ms(lambda: to_uint8(frames.numpy()), args.repeats)  # what the peer does before MP4
    want = encode_video(frames.numpy(), "mp4", 24, params.quality)
    packer = ipc.Packer(os.getpid(), 0, pool_slots=ipc.WORKER_POOL_SLOTS)
    rows, results = [], {"peer_pixels_ms": peer_ms}
    as_tensor = dataclasses.replace(params, output_format="tensor")
    try:
        for name, sent_as in (("float32 (before)", as_tensor), ("uint8 (now)", params)):
            pieces, mp4 = route(frames, sent_as, args.repeats, packer)
            assert mp4 == want, f"{name}: the route's MP4 differs from the peer's"
            rows.append((name, *pieces.values(), sum(pieces.values()) - peer_ms))
            results[name] = pieces
    finally:
        packer.close()
    headers = ["frames as", "quantise", "shm", "encode outputs", "serialise+parse", "join+pixels", "beyond peer"]
    print(f"{args.frames} frames at {width}x{height}; the peer's quantisation (to_uint8): {peer_ms:.1f} ms")
    print_table(headers, rows, ".1f")
    write_json(args.output, "video_relay", {"settings": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

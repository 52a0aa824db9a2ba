"""What sending one batch of outputs costs the worker process, by path.

The worker's output thread packs a batch's images and sends them to the executor while the
main thread launches the next forward pass; whatever CPU the sending takes in the worker process
(any of its threads) is time the launching thread may wait for the GIL. This measures that CPU
per batch — process CPU time, so a queue's feeder thread counts too — for one batch of images
(default: four 256² float32 images, 786 KB each, 3.1 MB together) sent as:

  inline, queue        pickled into a multiprocessing.Queue (the result channel before ce58483)
  inline, pipe         pickled into the worker's result pipe (stage_service/result_pipe.py)
  slots, N             packed into the worker's reusable shared-memory slots, N of them
  one-shot segments    a new shared-memory segment per image
  ..., strided         the same from channels-first images seen channels-last (a permuted
                       view, as the DiT returned them before 020838b): each needs a gather

Batches go out one every `--interval-ms`, as forward passes end (the sleeps are not CPU). A
reader process unpacks every message and keeps the last `--held` batches alive, as a stage whose
consumers lag does; slots whose outputs are still held cannot be reused, so a pool smaller than
what is held falls back to one-shot segments. Run: python -m bench.investigations.output_send
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch

from bench.common import add_output, print_table, write_json
from stagemesh.stage_service.transport import ipc, protocol
from stagemesh.stage_service.transport.result_pipe import result_pipe


def _read(channel, held: int, ready) -> None:
    """Reader process: unpack each batch, keep the last `held` alive, stop at None."""
    ready.set()  # imports done: from here on it keeps up, as the executor's pump does
    alive: list = []
    while (msg := channel.get()) is not None:
        alive.append(ipc.unpack(msg.payload))
        del alive[:-held]


def _send_all(channel, packer: ipc.Packer, images: list[torch.Tensor], batches: int, interval_s: float) -> float:
    """Process CPU seconds per batch of packing and sending `images` `batches` times."""
    start = time.process_time()
    for i in range(batches):
        payload = packer.pack([{"image": img} for img in images])
        channel.put(protocol.OutputReady(f"{i:032x}", payload=payload))
        time.sleep(interval_s)
    return (time.process_time() - start) / batches


def measure(args, ctx, path: str, slots: int) -> float:
    if path.endswith("strided"):
        batch = torch.rand(args.batch, 3, args.size, args.size).permute(0, 2, 3, 1)
    else:
        batch = torch.rand(args.batch, args.size, args.size, 3)  # never zeros
    # Inline: each image its own storage (under the threshold); otherwise the batch's slices.
    images = [img.clone() for img in batch] if path.startswith("inline") else list(batch)
    if path == "inline, queue":
        reader = writer = ctx.Queue()
    else:
        reader, writer = result_pipe(ctx)
    ready = ctx.Event()
    proc = ctx.Process(target=_read, args=(reader, args.held, ready), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise RuntimeError("the reader process did not start")
    packer = ipc.Packer(os.getpid(), 0, pool_slots=slots)
    try:
        interval = args.interval_ms / 1e3
        _send_all(writer, packer, images, args.held + 2, interval)  # warm-up: slots, pages
        seconds = _send_all(writer, packer, images, args.batches, interval)
        writer.put(None)
        proc.join(60)
    finally:
        proc.kill()
        packer.close()
        ipc.sweep(os.getpid())
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--held", type=int, default=2, help="batches the reader keeps alive")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument(
        "--interval-ms", type=float, default=10.0, help="time between batches (a forward pass of 4 × 256² takes ~30 ms)"
    )
    add_output(parser, "output_send")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    cases = [
        ("inline, queue", 0),
        ("inline, pipe", 0),
        ("slots", 8),
        ("slots", 8, "strided"),
        ("slots", ipc.WORKER_POOL_SLOTS),
        ("one-shot segments", 0),
    ]
    rows, results = [], []
    for path, slots, *how in cases:
        label = ", ".join([path, *([str(slots)] if path == "slots" else []), *how])
        ms = measure(args, ctx, label, slots) * 1e3
        results.append({"path": label, "cpu_ms_per_batch": ms})
        rows.append([label, ms])
    print(
        f"{args.batch} images of {args.size}² float32 per batch, one every {args.interval_ms} ms, "
        f"reader holds {args.held} batches"
    )
    print_table(["path", "worker CPU ms / batch"], rows, floatfmt=".2f")
    path = write_json(
        args.output,
        "output_send",
        {
            "size": args.size,
            "batch": args.batch,
            "held": args.held,
            "interval_ms": args.interval_ms,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

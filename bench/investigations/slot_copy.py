"""What filling the output slots costs the async output thread while the main thread launches.

At 256²/batch 4 the async output thread copies four 786 KB images from the pinned batch buffer
into four 1 MiB shared-memory slots. Traced inside the serving worker on the H200 that took
30-40 ms of the thread's wall time (20 ms of its CPU), so each output left a forward pass late.
This reproduces it in one process: the main thread runs the default DiT's forward pass back to
back (or idles) while a second thread copies the four slices into four mappings, with:

  torch copy   a torch `copy_` into a `frombuffer` view (the old path; torch may split it over
               its intra-op threads)
  memmove      one `ctypes.memmove` (single-threaded, the GIL released; the shipped path,
               `shm_pool.copy_into`)

from a pinned source (what the output path copies from) and a pageable one, and the torch copy
once more with `torch.set_num_threads(1)`. Reports the median wall and CPU time of the four
copies. Run on a GPU: python -m bench.investigations.slot_copy
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from bench.serving import Forward
from stagemesh.stage_service import platform
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.transport.shm_pool import HEADER_BYTES, copy_into
from stagemesh.stage_service.transport.tensors import host_bytes
from stagemesh.stage_service.worker.async_output import copy_to_host


def torch_copy(mapping: mmap.mmap, raw: torch.Tensor) -> None:
    view = torch.frombuffer(mapping, dtype=torch.uint8, count=raw.numel(), offset=HEADER_BYTES)
    view.copy_(raw)
    del view


def memmove(mapping: mmap.mmap, raw: torch.Tensor) -> None:
    copy_into(mapping, HEADER_BYTES, raw)


def host_slices(device: str, size: int, batch: int, pinned: bool) -> list[torch.Tensor]:
    images = torch.rand(batch, size, size, 3, device=device)
    if pinned:  # as the output path does: one copy of the batch storage, slices are views of it
        stream = platform.Stream(device)
        with stream.active():
            host = copy_to_host(list(images.unbind()), stream)
        stream.synchronize()
    else:
        host = list(images.cpu().unbind())
    return [host_bytes(h) for h in host]


def measure(forward: Forward | None, copy, pinned: bool, args) -> dict:
    slots = [mmap.mmap(-1, HEADER_BYTES + args.size * args.size * 3 * 4) for _ in range(args.batch)]
    stop = threading.Event()

    def launch() -> None:
        while not stop.is_set():
            forward.runner.run(forward.items)

    launcher = threading.Thread(target=launch) if forward is not None else None
    if launcher is not None:
        launcher.start()
        time.sleep(0.2)
    walls, cpus = [], []
    try:
        for _ in range(args.repeats):
            raws = host_slices(args.device, args.size, args.batch, pinned)
            wall, cpu = time.perf_counter(), time.thread_time()
            for mapping, raw in zip(slots, raws):
                copy(mapping, raw)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
            assert bytes(slots[-1][HEADER_BYTES : HEADER_BYTES + 64]) == raws[-1][:64].numpy().tobytes()
            time.sleep(0.01)
    finally:
        stop.set()
        if launcher is not None:
            launcher.join()
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "cpu_ms": statistics.median(cpus) * 1e3,
        "max_wall_ms": max(walls) * 1e3,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    add_repeats(parser, 30, "copies of the slices per case; figures are medians (default: 30)")
    add_output(parser, "slot_copy")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    # The eager forward: a launching thread that never blocks, as without step graphs.
    forward = Forward(model_dir, args.device, args.size, args.batch, 8, cuda_graphs=False)
    cases = [
        (main_thread, source, copy.__name__.replace("_", " "), copy)
        for main_thread in ("idle", "launching")
        for source in ("pinned", "pageable")
        for copy in (torch_copy, memmove)
    ]
    rows, results = [], []
    threads = torch.get_num_threads()
    for main_thread, source, name, copy in cases:
        r = measure(forward if main_thread == "launching" else None, copy, source == "pinned", args)
        results.append({"main_thread": main_thread, "source": source, "copy": name, "threads": threads, **r})
    torch.set_num_threads(1)
    for source in ("pinned", "pageable"):
        r = measure(forward, torch_copy, source == "pinned", args)
        results.append({"main_thread": "launching", "source": source, "copy": "torch copy", "threads": 1, **r})
    for r in results:
        rows.append(
            [r["main_thread"], r["source"], r["copy"], r["threads"], r["wall_ms"], r["cpu_ms"], r["max_wall_ms"]]
        )
    print_table(
        ["main thread", "source", "copy", "intra-op threads", f"{args.batch} copies wall ms", "CPU ms", "max wall ms"],
        rows,
        floatfmt=".2f",
    )
    path = write_json(
        args.output, "slot_copy", {"device": args.device, "size": args.size, "batch": args.batch, "results": results}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

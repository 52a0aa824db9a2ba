"""Can DLO copy straight out of a runtime-cache entry? Page-locking a file mapping in place.

A consumer of the runtime cache streams blocks from a read-only mapping of the entry through two
pinned staging buffers: a CPU copy of every block at every step (docs/PERFORMANCE.md, runtime-weight
cache: throughput 0.6x of private weights). Registering the mapping itself with cudaHostRegister
would let each H2D copy be DMA from the page cache. This measures, for one file of `--gb` GB of
random bytes, per variant (private / shared mapping; default / read-only flag; the whole file at
once / `--chunk-mb` pieces):
  - seconds to register and to unregister, or the CUDA error;
  - H2D bandwidth from the registered mapping (1 GiB copies) against a pinned buffer's;
  - the process's anonymous and private-dirty memory before and after (a pin that copies the
    pages of a private mapping would show here as new private memory, losing the sharing).

Run on a GPU:  python -m bench.investigations.host_register --gb 24 --dir /tmp
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_output, print_table, write_json
from stagemesh.stage_service.platform import REGISTER_READ_ONLY, clear_cuda_error

GIB = 1 << 30


def _rollup() -> dict[str, int]:
    """Anonymous and Private_Dirty bytes of this process (smaps_rollup)."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Anonymous", "Private_Dirty", "Rss"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _write_random(path: Path, nbytes: int) -> None:
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        os.fsync(f.fileno())


def _h2d(src: torch.Tensor, device: torch.device, piece: int, repeats: int = 4) -> float:
    """H2D bandwidth of copies that each stay inside one registered piece: a copy spanning two
    registrations fails (cudaErrorInvalidValue, seen on the H200)."""
    n = min(GIB, piece)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev.copy_(src[:n], non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for k in range(repeats):
        off = (k % (src.numel() // piece)) * piece
        dev.copy_(src[off : off + n], non_blocking=True)
    torch.cuda.synchronize(device)
    return n * repeats / (time.perf_counter() - start)


def variant(path: Path, shared: bool, flags: int, chunk: int, device: torch.device) -> dict:
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=shared, nbytes=size)
    data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    cudart = torch.cuda.cudart()
    before = _rollup()
    ranges = [(o, min(chunk, size - o)) for o in range(0, size, chunk)] if chunk else [(0, size)]
    start, done, error = time.perf_counter(), [], None
    for off, n in ranges:
        rc = int(cudart.cudaHostRegister(data.data_ptr() + off, n, flags))
        if rc:
            error = f"cudaHostRegister -> {rc} at offset {off}"
            clear_cuda_error()
            break
        done.append(off)
    register_s = time.perf_counter() - start
    after = _rollup()
    bandwidth = _h2d(data, device, chunk or size) if error is None else None
    start = time.perf_counter()
    for off in done:
        cudart.cudaHostUnregister(data.data_ptr() + off)
    unregister_s = time.perf_counter() - start
    return {
        "mapping": "shared" if shared else "private",
        "flags": flags,
        "chunk_mb": chunk >> 20,
        "register_s": register_s,
        "unregister_s": unregister_s,
        "error": error,
        "h2d_bytes_per_s": bandwidth,
        "new_anonymous_bytes": after.get("Anonymous", 0) - before.get("Anonymous", 0),
        "new_private_dirty_bytes": after.get("Private_Dirty", 0) - before.get("Private_Dirty", 0),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=24.0, help="file size in GB (GiB multiples of 256 MiB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file is written")
    parser.add_argument("--chunk-mb", type=int, default=256, help="piece size of the chunked variants")
    add_output(parser, "host_register", "--json")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: cudaHostRegister is what is measured")
    device = torch.device("cuda", torch.cuda.current_device())
    path = Path(args.dir) / "stagemesh-host-register.bin"
    _write_random(path, int(args.gb * GIB) // (256 << 20) * (256 << 20))
    pinned = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    peer = _h2d(pinned, device, GIB)
    del pinned
    rows = []
    try:
        for shared in (True, False):  # shared first: what a runtime-cache consumer maps
            for flags in (REGISTER_READ_ONLY, 0):
                for chunk in (0, args.chunk_mb << 20):
                    rows.append(variant(path, shared, flags, chunk, device))
                    print(rows[-1], flush=True)
    finally:
        path.unlink()
    print_table(
        [
            "mapping",
            "flags",
            "chunk MB",
            "register s",
            "unregister s",
            "H2D GB/s",
            "x pinned",
            "new anon GB",
            "new dirty GB",
            "error",
        ],
        [
            [
                r["mapping"],
                r["flags"],
                r["chunk_mb"] or "whole",
                f"{r['register_s']:.2f}",
                f"{r['unregister_s']:.2f}",
                "-" if r["h2d_bytes_per_s"] is None else f"{r['h2d_bytes_per_s'] / 1e9:.1f}",
                "-" if r["h2d_bytes_per_s"] is None else f"{r['h2d_bytes_per_s'] / peer:.2f}",
                f"{r['new_anonymous_bytes'] / 1e9:.2f}",
                f"{r['new_private_dirty_bytes'] / 1e9:.2f}",
                r["error"] or "",
            ]
            for r in rows
        ],
    )
    path_out = write_json(
        args.output, "host_register", {"file_bytes": int(args.gb * GIB), "pinned_h2d_bytes_per_s": peer, "rows": rows}
    )
    print(f"pinned H2D {peer / 1e9:.1f} GB/s; wrote {path_out}")


if __name__ == "__main__":
    main()

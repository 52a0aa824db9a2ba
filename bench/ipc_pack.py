"""Pack + unpack throughput of stage_service.transport.ipc against a plain memcpy of the same bytes.

The packer copies a tensor into a new shared-memory segment and the reader copies it out and
unlinks it: two copies plus segment set-up, so the physical floor is half of memcpy's rate
(target: >= 0.5 x memcpy). Run: python -m bench.ipc_pack
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.stage_service.transport import ipc

SIZES = {"1 MB": 1_000_000, "16 MB": 16_000_000, "256 MB": 256_000_000}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up (first touch of fresh pages is part of every real pack, so keep it in the timing)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(nbytes: int, repeats: int) -> dict[str, float]:
    # Random data, never zeros: zero pages can be cheaper than real ones.
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    memcpy_s = _median_s(lambda: dst.copy_(src), repeats)
    clone_s = _median_s(lambda: src.clone(), repeats)
    out = {"bytes": nbytes, "memcpy_gbps": nbytes / memcpy_s / 1e9, "clone_gbps": nbytes / clone_s / 1e9}
    # The worker's packer (reusable slots) and a packer making one segment per tensor.
    for label, slots in (("pooled", ipc.WORKER_POOL_SLOTS), ("one_shot", 0)):
        packer = ipc.Packer(owner_pid=os.getpid(), rank=0, pool_slots=slots)

        def round_trip(packer: ipc.Packer = packer) -> None:
            result = ipc.unpack(packer.pack(src))
            assert result.numel() == nbytes

        seconds = _median_s(round_trip, repeats)
        check = ipc.unpack(packer.pack(src))
        assert torch.equal(check, src)
        del check
        packer.close()
        out[f"{label}_gbps"] = nbytes / seconds / 1e9
        out[f"{label}_vs_memcpy"] = memcpy_s / seconds
    ipc.sweep(os.getpid())
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    add_repeats(parser, 9, "timed runs per figure; figures are medians (default: 9)")
    add_output(parser, "ipc_pack")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # the worker's packing thread is one thread; compare like with like
    results, rows = {}, []
    for label, nbytes in SIZES.items():
        r = measure(nbytes, args.repeats)
        results[label] = r
        rows.append(
            [
                label,
                r["memcpy_gbps"],
                r["clone_gbps"],
                r["pooled_gbps"],
                r["pooled_vs_memcpy"],
                r["one_shot_gbps"],
                r["one_shot_vs_memcpy"],
            ]
        )
    print_table(
        [
            "size",
            "memcpy GB/s",
            "clone GB/s",
            "pooled pack+unpack GB/s",
            "pooled / memcpy (target >= 0.5)",
            "one-shot GB/s",
            "one-shot / memcpy",
        ],
        rows,
        floatfmt=".2f",
    )
    print(f"wrote {write_json(args.output, 'ipc_pack', {'results': results})}")


if __name__ == "__main__":
    main()

"""How fast the host launches the (launch-bound) default DiT from each CPU core.

bench/async_output.py sees the bare forward rate move by tens of percent between rounds and the
serving worker's forward run slower than the same forward in the benchmark's process. A
launch-bound forward runs at the speed of the one thread that issues its kernels, and on a
multi-socket host that speed depends on where the thread runs (its distance to the GPU's PCIe
root, its cache). This pins the launching thread to each allowed core in turn and measures the
forward rate there, in several interleaved passes, next to the GPU's local cores as the kernel
reports them (/sys/bus/pci/devices/<gpu>/local_cpulist). Run on a GPU:
  python -m bench.investigations.launch_affinity
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from bench.serving import Forward
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import ensure_model_dir


def parse_cpulist(text: str) -> set[int]:
    """The kernel's cpulist format ("0-7,16-23") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_local_cpus(device: str) -> set[int] | None:
    """The CPUs on the GPU's NUMA node, as the kernel reports for its PCIe device."""
    if not device.startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(torch.device(device).index or 0)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    try:
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{address}/local_cpulist").read_text()) or None
    except (OSError, ValueError):
        return None


def numa_node(cpu: int) -> int | None:
    for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"):
        return int(entry.name[4:])
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8, help="forward passes per core and repeat")
    add_repeats(parser, 3, "interleaved passes over the cores (default: 3)", "--passes")
    add_output(parser, "launch_affinity")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    cpus = sorted(os.sched_getaffinity(0))
    local = gpu_local_cpus(args.device)
    # The eager forward: the one whose speed is the launching thread's.
    forward = Forward(model_dir, args.device, args.size, args.batch, args.steps, cuda_graphs=False)
    rates: dict[int, list[float]] = {c: [] for c in cpus}
    unpinned = []
    for _ in range(args.repeats):
        os.sched_setaffinity(0, cpus)
        unpinned.append(forward.rate(args.iters)[0])
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            time.sleep(0.01)
            rates[cpu].append(forward.rate(args.iters)[0])
    os.sched_setaffinity(0, cpus)
    rows = [
        [cpu, numa_node(cpu), "yes" if local and cpu in local else "no", statistics.median(r), min(r), max(r)]
        for cpu, r in rates.items()
    ]
    rows.append(["any", None, "", statistics.median(unpinned), min(unpinned), max(unpinned)])
    print(f"GPU-local cores: {sorted(local) if local else 'unknown'}")
    print_table(["core", "NUMA node", "GPU-local", "forward req/s (median)", "min", "max"], rows, floatfmt=".1f")
    path = write_json(
        args.output,
        "launch_affinity",
        {
            "device": args.device,
            "size": args.size,
            "batch": args.batch,
            "local_cpus": sorted(local or []),
            "per_cpu": {str(c): r for c, r in rates.items()},
            "unpinned": unpinned,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

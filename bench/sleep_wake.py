"""Sleep and wake of a stage holding >= 20 GB of bf16 weights, against the copy bandwidth of
pinned memory measured in the same run, and a naive module.to("cpu") / module.to("cuda").

One run measures, in order:
  1. pinned copy bandwidth each way (torch pinned buffers, 4 GiB): the floor;
  2. the first level-1 sleep with sleep_host_buffer = "first_sleep": the buffer is faulted in
     and page-locked while the copy runs; against the lazy floor (5.6 s per 20 GB, the fault-in
     and cudaHostRegister of such a buffer measured on the H200);
  3. the buffer prepared ahead ("at_start"): how long that takes and the host memory it holds,
     then the first level-1 sleep and wake;
  4. --warmup + --cycles sleep/wake cycles alternating level 2 and level 1 (level-2 wakes from
     a page-cache-hot checkpoint), with RSS and device memory in use after every wake;
  5. a level-2 wake from a cold page cache (caches dropped where root may, else the file evicted
     with posix_fadvise; the fraction still resident is printed);
  6. the naive path (--no-naive skips it).
Targets (CUDA): the first level-1 sleep with the buffer prepared ahead, later level-1 sleeps and
every wake >= 0.8 x pinned bandwidth; the lazy first sleep within its floor; RSS and device
memory flat within 2 % over the cycles. Prints PASS/FAIL for each, writes JSON, exits 1 when one
is missed. On the CPU (--device cpu --gib 0.05 --dim 1024) it checks the code path only.

Run on a GPU: python bench/sleep_wake.py --gib 20
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json
from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.worker import host_pages
from stagemesh.stage_service.worker.sleep import SleepController
from stagemesh.weight_store.safetensors_writer import write_streamed

TARGET = 0.8  # of pinned bandwidth
FLAT = 0.02  # RSS and device memory over the cycles
LAZY_FLOOR_S_PER_GB = 5.6 / 20  # fault-in 3.3 s + cudaHostRegister 2.0 s (+ the copy) per 20 GB, H200


def build_model(gib: float, dim: int, device: str) -> nn.Module:
    per_layer = dim * dim * 2
    layers = max(1, int(gib * 2**30 // per_layer))
    model = nn.ModuleList(nn.Linear(dim, dim, bias=True, device="meta", dtype=torch.bfloat16) for _ in range(layers))
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)  # never time on zeros
    return model


def sync(device: str) -> None:
    if platform.is_cuda(device):
        torch.cuda.synchronize(device)


def timed(device: str, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def floor_bandwidth(device: str, nbytes: int) -> tuple[float, float]:
    """Bytes/s host->device and device->host: pinned memory on a GPU, a plain memcpy on the CPU."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=platform.is_cuda(device))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.random_()
    results = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        seconds = timed(device, lambda d=dst, s=src: [d.copy_(s, non_blocking=True) for _ in range(3)])
        results.append(3 * nbytes / seconds)
    del host, dev
    if platform.is_cuda(device):
        torch.cuda.empty_cache()
    return results[0], results[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def device_used(device: str) -> int | None:
    if not platform.is_cuda(device):
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# ---- the page cache -------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore); None where that cannot be read."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        ok = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    if not ok:
        return None
    flags = bytes(vec)
    return 1 - flags.count(0) / pages


def evict(path: Path) -> str:
    """Drop the file from the page cache as far as this process may; says how."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches + posix_fadvise(DONTNEED)"
    except OSError as exc:
        print(f"cannot drop caches ({exc.strerror}): the file was evicted with posix_fadvise(DONTNEED) only")
        return "posix_fadvise(DONTNEED)"


def read_through(path: Path) -> None:
    with open(path, "rb") as f:  # page-cache hot, as after a recent load
        while f.read(1 << 26):
            pass


# ---- the parts ------------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = args.device
        self.piece_bytes = args.piece_mib << 20
        self.cuda = platform.is_cuda(self.device)
        self.h2d, self.d2h = floor_bandwidth(self.device, min(4 << 30, int(args.gib * 2**30)))
        self.model = build_model(args.gib, args.dim, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.ckpt = Path(args.dir or tempfile.mkdtemp()) / "model.safetensors"
        state = self.model.state_dict()
        write_streamed(self.ckpt, [(k, tuple(v.shape), v.dtype) for k, v in state.items()], state.values())
        del state  # it references the weights' storage: holding it would keep them on the device
        read_through(self.ckpt)
        self.reference = self.model[0].weight[:4, :8].float().cpu().clone()
        self.report: dict = {
            "device": self.device,
            "weight_bytes": self.weight_bytes,
            "pinned_h2d_bytes_per_s": self.h2d,
            "pinned_d2h_bytes_per_s": self.d2h,
        }
        self.checks: list[tuple[str, float, str, bool]] = []

    def files(self) -> list[WeightFile]:
        return [WeightFile(self.ckpt, {"": self.model})]

    def x_d2h(self, seconds: float) -> float:
        return self.weight_bytes / seconds / self.d2h

    def x_h2d(self, seconds: float) -> float:
        return self.weight_bytes / seconds / self.h2d

    def same_weights(self) -> None:
        assert torch.equal(self.model[0].weight[:4, :8].float().cpu(), self.reference), "weights changed"

    def check(self, what: str, value: float, target: str, ok: bool) -> None:
        self.checks.append((what, value, target, ok))

    def lazy_first_sleep(self) -> list:
        controller = SleepController(self.files(), self.device, piece_bytes=self.piece_bytes)  # "first_sleep"
        sleep_s = timed(self.device, lambda: controller.sleep(1))
        stats = controller.host_stats()
        wake_s = timed(self.device, controller.wake)
        self.same_weights()
        controller.close()
        gb = self.weight_bytes / 1e9
        self.report["lazy"] = {"sleep_s": sleep_s, "wake_s": wake_s, **stats}
        self.check(
            "first level-1 sleep, lazy (s per GB)",
            sleep_s / gb,
            f"<= {LAZY_FLOOR_S_PER_GB:.3f}",
            sleep_s / gb <= LAZY_FLOOR_S_PER_GB,
        )
        return [
            ["level 1 sleep, first, lazy buffer", sleep_s, self.weight_bytes / sleep_s / 1e9, self.x_d2h(sleep_s)],
            [f"  (fault-in {stats['fault_s']:.3f} s wall, locking {stats['lock_s']:.3f} s on threads)", "", "", ""],
            ["level 1 wake after it", wake_s, self.weight_bytes / wake_s / 1e9, self.x_h2d(wake_s)],
        ]

    def prepared_first_sleep(self) -> tuple[SleepController, list]:
        started = time.perf_counter()
        controller = SleepController(self.files(), self.device, host_buffer="at_start", piece_bytes=self.piece_bytes)
        prepare_s = time.perf_counter() - started
        stats = controller.host_stats()
        sleep_s = timed(self.device, lambda: controller.sleep(1))
        wake_s = timed(self.device, controller.wake)
        self.same_weights()
        self.report["prepared"] = {"prepare_s": prepare_s, "sleep_s": sleep_s, "wake_s": wake_s, **stats}
        self.check(
            "first level-1 sleep, buffer prepared (x D2H)",
            self.x_d2h(sleep_s),
            f">= {TARGET}",
            self.x_d2h(sleep_s) >= TARGET,
        )
        self.check("level-1 wake (x H2D)", self.x_h2d(wake_s), f">= {TARGET}", self.x_h2d(wake_s) >= TARGET)
        held = controller.host_bytes
        return controller, [
            [f"prepare the buffer at start ({held / 1e9:.2f} GB held)", prepare_s, held / prepare_s / 1e9, ""],
            ["level 1 sleep, first, buffer prepared", sleep_s, self.weight_bytes / sleep_s / 1e9, self.x_d2h(sleep_s)],
            ["level 1 wake", wake_s, self.weight_bytes / wake_s / 1e9, self.x_h2d(wake_s)],
        ]

    def cycles(self, controller: SleepController) -> list:
        rows, samples = [], []
        for n in range(self.args.warmup + self.args.cycles):
            level = 2 - n % 2
            sleep_s = timed(self.device, lambda lv=level: controller.sleep(lv))
            wake_s = timed(self.device, controller.wake)
            controller.settle()  # a level-2 wake's unlocking, off the wake's path, is done
            self.same_weights()
            fill = controller.fill_stats() if level == 2 else {}
            sample = {
                "level": level,
                "sleep_s": sleep_s,
                "wake_s": wake_s,
                "rss": rss_bytes(),
                "device_used": device_used(self.device),
                **{f"fill_{k}": v for k, v in fill.items()},
            }
            if n >= self.args.warmup:
                samples.append(sample)
            used = sample["device_used"]
            rows.append(
                [
                    n,
                    level,
                    sleep_s,
                    self.x_d2h(sleep_s) if level == 1 else "-",
                    wake_s,
                    self.x_h2d(wake_s),
                    sample["rss"] / 1e9,
                    "-" if used is None else used / 1e9,
                    "warm-up" if n < self.args.warmup else "",
                ]
            )
        self.report["cycles"] = samples
        self._cycle_checks(samples)
        return rows

    def _cycle_checks(self, samples: list[dict]) -> None:
        by_level = {lv: [s for s in samples if s["level"] == lv] for lv in (1, 2)}
        later_sleep = statistics.median(self.x_d2h(s["sleep_s"]) for s in by_level[1])
        wake1 = statistics.median(self.x_h2d(s["wake_s"]) for s in by_level[1])
        wake2 = [self.x_h2d(s["wake_s"]) for s in by_level[2]]
        self.check("later level-1 sleeps, median (x D2H)", later_sleep, f">= {TARGET}", later_sleep >= TARGET)
        self.check("later level-1 wakes, median (x H2D)", wake1, f">= {TARGET}", wake1 >= TARGET)
        self.check(
            f"level-2 wake, hot, median (x H2D; min {min(wake2):.3f})",
            statistics.median(wake2),
            f">= {TARGET}",
            statistics.median(wake2) >= TARGET,
        )
        for key in ("rss", "device_used"):
            series = [s[key] for s in samples if s[key] is not None]
            if series:
                spread = max(abs(v / series[0] - 1) for v in series)
                self.check(f"{key} over {len(series)} cycles (max change)", spread, f"<= {FLAT}", spread <= FLAT)

    def level_2_breakdown(self) -> str:
        hot = [s for s in self.report["cycles"] if s["level"] == 2]
        if not hot:
            return ""

        def med(key: str) -> float:
            return statistics.median(s.get(key, 0.0) for s in hot)

        return (
            f"level-2 hot wake, median: {med('fill_locked_bytes') / 1e9:.2f} GB copied from locked pieces, "
            f"{med('fill_staged_bytes') / 1e9:.2f} GB staged; locking {med('fill_lock_s'):.3f} s summed over "
            f"{host_pages.LOCK_THREADS} threads; unlocking {med('fill_unlock_s'):.3f} s after the wake returned"
        )

    def cold_wake(self, controller: SleepController) -> list:
        controller.sleep(2)
        how = evict(self.ckpt)
        resident = resident_fraction(self.ckpt)
        wake_s = timed(self.device, controller.wake)
        controller.settle()
        self.same_weights()
        self.report["cold"] = {
            "wake_s": wake_s,
            "evicted_by": how,
            "resident_before": resident,
            **controller.fill_stats(),
        }
        shown = "unknown" if resident is None else f"{resident:.1%}"
        if resident is None or resident > 0.1:
            print(f"the cold figure is not from a cold cache: {shown} of the checkpoint stayed resident")
        return [
            [
                f"level 2 wake, cold ({shown} resident; {how})",
                wake_s,
                self.weight_bytes / wake_s / 1e9,
                self.x_h2d(wake_s),
            ]
        ]

    def naive(self) -> list:
        to_cpu = timed(self.device, lambda: self.model.to("cpu"))
        to_dev = timed(self.device, lambda: self.model.to(self.device))
        return [
            ["naive module.to('cpu')", to_cpu, self.weight_bytes / to_cpu / 1e9, self.x_d2h(to_cpu)],
            [f"naive module.to('{self.device}')", to_dev, self.weight_bytes / to_dev / 1e9, self.x_h2d(to_dev)],
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=20.0, help="weights to hold, GiB of bf16")
    parser.add_argument("--dim", type=int, default=8192, help="each weight is dim x dim (8192: 128 MiB, FLUX-like)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cycles", type=int, default=20, help="measured sleep/wake cycles (levels 2 and 1 in turn)")
    parser.add_argument("--warmup", type=int, default=2, help="cycles before them, not counted")
    parser.add_argument("--no-naive", dest="naive", action="store_false", help="skip module.to() (about a minute)")
    parser.add_argument("--piece-mib", type=int, default=host_pages.PIECE_BYTES >> 20, help="unit of locking")
    parser.add_argument("--lock-threads", type=int, default=host_pages.LOCK_THREADS, help="threads locking pieces")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--output", default="bench/results/sleep_wake.json")
    args = parser.parse_args()
    host_pages.LOCK_THREADS = args.lock_threads  # a study of the driver's concurrency, not a setting
    run = Run(args)
    try:
        rows = run.lazy_first_sleep()
        gc.collect()
        controller, prepared = run.prepared_first_sleep()
        rows += prepared
        cycle_rows = run.cycles(controller)
        rows += run.cold_wake(controller)
        run.report["host_bytes_held"] = controller.host_bytes
        controller.close()
        if args.naive:
            rows += run.naive()
    finally:
        run.ckpt.unlink(missing_ok=True)
    gb, h2d, d2h = run.weight_bytes / 1e9, run.h2d / 1e9, run.d2h / 1e9
    print(f"weights {gb:.2f} GB bf16 on {run.device}; pinned H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    print_table(["operation", "seconds", "GB/s", "x pinned bandwidth"], rows, floatfmt=".3f")
    print_table(
        ["cycle", "level", "sleep s", "x D2H", "wake s", "x H2D", "RSS GB", "device GB", ""], cycle_rows, floatfmt=".3f"
    )
    print(f"host memory held by the level-1 buffer when prepared ahead: {run.report['host_bytes_held'] / 1e9:.2f} GB")
    print(run.level_2_breakdown())
    missed = [c for c in run.checks if not c[3]]
    print_table(
        ["target", "value", "bound", "result"],
        [[w, v, t, "PASS" if ok else "FAIL"] for w, v, t, ok in run.checks],
        floatfmt=".3f",
    )
    run.report["rows"] = [[str(c) for c in r] for r in rows]
    run.report["checks"] = [{"what": w, "value": v, "bound": t, "pass": ok} for w, v, t, ok in run.checks]
    print(f"wrote {write_json(args.output, 'sleep_wake', run.report)}")
    if run.cuda and missed:
        print(f"{len(missed)} target(s) missed")
        sys.exit(1)
    print("all targets met" if run.cuda else "CPU run: the code path only, no targets")


if __name__ == "__main__":
    main()
